/* bf16 matrix products on Intel AMX tiles, float32 accumulation, rounded once where the
 * output is bf16: the bf16 sampler's linear layers, and the update's linear gradients.
 *
 * A decode step multiplies a few rows by every weight once, so it is bound by reading the
 * weights; oneDNN's packed bf16 linear read SmolLM2's 269 MB at about 14 GB/s at the bench's
 * 32 rows (20 ms a step, 121 linears, weights streamed from memory), this kernel at about
 * 19 (14 ms; docs/performance.md). The second operand is packed into panels of 16 output
 * columns, each a run of 1 KB tiles (32 inputs by 16 outputs, the pairs of inputs side by
 * side as TDPBF16PS reads them), so a panel is one sequential stream: a weight `[n, k]` once
 * per `generate` (postrl_amx_pack), or a `[k, n]` matrix by each thread within the product,
 * the panels it owns (postrl_amx_gemm: a weight for its input gradient, a layer's input for
 * its weight gradient; the panels then stay in that core's cache). Two panels at a time and
 * up to 32 rows: four accumulator tiles, two of rows, two of panels. Rows go in chunks that
 * stay in the core's L2 cache while every panel pair a thread owns passes over them. Inner
 * dimensions of a multiple of 32 only (postrl_amx_transpose pads a transposed operand with
 * zeros).
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
#include <omp.h>
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

/* Tile `tile` (panel tile / blocks, block tile % blocks) of b [k, n] (row stride ld, bf16)
 * packed as postrl_amx_pack packs b^T: panels of 16 columns (zeros past n), each
 * blocks = (k + 31) / 32 tiles (zeros past k); tile row i holds, for each of the panel's
 * columns, b's rows 2i and 2i + 1 of the block side by side. */
static inline void pack_kn_tile(const uint16_t *b, int64_t k, int64_t n, int64_t ld,
                                uint16_t *packed, int64_t tile, int64_t blocks) {
    static const uint16_t order[32] = { /* lane 2c: the first row's column c, 2c + 1 the next's */
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    __m512i pairs = _mm512_loadu_si512(order);
    int64_t p = tile / blocks, block = tile % blocks;
    __mmask16 columns = lanes(n - 16 * p);
    for (int i = 0; i < 16; i++) {
        int64_t first = 32 * block + 2 * i;
        __m256i x = first < k ? _mm256_maskz_loadu_epi16(columns, b + first * ld + 16 * p)
                              : _mm256_setzero_si256();
        __m256i y = first + 1 < k
            ? _mm256_maskz_loadu_epi16(columns, b + (first + 1) * ld + 16 * p)
            : _mm256_setzero_si256();
        _mm512_storeu_si512(packed + tile * 512 + i * 32,
                            _mm512_permutex2var_epi16(_mm512_zextsi256_si512(x), pairs,
                                                      _mm512_zextsi256_si512(y)));
    }
}

/* 32 rows of 32 16-bit values transposed in registers, as transpose16x16 does 32-bit ones. */
static inline void transpose32x32(__m512i r[32]) {
    for (int s = 0; s < 5; s++) {
        int b = 1 << s;
        uint16_t low[32], high[32];
        for (int j = 0; j < 32; j++) {
            low[j] = (uint16_t)((j & b) ? 32 + j - b : j);
            high[j] = (uint16_t)((j & b) ? 32 + j : j + b);
        }
        __m512i il = _mm512_loadu_si512(low), ih = _mm512_loadu_si512(high);
        for (int k = 0; k < 32; k++)
            if (!(k & b)) {
                __m512i x = r[k], y = r[k + b];
                r[k] = _mm512_permutex2var_epi16(x, il, y);
                r[k + b] = _mm512_permutex2var_epi16(x, ih, y);
            }
    }
}

/* dst [c, ld_dst] := src [r, c]^T (bf16, src's row stride ld_src), dst's columns from r to
 * ld_dst zero: the first operand of a product over src's rows, padded to the tiles' 32. */
void postrl_amx_transpose(const uint16_t *src, int64_t r, int64_t c, int64_t ld_src,
                          uint16_t *dst, int64_t ld_dst, int threads) {
    int64_t row_blocks = (ld_dst + 31) / 32, column_blocks = (c + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < row_blocks * column_blocks; block++) {
        int64_t i = block / column_blocks, j = block % column_blocks;
        int64_t columns = c - 32 * j < 32 ? c - 32 * j : 32;
        int64_t width = ld_dst - 32 * i < 32 ? ld_dst - 32 * i : 32;
        __mmask32 read = (__mmask32)(columns == 32 ? ~0u : (1u << columns) - 1);
        __mmask32 write = (__mmask32)(width == 32 ? ~0u : (1u << width) - 1);
        __m512i v[32];
        for (int t = 0; t < 32; t++)
            v[t] = 32 * i + t < r
                ? _mm512_maskz_loadu_epi16(read, src + (32 * i + t) * ld_src + 32 * j)
                : _mm512_setzero_si512();
        transpose32x32(v);
        for (int t = 0; t < columns; t++)
            _mm512_mask_storeu_epi16(dst + (32 * j + t) * ld_dst + 32 * i, write, v[t]);
    }
}

/* Rows [m0, m0 + rows) of a (row stride lda) times two panels (one when `two` is 0), rows <=
 * 32, with the tile configuration loaded for this row count; the products into c (4 * 256
 * floats: panel h's row r at c + 512 h + 16 r). */
static inline void panel_pair(const uint16_t *a, int64_t lda, int64_t m0, int rows, int64_t k,
                              const uint16_t *pa, int two, float *c) {
    int64_t blocks = k / 32;
    const uint16_t *pb = pa + blocks * 512;
    int upper = rows > 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        for (int l = 0; l < 16; l++) { /* the panels' tiles two blocks ahead */
            _mm_prefetch((const char *)(pa + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
            if (two) _mm_prefetch((const char *)(pb + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
        }
        _tile_loadd(4, a + m0 * lda + b * 32, lda * 2);
        _tile_loadd(6, pa + b * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, pb + b * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (upper) {
            _tile_loadd(5, a + (m0 + 16) * lda + b * 32, lda * 2);
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
}

/* panel_pair's products at columns [col, col + 32) of rows [m0, m0 + rows) of out (row stride
 * ldc): plus bias and rounded to bf16 (AMX_BF16), or float32 stored (AMX_FLOAT) or added to
 * what out holds (AMX_FLOAT_ADD). */
enum { AMX_BF16 = 0, AMX_FLOAT = 1, AMX_FLOAT_ADD = 2 };

static inline void write_pair(const float *c, int64_t m0, int rows, int two, int64_t col,
                              int64_t n, const uint16_t *bias, void *out, int64_t ldc,
                              int mode) {
    for (int h = 0; h <= two; h++) {
        int64_t first = col + 16 * h, count = n - first < 16 ? n - first : 16;
        __m512 add = bias ? load16(bias, first, 1, count) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + 512 * h + 16 * r), add);
            if (mode == AMX_BF16) {
                store16((uint16_t *)out + (m0 + r) * ldc, first, v, 1, count);
            } else {
                float *y = (float *)out + (m0 + r) * ldc + first;
                if (mode == AMX_FLOAT_ADD) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes(count), y));
                _mm512_mask_storeu_ps(y, lanes(count), v);
            }
        }
    }
}

static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    int low = rows < 16 ? rows : 16, high = rows > 16 ? rows - 16 : 1;
    for (int t = 0; t < 8; t++) cfg.bytes_per_row[t] = 64;
    cfg.rows[0] = cfg.rows[2] = cfg.rows[4] = low;   /* the rows' first 16: accumulators, a */
    cfg.rows[1] = cfg.rows[3] = cfg.rows[5] = high;  /* the next 16 */
    cfg.rows[6] = cfg.rows[7] = 16;                  /* the two panels' tiles */
    _tile_loadconfig(&cfg);
}

#define CHUNK_BYTES (128 * 1024) /* a chunk of rows of a (32-96 rows at the update's shapes) */

/* out [m, n] (row stride ldc) = a [m, k] (row stride lda) b (+ bias, bias [n] or NULL), b
 * packed by postrl_amx_pack (b = W^T) or in pack_kn_tile's layout; `mode` as write_pair's.
 * The panel pairs are split between the threads in contiguous runs; each runs a chunk of a's
 * rows through every pair it owns, 32 rows at a time, before the next chunk. With `b` (not
 * NULL: b [kb, n], row stride ldb, kb <= k), `packed` is scratch: each thread first packs
 * the panels it owns, reading b's rows in order, so they are in its own cache when it runs
 * them (in the update, the linears' gradients took 0.87 of oneDNN's time this way, 0.93 with
 * all of b packed first, in one pass of its own). */
void postrl_amx_gemm(const uint16_t *a, int64_t lda, int64_t m, int64_t k, uint16_t *packed,
                     const uint16_t *b, int64_t kb, int64_t ldb, const uint16_t *bias,
                     int64_t n, void *out, int64_t ldc, int mode, int threads) {
    int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, blocks = k / 32;
    int64_t chunk = 32 * (CHUNK_BYTES / (64 * k) > 1 ? CHUNK_BYTES / (64 * k) : 1);
    if (pairs < threads) threads = (int)pairs;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        int64_t first = pairs * t / count, last = pairs * (t + 1) / count;
        float c[4 * 256];
        int configured = -1;
        if (b) /* this thread's panels, b's rows in order */
            for (int64_t block = 0; block < blocks; block++)
                for (int64_t p = 2 * first; p < 2 * last && p < panels; p++)
                    pack_kn_tile(b, kb, n, ldb, packed, p * blocks + block, blocks);
        for (int64_t start = 0; start < m; start += chunk) {
            int64_t end = start + chunk < m ? start + chunk : m;
            for (int64_t q = first; q < last; q++) {
                int two = 2 * q + 1 < panels;
                for (int64_t m0 = start; m0 < end; m0 += 32) {
                    int rows = end - m0 < 32 ? (int)(end - m0) : 32;
                    if (rows != configured) configure(configured = rows);
                    panel_pair(a, lda, m0, rows, k, packed + 2 * q * blocks * 512, two, c);
                    write_pair(c, m0, rows, two, 32 * q, n, bias, out, ldc, mode);
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
}

/* y [m, n] = x [m, k] W^T + bias (bias [n] or NULL), all bf16, W packed by postrl_amx_pack;
 * y and x contiguous. */
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    postrl_amx_gemm(x, k, m, k, (uint16_t *)packed, NULL, 0, 0, bias, n, y, n, AMX_BF16,
                    threads);
}

#else /* no AMX: the sampler and the update keep oneDNN's matmuls */
int postrl_amx_available(void) { return 0; }
void postrl_amx_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int threads) {
    (void)w; (void)packed; (void)n; (void)k; (void)threads;
}
void postrl_amx_transpose(const uint16_t *src, int64_t r, int64_t c, int64_t ld_src,
                          uint16_t *dst, int64_t ld_dst, int threads) {
    (void)src; (void)r; (void)c; (void)ld_src; (void)dst; (void)ld_dst; (void)threads;
}
void postrl_amx_gemm(const uint16_t *a, int64_t lda, int64_t m, int64_t k, uint16_t *packed,
                     const uint16_t *b, int64_t kb, int64_t ldb, const uint16_t *bias,
                     int64_t n, void *out, int64_t ldc, int mode, int threads) {
    (void)a; (void)lda; (void)m; (void)k; (void)packed; (void)b; (void)kb; (void)ldb;
    (void)bias; (void)n; (void)out; (void)ldc; (void)mode; (void)threads;
}
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)bias; (void)n; (void)y; (void)threads;
}
#endif
