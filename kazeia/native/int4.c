/* Products with 4-bit weights (kazeia/int4.py): y[i][r] = sum over c of x[i][c] * w[r][c] (+ b[r])
   for float32 activation rows x (m of them, any m >= 1).

   Weights. Each row of `cols` weights (a multiple of 64) is cut into groups of 32. A weight is
       d * s * q  -  e * n
   with its code q in 0..15, its group's step s (uint8) and offset n (int8), and its row's float32
   factors d and e. A group's codes are 16 bytes: byte k holds code k in its low nibble and code
   16 + k in its high one. The kernels take two groups (a unit of 64 columns, 32 bytes) at a time:
   one mask and one shift give both groups' first and second halves, one group per 128-bit lane,
   and the activation codes are laid out to match (act_pos).

   Activations. Each row is rounded to int8 per block of 128 columns (64 when cols is not a
   multiple of 128; blocks of 64, 128 and 256 measured alike in quality, 128 the fastest): step
   t = max |x| / 127, codes p = round(x / t) (to nearest even; the same in every build). The
   float32 sum of x over each group is kept too. A row's result is
       d * sum over blocks of t * (sum over the block's groups of s * (q . p))
     - e * sum over groups of n * (sum of x over the group)  [+ b]
   The first sum is exact in int32 within a block (|q . p| <= 32 * 15 * 127, times s <= 255, over
   at most 4 groups), so a block costs one conversion to float; the offsets meet the exact
   activations, so only the q . x part sees the 8-bit rounding.

   Summation, for a given build: blocks in column order into vector lanes (with VNNI, two blocks
   share a vector: tile512), the lanes in a fixed tree, then the offsets (vector lanes over the
   groups, then a tree) and the bias; the trees and the last steps of 8 weight rows run side by side
   in one vector (sums8: the same tree in each lane; measured on Zen 3 with AVX2: one-row products
   ~7 % and two-row ~10 % faster; on Zen 4 with AVX-512 VNNI, whose own reductions made its kernel
   slower than AVX2's there: see tile_rows8). The work: one weight row against a tile of up to TILE
   activation rows, each unit's codes unpacked and steps widened once for the tile; a row's
   instructions are the same whatever the tile's size or place, so its result depends only on
   that row and the weights, never on m, the other rows or the thread count (batching, prompts and
   streamed == offline rely on it). The instructions: AVX-512 BW with VNNI (vpdpbusd, vpdpwssd),
   AVX-512 BW, AVX2 (vpmaddubsw, vpmaddwd), or plain C, chosen by the build's target flags
   (kazeia/cpu.py); all compute exact integers (no pair sum saturates), and all but VNNI the same
   float sums. One thread for a decoding step's product, on the generation thread (engine.py); a
   prompt's may split its weight rows over more (int4_gemm, `cpu.team`). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jobs.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { GROUP = 32, UNIT = 64 };
/* Bytes ahead of the codes being read that are asked for early (the next rows: rows follow each
   other in memory). Measured: a frame's products read ~35 % faster with it. The AVX-512 kernels
   ask further ahead and into the second-level cache only (_MM_HINT_T1), leaving the first level's
   miss slots to the loads: on a 2-vCPU Zen 4, one thread's products from memory (72 MB of weights)
   read at 19-21 GB/s against 15-17 with the AVX2 kernels' hint, a frame's products alone took
   42-45 ms against 50-56 and one-thread generation 46-54 ms against 54-63 (each pair in turns);
   the AVX2 kernels measured alike with either there, and keep theirs (Zen 3 unmeasured). */
#define PREFETCH 8192
#define PREFETCH512 16384

/* Which kernel this build runs, for tests and logs: 3 AVX-512 VNNI, 2 AVX-512 BW, 1 AVX2, 0 C. */
int int4_kernel(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 3;
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Columns per activation step for a row of `cols`. */
static long int4_block(long cols) { return cols % 128 == 0 ? 128 : UNIT; }

/* Where the kernel wants the activation code of column c (the codes are laid out to match the
   weight bytes, see unpack512): within each unit of 64 columns, the first half-groups (columns
   0-15 and 32-47), then the second ones (16-31, 48-63); AVX-512 takes two units at a time in
   blocks of 128: both units' first half-groups, then both second ones. */
static inline long act_pos(long c, long block) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (block % 128 == 0) {
        long pair = c & ~127L, u = (c >> 6) & 1, j = c & 63;
        return pair + ((j >> 4) & 1) * 64 + u * 32 + (j >> 5) * 16 + (j & 15);
    }
#elif !(defined(__AVX2__) && defined(__FMA__))
    (void)block;
    return c; /* the plain C loop reads columns in order */
#endif
    (void)block;
    long unit = c & ~63L, j = c & 63;
    return unit + ((j >> 4) & 1) * 32 + (j >> 5) * 16 + (j & 15);
}

/* The largest |v[j]| of a block; a NaN is passed over (it poisons the row's sums instead). */
static float block_amax(const float *v, long block) {
    float amax = 0.0f;
    long j = 0;
#if defined(__AVX512F__)
    __m512 top = _mm512_setzero_ps();
    for (; j + 16 <= block; j += 16) top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v + j)), top); /* NaN: top */
    amax = _mm512_reduce_max_ps(top);
#endif
    for (; j < block; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
    return amax;
}

/* A block's codes round(v * inverse) (to nearest even; 0 for a NaN, as lrintf's cast gives), at
   their act_pos places: 16 columns from a multiple of 16 stay side by side there. */
static void block_codes(const float *v, long block, float inverse, int8_t *p, long first) {
    long j = 0;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(inverse);
    for (; j < block; j += 16) {
        __m512 x = _mm512_loadu_ps(v + j);
        x = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), x);
        __m128i q = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x, scale)));
        _mm_storeu_si128((__m128i *)(p + act_pos(first + j, block)), q);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 scale = _mm256_set1_ps(inverse);
    for (; j < block; j += 16) {
        __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + j + 8);
        a = _mm256_and_ps(a, _mm256_cmp_ps(a, a, _CMP_ORD_Q));
        b = _mm256_and_ps(b, _mm256_cmp_ps(b, b, _CMP_ORD_Q));
        __m256i halves = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a, scale)),
                                            _mm256_cvtps_epi32(_mm256_mul_ps(b, scale))); /* a0-3 b0-3 a4-7 b4-7 */
        halves = _mm256_permute4x64_epi64(halves, 0xd8);
        __m128i q = _mm_packs_epi16(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
        _mm_storeu_si128((__m128i *)(p + act_pos(first + j, block)), q);
    }
#endif
    for (; j < block; j++) p[act_pos(first + j, block)] = (int8_t)lrintf(v[j] * inverse);
}

/* Floats of a row's block steps: each step twice (block b at 2b and 2b + 1), the blocks padded to
   an even count with zeros, so that two blocks' steps are one 16-byte load (pair512). */
static long t_stride(long blocks) { return 2 * (blocks + (blocks & 1)); }

/* Round one activation row to int8 per block: codes p (in the kernel's order, act_pos), steps t
   (t_stride), exact sums (per group). */
static void int4_quantize_row(const float *x, long cols, int8_t *p, float *t, float *sums) {
    long block = int4_block(cols), blocks = cols / block;
    memset(t, 0, sizeof(float) * (size_t)t_stride(blocks));
    for (long g = 0; g < cols / GROUP; g++) {
        float s = 0.0f;
        for (int j = 0; j < GROUP; j++) s += x[g * GROUP + j];
        sums[g] = s;
    }
    for (long b = 0; b < cols / block; b++) {
        float amax = block_amax(x + b * block, block);
        if (!(amax > 0.0f) || !isfinite(amax)) { /* zero, or not finite: the sums poison y */
            memset(p + b * block, 0, (size_t)block);
            continue;
        }
        t[2 * b] = t[2 * b + 1] = amax / 127.0f;
        block_codes(x + b * block, block, 127.0f / amax, p, b * block);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* A fixed tree: halves, then quarters, ... */
static inline float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* One thread's share of a product: weight rows [first, last) against the m quantized rows. */
struct int4_job {
    const uint8_t *qw, *gs;
    const int8_t *gn, *p;
    const float *rf, *t, *sums, *bias;
    float *y;
    long rows, cols, m, first, last;
};

#include "int4_tiles.h" /* the kernels: one weight row against a tile of activation rows */

#if defined(__AVX2__) && defined(__FMA__)
/* The vector part of offsets_tile with AVX2 (its groups up to the last multiple of 8), left in lanes,
   for `rows` weight rows at once (their offsets n8 one after the other, `groups` each): acc[q * n +
   i] for weight row q and activation row i, each in the same order as alone. The rows share each
   group's sums and their multiply-adds do not wait on each other (measured, Zen 3: one-row products
   10-19 % faster with eight rows at once than one after the other, the chain of a row's few
   multiply-adds being what a row alone waits on). */
INLINE void offsets_lanes256(const int8_t *n8, const float *sums, long groups, const int n, const int rows,
                             __m256 *acc) {
    for (int a = 0; a < rows * n; a++) acc[a] = _mm256_setzero_ps();
    for (long g = 0; g + 8 <= groups; g += 8)
        for (int q = 0; q < rows; q++) {
            const __m128i codes = _mm_loadl_epi64((const __m128i *)(n8 + q * groups + g));
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
            for (int i = 0; i < n; i++)
                acc[q * n + i] = _mm256_fmadd_ps(v, _mm256_loadu_ps(sums + i * groups + g), acc[q * n + i]);
        }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The vector part of offsets_tile with AVX-512 (its groups up to the last multiple of 16), left in
   lanes: acc[i] for activation row i. */
INLINE void offsets_lanes512(const int8_t *n8, const float *sums, long groups, const int n, __m512 *acc) {
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
    for (long g = 0; g + 16 <= groups; g += 16) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(n8 + g))));
        for (int i = 0; i < n; i++) acc[i] = _mm512_fmadd_ps(v, _mm512_loadu_ps(sums + i * groups + g), acc[i]);
    }
}
#endif

/* The offsets' term of n activation rows (sums: stride groups): sum over groups of n8[g] * sums[g],
   in vector lanes over the groups in order (16 or 8 lanes; one lane in plain C), then a fixed tree;
   each group's offsets widened once for the tile. */
INLINE void offsets_tile(const int8_t *n8, const float *sums, long groups, const int n, float *out) {
    long g = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 acc[TILE];
    offsets_lanes512(n8, sums, groups, n, acc);
    for (int i = 0; i < n; i++) out[i] = sum512(acc[i]);
    g = groups / 16 * 16;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[TILE];
    offsets_lanes256(n8, sums, groups, n, 1, acc);
    for (int i = 0; i < n; i++) out[i] = sum256(acc[i]);
    g = groups / 8 * 8;
#else
    for (int i = 0; i < n; i++) out[i] = 0.0f;
#endif
    for (int i = 0; i < n; i++)
        for (long h = g; h < groups; h++) out[i] += (float)n8[h] * sums[i * groups + h];
}

/* One weight row r against activation rows [i, i + n) of a job, n <= TILE (a constant in each
   expansion, so that the tile's vectors stay in registers). */
INLINE void tile_rows(const struct int4_job *j, long r, long i, const int n) {
    const long cols = j->cols, groups = cols / GROUP, block = int4_block(cols), blocks = cols / block;
    const uint8_t *w = j->qw + r * (cols / 2), *steps = j->gs + r * groups;
    const int8_t *p = j->p + i * cols;
    const long ts = t_stride(blocks);
    const float *t = j->t + i * ts;
    float dots[TILE], offsets[TILE];
    /* tile256's block size is a constant in each expansion: its loop over a block's units unrolls
       (measured, Zen 3: a one-row product 12 % faster than with the size a variable). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (block % 128 == 0)
        tile512(w, steps, p, t, ts, cols, n, dots);
    else
        tile256(w, steps, p, t, ts, cols, UNIT, n, dots);
#elif defined(__AVX2__) && defined(__FMA__)
    if (block == 128)
        tile256(w, steps, p, t, ts, cols, 128, n, dots);
    else
        tile256(w, steps, p, t, ts, cols, UNIT, n, dots);
#else
    tile_c(w, steps, p, t, ts, cols, block, n, dots);
#endif
    offsets_tile(j->gn + r * groups, j->sums + i * groups, groups, n, offsets);
    float d = j->rf[2 * r], e = j->rf[2 * r + 1], b = j->bias ? j->bias[r] : 0.0f;
    for (int k = 0; k < n; k++) j->y[(i + k) * j->rows + r] = d * dots[k] - e * offsets[k] + b;
}

#if defined(__AVX2__) && defined(__FMA__)
#define ROWS8 1
/* sum256 of eight vectors at once: lane r of the result is sum256(v[r]), by the same tree. */
static inline __m256 sums8(const __m256 v[8]) {
    __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]);
    __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]);
    __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]);
    __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]);
    __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xee);
    __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xee);
    __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xee);
    __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xee);
    /* lane l of v[0..7] as one vector each: t_l */
    __m256 t0 = _mm256_permute2f128_ps(b0, b4, 0x20), t4 = _mm256_permute2f128_ps(b0, b4, 0x31);
    __m256 t1 = _mm256_permute2f128_ps(b1, b5, 0x20), t5 = _mm256_permute2f128_ps(b1, b5, 0x31);
    __m256 t2 = _mm256_permute2f128_ps(b2, b6, 0x20), t6 = _mm256_permute2f128_ps(b2, b6, 0x31);
    __m256 t3 = _mm256_permute2f128_ps(b3, b7, 0x20), t7 = _mm256_permute2f128_ps(b3, b7, 0x31);
    /* sum256: halves (l + 4), then quarters (l + 2), then the last pair */
    __m256 h0 = _mm256_add_ps(t0, t4), h1 = _mm256_add_ps(t1, t5), h2 = _mm256_add_ps(t2, t6), h3 = _mm256_add_ps(t3, t7);
    return _mm256_add_ps(_mm256_add_ps(h0, h2), _mm256_add_ps(h1, h3));
}

/* The last steps of weight rows [r, r + 8) against activation rows [i, i + n): lane q of dots[k]
   and offsets[k] is the lanes of weight row q's sums (for row i + k), which sums8 reduces. */
INLINE void rows8_out(const struct int4_job *j, long r, long i, const int n, __m256 dots[][8], __m256 offsets[][8]) {
    float d[8], e[8], b[8];
    for (int q = 0; q < 8; q++)
        d[q] = j->rf[2 * (r + q)], e[q] = j->rf[2 * (r + q) + 1], b[q] = j->bias ? j->bias[r + q] : 0.0f;
    const __m256 dv = _mm256_loadu_ps(d), ev = _mm256_loadu_ps(e), bv = _mm256_loadu_ps(b);
    for (int k = 0; k < n; k++) {
        __m256 y = _mm256_sub_ps(_mm256_mul_ps(dv, sums8(dots[k])), _mm256_mul_ps(ev, sums8(offsets[k])));
        _mm256_storeu_ps(j->y + (i + k) * j->rows + r, _mm256_add_ps(y, bv));
    }
}

/* Whether tile_rows8 takes a row of `cols`: AVX2 with groups a multiple of 8; AVX-512 with blocks
   of 128 and groups a multiple of 16 (no tail for offsets_tile's plain C loop). */
static inline int rows8_fit(long cols) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return cols % 512 == 0;
#else
    return (cols / GROUP) % 8 == 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* tile_rows for weight rows [r, r + 8) at once (rows8_fit): the same sums; each row's lanes halved
   (halves512, the first step of sum512's tree), the rest of the tree and the last steps done in a
   vector whose lanes are the 8 weight rows. Measured on Zen 4 (VNNI, 512-bit operations in two
   halves), weights in cache, against one row's reductions at a time: one or two activation rows
   ~25 % faster, a prompt's 62 rows ~15-20 % on one thread and ~20-25 % on two; with weights from
   memory, one row with the whole 16-lane reduction per row had been slower than the AVX2 kernel. */
INLINE void tile_rows8(const struct int4_job *j, long r, long i, const int n) {
    const long cols = j->cols, groups = cols / GROUP, ts = t_stride(cols / 128);
    const int8_t *p = j->p + i * cols;
    const float *t = j->t + i * ts;
    __m256 dots[TILE][8], offsets[TILE][8];
    for (int q = 0; q < 8; q++) {
        __m512 f[TILE];
        tile512_lanes(j->qw + (r + q) * (cols / 2), j->gs + (r + q) * groups, p, t, ts, cols, n, f);
        for (int k = 0; k < n; k++) dots[k][q] = halves512(f[k]);
        offsets_lanes512(j->gn + (r + q) * groups, j->sums + i * groups, groups, n, f);
        for (int k = 0; k < n; k++) offsets[k][q] = halves512(f[k]);
    }
    rows8_out(j, r, i, n, dots, offsets);
}
#else
/* tile_rows for weight rows [r, r + 8) at once (rows8_fit): the same sums, each row's
   reductions and its last steps done in a vector whose lanes are the 8 weight rows. */
INLINE void tile_rows8(const struct int4_job *j, long r, long i, const int n) {
    const long cols = j->cols, groups = cols / GROUP, block = int4_block(cols), blocks = cols / block;
    const int8_t *p = j->p + i * cols;
    const long ts = t_stride(blocks);
    const float *t = j->t + i * ts;
    __m256 dots[TILE][8], offsets[TILE][8];
    for (int q = 0; q < 8; q++) {
        __m256 f[TILE];
        const uint8_t *w = j->qw + (r + q) * (cols / 2), *steps = j->gs + (r + q) * groups;
        if (block == 128)
            tile256_lanes(w, steps, p, t, ts, cols, 128, n, f);
        else
            tile256_lanes(w, steps, p, t, ts, cols, UNIT, n, f);
        for (int k = 0; k < n; k++) dots[k][q] = f[k];
    }
    /* the offsets of 8 / n weight rows at a time: at most eight sums in registers (a divisor of 8) */
    enum { SUMS = 8 };
    const int together = n > SUMS / 2 ? 1 : SUMS / n;
    for (int q0 = 0; q0 < 8; q0 += together) {
        __m256 o[SUMS];
        offsets_lanes256(j->gn + (r + q0) * groups, j->sums + i * groups, groups, n, together, o);
        for (int q = 0; q < together; q++)
            for (int k = 0; k < n; k++) offsets[k][q0 + q] = o[q * n + k];
    }
    rows8_out(j, r, i, n, dots, offsets);
}
#endif
#endif

/* Weight rows [r0, r1) against activation rows [i, i + n), n <= TILE. */
static void tile_block(const struct int4_job *j, long r0, long r1, long i, long n) {
#ifdef ROWS8
    if (r1 - r0 == 8 && rows8_fit(j->cols)) {
        switch (n) {
        case 1: tile_rows8(j, r0, i, 1); break;
        case 2: tile_rows8(j, r0, i, 2); break;
        case 3: tile_rows8(j, r0, i, 3); break;
        case 4: tile_rows8(j, r0, i, 4); break;
        case 5: tile_rows8(j, r0, i, 5); break;
        case 6: tile_rows8(j, r0, i, 6); break;
        case 7: tile_rows8(j, r0, i, 7); break;
        default: tile_rows8(j, r0, i, TILE); break;
        }
        return;
    }
#endif
    for (long r = r0; r < r1; r++) {
        switch (n) {
        case 1: tile_rows(j, r, i, 1); break;
        case 2: tile_rows(j, r, i, 2); break;
        case 3: tile_rows(j, r, i, 3); break;
#if TILE > 4
        case 4: tile_rows(j, r, i, 4); break;
        case 5: tile_rows(j, r, i, 5); break;
        case 6: tile_rows(j, r, i, 6); break;
        case 7: tile_rows(j, r, i, 7); break;
#endif
        default: tile_rows(j, r, i, TILE); break;
        }
    }
}

/* Weight rows per pass over the activation tiles: their codes and a tile's activation codes stay
   in the first-level cache while the tile is multiplied with each of them. */
enum { ROW_BLOCK = 8 };

static void *int4_job_run(void *arg) {
    const struct int4_job *j = arg;
    for (long r0 = j->first; r0 < j->last; r0 += ROW_BLOCK) {
        long r1 = r0 + ROW_BLOCK < j->last ? r0 + ROW_BLOCK : j->last;
        for (long i = 0; i < j->m; i += TILE) tile_block(j, r0, r1, i, j->m - i < TILE ? j->m - i : TILE);
    }
    return NULL;
}

enum { MAX_THREADS = 16 }; /* at most MAX_JOBS (jobs.h) */

/* y (m x rows) = x (m x cols) @ W.T [+ bias]; W as described above: codes qw (rows x cols/2
   bytes), steps gs (rows x cols/32, uint8), offsets gn (rows x cols/32, int8), row factors rf
   (rows x 2 float32: d, e). The weight rows are split over `threads` threads (a prompt's
   product); every result is computed as with one. Returns 0, -1 for a shape it does not take,
   -2 out of memory. */
int int4_gemm(const uint8_t *qw, const uint8_t *gs, const int8_t *gn, const float *rf, const float *x,
              const float *bias, float *y, long rows, long cols, long m, int threads) {
    if (m < 1 || rows < 1 || cols < UNIT || cols % UNIT) return -1;
    long groups = cols / GROUP, block = int4_block(cols), blocks = cols / block;
    /* per activation row: codes, block steps, group sums; per weight row: steps, offsets */
    int8_t *p = line_buffer((size_t)(m * cols));
    long ts = t_stride(blocks);
    float *t = malloc(sizeof(float) * (size_t)(m * (ts + groups)));
    if (!p || !t) {
        free(p);
        free(t);
        return -2;
    }
    float *sums = t + m * ts;
    for (long i = 0; i < m; i++) int4_quantize_row(x + i * cols, cols, p + i * cols, t + i * ts, sums + i * groups);
    threads = job_count(threads, shares(rows, rows * cols * m), MAX_THREADS);
    struct int4_job jobs[MAX_THREADS];
    for (int i = 0; i < threads; i++)
        jobs[i] = (struct int4_job){qw, gs, gn, p, rf, t, sums, bias, y, rows, cols, m,
                                    rows * i / threads, rows * (i + 1) / threads};
    run_jobs(int4_job_run, jobs, sizeof jobs[0], threads);
    free(p);
    free(t);
    return 0;
}

/* int4_gemm on the calling thread alone: a decoding step's product from Python (kazeia/int4.py). */
int int4_gemv(const uint8_t *qw, const uint8_t *gs, const int8_t *gn, const float *rf, const float *x,
              const float *bias, float *y, long rows, long cols, long m) {
    return int4_gemm(qw, gs, gn, rf, x, bias, y, rows, cols, m, 1);
}
