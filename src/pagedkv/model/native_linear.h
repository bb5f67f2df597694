/* The fp32 product of up to 64 rows with four weight rows at a time, shared by pk_linear
 * (native_kernels.c: the rows of an fp32 matrix) and the quantized projections
 * (native_quant_kernels.c: rows dequantized into a thread's scratch buffer first). Both run
 * this one code, so an output element is the same float operations in both: 8 lane partial
 * sums (16 in the AVX-512 form) in k order, then a fixed reduction, whatever the number of
 * rows, the row's place in the batch and the number of threads. A sequence gets bit-identical
 * results alone and in any batch, and a quantized matrix whose values are exactly an fp32
 * matrix's gives exactly its products. */
#ifndef PAGEDKV_NATIVE_LINEAR_H
#define PAGEDKV_NATIVE_LINEAR_H

#include <immintrin.h>
#include <stdint.h>

#include "native_dequant.h"
#include "native_simd.h"

/* The epilogue of one output element: dot (+ bias[n]) (+ residual[r, n]), in that order, as
 * torch computes residual + (x @ W.T + b). */
static inline float finish(float dot, const float *bias, const float *res, int64_t at, int64_t n) {
    if (bias) dot += bias[n];
    if (res) dot = res[at] + dot;
    return dot;
}

/* The next four weight rows' first and third, into L1 ahead of use: 7-10 % faster than the
 * hardware prefetcher alone at one row (4 streams a thread). A prefetch never faults, so the
 * last block may ask past the end of the matrix. */
#define PREFETCH_NEXT_BLOCK(w0, k, i) do { \
        _mm_prefetch((const char *)((w0) + 4 * (k) + (i)), _MM_HINT_T0); \
        _mm_prefetch((const char *)((w0) + 6 * (k) + (i)), _MM_HINT_T0); \
    } while (0)

/* Output column col for rows [0, rows), its weight row at wn [k]: the single-column tail. */
static inline void linear_column(const float *x, const float *wn, const float *bias,
                                 const float *res, float *y, int64_t rows, int64_t k, int64_t n,
                                 int64_t col) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(wn + i), a);
        y[r * n + col] = finish(hsum(a), bias, res, r * n + col, col);
    }
}

/* linear_block4's AVX-512 form, chosen once per process by pk_set_isa (native.py: by the CPU's
 * capability, PAGEDKV_NATIVE_ISA=avx2 forces the other). Four rows share each weight load and
 * four columns each row load (16 accumulators of 16 lanes); an output element is 16 lane
 * partial sums in k order (the last 8 masked when k % 16 == 8), then one fixed reduction:
 * the same operations in the four-row tile and in the one-row tail, so still batch-invariant,
 * but not the AVX2 form's bits (8 lanes): the ISA is part of what a run computes. */
#define PK_ROWS_STEP(R, LOAD)                                                         \
    do {                                                                              \
        __m512 u[4] = {LOAD(w0), LOAD(w1), LOAD(w2), LOAD(w3)};                       \
        for (int ri = 0; ri < (R); ri++) {                                            \
            __m512 xv = LOAD(xr[ri]);                                                 \
            for (int j = 0; j < 4; j++) a[ri][j] = _mm512_fmadd_ps(xv, u[j], a[ri][j]); \
        }                                                                             \
    } while (0)
#define PK_FULL(p) _mm512_loadu_ps((p) + i)
#define PK_TAIL(p) _mm512_maskz_loadu_ps(tail, (p) + i)
#define PK_ROWS_KERNEL(NAME, R)                                                                 \
    PK_AVX512 static void NAME(const float *x, const float *w0, const float *bias,           \
                               const float *res, float *y, int64_t r, int64_t k, int64_t n,  \
                               int64_t c, int prefetch) {                                     \
        const float *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k, *xr[4];                         \
        __m512 a[4][4];                                                                       \
        for (int ri = 0; ri < (R); ri++) {                                                    \
            xr[ri] = x + (r + ri) * k;                                                        \
            for (int j = 0; j < 4; j++) a[ri][j] = _mm512_setzero_ps();                       \
        }                                                                                     \
        int64_t i = 0;                                                                        \
        for (; i + 16 <= k; i += 16) {                                                        \
            if (prefetch) PREFETCH_NEXT_BLOCK(w0, k, i);                                      \
            PK_ROWS_STEP(R, PK_FULL);                                                         \
        }                                                                                     \
        if (i < k) {                                                                          \
            __mmask16 tail = (__mmask16)((1u << (k - i)) - 1u);                               \
            PK_ROWS_STEP(R, PK_TAIL);                                                         \
        }                                                                                     \
        for (int ri = 0; ri < (R); ri++)                                                      \
            for (int j = 0; j < 4; j++) {                                                     \
                int64_t at = (r + ri) * n + c + j;                                            \
                y[at] = finish(_mm512_reduce_add_ps(a[ri][j]), bias, res, at, c + j);         \
            }                                                                                 \
    }
PK_ROWS_KERNEL(linear_rows4_avx512, 4)
PK_ROWS_KERNEL(linear_row1_avx512, 1)

PK_AVX512 static void linear_block4_avx512(const float *x, const float *w0, const float *bias,
                                           const float *res, float *y, int64_t rows, int64_t k,
                                           int64_t n, int64_t c, int prefetch) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) linear_rows4_avx512(x, w0, bias, res, y, r, k, n, c, prefetch);
    for (; r < rows; r++) linear_row1_avx512(x, w0, bias, res, y, r, k, n, c, prefetch);
}

/* Output columns c..c+3 for rows [0, rows): their weight rows are w0 .. w0 + 3k (contiguous).
 * prefetch: whether the next block lies at w0 + 4k (a whole matrix) or not (a scratch block). */
static inline void linear_block4(const float *x, const float *w0, const float *bias,
                                 const float *res, float *y, int64_t rows, int64_t k, int64_t n,
                                 int64_t c, int prefetch) {
    if (pk_avx512) {
        linear_block4_avx512(x, w0, bias, res, y, rows, k, n, c, prefetch);
        return;
    }
    const float *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {  /* two rows share each weight load */
        const float *xa = x + r * k, *xb = xa + k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t i = 0; i < k; i += 8) {
            if (prefetch) PREFETCH_NEXT_BLOCK(w0, k, i);
            __m256 u0 = _mm256_loadu_ps(w0 + i), u1 = _mm256_loadu_ps(w1 + i);
            __m256 u2 = _mm256_loadu_ps(w2 + i), u3 = _mm256_loadu_ps(w3 + i);
            __m256 xv = _mm256_loadu_ps(xa + i), xw = _mm256_loadu_ps(xb + i);
            a0 = _mm256_fmadd_ps(xv, u0, a0); a1 = _mm256_fmadd_ps(xv, u1, a1);
            a2 = _mm256_fmadd_ps(xv, u2, a2); a3 = _mm256_fmadd_ps(xv, u3, a3);
            b0 = _mm256_fmadd_ps(xw, u0, b0); b1 = _mm256_fmadd_ps(xw, u1, b1);
            b2 = _mm256_fmadd_ps(xw, u2, b2); b3 = _mm256_fmadd_ps(xw, u3, b3);
        }
        int64_t at = r * n + c, bt = at + n;
        y[at] = finish(hsum(a0), bias, res, at, c);
        y[at + 1] = finish(hsum(a1), bias, res, at + 1, c + 1);
        y[at + 2] = finish(hsum(a2), bias, res, at + 2, c + 2);
        y[at + 3] = finish(hsum(a3), bias, res, at + 3, c + 3);
        y[bt] = finish(hsum(b0), bias, res, bt, c);
        y[bt + 1] = finish(hsum(b1), bias, res, bt + 1, c + 1);
        y[bt + 2] = finish(hsum(b2), bias, res, bt + 2, c + 2);
        y[bt + 3] = finish(hsum(b3), bias, res, bt + 3, c + 3);
    }
    for (; r < rows; r++) {  /* the odd row: the same operations, one row */
        const float *xa = x + r * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < k; i += 8) {
            if (prefetch) PREFETCH_NEXT_BLOCK(w0, k, i);
            __m256 xv = _mm256_loadu_ps(xa + i);
            a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + i), a0);
            a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + i), a1);
            a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w2 + i), a2);
            a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w3 + i), a3);
        }
        int64_t at = r * n + c;
        y[at] = finish(hsum(a0), bias, res, at, c);
        y[at + 1] = finish(hsum(a1), bias, res, at + 1, c + 1);
        y[at + 2] = finish(hsum(a2), bias, res, at + 2, c + 2);
        y[at + 3] = finish(hsum(a3), bias, res, at + 3, c + 3);
    }
}

/* The projections of both files, by weight format (pk_decode_layer runs any of them). */
void pk_linear(const float *x, const float *w, const float *bias, const float *res, float *y,
               int64_t rows, int64_t k, int64_t n, int threads);
int pk_linear_q4_1(const float *x, const uint8_t *wq, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads);
int pk_linear_q8_0(const float *x, const uint8_t *wq, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads);

/* y = x @ W.T (+ bias) (+ residual) for W in format fmt; 0, or -1 (no scratch memory). */
static inline int pk_project(int fmt, const float *x, const void *w, const float *bias,
                             const float *res, float *y, int64_t rows, int64_t k, int64_t n,
                             int threads) {
    if (fmt == PK_Q4_1) return pk_linear_q4_1(x, w, bias, res, y, rows, k, n, threads);
    if (fmt == PK_Q8_0) return pk_linear_q8_0(x, w, bias, res, y, rows, k, n, threads);
    pk_linear(x, w, bias, res, y, rows, k, n, threads);
    return 0;
}

#endif
