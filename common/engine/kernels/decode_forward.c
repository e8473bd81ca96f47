/*
 * The whole decoder forward for the decode rows of a step (M <= MAX_ROWS) in one call, on the CPU.
 *
 * At small batch a decode step is bound by reading the weights once, and the
 * torch path spends as long again in the ~40 small operators per layer
 * between the matmuls (Python dispatch, allocations, one OpenMP region each).
 * Here one OpenMP region runs every layer: the threads split each linear
 * layer's output rows and each (row, kv head) of attention, and meet at a
 * barrier between phases. No Python runs between kernels.
 *
 * Per layer, for each row: RMSNorm -> fused QKV (+bias) -> per-head q/k norm
 * (Qwen3) -> RoPE -> K/V written into the paged pool -> paged attention ->
 * o_proj added to the residual -> RMSNorm -> fused gate/up -> SiLU(gate) * up
 * -> down_proj added to the residual. Then the final RMSNorm.
 *
 * Weights are float32, bfloat16, or int8 with one float32 scale per output
 * row (symmetric). An int8 layer's input row is rounded to int16 steps of its
 * own range (15 bits: ``to_int16_rows``) and its products summed in integers,
 * exactly, the weights widened to int16 in registers: the scales are applied
 * to each whole sum, so an int8 output does not depend on the step's other
 * rows, the threads or the instruction set.
 * Activations, the residual stream and every float sum stay in float32 inside
 * the call; the K/V written to the pool and the final hidden state take the
 * model dtype (bfloat16 rounds to nearest even), or the K/V an int8 pool's rows
 * (D_POOL_INT8: kv_int8.h, whose attention then reads them).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "kv_int8.h"
#include "panels_bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef MAX_ROWS
#define MAX_ROWS 256 /* decode steps: up to 64 rows (engine.cpu.decode_kernel_max_batch), int8 weights 8, float32
                        * 8 (16 on AVX2 without AVX-512: common/engine/models/llama.py); engine.deterministic:
                        * every row of a step, in calls of up to 256 rows (64 went over the weights 4 times as
                        * often: 0.89-0.94x the mode-off throughput against 0.95-1.01x at 135M,
                        * bench.deterministic) */
#endif
#define MAX_K 16384

/* W_BF16_PANELS: bf16 in panels_bf16.h's panel layout (common/engine/models/llama.py ``pack_panels``) */
/* W_BF16_COMPACT: the same in compact_panels.h's lossless 12.25 bits a weight (common/engine/compact_panels.py) */
enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_BF16_PANELS = 3, W_BF16_COMPACT = 4 };
#define IN_PANELS(wtype) ((wtype) == W_BF16_PANELS || (wtype) == W_BF16_COMPACT)
#define X_IN_BF16(wtype) ((wtype) == W_BF16 || IN_PANELS(wtype)) /* bf16 weights: x rounded to bf16 */

/* Fields of one layer's entry in the layer table (int64 each; pointers as addresses, 0 for none). */
enum {
    F_IN_NORM, F_POST_NORM, F_Q_NORM, F_K_NORM,
    F_QKV_W, F_QKV_SCALE, F_QKV_BIAS,
    F_O_W, F_O_SCALE, F_O_BIAS,
    F_GU_W, F_GU_SCALE, F_GU_BIAS,
    F_DOWN_W, F_DOWN_SCALE, F_DOWN_BIAS,
    F_K_OFFSET, F_V_OFFSET,
    NUM_FIELDS
};

/* Shapes, in the dims array. */
enum {
    D_ROWS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_BLOCK_SIZE, D_MAX_BLOCKS,
    D_ACT_BF16, D_WEIGHT_TYPE, D_BLOCK_STRIDE, D_POOL_INT8, NUM_DIMS
};

static inline float act_at(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#define ROW_BLOCK 4 /* weight rows per work item: four independent sums per x row keep the FMA units busy */
/* From this many x rows, bf16 weights go through dot_block_bf16 (up to X_BLOCK x rows against a block of weight
 * rows) instead of one x row at a time: 6-8 rows 10-40% faster, 2-4 rows 5% slower (Zen 4). */
#ifndef BLOCKED_ROWS_MIN
#define BLOCKED_ROWS_MIN 5
#endif
/* x rows per pass over a block of weight rows: 6 x 4 sums in registers, 10 loads for 24 products. With 4 x rows
 * (8 loads for 16), Zen 4's loads were the bound: at the 135M shape 6 rows made the linears of a 16-32 row step
 * 10-13% faster, at the 1B shape 4-12%. Each sum is the same either way (one accumulator per x row and weight
 * row, reduced by the same tree), so the row count per pass never changes a result. */
#define X_BLOCK 6
/* The weight rows W_PREFETCH_AHEAD blocks ahead are prefetched into L2 (prefetcht1) as a block is read. The
 * hardware prefetchers alone left a 1-row step at 20 GB/s of the weights on Zen 4; with this, 27 GB/s, and an
 * 8-row step went from 16 to 9 ms (an L1 prefetch helped far less: it holds one of L1's few miss buffers). */
#ifndef W_PREFETCH_AHEAD
#define W_PREFETCH_AHEAD 4 /* weight blocks */
#endif
#ifndef W_PREFETCH_LOCALITY
#define W_PREFETCH_LOCALITY 2 /* __builtin_prefetch's locality: 2 is prefetcht1 */
#endif

/* Dot products of one x row (float32, and bfloat16 in xb when the weights are bf16) with ROW_BLOCK float32 or
 * bf16 weight rows starting at row j; nb < ROW_BLOCK rows at the end of a matrix (int8: linear_rows_int8). */
static inline void dot_rows(const float *xr, const uint16_t *xb, const void *w, int wtype, int64_t j, int nb,
                            int k, float *sums)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (wtype == W_BF16 && nb == ROW_BLOCK && k % 32 == 0) {
        /* 32 bf16 products per instruction, summed in float32: the weights are read as they are */
        const uint16_t *w0 = (const uint16_t *)w + j * k;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < k; i += 32) {
            if (W_PREFETCH_AHEAD > 0)
                for (int b = 0; b < ROW_BLOCK; b++)
                    __builtin_prefetch(w0 + (int64_t)(W_PREFETCH_AHEAD * ROW_BLOCK + b) * k + i, 0, W_PREFETCH_LOCALITY);
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i);
            a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_loadu_si512(w0 + i));
            a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_loadu_si512(w0 + k + i));
            a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_loadu_si512(w0 + 2 * k + i));
            a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_loadu_si512(w0 + 3 * k + i));
        }
        /* reduced by dot_block_bf16's tree (sum16x16), not _mm512_reduce_add_ps's (halves first): a row's sums
         * are then the same below and from BLOCKED_ROWS_MIN rows, which engine.deterministic needs */
        const __m512 zero = _mm512_setzero_ps();
        const __m512 v[16] = {a0, a1, a2, a3, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero};
        float all[16];
        _mm512_storeu_ps(all, sum16x16(v));
        memcpy(sums, all, sizeof(float) * ROW_BLOCK);
        return;
    }
#endif
    (void)xb;
    for (int b = 0; b < nb; b++) {
        float acc = 0.f;
        if (wtype == W_F32) {
            const float *wr = (const float *)w + (j + b) * k;
            for (int i = 0; i < k; i++) acc += xr[i] * wr[i];
        } else {
            const uint16_t *wr = (const uint16_t *)w + (j + b) * k;
            for (int i = 0; i < k; i++) acc += xr[i] * bf16_to_f32(wr[i]);
        }
        sums[b] = acc;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The dot products of mr (<= X_BLOCK) bf16 x rows with ROW_BLOCK bf16 weight rows from row j, into
 * sums[r * 4 + b]: each weight vector is loaded once for every x row, and each 4 x rows' 16 sums are reduced by
 * one transpose-and-add instead of a horizontal sum each. */
static inline __attribute__((always_inline)) void dot_block_bf16(const uint16_t *xb, const uint16_t *w, int64_t j,
                                                                 int k, const int mr, float *sums)
{
    const uint16_t *w0 = w + j * k;
    __m512 acc[X_BLOCK][ROW_BLOCK];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < ROW_BLOCK; b++) acc[r][b] = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 32) {
        __m512bh wv[ROW_BLOCK];
        if (W_PREFETCH_AHEAD > 0)
            for (int b = 0; b < ROW_BLOCK; b++)
                __builtin_prefetch(w0 + (int64_t)(W_PREFETCH_AHEAD * ROW_BLOCK + b) * k + i, 0, W_PREFETCH_LOCALITY);
        for (int b = 0; b < ROW_BLOCK; b++) {
            __m512i raw = _mm512_loadu_si512(w0 + (int64_t)b * k + i);
            __asm__("" : "+v"(raw)); /* keep it in a register: gcc would otherwise load it again for every x row */
            wv[b] = (__m512bh)raw;
        }
        for (int r = 0; r < mr; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (int64_t)r * k + i);
            for (int b = 0; b < ROW_BLOCK; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
        }
    }
    for (int g = 0; g < mr; g += 4) {
        __m512 v[16];
        for (int i = 0; i < 16; i++)
            v[i] = g + i / ROW_BLOCK < mr ? acc[g + i / ROW_BLOCK][i % ROW_BLOCK] : _mm512_setzero_ps();
        _mm512_storeu_ps(sums + g * ROW_BLOCK, sum16x16(v));
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define X_BLOCK_AVX2 2 /* x rows per pass with 8-float registers: 2 x 4 sums, the 4 weight vectors and an x vector */
/* float32 weights, or bf16 ones on a CPU without AVX512-BF16 (widened; x stays float32, as in dot_rows): the dot
 * products of mr (<= X_BLOCK_AVX2) x rows with ROW_BLOCK weight rows from row j, into sums[r * 4 + b]. Each sum is
 * one 8-lane accumulator over k in order, then one fixed tree, whatever mr is: a row's result never depends on
 * the rows beside it (engine.deterministic with a count). k % 8 == 0. */
static inline __attribute__((always_inline)) void dot_block_avx2(const float *x, const void *w, const int bf16,
                                                                 int64_t j, int k, const int mr, float *sums)
{
    __m256 acc[X_BLOCK_AVX2][ROW_BLOCK];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < ROW_BLOCK; b++) acc[r][b] = _mm256_setzero_ps();
    const int64_t es = bf16 ? 2 : 4;
    const char *w0 = (const char *)w + j * k * es;
    for (int i = 0; i < k; i += 8) {
        if (W_PREFETCH_AHEAD > 0 && i % (64 / es) == 0)
            for (int b = 0; b < ROW_BLOCK; b++)
                __builtin_prefetch(w0 + ((int64_t)(W_PREFETCH_AHEAD * ROW_BLOCK + b) * k + i) * es, 0,
                                   W_PREFETCH_LOCALITY);
        __m256 wv[ROW_BLOCK];
        for (int b = 0; b < ROW_BLOCK; b++)
            wv[b] = bf16 ? widen8_bf16((const uint16_t *)(w0 + ((int64_t)b * k + i) * 2))
                         : _mm256_loadu_ps((const float *)(w0 + ((int64_t)b * k + i) * 4));
        for (int r = 0; r < mr; r++) {
            __m256 xv = _mm256_loadu_ps(x + (int64_t)r * k + i);
            for (int b = 0; b < ROW_BLOCK; b++) acc[r][b] = _mm256_fmadd_ps(xv, wv[b], acc[r][b]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < ROW_BLOCK; b++) sums[r * ROW_BLOCK + b] = sum8(acc[r][b]);
}

/* From this many x rows, float32 weights (bf16: TILED_ROWS_MIN_BF16) go through dot_block_tiled instead of
 * dot_block_avx2's passes over whole weight rows: a float32 block of 4 rows (32-128 KB at the 1B shape's widths,
 * 9-24 KB at 135M's) leaves L1 between two passes where it is large, a bf16 one (half that) more rarely, and is
 * widened in registers. With them a decode step's forward on Zen 3 against the torch path (bench.decode_kernel;
 * docs/history/benchmarks-rounds.md, "Decode steps of many rows on an AVX2 CPU: the kernel's linears in tiles"): at 1B
 * float32 1.02x at 16 rows (0.84x before); at 135M float32 1.34x at 8 rows, bf16
 * 1.19-1.41x at 32, 1.01x (64) to 1.35x (48). bf16 tiles against the passes (experiments.kernel_ab decode_forward,
 * 135M, the builds with TILED_ROWS_MIN_BF16=2, 8 and 12): 1.12-1.21x at 12-24 rows, level at 8 (within the runs'
 * 5%), slower at 2-4 (0.90-0.92x). */
#if defined(__AVX512F__) /* unmeasured with AVX-512 (the float32 kernel takes 8 rows there): never */
#define TILED_ROWS_MIN_DEFAULT (MAX_ROWS + 1)
#else
#define TILED_ROWS_MIN_DEFAULT 8
#endif
#ifndef TILED_ROWS_MIN_F32
#define TILED_ROWS_MIN_F32 TILED_ROWS_MIN_DEFAULT
#endif
#ifndef TILED_ROWS_MIN_BF16
#define TILED_ROWS_MIN_BF16 (TILED_ROWS_MIN_DEFAULT > 12 ? TILED_ROWS_MIN_DEFAULT : 12)
#endif
#ifndef K_TILE
#define K_TILE 512      /* weight columns per tile (a multiple of 8): a block's 4 rows of them, 8 KB, stay in L1 */
#endif
#define TILED_ROWS 64   /* x rows per call of dot_block_tiled: their 4 x 8-lane sums a weight row, 8 KB */

/* One x row pair's (mr <= X_BLOCK_AVX2) pass over a tile of kt columns from column i0: the 4 weight rows' tile at
 * wt (row b at wt + b * ws), the rows' running sums in acc[r * ROW_BLOCK + b]. */
static inline __attribute__((always_inline)) void tile_pass(const float *x, int k, const float *wt, int64_t ws,
                                                            int i0, int kt, const int mr, __m256 *acc)
{
    __m256 a[X_BLOCK_AVX2][ROW_BLOCK];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < ROW_BLOCK; b++) a[r][b] = acc[r * ROW_BLOCK + b];
    for (int i = 0; i < kt; i += 8) {
        __m256 xv[X_BLOCK_AVX2];
        for (int r = 0; r < mr; r++) xv[r] = _mm256_loadu_ps(x + (int64_t)r * k + i0 + i);
        for (int b = 0; b < ROW_BLOCK; b++) {
            __m256 wv = _mm256_loadu_ps(wt + b * ws + i);
            for (int r = 0; r < mr; r++) a[r][b] = _mm256_fmadd_ps(xv[r], wv, a[r][b]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < ROW_BLOCK; b++) acc[r * ROW_BLOCK + b] = a[r][b];
}

/* dot_block_avx2's sums for m (<= TILED_ROWS) x rows, the weight rows read in tiles of K_TILE columns that every
 * row pair takes while they are in L1 (bf16 ones widened once into wt, float32 ones read where they are). Each sum
 * is the same 8-lane accumulator over k in order and the same tree as dot_block_avx2's, so a row's result is the
 * same whichever of the two computes it. */
static void dot_block_tiled(const float *x, const void *w, const int bf16, int64_t j, int k, int m, float *sums)
{
    float wt[ROW_BLOCK * K_TILE] __attribute__((aligned(32)));
    __m256 acc[TILED_ROWS * ROW_BLOCK];
    for (int q = 0; q < m * ROW_BLOCK; q++) acc[q] = _mm256_setzero_ps();
    const int64_t es = bf16 ? 2 : 4;
    const char *w0 = (const char *)w + j * k * es;
    for (int i0 = 0; i0 < k; i0 += K_TILE) {
        const int kt = k - i0 < K_TILE ? k - i0 : K_TILE;
        const float *tile = wt;
        int64_t ws = K_TILE;
        if (bf16) {
            for (int b = 0; b < ROW_BLOCK; b++)
                for (int i = 0; i < kt; i += 8) {
                    const char *at = w0 + ((int64_t)b * k + i0 + i) * 2;
                    if (W_PREFETCH_AHEAD > 0 && i % 32 == 0)
                        __builtin_prefetch(at + (int64_t)W_PREFETCH_AHEAD * ROW_BLOCK * k * 2, 0, W_PREFETCH_LOCALITY);
                    _mm256_store_ps(wt + b * K_TILE + i, widen8_bf16((const uint16_t *)at));
                }
        } else {
            tile = (const float *)w0 + i0;
            ws = k;
            if (W_PREFETCH_AHEAD > 0)
                for (int b = 0; b < ROW_BLOCK; b++)
                    for (int i = 0; i < kt; i += 16)
                        __builtin_prefetch(tile + (int64_t)(W_PREFETCH_AHEAD * ROW_BLOCK + b) * k + i, 0,
                                           W_PREFETCH_LOCALITY);
        }
        int r0 = 0;
        for (; r0 + X_BLOCK_AVX2 <= m; r0 += X_BLOCK_AVX2)
            tile_pass(x + (int64_t)r0 * k, k, tile, ws, i0, kt, X_BLOCK_AVX2, acc + r0 * ROW_BLOCK);
        for (; r0 < m; r0++) tile_pass(x + (int64_t)r0 * k, k, tile, ws, i0, kt, 1, acc + r0 * ROW_BLOCK);
    }
    for (int q = 0; q < m * ROW_BLOCK; q++) sums[q] = sum8(acc[q]);
}
#endif

/* An int8 layer's input: each row rounded to integer steps of xs = max|x| / XQ_MAX. Each int32 lane of a sum takes
 * k / 16 products of at most XQ_MAX * 127, which stays within int32 up to MAX_K: the sums are exact. */
#define XQ_MAX 16383
_Static_assert((int64_t)(MAX_K / 16) * XQ_MAX * 127 <= INT32_MAX, "an int32 lane of an int8 sum could overflow");
#ifndef INT8_STREAM_ROWS
#define INT8_STREAM_ROWS 3 /* dot_block_int8 */
#endif
#define XQ_BLOCK 4 /* x rows per pass over a block of int8 weight rows: 4 x 4 int32 sums in registers */

/* xq = x rounded to XQ_MAX steps of each row's own range, xs its step (rows split over the team). A row with a
 * NaN or an infinity gets xs = NaN, so that every output of that row is NaN, as a float product would make it. */
static void to_int16_rows(const float *x, int m, int k, int16_t *xq, float *xs)
{
    #pragma omp for schedule(static)
    for (int r = 0; r < m; r++) {
        const float *xr = x + (int64_t)r * k;
        int16_t *q = xq + (int64_t)r * k;
        float amax = 0.f;
        int bad = 0, i = 0;
#if defined(__AVX512F__)
        __m512 vmax = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (; i + 16 <= k; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        }
        amax = _mm512_reduce_max_ps(vmax);
        bad = nan != 0;
#endif
        for (; i < k; i++) {
            bad |= isnan(xr[i]);
            amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
        }
        const float inv = (float)XQ_MAX / amax;
        /* a zero row, or a range under XQ_MAX / FLT_MAX (~5e-35, whose products vanish in float32): zeros */
        if (bad || isinf(amax) || isinf(inv)) {
            xs[r] = bad || isinf(amax) ? NAN : 0.f;
            memset(q, 0, sizeof(int16_t) * (size_t)k);
            continue;
        }
        xs[r] = amax / (float)XQ_MAX;
        i = 0;
#if defined(__AVX512F__)
        const __m512i lo = _mm512_set1_epi32(-XQ_MAX), hi = _mm512_set1_epi32(XQ_MAX);
        for (; i + 16 <= k; i += 16) { /* rounds to nearest even, as nearbyintf below */
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + i), _mm512_set1_ps(inv)));
            v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
            _mm256_storeu_si256((__m256i *)(q + i), _mm512_cvtepi32_epi16(v));
        }
#endif
        for (; i < k; i++) {
            float v = nearbyintf(xr[i] * inv);
            q[i] = (int16_t)(v > XQ_MAX ? XQ_MAX : v < -XQ_MAX ? -XQ_MAX : v);
        }
    }
}

#if defined(__AVX512BW__)
/* acc + the pairwise products of a and b (int16), summed into int32 lanes: one instruction with AVX512-VNNI */
static inline __m512i dot_i16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* The sum of v's 16 int32 lanes, in int64 (each lane fits int32, their sum may not). */
static inline int64_t sum_lanes_i64(__m512i v) {
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}

/* sums[r * 4 + b] = xq[r] . w[j + b] for mr (<= XQ_BLOCK) x rows, in integers. k % 32 == 0. The block's 4 weight
 * rows lie one after another in memory: up to INT8_STREAM_ROWS x rows it is read in that order, one stream (a step of
 * 1-3 rows read the 1B shape's weights at 41-46 GB/s so, where the probe read 44-48, against 32-36 taking the 4 rows
 * side by side); for more x rows the 4 rows go side by side, each weight vector widened once for every x row. */
static inline __attribute__((always_inline)) void dot_block_int8(const int16_t *xq, const int8_t *w, int64_t j,
                                                                 int k, const int mr, int64_t *sums)
{
    const int8_t *w0 = w + j * k;
    const int64_t ahead = (int64_t)W_PREFETCH_AHEAD * ROW_BLOCK * k; /* the bytes prefetched ahead into L2 */
    __m512i acc[XQ_BLOCK][ROW_BLOCK];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < ROW_BLOCK; b++) acc[r][b] = _mm512_setzero_si512();
    if (mr <= INT8_STREAM_ROWS) {
        for (int b = 0; b < ROW_BLOCK; b++) {
            const int8_t *wb = w0 + (int64_t)b * k;
            for (int i = 0; i < k; i += 32) {
                if (W_PREFETCH_AHEAD > 0 && i % 64 == 0) __builtin_prefetch(wb + ahead + i, 0, W_PREFETCH_LOCALITY);
                __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wb + i)));
                for (int r = 0; r < mr; r++)
                    acc[r][b] = dot_i16(acc[r][b], _mm512_loadu_si512(xq + (int64_t)r * k + i), wv);
            }
        }
    } else {
        for (int i = 0; i < k; i += 32) {
            if (W_PREFETCH_AHEAD > 0 && i % 64 == 0)
                for (int b = 0; b < ROW_BLOCK; b++)
                    __builtin_prefetch(w0 + ahead + (int64_t)b * k + i, 0, W_PREFETCH_LOCALITY);
            __m512i wv[ROW_BLOCK];
            for (int b = 0; b < ROW_BLOCK; b++)
                wv[b] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w0 + (int64_t)b * k + i)));
            for (int r = 0; r < mr; r++) {
                __m512i xv = _mm512_loadu_si512(xq + (int64_t)r * k + i);
                for (int b = 0; b < ROW_BLOCK; b++) acc[r][b] = dot_i16(acc[r][b], xv, wv[b]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < ROW_BLOCK; b++) sums[r * ROW_BLOCK + b] = sum_lanes_i64(acc[r][b]);
}
#endif

/* linear_rows for int8 weights, from the rows' int16 steps (to_int16_rows): y = sum * xs[r] * scale[j] + bias,
 * the integer sum exact (the same with or without AVX512), scaled in double and then rounded to float32. */
static void linear_rows_int8(const int16_t *xq, const float *xs, int m, int k, const int8_t *w, const float *scale,
                             const void *bias, int act_bf16, float *y, int n, int accumulate)
{
    #pragma omp for schedule(static)
    for (int jb = 0; jb < n; jb += ROW_BLOCK) {
        int nb = n - jb < ROW_BLOCK ? n - jb : ROW_BLOCK;
        for (int r0 = 0; r0 < m; r0 += XQ_BLOCK) {
            int mr = m - r0 < XQ_BLOCK ? m - r0 : XQ_BLOCK;
            int64_t sums[XQ_BLOCK * ROW_BLOCK];
            const int16_t *xr = xq + (int64_t)r0 * k;
#if defined(__AVX512BW__)
            if (nb == ROW_BLOCK && k % 32 == 0) {
                switch (mr) { /* a copy per row count, so the accumulators stay in registers */
                case 1: dot_block_int8(xr, w, jb, k, 1, sums); break;
                case 2: dot_block_int8(xr, w, jb, k, 2, sums); break;
                case 3: dot_block_int8(xr, w, jb, k, 3, sums); break;
                default: dot_block_int8(xr, w, jb, k, 4, sums); break;
                }
            } else
#endif
            for (int r = 0; r < mr; r++)
                for (int b = 0; b < nb; b++) {
                    const int8_t *wr = w + (int64_t)(jb + b) * k;
                    int64_t s = 0;
                    for (int i = 0; i < k; i++) s += (int32_t)xr[(int64_t)r * k + i] * wr[i];
                    sums[r * ROW_BLOCK + b] = s;
                }
            for (int r = 0; r < mr; r++)
                for (int b = 0; b < nb; b++) {
                    int j = jb + b;
                    float v = (float)((double)sums[r * ROW_BLOCK + b] * (double)xs[r0 + r] * (double)scale[j])
                              + (bias != NULL ? act_at(bias, act_bf16, j) : 0.f);
                    if (accumulate) y[(int64_t)(r0 + r) * n + j] += v;
                    else y[(int64_t)(r0 + r) * n + j] = v;
                }
        }
    }
}

/* y[r0 + r, jb + b] (+)= sums[r * ROW_BLOCK + b] + bias[jb + b] for mr rows and nb outputs: linear_rows' writes */
static inline void put_sums(const float *sums, int r0, int mr, int jb, int nb, const void *bias, int act_bf16,
                            float *y, int n, int accumulate)
{
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < nb; b++) {
            int j = jb + b;
            float v = sums[r * ROW_BLOCK + b] + (bias != NULL ? act_at(bias, act_bf16, j) : 0.f);
            if (accumulate) y[(int64_t)(r0 + r) * n + j] += v;
            else y[(int64_t)(r0 + r) * n + j] = v;
        }
}

/*
 * y[r, j] (+)= x[r, :] . w[j, :] (* scale[j]) + bias[j] for m rows of x, the output rows split over the
 * team in blocks of ROW_BLOCK (call inside a parallel region). A block of weight rows is read from memory
 * once; the other x rows find it in L1. xb: x in bfloat16 (bf16 weights only; the products then round
 * x to bf16, as torch's bf16 linear does), or for int8 weights x's int16 steps, xs their sizes (prepare_input).
 */
static void linear_rows(const float *x, const uint16_t *xb, const float *xs, int m, int k, const int64_t *f,
                        int w_field, int wtype, int act_bf16, float *y, int n, int accumulate)
{
    const void *w = (const void *)f[w_field];
    const float *scale = (const float *)f[w_field + 1];
    const void *bias = (const void *)f[w_field + 2];
    if (wtype == W_INT8) {
        linear_rows_int8((const int16_t *)xb, xs, m, k, (const int8_t *)w, scale, bias, act_bf16, y, n, accumulate);
        return;
    }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (IN_PANELS(wtype)) {
        float acc[MAX_ROWS * PANEL_GROUP * PANEL_COLS]; /* this thread's sums of a tile's panels */
        const int compact = wtype == W_BF16_COMPACT;
        panels_linear(xb, m, k, compact ? NULL : (const uint16_t *)w, compact ? (const uint8_t *)w : NULL, n, bias,
                      act_bf16, y, NULL, accumulate, acc);
        return;
    }
#endif
    #pragma omp for schedule(static)
    for (int jb = 0; jb < n; jb += ROW_BLOCK) {
        int nb = n - jb < ROW_BLOCK ? n - jb : ROW_BLOCK;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (wtype == W_BF16 && nb == ROW_BLOCK && k % 32 == 0 && m >= BLOCKED_ROWS_MIN) {
            for (int r0 = 0; r0 < m; r0 += X_BLOCK) {
                float sums[(X_BLOCK + 3) / 4 * 4 * ROW_BLOCK]; /* X_BLOCK rows, reduced 4 at a time */
                const uint16_t *xr = xb + (int64_t)r0 * k;
                int mr = m - r0 < X_BLOCK ? m - r0 : X_BLOCK;
                switch (mr) { /* a copy per row count, so the accumulators stay in registers */
                case 1: dot_block_bf16(xr, (const uint16_t *)w, jb, k, 1, sums); break;
                case 2: dot_block_bf16(xr, (const uint16_t *)w, jb, k, 2, sums); break;
                case 3: dot_block_bf16(xr, (const uint16_t *)w, jb, k, 3, sums); break;
                case 4: dot_block_bf16(xr, (const uint16_t *)w, jb, k, 4, sums); break;
                case 5: dot_block_bf16(xr, (const uint16_t *)w, jb, k, 5, sums); break;
                default: dot_block_bf16(xr, (const uint16_t *)w, jb, k, 6, sums); break;
                }
                put_sums(sums, r0, mr, jb, ROW_BLOCK, bias, act_bf16, y, n, accumulate);
            }
            continue;
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512BF16__)
        const int by_avx2 = wtype == W_F32;
#else
        const int by_avx2 = wtype == W_F32 || wtype == W_BF16;
#endif
        if (by_avx2 && nb == ROW_BLOCK && k % 8 == 0) {
            if (m >= (wtype == W_BF16 ? TILED_ROWS_MIN_BF16 : TILED_ROWS_MIN_F32)) {
                float sums[TILED_ROWS * ROW_BLOCK];
                for (int r0 = 0; r0 < m; r0 += TILED_ROWS) {
                    int mr = m - r0 < TILED_ROWS ? m - r0 : TILED_ROWS;
                    dot_block_tiled(x + (int64_t)r0 * k, w, wtype == W_BF16, jb, k, mr, sums);
                    put_sums(sums, r0, mr, jb, ROW_BLOCK, bias, act_bf16, y, n, accumulate);
                }
                continue;
            }
            for (int r0 = 0; r0 < m; r0 += X_BLOCK_AVX2) {
                float sums[X_BLOCK_AVX2 * ROW_BLOCK];
                const float *xr = x + (int64_t)r0 * k;
                int mr = m - r0 < X_BLOCK_AVX2 ? m - r0 : X_BLOCK_AVX2;
                if (mr == 1) dot_block_avx2(xr, w, wtype == W_BF16, jb, k, 1, sums);
                else dot_block_avx2(xr, w, wtype == W_BF16, jb, k, 2, sums);
                put_sums(sums, r0, mr, jb, ROW_BLOCK, bias, act_bf16, y, n, accumulate);
            }
            continue;
        }
#endif
        for (int r = 0; r < m; r++) {
            float sums[ROW_BLOCK];
            dot_rows(x + (int64_t)r * k, xb + (int64_t)r * k, w, wtype, jb, nb, k, sums);
            put_sums(sums, r, 1, jb, nb, bias, act_bf16, y, n, accumulate);
        }
    }
}

/* xb = x rounded to bf16, rows split over the team (the input of a bf16 linear layer). */
static void to_bf16_rows(const float *x, int m, int k, uint16_t *xb) {
    #pragma omp for schedule(static)
    for (int r = 0; r < m; r++)
        for (int i = 0; i < k; i++) xb[(int64_t)r * k + i] = f32_to_bf16(x[(int64_t)r * k + i]);
}

/* A linear layer's input as its weights take it, into xb (and xs): rounded to bf16 for bf16 weights, to int16
 * steps for int8 (to_int16_rows); float32 weights read x itself. */
static void prepare_input(const float *x, int m, int k, int wtype, uint16_t *xb, float *xs) {
    if (X_IN_BF16(wtype)) to_bf16_rows(x, m, k, xb);
    else if (wtype == W_INT8) to_int16_rows(x, m, k, (int16_t *)xb, xs);
}

static inline void rms_norm(const float *x, const void *w, int bf16, int d, float eps, float *out) {
    float ss = 0.f;
    for (int i = 0; i < d; i++) ss += x[i] * x[i];
    float inv = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = 0; i < d; i++) out[i] = act_at(w, bf16, i) * (x[i] * inv);
}

static inline void rope(float *x, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

static inline void store(void *base, int bf16, int64_t offset, const float *src, int d) {
    if (bf16) {
        uint16_t *p = (uint16_t *)base + offset;
        for (int i = 0; i < d; i++) p[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + offset, src, sizeof(float) * (size_t)d);
    }
}

/* Scratch on a 64-byte boundary whatever the allocator gives: the compiler's vectorized loops over a row (the
 * RMSNorm's sum of squares) then take one path for every call, never one that peels a misaligned start, so a
 * row's sums do not move with where a call's scratch lands (engine.deterministic). */
static void *alloc64(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* 0 where tessera_decode_forward takes a model of these dims (all but D_ROWS, D_MAX_BLOCKS and D_BLOCK_STRIDE),
 * else -1: the caller asks once, at load, and keeps its torch path for a model this kernel does not take. */
int tessera_decode_forward_shapes(const int64_t *dims)
{
    const int hidden = (int)dims[D_HIDDEN], heads = (int)dims[D_HEADS], kv_heads = (int)dims[D_KV_HEADS];
    const int head_dim = (int)dims[D_HEAD_DIM], inter = (int)dims[D_INTER], block_size = (int)dims[D_BLOCK_SIZE];
    const int wtype = (int)dims[D_WEIGHT_TYPE];
    const int q_size = heads * head_dim, qkv_size = q_size + 2 * kv_heads * head_dim;
    if (kv_heads < 1 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM ||
        head_dim % 2 != 0 || block_size > MAX_BLOCK || hidden > MAX_K || inter > MAX_K || q_size > MAX_K ||
        wtype < W_F32 || wtype > W_BF16_COMPACT)
        return -1;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (IN_PANELS(wtype) && ((qkv_size | hidden | 2 * inter) % PANEL_COLS != 0 || (hidden | q_size | inter) % 2))
        return -1;
#else
    (void)qkv_size;
    if (IN_PANELS(wtype)) return -1; /* no AVX512-BF16 here: the caller packs no panels */
#endif
    return 0;
}

/*
 * layers:       [num_layers, NUM_FIELDS] int64 (see the F_ enum)
 * dims:         [NUM_DIMS] int64 (see the D_ enum)
 * x:            [rows, hidden] embeddings, model dtype
 * positions:    [rows] int64
 * cos, sin:     [max_positions, head_dim / 2] float32
 * pool:         the KV pool's base; a layer's K/V at F_K_OFFSET/F_V_OFFSET elements, blocks D_BLOCK_STRIDE apart
 * block_tables: [rows, max_blocks] int64; context_lens: [rows] int64, the new token included
 * slot_blocks, slot_offsets: [rows] int64, where each row's new K/V goes
 * final_norm:   [hidden] model dtype; out: [rows, hidden] model dtype, the normed last hidden state
 * Returns -1 (and writes nothing) for shapes it does not take.
 */
int tessera_decode_forward(const int64_t *layers, int num_layers, const int64_t *dims, float eps, float attn_scale,
                           const void *x, const int64_t *positions, const float *cos, const float *sin,
                           void *pool, const int64_t *block_tables, const int64_t *context_lens,
                           const int64_t *slot_blocks, const int64_t *slot_offsets,
                           const void *final_norm, void *out)
{
    const int m = (int)dims[D_ROWS], hidden = (int)dims[D_HIDDEN], heads = (int)dims[D_HEADS];
    const int kv_heads = (int)dims[D_KV_HEADS], head_dim = (int)dims[D_HEAD_DIM], inter = (int)dims[D_INTER];
    const int block_size = (int)dims[D_BLOCK_SIZE], act_bf16 = (int)dims[D_ACT_BF16];
    const int wtype = (int)dims[D_WEIGHT_TYPE];
    const int pool_int8 = (int)dims[D_POOL_INT8]; /* the pool holds kv_int8.h's rows, not the model dtype's */
    const int64_t max_blocks = dims[D_MAX_BLOCKS], block_stride = dims[D_BLOCK_STRIDE];
    const int q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    if (m < 1 || m > MAX_ROWS || tessera_decode_forward_shapes(dims) != 0) return -1;

    const size_t widest = (size_t)(qkv_size > 2 * inter ? qkv_size : 2 * inter);
    float *h = (float *)alloc64(sizeof(float) * (size_t)m * (2 * (size_t)hidden + inter + widest + q_size));
    if (h == NULL) return -1;
    float *xn = h + (size_t)m * hidden;      /* [m, hidden] normed input of a linear layer */
    float *act = xn + (size_t)m * hidden;    /* [m, inter] SiLU(gate) * up */
    float *wide = act + (size_t)m * inter;   /* [m, qkv_size] or [m, 2 * inter] */
    float *attn = wide + (size_t)m * widest; /* [m, q_size] attention output */
    /* h: [m, hidden] the residual stream */
    for (int64_t i = 0; i < (int64_t)m * hidden; i++) h[i] = act_at(x, act_bf16, i);
    const int group = heads / kv_heads, half = head_dim / 2;

    const int widest_k = inter > q_size ? (inter > hidden ? inter : hidden) : (q_size > hidden ? q_size : hidden);
    uint16_t *xb = (uint16_t *)alloc64(sizeof(uint16_t) * (size_t)m * (size_t)widest_k); /* bf16 or int16 input */
    if (xb == NULL) { free(h); return -1; }
    float xs[MAX_ROWS]; /* an int8 layer's input: each row's step (to_int16_rows) */
#if defined(ATTEND_VECTOR)
    const int by_row = !pool_int8 && attend_by_row(m, context_lens, head_dim, kv_heads, block_size, act_bf16);
#endif
    int i8_by_row = 1; /* over an int8 pool: an item per row where that keeps every thread busy, as kv_int8.c */
#ifdef _OPENMP
    i8_by_row = m >= 2 * omp_get_max_threads();
#endif
    #pragma omp parallel
    {
#if defined(ATTEND_VECTOR)
        attend_state *states = by_row ? aligned_alloc(64, sizeof(attend_state) * (size_t)kv_heads) : NULL;
#endif
        i8_state *i8 = pool_int8 ? i8_thread_state(heads, head_dim) : NULL;
        for (int l = 0; l < num_layers; l++) {
            const int64_t *f = layers + (int64_t)l * NUM_FIELDS;
            #pragma omp for schedule(static)
            for (int r = 0; r < m; r++)
                rms_norm(h + (int64_t)r * hidden, (const void *)f[F_IN_NORM], act_bf16, hidden, eps,
                         xn + (int64_t)r * hidden);
            prepare_input(xn, m, hidden, wtype, xb, xs);
            linear_rows(xn, xb, xs, m, hidden, f, F_QKV_W, wtype, act_bf16, wide, qkv_size, 0);

            /* q/k norm (Qwen3), RoPE, and the new K/V into the pool: one item per (row, head of q, k or v) */
            #pragma omp for schedule(static)
            for (int item = 0; item < m * (heads + 2 * kv_heads); item++) {
                int r = item / (heads + 2 * kv_heads), hd = item % (heads + 2 * kv_heads);
                float *v = wide + (int64_t)r * qkv_size + (int64_t)hd * head_dim;
                if (hd < heads + kv_heads) {
                    const void *qk_norm = (const void *)f[hd < heads ? F_Q_NORM : F_K_NORM];
                    if (qk_norm != NULL) {
                        float tmp[MAX_HEAD_DIM];
                        memcpy(tmp, v, sizeof(float) * (size_t)head_dim);
                        rms_norm(tmp, qk_norm, act_bf16, head_dim, eps, v);
                    }
                    rope(v, cos + positions[r] * half, sin + positions[r] * half, half);
                }
                if (hd >= heads) {
                    int is_v = hd >= heads + kv_heads;
                    int kvh = hd - heads - (is_v ? kv_heads : 0);
                    int64_t row = slot_offsets[r] * kv_heads + kvh, at = slot_blocks[r] * block_stride
                                                                    + f[is_v ? F_V_OFFSET : F_K_OFFSET];
                    if (pool_int8) { /* rounded to the model dtype first, as the layer path's K/V are */
                        float kv[MAX_HEAD_DIM];
                        for (int d = 0; d < head_dim; d++) kv[d] = act_bf16 ? bf16_to_f32(f32_to_bf16(v[d])) : v[d];
                        quantize_row(kv, 0, 0, head_dim, (int8_t *)pool + at + row * (head_dim + I8_SCALE_BYTES));
                    } else {
                        store(pool, act_bf16, at + row * head_dim, v, head_dim);
                    }
                }
            }

            /* attention: one item per row (every kv head, block by block) for many rows of long contexts, else
             * per (row, kv head); q rows sit at the start of each row's qkv */
            if (pool_int8) {
                #pragma omp for schedule(dynamic, 1)
                for (int64_t item = 0; item < (i8_by_row ? m : (int64_t)m * kv_heads); item++) {
                    int r = (int)(i8_by_row ? item : item / kv_heads);
                    int kvh0 = i8_by_row ? 0 : (int)(item % kv_heads), kvh1 = i8_by_row ? kv_heads : kvh0 + 1;
                    attend_i8(i8, wide + (int64_t)r * qkv_size, 0, (const int8_t *)pool, block_stride, f[F_K_OFFSET],
                              f[F_V_OFFSET], block_tables + (int64_t)r * max_blocks, context_lens[r],
                              attn + (int64_t)r * q_size, 0, kvh0, kvh1, heads, kv_heads, head_dim, block_size,
                              attn_scale, group);
                }
            } else
#if defined(ATTEND_VECTOR)
            if (by_row) {
                #pragma omp for schedule(dynamic, 1)
                for (int r = 0; r < m; r++) {
                    if (states != NULL) {
                        attend_row(wide + (int64_t)r * qkv_size, 0, pool, block_stride, f[F_K_OFFSET],
                                          f[F_V_OFFSET], block_tables + (int64_t)r * max_blocks, max_blocks,
                                          context_lens + r, attn + (int64_t)r * q_size, 0, heads, kv_heads, head_dim,
                                          block_size, attn_scale, act_bf16, group, states, 0);
                        continue;
                    }
                    for (int kvh = 0; kvh < kv_heads; kvh++) /* no scratch for this thread: a head at a time */
                        attend_one(wide + (int64_t)r * qkv_size, 0, pool, block_stride, f[F_K_OFFSET],
                                   f[F_V_OFFSET], block_tables + (int64_t)r * max_blocks, max_blocks,
                                   context_lens + r, attn + (int64_t)r * q_size, 0, heads, kv_heads, head_dim,
                                   block_size, attn_scale, act_bf16, group, kvh);
                }
            } else
#endif
            {
                #pragma omp for schedule(dynamic, 1)
                for (int64_t item = 0; item < (int64_t)m * kv_heads; item++) {
                    int r = (int)(item / kv_heads);
                    /* attend_one addresses q and out as [rows, heads, head_dim]: give it row r alone */
                    attend_one(wide + (int64_t)r * qkv_size, 0, pool, block_stride, f[F_K_OFFSET], f[F_V_OFFSET],
                               block_tables + (int64_t)r * max_blocks, max_blocks, context_lens + r,
                               attn + (int64_t)r * q_size, 0, heads, kv_heads, head_dim, block_size, attn_scale,
                               act_bf16, group, item % kv_heads);
                }
            }
            prepare_input(attn, m, q_size, wtype, xb, xs);
            linear_rows(attn, xb, xs, m, q_size, f, F_O_W, wtype, act_bf16, h, hidden, 1);

            #pragma omp for schedule(static)
            for (int r = 0; r < m; r++)
                rms_norm(h + (int64_t)r * hidden, (const void *)f[F_POST_NORM], act_bf16, hidden, eps,
                         xn + (int64_t)r * hidden);
            prepare_input(xn, m, hidden, wtype, xb, xs);
            linear_rows(xn, xb, xs, m, hidden, f, F_GU_W, wtype, act_bf16, wide, 2 * inter, 0);
            #pragma omp for schedule(static)
            for (int r = 0; r < m; r++) {
                const float *g = wide + (int64_t)r * 2 * inter, *u = g + inter;
                float *a = act + (int64_t)r * inter;
                int i = 0;
#if defined(__AVX512F__)
                for (; i + 16 <= inter; i += 16) /* as the torch path's elementwise kernel, without its rounding */
                    _mm512_storeu_ps(a + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#elif defined(__AVX2__) && defined(__FMA__)
                for (; i + 8 <= inter; i += 8)
                    _mm256_storeu_ps(a + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
#endif
                for (; i < inter; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
            }
            prepare_input(act, m, inter, wtype, xb, xs);
            linear_rows(act, xb, xs, m, inter, f, F_DOWN_W, wtype, act_bf16, h, hidden, 1);
        }
        #pragma omp for schedule(static)
        for (int r = 0; r < m; r++) {
            float tmp[MAX_K];
            rms_norm(h + (int64_t)r * hidden, final_norm, act_bf16, hidden, eps, tmp);
            store(out, act_bf16, (int64_t)r * hidden, tmp, hidden);
        }
#if defined(ATTEND_VECTOR)
        free(states);
#endif
        i8_thread_state_free(i8);
    }
    free(xb);
    free(h);
    return 0;
}

/* 1 where this build takes W_BF16_PANELS (the compiler targets AVX512-BF16), else 0: the caller packs no panels. */
int tessera_decode_forward_panels(void)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/*
 * y = x @ w^T * scale (+ bias) for a few rows of x against int8 weights with one float32 scale per
 * output row (an int8 model's LM head at decode), x rounded to int16 steps as in the layers (to_int16_rows).
 * x, bias and y in the activation dtype (act_bf16).
 */
int tessera_linear_int8(const void *x, const int8_t *w, const float *scale, const void *bias, void *y,
                        int m, int n, int k, int act_bf16)
{
    if (m < 1 || m > MAX_ROWS || k < 1 || k > MAX_K) return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)m * ((size_t)k + (size_t)n) + sizeof(int16_t) * (size_t)m * k);
    if (xf == NULL) return -1;
    float *yf = xf + (size_t)m * k;
    int16_t *xq = (int16_t *)(yf + (size_t)m * n);
    float xs[MAX_ROWS];
    for (int64_t i = 0; i < (int64_t)m * k; i++) xf[i] = act_at(x, act_bf16, i);
    const int64_t f[3] = {(int64_t)w, (int64_t)scale, (int64_t)bias};
    #pragma omp parallel
    {
        to_int16_rows(xf, m, k, xq, xs);
        linear_rows(xf, (const uint16_t *)xq, xs, m, k, f, 0, W_INT8, act_bf16, yf, n, 0);
    }
    for (int r = 0; r < m; r++) store(y, act_bf16, (int64_t)r * n, yf + (int64_t)r * n, n);
    free(xf);
    return 0;
}
