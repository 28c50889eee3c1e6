/* postrl's sampling step, AVX-512 (or AVX2): a token from each row's temperature-scaled
 * logits, drawn by inversion from that row's uniform, with its log-probability and the row's
 * entropy.
 *
 * PyTorch takes a softmax, a float64 cumulative sum and a search over the whole vocabulary,
 * each a pass writing a row's worth of memory (bench/log.md). Here each row is three passes over
 * its logits, reading only: their largest value; the sum of the exponentials (and of their
 * products with the logits, for the entropy); and the scan for the token, which stops at it.
 *
 * Sums are taken over blocks of 16 logits, each block's exponentials added in float32 and the
 * blocks in float64. The scan recomputes the blocks exactly as the sum did, so the cumulative
 * mass ends at the very total the threshold u * total was taken from: for u < 1 some token is
 * always reached, and a token of probability 0 never is.
 */
#include <math.h>

#include "simd.h"

/* The 16 logits of block `i` (of a row of `vocab`) over the temperature; -inf past the end. */
static inline __m512 scaled16(const float *row, int64_t i, int64_t vocab, __m512 temperature) {
    __mmask16 m = lanes(vocab - i);
    return _mm512_div_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + i),
                         temperature);
}

/* exp(z - top) of a block, 0 where z is -inf (past the end, or masked logits). */
static inline __m512 weights16(__m512 z, __m512 top) {
    return exp16(_mm512_sub_ps(z, top));
}

static void sample_row(const float *row, int64_t vocab, float t, double u, int64_t *token,
                       float *logprob, float *entropy) {
    __m512 temperature = _mm512_set1_ps(t);
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < vocab; i += 16)
        most = _mm512_max_ps(most, scaled16(row, i, vocab, temperature));
    float top_value = _mm512_reduce_max_ps(most);
    __m512 top = _mm512_set1_ps(top_value);
    double total = 0.0, weighted = 0.0; /* sum of e, sum of e * z */
    for (int64_t i = 0; i < vocab; i += 16) {
        __m512 z = scaled16(row, i, vocab, temperature);
        __m512 e = weights16(z, top);
        total += (double)_mm512_reduce_add_ps(e);
        /* only where e > 0: a -inf logit of probability 0 adds nothing (not 0 * -inf) */
        __mmask16 counted = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_GT_OQ);
        weighted += (double)_mm512_reduce_add_ps(_mm512_maskz_mul_ps(counted, e, z));
    }
    double threshold = u * total, mass = 0.0;
    int64_t chosen = -1;
    for (int64_t i = 0; i < vocab && chosen < 0; i += 16) {
        __m512 e = weights16(scaled16(row, i, vocab, temperature), top);
        double block = (double)_mm512_reduce_add_ps(e);
        if (!(mass + block > threshold)) {
            mass += block;
            continue;
        }
        float lane[16];
        _mm512_storeu_ps(lane, e);
        int64_t count = vocab - i < 16 ? vocab - i : 16;
        for (int64_t j = 0; j < count; j++) { /* the first token past the threshold */
            if (lane[j] > 0.0f) chosen = i + j; /* else: the block's last one that can be drawn */
            mass += (double)lane[j];
            if (lane[j] > 0.0f && mass > threshold) break;
        }
    }
    if (chosen < 0) { /* no mass at all (every logit -inf, or NaN): the first largest logit */
        chosen = 0;
        for (int64_t j = 0; j < vocab; j++)
            if (row[j] / t == top_value) { chosen = j; break; }
    }
    double log_total = log(total);
    *token = chosen;
    *logprob = (float)((double)(row[chosen] / t) - top_value - log_total);
    if (entropy) *entropy = (float)(top_value + log_total - weighted / total);
}

/* For each of `rows` rows of `vocab` logits (row r at logits + r * ld): with z = logit /
 * temperature and p = softmax(z), the first token whose cumulative p exceeds u[r], log p of
 * it, and (when `entropies` is not NULL) -sum p log p. */
void postrl_sample(const float *logits, int64_t rows, int64_t vocab, int64_t ld,
                   float temperature, const double *u, int64_t *tokens, float *logprobs,
                   float *entropies, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        sample_row(logits + r * ld, vocab, temperature, u[r], tokens + r, logprobs + r,
                   entropies ? entropies + r : NULL);
}
