/* The library's exported functions: the interface description, validation of the index data that
 * Python does not read (cu_seqlens, seqused_k, block tables), dispatch by dtype, the task runner,
 * per-thread scratch and the SIGINT hook for cancellation.
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "amx.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "kernels.h"
#include "profile.h"

/* Below this many multiply-adds a call runs on the calling thread: a team's fork/join costs a few
 * microseconds, more than a small decode step's compute. */
#define TA_PARALLEL_MIN_WORK (1 << 19)

/* ----------------------------------------------------------------------------- interface description */

#define TA_DESCRIBE(section, kind, name) #section ":" #name ":" #kind ","
const char *ta_abi(void) { return TA_FIELDS(TA_DESCRIBE); }
const char *ta_user_abi(void) { return TA_USER_FIELDS(TA_DESCRIBE); }

/* The CPU features this library was compiled for (simd.h), without the marker. Its body is a pointer
 * to a constant, so calling it runs no vector instruction. */
const char *ta_isa_features(void) { return ta_cpu_features + sizeof TA_FEATURE_MARKER - 1; }

const char *ta_build_info(void) {
    return "isa=" TA_ISA_NAME ";amx="
#ifdef TA_HAVE_AMX
           "1"
#else
           "0"
#endif
           ";bf16dot="
#ifdef TA_HAVE_BF16DOT
           "1"
#else
           "0"
#endif
           ";openmp="
#ifdef _OPENMP
           "1"
#else
           "0"
#endif
           ";compiler=" __VERSION__;
}

/* Multiply-adds per second of vdpbf16ps over those of fp32 FMAs on this core (0 without
 * AVX512_BF16): kernels.py turns the bf16 dot-product tiles on where they are faster. Measured, not
 * assumed: on Zen 4 vdpbf16ps does twice the fp32 rate, on the Sapphire Rapids this was written on
 * half of it. */
double ta_probe_bf16dot(void) {
#ifdef TA_HAVE_BF16DOT
    double f32 = INFINITY, bf16 = INFINITY; /* the fastest of five runs each: preemption only slows */
    for (int rep = 0; rep < 5; rep++) {
        double t = ta_bf16dot_probe_seconds(0);
        f32 = t < f32 ? t : f32;
        t = ta_bf16dot_probe_seconds(1);
        bf16 = t < bf16 ? t : bf16;
    }
    return bf16 > 0 ? 2.0 * f32 / bf16 : 0; /* a vdpbf16ps does twice an FMA's multiply-adds */
#else
    return 0;
#endif
}

/* fp32 FMA peak of `threads` cores in GFLOP/s (wall clock, best of three): what the benchmarks
 * report efficiency against. As many independent accumulators as the micro-GEMM uses. */
static void fma_probe_thread(void *ctx, int tid, int nt) {
    enum { ACC = 2 * TA_MR, ITERS = 200000 };
    (void)ctx, (void)tid, (void)nt;
    vr acc[ACC];
    const vr x = vset1(0.999f), y = vset1(1e-3f);
#pragma GCC unroll 24
    for (int i = 0; i < ACC; i++) acc[i] = vset1((float)i);
    for (int it = 0; it < ITERS; it++)
#pragma GCC unroll 24
        for (int i = 0; i < ACC; i++) acc[i] = vfma(acc[i], x, y);
    float sink = 0;
    for (int i = 0; i < ACC; i++) sink += vsum(acc[i]);
    __asm__ volatile("" : : "r"(&sink) : "memory");
}

double ta_probe_fma_gflops(int64_t threads) {
    enum { ACC = 2 * TA_MR, ITERS = 200000 };
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ta_team((int)threads, fma_probe_thread, NULL);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double t = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        double gflops = (double)threads * ITERS * ACC * VW * 2 / t * 1e-9;
        best = gflops > best ? gflops : best;
    }
    return best;
}

/* Elements per second that the kernels' exp2 (simd.h) turns out on one core, with the subtraction
 * of the running max and the row sum the softmax pass does around it: the second roof of attention
 * on a CPU, since exp2 runs on the same vector ports as the FMAs. Thread CPU time, best of five. */
double ta_probe_exp2_rate(void) {
    enum { N = 1024, ITERS = 400 };
    static __thread real buf[N];
    for (int i = 0; i < N; i++) buf[i] = (real)(-(i % 97) * 0.125);
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
        vr sum[4] = {vzero(), vzero(), vzero(), vzero()};
        const vr m = vset1((real)0.5);
        for (int it = 0; it < ITERS; it++)
            for (int i = 0; i < N; i += 4 * VW)
                for (int k = 0; k < 4; k++) sum[k] += vexp2(vload(buf + i + k * VW) - m);
        __asm__ volatile("" : : "r"(sum) : "memory");
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
        double t = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        double rate = t > 0 ? (double)N * ITERS / t : 0;
        best = rate > best ? rate : best;
    }
    return best;
}

#ifdef TA_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#define TA_ARCH_REQ_XCOMP_PERM 0x1023
#define TA_XFEATURE_XTILEDATA 18

/* Linux (5.16+) hands out the AMX tile state only to processes that ask; asking again is harmless
 * (PyTorch's oneDNN asks too). -1 = not asked yet. */
static int amx_state = -1;

int ta_amx_available(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state < 0) {
        state = syscall(SYS_arch_prctl, TA_ARCH_REQ_XCOMP_PERM, TA_XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state;
}
#endif

/* AMX bf16 peak of one core in GFLOP/s: tdpbf16ps on four accumulator tiles in registers (thread
 * CPU time, best of five); 0 without AMX or without the kernel's permission. */
double ta_probe_amx_gflops(void) {
#ifdef TA_HAVE_AMX
    enum { ITERS = 20000 };
    if (!ta_amx_available()) return 0;
    static __thread uint16_t a[16 * 32], b[16 * 32];
    static __thread float c[16 * 16];
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    double best = 0;
    ta_amx_begin();
    for (int rep = 0; rep < 5; rep++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a, 64);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b, 64);
        for (int it = 0; it < ITERS; it++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, 64);
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
        double t = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        double gflops = t > 0 ? 4.0 * ITERS * 16 * 16 * 32 * 2 / t * 1e-9 : 0;
        best = gflops > best ? gflops : best;
    }
    ta_amx_end();
    return best;
#else
    return 0;
#endif
}

/* --------------------------------------------------------------------------------------- profile */

#define TA_PHASE_NAME(name) #name ","
const char *ta_profile_names(void) { return TA_PHASES(TA_PHASE_NAME); }

#ifdef TA_PROFILE
__thread uint64_t ta_prof_local[TA_PH_COUNT], ta_prof_long[TA_PH_COUNT];
static uint64_t prof_total[TA_PH_COUNT];

void ta_prof_flush(void) {
    for (int i = 0; i < TA_PH_COUNT; i++) {
        if (ta_prof_local[i]) __atomic_fetch_add(&prof_total[i], ta_prof_local[i], __ATOMIC_RELAXED);
        ta_prof_local[i] = 0;
    }
}

#include <sys/resource.h>
#ifndef RUSAGE_THREAD
#define RUSAGE_THREAD 1 /* Linux's, hidden without _GNU_SOURCE */
#endif
long ta_prof_switches(void) {
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) == 0 ? ru.ru_nivcsw : -1;
}

void ta_prof_task_end(long switches_before, uint64_t ticks) {
    int preempted = ta_prof_switches() != switches_before;
    uint64_t dropped = 0;
    for (int i = 0; i < TA_PH_COUNT; i++) { /* preempted: the long intervals carry the time slice */
        if (preempted)
            dropped += ta_prof_long[i];
        else
            ta_prof_local[i] += ta_prof_long[i];
        ta_prof_long[i] = 0;
    }
    ta_prof_local[TA_PH_preempted] += (uint64_t)preempted;
    ta_prof_local[TA_PH_task] += ticks > dropped ? ticks - dropped : 0;
    ta_prof_local[TA_PH_task_all] += ticks;
    ta_prof_local[TA_PH_tasks] += 1;
    ta_prof_flush();
}
#endif

/* The profiling build's counters (TSC ticks, or counts for calls/tasks) into out[0..n), cleared;
 * returns how many phases there are, or -1 when the library was built without TA_PROFILE. */
int64_t ta_profile_read(double *out, int64_t n) {
#ifdef TA_PROFILE
    for (int64_t i = 0; i < n && i < TA_PH_COUNT; i++) out[i] = (double)__atomic_exchange_n(&prof_total[i], 0, __ATOMIC_RELAXED);
    return TA_PH_COUNT;
#else
    (void)out, (void)n;
    return -1;
#endif
}

/* ------------------------------------------------------------------------------- scratch, tasks */

int64_t ta_l2_bytes(void) {
    static int64_t bytes;
    int64_t b = __atomic_load_n(&bytes, __ATOMIC_RELAXED);
    if (b == 0) {
#ifdef _SC_LEVEL2_CACHE_SIZE
        b = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        if (b < (256 << 10) || b > (64 << 20)) b = 1 << 20;
        __atomic_store_n(&bytes, b, __ATOMIC_RELAXED);
    }
    return b;
}

static __thread void *tls_buf[TA_SCRATCH_SLOTS];
static __thread size_t tls_cap[TA_SCRATCH_SLOTS];

/* Buffers above this size are released at the end of a call instead of kept for the next one. */
#define TA_SCRATCH_KEEP (8u << 20)

void *ta_scratch(int slot, size_t bytes) {
    if (bytes <= tls_cap[slot]) return tls_buf[slot];
    free(tls_buf[slot]);
    size_t cap = (bytes + 4095) & ~(size_t)4095;
    if (posix_memalign(&tls_buf[slot], 64, cap)) {
        tls_buf[slot] = NULL;
        tls_cap[slot] = 0;
        return NULL;
    }
    tls_cap[slot] = cap;
    return tls_buf[slot];
}

void ta_scratch_trim(void) {
    for (int s = 0; s < TA_SCRATCH_SLOTS; s++)
        if (tls_cap[s] > TA_SCRATCH_KEEP) {
            free(tls_buf[s]);
            tls_buf[s] = NULL;
            tls_cap[s] = 0;
        }
}

static void record_status(int *status, int st) {
    int expected = TA_OK;
    if (st != TA_OK) __atomic_compare_exchange_n(status, &expected, st, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

typedef struct {
    const ta_args *a;
    const void *tasks, *plan;
    size_t task_size;
    ta_task_fn fn;
    int64_t ntasks, next; /* tasks are taken in order from `next` (a dynamic schedule of chunk 1) */
    int status;
} ta_task_team;

static void run_team_tasks(void *ctx, int tid, int nt) {
    ta_task_team *T = (ta_task_team *)ctx;
    (void)tid, (void)nt;
    const ta_fp_mode mode = flush_subnormals();
    for (;;) {
        int64_t t = __atomic_fetch_add(&T->next, 1, __ATOMIC_RELAXED);
        if (t >= T->ntasks || __atomic_load_n(&T->status, __ATOMIC_RELAXED) != TA_OK) break;
        TA_PROF_TASK_T(task, sw);
        record_status(&T->status, T->fn(T->a, T->plan, (const char *)T->tasks + (size_t)t * T->task_size));
        TA_PROF_TASK(task, sw);
    }
    restore_fp_mode(mode);
    ta_scratch_trim();
}

int ta_run_tasks(const ta_args *a, int64_t ntasks, double work, const void *tasks, size_t task_size, ta_task_fn fn,
                 const void *plan) {
    int64_t nt = a->num_threads > 0 ? a->num_threads : 1;
    if (nt > ntasks) nt = ntasks;
    if (work < TA_PARALLEL_MIN_WORK) nt = 1;
    ta_task_team T = {a, tasks, plan, task_size, fn, ntasks, 0, TA_OK};
    TA_PROF_T(region);
    ta_team((int)(nt > 1 ? nt : 1), run_team_tasks, &T);
    /* thread-ticks the region offered: what the tasks did not use is imbalance and fork/join */
    TA_PROF_REGION(region);
#ifdef TA_PROFILE
    if (nt > 1) ta_prof_local[TA_PH_region] *= (uint64_t)nt;
#endif
    TA_PROF_COUNT(calls, 1);
    TA_PROF_FLUSH();
    return T.status;
}

/* ---------------------------------------------------------------------------------- validation */

static int fail(ta_args *a, const char *fmt, ...) {
    if (a->err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf((char *)a->err, TA_ERR_LEN, fmt, ap);
        va_end(ap);
    }
    return TA_EINVAL;
}

/* Cumulative offsets: start at 0, never decrease, end at the token count. Returns the longest. */
static int check_cu(ta_args *a, const char *name, const int32_t *cu, int64_t total, int64_t *longest) {
    if (cu[0] != 0) return fail(a, "%s[0] = %d; expected 0", name, cu[0]);
    *longest = 0;
    for (int64_t b = 0; b < a->B; b++) {
        int64_t len = (int64_t)cu[b + 1] - cu[b];
        if (len < 0) return fail(a, "%s decreases at index %lld (%d -> %d)", name, (long long)b, cu[b], cu[b + 1]);
        if (len > *longest) *longest = len;
    }
    if (cu[a->B] != total)
        return fail(a, "%s[-1] = %d; expected the token count %lld", name, cu[a->B], (long long)total);
    return TA_OK;
}

static int validate(ta_args *a) {
    const int32_t *used = (const int32_t *)a->seqused_k;
    int64_t longest;
    if (a->varlen) {
        if (check_cu(a, "cu_seqlens_q", (const int32_t *)a->cu_q, a->Tq, &longest)) return TA_EINVAL;
        a->Sq = longest;
        if (!a->paged) {
            if (check_cu(a, "cu_seqlens_k", (const int32_t *)a->cu_k, a->Tk, &longest)) return TA_EINVAL;
            a->Sk = longest;
        }
    }
    for (int64_t b = 0; b < a->B; b++) {
        int64_t cap = a->paged    ? a->max_pages * a->page_size
                      : a->varlen ? (int64_t)((const int32_t *)a->cu_k)[b + 1] - ((const int32_t *)a->cu_k)[b]
                                  : a->Sk;
        int64_t k_len = used ? used[b] : cap;
        if (k_len < 0 || k_len > cap)
            return fail(a, "seqused_k[%lld] = %lld; expected 0 <= seqused_k <= %lld keys", (long long)b,
                        (long long)k_len, (long long)cap);
        if (a->paged) { /* every entry, read or not (as the Python validation checks the whole table) */
            const int32_t *bt = (const int32_t *)a->block_table;
            for (int64_t p = 0; p < a->max_pages; p++) {
                int32_t page = bt[b * a->bt_st[0] + p * a->bt_st[1]];
                if (page < 0 || page >= a->num_pages)
                    return fail(a, "block_table[%lld, %lld] = %d; expected a page index in [0, %lld)", (long long)b,
                                (long long)p, page, (long long)a->num_pages);
            }
        }
    }
    return TA_OK;
}

int ta_forward(ta_args *a) {
    int st = validate(a);
    if (st != TA_OK) return st;
    return a->dtype == TA_F64 ? ta_forward_f64(a) : ta_forward_f32(a);
}

int ta_backward(ta_args *a) {
    int st = validate(a);
    if (st != TA_OK) return st;
    return a->dtype == TA_F64 ? ta_backward_f64(a) : ta_backward_f32(a);
}

/* ------------------------------------------------------------------------------------- SIGINT hook */

/* While armed, SIGINT sets *flag (which the kernels poll between tiles) and then runs the handler
 * that was installed before (Python's, which schedules KeyboardInterrupt for when the call returns).
 * Arm and disarm from the main thread, around one call. */
static struct sigaction prev_sigint;
static int32_t *volatile sigint_flag;

static void on_sigint(int sig, siginfo_t *info, void *ctx) {
    int32_t *flag = sigint_flag;
    if (flag) __atomic_store_n(flag, 1, __ATOMIC_RELAXED);
    if (prev_sigint.sa_flags & SA_SIGINFO) {
        if (prev_sigint.sa_sigaction) prev_sigint.sa_sigaction(sig, info, ctx);
    } else if (prev_sigint.sa_handler == SIG_DFL) {
        sigaction(SIGINT, &prev_sigint, NULL);
        raise(sig);
    } else if (prev_sigint.sa_handler != SIG_IGN) {
        prev_sigint.sa_handler(sig);
    }
}

int ta_sigint_arm(int32_t *flag) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigint;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigint_flag = flag;
    return sigaction(SIGINT, &sa, &prev_sigint);
}

int ta_sigint_disarm(void) {
    int st = sigaction(SIGINT, &prev_sigint, NULL);
    sigint_flag = NULL;
    return st;
}
