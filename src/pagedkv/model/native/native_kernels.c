/* pagedkv's fp32 CPU kernels around the projections (AVX2 + FMA, OpenMP): RMSNorm, SiLU-and-mul,
 * RoPE into the paged cache and the one-call decode layer, built by native.py with the system
 * gcc and called through ctypes on torch tensors' memory. The projections are native_chain.c
 * (up to 8 rows) and native_gemm.c.
 *
 * Contract shared by every kernel: every output element is computed by the same sequence of
 * float operations whatever the number of rows, the row's position in the batch and the number
 * of threads. So a sequence decoded alone and in any batch gets bit-identical logits.
 *
 * The OpenMP runtime is the one torch already loaded (same soname): the kernels share torch's
 * thread team instead of fighting it for the cores. native.py checks that before using them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "native_linear.h"

int pk_avx512 = 0;

/* The kernels' form for this process: 1 AVX-512 (the caller checked the CPU), 0 AVX2. */
void pk_set_isa(int avx512) { pk_avx512 = avx512; }

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

/* native_attention.c */
void pk_decode_attention(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int64_t *tables, int64_t table_stride,
                         const int64_t *ctx_lens, float *out, int64_t seqs, int64_t hq,
                         int64_t hkv, int64_t d, int64_t block_size, float scale, int threads);

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
