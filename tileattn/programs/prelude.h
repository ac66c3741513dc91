/* Helpers of the C code tileattn.programs generates from score_mod / mask_mod graphs.
 *
 * Each mirrors the PyTorch CPU kernel of the op it stands for, so a compiled function computes what
 * PyTorch computes: Python-style floor division and remainder (sign of the divisor), PyTorch's
 * shift rules (a shift by a negative or too large amount gives 0, or the sign for >>), NaN-propagating
 * minimum/maximum, the special exponents of pow(x, scalar). Integer arithmetic wraps (the library is
 * compiled with -fwrapv) as PyTorch's does; an integer division by zero sets *zero instead of trapping.
 *
 * The fp32 transcendental functions (exp, exp2, log, log2, tanh, sigmoid) are written here rather than
 * called from libm: a libm call is opaque to the compiler and keeps a tile loop scalar, these are
 * branch-free and inline, so the loop over a tile's rows vectorises in the build's own instruction
 * set (AVX-512, AVX2 or the portable vector width). Each is within 2 ulp of the correctly rounded
 * result over the fp32 range (tests/test_programs_math.py measures it), with libm's values at the
 * special points (NaN, +-inf, 0, overflow, underflow). fp64 code keeps libm: it serves accuracy, not speed.
 */
#include <math.h>
#include <stdint.h>

/* Branch-free where it matters: a division by a constant (``kv_idx // 128``) then folds into a
 * multiply and the tile loop still vectorises. b == 0 and b == -1 (which would trap) divide by 1. */
#define TA_DIV_INT(T, NAME)                                                                     \
    static inline T NAME##_floordiv(T a, T b, int *zero) {                                      \
        *zero |= b == 0;                                                                        \
        T d = (b == 0 || b == -1) ? (T)1 : b;                                                   \
        T q = a / d;                                                                            \
        q = ((a % d != 0) && ((a < 0) != (d < 0))) ? (T)(q - 1) : q;                            \
        return b == 0 ? (T)0 : (b == -1 ? (T)(0 - a) : q);                                      \
    }                                                                                           \
    static inline T NAME##_truncdiv(T a, T b, int *zero) {                                      \
        *zero |= b == 0;                                                                        \
        T d = (b == 0 || b == -1) ? (T)1 : b;                                                   \
        return b == 0 ? (T)0 : (b == -1 ? (T)(0 - a) : (T)(a / d));                             \
    }                                                                                           \
    static inline T NAME##_remainder(T a, T b, int *zero) {                                     \
        *zero |= b == 0;                                                                        \
        T d = (b == 0 || b == -1) ? (T)1 : b;                                                   \
        T r = a % d;                                                                            \
        r = ((r != 0) && ((r < 0) != (d < 0))) ? (T)(r + d) : r;                                \
        return (b == 0 || b == -1) ? (T)0 : r;                                                  \
    }                                                                                           \
    static inline T NAME##_fmod(T a, T b, int *zero) {                                          \
        *zero |= b == 0;                                                                        \
        T d = (b == 0 || b == -1) ? (T)1 : b;                                                   \
        return (b == 0 || b == -1) ? (T)0 : (T)(a % d);                                         \
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

static inline float ta_bits_f32(uint32_t u) {
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
}

static inline uint32_t ta_f32_bits(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return v.u;
}

/* 2^n for an integral float n in [-150, 128], as two normal factors (their product rounds once, to a
 * subnormal, 0 or inf where 2^n is one). */
static inline float ta_pow2_scale(float p, float n) {
    int32_t k = (int32_t)n, half = k / 2;
    return p * ta_bits_f32((uint32_t)(half + 127) << 23) * ta_bits_f32((uint32_t)(k - half + 127) << 23);
}

/* 2^x: x = n + f, |f| <= 1/2, 2^f by the minimax polynomial of the native kernels (1.9e-9 relative). */
static inline float ta_exp2f(float x) {
    float c = x < -150.0f ? -150.0f : (x > 128.0f ? 128.0f : x); /* NaN passes through both */
    float n = rintf(c), f = c - n;
    float p = 0.00015350866257614953f;
    p = p * f + 0.0013399974174552543f;
    p = p * f + 0.009618470186087573f;
    p = p * f + 0.05550328643246867f;
    p = p * f + 0.24022647063769273f;
    p = p * f + 0.6931472058202f;
    p = p * f + 1.0000000005308562f;
    return x != x ? x : ta_pow2_scale(p, n);
}

/* e^x: n = round(x / ln 2), r = x - n ln 2 in two parts (Cody and Waite), e^r by Taylor to degree 7
 * on |r| <= ln(2)/2 (first omitted term 5e-9 relative). */
static inline float ta_expf(float x) {
    float c = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
    float n = rintf(c * 1.4426950408889634f);
    float r = c - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return x != x ? x : ta_pow2_scale(p, n);
}

/* ln x = e ln 2 + ln m: x = m 2^e with m in [sqrt(1/2), sqrt(2)) (subnormals scaled by 2^24 first),
 * s = (m - 1) / (m + 1), ln m = 2 atanh(s) by its odd series to s^13 (|s| <= 0.172). Returns ln m
 * and sets *e. */
static inline float ta_log_reduce(float x, float *e) {
    int tiny = x < 1.1754943508222875e-38f;
    uint32_t u = ta_f32_bits(tiny ? x * 16777216.0f : x);
    float m = ta_bits_f32((u & 0x007fffffu) | 0x3f800000u);
    /* selects between floats only: an int flag in integer arithmetic keeps GCC from vectorising */
    const float big = m > 1.4142135623730951f ? 1.0f : 0.0f;
    m = m > 1.4142135623730951f ? m * 0.5f : m;
    *e = (float)((int32_t)((u >> 23) & 0xff) - 127) + big - (tiny ? 24.0f : 0.0f);
    float s = (m - 1.0f) / (m + 1.0f), z = s * s;
    float p = 2.0f / 13;
    p = p * z + 2.0f / 11;
    p = p * z + 2.0f / 9;
    p = p * z + 2.0f / 7;
    p = p * z + 2.0f / 5;
    p = p * z + 2.0f / 3;
    p = p * z + 2.0f;
    return s * p;
}

/* The values of ln and log2 at 0, +inf, negatives and NaN, around the reduced result r. */
static inline float ta_log_special(float x, float r) {
    r = x == INFINITY ? x : r;
    r = x == 0.0f ? -INFINITY : r;
    return (x < 0.0f || x != x) ? NAN : r;
}

static inline float ta_logf(float x) {
    float e, lnm = ta_log_reduce(x, &e);
    return ta_log_special(x, e * 0.693145751953125f + (lnm + e * 1.428606765330187e-06f));
}

static inline float ta_log2f(float x) {
    float e, lnm = ta_log_reduce(x, &e);
    return ta_log_special(x, e + lnm * 1.4426950408889634f);
}

/* tanh: (1 - e) / (1 + e) with e = e^(-2|x|), and the odd Taylor series below |x| = 0.4 where that
 * quotient cancels (first omitted term < 3e-10 relative); the sign of x. */
static inline float ta_tanhf(float x) {
    float ax = fabsf(x);
    float e = ta_expf(-2.0f * ax);
    float far = (1.0f - e) / (1.0f + e);
    float x2 = ax * ax;
    float p = -929569.0f / 638512875.0f;
    p = p * x2 + 21844.0f / 6081075.0f;
    p = p * x2 + -1382.0f / 155925.0f;
    p = p * x2 + 62.0f / 2835.0f;
    p = p * x2 + -17.0f / 315.0f;
    p = p * x2 + 2.0f / 15.0f;
    p = p * x2 + -1.0f / 3.0f;
    float near = ax * x2 * p + ax;
    float t = ax < 0.4f ? near : far;
    return x != x ? x : copysignf(t, x);
}

/* sigmoid: e = e^(-|x|) never overflows; 1 / (1 + e) for x >= 0, e / (1 + e) below (PyTorch's form). */
static inline float ta_sigmoidf(float x) {
    float e = ta_expf(-fabsf(x));
    return (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

static inline double ta_sigmoid(double x) {
    double e = exp(-fabs(x));
    return (x >= 0.0 ? 1.0 : e) / (1.0 + e);
}
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
