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
 * Built by slotserve.native (build.py) with -O3 -march=native -fopenmp, bound by
 * slotserve.native.blocks: AVX-512 VNNI or AVX-VNNI
 * dot products where the CPU has them, AVX2 otherwise, plain C elsewhere.
 */
#include <omp.h>

#include "common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32
#define ROWS 4 /* activation rows that share one load of the weights */

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1 };

INLINE int64_t padded_blocks(int64_t k) { return (k / BLOCK + 1) / 2 * 2; }

/* Offset of weight e of block b in pair order. */
INLINE int64_t pair_offset(int64_t b, int e) {
    return (b / 2) * 64 + (e < 16 ? 0 : 32) + (b % 2) * 16 + (e % 16);
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
static void quantize_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
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

/* ---- a transformer layer's work around its attention ------------------------------------ */

/* One matrix: its packed blocks, GGUF type (KIND_*) and output width (rows; its input
 * width is implied by the call). */
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

/* linear: y[m, w.rows] (row stride ldy) = x[m, k] (row stride ldx) . W^T (tmp.h unused). */
typedef struct {
    const float *x;
    int64_t m, k, ldx;
    matrix w;
    float *y;
    int64_t ldy;
    scratch tmp;
    int64_t threads;
} linear_args;

/* layer_in: qkv[m, qkv_w.rows] = rope(rms_norm(x[m, dim]) W_qkv^T); RoPE (rotate-half, as
 * slotserve.model.layers.RopeTables) on the first `rotated` heads of `head_dim`, row t by
 * the step's rows cos[t], sin[t] ([m, head_dim]). */
typedef struct {
    const float *x;
    int64_t m, dim;
    const float *norm;
    float eps;
    matrix qkv_w;
    float *qkv;
    int64_t rotated, head_dim;
    const float *cos, *sin;
    scratch tmp;
    int64_t threads;
} layer_in_args;

/* layer_out: x += attn W_o^T; x += down(silu(gate) * up) of rms_norm(x), in place, where
 * gate_up[m, 2 ffn] = rms_norm(x) W_gate_up^T (the gate rows first). */
typedef struct {
    float *x;
    int64_t m, dim;
    const float *attn;
    int64_t attn_width;
    matrix o_w;
    const float *norm;
    float eps;
    matrix gate_up_w;
    float *gate_up;
    matrix down_w;
    scratch tmp;
    int64_t threads;
} layer_out_args;

/* norm: out[m, dim] = rms_norm(x[m, dim]) * weight, row by row. */
typedef struct {
    const float *x;
    int64_t m, dim;
    const float *weight;
    float eps;
    float *out;
} norm_args;

LAYOUT(norm_args, norm_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(dim) LAYOUT_FIELD(weight) LAYOUT_FIELD(eps)
       LAYOUT_FIELD(out))
LAYOUT(matrix, matrix, LAYOUT_FIELD(blocks) LAYOUT_FIELD(kind) LAYOUT_FIELD(rows))
LAYOUT(scratch, scratch, LAYOUT_FIELD(h) LAYOUT_FIELD(q) LAYOUT_FIELD(d) LAYOUT_FIELD(s))
LAYOUT(linear_args, linear_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(k) LAYOUT_FIELD(ldx) LAYOUT_FIELD(w)
       LAYOUT_FIELD(y) LAYOUT_FIELD(ldy) LAYOUT_FIELD(tmp) LAYOUT_FIELD(threads))
LAYOUT(layer_in_args, layer_in_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(dim) LAYOUT_FIELD(norm) LAYOUT_FIELD(eps)
       LAYOUT_FIELD(qkv_w) LAYOUT_FIELD(qkv) LAYOUT_FIELD(rotated) LAYOUT_FIELD(head_dim)
       LAYOUT_FIELD(cos) LAYOUT_FIELD(sin) LAYOUT_FIELD(tmp) LAYOUT_FIELD(threads))
LAYOUT(layer_out_args, layer_out_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(dim) LAYOUT_FIELD(attn)
       LAYOUT_FIELD(attn_width) LAYOUT_FIELD(o_w) LAYOUT_FIELD(norm) LAYOUT_FIELD(eps)
       LAYOUT_FIELD(gate_up_w) LAYOUT_FIELD(gate_up) LAYOUT_FIELD(down_w) LAYOUT_FIELD(tmp)
       LAYOUT_FIELD(threads))

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

/* x[m, k] (row stride ldx) times W into y (row stride ldy; accumulating or not), through
 * the activations' int8 blocks. */
static int project(const float *x, int64_t m, int64_t k, int64_t ldx, const matrix *w,
                   float *y, int64_t ldy, int accumulate, const scratch *tmp, int64_t threads) {
    quantize_q8(x, m, k, ldx, tmp->q, tmp->d, tmp->s);
    return multiply((int)w->kind, w->blocks, w->rows, k, tmp->q, tmp->d, tmp->s, m, y, ldy,
                    accumulate, (int)threads);
}

int norm(const norm_args *a) {
    rms_norm_rows(a->x, a->m, a->dim, a->weight, a->eps, a->out);
    return 0;
}

/* Returns 0, or -1 for arguments it cannot take (k not a multiple of 32, an unknown type):
 * then y is unwritten. */
int linear(const linear_args *a) {
    return project(a->x, a->m, a->k, a->ldx, &a->w, a->y, a->ldy, 0, &a->tmp, a->threads);
}

int layer_in(const layer_in_args *a) {
    const int64_t m = a->m, dim = a->dim, head_dim = a->head_dim, width = a->qkv_w.rows;
    rms_norm_rows(a->x, m, dim, a->norm, a->eps, a->tmp.h);
    if (project(a->tmp.h, m, dim, dim, &a->qkv_w, a->qkv, width, 0, &a->tmp, a->threads))
        return -1;
    int64_t half = head_dim / 2;
    for (int64_t t = 0; t < m; t++) {
        const float *c = a->cos + t * head_dim, *sn = a->sin + t * head_dim;
        for (int64_t head = 0; head < a->rotated; head++) {
            float *v = a->qkv + t * width + head * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float x = v[i], y = v[i + half];
                v[i] = x * c[i] - y * sn[i];
                v[i + half] = y * c[i + half] + x * sn[i + half];
            }
        }
    }
    return 0;
}

int layer_out(const layer_out_args *a) {
    const int64_t m = a->m, dim = a->dim, ffn = a->gate_up_w.rows / 2;
    const scratch *tmp = &a->tmp;
    if (project(a->attn, m, a->attn_width, a->attn_width, &a->o_w, a->x, dim, 1, tmp,
                a->threads))
        return -1;
    rms_norm_rows(a->x, m, dim, a->norm, a->eps, tmp->h);
    if (project(tmp->h, m, dim, dim, &a->gate_up_w, a->gate_up, 2 * ffn, 0, tmp, a->threads))
        return -1;
    for (int64_t t = 0; t < m; t++) {
        const float *gate = a->gate_up + t * 2 * ffn, *up = gate + ffn;
        float *out = tmp->h + t * ffn;
#pragma omp simd
        for (int64_t j = 0; j < ffn; j++) out[j] = silu(gate[j]) * up[j];
    }
    return project(tmp->h, m, ffn, ffn, &a->down_w, a->x, dim, 1, tmp, a->threads);
}
