/* What every slotserve kernel shares: the inline attribute, fp16/bf16 reads, the
 * vectorisable exponential, and the ABI check.
 *
 * Each kernel takes one argument struct, mirrored field for field by a ctypes.Structure
 * in its Python binding (slotserve.native.*). LAYOUT(...) exports a struct's size and its
 * fields' offsets so a test can compare both sides: a field added on one side only fails
 * that test instead of corrupting a call.
 */
#ifndef SLOTSERVE_COMMON_H
#define SLOTSERVE_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* fp16 bits at p as fp32. */
INLINE float half_at(const uint16_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* bf16 bits as fp32 (exact: the high half of an fp32). */
INLINE float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* e^x's range reduction and polynomial for x of type T: a float, or a vector of floats
 * (GCC's vector extension), each lane taking the same operations in the same order.
 * Declares n, x / ln2 rounded to a whole number (adding 1.5 * 2^23 rounds), and p, e^r
 * for r = x - n ln2 (ln2 split in two parts) by its degree-6 Taylor polynomial. */
#define EXP_STEPS(T, x, n, p)                                                               \
    const T n = ((x) * 1.44269504089f + 12582912.0f) - 12582912.0f;                         \
    const T p##_r = (x) - n * 0.693145751953f - n * 1.42860682e-6f;                         \
    T p = p##_r * (1.0f / 720) + 1.0f / 120;                                                \
    p = p * p##_r + 1.0f / 24;                                                              \
    p = p * p##_r + 1.0f / 6;                                                               \
    p = p * p##_r + 0.5f;                                                                   \
    p = p * p##_r + 1.0f;                                                                   \
    p = p * p##_r + 1.0f

/* e^x for x <= 0, to about 2 ulp: `EXP_STEPS`, then 2^n through the exponent bits. Unlike
 * libm's expf it vectorises. The softmax (attention.c, also on eight lanes) and SiLU
 * (blocks.c) both use it. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    EXP_STEPS(float, x, n, p);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* `int64_t NAME_layout(int64_t *offsets)`: writes the offset of each listed field of TYPE,
 * in order, and returns sizeof(TYPE). */
#define LAYOUT_FIELD(field) offsets[n++] = (int64_t)offsetof(layout_type, field);
#define LAYOUT(name, type, ...)                                                              \
    int64_t name##_layout(int64_t *offsets) {                                                \
        typedef type layout_type;                                                            \
        int n = 0;                                                                           \
        __VA_ARGS__                                                                          \
        return (int64_t)sizeof(type);                                                        \
    }

#endif
