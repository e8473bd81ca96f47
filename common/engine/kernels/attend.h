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

#include "bf16.h"
#include "simd.h"

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define PREFETCH_AHEAD 2 /* blocks */

static inline void load_row(const void *base, int64_t offset, int is_bf16, int d, float *dst) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        const float *p = (const float *)base + offset;
        for (int i = 0; i < d; i++) dst[i] = p[i];
    }
}

/* Blocks lie anywhere in the pool: while the block at `start` is computed, fetch the K/V rows of the blocks
 * PREFETCH_AHEAD ahead (and, at the first block, the next one too), so the reads overlap the arithmetic instead
 * of waiting on memory one block after another. */
static inline __attribute__((always_inline)) void prefetch_ahead(
    const void *kv, const int64_t *table, int64_t start, int64_t len, int block_size, int64_t block_stride,
    int64_t k_offset, int64_t v_offset, int kvh, const int head_dim, int64_t token_stride, const int is_bf16)
{
    for (int64_t ahead = (start == 0 ? 1 : PREFETCH_AHEAD); ahead <= PREFETCH_AHEAD; ahead++) {
        if (start + ahead * block_size >= len) break;
        int64_t next = table[start / block_size + ahead] * block_stride + (int64_t)kvh * head_dim;
        int elem = is_bf16 ? 2 : 4;
        const char *kn = (const char *)kv + (next + k_offset) * elem;
        const char *vn = (const char *)kv + (next + v_offset) * elem;
        for (int t = 0; t < block_size; t++)
            for (int64_t b = 0; b < (int64_t)head_dim * elem; b += 64) {
                __builtin_prefetch(kn + t * token_stride * elem + b);
                __builtin_prefetch(vn + t * token_stride * elem + b);
            }
    }
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

        for (int64_t start = 0; start < len; start += block_size) {
            int64_t block = table[start / block_size];
            int n = (int)(len - start < block_size ? len - start : block_size);
            int64_t kbase = block * block_stride + k_offset + (int64_t)kvh * head_dim;
            int64_t vbase = block * block_stride + v_offset + (int64_t)kvh * head_dim;
            int64_t token_stride = (int64_t)num_kv_heads * head_dim;
            prefetch_ahead(kv, table, start, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim,
                           token_stride, is_bf16);

            for (int t = 0; t < n; t++) {
                load_row(kv, kbase + t * token_stride, is_bf16, head_dim, krow);
                for (int g = 0; g < group; g++) {
                    float s = 0.f;
                    for (int i = 0; i < head_dim; i++) s += qv[g][i] * krow[i];
                    scores[g][t] = s;
                }
            }
            for (int g = 0; g < group; g++) {
                float bmax = m[g];
                for (int t = 0; t < n; t++) bmax = scores[g][t] > bmax ? scores[g][t] : bmax;
                float correction = expf(m[g] - bmax);
                l[g] *= correction;
                for (int i = 0; i < head_dim; i++) acc[g][i] *= correction;
                for (int t = 0; t < n; t++) {
                    scores[g][t] = expf(scores[g][t] - bmax);
                    l[g] += scores[g][t];
                }
                m[g] = bmax;
            }
            for (int t = 0; t < n; t++) {
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
 * The same with AVX-512, for head_dim a multiple of 16: a token's K (or V) row is head_dim / 16 vectors,
 * widened once for every query head of the group. Scores are float32 dot products of q * scale (as the
 * scalar path: both agree up to the order of the sums); the block's softmax update runs 16 scores at a
 * time; the probabilities fold V rows into float32 accumulators kept as vectors.
 */
static inline __attribute__((always_inline)) void attend_one_avx512(
    const void *q, const int q_bf16, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out, const int out_bf16,
    int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale, const int is_bf16,
    int group, int64_t item)
{
    const int nb = head_dim / 16;
    int r = (int)(item / num_kv_heads), kvh = (int)(item % num_kv_heads);
    int64_t len = context_lens[r];
    const int64_t *table = block_tables + (int64_t)r * max_blocks;
    int64_t token_stride = (int64_t)num_kv_heads * head_dim;

    __m512 qv[MAX_GROUP * MAX_HEAD_DIM / 16], acc[MAX_GROUP * MAX_HEAD_DIM / 16], row[MAX_HEAD_DIM / 16];
    float m[MAX_GROUP], l[MAX_GROUP];
    float scores[MAX_GROUP][MAX_BLOCK + 16];
    __m512 vscale = _mm512_set1_ps(scale);

    for (int h = 0; h < group; h++) {
        int64_t qoff = ((int64_t)r * num_heads + kvh * group + h) * head_dim;
        for (int b = 0; b < nb; b++) {
            qv[h * nb + b] = _mm512_mul_ps(load16(q, q_bf16, qoff + 16 * b), vscale);
            acc[h * nb + b] = _mm512_setzero_ps();
        }
        m[h] = -INFINITY;
        l[h] = 0.f;
    }

    for (int64_t start = 0; start < len; start += block_size) {
        int64_t block = table[start / block_size];
        int n = (int)(len - start < block_size ? len - start : block_size);
        int64_t kbase = block * block_stride + k_offset + (int64_t)kvh * head_dim;
        int64_t vbase = block * block_stride + v_offset + (int64_t)kvh * head_dim;
        prefetch_ahead(kv, table, start, len, block_size, block_stride, k_offset, v_offset, kvh, head_dim,
                       token_stride, is_bf16);

        for (int t = 0; t < n; t++) {
            for (int b = 0; b < nb; b++) row[b] = load16(kv, is_bf16, kbase + t * token_stride + 16 * b);
            for (int h = 0; h < group; h++) {
                const __m512 *k = row;
                __m512 s = _mm512_mul_ps(qv[h * nb], k[0]);
                for (int b = 1; b < nb; b++) s = _mm512_fmadd_ps(qv[h * nb + b], k[b], s);
                scores[h][t] = _mm512_reduce_add_ps(s);
            }
        }
        for (int h = 0; h < group; h++) {
            float bmax = m[h];
            for (int t = 0; t < n; t += 16) {
                __mmask16 keep = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
                float bm = _mm512_mask_reduce_max_ps(keep, _mm512_loadu_ps(scores[h] + t));
                bmax = bm > bmax ? bm : bmax;
            }
            float correction = expf(m[h] - bmax);
            __m512 sum = _mm512_setzero_ps(), vmax = _mm512_set1_ps(bmax);
            for (int t = 0; t < n; t += 16) {
                __mmask16 keep = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1u);
                __m512 p = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_loadu_ps(scores[h] + t), vmax)));
                _mm512_storeu_ps(scores[h] + t, p);
                sum = _mm512_add_ps(sum, p);
            }
            l[h] = l[h] * correction + _mm512_reduce_add_ps(sum);
            m[h] = bmax;
            if (correction != 1.f) {
                __m512 c = _mm512_set1_ps(correction);
                for (int b = 0; b < nb; b++) acc[h * nb + b] = _mm512_mul_ps(acc[h * nb + b], c);
            }
        }
        for (int t = 0; t < n; t++) {
            for (int b = 0; b < nb; b++) row[b] = load16(kv, is_bf16, vbase + t * token_stride + 16 * b);
            for (int h = 0; h < group; h++) {
                const __m512 *v = row;
                __m512 p = _mm512_set1_ps(scores[h][t]);
                for (int b = 0; b < nb; b++) acc[h * nb + b] = _mm512_fmadd_ps(p, v[b], acc[h * nb + b]);
            }
        }
    }

    for (int h = 0; h < group; h++) {
        __m512 inv = _mm512_set1_ps(l[h] > 0.f ? 1.f / l[h] : 0.f);
        int64_t ooff = ((int64_t)r * num_heads + kvh * group + h) * head_dim;
        for (int b = 0; b < nb; b++) store16(out, out_bf16, ooff + 16 * b, _mm512_mul_ps(acc[h * nb + b], inv));
    }
}
#endif

/* One (row, kv head): the AVX-512 path where it applies, else the scalar one. */
static inline __attribute__((always_inline)) void attend_one(
    const void *q, const int q_bf16, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out, const int out_bf16,
    int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale, const int is_bf16,
    int group, int64_t item)
{
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        attend_one_avx512(q, q_bf16, kv, block_stride, k_offset, v_offset, block_tables, max_blocks, context_lens,
                          out, out_bf16, num_heads, num_kv_heads, head_dim, block_size, scale, is_bf16, group, item);
        return;
    }
#endif
    attend_one_scalar(q, q_bf16, kv, block_stride, k_offset, v_offset, block_tables, max_blocks, context_lens,
                      out, out_bf16, num_heads, num_kv_heads, head_dim, block_size, scale, is_bf16, group, item);
}

#endif
