/* Where a call's cycles go: per-phase time-stamp counters, compiled in only for the profiling build.
 *
 * build.py compiles a separate library with -DTA_PROFILE=1 when TILEATTN_NATIVE_PROFILE=1; every
 * other build sees empty macros, so the kernels carry no trace of the instrumentation. In the
 * profiling build each thread adds the TSC ticks of every phase of every tile to thread-local
 * counters, flushed into one global array at the end of each task; ta_profile_read() returns and
 * clears them (kernels.profile() in Python). The TSC ticks at a constant rate (the nominal clock), so
 * the counters are times, not core cycles; the shares of the phases are what they are for.
 *
 * A thread preempted during a task would charge the whole time slice (a millisecond or more) to
 * whichever phase was running. So intervals longer than TA_PROF_LONG are held apart until the task
 * ends: if the thread's involuntary context switches did not change, they count as usual; if they
 * did, they are dropped from the phases and from "task" ("preempted" counts such tasks). "task_all"
 * keeps every task's time, which with "region" gives the threads' idle time.
 *
 * Usage in a kernel:  TA_PROF_T(t);  ...work...;  TA_PROF(t, fwd_scores);  ...;  TA_PROF(t, ...)
 * (TA_PROF charges the ticks since t to a phase and restarts t).
 */
#ifndef TA_PROFILE_H
#define TA_PROFILE_H

#include <stdint.h>

/* The phases, in the order ta_profile_names() lists them. */
#define TA_PHASES(X)                                                                                \
    X(fwd_pack) X(fwd_scores) X(fwd_mods) X(fwd_softmax) X(fwd_pv) X(fwd_finish) X(fwd_kv_convert)   \
    X(bwd_pack) X(bwd_scores) X(bwd_dp) X(bwd_mods) X(bwd_probs) X(bwd_dv) X(bwd_dk) X(bwd_dq)       \
    X(bwd_store) X(task) X(task_all) X(region) X(calls) X(tasks) X(preempted)

#define TA_PHASE_ENUM(name) TA_PH_##name,
enum { TA_PHASES(TA_PHASE_ENUM) TA_PH_COUNT };

#ifdef TA_PROFILE
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define TA_TICKS() __rdtsc()
#elif defined(__aarch64__)
static inline uint64_t ta_ticks_arm(void) {
    uint64_t t;
    __asm__ volatile("mrs %0, cntvct_el0" : "=r"(t));
    return t;
}
#define TA_TICKS() ta_ticks_arm()
#else
#error "TA_PROFILE needs a time-stamp counter (x86-64 or aarch64)"
#endif

/* Thread-local counters of the running task and the process-wide totals (api.c). */
extern __thread uint64_t ta_prof_local[TA_PH_COUNT], ta_prof_long[TA_PH_COUNT];
#define TA_PROF_LONG (1u << 20) /* ticks: ~0.3-0.5 ms, below a scheduler time slice */
void ta_prof_flush(void);
long ta_prof_switches(void);     /* this thread's involuntary context switches so far */
void ta_prof_task_end(long switches_before, uint64_t ticks);

#define TA_PROF_T(t) uint64_t t = TA_TICKS()
#define TA_PROF(t, phase)                                                                           \
    do {                                                                                            \
        uint64_t now_ = TA_TICKS(), d_ = now_ - (t);                                                \
        if (d_ > TA_PROF_LONG)                                                                      \
            ta_prof_long[TA_PH_##phase] += d_;                                                      \
        else                                                                                        \
            ta_prof_local[TA_PH_##phase] += d_;                                                     \
        (t) = now_;                                                                                 \
    } while (0)
#define TA_PROF_REGION(t) (ta_prof_local[TA_PH_region] += TA_TICKS() - (t))
#define TA_PROF_COUNT(phase, n) (ta_prof_local[TA_PH_##phase] += (uint64_t)(n))
#define TA_PROF_FLUSH() ta_prof_flush()
#define TA_PROF_TASK_T(t, sw) uint64_t t = TA_TICKS(); long sw = ta_prof_switches()
#define TA_PROF_TASK(t, sw) ta_prof_task_end(sw, TA_TICKS() - (t))
#else
#define TA_PROF_T(t) ((void)0)
#define TA_PROF(t, phase) ((void)0)
#define TA_PROF_COUNT(phase, n) ((void)0)
#define TA_PROF_FLUSH() ((void)0)
#define TA_PROF_TASK_T(t, sw) ((void)0)
#define TA_PROF_TASK(t, sw) ((void)0)
#define TA_PROF_REGION(t) ((void)0)
#endif

#endif
