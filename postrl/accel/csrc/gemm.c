/* postrl's float32 linear layer for the lean sampler: y = x W^T (+ b), AVX-512 or AVX2.
 *
 * A decode step multiplies a few rows (1 to 32) by every weight of the model, once. At these
 * row counts the multiplication is bound by streaming the weights from memory as much as by
 * arithmetic, and oneDNN's packed fp32 linear reached about 0.55 of this CPU's peak at 32 rows
 * and about 0.7 of its read rate at 8 (docs/performance.md). Here the weight is packed once per
 * `generate` into panels of 32 output columns stored k-major, so that a panel is one
 * sequential stream; each panel is multiplied by blocks of at most 14 rows held in 28 vector
 * accumulators (3 rows on AVX2, whose 16-float vectors take two of its 16 registers), and the
 * next panel is prefetched while the blocks run, each block its share, so that reading the
 * weights overlaps the arithmetic.
 *
 * Built by postrl.accel.native on first use (-O3 -march=native -fopenmp); it shares
 * PyTorch's OpenMP runtime, whose thread count the caller passes.
 */
#include <stddef.h>

#include "simd.h"

#define NR 32 /* output columns per panel: two 16-float vectors */
#ifdef __AVX512F__
#define MR_MAX 14 /* rows per block: 2 * 14 accumulators + 2 weight vectors of 32 registers */
#else
#ifndef MR_AVX2 /* -DMR_AVX2=N: to measure another blocking on another AVX2 CPU */
#define MR_AVX2 3
#endif
#define MR_MAX MR_AVX2 /* AVX2 (avx2.h): a vector is 2 of 16 registers, 4 per row */
#endif

/* Panel p holds columns 32p..32p+31 of W [n, k] (row-major), k-major:
 * packed[(p * k + kk) * 32 + j] = W[32p + j, kk]; columns past n are zeros. */
void postrl_pack(const float *w, float *packed, int64_t n, int64_t k) {
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        const float *src = w + p * NR * k; /* the panel's rows of W, read as 32 streams */
        int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        for (int64_t kk = 0; kk < k; kk++) { /* written in order */
            for (int64_t j = 0; j < cols; j++) dst[kk * NR + j] = src[j * k + kk];
            for (int64_t j = cols; j < NR; j++) dst[kk * NR + j] = 0.0f;
        }
    }
}

/* Rows x[0..MR) (stride ldx) times one panel into y (stride ldy), `cols` valid columns;
 * `bias` (32 floats, zero-padded) or NULL; alongside, the first `lines` 64-byte lines from
 * `next` are prefetched: all of a panel's 2k lines (two per k), or a share of them. */
#define BLOCK(MR)                                                                           \
    static void block##MR(const float *x, int64_t ldx, const float *panel, int64_t k,      \
                          const float *bias, float *y, int64_t ldy, int64_t cols,          \
                          const float *next, int64_t lines) {                              \
        __m512 lo[MR], hi[MR];                                                              \
        __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();                     \
        __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();                \
        for (int i = 0; i < MR; i++) lo[i] = b0, hi[i] = b1;                                \
        for (int64_t kk = 0; kk < k; kk++) {                                                \
            __m512 w0 = _mm512_loadu_ps(panel + kk * NR);                                   \
            __m512 w1 = _mm512_loadu_ps(panel + kk * NR + 16);                              \
            if (kk < lines) { /* one line (16 floats) of `next` per k, two when alone */   \
                if (lines > k) {                                                            \
                    _mm_prefetch((const char *)(next + kk * NR), _MM_HINT_T1);              \
                    _mm_prefetch((const char *)(next + kk * NR + 16), _MM_HINT_T1);         \
                } else {                                                                    \
                    _mm_prefetch((const char *)(next + kk * 16), _MM_HINT_T1);              \
                }                                                                           \
            }                                                                               \
            for (int i = 0; i < MR; i++) {                                                  \
                __m512 a = _mm512_set1_ps(x[i * ldx + kk]);                                 \
                lo[i] = _mm512_fmadd_ps(a, w0, lo[i]);                                      \
                hi[i] = _mm512_fmadd_ps(a, w1, hi[i]);                                      \
            }                                                                               \
        }                                                                                   \
        __mmask16 m0 = lanes(cols), m1 = lanes(cols - 16);                                  \
        for (int i = 0; i < MR; i++) {                                                      \
            _mm512_mask_storeu_ps(y + i * ldy, m0, lo[i]);                                  \
            _mm512_mask_storeu_ps(y + i * ldy + 16, m1, hi[i]);                             \
        }                                                                                   \
    }

BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7)
BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12) BLOCK(13) BLOCK(14)

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, const float *, float *,
                         int64_t, int64_t, const float *, int64_t);
static const block_fn BLOCKS[15] = {
    NULL, block1, block2, block3, block4, block5, block6, block7,
    block8, block9, block10, block11, block12, block13, block14};

/* y [m, n] = x [m, k] W^T (+ bias), W packed by postrl_pack; bias: NULL or padded to the
 * panels' width. The rows are split into equal blocks of at most MR_MAX, the panels among
 * `threads` threads; each block prefetches its share of the next panel, so that the reads
 * spread over the whole panel's arithmetic (one block alone: two lines per k; with more,
 * one line per k, until its share is done). */
void postrl_linear(const float *x, int64_t m, int64_t k, const float *packed,
                   const float *bias, int64_t n, float *y, int threads) {
    if (m <= 0) return;
    int64_t panels = (n + NR - 1) / NR;
    int64_t blocks = (m + MR_MAX - 1) / MR_MAX, rows = (m + blocks - 1) / blocks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k * NR, *next = panel + k * NR;
        int64_t lines = p + 1 < panels ? 2 * k : 0; /* of the next panel, to prefetch */
        for (int64_t i = 0, b = 0; i < m; i += rows, b++) {
            int64_t mr = m - i < rows ? m - i : rows;
            int64_t from = b * lines / blocks, to = (b + 1) * lines / blocks;
            BLOCKS[mr](x + i * k, k, panel, k, bias ? bias + p * NR : NULL, y + i * n + p * NR,
                       n, n - p * NR, next + from * 16, to - from);
        }
    }
}
