/*
 * Paged attention for single query rows (decode) on the CPU.
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
    if (attend_by_row(rows, context_lens, head_dim, num_kv_heads, is_bf16)) {
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
 * there), so a chunk that continues a cached prefix needs no gathered copy. bfloat16 with AVX512-BF16 only:
 * elsewhere the function returns -3 and the caller keeps torch's SDPA.
 *
 * One work item is (chunk, kv head, tile of up to CHUNK_QT queries): the tile's G * CHUNK_QT query vectors
 * share every K/V tile read. Keys go CHUNK_KT = 16 at a time. K is laid out as pairs of dimensions by key,
 * so one `dpbf16` gives 16 keys' partial scores with no horizontal sums; V as pairs of keys by dimension,
 * so the probabilities (rounded to bf16, as the second matmul of a bf16 SDPA does) fold in two keys per
 * instruction. Every query keeps a running softmax (max, sum, float32 accumulator). Keys past a query's
 * position are masked; key tiles past the tile's last query are never read.
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "simd.h"

#define CHUNK_QT 16
#define CHUNK_KT 16
#define CHUNK_MAX_VECS 64 /* query vectors per item: the query tile shrinks for large groups */
#define VB 4              /* query vectors computed together: independent FMA chains */

/* r[0..16) as a 16 x 16 matrix of 32-bit words, transposed in place (64 shuffles) */
static inline __attribute__((always_inline)) void transpose16x16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], 128-bit lane L: word 4L + c of rows 4i..4i+3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        t[4 * c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
        t[4 * c + 1] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        t[4 * c + 2] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        t[4 * c + 3] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_i32x4(t[4 * c], t[4 * c + 2], 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 * c], t[4 * c + 2], 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(t[4 * c + 1], t[4 * c + 3], 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 * c + 1], t[4 * c + 3], 0xdd);
    }
}

static inline __attribute__((always_inline)) void chunk_item(
    const uint16_t *q, int64_t q_row_stride, const uint16_t *kv, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *table, int64_t token_start, int64_t num_computed, int q_first, int nq,
    uint16_t *out, int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale,
    int group, int kvh)
{
    const int pairs = head_dim / 2, dblocks = head_dim / 16;
    int nv = nq * group;
    int nvp = (nv + VB - 1) / VB * VB;
    uint32_t qp[CHUNK_MAX_VECS][MAX_HEAD_DIM / 2]; /* scaled queries, bf16 pairs */
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
            for (int i = 0; i < head_dim; i++) dst[i] = f32_to_bf16(bf16_to_f32(src[i]) * scale);
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
 * q:            bf16 query rows, row t at q + t * q_row_stride (heads, then head_dim, contiguous in a row)
 * chunks:       [num_chunks, 3] int64: the chunk's first row in q/out, its number of rows, and how many of
 *               the sequence's tokens were cached before it (its first row's position)
 * block_tables: [num_chunks, max_blocks] int64, covering each chunk's whole context
 * out:          [rows, num_heads, head_dim] bf16; only the chunks' rows are written
 * The pool and its offsets are as for tessera_paged_attention.
 * Returns 0, -1 for shapes it does not take, -3 where the CPU or compiler lacks AVX512-BF16.
 */
int tessera_chunk_attention(
    const void *q, int64_t q_row_stride, const void *kv, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *chunks, int num_chunks, const int64_t *block_tables, int64_t max_blocks,
    void *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (num_heads % num_kv_heads != 0) return -1;
    int group = num_heads / num_kv_heads;
    if (group > CHUNK_MAX_VECS || head_dim > MAX_HEAD_DIM || head_dim % 32 != 0) return -1;
    int qt = CHUNK_MAX_VECS / group < CHUNK_QT ? CHUNK_MAX_VECS / group : CHUNK_QT;
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
        if (head_dim == 64)
            chunk_item((const uint16_t *)q, q_row_stride, (const uint16_t *)kv, block_stride, k_offset, v_offset,
                       table, chunks[3 * c], chunks[3 * c + 2], (int)(tile * qt), nq, (uint16_t *)out, num_heads,
                       num_kv_heads, 64, block_size, scale, group, kvh);
        else
            chunk_item((const uint16_t *)q, q_row_stride, (const uint16_t *)kv, block_stride, k_offset, v_offset,
                       table, chunks[3 * c], chunks[3 * c + 2], (int)(tile * qt), nq, (uint16_t *)out, num_heads,
                       num_kv_heads, head_dim, block_size, scale, group, kvh);
    }
    free(items);
    return 0;
#else
    (void)q; (void)q_row_stride; (void)kv; (void)block_stride; (void)k_offset; (void)v_offset; (void)chunks;
    (void)num_chunks; (void)block_tables; (void)max_blocks; (void)out; (void)num_heads; (void)num_kv_heads;
    (void)head_dim; (void)block_size; (void)scale;
    return -3;
#endif
}
