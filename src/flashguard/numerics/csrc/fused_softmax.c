/* The softmax passes of the emulated flash attention (attention/flash.py) fused into one pass each,
 * with the bits of torch's own ops: the bf16 chains (bf16 scores, P and dP: the study's arithmetic)
 * and, at the end of the file, the fp32 ones (fa2 and its kin).
 *
 * Each torch op on a bf16 tile widens to fp32, computes one IEEE fp32 operation and rounds to
 * bf16 to nearest even; a chain of them reads and writes the whole tile once per op. Here a chain
 * runs lane by lane in registers with the same roundings between its steps. The exponential is
 * torch's own vector exponential (Sleef_expf16_u10, called through the pointer that
 * numerics/fused_softmax.py takes from torch's library), which torch's bf16 exp applies to every
 * element of a loop whose length is a multiple of its 64-element step: the Python side uses these
 * kernels only where torch's loops have no scalar tail, and checks them against torch's ops over
 * every bf16 bit pattern before the first use.
 *
 * Layout: ``s`` (and ``dp``) are rows of ``w`` bf16 values (w a multiple of 16), rows r0..r1-1 of
 * a contiguous (rows, w) tile; ``shift`` holds one bf16 value per row; ``hidden`` is NULL or a
 * (period, w) byte mask, row r using mask row r % period (a causal mask shared by batch and heads).
 * Built with -ffp-contract=off: no product and sum are fused.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define FG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

typedef __m512 (*fg_vexp_t)(__m512);
static fg_vexp_t fg_vexp;

/* torch's vector exponential; returns 1 if the pointer was taken */
int fg_bf16_softmax_set_exp(void *fn) {
    fg_vexp = (fg_vexp_t)fn;
    return fn != NULL;
}

FG_AVX512 static inline __m512 widen(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* fp32 -> the bf16 bits torch's vector conversion writes, in the high half of each lane:
 * round to nearest even; a NaN becomes 0xffff */
FG_AVX512 static inline __m512i bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    return _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32((int)0xffff0000u), r);
}

/* the bf16 value of v, held in fp32 (the next op's widened operand) */
FG_AVX512 static inline __m512 rnd(__m512 v) { return _mm512_castsi512_ps(bf16_bits(v)); }

FG_AVX512 static inline void store(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}

FG_AVX512 static inline __m512 row_value(const uint16_t *shift, int64_t r) {
    uint32_t u = (uint32_t)shift[r] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return _mm512_set1_ps(f);
}

FG_AVX512 static inline __mmask16 hidden_lanes(const uint8_t *h) {
    __m128i b = _mm_loadu_si128((const __m128i *)h);
    return _mm_test_epi8_mask(b, b);
}

/* P = exp(S' - lse) of the backward pass: S' = bf16(S * scale) when do_scale, else S; hidden
 * entries of S' are -inf; each step rounded to bf16. In place. */
FG_AVX512 void fg_bf16_p_from_lse(uint16_t *s, const uint16_t *shift, const uint8_t *hidden, int64_t period,
                                  float scale, int do_scale, int64_t w, int64_t r0, int64_t r1) {
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-__builtin_inff());
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *row = s + r * w;
        const uint8_t *hrow = hidden ? hidden + (r % period) * w : NULL;
        const __m512 m = row_value(shift, r);
        /* exp(bf16(-inf - m)) is +0 unless m is NaN or -inf: a group of 16 hidden entries is then
         * +0 without the exponential */
        const float mf = _mm512_cvtss_f32(m);
        const int zero_hidden = mf == mf && mf > -__builtin_inff();
        for (int64_t j = 0; j < w; j += 16) {
            __mmask16 h = hrow ? hidden_lanes(hrow + j) : 0;
            if (h == 0xFFFF && zero_hidden) {
                memset(row + j, 0, 16 * sizeof(uint16_t));
                continue;
            }
            __m512 x = widen(row + j);
            if (do_scale) x = rnd(_mm512_mul_ps(x, sc));
            x = _mm512_mask_blend_ps(h, x, ninf);
            x = rnd(_mm512_sub_ps(x, m));
            store(row + j, fg_vexp(x));
        }
    }
}

/* P = exp(S - m) of the forward pass, hidden entries then set to +0. In place. */
FG_AVX512 void fg_bf16_p_from_max(uint16_t *s, const uint16_t *shift, const uint8_t *hidden, int64_t period,
                                  int64_t w, int64_t r0, int64_t r1) {
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *row = s + r * w;
        const uint8_t *hrow = hidden ? hidden + (r % period) * w : NULL;
        const __m512 m = row_value(shift, r);
        for (int64_t j = 0; j < w; j += 16) {
            __mmask16 h = hrow ? hidden_lanes(hrow + j) : 0;
            if (h == 0xFFFF) {   /* all set to +0 after the exponential: it need not run */
                memset(row + j, 0, 16 * sizeof(uint16_t));
                continue;
            }
            __m512 p = fg_vexp(rnd(_mm512_sub_ps(widen(row + j), m)));
            store(row + j, _mm512_mask_blend_ps(h, p, zero));
        }
    }
}

/* dS = bf16(P') * bf16(dP - delta), P' = bf16(P * scale) when do_scale, else P. Into p. */
FG_AVX512 void fg_bf16_ds(uint16_t *p, const uint16_t *dp, const uint16_t *shift, float scale, int do_scale,
                          int64_t w, int64_t r0, int64_t r1) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *prow = p + r * w;
        const uint16_t *drow = dp + r * w;
        const __m512 d = row_value(shift, r);
        for (int64_t j = 0; j < w; j += 16) {
            __m512 dpm = rnd(_mm512_sub_ps(widen(drow + j), d));
            __m512 x = widen(prow + j);
            if (do_scale) x = rnd(_mm512_mul_ps(x, sc));
            store(prow + j, _mm512_mul_ps(x, dpm));
        }
    }
}

/* The row max of a pass's results: their largest value, or NaN where the row holds a NaN (max_ps
 * would drop it). Which of +0 and -0, or which NaN, torch's amax returns depends on its reduction
 * order: the Python side takes torch's amax for a tile where a row max is zero or NaN. */
FG_AVX512 static inline float row_max_of(__m512 mx, __mmask16 nan) {
    return nan ? __builtin_nanf("") : _mm512_reduce_max_ps(mx);
}

/* S = bf16(S * scale), hidden entries then set to the bf16 bits ``fill``. In place. With ``rowmax``
 * (else NULL) each row's max, as bf16 bits, into rowmax[r] (see row_max_of). */
FG_AVX512 void fg_bf16_scale_fill(uint16_t *s, const uint8_t *hidden, int64_t period, float scale,
                                  uint16_t fill, uint16_t *rowmax, int64_t w, int64_t r0, int64_t r1) {
    const __m512 sc = _mm512_set1_ps(scale);
    uint32_t fu = (uint32_t)fill << 16;
    float ff;
    memcpy(&ff, &fu, sizeof ff);
    const __m512 fillv = _mm512_set1_ps(ff);
    for (int64_t r = r0; r < r1; r++) {
        uint16_t *row = s + r * w;
        const uint8_t *hrow = hidden ? hidden + (r % period) * w : NULL;
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        __mmask16 nan = 0;
        for (int64_t j = 0; j < w; j += 16) {
            __m512 x = rnd(_mm512_mul_ps(widen(row + j), sc));
            if (hrow) x = _mm512_mask_blend_ps(hidden_lanes(hrow + j), x, fillv);
            store(row + j, x);
            if (rowmax) {
                mx = _mm512_max_ps(mx, x);
                nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            }
        }
        if (rowmax) {
            float m = row_max_of(mx, nan);
            uint32_t u;
            memcpy(&u, &m, sizeof u);
            rowmax[r] = m != m ? 0xffff : (uint16_t)(u >> 16);   /* a bf16 value: exact */
        }
    }
}

/* how many lanes of x are >= t (ge) or == t: ordered compares, NaN is never counted */
FG_AVX512 static inline int lanes_cmp(__m512 x, __m512 t, int ge) {
    __mmask16 hit = ge ? _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ) : _mm512_cmp_ps_mask(x, t, _CMP_EQ_OQ);
    return __builtin_popcount((unsigned)hit);
}

/* How many entries of each row compare to the row's value thr[r] as ``ge`` (s >= thr) or, ge = 0,
 * equal (s == thr), into count[r]: torch's compare of bf16 values (exact in fp32; NaN compares
 * false, -0 equals +0) summed. Rows are whole 16-lane vectors. */
FG_AVX512 void fg_bf16_count_cmp(const uint16_t *s, const uint16_t *thr, int ge, int32_t *count, int64_t w,
                                 int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = s + r * w;
        const __m512 t = row_value(thr, r);
        int32_t n = 0;
        for (int64_t j = 0; j < w; j += 16) n += lanes_cmp(widen(row + j), t, ge);
        count[r] = n;
    }
}

/* a = bf16(a + b): a bf16 accumulator's in-place add_ (the study's arithmetic accumulates O, dQ,
 * dK and dV in bf16 across tiles). In place. */
FG_AVX512 void fg_bf16_add(uint16_t *a, const uint16_t *b, int64_t w, int64_t r0, int64_t r1) {
    for (int64_t i = r0 * w; i < r1 * w; i += 16)
        store(a + i, _mm512_add_ps(widen(a + i), widen(b + i)));
}

#else
int fg_bf16_softmax_set_exp(void *fn) { (void)fn; return 0; }
#endif

/* ---- the fp32 chains (fa2 and its kin: fp32 scores, P and dP). Every step is one IEEE fp32
 * operation, as torch's; the exponential is torch's own for fp32 (MKL's vsExp, whose result for an
 * element does not depend on the array it is in), called on row pieces of up to FG_PIECE values.
 * Rows are whole 16-lane vectors (the Python side passes rows of whole 64-element steps). */

typedef void (*fg_vsexp_t)(int, const float *, float *);
static fg_vsexp_t fg_vsexp;
#define FG_PIECE 1024

int fg_f32_softmax_set_exp(void *fn) {
    fg_vsexp = (fg_vsexp_t)fn;
    return fn != NULL;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* P = exp(S' - shift) in place, S' = S * scale when do_scale, hidden entries of S' -inf when
 * fill_neg_inf. hidden_zero: 1 = a hidden entry's P is +0 (the finite fill: set after exp);
 * 2 = as torch's exp of -inf - shift, which is +0 where the row's shift is above -inf (those are
 * set to 0 before and after the exponential, which never sees -inf there: MKL's exp is slow on it)
 * and NaN elsewhere (left to the exponential). pbar: NULL, or where P rounded to bf16 and held in fp32
 * goes (the matmul operand torch's cast and widening give). */
FG_AVX512 void fg_f32_p(float *s, const float *shift, const uint8_t *hidden, int64_t period, float scale,
                        int do_scale, int fill_neg_inf, int hidden_zero, float *pbar, int64_t w, int64_t r0,
                        int64_t r1) {
    float buf[FG_PIECE];
    __mmask16 zero[FG_PIECE / 16];
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-__builtin_inff()), z = _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; r++) {
        float *row = s + r * w;
        const uint8_t *hrow = hidden ? hidden + (r % period) * w : NULL;
        const float mf = shift[r];
        const __m512 m = _mm512_set1_ps(mf);
        /* torch's fp32 x - m is fma(m, -1, x) in its vector loop: where both are NaN the result is
         * m's NaN, which x86 gives for m - x (the first operand's); elsewhere the two agree */
        const int m_nan = mf != mf;
        const int zero_hidden = hidden_zero == 1 || (hidden_zero == 2 && mf > -__builtin_inff());
        for (int64_t j0 = 0; j0 < w; j0 += FG_PIECE) {
            const int n = (int)(w - j0 < FG_PIECE ? w - j0 : FG_PIECE);
            int used = 0;   /* the exponential runs up to the last group not all set to +0 */
            for (int j = 0; j < n; j += 16) {
                __m512 x = _mm512_loadu_ps(row + j0 + j);
                if (do_scale) x = _mm512_mul_ps(x, sc);
                __mmask16 h = hrow ? hidden_lanes(hrow + j0 + j) : 0;
                if (fill_neg_inf) x = _mm512_mask_blend_ps(h, x, ninf);
                x = m_nan ? _mm512_sub_ps(m, x) : _mm512_sub_ps(x, m);
                zero[j / 16] = zero_hidden ? h : 0;
                if (zero[j / 16] != 0xFFFF) used = j + 16;
                _mm512_storeu_ps(buf + j, _mm512_mask_blend_ps(zero[j / 16], x, z));
            }
            if (used) fg_vsexp(used, buf, buf);
            for (int j = 0; j < n; j += 16) {
                __m512 p = _mm512_mask_blend_ps(zero[j / 16], _mm512_loadu_ps(buf + j), z);
                _mm512_storeu_ps(row + j0 + j, p);
                if (pbar) _mm512_storeu_ps(pbar + r * w + j0 + j, rnd(p));   /* P.to(bf16).to(fp32) */
            }
        }
    }
}

/* dS = P' * (dP - delta), P' = P * scale when do_scale, into p (round_bf16: dS rounded to bf16 and
 * held in fp32, the matmul operand torch's cast and widening give); dp is left as it is */
FG_AVX512 void fg_f32_ds(float *p, const float *dp, const float *shift, float scale, int do_scale, int round_bf16,
                         int64_t w, int64_t r0, int64_t r1) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r = r0; r < r1; r++) {
        float *prow = p + r * w;
        const float *drow = dp + r * w;
        const float df = shift[r];
        const __m512 d = _mm512_set1_ps(df);
        const int d_nan = df != df;   /* as m_nan in fg_f32_p */
        for (int64_t j = 0; j < w; j += 16) {
            __m512 g = _mm512_loadu_ps(drow + j);
            __m512 dpm = d_nan ? _mm512_sub_ps(d, g) : _mm512_sub_ps(g, d);
            __m512 x = _mm512_loadu_ps(prow + j);
            if (do_scale) x = _mm512_mul_ps(x, sc);
            /* where both factors are NaN torch's product keeps dP - delta's (its mul's first
             * source operand); the compiler may order this product's operands either way */
            __mmask16 both = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(dpm, dpm, _CMP_UNORD_Q);
            __m512 ds = _mm512_mask_blend_ps(both, _mm512_mul_ps(x, dpm), dpm);
            _mm512_storeu_ps(prow + j, round_bf16 ? rnd(ds) : ds);   /* dS.to(bf16).to(fp32) */
        }
    }
}

/* S = S * scale, hidden entries then ``fill``. In place. */
/* fg_bf16_count_cmp on fp32 tiles */
FG_AVX512 void fg_f32_count_cmp(const float *s, const float *thr, int ge, int32_t *count, int64_t w, int64_t r0,
                                int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *row = s + r * w;
        const __m512 t = _mm512_set1_ps(thr[r]);
        int32_t n = 0;
        for (int64_t j = 0; j < w; j += 16) n += lanes_cmp(_mm512_loadu_ps(row + j), t, ge);
        count[r] = n;
    }
}

FG_AVX512 void fg_f32_scale_fill(float *s, const uint8_t *hidden, int64_t period, float scale, float fill,
                                 float *rowmax, int64_t w, int64_t r0, int64_t r1) {
    const __m512 sc = _mm512_set1_ps(scale), f = _mm512_set1_ps(fill);
    for (int64_t r = r0; r < r1; r++) {
        float *row = s + r * w;
        const uint8_t *hrow = hidden ? hidden + (r % period) * w : NULL;
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        __mmask16 nan = 0;
        for (int64_t j = 0; j < w; j += 16) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + j), sc);
            if (hrow) x = _mm512_mask_blend_ps(hidden_lanes(hrow + j), x, f);
            _mm512_storeu_ps(row + j, x);
            if (rowmax) {
                mx = _mm512_max_ps(mx, x);
                nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            }
        }
        if (rowmax) rowmax[r] = row_max_of(mx, nan);
    }
}
#endif
