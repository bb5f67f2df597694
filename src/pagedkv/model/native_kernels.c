/* pagedkv's fp32 CPU kernels for small batches (AVX2 + FMA, OpenMP), built by native.py with the
 * system gcc and called through ctypes on torch tensors' memory.
 *
 * Why: at 1-64 rows a decoder step is memory-bound, and torch's matmuls read an [out, in]
 * weight at ~20 GB/s where a sum reads ~29 GB/s (docs/latency.md, fifth round). Streaming each
 * weight row once, contiguously, a thread per range of rows, reads at the sum's speed.
 *
 * Contract shared by every kernel: every output element is computed by the same sequence of
 * float operations whatever the number of rows, the row's position in the batch and the number
 * of threads (8 lane partial sums in k order, then a fixed reduction). So a sequence decoded
 * alone and in a batch of up to 64 gets bit-identical logits.
 *
 * The OpenMP runtime is the one torch already loaded (same soname): the kernels share torch's
 * thread team instead of fighting it for the cores. native.py checks that before using them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "native_linear.h"

/* y[r, :] = x[r, :] @ w.T (+ bias) (+ residual[r, :]) for r < rows.
 * x [rows, k], w [n, k], bias [n] or NULL, residual [rows, n] or NULL, y [rows, n]: contiguous
 * fp32; k % 8 == 0. y may be residual (each element is read before it is written). */
void pk_linear(const float *x, const float *w, const float *bias, const float *res, float *y,
               int64_t rows, int64_t k, int64_t n, int threads) {
    int64_t blocks = n / 4;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1)
    for (int64_t g = 0; g < blocks; g++)
        linear_block4(x, w + g * 4 * k, bias, res, y, rows, k, n, g * 4, 1);
    for (int64_t c = blocks * 4; c < n; c++) linear_column(x, w + c * k, bias, res, y, rows, k, n, c);
}

/* y[r, :] = x[r, :] * weight / sqrt(mean(x[r, :]^2) + eps); h % 8 == 0; y may be x. */
void pk_rms_norm(const float *x, const float *weight, float *y, int64_t rows, int64_t h,
                 float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * h;
        float *yr = y + r * h;
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = 0; i < h; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            s = _mm256_fmadd_ps(v, v, s);
        }
        __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum(s) / (float)h + eps));
        for (int64_t i = 0; i < h; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), scale);
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
        }
    }
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

/* out[r, :] = silu(gate[r, :]) * up[r, :] for rows of ``half`` floats; row r of gate at
 * gate + r * gate_stride (of up likewise); out [rows, half] contiguous. Gate and up are the two
 * halves of one [rows, 2 * half] product (strides 2 * half) or two shards (strides half). */
void pk_silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
                 float *out, int64_t rows, int64_t half, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < half; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
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

/* Decode attention straight from the paged cache: one query per sequence, its keys and values
 * found through its block table (slot = table[t / B] * B + t % B), nothing gathered.
 * q: row s of the batch at q + s * q_stride, [Hq, D]; caches [num_blocks, B, Hkv, D];
 * tables [S, table_stride] and ctx_lens [S] int64; out [S, Hq * D]. Query head h reads KV head
 * h / (Hq / Hkv). Softmax in one pass (running maximum), fp32; D % 8 == 0. bf16: queries,
 * caches and out are bf16 (D <= 256), the arithmetic the same fp32, out rounded once.
 * Each (sequence, head) is computed alone, in the same order whatever the batch. */
static inline void decode_attention(const void *q, int64_t q_stride, const void *k_cache,
                                    const void *v_cache, const int64_t *tables,
                                    int64_t table_stride, const int64_t *ctx_lens, void *out,
                                    int64_t seqs, int64_t hq, int64_t hkv, int64_t d,
                                    int64_t block_size, float scale, int threads, int bf16) {
    int64_t group = hq / hkv, work = seqs * hq, row = hkv * d;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && work > 1)
    for (int64_t item = 0; item < work; item++) {
        int64_t s = item / hq, h = item % hq, kvh = h / group, ctx = ctx_lens[s];
        int64_t q_at = s * q_stride + h * d, out_at = s * hq * d + h * d;
        const int64_t *table = tables + s * table_stride;
        float acc[256];  /* native.BF16_MAX_HEAD_DIM: the caller checks d */
        float *o = bf16 ? acc : (float *)out + out_at;
        for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        for (int64_t t = 0; t < ctx; t++) {
            int64_t at = (table[t / block_size] * block_size + t % block_size) * row + kvh * d;
            __m256 a = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8)
                a = _mm256_fmadd_ps(load8(q, q_at + i, bf16), load8(k_cache, at + i, bf16), a);
            float score = hsum(a) * scale;
            float p;
            if (score > m) {  /* a new maximum: what was summed so far shrinks by exp(m - score) */
                float shrink = expf(m - score);
                __m256 sv = _mm256_set1_ps(shrink);
                for (int64_t i = 0; i < d; i += 8)
                    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), sv));
                l *= shrink;
                m = score;
                p = 1.0f;
            } else {
                p = expf(score - m);
            }
            l += p;
            __m256 pv = _mm256_set1_ps(p);
            for (int64_t i = 0; i < d; i += 8)
                _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, load8(v_cache, at + i, bf16),
                                                        _mm256_loadu_ps(o + i)));
        }
        __m256 inv = _mm256_set1_ps(1.0f / l);
        for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
        if (bf16)
            for (int64_t i = 0; i < d; i++) ((uint16_t *)out)[out_at + i] = to_bf16(acc[i]);
    }
}

void pk_decode_attention(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int64_t *tables, int64_t table_stride,
                         const int64_t *ctx_lens, float *out, int64_t seqs, int64_t hq,
                         int64_t hkv, int64_t d, int64_t block_size, float scale, int threads) {
    decode_attention(q, q_stride, k_cache, v_cache, tables, table_stride, ctx_lens, out, seqs,
                     hq, hkv, d, block_size, scale, threads, 0);
}

/* pk_decode_attention on bf16 queries, caches and out (uint16 bits), D <= 256. */
void pk_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *tables,
                              int64_t table_stride, const int64_t *ctx_lens, uint16_t *out,
                              int64_t seqs, int64_t hq, int64_t hkv, int64_t d,
                              int64_t block_size, float scale, int threads) {
    decode_attention(q, q_stride, k_cache, v_cache, tables, table_stride, ctx_lens, out, seqs,
                     hq, hkv, d, block_size, scale, threads, 1);
}

/* RoPE and the KV write of one layer, in place, for rows of qkv = [q heads | k heads | v heads]
 * (row r at qkv + r * row_stride, heads of d floats): every q and k head rotated as
 * layers.apply_rotary does (pairs i, i + d/2; cos [rows, d] and signed_sin [rows, d] as
 * RotaryEmbedding.cos_sin gives them), then the rotated k and the v of row r copied to slot
 * slots[r] of the caches [num_slots, hkv, d]. Rows are independent: any batch, same bits. */
void pk_rope_store(float *qkv, int64_t row_stride, const float *cos, const float *signed_sin,
                   const int64_t *slots, float *k_cache, float *v_cache, int64_t rows,
                   int64_t hq, int64_t hkv, int64_t d, int threads) {
    int64_t half = d / 2, kv_row = hkv * d;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * row_stride;
        const float *c = cos + r * d, *s = signed_sin + r * d;
        for (int64_t h = 0; h < hq + hkv; h++) {
            float *x = row + h * d;
            for (int64_t i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                x[i] = a * c[i] + b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        float *kd = k_cache + slots[r] * kv_row, *vd = v_cache + slots[r] * kv_row;
        const float *ks = row + hq * d, *vs = ks + kv_row;
        for (int64_t i = 0; i < kv_row; i++) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}

/* One decoder layer for a step where every row is a decode token (rows <= 64), the kernels
 * above in sequence: one call where the Python layer made nine, the glue between them (~4 ms
 * of a 25 ms step at batch 1) reduced to a function call. ``hidden`` [rows, h] is the residual
 * stream, updated in place; ``work`` holds rows * (h + qkv + hq*d + 3*inter) floats. The
 * arithmetic is exactly that of the separate calls (same kernels, same order). formats:
 * PK_FP32, PK_Q4_1 or PK_Q8_0 for w_qkv, w_o, w_gate_up, w_down. Returns 0, or -1 when a
 * quantized projection had no scratch memory (the layer is then incomplete). */
int pk_decode_layer(float *hidden, int64_t rows, int64_t h, const float *norm1,
                    const float *norm2, float eps, const int *formats, const void *w_qkv,
                    const float *b_qkv, const void *w_o, const void *w_gate_up,
                    const void *w_down, int64_t inter, int64_t hq, int64_t hkv, int64_t d,
                    const float *cos, const float *signed_sin, const int64_t *slots,
                    float *k_cache, float *v_cache, const int64_t *tables,
                    int64_t table_stride, const int64_t *ctx_lens, int64_t block_size,
                    float scale, float *work, int threads) {
    int64_t qkv_n = (hq + 2 * hkv) * d;
    float *normed = work, *qkv = normed + rows * h, *attn = qkv + rows * qkv_n;
    float *gate_up = attn + rows * hq * d, *act = gate_up + rows * 2 * inter;
    pk_rms_norm(hidden, norm1, normed, rows, h, eps, threads);
    if (pk_project(formats[0], normed, w_qkv, b_qkv, NULL, qkv, rows, h, qkv_n, threads))
        return -1;
    pk_rope_store(qkv, qkv_n, cos, signed_sin, slots, k_cache, v_cache, rows, hq, hkv, d,
                  threads);
    pk_decode_attention(qkv, qkv_n, k_cache, v_cache, tables, table_stride, ctx_lens, attn,
                        rows, hq, hkv, d, block_size, scale, threads);
    if (pk_project(formats[1], attn, w_o, NULL, hidden, hidden, rows, hq * d, h, threads))
        return -1;
    pk_rms_norm(hidden, norm2, normed, rows, h, eps, threads);
    if (pk_project(formats[2], normed, w_gate_up, NULL, NULL, gate_up, rows, h, 2 * inter,
                   threads))
        return -1;
    pk_silu_mul(gate_up, 2 * inter, gate_up + inter, 2 * inter, act, rows, inter, threads);
    return pk_project(formats[3], act, w_down, NULL, hidden, hidden, rows, inter, h, threads);
}
