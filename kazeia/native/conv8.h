/* conv8.c's kernels, one set per build (the flags choose, kazeia/cpu.py): a row's quantization and
   a tile of Q8_MR positions x one panel of Q8_PW output channels, every tap, the float steps and
   the store. conv8.c states the arithmetic; here only how each path sums S = sum of qx * qw.

   Codes in memory (`q8_quantize`): kp a row (zeros past cin), as the path's inner loop takes
   them; packed weights per panel: (taps, kp / Q8_K, Q8_PW, Q8_K), so one vector load gives Q8_K
   consecutive k of Q8_LANES channels.
   * AVX-512 VNNI: codes qx + 128 as bytes (vpdpbusd's unsigned operand, so the inner loop needs no
     conversion), int8 weights, four k per 32-bit lane; the sums start from minus the offset's
     share, -128 * sum over c of qw[n][tap][c] (packed with the weights). A tile is 6 positions x
     32 channels: 12 accumulators (GCC spills them from 16 on).
   * AVX2: codes and weights as int16, vpmaddwd (two k per 32-bit lane: exact, no 16-bit step).
     This is one multiply and one add per 16 products, where vpmaddubsw on |qx| and qw with qx's
     sign needs a sign, two multiplies and an add per 32 (three of them on the two multiply ports
     of most AVX2 cores). A tile is 4 positions x 16 channels (64 bytes of weights a k pair: no
     load crosses a cache line).
   * portable C: int8 codes and weights, the sum of the products.
   After each tap's sums the tile's float values are merged in memory (the registers hold the
   sums); the float steps are the same sequence on every path, no fused multiply-add, and the
   conversions round as C's do (to nearest, ties to even), so all paths give the same bits. */

#ifndef KAZEIA_CONV8_H
#define KAZEIA_CONV8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define Q8_VNNI 1
enum { Q8_LANES = 16, Q8_NV = 2, Q8_MR = 6, Q8_K = 4, Q8_CODE0 = 128 };
typedef uint8_t q8_code;
typedef int8_t q8_weight;
#elif defined(__AVX2__)
#include <immintrin.h>
#define Q8_AVX2 1
enum { Q8_LANES = 8, Q8_NV = 2, Q8_MR = 4, Q8_K = 2, Q8_CODE0 = 0 };
typedef int16_t q8_code;
typedef int16_t q8_weight;
#else
enum { Q8_LANES = 8, Q8_NV = 1, Q8_MR = 4, Q8_K = 4, Q8_CODE0 = 0 };
typedef int8_t q8_code;
typedef int8_t q8_weight;
#endif

enum { Q8_PW = Q8_LANES * Q8_NV /* output channels of a panel */ };

/* One row of cin values -> its codes (kp bytes, `Q8_CODE0` past cin) and its scale: max |x| / 127,
   codes round(x * (127 / max |x|)) within -127..127 (0 for a row of zeros). The largest magnitude
   is exact in any order; NaN is skipped by the maximum and clamps to -127 as lrintf's does. */
static inline float q8_quantize(const float *x, long cin, long kp, q8_code *q) {
    float most = 0.0f;
    long c = 0;
#if defined(Q8_VNNI)
    __m512 m = _mm512_setzero_ps();
    for (; c + 16 <= cin; c += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + c)), m);
    most = _mm512_reduce_max_ps(m);
#elif defined(Q8_AVX2)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (; c + 8 <= cin; c += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + c), magnitude), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) most = lanes[i] > most ? lanes[i] : most;
#endif
    for (; c < cin; c++) most = fabsf(x[c]) > most ? fabsf(x[c]) : most;
    const float inv = most > 0.0f ? 127.0f / most : 0.0f;
    c = 0;
#if defined(Q8_VNNI)
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (; c + 16 <= cin; c += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), iv)); /* to nearest, ties to even */
        v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
        const __m128i bytes = _mm_xor_si128(_mm512_cvtepi32_epi8(v), _mm_set1_epi8((char)0x80));
        _mm_storeu_si128((__m128i *)(q + c), bytes);
    }
#elif defined(Q8_AVX2)
    const __m256 iv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (; c + 8 <= cin; c += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c), iv));
        v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
        _mm_storeu_si128((__m128i *)(q + c), _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
    }
#endif
    for (; c < cin; c++) {
        long v = lrintf(x[c] * inv);
        q[c] = (q8_code)((v > 127 ? 127 : v < -127 ? -127 : v) + Q8_CODE0);
    }
    for (; c < kp; c++) q[c] = Q8_CODE0;
    return most / 127.0f;
}

/* One panel of one call: its packed weights and offset shares, scales and bias from its first
   channel on; `width` of its Q8_PW channels are real. */
struct q8_panel {
    const q8_weight *w;  /* (taps, kp / Q8_K, Q8_PW, Q8_K) */
    const int32_t *off;  /* (taps, Q8_PW): minus the offset's shares */
    const float *sw;     /* Q8_PW scales (zeros past width) */
    const float *bias;   /* width values, or NULL */
    long kp, step;       /* bytes a code row; rows between taps (the dilation) */
    int taps, width;
};

#if defined(Q8_VNNI)
/* Positions 0 .. valid - 1 (valid <= Q8_MR) from the code row qx (tap 0's) and its scales sx: every
   tap, then y := f * sw + bias + res (rows ldy / ldres floats apart; res may be NULL). */
static void q8_tile(const struct q8_panel *p, const q8_code *qx, const float *sx, int valid, float *y, long ldy,
                    const float *res, long ldres) {
    float f[Q8_MR][Q8_PW] __attribute__((aligned(64))) = {{0}}; /* in memory: the registers hold the sums */
    const long groups = p->kp / 4;
    for (int tap = 0; tap < p->taps; tap++) {
        const q8_code *rows[Q8_MR];
        for (int r = 0; r < Q8_MR; r++) rows[r] = qx + ((r < valid ? r : valid - 1) + tap * p->step) * p->kp;
        __m512i acc[Q8_MR][Q8_NV]; /* from minus the offset's share: S when the sums are done */
        for (int v = 0; v < Q8_NV; v++) {
            const __m512i start = _mm512_loadu_si512(p->off + tap * Q8_PW + v * Q8_LANES);
            for (int r = 0; r < Q8_MR; r++) acc[r][v] = start;
        }
        const q8_weight *w = p->w + tap * p->kp * Q8_PW;
        for (long g = 0; g < groups; g++, w += Q8_PW * 4) {
            __m512i wv[Q8_NV];
            for (int v = 0; v < Q8_NV; v++) wv[v] = _mm512_loadu_si512(w + v * Q8_LANES * 4);
            for (int r = 0; r < Q8_MR; r++) {
                int32_t four;
                memcpy(&four, rows[r] + g * 4, sizeof four);
                const __m512i xv = _mm512_set1_epi32(four);
                for (int v = 0; v < Q8_NV; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xv, wv[v]);
            }
        }
        for (int v = 0; v < Q8_NV; v++) {
            for (int r = 0; r < Q8_MR; r++) {
                const __m512 s = _mm512_cvtepi32_ps(acc[r][v]);
                const float scale = sx[(r < valid ? r : valid - 1) + tap * p->step];
                const __m512 sum = _mm512_add_ps(_mm512_load_ps(f[r] + v * Q8_LANES), _mm512_mul_ps(s, _mm512_set1_ps(scale)));
                _mm512_store_ps(f[r] + v * Q8_LANES, sum);
            }
        }
    }
    for (int v = 0; v < Q8_NV; v++) {
        const int lanes = p->width - v * Q8_LANES;
        if (lanes <= 0) break;
        const __mmask16 k = lanes >= Q8_LANES ? (__mmask16)0xffff : (__mmask16)((1u << lanes) - 1);
        const __m512 sw = _mm512_loadu_ps(p->sw + v * Q8_LANES);
        const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(k, p->bias + v * Q8_LANES) : _mm512_setzero_ps();
        for (int r = 0; r < valid; r++) {
            __m512 out = _mm512_mul_ps(_mm512_load_ps(f[r] + v * Q8_LANES), sw);
            if (p->bias) out = _mm512_add_ps(out, bias);
            if (res) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(k, res + r * ldres + v * Q8_LANES));
            _mm512_mask_storeu_ps(y + r * ldy + v * Q8_LANES, k, out);
        }
    }
}
#elif defined(Q8_AVX2)
static void q8_tile(const struct q8_panel *p, const q8_code *qx, const float *sx, int valid, float *y, long ldy,
                    const float *res, long ldres) {
    float f[Q8_MR][Q8_PW] __attribute__((aligned(32))) = {{0}}; /* in memory: the registers hold the sums */
    const long pairs = p->kp / 2;
    for (int tap = 0; tap < p->taps; tap++) {
        const q8_code *rows[Q8_MR];
        for (int r = 0; r < Q8_MR; r++) rows[r] = qx + ((r < valid ? r : valid - 1) + tap * p->step) * p->kp;
        __m256i acc[Q8_MR][Q8_NV];
        for (int r = 0; r < Q8_MR; r++)
            for (int v = 0; v < Q8_NV; v++) acc[r][v] = _mm256_setzero_si256();
        const q8_weight *w = p->w + tap * p->kp * Q8_PW;
        for (long g = 0; g < pairs; g++, w += Q8_PW * 2) {
            __m256i wv[Q8_NV];
            for (int v = 0; v < Q8_NV; v++) wv[v] = _mm256_loadu_si256((const __m256i *)(w + v * Q8_LANES * 2));
            for (int r = 0; r < Q8_MR; r++) {
                int32_t two;
                memcpy(&two, rows[r] + g * 2, sizeof two);
                const __m256i xv = _mm256_set1_epi32(two);
                for (int v = 0; v < Q8_NV; v++) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(xv, wv[v]));
            }
        }
        for (int r = 0; r < Q8_MR; r++) {
            const __m256 scale = _mm256_set1_ps(sx[(r < valid ? r : valid - 1) + tap * p->step]);
            for (int v = 0; v < Q8_NV; v++) {
                const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][v]), scale);
                _mm256_store_ps(f[r] + v * Q8_LANES, _mm256_add_ps(_mm256_load_ps(f[r] + v * Q8_LANES), s));
            }
        }
    }
    for (int v = 0; v < Q8_NV; v++) {
        const int lanes = p->width - v * Q8_LANES;
        if (lanes <= 0) break;
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 sw = _mm256_loadu_ps(p->sw + v * Q8_LANES);
        const __m256 bias = p->bias ? _mm256_maskload_ps(p->bias + v * Q8_LANES, k) : _mm256_setzero_ps();
        for (int r = 0; r < valid; r++) {
            __m256 out = _mm256_mul_ps(_mm256_load_ps(f[r] + v * Q8_LANES), sw);
            if (p->bias) out = _mm256_add_ps(out, bias);
            if (res) out = _mm256_add_ps(out, _mm256_maskload_ps(res + r * ldres + v * Q8_LANES, k));
            _mm256_maskstore_ps(y + r * ldy + v * Q8_LANES, k, out);
        }
    }
}
#else
static void q8_tile(const struct q8_panel *p, const q8_code *qx, const float *sx, int valid, float *y, long ldy,
                    const float *res, long ldres) {
    float f[Q8_MR][Q8_PW] = {{0}};
    for (int tap = 0; tap < p->taps; tap++) {
        const q8_weight *w = p->w + tap * p->kp * Q8_PW;
        for (int r = 0; r < valid; r++) {
            const int8_t *row = (const int8_t *)(qx + (r + tap * p->step) * p->kp);
            int32_t s[Q8_PW] = {0};
            for (long g = 0; g < p->kp / 4; g++)
                for (int j = 0; j < Q8_PW; j++)
                    for (int e = 0; e < 4; e++) s[j] += (int32_t)row[g * 4 + e] * (int32_t)w[(g * Q8_PW + j) * 4 + e];
            const float scale = sx[r + tap * p->step];
            for (int j = 0; j < Q8_PW; j++) f[r][j] = f[r][j] + (float)s[j] * scale;
        }
    }
    for (int r = 0; r < valid; r++)
        for (int j = 0; j < p->width; j++) {
            float out = f[r][j] * p->sw[j];
            if (p->bias) out = out + p->bias[j];
            if (res) out = out + res[r * ldres + j];
            y[r * ldy + j] = out;
        }
}
#endif

#endif
