/* HL_RELAX(): what one turn of a spin-wait does to let the other hyperthread (or the
 * core's power state) breathe, shared by every spin loop of native/. */
#ifndef HOROLITE_RELAX_H
#define HOROLITE_RELAX_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HL_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define HL_RELAX() __asm__ __volatile__("yield")
#else
#define HL_RELAX() ((void)0)
#endif

#endif
