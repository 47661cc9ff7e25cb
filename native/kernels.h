/* horolite native kernels: reductions, scaling and fusion-buffer packing.
 *
 * Dtype and op codes mirror horolite/ops.py. Every function returns 0 on
 * success or a negative HL_E* code; on error nothing has been written.
 * Buffers are plain element arrays; acc/src (and dst/src) may be the same
 * pointer but must not otherwise overlap.
 */
#ifndef HOROLITE_KERNELS_H
#define HOROLITE_KERNELS_H

#include <stddef.h>

/* dtype codes (horolite.ops.REDUCIBLE_DTYPES) */
#define HL_UINT8 0
#define HL_INT8 1
#define HL_INT32 2
#define HL_INT64 3
#define HL_FLOAT16 4
#define HL_BFLOAT16 5
#define HL_FLOAT32 6
#define HL_FLOAT64 7
#define HL_UINT16 8
#define HL_INT16 9

/* op codes (horolite.ops.ReduceOp); AVERAGE is SUM with 1/n folded into postscale */
#define HL_SUM 1
#define HL_MIN 3
#define HL_MAX 4
#define HL_PRODUCT 5

/* error codes */
#define HL_EDTYPE (-1)  /* unknown dtype code */
#define HL_EOP (-2)     /* unknown op code */
#define HL_ESIZE (-3)   /* a byte count is not a multiple of the element size */
#define HL_ESCALE (-4)  /* non-finite scale factor for an integer dtype */

/* acc[i] = (acc[i] op src[i]) * postscale, in one pass; postscale == 1.0
 * skips the multiply. float16/bfloat16 compute in float32 and round to
 * nearest even. Integer sum/product wrap around; a scaled integer result is
 * computed in double, truncated toward zero and saturated to the dtype's range. */
int hl_reduce(void *acc, const void *src, size_t count, int dtype, int op, double postscale);

/* dst[i] = src[i] * factor (dst may equal src); same rounding rules as hl_reduce. */
int hl_scale(void *dst, const void *src, size_t count, int dtype, double factor);

/* Copy n buffers back to back into dst. factor == 1.0 copies bytes and ignores
 * dtype; otherwise every buffer holds elements of dtype and is scaled while
 * copying. */
int hl_pack(void *dst, const void *const *srcs, const size_t *nbytes, size_t n, int dtype, double factor);

/* A copy with non-temporal stores where the CPU has them (else memcpy), for
 * outputs too large to be read back from cache: it skips the read-for-ownership
 * of every output line, a third of the traffic. Call hl_streaming_done before
 * another thread or process may read the output. hl_pack streams from
 * HL_STREAM_BYTES in all. (Shared by the C files; not part of the Python API.) */
#define HL_STREAM_BYTES ((size_t)8 << 20)
void hl_copy_streaming(void *dst, const void *src, size_t bytes);
void hl_streaming_done(void);

/* dsts[q][i] = (a[i] + b[i]) * postscale for q < ndst (postscale 1.0: no
 * multiply), float32 or float64, rounded as hl_reduce rounds: one pass that
 * reads two streams and writes every output, with non-temporal stores when
 * `stream` (call hl_streaming_done after). Reading and writing in the same
 * loop keeps both directions of the memory path busy, which a reduce and then
 * a copy do not. Returns 0, or 1 (nothing written) when hl_has_sum_to_all
 * says there is no such pass for dtype on this CPU. (Shared by the C files;
 * not part of the Python API.) */
int hl_has_sum_to_all(int dtype);
int hl_sum_to_all(void *const *dsts, int ndst, const void *a, const void *b, size_t count,
                  int dtype, double postscale, int stream);

/* Copy consecutive nbytes[i] bytes of src into dsts[i]. */
int hl_unpack(void *const *dsts, const void *src, const size_t *nbytes, size_t n);

/* Instruction-set levels: 0 = portable build, 1 = x86-64-v3 (AVX2, FMA, F16C).
 * hl_isa_name returns NULL for a level this build or this CPU cannot run.
 * hl_isa_set selects the level used by later calls (for tests and
 * benchmarks; the best supported level is chosen on first use) and returns 0,
 * or -1 if the level is unavailable. */
int hl_isa_get(void);
int hl_isa_set(int level);
const char *hl_isa_name(int level);

#endif /* HOROLITE_KERNELS_H */
