/* Threads: run a function on `nt` threads of a team, each knowing its index in the team
 * (declared in kernels.h; compiled once, in the fp32 unit, like api.c).
 *
 * With OpenMP (-fopenmp, the usual build and the wheel's) a team is an OpenMP parallel region
 * with a num_threads clause, so the caller's OpenMP settings are left untouched. A compiler
 * without an OpenMP runtime (clang without libomp, as on macOS) builds the same kernels on a small
 * pool of POSIX threads instead: workers are started on first use and kept (as OpenMP keeps its
 * threads, so their per-thread scratch outlives a call), and a call wakes as many as it needs.
 * Kernels split work into tasks taken in order from a shared counter (dynamic schedule) and never
 * depend on which thread runs what, so both runners give the same bits for any thread count.
 *
 * The pool serves one team at a time: a call that finds it busy (another Python thread's call in
 * flight) runs on its own thread alone, which is exact and avoids queueing behind it. A forked
 * child starts with no workers (they do not survive fork) and starts its own on first use.
 */
#include "kernels.h"

static __thread int ta_team_tid;
int ta_thread_index(void) { return ta_team_tid; }

#ifdef _OPENMP
#include <omp.h>


void ta_team(int nt, ta_team_fn fn, void *ctx) {
    if (nt <= 1) {
        fn(ctx, 0, 1);
        return;
    }
#pragma omp parallel num_threads(nt)
    {
        ta_team_tid = omp_get_thread_num();
        fn(ctx, ta_team_tid, omp_get_num_threads());
        ta_team_tid = 0;
    }
}

#else
#include <pthread.h>

#define TA_POOL_MAX 256

typedef struct {
    pthread_mutex_t lock;      /* guards the fields below */
    pthread_cond_t wake, done; /* workers wait on wake for a new generation; the caller on done */
    pthread_mutex_t busy;      /* held by the caller whose team the pool runs */
    int started;               /* workers alive */
    uint64_t generation;       /* one per team */
    int nt, running;           /* team size; workers still in the current team */
    ta_team_fn fn;
    void *ctx;
} ta_pool_t;

static ta_pool_t ta_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
                            PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, NULL, NULL};

static void *ta_pool_worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&ta_pool.lock);
    for (;;) {
        while (ta_pool.generation == seen) pthread_cond_wait(&ta_pool.wake, &ta_pool.lock);
        seen = ta_pool.generation;
        if (tid >= ta_pool.nt) continue; /* not in this team */
        ta_team_fn fn = ta_pool.fn;
        void *ctx = ta_pool.ctx;
        const int nt = ta_pool.nt;
        pthread_mutex_unlock(&ta_pool.lock);
        ta_team_tid = tid;
        fn(ctx, tid, nt);
        pthread_mutex_lock(&ta_pool.lock);
        if (--ta_pool.running == 0) pthread_cond_signal(&ta_pool.done);
    }
    return NULL;
}

/* fork: the child has the parent's memory but none of its workers, and possibly locks a parent
 * thread held; it starts from an empty pool */
static void ta_pool_after_fork(void) {
    pthread_mutex_init(&ta_pool.lock, NULL);
    pthread_mutex_init(&ta_pool.busy, NULL);
    pthread_cond_init(&ta_pool.wake, NULL);
    pthread_cond_init(&ta_pool.done, NULL);
    ta_pool.started = 0;
    ta_pool.running = 0;
}

void ta_team(int nt, ta_team_fn fn, void *ctx) {
    if (nt > TA_POOL_MAX) nt = TA_POOL_MAX;
    if (nt <= 1 || pthread_mutex_trylock(&ta_pool.busy) != 0) {
        fn(ctx, 0, 1);
        return;
    }
    static int forks_handled;
    pthread_mutex_lock(&ta_pool.lock);
    if (!forks_handled) pthread_atfork(NULL, NULL, ta_pool_after_fork), forks_handled = 1;
    if (ta_pool.started == 0) ta_pool.started = 1; /* the caller is thread 0 of every team */
    while (ta_pool.started < nt) { /* workers 1 .. nt-1; `started` counts the caller's slot too */
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&th, &attr, ta_pool_worker, (void *)(intptr_t)ta_pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer threads: still exact */
        ta_pool.started++;
    }
    if (nt > ta_pool.started) nt = ta_pool.started;
    ta_pool.fn = fn;
    ta_pool.ctx = ctx;
    ta_pool.nt = nt;
    ta_pool.running = nt - 1;
    ta_pool.generation++;
    pthread_cond_broadcast(&ta_pool.wake);
    pthread_mutex_unlock(&ta_pool.lock);
    fn(ctx, 0, nt);
    pthread_mutex_lock(&ta_pool.lock);
    while (ta_pool.running > 0) pthread_cond_wait(&ta_pool.done, &ta_pool.lock);
    pthread_mutex_unlock(&ta_pool.lock);
    pthread_mutex_unlock(&ta_pool.busy);
}
#endif
