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
 * Split-K (flash-decoding): an item may come with S > 1 splits (the caller asks for them when
 * items are fewer than threads: batch 1, a few long requests). Its key range is then cut into S
 * contiguous ranges, each a work unit of its own computing a partial softmax (max m, sum l,
 * unnormalised acc) into a buffer allocated once per call; after every unit is done the
 * partials of each item are merged exactly (rescaled by exp(m_s - max m)).
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
#include <stdlib.h>

#include "cpu_varlen_math.h"

#define CHUNK 64          /* keys per tile */
#define MAX_ROWS 64       /* query rows per item (np * G), enforced by the caller */
#define ROW_TILE_BYTES (32 * 1024)   /* row-by-row tiles up to this many bytes of K (measured) */
#define ITEM_COLS 6       /* (request, p0, np, h0, nh, splits) */

typedef struct {
    const float *q; float *out; const void *k, *v; int dtype;
    const int64_t *ks, *vs;                 /* element strides [blk, tok, head] of k and v */
    const int64_t *slots, *tables; int64_t width, bs;
    const int64_t *ctx, *qlen, *qstart, *kvstart;
    int64_t H, Hkv, D; float scale;
} args_t;

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

/* Row r of an item, r = (p * nh + hh) * G + g: query head (h0 + hh) * G + g at position
 * first_pos + p; its offset (in floats) in q and in out. */
static int64_t row_offset(const args_t *a, const int64_t *item, int64_t r) {
    const int64_t G = a->H / a->Hkv, nh = item[4], p = r / (nh * G);
    const int64_t head = (item[3] + (r / G) % nh) * G + r % G;
    return ((a->qstart[item[0]] + item[1] + p) * a->H + head) * a->D;
}

/* Keys [c_lo, c_hi) of request i folded into the softmax state (m, l, acc) of the item's rows,
 * row r seeing only keys up to its own position; qb holds the rows' queries, already scaled.
 * Keys are walked in tiles, token by token (all nh heads of a token are adjacent in memory: one
 * sequential read); nothing outside [c_lo, c_hi) is read. D is the head size, a constant in
 * the copies attend_keys makes. */
static inline __attribute__((always_inline)) void attend_keys_d(const args_t *a,
        const int64_t *item, int64_t c_lo, int64_t c_hi, const float *qb, float *acc,
        float *scratch, float *m, float *l, const int64_t D) {
    const int64_t i = item[0], nh = item[4], G = a->H / a->Hkv;
    const int64_t rows = item[2] * nh * G, first_pos = a->ctx[i] - a->qlen[i] + item[1];
    float *s = scratch + CHUNK * a->Hkv * D;
    const float *tile[CHUNK];
    int64_t koffs[CHUNK], voffs[CHUNK], lim[MAX_ROWS], stride;
    /* a tile's K rows of heads h0.. in few bytes (small heads) stay in L1 across the rows that
     * read them; wide ones (e.g. 8 x 128 floats, 4 KiB apart) would alias in L1 */
    const int by_row = CHUNK * nh * D * (int64_t)sizeof(float) <= ROW_TILE_BYTES;
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += CHUNK) {
        const int64_t n = c_hi - c0 < CHUNK ? c_hi - c0 : CHUNK;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t visible = first_pos + r / (nh * G) + 1 - c0;
            lim[r] = visible < 0 ? 0 : visible > n ? n : visible;
        }
        tile_offsets(a, a->ks, i, c0, n, item[3], koffs);
        tile_offsets(a, a->vs, i, c0, n, item[3], voffs);
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
}

/* attend_keys_d compiled for the usual head sizes with D a constant: the dot products and axpys
 * unroll and keep the query row in registers (measured, 2 KV heads x 32 at one thread, K/V
 * in cache: 0.94-1.29 ms generic, 0.70-0.74 ms for D = 32), and once for any other D. */
static void attend_keys(const args_t *a, const int64_t *item, int64_t c_lo, int64_t c_hi,
                        const float *qb, float *acc, float *scratch, float *m, float *l) {
    switch (a->D) {
    case 32: attend_keys_d(a, item, c_lo, c_hi, qb, acc, scratch, m, l, 32); return;
    case 64: attend_keys_d(a, item, c_lo, c_hi, qb, acc, scratch, m, l, 64); return;
    case 128: attend_keys_d(a, item, c_lo, c_hi, qb, acc, scratch, m, l, 128); return;
    }
    attend_keys_d(a, item, c_lo, c_hi, qb, acc, scratch, m, l, a->D);
}

/* One work unit: split s of item = (request i, p0, np, h0, nh, S). The item's keys
 * [kv_start_i, hi) (hi: one past the last row's position) are cut into S contiguous ranges whose
 * sizes differ by at most one key; unit s walks range s. S == 1 writes the rows' outputs; else
 * the unit's partial (m[rows], l[rows], acc[rows * D]: max, sum, unnormalised output) goes to
 * part + s * rows * (D + 2) for merge_splits. */
static void attend_unit(const args_t *a, const int64_t *item, int64_t s, float *buf, float *part) {
    const int64_t i = item[0], S = item[5], D = a->D, rows = item[2] * item[4] * (a->H / a->Hkv);
    const int64_t lo = a->kvstart[i], n = a->ctx[i] - a->qlen[i] + item[1] + item[2] - lo;
    float *qb = buf, *acc = qb + MAX_ROWS * D, m[MAX_ROWS], l[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const float *src = a->q + row_offset(a, item, r);
        for (int64_t x = 0; x < D; x++) qb[r * D + x] = src[x] * a->scale;
        memset(acc + r * D, 0, (size_t)D * sizeof(float));
        m[r] = -FLT_MAX; l[r] = 0.0f;
    }
    attend_keys(a, item, lo + n * s / S, lo + n * (s + 1) / S, qb, acc, acc + MAX_ROWS * D, m, l);
    if (S > 1) {
        float *dst = part + s * rows * (D + 2);
        memcpy(dst, m, (size_t)rows * sizeof(float));
        memcpy(dst + rows, l, (size_t)rows * sizeof(float));
        memcpy(dst + 2 * rows, acc, (size_t)(rows * D) * sizeof(float));
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = a->out + row_offset(a, item, r);
        const float inv = 1.0f / l[r];
        for (int64_t x = 0; x < D; x++) dst[x] = acc[r * D + x] * inv;
    }
}

/* The S partials of a split item merged exactly into its rows' outputs: with M the largest
 * partial max, out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s (a split that saw no key
 * of a row has m_s = -FLT_MAX, l_s = 0 and weighs nothing). Reads only the partial buffer. */
static void merge_splits(const args_t *a, const int64_t *item, const float *part) {
    const int64_t S = item[5], D = a->D, rows = item[2] * item[4] * (a->H / a->Hkv);
    const int64_t size = rows * (D + 2);
    for (int64_t r = 0; r < rows; r++) {
        float mx = -FLT_MAX, sum = 0.0f, *dst = a->out + row_offset(a, item, r);
        for (int64_t s = 0; s < S; s++) mx = part[s * size + r] > mx ? part[s * size + r] : mx;
        memset(dst, 0, (size_t)D * sizeof(float));
        for (int64_t s = 0; s < S; s++) {
            const float *p = part + s * size, w = exp_nonpos(p[r] - mx);
            sum += w * p[rows + r];
            axpy(dst, w, p + 2 * rows + r * D, D);
        }
        const float inv = 1.0f / sum;
        for (int64_t x = 0; x < D; x++) dst[x] *= inv;
    }
}

/* Work units of a call: unit u is split unit[2u + 1] of item unit[2u]; a split item's partials
 * start part_off[w] floats into the call's partial buffer. Returns that buffer's size in floats. */
static int64_t plan_units(const int64_t *items, int64_t n_items, int64_t G, int64_t D,
                          int64_t *unit, int64_t *part_off) {
    int64_t u = 0, floats = 0;
    for (int64_t w = 0; w < n_items; w++) {
        const int64_t *item = items + w * ITEM_COLS, S = item[5];
        for (int64_t s = 0; s < S; s++, u++) { unit[2 * u] = w; unit[2 * u + 1] = s; }
        part_off[w] = floats;
        if (S > 1) floats += S * item[2] * item[4] * G * (D + 2);
    }
    return floats;
}

/* Units in parallel, then (after the barrier) split items merged in parallel; one scratch
 * buffer per thread. Returns 0, or -1 when a thread's scratch could not be allocated. */
static int run_units(const args_t *a, const int64_t *items, int64_t n_items, const int64_t *unit,
                     int64_t units, const int64_t *part_off, float *part, int nthreads) {
    const int64_t D = a->D;
    const size_t floats = (size_t)(2 * MAX_ROWS * D + CHUNK * a->Hkv * D + MAX_ROWS * CHUNK);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *buf = (float *)malloc(floats * sizeof(float));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++)
            if (buf) attend_unit(a, items + unit[2 * u] * ITEM_COLS, unit[2 * u + 1], buf,
                                 part ? part + part_off[unit[2 * u]] : NULL);
        if (part) {   /* the same value in every thread: all of them meet this loop or none */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < n_items; w++)
                if (items[w * ITEM_COLS + 5] > 1 && !failed)
                    merge_splits(a, items + w * ITEM_COLS, part + part_off[w]);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* q, out: fp32 [T, H, D] contiguous; scores are (q . k) * scale.
 * items: int64 [n_items, 6] = (request, p0, np, h0, nh, splits), np * nh * G <= 64, splits >= 1
 * (the item's key range is walked as that many units, merged at the end).
 * Returns 0, or -1 when scratch memory could not be allocated (nothing is then promised of out). */
int vk_attention(const float *q, float *out, const void *k, const void *v, int dtype,
                 const int64_t *k_strides, const int64_t *v_strides,
                 const int64_t *slots, const int64_t *tables, int64_t width, int64_t block_size,
                 const int64_t *ctx, const int64_t *qlen, const int64_t *qstart,
                 const int64_t *kvstart, const int64_t *items, int64_t n_items,
                 int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    args_t a = {q, out, k, v, dtype, k_strides, v_strides, slots, tables, width, block_size,
                ctx, qlen, qstart, kvstart, H, Hkv, D, scale};
    int64_t units = 0;
    for (int64_t w = 0; w < n_items; w++) units += items[w * ITEM_COLS + 5];
    int64_t *unit = malloc((size_t)(2 * units + n_items + 1) * sizeof(int64_t));
    if (!unit) return -1;
    int64_t *part_off = unit + 2 * units;
    const int64_t part_floats = plan_units(items, n_items, H / Hkv, D, unit, part_off);
    float *part = part_floats ? (float *)malloc((size_t)part_floats * sizeof(float)) : NULL;
    int rc = -1;
    if (!part_floats || part) {
        if (nthreads > units) nthreads = (int)(units > 0 ? units : 1);
        rc = run_units(&a, items, n_items, unit, units, part_off, part, nthreads);
    }
    free(part);
    free(unit);
    return rc;
}
