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
   order, y := (tap 0 ? 0 : y) + (float)S * sx; then y * sw[n], + bias, + res. The kernels only
   differ in how S is summed:
   * AVX-512 VNNI: vpdpbusd on (qx + 128) as unsigned bytes times qw, four k per 32-bit lane; the
     offset's share, 128 * sum over c of qw[n][tap][c], is taken off after each tap.
   * AVX2: vpmaddubsw on |qx| times qw carrying qx's sign (vpsignb), then vpmaddwd by ones: a pair's
     sum is at most 2 * 127 * 127 < 2^15, so the 16-bit step never saturates.
   * portable C: the sum of the products.
   Built with the rest of kazeia/native; the build's flags choose the path (kazeia/cpu.py). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define Q8_VNNI 1
enum { Q8_LANES = 16, Q8_NV = 2, Q8_MR = 6 };
#elif defined(__AVX2__)
#include <immintrin.h>
#define Q8_AVX2 1
enum { Q8_LANES = 8, Q8_NV = 1, Q8_MR = 4 };
#else
enum { Q8_LANES = 8, Q8_NV = 1, Q8_MR = 4 };
#endif

#include "jobs.h"

enum { PW = Q8_LANES * Q8_NV, /* output channels of a panel */ MAX_CIN = 1 << 16 };

/* k values per tap, padded to whole groups of four (zeros in weights and inputs). */
static long padded(long cin) { return (cin + 3) / 4 * 4; }
static long panels(long n) { return (n + PW - 1) / PW; }

/* Packed layout, per panel p of PW channels: weights (taps, kp / 4, PW, 4) int8; then for all
   panels the offset shares (panels, taps, PW) int32; then the scales (panels * PW) float. */
long vconv8_packed_bytes(long n, int taps, long cin) {
    const long np = panels(n) * PW;
    return np * taps * padded(cin) + (long)sizeof(int32_t) * np * taps + (long)sizeof(float) * np;
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
    int8_t *q = packed;
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
                q[p * PW * taps * kp + ((tap * kp + c) / 4 * PW + j) * 4 + c % 4] = (int8_t)v;
                sum += (int32_t)v;
            }
            offset[(p * taps + tap) * PW + j] = 128 * sum;
        }
    }
}

/* One row of cin values -> its codes (kp bytes, zeros past cin) and its scale. The vector paths
   give lrintf's codes: the same product x * inv, rounded to nearest even (the default rounding
   mode of vcvtps2dq), a NaN to INT_MIN and so to -127; the maximum ignores NaNs as the scalar
   comparison does (vmaxps returns its second operand, the running maximum, when one is NaN). */
static float quantize_row(const float *x, long cin, long kp, int8_t *q) {
    long c = 0;
    float most = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 top = _mm512_setzero_ps();
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (; c + 16 <= cin; c += 16) top = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(x + c)), top);
    for (long i = c; i < cin; i++) most = fabsf(x[i]) > most ? fabsf(x[i]) : most;
    float lanes[16];
    _mm512_storeu_ps(lanes, top);
    for (int i = 0; i < 16; i++) most = lanes[i] > most ? lanes[i] : most;
    const float inv = most > 0.0f ? 127.0f / most : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    for (c = 0; c + 16 <= cin; c += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), vinv));
        v = _mm512_max_epi32(_mm512_min_epi32(v, hi), lo);
        _mm_storeu_si128((__m128i *)(q + c), _mm512_cvtepi32_epi8(v));
    }
#elif defined(__AVX2__)
    __m256 top = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; c + 8 <= cin; c += 8) top = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + c)), top);
    for (long i = c; i < cin; i++) most = fabsf(x[i]) > most ? fabsf(x[i]) : most;
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) most = lanes[i] > most ? lanes[i] : most;
    const float inv = most > 0.0f ? 127.0f / most : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (c = 0; c + 8 <= cin; c += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c), vinv));
        v = _mm256_max_epi32(_mm256_min_epi32(v, hi), lo);
        const __m256i w = _mm256_packs_epi32(v, v);                  /* 16-bit, per 128-bit lane */
        const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), /* lanes 0-3, then 4-7 */
                                          _mm256_extracti128_si256(w, 1));
        int32_t four[2] = {_mm_cvtsi128_si32(b), _mm_extract_epi32(b, 2)};
        memcpy(q + c, four, 8);
    }
#else
    for (long i = 0; i < cin; i++) most = fabsf(x[i]) > most ? fabsf(x[i]) : most;
    const float inv = most > 0.0f ? 127.0f / most : 0.0f;
#endif
    for (; c < cin; c++) {
        long v = lrintf(x[c] * inv);
        q[c] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
    memset(q + cin, 0, (size_t)(kp - cin));
    return most / 127.0f;
}

/* Rows [first, last) of the input quantized (one job of several). */
struct q8_rows {
    const float *x;
    int8_t *qx;
    float *sx;
    long x_batch, ldx, rows, cin, kp, first, last;
};

static void *q8_rows_run(void *arg) {
    const struct q8_rows *j = arg;
    for (long i = j->first; i < j->last; i++) {
        const long b = i / j->rows, r = i % j->rows;
        j->sx[i] = quantize_row(j->x + b * j->x_batch + r * j->ldx, j->cin, j->kp, j->qx + i * j->kp);
    }
    return NULL;
}

struct q8_args {
    const int8_t *qx;     /* (batch, rows, kp) codes of the padded input */
    const float *sx;      /* (batch, rows) their scales */
    const int8_t *qw;     /* packed weights */
    const int32_t *offset;
    const float *sw, *bias, *res;
    float *y;
    long rows, kp, n, length, step; /* step: rows between taps (the dilation) */
    long res_batch, ldres, y_batch, ldy;
    int taps;
};

/* S for MR positions (rows[r]: the code row of tap 0) x one panel, one tap, into s[r][PW]. */
static inline __attribute__((always_inline)) void tap_sums(const struct q8_args *a, const int8_t *const *rows,
                                                           const int8_t *w, const int32_t *off, int MR,
                                                           int32_t s[][PW]) {
    const long groups = a->kp / 4;
#if defined(Q8_VNNI)
    __m512i acc[Q8_MR][Q8_NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < Q8_NV; v++) acc[r][v] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u);
    for (long g = 0; g < groups; g++, w += PW * 4) {
        __m512i wv[Q8_NV];
        for (int v = 0; v < Q8_NV; v++) wv[v] = _mm512_loadu_si512(w + v * Q8_LANES * 4);
        for (int r = 0; r < MR; r++) {
            int32_t four;
            memcpy(&four, rows[r] + g * 4, sizeof four);
            const __m512i xv = _mm512_xor_si512(_mm512_set1_epi32(four), flip); /* qx + 128 as unsigned */
            for (int v = 0; v < Q8_NV; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xv, wv[v]);
        }
    }
    for (int v = 0; v < Q8_NV; v++) {
        const __m512i o = _mm512_loadu_si512(off + v * Q8_LANES);
        for (int r = 0; r < MR; r++) _mm512_storeu_si512(s[r] + v * Q8_LANES, _mm512_sub_epi32(acc[r][v], o));
    }
#elif defined(Q8_AVX2)
    (void)off;
    __m256i acc[Q8_MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (long g = 0; g < groups; g++, w += PW * 4) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
        for (int r = 0; r < MR; r++) {
            int32_t four;
            memcpy(&four, rows[r] + g * 4, sizeof four);
            const __m256i xv = _mm256_set1_epi32(four);
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(wv, xv));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
        }
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_si256((__m256i *)s[r], acc[r]);
#else
    (void)off;
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < PW; j++) s[r][j] = 0;
    for (long g = 0; g < groups; g++, w += PW * 4)
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < PW; j++)
                for (int e = 0; e < 4; e++) s[r][j] += (int32_t)rows[r][g * 4 + e] * (int32_t)w[j * 4 + e];
#endif
}

/* Positions m .. m + valid - 1 (valid <= MR) of batch entry b, panel p: every tap, then the scales. */
static inline __attribute__((always_inline)) void tile(const struct q8_args *a, long b, long m, int valid, long p,
                                                       int MR) {
    int32_t s[Q8_MR][PW];
    float f[Q8_MR][PW];
    const int8_t *rows[Q8_MR];
    const long n0 = p * PW, width = a->n - n0 < PW ? a->n - n0 : PW;
    for (int tap = 0; tap < a->taps; tap++) {
        for (int r = 0; r < MR; r++) {
            const long pos = m + (r < valid ? r : valid - 1) + tap * a->step; /* spare rows repeat the last */
            rows[r] = a->qx + (b * a->rows + pos) * a->kp;
        }
        const int8_t *w = a->qw + p * PW * a->taps * a->kp + tap * a->kp * PW;
        tap_sums(a, rows, w, a->offset + (p * a->taps + tap) * PW, MR, s);
        for (int r = 0; r < valid; r++) {
            const float sx = a->sx[b * a->rows + m + r + tap * a->step];
            for (long j = 0; j < width; j++) f[r][j] = (tap ? f[r][j] : 0.0f) + (float)s[r][j] * sx;
        }
    }
    for (int r = 0; r < valid; r++) {
        float *y = a->y + b * a->y_batch + (m + r) * a->ldy + n0;
        const float *res = a->res ? a->res + b * a->res_batch + (m + r) * a->ldres + n0 : NULL;
        for (long j = 0; j < width; j++) {
            float v = f[r][j] * a->sw[n0 + j];
            if (a->bias) v = v + a->bias[n0 + j];
            if (res) v = v + res[j];
            y[j] = v;
        }
    }
}

static void tile_full(const struct q8_args *a, long b, long m, long p) { tile(a, b, m, Q8_MR, p, Q8_MR); }
static void tile_one(const struct q8_args *a, long b, long m, long p) { tile(a, b, m, 1, p, 1); }

struct q8_job {
    const struct q8_args *a;
    long unit0, unit1; /* (batch entry, panel) pairs of this job */
};

static void *q8_job_run(void *arg) {
    const struct q8_job *j = arg;
    const struct q8_args *a = j->a;
    const long np = panels(a->n);
    for (long u = j->unit0; u < j->unit1; u++) {
        const long b = u / np, p = u % np;
        long m = 0;
        for (; m + Q8_MR <= a->length; m += Q8_MR) tile_full(a, b, m, p);
        for (; m < a->length; m++) tile_one(a, b, m, p);
    }
    return NULL;
}

enum { Q8_MIN_MACS_PER_THREAD = 1 << 21 };

/* y (batch blocks of `length` rows) := the int8 convolution above of x (batch blocks of
   (taps - 1) * dilation carried rows + `length` rows) with the packed weight w (`vconv8_pack`),
   + bias (n floats or NULL), + res (rows like y, or NULL). Strides in floats; rows hold cin (x)
   or n (y, res) contiguous values. The input rows are quantized here, once; the panels of output
   channels are split over up to `threads` threads (this one included); every value is the same
   whatever the split. Returns 0, -1 for arguments it cannot take, -2 when out of memory. */
int vconv8(const float *x, long x_batch, long ldx, const void *w, const float *bias, const float *res, long res_batch,
           long ldres, float *y, long y_batch, long ldy, long batch, long length, long cin, long n, int taps,
           int dilation, int threads) {
    if (batch < 0 || length < 0 || cin < 1 || cin > MAX_CIN || n < 1 || taps < 1 || dilation < 1) return -1;
    if (batch == 0 || length == 0) return 0;
    const long kp = padded(cin), rows = length + (long)(taps - 1) * dilation, np = panels(n) * PW;
    int8_t *qx = malloc((size_t)(batch * rows * kp));
    float *sx = malloc(sizeof(float) * (size_t)(batch * rows));
    if (!qx || !sx) {
        free(qx);
        free(sx);
        return -2;
    }
    { /* the rows quantized on up to `threads` threads: each row alone, so the split changes nothing */
        const long all = batch * rows;
        int parts = (int)(all * cin / (1 << 15));
        parts = parts > threads ? threads : parts;
        parts = parts > MAX_JOBS ? MAX_JOBS : parts < 1 ? 1 : parts;
        struct q8_rows quant[MAX_JOBS];
        for (int i = 0; i < parts; i++)
            quant[i] = (struct q8_rows){x, qx, sx, x_batch, ldx, rows, cin, kp, all * i / parts, all * (i + 1) / parts};
        run_jobs(q8_rows_run, quant, sizeof quant[0], parts);
    }
    const int8_t *qw = w;
    const int32_t *offset = (const int32_t *)(qw + np * taps * kp);
    struct q8_args a = {qx,    sx,     qw,     offset, (const float *)(offset + np * taps), bias, res, y, rows, kp, n,
                        length, dilation, res_batch, ldres, y_batch, ldy, taps};
    const long units = batch * panels(n);
    const double macs = (double)batch * length * n * taps * cin;
    long most = (long)(macs / Q8_MIN_MACS_PER_THREAD);
    if (threads > most) threads = (int)most;
    if (threads > units) threads = (int)units;
    if (threads > MAX_JOBS) threads = MAX_JOBS;
    if (threads < 1) threads = 1;
    struct q8_job jobs[MAX_JOBS];
    for (int i = 0; i < threads; i++) jobs[i] = (struct q8_job){&a, units * i / threads, units * (i + 1) / threads};
    run_jobs(q8_job_run, jobs, sizeof jobs[0], threads);
    free(qx);
    free(sx);
    return 0;
}
