/*
 * The panel layout of a bfloat16 linear weight, and y = x . w^T on it: the decode kernel's rows (decode_forward.c)
 * and any step's (linear_panels.c).
 *
 * A weight w[n][k] (n a multiple of PANEL_COLS, k even) is held as n / 16 panels: panel p holds output columns
 * 16p..16p+15, and for each pair of inputs (2kk, 2kk+1) their 16 columns' two weights side by side, 64 bytes. One
 * AVX512-BF16 dot product (vdpbf16ps) then takes a panel's 64 bytes against one x row's pair of inputs broadcast to
 * all 16 lanes, adding to 16 sums, one per output column: an outer product. The panels go in tiles of PANEL_GROUP,
 * whose 64-byte pieces interleave by pair: a tile is [k / 2][4][16][2] (the last one [k / 2][n / 16 % 4][16][2]
 * where n / 16 is not a multiple of 4), so the tile a kernel takes at once is one sequential stream of memory.
 * Four panels one after the other were four streams a panel's size apart (64 KB at k = 2,048, a power of two),
 * which a decode step of a few rows, bound by reading the weights, paid in full: on Zen 4 with 2 threads, the
 * tiles take 0.80-0.86x the time of one or two rows when the memory reads fast, 0.91-0.99x from 4 to 32 rows,
 * the same at 256 (bench.panel_layout; docs/history/benchmarks-rounds.md, "At 1B parameters (moved 2026-12-07)").
 *
 * Against the row layout (decode_forward.c's dot_block_bf16: a zmm of one weight row against a zmm of each x
 * row, each sum reduced across lanes at the end), x is read as 4-byte broadcasts (L1 hits, lighter on the load ports
 * than zmm loads) instead of full vectors, and no sum is reduced across lanes. A tile of up to PANEL_TILE_ROWS x
 * rows against a tile's panels keeps 24 sums in registers; the panels' k range is taken a k-block at a time, every
 * tile of rows reading the block before the next: at PANEL_KBLOCK inputs (a decode step's few rows) from L1, with
 * the next block's lines prefetched into L2 as each tile goes; at PANEL_MID_KBLOCK (24-255 rows) from L2, every
 * tile of rows prefetching its share of the next block; at PANEL_WIDE_KBLOCK (wide steps, bound by their products)
 * from L2.
 *
 * Each output's sum runs over k in one order (k-blocks in turn, pairs in turn within one), whatever the number
 * of rows or threads: a row's outputs do not depend on the other rows of the step.
 *
 * Measured on Zen 4, 2 threads, the 1B shape: the 16 layers' linears alone, from memory, 16 rows 39 ms against
 * the row layout's 53 and 32 rows 60 against 84 (a scratch harness, in alternating rounds); in L2, 900+ GFLOP/s
 * from 12 rows, near the machine's vdpbf16ps peak of about 990. The whole decode forward against the torch path:
 * bench.decode_kernel --model 1b; the layout's GEMM for any rows (linear_panels.c) against oneDNN's:
 * bench.panel_gemm; docs/history/benchmarks-rounds.md, "At 1B parameters (moved 2026-12-07)".
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
#define PANEL_KBLOCK 256    /* inputs per k-block of a step of a few rows: a tile's block is 32 KB, read from L1 */
/* From PANEL_SPREAD_ROWS rows a step's products weigh as much as its weights' reads. With one tile of rows
 * prefetching the next k-block, the reads ran under that tile's products alone and the other tiles of rows only
 * multiplied, out of the caches. Now a tile takes PANEL_MID_KBLOCK inputs a block, and each of its tiles of rows
 * prefetches its share of the next block's lines (g of G: the lines of pairs g, g + G, g + 2G, ...), so the reads
 * run under all of the block's products; the tiles of rows are made even (26 rows: 6, 5, 5, 5, 5) so that every
 * share is read over as long. Measured on Zen 4, 2 threads, weights from memory, against the build before it
 * (bench.panel_prefetch, alternating in one process): the 1B shape's linears 0.77x the time at 24 and 32 rows,
 * 0.87x at 48, 0.88x at 64, 0.95x at 128 (at 32 rows with blocks of 256 inputs 0.83-0.85x, of 512 0.81x, of
 * 4,096 0.86x); the embedded model's 0.88-0.89x at 24-48 rows, 0.92x at 64; the 1B decode kernel's whole forward
 * 0.92-0.95x at 24-64 rows. At 16 rows, bound by the reads, it lost 2-5%.
 * Steps of PANEL_WIDE_ROWS rows or more, bound by their products, take PANEL_WIDE_KBLOCK and the first tile of rows
 * prefetches: a tile's sums go to memory and back once per 4,096 inputs instead of 256 (bench.panel_gemm, Zen 4:
 * 0.94-0.98x oneDNN's speed from 256 rows at 256, 1.00-1.05x at 4,096). A k-block's size changes no sum: each
 * output's runs over k in one order. */
#ifndef PANEL_SPREAD_ROWS /* a benchmark's build may set these */
#define PANEL_SPREAD_ROWS 24
#endif
#ifndef PANEL_WIDE_ROWS
#define PANEL_WIDE_ROWS 256
#endif
#ifndef PANEL_MID_KBLOCK
#define PANEL_MID_KBLOCK 1024
#endif
#define PANEL_WIDE_KBLOCK 4096
/* How far ahead in its tile's stream a tile prefetches (besides the spread share above): for steps of up to
 * PANEL_NEAR_ROWS rows, which take a block's pairs fastest, PANEL_NEAR_PREFETCH bytes; below PANEL_SPREAD_ROWS,
 * PANEL_MID_PREFETCH bytes and PANEL_KBLOCK inputs (32 KB in a whole tile: the same inputs of the next block, which
 * the tile reads once every tile of rows has read this one); for wide steps, PANEL_KBLOCK inputs alone. Measured on
 * Zen 4, 2 threads, the 1B shape's linears from memory against the four-stream layout (which prefetched 8 KB ahead in
 * each panel), alternating in one process: 1 row 0.84x its time at 2 KB ahead in a fast hour of the memory (0.96-0.99x
 * in a slow one), 0.88x at 1 KB or none, 1.06x at 32 KB; 2 rows 0.78x at 2 KB; 3 rows 0.95-1.01x at 2 KB, 1.06x at 32
 * KB; 4 to 16 rows 0.94-0.99x at 4 KB and 32 KB, 0.95-1.05x at 32 KB alone, 1.1-1.7x at 2 KB alone; 256 rows 0.995x at
 * 32 KB alone, 1.01x with none, 1.04x at 4 KB and 32 KB (scratch builds of bench.panel_layout's comparison). */
#define PANEL_NEAR_ROWS 3
#define PANEL_NEAR_PREFETCH 2048
#define PANEL_MID_PREFETCH 4096
/* 0: each panel whole after the one before, four streams a panel's size apart (the layout before the tiles, which
 * bench.panel_layout builds to compare against): not a layout the engine packs */
#ifndef PANEL_INTERLEAVED
#define PANEL_INTERLEAVED 1
#endif

#include "compact_panels.h"

/* acc[r][0..nz*16) (+)= x[r][2kk0..2kk1) . panels p..p+nz of one tile over the same inputs, the tile's pairs
 * pair_stride elements apart (its panels' count x 32) and its panels z_stride apart (32); acc rows PANEL_GROUP * 16
 * apart. far (unless NULL): the lines a pair kk prefetches far ahead start at far + kk * far_step bytes, 64 apart
 * (the same tile's a k-block ahead in panels; the next chunk's records in compact panels) */
static inline __attribute__((always_inline)) void panel_tile(const int mr, const int nz, const uint16_t *xb,
                                                             int64_t ldx, const uint16_t *p, int64_t pair_stride,
                                                             int64_t z_stride, int kk0, int kk1, float *acc_out,
                                                             int first, int64_t near, const char *far,
                                                             int64_t far_step, const int spread, int share,
                                                             int shares)
{
    int next = kk0 + share; /* spread: the next pair whose lines far ahead this tile of rows prefetches */
    __m512 acc[PANEL_TILE_ROWS][PANEL_GROUP];
    for (int r = 0; r < mr; r++)
        for (int z = 0; z < nz; z++)
            acc[r][z] = first ? _mm512_setzero_ps()
                              : _mm512_loadu_ps(acc_out + (r * PANEL_GROUP + z) * PANEL_COLS);
    for (int kk = kk0; kk < kk1; kk++) {
        __m512bh wv[PANEL_GROUP];
        const uint16_t *pk = p + (int64_t)kk * pair_stride;
        for (int z = 0; z < nz; z++) {
            const uint16_t *pz = pk + z * z_stride;
            if (near) __builtin_prefetch((const char *)pz + near, 0, 2);
            if (far != NULL && !spread) __builtin_prefetch(far + kk * far_step + z * 64, 0, 2);
            __m512i raw = _mm512_loadu_si512(pz);
            __asm__("" : "+v"(raw)); /* one load per panel and pair, kept in a register for every row */
            wv[z] = (__m512bh)raw;
        }
        if (spread && kk == next) { /* this tile of rows' share of the lines far ahead: one pair in every shares */
            for (int z = 0; z < nz; z++) __builtin_prefetch(far + kk * far_step + z * 64, 0, 2);
            next += shares;
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

#define PANEL_TILE_CASE(SP, MR, NZ) \
    case (SP) * 64 + (MR) * 8 + (NZ): \
        panel_tile(MR, NZ, xb, ldx, p, pair_stride, z_stride, kk0, kk1, acc_out, first, near, far, far_step, SP, \
                   share, shares); \
        break;
#define PANEL_TILE_ROW(SP, MR) \
    PANEL_TILE_CASE(SP, MR, 1) PANEL_TILE_CASE(SP, MR, 2) PANEL_TILE_CASE(SP, MR, 3) PANEL_TILE_CASE(SP, MR, 4)
#define PANEL_TILE_ROWS_OF(SP) \
    PANEL_TILE_ROW(SP, 1) PANEL_TILE_ROW(SP, 2) PANEL_TILE_ROW(SP, 3) PANEL_TILE_ROW(SP, 4) PANEL_TILE_ROW(SP, 5) \
    PANEL_TILE_ROW(SP, 6)

/* panel_tile with mr, nz and whether its tiles of rows share the prefetches as constants: a copy per shape, so the
 * sums stay in registers, and a step that does not share them runs no test for it (one per pair cost steps of
 * 8-16 rows 2-10%, bench.panel_prefetch at the 3B shape) */
static void panel_tile_any(int mr, int nz, const uint16_t *xb, int64_t ldx, const uint16_t *p, int64_t pair_stride,
                           int64_t z_stride, int kk0, int kk1, float *acc_out, int first, int64_t near,
                           const char *far, int64_t far_step, int share, int shares)
{
    switch ((shares > 1) * 64 + mr * 8 + nz) {
    PANEL_TILE_ROWS_OF(0) PANEL_TILE_ROWS_OF(1)
    default: break;
    }
}

#define COMPACT_FUSED_ROWS 3
/* acc[r][0..nz*16) = x[r][0..k) . the first nz panels of a tile of compact panels (compact_panels.h, c at its
 * first pair), for mr (<= COMPACT_FUSED_ROWS) rows: each pair's lines decoded into registers and multiplied at once,
 * the sums over k in the panels' order */
static inline __attribute__((always_inline)) void compact_rows(const int mr, const int nz, const uint16_t *xb,
                                                               int64_t ldx, compact_tile_t *c, int k, float *acc_out)
{
    __m512 acc[COMPACT_FUSED_ROWS][PANEL_GROUP];
    for (int r = 0; r < mr; r++)
        for (int z = 0; z < nz; z++) acc[r][z] = _mm512_setzero_ps();
    for (int kk = 0; kk < k / 2; kk++) {
        __m512i w[PANEL_GROUP];
        compact_pair(c, kk, w, COMPACT_AHEAD);
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, xb + r * ldx + 2 * kk, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int z = 0; z < nz; z++) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], xv, (__m512bh)w[z]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(acc_out + (r * PANEL_GROUP + z) * PANEL_COLS, acc[r][z]);
}

#define COMPACT_ROWS_CASE(MR, NZ) \
    case (MR) * 8 + (NZ): compact_rows(MR, NZ, xb, k, &c, k, acc); break;
#define COMPACT_ROWS_OF(MR) \
    COMPACT_ROWS_CASE(MR, 1) COMPACT_ROWS_CASE(MR, 2) COMPACT_ROWS_CASE(MR, 3) COMPACT_ROWS_CASE(MR, 4)

/* acc[r][0..nz*16) = x[r] . tile t's first nz panels, for m rows [m][k]: up to COMPACT_FUSED_ROWS rows with the
 * lines in registers (compact_rows; from 4 rows, their sums and the decoder's registers do not fit the 32 zmm); more,
 * a chunk of pairs decoded into L1 as panels, then every tile of rows over it (panel_tile), each prefetching its
 * share of the next chunk's records (all of them where there is one tile of rows), so that the reads run under all
 * of the chunk's products */
static void compact_linear_tile(const uint16_t *xb, int m, int k, const uint8_t *blob, int t, int nz, float *acc)
{
    compact_tile_t c = compact_tile_at(blob, k, t, 0);
    if (m <= COMPACT_FUSED_ROWS) {
        switch (m * 8 + nz) {
        COMPACT_ROWS_OF(1) COMPACT_ROWS_OF(2) COMPACT_ROWS_OF(3)
        default: break;
        }
        return;
    }
    __m512i scratch[COMPACT_CHUNK_PAIRS * PANEL_GROUP];
    const int tiles_of_rows = (m + PANEL_TILE_ROWS - 1) / PANEL_TILE_ROWS;
    for (int k0 = 0; k0 < k; k0 += 2 * COMPACT_CHUNK_PAIRS) {
        const int k1 = k - k0 < 2 * COMPACT_CHUNK_PAIRS ? k : k0 + 2 * COMPACT_CHUNK_PAIRS;
        for (int kk = k0 / 2; kk < k1 / 2; kk++) compact_pair(&c, kk, scratch + (kk - k0 / 2) * PANEL_GROUP, 0);
        const char *next = (const char *)c.records + (int64_t)(k1 / 2) * COMPACT_RECORD;
        for (int g = 0, r0 = 0; g < tiles_of_rows; g++) { /* even tiles of rows: their shares take as long */
            const int left = tiles_of_rows - g, mr = (m - r0 + left - 1) / left;
            panel_tile_any(mr, nz, xb + (int64_t)r0 * k + k0, k, (const uint16_t *)scratch, PANEL_GROUP * 32, 32, 0,
                           (k1 - k0) / 2, acc + (int64_t)r0 * PANEL_GROUP * PANEL_COLS, k0 == 0, 0, next,
                           COMPACT_RECORD, g, tiles_of_rows);
            r0 += mr;
        }
    }
}

/* AMX tiles (Intel Xeon from Sapphire Rapids): a panel's 16 pairs of inputs are 16 rows of 64 bytes, a tile's
 * pair_stride apart, which is the B operand of tdpbf16ps as it stands (16 columns, each row a pair of inputs per
 * column); x's rows, 32 inputs at a time, are its A operand. So steps of PANEL_AMX_ROWS rows or more multiply the
 * panels with tiles: up to 16 rows against a tile's 4 panels, 4 sum tiles of 16 x 16 floats, over k 32 inputs at a
 * time (a k that is not a multiple of 32 takes its last pairs through panel_tile). Measured on an AMX Xeon, 2 cores,
 * the 1B shape's linears (bench.panel_gemm): vdpbf16ps reaches about 200 GFLOP/s there, oneDNN's tiles 1.7
 * TFLOP/s. The tiles add each pair's two products in their own order (each output's sums still run over k in one
 * order for a given row count), so a row's outputs from a step of PANEL_AMX_ROWS rows or more differ in rounding
 * from one of fewer: engine.deterministic takes a build with PANEL_AMX_ROWS 0 (no tiles). The kernel asks Linux for
 * the tiles' state once (amx.h); where it is refused, every step takes vdpbf16ps. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && PANEL_INTERLEAVED
#ifndef PANEL_AMX_ROWS
#define PANEL_AMX_ROWS 4
#endif
#else
#undef PANEL_AMX_ROWS
#define PANEL_AMX_ROWS 0
#endif

#if PANEL_AMX_ROWS > 0
#include "amx.h"

#define PANEL_AMX_M 16 /* rows of a tile */
#ifndef PANEL_AMX_AHEAD
#define PANEL_AMX_AHEAD 8192
#endif

/* tiles 0-3: the sums of mr rows x 16 floats of 4 panels; 4: mr rows of x over 32 inputs; 5-7: a panel's 16 pairs */
static void panel_amx_configure(int mr)
{
    const uint8_t m = (uint8_t)mr, rows[8] = {m, m, m, m, m, 16, 16, 16};
    amx_configure(rows);
}

/* acc[r][0..nz*16) = x[r][0..2 * pairs) . panels p..p+nz of one tile (pairs a multiple of 16), for the mr rows the
 * tiles are configured for; acc rows PANEL_GROUP * 16 floats apart */
static void panel_amx_rows(int nz, const uint16_t *xb, int64_t ldx, const uint16_t *p, int64_t pair_stride,
                           int pairs, float *acc)
{
    const int64_t bstride = pair_stride * 2, astride = ldx * 2, cstride = PANEL_GROUP * PANEL_COLS * 4;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kk = 0; kk < pairs; kk += 16) {
        const uint16_t *pk = p + (int64_t)kk * pair_stride;
#if PANEL_AMX_AHEAD > 0
        for (int64_t b = 0; b < bstride * 16; b += 64) __builtin_prefetch((const char *)pk + PANEL_AMX_AHEAD + b, 0, 2);
#endif
        _tile_loadd(4, xb + 2 * kk, astride);
        _tile_loadd(5, pk, bstride);
        _tile_dpbf16ps(0, 4, 5);
        if (nz > 1) {
            _tile_loadd(6, pk + 32, bstride);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nz > 2) {
            _tile_loadd(7, pk + 64, bstride);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nz > 3) {
            _tile_loadd(5, pk + 96, bstride);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, acc, cstride);
    if (nz > 1) _tile_stored(1, acc + PANEL_COLS, cstride);
    if (nz > 2) _tile_stored(2, acc + 2 * PANEL_COLS, cstride);
    if (nz > 3) _tile_stored(3, acc + 3 * PANEL_COLS, cstride);
}
#endif

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
 * unused), inside a parallel region: each thread takes a contiguous run of panels (the piece of a tile at either
 * end of its run too, so the threads' shares stay even), and all meet at a barrier at the end (as an omp for
 * would). acc: this thread's scratch, max_rows * PANEL_GROUP * 16 floats. The k-block and the prefetches follow
 * m (panels_kblock and the comments above).
 */
static inline int panels_kblock(int m)
{
    return m >= PANEL_WIDE_ROWS ? PANEL_WIDE_KBLOCK : m >= PANEL_SPREAD_ROWS ? PANEL_MID_KBLOCK : PANEL_KBLOCK;
}

static void panels_linear(const uint16_t *xb, int m, int k, const uint16_t *panels, const uint8_t *compact, int n,
                          const void *bias, int bias_bf16, float *y, uint16_t *y16, int accumulate, float *acc)
{
    const int np = n / PANEL_COLS, t = omp_get_thread_num(), nt = omp_get_num_threads();
    /* compact panels split by whole tiles (a tile's records are decoded whole) */
    const int64_t unit = compact != NULL ? PANEL_GROUP : 1, units = (np + unit - 1) / unit;
    const int64_t stop = units * (t + 1) / nt * unit;
    const int begin = (int)(units * t / nt * unit), end = (int)(stop < np ? stop : np);
    const int whole = np / PANEL_GROUP; /* tiles of PANEL_GROUP panels; the rest make one narrower tile */
    const int kblock = panels_kblock(m), tiles_of_rows = (m + PANEL_TILE_ROWS - 1) / PANEL_TILE_ROWS;
    /* whether the tiles of rows share the next k-block's lines (the layout before the tiles never did) */
    const int spread = PANEL_INTERLEAVED && m >= PANEL_SPREAD_ROWS && m < PANEL_WIDE_ROWS;
#if PANEL_AMX_ROWS > 0
    const int amx = compact == NULL && m >= PANEL_AMX_ROWS && amx_ready();
    int configured = 0; /* the rows the tiles are configured for in this call, 0: none yet */
#endif
    for (int p0 = begin, nz; p0 < end; p0 += nz) {
#if PANEL_INTERLEAVED
        const int tile = p0 / PANEL_GROUP, first = tile * PANEL_GROUP;
        const int width = tile < whole ? PANEL_GROUP : np - first; /* the tile's panels */
        nz = (end < first + width ? end : first + width) - p0;     /* this thread's of them, from p0 */
        const int64_t pair_stride = (int64_t)width * 2 * PANEL_COLS, z_stride = 2 * PANEL_COLS;
        const uint16_t *p = panels + (int64_t)first * k * PANEL_COLS + (int64_t)(p0 - first) * 2 * PANEL_COLS;
        /* bytes ahead a tile prefetches */
        const int64_t near = m <= PANEL_NEAR_ROWS ? PANEL_NEAR_PREFETCH
                             : m < PANEL_SPREAD_ROWS ? PANEL_MID_PREFETCH : 0;
        const int64_t far = m <= PANEL_NEAR_ROWS ? 0 : (int64_t)(spread ? kblock : PANEL_KBLOCK) * pair_stride;
#else
        (void)whole;
        nz = end - p0 < PANEL_GROUP ? end - p0 : PANEL_GROUP;
        const int64_t pair_stride = 2 * PANEL_COLS, z_stride = (int64_t)k * PANEL_COLS;
        const uint16_t *p = panels + (int64_t)p0 * k * PANEL_COLS;
        const int64_t near = 8192, far = 0; /* what this layout prefetched: 8 KB ahead in each panel */
#endif
#if PANEL_INTERLEAVED
        if (compact != NULL) {
            compact_linear_tile(xb, m, k, compact, tile, nz, acc);
        } else
#endif
#if PANEL_AMX_ROWS > 0
        if (amx) {
            const int pairs = k / 32 * 16; /* the pairs the tiles take; the rest through panel_tile */
            /* each tile of rows over all the pairs: the panels' 4 sum tiles stay in the tiles (taking the pairs a
             * k-block at a time, every tile of rows adding a block to its sums from memory, cost 1.3x at 256-512
             * rows) */
            for (int r0 = 0; r0 < m && pairs; r0 += PANEL_AMX_M) {
                const int mr = m - r0 < PANEL_AMX_M ? m - r0 : PANEL_AMX_M;
                if (mr != configured) panel_amx_configure(configured = mr);
                panel_amx_rows(nz, xb + (int64_t)r0 * k, k, p, pair_stride, pairs,
                               acc + (int64_t)r0 * PANEL_GROUP * PANEL_COLS);
            }
            for (int r0 = 0; pairs < k / 2 && r0 < m; r0 += PANEL_TILE_ROWS) /* the pairs past the tiles' */
                panel_tile_any(m - r0 < PANEL_TILE_ROWS ? m - r0 : PANEL_TILE_ROWS, nz, xb + (int64_t)r0 * k, k, p,
                               pair_stride, z_stride, pairs, k / 2, acc + (int64_t)r0 * PANEL_GROUP * PANEL_COLS,
                               pairs == 0, 0, NULL, 0, 0, 1);
        } else
#endif
        for (int k0 = 0; k0 < k; k0 += kblock) {
            const int k1 = k - k0 < kblock ? k : k0 + kblock;
            for (int g = 0, r0 = 0; g < tiles_of_rows; g++) {
                /* spread: even tiles of rows (their shares of the prefetches then take as long); else full ones */
                const int left = tiles_of_rows - g;
                const int mr = spread ? (m - r0 + left - 1) / left
                                      : m - r0 < PANEL_TILE_ROWS ? m - r0 : PANEL_TILE_ROWS;
                panel_tile_any(mr, nz, xb + (int64_t)r0 * k, k, p, pair_stride, z_stride, k0 / 2, k1 / 2,
                               acc + (int64_t)r0 * PANEL_GROUP * PANEL_COLS, k0 == 0, near,
                               far ? (const char *)p + far : NULL, 2 * pair_stride,
                               spread ? g : 0, spread ? tiles_of_rows : 1);
                r0 += mr;
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
#if PANEL_AMX_ROWS > 0
    if (configured) _tile_release();
#endif
    #pragma omp barrier
}
#endif

#endif
