/* horolite's wake-up between threads of one process: an event (set, clear,
 * wait) on one 32-bit word, waited on with a futex.
 *
 * The background thread sleeps on it when it has nothing to do. Python callers
 * set it through cffi after a submit; native code that queues work (the
 * TensorFlow ops) sets it through the function pointer hl_wake_set, without
 * Python or the GIL. wait() is called through cffi, which releases the GIL. The
 * word may lie in memory several processes map (a rank's doorbell on the control
 * board): its futex ops are the shared kind.
 */
#ifndef HOROLITE_WAKE_H
#define HOROLITE_WAKE_H

#include <stdint.h>

typedef struct {
    uint32_t set;      /* 1 while set */
    uint32_t waiters;  /* threads inside hl_wake_wait's futex wait */
} hl_wake;

void hl_wake_set(void *wake);
void hl_wake_clear(hl_wake *wake);
/* 1 if set (at once, or within timeout_s; a negative timeout waits forever), else 0. */
int hl_wake_wait(hl_wake *wake, double timeout_s);

#endif
