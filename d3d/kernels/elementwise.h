/* ---------------------------------------------------------------------------------------------
 * RMSNorm with transformers' rounding: y = weight * to_dtype(x * rsqrt(mean(x²) + eps)), the
 * normalisation in fp32 (in place allowed: y = x). SwiGLU: y = to_dtype(silu(gate)) * up for
 * gate_up = [gate | up] (M, 2I), elementwise.
 * ------------------------------------------------------------------------------------------- */

#define SILU_CHUNK 256  /* elements of one row per work item: a 1-row call still splits */

/* SwiGLU on 8 lanes: the scalar loop's operations (negation as a sign flip, exp_fixed8, IEEE
 * division, bf16 rounding to nearest even with quiet NaNs) lane by lane, so the same bits; returns
 * the first element it left to the scalar tail. */
#ifdef D3D_AVX2
static inline __attribute__((always_inline)) v8 v8_via_bf16(v8 f) {  /* bf16_to_f32(f32_to_bf16(f)) */
    return _mm256_castsi256_ps(_mm256_slli_epi32(v8_bf16_bits(f), 16));
}
static inline __attribute__((always_inline)) v8 v8_silu(v8 g) {
    v8 e = exp_fixed8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#ifdef __AVX512F__
/* The same on 16 lanes (exp_fixed16: the same operations as exp_fixed8, so the same bits per lane). */
static inline __attribute__((always_inline)) __m512i v16_bf16_bits(__m512 f) {  /* f32_to_bf16, in the low halves */
    __m512i u = _mm512_castps_si512(f);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
    return _mm512_srli_epi32(_mm512_mask_blend_epi32(nan, rounded, quiet), 16);
}
static inline __attribute__((always_inline)) __m512 v16_via_bf16(__m512 f) {  /* bf16_to_f32(f32_to_bf16(f)) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(v16_bf16_bits(f), 16));
}
static inline __attribute__((always_inline)) void v16_store_bf16(uint16_t *y, __m512 f) {
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(v16_bf16_bits(f)));
}
static inline __attribute__((always_inline)) __m512 v16_from_bf16(const uint16_t *a) { return load16_bf16(a, 0xffff); }
static inline __attribute__((always_inline)) __m512 v16_silu(__m512 g) {
    __m512 e = exp_fixed16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif
static inline int64_t SILU_VECTOR_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *y, int64_t i, int64_t end) {
#ifdef __AVX512F__
    for (; i + 16 <= end; i += 16)
        v16_store_bf16(y + i, _mm512_mul_ps(v16_via_bf16(v16_silu(v16_from_bf16(gate + i))), v16_from_bf16(up + i)));
#endif
    for (; i + 8 <= end; i += 8) {
        v8_store_bf16(y + i, _mm256_mul_ps(v8_via_bf16(v8_silu(v8_from_bf16(gate + i))), v8_from_bf16(up + i)));
    }
    return i;
}
static inline int64_t SILU_VECTOR_f32(const float *gate, const float *up, float *y, int64_t i, int64_t end) {
#ifdef __AVX512F__
    for (; i + 16 <= end; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(v16_silu(_mm512_loadu_ps(gate + i)), _mm512_loadu_ps(up + i)));
#endif
    for (; i + 8 <= end; i += 8) v8_store(y + i, _mm256_mul_ps(v8_silu(v8_load(gate + i)), v8_load(up + i)));
    return i;
}
#else
#define SILU_VECTOR_bf16(gate, up, y, i, end) (i)
#define SILU_VECTOR_f32(gate, up, y, i, end) (i)
#endif

/* RMSNorm of a row on 16 lanes where D is a multiple of 16: lane l's sum of squares is the scalar
 * loop's acc[l] (one fmaf chain over d = l, l + 16, …), folded as fold_lanes folds it, then the
 * scalar loop's products and roundings element by element — the same bits. Returns 0 where it
 * leaves the row to the scalar loop. */
#ifdef __AVX512F__
#define NORM_VECTOR(SUFFIX, LOAD16, STORE16)                                                         \
static inline int rms_norm_vector_##SUFFIX(const T_##SUFFIX *xr, const T_##SUFFIX *weight,           \
                                           T_##SUFFIX *yr, int64_t D, float eps) {                  \
    if (D % 16) return 0;                                                                            \
    __m512 acc = _mm512_setzero_ps();                                                                \
    for (int64_t d = 0; d < D; d += 16) { __m512 f = LOAD16(xr + d); acc = _mm512_fmadd_ps(f, f, acc); } \
    float lanes[16];                                                                                 \
    _mm512_storeu_ps(lanes, acc);                                                                    \
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(fold_lanes(lanes) / (float)D + eps));                     \
    for (int64_t d = 0; d < D; d += 16)                                                              \
        STORE16(yr + d, _mm512_mul_ps(LOAD16(weight + d), ROUND16_##SUFFIX(_mm512_mul_ps(LOAD16(xr + d), r)))); \
    return 1;                                                                                        \
}
typedef uint16_t T_bf16;
typedef float T_f32;
#define ROUND16_bf16(f) v16_via_bf16(f)
#define ROUND16_f32(f) (f)
NORM_VECTOR(bf16, v16_from_bf16, v16_store_bf16)
NORM_VECTOR(f32, _mm512_loadu_ps, _mm512_storeu_ps)
#else
#define rms_norm_vector_bf16(xr, weight, yr, D, eps) 0
#define rms_norm_vector_f32(xr, weight, yr, D, eps) 0
#endif

#define NORMS(SUFFIX, T_ELEM, LOAD, STORE)                                                           \
static inline void rms_norm_row_##SUFFIX(const T_ELEM *xr, const T_ELEM *weight, T_ELEM *yr, int64_t D, \
                                         float eps) {                                                \
    if (rms_norm_vector_##SUFFIX(xr, weight, yr, D, eps)) return;                                    \
    float acc[LANES] = {0};                                                                          \
    int64_t d = 0;                                                                                   \
    for (; d + LANES <= D; d += LANES)                                                               \
        for (int l = 0; l < LANES; l++) { float f = LOAD(xr[d + l]); acc[l] = fmaf(f, f, acc[l]); }  \
    for (int l = 0; d + l < D; l++) { float f = LOAD(xr[d + l]); acc[l] = fmaf(f, f, acc[l]); }      \
    float r = 1.0f / sqrtf(fold_lanes(acc) / (float)D + eps);                                        \
    for (d = 0; d < D; d++) yr[d] = STORE(LOAD(weight[d]) * LOAD(STORE(LOAD(xr[d]) * r)));           \
}                                                                                                    \
static void rms_norm_body_##SUFFIX(const T_ELEM *x, const T_ELEM *weight, T_ELEM *y, int64_t M,      \
                                   int64_t D, float eps) {                                           \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t m = 0; m < M; m++) rms_norm_row_##SUFFIX(x + m * D, weight, y + m * D, D, eps);     \
}                                                                                                    \
void d3d_rms_norm_##SUFFIX(const T_ELEM *x, const T_ELEM *weight, T_ELEM *y, int64_t M, int64_t D,   \
                           float eps, int threads) {                                                 \
    _Pragma("omp parallel num_threads(threads) if(M > 1)")                                           \
    rms_norm_body_##SUFFIX(x, weight, y, M, D, eps);                                                 \
}                                                                                                    \
static void silu_mul_body_##SUFFIX(const T_ELEM *gate_up, T_ELEM *y, int64_t M, int64_t I) {         \
    int64_t chunks = (I + SILU_CHUNK - 1) / SILU_CHUNK;                                              \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t job = 0; job < M * chunks; job++) {                                                 \
        int64_t m = job / chunks, i0 = (job % chunks) * SILU_CHUNK;                                  \
        int64_t i1 = i0 + SILU_CHUNK < I ? i0 + SILU_CHUNK : I;                                      \
        const T_ELEM *gate = gate_up + m * 2 * I, *up = gate + I;                                    \
        int64_t i = SILU_VECTOR_##SUFFIX(gate, up, y + m * I, i0, i1);                                \
        for (; i < i1; i++) {                                                                        \
            float g = LOAD(gate[i]);                                                                 \
            float silu = LOAD(STORE(g / (1.0f + exp_fixed(-g))));                                    \
            y[m * I + i] = STORE(silu * LOAD(up[i]));                                                \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
void d3d_silu_mul_##SUFFIX(const T_ELEM *gate_up, T_ELEM *y, int64_t M, int64_t I, int threads) {    \
    _Pragma("omp parallel num_threads(threads) if(M > 1)")                                           \
    silu_mul_body_##SUFFIX(gate_up, y, M, I);                                                        \
}

NORMS(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
NORMS(f32, float, IDENTITY, IDENTITY)

/* ---------------------------------------------------------------------------------------------
 * RoPE and the KV store: from qkv (M, (H + 2 Hkv) D) rows, M = B*T, write q rotated to
 * q_out (M, H, D) and k rotated, v as is into the cache slots start … start+T-1 of batch row b: k at
 * k_cache + b*kv_batch + g*kv_head + slot*D (or tiled with k_tiled, attention.h), v element d at v_cache + b*kv_batch + g*kv_head +
 * (d / V_PART)*v_part + slot*v_row + d % V_PART (the V layouts of attention.h). Rotation with PyTorch's rounding:
 * to_dtype(to_dtype(x*cos) + to_dtype(rotate_half(x)*sin)). Row m's cos/sin are row m of cos_/sin_
 * (M, D), or with `positions`, row positions[m] of tables cos_/sin_ (P, D).
 * ------------------------------------------------------------------------------------------- */

/* The rotation on 16 lanes where D is a multiple of 32 (so each half is whole vectors): the scalar
 * loop's negation (a sign flip), products, sum and roundings element by element — the same bits.
 * Returns 0 where it leaves the head to the scalar loop. */
#ifdef __AVX512F__
#define ROTATE_VECTOR(SUFFIX, LOAD16, STORE16)                                                       \
static inline int rotate_vector_##SUFFIX(const T_##SUFFIX *x, const T_##SUFFIX *cos_,                \
                                         const T_##SUFFIX *sin_, T_##SUFFIX *out, int64_t D) {       \
    if (D % 32) return 0;                                                                            \
    int64_t half = D / 2;                                                                            \
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);                                       \
    for (int64_t d = 0; d < D; d += 16) {                                                            \
        __m512 rot = d < half ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(LOAD16(x + d + half)), sign)) \
                              : LOAD16(x + d - half);                                                \
        __m512 a = ROUND16_##SUFFIX(_mm512_mul_ps(LOAD16(x + d), LOAD16(cos_ + d)));                 \
        __m512 b = ROUND16_##SUFFIX(_mm512_mul_ps(rot, LOAD16(sin_ + d)));                           \
        STORE16(out + d, _mm512_add_ps(a, b));                                                       \
    }                                                                                                \
    return 1;                                                                                        \
}
ROTATE_VECTOR(bf16, v16_from_bf16, v16_store_bf16)
ROTATE_VECTOR(f32, _mm512_loadu_ps, _mm512_storeu_ps)
#else
#define rotate_vector_bf16(x, cos_, sin_, out, D) 0
#define rotate_vector_f32(x, cos_, sin_, out, D) 0
#endif

#define ROPE_STORE(SUFFIX, T_ELEM, LOAD, STORE)                                                      \
static inline void rotate_##SUFFIX(const T_ELEM *x, const T_ELEM *cos_, const T_ELEM *sin_, T_ELEM *out, \
                                   int64_t D) {                                                      \
    if (rotate_vector_##SUFFIX(x, cos_, sin_, out, D)) return;                                       \
    int64_t half = D / 2;                                                                            \
    for (int64_t d = 0; d < D; d++) {                                                                \
        float rot = d < half ? -LOAD(x[d + half]) : LOAD(x[d - half]);                               \
        float a = LOAD(STORE(LOAD(x[d]) * LOAD(cos_[d]))), b = LOAD(STORE(rot * LOAD(sin_[d])));     \
        out[d] = STORE(a + b);                                                                       \
    }                                                                                                \
}                                                                                                    \
static void rope_store_body_##SUFFIX(const T_ELEM *qkv, const T_ELEM *cos_, const T_ELEM *sin_,      \
                                     const int64_t *positions, T_ELEM *q_out, T_ELEM *k_cache,       \
                                     T_ELEM *v_cache, int64_t B, int64_t T, int64_t H, int64_t Hkv,  \
                                     int64_t D, int64_t start, int64_t kv_batch, int64_t kv_head,    \
                                     int64_t v_row, int64_t v_part, int64_t k_tiled, int64_t last) { \
    int64_t width = (H + 2 * Hkv) * D;                                                               \
    _Pragma("omp for schedule(static)")  /* threads split (row, head) items: each item's own arithmetic */ \
    for (int64_t item = 0; item < B * T * (H + Hkv); item++) {                                       \
        int64_t m = item / (H + Hkv), h = item % (H + Hkv);                                          \
        int64_t b = m / T, slot = start + m % T, at_row = positions ? positions[m] : m;              \
        int64_t row_at = (at_row < last ? at_row : last) * D;  /* past the tables: their last row */  \
        const T_ELEM *row = qkv + m * width, *c = cos_ + row_at, *s = sin_ + row_at;                 \
        if (h < H) {                                                                                 \
            rotate_##SUFFIX(row + h * D, c, s, q_out + (m * H + h) * D, D);                          \
            continue;                                                                                \
        }                                                                                            \
        int64_t g = h - H, at = b * kv_batch + g * kv_head;                                          \
        if (k_tiled) {  /* rotated, then stored by pairs of d in the slot's tile */                  \
            T_ELEM key[MAX_HEAD_DIM];                                                                \
            rotate_##SUFFIX(row + (H + g) * D, c, s, key, D);                                        \
            T_ELEM *tile = k_cache + at + slot / KEY_TILE * KEY_TILE * D + slot % KEY_TILE * 2;      \
            for (int64_t d = 0; d < D; d++) tile[d / 2 * 2 * KEY_TILE + d % 2] = key[d];             \
        } else                                                                                       \
            rotate_##SUFFIX(row + (H + g) * D, c, s, k_cache + at + slot * D, D);                    \
        for (int64_t d0 = 0; d0 < D; d0 += V_PART)                                                   \
            memcpy(v_cache + at + d0 / V_PART * v_part + slot * v_row, row + (H + Hkv + g) * D + d0, \
                   (D - d0 < V_PART ? D - d0 : V_PART) * sizeof(T_ELEM));                            \
    }                                                                                                \
}                                                                                                    \
void d3d_rope_store_##SUFFIX(const T_ELEM *qkv, const T_ELEM *cos_, const T_ELEM *sin_, T_ELEM *q_out, \
                             T_ELEM *k_cache, T_ELEM *v_cache, int64_t B, int64_t T, int64_t H,      \
                             int64_t Hkv, int64_t D, int64_t start, int64_t kv_batch, int64_t kv_head, \
                             int64_t v_row, int64_t v_part, int64_t k_tiled) {                       \
    rope_store_body_##SUFFIX(qkv, cos_, sin_, NULL, q_out, k_cache, v_cache, B, T, H, Hkv, D, start, \
                             kv_batch, kv_head, v_row, v_part, k_tiled, INT64_MAX);                  \
}

ROPE_STORE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ROPE_STORE(f32, float, IDENTITY, IDENTITY)
