/* horolite native kernels (see kernels.h for the contract).
 *
 * The loops live in kernels_impl.h and are compiled twice: once for the
 * portable baseline and, with GCC on x86-64, once for x86-64-v3 (AVX2). The
 * best level the CPU runs is picked when the library loads; hl_isa_set lets
 * tests run both. float16 and bfloat16 conversions are integer bit
 * manipulation written without branches, so both builds vectorize them and
 * give bit-identical results.
 */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#define HL_ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define HL_ALWAYS_INLINE static inline
#endif

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__)
#define HL_HAVE_X86_64_V3 1
#else
#define HL_HAVE_X86_64_V3 0
#endif

/* ---- bit casts ---------------------------------------------------------- */

HL_ALWAYS_INLINE uint32_t hl_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

HL_ALWAYS_INLINE float hl_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- float16 <-> float32 -----------------------------------------------
 * float16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. */

HL_ALWAYS_INLINE float hl_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    /* exponent and mantissa moved to float32's positions (mantissa aligned) */
    const uint32_t body = (uint32_t)(h & 0x7fffu) << 13;
    const uint32_t exp = body & 0x0f800000u;
    /* normal: rebias the exponent from 15 to 127 */
    uint32_t out = body + (112u << 23);
    /* inf/nan: exponent 31 becomes 255, mantissa (payload, quiet bit) kept */
    out = exp == 0x0f800000u ? body + (224u << 23) : out;
    /* zero/subnormal: value is mantissa * 2^-24, obtained exactly as
     * (2^-14 + mantissa * 2^-24) - 2^-14 with both operands normal floats */
    const float sub = hl_float(body + (113u << 23)) - hl_float(113u << 23);
    out = exp == 0 ? hl_bits(sub) : out;
    return hl_float(out | sign);
}

HL_ALWAYS_INLINE uint16_t hl_f32_to_f16(float f)
{
    const uint32_t u = hl_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t mag = u & 0x7fffffffu;
    /* normal range: drop 13 mantissa bits rounding to nearest even, rebias.
     * A carry out of the mantissa bumps the exponent, which also turns
     * values just below 65536 into infinity as IEEE requires. */
    const uint32_t odd = (mag >> 13) & 1u;
    uint32_t out = (mag - (112u << 23) + 0x0fffu + odd) >> 13;
    /* |f| < 2^-14: half subnormal or zero. Adding 0.5 (whose ulp is 2^-24,
     * the half subnormal step) rounds to nearest even in hardware; the low
     * bits of the sum are then the half's mantissa (0x400 = smallest normal). */
    const uint32_t sub = hl_bits(hl_float(mag) + 0.5f) - (126u << 23);
    out = mag < (113u << 23) ? sub : out;
    /* |f| >= 65536, inf, nan */
    out = mag >= (143u << 23) ? 0x7c00u : out;
    out = mag > 0x7f800000u ? 0x7e00u : out;
    return (uint16_t)(out | sign);
}

/* ---- bfloat16 <-> float32 (bfloat16 is float32's upper half) ----------- */

HL_ALWAYS_INLINE float hl_bf16_to_f32(uint16_t h)
{
    return hl_float((uint32_t)h << 16);
}

HL_ALWAYS_INLINE uint16_t hl_f32_to_bf16(float f)
{
    const uint32_t u = hl_bits(f);
    uint32_t out = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    /* nan: keep sign and payload top, force quiet (rounding could carry
     * a nan into infinity) */
    out = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x0040u : out;
    return (uint16_t)out;
}

/* ---- element operations used by kernels_impl.h -------------------------- */

#define HL_ID(x) (x)

/* integer sum/product wrap around: compute in the unsigned type */
#define HL_ADD_U8(a, b) ((uint8_t)((a) + (b)))
#define HL_MUL_U8(a, b) ((uint8_t)((a) * (b)))
#define HL_ADD_I8(a, b) ((int8_t)(uint8_t)((uint8_t)(a) + (uint8_t)(b)))
#define HL_MUL_I8(a, b) ((int8_t)(uint8_t)((uint8_t)(a) * (uint8_t)(b)))
#define HL_ADD_I32(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))
#define HL_MUL_I32(a, b) ((int32_t)((uint32_t)(a) * (uint32_t)(b)))
#define HL_ADD_I64(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
#define HL_MUL_I64(a, b) ((int64_t)((uint64_t)(a) * (uint64_t)(b)))
#define HL_MIN_ANY(a, b) ((b) < (a) ? (b) : (a))
#define HL_MAX_ANY(a, b) ((b) > (a) ? (b) : (a))

/* floats: nan propagates from either side, like numpy.minimum/maximum */
#define HL_ADD_F(a, b) ((a) + (b))
#define HL_MUL_F(a, b) ((a) * (b))
#define HL_MIN_F(a, b) ((((a) < (b)) | ((a) != (a))) ? (a) : (b))
#define HL_MAX_F(a, b) ((((a) > (b)) | ((a) != (a))) ? (a) : (b))

/* Scaled integers: x * s in double, truncated toward zero, saturated. The
 * int64 upper bound is the largest double below 2^63. */
#define HL_DEFINE_SCALE_INT(NAME, T, LO, HI)                                  \
    HL_ALWAYS_INLINE T NAME(T x, double s)                                    \
    {                                                                         \
        double y = (double)x * s;                                             \
        y = y > (HI) ? (HI) : y;                                              \
        y = y < (LO) ? (LO) : y;                                              \
        return (T)y;                                                          \
    }
HL_DEFINE_SCALE_INT(hl_scale_u8, uint8_t, 0.0, 255.0)
HL_DEFINE_SCALE_INT(hl_scale_i8, int8_t, -128.0, 127.0)
HL_DEFINE_SCALE_INT(hl_scale_i32, int32_t, -2147483648.0, 2147483647.0)
HL_DEFINE_SCALE_INT(hl_scale_i64, int64_t, -9223372036854775808.0, 9223372036854774784.0)
#undef HL_DEFINE_SCALE_INT

/* these read the local scale factors sd (double) and sf (float) */
#define HL_SCALED_U8(x) hl_scale_u8((x), sd)
#define HL_SCALED_I8(x) hl_scale_i8((x), sd)
#define HL_SCALED_I32(x) hl_scale_i32((x), sd)
#define HL_SCALED_I64(x) hl_scale_i64((x), sd)
#define HL_SCALED_F16(x) hl_f32_to_f16((x) * sf)
#define HL_SCALED_BF16(x) hl_f32_to_bf16((x) * sf)
#define HL_SCALED_F32(x) ((x) * sf)
#define HL_SCALED_F64(x) ((x) * sd)

/* ---- the loops, once per level ------------------------------------------ */

#define HL_SFX(name) name##_generic
#include "kernels_impl.h"
#undef HL_SFX

#if HL_HAVE_X86_64_V3
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define HL_SFX(name) name##_v3
#include "kernels_impl.h"
#undef HL_SFX
#pragma GCC pop_options
#endif

/* ---- dispatch ----------------------------------------------------------- */

typedef int (*hl_reduce_fn)(void *, const void *, size_t, int, int, double);
typedef int (*hl_scale_fn)(void *, const void *, size_t, int, double);

struct hl_level {
    const char *name;
    hl_reduce_fn reduce;
    hl_scale_fn scale;
};

static const struct hl_level hl_levels[] = {
    {"generic", reduce_generic, scale_generic},
#if HL_HAVE_X86_64_V3
    {"x86-64-v3", reduce_v3, scale_v3},
#endif
};
#define HL_NLEVELS ((int)(sizeof hl_levels / sizeof hl_levels[0]))

static int hl_level_supported(int level)
{
    if (level < 0 || level >= HL_NLEVELS) return 0;
#if HL_HAVE_X86_64_V3
    if (level == 1) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("x86-64-v3") != 0;
    }
#endif
    return 1;
}

static int hl_best_level(void)
{
    int level = HL_NLEVELS - 1;
    while (level > 0 && !hl_level_supported(level)) level--;
    return level;
}

/* -1 until first use; any thread may resolve it, all resolve the same value */
static int hl_active = -1;

static const struct hl_level *hl_impl(void)
{
    int level = __atomic_load_n(&hl_active, __ATOMIC_RELAXED);
    if (level < 0) {
        level = hl_best_level();
        __atomic_store_n(&hl_active, level, __ATOMIC_RELAXED);
    }
    return &hl_levels[level];
}

int hl_isa_get(void)
{
    return (int)(hl_impl() - hl_levels);
}

int hl_isa_set(int level)
{
    if (!hl_level_supported(level)) return -1;
    __atomic_store_n(&hl_active, level, __ATOMIC_RELAXED);
    return 0;
}

const char *hl_isa_name(int level)
{
    return hl_level_supported(level) ? hl_levels[level].name : NULL;
}

/* ---- public entry points -------------------------------------------------- */

static const size_t hl_itemsize[8] = {1, 1, 4, 8, 2, 2, 4, 8};

static int hl_check_dtype_scale(int dtype, double factor)
{
    if (dtype < HL_UINT8 || dtype > HL_FLOAT64) return HL_EDTYPE;
    if (dtype <= HL_INT64 && factor != 1.0 && !isfinite(factor)) return HL_ESCALE;
    return 0;
}

int hl_reduce(void *acc, const void *src, size_t count, int dtype, int op, double postscale)
{
    int rc = hl_check_dtype_scale(dtype, postscale);
    if (rc) return rc;
    if (op != HL_SUM && op != HL_MIN && op != HL_MAX && op != HL_PRODUCT) return HL_EOP;
    if (count == 0) return 0;
    return hl_impl()->reduce(acc, src, count, dtype, op, postscale);
}

int hl_scale(void *dst, const void *src, size_t count, int dtype, double factor)
{
    int rc = hl_check_dtype_scale(dtype, factor);
    if (rc) return rc;
    if (count == 0) return 0;
    if (factor == 1.0) {
        if (dst != src) memmove(dst, src, count * hl_itemsize[dtype]);
        return 0;
    }
    return hl_impl()->scale(dst, src, count, dtype, factor);
}

int hl_pack(void *dst, const void *const *srcs, const size_t *nbytes, size_t n, int dtype,
            double factor)
{
    unsigned char *out = (unsigned char *)dst;
    size_t i;
    if (factor == 1.0) {
        for (i = 0; i < n; i++) {
            if (nbytes[i]) memcpy(out, srcs[i], nbytes[i]);
            out += nbytes[i];
        }
        return 0;
    }
    int rc = hl_check_dtype_scale(dtype, factor);
    if (rc) return rc;
    const size_t item = hl_itemsize[dtype];
    for (i = 0; i < n; i++)
        if (nbytes[i] % item) return HL_ESIZE;
    hl_scale_fn scale = hl_impl()->scale;
    for (i = 0; i < n; i++) {
        if (nbytes[i]) scale(out, srcs[i], nbytes[i] / item, dtype, factor);
        out += nbytes[i];
    }
    return 0;
}

int hl_unpack(void *const *dsts, const void *src, const size_t *nbytes, size_t n)
{
    const unsigned char *in = (const unsigned char *)src;
    for (size_t i = 0; i < n; i++) {
        if (nbytes[i]) memcpy(dsts[i], in, nbytes[i]);
        in += nbytes[i];
    }
    return 0;
}
