/* The vocoder's SnakeBeta activation, y = x + sin(x * alpha)^2 / (beta + 1e-9) per channel, in one
   pass (alpha and beta are stored as logs, as in kazeia/vocoder.py).

   In PyTorch it takes five passes over the activations (scale, sin, square, scale, add), at up to
   24 kHz times 96 channels; with the sine below it is one read and one write per value.

   sin(v)^2 = sin(r)^2 for r = v - k*pi, k the integer nearest v/pi, so r lies in [-pi/2, pi/2]
   and the sign of sin(r) never matters. pi is split in two float32 parts (Cody-Waite) so that r is
   accurate to a float32 rounding for |v| up to ~1e5; larger arguments go to libm's sinf. sin(r) is
   its Taylor series to r^13 (truncation below 7e-10 on [-pi/2, pi/2]): as accurate as PyTorch's
   vectorized sin (measured against float64: the same ~7e-7 worst absolute error on the output).
   Written so the compiler vectorizes it (fmaf, no branches in the common path). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "jobs.h"

static inline float sin_squared(float v) {
    const float inv_pi = 0.318309886183790671538f;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding and removing it rounds to an integer */
    const float pi_hi = 3.14159274101257324219f, pi_lo = -8.74227765734758577e-8f; /* pi_hi + pi_lo = pi */
    float k = (v * inv_pi + magic) - magic;
    float r = fmaf(-k, pi_hi, v);
    r = fmaf(-k, pi_lo, r);
    float r2 = r * r;
    float p = fmaf(r2, 1.0f / 6227020800.0f, -1.0f / 39916800.0f);
    p = fmaf(p, r2, 1.0f / 362880.0f);
    p = fmaf(p, r2, -1.0f / 5040.0f);
    p = fmaf(p, r2, 1.0f / 120.0f);
    p = fmaf(p, r2, -1.0f / 6.0f);
    float s = fmaf(p * r2, r, r);
    return s * s;
}

enum { LARGE = 100000 }; /* |x * alpha| beyond this: libm's sinf */

struct snake_job {
    const float *x, *alpha, *inv_beta; /* alpha, inv_beta: one per channel */
    float *y;
    long first, last; /* positions (b * length + t) of this job */
    long length, channels, x_batch_stride, y_batch_stride;
};

static void *snake_job_run(void *arg) {
    const struct snake_job *j = arg;
    const long C = j->channels;
    for (long row = j->first; row < j->last; row++) {
        const long b = row / j->length, t = row % j->length;
        const float *xr = j->x + b * j->x_batch_stride + t * C;
        float *yr = j->y + b * j->y_batch_stride + t * C;
        int large = 0;
        for (long c = 0; c < C; c++) {
            float v = xr[c], u = v * j->alpha[c];
            large |= !(fabsf(u) <= (float)LARGE); /* NaN too */
            yr[c] = v + sin_squared(u) * j->inv_beta[c];
        }
        if (large)
            for (long c = 0; c < C; c++) {
                float u = xr[c] * j->alpha[c];
                if (!(fabsf(u) <= (float)LARGE)) {
                    float sn = sinf(u);
                    yr[c] = xr[c] + sn * sn * j->inv_beta[c];
                }
            }
    }
    return NULL;
}

enum { MAX_THREADS = MAX_JOBS, MIN_VALUES_PER_THREAD = 32768 };

/* Time-major activations: x and y hold `batch` blocks of `length` positions of `channels` values
   (contiguous within a block); blocks start x_batch_stride / y_batch_stride floats apart (y may be
   a window of a wider buffer, or x itself). alpha = exp(log_alpha), beta = exp(log_beta) per
   channel. The positions are split over up to `threads` threads (this one included), never fewer
   than MIN_VALUES_PER_THREAD values each; every value is computed the same way whatever the split.
   Returns 0, or -1 when out of memory (nothing written). */
int snake_beta(const float *x, float *y, const float *log_alpha, const float *log_beta, long batch, long length,
               long channels, long x_batch_stride, long y_batch_stride, int threads) {
    float *factors = malloc(sizeof(float) * 2 * (size_t)(channels > 0 ? channels : 1));
    if (!factors) return -1;
    for (long c = 0; c < channels; c++) {
        factors[c] = expf(log_alpha[c]);
        factors[channels + c] = 1.0f / (expf(log_beta[c]) + 1e-9f);
    }
    const long rows = batch * length;
    long most = rows * channels / MIN_VALUES_PER_THREAD;
    threads = job_count(threads, most, MAX_THREADS);
    struct snake_job jobs[MAX_THREADS];
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct snake_job){x, factors, factors + channels, y, rows * i / threads, rows * (i + 1) / threads,
                                     length, channels, x_batch_stride, y_batch_stride};
    run_jobs(snake_job_run, jobs, sizeof jobs[0], threads);
    free(factors);
    return 0;
}

/* ---- the rest of the decoder's per-row and per-position work -----------------------------------
   Each value below is computed from its own row or position with a fixed sequence of operations
   (sums in a fixed order, libm's scalar expf/erff), whatever the number of rows or positions of
   the call: the vocoder's audio is then the same for any split of a stream into chunks
   (kazeia/vocoder.py). */

#ifdef __FMA__
#define MADD(a, b, c) fmaf(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

/* sum of a[i] * b[i] (or of a[i] when b is NULL) in 16 interleaved partial sums, then those in order. */
static float partial_sums(const float *a, const float *b, long n) {
    float part[16] = {0.0f}, sum = 0.0f;
    long i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) part[l] += b ? a[i + l] * b[i + l] : a[i + l];
    for (; i < n; i++) part[0] += b ? a[i] * b[i] : a[i];
    for (int l = 0; l < 16; l++) sum += part[l];
    return sum;
}

/* LayerNorm of `rows` rows of n values (biased variance): y = (x - mean) / sqrt(var + eps) * w + b.
   x and y may be the same rows. */
void layer_norm_rows(const float *x, const float *w, const float *b, float *y, long rows, long n, float eps) {
    float centred[n];
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        const float mean = partial_sums(xr, NULL, n) / (float)n;
        for (long i = 0; i < n; i++) centred[i] = xr[i] - mean;
        const float rstd = 1.0f / sqrtf(partial_sums(centred, centred, n) / (float)n + eps);
        float *yr = y + r * n;
        for (long i = 0; i < n; i++) yr[i] = centred[i] * rstd * w[i] + b[i];
    }
}

/* The exact GELU, x / 2 * (1 + erf(x / sqrt 2)), of `rows` rows of n values in place (row by row:
   a value's place in its loop depends on its channel only, should a compiler vectorize erff). */
void gelu_rows(float *x, long rows, long n) {
    for (long r = 0; r < rows; r++) {
        float *xr = x + r * n;
        for (long i = 0; i < n; i++) xr[i] = xr[i] * 0.5f * (1.0f + erff(xr[i] * 0.70710678118654752440f));
    }
}

/* Depthwise causal convolution over time-major rows: y[t][c] = sum over j of x[t + j d][c] * w[j][c]
   (in tap order, from 0), + bias[c]. x: batch blocks of (taps - 1) * d + length rows of `channels`
   values, x_batch floats apart; y: batch blocks of `length` rows, y_batch floats apart; w: (taps,
   channels). */
void depthwise_conv(const float *x, long x_batch, const float *w, const float *bias, float *y, long y_batch, long batch,
                    long length, long channels, int taps, int dilation) {
    for (long b = 0; b < batch; b++)
        for (long t = 0; t < length; t++) {
            const float *xt = x + b * x_batch + t * channels;
            float *yt = y + b * y_batch + t * channels;
            for (long c = 0; c < channels; c++) yt[c] = 0.0f;
            for (int j = 0; j < taps; j++) {
                const float *xj = xt + (long)j * dilation * channels, *wj = w + (long)j * channels;
                for (long c = 0; c < channels; c++) yt[c] = MADD(xj[c], wj[c], yt[c]);
            }
            for (long c = 0; c < channels; c++) yt[c] += bias[c];
        }
}

/* x * cos + roll(x, hd / 2) * sin, over hd values (sin with its first half negated). */
static void rotate(const float *x, const float *cos, const float *sin, float *y, int hd) {
    const int half = hd / 2;
    for (int i = 0; i < hd; i++) y[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
}

/* Sliding-window attention of n new positions (frames start .. start + n - 1) of each of `batch`
   streams. qkv: (batch, n, (nq + 2 nkv) * hd) rows, queries, keys, values before the rotation;
   cos, sin: (n, hd), frame start + i in row i; k_cache, v_cache: (batch, nkv, keep, hd), the
   rotated keys and the values of the `keep` frames before `start` (frames before 0: anything, never
   read), replaced by those of the last `keep` frames; out: (batch, n, nq * hd). The query of frame
   f attends to frames max(0, f - keep) .. f in that order (the window of keep + 1): scores
   q.k / sqrt(hd), their softmax (exp of score - max, summed in order), the values weighted in
   order. Returns 0, or -1 when out of memory (nothing written). */
int window_attend(const float *qkv, const float *cos, const float *sin, float *k_cache, float *v_cache, float *out,
                  long batch, long n, int nq, int nkv, int hd, int keep, long start) {
    const long span = keep + n, width = (long)(nq + 2 * nkv) * hd, group = nq / nkv;
    float *keys = malloc(sizeof(float) * (size_t)(2 * nkv * span * hd + hd + keep + 1));
    if (!keys) return -1;
    float *values = keys + nkv * span * hd, *q = values + nkv * span * hd, *p = q + hd;
    const float scale = 1.0f / sqrtf((float)hd);
    for (long b = 0; b < batch; b++) {
        float *kc = k_cache + b * nkv * keep * hd, *vc = v_cache + b * nkv * keep * hd;
        for (int h = 0; h < nkv; h++) { /* keys[h]: frames start - keep .. start + n - 1 */
            memcpy(keys + h * span * hd, kc + (long)h * keep * hd, sizeof(float) * (size_t)(keep * hd));
            memcpy(values + h * span * hd, vc + (long)h * keep * hd, sizeof(float) * (size_t)(keep * hd));
            for (long i = 0; i < n; i++) {
                const float *row = qkv + (b * n + i) * width;
                rotate(row + (long)(nq + h) * hd, cos + i * hd, sin + i * hd, keys + (h * span + keep + i) * hd, hd);
                memcpy(values + (h * span + keep + i) * hd, row + (long)(nq + nkv + h) * hd, sizeof(float) * (size_t)hd);
            }
        }
        for (long i = 0; i < n; i++)
            for (int h = 0; h < nq; h++) {
                const long kv = h / group, first = keep - start > i ? keep - start : i; /* entry of frame max(0, f - keep) */
                const float *kh = keys + kv * span * hd, *vh = values + kv * span * hd;
                rotate(qkv + (b * n + i) * width + (long)h * hd, cos + i * hd, sin + i * hd, q, hd);
                float top = -INFINITY, total = 0.0f;
                for (long e = first; e <= i + keep; e++) {
                    p[e - first] = partial_sums(q, kh + e * hd, hd) * scale;
                    if (p[e - first] > top) top = p[e - first];
                }
                for (long e = first; e <= i + keep; e++) {
                    p[e - first] = expf(p[e - first] - top);
                    total += p[e - first];
                }
                float *o = out + (b * n + i) * (long)nq * hd + (long)h * hd;
                for (int d = 0; d < hd; d++) o[d] = 0.0f;
                for (long e = first; e <= i + keep; e++)
                    for (int d = 0; d < hd; d++) o[d] = MADD(p[e - first], vh[e * hd + d], o[d]);
                for (int d = 0; d < hd; d++) o[d] /= total;
            }
        for (int h = 0; h < nkv; h++) {
            memcpy(kc + (long)h * keep * hd, keys + (h * span + n) * hd, sizeof(float) * (size_t)(keep * hd));
            memcpy(vc + (long)h * keep * hd, values + (h * span + n) * hd, sizeof(float) * (size_t)(keep * hd));
        }
    }
    free(keys);
    return 0;
}
