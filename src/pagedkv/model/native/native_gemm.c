/* pk_gemm: y = x @ W.T (+ bias) (+ residual) for the row counts above pk_linear's (prompts),
 * at the compute limit of the CPU rather than at the weights' bandwidth.
 *
 * Why a GEMM of our own: on an AMD EPYC (Zen 4) MKL's fp32 GEMM runs the engine's prompt shapes
 * at 121-159 GFLOPS of the two cores' 215 (docs/latency.md, ninth round); the trace workload
 * spends most of its time there.
 *
 * The form: each thread takes an even range of 16-row groups of x and transposes a span of them
 * at a time (as many as fit in its L2; [k][16] a group: sixteen rows' values at one k side by
 * side) into its own buffer, then sweeps every weight row over the span's panels of three
 * groups: the weight value is broadcast, the rows are a vector, so an accumulator lane is one
 * output element and no horizontal sum is needed (3 groups x 8 weight rows of 16 lanes in the
 * AVX-512 form, 1 group x 6 weight rows of 2 x 8 lanes in the AVX2 one).
 *
 * Weights in GGUF blocks (pk_gemm_blocks: int4/int8 prompts) are decoded a tile's weight rows
 * at a time into the thread's scratch, once per span (native_dequant.h's decoders, the values
 * pk_dequantize writes), so the matrix is never written whole: about 5 % of a 256-row product
 * on the Zen 4, where decoding the whole matrix first cost 6-10 %.
 *
 * Contract: every output element is ONE chain of fused multiply-adds in k order from 0, then
 * + bias, then residual +: the same operations whatever the tile, the ISA, the number of rows,
 * the row's place in the batch and the number of threads. So a row gets bit-identical results
 * alone and in any batch, on AVX2 and AVX-512 alike (a scalar fmaf loop computes the same
 * bits, and runs the columns that do not fill a tile: n % 8 or n % 6). Up to 8 rows run
 * native_chain.c, which computes the same chain with columns in a vector: the same bits again.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "native_gemm_tiles.h"

static __thread kept_buffer panel_kept, scratch_kept;

/* Groups of x transposed at a time (a span): every weight row is read, or decoded, once per
 * span and swept over its panels of PANEL_GROUPS groups, the span staying in the core's L2
 * (three quarters of it, 512 KB where the size is unknown; PAGEDKV_GEMM_SPAN_KB sets another,
 * for tests and A/B). Against a panel a span: on the Zen 4's 1 MB L2, 576 -> 3,072 at
 * 256-2,048 rows 1.1-1.2x faster in fp32 (the 7 MB weight read a quarter as often), and
 * blocks decoded 2-3x less often. The bits do not depend on it. */
static int64_t span_groups(int64_t k) {
    static int64_t l2_bytes;
    if (!l2_bytes) {
        long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2_bytes = size > 0 ? size : 512 << 10;
    }
    const char *set = getenv("PAGEDKV_GEMM_SPAN_KB");
    int64_t budget = set && atoll(set) > 0 ? atoll(set) << 10 : l2_bytes * 3 / 4;
    int64_t panels = budget / ((int64_t)PANEL_GROUPS * GROUP_ROWS * k * (int64_t)sizeof(float));
    return PANEL_GROUPS * (panels > 1 ? panels : 1);
}

/* The rows [row0, ...) of one span (count groups, transposed at xp) times the weight rows of
 * tiles [tile0, tile1) (TILE512_COLS or TILE_COLS columns a tile), and the columns past the
 * last tile when tail is set. */
static void span_product(const weight_source *src, float *scratch, const float *xp,
                         const float *bias, const float *res, float *y, int64_t row0, int count,
                         int64_t rows, int64_t k, int64_t n, int64_t tile0, int64_t tile1,
                         int tail) {
    int64_t c = tile0 * (pk_avx512 ? TILE512_COLS : TILE_COLS);
    int64_t end = tile1 * (pk_avx512 ? TILE512_COLS : TILE_COLS);
    if (pk_avx512) {
        for (; c < end; c += TILE512_COLS) {
            const float *wc = weight_rows(src, scratch, c, TILE512_COLS, k);
            for (int p = 0; p < count; p += PANEL_GROUPS) {
                const float *xq = xp + p * k * GROUP_ROWS;
                int64_t r0 = row0 + p * GROUP_ROWS;
                int left = count - p;
                if (left >= 3) tile512_3(xq, wc, bias, res, y, r0, rows, k, n, c);
                else if (left == 2) tile512_2(xq, wc, bias, res, y, r0, rows, k, n, c);
                else tile512_1(xq, wc, bias, res, y, r0, rows, k, n, c);
            }
        }
    } else {
        for (; c < end; c += TILE_COLS) {
            const float *wc = weight_rows(src, scratch, c, TILE_COLS, k);
            for (int g = 0; g < count; g++)
                tile256(xp + g * k * GROUP_ROWS, wc, bias, res, y, row0 + g * GROUP_ROWS, rows,
                        k, n, c);
        }
    }
    for (; tail && c < n; c++) {
        const float *wc = weight_rows(src, scratch, c, 1, k);
        for (int g = 0; g < count; g++)
            column_scalar(xp + g * k * GROUP_ROWS, wc, bias, res, y, row0 + g * GROUP_ROWS, rows,
                          k, n, c);
    }
}

/* The threads split the rows of x (groups of 16), or, where that would leave a thread less
 * than a panel of them (fewer than 48 rows a thread: decode steps of 16-64 sequences), the
 * columns, each thread then transposing all of x: with 16 rows, a split by rows left the
 * second thread idle. Either way every element is the same chain. */
int pk_gemm_source(const weight_source *src, const float *x, const float *bias, const float *res,
                   float *y, int64_t rows, int64_t k, int64_t n, int threads) {
    int64_t groups = (rows + GROUP_ROWS - 1) / GROUP_ROWS, span = span_groups(k);
    int64_t tiles = n / (pk_avx512 ? TILE512_COLS : TILE_COLS);
    int failed = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1)
    {
        int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        int by_columns = groups < PANEL_GROUPS * team;
        int64_t first = by_columns ? 0 : groups * t / team;
        int64_t last = by_columns ? groups : groups * (t + 1) / team;
        int64_t tile0 = by_columns ? tiles * t / team : 0;
        int64_t tile1 = by_columns ? tiles * (t + 1) / team : tiles;
        int tail = !by_columns || t == team - 1;
        if (by_columns && tile0 == tile1 && !tail) last = first; /* no columns of its own */
        int64_t mine = last - first < span ? last - first : span;
        float *xp = first < last ? kept(&panel_kept, mine * GROUP_ROWS * k) : NULL;
        float *scratch = src->w || first == last ? NULL : kept(&scratch_kept, TILE512_COLS * k);
        if (first < last && (!xp || (!src->w && !scratch))) {
            #pragma omp atomic write
            failed = 1;
            last = first;
        }
        for (int64_t g0 = first; g0 < last; g0 += span) {
            int count = last - g0 < span ? (int)(last - g0) : (int)span;
            int64_t row0 = g0 * GROUP_ROWS;
            for (int g = 0; g < count; g++)
                pack_group(x, xp + g * k * GROUP_ROWS, row0 + g * GROUP_ROWS, rows, k);
            span_product(src, scratch, xp, bias, res, y, row0, count, rows, k, n, tile0, tile1,
                         tail);
        }
    }
    return failed ? -1 : 0;
}

/* y [rows, n] = x [rows, k] @ w.T (+ bias [n]) (+ residual [rows, n]); w [n, k]; contiguous
 * fp32, k % 8 == 0; y may be residual. Returns 0, or -1 when a thread's buffer could not be
 * allocated (y then incomplete). */
int pk_gemm(const float *x, const float *w, const float *bias, const float *res, float *y,
            int64_t rows, int64_t k, int64_t n, int threads) {
    weight_source src = {.w = w};
    return pk_gemm_source(&src, x, bias, res, y, rows, k, n, threads);
}

/* pk_gemm with w in GGUF blocks of format kind (PK_Q4_1 or PK_Q8_0; k % 32 == 0): the bits
 * of pk_gemm on pk_dequantize's matrix, without writing that matrix. Returns 0, -1 (no
 * memory), or -2 for another format. */
int pk_gemm_blocks(int kind, const float *x, const uint8_t *wq, const float *bias,
                   const float *res, float *y, int64_t rows, int64_t k, int64_t n, int threads) {
    weight_source src = {.wq = wq};
    if (!(src.dequant = dequant_for(kind, k, &src.row_bytes))) return -2;
    return pk_gemm_source(&src, x, bias, res, y, rows, k, n, threads);
}
