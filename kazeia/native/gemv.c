/* Products of a few activation rows with a weight matrix, for decoding steps (single-threaded;
   `gemm_wide` also splits a prompt's weight rows over threads):
   y[i][r] = sum over c of x[i][c] * w[r][c], i < m, r < rows; w is row-major (rows, cols), as a
   Linear stores it; x and y are m rows of cols and rows values. m is 1 or 2 for one sequence's
   step, up to MAX_ROWS for a batched step of several requests (kazeia/batch.py).

   Batch-1 decoding reads every weight once per step and does two flops with it: the time is the
   weight reads. These loops read one weight row at a time, as one sequential stream with four
   independent accumulators (measured: ~96% of a plain single-threaded read; several rows at once
   and fewer accumulators read slower), each weight loaded once for both activation rows; one
   thread gets most of the machine's read bandwidth, so generation can keep its own core while the
   vocoder has the other (kazeia/engine.py) and never waits for another thread.

   Summation: 4 x 16 (AVX-512) or 4 x 8 (AVX2) lanes of partial sums over the columns (8 lanes in
   the portable build), added in a fixed order: for a given build a row's result never depends on
   m or on the other rows. More than two rows go through the same two-row dot product in pairs,
   (0, 1), (2, 3), ..., while the weight row is still in the first-level cache: each row's sums
   are those of m = 1, so a batched step gives every request exactly its solo result (gemm_wide
   takes six rows or more, 18 with the pair dot product, in tiles that make the same sums:
   wide_tiles). Weights and activations of dt (0 float32, 1 bfloat16, 2 float16) are widened to
   float32 and multiplied with fused multiply-adds; with AVX512_BF16, bfloat16 pairs go through its
   dot product (exact products, float32 sums; gemm_wide rounds its float32 activations to bfloat16
   for it). Outputs are rounded to dt once, as a float32-accumulating matmul does. Which
   instructions are used is decided by the build's target flags (kazeia/cpu.py). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "jobs.h"

/* Whether bfloat16 weights meet bfloat16 activations in AVX512_BF16's pair dot product (exact
   products, float32 sums): the bfloat16 models' products, and gemm_wide's (activations rounded to
   bfloat16 once per call there). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAIR_DOT 1
#else
#define PAIR_DOT 0
#endif

/* Which instructions this build uses, for tests and logs: 512 (AVX-512), 256 (AVX2 + FMA) or 0. */
int gemv_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

/* Whether bfloat16 pairs use AVX512_BF16's dot product in this build. */
int gemv_bf16_dot(void) { return PAIR_DOT; }

/* ---- weight loads widened to float32 vectors ------------------------------------------------ */
#if defined(__AVX512F__)
typedef __m512 vec;
enum { LANES = 16 };
static inline vec vload(const void *p, long i, int dt) {
    if (dt == BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { /* a fixed tree: halves, then quarters, ... */
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}
#define VECTORS 1
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
enum { LANES = 8 };
static inline vec vload(const void *p, long i, int dt) {
    if (dt == BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}
#define VECTORS 1
#else
enum { LANES = 8 };
#define VECTORS 0
#endif

/* Bytes ahead of the weights being read that are asked for early, one request a 64-byte line (the
   next rows: rows follow each other in memory). On a 2-vCPU Sapphire Rapids VM, where one core
   streams only ~12 GB/s, a 60-matrix harness read 7-8.5 GB/s without it and 9.4-10.6 with it
   (AVX-512 and AVX2 builds alike; 1-2 KB ahead gained less, 8 KB no more). The sums are unchanged.
   AVX-512 builds ask 8 KB ahead into the second-level cache only (_MM_HINT_T1, as int4.c's AVX-512
   kernels), leaving the first level's miss slots to the loads: on a 2-vCPU Zen 4 the harness's
   bfloat16 weights (dot products in AVX512_BF16) read at 19.0-19.3 GB/s on one thread against
   16.1-17.0, 29-32 against 20-25 on two, and one-thread bfloat16 generation took 179-196 ms a
   frame against 201-250 (three rounds in turns); AVX2 builds measured alike with either there. */
#define PREFETCH 3072
#define PREFETCH512 8192
static inline void ask_ahead(const void *p) {
#if defined(__AVX512F__)
    _mm_prefetch((const char *)p + PREFETCH512, _MM_HINT_T1);
#elif defined(__AVX2__)
    _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);
#else
    (void)p;
#endif
}

/* One weight row (cols values of dt, at w) against the m activation rows xf (float32, cols each):
   sums[i]. Four independent accumulators per activation row over consecutive vectors (one
   sequential stream of weights: what the prefetchers and the load ports like best), then single
   vectors, then the columns left over, in order. */
static inline __attribute__((always_inline)) void row_dot(const void *w, const int dt, const float *xf, const int m,
                                                           long cols, float sums[2]) {
    long c = 0;
#if VECTORS
    vec a[2][4];
    const long width = dt == F32 ? 4 : 2;
    for (int i = 0; i < 2; i++)
        for (int u = 0; u < 4; u++) a[i][u] = vzero();
    for (; c + 4 * LANES <= cols; c += 4 * LANES)
        for (int u = 0; u < 4; u++) {
            if ((u * LANES * width) % 64 == 0) ask_ahead((const char *)w + (c + u * LANES) * width);
            vec wv = vload(w, c + u * LANES, dt);
            a[0][u] = vfma(wv, vload(xf, c + u * LANES, F32), a[0][u]);
            if (m > 1) a[1][u] = vfma(wv, vload(xf + cols, c + u * LANES, F32), a[1][u]);
        }
    for (; c + LANES <= cols; c += LANES) {
        vec wv = vload(w, c, dt);
        a[0][0] = vfma(wv, vload(xf, c, F32), a[0][0]);
        if (m > 1) a[1][0] = vfma(wv, vload(xf + cols, c, F32), a[1][0]);
    }
    for (int i = 0; i < m; i++) sums[i] = vsum(vadd(vadd(a[i][0], a[i][1]), vadd(a[i][2], a[i][3])));
#else
    float part[2][LANES];
    for (int i = 0; i < 2; i++)
        for (int l = 0; l < LANES; l++) part[i][l] = 0.0f;
    for (; c + LANES <= cols; c += LANES)
        for (int l = 0; l < LANES; l++) {
            float wv = load(w, c + l, dt);
            part[0][l] += wv * xf[c + l];
            if (m > 1) part[1][l] += wv * xf[cols + c + l];
        }
    for (int i = 0; i < m; i++) {
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += part[i][l];
        sums[i] = s;
    }
#endif
    for (int i = 0; i < m; i++)
        for (long k = c; k < cols; k++) sums[i] += load(w, k, dt) * xf[(long)i * cols + k];
}

#if PAIR_DOT
/* bfloat16 weights and activations with AVX512_BF16's pair dot product: 32 columns a vector. */
static void row_dot_bf16(const uint16_t *w, const uint16_t *x, int m, long cols, float sums[2]) {
    __m512 a[2][4];
    for (int i = 0; i < 2; i++)
        for (int u = 0; u < 4; u++) a[i][u] = _mm512_setzero_ps();
    long c = 0;
    for (; c + 128 <= cols; c += 128)
        for (int u = 0; u < 4; u++) {
            ask_ahead(w + c + 32 * u);
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + c + 32 * u));
            a[0][u] = _mm512_dpbf16_ps(a[0][u], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + c + 32 * u)));
            if (m > 1)
                a[1][u] = _mm512_dpbf16_ps(a[1][u], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + cols + c + 32 * u)));
        }
    for (; c + 32 <= cols; c += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + c));
        a[0][0] = _mm512_dpbf16_ps(a[0][0], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + c)));
        if (m > 1) a[1][0] = _mm512_dpbf16_ps(a[1][0], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + cols + c)));
    }
    for (int i = 0; i < m; i++) {
        float s = vsum(vadd(vadd(a[i][0], a[i][1]), vadd(a[i][2], a[i][3])));
        for (long k = c; k < cols; k++) s += from_bf16(w[k]) * from_bf16(x[(long)i * cols + k]);
        sums[i] = s;
    }
}
#endif

#if PAIR_DOT
/* m rows of cols float32 values rounded to bfloat16 (to nearest even, as to_bf16), row by row, so
   that a value's rounding depends only on its column. */
static void to_bf16_rows(const float *x, long m, long cols, uint16_t *out) {
    for (long i = 0; i < m; i++, x += cols, out += cols) {
        long c = 0;
        for (; c + 16 <= cols; c += 16)
            _mm256_storeu_si256((__m256i *)(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + c)));
        for (; c < cols; c++) out[c] = to_bf16(x[c]);
    }
}
#endif

/* row_dot with its dtype and row count constants, so that neither is tested in its loops. */
static void row_dot_any(const void *w, int dt, const float *xf, int m, long cols, float sums[2]) {
    if (dt == BF16)
        m > 1 ? row_dot(w, BF16, xf, 2, cols, sums) : row_dot(w, BF16, xf, 1, cols, sums);
    else if (dt == F16)
        m > 1 ? row_dot(w, F16, xf, 2, cols, sums) : row_dot(w, F16, xf, 1, cols, sums);
    else
        m > 1 ? row_dot(w, F32, xf, 2, cols, sums) : row_dot(w, F32, xf, 1, cols, sums);
}

enum { MAX_ROWS = 256 }; /* activation rows one call takes */

/* One thread's share of gemv_team: weight rows [first, last). */
struct gemv_job {
    const void *w, *x, *bias;
    void *y;
    const float *xf; /* x widened to float32 */
    long rows, cols, first, last;
    int m, dt;
};

static void *gemv_job_run(void *arg) {
    const struct gemv_job *j = arg;
    const long cols = j->cols, width = j->dt == F32 ? 4 : 2; /* bytes per value */
    for (long r = j->first; r < j->last; r++) {
        const void *row = (const char *)j->w + r * cols * width;
        for (int i = 0; i < j->m; i += 2) {
            const int pair = j->m - i < 2 ? j->m - i : 2;
            float sums[2];
#if PAIR_DOT
            if (j->dt == BF16)
                row_dot_bf16((const uint16_t *)row, (const uint16_t *)j->x + (long)i * cols, pair, cols, sums);
            else
#endif
                row_dot_any(row, j->dt, j->xf + (long)i * cols, pair, cols, sums);
            for (int k = 0; k < pair; k++) {
                float v = sums[k];
                if (j->bias) v += load(j->bias, r, j->dt);
                store(j->y, (long)(i + k) * j->rows + r, v, j->dt);
            }
        }
    }
    return NULL;
}

enum { GEMV_THREADS = 16 }; /* at most MAX_JOBS (jobs.h) */

/* y (m x rows, dt) = x (m x cols, dt) @ w.T (w: rows x cols, dt) [+ bias (rows, dt)], 1 <= m <=
   MAX_ROWS, the weight rows split over `threads` threads (stack.c: a step that may take the
   vocoder's core); each row's result is the same whatever the split. Returns 0, -1 for an m it
   does not take, -2 when out of memory. */
int gemv_team(const void *w, const void *x, const void *bias, void *y, long rows, long cols, int m, int dt,
              int threads) {
    if (m < 1 || m > MAX_ROWS) return -1;
    float *xf = line_buffer(sizeof(float) * (size_t)m * (size_t)cols);
    if (!xf) return -2;
    for (long i = 0; i < m * cols; i++) xf[i] = load(x, i, dt);
    threads = job_count(threads, shares(rows, rows * cols * m), GEMV_THREADS);
    struct gemv_job jobs[GEMV_THREADS];
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct gemv_job){w, x, bias, y, xf, rows, cols, rows * i / threads, rows * (i + 1) / threads, m, dt};
    run_jobs(gemv_job_run, jobs, sizeof jobs[0], threads);
    free(xf);
    return 0;
}

/* One thread's share of gemm_wide: weight rows [first, last). */
struct wide_job {
    const void *w;
    int wdt;
    const float *x, *bias;
    float *y;
    long rows, cols, m, first, last;
    const void *tiles; /* the activation rows laid out for the tiles (wide_layout), or NULL */
    const uint16_t *xb; /* x rounded to bfloat16 (PAIR_DOT), or NULL: x as it is */
};

/* Weight rows per pass over the activation pairs: they stay in the second-level cache while a pair
   (two rows of cols floats) stays in the first (a prompt's 27 x 3072 -> 1024 read its weights
   from memory once per pair without it). */
enum { WIDE_ROWS = 16 };

/* Weight row r against activation rows [i0, i1) through row_dot, in pairs: their y, with the bias. */
static void wide_rows(const struct wide_job *j, long r, long i0, long i1) {
    const char *w = (const char *)j->w + r * j->cols * (j->wdt == F32 ? 4 : 2);
    for (long i = i0; i < i1; i += 2) {
        const int pair = i1 - i < 2 ? (int)(i1 - i) : 2;
        float sums[2];
#if PAIR_DOT
        if (j->xb)
            row_dot_bf16((const uint16_t *)w, j->xb + i * j->cols, pair, j->cols, sums);
        else
#endif
            row_dot_any(w, j->wdt, j->x + i * j->cols, pair, j->cols, sums);
        for (int k = 0; k < pair; k++) j->y[(i + k) * j->rows + r] = sums[k] + (j->bias ? j->bias[r] : 0.0f);
    }
}

#if VECTORS
/* A prompt's rows in tiles (gemm_wide): pairs of weight rows against TILE_X activation rows, each
   weight vector widened once for the tile's activation rows and each activation vector loaded once
   for a pair of weight rows (row_dot does both once per pair of activation rows: a prompt's
   bfloat16 products ran at a third of the multiply-add units' rate, 17-24 GMAC/s a thread on a Zen
   3). Every sum is row_dot's: each of an output's four accumulators (a[u], the vectors u, u + 4,
   u + 8, ... of the row) gets the same multiply-adds in the same order, accumulator after
   accumulator over a chunk of TILE_COLS columns, kept in `part` between chunks; then the same
   additions. The activation rows are laid out once per call (wide_layout): each tile's chunks
   with its rows side by side (rows cols floats apart fell in the same first-level cache sets), so
   that a chunk stays in that cache while every weight pair of a block passes (copying the chunk
   for each block of WIDE_ROWS weight rows instead took ~18 % of a 56 x 3072 -> 1024 product).
   Rows whose columns are not whole blocks of four vectors keep row_dot. */
enum { TILE_X = 6, TILE_COLS = 512, PAIRS = WIDE_ROWS / 2 };
typedef vec tile_part[4][2][TILE_X]; /* one weight pair's accumulators: [u][weight row][activation row] */

/* wide_block's dtype for bfloat16 weights and activations in the pair dot product (PAIR_DOT): a
   vector holds 32 columns, and each accumulator gets row_dot_bf16's pair products in its order. */
enum { PAIRED = 3 };

/* The accumulators of `pairs` weight-row pairs (w: the first pair's first row; rows of cols
   values) against nx activation rows over blocks [b0, b1) of four vectors: xs holds those columns
   of the nx rows, TILE_COLS values a row (float32, or bfloat16 where dt is PAIRED). */
static inline __attribute__((always_inline)) void wide_block(const void *w, const int dt, const void *xs, long cols,
                                                             long b0, long b1, int pairs, const int nx,
                                                             tile_part *part) {
    const long width = dt == F32 ? 4 : 2, lanes = dt == PAIRED ? 32 : LANES, step = 4 * lanes;
    for (int p = 0; p < pairs; p++) {
        const void *w0 = (const char *)w + 2 * p * cols * width, *w1 = (const char *)w0 + cols * width;
        for (int u = 0; u < 4; u++) {
            vec a0[TILE_X], a1[TILE_X];
            for (int k = 0; k < nx; k++) {
                a0[k] = b0 ? part[p][u][0][k] : vzero();
                a1[k] = b0 ? part[p][u][1][k] : vzero();
            }
            for (long b = b0; b < b1; b++) {
                const long c = b * step + u * lanes, cx = (b - b0) * step + u * lanes;
#if PAIR_DOT
                if (dt == PAIRED) {
                    const __m512bh v0 = (__m512bh)_mm512_loadu_si512((const uint16_t *)w0 + c);
                    const __m512bh v1 = (__m512bh)_mm512_loadu_si512((const uint16_t *)w1 + c);
                    for (int k = 0; k < nx; k++) {
                        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)xs + k * TILE_COLS + cx);
                        a0[k] = _mm512_dpbf16_ps(a0[k], v0, xv);
                        a1[k] = _mm512_dpbf16_ps(a1[k], v1, xv);
                    }
                    continue;
                }
#endif
                const vec v0 = vload(w0, c, dt), v1 = vload(w1, c, dt);
                for (int k = 0; k < nx; k++) {
                    const vec xv = vload((const float *)xs + k * TILE_COLS, cx, F32);
                    a0[k] = vfma(v0, xv, a0[k]);
                    a1[k] = vfma(v1, xv, a1[k]);
                }
            }
            for (int k = 0; k < nx; k++) part[p][u][0][k] = a0[k], part[p][u][1][k] = a1[k];
        }
    }
}

/* wide_block with its dtype and activation row count constants. */
static void wide_block_any(const void *w, int dt, const void *xs, long cols, long b0, long b1, int pairs, int nx,
                           tile_part *part) {
#define WIDE_BLOCK(n)                                                                                                  \
    do {                                                                                                               \
        if (PAIR_DOT && dt == PAIRED)                                                                                  \
            wide_block(w, PAIRED, xs, cols, b0, b1, pairs, n, part);                                                   \
        else if (dt == BF16)                                                                                           \
            wide_block(w, BF16, xs, cols, b0, b1, pairs, n, part);                                                     \
        else if (dt == F16)                                                                                            \
            wide_block(w, F16, xs, cols, b0, b1, pairs, n, part);                                                      \
        else                                                                                                           \
            wide_block(w, F32, xs, cols, b0, b1, pairs, n, part);                                                      \
    } while (0)
    switch (nx) {
    case 1: WIDE_BLOCK(1); break;
    case 2: WIDE_BLOCK(2); break;
    case 3: WIDE_BLOCK(3); break;
    case 4: WIDE_BLOCK(4); break;
    case 5: WIDE_BLOCK(5); break;
    default: WIDE_BLOCK(TILE_X); break;
    }
#undef WIDE_BLOCK
}

/* Values of x (m rows of cols) laid out for the tiles: for each tile of TILE_X rows, each chunk of
   TILE_COLS columns, the rows' chunks side by side (TILE_COLS values a row, a last chunk padded);
   x holds values of `size` bytes (float32, or bfloat16 for PAIR_DOT). */
static long wide_chunks(long cols) { return (cols + TILE_COLS - 1) / TILE_COLS; }
static long wide_layout_values(long m, long cols) {
    return (m + TILE_X - 1) / TILE_X * wide_chunks(cols) * TILE_X * TILE_COLS;
}
static void wide_layout(const void *x, size_t size, long m, long cols, void *tiles) {
    const long chunks = wide_chunks(cols);
    for (long i = 0; i < m; i++)
        for (long c = 0; c < chunks; c++) {
            const long first = c * TILE_COLS, n = cols - first < TILE_COLS ? cols - first : TILE_COLS;
            const long to = ((i / TILE_X * chunks + c) * TILE_X + i % TILE_X) * TILE_COLS;
            memcpy((char *)tiles + to * (long)size, (const char *)x + (i * cols + first) * (long)size, size * (size_t)n);
        }
}

#if PAIR_DOT
/* The first tile reads its weights from memory, where the pair dot product outruns the hardware's
   own prefetching: it asks for the next chunk's weight rows [r0, r1) from column c0 into the
   second-level cache (on a 2-vCPU Zen 4, 14 x (46 x 3072 -> 1024) products: 98-109 GMAC/s on two
   threads against 75-97 without). */
static void ask_next_chunk(const struct wide_job *j, long r0, long r1, long c0) {
    const long c1 = c0 + TILE_COLS < j->cols ? c0 + TILE_COLS : j->cols;
    for (long r = r0; r < r1; r++)
        for (long c = c0; c < c1; c += 32)
            _mm_prefetch((const char *)((const uint16_t *)j->w + r * j->cols + c), _MM_HINT_T1);
}
#endif

/* Weight rows [r0, r1) (at most WIDE_ROWS) against all activation rows in tiles (j->tiles); an odd
   last weight row through row_dot (row_dot_bf16). */
static void wide_tiles(const struct wide_job *j, long r0, long r1) {
    const long width = j->wdt == F32 ? 4 : 2;
    /* a block: four vectors of floats, or of bfloat16 pairs */
    const long step = j->xb ? 128 : 4 * LANES, blocks = j->cols / step, chunk = TILE_COLS / step;
    const long chunks = wide_chunks(j->cols);
    const int pairs = (int)((r1 - r0) / 2);
    tile_part part[PAIRS];
    for (long i = 0; i < j->m; i += TILE_X) {
        const int nx = j->m - i < TILE_X ? (int)(j->m - i) : TILE_X;
        for (long b0 = 0; b0 < blocks; b0 += chunk) {
            const long b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
            const long at = (i / TILE_X * chunks + b0 / chunk) * TILE_X * TILE_COLS;
            const char *w = (const char *)j->w + r0 * j->cols * width;
#if PAIR_DOT
            if (j->xb && i == 0 && b1 < blocks) ask_next_chunk(j, r0, r1, b1 * 128);
#endif
            const void *xs = (const char *)j->tiles + at * (j->xb ? sizeof(uint16_t) : sizeof(float));
            wide_block_any(w, j->xb ? PAIRED : j->wdt, xs, j->cols, b0, b1, pairs, nx, part);
        }
        for (int p = 0; p < pairs; p++)
            for (int q = 0; q < 2; q++) {
                const long r = r0 + 2 * p + q;
                const vec(*a)[2][TILE_X] = part[p];
                for (int k = 0; k < nx; k++)
                    j->y[(i + k) * j->rows + r] =
                        vsum(vadd(vadd(a[0][q][k], a[1][q][k]), vadd(a[2][q][k], a[3][q][k]))) +
                        (j->bias ? j->bias[r] : 0.0f);
            }
        if (r0 + 2 * pairs < r1) wide_rows(j, r1 - 1, i, i + nx); /* the odd last row */
    }
}
#endif

static void *wide_job_run(void *arg) {
    const struct wide_job *j = arg;
    for (long r0 = j->first; r0 < j->last; r0 += WIDE_ROWS) {
        const long r1 = r0 + WIDE_ROWS < j->last ? r0 + WIDE_ROWS : j->last;
#if VECTORS
        if (j->tiles) {
            wide_tiles(j, r0, r1);
            continue;
        }
#endif
        for (long i = 0; i < j->m; i += 2)
            for (long r = r0; r < r1; r++) wide_rows(j, r, i, i + 2 < j->m ? i + 2 : j->m);
    }
    return NULL;
}

enum { WIDE_THREADS = 16 }; /* at most MAX_JOBS (jobs.h) */

/* y (m x rows, float32) = x (m x cols, float32) @ w.T (w: rows x cols of wdt) [+ bias (rows,
   float32)]: weights kept narrow, results not rounded (kazeia/int4.py's output heads, and the
   talker's down projections int4 keeps in bfloat16). Same summation as `gemv_team` (row_dot,
   activation rows in pairs): each row's result is that of m = 1, whatever m, the weight rows' split
   over `threads` threads (a prompt's product) or the order they are taken in. With PAIR_DOT,
   bfloat16 weights meet the activations rounded to bfloat16 in the pair dot product (row_dot_bf16,
   wide_block): twice the multiply-adds an instruction of float32's, for a rounding of x finer
   than int4's own activations' (8-bit codes per block of 128); the activations stay float32
   otherwise. Returns 0, -1 for a shape it does not take, -2 when out of memory. */
int gemm_wide(const void *w, int wdt, const float *x, const float *bias, float *y, long rows, long cols, long m,
              int threads) {
    if (m < 1 || rows < 1 || cols < 1) return -1;
    threads = job_count(threads, shares(rows, rows * cols * m), WIDE_THREADS);
    uint16_t *xb = NULL;
#if PAIR_DOT
    if (wdt == BF16) { /* x rounded to bfloat16 once, the same way for every row and every m */
        if (!(xb = line_buffer(sizeof(uint16_t) * (size_t)(m * cols)))) return -2;
        to_bf16_rows(x, m, cols, xb);
    }
#endif
    void *tiles = NULL; /* where it cannot be had, the rows go through row_dot: the same sums */
#if VECTORS
    /* the pair dot product's rows in pairs (row_dot_bf16, each weight row asked for ahead) beat its
       tiles below three tiles' worth of rows (Zen 4: 58 against 38-45 GMAC/s at 6 rows, 77 against
       63-71 at 12) */
    const long block = xb ? 128 : 4 * LANES, fewest = xb ? 3 * TILE_X : TILE_X;
    const size_t size = xb ? sizeof(uint16_t) : sizeof(float);
    if (m >= fewest && cols % block == 0 && (tiles = line_buffer(size * (size_t)wide_layout_values(m, cols))))
        wide_layout(xb ? (const void *)xb : (const void *)x, size, m, cols, tiles);
#endif
    struct wide_job jobs[WIDE_THREADS];
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct wide_job){w, wdt, x, bias, y, rows, cols, m, rows * i / threads, rows * (i + 1) / threads,
                                    tiles, xb};
    run_jobs(wide_job_run, jobs, sizeof jobs[0], threads);
    free(tiles);
    free(xb);
    return 0;
}
