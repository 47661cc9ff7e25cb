/* The shared-memory allreduce: see shm_ring.h for the algorithm. */
#include "shm_ring.h"
#include "kernels.h"

#include <string.h>
#include <time.h>

#ifdef _WIN32
#include <windows.h>
static void hl_yield(void) { SwitchToThread(); }
static void hl_sleep_ns(long ns) { Sleep(ns >= 1000000 ? (DWORD)(ns / 1000000) : 0); }
static double hl_now(void) { return (double)GetTickCount64() / 1e3; }
#else
#include <sched.h>
static void hl_yield(void) { sched_yield(); }
static void hl_sleep_ns(long ns)
{
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}
static double hl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HL_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define HL_RELAX() __asm__ __volatile__("yield")
#else
#define HL_RELAX() ((void)0)
#endif

/* memcpy with non-temporal stores where the CPU has them: the gather writes the
 * output once and does not read it back, so skipping the read-for-ownership of
 * every output line saves a third of its memory traffic. */
static void copy_streaming(char *dst, const char *src, size_t bytes)
{
#if defined(__x86_64__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (bytes < 256 || head > bytes) {
        memcpy(dst, src, bytes);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, bytes -= head;
    size_t body = bytes & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, bytes - body);
#else
    memcpy(dst, src, bytes);
#endif
}

static void streaming_done(void)
{
#if defined(__x86_64__)
    _mm_sfence(); /* streaming stores are weakly ordered: fence before publishing */
#endif
}

static int64_t load_counter(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void store_counter(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Until every rank's counter `word` is >= want: 0, or 1 once `deadline` passed.
 * A partner that is running answers within microseconds, so spin first; then
 * give the core away, more and more patiently (ranks may outnumber cores). */
static int wait_all(int64_t *const *headers, int n, int word, int64_t want, double deadline,
                    int polite)
{
    const double spin_s = polite ? 2e-6 : 100e-6, yield_s = polite ? 200e-6 : 1e-3;
    long pause_ns = polite ? 5000 : 20000;
    double start = 0.0, elapsed = 0.0;
    for (unsigned iter = 0;; iter++) {
        int q = 0;
        while (q < n && load_counter(&headers[q][word]) >= want)
            q++;
        if (q == n)
            return 0;
        if ((iter & 31) == 0) {
            double now = hl_now();
            if (iter == 0)
                start = now;
            elapsed = now - start;
            if (now > deadline)
                return 1;
        }
        if (elapsed < spin_s) {
            HL_RELAX();
        } else if (elapsed < yield_s) {
            hl_yield();
        } else {
            hl_sleep_ns(pause_ns);
            if (pause_ns < 100000)
                pause_ns *= 2;
            iter = (iter | 31); /* look at the clock after every sleep */
        }
    }
}

int hl_shm_allreduce(int64_t *const *headers, char *const *slots, int n, int r,
                     size_t slot_bytes, int nslots, const void *src, void *dst,
                     size_t count, int dtype, size_t itemsize, int op, double postscale,
                     int64_t epoch, int64_t *resume, double timeout_s, int polite,
                     int64_t *blocks)
{
    const size_t per_block = slot_bytes / itemsize;
    const int64_t nblocks = (int64_t)((count + per_block - 1) / per_block);
    const char *in = (const char *)src;
    char *out = (char *)dst;
    const double deadline = hl_now() + timeout_s;
    /* an output larger than this is not expected to be read back from cache */
    const int stream = count * itemsize >= ((size_t)8 << 20);
    *blocks = nblocks;

    for (int64_t pos = *resume; pos < nblocks * 3; pos++) {
        const int64_t k = pos / 3, kk = epoch + k;
        const int phase = (int)(pos % 3);
        const size_t lo = (size_t)k * per_block;
        const size_t m = (count - lo < per_block) ? count - lo : per_block;
        const size_t slot_off = (size_t)(kk % nslots) * slot_bytes;
        /* segment q of this block: elements [seg(q), seg(q + 1)) counted from lo */
#define SEG(q) (m * (size_t)(q) / (size_t)n)
        int rc;
        if (phase == 0) {
            /* my slot held block kk - nslots: free once every rank has gathered it */
            if (wait_all(headers, n, HL_SHM_GATHERED, kk - nslots + 1, deadline, polite)) {
                *resume = pos;
                return 1;
            }
            char *mine = slots[r] + slot_off;
            size_t a = SEG(r), b = SEG(r + 1);
            memcpy(mine, in + lo * itemsize, a * itemsize);
            memcpy(mine + b * itemsize, in + (lo + b) * itemsize, (m - b) * itemsize);
            store_counter(&headers[r][HL_SHM_STAGED], kk + 1);
        } else if (phase == 1) {
            if (wait_all(headers, n, HL_SHM_STAGED, kk + 1, deadline, polite)) {
                *resume = pos;
                return 1;
            }
            size_t a = SEG(r), len = SEG(r + 1) - a;
            if (len) {
                /* my segment accumulates in the copy staged by my successor */
                char *acc = slots[(r + 1) % n] + slot_off + a * itemsize;
                rc = hl_reduce(acc, in + (lo + a) * itemsize, len, dtype, op,
                               n == 2 ? postscale : 1.0);
                if (rc < 0)
                    return rc;
                for (int d = 2; d < n; d++) {
                    int p = (r + d) % n;
                    rc = hl_reduce(acc, slots[p] + slot_off + a * itemsize, len, dtype, op,
                                   d == n - 1 ? postscale : 1.0);
                    if (rc < 0)
                        return rc;
                }
            }
            store_counter(&headers[r][HL_SHM_REDUCED], kk + 1);
        } else {
            if (wait_all(headers, n, HL_SHM_REDUCED, kk + 1, deadline, polite)) {
                *resume = pos;
                return 1;
            }
            for (int q = 0; q < n; q++) {
                size_t a = SEG(q), len = SEG(q + 1) - a;
                char *to = out + (lo + a) * itemsize;
                const char *from = slots[(q + 1) % n] + slot_off + a * itemsize;
                if (stream)
                    copy_streaming(to, from, len * itemsize);
                else
                    memcpy(to, from, len * itemsize);
            }
            if (stream)
                streaming_done();
            store_counter(&headers[r][HL_SHM_GATHERED], kk + 1);
        }
#undef SEG
    }
    *resume = nblocks * 3;
    return 0;
}
