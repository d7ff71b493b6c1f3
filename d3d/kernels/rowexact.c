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
 * The paths, by what the compiler targets (-march=native):
 *  - AVX-512 BF16: bf16 weights column-packed, pair dot products (vdpbf16ps); quantized weights
 *    decoded into the same packed layout per tile; fp32 weights column-packed, FMA;
 *  - AVX2 + FMA (and AVX-512 without BF16, for bf16): "lanes" — 16 FMA chains per dot product,
 *    lane l over k = l mod 16 — over bf16, fp32 or quantized weights decoded in registers;
 *  - anything else: the same lanes in portable C.
 *
 * Parts: isa.h (instruction sets and their vector primitives), formats.h (weight formats and their
 * decoding), linear.h (with amx.h: the bf16 products on Intel's AMX tiles), attention.h (with
 * attention_amx.h: bf16 attention on the tiles), elementwise.h
 * (RMSNorm, SwiGLU, RoPE and the KV store); this file holds the shared helpers and the whole
 * forward. Compiled on first use by d3d/kernels/build.py with the machine's C compiler
 * (-O3 -march=native -fopenmp) and called through ctypes (d3d/kernels/binding.py); it sees raw
 * pointers and sizes only.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "isa.h"

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
/* exp_fixed on 16 lanes, x already clamped to [−87, 88] (or NaN): the same operations in the same
 * order, so the same bits per lane — but for the last step, p · 2^k, which is one correctly rounded
 * product however it is formed: vscalefps forms it from k directly, where exp_fixed builds 2^k's bits
 * from k as an integer (k ∈ [−126, 127]: a normal power of two; checked on every float, overflow and
 * subnormal results included). */
static inline __m512 exp_clamped16(__m512 x) {
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
    return _mm512_scalef_ps(p, k);
}
/* exp_fixed on 16 lanes (the max and min pass NaNs on, as the scalar clamps do). */
static inline __m512 exp_fixed16(__m512 x) {
    return exp_clamped16(_mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x)));
}
/* exp_fixed16 where every lane is ≤ 0 or NaN (a softmax's x − top), whose upper clamp never acts there.
 * A softmax's exps, with the product by vscalefps: 1.29 → 0.98 cycles an element (AMD EPYC Zen 4, one core). */
static inline __m512 exp_below16(__m512 x) { return exp_clamped16(_mm512_max_ps(_mm512_set1_ps(-87.0f), x)); }
/* out[j] lane l = r[l] lane j: a 16 × 16 transpose of 32-bit lanes in registers. */
static inline __attribute__((always_inline)) void transpose16(const __m512 r[16], __m512 out[16]) {
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
        out[m] = _mm512_shuffle_f32x4(v0, v2, 0x88), out[4 + m] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        out[8 + m] = _mm512_shuffle_f32x4(v1, v3, 0x88), out[12 + m] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
}
#endif


#ifdef D3D_AVX2
/* exp_fixed on 8 lanes: the same operations in the same order, so the same bits per lane. */
static inline __attribute__((always_inline)) v8 exp_fixed8(v8 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    v8 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v8 r = v8_fma(k, _mm256_set1_ps(-0.693359375f), x);
    r = v8_fma(k, _mm256_set1_ps(2.12194440e-4f), r);
    v8 p = _mm256_set1_ps(1.3981999507e-3f);
    p = v8_fma(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = v8_fma(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = v8_fma(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = v8_fma(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(v8_fma(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#include "formats.h"
#include "linear.h"
#include "attention.h"
#include "elementwise.h"
#include "attention_amx.h"
#include "greedy.h"

/* ---------------------------------------------------------------------------------------------
 * The whole decoder in one call: every layer, then the final norm, over a KV cache, in one
 * parallel region. Each stage is the body of the per-op kernel (the same code, so the same bits as
 * a forward made of per-op calls); the implicit barrier after each stage orders them.
 *
 * The arguments come as one struct (mirrored by d3d_forward_args in d3d/kernels/binding.py): per
 * layer its named tensors — NULL for an absent bias or q/k norm — with each linear weight in its
 * format; `x` (M, hidden) is the residual stream, updated in place; `out` gets the final norm of
 * it. The M rows belong to `num_segments` sequences, each with its own KV cache (d3d_segment):
 * a segment's rows are consecutive in x, its new tokens go to its slots start … start+rows-1, and
 * its attention sees its own cache only — so sequences of any lengths share every linear layer
 * of one call (continuous batching), each row's bits those of the row alone. Cache element
 * (l, g, s, d) of a segment at l*kv_layer + g*kv_head + s*D + d from its k_cache (or tiled, with
 * k_tiled), v_cache's by its v_row and v_part (attention.h).
 * `rope`: (2, P, D) cos and sin tables; `positions` (M) rows of them (past P - 1 the last: only async
 * branches drafted beyond the length limit reach them, never verified). A segment's `mask`:
 * (rows, start+rows) bytes, or NULL for causal (d3d_segment, attention.h). Scratch: `work`
 * (M, hidden + width + 2 H D + 3 I) elements, `scores` d3d_segments_scratch floats, `linear_scratch` d3d_linear_scratch(M, max width, threads) floats.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const void *input_norm;
    d3d_weight qkv;
    const void *qkv_bias, *q_norm, *k_norm;
    d3d_weight o;
    const void *o_bias, *post_norm;
    d3d_weight gate_up;
    const void *gate_up_bias;
    d3d_weight down;
    const void *down_bias;
} d3d_layer;

typedef struct {
    const d3d_layer *layers;
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    void *x;
    const void *rope;
    const int64_t *positions;
    int64_t rope_positions;
    const d3d_segment *segments;
    int64_t num_segments, rows;
    const void *final_norm;
    void *out, *work;
    float *scores, *linear_scratch;
    int64_t threads;
    int64_t keep_rows;  /* the last rows whose outputs are read (≤ QUERY_BLOCK, of the last segment), or `rows` */
} d3d_forward_args;

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
void d3d_forward_##SUFFIX(const d3d_forward_args *a) {                                               \
    int64_t M = a->rows, H = a->heads, Hkv = a->kv_heads;                                           \
    int64_t D = a->head_dim, I = a->intermediate, hidden = a->hidden, width = (H + 2 * Hkv) * D;     \
    T_ELEM *x = a->x, *normed = a->work, *qkv = normed + M * hidden, *q = qkv + M * width;           \
    T_ELEM *attn = q + M * H * D, *gate_up = attn + M * H * D, *act = gate_up + M * 2 * I;           \
    const T_ELEM *rope = a->rope;                                                                    \
    float *scratch = a->linear_scratch;                                                              \
    _Pragma("omp parallel num_threads(a->threads)")                                                  \
    {                                                                                                \
    double stage_clock_ = omp_get_wtime();                                                           \
    (void)stage_clock_;                                                                              \
    for (int64_t l = 0; l < a->num_layers; l++) {                                                    \
        const d3d_layer *w = a->layers + l;                                                          \
        rms_norm_body_##SUFFIX(x, w->input_norm, normed, M, hidden, a->eps);                         \
        STAGE(STAGE_NORM);                                                                           \
        linear_##SUFFIX(normed, hidden, &w->qkv, w->qkv_bias, NULL, qkv, M, width, hidden, scratch); \
        STAGE(STAGE_QKV);                                                                            \
        if (w->q_norm) {  /* Qwen3: RMSNorm of every q and k head, in place */                       \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t item = 0; item < M * (H + Hkv); item++) {                                   \
                int64_t m = item / (H + Hkv), j = item % (H + Hkv);                                  \
                T_ELEM *head = qkv + m * width + j * D;                                              \
                rms_norm_row_##SUFFIX(head, j < H ? w->q_norm : w->k_norm, head, D, a->eps);         \
            }                                                                                        \
        }                                                                                            \
        for (int64_t i = 0, m = 0; i < a->num_segments; m += a->segments[i++].rows) {  /* every thread */ \
            const d3d_segment *g = a->segments + i;                                                  \
            rope_store_body_##SUFFIX(qkv + m * width, rope, rope + a->rope_positions * D, a->positions + m, \
                                     q + m * H * D, (T_ELEM *)g->k_cache + l * g->kv_layer,          \
                                     (T_ELEM *)g->v_cache + l * g->kv_layer, 1, g->rows, H, Hkv, D,  \
                                     g->start, 0, g->kv_head, g->v_row, g->v_part, g->k_tiled,       \
                                     a->rope_positions - 1);                                         \
        }                                                                                            \
        STAGE(STAGE_ROPE);                                                                           \
        /* Past the last layer's keys and values, only the rows whose outputs are read go on (a       \
         * prompt's last row; none for a chunk before it): the last keep_rows of the last segment,     \
         * attended to as a segment of their own after the rows before them — the same bits, as every  \
         * row's are whatever rows share its call. */                                                \
        int64_t from = l == a->num_layers - 1 ? M - a->keep_rows : 0, n = M - from;                  \
        if (from == 0) {                                                                             \
            d3d_attention_##SUFFIX##_segments_body(q, attn, a->segments, a->num_segments, l, H, Hkv, D, \
                                                   a->scale, a->scores);  /* the short ones, together */ \
            for (int64_t i = 0, m = 0; i < a->num_segments; m += a->segments[i++].rows) {            \
                const d3d_segment *g = a->segments + i;                                              \
                if (g->rows <= QUERY_BLOCK) continue;                                                \
                d3d_attention_##SUFFIX##_body(q + m * H * D, (T_ELEM *)g->k_cache + l * g->kv_layer, \
                                              (T_ELEM *)g->v_cache + l * g->kv_layer, g->mask,       \
                                              attn + m * H * D, 1, g->rows, H, Hkv, g->start + g->rows, D, \
                                              0, g->kv_head, g->v_row, g->v_part, g->k_tiled, a->scale, \
                                              a->scores);                                            \
            }                                                                                        \
        } else if (n > 0) {                                                                          \
            const d3d_segment *g = a->segments + a->num_segments - 1;                                \
            d3d_segment tail = *g;                                                                   \
            tail.rows = n, tail.start = g->start + g->rows - n;                                      \
            tail.mask = g->mask ? g->mask + (g->rows - n) * (g->start + g->rows) : NULL;             \
            d3d_attention_##SUFFIX##_segments_body(q + from * H * D, attn + from * H * D, &tail, 1, l, H, \
                                                   Hkv, D, a->scale, a->scores);                     \
        }                                                                                            \
        STAGE(STAGE_ATTENTION);                                                                      \
        if (n == 0) break;                                                                           \
        T_ELEM *xs = x + from * hidden;                                                              \
        linear_##SUFFIX(attn + from * H * D, H * D, &w->o, w->o_bias, xs, xs, n, hidden, H * D, scratch); \
        STAGE(STAGE_O);                                                                              \
        rms_norm_body_##SUFFIX(xs, w->post_norm, normed, n, hidden, a->eps);                         \
        STAGE(STAGE_NORM);                                                                           \
        linear_##SUFFIX(normed, hidden, &w->gate_up, w->gate_up_bias, NULL, gate_up, n, 2 * I, hidden, scratch); \
        STAGE(STAGE_GATE_UP);                                                                        \
        silu_mul_body_##SUFFIX(gate_up, act, n, I);                                                  \
        STAGE(STAGE_SILU);                                                                           \
        linear_##SUFFIX(act, I, &w->down, w->down_bias, xs, xs, n, hidden, I, scratch);              \
        STAGE(STAGE_DOWN);                                                                           \
        if (l == a->num_layers - 1) {                                                                \
            rms_norm_body_##SUFFIX(xs, a->final_norm, (T_ELEM *)a->out + from * hidden, n, hidden, a->eps); \
            STAGE(STAGE_NORM);                                                                       \
        }                                                                                            \
    }                                                                                                \
    }                                                                                                \
}

FORWARD(bf16, uint16_t)
FORWARD(f32, float)

/* exp_fixed over n floats: the softmax's own exp, for the pair contract's reference
 * (tests/test_kernels.py). */
void d3d_exp_fixed(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_fixed(x[i]);
}

/* The vector softmax's exp over n floats, each ≤ 0 (exp_below16 where the build has AVX-512, else
 * exp_fixed): for the tests, which hold it to exp_fixed's bits. */
void d3d_exp_below(const float *x, float *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, exp_below16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = exp_fixed(x[i]);
}

/* Which path this build took, for `d3d doctor`. */
const char *d3d_kernel_path(void) {
#ifdef D3D_AMX
    if (amx_on)
#ifdef D3D_AMX_EMULATE
        return "amx (emulated): bf16 tiles (bf16 linears, quantized blocks decoded into tiles; bf16 attention), packed fp32 FMA (fp32)";
#else
        return "amx: bf16 tiles (bf16 linears, quantized blocks decoded into tiles; bf16 attention), packed fp32 FMA (fp32)";
#endif
#endif
#if defined(D3D_LOOKUP)
    if (quads_on)
        return "avx512: packed bf16 pair dot products (bf16; 4-bit blocks looked up in quads, other quantized blocks grouped, decoded in registers; attention as pair dot products), packed fp32 FMA (fp32)";
#endif
#if defined(D3D_AVX512_BF16)
    return "avx512: packed bf16 pair dot products (bf16; quantized blocks grouped, decoded in registers; attention as pair dot products), packed fp32 FMA (fp32)";
#elif defined(__AVX512F__)
    return "avx512: avx2 fp32 lanes (bf16, quantized), packed fp32 FMA (fp32)";
#elif defined(D3D_AVX2)
    return "avx2: fp32 lanes (bf16 lane-packed, fp32, quantized)";
#else
    return "portable C, compiler-vectorised fp32 lanes";
#endif
}

/* The size of d3d_forward_args, d3d_layer and d3d_segment, so the Python mirror can check its layout. */
int64_t d3d_struct_sizes(int which) {
    return which == 0 ? (int64_t)sizeof(d3d_forward_args) : which == 1 ? (int64_t)sizeof(d3d_layer)
                                                                    : (int64_t)sizeof(d3d_segment);
}
