/* horolite shared-memory allreduce between the ranks of one host.
 *
 * Every rank owns a region of a shared window: a header of progress counters
 * and `slots` staging slots of `slot_bytes` each. A buffer is reduced block by
 * block (one block = one slot); in each block, segment q belongs to rank q:
 *   stage:  every rank copies its block, except its own segment, into its slot;
 *   reduce: rank q folds its own segment and the other ranks' staged copies of
 *           segment q into the staged copy held by rank (q+1) % n;
 *   gather: every rank copies each reduced segment into its output.
 * Each rank touches its input and output once, and the staged block is still
 * in cache when it is reduced and gathered: the point of the block size.
 * Progress counters (one cache line each) are monotonic across calls, so a
 * slot is reused only once every rank has gathered the block it held.
 */
#ifndef HOROLITE_SHM_RING_H
#define HOROLITE_SHM_RING_H

#include <stddef.h>
#include <stdint.h>

/* Int64 words in a rank's header: three counters, each on its own 64-byte line. */
#define HL_SHM_HEADER_WORDS 24
#define HL_SHM_STAGED 0
#define HL_SHM_REDUCED 8
#define HL_SHM_GATHERED 16

/* dst = allreduce(src) over n ranks (dst may equal src). headers[q] and
 * slots[q] are rank q's header and first slot as mapped in this process.
 * `epoch` is the number of blocks all earlier calls moved (the same on every
 * rank); *resume is 0 on the first call and is kept between calls that
 * returned 1. Waits spin, then yield, then sleep (polite != 0 starts sleeping
 * sooner: for more ranks than cores).
 * Returns 0 when done, 1 when a wait on other ranks passed `timeout_s`
 * (call again with the same arguments to continue), or a negative hl_reduce
 * error code. *blocks is set to the number of blocks this call moves. */
int hl_shm_allreduce(int64_t *const *headers, char *const *slots, int n, int r,
                     size_t slot_bytes, int nslots, const void *src, void *dst,
                     size_t count, int dtype, size_t itemsize, int op, double postscale,
                     int64_t epoch, int64_t *resume, double timeout_s, int polite,
                     int64_t *blocks);

#endif /* HOROLITE_SHM_RING_H */
