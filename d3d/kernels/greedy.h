/* ---------------------------------------------------------------------------------------------
 * The certified greedy head: which vocabulary rows can hold a row's argmax, without the exact head.
 *
 * Greedy decoding needs only the argmax of each row's logits. An approximate head — the head's
 * weights as 8-bit codes per block of 32 (w ~ scale·q, |w - scale·q| <= error, both per block, made
 * once by d3d.kernels.binding from the exact weights), the row's hidden state as 16-bit codes per
 * block (x ~ s·c, |x - s·c| <= 0.51 s, s = max|x| / 32767), exact integer block sums scaled in fp32 —
 * gives each logit A within a bound E of the exact one, rounding of both computations included:
 *   |z - A| <= sum_b error_b·S_b + scale_b·(127·32·0.51·s_b + 2·(K + 64)·u·128·S_b),  S_b = sum |x|,
 * u fp32's unit roundoff, then 1% and a relative 2^-20 of |A| more. With L the largest A - E and U the
 * largest A + E, a vocabulary row whose A + E falls below L - 2^-6·max(|L|, |U|) is below the best
 * row's exact logit by more than two bf16 steps, so its bf16 logit is below the argmax's: the argmax
 * of the exact bf16 logits — ties broken by the lowest index — lies among the others (the
 * candidates), which the caller computes with the exact head's own chains. On SmolLM2-135M's head
 * the candidates number 1 at the median and 9 at most (scripts/head_bound.py); the approximate head
 * reads 35 MB at memory speed where the exact one decodes its blocks to bf16 (AMD EPYC Zen 3: ~1.0
 * against ~1.6 ms for one row).
 *
 * d3d_greedy_candidates: for each of M rows x (M, K) fp32, K a multiple of 32, the candidates in
 * ascending order into candidates[m * cap …] and their number into counts[m] — or -1 where they are
 * more than cap or the row is not finite (the caller then runs the exact head). Up to GREEDY_ROWS rows
 * share one pass over the codes (one row ~1.0 ms, each more ~0.3 on a Zen 3: past 3 rows the exact
 * head's multi-row path, which decodes each block once for all rows, costs less).
 * ------------------------------------------------------------------------------------------- */

#define GREEDY_BLOCK 32
#define GREEDY_MAX_BLOCKS 512  /* K up to 16,384 */

/* The row's 16-bit codes and per-block constants: s_b, the bound's weight on error_b (S') and on
 * scale_b (C'). Returns 0 where x is not finite. */
static int greedy_codes(const float *x, int64_t K, int16_t *codes, float *s, float *weight_on_error,
                        float *weight_on_scale) {
    const double unit = 1.0 / 16777216.0;
    for (int64_t b = 0; b < K / GREEDY_BLOCK; b++) {
        const float *xb = x + b * GREEDY_BLOCK;
        float top = 0.0f, sum = 0.0f;
        for (int i = 0; i < GREEDY_BLOCK; i++) {
            float a = fabsf(xb[i]);
            if (!(a <= 3.0e38f)) return 0;  /* inf or NaN */
            top = a > top ? a : top;
            sum += a;
        }
        float step = top / 32767.0f;
        if (top > 0.0f && !(step >= 1e-30f)) return 0;  /* too small for 16-bit codes to bound */
        for (int i = 0; i < GREEDY_BLOCK; i++) {
            float c = step > 0.0f ? rintf(xb[i] / step) : 0.0f;
            codes[b * GREEDY_BLOCK + i] = (int16_t)(c > 32767.0f ? 32767.0f : c < -32767.0f ? -32767.0f : c);
        }
        double sums = (double)sum * (1.0 + 64 * unit);  /* >= the exact sum of |x| */
        s[b] = step;
        weight_on_error[b] = (float)(sums * (1.0 + 1e-6));
        weight_on_scale[b] = (float)((127.0 * 32.0 * 0.51 * step + 2.0 * (double)(K + 64) * unit * 128.0 * sums) * (1.0 + 1e-6));
    }
    return 1;
}

/* The approximate logits A and their bounds E of vocabulary rows v0 … v1-1 for R <= GREEDY_ROWS rows
 * (each row's codes xc[r], constants at r * blocks), each vocabulary row's codes read once for all;
 * low[r] and high[r] raised to the largest A - E and A + E seen */
#define GREEDY_ROWS 4
static inline __attribute__((always_inline)) void greedy_bounds(
    const int16_t *xc, const float *s, const float *on_error, const float *on_scale, const int R, int64_t K,
    const int8_t *codes, const float *scale, const float *error, int64_t V, int64_t v0, int64_t v1, float *approx,
    float *bound, float *low, float *high) {
    int64_t blocks = K / GREEDY_BLOCK;
    for (int64_t v = v0; v < v1; v++) {
        const int8_t *row = codes + v * K;
        const float *sv = scale + v * blocks, *ev = error + v * blocks;
        float a[GREEDY_ROWS] = {0.0f}, e[GREEDY_ROWS] = {0.0f};
#ifdef __AVX2__
        /* two chains a row, even and odd blocks: with one, an FMA's latency a block was the bound */
        __m256 even[GREEDY_ROWS], odd[GREEDY_ROWS];
        for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
#define GREEDY_BLOCK_SUM(b, chains)                                                                   \
        {                                                                                            \
            __m256i w_ = _mm256_loadu_si256((const __m256i *)(row + (b) * GREEDY_BLOCK));            \
            __m256i lo_ = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w_));                          \
            __m256i hi_ = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w_, 1));                     \
            for (int r = 0; r < R; r++) {                                                            \
                const int16_t *xr_ = xc + r * K + (b) * GREEDY_BLOCK;                                \
                __m256i p_ = _mm256_add_epi32(_mm256_madd_epi16(lo_, _mm256_loadu_si256((const __m256i *)xr_)), \
                                              _mm256_madd_epi16(hi_, _mm256_loadu_si256((const __m256i *)(xr_ + 16)))); \
                chains[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_), _mm256_set1_ps(sv[b] * s[r * blocks + (b)]), chains[r]); \
            }                                                                                        \
        }
        int64_t b2 = 0;
        for (; b2 + 2 <= blocks; b2 += 2) {
            GREEDY_BLOCK_SUM(b2, even)
            GREEDY_BLOCK_SUM(b2 + 1, odd)
        }
        if (b2 < blocks) GREEDY_BLOCK_SUM(b2, even)
#undef GREEDY_BLOCK_SUM
        for (int r = 0; r < R; r++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, _mm256_add_ps(even[r], odd[r]));
            for (int l = 0; l < 8; l++) a[r] += lanes[l];
        }
#else
        for (int64_t b = 0; b < blocks; b++)
            for (int r = 0; r < R; r++) {
                int32_t dot = 0;
                for (int i = 0; i < GREEDY_BLOCK; i++)
                    dot += (int32_t)row[b * GREEDY_BLOCK + i] * (int32_t)xc[r * K + b * GREEDY_BLOCK + i];
                a[r] += (float)dot * (sv[b] * s[r * blocks + b]);
            }
#endif
        for (int r = 0; r < R; r++) {
            const float *oe = on_error + r * blocks, *os = on_scale + r * blocks;
            int64_t b = 0;
#ifdef __AVX2__
            __m256 sum = _mm256_setzero_ps();
            for (; b + 8 <= blocks; b += 8)
                sum = _mm256_fmadd_ps(_mm256_loadu_ps(ev + b), _mm256_loadu_ps(oe + b),
                                      _mm256_fmadd_ps(_mm256_loadu_ps(sv + b), _mm256_loadu_ps(os + b), sum));
            float lanes[8];
            _mm256_storeu_ps(lanes, sum);
            for (int l = 0; l < 8; l++) e[r] += lanes[l];
#endif
            for (; b < blocks; b++) e[r] += ev[b] * oe[b] + sv[b] * os[b];
            float bd = e[r] * 1.01f + fabsf(a[r]) * (1.0f / 1048576.0f);
            approx[r * V + v] = a[r];
            bound[r * V + v] = bd;
            low[r] = a[r] - bd > low[r] ? a[r] - bd : low[r];
            high[r] = a[r] + bd > high[r] ? a[r] + bd : high[r];
        }
    }
}

void d3d_greedy_candidates(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale,
                           const float *error, int64_t V, int64_t cap, int64_t *candidates, int64_t *counts,
                           int threads) {
    /* the approximate logits and bounds: scratch of the calling thread's, kept (a fresh 1.5 MB a
     * call cost its page faults every step) */
    static _Thread_local float *scratch = NULL;
    static _Thread_local int64_t scratch_v = 0;
    if (scratch_v < V) {
        free(scratch);
        scratch = (float *)malloc(sizeof(float) * 2 * GREEDY_ROWS * V);
        scratch_v = scratch ? V : 0;
    }
    if (!scratch) {
        for (int64_t m = 0; m < M; m++) counts[m] = -1;
        return;
    }
    /* the calling thread's (callers may run in several threads); the team reads them through pointers */
    static _Thread_local int16_t codes_of_x[GREEDY_ROWS * GREEDY_MAX_BLOCKS * GREEDY_BLOCK];
    static _Thread_local float constants[3 * GREEDY_ROWS * GREEDY_MAX_BLOCKS];
    int16_t *xc = codes_of_x;
    float *s = constants, *on_error = s + GREEDY_ROWS * GREEDY_MAX_BLOCKS, *on_scale = on_error + GREEDY_ROWS * GREEDY_MAX_BLOCKS;
    int64_t blocks = K / GREEDY_BLOCK;
    float *approx = scratch, *bound = scratch + GREEDY_ROWS * V;
    for (int64_t m0 = 0; m0 < M; m0 += GREEDY_ROWS) {
        int64_t rows[GREEDY_ROWS];  /* the rows of x this pass takes: the finite ones */
        int R = 0;
        for (int64_t m = m0; m < M && m < m0 + GREEDY_ROWS; m++) {
            counts[m] = -1;
            if (K % GREEDY_BLOCK == 0 && blocks <= GREEDY_MAX_BLOCKS &&
                greedy_codes(x + m * K, K, xc + R * K, s + R * blocks, on_error + R * blocks, on_scale + R * blocks))
                rows[R++] = m;
        }
        if (!R) continue;
        float low[GREEDY_ROWS], high[GREEDY_ROWS];
        for (int r = 0; r < R; r++) low[r] = high[r] = -INFINITY;
        _Pragma("omp parallel num_threads(threads)")
        {
            int64_t n = omp_get_num_threads(), me = omp_get_thread_num();
            float my_low[GREEDY_ROWS], my_high[GREEDY_ROWS];
            for (int r = 0; r < R; r++) my_low[r] = my_high[r] = -INFINITY;
            int64_t v0 = V * me / n, v1 = V * (me + 1) / n;
            switch (R) {  /* one copy per row count, its accumulators in registers */
                case 1: greedy_bounds(xc, s, on_error, on_scale, 1, K, codes, scale, error, V, v0, v1, approx, bound, my_low, my_high); break;
                case 2: greedy_bounds(xc, s, on_error, on_scale, 2, K, codes, scale, error, V, v0, v1, approx, bound, my_low, my_high); break;
                case 3: greedy_bounds(xc, s, on_error, on_scale, 3, K, codes, scale, error, V, v0, v1, approx, bound, my_low, my_high); break;
                default: greedy_bounds(xc, s, on_error, on_scale, 4, K, codes, scale, error, V, v0, v1, approx, bound, my_low, my_high); break;
            }
            _Pragma("omp critical")
            for (int r = 0; r < R; r++) {
                low[r] = my_low[r] > low[r] ? my_low[r] : low[r];
                high[r] = my_high[r] > high[r] ? my_high[r] : high[r];
            }
        }
        for (int r = 0; r < R; r++) {
            if (!(low[r] > -INFINITY) || !(high[r] < INFINITY)) continue;
            float reach = fabsf(low[r]) > fabsf(high[r]) ? fabsf(low[r]) : fabsf(high[r]);
            float floor = low[r] - reach * (1.0f / 64.0f) - 1e-30f;
            const float *ar = approx + r * V, *br = bound + r * V;
            int64_t found = 0, *out = candidates + rows[r] * cap;
            for (int64_t v = 0; v < V && found <= cap; v++)
                if (ar[v] + br[v] >= floor) {
                    if (found < cap) out[found] = v;
                    found++;
                }
            counts[rows[r]] = found <= cap ? found : -1;
        }
    }
}

/* The approximate head of a bf16 head weight w (V, K), K a multiple of 32, made once: per block of
 * 32, scale = max|w| / 127, codes = w / scale rounded to nearest even (0 where the block is 0),
 * error = max |w - scale·code| computed exactly in double and rounded up to fp32 — any code would
 * do, the error being measured afterwards. Rows split between the threads. */
void d3d_greedy_weights(const uint16_t *w, int64_t V, int64_t K, int8_t *codes, float *scale, float *error,
                        int threads) {
    int64_t blocks = K / GREEDY_BLOCK;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t v = 0; v < V; v++) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *wb = w + v * K + b * GREEDY_BLOCK;
            float values[GREEDY_BLOCK], top = 0.0f;
            for (int i = 0; i < GREEDY_BLOCK; i++) {
                uint32_t bits = (uint32_t)wb[i] << 16;
                memcpy(&values[i], &bits, sizeof bits);
                top = fabsf(values[i]) > top ? fabsf(values[i]) : top;
            }
            float s = top / 127.0f, divisor = s > 0.0f ? s : 1.0f;
            double worst = 0.0;
            for (int i = 0; i < GREEDY_BLOCK; i++) {
                float q = rintf(values[i] / divisor);
                q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                codes[v * K + b * GREEDY_BLOCK + i] = (int8_t)q;
                double off = fabs((double)values[i] - (double)q * (double)s);
                worst = off > worst ? off : worst;
            }
            float e = (float)worst;
            scale[v * blocks + b] = s;
            error[v * blocks + b] = (double)e < worst ? nextafterf(e, INFINITY) : e;
        }
    }
}
