/* cpu_varlen.c: one attention call for a whole batch over a vmem or paged KV cache, on the CPU.
 *
 * Built at first use by runtime/attention/native.py (cc -O3 -march=native -fopenmp -shared) and
 * called through ctypes with raw pointers; no torch headers, so it builds in about a second.
 *
 * Work: one item = (request i, query positions p0 .. p0+np-1, KV heads h0 .. h0+nh-1), items
 * run in parallel. A query row at position pos = ctx_i - qlen_i + p attends to keys
 * [kv_start_i, pos] (bottom-right causal; decode: one position that sees every key). The G query
 * heads of a KV head share each loaded K/V row (GQA without repeating K/V), and a decode item
 * takes several KV heads so that it reads whole token rows, sequentially.
 *
 *   vmem   key t of request i: k + slot_i * s_blk + t * s_tok + h * s_head   (strided, in place)
 *   paged  key t of request i: k + table_i[t / bs] * s_blk + (t % bs) * s_tok + h * s_head
 *
 * Memory safety: only keys kv_start_i .. ctx_i - 1 of request i are loaded, so nothing past the
 * live tokens (possibly unmapped) and nothing before kv_start (possibly stale, even NaN) is read.
 * Softmax is online over tiles of CHUNK keys, accumulated in fp32 (K/V may be fp32, bf16, fp16).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
#define CHUNK 64          /* keys per tile */
#define MAX_ROWS 64       /* query rows per item (np * G), enforced by the caller */

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

static inline int64_t key_offset(const int64_t *slots, const int64_t *tables, int64_t width,
                                 int64_t bs, int64_t i, int64_t t, int64_t s_blk, int64_t s_tok) {
    if (slots) return slots[i] * s_blk + t * s_tok;
    return tables[i * width + t / bs] * s_blk + (t % bs) * s_tok;
}

typedef struct {
    const float *q; float *out; const void *k, *v; int dtype;
    const int64_t *ks, *vs;                 /* element strides [blk, tok, head] of k and v */
    const int64_t *slots, *tables; int64_t width, bs;
    const int64_t *ctx, *qlen, *qstart, *kvstart;
    int64_t H, Hkv, D; float scale;
} args_t;

/* 8 fp32 lanes (GCC vector extension: AVX with -march=native, plain loops elsewhere) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
static inline v8 ld8(const float *p) { return *(const v8u *)p; }
static inline void st8(float *p, v8 x) { *(v8u *)p = x; }
static inline float hsum8(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

static inline float dot(const float *a, const float *b, int64_t d) {
    int64_t x = 0;
    float tail = 0.0f;
    if (d % 8 == 0) {
        v8 s0 = {0}, s1 = {0};
        for (; x + 16 <= d; x += 16) { s0 += ld8(a + x) * ld8(b + x); s1 += ld8(a + x + 8) * ld8(b + x + 8); }
        if (x < d) s0 += ld8(a + x) * ld8(b + x);
        return hsum8(s0 + s1);
    }
    for (; x < d; x++) tail += a[x] * b[x];
    return tail;
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

/* key or value c0 + j of request i, heads h0 .. h0+nh-1, as fp32 rows ``stride`` apart: the
 * cache itself for fp32, else converted into scratch (nh * D floats). */
static const float *token_heads(const args_t *a, const void *base, const int64_t *st, int64_t i,
                                int64_t t, int64_t h0, int64_t nh, float *scratch, int64_t *stride) {
    const int64_t off = key_offset(a->slots, a->tables, a->width, a->bs, i, t, st[0], st[1]) + h0 * st[2];
    if (a->dtype == DT_F32) { *stride = st[2]; return (const float *)base + off; }
    for (int64_t hh = 0; hh < nh; hh++) load_row(scratch + hh * a->D, base, off + hh * st[2], a->dtype, a->D);
    *stride = a->D;
    return scratch;
}

/* softmax numerators of one row's visible scores sr[0:lim], folded into (m, l, acc) online */
static inline void online_softmax(float *sr, int64_t lim, float *m, float *l, float *acc, int64_t d) {
    float mx = -FLT_MAX, sum = 0.0f;
    for (int64_t j = 0; j < lim; j++) mx = sr[j] > mx ? sr[j] : mx;
    const float newm = mx > *m ? mx : *m, corr = exp_nonpos(*m - newm);
    #pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < lim; j++) { sr[j] = exp_nonpos(sr[j] - newm); sum += sr[j]; }
    if (corr != 1.0f)
        for (int64_t x = 0; x < d; x++) acc[x] *= corr;
    *l = *l * corr + sum;
    *m = newm;
}

/* One item: request i, query positions p0 .. p0+np-1, KV heads h0 .. h0+nh-1. Row
 * r = (p * nh + hh) * G + g is query head (h0 + hh) * G + g at position first_pos + p. Keys are
 * walked token by token (all nh heads of a token are adjacent in memory: one sequential read). */
static void attend_item(const args_t *a, const int64_t *item, float *buf) {
    const int64_t i = item[0], p0 = item[1], np = item[2], h0 = item[3], nh = item[4];
    const int64_t G = a->H / a->Hkv, D = a->D, rows = np * nh * G;
    const int64_t first_pos = a->ctx[i] - a->qlen[i] + p0;
    float *qb = buf, *acc = qb + MAX_ROWS * D, *scratch = acc + MAX_ROWS * D;
    float *s = scratch + a->Hkv * D, m[MAX_ROWS], l[MAX_ROWS];
    int64_t lim[MAX_ROWS], stride;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = r / (nh * G), head = (h0 + (r / G) % nh) * G + r % G;
        const float *src = a->q + ((a->qstart[i] + p0 + p) * a->H + head) * D;
        for (int64_t x = 0; x < D; x++) qb[r * D + x] = src[x] * a->scale;
        memset(acc + r * D, 0, (size_t)D * sizeof(float));
        m[r] = -FLT_MAX; l[r] = 0.0f;
    }
    const int64_t hi = first_pos + np;     /* keys [kv_start, hi): the last row sees them all */
    for (int64_t c0 = a->kvstart[i]; c0 < hi; c0 += CHUNK) {
        const int64_t n = hi - c0 < CHUNK ? hi - c0 : CHUNK;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t visible = first_pos + r / (nh * G) + 1 - c0;
            lim[r] = visible < 0 ? 0 : visible > n ? n : visible;
        }
        for (int64_t j = 0; j < n; j++) {  /* each key is loaded once for its G query heads */
            const float *kt = token_heads(a, a->k, a->ks, i, c0 + j, h0, nh, scratch, &stride);
            for (int64_t r = 0; r < rows; r++)
                if (j < lim[r]) s[r * CHUNK + j] = dot(qb + r * D, kt + ((r / G) % nh) * stride, D);
        }
        for (int64_t r = 0; r < rows; r++)
            if (lim[r]) online_softmax(s + r * CHUNK, lim[r], &m[r], &l[r], acc + r * D, D);
        for (int64_t j = 0; j < n; j++) {
            const float *vt = token_heads(a, a->v, a->vs, i, c0 + j, h0, nh, scratch, &stride);
            for (int64_t r = 0; r < rows; r++)
                if (j < lim[r]) axpy(acc + r * D, s[r * CHUNK + j], vt + ((r / G) % nh) * stride, D);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = r / (nh * G), head = (h0 + (r / G) % nh) * G + r % G;
        float *dst = a->out + ((a->qstart[i] + p0 + p) * a->H + head) * D;
        const float inv = 1.0f / l[r];
        for (int64_t x = 0; x < D; x++) dst[x] = acc[r * D + x] * inv;
    }
}

/* q, out: fp32 [T, H, D] contiguous; scores are (q . k) * scale.
 * items: int64 [n_items, 5] = (request, p0, np, h0, nh), np * nh * G <= 64.
 * Returns 0, or -1 when scratch memory could not be allocated. */
int vk_attention(const float *q, float *out, const void *k, const void *v, int dtype,
                 const int64_t *k_strides, const int64_t *v_strides,
                 const int64_t *slots, const int64_t *tables, int64_t width, int64_t block_size,
                 const int64_t *ctx, const int64_t *qlen, const int64_t *qstart,
                 const int64_t *kvstart, const int64_t *items, int64_t n_items,
                 int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    args_t a = {q, out, k, v, dtype, k_strides, v_strides, slots, tables, width, block_size,
                ctx, qlen, qstart, kvstart, H, Hkv, D, scale};
    const int64_t work = n_items;
    const size_t floats = (size_t)(2 * MAX_ROWS * D + Hkv * D + MAX_ROWS * CHUNK);
    int failed = 0;
    if (nthreads > work) nthreads = (int)(work > 0 ? work : 1);
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *buf = (float *)malloc(floats * sizeof(float));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; w++)
            if (buf) attend_item(&a, items + w * 5, buf);
        free(buf);
    }
    return failed ? -1 : 0;
}
