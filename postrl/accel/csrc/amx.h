/* amx.h: what amx_gemm.c and amx_attention.c share: the tiles' packing and transpositions,
 * the tile configuration and the two-panel product (static: each file gets its own copy).
 * The products' design is in amx_gemm.c's opening comment. */
#ifndef POSTRL_AMX_H
#define POSTRL_AMX_H

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

#endif /* __AVX512BW__ */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

long syscall(long number, ...);

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a state component's permission */
#define XFEATURE_XTILEDATA 18      /* the AMX tile data */

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

#endif /* AMX */

#endif /* POSTRL_AMX_H */
