/* A GGUF-block matrix decoded whole (the formats and decoders: native_dequant.h), where a path
 * reads the fp32 matrix itself: the tied embedding's rows, MKL's prompts when pagedkv's GEMM
 * is switched off. The projections read the blocks in place (native_chain.c, native_gemm.c).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_linear.h" /* and native_dequant.h */

/* The whole matrix, dequantized into dst [n, k] fp32 (the tied embedding's rows, MKL's
 * prompts). kind: PK_Q4_1 or PK_Q8_0 (another: nothing is written). */
void pk_dequantize(int kind, const uint8_t *wq, float *dst, int64_t n, int64_t k, int threads) {
    int64_t row_bytes;
    dequant_row_fn dequant = dequant_for(kind, k, &row_bytes);
    if (!dequant) return;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t r = 0; r < n; r++) dequant(wq + r * row_bytes, dst + r * k, k);
}
