/* libvmmshim-client: the companion API of tools/include/vmmshim.h.
 *
 * Reader side: open the registry (read-only, or writable for gc), describe it, iterate its
 * allocation and process records, find an allocation by (pid, interior address), and check or
 * reclaim dead owners' records.  Everything goes through the internal registry API
 * (shim/registry/registry.h) and the published layout (shim/registry/layout.h).
 *
 * Rules: this library never prints, never exits and links no CUDA library.  Every failure
 * leaves a one-line reason in a thread-local buffer (vmm_last_error()).  Reads never touch
 * pages of the shared segment that no writer has backed (a read fault on a tmpfs hole would
 * allocate it): the sparse process table is scanned with pread, not through the mapping. */
#include "vmmshim.h"
#include "client_internal.h"

#include "registry/registry.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define VMM_PUBLIC __attribute__((visibility("default")))

/* The public enums mirror the layout's; a change on either side must be a compile error. */
#define SAME(a, b) ((int)(a) == (int)(b))
_Static_assert(SAME(VMM_FROM_UNKNOWN, VMM_API_UNKNOWN) && SAME(VMM_FROM_CUDA_MALLOC, VMM_API_CUDA_MALLOC) &&
                   SAME(VMM_FROM_CUDA_MALLOC_ASYNC, VMM_API_CUDA_MALLOC_ASYNC) &&
                   SAME(VMM_FROM_CU_MEM_ALLOC, VMM_API_CU_MEM_ALLOC) &&
                   SAME(VMM_FROM_CU_MEM_ALLOC_ASYNC, VMM_API_CU_MEM_ALLOC_ASYNC) &&
                   SAME(VMM_FROM_CU_MEM_ALLOC_PITCH, VMM_API_CU_MEM_ALLOC_PITCH) &&
                   SAME(VMM_FROM_CU_MEM_MAP, VMM_API_CU_MEM_MAP) && SAME(VMM_FROM_TEST, VMM_API_TEST),
               "vmm_alloc_info.api mirrors vmm_reg_alloc.api");
_Static_assert(SAME(VMM_ALLOC_NOT_EXPORTABLE, VMM_REG_F_NOT_EXPORTABLE) && SAME(VMM_ALLOC_SHARED_CHUNK, VMM_REG_F_SHARED_CHUNK) &&
                   SAME(VMM_ALLOC_MULTI_HANDLE, VMM_REG_F_MULTI_HANDLE),
               "alloc flags match the registry's");
_Static_assert(SAME(VMM_KIND_BROKER, VMM_HANDLE_BROKER) && SAME(VMM_KIND_PIDFD, VMM_HANDLE_PIDFD) &&
                   SAME(VMM_KIND_FABRIC, VMM_HANDLE_FABRIC),
               "vmm_alloc_info.handle_kinds mirrors vmm_reg_alloc.handle_kinds");
_Static_assert(SAME(VMM_OWNER_DEAD, VMM__DEAD) && SAME(VMM_OWNER_ALIVE, VMM__ALIVE) &&
                   SAME(VMM_OWNER_UNKNOWN, VMM__UNKNOWN),
               "owner liveness values");
_Static_assert(sizeof(((vmm_registry_info *)0)->name) == sizeof(((vmm__reg *)0)->name), "registry name size");
_Static_assert(sizeof(((vmm_proc_info *)0)->broker_path) == sizeof(((vmm_reg_proc *)0)->broker_path),
               "broker_path size");
_Static_assert(sizeof(((vmm_proc_info *)0)->cmdline) == sizeof(((vmm_reg_proc *)0)->cmdline), "cmdline size");
_Static_assert(sizeof(((vmm_alloc_info *)0)->tag) == sizeof(((vmm_reg_alloc *)0)->tag), "tag size");
_Static_assert(sizeof(((vmm_alloc_info *)0)->frames) == sizeof(((vmm_reg_alloc *)0)->frames), "frames size");

struct vmm_registry {
    vmm__reg r;
};

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */

#define ERR_MAX 512
static _Thread_local char last_error[ERR_MAX];

static vmm_status vset_error(vmm_status st, const char *fmt, va_list ap)
{
    char buf[ERR_MAX];
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    if (n < 0) snprintf(buf, sizeof buf, "%s", vmm_strerror(st));
    /* one line, printable: whatever a segment or a caller put in a name stays on it */
    for (char *p = buf; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = ' ';
    memcpy(last_error, buf, sizeof last_error);
    last_error[sizeof last_error - 1] = 0;
    return st;
}

__attribute__((format(printf, 2, 3))) static vmm_status set_error(vmm_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vset_error(st, fmt, ap);
    va_end(ap);
    return st;
}

/* For the library's other files (client_internal.h): the same setter, hidden (not in the map). */
vmm_status vmm__client_error(vmm_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vset_error(st, fmt, ap);
    va_end(ap);
    return st;
}

VMM_PUBLIC const char *vmm_strerror(vmm_status status)
{
    switch (status) {
    case VMM_OK: return "success";
    case VMM_ERR_INVALID: return "invalid argument";
    case VMM_ERR_NOT_FOUND: return "not found";
    case VMM_ERR_ACCESS: return "permission denied";
    case VMM_ERR_CORRUPT: return "the registry is not a valid vmmshim segment";
    case VMM_ERR_VERSION: return "the registry's layout is newer than this library reads";
    case VMM_ERR_BUSY: return "a writer is mid-update (retry, or run gc)";
    case VMM_ERR_STALE: return "the allocation was freed since it was read";
    case VMM_ERR_OWNER_DEAD: return "the owning process has exited";
    case VMM_ERR_CUDA: return "a CUDA driver call failed";
    case VMM_ERR_NOMEM: return "out of memory";
    case VMM_ERR_IO: return "I/O error";
    }
    return "unknown status";
}

VMM_PUBLIC const char *vmm_last_error(void) { return last_error; }

/* A -EPROTO from the registry means "not a segment this reader can read": tell a segment that
 * is a registry of a newer layout (magic right, compat_version beyond ours) from a corrupt one. */
static bool header_too_new(const vmm_reg_header *h)
{
    return __atomic_load_n(&h->magic, __ATOMIC_RELAXED) == VMM_REG_MAGIC &&
           __atomic_load_n(&h->compat_version, __ATOMIC_RELAXED) > VMM_REG_VERSION;
}

static bool segment_too_new(const char *name)
{
    int fd = shm_open(name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) return false;
    vmm_reg_header h;
    memset(&h, 0, sizeof h);
    ssize_t n = pread(fd, &h, sizeof h, 0);
    close(fd);
    return n == (ssize_t)sizeof h && header_too_new(&h);
}

/* Map a registry error code (-errno style) to a status. */
static vmm_status status_of(int rc, bool too_new)
{
    switch (-rc) {
    case ENOENT: return VMM_ERR_NOT_FOUND;
    case EACCES:
    case EPERM: return VMM_ERR_ACCESS;
    case EPROTO: return too_new ? VMM_ERR_VERSION : VMM_ERR_CORRUPT;
    case EAGAIN: return VMM_ERR_BUSY;
    case ENOMEM: return VMM_ERR_NOMEM;
    case EINVAL:
    case ENAMETOOLONG: return VMM_ERR_INVALID;
    default: return VMM_ERR_IO;
    }
}

/* The status of a registry error, with the registry's own one-line reason (`msg`). */
static vmm_status reg_error(int rc, const char *msg, bool too_new)
{
    vmm_status st = status_of(rc, too_new);
    if (msg && *msg) return set_error(st, "%s", msg);
    char eb[128];
    return set_error(st, "registry: %s", strerror_r(-rc, eb, sizeof eb));
}

#define NEED(cond, what)                                                                          \
    do {                                                                                          \
        if (!(cond)) return set_error(VMM_ERR_INVALID, "%s: %s", __func__, what);                 \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* Open, close, describe                                                                       */

static vmm_status open_mode(const char *name, int mode, vmm_registry **out)
{
    NEED(out, "out is NULL");
    *out = NULL;
    if (name && strlen(name) >= sizeof(((vmm__reg *)0)->name))
        return set_error(VMM_ERR_INVALID, "registry name is longer than %zu bytes",
                         sizeof(((vmm__reg *)0)->name) - 1);
    vmm_registry *reg = calloc(1, sizeof *reg);
    if (!reg) return set_error(VMM_ERR_NOMEM, "registry: out of memory");
    char err[256] = "";
    /* The group only matters for a writer: it lets gc write to a segment shared with a group. */
    const char *group = mode == VMM__REG_READ ? NULL : getenv("VMMSHIM_REGISTRY_GROUP");
    int rc = vmm__reg_open(&reg->r, name, mode, 0, group, err, sizeof err);
    if (rc) {
        bool too_new = rc == -EPROTO && segment_too_new(reg->r.name);
        free(reg);
        return reg_error(rc, err, too_new);
    }
    *out = reg;
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_open(const char *name, vmm_registry **out) { return open_mode(name, VMM__REG_READ, out); }

VMM_PUBLIC vmm_status vmm_open_writable(const char *name, vmm_registry **out)
{
    return open_mode(name, VMM__REG_WRITE, out);
}

VMM_PUBLIC void vmm_close(vmm_registry *reg)
{
    if (!reg) return;
    vmm__import_forget_registry(reg);
    vmm__reg_close(&reg->r);
    free(reg);
}

static const uint64_t *chunk_table(const vmm__reg *r) { return (const uint64_t *)(r->base + r->hdr->chunk_off); }

static uint64_t chunks_hwm(const vmm__reg *r)
{
    uint64_t hwm = __atomic_load_n(&r->hdr->chunks_hwm, __ATOMIC_ACQUIRE);
    return hwm > r->hdr->chunk_count ? r->hdr->chunk_count : hwm;
}

VMM_PUBLIC vmm_status vmm_registry_describe(vmm_registry *reg, vmm_registry_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    const vmm__reg *r = &reg->r;
    const vmm_reg_header *h = r->hdr;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", r->name);
    out->version = h->version;
    out->compat_version = h->compat_version;
    out->capacity = h->capacity;
    out->chunk_records = h->chunk_records;
    out->created_ns = h->created_ns;
    out->total_bytes = h->total_size;
    out->touched_bytes = vmm__reg_footprint(r);
    /* Chunks beyond the high-water mark were never handed out; their table is backed anyway. */
    const uint64_t *ct = chunk_table(r);
    for (uint64_t c = 0, hwm = chunks_hwm(r); c < hwm; c++)
        if (__atomic_load_n(&ct[c], __ATOMIC_ACQUIRE) != 0) out->used_chunks++;
    out->publishes = __atomic_load_n(&h->stat_publishes, __ATOMIC_RELAXED);
    out->retracts = __atomic_load_n(&h->stat_retracts, __ATOMIC_RELAXED);
    out->reclaimed = __atomic_load_n(&h->stat_reclaimed, __ATOMIC_RELAXED);
    return VMM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Liveness, cached per owner within one call                                                  */

#define LIVE_CACHE 256 /* direct-mapped; records come in per-owner chunks, so misses are rare */

typedef struct {
    uint64_t start_time, pidns;
    uint32_t pid;
    int alive; /* -1: empty */
} live_entry;

typedef struct {
    live_entry e[LIVE_CACHE];
} live_cache;

static void live_cache_init(live_cache *c)
{
    for (size_t i = 0; i < LIVE_CACHE; i++) c->e[i].alive = -1;
}

static int live_cached(live_cache *c, uint32_t pid, uint64_t start_time, uint64_t pidns)
{
    live_entry *e = &c->e[(vmm_reg_hash(pid, start_time ^ pidns) >> 7) % LIVE_CACHE];
    if (e->alive >= 0 && e->pid == pid && e->start_time == start_time && e->pidns == pidns) return e->alive;
    e->pid = pid;
    e->start_time = start_time;
    e->pidns = pidns;
    e->alive = vmm__reg_liveness(pid, start_time, pidns);
    return e->alive;
}

static bool pid_exists(uint32_t pid)
{
    char path[32];
    snprintf(path, sizeof path, "/proc/%u", pid);
    return access(path, F_OK) == 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Record conversion                                                                           */

static void alloc_info_from(vmm_alloc_info *o, uint64_t slot, const vmm_reg_alloc *a, int alive)
{
    memset(o, 0, sizeof *o);
    memcpy(o->alloc_id, a->alloc_id, sizeof o->alloc_id);
    o->generation = a->generation;
    o->slot = slot;
    o->pid = a->pid;
    o->owner_alive = alive;
    o->owner_start_time = a->start_time;
    o->owner_pidns = a->pidns;
    o->device = a->device;
    memcpy(o->device_uuid, a->device_uuid, sizeof o->device_uuid);
    o->address = a->address;
    o->requested_size = a->requested_size;
    o->mapped_size = a->mapped_size;
    o->stream = a->stream;
    o->created_ns = a->created_ns;
    o->api = a->api;
    o->handle_kinds = a->handle_kinds;
    o->exported_fd = a->exported_fd;
    o->n_frames = a->n_frames > 8 ? 8 : a->n_frames;
    memcpy(o->frames, a->frames, o->n_frames * sizeof o->frames[0]);
    memcpy(o->tag, a->tag, sizeof o->tag);
    o->chunk_id = a->chunk_id;
    o->chunk_offset = a->chunk_offset;
    o->extent = a->extent;
    o->flags = a->flags & (VMM_REG_F_NOT_EXPORTABLE | VMM_REG_F_SHARED_CHUNK | VMM_REG_F_MULTI_HANDLE);
    /* a record of an older layout has zeros at n_handles: one handle */
    o->n_handles = (a->flags & VMM_REG_F_MULTI_HANDLE) && a->n_handles > 1 ? a->n_handles : 1;
    o->tag[sizeof o->tag - 1] = 0;
}

static void proc_info_from(vmm_proc_info *o, const vmm_reg_proc *p, uint32_t pid, int alive)
{
    memset(o, 0, sizeof *o);
    o->pid = pid;
    o->alive = alive;
    o->start_time = p->start_time;
    o->pidns = p->pidns;
    o->uid = p->uid;
    o->registered_ns = p->registered_ns;
    memcpy(o->broker_path, p->broker_path, sizeof o->broker_path);
    o->broker_path[sizeof o->broker_path - 1] = 0;
    /* argv is NUL-separated and may be truncated: join the arguments with spaces */
    size_t n = sizeof p->cmdline - 1;
    while (n > 0 && p->cmdline[n - 1] == 0) n--;
    for (size_t i = 0; i < n; i++) o->cmdline[i] = p->cmdline[i] ? p->cmdline[i] : ' ';
    o->cmdline[n] = 0;
    o->n_allocs = p->n_allocs;
    o->bytes_requested = p->bytes_requested;
    o->bytes_mapped = p->bytes_mapped;
    /* an owner of layout 2 leaves the counters as the slot's earlier owner left them */
    o->stats_known = p->generation != 0 && p->stats_generation == p->generation;
    if (!o->stats_known) return;
    o->allocs = p->allocs;
    o->allocs_backed = p->allocs_backed;
    o->passed_capture = p->passed_capture;
    o->passed_device_full = p->passed_device_full;
    o->passed_unsupported = p->passed_unsupported;
    o->maps_adopted = p->maps_adopted;
    o->peak_requested = p->peak_requested;
}

/* ------------------------------------------------------------------------------------------ */
/* Process table: claimed slots found with pread (the table is sparse; see the top)            */

typedef int (*claim_fn)(void *ctx, uint32_t index, uint64_t claim);

#define SCAN_BATCH 32 /* proc records per pread: 16 KiB on the stack */

static int scan_claims(const vmm__reg *r, claim_fn fn, void *ctx)
{
    const vmm_reg_header *h = r->hdr;
    uint32_t cap = h->proc_capacity;
    vmm_reg_proc buf[SCAN_BATCH];
    for (uint32_t i = 0; i < cap; i += SCAN_BATCH) {
        uint32_t n = cap - i < SCAN_BATCH ? cap - i : SCAN_BATCH;
        off_t off = (off_t)(h->proc_off + (uint64_t)i * sizeof(vmm_reg_proc));
        size_t want = n * sizeof(vmm_reg_proc);
        ssize_t got = pread(r->fd, buf, want, off);
        for (uint32_t k = 0; k < n; k++) {
            uint64_t claim;
            if (got == (ssize_t)want)
                claim = buf[k].claim;
            else /* cannot happen on tmpfs; fall back to the mapping */
                claim = __atomic_load_n(
                    &((const vmm_reg_proc *)(r->base + h->proc_off))[i + k].claim, __ATOMIC_ACQUIRE);
            if ((uint32_t)claim == 0) continue;
            int stop = fn(ctx, i + k, claim);
            if (stop) return stop;
        }
    }
    return 0;
}

/* Read a claimed proc slot.  0 and *pid, *alive filled; -ENOENT when the slot was released (or
 * re-claimed) meanwhile; -EAGAIN when the record stayed mid-write (waiting on wait). */
static int read_claimed_proc(const vmm__reg *r, uint32_t index, uint64_t claim, vmm_reg_proc *p, uint32_t *pid,
                             int *alive, vmm__reg_wait *wait)
{
    int rc = vmm__reg_read_proc_within(r, index, p, wait);
    if (rc) return rc;
    uint32_t cpid = (uint32_t)p->claim;
    if (cpid == 0 || (p->claim >> 32) != (claim >> 32)) return -ENOENT;
    if (p->pid == cpid && p->start_time != 0) {
        *pid = p->pid;
        *alive = vmm__reg_liveness(p->pid, p->start_time, p->pidns);
    } else {
        /* claimed but its identity not (yet) written: the claimer died in between, or is there */
        *pid = cpid;
        *alive = pid_exists(cpid) ? VMM__UNKNOWN : VMM__DEAD;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Iteration and lookup                                                                        */

typedef struct {
    const vmm__reg *r;
    vmm_alloc_fn fn;
    void *ctx;
    live_cache live;
} alloc_walk;

#define WALK_STOPPED 1

static int alloc_visit(void *ctx, uint64_t slot, const vmm_reg_alloc *rec, int read_rc)
{
    alloc_walk *w = ctx;
    if (read_rc != 0 || rec->state != VMM_REG_LIVE) return 0; /* busy, or a bare reservation */
    vmm_alloc_info info;
    alloc_info_from(&info, slot, rec, live_cached(&w->live, rec->pid, rec->start_time, rec->pidns));
    return w->fn(w->ctx, &info) ? WALK_STOPPED : 0;
}

VMM_PUBLIC vmm_status vmm_foreach_alloc(vmm_registry *reg, vmm_alloc_fn fn, void *ctx)
{
    NEED(reg, "reg is NULL");
    NEED(fn, "fn is NULL");
    alloc_walk *w = malloc(sizeof *w); /* the liveness cache is 8 KiB: keep it off small stacks */
    if (!w) return set_error(VMM_ERR_NOMEM, "vmm_foreach_alloc: out of memory");
    w->r = &reg->r;
    w->fn = fn;
    w->ctx = ctx;
    live_cache_init(&w->live);
    vmm__reg_for_each(&reg->r, alloc_visit, w);
    free(w);
    return VMM_OK;
}

typedef struct {
    const vmm__reg *r;
    vmm_proc_fn fn;
    void *ctx;
    uint32_t want_pid; /* vmm_find_proc: 0 = every process */
    bool found;
    vmm_proc_info *best;
    vmm__reg_wait wait;
} proc_walk;

static int proc_visit(void *ctx, uint32_t index, uint64_t claim)
{
    proc_walk *w = ctx;
    if (w->want_pid && (uint32_t)claim != w->want_pid) return 0;
    vmm_reg_proc p;
    uint32_t pid;
    int alive;
    if (read_claimed_proc(w->r, index, claim, &p, &pid, &alive, &w->wait) != 0) return 0;
    vmm_proc_info info;
    proc_info_from(&info, &p, pid, alive);
    if (w->want_pid) {
        /* A dead process's slot may outlive it until gc, and its pid be reused: prefer the
         * living one. */
        if (!w->found || (w->best->alive != VMM_OWNER_ALIVE && alive == VMM_OWNER_ALIVE)) *w->best = info;
        w->found = true;
        return alive == VMM_OWNER_ALIVE ? WALK_STOPPED : 0;
    }
    return w->fn(w->ctx, &info) ? WALK_STOPPED : 0;
}

VMM_PUBLIC vmm_status vmm_foreach_proc(vmm_registry *reg, vmm_proc_fn fn, void *ctx)
{
    NEED(reg, "reg is NULL");
    NEED(fn, "fn is NULL");
    proc_walk w = {.r = &reg->r, .fn = fn, .ctx = ctx};
    scan_claims(&reg->r, proc_visit, &w);
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_find_proc(vmm_registry *reg, uint32_t pid, vmm_proc_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    NEED(pid != 0, "pid is 0");
    vmm_proc_info best;
    proc_walk w = {.r = &reg->r, .want_pid = pid, .best = &best};
    scan_claims(&reg->r, proc_visit, &w);
    if (!w.found) return set_error(VMM_ERR_NOT_FOUND, "registry %s: no process %u in it", reg->r.name, pid);
    *out = best;
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_find(vmm_registry *reg, uint32_t pid, uint64_t address, vmm_alloc_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    NEED(pid != 0, "pid is 0");
    vmm_reg_alloc rec;
    uint64_t slot = 0;
    int rc = vmm__reg_find(&reg->r, pid, address, &rec, &slot);
    if (rc == -ENOENT)
        return set_error(VMM_ERR_NOT_FOUND, "registry %s: no live allocation of pid %u contains 0x%llx", reg->r.name,
                         pid, (unsigned long long)address);
    if (rc == -EAGAIN)
        return set_error(VMM_ERR_BUSY, "registry %s: the index or record for pid %u at 0x%llx stayed mid-update",
                         reg->r.name, pid, (unsigned long long)address);
    if (rc) return reg_error(rc, NULL, false);
    alloc_info_from(out, slot, &rec, vmm__reg_liveness(rec.pid, rec.start_time, rec.pidns));
    return VMM_OK;
}

vmm_status vmm__client_read_slot(vmm_registry *reg, uint64_t slot, vmm_alloc_info *out)
{
    const vmm__reg *r = &reg->r;
    if (slot >= r->hdr->capacity)
        return set_error(VMM_ERR_INVALID, "slot %llu is beyond the registry's capacity", (unsigned long long)slot);
    /* A record chunk nobody owns may be a hole of the sparse segment: reading it would back it. */
    if (__atomic_load_n(&chunk_table(r)[slot / r->hdr->chunk_records], __ATOMIC_ACQUIRE) == 0)
        return set_error(VMM_ERR_STALE, "allocation was freed (slot %llu is no longer in use)",
                         (unsigned long long)slot);
    vmm_reg_alloc rec;
    int rc = vmm__reg_read_alloc(r, slot, &rec);
    if (rc == -EAGAIN)
        return set_error(VMM_ERR_BUSY, "registry %s: record %llu stayed mid-update", r->name, (unsigned long long)slot);
    if (rc) return reg_error(rc, NULL, false);
    if (rec.state != VMM_REG_LIVE)
        return set_error(VMM_ERR_STALE, "allocation was freed (slot %llu is no longer live)", (unsigned long long)slot);
    alloc_info_from(out, slot, &rec, VMM_OWNER_UNKNOWN);
    return VMM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Check (read-only; mirrors vmm__reg_gc's decisions) and gc                                   */

/* Per proc slot, as gc judges it: its claim generation, and whether it is dead. */
typedef struct {
    const vmm__reg *r;
    uint32_t *gens;
    uint8_t *dead;
    vmm_gc_report *rep;
    vmm__reg_wait wait;
} check_walk;

static int check_proc(void *ctx, uint32_t index, uint64_t claim)
{
    check_walk *w = ctx;
    vmm_reg_proc p;
    uint32_t pid;
    int alive;
    w->gens[index] = (uint32_t)(claim >> 32);
    int rc = read_claimed_proc(w->r, index, claim, &p, &pid, &alive, &w->wait);
    if (rc == -ENOENT) return 0; /* released meanwhile */
    if (rc) alive = pid_exists((uint32_t)claim) ? VMM__UNKNOWN : VMM__DEAD;
    if (alive == VMM__ALIVE) w->rep->procs_alive++;
    if (alive == VMM__UNKNOWN) w->rep->procs_unknown++;
    if (alive == VMM__DEAD) {
        w->rep->procs_dead++;
        w->dead[index] = 1;
    }
    return 0;
}

/* True when the index stays odd (gc died mid-rebuild) and no writer holds its lock. */
static bool index_torn(const vmm__reg *r)
{
    for (int i = 0; i < 200; i++) {
        if (!(__atomic_load_n(&r->hdr->index_seq, __ATOMIC_ACQUIRE) & 1u)) return false;
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&r->hdr->index_lock, __ATOMIC_ACQUIRE) != 0) return false; /* a writer is at it */
    return (__atomic_load_n(&r->hdr->index_seq, __ATOMIC_ACQUIRE) & 1u) != 0;
}

VMM_PUBLIC vmm_status vmm_check(vmm_registry *reg, vmm_gc_report *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    memset(out, 0, sizeof *out);
    const vmm__reg *r = &reg->r;
    char why[200];
    int rc = vmm__reg_validate(r->base, r->map_size, why, sizeof why);
    if (rc) {
        /* why reads "registry: <reason>": put the name in */
        const char *reason = strncmp(why, "registry", 8) == 0 ? why + 8 : why;
        while (*reason == ' ') reason++;
        if (*reason != ':') reason = "";
        return set_error(status_of(rc, rc == -EPROTO && header_too_new(r->hdr)), "registry %s%s", r->name, reason);
    }
    uint32_t cap = r->hdr->proc_capacity;
    check_walk w = {.r = r, .gens = calloc(cap, sizeof(uint32_t)), .dead = calloc(cap, 1), .rep = out};
    if (!w.gens || !w.dead) {
        free(w.gens);
        free(w.dead);
        return set_error(VMM_ERR_NOMEM, "vmm_check: out of memory");
    }
    scan_claims(r, check_proc, &w);

    unsigned busy = 0;
    const uint64_t *ct = chunk_table(r);
    vmm_reg_alloc rec;
    vmm__reg_wait wait = {0};
    for (uint64_t ch = 0; ch < r->hdr->chunk_count; ch++) {
        uint64_t o = __atomic_load_n(&ct[ch], __ATOMIC_ACQUIRE);
        if (o == 0) continue;
        uint64_t t = o & ~VMM_REG_CHUNK_RECLAIMING;
        uint32_t idx = (uint32_t)t - 1, gen = (uint32_t)(t >> 32);
        if (idx >= cap) continue;
        /* As gc decides: the owner slot is dead in this generation, or moved on / was freed. */
        uint64_t claim = __atomic_load_n(
            &((const vmm_reg_proc *)(r->base + r->hdr->proc_off))[idx].claim, __ATOMIC_ACQUIRE);
        bool orphan = (uint32_t)(claim >> 32) != gen || (uint32_t)claim == 0;
        bool dead = w.dead[idx] && w.gens[idx] == gen;
        uint64_t first = ch * VMM_REG_CHUNK_RECORDS;
        if (dead || orphan) {
            const vmm_reg_alloc *recs = (const vmm_reg_alloc *)(r->base + r->hdr->rec_off);
            for (uint64_t s = first; s < first + VMM_REG_CHUNK_RECORDS; s++)
                if (__atomic_load_n(&recs[s].state, __ATOMIC_RELAXED) == VMM_REG_LIVE) out->records_reclaimed++;
            out->chunks_reclaimed++;
            continue;
        }
        for (uint64_t s = first; s < first + VMM_REG_CHUNK_RECORDS; s++)
            if (vmm__reg_read_alloc_within(r, s, &rec, &wait) == -EAGAIN) busy++;
    }
    free(w.gens);
    free(w.dead);
    out->index_rebuilt = index_torn(r);
    if (busy)
        return set_error(VMM_ERR_BUSY,
                         "registry %s: %u record%s of living processes stayed mid-update; retry (a process that "
                         "dies leaves them to gc)",
                         r->name, busy, busy == 1 ? "" : "s");
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_gc(vmm_registry *reg, vmm_gc_report *out)
{
    NEED(reg, "reg is NULL");
    vmm_gc_report z;
    if (!out) out = &z;
    memset(out, 0, sizeof *out);
    if (!reg->r.writable)
        return set_error(VMM_ERR_INVALID, "vmm_gc: registry %s was opened read-only; use vmm_open_writable",
                         reg->r.name);
    vmm__reg_gc_stats st;
    int rc = vmm__reg_gc(&reg->r, &st);
    if (rc) {
        char eb[128];
        return set_error(status_of(rc, false), "registry %s: gc: %s", reg->r.name, strerror_r(-rc, eb, sizeof eb));
    }
    out->procs_alive = st.procs_alive;
    out->procs_dead = st.procs_dead;
    out->procs_unknown = st.procs_unknown;
    out->records_reclaimed = st.records_reclaimed;
    out->chunks_reclaimed = st.chunks_reclaimed;
    out->index_rebuilt = st.index_rebuilt;
    return VMM_OK;
}

/* ========================================================================================== */
/* Import (companion side: obtaining an allocation's memory from its owner) lives in import.c; */
/* it uses only the public functions above and vmm__client_error().                           */
/* ========================================================================================== */
