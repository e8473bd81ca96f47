/*
 * The two passes around W8A8's int8 matmul (common/engine/quantization.py), on the CPU:
 *
 *   tessera_quantize_rows:   x [m, k] (float32 or bfloat16) -> q [m, k] int8 and scale [m] float32, symmetric
 *                            per row: scale = max|x_row| / 127 (at least 1e-8 / 127), q = round(x / scale),
 *                            half to even as torch.round.
 *   tessera_dequantize_rows: acc [m, n] int32 (torch._int_mm's sums) -> out [m, n] = acc * xs[row] * ws[col]
 *                            (+ bias[col]), rounded once to out's dtype.
 *   tessera_silu_mul_quantize: the MLP's middle in one pass, from gate_up's int32 sums [m, 2 * inter] to
 *                            down_proj's int8 input: gate and up dequantized (as above, in float32),
 *                            a = silu(gate) * up, then a quantized per row as tessera_quantize_rows does. Neither
 *                            gate_up's output nor a is ever written out.
 *
 * At tensor parallelism a row-parallel layer's input row is split over the ranks, and each must quantize its slice
 * with the whole row's scale, as one process would: tessera_quantize_rows_absmax quantizes as tessera_quantize_rows
 * from a given max|x_row| (the max over ranks), and tessera_silu_mul_rows writes the MLP's middle a (float32) for
 * it, as tessera_silu_mul_quantize computes it.
 *
 * Done with torch operators these were six passes over the batch, each with an allocation, and at 512 rows
 * they cost more than the int8 matmul saved (docs/history/benchmarks-rounds.md, "int8 at saturation").
 * Rows are split over torch's OpenMP threads; with AVX-512 a row goes 16 values at a time, and widths that
 * are not a multiple of 16 take the scalar loop for the rest.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "simd.h"

#define MIN_ABSMAX 1e-8f

static inline float ld(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline int8_t q8(float v) { return (int8_t)fminf(127.f, fmaxf(-127.f, nearbyintf(v))); }

static inline __attribute__((always_inline)) float row_absmax(const void *x, int64_t base, int k, const int bf16)
{
    int i = 0;
    float amax = 0.f;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x, bf16, base + i)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < k; i++) amax = fmaxf(amax, fabsf(ld(x, bf16, base + i)));
    return amax;
}

/* q = round(x / s) with s = max(amax, MIN_ABSMAX) / 127, written to *scale */
static inline __attribute__((always_inline)) void quantize_row_at(const void *x, int8_t *q, float *scale, float amax,
                                                                  int64_t base, int k, const int bf16)
{
    float s = fmaxf(amax, MIN_ABSMAX) / 127.f;
    float inv = 1.f / s;
    *scale = s;
    int i = 0;
#if defined(__AVX512F__)
    __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= k; i += 16) {
        __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, bf16, base + i), vinv)); /* nearest even */
        _mm_storeu_si128((__m128i *)(q + base + i), _mm512_cvtsepi32_epi8(r));
    }
#endif
    for (; i < k; i++) q[base + i] = q8(ld(x, bf16, base + i) * inv);
}

static inline __attribute__((always_inline)) void quantize_row(const void *x, int8_t *q, float *scale,
                                                               int64_t base, int k, const int bf16)
{
    quantize_row_at(x, q, scale, row_absmax(x, base, k, bf16), base, k, bf16);
}

int tessera_quantize_rows(const void *x, int8_t *q, float *scale, int64_t m, int k, int bf16)
{
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        if (bf16) quantize_row(x, q, scale + r, r * k, k, 1);
        else quantize_row(x, q, scale + r, r * k, k, 0);
    }
    return 0;
}

/* absmax [m]: each row's max|x| over its whole width (at tensor parallelism, the max over the ranks' slices) */
int tessera_quantize_rows_absmax(const void *x, int8_t *q, const float *absmax, float *scale, int64_t m, int k,
                                 int bf16)
{
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        if (bf16) quantize_row_at(x, q, scale + r, absmax[r], r * k, k, 1);
        else quantize_row_at(x, q, scale + r, absmax[r], r * k, k, 0);
    }
    return 0;
}

static inline __attribute__((always_inline)) void dequantize_row(const int32_t *acc, float xs, const float *ws,
                                                                 const void *bias, void *out, int64_t base,
                                                                 int n, const int bf16)
{
    int j = 0;
#if defined(__AVX512F__)
    __m512 vxs = _mm512_set1_ps(xs);
    for (; j + 16 <= n; j += 16) {
        __m512 a = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(acc + base + j)));
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(a, vxs), _mm512_loadu_ps(ws + j));
        if (bias != 0) v = _mm512_add_ps(v, load16(bias, bf16, j));
        store16(out, bf16, base + j, v);
    }
#endif
    for (; j < n; j++) {
        float v = (float)acc[base + j] * xs * ws[j] + (bias != 0 ? ld(bias, bf16, j) : 0.f);
        if (bf16) ((uint16_t *)out)[base + j] = f32_to_bf16(v);
        else ((float *)out)[base + j] = v;
    }
}

int tessera_dequantize_rows(const int32_t *acc, const float *xs, const float *ws, const void *bias, void *out,
                            int64_t m, int n, int bf16)
{
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        if (bf16) dequantize_row(acc, xs[r], ws, bias, out, r * n, n, 1);
        else dequantize_row(acc, xs[r], ws, bias, out, r * n, n, 0);
    }
    return 0;
}

/* silu(gate) * up of one row, gate and up dequantized from acc (row width 2 * inter), into a (float32) */
static void silu_mul_row(const int32_t *acc, float xs, const float *ws, const float *bias, float *a, int inter)
{
    int i = 0;
#if defined(__AVX512F__)
    __m512 vxs = _mm512_set1_ps(xs);
    for (; i + 16 <= inter; i += 16) {
        __m512 g = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(acc + i))), vxs),
                                 _mm512_loadu_ps(ws + i));
        __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(acc + inter + i))),
                                               vxs), _mm512_loadu_ps(ws + inter + i));
        if (bias != 0) {
            g = _mm512_add_ps(g, _mm512_loadu_ps(bias + i));
            u = _mm512_add_ps(u, _mm512_loadu_ps(bias + inter + i));
        }
        __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        __m512 inv = _mm512_rcp14_ps(d); /* 1/d to 14 bits, one Newton step to full float32 */
        inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_mul_ps(g, inv), u));
    }
#endif
    for (; i < inter; i++) {
        float g = (float)acc[i] * xs * ws[i] + (bias != 0 ? bias[i] : 0.f);
        float u = (float)acc[inter + i] * xs * ws[inter + i] + (bias != 0 ? bias[inter + i] : 0.f);
        a[i] = g / (1.f + expf(-g)) * u;
    }
}

/* bias: float32 [2 * inter] or NULL; scratch: float32 [threads, inter], one row per OpenMP thread */
int tessera_silu_mul_quantize(const int32_t *acc, const float *xs, const float *ws, const float *bias, int8_t *q,
                              float *scale, float *scratch, int64_t m, int inter, int threads)
{
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < m; r++) {
        float *a = scratch + (int64_t)omp_get_thread_num() * inter;
        silu_mul_row(acc + r * 2 * (int64_t)inter, xs[r], ws, bias, a, inter);
        quantize_row(a, q + r * (int64_t)inter, scale + r, 0, inter, 0);
    }
    return 0;
}

/* a [m, inter] float32: tessera_silu_mul_quantize's a, written out (bias as there) */
int tessera_silu_mul_rows(const int32_t *acc, const float *xs, const float *ws, const float *bias, float *a,
                          int64_t m, int inter)
{
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) silu_mul_row(acc + r * 2 * (int64_t)inter, xs[r], ws, bias, a + r * inter, inter);
    return 0;
}
