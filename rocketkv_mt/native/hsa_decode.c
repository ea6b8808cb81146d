/* Hybrid Sparse Attention for one decode query of one layer, float32, on the CPU.
 *
 * The same computation as rocketkv_mt.hsa.hsa_decode (the torch path), in one call instead of
 * about forty small torch ops: on a CPU those ops' dispatch costs several times the arithmetic.
 * rkv_decode_batch does one layer's whole decode step for many sessions in one call: it appends
 * each session's new token to its own buffers, tightens its KT page, and runs HSA or dense
 * attention, as the session's row of the table says (rocketkv_mt/decode_table.py).
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

/* Vectors of the machine's width: 16 floats with AVX-512 (32 registers), else 8 (16 registers). Sums
 * that stay in registers across a loop are held in such vectors: an array GCC keeps on the stack
 * makes each update wait on the store of the one before. */
#if defined(__AVX512F__)
#define VW 16
#define PAGE_VECS 16 /* page logits summed at once: 256 pages */
#else
#define VW 8
#define PAGE_VECS 12 /* 96 pages, leaving registers for the weight and a row */
#endif
#define SUM_VECS 4 /* value-row floats summed at once: 4 vectors */
typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4))); /* an unaligned load or store */

typedef struct {
    float score;
    int64_t index;
} Ranked;

/* The k-th largest of x[0..n) (1 <= k <= n), x reordered: quickselect whose partitions swap always and
 * advance on the comparison, so they do not branch on the data. A min-heap of the best k (the previous
 * form) mispredicted a branch on most steps of its sift: ~a sixth of the kernel's time. */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n;
    const int64_t want = k - 1; /* its index once x is in descending order */
    for (;;) {
        if (hi - lo == 1) return x[lo];
        const float a = x[lo], b = x[lo + (hi - lo) / 2], c = x[hi - 1];
        const float pivot = fmaxf(fminf(a, b), fminf(fmaxf(a, b), c)); /* the median of three */
        int64_t gt = lo, eq;
        for (int64_t i = lo; i < hi; ++i) { /* [lo, gt): above the pivot */
            const float v = x[i];
            x[i] = x[gt];
            x[gt] = v;
            gt += v > pivot;
        }
        eq = gt;
        for (int64_t i = gt; i < hi; ++i) { /* [gt, eq): equal to it */
            const float v = x[i];
            x[i] = x[eq];
            x[eq] = v;
            eq += v == pivot;
        }
        if (want < gt) hi = gt;
        else if (want < eq || eq == gt) return pivot; /* eq == gt: a NaN pivot, no progress to make */
        else lo = eq;
    }
}

/* Ask for n floats from p into the L2 cache, not the L1 (locality hint 1: prefetcht1). A session's
 * bound rows and chosen tokens are ~380 KB of separate short runs; asked for into the L1, each request
 * held one of its few miss buffers until its line came, and the requests queued behind each other
 * (measured on the 16-session step of the bundled model, AMD EPYC Zen 4: 77-79 us a session and layer
 * with the L1 hint, 65-70 with this one; either hint alone for bounds or tokens: no gain). */
static inline void prefetch_span(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 1);
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

typedef struct {
    Ranked *chan;
    float *logits, *scores, *att, *scale;
    int64_t *chosen, *tokens;
    uint8_t *forced;
    const float **rows;  /* the bound row each kept channel reads */
    float *weights;      /* (G, r) each query's scaled value of each kept channel */
} Scratch;

static void scratch_free(Scratch *s) {
    free(s->chan); free(s->logits); free(s->scores); free(s->chosen);
    free(s->att); free(s->tokens); free(s->scale); free(s->forced); free(s->rows); free(s->weights);
}

/* Room for Hkv heads, pages P, max_tokens attended tokens and g * att_len scores. */
static int scratch_alloc(Scratch *s, int64_t hkv, int64_t g, int64_t d, int64_t pages,
                         int64_t max_tokens, int64_t att_len) {
    s->chan = malloc(sizeof(Ranked) * 2 * hkv * d);  /* ranked channels of every head, two sessions' worth */
    s->logits = malloc(sizeof(float) * g * (pages + 1));
    s->scores = malloc(sizeof(float) * (pages + 1));
    s->chosen = malloc(sizeof(int64_t) * (pages + 1)); /* each page's index may be written once */
    s->att = malloc(sizeof(float) * g * (att_len + 1));
    s->tokens = malloc(sizeof(int64_t) * (max_tokens + 1));
    s->scale = malloc(sizeof(float) * g);
    s->forced = malloc((size_t)pages + 1);
    s->rows = malloc(sizeof(float *) * d);
    s->weights = malloc(sizeof(float) * g * d);
    if (!s->chan || !s->logits || !s->scores || !s->chosen || !s->att || !s->tokens || !s->scale ||
        !s->forced || !s->rows || !s->weights) {
        scratch_free(s);
        return -1;
    }
    return 0;
}

/* The group's channels ranked by summed |q|, best first: chan (d,) for qh (G, d). */
static void rank_channels(Ranked *chan, const float *qh, int64_t g, int64_t d) {
    float mag[d];
    uint32_t key[d]; /* mag's bits: non-negative floats order as their bits do, a NaN above them all */
    for (int64_t c = 0; c < d; ++c) {
        float m = 0.0f;
        for (int64_t j = 0; j < g; ++j) m += fabsf(qh[j * d + c]);
        mag[c] = m;
    }
    memcpy(key, mag, sizeof(key));
    /* Each channel's rank is the count of those before it (larger, or equal and of a lower index): a
     * permutation whatever the values, in d * d vector compares instead of qsort's calls of a comparator
     * (~a tenth of the kernel's time). */
    for (int64_t c = 0; c < d; ++c) {
        int64_t rank = 0;
        for (int64_t o = 0; o < d; ++o) rank += (key[o] > key[c]) | ((key[o] == key[c]) & (o < c));
        chan[rank].score = mag[c];
        chan[rank].index = c;
    }
}

/* The bound row channel c reads in one head's bounds bh: the max row where the group's q is positive. */
static const float *bound_row(const float *bh, const float *qh, int64_t c, int64_t g, int64_t d,
                              int64_t bounds_row_stride) {
    float group = 0.0f;
    for (int64_t j = 0; j < g; ++j) group += qh[j * d + c];
    return bh + (group > 0.0f ? c : d + c) * bounds_row_stride;
}

/* Every head's channels ranked into chan (Hkv, d), and the bound rows their top r read asked for: issued a
 * session ahead (or before the heads compute), their memory latency overlaps the work before it instead of
 * stalling the logits. q (Hkv, G, d); bounds one head after another, head_stride apart. */
static void plan_heads(Ranked *chan, const float *q, const float *bounds, int64_t hkv, int64_t g, int64_t d,
                       int64_t r, int64_t pages, int64_t head_stride, int64_t bounds_row_stride) {
    for (int64_t h = 0; h < hkv; ++h) {
        const float *qh = q + h * g * d;
        rank_channels(chan + h * d, qh, g, d);
        for (int64_t i = 0; i < r; ++i)
            prefetch_span(bound_row(bounds + h * head_stride, qh, chan[h * d + i].index, g, d, bounds_row_stride),
                          pages);
    }
}

/* out[k] = sum_i w[i] * rows[i][p0 + k] for NV vectors of pages from p0, each page's sum over the
 * channels in rank order; NV a constant where it is inlined, so the sums stay in registers. */
static inline __attribute__((always_inline)) void bound_logits(float *restrict out, const float *const *rows,
                                                              const float *restrict w, int64_t r, int64_t p0,
                                                              const int NV) {
    vf acc[PAGE_VECS];
    for (int v = 0; v < NV; ++v) acc[v] = (vf){0};
    for (int64_t i = 0; i < r; ++i) {
        const float wi = w[i], *row = rows[i] + p0;
        for (int v = 0; v < NV; ++v) acc[v] += wi * *(const vfu *)(row + v * VW);
    }
    for (int v = 0; v < NV; ++v) *(vfu *)(out + v * VW) = acc[v];
}

/* o (d,) = sum_i w[i] * v[tokens[i]] over the rows of vh (d floats each). Each slice of SUM_VECS
 * vectors is summed over every token in registers, then stored: added into o in memory, each token's
 * update waited on the store of the one before (~a sixth of the kernel's time over 128 tokens). */
static void gathered_sum(float *restrict o, const float *restrict vh, const int64_t *restrict tokens,
                         const float *restrict w, int64_t n_tok, int64_t d) {
    int64_t c0 = 0;
    for (; c0 + SUM_VECS * VW <= d; c0 += SUM_VECS * VW) {
        vf acc[SUM_VECS];
        for (int v = 0; v < SUM_VECS; ++v) acc[v] = (vf){0};
        for (int64_t i = 0; i < n_tok; ++i) {
            const float *row = vh + tokens[i] * d + c0;
            const float wi = w[i];
            for (int v = 0; v < SUM_VECS; ++v) acc[v] += wi * *(const vfu *)(row + v * VW);
        }
        for (int v = 0; v < SUM_VECS; ++v) *(vfu *)(o + c0 + v * VW) = acc[v];
    }
    if (c0 < d) { /* a head dim that is not a multiple of the slice: its rest, through memory */
        memset(o + c0, 0, sizeof(float) * (size_t)(d - c0));
        for (int64_t i = 0; i < n_tok; ++i) {
            const float *row = vh + tokens[i] * d;
            const float wi = w[i];
            for (int64_t c = c0; c < d; ++c) o[c] += wi * row[c];
        }
    }
}

/* HSA for the G queries of one KV head: qh (G, d), chan its ranked channels (rank_channels), bh its
 * bounds, kh/vh its rows, oh (G, d). */
static void hsa_head(const Scratch *s, const Ranked *chan, const float *qh, const float *bh, const float *kh,
                     const float *vh, const int64_t *pinned_h, float *oh, int64_t g, int64_t d, int64_t length,
                     int64_t pages, int64_t bounds_row_stride, int64_t page_size, int64_t r, int64_t k_pages,
                     int64_t n_local, int64_t n_pinned, float scaling) {
    float *logits = s->logits, *scores = s->scores, *att = s->att, *scale = s->scale;
    int64_t *chosen = s->chosen, *tokens = s->tokens;
    uint8_t *forced = s->forced;

    /* SparQ's scale per query head: sqrt(d * |q_hat|_1 / |q|_1). */
    for (int64_t j = 0; j < g; ++j) {
        float all = 0.0f, kept = 0.0f;
        for (int64_t c = 0; c < d; ++c) all += fabsf(qh[j * d + c]);
        for (int64_t i = 0; i < r; ++i) kept += fabsf(qh[j * d + chan[i].index]);
        all = all > 1e-30f ? all : 1e-30f;
        scale[j] = kept > 0.0f ? 1.0f / sqrtf((float)d * kept / all) : 0.0f;
    }

    /* Upper-bound logits: each kept channel reads its bound row (bound_row). Pages go in blocks,
     * channels inside, so a block's logits are summed in registers and stored once; each logit still
     * sums its channels in rank order (the same result as a channel at a time over all pages). On the
     * batched step of 16 sessions of the bundled model (~325 pages a head), blocks of 16 pages summed
     * through memory took 2.8x as long as blocks of 256. */
    const float **rows = s->rows;
    float *weights = s->weights;
    for (int64_t i = 0; i < r; ++i) {
        int64_t c = chan[i].index;
        rows[i] = bound_row(bh, qh, c, g, d, bounds_row_stride);
        for (int64_t j = 0; j < g; ++j) weights[j * r + i] = qh[j * d + c] * scale[j];
    }
    for (int64_t j = 0; j < g; ++j) {
        const float *wj = weights + j * r;
        float *lj = logits + j * pages;
        int64_t p0 = 0;
        for (; p0 + PAGE_VECS * VW <= pages; p0 += PAGE_VECS * VW) bound_logits(lj + p0, rows, wj, r, p0, PAGE_VECS);
        for (; p0 + 4 * VW <= pages; p0 += 4 * VW) bound_logits(lj + p0, rows, wj, r, p0, 4);
        for (; p0 + VW <= pages; p0 += VW) bound_logits(lj + p0, rows, wj, r, p0, 1);
        if (p0 < pages) { /* the last pages, fewer than a vector: summed as a vector's lanes are (channels
                           * outer, one running sum a page), so pages whose bounds are equal score equal
                           * wherever they sit; a sum over the channels a page at a time may be
                           * reassociated (-ffast-math) and break such ties by rounding */
            float a[VW] = {0};
            const int64_t n = pages - p0;
            for (int64_t i = 0; i < r; ++i) {
                const float wi = wj[i], *row = rows[i] + p0;
                for (int64_t k = 0; k < n; ++k) a[k] += wi * row[k];
            }
            memcpy(lj + p0, a, sizeof(float) * (size_t)n);
        }
    }
    memset(scores, 0, sizeof(float) * pages);
    for (int64_t j = 0; j < g; ++j) {
        float *lj = logits + j * pages;
        softmax_inplace(lj, pages);
        for (int64_t p = 0; p < pages; ++p) scores[p] += lj[p];
    }

    /* Forced pages first, then the best-scored others up to k_pages, each group in page order: the
     * others are those above the room-th best score of the unforced pages, then as many of those equal
     * to it as fill the room. The logits are spent: they hold the unforced scores for the selection. */
    memset(forced, 0, (size_t)pages);
    memset(forced + pages - n_local, 1, (size_t)n_local);
    for (int64_t i = 0; i < n_pinned; ++i) forced[pinned_h[i]] = 1;
    int64_t n_chosen = 0, n_free = 0;
    for (int64_t p = 0; p < pages; ++p) {
        chosen[n_chosen] = p;
        n_chosen += forced[p];
        logits[n_free] = scores[p];
        n_free += !forced[p];
    }
    const int64_t room = k_pages - n_chosen;
    if (room >= n_free) { /* every page is read */
        for (int64_t p = 0; p < pages; ++p) {
            chosen[n_chosen] = p;
            n_chosen += !forced[p];
        }
    } else if (room > 0) {
        const float floor = kth_largest(logits, n_free, room);
        int64_t ties = room;
        for (int64_t p = 0; p < pages; ++p) ties -= !forced[p] && scores[p] > floor;
        for (int64_t p = 0; p < pages; ++p) {
            if (forced[p]) continue;
            const int take = scores[p] > floor || (scores[p] == floor && ties > 0);
            ties -= take && !(scores[p] > floor);
            chosen[n_chosen] = p;
            n_chosen += take;
        }
    }

    /* Exact attention over the chosen pages' tokens. Their key and value rows are scattered and cold:
     * asked for all at once here, their misses overlap instead of each stalling the product that reads
     * it (the hardware prefetcher cannot guess a gather). */
    int64_t n_tok = 0;
    for (int64_t i = 0; i < n_chosen; ++i)
        for (int64_t t = chosen[i] * page_size; t < (chosen[i] + 1) * page_size && t < length; ++t)
            tokens[n_tok++] = t;
    for (int64_t i = 0; i < n_tok; ++i) {
        prefetch_span(kh + tokens[i] * d, d);
        prefetch_span(vh + tokens[i] * d, d);
    }
    for (int64_t j = 0; j < g; ++j) {
        const float *qj = qh + j * d;
        float *aj = att + j * n_tok;
        for (int64_t i = 0; i < n_tok; ++i) {
            const float *k = kh + tokens[i] * d;
            float sc = 0.0f;
            for (int64_t c = 0; c < d; ++c) sc += qj[c] * k[c];
            aj[i] = sc * scaling;
        }
        softmax_inplace(aj, n_tok);
        gathered_sum(oh + j * d, vh, tokens, aj, n_tok, d);
    }
}

/* Exact attention of the G queries of one KV head over its first `length` rows; att holds g * length. */
static void dense_head(float *att, const float *qh, const float *kh, const float *vh, float *oh, int64_t g, int64_t d,
                       int64_t length, float scaling) {
    /* Keys outer, the group inner: each key row is read once for all G queries. */
    for (int64_t t = 0; t < length; ++t) {
        const float *k = kh + t * d;
        for (int64_t j = 0; j < g; ++j) {
            const float *qj = qh + j * d;
            float sc = 0.0f;
            for (int64_t c = 0; c < d; ++c) sc += qj[c] * k[c];
            att[j * length + t] = sc * scaling;
        }
    }
    for (int64_t j = 0; j < g; ++j) softmax_inplace(att + j * length, length);
    memset(oh, 0, sizeof(float) * g * d);
    for (int64_t t = 0; t < length; ++t) {
        const float *v = vh + t * d;
        for (int64_t j = 0; j < g; ++j) {
            float w = att[j * length + t], *oj = oh + j * d;
            for (int64_t c = 0; c < d; ++c) oj[c] += w * v[c];
        }
    }
}

int rkv_hsa_decode(
    const float *q, const float *key_buf, const float *value_buf, const float *bounds,
    const int64_t *pinned, float *out,
    int64_t hkv, int64_t g, int64_t d, int64_t cap, int64_t length,
    int64_t pages, int64_t bounds_head_stride, int64_t bounds_row_stride,
    int64_t page_size, int64_t topr, int64_t k_pages, int64_t n_local, int64_t n_pinned, float scaling) {
    int64_t r = topr < d ? topr : d;
    int64_t max_tokens = k_pages * page_size;
    Scratch s;
    if (scratch_alloc(&s, hkv, g, d, pages, max_tokens, max_tokens) != 0) return -1;
    plan_heads(s.chan, q, bounds, hkv, g, d, r, pages, bounds_head_stride, bounds_row_stride);
    for (int64_t h = 0; h < hkv; ++h)
        hsa_head(&s, s.chan + h * d, q + h * g * d, bounds + h * bounds_head_stride, key_buf + h * cap * d, value_buf + h * cap * d,
                 pinned ? pinned + h * n_pinned : NULL, out + h * g * d, g, d, length, pages, bounds_row_stride,
                 page_size, r, k_pages, n_local, n_pinned, scaling);
    scratch_free(&s);
    return 0;
}

/* The table's columns: the same order as FIELDS in rocketkv_mt/decode_table.py. */
#define F_K 0
#define F_V 1
#define F_POS 2
#define F_CAP 3
#define F_ROW 4
#define F_POSITION 5
#define F_MK 6
#define F_MV 7
#define F_MPOS 8
#define F_MCAP 9
#define F_MROW 10
#define F_BOUNDS 11
#define F_BHEAD 12
#define F_BROW 13
#define F_BPAGE 14
#define F_BNEW 15
#define F_HSA 16
#define F_PAGES 17
#define F_PAGE_SIZE 18
#define F_TOPR 19
#define F_KPAGES 20
#define F_NLOCAL 21
#define F_PINNED 22
#define F_NPINNED 23
#define F_WIDTH 24

#define PTR(type, v) ((type *)(intptr_t)(v))

/* Write the token's key/value/position at row `row` of each head of one store. */
static void append_token(const int64_t *t, int64_t k_col, const float *k_new, const float *v_new, int64_t hkv,
                         int64_t d) {
    float *kb = PTR(float, t[k_col]), *vb = PTR(float, t[k_col + 1]);
    int64_t *pb = PTR(int64_t, t[k_col + 2]);
    int64_t cap = t[k_col + 3], row = t[k_col + 4], position = t[F_POSITION];
    for (int64_t h = 0; h < hkv; ++h) {
        memcpy(kb + (h * cap + row) * d, k_new + h * d, sizeof(float) * d);
        memcpy(vb + (h * cap + row) * d, v_new + h * d, sizeof(float) * d);
        pb[h * cap + row] = position;
    }
}

/* Session b's channels ranked into chan (Hkv, d) and its bound rows prefetched (nothing when b is past
 * the last session or its row is dense). */
static void plan_session(const int64_t *table, const float *q, int64_t b, int64_t n, Ranked *chan, int64_t hkv,
                         int64_t g, int64_t d) {
    if (b >= n) return;
    const int64_t *t = table + b * F_WIDTH;
    if (!t[F_HSA]) return;
    int64_t r = t[F_TOPR] < d ? t[F_TOPR] : d;
    plan_heads(chan, q + b * hkv * g * d, PTR(const float, t[F_BOUNDS]), hkv, g, d, r, t[F_PAGES], t[F_BHEAD],
               t[F_BROW]);
}

/* One layer's decode step for n sessions: table (n, fields) int64; q/out (n, Hkv, G, d);
 * k_new/v_new (n, Hkv, d). Returns 0, -1 (no scratch memory) or -2 (a table of another layout). */
int rkv_decode_batch(const int64_t *table, int64_t n, int64_t fields, const float *q, const float *k_new,
                     const float *v_new, float *out, int64_t hkv, int64_t g, int64_t d, float scaling) {
    if (fields != F_WIDTH) return -2;
    int64_t max_pages = 1, max_tokens = 1, max_att = 1;
    for (int64_t b = 0; b < n; ++b) {
        const int64_t *t = table + b * fields;
        int64_t length = t[F_ROW] + 1;
        if (t[F_HSA]) {
            int64_t tokens = t[F_KPAGES] * t[F_PAGE_SIZE];
            if (t[F_PAGES] > max_pages) max_pages = t[F_PAGES];
            if (tokens > max_tokens) max_tokens = tokens;
            if (tokens > max_att) max_att = tokens;
        } else if (length > max_att) {
            max_att = length;
        }
    }
    Scratch s;
    if (scratch_alloc(&s, hkv, g, d, max_pages, max_tokens, max_att) != 0) return -1;
    /* Each session's channels are ranked, and its bound rows asked for, while the session before it
     * computes: the sessions' buffers are far apart and cold, and that read is most of a step. */
    plan_session(table, q, 0, n, s.chan, hkv, g, d);
    for (int64_t b = 0; b < n; ++b) {
        const int64_t *t = table + b * fields;
        Ranked *chan = s.chan + (b % 2) * hkv * d;
        plan_session(table, q, b + 1, n, s.chan + ((b + 1) % 2) * hkv * d, hkv, g, d);
        const float *kn = k_new + b * hkv * d, *vn = v_new + b * hkv * d;
        append_token(t, F_K, kn, vn, hkv, d);
        if (t[F_MK]) append_token(t, F_MK, kn, vn, hkv, d);
        if (t[F_BOUNDS]) {
            float *bounds = PTR(float, t[F_BOUNDS]);
            for (int64_t h = 0; h < hkv; ++h) {
                float *hi = bounds + h * t[F_BHEAD] + t[F_BPAGE], *lo = hi + d * t[F_BROW];
                const float *key = kn + h * d;
                for (int64_t c = 0; c < d; ++c) {
                    float *mx = hi + c * t[F_BROW], *mn = lo + c * t[F_BROW];
                    if (t[F_BNEW]) {
                        *mx = key[c];
                        *mn = key[c];
                    } else {
                        *mx = key[c] > *mx ? key[c] : *mx;
                        *mn = key[c] < *mn ? key[c] : *mn;
                    }
                }
            }
        }
        const float *kb = PTR(const float, t[F_K]), *vb = PTR(const float, t[F_V]);
        int64_t cap = t[F_CAP], length = t[F_ROW] + 1;
        const float *qb = q + b * hkv * g * d;
        float *ob = out + b * hkv * g * d;
        for (int64_t h = 0; h < hkv; ++h) {
            if (t[F_HSA]) {
                int64_t r = t[F_TOPR] < d ? t[F_TOPR] : d;
                const int64_t *pinned = t[F_NPINNED] ? PTR(const int64_t, t[F_PINNED]) + h * t[F_NPINNED] : NULL;
                hsa_head(&s, chan + h * d, qb + h * g * d, PTR(const float, t[F_BOUNDS]) + h * t[F_BHEAD], kb + h * cap * d,
                         vb + h * cap * d, pinned, ob + h * g * d, g, d, length, t[F_PAGES], t[F_BROW],
                         t[F_PAGE_SIZE], r, t[F_KPAGES], t[F_NLOCAL], t[F_NPINNED], scaling);
            } else {
                dense_head(s.att, qb + h * g * d, kb + h * cap * d, vb + h * cap * d, ob + h * g * d, g, d, length,
                           scaling);
            }
        }
    }
    scratch_free(&s);
    return 0;
}
