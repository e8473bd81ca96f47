/*
 * The panel layout of a bfloat16 linear weight, and y = x . w^T on it: the decode kernel's rows (decode_forward.c)
 * and any step's (linear_panels.c).
 *
 * A weight w[n][k] (n a multiple of PANEL_COLS, k even) is held as n / 16 panels, each [k / 2][16][2]: panel p
 * holds output columns 16p..16p+15, and for each pair of inputs (2kk, 2kk+1) their 16 columns' two weights side
 * by side, 64 bytes. One AVX512-BF16 dot product (vdpbf16ps) then takes a panel's 64 bytes against one x row's
 * pair of inputs broadcast to all 16 lanes, adding to 16 sums, one per output column: an outer product.
 *
 * Against the row layout (decode_forward.c's dot_block_bf16: a zmm of one weight row against a zmm of each x
 * row, each sum reduced across lanes at the end), x is read as 4-byte broadcasts (L1 hits, lighter on the load ports
 * than zmm loads) instead of full vectors, each panel is one sequential stream, and no sum is reduced across
 * lanes. A tile of up to PANEL_TILE_ROWS x rows against PANEL_GROUP panels keeps 24 sums in registers; the
 * panels' k range is taken a k-block at a time, every tile of rows reading the block before the next: at
 * PANEL_KBLOCK inputs (a decode step's few rows) from L1, with the next block's lines prefetched into L2 as each
 * tile goes; at PANEL_WIDE_KBLOCK (wide steps, bound by their products) from L2.
 *
 * Each output's sum runs over k in one order (k-blocks in turn, pairs in turn within one), whatever the number
 * of rows or threads: a row's outputs do not depend on the other rows of the step.
 *
 * Measured on Zen 4, 2 threads, the 1B shape: the 16 layers' linears alone, from memory, 16 rows 39 ms against
 * the row layout's 53 and 32 rows 60 against 84 (a scratch harness, in alternating rounds); in L2, 900+ GFLOP/s
 * from 12 rows, near the machine's vdpbf16ps peak of about 990. The whole decode forward against the torch path:
 * bench.decode_kernel --model 1b; the layout's GEMM for any rows (linear_panels.c) against oneDNN's:
 * bench.panel_gemm; docs/benchmarks.md.
 */
#ifndef TESSERA_PANELS_BF16_H
#define TESSERA_PANELS_BF16_H

#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define PANEL_COLS 16       /* output columns per panel: one zmm of float32 sums */
#define PANEL_GROUP 4       /* panels per tile */
#define PANEL_TILE_ROWS 6   /* x rows per tile: 6 x 4 sums, 4 panel loads and 6 broadcasts per input pair */
#define PANEL_KBLOCK 256    /* inputs per k-block: a tile's 4 panels' block is 32 KB */
/* the k-block of steps of PANEL_WIDE_ROWS rows or more (linear_panels.c): their products bound them, not the
 * weights' reads, and a tile's sums then go to memory and back once per 4,096 inputs instead of 256 (measured
 * in bench.panel_gemm, Zen 4: 0.94-0.98x oneDNN's speed from 256 rows at 256, 1.00-1.05x at 4,096; at 24-40
 * rows 3-8% faster than at 256). The decode kernel keeps PANEL_KBLOCK at any rows: from 16 rows the wide block
 * bought it nothing (bench.decode_kernel --model 1b, 32 rows: 138-143 ms at 256, 143-144 ms wide) */
#define PANEL_WIDE_KBLOCK 4096
#define PANEL_WIDE_ROWS 24
#ifndef PANEL_PREFETCH
#define PANEL_PREFETCH 8192 /* bytes ahead in a panel's stream: at PANEL_KBLOCK, the same inputs of the next block */
#endif

/* acc[r][0..nz*16) (+)= x[r][2kk0..2kk1) . panels p..p+nz over the same inputs; acc rows PANEL_GROUP * 16 apart */
static inline __attribute__((always_inline)) void panel_tile(const int mr, const int nz, const uint16_t *xb,
                                                             int64_t ldx, const uint16_t *p, int64_t panel_stride,
                                                             int kk0, int kk1, float *acc_out, int first)
{
    __m512 acc[PANEL_TILE_ROWS][PANEL_GROUP];
    for (int r = 0; r < mr; r++)
        for (int z = 0; z < nz; z++)
            acc[r][z] = first ? _mm512_setzero_ps()
                              : _mm512_loadu_ps(acc_out + (r * PANEL_GROUP + z) * PANEL_COLS);
    for (int kk = kk0; kk < kk1; kk++) {
        __m512bh wv[PANEL_GROUP];
        for (int z = 0; z < nz; z++) {
            const uint16_t *pz = p + z * panel_stride + (int64_t)kk * 2 * PANEL_COLS;
            __builtin_prefetch((const char *)pz + PANEL_PREFETCH, 0, 2);
            __m512i raw = _mm512_loadu_si512(pz);
            __asm__("" : "+v"(raw)); /* one load per panel and pair, kept in a register for every row */
            wv[z] = (__m512bh)raw;
        }
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, xb + r * ldx + 2 * kk, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int z = 0; z < nz; z++) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], xv, wv[z]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(acc_out + (r * PANEL_GROUP + z) * PANEL_COLS, acc[r][z]);
}

#define PANEL_TILE_CASE(MR, NZ) \
    case (MR) * 8 + (NZ): panel_tile(MR, NZ, xb, ldx, p, panel_stride, kk0, kk1, acc_out, first); break;
#define PANEL_TILE_ROW(MR) PANEL_TILE_CASE(MR, 1) PANEL_TILE_CASE(MR, 2) PANEL_TILE_CASE(MR, 3) PANEL_TILE_CASE(MR, 4)

/* panel_tile with mr and nz as constants: a copy per shape, so the sums stay in registers */
static void panel_tile_any(int mr, int nz, const uint16_t *xb, int64_t ldx, const uint16_t *p, int64_t panel_stride,
                           int kk0, int kk1, float *acc_out, int first)
{
    switch (mr * 8 + nz) {
    PANEL_TILE_ROW(1) PANEL_TILE_ROW(2) PANEL_TILE_ROW(3) PANEL_TILE_ROW(4) PANEL_TILE_ROW(5) PANEL_TILE_ROW(6)
    default: break;
    }
}

/* y16[0..nz*16) = bf16 of a[0..nz*16) (+ bias from column j0, float32 or bf16), nearest even, 16 at a time */
static inline void panels_store_bf16(const float *a, int nz, const void *bias, int bias_bf16, int64_t j0,
                                     uint16_t *y16)
{
    for (int z = 0; z < nz; z++) {
        __m512 v = _mm512_loadu_ps(a + z * PANEL_COLS);
        const int64_t j = j0 + (int64_t)z * PANEL_COLS;
        if (bias != NULL && bias_bf16) {
            const __m256i b16 = _mm256_loadu_si256((const __m256i *)((const uint16_t *)bias + j));
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16)));
        } else if (bias != NULL) {
            v = _mm512_add_ps(v, _mm512_loadu_ps((const float *)bias + j));
        }
        _mm256_storeu_si256((__m256i *)(y16 + z * PANEL_COLS), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/*
 * y[r][j] (+)= x[r] . w[j] (+ bias[j], float32 or bf16) for m (<= max_rows) bf16 rows xb [m][k] against panels
 * (n / 16 of them), or, where y16 is given, y16[r][j] = the same in bfloat16 (nearest even; y and accumulate
 * unused), inside a parallel region: each thread takes a contiguous run of panels, and all meet at a barrier at
 * the end (as an omp for would). acc: this thread's scratch, max_rows * PANEL_GROUP * 16 floats. kblock: inputs
 * per k-block (even; PANEL_KBLOCK, or PANEL_WIDE_KBLOCK for wide steps).
 */
static void panels_linear(const uint16_t *xb, int m, int k, const uint16_t *panels, int n, const void *bias,
                          int bias_bf16, float *y, uint16_t *y16, int accumulate, float *acc, int kblock)
{
    const int np = n / PANEL_COLS, t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int begin = (int)((int64_t)np * t / nt), end = (int)((int64_t)np * (t + 1) / nt);
    const int64_t panel_stride = (int64_t)k * PANEL_COLS; /* elements from one panel to the next */
    for (int p0 = begin; p0 < end; p0 += PANEL_GROUP) {
        const int nz = end - p0 < PANEL_GROUP ? end - p0 : PANEL_GROUP;
        const uint16_t *p = panels + p0 * panel_stride;
        for (int k0 = 0; k0 < k; k0 += kblock) {
            const int k1 = k - k0 < kblock ? k : k0 + kblock;
            for (int r0 = 0; r0 < m; r0 += PANEL_TILE_ROWS) {
                const int mr = m - r0 < PANEL_TILE_ROWS ? m - r0 : PANEL_TILE_ROWS;
                panel_tile_any(mr, nz, xb + (int64_t)r0 * k, k, p, panel_stride, k0 / 2, k1 / 2,
                               acc + (int64_t)r0 * PANEL_GROUP * PANEL_COLS, k0 == 0);
            }
        }
        if (y16 != NULL) {
            for (int r = 0; r < m; r++)
                panels_store_bf16(acc + (int64_t)r * PANEL_GROUP * PANEL_COLS, nz, bias, bias_bf16,
                                  (int64_t)p0 * PANEL_COLS, y16 + (int64_t)r * n + (int64_t)p0 * PANEL_COLS);
            continue;
        }
        for (int r = 0; r < m; r++) {
            const float *a = acc + (int64_t)r * PANEL_GROUP * PANEL_COLS;
            float *yr = y + (int64_t)r * n + (int64_t)p0 * PANEL_COLS;
            for (int c = 0; c < nz * PANEL_COLS; c++) {
                float v = a[c];
                if (bias != NULL) {
                    const int64_t j = (int64_t)p0 * PANEL_COLS + c;
                    v += bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
                }
                if (accumulate) yr[c] += v;
                else yr[c] = v;
            }
        }
    }
    #pragma omp barrier
}
#endif

#endif
