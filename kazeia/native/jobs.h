/* Work split over threads, for the native functions that take a thread count (int4.c's int4_gemm,
   int8.c's int8_gemm, gemv.c's gemv_team, the vocoder's convolutions, stack.c's step): n jobs of
   `size` bytes each in one array, job 0 run on the calling thread and the others on its helper
   threads (jobs.c), all done before `run_jobs` returns. A job no helper can take runs on the calling
   thread instead, so the work is always done, and each job's results never depend on which thread
   ran it. */

#ifndef KAZEIA_JOBS_H
#define KAZEIA_JOBS_H

#include <stddef.h>
#include <stdlib.h>

enum { MAX_JOBS = 64 };

/* How many jobs to run: the `threads` asked for, at most `most` (the work's own bound: its items,
   or what is worth a thread) and `cap` (the job array's size), and at least one. */
static inline int job_count(int threads, long most, long cap) {
    if (threads > most) threads = (int)most;
    if (threads > cap) threads = (int)cap;
    return threads < 1 ? 1 : threads;
}

/* The most jobs worth a thread for `items` (each job takes whole ones) in a product of `macs`
   multiply-adds: a job handed to a helper costs ~1-10 us, so each should be a few us of work at
   least (a frame step of a tiny test model split over two threads ran ~5x slower than on one). */
static inline long shares(long items, long macs) { return items < macs >> 15 ? items : macs >> 15; }

void run_jobs(void *(*run)(void *), void *jobs, size_t size, int n);

/* A work buffer of `bytes` (freed with free) that starts on a cache line, or NULL: where a
   kernel's vector loads walk a buffer in 32- or 64-byte steps, one from malloc (16-byte aligned)
   makes every other load straddle two lines (measured, Zen 3: the int4 products up to ~10 % and
   the int8 vocoder's convolutions ~10 % slower). */
static inline void *line_buffer(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

#endif
