/* Vector helpers for the engine's C kernels: with AVX-512, 16 floats from/to float32 or bfloat16, e^x and SiLU, and a
 * 16 x 16 transpose of 32-bit words; with AVX2, 8 floats from/to float32 or bfloat16, e^x and SiLU, the sums of 8
 * vectors' lanes, and the fixed tree that sums 8 lanes. */
#ifndef TESSERA_SIMD_H
#define TESSERA_SIMD_H

/* e^r for |r| <= ln(2) / 2 as its Taylor series to r^7 (Horner's rule), in any vector width: FMA(a, b, c) = a * b +
 * c and SET1(x) broadcasts x (exp16 and exp8 share it, so the two widths give the same values) */
#define EXP_TAYLOR(FMA, SET1, r)                                                                                  \
    FMA(FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.f / 5040.f), r, SET1(1.f / 720.f)), r, SET1(1.f / 120.f)), r,             \
                        SET1(1.f / 24.f)), r, SET1(1.f / 6.f)), r, SET1(0.5f)), r, SET1(1.f)), r, SET1(1.f))

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

static inline __m512 load16(const void *p, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* float32 bits rounded to the nearest even bfloat16, in the high half (NaN inputs are not expected here) */
static inline __m512i round_bf16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
}

/* v rounded to bfloat16 and widened back (a no-op for float32) */
static inline __m512 round16(__m512 v, int bf16) {
    if (!bf16) return v;
    return _mm512_castsi512_ps(_mm512_and_si512(round_bf16_bits(v), _mm512_set1_epi32((int)0xffff0000u)));
}

static inline void store16(void *p, int bf16, int64_t i, __m512 v) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16)));
    else
        _mm512_storeu_ps((float *)p + i, v);
}

/* x split as n ln(2) + r, n a whole number and |r| <= ln(2) / 2, so that e^x = 2^n e^r: r, and n in *n */
static inline __m512 exp16_reduce(__m512 x, __m512 *n) {
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    *n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_mul_ps(_mm512_sub_ps(t, *n), _mm512_set1_ps(0.693147180559945f)); /* 2^(t-n) = e^r */
}

/* e^x, float32, relative error ~2e-7 on [-87, 88] (clamped outside it: 0 below, a large finite value above) */
static inline __m512 exp16(__m512 x) {
    __m512 n, r = exp16_reduce(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)), &n);
    return _mm512_scalef_ps(EXP_TAYLOR(_mm512_fmadd_ps, _mm512_set1_ps, r), n);
}

/* e^x for x at most a few units (a softmax's score less a running maximum it may pass by a little): clamped below
 * only (at -87: no subnormal results, and 0 rather than NaN for an x of -inf), Taylor to r^5 (relative error
 * ~3e-6, far below the bfloat16 rounding of a probability) */
static inline __m512 exp16_short(__m512 x) {
    __m512 n, r = exp16_reduce(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), &n);
    __m512 e = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(
        _mm512_set1_ps(1.f / 120.f), r, _mm512_set1_ps(1.f / 24.f)), r, _mm512_set1_ps(1.f / 6.f)), r,
        _mm512_set1_ps(0.5f)), r, _mm512_set1_ps(1.f)), r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(e, n);
}

/* silu(g) = g / (1 + e^-g): the reciprocal to 14 bits and one Newton step to full float32 */
static inline __m512 silu16(__m512 g) {
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
    return _mm512_mul_ps(g, inv);
}
/* r[0..16) as a 16 x 16 matrix of 32-bit words, transposed in place (64 shuffles) */
static inline __attribute__((always_inline)) void transpose16x16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], 128-bit lane L: word 4L + c of rows 4i..4i+3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        t[4 * c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
        t[4 * c + 1] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        t[4 * c + 2] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        t[4 * c + 3] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_i32x4(t[4 * c], t[4 * c + 2], 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 * c], t[4 * c + 2], 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(t[4 * c + 1], t[4 * c + 3], 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 * c + 1], t[4 * c + 3], 0xdd);
    }
}

#endif

#if defined(__AVX2__)
#include <immintrin.h>
#include <stdint.h>

/* 8 bfloat16 widened to float32 (exact) */
static inline __m256 widen8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* e^x, float32, as exp16 (the same polynomial, clamped to [-87, 88]), 2^n made in the exponent bits */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945f)); /* 2^(t-n) = e^r */
    /* n is in [-126, 127] after the clamp: 2^n is the normal float with exponent field n + 127 */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(EXP_TAYLOR(_mm256_fmadd_ps, _mm256_set1_ps, r), _mm256_castsi256_ps(e));
}

/* silu(g) = g / (1 + e^-g) as silu16 computes it: the reciprocal to 12 bits and one Newton step */
static inline __m256 silu8(__m256 g) {
    __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
    __m256 inv = _mm256_rcp_ps(d);
    inv = _mm256_mul_ps(inv, _mm256_fnmadd_ps(d, inv, _mm256_set1_ps(2.f)));
    return _mm256_mul_ps(g, inv);
}

/* 8 values from float32 or bfloat16 (widened, exact) */
static inline __m256 load8(const void *p, int bf16, int64_t i) {
    return bf16 ? widen8_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* float32 bits rounded to the nearest even bfloat16, in the high half (NaN inputs are not expected here) */
static inline __m256i round8_bits(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
}

/* v rounded to bfloat16 and widened back (a no-op for float32) */
static inline __m256 round8(__m256 v, int bf16) {
    if (!bf16) return v;
    return _mm256_castsi256_ps(_mm256_and_si256(round8_bits(v), _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 values to float32, or rounded to bfloat16 */
static inline void store8(void *p, int bf16, int64_t i, __m256 v) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m256i hi = _mm256_srli_epi32(round8_bits(v), 16); /* 8 x 32-bit words, each < 2^16 */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}

/* r[i] = the sum of the 8 lanes of v[i], for 8 vectors */
static inline __m256 sum8x8(const __m256 *v) {
    __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* v0-v3's halves, then v4-v7's */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* The sum of 8 lanes by one fixed tree, 8 -> 4 -> 2 -> 1 (lane l + lane l + 4 first): the AVX-512 reductions'
 * last three steps, so sums through either instruction set can match */
static inline float sum8(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#endif

#endif
