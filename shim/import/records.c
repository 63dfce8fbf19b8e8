/* The registry-reading mechanism shared by the client library and the shim's emulated legacy
 * IPC: the per-thread error line, record conversion (registry layout to vmm_alloc_info and
 * vmm_proc_info), owner liveness, the process-table scan, iteration and lookup.  The public
 * functions over it (argument checks, vmm_last_error, vmm_strerror) are tools/client/client.c.
 *
 * Rules: never print, never exit, link no CUDA library.  Every failure leaves a one-line reason
 * in a thread-local buffer (read through vmm__error_text).  Reads never touch pages of the
 * shared segment that no writer has backed (a read fault on a tmpfs hole would allocate it):
 * the sparse process table is scanned with pread, not through the mapping. */
#include "api/vmm_api.h"
#include "import/import.h"

#include "registry/keep.h"
#include "registry/registry.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
                   SAME(VMM_ALLOC_MULTI_HANDLE, VMM_REG_F_MULTI_HANDLE) && SAME(VMM_ALLOC_KEPT, VMM_REG_F_KEPT),
               "alloc flags match the registry's");
_Static_assert(SAME(VMM_KIND_BROKER, VMM_HANDLE_BROKER) && SAME(VMM_KIND_PIDFD, VMM_HANDLE_PIDFD) &&
                   SAME(VMM_KIND_FABRIC, VMM_HANDLE_FABRIC),
               "vmm_alloc_info.handle_kinds mirrors vmm_reg_alloc.handle_kinds");
_Static_assert(SAME(VMM_OWNER_DEAD, VMM__DEAD) && SAME(VMM_OWNER_ALIVE, VMM__ALIVE) &&
                   SAME(VMM_OWNER_UNKNOWN, VMM__UNKNOWN) && SAME(VMM_OWNER_KEPT, VMM__KEPT),
               "owner liveness values");
_Static_assert(sizeof(((vmm_registry_info *)0)->name) == sizeof(((vmm__reg *)0)->name), "registry name size");
_Static_assert(sizeof(((vmm_proc_info *)0)->broker_path) == sizeof(((vmm_reg_proc *)0)->broker_path),
               "broker_path size");
_Static_assert(sizeof(((vmm_proc_info *)0)->cmdline) == sizeof(((vmm_reg_proc *)0)->cmdline), "cmdline size");
_Static_assert(sizeof(((vmm_alloc_info *)0)->tag) == sizeof(((vmm_reg_alloc *)0)->tag), "tag size");
_Static_assert(sizeof(((vmm_alloc_info *)0)->frames) == sizeof(((vmm_reg_alloc *)0)->frames), "frames size");

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */

const char *vmm__status_text(vmm_status status)
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
    case VMM_ERR_NO_SHIM: return "not running under the shim (libvmmshim.so)";
    case VMM_ERR_PAUSED: return "the owner paused this memory (vmm_pause)";
    case VMM_ERR_STATE: return "not in the state the call needs (paused already, or not paused)";
    }
    return "unknown status";
}

#define ERR_MAX 512
static _Thread_local char last_error[ERR_MAX];

static vmm_status vset_error(vmm_status st, const char *fmt, va_list ap)
{
    char buf[ERR_MAX];
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    if (n < 0) snprintf(buf, sizeof buf, "%s", vmm__status_text(st));
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

/* For the mechanism's other files and the client library (import.h): the same setter, hidden. */
vmm_status vmm__error(vmm_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vset_error(st, fmt, ap);
    va_end(ap);
    return st;
}
/* Map a registry error code (-errno style) to a status. */
const char *vmm__error_text(void) { return last_error; }

vmm_status vmm__status_of(int rc, bool too_new)
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
vmm_status vmm__reg_error(int rc, const char *msg, bool too_new)
{
    vmm_status st = vmm__status_of(rc, too_new);
    if (msg && *msg) return set_error(st, "%s", msg);
    char eb[128];
    return set_error(st, "registry: %s", strerror_r(-rc, eb, sizeof eb));
}

/* ------------------------------------------------------------------------------------------ */
/* Segments of a newer layout                                                                  */

/* A -EPROTO from the registry means "not a segment this reader can read": tell a segment that
 * is a registry of a newer layout (magic right, compat_version beyond ours) from a corrupt one. */
bool vmm__header_too_new(const vmm_reg_header *h)
{
    return __atomic_load_n(&h->magic, __ATOMIC_RELAXED) == VMM_REG_MAGIC &&
           __atomic_load_n(&h->compat_version, __ATOMIC_RELAXED) > VMM_REG_VERSION;
}

/* ------------------------------------------------------------------------------------------ */
/* Liveness, cached per owner within one call                                                  */

#define LIVE_CACHE 256 /* direct-mapped; records come in per-owner chunks, so misses are rare */

typedef struct {
    uint64_t start_time, pidns;
    uint32_t pid;
    int alive; /* -1: empty */
    int kept;  /* a dead owner's: -1 not judged yet, else whether a living keeper keeps it */
} live_entry;

typedef struct {
    live_entry e[LIVE_CACHE];
} live_cache;

static void live_cache_init(live_cache *c)
{
    for (size_t i = 0; i < LIVE_CACHE; i++) c->e[i].alive = -1;
}

/* A record's owner as a reader sees it: a dead owner's record that a living keeper holds is
 * kept (layout.h KEEP), its memory served by the keeper. */
static int live_cached(live_cache *c, const vmm__reg *r, const vmm_reg_alloc *a)
{
    live_entry *e = &c->e[(vmm_reg_hash(a->pid, a->start_time ^ a->pidns) >> 7) % LIVE_CACHE];
    if (e->alive < 0 || e->pid != a->pid || e->start_time != a->start_time || e->pidns != a->pidns) {
        e->pid = a->pid;
        e->start_time = a->start_time;
        e->pidns = a->pidns;
        e->alive = vmm__reg_liveness(a->pid, a->start_time, a->pidns);
        e->kept = -1;
    }
    if (e->alive != VMM__DEAD || !(a->flags & VMM_REG_F_KEPT)) return e->alive;
    if (e->kept < 0) e->kept = vmm__keep_held(r, a->pid, a->start_time);
    return e->kept ? VMM__KEPT : VMM__DEAD;
}

/* The owner's state given its process's liveness: a kept record of a dead owner is served by its
 * keeper (layout.h KEEP). */
static int owner_state(const vmm__reg *r, const vmm_reg_alloc *a, int liveness)
{
    if (liveness == VMM__DEAD && (a->flags & VMM_REG_F_KEPT) && vmm__keep_held(r, a->pid, a->start_time)) return VMM__KEPT;
    return liveness;
}

static int record_owner(const vmm__reg *r, const vmm_reg_alloc *a)
{
    return owner_state(r, a, vmm__reg_liveness(a->pid, a->start_time, a->pidns));
}

bool vmm__kept_now(vmm_registry *reg, const vmm_alloc_info *a)
{
    vmm_reg_alloc rec;
    if (a->slot >= reg->r.hdr->capacity ||
        __atomic_load_n(&vmm__chunk_table(&reg->r)[a->slot / reg->r.hdr->chunk_records], __ATOMIC_ACQUIRE) == 0 ||
        vmm__reg_read_alloc(&reg->r, a->slot, &rec) != 0)
        return false;
    return rec.state == VMM_REG_LIVE && rec.generation == a->generation && rec.pid == a->pid &&
           rec.start_time == a->owner_start_time && record_owner(&reg->r, &rec) == VMM__KEPT;
}

bool vmm__pid_exists(uint32_t pid)
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
    o->flags = a->flags & (VMM_REG_F_NOT_EXPORTABLE | VMM_REG_F_SHARED_CHUNK | VMM_REG_F_MULTI_HANDLE | VMM_REG_F_KEPT |
                           VMM_REG_F_PAUSED);
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
    o->unpublished = p->unpublished; /* 0 in an owner of layout 3 to 5: reserved bytes there */
}

/* ------------------------------------------------------------------------------------------ */
/* Process table: claimed slots found with pread (the table is sparse; see the top)            */

#define SCAN_BATCH 32 /* proc records per pread: 16 KiB on the stack */

/* The end of the stretch of the table, from `from`, that holds data (or the table's end when the
 * file cannot say), and where that stretch begins in *data; 0 when nothing from `from` on is backed.
 * A claimed slot is written, so its page is backed: the holes (4096 slots, 2 MiB, of which a
 * machine uses a few pages) need no reading, which a cold reader otherwise pays ~0.3 ms for. */
static uint64_t backed_stretch(int fd, uint64_t from, uint64_t end, uint64_t *data)
{
    off_t d = lseek(fd, (off_t)from, SEEK_DATA);
    if (d < 0) {
        if (errno == ENXIO) return 0; /* only holes past `from` */
        *data = from;                 /* no SEEK_DATA here: read it all */
        return end;
    }
    if ((uint64_t)d >= end) return 0;
    off_t h = lseek(fd, d, SEEK_HOLE);
    *data = (uint64_t)d;
    return h < 0 || (uint64_t)h > end ? end : (uint64_t)h;
}

int vmm__scan_claims(const vmm__reg *r, vmm__claim_fn fn, void *ctx)
{
    const vmm_reg_header *h = r->hdr;
    uint32_t cap = h->proc_capacity;
    const uint64_t size = sizeof(vmm_reg_proc), table_end = h->proc_off + (uint64_t)cap * size;
    vmm_reg_proc buf[SCAN_BATCH];
    for (uint32_t i = 0; i < cap;) {
        uint64_t data, stop = backed_stretch(r->fd, h->proc_off + (uint64_t)i * size, table_end, &data);
        if (!stop) break;
        uint32_t first = (uint32_t)((data - h->proc_off) / size), last = (uint32_t)((stop - h->proc_off + size - 1) / size);
        if (first < i) first = i;
        if (last > cap) last = cap;
        for (i = first; i < last;) {
            uint32_t n = last - i < SCAN_BATCH ? last - i : SCAN_BATCH;
            off_t off = (off_t)(h->proc_off + (uint64_t)i * size);
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
                int stop_walk = fn(ctx, i + k, claim);
                if (stop_walk) return stop_walk;
            }
            i += n;
        }
        if (last <= first) i = first + 1; /* a stretch shorter than a record: step past it */
    }
    return 0;
}

/* Read a claimed proc slot.  0 and *pid, *alive filled; -ENOENT when the slot was released (or
 * re-claimed) meanwhile; -EAGAIN when the record stayed mid-write (waiting on wait). */
int vmm__read_claimed_proc(const vmm__reg *r, uint32_t index, uint64_t claim, vmm_reg_proc *p, uint32_t *pid,
                             int *alive, vmm__reg_wait *wait)
{
    int rc = vmm__reg_read_proc_within(r, index, p, wait);
    if (rc) return rc;
    uint32_t cpid = (uint32_t)p->claim;
    if (cpid == 0 || (p->claim >> 32) != (claim >> 32)) return -ENOENT;
    if (p->pid == cpid && p->start_time != 0) {
        *pid = p->pid;
        *alive = vmm__reg_liveness(p->pid, p->start_time, p->pidns);
        if (*alive == VMM__DEAD && p->keeper_pid && vmm__keep_held(r, p->pid, p->start_time)) *alive = VMM__KEPT;
    } else {
        /* claimed but its identity not (yet) written: the claimer died in between, or is there */
        *pid = cpid;
        *alive = vmm__pid_exists(cpid) ? VMM__UNKNOWN : VMM__DEAD;
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
    alloc_info_from(&info, slot, rec, live_cached(&w->live, w->r, rec));
    return w->fn(w->ctx, &info) ? WALK_STOPPED : 0;
}

vmm_status vmm__foreach_alloc(vmm_registry *reg, vmm_alloc_fn fn, void *ctx)
{
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
    uint64_t *paused;  /* per proc slot: the paused records' extents (NULL: none anywhere, or no memory) */
    uint64_t *paused_start; /* the owner's start_time those records name */
} proc_walk;

/* The paused bytes of each owner are no field of its record (layout.h, PAUSED): one walk over the
 * records sums them by proc slot. */
typedef struct {
    uint64_t *bytes, *start;
    uint32_t cap;
    bool any;
} paused_sum;

static int paused_visit(void *ctx, uint64_t slot, const vmm_reg_alloc *rec, int read_rc)
{
    (void)slot;
    paused_sum *s = ctx;
    if (read_rc != 0 || rec->state != VMM_REG_LIVE || !(rec->flags & VMM_REG_F_PAUSED) || rec->proc_index >= s->cap) return 0;
    if (s->bytes[rec->proc_index] && s->start[rec->proc_index] != rec->start_time) return 0; /* an earlier owner's */
    s->start[rec->proc_index] = rec->start_time;
    s->bytes[rec->proc_index] += rec->extent;
    s->any = true;
    return 0;
}

static void paused_prepare(proc_walk *w)
{
    uint32_t cap = w->r->hdr->proc_capacity;
    paused_sum s = {.bytes = calloc(cap ? cap : 1, sizeof *s.bytes), .start = calloc(cap ? cap : 1, sizeof *s.start),
                    .cap = cap};
    if (s.bytes && s.start) vmm__reg_for_each(w->r, paused_visit, &s);
    if (!s.any) {
        free(s.bytes);
        free(s.start);
        s.bytes = s.start = NULL;
    }
    w->paused = s.bytes;
    w->paused_start = s.start;
}

static void paused_done(proc_walk *w)
{
    free(w->paused);
    free(w->paused_start);
}

static int proc_visit(void *ctx, uint32_t index, uint64_t claim)
{
    proc_walk *w = ctx;
    if (w->want_pid && (uint32_t)claim != w->want_pid) return 0;
    vmm_reg_proc p;
    uint32_t pid;
    int alive;
    if (vmm__read_claimed_proc(w->r, index, claim, &p, &pid, &alive, &w->wait) != 0) return 0;
    vmm_proc_info info;
    proc_info_from(&info, &p, pid, alive);
    if (w->paused && w->paused_start[index] == p.start_time) info.bytes_paused = w->paused[index];
    if (w->want_pid) {
        /* A dead process's slot may outlive it until gc, and its pid be reused: prefer the
         * living one. */
        if (!w->found || (w->best->alive != VMM_OWNER_ALIVE && alive == VMM_OWNER_ALIVE)) *w->best = info;
        w->found = true;
        return alive == VMM_OWNER_ALIVE ? WALK_STOPPED : 0;
    }
    return w->fn(w->ctx, &info) ? WALK_STOPPED : 0;
}

vmm_status vmm__foreach_proc(vmm_registry *reg, vmm_proc_fn fn, void *ctx)
{
    proc_walk w = {.r = &reg->r, .fn = fn, .ctx = ctx};
    paused_prepare(&w);
    vmm__scan_claims(&reg->r, proc_visit, &w);
    paused_done(&w);
    return VMM_OK;
}

static vmm_status find_proc(vmm_registry *reg, uint32_t pid, vmm_proc_info *out, bool with_paused)
{
    vmm_proc_info best;
    proc_walk w = {.r = &reg->r, .want_pid = pid, .best = &best};
    if (with_paused) paused_prepare(&w);
    vmm__scan_claims(&reg->r, proc_visit, &w);
    paused_done(&w);
    if (!w.found) return set_error(VMM_ERR_NOT_FOUND, "registry %s: no process %u in it", reg->r.name, pid);
    *out = best;
    return VMM_OK;
}

vmm_status vmm__find_proc(vmm_registry *reg, uint32_t pid, vmm_proc_info *out)
{
    return find_proc(reg, pid, out, true);
}

vmm_status vmm__find_proc_identity(vmm_registry *reg, uint32_t pid, vmm_proc_info *out)
{
    return find_proc(reg, pid, out, false);
}

/* The live record of pid holding address, or the error a caller reports. */
static vmm_status find_record(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t size_hint, uint64_t *levels,
                              vmm_reg_alloc *rec, uint64_t *slot)
{
    int rc = vmm__reg_find_near(&reg->r, pid, address, size_hint, levels, rec, slot);
    if (rc == -ENOENT)
        return set_error(VMM_ERR_NOT_FOUND, "registry %s: no live allocation of pid %u contains 0x%llx", reg->r.name,
                         pid, (unsigned long long)address);
    if (rc == -EAGAIN)
        return set_error(VMM_ERR_BUSY, "registry %s: the index or record for pid %u at 0x%llx stayed mid-update",
                         reg->r.name, pid, (unsigned long long)address);
    return rc ? vmm__reg_error(rc, NULL, false) : VMM_OK;
}

vmm_status vmm__find(vmm_registry *reg, uint32_t pid, uint64_t address, vmm_alloc_info *out)
{
    vmm_reg_alloc rec;
    uint64_t slot = 0;
    vmm_status st = find_record(reg, pid, address, 0, NULL, &rec, &slot);
    if (st == VMM_OK) alloc_info_from(out, slot, &rec, record_owner(&reg->r, &rec));
    return st;
}

vmm_status vmm__find_cached(vmm_registry *reg, uint32_t pid, uint64_t address, vmm_alloc_info *out,
                            vmm__liveness_cache *cache)
{
    return vmm__find_cached_near(reg, pid, address, 0, out, cache);
}

vmm_status vmm__find_cached_near(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t size_hint,
                                 vmm_alloc_info *out, vmm__liveness_cache *cache)
{
    vmm_reg_alloc rec;
    uint64_t slot = 0;
    vmm_status st = find_record(reg, pid, address, size_hint, &cache->levels, &rec, &slot);
    if (st != VMM_OK) return st;
    if (!cache->valid || cache->pid != rec.pid || cache->start_time != rec.start_time || cache->pidns != rec.pidns) {
        cache->alive = vmm__reg_liveness(rec.pid, rec.start_time, rec.pidns);
        cache->pid = rec.pid;
        cache->start_time = rec.start_time;
        cache->pidns = rec.pidns;
        cache->valid = true;
    }
    alloc_info_from(out, slot, &rec, owner_state(&reg->r, &rec, cache->alive));
    return VMM_OK;
}

vmm_status vmm__read_slot(vmm_registry *reg, uint64_t slot, vmm_alloc_info *out)
{
    const vmm__reg *r = &reg->r;
    if (slot >= r->hdr->capacity)
        return set_error(VMM_ERR_INVALID, "slot %llu is beyond the registry's capacity", (unsigned long long)slot);
    /* A record chunk nobody owns may be a hole of the sparse segment: reading it would back it. */
    if (__atomic_load_n(&vmm__chunk_table(r)[slot / r->hdr->chunk_records], __ATOMIC_ACQUIRE) == 0)
        return set_error(VMM_ERR_STALE, "allocation was freed (slot %llu is no longer in use)",
                         (unsigned long long)slot);
    vmm_reg_alloc rec;
    int rc = vmm__reg_read_alloc(r, slot, &rec);
    if (rc == -EAGAIN)
        return set_error(VMM_ERR_BUSY, "registry %s: record %llu stayed mid-update", r->name, (unsigned long long)slot);
    if (rc) return vmm__reg_error(rc, NULL, false);
    if (rec.state != VMM_REG_LIVE)
        return set_error(VMM_ERR_STALE, "allocation was freed (slot %llu is no longer live)", (unsigned long long)slot);
    alloc_info_from(out, slot, &rec, VMM_OWNER_UNKNOWN);
    return VMM_OK;
}

/* The registry still shows this very allocation, live, at its place in its chunk. */
vmm_status vmm__paused(const vmm_alloc_info *a)
{
    return set_error(VMM_ERR_PAUSED, "pid %u paused the memory at 0x%llx (vmm_pause): import it once its owner resumes it",
                     a->pid, (unsigned long long)a->address);
}

vmm_status vmm__record_unchanged(vmm_registry *reg, const vmm_alloc_info *a)
{
    vmm_alloc_info now;
    vmm_status st = vmm__read_slot(reg, a->slot, &now);
    bool same = st == VMM_OK && now.generation == a->generation &&
                memcmp(now.alloc_id, a->alloc_id, sizeof now.alloc_id) == 0 && now.pid == a->pid &&
                now.owner_start_time == a->owner_start_time;
    if (st == VMM_ERR_STALE || (st == VMM_OK && !same))
        return set_error(VMM_ERR_STALE, "allocation was freed (generation %llu is gone)",
                         (unsigned long long)a->generation);
    if (st != VMM_OK) return st;
    if (now.flags & VMM_ALLOC_PAUSED) return vmm__paused(a);
    if (now.chunk_id != a->chunk_id || now.chunk_offset != a->chunk_offset || now.mapped_size != a->mapped_size)
        return set_error(VMM_ERR_STALE, "the registry places this allocation at offset %llu of chunk %llu (%llu bytes), "
                                        "not as described",
                         (unsigned long long)now.chunk_offset, (unsigned long long)now.chunk_id,
                         (unsigned long long)now.mapped_size);
    return VMM_OK;
}
