/*
 * y = x @ w^T (+ bias) in bfloat16 for a few rows of x (decode steps), on the CPU.
 *
 * At M <= 8 rows a linear layer is bound by reading its weights once from
 * memory, and torch's bf16 matmul reaches a fraction of the bandwidth there.
 * Here each thread streams a contiguous range of weight rows once: a row is
 * widened to float32 into a buffer that stays in L1, then every x row takes
 * its dot product with it. Accumulation is float32, the result is rounded to
 * bfloat16 (nearest even), as torch's bf16 linear does; only the order of the
 * float32 sums differs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_ROWS 8
#define MAX_K 16384

/* x: [m, k] bf16, w: [n, k] bf16 (row-major, as nn.Linear keeps it), bias: [n] bf16 or NULL,
 * y: [m, n] bf16. Returns -1 (and writes nothing) for shapes it does not take. */
int tessera_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int m, int n, int k)
{
    if (m < 1 || m > MAX_ROWS || k < 1 || k > MAX_K) return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)m * (size_t)k);
    if (xf == NULL) return -1;
    for (int64_t i = 0; i < (int64_t)m * k; i++) xf[i] = bf16_to_f32(x[i]);

    #pragma omp parallel
    {
        float wf[MAX_K];
        #pragma omp for schedule(static)
        for (int j = 0; j < n; j++) {
            const uint16_t *wr = w + (int64_t)j * k;
            for (int i = 0; i < k; i++) wf[i] = bf16_to_f32(wr[i]);
            float b = bias != NULL ? bf16_to_f32(bias[j]) : 0.f;
            for (int r = 0; r < m; r++) {
                const float *xr = xf + (int64_t)r * k;
                float s = 0.f;
                for (int i = 0; i < k; i++) s += xr[i] * wf[i];
                y[(int64_t)r * n + j] = f32_to_bf16(s + b);
            }
        }
    }
    free(xf);
    return 0;
}
