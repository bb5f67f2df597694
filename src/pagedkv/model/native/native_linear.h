/* What every projection kernel shares: the epilogue of an output element, and the entry
 * points by weight format. pk_linear and pk_linear_q* (native_chain.c, up to 8 rows;
 * from 9 rows, pk_gemm_source) and pk_gemm / pk_gemm_blocks (native_gemm.c) all compute an
 * element as one chain of fused multiply-adds in k order, then + bias, then residual +: a
 * sequence gets bit-identical results alone and in any batch, on either ISA, and a quantized
 * matrix whose values are exactly an fp32 matrix's gives exactly its products. */
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

/* The projections by weight format (pk_decode_layer runs any of them); 0, or -1 when a
 * thread's buffer could not be allocated. */
int pk_gemm_source(const weight_source *src, const float *x, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads);
int pk_linear(const float *x, const float *w, const float *bias, const float *res, float *y,
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
    return pk_linear(x, w, bias, res, y, rows, k, n, threads);
}

#endif
