/* Linear layers on a GGUF file's Q4_1 and Q8_0 weights, kept in 4.5 or 8.5 bits per
 * weight: y[m, n] = x[m, :] . W[n, :].
 *
 * The activations are first quantised like llama.cpp's Q8_1 blocks (`quantize_q8`): each
 * run of 32 values becomes 32 int8 `q` with a scale `d = amax / 127` and `s = d * sum(q)`.
 * A block's product is then an integer dot product of 32 pairs, scaled once:
 *   Q4_1 (w = dw * u + mw, u in 0..15):  dw * da * sum(u * q) + mw * s
 *   Q8_0 (w = dw * v, v int8):           dw * da * sum(v * q)
 * which is llama.cpp's arithmetic for these types, so the results follow its outputs (the
 * sums of 32 products are exact; only the fp32 accumulation order differs).
 *
 * Packed rows (slotserve.model.gguf_linear.pack makes them from the file's blocks, once):
 * a row of nb blocks is padded with a zero block to an even count P, and blocks go in
 * pairs, so that one 256-bit load holds two blocks' weights and each 8-lane dot product
 * holds two blocks' sums (lanes 0-3 the first, 4-7 the second):
 *   Q4_1 row: P x 16 bytes of nibbles (a block's bytes as GGUF has them: weight j in the
 *             low nibble of byte j, weight j + 16 in its high nibble), P fp16 dw, P fp16 mw
 *   Q8_0 row: P / 2 x 64 int8 in pair order, P fp16 dw
 * Pair order, for blocks b0 b1: b0[0:16] b1[0:16] b0[16:32] b1[16:32]. Activations are
 * quantised into pair order too (q[m, P * 32], d and s [m, P]).
 *
 * The products split their output columns over `threads` OpenMP threads. Loaded into a
 * process that has imported torch, the library binds to torch's own OpenMP runtime
 * (libgomp.so.1 is loaded already), so the two share one set of worker threads instead of
 * spinning against each other on the same cores.
 *
 * Built by slotserve.model.gguf_linear with -O3 -march=native -fopenmp: AVX-512 VNNI or AVX-VNNI
 * dot products where the CPU has them, AVX2 otherwise, plain C elsewhere.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
#define BLOCK 32
#define ROWS 4 /* activation rows that share one load of the weights */

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1 };

INLINE int64_t padded_blocks(int64_t k) { return (k / BLOCK + 1) / 2 * 2; }

/* Offset of weight e of block b in pair order. */
INLINE int64_t pair_offset(int64_t b, int e) {
    return (b / 2) * 64 + (e < 16 ? 0 : 32) + (b % 2) * 16 + (e % 16);
}

INLINE float half_at(const uint16_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* ---- activations -------------------------------------------------------------------- */

/* One block's 32 values as int8 (rounded to nearest even) at `low` (values 0..15) and
 * `high` (16..31); returns the sum of the int8 values. */
INLINE int quantize_block(const float *src, float inverse, int8_t *low, int8_t *high) {
#if defined(__AVX2__)
    __m256i n[4];
    __m256 by = _mm256_set1_ps(inverse);
    for (int j = 0; j < 4; j++)
        n[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * j), by),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    /* packs interleave the 128-bit lanes; the permute puts values 0..31 back in order */
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)low, _mm256_castsi256_si128(bytes));
    _mm_storeu_si128((__m128i *)high, _mm256_extracti128_si256(bytes, 1));
    return _mm_cvtsi128_si32(s4);
#else
    int sum = 0;
    for (int j = 0; j < 16; j++) {
        int a = (int)nearbyintf(src[j] * inverse), c = (int)nearbyintf(src[j + 16] * inverse);
        low[j] = (int8_t)a, high[j] = (int8_t)c;
        sum += a + c;
    }
    return sum;
#endif
}

/* x[m, k] (row stride ldx floats) -> q[m, P * 32] int8 in pair order, d and s [m, P]. */
void quantize_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                 float *s) {
    int64_t nb = k / BLOCK, np = padded_blocks(k);
    for (int64_t i = 0; i < m; i++) {
        int8_t *row = q + i * np * BLOCK;
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + i * ldx + b * BLOCK;
            float amax = 0.0f;
#pragma omp simd reduction(max : amax)
            for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(src[j]));
            float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
            int sum = quantize_block(src, inverse, row + pair_offset(b, 0), row + pair_offset(b, 16));
            d[i * np + b] = scale;
            s[i * np + b] = scale * (float)sum;
        }
        if (np > nb) { /* the padding block */
            memset(row + pair_offset(nb, 0), 0, 16);
            memset(row + pair_offset(nb, 16), 0, 16);
            d[i * np + nb] = s[i * np + nb] = 0.0f;
        }
    }
}

/* ---- one weight row against up to ROWS activation rows -------------------------------- */

typedef struct {
    const int8_t *q; /* [m, P * 32] */
    const float *d, *s; /* [m, P] */
    int64_t np;
} acts;

#if defined(__AVX2__)
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

#if defined(__AVX2__)
/* acc[r][slot] += the products of the pair of blocks from `first` (lane j of scales[r]
 * holds block b + j's dw * da, `lane` that of `first`). */
INLINE void pair_dot(int kind, const uint8_t *w, const acts *a, int64_t i, int rows,
                     int64_t first, const __m256 *scales, int lane, __m256 acc[][2], int slot) {
    __m256i u0, u1, w0 = _mm256_setzero_si256(), w1 = _mm256_setzero_si256();
    if (kind == KIND_Q4_1) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        __m256i packed = _mm256_loadu_si256((const __m256i *)(w + first * 16));
        u0 = _mm256_and_si256(packed, low);
        u1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    } else { /* |w| as unsigned; its sign moves to the activations */
        w0 = _mm256_loadu_si256((const __m256i *)(w + first * 32));
        w1 = _mm256_loadu_si256((const __m256i *)(w + first * 32 + 32));
        u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
    }
    /* lanes 0-3 take the pair's first block's scale, 4-7 the second's */
    __m256i spread = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(lane));
    for (int r = 0; r < rows; r++) {
        const int8_t *v = a->q + ((i + r) * a->np + first) * BLOCK;
        __m256i v0 = _mm256_loadu_si256((const __m256i *)v);
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(v + 32));
        if (kind == KIND_Q8_0) v0 = _mm256_sign_epi8(v0, w0), v1 = _mm256_sign_epi8(v1, w1);
        __m256i sums = dot_add(dot_add(_mm256_setzero_si256(), u0, v0), u1, v1);
        __m256 scale = _mm256_permutevar8x32_ps(scales[r], spread);
        acc[r][slot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][slot]);
    }
}
#endif

/* out[r] = packed W row `w` . activation row (i + r), r < rows. `rows` and `kind` are
 * constants where this is inlined, so the loops over r unroll. */
INLINE void row_dot(int kind, const uint8_t *w, const acts *a, int64_t i, int rows, float *out) {
    int64_t np = a->np;
    const uint16_t *dw = (const uint16_t *)(w + np * (kind == KIND_Q4_1 ? 16 : 32));
    const uint16_t *mw = dw + np;
#if defined(__AVX2__)
    __m256 acc[ROWS][2], offsets[ROWS];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = offsets[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < np; b += 8) { /* 8 blocks (4 pairs) share one scale vector */
        int64_t count = np - b < 8 ? np - b : 8;
        __m256 weight_scales = load_halves(dw + b, count), scales[ROWS];
        __m256 weight_mins = kind == KIND_Q4_1 ? load_halves(mw + b, count) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            scales[r] = _mm256_mul_ps(weight_scales, load_floats(a->d + (i + r) * np + b, count));
            if (kind == KIND_Q4_1)
                offsets[r] = _mm256_fmadd_ps(weight_mins, load_floats(a->s + (i + r) * np + b, count), offsets[r]);
        }
        /* Two pairs a turn into two accumulators: one fma chain would wait on itself. */
        for (int64_t pair = 0; pair < count / 2; pair += 2) {
            pair_dot(kind, w, a, i, rows, b + 2 * pair, scales, 2 * (int)pair, acc, 0);
            if (pair + 1 < count / 2)
                pair_dot(kind, w, a, i, rows, b + 2 * pair + 2, scales, 2 * (int)pair + 2, acc, 1);
        }
    }
    for (int r = 0; r < rows; r++)
        out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + hsum(offsets[r]);
#else
    for (int r = 0; r < rows; r++) {
        const int8_t *v = a->q + (i + r) * np * BLOCK;
        float total = 0.0f;
        for (int64_t b = 0; b < np; b++) {
            int sum = 0;
            for (int e = 0; e < BLOCK; e++) {
                int u;
                if (kind == KIND_Q4_1) {
                    uint8_t byte = w[b * 16 + e % 16];
                    u = e < 16 ? (byte & 0x0F) : (byte >> 4);
                } else {
                    u = (int8_t)w[pair_offset(b, e)];
                }
                sum += u * v[pair_offset(b, e)];
            }
            float da = a->d[(i + r) * np + b];
            total += half_at(dw + b) * da * (float)sum;
            if (kind == KIND_Q4_1) total += half_at(mw + b) * a->s[(i + r) * np + b];
        }
        out[r] = total;
    }
#endif
}

/* ---- the product ------------------------------------------------------------------------ */

typedef struct {
    int kind, accumulate;
    const uint8_t *w;
    int64_t n, m, ldy;
    acts a;
    float *y;
} product;

INLINE void put(const product *p, int64_t i, int64_t n, float value) {
    float *y = p->y + i * p->ldy + n;
    *y = p->accumulate ? *y + value : value;
}

static void product_part(const product *p, int part, int parts) {
    /* Columns in runs of 16, so that a part's rows are whole cache lines of y. */
    int64_t runs = (p->n + 15) / 16;
    int64_t first = runs * part / parts * 16, last = runs * (part + 1) / parts * 16;
    if (last > p->n) last = p->n;
    int64_t row_bytes = p->a.np * (p->kind == KIND_Q4_1 ? 20 : 34);
    float out[ROWS];
    for (int64_t n = first; n < last; n++) {
        const uint8_t *w = p->w + n * row_bytes;
        int64_t i = 0;
        for (; i + ROWS <= p->m; i += ROWS) {
            if (p->kind == KIND_Q4_1) row_dot(KIND_Q4_1, w, &p->a, i, ROWS, out);
            else row_dot(KIND_Q8_0, w, &p->a, i, ROWS, out);
            for (int r = 0; r < ROWS; r++) put(p, i + r, n, out[r]);
        }
        int rest = (int)(p->m - i);
        for (int r = 0; r < rest; r++) { /* one row at a time: 1..3 left over */
            if (p->kind == KIND_Q4_1) row_dot(KIND_Q4_1, w, &p->a, i + r, 1, out);
            else row_dot(KIND_Q8_0, w, &p->a, i + r, 1, out);
            put(p, i + r, n, out[0]);
        }
    }
}

static int multiply(int kind, const uint8_t *w, int64_t n, int64_t k, const int8_t *q,
                    const float *d, const float *s, int64_t m, float *y, int64_t ldy,
                    int accumulate, int threads) {
    if (k % BLOCK != 0 || (kind != KIND_Q4_1 && kind != KIND_Q8_0) || n <= 0 || m <= 0)
        return -1;
    product p = {kind, accumulate, w, n, m, ldy, {q, d, s, padded_blocks(k)}, y};
    /* a handoff costs about a microsecond: worth it from ~100k multiply-adds */
    int parts = n * m * k < (1 << 17) || threads < 1 ? 1 : threads;
#pragma omp parallel num_threads(parts)
    product_part(&p, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* y[m, n] (row stride ldy) = activations (quantize_q8 of x[m, k]) times W[n, k]^T, W in
 * `kind` blocks. Returns 0, or -1 for arguments it cannot take (k not a multiple of 32). */
int gemm(int kind, const uint8_t *w, int64_t n, int64_t k, const int8_t *q, const float *d,
         const float *s, int64_t m, float *y, int64_t ldy, int threads) {
    return multiply(kind, w, n, k, q, d, s, m, y, ldy, 0, threads);
}

/* ---- a transformer layer's work around its attention ------------------------------------ */

/* One matrix of a layer: its blocks, type and output width (its input width is implied). */
typedef struct {
    const uint8_t *blocks;
    int64_t kind, rows;
} matrix;

/* Scratch for a step of m rows: h[m, widest], q[m, widest], d and s[m, widest / 32]. */
typedef struct {
    float *h;
    int8_t *q;
    float *d, *s;
} scratch;

/* e^x for x <= 0 (to ~1e-7 relative): round x / ln 2 to n, a degree-6 Taylor polynomial of
 * the rest, 2^n through the exponent bits. Unlike libm's expf it vectorises. (The KV
 * kernel's softmax uses the same one.) */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504089f + round) - round;
    float r = x - n * 0.693145751953f - n * 1.42860682e-6f; /* ln2 split in two parts */
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* x * sigmoid(x), with the exponential of -|x| only (no overflow either way). */
INLINE float silu(float x) {
    float t = exp_nonpositive(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f : t) / (1.0f + t);
}

static void rms_norm_rows(const float *x, int64_t m, int64_t dim, const float *weight,
                          float eps, float *out) {
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < dim; j++) sum += row[j] * row[j];
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) out[i * dim + j] = row[j] * scale * weight[j];
    }
}

/* x[m, k] times W into y (accumulating or not), through the activations' int8 blocks. */
static int project(const float *x, int64_t m, int64_t k, const matrix *w, float *y,
                   int accumulate, const scratch *tmp, int threads) {
    quantize_q8(x, m, k, k, tmp->q, tmp->d, tmp->s);
    return multiply((int)w->kind, w->blocks, w->rows, k, tmp->q, tmp->d, tmp->s, m, y, w->rows,
                    accumulate, threads);
}

/* Before the attention: qkv[m, qkv.rows] = rms_norm(x) W_qkv^T, then RoPE (rotate-half,
 * as slotserve.model.layers.RopeTables) on its first `rotated` heads of `head_dim`, row t
 * at position pos[t] of the cos/sin tables [positions, head_dim]. */
int layer_in(const float *x, int64_t m, int64_t dim, const float *norm, float eps,
             const matrix *qkv_w, float *qkv, int64_t rotated, int64_t head_dim,
             const float *cos, const float *sin, const int64_t *pos, const scratch *tmp,
             int threads) {
    rms_norm_rows(x, m, dim, norm, eps, tmp->h);
    if (project(tmp->h, m, dim, qkv_w, qkv, 0, tmp, threads) != 0) return -1;
    int64_t half = head_dim / 2;
    for (int64_t t = 0; t < m; t++) {
        const float *c = cos + pos[t] * head_dim, *sn = sin + pos[t] * head_dim;
        for (int64_t head = 0; head < rotated; head++) {
            float *v = qkv + t * qkv_w->rows + head * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * sn[i];
                v[i + half] = b * c[i + half] + a * sn[i + half];
            }
        }
    }
    return 0;
}

/* After the attention: x += attn W_o^T; x += down(silu(gate) * up) of rms_norm(x), where
 * gate_up[m, 2 ffn] = rms_norm(x) W_gate_up^T (the gate rows first). */
int layer_out(float *x, int64_t m, int64_t dim, const float *attn, int64_t attn_width,
              const matrix *o_w, const float *norm, float eps, const matrix *gate_up_w,
              float *gate_up, const matrix *down_w, const scratch *tmp, int threads) {
    if (project(attn, m, attn_width, o_w, x, 1, tmp, threads) != 0) return -1;
    rms_norm_rows(x, m, dim, norm, eps, tmp->h);
    if (project(tmp->h, m, dim, gate_up_w, gate_up, 0, tmp, threads) != 0) return -1;
    int64_t ffn = gate_up_w->rows / 2;
    for (int64_t t = 0; t < m; t++) {
        const float *gate = gate_up + t * 2 * ffn, *up = gate + ffn;
        float *out = tmp->h + t * ffn;
#pragma omp simd
        for (int64_t j = 0; j < ffn; j++) out[j] = silu(gate[j]) * up[j];
    }
    return project(tmp->h, m, ffn, down_w, x, 1, tmp, threads);
}
