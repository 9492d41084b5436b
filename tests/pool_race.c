/* Checks of the kernels' thread pool (pool.c, included whole to reach its state), run by
 * tests/test_kernel_pool.py.
 *
 * "stale": a worker that read the word of a finished job and resumes while the next pool_run
 * has written its fields but not yet its generation (the only window the race needs) must claim
 * nothing: prints the number of task calls it made (0).
 * "stress SECONDS": jobs of alternating sizes on 2 threads; prints the indices run twice, the
 * indices not run when pool_run returned, and the calls made for a job that had returned.
 * "solo": a worker stalls 5 ms in a chunk (as when preempted); prints the chunks workers ran in
 * the SOLO_MIN jobs after it (0: the caller ran them alone) and whether workers ran any chunk
 * within the next 5000 jobs (1).
 * "share": a busy thread shares the caller's CPU; prints whether the caller went alone (1). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "pool.c"

static void nothing(void *ctx, int64_t begin, int64_t end) { (void)ctx; (void)begin; (void)end; }
static void count_call(void *ctx, int64_t begin, int64_t end) { (void)begin; (void)end; ++*(int *)ctx; }

static int stale(void) {
    P.active = 1;  /* one worker that never runs on its own: the test plays its part */
    pool_run(nothing, NULL, 9, 1);  /* a small job, finished by the caller alone */
    uint32_t gen = (uint32_t)(atomic_load(&P.word) >> 32);
    int calls = 0;
    P.fn = count_call; P.ctx = &calls; P.n = 576; P.chunk = 36;  /* the next job's fields */
    claim_and_run(gen);  /* the late worker, still on the finished job's generation */
    return calls;
}

typedef struct { int id; int64_t n; _Atomic int *count; } job_t;
static _Atomic int live = -1;
static _Atomic long not_live;

static void mark(void *arg, int64_t begin, int64_t end) {
    const job_t *j = (const job_t *)arg;
    if (atomic_load(&live) != j->id) atomic_fetch_add(&not_live, 1);
    for (int64_t i = begin; i < end && i < j->n; i++) atomic_fetch_add(&j->count[i], 1);
}

static void stress(double seconds) {
    static _Atomic int counts[2][4096];
    long twice = 0, missing = 0;
    struct timespec t0, t;
    set_threads(2);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int k = 0;; k++) {
        int s = k & 1;
        int64_t n = s ? 4096 : 9 + (k % 7) * 16;
        for (int64_t i = 0; i < n; i++) atomic_store(&counts[s][i], 0);
        job_t job = {k, n, counts[s]};
        atomic_store(&live, k);
        pool_run(mark, &job, n, 16);
        atomic_store(&live, -1);
        for (int64_t i = 0; i < n; i++) {
            int c = atomic_load(&counts[s][i]);
            twice += c > 1;
            missing += c == 0;
        }
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec + 1e-9 * (t.tv_nsec - t0.tv_nsec) > seconds) break;
    }
    printf("%ld %ld %ld\n", twice, missing, (long)atomic_load(&not_live));
}

static pthread_t caller;
static _Atomic int worker_calls, stall;

static void busy(void *ctx, int64_t begin, int64_t end) {
    (void)ctx; (void)begin; (void)end;
    if (pthread_equal(pthread_self(), caller)) {
        for (volatile int i = 0; i < 20000; i++) {}
        return;
    }
    atomic_fetch_add(&worker_calls, 1);
    if (atomic_exchange(&stall, 0)) nanosleep(&(struct timespec){0, 5000000}, NULL);
}

static void solo(void) {
    caller = pthread_self();
    set_threads(2);
    for (int tries = 0; tries < 1000 && P.solo_left == 0; tries++) {
        atomic_store(&stall, 1);
        pool_run(busy, NULL, 64, 1);
    }
    atomic_store(&stall, 0);
    atomic_store(&worker_calls, 0);
    for (int k = 0; k < SOLO_MIN; k++) pool_run(busy, NULL, 64, 1);
    int during = atomic_load(&worker_calls);
    for (int k = 0; k < 5000 && atomic_load(&worker_calls) == during; k++) pool_run(busy, NULL, 64, 1);
    printf("%d %d\n", during, atomic_load(&worker_calls) > during);
}

static _Atomic int hog_stop;

static void *hog(void *arg) {
    (void)arg;
    while (!atomic_load(&hog_stop)) {}
    return NULL;
}

static void share(void) {
    caller = pthread_self();
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    set_threads(2);
    pthread_setaffinity_np(caller, sizeof one, &one);
    pthread_t h;
    pthread_create(&h, NULL, hog, NULL);
    pthread_setaffinity_np(h, sizeof one, &one);
    /* up to 5 s of jobs (a fixed count was often too few on a quiet machine): the hog's time
     * slices may fall between jobs (a gap, which starts a new window) many times before one
     * falls inside a window */
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        for (int k = 0; k < WINDOW && P.solo_next == 0; k++) pool_run(busy, NULL, 64, 1);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (P.solo_next == 0 && t.tv_sec - t0.tv_sec + 1e-9 * (t.tv_nsec - t0.tv_nsec) < 5.0);
    atomic_store(&hog_stop, 1);
    pthread_join(h, NULL);
    printf("%d\n", P.solo_next > 0);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "stale") == 0) printf("%d\n", stale());
    else if (argc > 1 && strcmp(argv[1], "solo") == 0) solo();
    else if (argc > 1 && strcmp(argv[1], "share") == 0) share();
    else stress(argc > 2 ? atof(argv[2]) : 1.0);
    return 0;
}
