/* What postrl's native kernels share: AVX-512F (or its emulation by AVX2, avx2.h), lane masks,
 * the exponential, and loads and stores of float32 or bf16 values (the training kernels,
 * postrl/accel/csrc/fused.c and vocab.c). */
#ifndef POSTRL_SIMD_H
#define POSTRL_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#ifndef __AVX512F__
#if defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"
#else
#error "postrl's native kernels need AVX-512F, or AVX2 and FMA"
#endif
#endif

/* The first `count` of 16 lanes (all of them from 16, none below 1). */
static inline __mmask16 lanes(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}

/* e^x, 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6
 * (relative error below 2e-7), times 2^n. Below -87 (masked scores) it is 0: the smallest
 * value it gives, e^-87, is a normal float, since arithmetic on subnormal ones takes the
 * CPU's slow path (measured: a third of the columns masked made the attention 5x slower). */
static inline __m512 exp16(__m512 x) {
    __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

/* 16 values from `p` (float32, or bf16 when `bf16`) starting at element `i`, the first
 * `count` of them (the rest 0). */
static inline __m512 load16(const void *p, int64_t i, int bf16, int64_t count) {
    if (!bf16) return _mm512_maskz_loadu_ps(lanes(count), (const float *)p + i);
    const uint16_t *q = (const uint16_t *)p + i;
    __m256i half;
    if (count >= 16) {
        half = _mm256_loadu_si256((const __m256i *)q);
    } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        half = _mm256_maskz_loadu_epi16(lanes(count), q);
#else
        uint16_t part[16] = {0};
        for (int64_t k = 0; k < count; k++) part[k] = q[k];
        half = _mm256_loadu_si256((const __m256i *)part);
#endif
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* `v` rounded to bf16 (to nearest, ties to even; NaN to 0x7FC0) and back to float32: the
 * value a bf16 tensor would hold. */
static inline __m512i bf16_bits(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                    _mm512_set1_epi32(0x7FC00000));
    return _mm512_and_si512(rounded, _mm512_set1_epi32((int)0xFFFF0000u));
}

static inline __m512 round16(__m512 v, int bf16) {
    return bf16 ? _mm512_castsi512_ps(bf16_bits(v)) : v;
}

/* The first `count` of `v`'s 16 values into `p` at element `i`, rounded to bf16 when `bf16`. */
static inline void store16(void *p, int64_t i, __m512 v, int bf16, int64_t count) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)p + i, lanes(count), v);
        return;
    }
    __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16));
    uint16_t *q = (uint16_t *)p + i;
    if (count >= 16) {
        _mm256_storeu_si256((__m256i *)q, half);
    } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        _mm256_mask_storeu_epi16(q, lanes(count), half);
#else
        uint16_t part[16];
        _mm256_storeu_si256((__m256i *)part, half);
        for (int64_t k = 0; k < count; k++) q[k] = part[k];
#endif
    }
}

static inline int64_t element_size(int bf16) { return bf16 ? 2 : 4; }

#endif
