/* A whole decoding step of a decoder stack in one call: every layer's products and the glue
   between them (decode.c), for the stacks whose products are all native (the float GEMV of
   gemv.c, int4.c and int8.c), with the activations in one dtype.

   Python makes ~8 calls a layer otherwise (4 products, 4 glue functions), 103 layer steps a frame
   (the talker's 28 once, the code predictor's 5 fifteen times): their dispatch was the largest cost
   above the products themselves. The order of operations, and so every rounding, is that of
   `StackStep._run` (kazeia/native/__init__.py), which remains the path for products that are not
   native (PyTorch's). Several requests (kazeia/batch.py) share each product: their rows
   go in together, and each row's result does not depend on the others in these kernels. A step may
   split each product's weight rows over `threads` threads (jobs.h; the first frame of a prompt,
   on the prompt's team): every row's result is the one computed on one thread. */

#include <stdint.h>

enum { GEMV = 0, INT4 = 1, INT8 = 2 };

/* One product: y (m x rows) = x (m x cols) @ W.T [+ bias]. GEMV: w of dtype dt, x and y of dt.
   INT4: w codes, a steps, b offsets, c row factors, x and y float32 (int4.c). INT8: w int8 values
   in int8.c's layout, a row scales, x and y float32. */
typedef struct {
    int kind, dt;
    const void *w, *a, *b, *c;
    const void *bias;
    long rows, cols;
} Product;

typedef struct {
    Product qkv, o, gate_up, down;
    const void *qk_w, *post_w, *next_w; /* q/k norm scales; post-attention norm; the next norm */
} Layer;

int gemv_team(const void *w, const void *x, const void *bias, void *y, long rows, long cols, int m, int dt,
              int threads);
int int4_gemm(const uint8_t *qw, const uint8_t *gs, const int8_t *gn, const float *rf, const float *x,
              const float *bias, float *y, long rows, long cols, long m, int threads);
int int8_gemm(const int8_t *q, const float *scales, const float *x, const float *bias, float *y, long rows, long cols,
              long m, int threads);
void add_rms_norm(void *h, const void *delta, const void *w, void *out, int rows, int n, float eps, int dt);
int attend(const void *qkv, const void *qk_w, const void *cos, const void *sin, float *k_cache, float *v_cache,
           void *out, int count, int nq, int nkv, int hd, int cap, int pos, float eps, int dt, int threads);
void silu_mul(const void *gate_up, void *out, int rows, int n, int dt);

/* One product on `threads` threads. */
static int product(const Product *p, const void *x, void *y, int m, int threads) {
    switch (p->kind) {
    case GEMV:
        return gemv_team(p->w, x, p->bias, y, p->rows, p->cols, m, p->dt, threads);
    case INT4:
        return int4_gemm(p->w, p->a, p->b, p->c, x, p->bias, y, p->rows, p->cols, m, threads);
    case INT8:
        return int8_gemm(p->w, p->a, x, p->bias, y, p->rows, p->cols, m, threads);
    }
    return -1;
}

/* B requests, T positions each (rows request-major, n = B * T): h (n x H, dt) the residual stream,
   updated in place; the final-normed result in normed (n x H). Request r's positions are
   starts[r] .. starts[r] + T - 1 of its caches: layer l's keys and values at k[r * L + l],
   v[r * L + l] ((nkv, caps[r], hd) float32), its rotation cos[r], sin[r] (T x hd, dt).
   Buffers (dt): attended n x nq*hd, activated n x inner, qkv n x (nq + 2 nkv) hd, out n x H,
   gate_up n x 2 inner. `threads`: each product's and attention's (at least one). `last` (one
   request only): only the last position's result is wanted (a prompt's, whose last position
   makes the first frame): the last layer places every position's keys and values and attends
   them all, then runs its output product and MLP on the last row alone, the same bits as with
   the others (each row's result is its own); the other rows of normed are left as they were.
   Returns 0, or the first failing product's (or attention's) status. */
int stack_step(const Layer *layers, int L, const void *first_norm, void *h, void *normed, void *attended,
               void *activated, void *qkv, void *out, void *gate_up, int B, int T,
               const void *const *cos, const void *const *sin, float *const *k, float *const *v, const int *caps,
               const int *starts, int nq, int nkv, int hd, int H, int inner, float eps, float qk_eps, int dt,
               int threads, int last) {
    if (last && B != 1) return -1;
    const int n = B * T, size = dt == 0 ? 4 : 2;
    const long width = (long)(nq + 2 * nkv) * hd * size, out_width = (long)nq * hd * size; /* bytes a row */
    int status;
    add_rms_norm(h, 0, first_norm, normed, n, H, eps, dt);
    for (int l = 0; l < L; l++) {
        const Layer *layer = layers + l;
        if ((status = product(&layer->qkv, normed, qkv, n, threads))) return status;
        for (int r = 0; r < B; r++)
            if ((status = attend((char *)qkv + (long)r * T * width, layer->qk_w, cos[r], sin[r], k[(long)r * L + l],
                                 v[(long)r * L + l], (char *)attended + (long)r * T * out_width, T, nq, nkv, hd,
                                 caps[r], starts[r], qk_eps, dt, threads)))
                return status;
        /* rows [first, n) from here on: all of them, or the last one in the last layer */
        const int first = last && l == L - 1 ? n - 1 : 0, m = n - first;
        void *hs = (char *)h + (long)first * H * size, *ns = (char *)normed + (long)first * H * size;
        if ((status = product(&layer->o, (char *)attended + first * out_width, out, m, threads))) return status;
        add_rms_norm(hs, out, layer->post_w, ns, m, H, eps, dt);
        if ((status = product(&layer->gate_up, ns, gate_up, m, threads))) return status;
        silu_mul(gate_up, activated, m, inner, dt);
        if ((status = product(&layer->down, activated, out, m, threads))) return status;
        add_rms_norm(hs, out, layer->next_w, ns, m, H, eps, dt);
    }
    return 0;
}
