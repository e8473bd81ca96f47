/*
 * The greedy LM head's bound (common/engine/greedy_head.py, whose docstring derives it): from each token's
 * approximate logit (the int8 copy's) and its error bound, the 64-token tiles holding a token that the bound cannot
 * rule out as a row's argmax. Two vectorized passes over the vocabulary per row, in place of a dozen torch operations
 * over [rows, vocabulary] temporaries: at 135M parameters those cost as much as the bytes the int8 copy saves.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* The highest lower bound and the highest upper bound of tokens [0, n) of a row; returns whether every bound was
 * finite (a NaN or an infinity anywhere makes the whole head the only sound way). */
static int bounds(const float *restrict a, const float *restrict weight_error, const float *restrict step_error,
                  int n, float norm, float step, float rounding, float flushed, float *lower, float *upper)
{
    float low_max = -INFINITY, high_max = -INFINITY;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        const float margin = weight_error[i] * norm + step_error[i] * step + rounding * fabsf(a[i]) + flushed;
        const float low = a[i] - margin, high = a[i] + margin;
        finite &= fabsf(low) <= FLT_MAX && fabsf(high) <= FLT_MAX; /* false for NaN too */
        low_max = low > low_max ? low : low_max;
        high_max = high > high_max ? high : high_max;
    }
    *lower = low_max;
    *upper = high_max;
    return finite;
}

/* approx: [m, n] float32; weight_error, step_error: [n]; norm, step: [m] (a row's |x| and int16 step, each
 * already taken wider); a token's margin is weight_error * norm + step_error * step + rounding * |approx| + flushed.
 * A row's candidates are the tokens whose upper bound reaches the highest lower bound less tie_steps of the
 * logits' size. tiles: room for n / tile ids; gets the union over the rows, ascending. Returns their count, -1 for
 * shapes it does not take (n not a multiple of tile) or without memory, or -2 where a bound is not finite. */
int tessera_greedy_tiles(const float *approx, const float *weight_error, const float *step_error,
                         const float *norm, const float *step, int64_t m, int64_t n, int64_t tile,
                         float rounding, float flushed, float tie_steps, int32_t *tiles)
{
    if (m < 1 || tile < 1 || n < tile || n % tile != 0 || n > INT32_MAX) return -1;
    const int count = (int)(n / tile);
    unsigned char *marked = (unsigned char *)calloc((size_t)count, 1);
    if (marked == NULL) return -1;
    for (int64_t r = 0; r < m; r++) {
        const float *a = approx + r * n;
        float lower, upper;
        if (!bounds(a, weight_error, step_error, (int)n, norm[r], step[r], rounding, flushed, &lower, &upper)) {
            free(marked);
            return -2;
        }
        const float size = fabsf(lower) > fabsf(upper) ? fabsf(lower) : fabsf(upper);
        const float threshold = lower - tie_steps * size;
        for (int t = 0; t < count; t++) {
            float low, high;
            bounds(a + (int64_t)t * tile, weight_error + (int64_t)t * tile, step_error + (int64_t)t * tile, (int)tile,
                   norm[r], step[r], rounding, flushed, &low, &high);
            marked[t] |= !(high < threshold);
        }
    }
    int found = 0;
    for (int t = 0; t < count; t++)
        if (marked[t]) tiles[found++] = (int32_t)t;
    free(marked);
    return found;
}
