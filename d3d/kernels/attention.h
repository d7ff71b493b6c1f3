/* ---------------------------------------------------------------------------------------------
 * attention: q (B, T, H, D) contiguous; k: element (b, g, s, d) at b*kv_batch + g*kv_head + s*D + d —
 * rows of D values (k_tiled 0) — or, with k_tiled where the build reads tiled keys (TILED_KEYS_bf16(D):
 * the AVX2 build's bf16 keys, D a multiple of 16), at b*kv_batch + g*kv_head + (s / KEY_TILE)*KEY_TILE*D
 * + (d / 2)*2*KEY_TILE + (s % KEY_TILE)*2 + d % 2: each tile of 16 slots in the place of its 16 rows,
 * by pairs of d, so that the pairs of 8 keys the scores take together are one load (KVCache's tiled
 * keys; a one-token step's scores after 4,096 tokens 0.77x the time of transposing rows, AMD EPYC Zen 3);
 * v: element (b, g, s, d) at b*kv_batch + g*kv_head + (d / V_PART)*v_part + s*v_row + d % V_PART —
 * rows of D values (v_row = D, v_part = V_PART) or, in a cache of capacity C with D a multiple of
 * V_PART, each V_PART values of d stored for every slot before the next (v_row = V_PART,
 * v_part = C*V_PART), so that a weighted-sum item, which reads one V_PART slice of d for every key,
 * streams contiguous memory (KVCache's split values); out (B, T, H, D). Query t of a causal call
 * (mask NULL) sees keys 0 … S-T+t; with a mask (B, T, S) bytes, the keys whose byte is 1. In fp32:
 *  1. scores: a tile of 16 keys serves every query of its KV head — transposed once, or read as
 *     it is where its layout allows (a few queries; every chunk of a tiled tile on AVX2); a
 *     score is one FMA chain over d = 0 … D-1 (q pre-scaled), whatever the tile or query count
 *     (QUERY_CHUNK chains run interleaved: the same operations, in the same order, per chain);
 *  2. per query: max, exp and sum over the visible keys in 16 lanes, then the weighted sum of V
 *     in key order. `scores` is scratch of d3d_attention_scratch(B, T, H, S) floats.
 * Where the build has AVX-512 BF16, bf16 attention is a contract of its own (d3d_pair_scores): the
 * scores are vdpbf16ps chains over the pairs of d (pair_chains), and the weighted sums, with p
 * rounded to bf16, chains over the pairs of keys (PAIR_SUMS) — two products an operation where the
 * fp32 chains take one: a long prompt's prefill and a verification after thousands of tokens are
 * bound by these operations. Each query's bits are still its own, whatever the query count.
 * ------------------------------------------------------------------------------------------- */

#define KEY_TILE 16
#define MAX_HEAD_DIM 512  /* the widest head (d3d.config.MAX_HEAD_DIM) */

/* Built with -DD3D_PROFILE (scripts/profile_step.py), each pass's wall time, taken by thread 0 after
 * its barrier, adds to d3d_attention_pass_seconds: the scores, the softmax, the weighted sums, and
 * (on AMX tiles, attention_amx.h) the softmax and sums together. */
enum { PASS_SCORES, PASS_SOFTMAX, PASS_SUMS, PASS_SOFTMAX_AND_SUMS, PASSES };
double d3d_attention_pass_seconds[PASSES];
const int64_t d3d_attention_passes = PASSES;  /* the array's length, checked by binding.py */
#ifdef D3D_PROFILE
#define PASS_CLOCK double pass_clock_ = omp_get_wtime();
#define PASS_DONE(pass) do { if (omp_get_thread_num() == 0) { double now_ = omp_get_wtime();             \
                             d3d_attention_pass_seconds[pass] += now_ - pass_clock_; pass_clock_ = now_; } } while (0)
#else
#define PASS_CLOCK
#define PASS_DONE(pass) do { } while (0)
#endif

/* The weighted sum of V, in items of PART_DIMS values of d for the heads of one KV head: o[i][d -
 * d0] = sum over s < S in order of p_i[s] · v[s, d] for the n ≤ 4 heads p_i = p + i · p_stride and
 * d0 ≤ d < d0 + dn (dn ≤ PART_DIMS) — one FMA chain per (head, d), keys with p_i[s] = 0 skipped
 * or, with AVX-512, added (the same bits, see P_ZERO below),
 * whatever n, d0 or dn. The heads of a group read each V row once, and splitting d gives two threads
 * work even when a one-token step has fewer KV heads than threads' worth of items. */
#define PART_DIMS 32
#define V_PART PART_DIMS  /* values of d stored together in a split V (one weighted-sum item's) */
#define PREFETCH_KEYS 128  /* V rows ahead of the one summed, into L2 (prefetcht1): a long context streams
                            * V from memory (AMD EPYC Zen 5, 4K keys, 30 layers: 8 rows 8.5 ms, 64: 5.7,
                            * 128: 5.2, 256: 5.7; Zen 4, attention alone, 31 alternated rounds: into L2
                            * rather than non-temporal 1.08x at one query after 4,096 keys, 1.07x for 16
                            * one-token sequences after 256) */
#define TILES_AHEAD 4  /* jobs ahead whose key tile a thread prefetches, into L2 (prefetcht1): AMD EPYC
                        * Zen 4, attention alone, 30 layers, one query after 4,096 keys, 31 alternated
                        * rounds: 2 ahead non-temporal (before) 4.2-4.3 ms, 4 ahead into L2 3.6-3.8, 2 or
                        * 6 ahead into L2 within 5% of 4; 16 one-token sequences after 256 keys 1.15x */
#define WEIGHTED_SUM_PORTABLE(T_ELEM, LOAD, p, p_stride, n, v, S, D, d0, dn, o)                     \
    do {                                                                                             \
        for (int i_ = 0; i_ < (n); i_++) {                                                           \
            const float *pi_ = (p) + i_ * (p_stride);                                                \
            for (int64_t d = 0; d < (dn); d++) (o)[i_][d] = 0.0f;                                    \
            for (int64_t s = 0; s < (S); s++) {                                                      \
                float ps = pi_[s];                                                                   \
                if (ps == 0.0f) continue;                                                            \
                const T_ELEM *vr = (v) + s * (D) + (d0);                                             \
                for (int64_t d = 0; d < (dn); d++) (o)[i_][d] = fmaf(ps, LOAD(vr[d]), (o)[i_][d]);   \
            }                                                                                        \
        }                                                                                            \
    } while (0)
#ifdef __AVX512F__
static inline __m512 load16_bf16(const uint16_t *a, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, a)), 16));
}
static inline __m512 load16_f32(const float *a, __mmask16 live) { return _mm512_maskz_loadu_ps(live, a); }
/* Two bf16 values in a 32-bit lane (a pair), widened to fp32: the low one, the high one. */
#define PAIR_LOW(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(p), 16))
#define PAIR_HIGH(p) _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p), _mm512_set1_epi32((int)0xffff0000u)))
/* P_ZERO: adding p = 0 changes no chain, so the AVX-512 loops add it instead of testing for it
 * (one branch less per key and head; whole forwards on Zen 4, old and new alternated, the same
 * bits: 5-17 rows after 4,096 tokens 1.02-1.11x, 128- and 512-row prefill chunks 0.98-1.04x, one
 * row unchanged). For finite v, fma(+0, v, acc) is acc + (±0) rounded: acc itself when acc != 0,
 * and +0 when acc = +0 (x + (-0) = +0 under round-to-nearest). A chain is never -0: it starts at
 * +0, and an FMA whose exact result is zero rounds to +0. (A V value of ±inf under p = 0 would give
 * NaN here where the other builds skip it; every path of this build adds.) */
#define HEAD_FMA16(q, a, b)                                                                          \
    {                                                                                                \
        __m512 pv_ = _mm512_set1_ps(q);                                                              \
        a = _mm512_fmadd_ps(pv_, v0_, a);                                                            \
        b = _mm512_fmadd_ps(pv_, v1_, b);                                                            \
    }
#define WEIGHTED_SUM_VECTOR(SUFFIX, T_ELEM, p, p_stride, n, v, S, D, d0, dn, o)                     \
    do {                                                                                             \
        __mmask16 m0_ = (dn) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (dn)) - 1);              \
        __mmask16 m1_ = (dn) >= 32 ? (__mmask16)0xffff : (dn) <= 16 ? 0 : (__mmask16)((1u << ((dn) - 16)) - 1); \
        const float *p0_ = (p), *p1_ = p0_ + ((n) > 1) * (p_stride), *p2_ = p0_ + ((n) > 2) * 2 * (p_stride), \
                    *p3_ = p0_ + ((n) > 3) * 3 * (p_stride);                                         \
        __m512 a0_ = _mm512_setzero_ps(), b0_ = a0_, a1_ = a0_, b1_ = a0_, a2_ = a0_, b2_ = a0_, a3_ = a0_, b3_ = a0_; \
        for (int64_t s = 0; s < (S); s++) {                                                          \
            const T_ELEM *vr = (v) + s * (D) + (d0);                                                 \
            __builtin_prefetch(vr + PREFETCH_KEYS * (D), 0, 2);                                      \
            __m512 v0_ = load16_##SUFFIX(vr, m0_), v1_ = load16_##SUFFIX(vr + 16, m1_);              \
            HEAD_FMA16(p0_[s], a0_, b0_)                                                             \
            if ((n) > 1) { HEAD_FMA16(p1_[s], a1_, b1_) }                                            \
            if ((n) > 2) { HEAD_FMA16(p2_[s], a2_, b2_) }                                            \
            if ((n) > 3) { HEAD_FMA16(p3_[s], a3_, b3_) }                                            \
        }                                                                                            \
        __m512 all_[4][2] = {{a0_, b0_}, {a1_, b1_}, {a2_, b2_}, {a3_, b3_}};                        \
        for (int i_ = 0; i_ < (n); i_++) {                                                           \
            _mm512_storeu_ps((o)[i_], all_[i_][0]);                                                  \
            _mm512_storeu_ps((o)[i_] + 16, all_[i_][1]);                                             \
        }                                                                                            \
    } while (0)
#define WEIGHTED_SUM_bf16(p, p_stride, n, v, S, D, d0, dn, o) WEIGHTED_SUM_VECTOR(bf16, uint16_t, p, p_stride, n, v, S, D, d0, dn, o)
#define WEIGHTED_SUM_f32(p, p_stride, n, v, S, D, d0, dn, o) WEIGHTED_SUM_VECTOR(f32, float, p, p_stride, n, v, S, D, d0, dn, o)
/* WEIGHTED_SUM_RANGE's vectors (below): a head's 32 values of d in 2 registers of 16 lanes (one
 * piece), up to 8 heads at a time. The bf16 rows move as pairs (lane j: d0 + 2j, d0 + 2j + 1), fp32
 * rows as two halves. */
#define SUM_HEADS 8
typedef __m512 sum_vec;
#define SUM_PIECES 1
#define SUM_LOAD(p) _mm512_loadu_ps(p)
#define SUM_STORE(p, x) _mm512_storeu_ps(p, x)
#define SUM_SPLAT(p) _mm512_set1_ps(p)
#define SUM_FMA(p, w, acc) _mm512_fmadd_ps(p, w, acc)
#define PAIR_PIECE(s, piece, w)                                                                      \
    const uint16_t *vr = v + (s) * D + d0;                                                           \
    __builtin_prefetch(vr + PREFETCH_KEYS * D, 0, 2);                                                \
    __m512 x_ = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(live, vr));                             \
    w[0] = PAIR_LOW(x_), w[1] = PAIR_HIGH(x_)
#define HALVES_PIECE(s, piece, w)                                                                    \
    const float *vr = v + (s) * D + d0;                                                              \
    __builtin_prefetch(vr + PREFETCH_KEYS * D, 0, 2);                                                \
    w[0] = load16_f32(vr, m0), w[1] = load16_f32(vr + 16, m1)
#define SUM_RANGE_MASKS_bf16 __mmask16 live = dn >= 32 ? (__mmask16)0xffff : (__mmask16)((1u << (dn / 2)) - 1);
#define SUM_RANGE_MASKS_f32                                                                          \
    __mmask16 m0 = dn >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << dn) - 1);                       \
    __mmask16 m1 = dn >= 32 ? (__mmask16)0xffff : dn <= 16 ? 0 : (__mmask16)((1u << (dn - 16)) - 1);
#define RANGED_bf16(dn) ((dn) % 2 == 0)  /* whole pairs of d (else each head alone, WEIGHTED_SUM) */
#define RANGED_f32(dn) 1
#elif defined(D3D_AVX2)
static inline __attribute__((always_inline)) v8 load8_bf16(const uint16_t *a) { return v8_from_bf16(a); }
static inline __attribute__((always_inline)) v8 load8_f32(const float *a) { return v8_load(a); }
/* Two bf16 values in a 32-bit lane (a pair), widened to fp32: the low one, the high one. */
#define PAIR_LOW8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(p), 16))
#define PAIR_HIGH8(p) _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)))
/* Two heads at a time, 32 values of d in 4 registers each; dn a multiple of 8, else portable. */
#define HEAD_FMA8(q, a)                                                                              \
    if ((q) != 0.0f) {                                                                               \
        v8 pv_ = _mm256_set1_ps(q);                                                                  \
        a[0] = v8_fma(pv_, w_[0], a[0]);                                                             \
        if (parts_ > 1) a[1] = v8_fma(pv_, w_[1], a[1]);                                             \
        if (parts_ > 2) a[2] = v8_fma(pv_, w_[2], a[2]);                                             \
        if (parts_ > 3) a[3] = v8_fma(pv_, w_[3], a[3]);                                             \
    }
#define WEIGHTED_SUM_AVX2(SUFFIX, T_ELEM, LOAD, p, p_stride, n, v, S, D, d0, dn, o)                 \
    if ((dn) % 8) WEIGHTED_SUM_PORTABLE(T_ELEM, LOAD, p, p_stride, n, v, S, D, d0, dn, o);           \
    else                                                                                             \
        for (int h0_ = 0; h0_ < (n); h0_ += 2) {                                                     \
            int parts_ = (int)((dn) / 8), two_ = (n) - h0_ > 1;                                       \
            const float *pa_ = (p) + h0_ * (p_stride), *pb_ = pa_ + two_ * (p_stride);               \
            v8 a_[4] = {v8_zero(), v8_zero(), v8_zero(), v8_zero()}, b_[4] = {v8_zero(), v8_zero(), v8_zero(), v8_zero()}; \
            for (int64_t s = 0; s < (S); s++) {                                                      \
                const T_ELEM *vr = (v) + s * (D) + (d0);                                             \
                __builtin_prefetch(vr + PREFETCH_KEYS * (D), 0, 2);                                  \
                v8 w_[4];                                                                            \
                for (int j_ = 0; j_ < 4; j_++) w_[j_] = j_ < parts_ ? load8_##SUFFIX(vr + 8 * j_) : v8_zero(); \
                HEAD_FMA8(pa_[s], a_)                                                                \
                if (two_) { HEAD_FMA8(pb_[s], b_) }                                                  \
            }                                                                                        \
            for (int j_ = 0; j_ < parts_; j_++) {                                                    \
                v8_store((o)[h0_] + 8 * j_, a_[j_]);                                                 \
                if (two_) v8_store((o)[h0_ + 1] + 8 * j_, b_[j_]);                                   \
            }                                                                                        \
        }
#define WEIGHTED_SUM_bf16(p, p_stride, n, v, S, D, d0, dn, o) WEIGHTED_SUM_AVX2(bf16, uint16_t, bf16_to_f32, p, p_stride, n, v, S, D, d0, dn, o)
#define WEIGHTED_SUM_f32(p, p_stride, n, v, S, D, d0, dn, o) WEIGHTED_SUM_AVX2(f32, float, IDENTITY, p, p_stride, n, v, S, D, d0, dn, o)
/* WEIGHTED_SUM_RANGE's vectors: a head's 32 values of d in 4 registers of 8 lanes, laid out as
 * AVX-512's 2 of 16 and taken as two pieces of 2 (bf16 pairs: the low and high halves of d0 … d0+15,
 * then of d0+16 … d0+31; fp32: d0 … d0+7 and d0+16 … d0+23, then the 8 after each), up to 3 heads at
 * a time: 12 accumulators, a piece's 2 values and a broadcast fit the 16 registers (a whole row's 4
 * did not: AMD EPYC Zen 3, GCC spilled 3 accumulators, each FMA then waited on a store and a load —
 * a prefill's sums 3.6x slower than the registers allow). Whole slices of 32 only. */
#define SUM_HEADS 3
typedef v8 sum_vec;
#define SUM_PIECES 2
#define SUM_LOAD(p) v8_load(p)
#define SUM_STORE(p, x) v8_store(p, x)
#define SUM_SPLAT(p) v8_splat_reg(&(p))  /* once a piece (isa.h): 3 broadcasts kept would spill accumulators */
#define SUM_FMA(p, w, acc) v8_fma(p, w, acc)
#define PAIR_PIECE(s, piece, w)                                                                      \
    const uint16_t *vr = v + (s) * D + d0;                                                           \
    if ((piece) == 0) __builtin_prefetch(vr + PREFETCH_KEYS * D, 0, 2);                              \
    v8 x_ = _mm256_loadu_ps((const float *)(vr + 16 * (piece)));                                    \
    w[0] = PAIR_LOW8(x_), w[1] = PAIR_HIGH8(x_)
#define HALVES_PIECE(s, piece, w)                                                                    \
    const float *vr = v + (s) * D + d0;                                                              \
    if ((piece) == 0) __builtin_prefetch(vr + PREFETCH_KEYS * D, 0, 2);                              \
    w[0] = v8_load(vr + 8 * (piece)), w[1] = v8_load(vr + 16 + 8 * (piece))
#define SUM_RANGE_MASKS_bf16 (void)dn;
#define SUM_RANGE_MASKS_f32 (void)dn;
#define RANGED_bf16(dn) ((dn) == 32)
#define RANGED_f32(dn) ((dn) == 32)
#else
#define WEIGHTED_SUM_bf16(p, p_stride, n, v, S, D, d0, dn, o) WEIGHTED_SUM_PORTABLE(uint16_t, bf16_to_f32, p, p_stride, n, v, S, D, d0, dn, o)
#define WEIGHTED_SUM_f32(p, p_stride, n, v, S, D, d0, dn, o) WEIGHTED_SUM_PORTABLE(float, IDENTITY, p, p_stride, n, v, S, D, d0, dn, o)
#endif
#ifdef SUM_HEADS
/* The weighted sums of N ≤ SUM_HEADS heads with their own rows p_i and ends (several queries'), over
 * the keys s0 ≤ s < s1 of one V slice, one V row at a time, each (head, d) chain carried in `acc`
 * (head i's in rows 2i and 2i+1) from the keys before: every chain is WEIGHTED_SUM's — keys
 * s < end_i in order, p_i[s] = 0 added like any other (P_ZERO) — however the keys are cut into
 * ranges. LOAD_PIECE(s, piece, w) puts V row s's values of one piece in the 2 vectors w: the piece's
 * lanes of acc rows 2i and 2i + 1. */
#define SUM_QUERIES(group) ((group) >= SUM_HEADS ? 1 : SUM_HEADS / (group))
#define SUM_TOGETHER(group) ((group) <= SUM_HEADS)
#define SUM_WIDTH (16 / SUM_PIECES)  /* lanes of a vector */
#define HEADS_FMA(i, s, piece)                                                                       \
    {                                                                                                \
        sum_vec p_ = SUM_SPLAT(rows[i][s]);                                                          \
        a[i][piece][0] = SUM_FMA(p_, w[0], a[i][piece][0]);                                          \
        a[i][piece][1] = SUM_FMA(p_, w[1], a[i][piece][1]);                                          \
    }
#define SUM_RANGE_LOOP(LOAD_PIECE)                                                                   \
    int64_t first_end = ends[0], last_end = ends[0];                                                 \
    for (int i = 1; i < N; i++) {                                                                    \
        first_end = ends[i] < first_end ? ends[i] : first_end;                                       \
        last_end = ends[i] > last_end ? ends[i] : last_end;                                          \
    }                                                                                                \
    first_end = first_end < s1 ? first_end : s1;                                                     \
    last_end = last_end < s1 ? last_end : s1;                                                        \
    sum_vec a[SUM_HEADS][SUM_PIECES][2];                                                             \
    for (int i = 0; i < N; i++)                                                                      \
        for (int h = 0; h < SUM_PIECES; h++)                                                         \
            for (int k = 0; k < 2; k++) a[i][h][k] = SUM_LOAD(acc[2 * i + k] + h * SUM_WIDTH);       \
    for (int64_t s = s0; s < first_end; s++)  /* every head sees these keys */                       \
        for (int h = 0; h < SUM_PIECES; h++) {                                                       \
            sum_vec w[2];                                                                            \
            LOAD_PIECE(s, h, w);                                                                     \
            for (int i = 0; i < N; i++) HEADS_FMA(i, s, h)                                           \
        }                                                                                            \
    for (int64_t s = s0 > first_end ? s0 : first_end; s < last_end; s++)                            \
        for (int h = 0; h < SUM_PIECES; h++) {                                                       \
            sum_vec w[2];                                                                            \
            LOAD_PIECE(s, h, w);                                                                     \
            for (int i = 0; i < N; i++)                                                              \
                if (s < ends[i]) HEADS_FMA(i, s, h)                                                  \
        }                                                                                            \
    for (int i = 0; i < N; i++)                                                                      \
        for (int h = 0; h < SUM_PIECES; h++)                                                         \
            for (int k = 0; k < 2; k++) SUM_STORE(acc[2 * i + k] + h * SUM_WIDTH, a[i][h][k]);
static inline __attribute__((always_inline)) void sum_range_bf16(const float *const *rows, const int64_t *ends,
                                                                 const int N, const uint16_t *v, int64_t D,
                                                                 int64_t d0, int64_t dn, int64_t s0, int64_t s1,
                                                                 float (*acc)[16]) {
    SUM_RANGE_MASKS_bf16
    SUM_RANGE_LOOP(PAIR_PIECE)
}
static inline __attribute__((always_inline)) void sum_range_f32(const float *const *rows, const int64_t *ends,
                                                                const int N, const float *v, int64_t D,
                                                                int64_t d0, int64_t dn, int64_t s0, int64_t s1,
                                                                float (*acc)[16]) {
    SUM_RANGE_MASKS_f32
    SUM_RANGE_LOOP(HALVES_PIECE)
}
/* head i's values of d from its chains: bf16 pairs interleaved, fp32 halves in order */
static inline void sum_values_bf16(const float (*acc)[16], float *o) {
    for (int j = 0; j < 16; j++) o[2 * j] = acc[0][j], o[2 * j + 1] = acc[1][j];
}
static inline void sum_values_f32(const float (*acc)[16], float *o) {
    for (int j = 0; j < 16; j++) o[j] = acc[0][j], o[16 + j] = acc[1][j];
}
#ifdef D3D_AVX512_BF16
/* bf16 weighted sums as pair dot products (PAIR_SUMS, with the pair scores; where the group's heads
 * are summed together and D is even): each p is rounded to bf16 once (EXP_SUM_PAIRS, which also
 * makes the total the sum of the rounded p), and o[d] is the vdpbf16ps chain over the pairs of keys
 * (s, s + 1), s = 0, 2, 4, … in order, of p's pair and V's values at d — key s + 1's product first,
 * then key s's — up to the pair that holds the query's last visible key, then · (1 / total) as the
 * fp32 sums. A query whose keys end at an odd count has p = 0 beside its last one: the pair adds
 * +0 · v or 0 · 0 first, which changes no chain (P_ZERO), so a V row past a call's last visible key
 * is read as 0, never from memory, and a query's bits are its own. Two keys an operation for one. */
#define PAIR_SUMS_bf16(D, group) (PAIRS_bf16(D) && (group) <= SUM_HEADS)
/* 16 keys of EXP_SUM_PAIRS from s0, its `live` ones (whole vectors, then the tail): its from_, half_, top_, sum_ */
#define EXP_PAIRS_STEP(s0, live)                                                                     \
    {                                                                                                \
        __m512 x = _mm512_maskz_loadu_ps(live, from_ + (s0));                                        \
        __mmask16 seen = _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);   \
        __m256i p = (__m256i)_mm512_maskz_cvtneps_pbh(seen, exp_below16(_mm512_sub_ps(x, top_)));    \
        _mm256_mask_storeu_epi16(half_ + (s0), live, p);                                             \
        sum_ = _mm512_mask_add_ps(sum_, live, sum_, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(p), 16))); \
    }
/* row[s] for s < S = bf16(exp(row[s] - top)) (0 for -inf), written over the row as 16-bit values
 * from its start (row[S] = 0 for odd S), and sums[l] += those rounded values for s = l mod 16, in s
 * order. The bf16 values never overtake the floats still to be read. */
#define EXP_SUM_PAIRS(row, S, top, sums)                                                             \
    do {                                                                                             \
        __m512 sum_ = _mm512_loadu_ps(sums), top_ = _mm512_set1_ps(top);                             \
        const float *from_ = (row);                                                                  \
        uint16_t *half_ = (uint16_t *)(row);                                                         \
        int64_t s0 = 0;                                                                              \
        for (; s0 + LANES <= (S); s0 += LANES) EXP_PAIRS_STEP(s0, (__mmask16)0xffff)                 \
        if (s0 < (S)) EXP_PAIRS_STEP(s0, (__mmask16)((1u << ((S) - s0)) - 1))                        \
        if ((S) % 2) half_[S] = 0;                                                                   \
        _mm512_storeu_ps(sums, sum_);                                                                \
    } while (0)
/* The pair sums of N ≤ SUM_HEADS heads (their bf16 p rows, their ends) over the pairs of keys from s0
 * (even) to s1, one V slice (`live` of its 32 values of d), each head's chains carried in acc (head
 * i's in rows 2i — d = 8L + j in lane 4L + j — and 2i + 1 — d = 8L + 4 + j), as SUM_RANGE_LOOP
 * carries the fp32 ones. */
static inline __attribute__((always_inline)) void sum_pairs(const float *const *rows, const int64_t *ends,
                                                            const int N, const uint16_t *v, int64_t D,
                                                            int64_t dn, int64_t s0, int64_t s1, float (*acc)[16]) {
    __mmask32 live = dn >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << dn) - 1);
    int64_t first_end = ends[0], last_end = ends[0];
    for (int i = 1; i < N; i++) {
        first_end = ends[i] < first_end ? ends[i] : first_end;
        last_end = ends[i] > last_end ? ends[i] : last_end;
    }
    int64_t seen = last_end;  /* keys from here on are read as 0 */
    first_end = first_end < s1 ? first_end : s1;
    last_end = last_end < s1 ? last_end : s1;
    __m512 a[SUM_HEADS][2];
    for (int i = 0; i < N; i++) a[i][0] = _mm512_loadu_ps(acc[2 * i]), a[i][1] = _mm512_loadu_ps(acc[2 * i + 1]);
    int64_t s = s0;
#define PAIR_OF_ROWS                                                                                 \
        const uint16_t *vr = v + s * D;                                                              \
        __builtin_prefetch(vr + PREFETCH_KEYS * D, 0, 2);                                            \
        __builtin_prefetch(vr + (PREFETCH_KEYS + 1) * D, 0, 2);                                      \
        __m512i x0 = _mm512_maskz_loadu_epi16(live, vr);                                             \
        __m512i x1 = s + 1 < seen ? _mm512_maskz_loadu_epi16(live, vr + D) : _mm512_setzero_si512(); \
        __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
#define PAIR_HEAD(i)                                                                                 \
        {                                                                                            \
            __m512bh p_ = (__m512bh)_mm512_set1_epi32(((const int32_t *)rows[i])[s / 2]);            \
            a[i][0] = _mm512_dpbf16_ps(a[i][0], p_, lo);                                             \
            a[i][1] = _mm512_dpbf16_ps(a[i][1], p_, hi);                                             \
        }
    for (; s < first_end; s += 2) {  /* every head sees key s */
        PAIR_OF_ROWS
        for (int i = 0; i < N; i++) PAIR_HEAD(i)
    }
    for (; s < last_end; s += 2) {
        PAIR_OF_ROWS
        for (int i = 0; i < N; i++)
            if (s < ends[i]) PAIR_HEAD(i)
    }
#undef PAIR_OF_ROWS
#undef PAIR_HEAD
    for (int i = 0; i < N; i++) _mm512_storeu_ps(acc[2 * i], a[i][0]), _mm512_storeu_ps(acc[2 * i + 1], a[i][1]);
}
#define WEIGHTED_PAIR_RANGE(rows, ends, n, v, D, dn, s0, s1, acc) SUM_RANGE_SWITCH(sum_pairs, rows, ends, n, v, D, dn, s0, s1, acc)
/* head i's values of d from its pair chains */
static inline void sum_values_pairs(const float (*acc)[16], float *o) {
    for (int L = 0; L < 4; L++)
        for (int j = 0; j < 4; j++) o[8 * L + j] = acc[0][4 * L + j], o[8 * L + 4 + j] = acc[1][4 * L + j];
}
#endif
/* one copy of the loop per head count, so that the accumulators stay in registers; n ≤ SUM_HEADS
 * always (a range's heads_ = SUM_QUERIES(group) · group), the clamp only keeps the cases a build
 * never takes within its arrays */
#define SUM_CASE(FN, k, rows, ends, ...) case k: FN(rows, ends, (k) < SUM_HEADS ? (k) : SUM_HEADS, __VA_ARGS__); break;
#define SUM_RANGE_SWITCH(FN, rows, ends, n, ...)                                                     \
    switch (n) {                                                                                     \
        SUM_CASE(FN, 1, rows, ends, __VA_ARGS__) SUM_CASE(FN, 2, rows, ends, __VA_ARGS__)            \
        SUM_CASE(FN, 3, rows, ends, __VA_ARGS__) SUM_CASE(FN, 4, rows, ends, __VA_ARGS__)            \
        SUM_CASE(FN, 5, rows, ends, __VA_ARGS__) SUM_CASE(FN, 6, rows, ends, __VA_ARGS__)            \
        SUM_CASE(FN, 7, rows, ends, __VA_ARGS__)                                                     \
        default: FN(rows, ends, SUM_HEADS, __VA_ARGS__); break;                                      \
    }
#define WEIGHTED_SUM_RANGE_bf16(rows, ends, n, v, D, d0, dn, s0, s1, acc) SUM_RANGE_SWITCH(sum_range_bf16, rows, ends, n, v, D, d0, dn, s0, s1, acc)
#define WEIGHTED_SUM_RANGE_f32(rows, ends, n, v, D, d0, dn, s0, s1, acc) SUM_RANGE_SWITCH(sum_range_f32, rows, ends, n, v, D, d0, dn, s0, s1, acc)
#else  /* no multi-head sums: an item is one query's heads */
#define SUM_HEADS 4
#define SUM_QUERIES(group) 1
#define SUM_TOGETHER(group) 0
#define WEIGHTED_SUM_RANGE_bf16(rows, ends, n, v, D, d0, dn, s0, s1, acc)
#define WEIGHTED_SUM_RANGE_f32(rows, ends, n, v, D, d0, dn, s0, s1, acc)
#define RANGED_bf16(dn) 0
#define RANGED_f32(dn) 0
static inline void sum_values_bf16(const float (*acc)[16], float *o) { (void)acc, (void)o; }
static inline void sum_values_f32(const float (*acc)[16], float *o) { (void)acc, (void)o; }
#endif

#ifndef D3D_AVX512_BF16  /* no pair sums (PAIR_SUMS_bf16): every p an fp32 value */
#define PAIR_SUMS_bf16(D, group) 0
#define EXP_SUM_PAIRS(row, S, top, sums) (void)0
#define WEIGHTED_PAIR_RANGE(rows, ends, n, v, D, dn, s0, s1, acc) (void)0
static inline void sum_values_pairs(const float (*acc)[16], float *o) { (void)acc, (void)o; }
#endif
#define PAIR_SUMS_f32(D, group) 0
/* row[s] = exp(row[s] - top) (0 for -inf), and sums[l] += row[s] for s = l mod 16, in s order. */
#ifdef __AVX512F__
#define EXP_SUM(row, S, top, sums)                                                                   \
    do {                                                                                             \
        __m512 sum_ = _mm512_loadu_ps(sums), top_ = _mm512_set1_ps(top);                             \
        for (int64_t s0 = 0; s0 < (S); s0 += LANES) {                                                \
            __mmask16 live = (S) - s0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << ((S) - s0)) - 1); \
            __m512 x = _mm512_maskz_loadu_ps(live, (row) + s0);                                      \
            __mmask16 seen = _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ); \
            __m512 p = _mm512_maskz_mov_ps(seen, exp_below16(_mm512_sub_ps(x, top_)));               \
            _mm512_mask_storeu_ps((row) + s0, live, p);                                              \
            sum_ = _mm512_mask_add_ps(sum_, live, sum_, p);                                          \
        }                                                                                            \
        _mm512_storeu_ps(sums, sum_);                                                                \
    } while (0)
#elif defined(D3D_AVX2)
/* lanes s0 … s0+15 in two vectors; the tail's missing lanes neither read nor add */
#define EXP_SUM(row, S, top, sums)                                                                   \
    do {                                                                                             \
        v8 lo_ = v8_load(sums), hi_ = v8_load((sums) + 8), top_ = _mm256_set1_ps(top);               \
        v8 ninf_ = _mm256_set1_ps(-INFINITY);                                                        \
        int64_t full_ = (S) / LANES * LANES;                                                         \
        for (int64_t s0 = 0; s0 < full_; s0 += LANES) {                                              \
            v8 x0 = v8_load((row) + s0), x1 = v8_load((row) + s0 + 8);                               \
            v8 p0 = _mm256_andnot_ps(_mm256_cmp_ps(x0, ninf_, _CMP_EQ_OQ), exp_fixed8(_mm256_sub_ps(x0, top_))); \
            v8 p1 = _mm256_andnot_ps(_mm256_cmp_ps(x1, ninf_, _CMP_EQ_OQ), exp_fixed8(_mm256_sub_ps(x1, top_))); \
            v8_store((row) + s0, p0); v8_store((row) + s0 + 8, p1);                                  \
            lo_ = _mm256_add_ps(lo_, p0); hi_ = _mm256_add_ps(hi_, p1);                              \
        }                                                                                            \
        v8_store(sums, lo_); v8_store((sums) + 8, hi_);                                              \
        for (int l = 0; full_ + l < (S); l++) {                                                      \
            float x_ = (row)[full_ + l];                                                             \
            float p_ = x_ == -INFINITY ? 0.0f : exp_fixed(x_ - (top));                               \
            (row)[full_ + l] = p_;                                                                   \
            (sums)[l] += p_;                                                                         \
        }                                                                                            \
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
#ifdef __AVX512F__
/* 8 chains keep two FMA units of 4 cycles' latency busy; a chunk of at most 4 queries (a one-token
 * step's 3 heads per KV head) runs 4, not 8 with zeros */
#define QUERY_CHUNK 8
#ifdef D3D_AVX512_BF16
#define PAIR_SCORES 1  /* bf16 scores as pair dot products: pair_chains below */
#define PAIRS_bf16(D) ((D) % 2 == 0)
#ifndef D3D_AMX
/* Keys stored tiled (the header; KVCache's tiled keys) are the pair chains' operands as they are: a
 * tile's pair p is one 64-byte load, lane l key l's pair — no transposition a tile. (Builds with the
 * AMX tiles read rows: a process may switch between the two paths, its caches may not.) */
#define TILED_KEYS_bf16(D) PAIRS_bf16(D)
#endif
#else
#define PAIRS_bf16(D) 0
#endif
#define PAIRS_f32(D) 0
#define SCORE_FMA(i) a##i##_ = _mm512_fmadd_ps(_mm512_set1_ps((qs)[(i) * (D) + d]), kd_, a##i##_)
#define SCORE_CHAINS(kt, qs, D, acc, chunk)                                                          \
    do {                                                                                             \
        __m512 a0_ = _mm512_setzero_ps(), a1_ = a0_, a2_ = a0_, a3_ = a0_, a4_ = a0_, a5_ = a0_, a6_ = a0_, a7_ = a0_; \
        if ((chunk) > 4)                                                                             \
            for (int64_t d = 0; d < (D); d++) {                                                      \
                __m512 kd_ = _mm512_loadu_ps((kt)[d]);                                               \
                SCORE_FMA(0); SCORE_FMA(1); SCORE_FMA(2); SCORE_FMA(3);                              \
                SCORE_FMA(4); SCORE_FMA(5); SCORE_FMA(6); SCORE_FMA(7);                              \
            }                                                                                        \
        else                                                                                         \
            for (int64_t d = 0; d < (D); d++) {                                                      \
                __m512 kd_ = _mm512_loadu_ps((kt)[d]);                                               \
                SCORE_FMA(0); SCORE_FMA(1); SCORE_FMA(2); SCORE_FMA(3);                              \
            }                                                                                        \
        _mm512_storeu_ps((acc)[0], a0_); _mm512_storeu_ps((acc)[1], a1_);                            \
        _mm512_storeu_ps((acc)[2], a2_); _mm512_storeu_ps((acc)[3], a3_);                            \
        _mm512_storeu_ps((acc)[4], a4_); _mm512_storeu_ps((acc)[5], a5_);                            \
        _mm512_storeu_ps((acc)[6], a6_); _mm512_storeu_ps((acc)[7], a7_);                            \
    } while (0)
/* kt[d][l] = key l's element d, as float (0 for l ≥ n): 16 × 16 blocks transposed in registers. */
static inline void transpose16_store(__m512 r[16], float (*kt)[KEY_TILE], int64_t d0, int64_t D) {
    __m512 out[16];
    transpose16(r, out);
    for (int j = 0; j < 16; j++)
        if (d0 + j < D) _mm512_storeu_ps(kt[d0 + j], out[j]);
}
/* A bf16 key tile (D even) moves as pairs: lane l of pairs[p] holds key l's elements d0 + 2p (low
 * half) and d0 + 2p + 1 (high half), 0 for l ≥ n — one 16 × 16 transpose per 32 values of d, half
 * the shuffles of transposing the widened values. */
static inline __attribute__((always_inline)) void key_pairs(const uint16_t *kb, int64_t n, int64_t D, int64_t d0,
                                                            __m512 pairs[16]) {
    int64_t live_pairs = (D - d0) / 2 < 16 ? (D - d0) / 2 : 16;
    __mmask16 live = live_pairs >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << live_pairs) - 1);
    __m512 r[16];
    for (int l = 0; l < KEY_TILE; l++)
        r[l] = l < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(live, kb + l * D + d0)) : _mm512_setzero_ps();
    transpose16(r, pairs);
}
/* SCORE_CHAINS for C ≤ 4 queries straight from a bf16 key tile: the same chains, d in order, over
 * the same widened values, without storing the transposed tile (a one-token step's job). */
static inline __attribute__((always_inline)) void fused_scores_bf16(const uint16_t *kb, int64_t n, int64_t D,
                                                                    const float *qs, const int C,
                                                                    float (*acc)[KEY_TILE], int tiled, float scale) {
    (void)tiled;  /* tiled keys: the pair chains' only (d3d_tiled_keys) */
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#ifdef D3D_AVX512_BF16
    if (PAIRS_bf16(D)) {  /* the pair chains (pair_chains), q's pairs as they are */
        const int32_t *words = (const int32_t *)qs;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            __m512 pairs[16];
            int np = (D - d0) / 2 < 16 ? (int)((D - d0) / 2) : 16;
            if (tiled)  /* the tile's pairs as stored (lanes past n: its unused slots, scored, never stored) */
                for (int p = 0; p < np; p++) pairs[p] = _mm512_loadu_ps((const float *)(kb + (d0 / 2 + p) * 2 * KEY_TILE));
            else
                key_pairs(kb, n, D, d0, pairs);
            for (int p = 0; p < np; p++)
                for (int i = 0; i < C; i++)
                    a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(words[i * D + d0 / 2 + p]),
                                            (__m512bh)_mm512_castps_si512(pairs[p]));
        }
        for (int i = 0; i < C; i++) _mm512_storeu_ps(acc[i], _mm512_mul_ps(a[i], _mm512_set1_ps(scale)));
        return;
    }
#endif
    (void)scale;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512 pairs[16];
        key_pairs(kb, n, D, d0, pairs);
        int np = (D - d0) / 2 < 16 ? (int)((D - d0) / 2) : 16;
        for (int p = 0; p < np; p++) {
            __m512 lo = PAIR_LOW(pairs[p]), hi = PAIR_HIGH(pairs[p]);
            int64_t d = d0 + 2 * p;
            for (int i = 0; i < C; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * D + d]), lo, a[i]);
            for (int i = 0; i < C; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * D + d + 1]), hi, a[i]);
        }
    }
    for (int i = 0; i < C; i++) _mm512_storeu_ps(acc[i], a[i]);
}
#define FUSES_bf16(D) ((D) % 2 == 0)
#if defined(D3D_AVX512_BF16) && !defined(D3D_AMX)
/* fused_scores_bf16's pair chains over two whole tiles of a tiled cache at once (a one-token step's
 * run: TILE_PAIRS below): each query's chain over each tile exactly as there, 2C chains in flight
 * where one tile's C chains of 32 dependent steps were a latency path, and `ahead` — the tile
 * TILES_AHEAD on — fetched into L2 two lines a pair step (the two tiles ahead: 128 bytes a step)
 * rather than in a burst of 32 prefetches before each tile. */
static inline __attribute__((always_inline)) void tiles2_chains(const uint16_t *kb, int64_t D, const float *qs,
                                                                const int C, float (*acc)[KEY_TILE],
                                                                float (*acc2)[KEY_TILE], float scale,
                                                                const char *ahead) {
    const int32_t *words = (const int32_t *)qs;
    const uint16_t *kb2 = kb + KEY_TILE * D;
    __m512 a[4], b[4];
    for (int i = 0; i < C; i++) a[i] = b[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        if (ahead) __builtin_prefetch(ahead + p * 128, 0, 2), __builtin_prefetch(ahead + p * 128 + 64, 0, 2);
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * 2 * KEY_TILE);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb2 + p * 2 * KEY_TILE);
        for (int i = 0; i < C; i++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32(words[i * D + p]);
            a[i] = _mm512_dpbf16_ps(a[i], x, k0), b[i] = _mm512_dpbf16_ps(b[i], x, k1);
        }
    }
    __m512 s = _mm512_set1_ps(scale);
    for (int i = 0; i < C; i++) _mm512_storeu_ps(acc[i], _mm512_mul_ps(a[i], s)), _mm512_storeu_ps(acc2[i], _mm512_mul_ps(b[i], s));
}
/* Not inlined, one copy per query count: within the run's body GCC kept a key vector and the queries'
 * addresses on the stack, reloading them every pair step (as in pair_chains above). */
static __attribute__((noinline)) void fused_tiles2_bf16(const uint16_t *kb, int64_t D, const float *qs, int C,
                                                        float (*acc)[KEY_TILE], float (*acc2)[KEY_TILE], float scale,
                                                        const char *ahead) {
    switch (C) {
        case 1: tiles2_chains(kb, D, qs, 1, acc, acc2, scale, ahead); break;
        case 2: tiles2_chains(kb, D, qs, 2, acc, acc2, scale, ahead); break;
        case 3: tiles2_chains(kb, D, qs, 3, acc, acc2, scale, ahead); break;
        default: tiles2_chains(kb, D, qs, 4, acc, acc2, scale, ahead); break;
    }
}
/* pair_chains (below) over two whole tiles at once, for a chunk of 5 to QUERY_CHUNK queries: 16 chains,
 * each query's pair broadcast once for both tiles, its registers named as pair_chains's are (tiles2_chains
 * for 5-8 queries instead, its loops as clean: a 512-row chunk after 3,584 tokens 1.05-1.06x as long,
 * AMD EPYC Zen 4). */
#define PAIR_DP2(i) x = (__m512bh)_mm512_set1_epi32(words[(i) * D + p]),                              \
                    a##i = _mm512_dpbf16_ps(a##i, x, k0), b##i = _mm512_dpbf16_ps(b##i, x, k1)
static __attribute__((noinline)) void pair_chains2(const uint16_t *kb, int64_t D, const float *qs,
                                                   float (*acc)[KEY_TILE], float (*acc2)[KEY_TILE], float scale) {
    const int32_t *words = (const int32_t *)qs;
    const uint16_t *kb2 = kb + KEY_TILE * D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
    for (int64_t p = 0; p < D / 2; p++) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * 2 * KEY_TILE);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb2 + p * 2 * KEY_TILE), x;
        PAIR_DP2(0); PAIR_DP2(1); PAIR_DP2(2); PAIR_DP2(3); PAIR_DP2(4); PAIR_DP2(5); PAIR_DP2(6); PAIR_DP2(7);
    }
    __m512 s = _mm512_set1_ps(scale);
#define PAIR_STORE2(i) _mm512_storeu_ps(acc[i], _mm512_mul_ps(a##i, s)), _mm512_storeu_ps(acc2[i], _mm512_mul_ps(b##i, s))
    PAIR_STORE2(0); PAIR_STORE2(1); PAIR_STORE2(2); PAIR_STORE2(3);
    PAIR_STORE2(4); PAIR_STORE2(5); PAIR_STORE2(6); PAIR_STORE2(7);
#undef PAIR_STORE2
}
#undef PAIR_DP2
/* Whether whole tiles are scored two at a time (a tiled cache): a one-token step's run (group <= 4),
 * and the tiles every query of a few rows' call sees whole (ATTENTION_PAIR_RUN). */
#define TILE_PAIRS_bf16(D, tiled) (PAIRS_bf16(D) && (tiled))
#define FUSED_TILES2_bf16(kb, D, qs, C, acc, acc2, scale, ahead) fused_tiles2_bf16(kb, D, qs, C, acc, acc2, scale, ahead);
#define PAIR_CHAINS2_bf16(kb, D, qs, C, acc, acc2, scale)                                            \
    if ((C) <= 4) fused_tiles2_bf16(kb, D, qs, C, acc, acc2, scale, NULL);                           \
    else pair_chains2(kb, D, qs, acc, acc2, scale);
#endif
/* out[d] = q[d] · scale (0 where not `live`), one rounding each, 16 at a time. */
#define SCALE_QUERY_FLOATS(SUFFIX, LOAD, qr, D, scale, live, out)                                    \
    for (int64_t d0_ = 0; d0_ < (D); d0_ += 16) {                                                    \
        __mmask16 m_ = !(live) ? 0 : (D) - d0_ >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << ((D) - d0_)) - 1); \
        _mm512_storeu_ps((out) + d0_, _mm512_mul_ps(load16_##SUFFIX((qr) + d0_, m_), _mm512_set1_ps(scale))); \
    }
#ifdef D3D_AVX512_BF16
/* bf16 scores as pair dot products (PAIR_SCORES; d3d_pair_scores): the score of a query and a key is
 * x · scale, one rounding, x the vdpbf16ps chain over their pairs of d in order — each step adds the
 * product of the pair's odd elements, then of its even ones (the instruction's own order; both
 * products exact in fp32), rounding each sum to nearest even, subnormals flushed — starting from +0.
 * Lane l of a chain is key l of a 16-key tile, as in the fp32 chains; a pair step is one operation for
 * two of theirs. The same chain whether the tile is transposed into pairs (key_pairs) in registers for
 * up to 4 queries, stored so for more, or read as a tiled cache stores it, whatever the query count: a
 * query's scores are its own. (tests/test_kernels.py's pair_attention computes the contract step by
 * step, scores, softmax and sums.) */
/* A query's pairs as they are: out[p] (as 32-bit words) = q[2p], q[2p + 1] (0 where not `live`). */
#define QUERY_PAIRS(qr, D, live, out)                                                                \
    for (int64_t d0_ = 0; d0_ < (D); d0_ += 32) {                                                    \
        __mmask16 m_ = !(live) ? 0 : (D) - d0_ >= 32 ? (__mmask16)0xffff : (__mmask16)((1u << (((D) - d0_) / 2)) - 1); \
        _mm512_storeu_si512((out) + d0_ / 2, _mm512_maskz_loadu_epi32(m_, (const uint16_t *)(qr) + d0_)); \
    }
#define SCALE_QUERY_bf16(LOAD, qr, D, scale, live, out)                                              \
    if (PAIRS_bf16(D)) { QUERY_PAIRS(qr, D, live, out) } else { SCALE_QUERY_FLOATS(bf16, LOAD, qr, D, scale, live, out) }
/* One chain step of query i: its pair p broadcast (a 32-bit load) into the key tile's pair vector. */
#define PAIR_DP(i) a##i = _mm512_dpbf16_ps(a##i, (__m512bh)_mm512_set1_epi32(q##i[p]), kp)
/* The pair chains of a chunk of up to QUERY_CHUNK queries (their pairs D floats apart from qs) over a
 * key tile's pairs kt[p], times the scale. Not inlined: within the attention body GCC kept the
 * queries' 8 addresses in vector registers and moved them back one by one every step (objdump: 6
 * vmovq and 2 stack loads for 8 products); here they stay in general registers (a 512-row prefill
 * chunk's scores after 3,584 tokens 269-276 → 241-246 ms, AMD EPYC Zen 4). */
static __attribute__((noinline)) void pair_chains(const float (*kt)[KEY_TILE], const float *qs, int64_t D,
                                                  float (*acc)[KEY_TILE], int chunk, float scale) {
    const int32_t *q0 = (const int32_t *)qs, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D,
                  *q4 = q3 + D, *q5 = q4 + D, *q6 = q5 + D, *q7 = q6 + D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    if (chunk > 4)
        for (int64_t p = 0; p < D / 2; p++) {
            __m512bh kp = (__m512bh)_mm512_loadu_si512(kt[p]);
            PAIR_DP(0); PAIR_DP(1); PAIR_DP(2); PAIR_DP(3); PAIR_DP(4); PAIR_DP(5); PAIR_DP(6); PAIR_DP(7);
        }
    else
        for (int64_t p = 0; p < D / 2; p++) {
            __m512bh kp = (__m512bh)_mm512_loadu_si512(kt[p]);
            PAIR_DP(0); PAIR_DP(1); PAIR_DP(2); PAIR_DP(3);
        }
    __m512 s = _mm512_set1_ps(scale);
    _mm512_storeu_ps(acc[0], _mm512_mul_ps(a0, s)); _mm512_storeu_ps(acc[1], _mm512_mul_ps(a1, s));
    _mm512_storeu_ps(acc[2], _mm512_mul_ps(a2, s)); _mm512_storeu_ps(acc[3], _mm512_mul_ps(a3, s));
    _mm512_storeu_ps(acc[4], _mm512_mul_ps(a4, s)); _mm512_storeu_ps(acc[5], _mm512_mul_ps(a5, s));
    _mm512_storeu_ps(acc[6], _mm512_mul_ps(a6, s)); _mm512_storeu_ps(acc[7], _mm512_mul_ps(a7, s));
}
#define SCORE_CHAINS_bf16(kt, qs, D, acc, chunk, scale)                                              \
    do {                                                                                             \
        if (PAIRS_bf16(D)) pair_chains(kt, qs, D, acc, chunk, scale);                                \
        else SCORE_CHAINS(kt, qs, D, acc, chunk);                                                    \
    } while (0)
#else
#define SCALE_QUERY_bf16(LOAD, qr, D, scale, live, out) SCALE_QUERY_FLOATS(bf16, LOAD, qr, D, scale, live, out)
#endif
#define SCALE_QUERY_f32(LOAD, qr, D, scale, live, out) SCALE_QUERY_FLOATS(f32, LOAD, qr, D, scale, live, out)
#define SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, live, out) SCALE_QUERY_##SUFFIX(LOAD, qr, D, scale, live, out)
#define TRANSPOSE_TILE(SUFFIX, T_ELEM, LOAD, kb, n, D, kt, tiled)                                    \
    if (PAIRS_##SUFFIX(D))  /* the pairs as they are: kt[p] lane l = key l's pair p */                \
        for (int64_t d0_ = 0; d0_ < (D); d0_ += 32) {                                                \
            __m512 pairs_[16];                                                                       \
            key_pairs((const uint16_t *)(kb), (n), (D), d0_, pairs_);                                \
            for (int p_ = 0; p_ < 16 && d0_ + 2 * p_ < (D); p_++) _mm512_storeu_ps((kt)[d0_ / 2 + p_], pairs_[p_]); \
        }                                                                                            \
    else if (FUSES_##SUFFIX(D))                                                                      \
        for (int64_t d0_ = 0; d0_ < (D); d0_ += 32) {                                                \
            __m512 pairs_[16];                                                                       \
            key_pairs((const uint16_t *)(kb), (n), (D), d0_, pairs_);                                \
            for (int p_ = 0; p_ < 16 && d0_ + 2 * p_ < (D); p_++) {                                  \
                _mm512_storeu_ps((kt)[d0_ + 2 * p_], PAIR_LOW(pairs_[p_]));                          \
                _mm512_storeu_ps((kt)[d0_ + 2 * p_ + 1], PAIR_HIGH(pairs_[p_]));                     \
            }                                                                                        \
        }                                                                                            \
    else                                                                                             \
        for (int64_t d0_ = 0; d0_ < (D); d0_ += 16) {                                                \
            __mmask16 live_ = (D) - d0_ >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << ((D) - d0_)) - 1); \
            __m512 r_[16];                                                                           \
            for (int l_ = 0; l_ < KEY_TILE; l_++)                                                    \
                r_[l_] = l_ < (n) ? load16_##SUFFIX((kb) + l_ * (D) + d0_, live_) : _mm512_setzero_ps();  \
            transpose16_store(r_, (kt), d0_, (D));                                                   \
        }
/* The largest of row[0 … S-1]; NaNs are passed over, as the scalar `x > top ? x : top` does. Four
 * running maxima (one was a chain of vmaxps latencies: a 9-row verification after 4K tokens spent 2%
 * of its time here); a maximum is one whatever the order (but for the sign of a zero top, which changes
 * no exp(x − top)). */
static inline float ROW_MAX(const float *row, int64_t S) {
    __m512 top = _mm512_set1_ps(-INFINITY), t1 = top, t2 = top, t3 = top;
    int64_t s0 = 0;
    for (; s0 + 4 * LANES <= S; s0 += 4 * LANES) {
        top = _mm512_max_ps(_mm512_loadu_ps(row + s0), top);
        t1 = _mm512_max_ps(_mm512_loadu_ps(row + s0 + LANES), t1);
        t2 = _mm512_max_ps(_mm512_loadu_ps(row + s0 + 2 * LANES), t2);
        t3 = _mm512_max_ps(_mm512_loadu_ps(row + s0 + 3 * LANES), t3);
    }
    top = _mm512_max_ps(_mm512_max_ps(t1, top), _mm512_max_ps(t3, t2));  /* never NaN: each passed NaNs over */
    for (; s0 < S; s0 += LANES) {
        __mmask16 live = S - s0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (S - s0)) - 1);
        top = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + s0), top);
    }
    float lanes[LANES], best = -INFINITY;
    _mm512_storeu_ps(lanes, top);
    for (int l = 0; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
}
#elif defined(D3D_AVX2)
#define QUERY_CHUNK 6  /* 6 queries x 2 halves of the tile: 12 chains */
#define SCORE_CHAINS_OF(kt, qs, D, acc, C)                                                           \
    do {                                                                                             \
        v8 a_[C][2];                                                                                 \
        for (int i_ = 0; i_ < (C); i_++) a_[i_][0] = a_[i_][1] = v8_zero();                          \
        for (int64_t d = 0; d < (D); d++) {                                                          \
            v8 lo_ = v8_load_reg((kt)[d]), hi_ = v8_load_reg((kt)[d] + 8);  /* each loaded once */     \
            for (int i_ = 0; i_ < (C); i_++) {                                                       \
                v8 q_ = v8_splat_reg(&(qs)[i_ * (D) + d]);                                           \
                a_[i_][0] = v8_fma(q_, lo_, a_[i_][0]);                                              \
                a_[i_][1] = v8_fma(q_, hi_, a_[i_][1]);                                              \
            }                                                                                        \
        }                                                                                            \
        for (int i_ = 0; i_ < (C); i_++) v8_store((acc)[i_], a_[i_][0]), v8_store((acc)[i_] + 8, a_[i_][1]); \
    } while (0)
/* a chunk of at most half runs half the chains (the rest would be queries of zeros) */
#define SCORE_CHAINS(kt, qs, D, acc, chunk)                                                          \
    do {                                                                                             \
        if ((chunk) <= QUERY_CHUNK / 2) SCORE_CHAINS_OF(kt, qs, D, acc, QUERY_CHUNK / 2);            \
        else SCORE_CHAINS_OF(kt, qs, D, acc, QUERY_CHUNK);                                           \
    } while (0)
#define SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, live, out)                                           \
    for (int64_t d = 0; d < (D); d++) (out)[d] = (live) ? LOAD((qr)[d]) * (scale) : 0.0f;
/* out[j] lane i = r[i] lane j: an 8 x 8 transpose of 32-bit lanes in registers. */
static inline __attribute__((always_inline)) void transpose8(const v8 r[8], v8 out[8]) {
    v8 t[8], u[8];
    for (int p = 0; p < 4; p++) {
        t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 2; q++) {
        u[4 * q] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0x44);
        u[4 * q + 1] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0xEE);
        u[4 * q + 2] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0x44);
        u[4 * q + 3] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0xEE);
    }
    for (int m = 0; m < 4; m++) {
        out[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
        out[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
    }
}
/* Keys l0 … l0+7 of a bf16 tile (D a multiple of 16) as pairs: lane j of pairs[p] holds key l0 + j's
 * elements d0 + 2p (low half) and d0 + 2p + 1 (high half) — one load each from a tiled tile (lanes of
 * keys ≥ n then hold what its unused slots hold: no score of theirs is stored), else one 8 x 8
 * transpose of rows per 16 values of d of 8 keys (0 for keys ≥ n), half the shuffles of widening
 * first and transposing the floats. */
#define TILED_KEYS_bf16(D) ((D) % 16 == 0)
static inline __attribute__((always_inline)) void key_pairs8(const uint16_t *kb, int64_t n, int64_t D, int64_t d0,
                                                             int l0, v8 pairs[8], int tiled) {
    if (tiled) {
        for (int p = 0; p < 8; p++) pairs[p] = _mm256_loadu_ps((const float *)(kb + (d0 / 2 + p) * 2 * KEY_TILE + 2 * l0));
        return;
    }
    v8 r[8];
    for (int j = 0; j < 8; j++)
        r[j] = l0 + j < n ? _mm256_loadu_ps((const float *)(kb + (l0 + j) * D + d0)) : v8_zero();
    transpose8(r, pairs);
}
/* SCORE_CHAINS for C ≤ 4 queries straight from a bf16 key tile: the same chains, d in order, over
 * the same widened values, without storing the transposed tile (a one-token step's job). Both halves
 * of the tile advance together, so that 2C chains are in flight, not C: a one-token step's 3 heads
 * per KV head made 3 chains of 4-cycle FMAs wait on each other (AMD EPYC Zen 3). */
static inline __attribute__((always_inline)) void fused_scores_bf16(const uint16_t *kb, int64_t n, int64_t D,
                                                                    const float *qs, const int C,
                                                                    float (*acc)[KEY_TILE], int tiled, float scale) {
    (void)scale;  /* q comes scaled */
    v8 a[4][2];
    for (int i = 0; i < C; i++) a[i][0] = a[i][1] = v8_zero();
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        v8 pairs[2][8];
        key_pairs8(kb, n, D, d0, 0, pairs[0], tiled);
        key_pairs8(kb, n, D, d0, 8, pairs[1], tiled);
        for (int p = 0; p < 8; p++) {
            v8 lo0 = PAIR_LOW8(pairs[0][p]), lo1 = PAIR_LOW8(pairs[1][p]);
            int64_t d = d0 + 2 * p;
            for (int i = 0; i < C; i++) {
                v8 q = v8_splat_reg(qs + i * D + d);
                a[i][0] = v8_fma(q, lo0, a[i][0]), a[i][1] = v8_fma(q, lo1, a[i][1]);
            }
            v8 hi0 = PAIR_HIGH8(pairs[0][p]), hi1 = PAIR_HIGH8(pairs[1][p]);
            for (int i = 0; i < C; i++) {
                v8 q = v8_splat_reg(qs + i * D + d + 1);
                a[i][0] = v8_fma(q, hi0, a[i][0]), a[i][1] = v8_fma(q, hi1, a[i][1]);
            }
        }
    }
    for (int i = 0; i < C; i++) v8_store(acc[i], a[i][0]), v8_store(acc[i] + 8, a[i][1]);
}
/* SCORE_CHAINS for C ≤ QUERY_CHUNK queries straight from a tiled bf16 tile (a verification's or a
 * prefill's chunks): the same chains, d in order, over the same widened values, without the
 * transposed copy each chunk would otherwise read. Each pair of d is read twice from the tile (L1)
 * — shifted up for d, masked with a constant from memory for d + 1 — so that 2C accumulators, two
 * key vectors and a broadcast fit the 16 registers (with the mask held in a register, GCC spilled 5
 * accumulators and every FMA of theirs waited on a store and a load; with it from memory, still 2
 * of 12 within the attention body: tiled_scores6_bf16 below names its registers). */
static const uint32_t HIGH_HALVES[8] __attribute__((aligned(32))) = {
    0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};
static inline __attribute__((always_inline)) v8 pair_low_reg(const uint16_t *p) {
    return PAIR_LOW8(v8_load_reg((const float *)p));
}
static inline __attribute__((always_inline)) v8 pair_high_reg(const uint16_t *p) {
#if defined(__GNUC__) && defined(__x86_64__)
    v8 x;
    __asm__ volatile("vmovups %1, %0\n\tvandps %2, %0, %0"
                     : "=&x"(x) : "m"(*(const float (*)[8])p), "m"(*(const float (*)[8])HIGH_HALVES));
    return x;
#else
    return PAIR_HIGH8(v8_load((const float *)p));
#endif
}
/* `ahead`: a tile to prefetch into L2 (hint T1) as the chains run, one 64-byte line a pair of d — the
 * tile's D / 2 lines —, or NULL. A one-token step's scores fetch the tile 4 on so rather than in a
 * burst of 32 prefetches before each tile's chains: the step 0.98-0.99x as long after 4,096 tokens
 * (two pairs of arms, 21 rounds) and 0.98x after 7,168, the same after 256 (scripts/rows_ab.py; hints
 * T0, T1 and NTA alike), AMD EPYC Zen 3. */
static inline __attribute__((always_inline)) void tiled_scores_bf16(const uint16_t *kb, int64_t D, const float *qs,
                                                                    const int C, float *const *out, const char *ahead) {
    v8 a[QUERY_CHUNK][2];
    for (int i = 0; i < C; i++) a[i][0] = a[i][1] = v8_zero();
    for (int64_t p = 0; p < D / 2; p++) {
        const uint16_t *pair = kb + p * 2 * KEY_TILE;  /* keys 0-7, then 8-15 */
        if (ahead) __builtin_prefetch(ahead + p * 64, 0, 2);
        v8 k0 = pair_low_reg(pair), k1 = pair_low_reg(pair + KEY_TILE);
        for (int i = 0; i < C; i++) {
            v8 q = v8_splat_reg(qs + i * D + 2 * p);
            a[i][0] = v8_fma(q, k0, a[i][0]), a[i][1] = v8_fma(q, k1, a[i][1]);
        }
        k0 = pair_high_reg(pair), k1 = pair_high_reg(pair + KEY_TILE);
        for (int i = 0; i < C; i++) {
            v8 q = v8_splat_reg(qs + i * D + 2 * p + 1);
            a[i][0] = v8_fma(q, k0, a[i][0]), a[i][1] = v8_fma(q, k1, a[i][1]);
        }
    }
    for (int i = 0; i < C; i++) v8_store(out[i], a[i][0]), v8_store(out[i] + 8, a[i][1]);
}
#if defined(__GNUC__) && defined(__x86_64__)
/* tiled_scores_bf16 for 6 queries with its registers named: within the attention body GCC kept two of
 * the 12 accumulators on the stack (each of their FMAs then waited on a store and a load — 220 ns a
 * tile in place of ~130, AMD EPYC Zen 3). The same operations in the same order: per pair of d, the
 * two key vectors shifted up (d), 6 broadcasts and 12 FMAs, then masked (d + 1), again. */
#define PAIR_STEP(WIDEN, off)                                                                        \
    "vmovups (%[pair]), %%ymm12\n\t" "vmovups 32(%[pair]), %%ymm13\n\t" WIDEN                        \
    "vbroadcastss " off "(%[q]), %%ymm14\n\t"                                                        \
    "vfmadd231ps %%ymm12, %%ymm14, %[a0]\n\t" "vfmadd231ps %%ymm13, %%ymm14, %[b0]\n\t"             \
    "vbroadcastss " off "(%[q],%[stride]), %%ymm15\n\t"                                              \
    "vfmadd231ps %%ymm12, %%ymm15, %[a1]\n\t" "vfmadd231ps %%ymm13, %%ymm15, %[b1]\n\t"             \
    "vbroadcastss " off "(%[q],%[stride],2), %%ymm14\n\t"                                            \
    "vfmadd231ps %%ymm12, %%ymm14, %[a2]\n\t" "vfmadd231ps %%ymm13, %%ymm14, %[b2]\n\t"             \
    "vbroadcastss " off "(%[q3]), %%ymm15\n\t"                                                       \
    "vfmadd231ps %%ymm12, %%ymm15, %[a3]\n\t" "vfmadd231ps %%ymm13, %%ymm15, %[b3]\n\t"             \
    "vbroadcastss " off "(%[q3],%[stride]), %%ymm14\n\t"                                             \
    "vfmadd231ps %%ymm12, %%ymm14, %[a4]\n\t" "vfmadd231ps %%ymm13, %%ymm14, %[b4]\n\t"             \
    "vbroadcastss " off "(%[q3],%[stride],2), %%ymm15\n\t"                                           \
    "vfmadd231ps %%ymm12, %%ymm15, %[a5]\n\t" "vfmadd231ps %%ymm13, %%ymm15, %[b5]\n\t"
static inline __attribute__((always_inline)) void tiled_scores6_bf16(const uint16_t *kb, int64_t D, const float *qs,
                                                                     float *const *out) {
    v8 a0 = v8_zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    const int64_t stride = D * (int64_t)sizeof(float);
    for (int64_t p = 0; p < D / 2; p++) {
        const uint16_t *pair = kb + p * 2 * KEY_TILE;
        const float *q = qs + 2 * p, *q3 = q + 3 * D;
        __asm__ volatile(PAIR_STEP("vpslld $16, %%ymm12, %%ymm12\n\t" "vpslld $16, %%ymm13, %%ymm13\n\t", "0")
                         PAIR_STEP("vandps %[high], %%ymm12, %%ymm12\n\t" "vandps %[high], %%ymm13, %%ymm13\n\t", "4")
                         : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
                           [b0] "+x"(b0), [b1] "+x"(b1), [b2] "+x"(b2), [b3] "+x"(b3), [b4] "+x"(b4), [b5] "+x"(b5)
                         : [pair] "r"(pair), [q] "r"(q), [q3] "r"(q3), [stride] "r"(stride),
                           [high] "m"(*(const float (*)[8])HIGH_HALVES)
                         : "xmm12", "xmm13", "xmm14", "xmm15", "memory");  /* reads the pair and the queries */
    }
    v8 a[6][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
    for (int i = 0; i < 6; i++) v8_store(out[i], a[i][0]), v8_store(out[i] + 8, a[i][1]);
}
#else
#define tiled_scores6_bf16(kb, D, qs, out) tiled_scores_bf16(kb, D, qs, 6, out, NULL)
#endif
#define READS_TILES 1
#define FUSES_bf16(D) ((D) % 16 == 0)
/* kt[d][l0 + j] = key l0 + j's element d0 + i for an 8 x 8 block r[j] (key j's elements d0 … d0+7). */
static inline void transpose8_store(v8 r[8], float (*kt)[KEY_TILE], int64_t d0, int l0) {
    v8 out[8];
    transpose8(r, out);
    for (int m = 0; m < 8; m++) v8_store(kt[d0 + m] + l0, out[m]);
}
#define TRANSPOSE_TILE(SUFFIX, T_ELEM, LOAD, kb, n, D, kt, tiled)                                    \
    if (FUSES_##SUFFIX(D))                                                                           \
        for (int64_t d0_ = 0; d0_ < (D); d0_ += 16)                                                  \
            for (int l0_ = 0; l0_ < KEY_TILE; l0_ += 8) {                                            \
                v8 pairs_[8];                                                                        \
                key_pairs8((const uint16_t *)(kb), (n), (D), d0_, l0_, pairs_, (tiled));             \
                for (int p_ = 0; p_ < 8; p_++) {                                                     \
                    v8_store((kt)[d0_ + 2 * p_] + l0_, PAIR_LOW8(pairs_[p_]));                       \
                    v8_store((kt)[d0_ + 2 * p_ + 1] + l0_, PAIR_HIGH8(pairs_[p_]));                  \
                }                                                                                    \
            }                                                                                        \
    else if ((D) % 8)                                                                                \
        for (int64_t d = 0; d < (D); d++)                                                            \
            for (int l = 0; l < KEY_TILE; l++) (kt)[d][l] = l < (n) ? LOAD((kb)[l * (D) + d]) : 0.0f; \
    else                                                                                             \
        for (int64_t d0_ = 0; d0_ < (D); d0_ += 8)                                                   \
            for (int l0_ = 0; l0_ < KEY_TILE; l0_ += 8) {                                            \
                v8 r_[8];                                                                            \
                for (int j_ = 0; j_ < 8; j_++)                                                       \
                    r_[j_] = l0_ + j_ < (n) ? load8_##SUFFIX((kb) + (l0_ + j_) * (D) + d0_) : v8_zero(); \
                transpose8_store(r_, (kt), d0_, l0_);                                                \
            }
/* The largest of row[0 … S-1]; NaNs are passed over, as the scalar `x > top ? x : top` does. */
static inline float ROW_MAX(const float *row, int64_t S) {
    v8 top = _mm256_set1_ps(-INFINITY);
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) top = _mm256_max_ps(v8_load(row + s), top);
    float lanes[8], best = -INFINITY;
    v8_store(lanes, top);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    for (; s < S; s++) best = row[s] > best ? row[s] : best;
    return best;
}
#else
#define QUERY_CHUNK 4
#define FUSES_bf16(D) 0
#define SCORE_CHAINS(kt, qs, D, acc, chunk)                                                                 \
    do {                                                                                             \
        for (int i_ = 0; i_ < QUERY_CHUNK; i_++)                                                     \
            for (int l_ = 0; l_ < KEY_TILE; l_++) (acc)[i_][l_] = 0.0f;                              \
        for (int64_t d = 0; d < (D); d++)                                                            \
            for (int i_ = 0; i_ < QUERY_CHUNK; i_++)                                                 \
                for (int l_ = 0; l_ < KEY_TILE; l_++)                                                \
                    (acc)[i_][l_] = fmaf((qs)[i_ * (D) + d], (kt)[d][l_], (acc)[i_][l_]);                   \
    } while (0)
#define SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, live, out)                                           \
    for (int64_t d = 0; d < (D); d++) (out)[d] = (live) ? LOAD((qr)[d]) * (scale) : 0.0f;
#define TRANSPOSE_TILE(SUFFIX, T_ELEM, LOAD, kb, n, D, kt, tiled)                                    \
    for (int64_t d = 0; d < (D); d++)                                                                \
        for (int l = 0; l < KEY_TILE; l++) (kt)[d][l] = l < (n) ? LOAD((kb)[l * (D) + d]) : 0.0f;
static inline float ROW_MAX(const float *row, int64_t S) {
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) top = row[s] > top ? row[s] : top;
    return top;
}
#endif

#ifndef PAIRS_bf16  /* no pair chains in this build */
#define PAIRS_bf16(D) 0
#define PAIRS_f32(D) 0
#endif
#ifndef PAIR_SCORES  /* every score an fp32 chain (pair_chains: AVX-512 BF16's bf16 scores) */
#define SCORE_CHAINS_bf16(kt, qs, D, acc, chunk, scale) SCORE_CHAINS(kt, qs, D, acc, chunk)
#endif
#define SCORE_CHAINS_f32(kt, qs, D, acc, chunk, scale) SCORE_CHAINS(kt, qs, D, acc, chunk)
/* Whether this build scores bf16 queries and keys of head dim D as pair dot products (pair_chains),
 * not fp32 chains. */
int d3d_pair_scores(int64_t D) { return PAIRS_bf16(D); }
/* row[l] = acc[l] where key s0 + l is visible (its mask byte is 1; causal: l < visible), else
 * -inf, for l < n. */
/* FUSED_SCORES: a chunk of queries straight from a bf16 key tile, one copy per chunk size so that
 * its accumulators stay in registers: at most 4 by the ISA's fused_scores_bf16 (above), or — where
 * the build reads key tiles (READS_TILES: AVX2) and the cache's keys are tiled — any chunk, 5 or 6
 * by tiled_scores_bf16; fp32 tiles are always stored transposed. */
#ifndef READS_TILES
#define READS_TILES 0
#define tiled_scores_bf16(kb, D, qs, C, out, ahead) (void)0
#define tiled_scores6_bf16(kb, D, qs, out) (void)0
#endif
#define FUSES_ANY_CHUNK(tiled) (READS_TILES && (tiled))
/* tiled_scores_bf16 for a chunk of 1 … 6 queries, one copy per size; `out` the chunk's score rows;
 * `ahead` a tile whose lines the chains prefetch as they run (6 queries: all at once first), or NULL */
#define TILED_SCORES_AHEAD(kb, D, qs, chunk, out, ahead)                                             \
    switch (chunk) {                                                                                 \
        case 1: tiled_scores_bf16(kb, D, qs, 1, out, ahead); break;                                  \
        case 2: tiled_scores_bf16(kb, D, qs, 2, out, ahead); break;                                  \
        case 3: tiled_scores_bf16(kb, D, qs, 3, out, ahead); break;                                  \
        case 4: tiled_scores_bf16(kb, D, qs, 4, out, ahead); break;                                  \
        case 5: tiled_scores_bf16(kb, D, qs, 5, out, ahead); break;                                  \
        default:                                                                                     \
            if (ahead) PREFETCH_TILE(uint16_t, ahead);                                               \
            tiled_scores6_bf16(kb, D, qs, out);                                                      \
    }
#define TILED_SCORES(kb, D, qs, chunk, out) TILED_SCORES_AHEAD(kb, D, qs, chunk, out, (const char *)NULL)
#if defined(__AVX512F__) || defined(D3D_AVX2)
#define FUSED_SCORES_bf16(kb, n, D, qs, chunk, acc, tiled, scale)                                    \
    switch (chunk) {                                                                                 \
        case 1: fused_scores_bf16(kb, n, D, qs, 1, acc, tiled, scale); break;                        \
        case 2: fused_scores_bf16(kb, n, D, qs, 2, acc, tiled, scale); break;                        \
        case 3: fused_scores_bf16(kb, n, D, qs, 3, acc, tiled, scale); break;                        \
        case 4: fused_scores_bf16(kb, n, D, qs, 4, acc, tiled, scale); break;                        \
        default: {                                                                                   \
            float *rows_[6] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5]};                      \
            TILED_SCORES(kb, D, qs, chunk, rows_)                                                    \
        }                                                                                            \
    }
#else
#define FUSED_SCORES_bf16(kb, n, D, qs, chunk, acc, tiled, scale)
#endif
#define FUSES_f32(D) 0
#define FUSED_SCORES_f32(kb, n, D, qs, chunk, acc, tiled, scale)
#ifndef TILE_PAIRS_bf16
#define TILE_PAIRS_bf16(D, tiled) 0
#define FUSED_TILES2_bf16(kb, D, qs, C, acc, acc2, scale, ahead)
#define PAIR_CHAINS2_bf16(kb, D, qs, C, acc, acc2, scale)
#endif
#define TILE_PAIRS_f32(D, tiled) 0
#define FUSED_TILES2_f32(kb, D, qs, C, acc, acc2, scale, ahead)
#define PAIR_CHAINS2_f32(kb, D, qs, C, acc, acc2, scale)
#ifndef TILED_KEYS_bf16
#define TILED_KEYS_bf16(D) 0
#endif
#define TILED_KEYS_f32(D) 0
/* Whether this build reads keys of head_dim D tiled (the header): calls pass k_tiled only where it does. */
int d3d_tiled_keys(int bf16, int64_t D) { return bf16 ? TILED_KEYS_bf16(D) : TILED_KEYS_f32(D); }
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
    if (!mrow && n == KEY_TILE && visible >= KEY_TILE) {  /* a whole tile, every key seen */
        memcpy(row, acc, KEY_TILE * sizeof(float));
        return;
    }
    for (int l = 0; l < n; l++) row[l] = (mrow ? mrow[l] != 0 : l < visible) ? acc[l] : -INFINITY;
}
#endif

/* Keys past a query's last visible one change no bit of its output: their scores are -inf, their
 * exp 0 (a lane sum plus +0 is itself; the weighted sum skips p = 0 or adds it, P_ZERO). So a
 * query's pass stops at `visible_end` (S - T + t + 1 when causal, else one past the last 1 byte of
 * its mask row), and a key tile no query of a chunk sees is neither transposed nor scored for it: a
 * causal call over T new tokens costs about half its T x S square, and a one-token step the keys it
 * sees. */
static inline int64_t visible_end(const uint8_t *mrow, int64_t S, int64_t T, int64_t t) {
    if (!mrow) return S - T + t + 1;
    int64_t end = S;
    while (end > 0 && !mrow[end - 1]) end--;
    return end;
}
static inline int tile_unseen(const uint8_t *mrow, int64_t n) {
    for (int64_t l = 0; l < n; l++)
        if (mrow[l]) return 0;
    return 1;
}

/* Queries go in blocks of QUERY_BLOCK: a block's scores (QUERY_BLOCK x H x S floats) are written,
 * exponentiated and read back while they are still in cache, and the scratch holds one block. */
#define QUERY_BLOCK 32

/* Attention on AMX tiles (attention_amx.h), for bf16 where amx_attention_fits: the bodies below hand
 * their calls to it. */
#ifdef D3D_AMX
#define AMX_MAX_DIM 256  /* head dims up to this, multiples of 32 */
#define AMX_MAX_GROUP 16  /* query heads per KV head, up to this */
static int amx_attention_fits(int64_t D, int64_t group);
static int64_t amx_plan_floats(int64_t nt, int64_t H, int64_t Hkv, int64_t S);
static void amx_attention_blocks(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask,
                                 uint16_t *out, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D,
                                 int64_t kv_batch, int64_t kv_head, int64_t v_row, int64_t v_part, float scale,
                                 float *scratch);
#define ON_TILES_bf16(D, group) amx_attention_fits(D, group)
#define TILES_BLOCKS_bf16(...) amx_attention_blocks(__VA_ARGS__)
#define TILES_SEGMENTS_bf16(...) amx_attention_segments(__VA_ARGS__)
#else
#define ON_TILES_bf16(D, group) 0
#define TILES_BLOCKS_bf16(...) (void)0
#define TILES_SEGMENTS_bf16(...) (void)0
#endif
#define ON_TILES_f32(D, group) 0
#define TILES_BLOCKS_f32(...) (void)0
#define TILES_SEGMENTS_f32(...) (void)0

/* Floats from one query head's row of scores to the next: S rounded up to whole cache lines, an odd
 * number of them, so that the rows of a block (S a multiple of 512 floats after a prompt's 512-row
 * chunks) do not fall in one or two sets of the L1 cache, which their 16-key stores go to together. */
static inline int64_t score_stride(int64_t S) { return ((S + 15) / 16 | 1) * 16; }

/* Scratch floats for B x T queries over S keys (either path's, for both element types). */
int64_t d3d_attention_scratch(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D) {
    int64_t chains = B * (T < QUERY_BLOCK ? T : QUERY_BLOCK) * H * (score_stride(S) + 1);
#ifdef D3D_AMX
    if (amx_attention_fits(D, H / Hkv)) {
        int64_t tiles = B * amx_plan_floats(T < QUERY_BLOCK ? T : QUERY_BLOCK, H, Hkv, S);
        return tiles > chains ? tiles : chains;
    }
#endif
    (void)Hkv, (void)D;
    return chains;
}

#define ATTENTION(NAME, SUFFIX, T_ELEM, LOAD, STORE)                                                         \
static void NAME##_body(const T_ELEM *q, const T_ELEM *k, const T_ELEM *v, const uint8_t *mask,      \
                        T_ELEM *out, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t S,        \
                        int64_t D, int64_t kv_batch, int64_t kv_head, int64_t v_row, int64_t v_part, \
                        int64_t k_tiled, float scale, float *scores) {                               \
    int64_t group = H / Hkv, threads = omp_get_num_threads(), me = omp_get_thread_num();             \
    if (ON_TILES_##SUFFIX(D, group)) {                                                               \
        TILES_BLOCKS_##SUFFIX(q, k, v, mask, out, B, T, H, Hkv, S, D, kv_batch, kv_head, v_row, v_part, scale, scores); \
        return;                                                                                      \
    }                                                                                                \
    SCORE_JOB_STATE(T_ELEM)                                                                          \
    int64_t rows = T < QUERY_BLOCK ? T : QUERY_BLOCK;  /* scratch rows per batch row */              \
    const int64_t stride_ = score_stride(S);                                                         \
    float *totals = scores + B * rows * H * stride_;  /* each query's softmax denominator */         \
    for (int64_t t0 = 0; t0 < T; t0 += QUERY_BLOCK) {                                                \
        int64_t t1 = T - t0 < QUERY_BLOCK ? T : t0 + QUERY_BLOCK, nt = t1 - t0;                       \
        /* the keys this block sees: causally up to S - T + t1 - 1, with a mask any */               \
        int64_t keys = mask ? S : S - T + t1, tiles = (keys + KEY_TILE - 1) / KEY_TILE;              \
        int64_t jobs = B * Hkv * tiles;                                                              \
        ATTENTION_PASSES(SUFFIX, T_ELEM, LOAD, STORE)                                                \
    }                                                                                                \
}                                                                                                    \
void NAME(const T_ELEM *q, const T_ELEM *k, const T_ELEM *v, const uint8_t *mask, T_ELEM *out,       \
          int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D,                        \
          int64_t kv_batch, int64_t kv_head, int64_t v_row, int64_t v_part, int64_t k_tiled, float scale, \
          float *scores, int threads) {                                                              \
    _Pragma("omp parallel num_threads(threads)")                                                     \
    NAME##_body(q, k, v, mask, out, B, T, H, Hkv, S, D, kv_batch, kv_head, v_row, v_part, k_tiled, scale, scores); \
}

/* One job of each pass, over the variables of the body that runs it (see ATTENTION_PASSES). A score
 * job prefetches the key tile of this thread's job TILES_AHEAD on: its jobs go job_step_ apart, up to
 * job_end_. */
/* A thread's scaled queries (rows of D floats), kept across its jobs: the group's queries of the whole
 * block where they fit (a k-row verification's tiles each serve all of them), from qs_of on, qs_count
 * of them; else the chunk of QUERY_CHUNK queries from qs_of on (qs_count = -chunk). */
/* A key tile's KEY_TILE x D elements (rows or tiled alike: the same bytes) into L2 (hint T1). */
#define PREFETCH_TILE(T_ELEM, tile)                                                                  \
    for (int64_t at_ = 0; at_ < KEY_TILE * D * (int64_t)sizeof(T_ELEM); at_ += 64)                   \
        __builtin_prefetch((const char *)(tile) + at_, 0, 2);
#define QS_FLOATS 32768
#define SCORE_JOB_STATE(T_ELEM)                                                                      \
    float qs_kept[QS_FLOATS];                                                                        \
    const T_ELEM *qs_of = NULL;                                                                      \
    int64_t qs_count = 0;
/* whether the block's `all` queries of a group fit qs_kept (+ 16: SCALE_QUERY writes whole vectors),
 * and qs_kept made to hold them — rows t0 … t1-1 of batch row b, KV head g's heads, scaled, then
 * QUERY_CHUNK of zeros — unless it already does */
#define KEEPS_BLOCK(all) (((all) + QUERY_CHUNK) * D + 16 <= QS_FLOATS)
#define KEEP_BLOCK_QUERIES(SUFFIX, T_ELEM, LOAD, b, g, all)                                                  \
    {                                                                                                \
        const T_ELEM *q0_ = q + (((b) * T + t0) * H + (g) * group) * D;                              \
        if (q0_ != qs_of || (all) != qs_count) {                                                     \
            for (int64_t i_ = 0; i_ < (all) + QUERY_CHUNK; i_++) {                                   \
                int64_t t_ = t0 + i_ / group, h_ = (g) * group + i_ % group;                         \
                const T_ELEM *qr = i_ < (all) ? q + (((b) * T + t_) * H + h_) * D : q;  /* past: zeros */ \
                SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, i_ < (all), qs_kept + i_ * D);               \
            }                                                                                        \
            qs_of = q0_, qs_count = (all);                                                           \
        }                                                                                            \
    }
#define ATTENTION_SCORE_JOB(SUFFIX, T_ELEM, LOAD)                                                    \
    {                                                                                                \
        int64_t b = job / (Hkv * tiles), g = (job / tiles) % Hkv, s0 = (job % tiles) * KEY_TILE;     \
        int64_t n = S - s0 < KEY_TILE ? S - s0 : KEY_TILE;                                           \
        if (job + TILES_AHEAD * job_step_ < job_end_) {                                              \
            int64_t next = job + TILES_AHEAD * job_step_, nb = next / (Hkv * tiles), ng = (next / tiles) % Hkv; \
            PREFETCH_TILE(T_ELEM, k + nb * kv_batch + ng * kv_head + (next % tiles) * KEY_TILE * D); \
        }                                                                                            \
        /* causal: query t sees the tile from t = s0 - (S - T) on */                                 \
        int64_t first_t = mask || s0 - (S - T) <= t0 ? t0 : s0 - (S - T);                           \
        const T_ELEM *kb = k + b * kv_batch + g * kv_head + s0 * D;                                  \
        float kt[MAX_HEAD_DIM][KEY_TILE];                                                            \
        int transposed = 0;                                                                          \
        /* a tiled tile is the pair chains' operand as it is (TILED_KEYS_bf16 on AVX-512) */          \
        int direct = PAIRS_##SUFFIX(D) && k_tiled;                                                   \
        const float (*kts)[KEY_TILE] = direct ? (const float (*)[KEY_TILE])(const void *)kb : (const float (*)[KEY_TILE])kt; \
        /* one chunk of at most 4 queries (a one-token step's job), or any chunks of a tiled cache    \
         * where the build reads tiles, read the tile without storing it transposed */                \
        int fused = FUSES_##SUFFIX(D) && ((t1 - first_t) * group <= 4 || FUSES_ANY_CHUNK(k_tiled));  \
        /* the group's queries (t, h), QUERY_CHUNK at a time: their chains interleave, each unchanged */ \
        int64_t tq_ = first_t, jq_ = 0;  /* query i0's t and place in the group, carried (no division) */ \
        for (int64_t i0 = first_t * group; i0 < t1 * group; i0 += QUERY_CHUNK) {                    \
            float acc[QUERY_CHUNK][KEY_TILE];                                                        \
            int chunk = t1 * group - i0 < QUERY_CHUNK ? (int)(t1 * group - i0) : QUERY_CHUNK;        \
            int64_t ts_[QUERY_CHUNK], hs_[QUERY_CHUNK];  /* query i0 + i is (ts_[i], hs_[i]) */        \
            for (int i = 0; i < QUERY_CHUNK; i++) {                                                  \
                ts_[i] = tq_, hs_[i] = g * group + jq_;                                              \
                if (++jq_ == group) jq_ = 0, tq_++;                                                  \
            }                                                                                        \
            int seen = !mask;                                                                        \
            for (int i = 0; i < chunk && !seen; i++)                                                 \
                seen = !tile_unseen(mask + (b * T + ts_[i]) * S + s0, n);                            \
            if (!seen) {  /* masked rows still read this tile's -inf: it may lie before their end */ \
                for (int i = 0; i < chunk; i++) {                                                    \
                    float *row = ROW(b, ts_[i], hs_[i]) + s0;                                        \
                    for (int64_t l = 0; l < n; l++) row[l] = -INFINITY;                              \
                }                                                                                    \
                continue;                                                                            \
            }                                                                                        \
            if (!transposed && !fused && !direct) {                                                  \
                TRANSPOSE_TILE(SUFFIX, T_ELEM, LOAD, kb, n, D, kt, k_tiled);                         \
                transposed = 1;                                                                      \
            }                                                                                        \
            /* the scaled queries are kept across the thread's jobs: the block's (b, g) ones where    \
             * they fit, else the last chunk's */                                                    \
            const float *qs;                                                                         \
            int64_t all = (t1 - t0) * group;                                                         \
            if (KEEPS_BLOCK(all)) {                                                                  \
                KEEP_BLOCK_QUERIES(SUFFIX, T_ELEM, LOAD, b, g, all)                                          \
                qs = qs_kept + (i0 - t0 * group) * D;                                                \
            } else {                                                                                 \
                const T_ELEM *q0 = q + ((b * T + i0 / group) * H + g * group + i0 % group) * D;      \
                if (q0 != qs_of || -chunk != qs_count) {                                             \
                    for (int i = 0; i < QUERY_CHUNK; i++) {                                          \
                        int64_t t = (i0 + i) / group, h = g * group + (i0 + i) % group;              \
                        const T_ELEM *qr = i < chunk ? q + ((b * T + t) * H + h) * D : q;  /* past: zeros */ \
                        SCALE_QUERY(SUFFIX, LOAD, qr, D, scale, i < chunk, qs_kept + i * D);         \
                    }                                                                                \
                    qs_of = q0, qs_count = -chunk;                                                   \
                }                                                                                    \
                qs = qs_kept;                                                                        \
            }                                                                                        \
            if (fused) {                                                                             \
                FUSED_SCORES_##SUFFIX(kb, n, D, qs, chunk, acc, k_tiled, scale)                      \
            } else {                                                                                 \
                SCORE_CHAINS_##SUFFIX(kts, qs, D, acc, chunk, scale);                                \
            }                                                                                        \
            for (int i = 0; i < chunk; i++) {                                                        \
                const uint8_t *mrow = mask ? mask + (b * T + ts_[i]) * S + s0 : NULL;                \
                STORE_SCORES(ROW(b, ts_[i], hs_[i]) + s0, mrow, S - T + ts_[i] + 1 - s0, n, acc[i]); \
            }                                                                                        \
        }                                                                                            \
    }

#define ATTENTION_EXP_ITEM(SUFFIX)                                                                   \
    {                                                                                                \
        int64_t b = item / (nt * H), t = t0 + (item / H) % nt, h = item % H;                         \
        float *row = ROW(b, t, h);                                                                   \
        int64_t end = visible_end(mask ? mask + (b * T + t) * S : NULL, S, T, t);                    \
        float top = ROW_MAX(row, end);                                                               \
        float sums[LANES] = {0};                                                                     \
        if (PAIR_SUMS_##SUFFIX(D, group)) { EXP_SUM_PAIRS(row, end, top, sums); }                    \
        else { EXP_SUM(row, end, top, sums); }                                                       \
        totals[(b * rows + t - t0) * H + h] = fold_lanes(sums);                                      \
    }

/* A sum item: (batch row, a range of the block's queries, KV head, PART_DIMS values of d). Where the
 * ISA has WEIGHTED_SUM_RANGE, the range is every query of the block (unless the items would then be
 * fewer than the threads) and its keys go in spans of KEY_SPAN: each span's V rows are read from
 * memory once and from L1 by every batch of the range's heads (≤ SUM_HEADS at a time) — a k-row
 * verification over a long context streams V once, not k / SUM_QUERIES times — each head's chain
 * carried from span to span, unchanged. Elsewhere each query's heads go alone. */
#define KEY_SPAN 256  /* keys per span: 16 KB of one bf16 V slice */
static inline int64_t sum_split(int64_t items, int64_t batches, int64_t threads) {
    int64_t split = (threads + items - 1) / items;
    return split < batches ? split : batches;
}
#define ATTENTION_SUM_ITEM(SUFFIX, T_ELEM, LOAD, STORE)                                              \
    {                                                                                                \
        int64_t per = SUM_QUERIES(group), batches = (nt + per - 1) / per, split = SUM_SPLIT(B, nt);   \
        int64_t bq = item / (Hkv * parts), g = (item / parts) % Hkv, d0 = (item % parts) * PART_DIMS; \
        int64_t b = bq / split, r = bq % split;                                                      \
        int64_t tb = t0 + r * batches / split * per, te = t0 + (r + 1) * batches / split * per;      \
        te = te < t1 ? te : t1;                                                                      \
        int64_t dn = D - d0 < PART_DIMS ? D - d0 : PART_DIMS;                                        \
        const T_ELEM *vb = v + b * kv_batch + g * kv_head + d0 / V_PART * v_part;  /* slice d0 … */ \
        if (SUM_TOGETHER(group) && RANGED_##SUFFIX(dn)) {                                            \
            const float *rows_[QUERY_BLOCK * SUM_HEADS];                                             \
            int64_t ends_[QUERY_BLOCK * SUM_HEADS], at_[QUERY_BLOCK * SUM_HEADS], last_ = 0;  /* at_: (b * T + t) * H + h */ \
            int n_ = 0, heads_ = (int)(per * group);  /* heads summed together */                   \
            int pairs_ = PAIR_SUMS_##SUFFIX(D, group);                                               \
            for (int64_t t = tb; t < te; t++) {                                                      \
                int64_t end = visible_end(mask ? mask + (b * T + t) * S : NULL, S, T, t);            \
                last_ = end > last_ ? end : last_;                                                   \
                for (int64_t h = g * group; h < (g + 1) * group; h++, n_++)                          \
                    rows_[n_] = ROW(b, t, h), ends_[n_] = end, at_[n_] = (b * T + t) * H + h;        \
            }                                                                                        \
            float acc_[2 * QUERY_BLOCK * SUM_HEADS][16];                                             \
            memset(acc_, 0, sizeof(float) * 2 * 16 * n_);                                            \
            for (int64_t s0 = 0; s0 < last_; s0 += KEY_SPAN) {                                       \
                int64_t s1 = s0 + KEY_SPAN < last_ ? s0 + KEY_SPAN : last_;                          \
                for (int i0 = 0; i0 < n_; i0 += heads_) {                                            \
                    int nh = n_ - i0 < heads_ ? n_ - i0 : heads_;                                    \
                    if (pairs_) {                                                                    \
                        WEIGHTED_PAIR_RANGE(rows_ + i0, ends_ + i0, nh, (const uint16_t *)vb, v_row, dn, s0, s1, acc_ + 2 * i0); \
                    } else {                                                                         \
                        WEIGHTED_SUM_RANGE_##SUFFIX(rows_ + i0, ends_ + i0, nh, vb, v_row, 0, dn, s0, s1, acc_ + 2 * i0); \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            for (int i = 0; i < n_; i++) {                                                          \
                int64_t t = at_[i] / H % T, h = at_[i] % H;                                          \
                float total = totals[(b * rows + t - t0) * H + h], inv = total > 0.0f ? 1.0f / total : 0.0f; \
                float o[PART_DIMS];                                                                  \
                if (pairs_) sum_values_pairs((const float (*)[16])acc_[2 * i], o);                   \
                else sum_values_##SUFFIX((const float (*)[16])acc_[2 * i], o);                       \
                T_ELEM *outr = out + at_[i] * D + d0;                                                \
                for (int64_t d = 0; d < dn; d++) outr[d] = STORE(o[d] * inv);                        \
            }                                                                                        \
        } else                                                                                       \
            for (int64_t t = tb; t < te; t++) {                                                      \
                int64_t end = visible_end(mask ? mask + (b * T + t) * S : NULL, S, T, t);            \
                for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += 4) {                        \
                    int nh = (g + 1) * group - h0 < 4 ? (int)((g + 1) * group - h0) : 4;             \
                    float o[4][PART_DIMS];                                                           \
                    WEIGHTED_SUM_##SUFFIX(ROW(b, t, h0), stride_, nh, vb, end, v_row, 0, dn, o);     \
                    for (int i = 0; i < nh; i++) {                                                   \
                        float total = totals[(b * rows + t - t0) * H + h0 + i], inv = total > 0.0f ? 1.0f / total : 0.0f; \
                        T_ELEM *outr = out + ((b * T + t) * H + h0 + i) * D + d0;                    \
                        for (int64_t d = 0; d < dn; d++) outr[d] = STORE(o[i][d] * inv);             \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
    }
/* query ranges per (batch row, KV head, part): one where heads sum together (see above), else one
 * per batch of SUM_QUERIES queries; and the sum items of a block of nt queries */
#define SUM_SPLIT(B, nt) (SUM_TOGETHER(group) ? sum_split((B) * Hkv * parts, ((nt) + SUM_QUERIES(group) - 1) / SUM_QUERIES(group), threads) \
                                               : ((nt) + SUM_QUERIES(group) - 1) / SUM_QUERIES(group))
#define SUM_ITEMS(B, nt) ((B) * SUM_SPLIT(B, nt) * Hkv * parts)

/* the scratch row of query (b, t, h), t in the block t0 … t1-1 */
#define ROW(b, t, h) (scores + (((b) * rows + (t) - t0) * H + (h)) * stride_)
#define ATTENTION_PASSES(SUFFIX, T_ELEM, LOAD, STORE)                                                \
    /* 1. scores. Over a tiled cache, each thread's span of the block's tiles as one run (AVX2:      \
     * ATTENTION_TILE_RUN, a prefill chunk's scores after 3,584 tokens 0.89 -> 0.41 s, AMD EPYC Zen 3; \
     * AVX-512 BF16: ATTENTION_PAIR_RUN, whole tiles two at a time, a 512-row chunk after 3,584      \
     * tokens 0.83-0.85x as long, Zen 4); else jobs go round-robin (causal tiles late in S serve     \
     * fewer queries), and each thread prefetches the key tile of its job TILES_AHEAD on (a long     \
     * context streams K from memory). */                                                            \
    PASS_CLOCK                                                                                       \
    if (TILE_RUN_FITS(SUFFIX)) {                                                                     \
        int64_t first_ = me;                                                                         \
        ATTENTION_TILE_RUN(SUFFIX, T_ELEM, LOAD, SPAN_FIRST(jobs), SPAN_END(jobs))                   \
    } else if (PAIR_RUN_FITS(SUFFIX)) {                                                              \
        int64_t first_ = me;                                                                         \
        ATTENTION_PAIR_RUN(SUFFIX, T_ELEM, LOAD, SPAN_FIRST(jobs), SPAN_END(jobs))                   \
    } else                                                                                           \
    for (int64_t job = me, job_step_ = threads, job_end_ = jobs; job < jobs; job += threads)         \
        ATTENTION_SCORE_JOB(SUFFIX, T_ELEM, LOAD)                                                    \
    _Pragma("omp barrier")                                                                           \
    PASS_DONE(PASS_SCORES);                                                                          \
    /* 2. per query: max, exp and the sum of the exps, up to its last visible key */                 \
    for (int64_t item = me; item < B * nt * H; item += threads) ATTENTION_EXP_ITEM(SUFFIX)           \
    _Pragma("omp barrier")                                                                           \
    PASS_DONE(PASS_SOFTMAX);                                                                         \
    /* 3. the weighted sums of V, per (query, KV head, PART_DIMS values of d), its heads together */ \
    int64_t parts = (D + PART_DIMS - 1) / PART_DIMS;                                                 \
    for (int64_t item = me; item < SUM_ITEMS(B, nt); item += threads) ATTENTION_SUM_ITEM(SUFFIX, T_ELEM, LOAD, STORE)\
    _Pragma("omp barrier")                                                                           \
    PASS_DONE(PASS_SUMS);

/* The sequences of one batched forward (rowexact.c's d3d_forward), each after its own KV cache:
 * `rows` new queries at slots start … start+rows-1, keys/values of layer l at
 * k_cache/v_cache + l*kv_layer (k element (g, s, d) at g*kv_head + s*D + d, or tiled with k_tiled;
 * v as above with v_row and v_part), `mask` (rows, start+rows) or NULL for causal. */
typedef struct {
    int64_t rows, start;
    void *k_cache, *v_cache;
    int64_t kv_layer, kv_head, v_row, v_part, k_tiled;
    const uint8_t *mask;
} d3d_segment;
#ifdef D3D_AMX
static void amx_attention_segments(const uint16_t *q_all, uint16_t *out_all, const d3d_segment *segments,
                                   int64_t n_segments, int64_t layer, int64_t H, int64_t Hkv, int64_t D, float scale,
                                   float *scratch);
#endif

/* Segments of at most QUERY_BLOCK rows (decoding steps, verifications) run the three passes
 * together: each pass deals the jobs of every such segment round-robin over the threads, then one
 * barrier — instead of a call with three barriers per segment (a forward of 16 one-token sequences:
 * 23 ms against 15 for one 17-row sequence before). A job is the same code over the same data as in
 * a call of its own, so the same bits. Longer segments (a prompt's pieces) run one call each.
 * Scratch: d3d_segments_scratch floats. */
int64_t d3d_segments_scratch(const d3d_segment *g, int64_t n, int64_t H, int64_t Hkv, int64_t D) {
    int64_t together = 0, alone = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t size = d3d_attention_scratch(1, g[i].rows, H, Hkv, g[i].start + g[i].rows, D);
        if (g[i].rows <= QUERY_BLOCK) together += size;
        else if (size > alone) alone = size;
    }
    return together > alone ? together : alone;
}

/* A one-token step's scores (causal, B = T = 1, the group's ≤ 4 heads one chunk, every key seen):
 * a thread's span of jobs as one run over its tiles — the chains of ATTENTION_SCORE_JOB's fused
 * path, stored as it stores them, without its per-tile bookkeeping (divisions, query chunks, masks). */
#define SCORE_RUN_FITS(SUFFIX) (FUSES_##SUFFIX(D) && !mask && T == 1 && group <= 4)
#define ATTENTION_SCORE_RUN(SUFFIX, T_ELEM, LOAD, first, end)                                        \
    {                                                                                                \
        int64_t g_ = (first) / tiles, s0_ = ((first) % tiles) * KEY_TILE, qs_g_ = -1;                \
        for (int64_t job_ = (first); job_ < (end); job_++, s0_ += KEY_TILE) {                        \
            if (s0_ >= S) g_++, s0_ = 0;                                                             \
            if (g_ != qs_g_) {                                                                       \
                for (int64_t i = 0; i < group; i++)                                                  \
                    SCALE_QUERY(SUFFIX, LOAD, q + (g_ * group + i) * D, D, scale, 1, qs_kept + i * D); \
                qs_g_ = g_;                                                                          \
            }                                                                                        \
            const T_ELEM *next_ = NULL;  /* the tile TILES_AHEAD jobs on, fetched meanwhile */         \
            if (job_ + TILES_AHEAD < (end)) {                                                        \
                int64_t ahead_ = s0_ + TILES_AHEAD * KEY_TILE;                                       \
                next_ = ahead_ < S ? k + g_ * kv_head + ahead_ * D                                   \
                    : k + ((job_ + TILES_AHEAD) / tiles) * kv_head + ((job_ + TILES_AHEAD) % tiles) * KEY_TILE * D; \
            }                                                                                        \
            int64_t n = S - s0_ < KEY_TILE ? S - s0_ : KEY_TILE;                                     \
            if (FUSES_ANY_CHUNK(k_tiled) && n == KEY_TILE) {  /* a whole tiled tile: into the rows */  \
                float *rows_[QUERY_CHUNK];                                                           \
                for (int64_t i = 0; i < group; i++) rows_[i] = ROW(0, 0, g_ * group + i) + s0_;       \
                TILED_SCORES_AHEAD((const uint16_t *)(k + g_ * kv_head + s0_ * D), D, qs_kept, (int)group, rows_, \
                                   (const char *)next_)                                              \
                continue;                                                                            \
            }                                                                                        \
            if (TILE_PAIRS_##SUFFIX(D, k_tiled) && s0_ + 2 * KEY_TILE <= S && job_ + 1 < (end)) {      \
                /* this tile and the next, both whole, of this head: two at a time */                 \
                float acc[4][KEY_TILE], acc2[4][KEY_TILE];                                           \
                FUSED_TILES2_##SUFFIX((const uint16_t *)(k + g_ * kv_head + s0_ * D), D, qs_kept, (int)group, \
                                      acc, acc2, scale, (const char *)next_)                         \
                for (int64_t i = 0; i < group; i++) {                                                \
                    float *row_ = ROW(0, 0, g_ * group + i) + s0_;                                   \
                    STORE_SCORES(row_, NULL, S - s0_, KEY_TILE, acc[i]);                             \
                    STORE_SCORES(row_ + KEY_TILE, NULL, S - s0_ - KEY_TILE, KEY_TILE, acc2[i]);      \
                }                                                                                    \
                job_++, s0_ += KEY_TILE;                                                             \
                continue;                                                                            \
            }                                                                                        \
            if (next_) PREFETCH_TILE(T_ELEM, next_);                                                 \
            float acc[QUERY_CHUNK][KEY_TILE];                                                        \
            FUSED_SCORES_##SUFFIX(k + g_ * kv_head + s0_ * D, n, D, qs_kept, (int)group, acc, k_tiled, scale) \
            for (int64_t i = 0; i < group; i++)                                                      \
                STORE_SCORES(ROW(0, 0, g_ * group + i) + s0_, NULL, S - s0_, n, acc[i]);             \
        }                                                                                            \
        qs_of = NULL;  /* qs_kept now holds this run's queries */                                    \
    }

/* Scores of a block of rows t0 … t1-1 (a few rows' whole call, or one QUERY_BLOCK of a prefill's)
 * over a tiled cache where the build reads tiles (causal, B = 1, T > 1: a one-token step's run above
 * scores its tiles the same way with less bookkeeping a tile — through here it took 1.04-1.06x as
 * long after 4K tokens, AMD EPYC Zen 3; the group's queries of every row kept scaled): a thread's
 * span of jobs
 * as one run, each chunk of QUERY_CHUNK queries scored straight from the tile into the queries' rows;
 * a tile that the block's first query sees only in part (the last one or two) goes through
 * ATTENTION_SCORE_JOB. The same chains. */
#define TILE_RUN_FITS(SUFFIX) (FUSES_ANY_CHUNK(k_tiled) && FUSES_##SUFFIX(D) && !mask && T > 1 && B == 1 && KEEPS_BLOCK(nt * group))
#define ATTENTION_TILE_RUN(SUFFIX, T_ELEM, LOAD, first, end)                                         \
    for (int64_t job = (first), job_step_ = 1, job_end_ = (end), g_ = job / tiles, s0_ = job % tiles * KEY_TILE, \
                 all_ = nt * group; job < job_end_; job++, s0_ += KEY_TILE) {                        \
        if (s0_ >= tiles * KEY_TILE) g_++, s0_ = 0;                                                  \
        if (s0_ + KEY_TILE > S - T + t0 + 1) {  /* a tile the block's first query sees only in part */ \
            ATTENTION_SCORE_JOB(SUFFIX, T_ELEM, LOAD)                                                \
            continue;                                                                                \
        }                                                                                            \
        if (job + TILES_AHEAD < job_end_) {  /* divisions only where the tile ahead is another head's */ \
            int64_t ahead_ = s0_ + TILES_AHEAD * KEY_TILE;                                           \
            PREFETCH_TILE(T_ELEM, ahead_ < tiles * KEY_TILE ? k + g_ * kv_head + ahead_ * D          \
                : k + ((job + TILES_AHEAD) / tiles) * kv_head + ((job + TILES_AHEAD) % tiles) * KEY_TILE * D); \
        }                                                                                            \
        KEEP_BLOCK_QUERIES(SUFFIX, T_ELEM, LOAD, 0, g_, all_)                                                \
        for (int64_t i0 = 0, t_ = t0, j_ = 0; i0 < all_; i0 += QUERY_CHUNK) {                        \
            int chunk = all_ - i0 < QUERY_CHUNK ? (int)(all_ - i0) : QUERY_CHUNK;                    \
            float *rows_[QUERY_CHUNK];                                                               \
            for (int i = 0; i < chunk; i++) {  /* query i0 + i is (t_, head g_ · group + j_) */       \
                rows_[i] = ROW(0, t_, g_ * group + j_) + s0_;                                        \
                if (++j_ == group) j_ = 0, t_++;                                                     \
            }                                                                                        \
            TILED_SCORES((const uint16_t *)(k + g_ * kv_head + s0_ * D), D, qs_kept + i0 * D, chunk, rows_) \
        }                                                                                            \
    }

/* Scores of a few rows' call, or of a query block t0 … t1-1 of a longer one (causal, B = 1, T > 1), over
 * a tiled cache where the build scores whole tiles two at a time (TILE_PAIRS): a thread's span of jobs in
 * order, each tile that every query of the block sees whole taken with the next such tile of its head — each chunk of QUERY_CHUNK
 * queries' chains over both at once (pair_chains2, fused_tiles2_bf16), each chain as ATTENTION_SCORE_JOB
 * runs it — and any other tile (the last ones, which the first rows see in part) through
 * ATTENTION_SCORE_JOB. The same bits. */
#define PAIR_RUN_FITS(SUFFIX) (TILE_PAIRS_##SUFFIX(D, k_tiled) && !mask && T > 1 && B == 1 && KEEPS_BLOCK(nt * group))
#define ATTENTION_PAIR_RUN(SUFFIX, T_ELEM, LOAD, first, end)                                         \
    for (int64_t job = (first), job_step_ = 1, job_end_ = (end); job < job_end_; job++) {           \
        int64_t g_ = job / tiles, s0_ = job % tiles * KEY_TILE, all_ = nt * group;                   \
        if (job + 1 >= job_end_ || s0_ + 2 * KEY_TILE > S - T + t0 + 1) {                            \
            ATTENTION_SCORE_JOB(SUFFIX, T_ELEM, LOAD)                                                \
            continue;                                                                                \
        }                                                                                            \
        for (int64_t n_ = job + TILES_AHEAD; n_ < job + TILES_AHEAD + 2 && n_ < job_end_; n_++)      \
            PREFETCH_TILE(T_ELEM, k + (n_ / tiles) * kv_head + (n_ % tiles) * KEY_TILE * D);         \
        KEEP_BLOCK_QUERIES(SUFFIX, T_ELEM, LOAD, 0, g_, all_)                                        \
        const uint16_t *kb_ = (const uint16_t *)(k + g_ * kv_head + s0_ * D);                        \
        for (int64_t i0 = 0, t_ = t0, j_ = 0; i0 < all_; i0 += QUERY_CHUNK) {                        \
            int chunk = all_ - i0 < QUERY_CHUNK ? (int)(all_ - i0) : QUERY_CHUNK;                    \
            float acc_[QUERY_CHUNK][KEY_TILE], acc2_[QUERY_CHUNK][KEY_TILE];                         \
            float *rows_[QUERY_CHUNK];                                                               \
            int64_t seen_[QUERY_CHUNK];  /* keys query i0 + i sees from s0_ on */                    \
            for (int i = 0; i < chunk; i++) {  /* query i0 + i is (t_, head g_ · group + j_) */       \
                rows_[i] = ROW(0, t_, g_ * group + j_) + s0_, seen_[i] = S - T + t_ + 1 - s0_;       \
                if (++j_ == group) j_ = 0, t_++;                                                     \
            }                                                                                        \
            PAIR_CHAINS2_##SUFFIX(kb_, D, qs_kept + i0 * D, chunk, acc_, acc2_, scale)               \
            for (int i = 0; i < chunk; i++) {                                                        \
                STORE_SCORES(rows_[i], NULL, seen_[i], KEY_TILE, acc_[i]);                           \
                STORE_SCORES(rows_[i] + KEY_TILE, NULL, seen_[i] - KEY_TILE, KEY_TILE, acc2_[i]);    \
            }                                                                                        \
        }                                                                                            \
        job++;                                                                                       \
    }

/* A thread's share of a segment's n jobs or items: a contiguous block, so that each thread streams
 * its own run of K tiles and V rows (round-robin shares, each thread every other 2 KB tile or every
 * other half row, made both threads' prefetchers fetch what the other one reads); which thread gets
 * the larger block rotates from segment to segment (base_), as the round-robin's first item did. */
#define SPAN_FIRST(n) ((n) * first_ / threads)
#define SPAN_END(n) ((n) * (first_ + 1) / threads)
/* for each segment of at most QUERY_BLOCK rows: the variables a pass's job reads, then BODY */
#define FOR_SHORT_SEGMENTS(T_ELEM, BODY)                                                             \
    {                                                                                                \
        int64_t row0_ = 0, base_ = 0;                                                                \
        float *area_ = scratch;                                                                      \
        for (int64_t i_ = 0; i_ < n_segments; row0_ += segments[i_++].rows) {                                 \
            const d3d_segment *seg_ = segments + i_;                                                 \
            if (seg_->rows > QUERY_BLOCK) continue;                                                  \
            const int64_t B = 1, T = seg_->rows, S = seg_->start + T, t0 = 0, t1 = T, nt = T, rows = T;\
            const T_ELEM *q = q_all + row0_ * H * D;                                                 \
            const T_ELEM *k = (const T_ELEM *)seg_->k_cache + layer * seg_->kv_layer;                \
            const T_ELEM *v = (const T_ELEM *)seg_->v_cache + layer * seg_->kv_layer;                \
            const uint8_t *mask = seg_->mask;                                                        \
            T_ELEM *out = out_all + row0_ * H * D;                                                   \
            const int64_t stride_ = score_stride(S);                                                 \
            float *scores = area_, *totals = scores + rows * H * stride_;                            \
            const int64_t kv_batch = 0, kv_head = seg_->kv_head, v_row = seg_->v_row, v_part = seg_->v_part; \
            const int64_t k_tiled = seg_->k_tiled;                                                   \
            const int64_t keys = mask ? S : S - T + t1, tiles = (keys + KEY_TILE - 1) / KEY_TILE;    \
            const int64_t jobs = Hkv * tiles;                                                        \
            (void)B; (void)nt; (void)totals; (void)kv_batch; (void)v_row; (void)v_part; (void)jobs;     \
            (void)out; (void)q; (void)k; (void)v; (void)k_tiled;                                     \
            int64_t first_ = ((me - base_) % threads + threads) % threads;  /* this thread's rank here */\
            BODY                                                                                     \
            area_ += rows * H * (stride_ + 1);                                                       \
        }                                                                                            \
    }

ATTENTION(d3d_attention_bf16, bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ATTENTION(d3d_attention_f32, f32, float, IDENTITY, IDENTITY)

#define ATTENTION_SEGMENTS(NAME, SUFFIX, T_ELEM, LOAD, STORE)                                        \
static void NAME##_segments_body(const T_ELEM *q_all, T_ELEM *out_all, const d3d_segment *segments,  \
                                 int64_t n_segments, int64_t layer, int64_t H, int64_t Hkv, int64_t D,        \
                                 float scale, float *scratch) {                                      \
    int64_t group = H / Hkv, threads = omp_get_num_threads(), me = omp_get_thread_num();             \
    if (ON_TILES_##SUFFIX(D, group)) {                                                               \
        TILES_SEGMENTS_##SUFFIX(q_all, out_all, segments, n_segments, layer, H, Hkv, D, scale, scratch); \
        return;                                                                                      \
    }                                                                                                \
    SCORE_JOB_STATE(T_ELEM)                                                                          \
    PASS_CLOCK                                                                                       \
    FOR_SHORT_SEGMENTS(T_ELEM, {                                                                     \
        if (SCORE_RUN_FITS(SUFFIX))                                                                  \
            ATTENTION_SCORE_RUN(SUFFIX, T_ELEM, LOAD, SPAN_FIRST(jobs), SPAN_END(jobs))              \
        else if (TILE_RUN_FITS(SUFFIX))                                                              \
            ATTENTION_TILE_RUN(SUFFIX, T_ELEM, LOAD, SPAN_FIRST(jobs), SPAN_END(jobs))               \
        else if (PAIR_RUN_FITS(SUFFIX))                                                              \
            ATTENTION_PAIR_RUN(SUFFIX, T_ELEM, LOAD, SPAN_FIRST(jobs), SPAN_END(jobs))               \
        else                                                                                         \
            for (int64_t job = SPAN_FIRST(jobs), job_step_ = 1, job_end_ = SPAN_END(jobs); job < job_end_; job++) \
                ATTENTION_SCORE_JOB(SUFFIX, T_ELEM, LOAD)                                            \
        base_ += jobs;                                                                               \
    })                                                                                               \
    _Pragma("omp barrier")                                                                           \
    PASS_DONE(PASS_SCORES);                                                                          \
    FOR_SHORT_SEGMENTS(T_ELEM, {                                                                     \
        for (int64_t item = SPAN_FIRST(nt * H); item < SPAN_END(nt * H); item++) ATTENTION_EXP_ITEM(SUFFIX) \
        base_ += nt * H;                                                                             \
    })                                                                                               \
    _Pragma("omp barrier")                                                                           \
    PASS_DONE(PASS_SOFTMAX);                                                                         \
    int64_t parts = (D + PART_DIMS - 1) / PART_DIMS;                                                 \
    FOR_SHORT_SEGMENTS(T_ELEM, {                                                                     \
        for (int64_t item = SPAN_FIRST(SUM_ITEMS(1, nt)); item < SPAN_END(SUM_ITEMS(1, nt)); item++) \
            ATTENTION_SUM_ITEM(SUFFIX, T_ELEM, LOAD, STORE)                                          \
        base_ += SUM_ITEMS(1, nt);                                                                   \
    })                                                                                               \
    _Pragma("omp barrier")                                                                           \
    PASS_DONE(PASS_SUMS);                                                                            \
    (void)scale; (void)group;                                                                        \
}

ATTENTION_SEGMENTS(d3d_attention_bf16, bf16, uint16_t, bf16_to_f32, f32_to_bf16)
ATTENTION_SEGMENTS(d3d_attention_f32, f32, float, IDENTITY, IDENTITY)
