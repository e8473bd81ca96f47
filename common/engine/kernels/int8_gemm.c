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
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_ROWS 256
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

int tessera_int8_gemm(const int8_t *x, const int8_t *w, int32_t *y, int m, int n, int k)
{
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
