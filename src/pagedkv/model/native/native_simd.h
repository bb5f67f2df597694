/* AVX2 helpers shared by the kernels of native_kernels.c, native_chain.c, native_gemm.c and
 * native_attention.c: horizontal sums, a vector exp, bf16 <-> fp32; and the switch to the
 * AVX-512 forms. */
#ifndef PAGEDKV_NATIVE_SIMD_H
#define PAGEDKV_NATIVE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* Whether the AVX-512 forms run: set once per process by pk_set_isa (native.py: by the CPU's
 * capability, PAGEDKV_NATIVE_ISA=avx2 forces the AVX2 ones). The library is built for AVX2;
 * an AVX-512 function carries PK_AVX512 and runs only when this is set. */
extern int pk_avx512;

#define PK_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lane t of the result is the sum of the lanes of a[t]: eight horizontal sums at once. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                         _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for exp(r)
 * (Cephes' expf coefficients), times 2^n built in the exponent bits; x clamped to the range
 * where 2^n is a normal float (exp(-87.3) ~ 1e-38, exp(88.3) ~ 2e38). About 1 ulp; the scalar
 * expf of libm made silu * up 2.4x slower than torch's at 256 rows. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2, in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Eight floats from p[i..i+8): fp32, or bf16 widened (a bf16 is the top half of an fp32). */
static inline __m256 load8(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* fp32 -> bf16, rounded to nearest even as torch rounds (NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#endif
