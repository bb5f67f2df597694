/* GGUF's Q4_1 and Q8_0 blocks decoded to fp32 rows, shared by every kernel that reads them
 * (native_chain.c up to 8 rows, native_gemm.c from 9, pk_dequantize for the whole matrix), so
 * a weight has one decoded value wherever it is read; and where a kernel's weight rows come
 * from (weight_source).
 *
 * Q4_1: 32 weights in 20 bytes: d, m (fp16), then 16 bytes whose low nibble is weight j and
 * high nibble weight j + 16; w = d * q + m. Q8_0: 32 weights in 34 bytes: d (fp16), 32 int8;
 * w = d * q. Rows of n blocks are contiguous: weight [n, k] is n * k / 32 blocks. d * q is
 * exact in fp32 (an 11-bit times a 4- or 8-bit integer), so the fused d * q + m is the one fp32
 * rounding of it that gguf's and torch's decoders also make. */
#ifndef PAGEDKV_NATIVE_DEQUANT_H
#define PAGEDKV_NATIVE_DEQUANT_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_simd.h"

#define PK_FP32 0 /* the weight format codes (native_quant.FORMATS names the last two) */
#define PK_Q4_1 4
#define PK_Q8_0 8
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
static inline void dequant_q4_1_row(const uint8_t *src, float *dst, int64_t k) {
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
static inline void dequant_q8_0_row(const uint8_t *src, float *dst, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++, src += Q8_0_BYTES, dst += 32) {
        __m256 d = _mm256_set1_ps(half_at(src));
        for (int s = 0; s < 4; s++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(src + 2 + 8 * s));
            _mm256_storeu_ps(dst + 8 * s, _mm256_mul_ps(q8_to_ps(q, 1), d));
        }
    }
}

/* dequant_q4_1_row's AVX-512 form: a block's sixteen values fma(q, d, m), q = 0..15, are one
 * vector, and each weight is a lane of it picked by its nibble (vpermps reads an index's low
 * four bits, so the bytes need no mask): the same value per weight, at one FMA a block
 * instead of one a weight (which competed with the tiles' FMAs). */
PK_AVX512 static inline void dequant_q4_1_row512(const uint8_t *src, float *dst, int64_t k) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t b = 0; b < k / 32; b++, src += Q4_1_BYTES, dst += 32) {
        __m512 table = _mm512_fmadd_ps(levels, _mm512_set1_ps(half_at(src)),
                                       _mm512_set1_ps(half_at(src + 2)));
        __m128i q = _mm_loadu_si128((const __m128i *)(src + 4));
        _mm512_storeu_ps(dst, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), table));
        _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(
                                       _mm512_cvtepu8_epi32(_mm_srli_epi16(q, 4)), table));
    }
}

/* dequant_q8_0_row's AVX-512 form: the same q * d per weight. */
PK_AVX512 static inline void dequant_q8_0_row512(const uint8_t *src, float *dst, int64_t k) {
    for (int64_t b = 0; b < k / 32; b++, src += Q8_0_BYTES, dst += 32) {
        __m512 d = _mm512_set1_ps(half_at(src));
        for (int s = 0; s < 2; s++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(src + 2 + 16 * s));
            __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
            _mm512_storeu_ps(dst + 16 * s, _mm512_mul_ps(v, d));
        }
    }
}

typedef void (*dequant_row_fn)(const uint8_t *, float *, int64_t);

/* The row decoder (the AVX-512 form where it runs: the same values) and the bytes of a row of
 * k weights, for a format code; NULL for another. */
static inline dequant_row_fn dequant_for(int kind, int64_t k, int64_t *row_bytes) {
    *row_bytes = k / 32 * (kind == PK_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES);
    if (kind == PK_Q4_1) return pk_avx512 ? dequant_q4_1_row512 : dequant_q4_1_row;
    if (kind == PK_Q8_0) return pk_avx512 ? dequant_q8_0_row512 : dequant_q8_0_row;
    return NULL;
}

/* A buffer of an OpenMP thread's (a __thread variable of the file using it), kept for the next
 * call (fresh ones per call would be page faults every call) and grown when asked for more. */
typedef struct {
    float *buf;
    int64_t floats;
} kept_buffer;

static inline float *kept(kept_buffer *b, int64_t floats) {
    if (floats > b->floats) {
        free(b->buf);
        b->buf = aligned_alloc(64, (size_t)floats * sizeof(float));
        b->floats = b->buf ? floats : 0;
    }
    return b->buf;
}

/* Where a kernel's weight rows come from: an fp32 matrix [n, k] read in place (w), or GGUF
 * blocks (wq, row_bytes a row) decoded into the thread's scratch; the decoded values are
 * pk_dequantize's, so the products are the fp32 matrix's. weight_rows gives rows c .. c +
 * count - 1 (stride k). */
typedef struct {
    const float *w;
    const uint8_t *wq;
    dequant_row_fn dequant;
    int64_t row_bytes;
} weight_source;

static inline const float *weight_rows(const weight_source *src, float *scratch, int64_t c,
                                       int64_t count, int64_t k) {
    if (src->w) return src->w + c * k;
    for (int64_t j = 0; j < count; j++)
        src->dequant(src->wq + (c + j) * src->row_bytes, scratch + j * k, k);
    return scratch;
}

#endif
