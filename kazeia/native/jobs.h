/* Work split over threads, for the native functions that take a thread count (vocoder.c's
   snake_beta, int4.c's int4_gemm): n jobs of `size` bytes each in one array, job 0 run on the
   calling thread and each other on a thread of its own, all joined before returning. A job whose
   thread cannot be started runs on the calling thread instead, so the work is always done. */

#ifndef KAZEIA_JOBS_H
#define KAZEIA_JOBS_H

#include <pthread.h>
#include <stddef.h>

enum { MAX_JOBS = 64 };

/* How many jobs to run: the `threads` asked for, at most `most` (the work's own bound: its items,
   or what is worth a thread) and `cap` (the job array's size), and at least one. */
static inline int job_count(int threads, long most, long cap) {
    if (threads > most) threads = (int)most;
    if (threads > cap) threads = (int)cap;
    return threads < 1 ? 1 : threads;
}

static inline void run_jobs(void *(*run)(void *), void *jobs, size_t size, int n) {
    pthread_t ids[MAX_JOBS];
    int started[MAX_JOBS] = {0};
    char *job = jobs;
    const int threaded = n < MAX_JOBS ? n : MAX_JOBS; /* jobs past MAX_JOBS run here too */
    for (int i = 1; i < threaded; i++) started[i] = pthread_create(&ids[i], NULL, run, job + (size_t)i * size) == 0;
    run(job);
    for (int i = threaded; i < n; i++) run(job + (size_t)i * size);
    for (int i = 1; i < threaded; i++) {
        if (started[i])
            pthread_join(ids[i], NULL);
        else
            run(job + (size_t)i * size);
    }
}

#endif
