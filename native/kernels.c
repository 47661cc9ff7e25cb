/* horolite native kernels (see kernels.h for the contract).
 *
 * The loops live in kernels_impl.h and are compiled twice: once for the
 * portable baseline and, with GCC on x86-64, once for x86-64-v3 (AVX2). The
 * best level the CPU runs is picked on first use; hl_isa_set lets tests run
 * both. float16 and bfloat16 conversions are bit manipulation written
 * without branches, so the compiler vectorizes them; the x86-64-v3 level
 * converts float16 with F16C instructions instead (same results, nan
 * payloads aside).
 */
#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

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
    out = f != f ? 0x7e00u : out;
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
    out = f != f ? (u >> 16) | 0x0040u : out;
    return (uint16_t)out;
}

/* ---- element operations used by kernels_impl.h -------------------------- */

#define HL_ID(x) (x)

/* integer sum/product wrap around: compute in the unsigned type */
#define HL_ADD_U8(a, b) ((uint8_t)((a) + (b)))
#define HL_MUL_U8(a, b) ((uint8_t)((a) * (b)))
#define HL_ADD_I8(a, b) ((int8_t)(uint8_t)((uint8_t)(a) + (uint8_t)(b)))
#define HL_MUL_I8(a, b) ((int8_t)(uint8_t)((uint8_t)(a) * (uint8_t)(b)))
#define HL_ADD_U16(a, b) ((uint16_t)((a) + (b)))
#define HL_MUL_U16(a, b) ((uint16_t)((uint32_t)(a) * (uint32_t)(b)))
#define HL_ADD_I16(a, b) ((int16_t)(uint16_t)((uint16_t)(a) + (uint16_t)(b)))
#define HL_MUL_I16(a, b) ((int16_t)(uint16_t)((uint32_t)(uint16_t)(a) * (uint32_t)(uint16_t)(b)))
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
HL_DEFINE_SCALE_INT(hl_scale_u16, uint16_t, 0.0, 65535.0)
HL_DEFINE_SCALE_INT(hl_scale_i16, int16_t, -32768.0, 32767.0)
HL_DEFINE_SCALE_INT(hl_scale_i32, int32_t, -2147483648.0, 2147483647.0)
HL_DEFINE_SCALE_INT(hl_scale_i64, int64_t, -9223372036854775808.0, 9223372036854774784.0)
#undef HL_DEFINE_SCALE_INT

/* these read the local scale factors sd (double) and sf (float) */
#define HL_SCALED_U8(x) hl_scale_u8((x), sd)
#define HL_SCALED_I8(x) hl_scale_i8((x), sd)
#define HL_SCALED_U16(x) hl_scale_u16((x), sd)
#define HL_SCALED_I16(x) hl_scale_i16((x), sd)
#define HL_SCALED_I32(x) hl_scale_i32((x), sd)
#define HL_SCALED_I64(x) hl_scale_i64((x), sd)
#define HL_SCALED_F16(x) hl_f32_to_f16((x) * sf)
#define HL_SCALED_BF16(x) hl_f32_to_bf16((x) * sf)
/* A reduced 16-bit value is rounded to its type before the postscale, which is
 * then a second rounding: the sum a rank would hold, scaled as Horovod scales
 * a buffer (in float32), so results match Horovod's bit for bit. */
#define HL_RSCALED_F16(x) HL_SCALED_F16(hl_f16_to_f32(hl_f32_to_f16(x)))
#define HL_RSCALED_BF16(x) HL_SCALED_BF16(hl_bf16_to_f32(hl_f32_to_bf16(x)))
#define HL_SCALED_F32(x) ((x) * sf)
#define HL_SCALED_F64(x) ((x) * sd)

/* ---- the loops, once per level ------------------------------------------ */

#define HL_SFX(name) name##_generic
#include "kernels_impl.h"
#undef HL_SFX

#if HL_HAVE_X86_64_V3
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define HL_SFX(name) name##_v3
#include "kernels_impl.h"
#undef HL_SFX

/* float16 with F16C: GCC does not vectorize _Float16 conversions, so these
 * loops are written with intrinsics, 8 elements a step; the tail goes to the
 * template loop. Results equal the bit-manipulation ones (IEEE round to
 * nearest even both ways) except for nan payloads. */

/* x < y ? x : y, and x when x is nan: the same as HL_MIN_F / HL_MAX_F */
static inline __m256 hl_min8(__m256 x, __m256 y)
{
    return _mm256_blendv_ps(_mm256_min_ps(x, y), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

static inline __m256 hl_max8(__m256 x, __m256 y)
{
    return _mm256_blendv_ps(_mm256_max_ps(x, y), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

#define HL_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define HL_STORE8(p, v) \
    _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT))
/* v rounded to float16 and back (see HL_RSCALED_F16) */
#define HL_ROUND8(v) _mm256_cvtph_ps(_mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT))
#define HL_F16C_LOOP2(COMB)                                                   \
    do {                                                                      \
        if (scaled)                                                           \
            for (i = 0; i < body; i += 8)                                     \
                HL_STORE8(a + i, _mm256_mul_ps(HL_ROUND8(COMB(HL_LOAD8(a + i), HL_LOAD8(b + i))), s)); \
        else                                                                  \
            for (i = 0; i < body; i += 8)                                     \
                HL_STORE8(a + i, COMB(HL_LOAD8(a + i), HL_LOAD8(b + i)));     \
    } while (0)

static int reduce_f16_f16c(void *acc, const void *src, size_t count, int op, double postscale)
{
    uint16_t *a = (uint16_t *)acc;
    const uint16_t *b = (const uint16_t *)src;
    const size_t body = count & ~(size_t)7;
    const int scaled = postscale != 1.0;
    const __m256 s = _mm256_set1_ps((float)postscale);
    size_t i;
    switch (op) {
    case HL_SUM: HL_F16C_LOOP2(_mm256_add_ps); break;
    case HL_PRODUCT: HL_F16C_LOOP2(_mm256_mul_ps); break;
    case HL_MIN: HL_F16C_LOOP2(hl_min8); break;
    case HL_MAX: HL_F16C_LOOP2(hl_max8); break;
    default: return HL_EOP;
    }
    return body < count ? reduce_f16_v3(a + body, b + body, count - body, op, postscale) : 0;
}

static int scale_f16_f16c(void *dst, const void *src, size_t count, double factor)
{
    uint16_t *d = (uint16_t *)dst;
    const uint16_t *p = (const uint16_t *)src;
    const size_t body = count & ~(size_t)7;
    const __m256 s = _mm256_set1_ps((float)factor);
    for (size_t i = 0; i < body; i += 8) HL_STORE8(d + i, _mm256_mul_ps(HL_LOAD8(p + i), s));
    return body < count ? scale_f16_v3(d + body, p + body, count - body, factor) : 0;
}

#undef HL_LOAD8
#undef HL_STORE8
#undef HL_ROUND8
#undef HL_F16C_LOOP2
#pragma GCC pop_options
#endif

/* ---- dispatch ----------------------------------------------------------- */

typedef int (*hl_reduce_fn)(void *, const void *, size_t, int, double);
typedef int (*hl_scale_fn)(void *, const void *, size_t, double);

/* one level: its name and its loops, indexed by dtype code */
struct hl_level {
    const char *name;
    hl_reduce_fn reduce[10];
    hl_scale_fn scale[10];
};

#define HL_LEVEL(NAME, SFX, F16_REDUCE, F16_SCALE)                            \
    {                                                                         \
        NAME,                                                                 \
        {reduce_u8##SFX, reduce_i8##SFX, reduce_i32##SFX, reduce_i64##SFX,    \
         F16_REDUCE, reduce_bf16##SFX, reduce_f32##SFX, reduce_f64##SFX,      \
         reduce_u16##SFX, reduce_i16##SFX},                                   \
        {scale_u8##SFX, scale_i8##SFX, scale_i32##SFX, scale_i64##SFX,        \
         F16_SCALE, scale_bf16##SFX, scale_f32##SFX, scale_f64##SFX,          \
         scale_u16##SFX, scale_i16##SFX},                                     \
    }

static const struct hl_level hl_levels[] = {
    HL_LEVEL("generic", _generic, reduce_f16_generic, scale_f16_generic),
#if HL_HAVE_X86_64_V3
    HL_LEVEL("x86-64-v3", _v3, reduce_f16_f16c, scale_f16_f16c),
#endif
};
#undef HL_LEVEL
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

static const size_t hl_itemsize[10] = {1, 1, 4, 8, 2, 2, 4, 8, 2, 2};

static int hl_check_dtype_scale(int dtype, double factor)
{
    if (dtype < HL_UINT8 || dtype > HL_INT16) return HL_EDTYPE;
    const int integer = dtype <= HL_INT64 || dtype == HL_UINT16 || dtype == HL_INT16;
    if (integer && factor != 1.0 && !isfinite(factor)) return HL_ESCALE;
    return 0;
}

int hl_reduce(void *acc, const void *src, size_t count, int dtype, int op, double postscale)
{
    int rc = hl_check_dtype_scale(dtype, postscale);
    if (rc) return rc;
    if (op != HL_SUM && op != HL_MIN && op != HL_MAX && op != HL_PRODUCT) return HL_EOP;
    if (count == 0) return 0;
    return hl_impl()->reduce[dtype](acc, src, count, op, postscale);
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
    return hl_impl()->scale[dtype](dst, src, count, factor);
}

/* ---- copies that bypass the cache ---------------------------------------- */

void hl_copy_streaming(void *dst_, const void *src_, size_t bytes)
{
    char *dst = (char *)dst_;
    const char *src = (const char *)src_;
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

void hl_streaming_done(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

/* ---- a sum written to every rank's result in one pass --------------------- */

/* The vector body of hl_sum_to_all for one floating dtype: four 16-byte vectors
 * of a + b (times the scale), each stored to every output. */
#define HL_SUM_TO_ALL_BODY(T, V, LOADU, ADD, MUL, SET1, STREAM, STOREU)        \
    do {                                                                      \
        const T *a_ = (const T *)a, *b_ = (const T *)b;                       \
        const size_t per_ = 16 / sizeof(T), step_ = 4 * per_;                 \
        const T sc_ = (T)postscale;                                           \
        const V s_ = SET1(sc_);                                               \
        size_t i_ = 0;                                                        \
        /* NT stores need 16-byte alignment: reach it with scalar elements */ \
        while (nt && i_ < count && ((uintptr_t)((T *)dsts[0] + i_) & 15)) {   \
            T v_ = a_[i_] + b_[i_];                                           \
            if (scaled) v_ = v_ * sc_;                                        \
            for (int q_ = 0; q_ < ndst; q_++) ((T *)dsts[q_])[i_] = v_;       \
            i_++;                                                             \
        }                                                                     \
        for (; i_ + step_ <= count; i_ += step_) {                            \
            V x0 = ADD(LOADU(a_ + i_), LOADU(b_ + i_));                       \
            V x1 = ADD(LOADU(a_ + i_ + per_), LOADU(b_ + i_ + per_));         \
            V x2 = ADD(LOADU(a_ + i_ + 2 * per_), LOADU(b_ + i_ + 2 * per_)); \
            V x3 = ADD(LOADU(a_ + i_ + 3 * per_), LOADU(b_ + i_ + 3 * per_)); \
            if (scaled) {                                                     \
                x0 = MUL(x0, s_), x1 = MUL(x1, s_);                           \
                x2 = MUL(x2, s_), x3 = MUL(x3, s_);                           \
            }                                                                 \
            for (int q_ = 0; q_ < ndst; q_++) {                               \
                T *o_ = (T *)dsts[q_] + i_;                                   \
                if (nt) {                                                     \
                    STREAM(o_, x0), STREAM(o_ + per_, x1);                    \
                    STREAM(o_ + 2 * per_, x2), STREAM(o_ + 3 * per_, x3);     \
                } else {                                                      \
                    STOREU(o_, x0), STOREU(o_ + per_, x1);                    \
                    STOREU(o_ + 2 * per_, x2), STOREU(o_ + 3 * per_, x3);     \
                }                                                             \
            }                                                                 \
        }                                                                     \
        for (; i_ < count; i_++) {                                            \
            T v_ = a_[i_] + b_[i_];                                           \
            if (scaled) v_ = v_ * sc_;                                        \
            for (int q_ = 0; q_ < ndst; q_++) ((T *)dsts[q_])[i_] = v_;       \
        }                                                                     \
    } while (0)

int hl_has_sum_to_all(int dtype)
{
#if defined(__x86_64__)
    return dtype == HL_FLOAT32 || dtype == HL_FLOAT64;
#else
    (void)dtype;
    return 0;
#endif
}

int hl_sum_to_all(void *const *dsts, int ndst, const void *a, const void *b, size_t count,
                  int dtype, double postscale, int stream)
{
#if defined(__x86_64__)
    if (!hl_has_sum_to_all(dtype))
        return 1;
    const int scaled = postscale != 1.0;
    /* streaming stores only when every output has the same alignment */
    int nt = stream;
    for (int q = 1; q < ndst && nt; q++)
        nt = (((uintptr_t)dsts[q] - (uintptr_t)dsts[0]) & 15) == 0;
    if (dtype == HL_FLOAT32)
        HL_SUM_TO_ALL_BODY(float, __m128, _mm_loadu_ps, _mm_add_ps, _mm_mul_ps, _mm_set1_ps,
                           _mm_stream_ps, _mm_storeu_ps);
    else
        HL_SUM_TO_ALL_BODY(double, __m128d, _mm_loadu_pd, _mm_add_pd, _mm_mul_pd, _mm_set1_pd,
                           _mm_stream_pd, _mm_storeu_pd);
    return 0;
#else
    (void)dsts, (void)ndst, (void)a, (void)b, (void)count, (void)dtype, (void)postscale,
        (void)stream;
    return 1;
#endif
}

#undef HL_SUM_TO_ALL_BODY

int hl_pack(void *dst, const void *const *srcs, const size_t *nbytes, size_t n, int dtype,
            double factor)
{
    unsigned char *out = (unsigned char *)dst;
    size_t i, total = 0;
    if (factor == 1.0) {
        for (i = 0; i < n; i++)
            total += nbytes[i];
        const int stream = total >= HL_STREAM_BYTES;
        for (i = 0; i < n; i++) {
            if (nbytes[i] && stream)
                hl_copy_streaming(out, srcs[i], nbytes[i]);
            else if (nbytes[i])
                memcpy(out, srcs[i], nbytes[i]);
            out += nbytes[i];
        }
        if (stream)
            hl_streaming_done();
        return 0;
    }
    int rc = hl_check_dtype_scale(dtype, factor);
    if (rc) return rc;
    const size_t item = hl_itemsize[dtype];
    for (i = 0; i < n; i++)
        if (nbytes[i] % item) return HL_ESIZE;
    hl_scale_fn scale = hl_impl()->scale[dtype];
    for (i = 0; i < n; i++) {
        if (nbytes[i]) scale(out, srcs[i], nbytes[i] / item, factor);
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
