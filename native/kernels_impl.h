/* Kernel loops, included by kernels.c once per instruction-set level.
 *
 * Not a public header. Before including it, kernels.c defines HL_SFX(name)
 * (appends the level's suffix) and the element helpers and macros used below;
 * the includer's `#pragma GCC target` decides what the loops compile to. Every
 * loop is a plain, branch-free element loop so that GCC vectorizes it.
 * Defines reduce_<dtype><sfx>(acc, src, count, op, postscale) and
 * scale_<dtype><sfx>(dst, src, count, factor) for the ten dtypes; op is
 * already validated.
 */

/* out[i] = STORE(COMB(LOAD(acc[i]), LOAD(src[i]))), C being the compute type */
#define HL_LOOP2(T, C, LOAD, STORE, COMB)                                     \
    do {                                                                      \
        T *a_ = (T *)acc;                                                     \
        const T *b_ = (const T *)src;                                         \
        for (size_t i_ = 0; i_ < count; i_++) {                               \
            C x_ = LOAD(a_[i_]);                                              \
            C y_ = LOAD(b_[i_]);                                              \
            a_[i_] = STORE(COMB(x_, y_));                                     \
        }                                                                     \
    } while (0)

/* One function per dtype: picks the op, and the scaled or unscaled store,
 * outside the loop. (Separate functions keep GCC's if-conversion, and so the
 * vectorizer, working on every loop.) */
#define HL_DEFINE_REDUCE(NAME, T, C, LOAD, STORE, SCALED, ADD, MUL, MIN, MAX)  \
    static int HL_SFX(NAME)(void *acc, const void *src, size_t count, int op, \
                            double postscale)                                 \
    {                                                                         \
        const int scaled = postscale != 1.0;                                  \
        const double sd = postscale;                                          \
        const float sf = (float)postscale;                                    \
        (void)sd;                                                             \
        (void)sf;                                                             \
        switch (op) {                                                         \
        case HL_SUM:                                                          \
            if (scaled) HL_LOOP2(T, C, LOAD, SCALED, ADD);                    \
            else HL_LOOP2(T, C, LOAD, STORE, ADD);                            \
            return 0;                                                         \
        case HL_PRODUCT:                                                      \
            if (scaled) HL_LOOP2(T, C, LOAD, SCALED, MUL);                    \
            else HL_LOOP2(T, C, LOAD, STORE, MUL);                            \
            return 0;                                                         \
        case HL_MIN:                                                          \
            if (scaled) HL_LOOP2(T, C, LOAD, SCALED, MIN);                    \
            else HL_LOOP2(T, C, LOAD, STORE, MIN);                            \
            return 0;                                                         \
        case HL_MAX:                                                          \
            if (scaled) HL_LOOP2(T, C, LOAD, SCALED, MAX);                    \
            else HL_LOOP2(T, C, LOAD, STORE, MAX);                            \
            return 0;                                                         \
        default:                                                              \
            return HL_EOP;                                                    \
        }                                                                     \
    }

/* dst[i] = SCALED(LOAD(src[i])) */
#define HL_DEFINE_SCALE(NAME, T, LOAD, SCALED)                                \
    static int HL_SFX(NAME)(void *dst, const void *src, size_t count,         \
                            double factor)                                    \
    {                                                                         \
        const double sd = factor;                                             \
        const float sf = (float)factor;                                       \
        (void)sd;                                                             \
        (void)sf;                                                             \
        T *d_ = (T *)dst;                                                     \
        const T *s_ = (const T *)src;                                         \
        for (size_t i_ = 0; i_ < count; i_++) d_[i_] = SCALED(LOAD(s_[i_]));  \
        return 0;                                                             \
    }

HL_DEFINE_REDUCE(reduce_u8, uint8_t, uint8_t, HL_ID, HL_ID, HL_SCALED_U8,
                 HL_ADD_U8, HL_MUL_U8, HL_MIN_ANY, HL_MAX_ANY)
HL_DEFINE_REDUCE(reduce_i8, int8_t, int8_t, HL_ID, HL_ID, HL_SCALED_I8,
                 HL_ADD_I8, HL_MUL_I8, HL_MIN_ANY, HL_MAX_ANY)
HL_DEFINE_REDUCE(reduce_u16, uint16_t, uint16_t, HL_ID, HL_ID, HL_SCALED_U16,
                 HL_ADD_U16, HL_MUL_U16, HL_MIN_ANY, HL_MAX_ANY)
HL_DEFINE_REDUCE(reduce_i16, int16_t, int16_t, HL_ID, HL_ID, HL_SCALED_I16,
                 HL_ADD_I16, HL_MUL_I16, HL_MIN_ANY, HL_MAX_ANY)
HL_DEFINE_REDUCE(reduce_i32, int32_t, int32_t, HL_ID, HL_ID, HL_SCALED_I32,
                 HL_ADD_I32, HL_MUL_I32, HL_MIN_ANY, HL_MAX_ANY)
HL_DEFINE_REDUCE(reduce_i64, int64_t, int64_t, HL_ID, HL_ID, HL_SCALED_I64,
                 HL_ADD_I64, HL_MUL_I64, HL_MIN_ANY, HL_MAX_ANY)
HL_DEFINE_REDUCE(reduce_f16, uint16_t, float, hl_f16_to_f32, hl_f32_to_f16, HL_RSCALED_F16,
                 HL_ADD_F, HL_MUL_F, HL_MIN_F, HL_MAX_F)
HL_DEFINE_REDUCE(reduce_bf16, uint16_t, float, hl_bf16_to_f32, hl_f32_to_bf16, HL_RSCALED_BF16,
                 HL_ADD_F, HL_MUL_F, HL_MIN_F, HL_MAX_F)
HL_DEFINE_REDUCE(reduce_f32, float, float, HL_ID, HL_ID, HL_SCALED_F32,
                 HL_ADD_F, HL_MUL_F, HL_MIN_F, HL_MAX_F)
HL_DEFINE_REDUCE(reduce_f64, double, double, HL_ID, HL_ID, HL_SCALED_F64,
                 HL_ADD_F, HL_MUL_F, HL_MIN_F, HL_MAX_F)

HL_DEFINE_SCALE(scale_u8, uint8_t, HL_ID, HL_SCALED_U8)
HL_DEFINE_SCALE(scale_i8, int8_t, HL_ID, HL_SCALED_I8)
HL_DEFINE_SCALE(scale_u16, uint16_t, HL_ID, HL_SCALED_U16)
HL_DEFINE_SCALE(scale_i16, int16_t, HL_ID, HL_SCALED_I16)
HL_DEFINE_SCALE(scale_i32, int32_t, HL_ID, HL_SCALED_I32)
HL_DEFINE_SCALE(scale_i64, int64_t, HL_ID, HL_SCALED_I64)
HL_DEFINE_SCALE(scale_f16, uint16_t, hl_f16_to_f32, HL_SCALED_F16)
HL_DEFINE_SCALE(scale_bf16, uint16_t, hl_bf16_to_f32, HL_SCALED_BF16)
HL_DEFINE_SCALE(scale_f32, float, HL_ID, HL_SCALED_F32)
HL_DEFINE_SCALE(scale_f64, double, HL_ID, HL_SCALED_F64)

#undef HL_LOOP2
#undef HL_DEFINE_REDUCE
#undef HL_DEFINE_SCALE
