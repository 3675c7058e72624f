/* decode_floor.c: what one core can do for a decode token row at best, beside what the kernel
 * does (issue 30: is the 8-bit decode bound by its arithmetic?). Not part of the package: built
 * by hand, like decode_profile.c,
 *
 *   cc -O3 -march=native -ffp-contract=fast -Iruntime/attention \
 *      benchmarks/decode_floor.c -o /tmp/decode_floor -lm
 *   /tmp/decode_floor REPS          # -DKEYS=2048 at build: K/V from L2 and L3 instead of L1
 *
 * One token row = 32 query heads over 8 KV heads x 128 (decode_profile's shape): 32 x 128
 * multiply-adds against K and as many against V, 512 vector FMAs with 16 lanes. Timed on one
 * thread, K/V of 32 keys in cache, the fastest of REPS passes, as ns per token row:
 *
 *   fma      512 independent vector FMAs at the core's peak (12 chains in registers)
 *   scores   cpu_varlen's scoring loop alone: keys in pairs, each key's K rows widened into
 *            registers once (the kernel's loaders, 64 elements a call: e4m3 by table in
 *            FP8_BLOCKS order with AVX-512 VBMI, the queries in that order too; else with its
 *            NaN watch), the 4 query rows of a KV head read from memory, each query vector once
 *            for both keys; partial dot products stored, not reduced
 *   values   cpu_varlen's value loop alone: per KV head its 4 rows' accumulators in registers,
 *            D in blocks of 4 vectors, keys in groups of 8 (16 for 8-bit V), each V
 *            vector widened once
 *   pipes    (AVX-512 VBMI) 16 independent FMAs a round alone, then with 8 vpermi2b (the fp8
 *            table's byte permute) or 8 byte interleaves (vpunpcklbw) beside them, as the time
 *            of a round over the FMAs' alone: 1.00 where the other operation runs on pipes the
 *            FMAs do not use
 *
 * Each loop's results are first checked against plain sums of the exactly converted K/V (exit
 * 1 naming the first difference): what is timed computes what the kernel computes.
 *
 * scores + values is the arithmetic an exact fp32 decode cannot avoid with these loaders; the
 * kernel adds the horizontal sums, the softmax and the bookkeeping (decode_profile.c times it
 * whole: `decode_profile DTYPE 1 1 256 1 REPS` for the same shape in cache).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "cpu_varlen_math.h"

#ifndef KEYS
#define KEYS 32
#endif
#define HEADS 8
#define ROWS 4          /* query rows per KV head */
#define D 128
#define ROW_BYTES_MAX (HEADS * D * 4)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* 12 chains of FMAs, `n` FMAs in all (rounded down to 12s); returns a sum so nothing is dropped */
__attribute__((noinline)) static float fma_chains(long n) {
    vf c0 = splat(0.1f), c1 = splat(0.2f), c2 = splat(0.3f), c3 = splat(0.4f), c4 = splat(0.5f), c5 = splat(0.6f);
    vf c6 = splat(0.7f), c7 = splat(0.8f), c8 = splat(0.9f), c9 = splat(1.0f), c10 = splat(1.1f), c11 = splat(1.2f);
    vf m = splat(0.9999f), b = splat(1e-6f);
    for (long i = 0; i < n / 12; i++) {
        c0 = c0 * m + b; c1 = c1 * m + b; c2 = c2 * m + b; c3 = c3 * m + b; c4 = c4 * m + b; c5 = c5 * m + b;
        c6 = c6 * m + b; c7 = c7 * m + b; c8 = c8 * m + b; c9 = c9 * m + b; c10 = c10 * m + b; c11 = c11 * m + b;
        __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7),
                              "+v"(c8), "+v"(c9), "+v"(c10), "+v"(c11), "+v"(m));
    }
    const vf s = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11;
    return s[0];
}

/* the scoring loop's shape (cpu_varlen_tile.h key_partials, D a constant, two keys at a time) */
static ALWAYS void scores_dt(const void *k, const float *q, float *part, const int dt) {
    nan_watch nan = nan_watch_new();
    for (int j = 0; j < KEYS; j += 2)
        for (int hh = 0; hh < HEADS; hh++) {
            vf kr[2][D / VW];
            for (int jj = 0; jj < 2; jj++) {
                const int64_t off = (int64_t)(j + jj) * HEADS * D + hh * D;
                if (dt == DT_E4M3_FINITE) nan_watch_bytes(&nan, (const int8_t *)k + off, D);
                for (int x = 0; x < D / VW; x += 4) ld_kv4(k, off + x * VW, dt, &kr[jj][x]);
            }
            for (int c = 0; c < ROWS; c++) {
                const float *qr = q + (hh * ROWS + c) * D;
                vf sum[2] = {{0}, {0}};
                #pragma GCC unroll 16
                for (int x = 0; x < D / VW; x++) {
                    vf qx = ldf(qr + x * VW);
                    IN_REGISTER(qx);
                    sum[0] += qx * kr[0][x];
                    sum[1] += qx * kr[1][x];
                }
                stf(part + (hh * ROWS + c) * VW, sum[0]);
                stf(part + (HEADS * ROWS + hh * ROWS + c) * VW, sum[1]);
            }
        }
    if (nan_watch_seen(nan)) part[0] = 1.0f;
}

/* the value loop's shape (cpu_varlen_tile.h tile_values / value_block: 4 rows x 4 vectors, keys
 * in groups of 8, 16 for 8-bit V) */
static ALWAYS void values_dt(const void *v, const float *p, float *acc, const int dt) {
    nan_watch nan = nan_watch_new();
    const int group = kv_bytes(dt) == 1 ? 16 : 8;
    for (int g = 0; g < KEYS; g += group)
        for (int hh = 0; hh < HEADS; hh++)
            for (int x0 = 0; x0 < D; x0 += 4 * VW) {
                vf a[ROWS][4];
                for (int b = 0; b < ROWS; b++)
                    for (int c = 0; c < 4; c++) a[b][c] = ldf(acc + (hh * ROWS + b) * D + x0 + c * VW);
                for (int j = g; j < g + group; j++) {
                    const int64_t off = (int64_t)j * HEADS * D + hh * D + x0;
                    if (dt == DT_E4M3_FINITE) nan_watch_bytes(&nan, (const int8_t *)v + off, 4 * VW);
                    vf vv[4];
                    ld_kv4(v, off, dt, vv);
                    for (int b = 0; b < ROWS; b++) {
                        const vf pb = splat(p[j * HEADS * ROWS + hh * ROWS + b]);
                        for (int c = 0; c < 4; c++) a[b][c] += pb * vv[c];
                    }
                }
                for (int b = 0; b < ROWS; b++)
                    for (int c = 0; c < 4; c++) stf(acc + (hh * ROWS + b) * D + x0 + c * VW, a[b][c]);
            }
    if (nan_watch_seen(nan)) acc[0] = 1.0f;
}

/* e4m3 as the kernel's decode reads it: by table (in FP8_BLOCKS order) where the CPU has AVX-512
 * VBMI, else without the NaN step, watching for NaN bytes */
#define FLOOR_E4M3 (FP8_BY_TABLE ? DT_E4M3 : DT_E4M3_FINITE)

/* whether ld_kv4 gives dtype dt in FP8_BLOCKS order (the queries and accumulators follow it) */
static int in_blocks(int dt) { return FP8_BY_TABLE && dt == DT_E4M3; }

/* the n rows of D floats at x from memory order to the loaders' order for dt, or back */
static void to_loader_order(int dt, float *x, int n) {
#if FP8_BY_TABLE
    if (in_blocks(dt)) fp8_transpose_blocks(x, n, D);
#else
    (void)dt; (void)x; (void)n;
#endif
}

#define BY_DTYPE(fn, ...)                                                          \
    __attribute__((noinline)) static void fn##_any(int dt, __VA_ARGS__) {         \
        switch (dt) {                                                              \
        case DT_F32: fn##_dt(x, y, z, DT_F32); break;                              \
        case DT_BF16: fn##_dt(x, y, z, DT_BF16); break;                            \
        case DT_I8: fn##_dt(x, y, z, DT_I8); break;                                \
        default: fn##_dt(x, y, z, FLOOR_E4M3); break;                              \
        }                                                                          \
    }
BY_DTYPE(scores, const void *x, const float *y, float *z)
BY_DTYPE(values, const void *x, const float *y, float *z)

/* 0 when one pass of each loop gave what the kernel's exact conversion (ld_one) and plain
 * fp32 sums give (the last key pair's partials, lane by lane in the loaders' order from the
 * queries ``qd`` in that order, and summed over the lanes, the dot product of ``q`` in memory
 * order; every accumulator after one values pass from zero, put back in memory order), else 1
 * after naming the first difference */
static int check(int dt, const char *name, const void *kv, const float *q, const float *qd,
                 const float *p, float *part, float *acc) {
    scores_any(dt, kv, qd, part);
    for (int x = 0; x < HEADS * ROWS * D; x++) acc[x] = 0.0f;
    values_any(dt, kv, p, acc);
    to_loader_order(dt, acc, HEADS * ROWS);
    for (int jj = 0; jj < 2; jj++)
        for (int r = 0; r < HEADS * ROWS; r++) {
            float krow[D];   /* the K row of key KEYS - 2 + jj for row r, exactly, in the loaders' order */
            double dot = 0.0, dot_size = 0.0, lanes = 0.0;   /* q . K in memory order; the lanes' sum */
            for (int d = 0; d < D; d++) {
                krow[d] = ld_one(kv, (int64_t)(KEYS - 2 + jj) * HEADS * D + (r / ROWS) * D + d, dt);
                const double t = (double)q[r * D + d] * krow[d];
                dot += t; dot_size += t < 0 ? -t : t;
            }
            to_loader_order(dt, krow, 1);
            for (int lane = 0; lane < VW; lane++) {
                double want = 0.0, size = 0.0;
                for (int x = 0; x < D / VW; x++) {
                    const double t = (double)qd[r * D + x * VW + lane] * krow[x * VW + lane];
                    want += t; size += t < 0 ? -t : t;
                }
                const double got = part[(jj * HEADS * ROWS + r) * VW + lane];
                if (got - want > 1e-5 * size + 1e-30 || want - got > 1e-5 * size + 1e-30) {
                    fprintf(stderr, "%s scores: key %d row %d lane %d: %g, want %g\n", name, KEYS - 2 + jj, r, lane, got, want);
                    return 1;
                }
                lanes += got;
            }
            if (lanes - dot > 1e-5 * dot_size + 1e-30 || dot - lanes > 1e-5 * dot_size + 1e-30) {
                fprintf(stderr, "%s scores: key %d row %d: lanes sum to %g, q . K is %g\n", name, KEYS - 2 + jj, r, lanes, dot);
                return 1;
            }
        }
    for (int r = 0; r < HEADS * ROWS; r++)
        for (int d = 0; d < D; d++) {
            double want = 0.0, size = 0.0;
            for (int j = 0; j < KEYS; j++) {
                const double t = (double)p[j * HEADS * ROWS + r] * ld_one(kv, (int64_t)j * HEADS * D + (r / ROWS) * D + d, dt);
                want += t; size += t < 0 ? -t : t;
            }
            const double got = acc[r * D + d];
            if (got - want > 1e-5 * size + 1e-30 || want - got > 1e-5 * size + 1e-30) {
                fprintf(stderr, "%s values: row %d element %d: %g, want %g\n", name, r, d, got, want);
                return 1;
            }
        }
    return 0;
}

#if FP8_BY_TABLE
/* ns per round of 16 independent FMAs with 8 of OP beside them (8 independent chains of it):
 * the fastest of 5 timings of ``rounds`` rounds, every value kept in a register */
#define PIPE_ROUNDS(name, OP)                                                                     \
    __attribute__((noinline)) static double name(long rounds) {                                   \
        const __m512 m = _mm512_set1_ps(0.9999f), e = _mm512_set1_ps(1e-6f);                      \
        const __m512i t0 = _mm512_set1_epi32(0x01020304), t1 = _mm512_set1_epi8(5);               \
        (void)t0; (void)t1;                                                                       \
        double best = 1e30;                                                                       \
        for (int pass = 0; pass < 5; pass++) {                                                    \
            __m512 c[16];                                                                         \
            __m512i x[8];                                                                         \
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) c[i] = _mm512_set1_ps(0.1f * (i + 1)); \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) x[i] = _mm512_set1_epi32(i + 1);  \
            const double t = now();                                                               \
            for (long r = 0; r < rounds; r++) {                                                   \
                _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) c[i] = _mm512_fmadd_ps(c[i], m, e); \
                _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) x[i] = OP;                    \
                __asm__ volatile("" : "+v"(c[0]), "+v"(c[2]), "+v"(c[4]), "+v"(c[6]), "+v"(c[8]),  \
                                      "+v"(c[10]), "+v"(c[12]), "+v"(c[14]));                     \
                __asm__ volatile("" : "+v"(x[0]), "+v"(x[1]), "+v"(x[2]), "+v"(x[3]), "+v"(x[4]),  \
                                      "+v"(x[5]), "+v"(x[6]), "+v"(x[7]));                        \
            }                                                                                     \
            const double ns = (now() - t) / rounds * 1e9;                                         \
            __m512 sum = c[0];                                                                    \
            for (int i = 1; i < 16; i++) sum = _mm512_add_ps(sum, c[i]);                          \
            __m512i all = x[0];                                                                   \
            for (int i = 1; i < 8; i++) all = _mm512_xor_si512(all, x[i]);                        \
            volatile float sink = _mm512_reduce_add_ps(sum) + (float)_mm512_reduce_add_epi32(all); \
            (void)sink;                                                                           \
            best = ns < best ? ns : best;                                                         \
        }                                                                                         \
        return best;                                                                              \
    }
PIPE_ROUNDS(fmas_alone, x[i])
PIPE_ROUNDS(fmas_and_permutes, _mm512_permutex2var_epi8(t0, x[i], t1))
PIPE_ROUNDS(fmas_and_interleaves, _mm512_unpacklo_epi8(x[i], t0))
#endif

/* ns per token row of the fastest of reps passes of loop (scores_any or values_any) */
static double best_of(void (*loop)(int, const void *, const float *, float *), int dt,
                      const void *kv, const float *in, float *out, long reps) {
    double best = 1e30;
    for (long r = 0; r < reps; r++) {
        const double t0 = now();
        loop(dt, kv, in, out);
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    return best / KEYS * 1e9;
}

int main(int argc, char **argv) {
    const long reps = argc == 2 ? atol(argv[1]) : 0;
    if (reps < 1) { fprintf(stderr, "usage: %s REPS (>= 1)\n", argv[0]); return 2; }
    const char *names[] = {"f32", "bf16", "e4m3", "i8"};
    const int dtypes[] = {DT_F32, DT_BF16, FLOOR_E4M3, DT_I8}, sizes[] = {4, 2, 1, 1};
    char *kv = aligned_alloc(64, (size_t)KEYS * ROW_BYTES_MAX);
    float *q = aligned_alloc(64, sizeof(float) * HEADS * ROWS * D), *acc = aligned_alloc(64, sizeof(float) * HEADS * ROWS * D);
    float *qd = aligned_alloc(64, sizeof(float) * HEADS * ROWS * D);   /* q in a dtype's loader order */
    float *p = aligned_alloc(64, sizeof(float) * KEYS * HEADS * ROWS), *part = aligned_alloc(64, sizeof(float) * 2 * HEADS * ROWS * VW);
    if (!kv || !q || !qd || !acc || !p || !part) { fprintf(stderr, "%s: out of memory\n", argv[0]); return 2; }
    for (int x = 0; x < HEADS * ROWS * D; x++) { q[x] = (float)(x % 251) / 251.0f - 0.5f; acc[x] = 0.0f; }
    for (int x = 0; x < KEYS * HEADS * ROWS; x++) p[x] = (float)(x % 13) / 64.0f;

    long n = 0;   /* the FMA peak: enough FMAs for ~50 ms, the fastest of 5 */
    double fma_ns = 1e30;
    for (n = 12000; ; n *= 2) { const double t0 = now(); fma_chains(n); if (now() - t0 > 0.05) break; }
    for (int r = 0; r < 5; r++) {
        const double t0 = now();
        volatile float sink = fma_chains(n);
        (void)sink;
        const double t = (now() - t0) / n * 1e9;
        fma_ns = t < fma_ns ? t : fma_ns;
    }
    const int fmas_per_row = 2 * HEADS * ROWS * D / VW;
    printf("one thread, %d-lane vectors; a token row = %d/%dx%d heads, %d vector FMAs\n", VW, HEADS * ROWS, HEADS, D, fmas_per_row);
    printf("fma peak: %.3f ns per vector FMA, %.1f ns per token row\n", fma_ns, fma_ns * fmas_per_row);
    printf("%-5s %10s %10s %10s %12s\n", "dtype", "scores", "values", "sum", "fma / sum");
    for (int d = 0; d < 4; d++) {
        const size_t bytes = (size_t)KEYS * HEADS * D * sizes[d];
        for (size_t b = 0; b < bytes; b++) kv[b] = (char)((b * 2654435761u) % 0x70 + ((b & 1) << 7));   /* no e4m3 NaN */
        if (sizes[d] == 4) for (size_t x = 0; x < bytes / 4; x++) ((float *)kv)[x] = (float)(x % 97) / 97.0f - 0.5f;
        if (sizes[d] == 2) for (size_t x = 0; x < bytes / 2; x++) ((uint16_t *)kv)[x] = (uint16_t)(0x3C00 + x % 255);
        for (int x = 0; x < HEADS * ROWS * D; x++) qd[x] = q[x];
        to_loader_order(dtypes[d], qd, HEADS * ROWS);
        if (check(dtypes[d], names[d], kv, q, qd, p, part, acc)) return 1;
        const double s = best_of(scores_any, dtypes[d], kv, qd, part, reps), v = best_of(values_any, dtypes[d], kv, p, acc, reps);
        printf("%-5s %7.1f ns %7.1f ns %7.1f ns %11.0f%%\n", names[d], s, v, s + v, 100.0 * fma_ns * fmas_per_row / (s + v));
    }
    printf("(ns per token row; whole kernel, same shape: decode_profile DTYPE 1 1 256 1 REPS)\n");
#if FP8_BY_TABLE
    const long rounds = 200000 * (reps < 50 ? reps : 50);
    const double alone = fmas_alone(rounds);
    printf("pipes: 16 FMAs a round %.2f ns; with 8 vpermi2b beside them %.2fx, with 8 vpunpcklbw %.2fx\n",
           alone, fmas_and_permutes(rounds) / alone, fmas_and_interleaves(rounds) / alone);
#endif
    free(kv); free(q); free(qd); free(acc); free(p); free(part);
    return 0;
}
