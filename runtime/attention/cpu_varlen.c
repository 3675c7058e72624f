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
 * Keys are taken in tiles of CHUNK. A tile whose K rows (of the item's heads) fit in
 * ROW_TILE_BYTES is walked row by row (each query row's scores, then its accumulator, in
 * registers over the tile, which stays in L1); a wider one key by key, each key's heads loaded
 * once for every query row (64 rows of 4 KiB, 4 KiB apart, would alias in L1). Dot products are
 * reduced eight at a time in one shuffle tree; softmax's exp and max run on eight lanes.
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
#define ROW_TILE_BYTES (32 * 1024)   /* row-by-row tiles up to this many bytes of K (measured) */

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

/* Element offsets of keys (or values) c0 .. c0+n-1 of request i, head h0, into offs[0:n]; paged
 * walks the block table once per block (no division per key). */
static void tile_offsets(const args_t *a, const int64_t *st, int64_t i, int64_t c0, int64_t n,
                         int64_t h0, int64_t *offs) {
    if (a->slots) {
        const int64_t base = a->slots[i] * st[0] + h0 * st[2];
        for (int64_t j = 0; j < n; j++) offs[j] = base + (c0 + j) * st[1];
        return;
    }
    const int64_t *table = a->tables + i * a->width;
    int64_t blk = c0 / a->bs, in_blk = c0 % a->bs;
    for (int64_t j = 0; j < n; j++) {
        offs[j] = table[blk] * st[0] + in_blk * st[1] + h0 * st[2];
        if (++in_blk == a->bs) { in_blk = 0; blk++; }
    }
}

/* heads h0 .. h0+nh-1 of one key (or value) at element offset off, as fp32 rows ``stride``
 * apart: the cache itself for fp32, else converted into scratch (nh * D floats). */
static const float *token_heads(const args_t *a, const void *base, const int64_t *st, int64_t off,
                                int64_t nh, float *scratch, int64_t *stride) {
    if (a->dtype == DT_F32) { *stride = st[2]; return (const float *)base + off; }
    for (int64_t hh = 0; hh < nh; hh++) load_row(scratch + hh * a->D, base, off + hh * st[2], a->dtype, a->D);
    *stride = a->D;
    return scratch;
}

/* Pointers to the fp32 rows of a tile's keys (or values) at offs[0:n] (head hh of key j at
 * rows[j] + hh * *stride): the cache itself for fp32, else converted into scratch (n * nh * D
 * floats). */
static void tile_rows(const args_t *a, const void *base, const int64_t *st, const int64_t *offs,
                      int64_t n, int64_t nh, float *scratch, const float **rows, int64_t *stride) {
    for (int64_t j = 0; j < n; j++) {
        if (a->dtype == DT_F32) { rows[j] = (const float *)base + offs[j]; continue; }
        float *dst = scratch + j * nh * a->D;
        for (int64_t hh = 0; hh < nh; hh++) load_row(dst + hh * a->D, base, offs[j] + hh * st[2], a->dtype, a->D);
        rows[j] = dst;
    }
    *stride = a->dtype == DT_F32 ? st[2] : a->D;
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

/* s[r * CHUNK + j] = q_r . key j (head of row r) for every row that sees key j */
static inline void key_scores(float *s, int64_t j, const float *qb, const float *kt, int64_t stride,
                              int64_t rows, int64_t G, int64_t nh, const int64_t *lim, int64_t d) {
    int64_t r = 0;
    if (d % 8 == 0) {
        v8 part[8];
        for (; r + 8 <= rows; r += 8) {
            for (int t = 0; t < 8; t++)
                part[t] = dot_partial(qb + (r + t) * d, kt + (((r + t) / G) % nh) * stride, d);
            const v8 sums = hsum8x8(part);
            for (int t = 0; t < 8; t++)
                if (j < lim[r + t]) s[(r + t) * CHUNK + j] = sums[t];
        }
    }
    for (; r < rows; r++)
        if (j < lim[r]) s[r * CHUNK + j] = dot(qb + r * d, kt + ((r / G) % nh) * stride, d);
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

/* One item: request i, query positions p0 .. p0+np-1, KV heads h0 .. h0+nh-1. Row
 * r = (p * nh + hh) * G + g is query head (h0 + hh) * G + g at position first_pos + p. Keys are
 * walked token by token (all nh heads of a token are adjacent in memory: one sequential read). */
static void attend_item(const args_t *a, const int64_t *item, float *buf) {
    const int64_t i = item[0], p0 = item[1], np = item[2], h0 = item[3], nh = item[4];
    const int64_t G = a->H / a->Hkv, D = a->D, rows = np * nh * G;
    const int64_t first_pos = a->ctx[i] - a->qlen[i] + p0;
    float *qb = buf, *acc = qb + MAX_ROWS * D, *scratch = acc + MAX_ROWS * D;
    float *s = scratch + CHUNK * a->Hkv * D, m[MAX_ROWS], l[MAX_ROWS];
    const float *tile[CHUNK];
    int64_t koffs[CHUNK], voffs[CHUNK];
    int64_t lim[MAX_ROWS], stride;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = r / (nh * G), head = (h0 + (r / G) % nh) * G + r % G;
        const float *src = a->q + ((a->qstart[i] + p0 + p) * a->H + head) * D;
        for (int64_t x = 0; x < D; x++) qb[r * D + x] = src[x] * a->scale;
        memset(acc + r * D, 0, (size_t)D * sizeof(float));
        m[r] = -FLT_MAX; l[r] = 0.0f;
    }
    const int64_t hi = first_pos + np;     /* keys [kv_start, hi): the last row sees them all */
    /* a tile's K rows of heads h0.. in few bytes (small heads) stay in L1 across the rows that
     * read them; wide ones (e.g. 8 x 128 floats, 4 KiB apart) would alias in L1 */
    const int by_row = CHUNK * nh * D * (int64_t)sizeof(float) <= ROW_TILE_BYTES;
    for (int64_t c0 = a->kvstart[i]; c0 < hi; c0 += CHUNK) {
        const int64_t n = hi - c0 < CHUNK ? hi - c0 : CHUNK;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t visible = first_pos + r / (nh * G) + 1 - c0;
            lim[r] = visible < 0 ? 0 : visible > n ? n : visible;
        }
        tile_offsets(a, a->ks, i, c0, n, h0, koffs);
        tile_offsets(a, a->vs, i, c0, n, h0, voffs);
        if (by_row) {   /* the tile's rows are few bytes: row by row, K then V from L1 */
            tile_rows(a, a->k, a->ks, koffs, n, nh, scratch, tile, &stride);
            for (int64_t r = 0; r < rows; r++)
                if (lim[r]) tile_scores(s + r * CHUNK, qb + r * D, tile, ((r / G) % nh) * stride, lim[r], D);
        } else {        /* wide token rows: key by key, each loaded once for every query row */
            for (int64_t j = 0; j < n; j++) {
                const float *kt = token_heads(a, a->k, a->ks, koffs[j], nh, scratch, &stride);
                key_scores(s, j, qb, kt, stride, rows, G, nh, lim, D);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            if (lim[r]) online_softmax(s + r * CHUNK, lim[r], &m[r], &l[r], acc + r * D, D);
        if (by_row) {
            tile_rows(a, a->v, a->vs, voffs, n, nh, scratch, tile, &stride);
            for (int64_t r = 0; r < rows; r++)
                if (lim[r]) tile_axpy(acc + r * D, s + r * CHUNK, tile, ((r / G) % nh) * stride, lim[r], D);
        } else {
            for (int64_t j = 0; j < n; j++) {
                const float *vt = token_heads(a, a->v, a->vs, voffs[j], nh, scratch, &stride);
                for (int64_t r = 0; r < rows; r++)
                    if (j < lim[r]) axpy(acc + r * D, s[r * CHUNK + j], vt + ((r / G) % nh) * stride, D);
            }
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
    const size_t floats = (size_t)(2 * MAX_ROWS * D + CHUNK * Hkv * D + MAX_ROWS * CHUNK);
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
