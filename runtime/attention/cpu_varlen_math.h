/* cpu_varlen_math.h: the fp32 arithmetic of cpu_varlen.c, none of it about caches or items.
 *
 * K/V row conversion (bf16, fp16 -> fp32), softmax's exp on one and on eight lanes, dot products
 * reduced eight at a time in one shuffle tree, axpy over tiles with the accumulator in registers,
 * and the online softmax of one query row over one tile. Included by cpu_varlen.c only (native.py
 * hashes both files into the build's key).
 */
#ifndef VK_CPU_VARLEN_MATH_H
#define VK_CPU_VARLEN_MATH_H
#include <float.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

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

/* n elements of one K or V row (any dtype) -> fp32 */
static inline void load_row(float *dst, const void *base, int64_t off, int dtype, int64_t d) {
    if (dtype == DT_F32) {
        memcpy(dst, (const float *)base + off, (size_t)d * sizeof(float));
    } else if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)base + off;
        #pragma omp simd
        for (int64_t x = 0; x < d; x++) { uint32_t b = (uint32_t)src[x] << 16; memcpy(&dst[x], &b, 4); }
    } else {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int64_t x = 0; x < d; x++) dst[x] = half_to_float(src[x]);
    }
}

/* exp(x) for x <= 0 (softmax after subtracting the max), vectorisable, ~1 ulp; 0 below -87. */
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

/* 8 fp32 lanes (GCC vector extension: AVX with -march=native, plain loops elsewhere) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8 ld8(const float *p) { return *(const v8u *)p; }
static inline void st8(float *p, v8 x) { *(v8u *)p = x; }
static inline float hsum8(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* q . k over d (a multiple of 8) as 8 partial sums */
static inline v8 dot_partial(const float *q, const float *k, int64_t d) {
    v8 s0 = {0}, s1 = {0};
    int64_t x = 0;
    for (; x + 16 <= d; x += 16) { s0 += ld8(q + x) * ld8(k + x); s1 += ld8(q + x + 8) * ld8(k + x + 8); }
    if (x < d) s0 += ld8(q + x) * ld8(k + x);
    return s0 + s1;
}

static inline float dot(const float *a, const float *b, int64_t d) {
    if (d % 8 == 0) return hsum8(dot_partial(a, b, d));
    float sum = 0.0f;
    for (int64_t x = 0; x < d; x++) sum += a[x] * b[x];
    return sum;
}

/* acc[0:d] += p * row[0:d] */
static inline void axpy(float *acc, float p, const float *row, int64_t d) {
    int64_t x = 0;
    if (d % 8 == 0) {
        const v8 pv = {p, p, p, p, p, p, p, p};
        for (; x < d; x += 8) st8(acc + x, ld8(acc + x) + pv * ld8(row + x));
        return;
    }
    for (; x < d; x++) acc[x] += p * row[x];
}


#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* {hsum(a0), ..., hsum(a7)}: the eight horizontal sums in one vector (21 ops, not 8 x 6) */
static inline v8 hsum8x8(const v8 *a) {
    v8 x[4], y[2];
    for (int t = 0; t < 4; t++)
        x[t] = SHUF(a[2 * t], a[2 * t + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUF(a[2 * t], a[2 * t + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int t = 0; t < 2; t++)
        y[t] = SHUF(x[2 * t], x[2 * t + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF(x[2 * t], x[2 * t + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
}


/* s[j] = q . rows[j][off:off+d] for j < n (q already scaled) */
static inline void tile_scores(float *s, const float *q, const float *const *rows, int64_t off,
                               int64_t n, int64_t d) {
    int64_t j = 0;
    if (d % 8 == 0) {
        v8 part[8];
        for (; j + 8 <= n; j += 8) {
            for (int t = 0; t < 8; t++) part[t] = dot_partial(q, rows[j + t] + off, d);
            st8(s + j, hsum8x8(part));
        }
    }
    for (; j < n; j++) s[j] = dot(q, rows[j] + off, d);
}

/* acc[0:d] += sum_j p[j] * rows[j][off:off+d], 32 lanes of acc held in registers at a time */
static inline void tile_axpy(float *acc, const float *p, const float *const *rows, int64_t off,
                             int64_t n, int64_t d) {
    int64_t x = 0;
    if (d % 8 == 0) {
        for (; x + 32 <= d; x += 32) {
            v8 a0 = ld8(acc + x), a1 = ld8(acc + x + 8), a2 = ld8(acc + x + 16), a3 = ld8(acc + x + 24);
            for (int64_t j = 0; j < n; j++) {
                const float *r = rows[j] + off + x;
                const v8 pv = {p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j]};
                a0 += pv * ld8(r); a1 += pv * ld8(r + 8); a2 += pv * ld8(r + 16); a3 += pv * ld8(r + 24);
            }
            st8(acc + x, a0); st8(acc + x + 8, a1); st8(acc + x + 16, a2); st8(acc + x + 24, a3);
        }
        for (; x < d; x += 8) {
            v8 a0 = ld8(acc + x);
            for (int64_t j = 0; j < n; j++) {
                const v8 pv = {p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j]};
                a0 += pv * ld8(rows[j] + off + x);
            }
            st8(acc + x, a0);
        }
        return;
    }
    for (int64_t j = 0; j < n; j++) axpy(acc, p[j], rows[j] + off, d);
}

/* exp_nonpos on 8 lanes at once (the same clamp, range reduction and polynomial) */
static inline v8 exp8_nonpos(v8 x) {
    const v8 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const v8i under = x < lo;                                     /* lanes that give 0 */
    const v8 xc = (v8)(((v8i)x & ~under) | ((v8i)lo & under));
    const v8 y = xc * 1.44269504088896341f + 0.5f;
    v8 n = __builtin_convertvector(__builtin_convertvector(y, v8i), v8);   /* trunc, then */
    n += __builtin_convertvector(n > y, v8);                      /* floor: -1 where it rounded up */
    const v8 r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v8i two_n = (__builtin_convertvector(n, v8i) + 127) << 23;
    return (v8)((v8i)(p * (v8)two_n) & ~under);
}

/* softmax numerators of one row's visible scores sr[0:lim], folded into (m, l, acc) online */
static inline void online_softmax(float *sr, int64_t lim, float *m, float *l, float *acc, int64_t d) {
    float mx = -FLT_MAX, sum = 0.0f;
    int64_t j = 0;
    if (lim >= 8) {
        v8 vm = ld8(sr);
        for (j = 8; j + 8 <= lim; j += 8) {
            const v8 x = ld8(sr + j);
            const v8i gt = x > vm;
            vm = (v8)(((v8i)x & gt) | ((v8i)vm & ~gt));
        }
        for (int k = 0; k < 8; k++) mx = vm[k] > mx ? vm[k] : mx;
    }
    for (; j < lim; j++) mx = sr[j] > mx ? sr[j] : mx;
    const float newm = mx > *m ? mx : *m, corr = exp_nonpos(*m - newm);
    v8 vs = {0};
    for (j = 0; j + 8 <= lim; j += 8) {
        const v8 e = exp8_nonpos(ld8(sr + j) - newm);
        st8(sr + j, e);
        vs += e;
    }
    for (; j < lim; j++) { sr[j] = exp_nonpos(sr[j] - newm); sum += sr[j]; }
    sum += hsum8(vs);
    if (corr != 1.0f)
        for (int64_t x = 0; x < d; x++) acc[x] *= corr;
    *l = *l * corr + sum;
    *m = newm;
}

#endif
