/* Linear layers on a GGUF file's own weight blocks, y[m, n] = x[m, :] . W[n, :], and a
 * transformer layer's work around its attention in two calls (layer_in, layer_out).
 *
 * The arithmetic of each weight type (Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) is in
 * quants.h: the activations are quantised the way llama.cpp quantises them for that type,
 * and each block's product is an exact integer dot product scaled once, so the results
 * follow llama.cpp's outputs (only the fp32 accumulation order differs).
 *
 * A matrix may be a chain of parts in different types (a fused Q/K/V whose V rows are
 * Q8_0 and Q/K rows Q5_0, as llama.cpp's Q4_K_M mixes them); each part's rows land in
 * their columns of y, and activations are quantised once per format in a row.
 *
 * The products split their output columns over `threads` OpenMP threads, and each output
 * is computed by one thread in one order whatever the batch: a row's result never depends
 * on the rows beside it or on the thread count. Loaded into a process that has imported
 * torch, the library binds to torch's own OpenMP runtime (libgomp.so.1 is loaded already),
 * so the two share one set of worker threads instead of spinning against each other.
 *
 * Built by slotserve.native (build.py) with -O3 -march=native -fopenmp, bound by
 * slotserve.native.blocks: AVX-512 VNNI or AVX-VNNI dot products where the CPU has them,
 * AVX2 otherwise; on AArch64 the NEON dot product, with i8mm where the target has it
 * (quants_neon.h); plain C elsewhere (docs/KERNELS.md).
 */
#include <omp.h>

#include "common.h"
#include "quants.h"

/* ---- the product ------------------------------------------------------------------------ */

typedef struct {
    int64_t kind;
    int accumulate;
    const uint8_t *w;
    int64_t n, m, ldy;
    acts a;
    float *y;
} product;

/* Outputs n .. n + t - 1 of row i (t <= 8, a constant where this is inlined). */
INLINE void put_lanes(const product *p, int64_t i, int64_t n, int t, const float *value) {
    float *y = p->y + i * p->ldy + n;
#pragma omp simd
    for (int c = 0; c < t; c++) y[c] = p->accumulate ? y[c] + value[c] : value[c];
}

/* Any type's group of t rows: the K-quants' dot or the others' (`kind` is a constant
 * where this is inlined, so the choice is made at compile time), on AArch64 with the dot
 * product their NEON forms (quants_neon.h). */
INLINE void dot_any_group(int kind, const uint8_t *w, int t, const acts *a, int64_t i, int rows,
                          float out[][GROUP]) {
#if NEON_DOT
    if (kind == KIND_Q4_K || kind == KIND_Q5_K || kind == KIND_Q6_K) neon_dot_group_k(kind, w, t, a, i, rows, out);
    else neon_dot_group(kind, w, t, a, i, rows, out);
#else
    if (kind == KIND_Q4_K || kind == KIND_Q5_K || kind == KIND_Q6_K) dot_group_k(kind, w, t, a, i, rows, out);
    else dot_group(kind, w, t, a, i, rows, out);
#endif
}

#define GROUP_TAIL(rows) case rows: dot_any_group(kind, w, t, &p->a, whole, rows, out); break;
#if ROWS == 8
#define WIDE_GROUP_TAILS GROUP_TAIL(7) GROUP_TAIL(6) GROUP_TAIL(5) GROUP_TAIL(4)
#else
#define WIDE_GROUP_TAILS
#endif

/* Every activation row times the group of t rows at `w` (columns n ..): in groups of ROWS,
 * then the 1 .. ROWS - 1 rows left over in one group of their own, so that a step of 2 or
 * 3 rows decodes the weights once, as one of 1 row does (each count is a constant in its
 * own call, so the dot's loops over rows unroll). */
INLINE void group_rows(int kind, const product *p, const uint8_t *w, int t, int64_t n) {
    const int64_t whole = p->m / ROWS * ROWS;
    const int tail = (int)(p->m - whole);
    float out[ROWS][GROUP];
    for (int64_t i = 0; i < whole; i += ROWS) {
        dot_any_group(kind, w, t, &p->a, i, ROWS, out);
        for (int r = 0; r < ROWS; r++) put_lanes(p, i + r, n, t, out[r]);
    }
    switch (tail) {
    WIDE_GROUP_TAILS
    GROUP_TAIL(3)
    GROUP_TAIL(2)
    GROUP_TAIL(1)
    default: break;
    }
    for (int r = 0; r < tail; r++) put_lanes(p, whole + r, n, t, out[r]);
}

/* Columns first .. last (first a multiple of GROUP) of a product. Whole groups take the
 * size as a constant (their loads and offsets compile for it); only the last group of a
 * matrix may have fewer rows. A group's bytes are read in one forward stream, which the
 * hardware prefetchers follow: prefetching the next group's lines ahead (as rows one by
 * one needed) made products slower, for a large head and a small projection alike
 * (docs/BENCHMARKS.md). */
INLINE void groups(int kind, const product *p, int64_t first, int64_t last) {
    const int64_t row_bytes = weight_row_bytes(kind, p->a.k);
    for (int64_t n = first; n < last; n += GROUP) {
        const uint8_t *w = p->w + n * row_bytes;
        if (p->n - n >= GROUP) group_rows(kind, p, w, GROUP, n);
        else group_rows(kind, p, w, (int)(p->n - n), n);
    }
}

static void product_part(const product *p, int part, int parts) {
    /* Columns in runs of 16: whole cache lines of y, whole groups of GROUP rows. */
    int64_t runs = (p->n + 15) / 16;
    int64_t first = runs * part / parts * 16, last = runs * (part + 1) / parts * 16;
    if (last > p->n) last = p->n;
    switch (p->kind) {
    case KIND_Q4_1: groups(KIND_Q4_1, p, first, last); break;
    case KIND_Q8_0: groups(KIND_Q8_0, p, first, last); break;
    case KIND_Q5_0: groups(KIND_Q5_0, p, first, last); break;
    case KIND_Q5_1: groups(KIND_Q5_1, p, first, last); break;
    case KIND_Q4_K: groups(KIND_Q4_K, p, first, last); break;
    case KIND_Q5_K: groups(KIND_Q5_K, p, first, last); break;
    default: groups(KIND_Q6_K, p, first, last); break;
    }
}

/* ---- a transformer layer's work around its attention ------------------------------------ */

/* One matrix: its blocks (rows in groups of 8: quants.h), GGUF type (KIND_*)
 * and output width (rows; its input width is implied by the call); `next`, if not NULL,
 * the rows after these, in another type. */
typedef struct matrix {
    const uint8_t *blocks;
    int64_t kind, rows;
    const struct matrix *next;
} matrix;

/* Scratch for a step of m rows: h[m, widest] fp32; q[m, widest] int8; d and s
 * [m, widest / 32]; sums[m, widest / 16] int16. */
typedef struct {
    float *h;
    int8_t *q;
    float *d, *s;
    int16_t *sums;
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

/* layer_in: qkv[m, qkv_w.rows] = rope(head_norm(rms_norm(x[m, dim]) W_qkv^T)); with q_norm
 * and k_norm (not NULL), each of the first q_heads heads is RMS-normed by q_norm[head_dim]
 * and each of the next (rotated - q_heads) by k_norm first. RoPE (rotate-half, as
 * slotserve.model.layers.RopeTables) turns the first `rotated` heads of `head_dim`, row t
 * by the step's rows cos[t], sin[t] ([m, head_dim]). */
typedef struct {
    const float *x;
    int64_t m, dim;
    const float *norm;
    float eps;
    matrix qkv_w;
    float *qkv;
    int64_t rotated, head_dim;
    const float *cos, *sin;
    const float *q_norm, *k_norm;
    int64_t q_heads;
    scratch tmp;
    int64_t threads;
} layer_in_args;

/* layer_out: x += post_attn(attn W_o^T); x += post_ffn(down(act(gate) * up)) of
 * rms_norm(x), in place, where gate_up[m, 2 ffn] = rms_norm(x) W_gate_up^T (the gate
 * rows first), act is SiLU (gelu = 0) or GELU's tanh form (gelu = 1), and post_attn,
 * post_ffn are RMSNorms by those weights where they are not NULL (Gemma's norms after
 * each block), the identity otherwise. */
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
    const float *post_attn_norm, *post_ffn_norm;
    int64_t gelu;
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

/* attention.c's arguments and function: a layer's attention is the KV pool's, in another
 * library, which a step's stack calls by address without opening its arguments. */
struct attend_args;
typedef int (*attend_function)(const struct attend_args *);

/* A step's layers in one call (layer_stack): each layer's three calls' arguments, set for
 * the step (the attention's out is the rows layer_out reads as attn). */
typedef struct {
    int64_t layers;
    const layer_in_args *const *ins;
    const struct attend_args *const *attends;
    const layer_out_args *const *outs;
    attend_function attend;
} stack_args;

LAYOUT(stack_args, stack_args,
       LAYOUT_FIELD(layers) LAYOUT_FIELD(ins) LAYOUT_FIELD(attends) LAYOUT_FIELD(outs)
       LAYOUT_FIELD(attend))
LAYOUT(norm_args, norm_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(dim) LAYOUT_FIELD(weight) LAYOUT_FIELD(eps)
       LAYOUT_FIELD(out))
LAYOUT(matrix, matrix, LAYOUT_FIELD(blocks) LAYOUT_FIELD(kind) LAYOUT_FIELD(rows) LAYOUT_FIELD(next))
LAYOUT(scratch, scratch,
       LAYOUT_FIELD(h) LAYOUT_FIELD(q) LAYOUT_FIELD(d) LAYOUT_FIELD(s) LAYOUT_FIELD(sums))
LAYOUT(linear_args, linear_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(k) LAYOUT_FIELD(ldx) LAYOUT_FIELD(w)
       LAYOUT_FIELD(y) LAYOUT_FIELD(ldy) LAYOUT_FIELD(tmp) LAYOUT_FIELD(threads))
LAYOUT(layer_in_args, layer_in_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(dim) LAYOUT_FIELD(norm) LAYOUT_FIELD(eps)
       LAYOUT_FIELD(qkv_w) LAYOUT_FIELD(qkv) LAYOUT_FIELD(rotated) LAYOUT_FIELD(head_dim)
       LAYOUT_FIELD(cos) LAYOUT_FIELD(sin) LAYOUT_FIELD(q_norm) LAYOUT_FIELD(k_norm)
       LAYOUT_FIELD(q_heads) LAYOUT_FIELD(tmp) LAYOUT_FIELD(threads))
LAYOUT(layer_out_args, layer_out_args,
       LAYOUT_FIELD(x) LAYOUT_FIELD(m) LAYOUT_FIELD(dim) LAYOUT_FIELD(attn)
       LAYOUT_FIELD(attn_width) LAYOUT_FIELD(o_w) LAYOUT_FIELD(norm) LAYOUT_FIELD(eps)
       LAYOUT_FIELD(gate_up_w) LAYOUT_FIELD(gate_up) LAYOUT_FIELD(down_w)
       LAYOUT_FIELD(post_attn_norm) LAYOUT_FIELD(post_ffn_norm) LAYOUT_FIELD(gelu)
       LAYOUT_FIELD(tmp) LAYOUT_FIELD(threads))

/* x[m, k] (row stride ldx) times W (each part of its chain into its columns of y, row
 * stride ldy; accumulating or not), through the activations' int8 blocks. Returns -1 for a
 * type it does not take or a width that is not whole blocks of it (then y is unwritten). */
static int project(const float *x, int64_t m, int64_t k, int64_t ldx, const matrix *w,
                   float *y, int64_t ldy, int accumulate, const scratch *tmp, int64_t threads) {
    for (const matrix *part = w; part; part = part->next) {
        int format = act_format(part->kind);
        if (format < 0 || part->rows <= 0 || k % (format == ACT_Q8_K ? SUPER : BLOCK)) return -1;
    }
    if (m <= 0) return -1;
    acts a = {0};
    int quantized = -1;
    int64_t column = 0;
    for (const matrix *part = w; part; column += part->rows, part = part->next) {
        int format = act_format(part->kind);
        if (format != quantized) { /* once for a run of parts in one format */
            if (format == ACT_Q8_K) quantize_q8_k(x, m, k, ldx, tmp->q, tmp->d, tmp->sums, &a);
            else quantize_q8(x, m, k, ldx, tmp->q, tmp->d, tmp->s, &a);
            quantized = format;
        }
        product p = {part->kind, accumulate, part->blocks, part->rows, m, ldy, a, y + column};
        /* a handoff costs about a microsecond: worth it from ~100k multiply-adds */
        int parts = part->rows * m * k < (1 << 17) || threads < 1 ? 1 : (int)threads;
#pragma omp parallel num_threads(parts)
        product_part(&p, omp_get_thread_num(), omp_get_num_threads());
    }
    return 0;
}

INLINE int64_t total_rows(const matrix *w) {
    int64_t rows = 0;
    for (; w; w = w->next) rows += w->rows;
    return rows;
}

/* x * sigmoid(x), with the exponential of -|x| only (no overflow either way). */
INLINE float silu(float x) {
    float t = exp_nonpositive(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f : t) / (1.0f + t);
}

/* GELU's tanh form, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with tanh(u) =
 * sign(u) (1 - e^-2|u|) / (1 + e^-2|u|). */
INLINE float gelu_tanh(float x) {
    float u = 0.7978845608f * (x + 0.044715f * x * x * x);
    float t = exp_nonpositive(-2.0f * fabsf(u)), magnitude = (1.0f - t) / (1.0f + t);
    return 0.5f * x * (1.0f + (u >= 0.0f ? magnitude : -magnitude));
}

/* out[i, :] = rms_norm(x[i, :]) * weight (row strides ldx, ldo), or with `add`, out += it. */
static void rms_norm_rows(const float *x, int64_t m, int64_t dim, int64_t ldx, const float *weight,
                          float eps, float *out, int64_t ldo, int add) {
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * ldx;
        float *dst = out + i * ldo;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < dim; j++) sum += row[j] * row[j];
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        if (add) {
#pragma omp simd
            for (int64_t j = 0; j < dim; j++) dst[j] += row[j] * scale * weight[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < dim; j++) dst[j] = row[j] * scale * weight[j];
        }
    }
}

int norm(const norm_args *a) {
    rms_norm_rows(a->x, a->m, a->dim, a->dim, a->weight, a->eps, a->out, a->dim, 0);
    return 0;
}

/* Returns 0, or -1 for arguments it cannot take (a width that is not whole blocks of the
 * type, an unknown type): then y is unwritten. */
int linear(const linear_args *a) {
    return project(a->x, a->m, a->k, a->ldx, &a->w, a->y, a->ldy, 0, &a->tmp, a->threads);
}

int layer_in(const layer_in_args *a) {
    const int64_t m = a->m, dim = a->dim, head_dim = a->head_dim, width = total_rows(&a->qkv_w);
    rms_norm_rows(a->x, m, dim, dim, a->norm, a->eps, a->tmp.h, dim, 0);
    if (project(a->tmp.h, m, dim, dim, &a->qkv_w, a->qkv, width, 0, &a->tmp, a->threads))
        return -1;
    if (a->q_norm && a->k_norm) /* per head, in place: each row is read before it is written */
        for (int64_t t = 0; t < m; t++)
            for (int64_t head = 0; head < a->rotated; head++) {
                float *v = a->qkv + t * width + head * head_dim;
                rms_norm_rows(v, 1, head_dim, head_dim, head < a->q_heads ? a->q_norm : a->k_norm,
                              a->eps, v, head_dim, 0);
            }
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
    const int64_t m = a->m, dim = a->dim, ffn = total_rows(&a->gate_up_w) / 2;
    const scratch *tmp = &a->tmp;
    if (a->post_attn_norm) { /* x += norm(attn W_o^T) */
        if (project(a->attn, m, a->attn_width, a->attn_width, &a->o_w, tmp->h, dim, 0, tmp, a->threads))
            return -1;
        rms_norm_rows(tmp->h, m, dim, dim, a->post_attn_norm, a->eps, a->x, dim, 1);
    } else if (project(a->attn, m, a->attn_width, a->attn_width, &a->o_w, a->x, dim, 1, tmp, a->threads)) {
        return -1;
    }
    rms_norm_rows(a->x, m, dim, dim, a->norm, a->eps, tmp->h, dim, 0);
    if (project(tmp->h, m, dim, dim, &a->gate_up_w, a->gate_up, 2 * ffn, 0, tmp, a->threads))
        return -1;
    for (int64_t t = 0; t < m; t++) {
        const float *gate = a->gate_up + t * 2 * ffn, *up = gate + ffn;
        float *out = tmp->h + t * ffn;
        if (a->gelu) {
#pragma omp simd
            for (int64_t j = 0; j < ffn; j++) out[j] = gelu_tanh(gate[j]) * up[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < ffn; j++) out[j] = silu(gate[j]) * up[j];
        }
    }
    if (!a->post_ffn_norm) return project(tmp->h, m, ffn, ffn, &a->down_w, a->x, dim, 1, tmp, a->threads);
    /* gate_up's rows are free now and at least dim wide: down's rows go there first */
    if (project(tmp->h, m, ffn, ffn, &a->down_w, a->gate_up, 2 * ffn, 0, tmp, a->threads))
        return -1;
    rms_norm_rows(a->gate_up, m, dim, 2 * ffn, a->post_ffn_norm, a->eps, a->x, dim, 1);
    return 0;
}

/* Every layer of a step in turn: layer_in, its attention, layer_out, the calls a step
 * makes one by one from Python, in the same order on the same arguments (so the same
 * results), without the interpreter between them, which runs with caches the weights have
 * just flushed. Returns 0, or -(3 l + c + 1) where call c of layer l
 * (0: layer_in, 1: the attention, 2: layer_out) refused its arguments; the layers before
 * it have run. */
int layer_stack(const stack_args *a) {
    for (int64_t l = 0; l < a->layers; l++) {
        if (layer_in(a->ins[l])) return (int)(-3 * l - 1);
        if (a->attend(a->attends[l])) return (int)(-3 * l - 2);
        if (layer_out(a->outs[l])) return (int)(-3 * l - 3);
    }
    return 0;
}
