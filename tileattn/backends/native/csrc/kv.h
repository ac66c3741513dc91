/* K/V caches read as stored: element formats, their conversion to real lanes in registers, and the
 * scale descriptor of a quantised cache (the decode kernel's side; kernels.py builds the descriptor).
 *
 * Formats (kv_dtype): the float formats of q (fp32, fp64, bf16, fp16), int8, fp8 e4m3fn / e5m2
 * (torch.float8_e4m3fn: no infinities, 0x7f/0xff are NaN; torch.float8_e5m2: the top byte of an
 * fp16, infinities and NaN included) and int4 (two values a byte: byte c of a row holds channel 2c
 * in its low nibble, 2c + 1 in its high nibble, two's complement in [-8, 7]; a row of W channels is
 * W / 2 bytes, and strides count bytes). Every conversion is exact.
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

/* Bytes per element of the stored tensor (int4: per byte of two values): what strides count. */
static inline int64_t ta_kv_elsize(int64_t kd) {
    return kd == TA_F64 ? 8 : kd == TA_F32 ? 4 : kd >= TA_I8 ? 1 : 2;
}

/* Whether any of the rows [0, n) (width bytes each) of an e4m3 tensor holds a NaN. The first pass
 * over a chunk's rows: it prefetches rows ahead (strided rows defeat the hardware prefetcher). */
static inline int ta_e4m3_any_nan(const void *const *rows, int64_t n, int64_t width) {
#if defined(TA_ISA_AVX512)
    const __m512i m = _mm512_set1_epi8(0x7f);
    __mmask64 any = 0;
    for (int64_t j = 0; j < n; j++) {
        if (j + 16 < n)
            for (int64_t c = 0; c < width; c += 64) __builtin_prefetch((const char *)rows[j + 16] + c, 0, 3);
        for (int64_t c = 0; c < width; c += 64) {
            __mmask64 live = width - c >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (width - c)) - 1);
            __m512i x = _mm512_maskz_loadu_epi8(live, (const char *)rows[j] + c);
            any |= _mm512_mask_cmpeq_epi8_mask(live, _mm512_and_si512(x, m), m);
        }
    }
    return any != 0;
#else
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < width; c++)
            if ((((const uint8_t *)rows[j])[c] & 0x7f) == 0x7f) return 1;
    return 0;
#endif
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

/* Element i of a row of format kd. */
static inline double ta_kv_load1(const void *row, int64_t i, int64_t kd) {
    switch (kd) {
    case TA_F32: return ((const float *)row)[i];
    case TA_F64: return ((const double *)row)[i];
    case TA_BF16: return ta_bf16_to_f32(((const uint16_t *)row)[i]);
    case TA_F16: return ta_f16_to_f32(((const uint16_t *)row)[i]);
    case TA_I8: return ((const int8_t *)row)[i];
    case TA_I4: return (((((const uint8_t *)row)[i >> 1] >> (4 * (i & 1))) & 15) ^ 8) - 8;
    case TA_F8E4M3:
    case TA_F8E4M3_FINITE: return ta_e4m3_to_f32(((const uint8_t *)row)[i]);
    default: return ta_e5m2_to_f32(((const uint8_t *)row)[i]);
    }
}

/* ---------------------------------------------------------------------------- vector conversions */

/* Whether ta_kv_vload converts e4m3 through an fp16 conversion in registers, which yields 2^-8 of
 * the value: the kernel folds the 2^8 into its scales (exact). */
#if TA_REAL_BITS == 32 && (defined(TA_ISA_AVX512) || (defined(TA_ISA_AVX2) && defined(__F16C__)))
#define TA_E4M3_IN_REGISTERS 1
#else
#define TA_E4M3_IN_REGISTERS 0
#endif

/* The power of two by which ta_kv_vload's lanes fall short of the values of format kd. */
static inline real ta_kv_unit(int64_t kd) {
    return (kd == TA_F8E4M3 || kd == TA_F8E4M3_FINITE) && TA_E4M3_IN_REGISTERS ? 256 : 1;
}

/* The VW / 2 bytes of int4 from p as VW sign-extended int8 lanes in channel order (the low nibble of
 * byte c is channel 2c): nibbles split, interleaved back, then (x ^ 8) - 8. */
#if defined(TA_ISA_AVX2) || defined(TA_ISA_AVX512)
TA_INLINE __m128i ta_i4_bytes(__m128i x) {
    const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    __m128i lo = _mm_and_si128(x, low), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low);
    return _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), eight), eight);
}
#endif

/* VW elements [i, i + VW) of a row of format kd as real lanes (times 1 / ta_kv_unit(kd)). kd is a
 * compile-time constant at every call, so each format gets its own instructions: one widening load
 * (and a shift or an int->float conversion) for bf16, fp16, int8 and e5m2; e4m3 adds a mask and a
 * NaN check; int4 splits nibbles (ta_i4_bytes). Without a vector form, element by element. */
TA_INLINE vr ta_kv_vload(const void *row, int64_t i, const int kd) {
#if TA_REAL_BITS == 32 && defined(TA_ISA_AVX512)
    const char *p = (const char *)row;
    switch (kd) {
    case TA_F32: return _mm512_loadu_ps(p + 4 * i);
    case TA_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(p + 2 * i))), 16));
    case TA_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(p + 2 * i)));
    case TA_I8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(p + i))));
    case TA_I4: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ta_i4_bytes(_mm_loadl_epi64((const void *)(p + i / 2)))));
    case TA_F8E5M2: return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)(p + i))), 8));
    case TA_F8E4M3:
    case TA_F8E4M3_FINITE: {
        __m128i x = _mm_loadu_si128((const void *)(p + i));
        __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7), _mm256_set1_epi16((short)0xbfff));
        if (kd == TA_F8E4M3_FINITE) return _mm512_cvtph_ps(h);
        __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(x, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
        return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(NAN));
    }
    default: break;
    }
#elif TA_REAL_BITS == 32 && defined(TA_ISA_AVX2)
    const char *p = (const char *)row;
    switch (kd) {
    case TA_F32: return _mm256_loadu_ps((const float *)(p + 4 * i));
    case TA_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(p + 2 * i))), 16));
    case TA_I8: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(p + i))));
    case TA_I4: {
        int32_t four;
        memcpy(&four, p + i / 2, 4);
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ta_i4_bytes(_mm_cvtsi32_si128(four))));
    }
#ifdef __F16C__
    case TA_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const void *)(p + 2 * i)));
    case TA_F8E5M2: return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const void *)(p + i))), 8));
    case TA_F8E4M3:
    case TA_F8E4M3_FINITE: {
        __m128i x = _mm_loadl_epi64((const void *)(p + i));
        __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(x), 7), _mm_set1_epi16((short)0xbfff));
        if (kd == TA_F8E4M3_FINITE) return _mm256_cvtph_ps(h);
        __m128i nan = _mm_cmpeq_epi8(_mm_and_si128(x, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
        __m256 nan32 = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan));
        return _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(NAN), nan32);
    }
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
