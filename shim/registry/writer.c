/* The owner's side of the registry: attach, bind, publish, retract, remove, detach and close, and
 * the index changes they make.  It is apart from the segment (registry.c) because only a process
 * that owns records runs it, and it alone of the two calls down into the name tables and the
 * keepers (a freed record drops its names; a fork child forgets its parent's table and keeper),
 * which themselves only read the segment: so no two files of the registry call each other. */
#include "registry/registry.h"
#include "registry/internal.h"
#include "registry/keep.h"
#include "registry/names.h"
#include "registry/seq.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

/* Creation stamps only show ages: the coarse clock (a few ms) costs a fraction of the precise one. */
static uint64_t now_coarse_ns(void) { return clock_ns(CLOCK_REALTIME_COARSE); }

void vmm__reg_counters_clear(vmm_reg_proc *p)
{
    uint64_t *c[] = {&p->n_allocs,      &p->bytes_requested,    &p->bytes_mapped,       &p->allocs,
                     &p->allocs_backed, &p->passed_capture,     &p->passed_device_full, &p->passed_unsupported,
                     &p->maps_adopted,  &p->peak_requested,  &p->unpublished};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) __atomic_store_n(c[i], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->keeper_pid, 0, __ATOMIC_RELAXED); /* an earlier owner's keeper is not this one's */
}

static uint64_t chunk_tag(const vmm__reg *r) { return ((uint64_t)r->proc_gen << 32) | (r->proc_index + 1); }

int vmm__reg_attach(vmm__reg *r, const char *broker_path)
{
    if (!r->writable) return -EPERM;
    if (r->attached) return 0;
    uint32_t pid = (uint32_t)getpid();
    uint64_t start, ns;
    int rc = vmm__proc_identity(pid, &start, &ns);
    if (rc) return rc;
    uint32_t cap = r->hdr->proc_capacity;
    for (uint32_t k = 0; k < cap; k++) {
        uint32_t i = (pid + k) % cap;
        vmm_reg_proc *p = proc_at(r, i);
        uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)c != 0) continue;
        uint32_t gen = (uint32_t)(c >> 32) + 1;
        if (!__atomic_compare_exchange_n(&p->claim, &c, ((uint64_t)gen << 32) | pid, false, __ATOMIC_ACQ_REL,
                                         __ATOMIC_RELAXED))
            continue;
        if ((rc = vmm__reg_back_range(r->fd, (uint64_t)((uint8_t *)p - r->base), sizeof *p)) != 0) {
            __atomic_store_n(&p->claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
            return rc;
        }
        vmm_reg_proc v;
        memset(&v, 0, sizeof v);
        v.claim = ((uint64_t)gen << 32) | pid;
        v.pid = pid;
        v.start_time = start;
        v.pidns = ns;
        v.registered_ns = clock_ns(CLOCK_REALTIME);
        v.uid = (uint32_t)getuid();
        v.generation = gen;
        if (broker_path) snprintf(v.broker_path, sizeof v.broker_path, "%s", broker_path);
        int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t n = read(fd, v.cmdline, sizeof v.cmdline - 1);
            (void)n;
            close(fd);
        }
        seq_begin(&p->seq);
        v.seq = __atomic_load_n(&p->seq, __ATOMIC_RELAXED);
        /* claim stays as CAS'd; copy everything after seq up to the counters */
        copy_words_in((uint8_t *)p + 16, (uint8_t *)&v + 16, offsetof(vmm_reg_proc, n_allocs) - 16);
        __atomic_store_n(&p->pid, pid, __ATOMIC_RELAXED);
        vmm__reg_counters_clear(p);
        __atomic_store_n(&p->stats_generation, gen, __ATOMIC_RELAXED);
        seq_end(&p->seq);
        r->proc_index = i;
        r->proc_gen = gen;
        r->pid = pid;
        r->start_time = start;
        r->pidns = ns;
        if (getrandom(&r->id_nonce, sizeof r->id_nonce, 0) != sizeof r->id_nonce)
            r->id_nonce = clock_ns(CLOCK_REALTIME) ^ ((uint64_t)pid << 40);
        r->attached = true;
        /* a table of this (pid, start time) is an earlier image's (exec keeps both): it has
         * published nothing yet */
        vmm__names_unlink(r, pid, start);
        return 0;
    }
    return -ENOSPC;
}

int vmm__reg_set_broker(vmm__reg *r, const char *broker_path)
{
    if (!r->attached) return -EINVAL;
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    char buf[sizeof p->broker_path];
    memset(buf, 0, sizeof buf);
    snprintf(buf, sizeof buf, "%s", broker_path ? broker_path : "");
    seq_begin(&p->seq);
    copy_words_in(p->broker_path, buf, sizeof buf);
    seq_end(&p->seq);
    return 0;
}

/* internal.h says why these two are per process */
static pthread_mutex_t index_mutex = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t vmm__reg_gc_mutex = PTHREAD_MUTEX_INITIALIZER;

void vmm__reg_forget_after_fork(vmm__reg *r)
{
    pthread_mutex_init(&r->lock, NULL);
    pthread_mutex_init(&index_mutex, NULL);
    pthread_mutex_init(&vmm__reg_gc_mutex, NULL);
    r->attached = false;
    r->n_free = r->n_chunks = 0;
    vmm__names_forget_after_fork(r);
    vmm__keep_forget_after_fork();
    /* The inherited fd shares the parent's open file description, so its OFD locks would not
     * exclude the parent's: open the same object again (by /proc/self/fd, no name lookup, works
     * if unlinked) for a description of our own, under the same fd number.  No snprintf: this
     * may run in an atfork handler. */
    if (r->fd < 0) return;
    char path[32] = "/proc/self/fd/", digits[12];
    int n = 0, len = (int)strlen(path);
    for (unsigned v = (unsigned)r->fd; n == 0 || v; v /= 10) digits[n++] = (char)('0' + v % 10);
    while (n) path[len++] = digits[--n];
    path[len] = 0;
    int fd = open(path, (r->writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0 || dup3(fd, r->fd, O_CLOEXEC) < 0) r->writable = false; /* cannot lock safely: no writing */
    if (fd >= 0) close(fd);
}

static void index_insert_locked(vmm__reg *r, uint32_t slot, uint32_t pid, uint64_t key);
static void index_remove_locked(vmm__reg *r, uint64_t slot, uint32_t pid, uint64_t key);

/* Reset a record to UNBOUND; its generation moves on so stale references stay stale. */
static void record_clear(vmm_reg_alloc *a)
{
    uint64_t gen = __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1;
    seq_begin(&a->seq);
    vmm_reg_alloc z;
    memset(&z, 0, sizeof z);
    z.generation = gen;
    z.exported_fd = -1;
    copy_words_in((uint8_t *)a + 8, (uint8_t *)&z + 8, sizeof z - 8);
    __atomic_store_n(&a->state, VMM_REG_UNBOUND, __ATOMIC_RELAXED);
    seq_end(&a->seq);
}

unsigned vmm__reg_chunk_release(vmm__reg *r, uint64_t c)
{
    unsigned n = 0;
    vmm__reg_index_lock(r);
    for (uint64_t s = c * VMM_REG_CHUNK_RECORDS; s < (c + 1) * VMM_REG_CHUNK_RECORDS; s++) {
        vmm_reg_alloc *a = rec_at(r, s);
        uint32_t state = __atomic_load_n(&a->state, __ATOMIC_RELAXED);
        if (state == VMM_REG_UNBOUND && !(__atomic_load_n(&a->seq, __ATOMIC_RELAXED) & 1u)) continue;
        if (state != VMM_REG_UNBOUND)
            index_remove_locked(r, s, __atomic_load_n(&a->pid, __ATOMIC_RELAXED),
                                vmm_reg_key(__atomic_load_n(&a->address, __ATOMIC_RELAXED),
                                            __atomic_load_n(&a->extent, __ATOMIC_RELAXED)));
        if (state == VMM_REG_LIVE) n++;
        record_clear(a);
    }
    vmm__reg_index_unlock(r);
    __atomic_store_n(chunk_at(r, c), 0, __ATOMIC_RELEASE);
    return n;
}

void vmm__reg_detach(vmm__reg *r)
{
    if (!r->attached) return;
    vmm__names_release(r, true); /* names first: readers check them against the records */
    pthread_mutex_lock(&r->lock);
    for (size_t i = 0; i < r->n_chunks; i++) vmm__reg_chunk_release(r, r->chunks[i]);
    r->n_chunks = r->n_free = 0;
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    seq_begin(&p->seq);
    __atomic_store_n(&p->pid, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->start_time, 0, __ATOMIC_RELAXED);
    seq_end(&p->seq);
    /* an older writer claiming the slot next leaves 504 alone (layout.h, COVERAGE) */
    __atomic_store_n(&p->unpublished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->claim, (uint64_t)r->proc_gen << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&r->attached, false, __ATOMIC_RELEASE); /* vmm__reg_self reads it unlocked */
    pthread_mutex_unlock(&r->lock);
}

static int grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap * 2 : 256;
    while (n < need) n *= 2;
    void *p = realloc(*arr, n * elem);
    if (!p) return -ENOMEM;
    *arr = p;
    *cap = n;
    return 0;
}

/* Claim a chunk: bump allocation first (touches memory in order), then any chunk freed by a
 * detach or a reclaim. */
static int claim_chunk(vmm__reg *r)
{
    uint64_t count = r->hdr->chunk_count, tag = chunk_tag(r), c = UINT64_MAX;
    if (grow((void **)&r->chunks, &r->cap_chunks, r->n_chunks + 1, sizeof *r->chunks) ||
        grow((void **)&r->free_slots, &r->cap_free, (r->n_chunks + 1) * VMM_REG_CHUNK_RECORDS, sizeof *r->free_slots))
        return -ENOMEM;
    if (__atomic_load_n(&r->hdr->chunks_hwm, __ATOMIC_RELAXED) < count) {
        uint64_t h = __atomic_fetch_add(&r->hdr->chunks_hwm, 1, __ATOMIC_ACQ_REL);
        uint64_t zero = 0;
        if (h < count && __atomic_compare_exchange_n(chunk_at(r, h), &zero, tag, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            c = h;
    }
    for (uint64_t i = 0; c == UINT64_MAX && i < count; i++) {
        uint64_t zero = 0;
        if (__atomic_load_n(chunk_at(r, i), __ATOMIC_RELAXED) == 0 &&
            __atomic_compare_exchange_n(chunk_at(r, i), &zero, tag, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            c = i;
    }
    if (c == UINT64_MAX) return -ENOSPC;
    int rc = vmm__reg_back_range(r->fd, r->hdr->rec_off + c * VMM_REG_CHUNK_RECORDS * sizeof(vmm_reg_alloc),
                        VMM_REG_CHUNK_RECORDS * sizeof(vmm_reg_alloc));
    if (rc) {
        __atomic_store_n(chunk_at(r, c), 0, __ATOMIC_RELEASE);
        return rc;
    }
    r->chunks[r->n_chunks++] = (uint32_t)c;
    for (uint32_t k = VMM_REG_CHUNK_RECORDS; k-- > 0;) r->free_slots[r->n_free++] = (uint32_t)(c * VMM_REG_CHUNK_RECORDS + k);
    return 0;
}

static bool owns_slot(const vmm__reg *r, uint32_t slot)
{
    return slot < r->hdr->capacity &&
           (__atomic_load_n(chunk_at(r, slot / VMM_REG_CHUNK_RECORDS), __ATOMIC_RELAXED)) == chunk_tag(r);
}

/* A free record slot of this process (claiming a chunk when none is left). */
static int take_slot(vmm__reg *r, uint32_t *slot)
{
    pthread_mutex_lock(&r->lock);
    int rc = r->n_free ? 0 : claim_chunk(r);
    if (rc == 0) *slot = r->free_slots[--r->n_free];
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static void write_bound(vmm__reg *r, uint32_t s, uint64_t address, uint64_t extent, uint32_t flags)
{
    vmm_reg_alloc *a = rec_at(r, s);
    seq_begin(&a->seq);
    __atomic_store_n(&a->generation, __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->proc_index, r->proc_index, __ATOMIC_RELAXED);
    __atomic_store_n(&a->pid, r->pid, __ATOMIC_RELAXED);
    __atomic_store_n(&a->start_time, r->start_time, __ATOMIC_RELAXED);
    __atomic_store_n(&a->pidns, r->pidns, __ATOMIC_RELAXED);
    __atomic_store_n(&a->address, address, __ATOMIC_RELAXED);
    __atomic_store_n(&a->mapped_size, extent, __ATOMIC_RELAXED);
    __atomic_store_n(&a->extent, extent, __ATOMIC_RELAXED);
    __atomic_store_n(&a->chunk_id, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->chunk_offset, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->exported_fd, -1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->flags, flags, __ATOMIC_RELAXED);
    __atomic_store_n(&a->state, VMM_REG_BOUND, __ATOMIC_RELAXED);
    seq_end(&a->seq);
}

static int bind_flags(vmm__reg *r, uint64_t address, uint64_t extent, uint32_t flags, uint32_t *slot)
{
    if (!r->attached) return -EINVAL;
    if (address == 0 || extent == 0 || extent > (1ull << VMM_REG_MAX_LEVEL) || address > UINT64_MAX - extent) return -EINVAL;
    uint32_t s;
    int rc = take_slot(r, &s); /* outside the index lock: detach takes the two the other way round */
    if (rc) return rc;
    write_bound(r, s, address, extent, flags); /* complete before its index entry can lead a reader to it */
    vmm__reg_index_lock(r);
    index_insert_locked(r, s, r->pid, vmm_reg_key(address, extent));
    vmm__reg_index_unlock(r);
    *slot = s;
    return 0;
}

int vmm__reg_bind(vmm__reg *r, uint64_t address, uint64_t extent, uint32_t *slot)
{
    return bind_flags(r, address, extent, 0, slot);
}

/* Write record a as LIVE from d (one seq write) and count it; address and extent as given. */
static void write_live(vmm__reg *r, vmm_reg_alloc *a, const vmm_reg_alloc *d, uint64_t address, uint64_t extent,
                       vmm_reg_alloc *published)
{
    vmm_reg_alloc v = *d;
    static const uint8_t zero_id[16];
    if (!memcmp(v.alloc_id, zero_id, 16)) {
        uint64_t n = __atomic_add_fetch(&r->id_counter, 1, __ATOMIC_RELAXED);
        /* splitmix64 is a bijection: ids stay unique per process and look random across them */
        uint64_t x = n + r->id_nonce; /* both halves then differ between processes */
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        x ^= x >> 31;
        memcpy(v.alloc_id, &r->id_nonce, 8);
        memcpy(v.alloc_id + 8, &x, 8);
    }
    v.state = VMM_REG_LIVE;
    v.generation = __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1;
    v.proc_index = r->proc_index;
    v.pid = r->pid;
    v.start_time = r->start_time;
    v.pidns = r->pidns;
    v.address = address;
    v.extent = extent;
    if (!v.mapped_size) v.mapped_size = v.extent; /* an allocation that is its own chunk */
    if (!v.created_ns) v.created_ns = now_coarse_ns();
    if (!(v.handle_kinds & VMM_HANDLE_PIDFD)) v.exported_fd = -1;
    v.tag[sizeof v.tag - 1] = 0;
    if (v.n_frames > 8) v.n_frames = 8;
    seq_begin(&a->seq);
    copy_words_in((uint8_t *)a + 8, (uint8_t *)&v + 8, sizeof v - 8);
    __atomic_store_n(&a->state, VMM_REG_LIVE, __ATOMIC_RELAXED);
    seq_end(&a->seq);
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    __atomic_add_fetch(&p->n_allocs, 1, __ATOMIC_RELAXED);
    uint64_t live = __atomic_add_fetch(&p->bytes_requested, v.requested_size, __ATOMIC_RELAXED);
    /* a compare-and-swap only while a new peak is being set */
    uint64_t peak = __atomic_load_n(&p->peak_requested, __ATOMIC_RELAXED);
    while (live > peak && !__atomic_compare_exchange_n(&p->peak_requested, &peak, live, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    __atomic_add_fetch(&p->bytes_mapped, v.extent, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->hdr->stat_publishes, 1, __ATOMIC_RELAXED);
    if (published) {
        v.seq = 0;
        *published = v;
    }
}

int vmm__reg_publish(vmm__reg *r, uint32_t slot, const vmm_reg_alloc *d, vmm_reg_alloc *published)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    if (__atomic_load_n(&a->state, __ATOMIC_RELAXED) != VMM_REG_BOUND) return -EINVAL;
    write_live(r, a, d, __atomic_load_n(&a->address, __ATOMIC_RELAXED), __atomic_load_n(&a->extent, __ATOMIC_RELAXED),
               published);
    return 0;
}

/* bind + publish in one: the allocation path's, with one record write and one index insert. */
int vmm__reg_add(vmm__reg *r, uint64_t address, uint64_t extent, const vmm_reg_alloc *d, uint32_t *slot,
                 vmm_reg_alloc *published)
{
    if (!r->attached) return -EINVAL;
    if (address == 0 || extent == 0 || extent > (1ull << VMM_REG_MAX_LEVEL) || address > UINT64_MAX - extent) return -EINVAL;
    uint32_t s;
    int rc = take_slot(r, &s);
    if (rc) return rc;
    write_live(r, rec_at(r, s), d, address, extent, published); /* complete before the index leads to it */
    vmm__reg_index_lock(r);
    index_insert_locked(r, s, r->pid, vmm_reg_key(address, extent));
    vmm__reg_index_unlock(r);
    *slot = s;
    return 0;
}

/* retract + unbind in one: the free path's.  Only state and generation change (one short write):
 * readers skip unbound records whatever else they hold. */
int vmm__reg_remove(vmm__reg *r, uint32_t slot)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    uint32_t state = __atomic_load_n(&a->state, __ATOMIC_RELAXED);
    if (state == VMM_REG_UNBOUND) return -EINVAL;
    uint64_t address = __atomic_load_n(&a->address, __ATOMIC_RELAXED), extent = __atomic_load_n(&a->extent, __ATOMIC_RELAXED);
    if (state == VMM_REG_LIVE) {
        vmm_reg_proc *p = proc_at(r, r->proc_index);
        __atomic_sub_fetch(&p->n_allocs, 1, __ATOMIC_RELAXED);
        __atomic_sub_fetch(&p->bytes_requested, __atomic_load_n(&a->requested_size, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
        __atomic_sub_fetch(&p->bytes_mapped, extent, __ATOMIC_RELAXED);
        __atomic_add_fetch(&r->hdr->stat_retracts, 1, __ATOMIC_RELAXED);
    }
    seq_begin(&a->seq);
    __atomic_store_n(&a->generation, __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 2, __ATOMIC_RELAXED);
    __atomic_store_n(&a->state, VMM_REG_UNBOUND, __ATOMIC_RELAXED);
    __atomic_store_n(&a->handle_kinds, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->exported_fd, -1, __ATOMIC_RELAXED);
    seq_end(&a->seq);
    vmm__reg_index_lock(r);
    index_remove_locked(r, slot, r->pid, vmm_reg_key(address, extent));
    vmm__reg_index_unlock(r);
    /* the names in it go before the slot can be reused; with no names, one relaxed load */
    if (__atomic_load_n(&r->names_live, __ATOMIC_RELAXED)) vmm__names_drop_slot(r, slot);
    pthread_mutex_lock(&r->lock);
    r->free_slots[r->n_free++] = slot; /* cap_free covers every slot of our chunks */
    pthread_mutex_unlock(&r->lock);
    return 0;
}

int vmm__reg_set_paused(vmm__reg *r, uint32_t slot, int paused, uint64_t chunk_id, uint32_t handle_kinds,
                        int32_t exported_fd, const uint8_t *fabric)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    if (__atomic_load_n(&a->state, __ATOMIC_RELAXED) != VMM_REG_LIVE) return -EINVAL;
    uint32_t flags = __atomic_load_n(&a->flags, __ATOMIC_RELAXED);
    uint64_t fab[8] = {0};
    if (fabric) memcpy(fab, fabric, sizeof fab);
    seq_begin(&a->seq);
    __atomic_store_n(&a->flags, paused ? flags | VMM_REG_F_PAUSED : flags & ~(uint32_t)VMM_REG_F_PAUSED, SEQ_WORD_STORE);
    __atomic_store_n(&a->handle_kinds, handle_kinds, SEQ_WORD_STORE);
    __atomic_store_n(&a->exported_fd, (handle_kinds & VMM_HANDLE_PIDFD) ? exported_fd : -1, SEQ_WORD_STORE);
    if (chunk_id) __atomic_store_n(&a->chunk_id, chunk_id, SEQ_WORD_STORE);
    copy_words_in(a->fabric, fab, sizeof fab);
    seq_end(&a->seq);
    return 0;
}

int vmm__reg_retract(vmm__reg *r, uint32_t slot)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    if (__atomic_load_n(&a->state, __ATOMIC_RELAXED) != VMM_REG_LIVE) return -EINVAL;
    uint64_t req = __atomic_load_n(&a->requested_size, __ATOMIC_RELAXED);
    uint64_t mapped = __atomic_load_n(&a->extent, __ATOMIC_RELAXED);
    seq_begin(&a->seq);
    __atomic_store_n(&a->generation, __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->state, VMM_REG_BOUND, __ATOMIC_RELAXED);
    __atomic_store_n(&a->exported_fd, -1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->handle_kinds, 0, __ATOMIC_RELAXED);
    seq_end(&a->seq);
    if (__atomic_load_n(&r->names_live, __ATOMIC_RELAXED)) vmm__names_drop_slot(r, slot);
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    __atomic_sub_fetch(&p->n_allocs, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&p->bytes_requested, req, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&p->bytes_mapped, mapped, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->hdr->stat_retracts, 1, __ATOMIC_RELAXED);
    return 0;
}

int vmm__reg_unbind(vmm__reg *r, uint32_t slot)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    uint32_t state = __atomic_load_n(&a->state, __ATOMIC_RELAXED);
    if (state == VMM_REG_UNBOUND) return -EINVAL;
    if (state == VMM_REG_LIVE) vmm__reg_retract(r, slot);
    vmm__reg_index_lock(r);
    index_remove_locked(r, slot, r->pid,
                        vmm_reg_key(__atomic_load_n(&a->address, __ATOMIC_RELAXED), __atomic_load_n(&a->extent, __ATOMIC_RELAXED)));
    vmm__reg_index_unlock(r);
    record_clear(a); /* after its entry is gone: a reader that still reaches it sees it change */
    pthread_mutex_lock(&r->lock);
    r->free_slots[r->n_free++] = slot; /* cap_free covers every slot of our chunks */
    pthread_mutex_unlock(&r->lock);
    return 0;
}

/* ---- the index: writers serialised by a lock word, readers lock-free ---- */

/* Readers see index_seq odd meanwhile. */
void vmm__reg_index_rebuild_locked(vmm__reg *r)
{
    uint32_t *ix = index_at(r);
    uint64_t mask = r->hdr->index_slots - 1;
    uint64_t seq = __atomic_load_n(&r->hdr->index_seq, __ATOMIC_RELAXED) | 1u; /* odd already if a rebuild died */
    __atomic_store_n(&r->hdr->index_seq, seq, __ATOMIC_RELAXED);
    SEQ_FENCE(__ATOMIC_RELEASE);
    for (uint64_t i = 0; i <= mask; i++) __atomic_store_n(&ix[i], VMM_REG_IX_EMPTY, SEQ_WORD_STORE);
    uint64_t hwm = __atomic_load_n(&r->hdr->chunks_hwm, __ATOMIC_RELAXED);
    if (hwm > r->hdr->chunk_count) hwm = r->hdr->chunk_count;
    for (uint64_t s = 0; s < hwm * VMM_REG_CHUNK_RECORDS; s++) {
        vmm_reg_alloc *a = rec_at(r, s);
        if (__atomic_load_n(&a->state, __ATOMIC_RELAXED) == VMM_REG_UNBOUND) continue;
        index_insert_locked(r, (uint32_t)s, __atomic_load_n(&a->pid, __ATOMIC_RELAXED),
                            vmm_reg_key(__atomic_load_n(&a->address, __ATOMIC_RELAXED), __atomic_load_n(&a->extent, __ATOMIC_RELAXED)));
    }
    __atomic_store_n(&r->hdr->index_seq, seq + 1, __ATOMIC_RELEASE);
}

/* May a waiter take the index lock from holder `w`?  Yes when the holder's proc slot has moved on
 * or its owner is dead; when liveness cannot be judged (another pid namespace), after 2 s, far
 * beyond the few stores a holder makes. */
static bool index_holder_gone(const vmm__reg *r, uint64_t w, double waited)
{
    uint32_t idx = (uint32_t)w - 1, gen = (uint32_t)(w >> 32);
    if (idx >= r->hdr->proc_capacity) return true; /* not a holder we know: a corrupt word */
    uint64_t claim = __atomic_load_n(&proc_at(r, idx)->claim, __ATOMIC_ACQUIRE);
    if ((uint32_t)claim == 0 || (uint32_t)(claim >> 32) != gen) return true;
    vmm_reg_proc p;
    int live = vmm__reg_read_proc(r, idx, &p) == 0 && p.start_time ? vmm__reg_liveness(p.pid, p.start_time, p.pidns) : VMM__UNKNOWN;
    return live == VMM__DEAD || (live == VMM__UNKNOWN && waited > 2.0);
}

void vmm__reg_index_lock(vmm__reg *r)
{
    pthread_mutex_lock(&index_mutex); /* this process's threads queue here, not on the shared word */
    uint64_t me = chunk_tag(r), w = 0;
    double since = 0;
    for (unsigned n = 0; !__atomic_compare_exchange_n(&r->hdr->index_lock, &w, me, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED); n++) {
        if (n >= 64) sched_yield();
        if (n % 256 == 255) {
            double t = monotonic_s();
            if (since == 0) since = t;
            if (index_holder_gone(r, w, t - since) &&
                __atomic_compare_exchange_n(&r->hdr->index_lock, &w, me, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
                break; /* every change leaves the index readable, so taking over needs no repair */
        }
        w = 0;
    }
}

void vmm__reg_index_unlock(vmm__reg *r)
{
    __atomic_store_n(&r->hdr->index_lock, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&index_mutex);
}

static void index_insert_locked(vmm__reg *r, uint32_t slot, uint32_t pid, uint64_t key)
{
    uint32_t *ix = index_at(r);
    uint64_t mask = r->hdr->index_slots - 1, i = vmm_reg_hash(pid, key) & mask;
    for (uint64_t n = 0; n <= mask; n++, i = (i + 1) & mask) {
        uint32_t e = __atomic_load_n(&ix[i], __ATOMIC_RELAXED);
        if (e == VMM_REG_IX_EMPTY || e == VMM_REG_IX_TOMB) {
            __atomic_store_n(&ix[i], slot + 1, __ATOMIC_RELEASE);
            return;
        }
    }
}

/* The entry becomes a tombstone, so no other entry moves under a reader; a run of tombstones just
 * before an empty entry is the end of every run through it, and turns back into empty entries. */
static void index_remove_locked(vmm__reg *r, uint64_t slot, uint32_t pid, uint64_t key)
{
    uint32_t *ix = index_at(r);
    uint64_t mask = r->hdr->index_slots - 1, i = vmm_reg_hash(pid, key) & mask;
    for (uint64_t n = 0;; n++, i = (i + 1) & mask) {
        uint32_t e = __atomic_load_n(&ix[i], __ATOMIC_RELAXED);
        if (e == VMM_REG_IX_EMPTY || n > mask) return;
        if (e == slot + 1) break;
    }
    __atomic_store_n(&ix[i], VMM_REG_IX_TOMB, __ATOMIC_RELEASE);
    if (__atomic_load_n(&ix[(i + 1) & mask], __ATOMIC_RELAXED) != VMM_REG_IX_EMPTY) return;
    for (uint64_t n = 0; n <= mask && __atomic_load_n(&ix[i], __ATOMIC_RELAXED) == VMM_REG_IX_TOMB; n++, i = (i - 1) & mask)
        __atomic_store_n(&ix[i], VMM_REG_IX_EMPTY, __ATOMIC_RELEASE);
}

void vmm__reg_close(vmm__reg *r)
{
    if (!r->base) return;
    if (r->attached) vmm__reg_detach(r);
    vmm__names_release(r, false);
    munmap(r->base, r->map_size);
    close(r->fd);
    free(r->free_slots);
    free(r->chunks);
    pthread_mutex_destroy(&r->lock);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}
