/* The AArch64 path of the block products: every type's dot of a group of weight rows with
 * up to ROWS activation rows (quants.h's dot_group and dot_group_k), on NEON with the
 * ARMv8.2 dot product (SDOT: vdotq_laneq_s32), and where the target has FEAT_I8MM the int8
 * matrix multiply (SMMLA: vmmlaq_s32) for pairs of activation rows. Included at the end of
 * quants.h where the target has the dot product (NEON_DOT); blocks.c's dot_any_group then
 * calls neon_dot_group and neon_dot_group_k. docs/KERNELS.md says which -march builds it.
 *
 * The arithmetic is the plain-C path's, step for step: each row's integer sums of a block
 * (or super-block) are exact, the same integers in whatever order they are added; then the
 * floating-point steps are the plain C's, in its order, lane by lane, with no fused
 * multiply-add (-ffp-contract=off keeps the compiler from fusing the intrinsics), so every
 * output has the plain-C path's bits whatever its batch or thread count.
 * tests/native/test_aarch64.py checks that under emulation.
 *
 * A group vector of quants.h's layouts (lane n: 4 bytes of weight row n) is two 128-bit
 * registers here, each a quad of 4 rows; the products run quad by quad within a block.
 * SDOT multiplies the 4 weights in each lane of a quad by 4 activations that it takes
 * from one lane of a register of 16, the way the AVX2 path broadcasts them. SMMLA takes a
 * 2 x 8 block of two activation rows times 8 weights of two weight rows: a quad's words are
 * zipped into those row pairs once a block (neon_pairs) and serve every pair of activation
 * rows, twice the multiply-adds of SDOT an instruction; a lone row keeps to SDOT.
 */
#ifndef SLOTSERVE_QUANTS_NEON_H
#define SLOTSERVE_QUANTS_NEON_H

#include <arm_neon.h>

#if defined(__ARM_FEATURE_MATMUL_INT8)
#define NEON_I8MM 1
#else
#define NEON_I8MM 0
#endif

/* ---- loads ------------------------------------------------------------------------------ */

/* Lanes 4q .. 4q + 3 of the group vector of t rows at p (4 bytes a lane); lanes at or past
 * t are zero and never read beyond the vector. */
INLINE int8x16_t quad_at(const uint8_t *p, int t, int q) {
    if (t >= 4 * q + 4) return vld1q_s8((const int8_t *)p + 16 * q);
    int8_t lanes[16] = {0};
    memcpy(lanes, p + 16 * q, (size_t)(4 * (t - 4 * q)));
    return vld1q_s8(lanes);
}

/* Lanes 4q .. 4q + 3 of t fp16 at p (one a row), as fp32: exact, as half_at. */
INLINE float32x4_t quad_halves(const uint8_t *p, int t, int q) {
    uint16_t halves[4] = {0};
    memcpy(halves, p + 8 * q, (size_t)(2 * (t >= 4 * q + 4 ? 4 : t - 4 * q)));
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(halves)));
}

/* Two quads' words side by side for SMMLA: for chunk k (words 2k and 2k + 1 of u, 8
 * weights), pair[k][0] holds rows 0 and 1 of the quad (8 bytes each), pair[k][1] rows 2
 * and 3; `chunks` of them. */
INLINE void neon_pairs(const int8x16_t *u, int chunks, int8x16_t pair[][2]) {
    for (int k = 0; k < chunks; k++) {
        const int32x4_t first = vreinterpretq_s32_s8(u[2 * k]), second = vreinterpretq_s32_s8(u[2 * k + 1]);
        pair[k][0] = vreinterpretq_s8_s32(vzip1q_s32(first, second));
        pair[k][1] = vreinterpretq_s8_s32(vzip2q_s32(first, second));
    }
}

/* Bytes `from` .. of activation rows v0 and v1 in SMMLA's 2 x 8 operands: chunk k is
 * bytes from + 8k .. of v0, then of v1 (`chunks` even). */
INLINE void neon_act_pairs(const int8_t *v0, const int8_t *v1, int chunks, int8x16_t act[]) {
    for (int k = 0; k < chunks; k += 2) {
        const int64x2_t first = vreinterpretq_s64_s8(vld1q_s8(v0 + 8 * k));
        const int64x2_t second = vreinterpretq_s64_s8(vld1q_s8(v1 + 8 * k));
        act[k] = vreinterpretq_s8_s64(vzip1q_s64(first, second));
        act[k + 1] = vreinterpretq_s8_s64(vzip2q_s64(first, second));
    }
}

#if NEON_I8MM
/* Σ_k act[k] . pair[k] by SMMLA: the sums of two activation rows against a quad's 4
 * rows, row 0's into *s0 and row 1's into *s1 (lane n: weight row n). */
INLINE void neon_pair_dot(const int8x16_t *act, const int8x16_t pair[][2], int chunks,
                          int32x4_t *s0, int32x4_t *s1) {
    /* p[j] = [v0 . w_2j, v0 . w_2j+1, v1 . w_2j, v1 . w_2j+1] */
    int32x4_t p[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int k = 0; k < chunks; k++)
        for (int j = 0; j < 2; j++) p[j] = vmmlaq_s32(p[j], act[k], pair[k][j]);
    const int64x2_t low = vreinterpretq_s64_s32(p[0]), high = vreinterpretq_s64_s32(p[1]);
    *s0 = vreinterpretq_s32_s64(vzip1q_s64(low, high));
    *s1 = vreinterpretq_s32_s64(vzip2q_s64(low, high));
}
#endif

/* Σ_c u[c] . word c of the 8 words at v (32 activations), lane by lane: 8 SDOTs. */
INLINE int32x4_t neon_dot32(const int8x16_t u[8], const int8_t *v) {
    const int8x16_t low = vld1q_s8(v), high = vld1q_s8(v + 16);
    int32x4_t first = vdotq_laneq_s32(vdupq_n_s32(0), u[0], low, 0);
    int32x4_t second = vdotq_laneq_s32(vdupq_n_s32(0), u[4], high, 0);
    first = vdotq_laneq_s32(first, u[1], low, 1), second = vdotq_laneq_s32(second, u[5], high, 1);
    first = vdotq_laneq_s32(first, u[2], low, 2), second = vdotq_laneq_s32(second, u[6], high, 2);
    first = vdotq_laneq_s32(first, u[3], low, 3), second = vdotq_laneq_s32(second, u[7], high, 3);
    return vaddq_s32(first, second);
}

/* Σ_c u[c] . word c of the 4 words at v (16 activations): 4 SDOTs. */
INLINE int32x4_t neon_dot16(const int8x16_t u[4], const int8_t *v) {
    const int8x16_t words = vld1q_s8(v);
    int32x4_t first = vdotq_laneq_s32(vdupq_n_s32(0), u[0], words, 0);
    int32x4_t second = vdotq_laneq_s32(vdupq_n_s32(0), u[1], words, 1);
    first = vdotq_laneq_s32(first, u[2], words, 2), second = vdotq_laneq_s32(second, u[3], words, 3);
    return vaddq_s32(first, second);
}

/* Byte `byte` (0..3) of each 32-bit lane as an int32: unsigned, or (`sign`) signed. */
INLINE int32x4_t lane_byte_of(uint8x16_t words, int byte, int sign) {
    const int32x4_t w = vreinterpretq_s32_u8(words);
    if (sign) return vshlq_s32(vshlq_s32(w, vdupq_n_s32(24 - 8 * byte)), vdupq_n_s32(-24));
    return vandq_s32(vshlq_s32(w, vdupq_n_s32(-8 * byte)), vdupq_n_s32(0xFF));
}

/* ---- Q4_1, Q8_0, Q5_0 and Q5_1 ------------------------------------------------------------ */

/* 0x10 in each byte of a quad's 16 whose bit is set in `bits` (bit j: byte j). */
INLINE int8x16_t fifth_bytes(uint32_t bits) {
    const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    return vreinterpretq_s8_u8(vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(0x10)));
}

/* Quad q's weights of a group block of t rows, u[c] its rows' word c (weights 4c .. 4c + 3
 * of the block, as integers: the nibble with its fifth bit, or the int8). */
INLINE void quad_weights(int kind, const uint8_t *block, int t, int q, int8x16_t u[8]) {
    if (kind == KIND_Q8_0) {
        for (int c = 0; c < 8; c++) u[c] = quad_at(block + c * 4 * t, t, q);
        return;
    }
    const int8x16_t low4 = vdupq_n_s8(0x0F);
    for (int c = 0; c < 4; c++) { /* nibble vector c: weights 4c .. (low), 16 + 4c .. (high) */
        const int8x16_t packed = quad_at(block + c * 4 * t, t, q);
        u[c] = vandq_s8(packed, low4);
        u[4 + c] = vreinterpretq_s8_u8(vshrq_n_u8(vreinterpretq_u8_s8(packed), 4));
        if (has_fifth(kind)) {
            u[c] = vorrq_s8(u[c], fifth_bytes(fifth_mask(block + 16 * t, t, 2 * c) >> (16 * q)));
            u[4 + c] = vorrq_s8(u[4 + c], fifth_bytes(fifth_mask(block + 16 * t, t, 2 * c + 1) >> (16 * q)));
        }
    }
}

/* A block's share of a row's output in each lane, from its integer sums: the plain-C
 * path's steps (dot_group_rows), in its order. */
INLINE float32x4_t block_share(int kind, int32x4_t sums, float32x4_t dw, float32x4_t mw, float da,
                               float sa) {
    const float32x4_t scaled = vmulq_n_f32(vcvtq_f32_s32(sums), da); /* da * (float)sum */
    if (kind == KIND_Q5_0) return vmulq_f32(dw, vsubq_f32(scaled, vdupq_n_f32(16.0f * sa)));
    if (kind == KIND_Q8_0) return vmulq_f32(dw, scaled);
    return vaddq_f32(vmulq_f32(dw, scaled), vmulq_n_f32(mw, sa)); /* Q4_1, Q5_1 */
}

/* out[r][n] = activation row (i + r) . row n of a group of t rows at `w`, r < rows, n < t,
 * for a 32-value type `kind` (quants.h's dot_group). */
INLINE void neon_dot_group(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                           float out[][GROUP]) {
    const int64_t nb = a->k / BLOCK, size = block_bytes(kind) * t, at = scales_at(kind, t);
    const int quads = (t + 3) / 4, mins = kind == KIND_Q4_1 || kind == KIND_Q5_1;
    float32x4_t acc[2][ROWS];
    for (int q = 0; q < 2; q++)
        for (int r = 0; r < rows; r++) acc[q][r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size;
        for (int q = 0; q < quads; q++) {
            int8x16_t u[8];
            quad_weights(kind, block, t, q, u);
            const float32x4_t dw = quad_halves(block + at, t, q);
            const float32x4_t mw = mins ? quad_halves(block + at + 2 * t, t, q) : dw;
            int32x4_t sums[ROWS];
            int r = 0;
#if NEON_I8MM
            int8x16_t pair[4][2];
            if (rows >= 2) neon_pairs(u, 4, pair);
            for (; r + 1 < rows; r += 2) {
                int8x16_t act[4];
                neon_act_pairs(a->q + act_word(i, rows, r, b, nb, BLOCK, 0),
                               a->q + act_word(i, rows, r + 1, b, nb, BLOCK, 0), 4, act);
                neon_pair_dot(act, pair, 4, &sums[r], &sums[r + 1]);
            }
#endif
            for (; r < rows; r++) sums[r] = neon_dot32(u, a->q + act_word(i, rows, r, b, nb, BLOCK, 0));
            for (r = 0; r < rows; r++) {
                const int64_t scale = act_scale(i, rows, r, b, nb);
                acc[q][r] = vaddq_f32(acc[q][r], block_share(kind, sums[r], dw, mw, a->d[scale], a->s[scale]));
            }
        }
    }
    for (int q = 0; q < quads; q++)
        for (int r = 0; r < rows; r++) vst1q_f32(out[r] + 4 * q, acc[q][r]);
}

/* ---- K-quants --------------------------------------------------------------------------- */

/* A Q4_K or Q5_K super-block's integer sums for quad q of its group block (quants.h's
 * layout: scales [3][t][4], d [t], dmin [t], Q5_K's qh [8][t][4], nibbles [32][t][4]),
 * against activation rows i .. i + rows - 1 of super-block b: sums[r] = Σ_j sc_j Σ u q and
 * mins[r] = Σ_j m_j (bsums_2j + bsums_2j+1), lane by lane (k_super_dot's integers). */
INLINE void q45_k_sums(int kind, const uint8_t *block, int t, int q, const acts *a, int64_t i,
                       int rows, int64_t b, int32x4_t sums[], int32x4_t mins[]) {
    const int64_t nb = a->k / SUPER;
    const int fifth = kind == KIND_Q5_K;
    const uint8_t *qh = block + 16 * t, *qs = block + (fifth ? 48 : 16) * t;
    /* k_scales in each lane: scales 0-3 and 4-7, mins 0-3 and 4-7, one a byte */
    const uint8x16_t u0 = vreinterpretq_u8_s8(quad_at(block, t, q));
    const uint8x16_t u1 = vreinterpretq_u8_s8(quad_at(block + 4 * t, t, q));
    const uint8x16_t u2 = vreinterpretq_u8_s8(quad_at(block + 8 * t, t, q));
    const uint8x16_t low6 = vdupq_n_u8(0x3F), low4 = vdupq_n_u8(0x0F);
    const uint8x16_t scales[2] = {vandq_u8(u0, low6), vorrq_u8(vandq_u8(u2, low4), vshlq_n_u8(vshrq_n_u8(u0, 6), 4))};
    const uint8x16_t min_bytes[2] = {vandq_u8(u1, low6), vorrq_u8(vshrq_n_u8(u2, 4), vshlq_n_u8(vshrq_n_u8(u1, 6), 4))};
    for (int r = 0; r < rows; r++) {
        const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
        mins[r] = vdupq_n_s32(0);
        for (int j = 0; j < 8; j++)
            mins[r] = vmlaq_n_s32(mins[r], lane_byte_of(min_bytes[j / 4], j % 4, 0), bsums[2 * j] + bsums[2 * j + 1]);
        sums[r] = vdupq_n_s32(0);
    }
#if NEON_I8MM
    /* for a pair of activation rows r, r + 1: paired[r + p] = [r . w_2p, r . w_2p+1,
     * r+1 . w_2p, r+1 . w_2p+1] over weight rows 2p, 2p + 1 of the quad (SMMLA's order) */
    int32x4_t paired[ROWS];
    for (int r = 0; r < rows; r++) paired[r] = vdupq_n_s32(0);
#endif
    for (int j = 0; j < 4; j++) { /* sub-blocks 2j (low nibbles) and 2j + 1 (high) */
        int8x16_t lo[8], hi[8];
        for (int c = 0; c < 8; c++) {
            const uint8x16_t packed = vreinterpretq_u8_s8(quad_at(qs + (8 * j + c) * 4 * t, t, q));
            uint8x16_t low = vandq_u8(packed, low4), high = vshrq_n_u8(packed, 4);
            if (fifth) { /* bit 2j of qh moves to bit 4 of the low nibble, 2j + 1 of the high */
                const uint8x16_t bits = vreinterpretq_u8_s8(quad_at(qh + c * 4 * t, t, q)), top = vdupq_n_u8(0x10);
                low = vorrq_u8(low, vandq_u8(vshlq_u8(bits, vdupq_n_s8((int8_t)(4 - 2 * j))), top));
                high = vorrq_u8(high, vandq_u8(vshlq_u8(bits, vdupq_n_s8((int8_t)(3 - 2 * j))), top));
            }
            lo[c] = vreinterpretq_s8_u8(low), hi[c] = vreinterpretq_s8_u8(high);
        }
        const int32x4_t scale_lo = lane_byte_of(scales[j / 2], (2 * j) % 4, 0);
        const int32x4_t scale_hi = lane_byte_of(scales[j / 2], (2 * j + 1) % 4, 0);
        int r = 0;
#if NEON_I8MM
        if (rows >= 2) {
            int8x16_t pair_lo[4][2], pair_hi[4][2];
            neon_pairs(lo, 4, pair_lo), neon_pairs(hi, 4, pair_hi);
            const int64x2_t slo = vreinterpretq_s64_s32(scale_lo), shi = vreinterpretq_s64_s32(scale_hi);
            /* each weight pair's two scales, twice: [s_2p, s_2p+1, s_2p, s_2p+1] */
            const int32x4_t pscale_lo[2] = {vreinterpretq_s32_s64(vzip1q_s64(slo, slo)), vreinterpretq_s32_s64(vzip2q_s64(slo, slo))};
            const int32x4_t pscale_hi[2] = {vreinterpretq_s32_s64(vzip1q_s64(shi, shi)), vreinterpretq_s32_s64(vzip2q_s64(shi, shi))};
            for (; r + 1 < rows; r += 2) {
                const int8_t *v0 = a->q + act_word(i, rows, r, b, nb, SUPER, 16 * j);
                const int8_t *v1 = a->q + act_word(i, rows, r + 1, b, nb, SUPER, 16 * j);
                int8x16_t act_lo[4], act_hi[4];
                neon_act_pairs(v0, v1, 4, act_lo), neon_act_pairs(v0 + 32, v1 + 32, 4, act_hi);
                for (int p = 0; p < 2; p++) {
                    int32x4_t dot_lo = vdupq_n_s32(0), dot_hi = vdupq_n_s32(0);
                    for (int k = 0; k < 4; k++) {
                        dot_lo = vmmlaq_s32(dot_lo, act_lo[k], pair_lo[k][p]);
                        dot_hi = vmmlaq_s32(dot_hi, act_hi[k], pair_hi[k][p]);
                    }
                    paired[r + p] = vmlaq_s32(vmlaq_s32(paired[r + p], dot_lo, pscale_lo[p]), dot_hi, pscale_hi[p]);
                }
            }
        }
#endif
        for (; r < rows; r++) {
            const int8_t *v = a->q + act_word(i, rows, r, b, nb, SUPER, 16 * j);
            sums[r] = vmlaq_s32(sums[r], neon_dot32(lo, v), scale_lo);
            sums[r] = vmlaq_s32(sums[r], neon_dot32(hi, v + 32), scale_hi);
        }
    }
#if NEON_I8MM
    for (int r = 0; r + 1 < rows; r += 2) { /* the pairs' lanes back to rows */
        const int64x2_t low = vreinterpretq_s64_s32(paired[r]), high = vreinterpretq_s64_s32(paired[r + 1]);
        sums[r] = vreinterpretq_s32_s64(vzip1q_s64(low, high));
        sums[r + 1] = vreinterpretq_s32_s64(vzip2q_s64(low, high));
    }
#endif
}

/* A Q6_K super-block's integer sums for quad q of its group block (scales [4][t][4]; per 64
 * weights ql [4][t][4] twice and qh [4][t][4]; d [t]) against rows i .. i + rows - 1:
 * sums[r] = Σ_j sc_j Σ u q - 32 Σ_j sc_j bsums_j, lane by lane (k_super_dot's integer). */
INLINE void q6_k_sums(const uint8_t *block, int t, int q, const acts *a, int64_t i, int rows,
                      int64_t b, int32x4_t sums[]) {
    const int64_t nb = a->k / SUPER;
    uint8x16_t scales[4];
    for (int c = 0; c < 4; c++) scales[c] = vreinterpretq_u8_s8(quad_at(block + c * 4 * t, t, q));
    for (int r = 0; r < rows; r++) { /* -32 Σ_j sc_j bsums_j: the weights' offset of 32 */
        const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
        int32x4_t offset = vdupq_n_s32(0);
        for (int j = 0; j < 16; j++) offset = vmlaq_n_s32(offset, lane_byte_of(scales[j / 4], j % 4, 1), bsums[j]);
        sums[r] = vnegq_s32(vshlq_n_s32(offset, 5));
    }
#if NEON_I8MM
    int32x4_t paired[ROWS]; /* as q45_k_sums' */
    for (int r = 0; r < rows; r++) paired[r] = vdupq_n_s32(0);
#endif
    const uint8x16_t low4 = vdupq_n_u8(0x0F), bits2 = vdupq_n_u8(0x30);
    for (int h = 0; h < 2; h++)
        for (int half = 0; half < 2; half++) { /* weights 128h + 32g + 16 half + e: sub-block 8h + 2g + half */
            /* bytes 16 half .. + 15 of ql[64h ..], ql[64h + 32 ..] and qh[32h ..] */
            const uint8_t *weights = block + (16 + 48 * (2 * h + half)) * t;
            int8x16_t u[4][4];
            for (int c = 0; c < 4; c++) {
                const uint8x16_t l0 = vreinterpretq_u8_s8(quad_at(weights + c * 4 * t, t, q));
                const uint8x16_t l1 = vreinterpretq_u8_s8(quad_at(weights + (16 + c * 4) * t, t, q));
                const uint8x16_t top = vreinterpretq_u8_s8(quad_at(weights + (32 + c * 4) * t, t, q));
                u[0][c] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l0, low4), vandq_u8(vshlq_n_u8(top, 4), bits2)));
                u[1][c] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l1, low4), vandq_u8(vshlq_n_u8(top, 2), bits2)));
                u[2][c] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(top, bits2)));
                u[3][c] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(vshrq_n_u8(top, 2), bits2)));
            }
            for (int g = 0; g < 4; g++) {
                const int sub = 8 * h + 2 * g + half;
                const int32x4_t scale = lane_byte_of(scales[sub / 4], sub % 4, 1);
                int r = 0;
#if NEON_I8MM
                if (rows >= 2) {
                    int8x16_t pair[2][2];
                    neon_pairs(u[g], 2, pair);
                    const int64x2_t s = vreinterpretq_s64_s32(scale);
                    const int32x4_t pscale[2] = {vreinterpretq_s32_s64(vzip1q_s64(s, s)), vreinterpretq_s32_s64(vzip2q_s64(s, s))};
                    for (; r + 1 < rows; r += 2) {
                        int8x16_t act[2];
                        neon_act_pairs(a->q + act_word(i, rows, r, b, nb, SUPER, 4 * sub),
                                       a->q + act_word(i, rows, r + 1, b, nb, SUPER, 4 * sub), 2, act);
                        for (int p = 0; p < 2; p++) {
                            int32x4_t dot = vmmlaq_s32(vdupq_n_s32(0), act[0], pair[0][p]);
                            dot = vmmlaq_s32(dot, act[1], pair[1][p]);
                            paired[r + p] = vmlaq_s32(paired[r + p], dot, pscale[p]);
                        }
                    }
                }
#endif
                for (; r < rows; r++) {
                    const int8_t *v = a->q + act_word(i, rows, r, b, nb, SUPER, 4 * sub);
                    sums[r] = vmlaq_s32(sums[r], neon_dot16(u[g], v), scale);
                }
            }
        }
#if NEON_I8MM
    for (int r = 0; r + 1 < rows; r += 2) {
        const int64x2_t low = vreinterpretq_s64_s32(paired[r]), high = vreinterpretq_s64_s32(paired[r + 1]);
        sums[r] = vaddq_s32(sums[r], vreinterpretq_s32_s64(vzip1q_s64(low, high)));
        sums[r + 1] = vaddq_s32(sums[r + 1], vreinterpretq_s32_s64(vzip2q_s64(low, high)));
    }
#endif
}

/* out[r][n] as neon_dot_group, for a K-quant `kind` (quants.h's dot_group_k): per
 * super-block the integer sums, then k_super_dot's floating-point steps in its order. */
INLINE void neon_dot_group_k(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                             float out[][GROUP]) {
    const int64_t nb = a->k / SUPER, size = weight_row_bytes(kind, SUPER) * t;
    const int quads = (t + 3) / 4;
    float32x4_t acc[2][ROWS];
    for (int q = 0; q < 2; q++)
        for (int r = 0; r < rows; r++) acc[q][r] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size;
        for (int q = 0; q < quads; q++) {
            int32x4_t sums[ROWS], mins[ROWS];
            if (kind == KIND_Q6_K) {
                q6_k_sums(block, t, q, a, i, rows, b, sums);
                const float32x4_t d = quad_halves(block + 208 * t, t, q);
                for (int r = 0; r < rows; r++) { /* d da (float)(sum - 32 offset) */
                    const float32x4_t scale = vmulq_n_f32(d, a->d[(i + r) * nb + b]);
                    acc[q][r] = vaddq_f32(acc[q][r], vmulq_f32(scale, vcvtq_f32_s32(sums[r])));
                }
            } else {
                q45_k_sums(kind, block, t, q, a, i, rows, b, sums, mins);
                const float32x4_t d = quad_halves(block + 12 * t, t, q), dmin = quad_halves(block + 14 * t, t, q);
                for (int r = 0; r < rows; r++) { /* d da (float)sum - dmin da (float)mins */
                    const float da = a->d[(i + r) * nb + b];
                    const float32x4_t scaled = vmulq_f32(vmulq_n_f32(d, da), vcvtq_f32_s32(sums[r]));
                    const float32x4_t offset = vmulq_f32(vmulq_n_f32(dmin, da), vcvtq_f32_s32(mins[r]));
                    acc[q][r] = vaddq_f32(acc[q][r], vsubq_f32(scaled, offset));
                }
            }
        }
    }
    for (int q = 0; q < quads; q++)
        for (int r = 0; r < rows; r++) vst1q_f32(out[r] + 4 * q, acc[q][r]);
}

#endif
