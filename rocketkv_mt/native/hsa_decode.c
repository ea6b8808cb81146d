/* Hybrid Sparse Attention for one decode query of one layer, float32, on the CPU.
 *
 * The same computation as rocketkv_mt.hsa.hsa_decode (the torch path), in one call instead of
 * about forty small torch ops: on a CPU those ops' dispatch costs several times the arithmetic.
 *
 * Shapes (all float32 unless said): Hkv KV heads, G query heads per KV head, d head dim,
 * P pages of page_size kept tokens, C buffer capacity in tokens.
 *   q        (Hkv, G, d) contiguous
 *   key_buf  (Hkv, C, d) contiguous; value_buf likewise
 *   bounds   per head: rows 0..d-1 the pages' element-wise key max, rows d..2d-1 the min;
 *            each row holds P contiguous values; head stride / row stride given in floats
 *   pinned   (Hkv, A) int64 page indices that must be chosen (NULL when A = 0), as must the
 *            last n_local pages (the reply's recent tokens)
 *   out      (Hkv, G, d) contiguous
 * Returns 0, or -1 when scratch memory could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float score;
    int64_t index;
} Ranked;

static int by_score_desc(const void *a, const void *b) {
    float x = ((const Ranked *)a)->score, y = ((const Ranked *)b)->score;
    return (x < y) - (x > y);
}

/* Min-heap on score of at most `cap` entries: keeps the `cap` best seen. */
static void heap_offer(Ranked *heap, int64_t *size, int64_t cap, float score, int64_t index) {
    int64_t i;
    if (*size < cap) {
        i = (*size)++;
        while (i > 0 && heap[(i - 1) / 2].score > score) {
            heap[i] = heap[(i - 1) / 2];
            i = (i - 1) / 2;
        }
        heap[i].score = score;
        heap[i].index = index;
        return;
    }
    if (cap == 0 || score <= heap[0].score) return;
    i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        float best = score;
        if (l < *size && heap[l].score < best) { m = l; best = heap[l].score; }
        if (r < *size && heap[r].score < best) { m = r; }
        if (m == i) break;
        heap[i] = heap[m];
        i = m;
    }
    heap[i].score = score;
    heap[i].index = index;
}

/* In place: x[0..n) becomes softmax(x). */
static void softmax_inplace(float *x, int64_t n) {
    float m = x[0], s = 0.0f;
    for (int64_t i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    float inv = 1.0f / s;
    for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

int rkv_hsa_decode(
    const float *q, const float *key_buf, const float *value_buf, const float *bounds,
    const int64_t *pinned, float *out,
    int64_t hkv, int64_t g, int64_t d, int64_t cap, int64_t length,
    int64_t pages, int64_t bounds_head_stride, int64_t bounds_row_stride,
    int64_t page_size, int64_t topr, int64_t k_pages, int64_t n_local, int64_t n_pinned, float scaling) {
    int64_t r = topr < d ? topr : d;
    int64_t max_tokens = k_pages * page_size;
    Ranked *chan = malloc(sizeof(Ranked) * d);
    float *logits = malloc(sizeof(float) * g * pages);
    float *scores = malloc(sizeof(float) * pages);
    Ranked *heap = malloc(sizeof(Ranked) * (k_pages + 1));
    int64_t *chosen = malloc(sizeof(int64_t) * (k_pages + 1));
    float *att = malloc(sizeof(float) * g * (max_tokens + 1));
    int64_t *tokens = malloc(sizeof(int64_t) * (max_tokens + 1));
    float *scale = malloc(sizeof(float) * g);
    uint8_t *forced = malloc((size_t)pages);
    int rc = 0;
    if (!chan || !logits || !scores || !heap || !chosen || !att || !tokens || !scale || !forced) {
        rc = -1;
        goto done;
    }
    for (int64_t h = 0; h < hkv; ++h) {
        const float *qh = q + h * g * d;
        const float *bh = bounds + h * bounds_head_stride;

        /* Top-r channels by the group's summed |q|. */
        for (int64_t c = 0; c < d; ++c) {
            float m = 0.0f;
            for (int64_t j = 0; j < g; ++j) m += fabsf(qh[j * d + c]);
            chan[c].score = m;
            chan[c].index = c;
        }
        qsort(chan, (size_t)d, sizeof(Ranked), by_score_desc);

        /* SparQ's scale per query head: sqrt(d * |q_hat|_1 / |q|_1). */
        for (int64_t j = 0; j < g; ++j) {
            float all = 0.0f, kept = 0.0f;
            for (int64_t c = 0; c < d; ++c) all += fabsf(qh[j * d + c]);
            for (int64_t i = 0; i < r; ++i) kept += fabsf(qh[j * d + chan[i].index]);
            all = all > 1e-30f ? all : 1e-30f;
            scale[j] = kept > 0.0f ? 1.0f / sqrtf((float)d * kept / all) : 0.0f;
        }

        /* Upper-bound logits: each kept channel reads the max row where the group's q is positive. */
        memset(logits, 0, sizeof(float) * g * pages);
        for (int64_t i = 0; i < r; ++i) {
            int64_t c = chan[i].index;
            float group = 0.0f;
            for (int64_t j = 0; j < g; ++j) group += qh[j * d + c];
            const float *row = bh + (group > 0.0f ? c : d + c) * bounds_row_stride;
            for (int64_t j = 0; j < g; ++j) {
                float w = qh[j * d + c] * scale[j];
                float *lj = logits + j * pages;
                for (int64_t p = 0; p < pages; ++p) lj[p] += w * row[p];
            }
        }
        memset(scores, 0, sizeof(float) * pages);
        for (int64_t j = 0; j < g; ++j) {
            float *lj = logits + j * pages;
            softmax_inplace(lj, pages);
            for (int64_t p = 0; p < pages; ++p) scores[p] += lj[p];
        }

        /* Forced pages first, then the best-scored others up to k_pages. */
        memset(forced, 0, (size_t)pages);
        memset(forced + pages - n_local, 1, (size_t)n_local);
        for (int64_t i = 0; i < n_pinned; ++i) forced[pinned[h * n_pinned + i]] = 1;
        int64_t n_chosen = 0, heap_size = 0;
        for (int64_t p = 0; p < pages; ++p)
            if (forced[p]) chosen[n_chosen++] = p;
        int64_t room = k_pages - n_chosen;
        for (int64_t p = 0; p < pages && room > 0; ++p)
            if (!forced[p]) heap_offer(heap, &heap_size, room, scores[p], p);
        for (int64_t i = 0; i < heap_size; ++i) chosen[n_chosen++] = heap[i].index;

        /* Exact attention over the chosen pages' tokens. */
        int64_t n_tok = 0;
        for (int64_t i = 0; i < n_chosen; ++i)
            for (int64_t t = chosen[i] * page_size; t < (chosen[i] + 1) * page_size && t < length; ++t)
                tokens[n_tok++] = t;
        const float *kh = key_buf + h * cap * d, *vh = value_buf + h * cap * d;
        for (int64_t j = 0; j < g; ++j) {
            const float *qj = qh + j * d;
            float *aj = att + j * n_tok;
            for (int64_t i = 0; i < n_tok; ++i) {
                const float *k = kh + tokens[i] * d;
                float s = 0.0f;
                for (int64_t c = 0; c < d; ++c) s += qj[c] * k[c];
                aj[i] = s * scaling;
            }
            softmax_inplace(aj, n_tok);
            float *oj = out + (h * g + j) * d;
            memset(oj, 0, sizeof(float) * d);
            for (int64_t i = 0; i < n_tok; ++i) {
                const float *v = vh + tokens[i] * d;
                float w = aj[i];
                for (int64_t c = 0; c < d; ++c) oj[c] += w * v[c];
            }
        }
    }
done:
    free(chan); free(logits); free(scores); free(heap); free(chosen); free(att); free(tokens); free(scale); free(forced);
    return rc;
}
