/* bf16 matrix products in the summation orders of ATen's own CPU kernels (numerics/bf16_gemm.py).
 *
 * Where oneDNN has no bf16 kernel for the CPU (AVX2 without AVX-512), torch multiplies bf16
 * matrices in ATen's portable gemm: each output is a sum of exact fp32 products, accumulated in
 * fp32 in one fixed order, then rounded once to bf16. Three orders occur (numerics/bf16_gemm.py
 * says which layout takes which):
 *
 *   seq:  one sum, the products added in order of l.
 *   ilp4: four partial sums, product l going to sum l % 4; the last K % 4 products to sum 0;
 *         then ((s0 + s1) + s2) + s3.
 *   dot8: the vectorised dot product of 8 registers of 8 lanes: product l of each 64-wide
 *         chunk to register (l % 64) / 8, lane l % 8; the registers folded in halves (r += r + 4,
 *         r += r + 2, r += r + 1), the lanes likewise (lane i += lane i + 4, += i + 2, += i + 1);
 *         then the products up to the last multiple of 16 in one more register, folded alike
 *         and added; then the last K % 16 added one at a time.
 *
 * A product of two bf16 values has at most 16 significant bits, so it is exact in fp32 and a
 * fused multiply-add rounds exactly as a product and a sum do: the inputs here are the fp32
 * values of the bf16 operands, and the only roundings are the sums' and the final one to bf16.
 * Vectorising across output columns leaves each output's order as it is.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(FG_CLONES)
#define FG_TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FG_TARGETS
#endif

/* fp32 -> bf16, round to nearest even (NaN -> the quiet NaN 0x7FC0), as c10::BFloat16 does */
static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Each order's scalar body handles one row i of the output and the last w (< 8) columns from j0.
 * The bodies are macros, expanded inside the per-CPU clones (a static helper would be compiled
 * for the baseline CPU only). */
#define W 16

#define ILP4_BLOCK(w) do {                                                                         \
    float s0[W], s1[W], s2[W], s3[W];                                                              \
    for (int64_t j = 0; j < (w); j++) s0[j] = s1[j] = s2[j] = s3[j] = 0.0f;                       \
    for (int64_t l = 0; l < k4; l += 4) {                                                          \
        const float x0 = ai[l], x1 = ai[l + 1], x2 = ai[l + 2], x3 = ai[l + 3];                    \
        const float *b0 = B + l * n + j0, *b1 = b0 + n, *b2 = b1 + n, *b3 = b2 + n;                \
        for (int64_t j = 0; j < (w); j++) {                                                        \
            s0[j] += x0 * b0[j];                                                                   \
            s1[j] += x1 * b1[j];                                                                   \
            s2[j] += x2 * b2[j];                                                                   \
            s3[j] += x3 * b3[j];                                                                   \
        }                                                                                          \
    }                                                                                              \
    for (int64_t l = k4; l < k; l++) {                                                             \
        const float x = ai[l];                                                                     \
        const float *bl = B + l * n + j0;                                                          \
        for (int64_t j = 0; j < (w); j++) s0[j] += x * bl[j];                                      \
    }                                                                                              \
    for (int64_t j = 0; j < (w); j++) ci[j0 + j] = bf16_rne(((s0[j] + s1[j]) + s2[j]) + s3[j]);   \
} while (0)

#define SEQ_BLOCK(w) do {                                                                          \
    float s[W];                                                                                    \
    for (int64_t j = 0; j < (w); j++) s[j] = 0.0f;                                                 \
    for (int64_t l = 0; l < k; l++) {                                                              \
        const float x = ai[l];                                                                     \
        const float *bl = B + l * n + j0;                                                          \
        for (int64_t j = 0; j < (w); j++) s[j] += x * bl[j];                                       \
    }                                                                                              \
    for (int64_t j = 0; j < (w); j++) ci[j0 + j] = bf16_rne(s[j]);                                 \
} while (0)

/* dot8, one lane t (0..7) of the 8 registers at a time: register q's lane t holds the products
 * at l = 64c + 8q + t, summed over the chunks c; the registers then fold in halves (q += q + 4,
 * q += q + 2, q += q + 1), which for lane t reads ((r0 + r4) + (r2 + r6)) + ((r1 + r5) + (r3 + r7)),
 * and the lanes fold alike into the main sum. The products from k64 to k16 (whole 16-element
 * loads) go to a separate tail register, lane l % 8, folded alike and added to the main sum;
 * the last k % 16 are added one at a time. */
#define HSUM8(v, j) (((v[0][j] + v[4][j]) + (v[2][j] + v[6][j])) + ((v[1][j] + v[5][j]) + (v[3][j] + v[7][j])))
#define DOT8_BLOCK(w) do {                                                                         \
    float lane[8][W], tail[8][W];                                                                  \
    for (int t = 0; t < 8; t++) {                                                                  \
        float r[8][W];                                                                             \
        for (int q = 0; q < 8; q++)                                                                \
            for (int64_t j = 0; j < (w); j++) r[q][j] = 0.0f;                                      \
        for (int64_t l = 0; l < k64; l += 64)                                                      \
            for (int q = 0; q < 8; q++) {                                                          \
                const float x = ai[l + 8 * q + t];                                                 \
                const float *bl = B + (l + 8 * q + t) * n + j0;                                    \
                for (int64_t j = 0; j < (w); j++) r[q][j] += x * bl[j];                            \
            }                                                                                      \
        for (int64_t j = 0; j < (w); j++) {                                                        \
            lane[t][j] = HSUM8(r, j);                                                              \
            tail[t][j] = 0.0f;                                                                     \
        }                                                                                          \
        for (int64_t l = k64 + t; l < k16; l += 8) {                                               \
            const float x = ai[l];                                                                 \
            const float *bl = B + l * n + j0;                                                      \
            for (int64_t j = 0; j < (w); j++) tail[t][j] += x * bl[j];                             \
        }                                                                                          \
    }                                                                                              \
    for (int64_t j = 0; j < (w); j++) {                                                            \
        float s = HSUM8(lane, j) + HSUM8(tail, j);                                                 \
        for (int64_t l = k16; l < k; l++) s += ai[l] * B[l * n + j0 + j];                          \
        ci[j0 + j] = bf16_rne(s);                                                                  \
    }                                                                                              \
} while (0)

/* The whole blocks, in GCC's vector extension: 8 fp32 lanes a value (one AVX register in the
 * x86-64-v3 / v4 clones, two SSE ones in the baseline), so that the accumulators are registers.
 * Lanes are output columns: each column's own order is the scalar macros' (tests pin both). */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  /* unaligned loads */
#define LD(p) (*(const v8u *)(p))
#define BC(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})

static inline void store_bf16(uint16_t *dst, v8 v) {
    for (int j = 0; j < 8; j++) dst[j] = bf16_rne(v[j]);
}

/* ilp4 on 8 columns of one row: 4 partial sums */
#define ILP4_V8 do {                                                                               \
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                     \
    const float *bj = P;                                                                      \
    for (int64_t l = 0; l < k4; l += 4) {                                                          \
        s0 += BC(ai[l]) * LD(bj + l * 8);                                                          \
        s1 += BC(ai[l + 1]) * LD(bj + (l + 1) * 8);                                                \
        s2 += BC(ai[l + 2]) * LD(bj + (l + 2) * 8);                                                \
        s3 += BC(ai[l + 3]) * LD(bj + (l + 3) * 8);                                                \
    }                                                                                              \
    for (int64_t l = k4; l < k; l++) s0 += BC(ai[l]) * LD(bj + l * 8);                             \
    store_bf16(ci + j0, ((s0 + s1) + s2) + s3);                                                    \
} while (0)

/* seq on 8 columns of four rows at once (one chain per row: four chains hide the add latency) */
#define SEQ_V8_ROWS4 do {                                                                          \
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                     \
    const float *bj = P;                                                                      \
    for (int64_t l = 0; l < k; l++) {                                                              \
        const v8 bl = LD(bj + l * 8);                                                              \
        s0 += BC(ai[l]) * bl;                                                                      \
        s1 += BC(ai[k + l]) * bl;                                                                  \
        s2 += BC(ai[2 * k + l]) * bl;                                                              \
        s3 += BC(ai[3 * k + l]) * bl;                                                              \
    }                                                                                              \
    store_bf16(ci + j0, s0);                                                                       \
    store_bf16(ci + n + j0, s1);                                                                   \
    store_bf16(ci + 2 * n + j0, s2);                                                               \
    store_bf16(ci + 3 * n + j0, s3);                                                               \
} while (0)

#define SEQ_V8 do {                                                                                \
    v8 s0 = {0};                                                                                   \
    const float *bj = P;                                                                      \
    for (int64_t l = 0; l < k; l++) s0 += BC(ai[l]) * LD(bj + l * 8);                              \
    store_bf16(ci + j0, s0);                                                                       \
} while (0)

/* dot8 on 8 columns of one row (the order of DOT8_BLOCK) */
#define DOT8_V8 do {                                                                               \
    v8 lane[8], tail[8];                                                                           \
    const float *bj = P;                                                                      \
    for (int t = 0; t < 8; t++) {                                                                  \
        v8 r0 = {0}, r1 = {0}, r2 = {0}, r3 = {0}, r4 = {0}, r5 = {0}, r6 = {0}, r7 = {0};         \
        for (int64_t l = t; l < k64; l += 64) {                                                    \
            r0 += BC(ai[l]) * LD(bj + l * 8);                                                      \
            r1 += BC(ai[l + 8]) * LD(bj + (l + 8) * 8);                                            \
            r2 += BC(ai[l + 16]) * LD(bj + (l + 16) * 8);                                          \
            r3 += BC(ai[l + 24]) * LD(bj + (l + 24) * 8);                                          \
            r4 += BC(ai[l + 32]) * LD(bj + (l + 32) * 8);                                          \
            r5 += BC(ai[l + 40]) * LD(bj + (l + 40) * 8);                                          \
            r6 += BC(ai[l + 48]) * LD(bj + (l + 48) * 8);                                          \
            r7 += BC(ai[l + 56]) * LD(bj + (l + 56) * 8);                                          \
        }                                                                                          \
        lane[t] = ((r0 + r4) + (r2 + r6)) + ((r1 + r5) + (r3 + r7));                               \
        v8 tl = {0};                                                                               \
        for (int64_t l = k64 + t; l < k16; l += 8) tl += BC(ai[l]) * LD(bj + l * 8);               \
        tail[t] = tl;                                                                              \
    }                                                                                              \
    v8 s = (((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]))) \
         + (((tail[0] + tail[4]) + (tail[2] + tail[6])) + ((tail[1] + tail[5]) + (tail[3] + tail[7]))); \
    for (int64_t l = k16; l < k; l++) s += BC(ai[l]) * LD(bj + l * 8);                             \
    store_bf16(ci + j0, s);                                                                        \
} while (0)

/* c[b, i, j] = bf16(the sum over l of a[b, i, l] * bm[b, l, j] in the order ``how`` names);
 * a (batch, m, k) and bm (batch, k, n) contiguous fp32, c (batch, m, n) contiguous bf16 bits.
 * Whole blocks of 8 columns take the vector bodies (ROWS rows at a time) on a packed copy P of
 * the block (k x 8, contiguous: B's rows are n floats apart, and a stride of a power of two
 * maps them all onto a few cache sets), which stays in cache while the rows of A pass; the
 * last n % 8 columns take the scalar bodies. Returns 0, or -1 if P could not be allocated. */
#define GEMM(how, V8, ROWS, V8_ROWS, BLOCK)                                                        \
FG_TARGETS int fg_bf16_gemm_##how(const float *restrict a, const float *restrict bm,              \
                                   uint16_t *restrict c, int64_t batch, int64_t m, int64_t n,      \
                                   int64_t k) {                                                    \
    const int64_t n8 = n - n % 8, k4 = k - k % 4, k16 = k - k % 16, k64 = k - k % 64;              \
    const int64_t mr = m - m % (ROWS);                                                             \
    (void)k4; (void)k16; (void)k64; (void)mr;                                                      \
    float *P = n8 ? malloc((size_t)(k > 0 ? k : 1) * 8 * sizeof(float)) : NULL;                    \
    if (n8 && !P) return -1;                                                                       \
    for (int64_t b = 0; b < batch; b++) {                                                          \
        const float *restrict B = bm + b * k * n;                                                  \
        for (int64_t j0 = 0; j0 < n8; j0 += 8) {                                                   \
            for (int64_t l = 0; l < k; l++) memcpy(P + l * 8, B + l * n + j0, 8 * sizeof(float));  \
            int64_t i = 0;                                                                         \
            for (; i < mr; i += (ROWS)) {                                                          \
                const float *restrict ai = a + (b * m + i) * k;                                    \
                uint16_t *restrict ci = c + (b * m + i) * n;                                       \
                V8_ROWS;                                                                           \
            }                                                                                      \
            for (; i < m; i++) {                                                                   \
                const float *restrict ai = a + (b * m + i) * k;                                    \
                uint16_t *restrict ci = c + (b * m + i) * n;                                       \
                V8;                                                                                \
            }                                                                                      \
        }                                                                                          \
        if (n8 < n)                                                                                \
            for (int64_t i = 0; i < m; i++) {                                                      \
                const float *restrict ai = a + (b * m + i) * k;                                    \
                uint16_t *restrict ci = c + (b * m + i) * n;                                       \
                const int64_t j0 = n8, w = n - n8;                                                 \
                BLOCK(w);                                                                          \
            }                                                                                      \
    }                                                                                              \
    free(P);                                                                                       \
    return 0;                                                                                      \
}
GEMM(ilp4, ILP4_V8, 1, ILP4_V8, ILP4_BLOCK)
GEMM(seq, SEQ_V8, 4, SEQ_V8_ROWS4, SEQ_BLOCK)
GEMM(dot8, DOT8_V8, 1, DOT8_V8, DOT8_BLOCK)
