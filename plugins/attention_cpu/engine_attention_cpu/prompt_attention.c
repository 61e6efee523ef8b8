/* Paged attention of prompt chunks on the CPU: each request brings several new tokens (after a
 * cached prefix, maybe), each attending causally to the keys up to its own position, K/V read
 * straight from the pool through the request-to-token table (no gather copy).
 *
 * Work item = (request, KV head, a tile of up to QT of its new tokens): the G = H / KVH query
 * heads of that KV head times the tile's tokens are the item's M rows, attended together
 * (flash attention): per block of 16 keys, the block's K rows are transposed once into
 * [D][16] so that a row's 16 scores are D vector FMAs (four rows share each load), the online
 * softmax runs on 16 lanes, and the weighted values accumulate in each row's registers. Blocks
 * past a tile's last token are never read; a block straddling a row's own position (or its
 * sliding window's start) is masked for that row. Items are shared out as threads come free,
 * the longest (latest tiles) first.
 *
 * Head dims a multiple of 16 up to 128 (prompt_attention returns 1 otherwise: the caller's
 * SDPA runs instead). Pool layout and element types as decode_attention.c (kv_rows.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kv_rows.h"

#define QT 32   /* new tokens per item */
#define KB 16   /* keys per block: one 16-lane vector of scores per row */

typedef struct {
    int64_t b, kh, t0, keys; /* request, KV head, first new token of the tile, keys it reads */
} item_t;

typedef struct {
    const float *q; int64_t ldq; float *out; int64_t ldo;
    const int64_t *q_start, *ext, *prefix, *req_rows;
    const void *k_pool, *v_pool; int dtype;
    const int32_t *table; int64_t table_stride;
    int64_t H, KVH, D, window;
    float scale, k_scale, v_scale;
} prompt_t;

static int longest_first(const void *a, const void *b) {
    const int64_t x = ((const item_t *)a)->keys, y = ((const item_t *)b)->keys;
    return (x < y) - (x > y);
}

/* rows r .. r + R - 1 (R <= 4) of the item: their 16 scores against the block's keys
 * (kt: [D][16], transposed), the query rows pre-scaled */
static inline void scores4(const float *qs, int64_t D, const float *kt, int R, v16 *s) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t d = 0; d < D; d++) {
        const v16 k = ld16(kt + 16 * d);
        a0 += qs[d] * k;
        if (R > 1) a1 += qs[D + d] * k;
        if (R > 2) a2 += qs[2 * D + d] * k;
        if (R > 3) a3 += qs[3 * D + d] * k;
    }
    s[0] = a0; s[1] = a1; s[2] = a2; s[3] = a3;
}

/* lanes of a where `take` is set, else of b (C has no ?: on vectors) */
static inline v16 select16(i16v take, v16 a, v16 b) {
    return (v16)(((i16v)a & take) | ((i16v)b & ~take));
}

/* every lane: the largest / the sum of v's 16 lanes (a butterfly of shuffles) */
static inline v16 lanes_max(v16 v) {
    const i16v s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const i16v s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const i16v s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const i16v s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    v16 t = __builtin_shuffle(v, s8);
    v = select16(v > t, v, t);
    t = __builtin_shuffle(v, s4);
    v = select16(v > t, v, t);
    t = __builtin_shuffle(v, s2);
    v = select16(v > t, v, t);
    t = __builtin_shuffle(v, s1);
    return select16(v > t, v, t);
}

static inline float lanes_sum(v16 v) {
    const i16v s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const i16v s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const i16v s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const i16v s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    v += __builtin_shuffle(v, s8);
    v += __builtin_shuffle(v, s4);
    v += __builtin_shuffle(v, s2);
    v += __builtin_shuffle(v, s1);
    return v[0];
}

/* acc[DV * 16] += sum_j p[j] * rows[j][0 .. D) */
static inline void weighted(float *acc, const float *const *rows, const float *p, int64_t n,
                            const int64_t DV) {
    v16 a[8];
    for (int64_t c = 0; c < DV; c++) a[c] = ld16(acc + 16 * c);
    for (int64_t j = 0; j < n; j++) {
        const v16 w = (v16){0} + p[j];
        for (int64_t c = 0; c < DV; c++) a[c] += w * ld16(rows[j] + 16 * c);
    }
    for (int64_t c = 0; c < DV; c++) st16(acc + 16 * c, a[c]);
}

static void attend_item(const prompt_t *p, const item_t *it, float *qs, float *acc, float *m,
                        float *l, float *kt, float *kv_tmp) {
    const int64_t H = p->H, KVH = p->KVH, D = p->D, G = H / KVH, DV = D / 16, row = KVH * D;
    const int64_t b = it->b, t0 = it->t0, ext = p->ext[b], pre = p->prefix[b];
    const int64_t nq = ext - t0 < QT ? ext - t0 : QT, M = G * nq;
    const int32_t *tab = p->table + p->req_rows[b] * p->table_stride;
    /* row r = (token i = r / G, head h = kh * G + r % G), scaled by the softmax scale */
    for (int64_t r = 0; r < M; r++) {
        const float *src = p->q + (p->q_start[b] + t0 + r / G) * p->ldq + (it->kh * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = src[d] * p->scale;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, (size_t)(M * D) * sizeof(float));
    const int64_t first = pre + t0, last = pre + t0 + nq - 1; /* the tile's positions */
    const int64_t j0 = p->window > 0 && first - p->window + 1 > 0
                           ? (first - p->window + 1) / KB * KB : 0;
    const int convert = p->dtype != F32 || p->v_scale != 1.0f;
    float ps[4][KB];
    const float *vrows[KB];
    for (int64_t jb = j0; jb <= last; jb += KB) {
        const int64_t n = last + 1 - jb < KB ? last + 1 - jb : KB;
        for (int64_t j = 0; j < n; j++) { /* K rows transposed into kt[d][j] */
            const float *k = load_row(p->k_pool, p->dtype, tab[jb + j] * row + it->kh * D, D,
                                      p->k_scale, kv_tmp);
            for (int64_t d = 0; d < D; d++) kt[16 * d + j] = k[d];
        }
        for (int64_t j = n; j < KB; j++)
            for (int64_t d = 0; d < D; d++) kt[16 * d + j] = 0.0f;
        for (int64_t j = 0; j < n; j++)
            vrows[j] = load_row(p->v_pool, p->dtype, tab[jb + j] * row + it->kh * D, D,
                                p->v_scale, kv_tmp + (convert ? (1 + j) * D : 0));
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
            const int R = M - r0 < 4 ? (int)(M - r0) : 4;
            v16 s[4];
            if (R == 4) scores4(qs + r0 * D, D, kt, 4, s);
            else scores4(qs + r0 * D, D, kt, R, s);
            for (int i = 0; i < R; i++) {
                const int64_t r = r0 + i, pos = pre + t0 + r / G;
                /* the keys this row sees in the block: [lo, hi) */
                const int64_t hi = pos + 1 - jb < n ? pos + 1 - jb : n;
                const int64_t lo = p->window > 0 && pos - p->window + 1 > jb
                                       ? pos - p->window + 1 - jb : 0;
                if (hi <= lo) continue;
                float *sr = ps[i];
                v16 sv = s[i];
                if (lo > 0 || hi < KB) { /* the block straddles the row's window or position */
                    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
                    const i16v keep = (lane >= (float)lo) & (lane < (float)hi);
                    sv = select16(keep, sv, (v16){0} - INFINITY);
                }
                const float mx_blk = lanes_max(sv)[0], mx = mx_blk > m[r] ? mx_blk : m[r];
                const v16 pv = vexp16(sv - mx);
                st16(sr, pv);
                const float sum = lanes_sum(pv);
                float *ar = acc + r * D;
                if (mx != m[r]) {
                    const float corr = expf(m[r] - mx);
                    const v16 cv = (v16){0} + corr;
                    for (int64_t c = 0; c < DV; c++) st16(ar + 16 * c, ld16(ar + 16 * c) * cv);
                    l[r] *= corr;
                    m[r] = mx;
                }
                l[r] += sum;
                if (DV == 4) weighted(ar, vrows, sr, hi, 4);
                else if (DV == 8) weighted(ar, vrows, sr, hi, 8);
                else weighted(ar, vrows, sr, hi, DV);
            }
        }
    }
    for (int64_t r = 0; r < M; r++) {
        float *o = p->out + (p->q_start[b] + t0 + r / G) * p->ldo + (it->kh * G + r % G) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
    }
}

/* For each request b of B: its ext[b] new tokens, rows q_start[b] .. of q and out ([T, H, D]
 * rows ldq / ldo floats apart, heads contiguous), at positions prefix[b] .. prefix[b] +
 * ext[b] - 1, attend to the keys of req_to_token[req_rows[b]] up to their own position (the
 * last `window` of them with a window > 0). The new tokens' K/V are already in the pool.
 * Returns 1 (nothing done) for a head dim it does not take, 2 out of memory, else 0. */
int prompt_attention(const float *q, int64_t ldq, float *out, int64_t ldo,
                     const int64_t *q_start, const int64_t *ext, const int64_t *prefix,
                     const int64_t *req_rows, int64_t B, const void *k_pool,
                     const void *v_pool, int dtype, const int32_t *req_to_token,
                     int64_t table_stride, int64_t H, int64_t KVH, int64_t D, int64_t window,
                     float scale, float k_scale, float v_scale, int nthreads) {
    if (D % 16 != 0 || D > 128 || KVH <= 0 || H % KVH != 0 || H / KVH > 64) return 1;
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) n += KVH * ((ext[b] + QT - 1) / QT);
    static __thread kept_t items_kept;
    item_t *items = kept_bytes(&items_kept, (size_t)(n ? n : 1) * sizeof(item_t));
    if (!items) return 2;
    n = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t0 = 0; t0 < ext[b]; t0 += QT)
            for (int64_t kh = 0; kh < KVH; kh++) {
                const int64_t last = prefix[b] + (t0 + QT < ext[b] ? t0 + QT : ext[b]);
                const int64_t start = window > 0 && prefix[b] + t0 - window + 1 > 0
                                          ? prefix[b] + t0 - window + 1 : 0;
                items[n++] = (item_t){b, kh, t0, last - start};
            }
    qsort(items, (size_t)n, sizeof(item_t), longest_first);
    const prompt_t p = {q, ldq, out, ldo, q_start, ext, prefix, req_rows, k_pool, v_pool, dtype,
                        req_to_token, table_stride, H, KVH, D, window, scale, k_scale,
                        v_scale};
    const int64_t M = (H / KVH) * QT;
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        /* per thread, kept between calls: the rows' scaled queries, accumulators and softmax
         * state, the block's transposed K and converted V rows */
        static __thread kept_t buf_kept;
        float *buf = kept_bytes(&buf_kept, sizeof(float) * (size_t)(2 * M * D + 2 * M + 16 * D
                                                                    + (KB + 1) * D));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            if (!buf) continue;
            float *qs = buf, *acc = qs + M * D, *m = acc + M * D, *l = m + M, *kt = l + M;
            attend_item(&p, &items[i], qs, acc, m, l, kt, kt + 16 * D);
        }
    }
    return failed ? 2 : 0;
}
