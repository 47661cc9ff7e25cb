/* horolite's control board: the per-cycle exchange between the ranks of one host
 * in memory they share, and the wake-ups that go with it.
 *
 * Every rank has a region of the board: its doorbell (an hl_wake word, see
 * wake.h, which the rank's background thread sleeps on between cycles and which
 * its callers ring when they submit), how many rounds it has entered, whether
 * it has work in flight, and two
 * slots (rounds alternate between them) each holding a vector of uint64 words
 * and a mailbox of bytes. A round is the exchange of one cycle: each rank writes
 * its slot and enters; whoever enters last bumps the board's round word and wakes
 * the ranks sleeping on it. A rank that enters with news rings the doorbell of
 * the ranks that have not (see hl_board_enter), so a peer pausing between
 * cycles starts its cycle at once instead of when its pause ends. A slot is written again two rounds later,
 * once every rank has entered the round in between, so every rank has read it.
 *
 * The words are shared between processes, so every futex operation on them is
 * non-private (FUTEX_WAIT/FUTEX_WAKE without FUTEX_PRIVATE_FLAG).
 */
#ifndef HOROLITE_SHM_BOARD_H
#define HOROLITE_SHM_BOARD_H

#include <stddef.h>
#include <stdint.h>

#include "wake.h"

/* Bytes of a board for n ranks, vectors of `words` uint64 and mailboxes of
 * `mailbox` bytes (a multiple of 64). */
size_t hl_board_bytes(int n, int words, size_t mailbox);
/* Rank q's doorbell, vector and mailbox of slot `parity` (0 or 1), and the rounds
 * it has entered. */
hl_wake *hl_board_doorbell(char *board, int n, int words, size_t mailbox, int q);
uint64_t *hl_board_vector(char *board, int n, int words, size_t mailbox, int q, int parity);
char *hl_board_mailbox(char *board, int n, int words, size_t mailbox, int q, int parity);
int64_t hl_board_entered(char *board, int n, int words, size_t mailbox, int q);

/* Enter round `round` (this rank's vector and mailbox of slot round & 1 already
 * written); the last to enter completes the round. Returns 1 if the round is
 * complete, else 0. `ring` says whose doorbells it rings among the ranks not in
 * the round yet: HL_BOARD_RING_ALL (this rank brings news every rank must act
 * on), HL_BOARD_RING_BUSY (only ranks with work in flight, which may be pausing
 * with the same work ready: an idle rank is woken by its own submit instead), or
 * HL_BOARD_RING_NONE. */
#define HL_BOARD_RING_NONE 0
#define HL_BOARD_RING_BUSY 1
#define HL_BOARD_RING_ALL 2
int hl_board_enter(char *board, int n, int words, size_t mailbox, int r, int64_t round,
                   int ring);
/* Publish whether this rank has work in flight (read by HL_BOARD_RING_BUSY). */
void hl_board_set_busy(char *board, int n, int words, size_t mailbox, int r, int on);
/* Until round `round` is complete: spins for spin_s, then sleeps in the round
 * word's futex until the last rank wakes it. 0 when complete, 1 when timeout_s
 * passed first (call again to go on waiting). */
int hl_board_wait(char *board, int n, int words, size_t mailbox, int64_t round,
                  double timeout_s, double spin_s);
/* out = the bitwise OR of every rank's vector of slot round & 1. */
void hl_board_or(char *board, int n, int words, size_t mailbox, int64_t round, uint64_t *out);

/* Small tensors carried in a round: a rank's mailbox of the round's slot then
 * opens with a table (int64 count, then count triples of int64 cache slot,
 * byte offset in the mailbox, byte count), the data at those offsets. Every
 * rank carried the same slot (the round's vectors say so): out = the reduction
 * of every rank's bytes for `slot`, in rank order (so every rank computes the
 * same bits), then scaled by postscale. 0, a kernels.h HL_E* code, or
 * HL_BOARD_ENOTCARRIED when some rank's table lacks the slot or its byte count
 * is not `nbytes`. */
#define HL_BOARD_ENOTCARRIED (-20)
int hl_board_reduce_carried(char *board, int n, int words, size_t mailbox, int64_t round,
                            int64_t slot, void *out, size_t nbytes, size_t count, int dtype,
                            int op, double postscale);

/* A futex-backed wait for words shared between processes: the value of *bell (a
 * counter every change of interest bumps with hl_bell_ring) before looking, then
 * hl_bell_sleep(bell, seen, timeout) if what was looked for is not there yet. */
void hl_bell_ring(uint32_t *bell, uint32_t *sleepers);
void hl_bell_sleep(uint32_t *bell, uint32_t *sleepers, uint32_t seen, double timeout_s);

#endif /* HOROLITE_SHM_BOARD_H */
