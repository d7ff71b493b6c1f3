/* Weight formats the linear kernels read, and how each one decodes to the model's values.
 *
 * A weight is a (N, K) matrix — N output columns, K inputs — held in one of these layouts
 * (`d3d_weight.format`; mirrored by WEIGHT_FORMATS in d3d/kernels/binding.py):
 *
 *   PLAIN   the dtype's own (N, K) row-major matrix (bf16 or fp32);
 *   PACKED  the AVX-512 column-packed copy of a PLAIN matrix (see linear.h);
 *   LANE_PACKED  the AVX2 copy of a bf16 PLAIN matrix for its lanes (linear.h's lane-packed tiles), K a
 *           multiple of 16: per 16 output columns (N zero-padded to a multiple of 16) and per lane
 *           l = 0…15, the steps j = 0…K/16−1 of 16 bf16 each — the columns' weights at k = 16j + l in
 *           the order 0–3, 8–11, 4–7, 12–15 (what vpunpck{l,h}wd with zeros widens to 0–7 and 8–15);
 *   U4      GGUF Q4_1 and Q4_K, repacked at load: per 32 weights of a row, an fp32 scale s, an
 *           fp32 offset o and 16 bytes of 4-bit codes q (byte j holds weight j in its low nibble,
 *           weight j + 16 in its high one); the weight is bf16(fma(s, q, o));
 *   S4      GGUF Q4_0: per 32 weights an fp32 scale s and 16 bytes of codes as U4's; the weight is
 *           bf16(s·(q − 8)) — not fma(s, q, −8s), whose zero is +0 where the reference's is −0;
 *   I8      GGUF Q8_0: per 32 weights an fp32 scale s and 32 signed bytes q; the weight is bf16(s·q);
 *   U6      GGUF Q6_K: per 32 weights two fp32 scales (one per 16), 16 bytes of low nibbles laid
 *           out as U4's and 8 bytes of high bit pairs (byte i holds weight 8j + i's in bits 2j, 2j+1);
 *           q = (low | high << 4) − 32 and the weight is bf16(s·q).
 *   G4, G8  U4 and I8 blocks of 16 rows at a time, interleaved for the packed pair dot products of
 *           AVX-512 BF16 (linear.h's grouped linear): per 16 output columns and 32 weights, the 16
 *           scales (and offsets), then per pair of weights k = 2p, 2p+1 the codes of all 16 columns
 *           in the packed layout's lane order — lane l of the first half is column l/2 at k = 2p +
 *           l%2, of the second half column 8 + l/2 (G4: one byte per lane pair, first half in the low
 *           nibble; G8: 16 bytes per half). The same values, decoded by the same operations.
 *   A4      U4 blocks for the AMX tiles' first operand (amx.h; made where the tiles are on): per quad
 *           of 16-column groups (64 columns, the last quad as many as remain) and per 32 weights,
 *           each column's block_u4 in column order, its codes placed for vpmultishiftqb — weight k's
 *           nibble at bit 64·((k/4) mod 2) + 4·(4·(k/8) + k mod 4) of the 16 bytes. The same values,
 *           decoded as a lookup in the block's table of its 16.
 *   QL      U4 blocks in quads for the AVX-512 BF16 lookups (linear.h's quads; where the AMX tiles are off): a quad is 4
 *           output columns, a run 8 quads (32 columns, the last zero-padded); per run and per 32
 *           weights, its 8 quads' block_ql — the 4 columns' scales and offsets, then the 128 codes in
 *           32 words: the code of word w of the quad's vector at step s (column w/8, weight
 *           8·s + w mod 8) is bits 4·s … 4·s + 3 of word w. The same values, decoded as a lookup
 *           in the quad's 4 tables of 16 — through the quads' chains (linear.h), at every row count.
 *   QS      S4 blocks in quads, as QL (each offset −0, the table's codes q − 8: s·(q − 8), as S4's).
 *   QUAD_PACKED  the bf16 values of a QL or QS weight for its calls of many rows: per 16 output columns (N
 *           zero-padded) and per step of 8 weights, the 4 quads' vectors as above (128 bf16).
 *   T4      U4 and S4 blocks as tables, for AVX2 builds' calls of a few rows (linear.h's lanes; made where
 *           the lanes read them): per 32 weights the block's 16 values as bf16 — their low bytes, then
 *           their high bytes — and 16 bytes of codes placed for the lookup (decode_t4); the 4 rows
 *           of each block of 4 side by side, block by block, so that a thread's columns are one
 *           stream. A weight's runs of U4 or S4 rows, each zero-padded to a multiple of 4 rows, one
 *           after another (its runs in other formats keep their blocks). Twice U4's bytes, a third
 *           of the operations: a one-token step's decode is the bound on AVX2, its bytes no longer.
 *
 * Each quantized value is the GGUF reference dequantization (gguf-py's, which transformers and
 * so d3d's loader use) rounded to bf16, by construction: the reference computes d·q + m (Q4_1),
 * d·(q − 8) (Q4_0), (d·sc)·q − dmin·m (Q4_K), x·d (Q8_0) and (d·sc)·q (Q6_K) in fp32, one rounding
 * per operation. Where the reference's product is exact in fp32 (4-bit codes times an fp16 scale,
 * or a 6-bit sub-scale times one), its two roundings are the single rounding of an fma; the
 * repacked scale and offset are those exact products, computed once at load. The loader checks
 * every block against the weights it loaded anyway (d3d_dequantize) before a format is used.
 *
 * The bf16 rounding: round to nearest even, as torch's .to(bfloat16). The vector decoders use
 * Veltkamp's split, c = v·65537, v' = c − (c − v), which rounds v to 8 significant bits, nearest
 * even, for every |v| in [1e-30, 1e30] (checked exhaustively over all floats in that range) — and
 * every decoded weight is 0 or at least 2^-24 in magnitude, being a sum of fp16 multiples.
 */

enum { D3D_PLAIN = 0, D3D_PACKED = 1, D3D_U4 = 2, D3D_I8 = 3, D3D_U6 = 4, D3D_S4 = 5, D3D_G4 = 6, D3D_G8 = 7, D3D_A4 = 8, D3D_LANE_PACKED = 9, D3D_T4 = 10, D3D_QL = 12, D3D_QUAD_PACKED = 13, D3D_QS = 14 };

#define CHUNK 32  /* weights of a row per block of every quantized format */

typedef struct { float scale, offset; uint8_t q[16]; } block_u4;
typedef struct { float scale; int8_t q[32]; } block_i8;
typedef struct { float scale[2]; uint8_t low[16], high[8]; } block_u6;
typedef struct { float scale; uint8_t q[16]; } block_s4;
typedef struct { float scale[16], offset[16]; uint8_t q[16][16]; } block_g4;  /* 16 rows of block_u4 */
typedef struct { float scale[4], offset[4]; uint8_t q[64]; } block_ql;  /* a quad's 4 columns, 32 weights */
typedef struct { float scale[16]; int8_t q[16][32]; } block_g8;  /* 16 rows of block_i8 */
typedef struct { uint8_t low[16], high[16], q[16]; } block_t4;  /* a U4 or S4 block as its table */

/* What the linear kernels are handed for one weight: up to MAX_PARTS runs of rows, each in its
 * own format (a fused q|k|v projection whose parts a GGUF quantized differently, as Q4_K_M files
 * do). Every run but the last holds a multiple of 4 rows; a plain or packed weight is one run. */
#define MAX_PARTS 3
typedef struct {
    const void *data;
    int64_t format, rows;
} d3d_part;
typedef struct {
    d3d_part parts[MAX_PARTS];
    /* For quantized parts, the same weight as bf16 values (plain or packed, one part) or NULL:
     * what a call of several rows reads instead. The values are the parts' decoding and the
     * reduction is the same, so a row's bits do not change — but past one row the arithmetic, not
     * the bytes, bounds a call, and widening bf16 costs less than decoding blocks. */
    d3d_part dense;
    /* For U4 or I8 parts, the same blocks grouped 16 rows at a time (G4 or G8, one part), or NULL:
     * what calls of up to GROUPED_ROWS rows read where the build takes packed pair dot products (AVX-512 BF16). */
    d3d_part grouped;
} d3d_weight;

static inline int is_quantized(int64_t format) { return format >= D3D_U4 && format <= D3D_S4; }
static inline int is_4bit(int64_t format) { return format == D3D_U4 || format == D3D_S4; }

static inline int64_t block_bytes(int64_t format) {
    return format == D3D_U4 ? (int64_t)sizeof(block_u4) : format == D3D_I8 ? (int64_t)sizeof(block_i8)
         : format == D3D_U6 ? (int64_t)sizeof(block_u6) : format == D3D_T4 ? (int64_t)sizeof(block_t4)
         : (int64_t)sizeof(block_s4);
}

/* The part holding row n, and n's index within it. */
static inline const d3d_part *part_of(const d3d_weight *w, int64_t *n) {
    int p = 0;
    while (p + 1 < MAX_PARTS && *n >= w->parts[p].rows && w->parts[p + 1].rows) *n -= w->parts[p++].rows;
    return &w->parts[p];
}

/* Block b of row n of a quantized weight (K wide), and its format. */
static inline const void *block_at(const d3d_weight *w, int64_t n, int64_t b, int64_t K, int64_t *format) {
    const d3d_part *part = part_of(w, &n);
    *format = part->format;
    return (const char *)part->data + (n * (K / CHUNK) + b) * block_bytes(part->format);
}

static inline int nibble(const uint8_t *q, int e) { return e < 16 ? q[e] & 15 : q[e - 16] >> 4; }

/* A U4 or S4 block as T4: its table — code c's value, bf16(fma(s, c, o)) or bf16(s·(c − 8)) as
 * decode_block_scalar computes it — and weight e's code at the place decode_t4 reads it from:
 * vector v = e / 8 of the block's four, lane j = e % 8, i.e. the low (j < 4) or high nibble of byte
 * 8·(v / 2) + 2·(j % 4) + v % 2. */
static void table_block(int64_t format, const void *block, block_t4 *out) {
    const uint8_t *q = format == D3D_U4 ? ((const block_u4 *)block)->q : ((const block_s4 *)block)->q;
    for (int c = 0; c < 16; c++) {
        float v = format == D3D_U4 ? fmaf(((const block_u4 *)block)->scale, (float)c, ((const block_u4 *)block)->offset)
                                   : ((const block_s4 *)block)->scale * (float)(c - 8);
        uint16_t bits = f32_to_bf16(v);
        out->low[c] = (uint8_t)bits, out->high[c] = (uint8_t)(bits >> 8);
    }
    memset(out->q, 0, sizeof out->q);
    for (int e = 0; e < CHUNK; e++) {
        int v = e / 8, j = e % 8;
        out->q[8 * (v / 2) + 2 * (j % 4) + v % 2] |= (uint8_t)(nibble(q, e) << (4 * (j / 4)));
    }
}

static void decode_block_scalar(int64_t format, const void *block, float out[CHUNK]) {
    if (format == D3D_U4) {
        const block_u4 *b = block;
        for (int e = 0; e < CHUNK; e++) out[e] = bf16_to_f32(f32_to_bf16(fmaf(b->scale, (float)nibble(b->q, e), b->offset)));
    } else if (format == D3D_I8) {
        const block_i8 *b = block;
        for (int e = 0; e < CHUNK; e++) out[e] = bf16_to_f32(f32_to_bf16(b->scale * (float)b->q[e]));
    } else if (format == D3D_S4) {
        const block_s4 *b = block;
        for (int e = 0; e < CHUNK; e++) out[e] = bf16_to_f32(f32_to_bf16(b->scale * (float)(nibble(b->q, e) - 8)));
    } else {
        const block_u6 *b = block;
        for (int e = 0; e < CHUNK; e++) {
            int q = (nibble(b->low, e) | (((b->high[e % 8] >> (2 * (e / 8))) & 3) << 4)) - 32;
            out[e] = bf16_to_f32(f32_to_bf16(b->scale[e / 16] * (float)q));
        }
    }
}

#ifdef D3D_AVX2
/* Decoders: 32 weights (one block, or 32 plain elements) → 4 vectors of 8 in k order. */
static inline __attribute__((always_inline)) void decode_u4(const void *block, v8 out[4]) {
    const block_u4 *b = block;
    v8 s = v8_splat(&b->scale), o = v8_splat(&b->offset);
    __m256i lo = v8_bytes(b->q), hi = v8_bytes(b->q + 8), f = _mm256_set1_epi32(15);
    out[0] = v8_round_bf16(v8_fma(s, _mm256_cvtepi32_ps(_mm256_and_si256(lo, f)), o));
    out[1] = v8_round_bf16(v8_fma(s, _mm256_cvtepi32_ps(_mm256_and_si256(hi, f)), o));
    out[2] = v8_round_bf16(v8_fma(s, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), o));
    out[3] = v8_round_bf16(v8_fma(s, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), o));
}
static inline __attribute__((always_inline)) void decode_i8(const void *block, v8 out[4]) {
    const block_i8 *b = block;
    v8 s = v8_splat(&b->scale);
    for (int j = 0; j < 4; j++)
        out[j] = v8_round_bf16(_mm256_mul_ps(s, _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b->q + 8 * j))))));
}
static inline __attribute__((always_inline)) void decode_s4(const void *block, v8 out[4]) {
    const block_s4 *b = block;
    v8 s = v8_splat(&b->scale);
    __m256i lo = v8_bytes(b->q), hi = v8_bytes(b->q + 8), f = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    __m256i q[4] = {_mm256_and_si256(lo, f), _mm256_and_si256(hi, f), _mm256_srli_epi32(lo, 4), _mm256_srli_epi32(hi, 4)};
    for (int j = 0; j < 4; j++) out[j] = v8_round_bf16(_mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], eight))));
}
static inline __attribute__((always_inline)) void decode_u6(const void *block, v8 out[4]) {
    const block_u6 *b = block;
    __m256i lo = v8_bytes(b->low), hi = v8_bytes(b->low + 8), top = v8_bytes(b->high);
    __m256i f = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    __m256i low[4] = {_mm256_and_si256(lo, f), _mm256_and_si256(hi, f), _mm256_srli_epi32(lo, 4), _mm256_srli_epi32(hi, 4)};
    for (int j = 0; j < 4; j++) {
        __m256i high = _mm256_and_si256(_mm256_srli_epi32(top, 2 * j), three);
        __m256i q = _mm256_sub_epi32(_mm256_or_si256(low[j], _mm256_slli_epi32(high, 4)), bias);
        out[j] = v8_round_bf16(_mm256_mul_ps(v8_splat(&b->scale[j / 2]), _mm256_cvtepi32_ps(q)));
    }
}
/* A T4 block: the codes widened to bytes (lanes 0–15 the low nibbles, 16–31 the high ones), each
 * looked up in the table's low and high bytes (vpshufb), the pairs of bytes joined into bf16 words
 * and the words widened to fp32 — even words by a shift, odd ones by a mask: k order by
 * table_block's placement. Pure bit moves after the table: the values table_block wrote. */
static inline __attribute__((always_inline)) void decode_t4(const void *block, v8 out[4]) {
    const block_t4 *b = block;
    __m256i low = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b->low));
    __m256i high = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b->high));
    __m256i codes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b->q));
    __m256i index = _mm256_and_si256(_mm256_srlv_epi32(codes, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                     _mm256_set1_epi8(15));
    __m256i l = _mm256_shuffle_epi8(low, index), h = _mm256_shuffle_epi8(high, index);
    __m256i first = _mm256_unpacklo_epi8(l, h), second = _mm256_unpackhi_epi8(l, h);
    __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(first, 16));
    out[1] = _mm256_castsi256_ps(_mm256_and_si256(first, odd));
    out[2] = _mm256_castsi256_ps(_mm256_slli_epi32(second, 16));
    out[3] = _mm256_castsi256_ps(_mm256_and_si256(second, odd));
}
static inline __attribute__((always_inline)) void decode_plain_bf16(const void *p, v8 out[4]) {
    const uint16_t *w = p;
    for (int j = 0; j < 4; j++) out[j] = v8_from_bf16(w + 8 * j);
}
static inline __attribute__((always_inline)) void decode_plain_f32(const void *p, v8 out[4]) {
    const float *w = p;
    for (int j = 0; j < 4; j++) out[j] = v8_load(w + 8 * j);
}
#endif

/* out (N, K) bf16 = the values the kernels compute with for a quantized weight: the loader compares
 * them with the weights it loaded, and refuses the format on any difference. */
/* The 32 values of one block in k order, as the kernels decode them (each one a bf16 value). */
static inline void decode_block(int64_t format, const void *block, float out[CHUNK]) {
#ifdef D3D_AVX2
    v8 vec[4];
    if (format == D3D_U4) decode_u4(block, vec);
    else if (format == D3D_I8) decode_i8(block, vec);
    else if (format == D3D_S4) decode_s4(block, vec);
    else decode_u6(block, vec);
    for (int j = 0; j < 4; j++) v8_store(out + 8 * j, vec[j]);
#else
    decode_block_scalar(format, block, out);
#endif
}

void d3d_dequantize(const void *data, int64_t format, uint16_t *out, int64_t N, int64_t K) {
    const char *bytes = data;
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / CHUNK; b++) {
            float v[CHUNK];
            decode_block(format, bytes + (n * (K / CHUNK) + b) * block_bytes(format), v);
            for (int e = 0; e < CHUNK; e++) out[n * K + b * CHUNK + e] = f32_to_bf16(v[e]);
        }
}

/* The same values by the scalar decoder (the definition the vector decoders must match). */
void d3d_dequantize_reference(const void *data, int64_t format, uint16_t *out, int64_t N, int64_t K) {
    const char *bytes = data;
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / CHUNK; b++) {
            float v[CHUNK];
            decode_block_scalar(format, bytes + (n * (K / CHUNK) + b) * block_bytes(format), v);
            for (int e = 0; e < CHUNK; e++) out[n * K + b * CHUNK + e] = f32_to_bf16(v[e]);
        }
}
