/* bf16 matrix products on Intel AMX tiles, float32 accumulation, rounded once where the
 * output is bf16: the bf16 sampler's linear layers, the update's linear gradients, and the
 * training attention, forward and backward (postrl_amx_attention_*: every product and the
 * softmax of one row and key/value head in one pass, in that core's cache).
 *
 * A decode step multiplies a few rows by every weight once, so it is bound by reading the
 * weights; oneDNN's packed bf16 linear read SmolLM2's 269 MB at about 14 GB/s at the bench's
 * 32 rows (20 ms a step, 121 linears, weights streamed from memory), this kernel at about
 * 19 (14 ms; docs/performance.md). The second operand is packed into panels of 16 output
 * columns, each a run of 1 KB tiles (32 inputs by 16 outputs, the pairs of inputs side by
 * side as TDPBF16PS reads them), so a panel is one sequential stream: a weight `[n, k]` once
 * per `generate` (postrl_bf16_pack), or a `[k, n]` matrix by each thread within the product,
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#ifdef __AVX512BW__ /* the packing: AMX tiles' layout, which VDPBF16PS reads too */
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

/* The tile of panel p, block b of w [n, k] (row stride ld, bf16) into dst (512 values): panels
 * of 16 outputs (zeros past n), each (k + 31) / 32 tiles of 16 rows by 64 bytes (zeros past
 * k); tile row i holds, for each of the panel's outputs, its inputs 2i and 2i + 1 of the
 * block. A block of w, 16 outputs by 16 input pairs, is that tile transposed (pairs as
 * 32-bit values). */
static inline void pack_nk_tile(const uint16_t *w, int64_t n, int64_t k, int64_t ld,
                                uint16_t *dst, int64_t p, int64_t b) {
    int64_t inputs = k - 32 * b;
    __mmask32 read = (__mmask32)(inputs >= 32 ? ~0u : (1u << inputs) - 1);
    __m512i r[16];
    for (int c = 0; c < 16; c++)
        r[c] = p * 16 + c < n ? _mm512_maskz_loadu_epi16(read, w + (p * 16 + c) * ld + b * 32)
                              : _mm512_setzero_si512();
    transpose16x16(r);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + i * 32, r[i]);
}

/* w [n, k] bf16 (contiguous, k a multiple of 32) into packed, pack_nk_tile's layout: the
 * sampler's weights, once per `generate`, for AMX tiles or VDPBF16PS (dpbf16.c). */
void postrl_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + 15) / 16, blocks = k / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < panels * blocks; tile++)
        pack_nk_tile(w, n, k, k, packed + tile * 512, tile / blocks, tile % blocks);
}

#else
void postrl_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int threads) {
    (void)w; (void)packed; (void)n; (void)k; (void)threads;
}
#endif

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

/* The tile of panel p, block `block` of b [k, n] (row stride ld, bf16) into dst (512
 * values), packed as pack_nk_tile packs b^T: panels of 16 columns (zeros past n), each
 * (k + 31) / 32 tiles (zeros past k); tile row i holds, for each of the panel's columns,
 * b's rows 2i and 2i + 1 of the block side by side. */
static inline void pack_kn_tile(const uint16_t *b, int64_t k, int64_t n, int64_t ld,
                                uint16_t *dst, int64_t p, int64_t block) {
    static const uint16_t order[32] = { /* lane 2c: the first row's column c, 2c + 1 the next's */
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    __m512i pairs = _mm512_loadu_si512(order);
    __mmask16 columns = lanes(n - 16 * p);
    for (int i = 0; i < 16; i++) {
        int64_t first = 32 * block + 2 * i;
        __m256i x = first < k ? _mm256_maskz_loadu_epi16(columns, b + first * ld + 16 * p)
                              : _mm256_setzero_si256();
        __m256i y = first + 1 < k
            ? _mm256_maskz_loadu_epi16(columns, b + (first + 1) * ld + 16 * p)
            : _mm256_setzero_si256();
        _mm512_storeu_si512(dst + i * 32,
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

/* Block `block` (32 by 32) of dst [c, ld_dst] := src [r, c]^T (bf16, src's row stride
 * ld_src), dst's columns from r to ld_dst zero. */
static inline void transpose_block(const uint16_t *src, int64_t r, int64_t c, int64_t ld_src,
                                   uint16_t *dst, int64_t ld_dst, int64_t block) {
    int64_t column_blocks = (c + 31) / 32, i = block / column_blocks, j = block % column_blocks;
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

/* dst [c, ld_dst] := src [r, c]^T (bf16, src's row stride ld_src), dst's columns from r to
 * ld_dst zero: the first operand of a product over src's rows, padded to the tiles' 32. */
void postrl_amx_transpose(const uint16_t *src, int64_t r, int64_t c, int64_t ld_src,
                          uint16_t *dst, int64_t ld_dst, int threads) {
    int64_t blocks = (ld_dst + 31) / 32 * ((c + 31) / 32);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < blocks; block++)
        transpose_block(src, r, c, ld_src, dst, ld_dst, block);
}

/* Rows [m0, m0 + rows) of a (row stride lda) times two panels (one when `two` is 0), rows <=
 * 32, with the tile configuration loaded for this row count; the products into c (4 * 256
 * floats: panel h's row r at c + 512 h + 16 r). With `at` (not NULL), block b's columns of a
 * are at[b] (row stride lds[b]) instead: a sum of products over their segments. */
static inline void panel_pair(const uint16_t *a, int64_t lda, int64_t m0, int rows, int64_t k,
                              const uint16_t *pa, int two, float *c,
                              const uint16_t *const *at, const int64_t *lds) {
    int64_t blocks = k / 32;
    const uint16_t *pb = pa + blocks * 512;
    int upper = rows > 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        for (int l = 0; l < 16; l++) { /* the panels' tiles two blocks ahead */
            _mm_prefetch((const char *)(pa + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
            if (two) _mm_prefetch((const char *)(pb + (b + 2) * 512) + 64 * l, _MM_HINT_T0);
        }
        const uint16_t *ab = at ? at[b] : a + b * 32;
        int64_t ld = at ? lds[b] : lda;
        _tile_loadd(4, ab + m0 * ld, ld * 2);
        _tile_loadd(6, pa + b * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, pb + b * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (upper) {
            _tile_loadd(5, ab + (m0 + 16) * ld, ld * 2);
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

void postrl_amx_gemm_sum(int segments, const uint16_t *const *a, const int64_t *lda,
                         const int64_t *k, const uint16_t *const *b, const int64_t *kb,
                         const int64_t *ldb, int64_t m, uint16_t *packed,
                         const uint16_t *bias, int64_t n, void *out, int64_t ldc, int mode,
                         int threads);

/* out [m, n] (row stride ldc) = a [m, k] (row stride lda) b (+ bias, bias [n] or NULL), b
 * packed by postrl_bf16_pack (b = W^T) or in pack_kn_tile's layout; `mode` as write_pair's.
 * The panel pairs are split between the threads in contiguous runs; each runs a chunk of a's
 * rows through every pair it owns, 32 rows at a time, before the next chunk. With `b` (not
 * NULL: b [kb, n], row stride ldb, kb <= k), `packed` is scratch: each thread first packs
 * the panels it owns, reading b's rows in order, so they are in its own cache when it runs
 * them (in the update, the linears' gradients took 0.87 of oneDNN's time this way, 0.93 with
 * all of b packed first, in one pass of its own). */
void postrl_amx_gemm(const uint16_t *a, int64_t lda, int64_t m, int64_t k, uint16_t *packed,
                     const uint16_t *b, int64_t kb, int64_t ldb, const uint16_t *bias,
                     int64_t n, void *out, int64_t ldc, int mode, int threads) {
    postrl_amx_gemm_sum(1, &a, &lda, &k, b ? &b : NULL, &kb, &ldb, m, packed, bias, n, out,
                        ldc, mode, threads);
}

/* out [m, n] = sum over `segments` s of a_s [m, k_s] (row stride lda_s, k_s a multiple of 32)
 * b_s [kb_s, n] (row stride ldb_s, rows past kb_s up to k_s zeros), + bias, as one product
 * over the segments' inner dimensions side by side: float32 sums in the tiles, written
 * once (a layer's input gradient over the linears that read its input: dy_q W_q + dy_k W_k
 * + dy_v W_v). b NULL: `packed` holds the packing of b already (one segment). */
void postrl_amx_gemm_sum(int segments, const uint16_t *const *a, const int64_t *lda,
                         const int64_t *k, const uint16_t *const *b, const int64_t *kb,
                         const int64_t *ldb, int64_t m, uint16_t *packed,
                         const uint16_t *bias, int64_t n, void *out, int64_t ldc, int mode,
                         int threads) {
    int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, blocks = 0;
    for (int s = 0; s < segments; s++) blocks += k[s] / 32;
    int64_t width = 32 * blocks; /* the inner dimension in all */
    int64_t chunk = 32 * (CHUNK_BYTES / (64 * width) > 1 ? CHUNK_BYTES / (64 * width) : 1);
    enum { ON_STACK = 128 }; /* blocks: beyond them (an inner dimension past 4,096) malloc */
    const uint16_t *at_stack[ON_STACK], *bt_stack[ON_STACK];
    int64_t lds_stack[3 * ON_STACK];
    int heap = blocks > ON_STACK;
    const uint16_t **at = heap ? malloc((size_t)blocks * sizeof *at) : at_stack; /* each */
    const uint16_t **bt = heap ? malloc((size_t)blocks * sizeof *bt) : bt_stack; /* block's */
    int64_t *lds = heap ? malloc((size_t)blocks * 3 * sizeof *lds) : lds_stack; /* a, b */
    int64_t *rows_b = lds + blocks, *ldbs = rows_b + blocks;
    for (int s = 0, block = 0; s < segments; s++)
        for (int64_t j = 0; j < k[s] / 32; j++, block++) {
            at[block] = a[s] + 32 * j, lds[block] = lda[s];
            if (b) bt[block] = b[s] + 32 * j * ldb[s], rows_b[block] = kb[s] - 32 * j,
                   ldbs[block] = ldb[s];
        }
    const uint16_t *const *table = segments > 1 ? at : NULL;
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
                    pack_kn_tile(bt[block], rows_b[block], n, ldbs[block],
                                 packed + (p * blocks + block) * 512, p, 0);
        for (int64_t start = 0; start < m; start += chunk) {
            int64_t end = start + chunk < m ? start + chunk : m;
            for (int64_t q = first; q < last; q++) {
                int two = 2 * q + 1 < panels;
                for (int64_t m0 = start; m0 < end; m0 += 32) {
                    int rows = end - m0 < 32 ? (int)(end - m0) : 32;
                    if (rows != configured) configure(configured = rows);
                    panel_pair(a[0], lda[0], m0, rows, width, packed + 2 * q * blocks * 512,
                               two, c, table, lds);
                    write_pair(c, m0, rows, two, 32 * q, n, bias, out, ldc, mode);
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
    if (heap) {
        free(at);
        free(bt);
        free(lds);
    }
}

/* y [m, n] = x [m, k] W^T + bias (bias [n] or NULL), all bf16, W packed by postrl_bf16_pack;
 * y and x contiguous (dpbf16.c's postrl_bf16_linear calls it where the tiles serve). */
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    postrl_amx_gemm(x, k, m, k, (uint16_t *)packed, NULL, 0, 0, bias, n, y, n, AMX_BF16,
                    threads);
}

/* b [k, n] packed into tiles for a product over k: b's (r, c) at b + r * br + c * bc, one
 * of the two strides 1 (pack_kn_tile's rows, or pack_nk_tile's transposed rows). */
static void pack_any(const uint16_t *b, int64_t br, int64_t bc, int64_t k, int64_t n,
                     uint16_t *packed) {
    int64_t blocks = (k + 31) / 32, tiles = (n + 15) / 16 * blocks;
    for (int64_t tile = 0; tile < tiles; tile++)
        if (bc == 1) pack_kn_tile(b, k, n, br, packed + tile * 512, tile / blocks, tile % blocks);
        else pack_nk_tile(b, n, k, bc, packed + tile * 512, tile / blocks, tile % blocks);
}

/* out [m, n] (row stride ldo) := x [m, k] (row stride lda, k a multiple of 32) times b packed
 * by pack_any, on this thread, `mode` as write_pair's; *configured: the rows the tiles are
 * configured for (-1: none yet). */
static void product_rows(const uint16_t *x, int64_t lda, int64_t m, int64_t k,
                         const uint16_t *packed, int64_t n, void *out, int64_t ldo, int mode,
                         int *configured) {
    int64_t panels = (n + 15) / 16, blocks = k / 32;
    float c[4 * 256];
    for (int64_t m0 = 0; m0 < m; m0 += 32) {
        int count = m - m0 < 32 ? (int)(m - m0) : 32;
        if (count != *configured) configure(*configured = count);
        for (int64_t q = 0; q < (panels + 1) / 2; q++) {
            int two = 2 * q + 1 < panels;
            panel_pair(x, lda, m0, count, k, packed + 2 * q * blocks * 512, two, c, NULL, NULL);
            write_pair(c, m0, count, two, 32 * q, n, NULL, out, ldo, mode);
        }
    }
}

/* dst [c, ld_dst] := src [r, c]^T, zeros past r: postrl_amx_transpose on this thread. */
static void transpose_all(const uint16_t *src, int64_t r, int64_t c, int64_t ld_src,
                          uint16_t *dst, int64_t ld_dst) {
    int64_t blocks = (ld_dst + 31) / 32 * ((c + 31) / 32);
    for (int64_t block = 0; block < blocks; block++)
        transpose_block(src, r, c, ld_src, dst, ld_dst, block);
}

#define ROUND32(x) (((x) + 31) / 32 * 32)

/* lo and hi, 32 values, rounded to bf16 (to nearest, ties to even) into dst: one instruction
 * with AVX512-BF16 (which flushes subnormal values to 0: below 1.2e-38), else store16's. */
static inline void store32(uint16_t *dst, __m512 lo, __m512 hi) {
#ifdef __AVX512BF16__
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
    store16(dst, 0, lo, 1, 16);
    store16(dst, 16, hi, 1, 16);
#endif
}

/* Values in the larger of an item's two packings: keys^T or values^T (columns panels, dim
 * deep), or an operand of dim columns `deepest` deep (padded to 32). */
static int64_t attention_packing(int64_t columns, int64_t dim, int64_t deepest) {
    int64_t across = (columns + 15) / 16 * (dim / 32), down = (dim + 15) / 16 * (deepest / 32);
    return (across > down ? across : down) * 512;
}

/* The training attention of one micro-batch, forward: for each row b and key/value head h,
 * its `group` query heads' rows q [group * width, dim] over keys and values [columns, dim]:
 * weights = softmax(scale * q k^T + bias[b]) (float32 scores, each query row w of a head
 * with the bias row w; rounded to bf16 and kept for the backward), out = weights v rounded
 * to bf16, written where the output projection reads it: out [rows, width, heads * dim].
 * q [rows, heads, width, dim], keys and values [rows, kv_heads, columns, dim], bias [rows,
 * width, columns], weights [rows, heads, width, columns], all contiguous bf16; dim a multiple
 * of 32. Each thread takes whole (b, h) items: the scores never leave its cache. */
void postrl_amx_attention_forward(const uint16_t *q, const uint16_t *keys,
                                  const uint16_t *values, const uint16_t *bias,
                                  uint16_t *weights, uint16_t *out, int64_t rows,
                                  int64_t heads, int64_t kv_heads, int64_t width,
                                  int64_t columns, int64_t dim, float scale, int threads) {
    int64_t group = heads / kv_heads, lines = group * width, padded = ROUND32(columns);
    int64_t items = rows * kv_heads;
    int64_t packed_size = attention_packing(columns, dim, padded);
    if (items < threads) threads = (int)items;
#pragma omp parallel num_threads(threads)
    {
        float *z = aligned_alloc(64, (size_t)(lines * padded * 4));
        uint16_t *p = aligned_alloc(64, (size_t)(lines * padded * 2));
        uint16_t *packed = aligned_alloc(64, (size_t)(packed_size * 2));
        int configured = -1;
        __m512 vscale = _mm512_set1_ps(scale);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            int64_t b = item / kv_heads, h = item % kv_heads;
            const uint16_t *qi = q + item * lines * dim;
            const uint16_t *k = keys + item * columns * dim, *v = values + item * columns * dim;
            uint16_t *wi = weights + item * lines * columns;
            pack_any(k, 1, dim, dim, columns, packed); /* k^T [dim, columns] */
            product_rows(qi, dim, lines, dim, packed, columns, z, padded, AMX_FLOAT,
                         &configured);
            for (int64_t r = 0; r < lines; r++) {
                const uint16_t *bi = bias + (b * width + r % width) * columns;
                float *zr = z + r * padded;
                __m512 most = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
                for (int64_t i = 0; i < columns; i += 16) {
                    __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(zr + i), vscale,
                                               load16(bi, i, 1, columns - i));
                    _mm512_storeu_ps(zr + i, x);
                    most = _mm512_max_ps(most, _mm512_mask_mov_ps(most, lanes(columns - i), x));
                }
                __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(most));
                for (int64_t i = 0; i < columns; i += 16) { /* exp16 is 0 below -87: */
                    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(zr + i), top); /* masked keys */
                    __mmask16 live = lanes(columns - i)
                        & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
                    __m512 e = live ? _mm512_maskz_mov_ps(live, exp16(x)) : _mm512_setzero_ps();
                    _mm512_storeu_ps(zr + i, e);
                    sum = _mm512_add_ps(sum, e);
                }
                __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
                for (int64_t i = 0; i < padded; i += 32) /* zeros past columns */
                    store32(p + r * padded + i,
                            _mm512_maskz_mul_ps(lanes(columns - i), _mm512_loadu_ps(zr + i),
                                                inverse),
                            _mm512_maskz_mul_ps(lanes(columns - i - 16),
                                                _mm512_loadu_ps(zr + i + 16), inverse));
                for (int64_t i = 0; i < columns; i += 32) /* the weights kept */
                    _mm512_mask_storeu_epi16(wi + r * columns + i, (__mmask32)(columns - i >= 32
                        ? ~0u : (1u << (columns - i)) - 1), _mm512_loadu_si512(p + r * padded + i));
            }
            pack_any(v, dim, 1, columns, dim, packed);
            for (int64_t g = 0; g < group; g++) /* head h * group + g's rows */
                product_rows(p + g * width * padded, padded, width, padded, packed, dim,
                             out + b * width * heads * dim + (h * group + g) * dim, heads * dim,
                             AMX_BF16, &configured);
        }
        if (configured >= 0) _tile_release();
        free(z);
        free(p);
        free(packed);
    }
}

/* Its backward, for grad [rows, width, heads * dim] (contiguous), the forward's inputs and
 * weights: dq [rows, heads, width, dim], dkeys and dvalues [rows, kv_heads, columns, dim]
 * (bf16, written whole). Per item: dp = dout v^T (float32), ds = scale * p (dp - sum_j p_j
 * dp_j) (rounded to bf16), dq = ds k, dk = ds^T q, dv = p^T dout. */
void postrl_amx_attention_backward(const uint16_t *grad, const uint16_t *q,
                                   const uint16_t *keys, const uint16_t *values,
                                   const uint16_t *weights, uint16_t *dq, uint16_t *dkeys,
                                   uint16_t *dvalues, int64_t rows, int64_t heads,
                                   int64_t kv_heads, int64_t width, int64_t columns,
                                   int64_t dim, float scale, int threads) {
    int64_t group = heads / kv_heads, lines = group * width, padded = ROUND32(columns);
    int64_t tall = ROUND32(lines), items = rows * kv_heads;
    int64_t packed_size = attention_packing(columns, dim, padded > tall ? padded : tall);
    if (items < threads) threads = (int)items;
#pragma omp parallel num_threads(threads)
    {
        float *dp = aligned_alloc(64, (size_t)(lines * padded * 4));
        uint16_t *ds = aligned_alloc(64, (size_t)(lines * padded * 2));
        uint16_t *across = aligned_alloc(64, (size_t)(padded * tall * 2)); /* a transpose */
        uint16_t *dout = aligned_alloc(64, (size_t)(lines * dim * 2));
        uint16_t *packed = aligned_alloc(64, (size_t)(packed_size * 2));
        int configured = -1;
        __m512 vscale = _mm512_set1_ps(scale);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            int64_t b = item / kv_heads, h = item % kv_heads;
            const uint16_t *qi = q + item * lines * dim, *wi = weights + item * lines * columns;
            const uint16_t *k = keys + item * columns * dim, *v = values + item * columns * dim;
            for (int64_t g = 0; g < group; g++) /* this item's rows of grad, head by head */
                for (int64_t w = 0; w < width; w++)
                    memcpy(dout + (g * width + w) * dim,
                           grad + (b * width + w) * heads * dim + (h * group + g) * dim,
                           (size_t)dim * 2);
            pack_any(v, 1, dim, dim, columns, packed); /* v^T [dim, columns] */
            product_rows(dout, dim, lines, dim, packed, columns, dp, padded, AMX_FLOAT,
                         &configured);
            for (int64_t r = 0; r < lines; r++) {
                const uint16_t *pr = wi + r * columns;
                float *dr = dp + r * padded;
                __m512 dot = _mm512_setzero_ps();
                for (int64_t i = 0; i < columns; i += 16)
                    dot = _mm512_fmadd_ps(load16(pr, i, 1, columns - i),
                                          _mm512_maskz_loadu_ps(lanes(columns - i), dr + i), dot);
                __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(dot));
                __m512 x[2];
                for (int64_t i = 0; i < padded; i += 16) { /* zeros past columns: p is 0 */
                    x[i / 16 % 2] = _mm512_mul_ps(_mm512_mul_ps(load16(pr, i, 1, columns - i),
                        _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes(columns - i), dr + i), total)),
                        vscale);
                    if (i % 32) store32(ds + r * padded + i - 16, x[0], x[1]);
                }
            }
            pack_any(k, dim, 1, columns, dim, packed);
            product_rows(ds, padded, lines, padded, packed, dim, dq + item * lines * dim, dim,
                         AMX_BF16, &configured);
            transpose_all(ds, lines, columns, padded, across, tall); /* ds^T [columns, tall] */
            pack_any(qi, dim, 1, lines, dim, packed);
            product_rows(across, tall, columns, tall, packed, dim, dkeys + item * columns * dim,
                         dim, AMX_BF16, &configured);
            transpose_all(wi, lines, columns, columns, across, tall); /* p^T */
            pack_any(dout, dim, 1, lines, dim, packed);
            product_rows(across, tall, columns, tall, packed, dim,
                         dvalues + item * columns * dim, dim, AMX_BF16, &configured);
        }
        if (configured >= 0) _tile_release();
        free(dp);
        free(ds);
        free(across);
        free(dout);
        free(packed);
    }
}

#else /* no AMX: the update keeps oneDNN's matmuls, the sampler dpbf16.c's or oneDNN's */
int postrl_amx_available(void) { return 0; }
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
void postrl_amx_attention_forward(const uint16_t *q, const uint16_t *keys,
                                  const uint16_t *values, const uint16_t *bias,
                                  uint16_t *weights, uint16_t *out, int64_t rows,
                                  int64_t heads, int64_t kv_heads, int64_t width,
                                  int64_t columns, int64_t dim, float scale, int threads) {
    (void)q; (void)keys; (void)values; (void)bias; (void)weights; (void)out; (void)rows;
    (void)heads; (void)kv_heads; (void)width; (void)columns; (void)dim; (void)scale;
    (void)threads;
}
void postrl_amx_attention_backward(const uint16_t *grad, const uint16_t *q,
                                   const uint16_t *keys, const uint16_t *values,
                                   const uint16_t *weights, uint16_t *dq, uint16_t *dkeys,
                                   uint16_t *dvalues, int64_t rows, int64_t heads,
                                   int64_t kv_heads, int64_t width, int64_t columns,
                                   int64_t dim, float scale, int threads) {
    (void)grad; (void)q; (void)keys; (void)values; (void)weights; (void)dq; (void)dkeys;
    (void)dvalues; (void)rows; (void)heads; (void)kv_heads; (void)width; (void)columns;
    (void)dim; (void)scale; (void)threads;
}
void postrl_amx_gemm_sum(int segments, const uint16_t *const *a, const int64_t *lda,
                         const int64_t *k, const uint16_t *const *b, const int64_t *kb,
                         const int64_t *ldb, int64_t m, uint16_t *packed,
                         const uint16_t *bias, int64_t n, void *out, int64_t ldc, int mode,
                         int threads) {
    (void)segments; (void)a; (void)lda; (void)k; (void)b; (void)kb; (void)ldb; (void)m;
    (void)packed; (void)bias; (void)n; (void)out; (void)ldc; (void)mode; (void)threads;
}
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)bias; (void)n; (void)y; (void)threads;
}
#endif
