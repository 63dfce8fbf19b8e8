/* The program's streams as the pools know them: a key per stream, and the event dependencies the
 * program makes between streams, for a pool that follows them (cudaMemPoolReuseFollowEventDependencies).
 *
 * Natively, with internal dependencies refused, a free on stream A serves an allocation on stream B
 * once B waited (cuStreamWaitEvent) for an event recorded on A after the free: B's work then runs
 * after it.  The driver hooks report each record and wait here while some device's default pool
 * refuses internal dependencies and follows events (vmm__following); otherwise the hooks cost one
 * load, since the pool's waiting pass covers such frees already (pool.h).  What is kept is bounded
 * and may be forgotten: a forgotten record or wait only means new memory, never a free handed out
 * early.  Frees are numbered (vmm__S.free_seq); a record keeps the number the next free would get,
 * so a free below it was made before the record. */
#include <string.h>

#include "backing/internal.h"

#define FOLLOW_EVENTS 1024u /* direct-mapped by event: the stream and free number of its latest record */
#define FOLLOW_WAITS 256u   /* direct-mapped by (waiter, source): the highest free number waited past */

typedef struct recorded {
    uint64_t event, stream, mark;
} recorded;

typedef struct waited {
    uint64_t waiter, source, mark;
} waited;

static recorded recs[FOLLOW_EVENTS];
static waited waits[FOLLOW_WAITS];
static pthread_mutex_t follow_lock = PTHREAD_MUTEX_INITIALIZER;
int vmm__follow_on;

/* The per-thread default stream is one handle (CU_STREAM_PER_THREAD) naming a stream of each thread,
 * and the pool hands a free out at once on the stream it was freed on: so each thread gets a key of
 * its own for it, odd (no stream handle is; 1 is the legacy stream's) and never given twice.
 * segment.c's stream_wait turns a key back into the handle, which the allocating thread's own call
 * resolves to that thread's stream. */
uint64_t vmm__stream_key(CUstream s)
{
    static _Thread_local uint64_t mine;
    static uint64_t next = 3;
    if (s != CU_STREAM_PER_THREAD) return (uint64_t)(uintptr_t)s;
    if (!mine) mine = __atomic_fetch_add(&next, 2, __ATOMIC_RELAXED);
    return mine;
}

/* The legacy stream has two names: one key for both here. */
static uint64_t same_legacy(uint64_t key) { return key == (uint64_t)(uintptr_t)CU_STREAM_LEGACY ? 0 : key; }
static uint64_t key_of(CUstream s) { return same_legacy(vmm__stream_key(s)); }

static unsigned slot_of(uint64_t x, unsigned n) { return (unsigned)((x * 0x9E3779B97F4A7C15ull) >> 40) % n; }

void vmm__follow_set(int on) { __atomic_store_n(&vmm__follow_on, on, __ATOMIC_RELEASE); }

void vmm__follow_recorded(CUevent e, CUstream s, uint64_t mark)
{
    recorded *r = &recs[slot_of((uint64_t)(uintptr_t)e, FOLLOW_EVENTS)];
    uint64_t key = key_of(s);
    pthread_mutex_lock(&follow_lock);
    *r = (recorded){(uint64_t)(uintptr_t)e, key, mark};
    pthread_mutex_unlock(&follow_lock);
}

void vmm__follow_forget(CUevent e)
{
    recorded *r = &recs[slot_of((uint64_t)(uintptr_t)e, FOLLOW_EVENTS)];
    pthread_mutex_lock(&follow_lock);
    if (r->event == (uint64_t)(uintptr_t)e) memset(r, 0, sizeof *r);
    pthread_mutex_unlock(&follow_lock);
}

void vmm__follow_waited(CUstream s, CUevent e)
{
    const recorded *r = &recs[slot_of((uint64_t)(uintptr_t)e, FOLLOW_EVENTS)];
    uint64_t waiter = key_of(s);
    pthread_mutex_lock(&follow_lock);
    if (r->event == (uint64_t)(uintptr_t)e && r->stream != waiter) {
        waited *w = &waits[slot_of(waiter * 31 + r->stream, FOLLOW_WAITS)];
        if (w->waiter != waiter || w->source != r->stream) *w = (waited){waiter, r->stream, 0};
        if (r->mark > w->mark) w->mark = r->mark;
    }
    pthread_mutex_unlock(&follow_lock);
}

uint64_t vmm__followed(void *ctx, uint64_t waiter, uint64_t source)
{
    (void)ctx;
    if (!__atomic_load_n(&vmm__follow_on, __ATOMIC_RELAXED)) return 0; /* the pools' waiting pass covers it */
    waiter = same_legacy(waiter);
    source = same_legacy(source);
    const waited *w = &waits[slot_of(waiter * 31 + source, FOLLOW_WAITS)];
    pthread_mutex_lock(&follow_lock);
    uint64_t mark = w->waiter == waiter && w->source == source ? w->mark : 0;
    pthread_mutex_unlock(&follow_lock);
    return mark;
}
