/* See wake.h. Linux futexes; elsewhere a short sleep loop (no other platform is
 * supported by the launcher, but the package still builds). The futex ops are the
 * shared kind (no FUTEX_PRIVATE_FLAG): a word may lie in memory that other processes
 * map too (the control board's doorbells, transport/control_board.py). */
#include "wake.h"

#include <errno.h>
#include <limits.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

void hl_wake_set(void *arg) {
    hl_wake *wake = (hl_wake *)arg;
    if (__atomic_exchange_n(&wake->set, 1u, __ATOMIC_SEQ_CST) == 0u &&
        __atomic_load_n(&wake->waiters, __ATOMIC_SEQ_CST) != 0u) {
#ifdef __linux__
        syscall(SYS_futex, &wake->set, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
    }
}

void hl_wake_clear(hl_wake *wake) {
    __atomic_store_n(&wake->set, 0u, __ATOMIC_SEQ_CST);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int hl_wake_wait(hl_wake *wake, double timeout_s) {
    if (__atomic_load_n(&wake->set, __ATOMIC_SEQ_CST))
        return 1;
    double deadline = timeout_s < 0 ? -1.0 : now_s() + timeout_s;
    __atomic_add_fetch(&wake->waiters, 1u, __ATOMIC_SEQ_CST);
    while (!__atomic_load_n(&wake->set, __ATOMIC_SEQ_CST)) {
        struct timespec ts, *tsp = NULL;
        if (deadline >= 0) {
            double left = deadline - now_s();
            if (left <= 0)
                break;
            ts.tv_sec = (time_t)left;
            ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
            tsp = &ts;
        }
#ifdef __linux__
        /* Sleeps only while the word is still 0: a set() in between returns at once. */
        syscall(SYS_futex, &wake->set, FUTEX_WAIT, 0u, tsp, NULL, 0);
#else
        struct timespec nap = {0, 50000};
        (void)tsp;
        nanosleep(&nap, NULL);
#endif
    }
    __atomic_sub_fetch(&wake->waiters, 1u, __ATOMIC_SEQ_CST);
    return (int)__atomic_load_n(&wake->set, __ATOMIC_SEQ_CST);
}
