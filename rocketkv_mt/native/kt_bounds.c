/* KT page bounds of one layer's kept keys, straight into the decode set's bounds buffer.
 *
 * rocketkv_mt.kt_cache.KTCache keeps, per KV head, the element-wise max and min of each page's keys
 * with the page axis last ((Hkv, 2d, capacity): rows 0..d-1 the max, d..2d-1 the min), so HSA reads a
 * channel's bound over all pages as one row. In torch that is a padded copy, two reductions and two
 * transposed copies into a zeroed buffer (~260 us for 650 keys of 3 heads); here each key is read once
 * and each bound row written once, a block of pages at a time. It runs for every layer of every turn
 * a cache selects (on the page reader for tiered turns).
 *
 *   keys (Hkv, length, d) float32: head h's row j at keys + h * head_stride + j * row_stride
 *   out  (Hkv, 2d, capacity) float32, contiguous: pages 0..ceil(length / page)-1 written, the rest zero
 * Returns 0, or -1 for a head dim above MAX_D or a capacity short of the pages. */
#include <stdint.h>
#include <string.h>

#define MAX_D 256
#define BLOCK 16 /* pages whose bounds are gathered before their rows are written */
#define PAD 16   /* floats between a block's page rows: rows 1 KB apart would share a few L1 sets */

int rkv_page_bounds(const float *keys, int64_t hkv, int64_t length, int64_t d, int64_t head_stride,
                    int64_t row_stride, int64_t page, float *out, int64_t capacity) {
    const int64_t pages = length > 0 ? (length + page - 1) / page : 0;
    if (d > MAX_D || d < 1 || page < 1 || pages > capacity) return -1;
    float hi[BLOCK][MAX_D + PAD], lo[BLOCK][MAX_D + PAD];
    for (int64_t h = 0; h < hkv; ++h) {
        const float *kh = keys + h * head_stride;
        float *oh = out + h * 2 * d * capacity;
        for (int64_t p0 = 0; p0 < pages; p0 += BLOCK) {
            const int64_t nb = pages - p0 < BLOCK ? pages - p0 : BLOCK;
            for (int64_t i = 0; i < nb; ++i) {
                const int64_t first = (p0 + i) * page;
                const int64_t last = first + page < length ? first + page : length;
                const float *k = kh + first * row_stride;
                float *mx = hi[i], *mn = lo[i];
                for (int64_t c = 0; c < d; ++c) mx[c] = mn[c] = k[c];
                for (int64_t t = first + 1; t < last; ++t) {
                    k = kh + t * row_stride;
                    for (int64_t c = 0; c < d; ++c) {
                        mx[c] = k[c] > mx[c] ? k[c] : mx[c];
                        mn[c] = k[c] < mn[c] ? k[c] : mn[c];
                    }
                }
            }
            for (int64_t c = 0; c < d; ++c) {
                float *rmax = oh + c * capacity + p0, *rmin = oh + (d + c) * capacity + p0;
                for (int64_t i = 0; i < nb; ++i) {
                    rmax[i] = hi[i][c];
                    rmin[i] = lo[i][c];
                }
            }
        }
        for (int64_t row = 0; row < 2 * d; ++row)
            memset(oh + row * capacity + pages, 0, (size_t)(capacity - pages) * sizeof(float));
    }
    return 0;
}
