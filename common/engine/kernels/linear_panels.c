/*
 * y = x . w^T (+ bias) in bfloat16 for any number of rows, w in the panel layout of panels_bf16.h: the linear
 * layers of a model whose decode kernel reads its weights in panels run every other step (prompt chunks, decode
 * steps past the kernel's rows) here too, so the panels are the weights' only copy, not one of two beside
 * oneDNN's blocked layout.
 *
 * The rows go through in chunks of at most ROW_CHUNK, even ones: within a chunk each thread takes a run of panels,
 * and for each group of PANEL_GROUP panels and each k-block every tile of rows reads the block (panels_linear), as
 * the decode kernel does: a block's size and how its lines are prefetched follow the rows (panels_bf16.h). A chunk's
 * sums (ROW_CHUNK x PANEL_GROUP x 16 floats) stay in L2; each chunk reads the weights once more.
 *
 * Float32 sums, one order per output whatever the rows or threads (panels_bf16.h; with AMX tiles, one order per
 * output on either side of PANEL_AMX_ROWS); each result rounded to bfloat16, nearest even, as torch's bf16 linear
 * rounds its own.
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

/* From how many rows a call multiplies with AMX tiles (panels_bf16.h's PANEL_AMX_ROWS), 0 where it never does: a
 * build without them (no AMX, or engine.deterministic's) or Linux refusing their state */
int tessera_linear_panels_amx_rows(void)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__) && PANEL_AMX_ROWS > 0
    return amx_ready() ? PANEL_AMX_ROWS : 0;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The team's pass: with tiles NULL, y = x . w^T (+ bias) for every output, the rows ROW_CHUNK at a time; else only
 * the whole tiles listed (count of them, m <= ROW_CHUNK), y: [count][m][64]. Each tile's panels split over the team
 * as a whole call splits them, so either way every output's sum runs in its one order. -1 without memory. */
static int panels_team(const uint16_t *x, const uint16_t *panels, const uint8_t *compact, const uint16_t *bias,
                       uint16_t *y, int64_t m, int64_t n, int64_t k, const int32_t *tiles, int64_t count)
{
    const int64_t width = PANEL_COLS * PANEL_GROUP;
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
        if (!any && tiles == NULL) {
            /* chunks of even rows: none of fewer than PANEL_AMX_ROWS in a call of more, whose rows then all take the
             * AMX tiles or none does */
            const int64_t chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t r0 = m * c / chunks, mr = m * (c + 1) / chunks - r0;
                panels_linear(x + r0 * k, (int)mr, (int)k, panels, compact, (int)n, bias, 1, NULL, y + r0 * n, 0,
                              acc);
            }
        }
        else if (!any)
            for (int64_t i = 0; i < count; i++)
                panels_linear(x, (int)m, (int)k, panels + (int64_t)tiles[i] * width * k, NULL, (int)width, NULL, 1,
                              NULL, y + i * m * width, 0, acc);
        free(acc);
    }
    return failed ? -1 : 0;
}
#endif

/* x: [m, k] bf16 rows (row-major), panels: w [n, k] in panels (n a multiple of 16, k even), bias: [n] bf16 or
 * NULL, y: [m, n] bf16. Returns -1 (and writes nothing) for shapes it does not take or without AVX512-BF16. */
int tessera_linear_panels(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t m,
                          int64_t n, int64_t k)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (m < 1 || n < PANEL_COLS || n % PANEL_COLS != 0 || k < 2 || k % 2 != 0 || n > INT32_MAX || k > INT32_MAX)
        return -1;
    return panels_team(x, panels, NULL, bias, y, m, n, k, NULL, 0);
#else
    (void)x; (void)panels; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return -1;
#endif
}

/* tessera_linear_panels on the same weight as compact panels (compact_panels.h: blob, of an [n, k] weight); the
 * same outputs bit for bit. */
int tessera_linear_compact(const uint16_t *x, const uint8_t *blob, const uint16_t *bias, uint16_t *y, int64_t m,
                           int64_t n, int64_t k)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (m < 1 || n < PANEL_COLS || n % PANEL_COLS != 0 || k < 2 || k % 2 != 0 || n > INT32_MAX || k > INT32_MAX
        || compact_check(blob, n, k) != 0)
        return -1;
    return panels_team(x, NULL, blob, bias, y, m, n, k, NULL, 0);
#else
    (void)x; (void)blob; (void)bias; (void)y; (void)m; (void)n; (void)k;
    return -1;
#endif
}

/* The outputs of chosen whole tiles only: y[i] = x . w[tiles[i] * 64 : tiles[i] * 64 + 64]^T for i < count, as
 * y: [count][m][64] bf16 (tile-major), each tile's sums as tessera_linear_panels computes them (the same k-blocks
 * for the same m, one order per output), so every value equals that call's bit for bit: the greedy LM head
 * (common/engine/greedy_head.py) computes the few tokens its int8 bound cannot rule out. w: [n, k] in panels with
 * n a multiple of 64 (whole tiles). Returns -1 (and writes nothing) for shapes it does not take. */
int tessera_linear_panels_tiles(const uint16_t *x, const uint16_t *panels, const int32_t *tiles, int64_t count,
                                uint16_t *y, int64_t m, int64_t n, int64_t k)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int64_t width = PANEL_COLS * PANEL_GROUP;
    if (m < 1 || m > ROW_CHUNK || count < 1 || n < width || n % width != 0 || k < 2 || k % 2 != 0
        || n > INT32_MAX || k > INT32_MAX)
        return -1;
    for (int64_t i = 0; i < count; i++)
        if (tiles[i] < 0 || tiles[i] >= n / width) return -1;
    return panels_team(x, panels, NULL, NULL, y, m, n, k, tiles, count);
#else
    (void)x; (void)panels; (void)tiles; (void)count; (void)y; (void)m; (void)n; (void)k;
    return -1;
#endif
}
