/* A layer's KV write and attention for one step, in the pool's cells, in place.
 *
 * First each new K/V row t is stored at cell write[t] (converted to the storage dtype, as
 * slotserve.kv.storage.KVStorage.write does). Then one query row t belongs to sequence seq[t] at position pos[t]; the keys it sees are that
 * sequence's positions lo..pos[t] (lo = pos[t] - window + 1 with a window, else 0), found
 * at cells[seq[t] * key_len + j]. No gather, no padding, no mask: each query reads exactly
 * the cells it attends to, once per KV head for all the query heads that share it (GQA).
 * Scores, softmax and the weighted sum are in fp32, whatever the storage dtype. Built by
 * slotserve.native (build.py) with -O3 -march=native -fopenmp; bound by native/attention.py.
 */
#include <omp.h>

#include "common.h"
#ifdef __F16C__
#include <immintrin.h>
#endif
/* The AArch64 path (attention_neon.h), built with the block products' (quants.h). */
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define NEON_ATTENTION 1
#include "attention_neon.h"
#else
#define NEON_ATTENTION 0
#endif

enum { KV_FP32 = 0, KV_FP16 = 1, KV_BF16 = 2, KV_INT8 = 3 };

/* Where K (or V) rows live: the pool's storage, and a step buffer of the same dtype that
 * cells from `split` on name (cell c at row c - split; split < 0: no step buffer). */
typedef struct {
    void *data, *step;
    float *scales, *step_scales;
    int64_t split;
} rows_at;

/* The storage holding `*cell`, whose index becomes the row within it. */
INLINE void *locate(const rows_at *at, int64_t *cell, float **scales) {
    if (at->split >= 0 && *cell >= at->split) {
        *cell -= at->split;
        *scales = at->step_scales;
        return at->step;
    }
    *scales = at->scales;
    return at->data;
}

/* Row `cell`, head `g` of a [n_cells, kv_heads, dim] storage, as fp32: in place for fp32,
 * else converted into `row`. */
INLINE const float *load_row(const rows_at *at, int plain, int dtype, int64_t cell, int64_t g,
                             int64_t kv_heads, int64_t dim, float *row) {
    float *scales = at->scales;
    const void *data = plain ? at->data : locate(at, &cell, &scales);
    int64_t offset = (cell * kv_heads + g) * dim;
    switch (dtype) {
    case KV_FP32:
        return (const float *)data + offset;
    case KV_FP16: {
        const uint16_t *src = (const uint16_t *)data + offset;
        int64_t d = 0;
#ifdef __F16C__ /* eight at a time in hardware; gcc would convert one by one in software */
        for (; d + 8 <= dim; d += 8)
            _mm256_storeu_ps(row + d, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(src + d))));
#elif NEON_ATTENTION
        for (; d + 8 <= dim; d += 8) neon_halves_to_floats(src + d, row + d);
#endif
        for (; d < dim; d++) row[d] = (float)((const _Float16 *)src)[d];
        break;
    }
    case KV_BF16: {
        const uint16_t *src = (const uint16_t *)data + offset;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) row[d] = bf16_to_float(src[d]);
        break;
    }
    default: { /* KV_INT8: one fp32 scale per (cell, head) */
        const int8_t *src = (const int8_t *)data + offset;
        float scale = scales[cell * kv_heads + g];
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) row[d] = (float)src[d] * scale;
        break;
    }
    }
    return row;
}

/* Rows are requested this many keys ahead of their use: in a step the weights streamed
 * between layers have evicted the pool from the caches, and the hardware prefetcher does
 * not follow cell indices (measured: the first pass over a layer's KV took twice the
 * second). */
#define AHEAD 8

INLINE void prefetch_row(const rows_at *at, int plain, int dtype, int64_t cell, int64_t g,
                         int64_t kv_heads, int64_t dim) {
    static const int64_t bytes[] = {4, 2, 2, 1};
    float *scales;
    const void *data = plain ? at->data : locate(at, &cell, &scales);
    const char *start = (const char *)data + (cell * kv_heads + g) * dim * bytes[dtype];
    for (int64_t at = 0; at < dim * bytes[dtype]; at += 64) __builtin_prefetch(start + at);
}

/* Store the fp32 row `src` at row `cell`, head `g`, converting to the storage dtype with
 * torch's rounding: to nearest even (fp16, bf16), int8 symmetric with amax / 127 scales. */
INLINE void store_row(const rows_at *at, int dtype, int64_t cell, int64_t g,
                      int64_t kv_heads, int64_t dim, const float *src) {
    float *scales;
    void *data = locate(at, &cell, &scales);
    int64_t offset = (cell * kv_heads + g) * dim;
    switch (dtype) {
    case KV_FP32:
        memcpy((float *)data + offset, src, (size_t)dim * sizeof(float));
        break;
    case KV_FP16: {
        _Float16 *dst = (_Float16 *)data + offset;
        for (int64_t d = 0; d < dim; d++) dst[d] = (_Float16)src[d];
        break;
    }
    case KV_BF16: {
        uint16_t *dst = (uint16_t *)data + offset;
        for (int64_t d = 0; d < dim; d++) {
            uint32_t bits;
            memcpy(&bits, &src[d], sizeof bits);
            if ((bits & 0x7fffffffu) > 0x7f800000u) dst[d] = 0x7fc0; /* NaN, as torch writes it */
            else dst[d] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        }
        break;
    }
    default: { /* KV_INT8 */
        float amax = 0.0f;
        for (int64_t d = 0; d < dim; d++) amax = fabsf(src[d]) > amax ? fabsf(src[d]) : amax;
        float scale = (amax > 1e-8f ? amax : 1e-8f) / 127.0f;
        int8_t *dst = (int8_t *)data + offset;
        for (int64_t d = 0; d < dim; d++) {
            float value = nearbyintf(src[d] / scale);
            dst[d] = (int8_t)(value > 127.0f ? 127.0f : value < -127.0f ? -127.0f : value);
        }
        scales[cell * kv_heads + g] = scale;
        break;
    }
    }
}

/* Eight lanes (GCC's vector extension: AVX registers where the CPU has them), two
 * accumulators, and the lanes added as a tree in registers: plain loops (or an `omp simd`
 * reduction) had the compiler add the lanes one by one through the stack, the hottest
 * instructions of the kernel. */
typedef float lanes8 __attribute__((vector_size(32)));
typedef int32_t index8 __attribute__((vector_size(32)));

INLINE lanes8 load8(const float *from) {
    lanes8 value;
    memcpy(&value, from, sizeof value);
    return value;
}

INLINE float dot(const float *a, const float *b, int64_t dim) {
#if NEON_ATTENTION
    return neon_dot(a, b, dim);
#else
    lanes8 even = {0}, odd = {0};
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
        even += load8(a + d) * load8(b + d);
        odd += load8(a + d + 8) * load8(b + d + 8);
    }
    even += odd;
    even += __builtin_shuffle(even, (index8){4, 5, 6, 7, 0, 1, 2, 3});
    even += __builtin_shuffle(even, (index8){2, 3, 0, 1, 6, 7, 4, 5});
    even += __builtin_shuffle(even, (index8){1, 0, 3, 2, 5, 4, 7, 6});
    float sum = even[0];
    for (; d < dim; d++) sum += a[d] * b[d];
    return sum;
#endif
}

#if !NEON_ATTENTION
/* exp_nonpositive on eight lanes, its steps (`EXP_STEPS`) in its order on each lane, so
 * each lane is the float exp_nonpositive gives: a loop calling it stays scalar. */
INLINE lanes8 exp_nonpositive8(lanes8 x) {
    const lanes8 least = (lanes8){0} - 87.0f;
    const index8 below = x < least; /* -1 where x < -87: x = x < -87 ? -87 : x */
    x = (lanes8)((below & (index8)least) | (~below & (index8)x));
    EXP_STEPS(lanes8, x, n, p);
    const index8 bits = (__builtin_convertvector(n, index8) + 127) << 23;
    return p * (lanes8)bits;
}

/* The softmax's e^((s[j] - best) * scale) in place, eight at a time, and their sum added
 * one by one in position order (as neon_exp_scores adds them). */
INLINE float exp_scores(float *s, int64_t span, float best, float scale) {
    float total = 0.0f;
    int64_t j = 0;
    for (; j + 8 <= span; j += 8) {
        const lanes8 e = exp_nonpositive8((load8(s + j) - best) * scale);
        memcpy(s + j, &e, sizeof e);
        for (int lane = 0; lane < 8; lane++) total += e[lane];
    }
    for (; j < span; j++) {
        s[j] = exp_nonpositive((s[j] - best) * scale);
        total += s[j];
    }
    return total;
}
#endif

/* One query row's heads that share KV head g (`group` of them, at qg) over the keys at
 * positions 0..n_sink-1 and lo..hi (their cells: cells[position]): scores, softmax,
 * weighted values into og, each in position order. `scores` holds group * span. `plain`
 * (a constant where this is inlined): no sinks and no step buffer, so no test per key; the
 * arithmetic is the same either way. */
INLINE void attend_group(const float *qg, float *og, const rows_at *keys,
                         const rows_at *values, int plain, int dtype,
                         const int64_t *cells, int64_t n_sink, int64_t lo, int64_t hi, int64_t g,
                         int64_t group, int64_t kv_heads, int64_t dim, float scale,
                         float *scores, float *row) {
    const int64_t span = n_sink + hi - lo + 1;
#define CELL(j) cells[plain ? lo + (j) : (j) < n_sink ? (j) : lo + (j) - n_sink]
    float best[group];
    for (int64_t r = 0; r < group; r++) best[r] = -INFINITY;
    for (int64_t j = 0; j < span; j++) {
        if (j + AHEAD < span) prefetch_row(keys, plain, dtype, CELL(j + AHEAD), g, kv_heads, dim);
        const float *k = load_row(keys, plain, dtype, CELL(j), g, kv_heads, dim, row);
        for (int64_t r = 0; r < group; r++) {
            float score = dot(qg + r * dim, k, dim);
            scores[r * span + j] = score;
            best[r] = score > best[r] ? score : best[r];
        }
    }
    for (int64_t r = 0; r < group; r++) {
        float *s = scores + r * span, total = 0.0f;
#if NEON_ATTENTION
        total = neon_exp_scores(s, span, best[r], scale);
#else
        total = exp_scores(s, span, best[r], scale);
#endif
        float inverse = 1.0f / total;
        for (int64_t j = 0; j < span; j++) s[j] *= inverse;
        memset(og + r * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t j = 0; j < span; j++) {
        if (j + AHEAD < span)
            prefetch_row(values, plain, dtype, CELL(j + AHEAD), g, kv_heads, dim);
        const float *v = load_row(values, plain, dtype, CELL(j), g, kv_heads, dim, row);
        for (int64_t r = 0; r < group; r++) {
            float *o = og + r * dim, p = scores[r * span + j];
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) o[d] += p * v[d];
        }
    }
}
#undef CELL

/* One call's arguments (mirrored by slotserve.native.attention.AttendArgs).
 * q: [n_queries, heads, dim] and k_new, v_new: [n_queries, kv_heads, dim], fp32, each row
 * `q_stride` / `kv_stride` floats after the last (views into one fused projection need no
 * copy). write: [n_queries] cells for the new rows. out: [n_queries, heads, dim].
 * keys, values: [n_cells, kv_heads, dim] of `dtype` (key_scales, value_scales:
 * [n_cells, kv_heads] for KV_INT8, else unused). With step_split >= 0, cells from it on
 * name rows of keys_step / values_step (and their scales), the step's own rows in the same
 * dtype (`rows_at`). cells: [n_seqs, key_len]. scratch:
 * heads / kv_heads * key_len floats for each of `threads`. (Tagged: blocks.c's layer_stack
 * calls update_and_attend by address, with a pointer to this struct it never opens.) */
typedef struct attend_args {
    const float *q;
    int64_t q_stride;
    const float *k_new, *v_new;
    int64_t kv_stride;
    const int64_t *write;
    float *out;
    void *keys, *values;
    float *key_scales, *value_scales;
    void *keys_step, *values_step;
    float *key_step_scales, *value_step_scales;
    int64_t step_split;
    int64_t dtype;
    const int64_t *cells;
    int64_t key_len;
    const int64_t *seq, *pos;
    int64_t n_queries, heads, kv_heads, dim, window, sinks;
    float scale;
    float *scratch;
    int64_t threads;
} attend_args;

LAYOUT(attend_args, attend_args,
       LAYOUT_FIELD(q) LAYOUT_FIELD(q_stride) LAYOUT_FIELD(k_new) LAYOUT_FIELD(v_new)
       LAYOUT_FIELD(kv_stride) LAYOUT_FIELD(write) LAYOUT_FIELD(out) LAYOUT_FIELD(keys)
       LAYOUT_FIELD(values) LAYOUT_FIELD(key_scales) LAYOUT_FIELD(value_scales)
       LAYOUT_FIELD(keys_step) LAYOUT_FIELD(values_step) LAYOUT_FIELD(key_step_scales)
       LAYOUT_FIELD(value_step_scales) LAYOUT_FIELD(step_split)
       LAYOUT_FIELD(dtype) LAYOUT_FIELD(cells) LAYOUT_FIELD(key_len) LAYOUT_FIELD(seq)
       LAYOUT_FIELD(pos) LAYOUT_FIELD(n_queries) LAYOUT_FIELD(heads) LAYOUT_FIELD(kv_heads)
       LAYOUT_FIELD(dim) LAYOUT_FIELD(window) LAYOUT_FIELD(sinks) LAYOUT_FIELD(scale) LAYOUT_FIELD(scratch)
       LAYOUT_FIELD(threads))

/* Returns 0, or -1 when an argument is out of range (then nothing is written).
 *
 * The (query, KV head) pairs are shared out over `threads` OpenMP threads when there is
 * enough to share (torch's own threads: see blocks.c). */
int update_and_attend(const attend_args *a) {
    const float *q = a->q, *k_new = a->k_new, *v_new = a->v_new, scale = a->scale;
    const int64_t q_stride = a->q_stride, kv_stride = a->kv_stride, key_len = a->key_len;
    const int64_t *write = a->write, *cells = a->cells, *seq = a->seq, *pos = a->pos;
    const int64_t n_queries = a->n_queries, heads = a->heads, kv_heads = a->kv_heads;
    const int64_t dim = a->dim, window = a->window, sinks = a->sinks, threads = a->threads;
    const int dtype = (int)a->dtype;
    float *out = a->out, *scratch = a->scratch;
    const rows_at keys_at = {a->keys, a->keys_step, a->key_scales, a->key_step_scales,
                             a->step_split};
    const rows_at values_at = {a->values, a->values_step, a->value_scales,
                               a->value_step_scales, a->step_split};
    const rows_at *keys = &keys_at, *values = &values_at;
    if (kv_heads < 1 || heads % kv_heads || dim < 1 || dim > 1024 || dtype < 0 || dtype > 3)
        return -1;
    int64_t keys_read = 0;
    for (int64_t t = 0; t < n_queries; t++) {
        if (pos[t] < 0 || pos[t] >= key_len || seq[t] < 0 || write[t] < 0) return -1;
        keys_read += pos[t] + 1;
    }
    for (int64_t t = 0; t < n_queries; t++)
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t at = t * kv_stride + g * dim;
            store_row(keys, dtype, write[t], g, kv_heads, dim, k_new + at);
            store_row(values, dtype, write[t], g, kv_heads, dim, v_new + at);
        }
    const int64_t group = heads / kv_heads;
    /* A handoff costs about a microsecond: share from ~50k multiply-adds. */
    int parts = keys_read * heads * dim < (1 << 16) || threads < 1 ? 1 : (int)threads;
#pragma omp parallel num_threads(parts)
    {
        float row[dim];
        float *scores = scratch + omp_get_thread_num() * group * key_len;
#pragma omp for schedule(dynamic)
        for (int64_t pair = 0; pair < n_queries * kv_heads; pair++) {
            const int64_t t = pair / kv_heads, g = pair % kv_heads;
            /* A window keeps the last `window` positions, and `sinks` first ones forever. */
            int64_t lo = window > 0 && pos[t] - window + 1 > 0 ? pos[t] - window + 1 : 0;
            const int64_t n_sink = lo > sinks ? sinks : lo;
            const int64_t *row_cells = cells + seq[t] * key_len;
            const float *qg = q + t * q_stride + g * group * dim;
            float *og = out + (t * heads + g * group) * dim;
            /* Constant dtypes (and the common head size) per call site, so that each case
             * compiles its own loops, unrolled where the size is known. */
#define ATTEND(code, size)                                                                   \
    attend_group(qg, og, keys, values, plain, code, row_cells, n_sink, lo,                     \
                 pos[t], g, group, kv_heads, size, scale, scores, row)
#define BY_DTYPE(size)                                                                       \
    switch (dtype) {                                                                         \
    case KV_FP32: ATTEND(KV_FP32, size); break;                                              \
    case KV_FP16: ATTEND(KV_FP16, size); break;                                              \
    case KV_BF16: ATTEND(KV_BF16, size); break;                                              \
    default: ATTEND(KV_INT8, size); break;                                                   \
    }
            if (n_sink == 0 && a->step_split < 0 && dim == 64) {
                const int plain = 1;
                BY_DTYPE(64)
            } else if (n_sink == 0 && a->step_split < 0) {
                const int plain = 1;
                BY_DTYPE(dim)
            } else {
                const int plain = 0;
                BY_DTYPE(dim)
            }
#undef BY_DTYPE
#undef ATTEND
        }
    }
    return 0;
}
