/* The control board between the ranks of one host: see shm_board.h. */
#include "shm_board.h"
#include "wake.h"
#include "kernels.h"

#include <limits.h>
#include <string.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "relax.h"

#define LINE 64

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* FUTEX_WAIT/FUTEX_WAKE without the private flag: the word is in a shared mapping. */
static void futex_sleep(uint32_t *word, uint32_t seen, double timeout_s)
{
#ifdef __linux__
    struct timespec ts, *tsp = NULL;
    if (timeout_s >= 0) {
        ts.tv_sec = (time_t)timeout_s;
        ts.tv_nsec = (long)((timeout_s - (double)ts.tv_sec) * 1e9);
        tsp = &ts;
    }
    syscall(SYS_futex, word, FUTEX_WAIT, seen, tsp, NULL, 0);
#else
    struct timespec nap = {0, 50000};
    (void)word, (void)seen, (void)timeout_s;
    nanosleep(&nap, NULL);
#endif
}

static void futex_wake_all(uint32_t *word)
{
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

static size_t round_up(size_t x) { return (x + LINE - 1) / LINE * LINE; }

static size_t slot_bytes(int words, size_t mailbox) { return round_up((size_t)words * 8) + mailbox; }

static size_t region_bytes(int words, size_t mailbox) { return 2 * LINE + 2 * slot_bytes(words, mailbox); }

static char *region(char *board, int words, size_t mailbox, int q)
{
    return board + LINE + (size_t)q * region_bytes(words, mailbox);
}

size_t hl_board_bytes(int n, int words, size_t mailbox)
{
    return LINE + (size_t)n * region_bytes(words, mailbox);
}

hl_wake *hl_board_doorbell(char *board, int n, int words, size_t mailbox, int q)
{
    (void)n;
    return (hl_wake *)region(board, words, mailbox, q);
}

static int64_t *entered(char *board, int words, size_t mailbox, int q)
{
    return (int64_t *)(region(board, words, mailbox, q) + LINE);
}

uint64_t *hl_board_vector(char *board, int n, int words, size_t mailbox, int q, int parity)
{
    (void)n;
    return (uint64_t *)(region(board, words, mailbox, q) + 2 * LINE +
                        (size_t)(parity & 1) * slot_bytes(words, mailbox));
}

char *hl_board_mailbox(char *board, int n, int words, size_t mailbox, int q, int parity)
{
    return (char *)hl_board_vector(board, n, words, mailbox, q, parity) +
           round_up((size_t)words * 8);
}

int64_t hl_board_entered(char *board, int n, int words, size_t mailbox, int q)
{
    (void)n;
    return __atomic_load_n(entered(board, words, mailbox, q), __ATOMIC_ACQUIRE);
}

/* The board's header: the number of complete rounds (low 32 bits) and how many
 * ranks sleep on it. */
static uint32_t *round_word(char *board) { return (uint32_t *)board; }
static uint32_t *round_sleepers(char *board) { return (uint32_t *)board + 1; }

/* Whether rank q has work in flight (hl_board_set_busy), beside its round count. */
static int64_t *busy(char *board, int words, size_t mailbox, int q)
{
    return entered(board, words, mailbox, q) + 1;
}

void hl_board_set_busy(char *board, int n, int words, size_t mailbox, int r, int on)
{
    (void)n;
    __atomic_store_n(busy(board, words, mailbox, r), (int64_t)(on != 0), __ATOMIC_SEQ_CST);
}

int hl_board_enter(char *board, int n, int words, size_t mailbox, int r, int64_t round,
                   int ring)
{
    __atomic_store_n(entered(board, words, mailbox, r), round + 1, __ATOMIC_SEQ_CST);
    int all = 1;
    for (int q = 0; q < n; q++) {
        if (__atomic_load_n(entered(board, words, mailbox, q), __ATOMIC_SEQ_CST) <= round) {
            all = 0;
            if (ring == HL_BOARD_RING_ALL ||
                (ring == HL_BOARD_RING_BUSY &&
                 __atomic_load_n(busy(board, words, mailbox, q), __ATOMIC_SEQ_CST)))
                hl_wake_set(hl_board_doorbell(board, n, words, mailbox, q));
        }
    }
    if (!all)
        return 0;
    /* Every rank has entered (each one's store came before its own look, so at
     * least one rank sees them all): complete the round once, and wake sleepers. */
    uint32_t expected = (uint32_t)round;
    if (__atomic_compare_exchange_n(round_word(board), &expected, (uint32_t)(round + 1), 0,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST) &&
        __atomic_load_n(round_sleepers(board), __ATOMIC_SEQ_CST) != 0)
        futex_wake_all(round_word(board));
    return 1;
}

int hl_board_wait(char *board, int n, int words, size_t mailbox, int64_t round,
                  double timeout_s, double spin_s)
{
    (void)n, (void)words, (void)mailbox;
    uint32_t *word = round_word(board);
    const uint32_t open = (uint32_t)round;
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != open)
        return 0;
    const double start = now_s(), deadline = start + timeout_s;
    for (unsigned iter = 1;; iter++) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != open)
            return 0;
        if ((iter & 63) == 0 && now_s() - start >= spin_s)
            break;
        HL_RELAX();
    }
    uint32_t *sleepers = round_sleepers(board);
    __atomic_add_fetch(sleepers, 1u, __ATOMIC_SEQ_CST);
    int rc = 0;
    while (__atomic_load_n(word, __ATOMIC_SEQ_CST) == open) {
        double left = deadline - now_s();
        if (left <= 0) {
            rc = 1;
            break;
        }
        futex_sleep(word, open, left); /* returns at once if the round completed meanwhile */
    }
    __atomic_sub_fetch(sleepers, 1u, __ATOMIC_SEQ_CST);
    return rc;
}

void hl_board_or(char *board, int n, int words, size_t mailbox, int64_t round, uint64_t *out)
{
    memcpy(out, hl_board_vector(board, n, words, mailbox, 0, (int)(round & 1)),
           (size_t)words * 8);
    for (int q = 1; q < n; q++) {
        const uint64_t *v = hl_board_vector(board, n, words, mailbox, q, (int)(round & 1));
        for (int w = 0; w < words; w++)
            out[w] |= v[w];
    }
}

int hl_board_reduce_carried(char *board, int n, int words, size_t mailbox, int64_t round,
                            int64_t slot, void *out, size_t nbytes, size_t count, int dtype,
                            int op, double postscale)
{
    for (int q = 0; q < n; q++) {
        const char *box = hl_board_mailbox(board, n, words, mailbox, q, (int)(round & 1));
        const int64_t *table = (const int64_t *)box;
        const char *src = NULL;
        for (int64_t i = 0; i < table[0]; i++) {
            const int64_t *row = table + 1 + 3 * i;
            if (row[0] == slot) {
                if (row[2] != (int64_t)nbytes || row[1] < 0 ||
                    (size_t)row[1] + nbytes > mailbox)
                    return HL_BOARD_ENOTCARRIED;
                src = box + row[1];
                break;
            }
        }
        if (src == NULL)
            return HL_BOARD_ENOTCARRIED;
        int rc = q == 0 ? (memcpy(out, src, nbytes), 0)
                        : hl_reduce(out, src, count, dtype, op, 1.0);
        if (rc)
            return rc;
    }
    /* Scaled after the reduced value is rounded to the dtype, as the other paths do
     * (float16: the sum rounds to float16 first). */
    if (postscale != 1.0)
        return hl_scale(out, out, count, dtype, postscale);
    return 0;
}

void hl_bell_ring(uint32_t *bell, uint32_t *sleepers)
{
    __atomic_add_fetch(bell, 1u, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST) != 0u)
        futex_wake_all(bell);
}

void hl_bell_sleep(uint32_t *bell, uint32_t *sleepers, uint32_t seen, double timeout_s)
{
    __atomic_add_fetch(sleepers, 1u, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(bell, __ATOMIC_SEQ_CST) == seen)
        futex_sleep(bell, seen, timeout_s);
    __atomic_sub_fetch(sleepers, 1u, __ATOMIC_SEQ_CST);
}
