/* What postrl's native kernels (gemm.c, decode.c, sample.c) share: AVX-512F, lane masks and
 * the exponential. */
#ifndef POSTRL_SIMD_H
#define POSTRL_SIMD_H

#ifndef __AVX512F__
#error "postrl's native kernels need AVX-512F"
#endif

#include <immintrin.h>
#include <stdint.h>

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

#endif
