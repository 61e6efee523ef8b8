/* CPU graphs: the executor and the core's own nodes (embedding, RMSNorm with the residual add,
 * rotary embedding with the optional q/k norms, SiLU-and-multiply). See graph.h.
 *
 * Built once per machine with -march=native (keyed by the CPU's flags: engine.native), so the
 * loops below vectorize for the CPU that runs them. Every activation is float32.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "graph.h"
#include "ek_math.h"

int ek_graph_abi(void) { return EK_GRAPH_ABI; }

/* ---------------------------------------------------------------- the graph */

typedef struct {
    ek_node_fn fn;
    const void *args;
} node_t;

typedef struct {
    int n, cap;
    node_t *nodes;
    double *times; /* when set: seconds each node took (to the barrier after it), added up */
    uint64_t runs;
} ek_graph_t;

ek_graph_t *ek_graph_new(void) { return calloc(1, sizeof(ek_graph_t)); }

void ek_graph_free(ek_graph_t *g) {
    if (!g) return;
    free(g->nodes);
    free(g);
}

int ek_graph_add(ek_graph_t *g, ek_node_fn fn, const void *args) {
    if (!fn) return -1;
    if (g->n == g->cap) {
        int cap = g->cap ? 2 * g->cap : 64;
        node_t *p = realloc(g->nodes, (size_t)cap * sizeof(node_t));
        if (!p) return -4;
        g->nodes = p;
        g->cap = cap;
    }
    g->nodes[g->n].fn = fn;
    g->nodes[g->n].args = args;
    return g->n++;
}

int ek_graph_size(const ek_graph_t *g) { return g->n; }

/* times[i] += the seconds node i takes in each run from now on (NULL: stop) */
void ek_graph_profile(ek_graph_t *g, double *times) { g->times = times; }

/* One decode step: every node in order on nthreads threads, a barrier after each. */
void ek_graph_run(ek_graph_t *g, int nthreads, int64_t rows, const int64_t *input_ids,
                  const int64_t *positions, const int64_t *out_cache_loc,
                  const int64_t *req_rows, const int64_t *seq_lens, const int32_t *req_to_token,
                  int64_t req_to_token_stride) {
    const ek_step_t step = {rows, input_ids, positions, out_cache_loc, req_rows, seq_lens,
                            req_to_token, req_to_token_stride, ++g->runs};
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        double t0 = g->times && tid == 0 ? omp_get_wtime() : 0.0;
        for (int i = 0; i < g->n; i++) {
            g->nodes[i].fn(g->nodes[i].args, &step, tid, nth);
#pragma omp barrier
            if (g->times && tid == 0) {
                const double t1 = omp_get_wtime();
                g->times[i] += t1 - t0;
                t0 = t1;
            }
        }
    }
}

/* ---------------------------------------------------------------- nodes */

typedef struct {
    const float *table; /* [vocab, dim] */
    int64_t dim;
    float *out;
    int64_t ldo;
} embed_args;

void ek_node_embed(const void *a_, const ek_step_t *s, int tid, int nth) {
    const embed_args *a = a_;
    int64_t r0, r1;
    ek_split(s->rows, tid, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++)
        memcpy(a->out + r * a->ldo, a->table + s->input_ids[r] * a->dim,
               (size_t)a->dim * sizeof(float));
}

typedef struct {
    float *res; /* the residual stream [rows, dim]: res += add first, when add is given */
    int64_t ldr;
    const float *add;
    int64_t lda;
    const float *w; /* [dim] */
    int64_t dim;
    float eps;
    float *out; /* w * res / rms(res) */
    int64_t ldo;
} rmsnorm_args;

static inline void rmsnorm_row(const float *x, const float *w, int64_t dim, float eps,
                               float *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}

void ek_node_rmsnorm(const void *a_, const ek_step_t *s, int tid, int nth) {
    const rmsnorm_args *a = a_;
    int64_t r0, r1;
    ek_split(s->rows, tid, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        float *x = a->res + r * a->ldr;
        if (a->add) {
            const float *y = a->add + r * a->lda;
#pragma omp simd
            for (int64_t i = 0; i < a->dim; i++) x[i] = x[i] + y[i];
        }
        rmsnorm_row(x, a->w, a->dim, a->eps, a->out + r * a->ldo);
    }
}

typedef struct {
    float *x;            /* [rows, ldx]: heads of head_dim side by side (q heads, then k) */
    int64_t ldx;
    int64_t heads;       /* heads rotated (q and k) */
    int64_t head_dim;
    const float *cos_sin; /* [2, max_pos, head_dim / 2]: cos then sin per position */
    int64_t max_pos;
    const float *q_norm; /* [head_dim] per-head RMSNorm of the first q_heads (Qwen3), or NULL */
    const float *k_norm; /* ... of the others */
    int64_t q_heads;
    float eps;
} rope_args;

/* the half-split ("neox") rotation HF Llama checkpoints use: (x1, x2) ->
 * (x1 c - x2 s, x2 c + x1 s), each product rounded as torch rounds it */
void ek_node_rope(const void *a_, const ek_step_t *s, int tid, int nth) {
    const rope_args *a = a_;
    const int64_t D = a->head_dim, half = D / 2, items = s->rows * a->heads;
    int64_t i0, i1;
    ek_split(items, tid, nth, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) {
        const int64_t r = it / a->heads, h = it % a->heads;
        float *x = a->x + r * a->ldx + h * D;
        const float *norm = h < a->q_heads ? a->q_norm : a->k_norm;
        if (norm) rmsnorm_row(x, norm, D, a->eps, x);
        const float *c = a->cos_sin + s->positions[r] * half;
        const float *sn = a->cos_sin + (a->max_pos + s->positions[r]) * half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            const float a1 = x1 * c[i], b1 = x2 * sn[i], a2 = x2 * c[i], b2 = x1 * sn[i];
            x[i] = a1 - b1;
            x[i + half] = a2 + b2;
        }
    }
}

typedef struct {
    const float *gate_up; /* [rows, ldg]: gate [inter] then up [inter] */
    int64_t ldg;
    int64_t inter;
    float *out; /* silu(gate) * up */
    int64_t ldo;
} silu_mul_args;

#define SILU_CHUNK 256

void ek_node_silu_mul(const void *a_, const ek_step_t *s, int tid, int nth) {
    const silu_mul_args *a = a_;
    const int64_t per_row = (a->inter + SILU_CHUNK - 1) / SILU_CHUNK;
    int64_t i0, i1;
    ek_split(s->rows * per_row, tid, nth, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) {
        const int64_t r = it / per_row, c0 = it % per_row * SILU_CHUNK;
        const int64_t c1 = c0 + SILU_CHUNK < a->inter ? c0 + SILU_CHUNK : a->inter;
        const float *g = a->gate_up + r * a->ldg, *u = g + a->inter;
        float *o = a->out + r * a->ldo;
#pragma omp simd
        for (int64_t i = c0; i < c1; i++) o[i] = g[i] / (1.0f + ek_vexp(-g[i])) * u[i];
    }
}

/* ---------------------------------------------------------------- argument blocks */

/* Arguments live in C memory, one malloc each, freed with ek_args_free; the makers below
 * check nothing that the Python side has not (engine/cpu_graph/native.py). */
void ek_args_free(void *p) { free(p); }

#define NEW(T) T *a = malloc(sizeof(T)); if (!a) return NULL

void *ek_embed_args(const float *table, int64_t dim, float *out, int64_t ldo) {
    NEW(embed_args);
    *a = (embed_args){table, dim, out, ldo};
    return a;
}

void *ek_rmsnorm_args(float *res, int64_t ldr, const float *add, int64_t lda, const float *w,
                      int64_t dim, float eps, float *out, int64_t ldo) {
    NEW(rmsnorm_args);
    *a = (rmsnorm_args){res, ldr, add, lda, w, dim, eps, out, ldo};
    return a;
}

void *ek_rope_args(float *x, int64_t ldx, int64_t heads, int64_t head_dim,
                   const float *cos_sin, int64_t max_pos, const float *q_norm,
                   const float *k_norm, int64_t q_heads, float eps) {
    NEW(rope_args);
    *a = (rope_args){x, ldx, heads, head_dim, cos_sin, max_pos, q_norm, k_norm, q_heads, eps};
    return a;
}

void *ek_silu_mul_args(const float *gate_up, int64_t ldg, int64_t inter, float *out,
                       int64_t ldo) {
    NEW(silu_mul_args);
    *a = (silu_mul_args){gate_up, ldg, inter, out, ldo};
    return a;
}
