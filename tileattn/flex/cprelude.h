/* Helpers of the C code tileattn.flex generates from score_mod / mask_mod graphs.
 *
 * Each mirrors the PyTorch CPU kernel of the op it stands for, so a compiled function computes what
 * PyTorch computes: Python-style floor division and remainder (sign of the divisor), PyTorch's
 * shift rules (a shift by a negative or too large amount gives 0, or the sign for >>), NaN-propagating
 * minimum/maximum, the special exponents of pow(x, scalar). Integer arithmetic wraps (the library is
 * compiled with -fwrapv) as PyTorch's does; an integer division by zero sets *zero instead of trapping.
 */
#include <math.h>
#include <stdint.h>

#define TA_DIV_INT(T, NAME)                                                                     \
    static inline T NAME##_floordiv(T a, T b, int *zero) {                                      \
        if (b == 0) { *zero = 1; return 0; }                                                    \
        if (b == -1) return (T)(0 - a);                                                         \
        T q = a / b;                                                                            \
        if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;                                       \
        return q;                                                                               \
    }                                                                                           \
    static inline T NAME##_truncdiv(T a, T b, int *zero) {                                      \
        if (b == 0) { *zero = 1; return 0; }                                                    \
        if (b == -1) return (T)(0 - a);                                                         \
        return a / b;                                                                           \
    }                                                                                           \
    static inline T NAME##_remainder(T a, T b, int *zero) {                                     \
        if (b == 0) { *zero = 1; return 0; }                                                    \
        if (b == -1) return 0;                                                                  \
        T r = a % b;                                                                            \
        if ((r != 0) && ((r < 0) != (b < 0))) r += b;                                           \
        return r;                                                                               \
    }                                                                                           \
    static inline T NAME##_fmod(T a, T b, int *zero) {                                          \
        if (b == 0) { *zero = 1; return 0; }                                                    \
        if (b == -1) return 0;                                                                  \
        return a % b;                                                                           \
    }                                                                                           \
    static inline T NAME##_pow(T a, T b) {                                                      \
        if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);                      \
        T result = 1;                                                                           \
        while (b) { if (b & 1) result *= a; b >>= 1; a *= a; }                                   \
        return result;                                                                          \
    }

#define TA_SHIFT_INT(T, U, NAME)                                                                \
    static inline T NAME##_lshift(T a, T b) {                                                   \
        if (b < 0 || b >= (T)(sizeof(T) * 8)) return 0;                                         \
        return (T)((U)a << b);                                                                  \
    }                                                                                           \
    static inline T NAME##_rshift(T a, T b) {                                                   \
        const T max_shift = (T)(sizeof(T) * 8 - 1);                                             \
        if (b < 0 || b >= max_shift) return (T)(a >> max_shift);                                \
        return (T)(a >> b);                                                                     \
    }

TA_DIV_INT(int8_t, ta_i8)
TA_DIV_INT(int16_t, ta_i16)
TA_DIV_INT(int32_t, ta_i32)
TA_DIV_INT(int64_t, ta_i64)
TA_DIV_INT(uint8_t, ta_u8)
TA_SHIFT_INT(int8_t, uint8_t, ta_i8)
TA_SHIFT_INT(int16_t, uint16_t, ta_i16)
TA_SHIFT_INT(int32_t, uint32_t, ta_i32)
TA_SHIFT_INT(int64_t, uint64_t, ta_i64)

static inline uint8_t ta_u8_lshift(uint8_t a, uint8_t b) { return b >= 8 ? 0 : (uint8_t)(a << b); }
static inline uint8_t ta_u8_rshift(uint8_t a, uint8_t b) { return b >= 8 ? 0 : (uint8_t)(a >> b); }

#define TA_FLOAT(T, NAME, SUF)                                                                  \
    static inline T NAME##_floordiv(T a, T b) {                                                 \
        if (b == 0) return a / b;                                                               \
        T mod = fmod##SUF(a, b);                                                                \
        T div = (a - mod) / b;                                                                  \
        if ((mod != 0) && ((b < 0) != (mod < 0))) div -= 1;                                     \
        if (div == 0) return copysign##SUF(0, a / b);                                           \
        T floordiv = floor##SUF(div);                                                           \
        if (div - floordiv > (T)0.5) floordiv += 1;                                             \
        return floordiv;                                                                        \
    }                                                                                           \
    static inline T NAME##_remainder(T a, T b) {                                                \
        T mod = fmod##SUF(a, b);                                                                \
        if ((mod != 0) && ((b < 0) != (mod < 0))) mod += b;                                     \
        return mod;                                                                             \
    }                                                                                           \
    static inline T NAME##_max(T a, T b) { return (a != a || b != b) ? a + b : (a > b ? a : b); } \
    static inline T NAME##_min(T a, T b) { return (a != a || b != b) ? a + b : (a < b ? a : b); } \
    static inline T NAME##_sgn(T a) { return a != a ? a : (T)((a > 0) - (a < 0)); }             \
    static inline T NAME##_pows(T a, double e) {                                                \
        if (e == 2.0) return a * a;                                                             \
        if (e == 3.0) return a * a * a;                                                         \
        if (e == 0.5) return sqrt##SUF(a);                                                      \
        if (e == -0.5) return (T)1 / sqrt##SUF(a);                                              \
        if (e == -1.0) return (T)1 / a;                                                         \
        if (e == -2.0) return (T)1 / (a * a);                                                   \
        return pow##SUF(a, (T)e);                                                               \
    }

TA_FLOAT(float, ta_f32, f)
TA_FLOAT(double, ta_f64, )

static inline float ta_bf16(uint16_t bits) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)bits << 16;
    return v.f;
}

static inline float ta_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    union { uint32_t u; float f; } v;
    v.u = bits;
    return v.f;
}
