/* Paged attention straight from the cache for every sequence of a step, decode tokens and
 * prefill chunks alike, in one call (AVX2 + FMA, OpenMP); built into the same library as
 * native_kernels.c by native.py.
 *
 * Why this shape: torch's SDPA ran a prompt's attention at 27-40 GFLOPS on this machine kind
 * (a third of the projections' rate), and one call per prefill sequence; the old decode kernel
 * loaded and stored every output accumulator once per key. Here a work item is one sequence,
 * one KV head and up to ROWS query rows that share it, a row being (query position, query
 * head of the group): each key and value is read once per item, not once per head.
 *   scores  rows in vector lanes: the item's queries transposed once into scratch (Q^T), a
 *           key's elements broadcast straight from the cache, 2-4 keys x 1-6 row vectors of
 *           accumulators; no copy of K.
 *   softmax online over absolute blocks of KEYS positions; per lane, so a vector of rows.
 *   P V     dims in vector lanes: a value row loaded straight from the cache, 3 rows x 32
 *           dims of accumulators kept in registers over the block.
 *
 * Contract: sequence s has q_lens[s] >= 1 new tokens (NULL: 1 each), rows q_starts[s] + i of
 * the batch (NULL: row s), at absolute positions ctx_lens[s] - q_lens[s] + i; row i attends
 * keys 0..that position (causal, bottom right), found through the block table (slot =
 * table[t / B] * B + t % B), nothing gathered. q: batch row r at q + r * q_stride, [Hq, D];
 * caches [num_blocks, B, Hkv, D]; tables [S, table_stride], ctx_lens, q_starts, q_lens [S]
 * int64; out [T, Hq * D]. Query head h reads KV head h / (Hq / Hkv). D % 8 == 0, D <= MAX_D.
 * bf16: queries, caches and out are bf16, the arithmetic the same fp32, out rounded once.
 *
 * Bits: a row's scores are one FMA chain each in d order, its softmax blocks absolute key
 * positions, its sums in key order, and a key past its causal limit adds exactly nothing. So a
 * row gets the same bits whatever the batch, the item it falls in, the chunking of its prompt
 * (a decode token is the last row of a prompt), and the number of threads.
 */
#include <math.h>
#include <stdint.h>

#include "native_simd.h"

#define KEYS 32   /* keys per softmax block */
#define ROWS 48   /* query rows per work item: up to 6 vectors of lanes */
#define AHEAD 8   /* keys requested ahead of the one being scored */
/* the scratch below is sized for it (native.MAX_HEAD_DIM): DeepSeek's MLA record, 512 + 64,
 * read as one head (mla/native.py) */
#define MAX_D 576

#define INLINE static inline __attribute__((always_inline))

INLINE float scalar(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    union { uint32_t u; float f; } v = {(uint32_t)((const uint16_t *)p)[i] << 16};
    return v.f;
}

/* st[t * w + r] = q_r . k_t for nk keys (at k + at[t]) and NV vectors of rows of qt [d][w]. */
INLINE void scores_tile(const float *qt, int64_t w, const void *k, const int64_t *at,
                        int64_t d, float *st, const int NV, const int NK, int bf16) {
    __m256 acc[8][6];
    for (int t = 0; t < NK; t++)
        for (int v = 0; v < NV; v++) acc[t][v] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        __m256 kc[8];
        for (int t = 0; t < NK; t++) kc[t] = _mm256_set1_ps(scalar(k, at[t] + c, bf16));
        for (int v = 0; v < NV; v++) {
            __m256 qv = _mm256_loadu_ps(qt + c * w + v * 8);
            for (int t = 0; t < NK; t++) acc[t][v] = _mm256_fmadd_ps(qv, kc[t], acc[t][v]);
        }
    }
    for (int t = 0; t < NK; t++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(st + t * w + v * 8, acc[t][v]);
}

/* The keys and values AHEAD positions past the ones being scored: at[t] is the cache offset
 * (elements) of key t + AHEAD of the block, for t < n (past the context: n is smaller). */
typedef struct {
    const char *k, *v;
    const int64_t *at;
    int64_t n, row_bytes, elem_bytes;
} Ahead;

/* Requested a few keys at a time while scores run: requesting the whole next block's keys and
 * values at once (256 lines) hid less of the memory's latency (decode attention of 64 x 700
 * keys from DRAM at 15-16 GB/s that way, 19-20 GB/s this way; latency.md, eleventh round). */
INLINE void prefetch_keys(const Ahead *p, int64_t t, int64_t count) {
    for (int64_t i = t; i < t + count && i < p->n; i++)
        for (int64_t b = 0; b < p->row_bytes; b += 64) {
            _mm_prefetch(p->k + p->at[i] * p->elem_bytes + b, _MM_HINT_T0);
            _mm_prefetch(p->v + p->at[i] * p->elem_bytes + b, _MM_HINT_T0);
        }
}

INLINE void scores(const float *qt, int64_t w, const void *k, const int64_t *at, int64_t n,
                   int64_t d, float *st, const Ahead *pf, const int NV, int bf16) {
    /* 8-12 accumulators: enough independent chains to hide the FMA's latency (one vector of
     * rows, a decode token's, has only its keys for chains), no more than 16 registers hold */
    const int NK = NV == 1 ? 8 : NV <= 3 ? 4 : 2;
    int64_t t = 0;
    for (; t + NK <= n; t += NK) {
        prefetch_keys(pf, t, NK);
        scores_tile(qt, w, k, at + t, d, st + t * w, NV, NK, bf16);
    }
    for (; t < n; t++) {
        prefetch_keys(pf, t, 1);
        scores_tile(qt, w, k, at + t, d, st + t * w, NV, 1, bf16);
    }
}

/* One function per shape, out of line: inlined into the item's loop, the key pointers of a
 * tile were spilled to the stack and reloaded for every element. */
#define SCORES(NV, B)                                                                     \
    static __attribute__((noinline)) void scores_##NV##_##B(                             \
        const float *qt, int64_t w, const void *k, const int64_t *at, int64_t n, int64_t d, \
        float *st, const Ahead *pf) {                                                     \
        scores(qt, w, k, at, n, d, st, pf, NV, B);                                        \
    }
SCORES(1, 0) SCORES(2, 0) SCORES(3, 0) SCORES(4, 0) SCORES(5, 0) SCORES(6, 0)
SCORES(1, 1) SCORES(2, 1) SCORES(3, 1) SCORES(4, 1) SCORES(5, 1) SCORES(6, 1)
#undef SCORES
typedef void (*ScoresFn)(const float *, int64_t, const void *, const int64_t *, int64_t,
                         int64_t, float *, const Ahead *);
static const ScoresFn SCORES_FNS[2][6] = {
    {scores_1_0, scores_2_0, scores_3_0, scores_4_0, scores_5_0, scores_6_0},
    {scores_1_1, scores_2_1, scores_3_1, scores_4_1, scores_5_1, scores_6_1},
};

#include "native_attention512.h"

/* o[r][c..c + 8 NV) = o * alpha[r] + sum_t p[t][r] v_t, NR rows from r, in key order. */
INLINE void pv_tile(float *o, int64_t d, const float *alpha, const float *st, int64_t w,
                    const void *v, const int64_t *at, int64_t n, int64_t r, int64_t c,
                    const int NR, const int NV, int bf16) {
    __m256 acc[3][4];
    for (int i = 0; i < NR; i++) {
        __m256 a = _mm256_set1_ps(alpha[r + i]);
        for (int j = 0; j < NV; j++)
            acc[i][j] = _mm256_mul_ps(_mm256_loadu_ps(o + (r + i) * d + c + j * 8), a);
    }
    for (int64_t t = 0; t < n; t++) {  /* 12 accumulators, 3 weights, 1 value: 16 registers */
        __m256 p[3];
        for (int i = 0; i < NR; i++) p[i] = _mm256_set1_ps(st[t * w + r + i]);
        for (int j = 0; j < NV; j++) {
            __m256 vt = load8(v, at[t] + c + j * 8, bf16);
            for (int i = 0; i < NR; i++) acc[i][j] = _mm256_fmadd_ps(p[i], vt, acc[i][j]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NV; j++) _mm256_storeu_ps(o + (r + i) * d + c + j * 8, acc[i][j]);
}

INLINE void pv(float *o, int64_t d, const float *alpha, const float *st, int64_t w,
               const void *v, const int64_t *at, int64_t n, int64_t nr, int bf16) {
    for (int64_t r = 0; r < nr; r += 3)
        for (int64_t c = 0; c < d; c += 32) {
            int rows = nr - r < 3 ? (int)(nr - r) : 3, vecs = d - c < 32 ? (int)(d - c) / 8 : 4;
            /* constant tile shapes, so that the accumulators live in registers */
#define PV(R, V) case (R) * 8 + (V): pv_tile(o, d, alpha, st, w, v, at, n, r, c, R, V, bf16); break
            switch (rows * 8 + vecs) {
                PV(1, 1); PV(1, 2); PV(1, 3); PV(1, 4); PV(2, 1); PV(2, 2);
                PV(2, 3); PV(2, 4); PV(3, 1); PV(3, 2); PV(3, 3); PV(3, 4);
            }
#undef PV
        }
}

/* One block of n keys from t0 for the w rows: scale, mask past each row's limit, fold into
 * the running maximum m and sum l; st becomes the weights p, alpha the old sums' factor. */
INLINE void softmax_block(float *st, int64_t w, int64_t t0, int64_t n, const float *limit,
                          float scale, float *m, float *l, float *alpha) {
    for (int64_t r = 0; r < w; r += 8) {
        __m256 lim = _mm256_loadu_ps(limit + r), top = _mm256_set1_ps(-INFINITY);
        __m256 sc = _mm256_set1_ps(scale), old = _mm256_loadu_ps(m + r);
        for (int64_t t = 0; t < n; t++) {
            __m256 valid = _mm256_cmp_ps(_mm256_set1_ps((float)(t0 + t)), lim, _CMP_LE_OQ);
            __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                        _mm256_mul_ps(_mm256_loadu_ps(st + t * w + r), sc), valid);
            _mm256_storeu_ps(st + t * w + r, s);
            top = _mm256_max_ps(top, s);
        }
        /* key 0 is valid for every row, so m is finite after the first block and a block with
         * no valid key leaves m, l and o exactly as they were (alpha = exp(0) = 1, p = 0) */
        __m256 fresh = _mm256_max_ps(old, top), sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            __m256 valid = _mm256_cmp_ps(_mm256_set1_ps((float)(t0 + t)), lim, _CMP_LE_OQ);
            __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(st + t * w + r), fresh)),
                                     valid);
            _mm256_storeu_ps(st + t * w + r, p);
            sum = _mm256_add_ps(sum, p);
        }
        __m256 a = exp8(_mm256_sub_ps(old, fresh)); /* first block: exp(-inf) ~ 0 times 0 */
        _mm256_storeu_ps(alpha + r, a);
        _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
        _mm256_storeu_ps(m + r, fresh);
    }
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *tables, *ctx_lens, *q_starts, *q_lens;
    void *out;
    int64_t q_stride, table_stride, hq, hkv, d, block_size;
    float scale;
} Step;

/* at[t]: elements of the cache before the key (or value) of KV head kvh at position t0 + t,
 * t < n; one division per call, not one per key (it cost as much as the key's scores). */
INLINE void kv_offsets(const Step *a, const int64_t *table, int64_t t0, int64_t n,
                       int64_t kvh, int64_t *at) {
    int64_t b = t0 / a->block_size, off = t0 % a->block_size;
    for (int64_t t = 0; t < n; t++) {
        at[t] = ((table[b] * a->block_size + off) * a->hkv + kvh) * a->d;
        if (++off == a->block_size) off = 0, b++;
    }
}

/* Rows [r0, r0 + nr) (row = i * group + j) of sequence s and KV head kvh. */
INLINE void attend_item(const Step *a, int64_t s, int64_t kvh, int64_t r0, int64_t nr,
                        int bf16) {
    _Alignas(32) float qt[MAX_D * ROWS], o[ROWS * MAX_D], st[KEYS * ROWS];
    float limit[ROWS], m[ROWS], l[ROWS], alpha[ROWS];
    int64_t offs[KEYS + AHEAD]; /* a block's keys, then up to AHEAD keys of the next */
    int64_t d = a->d, group = a->hq / a->hkv, nv = (nr + 7) / 8, w = nv * 8, size = bf16 ? 2 : 4;
    /* native_attention512.h's forms: P V (dims in lanes) for every item, scores (rows in
     * lanes) for items of more than 8 rows, where 16 lanes fill */
    int wide_pv = pk_avx512 && d % 16 == 0, wide = wide_pv && nr > 8;
    if (wide) w = (nr + 15) / 16 * 16;
    int64_t qlen = a->q_lens ? a->q_lens[s] : 1, first = a->q_starts ? a->q_starts[s] : s;
    int64_t past = a->ctx_lens[s] - qlen; /* position of new token i: past + i */
    const int64_t *table = a->tables + s * a->table_stride;
    for (int64_t r = 0; r < w; r++) {
        /* padding rows repeat the last row's limit with zero queries: finite, never stored */
        int64_t i = (r0 + (r < nr ? r : nr - 1)) / group, j = (r0 + r) % group;
        int64_t q_at = (first + i) * a->q_stride + (kvh * group + j) * d;
        for (int64_t c = 0; c < d; c++) qt[c * w + r] = r < nr ? scalar(a->q, q_at + c, bf16) : 0;
        limit[r] = (float)(past + i);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t i = 0; i < nr * d; i++) o[i] = 0.0f;
    int64_t keys = past + (r0 + nr - 1) / group + 1; /* the last row's limit + 1 */
    for (int64_t t0 = 0; t0 < keys; t0 += KEYS) {
        int64_t n = keys - t0 < KEYS ? keys - t0 : KEYS;
        int64_t more = keys - t0 - n < AHEAD ? keys - t0 - n : AHEAD;
        kv_offsets(a, table, t0, n + more, kvh, offs);
        /* key t's scores request key t + AHEAD's key and value (a block table scatters them) */
        int64_t late = n + more - AHEAD;
        Ahead pf = {a->k_cache, a->v_cache, offs + AHEAD, late < 0 ? 0 : late, d * size, size};
        if (t0 == 0) {
            Ahead start = {a->k_cache, a->v_cache, offs, n + more, d * size, size};
            prefetch_keys(&start, 0, AHEAD);
        }
        if (wide) SCORES512_FNS[bf16][w / 16 - 1](qt, w, a->k_cache, offs, n, d, st, &pf);
        else SCORES_FNS[bf16][nv - 1](qt, w, a->k_cache, offs, n, d, st, &pf);
        softmax_block(st, w, t0, n, limit, a->scale, m, l, alpha);
        if (wide_pv) pv512(o, d, alpha, st, w, a->v_cache, offs, n, nr, bf16);
        else pv(o, d, alpha, st, w, a->v_cache, offs, n, nr, bf16);
    }
    for (int64_t r = 0; r < nr; r++) {
        int64_t i = (r0 + r) / group, j = (r0 + r) % group;
        int64_t out_at = (first + i) * a->hq * d + (kvh * group + j) * d;
        float inv = 1.0f / l[r];
        for (int64_t c = 0; c < d; c++) {
            float x = o[r * d + c] * inv;
            if (bf16) ((uint16_t *)a->out)[out_at + c] = to_bf16(x);
            else ((float *)a->out)[out_at + c] = x;
        }
    }
}

/* Work items of sequence s: its query rows (new tokens x heads of a group) in chunks of ROWS,
 * for each KV head. */
INLINE int64_t seq_items(const Step *a, int64_t s) {
    int64_t rows = (a->q_lens ? a->q_lens[s] : 1) * (a->hq / a->hkv);
    return a->hkv * ((rows + ROWS - 1) / ROWS);
}

INLINE void paged_attention(const Step *a, int64_t seqs, int threads, int bf16) {
    int64_t group = a->hq / a->hkv, work = 0;
    for (int64_t s = 0; s < seqs; s++) work += seq_items(a, s);
    /* items of unequal cost (a prompt's late rows see more keys): handed out one by one */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if(threads > 1 && work > 1)
    for (int64_t item = 0; item < work; item++) {
        int64_t s = 0, rest = item;
        while (rest >= seq_items(a, s)) rest -= seq_items(a, s++);
        int64_t kvh = rest % a->hkv, r0 = rest / a->hkv * ROWS;
        int64_t rows = (a->q_lens ? a->q_lens[s] : 1) * group - r0;
        attend_item(a, s, kvh, r0, rows < ROWS ? rows : ROWS, bf16);
    }
}

void pk_paged_attention(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int64_t *tables, int64_t table_stride,
                        const int64_t *ctx_lens, const int64_t *q_starts, const int64_t *q_lens,
                        float *out, int64_t seqs, int64_t hq, int64_t hkv, int64_t d,
                        int64_t block_size, float scale, int threads) {
    Step a = {q, k_cache, v_cache, tables, ctx_lens, q_starts, q_lens, out,
              q_stride, table_stride, hq, hkv, d, block_size, scale};
    paged_attention(&a, seqs, threads, 0);
}

/* pk_paged_attention on bf16 queries, caches and out (uint16 bits). */
void pk_paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *tables,
                             int64_t table_stride, const int64_t *ctx_lens,
                             const int64_t *q_starts, const int64_t *q_lens, uint16_t *out,
                             int64_t seqs, int64_t hq, int64_t hkv, int64_t d,
                             int64_t block_size, float scale, int threads) {
    Step a = {q, k_cache, v_cache, tables, ctx_lens, q_starts, q_lens, out,
              q_stride, table_stride, hq, hkv, d, block_size, scale};
    paged_attention(&a, seqs, threads, 1);
}

/* Every sequence one decode token (row s): pk_decode_layer's attention. */
void pk_decode_attention(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int64_t *tables, int64_t table_stride,
                         const int64_t *ctx_lens, float *out, int64_t seqs, int64_t hq,
                         int64_t hkv, int64_t d, int64_t block_size, float scale, int threads) {
    pk_paged_attention(q, q_stride, k_cache, v_cache, tables, table_stride, ctx_lens, NULL,
                       NULL, out, seqs, hq, hkv, d, block_size, scale, threads);
}
