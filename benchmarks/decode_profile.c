/* decode_profile.c: cpu_varlen.c's decode walk timed from C, K/V in cache or from memory
 * (issue 33: what limits the bf16 decode rows). Not part of the package: built by hand,
 *
 *   cc -O3 -march=native -fopenmp -ffp-contract=fast -Iruntime/attention \
 *      benchmarks/decode_profile.c -o /tmp/decode_profile -lm
 *   /tmp/decode_profile DTYPE THREADS BATCH CTX COPIES REPS [BLOCK [huge]]
 *                                                    # DTYPE: f32 | bf16 | e4m3 | e5m2 | i8
 *
 * One call = a decode step of BATCH requests x CTX keys, 32/8 heads x 128, vmem per-layer
 * layout (K and V [BATCH, CTX, 8, 128] each), one item per request (every KV head, whole token
 * rows), as the backend issues it. With BLOCK > 0, the paged layout instead: blocks of BLOCK
 * tokens, request i's block b at pool block b x BATCH + i (the requests' blocks interleaved,
 * as benchmarks/attention.py's paged pool holds them), read through the block table. Both
 * layouts hold the same K/V (a function of request, token and element), so their outputs are
 * equal. ``huge`` asks the kernel for 2 MiB pages under the K/V (madvise MADV_HUGEPAGE; the
 * line after the timing says how much it got): what 4 KiB pages' TLB misses cost. COPIES disjoint copies of the K/V are walked in turn: 1 keeps
 * a small problem in cache, enough copies (> 1 GiB in all) make every call read from memory.
 * Prints the fastest and the median call as ns per token row (one row = every KV head's K and
 * V of one token) and the K/V bytes read per second. For instruction counts run it under
 * `valgrind --tool=callgrind` from an AVX2 build (-march=haswell): valgrind cannot run AVX-512.
 * e4m3, e5m2 and i8 (issue 30: what limits the 8-bit decode rows) read one byte per element
 * with a scale of 1 per KV head; their bytes are drawn below 0x70 in magnitude, so that none
 * is a NaN or an infinity of either fp8.
 */
#include <stdio.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>
#include "cpu_varlen.c"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmp(const void *x, const void *y) { double a = *(const double *)x, b = *(const double *)y; return (a > b) - (a < b); }

int main(int argc, char **argv) {
    if (argc < 7 || argc > 9 || (argc == 9 && strcmp(argv[8], "huge"))) {
        fprintf(stderr, "usage: %s f32|bf16|e4m3|e5m2|i8 THREADS BATCH CTX COPIES REPS [BLOCK [huge]]\n", argv[0]);
        return 2;
    }
    const char *names[] = {"f32", "bf16", "e4m3", "e5m2", "i8"};
    const int dtypes[] = {DT_F32, DT_BF16, DT_E4M3, DT_E5M2, DT_I8}, sizes[] = {4, 2, 1, 1, 1};
    int which = -1;
    for (int i = 0; i < 5; i++) if (!strcmp(argv[1], names[i])) which = i;
    if (which < 0) { fprintf(stderr, "%s: DTYPE must be f32, bf16, e4m3, e5m2 or i8, got %s\n", argv[0], argv[1]); return 2; }
    const int bf16 = which == 1, dtype = dtypes[which], threads = atoi(argv[2]);
    const int64_t B = atoll(argv[3]), ctx = atoll(argv[4]), copies = atoll(argv[5]), reps = atoll(argv[6]);
    const int64_t bs = argc >= 8 ? atoll(argv[7]) : 0, width = bs > 0 ? (ctx + bs - 1) / bs : 0;
    const int huge = argc == 9;
    const int64_t H = 32, Hkv = 8, D = 128, eb = sizes[which];
    const int64_t elems = (bs > 0 ? B * width * bs : B * ctx) * Hkv * D;   /* per copy, K or V */
    if (B < 1 || ctx < 1 || copies < 1 || reps < 1 || threads < 1 || bs < 0) {
        fprintf(stderr, "%s: THREADS, BATCH, CTX, COPIES and REPS must be >= 1, BLOCK >= 0\n", argv[0]); return 2;
    }
    /* the K/V copies are the run's memory: checked against what is available before any is taken */
    const double kv_bytes = 2.0 * copies * elems * eb;
    const double available_bytes = (double)sysconf(_SC_AVPHYS_PAGES) * sysconf(_SC_PAGESIZE);
    if (kv_bytes > 0.8 * available_bytes) {
        fprintf(stderr, "%s: %.0f bytes of K/V asked, %.0f available (80%% allowed): fewer COPIES\n",
                argv[0], kv_bytes, available_bytes);
        return 2;
    }
    const size_t align = huge ? (size_t)2 << 20 : 64, alloc = ((size_t)kv_bytes + align - 1) / align * align;
    char *kv = aligned_alloc(align, alloc);
    if (!kv) { fprintf(stderr, "%s: could not allocate %.0f bytes of K/V\n", argv[0], kv_bytes); return 2; }
    if (huge && madvise(kv, alloc, MADV_HUGEPAGE)) perror("madvise(MADV_HUGEPAGE)");
    memset(kv, 0, alloc);
    const int64_t row = Hkv * D;
    for (int64_t x = 0; x < 2 * copies * B * ctx * row; x++) {   /* small values, bf16-exact */
        const int64_t e = x % row, t = x / row % ctx, i = x / row / ctx % B, ck = x / row / ctx / B;
        const int64_t at = ck * elems + (bs > 0 ? ((t / bs * B + i) * bs + t % bs) * row : (i * ctx + t) * row) + e;
        float f = (float)((x * 2654435761u) % 1000) / 1000.0f - 0.5f; uint32_t b; memcpy(&b, &f, 4);
        if (eb == 1) ((uint8_t *)kv)[at] = (uint8_t)((x * 2654435761u) % 0x70 + ((x & 1) << 7));   /* no NaN */
        else if (bf16) ((uint16_t *)kv)[at] = (uint16_t)(b >> 16); else ((float *)kv)[at] = f;
    }
    float scales[8] = {1, 1, 1, 1, 1, 1, 1, 1};   /* one per KV head (Hkv = 8) */
    const float *kscale = eb == 1 ? scales : NULL;
    float *q = malloc(sizeof(float) * B * H * D), *out = malloc(sizeof(float) * B * H * D);
    for (int64_t x = 0; x < B * H * D; x++) q[x] = (float)((x * 40503u) % 256) / 256.0f - 0.5f;   /* bf16-exact */
    int64_t st[3] = {(bs > 0 ? bs : ctx) * Hkv * D, Hkv * D, D}, *slots = malloc(8 * B), *cl = malloc(8 * B),
            *ql = malloc(8 * B), *qs = malloc(8 * B), *ks = malloc(8 * B), *items = malloc(8 * ITEM_COLS * B);
    int64_t *tables = bs > 0 ? malloc(8 * B * width) : NULL;
    for (int64_t i = 0; i < B; i++) {
        slots[i] = i; cl[i] = ctx; ql[i] = 1; qs[i] = i; ks[i] = 0;
        int64_t it[ITEM_COLS] = {i, 0, 1, 0, Hkv, 1};
        memcpy(items + i * ITEM_COLS, it, sizeof it);
        for (int64_t b = 0; b < width; b++) tables[i * width + b] = b * B + i;
    }
    double *t = malloc(sizeof(double) * reps);
    for (int64_t r = -copies; r < reps; r++) {   /* the first round of copies untimed */
        const int64_t c = (r + copies) % copies;
        const char *k = kv + 2 * c * elems * eb, *v = k + elems * eb;
        const double t0 = now();
        if (vk_attention(q, out, k, v, dtype, kscale, kscale, st, st, bs > 0 ? NULL : slots, tables, width, bs,
                         cl, ql, qs, ks, items, B, H, Hkv, D, 0.088f, 0, 0.0f, threads)) return 1;
        if (r >= 0) t[r] = now() - t0;
    }
    qsort(t, (size_t)reps, sizeof(double), cmp);
    const double rows = (double)(B * ctx), bytes = 2.0 * B * ctx * Hkv * D * eb;   /* what a call reads */
    double out_sum = 0.0;   /* the last call's outputs (the last copy's K/V), for comparing runs */
    for (int64_t x = 0; x < B * H * D; x++) out_sum += out[x];
    printf("%s%s threads=%d b%lld ctx%lld copies=%lld: min %.1f ns/row (%.1f GB/s), median %.1f ns/row (%.1f GB/s); out_sum=%.9g\n",
           argv[1], bs > 0 ? " paged" : "", threads, (long long)B, (long long)ctx, (long long)copies, 1e9 * t[0] / rows, bytes / t[0] / 1e9,
           1e9 * t[reps / 2] / rows, bytes / t[reps / 2] / 1e9, out_sum);
    if (huge) {   /* what the kernel gave: AnonHugePages of this process */
        long long kib = -1;
        char line[256];
        FILE *f = fopen("/proc/self/smaps_rollup", "r");
        while (f && fgets(line, sizeof line, f))
            if (sscanf(line, "AnonHugePages: %lld kB", &kib) == 1) break;
        if (f) fclose(f);
        printf("huge pages: %lld MiB under %.0f MiB of K/V\n", kib < 0 ? -1 : kib / 1024, kv_bytes / (1 << 20));
    }
    return 0;
}
