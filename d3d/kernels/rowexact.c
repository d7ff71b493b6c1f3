/* Row-exact CPU kernels for d3d's inference forward: linear, attention, RMSNorm, SwiGLU.
 *
 * "Row-exact": the value computed for one row (one token) is a fixed sequence of IEEE operations
 * that depends on that row's inputs and the weights only — never on how many rows share the call,
 * on the row's index, on how the work is split between threads, or on vectorisation. That is what
 * makes a 17-token verification bit-identical to 17 one-token steps on every machine, by
 * construction rather than by a BLAS library's luck (oneDNN's bf16 GEMM, for one, changes a row's
 * rounding between 1-row and 16-row calls on AMD Zen 4).
 *
 * How the rule is kept:
 *  - every reduction (a dot product, a sum of squares, a softmax sum) runs over a fixed number of
 *    independent lanes in index order, then folds the lanes in a fixed order;
 *  - compiled without -ffast-math and with -ffp-contract=off, so the compiler may vectorise or
 *    unroll but never reassociate or fuse; fused multiply-adds are written out explicitly;
 *  - threads split the work by output rows/columns, never inside one reduction.
 * The result does depend on the machine (AVX-512 BF16 dot products vs fp32 FMA): within one
 * machine every path uses the same kernel, which is all losslessness needs.
 *
 * This file is compiled on first use by d3d/kernels/__init__.py with the machine's C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes; it sees raw pointers only.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>  /* also where AVX-512 lacks BF16 (Skylake-X … Ice Lake): the fp32 paths use it */
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define D3D_AVX512_BF16 1
#endif

#define LANES 16

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float fold_lanes(const float *acc) {  /* fixed pairwise order */
    float t8[8], t4[4];
    for (int i = 0; i < 8; i++) t8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) t4[i] = t8[i] + t8[i + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

/* exp(x) for float, ~2 ulp: Cody-Waite reduction and a degree-6 polynomial. One formula for
 * every element, so vectorised and scalar code agree bit for bit. */
static inline float exp_fixed(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(k, -0.693359375f, x);
    r = fmaf(k, 2.12194440e-4f, r);
    float p = 1.3981999507e-3f;
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    int32_t e = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

#ifdef __AVX512F__
/* exp_fixed on 16 lanes: the same operations in the same order, so the same bits per lane. */
static inline __m512 exp_fixed16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

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
                    float v = out[r][c];                                                             \
                    if (bias) v += LOAD(bias[n0 + c]);                                               \
                    int64_t at = (m0 + r) * N + n0 + c;                                              \
                    y[at] = residual ? STORE(LOAD(residual[at]) + LOAD(STORE(v))) : STORE(v);        \
                }                                                                                    \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
void NAME(const T_ELEM *x, int64_t x_stride, const T_ELEM *w, const T_ELEM *bias, const T_ELEM *residual, \
          T_ELEM *y, int64_t M, int64_t N, int64_t K, int threads) {                                 \
    _Pragma("omp parallel num_threads(threads)")                                                     \
    NAME##_body(x, x_stride, w, bias, residual, y, M, N, K);                                         \
}

LINEAR(d3d_linear_bf16, uint16_t, bf16_to_f32, f32_to_bf16, dot_block_bf16)
LINEAR(d3d_linear_f32, float, IDENTITY, IDENTITY, dot_block_f32)

/* ---------------------------------------------------------------------------------------------
 * packed linear (AVX-512): weights repacked once so that one 64-byte load holds the same k step
 * of 16 output columns — bf16 (N/16, K/2, 16, 2), fp32 (N/16, K, 16). Each accumulator lane is
 * one output column, fed by one FMA chain over k in order (bf16: vdpbf16ps over k pairs); no
 * horizontal sum. A tile is up to 6 rows x 4 column groups (64 columns); the row count only
 * decides how rows are grouped into tiles, never a row's own chain. No software prefetch: with
 * the weights in huge pages the hardware prefetchers stream them faster without it (measured on
 * AMD EPYC Zen 4: ~5% per step).
 * ------------------------------------------------------------------------------------------- */

#if defined(__AVX512F__)
#define GROUPS 4     /* 16-column groups per tile; packed weights are zero-padded to 64 columns */
#define TILE_ROWS 6  /* up to 6 x 4 accumulators + 4 weight registers + 1 broadcast: 29 of 32 */

#define PACKED_LINEAR(NAME, T_ELEM, LOAD, STORE, STEPS, STEP_ELEMS, BROADCAST, FMA)                   \
static inline __attribute__((always_inline)) void NAME##_tile(                                       \
        const T_ELEM *x, int64_t x_stride, const T_ELEM *wp, int64_t K, const int R, const int G,    \
        __m512 acc[TILE_ROWS][GROUPS]) {                                                             \
    int64_t group_elems = (int64_t)(STEPS) * 16 * (STEP_ELEMS);                                      \
    for (int r = 0; r < R; r++)                                                                      \
        for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();                                 \
    for (int64_t i = 0; i < (STEPS); i++) {                                                          \
        const T_ELEM *wi = wp + i * 16 * (STEP_ELEMS);                                               \
        __m512 wv[GROUPS];                                                                           \
        for (int g = 0; g < G; g++) wv[g] = LOADW(wi + g * group_elems);                             \
        for (int r = 0; r < R; r++) {                                                                \
            __m512 xr = BROADCAST(x + r * x_stride, i);                                              \
            for (int g = 0; g < G; g++) acc[r][g] = FMA(acc[r][g], xr, wv[g]);                       \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
/* Threads own runs of 16-column groups, as even as possible (576 columns: 18 groups each); each   \
 * run goes in tiles of up to 4 groups x 6 rows. */                                                 \
static void NAME##_body(const T_ELEM *x, int64_t x_stride, const T_ELEM *wp, const T_ELEM *bias,     \
                        const T_ELEM *residual, T_ELEM *y, int64_t M, int64_t N, int64_t K) {        \
    int64_t groups = (N + 15) / 16, group_elems = (int64_t)(STEPS) * 16 * (STEP_ELEMS);              \
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();                              \
    int64_t first = groups * me / threads, last = groups * (me + 1) / threads;                       \
    for (int64_t g0 = first; g0 < last; g0 += GROUPS) {                                              \
        int G = last - g0 < GROUPS ? (int)(last - g0) : GROUPS;                                      \
        int64_t n0 = g0 * 16;                                                                        \
        const T_ELEM *w = wp + g0 * group_elems;                                                     \
        /* rows in tiles of at most 6, as even as possible: 17 rows → 6, 6, 5 */                     \
        int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;                                             \
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {                                                \
            int R = (int)((M - m0) / (tiles - t));                                                   \
            __m512 acc[TILE_ROWS][GROUPS];                                                           \
            const T_ELEM *xt = x + m0 * x_stride;                                                    \
            switch (G * 8 + R) {  /* one specialised loop per tile height and width */              \
                TILE_CASES(NAME, 1) TILE_CASES(NAME, 2) TILE_CASES(NAME, 3) TILE_CASES(NAME, 4)      \
            }                                                                                        \
            for (int r = 0; r < R; r++)                                                              \
                for (int g = 0; g < G; g++) {                                                        \
                    float lanes[16];                                                                 \
                    _mm512_storeu_ps(lanes, acc[r][g]);                                              \
                    for (int j = 0; j < 16 && n0 + g * 16 + j < N; j++) {                            \
                        int64_t n = n0 + g * 16 + j;                                                 \
                        float v = lanes[j];                                                          \
                        if (bias) v += LOAD(bias[n]);                                                \
                        int64_t at = (m0 + r) * N + n;                                               \
                        y[at] = residual ? STORE(LOAD(residual[at]) + LOAD(STORE(v))) : STORE(v);    \
                    }                                                                                \
                }                                                                                    \
            m0 += R;                                                                                 \
        }                                                                                            \
    }                                                                                                \
    _Pragma("omp barrier")                                                                           \
}                                                                                                    \
void NAME(const T_ELEM *x, int64_t x_stride, const T_ELEM *wp, const T_ELEM *bias, const T_ELEM *residual, \
          T_ELEM *y, int64_t M, int64_t N, int64_t K, int threads) {                                 \
    _Pragma("omp parallel num_threads(threads)")                                                     \
    NAME##_body(x, x_stride, wp, bias, residual, y, M, N, K);                                        \
}

#define TILE_CASE(NAME, G, R) case G * 8 + R: NAME##_tile(xt, x_stride, w, K, R, G, acc); break;
#define TILE_CASES(NAME, G) TILE_CASE(NAME, G, 1) TILE_CASE(NAME, G, 2) TILE_CASE(NAME, G, 3)            \
                            TILE_CASE(NAME, G, 4) TILE_CASE(NAME, G, 5) TILE_CASE(NAME, G, 6)

#define LOADW(p) _mm512_loadu_ps((const float *)(p))  /* 64 bytes: 16 floats or 16 bf16 pairs */
#define BROADCAST_F32(row, i) _mm512_set1_ps((row)[i])
#define FMA_F32(acc, x, w) _mm512_fmadd_ps(x, w, acc)
PACKED_LINEAR(d3d_linear_packed_f32, float, IDENTITY, IDENTITY, K, 1, BROADCAST_F32, FMA_F32)
#ifdef D3D_AVX512_BF16
static inline __m512 broadcast_pair(const uint16_t *row, int64_t i) {
    int32_t pair;
    memcpy(&pair, row + 2 * i, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
}
#define FMA_BF16(acc, x, w) _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(x), (__m512bh)_mm512_castps_si512(w))
PACKED_LINEAR(d3d_linear_packed_bf16, uint16_t, bf16_to_f32, f32_to_bf16, K / 2, 2, broadcast_pair, FMA_BF16)
#endif
#endif

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
 * attention: q (B, T, H, D) contiguous; k, v: element (b, g, s, d) at b*kv_batch + g*kv_head +
 * s*D + d (the KV cache's layout); out (B, T, H, D). Query t of a causal call (mask NULL) sees keys
 * 0 … S-T+t; with a mask (B, T, S) bytes, the keys whose byte is 1. In fp32:
 *  1. scores: a tile of 16 keys is transposed once and serves every query of its KV head; a
 *     score is one FMA chain over d = 0 … D-1 (q pre-scaled), whatever the tile or query count
 *     (QUERY_CHUNK chains run interleaved: the same operations, in the same order, per chain);
 *  2. per query: max, exp and sum over the visible keys in 16 lanes, then the weighted sum of V
 *     in key order. `scores` is scratch of B*T*H*S floats.
 * ------------------------------------------------------------------------------------------- */

#define KEY_TILE 16

/* o[d] = sum over s in order of p[s] * v[s, d] (one FMA chain per d; keys with p = 0 skipped).
 * With AVX-512, 64 values of d at a time stay in registers for the whole pass over s. */
#define WEIGHTED_SUM_PORTABLE(T_ELEM, LOAD, p, v, S, D, o)                                          \
    do {                                                                                             \
        for (int64_t d = 0; d < (D); d++) (o)[d] = 0.0f;                                             \
        for (int64_t s = 0; s < (S); s++) {                                                          \
            float ps = (p)[s];                                                                       \
            if (ps == 0.0f) continue;                                                                \
            const T_ELEM *vr = (v) + s * (D);                                                        \
            for (int64_t d = 0; d < (D); d++) (o)[d] = fmaf(ps, LOAD(vr[d]), (o)[d]);                \
        }                                                                                            \
    } while (0)
#ifdef __AVX512F__
static inline __m512 load16_bf16(const uint16_t *a, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, a)), 16));
}
static inline __m512 load16_f32(const float *a, __mmask16 live) { return _mm512_maskz_loadu_ps(live, a); }
#define WEIGHTED_SUM_VECTOR(SUFFIX, T_ELEM, p, v, S, D, o)                                          \
    for (int64_t d0 = 0; d0 < (D); d0 += 64) {                                                       \
        __mmask16 live[4];                                                                           \
        for (int j = 0; j < 4; j++) {                                                                \
            int64_t left = (D) - d0 - 16 * j;                                                        \
            live[j] = left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); \
        }                                                                                            \
        __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;                                  \
        for (int64_t s = 0; s < (S); s++) {                                                          \
            float ps = (p)[s];                                                                       \
            if (ps == 0.0f) continue;                                                                \
            const T_ELEM *vr = (v) + s * (D) + d0;                                                   \
            __m512 pv = _mm512_set1_ps(ps);                                                          \
            o0 = _mm512_fmadd_ps(pv, load16_##SUFFIX(vr, live[0]), o0);                              \
            o1 = _mm512_fmadd_ps(pv, load16_##SUFFIX(vr + 16, live[1]), o1);                         \
            o2 = _mm512_fmadd_ps(pv, load16_##SUFFIX(vr + 32, live[2]), o2);                         \
            o3 = _mm512_fmadd_ps(pv, load16_##SUFFIX(vr + 48, live[3]), o3);                         \
        }                                                                                            \
        float lanes_[64];                                                                            \
        _mm512_storeu_ps(lanes_, o0); _mm512_storeu_ps(lanes_ + 16, o1);                             \
        _mm512_storeu_ps(lanes_ + 32, o2); _mm512_storeu_ps(lanes_ + 48, o3);                        \
        for (int64_t d = d0; d < (D) && d < d0 + 64; d++) (o)[d] = lanes_[d - d0];                   \
    }
#define WEIGHTED_SUM_bf16(p, v, S, D, o) WEIGHTED_SUM_VECTOR(bf16, uint16_t, p, v, S, D, o)
#define WEIGHTED_SUM_f32(p, v, S, D, o) WEIGHTED_SUM_VECTOR(f32, float, p, v, S, D, o)
#else
#define WEIGHTED_SUM_bf16(p, v, S, D, o) WEIGHTED_SUM_PORTABLE(uint16_t, bf16_to_f32, p, v, S, D, o)
#define WEIGHTED_SUM_f32(p, v, S, D, o) WEIGHTED_SUM_PORTABLE(float, IDENTITY, p, v, S, D, o)
#endif

/* row[s] = exp(row[s] - top) (0 for -inf), and sums[l] += row[s] for s = l mod 16, in s order. */
#ifdef __AVX512F__
#define EXP_SUM(row, S, top, sums)                                                                   \
    do {                                                                                             \
        __m512 sum_ = _mm512_loadu_ps(sums), top_ = _mm512_set1_ps(top);                             \
        for (int64_t s0 = 0; s0 < (S); s0 += LANES) {                                                \
            __mmask16 live = (S) - s0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << ((S) - s0)) - 1); \
            __m512 x = _mm512_maskz_loadu_ps(live, (row) + s0);                                      \
            __mmask16 seen = _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ); \
            __m512 p = _mm512_maskz_mov_ps(seen, exp_fixed16(_mm512_sub_ps(x, top_)));               \
            _mm512_mask_storeu_ps((row) + s0, live, p);                                              \
            sum_ = _mm512_mask_add_ps(sum_, live, sum_, p);                                          \
        }                                                                                            \
        _mm512_storeu_ps(sums, sum_);                                                                \
    } while (0)
#else
#define EXP_SUM(row, S, top, sums)                                                                   \
    for (int64_t s0 = 0; s0 < (S); s0 += LANES)                                                      \
        for (int l = 0; l < LANES && s0 + l < (S); l++) {                                            \
            float x_ = (row)[s0 + l];                                                                \
            float p_ = x_ == -INFINITY ? 0.0f : exp_fixed(x_ - (top));                               \
            (row)[s0 + l] = p_;                                                                      \
            (sums)[l] += p_;                                                                         \
        }
#endif

/* acc[i][l] = sum over d in order of qs[i][d] * kt[d][l]: QUERY_CHUNK independent FMA chains per
 * lane, interleaved so that the FMA unit is not left waiting on one chain's latency; each chain is
 * the same sequence of fused multiply-adds whatever the chunk holds. */
#define QUERY_CHUNK 4
#ifdef __AVX512F__
#define SCORE_CHAINS(kt, qs, D, acc)                                                                 \
    do {                                                                                             \
        __m512 a0_ = _mm512_setzero_ps(), a1_ = a0_, a2_ = a0_, a3_ = a0_;                           \
        for (int64_t d = 0; d < (D); d++) {                                                          \
            __m512 kd_ = _mm512_loadu_ps((kt)[d]);                                                   \
            a0_ = _mm512_fmadd_ps(_mm512_set1_ps((qs)[0][d]), kd_, a0_);                             \
            a1_ = _mm512_fmadd_ps(_mm512_set1_ps((qs)[1][d]), kd_, a1_);                             \
            a2_ = _mm512_fmadd_ps(_mm512_set1_ps((qs)[2][d]), kd_, a2_);                             \
            a3_ = _mm512_fmadd_ps(_mm512_set1_ps((qs)[3][d]), kd_, a3_);                             \
        }                                                                                            \
        _mm512_storeu_ps((acc)[0], a0_); _mm512_storeu_ps((acc)[1], a1_);                            \
        _mm512_storeu_ps((acc)[2], a2_); _mm512_storeu_ps((acc)[3], a3_);                            \
    } while (0)
/* kt[d][l] = key l's element d, as float (0 for l ≥ n): 16 × 16 blocks transposed in registers. */
static inline void transpose16_store(__m512 r[16], float (*kt)[KEY_TILE], int64_t d0, int64_t D) {
    __m512 t[16], u[16];
    for (int p = 0; p < 8; p++) {
        t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) {  /* u[4q + m], 128-bit lane c: column 4c + m of rows 4q … 4q+3 */
        u[4 * q] = _mm512_shuffle_ps(t[4 * q], t[4 * q + 2], 0x44);
        u[4 * q + 1] = _mm512_shuffle_ps(t[4 * q], t[4 * q + 2], 0xEE);
        u[4 * q + 2] = _mm512_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0x44);
        u[4 * q + 3] = _mm512_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0xEE);
    }
    for (int m = 0; m < 4; m++) {  /* column 4c + m gathers lane c of u[m], u[4+m], u[8+m], u[12+m] */
        __m512 v0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
        __m512 v2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44), v3 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
        __m512 out[4] = {_mm512_shuffle_f32x4(v0, v2, 0x88), _mm512_shuffle_f32x4(v0, v2, 0xDD),
                         _mm512_shuffle_f32x4(v1, v3, 0x88), _mm512_shuffle_f32x4(v1, v3, 0xDD)};
        for (int c = 0; c < 4; c++)
            if (d0 + 4 * c + m < D) _mm512_storeu_ps(kt[d0 + 4 * c + m], out[c]);
    }
}
/* out[d] = q[d] · scale (0 where not `live`), one rounding each, 16 at a time. */
#define SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, live, out)                                           \
    for (int64_t d0_ = 0; d0_ < (D); d0_ += 16) {                                                    \
        __mmask16 m_ = !(live) ? 0 : (D) - d0_ >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << ((D) - d0_)) - 1); \
        _mm512_storeu_ps((out) + d0_, _mm512_mul_ps(load16_##SUFFIX((qr) + d0_, m_), _mm512_set1_ps(scale))); \
    }
#define TRANSPOSE_TILE(SUFFIX, T_ELEM, LOAD, kb, n, D, kt)                                           \
    for (int64_t d0_ = 0; d0_ < (D); d0_ += 16) {                                                    \
        __mmask16 live_ = (D) - d0_ >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << ((D) - d0_)) - 1); \
        __m512 r_[16];                                                                               \
        for (int l_ = 0; l_ < KEY_TILE; l_++)                                                        \
            r_[l_] = l_ < (n) ? load16_##SUFFIX((kb) + l_ * (D) + d0_, live_) : _mm512_setzero_ps();  \
        transpose16_store(r_, (kt), d0_, (D));                                                       \
    }
/* The largest of row[0 … S-1]; NaNs are passed over, as the scalar `x > top ? x : top` does. */
static inline float ROW_MAX(const float *row, int64_t S) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s0 = 0; s0 < S; s0 += LANES) {
        __mmask16 live = S - s0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (S - s0)) - 1);
        top = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + s0), top);
    }
    float lanes[LANES], best = -INFINITY;
    _mm512_storeu_ps(lanes, top);
    for (int l = 0; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
}
#else
#define SCORE_CHAINS(kt, qs, D, acc)                                                                 \
    do {                                                                                             \
        for (int i_ = 0; i_ < QUERY_CHUNK; i_++)                                                     \
            for (int l_ = 0; l_ < KEY_TILE; l_++) (acc)[i_][l_] = 0.0f;                              \
        for (int64_t d = 0; d < (D); d++)                                                            \
            for (int i_ = 0; i_ < QUERY_CHUNK; i_++)                                                 \
                for (int l_ = 0; l_ < KEY_TILE; l_++)                                                \
                    (acc)[i_][l_] = fmaf((qs)[i_][d], (kt)[d][l_], (acc)[i_][l_]);                   \
    } while (0)
#define SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, live, out)                                           \
    for (int64_t d = 0; d < (D); d++) (out)[d] = (live) ? LOAD((qr)[d]) * (scale) : 0.0f;
#define TRANSPOSE_TILE(SUFFIX, T_ELEM, LOAD, kb, n, D, kt)                                           \
    for (int64_t d = 0; d < (D); d++)                                                                \
        for (int l = 0; l < KEY_TILE; l++) (kt)[d][l] = l < (n) ? LOAD((kb)[l * (D) + d]) : 0.0f;
static inline float ROW_MAX(const float *row, int64_t S) {
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) top = row[s] > top ? row[s] : top;
    return top;
}
#endif

/* row[l] = acc[l] where key s0 + l is visible (its mask byte is 1; causal: l < visible), else
 * -inf, for l < n. */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
static inline void STORE_SCORES(float *row, const uint8_t *mrow, int64_t visible, int64_t n, const float *acc) {
    __mmask16 in_tile = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1), seen;
    if (mrow)
        seen = _mm_mask_cmpneq_epi8_mask(in_tile, _mm_maskz_loadu_epi8(in_tile, mrow), _mm_setzero_si128());
    else
        seen = visible >= 16 ? (__mmask16)0xffff : visible <= 0 ? 0 : (__mmask16)((1u << visible) - 1);
    _mm512_mask_storeu_ps(row, in_tile, _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(acc)));
}
#else
static inline void STORE_SCORES(float *row, const uint8_t *mrow, int64_t visible, int64_t n, const float *acc) {
    for (int l = 0; l < n; l++) row[l] = (mrow ? mrow[l] != 0 : l < visible) ? acc[l] : -INFINITY;
}
#endif

#define ATTENTION(NAME, SUFFIX, T_ELEM, LOAD, STORE)                                                         \
static void NAME##_body(const T_ELEM *q, const T_ELEM *k, const T_ELEM *v, const uint8_t *mask,      \
                        T_ELEM *out, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t S,        \
                        int64_t D, int64_t kv_batch, int64_t kv_head, float scale, float *scores) {  \
    int64_t group = H / Hkv, tiles = (S + KEY_TILE - 1) / KEY_TILE;                                  \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t job = 0; job < B * Hkv * tiles; job++) {                                            \
        int64_t b = job / (Hkv * tiles), g = (job / tiles) % Hkv, s0 = (job % tiles) * KEY_TILE;     \
        int64_t n = S - s0 < KEY_TILE ? S - s0 : KEY_TILE;                                           \
        const T_ELEM *kb = k + b * kv_batch + g * kv_head + s0 * D;                                  \
        float kt[512][KEY_TILE];                                                                     \
        TRANSPOSE_TILE(SUFFIX, T_ELEM, LOAD, kb, n, D, kt);                                          \
        /* the group's queries (t, h), QUERY_CHUNK at a time: their chains interleave, each unchanged */ \
        for (int64_t i0 = 0; i0 < T * group; i0 += QUERY_CHUNK) {                                    \
            float qs[QUERY_CHUNK][512], acc[QUERY_CHUNK][KEY_TILE];                                   \
            int chunk = T * group - i0 < QUERY_CHUNK ? (int)(T * group - i0) : QUERY_CHUNK;          \
            for (int i = 0; i < QUERY_CHUNK; i++) {                                                  \
                int64_t t = (i0 + i) / group, h = g * group + (i0 + i) % group;                      \
                const T_ELEM *qr = i < chunk ? q + ((b * T + t) * H + h) * D : q;  /* past: zeros */ \
                SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, i < chunk, qs[i]);                           \
            }                                                                                        \
            SCORE_CHAINS(kt, qs, D, acc);                                                            \
            for (int i = 0; i < chunk; i++) {                                                        \
                int64_t t = (i0 + i) / group, h = g * group + (i0 + i) % group;                      \
                float *row = scores + ((b * T + t) * H + h) * S + s0;                                \
                const uint8_t *mrow = mask ? mask + (b * T + t) * S + s0 : NULL;                     \
                STORE_SCORES(row, mrow, S - T + t + 1 - s0, n, acc[i]);                              \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t item = 0; item < B * T * H; item++) {                                               \
        int64_t b = item / (T * H), g = (item % H) / group;                                          \
        const T_ELEM *vb = v + b * kv_batch + g * kv_head;                                           \
        float *row = scores + item * S;                                                              \
        float top = ROW_MAX(row, S);                                                                 \
        float sums[LANES] = {0};                                                                     \
        EXP_SUM(row, S, top, sums);                                                                  \
        float total = fold_lanes(sums), o[512];                                                      \
        WEIGHTED_SUM_##SUFFIX(row, vb, S, D, o);                                                     \
        float inv = total > 0.0f ? 1.0f / total : 0.0f;                                              \
        T_ELEM *outr = out + item * D;                                                               \
        for (int64_t d = 0; d < D; d++) outr[d] = STORE(o[d] * inv);                                 \
    }                                                                                                \
}                                                                                                    \
void NAME(const T_ELEM *q, const T_ELEM *k, const T_ELEM *v, const uint8_t *mask, T_ELEM *out,       \
          int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D,                        \
          int64_t kv_batch, int64_t kv_head, float scale, float *scores, int threads) {              \
    _Pragma("omp parallel num_threads(threads)")                                                     \
    NAME##_body(q, k, v, mask, out, B, T, H, Hkv, S, D, kv_batch, kv_head, scale, scores);          \
}

ATTENTION(d3d_attention_bf16, bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ATTENTION(d3d_attention_f32, f32, float, IDENTITY, IDENTITY)

/* ---------------------------------------------------------------------------------------------
 * RMSNorm with transformers' rounding: y = weight * to_dtype(x * rsqrt(mean(x²) + eps)), the
 * normalisation in fp32 (in place allowed: y = x). SwiGLU: y = to_dtype(silu(gate)) * up for
 * gate_up = [gate | up] (M, 2I), elementwise.
 * ------------------------------------------------------------------------------------------- */

#define SILU_CHUNK 256  /* elements of one row per work item: a 1-row call still splits */

#define NORMS(SUFFIX, T_ELEM, LOAD, STORE)                                                           \
static inline void rms_norm_row_##SUFFIX(const T_ELEM *xr, const T_ELEM *weight, T_ELEM *yr, int64_t D, \
                                         float eps) {                                                \
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
        for (int64_t i = i0; i < i1; i++) {                                                          \
            float g = LOAD(gate_up[m * 2 * I + i]);                                                  \
            float silu = LOAD(STORE(g / (1.0f + exp_fixed(-g))));                                    \
            y[m * I + i] = STORE(silu * LOAD(gate_up[m * 2 * I + I + i]));                           \
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
 * q_out (M, H, D) and k rotated, v as is into the cache slots start … start+T-1 of batch row b at
 * k_cache + b*kv_batch + g*kv_head + slot*D. Rotation with PyTorch's rounding:
 * to_dtype(to_dtype(x*cos) + to_dtype(rotate_half(x)*sin)). Row m's cos/sin are row m of cos_/sin_
 * (M, D), or with `positions`, row positions[m] of tables cos_/sin_ (P, D).
 * ------------------------------------------------------------------------------------------- */

#define ROPE_STORE(SUFFIX, T_ELEM, LOAD, STORE)                                                      \
static inline void rotate_##SUFFIX(const T_ELEM *x, const T_ELEM *cos_, const T_ELEM *sin_, T_ELEM *out, \
                                   int64_t D) {                                                      \
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
                                     int64_t D, int64_t start, int64_t kv_batch, int64_t kv_head) {  \
    int64_t width = (H + 2 * Hkv) * D;                                                               \
    for (int64_t m = 0; m < B * T; m++) {                                                            \
        int64_t b = m / T, slot = start + m % T, row_at = (positions ? positions[m] : m) * D;        \
        const T_ELEM *row = qkv + m * width, *c = cos_ + row_at, *s = sin_ + row_at;                 \
        for (int64_t h = 0; h < H; h++) rotate_##SUFFIX(row + h * D, c, s, q_out + (m * H + h) * D, D); \
        for (int64_t g = 0; g < Hkv; g++) {                                                          \
            int64_t at = b * kv_batch + g * kv_head + slot * D;                                      \
            rotate_##SUFFIX(row + (H + g) * D, c, s, k_cache + at, D);                               \
            memcpy(v_cache + at, row + (H + Hkv + g) * D, D * sizeof(T_ELEM));                       \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
void d3d_rope_store_##SUFFIX(const T_ELEM *qkv, const T_ELEM *cos_, const T_ELEM *sin_, T_ELEM *q_out, \
                             T_ELEM *k_cache, T_ELEM *v_cache, int64_t B, int64_t T, int64_t H,      \
                             int64_t Hkv, int64_t D, int64_t start, int64_t kv_batch, int64_t kv_head) { \
    rope_store_body_##SUFFIX(qkv, cos_, sin_, NULL, q_out, k_cache, v_cache, B, T, H, Hkv, D, start, \
                             kv_batch, kv_head);                                                     \
}

ROPE_STORE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ROPE_STORE(f32, float, IDENTITY, IDENTITY)

/* ---------------------------------------------------------------------------------------------
 * The whole decoder in one call: every layer, then the final norm, over a KV cache, in one
 * parallel region. Each stage is the body of the per-op kernel above (the same code, so the same
 * bits as a forward made of per-op calls); the implicit barrier after each stage orders them.
 *
 * `layers` holds LAYER_SLOTS pointers per layer: input norm, qkv weight, qkv bias, q norm, k norm,
 * o weight, o bias, post-attention norm, gate_up weight, gate_up bias, down weight, down bias —
 * NULL for an absent bias or q/k norm; weights in the packed layout when `packed`. `x` (M, hidden)
 * is the residual stream, updated in place; `out` gets the final norm of it. Caches: element
 * (l, b, g, s, d) at l*kv_layer + b*kv_batch + g*kv_head + s*D + d; the new tokens go to slots
 * start … start+T-1. `rope`: (2, P, D) cos and sin tables; `positions` (M) rows of them. `mask`:
 * (B, T, start+T) bytes, or NULL for causal. Scratch: `work` (M, hidden + width + 2 H D + 3 I)
 * elements, `scores` B*T*H*(start+T) floats.
 * ------------------------------------------------------------------------------------------- */

#define LAYER_SLOTS 12

/* Built with -DD3D_PROFILE (scripts/profile_step.py), the forward adds each stage's wall time,
 * taken by thread 0 after the stage's barrier, to d3d_stage_seconds. */
enum { STAGE_NORM, STAGE_QKV, STAGE_ROPE, STAGE_ATTENTION, STAGE_O, STAGE_GATE_UP, STAGE_SILU, STAGE_DOWN, STAGES };
double d3d_stage_seconds[STAGES];
#ifdef D3D_PROFILE
#define STAGE(name) do { if (omp_get_thread_num() == 0) { double now_ = omp_get_wtime();                 \
                         d3d_stage_seconds[name] += now_ - stage_clock_; stage_clock_ = now_; } } while (0)
#else
#define STAGE(name) do { } while (0)
#endif

#define FORWARD(SUFFIX, T_ELEM)                                                                      \
void d3d_forward_##SUFFIX(const void *const *layers, int64_t L, int64_t hidden, int64_t H, int64_t Hkv, \
                          int64_t D, int64_t I, float eps, float scale, int packed, T_ELEM *x,       \
                          const T_ELEM *rope, const int64_t *positions, int64_t P,                   \
                          T_ELEM *k_cache, T_ELEM *v_cache, int64_t kv_layer, int64_t kv_batch,      \
                          int64_t kv_head, int64_t start, const uint8_t *mask, int64_t B, int64_t T, \
                          const T_ELEM *final_norm, T_ELEM *out, T_ELEM *work, float *scores,        \
                          int threads) {                                                             \
    int64_t M = B * T, S = start + T, width = (H + 2 * Hkv) * D;                                     \
    T_ELEM *normed = work, *qkv = normed + M * hidden, *q = qkv + M * width, *attn = q + M * H * D;  \
    T_ELEM *gate_up = attn + M * H * D, *act = gate_up + M * 2 * I;                                  \
    _Pragma("omp parallel num_threads(threads)")                                                     \
    {                                                                                                \
    double stage_clock_ = omp_get_wtime();                                                           \
    (void)stage_clock_;                                                                              \
    for (int64_t l = 0; l < L; l++) {                                                                \
        const T_ELEM *const *w = (const T_ELEM *const *)(layers + l * LAYER_SLOTS);                  \
        T_ELEM *keys = k_cache + l * kv_layer, *values = v_cache + l * kv_layer;                     \
        rms_norm_body_##SUFFIX(x, w[0], normed, M, hidden, eps);                                     \
        STAGE(STAGE_NORM);                                                                           \
        linear_##SUFFIX(normed, hidden, w[1], w[2], NULL, qkv, M, width, hidden, packed);            \
        STAGE(STAGE_QKV);                                                                            \
        if (w[3]) {  /* Qwen3: RMSNorm of every q and k head, in place */                            \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t item = 0; item < M * (H + Hkv); item++) {                                   \
                int64_t m = item / (H + Hkv), j = item % (H + Hkv);                                  \
                T_ELEM *head = qkv + m * width + j * D;                                              \
                rms_norm_row_##SUFFIX(head, j < H ? w[3] : w[4], head, D, eps);                      \
            }                                                                                        \
        }                                                                                            \
        _Pragma("omp single")                                                                        \
        rope_store_body_##SUFFIX(qkv, rope, rope + P * D, positions, q, keys, values, B, T, H, Hkv, D, \
                                 start, kv_batch, kv_head);                                          \
        STAGE(STAGE_ROPE);                                                                           \
        d3d_attention_##SUFFIX##_body(q, keys, values, mask, attn, B, T, H, Hkv, S, D, kv_batch,     \
                                      kv_head, scale, scores);                                       \
        STAGE(STAGE_ATTENTION);                                                                      \
        linear_##SUFFIX(attn, H * D, w[5], w[6], x, x, M, hidden, H * D, packed);                    \
        STAGE(STAGE_O);                                                                              \
        rms_norm_body_##SUFFIX(x, w[7], normed, M, hidden, eps);                                     \
        STAGE(STAGE_NORM);                                                                           \
        linear_##SUFFIX(normed, hidden, w[8], w[9], NULL, gate_up, M, 2 * I, hidden, packed);        \
        STAGE(STAGE_GATE_UP);                                                                        \
        silu_mul_body_##SUFFIX(gate_up, act, M, I);                                                  \
        STAGE(STAGE_SILU);                                                                           \
        linear_##SUFFIX(act, I, w[10], w[11], x, x, M, hidden, I, packed);                           \
        STAGE(STAGE_DOWN);                                                                           \
    }                                                                                                \
    rms_norm_body_##SUFFIX(x, final_norm, out, M, hidden, eps);                                      \
    STAGE(STAGE_NORM);                                                                               \
    }                                                                                                \
}

/* The linear body a weight's layout takes (the same choice the per-op call makes). */
static void linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                        const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K, int packed) {
#ifdef D3D_AVX512_BF16
    if (packed) { d3d_linear_packed_bf16_body(x, x_stride, w, bias, residual, y, M, N, K); return; }
#endif
    (void)packed;
    d3d_linear_bf16_body(x, x_stride, w, bias, residual, y, M, N, K);
}

static void linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias,
                       const float *residual, float *y, int64_t M, int64_t N, int64_t K, int packed) {
#ifdef __AVX512F__
    if (packed) { d3d_linear_packed_f32_body(x, x_stride, w, bias, residual, y, M, N, K); return; }
#endif
    (void)packed;
    d3d_linear_f32_body(x, x_stride, w, bias, residual, y, M, N, K);
}

FORWARD(bf16, uint16_t)
FORWARD(f32, float)

/* Which path this build took, for `d3d doctor`. */
const char *d3d_kernel_path(void) {
#if defined(D3D_AVX512_BF16)
    return "avx512: packed bf16 pair dot products (bf16), packed fp32 FMA (fp32)";
#elif defined(__AVX512F__)
    return "avx512: plain bf16 lanes (bf16), packed fp32 FMA (fp32)";
#else
    return "portable C, compiler-vectorised fp32 lanes";
#endif
}
