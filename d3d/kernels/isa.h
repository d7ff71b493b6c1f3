/* The instruction sets the kernels use, and the vector primitives of each, defined once.
 *
 * D3D_AVX512_BF16: AVX-512 with BF16 pair dot products (Zen 4, Sapphire Rapids and later) — the
 *   packed linear paths (linear.h) and the 16-lane attention use the intrinsics directly;
 * D3D_AVX2: AVX2 with FMA (every x86-64 CPU since 2013, AVX-512 ones included) — the lanes paths
 *   and the decoders of quantized weights, written with the v8 primitives below;
 * neither: portable C the compiler vectorises as it can.
 * (D3D_AMX, Intel's AMX tiles for the bf16 linear on top of AVX-512 BF16, is amx.h's own.)
 * Every primitive is one IEEE operation per lane (or a pure bit move), so code written with them
 * computes what the portable C next to it computes, bit for bit.
 */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define D3D_AVX512_BF16 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define D3D_AVX2 1
/* ---- AVX2 primitives: 8 fp32 lanes ---- */
typedef __m256 v8;
#define v8_zero() _mm256_setzero_ps()
#define v8_load(p) _mm256_loadu_ps(p)
#define v8_store(p, v) _mm256_storeu_ps(p, v)
#define v8_fma(a, b, acc) _mm256_fmadd_ps(a, b, acc)  /* a·b + acc, one rounding */
#define v8_splat(p) _mm256_broadcast_ss(p)
static inline __attribute__((always_inline)) v8 v8_round_bf16(v8 v) {  /* Veltkamp: nearest-even bf16 values (formats.h) */
    v8 c = _mm256_mul_ps(v, _mm256_set1_ps(65537.0f));
    return _mm256_sub_ps(c, _mm256_sub_ps(c, v));
}
static inline __attribute__((always_inline)) v8 v8_from_bf16(const uint16_t *p) {  /* 8 bf16, widened */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __attribute__((always_inline)) __m256i v8_bf16_bits(v8 f) {  /* f32_to_bf16, in the low halves */
    __m256i u = _mm256_castps_si256(f);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}
static inline __attribute__((always_inline)) void v8_store_bf16(uint16_t *y, v8 f) {  /* 8 f32_to_bf16 stores */
    __m256i bits = v8_bf16_bits(f);
    _mm_storeu_si128((__m128i *)y, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
static inline __attribute__((always_inline)) __m256i v8_bytes(const uint8_t *p) {  /* 8 bytes, zero-extended */
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* A load (8 floats; one float broadcast) into a register of its own, each time it is written: GCC
 * otherwise folds a vector used by several FMAs into each of them as a memory operand (more loads than
 * the ports take) or keeps a broadcast live across loops that need the register (spilled accumulators,
 * each FMA then waiting on a store and a load). The same value either way. */
#if defined(__GNUC__) && defined(__x86_64__)
static inline __attribute__((always_inline)) v8 v8_load_reg(const float *p) {
    v8 x;
    __asm__ volatile("vmovups %1, %0" : "=x"(x) : "m"(*(const float (*)[8])p));
    return x;
}
static inline __attribute__((always_inline)) v8 v8_splat_reg(const float *p) {
    v8 x;
    __asm__ volatile("vbroadcastss %1, %0" : "=x"(x) : "m"(*p));
    return x;
}
#else
#define v8_load_reg(p) v8_load(p)
#define v8_splat_reg(p) v8_splat(p)
#endif
#endif
