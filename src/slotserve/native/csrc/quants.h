/* The arithmetic of each GGUF weight type the block products take: how the activations
 * are quantised for it, and one weight row's dot product with up to ROWS activation rows.
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
 * Layouts. Q4_1, Q8_0, Q5_0 and Q5_1 rows are packed in pairs of blocks (gguf_linear.pack;
 * a row is padded with a zero block to an even count P), so that one 256-bit vector holds
 * a pair's 32 low or 32 high weights and 8 blocks' scales load as one vector. Q4_1 row: P x
 * 16 bytes of nibbles (weight j in the low nibble of byte j, j + 16 in its high nibble), P
 * fp16 dw, P fp16 mw. Q5_0 / Q5_1 row: the same nibbles, then P / 2 x 8 bytes of fifth bits
 * (per pair two 32-bit words, one for each vector of nibbles: bit j of a word is the fifth
 * bit of byte j of its vector), P fp16 dw, (Q5_1) P fp16 mw; the same bytes as the file's.
 * Q8_0 row: P / 2 x 64 int8 in pair order, P fp16 dw. Pair order, for blocks b0 b1:
 * b0[0:16] b1[0:16] b0[16:32] b1[16:32]; their activations are quantised into pair order
 * too (`ACT_PAIRS`). The K-quants keep the file's own blocks, with natural-order
 * activations. Q5_0 is Q5_1 with mw = -16 dw: its integer sums are of u, unsigned, as for
 * the other pair types.
 *
 * Each dot computes, for every row, the same operations in the same order whether it runs
 * with 1 or ROWS rows (the rows only share the weights' decoding): a row's result never
 * depends on its batch.
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
enum { ACT_PAIRS = 0, ACT_Q8_K = 2 };

INLINE int64_t padded_blocks(int64_t k) { return (k / BLOCK + 1) / 2 * 2; }

/* The activation format a weight type multiplies against (-1: not a type we take). */
INLINE int act_format(int64_t kind) {
    switch (kind) {
    case KIND_Q4_1: case KIND_Q8_0: case KIND_Q5_0: case KIND_Q5_1: return ACT_PAIRS;
    case KIND_Q4_K: case KIND_Q5_K: case KIND_Q6_K: return ACT_Q8_K;
    default: return -1;
    }
}

/* Bytes of one weight row of k values. */
INLINE int64_t weight_row_bytes(int64_t kind, int64_t k) {
    switch (kind) {
    case KIND_Q4_1: return padded_blocks(k) * 20;
    case KIND_Q8_0: return padded_blocks(k) * 34;
    case KIND_Q5_0: return padded_blocks(k) * 22;
    case KIND_Q5_1: return padded_blocks(k) * 24;
    case KIND_Q4_K: return k / SUPER * 144;
    case KIND_Q5_K: return k / SUPER * 176;
    default: return k / SUPER * 210; /* Q6_K */
    }
}

/* Offset of weight e of block b in pair order. */
INLINE int64_t pair_offset(int64_t b, int e) {
    return (b / 2) * 64 + (e < 16 ? 0 : 32) + (b % 2) * 16 + (e % 16);
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

/* Q8 blocks of x[m, k] (row stride ldx) in pair order: q[m, P * 32], d and s [m, P], the
 * padding block zero. */
static void quantize_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                        float *s, acts *out) {
    int64_t nb = k / BLOCK, np = padded_blocks(k);
    for (int64_t i = 0; i < m; i++) {
        int8_t *row = q + i * np * BLOCK;
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + i * ldx + b * BLOCK;
            float scale = block_amax(src, BLOCK) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            int sums[2];
            quantize_block(src, inverse, row + pair_offset(b, 0), row + pair_offset(b, 16), sums);
            d[i * np + b] = scale;
            s[i * np + b] = scale * (float)(sums[0] + sums[1]);
        }
        if (np > nb) { /* the padding block */
            memset(row + pair_offset(nb, 0), 0, 16);
            memset(row + pair_offset(nb, 16), 0, 16);
            d[i * np + nb] = s[i * np + nb] = 0.0f;
        }
    }
    *out = (acts){q, d, s, NULL, k, np * BLOCK, np};
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

INLINE int hsum_int(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return _mm_cvtsi128_si32(x);
}

/* Lanes below `count` set: masked loads read no further (nor fault) and give zeros, without
 * the stall of building a short vector in memory first. */
INLINE __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 fp16 (or an even count fewer, then zeros) as fp32. */
INLINE __m256 load_halves(const uint16_t *p, int64_t count) {
    if (count == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m128i mask = _mm256_castsi256_si128(first_lanes(count / 2)); /* 2 halves a lane */
    return _mm256_cvtph_ps(_mm_maskload_epi32((const int *)p, mask));
}

INLINE __m256 load_floats(const float *p, int64_t count) {
    if (count == 8) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, first_lanes(count));
}


#endif

/* ---- Q4_1, Q8_0, Q5_0 and Q5_1: packed pairs ------------------------------------------ */

/* Bytes of a packed row's weights before its scales, per block. */
INLINE int64_t pair_weight_bytes(int kind) {
    switch (kind) {
    case KIND_Q4_1: return 16;
    case KIND_Q8_0: return 32;
    default: return 20; /* Q5_0, Q5_1: nibbles and fifth bits */
    }
}

#if defined(__AVX2__)
/* 32 nibbles (0..15) plus 16 where bit j of the 32 bits at `bits` is set, for byte j. */
INLINE __m256i add_fifth(__m256i u, const uint8_t *bits) {
    uint32_t word;
    memcpy(&word, bits, sizeof word);
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

/* acc[r] += the products of the pair of blocks from `first` (lane j of scales[r] holds
 * block b + j's dw * da, `lane` that of `first`). */
INLINE void pair_dot(int kind, const uint8_t *w, const acts *a, int64_t i, int rows,
                     int64_t first, const __m256 *scales, int lane, __m256 *acc) {
    __m256i u0, u1, w0 = _mm256_setzero_si256(), w1 = _mm256_setzero_si256();
    if (kind == KIND_Q8_0) {
        w0 = _mm256_loadu_si256((const __m256i *)(w + first * 32));
        w1 = _mm256_loadu_si256((const __m256i *)(w + first * 32 + 32));
        if (Q8_0_OFFSET) { /* w + 128, unsigned */
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            u0 = _mm256_xor_si256(w0, flip), u1 = _mm256_xor_si256(w1, flip);
        } else { /* |w| as unsigned; its sign moves to the activations */
            u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
        }
    } else {
        const __m256i low = _mm256_set1_epi8(0x0F);
        __m256i packed = _mm256_loadu_si256((const __m256i *)(w + first * 16));
        u0 = _mm256_and_si256(packed, low);
        u1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        if (kind != KIND_Q4_1) { /* the pair's fifth bits follow all of the row's nibbles */
            const uint8_t *bits = w + a->d_stride * 16 + first * 4;
            u0 = add_fifth(u0, bits), u1 = add_fifth(u1, bits + 4);
        }
    }
    /* lanes 0-3 take the pair's first block's scale, 4-7 the second's */
    __m256i spread = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(lane));
    for (int r = 0; r < rows; r++) {
        const int8_t *v = a->q + (i + r) * a->q_stride + first * BLOCK;
        __m256i v0 = _mm256_loadu_si256((const __m256i *)v);
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(v + 32));
        if (kind == KIND_Q8_0 && !Q8_0_OFFSET) v0 = _mm256_sign_epi8(v0, w0), v1 = _mm256_sign_epi8(v1, w1);
        __m256i sums = dot_add(dot_add(_mm256_setzero_si256(), u0, v0), u1, v1);
        __m256 scale = _mm256_permutevar8x32_ps(scales[r], spread);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
    }
}
#endif

/* Weight e of block b of a packed row as an integer: the nibble (with its fifth bit) or
 * the int8. */
INLINE int pair_weight(int kind, const uint8_t *w, int64_t np, int64_t b, int e) {
    if (kind == KIND_Q8_0) return (int8_t)w[pair_offset(b, e)];
    uint8_t byte = w[b * 16 + e % 16];
    int u = e < 16 ? (byte & 0x0F) : (byte >> 4);
    if (kind != KIND_Q4_1) {
        uint32_t word;
        memcpy(&word, w + np * 16 + (b / 2) * 8 + (e < 16 ? 0 : 4), sizeof word);
        u |= (int)((word >> ((b % 2) * 16 + e % 16)) & 1) << 4;
    }
    return u;
}

/* out[r] = packed row `w` . activation row (i + r), r < rows, for a pair type `kind`. `rows`
 * and `kind` are constants where this is inlined, so the loops over r unroll. The offset
 * of the types with one (Q4_1, Q5_1: mw; Q5_0: -16 dw; Q8_0 with VNNI: -128 dw) is mw * s,
 * block by block. */
INLINE void dot_pairs(int kind, const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    const int64_t np = a->d_stride;
    const uint16_t *dw = (const uint16_t *)(w + np * pair_weight_bytes(kind)), *mw = dw + np;
#if defined(__AVX2__)
    const int offset = kind != KIND_Q8_0 || Q8_0_OFFSET;
    /* One accumulator a row: the offsets' products join it block by block. The rows'
     * chains are independent, so the fma latency hides behind the other rows (and the
     * next weight row) rather than behind a second accumulator. */
    __m256 acc[ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < np; b += 8) { /* 8 blocks (4 pairs) share one scale vector */
        int64_t count = np - b < 8 ? np - b : 8;
        __m256 weight_scales = load_halves(dw + b, count), scales[ROWS], weight_mins;
        if (kind == KIND_Q5_0) weight_mins = _mm256_mul_ps(weight_scales, _mm256_set1_ps(-16.0f));
        else if (kind == KIND_Q8_0) weight_mins = _mm256_mul_ps(weight_scales, _mm256_set1_ps(-128.0f));
        else if (offset) weight_mins = load_halves(mw + b, count);
        else weight_mins = _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            scales[r] = _mm256_mul_ps(weight_scales, load_floats(a->d + (i + r) * np + b, count));
            if (offset)
                acc[r] = _mm256_fmadd_ps(weight_mins, load_floats(a->s + (i + r) * np + b, count), acc[r]);
        }
        for (int64_t pair = 0; pair < count / 2; pair++)
            pair_dot(kind, w, a, i, rows, b + 2 * pair, scales, 2 * (int)pair, acc);
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(acc[r]);
#else
    const int offset = kind != KIND_Q8_0;
    for (int r = 0; r < rows; r++) {
        const int8_t *v = a->q + (i + r) * a->q_stride;
        float total = 0.0f;
        for (int64_t b = 0; b < np; b++) {
            int sum = 0;
            for (int e = 0; e < BLOCK; e++) sum += pair_weight(kind, w, np, b, e) * v[pair_offset(b, e)];
            const float scale = half_at(dw + b);
            total += scale * a->d[(i + r) * np + b] * (float)sum;
            if (kind == KIND_Q5_0) total += -16.0f * scale * a->s[(i + r) * np + b];
            else if (offset) total += half_at(mw + b) * a->s[(i + r) * np + b];
        }
        out[r] = total;
    }
#endif
}

INLINE void dot_q4_1(const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    dot_pairs(KIND_Q4_1, w, a, i, rows, out);
}

INLINE void dot_q8_0(const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    dot_pairs(KIND_Q8_0, w, a, i, rows, out);
}

INLINE void dot_q5_0(const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    dot_pairs(KIND_Q5_0, w, a, i, rows, out);
}

INLINE void dot_q5_1(const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    dot_pairs(KIND_Q5_1, w, a, i, rows, out);
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
