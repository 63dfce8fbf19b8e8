/* What this process keeps between imports: an entry per owner (its kept broker connection and
 * pidfd), the table of mapped chunks that every vmm_import and vmm_import_many of the process
 * shares, and the reaper thread that ends both once nobody needs them.  They live in one file
 * because they are one state under one lock: the reaper sweeps chunks and owners together, and
 * taking an owner or dropping a chunk is what wakes it.  Calls down into owners.c, driver.c and
 * records.c only; the imports call in here. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "registry/registry.h"

#include "import/internal.h"
#include "core/thread.h"

#define OWNER_IDLE_NS (30ull * 1000000000u) /* under the broker's 60 s, so it never closes a kept one first */

/* Lookups and counts are under vmm__chunks_lock; driver and broker calls never are, so a slow owner
 * stalls only the imports that wait for it. */
static owner_ref *owners;
pthread_mutex_t vmm__chunks_lock = PTHREAD_MUTEX_INITIALIZER;
static bool keep_nothing; /* vmm__import_keep_nothing */
static void reaper_wake_locked(void);

/* Lock held. */
static owner_ref *owner_find_locked(const vmm_alloc_info *a)
{
    for (owner_ref *o = owners; o; o = o->next)
        if (o->pid == a->pid && o->start_time == a->owner_start_time && o->pidns == a->owner_pidns) return o;
    return NULL;
}

/* The owner's entry, made when new, marked busy until vmm__owner_put. */
vmm_status vmm__owner_get(const vmm_alloc_info *a, owner_ref **out)
{
    pthread_mutex_lock(&vmm__chunks_lock);
    owner_ref *o = owner_find_locked(a);
    if (o) o->busy++;
    pthread_mutex_unlock(&vmm__chunks_lock);
    if (o) {
        *out = o;
        return VMM_OK;
    }
    owner_ref *fresh = calloc(1, sizeof *fresh);
    if (!fresh) return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    fresh->pid = a->pid;
    fresh->start_time = a->owner_start_time;
    fresh->pidns = a->owner_pidns;
    fresh->pidfd = vmm__owner_pidfd(a);
    fresh->sock = -1;
    fresh->rel_sock = -1;
    pthread_mutex_init(&fresh->io, NULL);
    pthread_mutex_init(&fresh->rel_io, NULL);
    fresh->busy = 1;
    pthread_mutex_lock(&vmm__chunks_lock);
    if ((o = owner_find_locked(a)) != NULL) {
        o->busy++;
    } else {
        fresh->next = owners;
        owners = o = fresh;
        fresh = NULL;
        reaper_wake_locked();
    }
    pthread_mutex_unlock(&vmm__chunks_lock);
    if (fresh) vmm__owner_free(fresh);
    *out = o;
    return VMM_OK;
}

void vmm__owner_put(owner_ref *o)
{
    pthread_mutex_lock(&vmm__chunks_lock);
    o->busy--;
    o->last_used_ns = vmm__now_ns();
    bool drop = keep_nothing && o->busy == 0 && o->chunks == 0;
    if (drop)
        for (owner_ref **pp = &owners; *pp; pp = &(*pp)->next)
            if (*pp == o) {
                *pp = o->next;
                break;
            }
    pthread_mutex_unlock(&vmm__chunks_lock);
    if (drop) vmm__owner_free(o);
}

void vmm__import_keep_nothing(void)
{
    pthread_mutex_lock(&vmm__chunks_lock);
    keep_nothing = true;
    pthread_mutex_unlock(&vmm__chunks_lock);
}

/* ------------------------------------------------------------------------------------------ */
/* Imported chunks                                                                             */

/* One part of s is unmapped: the last one frees the reservation (in the context current, which
 * the caller made the one it was mapped in).  A part the driver kept mapped never calls this, so
 * the range stays reserved under it. */
vmm_status vmm__slab_put(slab *s)
{
    if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) != 0) return VMM_OK;
    CUresult r = TWICE(vmm__import_cu.MemAddressFree(s->base, s->size));
    free(s->shared_refs);
    free(s);
    return r == CUDA_SUCCESS ? VMM_OK : vmm__cu_fail("cuMemAddressFree", r);
}

/* A mapping in s goes from one of the parts using it: true when that part was its last user, so
 * the caller unmaps it.  shared: 0 for a mapping of that part alone, else 1 + its counter. */
bool vmm__mapping_last(slab *s, const uint32_t *shared, size_t i)
{
    return !s || !shared || !shared[i] || __atomic_sub_fetch(&s->shared_refs[shared[i] - 1], 1, __ATOMIC_ACQ_REL) == 0;
}

/* A fixed table of chains: no growth path, so no allocation that could fail besides the entry's
 * own (a table library would exit on out-of-memory, and this library never exits). */
#define CHUNK_BUCKETS 1024u
static chunk *chunk_table[CHUNK_BUCKETS];
static unsigned long idle_chunks;

chunk_key vmm__key_of(const vmm_alloc_info *a)
{
    chunk_key k;
    memset(&k, 0, sizeof k);
    k.pid = a->pid;
    k.start_time = a->owner_start_time;
    k.pidns = a->owner_pidns;
    k.mapped_size = a->mapped_size;
    /* A MULTI-HANDLE record's chunk_id names only its first handle: while the allocation lives,
     * the handles after it are its own, but once it is freed the owner may give them back and map
     * others of the same sizes there, so another allocation with the same first handle and size
     * may span other handles.  Its mapping serves that one allocation: keyed by slot and
     * generation. */
    if (a->chunk_id && !(a->flags & VMM_ALLOC_MULTI_HANDLE)) {
        k.id = a->chunk_id;
    } else {
        k.by_slot = 1;
        k.id = a->slot;
        k.generation = a->generation;
        k.first = a->chunk_id; /* a resume (vmm_resume) maps fresh handles under new ids, same slot */
    }
    return k;
}

bool vmm__same_key(const chunk_key *x, const chunk_key *y)
{
    return x->pid == y->pid && x->by_slot == y->by_slot && x->start_time == y->start_time && x->pidns == y->pidns &&
           x->id == y->id && x->generation == y->generation && x->mapped_size == y->mapped_size && x->first == y->first;
}

static chunk **bucket_of(const chunk_key *k)
{
    uint64_t h = vmm_reg_hash(k->pid, k->id ^ (k->generation * 0x9e3779b97f4a7c15ull) ^ k->start_time ^ k->pidns ^
                                          (k->mapped_size << 1) ^ k->by_slot);
    return &chunk_table[h % CHUNK_BUCKETS];
}

/* Lock held.  The entry for k with one more reference, or NULL. */
chunk *vmm__chunk_ref_locked(const chunk_key *k)
{
    for (chunk *c = *bucket_of(k); c; c = c->next)
        if (vmm__same_key(&c->key, k)) {
            if (c->refs++ == 0) idle_chunks--;
            return c;
        }
    return NULL;
}

/* Lock held: take c out of the table (its mapping is the caller's to undo). */
static void chunk_unlink_locked(chunk *c)
{
    for (chunk **pp = bucket_of(&c->key); *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    c->owner->chunks--;
    c->owner->last_used_ns = vmm__now_ns();
}

void vmm__set_witness_locked(chunk *c, vmm_registry *reg, const vmm_alloc_info *a)
{
    c->reg = reg;
    c->witness_slot = a->slot;
    c->witness_generation = a->generation;
    memcpy(c->witness_id, a->alloc_id, sizeof c->witness_id);
}

chunk *vmm__chunk_enter(chunk *fresh, vmm_registry *reg, const vmm_alloc_info *a)
{
    pthread_mutex_lock(&vmm__chunks_lock);
    chunk *had = vmm__chunk_ref_locked(&fresh->key);
    if (had) {
        had->refs += fresh->refs - 1; /* one reference for each fresh would have carried */
    } else {
        chunk **b = bucket_of(&fresh->key);
        fresh->next = *b;
        *b = fresh;
        fresh->owner->chunks++;
        vmm__set_witness_locked(fresh, reg, a);
    }
    pthread_mutex_unlock(&vmm__chunks_lock);
    return had ? had : fresh;
}

/* Memory is unmapped from the context it was mapped in, whichever is current on the releasing
 * thread.  True when ctx was made current here; *prev is what to restore then.  (vmm__cuda_ready()
 * succeeded when the memory was mapped; the table never changes after.) */
bool vmm__ctx_enter(CUcontext ctx, CUcontext *prev)
{
    *prev = NULL;
    return vmm__import_cu.CtxGetCurrent(prev) == CUDA_SUCCESS && *prev != ctx && vmm__import_cu.CtxSetCurrent(ctx) == CUDA_SUCCESS;
}

/* Give back the pieces of a mapping, as far as they exist: the mapping, the handle, the address
 * range (not freed under a mapping the driver kept).  The first failure's status. */
vmm_status vmm__undo(CUdeviceptr base, size_t size, CUmemGenericAllocationHandle handle, bool mapped, bool reserved)
{
    vmm_status st = VMM_OK;
    CUresult r;
    if (mapped && (r = TWICE(vmm__import_cu.MemUnmap(base, size))) != CUDA_SUCCESS) {
        st = vmm__cu_fail("cuMemUnmap", r);
        reserved = false;
    }
    if ((r = TWICE(vmm__import_cu.MemRelease(handle))) != CUDA_SUCCESS && st == VMM_OK) st = vmm__cu_fail("cuMemRelease", r);
    if (reserved && (r = TWICE(vmm__import_cu.MemAddressFree(base, size))) != CUDA_SUCCESS && st == VMM_OK)
        st = vmm__cu_fail("cuMemAddressFree", r);
    return st;
}

/* Unmap, release and free the address range of a mapping no reference points to any more. */
vmm_status vmm__unmap_chunk(const chunk *c)
{
    CUcontext cur;
    bool switched = vmm__ctx_enter(c->ctx, &cur);
    vmm_status st = VMM_OK;
    if (!c->n_parts) {
        st = vmm__undo(c->base, c->size, c->handle, true, true);
    } else {
        /* one call per mapping, as a range import's; the range is not freed under a mapping the
         * driver kept */
        CUresult r;
        uint64_t at = 0;
        for (uint32_t i = 0; i < c->n_parts; at += c->part_len[i++])
            if (vmm__mapping_last(c->slab, c->shared, i) &&
                (r = TWICE(vmm__import_cu.MemUnmap(c->base + at, c->part_len[i]))) != CUDA_SUCCESS && st == VMM_OK)
                st = vmm__cu_fail("cuMemUnmap", r);
        if (st == VMM_OK && c->slab)
            st = vmm__slab_put(c->slab);
        else if (st == VMM_OK && (r = TWICE(vmm__import_cu.MemAddressFree(c->base, c->size))) != CUDA_SUCCESS)
            st = vmm__cu_fail("cuMemAddressFree", r);
    }
    if (switched) (void)TWICE(vmm__import_cu.CtxSetCurrent(cur)); /* else the thread stays in ctx */
    return st;
}

void vmm__chunk_free(chunk *c)
{
    free(c->part_len);
    free(c->shared);
    free(c);
}

/* Unmap a list of unlinked chunks (chained through next); the first failure's status. */
static vmm_status unmap_list(chunk *list)
{
    vmm_status st = VMM_OK;
    while (list) {
        chunk *c = list;
        list = c->next;
        vmm_status s1 = vmm__unmap_chunk(c);
        if (s1 == VMM_OK) vmm__release_tell(c); /* a pause of its owner waits to hear it */
        if (st == VMM_OK) st = s1;
        vmm__chunk_free(c);
    }
    return st;
}

/* Lock held.  The idle chunk's owner still holds it, as far as the registry tells.  A paused
 * witness (vmm_pause) does not: the owner released its handle, and an idle mapping here would be
 * all that keeps the memory from the device; nor one resumed since (its chunk has a new id). */
static bool witness_live_locked(const chunk *c)
{
    if (!c->reg || vmm__owner_exited(c->owner)) return false;
    vmm_alloc_info now;
    return vmm__read_slot(c->reg, c->witness_slot, &now) == VMM_OK &&
           now.generation == c->witness_generation && memcmp(now.alloc_id, c->witness_id, sizeof now.alloc_id) == 0 &&
           !(now.flags & VMM_ALLOC_PAUSED) && now.chunk_id == (c->key.by_slot ? c->key.first : c->key.id);
}

/* Drop one reference.  The last one leaves the mapping idle while its owner holds the chunk,
 * and unmaps it otherwise (outside the lock). */
vmm_status vmm__chunk_unref(chunk *c)
{
    pthread_mutex_lock(&vmm__chunks_lock);
    bool unmap = false;
    if (--c->refs == 0) {
        if (!keep_nothing && witness_live_locked(c)) {
            idle_chunks++;
            reaper_wake_locked();
        } else {
            chunk_unlink_locked(c);
            unmap = true;
        }
    }
    owner_ref *o = unmap ? c->owner : NULL;
    if (o) o->busy++; /* the owner entry outlives the unlink until vmm__owner_put */
    pthread_mutex_unlock(&vmm__chunks_lock);
    if (!unmap) return VMM_OK;
    c->next = NULL;
    vmm_status st = unmap_list(c);
    vmm__owner_put(o);
    return st;
}

/* ---- the reaper: a thread that looks after idle mappings and kept connections ------------ */

#define REAPER_TICK_MS 100
static bool reaper_running;

/* Lock held.  Unlink what nobody needs any more onto *dead_chunks / *dead_owners.  `all`: every
 * idle chunk (vmm_import_drop_idle); `reg`: the idle chunks read through it (vmm_close). */
static void sweep_locked(bool all, const vmm_registry *reg, chunk **dead_chunks, owner_ref **dead_owners)
{
    uint64_t now = vmm__now_ns();
    for (unsigned b = 0; b < CHUNK_BUCKETS; b++)
        for (chunk **pp = &chunk_table[b]; *pp;) {
            chunk *c = *pp;
            if (reg && c->reg == reg) c->reg = NULL; /* a held one goes at its last release */
            if (c->refs == 0 && (all || !witness_live_locked(c))) {
                *pp = c->next;
                c->owner->chunks--;
                c->owner->last_used_ns = now;
                idle_chunks--;
                c->next = *dead_chunks;
                *dead_chunks = c;
                continue;
            }
            pp = &c->next;
        }
    for (owner_ref **pp = &owners; *pp;) {
        owner_ref *o = *pp;
        if (o->chunks == 0 && o->busy == 0 && (now - o->last_used_ns > OWNER_IDLE_NS || vmm__owner_exited(o))) {
            *pp = o->next;
            o->next = *dead_owners;
            *dead_owners = o;
            continue;
        }
        pp = &o->next;
    }
}

/* Sweeps whose unmaps run outside vmm__chunks_lock now: vmm_import_drop_idle waits for them, so that
 * an idle mapping the reaper took a moment before is gone too when it returns.  The count belongs
 * to the process that swept: a child forked meanwhile inherits it without the threads that would
 * bring it down, so there it starts again from 0. */
static pthread_cond_t reaped = PTHREAD_COND_INITIALIZER;
static unsigned long reaping;
static pid_t reaping_pid;

/* Lock held: this process's sweeps in flight. */
static unsigned long *reaping_here_locked(void)
{
    pid_t me = getpid();
    if (reaping_pid != me) {
        reaping_pid = me;
        reaping = 0;
    }
    return &reaping;
}

/* Lock held, after a sweep into these lists: their unmaps begin. */
static void reap_begin_locked(const chunk *dead_chunks, const owner_ref *dead_owners)
{
    if (dead_chunks || dead_owners) (*reaping_here_locked())++;
}

static vmm_status reap(chunk *dead_chunks, owner_ref *dead_owners)
{
    if (!dead_chunks && !dead_owners) return VMM_OK;
    vmm_status st = unmap_list(dead_chunks);
    while (dead_owners) {
        owner_ref *o = dead_owners;
        dead_owners = o->next;
        vmm__owner_free(o);
    }
    pthread_mutex_lock(&vmm__chunks_lock);
    unsigned long *n = reaping_here_locked();
    if (*n && --*n == 0) pthread_cond_broadcast(&reaped);
    pthread_mutex_unlock(&vmm__chunks_lock);
    return st;
}

static void *reaper_main(void *arg)
{
    (void)arg;
    for (;;) {
        struct timespec ts = {0, REAPER_TICK_MS * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
        chunk *dead_chunks = NULL;
        owner_ref *dead_owners = NULL;
        pthread_mutex_lock(&vmm__chunks_lock);
        sweep_locked(false, NULL, &dead_chunks, &dead_owners);
        reap_begin_locked(dead_chunks, dead_owners);
        bool done = idle_chunks == 0 && owners == NULL;
        if (done) reaper_running = false;
        pthread_mutex_unlock(&vmm__chunks_lock);
        (void)reap(dead_chunks, dead_owners);
        if (done) return NULL;
    }
}

/* Lock held.  Start the reaper if it is not running.  It takes no signals (they are the
 * application's).  Should it fail to start, idle mappings and connections still go at
 * vmm_import_drop_idle and vmm_close. */
static void reaper_wake_locked(void)
{
    if (reaper_running || keep_nothing) return;
    pthread_t th;
    reaper_running = vmm__thread_detached(&th, reaper_main, NULL) == 0;
}

vmm_status vmm__import_drop_idle(void)
{
    chunk *dead_chunks = NULL;
    owner_ref *dead_owners = NULL;
    pthread_mutex_lock(&vmm__chunks_lock);
    sweep_locked(true, NULL, &dead_chunks, &dead_owners);
    reap_begin_locked(dead_chunks, dead_owners);
    pthread_mutex_unlock(&vmm__chunks_lock);
    vmm_status st = reap(dead_chunks, dead_owners);
    pthread_mutex_lock(&vmm__chunks_lock);
    while (*reaping_here_locked()) pthread_cond_wait(&reaped, &vmm__chunks_lock);
    pthread_mutex_unlock(&vmm__chunks_lock);
    return st;
}

void vmm__import_forget_registry(vmm_registry *reg)
{
    chunk *dead_chunks = NULL;
    owner_ref *dead_owners = NULL;
    pthread_mutex_lock(&vmm__chunks_lock);
    sweep_locked(false, reg, &dead_chunks, &dead_owners);
    reap_begin_locked(dead_chunks, dead_owners);
    pthread_mutex_unlock(&vmm__chunks_lock);
    (void)reap(dead_chunks, dead_owners);
}

/* The chunk is mapped here already, so the owner's broker is not asked: the registry must still
 * show this very allocation, live, in that chunk, and its owner alive (what the broker would
 * have checked). */
vmm_status vmm__still_live(vmm_registry *reg, const vmm_alloc_info *a, const owner_ref *owner)
{
    vmm_status st = vmm__record_unchanged(reg, a);
    if (st != VMM_OK) return st;
    if (vmm__owner_exited(owner) && !vmm__kept_now(reg, a)) return vmm__owner_dead(a); /* a keeper serves a kept one */
    return VMM_OK;
}
