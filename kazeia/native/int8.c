/* Products with int8 weights (kazeia/quant.py): y[i][r] = sum over c of x[i][c] * w[r][c] (+ b[r])
   for float32 activation rows x (m of them, any m >= 1).

   Weights: int8 values q[r][c] and one float32 scale s[r] per row (symmetric, per output channel).

   Activations: each row is rounded to 16 bits on a grid of its own: step t = max |x| / 32767,
   codes p = round(x * (32767 / max |x|)) (float32 product, nearest even, within +-32767). The
   row's result is
       y = (float)((double)(q . p) * ((double)t * (double)s[r]))  [+ b[r], in float32]
   where q . p is the exact integer dot product (64-bit). A row whose values are all zero has step
   0 (y = b); one with a value that is not finite gets NaN.

   Exactness. The vector kernels sum 16-bit products in 32-bit lanes: at most 512 products a lane
   (|q p| <= 127 * 32767, times 512 < 2^31) before the lanes are widened to 64 bits and added, so
   every build computes the same integer, whatever the order: the result depends only on the row
   and the weights, never on m, the other rows, the tiling or the instructions (AVX-512 BW or
   AVX2 vpmaddwd, plain C). Batched steps rely on it (kazeia/batch.py), and
   a float64 matrix product reproduces it exactly (`quant.reference_product`, the tests).

   Why 16 bits: one 8-bit row per input costs ~0.8 % of a product in rounding on the real-size
   model, as much as the weights' own rounding; 16 bits leave only the weights'. A 16-bit product
   costs one multiply-add instruction per 32 weights (AVX-512) per activation row, as an 8-bit row
   and its rounding residual do in the int8 GEMM (its way to this precision).

   Weight layout (`quant.interleave`): groups of ROWS = 4 rows, each group cut in chunks of CHUNK =
   32 columns with the 4 rows' pieces side by side, so that a group is one sequential stream (the
   prefetchers follow one stream best; reading rows side by side from the plain layout was ~2x
   slower). The work: one group against up to 4 activation rows (AVX-512; 2 with AVX2's 16
   registers) with all sums in registers, each weight loaded and widened to 16 bits once a pass;
   more activation rows take more passes over the group, then in the first-level cache. A
   decoding step's product runs on the calling thread (one weight stream); a prompt's
   splits the groups over threads (int8_gemm, `cpu.team`). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jobs.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { ROWS = 4, CHUNK = 32, LIMIT = 32767 };
/* Bytes ahead of the weights being read that are asked for early (the stream's next chunks). */
#define PREFETCH 4096

/* Which kernel this build runs, for tests and logs: 2 AVX-512 BW, 1 AVX2, 0 C. */
int int8_kernel(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* Round one row to 16-bit codes p; returns its step (0 for a zero row, NaN for one that is not
   finite). Vector and scalar code round alike: float32 products, to nearest even. */
static float int8_quantize_row(const float *x, long cols, int16_t *p) {
    float amax = 0.0f;
    int finite = 1;
    long c = 0;
#if defined(__AVX512F__)
    __m512 top = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (; c + 16 <= cols; c += 16) {
        __m512 v = _mm512_loadu_ps(x + c);
        bad |= _mm512_cmp_ps_mask(_mm512_mul_ps(v, _mm512_setzero_ps()), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        top = _mm512_max_ps(top, _mm512_abs_ps(v));
    }
    amax = _mm512_reduce_max_ps(top);
    finite = bad == 0;
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (; c + 8 <= cols; c += 8) {
        __m256 v = _mm256_loadu_ps(x + c);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_mul_ps(v, _mm256_setzero_ps()), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    finite = _mm256_movemask_ps(bad) == 0;
#endif
    for (; c < cols; c++) {
        finite &= isfinite(x[c]) != 0;
        amax = fabsf(x[c]) > amax ? fabsf(x[c]) : amax;
    }
    if (!finite || !(amax > 0.0f)) {
        memset(p, 0, sizeof(int16_t) * (size_t)cols);
        return finite ? 0.0f : NAN;
    }
    const float inverse = (float)LIMIT / amax;
    c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= cols; c += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), _mm512_set1_ps(inverse)));
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(LIMIT)), _mm512_set1_epi32(-LIMIT));
        _mm256_storeu_si256((__m256i *)(p + c), _mm512_cvtepi32_epi16(v));
    }
#elif defined(__AVX2__)
    for (; c + 16 <= cols; c += 16) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c), _mm256_set1_ps(inverse)));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c + 8), _mm256_set1_ps(inverse)));
        a = _mm256_max_epi32(_mm256_min_epi32(a, _mm256_set1_epi32(LIMIT)), _mm256_set1_epi32(-LIMIT));
        b = _mm256_max_epi32(_mm256_min_epi32(b, _mm256_set1_epi32(LIMIT)), _mm256_set1_epi32(-LIMIT));
        _mm256_storeu_si256((__m256i *)(p + c), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
#endif
    for (; c < cols; c++) {
        long v = lrintf(x[c] * inverse);
        p[c] = (int16_t)(v > LIMIT ? LIMIT : v < -LIMIT ? -LIMIT : v);
    }
    return amax / (float)LIMIT;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 32 columns a vector; a pass takes 4 activation rows (16 sums + 4 activations in registers); a
   32-bit lane gets 2 products per 32 columns, so BLOCK columns give it 512 at most. */
enum { STEP = 32, BLOCK = 8192 };
#define PASS 4
typedef __m512i acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_si512(); }
static inline acc_t widen(const int8_t *w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)); }
static inline acc_t load16(const int16_t *x) { return _mm512_loadu_si512((const void *)x); }
/* vpmaddwd then vpaddd: on a Zen 4 VM VNNI's fused vpdpwssd was no faster in this loop. */
static inline acc_t acc_dot(acc_t a, acc_t w, acc_t x) { return _mm512_add_epi32(a, _mm512_madd_epi16(w, x)); }
static inline int64_t acc_sum(acc_t a) {
    __m512i low = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a));
    __m512i high = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1));
    return _mm512_reduce_add_epi64(_mm512_add_epi64(low, high));
}
#define VECTORS 1
#elif defined(__AVX2__)
/* 16 columns a vector (a chunk of 32 in two); 2 activation rows a pass (16 registers); a lane gets
   4 products per 32 columns. */
enum { STEP = 16, BLOCK = 4096 };
#define PASS 2
typedef __m256i acc_t;
static inline acc_t acc_zero(void) { return _mm256_setzero_si256(); }
static inline acc_t widen(const int8_t *w) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)); }
static inline acc_t load16(const int16_t *x) { return _mm256_loadu_si256((const __m256i *)x); }
static inline acc_t acc_dot(acc_t a, acc_t w, acc_t x) { return _mm256_add_epi32(a, _mm256_madd_epi16(w, x)); }
static inline int64_t acc_sum(acc_t a) {
    __m256i low = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(a));
    __m256i high = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1));
    __m256i s = _mm256_add_epi64(low, high);
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
}
#define VECTORS 1
#else
#define PASS 4
#define VECTORS 0
#endif

/* The exact dot products of one group of ROWS weight rows (w: their interleaved chunks, see
   int8_gemm) with R activation rows (p, p + cols, ...): out[k][i]. One sequential stream of
   weights (what the prefetchers follow best; reading rows side by side is markedly slower), each
   weight widened once per pass. R is a constant at each call, so each R gets its own loop with
   its sums in registers. */
static inline __attribute__((always_inline)) void group_dots(const int8_t *w, const int16_t *p, long cols, const int R,
                                                             int64_t out[ROWS][PASS]) {
    for (int k = 0; k < ROWS; k++)
        for (int i = 0; i < R; i++) out[k][i] = 0;
    long c = 0;
#if VECTORS
    for (; c < cols;) {
        const long end = c + BLOCK < cols ? c + BLOCK : cols;
        acc_t a[ROWS][PASS];
        for (int k = 0; k < ROWS; k++)
            for (int i = 0; i < R; i++) a[k][i] = acc_zero();
        for (; c < end; c += CHUNK) {
            const int8_t *chunk = w + c * ROWS;
            _mm_prefetch((const char *)(chunk + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(chunk + 64 + PREFETCH), _MM_HINT_T0);
            for (int h = 0; h < CHUNK; h += STEP) {
                acc_t wv[ROWS];
                for (int k = 0; k < ROWS; k++) wv[k] = widen(chunk + k * CHUNK + h);
                for (int i = 0; i < R; i++) {
                    acc_t xv = load16(p + i * cols + c + h);
                    /* in a register, loaded once for the ROWS products (the compiler would rather
                       fold a load into each, which then bounds the loop) */
                    __asm__("" : "+v"(xv));
                    for (int k = 0; k < ROWS; k++) a[k][i] = acc_dot(a[k][i], wv[k], xv);
                }
            }
        }
        for (int k = 0; k < ROWS; k++)
            for (int i = 0; i < R; i++) out[k][i] += acc_sum(a[k][i]);
    }
#else
    for (; c < cols; c += CHUNK)
        for (int k = 0; k < ROWS; k++)
            for (int i = 0; i < R; i++) {
                int32_t s = 0;
                for (int h = 0; h < CHUNK; h++) s += (int32_t)w[c * ROWS + k * CHUNK + h] * p[i * cols + c + h];
                out[k][i] += s;
            }
#endif
}

/* group_dots() for the R of a call (1..PASS). */
static void group_dots_any(const int8_t *w, const int16_t *p, long cols, int R, int64_t out[ROWS][PASS]) {
    switch (R) {
    case 1:
        group_dots(w, p, cols, 1, out);
        return;
#if PASS > 2
    case 3:
        group_dots(w, p, cols, 3, out);
        return;
    case 4:
        group_dots(w, p, cols, 4, out);
        return;
#endif
    default:
        group_dots(w, p, cols, 2, out);
    }
}

/* One thread's share of a product: weight rows [first, last) against the m rounded rows. */
struct int8_job {
    const int8_t *q;
    const int16_t *p;
    const float *scales, *steps, *bias;
    float *y;
    long rows, cols, m, first, last;
};

static void *int8_job_run(void *arg) {
    const struct int8_job *j = arg;
    const long cols = j->cols;
    for (long r = j->first; r < j->last; r += ROWS) {
        for (long i = 0; i < j->m; i += PASS) {
            const int R = j->m - i >= PASS ? PASS : (int)(j->m - i);
            int64_t dots[ROWS][PASS];
            group_dots_any(j->q + r * cols, j->p + i * cols, cols, R, dots);
            for (int k = 0; k < ROWS; k++)
                for (int n = 0; n < R; n++) {
                    float v = (float)((double)dots[k][n] * ((double)j->steps[i + n] * (double)j->scales[r + k]));
                    if (j->bias) v += j->bias[r + k];
                    j->y[(i + n) * j->rows + r + k] = v;
                }
        }
    }
    return NULL;
}

enum { MAX_THREADS = 16 }; /* at most MAX_JOBS (jobs.h) */

/* y (m x rows) = x (m x cols) @ W.T [+ bias]: W int8 q (rows x cols) with row scales (rows,
   float32). The weight rows are split over `threads` threads (a prompt's product); every result
   is the one computed on one. Returns 0, -1 for a shape it does not take, -2 out of memory. */
int int8_gemm(const int8_t *q, const float *scales, const float *x, const float *bias, float *y, long rows, long cols,
              long m, int threads) {
    if (m < 1 || rows < ROWS || rows % ROWS || cols < CHUNK || cols % CHUNK) return -1;
    int16_t *p = line_buffer(sizeof(int16_t) * (size_t)(m * cols));
    float *steps = malloc(sizeof(float) * (size_t)m);
    if (!p || !steps) {
        free(p);
        free(steps);
        return -2;
    }
    for (long i = 0; i < m; i++) steps[i] = int8_quantize_row(x + i * cols, cols, p + i * cols);
    const long groups = rows / ROWS;
    threads = job_count(threads, shares(groups, rows * cols * m), MAX_THREADS);
    struct int8_job jobs[MAX_THREADS];
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct int8_job){q, p, scales, steps, bias, y, rows, cols, m,
                                    groups * i / threads * ROWS, groups * (i + 1) / threads * ROWS};
    run_jobs(int8_job_run, jobs, sizeof jobs[0], threads);
    free(p);
    free(steps);
    return 0;
}
