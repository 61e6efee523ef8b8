/* Paged decode attention on the CPU: one query token per request, K/V read straight from the
 * pool through the request-to-token table (no gather copy), online softmax in blocks of keys.
 *
 * Work item = (a group of rows, a range of their keys, every head): a slot's K (or V) row holds
 * all KV heads side by side, so an item streams whole rows, and the G = H / KVH query heads of
 * a KV head share every row loaded. A group is one row, or a request's rows side by side (draft
 * tokens verified together, each with its own length: group_rows), which share every key they
 * both read, fetched from memory once for all of them. With many groups an item is a whole
 * group; with few (fewer than 4 per thread) each group's keys are cut into chunks so that
 * every thread has work (split-KV, "flash decoding"): each row's chunk leaves its softmax state
 * (max, sum, weighted values) in scratch and a second phase, after a barrier, merges a row's
 * chunks. Items are dealt round-robin to the threads (claimed as threads come free in the
 * graph). Batch-invariant: a row's keys are cut into the same chunks (their size a function of
 * its own key count alone: rows are grouped only where those agree), each chunk is attended
 * with the same blocks and operations whatever rows share it, and the chunks' states are folded
 * in the same order whether the chunks are split over the threads or one thread attends them
 * all, so a row's result does not depend on the other rows of the step (a token verified among
 * drafts gets the bits it gets when decoded alone; with int8 activations a last-bit difference
 * can change a token). Where the head dim is a multiple of 16 (up to 128) the scores of 16 keys
 * are reduced together, the softmax's exp runs on 16 lanes and the weighted values accumulate
 * in registers (attend_rows_v); other head dims take the plain loops (attend_keys).
 *
 * Pool layout: [slots, KVH, D], element type float32, bfloat16 or float16 (converted to float32
 * on load, then multiplied by the layer's K or V scale). Two entry points share the kernel:
 * decode_attention (the eager path: q and out [T, H, D], K/V already stored) and the CPU graph
 * node ek_attention_node (graph.h: the step's rows, K/V stored by the node first).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "graph.h" /* engine's CPU graph nodes: engine.cpu_graph.include_dir() */
#include "kv_rows.h"

#define BLOCK 32        /* keys per online-softmax block */
#define PREFETCH 16     /* keys ahead whose K and V rows are prefetched (into L2) */
#define MIN_CHUNK 32    /* fewest keys in a chunk */
#define CHUNKS 4        /* a request's keys are cut into at most this many chunks */
#define MAX_ITEMS 128   /* split chunks per call (the scratch holds their states) */
#define GROUP_MAX 16    /* rows of one request attended together */

/* a kept scratch buffer of at least `bytes`: with none to be had the process is out of memory,
 * and a kernel that went on would leave its outputs unwritten, so it stops, saying so */
static void *scratch_or_abort(kept_t *k, size_t bytes) {
    void *p = kept_bytes(k, bytes);
    if (!p) {
        fprintf(stderr, "engine-attention-cpu: out of memory for %zu bytes of attention "
                "scratch\n", bytes);
        abort();
    }
    return p;
}

/* ---------------------------------------------------------------- CPU graph node */

/* float32 -> bfloat16 / float16 bits, rounded to nearest even as torch rounds (integer
 * arithmetic only) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* nan */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00; /* nan */
    if (a >= 0x47800000u) return sign | 0x7c00; /* >= 65536 (and inf): inf */
    if (a >= 0x38800000u) {                    /* a normal half: rebias, round at bit 13 */
        uint32_t r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);        /* a carry into the exponent is right */
        return sign | (uint16_t)(r >> 13);
    }
    if (a <= 0x33000000u) return sign;         /* at most 2^-25: zero (the tie goes even) */
    const uint32_t e = a >> 23, mant = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t m = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (m & 1u))) m++;
    return sign | (uint16_t)m;
}

/* One call: the requests, their K/V, where q and out live. */
typedef struct {
    const float *q;         /* row of request b: q_rows ? q_rows[b] : b, of H * D floats */
    int64_t ldq;
    const int64_t *q_rows;
    float *out;             /* the same rows as q */
    int64_t ldo;
    const float *k_new, *v_new; /* the new tokens' K / V rows (ld_new apart): what the graph's
                                 * store node stores (NULL in the attention itself) */
    int64_t ld_new;
    const int64_t *new_slots;
    int scaled;             /* storing: value / scale, clamped to the dtype's range */
    const void *k_pool, *v_pool;
    int dtype;
    const int32_t *table;   /* req_to_token */
    int64_t table_stride;
    const int64_t *req_rows, *seq_lens;
    int64_t B, H, KVH, D, window;
    float scale, k_scale, v_scale;
    float *partial;         /* MAX_ITEMS x (2 H + H D) floats for split chunks, or NULL */
} prob_t;

static inline int64_t key_start(const prob_t *p, int64_t b) {
    const int64_t L = p->seq_lens[b];
    return (p->window > 0 && L > p->window) ? L - p->window : 0;
}

/* keys per chunk of request b: a multiple of 16, a function of its own key count alone */
static inline int64_t req_chunk(const prob_t *p, int64_t b) {
    const int64_t W = p->seq_lens[b] - key_start(p, b);
    const int64_t C = (W + 16 * CHUNKS - 1) / (16 * CHUNKS) * 16;
    return C < MIN_CHUNK ? MIN_CHUNK : C;
}

static inline int64_t row_chunks(const prob_t *p, int64_t b) {
    const int64_t W = p->seq_lens[b] - key_start(p, b), C = req_chunk(p, b);
    return W > C ? (W + C - 1) / C : 1;
}

static inline void prefetch_row(const void *pool, int64_t off, int64_t bytes, int esize) {
    const char *c = (const char *)pool + off * esize;
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

/* ask for the K and V rows of keys [j0, j1) (the first ones of an item: next_key asks for
 * the rest PREFETCH keys ahead) */
static inline void prefetch_keys(const prob_t *p, const int32_t *tab, int64_t j0, int64_t j1) {
    const int64_t row = p->KVH * p->D;
    const int esize = p->dtype == F32 ? 4 : 2;
    for (int64_t j = j0; j < j1; j++) {
        prefetch_row(p->k_pool, tab[j] * row, row * esize, esize);
        prefetch_row(p->v_pool, tab[j] * row, row * esize, esize);
    }
}

/* key j's K row as float32 (converted into tmp where the pool is not float32 or scaled),
 * after asking for the K and V rows PREFETCH keys ahead (slots are scattered in the pool) */
static inline const float *next_key(const prob_t *p, const int32_t *tab, int64_t j, int64_t j1,
                                    float *tmp) {
    const int64_t row = p->KVH * p->D;
    const int esize = p->dtype == F32 ? 4 : 2;
    if (j + PREFETCH < j1) {
        const int64_t ahead = tab[j + PREFETCH] * row;
        prefetch_row(p->k_pool, ahead, row * esize, esize);
        prefetch_row(p->v_pool, ahead, row * esize, esize);
    }
    return load_row(p->k_pool, p->dtype, tab[j] * row, row, p->k_scale, tmp);
}

/* keys [j0, j1) of `tab` for every head of one query row: m, l (per head) and acc (H x D)
 * hold the online-softmax state, initialised here; keys up to jp (>= j1: the item's end, so
 * that a whole request's next chunk is on its way) are prefetched */
static void attend_keys(const prob_t *p, const float *q, const int32_t *tab, int64_t j0,
                        int64_t j1, int64_t jp, float *m, float *l, float *acc) {
    prefetch_keys(p, tab, j0, j0 + PREFETCH < jp ? j0 + PREFETCH : jp);
    const int64_t H = p->H, KVH = p->KVH, D = p->D, G = H / KVH, row = KVH * D;
    float s[H * BLOCK], tmp[row];
    for (int64_t h = 0; h < H; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t jb = j0; jb < j1; jb += BLOCK) {
        const int64_t n = j1 - jb < BLOCK ? j1 - jb : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            const float *k = next_key(p, tab, jb + j, jp, tmp);
            for (int64_t h = 0; h < H; h++) {
                const float *qh = q + h * D, *kh = k + (h / G) * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[d];
                s[h * BLOCK + j] = dot * p->scale;
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float *sh = s + h * BLOCK, mx = m[h];
            for (int64_t j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
            float sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                sh[j] = expf(sh[j] - mx);
                sum += sh[j];
            }
            if (mx != m[h]) {
                const float corr = expf(m[h] - mx);
                float *ah = acc + h * D;
                for (int64_t d = 0; d < D; d++) ah[d] *= corr;
                l[h] *= corr;
                m[h] = mx;
            }
            l[h] += sum;
        }
        for (int64_t j = 0; j < n; j++) {
            const float *v = load_row(p->v_pool, p->dtype, tab[jb + j] * row, row, p->v_scale,
                                      tmp);
            for (int64_t h = 0; h < H; h++) {
                const float w = s[h * BLOCK + j], *vh = v + (h / G) * D;
                float *ah = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ah[d] += w * vh[d];
            }
        }
    }
}

/* ---- the vector path (head_dim a multiple of 16: kv_rows.h's 16-lane vectors) */

/* lane i of the result: the sum of v[i]'s 16 lanes (a transpose-and-add tree: 30 shuffles and
 * 15 adds for 16 sums, where one sum at a time takes ~8 operations) */
static inline v16 hsum16(const v16 *v) {
    const i16v a1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16v b1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16v a2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i16v b2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i16v a3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i16v b3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i16v a4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i16v b4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    v16 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)  /* t[i]: v[i]'s 8 pair sums, then v[i + 8]'s */
        t[i] = __builtin_shuffle(v[i], v[i + 8], a1) + __builtin_shuffle(v[i], v[i + 8], b1);
    for (int i = 0; i < 4; i++)  /* u[i]: 4 sums each of v[i], v[i+4], v[i+8], v[i+12] */
        u[i] = __builtin_shuffle(t[i], t[i + 4], a2) + __builtin_shuffle(t[i], t[i + 4], b2);
    for (int i = 0; i < 2; i++)  /* w[i]: 2 sums each of v[i], v[i+2], ..., v[i+14] */
        w[i] = __builtin_shuffle(u[i], u[i + 2], a3) + __builtin_shuffle(u[i], u[i + 2], b3);
    return __builtin_shuffle(w[0], w[1], a4) + __builtin_shuffle(w[0], w[1], b4);
}


/* q . k over D = 16 * dv floats, two chains of FMAs; dv constant where inlined */
static inline v16 dot16(const float *q, const float *k, const int64_t dv) {
    v16 a = ld16(q) * ld16(k), b = (v16){0};
    for (int64_t c = 1; c + 1 < dv; c += 2) {
        a += ld16(q + 16 * c) * ld16(k + 16 * c);
        b += ld16(q + 16 * c + 16) * ld16(k + 16 * c + 16);
    }
    if (dv % 2 == 0) b += ld16(q + 16 * dv - 16) * ld16(k + 16 * dv - 16);
    return a + b;
}

/* acc[D] += sum_j w[j] * rows[j][off .. off + D), the accumulator in registers (dv <= 8) */
static inline void weighted_rows(float *acc, const float *const *rows, const float *w,
                                 int64_t n, int64_t off, const int64_t dv) {
    v16 a[8];
    for (int64_t c = 0; c < dv; c++) a[c] = ld16(acc + 16 * c);
    for (int64_t j = 0; j < n; j++) {
        const v16 wj = (v16){0} + w[j];
        const float *r = rows[j] + off;
        for (int64_t c = 0; c < dv; c++) a[c] += wj * ld16(r + 16 * c);
    }
    for (int64_t c = 0; c < dv; c++) st16(acc + 16 * c, a[c]);
}

/* attend_keys for D a multiple of 16 (at most 128 for the register accumulators, the usual
 * 64 and 128 specialised), for R query rows of one request at once (draft tokens verified
 * together: the same keys, each row up to its own end j1s[r]): per block of 16 keys the K and
 * V rows are fetched from memory once, by the first row, and stay in L1 for the others; each
 * row's arithmetic is exactly the one-row kernel's (its 16 dot products per head end as 16
 * vectors of partial sums reduced together, hsum16, keys past its end counted as zero sums
 * as a one-row block past the chunk's end is; the weighted values accumulate per head over
 * the block's rows in registers), so a row's bits do not depend on the rows beside it.
 * State: m and l R x H, acc R x H x D (row r's at r H and r H D). */
static void attend_rows_v(const prob_t *p, int64_t R, const float *const *qs,
                          const int32_t *tab, int64_t j0, const int64_t *j1s, int64_t jp,
                          float *ms, float *ls, float *accs) {
    prefetch_keys(p, tab, j0, j0 + PREFETCH < jp ? j0 + PREFETCH : jp);
    const int64_t H = p->H, KVH = p->KVH, D = p->D, G = H / KVH, row = KVH * D, DV = D / 16;
    const int convert = p->dtype != F32 || p->k_scale != 1.0f || p->v_scale != 1.0f;
    static __thread kept_t conv_kept; /* 16 K and 16 V rows as float32, where converted */
    float *kt = convert ? scratch_or_abort(&conv_kept, (size_t)(32 * row) * sizeof(float))
                       : NULL;
    float *vt = convert ? kt + 16 * row : NULL;
    v16 part[H * 16];
    float s[H * 16];
    const float *krows[16], *vrows[16];
    int64_t jmax = j0;
    for (int64_t r = 0; r < R; r++) jmax = j1s[r] > jmax ? j1s[r] : jmax;
    for (int64_t i = 0; i < R * H; i++) { ms[i] = -INFINITY; ls[i] = 0.0f; }
    memset(accs, 0, (size_t)(R * H * D) * sizeof(float));
    for (int64_t jb = j0; jb < jmax; jb += 16) {
        const int64_t nb = jmax - jb < 16 ? jmax - jb : 16;
        for (int64_t j = 0; j < nb; j++)
            krows[j] = next_key(p, tab, jb + j, jp, convert ? kt + j * row : NULL);
        for (int64_t j = 0; j < nb; j++)
            vrows[j] = load_row(p->v_pool, p->dtype, tab[jb + j] * row, row, p->v_scale,
                                convert ? vt + j * row : NULL);
        for (int64_t r = 0; r < R; r++) {
            const int64_t n = j1s[r] - jb < nb ? j1s[r] - jb : nb;
            if (n <= 0) continue; /* this row's keys ended before the block */
            const float *q = qs[r];
            float *m = ms + r * H, *l = ls + r * H, *acc = accs + r * H * D;
            for (int64_t j = 0; j < n; j++)
                for (int64_t kh = 0, h = 0; kh < KVH; kh++)
                    for (int64_t g = 0; g < G; g++, h++)
                        part[h * 16 + j] = DV == 4 ? dot16(q + h * D, krows[j] + kh * D, 4)
                                         : DV == 8 ? dot16(q + h * D, krows[j] + kh * D, 8)
                                                   : dot16(q + h * D, krows[j] + kh * D, DV);
            for (int64_t h = 0; h < H; h++)
                for (int64_t j = n; j < 16; j++) part[h * 16 + j] = (v16){0};
            for (int64_t h = 0; h < H; h++) {
                float *sh = s + h * 16, mx = m[h];
                st16(sh, hsum16(part + h * 16) * p->scale);
                for (int64_t j = 0; j < n; j++) mx = sh[j] > mx ? sh[j] : mx;
                st16(sh, vexp16(ld16(sh) - mx));
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++) sum += sh[j];
                if (mx != m[h]) {
                    const float corr = expf(m[h] - mx);
                    const v16 cv = (v16){0} + corr;
                    float *ah = acc + h * D;
                    for (int64_t c = 0; c < DV; c++) st16(ah + 16 * c, ld16(ah + 16 * c) * cv);
                    l[h] *= corr;
                    m[h] = mx;
                }
                l[h] += sum;
            }
            for (int64_t kh = 0, h = 0; kh < KVH; kh++)
                for (int64_t g = 0; g < G; g++, h++) {
                    if (DV == 4) weighted_rows(acc + h * D, vrows, s + h * 16, n, kh * D, 4);
                    else if (DV == 8)
                        weighted_rows(acc + h * D, vrows, s + h * 16, n, kh * D, 8);
                    else weighted_rows(acc + h * D, vrows, s + h * 16, n, kh * D, DV);
                }
        }
    }
}

static void finish(const float *l, const float *acc, int64_t H, int64_t D, float *o) {
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < D; d++) o[h * D + d] = acc[h * D + d] * inv;
    }
}

static void store(void *pool, int dtype, int64_t off, const float *x, int64_t n, int scaled,
                  float scale);

/* keys [j0, j1s[r]) of R rows of one request (the vector path where the head dim allows it;
 * else each row in turn); state as attend_rows_v's */
static inline void attend_rows(const prob_t *p, int64_t R, const float *const *qs,
                               const int32_t *tab, int64_t j0, const int64_t *j1s, int64_t jp,
                               float *m, float *l, float *acc) {
    const int64_t H = p->H, D = p->D;
    if (D % 16 == 0 && D <= 128) {
        attend_rows_v(p, R, qs, tab, j0, j1s, jp, m, l, acc);
        return;
    }
    for (int64_t r = 0; r < R; r++)
        attend_keys(p, qs[r], tab, j0, j1s[r], jp, m + r * H, l + r * H, acc + r * H * D);
}

/* a chunk's softmax state (mc, lc, ac) folded into the running one (m, l, acc): the one order
 * both the split merge and a whole request's attend use */
static void fold(int64_t H, int64_t D, float *m, float *l, float *acc, const float *mc,
                 const float *lc, const float *ac) {
    for (int64_t h = 0; h < H; h++) {
        const float mx = mc[h] > m[h] ? mc[h] : m[h];
        const float a = expf(m[h] - mx), b = expf(mc[h] - mx);
        l[h] = l[h] * a + lc[h] * b;
        float *oh = acc + h * D;
        const float *ch = ac + h * D;
        for (int64_t d = 0; d < D; d++) oh[d] = oh[d] * a + ch[d] * b;
        m[h] = mx;
    }
}

/* rows b, b + 1, ... that attend together (at most GROUP_MAX): a request's rows side by side
 * (a prompt chunk's or verified drafts' tokens, each with its own length) read the same slots
 * of the same table row; with the same first key and chunk size they are cut into the same
 * chunks and blocks, so each row computes what it computes alone */
static int64_t group_rows(const prob_t *p, int64_t b) {
    const int64_t start = key_start(p, b), C = req_chunk(p, b);
    int64_t e = b + 1;
    while (e < p->B && e - b < GROUP_MAX && p->req_rows[e] == p->req_rows[b] &&
           key_start(p, e) == start && req_chunk(p, e) == C)
        e++;
    return e - b;
}

/* the chunks of the group of R rows at b: its longest row's */
static int64_t group_chunks(const prob_t *p, int64_t b, int64_t R) {
    int64_t n = 1;
    for (int64_t r = b; r < b + R; r++) n = row_chunks(p, r) > n ? row_chunks(p, r) : n;
    return n;
}

static int64_t count_groups(const prob_t *p) {
    int64_t n = 0;
    for (int64_t b = 0; b < p->B; b += group_rows(p, b)) n++;
    return n;
}

/* whether this call's items are chunks (split over the threads) rather than whole groups:
 * with few groups (fewer than 4 per thread), where the scratch holds every row's chunks */
static int split_items(const prob_t *p, int nth) {
    if (!p->partial || count_groups(p) >= 4 * nth) return 0;
    int64_t items = 0;
    for (int64_t b = 0; b < p->B; b++) items += row_chunks(p, b);
    return items <= MAX_ITEMS;
}

/* the rows of the R-row group at b that have a chunk c (its keys from j0 = start + c C): their
 * places in the group (act), queries (qc, from the group's qs) and key ends (j1s); how many
 * (chunk 0: every row, in order) */
static int64_t chunk_rows(const prob_t *p, int64_t b, int64_t R, int64_t c, int64_t j0,
                          int64_t C, const float *const *qs, int64_t *act, const float **qc,
                          int64_t *j1s) {
    int64_t n = 0;
    for (int64_t r = 0; r < R; r++)
        if (c < row_chunks(p, b + r)) {
            const int64_t L = p->seq_lens[b + r];
            act[n] = r;
            qc[n] = qs[r];
            j1s[n++] = j0 + C < L ? j0 + C : L;
        }
    return n;
}

/* phase 1 on thread tid of nth: the items (split: every group's chunks, each row's chunk state
 * left in the scratch at the row's chunk index, or its output where the row has one chunk;
 * else whole groups, each row's chunks attended and folded in turn); dealt round-robin, or
 * with `next` claimed one at a time as threads come free (the graph node) */
static void attend_items(const prob_t *p, int split, ek_counter_t *next, const ek_step_t *s,
                         int tid, int nth) {
    const int64_t H = p->H, D = p->D, state = 2 * H + H * D;
    /* per row of a group: its running state (m, l, acc: split chunks go through it too) and
     * a later chunk's, each GROUP_MAX x (m H, l H, acc H D) */
    static __thread kept_t state_kept;
    float *st = scratch_or_abort(&state_kept, (size_t)(2 * GROUP_MAX * state) * sizeof(float));
    float *m = st, *l = m + GROUP_MAX * H, *acc = l + GROUP_MAX * H;
    float *mc = acc + GROUP_MAX * H * D, *lc = mc + GROUP_MAX * H, *ac = lc + GROUP_MAX * H;
    const float *qs[GROUP_MAX], *qc[GROUP_MAX];
    int64_t j1s[GROUP_MAX], act[GROUP_MAX];
    int64_t total = 0;
    for (int64_t b = 0; b < p->B;) {
        const int64_t R = group_rows(p, b);
        total += split ? group_chunks(p, b, R) : 1;
        b += R;
    }
    /* the group holding the claimed item: its first row b, R rows, first item, item count
     * and its first row's first chunk index in the scratch; claims only grow */
    int64_t b = 0, R = p->B ? group_rows(p, 0) : 0, first = 0;
    int64_t items = p->B ? (split ? group_chunks(p, 0, R) : 1) : 0, rc = 0;
    for (int64_t k = 0;; k++) {
        const int64_t item = next ? ek_claim(next, s, 1, total) : tid + k * nth;
        if (item < 0 || item >= total) break;
        while (item >= first + items) {
            for (int64_t r = b; r < b + R; r++) rc += row_chunks(p, r);
            first += items;
            b += R;
            R = group_rows(p, b);
            items = split ? group_chunks(p, b, R) : 1;
        }
        const int64_t start = key_start(p, b), C = req_chunk(p, b);
        const int32_t *tab = p->table + p->req_rows[b] * p->table_stride;
        int64_t jp = 0;
        for (int64_t r = 0; r < R; r++) {
            const int64_t L = p->seq_lens[b + r];
            qs[r] = p->q + (p->q_rows ? p->q_rows[b + r] : b + r) * p->ldq;
            jp = L > jp ? L : jp;
        }
        if (split) { /* chunk c of the rows that have one */
            const int64_t c = item - first, j0 = start + c * C;
            const int64_t n = chunk_rows(p, b, R, c, j0, C, qs, act, qc, j1s);
            int64_t je = j0;
            for (int64_t i = 0; i < n; i++) je = j1s[i] > je ? j1s[i] : je;
            attend_rows(p, n, qc, tab, j0, j1s, je, m, l, acc);
            int64_t at = rc; /* row b + r's first chunk index */
            for (int64_t i = 0, r = 0; i < n; i++) {
                for (; r < act[i]; r++) at += row_chunks(p, b + r);
                const int64_t row = b + act[i], chunks = row_chunks(p, row);
                if (chunks > 1) {
                    float *dst = p->partial + (at + c) * state;
                    memcpy(dst, m + i * H, (size_t)H * sizeof(float));
                    memcpy(dst + H, l + i * H, (size_t)H * sizeof(float));
                    memcpy(dst + 2 * H, acc + i * H * D, (size_t)(H * D) * sizeof(float));
                } else {
                    finish(l + i * H, acc + i * H * D, H, D,
                           p->out + (p->q_rows ? p->q_rows[row] : row) * p->ldo);
                }
            }
            continue;
        }
        /* a whole group: its chunks in order, each row's later chunks folded into its first */
        const int64_t chunks = group_chunks(p, b, R);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n = chunk_rows(p, b, R, c, start + c * C, C, qs, act, qc, j1s);
            if (c == 0) { /* every row: its state at its place in the group */
                attend_rows(p, n, qc, tab, start, j1s, jp, m, l, acc);
                continue;
            }
            attend_rows(p, n, qc, tab, start + c * C, j1s, jp, mc, lc, ac);
            for (int64_t i = 0; i < n; i++) {
                const int64_t r = act[i];
                fold(H, D, m + r * H, l + r * H, acc + r * H * D, mc + i * H, lc + i * H,
                     ac + i * H * D);
            }
        }
        for (int64_t r = 0; r < R; r++) {
            const int64_t row = b + r;
            finish(l + r * H, acc + r * H * D, H, D,
                   p->out + (p->q_rows ? p->q_rows[row] : row) * p->ldo);
        }
    }
}

/* phase 2 (after a barrier): each split request's chunks folded in order into its output */
static void merge_items(const prob_t *p, int split, int tid, int nth) {
    if (!split) return;
    const int64_t H = p->H, D = p->D, state = 2 * H + H * D;
    float m[H], l[H], acc[H * D];
    int64_t item = 0;
    for (int64_t b = 0; b < p->B; b++) {
        const int64_t chunks = row_chunks(p, b);
        if (chunks > 1 && b % nth == tid) {
            const float *st = p->partial + item * state;
            memcpy(m, st, (size_t)H * sizeof(float));
            memcpy(l, st + H, (size_t)H * sizeof(float));
            memcpy(acc, st + 2 * H, (size_t)(H * D) * sizeof(float));
            for (int64_t c = 1; c < chunks; c++) {
                st = p->partial + (item + c) * state;
                fold(H, D, m, l, acc, st, st + H, st + 2 * H);
            }
            finish(l, acc, H, D, p->out + (p->q_rows ? p->q_rows[b] : b) * p->ldo);
        }
        item += chunks;
    }
}

static int bad_shape(int64_t H, int64_t KVH, int64_t D) {
    return KVH <= 0 || H % KVH != 0 || H * D > 65536 || D > 1024;  /* bounds the stack arrays */
}

static size_t partial_bytes(int64_t H, int64_t D) {
    return (size_t)MAX_ITEMS * (size_t)(2 * H + H * D) * sizeof(float);
}

int decode_attention(const float *q, float *out, const int64_t *q_tokens,
                     const void *k_pool, const void *v_pool, int dtype,
                     const int32_t *req_to_token, int64_t table_stride,
                     const int64_t *rows, const int64_t *seq_lens,
                     int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t window,
                     float scale, float k_scale, float v_scale, int nthreads) {
    if (bad_shape(H, KVH, D)) return 1;
    if (nthreads < 1) nthreads = 1;
    /* the split chunks' scratch, kept per calling thread */
    static __thread kept_t partial_kept;
    prob_t p = {q, H * D, q_tokens, out, H * D, NULL, NULL, 0, NULL, 0, k_pool, v_pool,
                dtype, req_to_token, table_stride, rows, seq_lens, B, H, KVH, D, window,
                scale, k_scale, v_scale, NULL};
    if (count_groups(&p) < 4 * nthreads)
        p.partial = kept_bytes(&partial_kept, partial_bytes(H, D));
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int split = split_items(&p, nth);
        attend_items(&p, split, NULL, NULL, tid, nth);
#pragma omp barrier
        merge_items(&p, split, tid, nth);
    }
    return 0;
}

/* ---------------------------------------------------------------- CPU graph node */

typedef struct {
    ek_counter_t next; /* the next item to claim (ek_claim) */
    prob_t p;   /* B, the rows and the step's tables filled per step */
    int64_t ldk, ldv;
} attn_node_args;

/* n values into the pool at element offset off, as KVDtype.store does: a cast, or with
 * `scaled` value / scale clamped to the storage dtype's finite range first (a true division,
 * as torch divides) */
static void store(void *pool, int dtype, int64_t off, const float *x, int64_t n, int scaled,
                  float scale) {
    const float fmax = dtype == F32 ? 3.40282347e38f : dtype == BF16 ? 3.38953139e38f : 65504.0f;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        if (scaled) {
            v = v / scale;
            v = v > fmax ? fmax : (v < -fmax ? -fmax : v);
        }
        if (dtype == F32) ((float *)pool)[off + i] = v;
        else if (dtype == BF16) ((uint16_t *)pool)[off + i] = f32_to_bf16(v);
        else ((uint16_t *)pool)[off + i] = f32_to_f16(v);
    }
}

/* q [rows, ldq], k and v [rows, ld_new] (the new tokens' K/V, heads side by side), out
 * [rows, ldo]; `partial`: scratch of ek_attention_partial_bytes (may be shared by the nodes of
 * one graph: they run one after another). NULL when a shape is out of bounds. */
void *ek_attention_node_args(const float *q, int64_t ldq, const float *k, const float *v,
                             int64_t ld_new, float *out, int64_t ldo, void *k_pool,
                             void *v_pool, int dtype, int scaled, int64_t H, int64_t KVH,
                             int64_t D, int64_t window, float scale, float k_scale,
                             float v_scale, float *partial) {
    if (bad_shape(H, KVH, D) || dtype < F32 || dtype > F16) return NULL;
    attn_node_args *a = calloc(1, sizeof(attn_node_args));
    if (!a) return NULL;
    a->p = (prob_t){q, ldq, NULL, out, ldo, k, v, ld_new, NULL, scaled, k_pool, v_pool, dtype,
                    NULL, 0, NULL, NULL, 0, H, KVH, D, window, scale, k_scale, v_scale,
                    partial};
    return a;
}

size_t ek_attention_partial_bytes(int64_t H, int64_t D) { return partial_bytes(H, D); }

void ek_attention_node_free(void *a) { free(a); }

static prob_t step_problem(const attn_node_args *a, const ek_step_t *s) {
    prob_t p = a->p;
    p.B = s->rows;
    p.new_slots = s->out_cache_loc;
    p.table = s->req_to_token;
    p.table_stride = s->req_to_token_stride;
    p.req_rows = s->req_rows;
    p.seq_lens = s->seq_lens;
    return p;
}

/* Every row's new K and V stored at its slot first (rows split over the threads), so that a
 * request with several rows this step (a prompt chunk, draft tokens to verify: one row per
 * token, each with its own length) finds all of them when it attends, after the barrier ... */
void ek_attention_store_node(const void *a_, const ek_step_t *s, int tid, int nth) {
    const attn_node_args *a = a_;
    const prob_t *p = &a->p;
    const int64_t row = p->KVH * p->D;
    int64_t r0, r1;
    ek_split(s->rows, tid, nth, &r0, &r1);
    for (int64_t b = r0; b < r1; b++) {
        const int64_t off = s->out_cache_loc[b] * row;
        store((void *)p->k_pool, p->dtype, off, p->k_new + b * p->ld_new, row, p->scaled,
              p->k_scale);
        store((void *)p->v_pool, p->dtype, off, p->v_new + b * p->ld_new, row, p->scaled,
              p->v_scale);
    }
}

/* ... then every item attended (phase 1) ... */
void ek_attention_node(const void *a_, const ek_step_t *s, int tid, int nth) {
    attn_node_args *a = (attn_node_args *)a_;
    prob_t p = step_problem(a, s);
    p.k_new = p.v_new = NULL; /* stored by the node before */
    attend_items(&p, split_items(&p, nth), &a->next, s, tid, nth);
}

/* ... then (the next node, after the barrier) the split requests merged */
void ek_attention_merge_node(const void *a_, const ek_step_t *s, int tid, int nth) {
    const prob_t p = step_problem(a_, s);
    merge_items(&p, split_items(&p, nth), tid, nth);
}
