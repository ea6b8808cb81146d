/* Causal attention of a few query rows over a long contiguous history, float32, on the CPU.
 *
 * rocketkv_mt.attention_ops.dense_attention for a prefill chunk: n new queries (n small: a chunk fed
 * beside other sessions' decode tokens) over the L keys of the history and themselves. Through
 * SDPA with a mask, or through two batched products, that ran at 15-30 GFLOPS here: the products'
 * inner dimension is only the head dim, the (rows x L) logits go to memory and back, and a fresh
 * logits buffer is faulted in on every call. This kernel streams the keys in blocks of 64 that stay
 * in L1, with an online softmax, and takes a KV head's G query heads as G*n rows over each block, a
 * tile of ROWS rows at a time.
 *
 * Vectors are GCC vector extensions of VW floats, the machine's SIMD width (16 with AVX-512, else
 * 8), and a tile's partial products are register-blocked to what the machine holds (32 or 16 vector
 * registers): a 64-byte vector on a 16-register AVX2 machine spilled every accumulator and ran this
 * kernel 6x slower than SDPA.
 *
 * Shapes (float32): Hkv KV heads, G query heads per KV head, n query rows, d head dim (64 or 128),
 * L keys.
 *   q       (Hkv * G, n, d) contiguous; query i sits at position q_offset + i and sees keys
 *           0..q_offset + i (q_offset = L - n for a turn's last n tokens)
 *   keys    head h's key j at keys + h * head_stride + j * d; values likewise
 *   out     (Hkv * G, n, d) contiguous
 * Returns 0, or -1 for a head dim it does not take.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16 /* floats a vector */
#define LOGIT_VECS 4 /* key vectors of a tile's logits accumulated at once: ROWS x this registers */
#define VALUE_VECS 4 /* output vectors of a tile's values accumulated at once */
#else
#define VW 8
#define LOGIT_VECS 2
#define VALUE_VECS 2
#endif
typedef float vf __attribute__((vector_size(4 * VW), aligned(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4))); /* an unaligned load or store */
typedef int vi __attribute__((vector_size(4 * VW)));

#define BLOCK 64   /* keys per block */
#define AHEAD 2    /* blocks between the one computed and the one prefetched */
#define KV (BLOCK / VW)
#define MAX_D 128
#define ROWS 4 /* query rows of a tile (the tail of fewer: see head_rows) */
#define HIDDEN (-1e30f)
#define FLOOR (-80.f) /* see softmax_rows.c: expf's fast path; exp(-80) is below a row sum's resolution */

/* The logits of R rows of q against a block's keys, transposed (kt[c * BLOCK + b]), into s[r][b]. */
static inline __attribute__((always_inline)) void tile_logits(const float *restrict q, const int d, const int R,
                                                             const float *restrict kt, float scaling,
                                                             float s[][BLOCK]) {
    for (int v0 = 0; v0 < KV; v0 += LOGIT_VECS) {
        vf acc[ROWS][LOGIT_VECS];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < LOGIT_VECS; v++) acc[r][v] = (vf){0};
        for (int c = 0; c < d; c++) {
            const vf *kc = (const vf *)(kt + c * BLOCK) + v0;
            vf k[LOGIT_VECS];
            for (int v = 0; v < LOGIT_VECS; v++) k[v] = kc[v];
            for (int r = 0; r < R; r++) {
                const float qc = q[r * d + c];
                for (int v = 0; v < LOGIT_VECS; v++) acc[r][v] += qc * k[v];
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < LOGIT_VECS; v++) *(vf *)(s[r] + VW * (v0 + v)) = acc[r][v] * scaling;
    }
}

/* o[r] += sum_b p[r][b] * values[b] for R rows of d floats, over nb keys; o is read and written once. */
static inline __attribute__((always_inline)) void tile_values(float *restrict o, const int d, const int R,
                                                             const float *restrict vb, int64_t nb,
                                                             float p[][BLOCK]) {
    for (int v0 = 0; v0 < d / VW; v0 += VALUE_VECS) {
        vf acc[ROWS][VALUE_VECS];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < VALUE_VECS; v++) acc[r][v] = *(const vfu *)(o + r * d + VW * (v0 + v));
        for (int64_t b = 0; b < nb; b++) {
            vf x[VALUE_VECS];
            for (int v = 0; v < VALUE_VECS; v++) x[v] = *(const vfu *)(vb + b * d + VW * (v0 + v));
            for (int r = 0; r < R; r++) {
                const float pb = p[r][b];
                for (int v = 0; v < VALUE_VECS; v++) acc[r][v] += pb * x[v];
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < VALUE_VECS; v++) *(vfu *)(o + r * d + VW * (v0 + v)) = acc[r][v];
    }
}

/* The VW x VW block x[i][j] -> x[j][i], as rounds that swap the off-diagonal h x h blocks of each
 * pair of rows (i, i + h), h = VW / 2 .. 1. Row i keeps its own columns j without bit h and takes
 * row i + h's columns j - h for those with it; row i + h takes row i's columns j + h and keeps its
 * own (VW + j: the second operand). */
#define SEL_LO(h, j) (((j) & (h)) ? VW + (j) - (h) : (j))
#define SEL_HI(h, j) (((j) & (h)) ? VW + (j) : (j) + (h))
#if VW == 16
#define LANES(S, h)                                                                                   \
    {S(h, 0), S(h, 1), S(h, 2),  S(h, 3),  S(h, 4),  S(h, 5),  S(h, 6),  S(h, 7),                       \
     S(h, 8), S(h, 9), S(h, 10), S(h, 11), S(h, 12), S(h, 13), S(h, 14), S(h, 15)}
#else
#define LANES(S, h) {S(h, 0), S(h, 1), S(h, 2), S(h, 3), S(h, 4), S(h, 5), S(h, 6), S(h, 7)}
#endif
#define SWAP_ROUND(h)                                                                                 \
    if ((h) < VW)                                                                                     \
        for (int i = 0; i < VW; i++)                                                                  \
            if (!(i & (h))) {                                                                         \
                const vi lo = LANES(SEL_LO, h), hi = LANES(SEL_HI, h);                                \
                const vf a = x[i], b = x[i + (h)];                                                    \
                x[i] = __builtin_shuffle(a, b, lo);                                                   \
                x[i + (h)] = __builtin_shuffle(a, b, hi);                                             \
            }

static inline __attribute__((always_inline)) void transpose_vw(vf x[VW]) {
#if VW == 16
    SWAP_ROUND(8)
#endif
    SWAP_ROUND(4)
    SWAP_ROUND(2)
    SWAP_ROUND(1)
}

/* kt[c * BLOCK + b] = k[b * d + c] for the block's nb keys (zeros past them). */
static inline __attribute__((always_inline)) void transpose_block(const float *restrict k, int64_t nb, const int d,
                                                                 float *restrict kt) {
    for (int kb = 0; kb < KV; kb++)
        for (int cb = 0; cb < d / VW; cb++) {
            vf x[VW];
            for (int i = 0; i < VW; i++) {
                const int64_t b = VW * kb + i;
                x[i] = b < nb ? *(const vfu *)(k + b * d + VW * cb) : (vf){0};
            }
            transpose_vw(x);
            for (int i = 0; i < VW; i++) *(vf *)(kt + (VW * cb + i) * BLOCK + VW * kb) = x[i];
        }
}

/* Ask for a later block's keys and values now: streamed from memory one block at a time, a few
 * rows' arithmetic does not hide the wait (a 7k-token history: 2.9 GB/s read without this). */
static inline void prefetch_block(const float *kh, const float *vh, int64_t j, int64_t end, int64_t d) {
    if (j >= end) return;
    const int64_t stop = (j + BLOCK < end ? j + BLOCK : end) * d;
    for (int64_t i = j * d; i < stop; i += 16) {
        __builtin_prefetch(kh + i, 0, 3);
        __builtin_prefetch(vh + i, 0, 3);
    }
}

/* Turn a tile's logits into softmax numerators against each row's running max, rescaling what the
 * row holds when the max grows; the keys a row does not see (past its position) count as hidden. */
static void tile_softmax(float s[][BLOCK], int R, int64_t first_row, int64_t n, int64_t visible_from,
                         int64_t nb, float *m, float *l, float *o, int64_t d) {
    for (int r = 0; r < R; r++) {
        const int64_t row = first_row + r;
        int64_t see = visible_from + row % n; /* keys of the block this row sees */
        see = see < 0 ? 0 : see < nb ? see : nb;
        float *x = s[r];
        for (int64_t b = see; b < BLOCK; b++) x[b] = HIDDEN;
        float mb = m[row];
        for (int64_t b = 0; b < see; b++) mb = x[b] > mb ? x[b] : mb;
        if (mb > m[row]) {
            const float f = expf(fmaxf(m[row] - mb, FLOOR));
            l[row] *= f;
            for (int64_t c = 0; c < d; c++) o[r * d + c] *= f;
            m[row] = mb;
        }
        float sum = 0.f;
        for (int b = 0; b < BLOCK; b++) {
            const float e = x[b] < HIDDEN * 0.5f ? 0.f : expf(fmaxf(x[b] - mb, FLOOR));
            x[b] = e;
            sum += e;
        }
        l[row] += sum;
    }
}

/* One tile of R rows (from first_row) over a block: logits, softmax numerators, values. */
static inline __attribute__((always_inline)) void tile(const float *restrict qh, const float *restrict vb,
                                                      float *restrict oh, const int d, const int R,
                                                      int64_t first_row, int64_t n, int64_t visible_from,
                                                      int64_t nb, const float *restrict kt, float scaling,
                                                      float s[][BLOCK], float *m, float *l) {
    tile_logits(qh + first_row * d, d, R, kt, scaling, s);
    tile_softmax(s, R, first_row, n, visible_from, nb, m, l, oh + first_row * d, d);
    tile_values(oh + first_row * d, d, R, vb, nb, s);
}

static inline __attribute__((always_inline)) void head_rows(const float *restrict qh, const float *restrict kh,
                                                           const float *restrict vh, int64_t rows, int64_t n,
                                                           const int d, int64_t length, int64_t q_offset,
                                                           float scaling, float *restrict oh) {
    float kt[MAX_D * BLOCK] __attribute__((aligned(64)));
    float s[ROWS][BLOCK] __attribute__((aligned(64)));
    float m[rows], l[rows];
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -FLT_MAX;
        l[r] = 0.f;
    }
    memset(oh, 0, (size_t)(rows * d) * sizeof(float));
    const int64_t end = q_offset + n < length ? q_offset + n : length; /* keys any row sees */
    for (int64_t j0 = 0; j0 < end; j0 += BLOCK) {
        const int64_t nb = end - j0 < BLOCK ? end - j0 : BLOCK;
        prefetch_block(kh, vh, j0 + AHEAD * BLOCK, end, d);
        transpose_block(kh + j0 * d, nb, d, kt);
        const float *vb = vh + j0 * d;
        const int64_t visible_from = q_offset + 1 - j0;
        int64_t r0 = 0;
        for (; r0 + ROWS <= rows; r0 += ROWS) tile(qh, vb, oh, d, ROWS, r0, n, visible_from, nb, kt, scaling, s, m, l);
        switch (rows - r0) { /* the rows left over as one tile of a size known here */
        case 3: tile(qh, vb, oh, d, 3, r0, n, visible_from, nb, kt, scaling, s, m, l); break;
        case 2: tile(qh, vb, oh, d, 2, r0, n, visible_from, nb, kt, scaling, s, m, l); break;
        case 1: tile(qh, vb, oh, d, 1, r0, n, visible_from, nb, kt, scaling, s, m, l); break;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t c = 0; c < d; c++) oh[r * d + c] *= inv;
    }
}

int rkv_attend_rows(const float *q, int64_t hkv, int64_t g, int64_t n, int64_t d,
                    const float *keys, const float *values, int64_t head_stride, int64_t length,
                    int64_t q_offset, float scaling, float *out) {
    if (d != 64 && d != 128) return -1;
    const int64_t rows = g * n;
    for (int64_t h = 0; h < hkv; h++) {
        const float *qh = q + h * rows * d, *kh = keys + h * head_stride, *vh = values + h * head_stride;
        float *oh = out + h * rows * d;
        if (d == 64)
            head_rows(qh, kh, vh, rows, n, 64, length, q_offset, scaling, oh);
        else
            head_rows(qh, kh, vh, rows, n, 128, length, q_offset, scaling, oh);
    }
    return 0;
}

/* The two products of an attention part whose softmax happens between them (a tiered turn's parts,
 * rocketkv_mt/split_attention.py: the window rows' probabilities are kept): logits, then the values
 * weighted by the probabilities. With the same tiles as above: batched products of this shape (an
 * inner dimension of 64, a few dozen rows) ran at ~45 GFLOPS through torch.matmul here.
 *   rkv_row_logits: out (Hkv, M, T) = scaling * q (Hkv, M, d) . keys^T
 *   rkv_row_values: out (Hkv, M, d) = p (Hkv, M, T) . values
 * keys/values: head h's row j at + h * head_stride + j * d. Each returns 0, or -1 for a head dim it
 * does not take. */
static inline __attribute__((always_inline)) void logits_tile(const float *restrict qh, const float *restrict kt,
                                                             float *restrict oh, const int d, const int R,
                                                             int64_t r0, int64_t t, int64_t j0, int64_t nb,
                                                             float scaling, float s[][BLOCK]) {
    tile_logits(qh + r0 * d, d, R, kt, scaling, s);
    for (int r = 0; r < R; r++) memcpy(oh + (r0 + r) * t + j0, s[r], (size_t)nb * sizeof(float));
}

static inline __attribute__((always_inline)) void head_logits(const float *restrict qh, const float *restrict kh,
                                                             float *restrict oh, int64_t m, const int d, int64_t t,
                                                             float scaling) {
    float kt[MAX_D * BLOCK] __attribute__((aligned(64)));
    float s[ROWS][BLOCK] __attribute__((aligned(64)));
    for (int64_t j0 = 0; j0 < t; j0 += BLOCK) {
        const int64_t nb = t - j0 < BLOCK ? t - j0 : BLOCK;
        prefetch_block(kh, kh, j0 + AHEAD * BLOCK, t, d);
        transpose_block(kh + j0 * d, nb, d, kt);
        int64_t r0 = 0;
        for (; r0 + ROWS <= m; r0 += ROWS) logits_tile(qh, kt, oh, d, ROWS, r0, t, j0, nb, scaling, s);
        switch (m - r0) {
        case 3: logits_tile(qh, kt, oh, d, 3, r0, t, j0, nb, scaling, s); break;
        case 2: logits_tile(qh, kt, oh, d, 2, r0, t, j0, nb, scaling, s); break;
        case 1: logits_tile(qh, kt, oh, d, 1, r0, t, j0, nb, scaling, s); break;
        }
    }
}

static inline __attribute__((always_inline)) void values_tile(const float *restrict ph, const float *restrict vb,
                                                             float *restrict oh, const int d, const int R,
                                                             int64_t r0, int64_t t, int64_t j0, int64_t nb,
                                                             float s[][BLOCK]) {
    for (int r = 0; r < R; r++) memcpy(s[r], ph + (r0 + r) * t + j0, (size_t)nb * sizeof(float));
    tile_values(oh + r0 * d, d, R, vb, nb, s);
}

static inline __attribute__((always_inline)) void head_values(const float *restrict ph, const float *restrict vh,
                                                             float *restrict oh, int64_t m, const int d, int64_t t) {
    float s[ROWS][BLOCK] __attribute__((aligned(64)));
    memset(oh, 0, (size_t)(m * d) * sizeof(float));
    for (int64_t j0 = 0; j0 < t; j0 += BLOCK) {
        const int64_t nb = t - j0 < BLOCK ? t - j0 : BLOCK;
        prefetch_block(vh, vh, j0 + AHEAD * BLOCK, t, d);
        const float *vb = vh + j0 * d;
        int64_t r0 = 0;
        for (; r0 + ROWS <= m; r0 += ROWS) values_tile(ph, vb, oh, d, ROWS, r0, t, j0, nb, s);
        switch (m - r0) {
        case 3: values_tile(ph, vb, oh, d, 3, r0, t, j0, nb, s); break;
        case 2: values_tile(ph, vb, oh, d, 2, r0, t, j0, nb, s); break;
        case 1: values_tile(ph, vb, oh, d, 1, r0, t, j0, nb, s); break;
        }
    }
}

int rkv_row_logits(const float *q, int64_t hkv, int64_t m, int64_t d, const float *keys, int64_t head_stride,
                   int64_t t, float scaling, float *out) {
    if (d != 64 && d != 128) return -1;
    for (int64_t h = 0; h < hkv; h++) {
        if (d == 64)
            head_logits(q + h * m * d, keys + h * head_stride, out + h * m * t, m, 64, t, scaling);
        else
            head_logits(q + h * m * d, keys + h * head_stride, out + h * m * t, m, 128, t, scaling);
    }
    return 0;
}

int rkv_row_values(const float *p, int64_t hkv, int64_t m, int64_t t, const float *values, int64_t head_stride,
                   int64_t d, float *out) {
    if (d != 64 && d != 128) return -1;
    for (int64_t h = 0; h < hkv; h++) {
        if (d == 64)
            head_values(p + h * m * t, values + h * head_stride, out + h * m * d, m, 64, t);
        else
            head_values(p + h * m * t, values + h * head_stride, out + h * m * d, m, 128, t);
    }
    return 0;
}

/* A whole attention part of a tiered turn in one call (rocketkv_mt.split_attention.attend_part on the
 * CPU): the logits (rkv_row_logits' tiles), the hidden slots, the softmax numerators (softmax_rows.c),
 * the values (rkv_row_values' tiles), the normalised output, the log-sum-exp and the window rows'
 * numerators. In torch around the two products that was about a hundred small ops a part, two parts
 * a layer for every session of a prefill step: their dispatch, not their arithmetic, was the cost,
 * and it held the interpreter lock that the page reader's thread needs meanwhile.
 *   q        (Hkv, M, d) with M = G * R: query head j of KV head h's R rows at row j * R; a row i sits at
 *            turn row row0 + i
 *   keys     head h's key k at keys + h * head_stride + k * d; values likewise; T keys, the last
 *            own_tail of them the turn's own tokens: turn row x sees own key u only for u <= x
 *   visible  (Hkv, T) bytes, 0 where a slot holds no token; NULL: every slot holds one
 *   scratch  M * (T + 2) floats: one head's logits at a time, and its rows' maxima and sums
 *   out      (Hkv, M, d) normalised over the part's keys (0 for a row that sees none)
 *   lse      (Hkv, M) log-sum-exp of the row's logits (-inf for a row that sees none)
 *   wprobs   (Hkv, G, W, T) exp(logit - top) of each head's last W rows (0 where hidden); wtop (Hkv, G, W)
 * Returns 0, or -1 for a head dim it does not take. */
void rkv_softmax_rows(float *x, int64_t rows, int64_t n, float *top, float *sum);

int rkv_attend_part(const float *q, int64_t hkv, int64_t g, int64_t r, int64_t d, const float *keys,
                    const float *values, int64_t head_stride, int64_t t, float scaling, int64_t row0,
                    int64_t own_tail, const uint8_t *visible, int64_t w, float *scratch, float *out, float *lse,
                    float *wprobs, float *wtop) {
    if (d != 64 && d != 128) return -1;
    const int64_t m = g * r, tail_from = t - own_tail;
    float *tops = scratch + m * t, *sums = tops + m;
    const union { uint32_t u; float f; } minus_inf = {0xff800000u};  /* fast math may fold the INFINITY macro */
    for (int64_t h = 0; h < hkv; h++) {
        const float *qh = q + h * m * d, *kh = keys + h * head_stride, *vh = values + h * head_stride;
        const uint8_t *vis = visible ? visible + h * t : NULL;
        float *oh = out + h * m * d, *lh = lse + h * m;
        if (d == 64)
            head_logits(qh, kh, scratch, m, 64, t, scaling);
        else
            head_logits(qh, kh, scratch, m, 128, t, scaling);
        for (int64_t row = 0; row < m; row++) {
            /* hidden: a slot without a token, and the turn's own keys past this row's position */
            float *s = scratch + row * t;
            if (vis)
                for (int64_t k = 0; k < tail_from; k++) s[k] = vis[k] ? s[k] : -FLT_MAX;
            const int64_t sees = own_tail ? tail_from + row0 + row % r + 1 : t;
            for (int64_t k = tail_from; k < t; k++) s[k] = (k < sees && (!vis || vis[k])) ? s[k] : -FLT_MAX;
        }
        rkv_softmax_rows(scratch, m, t, tops, sums);
        for (int64_t row = 0; row < m; row++) {
            lh[row] = sums[row] > 0.f ? tops[row] + logf(sums[row]) : minus_inf.f;
            const int64_t i = row % r, j = row / r;
            if (i >= r - w) {
                const int64_t at = (h * g + j) * w + (i - (r - w));
                memcpy(wprobs + at * t, scratch + row * t, (size_t)t * sizeof(float));
                wtop[at] = tops[row];
            }
        }
        if (d == 64)
            head_values(scratch, vh, oh, m, 64, t);
        else
            head_values(scratch, vh, oh, m, 128, t);
        for (int64_t row = 0; row < m; row++) {
            const float norm = sums[row] > 1e-30f ? sums[row] : 1e-30f;
            float *o = oh + row * d;
            for (int64_t c = 0; c < d; c++) o[c] = o[c] / norm;
        }
    }
    return 0;
}
