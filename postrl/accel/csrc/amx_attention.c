/* The training attention of a bf16 micro-batch on AMX tiles, forward and backward
 * (postrl.accel.tile_attention binds them): for each row and key/value head, every product
 * and the softmax in one pass, in that core's cache; the products as amx_gemm.c's. */
#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
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


#else /* no AMX: the update keeps PyTorch's attention */
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
#endif
