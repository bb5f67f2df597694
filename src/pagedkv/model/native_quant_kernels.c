/* Projections whose weights stay in GGUF's own blocks (AVX2 + FMA + F16C, OpenMP), built into
 * the same library as native_kernels.c by native.py; the formats and their decoding are in
 * native_dequant.h.
 *
 * Each thread dequantizes four weight rows into its own scratch (L1-sized: 4 * k floats), then
 * runs linear_block4, the code pk_linear runs on fp32 rows: on a model whose fp32 weights were
 * decoded from these blocks, the products are bit-identical to the fp32 kernel's, and every
 * output element is the same operations whatever the batch, as there. The bytes read per
 * weight are 0.625 (Q4_1) and 1.06 (Q8_0) instead of 4.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_linear.h" /* and native_dequant.h */

/* y = x @ W.T (+ bias) (+ residual), W [n, k] in blocks of format kind; as pk_linear.
 * Returns 0, or -1 when a thread's scratch could not be allocated (nothing was written). */
static int quant_linear(int kind, const float *x, const uint8_t *wq, const float *bias,
                        const float *res, float *y, int64_t rows, int64_t k, int64_t n,
                        int threads) {
    int64_t blocks = n / 4, row_bytes;
    dequant_row_fn dequant = dequant_for(kind, k, &row_bytes);
    int failed = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        float *scratch = aligned_alloc(32, (size_t)(4 * k) * sizeof(float));
        #pragma omp atomic
        failed += scratch == NULL;
        #pragma omp barrier
        if (!failed) {
            #pragma omp for schedule(static)
            for (int64_t g = 0; g < blocks; g++) {
                for (int64_t j = 0; j < 4; j++)
                    dequant(wq + (g * 4 + j) * row_bytes, scratch + j * k, k);
                linear_block4(x, scratch, bias, res, y, rows, k, n, g * 4, 0);
            }
            #pragma omp single
            for (int64_t c = blocks * 4; c < n; c++) {  /* the tail: one column at a time */
                dequant(wq + c * row_bytes, scratch, k);
                linear_column(x, scratch, bias, res, y, rows, k, n, c);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

int pk_linear_q4_1(const float *x, const uint8_t *wq, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads) {
    return quant_linear(PK_Q4_1, x, wq, bias, res, y, rows, k, n, threads);
}

int pk_linear_q8_0(const float *x, const uint8_t *wq, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads) {
    return quant_linear(PK_Q8_0, x, wq, bias, res, y, rows, k, n, threads);
}

/* The whole matrix, dequantized into dst [n, k] fp32 (the tied embedding's rows, MKL's
 * prompts). kind: PK_Q4_1 or PK_Q8_0 (another: nothing is written). */
void pk_dequantize(int kind, const uint8_t *wq, float *dst, int64_t n, int64_t k, int threads) {
    int64_t row_bytes;
    dequant_row_fn dequant = dequant_for(kind, k, &row_bytes);
    if (!dequant) return;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t r = 0; r < n; r++) dequant(wq + r * row_bytes, dst + r * k, k);
}
