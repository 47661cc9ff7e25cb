/* The shared-memory allreduce: see shm_ring.h for the algorithm. */
#include "shm_ring.h"
#include "kernels.h"
#include "shm_board.h"

#include <string.h>
#include <time.h>

#ifdef _WIN32
#include <windows.h>
static void hl_yield(void) { SwitchToThread(); }
static double hl_now(void) { return (double)GetTickCount64() / 1e3; }
#else
#include <sched.h>
static void hl_yield(void) { sched_yield(); }
static double hl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}
#endif

#include "relax.h"

/* Most ranks sum_to_all writes to at once (more use reduce + copy) */
#define HL_SHM_MAX_FUSED_RANKS 64

/* Owners reduce and write results this many bytes at a time, while they are in L1. */
#define CHUNK_BYTES 16384

/* A result copy: streaming when the output is too large to be read back from cache. */
static void copy_out(char *dst, const char *src, size_t bytes, int stream)
{
    if (stream)
        hl_copy_streaming(dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

/* The input: the concatenation of parts (see shm_ring.h). */
struct input {
    const char *const *parts;
    const int64_t *starts;
    int nparts;
    size_t itemsize;
};

/* The part holding element `at`: the last i with starts[i] <= at < starts[i + 1]. */
static int part_of(const struct input *in, size_t at)
{
    int lo = 0, hi = in->nparts - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((size_t)in->starts[mid] <= at)
            lo = mid;
        else
            hi = mid - 1;
    }
    while (lo + 1 < in->nparts && (size_t)in->starts[lo + 1] <= at)
        lo++; /* past empty parts */
    return lo;
}

/* Copy elements [at, at + len) of the input to `to`. */
static void read_input(char *to, const struct input *in, size_t at, size_t len)
{
    if (len == 0)
        return;
    for (int i = part_of(in, at); len > 0; i++) {
        size_t end = (size_t)in->starts[i + 1];
        if (end <= at)
            continue;
        size_t take = end - at < len ? end - at : len;
        memcpy(to, in->parts[i] + (at - (size_t)in->starts[i]) * in->itemsize,
               take * in->itemsize);
        to += take * in->itemsize, at += take, len -= take;
    }
}

/* Elements [at, at + len) of the input as one pointer: into their part when they
 * lie in one (always, with one part), else copied into `scratch`. */
static const char *input_at(const struct input *in, size_t at, size_t len, char *scratch)
{
    int i = part_of(in, at);
    if (at + len <= (size_t)in->starts[i + 1])
        return in->parts[i] + (at - (size_t)in->starts[i]) * in->itemsize;
    read_input(scratch, in, at, len);
    return scratch;
}

static int64_t load_counter(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* The bell every counter store rings (rank 0's header): a rank that has waited past
 * its spin sleeps on it until a store it may be waiting for (shm_board.h). */
static uint32_t *bell(int64_t *const *headers) { return (uint32_t *)&headers[0][HL_SHM_BELL]; }
static uint32_t *bell_sleepers(int64_t *const *headers)
{
    return (uint32_t *)&headers[0][HL_SHM_BELL + 1];
}

static void store_counter(int64_t *const *headers, int r, int word, int64_t v)
{
    __atomic_store_n(&headers[r][word], v, __ATOMIC_SEQ_CST);
    hl_bell_ring(bell(headers), bell_sleepers(headers));
}

/* Until every rank's counter `word` is >= want: 0, or 1 once `deadline` passed.
 * A partner that is running answers within microseconds, so spin first; then
 * give the core away a while (ranks may outnumber cores); then sleep on the bell
 * until the next counter store wakes this rank (never a timed sleep). */
static int wait_all(int64_t *const *headers, int n, int word, int64_t want, double deadline,
                    int polite)
{
    const double spin_s = polite ? 2e-6 : 50e-6, yield_s = polite ? 100e-6 : 200e-6;
    double start = 0.0, elapsed = 0.0;
    for (unsigned iter = 0;; iter++) {
        const uint32_t seen = __atomic_load_n(bell(headers), __ATOMIC_SEQ_CST);
        int q = 0;
        while (q < n && load_counter(&headers[q][word]) >= want)
            q++;
        if (q == n)
            return 0;
        if ((iter & 31) == 0 || elapsed >= yield_s) {
            double now = hl_now();
            if (iter == 0)
                start = now;
            elapsed = now - start;
            if (now > deadline)
                return 1;
            if (elapsed >= yield_s) {
                hl_bell_sleep(bell(headers), bell_sleepers(headers), seen, deadline - now);
                continue;
            }
        }
        if (elapsed < spin_s)
            HL_RELAX();
        else
            hl_yield();
    }
}

/* Phase 1, owner side: fold the other ranks' staged copies of my segment into
 * the copy staged by my successor; `in` is my own input for the segment. */
static int reduce_segment(char *const *slots, int n, int r, size_t at, const char *in,
                          size_t len, int dtype, int op, double postscale)
{
    char *acc = slots[(r + 1) % n] + at;
    int rc = hl_reduce(acc, in, len, dtype, op, n == 2 ? postscale : 1.0);
    for (int d = 2; d < n && rc == 0; d++)
        rc = hl_reduce(acc, slots[(r + d) % n] + at, len, dtype, op,
                       d == n - 1 ? postscale : 1.0);
    return rc;
}

/* Whether an owner's last addition and its writes to every result can be one
 * pass (hl_sum_to_all) */
static int one_pass(int op, int n, int dtype)
{
    return op == HL_SUM && n <= HL_SHM_MAX_FUSED_RANKS && hl_has_sum_to_all(dtype);
}

/* Direct mode, owner side, for a sum: one chunk of my segment (staged copies at
 * `at` in the slots, my input at `in`) summed and written to every rank's result
 * at byte `out_at` in the same pass as its last addition (hl_sum_to_all). With
 * more than two ranks the others' copies are folded first, as reduce_segment
 * does, into the copy my successor staged. 0 or a negative hl_reduce error; only
 * for a dtype hl_has_sum_to_all accepts. */
static int sum_to_all(char *const *slots, char *const *arenas, const int64_t *offsets, int n,
                      int r, size_t at, const char *in, size_t out_at, size_t count,
                      int dtype, double postscale, int stream)
{
    void *outs[HL_SHM_MAX_FUSED_RANKS];
    for (int q = 0; q < n; q++)
        outs[q] = arenas[q] + offsets[q] + out_at;
    /* the operands in reduce_segment's order, so the sums round alike bit for bit */
    const char *x = slots[(r + 1) % n] + at, *y = in;
    if (n > 2) {
        char *acc = slots[(r + 1) % n] + at;
        int rc;
        if ((rc = hl_reduce(acc, in, count, dtype, HL_SUM, 1.0)) < 0)
            return rc;
        for (int d = 2; d < n - 1; d++)
            if ((rc = hl_reduce(acc, slots[(r + d) % n] + at, count, dtype, HL_SUM, 1.0)) < 0)
                return rc;
        x = acc, y = slots[(r + n - 1) % n] + at;
    }
    return hl_sum_to_all(outs, n, x, y, count, dtype, postscale, stream);
}

/* Shared mode, owner side: elements [at, at + len) of every rank's buffer (all in
 * arenas, each its own input and output) reduced a chunk at a time in a private
 * scratch buffer, then written back into every rank's buffer. Only the owner
 * reads or writes these elements, so no rank waits on another in between. */
static int reduce_shared(char *const *arenas, const int64_t *offsets, int n, int r,
                         size_t at, size_t len, int dtype, size_t itemsize, int op,
                         double postscale, int stream)
{
    char scratch[CHUNK_BYTES] __attribute__((aligned(64)));
    const size_t chunk = sizeof scratch / itemsize;
    const int fused = one_pass(op, n, dtype);
    void *outs[HL_SHM_MAX_FUSED_RANKS];
    for (size_t c = at; c < at + len; c += chunk) {
        const size_t cl = (at + len - c < chunk) ? at + len - c : chunk;
        const size_t byte = c * itemsize;
        if (fused) {
            /* as below, but the last addition writes every buffer in the same pass
             * (each element is read before it is overwritten: same index) */
            for (int q = 0; q < n; q++)
                outs[q] = arenas[q] + offsets[q] + byte;
            const char *x = outs[r];
            if (n > 2) {
                memcpy(scratch, outs[r], cl * itemsize);
                for (int d = 1; d < n - 1; d++)
                    hl_reduce(scratch, outs[(r + d) % n], cl, dtype, op, 1.0);
                x = scratch;
            }
            hl_sum_to_all(outs, n, x, outs[(r + n - 1) % n], cl, dtype, postscale, stream);
            continue;
        }
        memcpy(scratch, arenas[r] + offsets[r] + byte, cl * itemsize);
        for (int d = 1; d < n; d++) {
            int q = (r + d) % n;
            int rc = hl_reduce(scratch, arenas[q] + offsets[q] + byte, cl, dtype, op,
                               d == n - 1 ? postscale : 1.0);
            if (rc < 0)
                return rc;
        }
        for (int q = 0; q < n; q++)
            copy_out(arenas[q] + offsets[q] + byte, scratch, cl * itemsize, stream);
    }
    if (stream)
        hl_streaming_done(); /* streaming stores are weakly ordered */
    return 0;
}

int hl_shm_allreduce(int64_t *const *headers, char *const *slots, char *const *arenas,
                     size_t arena_bytes, int n, int r, size_t slot_bytes, int nslots,
                     const char *const *parts, const int64_t *starts, int nparts, void *dst,
                     size_t count, int dtype, size_t itemsize, int op, double postscale,
                     int64_t epoch, int64_t *state, double timeout_s, int polite,
                     int64_t *blocks)
{
    const size_t per_block = slot_bytes / itemsize;
    const int64_t nblocks = (int64_t)((count + per_block - 1) / per_block);
    const struct input in = {parts, starts, nparts, itemsize};
    /* an owner's input chunk that spans two parts is read into this */
    char scratch[CHUNK_BYTES] __attribute__((aligned(64)));
    char *out = (char *)dst;
    const double deadline = hl_now() + timeout_s;
    /* an output larger than this is not expected to be read back from cache */
    const int stream = count * itemsize >= HL_STREAM_BYTES;
    const size_t chunk = CHUNK_BYTES / itemsize;
    int64_t *const offsets = state + 2;
    *blocks = nblocks;

    if (count > 0 && count * itemsize <= HL_SHM_ONE_SHOT_BYTES && count <= per_block) {
        /* One shot: every rank stages all of its buffer and reduces every rank's copy
         * itself, in rank order (so every rank rounds alike): one wait on the others
         * instead of two. Every rank decides alike (same count and dtype). */
        const int64_t kk = epoch;
        const size_t off = (size_t)(kk % nslots) * slot_bytes, bytes = count * itemsize;
        int rc;
        if (state[0] == 0) {
            if (wait_all(headers, n, HL_SHM_GATHERED, kk - nslots + 1, deadline, polite))
                return 1;
            read_input(slots[r] + off, &in, 0, count); /* every part, in order */
            store_counter(headers, r, HL_SHM_STAGED, kk + 1);
            state[0] = 1;
            state[1] = HL_SHM_ONE_SHOT;
        }
        if (wait_all(headers, n, HL_SHM_STAGED, kk + 1, deadline, polite))
            return 1;
        memcpy(out, slots[0] + off, bytes);
        for (int q = 1; q < n; q++)
            if ((rc = hl_reduce(out, slots[q] + off, count, dtype, op,
                                q == n - 1 ? postscale : 1.0)) < 0)
                return rc;
        store_counter(headers, r, HL_SHM_REDUCED, kk + 1);
        store_counter(headers, r, HL_SHM_GATHERED, kk + 1); /* done reading the slots */
        state[0] = 3;
        return 0;
    }

    if (state[1] == HL_SHM_UNPUBLISHED) {
        /* where my result is in my arena, or -1; read by the others once they see
         * my first block staged (the release below orders the two) */
        int64_t off = -1;
        if (arenas != NULL && out >= arenas[r] &&
            (size_t)(out - arenas[r]) + count * itemsize <= arena_bytes)
            off = (int64_t)(out - arenas[r]);
        __atomic_store_n(&headers[r][HL_SHM_OUT_OFFSET], off, __ATOMIC_RELAXED);
        const int in_place = off >= 0 && nparts == 1 && parts[0] == out;
        __atomic_store_n(&headers[r][HL_SHM_IN_PLACE], (int64_t)in_place,
                         __ATOMIC_RELAXED);
        state[1] = HL_SHM_UNDECIDED;
    }
    for (int64_t pos = state[0]; pos < nblocks * 3; pos++) {
        const int64_t k = pos / 3, kk = epoch + k;
        const int phase = (int)(pos % 3);
        const size_t lo = (size_t)k * per_block;
        const size_t m = (count - lo < per_block) ? count - lo : per_block;
        const size_t slot_off = (size_t)(kk % nslots) * slot_bytes;
        const int direct = state[1] == HL_SHM_DIRECT;
        const int shared = state[1] == HL_SHM_SHARED;
        /* segment q of this block: elements [seg(q), seg(q + 1)) counted from lo */
#define SEG(q) (m * (size_t)(q) / (size_t)n)
        int rc;
        if (shared && k > 0) {
            /* every rank's buffer was in place when it staged block 0: nothing to stage,
             * nothing to wait for, and each owner reads the others' buffers directly */
            if (phase == 1) {
                size_t a = SEG(r), len = SEG(r + 1) - a;
                if (len && (rc = reduce_shared(arenas, offsets, n, r, lo + a, len, dtype,
                                               itemsize, op, postscale, stream)) < 0)
                    return rc;
                store_counter(headers, r, HL_SHM_REDUCED, kk + 1);
            }
        } else if (phase == 0) {
            /* my slot held block kk - nslots: free once every rank is done with it,
             * which a direct block says by its owners' REDUCED, else by GATHERED */
            int word = (direct && kk - nslots >= epoch) ? HL_SHM_REDUCED : HL_SHM_GATHERED;
            if (wait_all(headers, n, word, kk - nslots + 1, deadline, polite)) {
                state[0] = pos;
                return 1;
            }
            char *mine = slots[r] + slot_off;
            size_t a = SEG(r), b = SEG(r + 1);
            read_input(mine, &in, lo, a);
            read_input(mine + b * itemsize, &in, lo + b, m - b);
            store_counter(headers, r, HL_SHM_STAGED, kk + 1);
        } else if (phase == 1) {
            if (wait_all(headers, n, HL_SHM_STAGED, kk + 1, deadline, polite)) {
                state[0] = pos;
                return 1;
            }
            if (state[1] == HL_SHM_UNDECIDED) {
                /* every rank has staged, so every rank has published: all decide alike */
                int all = 1, in_place = 1;
                for (int q = 0; q < n; q++) {
                    offsets[q] = __atomic_load_n(&headers[q][HL_SHM_OUT_OFFSET],
                                                 __ATOMIC_RELAXED);
                    all &= offsets[q] >= 0;
                    in_place &= __atomic_load_n(&headers[q][HL_SHM_IN_PLACE],
                                                __ATOMIC_RELAXED) != 0;
                }
                state[1] = !all ? HL_SHM_GATHER : in_place ? HL_SHM_SHARED : HL_SHM_DIRECT;
            }
            size_t a = SEG(r), len = SEG(r + 1) - a;
            if (state[1] == HL_SHM_SHARED) {
                if (len && (rc = reduce_shared(arenas, offsets, n, r, lo + a, len, dtype,
                                               itemsize, op, postscale, stream)) < 0)
                    return rc;
            } else if (state[1] == HL_SHM_GATHER) {
                for (size_t c = a; c < a + len; c += chunk) {
                    size_t cl = (a + len - c < chunk) ? a + len - c : chunk;
                    if ((rc = reduce_segment(slots, n, r, slot_off + c * itemsize,
                                             input_at(&in, lo + c, cl, scratch), cl, dtype,
                                             op, postscale)) < 0)
                        return rc;
                }
            } else {
                /* direct: my segment goes from cache straight into every rank's result */
                const int fused = one_pass(op, n, dtype);
                for (size_t c = a; c < a + len; c += chunk) {
                    size_t cl = (a + len - c < chunk) ? a + len - c : chunk;
                    size_t at = slot_off + c * itemsize;
                    const char *mine = input_at(&in, lo + c, cl, scratch);
                    if (fused) {
                        if ((rc = sum_to_all(slots, arenas, offsets, n, r, at, mine,
                                             (lo + c) * itemsize,
                                             cl, dtype, postscale, stream)) < 0)
                            return rc;
                        continue;
                    }
                    if ((rc = reduce_segment(slots, n, r, at, mine, cl, dtype, op,
                                             postscale)) < 0)
                        return rc;
                    const char *from = slots[(r + 1) % n] + at;
                    for (int q = 0; q < n; q++)
                        copy_out(arenas[q] + offsets[q] + (lo + c) * itemsize, from,
                                 cl * itemsize, stream);
                }
                if (stream)
                    hl_streaming_done(); /* streaming stores are weakly ordered */
            }
            store_counter(headers, r, HL_SHM_REDUCED, kk + 1);
        } else if (state[1] == HL_SHM_GATHER) {
            if (wait_all(headers, n, HL_SHM_REDUCED, kk + 1, deadline, polite)) {
                state[0] = pos;
                return 1;
            }
            for (int q = 0; q < n; q++) {
                size_t a = SEG(q), len = SEG(q + 1) - a;
                copy_out(out + (lo + a) * itemsize,
                         slots[(q + 1) % n] + slot_off + a * itemsize, len * itemsize, stream);
            }
            if (stream)
                hl_streaming_done(); /* streaming stores are weakly ordered */
            store_counter(headers, r, HL_SHM_GATHERED, kk + 1);
        }
#undef SEG
    }
    state[0] = nblocks * 3;
    if (state[1] == HL_SHM_DIRECT || state[1] == HL_SHM_SHARED) {
        /* my result is complete once every owner has written its last segment */
        if (wait_all(headers, n, HL_SHM_REDUCED, epoch + nblocks, deadline, polite))
            return 1;
        store_counter(headers, r, HL_SHM_GATHERED, epoch + nblocks);
    }
    return 0;
}
