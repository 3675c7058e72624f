/* cpu_varlen_math.h: the fp32 arithmetic of cpu_varlen.c, none of it about caches or items.
 *
 * One vector type `vf` of VW fp32 lanes (16 with AVX-512, else 8; GCC vector extensions, so
 * other CPUs get plain loops), K/V loads converting bf16 / fp16 to fp32 in registers, the
 * transpose-reduction of VW partial dot products into one vector of VW scores, exp and tanh
 * on VW lanes. Included by cpu_varlen.c only (native.py hashes both files into the build's key).
 */
#ifndef VK_CPU_VARLEN_MATH_H
#define VK_CPU_VARLEN_MATH_H
#include <float.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__AVX__) || defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif
/* K/V dtypes; the 8-bit ones are read unscaled here (the per-head scales are folded into the
 * queries and the outputs by cpu_varlen.c). DT_E4M3_FINITE is internal (never passed in): e4m3
 * read without turning 0x7F / 0xFF into NaN, by a walk that checks its rows for those bytes. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_E4M3 = 3, DT_E5M2 = 4, DT_I8 = 5, DT_E4M3_FINITE = 6 };

#ifndef VW         /* -DVW=8 or 16 forces a width (the tests build the one the CPU does not) */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#endif
/* fp8 read by table (fp8_table) with AVX-512 VBMI's byte permutes and 16 lanes, unless the
 * build says to do without (-DVK_NO_VBMI: what an AVX-512 CPU without it runs, built by the
 * tests) */
#if VW == 16 && defined(__AVX512VBMI__) && !defined(VK_NO_VBMI)
#define FP8_BY_TABLE 1
#else
#define FP8_BY_TABLE 0
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint16_t vhu __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint8_t vbu __attribute__((vector_size(VW), aligned(1)));
typedef int8_t vsbu __attribute__((vector_size(VW), aligned(1)));
#define ALWAYS inline __attribute__((always_inline))

static inline float half_to_float(uint16_t h) {
#ifdef __FLT16_MAX__
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { exp = 113; while (!(man & 0x400)) { man <<= 1; exp--; } bits = sign | (exp << 23) | ((man & 0x3ff) << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

/* x in every lane: one vbroadcastss (GCC compiles `(vf){0} + x` as a scalar add first, since
 * 0 + -0 is +0: measured 4% of an 8-bit decode) */
static ALWAYS vf splat(float x) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif VW == 8 && defined(__AVX__)
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){0} + x;
#endif
}
static ALWAYS vf ldf(const float *p) { return *(const vfu *)p; }
static ALWAYS void stf(float *p, vf x) { *(vfu *)p = x; }

/* x, held in a register from here on. GCC otherwise folds a load into every FMA that uses the
 * value: a query vector the scoring uses for two keys was loaded twice, 512 vector loads for
 * the 512 FMAs of a token row, and the loads, not the FMAs, bounded the loop (measured: an
 * e4m3 decode 8% faster in cache with the query loaded once; docs/benchmarks.md, issue 30). */
#if defined(__x86_64__) && ((VW == 8 && defined(__AVX__)) || (VW == 16 && defined(__AVX512F__)))   /* one register */
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

/* bytes of one K/V element of dtype dt */
static ALWAYS int64_t kv_bytes(int dt) { return dt == DT_F32 ? 4 : dt <= DT_F16 ? 2 : 1; }

/* VW fp16 bit patterns as fp32 (F16C where the CPU has it) */
static ALWAYS vf half_vec(vh h) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps((__m256i)h);
#elif VW == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps((__m128i)h);
#else
    vf out;
    for (int t = 0; t < VW; t++) out[t] = half_to_float(h[t]);
    return out;
#endif
}

/* VW signed bytes at p widened to 32-bit lanes: one vpmovsxbd where the CPU has it (GCC
 * scalarises a convertvector from 8-bit lanes: measured 3.3x slower) */
static ALWAYS vi widen_s8(const int8_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VW == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vsbu *)p, vi);
#endif
}

/* VW e4m3fn bytes at p as fp32 times 2^-8 (E4M3_SCALE undoes it: cpu_varlen.c folds it into
 * the scales), exactly: each byte sign-extended to 16 bits and shifted left 7 is an fp16 bit
 * pattern once bit 14 is cleared (sign at 15, exponent and mantissa at 13..7: the fp16 value is
 * the e4m3 value / 2^8, subnormals included), converted by F16C; 0x7F / 0xFF (the only NaNs)
 * to NaN. Three integer operations on 16-bit lanes, then the hardware conversion. */
#define E4M3_SCALE 256.0f
static ALWAYS vh e4m3_half_bits(const int8_t *p) {
#if VW == 16 && defined(__AVX512F__)
    const vh s = (vh)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
#elif VW == 8 && defined(__AVX2__)
    const vh s = (vh)_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
#else
    typedef int16_t vs16 __attribute__((vector_size(VW * 2)));
    const vh s = (vh)__builtin_convertvector(*(const vsbu *)p, vs16);
#endif
    return (s << 7) & 0xBF80;
}
#if FP8_BY_TABLE
/* fp8 by table (AVX-512 VBMI): the fp32 of every fp8 byte (e4m3fn's value / 2^8, as e4m3_vec;
 * e5m2's value) has zero low 16 bits, so its top two bytes say it all. Two 128-entry byte
 * tables give them for the byte's magnitude (vpermi2b: 64 bytes a lookup), the sign is merged
 * into the top byte, and one zero-masked vpermi2b places each element's two bytes in its fp32
 * lane: seven operations for 64 elements (F16C takes ten for e4m3, plus two for its NaN watch,
 * and twelve for e5m2), exact for every byte, NaN and e5m2's infinities included.
 * Sixty-four elements at a time (ld_kv4) are placed by byte and word interleaves instead, which
 * leave the elements in the order FP8_BLOCKS says: on Zen 5 vpermi2b takes pipes the FMAs need
 * (decode_floor's pipes line: 16 FMAs with 8 vpermi2b beside them take 1.5x their time alone,
 * with 8 interleaves 1.00x), and an fp8 decode is bound by its arithmetic. An e4m3 decode is
 * 1.07x faster so in cache, 1.04-1.05x from memory (decode_profile, alternated; issue 30).
 * TOP[m] and NEXT[m] are bits 31..24 and 23..16 of the fp32 of magnitude m: e4m3 (E = m >> 3,
 * M = m & 7) M 2^-9 for E = 0, NaN for m = 0x7F, else (1 + M/8) 2^(E-7), all / 2^8; e5m2
 * (E = m >> 2, M = m & 3) M 2^-16 for E = 0, inf (M = 0) or NaN for E = 31, else
 * (1 + M/4) 2^(E-15). FP8_PLACE[k] picks, for fp32 lane i of the k-th 16 elements, byte
 * 16k + i of NEXT into byte 2 and of TOP into byte 3 (bytes 0 and 1 zeroed by the mask). */
/* FP8_BLOCKS: the order of 64 elements that ld_kv4 gives for fp8 by table. Seen as a 4 x 4 grid
 * of 4-element groups (vector k, 128-bit lane L), vector k lane L holds the group that vector L
 * lane k holds in memory order: the grid transposed, so fp8_transpose_blocks turns either order
 * into the other. The decode walk puts its queries in that order before it scores (the dot
 * products are the same sums) and its accumulators back after its values (cpu_varlen_tile.h). */
static const uint8_t E4M3_TOP[128] __attribute__((aligned(64))) = {
    0x00, 0x37, 0x37, 0x37, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38,
    0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39,
    0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A,
    0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B,
    0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C,
    0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D,
    0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E,
    0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x7F};
static const uint8_t E4M3_NEXT[128] __attribute__((aligned(64))) = {
    0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xC0};
static const uint8_t E5M2_TOP[128] __attribute__((aligned(64))) = {
    0x00, 0x37, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39,
    0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B,
    0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D,
    0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43,
    0x44, 0x44, 0x44, 0x44, 0x44, 0x44, 0x44, 0x44, 0x45, 0x45, 0x45, 0x45, 0x45, 0x45, 0x45, 0x45,
    0x46, 0x46, 0x46, 0x46, 0x46, 0x46, 0x46, 0x46, 0x47, 0x47, 0x47, 0x47, 0x7F, 0x7F, 0x7F, 0x7F};
static const uint8_t E5M2_NEXT[128] __attribute__((aligned(64))) = {
    0x00, 0x80, 0x00, 0x40, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0,
    0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0,
    0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0,
    0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0,
    0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0,
    0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0,
    0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0,
    0x00, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0, 0x00, 0x20, 0x40, 0x60, 0x80, 0xC0, 0xC0, 0xC0};
static const uint8_t FP8_PLACE[2 * 64] __attribute__((aligned(64))) = {
    0, 0, 0, 64, 0, 0, 1, 65, 0, 0, 2, 66, 0, 0, 3, 67, 0, 0, 4, 68, 0, 0, 5, 69, 0, 0, 6, 70, 0, 0, 7, 71,
    0, 0, 8, 72, 0, 0, 9, 73, 0, 0, 10, 74, 0, 0, 11, 75, 0, 0, 12, 76, 0, 0, 13, 77, 0, 0, 14, 78, 0, 0, 15, 79,
    0, 0, 16, 80, 0, 0, 17, 81, 0, 0, 18, 82, 0, 0, 19, 83, 0, 0, 20, 84, 0, 0, 21, 85, 0, 0, 22, 86, 0, 0, 23, 87,
    0, 0, 24, 88, 0, 0, 25, 89, 0, 0, 26, 90, 0, 0, 27, 91, 0, 0, 28, 92, 0, 0, 29, 93, 0, 0, 30, 94, 0, 0, 31, 95};
/* N (1, 2 or 4) vectors of 16 fp8 elements at p (e4m3 for dt DT_E4M3, else e5m2) as fp32 into
 * out[0:N], in memory order for N < 4, in FP8_BLOCKS order for N == 4 */
static ALWAYS void fp8_table(const int8_t *p, const int N, const int dt, vf *out) {
    const uint8_t *top_table = dt == DT_E4M3 ? E4M3_TOP : E5M2_TOP;
    const uint8_t *next_table = dt == DT_E4M3 ? E4M3_NEXT : E5M2_NEXT;
    /* (a narrower load leaves the upper bytes undefined: looked up, never placed) */
    const __m512i x = N == 4 ? _mm512_loadu_si512(p)
                    : N == 2 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p))
                    : _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    const __m512i top = _mm512_ternarylogic_epi32(
        _mm512_permutex2var_epi8(_mm512_load_si512(top_table), x, _mm512_load_si512(top_table + 64)),
        x, _mm512_set1_epi8((char)0x80), 0xF8);   /* table | (x & 0x80) */
    const __m512i next = _mm512_permutex2var_epi8(_mm512_load_si512(next_table), x,
                                                  _mm512_load_si512(next_table + 64));
    if (N == 4) {   /* (NEXT, TOP) byte pairs: bf16 bit patterns; then each as an fp32's top half */
        const __m512i lo = _mm512_unpacklo_epi8(next, top), hi = _mm512_unpackhi_epi8(next, top);
        const __m512i zero = _mm512_setzero_si512();
        out[0] = (vf)_mm512_unpacklo_epi16(zero, lo);
        out[1] = (vf)_mm512_unpackhi_epi16(zero, lo);
        out[2] = (vf)_mm512_unpacklo_epi16(zero, hi);
        out[3] = (vf)_mm512_unpackhi_epi16(zero, hi);
        return;
    }
    for (int k = 0; k < N; k++)
        out[k] = (vf)_mm512_maskz_permutex2var_epi8(0xCCCCCCCCCCCCCCCCull, next,
                                                    _mm512_load_si512(FP8_PLACE + 64 * k), top);
}

/* Each of the n rows of D floats at x (row stride D), its whole blocks of 64 floats from memory
 * order to FP8_BLOCKS order or back (the same transposition) */
static void fp8_transpose_blocks(float *x, int64_t n, int64_t D) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b + 64 <= D; b += 64) {
            float *blk = x + r * D + b;
            const __m512 a0 = _mm512_loadu_ps(blk), a1 = _mm512_loadu_ps(blk + 16);
            const __m512 a2 = _mm512_loadu_ps(blk + 32), a3 = _mm512_loadu_ps(blk + 48);
            const __m512 t0 = _mm512_shuffle_f32x4(a0, a1, 0x44), t1 = _mm512_shuffle_f32x4(a0, a1, 0xEE);
            const __m512 t2 = _mm512_shuffle_f32x4(a2, a3, 0x44), t3 = _mm512_shuffle_f32x4(a2, a3, 0xEE);
            _mm512_storeu_ps(blk, _mm512_shuffle_f32x4(t0, t2, 0x88));
            _mm512_storeu_ps(blk + 16, _mm512_shuffle_f32x4(t0, t2, 0xDD));
            _mm512_storeu_ps(blk + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
            _mm512_storeu_ps(blk + 48, _mm512_shuffle_f32x4(t1, t3, 0xDD));
        }
}
#endif

static ALWAYS vf e4m3_vec(const int8_t *p) {
#if FP8_BY_TABLE
    vf out;
    fp8_table(p, 1, DT_E4M3, &out);
    return out;
#else
    vh h = e4m3_half_bits(p);
    h |= (vh)((h & 0x3F80) == 0x3F80) & 0x7E00;
    return half_vec(h);
#endif
}

/* e4m3_vec without the NaN step: exact for every byte but 0x7F / 0xFF (read as +-1.875 / 2^8),
 * for walks that watch the bytes they read with nan_watch_bytes (the step was 13% of a decode) */
static ALWAYS vf e4m3_finite_vec(const int8_t *p) { return half_vec(e4m3_half_bits(p)); }

/* A watch for e4m3's NaN bytes, 0x7F and 0xFF: the largest signed and the largest unsigned
 * byte seen (127 and 255 are exactly those two), one vpmax each per 64 bytes with AVX-512 BW */
#if defined(__AVX512BW__)
typedef struct { __m512i smax, umax; } nan_watch;
static ALWAYS nan_watch nan_watch_new(void) { return (nan_watch){_mm512_set1_epi8(-128), _mm512_setzero_si512()}; }
static ALWAYS int nan_watch_seen(nan_watch t) {
    return (_mm512_cmpeq_epi8_mask(t.smax, _mm512_set1_epi8(127)) | _mm512_cmpeq_epi8_mask(t.umax, _mm512_set1_epi8(-1))) != 0;
}
#else
typedef struct { int seen; } nan_watch;
static ALWAYS nan_watch nan_watch_new(void) { return (nan_watch){0}; }
static ALWAYS int nan_watch_seen(nan_watch t) { return t.seen; }
#endif

/* the n bytes at p (n a multiple of VW) into the watch t */
static ALWAYS void nan_watch_bytes(nan_watch *t, const int8_t *p, int64_t n) {
    int64_t b = 0;
#if defined(__AVX512BW__)
    for (; b + 64 <= n; b += 64) {
        const __m512i x = _mm512_loadu_si512(p + b);
        t->smax = _mm512_max_epi8(t->smax, x);
        t->umax = _mm512_max_epu8(t->umax, x);
    }
    for (; b < n; b++) if (((uint8_t)p[b] | 0x80) == 0xFF) t->smax = _mm512_set1_epi8(127);
#else
    for (; b < n; b++) t->seen |= ((uint8_t)p[b] | 0x80) == 0xFF;
#endif
}

/* VW elements of a K or V row (dtype dt, a constant where it matters) at element offset off,
 * as fp32: bf16 is the top half of an fp32, fp16 goes through F16C where the CPU has it, e5m2
 * is the top byte of an fp16, e4m3 see e4m3_vec (times 2^-8), int8 converts (all exact). */
static ALWAYS vf ld_kv(const void *base, int64_t off, int dt) {
    if (dt == DT_F32) return ldf((const float *)base + off);
    if (dt == DT_E4M3) return e4m3_vec((const int8_t *)base + off);
    if (dt == DT_E4M3_FINITE) return e4m3_finite_vec((const int8_t *)base + off);
#if FP8_BY_TABLE
    if (dt == DT_E5M2) { vf out; fp8_table((const int8_t *)base + off, 1, DT_E5M2, &out); return out; }
#endif
    if (dt == DT_E5M2) return half_vec(__builtin_convertvector(*(const vbu *)((const uint8_t *)base + off), vh) << 8);
    if (dt == DT_I8) return __builtin_convertvector(widen_s8((const int8_t *)base + off), vf);
    const uint16_t *src = (const uint16_t *)base + off;
    if (dt == DT_BF16) return (vf)(__builtin_convertvector(*(const vhu *)src, vi) << 16);
    return half_vec(*(const vhu *)src);
}

/* 2 VW elements at off as fp32 into lo and hi: ld_kv twice, but fp8 by table from one load,
 * and finite e4m3 (no table) with AVX-512 BW widened 32 bytes in one register (three integer
 * operations for 32 lanes: measured 3%) */
static ALWAYS void ld_kv2(const void *base, int64_t off, int dt, vf *lo, vf *hi) {
#if FP8_BY_TABLE
    if (dt == DT_E4M3 || dt == DT_E5M2) {
        vf two[2];
        fp8_table((const int8_t *)base + off, 2, dt, two);
        *lo = two[0]; *hi = two[1];
        return;
    }
#endif
#if VW == 16 && defined(__AVX512BW__)
    if (dt == DT_E4M3_FINITE) {
        __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)base + off)));
        s = _mm512_and_si512(_mm512_slli_epi16(s, 7), _mm512_set1_epi16((short)0xBF80));
        *lo = (vf)_mm512_cvtph_ps(_mm512_castsi512_si256(s));
        *hi = (vf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(s, 1));
        return;
    }
#endif
    *lo = ld_kv(base, off, dt);
    *hi = ld_kv(base, off + VW, dt);
}

/* 4 VW elements at off as fp32 into out[0:4]: ld_kv2 twice, but fp8 by table in one go (in
 * FP8_BLOCKS order: the caller's other operand must be in that order too) */
static ALWAYS void ld_kv4(const void *base, int64_t off, int dt, vf *out) {
#if FP8_BY_TABLE
    if (dt == DT_E4M3 || dt == DT_E5M2) { fp8_table((const int8_t *)base + off, 4, dt, out); return; }
#endif
    ld_kv2(base, off, dt, &out[0], &out[1]);
    ld_kv2(base, off + 2 * VW, dt, &out[2], &out[3]);
}

/* one element of a K or V row as fp32 (the tail of a head size that is no multiple of VW) */
static ALWAYS float ld_one(const void *base, int64_t off, int dt) {
    if (dt == DT_F32) return ((const float *)base)[off];
    if (dt == DT_I8) return (float)((const int8_t *)base)[off];
    if (dt == DT_E4M3 || dt == DT_E4M3_FINITE) {   /* exact either way: tails are not checked */
        int8_t b[VW] = {0};
        b[0] = ((const int8_t *)base)[off];
        return e4m3_vec(b)[0];
    }
    if (dt == DT_E5M2) return half_to_float((uint16_t)(((const uint8_t *)base)[off] << 8));
    const uint16_t h = ((const uint16_t *)base)[off];
    if (dt == DT_BF16) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
    return half_to_float(h);
}

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* {sum(a[0]), ..., sum(a[VW-1])}: VW horizontal sums in one vector by a transpose-and-add
 * tree (log2(VW) levels; 45 operations for 16 sums on AVX-512 instead of 16 x 8). Level one
 * adds neighbouring lanes of each pair of inputs, each later level neighbouring groups twice
 * as wide, until lane t holds the whole sum of input t. */
static ALWAYS vf hsum_rows(const vf *a) {
    vf x[VW / 2], y[VW / 4];
#if VW == 16 && defined(__AVX512F__)
    /* the same tree's first two levels within each 128-bit lane (vunpck*ps, vshufps), the last
     * two across them (vshuff32x4): lane 4c+i of y[t] is a[4t+i]'s sum over floats 4c..4c+3.
     * In-lane shuffles instead of GCC's vpermt2ps for every level: an e4m3 decode 1.5-2% faster
     * in cache (decode_profile, alternated A/B), the same sums in another order */
    for (int t = 0; t < 8; t++) {
        const __m512 p = (__m512)a[2 * t], q = (__m512)a[2 * t + 1];
        x[t] = (vf)_mm512_add_ps(_mm512_unpacklo_ps(p, q), _mm512_unpackhi_ps(p, q));
    }
    for (int t = 0; t < 4; t++) {
        const __m512 p = (__m512)x[2 * t], q = (__m512)x[2 * t + 1];
        y[t] = (vf)_mm512_add_ps(_mm512_shuffle_ps(p, q, 0x44), _mm512_shuffle_ps(p, q, 0xEE));
    }
    __m512 z[2];
    for (int t = 0; t < 2; t++) {
        const __m512 p = (__m512)y[2 * t], q = (__m512)y[2 * t + 1];
        z[t] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
    }
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
#elif VW == 16
    vf z[2];
    for (int t = 0; t < 8; t++)
        x[t] = SHUF(a[2 * t], a[2 * t + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
               SHUF(a[2 * t], a[2 * t + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (int t = 0; t < 4; t++)
        y[t] = SHUF(x[2 * t], x[2 * t + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               SHUF(x[2 * t], x[2 * t + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int t = 0; t < 2; t++)
        z[t] = SHUF(y[2 * t], y[2 * t + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               SHUF(y[2 * t], y[2 * t + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return SHUF(z[0], z[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(z[0], z[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#else
    for (int t = 0; t < 4; t++)
        x[t] = SHUF(a[2 * t], a[2 * t + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUF(a[2 * t], a[2 * t + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int t = 0; t < 2; t++)
        y[t] = SHUF(x[2 * t], x[2 * t + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF(x[2 * t], x[2 * t + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
}

/* a > b ? a : b in each lane: one vmaxps where the CPU has it (exactly that, NaN and zeros too) */
static ALWAYS vf maxv(vf a, vf b) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif VW == 8 && defined(__AVX__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
#endif
}
static ALWAYS vf selectv(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* floor(y) in each lane: one vrndscaleps / vroundps where the CPU has it, else truncate and
 * take 1 where that rounded up */
static ALWAYS vf floorv(vf y) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_roundscale_ps((__m512)y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif VW == 8 && defined(__AVX__)
    return (vf)_mm256_round_ps((__m256)y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
    const vf n = __builtin_convertvector(__builtin_convertvector(y, vi), vf);
    return n + __builtin_convertvector(n > y, vf);                /* -1 where it rounded up */
#endif
}

/* exp(x) for x <= 0 (softmax after subtracting the max), ~1 ulp; 0 below -87. */
static inline float exp_nonpos(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n; memcpy(&two_n, &e, 4);
    return x < -87.0f ? 0.0f : p * two_n;
}

/* exp_nonpos on VW lanes at once (the same clamp, range reduction and polynomial) */
static ALWAYS vf expv_nonpos(vf x) {
    const vf lo = splat(-87.0f);
    const vi under = x < lo;                                      /* lanes that give 0 */
    const vf xc = maxv(lo, x);                                    /* NaN stays NaN */
    const vf n = floorv(xc * 1.44269504088896341f + 0.5f);
    const vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)two_n) & ~under);
}

/* cap * tanh(x / cap) on VW lanes, to fp32's relative precision at every |y| = |x / cap|:
 * below 0.625 Cephes tanhf's odd polynomial y + y^3 P(y^2), where the (1 - e) / (1 + e) with
 * e = exp(-2|y|) used above it cancels (its absolute error ~2^-23 made the score's error
 * ~cap * 2^-23: 0.1 at cap 1e6, and every score 0 at cap 1e30); the sign put back. */
static ALWAYS vf softcapv(vf x, float cap) {
    const vf y = x / cap;
    const vi sign = (vi)y & (vi)splat(-0.0f);
    const vf ay = (vf)((vi)y & ~(vi)splat(-0.0f));
    const vf e = expv_nonpos(-2.0f * ay);
    const vf large = (1.0f - e) / (1.0f + e);
    const vf z = ay * ay;
    vf p = z * -5.70498872745e-3f + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const vf small = p * z * ay + ay;
    const vi is_small = ay < splat(0.625f);                     /* NaN lanes: large (NaN) */
    const vf t = (vf)(((vi)small & is_small) | ((vi)large & ~is_small));
    return (vf)((vi)t | sign) * cap;
}

#endif
