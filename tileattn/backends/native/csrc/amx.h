/* AMX bf16 tiles (Intel Sapphire Rapids and later): the GEMMs of bf16 attention on the matrix unit.
 *
 * One AMX instruction, tdpbf16ps, multiplies a 16 x 32 bf16 tile by a 32 x 16 one (the second
 * stored as 16 rows of k pairs) into a 16 x 16 fp32 tile: 8192 multiply-adds. Measured here:
 * 3.2 TFLOP/s on one core in a register loop, against 0.23 for fp32 FMAs and 0.12 for vdpbf16ps;
 * PyTorch's SDPA uses it for bf16 through oneDNN. The kernels use it in the same transposed
 * layout as everywhere else:
 *
 *     C[p][r][0:32] (+)= sum_k A[r][k] B[p][k/2][0:32][k%2]
 *
 * A: bf16 rows of k values, 64-byte rows padded to a multiple of 32 values (K rows for the scores,
 * V^T for P.V: both copied into a padded tile, which also makes any stride, paging and odd length
 * look alike); B: bf16 pairs panels (Q^T or P, the layouts of the vdpbf16ps path); C: fp32 panels
 * of PW = 32 lanes, 128 bytes per row. A 32 x 32 block of C lives in tiles 0-3, the two A tiles of
 * a k step in 4-5, the two B tiles in 6-7.
 *
 * Linux grants a process the AMX register state on request (arch_prctl ARCH_REQ_XCOMP_PERM);
 * ta_amx_available() asks once. The tile configuration is per thread and other libraries (oneDNN)
 * load their own on the same threads, so every task loads ours and releases the tiles at its end.
 */
#ifndef TA_AMX_H
#define TA_AMX_H

#if defined(TA_ISA_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__) && TA_REAL_BITS == 32
#define TA_HAVE_AMX 1

#include "tile.h"

/* 1 when this process may use AMX (asks the kernel once), else 0. Defined in api.c. */
int ta_amx_available(void);

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ta_tilecfg;

/* Eight 16 x 64-byte tiles. */
static inline void ta_amx_begin(void) {
    ta_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline void ta_amx_end(void) { _tile_release(); }

/* C (npan panels, M rows; M a multiple of 16) = or += A (M x K, lda values per row) B (K/2 pair rows
 * per panel, b_ps values between panels); K a multiple of 32; c_ps floats between C panels. */
static void ta_amx_gemm(int64_t M, int64_t npan, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B,
                        int64_t b_ps, float *C, int64_t c_ps, int accumulate) {
    const int64_t ab = lda * 2, bb = PW * 4, cb = PW * 4; /* row strides in bytes */
    for (int64_t p = 0; p < npan; p++) {
        const uint16_t *Bp = B + p * b_ps;
        for (int64_t r0 = 0; r0 < M; r0 += 32) {
            float *c0 = C + p * c_ps + r0 * PW, *c1 = c0 + 16 * PW;
            const uint16_t *a0 = A + r0 * lda, *a1 = a0 + 16 * lda;
            const int two = r0 + 16 < M;
            if (accumulate) {
                _tile_loadd(0, c0, cb);
                _tile_loadd(1, c0 + 16, cb);
                if (two) {
                    _tile_loadd(2, c1, cb);
                    _tile_loadd(3, c1 + 16, cb);
                }
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                _tile_loadd(6, Bp + k0 * PW, bb);
                _tile_loadd(7, Bp + k0 * PW + 32, bb);
                _tile_loadd(4, a0 + k0, ab);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, a1 + k0, ab);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c0, cb);
            _tile_stored(1, c0 + 16, cb);
            if (two) {
                _tile_stored(2, c1, cb);
                _tile_stored(3, c1 + 16, cb);
            }
        }
    }
}

/* Keys [j0, j0 + n) of kv head hk of k as AMX A rows: n_pad x d_pad bf16, zero padded. */
static void ta_amx_pack_rows(uint16_t *dst, const ta_args *a, const ta_seq *s, const void *base, const int64_t st[3],
                             int64_t seq_off, int64_t hk, int64_t j0, int64_t n, int64_t width, int64_t n_pad,
                             int64_t w_pad) {
    for (int64_t j = 0; j < n_pad; j++) {
        uint16_t *d = dst + j * w_pad;
        if (j < n) {
            memcpy(d, (const uint16_t *)base + ta_key_off(a, s, st, seq_off, hk, j0 + j), (size_t)width * 2);
            memset(d + width, 0, (size_t)(w_pad - width) * 2);
        } else {
            memset(d, 0, (size_t)w_pad * 2);
        }
    }
}

/* 16 x 16 transpose of 32-bit elements: rows r[0..15] -> columns. */
static inline void ta_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* V^T of keys [j0, j0 + n) in key pairs, the A operand of acc^T += V^T P: w_pad rows (channels) of
 * ldt keys, row c holding (V[2kp][c], V[2kp+1][c]) as 32-bit words; zero padded. Two key rows are
 * interleaved into 32-bit words (pair kp, all channels), then 16 x 16 blocks of words are transposed. */
static void ta_amx_pack_vt(uint16_t *dst, int64_t ldt, const ta_args *a, const ta_seq *s, const void *base,
                           const int64_t st[3], int64_t seq_off, int64_t hk, int64_t j0, int64_t n, int64_t width,
                           int64_t w_pad) {
    uint32_t *d32 = (uint32_t *)dst;
    const int64_t ld32 = ldt / 2;
    memset(dst, 0, (size_t)(w_pad * ldt) * 2);
    for (int64_t kp0 = 0; kp0 < (n + 1) / 2; kp0 += 16) {
        const uint16_t *row[32];
        for (int i = 0; i < 32; i++)
            row[i] = kp0 * 2 + i < n ? (const uint16_t *)base + ta_key_off(a, s, st, seq_off, hk, j0 + kp0 * 2 + i)
                                     : NULL;
        int64_t kn = ld32 - kp0 < 16 ? ld32 - kp0 : 16;
        __mmask16 keep = (__mmask16)((1u << kn) - 1);
        for (int64_t c0 = 0; c0 < width; c0 += 16) {
            int64_t cn = width - c0 < 16 ? width - c0 : 16;
            __mmask16 cols = (__mmask16)((1u << cn) - 1);
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                __m256i lo = row[2 * i] ? _mm256_maskz_loadu_epi16(cols, row[2 * i] + c0) : _mm256_setzero_si256();
                __m256i hi = row[2 * i + 1] ? _mm256_maskz_loadu_epi16(cols, row[2 * i + 1] + c0) : _mm256_setzero_si256();
                r[i] = _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
            }
            ta_transpose16(r);
            for (int i = 0; i < cn; i++) _mm512_mask_storeu_epi32(d32 + (c0 + i) * ld32 + kp0, keep, r[i]);
        }
    }
}

/* The lanes of R from a q-like bf16 tensor (q, dout) as lane pairs in panels of channels,
 * T[c/PW][r/2][c%PW][r%2], the B operand of dK += dS^T Q and dV += Z^T dO (zero padded lanes). */
static void ta_amx_pack_lane_pairs(uint16_t *dst, const void *base, const int64_t st[3], int64_t seq_off,
                                   const ta_rows *R, int64_t width) {
    const int64_t lanes = R->npan * PW, wpan = (width + PW - 1) / PW;
    memset(dst, 0, (size_t)(wpan * lanes * PW) * 2);
    for (int64_t r = 0; r < R->M; r++) {
        const uint16_t *src = (const uint16_t *)base + seq_off + R->head[r] * st[1] + R->row[r] * st[2];
        uint16_t *d = dst + (r / 2) * PW * 2 + r % 2;
        for (int64_t c = 0; c < width; c++) d[(c / PW) * lanes * PW + (c % PW) * 2] = src[c];
    }
}

/* fp32 panels (npan x [keys][PW], panel stride tp) to bf16 rows [np][npan * PW]: the A operand of
 * the GEMMs that sum over query lanes. Keys past n and lanes past M become zeros. */
static void ta_amx_rows_bf16(uint16_t *dst, const float *src, int64_t tp, int64_t npan, int64_t n, int64_t np,
                             int64_t M) {
    const int64_t lanes = npan * PW;
    memset(dst + n * lanes, 0, (size_t)((np - n) * lanes) * 2);
    for (int64_t p = 0; p < npan; p++)
        for (int h = 0; h < PW; h += 16) {
            int64_t live = M - p * PW - h;
            __mmask16 keep = live >= 16 ? (__mmask16)0xffff : live <= 0 ? 0 : (__mmask16)((1u << live) - 1);
            for (int64_t j = 0; j < n; j++) {
                __m256bh x = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, src + p * tp + j * PW + h));
                _mm256_storeu_si256((__m256i *)(dst + j * lanes + p * PW + h), (__m256i)x);
            }
        }
}

#endif
#endif
