/* pk_gemm's microkernels (native_gemm.c): x transposed 16 rows at a time, and the tiles that
 * sweep weight rows over those groups, each output element one fused multiply-add chain in k
 * order, then + bias, then residual + (the contract native_gemm.c states). */
#ifndef PAGEDKV_NATIVE_GEMM_TILES_H
#define PAGEDKV_NATIVE_GEMM_TILES_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "native_linear.h"

#define GROUP_ROWS 16 /* rows of x transposed together */
#define PANEL_GROUPS 3 /* groups transposed at a time: one AVX-512 tile's rows */
#define TILE_COLS 6    /* weight rows swept over a group at a time in the AVX2 form */
#define TILE512_COLS 8 /* ... and over a panel in the AVX-512 form */

/* The 8 x 8 block r (8 rows of 8 floats) transposed in place: r[j] becomes column j. */
static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* dst [k][16] = rows [row0, row0 + 16) of x [rows, k], transposed; rows past the end are 0
 * (their products are computed and never stored). k % 8 == 0. */
static void pack_group(const float *x, float *dst, int64_t row0, int64_t rows, int64_t k) {
    for (int half = 0; half < 2; half++) {
        int64_t first = row0 + 8 * half;
        for (int64_t i = 0; i < k; i += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = first + j < rows ? _mm256_loadu_ps(x + (first + j) * k + i)
                                        : _mm256_setzero_ps();
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + (i + j) * GROUP_ROWS + 8 * half, r[j]);
        }
    }
}

/* The epilogue of 16 lanes of column c: rows row0 .. row0 + 15 that exist. */
static inline void store_lanes(const float *lanes, const float *bias, const float *res, float *y,
                               int64_t row0, int64_t rows, int64_t n, int64_t c) {
    for (int l = 0; l < GROUP_ROWS && row0 + l < rows; l++) {
        int64_t at = (row0 + l) * n + c;
        y[at] = finish(lanes[l], bias, res, at, c);
    }
}

/* The epilogue of a group's eight accumulators a[j] (column c + j, lane l: row row0 + l): two
 * 8 x 8 transposes give each row's eight columns in one vector, then + bias, then residual +,
 * stored; rows past the end are skipped. The same two roundings as store_lanes, so the same
 * bits; done lane by lane it took 10-20 % of the time, and a scatter (slow on Zen 4) 2x. */
PK_AVX512 static inline void store512(const __m512 *a, const float *bias, const float *res,
                                      float *y, int64_t row0, int64_t rows, int64_t n, int64_t c) {
    __m256 half[2][8];
    for (int j = 0; j < 8; j++) {
        half[0][j] = _mm512_castps512_ps256(a[j]);
        half[1][j] = _mm512_extractf32x8_ps(a[j], 1);
    }
    for (int h = 0; h < 2; h++) {
        transpose8(half[h]);
        for (int l = 0; l < 8; l++) {
            int64_t row = row0 + 8 * h + l;
            if (row >= rows) return;
            __m256 v = half[h][l];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
            if (res) v = _mm256_add_ps(_mm256_loadu_ps(res + row * n + c), v);
            _mm256_storeu_ps(y + row * n + c, v);
        }
    }
}

/* AVX-512: G groups (one zmm of 16 rows each) x 8 weight rows w[0..7] (stride k). */
#define PK_GEMM_TILE512(G)                                                                     \
    PK_AVX512 static void tile512_##G(const float *xp, const float *w, const float *bias,      \
                                      const float *res, float *y, int64_t row0, int64_t rows,  \
                                      int64_t k, int64_t n, int64_t c) {                      \
        __m512 a[G][8];                                                                        \
        for (int g = 0; g < (G); g++)                                                          \
            for (int j = 0; j < 8; j++) a[g][j] = _mm512_setzero_ps();                         \
        for (int64_t i = 0; i < k; i++) {                                                      \
            __m512 xv[G];                                                                      \
            for (int g = 0; g < (G); g++)                                                      \
                xv[g] = _mm512_loadu_ps(xp + (g * k + i) * GROUP_ROWS);                        \
            for (int j = 0; j < 8; j++) {                                                      \
                __m512 b = _mm512_set1_ps(w[j * k + i]);                                       \
                for (int g = 0; g < (G); g++) a[g][j] = _mm512_fmadd_ps(xv[g], b, a[g][j]);   \
            }                                                                                  \
        }                                                                                      \
        for (int g = 0; g < (G); g++) store512(a[g], bias, res, y, row0 + g * GROUP_ROWS, rows, n, c); \
    }
PK_GEMM_TILE512(1)
PK_GEMM_TILE512(2)
PK_GEMM_TILE512(3)

/* AVX2: one group (two ymm of 8 rows) x 6 weight rows: 12 accumulators of the 16 registers,
 * named one by one (as an array, gcc kept them on the stack: 2.5x slower). */
#define PK_STEP256(j, lo, hi)                                  \
    do {                                                       \
        __m256 b = _mm256_broadcast_ss(w + (j) * k + i);       \
        lo = _mm256_fmadd_ps(x0, b, lo);                       \
        hi = _mm256_fmadd_ps(x1, b, hi);                       \
    } while (0)
static void tile256(const float *xp, const float *w, const float *bias, const float *res,
                    float *y, int64_t row0, int64_t rows, int64_t k, int64_t n, int64_t c) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    for (int64_t i = 0; i < k; i++) {
        __m256 x0 = _mm256_loadu_ps(xp + i * GROUP_ROWS), x1 = _mm256_loadu_ps(xp + i * GROUP_ROWS + 8);
        PK_STEP256(0, a0, b0); PK_STEP256(1, a1, b1); PK_STEP256(2, a2, b2);
        PK_STEP256(3, a3, b3); PK_STEP256(4, a4, b4); PK_STEP256(5, a5, b5);
    }
    __m256 lo[TILE_COLS] = {a0, a1, a2, a3, a4, a5}, hi[TILE_COLS] = {b0, b1, b2, b3, b4, b5};
    float lanes[GROUP_ROWS];
    for (int j = 0; j < TILE_COLS; j++) {
        _mm256_storeu_ps(lanes, lo[j]);
        _mm256_storeu_ps(lanes + 8, hi[j]);
        store_lanes(lanes, bias, res, y, row0, rows, n, c + j);
    }
}

/* A column that does not fill a tile: the same chain per element, in scalar fmaf. */
static void column_scalar(const float *xp, const float *wc, const float *bias, const float *res,
                          float *y, int64_t row0, int64_t rows, int64_t k, int64_t n, int64_t c) {
    float lanes[GROUP_ROWS];
    for (int l = 0; l < GROUP_ROWS; l++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < k; i++) acc = fmaf(xp[i * GROUP_ROWS + l], wc[i], acc);
        lanes[l] = acc;
    }
    store_lanes(lanes, bias, res, y, row0, rows, n, c);
}

#endif
