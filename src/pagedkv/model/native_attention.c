/* Decode attention straight from the paged cache (AVX2 + FMA, OpenMP), built into the same
 * library as native_kernels.c by native.py.
 *
 * Why this shape: a decode step at 64 sequences reads each layer's whole KV cache (76 MB at
 * context 773 in fp32 for SmolLM2-135M), so the kernel must stream it at memory speed. One
 * work item is one sequence and one KV head with all the query heads that share it (GQA):
 * each key and value is read from memory once, not once per query head, and tokens are
 * scored eight at a time, so the softmax's exp and maximum are vector operations per tile of
 * eight tokens, not scalar ones per token.
 *
 * Contract: one query per sequence, its keys and values found through its block table
 * (slot = table[t / B] * B + t % B), nothing gathered. q: row s of the batch at
 * q + s * q_stride, [Hq, D]; caches [num_blocks, B, Hkv, D]; tables [S, table_stride] and
 * ctx_lens [S] (>= 1) int64; out [S, Hq * D]. Query head h reads KV head h / (Hq / Hkv).
 * Softmax with a running maximum per tile, fp32; D % 8 == 0. bf16: queries, caches and out
 * are bf16 (D <= 256), the arithmetic the same fp32, out rounded once. Each (sequence, KV
 * head) is computed alone, in the same order whatever the batch and the number of threads.
 */
#include <math.h>
#include <stdint.h>

#include "native_simd.h"

#define TILE 8       /* tokens scored at once: one vector of scores per query head */
#define MAX_GROUP 16 /* query heads of one KV head attended in one pass (more: several) */

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Heads [0, heads) of a group: queries at q + q_at + j * d, accumulators o + j * d (fp32,
 * overwritten), keys/values of token t at the cache offset kv_at + slot(t) * row. */
static void attend_group(const void *q, int64_t q_at, const void *k_cache, const void *v_cache,
                         const int64_t *table, int64_t ctx, int64_t row, int64_t kv_at,
                         int64_t block_size, int64_t heads, int64_t d, float scale, float *o,
                         int bf16) {
    float m[MAX_GROUP], l[MAX_GROUP];
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t j = 0; j < heads; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        for (int64_t c = 0; c < d; c++) o[j * d + c] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < ctx; t0 += TILE) {
        /* A short last tile repeats its last token in the missing lanes, masked out of the
         * softmax (score -inf, weight 0): every loop below has TILE iterations. */
        int64_t n = ctx - t0 < TILE ? ctx - t0 : TILE, at[TILE];
        for (int64_t i = 0; i < TILE; i++) {
            int64_t t = t0 + (i < n ? i : n - 1);
            at[i] = (table[t / block_size] * block_size + t % block_size) * row + kv_at;
        }
        __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)n), _CMP_LT_OQ);
        for (int64_t j = 0; j < heads; j++) {
            float *oj = o + j * d;
            __m256 dots[TILE];
            for (int64_t i = 0; i < TILE; i++) dots[i] = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; c += 8) {  /* eight independent sums, each in c order */
                __m256 qc = load8(q, q_at + j * d + c, bf16);
                for (int64_t i = 0; i < TILE; i++)
                    dots[i] = _mm256_fmadd_ps(qc, load8(k_cache, at[i] + c, bf16), dots[i]);
            }
            __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                        _mm256_mul_ps(hsum8x8(dots), _mm256_set1_ps(scale)),
                                        valid);
            float top = hmax8(s);
            if (top > m[j]) {  /* a new maximum: what was summed so far shrinks by exp(m - top) */
                if (m[j] != -INFINITY) {
                    float shrink = expf(m[j] - top);
                    __m256 sv = _mm256_set1_ps(shrink);
                    for (int64_t c = 0; c < d; c += 8)
                        _mm256_storeu_ps(oj + c, _mm256_mul_ps(_mm256_loadu_ps(oj + c), sv));
                    l[j] *= shrink;
                }
                m[j] = top;
            }
            __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(s, _mm256_set1_ps(m[j]))), valid);
            l[j] += hsum(p);
            float pt[TILE];
            _mm256_storeu_ps(pt, p);
            for (int64_t i = 0; i < TILE; i++) {  /* token order; the d / 8 sums independent */
                __m256 pi = _mm256_set1_ps(pt[i]);
                for (int64_t c = 0; c < d; c += 8)
                    _mm256_storeu_ps(oj + c, _mm256_fmadd_ps(pi, load8(v_cache, at[i] + c, bf16),
                                                             _mm256_loadu_ps(oj + c)));
            }
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        __m256 inv = _mm256_set1_ps(1.0f / l[j]);
        for (int64_t c = 0; c < d; c += 8)
            _mm256_storeu_ps(o + j * d + c, _mm256_mul_ps(_mm256_loadu_ps(o + j * d + c), inv));
    }
}

static inline void decode_attention(const void *q, int64_t q_stride, const void *k_cache,
                                    const void *v_cache, const int64_t *tables,
                                    int64_t table_stride, const int64_t *ctx_lens, void *out,
                                    int64_t seqs, int64_t hq, int64_t hkv, int64_t d,
                                    int64_t block_size, float scale, int threads, int bf16) {
    int64_t group = hq / hkv, chunks = (group + MAX_GROUP - 1) / MAX_GROUP;
    int64_t work = seqs * hkv * chunks;
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && work > 1)
    for (int64_t item = 0; item < work; item++) {
        int64_t s = item / (hkv * chunks), kvh = item / chunks % hkv, chunk = item % chunks;
        int64_t first = kvh * group + chunk * MAX_GROUP;
        int64_t heads = group - chunk * MAX_GROUP < MAX_GROUP ? group - chunk * MAX_GROUP
                                                               : MAX_GROUP;
        int64_t q_at = s * q_stride + first * d, out_at = s * hq * d + first * d;
        float acc[MAX_GROUP * 256];  /* bf16's accumulators; native.BF16_MAX_HEAD_DIM = 256 */
        float *o = bf16 ? acc : (float *)out + out_at;
        attend_group(q, q_at, k_cache, v_cache, tables + s * table_stride, ctx_lens[s],
                     hkv * d, kvh * d, block_size, heads, d, scale, o, bf16);
        if (bf16)
            for (int64_t i = 0; i < heads * d; i++)
                ((uint16_t *)out)[out_at + i] = to_bf16(acc[i]);
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
