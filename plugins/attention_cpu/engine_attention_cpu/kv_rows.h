/* What the cpu backend's kernels share (decode_attention.c, prompt_attention.c): the pool's
 * element types, a K or V row as float32, and 16-lane float vectors with their exp. */
#ifndef ENGINE_ATTENTION_CPU_KV_ROWS_H
#define ENGINE_ATTENTION_CPU_KV_ROWS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* a scratch buffer kept between calls (in a __thread variable: one per thread), grown when a
 * call needs more, never freed: no allocation per call */
typedef struct {
    void *p;
    size_t cap;
} kept_t;

/* at least `bytes` of k's buffer; NULL out of memory */
static inline void *kept_bytes(kept_t *k, size_t bytes) {
    if (bytes > k->cap) {
        free(k->p);
        k->p = malloc(bytes);
        k->cap = k->p ? bytes : 0;
    }
    return k->p;
}

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

/* n values of a pool row at element offset off as float32, times scale: the pool's own
 * memory where it is float32 and unscaled, else converted into tmp */
static inline const float *load_row(const void *pool, int dtype, int64_t off, int64_t n,
                                    float scale, float *tmp) {
    if (dtype == F32 && scale == 1.0f) return (const float *)pool + off;
    if (dtype == F32) {
        const float *p = (const float *)pool + off;
        for (int64_t d = 0; d < n; d++) tmp[d] = p[d] * scale;
    } else if (dtype == BF16) {
        const uint16_t *p = (const uint16_t *)pool + off;
        for (int64_t d = 0; d < n; d++) tmp[d] = bf16_to_f32(p[d]) * scale;
    } else {
        const uint16_t *p = (const uint16_t *)pool + off;
        int64_t d = 0;
#if defined(__AVX512F__)  /* vcvtph2ps: exact, as f16_to_f32 (this file is built -march=native) */
        for (; d + 16 <= n; d += 16)
            _mm512_storeu_ps(tmp + d, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(
                (const __m256i *)(p + d))), _mm512_set1_ps(scale)));
#elif defined(__F16C__)
        for (; d + 8 <= n; d += 8)
            _mm256_storeu_ps(tmp + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(
                (const __m128i *)(p + d))), _mm256_set1_ps(scale)));
#endif
        for (; d < n; d++) tmp[d] = f16_to_f32(p[d]) * scale;
    }
    return tmp;
}

/* ---- 16 lanes of float, whatever the CPU's vectors (-march=native: one zmm on AVX-512, two
 * ymm on AVX2) */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline v16 ld16(const float *p) { return *(const v16u *)p; }
static inline void st16(float *p, v16 v) { *(v16u *)p = v; }

/* exp of 16 lanes (libm's expf is one call per value): 2^n * p(r), r = x - n ln 2, Cephes'
 * degree-6 polynomial (~2e-7 relative error, as expf); 0 below -87, clamped at 88 */
static inline v16 vexp16(v16 x) {
    const i16v under = x < -87.0f;
    const i16v over = x > 88.0f;
    x = (v16)(((i16v)x & ~(under | over)) | ((i16v)((v16){0} + 88.0f) & over));
    const i16v n = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, i16v) - 128;
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    v16 y = (v16){0} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    return (v16)((i16v)(y * (v16)((n + 127) << 23)) & ~under);
}

#endif
