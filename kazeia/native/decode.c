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

   Every sum has a fixed order written out in plain C (GCC's vector extensions where a loop must
   hold 16 lanes, the exponential in arithmetic rather than libm), nothing fused
   (-ffp-contract=off): the portable, AVX2 and AVX-512 builds give the same bits. Measured on a
   2-vCPU Zen 4, one thread, against the scalar sums and libm's expf they replaced: a talker
   layer's attention at position 300 115 -> 50 us, SiLU of 3072 values 15 -> 2.6 us, a 56-position
   prompt's attention 1.18 -> 0.42 ms a layer and its SiLU 0.72 -> 0.10 ms.

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

/* 16 lanes of float32 in GCC's (and clang's) vector extensions: each operation lane by lane, as
   the target has it (one AVX-512 register, two AVX2 ones, four SSE ones), the same bits in all. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#ifdef __has_builtin
#if __has_builtin(__builtin_shufflevector) /* GCC 12, clang: lanes moved in registers */
#define HAVE_SHUFFLE 1
#endif
#endif

/* The 16 lanes added in a fixed tree: lane l + 8 to lane l, then l + 4, l + 2, l + 1. */
INLINE float tree16(const v16 *v) {
#ifdef HAVE_SHUFFLE
    v8 a = __builtin_shufflevector(*v, *v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(*v, *v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else /* through memory: the same additions */
    v8 a, b;
    memcpy(&a, v, sizeof a);
    memcpy(&b, (const char *)v + sizeof a, sizeof b);
    a = a + b;
    v4 c, d;
    memcpy(&c, &a, sizeof c);
    memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    c = c + d;
#endif
    return (c[0] + c[2]) + (c[1] + c[3]);
}

#define LOAD16(v, p) memcpy(&(v), (p), sizeof(v16)) /* an unaligned load */

/* sum of a[i] * b[i]: the whole 16s in 16 interleaved partial sums (lane l: i = l mod 16) added
   by tree16, then the columns past them one by one. */
INLINE float dot(const float *a, const float *b, int n) {
    v16 part = {0.0f};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 x, y;
        LOAD16(x, a + i);
        LOAD16(y, b + i);
        part += x * y;
    }
    float total = tree16(&part);
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* sum of a[i] in dot's order. */
INLINE float sum(const float *a, int n) {
    v16 part = {0.0f};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 x;
        LOAD16(x, a + i);
        part += x;
    }
    float total = tree16(&part);
    for (; i < n; i++) total += a[i];
    return total;
}

enum { HEAD_VECTORS = 16 }; /* head widths up to 256 keep a query in registers (`scores_of`) */

/* out[s] = dot(q, keys + s hd, hd) * scale for s < n: for head widths a multiple of 16 up to 256,
   the query's vectors loaded once (a key row then costs one load a vector, not two). */
INLINE void scores_of(const float *q, const float *keys, int n, const int hd, float scale, float *out) {
    if (hd % 16 || hd > 16 * HEAD_VECTORS) {
        for (int s = 0; s < n; s++) out[s] = dot(q, keys + (long)s * hd, hd) * scale;
        return;
    }
    v16 qv[HEAD_VECTORS];
    for (int c = 0; c < hd / 16; c++) LOAD16(qv[c], q + 16 * c);
    int s = 0;
    for (; s + 4 <= n; s += 4) { /* four keys' chains side by side: each key's sums as alone */
        v16 part[4] = {{0.0f}, {0.0f}, {0.0f}, {0.0f}};
        for (int c = 0; c < hd / 16; c++)
            for (int u = 0; u < 4; u++) {
                v16 x;
                LOAD16(x, keys + (long)(s + u) * hd + 16 * c);
                part[u] += qv[c] * x;
            }
        for (int u = 0; u < 4; u++) out[s + u] = tree16(&part[u]) * scale;
    }
    for (; s < n; s++) {
        const float *k = keys + (long)s * hd;
        v16 part = {0.0f};
        for (int c = 0; c < hd / 16; c++) {
            v16 x;
            LOAD16(x, k + 16 * c);
            part += qv[c] * x;
        }
        out[s] = tree16(&part) * scale;
    }
}

/* e^x in float32 within ~2 units in the last place, in plain arithmetic (no libm call) so that the
   loops calling it are vectorized, with the same bits in every build (-ffp-contract=off: nothing
   fused). x = n ln 2 + r, |r| <= ln 2 / 2, with ln 2 in two parts (n times the first is exact); e^r
   by its Taylor series to r^7 (error below 3e-9 relative); 2^n put in the exponent bits. Below
   -87 (e^x < 1.7e-38) it gives 0, above 88 infinity, NaN for NaN: a softmax or SiLU never tells. */
INLINE float exp32(float x) {
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (c * 1.44269504f + shift) - shift;
    const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float y = x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : p * scale);
    return x != x ? x : y;
}

/* The largest of a[0 .. n) (n >= 1; NaNs aside, the same whatever the order). */
INLINE float largest(const float *a, int n) {
    typedef int32_t v16i __attribute__((vector_size(64)));
    v16 top;
    for (int l = 0; l < 16; l++) top[l] = a[0];
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 x;
        LOAD16(x, a + i);
        const v16i more = x > top; /* lanes where x is larger: all ones */
        top = (v16)(((v16i)x & more) | ((v16i)top & ~more));
    }
    float best = a[0];
    for (int l = 0; l < 16; l++) best = top[l] > best ? top[l] : best;
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
        const void *d = delta ? at(delta, (long)r * n, dt) : NULL;
        if (dt == F32) /* each dtype its own loops: constant conversions, vectorized */
            add_rms_norm_row(hr, d, w, o, n, eps, F32);
        else if (dt == BF16)
            add_rms_norm_row(hr, d, w, o, n, eps, BF16);
        else
            add_rms_norm_row(hr, d, w, o, n, eps, F16);
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

/* acc[i] += p[s] * values[s hd + i] for s < m in order, i < hd: for head widths a multiple of 16
   up to 256 the sums held in registers over the rows. */
INLINE void accumulate(float *acc, const float *p, const float *values, int m, const int hd) {
    if (hd % 16 || hd > 16 * HEAD_VECTORS) {
        for (int s = 0; s < m; s++)
            for (int i = 0; i < hd; i++) acc[i] += p[s] * values[(long)s * hd + i];
        return;
    }
    v16 a[HEAD_VECTORS];
    for (int c = 0; c < hd / 16; c++) LOAD16(a[c], acc + 16 * c);
    for (int s = 0; s < m; s++)
        for (int c = 0; c < hd / 16; c++) {
            v16 x;
            LOAD16(x, values + (long)s * hd + 16 * c);
            a[c] += p[s] * x;
        }
    for (int c = 0; c < hd / 16; c++) memcpy(acc + 16 * c, &a[c], sizeof a[c]);
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
INLINE void attend_item(const struct attend_job *job, int item, const int dt, const int hd) {
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
        for (int s = 0; s < n; s++) sg[s] = exp32(sg[s] - top);
        total[g] = sum(sg, n);
        for (int i = 0; i < hd; i++) acc[g][i] = 0.0f;
    }
    for (int s = 0; s < n; s += KEY_BLOCK) {
        const int m = n - s < KEY_BLOCK ? n - s : KEY_BLOCK;
        for (int g = 0; g < group; g++) accumulate(acc[g], scores + (long)g * n + s, values + (long)s * hd, m, hd);
    }
    for (int g = 0; g < group; g++)
        for (int i = 0; i < hd; i++) store(job->out, ((long)t * nq + (long)(j * group + g)) * hd + i, acc[g][i] / total[g], dt);
}

/* One thread's items: index, index + jobs, ... (interleaved: a later position attends to more). */
static void *attend_job_run(void *arg) {
    const struct attend_job *job = arg;
    for (int item = job->index; item < job->items; item += job->jobs) {
        if (job->dt == F32 && job->hd == 128) /* the released models' heads: constant loops */
            attend_item(job, item, F32, 128);
        else if (job->dt == F32)
            attend_item(job, item, F32, job->hd);
        else if (job->dt == BF16)
            attend_item(job, item, BF16, job->hd);
        else
            attend_item(job, item, F16, job->hd);
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
        float *qt = q + (long)t * nq * hd;
        if (dt == F32)
            place(row, qk_w, c, s, k_cache, v_cache, qt, nq, nkv, hd, cap, pos + t, eps, F32);
        else if (dt == BF16)
            place(row, qk_w, c, s, k_cache, v_cache, qt, nq, nkv, hd, cap, pos + t, eps, BF16);
        else
            place(row, qk_w, c, s, k_cache, v_cache, qt, nq, nkv, hd, cap, pos + t, eps, F16);
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

INLINE void silu_mul_row(const void *gu, void *o, int n, const int dt) {
    for (int i = 0; i < n; i++) {
        const float g = load(gu, i, dt);
        const float s = rnd(g / (1.0f + exp32(-g)), dt);
        store(o, i, s * load(gu, (long)n + i, dt), dt);
    }
}

/* For each of `rows` rows: out = silu(gate) * up, gate_up = [gate | up] (2n values of dt); silu
   rounded to dt first. out: rows x n values of dt. */
void silu_mul(const void *gate_up, void *out, int rows, int n, int dt) {
    for (int r = 0; r < rows; r++) {
        const void *gu = at(gate_up, 2L * r * n, dt);
        void *o = at(out, (long)r * n, dt);
        if (dt == F32)
            silu_mul_row(gu, o, n, F32);
        else if (dt == BF16)
            silu_mul_row(gu, o, n, BF16);
        else
            silu_mul_row(gu, o, n, F16);
    }
}
