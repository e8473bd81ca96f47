/*
 * The int8 KV pool's row format (engine.cpu.kv_cache_dtype: int8) and its paged decode attention, shared by kv_int8.c
 * (the pool's store, gather and attention entry points) and decode_forward.c (the one-call decode step, which
 * stores its new K/V and attends over such a pool itself); common/engine/kv_int8.py mirrors the format in torch.
 *
 * A row is one (token, kv head) of one layer's K or V: head_dim int8 values, then their float32 scale (4 bytes),
 * head_dim + 4 bytes in all, x[d] = scale * q[d]. Symmetric, one scale per row: scale = max|x| * (1 / 127) and
 * q = x * (127 / max|x|) rounded to nearest (even), so the scale and the values are the same bits as the torch
 * code's. Rows lie in the pool as kv_cache.py lays it out: a layer's K row (block, token, head) at
 * block * block_stride + k_offset + (token * heads + head) * (head_dim + 4) bytes, V likewise from v_offset.
 *
 * The attention is attend.h's running softmax over blocks, an item being a row's kv heads [kvh0, kvh1), the G query
 * heads of a group sharing each K/V read: a row of K widened once, its scale applied to the score, and V's scale
 * folded into each probability. An item's sums do not depend on the other rows of the step, so it is batch-invariant
 * as the bf16 kernel is (engine.deterministic reads every row through it).
 */
#ifndef TESSERA_KV_INT8_H
#define TESSERA_KV_INT8_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"

#define I8_SCALE_BYTES 4

static inline float row_scale(const int8_t *row, int head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}

/* One row of head_dim values (float32 or bf16 at element `at` of src) into dst: values, then the scale. */
static inline void quantize_row(const void *src, int bf16, int64_t at, int head_dim, int8_t *dst) {
    float row[MAX_HEAD_DIM], amax = 0.f;
    load_row(src, at, bf16, head_dim, row);
    for (int d = 0; d < head_dim; d++) amax = fabsf(row[d]) > amax ? fabsf(row[d]) : amax;
    float scale = amax * (1.0f / 127.0f), inv = amax > 0.f ? 127.0f / amax : 0.f;
    for (int d = 0; d < head_dim; d++) {
        float x = nearbyintf(row[d] * inv);
        dst[d] = (int8_t)(x > 127.f ? 127.f : x < -127.f ? -127.f : x);
    }
    memcpy(dst + head_dim, &scale, sizeof scale);
}

/* One (row, kv head) without AVX-512: plain float32 loops. */
static void attend_i8_scalar(
    const void *q, int q_bf16, const int8_t *pool, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *table, int64_t len, void *out, int64_t r, int kvh, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, int group)
{
    const int64_t row_bytes = head_dim + I8_SCALE_BYTES, token_bytes = num_kv_heads * row_bytes;
    float qv[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float scores[MAX_GROUP][MAX_BLOCK];
    for (int g = 0; g < group; g++) {
        load_row(q, (r * num_heads + kvh * group + g) * head_dim, q_bf16, head_dim, qv[g]);
        for (int d = 0; d < head_dim; d++) {
            qv[g][d] *= scale;
            acc[g][d] = 0.f;
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    for (int64_t start = 0; start < len; start += block_size) {
        int n = (int)(len - start < block_size ? len - start : block_size);
        const int8_t *kb = pool + table[start / block_size] * block_stride + k_offset + kvh * row_bytes;
        const int8_t *vb = kb - k_offset + v_offset;
        for (int t = 0; t < n; t++) {
            const int8_t *row = kb + t * token_bytes;
            float s = row_scale(row, head_dim);
            for (int g = 0; g < group; g++) {
                float dot = 0.f;
                for (int d = 0; d < head_dim; d++) dot += qv[g][d] * (float)row[d];
                scores[g][t] = dot * s;
            }
        }
        for (int g = 0; g < group; g++) softmax_block(scores[g], n, acc[g], head_dim, &m[g], &l[g]);
        for (int t = 0; t < n; t++) {
            const int8_t *row = vb + t * token_bytes;
            float s = row_scale(row, head_dim);
            for (int g = 0; g < group; g++) {
                float p = scores[g][t] * s;
                for (int d = 0; d < head_dim; d++) acc[g][d] += p * (float)row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        int64_t ooff = (r * num_heads + kvh * group + g) * head_dim;
        for (int d = 0; d < head_dim; d++) {
            if (q_bf16) ((uint16_t *)out)[ooff + d] = f32_to_bf16(acc[g][d] * inv);
            else ((float *)out)[ooff + d] = acc[g][d] * inv;
        }
    }
}

#if defined(__AVX512F__)
static inline __m512 widen16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* One item's running state, per thread (heads: the item's query heads, at most num_heads): q scaled and the
 * float32 accumulators [heads][head_dim], each head's running max and sum, one block's scores per head, a tile of 16
 * K or V rows widened to float32 (and K's to int16 for the integer scores), q in int16 steps and their size. */
typedef struct {
    float *q, *acc, *m, *l, *scores, *tile, *tile_scale, *q_step;
    int16_t *q16, *tile16;
    void *base;
} i8_state;

/* Lays the state's fields out from base, each 64-byte aligned, or with base NULL only counts their bytes. */
static size_t i8_state_layout(i8_state *st, char *base, int num_heads, int head_dim) {
    size_t at = 0;
#define TAKE(field, type, n) do { if (base) st->field = (type *)(base + at); \
                                  at += ((n) * sizeof(type) + 63) / 64 * 64; } while (0)
    TAKE(tile, float, 16 * (size_t)head_dim);
    TAKE(q, float, (size_t)num_heads * head_dim);
    TAKE(acc, float, (size_t)num_heads * head_dim);
    TAKE(scores, float, (size_t)num_heads * (MAX_BLOCK + 16));
    TAKE(tile_scale, float, 16);
    TAKE(m, float, num_heads);
    TAKE(l, float, num_heads);
    TAKE(q_step, float, num_heads);
    TAKE(q16, int16_t, (size_t)num_heads * head_dim);
    TAKE(tile16, int16_t, 16 * (size_t)head_dim);
#undef TAKE
    return at;
}

/* A thread's state for items of up to num_heads query heads, or NULL (no memory: the caller takes the plain
 * loops). */
static i8_state *i8_state_new(int num_heads, int head_dim) {
    i8_state *st = malloc(sizeof(i8_state));
    char *base = st ? aligned_alloc(64, i8_state_layout(st, NULL, num_heads, head_dim)) : NULL;
    if (base == NULL) {
        free(st);
        return NULL;
    }
    i8_state_layout(st, base, num_heads, head_dim);
    st->base = base;
    return st;
}

static void i8_state_free(i8_state *st) {
    if (st) free(st->base);
    free(st);
}

/* The next block's row of token t for kv head kvh, into L2 (attend.h's PREFETCH_LOCALITY): a row of head_dim + 4
 * bytes may span two lines. */
static inline __attribute__((always_inline)) void prefetch_i8_row(const int8_t *next, int64_t at, int64_t row_bytes) {
    if (!next) return;
    __builtin_prefetch(next + at, 0, PREFETCH_LOCALITY);
    __builtin_prefetch(next + at + row_bytes - 1, 0, PREFETCH_LOCALITY);
}

/* Widen up to 16 rows (from t0 of a block, kv head kvh) into the state's tile, their scales beside them, while
 * prefetching the same rows of the next block. */
static inline __attribute__((always_inline)) void widen_tile(
    i8_state *st, const int8_t *block, const int8_t *next, int t0, int tn, int64_t token_bytes, int64_t head_at,
    const int head_dim)
{
    const int64_t row_bytes = head_dim + I8_SCALE_BYTES;
    for (int t = 0; t < tn; t++) {
        int64_t at = (t0 + t) * token_bytes + head_at;
        prefetch_i8_row(next, at, row_bytes);
        for (int c = 0; c < head_dim; c += 16) _mm512_store_ps(st->tile + t * head_dim + c, widen16_i8(block + at + c));
        st->tile_scale[t] = row_scale(block + at, head_dim);
    }
    for (int t = tn; t < 16; t++) st->tile_scale[t] = 0.f;
}

#if defined(__AVX512VNNI__)
#define I8_INT_SCORES 1
/* The scores of up to 16 K rows (from t0 of a block, at head_at; head_dim a multiple of 32) for the G query heads
 * from hg, written at pos + t0 of their scores, in integer sums: each row widened to int16 once (the tile), each
 * head's int16 q against it two dimensions a lane (AVX512-VNNI's vpdpwssd, 32 products an instruction), the 16 rows'
 * sums added across lanes by one transpose-and-add, then scaled by q's step and each row's scale. */
static inline __attribute__((always_inline)) void score_tile_int(
    i8_state *st, const int8_t *block, const int8_t *next, int t0, int tn, int64_t token_bytes, int64_t head_at,
    const int head_dim, int hg, int group, int pos)
{
    const int64_t row_bytes = head_dim + I8_SCALE_BYTES;
    const int np = head_dim / 32;
    for (int t = 0; t < tn; t++) {
        int64_t at = (t0 + t) * token_bytes + head_at;
        prefetch_i8_row(next, at, row_bytes);
        for (int c = 0; c < np; c++)
            _mm512_store_si512(st->tile16 + t * head_dim + 32 * c,
                               _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + at + 32 * c))));
        st->tile_scale[t] = row_scale(block + at, head_dim);
    }
    for (int t = tn; t < 16; t++) st->tile_scale[t] = 0.f;
    __m512 ks = _mm512_load_ps(st->tile_scale);
    for (int g = 0; g < group; g++) {
        const int16_t *qh = st->q16 + (hg + g) * head_dim;
        __m512i qv[MAX_HEAD_DIM / 32];
        __m512 part[16];
        for (int c = 0; c < np; c++) qv[c] = _mm512_loadu_si512(qh + 32 * c);
        for (int t = 0; t < tn; t++) {
            const int16_t *kt = st->tile16 + t * head_dim;
            __m512i sum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qv[0], _mm512_load_si512(kt));
            for (int c = 1; c < np; c++) sum = _mm512_dpwssd_epi32(sum, qv[c], _mm512_load_si512(kt + 32 * c));
            part[t] = _mm512_cvtepi32_ps(sum);
        }
        for (int t = tn; t < 16; t++) part[t] = _mm512_setzero_ps();
        __m512 scale = _mm512_mul_ps(ks, _mm512_set1_ps(st->q_step[hg + g]));
        _mm512_storeu_ps(st->scores + (hg + g) * (MAX_BLOCK + 16) + pos + t0, _mm512_mul_ps(sum16x16(part), scale));
    }
}
#else
#define I8_INT_SCORES 0
#endif

/* Kv heads [kvh0, kvh1) of row r with AVX-512, head_dim a multiple of 16 (a constant where the caller's switch
 * inlines it). Block by block, the heads take the block's rows one after another, so the block's K (V) range of
 * this layer is read from memory once, not once per head (three items reading every third row of it, at 135M's
 * three KV heads, read 2.2x the bytes). Keys go 16 at a time: the tile's rows are widened once, each query head's
 * 16 partial score vectors summed by one transpose-and-add (attend.h's sum16x16), the rows' scales applied to the
 * 16 scores; V's scales are folded into the probabilities, the accumulators kept in registers over a tile. */
static inline __attribute__((always_inline)) void attend_i8_vector(
    i8_state *st, const void *q, int q_bf16, const int8_t *pool, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *table, int64_t len, void *out, int64_t r, int kvh0, int kvh1, int num_heads,
    int num_kv_heads, const int head_dim, int block_size, float scale, int group)
{
    const int nc = head_dim / 16, h0 = kvh0 * group, h1 = kvh1 * group;
    const int64_t row_bytes = head_dim + I8_SCALE_BYTES, token_bytes = num_kv_heads * row_bytes;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int h = h0; h < h1; h++) {
        float *qh = st->q + h * head_dim, *acc = st->acc + h * head_dim;
        for (int c = 0; c < nc; c++) {
            _mm512_store_ps(qh + 16 * c, _mm512_mul_ps(load16(q, q_bf16, (r * num_heads + h) * head_dim + 16 * c), sv));
            _mm512_store_ps(acc + 16 * c, _mm512_setzero_ps());
        }
        st->m[h] = -INFINITY;
        st->l[h] = 0.f;
#if I8_INT_SCORES
        /* q in int16 steps of its own range (15 bits, where K has 8): each lane's products summed exactly in int32 */
        __m512 amax = _mm512_setzero_ps();
        for (int c = 0; c < nc; c++) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_load_ps(qh + 16 * c)));
        float top = _mm512_reduce_max_ps(amax), step = top * (1.0f / 32767.0f);
        __m512 inv = _mm512_set1_ps(top > 0.f ? 32767.0f / top : 0.f);
        for (int c = 0; c < nc; c++) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(qh + 16 * c), inv));
            _mm256_storeu_si256((__m256i *)(st->q16 + h * head_dim + 16 * c), _mm512_cvtsepi32_epi16(v));
        }
        st->q_step[h] = step;
#endif
    }
    /* A span of whole blocks at a time (up to MAX_BLOCK tokens): each block's scores for every kv head, one step of
     * the running softmax per head over the span, then each block's V rows; the next block's rows (then the span's
     * first V rows, the next span's first K rows) prefetched while a block is read. */
    const int64_t span = (int64_t)(MAX_BLOCK / block_size) * block_size;
    const int64_t num_blocks = (len + block_size - 1) / block_size;
#define BLOCK_AT(b, offset) (pool + table[b] * block_stride + (offset))
    for (int64_t start = 0; start < len; start += span) {
        const int n = (int)(len - start < span ? len - start : span);
        const int64_t first = start / block_size, last = (start + n - 1) / block_size; /* the span's blocks */
        for (int64_t b = first; b <= last; b++) {
            const int nt = (int)(len - b * block_size < block_size ? len - b * block_size : block_size);
            const int pos = (int)(b * block_size - start);
            const int8_t *kb = BLOCK_AT(b, k_offset);
            const int8_t *pk = b < last ? BLOCK_AT(b + 1, k_offset) : BLOCK_AT(first, v_offset);
            for (int kvh = kvh0; kvh < kvh1; kvh++) {
                const int64_t head_at = kvh * row_bytes;
                const int hg = kvh * group;
                for (int t0 = 0; t0 < nt; t0 += 16) {
                    int tn = nt - t0 < 16 ? nt - t0 : 16;
#if I8_INT_SCORES
                    if (head_dim % 32 == 0) { /* int16 pairs, 32 dimensions a vector */
                        score_tile_int(st, kb, pk, t0, tn, token_bytes, head_at, head_dim, hg, group, pos);
                        continue;
                    }
#endif
                    widen_tile(st, kb, pk, t0, tn, token_bytes, head_at, head_dim);
                    __m512 ks = _mm512_load_ps(st->tile_scale);
                    for (int g = 0; g < group; g++) {
                        const float *qh = st->q + (hg + g) * head_dim;
                        __m512 qv[MAX_HEAD_DIM / 16], part[16];
                        for (int c = 0; c < nc; c++) qv[c] = _mm512_load_ps(qh + 16 * c);
                        for (int t = 0; t < tn; t++) {
                            const float *kf = st->tile + t * head_dim;
                            __m512 s = _mm512_mul_ps(qv[0], _mm512_load_ps(kf));
                            for (int c = 1; c < nc; c++) s = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kf + 16 * c), s);
                            part[t] = s;
                        }
                        for (int t = tn; t < 16; t++) part[t] = _mm512_setzero_ps();
                        _mm512_storeu_ps(st->scores + (hg + g) * (MAX_BLOCK + 16) + pos + t0,
                                         _mm512_mul_ps(sum16x16(part), ks));
                    }
                }
            }
        }
        for (int h = h0; h < h1; h++) { /* the running softmax: each score becomes its weight in the span */
            float *sc = st->scores + h * (MAX_BLOCK + 16);
            __m512 top = _mm512_set1_ps(st->m[h]);
            for (int t = 0; t < n; t += 16) {
                __mmask16 live = (__mmask16)(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1);
                top = _mm512_mask_max_ps(top, live, top, _mm512_loadu_ps(sc + t));
            }
            float bmax = _mm512_reduce_max_ps(top);
            float correction = expf(st->m[h] - bmax);
            st->l[h] *= correction;
            if (correction != 1.f) {
                float *acc = st->acc + h * head_dim;
                for (int c = 0; c < nc; c++)
                    _mm512_store_ps(acc + 16 * c,
                                    _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), _mm512_set1_ps(correction)));
            }
            __m512 sum = _mm512_setzero_ps(), bm = _mm512_set1_ps(bmax);
            for (int t = 0; t < n; t += 16) {
                __mmask16 live = (__mmask16)(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1);
                __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), bm)));
                _mm512_storeu_ps(sc + t, e);
                sum = _mm512_add_ps(sum, e);
            }
            st->l[h] += _mm512_reduce_add_ps(sum);
            st->m[h] = bmax;
        }
        for (int64_t b = first; b <= last; b++) {
            const int nt = (int)(len - b * block_size < block_size ? len - b * block_size : block_size);
            const int pos = (int)(b * block_size - start);
            const int8_t *vb = BLOCK_AT(b, v_offset);
            const int8_t *pv = b < last ? BLOCK_AT(b + 1, v_offset)
                             : b + 1 < num_blocks ? BLOCK_AT(b + 1, k_offset) : 0;
            for (int kvh = kvh0; kvh < kvh1; kvh++) {
                const int64_t head_at = kvh * row_bytes;
                const int hg = kvh * group;
                for (int t0 = 0; t0 < nt; t0 += 16) {
                    int tn = nt - t0 < 16 ? nt - t0 : 16;
                    widen_tile(st, vb, pv, t0, tn, token_bytes, head_at, head_dim);
                    /* heads side by side, as many as keep their accumulators in 16 registers: independent chains */
                    const int per = nc >= 16 ? 1 : 16 / nc;
                    for (int g0 = 0; g0 < group; g0 += per) {
                        const int gn = group - g0 < per ? group - g0 : per;
                        const float *w = st->scores + (hg + g0) * (MAX_BLOCK + 16) + pos + t0;
                        __m512 a[16];
                        for (int g = 0; g < gn; g++)
                            for (int c = 0; c < nc; c++)
                                a[g * nc + c] = _mm512_load_ps(st->acc + (hg + g0 + g) * head_dim + 16 * c);
                        for (int t = 0; t < tn; t++) {
                            const float *vf = st->tile + t * head_dim;
                            for (int g = 0; g < gn; g++) {
                                __m512 p = _mm512_set1_ps(w[g * (MAX_BLOCK + 16) + t] * st->tile_scale[t]);
                                for (int c = 0; c < nc; c++)
                                    a[g * nc + c] = _mm512_fmadd_ps(p, _mm512_load_ps(vf + 16 * c), a[g * nc + c]);
                            }
                        }
                        for (int g = 0; g < gn; g++)
                            for (int c = 0; c < nc; c++)
                                _mm512_store_ps(st->acc + (hg + g0 + g) * head_dim + 16 * c, a[g * nc + c]);
                    }
                }
            }
        }
    }
#undef BLOCK_AT
    for (int h = h0; h < h1; h++) {
        __m512 inv = _mm512_set1_ps(st->l[h] > 0.f ? 1.f / st->l[h] : 0.f);
        const float *acc = st->acc + h * head_dim;
        for (int c = 0; c < nc; c++)
            store16(out, q_bf16, (r * num_heads + h) * head_dim + 16 * c,
                    _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), inv));
    }
}
#endif

#if !defined(__AVX512F__)
typedef struct {
    void *base;
} i8_state; /* no vector path here: attend_i8 takes the plain loops */
#endif

/* Kv heads [kvh0, kvh1) of row r of q (bf16 or float32; out likewise) over the int8 pool: the vector path with a
 * thread's state st, else the plain loops. */
static inline void attend_i8(
    i8_state *st, const void *q, int q_bf16, const int8_t *pool, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, const int64_t *table, int64_t len, void *out, int64_t r, int kvh0, int kvh1, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale, int group)
{
#if defined(__AVX512F__)
#define ATTEND_I8(D) attend_i8_vector(st, q, q_bf16, pool, block_stride, k_offset, v_offset, table, len, out, r, \
                                      kvh0, kvh1, num_heads, num_kv_heads, D, block_size, scale, group)
    if (st != NULL && head_dim % 16 == 0) {
        if (head_dim == 64) ATTEND_I8(64);
        else if (head_dim == 128) ATTEND_I8(128);
        else ATTEND_I8(head_dim);
        return;
    }
#undef ATTEND_I8
#else
    (void)st;
#endif
    for (int kvh = kvh0; kvh < kvh1; kvh++)
        attend_i8_scalar(q, q_bf16, pool, block_stride, k_offset, v_offset, table, len, out, r, kvh, num_heads,
                         num_kv_heads, head_dim, block_size, scale, group);
}

/* A thread's state for attend_i8 (NULL without AVX-512, where attend_i8 takes the plain loops). */
static inline i8_state *i8_thread_state(int num_heads, int head_dim) {
#if defined(__AVX512F__)
    return head_dim % 16 == 0 ? i8_state_new(num_heads, head_dim) : NULL;
#else
    (void)num_heads;
    (void)head_dim;
    return NULL;
#endif
}

static inline void i8_thread_state_free(i8_state *st) {
#if defined(__AVX512F__)
    i8_state_free(st);
#else
    (void)st;
#endif
}

#endif
