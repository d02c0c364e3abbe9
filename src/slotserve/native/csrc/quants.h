/* The arithmetic of each GGUF weight type the block products take: how the activations
 * are quantised for it, and the dot products of one weight row (of a group of 8 rows, for
 * the types stored in groups) with up to ROWS activation rows.
 * Included by blocks.c (one translation unit), which runs the products and layers.
 *
 * Every type follows llama.cpp's arithmetic for it: the activations become int8 with one
 * scale per block, the block sums are exact integer dot products, and the scales apply
 * once per block (or super-block):
 *
 *   type    weights w                                     activations       per block
 *   Q4_1    dw * u + mw, u 0..15 (blocks of 32)            Q8 (d, s)         dw da Σuq + mw s
 *   Q8_0    dw * v, v int8                                 Q8 (d)            dw da Σvq
 *   Q5_0    dw * (u - 16), u 0..31                         Q8 (d, s)         dw da Σuq - 16 dw s
 *   Q5_1    dw * u + mw, u 0..31                           Q8 (d, s)         dw da Σuq + mw s
 *   Q4_K    d sc_j u - dmin m_j, u 0..15, 8 sub-blocks     Q8_K (d, bsums)   see dot_q4_k
 *           of 32 with 6-bit scales sc_j and mins m_j
 *   Q5_K    as Q4_K with u 0..31                           Q8_K
 *   Q6_K    d sc_j (u - 32), u 0..63, 16 sub-blocks of     Q8_K              see dot_q6_k
 *           16 with int8 scales sc_j
 *
 * Q8 activations: each run of 32 values is 32 int8 q with d = amax / 127 (rounded half to
 * even) and s = d Σq. Q8_K (llama.cpp's block_q8_K): each run of 256 values is 256 int8
 * q = min(127, round(x * -127 / max)), where max is the value of largest magnitude, with
 * d = max / -127 and bsums, the sums of each 16 q.
 *
 * Layouts. Q4_1, Q8_0, Q5_0 and Q5_1 matrices hold their rows in groups of GROUP = 8 (the
 * last group has the n % 8 rows left, if any; gguf_linear.pack), each group's blocks one
 * after another, and each block of a group of t rows interleaved so that lane n of a vector
 * is row n's:
 *
 *   Q4_1  nibbles [4][t][4] bytes, d [t] fp16, m [t] fp16                   20 t bytes
 *   Q5_0  nibbles [4][t][4], fifth bits (8 masks of 4 t bits), d [t]        22 t
 *   Q5_1  nibbles, fifth bits, d [t], m [t]                                  24 t
 *   Q8_0  int8 [8][t][4], d [t]                                              34 t
 *
 * Nibble vector c (0..3) holds in lane n bytes 4c..4c+3 of row n's 16 nibble bytes (as the
 * file has them: weight j in the low nibble of byte j, j + 16 in its high nibble), so its
 * low nibbles are weights 4c..4c+3 and its high nibbles 16+4c..16+4c+3. Fifth-bit mask
 * 2c + h (a bit stream of 8 masks, each 4 t bits) has bit 4n + i set where weight
 * 16h + 4c + i of row n has its fifth bit; Q8_0's vector c holds weights 4c..4c+3. So one
 * dot-product instruction multiplies four weights of each of 8 rows by the same four
 * activations (broadcast), and one fma scales a block of 8 rows, where rows one by one
 * needed a shuffle, a conversion and an fma per block and row (llama.cpp's repacked GEMMs
 * interleave rows the same way). A [3072 x 576] product on one thread of the 2-core AMD
 * EPYC, best of three alternating runs, rows one by one -> interleaved: Q5_0 78.4 -> 61.9
 * us at 1 row and 262.9 -> 178.0 us at 8 rows; Q8_0 67.4 -> 53.2 and 240.1 -> 164.3; Q4_1
 * 68.9 -> 49.5 and 244.4 -> 161.9. A matrix keeps the file's bytes, moved: rows x blocks x
 * block bytes. The K-quants keep the file's own blocks. Activations are quantised in
 * natural order.
 *
 * Each dot computes, for every row, the same operations in the same order whether it runs
 * with 1 or ROWS rows (the rows only share the weights' decoding; the lanes of a group never
 * mix): a row's result never depends on its batch.
 */
#ifndef SLOTSERVE_QUANTS_H
#define SLOTSERVE_QUANTS_H

#include "common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32
#define SUPER 256 /* a K-quant super-block */
/* Activation rows that share one decoding of the weights: 8 where AVX-512VL gives 32
 * vector registers (a group's accumulators and scales fit), 4 with AVX2's 16. */
#if defined(__AVX512VL__)
#define ROWS 8
#else
#define ROWS 4
#endif

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1, KIND_Q5_0 = 2, KIND_Q5_1 = 3, KIND_Q4_K = 4, KIND_Q5_K = 5, KIND_Q6_K = 6 };
enum { ACT_Q8 = 0, ACT_Q8_K = 2 };
#define GROUP 8 /* rows interleaved in the Q4_1, Q8_0, Q5_0 and Q5_1 layouts */

/* The activation format a weight type multiplies against (-1: not a type we take). */
INLINE int act_format(int64_t kind) {
    switch (kind) {
    case KIND_Q4_1: case KIND_Q8_0: case KIND_Q5_0: case KIND_Q5_1: return ACT_Q8;
    case KIND_Q4_K: case KIND_Q5_K: case KIND_Q6_K: return ACT_Q8_K;
    default: return -1;
    }
}

/* Bytes of one weight row of k values. */
INLINE int64_t weight_row_bytes(int64_t kind, int64_t k) {
    switch (kind) {
    case KIND_Q4_1: return k / BLOCK * 20;
    case KIND_Q8_0: return k / BLOCK * 34;
    case KIND_Q5_0: return k / BLOCK * 22;
    case KIND_Q5_1: return k / BLOCK * 24;
    case KIND_Q4_K: return k / SUPER * 144;
    case KIND_Q5_K: return k / SUPER * 176;
    default: return k / SUPER * 210; /* Q6_K */
    }
}

/* ---- activations -------------------------------------------------------------------- */

/* Quantised activation rows: q[row * q_stride ...] int8; d[row * d_stride + block] the
 * scales; s the Q8 blocks' d Σq; bsums[row * (k / 16) + j] the Q8_K sums of 16. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int16_t *bsums;
    int64_t k, q_stride, d_stride;
} acts;

/* 32 values times `by` as int8 (rounded to nearest even, at most 127) at `low` (values
 * 0..15) and `high` (16..31); the sums of each half go to sums[0], sums[1]. */
INLINE void quantize_block(const float *src, float by, int8_t *low, int8_t *high, int sums[2]) {
#if defined(__AVX2__)
    __m256i n[4];
    __m256 scale = _mm256_set1_ps(by);
    const __m256i top = _mm256_set1_epi32(127);
    for (int j = 0; j < 4; j++)
        n[j] = _mm256_min_epi32(top, _mm256_cvtps_epi32(_mm256_round_ps(
                   _mm256_mul_ps(_mm256_loadu_ps(src + 8 * j), scale),
                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    for (int h = 0; h < 2; h++) {
        __m256i sum = _mm256_add_epi32(n[2 * h], n[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        sums[h] = _mm_cvtsi128_si32(s4);
    }
    /* packs interleave the 128-bit lanes; the permute puts values 0..31 back in order */
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)low, _mm256_castsi256_si128(bytes));
    _mm_storeu_si128((__m128i *)high, _mm256_extracti128_si256(bytes, 1));
#else
    sums[0] = sums[1] = 0;
    for (int j = 0; j < 16; j++) {
        int a = (int)nearbyintf(src[j] * by), c = (int)nearbyintf(src[j + 16] * by);
        a = a > 127 ? 127 : a, c = c > 127 ? 127 : c;
        low[j] = (int8_t)a, high[j] = (int8_t)c;
        sums[0] += a, sums[1] += c;
    }
#endif
}

/* The largest |src[j]|. A compare, not fmaxf: without -ffinite-math-only GCC calls libm's
 * fmaxf for each value (NaN rules), which cost 1% of a decode step. */
INLINE float block_amax(const float *src, int n) {
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int j = 0; j < n; j++) {
        float v = fabsf(src[j]);
        amax = v > amax ? v : amax;
    }
    return amax;
}

/* Q8 blocks of x[m, k] (row stride ldx): q[m, k], d and s [m, k / 32]. */
static void quantize_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                        float *s, acts *out) {
    int64_t nb = k / BLOCK;
    for (int64_t i = 0; i < m; i++) {
        int8_t *row = q + i * k;
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + i * ldx + b * BLOCK;
            float scale = block_amax(src, BLOCK) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            int sums[2];
            quantize_block(src, inverse, row + b * BLOCK, row + b * BLOCK + 16, sums);
            d[i * nb + b] = scale;
            s[i * nb + b] = scale * (float)(sums[0] + sums[1]);
        }
    }
    *out = (acts){q, d, s, NULL, k, k, nb};
}

/* Q8_K super-blocks of x[m, k] (k a multiple of 256): q[m, k], d[m, k / 256], bsums[m, k / 16]. */
static void quantize_q8_k(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                          int16_t *bsums, acts *out) {
    int64_t nb = k / SUPER;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + i * ldx + b * SUPER;
            int8_t *dst = q + i * k + b * SUPER;
            int16_t *sums = bsums + i * (k / 16) + b * 16;
            float amax = block_amax(src, SUPER), max = 0.0f;
            for (int j = 0; j < SUPER; j++) /* the first value of that magnitude, with its sign */
                if (fabsf(src[j]) == amax) { max = src[j]; break; }
            if (amax == 0.0f) {
                memset(dst, 0, SUPER), memset(sums, 0, 16 * sizeof *sums);
                d[i * nb + b] = 0.0f;
                continue;
            }
            float by = -127.0f / max;
            for (int j = 0; j < SUPER / BLOCK; j++) {
                int half[2];
                quantize_block(src + j * BLOCK, by, dst + j * BLOCK, dst + j * BLOCK + 16, half);
                sums[2 * j] = (int16_t)half[0], sums[2 * j + 1] = (int16_t)half[1];
            }
            d[i * nb + b] = 1.0f / by;
        }
    }
    *out = (acts){q, d, NULL, bsums, k, k, nb};
}

/* ---- vector helpers ------------------------------------------------------------------- */

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
/* u may take all of 0..255: the products add up in int32 (maddubs' int16 pairs would
 * saturate), so a Q8_0 weight w is u = w + 128 with an offset -128 dw, as the others. */
#define Q8_0_OFFSET 1
#else
#define Q8_0_OFFSET 0
#endif

/* acc + the 4-product sums of u (unsigned) and v (signed) bytes, in 8 int32 lanes. */
INLINE __m256i dot_add(__m256i acc, __m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, v);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, v);
#else /* pair sums fit int16: u <= 128, |v| <= 127 */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
#endif
}

/* acc + the pair sums of a * b (int16 lanes) in 8 int32 lanes. */
INLINE __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

INLINE float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* Lanes below `count` set: masked loads read no further (nor fault) and give zeros, without
 * the stall of building a short vector in memory first. */
INLINE __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#endif

/* ---- Q4_1, Q8_0, Q5_0 and Q5_1: rows in groups of 8 -------------------------------- */

/* Bytes of one block of one row. */
INLINE int64_t block_bytes(int kind) {
    switch (kind) {
    case KIND_Q4_1: return 20;
    case KIND_Q8_0: return 34;
    case KIND_Q5_0: return 22;
    default: return 24; /* Q5_1 */
    }
}

INLINE int has_fifth(int kind) { return kind == KIND_Q5_0 || kind == KIND_Q5_1; }

/* Where a group block of t rows keeps its d (then, for Q4_1 and Q5_1, its m), and its
 * fifth bits: byte offsets in the block. */
INLINE int64_t scales_at(int kind, int t) {
    switch (kind) {
    case KIND_Q4_1: return 16 * t;
    case KIND_Q8_0: return 32 * t;
    default: return 20 * t; /* Q5_0, Q5_1: after 16 t of nibbles and 4 t of fifth bits */
    }
}

/* Fifth-bit mask j (0..7) of a group block of t rows, from its bit stream at `bits`. */
INLINE uint32_t fifth_mask(const uint8_t *bits, int t, int j) {
    uint32_t word;
    if (t == GROUP) {
        memcpy(&word, bits + 4 * j, sizeof word);
        return word;
    }
    const int64_t at = (int64_t)j * 4 * t;
    uint64_t wide = 0;
    memcpy(&wide, bits + at / 8, (size_t)((at % 8 + 4 * t + 7) / 8));
    return (uint32_t)((wide >> (at % 8)) & ((1ull << (4 * t)) - 1));
}

/* Weight e of row n (of t) of a group block, as an integer: the nibble (with its fifth
 * bit) or the int8. */
INLINE int group_weight(int kind, const uint8_t *block, int t, int n, int e) {
    if (kind == KIND_Q8_0) return (int8_t)block[(e / 4) * 4 * t + 4 * n + e % 4];
    const int half = e / 16, c = (e % 16) / 4, i = e % 4;
    const uint8_t byte = block[c * 4 * t + 4 * n + i];
    int u = half ? byte >> 4 : byte & 0x0F;
    if (has_fifth(kind)) u |= (int)((fifth_mask(block + 16 * t, t, 2 * c + half) >> (4 * n + i)) & 1) << 4;
    return u;
}

#if defined(__AVX2__)
/* u + 16 where bit j of `word` is set, for byte j (the fifth bits of 32 nibbles). */
INLINE __m256i add_fifth(__m256i u, uint32_t word) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(u, _cvtu32_mask32(word), u, _mm256_set1_epi8(0x10));
#else
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)word), spread);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
    return _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
#endif
}

/* t lanes of 4 bytes (the rest zero) from p. */
INLINE __m256i load_lanes(const uint8_t *p, int t) {
    if (t == GROUP) return _mm256_loadu_si256((const __m256i *)p);
    return _mm256_maskload_epi32((const int *)p, first_lanes(t));
}

/* t fp16 (the rest zero) as fp32. */
INLINE __m256 load_lane_halves(const uint8_t *p, int t) {
    uint16_t halves[GROUP] = {0};
    if (t == GROUP) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(halves, p, (size_t)t * sizeof *halves);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)halves));
}
#endif

/* out[r][n] = activation row (i + r) . row n of a group of t rows at `w` (its blocks one
 * after another), r < rows, n < t, for a group type `kind`. `rows` and `kind` are
 * constants where this is inlined, so the loops over r unroll. Per block, the integer sums
 * of each row n are exact; then, in lane n, Q8_0 (dw da Σvq, or with VNNI dw (da Σuq -
 * 128 s), u = v + 128) and Q5_0 (dw (da Σuq - 16 s)) take one fma for the offset and one
 * for the scale, Q4_1 and Q5_1 (dw da Σuq + mw s) a product and two fmas. */
INLINE void dot_group(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                      float out[][GROUP]) {
    const int64_t nb = a->k / BLOCK, size = block_bytes(kind) * t, at = scales_at(kind, t);
#if defined(__AVX2__)
    __m256 acc[ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size;
        __m256i u[8], signs[8];
        if (kind == KIND_Q8_0) {
            for (int c = 0; c < 8; c++) {
                signs[c] = load_lanes(block + c * 4 * t, t);
                u[c] = Q8_0_OFFSET ? _mm256_xor_si256(signs[c], _mm256_set1_epi8((char)0x80)) /* w + 128 */
                                   : _mm256_sign_epi8(signs[c], signs[c]); /* |w|; its sign moves to q */
            }
        } else {
            for (int c = 0; c < 4; c++) { /* u[2c]: weights 4c.., u[2c + 1]: 16 + 4c.. */
                __m256i packed = load_lanes(block + c * 4 * t, t);
                u[2 * c] = _mm256_and_si256(packed, low);
                u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                if (has_fifth(kind)) {
                    u[2 * c] = add_fifth(u[2 * c], fifth_mask(block + 16 * t, t, 2 * c));
                    u[2 * c + 1] = add_fifth(u[2 * c + 1], fifth_mask(block + 16 * t, t, 2 * c + 1));
                }
            }
        }
        const __m256 dw = load_lane_halves(block + at, t);
        const __m256 mw = kind == KIND_Q4_1 || kind == KIND_Q5_1 ? load_lane_halves(block + at + 2 * t, t) : dw;
        for (int r = 0; r < rows; r++) {
            const int8_t *v = a->q + (i + r) * a->q_stride + b * BLOCK;
            __m256i sums = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                /* the four activations vector c's weights meet, in every lane */
                const int from = kind == KIND_Q8_0 ? 4 * c : (c % 2) * 16 + (c / 2) * 4;
                int32_t four;
                memcpy(&four, v + from, sizeof four);
                __m256i q = _mm256_set1_epi32(four);
                if (kind == KIND_Q8_0 && !Q8_0_OFFSET) q = _mm256_sign_epi8(q, signs[c]);
                sums = dot_add(sums, u[c], q);
            }
            const float da = a->d[(i + r) * a->d_stride + b];
            const __m256 total = _mm256_cvtepi32_ps(sums);
            if (kind == KIND_Q5_0 || (kind == KIND_Q8_0 && Q8_0_OFFSET)) {
                const float offset = kind == KIND_Q5_0 ? -16.0f : -128.0f;
                const __m256 scaled = _mm256_fmadd_ps(total, _mm256_set1_ps(da),
                                                      _mm256_set1_ps(offset * a->s[(i + r) * a->d_stride + b]));
                acc[r] = _mm256_fmadd_ps(dw, scaled, acc[r]);
            } else { /* Q8_0 without VNNI; Q4_1 and Q5_1 then add their mins' share */
                acc[r] = _mm256_fmadd_ps(dw, _mm256_mul_ps(total, _mm256_set1_ps(da)), acc[r]);
                if (kind != KIND_Q8_0)
                    acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[(i + r) * a->d_stride + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r], acc[r]);
#else
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < t; n++) {
            const int8_t *v = a->q + (i + r) * a->q_stride;
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *block = w + b * size;
                int sum = 0;
                for (int e = 0; e < BLOCK; e++) sum += group_weight(kind, block, t, n, e) * v[b * BLOCK + e];
                const float dw = half_at((const uint16_t *)(block + at) + n);
                const float da = a->d[(i + r) * a->d_stride + b], sa = a->s[(i + r) * a->d_stride + b];
                if (kind == KIND_Q5_0) total += dw * (da * (float)sum - 16.0f * sa);
                else if (kind == KIND_Q8_0) total += dw * (da * (float)sum);
                else total += dw * (da * (float)sum) + half_at((const uint16_t *)(block + at + 2 * t) + n) * sa;
            }
            out[r][n] = total;
        }
#endif
}

/* ---- K-quants: the file's super-blocks of 256 ------------------------------------------ */

/* The 6-bit scales and mins of a Q4_K/Q5_K super-block's 8 sub-blocks, from its 12 bytes
 * (llama.cpp's get_scale_min_k4). */
INLINE void k_scales(const uint8_t *q, int scale[8], int min[8]) {
    for (int j = 0; j < 4; j++) {
        scale[j] = q[j] & 63, min[j] = q[j + 4] & 63;
        scale[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
        min[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

/* Σ_j min_j (bsums[2j] + bsums[2j + 1]): the mins' share of a super-block's sum. */
INLINE int k_min_sum(const int min[8], const int16_t *bsums) {
    int sum = 0;
    for (int j = 0; j < 8; j++) sum += min[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return sum;
}

/* Q4_K (`fifth` 0; 144 bytes: fp16 d, fp16 dmin, 12 bytes of scales, 128 of nibbles) and
 * Q5_K (`fifth` 1; 176 bytes: the same with 32 bytes of fifth bits before the nibbles).
 * Sub-blocks 2j and 2j + 1 are the low and high nibbles of bytes 32j .. 32j + 31; Q5_K's
 * fifth bit of weight 64j + e (e < 32) is bit 2j of qh[e], of 64j + 32 + e bit 2j + 1.
 * A super-block's sum is d da Σ_j sc_j Σ u q - dmin da Σ_j m_j bsums_j, its integers
 * exact. */
#if defined(__AVX2__)
/* The 8 scales (int16 lanes 0-7) and 8 mins (lanes 8-15) of a Q4_K/Q5_K super-block, from
 * its 12 bytes: k_scales, eight at a time. */
INLINE __m256i k_scales_vector(const uint8_t *q) {
    uint32_t u[3], packed[4];
    memcpy(u, q, sizeof u);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    packed[0] = u[0] & low6;                                      /* scales 0-3 */
    packed[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);      /* scales 4-7 */
    packed[2] = u[1] & low6;                                      /* mins 0-3 */
    packed[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4); /* mins 4-7 */
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)packed));
}

/* Lane j of `pairs` (8 int16 in each 128-bit half) broadcast over all 16 int16 lanes. */
INLINE __m256i spread_lane(__m256i pairs, int j) {
    return _mm256_shuffle_epi8(pairs, _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j)));
}
#endif

/* Q4_K (`fifth` 0; 144 bytes: fp16 d, fp16 dmin, 12 bytes of scales, 128 of nibbles) and
 * Q5_K (`fifth` 1; 176 bytes: the same with 32 bytes of fifth bits before the nibbles).
 * Sub-blocks 2j and 2j + 1 are the low and high nibbles of bytes 32j .. 32j + 31; Q5_K's
 * fifth bit of weight 64j + e (e < 32) is bit 2j of qh[e], of 64j + 32 + e bit 2j + 1.
 * A super-block's sum is d da Σ_j sc_j Σ u q - dmin da Σ_j m_j bsums_j, its integers
 * exact. */
INLINE void dot_k(int fifth, const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    const int64_t nb = a->k / SUPER, size = fifth ? 176 : 144;
#if defined(__AVX2__)
    /* Each row's sum stays in the lanes of a float vector across the super-blocks, added
     * up once at the end: a super-block's integer lanes (each exact in fp32: at most
     * 8 x 4 x 31 x 127 x 63 < 2^23) and its mins' four are converted and scaled there,
     * where a horizontal sum and scalar arithmetic per super-block and row cost 10-15% of
     * the product (a [576 x 1536] Q4_K product on one thread of the 2-core AMD EPYC:
     * 52.3 -> 44.6 us at 1 row, 144 -> 129 us at 8; Q6_K 51.7 -> 45.5 and 143 -> 117). */
    __m256 sum[ROWS];
    for (int r = 0; r < rows; r++) sum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size, *qs = block + (fifth ? 48 : 16);
        const float d = half_at((const uint16_t *)block), dmin = half_at((const uint16_t *)(block + 2));
        const __m256i both = k_scales_vector(block + 4);
        const __m128i min16 = _mm256_extracti128_si256(both, 1);
        const __m256i scales = _mm256_permute2x128_si256(both, both, 0x00); /* scales in each half */
        __m256i acc[ROWS], mins[ROWS];
        for (int r = 0; r < rows; r++) {
            const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
            __m256i q8sums = _mm256_loadu_si256((const __m256i *)bsums);
            __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1));
            mins[r] = _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_madd_epi16(min16, pairs), 0);
            acc[r] = _mm256_setzero_si256();
        }
        __m256i high = fifth ? _mm256_loadu_si256((const __m256i *)(block + 16)) : _mm256_setzero_si256();
        const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
        for (int j = 0; j < 4; j++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i u0 = _mm256_and_si256(packed, low4);
            __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            if (fifth) { /* bits 0 and 1 of each byte of `high` are this j's */
                u0 = _mm256_or_si256(u0, _mm256_and_si256(_mm256_slli_epi16(high, 4), bit4));
                u1 = _mm256_or_si256(u1, _mm256_and_si256(_mm256_slli_epi16(high, 3), bit4));
                high = _mm256_srli_epi16(high, 2);
            }
            __m256i s0 = spread_lane(scales, 2 * j), s1 = spread_lane(scales, 2 * j + 1);
            for (int r = 0; r < rows; r++) {
                const int8_t *v = a->q + (i + r) * a->q_stride + b * SUPER + 64 * j;
                __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *)v));
                __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(v + 32)));
                acc[r] = madd_add(madd_add(acc[r], s0, p0), s1, p1);
            }
        }
        for (int r = 0; r < rows; r++) {
            const float da = a->d[(i + r) * a->d_stride + b];
            sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d * da), sum[r]);
            sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_set1_ps(-dmin * da), sum[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(sum[r]);
#else
    float total[ROWS];
    for (int r = 0; r < rows; r++) total[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size, *qs = block + (fifth ? 48 : 16);
        const float d = half_at((const uint16_t *)block), dmin = half_at((const uint16_t *)(block + 2));
        int scale[8], min[8];
        k_scales(block + 4, scale, min);
        for (int r = 0; r < rows; r++) {
            const int8_t *v = a->q + (i + r) * a->q_stride + b * SUPER;
            int sum = 0;
            for (int j = 0; j < 4; j++)
                for (int e = 0; e < 32; e++) {
                    int u0 = qs[32 * j + e] & 0x0F, u1 = qs[32 * j + e] >> 4;
                    if (fifth) {
                        u0 |= ((block[16 + e] >> (2 * j)) & 1) << 4;
                        u1 |= ((block[16 + e] >> (2 * j + 1)) & 1) << 4;
                    }
                    sum += scale[2 * j] * u0 * v[64 * j + e] + scale[2 * j + 1] * u1 * v[64 * j + 32 + e];
                }
            const float da = a->d[(i + r) * a->d_stride + b];
            const int mins = k_min_sum(min, a->bsums + (i + r) * (a->k / 16) + b * 16);
            total[r] += d * da * (float)sum - dmin * da * (float)mins;
        }
    }
    for (int r = 0; r < rows; r++) out[r] = total[r];
#endif
}

INLINE void dot_q4_k(const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    dot_k(0, w, a, i, rows, out);
}

INLINE void dot_q5_k(const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    dot_k(1, w, a, i, rows, out);
}

/* Q6_K (210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d). Each half h of 128
 * weights reads ql[64h ..], qh[32h ..]; for e < 32: weight 128h + e is ql[e] & 15 with qh[e]
 * bits 0-1 on top, 128h + 32 + e ql[32 + e] & 15 with bits 2-3, 128h + 64 + e ql[e] >> 4
 * with bits 4-5, 128h + 96 + e ql[32 + e] >> 4 with bits 6-7; weight t has scale t / 16.
 * A super-block's sum is d da (Σ_j sc_j Σ u q - 32 Σ_j sc_j bsums_j). */
INLINE void dot_q6_k(const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    const int64_t nb = a->k / SUPER;
#if defined(__AVX2__)
    /* As dot_k: each row's sum in the lanes of a float vector, its offsets' lanes
     * subtracted from its products' before the conversion. */
    __m256 sum[ROWS];
    for (int r = 0; r < rows; r++) sum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * 210;
        const int8_t *scale = (const int8_t *)(block + 192);
        const float d = half_at((const uint16_t *)(block + 208));
        const __m256i scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scale));
        __m256i acc[ROWS];
        for (int r = 0; r < rows; r++) { /* -32 sc_j bsums_j: the weights' offset of 32 */
            const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
            acc[r] = _mm256_slli_epi32(_mm256_madd_epi16(scale16, _mm256_loadu_si256((const __m256i *)bsums)), 5);
            acc[r] = _mm256_sub_epi32(_mm256_setzero_si256(), acc[r]);
        }
        const __m256i low4 = _mm256_set1_epi8(0x0F), bits2 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = block + 64 * h;
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i top = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
            __m256i u[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(top, 4), bits2)),
                _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(top, 2), bits2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(top, bits2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(top, 2), bits2)),
            };
            __m256i s[4]; /* 32 weights: two sub-blocks of 16, scales 8h + 2g and 8h + 2g + 1 */
            const __m256i half8 = h ? _mm256_permute2x128_si256(scale16, scale16, 0x11)
                                    : _mm256_permute2x128_si256(scale16, scale16, 0x00);
            for (int g = 0; g < 4; g++)
                s[g] = _mm256_blend_epi32(spread_lane(half8, 2 * g), spread_lane(half8, 2 * g + 1), 0xF0);
            for (int r = 0; r < rows; r++) {
                const int8_t *v = a->q + (i + r) * a->q_stride + b * SUPER + 128 * h;
                for (int g = 0; g < 4; g++)
                    acc[r] = madd_add(acc[r], s[g], _mm256_maddubs_epi16(u[g], _mm256_loadu_si256((const __m256i *)(v + 32 * g))));
            }
        }
        for (int r = 0; r < rows; r++)
            sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d * a->d[(i + r) * a->d_stride + b]), sum[r]);
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(sum[r]);
#else
    float total[ROWS];
    for (int r = 0; r < rows; r++) total[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * 210;
        const int8_t *scale = (const int8_t *)(block + 192);
        const float d = half_at((const uint16_t *)(block + 208));
        for (int r = 0; r < rows; r++) {
            const int8_t *v = a->q + (i + r) * a->q_stride + b * SUPER;
            int sum = 0;
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = block + 64 * h, *qh = block + 128 + 32 * h;
                for (int e = 0; e < 32; e++) {
                    int u[4] = {(ql[e] & 15) | ((qh[e] & 3) << 4), (ql[32 + e] & 15) | (((qh[e] >> 2) & 3) << 4),
                                (ql[e] >> 4) | (((qh[e] >> 4) & 3) << 4), (ql[32 + e] >> 4) | (((qh[e] >> 6) & 3) << 4)};
                    for (int g = 0; g < 4; g++) {
                        int t = 128 * h + 32 * g + e;
                        sum += scale[t / 16] * u[g] * v[t];
                    }
                }
            }
            const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
            int offset = 0;
            for (int j = 0; j < 16; j++) offset += scale[j] * bsums[j];
            total[r] += d * a->d[(i + r) * a->d_stride + b] * (float)(sum - 32 * offset);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = total[r];
#endif
}

#endif
