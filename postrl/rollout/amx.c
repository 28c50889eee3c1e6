/* The bf16 sampler's linear layers on Intel AMX tiles: y = x W^T + b, bf16 in and out, float32
 * accumulation, rounded once.
 *
 * A decode step multiplies a few rows by every weight once, so it is bound by reading the
 * weights; oneDNN's packed bf16 linear read SmolLM2's 269 MB at about 14 GB/s at the bench's
 * 32 rows (20 ms a step, 121 linears, weights streamed from memory), this kernel at about
 * 19 (14 ms; docs/performance.md). The weight is packed once per `generate` into panels of 16
 * output columns, each a run of 1 KB tiles (32 inputs by 16 outputs, the pairs of inputs
 * side by side as TDPBF16PS reads them), so a panel is one sequential stream. Two panels at
 * a time and up to 32 rows: four accumulator tiles, two of rows, two of weights; every block
 * of 32 rows reuses a panel pair while it is in cache. Inputs of a multiple of 32 only.
 *
 * The tiles are per thread, and oneDNN and PyTorch use them on the same OpenMP threads: as
 * they do, each call loads its configuration on every thread it runs on and releases the
 * tiles when done (PyTorch's cpublas::brgemm skips reloading a configuration it believes
 * loaded until its users release it, which they do at the end of each parallel region).
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

long syscall(long number, ...);

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a state component's permission */
#define XFEATURE_XTILEDATA 18      /* the AMX tile data */

/* 1 when this process may use AMX tiles (Linux grants them on request, once per process). */
int postrl_amx_available(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* 16 rows of 16 32-bit values transposed in registers: at each scale the off-diagonal blocks
 * of every block twice that size are swapped, which at the four scales swaps each element's
 * row and column. */
static inline void transpose16x16(__m512i r[16]) {
    for (int s = 0; s < 4; s++) {
        int b = 1 << s;
        int32_t low[16], high[16];
        for (int j = 0; j < 16; j++) {
            low[j] = (j & b) ? 16 + j - b : j;
            high[j] = (j & b) ? 16 + j : j + b;
        }
        __m512i il = _mm512_loadu_si512(low), ih = _mm512_loadu_si512(high);
        for (int k = 0; k < 16; k++)
            if (!(k & b)) {
                __m512i x = r[k], y = r[k + b];
                r[k] = _mm512_permutex2var_epi32(x, il, y);
                r[k + b] = _mm512_permutex2var_epi32(x, ih, y);
            }
    }
}

/* w [n, k] bf16 (contiguous, k a multiple of 32) into packed: panels of 16 outputs (zeros past
 * n), each k / 32 tiles of 16 rows by 64 bytes; tile row i holds, for each of the panel's
 * outputs, its inputs 2i and 2i + 1 of the block. A block of W, 16 outputs by 16 input pairs,
 * is that tile transposed (pairs as 32-bit values). */
void postrl_amx_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + 15) / 16, blocks = k / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < panels * blocks; tile++) {
        int64_t p = tile / blocks, b = tile % blocks;
        __m512i r[16];
        for (int c = 0; c < 16; c++)
            r[c] = p * 16 + c < n ? _mm512_loadu_si512(w + (p * 16 + c) * k + b * 32)
                                  : _mm512_setzero_si512();
        transpose16x16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(packed + tile * 512 + i * 32, r[i]);
    }
}

/* Rows [m0, m0 + rows) of y times two panels (one when `two` is 0), rows <= 32, with the
 * tile configuration loaded for this row count; c: 4 * 256 floats of scratch. */
static inline void panel_pair(const uint16_t *x, int64_t m0, int rows, int64_t k,
                              const uint16_t *pa, int two, const uint16_t *bias, int64_t col,
                              int64_t n, uint16_t *y, float *c) {
    int64_t blocks = k / 32;
    const uint16_t *pb = pa + blocks * 512;
    int upper = rows > 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        for (int l = 0; l < 16; l++) { /* the panels' tiles two blocks ahead */
            _mm_prefetch((const char *)(pa + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
            if (two) _mm_prefetch((const char *)(pb + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
        }
        _tile_loadd(4, x + m0 * k + b * 32, k * 2);
        _tile_loadd(6, pa + b * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, pb + b * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (upper) {
            _tile_loadd(5, x + (m0 + 16) * k + b * 32, k * 2);
            _tile_dpbf16ps(1, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(2, c + 512, 64);
    if (upper) {
        _tile_stored(1, c + 256, 64);
        _tile_stored(3, c + 768, 64);
    }
    for (int h = 0; h <= two; h++) {
        int64_t first = col + 16 * h, count = n - first < 16 ? n - first : 16;
        __m512 add = bias ? load16(bias, first, 1, count) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            store16(y + (m0 + r) * n, first,
                    _mm512_add_ps(_mm512_loadu_ps(c + 512 * h + 16 * r), add), 1, count);
    }
}

static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    int low = rows < 16 ? rows : 16, high = rows > 16 ? rows - 16 : 1;
    for (int t = 0; t < 8; t++) cfg.bytes_per_row[t] = 64;
    cfg.rows[0] = cfg.rows[2] = cfg.rows[4] = low;   /* the rows' first 16: accumulators, x */
    cfg.rows[1] = cfg.rows[3] = cfg.rows[5] = high;  /* the next 16 */
    cfg.rows[6] = cfg.rows[7] = 16;                  /* the two panels' tiles */
    _tile_loadconfig(&cfg);
}

/* y [m, n] = x [m, k] W^T + bias (bias [n] or NULL), all bf16, W packed by postrl_amx_pack;
 * y and x contiguous. The panel pairs are split between the threads; each runs every block of
 * 32 rows through a pair before the next. */
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, blocks = k / 32;
#pragma omp parallel num_threads(threads) if (pairs > 1)
    {
        float c[4 * 256];
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < pairs; q++)
            for (int64_t m0 = 0; m0 < m; m0 += 32) {
                int rows = m - m0 < 32 ? (int)(m - m0) : 32;
                if (rows != configured) configure(configured = rows);
                panel_pair(x, m0, rows, k, packed + 2 * q * blocks * 512, 2 * q + 1 < panels,
                           bias, 32 * q, n, y, c);
            }
        if (configured >= 0) _tile_release();
    }
}

#else /* no AMX: the sampler keeps oneDNN's linears */
int postrl_amx_available(void) { return 0; }
void postrl_amx_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int threads) {
    (void)w; (void)packed; (void)n; (void)k; (void)threads;
}
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)bias; (void)n; (void)y; (void)threads;
}
#endif
