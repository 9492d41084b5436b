/* A thread pool whose caller never waits for a thread to be scheduled, only for work in progress.
 *
 * pool_run(fn, ctx, n, chunk) splits [0, n) into chunks; the caller and the workers claim chunks
 * with a compare-and-swap on one word holding (job generation, next index), so a worker that
 * wakes late claims nothing from a finished job. The caller then waits only for chunks already
 * claimed. On a CPU shared with other processes a preempted worker therefore costs at most one
 * chunk, where a fork/join barrier (OpenMP's) waits a whole scheduler time slice. Workers spin a
 * little after each job, then sleep on a condition variable.
 *
 * When the machine's cores are busy with other work, sharing a job costs more than it gains (the
 * workers' spinning and their preempted chunks take the caller's time): the caller runs the next
 * jobs alone, SOLO_MIN of them, twice as many each time again (up to SOLO_MAX), fewer after good
 * shared ones. It does so after a job whose caller waited longer than it worked and than
 * SLOW_WAIT_NS (a worker preempted while holding a chunk), and after WINDOW shared jobs in which
 * the caller ran on its core less than MIN_SHARE of the time (threads preempted by other work).
 *
 * A finished job's word is retired (next index UINT32_MAX) before pool_run returns: a worker
 * that read the word of a finished job and is late (preempted, or woken late) may read the next
 * job's n and chunk, and would otherwise claim indices of that job under the old generation,
 * running it a second time and counting them into its done count, so the next pool_run could
 * return while a chunk still runs (on its caller's stack, or on freed buffers). */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "gguf_blocks.h"

#define MAX_WORKERS 63
#define SPINS 20000
#define SOLO_MIN 256
#define SOLO_MAX 16384
#define SLOW_WAIT_NS 1000000  /* a wait this long: a worker was preempted, not just slower */
#define WINDOW 128
#define MIN_SHARE 0.8
#define GAP_NS 1000000  /* a pause this long between shared jobs starts a new window */
#define RETIRED 0xffffffffu  /* the next index of a finished job: above any n (n < 2^32 - 1) */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_workers, active, sleepers;  /* active: workers that claim work (threads - 1) */
    int64_t solo_left, solo_next;     /* jobs the caller still runs alone; the next such run's */
    int64_t window_jobs, window_wall, window_cpu, last_end;  /* the caller's share of its core */
    _Atomic uint64_t word;  /* generation << 32 | next index */
    _Atomic int64_t done;
    task_fn fn;
    void *ctx;
    int64_t n, chunk;
    pthread_t threads[MAX_WORKERS];
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void claim_and_run(uint32_t gen) {
    for (;;) {
        uint64_t w = atomic_load_explicit(&P.word, memory_order_acquire);
        int64_t n = P.n, chunk = P.chunk, begin = (int64_t)(w & 0xffffffffu);
        if ((uint32_t)(w >> 32) != gen || begin >= n) return;
        int64_t end = begin + chunk < n ? begin + chunk : n;
        if (!atomic_compare_exchange_weak_explicit(&P.word, &w, ((uint64_t)gen << 32) | (uint64_t)end,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        P.fn(P.ctx, begin, end);  /* the job stays live until this chunk is counted done */
        atomic_fetch_add_explicit(&P.done, end - begin, memory_order_release);
    }
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = 0;
    for (;;) {
        uint32_t gen;
        int spins = 0;
        while ((gen = (uint32_t)(atomic_load_explicit(&P.word, memory_order_acquire) >> 32)) == seen) {
            if (++spins < SPINS) { _mm_pause(); continue; }
            pthread_mutex_lock(&P.mu);
            P.sleepers++;
            while ((gen = (uint32_t)(atomic_load(&P.word) >> 32)) == seen) pthread_cond_wait(&P.cv, &P.mu);
            P.sleepers--;
            pthread_mutex_unlock(&P.mu);
            break;
        }
        seen = gen;
        if (id < P.active) claim_and_run(gen);
    }
    return NULL;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t thread_cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void go_solo(void) {
    P.solo_next = P.solo_next < SOLO_MIN ? SOLO_MIN : (2 * P.solo_next < SOLO_MAX ? 2 * P.solo_next : SOLO_MAX);
    P.solo_left = P.solo_next;
}

/* After a shared job (started, waiting: when the caller ran out of chunks, ended): alone for a
 * while when sharing did not pay (see the file comment). */
static void judge(int64_t started, int64_t waiting, int64_t ended) {
    if (P.window_jobs == 0 || started - P.last_end > GAP_NS) {
        P.window_jobs = 0;
        P.window_wall = started;
        P.window_cpu = thread_cpu_ns();
    }
    P.last_end = ended;
    if (ended - waiting > waiting - started && ended - waiting > SLOW_WAIT_NS) {
        P.window_jobs = 0;
        go_solo();
    } else if (++P.window_jobs == WINDOW) {
        P.window_jobs = 0;
        if (thread_cpu_ns() - P.window_cpu < MIN_SHARE * (ended - P.window_wall)) go_solo();
    } else if (P.solo_next > 0) {
        P.solo_next--;
    }
}

/* fn(ctx, begin, end) over chunks of [0, n) (n < 2^32 - 1), on the caller and the workers;
 * returns when every chunk has run. One caller at a time. */
void pool_run(task_fn fn, void *ctx, int64_t n, int64_t chunk) {
    if (n <= 0) return;
    if (P.active == 0 || n <= chunk || P.solo_left > 0) {
        if (P.solo_left > 0) P.solo_left--;
        fn(ctx, 0, n);
        return;
    }
    int64_t started = now_ns();
    uint32_t gen = (uint32_t)(atomic_load(&P.word) >> 32) + 1;
    P.fn = fn; P.ctx = ctx; P.n = n; P.chunk = chunk;
    atomic_store(&P.done, 0);
    atomic_store_explicit(&P.word, (uint64_t)gen << 32, memory_order_release);
    pthread_mutex_lock(&P.mu);
    if (P.sleepers) pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    claim_and_run(gen);
    int64_t waiting = now_ns();
    for (int spins = 0; atomic_load_explicit(&P.done, memory_order_acquire) < n; spins++) {
        if (spins < SPINS) _mm_pause(); else sched_yield();  /* a preempted worker holds a chunk */
    }
    judge(started, waiting, now_ns());
    /* retire the job before the next one's fields are written (see the file comment); a full
     * barrier: no later store moves before it */
    atomic_store(&P.word, ((uint64_t)gen << 32) | RETIRED);
}

/* Use n threads in all: the caller and n - 1 workers (started when first needed). */
void set_threads(int n) {
    pthread_mutex_lock(&P.mu);
    int want = n - 1 > MAX_WORKERS ? MAX_WORKERS : (n < 1 ? 0 : n - 1);
    while (P.n_workers < want) {
        if (pthread_create(&P.threads[P.n_workers], NULL, worker, (void *)(intptr_t)P.n_workers) != 0) break;
        pthread_detach(P.threads[P.n_workers]);
        P.n_workers++;
    }
    P.active = want < P.n_workers ? want : P.n_workers;
    pthread_mutex_unlock(&P.mu);
}
int get_threads(void) { return P.active + 1; }
