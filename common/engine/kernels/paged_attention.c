/*
 * Paged attention for single query rows (decode) on the CPU.
 *
 * Reads K/V straight from the block-major pool through each row's block
 * table, so no gathered copy of the context is ever made. One work item is
 * (row, kv head): the G query heads of a group share every K/V read. Scores
 * are computed a block at a time and folded into a running softmax
 * (max, sum, accumulator), so memory use does not grow with context length.
 * Accumulation is always float32; bf16 inputs are widened on load.
 */
#include <stdint.h>

#include "attend.h"

/* The common head sizes get their own copies so the compiler can unroll and
 * keep vectors in registers; anything else takes the generic path. */
#define ATTEND(D, BF16) attend_one(q, BF16, kv, block_stride, k_offset, v_offset, block_tables, max_blocks, \
    context_lens, out, BF16, num_heads, num_kv_heads, D, block_size, scale, BF16, group, item)

int tessera_paged_attention(
    const void *q, const void *kv, int64_t block_stride, int64_t k_offset, int64_t v_offset,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out,
    int rows, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16)
{
    int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||
        num_heads % num_kv_heads != 0)
        return -1;

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
