/* Exports ahead of requests.  A segment's first broker export (cuMemExportToShareableHandle,
 * ~0.6 ms on an H100) made a companion's first take from a fresh owner several times its later
 * ones.  When the program names tensors (vmm_publish, vmm_publish_many: it declares it wants them
 * taken), the hook queues their byte ranges here and wakes the broker thread; once
 * VMMSHIM_PREEXPORT_MS have passed, that thread walks the records still under them and asks the
 * shim's own export function for each of their handles, one a turn between its requests, so the
 * segment's fd is kept (export.c: broker_fd) before anyone asks.  The allocation path does no
 * work for this, a process that names nothing exports nothing, and a range freed before its turn
 * is found gone in the registry and skipped.  At most VMMSHIM_PREEXPORT_FDS kept fds, and only as
 * many as RLIMIT_NOFILE leaves numbers above 1023 for. */
#include "backing/preexport.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <uthash.h>

#include "backing/backing.h"
#include "broker/broker.h"
#include "broker/protocol.h"
#include "core/log.h"
#include "core/options.h"
#include "registry/registry.h"

#define FD_MARGIN 64 /* fd numbers above 1023 left for everything else the process keeps there */

typedef struct span {
    uint64_t addr, len;
} span;

typedef struct done_rec { /* a record visited this pass: many tensors lie in one allocation */
    struct {
        uint64_t slot, generation;
    } key;
    UT_hash_handle hh;
} done_rec;

static struct {
    pthread_mutex_t lock;
    span *q; /* ranges to walk, [head, n) */
    size_t n, cap, head;
    uint64_t due_ns; /* no export before this */
    uint64_t at, end; /* the range being walked */
    int walking;
    int have_rec; /* the record whose handles go next */
    uint64_t slot, generation;
    uint8_t id[16];
    uint32_t next_handle, n_handles;
    done_rec *done;
    int registered, warned;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void reset_locked(void)
{
    done_rec *d, *tmp;
    HASH_ITER(hh, P.done, d, tmp) {
        HASH_DEL(P.done, d);
        free(d);
    }
    free(P.q);
    P.q = NULL;
    P.n = P.cap = P.head = 0;
    P.walking = P.have_rec = 0;
}

static void forget_after_fork(void);

/* A fork child forgets the queue (its ranges name the parent's memory): the handler is registered
 * with the broker's idle hook, once a process, and a child keeps it registered. */
static void register_atfork(void) { pthread_atfork(NULL, NULL, forget_after_fork); }

void vmm__preexport_want(const uint64_t *addr, const uint64_t *len, size_t n)
{
    long long ms = vmm__opt_int(VMM__OPT_PREEXPORT_MS);
    if (ms < 0 || n == 0 || vmm__opt_enum(VMM__OPT_EXPORT) == VMM__EXPORT_PIDFD) return; /* pidfd: all exported */
    pthread_mutex_lock(&P.lock);
    if (!P.registered) {
        static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
        pthread_once(&atfork_once, register_atfork);
        vmm__broker_set_idle(vmm__preexport_step);
        P.registered = 1;
    }
    if (P.n - P.head + n > P.cap) {
        size_t live = P.n - P.head, cap = P.cap ? P.cap : 256;
        while (cap < live + n) cap *= 2;
        span *q = malloc(cap * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&P.lock);
            return; /* nothing ahead of time: each segment is exported at its first request */
        }
        if (live) memcpy(q, P.q + P.head, live * sizeof *q);
        free(P.q);
        P.q = q;
        P.cap = cap;
        P.n = live;
        P.head = 0;
    }
    int idle = P.n == P.head && !P.walking && !P.have_rec;
    for (size_t i = 0; i < n; i++)
        if (len[i]) P.q[P.n++] = (span){addr[i], len[i]};
    /* a program naming its tensors every step keeps the first deadline rather than moving it on */
    if (idle) P.due_ns = now_ns() + (uint64_t)ms * 1000000ull;
    pthread_mutex_unlock(&P.lock);
    vmm__broker_wake();
}

/* The fds this process may keep above 1023 for exports ahead of requests. */
static unsigned long fd_room(void)
{
    unsigned long limit = (unsigned long)vmm__opt_int(VMM__OPT_PREEXPORT_FDS);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        unsigned long room = rl.rlim_cur > 1024 + FD_MARGIN ? (unsigned long)rl.rlim_cur - 1024 - FD_MARGIN : 0;
        if (room < limit) limit = room;
    }
    return limit;
}

/* Under P.lock: the next handle to ask for (1), or 0 when the queue is done. */
static int next_locked(vmm__reg *r)
{
    for (;;) {
        if (P.have_rec && P.next_handle < P.n_handles) return 1;
        P.have_rec = 0;
        if (!P.walking) {
            if (P.head == P.n) return 0;
            P.at = P.q[P.head].addr;
            P.end = P.q[P.head].addr + P.q[P.head].len;
            P.head++;
            P.walking = 1;
        }
        vmm_reg_alloc rec;
        uint64_t slot;
        if (P.at >= P.end || vmm__reg_find(r, r->pid, P.at, &rec, &slot) != 0 || rec.address + rec.extent <= P.at) {
            P.walking = 0; /* done, or freed since it was named: nothing under it is wanted now */
            continue;
        }
        P.at = rec.address + rec.extent;
        if (!(rec.handle_kinds & VMM_HANDLE_BROKER) || (rec.flags & VMM_REG_F_NOT_EXPORTABLE)) continue;
        done_rec *d;
        struct {
            uint64_t slot, generation;
        } key = {slot, rec.generation};
        HASH_FIND(hh, P.done, &key, sizeof key, d);
        if (d) continue;
        if ((d = calloc(1, sizeof *d)) != NULL) {
            d->key.slot = slot;
            d->key.generation = rec.generation;
            HASH_ADD(hh, P.done, key, sizeof d->key, d);
        }
        P.have_rec = 1;
        P.slot = slot;
        P.generation = rec.generation;
        memcpy(P.id, rec.alloc_id, 16);
        P.next_handle = 0;
        P.n_handles = rec.n_handles > 1 ? rec.n_handles : 1;
    }
}

int vmm__preexport_step(vmm__broker_export_fn export_fn)
{
    vmm__reg *r = vmm__registry();
    pthread_mutex_lock(&P.lock);
    if (!r || (P.head == P.n && !P.walking && !P.have_rec)) {
        pthread_mutex_unlock(&P.lock);
        return -1;
    }
    uint64_t now = now_ns();
    if (now < P.due_ns) {
        int ms = (int)((P.due_ns - now + 999999) / 1000000);
        pthread_mutex_unlock(&P.lock);
        return ms;
    }
    unsigned long room = fd_room();
    if (vmm__backing_kept_fds() >= room) {
        int warn = !P.warned;
        P.warned = 1;
        reset_locked();
        pthread_mutex_unlock(&P.lock);
        struct rlimit rl;
        if (warn && room == 0 && vmm__opt_int(VMM__OPT_PREEXPORT_FDS) > 0 && getrlimit(RLIMIT_NOFILE, &rl) == 0)
            vmm__log(VMM__LOG_WARNING, "no pre-export: RLIMIT_NOFILE %llu leaves no fd numbers above 1023 to keep "
                     "exports in (raise it, ulimit -n); each segment is exported at each request",
                     (unsigned long long)rl.rlim_cur);
        else if (warn && room)
            vmm__log(VMM__LOG_WARNING, "pre-export stopped at %lu kept fds (VMMSHIM_PREEXPORT_FDS, RLIMIT_NOFILE); "
                     "further segments are exported at their first request", room);
        return -1;
    }
    if (!next_locked(r)) {
        reset_locked();
        pthread_mutex_unlock(&P.lock);
        return -1;
    }
    uint64_t slot = P.slot, generation = P.generation;
    uint8_t id[16];
    memcpy(id, P.id, 16);
    uint32_t first = P.next_handle++;
    pthread_mutex_unlock(&P.lock);

    /* the shim's own export: keeps the segment's fd (broker_fd) and hands a duplicate, closed here */
    int fds[1] = {-1};
    uint64_t sizes[1], keys[1] = {VMM_BROKER_NO_KEY};
    uint32_t n_here = 0, n_total = 0, device = 0;
    int rc = export_fn(slot, generation, id, first, 1, fds, sizes, keys, &n_here, &n_total, &device);
    for (uint32_t k = 0; k < n_here && k < 1; k++)
        if (fds[k] >= 0) close(fds[k]);
    if (rc != 0) {
        pthread_mutex_lock(&P.lock);
        if (P.have_rec && P.slot == slot && P.generation == generation) P.have_rec = 0; /* gone meanwhile */
        pthread_mutex_unlock(&P.lock);
    }
    return 0;
}

static void forget_after_fork(void)
{
    /* the parent's ranges name its memory, not the child's; the child's broker registers anew */
    pthread_mutex_init(&P.lock, NULL);
    P.q = NULL; /* the parent's queue stays the parent's (leaked in the child, as the backing's tables) */
    P.done = NULL;
    P.n = P.cap = P.head = 0;
    P.walking = P.have_rec = 0;
    P.registered = 0;
    P.warned = 0;
}
