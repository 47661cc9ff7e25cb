/* horolite shared-memory allreduce between the ranks of one host.
 *
 * Every rank owns a region of a shared window: a header of progress counters
 * and `slots` staging slots of `slot_bytes` each. A buffer is reduced block by
 * block (one block = one slot); in each block, segment q belongs to rank q:
 *   stage:  every rank copies its block, except its own segment, into its slot;
 *   reduce: rank q folds its own segment and the other ranks' staged copies of
 *           segment q into the staged copy held by rank (q+1) % n;
 *   gather: every rank copies each reduced segment into its output.
 * When every rank's output lies in its result arena (memory the other ranks
 * have mapped too), the call is "direct": rank q writes its reduced segment
 * straight into every rank's output and there is no gather pass, so each
 * result byte crosses from one core to another once instead of twice. Every
 * rank publishes where its output is before it stages its first block, so
 * all ranks see the same offsets and choose the same way. When moreover every
 * rank reduces in place (src == dst, as a fused batch does), the call is
 * "shared": after block 0 nobody stages at all, and the owner of a segment
 * reads it from every rank's buffer directly.
 * In both, a float32/float64 sum (or average) makes its last addition and the
 * writes to every rank's result one pass (hl_sum_to_all): the owner's core
 * then reads and writes memory at once instead of one after the other, which
 * on a 2-core VM took 64 MiB from ~1.35x to ~1.1x the time of one numpy.add.
 * Each rank touches its input and output once, and the staged block is still
 * in cache when it is reduced: the point of the block size.
 * Progress counters (one cache line each) are monotonic across calls, so a
 * slot is reused only once every rank is done with the block it held.
 */
#ifndef HOROLITE_SHM_RING_H
#define HOROLITE_SHM_RING_H

#include <stddef.h>
#include <stdint.h>

/* Int64 words in a rank's header: three progress counters, each on its own
 * 64-byte line, and on a fourth line the offset of the current call's output in
 * the rank's arena and whether the call is in place. */
#define HL_SHM_HEADER_WORDS 32
#define HL_SHM_STAGED 0
#define HL_SHM_REDUCED 8
#define HL_SHM_GATHERED 16
#define HL_SHM_OUT_OFFSET 24
#define HL_SHM_IN_PLACE 25
/* In rank 0's header only: the bell every counter store rings (a uint32 counter),
 * and how many ranks sleep on it (shm_board.h's hl_bell_*). */
#define HL_SHM_BELL 28

/* Calls of at most this many bytes go in one shot: each rank stages its whole
 * buffer and reduces all ranks' copies itself (one wait instead of two). */
#define HL_SHM_ONE_SHOT_BYTES ((size_t)32 << 10)

/* state[1] of a call: set to HL_SHM_UNPUBLISHED before the first try */
#define HL_SHM_UNPUBLISHED (-2)
#define HL_SHM_UNDECIDED (-1)
#define HL_SHM_GATHER 0
#define HL_SHM_DIRECT 1
#define HL_SHM_SHARED 2
#define HL_SHM_ONE_SHOT 3

/* dst = allreduce(input) over n ranks. The input is the concatenation of
 * `nparts` arrays: parts[i] holds elements [starts[i], starts[i + 1]) (starts
 * has nparts + 1 entries, starts[0] = 0, starts[nparts] = count), so the members
 * of a fused batch are read where they lie instead of being packed first. With
 * one part, dst may equal parts[0] (in place). headers[q] and
 * slots[q] are rank q's header and first slot as mapped in this process;
 * arenas[q] is rank q's result arena of arena_bytes as mapped here, or arenas
 * is NULL when there are none. `epoch` is the number of blocks all earlier
 * calls moved (the same on every rank). state holds 2 + n int64: state[0] = 0
 * and state[1] = HL_SHM_UNPUBLISHED on the first try, kept as they are between
 * tries of one call. Waits spin, then yield, then sleep (polite != 0 starts
 * sleeping sooner: for more ranks than cores).
 * Returns 0 when done, 1 when a wait on other ranks passed `timeout_s`
 * (call again with the same arguments to continue), or a negative hl_reduce
 * error code. *blocks is set to the number of blocks this call moves. */
int hl_shm_allreduce(int64_t *const *headers, char *const *slots, char *const *arenas,
                     size_t arena_bytes, int n, int r, size_t slot_bytes, int nslots,
                     const char *const *parts, const int64_t *starts, int nparts, void *dst,
                     size_t count, int dtype, size_t itemsize, int op, double postscale,
                     int64_t epoch, int64_t *state, double timeout_s, int polite,
                     int64_t *blocks);

#endif /* HOROLITE_SHM_RING_H */
