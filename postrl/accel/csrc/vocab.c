/* The log-probability of each token and the entropy of its next-token distribution, from
 * logits over the whole vocabulary, forward and backward, float32 or bf16 logits, AVX-512 (or AVX2)
 * (postrl/models/vocab.py holds the maths and PyTorch's version of it).
 *
 * With z = logit / temperature, lse = log sum_j e^z_j, p = e^(z - lse):
 *     log p_y = z_y - lse,   H = lse - sum_j p_j z_j,
 *     d log p_y / d z = onehot(y) - p,   d H / d z = -p (z - lse + H).
 * The forward reads a row twice (its largest logit; the sums of e^(z - top) and of
 * e^(z - top) z) and stores nothing of the vocabulary's size; the backward recomputes p from
 * the row and lse and writes the gradient once. PyTorch's version makes the float32
 * probabilities in the forward, keeps them for the backward and sweeps them several times.
 * Sums are taken per lane in float32 over 1,024 logits at most, then in float64.
 */
#include <math.h>

#include "simd.h"

#define SPAN 1024 /* logits per float32 partial sum */

static inline __m512 scaled(const void *row, int64_t i, int64_t vocab, float inverse, int bf16) {
    __m512 z = load16(row, i, bf16, vocab - i);
    return inverse == 1.0f ? z : _mm512_mul_ps(z, _mm512_set1_ps(inverse));
}

/* Sum of a vector's lanes into a float64 total. */
static inline double widened(__m512 v) {
    __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm512_reduce_add_pd(_mm512_add_pd(low, high));
}

static void forward_row(const void *row, int64_t vocab, int64_t target, float inverse, int bf16,
                        float *logp, float *lse, float *entropy) {
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < vocab; i += 16)
        most = _mm512_max_ps(most, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),
                                                       lanes(vocab - i),
                                                       scaled(row, i, vocab, inverse, bf16)));
    float top = _mm512_reduce_max_ps(most);
    __m512 vtop = _mm512_set1_ps(top);
    double total = 0.0, weighted = 0.0; /* sums of e = e^(z - top) and of e z */
    for (int64_t start = 0; start < vocab; start += SPAN) {
        __m512 sum = _mm512_setzero_ps(), products = _mm512_setzero_ps();
        int64_t end = start + SPAN < vocab ? start + SPAN : vocab;
        for (int64_t i = start; i < end; i += 16) {
            __mmask16 m = lanes(vocab - i);
            __m512 z = scaled(row, i, vocab, inverse, bf16);
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(z, vtop)));
            sum = _mm512_add_ps(sum, e);
            /* only where e > 0: a -inf logit of probability 0 adds nothing (not 0 * -inf) */
            __mmask16 counted = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_GT_OQ);
            products = _mm512_mask3_fmadd_ps(e, z, products, counted);
        }
        total += widened(sum);
        weighted += widened(products);
    }
    double log_total = (double)top + log(total);
    float zy = _mm512_cvtss_f32(scaled(row, target, target + 1, inverse, bf16));
    *lse = (float)log_total;
    *logp = (float)((double)zy - log_total);
    if (entropy) *entropy = (float)(log_total - weighted / total);
}

/* For each of `rows` rows of `vocab` logits (row r at element r * ld): log p of targets[r],
 * lse and (unless `entropies` is NULL) the entropy, at 1 / `inverse` temperature. */
void postrl_logprob_forward(const void *logits, int64_t rows, int64_t vocab, int64_t ld,
                            const int64_t *targets, float inverse, float *logps, float *lses,
                            float *entropies, int bf16, int threads) {
    int64_t size = element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        forward_row((const char *)logits + r * ld * size, vocab, targets[r], inverse, bf16,
                    logps + r, lses + r, entropies ? entropies + r : NULL);
}

/* The gradient with respect to the logits (rows of `vocab`, contiguous, in the logits' dtype)
 * of sum_r grad_logp[r] log p_r + grad_entropy[r] H_r (`grad_entropy` NULL: no entropy
 * term; `entropies` then unused). */
void postrl_logprob_backward(const void *logits, int64_t rows, int64_t vocab, int64_t ld,
                             const int64_t *targets, float inverse, const float *lses,
                             const float *entropies, const float *grad_logp,
                             const float *grad_entropy, void *grad, int bf16, int threads) {
    int64_t size = element_size(bf16);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)logits + r * ld * size;
        char *out = (char *)grad + r * vocab * size;
        __m512 lse = _mm512_set1_ps(lses[r]), scale = _mm512_set1_ps(inverse);
        __m512 gl = _mm512_set1_ps(-grad_logp[r]);
        __m512 gh = _mm512_set1_ps(grad_entropy ? -grad_entropy[r] : 0.0f);
        __m512 shift = _mm512_set1_ps(grad_entropy ? entropies[r] - lses[r] : 0.0f);
        int64_t target = targets[r];
        for (int64_t i = 0; i < vocab; i += 16) {
            int64_t count = vocab - i;
            __m512 z = scaled(row, i, vocab, inverse, bf16);
            __m512 p = exp16(_mm512_sub_ps(z, lse));
            /* -g_logp p - g_H p (z - lse + H), the entropy term only where p > 0 */
            __m512 d = _mm512_mul_ps(p, gl);
            if (grad_entropy) {
                __mmask16 counted = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_GT_OQ);
                __m512 spread = _mm512_mul_ps(p, _mm512_add_ps(z, shift));
                d = _mm512_mask3_fmadd_ps(spread, gh, d, counted);
            }
            if (target >= i && target < i + 16) {
                float lane[16];
                _mm512_storeu_ps(lane, d);
                lane[target - i] += grad_logp[r];
                d = _mm512_loadu_ps(lane);
            }
            store16(out, i, inverse == 1.0f ? d : _mm512_mul_ps(d, scale), bf16, count);
        }
    }
}
