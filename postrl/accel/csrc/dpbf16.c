/* The bf16 sampler's linear layers on a CPU with AVX512-BF16 and no AMX tiles (AMD Zen 4, for
 * one): y = x W^T + b, bf16 in and out, float32 sums rounded once, W in amx_gemm.c's packing.
 *
 * amx_gemm.c's packing stores a panel of 16 outputs as k / 2 rows of 64 bytes, row j holding each
 * output's inputs 2j and 2j + 1 side by side: exactly the second operand of VDPBF16PS, which
 * adds to 16 float32 sums the products of 16 such pairs with one broadcast pair of x. So one
 * packing serves both: postrl_bf16_linear takes AMX tiles where this process may use them,
 * else this kernel. It runs two panels (32 outputs) at a time over blocks of at most 14 rows
 * held in 28 vector accumulators, and prefetches the next two panels while it runs, each
 * block its share, as gemm.c does in float32; a decode step of 32 rows is bound by its
 * arithmetic, which VDPBF16PS does at twice float32's rate (docs/performance.md).
 */
#include <stdint.h>

#include "simd.h"

int postrl_amx_available(void);
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads);

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MR_MAX 14 /* rows per block: 2 * 14 accumulators + 2 weight vectors of 32 registers */

/* Rows x[0..MR) (row stride k, bf16) times panels p0 and p1 (k / 2 pair rows of 32 values
 * each) into y (row stride n) at columns [col, col + 32) of n; `bias` (bf16, n values) or
 * NULL; alongside, pair rows [from, to) of the next panels next0 and next1 are prefetched,
 * one 64-byte line of each per pair row run. */
#define BLOCK(MR)                                                                           \
    static void block##MR(const uint16_t *x, int64_t k, const uint16_t *p0,                \
                          const uint16_t *p1, const uint16_t *bias, int64_t col, int64_t n, \
                          uint16_t *y, const uint16_t *next0, const uint16_t *next1,        \
                          int64_t from, int64_t to) {                                       \
        int64_t count0 = n - col, count1 = n - col - 16;                                    \
        __m512 b0 = bias ? load16(bias, col, 1, count0) : _mm512_setzero_ps();              \
        __m512 b1 = bias ? load16(bias, col + 16, 1, count1) : _mm512_setzero_ps();         \
        __m512 lo[MR], hi[MR];                                                              \
        for (int i = 0; i < MR; i++) lo[i] = b0, hi[i] = b1;                                \
        const int32_t *pairs = (const int32_t *)x; /* x's inputs 2j and 2j + 1 as one */    \
        for (int64_t j = 0; j < k / 2; j++) {                                               \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + 32 * j);                        \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(p1 + 32 * j);                        \
            if (j >= from && j < to) {                                                      \
                _mm_prefetch((const char *)(next0 + 32 * j), _MM_HINT_T1);                  \
                _mm_prefetch((const char *)(next1 + 32 * j), _MM_HINT_T1);                  \
            }                                                                               \
            for (int i = 0; i < MR; i++) {                                                  \
                __m512bh a = (__m512bh)_mm512_set1_epi32(pairs[i * (k / 2) + j]);           \
                lo[i] = _mm512_dpbf16_ps(lo[i], a, w0);                                     \
                hi[i] = _mm512_dpbf16_ps(hi[i], a, w1);                                     \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < MR; i++) {                                                      \
            store16(y + i * n, col, lo[i], 1, count0);                                      \
            store16(y + i * n, col + 16, hi[i], 1, count1);                                 \
        }                                                                                   \
    }

BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7)
BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12) BLOCK(13) BLOCK(14)

typedef void (*block_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *,
                         const uint16_t *, int64_t, int64_t, uint16_t *, const uint16_t *,
                         const uint16_t *, int64_t, int64_t);
static const block_fn BLOCKS[MR_MAX + 1] = {
    NULL, block1, block2, block3, block4, block5, block6, block7,
    block8, block9, block10, block11, block12, block13, block14};

/* y [m, n] = x [m, k] W^T (+ bias) by VDPBF16PS: the panel pairs split among the threads,
 * the rows into equal blocks of at most MR_MAX. A lone last panel is run as its own pair
 * (its second half never stored). Exported for the tests, which run it on AMX CPUs too. */
void postrl_dpbf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                          const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    if (m <= 0) return;
    int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, stride = 16 * k;
    int64_t blocks = (m + MR_MAX - 1) / MR_MAX, rows = (m + blocks - 1) / blocks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t q = 0; q < pairs; q++) {
        const uint16_t *p0 = packed + 2 * q * stride;
        const uint16_t *p1 = 2 * q + 1 < panels ? p0 + stride : p0;
        int64_t ahead = 2 * q + 2 < panels ? k / 2 : 0; /* pair rows of the next two panels */
        const uint16_t *next0 = p0 + 2 * stride;
        const uint16_t *next1 = 2 * q + 3 < panels ? next0 + stride : next0;
        for (int64_t i = 0, b = 0; i < m; i += rows, b++) {
            int64_t mr = m - i < rows ? m - i : rows;
            BLOCKS[mr](x + i * k, k, p0, p1, bias, 32 * q, n, y + i * n, next0, next1,
                       b * ahead / blocks, (b + 1) * ahead / blocks);
        }
    }
}
#endif

static int amx = -1; /* whether this process uses AMX tiles: asked once */

/* 2: AMX tiles, 1: VDPBF16PS, 0: neither here (the sampler keeps oneDNN's bf16 linear). */
int postrl_bf16_linears(void) {
    if (amx < 0) amx = postrl_amx_available();
    if (amx) return 2;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] W^T + bias (bias [n] or NULL), all bf16, W packed by postrl_bf16_pack
 * (k a multiple of 32); y and x contiguous. Only where postrl_bf16_linears() is not 0. */
void postrl_bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                        const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    if (postrl_bf16_linears() == 2) {
        postrl_amx_linear(x, m, k, packed, bias, n, y, threads);
        return;
    }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    postrl_dpbf16_linear(x, m, k, packed, bias, n, y, threads);
#endif
}
