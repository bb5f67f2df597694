/* Projections whose weights stay in GGUF's own blocks (AVX2 + FMA + F16C, OpenMP), built into
 * the same library as native_kernels.c by native.py.
 *
 * Q4_1: 32 weights in 20 bytes: d, m (fp16), then 16 bytes whose low nibble is weight j and
 * high nibble weight j + 16; w = d * q + m. Q8_0: 32 weights in 34 bytes: d (fp16), 32 int8;
 * w = d * q. Rows of n blocks are contiguous: weight [n, k] is n * k / 32 blocks.
 *
 * Each thread dequantizes four weight rows into its own scratch (L1-sized: 4 * k floats), then
 * runs linear_block4, the code pk_linear runs on fp32 rows. d * q is exact in fp32 (an 11-bit
 * times a 4- or 8-bit integer), so the dequantized value is the one fp32 rounding of d * q + m
 * that gguf's and torch's decoders also make: on a model whose fp32 weights were decoded from
 * these blocks, the products are bit-identical to the fp32 kernel's, and every output element
 * is the same operations whatever the batch, as there. The bytes read per weight are 0.625
 * (Q4_1) and 1.06 (Q8_0) instead of 4.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_linear.h"

#define Q4_1_BYTES 20
#define Q8_0_BYTES 34

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256 q8_to_ps(__m128i bytes_lo8, int is_signed) {
    __m256i q = is_signed ? _mm256_cvtepi8_epi32(bytes_lo8) : _mm256_cvtepu8_epi32(bytes_lo8);
    return _mm256_cvtepi32_ps(q);
}

/* k weights (k % 32 == 0) of one Q4_1 row into dst. */
static void dequant_q4_1_row(const uint8_t *src, float *dst, int64_t k) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < k / 32; b++, src += Q4_1_BYTES, dst += 32) {
        __m256 d = _mm256_set1_ps(half_at(src)), m = _mm256_set1_ps(half_at(src + 2));
        __m128i q = _mm_loadu_si128((const __m128i *)(src + 4));
        __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
        _mm256_storeu_ps(dst, _mm256_fmadd_ps(q8_to_ps(lo, 0), d, m));
        _mm256_storeu_ps(dst + 8, _mm256_fmadd_ps(q8_to_ps(_mm_srli_si128(lo, 8), 0), d, m));
        _mm256_storeu_ps(dst + 16, _mm256_fmadd_ps(q8_to_ps(hi, 0), d, m));
        _mm256_storeu_ps(dst + 24, _mm256_fmadd_ps(q8_to_ps(_mm_srli_si128(hi, 8), 0), d, m));
    }
}

/* k weights (k % 32 == 0) of one Q8_0 row into dst. */
static void dequant_q8_0_row(const uint8_t *src, float *dst, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++, src += Q8_0_BYTES, dst += 32) {
        __m256 d = _mm256_set1_ps(half_at(src));
        for (int s = 0; s < 4; s++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(src + 2 + 8 * s));
            _mm256_storeu_ps(dst + 8 * s, _mm256_mul_ps(q8_to_ps(q, 1), d));
        }
    }
}

typedef void (*dequant_row_fn)(const uint8_t *, float *, int64_t);

/* y = x @ W.T (+ bias) (+ residual), W [n, k] in blocks of row_bytes per row; as pk_linear.
 * Returns 0, or -1 when a thread's scratch could not be allocated (nothing was written). */
static int quant_linear(dequant_row_fn dequant, int64_t row_bytes, const float *x,
                        const uint8_t *wq, const float *bias, const float *res, float *y,
                        int64_t rows, int64_t k, int64_t n, int threads) {
    int64_t blocks = n / 4;
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
    return quant_linear(dequant_q4_1_row, k / 32 * Q4_1_BYTES, x, wq, bias, res, y, rows, k, n,
                        threads);
}

int pk_linear_q8_0(const float *x, const uint8_t *wq, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads) {
    return quant_linear(dequant_q8_0_row, k / 32 * Q8_0_BYTES, x, wq, bias, res, y, rows, k, n,
                        threads);
}

/* The whole matrix, dequantized into dst [n, k] fp32 (prompts: then one GEMM). kind 4: Q4_1,
 * 8: Q8_0. */
void pk_dequantize(int kind, const uint8_t *wq, float *dst, int64_t n, int64_t k, int threads) {
    dequant_row_fn dequant = kind == 4 ? dequant_q4_1_row : dequant_q8_0_row;
    int64_t row_bytes = k / 32 * (kind == 4 ? Q4_1_BYTES : Q8_0_BYTES);
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t r = 0; r < n; r++) dequant(wq + r * row_bytes, dst + r * k, k);
}
