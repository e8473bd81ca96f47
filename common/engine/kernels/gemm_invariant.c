/*
 * y = x @ w^T (+ bias) in which every output is a fixed function of its own x row and w row, for any row
 * count: the batch-invariant matmul of engine.deterministic (common/engine/models/llama.py `linear`).
 *
 *   tessera_gemm_invariant(x [m, k], w [n, k] (row-major, as nn.Linear keeps it), bias [n] or NULL,
 *                          y [m, n], m, n, k, is_bf16)
 *
 * torch's matmul picks its kernel, blocking and (for few rows) split of the sum by the row count and the
 * thread count, so one row's result changes with what else is in its batch: in bfloat16 that flips greedy
 * tokens, and a sequence recomputed by a prompt step after a failover does not continue as its decode steps
 * did. Here each output y[r][j] is always the same sequence of operations: sixteen float32 lanes accumulate
 * x[r] . w[j] over k in order, 32 bfloat16 products (AVX512-BF16 dot products) or 16 float32 products (FMA)
 * per step, the masked tail last; then one fixed tree adds the lanes, then the bias; bfloat16 output rounds to
 * nearest even. The row count only chooses how many rows share a weight tile (4 by 4 tiles, so each weight
 * load serves four rows); threads split the weight rows, never a sum. Built without fast-math (native.py) so
 * that the compiler cannot reorder a sum differently in two copies of the tile.
 *
 * With AVX2 and FMA (no AVX-512) the sixteen lanes are two 8-float registers, each lane summing the same
 * products in the same order with the same FMAs, the tail zero-padded as the masked loads pad it: so float32,
 * and bfloat16 on a CPU without AVX512-BF16, give the AVX-512 paths' bits, and workers of a cluster agree across
 * those hosts (bfloat16 with AVX512-BF16 dot products gives other bits: a cluster mixing it with them does not).
 * Tiles of 4 rows by 3 weight rows sum each output's lanes 0-7 and 8-15 in separate passes (12 sums in the
 * sixteen registers: `tile_halves`); a single row takes 4 weight rows at a time, both halves at once, prefetching.
 * Elsewhere (or built with TESSERA_PORTABLE, which the tests compare the vector paths with) a portable loop does
 * the same operations one lane at a time, far slower.
 */
#include <stdint.h>

#include <math.h>
#include <stdlib.h>

#include "bf16.h"
#include "simd.h"

#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(TESSERA_PORTABLE)
#include <immintrin.h>
#endif

#define TILE_M 4
#define TILE_N 4
#define BLOCK_N 64 /* weight rows per work item: 64 x k bf16 stays in L2 while every row tile passes */

#if defined(__AVX512F__) && !defined(TESSERA_PORTABLE)
/* The fixed tree: 16 lanes -> 8 -> 4 -> 2 -> 1 */
static inline float lanes_sum(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

static inline void store_out(void *y, int is_bf16, int64_t at, float s, const void *bias, int64_t j) {
    if (bias != 0) s += is_bf16 ? bf16_to_f32(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
    if (is_bf16) ((uint16_t *)y)[at] = f32_to_bf16(s);
    else ((float *)y)[at] = s;
}

/* 16 bf16 widened to float32 (exact) */
static inline __m512 widen16(const uint16_t *p, __mmask16 mask) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

/* The full 4 x 4 tile with its sixteen sums in registers: the same operations, per output, as `tile`. */
#if defined(__AVX512BF16__)
#define DOT4(a, xv) acc##a##0 = _mm512_dpbf16_ps(acc##a##0, xv, w0); acc##a##1 = _mm512_dpbf16_ps(acc##a##1, xv, w1); \
    acc##a##2 = _mm512_dpbf16_ps(acc##a##2, xv, w2); acc##a##3 = _mm512_dpbf16_ps(acc##a##3, xv, w3);
static inline __attribute__((always_inline)) void tile4x4_bf16(
    const uint16_t *xs, const uint16_t *ws, const void *bias, void *y, int64_t r0, int64_t j0, int64_t n, int64_t k)
{
    __m512 acc00 = _mm512_setzero_ps(), acc01 = acc00, acc02 = acc00, acc03 = acc00, acc10 = acc00, acc11 = acc00,
           acc12 = acc00, acc13 = acc00, acc20 = acc00, acc21 = acc00, acc22 = acc00, acc23 = acc00, acc30 = acc00,
           acc31 = acc00, acc32 = acc00, acc33 = acc00;
    for (int64_t i = 0; i < k; i += 32) {
        __mmask32 mask = k - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - i)) - 1u);
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + i);
        __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + k + i);
        __m512bh w2 = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + 2 * k + i);
        __m512bh w3 = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + 3 * k + i);
        __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + i);
        DOT4(0, x0)
        __m512bh x1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + k + i);
        DOT4(1, x1)
        __m512bh x2 = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + 2 * k + i);
        DOT4(2, x2)
        __m512bh x3 = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + 3 * k + i);
        DOT4(3, x3)
    }
    __m512 acc[4][4] = {{acc00, acc01, acc02, acc03}, {acc10, acc11, acc12, acc13},
                        {acc20, acc21, acc22, acc23}, {acc30, acc31, acc32, acc33}};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) store_out(y, 1, (r0 + a) * n + j0 + b, lanes_sum(acc[a][b]), bias, j0 + b);
}
#undef DOT4

/* One row against four weight rows, the four sums in registers, the weight rows a few tiles ahead prefetched
 * into L2 (a decode step's few rows are bound by reading the weights once). */
#define PREFETCH_AHEAD 4
static inline __attribute__((always_inline)) void tile1x4_bf16(
    const uint16_t *xs, const uint16_t *ws, const void *bias, void *y, int64_t r0, int64_t j0, int64_t n, int64_t k)
{
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t i = 0; i < k; i += 32) {
        for (int b = 0; b < 4; b++) __builtin_prefetch(ws + (int64_t)(4 * PREFETCH_AHEAD + b) * k + i, 0, 2);
        __mmask32 mask = k - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - i)) - 1u);
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + i);
        acc0 = _mm512_dpbf16_ps(acc0, xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + i));
        acc1 = _mm512_dpbf16_ps(acc1, xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + k + i));
        acc2 = _mm512_dpbf16_ps(acc2, xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + 2 * k + i));
        acc3 = _mm512_dpbf16_ps(acc3, xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + 3 * k + i));
    }
    store_out(y, 1, r0 * n + j0, lanes_sum(acc0), bias, j0);
    store_out(y, 1, r0 * n + j0 + 1, lanes_sum(acc1), bias, j0 + 1);
    store_out(y, 1, r0 * n + j0 + 2, lanes_sum(acc2), bias, j0 + 2);
    store_out(y, 1, r0 * n + j0 + 3, lanes_sum(acc3), bias, j0 + 3);
}
#endif

/* float32: the full 4 x 4 tile in registers */
#define FMA4(a, xv) acc##a##0 = _mm512_fmadd_ps(xv, w0, acc##a##0); acc##a##1 = _mm512_fmadd_ps(xv, w1, acc##a##1); \
    acc##a##2 = _mm512_fmadd_ps(xv, w2, acc##a##2); acc##a##3 = _mm512_fmadd_ps(xv, w3, acc##a##3);
static inline __attribute__((always_inline)) void tile4x4_f32(
    const float *xs, const float *ws, const void *bias, void *y, int64_t r0, int64_t j0, int64_t n, int64_t k)
{
    __m512 acc00 = _mm512_setzero_ps(), acc01 = acc00, acc02 = acc00, acc03 = acc00, acc10 = acc00, acc11 = acc00,
           acc12 = acc00, acc13 = acc00, acc20 = acc00, acc21 = acc00, acc22 = acc00, acc23 = acc00, acc30 = acc00,
           acc31 = acc00, acc32 = acc00, acc33 = acc00;
    for (int64_t i = 0; i < k; i += 16) {
        __mmask16 mask = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1u);
        __m512 w0 = _mm512_maskz_loadu_ps(mask, ws + i), w1 = _mm512_maskz_loadu_ps(mask, ws + k + i);
        __m512 w2 = _mm512_maskz_loadu_ps(mask, ws + 2 * k + i), w3 = _mm512_maskz_loadu_ps(mask, ws + 3 * k + i);
        __m512 x0 = _mm512_maskz_loadu_ps(mask, xs + i);
        FMA4(0, x0)
        __m512 x1 = _mm512_maskz_loadu_ps(mask, xs + k + i);
        FMA4(1, x1)
        __m512 x2 = _mm512_maskz_loadu_ps(mask, xs + 2 * k + i);
        FMA4(2, x2)
        __m512 x3 = _mm512_maskz_loadu_ps(mask, xs + 3 * k + i);
        FMA4(3, x3)
    }
    __m512 acc[4][4] = {{acc00, acc01, acc02, acc03}, {acc10, acc11, acc12, acc13},
                        {acc20, acc21, acc22, acc23}, {acc30, acc31, acc32, acc33}};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) store_out(y, 0, (r0 + a) * n + j0 + b, lanes_sum(acc[a][b]), bias, j0 + b);
}
#undef FMA4

/* One tile of mr x nr outputs (mr <= TILE_M, nr <= TILE_N): the edges, and float32. */
static inline void tile(
    const void *x, const void *w, const void *bias, void *y, int64_t r0, int64_t j0, int mr, int nr,
    int64_t n, int64_t k, const int is_bf16)
{
    __m512 acc[TILE_M][TILE_N];
    for (int a = 0; a < TILE_M; a++)
        for (int b = 0; b < TILE_N; b++) acc[a][b] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (is_bf16) {
        const uint16_t *xs = (const uint16_t *)x + r0 * k, *ws = (const uint16_t *)w + j0 * k;
        for (int64_t i = 0; i < k; i += 32) {
            __mmask32 mask = k - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - i)) - 1u);
            __m512bh wv[TILE_N];
            for (int b = 0; b < nr; b++) wv[b] = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + b * k + i);
            for (int a = 0; a < mr; a++) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + a * k + i);
                for (int b = 0; b < nr; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], xv, wv[b]);
            }
        }
        goto done;
    }
#endif
    for (int64_t i = 0; i < k; i += 16) {
        __mmask16 mask = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1u);
        __m512 wv[TILE_N];
        for (int b = 0; b < nr; b++)
            wv[b] = is_bf16 ? widen16((const uint16_t *)w + (j0 + b) * k + i, mask)
                            : _mm512_maskz_loadu_ps(mask, (const float *)w + (j0 + b) * k + i);
        for (int a = 0; a < mr; a++) {
            __m512 xv = is_bf16 ? widen16((const uint16_t *)x + (r0 + a) * k + i, mask)
                                : _mm512_maskz_loadu_ps(mask, (const float *)x + (r0 + a) * k + i);
            for (int b = 0; b < nr; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
        }
    }
#if defined(__AVX512BF16__)
done:
#endif
    for (int a = 0; a < mr; a++)
        for (int b = 0; b < nr; b++) store_out(y, is_bf16, (r0 + a) * n + j0 + b, lanes_sum(acc[a][b]), bias, j0 + b);
}

static int gemm(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                const int is_bf16)
{
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j1 = 0; j1 < n; j1 += BLOCK_N) {
        int64_t j_end = j1 + BLOCK_N < n ? j1 + BLOCK_N : n;
        for (int64_t r0 = 0; r0 < m; r0 += TILE_M) {
            int mr = m - r0 < TILE_M ? (int)(m - r0) : TILE_M;
            for (int64_t j0 = j1; j0 < j_end; j0 += TILE_N) {
                int nr = j_end - j0 < TILE_N ? (int)(j_end - j0) : TILE_N;
                if (nr == TILE_N && mr == TILE_M && !is_bf16) {
                    tile4x4_f32((const float *)x + r0 * k, (const float *)w + j0 * k, bias, y, r0, j0, n, k);
                    continue;
                }
#if defined(__AVX512BF16__)
                if (is_bf16 && nr == TILE_N && mr == TILE_M) {
                    tile4x4_bf16((const uint16_t *)x + r0 * k, (const uint16_t *)w + j0 * k, bias, y, r0, j0, n, k);
                    continue;
                }
                if (is_bf16 && nr == TILE_N) { /* the rows past the last full tile, one at a time */
                    for (int a = 0; a < mr; a++)
                        tile1x4_bf16((const uint16_t *)x + (r0 + a) * k, (const uint16_t *)w + j0 * k, bias, y,
                                     r0 + a, j0, n, k);
                    continue;
                }
#endif
                tile(x, w, bias, y, r0, j0, mr, nr, n, k, is_bf16);
            }
        }
    }
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(TESSERA_PORTABLE)
static inline float elem(const void *p, const int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The fixed tree of the AVX-512 paths, over lanes 0-7 (lo) and 8-15 (hi): 16 -> 8 -> 4 -> 2 -> 1 */
static inline float lanes_sum(__m256 lo, __m256 hi) {
    return sum8(_mm256_add_ps(lo, hi));
}

static inline void store_out(void *y, int is_bf16, int64_t at, float s, const void *bias, int64_t j) {
    if (bias != 0) s += elem(bias, is_bf16, j);
    if (is_bf16) ((uint16_t *)y)[at] = f32_to_bf16(s);
    else ((float *)y)[at] = s;
}

#define PREFETCH_AHEAD 4 /* weight tiles ahead of a single row's tile, prefetched into L2 */

/* One row r against nr (<= 4, a constant once inlined) weight rows from j0, each output a pair of 8-lane sums (8 of
 * the sixteen registers), the weights prefetched ahead: a decode step's single row streams them from memory.
 * xf: the x rows in float32 (bfloat16 ones widened once, by gemm) */
static inline __attribute__((always_inline)) void tile_row(
    const float *xf, const void *w, const void *bias, void *y, int64_t r, int64_t j0, int64_t n, int64_t k,
    const int nr, const int is_bf16)
{
    __m256 lo[4], hi[4];
#pragma GCC unroll 4
    for (int b = 0; b < nr; b++) lo[b] = hi[b] = _mm256_setzero_ps();
    const int64_t full = k - k % 16, es = is_bf16 ? 2 : 4;
    const char *wbase = (const char *)w + j0 * k * es;
    const float *xr = xf + r * k;
    for (int64_t i = 0; i < full; i += 16) {
#pragma GCC unroll 4
        for (int b = 0; b < nr; b++) __builtin_prefetch(wbase + ((PREFETCH_AHEAD * nr + b) * k + i) * es, 0, 2);
        const __m256 xl = _mm256_loadu_ps(xr + i), xh = _mm256_loadu_ps(xr + i + 8);
#pragma GCC unroll 4
        for (int b = 0; b < nr; b++) {
            lo[b] = _mm256_fmadd_ps(xl, load8(w, is_bf16, (j0 + b) * k + i), lo[b]);
            hi[b] = _mm256_fmadd_ps(xh, load8(w, is_bf16, (j0 + b) * k + i + 8), hi[b]);
        }
    }
    if (full < k) { /* the tail, zero-padded to sixteen as the AVX-512 paths' masked loads pad it */
        float xt[16], wt[4][16];
        for (int l = 0; l < 16; l++) xt[l] = full + l < k ? xr[full + l] : 0.f;
        for (int b = 0; b < nr; b++)
            for (int l = 0; l < 16; l++) wt[b][l] = full + l < k ? elem(w, is_bf16, (j0 + b) * k + full + l) : 0.f;
        for (int b = 0; b < nr; b++) {
            lo[b] = _mm256_fmadd_ps(_mm256_loadu_ps(xt), _mm256_loadu_ps(wt[b]), lo[b]);
            hi[b] = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 8), _mm256_loadu_ps(wt[b] + 8), hi[b]);
        }
    }
    for (int b = 0; b < nr; b++) store_out(y, is_bf16, r * n + j0 + b, lanes_sum(lo[b], hi[b]), bias, j0 + b);
}

#define HALF_CHUNK 512 /* k per pass of a half: a 4-row by 3-weight-row tile's chunk (14 KB in float32) stays in L1 */

/* mr x nr outputs of several rows (constants once inlined: mr <= 4, nr <= 3), each output's lanes 0-7 and 8-15
 * summed in separate passes over a chunk of k (a lane's products stay in order: lanes never meet before the tree),
 * so one 8-float register per output: 12 sums, 3 weight vectors and an x vector in the sixteen registers, and 7
 * loads for 12 FMAs (2 x 3 tiles holding both halves need 10). Between passes the sums wait in memory. */
static inline __attribute__((always_inline)) void tile_halves(
    const float *xf, const void *w, const void *bias, void *y, int64_t r0, int64_t j0, int64_t n, int64_t k,
    const int mr, const int nr, const int is_bf16)
{
    __m256 sums[2][4][3];
#pragma GCC unroll 4
    for (int a = 0; a < mr; a++)
#pragma GCC unroll 3
        for (int b = 0; b < nr; b++) sums[0][a][b] = sums[1][a][b] = _mm256_setzero_ps();
    const int64_t full = k - k % 16;
    for (int64_t c = 0; c < full; c += HALF_CHUNK) {
        const int64_t end = c + HALF_CHUNK < full ? c + HALF_CHUNK : full;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256 s[4][3];
#pragma GCC unroll 4
            for (int a = 0; a < mr; a++)
#pragma GCC unroll 3
                for (int b = 0; b < nr; b++) s[a][b] = sums[h][a][b];
            for (int64_t i = c + 8 * h; i < end; i += 16) {
                __m256 wv[3];
#pragma GCC unroll 3
                for (int b = 0; b < nr; b++) wv[b] = load8(w, is_bf16, (j0 + b) * k + i);
#pragma GCC unroll 4
                for (int a = 0; a < mr; a++) {
                    const __m256 xv = _mm256_loadu_ps(xf + (r0 + a) * k + i);
#pragma GCC unroll 3
                    for (int b = 0; b < nr; b++) s[a][b] = _mm256_fmadd_ps(xv, wv[b], s[a][b]);
                }
            }
#pragma GCC unroll 4
            for (int a = 0; a < mr; a++)
#pragma GCC unroll 3
                for (int b = 0; b < nr; b++) sums[h][a][b] = s[a][b];
        }
    }
    if (full < k) { /* the tail, zero-padded to sixteen as the AVX-512 paths' masked loads pad it */
        float xt[4][16], wt[3][16];
        for (int a = 0; a < mr; a++)
            for (int l = 0; l < 16; l++) xt[a][l] = full + l < k ? xf[(r0 + a) * k + full + l] : 0.f;
        for (int b = 0; b < nr; b++)
            for (int l = 0; l < 16; l++) wt[b][l] = full + l < k ? elem(w, is_bf16, (j0 + b) * k + full + l) : 0.f;
        for (int h = 0; h < 2; h++)
            for (int a = 0; a < mr; a++)
                for (int b = 0; b < nr; b++)
                    sums[h][a][b] = _mm256_fmadd_ps(_mm256_loadu_ps(xt[a] + 8 * h), _mm256_loadu_ps(wt[b] + 8 * h),
                                                    sums[h][a][b]);
    }
    for (int a = 0; a < mr; a++)
        for (int b = 0; b < nr; b++)
            store_out(y, is_bf16, (r0 + a) * n + j0 + b, lanes_sum(sums[0][a][b], sums[1][a][b]), bias, j0 + b);
}

/* rows [r0, r0 + mr) (mr <= 4) against the weight rows [j1, j_end): tiles of 3 weight rows, then one at a time */
static inline __attribute__((always_inline)) void row_tiles(
    const float *xf, const void *w, const void *bias, void *y, int64_t r0, int64_t n, int64_t k, int64_t j1,
    int64_t j_end, const int mr, const int is_bf16)
{
    int64_t j0 = j1;
    for (; j0 + 3 <= j_end; j0 += 3) tile_halves(xf, w, bias, y, r0, j0, n, k, mr, 3, is_bf16);
    for (; j0 < j_end; j0++) tile_halves(xf, w, bias, y, r0, j0, n, k, mr, 1, is_bf16);
}

/* One block of weight rows [j1, j_end) against every row: 4-row tiles, then the 2 or 3 rows left over; a single
 * row (a decode step's, or one left over) in tiles of 4 weight rows that prefetch the weights ahead. */
static inline __attribute__((always_inline)) void block(
    const float *xf, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t j1,
    int64_t j_end, const int is_bf16)
{
    int64_t r0 = 0;
    for (; r0 + 4 <= m; r0 += 4) row_tiles(xf, w, bias, y, r0, n, k, j1, j_end, 4, is_bf16);
    if (m - r0 == 3) row_tiles(xf, w, bias, y, r0, n, k, j1, j_end, 3, is_bf16);
    else if (m - r0 == 2) row_tiles(xf, w, bias, y, r0, n, k, j1, j_end, 2, is_bf16);
    else if (m - r0 == 1) {
        int64_t j0 = j1;
        for (; j0 + 4 <= j_end; j0 += 4) tile_row(xf, w, bias, y, r0, j0, n, k, 4, is_bf16);
        for (; j0 < j_end; j0++) tile_row(xf, w, bias, y, r0, j0, n, k, 1, is_bf16);
    }
}

static int gemm(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                const int is_bf16)
{
    float *widened = NULL; /* bfloat16 x rows in float32 (exact): read by every tile of every weight block */
    if (is_bf16) {
        widened = malloc(sizeof(float) * (size_t)(m * k));
        if (widened == NULL) return -2;
        for (int64_t i = 0; i < m * k; i++) widened[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    const float *xf = is_bf16 ? widened : (const float *)x;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j1 = 0; j1 < n; j1 += BLOCK_N) {
        int64_t j_end = j1 + BLOCK_N < n ? j1 + BLOCK_N : n;
        if (is_bf16) block(xf, w, bias, y, m, n, k, j1, j_end, 1);
        else block(xf, w, bias, y, m, n, k, j1, j_end, 0);
    }
    free(widened);
    return 0;
}
#else
/* Portable: sixteen float32 lanes, each summing every sixteenth product in order with an FMA (the tail padded
 * with zeros to sixteen), then the same tree: the vector paths' operations, one lane at a time. */
static int gemm(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                const int is_bf16)
{
    const int64_t padded = (k + 15) / 16 * 16;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < m; r++) {
            float lane[16] = {0};
            for (int64_t i = 0; i < padded; i++) {
                float xv = i >= k ? 0.f : is_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * k + i])
                                                  : ((const float *)x)[r * k + i];
                float wv = i >= k ? 0.f : is_bf16 ? bf16_to_f32(((const uint16_t *)w)[j * k + i])
                                                  : ((const float *)w)[j * k + i];
                lane[i % 16] = fmaf(xv, wv, lane[i % 16]);
            }
            for (int width = 8; width >= 1; width /= 2)
                for (int l = 0; l < width; l++) lane[l] += lane[l + width];
            float s = lane[0];
            if (bias != 0) s += is_bf16 ? bf16_to_f32(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
            if (is_bf16) ((uint16_t *)y)[r * n + j] = f32_to_bf16(s);
            else ((float *)y)[r * n + j] = s;
        }
    }
    return 0;
}
#endif

/* x, w, bias and y all bfloat16 (is_bf16) or all float32. Returns -1 (writing nothing) for an empty shape, -2 where
 * the widened copy of bfloat16 rows could not be allocated. */
int tessera_gemm_invariant(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n,
                           int64_t k, int is_bf16)
{
    if (m < 1 || n < 1 || k < 1) return -1;
    return gemm(x, w, bias, y, m, n, k, is_bf16);
}
