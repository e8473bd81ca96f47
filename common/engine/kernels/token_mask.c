/*
 * Structured output's token mask, applied to float32 logits in place (common/engine/structured_output.py).
 *
 * The grammar engine fills one bitmask row per constrained logits row: bit j of 32-bit word w allows token
 * 32 * w + j. Every disallowed token's logit becomes -inf, and so do the logits past the mask's last word
 * (a model's padded vocabulary). Most words are all ones or all zeros, so each takes one test and, with
 * AVX-512, two masked stores of 16 lanes; torch's path unpacks every bit into a [rows, vocab] tensor first.
 * Rows are split over torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* logits: [*, logits_stride] float32; mask: [n_rows, mask_words] int32; rows[i]: the logits row of mask row i. */
int tessera_apply_token_mask(float *logits, const int32_t *mask, const int64_t *rows, int n_rows, int vocab,
                             int mask_words, int64_t logits_stride)
{
    if (n_rows < 0 || vocab < 0 || mask_words < 0 || logits_stride < vocab)
        return -1;
    const float ninf = -INFINITY;
#pragma omp parallel for schedule(static) if (n_rows > 1)
    for (int i = 0; i < n_rows; i++) {
        float *row = logits + rows[i] * logits_stride;
        const uint32_t *bits = (const uint32_t *)(mask + (int64_t)i * mask_words);
        int covered = mask_words * 32 < vocab ? mask_words * 32 : vocab;
        int w = 0;
#if defined(__AVX512F__)
        const __m512 minus_inf = _mm512_set1_ps(ninf);
        for (; (w + 1) * 32 <= covered; w++) {
            uint32_t word = bits[w];
            if (word == 0xFFFFFFFFu)
                continue;
            float *at = row + w * 32;
            _mm512_mask_storeu_ps(at, (__mmask16)~word, minus_inf);
            _mm512_mask_storeu_ps(at + 16, (__mmask16)~(word >> 16), minus_inf);
        }
#endif
        for (int t = w * 32; t < covered; t++)
            if (!((bits[t >> 5] >> (t & 31)) & 1u))
                row[t] = ninf;
        for (int t = covered; t < vocab; t++)
            row[t] = ninf;
    }
    return 0;
}
