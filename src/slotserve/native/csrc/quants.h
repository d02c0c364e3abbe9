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
 *   Q4_K    d sc_j u - dmin m_j, u 0..15, 8 sub-blocks     Q8_K (d, bsums)   see k_super_dot
 *           of 32 with 6-bit scales sc_j and mins m_j
 *   Q5_K    as Q4_K with u 0..31                           Q8_K
 *   Q6_K    d sc_j (u - 32), u 0..63, 16 sub-blocks of     Q8_K              see k_super_dot
 *           16 with int8 scales sc_j
 *
 * Q8 activations: each run of 32 values is 32 int8 q with d = amax / 127 (rounded half to
 * even) and s = d Σq. Q8_K (llama.cpp's block_q8_K): each run of 256 values is 256 int8
 * q = min(127, round(x * -127 / max)), where max is the value of largest magnitude, with
 * d = max / -127 and bsums, the sums of each 16 q.
 *
 * Layouts. Matrices hold their rows in groups of GROUP = 8 (the last group has the n % 8
 * rows left, if any; gguf_linear.pack), each group's blocks (super-blocks for the
 * K-quants) one after another, and each block of a group of t rows interleaved so that
 * lane n of a vector is row n's:
 *
 *   Q4_1  nibbles [4][t][4] bytes, d [t] fp16, m [t] fp16                   20 t bytes
 *   Q5_0  nibbles [4][t][4], fifth bits (8 masks of 4 t bits), d [t]        22 t
 *   Q5_1  nibbles, fifth bits, d [t], m [t]                                  24 t
 *   Q8_0  int8 [8][t][4], d [t]                                              34 t
 *   Q4_K  scales [3][t][4], d [t], dmin [t], nibbles [32][t][4]             144 t
 *   Q5_K  scales [3][t][4], d [t], dmin [t], qh [8][t][4], nibbles          176 t
 *   Q6_K  scales [4][t][4], 4 x (ql [4][t][4], ql [4][t][4], qh [4][t][4]),  210 t
 *         d [t]
 *
 * A K-quant's vector w of a field holds in lane n bytes 4w .. 4w + 3 of that field of row
 * n's super-block, the fields in the order the products read them (k_segments: Q6_K's
 * weights 64 at a time), so one dot-product instruction multiplies four weights
 * of 8 rows, and a sub-block's sums of 8 rows take one integer multiply by its 8 scales
 * (dot_group_k), where super-blocks row by row decoded each row's scales on their own.
 *
 * Nibble vector c (0..3) holds in lane n bytes 4c..4c+3 of row n's 16 nibble bytes (as the
 * file has them: weight j in the low nibble of byte j, j + 16 in its high nibble), so its
 * low nibbles are weights 4c..4c+3 and its high nibbles 16+4c..16+4c+3. Fifth-bit mask
 * 2c + h (a bit stream of 8 masks, each 4 t bits) has bit 4n + i set where weight
 * 16h + 4c + i of row n has its fifth bit; Q8_0's vector c holds weights 4c..4c+3. So one
 * dot-product instruction multiplies four weights of each of 8 rows by the same four
 * activations (broadcast), and one fma scales a block of 8 rows, where rows one by one
 * needed a shuffle, a conversion and an fma per block and row (llama.cpp's repacked GEMMs
 * interleave rows the same way). A matrix keeps the file's bytes, moved: rows x blocks x
 * block bytes. Activations are quantised in natural order, except that with AVX-512 VNNI
 * they are stored in the products' groups of rows, a pair's words side by side, so that the
 * products run two rows to a 512-bit vector (act_word, dot_group_pairs): one 512-bit
 * dot-product instruction does the work of two 256-bit ones for less than twice the time.
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

/* With AVX-512 (F, VL, BW and VNNI), the products take activation rows two to a 512-bit
 * vector (dot_group_pairs, dot_group_k), and the quantisers store them for it (act_word). */
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAIRED 1
#else
#define PAIRED 0
#endif
/* act_group's groups are the products' (blocks.c's group_rows: ROWS rows at a time). */
_Static_assert(!PAIRED || ROWS == 8, "paired activation groups are 8 rows");

/* The weight types and their codes, block sizes and layouts are native/blocks.py's
 * BLOCK_TYPES; tests/native/test_block_types.py checks this enum and the tables below
 * (weight_row_bytes, block_bytes, scales_at, act_format, k_segments) against it. Each
 * switch names every type it serves in a case, the one it defaults to included. */
enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1, KIND_Q5_0 = 2, KIND_Q5_1 = 3, KIND_Q4_K = 4, KIND_Q5_K = 5, KIND_Q6_K = 6 };
enum { ACT_Q8 = 0, ACT_Q8_K = 2 };
#define GROUP 8 /* rows interleaved in a matrix */

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
    case KIND_Q6_K: default: return k / SUPER * 210;
    }
}

/* ---- activations -------------------------------------------------------------------- */

/* Quantised activation rows, m of k values (nb blocks each): q int8 (act_word), d the
 * scales (act_scale for Q8; d[row * nb + super-block] for Q8_K), s the Q8 blocks' d Σq
 * (act_scale), bsums[row * (k / 16) + j] the Q8_K sums of 16. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int16_t *bsums;
    int64_t k, m, nb;
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
 * fmaxf for each value (NaN rules), a call per activation value on the decode path. */
INLINE float block_amax(const float *src, int n) {
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int j = 0; j < n; j++) {
        float v = fabsf(src[j]);
        amax = v > amax ? v : amax;
    }
    return amax;
}

/* Where activation rows keep their blocks. With PAIRED they are stored in the groups the
 * products take them in (rows 8g .. 8g + 7, then the m % 8 left): in a group of G rows from
 * row i, word c (4 bytes) of block b of its row r sits ((b W + c) G + r) 4 bytes after byte
 * i k (W = values / 4 words a block), so rows r and r + 1 are side by side (one 8-byte
 * broadcast for the pair) and a group of one row is the row as it came; the products know
 * G (their row count), so the offsets are constants there. Without PAIRED, rows one after
 * another. act_word: that byte, for blocks of `values` (Q8: 32, Q8_K: 256). */
INLINE int64_t act_word(int64_t i, int rows, int r, int64_t b, int64_t nb, int values, int64_t word) {
#if PAIRED
    return i * nb * values + ((b * (values / 4) + word) * rows + r) * 4;
#else
    (void)rows;
    return ((i + r) * nb + b) * values + word * 4;
#endif
}

/* Bytes from one word of a row's block to the next, in a group of `rows` (act_word). */
#define ACT_STEP(rows) (PAIRED ? 4 * (rows) : 4)

/* Where row r of a group of `rows` from row i keeps its Q8 block b's d and s: i nb + b G + r
 * with PAIRED (a pair's two side by side), else (i + r) nb + b. */
INLINE int64_t act_scale(int64_t i, int rows, int r, int64_t b, int64_t nb) {
#if PAIRED
    return i * nb + b * rows + r;
#else
    (void)rows;
    return (i + r) * nb + b;
#endif
}

/* Row i of m as the products group it: the group's first row, its row count and i's place. */
INLINE void act_group(int64_t i, int64_t m, int64_t *first, int *rows, int *r) {
    *first = PAIRED ? i / 8 * 8 : i;
    *rows = PAIRED ? (int)(m - *first < 8 ? m - *first : 8) : 1;
    *r = (int)(i - *first);
}

/* A quantised block of row i of m (`values` bytes at `block`) stored where act_word says. */
INLINE void store_block(int8_t *q, int64_t i, int64_t m, int64_t b, int64_t nb, int values, const int8_t *block) {
    int64_t first;
    int rows, r;
    act_group(i, m, &first, &rows, &r);
    for (int c = 0; c < values / 4; c++) memcpy(q + act_word(first, rows, r, b, nb, values, c), block + 4 * c, 4);
}

/* Q8 blocks of x[m, k] (row stride ldx): q[m, k], d and s [m, k / 32], where act_word and
 * act_scale say. */
static void quantize_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                        float *s, acts *out) {
    const int64_t nb = k / BLOCK;
    for (int64_t i = 0; i < m; i++) {
        int64_t first;
        int rows, r;
        act_group(i, m, &first, &rows, &r);
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + i * ldx + b * BLOCK;
            float scale = block_amax(src, BLOCK) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            int sums[2];
            int8_t block[BLOCK];
            quantize_block(src, inverse, block, block + 16, sums);
            store_block(q, i, m, b, nb, BLOCK, block);
            const int64_t at = act_scale(first, rows, r, b, nb);
            d[at] = scale;
            s[at] = scale * (float)(sums[0] + sums[1]);
        }
    }
    *out = (acts){q, d, s, NULL, k, m, nb};
}

/* Q8_K super-blocks of x[m, k] (k a multiple of 256): q[m, k] where act_word says,
 * d[m, k / 256], bsums[m, k / 16]. */
static void quantize_q8_k(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                          int16_t *bsums, acts *out) {
    const int64_t nb = k / SUPER;
    int8_t dst[SUPER];
    for (int64_t i = 0; i < m; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + i * ldx + b * SUPER;
            int16_t *sums = bsums + i * (k / 16) + b * 16;
            float amax = block_amax(src, SUPER), max = 0.0f;
            for (int j = 0; j < SUPER; j++) /* the first value of that magnitude, with its sign */
                if (fabsf(src[j]) == amax) { max = src[j]; break; }
            if (amax == 0.0f) {
                memset(dst, 0, SUPER), memset(sums, 0, 16 * sizeof *sums);
                d[i * nb + b] = 0.0f;
            } else {
                float by = -127.0f / max;
                for (int j = 0; j < SUPER / BLOCK; j++) {
                    int half[2];
                    quantize_block(src + j * BLOCK, by, dst + j * BLOCK, dst + j * BLOCK + 16, half);
                    sums[2 * j] = (int16_t)half[0], sums[2 * j + 1] = (int16_t)half[1];
                }
                d[i * nb + b] = 1.0f / by;
            }
            store_block(q, i, m, b, nb, SUPER, dst);
        }
    }
    *out = (acts){q, d, NULL, bsums, k, m, nb};
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
    case KIND_Q5_1: default: return 24;
    }
}

INLINE int has_fifth(int kind) { return kind == KIND_Q5_0 || kind == KIND_Q5_1; }

/* Where a group block of t rows keeps its d (then, for Q4_1 and Q5_1, its m), and its
 * fifth bits: byte offsets in the block. */
INLINE int64_t scales_at(int kind, int t) {
    switch (kind) {
    case KIND_Q4_1: return 16 * t;
    case KIND_Q8_0: return 32 * t;
    case KIND_Q5_0: case KIND_Q5_1: default: return 20 * t; /* after 16 t of nibbles and 4 t of fifth bits */
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

#if defined(__AVX2__)
/* The weights of a group block of t rows as 8 vectors of unsigned bytes (lane n row n's):
 * u[c] meets activation word group_word(kind, c); for Q8_0, `signs` are the int8 weights
 * and u is w + 128 (with VNNI) or |w| (its sign then moves to the activations). */
INLINE void group_weights(int kind, const uint8_t *block, int t, __m256i u[8], __m256i signs[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 8; c++) {
        if (kind == KIND_Q8_0) {
            signs[c] = load_lanes(block + c * 4 * t, t);
            u[c] = Q8_0_OFFSET ? _mm256_xor_si256(signs[c], _mm256_set1_epi8((char)0x80)) /* w + 128 */
                               : _mm256_sign_epi8(signs[c], signs[c]); /* |w| */
        } else { /* u[2c']: weights 4c'.. (low nibbles of word c'), u[2c' + 1]: 16 + 4c'.. */
            const __m256i packed = load_lanes(block + c / 2 * 4 * t, t);
            u[c] = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(packed, 4) : packed, low);
            if (has_fifth(kind)) u[c] = add_fifth(u[c], fifth_mask(block + 16 * t, t, c));
        }
    }
}
#endif

/* The activation word (4 values) weight vector c of group_weights meets. */
INLINE int group_word(int kind, int c) { return kind == KIND_Q8_0 ? c : (c % 2) * 4 + c / 2; }

#if PAIRED
/* Lane n of x in lanes 2n and 2n + 1. */
INLINE __m512i doubled_lanes(__m256i x) {
    const __m512i doubled = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_epi32(doubled, _mm512_castsi256_si512(x));
}

INLINE __m512 doubled_floats(__m256 x) { return _mm512_castsi512_ps(doubled_lanes(_mm256_castps_si256(x))); }
#endif

/* out[r][n] = activation row (i + r) . row n of a group of t rows at `w` (its blocks one
 * after another), r < rows, n < t, for a group type `kind`. `rows` and `kind` are
 * constants where this is inlined, so the loops over r unroll. Per block, the integer sums
 * of each row n are exact; then, in lane n, Q8_0 (dw da Σvq, or with VNNI dw (da Σuq -
 * 128 s), u = v + 128) and Q5_0 (dw (da Σuq - 16 s)) take one fma for the offset and one
 * for the scale, Q4_1 and Q5_1 (dw da Σuq + mw s) a product and two fmas. */
#if PAIRED
/* dot_group for the pairs of a group of `rows` activation rows from row i (stored as
 * act_word has them) on 512-bit vectors: lane 2n + j of pair p is weight row n against
 * activation row i + 2p + j, so one dot-product instruction serves two rows (the weights'
 * lanes doubled once a block, each pair's activations one 8-byte broadcast). Lane by lane
 * the same operations in the same order as dot_group_rows', so a row's result is the same
 * in either. */
INLINE void dot_group_pairs(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                            float out[][GROUP]) {
    const int64_t nb = a->k / BLOCK, size = block_bytes(kind) * t, at = scales_at(kind, t);
    const int pairs = rows / 2;
    __m512 acc[4];
    for (int p = 0; p < pairs; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size;
        __m256i lanes[8], signs[8];
        group_weights(kind, block, t, lanes, signs); /* VNNI: Q8_0 as w + 128 */
        __m512i u[8];
        for (int c = 0; c < 8; c++) u[c] = doubled_lanes(lanes[c]);
        const __m512 dw = doubled_floats(load_lane_halves(block + at, t));
        const __m512 mw = kind == KIND_Q4_1 || kind == KIND_Q5_1 ? doubled_floats(load_lane_halves(block + at + 2 * t, t)) : dw;
        for (int p = 0; p < pairs; p++) {
            const int64_t first = act_scale(i, rows, 2 * p, b, nb);
            const int8_t *words = a->q + act_word(i, rows, 2 * p, b, nb, BLOCK, 0);
            __m512i sums = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                /* the four activations vector c's weights meet, of rows 2p and 2p + 1 */
                int64_t two;
                memcpy(&two, words + group_word(kind, c) * ACT_STEP(rows), sizeof two);
                sums = _mm512_dpbusd_epi32(sums, u[c], _mm512_set1_epi64(two));
            }
            double pair_d, pair_s;
            memcpy(&pair_d, a->d + first, sizeof pair_d);
            memcpy(&pair_s, a->s + first, sizeof pair_s);
            const __m512 da = _mm512_castpd_ps(_mm512_set1_pd(pair_d));
            const __m512 sa = _mm512_castpd_ps(_mm512_set1_pd(pair_s));
            const __m512 total = _mm512_cvtepi32_ps(sums);
            if (kind == KIND_Q5_0 || kind == KIND_Q8_0) {
                const __m512 offset = _mm512_set1_ps(kind == KIND_Q5_0 ? -16.0f : -128.0f);
                acc[p] = _mm512_fmadd_ps(dw, _mm512_fmadd_ps(total, da, _mm512_mul_ps(offset, sa)), acc[p]);
            } else {
                acc[p] = _mm512_fmadd_ps(dw, _mm512_mul_ps(total, da), acc[p]);
                acc[p] = _mm512_fmadd_ps(mw, sa, acc[p]);
            }
        }
    }
    const __m512i apart = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int p = 0; p < pairs; p++) {
        const __m512 two = _mm512_permutexvar_ps(apart, acc[p]);
        _mm256_storeu_ps(out[2 * p], _mm512_castps512_ps256(two));
        _mm256_storeu_ps(out[2 * p + 1], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(two), 1)));
    }
}
#endif

/* dot_group's rows `from` .. rows - 1 of a group of `rows` from row i, one by one (a row's
 * lanes one 256-bit vector). */
INLINE void dot_group_rows(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                           int from, float out[][GROUP]) {
    const int64_t nb = a->k / BLOCK, size = block_bytes(kind) * t, at = scales_at(kind, t);
#if defined(__AVX2__)
    __m256 acc[ROWS];
    for (int r = from; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size;
        __m256i u[8], signs[8];
        group_weights(kind, block, t, u, signs);
        const __m256 dw = load_lane_halves(block + at, t);
        const __m256 mw = kind == KIND_Q4_1 || kind == KIND_Q5_1 ? load_lane_halves(block + at + 2 * t, t) : dw;
        for (int r = from; r < rows; r++) {
            const int8_t *v = a->q + act_word(i, rows, r, b, nb, BLOCK, 0);
            __m256i sums = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                /* the four activations vector c's weights meet, in every lane */
                int32_t four;
                memcpy(&four, v + group_word(kind, c) * ACT_STEP(rows), sizeof four);
                __m256i q = _mm256_set1_epi32(four);
                if (kind == KIND_Q8_0 && !Q8_0_OFFSET) q = _mm256_sign_epi8(q, signs[c]);
                sums = dot_add(sums, u[c], q);
            }
            const int64_t scale = act_scale(i, rows, r, b, nb);
            const float da = a->d[scale];
            const __m256 total = _mm256_cvtepi32_ps(sums);
            if (kind == KIND_Q5_0 || (kind == KIND_Q8_0 && Q8_0_OFFSET)) {
                const float offset = kind == KIND_Q5_0 ? -16.0f : -128.0f;
                const __m256 scaled = _mm256_fmadd_ps(total, _mm256_set1_ps(da),
                                                      _mm256_set1_ps(offset * a->s[scale]));
                acc[r] = _mm256_fmadd_ps(dw, scaled, acc[r]);
            } else { /* Q8_0 without VNNI; Q4_1 and Q5_1 then add their mins' share */
                acc[r] = _mm256_fmadd_ps(dw, _mm256_mul_ps(total, _mm256_set1_ps(da)), acc[r]);
                if (kind != KIND_Q8_0)
                    acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[scale]), acc[r]);
            }
        }
    }
    for (int r = from; r < rows; r++) _mm256_storeu_ps(out[r], acc[r]);
#else
    for (int r = from; r < rows; r++)
        for (int n = 0; n < t; n++) {
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *block = w + b * size;
                const int8_t *v = a->q + act_word(i, rows, r, b, nb, BLOCK, 0); /* row after row */
                int sum = 0;
                for (int e = 0; e < BLOCK; e++) sum += group_weight(kind, block, t, n, e) * v[e];
                const float dw = half_at((const uint16_t *)(block + at) + n);
                const int64_t scale = act_scale(i, rows, r, b, nb);
                const float da = a->d[scale], sa = a->s[scale];
                if (kind == KIND_Q5_0) total += dw * (da * (float)sum - 16.0f * sa);
                else if (kind == KIND_Q8_0) total += dw * (da * (float)sum);
                else total += dw * (da * (float)sum) + half_at((const uint16_t *)(block + at + 2 * t) + n) * sa;
            }
            out[r][n] = total;
        }
#endif
}

/* out[r][n] for the group of `rows` activation rows from row i: with PAIRED its pairs two
 * to a 512-bit vector (dot_group_pairs) and an odd last row alone, else row by row. */
INLINE void dot_group(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                      float out[][GROUP]) {
#if PAIRED
    if (rows >= 2) dot_group_pairs(kind, w, t, a, i, rows, out);
    if (rows % 2) dot_group_rows(kind, w, t, a, i, rows, rows - 1, out);
#else
    dot_group_rows(kind, w, t, a, i, rows, 0, out);
#endif
}

/* ---- K-quants: super-blocks of 256, rows in groups of 8 ------------------------------ */

/* The K-quants' group layout (native/blocks.py's BlockType.segments): these byte ranges
 * of each row's file super-block, each as [words][t][word] (lane n of a vector is row n's word), one
 * after another in the order the products read them (the hardware prefetchers follow one
 * stream). Returns the table, rows {start, end, word}, and its length in `count`. */
INLINE const int (*k_segments(int kind, int *count))[3] {
    static const int q4_k[][3] = {{4, 16, 4}, {0, 2, 2}, {2, 4, 2}, {16, 144, 4}};
    static const int q5_k[][3] = {{4, 16, 4}, {0, 2, 2}, {2, 4, 2}, {16, 48, 4}, {48, 176, 4}};
    /* Q6_K: its scales, its weights 64 at a time as dot_group_k takes them (16 bytes of
     * ql's low half, 16 of its high half, 16 of qh), then d */
    static const int q6_k[][3] = {
        {192, 208, 4}, {0, 16, 4},   {32, 48, 4},   {128, 144, 4}, {16, 32, 4},
        {48, 64, 4},   {144, 160, 4}, {64, 80, 4},  {96, 112, 4},  {160, 176, 4},
        {80, 96, 4},   {112, 128, 4}, {176, 192, 4}, {208, 210, 2}};
    if (kind == KIND_Q4_K) return *count = 4, q4_k;
    if (kind == KIND_Q5_K) return *count = 5, q5_k;
    return *count = 14, q6_k;
}

/* Row n's file super-block (`file`, its 144, 176 or 210 bytes) from a group block of t
 * rows: the layout undone, as the plain-C products read it. */
INLINE void k_file_block(int kind, const uint8_t *block, int t, int n, uint8_t *file) {
    int count;
    const int(*seg)[3] = k_segments(kind, &count);
    int64_t at = 0; /* where the segment starts in the group block */
    for (int j = 0; j < count; j++) {
        const int start = seg[j][0], end = seg[j][1], word = seg[j][2];
        for (int w = 0; w < (end - start) / word; w++)
            memcpy(file + start + w * word, block + at + ((int64_t)w * t + n) * word, (size_t)word);
        at += (int64_t)(end - start) * t;
    }
}

/* The 6-bit scales and mins of a Q4_K/Q5_K super-block's 8 sub-blocks, from its 12 bytes
 * (llama.cpp's get_scale_min_k4). */
INLINE void k_scales(const uint8_t *q, int scale[8], int min[8]) {
    for (int j = 0; j < 4; j++) {
        scale[j] = q[j] & 63, min[j] = q[j + 4] & 63;
        scale[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
        min[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

/* One file super-block (of a Q4_K, Q5_K or Q6_K row) times 256 activations v (scale da,
 * sums of 16 bsums), llama.cpp's arithmetic: the sums are exact integers, scaled once.
 *
 * Q4_K (144 bytes: fp16 d, fp16 dmin, 12 bytes of scales, 128 of nibbles) and Q5_K (176:
 * the same with 32 bytes of fifth bits qh before the nibbles): sub-blocks 2j and 2j + 1
 * are the low and high nibbles of bytes 32j .. 32j + 31; Q5_K's fifth bit of weight
 * 64j + e (e < 32) is bit 2j of qh[e], of 64j + 32 + e bit 2j + 1. The sum is
 * d da Σ_j sc_j Σ u q - dmin da Σ_j m_j (bsums_2j + bsums_2j+1).
 *
 * Q6_K (210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d): each half h of 128
 * weights reads ql[64h ..], qh[32h ..]; for e < 32 weight 128h + e is ql[e] & 15 with qh[e]
 * bits 0-1 on top, 128h + 32 + e ql[32 + e] & 15 with bits 2-3, 128h + 64 + e ql[e] >> 4
 * with bits 4-5, 128h + 96 + e ql[32 + e] >> 4 with bits 6-7; weight i has scale i / 16.
 * The sum is d da (Σ_j sc_j Σ u q - 32 Σ_j sc_j bsums_j). */
INLINE float k_super_dot(int kind, const uint8_t *block, const int8_t *v, const int16_t *bsums,
                         float da) {
    int sum = 0;
    if (kind == KIND_Q6_K) {
        const int8_t *scale = (const int8_t *)(block + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = block + 64 * h, *qh = block + 128 + 32 * h;
            for (int e = 0; e < 32; e++) {
                int u[4] = {(ql[e] & 15) | ((qh[e] & 3) << 4), (ql[32 + e] & 15) | (((qh[e] >> 2) & 3) << 4),
                            (ql[e] >> 4) | (((qh[e] >> 4) & 3) << 4), (ql[32 + e] >> 4) | (((qh[e] >> 6) & 3) << 4)};
                for (int g = 0; g < 4; g++) {
                    const int at = 128 * h + 32 * g + e;
                    sum += scale[at / 16] * u[g] * v[at];
                }
            }
        }
        int offset = 0;
        for (int j = 0; j < 16; j++) offset += scale[j] * bsums[j];
        return half_at((const uint16_t *)(block + 208)) * da * (float)(sum - 32 * offset);
    }
    const int fifth = kind == KIND_Q5_K;
    const uint8_t *qs = block + (fifth ? 48 : 16);
    int scale[8], min[8], mins = 0;
    k_scales(block + 4, scale, min);
    for (int j = 0; j < 4; j++)
        for (int e = 0; e < 32; e++) {
            int u0 = qs[32 * j + e] & 0x0F, u1 = qs[32 * j + e] >> 4;
            if (fifth) {
                u0 |= ((block[16 + e] >> (2 * j)) & 1) << 4;
                u1 |= ((block[16 + e] >> (2 * j + 1)) & 1) << 4;
            }
            sum += scale[2 * j] * u0 * v[64 * j + e] + scale[2 * j + 1] * u1 * v[64 * j + 32 + e];
        }
    for (int j = 0; j < 8; j++) mins += min[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    const float d = half_at((const uint16_t *)block), dmin = half_at((const uint16_t *)(block + 2));
    return d * da * (float)sum - dmin * da * (float)mins;
}

#if defined(__AVX2__)
/* Byte `byte` (0..3) of each 32-bit lane, as int32 lanes: unsigned, or (`sign`) signed. */
INLINE __m256i lane_byte(__m256i words, int byte, int sign) {
    if (sign) return _mm256_srai_epi32(_mm256_slli_epi32(words, 24 - 8 * byte), 24);
    return _mm256_and_si256(_mm256_srli_epi32(words, 8 * byte), _mm256_set1_epi32(0xFF));
}

/* Bytes 2p and 2p + 1 (p 0..1) of each 32-bit lane as its two int16 (unsigned, 0..255). */
INLINE __m256i lane_byte_pair(__m256i words, int p) {
    const __m256i pair = _mm256_srli_epi32(words, 16 * p);
    return _mm256_or_si256(_mm256_and_si256(pair, _mm256_set1_epi32(0xFF)),
                           _mm256_slli_epi32(_mm256_and_si256(pair, _mm256_set1_epi32(0xFF00)), 8));
}

/* The int16 pair (sums[2p], sums[2p + 1]) in every 32-bit lane. */
INLINE __m256i pair_of(const int16_t *sums, int p) {
    int32_t pair;
    memcpy(&pair, sums + 2 * p, sizeof pair);
    return _mm256_set1_epi32(pair);
}

/* Fifth bit `bit` (0..7) of each byte of `qh`, moved to bit 4 (0x10 or 0). */
INLINE __m256i fifth_of(__m256i qh, int bit) {
    const __m256i moved = bit <= 4 ? _mm256_slli_epi16(qh, 4 - bit) : _mm256_srli_epi16(qh, bit - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}
#endif

/* out[r][n] = activation row (i + r) . row n of a group of t rows at `w` (its super-blocks
 * one after another), r < rows, n < t, for a K-quant `kind` (a constant where this is
 * inlined). Per super-block each sub-block's integer sums of 8 rows come from one
 * dot-product instruction per 4 weights, and are scaled by that sub-block's scales (one
 * integer multiply for 8 rows); the super-block's integer sum, exact in int32 as in
 * llama.cpp, is converted and scaled once in each lane. */
#if PAIRED
/* Σ_c u[c] . word c of two activation rows (act_word's: the pair's 8 bytes at `words`,
 * each word `step` bytes after the one before), lane 2n + j row n's against row j's. */
INLINE __m512i pair_dot(const __m512i *u, int n, const int8_t *words, int64_t step) {
    __m512i dot = _mm512_setzero_si512();
    for (int c = 0; c < n; c++) {
        int64_t two;
        memcpy(&two, words + step * c, sizeof two);
        dot = _mm512_dpbusd_epi32(dot, u[c], _mm512_set1_epi64(two));
    }
    return dot;
}

/* A pair's lanes 2n (its first row's) added to `first`, 2n + 1 to `second`. */
INLINE void add_pair_apart(__m512i pair, __m256i *first, __m256i *second) {
    const __m512i apart = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m512i rows = _mm512_permutexvar_epi32(apart, pair);
    *first = _mm256_add_epi32(*first, _mm512_castsi512_si256(rows));
    *second = _mm256_add_epi32(*second, _mm512_extracti64x4_epi64(rows, 1));
}
#endif

/* With PAIRED, a group's pairs of activation rows take the sub-blocks' dot products two rows
 * to a 512-bit vector (its weights' lanes doubled, as dot_group_pairs), an odd last row
 * alone; each row's integer sums of a super-block are the same as one by one (integers:
 * exact in any order), and the floating-point steps after them are the rows' own. */
INLINE void dot_group_k(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                        float out[][GROUP]) {
    const int64_t nb = a->k / SUPER, size = weight_row_bytes(kind, SUPER) * t;
#if defined(__AVX2__)
    const int twos = PAIRED ? rows / 2 : 0; /* pairs of rows */
    __m256 acc[ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = w + b * size;
        __m256i sums[ROWS];
        __m256 d;
#if PAIRED
        __m512i paired[4]; /* rows i + 2p and i + 2p + 1 */
        for (int p = 0; p < twos; p++) paired[p] = _mm512_setzero_si512();
#endif
        if (kind == KIND_Q6_K) { /* scales [4][t][4]; per 64 weights ql [4][t][4] twice, qh [4][t][4]; d [t] */
            const uint8_t *sc = block;
            __m256i scales[4], pairs[8];
            for (int c = 0; c < 4; c++) {
                scales[c] = load_lanes(sc + c * 4 * t, t);
                for (int p = 0; p < 2; p++) /* scales 4c + 2p, 4c + 2p + 1 as int16 in each lane */
                    pairs[2 * c + p] = _mm256_blend_epi16(lane_byte(scales[c], 2 * p, 1),
                                                          _mm256_slli_epi32(lane_byte(scales[c], 2 * p + 1, 1), 16), 0xAA);
            }
            for (int r = 0; r < rows; r++) { /* -32 Σ_j sc_j bsums_j: the weights' offset of 32 */
                const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
                __m256i offset = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) offset = madd_add(offset, pairs[p], pair_of(bsums, p));
                sums[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
            }
            for (int h = 0; h < 2; h++)
                for (int q = 0; q < 2; q++) { /* weights 128h + 32g + 16q .. + 15: sub-block 8h + 2g + q */
                    __m256i u[4][4];
                    /* bytes 16q .. 16q + 15 of ql[64h ..], ql[64h + 32 ..] and qh[32h ..] */
                    const uint8_t *weights = block + (16 + 48 * (2 * h + q)) * t;
                    for (int c = 0; c < 4; c++) {
                        const __m256i l0 = load_lanes(weights + c * 4 * t, t);
                        const __m256i l1 = load_lanes(weights + (16 + c * 4) * t, t);
                        const __m256i top = load_lanes(weights + (32 + c * 4) * t, t), bits2 = _mm256_set1_epi8(0x30);
                        u[0][c] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(top, 4), bits2));
                        u[1][c] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(top, 2), bits2));
                        u[2][c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(top, bits2));
                        u[3][c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                                  _mm256_and_si256(_mm256_srli_epi16(top, 2), bits2));
                    }
#if PAIRED
                    if (twos > 0)
                        for (int g = 0; g < 4; g++) {
                            const int sub = 8 * h + 2 * g + q;
                            const __m512i scale = doubled_lanes(lane_byte(scales[sub / 4], sub % 4, 1));
                            __m512i doubled[4];
                            for (int c = 0; c < 4; c++) doubled[c] = doubled_lanes(u[g][c]);
                            for (int p = 0; p < twos; p++) {
                                const int8_t *words = a->q + act_word(i, rows, 2 * p, b, nb, SUPER, 4 * sub);
                                const __m512i dot = pair_dot(doubled, 4, words, ACT_STEP(rows));
                                paired[p] = _mm512_add_epi32(paired[p], _mm512_mullo_epi32(dot, scale));
                            }
                        }
#endif
                    for (int g = 0; g < 4; g++) {
                        const int sub = 8 * h + 2 * g + q;
                        const __m256i scale = lane_byte(scales[sub / 4], sub % 4, 1);
                        for (int r = 2 * twos; r < rows; r++) {
                            const int8_t *v = a->q + act_word(i, rows, r, b, nb, SUPER, 4 * sub);
                            __m256i dot = _mm256_setzero_si256();
                            for (int c = 0; c < 4; c++) {
                                int32_t four;
                                memcpy(&four, v + ACT_STEP(rows) * c, sizeof four);
                                dot = dot_add(dot, u[g][c], _mm256_set1_epi32(four));
                            }
                            sums[r] = _mm256_add_epi32(sums[r], _mm256_mullo_epi32(dot, scale));
                        }
                    }
                }
            d = load_lane_halves(block + 208 * t, t);
        } else { /* Q4_K, Q5_K: scales [3][t][4], d [t], dmin [t], (Q5_K: qh [8][t][4]), nibbles [32][t][4] */
            const int fifth = kind == KIND_Q5_K;
            const uint8_t *sc = block, *qh = block + 16 * t, *qs = block + (fifth ? 48 : 16) * t;
            const __m256i u0 = load_lanes(sc, t), u1 = load_lanes(sc + 4 * t, t), u2 = load_lanes(sc + 8 * t, t);
            const __m256i low6 = _mm256_set1_epi8(0x3F), top2 = _mm256_set1_epi8(0x03);
            /* k_scales, each lane a row's: scales 0-3, 4-7, mins 0-3, 4-7 as bytes */
            const __m256i scale03 = _mm256_and_si256(u0, low6), min03 = _mm256_and_si256(u1, low6);
            const __m256i scale47 = _mm256_or_si256(_mm256_and_si256(u2, low4),
                                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), top2), 4));
            const __m256i min47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), low4),
                                                  _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), top2), 4));
            const __m256i min_pairs[4] = {lane_byte_pair(min03, 0), lane_byte_pair(min03, 1),
                                          lane_byte_pair(min47, 0), lane_byte_pair(min47, 1)};
            __m256i mins[ROWS];
            for (int r = 0; r < rows; r++) { /* Σ_j m_j (bsums_2j + bsums_2j+1), as int16 pairs */
                const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
                int16_t sub[8];
                for (int j = 0; j < 8; j++) sub[j] = (int16_t)(bsums[2 * j] + bsums[2 * j + 1]);
                mins[r] = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) mins[r] = madd_add(mins[r], min_pairs[p], pair_of(sub, p));
                sums[r] = _mm256_setzero_si256();
            }
            for (int j = 0; j < 4; j++) { /* sub-blocks 2j (low nibbles) and 2j + 1 (high) */
                __m256i lo[8], hi[8];
                for (int c = 0; c < 8; c++) {
                    const __m256i packed = load_lanes(qs + (8 * j + c) * 4 * t, t);
                    lo[c] = _mm256_and_si256(packed, low4);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                    if (fifth) {
                        const __m256i bits = load_lanes(qh + c * 4 * t, t);
                        lo[c] = _mm256_or_si256(lo[c], fifth_of(bits, 2 * j));
                        hi[c] = _mm256_or_si256(hi[c], fifth_of(bits, 2 * j + 1));
                    }
                }
                const __m256i scale_lo = lane_byte(j < 2 ? scale03 : scale47, (2 * j) % 4, 0);
                const __m256i scale_hi = lane_byte(j < 2 ? scale03 : scale47, (2 * j + 1) % 4, 0);
#if PAIRED
                if (twos > 0) {
                    __m512i lo2[8], hi2[8];
                    for (int c = 0; c < 8; c++) lo2[c] = doubled_lanes(lo[c]), hi2[c] = doubled_lanes(hi[c]);
                    const __m512i scale2_lo = doubled_lanes(scale_lo), scale2_hi = doubled_lanes(scale_hi);
                    for (int p = 0; p < twos; p++) {
                        const int8_t *words = a->q + act_word(i, rows, 2 * p, b, nb, SUPER, 16 * j);
                        const int64_t step = ACT_STEP(rows);
                        const __m512i dot_lo = _mm512_mullo_epi32(pair_dot(lo2, 8, words, step), scale2_lo);
                        const __m512i dot_hi = _mm512_mullo_epi32(pair_dot(hi2, 8, words + 8 * step, step), scale2_hi);
                        paired[p] = _mm512_add_epi32(paired[p], _mm512_add_epi32(dot_lo, dot_hi));
                    }
                }
#endif
                for (int r = 2 * twos; r < rows; r++) {
                    const int8_t *v = a->q + act_word(i, rows, r, b, nb, SUPER, 16 * j);
                    __m256i dot_lo = _mm256_setzero_si256(), dot_hi = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c++) {
                        int32_t four[2];
                        memcpy(&four[0], v + ACT_STEP(rows) * c, sizeof four[0]);
                        memcpy(&four[1], v + ACT_STEP(rows) * (8 + c), sizeof four[1]);
                        dot_lo = dot_add(dot_lo, lo[c], _mm256_set1_epi32(four[0]));
                        dot_hi = dot_add(dot_hi, hi[c], _mm256_set1_epi32(four[1]));
                    }
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(_mm256_mullo_epi32(dot_lo, scale_lo),
                                                                         _mm256_mullo_epi32(dot_hi, scale_hi)));
                }
            }
            d = load_lane_halves(block + 12 * t, t);
            const __m256 dmin = load_lane_halves(block + 14 * t, t);
            for (int r = 0; r < rows; r++) {
                const __m256 da = _mm256_set1_ps(a->d[(i + r) * nb + b]);
                acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(mins[r]), acc[r]);
            }
        }
#if PAIRED
        for (int p = 0; p < twos; p++) add_pair_apart(paired[p], &sums[2 * p], &sums[2 * p + 1]);
#endif
        for (int r = 0; r < rows; r++) {
            const __m256 da = _mm256_set1_ps(a->d[(i + r) * nb + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(sums[r]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r], acc[r]);
#else
    uint8_t file[210];
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < t; n++) {
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                k_file_block(kind, w + b * size, t, n, file);
                const int8_t *v = a->q + act_word(i, rows, r, b, nb, SUPER, 0); /* row after row */
                const int16_t *bsums = a->bsums + (i + r) * (a->k / 16) + b * 16;
                total += k_super_dot(kind, file, v, bsums, a->d[(i + r) * nb + b]);
            }
            out[r][n] = total;
        }
#endif
}

/* The AArch64 path (quants_neon.h): NEON with the dot product, SMMLA where the target has
 * i8mm; blocks.c calls it in place of dot_group and dot_group_k. */
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define NEON_DOT 1
#include "quants_neon.h"
#else
#define NEON_DOT 0
#endif

#endif
