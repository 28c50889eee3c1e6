/* bf16 matrix products on Intel AMX tiles, float32 accumulation, rounded once where the
 * output is bf16: the bf16 sampler's linear layers, the update's linear gradients, and the
 * training attention, forward and backward (postrl_amx_attention_*: every product and the
 * softmax of one row and key/value head in one pass, in that core's cache).
 *
 * A decode step multiplies a few rows by every weight once, so it is bound by reading the
 * weights, which oneDNN's packed bf16 linear read well below the memory's rate at the
 * bench's rows (bench/log.md). The second operand is packed into panels of 16 output
 * columns, each a run of 1 KB tiles (32 inputs by 16 outputs, the pairs of inputs side by
 * side as TDPBF16PS reads them), so a panel is one sequential stream: a weight `[n, k]` once
 * per `generate` (postrl_bf16_pack), or a `[k, n]` matrix by each thread within the product,
 * the panels it owns (postrl_amx_gemm: a weight for its input gradient, a layer's input for
 * its weight gradient; the panels then stay in that core's cache). Two panels at a time and
 * up to 32 rows: four accumulator tiles, two of rows, two of panels. Rows go in chunks that
 * stay in the core's L2 cache while every panel pair a thread owns passes over them. Inner
 * dimensions of a multiple of 32 only (postrl_amx_transpose pads a transposed operand with
 * zeros).
 *
 * The tiles are per thread, and oneDNN and PyTorch use them on the same OpenMP threads: as
 * they do, each call loads its configuration on every thread it runs on and releases the
 * tiles when done (PyTorch's cpublas::brgemm skips reloading a configuration it believes
 * loaded until its users release it, which they do at the end of each parallel region).
 */
#include "amx.h"

#ifdef __AVX512BW__
/* w [n, k] bf16 (contiguous, k a multiple of 32) into packed, pack_nk_tile's layout: the
 * sampler's weights, once per `generate`, for AMX tiles or VDPBF16PS (dpbf16.c). */
void postrl_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int threads) {
    int64_t panels = (n + 15) / 16, blocks = k / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < panels * blocks; tile++)
        pack_nk_tile(w, n, k, k, packed + tile * 512, tile / blocks, tile % blocks);
}

#else
void postrl_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k, int threads) {
    (void)w; (void)packed; (void)n; (void)k; (void)threads;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* 1 when this process may use AMX tiles (Linux grants them on request, once per process). */
int postrl_amx_available(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* dst [c, ld_dst] := src [r, c]^T (bf16, src's row stride ld_src), dst's columns from r to
 * ld_dst zero: the first operand of a product over src's rows, padded to the tiles' 32. */
void postrl_amx_transpose(const uint16_t *src, int64_t r, int64_t c, int64_t ld_src,
                          uint16_t *dst, int64_t ld_dst, int threads) {
    int64_t blocks = (ld_dst + 31) / 32 * ((c + 31) / 32);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < blocks; block++)
        transpose_block(src, r, c, ld_src, dst, ld_dst, block);
}

#define CHUNK_BYTES (128 * 1024) /* a chunk of rows of a (32-96 rows at the update's shapes) */

void postrl_amx_gemm_sum(int segments, const uint16_t *const *a, const int64_t *lda,
                         const int64_t *k, const uint16_t *const *b, const int64_t *kb,
                         const int64_t *ldb, int64_t m, uint16_t *packed,
                         const uint16_t *bias, int64_t n, void *out, int64_t ldc, int mode,
                         int threads);

/* out [m, n] (row stride ldc) = a [m, k] (row stride lda) b (+ bias, bias [n] or NULL), b
 * packed by postrl_bf16_pack (b = W^T) or in pack_kn_tile's layout; `mode` as write_pair's.
 * The panel pairs are split between the threads in contiguous runs; each runs a chunk of a's
 * rows through every pair it owns, 32 rows at a time, before the next chunk. With `b` (not
 * NULL: b [kb, n], row stride ldb, kb <= k), `packed` is scratch: each thread first packs
 * the panels it owns, reading b's rows in order, so they are in its own cache when it runs
 * them (in the update, the linears' gradients took 0.87 of oneDNN's time this way, 0.93 with
 * all of b packed first, in one pass of its own). */
void postrl_amx_gemm(const uint16_t *a, int64_t lda, int64_t m, int64_t k, uint16_t *packed,
                     const uint16_t *b, int64_t kb, int64_t ldb, const uint16_t *bias,
                     int64_t n, void *out, int64_t ldc, int mode, int threads) {
    postrl_amx_gemm_sum(1, &a, &lda, &k, b ? &b : NULL, &kb, &ldb, m, packed, bias, n, out,
                        ldc, mode, threads);
}

/* out [m, n] = sum over `segments` s of a_s [m, k_s] (row stride lda_s, k_s a multiple of 32)
 * b_s [kb_s, n] (row stride ldb_s, rows past kb_s up to k_s zeros), + bias, as one product
 * over the segments' inner dimensions side by side: float32 sums in the tiles, written
 * once (a layer's input gradient over the linears that read its input: dy_q W_q + dy_k W_k
 * + dy_v W_v). b NULL: `packed` holds the packing of b already (one segment). */
void postrl_amx_gemm_sum(int segments, const uint16_t *const *a, const int64_t *lda,
                         const int64_t *k, const uint16_t *const *b, const int64_t *kb,
                         const int64_t *ldb, int64_t m, uint16_t *packed,
                         const uint16_t *bias, int64_t n, void *out, int64_t ldc, int mode,
                         int threads) {
    int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, blocks = 0;
    for (int s = 0; s < segments; s++) blocks += k[s] / 32;
    int64_t width = 32 * blocks; /* the inner dimension in all */
    int64_t chunk = 32 * (CHUNK_BYTES / (64 * width) > 1 ? CHUNK_BYTES / (64 * width) : 1);
    enum { ON_STACK = 128 }; /* blocks: beyond them (an inner dimension past 4,096) malloc */
    const uint16_t *at_stack[ON_STACK], *bt_stack[ON_STACK];
    int64_t lds_stack[3 * ON_STACK];
    int heap = blocks > ON_STACK;
    const uint16_t **at = heap ? malloc((size_t)blocks * sizeof *at) : at_stack; /* each */
    const uint16_t **bt = heap ? malloc((size_t)blocks * sizeof *bt) : bt_stack; /* block's */
    int64_t *lds = heap ? malloc((size_t)blocks * 3 * sizeof *lds) : lds_stack; /* a, b */
    int64_t *rows_b = lds + blocks, *ldbs = rows_b + blocks;
    for (int s = 0, block = 0; s < segments; s++)
        for (int64_t j = 0; j < k[s] / 32; j++, block++) {
            at[block] = a[s] + 32 * j, lds[block] = lda[s];
            if (b) bt[block] = b[s] + 32 * j * ldb[s], rows_b[block] = kb[s] - 32 * j,
                   ldbs[block] = ldb[s];
        }
    const uint16_t *const *table = segments > 1 ? at : NULL;
    if (pairs < threads) threads = (int)pairs;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        int64_t first = pairs * t / count, last = pairs * (t + 1) / count;
        float c[4 * 256];
        int configured = -1;
        if (b) /* this thread's panels, b's rows in order */
            for (int64_t block = 0; block < blocks; block++)
                for (int64_t p = 2 * first; p < 2 * last && p < panels; p++)
                    pack_kn_tile(bt[block], rows_b[block], n, ldbs[block],
                                 packed + (p * blocks + block) * 512, p, 0);
        for (int64_t start = 0; start < m; start += chunk) {
            int64_t end = start + chunk < m ? start + chunk : m;
            for (int64_t q = first; q < last; q++) {
                int two = 2 * q + 1 < panels;
                for (int64_t m0 = start; m0 < end; m0 += 32) {
                    int rows = end - m0 < 32 ? (int)(end - m0) : 32;
                    if (rows != configured) configure(configured = rows);
                    panel_pair(a[0], lda[0], m0, rows, width, packed + 2 * q * blocks * 512,
                               two, c, table, lds);
                    write_pair(c, m0, rows, two, 32 * q, n, bias, out, ldc, mode);
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
    if (heap) {
        free(at);
        free(bt);
        free(lds);
    }
}

/* y [m, n] = x [m, k] W^T + bias (bias [n] or NULL), all bf16, W packed by postrl_bf16_pack;
 * y and x contiguous (dpbf16.c's postrl_bf16_linear calls it where the tiles serve). */
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    postrl_amx_gemm(x, k, m, k, (uint16_t *)packed, NULL, 0, 0, bias, n, y, n, AMX_BF16,
                    threads);
}

#else /* no AMX: the update keeps oneDNN's matmuls, the sampler dpbf16.c's or oneDNN's */
int postrl_amx_available(void) { return 0; }
void postrl_amx_transpose(const uint16_t *src, int64_t r, int64_t c, int64_t ld_src,
                          uint16_t *dst, int64_t ld_dst, int threads) {
    (void)src; (void)r; (void)c; (void)ld_src; (void)dst; (void)ld_dst; (void)threads;
}
void postrl_amx_gemm(const uint16_t *a, int64_t lda, int64_t m, int64_t k, uint16_t *packed,
                     const uint16_t *b, int64_t kb, int64_t ldb, const uint16_t *bias,
                     int64_t n, void *out, int64_t ldc, int mode, int threads) {
    (void)a; (void)lda; (void)m; (void)k; (void)packed; (void)b; (void)kb; (void)ldb;
    (void)bias; (void)n; (void)out; (void)ldc; (void)mode; (void)threads;
}
void postrl_amx_gemm_sum(int segments, const uint16_t *const *a, const int64_t *lda,
                         const int64_t *k, const uint16_t *const *b, const int64_t *kb,
                         const int64_t *ldb, int64_t m, uint16_t *packed,
                         const uint16_t *bias, int64_t n, void *out, int64_t ldc, int mode,
                         int threads) {
    (void)segments; (void)a; (void)lda; (void)k; (void)b; (void)kb; (void)ldb; (void)m;
    (void)packed; (void)bias; (void)n; (void)out; (void)ldc; (void)mode; (void)threads;
}
void postrl_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, uint16_t *y, int threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)bias; (void)n; (void)y; (void)threads;
}
#endif
