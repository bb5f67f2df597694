/* The projections of up to 8 rows (decode steps of a few sequences), on the GEMM's
 * contract: every output element ONE chain of fused multiply-adds in k order from 0, then +
 * bias, then residual + (native_gemm.c). So a row gets the same bits at any row count, on
 * either side of this file's limit, in a mixed step as in a decode step, and on AVX2 and
 * AVX-512 alike; and weights in GGUF blocks give exactly their fp32 matrix's products.
 *
 * Why not the GEMM's form here: it puts 16 rows of x in a vector, so one row would waste 15
 * lanes. This form puts 16 output columns in a vector (8 in AVX2): sixteen weight rows are
 * loaded 16 values of k at a time and transposed in registers, so that a vector holds the 16
 * columns' weights at one k; each row of x is broadcast against it, one accumulator a row.
 * The weights are read once (121 matrices of the embedded model's shapes at one row on a Zen 4:
 * 0.92-0.99x the speed of the lane-partial-sum kernel it replaced, for the GEMM's bits;
 * docs/latency.md, tenth round). Columns split across
 * threads in groups of 16; weights in blocks are decoded a group at a time into the thread's
 * scratch. Columns past the last group run the same chain in scalar fmaf.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_gemm_tiles.h"

#define CHAIN_MAX_ROWS 8 /* from 9 rows, a GEMM group of 16 (half full or more) is faster */
#define COLS512 16
#define COLS256 8

static __thread kept_buffer chain_scratch;

/* r[j] = 16 floats of weight row j (at one span of k): afterwards r[i] is the 16 rows' values
 * at k offset i. */
PK_AVX512 static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* R rows of x (from row r0) x 16 columns (c .. c + 15, weight rows wc, stride k). k % 16 == 8
 * ends with 8 values of k loaded into the low halves (the high ones zero and never used).
 * Sixteen rows read at once are more streams than the hardware prefetcher follows well: each
 * is asked four lines ahead (a prefetch never faults past the end). */
#define PK_CHAIN512(R)                                                                          \
    PK_AVX512 static void chain512_##R(const float *x, const float *wc, const float *bias,     \
                                       const float *res, float *y, int64_t r0, int64_t k,      \
                                       int64_t n, int64_t c) {                                 \
        __m512 acc[R];                                                                          \
        for (int r = 0; r < (R); r++) acc[r] = _mm512_setzero_ps();                             \
        for (int64_t i = 0; i < k; i += 16) {                                                   \
            int width = k - i < 16 ? (int)(k - i) : 16;                                         \
            __m512 t[16];                                                                       \
            for (int j = 0; j < 16; j++) {                                                      \
                _mm_prefetch((const char *)(wc + j * k + i + 64), _MM_HINT_T0);                 \
                t[j] = _mm512_maskz_loadu_ps((__mmask16)((1u << width) - 1), wc + j * k + i);   \
            }                                                                                   \
            transpose16(t);                                                                     \
            for (int q = 0; q < width; q++)                                                     \
                for (int r = 0; r < (R); r++)                                                   \
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(r0 + r) * k + i + q]), t[q], acc[r]); \
        }                                                                                       \
        for (int r = 0; r < (R); r++) {                                                         \
            int64_t at = (r0 + r) * n + c;                                                      \
            __m512 v = acc[r];                                                                  \
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));                          \
            if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + at), v);                           \
            _mm512_storeu_ps(y + at, v);                                                        \
        }                                                                                       \
    }
PK_CHAIN512(1)
PK_CHAIN512(2)
PK_CHAIN512(4)
PK_CHAIN512(8)

/* The AVX2 form: R rows x 8 columns, weight rows transposed 8 x 8 (k % 8 == 0). */
#define PK_CHAIN256(R)                                                                          \
    static void chain256_##R(const float *x, const float *wc, const float *bias,               \
                             const float *res, float *y, int64_t r0, int64_t k, int64_t n,     \
                             int64_t c) {                                                      \
        __m256 acc[R];                                                                          \
        for (int r = 0; r < (R); r++) acc[r] = _mm256_setzero_ps();                             \
        for (int64_t i = 0; i < k; i += 8) {                                                    \
            __m256 t[8];                                                                        \
            for (int j = 0; j < 8; j++) t[j] = _mm256_loadu_ps(wc + j * k + i);                 \
            transpose8(t);                                                                      \
            for (int q = 0; q < 8; q++)                                                         \
                for (int r = 0; r < (R); r++)                                                   \
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[(r0 + r) * k + i + q]), t[q], acc[r]); \
        }                                                                                       \
        for (int r = 0; r < (R); r++) {                                                         \
            int64_t at = (r0 + r) * n + c;                                                      \
            __m256 v = acc[r];                                                                  \
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));                          \
            if (res) v = _mm256_add_ps(_mm256_loadu_ps(res + at), v);                           \
            _mm256_storeu_ps(y + at, v);                                                        \
        }                                                                                       \
    }
PK_CHAIN256(1)
PK_CHAIN256(2)
PK_CHAIN256(4)

/* Every row of x against the group of columns c .. c + width - 1 (weight rows wc). */
static void chain_group(const float *x, const float *wc, const float *bias, const float *res,
                        float *y, int64_t rows, int64_t k, int64_t n, int64_t c) {
    for (int64_t r0 = 0; r0 < rows;) {
        int64_t left = rows - r0, step = left >= 8 && pk_avx512 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (pk_avx512) {
            if (step == 8) chain512_8(x, wc, bias, res, y, r0, k, n, c);
            else if (step == 4) chain512_4(x, wc, bias, res, y, r0, k, n, c);
            else if (step == 2) chain512_2(x, wc, bias, res, y, r0, k, n, c);
            else chain512_1(x, wc, bias, res, y, r0, k, n, c);
        } else {
            if (step == 4) chain256_4(x, wc, bias, res, y, r0, k, n, c);
            else if (step == 2) chain256_2(x, wc, bias, res, y, r0, k, n, c);
            else chain256_1(x, wc, bias, res, y, r0, k, n, c);
        }
        r0 += step;
    }
}

/* A column past the last group: the same chain, scalar. */
static void chain_column(const float *x, const float *wc, const float *bias, const float *res,
                         float *y, int64_t rows, int64_t k, int64_t n, int64_t c) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < k; i++) acc = fmaf(x[r * k + i], wc[i], acc);
        y[r * n + c] = finish(acc, bias, res, r * n + c, c);
    }
}

/* y = x @ W.T (+ bias) (+ residual) for W from src; rows >= 16 go to pk_gemm_source. Returns
 * 0, or -1 when a thread's scratch could not be allocated (y then incomplete). */
static int chain_product(const weight_source *src, const float *x, const float *bias,
                         const float *res, float *y, int64_t rows, int64_t k, int64_t n,
                         int threads) {
    if (rows > CHAIN_MAX_ROWS) return pk_gemm_source(src, x, bias, res, y, rows, k, n, threads);
    int64_t width = pk_avx512 ? COLS512 : COLS256, groups = n / width;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t first = groups * t / team, last = groups * (t + 1) / team;
        int tail = t == team - 1 && groups * width < n;
        float *scratch = src->w || (first == last && !tail) ? NULL : kept(&chain_scratch, width * k);
        if (!src->w && (first < last || tail) && !scratch) {
            #pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t g = first; g < last; g++)
                chain_group(x, weight_rows(src, scratch, g * width, width, k), bias, res, y,
                            rows, k, n, g * width);
            for (int64_t c = groups * width; tail && c < n; c++)
                chain_column(x, weight_rows(src, scratch, c, 1, k), bias, res, y, rows, k, n, c);
        }
    }
    return failed ? -1 : 0;
}

int pk_linear(const float *x, const float *w, const float *bias, const float *res, float *y,
              int64_t rows, int64_t k, int64_t n, int threads) {
    weight_source src = {.w = w};
    return chain_product(&src, x, bias, res, y, rows, k, n, threads);
}

static int chain_blocks(int kind, const float *x, const uint8_t *wq, const float *bias,
                        const float *res, float *y, int64_t rows, int64_t k, int64_t n,
                        int threads) {
    weight_source src = {.wq = wq};
    src.dequant = dequant_for(kind, k, &src.row_bytes);
    return chain_product(&src, x, bias, res, y, rows, k, n, threads);
}

int pk_linear_q4_1(const float *x, const uint8_t *wq, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads) {
    return chain_blocks(PK_Q4_1, x, wq, bias, res, y, rows, k, n, threads);
}

int pk_linear_q8_0(const float *x, const uint8_t *wq, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads) {
    return chain_blocks(PK_Q8_0, x, wq, bias, res, y, rows, k, n, threads);
}
