/* Entry points of the kernels, once per real type, and the task runner they share. */
#ifndef TA_KERNELS_H
#define TA_KERNELS_H

#include <stdlib.h>

#include "common.h"

/* The decode path serves forward calls with at most this many query rows per kv head (Sq * G):
 * below it a transposed tile would leave most of its lanes empty. */
#define TA_DECODE_MAX_ROWS 8

/* Whether a sequence of q_len query rows takes the decode path (each sequence of a ragged call
 * decides for itself, so its bits do not depend on the others); a quantised cache is read only
 * there. */
static inline int ta_decode_takes(const ta_args *a, int64_t q_len) {
    if (a->options & (TA_OPT_KV_QUANT | TA_OPT_FORCE_DECODE)) return 1;
    if (a->options & TA_OPT_FORCE_PREFILL) return 0;
    return q_len * (a->Hq / a->Hkv) <= TA_DECODE_MAX_ROWS;
}

int ta_forward_f32(const ta_args *a);
int ta_forward_f64(const ta_args *a);
/* The sequences that ta_decode_takes; *rest = how many it left to the prefill path. */
int ta_decode_f32(const ta_args *a, int64_t *rest);
int ta_decode_f64(const ta_args *a, int64_t *rest);
int ta_backward_f32(const ta_args *a);
int ta_backward_f64(const ta_args *a);

/* Run fn(a, plan, task) for every task (an array of ntasks records of task_size bytes) on up to
 * a->num_threads OpenMP threads, dynamically scheduled in array order. A task's result depends only
 * on the task, so neither the thread count nor the schedule changes any bit. `work` (multiply-adds)
 * keeps tiny calls on the calling thread. Returns the first nonzero status (cancelled, no memory). */
/* This core's L2 cache in bytes (1 MiB where the system does not say), for sizing query blocks. */
int64_t ta_l2_bytes(void);

typedef int (*ta_task_fn)(const ta_args *a, const void *plan, const void *task);
int ta_run_tasks(const ta_args *a, int64_t ntasks, double work, const void *tasks, size_t task_size, ta_task_fn fn,
                 const void *plan);

/* A team of `nt` threads runs fn(ctx, tid, nt), tid = 0 .. nt-1, the caller being thread 0
 * (threads.c: OpenMP, or a pool of POSIX threads where the compiler has no OpenMP runtime);
 * ta_thread_index() is the calling thread's tid (0 outside a team). */
typedef void (*ta_team_fn)(void *ctx, int tid, int nt);
void ta_team(int nt, ta_team_fn fn, void *ctx);
int ta_thread_index(void);

#endif
