/* yardstick.c: the native loops of benchmarks/yardstick.py.
 *
 * vk_read_sum, STREAM's read kernel: every float of p[0:n] is loaded once and added into one of four
 * vector accumulators per thread (OpenMP, a static share of the array each), nothing is
 * written. The sum is returned, so no compiler may drop a load: the yardstick checks it
 * against the exact count of ones it put in the array. Built by runtime/attention/native.py
 * with the attention kernel's flags (-O3 -march=native -fopenmp) and its vector type (the
 * same path from here in the source tree and in the installed package).
 */
#include "../runtime/attention/cpu_varlen_math.h"

double vk_read_sum(const float *p, int64_t n, int nthreads) {
    const int64_t blocks = n / (4 * VW);
    double total = 0.0;
    #pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const float *x = p + b * 4 * VW;
            a0 += ldf(x);
            a1 += ldf(x + VW);
            a2 += ldf(x + 2 * VW);
            a3 += ldf(x + 3 * VW);
        }
        const vf s = (a0 + a1) + (a2 + a3);
        for (int t = 0; t < VW; t++) total += s[t];
    }
    for (int64_t i = blocks * 4 * VW; i < n; i++) total += p[i];
    return total;
}

/* The arithmetic roof: each thread runs `iters` rounds of 12 independent vector FMAs (no
 * loads, no dependency shorter than 12 FMAs), so it runs at the core's FMA throughput. Returns
 * a sum of the accumulators so none can be dropped; the flops are threads x iters x 12 x VW x 2. */
double vk_fma_peak(int64_t iters, int nthreads) {
    double total = 0.0;
    #pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        vf acc[12];
        const vf mul = splat(0.999999f), add = splat(1e-7f);
        for (int t = 0; t < 12; t++) acc[t] = splat(1.0f + t);
        for (int64_t i = 0; i < iters; i++) {
            #pragma GCC unroll 12
            for (int t = 0; t < 12; t++) acc[t] = acc[t] * mul + add;
        }
        vf s = acc[0];
        for (int t = 1; t < 12; t++) s += acc[t];
        for (int t = 0; t < VW; t++) total += s[t];
    }
    return total;
}

/* VW, the fp32 lanes of the vector type this build uses (for counting vk_fma_peak's flops). */
int vk_vector_lanes(void) { return VW; }
