/* The AVX-512 forms of native_attention.c's two products, when pk_avx512 is set and
 * D % 16 == 0: P V (dims in lanes) for every work item, the scores (rows in lanes) for items of
 * more than 8 rows (prompt chunks; a decode item's 3 rows would fill 3 of 16 lanes). Included
 * once, by native_attention.c. Same arithmetic as the AVX2 forms, 16 lanes instead of 8: a
 * row's score is one FMA chain in d order (lane = row), an output element one chain in key
 * order after the alpha product (lane = dim). So the bits are the AVX2 forms' (tested), and a
 * decode token still equals the last row of its prompt. On a CPU with 512-bit FMA units
 * (Zen 5) this doubles the work per instruction. */
#ifndef PAGEDKV_NATIVE_ATTENTION512_H
#define PAGEDKV_NATIVE_ATTENTION512_H

#define INLINE512 static inline __attribute__((always_inline)) PK_AVX512

INLINE512 __m512 load16(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* st[t * w + r] = q_r . k_t for NK keys and NV vectors of 16 rows of qt [d][w]. */
INLINE512 void scores512_tile(const float *qt, int64_t w, const void *k, const int64_t *at,
                              int64_t d, float *st, const int NV, const int NK, int bf16) {
    __m512 acc[8][3];
    for (int t = 0; t < NK; t++)
        for (int v = 0; v < NV; v++) acc[t][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        __m512 kc[8];
        for (int t = 0; t < NK; t++) kc[t] = _mm512_set1_ps(scalar(k, at[t] + c, bf16));
        for (int v = 0; v < NV; v++) {
            __m512 qv = _mm512_loadu_ps(qt + c * w + v * 16);
            for (int t = 0; t < NK; t++) acc[t][v] = _mm512_fmadd_ps(qv, kc[t], acc[t][v]);
        }
    }
    for (int t = 0; t < NK; t++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(st + t * w + v * 16, acc[t][v]);
}

/* 8 keys x 1-3 vectors of rows: 8-24 accumulators of the 32 registers. */
#define SCORES512(NV, B)                                                                     \
    static __attribute__((noinline)) PK_AVX512 void scores512_##NV##_##B(                   \
        const float *qt, int64_t w, const void *k, const int64_t *at, int64_t n, int64_t d, \
        float *st, const Ahead *pf) {                                                        \
        int64_t t = 0;                                                                       \
        for (; t + 8 <= n; t += 8) {                                                         \
            prefetch_keys(pf, t, 8);                                                         \
            scores512_tile(qt, w, k, at + t, d, st + t * w, NV, 8, B);                       \
        }                                                                                    \
        for (; t < n; t++) {                                                                 \
            prefetch_keys(pf, t, 1);                                                         \
            scores512_tile(qt, w, k, at + t, d, st + t * w, NV, 1, B);                       \
        }                                                                                    \
    }
SCORES512(1, 0) SCORES512(2, 0) SCORES512(3, 0)
SCORES512(1, 1) SCORES512(2, 1) SCORES512(3, 1)
#undef SCORES512
static const ScoresFn SCORES512_FNS[2][3] = {
    {scores512_1_0, scores512_2_0, scores512_3_0},
    {scores512_1_1, scores512_2_1, scores512_3_1},
};

/* o[r][c..c + 16 NV) = o * alpha[r] + sum_t p[t][r] v_t, NR rows from r, in key order. */
INLINE512 void pv512_tile(float *o, int64_t d, const float *alpha, const float *st, int64_t w,
                          const void *v, const int64_t *at, int64_t n, int64_t r, int64_t c,
                          const int NR, const int NV, int bf16) {
    __m512 acc[4][4];
    for (int i = 0; i < NR; i++) {
        __m512 a = _mm512_set1_ps(alpha[r + i]);
        for (int j = 0; j < NV; j++)
            acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(o + (r + i) * d + c + j * 16), a);
    }
    for (int64_t t = 0; t < n; t++) {
        __m512 p[4];
        for (int i = 0; i < NR; i++) p[i] = _mm512_set1_ps(st[t * w + r + i]);
        for (int j = 0; j < NV; j++) {
            __m512 vt = load16(v, at[t] + c + j * 16, bf16);
            for (int i = 0; i < NR; i++) acc[i][j] = _mm512_fmadd_ps(p[i], vt, acc[i][j]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(o + (r + i) * d + c + j * 16, acc[i][j]);
}

static __attribute__((noinline)) PK_AVX512 void pv512(float *o, int64_t d, const float *alpha,
                                                     const float *st, int64_t w, const void *v,
                                                     const int64_t *at, int64_t n, int64_t nr,
                                                     int bf16) {
    for (int64_t r = 0; r < nr; r += 4)
        for (int64_t c = 0; c < d; c += 64) {
            int rows = nr - r < 4 ? (int)(nr - r) : 4, vecs = d - c < 64 ? (int)(d - c) / 16 : 4;
#define PV(R, V) case (R) * 8 + (V): pv512_tile(o, d, alpha, st, w, v, at, n, r, c, R, V, bf16); break
            switch (rows * 8 + vecs) {
                PV(1, 1); PV(1, 2); PV(1, 3); PV(1, 4); PV(2, 1); PV(2, 2); PV(2, 3); PV(2, 4);
                PV(3, 1); PV(3, 2); PV(3, 3); PV(3, 4); PV(4, 1); PV(4, 2); PV(4, 3); PV(4, 4);
            }
#undef PV
        }
}

#endif
