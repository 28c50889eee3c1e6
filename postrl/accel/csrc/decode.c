/* postrl's decode-step kernels for the lean sampler, AVX-512 (or AVX2), float32 or bf16
 * (`bf16`: every tensor of a call in bf16, the arithmetic in float32): everything a decoder
 * layer does between its linears.
 *
 * Between its linears, a decode step runs small operations on a few rows: PyTorch spends more
 * on dispatching them than on their arithmetic (bench/log.md). Here each is one
 * call per layer: the rotary embedding of queries and keys, stored with the values straight
 * into the KV cache's column; the residual add with the RMSNorm after it, in one pass per
 * row; SiLU(gate) * up; the attention of each row's queries over its own cached columns, the
 * G query heads of a group reading their shared key/value head, with the softmax in float32
 * as PyTorch's kernels compute it. In bf16 the arithmetic is float32, rounded to bf16 where a
 * result is stored: the residual sum, the norm after its weight, SiLU and its product, the
 * rotated heads (PyTorch's bf16 rotation also rounds its products), the attention's output.
 */
#include <math.h>

#include "simd.h"

/* Sum of a[i] * b[i], i < n (float32, or bf16 when `bf16`). */
static inline float dot(const void *a, const void *b, int64_t n, int bf16) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
        sum = _mm512_fmadd_ps(load16(a, i, bf16, n - i), load16(b, i, bf16, n - i), sum);
    return _mm512_reduce_add_ps(sum);
}

/* out = x / sqrt(mean(x^2) + eps) * weight, one row of `width`. */
static inline void norm_row(const void *x, const void *weight, void *out, int64_t width,
                            float eps, int bf16) {
    __m512 s = _mm512_set1_ps(1.0f / sqrtf(dot(x, x, width, bf16) / (float)width + eps));
    for (int64_t i = 0; i < width; i += 16) {
        __m512 v = _mm512_mul_ps(load16(x, i, bf16, width - i), s);
        store16(out, i, _mm512_mul_ps(v, load16(weight, i, bf16, width - i)), bf16, width - i);
    }
}

/* The entry points' bf16 flag as a constant where each inline row function is called, so
 * that the compiler builds one copy per dtype without a test in its inner loops. */
#define BY_DTYPE(bf16, call) do { if (bf16) { const int dtype_bf16 = 1; call; } \
                                  else { const int dtype_bf16 = 0; call; } } while (0)

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of `width` (contiguous). */
void postrl_rms_norm(const void *x, const void *weight, void *y, int64_t rows, int64_t width,
                     float eps, int bf16, int threads) {
    int64_t row = width * element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++)
        BY_DTYPE(bf16, norm_row((const char *)x + r * row, weight, (char *)y + r * row, width,
                                eps, dtype_bf16));
}

/* hidden[r] += delta[r], rounded to the stream's dtype. */
static inline void add_row(void *hidden, const void *delta, int64_t width, int bf16) {
    for (int64_t i = 0; i < width; i += 16)
        store16(hidden, i, _mm512_add_ps(load16(hidden, i, bf16, width - i),
                                         load16(delta, i, bf16, width - i)), bf16, width - i);
}

/* The residual stream and the norm after it: hidden[r] += delta[r] (in place), then
 * y[r] = RMSNorm(hidden[r]) * weight; rows of `width`, contiguous. */
void postrl_add_rms_norm(void *hidden, const void *delta, const void *weight, void *y,
                         int64_t rows, int64_t width, float eps, int bf16, int threads) {
    int64_t row = width * element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++) {
        char *h = (char *)hidden + r * row;
        BY_DTYPE(bf16, (add_row(h, (const char *)delta + r * row, width, dtype_bf16),
                        norm_row(h, weight, (char *)y + r * row, width, eps, dtype_bf16)));
    }
}

/* One row of SiLU(gate) * up; SiLU(g) = g / (1 + e^-g). */
static inline void silu_mul_row(const void *gate, const void *up, void *out, int64_t width,
                                int bf16) {
    for (int64_t i = 0; i < width; i += 16) {
        __m512 g = load16(gate, i, bf16, width - i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), bf16);
        store16(out, i, _mm512_mul_ps(silu, load16(up, i, bf16, width - i)), bf16, width - i);
    }
}

/* y[r, j] = SiLU(x[r, j]) * x[r, width + j]: the gate and up halves of a fused projection,
 * rows of 2 * width (contiguous). */
void postrl_silu_mul(const void *x, void *y, int64_t rows, int64_t width, int bf16,
                     int threads) {
    int64_t row = width * element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)x + 2 * r * row;
        BY_DTYPE(bf16, silu_mul_row(gate, gate + row, (char *)y + r * row, width, dtype_bf16));
    }
}

/* One head's rotary embedding: out = x * cos + rotate_half(x) * sin, rotate_half(x) being
 * (-x[half:], x[:half]) (the Llama convention, as postrl.models.layers.rotate computes it:
 * products rounded to float32, then summed; in bf16 the sum rounded once). */
static inline void rotate_head(const void *x, const void *cos, const void *sin, void *out,
                               int64_t dim, int bf16) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += 16) {
        int64_t n = half - i;
        __m512 a = load16(x, i, bf16, n), b = load16(x, half + i, bf16, n);
        __m512 c0 = load16(cos, i, bf16, n), s0 = load16(sin, i, bf16, n);
        __m512 c1 = load16(cos, half + i, bf16, n), s1 = load16(sin, half + i, bf16, n);
        store16(out, i, _mm512_sub_ps(_mm512_mul_ps(a, c0), _mm512_mul_ps(b, s0)), bf16, n);
        store16(out, half + i, _mm512_add_ps(_mm512_mul_ps(b, c1), _mm512_mul_ps(a, s1)), bf16,
                n);
    }
}

/* One row of a decode step's new column (see postrl_rotate_store; pointers at the row). */
static inline void rotate_store_row(const char *in, const char *c, const char *s, char *queries,
                                    char *keys, char *values, int64_t kv_head, int64_t heads,
                                    int64_t kv_heads, int64_t dim, int bf16) {
    int64_t size = element_size(bf16), head = dim * size;
    for (int64_t h = 0; h < heads; h++) rotate_head(in + h * head, c, s, queries + h * head, dim,
                                                    bf16);
    for (int64_t h = 0; h < kv_heads; h++) {
        rotate_head(in + (heads + h) * head, c, s, keys + h * kv_head * size, dim, bf16);
        const char *v = in + (heads + kv_heads + h) * head;
        char *value = values + h * kv_head * size;
        for (int64_t i = 0; i < dim; i += 16)
            store16(value, i, load16(v, i, bf16, dim - i), bf16, dim - i);
    }
}

/* A decode step's new column: qkv [rows, (heads + 2 kv_heads) * dim] (row stride qkv_row)
 * holds each row's query heads, key heads and value heads; cos, sin [rows, dim]. The rotated
 * queries go to queries [rows, heads, dim] (contiguous); the rotated keys and the values to
 * the cache's column: keys, values at row stride kv_row and head stride kv_head (elements). */
void postrl_rotate_store(const void *qkv, int64_t qkv_row, const void *cos, const void *sin,
                         void *queries, void *keys, void *values, int64_t kv_row,
                         int64_t kv_head, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t dim, int bf16, int threads) {
    int64_t size = element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 4)
    for (int64_t r = 0; r < rows; r++)
        BY_DTYPE(bf16, rotate_store_row((const char *)qkv + r * qkv_row * size,
                                        (const char *)cos + r * dim * size,
                                        (const char *)sin + r * dim * size,
                                        (char *)queries + r * heads * dim * size,
                                        (char *)keys + r * kv_row * size,
                                        (char *)values + r * kv_row * size, kv_head, heads,
                                        kv_heads, dim, dtype_bf16));
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
 * weighted sum one accumulator per 16 dimensions (offsets in elements). */
static void attend_head(const void *query, const void *k, const void *v, const void *add,
                        void *o, int64_t dim, int64_t columns, float scale, float *p,
                        int bf16) {
    int64_t size = element_size(bf16);
    for (int64_t c = 0; c < columns; c++)
        p[c] = dot(query, (const char *)k + c * dim * size, dim, bf16) * scale
               + _mm512_cvtss_f32(load16(add, c, bf16, 1));
    __m512 inverse = _mm512_set1_ps(softmax_numerators(p, columns));
    for (int64_t i = 0; i < dim; i += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < columns; c++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(p[c]), load16(v, c * dim + i, bf16, dim - i),
                                  acc);
        store16(o, i, _mm512_mul_ps(acc, inverse), bf16, dim - i);
    }
}

/* A group's queries over their key/value head, for a head of 16 * DV values (BF: bf16): the
 * scores of 16 columns at a time reduced together (sum_lanes16), the weighted sum in 2 * DV
 * accumulators (even and odd columns), so that the additions' latency overlaps. p: group *
 * padded floats. Offsets are in elements. */
#define ATTEND_GROUP(DV, BF, NAME)                                                          \
    static void NAME(const void *q, const void *k, const void *v, const void *add, void *o, \
                     int64_t group, int64_t columns, float scale, float *p, int64_t padded) { \
        const int64_t dim = 16 * DV;                                                        \
        for (int64_t g = 0; g < group; g++) {                                               \
            float *pg = p + g * padded;                                                     \
            __m512 qv[DV];                                                                  \
            for (int j = 0; j < DV; j++) qv[j] = load16(q, g * dim + 16 * j, BF, 16);       \
            for (int64_t c0 = 0; c0 < columns; c0 += 16) {                                  \
                __m512 t[16];                                                               \
                for (int64_t c = 0; c < 16; c++) {                                          \
                    t[c] = _mm512_setzero_ps();                                             \
                    if (c0 + c < columns)                                                   \
                        for (int j = 0; j < DV; j++)                                        \
                            t[c] = _mm512_fmadd_ps(                                         \
                                qv[j], load16(k, (c0 + c) * dim + 16 * j, BF, 16), t[c]);   \
                }                                                                           \
                _mm512_storeu_ps(pg + c0, _mm512_fmadd_ps(sum_lanes16(t), _mm512_set1_ps(scale), \
                                                          load16(add, c0, BF, columns - c0))); \
            }                                                                               \
            __m512 inverse = _mm512_set1_ps(softmax_numerators(pg, columns));               \
            __m512 even[DV], odd[DV];                                                       \
            for (int j = 0; j < DV; j++) even[j] = odd[j] = _mm512_setzero_ps();            \
            int64_t c = 0;                                                                  \
            for (; c + 1 < columns; c += 2) {                                               \
                __m512 w0 = _mm512_set1_ps(pg[c]), w1 = _mm512_set1_ps(pg[c + 1]);          \
                for (int j = 0; j < DV; j++) {                                              \
                    __m512 v0 = load16(v, c * dim + 16 * j, BF, 16);                        \
                    __m512 v1 = load16(v, (c + 1) * dim + 16 * j, BF, 16);                  \
                    even[j] = _mm512_fmadd_ps(w0, v0, even[j]);                             \
                    odd[j] = _mm512_fmadd_ps(w1, v1, odd[j]);                               \
                }                                                                           \
            }                                                                               \
            if (c < columns)                                                                \
                for (int j = 0; j < DV; j++)                                                \
                    even[j] = _mm512_fmadd_ps(_mm512_set1_ps(pg[c]),                        \
                                              load16(v, c * dim + 16 * j, BF, 16), even[j]); \
            for (int j = 0; j < DV; j++)                                                    \
                store16(o, g * dim + 16 * j,                                                \
                        _mm512_mul_ps(_mm512_add_ps(even[j], odd[j]), inverse), BF, 16);    \
        }                                                                                   \
    }

ATTEND_GROUP(4, 0, attend_group4) ATTEND_GROUP(8, 0, attend_group8)
ATTEND_GROUP(4, 1, attend_group4_bf16) ATTEND_GROUP(8, 1, attend_group8_bf16)

/* Attention of one new query per head and row over that row's cached columns.
 * q: [rows, kv_heads * group, dim] at row stride q_row; keys, values: [rows, kv_heads,
 * columns, dim] at strides (kv_row, kv_head, dim, 1); mask: [rows, columns] additive, at row
 * stride mask_row; out: [rows, kv_heads * group, dim], contiguous (strides in elements, every
 * tensor float32, or bf16 when `bf16`). Query head h * group + g reads key/value head h. Heads
 * of 64 and 128 values take attend_group, others attend_head. */
void postrl_attend_rows(const void *q, int64_t q_row, const void *keys, const void *values,
                        int64_t kv_row, int64_t kv_head, const void *mask, int64_t mask_row,
                        void *out, int64_t rows, int64_t kv_heads, int64_t group, int64_t dim,
                        int64_t columns, float scale, int bf16, int threads) {
    int64_t padded = (columns + 15) / 16 * 16, size = element_size(bf16);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const char *k = (const char *)keys + (r * kv_row + h * kv_head) * size;
            const char *v = (const char *)values + (r * kv_row + h * kv_head) * size;
            const char *add = (const char *)mask + r * mask_row * size;
            const char *query = (const char *)q + (r * q_row + h * group * dim) * size;
            char *o = (char *)out + (r * kv_heads + h) * group * dim * size;
            float p[group * padded]; /* the scores, then their exponentials */
            if (dim == 64)
                (bf16 ? attend_group4_bf16 : attend_group4)(query, k, v, add, o, group, columns,
                                                            scale, p, padded);
            else if (dim == 128)
                (bf16 ? attend_group8_bf16 : attend_group8)(query, k, v, add, o, group, columns,
                                                            scale, p, padded);
            else
                for (int64_t g = 0; g < group; g++)
                    attend_head(query + g * dim * size, k, v, add, o + g * dim * size, dim,
                                columns, scale, p, bf16);
        }
    }
}
