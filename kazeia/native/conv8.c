/* The int8 vocoder's convolution (kazeia/conv.py's `Tiled8`): int8 weights with one scale per
   output channel, int8 inputs with one scale per input row (time step), exact int32 sums.

   A causal convolution of `taps` taps of dilation d over time-major rows, as conv.c's `vconv`:
       y[t][n] = sw[n] * (sum over tap of sx[t + tap d] * S[t][tap][n]) + bias[n] (+ res[t][n])
       S[t][tap][n] = sum over c of qx[t + tap d][c] * qw[n][tap][c]      (an exact integer)
   with qw[n] = round(w[n] / sw[n]), sw[n] = max |w[n]| / 127, and each input row quantized alone:
   sx[r] = max |x[r]| / 127, qx[r] = round(x[r] * (127 / max |x[r]|)), both within -127..127. A row's
   codes depend on that row only, so a position's output is the same whatever chunk, batch or
   thread count it is computed in.

   Every path gives the same bits: S is an integer (|S| <= cin * 127 * 127 < 2^31 for the cin
   `vconv8` accepts), and the float steps are one fixed sequence, no fused multiply-add: per tap in
   order, y := (tap 0 ? 0 : y) + (float)S * sx; then y * sw[n], + bias, + res. The kernels
   (conv8.h: AVX-512 VNNI, AVX2, portable C) only differ in how S is summed and how many positions
   and channels a tile holds. Built with the rest of kazeia/native; the build's flags choose the
   path (kazeia/cpu.py). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conv8.h"
#include "jobs.h"

enum { PW = Q8_PW, MAX_CIN = 1 << 16 };

/* k values per tap, padded to whole groups of four (zeros in weights and inputs). */
static long padded(long cin) { return (cin + 3) / 4 * 4; }
static long panels(long n) { return (n + PW - 1) / PW; }

/* Packed layout, per panel p of PW channels: weights (taps, kp / Q8_K, PW, Q8_K) q8_weight; then for all
   panels minus the VNNI offset shares (panels, taps, PW) int32; then the scales (panels * PW) float. The
   panel width is the build's (conv8.h), so a packed weight belongs to the library that packed it. */
long vconv8_packed_bytes(long n, int taps, long cin) {
    const long np = panels(n) * PW;
    return np * taps * padded(cin) * (long)sizeof(q8_weight) + (long)sizeof(int32_t) * np * taps +
           (long)sizeof(float) * np;
}

/* Which path this build runs: 2 VNNI, 1 AVX2, 0 portable (for tests and logs). */
int vconv8_kernel(void) {
#if defined(Q8_VNNI)
    return 2;
#elif defined(Q8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* w: (n, taps, cin) float32 -> packed (`vconv8_packed_bytes`). */
void vconv8_pack(const float *w, long n, int taps, long cin, void *packed) {
    const long kp = padded(cin), np = panels(n) * PW;
    q8_weight *q = packed;
    int32_t *offset = (int32_t *)(q + np * taps * kp);
    float *scale = (float *)(offset + np * taps);
    memset(packed, 0, (size_t)vconv8_packed_bytes(n, taps, cin));
    for (long o = 0; o < n; o++) {
        const float *row = w + o * taps * cin;
        float most = 0.0f;
        for (long k = 0; k < taps * cin; k++) most = fabsf(row[k]) > most ? fabsf(row[k]) : most;
        scale[o] = most / 127.0f;
        const float inv = most > 0.0f ? 127.0f / most : 0.0f;
        const long p = o / PW, j = o % PW;
        for (int tap = 0; tap < taps; tap++) {
            int32_t sum = 0;
            for (long c = 0; c < cin; c++) {
                long v = lrintf(row[tap * cin + c] * inv);
                v = v > 127 ? 127 : v < -127 ? -127 : v;
                q[p * PW * taps * kp + ((tap * kp + c) / Q8_K * PW + j) * Q8_K + c % Q8_K] = (q8_weight)v;
                sum += (int32_t)v;
            }
            offset[(p * taps + tap) * PW + j] = -128 * sum;
        }
    }
}

struct q8_call {
    const float *x, *res, *bias;
    float *y;
    const q8_weight *qw;
    const int32_t *offset;
    const float *sw;
    long x_batch, ldx, res_batch, ldres, y_batch, ldy, length, cin, n, kp, dilation;
    int taps;
};

struct q8_job {
    const struct q8_call *c;
    long tile0, tile1; /* tiles of Q8_MR positions, counted over the batch entries in order */
    int failed;
};

/* Positions m0 .. m1 - 1 of batch entry b: their input rows quantized into qx / sx (one job's own
   buffers, so a row's codes never depend on the split), then every panel, Q8_MR positions a tile. */
static void q8_span(const struct q8_call *c, long b, long m0, long m1, q8_code *qx, float *sx) {
    const long rows = m1 - m0 + (long)(c->taps - 1) * c->dilation;
    const float *x = c->x + b * c->x_batch + m0 * c->ldx;
    for (long r = 0; r < rows; r++) sx[r] = q8_quantize(x + r * c->ldx, c->cin, c->kp, qx + r * c->kp);
    const long np = panels(c->n);
    for (long p = 0; p < np; p++) {
        const long n0 = p * PW;
        const struct q8_panel panel = {c->qw + p * PW * c->taps * c->kp,
                                       c->offset + p * c->taps * PW,
                                       c->sw + n0,
                                       c->bias ? c->bias + n0 : NULL,
                                       c->kp,
                                       c->dilation,
                                       c->taps,
                                       (int)(c->n - n0 < PW ? c->n - n0 : PW)};
        for (long m = m0; m < m1; m += Q8_MR) {
            const int valid = (int)(m1 - m < Q8_MR ? m1 - m : Q8_MR);
            float *y = c->y + b * c->y_batch + m * c->ldy + n0;
            const float *res = c->res ? c->res + b * c->res_batch + m * c->ldres + n0 : NULL;
            q8_tile(&panel, qx + (m - m0) * c->kp, sx + (m - m0), valid, y, c->ldy, res, c->ldres);
        }
    }
}

static void *q8_job_run(void *arg) {
    struct q8_job *j = arg;
    const struct q8_call *c = j->c;
    const long per = (c->length + Q8_MR - 1) / Q8_MR; /* tiles per batch entry */
    const long most = (j->tile1 - j->tile0) * Q8_MR + (long)(c->taps - 1) * c->dilation;
    q8_code *qx = line_buffer(sizeof(q8_code) * (size_t)(most * c->kp));
    float *sx = malloc(sizeof(float) * (size_t)most);
    if (!qx || !sx) {
        j->failed = 1;
    } else {
        for (long t = j->tile0; t < j->tile1;) {
            const long b = t / per, end = (b + 1) * per < j->tile1 ? (b + 1) * per : j->tile1;
            const long m0 = (t - b * per) * Q8_MR, m1 = (end - b * per) * Q8_MR;
            q8_span(c, b, m0, m1 < c->length ? m1 : c->length, qx, sx);
            t = end;
        }
    }
    free(qx);
    free(sx);
    return NULL;
}

enum { Q8_MIN_MACS_PER_THREAD = 1 << 21 };

/* y (batch blocks of `length` rows) := the int8 convolution above of x (batch blocks of
   (taps - 1) * dilation carried rows + `length` rows) with the packed weight w (`vconv8_pack`),
   + bias (n floats or NULL), + res (rows like y, or NULL). Strides in floats; rows hold cin (x)
   or n (y, res) contiguous values. The positions are split over up to `threads` threads (this one
   included), each quantizing the input rows its positions read; every value is the same whatever
   the split. Returns 0, -1 for arguments it cannot take, -2 when out of memory. */
int vconv8(const float *x, long x_batch, long ldx, const void *w, const float *bias, const float *res, long res_batch,
           long ldres, float *y, long y_batch, long ldy, long batch, long length, long cin, long n, int taps,
           int dilation, int threads) {
    if (batch < 0 || length < 0 || cin < 1 || cin > MAX_CIN || n < 1 || taps < 1 || dilation < 1) return -1;
    if (batch == 0 || length == 0) return 0;
    const long kp = padded(cin), np = panels(n) * PW;
    const q8_weight *qw = w;
    const int32_t *offset = (const int32_t *)(qw + np * taps * kp);
    const struct q8_call c = {x,         res,   bias, y,       qw,     offset, (const float *)(offset + np * taps),
                              x_batch,   ldx,   res_batch, ldres, y_batch, ldy, length, cin, n, kp, dilation, taps};
    const long tiles = batch * ((length + Q8_MR - 1) / Q8_MR);
    const double macs = (double)batch * length * n * taps * cin;
    long most = (long)(macs / Q8_MIN_MACS_PER_THREAD);
    threads = job_count(threads, tiles, most < MAX_JOBS ? most : MAX_JOBS);
    struct q8_job jobs[MAX_JOBS];
    for (int i = 0; i < threads; i++) jobs[i] = (struct q8_job){&c, tiles * i / threads, tiles * (i + 1) / threads, 0};
    run_jobs(q8_job_run, jobs, sizeof jobs[0], threads);
    for (int i = 0; i < threads; i++)
        if (jobs[i].failed) return -2;
    return 0;
}
