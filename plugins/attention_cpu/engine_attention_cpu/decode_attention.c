/* Paged decode attention on the CPU: one query token per request, K/V read straight from the
 * pool through the request-to-token table (no gather copy), online softmax in blocks of keys.
 *
 * Work item = (request, KV head): its G = H / KVH query heads share every K and V row that is
 * loaded, so each row is read once per step. Items are spread over OpenMP threads.
 * Pool layout: [slots, KVH, D], element type float32, bfloat16 or float16 (converted to float32
 * on load, then multiplied by the layer's K or V scale). q and out: float32 [T, H, D].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };
#define BLOCK 64
#define PREFETCH 4

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {  /* IEEE half -> float, with no compiler extension */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);  /* normal: rebias 15 -> 127 */
    } else {
        const float f = (float)man * 5.9604644775390625e-8f;  /* zero, subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline const float *load_row(const void *pool, int dtype, int64_t off, int64_t D,
                                    float scale, float *tmp) {
    if (dtype == F32 && scale == 1.0f) return (const float *)pool + off;
    if (dtype == F32) {
        const float *p = (const float *)pool + off;
        for (int64_t d = 0; d < D; d++) tmp[d] = p[d] * scale;
    } else if (dtype == BF16) {
        const uint16_t *p = (const uint16_t *)pool + off;
        for (int64_t d = 0; d < D; d++) tmp[d] = bf16_to_f32(p[d]) * scale;
    } else {
        const uint16_t *p = (const uint16_t *)pool + off;
        for (int64_t d = 0; d < D; d++) tmp[d] = f16_to_f32(p[d]) * scale;
    }
    return tmp;
}

/* ask for the KV heads kh0.. of a slot's row ahead of use: slots are scattered in the pool */
static inline void prefetch(const void *pool, int64_t slot, int64_t row, int64_t kh0, int64_t nkh,
                            int64_t D, int64_t esize) {
    const char *p = (const char *)pool + (slot * row + kh0 * D) * esize;
    for (int64_t c = 0; c < nkh * D * esize; c += 64) __builtin_prefetch(p + c);
}

static void attend(const float *qh, float *oh, const void *k_pool, const void *v_pool,
                   int dtype, const int32_t *table, int64_t start, int64_t L, int64_t KVH,
                   int64_t kh0, int64_t nkh, int64_t G, int64_t D, float scale, float k_scale,
                   float v_scale) {
    /* query heads kh0*G .. (kh0+nkh)*G-1 of one request; qh, oh point at head kh0*G */
    const int64_t NQ = nkh * G;
    float acc[NQ * D], score[NQ * BLOCK], mx[NQ], sum[NQ], tmp[D];
    for (int64_t i = 0; i < NQ * D; i++) acc[i] = 0.0f;
    for (int64_t g = 0; g < NQ; g++) { mx[g] = -1e30f; sum[g] = 0.0f; }
    const int64_t esize = dtype == F32 ? 4 : 2, row = KVH * D;
    for (int64_t l0 = start; l0 < L; l0 += BLOCK) {
        const int64_t n = (L - l0 < BLOCK) ? L - l0 : BLOCK;
        for (int64_t j = 0; j < n; j++) {
            if (l0 + j + PREFETCH < L)
                prefetch(k_pool, table[l0 + j + PREFETCH], row, kh0, nkh, D, esize);
            for (int64_t h = 0; h < nkh; h++) {
                const int64_t off = table[l0 + j] * row + (kh0 + h) * D;
                const float *k = load_row(k_pool, dtype, off, D, k_scale, tmp);
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qh + (h * G + g) * D;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d];
                    score[(h * G + g) * BLOCK + j] = dot * scale;
                }
            }
        }
        for (int64_t g = 0; g < NQ; g++) {
            float *sg = score + g * BLOCK;
            float m = mx[g];
            for (int64_t j = 0; j < n; j++) m = sg[j] > m ? sg[j] : m;
            const float corr = expf(mx[g] - m);
            float s = 0.0f;
            for (int64_t j = 0; j < n; j++) { sg[j] = expf(sg[j] - m); s += sg[j]; }
            sum[g] = sum[g] * corr + s;
            mx[g] = m;
            float *ag = acc + g * D;
            for (int64_t d = 0; d < D; d++) ag[d] *= corr;
        }
        for (int64_t j = 0; j < n; j++) {
            if (j + PREFETCH < n)
                prefetch(v_pool, table[l0 + j + PREFETCH], row, kh0, nkh, D, esize);
            for (int64_t h = 0; h < nkh; h++) {
                const int64_t off = table[l0 + j] * row + (kh0 + h) * D;
                const float *v = load_row(v_pool, dtype, off, D, v_scale, tmp);
                for (int64_t g = 0; g < G; g++) {
                    const float p = score[(h * G + g) * BLOCK + j];
                    float *ag = acc + (h * G + g) * D;
                    for (int64_t d = 0; d < D; d++) ag[d] += p * v[d];
                }
            }
        }
    }
    for (int64_t g = 0; g < NQ; g++) {
        const float inv = 1.0f / sum[g];
        for (int64_t d = 0; d < D; d++) oh[g * D + d] = acc[g * D + d] * inv;
    }
}

int decode_attention(const float *q, float *out, const int64_t *q_tokens,
                     const void *k_pool, const void *v_pool, int dtype,
                     const int32_t *req_to_token, int64_t table_stride,
                     const int64_t *rows, const int64_t *seq_lens,
                     int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t window,
                     float scale, float k_scale, float v_scale, int nthreads) {
    if (H % KVH != 0 || H * D > 65536 || D > 1024) return 1;  /* bounds the stack arrays */
    const int64_t G = H / KVH;
    /* few requests: split each one's KV heads across threads so that every thread has work */
    const int64_t split = B >= 4 * nthreads ? 1 : KVH;
    const int64_t nkh = KVH / split;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t item = 0; item < B * split; item++) {
        const int64_t b = item / split, kh0 = (item % split) * nkh;
        const int64_t L = seq_lens[b];
        const int64_t start = (window > 0 && L > window) ? L - window : 0;
        const int64_t off = (q_tokens[b] * H + kh0 * G) * D;
        attend(q + off, out + off, k_pool, v_pool, dtype, req_to_token + rows[b] * table_stride,
               start, L, KVH, kh0, nkh, G, D, scale, k_scale, v_scale);
    }
    return 0;
}
