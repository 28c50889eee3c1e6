/* postrl's float32 decode-step kernels for the lean sampler, AVX-512: everything a decoder
 * layer does between its linears.
 *
 * Between its linears, a decode step runs small operations on a few rows: PyTorch spends more
 * on dispatching them than on their arithmetic (at 32 rows, SmolLM2's 30 layers of attention
 * took 11 ms of a 60 ms step, their RMSNorms 3 ms; docs/performance.md). Here each is one
 * call per layer: the rotary embedding of queries and keys, stored with the values straight
 * into the KV cache's column; the residual add with the RMSNorm after it, in one pass per
 * row; SiLU(gate) * up; the attention of each row's queries over its own cached columns, the
 * G query heads of a group reading their shared key/value head, with the softmax in float32
 * as PyTorch's kernels compute it.
 */
#include <math.h>

#include "simd.h"

/* Sum of a[i] * b[i], i < n. */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i),
                              sum);
    }
    return _mm512_reduce_add_ps(sum);
}

/* out = x / sqrt(mean(x^2) + eps) * weight, one row of `width`. */
static inline void norm_row(const float *x, const float *weight, float *out, int64_t width,
                            float eps) {
    __m512 s = _mm512_set1_ps(1.0f / sqrtf(dot(x, x, width) / (float)width + eps));
    for (int64_t i = 0; i < width; i += 16) {
        __mmask16 m = lanes(width - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, weight + i)));
    }
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of `width` (contiguous). */
void postrl_rms_norm(const float *x, const float *weight, float *y, int64_t rows,
                     int64_t width, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * width, weight, y + r * width, width, eps);
}

/* The residual stream and the norm after it: hidden[r] += delta[r] (in place), then
 * y[r] = RMSNorm(hidden[r]) * weight; rows of `width`, contiguous. */
void postrl_add_rms_norm(float *hidden, const float *delta, const float *weight, float *y,
                         int64_t rows, int64_t width, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * width;
        const float *d = delta + r * width;
        for (int64_t i = 0; i < width; i += 16) {
            __mmask16 m = lanes(width - i);
            _mm512_mask_storeu_ps(h + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, h + i),
                                                          _mm512_maskz_loadu_ps(m, d + i)));
        }
        norm_row(h, weight, y + r * width, width, eps);
    }
}

/* y[r, j] = SiLU(x[r, j]) * x[r, width + j]: the gate and up halves of a fused projection,
 * rows of 2 * width (contiguous); SiLU(g) = g / (1 + e^-g). */
void postrl_silu_mul(const float *x, float *y, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * width, *up = gate + width;
        float *out = y + r * width;
        for (int64_t i = 0; i < width; i += 16) {
            __mmask16 m = lanes(width - i);
            __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            __m512 u = _mm512_maskz_loadu_ps(m, up + i);
            _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu, u));
        }
    }
}

/* One head's rotary embedding: out = x * cos + rotate_half(x) * sin, rotate_half(x) being
 * (-x[half:], x[:half]) (the Llama convention, as postrl.models.layers.rotate computes it:
 * products rounded, then summed). */
static inline void rotate_head(const float *x, const float *cos, const float *sin, float *out,
                               int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += 16) {
        __mmask16 m = lanes(half - i);
        __m512 a = _mm512_maskz_loadu_ps(m, x + i), b = _mm512_maskz_loadu_ps(m, x + half + i);
        __m512 c0 = _mm512_maskz_loadu_ps(m, cos + i), s0 = _mm512_maskz_loadu_ps(m, sin + i);
        __m512 c1 = _mm512_maskz_loadu_ps(m, cos + half + i);
        __m512 s1 = _mm512_maskz_loadu_ps(m, sin + half + i);
        _mm512_mask_storeu_ps(out + i, m,
                              _mm512_sub_ps(_mm512_mul_ps(a, c0), _mm512_mul_ps(b, s0)));
        _mm512_mask_storeu_ps(out + half + i, m,
                              _mm512_add_ps(_mm512_mul_ps(b, c1), _mm512_mul_ps(a, s1)));
    }
}

/* A decode step's new column: qkv [rows, (heads + 2 kv_heads) * dim] (row stride qkv_row)
 * holds each row's query heads, key heads and value heads; cos, sin [rows, dim]. The rotated
 * queries go to queries [rows, heads, dim] (contiguous); the rotated keys and the values to
 * the cache's column: keys, values at row stride kv_row and head stride kv_head. */
void postrl_rotate_store(const float *qkv, int64_t qkv_row, const float *cos, const float *sin,
                         float *queries, float *keys, float *values, int64_t kv_row,
                         int64_t kv_head, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t dim, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *in = qkv + r * qkv_row, *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++)
            rotate_head(in + h * dim, c, s, queries + (r * heads + h) * dim, dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            float *key = keys + r * kv_row + h * kv_head;
            float *value = values + r * kv_row + h * kv_head;
            rotate_head(in + (heads + h) * dim, c, s, key, dim);
            const float *v = in + (heads + kv_heads + h) * dim;
            for (int64_t i = 0; i < dim; i += 16) {
                __mmask16 m = lanes(dim - i);
                _mm512_mask_storeu_ps(value + i, m, _mm512_maskz_loadu_ps(m, v + i));
            }
        }
    }
}

/* The 16 sums of t[0..16)'s lanes, as one vector (lane c: the sum of t[c]): pairs of vectors
 * are folded together (unpack and add) until each 128-bit lane holds four columns' partial
 * sums, then the lanes are added across. 30 shuffles and 15 additions for 16 dot products,
 * where reducing each on its own takes 16 times 4 and 4. */
static inline __m512 sum_lanes16(const __m512 t[16]) {
    __m512 s[8], u[4], v[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]),
                             _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: four columns' partial sums */
        __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* lanes 0+1 and 2+3 of u[2i], then of u[2i+1] */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* p[0..columns) = e^(p - max p), in place, in float32; 1 / their sum. */
static inline float softmax_numerators(float *p, int64_t columns) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < columns; c += 16)
        top = _mm512_mask_max_ps(top, lanes(columns - c), top, _mm512_loadu_ps(p + c));
    __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t c = 0; c < columns; c += 16) {
        __mmask16 m = lanes(columns - c);
        __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + c),
                                                              shift)));
        _mm512_mask_storeu_ps(p + c, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* One query over one key/value head, any head size: each score its own dot product, the
 * weighted sum one accumulator per 16 dimensions. */
static void attend_head(const float *query, const float *k, const float *v, const float *add,
                        float *o, int64_t dim, int64_t columns, float scale, float *p) {
    for (int64_t c = 0; c < columns; c++) p[c] = dot(query, k + c * dim, dim) * scale + add[c];
    __m512 inverse = _mm512_set1_ps(softmax_numerators(p, columns));
    for (int64_t i = 0; i < dim; i += 16) {
        __mmask16 m = lanes(dim - i);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < columns; c++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(p[c]), _mm512_maskz_loadu_ps(m, v + c * dim + i),
                                  acc);
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(acc, inverse));
    }
}

/* A group's queries over their key/value head, for a head of 16 * DV floats: the scores of 16
 * columns at a time reduced together (sum_lanes16), the weighted sum in 2 * DV accumulators
 * (even and odd columns), so that the additions' latency overlaps. p: group * padded floats. */
#define ATTEND_GROUP(DV)                                                                    \
    static void attend_group##DV(const float *q, const float *k, const float *v,            \
                                 const float *add, float *o, int64_t group, int64_t columns, \
                                 float scale, float *p, int64_t padded) {                   \
        const int64_t dim = 16 * DV;                                                        \
        for (int64_t g = 0; g < group; g++) {                                               \
            const float *query = q + g * dim;                                               \
            float *pg = p + g * padded;                                                     \
            __m512 qv[DV];                                                                  \
            for (int j = 0; j < DV; j++) qv[j] = _mm512_loadu_ps(query + 16 * j);           \
            for (int64_t c0 = 0; c0 < columns; c0 += 16) {                                  \
                __m512 t[16];                                                               \
                for (int64_t c = 0; c < 16; c++) {                                          \
                    t[c] = _mm512_setzero_ps();                                             \
                    if (c0 + c < columns)                                                   \
                        for (int j = 0; j < DV; j++)                                        \
                            t[c] = _mm512_fmadd_ps(                                         \
                                qv[j], _mm512_loadu_ps(k + (c0 + c) * dim + 16 * j), t[c]); \
                }                                                                           \
                __mmask16 m = lanes(columns - c0);                                          \
                _mm512_storeu_ps(pg + c0, _mm512_fmadd_ps(sum_lanes16(t), _mm512_set1_ps(scale), \
                                                          _mm512_maskz_loadu_ps(m, add + c0))); \
            }                                                                               \
            __m512 inverse = _mm512_set1_ps(softmax_numerators(pg, columns));               \
            __m512 even[DV], odd[DV];                                                       \
            for (int j = 0; j < DV; j++) even[j] = odd[j] = _mm512_setzero_ps();            \
            int64_t c = 0;                                                                  \
            for (; c + 1 < columns; c += 2) {                                               \
                __m512 w0 = _mm512_set1_ps(pg[c]), w1 = _mm512_set1_ps(pg[c + 1]);          \
                for (int j = 0; j < DV; j++) {                                              \
                    __m512 v0 = _mm512_loadu_ps(v + c * dim + 16 * j);                      \
                    __m512 v1 = _mm512_loadu_ps(v + (c + 1) * dim + 16 * j);                \
                    even[j] = _mm512_fmadd_ps(w0, v0, even[j]);                             \
                    odd[j] = _mm512_fmadd_ps(w1, v1, odd[j]);                               \
                }                                                                           \
            }                                                                               \
            if (c < columns)                                                                \
                for (int j = 0; j < DV; j++)                                                \
                    even[j] = _mm512_fmadd_ps(_mm512_set1_ps(pg[c]),                        \
                                              _mm512_loadu_ps(v + c * dim + 16 * j), even[j]); \
            for (int j = 0; j < DV; j++)                                                    \
                _mm512_storeu_ps(o + g * dim + 16 * j,                                      \
                                 _mm512_mul_ps(_mm512_add_ps(even[j], odd[j]), inverse));   \
        }                                                                                   \
    }

ATTEND_GROUP(4) ATTEND_GROUP(8)

/* Attention of one new query per head and row over that row's cached columns.
 * q: [rows, kv_heads * group, dim] at row stride q_row; keys, values: [rows, kv_heads,
 * columns, dim] at strides (kv_row, kv_head, dim, 1); mask: [rows, columns] additive, at row
 * stride mask_row; out: [rows, kv_heads * group, dim], contiguous. Query head h * group + g
 * reads key/value head h. Heads of 64 and 128 floats take attend_group, others attend_head. */
void postrl_attend_rows(const float *q, int64_t q_row, const float *keys, const float *values,
                        int64_t kv_row, int64_t kv_head, const float *mask, int64_t mask_row,
                        float *out, int64_t rows, int64_t kv_heads,
                        int64_t group, int64_t dim, int64_t columns, float scale, int threads) {
    int64_t padded = (columns + 15) / 16 * 16;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *k = keys + r * kv_row + h * kv_head;
            const float *v = values + r * kv_row + h * kv_head;
            const float *add = mask + r * mask_row, *query = q + r * q_row + h * group * dim;
            float *o = out + (r * kv_heads + h) * group * dim;
            float p[group * padded]; /* the scores, then their exponentials */
            if (dim == 64)
                attend_group4(query, k, v, add, o, group, columns, scale, p, padded);
            else if (dim == 128)
                attend_group8(query, k, v, add, o, group, columns, scale, p, padded);
            else
                for (int64_t g = 0; g < group; g++)
                    attend_head(query + g * dim, k, v, add, o + g * dim, dim, columns, scale, p);
        }
    }
}
