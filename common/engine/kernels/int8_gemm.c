/*
 * y = x @ w^T in int8 with int32 sums, for the few rows of a decode step (W8A8, common/engine/quantization.py).
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
 * a time, so their copy stays in L2 while the threads' weight pairs meet it. Integer sums are exact, so this gives
 * the same int32 as the path without tiles and as torch._int_mm.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_ROWS 256 /* without tiles */
#define W_BLOCK 4 /* weight rows per work item */
#define W_PREFETCH_AHEAD 4 /* weight blocks prefetched ahead into L2, as decode_forward.c does */

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

#include "amx.h"

#ifndef INT8_AMX_ROWS
#define INT8_AMX_ROWS 4 /* the fewest rows that take the tiles */
#endif
#ifndef INT8_AMX_MC
#define INT8_AMX_MC 256 /* x rows per pass over the weights */
#endif
#ifndef INT8_AMX_STREAM_BYTES
#define INT8_AMX_STREAM_BYTES (2 << 20) /* a y from this size on is written past the caches */
#endif
#ifndef INT8_AMX_AHEAD
#define INT8_AMX_AHEAD 512 /* bytes ahead prefetched in each weight row, on a block's first pass */
#endif


/* r[0..16) transposed as a 16 x 16 matrix of 32-bit words: bit b of the row and column indices swapped, b = 8..1 */
static inline __attribute__((always_inline)) void transpose16x16_epi32(__m512i r[16])
{
    for (int b = 8; b >= 1; b >>= 1) {
        int lo[16], hi[16];
        for (int c = 0; c < 16; c++) {
            lo[c] = c & b ? 16 + c - b : c;
            hi[c] = c & b ? 16 + c : c + b;
        }
        const __m512i lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
        for (int i = 0; i < 16; i++)
            if (!(i & b)) {
                const __m512i a = r[i], c = r[i + b];
                r[i] = _mm512_permutex2var_epi32(a, lo_idx, c);
                r[i + b] = _mm512_permutex2var_epi32(a, hi_idx, c);
            }
    }
}

/* x's block of 16 rows from row r0 (mr of them real, the rest zero), as the tiles' B operand for each 64 inputs:
 * xp[c][g][j] = the 4 bytes x[r0 + j][64c + 4g .. 64c + 4g + 3], one KB per c */
static void int8_amx_pack(const int8_t *x, int64_t k, int mr, int8_t *xp)
{
    for (int64_t c = 0; c < k / 64; c++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < mr ? _mm512_loadu_si512(x + (int64_t)j * k + 64 * c) : _mm512_setzero_si512();
        transpose16x16_epi32(r);
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
        transpose16x16_epi32(v);
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

/* x's packed copy, per calling thread, grown to the largest call's (m rounded up to 16) x k bytes and kept */
static __thread int8_t *int8_amx_buffer;
static __thread size_t int8_amx_capacity;

static int int8_amx_gemm(const int8_t *x, const int8_t *w, int32_t *y, int m, int n, int k)
{
    const int blocks = (m + 15) / 16;
    const size_t need = (size_t)blocks * 16 * k;
    if (need > int8_amx_capacity) {
        free(int8_amx_buffer);
        int8_amx_buffer = aligned_alloc(64, need);
        int8_amx_capacity = int8_amx_buffer != NULL ? need : 0;
        if (int8_amx_buffer == NULL) return -1;
    }
    int8_t *xp = int8_amx_buffer;
    /* non-temporal stores need y's rows 64-byte aligned; a y this large leaves the core's caches anyway, and
     * writing it past them saves reading each line before it is written (1.3-1.5x at 256-1024 rows of the 1B
     * shape's gate/up and LM head, bench.int8_gemm) */
    const int stream = (int64_t)m * n * 4 >= INT8_AMX_STREAM_BYTES && ((uintptr_t)y & 63) == 0 && n % 16 == 0;
    const int wblocks = n / 16, items = (wblocks + 1) / 2;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++)
            int8_amx_pack(x + (int64_t)b * 16 * k, k, m - b * 16 < 16 ? m - b * 16 : 16, xp + (int64_t)b * 16 * k);
        const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        amx_configure(rows);
        int8_amx_out_t out = {.y = {NULL, NULL, NULL, NULL}, .stream = stream};
        for (int r0 = 0; r0 < m; r0 += INT8_AMX_MC) {
            const int mc = m - r0 < INT8_AMX_MC ? m - r0 : INT8_AMX_MC;
            #pragma omp for schedule(static)
            for (int it = 0; it < items; it++) {
                const int nw = 2 * it + 1 < wblocks ? 2 : 1;
                int8_amx_item(w, k, nw, xp + (int64_t)r0 * k, mc, y + (int64_t)r0 * n, n, (int64_t)it * 32, &out);
            }
            int8_amx_flush(&out, n); /* this thread's last tiles of the pass */
            if (stream) _mm_sfence(); /* the non-temporal stores seen before the call returns */
        }
        _tile_release();
        #pragma omp for schedule(static)
        for (int j = wblocks * 16; j < n; j++) /* the last rows of a matrix whose height is not a multiple of 16 */
            for (int r = 0; r < m; r++) {
                int32_t s = 0;
                for (int i = 0; i < k; i++) s += (int32_t)x[(int64_t)r * k + i] * w[(int64_t)j * k + i];
                y[(int64_t)r * n + j] = s;
            }
    }
    return 0;
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
            for (int j = jb; j < n; j++)
                for (int r = 0; r < m; r++) {
                    int32_t s = 0;
                    for (int i = 0; i < k; i++) s += (int32_t)x[(int64_t)r * k + i] * w[(int64_t)j * k + i];
                    y[(int64_t)r * n + j] = s;
                }
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
