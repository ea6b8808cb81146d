/* Stage 1's choice over slots held in any order, one call per layer (rocketkv_mt.reselect.choose_over_parts).
 *
 * In torch the choice is about thirty small ops over history-long rows (scatter by position, max
 * pooling, a top-k with ties broken towards earlier positions, gathers); a tiered turn runs it twice a
 * layer. Here each head is a few passes over plain arrays.
 *
 * Shapes: Hkv KV heads, S slots, H history positions, w window, prefix = H - w.
 *   probs    (Hkv, S) float32: each slot's window probability
 *   key_pos  (Hkv, S) int64: each slot's position
 *   alive    (Hkv, S) uint8, or NULL when every slot holds its token
 *   out_*    (Hkv, prompt_budget) at least; written with row stride keep + w, keep stored in *out_keep:
 *            the chosen slots, their positions (ascending) and raw scores (0 for the window)
 * As the torch path: a slot's score lands at its position (dropped when dead, negative, or in the
 * window); a position no alive slot holds is never kept; keep = min(prompt_budget - w, the fewest
 * positions any head holds); the scores are max-pooled (kernel_size, stride 1, centred, -inf padding)
 * before the top keep are taken, ties going to the earlier position.
 * Returns 0; -1 when scratch memory could not be allocated; -2 when an alive slot's position lies
 * outside [0, H) (nothing written). NaN scores are the caller's to reject.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static void swap_f(float *a, float *b) {
    float t = *a;
    *a = *b;
    *b = t;
}

/* The k-th largest (k >= 1) of v[0..n), reordering v. */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        /* Median of three as the pivot, moved to hi. */
        if (v[mid] > v[lo]) swap_f(&v[mid], &v[lo]);
        if (v[hi] > v[lo]) swap_f(&v[hi], &v[lo]);
        if (v[mid] > v[hi]) swap_f(&v[mid], &v[hi]);
        float pivot = v[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++)
            if (v[i] > pivot) swap_f(&v[i], &v[store++]);
        swap_f(&v[store], &v[hi]);
        if (store == target) return v[store];
        if (store < target) lo = store + 1;
        else hi = store - 1;
    }
    return v[target];
}

/* out[i] = max(raw[i - k/2 .. i - k/2 + k - 1]) within bounds (van Herk / Gil-Werman: three passes). */
static void max_pool(const float *raw, int64_t n, int64_t k, float *out, float *pad, float *g, float *h) {
    const int64_t len = n + k - 1, left = k / 2;
    for (int64_t i = 0; i < len; i++) {
        int64_t src = i - left;
        pad[i] = (src >= 0 && src < n) ? raw[src] : -INFINITY;
    }
    for (int64_t i = 0; i < len; i++) g[i] = (i % k == 0) ? pad[i] : fmaxf(g[i - 1], pad[i]);
    for (int64_t i = len - 1; i >= 0; i--) h[i] = (i % k == k - 1 || i == len - 1) ? pad[i] : fmaxf(h[i + 1], pad[i]);
    for (int64_t i = 0; i < n; i++) out[i] = fmaxf(h[i], g[i + k - 1]);
}

int rkv_choose(const float *probs, const int64_t *key_pos, const uint8_t *alive, int64_t hkv, int64_t slots,
               int64_t history_len, int64_t w, int64_t prompt_budget, int64_t kernel_size,
               int64_t *out_slots, int64_t *out_pos, float *out_scores, int64_t *out_keep) {
    const int64_t prefix = history_len - w;
    const int64_t pooled = kernel_size > 1 ? prefix + kernel_size - 1 : 1;
    float *raw = malloc((size_t)(hkv * prefix + 1) * sizeof(float));
    int64_t *slot_of = malloc((size_t)(hkv * (history_len + 1)) * sizeof(int64_t));
    float *score = malloc((size_t)(prefix + 1) * sizeof(float));
    float *work = malloc((size_t)(prefix + 1) * sizeof(float));
    float *pad = malloc((size_t)pooled * sizeof(float));
    float *g = malloc((size_t)pooled * sizeof(float));
    float *h = malloc((size_t)pooled * sizeof(float));
    int rc = -1;
    if (!raw || !slot_of || !score || !work || !pad || !g || !h) goto done;

    int64_t keep = prompt_budget - w;
    for (int64_t hd = 0; hd < hkv; hd++) {
        float *r = raw + hd * prefix;
        int64_t *so = slot_of + hd * (history_len + 1);
        const float *p = probs + hd * slots;
        const int64_t *kp = key_pos + hd * slots;
        const uint8_t *al = alive ? alive + hd * slots : NULL;
        for (int64_t i = 0; i < prefix; i++) r[i] = 0.f;
        for (int64_t i = 0; i <= history_len; i++) so[i] = -1;
        for (int64_t s = 0; s < slots; s++) {
            const int64_t pos = kp[s];
            const int live = al ? al[s] != 0 : 1;
            if (al && live && (pos < 0 || pos >= history_len)) {
                rc = -2;
                goto done;
            }
            if (live && pos >= 0 && pos < prefix) r[pos] += p[s];
            /* Slot of each position: later slots win, as torch's scatter on the CPU writes. */
            int64_t target = al ? (live ? pos : history_len) : (pos < 0 ? 0 : (pos > history_len ? history_len : pos));
            so[target] = s;
        }
        int64_t held = 0;
        for (int64_t i = 0; i < prefix; i++) held += so[i] >= 0;
        if (held < keep) keep = held;
    }
    if (keep < 0) keep = 0;
    const int64_t width = keep + w;

    for (int64_t hd = 0; hd < hkv; hd++) {
        const float *r = raw + hd * prefix;
        const int64_t *so = slot_of + hd * (history_len + 1);
        if (kernel_size > 1 && prefix > 0) max_pool(r, prefix, kernel_size, score, pad, g, h);
        else for (int64_t i = 0; i < prefix; i++) score[i] = r[i];
        for (int64_t i = 0; i < prefix; i++)
            if (so[i] < 0) score[i] = -INFINITY;
        int64_t *os = out_slots + hd * width, *op = out_pos + hd * width;
        float *sc = out_scores + hd * width;
        int64_t n = 0;
        const int64_t k = keep < prefix ? keep : prefix;
        if (k > 0) {
            for (int64_t i = 0; i < prefix; i++) work[i] = score[i];
            const float kth = kth_largest(work, prefix, k);
            int64_t above = 0;
            for (int64_t i = 0; i < prefix; i++) above += score[i] > kth;
            int64_t room = k - above;
            for (int64_t i = 0; i < prefix && n < k; i++) {
                if (score[i] > kth || (score[i] == kth && room-- > 0)) {
                    op[n] = i;
                    os[n] = so[i];
                    sc[n] = r[i];
                    n++;
                }
            }
        }
        for (int64_t j = 0; j < w; j++) {
            op[n + j] = prefix + j;
            os[n + j] = so[prefix + j];
            sc[n + j] = 0.f;
        }
    }
    *out_keep = keep;
    rc = 0;
done:
    free(raw); free(slot_of); free(score); free(work); free(pad); free(g); free(h);
    return rc;
}
