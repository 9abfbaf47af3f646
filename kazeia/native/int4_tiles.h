/* The int4 product's kernels (included by int4.c, after its quantization helpers and `struct
   int4_job`): one weight row against a tile of up to TILE activation rows, for AVX-512 (with and
   without VNNI), AVX2 and plain C. Every path sums a row's blocks in the same order whatever the
   tile's size, so a row keeps its one-row bits (int4.c's header says how). */

/* ---- the kernels: one weight row against a tile of n <= TILE activation rows ------------------
   A unit of 64 columns (two groups, 32 bytes): one mask and one shift give both groups' first and
   second halves, one group per 128-bit lane; the products are u8 codes x s8 activation codes, the
   groups' steps multiply their lanes' sums in int32, and each block of 128 (or 64) columns meets
   float arithmetic once: its lanes converted and multiplied by the row's block step. */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TILE 8 /* activation rows per tile */
/* Units u and u + 1 (a block of 128): the codes' low and high nibbles (one group per 128-bit lane). */
struct unpacked512 {
    __m512i low, high;
};
INLINE struct unpacked512 unpack512(const uint8_t *w, long u) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512i raw = _mm512_loadu_si512((const void *)(w + u * 32));
    _mm_prefetch((const char *)(w + u * 32 + PREFETCH512), _MM_HINT_T1);
    return (struct unpacked512){_mm512_and_si512(raw, mask), _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask)};
}
#if defined(__AVX512VNNI__)
/* Pairs of blocks (VNNI). Each block's 16 lanes of 8 products (vpdpbusd) fit in 16 bits: blocks b
   and b + 1 are packed side by side (vpackssdw: in each 128-bit lane, group l of block b, then
   group l of block b + 1) and multiplied by their groups' steps (vpdpwssd), 16 int32 lanes of 16
   products each; converted once and multiplied by the two blocks' steps [t_b t_b t_b+1 t_b+1] per
   128-bit lane: per 256 columns and row, four vpdpbusd, one pack, one vpdpwssd, one conversion
   and one FMA. */
/* The steps of blocks b (the first 4 bytes of `eight`) and b + 1 (the next 4) as vpdpwssd's
   multipliers: in 128-bit lane l, 4 x int16 step of group l of b, then 4 x that of b + 1. */
INLINE __m512i pair_steps(uint64_t eight) {
    static const int8_t order[64] = {
        0, -1, 0, -1, 0, -1, 0, -1, 4, -1, 4, -1, 4, -1, 4, -1, 1, -1, 1, -1, 1, -1, 1, -1, 5, -1, 5, -1, 5, -1, 5, -1,
        2, -1, 2, -1, 2, -1, 2, -1, 6, -1, 6, -1, 6, -1, 6, -1, 3, -1, 3, -1, 3, -1, 3, -1, 7, -1, 7, -1, 7, -1, 7, -1};
    return _mm512_shuffle_epi8(_mm512_set1_epi64((long long)eight), _mm512_loadu_si512((const void *)order));
}
/* The 8-product lanes of block b's units (u = 2b, 2b + 1) against activation codes x. */
INLINE __m512i eights512(struct unpacked512 k, const int8_t *x, long u) {
    __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k.low, _mm512_loadu_si512((const void *)(x + u * UNIT)));
    return _mm512_dpbusd_epi32(e, k.high, _mm512_loadu_si512((const void *)(x + u * UNIT + UNIT))); /* <= 8*15*127 */
}
/* Blocks b and, where `two`, b + 1 (codes ka, kb; steps as pair_steps gives them) of n activation rows
   p (stride cols, block steps t at stride ts) into their sums f; `two` is a constant in each
   expansion, so neither loop tests it. */
INLINE void pair512(struct unpacked512 ka, struct unpacked512 kb, const int two, __m512i steps, const int8_t *p,
                    const float *t, long ts, long cols, long b, const int n, __m512 *f) {
    for (int i = 0; i < n; i++) {
        const int8_t *x = p + i * cols;
        __m512i second = two ? eights512(kb, x, 2 * b + 2) : _mm512_setzero_si512();
        __m512i ints = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(eights512(ka, x, 2 * b), second),
                                           steps);
        __m512 scale = _mm512_broadcast_f32x4(_mm_loadu_ps(t + i * ts + 2 * b));
        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), scale, f[i]);
    }
}
/* A weight row's blocks of 128 against n activation rows p (stride cols), block steps t (stride
   ts): each row's sums in 16 lanes (f), for its caller to reduce. */
INLINE void tile512_lanes(const uint8_t *w, const uint8_t *gs, const int8_t *p, const float *t, long ts, long cols,
                          const int n, __m512 *f) {
    const long blocks = cols / 128;
    for (int i = 0; i < n; i++) f[i] = _mm512_setzero_ps();
    long b = 0;
    for (; b + 1 < blocks; b += 2) { /* whole pairs of blocks */
        uint64_t eight;
        memcpy(&eight, gs + 4 * b, 8);
        pair512(unpack512(w, 2 * b), unpack512(w, 2 * b + 2), 1, pair_steps(eight), p, t, ts, cols, b, n, f);
    }
    if (b < blocks) { /* an odd last block: its pair's second half is zero */
        uint32_t four;
        memcpy(&four, gs + 4 * b, 4);
        const struct unpacked512 ka = unpack512(w, 2 * b);
        pair512(ka, ka, 0, pair_steps(four), p, t, ts, cols, b, n, f);
    }
}
#else
/* A block's steps widened to int16 across their groups' 128-bit lanes (once a tile), then its
   int32 lanes per activation row: two vpmaddubsw, one 16-bit add, one vpmaddwd. */
INLINE __m512i steps512(const uint8_t *gs, long u) {
    int32_t four;
    memcpy(&four, gs + 2 * u, sizeof four);
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_cvtsi32_si128(four)),
                               _mm512_set_epi8(-1, 3, -1, 3, -1, 3, -1, 3, -1, 3, -1, 3, -1, 3, -1, 3,
                                               -1, 2, -1, 2, -1, 2, -1, 2, -1, 2, -1, 2, -1, 2, -1, 2,
                                               -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1,
                                               -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0));
}
INLINE __m512i block512(struct unpacked512 k, __m512i steps, const int8_t *x, long u) {
    __m512i first = _mm512_maddubs_epi16(k.low, _mm512_loadu_si512((const void *)(x + u * UNIT)));
    __m512i second = _mm512_maddubs_epi16(k.high, _mm512_loadu_si512((const void *)(x + u * UNIT + UNIT)));
    return _mm512_madd_epi16(_mm512_add_epi16(first, second), steps);
}
/* tile512_lanes without VNNI. */
INLINE void tile512_lanes(const uint8_t *w, const uint8_t *gs, const int8_t *p, const float *t, long ts, long cols,
                          const int n, __m512 *f) {
    const long blocks = cols / 128;
    for (int i = 0; i < n; i++) f[i] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        struct unpacked512 k = unpack512(w, 2 * b);
        __m512i steps = steps512(gs, 2 * b);
        for (int i = 0; i < n; i++)
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block512(k, steps, p + i * cols, 2 * b)),
                                   _mm512_set1_ps(t[i * ts + 2 * b]), f[i]);
    }
}
#endif
/* The first step of a 16-lane vector's fixed tree (its two halves added): sum512 ends it, and the
   eight-row kernel (tile_rows8) ends it for eight vectors at once, by the same tree. */
INLINE __m256 halves512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
INLINE float sum512(__m512 v) { return sum256(halves512(v)); }
/* tile512_lanes, each row's lanes reduced (sum512). */
INLINE void tile512(const uint8_t *w, const uint8_t *gs, const int8_t *p, const float *t, long ts, long cols,
                    const int n, float *out) {
    __m512 f[TILE];
    tile512_lanes(w, gs, p, t, ts, cols, n, f);
    for (int i = 0; i < n; i++) out[i] = sum512(f[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define TILE 8 /* measured (Zen 3): prompt rows ~10 % faster than in tiles of 4, one row the same */
#else
#define TILE 4
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 (and AVX-512 for blocks of 64): one unit of 64 columns a vector, one group per 128-bit lane. */
struct unpacked256 {
    __m256i low, high, steps;
};
INLINE struct unpacked256 unpack256(const uint8_t *w, __m256i steps, long u) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __m256i raw = _mm256_loadu_si256((const __m256i *)(w + u * 32));
    if (u & 1) _mm_prefetch((const char *)(w + u * 32 + PREFETCH), _MM_HINT_T0);
    return (struct unpacked256){_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask), steps};
}
/* The steps of unit u and, where `two`, u + 1 (2 or 4 groups, one load) widened to int16, one group
   per 128-bit lane: unit u's in first, u + 1's in second (measured, Zen 3: a one-row product ~5 %
   faster than widening each unit's two steps on their own). */
INLINE void steps256(const uint8_t *gs, long u, const int two, __m256i *first, __m256i *second) {
    int32_t four = 0;
    memcpy(&four, gs + 2 * u, two ? 4 : 2);
    const __m256i all = _mm256_set1_epi32(four);
    *first = _mm256_shuffle_epi8(all, _mm256_set_epi8(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1,
                                                      -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0));
    if (two)
        *second = _mm256_shuffle_epi8(all, _mm256_set_epi8(-1, 3, -1, 3, -1, 3, -1, 3, -1, 3, -1, 3, -1, 3, -1, 3,
                                                           -1, 2, -1, 2, -1, 2, -1, 2, -1, 2, -1, 2, -1, 2, -1, 2));
}
INLINE __m256i dot256(struct unpacked256 k, const int8_t *x, long u) {
    __m256i first = _mm256_maddubs_epi16(k.low, _mm256_loadu_si256((const __m256i *)(x + u * UNIT)));
    __m256i second = _mm256_maddubs_epi16(k.high, _mm256_loadu_si256((const __m256i *)(x + u * UNIT + 32)));
    return _mm256_madd_epi16(_mm256_add_epi16(first, second), k.steps);
}
/* tile512 for AVX2's vectors: a block's units' integer lanes added (exact), then converted; each
   row's sums left in their lanes (f[i]), for its caller to reduce. Both units of a block are
   unpacked first and each row's two dot products added at once, so that no integer sums are held
   across the units (measured, Zen 3: with eight rows' integer and float sums in registers they
   spilled, and prompt products ran 8-27 % slower; the integers are the same). */
INLINE void tile256_lanes(const uint8_t *w, const uint8_t *gs, const int8_t *p, const float *t, long ts, long cols,
                          long block, const int n, __m256 *f) {
    const long per_block = block / UNIT, blocks = cols / block;
    for (int i = 0; i < n; i++) f[i] = _mm256_setzero_ps();
    for (long b = 0, u = 0; b < blocks; b++, u += per_block) {
        __m256i steps[2];
        steps256(gs, u, per_block == 2, &steps[0], &steps[1]);
        const struct unpacked256 first = unpack256(w, steps[0], u);
        if (per_block == 2) {
            const struct unpacked256 second = unpack256(w, steps[1], u + 1);
            for (int i = 0; i < n; i++) {
                const __m256i sum = _mm256_add_epi32(dot256(first, p + i * cols, u), dot256(second, p + i * cols, u + 1));
                f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(t[i * ts + 2 * b]), f[i]);
            }
        } else {
            for (int i = 0; i < n; i++) {
                const __m256i sum = dot256(first, p + i * cols, u);
                f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(t[i * ts + 2 * b]), f[i]);
            }
        }
    }
}
/* tile256_lanes, each row's lanes reduced (sum256). */
INLINE void tile256(const uint8_t *w, const uint8_t *gs, const int8_t *p, const float *t, long ts, long cols,
                    long block, const int n, float *out) {
    __m256 f[TILE];
    tile256_lanes(w, gs, p, t, ts, cols, block, n, f);
    for (int i = 0; i < n; i++) out[i] = sum256(f[i]);
}
#endif

#if !(defined(__AVX2__) && defined(__FMA__))
/* Plain C: the same integers per block, summed in one float per row. */
INLINE void tile_c(const uint8_t *w, const uint8_t *gs, const int8_t *p, const float *t, long ts, long cols,
                   long block, const int n, float *out) {
    const long per_block = block / UNIT, blocks = cols / block;
    for (int i = 0; i < n; i++) out[i] = 0.0f;
    for (long b = 0, g = 0; b < blocks; b++) {
        int32_t acc[TILE] = {0};
        for (long k = 0; k < per_block * (UNIT / GROUP); k++, g++) {
            int32_t low[16], high[16];
            for (int j = 0; j < 16; j++) low[j] = w[g * 16 + j] & 0x0f, high[j] = w[g * 16 + j] >> 4;
            for (int i = 0; i < n; i++) {
                const int8_t *x = p + i * cols + g * GROUP;
                int32_t dot = 0;
                for (int j = 0; j < 16; j++) dot += low[j] * x[j] + high[j] * x[16 + j];
                acc[i] += dot * gs[g];
            }
        }
        for (int i = 0; i < n; i++) out[i] += (float)acc[i] * t[i * ts + 2 * b];
    }
}
#endif
