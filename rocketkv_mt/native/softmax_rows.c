/* Softmax numerators of a block of attention logits, in place, one pass per row.
 *
 * rocketkv_mt.split_attention.attend_part turns each row of its logits into exp(logit - row max),
 * keeping the max and the row's sum (its log-sum-exp merges parts). In torch that is four passes
 * (max, subtract, exp, sum), and on this project's CPU torch's exp of float32 runs at about a
 * nanosecond an element; here each row is read once for its max and once for exp and sum, with
 * the compiler's vectorised expf.
 *
 * Shapes: rows x n float32, rows contiguous (row r at x + r * n).
 *   x    overwritten: exp(max(x - top, FLOOR)) (0 where x is -inf; the torch path's exp(x - top)
 *        differs only where that is below exp(FLOOR), 1.8e-35)
 *   top  (rows) each row's max over its finite logits; 0 for a row with none (so exp(-inf - 0) = 0)
 *   sum  (rows) each row's sum of exp(x - top)
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

/* Logits are finite or -inf (hidden). The library is compiled with fast math, which may assume no
 * infinities, so -inf is only ever compared against a finite threshold. The vectorised expf computes
 * every lane before the select, and one lane far below its fast range (-inf, or a logit 87 below
 * the max) sends the whole vector down a slow path: a tenth of 3 x 3 x 26 x 1216 logits hidden took
 * 0.78 ms against 0.24 ms with none. So every argument is clamped at -80 first (a select on the
 * hidden flag alone would not do: the compiler drops it, its value being unused where the flag is
 * set); exp(-80) is 1.8e-35, below a float's resolution of a row's sum, which is at least 1. */
#define HIDDEN (-1e30f)
#define FLOOR (-80.f)

void rkv_softmax_rows(float *x, int64_t rows, int64_t n, float *top, float *sum) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * n;
        float m = -FLT_MAX;
        for (int64_t j = 0; j < n; j++) m = row[j] > m ? row[j] : m;
        if (m < HIDDEN) m = 0.f;  /* every logit hidden */
        float s = 0.f;
        for (int64_t j = 0; j < n; j++) {
            const float v = row[j];
            const float e = v < HIDDEN ? 0.f : expf(fmaxf(v - m, FLOOR));
            row[j] = e;
            s += e;
        }
        top[r] = m;
        sum[r] = s;
    }
}
