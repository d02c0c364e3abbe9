/* The AArch64 path of the attention (attention.c), on NEON: the query-key dot, the
 * softmax's exponentials four at a time, and fp16 rows converted eight at a time. Built
 * with the block products' AArch64 path (NEON_ATTENTION, the dot-product level: see
 * docs/KERNELS.md), though it needs only ARMv8-A's NEON; the rest of the kernel (the
 * weighted sum, bf16 and int8 rows) the compiler vectorises for NEON from the plain loops.
 *
 * The same operations in the same order as the plain C, lane by lane: the dot's lanes are
 * added as attention.c's `dot` adds them, exp_nonpositive's steps are the scalar ones, and
 * the softmax's sum adds the exponentials one by one in position order, as the plain-C
 * build does; so every output has the plain-C path's bits (tests/native/test_aarch64.py).
 */
#ifndef SLOTSERVE_ATTENTION_NEON_H
#define SLOTSERVE_ATTENTION_NEON_H

#include <arm_neon.h>

/* attention.c's `dot`: two accumulators of eight lanes (here each two registers of four),
 * then lane i + lane i + 4, i + i + 2, i + i + 1, then the tail in order. */
INLINE float neon_dot(const float *a, const float *b, int64_t dim) {
    float32x4_t even[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}, odd[2] = {even[0], even[0]};
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16)
        for (int h = 0; h < 2; h++) {
            even[h] = vaddq_f32(even[h], vmulq_f32(vld1q_f32(a + d + 4 * h), vld1q_f32(b + d + 4 * h)));
            odd[h] = vaddq_f32(odd[h], vmulq_f32(vld1q_f32(a + d + 8 + 4 * h), vld1q_f32(b + d + 8 + 4 * h)));
        }
    const float32x4_t four = vaddq_f32(vaddq_f32(even[0], odd[0]), vaddq_f32(even[1], odd[1]));
    const float32x2_t two = vadd_f32(vget_low_f32(four), vget_high_f32(four));
    float sum = vget_lane_f32(two, 0) + vget_lane_f32(two, 1);
    for (; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

/* exp_nonpositive in four lanes, its steps in its order. */
INLINE float32x4_t neon_exp_nonpositive(float32x4_t x) {
    const float32x4_t floor = vdupq_n_f32(-87.0f), round = vdupq_n_f32(12582912.0f);
    x = vbslq_f32(vcltq_f32(x, floor), floor, x);
    const float32x4_t n = vsubq_f32(vaddq_f32(vmulq_n_f32(x, 1.44269504089f), round), round);
    const float32x4_t r = vsubq_f32(vsubq_f32(x, vmulq_n_f32(n, 0.693145751953f)), vmulq_n_f32(n, 1.42860682e-6f));
    const float coefficients[] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    float32x4_t p = vdupq_n_f32(1.0f / 720);
    for (int c = 0; c < 6; c++) p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(coefficients[c]));
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(bits));
}

/* s[j] = e^((s[j] - best) scale) for j < span; returns their sum, added in order of j. */
INLINE float neon_exp_scores(float *s, int64_t span, float best, float scale) {
    float total = 0.0f;
    int64_t j = 0;
    for (; j + 4 <= span; j += 4) {
        const float32x4_t e = neon_exp_nonpositive(vmulq_n_f32(vsubq_f32(vld1q_f32(s + j), vdupq_n_f32(best)), scale));
        vst1q_f32(s + j, e);
        total += vgetq_lane_f32(e, 0);
        total += vgetq_lane_f32(e, 1);
        total += vgetq_lane_f32(e, 2);
        total += vgetq_lane_f32(e, 3);
    }
    for (; j < span; j++) {
        s[j] = exp_nonpositive((s[j] - best) * scale);
        total += s[j];
    }
    return total;
}

/* Eight fp16 at src as fp32 at row (exact). */
INLINE void neon_halves_to_floats(const uint16_t *src, float *row) {
    const float16x8_t halves = vreinterpretq_f16_u16(vld1q_u16(src));
    vst1q_f32(row, vcvt_f32_f16(vget_low_f16(halves)));
    vst1q_f32(row + 4, vcvt_high_f32_f16(halves));
}

#endif
