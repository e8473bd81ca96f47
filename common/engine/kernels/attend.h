/*
 * One (row, kv head) of paged decode attention, shared by paged_attention.c and decode_forward.c.
 *
 * Reads K/V straight from the block-major pool through the row's block
 * table: the G query heads of a group share every K/V read. Scores are
 * computed a block at a time and folded into a running softmax (max, sum,
 * accumulator), so memory use does not grow with context length.
 * Accumulation is always float32; bf16 inputs are widened on load.
 */
#ifndef TESSERA_ATTEND_H
#define TESSERA_ATTEND_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "simd.h"

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
/* How far ahead, and into which cache, the K/V rows are prefetched (-D overrides them for A/B builds,
 * experiments.kernel_ab). Into L2 (prefetcht1): on Zen 4 a prefetch into L1 holds one of its few miss buffers
 * until the line arrives, which capped a 64-row step's K/V reads near 10 GB/s; into L2, 13-16 GB/s
 * (experiments.attention_kernels). One block ahead, not three: with an item per row (below) 1.02-1.11x faster
 * over 8-64 rows of 290 and 1,000 tokens, and no slower for 1-8 rows of the whole forward (Zen 4, 2026-11-30;
 * `perf` had put the kernel's hottest instructions just after these prefetches, the miss buffers full). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1 /* blocks */
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2 /* __builtin_prefetch's locality: 2 is prefetcht1 */
#endif

static inline void load_row(const void *base, int64_t offset, int is_bf16, int d, float *dst) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        const float *p = (const float *)base + offset;
        for (int i = 0; i < d; i++) dst[i] = p[i];
    }
}

/* Blocks lie anywhere in the pool, so no hardware prefetcher can guess the next one. The K (V) loop of a block
 * fetches the matching row of the block PREFETCH_AHEAD ahead one token at a time: the reads are spread over the
 * arithmetic instead of queued behind each other in one burst (a burst per block gave half the bandwidth). */
static inline __attribute__((always_inline)) void next_block_rows(
    const void *kv, const int64_t *table, int64_t start, int64_t len, int block_size, int64_t block_stride,
    int64_t k_offset, int64_t v_offset, int kvh, int head_dim, int elem, int ahead, const char **k, const char **v) {
    *k = *v = 0;
    if (start + (int64_t)ahead * block_size >= len) return;
    int64_t next = table[start / block_size + ahead] * block_stride + (int64_t)kvh * head_dim;
    *k = (const char *)kv + (next + k_offset) * elem;
    *v = (const char *)kv + (next + v_offset) * elem;
}

/* Token t's row of a block found by next_block_rows (nothing when there is no such block). */
static inline __attribute__((always_inline)) void prefetch_row(const char *rows, int t, int64_t token_bytes,
                                                               int row_bytes) {
    if (rows)
        for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(rows + t * token_bytes + b, 0, PREFETCH_LOCALITY);
}

/* The rows of the blocks before the first in-loop prefetch lands (blocks 0 .. PREFETCH_AHEAD - 1). */
static inline __attribute__((always_inline)) void prefetch_first_blocks(
    const void *kv, const int64_t *table, int64_t len, int block_size, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, int kvh, int head_dim, int elem, int64_t token_bytes) {
    for (int ahead = 0; ahead < PREFETCH_AHEAD; ahead++) {
        const char *k, *v;
        next_block_rows(kv, table, 0, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim, elem, ahead,
                        &k, &v);
        for (int t = 0; t < block_size; t++) {
            prefetch_row(k, t, token_bytes, head_dim * elem);
            prefetch_row(v, t, token_bytes, head_dim * elem);
        }
    }
}

/* One block's n scores into one head's running softmax (its max m and sum l; its accumulator acc rescaled to the
 * new max), each score becoming its weight in the block: the plain loops' step, here and in kv_int8.h. */
static inline void softmax_block(float *scores, int n, float *acc, int head_dim, float *m, float *l) {
    float bmax = *m;
    for (int t = 0; t < n; t++) bmax = scores[t] > bmax ? scores[t] : bmax;
    float correction = expf(*m - bmax), sum = *l * correction;
    for (int i = 0; i < head_dim; i++) acc[i] *= correction;
    for (int t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - bmax);
        sum += scores[t];
    }
    *m = bmax;
    *l = sum;
}

/*
 * q:            [rows, num_heads, head_dim]
 * kv:           pool base; element (block, token, kv_head, dim) of this layer's K is at
 *               block * block_stride + k_offset + (token * num_kv_heads + kv_head) * head_dim + dim
 *               (V likewise with v_offset)
 * block_tables: [rows, max_blocks] int64
 * context_lens: [rows] int64, keys [0, len) are attended
 * out:          [rows, num_heads, head_dim]
 */
static inline __attribute__((always_inline)) void attend_one_scalar(
    const void *q, const int q_bf16, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out, const int out_bf16,
    int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale, const int is_bf16,
    int group, int64_t item)
{
    {
        int r = (int)(item / num_kv_heads);
        int kvh = (int)(item % num_kv_heads);
        int64_t len = context_lens[r];
        const int64_t *table = block_tables + (int64_t)r * max_blocks;

        float qv[MAX_GROUP][MAX_HEAD_DIM];
        float acc[MAX_GROUP][MAX_HEAD_DIM];
        float m[MAX_GROUP], l[MAX_GROUP];
        float scores[MAX_GROUP][MAX_BLOCK];
        float krow[MAX_HEAD_DIM];

        for (int g = 0; g < group; g++) {
            int64_t qoff = ((int64_t)r * num_heads + kvh * group + g) * head_dim;
            load_row(q, qoff, q_bf16, head_dim, qv[g]);
            for (int i = 0; i < head_dim; i++) { qv[g][i] *= scale; acc[g][i] = 0.f; }
            m[g] = -INFINITY;
            l[g] = 0.f;
        }

        const int elem = is_bf16 ? 2 : 4;
        int64_t token_stride = (int64_t)num_kv_heads * head_dim;
        prefetch_first_blocks(kv, table, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim, elem,
                             token_stride * elem);
        for (int64_t start = 0; start < len; start += block_size) {
            int64_t block = table[start / block_size];
            int n = (int)(len - start < block_size ? len - start : block_size);
            int64_t kbase = block * block_stride + k_offset + (int64_t)kvh * head_dim;
            int64_t vbase = block * block_stride + v_offset + (int64_t)kvh * head_dim;
            const char *pk, *pv;
            next_block_rows(kv, table, start, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim,
                            elem, PREFETCH_AHEAD, &pk, &pv);

            for (int t = 0; t < n; t++) {
                prefetch_row(pk, t, token_stride * elem, head_dim * elem);
                load_row(kv, kbase + t * token_stride, is_bf16, head_dim, krow);
                for (int g = 0; g < group; g++) {
                    float s = 0.f;
                    for (int i = 0; i < head_dim; i++) s += qv[g][i] * krow[i];
                    scores[g][t] = s;
                }
            }
            for (int g = 0; g < group; g++) softmax_block(scores[g], n, acc[g], head_dim, &m[g], &l[g]);
            for (int t = 0; t < n; t++) {
                prefetch_row(pv, t, token_stride * elem, head_dim * elem);
                load_row(kv, vbase + t * token_stride, is_bf16, head_dim, krow);
                for (int g = 0; g < group; g++) {
                    float p = scores[g][t];
                    for (int i = 0; i < head_dim; i++) acc[g][i] += p * krow[i];
                }
            }
        }

        for (int g = 0; g < group; g++) {
            float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
            int64_t ooff = ((int64_t)r * num_heads + kvh * group + g) * head_dim;
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + ooff;
                for (int i = 0; i < head_dim; i++) o[i] = f32_to_bf16(acc[g][i] * inv);
            } else {
                float *o = (float *)out + ooff;
                for (int i = 0; i < head_dim; i++) o[i] = acc[g][i] * inv;
            }
        }
    }
}

#if defined(__AVX512F__)
/*
 * The same with AVX-512, for head_dim a multiple of 16. Dimensions go 32 at a time as a pair of vectors
 * (a, b): for a bf16 pool a holds the even and b the odd dimensions of one 64-byte load, widened by a shift
 * and a mask (no cross-lane conversion); for float32, the first and second 16. q and the accumulators use
 * the same pairing, so a dot product is unchanged up to the order of its float32 sums, and the output is
 * put back in order once per item. The 16 scores of a tile of keys are one transpose-and-add of 16 partial
 * vectors instead of 16 horizontal sums. The next block's K (V) rows are prefetched a token at a time inside
 * the K (V) loop, so the reads are spread over the arithmetic instead of queued behind each other.
 */
#define PAIRS_MAX (MAX_HEAD_DIM / 32)
/* A block's V rows are folded into the accumulators of up to ACC_HEADS_MAX heads at once (accumulate_heads):
 * 1.06-1.11x over 8-64 rows of 290 and 1,000 tokens, bf16, against a head at a time (experiments.kernel_ab
 * decode_attention, Intel Xeon with AMX, 2026-12-06); -DATTEND_ACC_CHUNKS=0 builds the head-at-a-time path. */
#define ACC_HEADS_MAX 8
#ifndef ATTEND_ACC_CHUNKS
#define ATTEND_ACC_CHUNKS 1
#endif

static inline void load_pair(const void *p, int bf16, int64_t i, int dims, __m512 *a, __m512 *b) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)p + i;
        __m512i raw = dims == 32 ? _mm512_loadu_si512(src) /* a half pair: 16 dimensions, the rest zeros */
            : _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256((const __m256i *)src), 0);
        *a = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        *b = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
    } else {
        const float *src = (const float *)p + i;
        *a = _mm512_loadu_ps(src);
        *b = dims == 32 ? _mm512_loadu_ps(src + 16) : _mm512_setzero_ps();
    }
}

/* r[i] = the sum of the 16 lanes of v[i], for 16 vectors */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 p[8], c[4], e[2];
    for (int j = 0; j < 8; j++)
        p[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        __m512d x = _mm512_castps_pd(p[2 * j]), y = _mm512_castps_pd(p[2 * j + 1]);
        c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int j = 0; j < 2; j++)
        e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xdd));
}

/* The running state of the G query heads of one (row, kv head): q in the pool's pairing, scaled; the float32
 * accumulators; the running max and sum of each head's softmax. */
typedef struct {
    __m512 qa[MAX_GROUP][PAIRS_MAX], qb[MAX_GROUP][PAIRS_MAX], acca[MAX_GROUP][PAIRS_MAX], accb[MAX_GROUP][PAIRS_MAX];
    float m[MAX_GROUP], l[MAX_GROUP];
} attend_state;

/* Scratch shared by the blocks of an item: the 16 partial score vectors of a float32 pool's tile (attend_block)
 * and one block's scores per head. */
typedef struct {
    __m512 part[MAX_GROUP][16];
    float scores[MAX_GROUP][MAX_BLOCK + 16];
} attend_scratch;

static inline __attribute__((always_inline)) void attend_init(
    attend_state *st, const void *q, const int q_bf16, int64_t r, int kvh, int num_heads, const int head_dim,
    float scale, const int is_bf16, int group)
{
    const int np = (head_dim + 31) / 32;
    for (int h = 0; h < group; h++) {
        /* q in the pool's pairing, scaled; the dimensions past head_dim of the last pair are zeros */
        float row[MAX_HEAD_DIM + 32] = {0};
        int64_t qoff = ((int64_t)r * num_heads + kvh * group + h) * head_dim;
        for (int d = 0; d < head_dim; d += 16) _mm512_storeu_ps(row + d, load16(q, q_bf16, qoff + d));
        for (int c = 0; c < np; c++) {
            __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(row + 32 * c), _mm512_set1_ps(scale));
            __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(row + 32 * c + 16), _mm512_set1_ps(scale));
            if (is_bf16) {
                const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
                const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
                st->qa[h][c] = _mm512_permutex2var_ps(lo, even, hi);
                st->qb[h][c] = _mm512_permutex2var_ps(lo, odd, hi);
            } else {
                st->qa[h][c] = lo;
                st->qb[h][c] = hi;
            }
            st->acca[h][c] = st->accb[h][c] = _mm512_setzero_ps();
        }
        st->m[h] = -INFINITY;
        st->l[h] = 0.f;
    }
}

/* One head's scores for a tile of tn keys (at most 16) from t0 of a bf16 pool: q and the 16 partial vectors in
 * registers, so that only the tile's summed scores are stored (1.03-1.06x over 8-64 rows, experiments.kernel_ab
 * decode_attention, Zen 4). Each score is the same products summed in the same order as when the keys were walked
 * once for all the heads; pk: the rows to prefetch (the first head's pass only). */
static inline __attribute__((always_inline)) void score_head(
    const attend_state *st, attend_scratch *sc, int h, const void *kv, int64_t kbase, int t0, int tn,
    const char *pk, int64_t token_stride, const int head_dim, const int is_bf16, const int np)
{
    const int elem = is_bf16 ? 2 : 4, row_bytes = head_dim * elem;
    const int64_t token_bytes = token_stride * elem;
    __m512 qa[PAIRS_MAX], qb[PAIRS_MAX], part[16];
    for (int c = 0; c < np; c++) {
        qa[c] = st->qa[h][c];
        qb[c] = st->qb[h][c];
    }
    for (int t = 0; t < tn; t++) {
        prefetch_row(pk, t0 + t, token_bytes, row_bytes);
        __m512 ka, kb;
        load_pair(kv, is_bf16, kbase + (t0 + t) * token_stride, head_dim < 32 ? 16 : 32, &ka, &kb);
        __m512 s = _mm512_mul_ps(qa[0], ka);
        s = _mm512_fmadd_ps(qb[0], kb, s);
        for (int c = 1; c < np; c++) {
            load_pair(kv, is_bf16, kbase + (t0 + t) * token_stride + 32 * c, head_dim - 32 * c < 32 ? 16 : 32,
                      &ka, &kb);
            s = _mm512_fmadd_ps(qa[c], ka, s);
            s = _mm512_fmadd_ps(qb[c], kb, s);
        }
        part[t] = s;
    }
    for (int t = tn; t < 16; t++) part[t] = _mm512_setzero_ps();
    _mm512_storeu_ps(sc->scores[h] + t0, sum16x16(part));
}

#define SCORE_HEADS(NP)                                                                                         \
    for (int h = 0; h < group; h++)                                                                             \
        score_head(st, sc, h, kv, kbase, t0, tn, h == 0 ? pk : 0, token_stride, head_dim, is_bf16, NP)

/* One head's accumulators over a block's V rows (scores p), held in registers across the rows: np is a constant
 * where attend_block's switch inlines this, so the compiler keeps them out of memory. Each accumulator takes the
 * correction and then one FMA per row in row order, as when the rows were walked once for all the heads with the
 * accumulators in attend_state, so the sums are the same to the bit. Walked that way, each FMA loaded and stored
 * its accumulator: the hottest lines of a prompt step under engine.deterministic (`perf`, 135M, Zen 4). pv: the
 * rows to prefetch (the first head's pass only). */
static inline __attribute__((always_inline)) void accumulate_head(
    attend_state *st, int h, float correction, const float *p, const void *kv, int64_t vbase, int n,
    const char *pv, int64_t token_stride, const int head_dim, const int is_bf16, const int np)
{
    const int elem = is_bf16 ? 2 : 4, row_bytes = head_dim * elem;
    const int64_t token_bytes = token_stride * elem;
    __m512 a[PAIRS_MAX], b[PAIRS_MAX];
    for (int c = 0; c < np; c++) {
        a[c] = st->acca[h][c];
        b[c] = st->accb[h][c];
    }
    if (correction != 1.f) {
        __m512 cv = _mm512_set1_ps(correction);
        for (int c = 0; c < np; c++) {
            a[c] = _mm512_mul_ps(a[c], cv);
            b[c] = _mm512_mul_ps(b[c], cv);
        }
    }
    for (int t = 0; t < n; t++) {
        prefetch_row(pv, t, token_bytes, row_bytes);
        __m512 pt = _mm512_set1_ps(p[t]);
        for (int c = 0; c < np; c++) {
            __m512 va, vb;
            load_pair(kv, is_bf16, vbase + t * token_stride + 32 * c, head_dim - 32 * c < 32 ? 16 : 32, &va, &vb);
            a[c] = _mm512_fmadd_ps(pt, va, a[c]);
            b[c] = _mm512_fmadd_ps(pt, vb, b[c]);
        }
    }
    for (int c = 0; c < np; c++) {
        st->acca[h][c] = a[c];
        st->accb[h][c] = b[c];
    }
}

/* accumulate_head for NH heads at once (h0 on), each V row widened once for all of them: the same products
 * added in the same order into each accumulator, so the sums are the same to the bit. NH * NP * 2 accumulators
 * (at most 16) stay in registers. */
static inline __attribute__((always_inline)) void accumulate_heads(
    attend_state *st, int h0, const int nh, const float *corrections, const attend_scratch *sc, const void *kv,
    int64_t vbase, int n, const char *pv, int64_t token_stride, const int head_dim, const int is_bf16, const int np)
{
    const int elem = is_bf16 ? 2 : 4, row_bytes = head_dim * elem;
    const int64_t token_bytes = token_stride * elem;
    __m512 a[ACC_HEADS_MAX][PAIRS_MAX], b[ACC_HEADS_MAX][PAIRS_MAX];
    for (int j = 0; j < nh; j++) {
        float correction = corrections[h0 + j];
        __m512 cv = _mm512_set1_ps(correction);
        for (int c = 0; c < np; c++) {
            a[j][c] = st->acca[h0 + j][c];
            b[j][c] = st->accb[h0 + j][c];
            if (correction != 1.f) {
                a[j][c] = _mm512_mul_ps(a[j][c], cv);
                b[j][c] = _mm512_mul_ps(b[j][c], cv);
            }
        }
    }
    for (int t = 0; t < n; t++) {
        prefetch_row(pv, t, token_bytes, row_bytes);
        __m512 pt[ACC_HEADS_MAX];
        for (int j = 0; j < nh; j++) pt[j] = _mm512_set1_ps(sc->scores[h0 + j][t]);
        for (int c = 0; c < np; c++) {
            __m512 va, vb;
            load_pair(kv, is_bf16, vbase + t * token_stride + 32 * c, head_dim - 32 * c < 32 ? 16 : 32, &va, &vb);
            for (int j = 0; j < nh; j++) {
                a[j][c] = _mm512_fmadd_ps(pt[j], va, a[j][c]);
                b[j][c] = _mm512_fmadd_ps(pt[j], vb, b[j][c]);
            }
        }
    }
    for (int j = 0; j < nh; j++)
        for (int c = 0; c < np; c++) {
            st->acca[h0 + j][c] = a[j][c];
            st->accb[h0 + j][c] = b[j][c];
        }
}

/* The heads NP-pair accumulators at a time in chunks of up to 16 / (2 NP) heads (accumulate_heads); a chunk's
 * head count a constant per case. */
#define ACC_CHUNK(NH, NP) accumulate_heads(st, h0, NH, corrections, sc, kv, vbase, n, h0 == 0 ? pv : 0, token_stride, \
                                           head_dim, is_bf16, NP)
#define ACCUMULATE_CHUNKS(NP)                                                                                   \
    for (int h0 = 0; h0 < group; h0 += 8 / (NP)) {                                                              \
        int nh = group - h0 < 8 / (NP) ? group - h0 : 8 / (NP);                                                 \
        switch (nh) {                                                                                           \
        case 1: ACC_CHUNK(1, NP); break;                                                                        \
        case 2: ACC_CHUNK(2, NP); break;                                                                        \
        case 3: ACC_CHUNK(3, NP); break;                                                                        \
        case 4: ACC_CHUNK(4, NP); break;                                                                        \
        case 5: ACC_CHUNK(5, NP); break;                                                                        \
        case 6: ACC_CHUNK(6, NP); break;                                                                        \
        case 7: ACC_CHUNK(7, NP); break;                                                                        \
        default: ACC_CHUNK(8, NP); break;                                                                       \
        }                                                                                                       \
    }

#define ACCUMULATE_HEADS(NP)                                                                                    \
    for (int h = 0; h < group; h++)                                                                             \
        accumulate_head(st, h, corrections[h], sc->scores[h], kv, vbase, n, h == 0 ? pv : 0, token_stride,      \
                        head_dim, is_bf16, NP)

/* One block's n keys (K rows from kbase, V rows from vbase) folded into st; pk / pv: the rows to prefetch. */
static inline __attribute__((always_inline)) void attend_block(
    attend_state *st, attend_scratch *sc, const void *kv, int64_t kbase, int64_t vbase, int n, const char *pk,
    const char *pv, int64_t token_stride, const int head_dim, const int is_bf16, int group)
{
    const int np = (head_dim + 31) / 32, elem = is_bf16 ? 2 : 4, row_bytes = head_dim * elem;
    const int64_t token_bytes = token_stride * elem;
    __m512 ka[PAIRS_MAX], kb[PAIRS_MAX];
    for (int t0 = 0; t0 < n; t0 += 16) {
        int tn = n - t0 < 16 ? n - t0 : 16;
        if (is_bf16) {
            switch (np) { /* a constant np per case, as for the V rows below */
            case 1: SCORE_HEADS(1); break;
            case 2: SCORE_HEADS(2); break;
            case 3: SCORE_HEADS(3); break;
            case 4: SCORE_HEADS(4); break;
            default: SCORE_HEADS(np); break;
            }
            continue;
        }
        /* A float32 pool's K rows, twice the bytes, are read once for all the heads: a head at a time (score_head)
         * was 0.78-0.95x as fast there (experiments.kernel_ab decode_attention --dtype float32, Zen 4). */
        for (int t = 0; t < tn; t++) {
            prefetch_row(pk, t0 + t, token_bytes, row_bytes);
            for (int c = 0; c < np; c++) {
                int dims = head_dim - 32 * c < 32 ? 16 : 32;
                load_pair(kv, is_bf16, kbase + (t0 + t) * token_stride + 32 * c, dims, &ka[c], &kb[c]);
            }
            for (int h = 0; h < group; h++) {
                __m512 s = _mm512_mul_ps(st->qa[h][0], ka[0]);
                s = _mm512_fmadd_ps(st->qb[h][0], kb[0], s);
                for (int c = 1; c < np; c++) {
                    s = _mm512_fmadd_ps(st->qa[h][c], ka[c], s);
                    s = _mm512_fmadd_ps(st->qb[h][c], kb[c], s);
                }
                sc->part[h][t] = s;
            }
        }
        for (int h = 0; h < group; h++) {
            for (int t = tn; t < 16; t++) sc->part[h][t] = _mm512_setzero_ps();
            _mm512_storeu_ps(sc->scores[h] + t0, sum16x16(sc->part[h]));
        }
    }
    float corrections[MAX_GROUP];
    for (int h = 0; h < group; h++) {
        float bmax = st->m[h];
        for (int t = 0; t < n; t += 16) {
            __mmask16 keep = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
            float bm = _mm512_mask_reduce_max_ps(keep, _mm512_loadu_ps(sc->scores[h] + t));
            bmax = bm > bmax ? bm : bmax;
        }
        float correction = expf(st->m[h] - bmax);
        __m512 sum = _mm512_setzero_ps(), vmax = _mm512_set1_ps(bmax);
        for (int t = 0; t < n; t += 16) {
            __mmask16 keep = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
            __m512 p = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc->scores[h] + t), vmax)));
            _mm512_storeu_ps(sc->scores[h] + t, p);
            sum = _mm512_add_ps(sum, p);
        }
        st->l[h] = st->l[h] * correction + _mm512_reduce_add_ps(sum);
        st->m[h] = bmax;
        corrections[h] = correction;
    }
    switch (np) { /* a constant np per case, so that each head's accumulators stay in registers (accumulate_head) */
#if ATTEND_ACC_CHUNKS
    case 1: ACCUMULATE_CHUNKS(1); break;
    case 2: ACCUMULATE_CHUNKS(2); break;
    case 4: ACCUMULATE_CHUNKS(4); break;
#else
    case 1: ACCUMULATE_HEADS(1); break;
    case 2: ACCUMULATE_HEADS(2); break;
    case 4: ACCUMULATE_HEADS(4); break;
#endif
    case 3: ACCUMULATE_HEADS(3); break;
    default: ACCUMULATE_HEADS(np); break;
    }
}
#undef ACCUMULATE_HEADS
#undef ACCUMULATE_CHUNKS
#undef ACC_CHUNK
#undef SCORE_HEADS

static inline __attribute__((always_inline)) void attend_finish(
    const attend_state *st, void *out, const int out_bf16, int64_t r, int kvh, int num_heads, const int head_dim,
    const int is_bf16, int group)
{
    const int np = (head_dim + 31) / 32;
    for (int h = 0; h < group; h++) {
        __m512 inv = _mm512_set1_ps(st->l[h] > 0.f ? 1.f / st->l[h] : 0.f);
        int64_t ooff = ((int64_t)r * num_heads + kvh * group + h) * head_dim;
        for (int c = 0; c < np; c++) {
            __m512 a = _mm512_mul_ps(st->acca[h][c], inv), b = _mm512_mul_ps(st->accb[h][c], inv), lo = a, hi = b;
            if (is_bf16) { /* even and odd dimensions back in order */
                const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                lo = _mm512_permutex2var_ps(a, first, b);
                hi = _mm512_permutex2var_ps(a, _mm512_add_epi32(first, _mm512_set1_epi32(8)), b);
            }
            store16(out, out_bf16, ooff + 32 * c, lo);
            if (head_dim - 32 * c >= 32) store16(out, out_bf16, ooff + 32 * c + 16, hi);
        }
    }
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/*
 * The same with AVX2 and FMA, for head_dim a multiple of 8 (a CPU without AVX-512): dimensions 8 at a time; the 8
 * scores of a tile of keys are 8 independent FMA chains summed by one transpose-and-add (sum8x8), the softmax's
 * exponentials 8 at a time (exp8), and a head's accumulators stay in registers over a block's V rows. A bf16 pool's
 * block is widened to float32 once, K rows then V rows, into a scratch (WIDEN_FLOATS; in L1 at the common sizes, 4 KB
 * for 16 tokens of 64 dimensions) that every query head of the group then reads: widening each K row once per head
 * had cost more than the scalar loop (first-generation Zen, 135M shapes: 0.92-0.99x), the scratch gains 1.02-1.15x
 * over it (Zen 3; experiments.kernel_ab decode_attention --dtype bfloat16). Items per (row, kv head) or per row
 * (attend_by_row), as above.
 */
#define CHUNKS_MAX (MAX_HEAD_DIM / 8)
/* The most floats of a bf16 block's K (or V) rows widened at once: 32 KB, blocks of up to 64 tokens of 128
 * dimensions (16 x 64 is 4 KB); larger blocks of a bf16 pool take the scalar path (ATTEND_VECTOR_KV). */
#define WIDEN_FLOATS 8192

static inline __m256 load8_any(const void *p, int bf16, int64_t i) {
    return bf16 ? widen8_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* The running state of the G query heads of one (row, kv head): q scaled, the float32 accumulators, and each
 * head's running max and sum. */
typedef struct {
    __m256 qv[MAX_GROUP][CHUNKS_MAX], acc[MAX_GROUP][CHUNKS_MAX];
    float m[MAX_GROUP], l[MAX_GROUP];
} attend_state;

/* One block's scores per head (8 past the block for the last tile's lanes), and a bf16 block's rows widened. */
typedef struct {
    float scores[MAX_GROUP][MAX_BLOCK + 8];
    float rows[WIDEN_FLOATS] __attribute__((aligned(32)));
} attend_scratch;

/* n rows of head_dim bf16 values from base (token_stride apart) as float32 rows side by side in dst */
static inline __attribute__((always_inline)) void widen_rows(float *dst, const void *kv, int64_t base, int n,
                                                             int64_t token_stride, const int head_dim)
{
    for (int t = 0; t < n; t++)
        for (int c = 0; c < head_dim; c += 8)
            _mm256_store_ps(dst + t * head_dim + c, widen8_bf16((const uint16_t *)kv + base + t * token_stride + c));
}

static inline __attribute__((always_inline)) void attend_init(
    attend_state *st, const void *q, const int q_bf16, int64_t r, int kvh, int num_heads, const int head_dim,
    float scale, const int is_bf16, int group)
{
    (void)is_bf16; /* the AVX-512 path's pairing needs it; here q is in order whatever the pool */
    for (int h = 0; h < group; h++) {
        int64_t qoff = ((int64_t)r * num_heads + kvh * group + h) * head_dim;
        for (int c = 0; c < head_dim / 8; c++) {
            st->qv[h][c] = _mm256_mul_ps(load8_any(q, q_bf16, qoff + 8 * c), _mm256_set1_ps(scale));
            st->acc[h][c] = _mm256_setzero_ps();
        }
        st->m[h] = -INFINITY;
        st->l[h] = 0.f;
    }
}

/* One block's n keys (K rows from kbase, V rows from vbase) folded into st; pk / pv: the rows to prefetch. */
static inline __attribute__((always_inline)) void attend_block(
    attend_state *st, attend_scratch *sc, const void *kv, int64_t kbase, int64_t vbase, int n, const char *pk,
    const char *pv, int64_t token_stride, const int head_dim, const int is_bf16, int group)
{
    const int nc = head_dim / 8, row_bytes = head_dim * (is_bf16 ? 2 : 4);
    const int64_t token_bytes = token_stride * (is_bf16 ? 2 : 4);
    const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    __m256 part[8];
    for (int t = 0; t < n; t++) prefetch_row(pk, t, token_bytes, row_bytes);
    /* the rows the heads read: the pool's own (float32), or the block's widened in sc->rows (bf16) */
    const float *rows = (const float *)kv;
    int64_t kb = kbase, vb = vbase, stride = token_stride;
    if (is_bf16) {
        widen_rows(sc->rows, kv, kbase, n, token_stride, head_dim);
        rows = sc->rows;
        kb = vb = 0;
        stride = head_dim;
    }
    for (int h = 0; h < group; h++) {
        float *scores = sc->scores[h];
        for (int t0 = 0; t0 < n; t0 += 8) { /* a head's scores of 8 keys: 8 partial vectors, one sum8x8 */
            int tn = n - t0 < 8 ? n - t0 : 8;
            const float *ko = rows + kb + t0 * stride;
            if (tn == 8) { /* the 8 keys' sums side by side: 8 independent FMA chains, not one per key */
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) part[t] = _mm256_setzero_ps();
                for (int c = 0; c < nc; c++)
#pragma GCC unroll 8
                    for (int t = 0; t < 8; t++)
                        part[t] = _mm256_fmadd_ps(st->qv[h][c], _mm256_loadu_ps(ko + t * stride + 8 * c), part[t]);
            } else {
                for (int t = 0; t < 8; t++) part[t] = _mm256_setzero_ps();
                for (int t = 0; t < tn; t++)
                    for (int c = 0; c < nc; c++)
                        part[t] = _mm256_fmadd_ps(st->qv[h][c], _mm256_loadu_ps(ko + t * stride + 8 * c), part[t]);
            }
            _mm256_storeu_ps(scores + t0, sum8x8(part));
        }
        float bmax = st->m[h];
        for (int t = 0; t < n; t++) bmax = scores[t] > bmax ? scores[t] : bmax;
        float correction = expf(st->m[h] - bmax);
        __m256 sum = _mm256_setzero_ps(), vmax = _mm256_set1_ps(bmax);
        for (int t = 0; t < n; t += 8) { /* keys past n (a block's last tile) weigh nothing */
            __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(n - t)), _CMP_LT_OQ);
            __m256 p = _mm256_and_ps(keep, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vmax)));
            _mm256_storeu_ps(scores + t, p);
            sum = _mm256_add_ps(sum, p);
        }
        st->l[h] = st->l[h] * correction + sum8(sum);
        st->m[h] = bmax;
        if (correction != 1.f)
            for (int c = 0; c < nc; c++) st->acc[h][c] = _mm256_mul_ps(st->acc[h][c], _mm256_set1_ps(correction));
    }
    for (int t = 0; t < n; t++) prefetch_row(pv, t, token_bytes, row_bytes);
    if (is_bf16) widen_rows(sc->rows, kv, vbase, n, token_stride, head_dim); /* the K rows are done with */
    for (int h = 0; h < group; h++) /* a head's accumulators held over the block's V rows (L1 after head 0) */
        for (int c0 = 0; c0 < nc; c0 += 8) {
            const int cn = nc - c0 < 8 ? nc - c0 : 8;
            __m256 a[8];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) a[c] = c < cn ? st->acc[h][c0 + c] : _mm256_setzero_ps();
            for (int t = 0; t < n; t++) {
                const __m256 p = _mm256_set1_ps(sc->scores[h][t]);
                const float *vo = rows + vb + t * stride + 8 * c0;
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    if (c < cn) a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vo + 8 * c), a[c]);
            }
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                if (c < cn) st->acc[h][c0 + c] = a[c];
        }
}

static inline __attribute__((always_inline)) void attend_finish(
    const attend_state *st, void *out, const int out_bf16, int64_t r, int kvh, int num_heads, const int head_dim,
    const int is_bf16, int group)
{
    (void)is_bf16;
    for (int h = 0; h < group; h++) {
        __m256 inv = _mm256_set1_ps(st->l[h] > 0.f ? 1.f / st->l[h] : 0.f);
        int64_t ooff = ((int64_t)r * num_heads + kvh * group + h) * head_dim;
        for (int c = 0; c < head_dim / 8; c++) {
            float o[8];
            _mm256_storeu_ps(o, _mm256_mul_ps(st->acc[h][c], inv));
            if (out_bf16)
                for (int i = 0; i < 8; i++) ((uint16_t *)out)[ooff + 8 * c + i] = f32_to_bf16(o[i]);
            else
                memcpy((float *)out + ooff + 8 * c, o, sizeof o);
        }
    }
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* A vector path (AVX-512, or AVX2 and FMA): head sizes of ATTEND_DIM_STEP dimensions at a time, rows as items */
#define ATTEND_VECTOR 1
#if defined(__AVX512F__)
#define ATTEND_DIM_STEP 16
#define ATTEND_VECTOR_KV(is_bf16, block_size, head_dim) 1
#else
#define ATTEND_DIM_STEP 8
/* AVX2 takes a bf16 pool whose block's rows fit the widening scratch */
#define ATTEND_VECTOR_KV(is_bf16, block_size, head_dim) \
    (!(is_bf16) || (int64_t)(block_size) * (head_dim) <= WIDEN_FLOATS)
#endif

/* One (row, kv head) through the vector path's attend_init, attend_block and attend_finish. */
static inline __attribute__((always_inline)) void attend_one_vector(
    const void *q, const int q_bf16, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out, const int out_bf16,
    int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale, const int is_bf16,
    int group, int64_t item)
{
    const int elem = is_bf16 ? 2 : 4;
    int r = (int)(item / num_kv_heads), kvh = (int)(item % num_kv_heads);
    int64_t len = context_lens[r];
    const int64_t *table = block_tables + (int64_t)r * max_blocks;
    int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    attend_state st;
    attend_scratch sc;

    attend_init(&st, q, q_bf16, r, kvh, num_heads, head_dim, scale, is_bf16, group);
    prefetch_first_blocks(kv, table, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim, elem,
                         token_stride * elem);
    for (int64_t start = 0; start < len; start += block_size) {
        int64_t block = table[start / block_size];
        int n = (int)(len - start < block_size ? len - start : block_size);
        int64_t base = block * block_stride + (int64_t)kvh * head_dim;
        const char *pk, *pv;
        next_block_rows(kv, table, start, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim, elem,
                        PREFETCH_AHEAD, &pk, &pv);
        attend_block(&st, &sc, kv, base + k_offset, base + v_offset, n, pk, pv, token_stride, head_dim, is_bf16,
                     group);
    }
    attend_finish(&st, out, out_bf16, r, kvh, num_heads, head_dim, is_bf16, group);
}

/*
 * Every kv head of one row, block by block: each block's K (V) rows of this layer are one contiguous range
 * that the heads read one after another, instead of three items reading every third row of it at different
 * times. For batches with enough rows to keep every thread busy at one item per row.
 */
#define ROW_MAX_KV_HEADS 16
/* An item is a whole row from ROW_ITEMS_MIN rows whose mean context is at least ROW_MIN_CONTEXT tokens. With the
 * prefetch three blocks ahead, an item per row was 1.34x faster than an item per (row, kv head) at 64 rows of 1,000
 * tokens and 12% slower at 64 of 290, so it waited for 400 tokens; one block ahead, it is as fast or faster at
 * every context measured (experiments.kernel_ab decode_attention, Zen 4). -D overrides both for A/B builds. */
#ifndef ROW_ITEMS_MIN
#define ROW_ITEMS_MIN 8
#endif
#ifndef ROW_MIN_CONTEXT
#define ROW_MIN_CONTEXT 0
#endif

/* Whether a step's decode rows go one item per row (attend_row): a pool the vector path takes, and enough rows to
 * keep every thread busy. */
static inline int attend_by_row(int rows, const int64_t *context_lens, int head_dim, int num_kv_heads, int block_size,
                                int is_bf16) {
    if (!ATTEND_VECTOR_KV(is_bf16, block_size, head_dim)) return 0;
#ifdef _OPENMP
    if (rows < omp_get_max_threads()) return 0;
#endif
    if (rows < ROW_ITEMS_MIN || head_dim % ATTEND_DIM_STEP != 0 || num_kv_heads > ROW_MAX_KV_HEADS) return 0;
    int64_t total = 0;
    for (int r = 0; r < rows; r++) total += context_lens[r];
    return total >= (int64_t)ROW_MIN_CONTEXT * rows;
}

static inline __attribute__((always_inline)) void attend_row(
    const void *q, const int q_bf16, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out, const int out_bf16,
    int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale, const int is_bf16,
    int group, attend_state *states, int64_t r)
{
    const int elem = is_bf16 ? 2 : 4;
    int64_t len = context_lens[r];
    const int64_t *table = block_tables + (int64_t)r * max_blocks;
    int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    attend_scratch sc;

    for (int kvh = 0; kvh < num_kv_heads; kvh++) {
        attend_init(&states[kvh], q, q_bf16, r, kvh, num_heads, head_dim, scale, is_bf16, group);
        prefetch_first_blocks(kv, table, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim, elem,
                             token_stride * elem);
    }
    for (int64_t start = 0; start < len; start += block_size) {
        int64_t block = table[start / block_size];
        int n = (int)(len - start < block_size ? len - start : block_size);
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            int64_t base = block * block_stride + (int64_t)kvh * head_dim;
            const char *pk, *pv;
            next_block_rows(kv, table, start, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim,
                            elem, PREFETCH_AHEAD, &pk, &pv);
            attend_block(&states[kvh], &sc, kv, base + k_offset, base + v_offset, n, pk, pv, token_stride,
                         head_dim, is_bf16, group);
        }
    }
    for (int kvh = 0; kvh < num_kv_heads; kvh++)
        attend_finish(&states[kvh], out, out_bf16, r, kvh, num_heads, head_dim, is_bf16, group);
}
#endif

/* One (row, kv head): the vector path where it applies (ATTEND_VECTOR_KV), else the scalar one. */
static inline __attribute__((always_inline)) void attend_one(
    const void *q, const int q_bf16, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out, const int out_bf16,
    int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale, const int is_bf16,
    int group, int64_t item)
{
#if defined(ATTEND_VECTOR)
    if (head_dim % ATTEND_DIM_STEP == 0 && ATTEND_VECTOR_KV(is_bf16, block_size, head_dim)) {
        attend_one_vector(q, q_bf16, kv, block_stride, k_offset, v_offset, block_tables, max_blocks, context_lens,
                          out, out_bf16, num_heads, num_kv_heads, head_dim, block_size, scale, is_bf16, group, item);
        return;
    }
#endif
    attend_one_scalar(q, q_bf16, kv, block_stride, k_offset, v_offset, block_tables, max_blocks, context_lens,
                      out, out_bf16, num_heads, num_kv_heads, head_dim, block_size, scale, is_bf16, group, item);
}

#endif
