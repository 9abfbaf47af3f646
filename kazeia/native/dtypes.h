/* The activation dtypes the native code takes, shared by decode.c and gemv.c: `dt` is 0 for
   float32, 1 for bfloat16 (stored as uint16), 2 for float16 (where the compiler has _Float16; the
   caller checks `has_float16`, decode.c). Conversions round to nearest even, as torch does. */

#ifndef KAZEIA_DTYPES_H
#define KAZEIA_DTYPES_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef __FLT16_MAX__ /* the compiler has IEEE half precision */
typedef _Float16 half;
#define KAZEIA_HAS_FLOAT16 1
#else
typedef uint16_t half; /* never used as a number: the caller checks has_float16() */
#define KAZEIA_HAS_FLOAT16 0
#endif

/* Element i of an array of dt values, as float32. */
static inline float load(const void *p, long i, int dt) {
    if (dt == BF16) return from_bf16(((const uint16_t *)p)[i]);
    if (dt == F16) return (float)((const half *)p)[i];
    return ((const float *)p)[i];
}

/* Element i of an array of dt values := v rounded to dt. */
static inline void store(void *p, long i, float v, int dt) {
    if (dt == BF16)
        ((uint16_t *)p)[i] = to_bf16(v);
    else if (dt == F16)
        ((half *)p)[i] = (half)v;
    else
        ((float *)p)[i] = v;
}

#endif
