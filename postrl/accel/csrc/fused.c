/* The training forward's RMSNorm, SiLU(gate) * up, rotary embedding and the attention's
 * scaled, biased softmax, forward and backward, in float32 or bf16, AVX-512 (or AVX2): one
 * pass over a row where PyTorch runs several operations, each of which reads and writes the
 * whole micro-batch (and, in bf16, rounds and converts between them).
 *
 * The maths is transformers' (postrl/models/layers.py): RMSNorm normalises in float32 and
 * rounds the normalised row to the input's dtype before multiplying by the weight; SiLU's
 * output is rounded before it multiplies `up`. Backward passes compute in float32 from the
 * stored inputs and round once, at the end (PyTorch's autograd also rounds some of the
 * intermediate products to bf16). bf16 is stored as the upper half of a float32 and rounded
 * to nearest, ties to even, as PyTorch rounds it.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "simd.h"

/* 1 / sqrt(mean(x^2) + eps) of one row of `width`. */
static inline float inverse_rms(const void *x, int64_t width, float eps, int bf16) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < width; i += 16) {
        __m512 v = load16(x, i, bf16, width - i);
        sum = _mm512_fmadd_ps(v, v, sum);
    }
    return 1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)width + eps);
}

static inline void norm_forward_row(const void *x, const void *weight, void *y, float *scale,
                                    int64_t width, float eps, int bf16) {
    float s = inverse_rms(x, width, eps, bf16);
    *scale = s;
    __m512 vs = _mm512_set1_ps(s);
    for (int64_t i = 0; i < width; i += 16) {
        __m512 normed = round16(_mm512_mul_ps(load16(x, i, bf16, width - i), vs), bf16);
        store16(y, i, _mm512_mul_ps(normed, load16(weight, i, bf16, width - i)), bf16, width - i);
    }
}

/* y[r] = weight * round(x[r] * s[r]), s[r] = 1 / sqrt(mean(x[r]^2) + eps), written to
 * `scale[r]`; rows of `width`, contiguous. */
void postrl_norm_forward(const void *x, const void *weight, void *y, float *scale, int64_t rows,
                         int64_t width, float eps, int bf16, int threads) {
    int64_t size = element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++)
        norm_forward_row((const char *)x + r * width * size, weight,
                         (char *)y + r * width * size, scale + r, width, eps, bf16);
}

/* One row's dx, and its terms of dweight added into `dweight` (float32; NULL: none):
 * n = x s, dn = dy weight, dx = s (dn - n mean(dn n)), dweight += dy round(n). */
static inline void norm_backward_row(const void *dy, const void *x, const void *weight, float s,
                                     void *dx, float *dweight, int64_t width, int bf16) {
    __m512 vs = _mm512_set1_ps(s), dot = _mm512_setzero_ps();
    for (int64_t i = 0; i < width; i += 16) {
        int64_t count = width - i;
        __m512 n = _mm512_mul_ps(load16(x, i, bf16, count), vs), g = load16(dy, i, bf16, count);
        dot = _mm512_fmadd_ps(_mm512_mul_ps(g, load16(weight, i, bf16, count)), n, dot);
        if (dweight) {
            __mmask16 m = lanes(count);
            __m512 sum = _mm512_fmadd_ps(g, round16(n, bf16),
                                         _mm512_maskz_loadu_ps(m, dweight + i));
            _mm512_mask_storeu_ps(dweight + i, m, sum);
        }
    }
    __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(dot) / (float)width);
    for (int64_t i = 0; i < width; i += 16) {
        int64_t count = width - i;
        __m512 n = _mm512_mul_ps(load16(x, i, bf16, count), vs);
        __m512 dn = _mm512_mul_ps(load16(dy, i, bf16, count), load16(weight, i, bf16, count));
        store16(dx, i, _mm512_mul_ps(vs, _mm512_fnmadd_ps(n, mean, dn)), bf16, count);
    }
}

/* The backward of postrl_norm_forward: dx (rows of `width`, contiguous) and, unless `dweight`
 * is NULL, dweight's terms: thread t adds its rows' into `dweight + t * width` (float32,
 * `threads` rows of `width`: zero them first, then sum them). */
void postrl_norm_backward(const void *dy, const void *x, const void *weight, const float *scale,
                          void *dx, float *dweight, int64_t rows, int64_t width, int bf16,
                          int threads) {
    int64_t size = element_size(bf16);
#pragma omp parallel num_threads(threads) if (rows * width > 65536)
    {
        float *own = dweight ? dweight + omp_get_thread_num() * width : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t at = r * width * size;
            norm_backward_row((const char *)dy + at, (const char *)x + at, weight, scale[r],
                              (char *)dx + at, own, width, bf16);
        }
    }
}

/* 1 / (1 + e^-g), 16 lanes: the reciprocal by its 14-bit estimate and a Newton step (relative
 * error about 2^-28) instead of a division (the same time here: the kernel is bound by its
 * exponential and conversions). */
static inline __m512 sigmoid(__m512 g) {
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    __m512 r = _mm512_rcp14_ps(d);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, one), r);
}

/* h[r] = round(SiLU(gate[r])) * up[r]; gate and up rows `gate_stride` and `up_stride`
 * elements apart, h's contiguous, all `width` wide. */
void postrl_swiglu_forward(const void *gate, int64_t gate_stride, const void *up,
                           int64_t up_stride, void *h, int64_t rows, int64_t width, int bf16,
                           int threads) {
    int64_t size = element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate + r * gate_stride * size;
        const char *u = (const char *)up + r * up_stride * size;
        char *out = (char *)h + r * width * size;
        for (int64_t i = 0; i < width; i += 16) {
            int64_t count = width - i;
            __m512 x = load16(g, i, bf16, count);
            __m512 silu = round16(_mm512_mul_ps(x, sigmoid(x)), bf16);
            store16(out, i, _mm512_mul_ps(silu, load16(u, i, bf16, count)), bf16, count);
        }
    }
}

/* The backward of postrl_swiglu_forward: dup = dh round(SiLU(g)), dgate = dh up SiLU'(g),
 * SiLU'(g) = s (1 + g (1 - s)) with s the sigmoid; dh, dgate and dup contiguous. */
void postrl_swiglu_backward(const void *dh, const void *gate, int64_t gate_stride,
                            const void *up, int64_t up_stride, void *dgate, void *dup,
                            int64_t rows, int64_t width, int bf16, int threads) {
    int64_t size = element_size(bf16);
    __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate + r * gate_stride * size;
        const char *u = (const char *)up + r * up_stride * size;
        int64_t at = r * width * size;
        for (int64_t i = 0; i < width; i += 16) {
            int64_t count = width - i;
            __m512 x = load16(g, i, bf16, count), d = load16((const char *)dh + at, i, bf16, count);
            __m512 s = sigmoid(x);
            __m512 silu = round16(_mm512_mul_ps(x, s), bf16);
            store16((char *)dup + at, i, _mm512_mul_ps(d, silu), bf16, count);
            __m512 slope = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
            __m512 dg = _mm512_mul_ps(_mm512_mul_ps(d, load16(u, i, bf16, count)), slope);
            store16((char *)dgate + at, i, dg, bf16, count);
        }
    }
}

/* The attention's weights: out = round(softmax(scale * scores + bias)) over each row of
 * `columns`, in float32. scores and out are [rows, heads, width, columns], bias is
 * [rows, width, columns] (the same for every head), all contiguous. */
void postrl_softmax_forward(const void *scores, const void *bias, void *out, int64_t rows,
                            int64_t heads, int64_t width, int64_t columns, float scale,
                            int bf16, int threads) {
    int64_t size = element_size(bf16), lines = rows * heads * width;
    int64_t padded = (columns + 15) / 16 * 16;
    __m512 vscale = _mm512_set1_ps(scale);
#pragma omp parallel num_threads(threads) if (lines * columns > 65536)
    {
        float *z = aligned_alloc(64, (size_t)padded * sizeof(float)); /* a row, then its e^z */
#pragma omp for schedule(static)
        for (int64_t line = 0; line < lines; line++) {
            int64_t r = line / (heads * width), w = line % width;
            const char *s = (const char *)scores + line * columns * size;
            const char *b = (const char *)bias + (r * width + w) * columns * size;
            char *o = (char *)out + line * columns * size;
            __m512 most = _mm512_set1_ps(-INFINITY);
            for (int64_t i = 0; i < columns; i += 16) {
                __m512 v = _mm512_fmadd_ps(load16(s, i, bf16, columns - i), vscale,
                                           load16(b, i, bf16, columns - i));
                _mm512_store_ps(z + i, v);
                most = _mm512_max_ps(most, _mm512_mask_mov_ps(most, lanes(columns - i), v));
            }
            __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(most)), sum = _mm512_setzero_ps();
            for (int64_t i = 0; i < columns; i += 16) {
                __m512 e = _mm512_maskz_mov_ps(lanes(columns - i),
                                               exp16(_mm512_sub_ps(_mm512_load_ps(z + i), top)));
                _mm512_store_ps(z + i, e);
                sum = _mm512_add_ps(sum, e);
            }
            __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
            for (int64_t i = 0; i < columns; i += 16)
                store16(o, i, _mm512_mul_ps(_mm512_load_ps(z + i), inverse), bf16, columns - i);
        }
        free(z);
    }
}

/* Its backward: dscores = scale * p (dp - sum_j p_j dp_j) per row of `columns`, p the
 * forward's (rounded) weights; `lines` rows in all, contiguous. */
void postrl_softmax_backward(const void *weights, const void *grad, void *dscores,
                             int64_t lines, int64_t columns, float scale, int bf16,
                             int threads) {
    int64_t size = element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (lines * columns > 65536)
    for (int64_t line = 0; line < lines; line++) {
        const char *p = (const char *)weights + line * columns * size;
        const char *g = (const char *)grad + line * columns * size;
        char *d = (char *)dscores + line * columns * size;
        __m512 dot = _mm512_setzero_ps();
        for (int64_t i = 0; i < columns; i += 16)
            dot = _mm512_fmadd_ps(load16(p, i, bf16, columns - i), load16(g, i, bf16, columns - i),
                                  dot);
        __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(dot)), vscale = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < columns; i += 16) {
            __m512 pv = load16(p, i, bf16, columns - i);
            __m512 diff = _mm512_sub_ps(load16(g, i, bf16, columns - i), total);
            store16(d, i, _mm512_mul_ps(_mm512_mul_ps(pv, diff), vscale), bf16, columns - i);
        }
    }
}

/* One head's row, in halves of `dim`: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2; `inverse`,
 * the backward (the transposed rotation): out1 = x1 c1 + x2 s2, out2 = x2 c2 - x1 s1. */
static inline void rotate_row(const char *x, const char *c, const char *s, char *out,
                              int64_t dim, int inverse, int bf16) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += 16) {
        int64_t count = half - i;
        __m512 x1 = load16(x, i, bf16, count), x2 = load16(x, half + i, bf16, count);
        __m512 s1 = load16(s, i, bf16, count), s2 = load16(s, half + i, bf16, count);
        __m512 a = inverse ? _mm512_sub_ps(_mm512_setzero_ps(), s2) : s1;
        __m512 b = inverse ? _mm512_sub_ps(_mm512_setzero_ps(), s1) : s2;
        store16(out, i, _mm512_fnmadd_ps(x2, a, _mm512_mul_ps(x1, load16(c, i, bf16, count))),
                bf16, count);
        store16(out, half + i,
                _mm512_fmadd_ps(x1, b, _mm512_mul_ps(x2, load16(c, half + i, bf16, count))),
                bf16, count);
    }
}

/* Rotary embedding of x [rows, heads, width, dim] (element strides row_stride, head_stride,
 * width_stride; each head's row contiguous) at the angles of cos and sin [rows, width, dim]
 * (contiguous; the same for every head), into out [rows, heads, width, dim], contiguous;
 * `inverse`: the backward's rotation. */
void postrl_rotate(const void *x, int64_t row_stride, int64_t head_stride, int64_t width_stride,
                   const void *cos, const void *sin, void *out, int64_t rows, int64_t heads,
                   int64_t width, int64_t dim, int inverse, int bf16, int threads) {
    int64_t size = element_size(bf16), lines = rows * heads * width;
#pragma omp parallel for schedule(static) num_threads(threads) if (lines * dim > 65536)
    for (int64_t line = 0; line < lines; line++) {
        int64_t r = line / (heads * width), h = line / width % heads, w = line % width;
        int64_t angle = (r * width + w) * dim * size;
        rotate_row((const char *)x + (r * row_stride + h * head_stride + w * width_stride) * size,
                   (const char *)cos + angle, (const char *)sin + angle,
                   (char *)out + line * dim * size, dim, inverse, bf16);
    }
}

/* into[i] += grad[i], float32 += bf16, `count` values: a bf16 gradient added into its float32
 * master gradient in one pass (PyTorch's mixed-dtype add_ casts into a temporary first). */
void postrl_add_bf16(float *into, const void *grad, int64_t count, int threads) {
    int64_t blocks = (count + 4095) / 4096;
#pragma omp parallel for schedule(static) num_threads(threads) if (count > 65536)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t end = (block + 1) * 4096 < count ? (block + 1) * 4096 : count;
        for (int64_t i = block * 4096; i < end; i += 16) {
            __mmask16 m = lanes(end - i);
            _mm512_mask_storeu_ps(into + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, into + i),
                                                             load16(grad, i, 1, end - i)));
        }
    }
}
