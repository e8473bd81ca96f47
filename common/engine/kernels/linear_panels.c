/*
 * y = x . w^T (+ bias) in bfloat16 for any number of rows, w in the panel layout of panels_bf16.h: the linear
 * layers of a model whose decode kernel reads its weights in panels run every other step (prompt chunks, decode
 * steps past the kernel's rows) here too, so the panels are the weights' only copy, not one of two beside
 * oneDNN's blocked layout.
 *
 * The rows go through ROW_CHUNK at a time: within a chunk each thread takes a run of panels, and for each group
 * of PANEL_GROUP panels and each k-block every tile of rows reads the block (panels_linear): PANEL_KBLOCK inputs
 * for a step of a few rows, bound by reading the weights, as the decode kernel takes them; PANEL_WIDE_KBLOCK from
 * PANEL_WIDE_ROWS rows, bound by the products, where fewer round trips of the tiles' sums count more than the
 * block's staying in L1. A chunk's sums (ROW_CHUNK x PANEL_GROUP x 16 floats) stay in L2; each chunk reads the
 * weights once more.
 *
 * Float32 sums, one order per output whatever the rows or threads (panels_bf16.h); each result rounded to
 * bfloat16, nearest even, as torch's bf16 linear rounds its own.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "panels_bf16.h"

#define ROW_CHUNK 512

/* 1 where this build computes on panels (AVX512-BF16), else 0 (tessera_linear_panels refuses every call) */
int tessera_linear_panels_available(void)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* x: [m, k] bf16 rows (row-major), panels: w [n, k] in panels (n a multiple of 16, k even), bias: [n] bf16 or
 * NULL, y: [m, n] bf16. Returns -1 (and writes nothing) for shapes it does not take or without AVX512-BF16. */
int tessera_linear_panels(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t m,
                          int64_t n, int64_t k)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (m < 1 || n < PANEL_COLS || n % PANEL_COLS != 0 || k < 2 || k % 2 != 0 || n > INT32_MAX || k > INT32_MAX)
        return -1;
    int failed = 0;
    #pragma omp parallel
    {
        float *acc = (float *)malloc(sizeof(float) * ROW_CHUNK * PANEL_GROUP * PANEL_COLS);
        int any;
        if (acc == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        #pragma omp atomic read
        any = failed;
        if (!any)
            for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
                const int mr = (int)(m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK);
                panels_linear(x + r0 * k, mr, (int)k, panels, (int)n, bias, 1, NULL, y + r0 * n, 0, acc,
                              m >= PANEL_WIDE_ROWS ? PANEL_WIDE_KBLOCK : PANEL_KBLOCK);
            }
        free(acc);
    }
    return failed ? -1 : 0;
#else
    (void)x; (void)panels; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return -1;
#endif
}
