/* The work between the matrix products of one decoder-layer step at batch 1, for one position or
   several consecutive ones (`rows` / `count` below; the code predictor's first step has two, an int4
   or int8 prompt all of its own: kazeia/native/step.py).

   Eager PyTorch spends some 25 small operations on it per layer (norms, rotation, cache write,
   attention, SiLU, residual adds), each costing far more to dispatch than to compute; 103 layer
   steps per frame made that the largest cost above the weight reads. Here it is four calls of the
   three functions below per layer, through ctypes (kazeia/native/__init__.py).

   Rounding follows the eager code (kazeia/layers.py): every value the eager path stores in the
   activation dtype is rounded to it here at the same place, so bfloat16 results differ from it by
   summation order only. `dt` is 0 for float32 activations, 1 for bfloat16 (stored as uint16), 2
   for float16 (where the compiler has _Float16, see `has_float16`).
   Keys and values are cached in float32, layout (kv_heads, capacity, head_dim).

   Every sum has a fixed order written out in plain C (GCC's vector extensions at the build's own
   width, 16 partial sums whatever it is; the exponential in arithmetic rather than libm), nothing
   fused (-ffp-contract=off): the portable, AVX2 and AVX-512 builds give the same bits. Measured
   on a 2-vCPU Zen 4, one thread, against the scalar sums and libm's expf they replaced (AVX-512
   build | AVX2 build): a talker layer's attention at position 300 111 -> 81-85 | 127-185 -> 84
   us, SiLU of 3072 values 10-15 -> 3.7 | 9-14 -> 3.6 us, a 56-position prompt's attention
   1.07-1.16 -> 0.51-0.55 | 0.93-1.34 -> 0.48-0.50 ms a layer (one thread).

   Built at first use by the system C compiler; no Python headers, no PyTorch headers. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "jobs.h"

int has_float16(void) { return KAZEIA_HAS_FLOAT16; }

#ifndef KAZEIA_BUILD_KEY
#define KAZEIA_BUILD_KEY ""
#endif
/* The hash that names this build (sources, flags, compiler, CPU): Kazeia checks it after loading. */
const char *build_key(void) { return KAZEIA_BUILD_KEY; }

static inline float rnd(float v, int dt) {
    if (dt == BF16) return from_bf16(to_bf16(v));
    if (dt == F16) return (float)(half)v;
    return v;
}

/* Address of element i of an array of dt values. */
static inline void *at(const void *p, long i, int dt) { return (char *)p + i * (dt == F32 ? 4 : 2); }

#define INLINE static inline __attribute__((always_inline))

/* f(args..., dt) with dt a constant in each call: each dtype gets loops of its own, whose
   conversions are known and which the compiler vectorizes. */
#define BY_DTYPE(dt, f, ...)                                                                          \
    ((dt) == F32 ? f(__VA_ARGS__, F32) : (dt) == BF16 ? f(__VA_ARGS__, BF16) : f(__VA_ARGS__, F16))

/* Vectors of the build's own width in GCC's (and clang's) vector extensions: VW float32 lanes, one
   register (16 with AVX-512, 8 with AVX, 4 otherwise). Elementwise work is the same per element at
   any width. A sum keeps 16 partial sums whatever the width (lane l takes the terms i = l mod 16:
   PIECES vectors), added in one fixed tree (`tree16`): every build gives the same bits. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
enum { PIECES = 16 / VW };
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define LOADV(v, p) memcpy(&(v), (p), sizeof(vf)) /* an unaligned load */
#define STOREV(p, v) memcpy((p), &(v), sizeof(vf))

INLINE vf splat(float v) { return (vf){0.0f} + v; }
INLINE vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

#ifdef __has_builtin
#if __has_builtin(__builtin_shufflevector) /* GCC 12, clang: lanes moved in registers */
#define HAVE_SHUFFLE 1
#endif
#endif

/* The upper and lower halves of a vector of 2n lanes added: lane l + n to lane l. */
#ifdef HAVE_SHUFFLE
#define FOLD8(v) (__builtin_shufflevector((v), (v), 0, 1, 2, 3) + __builtin_shufflevector((v), (v), 4, 5, 6, 7))
#else
INLINE v4 fold8_copy(v8 v) {
    v4 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return lo + hi;
}
#define FOLD8(v) fold8_copy(v)
#endif

/* The 16 partial sums (PIECES vectors: lane l of the 16 in piece l / VW) added in a fixed tree:
   lane l + 8 to lane l, then l + 4, l + 2, l + 1. */
INLINE float tree16(const vf *part) {
#if VW == 16
#ifdef HAVE_SHUFFLE
    const v8 a = __builtin_shufflevector(part[0], part[0], 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(part[0], part[0], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8 a, b;
    memcpy(&a, part, sizeof a);
    memcpy(&b, (const char *)part + sizeof a, sizeof b);
    a = a + b;
#endif
    const v4 c = FOLD8(a);
#elif VW == 8
    const v8 a = part[0] + part[1];
    const v4 c = FOLD8(a);
#else
    const v4 c = (part[0] + part[2]) + (part[1] + part[3]);
#endif
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* sum of a[i] * b[i]: the whole 16s in 16 interleaved partial sums (lane l: i = l mod 16) added
   by tree16, then the columns past them one by one. */
INLINE float dot(const float *a, const float *b, int n) {
    vf part[PIECES];
    for (int k = 0; k < PIECES; k++) part[k] = splat(0.0f);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < PIECES; k++) {
            vf x, y;
            LOADV(x, a + i + k * VW);
            LOADV(y, b + i + k * VW);
            part[k] += x * y;
        }
    float total = tree16(part);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* sum of a[i] in dot's order. */
INLINE float sum(const float *a, int n) {
    vf part[PIECES];
    for (int k = 0; k < PIECES; k++) part[k] = splat(0.0f);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < PIECES; k++) {
            vf x;
            LOADV(x, a + i + k * VW);
            part[k] += x;
        }
    float total = tree16(part);
    for (; i < n; i++) total += a[i];
    return total;
}

/* e^x lane by lane within ~2 units in the last place, in vector arithmetic (no libm call, no
   branch: every build vectorizes it, the same bits in all; -ffp-contract=off: nothing fused).
   x = n ln 2 + r, |r| <= ln 2 / 2, with ln 2 in two parts (n times the first is exact); e^r by its
   Taylor series to r^7 (error below 3e-9 relative); 2^n put in the exponent bits. Below -87
   (e^x < 1.7e-38) it gives 0, above 88 infinity, NaN for NaN: a softmax or SiLU never tells. */
INLINE vf expv(vf x) {
    const vf low = splat(-87.0f), high = splat(88.0f), shift = splat(12582912.0f); /* 1.5 * 2^23 */
    const vf c = pick(x < low, low, pick(x > high, high, x));
    const vf n = (c * 1.44269504f + shift) - shift; /* rounded to an integer */
    const vf r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
    vf p = splat(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    const vf y = pick(x < low, splat(0.0f), pick(x > high, splat(INFINITY), p * (vf)bits));
    return pick(x != x, x, y);
}

/* a[i] = e^(a[i] - shift) for i < n, a vector at a time (the last ones through a padded copy:
   the same arithmetic). */
INLINE void exp_shifted(float *a, int n, float shift) {
    int i = 0;
    for (; i + VW <= n; i += VW) {
        vf x;
        LOADV(x, a + i);
        x = expv(x - shift);
        STOREV(a + i, x);
    }
    if (i < n) {
        vf x = splat(0.0f);
        memcpy(&x, a + i, sizeof(float) * (size_t)(n - i));
        x = expv(x - shift);
        memcpy(a + i, &x, sizeof(float) * (size_t)(n - i));
    }
}

#if VW == 16
enum { KEYS_AT_ONCE = 4 }; /* 32 registers */
#else
enum { KEYS_AT_ONCE = 2 }; /* 16 registers, a 16-lane sum taking two or four */
#endif

/* out[s] = dot(q, keys + s hd, hd) * scale for s < n: for head widths a multiple of 16, several
   keys' sums side by side (independent chains, each key's sums those of dot), each vector of the
   query loaded once for them. */
INLINE void scores_of(const float *q, const float *keys, int n, const int hd, float scale, float *out) {
    int s = 0;
    if (hd % 16 == 0)
        for (; s + KEYS_AT_ONCE <= n; s += KEYS_AT_ONCE) {
            vf part[KEYS_AT_ONCE][PIECES];
            for (int u = 0; u < KEYS_AT_ONCE; u++)
                for (int k = 0; k < PIECES; k++) part[u][k] = splat(0.0f);
            for (int c = 0; c < hd; c += 16)
                for (int k = 0; k < PIECES; k++) {
                    vf qc;
                    LOADV(qc, q + c + k * VW);
                    for (int u = 0; u < KEYS_AT_ONCE; u++) {
                        vf x;
                        LOADV(x, keys + (long)(s + u) * hd + c + k * VW);
                        part[u][k] += qc * x;
                    }
                }
            for (int u = 0; u < KEYS_AT_ONCE; u++) out[s + u] = tree16(part[u]) * scale;
        }
    for (; s < n; s++) out[s] = dot(q, keys + (long)s * hd, hd) * scale;
}

/* The largest of a[0 .. n) (n >= 1; NaNs aside, the same whatever the order). */
INLINE float largest(const float *a, int n) {
    vf top = splat(a[0]);
    int i = 0;
    for (; i + VW <= n; i += VW) {
        vf x;
        LOADV(x, a + i);
        top = pick(x > top, x, top);
    }
    float best = a[0];
    for (int l = 0; l < VW; l++) best = top[l] > best ? top[l] : best;
    for (; i < n; i++) best = a[i] > best ? a[i] : best;
    return best;
}

/* 1 / sqrt(mean(x^2) + eps) over n values (the RMSNorm factor, in float32). */
INLINE float rms_factor(const float *x, int n, float eps) { return 1.0f / sqrtf(dot(x, x, n) / (float)n + eps); }

INLINE void add_rms_norm_row(void *h, const void *delta, const void *w, void *out, int n, float eps, const int dt) {
    float x[n];
    for (int i = 0; i < n; i++) {
        float v = load(h, i, dt);
        if (delta) {
            v = rnd(v + load(delta, i, dt), dt);
            store(h, i, v, dt);
        }
        x[i] = v;
    }
    float r = rms_factor(x, n, eps);
    for (int i = 0; i < n; i++) store(out, i, rnd(x[i] * r, dt) * load(w, i, dt), dt);
}

/* For each of `rows` rows: h += delta (rounded to dt; skipped when delta is NULL), then
   out = rmsnorm(h) * w. h, delta, out: rows x n values of dt; w: n values of dt. */
void add_rms_norm(void *h, const void *delta, const void *w, void *out, int rows, int n, float eps, int dt) {
    for (int r = 0; r < rows; r++) {
        void *hr = at(h, (long)r * n, dt), *o = at(out, (long)r * n, dt);
        BY_DTYPE(dt, add_rms_norm_row, hr, delta ? at(delta, (long)r * n, dt) : NULL, w, o, n, eps);
    }
}

/* Attention over `count` new positions pos, pos + 1, ... in two passes.

   Placing (`place`, in position order): row t of qkv holds (nq + 2 nkv) heads of hd values (dt) of
   position pos + t: queries, keys, values. Each query and key head is RMS-normed with its scale
   (qk_w: (nq + nkv, hd), dt) and rotated (cos, sin: hd values of dt a position, sin with its first
   half negated: x*cos + roll(x, hd/2)*sin), each value rounded to dt where the eager layers round
   it; keys and values go to the caches ((nkv, cap, hd) float32) at their positions, queries to q
   (count x nq x hd float32).

   Attending (`attend_item`): query head g of position pos + t with key/value head g / (nq / nkv)
   over the cache's positions 0 .. pos + t (causal, as in a prompt); the query heads sharing a
   key/value head go together, each cached row read once. Each (position, key/value head) is an
   item on its own, so the items may be split over threads: every result is the same whichever
   thread computes it (a prompt's attention runs on its team, kazeia/native/stack.c). */
INLINE void place(const void *qkv, const void *qk_w, const void *cos, const void *sin, float *k_cache, float *v_cache,
                  float *q, int nq, int nkv, int hd, int cap, int pos, float eps, const int dt) {
    const int half = hd / 2;
    float x[hd], y[hd];
    for (int head = 0; head < nq + nkv; head++) {
        for (int i = 0; i < hd; i++) x[i] = load(qkv, (long)head * hd + i, dt);
        const float r = rms_factor(x, hd, eps);
        for (int i = 0; i < hd; i++) y[i] = rnd(rnd(x[i] * r, dt) * load(qk_w, (long)head * hd + i, dt), dt);
        float *dst = head < nq ? q + (long)head * hd : k_cache + ((long)(head - nq) * cap + pos) * hd;
        for (int i = 0; i < half; i++)
            dst[i] = rnd(rnd(y[i] * load(cos, i, dt), dt) + rnd(y[i + half] * load(sin, i, dt), dt), dt);
        for (int i = half; i < hd; i++)
            dst[i] = rnd(rnd(y[i] * load(cos, i, dt), dt) + rnd(y[i - half] * load(sin, i, dt), dt), dt);
    }
    for (int j = 0; j < nkv; j++) {
        float *dst = v_cache + ((long)j * cap + pos) * hd;
        for (int i = 0; i < hd; i++) dst[i] = load(qkv, (long)(nq + nkv + j) * hd + i, dt);
    }
}

enum { SUM_VECTORS = 8 }; /* accumulated vectors held in registers (`accumulate`) */

/* acc[i] += p[s] * values[s hd + i] for s < m in order, i < hd: SUM_VECTORS vectors of columns at
   a time held in registers over the rows. */
INLINE void accumulate(float *acc, const float *p, const float *values, int m, const int hd) {
    int c0 = 0;
    while (c0 + VW <= hd) {
        const int vectors = (hd - c0) / VW < SUM_VECTORS ? (hd - c0) / VW : SUM_VECTORS;
        vf a[SUM_VECTORS];
        for (int c = 0; c < vectors; c++) LOADV(a[c], acc + c0 + VW * c);
        for (int s = 0; s < m; s++)
            for (int c = 0; c < vectors; c++) {
                vf x;
                LOADV(x, values + (long)s * hd + c0 + VW * c);
                a[c] += p[s] * x;
            }
        for (int c = 0; c < vectors; c++) STOREV(acc + c0 + VW * c, a[c]);
        c0 += VW * vectors;
    }
    for (int s = 0; s < m; s++)
        for (int i = c0; i < hd; i++) acc[i] += p[s] * values[(long)s * hd + i];
}

enum { KEY_BLOCK = 16 }; /* key or value rows a block (8 KB at the released models' 128 wide heads) */

struct attend_job {
    const float *q, *k_cache, *v_cache;
    void *out;
    float *scores; /* this job's: nq / nkv x (pos + count) floats */
    int dt, jobs, index, items, nq, nkv, hd, cap, pos;
};

/* Item `item` = t * nkv + j: the query heads of key/value head j at position pos + t, into out
   (row t: nq heads of hd values, dt). */
INLINE void attend_item(const struct attend_job *job, int item, const int hd, const int dt) {
    const int nq = job->nq, nkv = job->nkv, group = nq / nkv;
    const int t = item / nkv, j = item % nkv, n = job->pos + t + 1;
    const float scale = 1.0f / sqrtf((float)hd);
    const float *keys = job->k_cache + (long)j * job->cap * hd, *values = job->v_cache + (long)j * job->cap * hd;
    const float *qj = job->q + ((long)t * nq + (long)j * group) * hd;
    float *scores = job->scores;
    float acc[group][hd], total[group];
    /* Key and value rows in blocks that stay in the first-level cache while each query of the
       group passes (read once from farther away, not once a query). */
    for (int s = 0; s < n; s += KEY_BLOCK) {
        const int m = n - s < KEY_BLOCK ? n - s : KEY_BLOCK;
        for (int g = 0; g < group; g++)
            scores_of(qj + (long)g * hd, keys + (long)s * hd, m, hd, scale, scores + (long)g * n + s);
    }
    for (int g = 0; g < group; g++) {
        float *sg = scores + (long)g * n;
        const float top = largest(sg, n);
        exp_shifted(sg, n, top);
        total[g] = sum(sg, n);
        for (int i = 0; i < hd; i++) acc[g][i] = 0.0f;
    }
    for (int s = 0; s < n; s += KEY_BLOCK) {
        const int m = n - s < KEY_BLOCK ? n - s : KEY_BLOCK;
        for (int g = 0; g < group; g++) accumulate(acc[g], scores + (long)g * n + s, values + (long)s * hd, m, hd);
    }
    for (int g = 0; g < group; g++) {
        const long row = ((long)t * nq + (long)(j * group + g)) * hd;
        for (int i = 0; i < hd; i++) store(job->out, row + i, acc[g][i] / total[g], dt);
    }
}

/* One thread's items: index, index + jobs, ... (interleaved: a later position attends to more). */
static void *attend_job_run(void *arg) {
    const struct attend_job *job = arg;
    for (int item = job->index; item < job->items; item += job->jobs) {
        if (job->dt == F32 && job->hd == 128) /* the released models' heads: constant loops */
            attend_item(job, item, 128, F32);
        else
            BY_DTYPE(job->dt, attend_item, job, item, job->hd);
    }
    return NULL;
}

enum { ATTEND_THREADS = 16 }; /* at most MAX_JOBS (jobs.h) */

/* `count` consecutive new positions pos, pos + 1, ... (the passes above): qkv (count rows of
   (nq + 2 nkv) hd values), cos and sin (count rows of hd values) and out (count rows of nq hd
   values), all dt; the attention's items split over `threads` threads. Returns 0, or -2 when out
   of memory. */
int attend(const void *qkv, const void *qk_w, const void *cos, const void *sin, float *k_cache, float *v_cache,
           void *out, int count, int nq, int nkv, int hd, int cap, int pos, float eps, int dt, int threads) {
    const long width = (long)(nq + 2 * nkv) * hd, items = (long)count * nkv;
    const long macs = items * (nq / nkv) * (pos + (count + 1) / 2) * 2L * hd;
    const int jobs = job_count(threads, shares(items, macs), ATTEND_THREADS);
    float *q = malloc(sizeof(float) * ((size_t)count * nq * hd + (size_t)jobs * (nq / nkv) * (pos + count)));
    if (!q) return -2;
    for (int t = 0; t < count; t++) {
        const void *row = at(qkv, t * width, dt), *c = at(cos, (long)t * hd, dt), *s = at(sin, (long)t * hd, dt);
        BY_DTYPE(dt, place, row, qk_w, c, s, k_cache, v_cache, q + (long)t * nq * hd, nq, nkv, hd, cap, pos + t, eps);
    }
    struct attend_job all[ATTEND_THREADS];
    float *scores = q + (long)count * nq * hd;
    for (int i = 0; i < jobs; i++)
        all[i] = (struct attend_job){q, k_cache, v_cache, out, scores + (long)i * (nq / nkv) * (pos + count),
                                     dt, jobs, i, (int)items, nq, nkv, hd, cap, pos};
    run_jobs(attend_job_run, all, sizeof all[0], jobs);
    free(q);
    return 0;
}

/* silu(g) = g / (1 + e^-g) lane by lane. */
INLINE vf siluv(vf g) { return g / (1.0f + expv(-g)); }

INLINE void silu_mul_row(const void *gu, void *o, int n, const int dt) {
    int i = 0;
    if (dt == F32) { /* whole vectors straight from the row */
        const float *gate = gu, *up = gate + n;
        for (; i + VW <= n; i += VW) {
            vf g, u;
            LOADV(g, gate + i);
            LOADV(u, up + i);
            const vf y = siluv(g) * u;
            STOREV((float *)o + i, y);
        }
    }
    for (; i < n; i += VW) { /* through copies: the last ones, and other dtypes (the same arithmetic) */
        const int m = n - i < VW ? n - i : VW;
        float g[VW], s[VW];
        for (int l = 0; l < VW; l++) g[l] = l < m ? load(gu, i + l, dt) : 0.0f;
        vf x;
        LOADV(x, g);
        x = siluv(x);
        STOREV(s, x);
        for (int l = 0; l < m; l++) store(o, i + l, rnd(s[l], dt) * load(gu, (long)n + i + l, dt), dt);
    }
}

/* For each of `rows` rows: out = silu(gate) * up, gate_up = [gate | up] (2n values of dt); silu
   rounded to dt first. out: rows x n values of dt. */
void silu_mul(const void *gate_up, void *out, int rows, int n, int dt) {
    for (int r = 0; r < rows; r++) {
        const void *gu = at(gate_up, 2L * r * n, dt);
        BY_DTYPE(dt, silu_mul_row, gu, at(out, (long)r * n, dt), n);
    }
}
