/* vmmctl keep's keeper proper: what is held for each kept process, the watcher's pass over the
 * registry, and what happens at the process's end.  Split from keep.c (the command: claiming,
 * --all, the daemon, release) because this is the part that runs for as long as the keeper
 * does, one thread per kept process, and needs nothing of how processes were chosen.
 *
 * What is held is fds: each chunk's handles as the owner's broker hands them to any companion
 * (vmm_import_fds), which keep the memory alive until closed and need no CUDA context here, so a
 * keeper starts on a full device and costs the device nothing.  One thread per kept process
 * (a watcher) reads the registry every tick, or at once when the owner rings: it drops a chunk
 * as soon as no live allocation of the owner is in it (so that what the owner gives back reaches
 * the device when the owner gives it back), and takes a chunk once an allocation has lived in it
 * for the settle time (a chunk's first export holds the owner's allocator lock for ~0.6 ms on an
 * H100, so short-lived churn is not worth holding).  When the owner dies, the watcher keeps what
 * it holds, marks those records kept, points the owner's broker_path at this keeper's broker
 * socket (shim/broker/broker.c, serving from the held fds), and writes a dump if asked. */
#include "vmmshim.h"

#include "broker/broker.h"
#include "core/options.h"
#include "registry/keep.h"
#include "registry/registry.h"

#include "format.h"
#include "keeper.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uthash.h>
#include <utlist.h>

#define TICK_MS 10u /* a watcher's pass, at the latest */

/* ------------------------------------------------------------------------------------------ */
/* What is held                                                                                */

/* A chunk of an owner, named as the client library names imported chunks. */
typedef struct ckey {
    uint64_t id;               /* chunk_id; 0: the record is a chunk of its own, named by slot */
    uint64_t slot, generation; /* only when id is 0 */
    uint64_t mapped_size;
    uint32_t n_handles, multi;
} ckey;

typedef struct chunk {
    ckey key;
    uint32_t n, device;
    int *fds;
    uint64_t *sizes, bytes;
    uint64_t base; /* where its handles lie in the owner: what two chunks share is counted once */
    unsigned refs; /* held records in it */
    UT_hash_handle hh;
} chunk;

typedef struct held {
    uint64_t slot; /* key of g_slots: the broker finds records by slot */
    uint64_t generation, requested, pass;
    uint8_t id[16];
    struct owner *o;
    chunk *c;
    UT_hash_handle hh;
    struct held *prev, *next; /* the owner's list */
} held;

/* A chunk with a live allocation in it, not held yet: since when. */
typedef struct pending {
    ckey key;
    uint64_t first_ns, pass;
    vmm_alloc_info rep; /* an allocation in it, to ask the broker for */
    bool warned;
    UT_hash_handle hh;
} pending;

vmm__ctl_keeper vmm__ctl_kp = {.settle_ms = SETTLE_MS_DEFAULT};
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* g_slots, every owner's chunks and held records */
static held *g_slots;
static pthread_mutex_t g_out = PTHREAD_MUTEX_INITIALIZER; /* one event line at a time */

/* keeper.h says what an event line is */

void vmm__ctl_keep_event(const char *fmt, ...)
{
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    for (char *p = msg; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    struct tm tm;
    localtime_r(&t.tv_sec, &tm);
    pthread_mutex_lock(&g_out);
    printf("%02d:%02d:%02d.%03ld keep: %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec, t.tv_nsec / 1000000, msg);
    fflush(stdout);
    pthread_mutex_unlock(&g_out);
}

static ckey key_of(const vmm_alloc_info *a)
{
    ckey k;
    memset(&k, 0, sizeof k);
    k.id = a->chunk_id;
    if (!k.id) {
        k.slot = a->slot;
        k.generation = a->generation;
    }
    k.mapped_size = a->mapped_size;
    k.n_handles = a->n_handles;
    k.multi = !!(a->flags & VMM_ALLOC_MULTI_HANDLE);
    return k;
}

/* g_lock held. */
static void chunk_unref(owner *o, chunk *c)
{
    if (--c->refs) return;
    HASH_DEL(o->chunks, c);
    for (uint32_t i = 0; i < c->n; i++) close(c->fds[i]);
    o->n_chunks--;
    free(c->fds);
    free(c->sizes);
    free(c);
}

/* g_lock held. */
static void held_drop(owner *o, held *h)
{
    HASH_DEL(g_slots, h);
    DL_DELETE(o->recs, h);
    o->n_held--;
    chunk_unref(o, h->c);
    free(h);
}

/* g_lock held.  false when out of memory. */
static bool held_add(owner *o, chunk *c, const vmm_alloc_info *a)
{
    held *h = calloc(1, sizeof *h);
    if (!h) return false;
    h->slot = a->slot;
    h->generation = a->generation;
    h->requested = a->requested_size;
    memcpy(h->id, a->alloc_id, sizeof h->id);
    h->o = o;
    h->c = c;
    h->pass = o->pass;
    c->refs++;
    HASH_ADD(hh, g_slots, slot, sizeof h->slot, h);
    DL_APPEND(o->recs, h);
    o->n_held++;
    return true;
}

typedef struct span {
    uint64_t lo, hi;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* The device memory held: the union of the chunks' places in the owner.  Two MULTI-HANDLE
 * records may share a handle (each is a chunk here, with its own fds of it), and a sum would
 * count that handle twice, above what NVML shows held.  Only the watcher changes o->chunks. */
static uint64_t held_bytes(const owner *o)
{
    unsigned n = HASH_COUNT(o->chunks), k = 0;
    span *v = n ? malloc(n * sizeof *v) : NULL;
    uint64_t sum = 0, total = 0, end = 0;
    for (const chunk *c = o->chunks; c; c = c->hh.next) {
        sum += c->bytes;
        if (v) v[k++] = (span){c->base, c->base + c->bytes};
    }
    if (!v) return sum; /* out of memory: an upper bound */
    qsort(v, k, sizeof *v, span_cmp);
    for (unsigned i = 0; i < k; i++) {
        uint64_t lo = v[i].lo > end ? v[i].lo : end;
        if (v[i].hi > lo) total += v[i].hi - lo;
        if (v[i].hi > end) end = v[i].hi;
    }
    free(v);
    return total;
}

/* The keep file's counts, now; the bytes held. */
static uint64_t publish_counts(owner *o)
{
    uint64_t bytes = held_bytes(o);
    __atomic_store_n(&o->k.f->held_allocs, o->n_held, __ATOMIC_RELAXED);
    __atomic_store_n(&o->k.f->held_bytes, bytes, __ATOMIC_RELAXED);
    return bytes;
}

/* The broker's export function: fds of a held record's chunk, for the processes that import a
 * kept owner's memory (its broker_path names this keeper's socket).  No keys: a record's chunk
 * keeps fds of its own, and nothing here tells two records' shared segment apart. */
int vmm__ctl_keep_export(uint64_t slot, uint64_t generation, const uint8_t id[16], uint32_t first, uint32_t max,
                       int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total,
                       uint32_t *device)
{
    (void)keys;
    *n_here = *n_total = 0;
    int rc = 0;
    pthread_mutex_lock(&g_lock);
    held *h = NULL;
    HASH_FIND(hh, g_slots, &slot, sizeof slot, h);
    if (!h)
        rc = -ENOENT;
    else if (h->generation != generation || memcmp(h->id, id, 16) != 0)
        rc = -ESTALE;
    else {
        chunk *c = h->c;
        *n_total = c->n;
        *device = c->device;
        if (first >= c->n) rc = -ERANGE;
        for (uint32_t i = first; rc == 0 && i < c->n && *n_here < max; i++) {
            int fd = fcntl(c->fds[i], F_DUPFD_CLOEXEC, 0);
            if (fd < 0) rc = -errno;
            else {
                fds[*n_here] = fd;
                sizes[(*n_here)++] = c->sizes[i];
            }
        }
        if (rc)
            while (*n_here) close(fds[--*n_here]);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* A watcher's pass                                                                            */

typedef struct cur_set {
    const owner *o;
    vmm_alloc_info *a;
    size_t n, cap;
    bool nomem;
} cur_set;

static int collect(void *ctx, const vmm_alloc_info *a)
{
    cur_set *s = ctx;
    if (a->pid != s->o->pid || a->owner_start_time != s->o->start_time) return 0;
    if ((a->flags & VMM_ALLOC_NOT_EXPORTABLE) || !(a->handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD))) return 0;
    if (vmm__ctl_kp.tag && strcmp(a->tag, vmm__ctl_kp.tag) != 0) return 0;
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        vmm_alloc_info *m = realloc(s->a, cap * sizeof *m);
        if (!m) {
            s->nomem = true;
            return 1;
        }
        s->a = m;
        s->cap = cap;
    }
    s->a[s->n++] = *a;
    return 0;
}

/* The owner's live allocations now, or false (out of memory: nothing changes this pass). */
static bool read_current(owner *o, cur_set *s)
{
    memset(s, 0, sizeof *s);
    s->o = o;
    vmm_foreach_alloc(vmm__ctl_kp.reg, collect, s);
    if (s->nomem) {
        free(s->a);
        return false;
    }
    return true;
}

/* Hold what is current, as far as its chunk is held; drop what is no longer current (g_lock
 * held).  Records whose chunk is not held go to pending when `pend`. */
static void settle_locked(owner *o, const cur_set *s, bool pend, uint64_t now)
{
    o->pass++;
    for (size_t i = 0; i < s->n; i++) {
        const vmm_alloc_info *a = &s->a[i];
        /* its owner gave the memory back (vmm_pause): holding it would keep it from the device;
         * at resume the record names a new chunk, taken as any new one */
        if (a->flags & VMM_ALLOC_PAUSED) continue;
        held *h = NULL;
        HASH_FIND(hh, g_slots, &a->slot, sizeof a->slot, h);
        if (h && h->o == o && h->generation == a->generation) {
            h->pass = o->pass;
            continue;
        }
        if (h && h->o != o) continue; /* another owner's, freed: its own watcher drops it first */
        if (h) held_drop(o, h);       /* its slot holds another allocation now */
        ckey k = key_of(a);
        chunk *c = NULL;
        HASH_FIND(hh, o->chunks, &k, sizeof k, c);
        if (c) {
            (void)held_add(o, c, a);
            continue;
        }
        if (!pend) continue;
        pending *p = NULL;
        HASH_FIND(hh, o->pend, &k, sizeof k, p);
        if (!p && (p = calloc(1, sizeof *p)) != NULL) {
            p->key = k;
            p->first_ns = now;
            HASH_ADD(hh, o->pend, key, sizeof p->key, p);
        }
        if (p) {
            p->pass = o->pass;
            p->rep = *a;
        }
    }
    held *h, *tmp;
    DL_FOREACH_SAFE(o->recs, h, tmp)
    if (h->pass != o->pass) held_drop(o, h);
    pending *p, *ptmp;
    HASH_ITER(hh, o->pend, p, ptmp)
    if (p->pass != o->pass) {
        HASH_DEL(o->pend, p);
        free(p);
    }
}

/* Take the chunks that settled (all of them, `all`: the owner is exiting with a failure): their
 * fds from the owner's broker (outside g_lock). */
static void take_settled(owner *o, uint64_t now, bool all)
{
    pending *p, *tmp;
    HASH_ITER(hh, o->pend, p, tmp)
    {
        if (!all && now - p->first_ns < (uint64_t)vmm__ctl_kp.settle_ms * 1000000u) continue;
        uint32_t want = p->key.multi ? p->key.n_handles : 1, n = 0;
        int *fds = calloc(want ? want : 1, sizeof *fds);
        uint64_t *sizes = calloc(want ? want : 1, sizeof *sizes);
        chunk *c = calloc(1, sizeof *c);
        vmm_status st = fds && sizes && c ? vmm_import_fds(vmm__ctl_kp.reg, &p->rep, fds, sizes, want, &n) : VMM_ERR_NOMEM;
        if (st != VMM_OK) {
            free(fds);
            free(sizes);
            free(c);
            if (st == VMM_ERR_STALE || st == VMM_ERR_OWNER_DEAD) {
                HASH_DEL(o->pend, p); /* freed meanwhile, or the owner is going: the next pass says */
                free(p);
            } else if (!p->warned) {
                p->warned = true;
                vmm__ctl_keep_event("pid %u: cannot hold its allocation at 0x%llx: %s (tried again each pass)", o->pid,
                      (unsigned long long)p->rep.address, *vmm_last_error() ? vmm_last_error() : vmm_strerror(st));
            }
            continue;
        }
        c->key = p->key;
        c->n = n;
        c->fds = fds;
        c->sizes = sizes;
        c->device = p->rep.device;
        c->base = p->rep.address - p->rep.chunk_offset;
        for (uint32_t i = 0; i < n; i++) c->bytes += sizes[i];
        pthread_mutex_lock(&g_lock);
        HASH_ADD(hh, o->chunks, key, sizeof c->key, c);
        o->n_chunks++;
        pthread_mutex_unlock(&g_lock);
        HASH_DEL(o->pend, p);
        free(p);
    }
}

/* One pass while the owner lives: drop first and answer the bell, then take what settled. */
static void pass_alive(owner *o, uint32_t bell)
{
    cur_set s;
    if (!read_current(o, &s)) {
        vmm__keep_beat(&o->k); /* not a full pass: done stays */
        return;
    }
    unsigned before_held = o->n_held, before_chunks = o->n_chunks;
    uint64_t now = mono_ns();
    pthread_mutex_lock(&g_lock);
    settle_locked(o, &s, true, now);
    pthread_mutex_unlock(&g_lock);
    /* an owner exiting with a failure waits for this pass to take everything: done comes after */
    bool exiting = __atomic_load_n(&o->k.f->exit_seen, __ATOMIC_ACQUIRE) && o->k.f->exit_status != 0;
    if (!exiting) vmm__keep_done(&o->k, bell);
    if (o->pend) {
        take_settled(o, now, exiting);
        pthread_mutex_lock(&g_lock);
        settle_locked(o, &s, true, now); /* the allocations in chunks just taken */
        pthread_mutex_unlock(&g_lock);
    }
    free(s.a);
    uint64_t bytes = publish_counts(o);
    if (exiting) vmm__keep_done(&o->k, bell);
    if (o->n_held != before_held || o->n_chunks != before_chunks) {
        hbuf h;
        vmm__ctl_keep_event("pid %u: holding %u allocation%s in %u chunk%s, %s", o->pid, o->n_held, o->n_held == 1 ? "" : "s",
              o->n_chunks, o->n_chunks == 1 ? "" : "s", vmm__ctl_human(bytes, &h));
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The owner's end                                                                             */

static bool owner_gone(const owner *o)
{
    if (__atomic_load_n(&o->end_known, __ATOMIC_ACQUIRE)) return true;
    if (o->pidfd >= 0) {
        struct pollfd p = {.fd = o->pidfd, .events = POLLIN};
        return poll(&p, 1, 0) > 0; /* a pidfd turns readable when its process exits */
    }
    return vmm__reg_liveness(o->pid, o->start_time, o->pidns) == VMM__DEAD;
}

/* How the owner ended: what it gave exit() (the shim wrote it), else what its zombie says
 * (/proc/<pid>/stat field 52, readable until its parent reaps it), else unknown. */
static void how_ended(owner *o, uint32_t *kind, int32_t *value)
{
    if (__atomic_load_n(&o->k.f->exit_seen, __ATOMIC_ACQUIRE)) {
        *kind = VMM_KEEP_END_EXIT;
        *value = o->k.f->exit_status & 0xff;
        return;
    }
    *kind = VMM_KEEP_END_UNKNOWN;
    *value = 0;
    char path[64], buf[2048];
    snprintf(path, sizeof path, "/proc/%u/stat", o->pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
    if (!p || p[1] != ' ' || p[2] != 'Z') return;
    unsigned long long start = 0;
    int field = 2;
    long long ws = -1;
    for (char *t = p + 1; *t && field < 52; t++)
        if (*t == ' ') {
            field++;
            if (field == 22) start = strtoull(t + 1, NULL, 10);
            if (field == 52) ws = strtoll(t + 1, NULL, 10);
        }
    if (start != o->start_time || ws < 0) return;
    int w = (int)ws;
    if (WIFSIGNALED(w)) {
        *kind = VMM_KEEP_END_SIGNAL;
        *value = WTERMSIG(w);
    } else if (WIFEXITED(w)) {
        *kind = VMM_KEEP_END_EXIT;
        *value = WEXITSTATUS(w);
    }
}

/* --on-exit dump DIR: `vmmctl dump PID -o DIR/PID` as a process of its own, whose CUDA context
 * goes with it (the keeper itself never starts CUDA). */
static void run_dump(owner *o)
{
    char out[PATH_MAX], self[PATH_MAX], pid[16], reg[sizeof(((vmm_registry_info *)0)->name)];
    vmm_registry_info info;
    if (vmm_registry_describe(vmm__ctl_kp.reg, &info) != VMM_OK) return;
    snprintf(reg, sizeof reg, "%s", info.name);
    snprintf(pid, sizeof pid, "%u", o->pid);
    if (snprintf(out, sizeof out, "%s/%u", vmm__ctl_kp.dump_dir, o->pid) >= (int)sizeof out) return;
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return;
    self[n] = 0;
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    if (child == 0) {
        sigset_t none;
        sigemptyset(&none);
        pthread_sigmask(SIG_SETMASK, &none, NULL);
        char *argv[] = {self, "--registry", reg, "dump", pid, "-o", out, NULL};
        execv(self, argv);
        _exit(127);
    }
    if (child < 0) {
        vmm__ctl_keep_event("pid %u: cannot start the dump: %s", o->pid, strerror(errno));
        return;
    }
    int st = 0;
    while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) vmm__ctl_keep_event("pid %u: dump written to %s", o->pid, out);
    else vmm__ctl_keep_event("pid %u: the dump to %s failed (vmmctl dump status %d)", o->pid, out,
               WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
}

/* The owner has died: keep what is held, and serve it. */
static void on_death(owner *o)
{
    uint32_t kind;
    int32_t value;
    if (__atomic_load_n(&o->end_known, __ATOMIC_ACQUIRE)) {
        kind = o->end_kind;
        value = o->end_value;
    } else {
        how_ended(o, &kind, &value);
    }
    char how[80];
    vmm__ctl_end_text((int)kind, value, how, sizeof how);
    cur_set s;
    bool read = read_current(o, &s);
    pthread_mutex_lock(&g_lock);
    if (read) settle_locked(o, &s, false, mono_ns()); /* what it freed before it died goes */
    pthread_mutex_unlock(&g_lock);
    free(read ? s.a : NULL);
    pending *p, *tmp;
    HASH_ITER(hh, o->pend, p, tmp)
    {
        HASH_DEL(o->pend, p);
        free(p);
    }
    vmm_keep_file *f = o->k.f;
    f->end_kind = kind;
    f->end_value = value;
    f->ended_ns = vmm__ctl_now_ns();
    if (o->n_held == 0) {
        vmm__ctl_keep_event("pid %u %s: nothing of it was held", o->pid, how);
        return;
    }
    /* the socket first: a reader that finds a record kept connects to broker_path */
    if (vmm__keep_take_broker(&vmm__ctl_kp.wreg, &o->k, vmm__ctl_kp.sock) != 0) {
        vmm__ctl_keep_event("pid %u %s: its registry slot was taken meanwhile; letting go", o->pid, how);
        pthread_mutex_lock(&g_lock);
        while (o->recs) held_drop(o, o->recs);
        pthread_mutex_unlock(&g_lock);
        return;
    }
    pthread_mutex_lock(&g_lock);
    held *h, *htmp;
    DL_FOREACH_SAFE(o->recs, h, htmp)
    if (vmm__keep_mark(&vmm__ctl_kp.wreg, &o->k, h->slot, h->generation) != 0) held_drop(o, h);
    pthread_mutex_unlock(&g_lock);
    uint64_t bytes = publish_counts(o);
    __atomic_store_n(&f->state, VMM_KEEP_KEPT, __ATOMIC_RELEASE);
    hbuf hb;
    vmm__ctl_keep_event("pid %u %s: keeping %u allocation%s in %u chunk%s, %s; served at %s", o->pid, how, o->n_held,
          o->n_held == 1 ? "" : "s", o->n_chunks, o->n_chunks == 1 ? "" : "s", vmm__ctl_human(bytes, &hb), vmm__ctl_kp.sock);
    bool normal = kind == VMM_KEEP_END_EXIT && value == 0;
    if (vmm__ctl_kp.dump_dir && !normal) run_dump(o);
}

/* ------------------------------------------------------------------------------------------ */
/* The watcher                                                                                 */

static void *death_main(void *arg)
{
    owner *o = arg;
    while (!__atomic_load_n(&o->stopping, __ATOMIC_ACQUIRE)) {
        struct pollfd p = {.fd = o->pidfd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0) continue;
        how_ended(o, &o->end_kind, &o->end_value);
        __atomic_store_n(&o->end_known, 1, __ATOMIC_RELEASE);
        vmm__keep_nudge(&o->k); /* the watcher's wait ends now */
        break;
    }
    return NULL;
}

static void release_owner(owner *o, const char *why)
{
    if (o->has_death_th) {
        __atomic_store_n(&o->stopping, 1, __ATOMIC_RELEASE);
        pthread_join(o->death_th, NULL);
        o->has_death_th = false;
    }
    unsigned n = o->n_held;
    uint64_t bytes = held_bytes(o);
    pthread_mutex_lock(&g_lock);
    while (o->recs) held_drop(o, o->recs);
    pthread_mutex_unlock(&g_lock);
    pending *p, *tmp;
    HASH_ITER(hh, o->pend, p, tmp)
    {
        HASH_DEL(o->pend, p);
        free(p);
    }
    vmm__keep_end(&vmm__ctl_kp.wreg, &o->k);
    if (o->pidfd >= 0) close(o->pidfd);
    o->pidfd = -1;
    hbuf h;
    vmm__ctl_keep_event("pid %u: released (%s): %u allocation%s, %s let go", o->pid, why, n, n == 1 ? "" : "s",
          vmm__ctl_human(bytes, &h));
}

static void *watch_main(void *arg)
{
    owner *o = arg;
    const vmm_reg_header *hdr = vmm__ctl_kp.wreg.hdr;
    uint32_t seen = vmm__keep_wait(&o->k, 0, 0);
    uint64_t pubs = 0, rets = 0;
    bool first = true;
    const char *why = "the keeper stops";
    for (;;) {
        uint32_t bell = vmm__keep_wait(&o->k, seen, TICK_MS);
        bool rung = bell != seen;
        seen = bell;
        if (__atomic_load_n(&vmm__ctl_kp.stop, __ATOMIC_ACQUIRE)) break;
        if (__atomic_load_n(&o->k.f->release, __ATOMIC_ACQUIRE)) {
            why = "vmmctl release";
            break;
        }
        if (!o->dead && owner_gone(o)) {
            o->dead = true;
            on_death(o);
            if (o->n_held == 0) {
                why = "nothing to keep";
                break;
            }
        }
        if (o->dead) {
            vmm__keep_done(&o->k, bell); /* the heartbeat */
            continue;
        }
        uint64_t p = __atomic_load_n(&hdr->stat_publishes, __ATOMIC_ACQUIRE);
        uint64_t r = __atomic_load_n(&hdr->stat_retracts, __ATOMIC_ACQUIRE);
        if (first || rung || p != pubs || r != rets || o->pend) {
            first = false;
            pubs = p;
            rets = r;
            pass_alive(o, bell);
        } else {
            vmm__keep_done(&o->k, bell);
        }
    }
    release_owner(o, why);
    __atomic_store_n(&o->done, true, __ATOMIC_RELEASE);
    return NULL;
}


bool vmm__ctl_keep_start(owner *o)
{
    o->has_death_th = o->pidfd >= 0 && pthread_create(&o->death_th, NULL, death_main, o) == 0;
    if (pthread_create(&o->th, NULL, watch_main, o) != 0) {
        if (o->has_death_th) {
            __atomic_store_n(&o->stopping, 1, __ATOMIC_RELEASE);
            pthread_join(o->death_th, NULL);
        }
        return false;
    }
    return true;
}
