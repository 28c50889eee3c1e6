/* The AVX-512F types and intrinsics postrl's kernels use, each as a pair of AVX2 registers:
 * included by simd.h on a CPU with AVX2 and FMA but no AVX-512F (Intel's consumer chips since
 * Alder Lake, AMD's before Zen 4), so that the same kernel sources build there.
 *
 * After <immintrin.h>, the names are redefined as macros: `__m512` becomes a struct of two
 * `__m256` halves (lanes 0-7, 8-15) and each `_mm512_*` a function on the halves, with the
 * instruction's result lane for lane. A kernel that uses an intrinsic missing here fails to
 * build (GCC's own takes a vector, not the struct; tests/accel/test_build_targets.py compiles
 * this target on any CPU). Only the forms the kernels use are here: `roundscale` with a scale
 * of 0, `scalef` for the exponents exp16 gives it (|n| <= 127 and a normal result), `rcp14` as
 * AVX's 12-bit estimate refined by one Newton step (more precise than the 14-bit one it stands
 * for), `cvtepi32_epi16` of values below 2^16. Those taking an immediate rely on the -O3 the
 * library is built with, as GCC's own do: inlined, the immediate is a constant. Masked loads
 * and stores of all 16 lanes take the plain instructions: AMD's masked stores are microcoded.
 */
#ifndef POSTRL_AVX2_H
#define POSTRL_AVX2_H

#include <immintrin.h>
#include <stdint.h>

typedef struct { __m256 lo, hi; } postrl_m512;
typedef struct { __m256i lo, hi; } postrl_m512i;
typedef struct { __m256d lo, hi; } postrl_m512d; /* lanes 0-3, 4-7 */
#define __m512 postrl_m512
#define __m512i postrl_m512i
#define __m512d postrl_m512d

#define P2 static inline __attribute__((always_inline))

/* Lanes of a 16-bit mask as two 8-lane masks (all bits set where the mask bit is). */
P2 __m256i p2_mask8(unsigned bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
#define P2_LO(m) p2_mask8((unsigned)(m) & 0xFFu)
#define P2_HI(m) p2_mask8(((unsigned)(m) >> 8) & 0xFFu)
P2 __m256 p2_blend(__m256 a, __m256 b, __m256i mask) { /* b where mask, else a */
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(mask));
}

/* An AVX2 operation on each half: of one pair (converting its type), two or three. */
#define P2_UNARY(out, in, name, op) \
    P2 out name(in v) { return (out){op(v.lo), op(v.hi)}; }
#define P2_BINARY(type, name, op) \
    P2 type name(type a, type b) { return (type){op(a.lo, b.lo), op(a.hi, b.hi)}; }
#define P2_TERNARY(type, name, op)                                                       \
    P2 type name(type a, type b, type c) {                                               \
        return (type){op(a.lo, b.lo, c.lo), op(a.hi, b.hi, c.hi)};                       \
    }

/* float32 arithmetic, lane for lane */
P2_BINARY(__m512, p2_add_ps, _mm256_add_ps)
P2_BINARY(__m512, p2_sub_ps, _mm256_sub_ps)
P2_BINARY(__m512, p2_mul_ps, _mm256_mul_ps)
P2_BINARY(__m512, p2_div_ps, _mm256_div_ps)
P2_BINARY(__m512, p2_max_ps, _mm256_max_ps)
P2_BINARY(__m512, p2_min_ps, _mm256_min_ps)
#define _mm512_add_ps p2_add_ps
#define _mm512_sub_ps p2_sub_ps
#define _mm512_mul_ps p2_mul_ps
#define _mm512_div_ps p2_div_ps
#define _mm512_max_ps p2_max_ps
#define _mm512_min_ps p2_min_ps

P2 __m512 p2_set1_ps(float x) { return (__m512){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
#define _mm512_set1_ps p2_set1_ps
P2 __m512 p2_setzero_ps(void) { return (__m512){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
#define _mm512_setzero_ps p2_setzero_ps
P2_TERNARY(__m512, p2_fmadd_ps, _mm256_fmadd_ps)
#define _mm512_fmadd_ps p2_fmadd_ps
P2_TERNARY(__m512, p2_fnmadd_ps, _mm256_fnmadd_ps)
#define _mm512_fnmadd_ps p2_fnmadd_ps
P2 __m512 p2_rcp14_ps(__m512 d) {
    const __m256 two = _mm256_set1_ps(2.0f);
    __m256 lo = _mm256_rcp_ps(d.lo), hi = _mm256_rcp_ps(d.hi);
    return (__m512){_mm256_mul_ps(lo, _mm256_fnmadd_ps(d.lo, lo, two)),
                    _mm256_mul_ps(hi, _mm256_fnmadd_ps(d.hi, hi, two))};
}
#define _mm512_rcp14_ps p2_rcp14_ps
#define _mm512_roundscale_ps(x, imm) \
    ((__m512){_mm256_round_ps((x).lo, (imm) & 0xF), _mm256_round_ps((x).hi, (imm) & 0xF)})
P2 __m256 p2_scalef8(__m256 p, __m256 n) { /* p * 2^n: n integral, 2^n a normal float */
    __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    __m256i e = _mm256_slli_epi32(biased, 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
P2 __m512 p2_scalef_ps(__m512 p, __m512 n) {
    return (__m512){p2_scalef8(p.lo, n.lo), p2_scalef8(p.hi, n.hi)};
}
#define _mm512_scalef_ps p2_scalef_ps

/* loads and stores; masked ones touch no memory in lanes off the mask */
P2 __m512 p2_loadu_ps(const void *p) {
    return (__m512){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)};
}
#define _mm512_loadu_ps p2_loadu_ps
P2 __m512 p2_load_ps(const void *p) {
    return (__m512){_mm256_load_ps((const float *)p), _mm256_load_ps((const float *)p + 8)};
}
#define _mm512_load_ps p2_load_ps
P2 void p2_storeu_ps(void *p, __m512 v) {
    _mm256_storeu_ps((float *)p, v.lo);
    _mm256_storeu_ps((float *)p + 8, v.hi);
}
#define _mm512_storeu_ps p2_storeu_ps
P2 void p2_store_ps(void *p, __m512 v) {
    _mm256_store_ps((float *)p, v.lo);
    _mm256_store_ps((float *)p + 8, v.hi);
}
#define _mm512_store_ps p2_store_ps
P2 __m512 p2_maskz_loadu_ps(__mmask16 m, const void *p) {
    if (m == 0xFFFF) return _mm512_loadu_ps(p);
    const float *f = (const float *)p;
    return (__m512){_mm256_maskload_ps(f, P2_LO(m)), _mm256_maskload_ps(f + 8, P2_HI(m))};
}
#define _mm512_maskz_loadu_ps p2_maskz_loadu_ps
P2 __m512 p2_mask_loadu_ps(__m512 src, __mmask16 m, const void *p) {
    if (m == 0xFFFF) return _mm512_loadu_ps(p);
    __m512 v = _mm512_maskz_loadu_ps(m, p);
    return (__m512){p2_blend(src.lo, v.lo, P2_LO(m)), p2_blend(src.hi, v.hi, P2_HI(m))};
}
#define _mm512_mask_loadu_ps p2_mask_loadu_ps
P2 void p2_mask_storeu_ps(void *p, __mmask16 m, __m512 v) {
    if (m == 0xFFFF) {
        _mm512_storeu_ps(p, v);
        return;
    }
    if (m & 0xFF) _mm256_maskstore_ps((float *)p, P2_LO(m), v.lo);
    if (m >> 8) _mm256_maskstore_ps((float *)p + 8, P2_HI(m), v.hi);
}
#define _mm512_mask_storeu_ps p2_mask_storeu_ps

/* masks: comparisons into them, selections by them */
P2 __mmask16 p2_cmp_ps_mask(__m512 a, __m512 b, const int imm) { /* imm: a constant */
    return (__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, imm))
                       | _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, imm)) << 8);
}
#define _mm512_cmp_ps_mask p2_cmp_ps_mask
P2 __m512 p2_mask_mov_ps(__m512 src, __mmask16 m, __m512 v) {
    return (__m512){p2_blend(src.lo, v.lo, P2_LO(m)), p2_blend(src.hi, v.hi, P2_HI(m))};
}
#define _mm512_mask_mov_ps p2_mask_mov_ps
P2 __m512 p2_maskz_mov_ps(__mmask16 m, __m512 v) {
    return (__m512){_mm256_and_ps(v.lo, _mm256_castsi256_ps(P2_LO(m))),
                    _mm256_and_ps(v.hi, _mm256_castsi256_ps(P2_HI(m)))};
}
#define _mm512_maskz_mov_ps p2_maskz_mov_ps
P2 __m512 p2_mask_max_ps(__m512 src, __mmask16 m, __m512 a, __m512 b) {
    return _mm512_mask_mov_ps(src, m, _mm512_max_ps(a, b));
}
#define _mm512_mask_max_ps p2_mask_max_ps
P2 __m512 p2_maskz_mul_ps(__mmask16 m, __m512 a, __m512 b) {
    return _mm512_maskz_mov_ps(m, _mm512_mul_ps(a, b));
}
#define _mm512_maskz_mul_ps p2_maskz_mul_ps
P2 __m512 p2_mask3_fmadd_ps(__m512 a, __m512 b, __m512 c, __mmask16 m) {
    return _mm512_mask_mov_ps(c, m, _mm512_fmadd_ps(a, b, c));
}
#define _mm512_mask3_fmadd_ps p2_mask3_fmadd_ps

/* across lanes: the halves, then 128-bit lanes, pairs, the last two (op: add or max) */
#define P2_REDUCE(name, op)                                                              \
    P2 float name(__m512 v) {                                                            \
        __m256 s8 = _mm256_##op##_ps(v.lo, v.hi);                                        \
        __m128 s4 = _mm_##op##_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); \
        __m128 s2 = _mm_##op##_ps(s4, _mm_movehl_ps(s4, s4));                            \
        return _mm_cvtss_f32(_mm_##op##_ss(s2, _mm_movehdup_ps(s2)));                    \
    }
P2_REDUCE(p2_reduce_add_ps, add)
#define _mm512_reduce_add_ps p2_reduce_add_ps
P2_REDUCE(p2_reduce_max_ps, max)
#define _mm512_reduce_max_ps p2_reduce_max_ps
P2 float p2_cvtss_f32(__m512 v) { return _mm256_cvtss_f32(v.lo); }
#define _mm512_cvtss_f32 p2_cvtss_f32
P2_BINARY(__m512, p2_unpacklo_ps, _mm256_unpacklo_ps)
#define _mm512_unpacklo_ps p2_unpacklo_ps
P2_BINARY(__m512, p2_unpackhi_ps, _mm256_unpackhi_ps)
#define _mm512_unpackhi_ps p2_unpackhi_ps
P2_BINARY(__m512d, p2_unpacklo_pd, _mm256_unpacklo_pd)
#define _mm512_unpacklo_pd p2_unpacklo_pd
P2_BINARY(__m512d, p2_unpackhi_pd, _mm256_unpackhi_pd)
#define _mm512_unpackhi_pd p2_unpackhi_pd
/* 128-bit lanes: two of a's (imm's low two fields), then two of b's */
#define P2_PICK(v, lane) ((lane) < 2 ? (v).lo : (v).hi)
#define P2_HALF(v, l0, l1)                                                               \
    _mm256_permute2f128_ps(P2_PICK(v, l0), P2_PICK(v, l1), ((l0) & 1) | (((l1) & 1) + 2) << 4)
#define _mm512_shuffle_f32x4(a, b, imm)                                                   \
    ((__m512){P2_HALF(a, (imm) & 3, ((imm) >> 2) & 3),                                    \
              P2_HALF(b, ((imm) >> 4) & 3, ((imm) >> 6) & 3)})

/* casts and conversions */
P2_UNARY(__m512d, __m512, p2_castps_pd, _mm256_castps_pd)
#define _mm512_castps_pd p2_castps_pd
P2_UNARY(__m512, __m512d, p2_castpd_ps, _mm256_castpd_ps)
#define _mm512_castpd_ps p2_castpd_ps
P2_UNARY(__m512i, __m512, p2_castps_si512, _mm256_castps_si256)
#define _mm512_castps_si512 p2_castps_si512
P2_UNARY(__m512, __m512i, p2_castsi512_ps, _mm256_castsi256_ps)
#define _mm512_castsi512_ps p2_castsi512_ps
P2 __m256 p2_castps512_ps256(__m512 v) { return v.lo; }
#define _mm512_castps512_ps256 p2_castps512_ps256
P2 __m256d p2_extractf64x4_pd(__m512d v, int high) { return high ? v.hi : v.lo; }
#define _mm512_extractf64x4_pd p2_extractf64x4_pd
P2 __m512d p2_cvtps_pd(__m256 v) {
    return (__m512d){_mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                     _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))};
}
#define _mm512_cvtps_pd p2_cvtps_pd
P2_BINARY(__m512d, p2_add_pd, _mm256_add_pd)
#define _mm512_add_pd p2_add_pd
P2 double p2_reduce_add_pd(__m512d v) {
    __m256d s4 = _mm256_add_pd(v.lo, v.hi);
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}
#define _mm512_reduce_add_pd p2_reduce_add_pd

/* 32-bit integer lanes (the bf16 conversions) */
P2 __m512i p2_set1_epi32(int x) {
    return (__m512i){_mm256_set1_epi32(x), _mm256_set1_epi32(x)};
}
#define _mm512_set1_epi32 p2_set1_epi32
P2_BINARY(__m512i, p2_add_epi32, _mm256_add_epi32)
#define _mm512_add_epi32 p2_add_epi32
P2_BINARY(__m512i, p2_and_si512, _mm256_and_si256)
#define _mm512_and_si512 p2_and_si512
#define _mm512_srli_epi32(v, n) \
    ((__m512i){_mm256_srli_epi32((v).lo, n), _mm256_srli_epi32((v).hi, n)})
#define _mm512_slli_epi32(v, n) \
    ((__m512i){_mm256_slli_epi32((v).lo, n), _mm256_slli_epi32((v).hi, n)})
P2 __m512i p2_mask_mov_epi32(__m512i src, __mmask16 m, __m512i v) {
    return (__m512i){_mm256_blendv_epi8(src.lo, v.lo, P2_LO(m)),
                     _mm256_blendv_epi8(src.hi, v.hi, P2_HI(m))};
}
#define _mm512_mask_mov_epi32 p2_mask_mov_epi32
P2 __m512i p2_cvtepu16_epi32(__m256i v) {
    return (__m512i){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)),
                     _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}
#define _mm512_cvtepu16_epi32 p2_cvtepu16_epi32
P2 __m256i p2_cvtepi32_epi16(__m512i v) { /* values below 2^16 only (bf16 bits) */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(v.lo, v.hi), 0xD8);
}
#define _mm512_cvtepi32_epi16 p2_cvtepi32_epi16

#undef P2
#endif
