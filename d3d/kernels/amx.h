/* ---------------------------------------------------------------------------------------------
 * AMX linear (Intel Xeons from Sapphire Rapids on): the bf16 matrix products on tiles.
 *
 * The packed bf16 layout (N/16, K/2, 16, 2) is already the tile layout TDPBF16PS reads for its
 * second operand: 16 consecutive k pairs of a 16-column group are one 1 KB tile (16 rows of 64
 * bytes). A call's rows go in tiles of up to 16 (the first operand: 16 rows x 32 bf16 of x); each
 * output (row, column) is one accumulator element, zeroed, then fed by one TDPBF16PS per 32 values
 * of k, in k order. A row's elements are computed by the same tile operations in the same order
 * whether its tile holds 1 or 16 valid rows, and threads split output columns, never k — so every
 * row's bits are the row's alone, as on the other paths (rowexact.c). The bits differ from the
 * AVX-512 path's: vdpbf16ps runs one fp32 FMA chain per output, a pair's odd product first (SDM;
 * measured on AMD Zen 4 and on an Intel Xeon), while TDPBF16PS follows neither that nor the SDM's
 * even-first chain on the hardware (an Intel Xeon, tests/test_amx.py; docs/amx.md) — so once a
 * process turns AMX on, every bf16 linear of every row count takes it: weights in the packed layout
 * directly, quantized weights decoded into tiles of that layout (grouped blocks by the same vector
 * decoder as the 1-4 row path, one 1 KB tile at a time just before the tiles read it, or a panel
 * once for calls of many rows; other formats by decode_panel), or — 4-bit blocks, calls of up to 64
 * rows — looked up per column into tiles of the first operand (A4, below) — the same bf16 values, so
 * the same bits as their bf16 copy's.
 *
 * Linux gives a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM): d3d_amx(1)
 * asks, and the path is on only if the CPU reports AMX-BF16 and the kernel grants it. Built with
 * -DD3D_AMX_EMULATE, the tile operations are plain C following the SDM's pseudo-code (row by row,
 * k pair by k pair, fp32 FMAs, denormals flushed), so that this file's indexing, tails and
 * threading are tested on machines without AMX (tests/test_amx.py).
 * ------------------------------------------------------------------------------------------- */

#if defined(D3D_AVX512_BF16) && (defined(D3D_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_BF16__)))
#define D3D_AMX 1
#endif

#ifdef D3D_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_K 32  /* k values per tile step: a 64-byte tile row of bf16 */
#define AMX_ROWS 16  /* rows of a tile */
#ifndef AMX_GROUPED_ROWS
#define AMX_GROUPED_ROWS 32  /* calls of up to this many rows decode grouped blocks (more: the bf16 values) */
#endif
#define AMX_AHEAD 4  /* k steps ahead that a packed weight tile is prefetched into L2, for calls of several
                     * rows (Xeon, 2 cores, whole forwards over bf16 weights: 17 rows 15.8-16.2 ms against
                     * 17.2-17.6 without; one row 11.3-11.4 against 10.9-11.0: the hardware's own keeps up) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

#ifdef D3D_AMX_EMULATE
static __thread struct {
    amx_config config;
    uint8_t tile[8][AMX_ROWS][64];
} amx_emu;
static void amx_load_config(const amx_config *config) { amx_emu.config = *config; }
static void amx_release(void) { memset(&amx_emu.config, 0, sizeof amx_emu.config); }
static void amx_zero(int t) { memset(amx_emu.tile[t], 0, sizeof amx_emu.tile[t]); }
static void amx_load(int t, const void *base, int64_t stride) {
    amx_zero(t);
    for (int r = 0; r < amx_emu.config.rows[t]; r++)
        memcpy(amx_emu.tile[t][r], (const char *)base + r * stride, amx_emu.config.colsb[t]);
}
static void amx_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < amx_emu.config.rows[t]; r++)
        memcpy((char *)base + r * stride, amx_emu.tile[t][r], amx_emu.config.colsb[t]);
}
static float amx_flush(float v) { return fpclassify(v) == FP_SUBNORMAL ? copysignf(0.0f, v) : v; }
static float amx_bf16(const uint8_t *at) {
    uint16_t h;
    memcpy(&h, at, 2);
    return amx_flush(bf16_to_f32(h));
}
static void amx_dp(int c, int a, int b) {
    const amx_config *k = &amx_emu.config;
    for (int m = 0; m < k->rows[c]; m++)
        for (int n = 0; n < k->colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, amx_emu.tile[c][m] + 4 * n, 4);
            for (int p = 0; p < k->colsb[a] / 4; p++)
                for (int e = 0; e < 2; e++)
                    acc = amx_flush(fmaf(amx_bf16(amx_emu.tile[a][m] + 4 * p + 2 * e),
                                         amx_bf16(amx_emu.tile[b][p] + 4 * n + 2 * e), acc));
            memcpy(amx_emu.tile[c][m] + 4 * n, &acc, 4);
        }
}
#define TILE_LOAD(t, base, stride) amx_load(t, base, stride)
#define TILE_STORE(t, base, stride) amx_store(t, base, stride)
#define TILE_ZERO(t) amx_zero(t)
#define TILE_DP(c, a, b) amx_dp(c, a, b)
#else
#define amx_load_config(config) _tile_loadconfig(config)
#define amx_release() _tile_release()
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* Whether bf16 linears take the tiles: off until d3d_amx(1) succeeds; one choice for the process. */
static int amx_on;

/* The tiles of a block of rows: accumulators C[rt][g] = tmm(2 rt + g) for row tiles rt of r0 and r1
 * rows (r1 = 0: one row tile) and two column groups; x's row tiles in tmm4, tmm5; the groups'
 * weights in tmm6, tmm7. `*state` remembers the thread's configuration (0: none yet). */
static inline void amx_configure(int r0, int r1, int *state) {
    if (*state == r0 * 64 + r1 + 1) return;
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, AMX_ROWS, AMX_ROWS};
    for (int t = 0; t < 8; t++) config.rows[t] = (uint8_t)rows[t], config.colsb[t] = rows[t] ? 64 : 0;
    amx_load_config(&config);
    *state = r0 * 64 + r1 + 1;
}

/* The weights of k step i (32 values of k) of group g as one tile (16 k pairs x 16 columns, 1 KB):
 * in place in a packed panel, or — from grouped blocks — decoded into `buf` as the 1-4 row path
 * decodes them (grouped_pair), just before the tiles read it, so it is read from L1. */
static inline __attribute__((always_inline)) const uint16_t *amx_weight_tile(
        const uint16_t *tile_w, const d3d_part *grouped, int64_t g, int64_t i, int64_t K, uint16_t *buf, int ahead) {
    if (!grouped) {
        const uint16_t *at = tile_w + g * 16 * K + i * 16 * AMX_K;
        if (ahead)  /* the same group's tile AMX_AHEAD steps on */
            for (int line = 0; line < 16; line++) __builtin_prefetch(at + AMX_AHEAD * 16 * AMX_K + line * 32, 0, 2);
        return at;
    }
    int g4 = grouped->format == D3D_G4;
    int64_t size = g4 ? (int64_t)sizeof(block_g4) : (int64_t)sizeof(block_g8);
    const char *at = (const char *)grouped->data + (g * (K / CHUNK) + i) * size;
    for (int64_t line = 0; line < size; line += 64) __builtin_prefetch(at + GROUPED_AHEAD * size + line, 0, 2);
    __m512 s0, s1, o0, o1;
    grouped_scales(at, g4, &s0, &s1, &o0, &o1);
    for (int p = 0; p < 16; p++) _mm512_store_si512(buf + p * 32, (__m512i)grouped_pair(at, p, g4, s0, s1, o0, o1));
    return buf;
}

/* Every row over the G ≤ GROUPS groups g0 … (columns from 16·g0): two groups and up to 32 rows (two
 * row tiles) at a time, each output zeroed, then one TDPBF16PS per k step, then stored by
 * store16_bf16 (+ bias, rounded, + residual, rounded: the packed path's rule). The weights come from
 * `tile_w` (packed layout, the G groups from tile_w on) or, with `grouped`, from its groups g0 …
 * decoded tile by tile (callers pass M ≤ 32 then: one pass of rows, each block decoded once). */
static void amx_block(const uint16_t *x, int64_t x_stride, const uint16_t *tile_w, const d3d_part *grouped,
                      int64_t g0, int G, const uint16_t *bias, const uint16_t *residual, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int *state) {
    int64_t steps = K / AMX_K, row_bytes = x_stride * 2;
    float out[2 * AMX_ROWS][2][16];
    uint16_t buf[2][2][16 * AMX_K] __attribute__((aligned(64)));  /* [group][step parity] */
    for (int gp = 0; gp < G; gp += 2) {
        int GG = G - gp < 2 ? G - gp : 2;
        int64_t ga = grouped ? g0 + gp : gp, gb = ga + 1;
        for (int64_t m0 = 0; m0 < M; m0 += 2 * AMX_ROWS) {
            int r0 = M - m0 < AMX_ROWS ? (int)(M - m0) : AMX_ROWS;
            int r1 = M - m0 - r0 < AMX_ROWS ? (int)(M - m0 - r0) : AMX_ROWS;
            amx_configure(r0, r1, state);
            const uint16_t *x0 = x + m0 * x_stride, *x1 = x0 + AMX_ROWS * x_stride;
            TILE_ZERO(0);
            TILE_ZERO(1);
            if (r1) {
                TILE_ZERO(2);
                TILE_ZERO(3);
            }
            for (int64_t i = 0; i < steps; i++) {
                TILE_LOAD(4, x0 + i * AMX_K, row_bytes);
                TILE_LOAD(6, amx_weight_tile(tile_w, grouped, ga, i, K, buf[0][i & 1], M > 1), 64);
                TILE_DP(0, 4, 6);
                if (r1) {
                    TILE_LOAD(5, x1 + i * AMX_K, row_bytes);
                    TILE_DP(2, 5, 6);
                }
                if (GG > 1) {
                    TILE_LOAD(7, amx_weight_tile(tile_w, grouped, gb, i, K, buf[1][i & 1], M > 1), 64);
                    TILE_DP(1, 4, 7);
                    if (r1) TILE_DP(3, 5, 7);
                }
            }
            TILE_STORE(0, out[0][0], sizeof out[0]);
            if (GG > 1) TILE_STORE(1, out[0][1], sizeof out[0]);
            if (r1) {
                TILE_STORE(2, out[AMX_ROWS][0], sizeof out[0]);
                if (GG > 1) TILE_STORE(3, out[AMX_ROWS][1], sizeof out[0]);
            }
            for (int r = 0; r < r0 + r1; r++)
                for (int g = 0; g < GG; g++) {
                    int64_t n = (g0 + gp + g) * 16, at = (m0 + r) * N + n;
                    store16_bf16(_mm512_loadu_ps(out[r][g]), bias ? bias + n : 0, residual ? residual + at : 0,
                                 y + at, N - n < 16 ? (int)(N - n) : 16);
                }
        }
    }
}

/* panel[g][k/2][j][k%2] for the G groups g0 … of a grouped weight: each pair vector decoded as the
 * 1-4 row path decodes it (grouped_pair), stored in the packed layout. */
static void grouped_panel(const d3d_part *grouped, int64_t g0, int G, int64_t K, uint16_t *panel) {
    int64_t blocks = K / CHUNK, g4 = grouped->format == D3D_G4;
    int64_t size = g4 ? (int64_t)sizeof(block_g4) : (int64_t)sizeof(block_g8);
    for (int g = 0; g < G; g++)
        for (int64_t b = 0; b < blocks; b++) {
            const char *at = (const char *)grouped->data + ((g0 + g) * blocks + b) * size;
            __m512 s0, s1, o0, o1;
            grouped_scales(at, (int)g4, &s0, &s1, &o0, &o1);
            uint16_t *to = panel + g * 16 * K + b * 16 * CHUNK;
            for (int p = 0; p < 16; p++)
                _mm512_storeu_si512(to + p * 32, (__m512i)grouped_pair(at, p, (int)g4, s0, s1, o0, o1));
        }
}

/* ---------------------------------------------------------------------------------------------
 * Q4 blocks as the tiles' first operand (formats.h's A4): each column's 32 weights decode as a lookup in
 * its block's table (linear.h's lookup_block, about half the vector operations of grouped_pair), which
 * needs the weights of a tile row to share a column: so the weight tile is the first operand (16
 * columns x 32 k) and x's rows, as k pairs, the second (16 pairs x up to 16 rows), giving each output
 * (column, row) from the same pair products in the same order as the weights-second form — the
 * products commute, and the hardware gives the same bits either way round (docs/amx.md; tests/test_amx.py compares every
 * row count's rows with the row alone, across the two forms).
 * ------------------------------------------------------------------------------------------- */
#if defined(__AVX512VBMI__)
#define AMX_A4 1
#define A4_AHEAD 12288  /* bytes ahead in a thread's stream prefetched into L2 (Xeon, 2 threads, the
                         * model's 120 Q4 matrices: none or 1.5 KB ahead ~13 GB/s, 6-12 KB ~15-16) */

/* One weight tile: the 16 columns' blocks from `at` on, each a 64-byte row of 32 bf16 values in k order. */
static inline __attribute__((always_inline)) void a4_tile(const block_u4 *at, __m512i control, uint16_t *buf) {
    const __m512 codes = lookup_codes();
    for (int j = 0; j < 16; j++) _mm512_store_si512(buf + 32 * j, (__m512i)lookup_block(&at[j], control, codes));
}

/* Block b of the 16-column group g of an A4 weight: groups go in quads of 4 (64 columns; the last
 * quad as many as remain), each quad block by block, so that a thread's run of groups is one stream
 * through memory (linear.h's looked_up_at). */
static inline const block_u4 *a4_at(const void *data, int64_t g, int64_t b, int64_t groups, int64_t blocks) {
    return looked_up_at(data, g, b, groups, blocks, 4);
}

/* a4_at, with the stream A4_AHEAD bytes on prefetched into L2. */
static inline __attribute__((always_inline)) const block_u4 *a4_next(const void *data, int64_t g, int64_t b,
                                                                     int64_t groups, int64_t blocks) {
    const block_u4 *at = a4_at(data, g, b, groups, blocks);
    for (int line = 0; line < 16 * (int)sizeof(block_u4); line += 64) _mm_prefetch((const char *)at + A4_AHEAD + line, _MM_HINT_T1);
    return at;
}

/* Bytes of the A4 copy of a U4 weight (N, K), and with `out` the copy (columns past N zero). */
static int64_t a4_pack(const d3d_weight *w, int64_t N, int64_t K, void *out) { return looked_up_pack(w, N, K, out, 4); }

#define AMX_A4_ROWS 64  /* calls of up to this many rows decode A4 blocks (more: the bf16 values) */

/* Tiles of the weights-first form, for RT row tiles of 16 rows (the last one `last` rows): the
 * accumulators C[rt][g] = tmm(rt·GP + g) (16 columns x the tile's rows; GP = 4 groups for one row
 * tile, 2 for two, 1 for three or four); x's k pairs in tmm4 (full row tiles) and tmm5 (the last);
 * the weights in tmm6, tmm7. */
static inline void amx_configure_a4(int RT, int last, int *state) {
    int key = 4096 + RT * 64 + last;
    if (*state == key) return;
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    int GP = RT == 1 ? 4 : RT == 2 ? 2 : 1;
    for (int t = 0; t < 4; t++) {  /* all four, so that each can be zeroed (unused ones: one column) */
        int rows = t >= RT * GP ? 1 : t / GP == RT - 1 ? last : AMX_ROWS;
        config.rows[t] = AMX_ROWS, config.colsb[t] = (uint16_t)(4 * rows);
    }
    if (RT > 1) config.rows[4] = AMX_ROWS, config.colsb[4] = 4 * AMX_ROWS;
    config.rows[5] = AMX_ROWS, config.colsb[5] = (uint16_t)(4 * last);
    for (int t = 6; t < 8; t++) config.rows[t] = AMX_ROWS, config.colsb[t] = 64;
    amx_load_config(&config);
    *state = key;
}

/* tmm(c) += tmm(a) · tmm(b) for a run-time c < 4 (tile numbers are immediates). */
#define A4_DP(c, a, b) do { switch (c) { case 0: TILE_DP(0, a, b); break; case 1: TILE_DP(1, a, b); break; \
                                          case 2: TILE_DP(2, a, b); break; default: TILE_DP(3, a, b); } } while (0)

/* Every row (M ≤ AMX_A4_ROWS) over an A4 weight: this thread's groups in passes of up to GP within a
 * quad; per k step each group's tile decoded once (a4_tile) and multiplied by every row tile; each
 * output zeroed, fed one TDPBF16PS per k step in k order, stored by store16_bf16 as the other forms. */
static void amx_a4_body(const uint16_t *x, int64_t x_stride, const d3d_part *a4, const uint16_t *bias,
                        const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K, float *scratch) {
    int64_t groups = (N + 15) / 16, blocks = K / CHUNK, threads = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t first = groups * me / threads, last = groups * (me + 1) / threads;
    int RT = (int)((M + AMX_ROWS - 1) / AMX_ROWS), tail = (int)(M - (RT - 1) * AMX_ROWS);
    int GP = RT == 1 ? 4 : RT == 2 ? 2 : 1;
    /* x as k pairs: pairs[rt][i][p][m] = x[16 rt + m][32 i + 2p … + 1] (one 32-bit pair) */
    float *pairs = scratch + me * (GROUPS * 16 * K / 2);
    if (M == 1) pairs = (float *)x;  /* already in that order (row stride 4 bytes) */
    else
        for (int rt = 0; rt < RT; rt++)
            for (int64_t kp = 0; kp < K / 2; kp += 16) {  /* K / 2 is a multiple of 16 (K % AMX_K == 0) */
                __m512 rows_[AMX_ROWS], moved[AMX_ROWS];
                for (int m = 0; m < AMX_ROWS; m++)
                    rows_[m] = m < (rt == RT - 1 ? tail : AMX_ROWS)
                                   ? _mm512_loadu_ps(x + (rt * AMX_ROWS + m) * x_stride + 2 * kp) : _mm512_setzero_ps();
                transpose16(rows_, moved);
                for (int j = 0; j < 16; j++) _mm512_store_ps(pairs + (rt * (K / 2) + kp + j) * AMX_ROWS, moved[j]);
            }
    const __m512i control = lookup_control();
    uint16_t buf[2][16 * AMX_K] __attribute__((aligned(64)));
    float out[AMX_ROWS][AMX_ROWS] __attribute__((aligned(64)));
    int state = 0;
    for (int64_t g0 = first, g1; g0 < last; g0 = g1) {
        g1 = g0 + GP < (g0 / 4 + 1) * 4 ? g0 + GP : (g0 / 4 + 1) * 4;
        if (g1 > last) g1 = last;
        int G = (int)(g1 - g0);
        amx_configure_a4(RT, tail, &state);
        TILE_ZERO(0);
        TILE_ZERO(1);
        TILE_ZERO(2);
        TILE_ZERO(3);
        if (RT > 2)  /* one group a pass: its tile decoded once a k step, each row tile's pairs loaded in turn */
            for (int64_t i = 0; i < blocks; i++) {
                a4_tile(a4_next(a4->data, g0, i, groups, blocks), control, buf[0]);
                TILE_LOAD(6, buf[0], 64);
                for (int rt = 0; rt < RT; rt++) {
                    const float *at = pairs + (rt * (K / 2) + i * 16) * AMX_ROWS;
                    if (rt < RT - 1) {
                        TILE_LOAD(4, at, 4 * AMX_ROWS);
                        A4_DP(rt, 6, 4);
                    } else {
                        TILE_LOAD(5, at, 4 * AMX_ROWS);
                        A4_DP(rt, 6, 5);
                    }
                }
            }
        else
            for (int64_t i = 0; i < blocks; i++) {  /* the row tiles' pairs stay loaded for every group */
                if (RT == 2) TILE_LOAD(4, pairs + i * 16 * AMX_ROWS, 4 * AMX_ROWS);
                if (M == 1) TILE_LOAD(5, pairs + i * 16, 4);
                else TILE_LOAD(5, pairs + ((RT - 1) * (K / 2) + i * 16) * AMX_ROWS, 4 * AMX_ROWS);
                for (int g = 0; g < G; g++) {
                    a4_tile(a4_next(a4->data, g0 + g, i, groups, blocks), control, buf[g & 1]);
                    switch (g) {  /* one row tile (pairs in tmm5): C = g; two (tmm4, tmm5): C = g, 2 + g */
                        case 0: TILE_LOAD(6, buf[0], 64); if (RT == 2) { TILE_DP(0, 6, 4); TILE_DP(2, 6, 5); } else TILE_DP(0, 6, 5); break;
                        case 1: TILE_LOAD(7, buf[1], 64); if (RT == 2) { TILE_DP(1, 7, 4); TILE_DP(3, 7, 5); } else TILE_DP(1, 7, 5); break;
                        case 2: TILE_LOAD(6, buf[0], 64); TILE_DP(2, 6, 5); break;
                        default: TILE_LOAD(7, buf[1], 64); TILE_DP(3, 7, 5); break;
                    }
                }
            }
        for (int rt = 0; rt < RT; rt++)
            for (int g = 0; g < G; g++) {
                int rows = rt == RT - 1 ? tail : AMX_ROWS;
                int64_t stride = rows == 1 ? 4 : sizeof out[0];  /* one row: its 16 columns side by side */
                switch (rt * GP + g) {  /* tile numbers are immediates */
                    case 0: TILE_STORE(0, out, stride); break;
                    case 1: TILE_STORE(1, out, stride); break;
                    case 2: TILE_STORE(2, out, stride); break;
                    default: TILE_STORE(3, out, stride); break;
                }
                __m512 row[AMX_ROWS];
                if (rows == 1) row[0] = _mm512_load_ps(out[0]);
                else {
                    __m512 column[AMX_ROWS];
                    for (int c = 0; c < AMX_ROWS; c++) column[c] = _mm512_load_ps(out[c]);
                    transpose16(column, row);
                }
                int64_t n = (g0 + g) * 16;
                for (int r = 0; r < rows; r++) {
                    int64_t at = (rt * AMX_ROWS + r) * N + n;
                    store16_bf16(row[r], bias ? bias + n : 0, residual ? residual + at : 0, y + at, N - n < 16 ? (int)(N - n) : 16);
                }
            }
    }
    if (state) amx_release();
    _Pragma("omp barrier")
}
#endif

/* Threads own runs of 16-column groups, as the packed path's; each run goes in blocks of up to
 * GROUPS groups, read from `packed` or decoded into this thread's panel (from `grouped` blocks, or
 * any quantized `w` by decode_panel). */
static void amx_bf16_body(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const d3d_part *grouped,
                          const d3d_weight *w, const uint16_t *bias, const uint16_t *residual, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, float *scratch) {
    int64_t groups = (N + 15) / 16, threads = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t first = groups * me / threads, last = groups * (me + 1) / threads;
    uint16_t *panel = (uint16_t *)(scratch + me * (GROUPS * 16 * K / 2));
    int state = 0;
    for (int64_t g0 = first; g0 < last; g0 += GROUPS) {
        int G = last - g0 < GROUPS ? (int)(last - g0) : GROUPS;
        if (grouped && M <= 2 * AMX_ROWS) {  /* one pass of rows: each block decoded once, into L1 */
            amx_block(x, x_stride, NULL, grouped, g0, G, bias, residual, y, M, N, K, &state);
            continue;
        }
        const uint16_t *tile_w = panel;
        if (packed) tile_w = packed + g0 * 16 * K;
        else if (grouped) grouped_panel(grouped, g0, G, K, panel);
        else decode_panel(w, g0, G, N, K, panel);
        amx_block(x, x_stride, tile_w, NULL, g0, G, bias, residual, y, M, N, K, &state);
    }
    if (state) amx_release();
    _Pragma("omp barrier")
}

/* The AMX linear for `w`, or 0 where it does not take one (AMX off, or K not whole tile steps: then
 * the weight takes its AVX-512 path at every row count). */
static int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const d3d_weight *w, const uint16_t *bias,
                           const uint16_t *residual, uint16_t *y, int64_t M, int64_t N, int64_t K, float *scratch) {
    if (!amx_on || K % AMX_K) return 0;
    int64_t format = w->parts[0].format;
    if (format == D3D_PACKED)
        amx_bf16_body(x, x_stride, w->parts[0].data, NULL, NULL, bias, residual, y, M, N, K, scratch);
    else if (!is_quantized(format))
        return 0;
#ifdef AMX_A4
    else if (M <= AMX_A4_ROWS && w->grouped.data && w->grouped.format == D3D_A4)
        amx_a4_body(x, x_stride, &w->grouped, bias, residual, y, M, N, K, scratch);
#endif
    else if (M <= AMX_GROUPED_ROWS && w->grouped.data)  /* a third of the bytes of the bf16 values */
        amx_bf16_body(x, x_stride, NULL, &w->grouped, NULL, bias, residual, y, M, N, K, scratch);
    else if (w->dense.data)
        amx_bf16_body(x, x_stride, w->dense.data, NULL, NULL, bias, residual, y, M, N, K, scratch);
    else
        amx_bf16_body(x, x_stride, NULL, NULL, w, bias, residual, y, M, N, K, scratch);
    return 1;
}

static int amx_cpu(void) {
#ifdef D3D_AMX_EMULATE
    return 1;
#else
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (d >> 22 & 1) && (d >> 24 & 1);  /* AMX-BF16, AMX-TILE */
#endif
}
#endif

/* Turn the AMX path on (1) or off (0) for this process; returns whether it is on. On needs a build
 * with AMX, a CPU that reports AMX-BF16 and the tile state granted by Linux. */
int d3d_amx(int on) {
#ifdef D3D_AMX
    if (!on || !amx_cpu()) return amx_on = 0;
#ifndef D3D_AMX_EMULATE
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return amx_on = 0;
#endif
    return amx_on = 1;
#else
    (void)on;
    return 0;
#endif
}
