/* The elementwise kernels of numerics/fast_exp.py in C: the same arithmetic, one pass.
 *
 * Built on first use by numerics/native.py with -ffp-contract=off, so that the compiler
 * never fuses a product and a sum into an FMA the kernel it models does not have: every
 * fused multiply-add here is an explicit fmaf (one rounding, IEEE 754), every other
 * operation rounds on its own, as the AVX-512 intrinsics it models do. Tests pin it to the
 * pure-PyTorch fallback bit for bit (tests/numerics/test_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(FG_CLONES)
/* hardware FMA and wide vectors where the CPU has them; fmaf is exact in every clone */
#define FG_TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FG_TARGETS
#endif

static float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

/* out[i] = fp32(a[i] * b[i] + c[i]) with one rounding */
FG_TARGETS void fg_fma32(const float *a, const float *b, const float *c, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = fmaf(a[i], b[i], c[i]);
}

/* ATen's AVX-512 fexp_u20, one lane at a time (numerics/fast_exp.py states its steps) */
FG_TARGETS void fg_fexp_u20(const float *x, float *out, int64_t n) {
    const float log2e = f32_from_bits(0x3FB8AA3Bu);
    const float ln_min = f32_from_bits(0xC2AEAC50u);
    const float ln_max = f32_from_bits(0x42B17218u);
    const float c0 = (float)0.00010703434948458272, c1 = (float)0.30354260500649682;
    const float c2 = (float)-0.22433836478672356, c3 = (float)-0.079204240219773236;
    const float a = 8388608.0f, b = 8388608.0f * 127.0f;
    for (int64_t i = 0; i < n; i++) {
        float xi = x[i];
        float src = xi * log2e;
        float frac = src - floorf(src);
        float poly = fmaf(frac, fmaf(frac, fmaf(frac, c3, c2), c1), c0);
        float w = fmaf(a, src - poly, b);
        /* cvtt: truncation towards 0 (w lies well inside int32 for x in [ln_min, ln_max]) */
        int32_t word = (xi >= ln_min && xi <= ln_max) ? (int32_t)w : 0;
        float r;
        memcpy(&r, &word, sizeof r);
        if (xi < ln_min) r = 0.0f;
        if (xi > ln_max) r = INFINITY;
        if (xi != xi) r = xi;
        out[i] = r;
    }
}
