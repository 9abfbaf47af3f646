/* The work between the matrix products of one decoder-layer step at batch 1, for one position or
   a few consecutive ones (`rows` / `count` below; the code predictor's first step has two).

   Eager PyTorch spends some 25 small operations on it per layer (norms, rotation, cache write,
   attention, SiLU, residual adds), each costing far more to dispatch than to compute; 103 layer
   steps per frame made that the largest cost above the weight reads. Here it is four calls of the
   three functions below per layer, through ctypes (kazeia/native/__init__.py).

   Rounding follows the eager code (kazeia/layers.py): every value the eager path stores in the
   activation dtype is rounded to it here at the same place, so bfloat16 results differ from it by
   summation order only. `dt` is 0 for float32 activations, 1 for bfloat16 (stored as uint16), 2
   for float16 (where the compiler has _Float16, see `has_float16`).
   Keys and values are cached in float32, layout (kv_heads, capacity, head_dim).

   Built at first use by the system C compiler; no Python headers, no PyTorch headers. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

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

/* sum of a[i] * b[i] in 16 interleaved partial sums (a form the compiler vectorizes as written). */
static inline float dot(const float *a, const float *b, int n) {
    float part[16] = {0.0f}, sum = 0.0f;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) part[l] += a[i + l] * b[i + l];
    for (; i < n; i++) part[0] += a[i] * b[i];
    for (int l = 0; l < 16; l++) sum += part[l];
    return sum;
}

/* 1 / sqrt(mean(x^2) + eps) over n values (the RMSNorm factor, in float32). */
static float rms_factor(const float *x, int n, float eps) {
    return 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
}

static void add_rms_norm_row(void *h, const void *delta, const void *w, void *out, int n, float eps, int dt) {
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
    for (int r = 0; r < rows; r++)
        add_rms_norm_row(at(h, (long)r * n, dt), delta ? at(delta, (long)r * n, dt) : NULL, w,
                         at(out, (long)r * n, dt), n, eps, dt);
}

/* One attention step at position `pos` (`attend` below runs one per new position).
   qkv: (nq + 2 nkv) heads of hd values (dt): queries, keys, values of the new position.
   qk_w: (nq + nkv, hd) RMSNorm scales of the query and key heads (dt).
   cos, sin: hd values (dt) for `pos`, sin with its first half negated (x*cos + roll(x, hd/2)*sin).
   k_cache, v_cache: (nkv, cap, hd) float32; the new key and value are written at `pos`.
   out: (nq, hd) values (dt), query head g attending with key/value head g / (nq / nkv).
   scratch: at least nq * hd + (nq / nkv) * (pos + 1) floats. */
static void attend_one(const void *qkv, const void *qk_w, const void *cos, const void *sin, float *k_cache,
                       float *v_cache, void *out, float *scratch, int nq, int nkv, int hd, int cap, int pos,
                       float eps, int dt) {
    const int half = hd / 2;
    float *q = scratch, *scores = scratch + (long)nq * hd;
    float x[hd], y[hd];
    for (int head = 0; head < nq + nkv; head++) {
        for (int i = 0; i < hd; i++) x[i] = load(qkv, (long)head * hd + i, dt);
        float r = rms_factor(x, hd, eps);
        for (int i = 0; i < hd; i++) y[i] = rnd(rnd(x[i] * r, dt) * load(qk_w, (long)head * hd + i, dt), dt);
        float *dst = head < nq ? q + (long)head * hd : k_cache + ((long)(head - nq) * cap + pos) * hd;
        for (int i = 0; i < hd; i++) {
            float rolled = y[i < half ? i + half : i - half];
            dst[i] = rnd(rnd(y[i] * load(cos, i, dt), dt) + rnd(rolled * load(sin, i, dt), dt), dt);
        }
    }
    for (int j = 0; j < nkv; j++) {
        float *dst = v_cache + ((long)j * cap + pos) * hd;
        for (int i = 0; i < hd; i++) dst[i] = load(qkv, (long)(nq + nkv + j) * hd + i, dt);
    }
    /* Query heads sharing a key/value head go together: each cached row is read once. */
    const float scale = 1.0f / sqrtf((float)hd);
    const int group = nq / nkv, n = pos + 1;
    float acc[group][hd], total[group], top[group];
    for (int j = 0; j < nkv; j++) {
        for (int g = 0; g < group; g++) top[g] = -INFINITY;
        const float *keys = k_cache + (long)j * cap * hd, *values = v_cache + (long)j * cap * hd;
        const float *qj = q + (long)j * group * hd;
        for (int s = 0; s < n; s++) {
            const float *k = keys + (long)s * hd;
            for (int g = 0; g < group; g++) {
                const float *qg = qj + (long)g * hd;
                float score = dot(qg, k, hd) * scale;
                scores[(long)g * n + s] = score;
                if (score > top[g]) top[g] = score;
            }
        }
        for (int g = 0; g < group; g++) {
            float *sg = scores + (long)g * n, sum = 0.0f;
            for (int s = 0; s < n; s++) {
                sg[s] = expf(sg[s] - top[g]);
                sum += sg[s];
            }
            total[g] = sum;
            for (int i = 0; i < hd; i++) acc[g][i] = 0.0f;
        }
        for (int s = 0; s < n; s++) {
            const float *v = values + (long)s * hd;
            for (int g = 0; g < group; g++) {
                const float p = scores[(long)g * n + s];
                float *a = acc[g];
                for (int i = 0; i < hd; i++) a[i] += p * v[i];
            }
        }
        for (int g = 0; g < group; g++)
            for (int i = 0; i < hd; i++) store(out, (long)(j * group + g) * hd + i, acc[g][i] / total[g], dt);
    }
}

/* `count` consecutive new positions pos, pos + 1, ...: row t of qkv (its heads as above), cos and
   sin (hd values each) and out is position pos + t, which attends to the cache up to itself (each
   position's key and value are written before the next one attends: causal, as in a prompt). */
void attend(const void *qkv, const void *qk_w, const void *cos, const void *sin, float *k_cache,
            float *v_cache, void *out, float *scratch, int count, int nq, int nkv, int hd, int cap, int pos,
            float eps, int dt) {
    const long width = (long)(nq + 2 * nkv) * hd;
    for (int t = 0; t < count; t++)
        attend_one(at(qkv, t * width, dt), qk_w, at(cos, (long)t * hd, dt), at(sin, (long)t * hd, dt), k_cache,
                   v_cache, at(out, (long)t * nq * hd, dt), scratch, nq, nkv, hd, cap, pos + t, eps, dt);
}

/* For each of `rows` rows: out = silu(gate) * up, gate_up = [gate | up] (2n values of dt); silu
   rounded to dt first. out: rows x n values of dt. */
void silu_mul(const void *gate_up, void *out, int rows, int n, int dt) {
    for (int r = 0; r < rows; r++) {
        const void *gu = at(gate_up, 2L * r * n, dt);
        void *o = at(out, (long)r * n, dt);
        for (int i = 0; i < n; i++) {
            float g = load(gu, i, dt);
            float s = rnd(g / (1.0f + expf(-g)), dt);
            store(o, i, s * load(gu, (long)n + i, dt), dt);
        }
    }
}
