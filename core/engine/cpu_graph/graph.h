/* engine's CPU graphs: the C side of a node (core/engine/cpu_graph, docs/plugins.md).
 *
 * A CPU graph is a decode forward recorded once at start as a list of nodes, each a C function
 * and its arguments, and replayed every decode step by ek_graph_run in one OpenMP parallel
 * region: every thread calls every node in order with its thread index, and all threads meet at
 * a barrier after each node. A node therefore does its share of the work (split by tid / nth)
 * and may read what any earlier node wrote. The arguments (buffers, weights, sizes) are fixed
 * when the graph is built; what changes per step is in ek_step_t.
 *
 * A plugin that offers nodes (a linear kernel, an attention backend) includes this header
 * (engine.cpu_graph.include_dir()), exports its node functions, and hands their addresses and
 * argument pointers to the builder as engine.cpu_graph.GraphNode. Nodes must not fail at run
 * time (check everything when the arguments are made) and must not open OpenMP regions.
 */
#ifndef ENGINE_CPU_GRAPH_H
#define ENGINE_CPU_GRAPH_H

#include <stdint.h>

#define EK_GRAPH_ABI 2 /* bumped when ek_step_t or the node signature changes */

typedef struct ek_step {
    int64_t rows;                 /* decode rows this step: one new token each */
    const int64_t *input_ids;     /* [rows] */
    const int64_t *positions;     /* [rows] each token's position in its sequence */
    const int64_t *out_cache_loc; /* [rows] KV pool slot of each new token */
    const int64_t *req_rows;      /* [rows] each request's row of req_to_token */
    const int64_t *seq_lens;      /* [rows] tokens in the pool after this step */
    const int32_t *req_to_token;  /* [R, stride] position -> slot */
    int64_t req_to_token_stride;
    uint64_t epoch;               /* this run's number (1, 2, ...): see ek_claim */
} ek_step_t;

/* one node: called by every thread of the region, tid in [0, nth) */
typedef void (*ek_node_fn)(const void *args, const ek_step_t *step, int tid, int nth);

/* rows [*r0, *r1) of `rows` that thread tid of nth takes */
static inline void ek_split(int64_t rows, int tid, int nth, int64_t *r0, int64_t *r1) {
    *r0 = rows * tid / nth;
    *r1 = rows * (tid + 1) / nth;
}

/* Work shared out as it is done rather than split up front: a thread that another process or
 * thread holds up leaves its share to the others instead of holding everyone at the barrier.
 * A node keeps an ek_counter_t (zeroed when its arguments are made) and its threads call
 * ek_claim until it returns -1; the counter starts over by itself in the next run (epoch). */
typedef struct {
    uint64_t v; /* the epoch it was last claimed in (high 32 bits), the next index (low 32) */
} ek_counter_t;

/* the first of the next `chunk` of `n` items for this thread, or -1 when all are taken */
static inline int64_t ek_claim(ek_counter_t *c, const ek_step_t *s, int64_t chunk, int64_t n) {
    const uint64_t epoch = s->epoch & 0xffffffffu;
    uint64_t v = __atomic_load_n(&c->v, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t start = (v >> 32) == epoch ? (int64_t)(v & 0xffffffffu) : 0;
        if (start >= n) return -1;
        const uint64_t next = epoch << 32 | (uint64_t)(start + chunk);
        if (__atomic_compare_exchange_n(&c->v, &v, next, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return start;
    }
}

#endif
