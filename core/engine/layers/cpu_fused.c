/* The small layers of an eager forward on a CPU, one pass each (layers/cpu_fused.py): RMSNorm
 * (with the residual add before it), SiLU-and-multiply and the rotary embedding. A prompt chunk
 * of hundreds of tokens otherwise runs them as 3-5 torch ops each, every op another pass over
 * [tokens, hidden] floats. The CPU graph (cpu_graph/graph.c) has the same arithmetic as nodes
 * for the steps it replays; these run in the steps it does not.
 *
 * Built once per machine with -march=native and -ffp-contract=off: every product and sum is
 * rounded where torch's eager ops round it (RMSNorm's sum of squares aside: its order differs).
 * Every tensor is float32; rows are split over the threads as torch would.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "ek_math.h" /* engine/cpu_graph: the exp graph.c's SiLU uses */

/* out = w * (h / rms(h)) per row, h = x + add (written to h) when add is given, else h = x */
void ek_rms_norm(const float *x, int64_t ldx, const float *add, int64_t lda, float *h,
                 int64_t ldh, const float *w, int64_t rows, int64_t dim, float eps, float *out,
                 int64_t ldo, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        if (add) {
            const float *ar = add + r * lda;
            float *hr = h + r * ldh;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) hr[i] = ar[i] + xr[i];
            xr = hr;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * ldo;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* out = silu(gate) * up, rows of n */
void ek_silu_mul(const float *gate, int64_t ldg, const float *up, int64_t ldu, float *out,
                 int64_t ldo, int64_t rows, int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * ldg, *u = up + r * ldu;
        float *o = out + r * ldo;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + ek_vexp(-g[i])) * u[i];
    }
}

/* out[t, h] = x[t, h] * cos[t] + (x2, x1)[t, h] * sin[t] for each of `heads` heads of d values
 * (the half-split layout; sin's first half already negated, as layers/rotary.py makes it) */
void ek_rotary(const float *x, int64_t ldx, int64_t heads, int64_t d, const float *cos,
               const float *sin, float *out, int64_t rows, int nthreads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t hd = 0; hd < heads; hd++) {
            const float *xr = x + r * ldx + hd * d;
            float *o = out + (r * heads + hd) * d;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i] * c[i], b = xr[i + half] * s[i];
                o[i] = a + b;
            }
#pragma omp simd
            for (int64_t i = half; i < d; i++) {
                const float a = xr[i] * c[i], b = xr[i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}
