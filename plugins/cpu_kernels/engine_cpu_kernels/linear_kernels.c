/* Small-batch GEMMs for CPU decode: y[M, N] = x[M, K] . W[N, K]^T (+ bias), x and y float32
 * or bfloat16, W packed once at load in one of these formats:
 *
 *   FMT_F16        float16 weights, k-major tiles of 32 output rows: tile[k][32]
 *   FMT_BF16       bfloat16 weights, the same k-major layout
 *   FMT_BF16_PAIRS bfloat16 weights for vdpbf16ps: tile[k / 2][32][2] (K padded to even)
 *   FMT_Q8_0       GGUF Q8_0 blocks (32 int8 and one float16 scale per block of K): per tile
 *                  and block, 8 groups of [32 rows][4 bytes] (1024 bytes) then 32 float16
 *                  scales (64 bytes): 34 bytes per 32 weights, as in a GGUF file
 *   FMT_Q4_0       GGUF Q4_0 blocks (16 bytes of nibbles and one float16 scale d per block;
 *                  weight = d * (q - 8)): per tile and block, the nibbles as
 *                  [4 words][2 halves of 16 rows][16 rows][4 bytes] (512 bytes: word p of a
 *                  GGUF block's qs holds weights 4p..4p+3 in its low nibbles and 16+4p..16+4p+3
 *                  in its high ones), then 32 float16 d (64 bytes): 18 bytes per 32 weights
 *   FMT_Q4_1       GGUF Q4_1 blocks (weight = d * q + m): as Q4_0, then 32 float16 m
 *                  (64 bytes more): 20 bytes per 32 weights
 *   FMT_Q8_0_F32, FMT_Q4_0_F32, FMT_Q4_1_F32
 *                  weight-only modes of the three block formats: the same packed bytes (pack
 *                  with FMT_Q8_0 / Q4_0 / Q4_1, or pass these codes: packing and unpacking treat
 *                  them as their base format), but ek_linear keeps the activations float32
 *                  (bfloat16 ones widened) and dequantizes the weights in registers (Q4_0
 *                  d * (q - 8), Q4_1 d * q + m, Q8_0 d * q, d and m float16 -> float32), with
 *                  float32 accumulation: the result is float32 x @ W^T within float rounding.
 *                  Few rows (the decode regime) run fused kernels (nibbles / int8 widened to
 *                  float and FMA'd against the activations, per block sum times d); more rows
 *                  dequantize the tile to float32 scratch once and run the float32 kernels.
 *   FMT_F32        float32 weights, k-major tiles of 32 output rows: tile[k][32] (a float32
 *                  model's linears, and its MoE experts through ek_grouped_linear)
 *
 * Each tile holds 32 output rows (N is padded to a multiple of 32 with zeros), and a tile's
 * bytes are contiguous in the order the kernel reads them, so one pass streams the weights.
 *
 * Instruction sets, chosen at run time by the caller from ek_features() (cpuid through
 * __builtin_cpu_supports), never at build time: every function that uses an extension carries
 * its own target attribute, and one shared object holds all paths:
 *   ISA_SCALAR  plain C (any CPU; slow, for correctness and odd machines)
 *   ISA_AVX2    AVX2 + FMA + F16C: float16/bfloat16 converted to float32 and FMA; Q8_0 with
 *               vpmaddubsw on |w| and sign(x, w) (llama.cpp's trick), activations int8 per block
 *   ISA_AVX512  AVX-512F/BW/VL: float16/bfloat16 converted + FMA; vdpbf16ps (AVX512_BF16) for
 *               FMT_BF16_PAIRS; vpdpbusd (AVX512_VNNI) for Q8_0 with activations quantized to
 *               int8 per block of 32 and offset to unsigned (x + 128; the offset times the
 *               block's weight sum is subtracted, computed by the same instruction)
 *
 * The N tiles are split across nthreads OpenMP threads (torch's libgomp: torch is loaded
 * before this library). Rows are processed in chunks of 64 so that a chunk's activations stay
 * in cache while the weights stream; within a chunk, register-blocked micro-kernels run
 * MR rows x 32 columns at a time.
 *
 * ek_grouped_linear runs many such GEMMs in one call, an MoE layer's experts: each expert's
 * rows of a sorted activation matrix times its own packed weight, every (expert, tile) pair a
 * work item that the threads claim, so that both threads stream weights however few rows each
 * expert has.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "graph.h" /* engine's CPU graph nodes: engine.cpu_graph.include_dir() */

#define NR 32          /* output rows per tile */
#define QK 32          /* weights per quantization block */
#define Q8_TILE_BLOCK (8 * NR * 4 + NR * 2) /* 1088 bytes: one block of K for one tile */
#define Q4_NIBBLES (4 * NR * 4)               /* 512 bytes of nibbles per tile and block */
#define Q4_0_TILE_BLOCK (Q4_NIBBLES + NR * 2) /* 576: nibbles, d */
#define Q4_1_TILE_BLOCK (Q4_NIBBLES + NR * 4) /* 640: nibbles, d, m */
#define M_CHUNK 64

enum { FMT_F16 = 0, FMT_BF16 = 1, FMT_BF16_PAIRS = 2, FMT_Q8_0 = 3, FMT_Q4_0 = 4, FMT_Q4_1 = 5,
       /* weight-only modes of the block formats: the same packed bytes (FMT_Q8_0 / Q4_0 /
        * Q4_1), float32 activations, the weights dequantized in registers */
       FMT_Q8_0_F32 = 6, FMT_Q4_0_F32 = 7, FMT_Q4_1_F32 = 8,
       FMT_F32 = 9 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { DT_F32 = 0, DT_BF16 = 1 };
enum { FEAT_AVX2 = 1, FEAT_AVX512 = 2, FEAT_AVX512_BF16 = 4, FEAT_AVX512_VNNI = 8 };
enum { EK_OK = 0, EK_BAD_FORMAT = -1, EK_BAD_ISA = -2, EK_BAD_K = -3, EK_NO_MEMORY = -4,
       EK_UNSUPPORTED = -5, EK_BAD_ARGS = -6 };

#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#define T_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define T_512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#define T_512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
/* Prefetch of the next tile while this one is computed (NULL: none): the tile being computed
 * streams from memory through the hardware prefetchers; the next one is requested meanwhile, at
 * the pace of the current one, so that compute and memory traffic overlap. The block formats
 * prefetch only for several rows: one row streams as fast as the hardware prefetchers alone
 * bring the tiles (Q4_1 and Q8_0 measured 3-15% faster at one row without it). */
#define PF(p) do { if (pf) _mm_prefetch((const char *)(p), _MM_HINT_T0); } while (0)
/* into L2 only: FMT_F32 tiles (128 KiB at K 1024) prefetched a tile ahead; into L1 they
 * evicted the running tile (the Qwen3-MoE expert GEMMs at 256 tokens: 22.0 -> 17.6 ms) */
#define PF2(p) do { if (pf) _mm_prefetch((const char *)(p), _MM_HINT_T1); } while (0)

/* ---------------------------------------------------------------- features */

int ek_features(void) {
    __builtin_cpu_init();
    int f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        f |= FEAT_AVX2;
    if ((f & FEAT_AVX2) && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
        f |= FEAT_AVX512;
        if (__builtin_cpu_supports("avx512bf16")) f |= FEAT_AVX512_BF16;
        if (__builtin_cpu_supports("avx512vnni")) f |= FEAT_AVX512_VNNI;
    }
    return f;
}

static int is_wo(int fmt) { return fmt >= FMT_Q8_0_F32 && fmt <= FMT_Q4_1_F32; }

/* the packing format of a weight-only mode (FMT_Q4_1_F32 -> FMT_Q4_1), others as they are */
static int base_fmt(int fmt) { return is_wo(fmt) ? fmt - FMT_Q8_0_F32 + FMT_Q8_0 : fmt; }

static int isa_ok(int fmt, int isa) {
    int f = ek_features();
    if (is_wo(fmt)) /* FMA + F16C / AVX-512F/BW/VL: no VNNI needed */
        return isa == ISA_SCALAR || (isa == ISA_AVX2 && (f & FEAT_AVX2)) ||
               (isa == ISA_AVX512 && (f & FEAT_AVX512));
    if (isa == ISA_SCALAR) return 1;
    if (isa == ISA_AVX2) return (f & FEAT_AVX2) && fmt != FMT_BF16_PAIRS;
    if (isa == ISA_AVX512) {
        if (!(f & FEAT_AVX512)) return 0;
        if (fmt == FMT_BF16_PAIRS) return (f & FEAT_AVX512_BF16) != 0;
        if (fmt == FMT_Q8_0 || fmt == FMT_Q4_0 || fmt == FMT_Q4_1)
            return (f & FEAT_AVX512_VNNI) != 0;
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- scalar helpers */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Per-thread scratch, grown as needed (a converted weight tile, converted activations). */
typedef struct { void *p; size_t cap; } scratch_t;
static __thread scratch_t tl_tile, tl_act;

static void *scratch(scratch_t *s, size_t bytes) {
    if (bytes > s->cap) {
        free(s->p);
        s->p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        s->cap = s->p ? bytes : 0;
    }
    return s->p;
}

/* ---------------------------------------------------------------- packing */

int64_t ek_packed_bytes(int fmt, int64_t N, int64_t K) {
    int64_t nt = (N + NR - 1) / NR;
    fmt = base_fmt(fmt);
    switch (fmt) {
    case FMT_F16:
    case FMT_BF16: return nt * K * NR * 2;
    case FMT_F32: return nt * K * NR * 4;
    case FMT_BF16_PAIRS: return nt * ((K + 1) / 2 * 2) * NR * 2;
    case FMT_Q8_0: return K % QK ? EK_BAD_K : nt * (K / QK) * Q8_TILE_BLOCK;
    case FMT_Q4_0: return K % QK ? EK_BAD_K : nt * (K / QK) * Q4_0_TILE_BLOCK;
    case FMT_Q4_1: return K % QK ? EK_BAD_K : nt * (K / QK) * Q4_1_TILE_BLOCK;
    }
    return EK_BAD_FORMAT;
}

/* src: [N, K] 16-bit values (float16 or bfloat16 bits) for the float formats. */
int ek_pack_half(int fmt, const uint16_t *src, int64_t N, int64_t K, uint16_t *dst,
                 int nthreads) {
    int64_t nt = (N + NR - 1) / NR;
    if (fmt == FMT_F16 || fmt == FMT_BF16) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t t = 0; t < nt; t++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = t * NR + j;
                uint16_t *d = dst + t * K * NR + j;
                for (int64_t k = 0; k < K; k++) d[k * NR] = n < N ? src[n * K + k] : 0;
            }
        return EK_OK;
    }
    if (fmt == FMT_BF16_PAIRS) {
        int64_t kp = (K + 1) / 2 * 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t t = 0; t < nt; t++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = t * NR + j;
                uint16_t *d = dst + t * kp * NR + j * 2;
                for (int64_t k = 0; k < kp; k++)
                    d[(k / 2) * NR * 2 + (k & 1)] = (n < N && k < K) ? src[n * K + k] : 0;
            }
        return EK_OK;
    }
    return EK_BAD_FORMAT;
}

/* FMT_F32: src [N, K] float32 (row stride K) -> tiles [k][32] */
int ek_pack_f32(const float *src, int64_t N, int64_t K, float *dst, int nthreads) {
    int64_t nt = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < nt; t++)
        for (int64_t j = 0; j < NR; j++) {
            int64_t n = t * NR + j;
            float *d = dst + t * K * NR + j;
            for (int64_t k = 0; k < K; k++) d[k * NR] = n < N ? src[n * K + k] : 0.0f;
        }
    return EK_OK;
}

/* Q8_0: q [N, K] int8, d [N, K / 32] float16 bits (a GGUF Q8_0 tensor's blocks, split). */
int ek_pack_q8_0(const int8_t *q, const uint16_t *d, int64_t N, int64_t K, uint8_t *dst,
                 int nthreads) {
    if (K % QK) return EK_BAD_K;
    int64_t nt = (N + NR - 1) / NR, nb = K / QK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < nt; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = dst + (t * nb + b) * Q8_TILE_BLOCK;
            uint16_t *scales = (uint16_t *)(blk + 8 * NR * 4);
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = t * NR + j;
                for (int g = 0; g < 8; g++)
                    for (int e = 0; e < 4; e++)
                        blk[(g * NR + j) * 4 + e] =
                            n < N ? (uint8_t)q[n * K + b * QK + g * 4 + e] : 0;
                scales[j] = n < N ? d[n * nb + b] : 0;
            }
        }
    return EK_OK;
}

static int is_q4(int fmt) { return fmt == FMT_Q4_0 || fmt == FMT_Q4_1; }

static int64_t q4_tile_block(int fmt) {
    return fmt == FMT_Q4_0 ? Q4_0_TILE_BLOCK : Q4_1_TILE_BLOCK;
}

/* One GGUF Q4 block (row j of the tile) into its places in the tile's block. */
static void put_q4_block(int fmt, const uint8_t *src, int j, uint8_t *blk) {
    const uint8_t *qs = src + (fmt == FMT_Q4_0 ? 2 : 4);
    for (int p = 0; p < 4; p++) memcpy(blk + (p * NR + j) * 4, qs + p * 4, 4);
    memcpy(blk + Q4_NIBBLES + j * 2, src, 2);                              /* d */
    if (fmt == FMT_Q4_1) memcpy(blk + Q4_NIBBLES + NR * 2 + j * 2, src + 2, 2); /* m */
}

/* Q4_0 / Q4_1 from a GGUF tensor's bytes as they are in the file: raw holds N rows of K / 32
 * blocks (18 bytes for Q4_0: d, qs[16]; 20 for Q4_1: d, m, qs[16]). Rows past N are zeros. */
int ek_pack_gguf_q4(int fmt, const uint8_t *raw, int64_t N, int64_t K, uint8_t *dst,
                    int nthreads) {
    if (!is_q4(fmt)) return EK_BAD_FORMAT;
    if (K % QK) return EK_BAD_K;
    int64_t nt = (N + NR - 1) / NR, nb = K / QK, tb = q4_tile_block(fmt);
    int64_t bs = fmt == FMT_Q4_0 ? 18 : 20;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < nt; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = dst + (t * nb + b) * tb;
            memset(blk, 0, (size_t)tb);
            for (int j = 0; j < NR && t * NR + j < N; j++)
                put_q4_block(fmt, raw + ((t * NR + j) * nb + b) * bs, j, blk);
        }
    return EK_OK;
}

/* weight k (0..31) of row j in a Q4 tile block: its nibble (0..15) */
static inline int q4_nibble(const uint8_t *blk, int j, int k) {
    int word = (k % 16) / 4, e = k % 4;
    uint8_t byte = blk[(word * NR + j) * 4 + e];
    return k < 16 ? byte & 0xF : byte >> 4;
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* Back to [N, K] float32 (tests, and a reference for any format). */
int ek_unpack(int fmt, const void *packed, int64_t N, int64_t K, float *dst) {
    int64_t nb = K / QK, kp = (K + 1) / 2 * 2;
    fmt = base_fmt(fmt);
    for (int64_t n = 0; n < N; n++) {
        int64_t t = n / NR, j = n % NR;
        for (int64_t k = 0; k < K; k++) {
            float v;
            if (fmt == FMT_F16 || fmt == FMT_BF16) {
                uint16_t h = ((const uint16_t *)packed)[t * K * NR + k * NR + j];
                v = fmt == FMT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
            } else if (fmt == FMT_F32) {
                v = ((const float *)packed)[t * K * NR + k * NR + j];
            } else if (fmt == FMT_BF16_PAIRS) {
                v = bf16_to_f32(
                    ((const uint16_t *)packed)[t * kp * NR + (k / 2) * NR * 2 + j * 2 + (k & 1)]);
            } else if (is_q4(fmt)) {
                if (K % QK) return EK_BAD_K;
                const uint8_t *blk =
                    (const uint8_t *)packed + (t * nb + k / QK) * q4_tile_block(fmt);
                int q = q4_nibble(blk, (int)j, (int)(k % QK));
                float d = f16_at(blk + Q4_NIBBLES + j * 2);
                v = fmt == FMT_Q4_0 ? d * (float)(q - 8)
                                    : d * (float)q + f16_at(blk + Q4_NIBBLES + NR * 2 + j * 2);
            } else if (fmt == FMT_Q8_0) {
                if (K % QK) return EK_BAD_K;
                const uint8_t *blk = (const uint8_t *)packed + (t * nb + k / QK) * Q8_TILE_BLOCK;
                int g = (k % QK) / 4, e = k % 4;
                uint16_t s;
                memcpy(&s, blk + 8 * NR * 4 + j * 2, 2);
                v = (float)(int8_t)blk[(g * NR + j) * 4 + e] * f16_to_f32(s);
            } else {
                return EK_BAD_FORMAT;
            }
            dst[n * K + k] = v;
        }
    }
    return EK_OK;
}

/* ---------------------------------------------------------------- activations */

/* float32 rows of x, converting bfloat16 ones (into per-thread scratch). */
static const float *act_f32(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx,
                            int64_t *ld_out) {
    if (xdt == DT_F32) {
        *ld_out = ldx;
        return (const float *)x;
    }
    float *buf = scratch(&tl_act, (size_t)(M * K) * 4);
    if (!buf) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++)
            buf[m * K + k] = bf16_to_f32(((const uint16_t *)x)[m * ldx + k]);
    *ld_out = K;
    return buf;
}

/* each row's sum per block of 32 of float32 rows [m0, m1) of x (row stride ld): s[m * nb + b] */
static void block_sums(const float *xf, int64_t ld, int64_t m0, int64_t m1, int64_t K,
                       float *s) {
    const int64_t nb = K / QK;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t b = 0; b < nb; b++) {
            float acc = 0.0f;
            for (int i = 0; i < QK; i++) acc += xf[m * ld + b * QK + i];
            s[m * nb + b] = acc;
        }
}

/* Weight-only block formats: float32 rows of x (bfloat16 widened, into per-thread scratch) and,
 * with `sums`, each row's sum per block of 32 ([M, K / 32] floats: the Q4_1 m term). */
static const float *act_wo(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx, int sums,
                           int64_t *ld_out, float **xs) {
    int64_t nb = K / QK, ld = xdt == DT_F32 ? ldx : K;
    size_t xbytes = xdt == DT_F32 ? 0 : (size_t)(M * K) * 4;
    float *buf = scratch(&tl_act, xbytes + (sums ? (size_t)(M * nb) * 4 : 0) + 64);
    if (!buf) return NULL;
    const float *xf = (const float *)x;
    if (xdt != DT_F32) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++)
                buf[m * K + k] = bf16_to_f32(((const uint16_t *)x)[m * ldx + k]);
        xf = buf;
    }
    *xs = NULL;
    if (sums) {
        float *s = buf + xbytes / 4;
        block_sums(xf, ld, 0, M, K, s);
        *xs = s;
    }
    *ld_out = ld;
    return xf;
}

/* rows [m0, m1) of x as bfloat16 pairs: out[m * kp + k], kp = K rounded up to even */
static void bf16_rows(const void *x, int xdt, int64_t m0, int64_t m1, int64_t K, int64_t ldx,
                      uint16_t *out) {
    int64_t kp = (K + 1) / 2 * 2;
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t k = 0; k < K; k++)
            out[m * kp + k] = xdt == DT_BF16 ? ((const uint16_t *)x)[m * ldx + k]
                                             : f32_to_bf16(((const float *)x)[m * ldx + k]);
        if (kp > K) out[m * kp + K] = 0;
    }
}

/* bfloat16 rows of x with even K (pairs for vdpbf16ps). */
static const uint16_t *act_bf16(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx,
                                int64_t *ld_out) {
    int64_t kp = (K + 1) / 2 * 2;
    if (xdt == DT_BF16 && kp == K && ldx % 2 == 0) {
        *ld_out = ldx;
        return (const uint16_t *)x;
    }
    uint16_t *buf = scratch(&tl_act, (size_t)(M * kp) * 2);
    if (!buf) return NULL;
    bf16_rows(x, xdt, 0, M, K, ldx, buf);
    *ld_out = kp;
    return buf;
}

/* Q8_0 activations, as llama.cpp quantizes them for a Q8_0 dot product: per block of 32,
 * d = max|x| / 127, q = round(x / d) (halves away from zero). Written as int8 (offset 128 to
 * uint8 with `offset`) followed by the float scales and the int32 sums of each block's q (the
 * Q4 kernels' offset and m terms; Q8_1's s is d times it): [M, K] bytes, then [M, K / 32]
 * floats, then [M, K / 32] int32. */
/* One block of 32 activations quantized with AVX2, exactly as the scalar loop below: the same
 * float operations, and roundf's halves away from zero (truncate, then step away from zero
 * where the dropped part is at least one half). */
T_AVX2 INLINE __m256 ld8_act_avx2(const void *x, int xdt, int64_t k) {
    if (xdt == DT_F32) return _mm256_loadu_ps((const float *)x + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

T_AVX2 static void quantize_block_avx2(const void *x, int xdt, int64_t k0, int offset,
                                       uint8_t *out, float *d, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = ld8_act_avx2(x, xdt, k0 + i * 8);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float dd = _mm_cvtss_f32(m4) / 127.0f, id = dd ? 1.0f / dd : 0.0f;
    *d = dd;
    __m256i q[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 s = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
        __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(s, t)), half, _CMP_GE_OQ);
        t = _mm256_add_ps(t, _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(s, sign),
                                                               _mm256_set1_ps(1.0f))));
        q[i] = _mm256_cvttps_epi32(t);
        total = _mm256_add_epi32(total, q[i]);
    }
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    *sum = _mm_cvtsi128_si32(t4);
    /* int32 -> int8 in order: the packs work per 128-bit lane, a dword permute restores it */
    __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b = _mm256_packs_epi16(w01, w23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (offset) b = _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80)); /* q + 128 */
    _mm256_storeu_si256((__m256i *)out, b);
}

/* the layout of quantized activations for `cap` rows: [cap, K] bytes (padded to 64), then
 * [cap, K / 32] float scales, then [cap, K / 32] int32 sums */
static size_t q8_bytes(int64_t cap, int64_t K) {
    return (size_t)((cap * K + 63) / 64 * 64) + (size_t)(cap * (K / QK)) * 8;
}

static void q8_parts(uint8_t *buf, int64_t cap, int64_t K, float **d, int32_t **sum) {
    *d = (float *)(buf + (cap * K + 63) / 64 * 64);
    *sum = (int32_t *)(*d + cap * (K / QK));
}

/* rows [m0, m1) of x quantized into `buf`, laid out for `cap` rows (q8_bytes) */
static void quantize_rows(const void *x, int xdt, int64_t m0, int64_t m1, int64_t K,
                          int64_t ldx, int offset, int isa, uint8_t *buf, int64_t cap) {
    int64_t nb = K / QK;
    float *d;
    int32_t *sum;
    q8_parts(buf, cap, K, &d, &sum);
    if (isa != ISA_SCALAR) {
        int64_t es = xdt == DT_F32 ? 4 : 2;
        for (int64_t m = m0; m < m1; m++)
            for (int64_t b = 0; b < nb; b++)
                quantize_block_avx2((const char *)x + m * ldx * es, xdt, b * QK, offset,
                                    buf + m * K + b * QK, d + m * nb + b, sum + m * nb + b);
        return;
    }
    for (int64_t m = m0; m < m1; m++)
        for (int64_t b = 0; b < nb; b++) {
            float v[QK], amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                int64_t k = b * QK + i;
                v[i] = xdt == DT_F32 ? ((const float *)x)[m * ldx + k]
                                     : bf16_to_f32(((const uint16_t *)x)[m * ldx + k]);
                amax = fmaxf(amax, fabsf(v[i]));
            }
            float dd = amax / 127.0f, id = dd ? 1.0f / dd : 0.0f;
            d[m * nb + b] = dd;
            int32_t s = 0;
            for (int i = 0; i < QK; i++) {
                int q = (int)roundf(v[i] * id);
                s += q;
                buf[m * K + b * QK + i] = (uint8_t)(offset ? q + 128 : (int8_t)q);
            }
            sum[m * nb + b] = s;
        }
}

static uint8_t *act_q8(const void *x, int xdt, int64_t M, int64_t K, int64_t ldx, int offset,
                       int isa, float **scales, int32_t **sums) {
    uint8_t *buf = scratch(&tl_act, q8_bytes(M, K));
    if (!buf) return NULL;
    quantize_rows(x, xdt, 0, M, K, ldx, offset, isa, buf, M);
    q8_parts(buf, M, K, scales, sums);
    return buf;
}

/* ---------------------------------------------------------------- scalar kernels */

/* c[mr][32] for one tile; x rows float32 (float formats) or int8 + scales (Q8_0). */
static void mk_scalar(int fmt, const void *xa, int64_t ldx, const float *dx, const void *wt,
                      int64_t K, float *c, int mr) {
    int64_t kp = (K + 1) / 2 * 2, nb = K / QK;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) {
            float acc = 0.0f;
            if (fmt == FMT_Q8_0) {
                const int8_t *xq = (const int8_t *)xa + i * ldx;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = (const uint8_t *)wt + b * Q8_TILE_BLOCK;
                    int32_t dot = 0;
                    for (int g = 0; g < 8; g++)
                        for (int e = 0; e < 4; e++)
                            dot += (int32_t)(int8_t)blk[(g * NR + j) * 4 + e] * xq[b * QK + g * 4 + e];
                    uint16_t s;
                    memcpy(&s, blk + 8 * NR * 4 + j * 2, 2);
                    acc += (float)dot * f16_to_f32(s) * dx[i * (K / QK) + b];
                }
            } else if (fmt == FMT_BF16_PAIRS) {
                const uint16_t *xb = (const uint16_t *)xa + i * ldx, *w = wt;
                for (int64_t k = 0; k < kp; k++)
                    acc += bf16_to_f32(xb[k]) * bf16_to_f32(w[(k / 2) * NR * 2 + j * 2 + (k & 1)]);
            } else {
                const float *x = (const float *)xa + i * ldx;
                const uint16_t *w = wt;
                for (int64_t k = 0; k < K; k++) {
                    uint16_t h = w[k * NR + j];
                    acc += x[k] * (fmt == FMT_F16 ? f16_to_f32(h) : bf16_to_f32(h));
                }
            }
            c[i * NR + j] = acc;
        }
}

/* Q4_0 / Q4_1, the reference: per block, the integer dot of the nibbles with the int8
 * activations, then d_w * d_x * (dot - 8 * sum(q_x)) (Q4_0) or d_w * d_x * dot
 * + m_w * d_x * sum(q_x) (Q4_1). Activation scales and sums [mr, nb]. */
static void mk_scalar_q4(int fmt, const int8_t *xq, int64_t ldx, const float *dx,
                         const int32_t *sx, const uint8_t *wt, int64_t nb, float *c, int mr) {
    const int64_t tb = q4_tile_block(fmt);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = wt + b * tb;
                int32_t dot = 0;
                for (int k = 0; k < QK; k++) dot += q4_nibble(blk, j, k) * xq[i * ldx + b * QK + k];
                float dw = f16_at(blk + Q4_NIBBLES + j * 2), d = dx[i * nb + b];
                int32_t s = sx[i * nb + b];
                if (fmt == FMT_Q4_0) acc += dw * d * (float)(dot - 8 * s);
                else acc += dw * d * (float)dot +
                            f16_at(blk + Q4_NIBBLES + NR * 2 + j * 2) * (d * (float)s);
            }
            c[i * NR + j] = acc;
        }
}

/* ---------------------------------------------------------------- AVX2 kernels */

#define MR_AVX2 2        /* rows per micro-kernel converting half weights on the fly */
#define MR_AVX2_F32 3    /* rows per micro-kernel on a float32 tile */
#ifndef AVX2_KC
#define AVX2_KC 16       /* k per float32 chunk of a half tile (2 KiB, L1; 8-64 measured) */
#endif

T_AVX2 INLINE __m256 ld8_avx2(const void *p, const int fmt) {
    if (fmt == -1) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (fmt == FMT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* fmt -1: a float32 tile [K][32]; else a half tile [K][32] converted on the fly */
T_AVX2 INLINE void mk_avx2_acc(const float *x, int64_t ldx, const void *wt, int64_t K,
                               float *c, const int MR, const int fmt, const char *pf,
                               const int acc) {
    __m256 a[3][4];
    const int es = fmt == -1 ? 4 : 2;
#pragma GCC unroll 3
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            a[i][j] = acc ? _mm256_loadu_ps(c + i * NR + j * 8) : _mm256_setzero_ps();
    const char *w = (const char *)wt;
    for (int64_t k = 0; k < K; k++) {
        PF(pf + k * NR * 2);
        __m256 w0 = ld8_avx2(w + (k * NR + 0) * es, fmt), w1 = ld8_avx2(w + (k * NR + 8) * es, fmt);
        __m256 w2 = ld8_avx2(w + (k * NR + 16) * es, fmt), w3 = ld8_avx2(w + (k * NR + 24) * es, fmt);
#pragma GCC unroll 3
        for (int i = 0; i < MR; i++) {
            __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);
            a[i][0] = _mm256_fmadd_ps(w0, xb, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(w1, xb, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(w2, xb, a[i][2]);
            a[i][3] = _mm256_fmadd_ps(w3, xb, a[i][3]);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(c + i * NR + j * 8, a[i][j]);
}

/* acc 0: c = x . w over K; acc 1: c += it (a chunk of K after the first) */
T_AVX2 INLINE void mk_avx2_impl(const float *x, int64_t ldx, const void *wt, int64_t K,
                                float *c, const int MR, const int fmt, const char *pf) {
    mk_avx2_acc(x, ldx, wt, K, c, MR, fmt, pf, 0);
}

/* every one of ``rows`` rows over a float32 chunk [kc][32] of a tile, k0..k0 + kc, in passes
 * of MR_AVX2_F32 rows: into c for the first chunk (k0 0), onto it for the next. The AVX2
 * converted and dequantized tiles run through this a chunk at a time, so that the chunk stays
 * in L1 for every pass (the whole tile read from L2 once per pass cost more) */
T_AVX2 static void avx2_chunk_passes(const float *x, int64_t ldx, const float *chunk,
                                     int64_t k0, int64_t kc, float *c, int64_t rows) {
    for (int64_t i = 0; i < rows; i += MR_AVX2_F32) {
        const float *xi = x + i * ldx + k0;
        float *ci = c + i * NR;
        int mr = rows - i < MR_AVX2_F32 ? (int)(rows - i) : MR_AVX2_F32;
        if (k0) {
            if (mr == 1) mk_avx2_acc(xi, ldx, chunk, kc, ci, 1, -1, NULL, 1);
            else if (mr == 2) mk_avx2_acc(xi, ldx, chunk, kc, ci, 2, -1, NULL, 1);
            else mk_avx2_acc(xi, ldx, chunk, kc, ci, 3, -1, NULL, 1);
        } else {
            if (mr == 1) mk_avx2_acc(xi, ldx, chunk, kc, ci, 1, -1, NULL, 0);
            else if (mr == 2) mk_avx2_acc(xi, ldx, chunk, kc, ci, 2, -1, NULL, 0);
            else mk_avx2_acc(xi, ldx, chunk, kc, ci, 3, -1, NULL, 0);
        }
    }
}

T_AVX2 static void mk_avx2_half(int fmt, const float *x, int64_t ldx, const void *wt, int64_t K,
                                float *c, int mr, const char *pf) {
    if (fmt == FMT_F16) {
        if (mr == 1) mk_avx2_impl(x, ldx, wt, K, c, 1, FMT_F16, pf);
        else mk_avx2_impl(x, ldx, wt, K, c, 2, FMT_F16, pf);
    } else {
        if (mr == 1) mk_avx2_impl(x, ldx, wt, K, c, 1, FMT_BF16, pf);
        else mk_avx2_impl(x, ldx, wt, K, c, 2, FMT_BF16, pf);
    }
}

/* a half tile [K][32] to float32 */
T_AVX2 static void tile_to_f32_avx2(int fmt, const uint16_t *w, int64_t K, float *out,
                                    const char *pf) {
    for (int64_t i = 0; i < K * NR; i += 8) {
        if ((i & 31) == 0) PF(pf + i * 2);
        _mm256_storeu_ps(out + i, fmt == FMT_F16 ? ld8_avx2(w + i, FMT_F16) : ld8_avx2(w + i, FMT_BF16));
    }
}

/* Q8_0, one row: 4 x 8 outputs, |w| x sign(x, w) with vpmaddubsw (no saturation: |w|, |x| <= 127) */
T_AVX2 static void mk_avx2_q8(const int8_t *xq, const float *dx, const uint8_t *wt, int64_t nb,
                              float *c, const char *pf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * Q8_TILE_BLOCK;
        __m256i d0 = _mm256_setzero_si256(), d1 = d0, d2 = d0, d3 = d0;
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            PF(pf + b * Q8_TILE_BLOCK + g * 128);
            PF(pf + b * Q8_TILE_BLOCK + g * 128 + 64);
            __m256i xv = _mm256_set1_epi32(load_i32(xq + b * QK + g * 4));
#define Q8_AVX2_STEP(J, D)                                                                    \
    {                                                                                         \
        __m256i w = _mm256_loadu_si256((const __m256i *)(blk + g * NR * 4 + (J) * 32));       \
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));    \
        D = _mm256_add_epi32(D, _mm256_madd_epi16(p, ones));                                  \
    }
            Q8_AVX2_STEP(0, d0) Q8_AVX2_STEP(1, d1) Q8_AVX2_STEP(2, d2) Q8_AVX2_STEP(3, d3)
#undef Q8_AVX2_STEP
        }
        PF(pf + b * Q8_TILE_BLOCK + 1024);
        const __m128i *sp = (const __m128i *)(blk + 8 * NR * 4);
        __m256 dxv = _mm256_set1_ps(dx[b]);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(sp + 0)), dxv), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(sp + 1)), dxv), a1);
        a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(sp + 2)), dxv), a2);
        a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d3), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(sp + 3)), dxv), a3);
    }
    _mm256_storeu_ps(c, a0);
    _mm256_storeu_ps(c + 8, a1);
    _mm256_storeu_ps(c + 16, a2);
    _mm256_storeu_ps(c + 24, a3);
}

/* Q4_0 / Q4_1 on AVX2, one row at a time (16 ymm registers: 4 float and 4 int16
 * accumulators, 2 activation words, 3 weight vectors, 2 constants): per block, word p of the
 * nibbles (4 x 32 bytes: 8 output rows each) split into low and high nibbles (unsigned 0..15)
 * and multiplied with the int8 activations by vpmaddubsw; the int16 pair sums of a whole block
 * add up without overflow (|sum| <= 4 * 2 * 2 * 15 * 127 = 30480) before one vpmaddwd. */
T_AVX2 INLINE void mk_avx2_q4_impl(const int8_t *xq, const float *dx, const int32_t *sx,
                                   const uint8_t *wt, int64_t nb, float *c, const int fmt,
                                   const char *pf) {
    const int64_t tb = fmt == FMT_Q4_0 ? Q4_0_TILE_BLOCK : Q4_1_TILE_BLOCK;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 a[4];
#pragma GCC unroll 4
    for (int o = 0; o < 4; o++) a[o] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * tb;
        __m256i s16[4];
#pragma GCC unroll 4
        for (int o = 0; o < 4; o++) s16[o] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            PF(pf + b * tb + p * 128);
            PF(pf + b * tb + p * 128 + 64);
            __m256i xl = _mm256_set1_epi32(load_i32(xq + b * QK + p * 4));
            __m256i xh = _mm256_set1_epi32(load_i32(xq + b * QK + 16 + p * 4));
#pragma GCC unroll 4
            for (int o = 0; o < 4; o++) { /* output rows 8o..8o+7 */
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + p * NR * 4 + o * 32));
                __m256i wl = _mm256_and_si256(v, lo4);
                __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                s16[o] = _mm256_add_epi16(s16[o], _mm256_add_epi16(
                    _mm256_maddubs_epi16(wl, xl), _mm256_maddubs_epi16(wh, xh)));
            }
        }
        PF(pf + b * tb + Q4_NIBBLES);
        if (fmt == FMT_Q4_1) PF(pf + b * tb + Q4_NIBBLES + 64);
        const float d = dx[b];
        const int32_t s = sx[b];
        const __m256 dxv = _mm256_set1_ps(d), ms = _mm256_set1_ps(d * (float)s);
        const __m256i off = _mm256_set1_epi32(8 * s);
#pragma GCC unroll 4
        for (int o = 0; o < 4; o++) {
            __m256i dot = _mm256_madd_epi16(s16[o], ones);
            if (fmt == FMT_Q4_0) dot = _mm256_sub_epi32(dot, off);
            __m256 dw =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4_NIBBLES + o * 16)));
            a[o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dxv), a[o]);
            if (fmt == FMT_Q4_1) {
                __m256 m = _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)(blk + Q4_NIBBLES + NR * 2 + o * 16)));
                a[o] = _mm256_fmadd_ps(m, ms, a[o]);
            }
        }
    }
#pragma GCC unroll 4
    for (int o = 0; o < 4; o++) _mm256_storeu_ps(c + o * 8, a[o]);
}

T_AVX2 static void mk_avx2_q4(int fmt, const int8_t *xq, const float *dx, const int32_t *sx,
                              const uint8_t *wt, int64_t nb, float *c, const char *pf) {
    if (fmt == FMT_Q4_0) mk_avx2_q4_impl(xq, dx, sx, wt, nb, c, FMT_Q4_0, pf);
    else mk_avx2_q4_impl(xq, dx, sx, wt, nb, c, FMT_Q4_1, pf);
}

/* ---------------------------------------------------------------- AVX-512 kernels */

#ifndef DIRECT_512
#define DIRECT_512 36 /* float16 / bfloat16 tiles of up to this many rows: every MR_512-row pass
                       * converts the weights in registers (a Zen 5, SmolLM2's float16 step: 16
                       * rows 12.0 -> 10.0 ms, 24 16.1 -> 13.9, 32 20.3 -> 18.0 against the tile
                       * converted once; 48 and 64 rows the same either way) */
#endif
#define MR_512 12     /* 24 accumulators + 2 weight vectors + 1 broadcast of 32 registers */
#define MR_512_Q8 4

T_512 INLINE __m512 ld16_512(const void *p, const int fmt) {
    if (fmt < 0) return _mm512_loadu_ps((const float *)p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (fmt == FMT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* acc 0: c = x . w over K; acc 1: c += it (a chunk of K after the first) */
T_512 INLINE void mk_512_acc(const float *x, int64_t ldx, const void *wt, int64_t K, float *c,
                             const int MR, const int fmt, const char *pf, const int acc) {
    __m512 a0[MR_512], a1[MR_512];
    const int es = fmt < 0 ? 4 : 2;
    /* bytes of the next tile per k to prefetch: fmt -2 is a packed float32 weight (FMT_F32,
     * the next tile float32 too); -1 a converted tile whose next one is still half */
    const int ps = fmt == -2 ? 4 : 2;
    const char *w = (const char *)wt;
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        a0[i] = acc ? _mm512_loadu_ps(c + i * NR) : _mm512_setzero_ps();
        a1[i] = acc ? _mm512_loadu_ps(c + i * NR + 16) : _mm512_setzero_ps();
    }
    int64_t k = 0;
    if (MR == 1) { /* decode: two k per step, four independent accumulators */
        __m512 b0 = _mm512_setzero_ps(), b1 = b0;
        for (; k + 1 < K; k += 2) {
#pragma GCC unroll 4
            for (int o = 0; o < 2 * ps * NR; o += 64) {
                if (fmt == -2) PF2(pf + k * NR * ps + o);
                else PF(pf + k * NR * ps + o);
            }
            a0[0] = _mm512_fmadd_ps(ld16_512(w + (k * NR) * es, fmt), _mm512_set1_ps(x[k]), a0[0]);
            a1[0] = _mm512_fmadd_ps(ld16_512(w + (k * NR + 16) * es, fmt), _mm512_set1_ps(x[k]), a1[0]);
            b0 = _mm512_fmadd_ps(ld16_512(w + (k * NR + 32) * es, fmt), _mm512_set1_ps(x[k + 1]), b0);
            b1 = _mm512_fmadd_ps(ld16_512(w + (k * NR + 48) * es, fmt), _mm512_set1_ps(x[k + 1]), b1);
        }
        a0[0] = _mm512_add_ps(a0[0], b0);
        a1[0] = _mm512_add_ps(a1[0], b1);
    }
    for (; k < K; k++) {
#pragma GCC unroll 2
        for (int o = 0; o < ps * NR; o += 64) {
            if (fmt == -2) PF2(pf + k * NR * ps + o);
            else PF(pf + k * NR * ps + o);
        }
        __m512 w0 = ld16_512(w + (k * NR) * es, fmt), w1 = ld16_512(w + (k * NR + 16) * es, fmt);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
            a0[i] = _mm512_fmadd_ps(w0, xb, a0[i]);
            a1[i] = _mm512_fmadd_ps(w1, xb, a1[i]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * NR, a0[i]);
        _mm512_storeu_ps(c + i * NR + 16, a1[i]);
    }
}

T_512 INLINE void mk_512_impl(const float *x, int64_t ldx, const void *wt, int64_t K, float *c,
                              const int MR, const int fmt, const char *pf) {
    mk_512_acc(x, ldx, wt, K, c, MR, fmt, pf, 0);
}

#define MR_CASES(CALL)                                                                        \
    switch (mr) {                                                                             \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;                   \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break;                   \
    case 7: CALL(7); break; case 8: CALL(8); break; case 9: CALL(9); break;                   \
    case 10: CALL(10); break; case 11: CALL(11); break; default: CALL(12); break;             \
    }

T_512 static void mk_512_f16(const float *x, int64_t ldx, const void *wt, int64_t K, float *c, int mr,
                              const char *pf) {
#define C(R) mk_512_impl(x, ldx, wt, K, c, R, FMT_F16, pf)
    MR_CASES(C)
#undef C
}

T_512 static void mk_512_bf16(const float *x, int64_t ldx, const void *wt, int64_t K, float *c, int mr,
                              const char *pf) {
#define C(R) mk_512_impl(x, ldx, wt, K, c, R, FMT_BF16, pf)
    MR_CASES(C)
#undef C
}

T_512 static void mk_512_f32(const float *x, int64_t ldx, const void *wt, int64_t K, float *c, int mr,
                              const char *pf) {
#define C(R) mk_512_impl(x, ldx, wt, K, c, R, -1, pf)
    MR_CASES(C)
#undef C
}

/* FMT_F32 weights: as mk_512_f32, prefetching the next float32 tile; acc: onto c */
T_512 static void mk_512_w32(const float *x, int64_t ldx, const void *wt, int64_t K, float *c, int mr,
                             const char *pf, int acc) {
    if (acc) {
#define C(R) mk_512_acc(x, ldx, wt, K, c, R, -2, pf, 1)
        MR_CASES(C)
#undef C
    } else {
#define C(R) mk_512_acc(x, ldx, wt, K, c, R, -2, pf, 0)
        MR_CASES(C)
#undef C
    }
}

T_512 static void tile_to_f32_512(int fmt, const uint16_t *w, int64_t K, float *out) {
    for (int64_t i = 0; i < K * NR; i += 16) {
        _mm512_storeu_ps(out + i, fmt == FMT_F16 ? ld16_512(w + i, FMT_F16) : ld16_512(w + i, FMT_BF16));
    }
}

/* vdpbf16ps: x rows as bfloat16 pairs, weights [K/2][32][2] */
T_512BF INLINE void mk_512_dp_impl(const uint16_t *xb, int64_t ldx, const uint16_t *w,
                                   int64_t kp, float *c, const int MR, const char *pf) {
    __m512 a0[MR_512], a1[MR_512];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    int64_t p = 0, np = kp / 2;
    if (MR == 1) {
        __m512 b0 = _mm512_setzero_ps(), b1 = b0;
        for (; p + 1 < np; p += 2) {
            PF(pf + p * 128);
            PF(pf + p * 128 + 64);
            PF(pf + p * 128 + 128);
            PF(pf + p * 128 + 192);
            __m512bh x0 = (__m512bh)_mm512_set1_epi32(load_i32(xb + 2 * p));
            __m512bh x1 = (__m512bh)_mm512_set1_epi32(load_i32(xb + 2 * p + 2));
            a0[0] = _mm512_dpbf16_ps(a0[0], (__m512bh)_mm512_loadu_si512(w + p * 64), x0);
            a1[0] = _mm512_dpbf16_ps(a1[0], (__m512bh)_mm512_loadu_si512(w + p * 64 + 32), x0);
            b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_loadu_si512(w + p * 64 + 64), x1);
            b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_loadu_si512(w + p * 64 + 96), x1);
        }
        a0[0] = _mm512_add_ps(a0[0], b0);
        a1[0] = _mm512_add_ps(a1[0], b1);
    }
    for (; p < np; p++) {
        PF(pf + p * 128);
        PF(pf + p * 128 + 64);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 64);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 64 + 32);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(load_i32(xb + i * ldx + 2 * p));
            a0[i] = _mm512_dpbf16_ps(a0[i], w0, xv);
            a1[i] = _mm512_dpbf16_ps(a1[i], w1, xv);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * NR, a0[i]);
        _mm512_storeu_ps(c + i * NR + 16, a1[i]);
    }
}

T_512BF static void mk_512_dp(const uint16_t *xb, int64_t ldx, const uint16_t *w, int64_t kp,
                              float *c, int mr, const char *pf) {
#define C(R) mk_512_dp_impl(xb, ldx, w, kp, c, R, pf)
    MR_CASES(C)
#undef C
}

/* Q8_0 with vpdpbusd: activations uint8 (q + 128), weights int8; the 128 * sum(w) the offset
 * adds is computed per block with the same instruction and subtracted. */
T_512VNNI INLINE void mk_512_q8_impl(const uint8_t *xq, int64_t ldx, const float *dx,
                                     int64_t lddx, const uint8_t *wt, int64_t nb, float *c,
                                     const int MR, const char *pf) {
    __m512 a0[MR_512_Q8], a1[MR_512_Q8];
    const __m512i off = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * Q8_TILE_BLOCK;
        __m512i d0[MR_512_Q8], d1[MR_512_Q8], c0 = _mm512_setzero_si512(), c1 = c0;
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) d0[i] = d1[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            PF(pf + b * Q8_TILE_BLOCK + g * 128);
            PF(pf + b * Q8_TILE_BLOCK + g * 128 + 64);
            __m512i w0 = _mm512_loadu_si512(blk + g * NR * 4);
            __m512i w1 = _mm512_loadu_si512(blk + g * NR * 4 + 64);
            c0 = _mm512_dpbusd_epi32(c0, off, w0);
            c1 = _mm512_dpbusd_epi32(c1, off, w1);
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                __m512i xv = _mm512_set1_epi32(load_i32(xq + i * ldx + b * QK + g * 4));
                d0[i] = _mm512_dpbusd_epi32(d0[i], xv, w0);
                d1[i] = _mm512_dpbusd_epi32(d1[i], xv, w1);
            }
        }
        PF(pf + b * Q8_TILE_BLOCK + 1024);
        __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 8 * NR * 4)));
        __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 8 * NR * 4 + 32)));
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            __m512 dxv = _mm512_set1_ps(dx[i * lddx + b]);
            a0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d0[i], c0)),
                                    _mm512_mul_ps(s0, dxv), a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d1[i], c1)),
                                    _mm512_mul_ps(s1, dxv), a1[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * NR, a0[i]);
        _mm512_storeu_ps(c + i * NR + 16, a1[i]);
    }
}

T_512VNNI static void mk_512_q8(const uint8_t *xq, int64_t ldx, const float *dx, int64_t lddx,
                                const uint8_t *wt, int64_t nb, float *c, int mr, const char *pf) {
    switch (mr) {
    case 1: mk_512_q8_impl(xq, ldx, dx, lddx, wt, nb, c, 1, pf); break;
    case 2: mk_512_q8_impl(xq, ldx, dx, lddx, wt, nb, c, 2, pf); break;
    case 3: mk_512_q8_impl(xq, ldx, dx, lddx, wt, nb, c, 3, pf); break;
    default: mk_512_q8_impl(xq, ldx, dx, lddx, wt, nb, c, 4, pf); break;
    }
}

/* Q4_0 / Q4_1 with vpdpbusd: the nibbles are the unsigned operand (0..15), the activations
 * the signed one (int8, no offset). Per block, word p of the nibbles (two zmm: rows 0..15 and
 * 16..31) gives weights 4p.. (low nibbles, with activation word p) and 16+4p.. (high, with
 * word p + 4). One row (decode) keeps low and high in separate accumulators for more chains,
 * and takes the high nibbles in place (16 x their value, one vpandnd instead of a shift and an
 * and: 16 * 15 * 127 * 32 fits int32 easily), shifting the block's dot back by 4 bits. */
#define MR_512_Q4 6

/* acc += u8 w . s8 x[0..3] broadcast to every lane: the broadcast as vpdpbusd's {1to16}
 * memory operand (GCC does not fold _mm512_set1_epi32 of a load into it) */
T_512VNNI INLINE __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

T_512VNNI INLINE void mk_512_q4_impl(const int8_t *xq, int64_t ldx, const float *dx,
                                     const int32_t *sx, int64_t lddx, const uint8_t *wt,
                                     int64_t nb, float *c, const int MR, const int fmt,
                                     const char *pf) {
    const int64_t tb = fmt == FMT_Q4_0 ? Q4_0_TILE_BLOCK : Q4_1_TILE_BLOCK;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512 a0[MR_512_Q4], a1[MR_512_Q4];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * tb;
        __m512i l0[MR_512_Q4], l1[MR_512_Q4], h0 = _mm512_setzero_si512(), h1 = h0;
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) l0[i] = l1[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            PF(pf + b * tb + p * 128);
            PF(pf + b * tb + p * 128 + 64);
            __m512i v0 = _mm512_loadu_si512(blk + p * NR * 4);
            __m512i v1 = _mm512_loadu_si512(blk + p * NR * 4 + 64);
            __m512i w0l = _mm512_and_si512(v0, lo4), w1l = _mm512_and_si512(v1, lo4), w0h, w1h;
            if (MR == 1) { /* 16 x the high nibbles, one instruction: divided out per block */
                w0h = _mm512_andnot_si512(lo4, v0);
                w1h = _mm512_andnot_si512(lo4, v1);
            } else {
                w0h = _mm512_and_si512(_mm512_srli_epi16(v0, 4), lo4);
                w1h = _mm512_and_si512(_mm512_srli_epi16(v1, 4), lo4);
            }
#pragma GCC unroll 6
            for (int i = 0; i < MR; i++) {
                const int8_t *xl = xq + i * ldx + b * QK + p * 4, *xh = xl + 16;
                l0[i] = dpbusd_bcst(l0[i], w0l, xl);
                l1[i] = dpbusd_bcst(l1[i], w1l, xl);
                if (MR == 1) {
                    h0 = dpbusd_bcst(h0, w0h, xh);
                    h1 = dpbusd_bcst(h1, w1h, xh);
                } else {
                    l0[i] = dpbusd_bcst(l0[i], w0h, xh);
                    l1[i] = dpbusd_bcst(l1[i], w1h, xh);
                }
            }
        }
        PF(pf + b * tb + Q4_NIBBLES);
        if (fmt == FMT_Q4_1) PF(pf + b * tb + Q4_NIBBLES + 64);
        if (MR == 1) { /* h = 16 x the high nibbles' dot: exact, a multiple of 16 */
            l0[0] = _mm512_add_epi32(l0[0], _mm512_srai_epi32(h0, 4));
            l1[0] = _mm512_add_epi32(l1[0], _mm512_srai_epi32(h1, 4));
        }
        __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q4_NIBBLES)));
        __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q4_NIBBLES + 32)));
        __m512 m0 = s0, m1 = s1;
        if (fmt == FMT_Q4_1) {
            m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q4_NIBBLES + 64)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q4_NIBBLES + 96)));
        }
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            float d = dx[i * lddx + b];
            int32_t s = sx[i * lddx + b];
            if (fmt == FMT_Q4_0) {
                __m512i off = _mm512_set1_epi32(8 * s);
                l0[i] = _mm512_sub_epi32(l0[i], off);
                l1[i] = _mm512_sub_epi32(l1[i], off);
            }
            __m512 dxv = _mm512_set1_ps(d);
            a0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l0[i]), _mm512_mul_ps(s0, dxv), a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l1[i]), _mm512_mul_ps(s1, dxv), a1[i]);
            if (fmt == FMT_Q4_1) {
                __m512 ms = _mm512_set1_ps(d * (float)s);
                a0[i] = _mm512_fmadd_ps(m0, ms, a0[i]);
                a1[i] = _mm512_fmadd_ps(m1, ms, a1[i]);
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * NR, a0[i]);
        _mm512_storeu_ps(c + i * NR + 16, a1[i]);
    }
}

#define Q4_512_CASES(FMT)                                                                     \
    switch (mr) {                                                                             \
    case 1: mk_512_q4_impl(xq, ldx, dx, sx, lddx, wt, nb, c, 1, FMT, pf); break;              \
    case 2: mk_512_q4_impl(xq, ldx, dx, sx, lddx, wt, nb, c, 2, FMT, pf); break;              \
    case 3: mk_512_q4_impl(xq, ldx, dx, sx, lddx, wt, nb, c, 3, FMT, pf); break;              \
    case 4: mk_512_q4_impl(xq, ldx, dx, sx, lddx, wt, nb, c, 4, FMT, pf); break;              \
    case 5: mk_512_q4_impl(xq, ldx, dx, sx, lddx, wt, nb, c, 5, FMT, pf); break;              \
    default: mk_512_q4_impl(xq, ldx, dx, sx, lddx, wt, nb, c, 6, FMT, pf); break;             \
    }

T_512VNNI static void mk_512_q4(int fmt, const int8_t *xq, int64_t ldx, const float *dx,
                                const int32_t *sx, int64_t lddx, const uint8_t *wt, int64_t nb,
                                float *c, int mr, const char *pf) {
    if (fmt == FMT_Q4_0) Q4_512_CASES(FMT_Q4_0)
    else Q4_512_CASES(FMT_Q4_1)
}
#undef Q4_512_CASES

/* ---------------------------------------------------------------- weight-only block kernels */

/* FMT_Q8_0_F32 / Q4_0_F32 / Q4_1_F32: float32 activations, the packed blocks dequantized in
 * registers. The fused kernels (few rows) widen each block's weights to float (Q4_0: q - 8,
 * Q4_1: q, Q8_0: q; exact small integers), FMA them against the activations into a per-block
 * sum per output row, then add d * sum (and for Q4_1 m * the block's activation sum, computed
 * once per call): sum_k (d q_k + m) x_k = d sum_k q_k x_k + m sum_k x_k, float32 throughout.
 * More rows: the tile is dequantized to float32 [K][32] scratch once (d * (q - 8), d * q + m
 * with one FMA, d * q) and the float32 micro-kernels run over the rows. */

/* One tile's weights as float32 [K][32] (fmt the base block format), the values ek_unpack
 * gives. Scalar (the reference path). */
static void wo_tile_scalar(int fmt, const uint8_t *wt, int64_t nb, float *out) {
    const int64_t tb = fmt == FMT_Q8_0 ? Q8_TILE_BLOCK : q4_tile_block(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * tb;
        for (int j = 0; j < NR; j++) {
            float d, m = 0.0f;
            if (fmt == FMT_Q8_0) {
                d = f16_at(blk + 8 * NR * 4 + j * 2);
            } else {
                d = f16_at(blk + Q4_NIBBLES + j * 2);
                if (fmt == FMT_Q4_1) m = f16_at(blk + Q4_NIBBLES + NR * 2 + j * 2);
            }
            for (int k = 0; k < QK; k++) {
                float v;
                if (fmt == FMT_Q8_0) v = d * (float)(int8_t)blk[((k / 4) * NR + j) * 4 + k % 4];
                else if (fmt == FMT_Q4_0) v = d * (float)(q4_nibble(blk, j, k) - 8);
                else v = d * (float)q4_nibble(blk, j, k) + m;
                out[(b * QK + k) * NR + j] = v;
            }
        }
    }
}

/* c[mr][32] = x[mr][K] . tile[K][32] in k order (the scalar path) */
static void mk_scalar_f32(const float *x, int64_t ldx, const float *tile, int64_t K, float *c,
                          int mr) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += x[i * ldx + k] * tile[k * NR + j];
            c[i * NR + j] = acc;
        }
}

/* AVX2: the weights of 8 output rows (one ymm: 8 dwords of 4 bytes) at nibble offset sh
 * (0, 4, ..., 28) as float: Q4_0 from bytes XORed with 0x88 (each nibble q ^ 8, read as a
 * signed nibble, is q - 8), Q4_1 unsigned */
T_AVX2 INLINE __m256 nib_avx2(__m256i v, const int sh, const int fmt) {
    if (fmt == FMT_Q4_0) {
        __m256i t = sh == 28 ? v : _mm256_slli_epi32(v, 28 - sh);
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(t, 28));
    }
    __m256i t = sh ? _mm256_srli_epi32(v, sh) : v;
    if (sh != 28) t = _mm256_and_si256(t, _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(t);
}

/* vpshufb indices moving byte e of each dword to its top byte, zeroing the others */
#define TOP_BYTE_IDX(e, k) ((int)(0x808080u | (uint32_t)((e) + 4 * (k)) << 24))

/* byte e of each dword in its top byte, the rest zero (one vpshufb): as float, q * 2^24
 * exactly (the fused Q8_0 kernels scale d by 2^-24, also exact) */
T_AVX2 INLINE __m256 i8hi_avx2(__m256i v, const int e) {
    const __m256i idx = _mm256_set_epi32(
        TOP_BYTE_IDX(e, 3), TOP_BYTE_IDX(e, 2), TOP_BYTE_IDX(e, 1), TOP_BYTE_IDX(e, 0),
        TOP_BYTE_IDX(e, 3), TOP_BYTE_IDX(e, 2), TOP_BYTE_IDX(e, 1), TOP_BYTE_IDX(e, 0));
    __m256i t = e == 3 ? _mm256_and_si256(v, _mm256_set1_epi32((int)0xFF000000u))
                       : _mm256_shuffle_epi8(v, idx);
    return _mm256_cvtepi32_ps(t);
}

/* byte e (0..3) of each dword, sign-extended, as float (Q8_0) */
T_AVX2 INLINE __m256 i8_avx2(__m256i v, const int e) {
    __m256i t = e == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * e);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(t, 24));
}

/* One row, fused (16 ymm registers: 4 weight words, 4 block sums, 4 accumulators, the
 * broadcast and temporaries). xs: the row's activation sum per block (Q4_1). */
T_AVX2 INLINE void mk_avx2_wo_impl(const float *x, const float *xs, const uint8_t *wt,
                                   int64_t nb, float *c, const int fmt, const char *pf) {
    const int64_t tb = fmt == FMT_Q8_0 ? Q8_TILE_BLOCK
                       : fmt == FMT_Q4_0 ? Q4_0_TILE_BLOCK : Q4_1_TILE_BLOCK;
    const int soff = fmt == FMT_Q8_0 ? 8 * NR * 4 : Q4_NIBBLES; /* the block's d */
    __m256 a[4];
#pragma GCC unroll 4
    for (int o = 0; o < 4; o++) a[o] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * tb;
        const float *xb = x + b * QK;
        __m256 s[4];
#pragma GCC unroll 4
        for (int o = 0; o < 4; o++) s[o] = _mm256_setzero_ps();
        if (fmt == FMT_Q8_0) {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                PF(pf + b * tb + g * 128);
                PF(pf + b * tb + g * 128 + 64);
                __m256i v[4];
#pragma GCC unroll 4
                for (int o = 0; o < 4; o++)
                    v[o] = _mm256_loadu_si256((const __m256i *)(blk + g * NR * 4 + o * 32));
#pragma GCC unroll 4
                for (int e = 0; e < 4; e++) {
                    __m256 xv = _mm256_broadcast_ss(xb + g * 4 + e);
#pragma GCC unroll 4
                    for (int o = 0; o < 4; o++) s[o] = _mm256_fmadd_ps(i8hi_avx2(v[o], e), xv, s[o]);
                }
            }
        } else {
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                PF(pf + b * tb + p * 128);
                PF(pf + b * tb + p * 128 + 64);
                __m256i v[4];
#pragma GCC unroll 4
                for (int o = 0; o < 4; o++) {
                    v[o] = _mm256_loadu_si256((const __m256i *)(blk + p * NR * 4 + o * 32));
                    if (fmt == FMT_Q4_0) v[o] = _mm256_xor_si256(v[o], _mm256_set1_epi8((char)0x88));
                }
#pragma GCC unroll 8
                for (int n = 0; n < 8; n++) { /* nibble n: byte n / 2, high half when odd */
                    const int e = n / 2, h = n % 2;
                    __m256 xv = _mm256_broadcast_ss(xb + h * 16 + p * 4 + e);
#pragma GCC unroll 4
                    for (int o = 0; o < 4; o++)
                        s[o] = _mm256_fmadd_ps(nib_avx2(v[o], 8 * e + 4 * h, fmt), xv, s[o]);
                }
            }
        }
        PF(pf + b * tb + soff);
        if (fmt == FMT_Q4_1) PF(pf + b * tb + soff + 64);
#pragma GCC unroll 4
        for (int o = 0; o < 4; o++) {
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + soff + o * 16)));
            if (fmt == FMT_Q8_0) d = _mm256_mul_ps(d, _mm256_set1_ps(0x1p-24f)); /* q * 2^24 */
            a[o] = _mm256_fmadd_ps(d, s[o], a[o]);
            if (fmt == FMT_Q4_1) {
                __m256 m = _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)(blk + soff + NR * 2 + o * 16)));
                a[o] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[b]), a[o]);
            }
        }
    }
#pragma GCC unroll 4
    for (int o = 0; o < 4; o++) _mm256_storeu_ps(c + o * 8, a[o]);
}

T_AVX2 static void mk_avx2_wo(int fmt, const float *x, const float *xs, const uint8_t *wt,
                              int64_t nb, float *c, const char *pf) {
    if (fmt == FMT_Q8_0) mk_avx2_wo_impl(x, xs, wt, nb, c, FMT_Q8_0, pf);
    else if (fmt == FMT_Q4_0) mk_avx2_wo_impl(x, xs, wt, nb, c, FMT_Q4_0, pf);
    else mk_avx2_wo_impl(x, xs, wt, nb, c, FMT_Q4_1, pf);
}

/* the tile dequantized to float32 [K][32] */
T_AVX2 static void wo_tile_avx2(int fmt, const uint8_t *wt, int64_t nb, float *out) {
    const int64_t tb = fmt == FMT_Q8_0 ? Q8_TILE_BLOCK : q4_tile_block(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * tb;
        float *ob = out + b * QK * NR;
        for (int o = 0; o < 4; o++) {
            if (fmt == FMT_Q8_0) {
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 8 * NR * 4 + o * 16)));
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + g * NR * 4 + o * 32));
#pragma GCC unroll 4
                    for (int e = 0; e < 4; e++)
                        _mm256_storeu_ps(ob + (g * 4 + e) * NR + o * 8, _mm256_mul_ps(d, i8_avx2(v, e)));
                }
                continue;
            }
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + Q4_NIBBLES + o * 16)));
            __m256 m = fmt == FMT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                             (const __m128i *)(blk + Q4_NIBBLES + NR * 2 + o * 16)))
                                       : _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + p * NR * 4 + o * 32));
                if (fmt == FMT_Q4_0) {
                    v = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x88));
#pragma GCC unroll 8
                    for (int n = 0; n < 8; n++)
                        _mm256_storeu_ps(ob + ((n % 2) * 16 + p * 4 + n / 2) * NR + o * 8,
                                         _mm256_mul_ps(d, nib_avx2(v, 4 * n, FMT_Q4_0)));
                } else {
#pragma GCC unroll 8
                    for (int n = 0; n < 8; n++)
                        _mm256_storeu_ps(ob + ((n % 2) * 16 + p * 4 + n / 2) * NR + o * 8,
                                         _mm256_fmadd_ps(d, nib_avx2(v, 4 * n, FMT_Q4_1), m));
                }
            }
        }
    }
}

/* AVX-512: nibble offset sh of each dword of v as float through a 16-entry table (vpermps
 * reads the low 4 bits of each index: no mask needed): Q4_0 -8..7, Q4_1 0..15 */
T_512 INLINE __m512 nib_512(__m512i v, const int sh, __m512 tab) {
    return _mm512_permutexvar_ps(sh ? _mm512_srli_epi32(v, sh) : v, tab);
}

T_512 INLINE __m512 i8_512(__m512i v, const int e) {
    __m512i t = e == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * e);
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(t, 24));
}

/* byte e of each dword in its top byte, the rest zero (one vpshufb): as float, q * 2^24
 * exactly (the fused Q8_0 kernels scale d by 2^-24, also exact) */
T_512 INLINE __m512 i8hi_512(__m512i v, const int e) {
    const __m512i idx = _mm512_set_epi32(
        TOP_BYTE_IDX(e, 3), TOP_BYTE_IDX(e, 2), TOP_BYTE_IDX(e, 1), TOP_BYTE_IDX(e, 0),
        TOP_BYTE_IDX(e, 3), TOP_BYTE_IDX(e, 2), TOP_BYTE_IDX(e, 1), TOP_BYTE_IDX(e, 0),
        TOP_BYTE_IDX(e, 3), TOP_BYTE_IDX(e, 2), TOP_BYTE_IDX(e, 1), TOP_BYTE_IDX(e, 0),
        TOP_BYTE_IDX(e, 3), TOP_BYTE_IDX(e, 2), TOP_BYTE_IDX(e, 1), TOP_BYTE_IDX(e, 0));
    __m512i t = e == 3 ? _mm512_and_si512(v, _mm512_set1_epi32((int)0xFF000000u))
                       : _mm512_shuffle_epi8(v, idx);
    return _mm512_cvtepi32_ps(t);
}

T_512 INLINE __m512 q4_table(const int fmt) {
    return fmt == FMT_Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                           : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

#define MR_512_WO 4 /* rows per fused micro-kernel */

/* MR rows fused: each weight vector (16 output rows, one k) widened once and FMA'd into every
 * row's block sum. One row keeps two chains per half (odd and even k) for the FMA latency.
 * xs: activation sums per block, row stride nb (Q4_1). */
T_512 INLINE void mk_512_wo_impl(const float *x, int64_t ldx, const float *xs,
                                 const uint8_t *wt, int64_t nb, float *c, const int MR,
                                 const int fmt, const char *pf) {
    const int64_t tb = fmt == FMT_Q8_0 ? Q8_TILE_BLOCK
                       : fmt == FMT_Q4_0 ? Q4_0_TILE_BLOCK : Q4_1_TILE_BLOCK;
    const int soff = fmt == FMT_Q8_0 ? 8 * NR * 4 : Q4_NIBBLES;
    const __m512 tab = q4_table(fmt == FMT_Q4_0 ? FMT_Q4_0 : FMT_Q4_1);
    __m512 a0[MR_512_WO], a1[MR_512_WO];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * tb;
        const float *xb = x + b * QK;
        __m512 s0[MR_512_WO], s1[MR_512_WO], t0 = _mm512_setzero_ps(), t1 = t0;
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) s0[i] = s1[i] = _mm512_setzero_ps();
#define WO_FMA(W0, W1, KK, ODD)                                                               \
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++) {                                    \
        __m512 xv = _mm512_set1_ps(xb[i * ldx + (KK)]);                                       \
        if (MR == 1 && (ODD)) {                                                               \
            t0 = _mm512_fmadd_ps(W0, xv, t0);                                                 \
            t1 = _mm512_fmadd_ps(W1, xv, t1);                                                 \
        } else {                                                                              \
            s0[i] = _mm512_fmadd_ps(W0, xv, s0[i]);                                           \
            s1[i] = _mm512_fmadd_ps(W1, xv, s1[i]);                                           \
        }                                                                                     \
    }
        if (fmt == FMT_Q8_0) {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                PF(pf + b * tb + g * 128);
                PF(pf + b * tb + g * 128 + 64);
                __m512i v0 = _mm512_loadu_si512(blk + g * NR * 4);
                __m512i v1 = _mm512_loadu_si512(blk + g * NR * 4 + 64);
#pragma GCC unroll 4
                for (int e = 0; e < 4; e++) {
                    __m512 w0 = i8hi_512(v0, e), w1 = i8hi_512(v1, e);
                    WO_FMA(w0, w1, g * 4 + e, e & 1)
                }
            }
        } else {
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                PF(pf + b * tb + p * 128);
                PF(pf + b * tb + p * 128 + 64);
                __m512i v0 = _mm512_loadu_si512(blk + p * NR * 4);
                __m512i v1 = _mm512_loadu_si512(blk + p * NR * 4 + 64);
#pragma GCC unroll 8
                for (int n = 0; n < 8; n++) {
                    const int e = n / 2, h = n % 2;
                    __m512 w0 = nib_512(v0, 8 * e + 4 * h, tab), w1 = nib_512(v1, 8 * e + 4 * h, tab);
                    WO_FMA(w0, w1, h * 16 + p * 4 + e, h)
                }
            }
        }
#undef WO_FMA
        PF(pf + b * tb + soff);
        if (fmt == FMT_Q4_1) PF(pf + b * tb + soff + 64);
        if (MR == 1) {
            s0[0] = _mm512_add_ps(s0[0], t0);
            s1[0] = _mm512_add_ps(s1[0], t1);
        }
        __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + soff)));
        __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + soff + 32)));
        if (fmt == FMT_Q8_0) { /* the weights came as q * 2^24 */
            d0 = _mm512_mul_ps(d0, _mm512_set1_ps(0x1p-24f));
            d1 = _mm512_mul_ps(d1, _mm512_set1_ps(0x1p-24f));
        }
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            a0[i] = _mm512_fmadd_ps(d0, s0[i], a0[i]);
            a1[i] = _mm512_fmadd_ps(d1, s1[i], a1[i]);
        }
        if (fmt == FMT_Q4_1) {
            __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + soff + 64)));
            __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + soff + 96)));
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                __m512 xsv = _mm512_set1_ps(xs[i * nb + b]);
                a0[i] = _mm512_fmadd_ps(m0, xsv, a0[i]);
                a1[i] = _mm512_fmadd_ps(m1, xsv, a1[i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(c + i * NR, a0[i]);
        _mm512_storeu_ps(c + i * NR + 16, a1[i]);
    }
}

#define WO_512_CASES(FMT)                                                                     \
    switch (mr) {                                                                             \
    case 1: mk_512_wo_impl(x, ldx, xs, wt, nb, c, 1, FMT, pf); break;                         \
    case 2: mk_512_wo_impl(x, ldx, xs, wt, nb, c, 2, FMT, pf); break;                         \
    case 3: mk_512_wo_impl(x, ldx, xs, wt, nb, c, 3, FMT, pf); break;                         \
    default: mk_512_wo_impl(x, ldx, xs, wt, nb, c, 4, FMT, pf); break;                        \
    }

T_512 static void mk_512_wo(int fmt, const float *x, int64_t ldx, const float *xs,
                            const uint8_t *wt, int64_t nb, float *c, int mr, const char *pf) {
    if (fmt == FMT_Q8_0) WO_512_CASES(FMT_Q8_0)
    else if (fmt == FMT_Q4_0) WO_512_CASES(FMT_Q4_0)
    else WO_512_CASES(FMT_Q4_1)
}
#undef WO_512_CASES

T_512 static void wo_tile_512(int fmt, const uint8_t *wt, int64_t nb, float *out) {
    const int64_t tb = fmt == FMT_Q8_0 ? Q8_TILE_BLOCK : q4_tile_block(fmt);
    const __m512 tab = q4_table(fmt == FMT_Q4_0 ? FMT_Q4_0 : FMT_Q4_1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * tb;
        float *ob = out + b * QK * NR;
        for (int half = 0; half < 2; half++) {
            if (fmt == FMT_Q8_0) {
                __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 8 * NR * 4 + half * 32)));
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++) {
                    __m512i v = _mm512_loadu_si512(blk + g * NR * 4 + half * 64);
#pragma GCC unroll 4
                    for (int e = 0; e < 4; e++)
                        _mm512_storeu_ps(ob + (g * 4 + e) * NR + half * 16, _mm512_mul_ps(d, i8_512(v, e)));
                }
                continue;
            }
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + Q4_NIBBLES + half * 32)));
            __m512 m = fmt == FMT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                             (const __m256i *)(blk + Q4_NIBBLES + 64 + half * 32)))
                                       : _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512(blk + p * NR * 4 + half * 64);
#pragma GCC unroll 8
                for (int n = 0; n < 8; n++) {
                    __m512 q = nib_512(v, 4 * n, tab);
                    _mm512_storeu_ps(ob + ((n % 2) * 16 + p * 4 + n / 2) * NR + half * 16,
                                     fmt == FMT_Q4_1 ? _mm512_fmadd_ps(d, q, m) : _mm512_mul_ps(d, q));
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- driver */

static void epilogue(const float *c, int64_t rows, int64_t n0, int64_t N, const float *bias,
                     void *y, int ydt, int64_t ldy) {
    int64_t cols = N - n0 < NR ? N - n0 : NR;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            float v = c[i * NR + j] + (bias ? bias[n0 + j] : 0.0f);
            if (ydt == DT_F32) ((float *)y)[i * ldy + n0 + j] = v;
            else ((uint16_t *)y)[i * ldy + n0 + j] = f32_to_bf16(v);
        }
}

typedef struct {
    int fmt, isa;
    const void *xa;  /* activations as the kernel reads them */
    int64_t ldx;
    const float *dx; /* Q8_0 / Q4 activation scales [M, K / 32]; weight-only Q4_1: the
                      * activations' sums per block [M, K / 32] */
    const int32_t *sx; /* Q4 activation block sums [M, K / 32] */
    const void *w;
    int64_t M, N, K;
    const float *bias;
    void *y;
    int ydt;
    int64_t ldy;
} job_t;

static int64_t tile_bytes(int fmt, int64_t K) {
    fmt = base_fmt(fmt);
    if (fmt == FMT_F32) return K * NR * 4;
    if (fmt == FMT_Q8_0) return K / QK * Q8_TILE_BLOCK;
    if (is_q4(fmt)) return K / QK * q4_tile_block(fmt);
    return (fmt == FMT_BF16_PAIRS ? (K + 1) / 2 * 2 : K) * NR * 2;
}

/* Weight-only block formats: up to WO_FUSED_* rows (per chunk of 64) run the fused kernels
 * (the weights widened in registers once per 4 rows on AVX-512, per row on AVX2), more
 * dequantize the tile to float32 once and run the float32 micro-kernels (12 / 3 rows per
 * pass). Crossover measured on SmolLM2's Q4_1 shapes (Zen 4, 2 threads): AVX-512 fused ahead
 * up to 6-7 rows, AVX2 up to 2. */
#define WO_FUSED_512 6
#define WO_FUSED_AVX2 2

static int run_tile_wo(const job_t *j, const char *wt, const char *next, int64_t m0,
                       int64_t rows, float *c) {
    const int fmt = base_fmt(j->fmt), isa = j->isa;
    const int64_t K = j->K, nb = K / QK;
    const float *x = (const float *)j->xa + m0 * j->ldx;
    const float *xs = j->dx ? j->dx + m0 * nb : NULL;
    const uint8_t *w = (const uint8_t *)wt;
    if (isa != ISA_SCALAR && rows <= (isa == ISA_AVX512 ? WO_FUSED_512 : WO_FUSED_AVX2)) {
        int mrmax = isa == ISA_AVX512 ? MR_512_WO : 1;
        for (int64_t i = 0; i < rows;) {
            int mr = rows - i < mrmax ? (int)(rows - i) : mrmax;
            const char *pf = i == 0 && rows > 1 ? next : NULL;
            if (isa == ISA_AVX512)
                mk_512_wo(fmt, x + i * j->ldx, j->ldx, xs ? xs + i * nb : NULL, w, nb,
                          c + i * NR, mr, pf);
            else
                mk_avx2_wo(fmt, x + i * j->ldx, xs ? xs + i * nb : NULL, w, nb, c + i * NR, pf);
            i += mr;
        }
        return EK_OK;
    }
    if (isa == ISA_AVX2) { /* a block (32 k) at a time; the next tile's block prefetched */
        const int64_t tb = fmt == FMT_Q8_0 ? Q8_TILE_BLOCK : q4_tile_block(fmt);
        const char *pf = next;
        float *chunk = scratch(&tl_tile, (size_t)(QK * NR) * 4);
        if (!chunk) return EK_NO_MEMORY;
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t o = 0; o < tb; o += 64) PF(pf + b * tb + o);
            wo_tile_avx2(fmt, w + b * tb, 1, chunk);
            avx2_chunk_passes(x, j->ldx, chunk, b * QK, QK, c, rows);
        }
        return EK_OK;
    }
    float *tile = scratch(&tl_tile, (size_t)(K * NR) * 4);
    if (!tile) return EK_NO_MEMORY;
    if (isa == ISA_SCALAR) {
        wo_tile_scalar(fmt, w, nb, tile);
        mk_scalar_f32(x, j->ldx, tile, K, c, (int)rows);
        return EK_OK;
    }
    wo_tile_512(fmt, w, nb, tile); /* AVX-512: the whole tile, then 12-row passes */
    for (int64_t i = 0; i < rows;) {
        int mr = rows - i < MR_512 ? (int)(rows - i) : MR_512;
        mk_512_f32(x + i * j->ldx, j->ldx, tile, K, c + i * NR, mr, i == 0 ? next : NULL);
        i += mr;
    }
    return EK_OK;
}

#define AVX2_F32_KC 16 /* k per pass of the AVX2 float32 micro-kernels over an FMT_F32 tile (2 KiB, L1: the
                        * Qwen3-MoE expert GEMMs at 256 tokens 8-16 best, 64 1.4x slower) */
#ifndef MR_512_F32
#define MR_512_F32 8 /* rows per AVX-512 pass over an FMT_F32 tile (in cache: 8 rows 200 GFLOP/s,
                      * 12 rows 170, on 2 Zen 4 cores) */
#endif
#ifndef AVX512_F32_KC
#define AVX512_F32_KC 128 /* k per chunk of an FMT_F32 tile for more than MR_512_F32 rows (16 KiB) */
#endif

/* FMT_F32: the tile's own float32 weights through the float32 micro-kernels */
static int run_tile_f32(const job_t *j, const char *wt, const char *next, int64_t m0,
                        int64_t rows, float *c) {
    const int64_t K = j->K;
    const float *x = (const float *)j->xa + m0 * j->ldx, *w = (const float *)wt;
    if (j->isa == ISA_SCALAR) {
        mk_scalar_f32(x, j->ldx, w, K, c, (int)rows);
    } else if (j->isa == ISA_AVX2) { /* AVX2_F32_KC k at a time (in L1 for every pass) */
        const char *pf = next;
        for (int64_t k0 = 0; k0 < K; k0 += AVX2_F32_KC) {
            int64_t kc = K - k0 < AVX2_F32_KC ? K - k0 : AVX2_F32_KC;
            for (int64_t o = 0; o < kc * NR * 4; o += 64) PF2(pf + k0 * NR * 4 + o);
            avx2_chunk_passes(x, j->ldx, w + k0 * NR, k0, kc, c, rows);
        }
    } else if (rows <= MR_512_F32) { /* one pass streams the tile */
        mk_512_w32(x, j->ldx, w, K, c, (int)rows, next, 0);
    } else { /* AVX512_F32_KC k at a time, every pass over it while in L1, the next tile's
              * same k prefetched by the first pass */
        for (int64_t k0 = 0; k0 < K; k0 += AVX512_F32_KC) {
            int64_t kc = K - k0 < AVX512_F32_KC ? K - k0 : AVX512_F32_KC;
            for (int64_t i = 0; i < rows;) {
                int mr = rows - i < MR_512_F32 ? (int)(rows - i) : MR_512_F32;
                mk_512_w32(x + i * j->ldx + k0, j->ldx, w + k0 * NR, kc, c + i * NR, mr,
                           i == 0 && next ? next + k0 * NR * 4 : NULL, k0 > 0);
                i += mr;
            }
        }
    }
    return EK_OK;
}

/* rows [m0, m0 + rows) of the tile at wt; the first micro-kernel pass prefetches `next` (the
 * tile to run next, or NULL) */
static int run_tile_at(const job_t *j, const char *wt, const char *next, int64_t m0,
                       int64_t rows, float *c) {
    const int fmt = j->fmt, isa = j->isa;
    const int64_t K = j->K, nb = K / QK, kp = (K + 1) / 2 * 2;

    if (fmt == FMT_F32) return run_tile_f32(j, wt, next, m0, rows, c);
    if (is_wo(fmt)) return run_tile_wo(j, wt, next, m0, rows, c);
    if (is_q4(fmt)) {
        const int8_t *xq = (const int8_t *)j->xa + m0 * j->ldx;
        const float *dx = j->dx + m0 * nb;
        const int32_t *sx = j->sx + m0 * nb;
        if (isa == ISA_SCALAR) {
            mk_scalar_q4(fmt, xq, j->ldx, dx, sx, (const uint8_t *)wt, nb, c, (int)rows);
            return EK_OK;
        }
        int mrmax = isa == ISA_AVX512 ? MR_512_Q4 : 1;
        for (int64_t i = 0; i < rows;) {
            int mr = rows - i < mrmax ? (int)(rows - i) : mrmax;
            const char *pf = i == 0 && rows > 1 ? next : NULL;
            if (isa == ISA_AVX512)
                mk_512_q4(fmt, xq + i * j->ldx, j->ldx, dx + i * nb, sx + i * nb, nb,
                          (const uint8_t *)wt, nb, c + i * NR, mr, pf);
            else
                mk_avx2_q4(fmt, xq + i * j->ldx, dx + i * nb, sx + i * nb, (const uint8_t *)wt,
                           nb, c + i * NR, pf);
            i += mr;
        }
        return EK_OK;
    }
    if (isa == ISA_SCALAR) {
        const float *dx = fmt == FMT_Q8_0 ? j->dx + m0 * nb : NULL;
        int64_t es = fmt == FMT_Q8_0 ? 1 : fmt == FMT_BF16_PAIRS ? 2 : 4;
        mk_scalar(fmt, (const char *)j->xa + m0 * j->ldx * es, j->ldx, dx, wt, K, c, (int)rows);
        return EK_OK;
    }
    if (fmt == FMT_Q8_0) {
        for (int64_t i = 0; i < rows;) {
            const char *pf = i == 0 && rows > 1 ? next : NULL;
            if (isa == ISA_AVX512) {
                int mr = rows - i < MR_512_Q8 ? (int)(rows - i) : MR_512_Q8;
                mk_512_q8((const uint8_t *)j->xa + (m0 + i) * j->ldx, j->ldx, j->dx + (m0 + i) * nb,
                          nb, (const uint8_t *)wt, nb, c + i * NR, mr, pf);
                i += mr;
            } else {
                mk_avx2_q8((const int8_t *)j->xa + (m0 + i) * j->ldx, j->dx + (m0 + i) * nb,
                           (const uint8_t *)wt, nb, c + i * NR, pf);
                i += 1;
            }
        }
        return EK_OK;
    }
    if (fmt == FMT_BF16_PAIRS) {
        for (int64_t i = 0; i < rows;) {
            int mr = rows - i < MR_512 ? (int)(rows - i) : MR_512;
            mk_512_dp((const uint16_t *)j->xa + (m0 + i) * j->ldx, j->ldx, (const uint16_t *)wt,
                      kp, c + i * NR, mr, i == 0 ? next : NULL);
            i += mr;
        }
        return EK_OK;
    }
    /* float16 / bfloat16 k-major: each micro-kernel pass converts in registers (up to
     * DIRECT_512 rows on AVX-512, one pass on AVX2), else the tile is converted to float32
     * once and the float32 micro-kernel runs over all rows (the same products and sums) */
    const float *x = (const float *)j->xa + m0 * j->ldx;
    int direct_rows = isa == ISA_AVX512 ? DIRECT_512 : MR_AVX2;
    if (rows <= direct_rows) {
        if (isa == ISA_AVX512) {
            for (int64_t i = 0; i < rows; i += MR_512) {
                const int mr = rows - i < MR_512 ? (int)(rows - i) : MR_512;
                const char *pf = i == 0 ? next : NULL;
                if (fmt == FMT_F16) mk_512_f16(x + i * j->ldx, j->ldx, wt, K, c + i * NR, mr, pf);
                else mk_512_bf16(x + i * j->ldx, j->ldx, wt, K, c + i * NR, mr, pf);
            }
        } else {
            for (int64_t i = 0; i < rows; i += MR_AVX2)
                mk_avx2_half(fmt, x + i * j->ldx, j->ldx, wt, K, c + i * NR,
                             rows - i < MR_AVX2 ? (int)(rows - i) : MR_AVX2, i == 0 ? next : NULL);
        }
        return EK_OK;
    }
    if (isa == ISA_AVX2) { /* AVX2_KC k at a time, the next tile prefetched while converting */
        float *chunk = scratch(&tl_tile, (size_t)(AVX2_KC * NR) * 4);
        if (!chunk) return EK_NO_MEMORY;
        for (int64_t k0 = 0; k0 < K; k0 += AVX2_KC) {
            int64_t kc = K - k0 < AVX2_KC ? K - k0 : AVX2_KC;
            tile_to_f32_avx2(fmt, (const uint16_t *)wt + k0 * NR, kc, chunk,
                             next ? next + k0 * NR * 2 : NULL);
            avx2_chunk_passes(x, j->ldx, chunk, k0, kc, c, rows);
        }
        return EK_OK;
    }
    /* AVX-512: the whole tile converted, then 12-row passes, the first prefetching the next
     * tile (prefetching while converting, as AVX2 does, slowed it: 16 rows of SmolLM2's
     * float16 step 24.6 -> 28.7 ms; so did AVX2's chunks, 25.0 -> 31.8-34.4 ms) */
    float *tile = scratch(&tl_tile, (size_t)(K * NR) * 4);
    if (!tile) return EK_NO_MEMORY;
    tile_to_f32_512(fmt, (const uint16_t *)wt, K, tile);
    for (int64_t i = 0; i < rows;) {
        int mr = rows - i < MR_512 ? (int)(rows - i) : MR_512;
        mk_512_f32(x + i * j->ldx, j->ldx, tile, K, c + i * NR, mr, i == 0 ? next : NULL);
        i += mr;
    }
    return EK_OK;
}

/* rows [m0, m0 + rows) of tile t; the first micro-kernel pass prefetches tile t + 1 unless
 * `last` */
static int run_tile(const job_t *j, int64_t t, int last, int64_t m0, int64_t rows, float *c) {
    const int64_t tb = tile_bytes(j->fmt, j->K);
    const char *wt = (const char *)j->w + t * tb;
    return run_tile_at(j, wt, last ? NULL : wt + tb, m0, rows, c);
}

/* tiles [t0, t1) of every row of the job: the micro-kernels into c, then the epilogue */
static int run_tiles(const job_t *j, int64_t t0, int64_t t1) {
    float c[M_CHUNK * NR] __attribute__((aligned(64)));
    int status = EK_OK;
    const int64_t es = j->ydt == DT_F32 ? 4 : 2;
    for (int64_t m0 = 0; m0 < j->M; m0 += M_CHUNK) {
        int64_t rows = j->M - m0 < M_CHUNK ? j->M - m0 : M_CHUNK;
        for (int64_t t = t0; t < t1; t++) {
            int s = run_tile(j, t, t + 1 == t1, m0, rows, c);
            if (s != EK_OK) {
                status = s;
                continue;
            }
            epilogue(c, rows, t * NR, j->N, j->bias, (char *)j->y + m0 * j->ldy * es, j->ydt,
                     j->ldy);
        }
    }
    return status;
}

static int check_args(int fmt, int isa, int64_t K) {
    if (fmt < FMT_F16 || fmt > FMT_F32) return EK_BAD_FORMAT;
    if (!isa_ok(fmt, isa)) return EK_BAD_ISA;
    if ((fmt == FMT_Q8_0 || is_q4(fmt) || is_wo(fmt)) && K % QK) return EK_BAD_K;
    if (fmt == FMT_BF16_PAIRS && isa != ISA_AVX512 && isa != ISA_SCALAR) return EK_BAD_ISA;
    return EK_OK;
}

/* The job's activations as its kernel reads them (j->M rows of x, row stride ldx): int8 blocks
 * for the int8 formats, bfloat16 pairs for vdpbf16ps, float32 (with block sums for the Q4_1
 * weight-only kernels) for the others. 0: out of memory. */
static int prep_activations(job_t *j, const void *x, int xdt, int64_t ldx) {
    const int fmt = j->fmt, isa = j->isa;
    const int64_t M = j->M, K = j->K;
    if (is_wo(fmt)) {
        j->xa = act_wo(x, xdt, M, K, ldx, fmt == FMT_Q4_1_F32 && isa != ISA_SCALAR, &j->ldx,
                       (float **)&j->dx);
    } else if (fmt == FMT_Q8_0 || is_q4(fmt)) {
        float *dx = NULL;
        int32_t *sx = NULL;
        j->xa = act_q8(x, xdt, M, K, ldx, fmt == FMT_Q8_0 && isa == ISA_AVX512, isa, &dx, &sx);
        j->ldx = K;
        j->dx = dx;
        j->sx = sx;
    } else if (fmt == FMT_BF16_PAIRS) {
        j->xa = act_bf16(x, xdt, M, K, ldx, &j->ldx);
    } else {
        j->xa = act_f32(x, xdt, M, K, ldx, &j->ldx);
    }
    return j->xa != NULL;
}

/* y[M, N] (row stride ldy, float32 or bfloat16) = x[M, K] (row stride ldx) . W^T + bias.
 * Returns EK_OK or a negative EK_* code. */
int ek_linear(int fmt, int isa, const void *x, int xdt, int64_t M, int64_t K, int64_t ldx,
              const void *w, int64_t N, const float *bias, void *y, int ydt, int64_t ldy,
              int nthreads) {
    int bad = check_args(fmt, isa, K);
    if (bad != EK_OK) return bad;
    if (M <= 0 || N <= 0) return EK_OK;
    job_t j = {fmt, isa, NULL, 0, NULL, NULL, w, M, N, K, bias, y, ydt, ldy};
    if (!prep_activations(&j, x, xdt, ldx)) return EK_NO_MEMORY;
    int64_t nt = (N + NR - 1) / NR;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > nt) nthreads = (int)nt;
    int status = EK_OK;
#pragma omp parallel num_threads(nthreads)
    {
        int tid = 0, n = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        n = omp_get_num_threads();
#endif
        int s = run_tiles(&j, nt * tid / n, nt * (tid + 1) / n);
        if (s != EK_OK) {
#pragma omp atomic write
            status = s;
        }
    }
    return status;
}

/* ---------------------------------------------------------------- grouped (MoE experts) */

/* An MoE layer's experts in one call: rows [offsets[e], offsets[e + 1]) of x (R rows, sorted
 * by expert) times expert e's packed weight w[e] (N x K, all in format fmt) into the same rows
 * of y; an expert whose w[e] is NULL (held by another rank) gets zero rows. The activations
 * are prepared once for all R rows (int8 blocks, bfloat16 pairs, block sums: per row, so the
 * same for every expert); the (expert, output tile) pairs are the work items, in expert order,
 * claimed in runs by the threads (an expert's few rows would leave a thread idle if the
 * threads split each expert's tiles), each pass prefetching the run's next tile. */
int ek_grouped_linear(int fmt, int isa, const void *x, int xdt, int64_t R, int64_t K,
                      int64_t ldx, const void *const *w, const int64_t *offsets, int64_t E,
                      int64_t N, void *y, int ydt, int64_t ldy, int nthreads) {
    int bad = check_args(fmt, isa, K);
    if (bad != EK_OK) return bad;
    if (R <= 0 || N <= 0 || E <= 0) return EK_OK;
    if (offsets[0] != 0 || offsets[E] != R) return EK_BAD_ARGS;
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] < offsets[e]) return EK_BAD_ARGS;
    job_t j = {fmt, isa, NULL, 0, NULL, NULL, NULL, R, N, K, NULL, y, ydt, ldy};
    if (!prep_activations(&j, x, xdt, ldx)) return EK_NO_MEMORY;
    const int64_t es = ydt == DT_F32 ? 4 : 2, nt = (N + NR - 1) / NR, tb = tile_bytes(fmt, K);
    int64_t *active = malloc((size_t)E * sizeof(int64_t)), na = 0;
    if (!active) return EK_NO_MEMORY;
    for (int64_t e = 0; e < E; e++) {
        if (offsets[e + 1] == offsets[e]) continue;
        if (w[e]) {
            active[na++] = e;
        } else {
            for (int64_t r = offsets[e]; r < offsets[e + 1]; r++)
                memset((char *)y + r * ldy * es, 0, (size_t)(N * es));
        }
    }
    const int64_t items = na * nt;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > items) nthreads = items > 0 ? (int)items : 1;
    int64_t run = items / (8 * nthreads);
    if (run < 1) run = 1;
    int64_t claimed = 0;
    int status = EK_OK;
#pragma omp parallel num_threads(nthreads)
    {
        float c[M_CHUNK * NR] __attribute__((aligned(64)));
        int s = EK_OK;
        for (;;) {
            int64_t i0 = __atomic_fetch_add(&claimed, run, __ATOMIC_RELAXED);
            if (i0 >= items) break;
            int64_t i1 = i0 + run < items ? i0 + run : items;
            for (int64_t i = i0; i < i1; i++) {
                int64_t e = active[i / nt], t = i % nt;
                const char *wt = (const char *)w[e] + t * tb, *next = NULL;
                if (i + 1 < i1)
                    next = (const char *)w[active[(i + 1) / nt]] + ((i + 1) % nt) * tb;
                for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += M_CHUNK) {
                    int64_t rows = offsets[e + 1] - m0 < M_CHUNK ? offsets[e + 1] - m0 : M_CHUNK;
                    int r = run_tile_at(&j, wt, m0 == offsets[e] ? next : NULL, m0, rows, c);
                    if (r != EK_OK) {
                        s = r;
                        continue;
                    }
                    epilogue(c, rows, t * NR, N, NULL, (char *)y + m0 * ldy * es, ydt, ldy);
                }
            }
        }
        if (s != EK_OK) {
#pragma omp atomic write
            status = s;
        }
    }
    free(active);
    return status;
}

/* ---------------------------------------------------------------- CPU graph nodes */

/* A linear layer as nodes of an engine CPU graph (graph.h): y[rows] = x[rows] . W^T + bias,
 * x and y float32 buffers of at least `cap` rows, the rows of the step. Formats whose kernels
 * read prepared activations (int8 blocks, bfloat16 pairs, the Q4_1 weight-only block sums)
 * run two nodes: ek_linear_node_prep writes them into the node's own buffer (rows split over
 * the threads), ek_linear_node_gemm splits the output tiles over the threads. */
typedef struct {
    ek_counter_t next; /* the next output tile to claim (ek_claim) */
    job_t j;        /* M set per step */
    const float *x; /* the input buffer as given */
    int64_t ldx_in, cap;
    int prep;       /* PREP_* */
    void *buf;      /* prepared activations for cap rows */
} lnode_t;

enum { PREP_NONE, PREP_SUMS, PREP_Q8, PREP_BF16 };

void ek_linear_node_free(void *p) {
    lnode_t *n = p;
    if (!n) return;
    free(n->buf);
    free(n);
}

/* the node's arguments (NULL: out of memory; *status says why not otherwise) */
void *ek_linear_node_new(int fmt, int isa, const float *x, int64_t ldx, const void *w,
                         int64_t N, int64_t K, const float *bias, float *y, int64_t ldy,
                         int64_t cap, int *status) {
    *status = check_args(fmt, isa, K);
    if (*status != EK_OK) return NULL;
    *status = EK_NO_MEMORY;
    lnode_t *n = calloc(1, sizeof(lnode_t));
    if (!n) return NULL;
    n->j = (job_t){fmt, isa, x, ldx, NULL, NULL, w, 0, N, K, bias, y, DT_F32, ldy};
    n->x = x;
    n->ldx_in = ldx;
    n->cap = cap;
    size_t bytes = 0;
    const int64_t nb = K / QK;
    if (is_wo(fmt)) {
        if (fmt == FMT_Q4_1_F32 && isa != ISA_SCALAR) {
            n->prep = PREP_SUMS;
            bytes = (size_t)(cap * nb) * 4;
        }
    } else if (fmt == FMT_Q8_0 || is_q4(fmt)) {
        n->prep = PREP_Q8;
        bytes = q8_bytes(cap, K);
    } else if (fmt == FMT_BF16_PAIRS) {
        n->prep = PREP_BF16;
        bytes = (size_t)(cap * ((K + 1) / 2 * 2)) * 2;
    }
    if (bytes) {
        n->buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!n->buf) {
            free(n);
            return NULL;
        }
    }
    if (n->prep == PREP_SUMS) {
        n->j.dx = n->buf;
    } else if (n->prep == PREP_Q8) {
        float *d;
        int32_t *sum;
        q8_parts(n->buf, cap, K, &d, &sum);
        n->j.xa = n->buf;
        n->j.ldx = K;
        n->j.dx = d;
        n->j.sx = sum;
    } else if (n->prep == PREP_BF16) {
        n->j.xa = n->buf;
        n->j.ldx = (K + 1) / 2 * 2;
    }
    *status = EK_OK;
    return n;
}

int ek_linear_node_has_prep(const void *p) { return ((const lnode_t *)p)->prep != PREP_NONE; }

void ek_linear_node_prep(const void *p, const ek_step_t *s, int tid, int nth) {
    const lnode_t *n = p;
    int64_t m0, m1;
    ek_split(s->rows, tid, nth, &m0, &m1);
    const int fmt = n->j.fmt, isa = n->j.isa;
    const int64_t K = n->j.K;
    if (n->prep == PREP_SUMS)
        block_sums(n->x, n->ldx_in, m0, m1, K, n->buf);
    else if (n->prep == PREP_Q8)
        quantize_rows(n->x, DT_F32, m0, m1, K, n->ldx_in, fmt == FMT_Q8_0 && isa == ISA_AVX512,
                      isa, n->buf, n->cap);
    else if (n->prep == PREP_BF16)
        bf16_rows(n->x, DT_F32, m0, m1, K, n->ldx_in, n->buf);
}

/* the output tiles claimed a few at a time (about 4 claims per thread: a thread held up by
 * another process leaves its tiles to the others), contiguous within a claim */
void ek_linear_node_gemm(const void *p, const ek_step_t *s, int tid, int nth) {
    lnode_t *n = (lnode_t *)p;
    job_t j = n->j;
    j.M = s->rows;
    const int64_t nt = (j.N + NR - 1) / NR;
    int64_t chunk = nt / (4 * nth);
    if (chunk < 1) chunk = 1;
    for (int64_t t0; (t0 = ek_claim(&n->next, s, chunk, nt)) >= 0;)
        if (run_tiles(&j, t0, t0 + chunk < nt ? t0 + chunk : nt) != EK_OK) {
            /* only the tile scratch can fail here (the rest was checked when the node was
             * made); a graph node has no status to return, and going on would leave the
             * output tiles unwritten */
            fprintf(stderr, "engine-cpu-kernels: out of memory for a linear node's tile "
                    "scratch (%lld rows)\n", (long long)j.M);
            abort();
        }
    (void)tid;
}

/* ---------------------------------------------------------------- peak throughput */

/* The arithmetic peak the benchmark reports fractions of: `iters` steps of 12 independent
 * chains (enough to cover latency x pipes) of one instruction on each of nthreads threads.
 * Returns the operations done (flops: 2 per FMA lane, 4 per vdpbf16ps lane, 8 per vpdpbusd
 * lane, 64 per vpmaddubsw ymm: 32 multiplies and 32 adds), or a negative EK_* code. kind 0: AVX2
 * vfmadd231ps ymm; 1: AVX-512 vfmadd231ps zmm; 2: vdpbf16ps zmm; 3: vpdpbusd zmm; 4: AVX2
 * vpmaddubsw ymm (the AVX2 block kernels' multiply). */
#define PEAK_BODY(T, ZERO, OP, SINK)                                                          \
    {                                                                                         \
        T a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, a4 = ZERO, a5 = ZERO, a6 = ZERO,        \
          a7 = ZERO, a8 = ZERO, a9 = ZERO, a10 = ZERO, a11 = ZERO;                            \
        for (int64_t i = 0; i < iters; i++) {                                                 \
            a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); a5 = OP(a5);     \
            a6 = OP(a6); a7 = OP(a7); a8 = OP(a8); a9 = OP(a9); a10 = OP(a10); a11 = OP(a11); \
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5)); \
            __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11)); \
        }                                                                                     \
        SINK(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11);                               \
    }

static volatile float peak_sink;

T_AVX2 static void peak_avx2(int64_t iters) {
    const __m256 m = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
#define OP(a) _mm256_fmadd_ps(a, m, b)
#define SINK(...) { __m256 v[] = {__VA_ARGS__}; float s = 0; for (int i = 0; i < 12; i++) s += v[i][0]; peak_sink = s; }
    PEAK_BODY(__m256, _mm256_setzero_ps(), OP, SINK)
#undef OP
#undef SINK
}

T_512 static void peak_512(int64_t iters) {
    const __m512 m = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
#define OP(a) _mm512_fmadd_ps(a, m, b)
#define SINK(...) { __m512 v[] = {__VA_ARGS__}; float s = 0; for (int i = 0; i < 12; i++) s += v[i][0]; peak_sink = s; }
    PEAK_BODY(__m512, _mm512_setzero_ps(), OP, SINK)
#undef OP
#undef SINK
}

T_512BF static void peak_512bf(int64_t iters) {
    const __m512bh m = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a80);
#define OP(a) _mm512_dpbf16_ps(a, m, b)
#define SINK(...) { __m512 v[] = {__VA_ARGS__}; float s = 0; for (int i = 0; i < 12; i++) s += v[i][0]; peak_sink = s; }
    PEAK_BODY(__m512, _mm512_setzero_ps(), OP, SINK)
#undef OP
#undef SINK
}

T_512VNNI static void peak_512vnni(int64_t iters) {
    const __m512i m = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
#define OP(a) _mm512_dpbusd_epi32(a, m, b)
#define SINK(...) { __m512i v[] = {__VA_ARGS__}; int s = 0; for (int i = 0; i < 12; i++) s += _mm_cvtsi128_si32(_mm512_castsi512_si128(v[i])); peak_sink = (float)s; }
    PEAK_BODY(__m512i, _mm512_setzero_si512(), OP, SINK)
#undef OP
#undef SINK
}

T_AVX2 static void peak_avx2_int8(int64_t iters) {
    const __m256i m = _mm256_set1_epi8(1);
#define OP(a) _mm256_maddubs_epi16(a, m)
#define SINK(...) { __m256i v[] = {__VA_ARGS__}; int s = 0; for (int i = 0; i < 12; i++) s += _mm_cvtsi128_si32(_mm256_castsi256_si128(v[i])); peak_sink = (float)s; }
    PEAK_BODY(__m256i, _mm256_set1_epi8(2), OP, SINK)
#undef OP
#undef SINK
}

double ek_peak(int kind, int64_t iters, int nthreads) {
    int f = ek_features();
    int need[] = {FEAT_AVX2, FEAT_AVX512, FEAT_AVX512 | FEAT_AVX512_BF16,
                  FEAT_AVX512 | FEAT_AVX512_VNNI, FEAT_AVX2};
    double per[] = {12.0 * 8 * 2, 12.0 * 16 * 2, 12.0 * 16 * 4, 12.0 * 16 * 8, 12.0 * 32 * 2};
    if (kind < 0 || kind > 4) return EK_BAD_FORMAT;
    if ((f & need[kind]) != need[kind]) return EK_BAD_ISA;
#pragma omp parallel num_threads(nthreads)
    {
        if (kind == 0) peak_avx2(iters);
        else if (kind == 1) peak_512(iters);
        else if (kind == 2) peak_512bf(iters);
        else if (kind == 3) peak_512vnni(iters);
        else peak_avx2_int8(iters);
    }
    return per[kind] * (double)iters * nthreads;
}
