/*
 * The torch path's elementwise work between the matmuls, one pass each, on the CPU (models/llama.py):
 * residual add + RMSNorm, SiLU(gate) * up, and RoPE on the fused q/k heads.
 *
 * On the torch path each of these is four to eight operators, each a pass over the whole batch with an
 * allocation and an OpenMP region of its own; for a 2048-token prompt step that was a tenth of the step.
 * Rows are split over torch's OpenMP threads; with AVX-512 a row (for RoPE, a head's half) goes 16 values at a time,
 * with AVX2 8 (what is left past the last whole vector, and a norm's whole row where its width is not a multiple of
 * the vector, takes the scalar loop). Arithmetic is float32; a bfloat16 result is rounded where the
 * torch path rounds it (the residual sum, the normalized row before the weight, the SiLU before the
 * product), so both paths agree up to the order of the mean's sum and the last bit of e^x.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "simd.h"

static inline float ld(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rnd(float x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline void st(void *p, int bf16, int64_t i, float x) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

static inline __attribute__((always_inline)) void norm_row(const void *x, void *residual, const void *weight,
                                                           void *out, int64_t base, int dim, float eps,
                                                           const int bf16)
{
#if defined(__AVX512F__)
    if (dim % 16 == 0) {
        /* with a residual, the rounded sum is stored there and read back; else x is read twice */
        const void *h = residual != 0 ? (const void *)residual : x;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < dim; i += 16) {
            __m512 v = load16(x, bf16, base + i);
            if (residual != 0) {
                v = round16(_mm512_add_ps(v, load16(residual, bf16, base + i)), bf16);
                store16(residual, bf16, base + i, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps));
        for (int i = 0; i < dim; i += 16) {
            __m512 n = round16(_mm512_mul_ps(load16(h, bf16, base + i), inv), bf16);
            store16(out, bf16, base + i, _mm512_mul_ps(load16(weight, bf16, i), n));
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (dim % 8 == 0) {
        const void *h = residual != 0 ? (const void *)residual : x;
        __m256 ss = _mm256_setzero_ps();
        for (int i = 0; i < dim; i += 8) {
            __m256 v = load8(x, bf16, base + i);
            if (residual != 0) {
                v = round8(_mm256_add_ps(v, load8(residual, bf16, base + i)), bf16);
                store8(residual, bf16, base + i, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 inv = _mm256_set1_ps(1.f / sqrtf(sum8(ss) / (float)dim + eps));
        for (int i = 0; i < dim; i += 8) {
            __m256 n = round8(_mm256_mul_ps(load8(h, bf16, base + i), inv), bf16);
            store8(out, bf16, base + i, _mm256_mul_ps(load8(weight, bf16, i), n));
        }
        return;
    }
#endif
    float ss = 0.f;
    for (int i = 0; i < dim; i++) {
        float v = ld(x, bf16, base + i);
        if (residual != 0) {
            v = rnd(v + ld(residual, bf16, base + i), bf16);
            st(residual, bf16, base + i, v);
        }
        ss += v * v;
    }
    float inv = 1.f / sqrtf(ss / (float)dim + eps);
    const void *h = residual != 0 ? (const void *)residual : x;
    for (int i = 0; i < dim; i++) st(out, bf16, base + i, ld(weight, bf16, i) * rnd(ld(h, bf16, base + i) * inv, bf16));
}

/* out = weight * rms_norm(x (+ residual)); with a residual, residual <- x + residual first. */
int tessera_add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int dim,
                         float eps, int bf16)
{
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) norm_row(x, residual, weight, out, r * dim, dim, eps, 1);
        else norm_row(x, residual, weight, out, r * dim, dim, eps, 0);
    }
    return 0;
}

static inline __attribute__((always_inline)) void silu_row(const void *gate_up, void *out, int64_t r, int inter,
                                                           const int bf16)
{
    int64_t in = r * 2 * (int64_t)inter, o = r * (int64_t)inter;
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inter; i += 16) {
        __m512 s = round16(silu16(load16(gate_up, bf16, in + i)), bf16);
        store16(out, bf16, o + i, _mm512_mul_ps(s, load16(gate_up, bf16, in + inter + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= inter; i += 8) {
        __m256 s = round8(silu8(load8(gate_up, bf16, in + i)), bf16);
        store8(out, bf16, o + i, _mm256_mul_ps(s, load8(gate_up, bf16, in + inter + i)));
    }
#endif
    for (; i < inter; i++) {
        float g = ld(gate_up, bf16, in + i);
        st(out, bf16, o + i, rnd(g / (1.f + expf(-g)), bf16) * ld(gate_up, bf16, in + inter + i));
    }
}

/* out[r, :] = silu(gate_up[r, :inter]) * gate_up[r, inter:] */
int tessera_silu_mul(const void *gate_up, void *out, int64_t rows, int inter, int bf16)
{
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) silu_row(gate_up, out, r, inter, 1);
        else silu_row(gate_up, out, r, inter, 0);
    }
    return 0;
}

/*
 * RoPE in place on the first `heads` heads of each row of qk (row stride `row_stride` elements, heads
 * head_dim apart): x1, x2 = halves; (x1 * cos - x2 * sin, x2 * cos + x1 * sin) with cos/sin float32
 * [positions, head_dim / 2] rows of the table at each row's position (rounded to bfloat16 first for bf16
 * rows, as the torch path's table is).
 */
int tessera_rope(void *qk, int64_t row_stride, const int64_t *positions, const float *cos_table,
                 const float *sin_table, int64_t rows, int heads, int head_dim, int bf16)
{
    int half = head_dim / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * half, *s = sin_table + positions[r] * half;
        for (int h = 0; h < heads; h++) {
            int64_t base = r * row_stride + (int64_t)h * head_dim;
            int i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= half; i += 16) {
                __m512 cc = round16(_mm512_loadu_ps(c + i), bf16), ss = round16(_mm512_loadu_ps(s + i), bf16);
                __m512 x1 = load16(qk, bf16, base + i), x2 = load16(qk, bf16, base + half + i);
                store16(qk, bf16, base + i, _mm512_fmsub_ps(x1, cc, _mm512_mul_ps(x2, ss)));
                store16(qk, bf16, base + half + i, _mm512_fmadd_ps(x2, cc, _mm512_mul_ps(x1, ss)));
            }
#elif defined(__AVX2__) && defined(__FMA__)
            for (; i + 8 <= half; i += 8) {
                __m256 cc = round8(_mm256_loadu_ps(c + i), bf16), ss = round8(_mm256_loadu_ps(s + i), bf16);
                __m256 x1 = load8(qk, bf16, base + i), x2 = load8(qk, bf16, base + half + i);
                store8(qk, bf16, base + i, _mm256_fmsub_ps(x1, cc, _mm256_mul_ps(x2, ss)));
                store8(qk, bf16, base + half + i, _mm256_fmadd_ps(x2, cc, _mm256_mul_ps(x1, ss)));
            }
#endif
            for (; i < half; i++) {
                float x1 = ld(qk, bf16, base + i), x2 = ld(qk, bf16, base + half + i);
                float cc = rnd(c[i], bf16), ss = rnd(s[i], bf16);
                st(qk, bf16, base + i, x1 * cc - x2 * ss);
                st(qk, bf16, base + half + i, x2 * cc + x1 * ss);
            }
        }
    }
    return 0;
}
