/* The helper threads behind run_jobs (jobs.h).

   Each thread that splits work keeps its own helpers, started on its first split and kept until
   it ends (a thread-specific key's destructor stops and joins them); a split hands the helpers
   their jobs and wakes them, runs job 0 itself, then waits for them. Starting and joining a thread
   for every split cost ~40 us (measured, a 2-vCPU KVM guest: a prompt makes ~200 splits, a step
   split over two threads ~400), handing a job to a sleeping helper ~10 us, to one still polling
   ~1 us. A helper polls for its next jobs for POLL_NS, then sleeps on a futex, so that idle
   helpers take no CPU from anyone else (a busy neighbour included) for longer than that; the
   caller waits for its helpers the same way. Work is split only where threads were given for it:
   a prompt's team (the prompt and its first frame, while nothing else runs: kazeia/placement.py)
   and a stage of several threads (the vocoder's convolutions on a larger machine).

   Helpers belong to one process: after a fork the child's calling thread has none (they stayed in
   the parent) and starts its own. Where a helper cannot be started its jobs run on the calling
   thread. Off Linux (no futex) every split starts and joins its threads. */

#define _GNU_SOURCE
#include "jobs.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* How long a waiting thread polls before it sleeps: longer than the gap between two products of
   a prompt (its glue in torch, ~0.1-1 ms) or of a native step (~5-30 us). Measured on a 2-vCPU
   KVM guest, 0.6B int4, a 3-sentence prompt: 50 us let the helper fall asleep between a prompt's
   products and its prefill gained nothing over starting threads; 1 ms, 5 %. */
#define POLL_NS 1000000L

struct helpers;

/* What a helper knows of itself: its pool, its job index, and the round it has done last. */
struct seat {
    struct helpers *pool;
    int index;
    unsigned seen;
};

struct helpers {
    pid_t pid; /* the process they run in */
    int count; /* helpers started */
    pthread_t ids[MAX_JOBS];
    struct seat seats[MAX_JOBS];
    _Atomic unsigned round; /* bumped by the owner to hand out a round of jobs */
    _Atomic unsigned left;  /* helpers that have not finished the current round */
    _Atomic int stop;
    /* the current round: helper k runs job k if k < n */
    void *(*run)(void *);
    char *jobs;
    size_t size;
    int n;
};

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long elapsed_ns(const struct timespec *since) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

/* Return once *word differs from `value`: polling for POLL_NS, then asleep on the futex. */
static void wait_change(_Atomic unsigned *word, unsigned value) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int i = 1;; i++) {
        if (atomic_load(word) != value) return;
        relax();
        if (i % 64 == 0 && elapsed_ns(&start) > POLL_NS) break;
    }
    while (atomic_load(word) == value) syscall(SYS_futex, (void *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void wake(_Atomic unsigned *word, int count) {
    syscall(SYS_futex, (void *)word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}

static void *helper_main(void *arg) {
    struct seat *seat = arg;
    struct helpers *pool = seat->pool;
    for (;;) {
        wait_change(&pool->round, seat->seen);
        seat->seen = atomic_load(&pool->round);
        if (atomic_load(&pool->stop)) return NULL;
        if (seat->index < pool->n) pool->run(pool->jobs + (size_t)seat->index * pool->size);
        if (atomic_fetch_sub(&pool->left, 1) == 1) wake(&pool->left, 1);
    }
}

/* The key's destructor, when the owning thread ends: stop the helpers and join them. */
static void retire(void *arg) {
    struct helpers *pool = arg;
    if (pool->pid == getpid()) {
        atomic_store(&pool->stop, 1);
        atomic_fetch_add(&pool->round, 1);
        wake(&pool->round, INT_MAX);
        for (int i = 0; i < pool->count; i++) pthread_join(pool->ids[i], NULL);
    }
    free(pool);
}

static pthread_key_t key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static int key_made;
static __thread struct helpers *own;

static void make_key(void) { key_made = pthread_key_create(&key, retire) == 0; }

/* The calling thread's pool with at least `want` helpers started if it can, or NULL. */
static struct helpers *helpers(int want) {
    if (own && own->pid != getpid()) { /* a fork's child: the helpers are the parent's */
        pthread_setspecific(key, NULL);     /* so that this thread's end does not retire it again */
        free(own);
        own = NULL;
    }
    if (!own) {
        pthread_once(&key_once, make_key);
        struct helpers *pool = key_made ? calloc(1, sizeof *pool) : NULL;
        if (!pool) return NULL;
        pool->pid = getpid();
        if (pthread_setspecific(key, pool)) {
            free(pool);
            return NULL;
        }
        own = pool;
    }
    while (own->count < want) {
        struct seat *seat = &own->seats[own->count];
        *seat = (struct seat){own, own->count + 1, atomic_load(&own->round)};
        if (pthread_create(&own->ids[own->count], NULL, helper_main, seat)) break;
        own->count++;
    }
    return own;
}

void run_jobs(void *(*run)(void *), void *jobs, size_t size, int n) {
    char *job = jobs;
    struct helpers *pool = n > 1 ? helpers(n - 1 < MAX_JOBS - 1 ? n - 1 : MAX_JOBS - 1) : NULL;
    int taken = pool ? (pool->count < n - 1 ? pool->count : n - 1) : 0; /* jobs 1 .. taken go to helpers */
    if (taken) {
        pool->run = run, pool->jobs = job, pool->size = size, pool->n = taken + 1;
        atomic_store(&pool->left, (unsigned)pool->count);
        atomic_fetch_add(&pool->round, 1);
        wake(&pool->round, INT_MAX);
    }
    run(job);
    for (int i = taken + 1; i < n; i++) run(job + (size_t)i * size);
    if (taken)
        for (unsigned left; (left = atomic_load(&pool->left)) != 0;) wait_change(&pool->left, left);
}

#else /* no futex: a thread started and joined for each job */

void run_jobs(void *(*run)(void *), void *jobs, size_t size, int n) {
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
