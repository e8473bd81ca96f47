/*
 * The int8 KV pool's entry points (engine.cpu.kv_cache_dtype: int8; the row format and the attention in kv_int8.h): the
 * store that quantizes a step's new K/V into its rows, the dequantizing read of a prompt chunk's cached context, and
 * the paged decode attention over every decode row of a step.
 */
#include "kv_int8.h"

/* k, v: [n, heads, head_dim] with row strides k_stride, v_stride (elements) between tokens; token i goes to slot
 * offsets[i] of block blocks[i]. */
int tessera_kv_store_i8(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int src_bf16,
                        const int64_t *blocks, const int64_t *offsets, int64_t n, int8_t *pool, int64_t block_stride,
                        int64_t k_offset, int64_t v_offset, int heads, int head_dim)
{
    const int64_t row_bytes = head_dim + I8_SCALE_BYTES;
    #pragma omp parallel for schedule(static) if (n * heads >= 256)
    for (int64_t item = 0; item < n * heads; item++) {
        int64_t i = item / heads, h = item % heads;
        int64_t slot = blocks[i] * block_stride + (offsets[i] * heads + h) * row_bytes;
        quantize_row(k, src_bf16, i * k_stride + h * head_dim, head_dim, pool + slot + k_offset);
        quantize_row(v, src_bf16, i * v_stride + h * head_dim, head_dim, pool + slot + v_offset);
    }
    return 0;
}

/* The first n tokens of a table's blocks, one layer's K (offset k_offset) or V, dequantized into out [n, heads,
 * head_dim] (bf16 or float32). */
int tessera_kv_gather_i8(const int8_t *pool, int64_t block_stride, int64_t offset, const int64_t *table,
                         int64_t n, int block_size, int heads, int head_dim, void *out, int out_bf16)
{
    const int64_t row_bytes = head_dim + I8_SCALE_BYTES;
    #pragma omp parallel for schedule(static) if (n * heads >= 1024)
    for (int64_t item = 0; item < n * heads; item++) {
        int64_t t = item / heads, h = item % heads;
        const int8_t *row = pool + table[t / block_size] * block_stride + offset
            + ((t % block_size) * heads + h) * row_bytes;
        float s = row_scale(row, head_dim);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + item * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(s * (float)row[d]);
        } else {
            float *o = (float *)out + item * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] = s * (float)row[d];
        }
    }
    return 0;
}

/*
 * q:            [rows, num_heads, head_dim], bf16 (q_bf16) or float32; out likewise
 * pool:         the int8 pool's base (rows as above)
 * block_tables: [rows, max_blocks] int64; context_lens: [rows] int64, keys [0, len) are attended
 * Returns -1 for shapes past the kernel's limits.
 */
int tessera_paged_attention_i8(
    const void *q, int q_bf16, const int8_t *pool, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out, int rows,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale)
{
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP
        || head_dim > MAX_HEAD_DIM || block_size < 1 || block_size > MAX_BLOCK)
        return -1;
    const int group = num_heads / num_kv_heads;
    /* An item per row where that keeps every thread busy (its heads share each block's reads), else per (row, kv
     * head). */
    int per_row = 1;
#ifdef _OPENMP
    per_row = rows >= 2 * omp_get_max_threads();
#endif
    const int64_t items = per_row ? rows : (int64_t)rows * num_kv_heads;
    #pragma omp parallel
    {
        i8_state *st = i8_thread_state(num_heads, head_dim);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t r = per_row ? item : item / num_kv_heads;
            int kvh0 = per_row ? 0 : (int)(item % num_kv_heads), kvh1 = per_row ? num_kv_heads : kvh0 + 1;
            attend_i8(st, q, q_bf16, pool, block_stride, k_offset, v_offset, block_tables + r * max_blocks,
                      context_lens[r], out, r, kvh0, kvh1, num_heads, num_kv_heads, head_dim, block_size, scale, group);
        }
        i8_thread_state_free(st);
    }
    return 0;
}
