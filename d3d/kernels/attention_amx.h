/* ---------------------------------------------------------------------------------------------
 * Attention on AMX tiles (amx.h; bf16 only). Once a process turns AMX on, every bf16 attention whose
 * head dim is a multiple of 32 (up to AMX_MAX_DIM) and whose groups have at most AMX_MAX_GROUP heads
 * runs here, at every query count — a contract of its own, not attention.h's fp32 chains:
 *  1. x(query head, key) = the TDPBF16PS products of its bf16 q and k, 32 values of d per tile
 *     product, in d order — the KV head's query heads a tile's rows and 16 keys its columns (each
 *     16-key tile transposed into d pairs once for all of them), or, for at most AMX_KEY_ROWS query
 *     heads (a one-token step's), the keys as rows read from the cache as they are: the same products
 *     in the same pair positions, so the same x;
 *  2. per query head: m = the max of x over its visible keys, p = bf16(exp_fixed(fl(x · scale) -
 *     fl(m · scale))) (0 where the key is not visible), total = the sum of those rounded p in 16
 *     lanes, in key order;
 *  3. out[d] = bf16(fl(fl(y0 + y1) · (1 / total))), y0 and y1 the TDPBF16PS products of p and v
 *     over the even and the odd 16-key tiles, each in key order from key 0: V's rows are read from
 *     the cache as they are (one key per tile row, its values of d in pairs), and each p goes
 *     beside a 0 — (p, 0) for even d, (0, p) for odd d — so that a pair's two products are one
 *     key's for one d and a 0.
 * Each output element is fed the same tile products in the same order whatever shares its tiles; a
 * tile past a query's last visible key adds p = 0 to it (+0 products: no bit changes), and keys past
 * the call's last visible one are read as 0, never from memory. So a query's bits are its own for 1
 * row or 4,096, causal or masked, and threads split keys (scores), query heads (softmax) and (16
 * query heads, 32 values of d) (sums), never a sum. The bits differ from attention.h's: a process
 * that turns AMX on takes this path at every row count (tests/test_amx.py).
 *
 * A call's queries go in blocks of QUERY_BLOCK; one sequence's block is an amx_plan, and the plans of
 * one call (a batch's rows, a forward's short segments) run three passes together, a barrier after
 * each, as attention.h's do.
 * ------------------------------------------------------------------------------------------- */

#ifdef D3D_AMX
#define AMX_KEYS 64  /* keys per score job */
#define AMX_SUM_DIMS 32  /* values of d per sum item: one 64-byte row of a V tile */

typedef struct {
    const uint16_t *q, *k, *v;  /* q of the block's first query; this sequence's K and V for the layer */
    const uint8_t *mask;        /* (T, S) bytes, or NULL: causal */
    uint16_t *out;              /* the output of the block's first query */
    int64_t T, S, t0, nt, keys;  /* keys: one past the block's last visible key */
    int64_t kv_head, v_row, v_part;
    int64_t rows, stride;  /* score rows per KV head (the block's query heads, whole tiles), floats per row */
    float *odd;     /* per row: x, then in place p as (0, p) pairs (p's fp32 value) */
    uint32_t *even; /* per row: p as (p, 0) pairs */
    float *totals;
} amx_plan;

static inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

static int amx_attention_fits(int64_t D, int64_t group) {
    return amx_on && D % AMX_K == 0 && D <= AMX_MAX_DIM && group <= AMX_MAX_GROUP;
}

static int64_t amx_plan_floats(int64_t nt, int64_t H, int64_t Hkv, int64_t S) {
    int64_t rows = Hkv * round_up(nt * (H / Hkv), AMX_ROWS);
    return 2 * rows * (round_up(S, KEY_TILE) + KEY_TILE) + round_up(rows, 16);
}

/* The plan of queries t0 … t0+nt-1 of a T-query call over S keys, its scratch from `scratch` on
 * (amx_plan_floats; each region whole 64-byte lines). */
static void amx_plan_init(amx_plan *p, const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask,
                          uint16_t *out, int64_t T, int64_t S, int64_t t0, int64_t nt, int64_t H, int64_t Hkv,
                          int64_t D, int64_t kv_head, int64_t v_row, int64_t v_part, float *scratch) {
    p->q = q + t0 * H * D, p->out = out + t0 * H * D, p->k = k, p->v = v, p->mask = mask;
    p->T = T, p->S = S, p->t0 = t0, p->nt = nt, p->kv_head = kv_head, p->v_row = v_row, p->v_part = v_part;
    p->keys = 0;
    for (int64_t t = t0; t < t0 + nt; t++) {
        int64_t end = visible_end(mask ? mask + t * S : NULL, S, T, t);
        p->keys = end > p->keys ? end : p->keys;
    }
    p->rows = round_up(nt * (H / Hkv), AMX_ROWS), p->stride = round_up(S, KEY_TILE) + KEY_TILE;  /* + 16: rows in different cache sets */
    p->odd = scratch, p->even = (uint32_t *)(scratch + Hkv * p->rows * p->stride);
    p->totals = scratch + 2 * Hkv * p->rows * p->stride;
}

/* One past the last key that any of the plan's queries t0 + a … t0 + b sees. */
static int64_t amx_last_end(const amx_plan *p, int64_t a, int64_t b) {
    if (!p->mask) return p->S - p->T + p->t0 + b + 1;
    int64_t end = 0;
    for (int64_t t = p->t0 + a; t <= p->t0 + b; t++) {
        int64_t e = visible_end(p->mask + t * p->S, p->S, p->T, t);
        end = e > end ? e : end;
    }
    return end;
}

/* A thread's copy of one plan's KV head's query heads as tile operands, kept while it works on them
 * (reset per call): as rows (amx_query_rows: row (t - t0) · group + j holds query head j's q) or, in
 * the keys-as-rows form, as d pairs (amx_query_pairs) — a plan takes one form only. */
static __thread struct {
    const uint16_t *q;
    int64_t g;
    uint16_t rows[QUERY_BLOCK * AMX_MAX_GROUP][AMX_MAX_DIM] __attribute__((aligned(64)));
} amx_queries;

/* The same query heads as second operands (at most AMX_ROWS of them, for the keys-as-rows form):
 * tile i holds d = 32i … 32i+31, row r the pairs (2r, 2r+1) of each query head (column). */
static const uint16_t *amx_query_pairs(const amx_plan *p, int64_t g, int64_t H, int64_t Hkv, int64_t D) {
    if (amx_queries.q != p->q || amx_queries.g != g) {
        int64_t group = H / Hkv, cols = p->nt * group;
        for (int64_t i = 0; i < D / AMX_K; i++) {
            __m512 r[16], pairs[16];
            for (int l = 0; l < 16; l++)
                r[l] = l < cols ? _mm512_castsi512_ps(_mm512_loadu_si512(
                                      p->q + ((l / group) * H + g * group + l % group) * D + i * AMX_K))
                                : _mm512_setzero_ps();
            transpose16(r, pairs);
            for (int row = 0; row < 16; row++) _mm512_store_ps((float *)amx_queries.rows[0] + (i * AMX_ROWS + row) * 16, pairs[row]);
        }
        amx_queries.q = p->q, amx_queries.g = g;
    }
    return amx_queries.rows[0];
}

static const uint16_t *amx_query_rows(const amx_plan *p, int64_t g, int64_t H, int64_t Hkv, int64_t D) {
    if (amx_queries.q != p->q || amx_queries.g != g) {
        int64_t group = H / Hkv, cols = p->nt * group;
        for (int64_t r = 0; r < p->rows; r++)
            if (r < cols) memcpy(amx_queries.rows[r], p->q + ((r / group) * H + g * group + r % group) * D, D * 2);
            else memset(amx_queries.rows[r], 0, D * 2);
        amx_queries.q = p->q, amx_queries.g = g;
    }
    return amx_queries.rows[0];
}

/* Pass 1 where the KV head has at most AMX_KEY_ROWS query heads (a one-token step's): keys as the
 * tiles' rows, read from the cache as they are, the query heads as columns — the same products in
 * the same pair positions as the query-rows form below (a product's operands swap places), so the
 * same x; then each query head's column gathered into its row. */
#define AMX_KEY_ROWS 8
static void amx_score_keys_as_rows(const amx_plan *p, int64_t g, int64_t s_begin, int64_t s_end, int64_t H,
                                   int64_t Hkv, int64_t D, int *state) {
    int64_t cols = p->nt * (H / Hkv), steps = D / AMX_K, tiles = (s_end - s_begin + KEY_TILE - 1) / KEY_TILE;
    const uint16_t *qpairs = amx_query_pairs(p, g, H, Hkv, D), *kg = p->k + g * p->kv_head;
    uint16_t tail[AMX_ROWS * AMX_MAX_DIM] __attribute__((aligned(64)));
    const uint16_t *a[AMX_KEYS / KEY_TILE];
    int64_t a_stride[AMX_KEYS / KEY_TILE];
    for (int64_t j = 0; j < tiles; j++) {
        int64_t s0 = s_begin + j * KEY_TILE, n = p->keys - s0 < KEY_TILE ? p->keys - s0 : KEY_TILE;
        a[j] = kg + s0 * D, a_stride[j] = D * 2;
        if (s0 + AMX_KEYS + KEY_TILE <= p->keys)  /* the tile AMX_KEYS keys on, into L2 */
            for (int64_t at = 0; at < KEY_TILE * D * 2; at += 64) __builtin_prefetch((const char *)(a[j] + AMX_KEYS * D) + at, 0, 2);
        if (n < KEY_TILE) {  /* the last keys: never read past the call's */
            memcpy(tail, a[j], n * D * 2);
            memset(tail + n * D, 0, (KEY_TILE - n) * D * 2);
            a[j] = tail;
        }
    }
    amx_configure(AMX_ROWS, AMX_ROWS, state);
#define KEY_TILE_DP(J, A, B)                                                                         \
    if (J < tiles) {                                                                                 \
        if (i == 0) TILE_ZERO(J);                                                                    \
        TILE_LOAD(A, a[J] + i * AMX_K, a_stride[J]);                                                 \
        TILE_DP(J, A, B);                                                                            \
    }
#define KEY_STEP(B)                                                                                  \
    TILE_LOAD(B, qpairs + i * AMX_ROWS * AMX_K, 64);                                                 \
    KEY_TILE_DP(0, 4, B) KEY_TILE_DP(1, 5, B) KEY_TILE_DP(2, 4, B) KEY_TILE_DP(3, 5, B)
    for (int64_t i = 0; i < steps; i++) {
        if (i & 1) { KEY_STEP(7) } else { KEY_STEP(6) }
    }
#undef KEY_STEP
#undef KEY_TILE_DP
    float c[AMX_KEYS / KEY_TILE][AMX_ROWS][16] __attribute__((aligned(64)));
    TILE_STORE(0, c[0], 64);
    if (tiles > 1) TILE_STORE(1, c[1], 64);
    if (tiles > 2) TILE_STORE(2, c[2], 64);
    if (tiles > 3) TILE_STORE(3, c[3], 64);
    __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32(16));
    for (int64_t j = 0; j < tiles; j++) {
        int64_t s0 = s_begin + j * KEY_TILE, n = s_end - s0 < KEY_TILE ? s_end - s0 : KEY_TILE;
        __mmask16 live = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        for (int64_t col = 0; col < cols; col++)
            _mm512_mask_storeu_ps(p->odd + (g * p->rows + col) * p->stride + s0, live,
                                  _mm512_i32gather_ps(down, &c[j][0][col], 4));
    }
}

/* Pass 1, job (KV head g, AMX_KEYS keys): the d pairs of its 16-key tiles (second operands), then x
 * for every tile of the KV head's query heads that sees them, stored as it is into their rows — the
 * whole tiles first, then the partial one (tiles configured with its rows only: no row past the
 * query heads is read or written). */
static void amx_score_job(const amx_plan *p, int64_t job, int64_t H, int64_t Hkv, int64_t D, int *state) {
    int64_t chunks = (p->keys + AMX_KEYS - 1) / AMX_KEYS, g = job / chunks, s_begin = job % chunks * AMX_KEYS;
    int64_t group = H / Hkv, cols = p->nt * group, steps = D / AMX_K;
    int64_t s_end = s_begin + AMX_KEYS < p->keys ? s_begin + AMX_KEYS : p->keys;
    if (cols <= AMX_KEY_ROWS) {
        amx_score_keys_as_rows(p, g, s_begin, s_end, H, Hkv, D, state);
        return;
    }
    const uint16_t *qrows = amx_query_rows(p, g, H, Hkv, D), *kg = p->k + g * p->kv_head;
    float pairs[AMX_KEYS / KEY_TILE][AMX_MAX_DIM / AMX_K][AMX_ROWS][16] __attribute__((aligned(64)));
    for (int64_t s0 = s_begin; s0 < s_end; s0 += KEY_TILE) {
        int64_t n = p->keys - s0 < KEY_TILE ? p->keys - s0 : KEY_TILE;
        const uint16_t *kb = kg + s0 * D;
        if (s0 + AMX_KEYS + KEY_TILE <= p->keys)  /* the tile AMX_KEYS keys on, into L2 */
            for (int64_t at = 0; at < KEY_TILE * D * 2; at += 64) __builtin_prefetch((const char *)(kb + AMX_KEYS * D) + at, 0, 2);
        for (int64_t i = 0; i < steps; i++) {
            __m512 r[16];
            key_pairs(kb, n, D, i * AMX_K, r);  /* 0 for keys from the call's last visible one */
            for (int row = 0; row < 16; row++) _mm512_store_ps(pairs[(s0 - s_begin) / KEY_TILE][i][row], r[row]);
        }
    }
    int64_t tiles = (s_end - s_begin + KEY_TILE - 1) / KEY_TILE;
    for (int64_t c0 = 0; c0 < cols; c0 += AMX_ROWS) {
        int64_t nc = cols - c0 < AMX_ROWS ? cols - c0 : AMX_ROWS, end = amx_last_end(p, c0 / group, (c0 + nc - 1) / group);
        int64_t seen = p->mask || end >= s_end ? tiles : (end - s_begin + KEY_TILE - 1) / KEY_TILE;  /* causal */
        if (seen <= 0) continue;
        amx_configure((int)nc, (int)nc, state);
        /* key tile j's x in tmm j (up to 4 accumulators in flight), d step i's q rows in tmm 4 + i % 2,
         * the pairs in tmm 6 and 7 by turns (the tile intrinsics take constant tile numbers) */
        float *xs = p->odd + (g * p->rows + c0) * p->stride + s_begin;
#define SCORE_TILE(J, A, B)                                                                          \
    if (J < seen) {                                                                                  \
        if (i == 0) TILE_ZERO(J);                                                                    \
        TILE_LOAD(B, pairs[J][i], 64);                                                               \
        TILE_DP(J, A, B);                                                                            \
    }
#define SCORE_STEP(A)                                                                                \
    TILE_LOAD(A, qrows + c0 * AMX_MAX_DIM + i * AMX_K, AMX_MAX_DIM * 2);                             \
    SCORE_TILE(0, A, 6) SCORE_TILE(1, A, 7) SCORE_TILE(2, A, 6) SCORE_TILE(3, A, 7)
        for (int64_t i = 0; i < steps; i++) {
            if (i & 1) { SCORE_STEP(5) } else { SCORE_STEP(4) }
        }
#undef SCORE_STEP
#undef SCORE_TILE
        TILE_STORE(0, xs, p->stride * 4);
        if (seen > 1) TILE_STORE(1, xs + KEY_TILE, p->stride * 4);
        if (seen > 2) TILE_STORE(2, xs + 2 * KEY_TILE, p->stride * 4);
        if (seen > 3) TILE_STORE(3, xs + 3 * KEY_TILE, p->stride * 4);
    }
}

/* Pass 2, item (KV head g, query head): its p as (0, p) pairs in place over its x and as (p, 0)
 * pairs beside them, 0 from its last visible key to the plan's last 16-key tile, and its total. */
static void amx_exp_item(const amx_plan *p, int64_t item, int64_t H, int64_t Hkv, float scale) {
    int64_t group = H / Hkv, cols = p->nt * group, g = item / cols, col = item % cols, t = p->t0 + col / group;
    int64_t at = (g * p->rows + col) * p->stride;
    float *row = p->odd + at;
    uint32_t *even = p->even + at;
    const uint8_t *mrow = p->mask ? p->mask + t * p->S : NULL;
    int64_t end = visible_end(mrow, p->S, p->T, t);
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps(), scale_ = _mm512_set1_ps(scale);
#define AMX_SEEN(s0)                                                                                 \
    __mmask16 live = end - (s0) >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (end - (s0))) - 1); \
    __mmask16 seen = mrow ? _mm_mask_cmpneq_epi8_mask(live, _mm_maskz_loadu_epi8(live, mrow + (s0)), _mm_setzero_si128()) : live
    for (int64_t s0 = 0; s0 < end; s0 += LANES) {
        AMX_SEEN(s0);
        top = _mm512_mask_max_ps(top, seen, _mm512_loadu_ps(row + s0), top);
    }
    float lanes[LANES], best = -INFINITY;
    _mm512_storeu_ps(lanes, top);
    for (int l = 0; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;  /* NaNs passed over */
    top = _mm512_mul_ps(_mm512_set1_ps(best), scale_);
    for (int64_t s0 = 0; s0 < end; s0 += LANES) {
        AMX_SEEN(s0);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(seen, row + s0), scale_);
        __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
            _mm512_maskz_mov_ps(seen, exp_below16(_mm512_sub_ps(x, top)))));  /* x ≤ top: top is x's largest, both times scale */
        __m512 p16 = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        sum = _mm512_mask_add_ps(sum, live, sum, p16);
        _mm512_mask_storeu_ps(row + s0, live, p16);
        _mm512_mask_storeu_epi32(even + s0, live, bits);
    }
#undef AMX_SEEN
    int64_t tail = round_up(p->keys, KEY_TILE) - end;
    memset(row + end, 0, tail * 4);
    memset(even + end, 0, tail * 4);
    _mm512_storeu_ps(lanes, sum);
    p->totals[g * p->rows + col] = fold_lanes(lanes);
}

/* Pass 3, item (KV head g, 16 query heads, 32 values of d): the weighted sums of V — even d from the
 * (p, 0) rows, odd d from the (0, p) rows, each 16-key tile of V read once for both, even and odd
 * key tiles into accumulators of their own (tmm 0, 1 and 2, 3: two chains in flight), added at the
 * end — divided by the totals. */
static void amx_sum_item(const amx_plan *p, int64_t item, int64_t H, int64_t Hkv, int64_t D, int *state) {
    int64_t group = H / Hkv, cols = p->nt * group, tiles = (cols + AMX_ROWS - 1) / AMX_ROWS, slices = D / AMX_SUM_DIMS;
    int64_t g = item / (tiles * slices), c0 = item / slices % tiles * AMX_ROWS, d0 = item % slices * AMX_SUM_DIMS;
    int64_t nc = cols - c0 < AMX_ROWS ? cols - c0 : AMX_ROWS, end = amx_last_end(p, c0 / group, (c0 + nc - 1) / group);
    int64_t at = (g * p->rows + c0) * p->stride;
    const uint16_t *vg = p->v + g * p->kv_head + d0 / V_PART * p->v_part + d0 % V_PART;
    uint16_t tail[KEY_TILE * AMX_SUM_DIMS] __attribute__((aligned(64)));
    amx_configure((int)nc, (int)nc, state);  /* its query heads' rows only */
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
    for (int64_t s0 = 0; s0 < end; s0 += KEY_TILE) {
        const uint16_t *vb = vg + s0 * p->v_row;
        int64_t vb_stride = p->v_row * 2;
        for (int64_t l = 0; l < KEY_TILE; l++) __builtin_prefetch(vb + (PREFETCH_KEYS + l) * p->v_row, 0, 2);
        if (s0 + KEY_TILE > p->keys) {  /* the last keys: never read past the call's */
            int64_t n = p->keys - s0;
            for (int64_t l = 0; l < KEY_TILE; l++)
                if (l < n) memcpy(tail + l * AMX_SUM_DIMS, vb + l * p->v_row, AMX_SUM_DIMS * 2);
                else memset(tail + l * AMX_SUM_DIMS, 0, AMX_SUM_DIMS * 2);
            vb = tail, vb_stride = AMX_SUM_DIMS * 2;
        }
        TILE_LOAD(4, p->even + at + s0, p->stride * 4);
        TILE_LOAD(5, p->odd + at + s0, p->stride * 4);
        if (s0 / KEY_TILE % 2 == 0) {
            TILE_LOAD(6, vb, vb_stride);
            TILE_DP(0, 4, 6);
            TILE_DP(1, 5, 6);
        } else {
            TILE_LOAD(7, vb, vb_stride);
            TILE_DP(2, 4, 7);
            TILE_DP(3, 5, 7);
        }
    }
    float c[4][AMX_ROWS][16] __attribute__((aligned(64)));
    TILE_STORE(0, c[0], 64);
    TILE_STORE(1, c[1], 64);
    TILE_STORE(2, c[2], 64);
    TILE_STORE(3, c[3], 64);
    __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t j = 0; j < nc; j++) {
        int64_t col = c0 + j, t = col / group, h = g * group + col % group;
        float total = p->totals[g * p->rows + col], inv = total > 0.0f ? 1.0f / total : 0.0f;
        __m512 even = _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(c[0][j]), _mm512_load_ps(c[2][j])), _mm512_set1_ps(inv));
        __m512 odd = _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(c[1][j]), _mm512_load_ps(c[3][j])), _mm512_set1_ps(inv));
        uint16_t *o = p->out + (t * H + h) * D + d0;
        v16_store_bf16(o, _mm512_permutex2var_ps(even, first, odd));
        v16_store_bf16(o + 16, _mm512_permutex2var_ps(even, second, odd));
    }
}

/* Passes 2 and 3 together, item (KV head g, 16 query heads): their softmax items, then their sum
 * items — so that the p rows the sums read were written just before, by the same thread, and are
 * still in its L2 (a long context's p rows for every query head do not fit). */
static void amx_exp_sum_item(const amx_plan *p, int64_t item, int64_t H, int64_t Hkv, int64_t D, float scale, int *state) {
    int64_t cols = p->nt * (H / Hkv), tiles = (cols + AMX_ROWS - 1) / AMX_ROWS, slices = D / AMX_SUM_DIMS;
    int64_t g = item / tiles, c0 = item % tiles * AMX_ROWS, c1 = c0 + AMX_ROWS < cols ? c0 + AMX_ROWS : cols;
    for (int64_t col = c0; col < c1; col++) amx_exp_item(p, g * cols + col, H, Hkv, scale);
    for (int64_t slice = 0; slice < slices; slice++) amx_sum_item(p, item * slices + slice, H, Hkv, D, state);
}

/* Items of pass 0 (scores), 1 (softmax), 2 (sums) or 3 (softmax and sums together) of a plan. */
static int64_t amx_pass_items(const amx_plan *p, int pass, int64_t H, int64_t Hkv, int64_t D) {
    int64_t cols = p->nt * (H / Hkv), tiles = (cols + AMX_ROWS - 1) / AMX_ROWS;
    if (pass == 0) return Hkv * ((p->keys + AMX_KEYS - 1) / AMX_KEYS);
    if (pass == 1) return Hkv * cols;
    return Hkv * tiles * (pass == 2 ? D / AMX_SUM_DIMS : 1);
}

/* The passes over n plans, run by every thread of the parallel region: each pass's items, numbered
 * across the plans, in one contiguous share per thread (a thread streams its own run of keys), then
 * a barrier. The scores, then the softmax and the sums as two passes, or as one where there are
 * enough groups of 16 query heads to share (AMX_FUSED_ITEMS a thread): the same items either way,
 * so the same bits. */
#define AMX_FUSED_ITEMS 4
static void amx_attention_run(const amx_plan *plans, int64_t n, int64_t H, int64_t Hkv, int64_t D, float scale) {
    int64_t threads = omp_get_num_threads(), me = omp_get_thread_num(), fused_items = 0;
    int state = 0;
    PASS_CLOCK
    amx_queries.q = NULL;
    for (int64_t i = 0; i < n; i++) fused_items += amx_pass_items(plans + i, 3, H, Hkv, D);
    int fused = fused_items >= AMX_FUSED_ITEMS * threads;
    for (int step = 0; step < (fused ? 2 : 3); step++) {
        int pass = fused && step == 1 ? 3 : step;
        int64_t total = 0, base = 0;
        for (int64_t i = 0; i < n; i++) total += amx_pass_items(plans + i, pass, H, Hkv, D);
        int64_t first = total * me / threads, last = total * (me + 1) / threads;
        for (int64_t i = 0; i < n && base < last; i++) {
            int64_t count = amx_pass_items(plans + i, pass, H, Hkv, D);
            for (int64_t j = first > base ? first - base : 0; j < count && base + j < last; j++) {
                if (pass == 0) amx_score_job(plans + i, j, H, Hkv, D, &state);
                else if (pass == 1) amx_exp_item(plans + i, j, H, Hkv, scale);
                else if (pass == 2) amx_sum_item(plans + i, j, H, Hkv, D, &state);
                else amx_exp_sum_item(plans + i, j, H, Hkv, D, scale, &state);
            }
            base += count;
        }
        _Pragma("omp barrier")
        PASS_DONE(pass);
    }
    if (state) amx_release();
}
/* attention.h's d3d_attention_bf16_body on tiles: each block of QUERY_BLOCK queries, the batch's rows together. */
static void amx_attention_blocks(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask,
                                 uint16_t *out, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D,
                                 int64_t kv_batch, int64_t kv_head, int64_t v_row, int64_t v_part, float scale,
                                 float *scratch) {
    int64_t size = amx_plan_floats(T < QUERY_BLOCK ? T : QUERY_BLOCK, H, Hkv, S);
    amx_plan plans[B];
    for (int64_t t0 = 0; t0 < T; t0 += QUERY_BLOCK) {
        int64_t nt = T - t0 < QUERY_BLOCK ? T - t0 : QUERY_BLOCK;
        for (int64_t b = 0; b < B; b++)
            amx_plan_init(plans + b, q + b * T * H * D, k + b * kv_batch, v + b * kv_batch, mask ? mask + b * T * S : NULL,
                          out + b * T * H * D, T, S, t0, nt, H, Hkv, D, kv_head, v_row, v_part, scratch + b * size);
        amx_attention_run(plans, B, H, Hkv, D, scale);
    }
}

/* attention.h's segments body on tiles: the segments of at most QUERY_BLOCK rows, together. */
static void amx_attention_segments(const uint16_t *q_all, uint16_t *out_all, const d3d_segment *segments,
                                   int64_t n_segments, int64_t layer, int64_t H, int64_t Hkv, int64_t D, float scale,
                                   float *scratch) {
    amx_plan plans[n_segments > 0 ? n_segments : 1];
    int64_t n = 0, row0 = 0;
    for (int64_t i = 0; i < n_segments; row0 += segments[i++].rows) {
        const d3d_segment *g = segments + i;
        if (g->rows > QUERY_BLOCK) continue;
        int64_t S = g->start + g->rows;
        amx_plan_init(plans + n++, q_all + row0 * H * D, (const uint16_t *)g->k_cache + layer * g->kv_layer,
                      (const uint16_t *)g->v_cache + layer * g->kv_layer, g->mask, out_all + row0 * H * D, g->rows, S,
                      0, g->rows, H, Hkv, D, g->kv_head, g->v_row, g->v_part, scratch);
        scratch += amx_plan_floats(g->rows, H, Hkv, S);
    }
    if (n) amx_attention_run(plans, n, H, Hkv, D, scale);
}
#endif
