/* cpu_varlen.c: one attention call for a whole batch over a vmem or paged KV cache, on the CPU.
 *
 * Built at first use by runtime/attention/native.py (cc -O3 -march=native -fopenmp -shared) and
 * called through ctypes with raw pointers; no torch headers, so it builds in a few seconds.
 *
 * Work: one item = (request i, query positions p0 .. p0+np-1, KV heads h0 .. h0+nh-1), items
 * run in parallel. A query row at position pos = ctx_i - qlen_i + p attends to keys
 * [lo, pos] with lo = max(kv_start_i, pos - window + 1) (bottom-right causal; decode: one
 * position that sees every key of its window). The G query heads of a KV head share each
 * loaded K/V row (GQA without repeating K/V). Decode, prefill chunks and mixed batches are
 * the same code: a prefill item holds up to 64 / G positions of one KV head, a decode item
 * every KV head of one position (it reads whole token rows, sequentially).
 *
 * Split-K (flash-decoding): an item may come with S > 1 splits (the caller asks for them when
 * items are fewer than threads: batch 1, a few long requests). Its key range is then cut into S
 * contiguous ranges, each a work unit of its own computing a partial softmax (max m, sum l,
 * unnormalised acc) into a buffer allocated once per call; after every unit is done the
 * partials of each item are merged exactly (rescaled by exp(m_s - max m)).
 *
 * A unit walks its keys in tiles of CHUNK (cpu_varlen_tile.h): scores key-major (each key's
 * K row loaded once into registers, every row's dot product with it reduced VW at a time by
 * one transpose tree), the online softmax vectorised across rows, then values in register
 * blocks of up to 4 rows x 4 vectors, each V row of the tile loaded once per block. Prefill
 * units (one KV head, many rows) walk the tiles GEMM-like on transposed queries and
 * accumulators, each K/V tile widened to fp32 once (cpu_varlen_tile.h, unit_gemm).
 *
 *   vmem   key t of request i: k + slot_i * s_blk + t * s_tok + h * s_head   (strided, in place)
 *   paged  key t of request i: k + table_i[t / bs] * s_blk + (t % bs) * s_tok + h * s_head
 *
 * Memory safety: only keys [item lo, last row's position] of request i are loaded, item lo >=
 * kv_start_i, so nothing past the live tokens (possibly unmapped) and nothing before kv_start
 * (possibly stale, even NaN) is read. Accumulation is fp32 (K/V may be fp32, bf16, fp16, or
 * 8-bit: fp8 e4m3 / e5m2, int8, converted exactly in registers).
 *
 * 8-bit K/V carry fp32 scales per KV head (value = stored * scale): K's is folded into the
 * query rows of its head (q * scale_k . k = q . (scale_k k)) and V's into their outputs
 * (sum p (scale_v v) = scale_v sum p v), so the inner loops convert bytes and never multiply.
 * e4m3 with AVX-512 VBMI converts by table, exactly, NaN bytes included (cpu_varlen_math.h's
 * fp8_table). Elsewhere an e4m3 decode converts without the step that makes 0x7F / 0xFF NaN and
 * watches the bytes it reads for those two instead (a vpmax per 64 bytes); a unit that met one
 * is walked again with the step, so the result is always that of the exact conversion (issue
 * 30: 13% of the time).
 */
#include <stdlib.h>

#include "cpu_varlen_math.h"

#define CHUNK 32          /* keys per tile */
#define VALUE_GROUP 8     /* keys whose V rows are read together, twice as many for 8-bit V (cpu_varlen_tile.h) */
#define PREFETCH_KEYS 6   /* K rows are prefetched this many keys ahead (cpu_varlen_tile.h) */
#ifndef PREFETCH_V_BYTES
#define PREFETCH_V_BYTES 2   /* V rows of 1- and 2-byte elements are prefetched as their keys are scored (issue 30) */
#endif
#define MAX_ROWS 64       /* query rows per item (np * nh * G), enforced by the caller */
#define KR_VECS 16        /* K row vectors a key's scoring holds in registers (cpu_varlen_tile.h) */
_Static_assert(KR_VECS % 4 == 0, "ld_kv4's blocks of 4 vectors start at multiples of 4 (FP8_BLOCKS)");
#define WIDEN_ROWS 4      /* units with more rows a KV head widen each V tile once (cpu_varlen_tile.h) */
#define WIDEN_HEADS (MAX_ROWS / (WIDEN_ROWS + 1))   /* the most KV heads such a unit has */
#define ITEM_COLS 6       /* (request, p0, np, h0, nh, splits) */

typedef struct {
    const float *q; float *out; const void *k, *v; int dtype;
    const float *kscale, *vscale;           /* [Hkv] each, or NULL (unscaled K/V) */
    const int64_t *ks, *vs;                 /* element strides [blk, tok, head] of k and v */
    const int64_t *slots, *tables; int64_t width, bs;
    const int64_t *ctx, *qlen, *qstart, *kvstart;
    int64_t H, Hkv, D; float scale; int64_t window; float softcap;   /* 0: none */
} args_t;

/* One thread's scratch, 64-byte aligned: queries (scaled), accumulators, key-major scores,
 * the partial dot products of one key, per-row softmax state and visible key range. */
typedef struct {
    float *qb, *acc;          /* [MAX_ROWS][D] */
    float *s;                 /* [CHUNK][MAX_ROWS]: scores, then probabilities */
    float *part;              /* [2][MAX_ROWS][VW]: two keys' partial dot products per row */
    float *tails;             /* [2][MAX_ROWS]: the dot products' scalar tails (D % VW) */
    float *m, *l, *corr;      /* [MAX_ROWS]: running max, sum, this tile's rescale */
    float *vt;                /* [CHUNK][WIDEN_HEADS][D]: a tile's V widened to fp32 */
    float *kt;                /* [CHUNK][D]: a tile's K widened to fp32 (unit_gemm) */
    float *qT;                /* [D][MAX_ROWS]: qb transposed (unit_gemm) */
    int32_t *lo, *hi;         /* [MAX_ROWS]: row r sees keys [lo, hi) */
    int nan_bytes;            /* the unit's walk read an e4m3 NaN byte as finite (DT_E4M3_FINITE) */
    int q_overflow;           /* a finite query times its scale was not finite (vk_attention: -3) */
} ws_t;

/* The item a unit belongs to, unpacked, and the keys [c_lo, c_hi) the unit walks. */
typedef struct {
    int64_t i, p0, np, h0, nh, G, rows, rvec, c_lo, c_hi;
    int exact;                     /* e4m3 read with the NaN step (a walk met a NaN byte) */
    int64_t head_rows[MAX_ROWS];   /* [nh][np * G]: the c-th row of head hh, (p * nh + hh) * G + g */
} unit_t;

#include "cpu_varlen_tile.h"

/* Row r of an item, r = (p * nh + hh) * G + g: query head (h0 + hh) * G + g at position
 * first_pos + p; its offset (in floats) in q and in out. */
static int64_t row_kv_head(const args_t *a, const int64_t *item, int64_t r) {
    return item[3] + (r / (a->H / a->Hkv)) % item[4];
}

/* e4m3 loads are the values / 2^8 (cpu_varlen_math.h): the scales carry the 2^8 back */
static float kv_unit(const args_t *a) { return a->dtype == DT_E4M3 ? E4M3_SCALE : 1.0f; }

/* V's scale of row r's KV head (1 when unscaled) */
static float row_vscale(const args_t *a, const int64_t *item, int64_t r) {
    return a->vscale ? a->vscale[row_kv_head(a, item, r)] * kv_unit(a) : 1.0f;
}

static int64_t row_offset(const args_t *a, const int64_t *item, int64_t r) {
    const int64_t G = a->H / a->Hkv, nh = item[4], p = r / (nh * G);
    const int64_t head = (item[3] + (r / G) % nh) * G + r % G;
    return ((a->qstart[item[0]] + item[1] + p) * a->H + head) * a->D;
}

/* The first key any row of the item sees: kv_start, or the window's start at its first row. */
static int64_t item_lo(const args_t *a, const int64_t *item) {
    const int64_t i = item[0], first = a->ctx[i] - a->qlen[i] + item[1];
    const int64_t lo = a->window ? first - a->window + 1 : 0;
    return lo > a->kvstart[i] ? lo : a->kvstart[i];
}

/* A unit's rows loaded: queries scaled, accumulators and softmax state cleared, each row's
 * visible keys [lo, hi); rows past the item's (up to a multiple of VW) see nothing. */
static void unit_start(const args_t *a, const int64_t *item, unit_t *u, ws_t *w) {
    const int64_t D = a->D, i = item[0], first = a->ctx[i] - a->qlen[i] + item[1];
    u->i = i; u->p0 = item[1]; u->np = item[2]; u->h0 = item[3]; u->nh = item[4];
    u->G = a->H / a->Hkv; u->rows = u->np * u->nh * u->G; u->rvec = (u->rows + VW - 1) / VW;
    u->exact = 0; w->nan_bytes = 0;
    for (int64_t hh = 0, c = 0; hh < u->nh; hh++)
        for (int64_t p = 0; p < u->np; p++)
            for (int64_t g = 0; g < u->G; g++) u->head_rows[c++] = (p * u->nh + hh) * u->G + g;
    for (int64_t r = 0; r < u->rvec * VW; r++) {
        w->m[r] = -FLT_MAX; w->l[r] = 0.0f; w->tails[r] = w->tails[MAX_ROWS + r] = 0.0f;
        memset(w->part + r * VW, 0, VW * sizeof(float));
        memset(w->part + (MAX_ROWS + r) * VW, 0, VW * sizeof(float));
        w->lo[r] = w->hi[r] = 0;
        if (r >= u->rows) continue;
        const float *src = a->q + row_offset(a, item, r);
        const float qs = a->scale * (a->kscale ? a->kscale[row_kv_head(a, item, r)] * kv_unit(a) : 1.0f);
        int over = 0;   /* scale folded into q overflowed where (q . k) * scale may not */
        for (int64_t x = 0; x < D; x++) {
            const float y = src[x] * qs;
            over |= !(__builtin_fabsf(y) <= FLT_MAX) & (__builtin_fabsf(src[x]) <= FLT_MAX);
            w->qb[r * D + x] = y;
        }
        w->q_overflow |= over;
        memset(w->acc + r * D, 0, (size_t)D * sizeof(float));
        const int64_t pos = first + r / (u->nh * u->G), lo = a->window ? pos - a->window + 1 : 0;
        w->lo[r] = (int32_t)(lo > a->kvstart[i] ? lo : a->kvstart[i]);
        w->hi[r] = (int32_t)(pos + 1);
    }
    if (unit_gemm(u))   /* accumulators transposed, all zero */
        memset(w->acc, 0, (size_t)(MAX_ROWS * D) * sizeof(float));
    if (unit_gemm(u))   /* rows past the unit's (to a multiple of VW) score 0, masked anyway */
        for (int64_t x = 0; x < D; x++)
            for (int64_t r = 0; r < u->rvec * VW; r++) w->qT[x * MAX_ROWS + r] = r < u->rows ? w->qb[r * D + x] : 0.0f;
}

/* One work unit: split s of item = (request i, p0, np, h0, nh, S). The item's keys
 * [item_lo, hi) (hi: one past the last row's position) are cut into S contiguous ranges whose
 * sizes differ by at most one key; unit s walks range s. S == 1 writes the rows' outputs; else
 * the unit's partial (m[rows], l[rows], acc[rows * D]: max, sum, unnormalised output) goes to
 * part + s * rows * (D + 2) for merge_splits. */
static void attend_unit(const args_t *a, const int64_t *item, int64_t s, ws_t *w, float *part) {
    unit_t u;
    unit_start(a, item, &u, w);
    const int64_t S = item[5], D = a->D, rows = u.rows, lo = item_lo(a, item);
    const int64_t n = a->ctx[u.i] - a->qlen[u.i] + u.p0 + u.np - lo;
    const int64_t c_lo = lo + n * s / S, c_hi = lo + n * (s + 1) / S;
    u.c_lo = c_lo; u.c_hi = c_hi;
    walk_keys(a, &u, w);
    if (w->nan_bytes) {   /* e4m3 NaN bytes were read as finite: the unit again, exactly */
        unit_start(a, item, &u, w);
        u.c_lo = c_lo; u.c_hi = c_hi; u.exact = 1;
        walk_keys(a, &u, w);
    }
    if (S > 1) {
        float *dst = part + s * rows * (D + 2);
        memcpy(dst, w->m, (size_t)rows * sizeof(float));
        memcpy(dst + rows, w->l, (size_t)rows * sizeof(float));
        memcpy(dst + 2 * rows, w->acc, (size_t)(rows * D) * sizeof(float));
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = a->out + row_offset(a, item, r);
        const float inv = row_vscale(a, item, r) / w->l[r];
        for (int64_t x = 0; x < D; x++) dst[x] = w->acc[r * D + x] * inv;
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
            const float *p = part + s * size, wt = exp_nonpos(p[r] - mx), *acc = p + 2 * rows + r * D;
            sum += wt * p[rows + r];
            for (int64_t x = 0; x < D; x++) dst[x] += wt * acc[x];
        }
        const float inv = row_vscale(a, item, r) / sum;
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

/* One thread's scratch in one 64-byte aligned block, or NULL. */
static float *scratch_alloc(int64_t D, ws_t *w) {
    const size_t rows_d = (size_t)MAX_ROWS * (size_t)D;
    const size_t vt = (size_t)CHUNK * WIDEN_HEADS * (size_t)D + (size_t)CHUNK * D + rows_d;
    const size_t floats = 2 * rows_d + 32 + CHUNK * MAX_ROWS + 2 * MAX_ROWS * VW + 7 * MAX_ROWS + vt + 16;
    if (rows_d / MAX_ROWS != (size_t)D || floats > SIZE_MAX / sizeof(float) / 2) return NULL;
    float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!buf) return NULL;
    w->part = buf;                               /* first: vectors at 64-byte alignment */
    w->s = w->part + 2 * MAX_ROWS * VW;
    w->m = w->s + CHUNK * MAX_ROWS;
    w->l = w->m + MAX_ROWS; w->corr = w->l + MAX_ROWS; w->tails = w->corr + MAX_ROWS;
    w->lo = (int32_t *)(w->tails + 2 * MAX_ROWS); w->hi = w->lo + MAX_ROWS;
    w->qb = (float *)(w->hi + MAX_ROWS);
    w->acc = w->qb + rows_d;
    w->vt = (float *)(((uintptr_t)(w->acc + rows_d) + 63) & ~(uintptr_t)63);
    w->kt = w->vt + (size_t)CHUNK * WIDEN_HEADS * D;
    w->qT = w->kt + (size_t)CHUNK * D;
    return buf;
}

/* Units in parallel, then (after the barrier) split items merged in parallel; one scratch
 * buffer per thread. Returns 0, -1 when a thread's scratch could not be allocated, or -3 when
 * a finite query row times its scale overflowed fp32 (the outputs are then not promised). */
static int run_units(const args_t *a, const int64_t *items, int64_t n_items, const int64_t *unit,
                     int64_t units, const int64_t *part_off, float *part, int nthreads) {
    int failed = 0, overflow = 0;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        ws_t w;
        float *buf = scratch_alloc(a->D, &w);
        w.q_overflow = 0;
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++)
            if (buf) attend_unit(a, items + unit[2 * u] * ITEM_COLS, unit[2 * u + 1], &w,
                                 part ? part + part_off[unit[2 * u]] : NULL);
        if (part) {   /* the same value in every thread: all of them meet this loop or none */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t w2 = 0; w2 < n_items; w2++)
                if (items[w2 * ITEM_COLS + 5] > 1 && !failed)
                    merge_splits(a, items + w2 * ITEM_COLS, part + part_off[w2]);
        }
        if (w.q_overflow) {
            #pragma omp atomic write
            overflow = 1;
        }
        free(buf);
    }
    return failed ? -1 : overflow ? -3 : 0;
}

/* q, out: fp32 [T, H, D] contiguous; scores are (q . k) * scale, soft-capped to
 * softcap * tanh(score / softcap) when softcap > 0; window > 0: a query at p sees keys
 * (p - window, p] only. items: int64 [n_items, 6] = (request, p0, np, h0, nh, splits),
 * np * nh * G <= 64, splits >= 1 (the item's key range is walked as that many units, merged
 * at the end). dtype: of K and V (DT_*); kscale, vscale: fp32 [Hkv] for 8-bit K/V, else NULL.
 * Returns 0, or -1 when scratch memory could not be allocated (nothing is then promised of out),
 * -2 from a library built for one (head size, dtype) called with another, or -3 when a finite
 * query times scale (and K's scale) overflowed fp32 (nothing promised: the caller recomputes). */
int vk_attention(const float *q, float *out, const void *k, const void *v, int dtype,
                 const float *kscale, const float *vscale, const int64_t *k_strides, const int64_t *v_strides,
                 const int64_t *slots, const int64_t *tables, int64_t width, int64_t block_size,
                 const int64_t *ctx, const int64_t *qlen, const int64_t *qstart,
                 const int64_t *kvstart, const int64_t *items, int64_t n_items,
                 int64_t H, int64_t Hkv, int64_t D, float scale, int64_t window, float softcap,
                 int nthreads) {
#ifdef VK_ONLY_DT
    if (dtype != VK_ONLY_DT || (VK_ONLY_D && D != VK_ONLY_D)) return -2;   /* built for another shape */
#endif
    args_t a = {q, out, k, v, dtype, kscale, vscale, k_strides, v_strides, slots, tables, width, block_size,
                ctx, qlen, qstart, kvstart, H, Hkv, D, scale, window, softcap};
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
