/* Work split over threads, for the native functions that take a thread count (int4.c's int4_gemm,
   int8.c's int8_gemm, gemv.c's gemm_wide, the vocoder's convolutions, stack.c's step): n jobs of
   `size` bytes each in one array, job 0 run on the calling thread and the others on its helper
   threads (jobs.c), all done before `run_jobs` returns. A job no helper can take runs on the calling
   thread instead, so the work is always done, and each job's results never depend on which thread
   ran it. */

#ifndef KAZEIA_JOBS_H
#define KAZEIA_JOBS_H

#include <stddef.h>

enum { MAX_JOBS = 64 };

/* How many jobs to run: the `threads` asked for, at most `most` (the work's own bound: its items,
   or what is worth a thread) and `cap` (the job array's size), and at least one. */
static inline int job_count(int threads, long most, long cap) {
    if (threads > most) threads = (int)most;
    if (threads > cap) threads = (int)cap;
    return threads < 1 ? 1 : threads;
}

void run_jobs(void *(*run)(void *), void *jobs, size_t size, int n);

#endif
