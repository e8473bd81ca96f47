/*
 * y = x @ w^T in int8 with int32 sums (W8A8, common/engine/quantization.py): a decode step's few rows with
 * AVX512-VNNI, any number of rows on AMX tiles.
 *
 *   tessera_int8_gemm(x [m, k] int8, w [n, k] int8 (row-major, as the model keeps it), y [m, n] int32, m, n, k)
 *
 * The same sums as torch._int_mm(x, w.t()), exactly (integer arithmetic), but at a decode step's 2-64 rows,
 * where torch's int8 matmul reaches a fraction of the machine (bench/int8_gemm.py has the measured crossover).
 * AVX512-VNNI's vpdpbusd multiplies unsigned by signed bytes, four products into each int32 lane: x goes
 * in as x + 128 (its sign bit flipped, so -127..127 becomes 1..255) and 128 * sum(w_row) comes off each
 * sum. The output rows are split over torch's OpenMP threads in blocks of four weight rows; a block is read
 * from memory once, and the x rows, four at a time, find it in L1 or L2. Returns -1 (writing nothing) where
 * the CPU or the shape is not served: no AVX512-VNNI at build time, k not a multiple of 64, or m too large.
 *
 * On a CPU with AMX-INT8 (Intel Xeon from Sapphire Rapids) calls of INT8_AMX_ROWS rows or more multiply on the
 * tiles instead (tdpbssd, signed by signed bytes, 16 x 16 x 64 products a call), at any m: a weight block of 16
 * rows is a tile as the model keeps it (16 rows of 64 bytes, k apart), x's rows are copied once per call into the
 * tiles' other operand (per 64 inputs, 16 rows of 4 bytes for each of 16 x rows: a 16 x 16 transpose of 4-byte
 * words), and the sums (16 weight rows x 16 x rows) are transposed back into y. Work items are pairs of weight
 * blocks (32 rows), each against pairs of x blocks (2 x 2 sum tiles over the whole k); x's rows go INT8_AMX_MC at
 * a time, so their copy stays in L2 while the threads' weight pairs meet it. Calls of many rows against a short k
 * swap the operands (int8_amx_item_wide: x as A, each weight pair packed as B). Integer sums are exact, so this
 * gives the same int32 as the path without tiles and as torch._int_mm.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_ROWS 256 /* without tiles */
#define W_BLOCK 4 /* weight rows per work item */
#define W_PREFETCH_AHEAD 4 /* weight blocks prefetched ahead into L2, as decode_forward.c does */

/* y[r][j] for every x row r and the weight rows j0..j1 (a matrix's last rows, past its whole blocks), plainly */
static __attribute__((unused)) void int8_rows_plain(const int8_t *x, const int8_t *w, int32_t *y, int m, int n,
                                                    int k, int j0, int j1)
{
    for (int j = j0; j < j1; j++)
        for (int r = 0; r < m; r++) {
            int32_t s = 0;
            for (int i = 0; i < k; i++) s += (int32_t)x[(int64_t)r * k + i] * w[(int64_t)j * k + i];
            y[(int64_t)r * n + j] = s;
        }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* The 16 lane-sums of v[0..15] in one vector (lane i: the sum of v[i]'s lanes): a transpose-and-add. */
static inline __m512i sum16x16_epi32(const __m512i *v)
{
    __m512i p[8], c[4], e[2];
    for (int j = 0; j < 8; j++)
        p[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                                _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++)
        c[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * j], p[2 * j + 1]),
                                _mm512_unpackhi_epi64(p[2 * j], p[2 * j + 1]));
    for (int j = 0; j < 2; j++)
        e[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2 * j], c[2 * j + 1], 0x88),
                                _mm512_shuffle_i32x4(c[2 * j], c[2 * j + 1], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(e[0], e[1], 0x88), _mm512_shuffle_i32x4(e[0], e[1], 0xdd));
}

/* sums[r * 4 + b] = (x[r] + 128) . w[j + b] for MR (<= 4) x rows; with rowsum, also wsum[b] = sum(w[j + b]) */
static inline __attribute__((always_inline)) void block(const int8_t *x, const int8_t *w0, int k, const int mr,
                                                        const int rowsum, int32_t *sums, int32_t *wsum)
{
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512i acc[4][W_BLOCK], ws[W_BLOCK];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < W_BLOCK; b++) acc[r][b] = _mm512_setzero_si512();
    for (int b = 0; b < W_BLOCK; b++) ws[b] = _mm512_setzero_si512();
    for (int i = 0; i < k; i += 64) {
        __m512i wv[W_BLOCK];
        for (int b = 0; b < W_BLOCK; b++) {
            __builtin_prefetch(w0 + (int64_t)(W_PREFETCH_AHEAD * W_BLOCK + b) * k + i, 0, 2);
            wv[b] = _mm512_loadu_si512(w0 + (int64_t)b * k + i);
            __asm__("" : "+v"(wv[b])); /* keep it in a register for every x row */
            if (rowsum) ws[b] = _mm512_dpbusd_epi32(ws[b], ones, wv[b]);
        }
        for (int r = 0; r < mr; r++) {
            __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(x + (int64_t)r * k + i), flip);
            for (int b = 0; b < W_BLOCK; b++) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], xv, wv[b]);
        }
    }
    __m512i v[16];
    for (int i = 0; i < 16; i++) v[i] = i < mr * W_BLOCK ? acc[i / W_BLOCK][i % W_BLOCK] : _mm512_setzero_si512();
    _mm512_storeu_si512(sums, sum16x16_epi32(v));
    if (rowsum) {
        for (int i = 0; i < 16; i++) v[i] = i < W_BLOCK ? ws[i] : _mm512_setzero_si512();
        int32_t all[16];
        _mm512_storeu_si512(all, sum16x16_epi32(v));
        for (int b = 0; b < W_BLOCK; b++) wsum[b] = all[b];
    }
}
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <stdlib.h>
#include <omp.h>
#include <unistd.h>

#include "amx.h"
#include "simd.h"

#ifndef INT8_AMX_ROWS
#define INT8_AMX_ROWS 4 /* the fewest rows that take the tiles */
#endif
/* Which operand x is. With the weights as A, each weight pair transposes its 4 sum tiles per pair of x blocks: m / 8
 * transposes; with x as A, it packs its two blocks as B once per pass instead: k / 32. So x is A (wide) from
 * INT8_AMX_WIDE_ROWS rows where m >= k / 4 (bench.int8_gemm: at 256-2048 rows, 1.2-1.9x the other way at 135M's k
 * of 576-1536, 1.3-1.6x at 1024-2048 rows of 1B's k of 2048; the other way ahead below) */
#ifndef INT8_AMX_WIDE_ROWS
#define INT8_AMX_WIDE_ROWS 128
#endif
#ifndef INT8_AMX_MC
#define INT8_AMX_MC 256 /* x rows per pass over the weights, weights as A: their packed copy stays in L2 */
#endif
#ifndef INT8_AMX_WIDE_MC
#define INT8_AMX_WIDE_MC 1024 /* x rows per pass, x as A: every pass packs each weight pair again */
#endif
/* A y from this size on is written past the caches: half the last-level cache (at least L2's 2 MB). Every y is read
 * again at once (tessera_dequantize_rows, tessera_silu_mul_quantize): one that fits the L3 is read from there, one
 * streamed past it from memory. Streamed from 2 MB, a 1,024-token prompt step of the int8 135M model took 1.06-1.08x
 * the time and one of the 1B shape 1.02x, its consumers' reads of the sums twice as long (Intel Xeon with AMX, its
 * L3 480 MB; docs/history/benchmarks-rounds.md, "Decode attention and the int8 sums: what the caches hold"); the matmul
 * alone was 1.3-1.5x faster streamed. -D sets a size for A/B builds. */
#ifndef INT8_AMX_STREAM_BYTES
#define INT8_AMX_STREAM_BYTES int8_stream_from
#endif
static int64_t int8_stream_from = 2 << 20;

/* found once, as the library loads, before any call can read it */
__attribute__((constructor)) static void int8_find_stream_bytes(void)
{
#ifdef _SC_LEVEL3_CACHE_SIZE
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE); /* 0 or -1 where the C library does not know it */
    if (l3 / 2 > int8_stream_from) int8_stream_from = l3 / 2;
#endif
}

#ifndef INT8_AMX_AHEAD
#define INT8_AMX_AHEAD 512 /* bytes ahead prefetched in each weight row, on a block's first pass */
#endif


/* a block of 16 rows of x or of the weights (mr of them real, the rest zero), k apart, as the tiles' B operand for
 * each 64 inputs: xp[c][g][j] = the 4 bytes x[j][64c + 4g .. 64c + 4g + 3], one KB per c */
static void int8_amx_pack(const int8_t *x, int64_t k, int mr, int8_t *xp)
{
    for (int64_t c = 0; c < k / 64; c++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < mr ? _mm512_loadu_si512(x + (int64_t)j * k + 64 * c) : _mm512_setzero_si512();
        transpose16x16(r);
        for (int g = 0; g < 16; g++) _mm512_storeu_si512(xp + c * 1024 + g * 64, r[g]);
    }
}

/* sum tiles stored but not yet written to y: up to 4 tiles of 16 weight rows x 16 x rows, each with where it goes.
 * They are written after the next tiles' products are issued, so the transposes run while the tiles multiply. */
typedef struct {
    int32_t buf[4][256] __attribute__((aligned(64)));
    int32_t *y[4]; /* y at the tile's first x row and weight row; NULL: no tile there */
    int rows[4];   /* its x rows (<= 16) */
    int stream;    /* 1: y is written past the caches (non-temporal stores), for a y larger than L2 */
} int8_amx_out_t;

/* writes the tiles out holds into y (row stride n), transposed, and empties it */
static void int8_amx_flush(int8_amx_out_t *out, int64_t n)
{
    for (int t = 0; t < 4; t++) {
        if (out->y[t] == NULL) continue;
        __m512i v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_load_si512(out->buf[t] + 16 * i);
        transpose16x16(v);
        if (out->stream)
            for (int j = 0; j < out->rows[t]; j++) _mm512_stream_si512((__m512i *)(out->y[t] + (int64_t)j * n), v[j]);
        else
            for (int j = 0; j < out->rows[t]; j++) _mm512_storeu_si512(out->y[t] + (int64_t)j * n, v[j]);
        out->y[t] = NULL;
    }
}

/* y[r][j0 .. j0 + 16 * nw) for the x rows of one pass (m of them, packed in xp), nw (1 or 2) weight blocks from
 * row j0: pairs of x blocks, each over the whole k in 2 x 2 sum tiles (tiles 0-3; 4-5: the weight blocks, 6-7:
 * the x blocks); the sums go through out (written at the next pair's, or the caller's, flush) */
static void int8_amx_item(const int8_t *w, int64_t k, int nw, const int8_t *xp, int m, int32_t *y, int64_t n,
                          int64_t j0, int8_amx_out_t *out)
{
    const int64_t kc = k / 64, xblock = kc * 1024;
    const int8_t *w0 = w + j0 * k, *w1 = w0 + 16 * k;
    for (int b = 0; b * 16 < m; b += 2) {
        const int two = (b + 1) * 16 < m;
        const int8_t *x0 = xp + b * xblock, *x1 = x0 + xblock;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < kc; c++) {
            if (b == 0 && INT8_AMX_AHEAD > 0 && 64 * c + INT8_AMX_AHEAD < k)
                for (int i = 0; i < 16 * nw; i++) __builtin_prefetch(w0 + i * k + 64 * c + INT8_AMX_AHEAD, 0, 1);
            _tile_loadd(4, w0 + 64 * c, k);
            _tile_loadd(6, x0 + 1024 * c, 64);
            _tile_dpbssd(0, 4, 6);
            if (two) {
                _tile_loadd(7, x1 + 1024 * c, 64);
                _tile_dpbssd(1, 4, 7);
            }
            if (nw > 1) {
                _tile_loadd(5, w1 + 64 * c, k);
                _tile_dpbssd(2, 5, 6);
                if (two) _tile_dpbssd(3, 5, 7);
            }
        }
        int8_amx_flush(out, n); /* the previous pair's, while these tiles multiply */
        const int mr0 = m - b * 16 < 16 ? m - b * 16 : 16, mr1 = m - (b + 1) * 16 < 16 ? m - (b + 1) * 16 : 16;
        int32_t *y0 = y + (int64_t)b * 16 * n + j0, *y1 = y0 + 16 * n;
        _tile_stored(0, out->buf[0], 64);
        out->y[0] = y0, out->rows[0] = mr0;
        if (two) {
            _tile_stored(1, out->buf[1], 64);
            out->y[1] = y1, out->rows[1] = mr1;
        }
        if (nw > 1) {
            _tile_stored(2, out->buf[2], 64);
            out->y[2] = y0 + 16, out->rows[2] = mr0;
            if (two) {
                _tile_stored(3, out->buf[3], 64);
                out->y[3] = y1 + 16, out->rows[3] = mr1;
            }
        }
    }
}

/* y[r][j0 .. j0 + 16 * nw) for the x rows of one pass (m of them, a multiple of 16, row-major in x), nw (1 or 2)
 * weight blocks from row j0, the weight blocks first packed into wp (the tiles' B operand, 2 * k bytes): pairs of
 * x blocks over the whole k in 2 x 2 sum tiles (tiles 0-3; 4-5: the x blocks, 6-7: the weight blocks), each tile
 * of 16 x rows x 16 weight rows stored as y holds it (no transposes; through buf when y is written past the
 * caches) */
static void int8_amx_item_wide(const int8_t *w, int64_t k, int nw, const int8_t *x, int m, int32_t *y, int64_t n,
                               int64_t j0, int8_t *wp, int stream)
{
    const int64_t kc = k / 64;
    for (int b = 0; b < nw; b++) int8_amx_pack(w + (j0 + 16 * b) * k, k, 16, wp + b * kc * 1024);
    const int8_t *wp0 = wp, *wp1 = wp + kc * 1024;
    int32_t buf[256] __attribute__((aligned(64)));
    for (int r = 0; r < m; r += 32) {
        const int two = r + 16 < m;
        const int8_t *x0 = x + (int64_t)r * k, *x1 = x0 + 16 * k;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < kc; c++) {
            _tile_loadd(4, x0 + 64 * c, k);
            _tile_loadd(6, wp0 + 1024 * c, 64);
            _tile_dpbssd(0, 4, 6);
            if (nw > 1) {
                _tile_loadd(7, wp1 + 1024 * c, 64);
                _tile_dpbssd(1, 4, 7);
            }
            if (two) {
                _tile_loadd(5, x1 + 64 * c, k);
                _tile_dpbssd(2, 5, 6);
                if (nw > 1) _tile_dpbssd(3, 5, 7);
            }
        }
        int32_t *y0 = y + (int64_t)r * n + j0, *y1 = y0 + 16 * n;
#define INT8_AMX_WIDE_STORE(t, yt)                                                                                 \
    do {                                                                                                           \
        if (stream) {                                                                                              \
            _tile_stored(t, buf, 64);                                                                              \
            for (int i_ = 0; i_ < 16; i_++)                                                                        \
                _mm512_stream_si512((__m512i *)((yt) + (int64_t)i_ * n), _mm512_load_si512(buf + 16 * i_));       \
        } else {                                                                                                   \
            _tile_stored(t, (yt), n * 4);                                                                          \
        }                                                                                                          \
    } while (0)
        INT8_AMX_WIDE_STORE(0, y0);
        if (nw > 1) INT8_AMX_WIDE_STORE(1, y0 + 16);
        if (two) {
            INT8_AMX_WIDE_STORE(2, y1);
            if (nw > 1) INT8_AMX_WIDE_STORE(3, y1 + 16);
        }
#undef INT8_AMX_WIDE_STORE
    }
}

/* x's packed copy (the rows the narrow items take), per calling thread, grown to the largest call's and kept; and
 * per OpenMP thread, the weight pair a wide item packs */
static __thread int8_t *int8_amx_buffer, *int8_amx_wbuffer;
static __thread size_t int8_amx_capacity, int8_amx_wcapacity;

static int8_t *int8_amx_grow(int8_t **buffer, size_t *capacity, size_t need)
{
    if (need > *capacity) {
        free(*buffer);
        *buffer = aligned_alloc(64, need);
        *capacity = *buffer != NULL ? need : 0;
    }
    return *buffer;
}

static int int8_amx_gemm(const int8_t *x, const int8_t *w, int32_t *y, int m, int n, int k)
{
    /* wide: the whole blocks of 16 rows take x as the tiles' A operand, each weight pair packed once per pass; the
     * rows past them (and every row of a narrow call) are packed and take the weights as A */
    const int m16 = m >= INT8_AMX_WIDE_ROWS && 4 * (int64_t)m >= k ? m / 16 * 16 : 0, tail = m - m16;
    const int tail_blocks = (tail + 15) / 16;
    int8_t *xp = int8_amx_grow(&int8_amx_buffer, &int8_amx_capacity, (size_t)(tail_blocks > 0 ? tail_blocks : 1)
                               * 16 * k);
    if (xp == NULL) return -1;
    /* non-temporal stores need y's rows 64-byte aligned; a y this large leaves the core's caches anyway, and
     * writing it past them saves reading each line before it is written (1.3-1.5x at 256-1024 rows of the 1B
     * shape's gate/up and LM head, bench.int8_gemm) */
    const int stream = (int64_t)m * n * 4 >= INT8_AMX_STREAM_BYTES && ((uintptr_t)y & 63) == 0 && n % 16 == 0;
    const int wblocks = n / 16, items = (wblocks + 1) / 2;
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        #pragma omp for schedule(static)
        for (int b = 0; b < tail_blocks; b++)
            int8_amx_pack(x + (int64_t)(m16 + b * 16) * k, k, tail - b * 16 < 16 ? tail - b * 16 : 16,
                          xp + (int64_t)b * 16 * k);
        int8_t *wp = m16 > 0 ? int8_amx_grow(&int8_amx_wbuffer, &int8_amx_wcapacity, (size_t)32 * k) : NULL;
        failed = m16 > 0 && wp == NULL;
        const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        amx_configure(rows);
        int8_amx_out_t out = {.y = {NULL, NULL, NULL, NULL}, .stream = stream};
        /* wide passes of INT8_AMX_WIDE_MC rows, the tail riding in the last (the weight pair still in L2); or
         * narrow passes of INT8_AMX_MC rows */
        const int per_pass = m16 > 0 ? INT8_AMX_WIDE_MC : INT8_AMX_MC, rows_passed = m16 > 0 ? m16 : tail;
        const int passes = (rows_passed + per_pass - 1) / per_pass;
        for (int pass = 0; pass < passes; pass++) {
            const int r0 = pass * per_pass, mc = rows_passed - r0 < per_pass ? rows_passed - r0 : per_pass;
            #pragma omp for schedule(static)
            for (int it = 0; it < items; it++) {
                const int nw = 2 * it + 1 < wblocks ? 2 : 1;
                if (m16 == 0)
                    int8_amx_item(w, k, nw, xp + (int64_t)r0 * k, mc, y + (int64_t)r0 * n, n, (int64_t)it * 32, &out);
                else if (wp != NULL)
                    int8_amx_item_wide(w, k, nw, x + (int64_t)r0 * k, mc, y + (int64_t)r0 * n, n, (int64_t)it * 32,
                                       wp, stream);
                if (m16 > 0 && tail > 0 && pass == passes - 1)
                    int8_amx_item(w, k, nw, xp, tail, y + (int64_t)m16 * n, n, (int64_t)it * 32, &out);
            }
            int8_amx_flush(&out, n); /* this thread's last tiles of the pass */
            if (stream) _mm_sfence(); /* the non-temporal stores seen before the call returns */
        }
        _tile_release();
        #pragma omp single /* the last rows of a matrix whose height is not a multiple of 16 */
        int8_rows_plain(x, w, y, m, n, k, wblocks * 16, n);
    }
    return failed ? -1 : 0;
}
#define INT8_AMX 1
#else
#define INT8_AMX 0
#endif

/* the fewest rows a call multiplies on the tiles: INT8_AMX_ROWS where the build has them and Linux grants them,
 * else 0 (no tiles) */
int tessera_int8_gemm_amx_rows(void)
{
#if INT8_AMX
    return amx_ready() ? INT8_AMX_ROWS : 0;
#else
    return 0;
#endif
}

/* the most rows a call takes: any where the tiles serve it, else MAX_ROWS (0: none, without AVX512-VNNI) */
int tessera_int8_gemm_max_rows(void)
{
#if INT8_AMX
    if (amx_ready()) return 1 << 30;
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    return MAX_ROWS;
#else
    return 0;
#endif
}

int tessera_int8_gemm(const int8_t *x, const int8_t *w, int32_t *y, int m, int n, int k)
{
#if INT8_AMX
    if (m >= INT8_AMX_ROWS && n >= 1 && k >= 64 && k % 64 == 0 && amx_ready())
        return int8_amx_gemm(x, w, y, m, n, k);
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    if (m < 1 || m > MAX_ROWS || n < 1 || k < 64 || k % 64 != 0) return -1;
    #pragma omp parallel for schedule(static)
    for (int jb = 0; jb < n; jb += W_BLOCK) {
        if (n - jb < W_BLOCK) { /* the last rows of a matrix whose height is not a multiple of 4 */
            int8_rows_plain(x, w, y, m, n, k, jb, n);
            continue;
        }
        const int8_t *w0 = w + (int64_t)jb * k;
        int32_t wsum[W_BLOCK];
        for (int r0 = 0; r0 < m; r0 += 4) {
            int32_t sums[16];
            const int8_t *xr = x + (int64_t)r0 * k;
            int mr = m - r0 < 4 ? m - r0 : 4;
            /* a copy per row count and first pass, so the accumulators stay in registers */
#define BLOCKS(ROWSUM) switch (mr) { \
            case 1: block(xr, w0, k, 1, ROWSUM, sums, wsum); break; \
            case 2: block(xr, w0, k, 2, ROWSUM, sums, wsum); break; \
            case 3: block(xr, w0, k, 3, ROWSUM, sums, wsum); break; \
            default: block(xr, w0, k, 4, ROWSUM, sums, wsum); break; }
            if (r0 == 0) BLOCKS(1) else BLOCKS(0)
#undef BLOCKS
            for (int r = 0; r < mr; r++)
                for (int b = 0; b < W_BLOCK; b++)
                    y[(int64_t)(r0 + r) * n + jb + b] = sums[r * W_BLOCK + b] - 128 * wsum[b];
        }
    }
    return 0;
#else
    (void)x; (void)w; (void)y; (void)m; (void)n; (void)k;
    return -1;
#endif
}
