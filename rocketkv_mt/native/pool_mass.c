/* The window mass of a pool of sketched cold tokens, from their logits, in one pass per row.
 *
 * rocketkv_mt.cold_select.page_picks scores every sketched token of a pool by the softmax mass the
 * window rows put on it. In torch that is six passes over the (rows x pool) logits (shift, clamp, exp,
 * row sums, weights, column sums); here each row's exponentials are computed once into a scratch row
 * that stays in cache, summed, and added to the pool's mass with the row's weight.
 *
 * Shapes: Hkv KV heads, R window rows per head (a chunk of them), m pool slots.
 *   logits   (Hkv, R, m) float32 or bfloat16 (is_bf16), each row's q.k * scaling; rows contiguous,
 *            heads row_stride rows apart (row_stride >= R: the rows of a padded product)
 *   alive    (Hkv, m) uint8: 0 where a slot holds no cold token
 *   lse_dev  (Hkv, R) float32: each row's log-sum-exp over the device's keys
 *   lse_out  (Hkv, R) float32: each row's log-sum-exp over the device's keys and the pool's alive slots
 *   mass     (Hkv, m) float32, added to: sum over the rows of exp(logit - lse_out) at alive slots
 * Exponents are taken relative to lse_dev and clamped to [floor_, cap]: a share below exp(floor_)
 * ranks nothing, and one above exp(cap) (a cold token outweighing the whole device that many times)
 * stays finite.
 * Returns 0, or -1 when the scratch row could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int rkv_pool_mass(const void *logits, int64_t is_bf16, int64_t row_stride, const uint8_t *alive, const float *lse_dev,
                  float *lse_out, float *mass, int64_t hkv, int64_t rows, int64_t m, float floor_, float cap) {
    float *share = malloc((size_t)(m > 0 ? m : 1) * sizeof(float));
    if (share == NULL) return -1;
    for (int64_t h = 0; h < hkv; h++) {
        const uint8_t *live = alive + h * m;
        float *col = mass + h * m;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t at = h * rows + r, from = (h * row_stride + r) * m;
            const float shift = lse_dev[at];
            float sum = 0.f;
            if (is_bf16) {
                const uint16_t *row = (const uint16_t *)logits + from;
                for (int64_t j = 0; j < m; j++) {
                    float x = bf16_to_float(row[j]) - shift;
                    x = x < floor_ ? floor_ : (x > cap ? cap : x);
                    const float e = live[j] ? expf(x) : 0.f;
                    share[j] = e;
                    sum += e;
                }
            } else {
                const float *row = (const float *)logits + from;
                for (int64_t j = 0; j < m; j++) {
                    float x = row[j] - shift;
                    x = x < floor_ ? floor_ : (x > cap ? cap : x);
                    const float e = live[j] ? expf(x) : 0.f;
                    share[j] = e;
                    sum += e;
                }
            }
            /* Relative to the device's normaliser the row's total is 1 + sum. */
            const float lse = shift + log1pf(sum);
            const float weight = 1.f / (1.f + sum);
            lse_out[at] = lse;
            for (int64_t j = 0; j < m; j++) col[j] += weight * share[j];
        }
    }
    free(share);
    return 0;
}
