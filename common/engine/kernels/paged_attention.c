/*
 * Paged attention on the CPU, read in place from the block-major pool: single query rows (decode) here, then prompt
 * chunks (tessera_chunk_attention, below; one file because both walk the same pool through block tables).
 *
 * Reads K/V straight from the block-major pool through each row's block
 * table, so no gathered copy of the context is ever made. One work item is
 * (row, kv head), or with many rows of long contexts (attend_by_row in
 * attend.h) a row, whose kv heads take each block in turn: one contiguous
 * read of the block's K, then V, for this layer. The G query heads of a group share every K/V read. Scores
 * are computed a block at a time and folded into a running softmax
 * (max, sum, accumulator), so memory use does not grow with context length.
 * Accumulation is always float32; bf16 inputs are widened on load.
 */
#include <stdint.h>
#include <stdlib.h>

#include "attend.h"

/* The common head sizes get their own copies so the compiler can unroll and
 * keep vectors in registers; anything else takes the generic path. */
#define ATTEND(D, BF16) attend_one(q, BF16, kv, block_stride, k_offset, v_offset, block_tables, max_blocks, \
    context_lens, out, BF16, num_heads, num_kv_heads, D, block_size, scale, BF16, group, item)

#define ATTEND_ROW(D, BF16) attend_row(q, BF16, kv, block_stride, k_offset, v_offset, block_tables, \
    max_blocks, context_lens, out, BF16, num_heads, num_kv_heads, D, block_size, scale, BF16, group, states, r)

int tessera_paged_attention(
    const void *q, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out,
    int rows, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16)
{
    int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||
        num_heads % num_kv_heads != 0)
        return -1;

#if defined(ATTEND_VECTOR)
    /* Enough rows to keep every thread busy at one item per row: each row reads its blocks' K/V ranges whole */
    if (attend_by_row(rows, context_lens, head_dim, num_kv_heads, block_size, is_bf16)) {
        #pragma omp parallel
        {
            attend_state *states = aligned_alloc(64, sizeof(attend_state) * num_kv_heads);
            #pragma omp for schedule(dynamic, 1)
            for (int64_t r = 0; r < rows; r++) {
                if (states == NULL) { /* no scratch for this thread: a head at a time */
                    for (int64_t item = r * num_kv_heads; item < (r + 1) * num_kv_heads; item++)
                        ATTEND(head_dim, is_bf16);
                    continue;
                }
                if (head_dim == 64 && is_bf16) ATTEND_ROW(64, 1);
                else if (head_dim == 64) ATTEND_ROW(64, 0);
                else if (head_dim == 128 && is_bf16) ATTEND_ROW(128, 1);
                else if (head_dim == 128) ATTEND_ROW(128, 0);
                else ATTEND_ROW(head_dim, is_bf16);
            }
            free(states);
        }
        return 0;
    }
#endif
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < (int64_t)rows * num_kv_heads; item++) {
        if (head_dim == 64 && is_bf16) ATTEND(64, 1);
        else if (head_dim == 64) ATTEND(64, 0);
        else if (head_dim == 128 && is_bf16) ATTEND(128, 1);
        else if (head_dim == 128) ATTEND(128, 0);
        else ATTEND(head_dim, is_bf16);
    }
    return 0;
}


/*
 * Attention for rows that compute several tokens of one sequence (a prompt, a prompt chunk, a recompute):
 * causal, grouped-query, K/V read from the paged pool (the step has already written the chunk's own K/V
 * there), so a chunk that continues a cached prefix needs no gathered copy. bfloat16 with AVX512-BF16, float32
 * with AVX2 and FMA, and bfloat16 through the float32 item on an AVX2 CPU without AVX-512 (each row widened as
 * it is read): elsewhere the function returns -3 and the caller keeps torch's SDPA.
 *
 * One work item is (chunk, kv head, tile of up to CHUNK_QT queries): the tile's G * CHUNK_QT query vectors
 * share every K/V tile read. Keys go CHUNK_KT = 16 at a time. K is laid out as pairs of dimensions by key,
 * so one `dpbf16` gives 16 keys' partial scores with no horizontal sums; V as pairs of keys by dimension,
 * so the probabilities (rounded to bf16, as the second matmul of a bf16 SDPA does) fold in two keys per
 * instruction. The queries stay as they are held, and the scale goes on the float32 scores (a query scaled and
 * rounded to bf16 first, where the scale is not a power of 2, is off by up to half a bf16 unit, so a score far
 * above the others, which the softmax then exponentiates, is off by as much relative to them). Every query keeps a
 * running softmax (max, sum, float32 accumulator). Keys past a query's position are masked; key tiles past the
 * tile's last query are never read.
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "simd.h"

#define CHUNK_BF16 1
#define CHUNK_QT 16
#define CHUNK_KT 16
#define CHUNK_MAX_VECS 64 /* query vectors per item: the query tile shrinks for large groups */
#define VB 4              /* query vectors computed together: independent FMA chains */

static inline __attribute__((always_inline)) void chunk_item(
    const uint16_t *q, int64_t q_row_stride, const uint16_t *kv, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *table, int64_t token_start, int64_t num_computed, int q_first, int nq,
    uint16_t *out, int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale,
    int group, int kvh)
{
    const int pairs = head_dim / 2, dblocks = head_dim / 16;
    int nv = nq * group;
    int nvp = (nv + VB - 1) / VB * VB;
    uint32_t qp[CHUNK_MAX_VECS][MAX_HEAD_DIM / 2]; /* the queries, bf16 pairs (the scale goes on the float sums) */
    __m512 acc[CHUNK_MAX_VECS][MAX_HEAD_DIM / 16];
    float m[CHUNK_MAX_VECS];
    __m512 l[CHUNK_MAX_VECS]; /* each query's softmax sum, lane by lane: summed across lanes once, at the end */
    int64_t pos[CHUNK_MAX_VECS];
    __m512i kt[MAX_HEAD_DIM / 2];              /* [pair of dims] -> 16 keys x (d, d+1) */
    __m512i vt[CHUNK_KT / 2][MAX_HEAD_DIM / 16]; /* [pair of keys][16 dims] -> 16 dims x (key, key+1) */
    for (int v = 0; v < nvp; v++) {
        int qi = v / group, g = v % group;
        uint16_t *dst = (uint16_t *)qp[v];
        if (v < nv) {
            const uint16_t *src = q + (token_start + q_first + qi) * q_row_stride + (int64_t)(kvh * group + g) * head_dim;
            for (int i = 0; i < head_dim; i++) dst[i] = src[i];
        } else {
            for (int i = 0; i < head_dim; i++) dst[i] = 0;
        }
        for (int b = 0; b < dblocks; b++) acc[v][b] = _mm512_setzero_ps();
        m[v] = -INFINITY;
        l[v] = _mm512_setzero_ps();
        pos[v] = num_computed + q_first + (v < nv ? qi : nq - 1);
    }
    int64_t key_end = num_computed + q_first + nq; /* keys [0, key_end) are visible to some query of the tile */
    int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    for (int64_t start = 0; start < key_end;) {
        int64_t in_block = start % block_size;
        int n = CHUNK_KT;
        if (block_size - in_block < n) n = (int)(block_size - in_block);
        if (key_end - start < n) n = (int)(key_end - start);
        int64_t block = table[start / block_size];
        const uint16_t *kb = kv + block * block_stride + k_offset + in_block * token_stride + (int64_t)kvh * head_dim;
        const uint16_t *vb = kv + block * block_stride + v_offset + in_block * token_stride + (int64_t)kvh * head_dim;
        for (int i = 0; i < pairs; i += 16) { /* 16 keys x 16 pairs of dimensions, transposed */
            for (int t = 0; t < 16; t++)
                kt[i + t] = t < n ? _mm512_loadu_si512(kb + t * token_stride + 2 * i) : _mm512_setzero_si512();
            transpose16x16(kt + i);
        }
        for (int tp = 0; tp < CHUNK_KT / 2; tp++) {
            for (int b = 0; b < dblocks; b++) {
                int t0 = 2 * tp, t1 = 2 * tp + 1;
                __m512i lo = t0 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + t0 * token_stride + 16 * b)))
                                    : _mm512_setzero_si512();
                __m512i hi = t1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + t1 * token_stride + 16 * b)))
                                    : _mm512_setzero_si512();
                vt[tp][b] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
            }
        }
        for (int v0 = 0; v0 < nvp; v0 += VB) {
            if (pos[v0 + VB - 1] < start) continue; /* every query of the block is before this key tile */
            __m512 s[VB];
            for (int j = 0; j < VB; j++) s[j] = _mm512_setzero_ps();
            for (int i = 0; i < pairs; i++) {
                __m512bh kv2 = (__m512bh)kt[i];
                for (int j = 0; j < VB; j++)
                    s[j] = _mm512_dpbf16_ps(s[j], (__m512bh)_mm512_set1_epi32((int)qp[v0 + j][i]), kv2);
            }
            for (int j = 0; j < VB; j++) s[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(scale));
            uint32_t pp[VB][CHUNK_KT / 2];
            for (int j = 0; j < VB; j++) {
                int v = v0 + j;
                int64_t visible = pos[v] + 1 - start;
                if (visible > n) visible = n;
                if (visible <= 0) {
                    for (int tp = 0; tp < CHUNK_KT / 2; tp++) pp[j][tp] = 0u;
                    continue;
                }
                __mmask16 keep = (__mmask16)((1u << visible) - 1u);
                float mx = _mm512_mask_reduce_max_ps(keep, s[j]);
                if (mx > m[v]) { /* rescale only when the running max moves (rarely, after the first tiles) */
                    __m512 c = _mm512_set1_ps(expf(m[v] - mx));
                    l[v] = _mm512_mul_ps(l[v], c);
                    for (int b = 0; b < dblocks; b++) acc[v][b] = _mm512_mul_ps(acc[v][b], c);
                    m[v] = mx;
                }
                __m512 p = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(s[j], _mm512_set1_ps(m[v]))));
                l[v] = _mm512_add_ps(l[v], p);
                _mm256_storeu_si256((__m256i *)pp[j], (__m256i)_mm512_cvtneps_pbh(p));
            }
            for (int tp = 0; tp < (n + 1) / 2; tp++) {
                for (int j = 0; j < VB; j++) {
                    __m512bh p2 = (__m512bh)_mm512_set1_epi32((int)pp[j][tp]);
                    for (int b = 0; b < dblocks; b++)
                        acc[v0 + j][b] = _mm512_dpbf16_ps(acc[v0 + j][b], p2, (__m512bh)vt[tp][b]);
                }
            }
        }
        start += n;
    }
    for (int v = 0; v < nv; v++) {
        float sum = _mm512_reduce_add_ps(l[v]);
        __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
        uint16_t *o = out + ((token_start + q_first + v / group) * num_heads + kvh * group + v % group) * (int64_t)head_dim;
        for (int b = 0; b < dblocks; b++)
            _mm256_storeu_si256((__m256i *)(o + 16 * b), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[v][b], inv)));
    }
}
#endif

/*
 * The bfloat16 chunk item on AMX tiles (Intel Xeon from Sapphire Rapids), for head sizes of 32-128 in steps of 32:
 * (chunk, up to AMX_QT queries, kv head), at most AMX_MAX_VECS query vectors (eight tiles of 16 rows), so that
 * each block of keys' K and V, put in the tiles' layouts once, serves up to eight tiles of queries. Keys go
 * AMX_KB = 64 at a time. A tile of queries' scores against them are four tdpbf16ps sums (16 x 16 floats each)
 * over the head's dimensions, 32 at a time (scaled afterwards, as above): the queries are the A operand as held, 16
 * keys' K as pairs of dimensions by key (kt, as the vdpbf16ps item lays it out) the B operand. The running softmax
 * is the item's (vector code, a row at a time), its maximum moved only when a block's passes it by more than
 * AMX_SLACK (each probability then at most e^AMX_SLACK, which float32 sums and bfloat16 hold). The
 * probabilities, rounded to bf16 as there, are the A operand of the second product (two tiles of 32 keys), V as
 * pairs of keys by dimension its B operand: the queries' float32 accumulators, up to four blocks of 16 dimensions,
 * are loaded into their own sum tiles, the products issued into them together, and stored back (speeds:
 * bench.chunk_attention; docs/history/benchmarks-rounds.md, "On an Intel Xeon with AMX"). The tiles add a pair's two
 * products in their own order, so the
 * outputs differ from the vdpbf16ps item's in rounding; prompt chunks never run under engine.deterministic (every
 * row a decode row there).
 */
#if defined(CHUNK_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"

#define CHUNK_AMX 1
#define AMX_KB 64          /* keys a block: four score tiles of 16 keys */
#define AMX_MAX_VECS 128   /* query vectors an item: eight tiles of 16 rows */
#define AMX_QT 64          /* queries an item at most */
#define AMX_MAX_HEAD_DIM 128
#define AMX_SLACK 8.f
#define AMX_VT_STRIDE (AMX_MAX_HEAD_DIM * 4)

/* the sums of dimension block b0 + T of P V (T: its tile, 0-3) over the block's one or two A tiles of 32 keys */
#define AMX_PV_SUM(T)                                                                        \
    if (nb > T) {                                                                            \
        _tile_loadd(T, acc[v0] + 16 * (b0 + T), AMX_MAX_HEAD_DIM * 4);                       \
        _tile_loadd(6, vt[0] + 16 * (b0 + T), AMX_VT_STRIDE);                                \
        _tile_dpbf16ps(T, 4, 6);                                                             \
        if (n > 32) {                                                                        \
            _tile_loadd(7, vt[16] + 16 * (b0 + T), AMX_VT_STRIDE);                           \
            _tile_dpbf16ps(T, 5, 7);                                                         \
        }                                                                                    \
    }

static inline __attribute__((always_inline)) void chunk_item_amx(
    const uint16_t *q, int64_t q_row_stride, const uint16_t *kv, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *table, int64_t token_start, int64_t num_computed, int q_first, int nq,
    uint16_t *out, int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale,
    int group, int kvh)
{
    const int pairs = head_dim / 2, dblocks = head_dim / 16, dchunks = head_dim / 32;
    const int nv = nq * group, tiles = (nv + 15) / 16;
    uint16_t qb[AMX_MAX_VECS][AMX_MAX_HEAD_DIM] __attribute__((aligned(64))); /* the queries, zero past nv */
    float acc[AMX_MAX_VECS][AMX_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float m[AMX_MAX_VECS];
    __m512 l[AMX_MAX_VECS];
    int64_t pos[AMX_MAX_VECS];
    __m512i kt[AMX_KB / 16][AMX_MAX_HEAD_DIM / 2];                         /* per 16 keys: [pair of dims] -> 16 keys */
    uint32_t vt[AMX_KB / 2][AMX_MAX_HEAD_DIM] __attribute__((aligned(64))); /* [pair of keys][dim] */
    float sc[16][AMX_KB] __attribute__((aligned(64)));                    /* a tile of queries' scores */
    uint16_t pb[16][AMX_KB] __attribute__((aligned(64)));                 /* their probabilities, bf16 */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int v = 0; v < tiles * 16; v++) {
        if (v < nv) {
            const uint16_t *src = q + (token_start + q_first + v / group) * q_row_stride
                                  + (int64_t)(kvh * group + v % group) * head_dim;
            for (int i = 0; i < head_dim; i += 32)
                _mm512_store_si512(qb[v] + i, _mm512_loadu_si512(src + i));
        } else {
            for (int i = 0; i < head_dim; i += 32) _mm512_store_si512(qb[v] + i, _mm512_setzero_si512());
        }
        for (int i = 0; i < head_dim; i += 16) _mm512_store_ps(acc[v] + i, _mm512_setzero_ps());
        m[v] = -INFINITY;
        l[v] = _mm512_setzero_ps();
        pos[v] = num_computed + q_first + (v < nv ? v / group : nq - 1);
    }
    /* tiles 0-3: scores against 16 keys each, then sums of P V; 4-5: queries or probabilities (A); 6, 7 (and 5
     * for K): K or V (B); every tile 16 rows of 64 bytes */
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure(rows);
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t key_end = num_computed + q_first + nq; /* keys [0, key_end) are visible to some query of the item */
    for (int64_t start = 0; start < key_end; start += AMX_KB) {
        const int n = key_end - start < AMX_KB ? (int)(key_end - start) : AMX_KB;
        const int kgroups = (n + 15) / 16, kpairs = (n > 32 ? 32 : 16); /* pairs of keys V's layout holds */
        const uint16_t *kr[AMX_KB], *vr[AMX_KB]; /* each key's K and V row in the pool */
        for (int t = 0; t < n; t++) {
            const int64_t s = start + t, block = table[s / block_size], in_block = s % block_size;
            const int64_t at = block * block_stride + in_block * token_stride + (int64_t)kvh * head_dim;
            kr[t] = kv + k_offset + at;
            vr[t] = kv + v_offset + at;
        }
        for (int h = 0; h < kgroups; h++)
            for (int i = 0; i < pairs; i += 16) { /* 16 keys x 16 pairs of dimensions, transposed */
                for (int t = 0; t < 16; t++)
                    kt[h][i + t] = 16 * h + t < n ? _mm512_loadu_si512(kr[16 * h + t] + 2 * i) : _mm512_setzero_si512();
                transpose16x16(kt[h] + i);
            }
        for (int tp = 0; tp < kpairs; tp++) {
            const int t0 = 2 * tp, t1 = t0 + 1;
            for (int b = 0; b < dblocks; b++) {
                __m512i lo = t0 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[t0] + 16 * b)))
                                    : _mm512_setzero_si512();
                __m512i hi = t1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[t1] + 16 * b)))
                                    : _mm512_setzero_si512();
                _mm512_store_si512(vt[tp] + 16 * b, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
        for (int qt = 0; qt < tiles; qt++) {
            const int v0 = 16 * qt, last = v0 + 15 < nv ? v0 + 15 : nv - 1;
            if (pos[last] < start) continue; /* every query of the tile is before this key block */
            _tile_zero(0);
            if (kgroups > 1) _tile_zero(1);
            if (kgroups > 2) _tile_zero(2);
            if (kgroups > 3) _tile_zero(3);
            for (int c = 0; c < dchunks; c++) {
                _tile_loadd(4, qb[v0] + 32 * c, AMX_MAX_HEAD_DIM * 2);
                _tile_loadd(6, kt[0] + 16 * c, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (kgroups > 1) {
                    _tile_loadd(7, kt[1] + 16 * c, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (kgroups > 2) {
                    _tile_loadd(5, kt[2] + 16 * c, 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (kgroups > 3) {
                    _tile_loadd(6, kt[3] + 16 * c, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
            _tile_stored(0, sc[0], AMX_KB * 4);
            if (kgroups > 1) _tile_stored(1, sc[0] + 16, AMX_KB * 4);
            if (kgroups > 2) _tile_stored(2, sc[0] + 32, AMX_KB * 4);
            if (kgroups > 3) _tile_stored(3, sc[0] + 48, AMX_KB * 4);
            for (int j = 0; j < 16; j++) {
                const int v = v0 + j;
                int64_t visible = v < nv ? pos[v] + 1 - start : 0;
                if (visible > n) visible = n;
                if (visible <= 0) {
                    _mm512_store_si512(pb[j], _mm512_setzero_si512());
                    _mm512_store_si512(pb[j] + 32, _mm512_setzero_si512());
                    continue;
                }
                __mmask16 keep[4];
                __m512 s[4], mx = _mm512_set1_ps(-INFINITY);
                for (int g = 0; g < 4; g++) {
                    const int64_t in = visible - 16 * g;
                    keep[g] = (__mmask16)(in >= 16 ? 0xffffu : in > 0 ? (1u << in) - 1u : 0u);
                    s[g] = _mm512_mul_ps(_mm512_load_ps(sc[j] + 16 * g), vscale);
                    mx = _mm512_mask_max_ps(mx, keep[g], mx, s[g]);
                }
                const float block_max = _mm512_reduce_max_ps(mx);
                if (block_max > m[v] + AMX_SLACK) { /* the first block, then rarely: the running maximum moves */
                    const __m512 c = _mm512_set1_ps(expf(m[v] - block_max));
                    l[v] = _mm512_mul_ps(l[v], c);
                    for (int b = 0; b < dblocks; b++)
                        _mm512_store_ps(acc[v] + 16 * b, _mm512_mul_ps(_mm512_load_ps(acc[v] + 16 * b), c));
                    m[v] = block_max;
                }
                const __m512 mv = _mm512_set1_ps(m[v]);
                __m512 p[4], sum = l[v];
                for (int g = 0; g < 4; g++) {
                    p[g] = _mm512_maskz_mov_ps(keep[g], exp16_short(_mm512_sub_ps(s[g], mv)));
                    sum = _mm512_add_ps(sum, p[g]);
                }
                l[v] = sum;
                _mm512_store_si512(pb[j], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
                _mm512_store_si512(pb[j] + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
            }
            _tile_loadd(4, pb[0], AMX_KB * 2);
            if (n > 32) _tile_loadd(5, pb[0] + 32, AMX_KB * 2);
            for (int b0 = 0; b0 < dblocks; b0 += 4) {
                const int nb = dblocks - b0 < 4 ? dblocks - b0 : 4;
                AMX_PV_SUM(0)
                AMX_PV_SUM(1)
                AMX_PV_SUM(2)
                AMX_PV_SUM(3)
                _tile_stored(0, acc[v0] + 16 * b0, AMX_MAX_HEAD_DIM * 4);
                if (nb > 1) _tile_stored(1, acc[v0] + 16 * (b0 + 1), AMX_MAX_HEAD_DIM * 4);
                if (nb > 2) _tile_stored(2, acc[v0] + 16 * (b0 + 2), AMX_MAX_HEAD_DIM * 4);
                if (nb > 3) _tile_stored(3, acc[v0] + 16 * (b0 + 3), AMX_MAX_HEAD_DIM * 4);
            }
        }
    }
    _tile_release();
    for (int v = 0; v < nv; v++) {
        const float sum = _mm512_reduce_add_ps(l[v]);
        const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
        uint16_t *o = out + ((token_start + q_first + v / group) * num_heads + kvh * group + v % group) * (int64_t)head_dim;
        for (int b = 0; b < dblocks; b++)
            _mm256_storeu_si256((__m256i *)(o + 16 * b),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[v] + 16 * b), inv)));
    }
}
#undef AMX_PV_SUM
#endif

/*
 * The float32 chunk item with AVX2 and FMA (bf16 1: a bf16 pool, queries and output on a CPU without AVX-512, each
 * value widened as it is loaded, the output rounded once), as the bfloat16 one: (chunk, kv head, tile of up to F32_QT
 * queries), keys F32_KT = 16 at a time, every query vector with a running softmax. 16 keys' K, transposed 8 x 8 a block
 * at a time, is a dimension's 16 keys in two vectors, so F32_VB query vectors' scores against the tile are 2 * F32_VB
 * independent FMA chains of one broadcast query value and a K vector each. The outputs take F32_PV query vectors x 32
 * dimensions at a time, a V row's 4 vectors against each vector's broadcast probability. Key tiles past a vector
 * group's last query are skipped, so a prompt does the causal half of the work that SDPA does in full at
 * these lengths.
 */
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"

#define CHUNK_F32 1
#if !defined(__AVX512F__)
#define CHUNK_BF16_WIDENED 1 /* bf16 chunks through this item too, where no AVX-512 item builds (an AVX2-only CPU) */
#endif
#ifndef F32_QT
#define F32_QT 16
#endif
#define F32_KT 16
#ifndef F32_MAX_VECS
#define F32_MAX_VECS 48 /* query vectors per item, a multiple of F32_VB: the query tile shrinks for large groups */
#endif
#ifndef F32_VB
#define F32_VB 6        /* query vectors scored together: 12 sums, two K vectors and a broadcast in registers */
#endif
#ifndef F32_PV
#define F32_PV 3        /* query vectors accumulated together, 4 vectors of dimensions each: 12 sums */
#endif
/* A query's running max m moves only when a tile's max passes it by more than this: the probabilities e^(s - m)
 * stay below e^8, their sum far from float32's range, and the branch is taken about once per query */
#define F32_MAX_SLACK 8.f

/* r[0..8) as an 8 x 8 matrix of floats, transposed in place */
static inline __attribute__((always_inline)) void transpose8x8(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + c]: column c (low half) and c + 4 (high half) of rows 4i..4i+3 */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

static inline __attribute__((always_inline)) void chunk_item_f32(
    const void *q, int64_t q_row_stride, const void *kv, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *table, int64_t token_start, int64_t num_computed, int q_first, int nq,
    void *out, int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale,
    int group, int kvh, const int bf16)
{
    const int nv = nq * group, nvp = (nv + F32_VB - 1) / F32_VB * F32_VB;
    float qs[F32_MAX_VECS * MAX_HEAD_DIM] __attribute__((aligned(32)));  /* [vector][dim], scaled */
    float acc[F32_MAX_VECS * MAX_HEAD_DIM] __attribute__((aligned(32))); /* [vector][dim] */
    float p[F32_MAX_VECS][F32_KT] __attribute__((aligned(32)));          /* the tile's probabilities */
    __m256 kt[MAX_HEAD_DIM][2];                                          /* [dim] -> keys 0-7, 8-15 */
    float m[F32_MAX_VECS];
    __m256 l[F32_MAX_VECS]; /* each query's softmax sum, lane by lane: summed across lanes once, at the end */
    int64_t pos[F32_MAX_VECS];
    for (int v = 0; v < nvp; v++) {
        int qi = v / group, g = v % group;
        float *dst = qs + (int64_t)v * head_dim;
        if (v < nv) {
            int64_t src = (token_start + q_first + qi) * q_row_stride + (int64_t)(kvh * group + g) * head_dim;
            for (int i = 0; i < head_dim; i += 8)
                _mm256_store_ps(dst + i, _mm256_mul_ps(load8(q, bf16, src + i), _mm256_set1_ps(scale)));
        } else {
            for (int i = 0; i < head_dim; i++) dst[i] = 0.f;
        }
        for (int i = 0; i < head_dim; i++) acc[(int64_t)v * head_dim + i] = 0.f;
        m[v] = -INFINITY;
        l[v] = _mm256_setzero_ps();
        pos[v] = num_computed + q_first + (v < nv ? qi : nq - 1);
    }
    const __m256 lane_lo = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const __m256 lane_hi = _mm256_add_ps(lane_lo, _mm256_set1_ps(8.f));
    int64_t key_end = num_computed + q_first + nq; /* keys [0, key_end) are visible to some query of the tile */
    int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    for (int64_t start = 0; start < key_end;) {
        int64_t in_block = start % block_size;
        int n = F32_KT;
        if (block_size - in_block < n) n = (int)(block_size - in_block);
        if (key_end - start < n) n = (int)(key_end - start);
        int64_t block = table[start / block_size];
        /* the block's K and V rows of this kv head, as element offsets into the pool */
        const int64_t kb = block * block_stride + k_offset + in_block * token_stride + (int64_t)kvh * head_dim;
        const int64_t vb = block * block_stride + v_offset + in_block * token_stride + (int64_t)kvh * head_dim;
        for (int h = 0; h < 2; h++) /* keys 8h..8h+7, each 8 dimensions at a time, transposed */
            for (int d = 0; d < head_dim; d += 8) {
                __m256 r[8];
                for (int t = 0; t < 8; t++)
                    r[t] = 8 * h + t < n ? load8(kv, bf16, kb + (8 * h + t) * token_stride + d) : _mm256_setzero_ps();
                transpose8x8(r);
                for (int t = 0; t < 8; t++) kt[d + t][h] = r[t];
            }
        for (int v0 = 0; v0 < nvp; v0 += F32_VB) {
            if (pos[v0 + F32_VB - 1] < start) continue; /* every query of the group is before this key tile */
            __m256 s[F32_VB][2];
            for (int j = 0; j < F32_VB; j++) s[j][0] = s[j][1] = _mm256_setzero_ps();
            for (int d = 0; d < head_dim; d++) {
                __m256 k0 = kt[d][0], k1 = kt[d][1];
                for (int j = 0; j < F32_VB; j++) {
                    __m256 b = _mm256_broadcast_ss(qs + (int64_t)(v0 + j) * head_dim + d);
                    s[j][0] = _mm256_fmadd_ps(b, k0, s[j][0]);
                    s[j][1] = _mm256_fmadd_ps(b, k1, s[j][1]);
                }
            }
            /* the sums out to memory by constant indices, so they stay in registers through the loop above */
            float scores[F32_VB][F32_KT] __attribute__((aligned(32)));
#pragma GCC unroll 16
            for (int j = 0; j < F32_VB; j++) {
                _mm256_store_ps(scores[j], s[j][0]);
                _mm256_store_ps(scores[j] + 8, s[j][1]);
            }
            for (int j = 0; j < F32_VB; j++) {
                int v = v0 + j;
                int64_t visible = pos[v] + 1 - start;
                if (visible > n) visible = n;
                if (v >= nv || visible <= 0) {
                    for (int t = 0; t < F32_KT; t++) p[v][t] = 0.f;
                    continue;
                }
                __m256 vis = _mm256_set1_ps((float)visible);
                __m256 keep0 = _mm256_cmp_ps(lane_lo, vis, _CMP_LT_OQ), keep1 = _mm256_cmp_ps(lane_hi, vis, _CMP_LT_OQ);
                __m256 ninf = _mm256_set1_ps(-INFINITY);
                __m256 s0 = _mm256_load_ps(scores[j]), s1 = _mm256_load_ps(scores[j] + 8);
                __m256 mx = _mm256_max_ps(_mm256_blendv_ps(ninf, s0, keep0), _mm256_blendv_ps(ninf, s1, keep1));
                mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1)); /* every lane: the tile's max */
                mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4e));
                mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xb1));
                float tile_max = _mm256_cvtss_f32(mx);
                if (tile_max > m[v] + F32_MAX_SLACK) { /* the first tile, then rarely: a predictable branch */
                    __m256 c = _mm256_set1_ps(expf(m[v] - tile_max));
                    l[v] = _mm256_mul_ps(l[v], c);
                    float *a = acc + (int64_t)v * head_dim;
                    for (int i = 0; i < head_dim; i += 8) _mm256_store_ps(a + i, _mm256_mul_ps(_mm256_load_ps(a + i), c));
                    m[v] = tile_max;
                }
                __m256 mv = _mm256_set1_ps(m[v]);
                __m256 p0 = _mm256_and_ps(keep0, exp8(_mm256_sub_ps(s0, mv)));
                __m256 p1 = _mm256_and_ps(keep1, exp8(_mm256_sub_ps(s1, mv)));
                _mm256_store_ps(p[v], p0);
                _mm256_store_ps(p[v] + 8, p1);
                l[v] = _mm256_add_ps(l[v], _mm256_add_ps(p0, p1));
            }
        }
        for (int v0 = 0; v0 < nvp; v0 += F32_PV) {
            if (pos[v0 + F32_PV - 1] < start) continue;
            for (int d = 0; d < head_dim; d += 32) {
                __m256 a[F32_PV][4];
                for (int j = 0; j < F32_PV; j++)
                    for (int i = 0; i < 4; i++) a[j][i] = _mm256_load_ps(acc + (int64_t)(v0 + j) * head_dim + d + 8 * i);
                for (int t = 0; t < n; t++) {
                    const int64_t vr = vb + t * token_stride + d;
                    __m256 b[F32_PV];
                    for (int j = 0; j < F32_PV; j++) b[j] = _mm256_broadcast_ss(&p[v0 + j][t]);
                    for (int i = 0; i < 4; i++) {
                        __m256 x = load8(kv, bf16, vr + 8 * i);
                        for (int j = 0; j < F32_PV; j++) a[j][i] = _mm256_fmadd_ps(b[j], x, a[j][i]);
                    }
                }
                for (int j = 0; j < F32_PV; j++)
                    for (int i = 0; i < 4; i++) _mm256_store_ps(acc + (int64_t)(v0 + j) * head_dim + d + 8 * i, a[j][i]);
            }
        }
        start += n;
    }
    for (int v = 0; v < nv; v++) {
        float sum = sum8(l[v]);
        __m256 inv = _mm256_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
        int64_t o = ((token_start + q_first + v / group) * num_heads + kvh * group + v % group) * (int64_t)head_dim;
        for (int i = 0; i < head_dim; i += 8)
            store8(out, bf16, o + i, _mm256_mul_ps(_mm256_load_ps(acc + (int64_t)v * head_dim + i), inv));
    }
}
#endif

/*
 * q:            query rows (bf16, or float32 with is_bf16 0), row t at q + t * q_row_stride (heads, then head_dim,
 *               contiguous in a row)
 * chunks:       [num_chunks, 3] int64: the chunk's first row in q/out, its number of rows, and how many of
 *               the sequence's tokens were cached before it (its first row's position)
 * block_tables: [num_chunks, max_blocks] int64, covering each chunk's whole context
 * out:          [rows, num_heads, head_dim], q's dtype; only the chunks' rows are written
 * The pool (q's dtype) and its offsets are as for tessera_paged_attention.
 * Returns 0, -1 for shapes it does not take, -3 where the CPU or compiler has no kernel for the dtype (bfloat16:
 * AVX512-BF16, or AVX2 and FMA without AVX-512 through the float32 item; float32: AVX2 and FMA).
 */
int tessera_chunk_attention(
    const void *q, int64_t q_row_stride, const void *kv, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *chunks, int num_chunks, const int64_t *block_tables, int64_t max_blocks,
    void *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16)
{
#if defined(CHUNK_BF16) || defined(CHUNK_F32)
    int max_vecs, max_queries; /* query vectors and queries per item */
    if (is_bf16) {
#if defined(CHUNK_BF16)
        max_vecs = CHUNK_MAX_VECS;
        max_queries = CHUNK_QT;
#elif defined(CHUNK_BF16_WIDENED)
        max_vecs = F32_MAX_VECS; /* the float32 item, widening a bf16 pool's rows as it reads them */
        max_queries = F32_QT;
#else
        return -3;
#endif
    } else {
#if defined(CHUNK_F32)
        max_vecs = F32_MAX_VECS;
        max_queries = F32_QT;
#else
        return -3;
#endif
    }
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    int group = num_heads / num_kv_heads;
    if (group > max_vecs || head_dim > MAX_HEAD_DIM || head_dim % 32 != 0) return -1;
#if defined(CHUNK_AMX)
    /* the tiles where Linux grants them, for head sizes they take (CHUNK_AMX_OFF: a benchmark's build without) */
#ifdef CHUNK_AMX_OFF
    const int amx = 0;
#else
    const int amx = is_bf16 && head_dim <= AMX_MAX_HEAD_DIM && amx_ready();
#endif
    if (amx) { /* larger items: a block of keys laid out for the tiles serves more queries */
        max_vecs = AMX_MAX_VECS;
        max_queries = AMX_QT;
    }
#endif
    int qt = max_vecs / group < max_queries ? max_vecs / group : max_queries;
    int64_t total = 0;
    for (int c = 0; c < num_chunks; c++) total += (chunks[3 * c + 1] + qt - 1) / qt * num_kv_heads;
    /* work items (chunk, tile, kv head), each chunk's latest (heaviest) tiles first */
    int64_t *items = (int64_t *)malloc(sizeof(int64_t) * 2 * (total > 0 ? total : 1));
    if (items == NULL) return -2;
    int64_t k = 0;
    for (int c = 0; c < num_chunks; c++) {
        int64_t tiles = (chunks[3 * c + 1] + qt - 1) / qt;
        for (int64_t tile = tiles - 1; tile >= 0; tile--)
            for (int h = 0; h < num_kv_heads; h++) { items[2 * k] = c; items[2 * k + 1] = tile * num_kv_heads + h; k++; }
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < total; it++) {
        int c = (int)items[2 * it];
        int64_t tile = items[2 * it + 1] / num_kv_heads;
        int kvh = (int)(items[2 * it + 1] % num_kv_heads);
        int64_t left = chunks[3 * c + 1] - tile * qt;
        int nq = (int)(left < qt ? left : qt);
        const int64_t *table = block_tables + c * max_blocks;
#define CHUNK_ARGS(T, D) (const T *)q, q_row_stride, (const T *)kv, block_stride, k_offset, v_offset, table, \
    chunks[3 * c], chunks[3 * c + 2], (int)(tile * qt), nq, (T *)out, num_heads, num_kv_heads, D, block_size, scale, \
    group, kvh
        if (is_bf16) {
#if defined(CHUNK_AMX)
            if (amx && head_dim == 64) chunk_item_amx(CHUNK_ARGS(uint16_t, 64));
            else if (amx) chunk_item_amx(CHUNK_ARGS(uint16_t, head_dim));
            else
#endif
#if defined(CHUNK_BF16)
            if (head_dim == 64) chunk_item(CHUNK_ARGS(uint16_t, 64));
            else chunk_item(CHUNK_ARGS(uint16_t, head_dim));
#elif defined(CHUNK_BF16_WIDENED)
            if (head_dim == 64) chunk_item_f32(CHUNK_ARGS(void, 64), 1);
            else if (head_dim == 128) chunk_item_f32(CHUNK_ARGS(void, 128), 1);
            else chunk_item_f32(CHUNK_ARGS(void, head_dim), 1);
#endif
        } else {
#if defined(CHUNK_F32)
            if (head_dim == 64) chunk_item_f32(CHUNK_ARGS(void, 64), 0);
            else if (head_dim == 128) chunk_item_f32(CHUNK_ARGS(void, 128), 0);
            else chunk_item_f32(CHUNK_ARGS(void, head_dim), 0);
#endif
        }
#undef CHUNK_ARGS
    }
    free(items);
    return 0;
#else
    (void)q; (void)q_row_stride; (void)kv; (void)block_stride; (void)k_offset; (void)v_offset; (void)chunks;
    (void)num_chunks; (void)block_tables; (void)max_blocks; (void)out; (void)num_heads; (void)num_kv_heads;
    (void)head_dim; (void)block_size; (void)scale; (void)is_bf16;
    return -3;
#endif
}
