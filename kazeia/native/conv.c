/* The vocoder's convolutions and linears as one product kernel whose every output value is
   computed by the same arithmetic in the same order whatever the call: the chunk a position falls
   in, the number of positions or batch rows of the call, the thread count (kazeia/conv.py).

   A causal convolution with `taps` taps of dilation d over time-major rows (position t reads
   padded input rows t, t + d, ..., t + (taps - 1) d, each `cin` values):
       y[t][n] = (sum over k of x[t + (k / cin) d][k % cin] * w[n][k]) + bias[n] (+ res[t][n])
   with k = tap * cin + channel running 0, 1, ..., taps * cin - 1. A Linear is taps = 1; a
   transposed convolution is one in its polyphase form (kazeia/conv.py builds that weight).

   Summation: one accumulator per output value, starting at 0, one multiply-add per k in that
   order (a fused multiply-add where the build has FMA, a rounded product then a sum in the
   portable build), then + bias, then + res. Vectors run across output channels, never across
   k, so nothing is ever summed in another order: a register tile of MR positions x NV vectors of
   output channels takes one weight vector load and one broadcast input value per k. The blocking
   (panels of output channels, blocks of k kept in the second-level cache, blocks of positions,
   threads) only decides when each multiply-add happens; partial sums of a k block are stored in y
   as float32 and reloaded, which is exact.

   Weights are packed once (`vconv_pack`): panels of NV * LANES output channels, each a
   (taps * cin, NV * LANES) matrix, zero past the last channel. Which panels a layer has depends on
   the build only (its vector width and widest tile, NV_MAX). A layer of very few output channels
   (the last convolution's one) runs as dot products along k instead, in an order fixed by taps and
   cin (`dot_rows`). Built with the rest of kazeia/native (-ffp-contract=off).

   Pairs (a bfloat16 vocoder, where the build has AVX512_BF16): the weights are packed as bfloat16
   pairs of consecutive k, the inputs rounded to bfloat16 (to nearest even) as a block of positions
   is read, and each accumulator takes one bfloat16 pair dot product per two k, in k order (the
   instruction's own rounding, the same for every value): twice the products per instruction.

   Narrow weights (a product that reads far more weights than it multiplies, on every build): the
   weights rounded to bfloat16 and stored so, in the float32 layout, each widened to float32 as it
   is loaded; the inputs and every sum stay float32. The result is, bit for bit, that of the float32
   product of the rounded weights, at half the bytes read. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "jobs.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAIRS 1 /* bfloat16 pair dot products */
#else
#define PAIRS 0
#endif

/* How a layer's weights are packed (`vconv_pack`'s and `vconv`'s `format`). */
enum { FLOAT32 = 0, PAIRS_BF16 = 1, NARROW_BF16 = 2 };

#if defined(__AVX512F__)
typedef __m512 vec;
enum { LANES = 16, NV_MAX = 4 };
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vbcast(const float *p) { return _mm512_set1_ps(*p); }
static inline vec vmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vload_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline vec vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void vstore_n(float *p, vec v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
/* Positions per register tile for NV vectors of channels: 24 accumulators of 32 registers. */
static const int MR_FOR[NV_MAX + 1] = {0, 16, 12, 8, 6};
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
enum { LANES = 8, NV_MAX = 2 };
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vbcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vec vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vec vmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vload_n(const float *p, int n) {
    float t[LANES] = {0};
    memcpy(t, p, sizeof(float) * (size_t)n);
    return _mm256_loadu_ps(t);
}
static inline void vstore_n(float *p, vec v, int n) {
    float t[LANES];
    _mm256_storeu_ps(t, v);
    memcpy(p, t, sizeof(float) * (size_t)n);
}
/* 12 accumulators, NV weight vectors and one broadcast of 16 registers. Measured (Zen 3): a tile of
   4 positions x 3 vectors left the compiler no register for the weights, so it read them again from
   memory with every multiply-add, and ran at a third of the FMA units' rate; 6 x 2 runs near it. */
static const int MR_FOR[NV_MAX + 1] = {0, 12, 6};
#else
typedef float vec __attribute__((vector_size(16)));
enum { LANES = 4, NV_MAX = 2 };
static inline vec vzero(void) { return (vec){0.0f, 0.0f, 0.0f, 0.0f}; }
static inline vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline vec vbcast(const float *p) { return (vec){*p, *p, *p, *p}; }
static inline vec vload_bf16(const uint16_t *p) {
    return (vec){from_bf16(p[0]), from_bf16(p[1]), from_bf16(p[2]), from_bf16(p[3])};
}
static inline vec vmadd(vec a, vec b, vec c) { return a * b + c; } /* rounded product, then the sum */
static inline vec vadd(vec a, vec b) { return a + b; }
static inline void vstore(float *p, vec v) { memcpy(p, &v, sizeof v); }
static inline vec vload_n(const float *p, int n) {
    vec v = vzero();
    memcpy(&v, p, sizeof(float) * (size_t)n);
    return v;
}
static inline void vstore_n(float *p, vec v, int n) { memcpy(p, &v, sizeof(float) * (size_t)n); }
static const int MR_FOR[NV_MAX + 1] = {0, 8, 6};
#endif

enum {
    MR_MAX = 16,
    K_BLOCK_BYTES = 192 * 1024, /* a panel's block of k: weights re-read from the second-level cache */
    M_BLOCK_BYTES = 256 * 1024, /* input rows of a block of positions */
};

/* ---- panels ------------------------------------------------------------------------------------- */

/* The vectors of panel p of a layer with n output channels: ceil(n / LANES) vectors split into
   ceil(vectors / NV_MAX) panels as evenly as possible, wider ones first. */
static int panel_count(long n) {
    long vectors = (n + LANES - 1) / LANES;
    return (int)((vectors + NV_MAX - 1) / NV_MAX);
}
static int panel_vectors(long n, int p) {
    long vectors = (n + LANES - 1) / LANES;
    int count = panel_count(n);
    return (int)(vectors / count + (p < vectors % count));
}
static long panel_first(long n, int p) { /* first vector of panel p */
    long vectors = (n + LANES - 1) / LANES, first = 0;
    int count = panel_count(n);
    for (int i = 0; i < p; i++) first += vectors / count + (i < vectors % count);
    return first;
}

/* A layer of very few output channels (the vocoder's last convolution has one) runs as dot
   products along k instead (`dot_rows`): its weight is kept as it is given, (n, k). */
static int uses_dot(long n) { return n * 4 <= LANES; }

/* Whether this build can take a layer as bfloat16 pairs: AVX512_BF16, and cin even (so a pair never
   straddles two taps). */
int vconv_pairs(long cin) { return PAIRS && cin % 2 == 0; }

/* Bytes of one packed weight value of a panel in `format`. */
static long value_bytes(int format) { return format == FLOAT32 ? (long)sizeof(float) : (long)sizeof(uint16_t); }

/* Bytes of the packed weight of a layer with n outputs and k = taps * cin inputs per output. */
long vconv_packed_bytes(long n, long k, int format) {
    if (uses_dot(n)) return (long)sizeof(float) * n * k;
    return (n + LANES - 1) / LANES * LANES * k * value_bytes(format);
}

/* Which build: the vector width in floats (for tests and logs). */
int vconv_lanes(void) { return LANES; }

/* w: (n, k) float32 rows, output channel-major (k = tap * cin + channel); packed by `format`: the
   panels of float32 (FLOAT32), of bfloat16 pairs (PAIRS_BF16, where `vconv_pairs`) or of bfloat16 in
   the float32 layout (NARROW_BF16), rounded to nearest even; a layer that `uses_dot` keeps float32
   rows (rounded to bfloat16 values but for FLOAT32). */
void vconv_pack(const float *w, long n, long k, int format, void *packed) {
    if (uses_dot(n)) {
        for (long i = 0; i < n * k; i++) ((float *)packed)[i] = format == FLOAT32 ? w[i] : from_bf16(to_bf16(w[i]));
        return;
    }
    for (int p = 0; p < panel_count(n); p++) {
        const long n0 = panel_first(n, p) * LANES, width = (long)panel_vectors(n, p) * LANES;
        for (long kk = 0; kk < k; kk++)
            for (long j = 0; j < width; j++) {
                const float v = n0 + j < n ? w[(n0 + j) * k + kk] : 0.0f;
                if (format == PAIRS_BF16) /* pair kk / 2 of column j: ((kk / 2) * width + j) * 2 + kk % 2 */
                    ((uint16_t *)packed)[n0 * k + ((kk / 2) * width + j) * 2 + kk % 2] = to_bf16(v);
                else if (format == NARROW_BF16)
                    ((uint16_t *)packed)[n0 * k + kk * width + j] = to_bf16(v);
                else
                    ((float *)packed)[n0 * k + kk * width + j] = v;
            }
    }
}

/* ---- the register tile -------------------------------------------------------------------------- */

struct tile {
    const float *rows[MR_MAX];     /* input row of each position (padded coordinates), tap 0 */
    const uint16_t *halves[MR_MAX]; /* the same rows rounded to bfloat16 (pairs) */
    float *out[MR_MAX];            /* its output row (channels n0...) */
    const float *res[MR_MAX];      /* its residual row, or NULL */
    const void *w;                 /* the panel's weights at k0: (k, NV * LANES), or pairs (k / 2, NV * LANES, 2) */
    const float *bias;             /* at n0, or NULL */
    long k0, k1, cin, step;        /* k range of this block; input channels; values between taps */
    int valid_rows, width;         /* positions to store; output channels of the panel to store */
    int first, last;               /* first block of k (start at 0), last (add bias and residual) */
};

/* The accumulators at the start of a block of k: 0, or the partial sums stored by the last block. */
#define TILE_START(t, acc, MR, NV)                                                                         \
    for (int r = 0; r < MR; r++)                                                                           \
        for (int v = 0; v < NV; v++) {                                                                     \
            const int left = t->width - v * LANES;                                                         \
            if (t->first || left <= 0)                                                                     \
                acc[r][v] = vzero();                                                                       \
            else                                                                                           \
                acc[r][v] = left >= LANES ? vload(t->out[r] + v * LANES) : vload_n(t->out[r] + v * LANES, left); \
        }

/* Store the valid rows and channels; after the last block of k, + bias, then + res. */
static inline __attribute__((always_inline)) void tile_finish(const struct tile *t, vec acc[][NV_MAX], const int MR,
                                                              const int NV) {
    for (int r = 0; r < MR && r < t->valid_rows; r++)
        for (int v = 0; v < NV; v++) {
            const int left = t->width - v * LANES;
            if (left <= 0) break;
            const int n = left >= LANES ? LANES : left;
            vec a = acc[r][v];
            if (t->last) {
                if (t->bias) a = vadd(a, n == LANES ? vload(t->bias + v * LANES) : vload_n(t->bias + v * LANES, n));
                if (t->res[r])
                    a = vadd(a, n == LANES ? vload(t->res[r] + v * LANES) : vload_n(t->res[r] + v * LANES, n));
            }
            if (n == LANES)
                vstore(t->out[r] + v * LANES, a);
            else
                vstore_n(t->out[r] + v * LANES, a, n);
        }
}

/* acc (MR x NV vectors) over k0..k1, in order, one multiply-add per k: the body of every tile shape,
   its weights float32 or, where `NARROW`, bfloat16 widened as loaded. Each tap's run of k works on a
   copy of the accumulators (`a`): with the array itself GCC 12 stored every accumulator back to the
   stack at every k in the AVX2 build (measured: a third of the speed). */
static inline __attribute__((always_inline)) void tile_run(const struct tile *t, const int MR, const int NV,
                                                           const int NARROW) {
    vec acc[MR_MAX][NV_MAX];
    TILE_START(t, acc, MR, NV)
    const float *w = t->w;
    const uint16_t *h = t->w; /* the same, NARROW */
    for (long k = t->k0; k < t->k1;) {
        const long tap = k / t->cin, c = k - tap * t->cin;
        const long end = (tap + 1) * t->cin < t->k1 ? (tap + 1) * t->cin : t->k1;
        const long offset = tap * t->step + c, count = end - k;
        const float *xr[MR_MAX];
        for (int r = 0; r < MR; r++) xr[r] = t->rows[r] + offset;
        vec a[MR_MAX][NV_MAX];
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) a[r][v] = acc[r][v];
        for (long i = 0; i < count; i++, w += NV * LANES, h += NV * LANES) {
            vec wv[NV_MAX];
            for (int v = 0; v < NV; v++) wv[v] = NARROW ? vload_bf16(h + v * LANES) : vload(w + v * LANES);
            for (int r = 0; r < MR; r++) {
                const vec xv = vbcast(xr[r] + i);
                for (int v = 0; v < NV; v++) a[r][v] = vmadd(xv, wv[v], a[r][v]);
            }
        }
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) acc[r][v] = a[r][v];
        k = end;
    }
    tile_finish(t, acc, MR, NV);
}

#if PAIRS
/* The same over bfloat16 pairs: one pair dot product per two k, in order (k0, k1 and cin even). */
static inline __attribute__((always_inline)) void tile_run_pairs(const struct tile *t, const int MR, const int NV) {
    vec acc[MR_MAX][NV_MAX];
    TILE_START(t, acc, MR, NV)
    const uint16_t *w = t->w;
    for (long k = t->k0; k < t->k1;) {
        const long tap = k / t->cin, c = k - tap * t->cin;
        const long end = (tap + 1) * t->cin < t->k1 ? (tap + 1) * t->cin : t->k1;
        const long offset = tap * t->step + c;
        const uint16_t *xr[MR_MAX];
        for (int r = 0; r < MR; r++) xr[r] = t->halves[r] + offset;
        for (long i = 0; i < end - k; i += 2, w += NV * 2 * LANES) {
            __m512i wv[NV_MAX];
            for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_si512(w + v * 2 * LANES);
            for (int r = 0; r < MR; r++) {
                int32_t pair;
                memcpy(&pair, xr[r] + i, sizeof pair);
                const __m512i xv = _mm512_set1_epi32(pair);
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)xv, (__m512bh)wv[v]);
            }
        }
        k = end;
    }
    tile_finish(t, acc, MR, NV);
}
#endif

#define FLOAT_TILES(mr, nv)                                                             \
    static void tile_##mr##_##nv(const struct tile *t) { tile_run(t, mr, nv, 0); }        \
    static void narrow_##mr##_##nv(const struct tile *t) { tile_run(t, mr, nv, 1); }
#if PAIRS
#define TILE(mr, nv) \
    FLOAT_TILES(mr, nv) static void pairs_##mr##_##nv(const struct tile *t) { tile_run_pairs(t, mr, nv); }
#define PAIRS_ROW(nv, most) {pairs_1_##nv, pairs_2_##nv, pairs_4_##nv, pairs_##most##_##nv}
#else
#define TILE(mr, nv) FLOAT_TILES(mr, nv)
#endif
#define SHAPES(nv, most) TILE(1, nv) TILE(2, nv) TILE(4, nv) TILE(most, nv)
#define ROW(nv, most) {tile_1_##nv, tile_2_##nv, tile_4_##nv, tile_##most##_##nv}
#define NARROW_ROW(nv, most) {narrow_1_##nv, narrow_2_##nv, narrow_4_##nv, narrow_##most##_##nv}
/* Per NV: tiles of 1, 2, 4 and MR_FOR[NV] positions (a block's last positions, and calls of few
   rows, take the smallest that holds them: the same sums, less work on spare rows). */
static const int TILE_ROWS[4] = {1, 2, 4, 0};
#if defined(__AVX512F__)
SHAPES(1, 16)
SHAPES(2, 12)
SHAPES(3, 8)
SHAPES(4, 6)
static void (*const TILES[NV_MAX + 1][4])(const struct tile *) = {{0}, ROW(1, 16), ROW(2, 12), ROW(3, 8), ROW(4, 6)};
static void (*const NARROW_TILES[NV_MAX + 1][4])(const struct tile *) = {
    {0}, NARROW_ROW(1, 16), NARROW_ROW(2, 12), NARROW_ROW(3, 8), NARROW_ROW(4, 6)};
#if PAIRS
static void (*const PAIR_TILES[NV_MAX + 1][4])(const struct tile *) = {
    {0}, PAIRS_ROW(1, 16), PAIRS_ROW(2, 12), PAIRS_ROW(3, 8), PAIRS_ROW(4, 6)};
#endif
#elif defined(__AVX2__) && defined(__FMA__)
SHAPES(1, 12)
SHAPES(2, 6)
static void (*const TILES[NV_MAX + 1][4])(const struct tile *) = {{0}, ROW(1, 12), ROW(2, 6)};
static void (*const NARROW_TILES[NV_MAX + 1][4])(const struct tile *) = {{0}, NARROW_ROW(1, 12), NARROW_ROW(2, 6)};
#else
SHAPES(1, 8)
SHAPES(2, 6)
static void (*const TILES[NV_MAX + 1][4])(const struct tile *) = {{0}, ROW(1, 8), ROW(2, 6)};
static void (*const NARROW_TILES[NV_MAX + 1][4])(const struct tile *) = {{0}, NARROW_ROW(1, 8), NARROW_ROW(2, 6)};
#endif

/* The tile of the fewest positions, at least `rows` of them (up to MR_FOR[nv]). */
static int tile_shape(int nv, long rows) {
    for (int i = 0; i < 3; i++)
        if (rows <= TILE_ROWS[i] && TILE_ROWS[i] < MR_FOR[nv]) return i;
    return 3;
}

/* ---- the call ----------------------------------------------------------------------------------- */

struct conv_args {
    const float *x, *bias, *res;
    const void *w;
    float *y;
    long x_batch, ldx, res_batch, ldres, y_batch, ldy; /* strides in floats */
    long batch, length, cin, n, k;                      /* k = taps * cin */
    long step;                                          /* dilation * ldx */
    long keep;                                          /* (taps - 1) * dilation */
    int format;                                         /* of the packed weights (`vconv_pack`) */
};

struct conv_job {
    const struct conv_args *a;
    long unit0, unit1;  /* blocks of positions (batch-major) of this job */
    int panel0, panel1; /* panels of this job */
    long rows_per_unit;
    int failed;         /* out of memory */
};

/* Positions t0..t1 of batch entry b, panel p. halves: with PAIRS_BF16, the input rows t0 .. t1 + keep
   of the block rounded to bfloat16, cin values each. */
static void run_block(const struct conv_args *a, long b, long t0, long t1, int p, const uint16_t *halves) {
    const int nv = panel_vectors(a->n, p), mr = MR_FOR[nv];
    const long n0 = panel_first(a->n, p) * LANES, stride = (long)nv * LANES;
    const int width = (int)(a->n - n0 < stride ? a->n - n0 : stride);
    const int pairs = a->format == PAIRS_BF16;
    long kc = K_BLOCK_BYTES / (value_bytes(a->format) * stride);
    kc = kc < 2 ? 2 : kc - kc % 2; /* pairs never straddle two blocks */
    struct tile t;
    t.cin = a->cin, t.step = pairs ? a->step / a->ldx * a->cin : a->step, t.width = width;
    t.bias = a->bias ? a->bias + n0 : NULL;
    for (long k0 = 0; k0 < a->k; k0 += kc) {
        t.k0 = k0, t.k1 = k0 + kc < a->k ? k0 + kc : a->k;
        t.first = k0 == 0, t.last = t.k1 == a->k;
        t.w = (const char *)a->w + (n0 * a->k + k0 * stride) * value_bytes(a->format);
        for (long m = t0; m < t1;) {
            const int shape = tile_shape(nv, t1 - m), rows = shape < 3 ? TILE_ROWS[shape] : mr;
            t.valid_rows = (int)(t1 - m < rows ? t1 - m : rows);
            for (int r = 0; r < rows; r++) {
                const long pos = m + (r < t.valid_rows ? r : t.valid_rows - 1); /* spare rows repeat the last */
                t.rows[r] = a->x + b * a->x_batch + pos * a->ldx;
                t.halves[r] = halves ? halves + (pos - t0) * a->cin : NULL;
                t.out[r] = a->y + b * a->y_batch + pos * a->ldy + n0;
                t.res[r] = a->res ? a->res + b * a->res_batch + pos * a->ldres + n0 : NULL;
            }
#if PAIRS
            if (pairs)
                PAIR_TILES[nv][shape](&t);
            else
#endif
                (a->format == NARROW_BF16 ? NARROW_TILES : TILES)[nv][shape](&t);
            m += t.valid_rows;
        }
    }
}

#if PAIRS
/* n values rounded to bfloat16, to nearest even (the same instruction for every value). */
static void round_pairs(const float *x, long n, uint16_t *out) {
    for (long c = 0; c < n; c += 16) {
        const __mmask16 m = n - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - c)) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + c));
        _mm256_mask_storeu_epi16(out + c, m, (__m256i)h);
    }
}
#endif

/* Sum of the lanes of v, in a fixed tree (halves, then quarters, ...). */
static float lanes_sum(vec v) {
    float a[LANES];
    vstore(a, v);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] += a[i + width];
    return a[0];
}

/* Positions t0..t1 of batch entry b for a layer that `uses_dot`: per output value, the products
   of each tap's channels LANES at a time (zeros past the end of a tap) summed into four vector
   accumulators in turn, then (acc0 + acc1) + (acc2 + acc3), its lanes by `lanes_sum`, + bias,
   + res: an order fixed by taps and cin. */
static void dot_rows(const struct conv_args *a, long b, long t0, long t1) {
    const long taps = a->k / a->cin;
    for (long t = t0; t < t1; t++) {
        const float *x = a->x + b * a->x_batch + t * a->ldx;
        float *y = a->y + b * a->y_batch + t * a->ldy;
        for (long o = 0; o < a->n; o++) {
            vec acc[4] = {vzero(), vzero(), vzero(), vzero()};
            int i = 0;
            for (long j = 0; j < taps; j++) {
                const float *xj = x + j * a->step, *wj = (const float *)a->w + o * a->k + j * a->cin;
                for (long c = 0; c < a->cin; c += LANES, i = (i + 1) & 3) {
                    const int m = a->cin - c < LANES ? (int)(a->cin - c) : LANES;
                    const vec xv = m == LANES ? vload(xj + c) : vload_n(xj + c, m);
                    const vec wv = m == LANES ? vload(wj + c) : vload_n(wj + c, m);
                    acc[i] = vmadd(xv, wv, acc[i]);
                }
            }
            float sum = lanes_sum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
            if (a->bias) sum += a->bias[o];
            if (a->res) sum += a->res[b * a->res_batch + t * a->ldres + o];
            y[o] = sum;
        }
    }
}

static void *conv_job_run(void *arg) {
    struct conv_job *j = arg;
    const struct conv_args *a = j->a;
    const long per_batch = (a->length + j->rows_per_unit - 1) / j->rows_per_unit;
    uint16_t *halves = NULL;
    if (a->format == PAIRS_BF16 && !uses_dot(a->n)) {
        halves = malloc(sizeof(uint16_t) * (size_t)((j->rows_per_unit + a->keep) * a->cin));
        if (!halves) {
            j->failed = 1;
            return NULL;
        }
    }
    for (long u = j->unit0; u < j->unit1; u++) {
        const long b = u / per_batch, t0 = (u % per_batch) * j->rows_per_unit;
        const long t1 = t0 + j->rows_per_unit < a->length ? t0 + j->rows_per_unit : a->length;
#if PAIRS
        if (halves)
            for (long row = t0; row < t1 + a->keep; row++)
                round_pairs(a->x + b * a->x_batch + row * a->ldx, a->cin, halves + (row - t0) * a->cin);
#endif
        if (uses_dot(a->n))
            dot_rows(a, b, t0, t1);
        else
            for (int p = j->panel0; p < j->panel1; p++) run_block(a, b, t0, t1, p, halves);
    }
    free(halves);
    return NULL;
}

/* What a thread's share must be worth (a job handed to a helper costs ~1-10 us): ~25 us of
   multiply-adds, or ~20 us of reading weights that come from memory (a product of a few positions,
   such as a one-frame chunk's transformer, reads far more than it multiplies: 121 MB of its
   linears read in 7.0 ms on one thread, 4.6 on two; measured, Zen 4). */
enum { MIN_MACS_PER_THREAD = 1 << 20, MIN_WEIGHT_BYTES_PER_THREAD = 1 << 18 };

/* y (batch blocks of `length` rows) := the convolution of x (batch blocks of rows, each block
   beginning with the (taps - 1) * dilation carried rows) with the packed weight w (of `format`, as
   packed), + bias (n floats or NULL), + res (rows like y, or NULL). Strides in floats; rows hold
   cin (x) or n (y, res) contiguous values. The work is split over up to `threads` threads (this
   one included); every value is the same whatever the split. Returns 0, -1 for arguments it cannot
   take, -2 when out of memory. */
int vconv(const float *x, long x_batch, long ldx, const void *w, const float *bias, const float *res, long res_batch,
          long ldres, float *y, long y_batch, long ldy, long batch, long length, long cin, long n, int taps,
          int dilation, int format, int threads) {
    if (batch < 0 || length < 0 || cin < 1 || n < 1 || taps < 1 || dilation < 1) return -1;
    if (format < FLOAT32 || format > NARROW_BF16 || (format == PAIRS_BF16 && !vconv_pairs(cin))) return -1;
    if (batch == 0 || length == 0) return 0;
    struct conv_args a = {x,      bias,  res,    w,    y,     x_batch,  ldx,        res_batch,
                          ldres,  y_batch, ldy,  batch, length, cin,    n,          (long)taps * cin,
                          (long)dilation * ldx, (long)(taps - 1) * dilation, format};
    long rows = M_BLOCK_BYTES / (long)(sizeof(float) * cin);
    rows = rows < 16 ? 16 : rows;
    rows = (rows + 47) / 48 * 48; /* whole tiles of every shape */
    long units = batch * ((length + rows - 1) / rows);
    const int panels = uses_dot(n) ? 1 : panel_count(n);
    const double macs = (double)batch * length * n * a.k;
    long most = (long)(macs / MIN_MACS_PER_THREAD) + vconv_packed_bytes(n, a.k, format) / MIN_WEIGHT_BYTES_PER_THREAD;
    threads = job_count(threads, most, MAX_JOBS);
    struct conv_job jobs[MAX_JOBS];
    const int by_panels = units < threads && panels >= threads;
    if (!by_panels && threads > 1) {
        /* blocks of positions as even as whole tiles allow, as many as the threads share evenly (a
           one-frame chunk's 1920 positions were 720 + 1200 on two threads, now 960 + 960; its 640
           were 384 + 256, now 336 + 304); every value is the same whatever the blocks */
        const long per_batch = ((units + threads - 1) / threads * threads + batch - 1) / batch;
        rows = ((length + per_batch - 1) / per_batch + 47) / 48 * 48;
        units = batch * ((length + rows - 1) / rows);
    }
    if (!by_panels && threads > units) threads = (int)units;
    for (int i = 0; i < threads; i++) {
        if (by_panels)
            jobs[i] = (struct conv_job){&a, 0, units, panels * i / threads, panels * (i + 1) / threads, rows, 0};
        else
            jobs[i] = (struct conv_job){&a, units * i / threads, units * (i + 1) / threads, 0, panels, rows, 0};
    }
    run_jobs(conv_job_run, jobs, sizeof jobs[0], threads);
    for (int i = 0; i < threads; i++)
        if (jobs[i].failed) return -2;
    return 0;
}
