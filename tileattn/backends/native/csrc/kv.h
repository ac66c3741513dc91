/* K/V caches read as stored: element formats, their conversion to real lanes in registers, and the
 * scale descriptor of a quantised cache (the decode kernel's side; kernels.py builds the descriptor).
 *
 * Formats (kv_dtype): the float formats of q (fp32, fp64, bf16, fp16), int8, fp8 e4m3fn / e5m2
 * (torch.float8_e4m3fn: no infinities, 0x7f/0xff are NaN; torch.float8_e5m2: the top byte of an
 * fp16, infinities and NaN included) and int4 (two values a byte: byte c of a row holds channel 2c
 * in its low nibble, 2c + 1 in its high nibble, two's complement in [-8, 7]; a row of W channels is
 * W / 2 bytes, and strides count bytes) and llama.cpp's blocks q8_0 / q4_0 (per 32 values an fp16
 * scale d, then 32 int8 q, value d q, or 16 bytes of nibbles, the low nibbles the block's first 16
 * values, the high nibbles its last 16, value d (nibble - 8): value i of a row lives in block i / 32,
 * 34 or 18 bytes a block; their scales are inside, so a row converts to its real values). Every
 * conversion is exact (d q needs at most 19 significant bits).
 *
 * Dequantisation is x_deq = (x + offset) * scale, the Ascend antiquant convention (no offset =
 * symmetric). k_scale, k_offset, v_scale, v_offset are fp32 tensors (each optional), read through
 * six numbers st = (batch, kv head, position, slot, channel group, groups):
 *
 *     element of (sequence b, kv head h, key j, channel c) = p[b st0 + h st1 + pos(j) + (c / (W / groups)) st4]
 *     pos(j) = page(b, j) st2 + (j % page_size) st3   for a paged cache (physical slots)
 *            = (t0(b) + j) st2                         otherwise (t0 = cu_seqlens_k[b] for varlen k)
 *
 * with W the head dim (D for K, Dv for V) and zero strides along broadcast axes. A scale is then
 * classified once per call by what it varies with: nothing within a (sequence, kv head) (SCALAR:
 * per tensor, per head, FlashAttention-3's descales), the channel only (CHANNEL), the key only
 * (TOKEN), or both (GENERAL: per-token groups of channels). q_scale (FlashAttention-3's q_descale)
 * multiplies the scores; it is read at b q_scale_st[0] + h q_scale_st[1] for kv head h.
 */
#ifndef TA_KV_H
#define TA_KV_H

#include "common.h"

enum { TA_QS_NONE, TA_QS_SCALAR, TA_QS_CHANNEL, TA_QS_TOKEN, TA_QS_GENERAL };

/* e4m3 rows known to hold no NaN byte (0x7f, 0xff): read without the NaN check. Internal to the
 * kernels (never a kv_dtype of the interface). */
#define TA_F8E4M3_FINITE 15

static inline int64_t ta_kv_dtype(const ta_args *a) {
    return (a->options & TA_OPT_KV_QUANT) ? a->kv_dtype : a->dtype;
}

/* Bytes per element of the stored tensor (int4, q8_0, q4_0: per byte): what strides count. */
static inline int64_t ta_kv_elsize(int64_t kd) {
    return kd == TA_F64 ? 8 : kd == TA_F32 ? 4 : kd >= TA_I8 ? 1 : 2;
}

static inline int ta_qs_kind(const void *p, const int64_t st[6]) {
    if (!p) return TA_QS_NONE;
    int token = st[2] != 0 || st[3] != 0, channel = st[5] > 1 && st[4] != 0;
    return token && channel ? TA_QS_GENERAL : token ? TA_QS_TOKEN : channel ? TA_QS_CHANNEL : TA_QS_SCALAR;
}

/* pos(j) of the descriptor above for sequence s. */
static inline int64_t ta_qs_pos(const ta_args *a, const ta_seq *s, const int64_t st[6], int64_t j) {
    if (st[2] == 0 && st[3] == 0) return 0;
    if (a->paged) {
        const int32_t *bt = (const int32_t *)a->block_table;
        int64_t page = bt[s->b * a->bt_st[0] + (j / a->page_size) * a->bt_st[1]];
        return page * st[2] + (j % a->page_size) * st[3];
    }
    int64_t t0 = a->varlen ? ((const int32_t *)a->cu_k)[s->b] : 0;
    return (t0 + j) * st[2];
}

/* The scale element of channel group g at position offset pos. */
static inline float ta_qs_at(const void *p, const int64_t st[6], int64_t b, int64_t hk, int64_t pos, int64_t g) {
    return ((const float *)p)[b * st[0] + hk * st[1] + pos + g * st[4]];
}

/* ---------------------------------------------------------------------------- scalar conversions */

static inline float ta_e5m2_to_f32(uint8_t x) { return ta_f16_to_f32((uint16_t)(x << 8)); }

/* e4m3 is e5m2's layout with one exponent bit less: placed in an fp16 it reads 2^-8 of its value
 * (subnormals included), and 0x7f / 0xff are NaN. */
static inline float ta_e4m3_to_f32(uint8_t x) {
    if ((x & 0x7f) == 0x7f) return NAN;
    return ta_f16_to_f32((uint16_t)(((x & 0x80) << 8) | ((x & 0x7f) << 7))) * 256.0f;
}

/* Bytes of a block of 32 values of q8_0 / q4_0, and its fp16 scale. */
static inline int64_t ta_block_bytes(int64_t kd) { return kd == TA_Q8_0 ? 34 : 18; }

static inline float ta_block_scale(const uint8_t *block) {
    uint16_t d;
    memcpy(&d, block, 2);
    return ta_f16_to_f32(d);
}

/* Element i of a row of format kd. */
static inline double ta_kv_load1(const void *row, int64_t i, int64_t kd) {
    switch (kd) {
    case TA_F32: return ((const float *)row)[i];
    case TA_F64: return ((const double *)row)[i];
    case TA_BF16: return ta_bf16_to_f32(((const uint16_t *)row)[i]);
    case TA_F16: return ta_f16_to_f32(((const uint16_t *)row)[i]);
    case TA_I8: return ((const int8_t *)row)[i];
    case TA_I4: return (((((const uint8_t *)row)[i >> 1] >> (4 * (i & 1))) & 15) ^ 8) - 8;
    case TA_Q8_0: {
        const uint8_t *b = (const uint8_t *)row + (i >> 5) * 34;
        return (double)ta_block_scale(b) * (int8_t)b[2 + (i & 31)];
    }
    case TA_Q4_0: {
        const uint8_t *b = (const uint8_t *)row + (i >> 5) * 18;
        return (double)ta_block_scale(b) * (((b[2 + (i & 15)] >> ((i & 16) >> 2)) & 15) - 8);
    }
    case TA_F8E4M3:
    case TA_F8E4M3_FINITE: return ta_e4m3_to_f32(((const uint8_t *)row)[i]);
    default: return ta_e5m2_to_f32(((const uint8_t *)row)[i]);
    }
}

/* ---------------------------------------------------------------------------- vector conversions */

/* Whether ta_kv_vload converts e4m3 through an fp16 conversion in registers (simd.h), which yields
 * 2^-8 of the value: the kernel folds the 2^8 into its scales (exact). */
#ifdef TA_VCVT_F16
#define TA_E4M3_IN_REGISTERS 1
#else
#define TA_E4M3_IN_REGISTERS 0
#endif

/* The power of two by which ta_kv_vload's lanes fall short of the values of format kd. */
static inline real ta_kv_unit(int64_t kd) {
    return (kd == TA_F8E4M3 || kd == TA_F8E4M3_FINITE) && TA_E4M3_IN_REGISTERS ? 256 : 1;
}

/* VW elements [i, i + VW) of a row of format kd as real lanes (times 1 / ta_kv_unit(kd)). kd is a
 * compile-time constant at every call, so each format gets its own instructions: simd.h's widening
 * loads where the ISA has them (one load and a shift or an int->float conversion for bf16, fp16,
 * int8 and e5m2; e4m3 adds a mask and a NaN check; int4 splits nibbles; q8_0 is int8 times its
 * block's scale: VW divides 32, so a vector lies in one block), else element by element. */
TA_INLINE vr ta_kv_vload(const void *row, int64_t i, const int kd) {
#ifdef TA_VCVT_INT
    const char *p = (const char *)row;
    switch (kd) {
    case TA_F32: return vload((const real *)(p + 4 * i));
    case TA_BF16: return vload_bf16(p + 2 * i);
#ifdef TA_VCVT_F16
    case TA_F16: return vload_f16(p + 2 * i);
#endif
    case TA_I8: return vload_i8(p + i);
    case TA_I4: return vload_i4(p + i / 2);
    case TA_Q8_0: {
        const uint8_t *b = (const uint8_t *)p + (i >> 5) * 34;
        return vload_i8(b + 2 + (i & 31)) * vset1(ta_block_scale(b));
    }
#ifdef TA_VCVT_F16
    case TA_F8E5M2: return vload_e5m2(p + i);
    case TA_F8E4M3:
    case TA_F8E4M3_FINITE: return vload_e4m3(p + i, kd == TA_F8E4M3_FINITE);
#endif
    default: break;
    }
#else
    if (kd == (TA_REAL_BITS == 64 ? TA_F64 : TA_F32)) return vload((const real *)row + i);
#endif
    vr r;
    for (int t = 0; t < VW; t++) r[t] = (real)ta_kv_load1(row, i + t, kd);
    return r;
}

#endif
