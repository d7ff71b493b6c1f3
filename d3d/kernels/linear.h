/* ---------------------------------------------------------------------------------------------
 * linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), rounded, then + residual[m, n] when given
 * (rounded again: the same bits as PyTorch's `residual + linear(x)`); x rows `x_stride` elements apart,
 * w (N, K) and y (M, N) contiguous. Threads own blocks of output columns and compute every row
 * for them, so each weight row is read from memory once per call whatever M is.
 * ------------------------------------------------------------------------------------------- */

#define COLS 4  /* output columns per block: each weight row is loaded once per block of rows */
#define ROWS 4  /* rows per block: ROWS x COLS independent accumulators hide the FMA latency */
#define AHEAD 4  /* column blocks between the one computed and the one prefetched */
/* Prefetch the 64-byte lines of `COLS` weight rows that hold element k (memory-bound at 1 row,
 * and at 17 rows it overlaps the weight stream with the arithmetic). */
#define PREFETCH_BLOCK(ahead, k, K)                                                                 \
    for (int c_ = 0; c_ < COLS; c_++) __builtin_prefetch((const char *)((ahead) + c_ * (K) + (k)), 0, 0)
/* The header's rule for one output: y[at] = v (+ bias[n]) rounded, then + residual[at] rounded again. */
#define STORE_OUTPUT(LOAD, STORE, y, at, v, bias, n, residual)                                      \
    do {                                                                                            \
        float v_ = (v);                                                                             \
        if (bias) v_ += LOAD((bias)[n]);                                                            \
        (y)[at] = (residual) ? STORE(LOAD((residual)[at]) + LOAD(STORE(v_))) : STORE(v_);           \
    } while (0)

#ifdef D3D_AVX512_BF16
/* 32 bf16 of a row from k on, zero-filled past K. */
static inline __m512bh load_chunk(const uint16_t *a, int64_t k, int64_t K) {
    if (k + 32 <= K) return (__m512bh)_mm512_loadu_si512(a + k);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << (K - k)) - 1), a + k);
}

static inline float fold512(__m512 v) {
    float lanes[LANES];
    _mm512_storeu_ps(lanes, v);
    return fold_lanes(lanes);
}

/* out[r][c] = x_r · w_c for R rows and C columns: one 16-lane vdpbf16ps chain per (r, c). The
 * full 4 x 4 block names its 16 accumulators so they stay in registers. */
#define DP(r, c) a##r##c = _mm512_dpbf16_ps(a##r##c, x##r, w##c)
static void dot_4x4_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t K,
                         const uint16_t *ahead, float out[ROWS][COLS]) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
           a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int64_t k = 0; k < K; k += 32) {
        if (ahead) PREFETCH_BLOCK(ahead, k, K);
        __m512bh w0 = load_chunk(w, k, K), w1 = load_chunk(w + K, k, K), w2 = load_chunk(w + 2 * K, k, K),
                 w3 = load_chunk(w + 3 * K, k, K);
        __m512bh x0 = load_chunk(x, k, K), x1 = load_chunk(x + x_stride, k, K),
                 x2 = load_chunk(x + 2 * x_stride, k, K), x3 = load_chunk(x + 3 * x_stride, k, K);
        DP(0, 0); DP(0, 1); DP(0, 2); DP(0, 3); DP(1, 0); DP(1, 1); DP(1, 2); DP(1, 3);
        DP(2, 0); DP(2, 1); DP(2, 2); DP(2, 3); DP(3, 0); DP(3, 1); DP(3, 2); DP(3, 3);
    }
    __m512 all[ROWS][COLS] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) out[r][c] = fold512(all[r][c]);
}
#undef DP

static void dot_block_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t K, int R, int C,
                           const uint16_t *ahead, float out[ROWS][COLS]) {
    if (R == ROWS && C == COLS) {
        dot_4x4_bf16(x, x_stride, w, K, ahead, out);
        return;
    }
    for (int r = 0; r < R; r++) {  /* remainder rows: a 1 x C block, same chain per (r, c) */
        __m512 acc[COLS] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = 0; k < K; k += 32) {
            if (ahead && r == 0) PREFETCH_BLOCK(ahead, k, K);
            __m512bh xr = load_chunk(x + r * x_stride, k, K);
            for (int c = 0; c < C; c++) acc[c] = _mm512_dpbf16_ps(acc[c], xr, load_chunk(w + c * K, k, K));
        }
        for (int c = 0; c < C; c++) out[r][c] = fold512(acc[c]);
    }
}
#endif

/* The same block in portable C: one 16-lane fp32 FMA chain per (r, c). */
#define DOT_BLOCK(NAME, T_ELEM, LOAD)                                                                \
static inline __attribute__((always_inline)) void NAME(                                              \
        const T_ELEM *x, int64_t x_stride, const T_ELEM *w, int64_t K, int R, int C, const T_ELEM *ahead, \
        float out[ROWS][COLS]) {                                                                     \
    float acc[ROWS][COLS][LANES];                                                                    \
    memset(acc, 0, sizeof acc);                                                                      \
    int64_t k = 0;                                                                                   \
    for (; k + LANES <= K; k += LANES) {                                                             \
        if (ahead) PREFETCH_BLOCK(ahead, k, K);                                                      \
        for (int r = 0; r < R; r++)                                                                  \
            for (int c = 0; c < C; c++)                                                              \
                for (int l = 0; l < LANES; l++)                                                      \
                    acc[r][c][l] = fmaf(LOAD(x[r * x_stride + k + l]), LOAD(w[c * K + k + l]), acc[r][c][l]); \
    }                                                                                                \
    for (int r = 0; r < R; r++)                                                                      \
        for (int c = 0; c < C; c++) {                                                                \
            for (int l = 0; k + l < K; l++)                                                          \
                acc[r][c][l] = fmaf(LOAD(x[r * x_stride + k + l]), LOAD(w[c * K + k + l]), acc[r][c][l]); \
            out[r][c] = fold_lanes(acc[r][c]);                                                       \
        }                                                                                            \
}

#define IDENTITY(x) (x)
DOT_BLOCK(dot_block_f32, float, IDENTITY)
#ifndef D3D_AVX512_BF16
DOT_BLOCK(dot_block_bf16, uint16_t, bf16_to_f32)
#endif

#define LINEAR(NAME, T_ELEM, LOAD, STORE, DOT)                                                       \
static void NAME##_body(const T_ELEM *x, int64_t x_stride, const T_ELEM *w, const T_ELEM *bias,      \
                        const T_ELEM *residual, T_ELEM *y, int64_t M, int64_t N, int64_t K) {        \
    int64_t blocks = (N + COLS - 1) / COLS;                                                          \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t blk = 0; blk < blocks; blk++) {                                                     \
        int64_t n0 = blk * COLS;                                                                     \
        int C = N - n0 < COLS ? (int)(N - n0) : COLS;                                                \
        /* the first pass over this block's weights also pulls in a block further on */             \
        const T_ELEM *ahead = blk + AHEAD < blocks ? w + (n0 + AHEAD * COLS) * K : NULL;             \
        for (int64_t m0 = 0; m0 < M; m0 += ROWS, ahead = NULL) {                                     \
            int R = M - m0 < ROWS ? (int)(M - m0) : ROWS;                                            \
            float out[ROWS][COLS];                                                                   \
            if (R == ROWS && C == COLS) DOT(x + m0 * x_stride, x_stride, w + n0 * K, K, ROWS, COLS, ahead, out); \
            else if (C == COLS) for (int r = 0; r < R; r++)                                          \
                DOT(x + (m0 + r) * x_stride, x_stride, w + n0 * K, K, 1, COLS, r ? NULL : ahead,    \
                    (float (*)[COLS])out[r]);                                                        \
            else DOT(x + m0 * x_stride, x_stride, w + n0 * K, K, R, C, NULL, out);                  \
            for (int r = 0; r < R; r++)                                                              \
                for (int c = 0; c < C; c++) {                                                        \
                    STORE_OUTPUT(LOAD, STORE, y, (m0 + r) * N + n0 + c, out[r][c], bias, n0 + c, residual); \
                }                                                                                    \
        }                                                                                            \
    }                                                                                                \
}

LINEAR(lanes_reference_bf16, uint16_t, bf16_to_f32, f32_to_bf16, dot_block_bf16)
LINEAR(lanes_reference_f32, float, IDENTITY, IDENTITY, dot_block_f32)

/* ---------------------------------------------------------------------------------------------
 * packed linear (AVX-512): weights repacked once so that one 64-byte load holds the same k step
 * of 16 output columns — bf16 (N/16, K/2, 16, 2), fp32 (N/16, K, 16). Each accumulator lane is
 * one output column, fed by one FMA chain over k in order (bf16: vdpbf16ps over k pairs); no
 * horizontal sum. A tile is up to 6 rows x 4 column groups (64 columns); the row count only
 * decides how rows are grouped into tiles, never a row's own chain. A one-tile call (up to 6 rows)
 * leaves the weight stream to the hardware prefetchers, which stream huge pages faster alone
 * (measured on AMD EPYC Zen 4: ~5% per step); several tiles prefetch the next block (below).
 * Finished lanes are stored 16 at a time (store16_*), with the scalar rule's operations.
 * ------------------------------------------------------------------------------------------- */

#if defined(__AVX512F__)
#define GROUPS 4     /* 16-column groups per tile; packed weights are zero-padded to 64 columns */
#define TILE_ROWS 6  /* up to 6 x 4 accumulators + 4 weight registers + 1 broadcast: 29 of 32 */

/* 16 finished lanes of one row: + bias, rounded, + residual, rounded again — the scalar rule of the
 * header, lane by lane (the same IEEE additions and the same rounding), for the first `live` lanes. */
static inline __attribute__((always_inline)) void store16_f32(__m512 v, const float *bias, const float *residual,
                                                              float *y, int live) {
    __mmask16 m = (__mmask16)((1u << live) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias));
    if (residual) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, residual), v);
    _mm512_mask_storeu_ps(y, m, v);
}

/* A block's tiles prefetch the next block of their run into L2 (hint T1), each tile its share, a few
 * lines a k step — only when the rows take two tiles or more: then the first tile's weights are
 * re-read from L2 by the others, and without it the next block's stream waited for the arithmetic
 * (AMD EPYC Zen 4, 2 threads, the model's 121 matrices, medians of 11 interleaved rounds: 8 rows
 * 13.5 → 11.3 ms, 12 rows 14.3 → 11.7, 17 rows 17.6 → 15.7; one row unchanged, and the hardware
 * prefetchers alone streamed one row's weights best). */
#define PREFETCH_MIN_TILES 2

#define PACKED_LINEAR(NAME, T_ELEM, STEPS, STEP_ELEMS, BROADCAST, FMA, STORE16)                        \
static inline __attribute__((always_inline)) void NAME##_tile(                                       \
        const T_ELEM *x, int64_t x_stride, const T_ELEM *wp, int64_t K, const int R, const int G,    \
        __m512 acc[TILE_ROWS][GROUPS], const char *ahead, int ahead_per_step, int64_t ahead_lines) { \
    int64_t group_elems = (int64_t)(STEPS) * 16 * (STEP_ELEMS);                                      \
    for (int r = 0; r < R; r++)                                                                      \
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();                                 \
    for (int64_t i = 0; i < (STEPS); i++) {                                                          \
        const T_ELEM *wi = wp + i * 16 * (STEP_ELEMS);                                               \
        __m512 wv[GROUPS];                                                                           \
        for (int g = 0; g < G; g++) wv[g] = LOADW(wi + g * group_elems);                             \
        for (int p = 0; p < ahead_per_step; p++) {                                                   \
            int64_t line = i * ahead_per_step + p;                                                   \
            if (line < ahead_lines) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);                    \
        }                                                                                            \
        for (int r = 0; r < R; r++) {                                                                \
            __m512 xr = BROADCAST(x + r * x_stride, i);                                              \
            for (int g = 0; g < G; g++) acc[r][g] = FMA(acc[r][g], xr, wv[g]);                       \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
/* Every row over one block of G groups (columns n0 …) whose packed weights start at tile_w; rows   \
 * in tiles of at most 6, as even as possible (17 rows → 6, 6, 5), prefetching `next_bytes` from    \
 * `next` (the run's next block; 0 for none). */                                                    \
static void NAME##_block(const T_ELEM *x, int64_t x_stride, const T_ELEM *tile_w, int G, int64_t n0, \
                         const T_ELEM *bias, const T_ELEM *residual, T_ELEM *y, int64_t M, int64_t N, \
                         int64_t K, const char *next, int64_t next_bytes) {                          \
    int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;                                                 \
    if (tiles == 0) return;  /* a call of no rows */                                                 \
    int64_t next_lines = tiles >= PREFETCH_MIN_TILES ? next_bytes / 64 : 0;                          \
    int64_t share = (next_lines + tiles - 1) / tiles;  /* lines each tile prefetches */              \
    int per_step = (int)((share + (STEPS) - 1) / (STEPS));                                           \
    for (int64_t t = 0, m0 = 0; t < tiles; t++) {                                                    \
        int R = (int)((M - m0) / (tiles - t));                                                       \
        __m512 acc[TILE_ROWS][GROUPS];                                                               \
        const T_ELEM *xt = x + m0 * x_stride;                                                        \
        const char *ahead = next + 64 * share * t;                                                   \
        int64_t ahead_lines = next_lines - share * t < share ? next_lines - share * t : share;       \
        switch (G * 8 + R) {  /* one specialised loop per tile height and width */                  \
            TILE_CASES(NAME, 1) TILE_CASES(NAME, 2) TILE_CASES(NAME, 3) TILE_CASES(NAME, 4)          \
        }                                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int g = 0; g < G; g++) {                                                            \
                int64_t n = n0 + g * 16, at = (m0 + r) * N + n;                                      \
                STORE16(acc[r][g], bias ? bias + n : 0, residual ? residual + at : 0, y + at,        \
                        N - n < 16 ? (int)(N - n) : 16);                                             \
            }                                                                                        \
        m0 += R;                                                                                     \
    }                                                                                                \
}                                                                                                    \
/* Threads own runs of 16-column groups, as even as possible (576 columns: 18 groups each); each   \
 * run goes in blocks of up to 4 groups. */                                                         \
static void NAME##_body(const T_ELEM *x, int64_t x_stride, const T_ELEM *wp, const T_ELEM *bias,     \
                        const T_ELEM *residual, T_ELEM *y, int64_t M, int64_t N, int64_t K) {        \
    int64_t groups = (N + 15) / 16, group_elems = (int64_t)(STEPS) * 16 * (STEP_ELEMS);              \
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();                              \
    int64_t first = groups * me / threads, last = groups * (me + 1) / threads;                       \
    for (int64_t g0 = first; g0 < last; g0 += GROUPS) {                                              \
        int G = last - g0 < GROUPS ? (int)(last - g0) : GROUPS;                                      \
        int64_t following = last - g0 - G < GROUPS ? last - g0 - G : GROUPS;                         \
        const T_ELEM *tile_w = wp + g0 * group_elems;                                                \
        NAME##_block(x, x_stride, tile_w, G, g0 * 16, bias, residual, y, M, N, K,                    \
                     (const char *)(tile_w + G * group_elems),                                       \
                     following * group_elems * (int64_t)sizeof(T_ELEM));                             \
    }                                                                                                \
    _Pragma("omp barrier")                                                                           \
}

#define TILE_CASE(NAME, G, R)                                                                        \
    case G * 8 + R: NAME##_tile(xt, x_stride, tile_w, K, R, G, acc, ahead, per_step, ahead_lines); break;
#define TILE_CASES(NAME, G) TILE_CASE(NAME, G, 1) TILE_CASE(NAME, G, 2) TILE_CASE(NAME, G, 3)            \
                            TILE_CASE(NAME, G, 4) TILE_CASE(NAME, G, 5) TILE_CASE(NAME, G, 6)

#define LOADW(p) _mm512_loadu_ps((const float *)(p))  /* 64 bytes: 16 floats or 16 bf16 pairs */
#define BROADCAST_F32(row, i) _mm512_set1_ps((row)[i])
#define FMA_F32(acc, x, w) _mm512_fmadd_ps(x, w, acc)
PACKED_LINEAR(packed_f32, float, K, 1, BROADCAST_F32, FMA_F32, store16_f32)
#ifdef D3D_AVX512_BF16
static inline __m512 broadcast_pair(const uint16_t *row, int64_t i) {
    int32_t pair;
    memcpy(&pair, row + 2 * i, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
}
#define FMA_BF16(acc, x, w) _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(x), (__m512bh)_mm512_castps_si512(w))

/* f32_to_bf16 on 16 lanes (nearest even, quiet NaNs), the bf16 bits in each lane's low half. */
static inline __attribute__((always_inline)) __m512i bf16_bits16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_srli_epi32(rounded, 16);
}
static inline __attribute__((always_inline)) __m512 widen16_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __attribute__((always_inline)) void store16_bf16_masked(__m512 v, const uint16_t *bias, const uint16_t *residual,
                                                                      uint16_t *y, __mmask16 m) {
    if (bias) v = _mm512_add_ps(v, widen16_bf16(bias, m));
    __m512i bits = bf16_bits16(v);
    if (residual)
        bits = bf16_bits16(_mm512_add_ps(widen16_bf16(residual, m), _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))));
    _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(bits));
}
static inline __attribute__((always_inline)) void store16_bf16(__m512 v, const uint16_t *bias, const uint16_t *residual,
                                                               uint16_t *y, int live) {
    store16_bf16_masked(v, bias, residual, y, (__mmask16)((1u << live) - 1));
}
PACKED_LINEAR(packed_bf16, uint16_t, K / 2, 2, broadcast_pair, FMA_BF16, store16_bf16)
#endif
#endif

/* Whether this build's bf16 lanes read lane-packed copies (formats.h's LANE_PACKED: AVX2, where bf16
 * is not column-packed) of weights whose width is a multiple of 16. */
int d3d_lane_packed_linear(void) {
#if defined(D3D_AVX2) && !defined(D3D_AVX512_BF16)
    return 1;
#else
    return 0;
#endif
}

/* Which layouts this build's linear takes: 1 = packed (AVX-512), 0 = plain (N, K). */
int d3d_packed_linear(int bf16) {
#if defined(D3D_AVX512_BF16)
    return 1;
#elif defined(__AVX512F__)
    return !bf16;
#else
    (void)bf16;
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * lanes linear (AVX2): the reference lanes' arithmetic — per (row, column) 16 fp32 FMA chains, lane
 * l taking k = l, l + 16, l + 32, … in order, folded by fold_lanes — over any non-packed format,
 * 8 lanes to a register. The weights of a block of 4 columns are decoded straight into the FMAs of
 * up to 4 rows at a time (up to FUSED_MAX rows), or beyond that once per call into a per-thread strip
 * of fp32 values (4 x K, L1/L2) that every row tile reads: tiles of 2 rows x 4 columns, each 16-lane chain run as two independent
 * 8-lane halves (8 accumulators, all in registers). Rows are converted to fp32 once per call.
 * Needs K a multiple of 32 (every block format is; plain weights of other widths take the
 * reference lanes, which give the same bits). Plain weights — a quantized weight's bf16 values among
 * them — take the pair tiles below from PAIR_MIN_ROWS rows; the strip serves quantized weights read
 * without their bf16 values (RowExactKernels.dense_rows off) and the fused tiles the rest.
 * ------------------------------------------------------------------------------------------- */

/* Calls of up to FUSED_MAX rows run the fused tiles 4 rows at a time (the weights streamed once per 4
 * rows), calls of more decode each block into the strip once. AMD EPYC Zen 3 (AVX2), whole forwards
 * over the bf16 values after 256 tokens, two builds interleaved, in one-token steps: 5 rows 1.57
 * (strip 2.88), 8 rows 2.12 (3.43), 9 rows 2.47 (3.79), 13 rows 3.37 (4.47), 17 rows 4.31 (4.71);
 * from 20 rows to 32 the two were even. */
#define FUSED_MAX 24

#ifdef D3D_AVX2
/* fold_lanes of the 16 lanes lo (0–7) and hi (8–15), in registers: the same additions in the same
 * order — lane i + lane i+8, then i + i+4, then (0 + 2) + (1 + 3). */
static inline __attribute__((always_inline)) float fold_v8(v8 lo, v8 hi) {
    v8 t8 = _mm256_add_ps(lo, hi);
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

/* `steps` iterations k = 0, 16, 32, …: a_c += x0[k…k+7] · w_c[k…k+7], b_c += x1[…] · w_c[…], for the 4
 * strip columns c (K floats apart). Each weight vector is loaded once and serves both rows: written
 * out, because GCC folds the loads into the FMAs and loads each one twice (10 loads per 8 FMAs
 * where 6 do; measured 3.2 vs 5.0 G FMA/s on a core of an AMD EPYC with AVX2). The same FMAs in the
 * same order either way. */
#if defined(__GNUC__) && defined(__x86_64__)
#define LANES_TILE_LOOP(w, K, x0, x1, steps, a0, a1, a2, a3, b0, b1, b2, b3)                       \
    do {                                                                                            \
        const float *w_ = (w), *w3_ = (w) + 3 * (K), *x0_ = (x0), *x1_ = (x1);                      \
        int64_t n_ = (steps), stride_ = (K) * (int64_t)sizeof(float);                               \
        if (n_ > 0)                                                                                 \
            __asm__("1:\n\t"                                                                         \
                    "vmovups (%[w]), %%ymm12\n\t"                                                    \
                    "vmovups (%[w],%[st]), %%ymm13\n\t"                                              \
                    "vmovups (%[w],%[st],2), %%ymm14\n\t"                                            \
                    "vmovups (%[w3]), %%ymm15\n\t"                                                   \
                    "vmovups (%[x0]), %%ymm8\n\t"                                                    \
                    "vmovups (%[x1]), %%ymm9\n\t"                                                    \
                    "vfmadd231ps %%ymm8, %%ymm12, %[a0]\n\t"                                         \
                    "vfmadd231ps %%ymm8, %%ymm13, %[a1]\n\t"                                         \
                    "vfmadd231ps %%ymm8, %%ymm14, %[a2]\n\t"                                         \
                    "vfmadd231ps %%ymm8, %%ymm15, %[a3]\n\t"                                         \
                    "vfmadd231ps %%ymm9, %%ymm12, %[b0]\n\t"                                         \
                    "vfmadd231ps %%ymm9, %%ymm13, %[b1]\n\t"                                         \
                    "vfmadd231ps %%ymm9, %%ymm14, %[b2]\n\t"                                         \
                    "vfmadd231ps %%ymm9, %%ymm15, %[b3]\n\t"                                         \
                    "addq $64, %[w]\n\t"                                                             \
                    "addq $64, %[w3]\n\t"                                                            \
                    "addq $64, %[x0]\n\t"                                                            \
                    "addq $64, %[x1]\n\t"                                                            \
                    "decq %[n]\n\t"                                                                  \
                    "jnz 1b"                                                                        \
                    : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [b0] "+x"(b0),      \
                      [b1] "+x"(b1), [b2] "+x"(b2), [b3] "+x"(b3), [w] "+r"(w_), [w3] "+r"(w3_),       \
                      [x0] "+r"(x0_), [x1] "+r"(x1_), [n] "+r"(n_)                                    \
                    : [st] "r"(stride_)                                                             \
                    : "ymm8", "ymm9", "ymm12", "ymm13", "ymm14", "ymm15", "memory", "cc");          \
    } while (0)
#else
#define LANES_TILE_LOOP(w, K, x0, x1, steps, a0, a1, a2, a3, b0, b1, b2, b3)                       \
    for (int64_t s_ = 0; s_ < (steps); s_++) {                                                      \
        int64_t k_ = s_ * LANES;                                                                    \
        v8 w0_ = v8_load((w) + k_), w1_ = v8_load((w) + (K) + k_), w2_ = v8_load((w) + 2 * (K) + k_), \
           w3_ = v8_load((w) + 3 * (K) + k_), x0_ = v8_load((x0) + k_), x1_ = v8_load((x1) + k_);   \
        a0 = v8_fma(x0_, w0_, a0); a1 = v8_fma(x0_, w1_, a1); a2 = v8_fma(x0_, w2_, a2); a3 = v8_fma(x0_, w3_, a3); \
        b0 = v8_fma(x1_, w0_, b0); b1 = v8_fma(x1_, w1_, b1); b2 = v8_fma(x1_, w2_, b2); b3 = v8_fma(x1_, w3_, b3); \
    }
#endif

/* res[r * 4 + c] = x_r · strip_c for R ≤ 2 rows: lanes 0–7 of every chain first, then lanes 8–15. */
static void lanes_tile(const float *xf, int R, int64_t K, const float *strip, float *res) {
    v8 first[8];  /* lanes 0–7 of the 8 chains */
    for (int half = 0; half < 2; half++) {
        v8 a0 = v8_zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const float *x0 = xf + 8 * half, *x1 = xf + (R > 1 ? K : 0) + 8 * half;  /* one row: chain b is dropped */
        const float *w = strip + 8 * half;
        int64_t steps = (K - 8 * half + LANES - 1) / LANES;
        LANES_TILE_LOOP(w, K, x0, x1, steps, a0, a1, a2, a3, b0, b1, b2, b3);
        if (half == 0) {
            first[0] = a0; first[1] = a1; first[2] = a2; first[3] = a3;
            first[4] = b0; first[5] = b1; first[6] = b2; first[7] = b3;
        } else {
            res[0] = fold_v8(first[0], a0); res[1] = fold_v8(first[1], a1);
            res[2] = fold_v8(first[2], a2); res[3] = fold_v8(first[3], a3);
            if (R > 1) {
                res[4] = fold_v8(first[4], b0); res[5] = fold_v8(first[5], b1);
                res[6] = fold_v8(first[6], b2); res[7] = fold_v8(first[7], b3);
            }
        }
    }
}



#define LANES_AHEAD 4  /* column blocks ahead that the one-row path prefetches (2: 15.1, 4: 13.7, 8: 15.4 ms a step) */
/* Bytes ahead that a T4 stream prefetches. AMD EPYC Zen 3, 2 threads, one row over the 106 M weights of
 * SmolLM2-135M's layers as T4 (a /tmp harness, medians of 15-25): none 6.45 ms, 1 KB 5.6, 1.5 KB
 * 4.8, 2 KB 4.8-5.0, 3 KB 5.4, 4 KB 5.6 — against a plain read of the same 159 MB in 5.0 ms. */
#define T4_AHEAD 2048
/* A few rows straight from the decoded registers: for each group of C columns, each block's
 * weights are decoded once and feed R rows (R·C·2 ≤ 8 accumulators); rows past M repeat row 0 and
 * are dropped. No strip: at 2–4 rows its stores and reloads cost more than the FMAs they save. */
#define LANES_FUSED(NAME, DECODE, R, C)                                                              \
static inline __attribute__((always_inline)) void NAME(const float *xf, int64_t M, int64_t K,       \
        const char *const rows[4], int64_t chunk_bytes, const char *const *ahead, float *res) {      \
    int64_t blocks = K / CHUNK;                                                                      \
    const float *x[R];                                                                               \
    for (int r = 0; r < R; r++) x[r] = xf + (r < M ? r : 0) * K;                                     \
    for (int c0 = 0; c0 < 4; c0 += C) {                                                              \
        v8 acc[R][C][2];                                                                             \
        for (int r = 0; r < R; r++)                                                                  \
            for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = v8_zero();                     \
        for (int64_t b = 0; b < blocks; b++) {                                                       \
            if (ahead) for (int c = 0; c < C; c++) __builtin_prefetch(ahead[c0 + c] + b * chunk_bytes, 0, 0); \
            for (int c = 0; c < C; c++) {                                                            \
                v8 w_[4];                                                                            \
                DECODE(rows[c0 + c] + b * chunk_bytes, w_);                                          \
                for (int r = 0; r < R; r++) {                                                        \
                    const float *xb = x[r] + b * CHUNK;                                              \
                    acc[r][c][0] = v8_fma(v8_load(xb), w_[0], acc[r][c][0]);                         \
                    acc[r][c][1] = v8_fma(v8_load(xb + 8), w_[1], acc[r][c][1]);                     \
                    acc[r][c][0] = v8_fma(v8_load(xb + 16), w_[2], acc[r][c][0]);                    \
                    acc[r][c][1] = v8_fma(v8_load(xb + 24), w_[3], acc[r][c][1]);                    \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R && r < M; r++)                                                         \
            for (int c = 0; c < C; c++) res[r * 4 + c0 + c] = fold_v8(acc[r][c][0], acc[r][c][1]);   \
    }                                                                                                \
}

/* res[m * 4 + c] = x_m · w_c for the 4 weight rows at `rows[c]` (byte pointers), every row m:
 * fused 4 rows at a time for up to FUSED_MAX rows, over a decoded strip beyond. */
#define LANES_COLUMNS(NAME, DECODE)                                                                  \
LANES_FUSED(NAME##_1, DECODE, 1, 4)                                                                  \
LANES_FUSED(NAME##_2, DECODE, 2, 2)                                                                  \
LANES_FUSED(NAME##_4, DECODE, 4, 1)                                                                  \
static void NAME(const float *xf, int64_t M, int64_t K, const char *const rows[4], int64_t chunk_bytes, \
                 const char *const *ahead, float *strip, float *res) {                               \
    if (M <= FUSED_MAX) {  /* 4 rows at a time, the last 1–4 in the tile of their size */            \
        for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                      \
            int64_t r = M - m0 < 4 ? M - m0 : 4;                                                     \
            const char *const *first = m0 ? NULL : ahead;                                            \
            if (r == 1) NAME##_1(xf + m0 * K, r, K, rows, chunk_bytes, first, res + m0 * 4);         \
            else if (r == 2) NAME##_2(xf + m0 * K, r, K, rows, chunk_bytes, first, res + m0 * 4);    \
            else NAME##_4(xf + m0 * K, r, K, rows, chunk_bytes, first, res + m0 * 4);                \
        }                                                                                            \
        return;                                                                                      \
    }                                                                                                \
    int64_t blocks = K / CHUNK;                                                                      \
    for (int c = 0; c < 4; c++)                                                                      \
        for (int64_t b = 0; b < blocks; b++) {                                                       \
            v8 w_[4];                                                                                \
            DECODE(rows[c] + b * chunk_bytes, w_);                                                   \
            for (int j = 0; j < 4; j++) v8_store(strip + c * K + b * CHUNK + 8 * j, w_[j]);          \
        }                                                                                            \
    for (int64_t m = 0; m < M; m += 2) lanes_tile(xf + m * K, M - m > 1 ? 2 : 1, K, strip, res + m * 4); \
}

LANES_COLUMNS(lanes_columns_bf16, decode_plain_bf16)
LANES_COLUMNS(lanes_columns_f32, decode_plain_f32)
LANES_COLUMNS(lanes_columns_u4, decode_u4)
LANES_COLUMNS(lanes_columns_i8, decode_i8)
LANES_COLUMNS(lanes_columns_u6, decode_u6)
LANES_COLUMNS(lanes_columns_s4, decode_s4)
LANES_COLUMNS(lanes_columns_t4, decode_t4)

/* lanes_columns_t4 for one row, in registers named by hand: the 4 columns' tables side by side (one
 * stream, the 3 lines of each block's group prefetched T4_AHEAD on), each column decoded as decode_t4
 * does and its 4 vectors fed to its two chains. Left to the compiler, the tile inlined into the
 * linear kept two of the 8 chains on the stack — a store and a load in their dependency every block,
 * a quarter of the kernel's time (perf, AMD EPYC Zen 3). The same operations in the same order. */
#if defined(__GNUC__) && defined(__x86_64__)
#define T4_STR(x) #x
#define T4_STRING(x) T4_STR(x)
/* decode_t4 of column c of the group at %[w] into ymm10, ymm8, ymm11, ymm9 (k order) */
#define T4_DECODE_ASM(c)                                                                             \
    "vbroadcasti128 " #c "*48+32(%[w]), %%ymm8\n\t"   /* the codes */                              \
    "vpsrlvd %[shift], %%ymm8, %%ymm8\n\t"                                                           \
    "vpand %[nibble], %%ymm8, %%ymm8\n\t"                                                            \
    "vbroadcasti128 " #c "*48(%[w]), %%ymm9\n\t"      /* the table's low bytes */                  \
    "vpshufb %%ymm8, %%ymm9, %%ymm9\n\t"                                                             \
    "vbroadcasti128 " #c "*48+16(%[w]), %%ymm10\n\t"  /* and high ones */                          \
    "vpshufb %%ymm8, %%ymm10, %%ymm10\n\t"                                                           \
    "vpunpcklbw %%ymm10, %%ymm9, %%ymm8\n\t"                                                         \
    "vpunpckhbw %%ymm10, %%ymm9, %%ymm9\n\t"                                                         \
    "vpslld $16, %%ymm8, %%ymm10\n\t"                                                                \
    "vpand %[odd], %%ymm8, %%ymm8\n\t"                                                               \
    "vpslld $16, %%ymm9, %%ymm11\n\t"                                                                \
    "vpand %[odd], %%ymm9, %%ymm9\n\t"
/* the decoded vectors into a row's two chains a, b; `row` the row's address (base, index) */
#define T4_FMA_ASM(row, a, b)                                                                        \
    "vfmadd231ps (" row "), %%ymm10, %[" #a "]\n\t"                                                  \
    "vfmadd231ps 32(" row "), %%ymm8, %[" #b "]\n\t"                                                 \
    "vfmadd231ps 64(" row "), %%ymm11, %[" #a "]\n\t"                                                \
    "vfmadd231ps 96(" row "), %%ymm9, %[" #b "]\n\t"
#define T4_COLUMN_ASM(c, a, b) T4_DECODE_ASM(c) T4_FMA_ASM("%[x]", a, b)
/* a loop over the K / 32 blocks of a group's stream (%[w], 192 bytes a block, its 3 lines prefetched
 * T4_AHEAD on) and of the rows (%[x], 32 floats a block): BODY per block */
#define T4_LOOP_ASM(BODY)                                                                            \
    "1:\n\t"                                                                                         \
    "prefetchnta " T4_STRING(T4_AHEAD) "(%[w])\n\t"                                                  \
    "prefetchnta " T4_STRING(T4_AHEAD) "+64(%[w])\n\t"                                               \
    "prefetchnta " T4_STRING(T4_AHEAD) "+128(%[w])\n\t"                                              \
    BODY                                                                                             \
    "addq $192, %[w]\n\t"                                                                           \
    "subq $-128, %[x]\n\t"                                                                          \
    "decq %[n]\n\t"                                                                                 \
    "jnz 1b"
/* decode_t4's constants, in registers for the loop */
#define T4_CONSTANTS                                                                                 \
    __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), nibble = _mm256_set1_epi8(15);        \
    __m256i odd = _mm256_set1_epi32((int)0xffff0000u)
static void t4_one_row(const float *x, int64_t K, const char *w, float *res) {
    v8 a0 = v8_zero(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    T4_CONSTANTS;
    int64_t n = K / CHUNK;
    if (n > 0)
        __asm__(T4_LOOP_ASM(T4_COLUMN_ASM(0, a0, b0) T4_COLUMN_ASM(1, a1, b1) T4_COLUMN_ASM(2, a2, b2)
                            T4_COLUMN_ASM(3, a3, b3))
                : [a0] "+x"(a0), [b0] "+x"(b0), [a1] "+x"(a1), [b1] "+x"(b1), [a2] "+x"(a2), [b2] "+x"(b2),
                  [a3] "+x"(a3), [b3] "+x"(b3), [w] "+r"(w), [x] "+r"(x), [n] "+r"(n)
                : [shift] "x"(shift), [nibble] "x"(nibble), [odd] "x"(odd)
                : "ymm8", "ymm9", "ymm10", "ymm11", "memory", "cc");
    res[0] = fold_v8(a0, b0), res[1] = fold_v8(a1, b1), res[2] = fold_v8(a2, b2), res[3] = fold_v8(a3, b3);
}

/* The same for two rows (a verification of one draft), two columns at a time: each column decoded
 * once for both rows, the rows `stride` bytes apart; the group's other two columns in a second pass,
 * from L1. */
#define T4_PAIR_COLUMN_ASM(c, a, b, e, f) T4_DECODE_ASM(c) T4_FMA_ASM("%[x]", a, b) T4_FMA_ASM("%[x],%[stride]", e, f)
static void t4_two_rows(const float *x, int64_t K, const char *w, float *res) {
    T4_CONSTANTS;
    int64_t stride = K * (int64_t)sizeof(float);
    for (int c0 = 0; c0 < 4; c0 += 2) {
        v8 a0 = v8_zero(), b0 = a0, a1 = a0, b1 = a0, e0 = a0, f0 = a0, e1 = a0, f1 = a0;  /* row 0: a, b; row 1: e, f */
        const char *group = w + c0 * (int64_t)sizeof(block_t4);
        const float *xr = x;
        int64_t n = K / CHUNK;
        if (n > 0)
            __asm__(T4_LOOP_ASM(T4_PAIR_COLUMN_ASM(0, a0, b0, e0, f0) T4_PAIR_COLUMN_ASM(1, a1, b1, e1, f1))
                    : [a0] "+x"(a0), [b0] "+x"(b0), [a1] "+x"(a1), [b1] "+x"(b1), [e0] "+x"(e0), [f0] "+x"(f0),
                      [e1] "+x"(e1), [f1] "+x"(f1), [w] "+r"(group), [x] "+r"(xr), [n] "+r"(n)
                    : [stride] "r"(stride), [shift] "x"(shift), [nibble] "x"(nibble), [odd] "x"(odd)
                    : "ymm8", "ymm9", "ymm10", "ymm11", "memory", "cc");
        res[c0] = fold_v8(a0, b0), res[c0 + 1] = fold_v8(a1, b1);
        res[4 + c0] = fold_v8(e0, f0), res[4 + c0 + 1] = fold_v8(e1, f1);
    }
}
#undef T4_PAIR_COLUMN_ASM
#undef T4_COLUMN_ASM
#undef T4_FMA_ASM
#undef T4_DECODE_ASM
#undef T4_LOOP_ASM
#undef T4_CONSTANTS
#define T4_ONE_ROW 1
#endif

/* Scratch floats a lanes call takes: the rows in fp32, and per thread a strip and the results. */
static int64_t lanes_scratch(int64_t M, int64_t K, int threads) { return M * K + threads * (4 * K + 4 * M); }

#ifdef T4_ONE_ROW  /* one or two rows: t4_one_row, t4_two_rows, from the group's first column */
#define T4_COLUMNS(xf, M, K, rows, chunk_bytes, ahead, strip, res)                                   \
    (M == 1 ? t4_one_row(xf, K, rows[0], res) : M == 2 ? t4_two_rows(xf, K, rows[0], res)            \
            : lanes_columns_t4(xf, M, K, rows, chunk_bytes, ahead, strip, res))
#else
#define T4_COLUMNS lanes_columns_t4
#endif

#define LANES_LINEAR(SUFFIX, T_ELEM, LOAD, STORE)                                                    \
static __attribute__((unused)) void lanes_##SUFFIX##_body(const T_ELEM *x, int64_t x_stride, const d3d_weight *w, const T_ELEM *bias, \
                                  const T_ELEM *residual, T_ELEM *y, int64_t M, int64_t N, int64_t K, \
                                  float *scratch) {                                                  \
    float *xf = scratch;                                                                             \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t m = 0; m < M; m++)                                                                  \
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = LOAD(x[m * x_stride + k]);                   \
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();                              \
    float *strip = scratch + M * K + me * (4 * K + 4 * M), *res = strip + 4 * K;                     \
    int64_t blocks = (N + 3) / 4;                                                                    \
    (void)threads;                                                                                   \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t blk = 0; blk < blocks; blk++) {                                                     \
        int64_t n0 = blk * 4, first = n0;                                                            \
        int C = N - n0 < 4 ? (int)(N - n0) : 4;                                                      \
        const d3d_part *part = part_of(w, &first);  /* a run of rows never splits a block of 4 */     \
        int64_t format = part->format;                                                               \
        int64_t chunk_bytes = is_quantized(format) || format == D3D_T4 ? block_bytes(format)         \
                                                                     : CHUNK * (int64_t)sizeof(T_ELEM); \
        int64_t row_bytes = chunk_bytes * (K / CHUNK);                                               \
        const char *rows[4], *later[4], *const *ahead = NULL;                                        \
        if (format == D3D_T4) {  /* the 4 columns' blocks side by side: one stream, prefetched T4_AHEAD on */ \
            for (int c = 0; c < 4; c++) {                                                            \
                rows[c] = (const char *)part->data + first * row_bytes + c * chunk_bytes;            \
                later[c] = rows[c] + T4_AHEAD;                                                       \
            }                                                                                        \
            ahead = later;                                                                           \
            chunk_bytes *= 4;                                                                        \
        } else {                                                                                     \
            for (int c = 0; c < 4; c++) rows[c] = (const char *)part->data + (first + (c < C ? c : 0)) * row_bytes; \
            if (first + (LANES_AHEAD + 1) * 4 <= part->rows) {  /* prefetch the block LANES_AHEAD on */ \
                for (int c = 0; c < 4; c++) later[c] = rows[c] + LANES_AHEAD * 4 * row_bytes;        \
                ahead = later;                                                                       \
            }                                                                                        \
        }                                                                                            \
        switch (format) {                                                                            \
            case D3D_T4: T4_COLUMNS(xf, M, K, rows, chunk_bytes, ahead, strip, res); break;                  \
            case D3D_U4: lanes_columns_u4(xf, M, K, rows, chunk_bytes, ahead, strip, res); break;           \
            case D3D_I8: lanes_columns_i8(xf, M, K, rows, chunk_bytes, ahead, strip, res); break;           \
            case D3D_U6: lanes_columns_u6(xf, M, K, rows, chunk_bytes, ahead, strip, res); break;           \
            case D3D_S4: lanes_columns_s4(xf, M, K, rows, chunk_bytes, ahead, strip, res); break;           \
            default: lanes_columns_##SUFFIX(xf, M, K, rows, chunk_bytes, ahead, strip, res);                \
        }                                                                                            \
        for (int64_t m = 0; m < M; m++)                                                              \
            for (int c = 0; c < C; c++) {                                                            \
                STORE_OUTPUT(LOAD, STORE, y, m * N + n0 + c, res[m * 4 + c], bias, n0 + c, residual); \
            }                                                                                        \
    }                                                                                                \
}
LANES_LINEAR(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
LANES_LINEAR(f32, float, IDENTITY, IDENTITY)

/* ---------------------------------------------------------------------------------------------
 * pair tiles (AVX2): the lanes' arithmetic for calls of 5 rows or more over plain weights (bf16, a
 * quantized weight's bf16 values, or fp32). A tile is up to 3 rows x a pair of columns: its 6 chains
 * of 16 lanes in 12 registers, each weight vector loaded once for the tile's rows and each row vector
 * used by both columns — 12 FMAs for 10 loads, where the fused tiles above take 16 FMAs for 20 loads
 * and the strip's half-chains 8 for 6. bf16 weights are widened by interleaving them with zeros
 * (vpunpck{l,h}wd: one operation per 8 values, from one 32-byte load per 16), which takes the lanes
 * k = 0–3, 8–11 of each 16 into one register and 4–7, 12–15 into the other: the rows are converted
 * to fp32 in that order, once per call, and a chain's two registers are put back in lane order
 * before its fold. Every lane runs the same FMAs in the same order; only the registers differ.
 * Rows go in blocks of PAIR_ROW_BLOCK (their fp32 copies stay in L2 while a thread's columns pass
 * over them), each thread owning the same columns in every block.
 * AMD EPYC Zen 3, 2 threads, whole forwards after 256 tokens over the shipped GGUF's bf16 values
 * against the fused tiles and the strip, interleaved (scripts/rows_ab.py), in one-token steps:
 * 5 rows 1.78 → 1.68, 6 1.97 → 1.83, 9 2.76 → 2.67, 17 4.90 → 4.68, 24 6.96 → 6.42, 33 9.8–11.3 →
 * 8.7–8.9, 64 18.5 → 16.4, 512 153 → 138; 8 and 13 rows 2–3% slower (noise ±5%); 3 and 4 rows slower
 * (1.39 → 1.41, 1.48 → 1.61: there the fused tiles decode once for all rows), hence PAIR_MIN_ROWS.
 * The FMAs do not bound them: over L1-resident data one core ran a 3-row tile at ~1.8 FMAs a cycle
 * of the 2 it can issue, whole calls at about half of that (the rows' fp32 copies come from L2 once
 * per column pair).
 * ------------------------------------------------------------------------------------------- */

#define PAIR_MIN_ROWS 5      /* calls of fewer rows take the fused tiles */
#define PAIR_ROW_BLOCK 48    /* rows per block (48 x 1536 floats: 288 KiB of L2; all rows at once: 1.5x slower at 512) */
#define PAIR_AHEAD 8         /* column pairs ahead whose weights are prefetched (4 to 16: within noise) */

/* One 16-lane chain's two registers in lane order (lanes 0–7, 8–15), from the bf16 tiles' order. */
static inline __attribute__((always_inline)) float fold_interleaved(v8 p, v8 q) {
    return fold_v8(_mm256_permute2f128_ps(p, q, 0x20), _mm256_permute2f128_ps(p, q, 0x31));
}
static inline __attribute__((always_inline)) float fold_plain(v8 p, v8 q) { return fold_v8(p, q); }
#define WIDEN_LO_BF16(p) _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *)(p))))
#define WIDEN_HI_BF16(p) _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *)(p))))
#define LOAD_LO_F32(p) v8_load_reg(p)
#define LOAD_HI_F32(p) v8_load_reg((p) + 8)
/* 16 elements of a row from src as the tiles read them, in fp32 at dst: bf16 in the interleaved
 * order (widened as the weights are), fp32 as they are. */
#define ROW_INTERLEAVED(dst, src) (v8_store((dst), WIDEN_LO_BF16(src)), v8_store((dst) + 8, WIDEN_HI_BF16(src)))
#define ROW_PLAIN(dst, src) (v8_store((dst), v8_load(src)), v8_store((dst) + 8, v8_load((src) + 8)))

/* One k step of 16 for R rows (1–3) and the pair's columns a and b; r<i><c><h>: row i, column c,
 * register h of its chain. */
#define PAIR_HALF(WIDEN, h, off)                                                                     \
    {                                                                                                \
        v8 wa_ = WIDEN(wa + k), wb_ = WIDEN(wb + k), x_;                                             \
        x_ = v8_load_reg(x0 + k + off); r0a##h = v8_fma(x_, wa_, r0a##h); r0b##h = v8_fma(x_, wb_, r0b##h); \
        if (R > 1) { x_ = v8_load_reg(x1 + k + off); r1a##h = v8_fma(x_, wa_, r1a##h); r1b##h = v8_fma(x_, wb_, r1b##h); } \
        if (R > 2) { x_ = v8_load_reg(x2 + k + off); r2a##h = v8_fma(x_, wa_, r2a##h); r2b##h = v8_fma(x_, wb_, r2b##h); } \
    }

#define PAIR_LINEAR(SUFFIX, T_ELEM, LOAD, STORE, WIDEN_LO, WIDEN_HI, ROW_ORDER, FOLD)                 \
static inline __attribute__((always_inline)) void pair_tile_##SUFFIX(                                 \
        const int R, const float *x0, const float *x1, const float *x2, const T_ELEM *wa,             \
        const T_ELEM *wb, int64_t K, float out[3][2]) {                                              \
    v8 r0a0 = v8_zero(), r0a1 = r0a0, r0b0 = r0a0, r0b1 = r0a0, r1a0 = r0a0, r1a1 = r0a0, r1b0 = r0a0, \
       r1b1 = r0a0, r2a0 = r0a0, r2a1 = r0a0, r2b0 = r0a0, r2b1 = r0a0;                               \
    for (int64_t k = 0; k < K; k += 16) {                                                            \
        PAIR_HALF(WIDEN_LO, 0, 0)                                                                    \
        PAIR_HALF(WIDEN_HI, 1, 8)                                                                    \
    }                                                                                                \
    out[0][0] = FOLD(r0a0, r0a1); out[0][1] = FOLD(r0b0, r0b1);                                      \
    if (R > 1) { out[1][0] = FOLD(r1a0, r1a1); out[1][1] = FOLD(r1b0, r1b1); }                       \
    if (R > 2) { out[2][0] = FOLD(r2a0, r2a1); out[2][1] = FOLD(r2b0, r2b1); }                       \
}                                                                                                    \
static void pair_##SUFFIX##_body(const T_ELEM *x, int64_t x_stride, const T_ELEM *w, const T_ELEM *bias, \
                                 const T_ELEM *residual, T_ELEM *y, int64_t M, int64_t N, int64_t K,  \
                                 float *scratch) {                                                   \
    float *xf = scratch;                                                                             \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t m = 0; m < M; m++)                                                                  \
        for (int64_t k = 0; k < K; k += 16) ROW_ORDER(xf + m * K + k, x + m * x_stride + k);   \
    int64_t pairs = (N + 1) / 2;                                                                     \
    for (int64_t mb = 0; mb < M; mb += PAIR_ROW_BLOCK) {                                             \
        int64_t end = M - mb < PAIR_ROW_BLOCK ? M : mb + PAIR_ROW_BLOCK;                             \
        _Pragma("omp for schedule(static) nowait")  /* the same pairs per thread in every block */  \
        for (int64_t p = 0; p < pairs; p++) {                                                        \
            int64_t n0 = 2 * p;                                                                      \
            int C = N - n0 < 2 ? 1 : 2;                                                              \
            const T_ELEM *wa = w + n0 * K, *wb = C > 1 ? wa + K : wa;  /* a lone last column twice */ \
            if (p + PAIR_AHEAD < pairs) {                                                            \
                const char *ahead = (const char *)(w + (n0 + 2 * PAIR_AHEAD) * K);                   \
                int64_t bytes = (N - n0 - 2 * PAIR_AHEAD < 2 ? 1 : 2) * K * (int64_t)sizeof(T_ELEM); \
                for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(ahead + at, 0, 0);    \
            }                                                                                        \
            for (int64_t m = mb; m < end;) {  /* tiles of 3 rows; 4 left go as 2 + 2 */              \
                int64_t left = end - m;                                                              \
                int R = left >= 3 && left != 4 ? 3 : left >= 2 ? 2 : 1;                             \
                const float *x0 = xf + m * K, *x1 = R > 1 ? x0 + K : x0, *x2 = R > 2 ? x0 + 2 * K : x0; \
                float out[3][2];                                                                     \
                if (R == 3) pair_tile_##SUFFIX(3, x0, x1, x2, wa, wb, K, out);                       \
                else if (R == 2) pair_tile_##SUFFIX(2, x0, x1, x2, wa, wb, K, out);                  \
                else pair_tile_##SUFFIX(1, x0, x1, x2, wa, wb, K, out);                              \
                for (int r = 0; r < R; r++)                                                          \
                    for (int c = 0; c < C; c++) {                                                    \
                        STORE_OUTPUT(LOAD, STORE, y, (m + r) * N + n0 + c, out[r][c], bias, n0 + c, residual); \
                    }                                                                                \
                m += R;                                                                              \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    _Pragma("omp barrier")                                                                           \
}
PAIR_LINEAR(bf16, uint16_t, bf16_to_f32, f32_to_bf16, WIDEN_LO_BF16, WIDEN_HI_BF16, ROW_INTERLEAVED, fold_interleaved)
PAIR_LINEAR(f32, float, IDENTITY, IDENTITY, LOAD_LO_F32, LOAD_HI_F32, ROW_PLAIN, fold_plain)

/* ---------------------------------------------------------------------------------------------
 * lane-packed tiles (AVX2, bf16): the lanes' arithmetic with each lane's chain run across 16 output
 * columns at once. A bf16 weight is copied once into the LANE_PACKED layout (formats.h): per 16
 * columns and per lane l, the columns' weights at k = l, l + 16, l + 32, … — 16 bf16 a step, placed
 * so that interleaving them with zeros (vpunpck{l,h}wd) widens columns 0–7 into one register and
 * 8–15 into the other. A row's element k = 16j + l is broadcast to every column, so lane l of
 * output (r, n) is one accumulator's column n: the reference lanes' FMAs, in their order. The 16
 * lanes' accumulators go to memory after their chains and are folded there in fold_lanes's order,
 * 8 columns at a time. A tile is up to 6 rows: 12 accumulators, 2 weight registers and the
 * broadcast — 12 FMAs for 8 loads, where the pair tiles take 12 for 10 and their rows' vectors
 * come from L2 once per pair of columns (here a row's elements are broadcast from L1).
 * Rows are converted to fp32 once per call, lane by lane (row r, lane l, step j at r·K + l·K/16 + j);
 * rows go in blocks of PAIR_ROW_BLOCK, each thread owning the same columns in every block.
 * AMD EPYC Zen 3, 2 threads, a throwaway harness over SmolLM2-135M's 30 layers and head (random
 * bf16 weights), against the pair tiles (1–4 rows: the fused tiles), every output identical:
 * 1 row 13.6 → 11.3 ms, 3 rows 14.2 → 12.3, 5 rows 14.0 → 12.5, 17 rows 41.0 → 32.2, 48 rows 101 → 84
 * (~71–77 G FMA/s of the ~90–100 two cores issue).
 * ------------------------------------------------------------------------------------------- */

#define LANE_TILE_ROWS 6

/* STORE_OUTPUT for 8 consecutive outputs of a row: y[0…7] = v (+ bias[0…7]) rounded, then
 * + residual[0…7] rounded again — the same operations lane by lane. */
static inline __attribute__((always_inline)) void store8_bf16(v8 v, const uint16_t *bias, const uint16_t *residual,
                                                              uint16_t *y) {
    if (bias) v = _mm256_add_ps(v, v8_from_bf16(bias));
    if (residual) v = _mm256_add_ps(v8_from_bf16(residual), _mm256_castsi256_ps(_mm256_slli_epi32(v8_bf16_bits(v), 16)));
    v8_store_bf16(y, v);
}

/* out[r][h] = columns 8h … 8h + 7 of rows r < R over one block of 16 columns (its K·16 weights at wb). */
#define LANE_TILE(R)                                                                                 \
static inline __attribute__((always_inline)) void lane_tile_##R(const float *xf, int64_t K, const uint16_t *wb, \
                                                                 v8 out[LANE_TILE_ROWS][2]) {      \
    int64_t J = K / 16;                                                                              \
    v8 lanes[16][R][2];                                                                              \
    for (int l = 0; l < 16; l++) {                                                                   \
        v8 lo[R], hi[R];                                                                             \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) lo[r] = hi[r] = v8_zero();               \
        const uint16_t *w = wb + l * J * 16;                                                         \
        const float *x = xf + l * J;                                                                 \
        for (int64_t j = 0; j < J; j++) {                                                            \
            v8 w0 = WIDEN_LO_BF16(w + 16 * j), w1 = WIDEN_HI_BF16(w + 16 * j);                       \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                    \
                v8 xb = v8_splat(x + r * K + j);                                                     \
                lo[r] = v8_fma(xb, w0, lo[r]);                                                       \
                hi[r] = v8_fma(xb, w1, hi[r]);                                                       \
            }                                                                                        \
        }                                                                                            \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) { lanes[l][r][0] = lo[r]; lanes[l][r][1] = hi[r]; } \
    }                                                                                                \
    /* fold_lanes, per column: lane i + lane i+8, then i + i+4, then (0 + 2) + (1 + 3) */            \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                              \
        for (int h = 0; h < 2; h++) {                                                                \
            v8 t[8];                                                                                 \
            for (int i = 0; i < 8; i++) t[i] = _mm256_add_ps(lanes[i][r][h], lanes[i + 8][r][h]);    \
            for (int i = 0; i < 4; i++) t[i] = _mm256_add_ps(t[i], t[i + 4]);                        \
            out[r][h] = _mm256_add_ps(_mm256_add_ps(t[0], t[2]), _mm256_add_ps(t[1], t[3]));         \
        }                                                                                            \
}
LANE_TILE(1) LANE_TILE(2) LANE_TILE(3) LANE_TILE(4) LANE_TILE(5) LANE_TILE(6)

static __attribute__((unused)) void lane_packed_bf16_body(const uint16_t *x, int64_t x_stride, const uint16_t *wp, const uint16_t *bias,
                                  const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K,
                                  float *scratch) {
    float *xf = scratch;
    int64_t J = K / 16, blocks = (N + 15) / 16;
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++)
        for (int l = 0; l < 16; l++)
            for (int64_t j = 0; j < J; j++) xf[m * K + l * J + j] = bf16_to_f32(x[m * x_stride + 16 * j + l]);
    for (int64_t mb = 0; mb < M; mb += PAIR_ROW_BLOCK) {
        int64_t end = M - mb < PAIR_ROW_BLOCK ? M : mb + PAIR_ROW_BLOCK;
        _Pragma("omp for schedule(static) nowait")  /* the same columns per thread in every block */
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *wb = wp + b * 16 * K;
            for (int64_t m = mb; m < end;) {  /* tiles of 6 rows; 7–11 left go as two near-equal tiles */
                int64_t left = end - m;
                int R = left > LANE_TILE_ROWS && left < 2 * LANE_TILE_ROWS ? (int)(left + 1) / 2
                      : left > LANE_TILE_ROWS ? LANE_TILE_ROWS : (int)left;
                const float *xr = xf + m * K;
                v8 out[LANE_TILE_ROWS][2];
                switch (R) {
                    case 1: lane_tile_1(xr, K, wb, out); break;
                    case 2: lane_tile_2(xr, K, wb, out); break;
                    case 3: lane_tile_3(xr, K, wb, out); break;
                    case 4: lane_tile_4(xr, K, wb, out); break;
                    case 5: lane_tile_5(xr, K, wb, out); break;
                    default: lane_tile_6(xr, K, wb, out);
                }
                for (int r = 0; r < R; r++)
                    for (int h = 0; h < 2; h++) {
                        int64_t n0 = b * 16 + 8 * h, at = (m + r) * N + n0;
                        if (n0 + 8 <= N) {
                            store8_bf16(out[r][h], bias ? bias + n0 : NULL, residual ? residual + at : NULL, y + at);
                            continue;
                        }
                        float v[8];
                        v8_store(v, out[r][h]);
                        for (int c = 0; n0 + c < N; c++)
                            STORE_OUTPUT(bf16_to_f32, f32_to_bf16, y, at + c, v[c], bias, n0 + c, residual);
                    }
                m += R;
            }
        }
    }
    _Pragma("omp barrier")
}
#else
static int64_t lanes_scratch(int64_t M, int64_t K, int threads) { (void)M, (void)K, (void)threads; return 0; }
#endif

/* ---------------------------------------------------------------------------------------------
 * Quantized weights without AVX2 (portable builds): each block of 4 columns is decoded into a
 * strip of fp32 values and the reference lanes run over it with the rows in fp32 — the same chains
 * as over the bf16 weights, whose widening to fp32 is exact.
 * ------------------------------------------------------------------------------------------- */

static int64_t strip_scratch(int64_t M, int64_t K, int threads) { return M * K + threads * 4 * K; }

#ifndef D3D_AVX2

#define STRIP_LINEAR(SUFFIX, T_ELEM, LOAD, STORE)                                                    \
static void strip_##SUFFIX##_body(const T_ELEM *x, int64_t x_stride, const d3d_weight *w, const T_ELEM *bias, \
                                  const T_ELEM *residual, T_ELEM *y, int64_t M, int64_t N, int64_t K, \
                                  float *scratch) {                                                  \
    float *xf = scratch, *strip = scratch + M * K + omp_get_thread_num() * 4 * K;                    \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t m = 0; m < M; m++)                                                                  \
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = LOAD(x[m * x_stride + k]);                   \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t n0 = 0; n0 < N; n0 += COLS) {                                                       \
        int C = N - n0 < COLS ? (int)(N - n0) : COLS;                                                \
        for (int c = 0; c < C; c++)                                                                  \
            for (int64_t b = 0; b < K / CHUNK; b++) {                                                \
                int64_t format;                                                                      \
                const void *block = block_at(w, n0 + c, b, K, &format);                              \
                decode_block_scalar(format, block, strip + c * K + b * CHUNK);                       \
            }                                                                                        \
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {                                                   \
            int R = M - m0 < ROWS ? (int)(M - m0) : ROWS;                                            \
            float out[ROWS][COLS];                                                                   \
            dot_block_f32(xf + m0 * K, K, strip, K, R, C, NULL, out);                                \
            for (int r = 0; r < R; r++)                                                              \
                for (int c = 0; c < C; c++) {                                                        \
                    STORE_OUTPUT(LOAD, STORE, y, (m0 + r) * N + n0 + c, out[r][c], bias, n0 + c, residual); \
                }                                                                                    \
        }                                                                                            \
    }                                                                                                \
}
STRIP_LINEAR(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
#endif

/* ---------------------------------------------------------------------------------------------
 * Quantized weights with AVX-512 BF16: a bf16 weight there takes the packed pair dot products, so
 * a quantized one must too. Each run of up to 4 column groups is decoded (by the AVX2 decoders
 * every AVX-512 CPU has) into a per-thread panel in the packed layout — (G, K/2, 16, 2) bf16 —
 * and the packed tiles run over the panel exactly as over packed weights.
 * ------------------------------------------------------------------------------------------- */

#ifdef D3D_AVX2
/* panel[g][k/2][j][k%2] = bf16 value of weight row (g0 + g)·16 + j at k, zeros past row N. */
static void decode_panel(const d3d_weight *w, int64_t g0, int G, int64_t N, int64_t K, uint16_t *panel) {
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 16; j++) {
            int64_t n = (g0 + g) * 16 + j;
            uint16_t *column = panel + (int64_t)g * 16 * K + 2 * j;
            for (int64_t b = 0; b < K / CHUNK; b++) {
                float v[CHUNK];
                if (n < N) {
                    int64_t format;
                    const void *block = block_at(w, n, b, K, &format);
                    decode_block(format, block, v);
                } else {
                    memset(v, 0, sizeof v);
                }
                for (int e = 0; e < CHUNK; e++) {
                    int64_t k = b * CHUNK + e;
                    column[(k / 2) * 32 + (k % 2)] = f32_to_bf16(v[e]);
                }
            }
        }
}

/* For the tests on any AVX2 machine: the panel of groups g0 … g0+G-1. */
void d3d_decode_panel(const d3d_weight *w, int64_t g0, int G, int64_t N, int64_t K, uint16_t *panel) {
    decode_panel(w, g0, G, N, K, panel);
}
#endif

#ifdef D3D_AVX512_BF16
static int64_t panel_scratch(int64_t K, int threads) { return threads * (GROUPS * 16 * K / 2); }

static void packed_quantized_bf16_body(const uint16_t *x, int64_t x_stride, const d3d_weight *w,
                                       const uint16_t *bias, const uint16_t *residual, uint16_t *y,
                                       int64_t M, int64_t N, int64_t K, float *scratch) {
    int64_t groups = (N + 15) / 16;
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t first = groups * me / threads, last = groups * (me + 1) / threads;
    uint16_t *panel = (uint16_t *)(scratch + me * (GROUPS * 16 * K / 2));
    for (int64_t g0 = first; g0 < last; g0 += GROUPS) {
        int G = last - g0 < GROUPS ? (int)(last - g0) : GROUPS;
        decode_panel(w, g0, G, N, K, panel);
        packed_bf16_block(x, x_stride, panel, G, g0 * 16, bias, residual, y, M, N, K, 0, 0);
    }
    _Pragma("omp barrier")
}
#else
static int64_t panel_scratch(int64_t K, int threads) { (void)K, (void)threads; return 0; }
#endif

/* ---------------------------------------------------------------------------------------------
 * Grouped quantized weights (formats.h's G4, G8): a call of 1-4 rows with AVX-512 BF16 decodes 16
 * columns' codes at once into the packed layout's pair vector — codes to fp32, the block's fma or
 * product with per-lane scales, vcvtne2ps2bf16's nearest-even rounding (exact here: every decoded
 * value is 0 or at least 2^-24, so neither its input nor its output is ever subnormal) — and feeds
 * it to the same vdpbf16ps chain as the packed bf16 weight: the same values, the same bits, a third
 * of the bytes.
 * ------------------------------------------------------------------------------------------- */

/* The format all of `w`'s parts share, or -1. */
static int64_t parts_format(const d3d_weight *w) {
    int64_t format = w->parts[0].format;
    for (int p = 0; p < MAX_PARTS && w->parts[p].rows; p++)
        if (w->parts[p].format != format) return -1;
    return format;
}

/* Bytes of the G4 or G8 copy of `w` (N, K; its parts all U4 or all I8, K whole blocks) and, with
 * `out`, the copy itself (columns past N padded with zero scales and codes). */
static int64_t group_pack(const d3d_weight *w, int64_t N, int64_t K, void *out) {
    int64_t format = parts_format(w), blocks = K / CHUNK, groups = (N + 15) / 16;
    int64_t size = format == D3D_U4 ? (int64_t)sizeof(block_g4) : (int64_t)sizeof(block_g8);
    if (!out) return groups * blocks * size;
    memset(out, 0, groups * blocks * size);
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < blocks; b++) {
            char *to = (char *)out + (g * blocks + b) * size;
            for (int j = 0; j < 16 && g * 16 + j < N; j++) {
                int64_t f;
                const void *from = block_at(w, g * 16 + j, b, K, &f);
                int half = j / 8, lane0 = 2 * (j % 8);  /* lanes lane0, lane0 + 1 of its half */
                for (int p = 0; p < 16; p++)
                    for (int e = 0; e < 2; e++) {
                        int k = 2 * p + e;
                        if (format == D3D_U4) {
                            const block_u4 *u = from;
                            block_g4 *g4 = (block_g4 *)to;
                            g4->scale[j] = u->scale, g4->offset[j] = u->offset;
                            g4->q[p][lane0 + e] |= (uint8_t)(nibble(u->q, k) << (4 * half));
                        } else {
                            const block_i8 *i = from;
                            block_g8 *g8 = (block_g8 *)to;
                            g8->scale[j] = i->scale;
                            g8->q[p][16 * half + lane0 + e] = i->q[k];
                        }
                    }
            }
        }
    return groups * blocks * size;
}

/* Bytes of `rows` rows of K weights as T4 (the rows zero-padded to a multiple of 4). */
static int64_t table_bytes(int64_t rows, int64_t K) { return (rows + 3) / 4 * 4 * (K / CHUNK) * (int64_t)sizeof(block_t4); }

/* Bytes of the T4 copy of `w`'s runs of 4-bit blocks (U4, S4; K whole blocks) and, with `out`, the
 * copy itself: each such run in turn, per block of 4 of its rows (zero tables past its last) and per
 * block b of K, the 4 rows' tables. Runs of other formats have none (tables_of). */
static int64_t table_pack(const d3d_weight *w, int64_t K, void *out) {
    int64_t blocks = K / CHUNK, size = 0;
    for (int p = 0; p < MAX_PARTS && w->parts[p].rows; p++) {
        const d3d_part *part = &w->parts[p];
        if (!is_4bit(part->format)) continue;
        if (out) {
            block_t4 *to = (block_t4 *)((char *)out + size);
            memset(to, 0, table_bytes(part->rows, K));
            _Pragma("omp parallel for schedule(static)")
            for (int64_t n = 0; n < part->rows; n++)
                for (int64_t b = 0; b < blocks; b++)
                    table_block(part->format, (const char *)part->data + (n * blocks + b) * block_bytes(part->format),
                                to + ((n / 4) * blocks + b) * 4 + n % 4);
        }
        size += table_bytes(part->rows, K);
    }
    return size;
}

#if defined(D3D_AVX2) && !defined(D3D_AVX512_BF16)
/* `w` as the lanes read it with its T4 copy: each run of 4-bit blocks replaced by its tables. */
static d3d_weight tables_of(const d3d_weight *w, int64_t K) {
    d3d_weight tables = {{{0}}};
    const char *at = w->grouped.data;
    for (int p = 0; p < MAX_PARTS && w->parts[p].rows; p++) {
        tables.parts[p] = w->parts[p];
        if (!is_4bit(w->parts[p].format)) continue;
        tables.parts[p].data = at, tables.parts[p].format = D3D_T4;
        at += table_bytes(w->parts[p].rows, K);
    }
    return tables;
}
#endif

/* Whether this build's calls of a few rows read grouped copies (AVX-512 BF16: G4, G8; the AVX2
 * lanes: T4). */
int d3d_grouped_linear(void) {
#if defined(D3D_AVX512_BF16) || defined(D3D_AVX2)
    return 1;
#else
    return 0;
#endif
}

#ifdef D3D_AVX512_BF16
/* Scales of columns l/2 (first half) or 8 + l/2 (second) in lane l. */
static inline __m512 lane_pairs(__m512 per_column, int half) {
    const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(half ? _mm512_add_epi32(first, _mm512_set1_epi32(8)) : first, per_column);
}

/* The weights of pair p (k = 2p, 2p + 1) of a grouped block for its 16 columns, as the packed layout's
 * pair vector: the codes widened, times the scale (plus the offset for G4) per lane, rounded to bf16
 * — the same values as the bf16 copy (see above). s0/s1, o0/o1: the block's scales and offsets
 * spread by lane_pairs. */
static inline __attribute__((always_inline)) __m512bh grouped_pair(const char *at, int p, int g4, __m512 s0, __m512 s1,
                                                                   __m512 o0, __m512 o1) {
    __m512 v0, v1;
    if (g4) {
        const __m512i low = _mm512_set1_epi32(15);
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(((const block_g4 *)at)->q[p])));
        v0 = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(_mm512_and_si512(q, low)), o0);
        v1 = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), o1);
    } else {
        const int8_t *q = ((const block_g8 *)at)->q[p];
        v0 = _mm512_mul_ps(s0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        v1 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
    }
    return _mm512_cvtne2ps_pbh(v1, v0);
}

/* A grouped block's scales (and offsets) spread by lane_pairs. */
static inline __attribute__((always_inline)) void grouped_scales(const char *at, int g4, __m512 *s0, __m512 *s1,
                                                                 __m512 *o0, __m512 *o1) {
    __m512 scale = _mm512_loadu_ps((const float *)at);
    *s0 = lane_pairs(scale, 0), *s1 = lane_pairs(scale, 1);
    if (g4) {
        __m512 offset = _mm512_loadu_ps((const float *)at + 16);
        *o0 = lane_pairs(offset, 0), *o1 = lane_pairs(offset, 1);
    } else {
        *o0 = *o1 = _mm512_setzero_ps();
    }
}

#define GROUPED_ROWS 4  /* calls of up to this many rows read the grouped blocks (more: the bf16 values) */
#define GROUPED_AHEAD 4  /* blocks ahead that each group's stream prefetches, into L2 (prefetcht1): AMD EPYC
                          * Zen 5, non-temporal: none 8.1 ms a step, 8: ~5.8, noisy; Zen 4, whole one-token
                          * forwards alternated 11 times: 8 ahead non-temporal 8.2-8.7 ms, 8 ahead into
                          * L2 1.12-1.14x faster, 4 ahead into L2 1.18-1.21x (2 rows 1.07x), 16 ahead or
                          * into L1 no better */
/* R rows x up to GT column groups: each group's pair vector is decoded once and feeds every row. */
static inline __attribute__((always_inline)) void grouped_tile(
        const uint16_t *x, int64_t x_stride, const char *data, int64_t g0, int G, const int R, const int GT,
        int64_t blocks, int64_t size, int g4, __m512 acc[GROUPED_ROWS][4]) {
    for (int r = 0; r < R; r++)
        for (int g = 0; g < GT; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const char *at[4];
        __m512 s0[4], s1[4], o0[4], o1[4];
        for (int g = 0; g < GT; g++) {
            at[g] = data + ((g0 + (g < G ? g : 0)) * blocks + b) * size;
            for (int64_t line = 0; line < size; line += 64)
                __builtin_prefetch(at[g] + GROUPED_AHEAD * size + line, 0, 2);
            grouped_scales(at[g], g4, &s0[g], &s1[g], &o0[g], &o1[g]);
        }
        for (int p = 0; p < 16; p++) {
            __m512 xp[GROUPED_ROWS];
            for (int r = 0; r < R; r++) xp[r] = broadcast_pair(x + r * x_stride, b * 16 + p);
            for (int g = 0; g < GT; g++) {
                if (g >= G) break;
                __m512bh w = grouped_pair(at[g], p, g4, s0[g], s1[g], o0[g], o1[g]);
                for (int r = 0; r < R; r++)  /* as FMA_BF16 */
                    acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)_mm512_castps_si512(xp[r]), w);
            }
        }
    }
}

static void grouped_bf16_body(const uint16_t *x, int64_t x_stride, const d3d_part *grouped, const uint16_t *bias,
                              const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    int64_t groups = (N + 15) / 16, blocks = K / CHUNK, g4 = grouped->format == D3D_G4;
    int64_t size = g4 ? (int64_t)sizeof(block_g4) : (int64_t)sizeof(block_g8);
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t first = groups * me / threads, last = groups * (me + 1) / threads;
    /* groups side by side: 4 at one or two rows, 2 beside more rows' accumulators (Zen 4, the shipped
     * GGUF's G8 head, whole 2-row forwards interleaved: 1.12-1.16 one-token steps against 1.18 at 2) */
    int tile = M <= 2 ? 4 : 2;
    for (int64_t g0 = first; g0 < last; g0 += tile) {
        int G = last - g0 < tile ? (int)(last - g0) : tile;
        __m512 acc[GROUPED_ROWS][4];
        const char *data = grouped->data;
        switch (M) {
            case 1: grouped_tile(x, x_stride, data, g0, G, 1, 4, blocks, size, (int)g4, acc); break;
            case 2: grouped_tile(x, x_stride, data, g0, G, 2, 4, blocks, size, (int)g4, acc); break;
            case 3: grouped_tile(x, x_stride, data, g0, G, 3, 2, blocks, size, (int)g4, acc); break;
            default: grouped_tile(x, x_stride, data, g0, G, 4, 2, blocks, size, (int)g4, acc); break;
        }
        for (int64_t r = 0; r < M; r++)
            for (int g = 0; g < G; g++) {
                int64_t n = (g0 + g) * 16, at = r * N + n;
                store16_bf16(acc[r][g], bias ? bias + n : 0, residual ? residual + at : 0, y + at,
                             N - n < 16 ? (int)(N - n) : 16);
            }
    }
    _Pragma("omp barrier")
}
#endif


/* ---------------------------------------------------------------------------------------------
 * 4-bit blocks looked up (AVX-512 BF16 with VBMI): a Q4 block has only 16 values, so a column's 32
 * weights decode as a lookup in the block's table — its 16 values bf16(fma(s, q, o)) made by one fma
 * and one rounding (vcvtne2ps2bf16, exact here as in grouped_pair), each code put in the low bits of a
 * 16-bit index by vpmultishiftqb, vpermw reading the table (its entries twice: an index's fifth bit
 * is the next code's). The AMX tiles' 4-bit operand (formats.h's A4, amx.h) is decoded so; the quads
 * below are the same idea with 4 columns to a vector. (A path that read every row count through
 * these one-column lookups, L4, was slower than the quads at every row count on an AMD EPYC Zen 4 —
 * 1.12× a one-token step, 1.18-1.28× 2-17 rows — and was removed; docs/performance.md.)
 * ------------------------------------------------------------------------------------------- */
#if defined(D3D_AVX512_BF16) && defined(__AVX512VBMI__)
#define D3D_LOOKUP 1

/* The multishift control: output qword j's words read source qword j % 2 (the 16 code bytes are
 * broadcast to every 128-bit lane) at the 4-bit slots place_code puts weights 4j … 4j + 3 in. */
static inline __m512i lookup_control(void) {
    uint64_t ctrl[8];
    for (int j = 0; j < 8; j++) {
        uint64_t c = 0;
        for (int i = 0; i < 4; i++) {
            uint64_t bit = 4 * ((j / 2) * 4 + i);
            c |= bit << (16 * i) | bit << (16 * i + 8);
        }
        ctrl[j] = c;
    }
    return _mm512_loadu_si512(ctrl);
}
static inline __m512 lookup_codes(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

/* Put weight k's code where lookup_block reads it: bit 64·((k/4) mod 2) + 4·(4·(k/8) + k mod 4) of
 * the block's 16 code bytes (formats.h's A4). */
static inline void place_nibble(uint8_t q[16], int k, int code) {
    int bit = 64 * ((k / 4) % 2) + 4 * (4 * (k / 8) + k % 4);
    q[bit / 8] |= (uint8_t)(code << (bit % 8));
}
static inline void place_code(block_u4 *to, int k, int code) { place_nibble(to->q, k, code); }

/* The block's 32 weights, bf16 in k order — the values decode_block_scalar gives. */
static inline __attribute__((always_inline)) __m512bh lookup_block(const block_u4 *at, __m512i control, __m512 codes) {
    __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(at->scale), codes, _mm512_set1_ps(at->offset));
    __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
    __m512i index = _mm512_multishift_epi64_epi8(control, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)at->q)));
    return (__m512bh)_mm512_permutexvar_epi16(index, table);
}

/* Block b of the 16-column group g of a weight whose blocks are placed for the lookups (A4): groups
 * in runs of `run` (the last run as many as remain), each run block by block — the run's groups' 16
 * blocks side by side at each block step. */
static inline const block_u4 *looked_up_at(const void *data, int64_t g, int64_t b, int64_t groups, int64_t blocks,
                                           int64_t run) {
    int64_t first = g / run * run, width = groups - first < run ? groups - first : run;
    return (const block_u4 *)data + (first * blocks + b * width + g - first) * 16;
}

/* Bytes of the A4 copy of a U4 weight (N, K) in runs of `run` groups, and with `out` the copy
 * (columns past N zero): each block's scale and offset, its codes placed by place_code. */
static int64_t looked_up_pack(const d3d_weight *w, int64_t N, int64_t K, void *out, int64_t run) {
    int64_t blocks = K / CHUNK, groups = (N + 15) / 16, size = groups * 16 * blocks * (int64_t)sizeof(block_u4);
    if (!out) return size;
    memset(out, 0, size);
    _Pragma("omp parallel for schedule(static)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t format;
            const block_u4 *from = block_at(w, n, b, K, &format);
            block_u4 *to = (block_u4 *)looked_up_at(out, n / 16, b, groups, blocks, run) + n % 16;
            to->scale = from->scale, to->offset = from->offset;
            for (int k = 0; k < CHUNK; k++) place_code(to, k, nibble(from->q, k));
        }
    return size;
}

/* 64 bytes into a register of their own, loaded once: GCC otherwise reloads a vector for each product
 * that reads it (20 loads per 16 pair dot products in a 4 x 4 tile where 8 do). The same value. */
static inline __attribute__((always_inline)) __m512bh load_reg(const uint16_t *p) {
#if defined(__GNUC__) && defined(__x86_64__)
    __m512i v;
    __asm__ volatile("vmovdqu64 %1, %0" : "=v"(v) : "m"(*(const uint16_t (*)[32])p));
    return (__m512bh)v;
#else
    return (__m512bh)_mm512_loadu_si512(p);
#endif
}

/* ---------------------------------------------------------------------------------------------
 * 4-bit blocks looked up in quads (formats.h's QL for U4 blocks, QS for S4's, QUAD_PACKED; AVX-512
 * BF16 with VBMI where the AMX tiles are off; d3d_quads(0), D3D_QUADS=0 turns them off):
 * a vector of 32 bf16 weights is a quad — 4 output columns × 8 consecutive k —, so its 4 columns'
 * tables of 16 values (one fma and half a rounding each per block, the 4 scales and offsets each one
 * 128-bit broadcast) fit the two registers one vpermi2w reads, and each code, placed by a word shift
 * from the quad block's one 64-byte load of codes and its column's bits set by one vpternlogd,
 * decodes in one lookup: 4 vector operations per 32 weights with the pair dot product,
 * where the grouped blocks' decode (grouped_pair) takes 9. (AMD EPYC Zen 4, one row from cache:
 * 5.5 cycles per 32 weights a thread with a 128-bit broadcast of each step's codes and 8 scalar
 * broadcasts of the scales and offsets per block, 4.7-4.9 with these loads.) A lane of a quad is one column's pair
 * slot (lane 4c + s: column c, the pairs 4i + s of each step i), so the chains are the quads' own:
 * per row, column and slot one vdpbf16ps chain over the steps in k order, the 4 slots folded as
 * (s0 + s1) + (s2 + s3) (quad_fold), then the bias and residual as store16_bf16 adds them. Calls of up
 * to QUAD_FUSED rows decode each vector once for all of them; more rows read the bf16 values laid
 * out in the same quads (QUAD_PACKED) in 6 x 4 tiles, the packed layout's shape — the same chains,
 * so every row count gives the row alone's bits (tests/test_quantized.py's quad reference). AMD EPYC
 * Zen 4, the shipped Q4_1 GGUF, against the grouped blocks: a one-token step 4.5-4.6 ms against
 * 5.6-5.9, a 17-row verification 14.2-14.4 ms against 14.3-14.8 (scripts/step_costs.py, alternated).
 * Whole forwards in one-token steps (scripts/rows_ab.py, interleaved), every row count up to 6 taking
 * a run's 8 quads at once (quad_tile) against 2-4 rows in passes of 4 quads and more reading the
 * bf16 values: 2 rows 1.06-1.17 against 1.41-1.43, 3 rows 1.29-1.34 against 1.49-1.55, 4 rows
 * 1.51-1.52 against 1.71-1.87, 5 rows 1.79 against 2.14-2.30, 6 rows 1.92 against 2.18-2.40 (7-8
 * rows decoded so were no faster than the bf16 values).
 * ------------------------------------------------------------------------------------------- */
#define QUAD_RUN 8    /* quads side by side in the QL stream: a one-row call's chains, 32 columns */
#define QUAD_FUSED 6  /* calls of up to this many rows decode the blocks; more read QUAD_PACKED */
#define QUAD_NARROW 3  /* calls of up to this many rows broadcast x's steps as they go */
#define QUAD_AHEAD 2  /* block steps of a run (768 bytes each) ahead that its stream prefetches */
static int quads_on;

static inline __m512i quad_columns(void) {  /* word w: its column in the quad, the index's bits 0-1 */
    uint16_t c[32];
    for (int w = 0; w < 32; w++) c[w] = (uint16_t)(w / 8);
    return _mm512_loadu_si512(c);
}

/* Code q of the table's 16 values at element e of every 128-bit lane for table register t (0-3):
 * 4t + e / 4 — the lanes' elements are the quad's 4 columns, e mod 4 (quad_tables). */
static inline __m512 quad_codes(int t) {
    float q[16];
    for (int e = 0; e < 16; e++) q[e] = (float)(4 * t + e / 4);
    return _mm512_loadu_ps(q);
}

/* Word w of a quad block's vector at step s (column w/8, weight 8s + w mod 8): bits 4s … 4s + 3 of its
 * 64 code bytes' word w, so that one shift puts each step's code in the index's bits 2-5. */
static inline void place_quad_code(uint8_t q[64], int s, int w, int code) {
    int nibble = 4 * w + s;
    q[nibble / 2] |= (uint8_t)(code << (4 * (nibble % 2)));
}

/* The 8 quads of run r at block b. */
static inline const block_ql *quad_at(const void *data, int64_t r, int64_t b, int64_t blocks) {
    return (const block_ql *)data + (r * blocks + b) * QUAD_RUN;
}

/* Bytes of the QL or QS copy of a U4 or S4 weight (N, K), and with `out` the copy (columns past N zero). */
static int64_t quad_pack(const d3d_weight *w, int64_t N, int64_t K, void *out) {
    int64_t blocks = K / CHUNK, runs = (N + 4 * QUAD_RUN - 1) / (4 * QUAD_RUN);
    int64_t size = runs * blocks * QUAD_RUN * (int64_t)sizeof(block_ql);
    if (!out) return size;
    memset(out, 0, size);
    _Pragma("omp parallel for schedule(static)")
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t format;
            const void *from = block_at(w, n, b, K, &format);
            block_ql *to = (block_ql *)quad_at(out, n / (4 * QUAD_RUN), b, blocks) + n % (4 * QUAD_RUN) / 4;
            int c = (int)(n % 4);  /* each column writes its own scale, offset and code bytes */
            const uint8_t *q;
            if (format == D3D_U4) {
                const block_u4 *u = from;
                to->scale[c] = u->scale, to->offset[c] = u->offset, q = u->q;
            } else {  /* S4: s·(q − 8) as fma(s, q − 8, −0) — its sign of zero included */
                const block_s4 *s4 = from;
                to->scale[c] = s4->scale, to->offset[c] = -0.0f, q = s4->q;
            }
            for (int k = 0; k < CHUNK; k++) place_quad_code(to->q, k / 8, 8 * c + k % 8, nibble(q, k));
        }
    return size;
}

/* The quads' constants: the columns' index bits, and the codes of the 4 table registers' elements
 * (q − 8 for S4 blocks, whose offsets are −0: quad_pack). */
typedef struct { __m512i columns; __m512 codes[4]; } quad_consts;
static inline quad_consts quad_consts_for(int64_t format) {
    quad_consts k;
    k.columns = quad_columns();
    for (int t = 0; t < 4; t++)
        k.codes[t] = format == D3D_QS ? _mm512_sub_ps(quad_codes(t), _mm512_set1_ps(8.0f)) : quad_codes(t);
    return k;
}

/* A quad block's 4 tables, as the two registers vpermi2w reads: index 4q + c is column c's value of
 * code q, bf16(fma(s_c, q, o_c)) — the values decode_block_scalar gives —, each 128-bit lane of a
 * register the 4 columns' values of 4 codes, so that the 4 scales and offsets are each one broadcast. */
static inline __attribute__((always_inline)) void quad_tables(const block_ql *at, const quad_consts *k, __m512i *t01, __m512i *t23) {
    __m512 scale = _mm512_broadcast_f32x4(_mm_loadu_ps(at->scale)), offset = _mm512_broadcast_f32x4(_mm_loadu_ps(at->offset));
    *t01 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(scale, k->codes[1], offset), _mm512_fmadd_ps(scale, k->codes[0], offset));
    *t23 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(scale, k->codes[3], offset), _mm512_fmadd_ps(scale, k->codes[2], offset));
}

/* Step s of a quad block whose 64 code bytes are `codes`: its vector of 32 weights. Each word's code
 * for step s is shifted into the index's bits 2-5 by a word shift — not vpmultishiftqb, which takes the
 * FMA pipes vdpbf16ps needs (AMD EPYC Zen 4, one row from cache: 2.83 against 3.00 TSC cycles per 32
 * weights, a /tmp harness over the same blocks, the same bits). */
static inline __attribute__((always_inline)) __m512bh quad_vector(__m512i codes, int s, __m512i t01, __m512i t23,
                                                                  const quad_consts *k) {
    __m512i placed = s == 0 ? _mm512_slli_epi16(codes, 2) : _mm512_srli_epi16(codes, 4 * s - 2);
    __m512i index = _mm512_ternarylogic_epi32(placed, _mm512_set1_epi16(0x3C), k->columns, 0xEA);  /* code << 2 | column */
    return (__m512bh)_mm512_permutex2var_epi16(t01, index, t23);
}

/* 4 quads' chains (16 columns) folded: lane 4j + c = column c of quad j, (s0 + s1) + (s2 + s3). */
static inline __attribute__((always_inline)) __m512 quad_fold(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 f[4], a[4] = {a0, a1, a2, a3};
    for (int j = 0; j < 4; j++) {
        __m512 h = _mm512_add_ps(a[j], _mm512_permute_ps(a[j], 0xB1));  /* s0 + s1 in lane 4c, s2 + s3 in 4c + 2 */
        f[j] = _mm512_add_ps(h, _mm512_permute_ps(h, 0x4E));            /* their sum in lane 4c */
    }
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    return _mm512_shuffle_f32x4(_mm512_permutex2var_ps(f[0], first, f[1]), _mm512_permutex2var_ps(f[2], first, f[3]), 0x44);
}

/* The row's 8 weights of step i, in every 128-bit lane: the pairs each quad lane multiplies. */
static inline __attribute__((always_inline)) __m512bh quad_x(const uint16_t *row, int64_t i) {
    return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row + 8 * i)));
}

/* R ≤ QUAD_FUSED rows x the 8 quads of run r: each vector decoded once for every row, the run's
 * stream read once in order at every row count (past 2 rows the chains spill to the stack, which
 * costs less than reading the run in passes over parts of its block steps — strided streams; the
 * figures are in the section's head). One to QUAD_NARROW rows read their steps of x broadcast to the
 * 4 lanes as they go; more read them broadcast once per call (quad_wide: plain loads, where a 128-bit
 * broadcast from memory takes a shuffle as well). */
static inline __attribute__((always_inline)) void quad_tile(const uint16_t *x, int64_t x_stride, const void *data,
                                                            int64_t r, int64_t blocks, const int R, const quad_consts *k,
                                                            __m512 acc[QUAD_FUSED][QUAD_RUN]) {
    __m512 a[QUAD_FUSED][QUAD_RUN];  /* local, as quad_packed_tile's */
    for (int m = 0; m < R; m++)
        for (int j = 0; j < QUAD_RUN; j++) a[m][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const block_ql *at = quad_at(data, r, b, blocks);
        for (int line = 0; line < QUAD_RUN * (int)sizeof(block_ql); line += 64)
            _mm_prefetch((const char *)at + QUAD_AHEAD * QUAD_RUN * sizeof(block_ql) + line, _MM_HINT_T0);
        _Pragma("GCC unroll 8")
        for (int j = 0; j < QUAD_RUN; j++) {
            __m512i t01, t23;
            quad_tables(at + j, k, &t01, &t23);
            __m512i codes = _mm512_loadu_si512(at[j].q);
            for (int s = 0; s < 4; s++) {
                __m512bh w = quad_vector(codes, s, t01, t23, k);
                for (int m = 0; m < R; m++)
                    a[m][j] = _mm512_dpbf16_ps(a[m][j], R <= QUAD_NARROW ? quad_x(x + m * x_stride, 4 * b + s)
                                                               : (__m512bh)_mm512_loadu_si512(x + m * x_stride + 32 * (4 * b + s)), w);
            }
        }
    }
    for (int m = 0; m < R; m++)
        for (int j = 0; j < QUAD_RUN; j++) acc[m][j] = a[m][j];
}

/* Floats of scratch the threads' quad_wide copies of up to QUAD_FUSED rows take (two bf16 a float). */
static int64_t quad_scratch(int64_t M, int64_t K, int threads) { return threads * (M < QUAD_FUSED ? M : QUAD_FUSED) * K * 2; }

/* Rows x (M, K) with each step of 8 broadcast to the 4 lanes: (M, K / 8, 32) into `wide`. */
static void quad_wide(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, uint16_t *wide) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < K / 8; i++) _mm512_storeu_si512(wide + (m * K / 8 + i) * 32, (__m512i)quad_x(x + m * x_stride, i));
}

/* Calls of up to QUAD_FUSED rows over a QL weight; threads own runs of 8 quads, each thread with its
 * own quad_wide copy of the rows in `scratch` past QUAD_NARROW rows. */
static void quad_bf16_body(const uint16_t *x, int64_t x_stride, const d3d_part *ql, const uint16_t *bias,
                           const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K, float *scratch) {
    int64_t runs = (N + 4 * QUAD_RUN - 1) / (4 * QUAD_RUN), blocks = K / CHUNK;
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t first = runs * me / threads, last = runs * (me + 1) / threads;
    const quad_consts k = quad_consts_for(ql->format);
    if (M > QUAD_NARROW) {
        uint16_t *wide = (uint16_t *)(scratch + me * (quad_scratch(M, K, 1)));
        quad_wide(x, x_stride, M, K, wide);
        x = wide, x_stride = 4 * K;
    }
    for (int64_t r = first; r < last; r++) {
        __m512 acc[QUAD_FUSED][QUAD_RUN];
        switch (M) {
            case 1: quad_tile(x, x_stride, ql->data, r, blocks, 1, &k, acc); break;
            case 2: quad_tile(x, x_stride, ql->data, r, blocks, 2, &k, acc); break;
            case 3: quad_tile(x, x_stride, ql->data, r, blocks, 3, &k, acc); break;
            case 4: quad_tile(x, x_stride, ql->data, r, blocks, 4, &k, acc); break;
            case 5: quad_tile(x, x_stride, ql->data, r, blocks, 5, &k, acc); break;
            default: quad_tile(x, x_stride, ql->data, r, blocks, 6, &k, acc); break;
        }
        for (int j = 0; j < QUAD_RUN; j += 4) {  /* 4 quads' chains: 16 columns */
            int64_t n0 = r * 4 * QUAD_RUN + j * 4;
            if (n0 >= N) break;
            int live = N - n0 < 16 ? (int)(N - n0) : 16;
            for (int64_t m = 0; m < M; m++)
                store16_bf16(quad_fold(acc[m][j], acc[m][j + 1], acc[m][j + 2], acc[m][j + 3]), bias ? bias + n0 : 0,
                             residual ? residual + m * N + n0 : 0, y + m * N + n0, live);
        }
    }
    _Pragma("omp barrier")
}

/* R ≤ 6 rows x 16 columns of a QUAD_PACKED weight (its 16-column group at wg), prefetching its share
 * (`ahead_lines` lines from `ahead`) of the next group's. */
static inline __attribute__((always_inline)) void quad_packed_tile(const uint16_t *x, int64_t x_stride, const uint16_t *wg,
                                                                   int64_t steps, const int R, __m512 acc[TILE_ROWS][4],
                                                                   const char *ahead, int64_t ahead_lines) {
    __m512 a[TILE_ROWS][4];  /* the chains, local so that they stay in registers (a pointer's array is stored every step) */
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 4; j++) a[m][j] = _mm512_setzero_ps();
    int64_t per = (ahead_lines + steps - 1) / steps;
    for (int64_t i = 0; i < steps; i++) {
        __m512bh w[4];
        for (int j = 0; j < 4; j++) w[j] = load_reg(wg + i * 128 + 32 * j);
        for (int64_t p = i * per; p < (i + 1) * per && p < ahead_lines; p++) _mm_prefetch(ahead + 64 * p, _MM_HINT_T1);
        for (int m = 0; m < R; m++) {
            __m512bh xm = quad_x(x + m * x_stride, i);
            for (int j = 0; j < 4; j++) a[m][j] = _mm512_dpbf16_ps(a[m][j], xm, w[j]);
        }
    }
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = a[m][j];
}

/* Calls of more than QUAD_FUSED rows over a QL weight: its QUAD_PACKED values, rows in tiles of at
 * most 6 (as even as possible); threads own runs of 16-column groups. */
static void quad_packed_body(const uint16_t *x, int64_t x_stride, const uint16_t *wq, const uint16_t *bias,
                             const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    int64_t groups = (N + 15) / 16, steps = K / 8, group_elems = steps * 128;
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t first = groups * me / threads, last = groups * (me + 1) / threads;
    int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t g = first; g < last; g++) {
        const uint16_t *wg = wq + g * group_elems;
        int64_t next_lines = g + 1 < last ? group_elems * 2 / 64 : 0, share = (next_lines + tiles - 1) / tiles;
        int64_t n0 = g * 16;
        int live = N - n0 < 16 ? (int)(N - n0) : 16;
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {
            int R = (int)((M - m0) / (tiles - t));
            const char *ahead = (const char *)(wg + group_elems) + 64 * share * t;
            int64_t ahead_lines = next_lines - share * t < share ? next_lines - share * t : share;
            if (ahead_lines < 0) ahead_lines = 0;
            __m512 acc[TILE_ROWS][4];
            const uint16_t *xt = x + m0 * x_stride;
            switch (R) {
                case 1: quad_packed_tile(xt, x_stride, wg, steps, 1, acc, ahead, ahead_lines); break;
                case 2: quad_packed_tile(xt, x_stride, wg, steps, 2, acc, ahead, ahead_lines); break;
                case 3: quad_packed_tile(xt, x_stride, wg, steps, 3, acc, ahead, ahead_lines); break;
                case 4: quad_packed_tile(xt, x_stride, wg, steps, 4, acc, ahead, ahead_lines); break;
                case 5: quad_packed_tile(xt, x_stride, wg, steps, 5, acc, ahead, ahead_lines); break;
                default: quad_packed_tile(xt, x_stride, wg, steps, 6, acc, ahead, ahead_lines); break;
            }
            for (int m = 0; m < R; m++) {
                int64_t row = m0 + m;
                store16_bf16(quad_fold(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), bias ? bias + n0 : 0,
                             residual ? residual + row * N + n0 : 0, y + row * N + n0, live);
            }
            m0 += R;
        }
    }
    _Pragma("omp barrier")
}
#endif

#include "amx.h"

/* The format of the grouped copy of `w` that this process's calls of a few rows read (0: none):
 * with AVX-512 BF16, A4 for U4 weights while the AMX tiles are on (where the build has them), else
 * QL (QS for S4) where the quads are (calls of up to QUAD_FUSED rows read them), else G4; G8 for I8 weights; with the AVX2 lanes, T4 for weights with runs of
 * 4-bit blocks (U4, S4). */
int64_t d3d_group_format(const d3d_weight *w, int64_t K) {
    if (K % CHUNK) return 0;
#if defined(D3D_AVX2) && !defined(D3D_AVX512_BF16)
    for (int p = 0; p < MAX_PARTS && w->parts[p].rows; p++)
        if (is_4bit(w->parts[p].format)) return D3D_T4;
    return 0;
#else
    int64_t format = parts_format(w);
    if (format != D3D_U4 && format != D3D_I8 && format != D3D_S4) return 0;
#ifdef AMX_A4
    if (amx_on && format == D3D_U4) return D3D_A4;
#endif
#ifdef D3D_LOOKUP
    int tiles = 0;  /* the AMX tiles read their own forms (and the bf16 values), never the quads' */
#ifdef D3D_AMX
    tiles = amx_on;
#endif
    if (!tiles && quads_on && format == D3D_U4) return D3D_QL;
    if (!tiles && quads_on && format == D3D_S4) return D3D_QS;
#endif
    if (format == D3D_S4) return 0;  /* S4 has a grouped form in quads only */
    return format == D3D_U4 ? D3D_G4 : D3D_G8;
#endif
}

/* Turn the quads (QL, QS) on or off for this process's grouped copies made from now on (where the
 * build has them); returns whether they are on. */
int d3d_quads(int on) {
#ifdef D3D_LOOKUP
    return quads_on = on != 0;
#else
    (void)on;
    return 0;
#endif
}

/* Bytes of that copy (0: none) and, with `out`, the copy. */
int64_t d3d_group_pack(const d3d_weight *w, int64_t N, int64_t K, void *out) {
    int64_t format = d3d_group_format(w, K);
    if (!format) return 0;
#ifdef AMX_A4
    if (format == D3D_A4) return a4_pack(w, N, K, out);
#endif
    if (format == D3D_T4) return table_pack(w, K, out);
#ifdef D3D_LOOKUP
    if (format == D3D_QL || format == D3D_QS) return quad_pack(w, N, K, out);
#endif
    return group_pack(w, N, K, out);
}

/* ---------------------------------------------------------------------------------------------
 * The linear a weight takes, by its format and this build — the same choice for every row count,
 * which is the invariant — and the per-op entry points.
 * ------------------------------------------------------------------------------------------- */

/* Calls of DENSE_MIN + 1 … DENSE_ROWS rows read a quantized weight's bf16 values (formats.h's
 * d3d_weight.dense: the same bits). AMD EPYC Zen 3 (AVX2), whole forwards after 256 tokens, builds
 * interleaved, in one-token steps: 2 rows 1.15–1.21 over the blocks against 1.47 over the bf16
 * values (the blocks' decode, shared by both rows, costs less than 3.4x the bytes), 3 rows 1.55
 * against 1.40–1.45. With AVX2 every call of 3 rows or more reads them (from 5 rows in
 * the pair tiles, faster than decoding each block into the strip once); the portable build decodes
 * into its strip past FUSED_MAX rows. */
/* Calls of up to TABLE_ROWS rows over U4 or S4 blocks read their T4 tables where the lanes take them
 * (AVX2 builds without AVX-512 BF16). AMD EPYC Zen 3, whole forwards after 256 tokens, the shipped
 * Q4_1 GGUF, builds interleaved (scripts/rows_ab.py), in the old one-token steps: 1 row 0.73-0.77
 * (the U4 blocks: 1.0), 2 rows 0.99-1.11 (1.14-1.25), 3 rows 1.40-1.49 (the bf16 values: 1.16-1.23),
 * 4 rows 1.51-1.66 (1.23-1.30); 3 / 4 / 8 rows over the tables in the strip instead of the fused tiles
 * 2.0 / 2.0 / 3.2 (the bf16 values: 1.1 / 1.3 / 2.0). Past 2 rows the FMAs bound a call, and the
 * lane-packed bf16 tiles (one weight vector for 8 columns, each row's element broadcast) keep more of
 * them busy than any tile over the tables did. */
#define TABLE_ROWS 2
#ifdef D3D_AVX2
#define DENSE_MIN 2
#define DENSE_ROWS INT64_MAX
#else
#define DENSE_MIN 1  /* the portable strip decodes in scalar C */
#define DENSE_ROWS FUSED_MAX
#endif

static void linear_bf16(const uint16_t *x, int64_t x_stride, const d3d_weight *w, const uint16_t *bias,
                        const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K, float *scratch) {
#ifdef D3D_AMX
    if (amx_linear_bf16(x, x_stride, w, bias, residual, y, M, N, K, scratch)) return;
#endif
    int64_t format = w->parts[0].format;
    d3d_weight dense = {{w->dense}, {0}};
#if defined(D3D_AVX2) && !defined(D3D_AVX512_BF16)
    if (M <= TABLE_ROWS && w->grouped.data && w->grouped.format == D3D_T4) {
        d3d_weight tables = tables_of(w, K);
        lanes_bf16_body(x, x_stride, &tables, bias, residual, y, M, N, K, scratch);
        return;
    }
#endif
#ifdef D3D_LOOKUP
    if (w->grouped.data && (w->grouped.format == D3D_QL || w->grouped.format == D3D_QS)) {
        if (M > QUAD_FUSED && w->dense.data && w->dense.format == D3D_QUAD_PACKED)
            quad_packed_body(x, x_stride, w->dense.data, bias, residual, y, M, N, K);
        else if (M <= QUAD_FUSED)
            quad_bf16_body(x, x_stride, &w->grouped, bias, residual, y, M, N, K, scratch);
        else  /* no bf16 copy: the decoding tiles, QUAD_FUSED rows at a time (the same chains) */
            for (int64_t m0 = 0; m0 < M; m0 += QUAD_FUSED)
                quad_bf16_body(x + m0 * x_stride, x_stride, &w->grouped, bias, residual ? residual + m0 * N : 0,
                               y + m0 * N, M - m0 < QUAD_FUSED ? M - m0 : QUAD_FUSED, N, K, scratch);
        return;
    }
#endif
#ifdef D3D_AVX512_BF16
    if (M <= GROUPED_ROWS && w->grouped.data && w->grouped.format != D3D_A4) { grouped_bf16_body(x, x_stride, &w->grouped, bias, residual, y, M, N, K); return; }
    /* with AVX-512 BF16 every other row count reads them: the panel decoder below is scalar (one-
     * token step, AMD EPYC Zen 5: 90 ms over Q4_1 blocks against 8.0 ms over the bf16 values) */
    if (is_quantized(format) && w->dense.data) {
#else
    if (M > DENSE_MIN && M <= DENSE_ROWS && is_quantized(format) && w->dense.data) {
#endif
        w = &dense;
        format = dense.parts[0].format;
    }
#ifdef D3D_AVX512_BF16
    if (format == D3D_PACKED) { packed_bf16_body(x, x_stride, w->parts[0].data, bias, residual, y, M, N, K); return; }
    if (is_quantized(format)) { packed_quantized_bf16_body(x, x_stride, w, bias, residual, y, M, N, K, scratch); return; }
#elif defined(D3D_AVX2)
    if (format == D3D_LANE_PACKED) { lane_packed_bf16_body(x, x_stride, w->parts[0].data, bias, residual, y, M, N, K, scratch); return; }
    if (format == D3D_PLAIN && M >= PAIR_MIN_ROWS && K % 16 == 0) { pair_bf16_body(x, x_stride, w->parts[0].data, bias, residual, y, M, N, K, scratch); return; }
    if (is_quantized(format) || K % CHUNK == 0) { lanes_bf16_body(x, x_stride, w, bias, residual, y, M, N, K, scratch); return; }
#else
    if (is_quantized(format)) { strip_bf16_body(x, x_stride, w, bias, residual, y, M, N, K, scratch); return; }
#endif
    lanes_reference_bf16_body(x, x_stride, w->parts[0].data, bias, residual, y, M, N, K);
}

static void linear_f32(const float *x, int64_t x_stride, const d3d_weight *w, const float *bias,
                       const float *residual, float *y, int64_t M, int64_t N, int64_t K, float *scratch) {
#ifdef __AVX512F__
    if (w->parts[0].format == D3D_PACKED) { packed_f32_body(x, x_stride, w->parts[0].data, bias, residual, y, M, N, K); return; }
#endif
#ifdef D3D_AVX2
    if (w->parts[0].format == D3D_PLAIN && M >= PAIR_MIN_ROWS && K % 16 == 0) { pair_f32_body(x, x_stride, w->parts[0].data, bias, residual, y, M, N, K, scratch); return; }
    if (K % CHUNK == 0) { lanes_f32_body(x, x_stride, w, bias, residual, y, M, N, K, scratch); return; }
#endif
    (void)scratch;
    lanes_reference_f32_body(x, x_stride, w->parts[0].data, bias, residual, y, M, N, K);
}

/* Floats of scratch a linear over M rows of width up to K takes (any format, this build). */
int64_t d3d_linear_scratch(int64_t M, int64_t K, int threads) {
    int64_t need = lanes_scratch(M, K, threads), strip = strip_scratch(M, K, threads), panel = panel_scratch(K, threads);
    need = need > strip ? need : strip;
#ifdef D3D_LOOKUP
    int64_t quads = quad_scratch(M, K, threads);
    need = need > quads ? need : quads;
#endif
    return need > panel ? need : panel;
}

void d3d_linear_bf16(const uint16_t *x, int64_t x_stride, const d3d_weight *w, const uint16_t *bias,
                     const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K, float *scratch,
                     int threads) {
    _Pragma("omp parallel num_threads(threads)")
    linear_bf16(x, x_stride, w, bias, residual, y, M, N, K, scratch);
}

void d3d_linear_f32(const float *x, int64_t x_stride, const d3d_weight *w, const float *bias,
                    const float *residual, float *y, int64_t M, int64_t N, int64_t K, float *scratch, int threads) {
    _Pragma("omp parallel num_threads(threads)")
    linear_f32(x, x_stride, w, bias, residual, y, M, N, K, scratch);
}

/* The reference lanes over plain weights, whatever this build's own path (for the tests: where a
 * bf16 weight takes the lanes, every lanes kernel must give these bits). */
void d3d_linear_reference_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                               const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K, int threads) {
    _Pragma("omp parallel num_threads(threads)")
    lanes_reference_bf16_body(x, x_stride, w, bias, residual, y, M, N, K);
}

void d3d_linear_reference_f32(const float *x, int64_t x_stride, const float *w, const float *bias,
                              const float *residual, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    _Pragma("omp parallel num_threads(threads)")
    lanes_reference_f32_body(x, x_stride, w, bias, residual, y, M, N, K);
}
