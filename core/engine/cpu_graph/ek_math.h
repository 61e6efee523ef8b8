/* Scalar math the core's C libraries share (cpu_graph/graph.c, layers/cpu_fused.c): written
 * to vectorize inside their loops. */
#ifndef ENGINE_EK_MATH_H
#define ENGINE_EK_MATH_H

#include <math.h>
#include <stdint.h>

/* exp(x) for a vectorizing loop: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], a degree-6
 * polynomial (relative error ~2e-7, as expf), saturating to 0 / inf outside +-87. */
static inline float ek_vexp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } s;
    s.i = ((int32_t)n + 127) << 23;
    return p * s.f;
}

#endif
