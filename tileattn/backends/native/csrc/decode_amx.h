/* The decode path's dot products on AMX tiles (Intel Sapphire Rapids and later, where Linux grants
 * the tile state; amx.h): the scores S^T = K Q^T and P.V of a task, for K/V stored as bf16, int8
 * (AMX-INT8) or fp8 (widened to bf16, exactly).
 *
 * A decode task has few query rows (the G heads of a kv head), far fewer than a tile's 16, so the
 * spare tile columns / rows hold *digits* of the fp32 operands instead, which makes the products
 * exact rather than rounded to bf16:
 *
 *   bf16 K/V (tdpbf16ps): q (times any per-channel K scale) and P are split into three bf16 digits,
 *       x = d0 + d1 + d2 exactly (8 + 8 + 8 significant bits); 4 rows x 3 digits = 12 columns of the
 *       B tile for the scores, 12 rows of the A tile for P.V. Products are exact, sums in fp32 (the
 *       unit's own order), the digits' partial sums added in fp32 at the end.
 *   int8 K/V (tdpbssd): q and P become 30-bit fixed-point integers, per row x = round(v * 2^(29-e))
 *       with 2^e > max |v|, written as four balanced base-256 digits in [-128, 127]; 4 rows x 4
 *       digits = 16 columns / rows. The digit products are summed exactly in int32 by the unit and
 *       combined (Horner, fp32) at the end: the only rounding besides fp32's is that of the fixed
 *       point, 2^-30 of a row's largest element.
 *
 * K tiles are loaded from the cache in place (16 keys whose rows are equally spaced: contiguous, or
 * within one page), else from a 16-row copy; fp8 rows are widened into a bf16 buffer first. V is
 * repacked once per task into the tiles' interleaved layout (pairs of keys for bf16, quads for int8)
 * with in-lane unpacks, which permute the channels within each 16-column C tile; the final combine
 * puts them back. Rows are taken DEC_AMX_RB at a time.
 */
#ifndef TA_DECODE_AMX_H
#define TA_DECODE_AMX_H

#include "amx.h"

#ifdef TA_HAVE_AMX
#define DEC_AMX_RB 4
#ifdef __AMX_INT8__
#define DEC_AMX_INT8 1
/* c += a b on tiles: int8 digits x int8 (exact int32 sums) or bf16 pairs (fp32 sums) */
#define DEC_AMX_DP(c, a, b)              \
    do {                                 \
        if (kd == TA_I8)                 \
            _tile_dpbssd(c, a, b);       \
        else                             \
            _tile_dpbf16ps(c, a, b);     \
    } while (0)
#else
#define DEC_AMX_INT8 0
#define DEC_AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* Keys per A tile row block of P.V: pairs (bf16) or quads (int8) of 16 tile rows. */
static inline int64_t dec_amx_kblock(int64_t kd) { return kd == TA_I8 ? 64 : 32; }

/* Whether a call with format kd and these head dims takes the tiles (else the FMA kernels). */
static int dec_amx_eligible(const ta_args *a, int64_t kd) {
    if (a->options & TA_OPT_NO_AMX) return 0;
    if (!(kd == TA_BF16 || kd == TA_F8E4M3 || kd == TA_F8E5M2 || (DEC_AMX_INT8 && kd == TA_I8))) return 0;
    const int64_t w = kd == TA_I8 ? 64 : 32; /* elements per 64-byte tile row */
    return a->D % w == 0 && a->Dv % w == 0 && a->D <= 256 && ta_amx_available();
}

/* Bytes of the per-task buffers: the scores' or P.V's scratch (*work, one after the other) and the
 * packed V (*vbytes). */
static void dec_amx_bytes(int64_t kd, int64_t D, int64_t Dv, int64_t n, size_t *work, size_t *vbytes) {
    const int64_t kb = dec_amx_kblock(kd), nk = ta_round_up(n > 0 ? n : 1, kb), es = kd == TA_I8 ? 1 : 2;
    const size_t scores = (size_t)(2048 + 2 * 16 * 512 + (D * es / 64) * 1024 + ta_round_up(n, 16) * D * 2);
    const size_t pv = (size_t)(4096 + (nk / kb) * 1024);
    *work = scores > pv ? scores : pv;
    *vbytes = (size_t)(nk * Dv * es);
}

/* -------------------------------------------------------------------------------------- digits */

/* Three bf16 digits of 16 fp32 values: x = d0 + d1 + d2 exactly. */
static inline void dec_bf16_digits(__m512 x, __m256i d[3]) {
    for (int t = 0; t < 3; t++) {
        __m256bh h = _mm512_cvtneps_pbh(x);
        d[t] = (__m256i)h;
        x = _mm512_sub_ps(x, _mm512_cvtpbh_ps(h));
    }
}

/* The fixed-point factor 2^(29 - e) with 2^e > max |v| (1 when the row is zero or not finite). */
static inline float dec_fixed_factor(float maxabs) {
    if (!(maxabs > 0) || !isfinite(maxabs)) return 1.0f;
    int e;
    frexpf(maxabs, &e);
    return ldexpf(1.0f, 29 - e);
}

/* Four balanced base-256 digits of 16 int32 lanes |x| < 2^30: x = sum_t 256^t d_t, d_t in [-128, 127]. */
static inline void dec_int8_digits(__m512i x, __m128i d[4]) {
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    for (int t = 0; t < 3; t++) {
        __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(x, c128), c255), c128);
        d[t] = _mm512_cvtepi32_epi8(lo);
        x = _mm512_srai_epi32(_mm512_sub_epi32(x, lo), 8);
    }
    d[3] = _mm512_cvtepi32_epi8(x);
}

/* ------------------------------------------------------------------------------------- scores */

/* B tiles of the scores for rows [0, rb) of q (rb <= 4, Dp values per row): per k step of 64 bytes,
 * 16 rows of (pairs / quads of d) x 16 columns (digit t, row r) at column 4t + r. int8: inv[r]
 * receives 1 / the row's fixed-point factor. Returns 0, or 1 when a row is not finite (int8). */
static int dec_amx_q_tiles(int64_t kd, const real *q, int64_t Dp, int64_t D, int rb, uint8_t *B, float *inv) {
    const int64_t steps = kd == TA_I8 ? D / 64 : D / 32;
    memset(B, 0, (size_t)steps * 1024);
    int bad = 0;
    for (int r = 0; r < rb; r++) {
        const real *qr = q + r * Dp;
        if (kd == TA_I8) {
            float mx = 0;
            for (int64_t c = 0; c < D; c++) mx = fabsf(qr[c]) > mx || qr[c] != qr[c] ? fabsf(qr[c]) : mx;
            bad |= !isfinite(mx);
            float f = dec_fixed_factor(mx);
            inv[r] = 1.0f / f;
            for (int64_t c0 = 0; c0 < D; c0 += 16) {
                __m128i d[4];
                dec_int8_digits(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qr + c0), _mm512_set1_ps(f))), d);
                for (int t = 0; t < 4; t++) {
                    uint8_t bytes[16];
                    _mm_storeu_si128((__m128i *)bytes, d[t]);
                    for (int i = 0; i < 16; i++) { /* element c -> step c/64, row (c%64)/4, byte c%4 of column */
                        int64_t c = c0 + i;
                        B[(c / 64) * 1024 + ((c % 64) / 4) * 64 + (4 * t + r) * 4 + c % 4] = bytes[i];
                    }
                }
            }
        } else {
            inv[r] = 1.0f;
            for (int64_t c0 = 0; c0 < D; c0 += 16) {
                __m256i d[3];
                dec_bf16_digits(_mm512_loadu_ps(qr + c0), d);
                for (int t = 0; t < 3; t++) {
                    uint16_t w[16];
                    _mm256_storeu_si256((__m256i *)w, d[t]);
                    for (int i = 0; i < 16; i++) { /* element c -> step c/32, row (c%32)/2, half c%2 */
                        int64_t c = c0 + i;
                        ((uint16_t *)B)[(c / 32) * 512 + ((c % 32) / 2) * 32 + (4 * t + r) * 2 + c % 2] = w[i];
                    }
                }
            }
        }
    }
    return bad;
}

/* K rows [0, n) widened to bf16 (fp8 formats) into buf, n padded to 16 with zero rows. */
static void dec_amx_widen(int64_t kd, const void *const *rows, int64_t n, int64_t width, uint16_t *buf) {
    const int64_t np = ta_round_up(n, 16);
    for (int64_t j = 0; j < np; j++) {
        uint16_t *d = buf + j * width;
        if (j >= n) {
            memset(d, 0, (size_t)width * 2);
            continue;
        }
        for (int64_t c = 0; c < width; c += 32) {
            __m512 lo = kd == TA_F8E4M3 ? ta_kv_vload(rows[j], c, TA_F8E4M3) : ta_kv_vload(rows[j], c, TA_F8E5M2);
            __m512 hi = kd == TA_F8E4M3 ? ta_kv_vload(rows[j], c + 16, TA_F8E4M3) : ta_kv_vload(rows[j], c + 16, TA_F8E5M2);
            _mm512_storeu_si512(d + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* The 16 K rows of the A tile for keys [j0, j0 + 16): in place when they are equally spaced
 * (contiguous, or within one page), else copied into buf with zero rows past n. */
static const char *dec_amx_k_block(const void *const *krows, int64_t j0, int64_t n, int64_t row_bytes, char *buf,
                                   int64_t *stride) {
    const char *k0 = (const char *)krows[j0];
    int64_t st = n > j0 + 1 ? (const char *)krows[j0 + 1] - k0 : row_bytes;
    int same = j0 + 16 <= n && st > 0;
    for (int u = 2; same && u < 16; u++) same = (const char *)krows[j0 + u] == k0 + u * st;
    if (same) {
        *stride = st;
        return k0;
    }
    for (int u = 0; u < 16; u++) {
        if (j0 + u < n)
            memcpy(buf + u * row_bytes, krows[j0 + u], (size_t)row_bytes);
        else
            memset(buf + u * row_bytes, 0, (size_t)row_bytes);
    }
    *stride = row_bytes;
    return buf;
}

/* Pull the rows of keys [j0, j0 + 16) towards the core ahead of their tile loads (paged caches defeat
 * the hardware prefetcher at page boundaries). */
static inline void dec_amx_prefetch(const void *const *rows, int64_t j0, int64_t n, int64_t row_bytes) {
    for (int64_t u = j0; u < j0 + 16 && u < n; u++)
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)rows[u] + b, _MM_HINT_T0);
}

/* Scores of 16 keys from the C tile stored at C: rows [0, rb) of the block into S + j0 (np per row). */
static inline void dec_amx_take_scores(int64_t kd, const int32_t *C, int rb, const float *inv, int bad, real alpha,
                                       real *S, int64_t np, int64_t j0) {
    __m512i T[16];
    for (int u = 0; u < 16; u++) T[u] = _mm512_loadu_si512(C + 16 * u);
    ta_transpose16(T); /* T[col] = that column over the 16 keys */
    for (int r = 0; r < rb; r++) {
        __m512 s;
        if (kd == TA_I8) {
            s = _mm512_cvtepi32_ps(T[12 + r]);
            for (int t = 2; t >= 0; t--) s = _mm512_fmadd_ps(s, _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(T[4 * t + r]));
            s = bad ? _mm512_set1_ps(NAN) : _mm512_mul_ps(s, _mm512_set1_ps(inv[r]));
        } else {
            s = _mm512_add_ps(_mm512_add_ps((__m512)T[r], (__m512)T[4 + r]), (__m512)T[8 + r]);
        }
        _mm512_storeu_ps(S + r * np + j0, _mm512_mul_ps(s, _mm512_set1_ps(alpha)));
    }
}

/* Raw scores of rows [0, M) (q: M x Dp, already holding any per-channel K scale and unit) with keys
 * [0, n) into S (np per row), times alpha. rows[j] are the K rows (bf16 or int8 as stored; fp8:
 * widened first). Two key blocks at a time (tiles 0, 1: C; 2, 3: A; 4-7: the q digits of up to
 * four k steps, else reloaded), so the two accumulation chains overlap. */
static void dec_amx_scores(int64_t kd, const real *q, int64_t M, int64_t Dp, int64_t D, const void *const *rows,
                           int64_t n, real alpha, real *S, int64_t np, char *mem) {
    const int64_t es = kd == TA_I8 ? 1 : 2, steps = D * es / 64, row_bytes = D * es;
    int32_t *C = (int32_t *)mem;
    char *gather = mem + 2048, *B = gather + 2 * 16 * 512, *wide = B + steps * 1024;
    const void *const *krows = rows;
    if (kd == TA_F8E4M3 || kd == TA_F8E5M2) { /* widened rows, addressed like a contiguous cache */
        dec_amx_widen(kd, rows, n, D, (uint16_t *)wide);
        kd = TA_BF16;
        krows = NULL;
    }
    const int64_t rbytes = kd == TA_I8 ? D : 2 * D;
    const int resident = steps <= 4;
    for (int64_t r0 = 0; r0 < M; r0 += DEC_AMX_RB) {
        const int rb = M - r0 < DEC_AMX_RB ? (int)(M - r0) : DEC_AMX_RB;
        float inv[DEC_AMX_RB];
        int bad = dec_amx_q_tiles(kd, q + r0 * Dp, Dp, D, rb, (uint8_t *)B, inv);
        if (resident) {
            if (steps > 0) _tile_loadd(4, B, 64);
            if (steps > 1) _tile_loadd(5, B + 1024, 64);
            if (steps > 2) _tile_loadd(6, B + 2048, 64);
            if (steps > 3) _tile_loadd(7, B + 3072, 64);
        }
        for (int64_t j0 = 0; j0 < n; j0 += 32) {
            const int two = j0 + 16 < n;
            const char *base[2];
            int64_t stride[2];
            for (int h = 0; h < 1 + two; h++) {
                if (krows) {
                    if (j0 + 64 + 16 * h < n) dec_amx_prefetch(krows, j0 + 64 + 16 * h, n, rbytes);
                    base[h] = dec_amx_k_block(krows, j0 + 16 * h, n, rbytes, gather + h * 16 * 512, &stride[h]);
                } else {
                    base[h] = wide + (j0 + 16 * h) * rbytes;
                    stride[h] = rbytes;
                }
            }
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t s = 0; s < steps; s++) {
                if (!resident) _tile_loadd(4, B + s * 1024, 64);
                _tile_loadd(2, base[0] + s * 64, stride[0]);
                if (two) _tile_loadd(3, base[1] + s * 64, stride[1]);
                switch (resident ? s : 0) {
                case 0: DEC_AMX_DP(0, 2, 4); if (two) DEC_AMX_DP(1, 3, 4); break;
                case 1: DEC_AMX_DP(0, 2, 5); if (two) DEC_AMX_DP(1, 3, 5); break;
                case 2: DEC_AMX_DP(0, 2, 6); if (two) DEC_AMX_DP(1, 3, 6); break;
                default: DEC_AMX_DP(0, 2, 7); if (two) DEC_AMX_DP(1, 3, 7); break;
                }
            }
            _tile_stored(0, C, 64);
            if (two) _tile_stored(1, C + 256, 64);
            dec_amx_take_scores(kd, C, rb, inv, bad, alpha, S + r0 * np, np, j0);
            if (two) dec_amx_take_scores(kd, C + 256, rb, inv, bad, alpha, S + r0 * np, np, j0 + 16);
        }
    }
}

/* --------------------------------------------------------------------------------------- P.V */

/* V rows [0, n) in the B layout of P.V, block-major: tile (key block b, 16-column block cb) at
 * (b * Dv/16 + cb) * 1024 bytes, 16 rows of 64 bytes (pairs or quads of keys), zero padded. */
static void dec_amx_pack_v(int64_t kd, const void *const *rows, int64_t n, int64_t Dv, uint8_t *dst) {
    const int64_t kb = dec_amx_kblock(kd), nk = ta_round_up(n > 0 ? n : 1, kb), ncb = Dv / 16;
    const int64_t rbytes = kd == TA_I8 ? Dv : kd == TA_BF16 ? 2 * Dv : Dv;
    const __m512i zero = _mm512_setzero_si512();
    if (kd == TA_I8) { /* quads: 4 key rows of 64 channels -> 4 blocks of 16 channels */
        for (int64_t j = 0; j < nk; j += 4) {
            if (j + 32 < n)
                for (int u = 0; u < 4; u++) dec_amx_prefetch(rows, j + 32 + u, j + 33 + u, rbytes);
            uint8_t *row = dst + ((j / kb) * ncb * 16 + (j % kb) / 4) * 64;
            for (int64_t z = 0; z < Dv / 64; z++) {
                __m512i r[4];
                for (int u = 0; u < 4; u++)
                    r[u] = j + u < n ? _mm512_loadu_si512((const int8_t *)rows[j + u] + 64 * z) : zero;
                __m512i p01l = _mm512_unpacklo_epi8(r[0], r[1]), p01h = _mm512_unpackhi_epi8(r[0], r[1]);
                __m512i p23l = _mm512_unpacklo_epi8(r[2], r[3]), p23h = _mm512_unpackhi_epi8(r[2], r[3]);
                _mm512_storeu_si512(row + (4 * z + 0) * 1024, _mm512_unpacklo_epi16(p01l, p23l));
                _mm512_storeu_si512(row + (4 * z + 1) * 1024, _mm512_unpackhi_epi16(p01l, p23l));
                _mm512_storeu_si512(row + (4 * z + 2) * 1024, _mm512_unpacklo_epi16(p01h, p23h));
                _mm512_storeu_si512(row + (4 * z + 3) * 1024, _mm512_unpackhi_epi16(p01h, p23h));
            }
        }
        return;
    }
    for (int64_t j = 0; j < nk; j += 2) { /* pairs: 2 key rows of 32 channels -> 2 blocks of 16 */
        if (j + 32 < n)
            for (int u = 0; u < 2; u++) dec_amx_prefetch(rows, j + 32 + u, j + 33 + u, rbytes);
        uint8_t *row = dst + ((j / kb) * ncb * 16 + (j % kb) / 2) * 64;
        for (int64_t z = 0; z < Dv / 32; z++) {
            __m512i r[2];
            for (int u = 0; u < 2; u++) {
                if (j + u >= n) {
                    r[u] = zero;
                } else if (kd == TA_BF16) {
                    r[u] = _mm512_loadu_si512((const uint16_t *)rows[j + u] + 32 * z);
                } else {
                    __m512 lo = kd == TA_F8E4M3 ? ta_kv_vload(rows[j + u], 32 * z, TA_F8E4M3)
                                                : ta_kv_vload(rows[j + u], 32 * z, TA_F8E5M2);
                    __m512 hi = kd == TA_F8E4M3 ? ta_kv_vload(rows[j + u], 32 * z + 16, TA_F8E4M3)
                                                : ta_kv_vload(rows[j + u], 32 * z + 16, TA_F8E5M2);
                    r[u] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                }
            }
            _mm512_storeu_si512(row + (2 * z) * 1024, _mm512_unpacklo_epi16(r[0], r[1]));
            _mm512_storeu_si512(row + (2 * z + 1) * 1024, _mm512_unpackhi_epi16(r[0], r[1]));
        }
    }
}

/* The first channel of column group L (4 columns) of block cb after the in-lane unpacks. */
static inline int64_t dec_amx_channel(int64_t kd, int64_t cb, int L) {
    return kd == TA_I8 ? 64 * (cb / 4) + 16 * L + 4 * (cb % 4) : 32 * (cb / 2) + 8 * L + 4 * (cb % 2);
}

/* P digits of rows [0, rb) of P (np per row, zero past n) as A tiles: key block b at b * 1024 bytes,
 * row 4t + r holding digit t of row r. int8: inv[r] = 1 / the row's fixed-point factor, bad[r] set
 * when the row is not finite. */
static void dec_amx_p_tiles(int64_t kd, const real *P, int64_t np, int rb, int64_t n, uint8_t *A, float *inv, int *bad) {
    const int64_t kb = dec_amx_kblock(kd), nk = ta_round_up(n > 0 ? n : 1, kb);
    memset(A, 0, (size_t)(nk / kb) * 1024);
    for (int r = 0; r < rb; r++) {
        const real *pr = P + r * np;
        float f = 1.0f;
        bad[r] = 0;
        if (kd == TA_I8) {
            float mx = 0;
            for (int64_t j = 0; j < n; j++) mx = fabsf(pr[j]) > mx || pr[j] != pr[j] ? fabsf(pr[j]) : mx;
            bad[r] = !isfinite(mx);
            f = dec_fixed_factor(mx);
        }
        inv[r] = 1.0f / f;
        for (int64_t j = 0; j < n; j += 16) {
            __mmask16 live = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            __m512 p = _mm512_maskz_loadu_ps(live, pr + j);
            uint8_t *blk = A + (j / kb) * 1024;
            if (kd == TA_I8) {
                __m128i d[4];
                dec_int8_digits(_mm512_cvtps_epi32(_mm512_mul_ps(p, _mm512_set1_ps(f))), d);
                for (int t = 0; t < 4; t++) _mm_storeu_si128((__m128i *)(blk + (4 * t + r) * 64 + j % 64), d[t]);
            } else {
                __m256i d[3];
                dec_bf16_digits(p, d);
                for (int t = 0; t < 3; t++) _mm256_storeu_si256((__m256i *)(blk + (4 * t + r) * 64 + (j % 32) * 2), d[t]);
            }
        }
    }
}

/* acc (M x Dvp) = P.V for rows [0, M) with weights P (np per row, zero past n) and the packed V.
 * Up to four 16-column blocks accumulate at once (tiles 4-7), so their chains overlap; tile 0
 * holds the P digits of a key block, tiles 1-3 the V tiles. */
static void dec_amx_pv(int64_t kd, real *acc, int64_t Dvp, int64_t Dv, const real *P, int64_t np, int64_t M, int64_t n,
                       const uint8_t *Vp, char *mem) {
    const int64_t kb = dec_amx_kblock(kd), nblk = ta_round_up(n > 0 ? n : 1, kb) / kb, ncb = Dv / 16;
    int32_t *C = (int32_t *)mem;
    uint8_t *A = (uint8_t *)mem + 4096;
    for (int64_t r0 = 0; r0 < M; r0 += DEC_AMX_RB) {
        const int rb = M - r0 < DEC_AMX_RB ? (int)(M - r0) : DEC_AMX_RB;
        float inv[DEC_AMX_RB];
        int bad[DEC_AMX_RB];
        dec_amx_p_tiles(kd, P + r0 * np, np, rb, n, A, inv, bad);
        for (int64_t cb0 = 0; cb0 < ncb; cb0 += 4) {
            const int cn = ncb - cb0 < 4 ? (int)(ncb - cb0) : 4;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int64_t b = 0; b < nblk; b++) {
                const uint8_t *v = Vp + (b * ncb + cb0) * 1024;
                _tile_loadd(0, A + b * 1024, 64);
                _tile_loadd(1, v, 64);
                DEC_AMX_DP(4, 0, 1);
                if (cn > 1) {
                    _tile_loadd(2, v + 1024, 64);
                    DEC_AMX_DP(5, 0, 2);
                }
                if (cn > 2) {
                    _tile_loadd(3, v + 2048, 64);
                    DEC_AMX_DP(6, 0, 3);
                }
                if (cn > 3) {
                    _tile_loadd(1, v + 3072, 64);
                    DEC_AMX_DP(7, 0, 1);
                }
            }
            _tile_stored(4, C, 64);
            _tile_stored(5, C + 256, 64);
            _tile_stored(6, C + 512, 64);
            _tile_stored(7, C + 768, 64);
            for (int c = 0; c < cn; c++) {
                const int32_t *Cc = C + 256 * c;
                const int64_t cb = cb0 + c;
                for (int r = 0; r < rb; r++) {
                    __m512 x;
                    if (kd == TA_I8) {
                        x = _mm512_cvtepi32_ps(_mm512_loadu_si512(Cc + (12 + r) * 16));
                        for (int t = 2; t >= 0; t--)
                            x = _mm512_fmadd_ps(x, _mm512_set1_ps(256.0f),
                                                _mm512_cvtepi32_ps(_mm512_loadu_si512(Cc + (4 * t + r) * 16)));
                        x = bad[r] ? _mm512_set1_ps(NAN) : _mm512_mul_ps(x, _mm512_set1_ps(inv[r]));
                    } else {
                        const float *cf = (const float *)Cc;
                        x = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(cf + r * 16), _mm512_loadu_ps(cf + (4 + r) * 16)),
                                          _mm512_loadu_ps(cf + (8 + r) * 16));
                    }
                    real *ar = acc + (r0 + r) * Dvp;
                    _mm_storeu_ps(ar + dec_amx_channel(kd, cb, 0), _mm512_castps512_ps128(x));
                    _mm_storeu_ps(ar + dec_amx_channel(kd, cb, 1), _mm512_extractf32x4_ps(x, 1));
                    _mm_storeu_ps(ar + dec_amx_channel(kd, cb, 2), _mm512_extractf32x4_ps(x, 2));
                    _mm_storeu_ps(ar + dec_amx_channel(kd, cb, 3), _mm512_extractf32x4_ps(x, 3));
                }
            }
        }
    }
}

#endif
#endif
