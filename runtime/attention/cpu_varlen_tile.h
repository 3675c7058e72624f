/* cpu_varlen_tile.h: one work unit's walk over its keys, tile by tile (included by
 * cpu_varlen.c after its types; native.py hashes it into the build's key).
 *
 * Per tile of n <= CHUNK keys c0 .. c0+n-1:
 *
 *   scores   keys two at a time, for each KV head hh of the item: both keys' K rows (hh) into
 *            registers, then every row r of head hh, its q loaded once for both keys:
 *            part[jj][r] = lanes of q_r * k_jj (D / VW FMAs each); hsum_rows turns VW rows'
 *            partials into VW scores s[j][r0 .. r0+VW) (key-major)
 *   softmax  VW rows at a time over the tile's keys, keys outside a row's [lo, hi) masked:
 *            m' = max(m, max_j s), corr = exp(m - m'), p = exp(s - m'), l = l corr + sum p
 *   values   keys in groups of 8 (16 for 8-bit V); per head hh its rows in blocks of up to 4,
 *            D in blocks of up to 4 vectors: acc (registers) = acc * corr + sum_j p[j][r] * V[j, hh]
 *
 * Each K and V element of the tile is loaded once per block of rows that reads it (once per
 * key for decode: G <= 4 rows a head).
 *
 * Prefill units (one KV head, more than WIDEN_ROWS rows: unit_gemm) walk GEMM-like instead:
 * the tile's K and V widened to fp32 once, scores 4 keys x up to 4 row vectors against the
 * transposed queries qT[d][r] (no horizontal sums), values 4 floats of D x the row vectors into
 * the transposed accumulators acc[d][r], transposed back at the unit's end. Walked with D and the dtype as constants for the usual
 * head sizes (the loops unroll, the K row stays in registers), once generically.
 */
#ifndef VK_CPU_VARLEN_TILE_H
#define VK_CPU_VARLEN_TILE_H

/* A unit of one KV head with more than WIDEN_ROWS rows (prefill): its scores GEMM-like
 * (tile_scores_gemm) from the queries transposed once (w->qT, unit_start). */
static int unit_gemm(const unit_t *u) { return u->nh == 1 && u->np * u->G > WIDEN_ROWS; }

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

/* Prefetch head hh's D elements of the K row at element offset off (< 0: none). */
static ALWAYS void prefetch_head(const void *base, int64_t off, int64_t D, int dt) {
    if (off < 0) return;
    const int64_t bytes = D * kv_bytes(dt);
    const char *row = (const char *)base + off * kv_bytes(dt);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

/* Partial dot products of every row with JN (1 or 2) consecutive keys at koffs[0:JN]: the keys'
 * rows of head hh in registers, each q row loaded once for the JN keys, partials to
 * part[jj][r] (and the scalar tails of a head size that is no multiple of VW to tails[jj][r]).
 * Beside each head's work, that head's slice of the K rows at ahead[0:JN] (PREFETCH_KEYS keys
 * later) is prefetched: spread so, not in one burst per row, the loads of later rows overlap
 * this one's arithmetic. ``voffs`` (or NULL): the same keys' V rows, prefetched now for the
 * tile's values (for 1- and 2-byte K/V the walk's arithmetic otherwise adds to the V loads'
 * time instead of hiding under it; measured in docs/benchmarks.md, issue 30). The K rows sit in
 * a fixed-size array, so in registers: GCC keeps an array sized by D (variable-length, even
 * where D is a constant) in memory, storing every widened K vector (5% of an e4m3 decode). */
static ALWAYS void key_partials(const args_t *a, const unit_t *u, const int64_t *koffs,
                                const int JN, const int64_t *ahead, const int64_t *voffs,
                                ws_t *w, const int64_t D, const int dt) {
    const int64_t nv = D / VW, per_head = u->np * u->G;
    nan_watch nan = nan_watch_new();
    for (int64_t hh = 0; hh < u->nh; hh++) {
        for (int jj = 0; jj < JN; jj++) {
            prefetch_head(a->k, ahead[jj] < 0 ? -1 : ahead[jj] + hh * a->ks[2], D, dt);
            if (voffs) prefetch_head(a->v, voffs[jj] + hh * a->vs[2], D, dt);
        }
        /* the head's vectors KR_VECS at a time (once for D <= KR_VECS * VW), partials added up */
        for (int64_t x0 = 0; x0 == 0 || x0 < nv; x0 += KR_VECS) {
            const int64_t xn = nv - x0 < KR_VECS ? nv - x0 : KR_VECS;
            vf kr[2][KR_VECS];
            for (int jj = 0; jj < JN; jj++) {
                const int64_t off = koffs[jj] + hh * a->ks[2] + x0 * VW;
                if (dt == DT_E4M3_FINITE) nan_watch_bytes(&nan, (const int8_t *)a->k + off, xn * VW);
                int64_t x = 0;
                #pragma GCC unroll 4
                for (; x + 4 <= xn; x += 4) ld_kv4(a->k, off + x * VW, dt, &kr[jj][x]);
                #pragma GCC unroll 8
                for (; x + 2 <= xn; x += 2) ld_kv2(a->k, off + x * VW, dt, &kr[jj][x], &kr[jj][x + 1]);
                if (x < xn) kr[jj][x] = ld_kv(a->k, off + x * VW, dt);
            }
            for (int64_t c = 0; c < per_head; c++) {
                const int64_t r = u->head_rows[hh * per_head + c];
                const float *qr = w->qb + r * D + x0 * VW;
                vf sum[2] = {{0}, {0}};
                #pragma GCC unroll 16
                for (int64_t x = 0; x < xn; x++) {
                    vf qx = ldf(qr + x * VW);
                    IN_REGISTER(qx);   /* loaded once for the JN keys */
                    for (int jj = 0; jj < JN; jj++) sum[jj] += qx * kr[jj][x];
                }
                for (int jj = 0; jj < JN; jj++) {
                    float *part = w->part + (jj * MAX_ROWS + r) * VW;
                    stf(part, x0 ? ldf(part) + sum[jj] : sum[jj]);
                }
            }
        }
        if (D % VW)
            for (int64_t c = 0; c < per_head; c++) {
                const int64_t r = u->head_rows[hh * per_head + c];
                const float *qr = w->qb + r * D;
                for (int jj = 0; jj < JN; jj++) {
                    float t = 0.0f;
                    for (int64_t x = nv * VW; x < D; x++)
                        t += qr[x] * ld_one(a->k, koffs[jj] + hh * a->ks[2] + x, dt);
                    w->tails[jj * MAX_ROWS + r] = t;
                }
            }
    }
    if (dt == DT_E4M3_FINITE && nan_watch_seen(nan)) w->nan_bytes = 1;
}

/* Key j's scores s[j][r] from its partials part[jj][r]: VW rows per transpose tree */
static ALWAYS void key_scores(const args_t *a, const unit_t *u, int64_t j, int jj, ws_t *w,
                              const int64_t D) {
    for (int64_t b = 0; b < u->rvec; b++) {
        vf sc = hsum_rows((const vf *)(w->part + (jj * MAX_ROWS + b * VW) * VW));
        if (D % VW) sc += ldf(w->tails + jj * MAX_ROWS + b * VW);
        if (a->softcap > 0.0f) sc = softcapv(sc, a->softcap);
        stf(w->s + j * MAX_ROWS + b * VW, sc);
    }
}

/* s[j][r] = q_r . K[key j, head of r] (scaled q; soft-capped when the layer has a cap); keys in
 * pairs where both K rows fit in registers (D <= 8 VW). ``knext[0:n_next]``: the next tile's
 * K offsets, for the prefetch across the tile's end. */
static ALWAYS void tile_scores(const args_t *a, const unit_t *u, const int64_t *koffs, int64_t n,
                               const int64_t *knext, int64_t n_next, const int64_t *voffs,
                               ws_t *w, const int64_t D, const int dt) {
#define AHEAD(x) ((x) < n ? koffs[x] : (x) - n < n_next ? knext[(x) - n] : -1)
#define VOFFS (voffs ? voffs + j : NULL)
    int64_t j = 0, ahead[2];
    if (D / VW <= 8 && D % VW == 0)
        for (; j + 2 <= n; j += 2) {
            ahead[0] = AHEAD(j + PREFETCH_KEYS);
            ahead[1] = AHEAD(j + 1 + PREFETCH_KEYS);
            key_partials(a, u, koffs + j, 2, ahead, VOFFS, w, D, dt);
            key_scores(a, u, j, 0, w, D);
            key_scores(a, u, j + 1, 1, w, D);
        }
    for (; j < n; j++) {
        ahead[0] = AHEAD(j + PREFETCH_KEYS);
        key_partials(a, u, koffs + j, 1, ahead, VOFFS, w, D, dt);
        key_scores(a, u, j, 0, w, D);
    }
#undef AHEAD
#undef VOFFS
}

/* The tile's scores become probabilities, VW rows at a time: keys outside a row's [lo, hi)
 * weigh 0; m, l updated; corr = exp(old m - new m) for the values' rescale. */
static ALWAYS void tile_softmax(const unit_t *u, int64_t c0, int64_t n, ws_t *w) {
    for (int64_t b = 0; b < u->rvec; b++) {
        const vi lo = *(const vi *)(w->lo + b * VW), hi = *(const vi *)(w->hi + b * VW);
        const vi whole = (lo <= (int32_t)c0) & (hi >= (int32_t)(c0 + n)) & (lo < hi);
        int all = 1;   /* every lane a real row that sees every key of the tile: no masks */
        for (int t = 0; t < VW; t++) all &= whole[t] != 0;
        float *s = w->s + b * VW;
        vf mx = splat(-FLT_MAX);
        for (int64_t j = 0; j < n; j++) {
            const vi key = (vi){0} + (int32_t)(c0 + j), seen = (key >= lo) & (key < hi);
            const vf sc = ldf(s + j * MAX_ROWS);
            mx = maxv(mx, all ? sc : selectv(seen, sc, splat(-FLT_MAX)));
        }
        const vf m_old = ldf(w->m + b * VW), m_new = maxv(m_old, mx);
        vf sum = {0};
        for (int64_t j = 0; j < n; j++) {
            const vi key = (vi){0} + (int32_t)(c0 + j), seen = (key >= lo) & (key < hi);
            const vf e = expv_nonpos(ldf(s + j * MAX_ROWS) - m_new);
            const vf p = all ? e : selectv(seen, e, (vf){0});
            stf(s + j * MAX_ROWS, p);
            sum += p;
        }
        const vf corr = expv_nonpos(m_old - m_new);
        stf(w->corr + b * VW, corr);
        stf(w->l + b * VW, ldf(w->l + b * VW) * corr + sum);
        stf(w->m + b * VW, m_new);
    }
}

/* Rows rs[0:RB] (one KV head, V at element offset hoff of each key), floats x0 .. x0 + CV*VW
 * of their accumulators: rescaled by corr (``rescale``: the tile's first group), plus n keys'
 * p-weighted V rows (p from ``sp``, key-major), in registers. */
static ALWAYS void value_block(const args_t *a, ws_t *w, const int64_t *rs, const int RB,
                               const int CV, const int64_t *voffs, int64_t hoff, int64_t n,
                               int64_t x0, const int64_t D, const int dt, const float *sp, int rescale) {
    vf acc[4][4];
    nan_watch nan = nan_watch_new();
    for (int b = 0; b < RB; b++)
        for (int c = 0; c < CV; c++)
            acc[b][c] = ldf(w->acc + rs[b] * D + x0 + c * VW) * (rescale ? w->corr[rs[b]] : 1.0f);
    for (int64_t j = 0; j < n; j++) {
        const int64_t off = voffs[j] + hoff + x0;
        vf vv[4];
        if (dt == DT_E4M3_FINITE) nan_watch_bytes(&nan, (const int8_t *)a->v + off, CV * VW);
        int cv = 0;
        if (CV == 4) { ld_kv4(a->v, off, dt, vv); cv = 4; }
        for (; cv + 2 <= CV; cv += 2) ld_kv2(a->v, off + cv * VW, dt, &vv[cv], &vv[cv + 1]);
        if (cv < CV) vv[cv] = ld_kv(a->v, off + cv * VW, dt);
        const float *p = sp + j * MAX_ROWS;
        for (int b = 0; b < RB; b++) {
            const vf pb = splat(p[rs[b]]);
            for (int c = 0; c < CV; c++) acc[b][c] += pb * vv[c];
        }
    }
    for (int b = 0; b < RB; b++)
        for (int c = 0; c < CV; c++) stf(w->acc + rs[b] * D + x0 + c * VW, acc[b][c]);
    if (dt == DT_E4M3_FINITE && nan_watch_seen(nan)) w->nan_bytes = 1;
}

/* value_block over D for RB rows: blocks of 4 vectors, then the remaining vectors, then the
 * scalar tail of a head size that is no multiple of VW. */
static ALWAYS void value_rows(const args_t *a, ws_t *w, const int64_t *rs, const int RB,
                              const int64_t *voffs, int64_t hoff, int64_t n, const int64_t D,
                              const int dt, const float *sp, int rescale) {
    const int64_t nv = D / VW;
    int64_t x0 = 0;
    for (; x0 + 4 * VW <= nv * VW; x0 += 4 * VW) value_block(a, w, rs, RB, 4, voffs, hoff, n, x0, D, dt, sp, rescale);
    switch (nv % 4) {
    case 3: value_block(a, w, rs, RB, 3, voffs, hoff, n, x0, D, dt, sp, rescale); break;
    case 2: value_block(a, w, rs, RB, 2, voffs, hoff, n, x0, D, dt, sp, rescale); break;
    case 1: value_block(a, w, rs, RB, 1, voffs, hoff, n, x0, D, dt, sp, rescale); break;
    }
    for (int64_t x = nv * VW; x < D; x++)
        for (int b = 0; b < RB; b++) {
            float t = w->acc[rs[b] * D + x] * (rescale ? w->corr[rs[b]] : 1.0f);
            for (int64_t j = 0; j < n; j++) t += sp[j * MAX_ROWS + rs[b]] * ld_one(a->v, voffs[j] + hoff + x, dt);
            w->acc[rs[b] * D + x] = t;
        }
}

/* The tile's values into the accumulators: keys in groups of VALUE_GROUP, and within a group
 * each KV head's rows in blocks of up to 4. A group's V rows are all read before the next
 * group's: measured 1.14x faster from memory (one thread, b8 ctx2k 32/8 x 128 fp32) than one
 * pass per (head, block) over the whole tile, which reads 32 rows 4 KiB apart 256 B at a time;
 * within the noise with the V rows in cache. 8-bit V in groups of twice as many keys (still
 * half of fp32's bytes a group): the accumulators are loaded and stored half as often, an e4m3
 * decode 2-3% faster; fp32 measured 5% slower from memory with 16. */
static ALWAYS void tile_values(const args_t *a, const unit_t *u, const int64_t *voffs, int64_t n,
                               ws_t *w, const int64_t D, const int dt) {
    const int64_t per_head = u->np * u->G;
    const int64_t group = kv_bytes(dt) == 1 ? 2 * VALUE_GROUP : VALUE_GROUP;
    for (int64_t g0 = 0; g0 < n; g0 += group) {
        const int64_t ng = n - g0 < group ? n - g0 : group;
        const float *sg = w->s + g0 * MAX_ROWS;
        for (int64_t hh = 0; hh < u->nh; hh++) {
            const int64_t hoff = hh * a->vs[2];
            for (int64_t c = 0; c < per_head; c += 4) {
                int64_t rs[4];
                const int RB = per_head - c < 4 ? (int)(per_head - c) : 4, first = g0 == 0;
                for (int b = 0; b < RB; b++) rs[b] = u->head_rows[hh * per_head + c + b];
                switch (RB) {
                case 4: value_rows(a, w, rs, 4, voffs + g0, hoff, ng, D, dt, sg, first); break;
                case 3: value_rows(a, w, rs, 3, voffs + g0, hoff, ng, D, dt, sg, first); break;
                case 2: value_rows(a, w, rs, 2, voffs + g0, hoff, ng, D, dt, sg, first); break;
                default: value_rows(a, w, rs, 1, voffs + g0, hoff, ng, D, dt, sg, first); break;
                }
            }
        }
    }
}

/* The tile's V rows (n keys at voffs, the unit's nh heads) widened to fp32 once, into
 * vt[j][hh][D] (exactly ld_kv's values): for units with more than WIDEN_ROWS rows a head
 * (prefill), whose value blocks would otherwise each convert every V element again (16 times
 * for 64 rows of one head). tile_values then reads vt as fp32. */
static ALWAYS void tile_widen(const args_t *a, const unit_t *u, const int64_t *voffs, int64_t n,
                              float *vt, const int64_t D, const int dt) {
    const int64_t nv = D / VW;
    for (int64_t j = 0; j < n; j++)
        for (int64_t hh = 0; hh < u->nh; hh++) {
            const int64_t off = voffs[j] + hh * a->vs[2];
            float *dst = vt + (j * u->nh + hh) * D;
            #pragma GCC unroll 16
            for (int64_t x = 0; x < nv; x++) stf(dst + x * VW, ld_kv(a->v, off + x * VW, dt));
            for (int64_t x = nv * VW; x < D; x++) dst[x] = ld_one(a->v, off + x, dt);
        }
}

/* JB keys' scores against RV vectors of rows, GEMM-like: for each d, JB K elements broadcast
 * times the RV row vectors of qT[d] (the unit's queries transposed, scaled), into JB x RV
 * accumulators, s[j][r] written key-major as they are (no horizontal sums). */
static ALWAYS void gemm_block(const args_t *a, const float *const *krow, const int JB,
                              const int RV, float *s, const float *qT, const int64_t D) {
    vf acc[4][4];
    for (int jj = 0; jj < JB; jj++)
        for (int b = 0; b < RV; b++) acc[jj][b] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf qv[4];
        for (int b = 0; b < RV; b++) qv[b] = ldf(qT + d * MAX_ROWS + b * VW);
        for (int jj = 0; jj < JB; jj++) {
            const vf kx = splat(krow[jj][d]);
            for (int b = 0; b < RV; b++) acc[jj][b] += kx * qv[b];
        }
    }
    for (int jj = 0; jj < JB; jj++)
        for (int b = 0; b < RV; b++)
            stf(s + jj * MAX_ROWS + b * VW, a->softcap > 0.0f ? softcapv(acc[jj][b], a->softcap) : acc[jj][b]);
}

/* JB keys against all rvec row vectors, at most four at a time (rvec reaches MAX_ROWS / VW:
 * 4 with AVX-512, 8 where VW is 8) */
static ALWAYS void gemm_keys(const args_t *a, const float *const *krow, const int JB, int64_t rvec,
                             float *s, const float *qT, const int64_t D) {
    for (int64_t b0 = 0; b0 < rvec; b0 += 4) {
        float *sb = s + b0 * VW;
        const float *qb = qT + b0 * VW;
        switch (rvec - b0) {
        case 1: gemm_block(a, krow, JB, 1, sb, qb, D); break;
        case 2: gemm_block(a, krow, JB, 2, sb, qb, D); break;
        case 3: gemm_block(a, krow, JB, 3, sb, qb, D); break;
        default: gemm_block(a, krow, JB, 4, sb, qb, D); break;
        }
    }
}

/* tile_scores for a unit of one KV head with many rows (unit_gemm): the tile's K rows as fp32
 * (in place for fp32 K, else widened once into w->kt), scores four keys at a time. */
static ALWAYS void tile_scores_gemm(const args_t *a, const unit_t *u, const int64_t *koffs,
                                    int64_t n, ws_t *w, const int64_t D, const int dt) {
    const float *krow[CHUNK];
    for (int64_t j = 0; j < n; j++) {
        float *dst = w->kt + j * D;
        const int64_t nv = D / VW;
        #pragma GCC unroll 16
        for (int64_t x = 0; x < nv; x++) stf(dst + x * VW, ld_kv(a->k, koffs[j] + x * VW, dt));
        for (int64_t x = nv * VW; x < D; x++) dst[x] = ld_one(a->k, koffs[j] + x, dt);
        krow[j] = dst;
    }
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) gemm_keys(a, krow + j, 4, u->rvec, w->s + j * MAX_ROWS, w->qT, D);
    switch (n - j) {
    case 3: gemm_keys(a, krow + j, 3, u->rvec, w->s + j * MAX_ROWS, w->qT, D); break;
    case 2: gemm_keys(a, krow + j, 2, u->rvec, w->s + j * MAX_ROWS, w->qT, D); break;
    case 1: gemm_keys(a, krow + j, 1, u->rvec, w->s + j * MAX_ROWS, w->qT, D); break;
    }
}

/* Floats x0 .. x0+XB of RV row vectors of the transposed accumulators accT[x][r] (w->acc in
 * unit_gemm units): rescaled by the tile's corr, plus the n keys' p[j][r] (vector loads, the
 * scores' key-major layout) times V[j][x] broadcast. */
static ALWAYS void gemm_values_block(const float *const *vrow, int64_t n, const int XB,
                                     const int RV, int64_t r0, int64_t x0, ws_t *w) {
    vf acc[4][4], corr[4];
    for (int b = 0; b < RV; b++) corr[b] = ldf(w->corr + r0 + b * VW);
    for (int xb = 0; xb < XB; xb++)
        for (int b = 0; b < RV; b++) acc[xb][b] = ldf(w->acc + (x0 + xb) * MAX_ROWS + r0 + b * VW) * corr[b];
    for (int64_t j = 0; j < n; j++) {
        vf pv[4];
        for (int b = 0; b < RV; b++) pv[b] = ldf(w->s + j * MAX_ROWS + r0 + b * VW);
        for (int xb = 0; xb < XB; xb++) {
            const vf vx = splat(vrow[j][x0 + xb]);
            for (int b = 0; b < RV; b++) acc[xb][b] += vx * pv[b];
        }
    }
    for (int xb = 0; xb < XB; xb++)
        for (int b = 0; b < RV; b++) stf(w->acc + (x0 + xb) * MAX_ROWS + r0 + b * VW, acc[xb][b]);
}

static ALWAYS void gemm_values_rows(const float *const *vrow, int64_t n, const int XB, int64_t rvec,
                                    int64_t x0, ws_t *w) {
    for (int64_t b0 = 0; b0 < rvec; b0 += 4) {   /* at most four row vectors at a time */
        switch (rvec - b0) {
        case 1: gemm_values_block(vrow, n, XB, 1, b0 * VW, x0, w); break;
        case 2: gemm_values_block(vrow, n, XB, 2, b0 * VW, x0, w); break;
        case 3: gemm_values_block(vrow, n, XB, 3, b0 * VW, x0, w); break;
        default: gemm_values_block(vrow, n, XB, 4, b0 * VW, x0, w); break;
        }
    }
}

/* tile_values for a unit_gemm unit: the tile's V rows widened to fp32 once (w->vt), then D
 * four floats at a time against all rows (the transposed accumulators in w->acc). */
static ALWAYS void tile_values_gemm(const args_t *a, const unit_t *u, const int64_t *voffs,
                                    int64_t n, ws_t *w, const int64_t D, const int dt) {
    const float *vrow[CHUNK];
    tile_widen(a, u, voffs, n, w->vt, D, dt);
    for (int64_t j = 0; j < n; j++) vrow[j] = w->vt + j * D;
    int64_t x0 = 0;
    for (; x0 + 4 <= D; x0 += 4) gemm_values_rows(vrow, n, 4, u->rvec, x0, w);
    for (; x0 < D; x0++) gemm_values_rows(vrow, n, 1, u->rvec, x0, w);
}

/* Keys [u->c_lo, u->c_hi) folded into the unit's softmax state and accumulators, tile by tile;
 * nothing outside that range is read. D and dt are constants in the copies walk_keys makes. */
static ALWAYS void walk_keys_d(const args_t *a, const unit_t *u, ws_t *w, const int64_t D,
                               const int dt) {
    int64_t offs[2][2][CHUNK];    /* [tile parity][K, V][key]: this tile's and the next's */
    /* 2- and 1-byte V of a unit with many rows a head: each tile widened once (tile_widen),
     * the values read from w->vt as fp32 through wa (vt's strides) and woffs */
    const int widen = dt != DT_F32 && u->np * u->G > WIDEN_ROWS, gemm = unit_gemm(u);
    /* e4m3 decode without the table (no AVX-512 VBMI) reads its rows without the NaN step,
     * checking them for NaN bytes instead (attend_unit walks the unit again exactly if one is
     * met); by table the reading is exact as it is */
    const int finite = !FP8_BY_TABLE && dt == DT_E4M3 && !widen && !gemm && !u->exact;
    /* fp8 by table: ld_kv4 gives K and V in FP8_BLOCKS order, so the queries the scores read go
     * into that order first, and the accumulators the values build come back from it last */
#if FP8_BY_TABLE
    const int blocks = (dt == DT_E4M3 || dt == DT_E5M2) && !gemm;
    if (blocks) fp8_transpose_blocks(w->qb, u->rows, D);
#endif
    args_t wa = *a;
    const int64_t wstrides[3] = {0, u->nh * D, D};
    int64_t woffs[CHUNK];
    if (widen) {
        wa.v = w->vt; wa.vs = wstrides;
        for (int64_t j = 0; j < CHUNK; j++) woffs[j] = j * u->nh * D;
    }
    int64_t n = u->c_hi - u->c_lo < CHUNK ? u->c_hi - u->c_lo : CHUNK;
    tile_offsets(a, a->ks, u->i, u->c_lo, n, u->h0, offs[0][0]);
    tile_offsets(a, a->vs, u->i, u->c_lo, n, u->h0, offs[0][1]);
    for (int64_t c0 = u->c_lo, t = 0; c0 < u->c_hi; c0 += CHUNK, t ^= 1) {
        n = u->c_hi - c0 < CHUNK ? u->c_hi - c0 : CHUNK;
        const int64_t c1 = c0 + CHUNK, n1 = u->c_hi - c1 < CHUNK ? u->c_hi - c1 : CHUNK;
        if (n1 > 0) {
            tile_offsets(a, a->ks, u->i, c1, n1, u->h0, offs[t ^ 1][0]);
            tile_offsets(a, a->vs, u->i, c1, n1, u->h0, offs[t ^ 1][1]);
        }
        const int64_t *vpre = kv_bytes(dt) <= PREFETCH_V_BYTES ? offs[t][1] : NULL;
        if (gemm) tile_scores_gemm(a, u, offs[t][0], n, w, D, dt);
        else if (finite) tile_scores(a, u, offs[t][0], n, offs[t ^ 1][0], n1 > 0 ? n1 : 0, vpre, w, D, DT_E4M3_FINITE);
        else tile_scores(a, u, offs[t][0], n, offs[t ^ 1][0], n1 > 0 ? n1 : 0, vpre, w, D, dt);
        tile_softmax(u, c0, n, w);
        if (gemm) {
            tile_values_gemm(a, u, offs[t][1], n, w, D, dt);
        } else if (widen) {
            tile_widen(a, u, offs[t][1], n, w->vt, D, dt);
            tile_values(&wa, u, woffs, n, w, D, DT_F32);
        } else if (finite) {
            tile_values(a, u, offs[t][1], n, w, D, DT_E4M3_FINITE);
        } else {
            tile_values(a, u, offs[t][1], n, w, D, dt);
        }
    }
#if FP8_BY_TABLE
    if (blocks && !widen) fp8_transpose_blocks(w->acc, u->rows, D);
#endif
    if (gemm) {   /* accT[x][r] back to acc[r][x], through qb (no longer needed) */
        for (int64_t r = 0; r < u->rows; r++)
            for (int64_t x = 0; x < D; x++) w->qb[r * D + x] = w->acc[x * MAX_ROWS + r];
        memcpy(w->acc, w->qb, (size_t)(u->rows * D) * sizeof(float));
    }
}

#define WALK_DTYPES(D)                                                              \
    switch (a->dtype) {                                                             \
    case DT_F32: walk_keys_d(a, u, w, D, DT_F32); return;                           \
    case DT_BF16: walk_keys_d(a, u, w, D, DT_BF16); return;                         \
    case DT_E4M3: walk_keys_d(a, u, w, D, DT_E4M3); return;                         \
    case DT_E5M2: walk_keys_d(a, u, w, D, DT_E5M2); return;                         \
    case DT_I8: walk_keys_d(a, u, w, D, DT_I8); return;                             \
    default: walk_keys_d(a, u, w, D, DT_F16); return;                               \
    }

/* walk_keys_d compiled for the usual head sizes with D a constant (the dot products and
 * value blocks unroll, the K row stays in registers) and once for any other D; each for the
 * six K/V dtypes. With VK_ONLY_DT (and VK_ONLY_D, 0 for any D) defined: that one copy only. */
static void walk_keys(const args_t *a, const unit_t *u, ws_t *w) {
#ifdef VK_ONLY_DT   /* a build for one (head size, dtype): native.py's per-shape libraries */
    walk_keys_d(a, u, w, VK_ONLY_D ? VK_ONLY_D : a->D, VK_ONLY_DT);
#else
    switch (a->D) {
    case 32: WALK_DTYPES(32)
    case 64: WALK_DTYPES(64)
    case 128: WALK_DTYPES(128)
    case 256: WALK_DTYPES(256)
    }
    WALK_DTYPES(a->D)
#endif
}

#endif
