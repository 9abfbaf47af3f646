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
    if (threads > most) threads = (int)most;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    struct snake_job jobs[MAX_THREADS];
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct snake_job){x, factors, factors + channels, y, rows * i / threads, rows * (i + 1) / threads,
                                     length, channels, x_batch_stride, y_batch_stride};
    run_jobs(snake_job_run, jobs, sizeof jobs[0], threads);
    free(factors);
    return 0;
}
