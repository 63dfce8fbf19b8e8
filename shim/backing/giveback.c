/* Giving memory back: the give-back thread, which returns segments empty for
 * VMMSHIM_GIVE_BACK_MS (so a program that frees and makes no further call still gives them back),
 * and the release at synchronizations (the default pool's memory beyond its threshold goes then,
 * as natively, and stream-ordered frees a synchronization covers are reached without an event).
 * What may stay is each pool's budget (vmm__retain_of); what goes is the pool's choice. */
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>

#include "backing/internal.h"
#include "core/log.h"
#include "core/thread.h"

/* The budget of each pool: what cudaMalloc freed may stay empty up to VMMSHIM_CACHE_SIZE bytes;
 * the default pool keeps up to its release threshold reserved, as natively. */
static void release_locked(vmm__pool *p, int stream_ordered, uint64_t until)
{
    if (stream_ordered) vmm__pool_release(p, p->retain, 0, until);
    else vmm__pool_release(p, 0, p->retain, until);
}

static int settled(const vmm__pool *p, int stream_ordered)
{
    return !vmm__pool_empty_bytes(p) || (stream_ordered ? p->reserved <= p->retain : vmm__pool_empty_bytes(p) <= p->retain);
}

/* One pass over every pool: what has been empty for the delay goes back (beyond each pool's
 * budget).  Returns when the next segment falls due (UINT64_MAX: none is waiting). */
static uint64_t purge_pass_locked(uint64_t now)
{
    uint64_t next = UINT64_MAX, delay = vmm__S.give_back_ns;
    if (__atomic_load_n(&vmm__S.captures, __ATOMIC_ACQUIRE) > 0) return now + (delay ? delay : 1000000u); /* after the capture */
    for (int i = 0; i < MAX_DEVICES; i++) {
        device_state *d = &vmm__S.dev[i];
        if (!d->pool_ready) continue;
        VMM__FOR_POOLS(d, p, k) {
            if (now >= delay) release_locked(p, k, now - delay);
            uint64_t oldest = vmm__pool_oldest_empty(p);
            if (oldest != UINT64_MAX && !settled(p, k) && oldest + delay < next) next = oldest + delay;
        }
    }
    /* a segment a free in flight still touches is looked at again a little later, never spun on */
    if (next != UINT64_MAX && next < now + 5000000u) next = now + 5000000u;
    return next;
}

static void *purge_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&vmm__S.lock);
    while (!vmm__S.stopping) {
        uint64_t next = purge_pass_locked(vmm__now_ns(NULL));
        if (next == UINT64_MAX) {
            vmm__S.purge_state = 1;
            pthread_cond_wait(&vmm__S.purge_wake, &vmm__S.lock);
        } else {
            vmm__S.purge_state = 2;
            struct timespec t = {.tv_sec = (time_t)(next / 1000000000u), .tv_nsec = (long)(next % 1000000000u)};
            pthread_cond_timedwait(&vmm__S.purge_wake, &vmm__S.lock, &t);
        }
    }
    vmm__S.purge_state = 1;
    pthread_mutex_unlock(&vmm__S.lock);
    return NULL;
}

/* Under vmm__S.lock: a free emptied a segment of p.  With no give-back delay it goes back at once, as
 * natively (unless a free in flight still touches it: then at the next synchronization or pass). */
void vmm__emptied_locked(vmm__pool *p, int stream_ordered)
{
    if (stream_ordered) __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED);
    /* Natively cudaFree's memory is the device's again when it returns, and a neighbour woken by
     * the free (a rollout engine after empty_cache) may allocate it at once: the delay keeps
     * only a little of it, what a program that frees and allocates the same sizes reuses. */
    else if (vmm__pool_empty_bytes(p) > vmm__S.hold_limit) vmm__pool_release_newest(p, vmm__S.hold_limit);
    if (!vmm__S.give_back_ns) {
        release_locked(p, stream_ordered, UINT64_MAX);
        if (settled(p, stream_ordered)) return;
        __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED);
    }
    /* A large free went back whole just above: waking the thread for no deadline would make it
     * contend for the lock with the program's next call (a futex wake and wait per pair). */
    if (!vmm__pool_empty_bytes(p)) return;
    vmm__purge_kick_locked();
}

/* Under vmm__S.lock: a segment became empty, so the give-back thread has a deadline to keep.  Started
 * on the first one, with every signal blocked (the program's handlers never run on it); woken only
 * when it waits with no deadline, so a free costs no system call while one is set. */
void vmm__purge_kick_locked(void)
{
    if (vmm__S.purge_state == 1) {
        pthread_cond_signal(&vmm__S.purge_wake);
        vmm__S.purge_state = 2;
    } else if (vmm__S.purge_state == 0) {
        pthread_t t;
        int rc = vmm__thread_detached(&t, purge_main, NULL);
        if (rc == 0) {
            pthread_setname_np(t, "vmmshim-purge");
            vmm__S.purge_state = 2;
        } else {
            vmm__S.purge_state = -1;
            vmm__log(VMM__LOG_WARNING, "the give-back thread did not start (%s); freed memory goes back when the "
                     "pool next grows or is trimmed", strerror(rc));
        }
    }
}

uint64_t vmm__give_back_now(void)
{
    uint64_t freed = 0;
    if (!vmm__S.ready) return 0;
    pthread_mutex_lock(&vmm__S.lock);
    for (int i = 0; i < MAX_DEVICES; i++) {
        device_state *d = &vmm__S.dev[i];
        if (!d->pool_ready) continue;
        VMM__FOR_POOLS(d, p, k)
            if (k == 0) freed += vmm__pool_release(p, 0, p->retain, UINT64_MAX); /* stream-ordered pools keep their threshold, as natively */
    }
    pthread_mutex_unlock(&vmm__S.lock);
    return freed;
}

/* Natively a synchronization releases the default pool's memory beyond its threshold; with no
 * give-back delay, what cudaMalloc freed goes then too.  The hooks come here only when
 * vmm__sync_watching() said something waits (backing.h). */
uint64_t vmm__free_mark(void) { return __atomic_load_n(&vmm__S.free_seq, __ATOMIC_ACQUIRE) + 1; }

static int legacy_stream(CUstream s) { return s == NULL || s == CU_STREAM_LEGACY; }

void vmm__synchronized(int whole_context, CUstream stream, uint64_t mark)
{
    if (!vmm__S.ready) return;
    int sync_due = __atomic_load_n(&vmm__sync.sync_due, __ATOMIC_ACQUIRE), unrecorded = __atomic_load_n(&vmm__sync.unrecorded_due, __ATOMIC_ACQUIRE);
    if (!sync_due && !unrecorded) return;
    CUcontext ctx = NULL;
    if (unrecorded && (vmm__cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)) unrecorded = 0;
    pthread_mutex_lock(&vmm__S.lock);
    __atomic_store_n(&vmm__sync.sync_due, 0, __ATOMIC_RELAXED);
    int left = 0;
    uint64_t still_unrecorded = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        device_state *d = &vmm__S.dev[i];
        if (!d->pool_ready) continue;
        if (unrecorded) VMM__FOR_POOLS(d, p, k) {
            /* the frees this synchronization covers are reached, with no event recorded at all;
             * the legacy stream has two names */
            vmm__pool_reached_by_sync(p, whole_context, vmm__stream_key(stream), ctx, mark);
            if (!whole_context && legacy_stream(stream))
                vmm__pool_reached_by_sync(p, 0, (uint64_t)(uintptr_t)(stream ? NULL : CU_STREAM_LEGACY), ctx, mark);
            still_unrecorded += p->n_tracked;
        }
        VMM__FOR_POOLS(d, p, k) {
            if (k == 0 && vmm__S.give_back_ns) continue;
            release_locked(p, k, UINT64_MAX);
            left |= !settled(p, k);
        }
    }
    if (left) __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED); /* frees of streams not synchronized yet */
    if (unrecorded && !still_unrecorded) __atomic_store_n(&vmm__sync.unrecorded_due, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&vmm__S.lock);
}
