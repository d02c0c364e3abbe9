/* The kernels of one build checked against the outputs of the host's plain-C build, bit for
 * bit, with no Python where it runs (a device, or qemu-aarch64 on the host:
 * tests/native/test_aarch64.py builds it, writes the cases and runs it).
 *
 *   check_kernels BLOCKS.so ATTENTION.so CASES THREADS...
 *       every case of the file CASES on each thread count; one line per mismatch, then a
 *       summary; exits 0 only when every output matched.
 *   check_kernels --repeat N BLOCKS.so CASES LABEL ROWS
 *       product LABEL on its first ROWS rows, N times on one thread, unchecked (for
 *       counting the instructions a product executes).
 *
 * A product case (written by tests/native/kernel_cases.py) holds a weight matrix in the
 * kernel's layout, M activation rows and the reference's M output rows; it runs on rows
 * 1..m for every m <= M, and row i must equal the reference's row i exactly whatever m is
 * (the batch-invariance contract). An attention case holds one update_and_attend call:
 * its queries, new K/V rows and KV storage before the call, and the reference's output and
 * storage after it; each run starts from a fresh copy of the storage.
 *
 * The argument structs are mirrored here as the Python bindings mirror them, and their
 * layouts compared with the library's (the *_layout functions) before any call.
 */
#include <dlfcn.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the kernels' argument structs (blocks.c, attention.c) ---------------------------- */

typedef struct matrix {
    const uint8_t *blocks;
    int64_t kind, rows;
    const struct matrix *next;
} matrix;

typedef struct {
    float *h;
    int8_t *q;
    float *d, *s;
    int16_t *sums;
} scratch;

typedef struct {
    const float *x;
    int64_t m, k, ldx;
    matrix w;
    float *y;
    int64_t ldy;
    scratch tmp;
    int64_t threads;
} linear_args;

typedef struct {
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

typedef int (*kernel_call)(const void *);
typedef int64_t (*layout_call)(int64_t *);

/* Whether the library's struct `name` has this size and these field offsets. */
static int same_layout(void *library, const char *name, int64_t size, const int64_t *offsets,
                       int fields) {
    char symbol[64];
    snprintf(symbol, sizeof symbol, "%s_layout", name);
    layout_call layout = (layout_call)dlsym(library, symbol);
    int64_t found[64];
    for (int f = 0; f < 64; f++) found[f] = -1;
    if (!layout) {
        fprintf(stderr, "abi: no %s in the library\n", symbol);
        return 0;
    }
    int64_t their_size = layout(found);
    int same = their_size == size && found[fields] == -1;
    for (int f = 0; f < fields; f++) same = same && found[f] == offsets[f];
    if (!same) fprintf(stderr, "abi: %s differs from its mirror here\n", name);
    return same;
}

#define AT(type, field) (int64_t) offsetof(type, field)
static const int64_t matrix_fields[] = {AT(matrix, blocks), AT(matrix, kind), AT(matrix, rows),
                                        AT(matrix, next)};
static const int64_t scratch_fields[] = {AT(scratch, h), AT(scratch, q), AT(scratch, d),
                                         AT(scratch, s), AT(scratch, sums)};
static const int64_t linear_args_fields[] = {
    AT(linear_args, x), AT(linear_args, m), AT(linear_args, k), AT(linear_args, ldx),
    AT(linear_args, w), AT(linear_args, y), AT(linear_args, ldy), AT(linear_args, tmp),
    AT(linear_args, threads)};
static const int64_t attend_args_fields[] = {
    AT(attend_args, q), AT(attend_args, q_stride), AT(attend_args, k_new),
    AT(attend_args, v_new), AT(attend_args, kv_stride), AT(attend_args, write),
    AT(attend_args, out), AT(attend_args, keys), AT(attend_args, values),
    AT(attend_args, key_scales), AT(attend_args, value_scales), AT(attend_args, keys_step),
    AT(attend_args, values_step), AT(attend_args, key_step_scales),
    AT(attend_args, value_step_scales), AT(attend_args, step_split), AT(attend_args, dtype),
    AT(attend_args, cells), AT(attend_args, key_len), AT(attend_args, seq), AT(attend_args, pos),
    AT(attend_args, n_queries), AT(attend_args, heads), AT(attend_args, kv_heads),
    AT(attend_args, dim), AT(attend_args, window), AT(attend_args, sinks), AT(attend_args, scale),
    AT(attend_args, scratch), AT(attend_args, threads)};
#define SAME_LAYOUT(library, type) \
    same_layout(library, #type, sizeof(type), type##_fields, (int)(sizeof type##_fields / sizeof(int64_t)))

static int abi_matches(void *blocks, void *attention) {
    int ok = SAME_LAYOUT(blocks, matrix) & SAME_LAYOUT(blocks, scratch);
    return ok & SAME_LAYOUT(blocks, linear_args) & SAME_LAYOUT(attention, attend_args);
}

/* ---- the case file ------------------------------------------------------------------------
 * "SSKC", u32 version (1), u32 case count; each case: char kind[4] ("LINR" or "ATTN"), char
 * label[28], u32 array count; each array: char name[32], u64 byte count, the bytes. All
 * little-endian; names and labels NUL-padded. */

#define NAME 32
#define LABEL 28
#define MAX_ARRAYS 32

typedef struct {
    char name[NAME];
    uint64_t bytes;
    void *data; /* NULL when empty */
} array;

typedef struct {
    char kind[5], label[LABEL + 1];
    int count;
    array arrays[MAX_ARRAYS];
} test_case;

static void read_exactly(FILE *file, void *to, size_t bytes) {
    if (fread(to, 1, bytes, file) != bytes) {
        fprintf(stderr, "cases: the file ends early\n");
        exit(2);
    }
}

static int read_case(FILE *file, test_case *c) {
    uint32_t count;
    memset(c, 0, sizeof *c);
    read_exactly(file, c->kind, 4);
    read_exactly(file, c->label, LABEL);
    read_exactly(file, &count, sizeof count);
    if (count > MAX_ARRAYS) return 0;
    c->count = (int)count;
    for (int j = 0; j < c->count; j++) {
        array *a = &c->arrays[j];
        read_exactly(file, a->name, NAME);
        a->name[NAME - 1] = 0;
        read_exactly(file, &a->bytes, sizeof a->bytes);
        if (a->bytes) {
            a->data = aligned_alloc(64, (a->bytes + 63) / 64 * 64);
            read_exactly(file, a->data, a->bytes);
        }
    }
    return 1;
}

static void free_case(test_case *c) {
    for (int j = 0; j < c->count; j++) free(c->arrays[j].data);
}

static const array *find(const test_case *c, const char *name) {
    for (int j = 0; j < c->count; j++)
        if (!strcmp(c->arrays[j].name, name)) return &c->arrays[j];
    fprintf(stderr, "cases: %s has no array %s\n", c->label, name);
    exit(2);
}

static void *data_of(const test_case *c, const char *name) { return find(c, name)->data; }

/* A fresh copy of an array (NULL when empty), for a call that writes it. */
static void *copy_of(const test_case *c, const char *name) {
    const array *a = find(c, name);
    if (!a->bytes) return NULL;
    void *copy = aligned_alloc(64, (a->bytes + 63) / 64 * 64);
    memcpy(copy, a->data, a->bytes);
    return copy;
}

/* ---- the checks ---------------------------------------------------------------------- */

typedef struct {
    kernel_call linear, attend;
    int passed, failed;
} checker;

/* y[m, n] = x[m, k] W^T on `threads` threads, through the scratch the binding would give. */
static int run_linear(const checker *ch, const test_case *c, int64_t m, int64_t threads, float *y) {
    const int64_t *shape = data_of(c, "shape");
    const int64_t n = shape[0], k = shape[1], blocks = (k + 31) / 32;
    int8_t *q = malloc((size_t)(m * blocks * 32));
    float *scales = malloc((size_t)(2 * m * blocks) * sizeof(float));
    int16_t *sums = malloc((size_t)(m * blocks * 2) * sizeof(int16_t));
    linear_args args = {
        .x = data_of(c, "x"), .m = m, .k = k, .ldx = k,
        .w = {data_of(c, "weights"), *(const int64_t *)data_of(c, "kind"), n, NULL},
        .y = y, .ldy = n, .tmp = {NULL, q, scales, scales + m * blocks, sums}, .threads = threads,
    };
    int status = ch->linear(&args);
    free(q), free(scales), free(sums);
    return status;
}

static void check_linear(checker *ch, const test_case *c, const int *threads, int thread_counts) {
    const int64_t *shape = data_of(c, "shape");
    const int64_t n = shape[0], rows = shape[2];
    const float *expected = data_of(c, "y");
    float *y = malloc((size_t)(rows * n) * sizeof(float));
    for (int t = 0; t < thread_counts; t++)
        for (int64_t m = 1; m <= rows; m++) {
            memset(y, 0xFF, (size_t)(m * n) * sizeof(float)); /* NaNs where nothing is written */
            int status = run_linear(ch, c, m, threads[t], y), bad = -1;
            for (int64_t at = 0; status == 0 && at < m * n && bad < 0; at++)
                if (memcmp(&y[at], &expected[at], sizeof(float))) bad = (int)at;
            if (status == 0 && bad < 0) {
                ch->passed++;
                continue;
            }
            ch->failed++;
            if (status) printf("FAIL %s rows=%" PRId64 " threads=%d: refused (%d)\n", c->label, m, threads[t], status);
            else
                printf("FAIL %s rows=%" PRId64 " threads=%d: y[%" PRId64 ", %" PRId64 "] = %.9g, expected %.9g\n",
                       c->label, m, threads[t], bad / n, bad % n, y[bad], expected[bad]);
        }
    free(y);
}

/* The storage arrays an attention call may write, each compared with NAME_after. */
static const char *const STORAGE[] = {"keys", "values", "key_scales", "value_scales",
                                      "keys_step", "values_step", "key_step_scales",
                                      "value_step_scales"};
#define STORAGES (int)(sizeof STORAGE / sizeof *STORAGE)

static void check_attention(checker *ch, const test_case *c, const int *threads, int thread_counts) {
    /* shape: n_queries, heads, kv_heads, dim, window, sinks, key_len, step_split, dtype,
     * q_stride, kv_stride */
    const int64_t *shape = data_of(c, "shape");
    const int64_t n_queries = shape[0], heads = shape[1], kv_heads = shape[2], dim = shape[3];
    const int64_t key_len = shape[6];
    const float *qkv = data_of(c, "qkv"), *expected = data_of(c, "out");
    const array *out_array = find(c, "out");
    for (int t = 0; t < thread_counts; t++) {
        void *storage[STORAGES];
        for (int s = 0; s < STORAGES; s++) storage[s] = copy_of(c, STORAGE[s]);
        float *out = malloc(out_array->bytes);
        float *scores = malloc((size_t)(threads[t] * heads / kv_heads * key_len) * sizeof(float));
        attend_args args = {
            .q = qkv, .q_stride = shape[9], .k_new = qkv + heads * dim,
            .v_new = qkv + (heads + kv_heads) * dim, .kv_stride = shape[10],
            .write = data_of(c, "write"), .out = out,
            .keys = storage[0], .values = storage[1], .key_scales = storage[2],
            .value_scales = storage[3], .keys_step = storage[4], .values_step = storage[5],
            .key_step_scales = storage[6], .value_step_scales = storage[7],
            .step_split = shape[7], .dtype = shape[8], .cells = data_of(c, "cells"),
            .key_len = key_len, .seq = data_of(c, "seq"), .pos = data_of(c, "pos"),
            .n_queries = n_queries, .heads = heads, .kv_heads = kv_heads, .dim = dim,
            .window = shape[4], .sinks = shape[5], .scale = *(const float *)data_of(c, "scale"),
            .scratch = scores, .threads = threads[t],
        };
        int status = ch->attend(&args);
        const char *wrong = status ? "refused" : NULL;
        if (!wrong && memcmp(out, expected, out_array->bytes)) wrong = "out";
        for (int s = 0; s < STORAGES && !wrong; s++) {
            char after[NAME];
            snprintf(after, sizeof after, "%s_after", STORAGE[s]);
            const array *a = find(c, after);
            if (a->bytes && memcmp(storage[s], a->data, a->bytes)) wrong = STORAGE[s];
        }
        if (wrong) {
            ch->failed++;
            printf("FAIL %s threads=%d: %s differs\n", c->label, threads[t], wrong);
            for (int64_t at = 0; !status && at < (int64_t)(out_array->bytes / 4); at++)
                if (memcmp(&out[at], &expected[at], 4)) {
                    printf("  out[%" PRId64 "] = %.9g, expected %.9g\n", at, out[at], expected[at]);
                    break;
                }
        } else {
            ch->passed++;
        }
        for (int s = 0; s < STORAGES; s++) free(storage[s]);
        free(out), free(scores);
    }
}

static void *open_library(const char *path) {
    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    return library;
}

static FILE *open_cases(const char *path, uint32_t *count) {
    FILE *file = fopen(path, "rb");
    char magic[4];
    uint32_t version;
    if (!file) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(2);
    }
    read_exactly(file, magic, 4);
    read_exactly(file, &version, sizeof version);
    read_exactly(file, count, sizeof *count);
    if (memcmp(magic, "SSKC", 4) || version != 1) {
        fprintf(stderr, "%s is not a version 1 case file\n", path);
        exit(2);
    }
    return file;
}

/* --repeat N BLOCKS.so CASES LABEL ROWS */
static int repeat(int argc, char **argv) {
    if (argc != 7) return 2;
    const long times = atol(argv[2]), rows = atol(argv[6]);
    checker ch = {(kernel_call)dlsym(open_library(argv[3]), "linear"), NULL, 0, 0};
    uint32_t count;
    FILE *file = open_cases(argv[4], &count);
    for (uint32_t j = 0; j < count; j++) {
        static test_case c;
        if (!read_case(file, &c)) return 2;
        if (!strcmp(c.kind, "LINR") && !strcmp(c.label, argv[5])) {
            float *y = malloc((size_t)(rows * ((const int64_t *)data_of(&c, "shape"))[0]) * sizeof(float));
            for (long r = 0; r < times; r++)
                if (run_linear(&ch, &c, rows, 1, y)) return 1;
            printf("%s: %ld products of %ld rows\n", c.label, times, rows);
            return 0;
        }
        free_case(&c);
    }
    fprintf(stderr, "no product %s\n", argv[5]);
    return 2;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--repeat")) return repeat(argc, argv);
    if (argc < 5) {
        fprintf(stderr, "usage: %s BLOCKS.so ATTENTION.so CASES THREADS...\n", argv[0]);
        return 2;
    }
    void *blocks = open_library(argv[1]), *attention = open_library(argv[2]);
    if (!abi_matches(blocks, attention)) return 1;
    checker ch = {(kernel_call)dlsym(blocks, "linear"), (kernel_call)dlsym(attention, "update_and_attend"), 0, 0};
    int threads[8], thread_counts = 0;
    for (int j = 4; j < argc && thread_counts < 8; j++) threads[thread_counts++] = atoi(argv[j]);
    uint32_t count;
    FILE *file = open_cases(argv[3], &count);
    for (uint32_t j = 0; j < count; j++) {
        static test_case c;
        if (!read_case(file, &c)) {
            fprintf(stderr, "cases: case %u has too many arrays\n", j);
            return 2;
        }
        if (!strcmp(c.kind, "LINR")) check_linear(&ch, &c, threads, thread_counts);
        else if (!strcmp(c.kind, "ATTN")) check_attention(&ch, &c, threads, thread_counts);
        else {
            fprintf(stderr, "cases: unknown kind %s\n", c.kind);
            return 2;
        }
        free_case(&c);
    }
    fclose(file);
    printf("%d passed, %d failed\n", ch.passed, ch.failed);
    return ch.failed ? 1 : 0;
}
