/* Products of a few activation rows with a weight matrix, for decoding steps (gemv_team may split
   the weight rows over threads: a step that takes the vocoder's core):
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
   are those of m = 1, so a batched step gives every request exactly its solo result. Weights and
   activations of dt (0 float32, 1 bfloat16, 2 float16) are widened to float32 and multiplied with
   fused multiply-adds; with AVX512_BF16, bfloat16 pairs go through its dot product (exact
   products, float32 sums). Outputs are rounded to dt once, as a float32-accumulating matmul does. Which
   instructions are used is decided by the build's target flags (kazeia/cpu.py). */

#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "jobs.h"

/* Whether bfloat16 weights meet bfloat16 activations in AVX512_BF16's pair dot product (exact
   products, float32 sums): the bfloat16 models' products. */
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
