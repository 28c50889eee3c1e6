/* A decode step's decoder layers in one call, float32 or bf16: the sequence of postrl's
 * kernels (gemm.c or dpbf16.c, decode.c) that the lean sampler's Python loop calls layer by
 * layer.
 *
 * Per layer that loop makes nine calls into the kernels, with as many views, outputs and
 * checks in Python, a measurable share of a float32 step (bench/log.md). The kernels and their order here are the loop's own, so the result
 * is the same to the bit. It covers the cache's per-row layout (each row's prompt columns
 * copied beside its own); the shared one, with its cascade over the prompts' columns, stays
 * in Python.
 */
#include <stdint.h>

void postrl_linear(const float *x, int64_t m, int64_t k, const float *packed, const float *bias,
                   int64_t n, float *y, int threads);
void postrl_bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                        const uint16_t *bias, int64_t n, uint16_t *y, int threads);
void postrl_rms_norm(const void *x, const void *weight, void *y, int64_t rows, int64_t width,
                     float eps, int bf16, int threads);
void postrl_add_rms_norm(void *hidden, const void *delta, const void *weight, void *y,
                         int64_t rows, int64_t width, float eps, int bf16, int threads);
void postrl_silu_mul(const void *x, void *y, int64_t rows, int64_t width, int bf16,
                     int threads);
void postrl_rotate_store(const void *qkv, int64_t qkv_row, const void *cos, const void *sin,
                         void *queries, void *keys, void *values, int64_t kv_row,
                         int64_t kv_head, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t dim, int bf16, int threads);
void postrl_attend_rows(const void *q, int64_t q_row, const void *keys, const void *values,
                        int64_t kv_row, int64_t kv_head, const void *mask, int64_t mask_row,
                        void *out, int64_t rows, int64_t kv_heads, int64_t group, int64_t dim,
                        int64_t columns, float scale, int bf16, int threads);

enum { QKV, OUT, GATE_UP, DOWN, KINDS };

/* y [m, n] = x [m, k] W^T + b: gemm.c's float32 linear, or dpbf16.c's bf16 one (on AMX tiles
 * or by VDPBF16PS). */
static void linear(int bf16, const void *x, int64_t m, int64_t k, const void *w, const void *b,
                   int64_t n, void *y, int threads) {
    if (bf16)
        postrl_bf16_linear(x, m, k, w, b, n, y, threads);
    else
        postrl_linear(x, m, k, w, b, n, y, threads);
}

/* The layers over `hidden` [rows, sizes[1]] (the residual stream, updated in place): its
 * first RMSNorm, then each layer; `normed` receives the stream after the final norm. Every
 * tensor is float32, or bf16 when `bf16`; offsets and strides are in elements.
 *
 * sizes: rows, hidden width, query heads, key/value heads, head dim, MLP width. Per layer l
 * and linear k (QKV, OUT, GATE_UP, DOWN): weights[4l + k] (packed by postrl_pack, or by
 * postrl_bf16_pack in bf16) and biases[4l + k] (padded in float32, or NULL); norms[2l] and
 * norms[2l + 1] (input, post-attention), norms[2 layers] the final one. Each linear's output
 * goes to record[4l + k] when `record` is not NULL (the record's slots of this step, [rows,
 * width] each), else to scratch. The cache: layer l's keys at keys + l * layer (strides
 * kv_row and kv_head, a head's columns of `dim` contiguous), this step's at column `column`;
 * attention over columns [0, columns) under the additive `mask` (row stride mask_row),
 * scaled by `scale`. `scratch`: postrl_decode_scratch(sizes) elements. */
int64_t postrl_decode_scratch(const int64_t *sizes) {
    int64_t rows = sizes[0], hidden = sizes[1], heads = sizes[2], kv_heads = sizes[3];
    int64_t dim = sizes[4], inner = sizes[5], qkv = (heads + 2 * kv_heads) * dim;
    int64_t widest = qkv > 2 * inner ? qkv : 2 * inner;
    if (hidden > widest) widest = hidden;
    return rows * (2 * heads * dim + inner + widest);
}

void postrl_decode_layers(int64_t layers, const int64_t *sizes, void *hidden, void *normed,
                          const void *cos, const void *sin, const void *const *weights,
                          const void *const *biases, const void *const *norms, float eps,
                          void *keys, void *values, int64_t layer, int64_t kv_row,
                          int64_t kv_head, int64_t column, int64_t columns, const void *mask,
                          int64_t mask_row, float scale, void *const *record, void *scratch,
                          int bf16, int threads) {
    int64_t rows = sizes[0], width = sizes[1], heads = sizes[2], kv_heads = sizes[3];
    int64_t dim = sizes[4], inner = sizes[5], qkv = (heads + 2 * kv_heads) * dim;
    int64_t outs[KINDS] = {qkv, width, 2 * inner, width}, size = bf16 ? 2 : 4;
    char *queries = scratch, *attended = queries + rows * heads * dim * size;
    char *act = attended + rows * heads * dim * size, *own = act + rows * inner * size;
    postrl_rms_norm(hidden, norms[0], normed, rows, width, eps, bf16, threads);
    for (int64_t l = 0; l < layers; l++) {
        const void *const *w = weights + KINDS * l, *const *b = biases + KINDS * l;
        void *y[KINDS];
        for (int k = 0; k < KINDS; k++) y[k] = record ? record[KINDS * l + k] : own;
        char *layer_keys = (char *)keys + l * layer * size;
        char *layer_values = (char *)values + l * layer * size;
        linear(bf16, normed, rows, width, w[QKV], b[QKV], outs[QKV], y[QKV], threads);
        postrl_rotate_store(y[QKV], qkv, cos, sin, queries, layer_keys + column * dim * size,
                            layer_values + column * dim * size, kv_row, kv_head, rows, heads,
                            kv_heads, dim, bf16, threads);
        postrl_attend_rows(queries, heads * dim, layer_keys, layer_values, kv_row, kv_head,
                           mask, mask_row, attended, rows, kv_heads, heads / kv_heads, dim,
                           columns, scale, bf16, threads);
        linear(bf16, attended, rows, heads * dim, w[OUT], b[OUT], outs[OUT], y[OUT], threads);
        postrl_add_rms_norm(hidden, y[OUT], norms[2 * l + 1], normed, rows, width, eps, bf16,
                            threads);
        linear(bf16, normed, rows, width, w[GATE_UP], b[GATE_UP], outs[GATE_UP], y[GATE_UP],
               threads);
        postrl_silu_mul(y[GATE_UP], act, rows, inner, bf16, threads);
        linear(bf16, act, rows, inner, w[DOWN], b[DOWN], outs[DOWN], y[DOWN], threads);
        postrl_add_rms_norm(hidden, y[DOWN], norms[2 * l + 2], normed, rows, width, eps, bf16,
                            threads);
    }
}
