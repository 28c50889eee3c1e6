/* What postrl's native kernels (gemm.c, decode.c) share: AVX-512F, and lane masks. */
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

#endif
