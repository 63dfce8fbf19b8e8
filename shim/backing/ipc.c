/* Legacy CUDA IPC emulated for shim memory (see ipc.h for the handle layout).
 *
 * get: the handle names the allocation's registry record (slot, generation, alloc id) and its
 * owner (pid, start time).  open: read that record, check that it is still the same live
 * allocation of a live owner, and import it with the import mechanism (shim/import) (the owner's broker hands
 * over the fd, checking this process's credentials and the generation once more).  Opens are
 * counted per (owner, allocation, generation) and share one import; the last close releases it.
 * The pointer is the allocation's own (its chunk's base here + its offset in the chunk): the
 * import mechanism maps each chunk once and counts its imports, so allocations that share a chunk
 * share its mapping and closing one never unmaps another.
 * Every CUDA call made here is bracketed by vmm__enter/vmm__leave so the hooks pass it through. */
#include "backing/ipc.h"

#include "import/import.h"

#include <cuda.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uthash.h>

#include "core/log.h"
#include "core/options.h"
#include "hooks/real.h"
#include "registry/registry.h"
#include "api/vmm_api.h"

/* ------------------------------------------------------------------------------------------ */
/* Process-wide state                                                                          */

typedef struct open_key {
    uint32_t pid, zero; /* zero: no padding inside the hashed key */
    uint64_t start_time, generation;
    uint8_t alloc_id[16];
} open_key;

typedef struct opened {
    open_key key;
    uint64_t ptr;
    unsigned refs;
    CUcontext ctx; /* current when it was opened: synchronised before the last close unmaps */
    vmm_imported *imp;
    /* Two allocations can come back at one pointer: the owner freed the first and placed the
     * second at the same offset of the same chunk.  by_ptr holds the first opened; the others
     * wait on this list, and closes of that pointer count down one entry after another. */
    struct opened *same_ptr;
    UT_hash_handle hh; /* by key */
    UT_hash_handle hp; /* by ptr (only the head of a same_ptr list) */
} opened;

static struct {
    pthread_mutex_t lock;
    opened *by_key, *by_ptr;
    vmm_registry *client;     /* for vmm__import */
    vmm__reg reader;          /* read-only view, when this process has not attached one itself */
    bool reader_open;
    CUcontext primary[64];    /* primary contexts this file retained, per device */
} I = {.lock = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* fork() never finds the tables mid-change (nothing holds the lock across a CUDA call).  The
 * child keeps the entries; like all CUDA state they are of no use there unless it re-execs. */
static void before_fork(void) { pthread_mutex_lock(&I.lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&I.lock); }
static void after_fork_child(void)
{
    pthread_mutex_init(&I.lock, NULL);
    memset(I.primary, 0, sizeof I.primary);
}

static void register_atfork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static bool shim_enabled(void)
{
    (void)vmm__opt_init();
    return vmm__opt_bool(VMM__OPT_ENABLE);
}

/* The registry this process publishes in (or would): the same name the backing opens. */
static const char *registry_name(void)
{
    struct vmm__reg *r = vmm__registry();
    if (r) return r->name;
    const char *n = vmm__opt_str(VMM__OPT_REGISTRY);
    return *n ? n : NULL;
}

/* Lock held.  The registry view to read records with, or NULL (reason in why). */
static const vmm__reg *reader_locked(char *why, size_t len)
{
    struct vmm__reg *r = vmm__registry();
    if (r) return r;
    if (!I.reader_open) {
        if (vmm__reg_open(&I.reader, registry_name(), VMM__REG_READ, 0, NULL, why, len) != 0) return NULL;
        I.reader_open = true;
    }
    return &I.reader;
}

/* Lock held.  The import mechanism's handle on the same registry, for vmm__import. */
static vmm_registry *client_locked(char *why, size_t len)
{
    if (!I.client) vmm__import_keep_nothing();
    if (!I.client && vmm__open(registry_name(), VMM__REG_READ, &I.client) != VMM_OK) {
        snprintf(why, len, "%s", vmm__error_text());
        I.client = NULL;
    }
    return I.client;
}

static void self_identity(uint32_t *pid, uint64_t *start)
{
    struct vmm__reg *r = vmm__registry();
    if (r && r->attached) {
        *pid = r->pid;
        *start = r->start_time;
        return;
    }
    uint64_t ns = 0;
    *pid = (uint32_t)getpid();
    if (vmm__proc_identity(*pid, start, &ns) != 0) *start = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* The driver underneath                                                                       */

typedef CUresult (*ctx_get_fn)(CUcontext *);
typedef CUresult (*ctx_set_fn)(CUcontext);
typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*sync_fn)(void);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef int (*get_device_fn)(int *);

#define DRIVER_FN(var, type, name)                                                                \
    type var;                                                                                     \
    do {                                                                                          \
        void *p_ = vmm__real_driver(name);                                                        \
        memcpy(&var, &p_, sizeof p_);                                                             \
    } while (0)

/* Make sure the calling thread has a context: when it has none, bind the primary context of
 * the runtime's current device (device 0 without a runtime), as the runtime itself would.
 * Returns the current context, or NULL. */
static CUcontext bind_context(void)
{
    DRIVER_FN(get_current, ctx_get_fn, "cuCtxGetCurrent");
    DRIVER_FN(set_current, ctx_set_fn, "cuCtxSetCurrent");
    DRIVER_FN(init, init_fn, "cuInit");
    DRIVER_FN(retain, retain_fn, "cuDevicePrimaryCtxRetain");
    if (!get_current || !set_current || !init || !retain) return NULL;
    CUcontext ctx = NULL;
    vmm__enter();
    if (get_current(&ctx) == CUDA_ERROR_NOT_INITIALIZED && init(0) == CUDA_SUCCESS) get_current(&ctx);
    if (!ctx) {
        int dev = 0;
        get_device_fn get_device;
        void *sym = vmm__real_runtime("cudaGetDevice", NULL);
        memcpy(&get_device, &sym, sizeof sym);
        if (get_device && get_device(&dev) != 0) dev = 0;
        if (dev >= 0 && dev < (int)(sizeof I.primary / sizeof I.primary[0])) {
            pthread_mutex_lock(&I.lock);
            ctx = I.primary[dev];
            pthread_mutex_unlock(&I.lock);
            CUcontext fresh = NULL;
            if (!ctx && retain(&fresh, (CUdevice)dev) == CUDA_SUCCESS) { /* no driver call under the lock */
                pthread_mutex_lock(&I.lock);
                if (!I.primary[dev]) I.primary[dev] = fresh; /* a racing retain is one harmless extra reference */
                ctx = I.primary[dev];
                pthread_mutex_unlock(&I.lock);
            }
            if (ctx && set_current(ctx) != CUDA_SUCCESS) ctx = NULL;
        }
    }
    vmm__leave();
    return ctx;
}

/* Wait for the work of ctx, as the last close must before it unmaps the memory. */
static void sync_context(CUcontext ctx)
{
    DRIVER_FN(get_current, ctx_get_fn, "cuCtxGetCurrent");
    DRIVER_FN(set_current, ctx_set_fn, "cuCtxSetCurrent");
    DRIVER_FN(sync, sync_fn, "cuCtxSynchronize");
    if (!get_current || !set_current || !sync || !ctx) return;
    vmm__enter();
    CUcontext prev = NULL;
    get_current(&prev);
    if (prev == ctx || set_current(ctx) == CUDA_SUCCESS) {
        sync();
        if (prev != ctx) set_current(prev);
    }
    vmm__leave();
}

/* ------------------------------------------------------------------------------------------ */
/* The API                                                                                     */

vmm__result vmm__ipc_get_handle(uint64_t ptr, unsigned char handle[64])
{
    /* An interior pointer names the allocation around it, as a native handle does: opening it
     * returns that allocation's base, never its chunk's. */
    vmm__alloc_ref ref;
    memset(&ref, 0, sizeof ref);
    if (!vmm__lookup(ptr, &ref)) return VMM__PASS;
    struct vmm__reg *r = vmm__registry();
    if (!r || !r->attached || ref.slot == UINT32_MAX) return VMM__PASS; /* unpublished: nothing to name */
    vmm__ipc_encode(r->pid, r->start_time, ref.slot, ref.generation, ref.alloc_id, handle);
    return VMM__DONE;
}

static vmm__result refuse(const vmm__ipc_handle *h, const char *why)
{
    vmm__debug("IPC handle of pid %u (slot %llu, generation %llu) refused: %s", h->pid, (unsigned long long)h->slot,
               (unsigned long long)h->generation, why);
    return VMM__INVALID;
}

/* Lock held. */
static opened *find_key_locked(const open_key *k)
{
    opened *e = NULL;
    HASH_FIND(hh, I.by_key, k, sizeof *k, e);
    return e;
}

static void release_import(vmm_imported *imp)
{
    vmm__enter();
    vmm_status st = vmm__import_release(imp);
    vmm__leave();
    if (st != VMM_OK) vmm__debug("releasing an IPC mapping: %s", vmm__error_text());
}

vmm__result vmm__ipc_open(const unsigned char handle[64], uint64_t *ptr)
{
    vmm__ipc_handle h;
    vmm__result d = vmm__ipc_decode(handle, &h);
    if (d == VMM__PASS || !shim_enabled()) return VMM__PASS; /* disabled: untouched, the real one decides */
    if (d == VMM__INVALID) {
        vmm__debug("IPC handle refused: damaged (check word or reserved fields wrong)");
        return VMM__INVALID;
    }
    pthread_once(&atfork_once, register_atfork);

    open_key k;
    memset(&k, 0, sizeof k);
    k.pid = h.pid;
    k.start_time = h.start_time;
    k.generation = h.generation;
    memcpy(k.alloc_id, h.alloc_id, sizeof k.alloc_id);

    pthread_mutex_lock(&I.lock);
    opened *e = find_key_locked(&k);
    if (e) { /* opened before: the same mapping, one more reference */
        e->refs++;
        *ptr = e->ptr;
        pthread_mutex_unlock(&I.lock);
        return VMM__DONE;
    }
    pthread_mutex_unlock(&I.lock);

    uint32_t self_pid;
    uint64_t self_start;
    self_identity(&self_pid, &self_start);
    if (h.pid == self_pid && h.start_time == self_start) return refuse(&h, "made by this very process");

    /* The record must still be this allocation, live, of a live owner. */
    char why[256] = "";
    vmm_reg_alloc rec;
    int rc = -EAGAIN;
    pthread_mutex_lock(&I.lock);
    const vmm__reg *reader = reader_locked(why, sizeof why);
    for (int tries = 0; reader && rc == -EAGAIN && tries < 100; tries++) {
        rc = vmm__reg_read_alloc(reader, h.slot, &rec);
        if (rc == -EAGAIN) sched_yield();
    }
    vmm_registry *client = reader ? client_locked(why, sizeof why) : NULL;
    pthread_mutex_unlock(&I.lock);
    if (!reader || !client) return refuse(&h, why);
    if (rc != 0) return refuse(&h, rc == -EAGAIN ? "its record is busy" : "no such record");
    if (rec.state != VMM_REG_LIVE || rec.pid != h.pid || rec.start_time != h.start_time ||
        rec.generation != h.generation || memcmp(rec.alloc_id, h.alloc_id, sizeof rec.alloc_id) != 0)
        return refuse(&h, "stale: the allocation was freed");
    if (rec.flags & VMM_REG_F_NOT_EXPORTABLE) return refuse(&h, "the allocation is not exportable");
    if (vmm__reg_liveness(rec.pid, rec.start_time, rec.pidns) == VMM__DEAD) return refuse(&h, "its owner has exited");

    vmm_alloc_info info;
    memset(&info, 0, sizeof info);
    memcpy(info.alloc_id, rec.alloc_id, sizeof info.alloc_id);
    info.generation = rec.generation;
    info.slot = h.slot;
    info.pid = rec.pid;
    info.owner_alive = VMM_OWNER_ALIVE;
    info.owner_start_time = rec.start_time;
    info.owner_pidns = rec.pidns;
    info.device = rec.device;
    memcpy(info.device_uuid, rec.device_uuid, sizeof info.device_uuid);
    info.address = rec.address;
    info.requested_size = rec.requested_size;
    info.mapped_size = rec.mapped_size;
    info.stream = rec.stream;
    info.created_ns = rec.created_ns;
    info.api = rec.api;
    /* the registry's VMM_HANDLE_* bits are the public VMM_KIND_* bits */
    info.handle_kinds = rec.handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD | VMM_KIND_FABRIC);
    info.exported_fd = rec.exported_fd;
    info.chunk_id = rec.chunk_id;
    info.chunk_offset = rec.chunk_offset;
    info.extent = rec.extent;
    info.flags = rec.flags & (VMM_ALLOC_NOT_EXPORTABLE | VMM_ALLOC_SHARED_CHUNK);

    CUcontext ctx = bind_context();
    vmm_imported *imp = NULL;
    vmm__enter();
    vmm_status st = vmm__import(client, &info, &imp);
    vmm__leave();
    if (st != VMM_OK) return refuse(&h, vmm__error_text());

    pthread_mutex_lock(&I.lock);
    e = find_key_locked(&k);
    if (e) { /* another thread opened it meanwhile: share its mapping, drop ours */
        e->refs++;
        *ptr = e->ptr;
        pthread_mutex_unlock(&I.lock);
        release_import(imp);
        return VMM__DONE;
    }
    e = calloc(1, sizeof *e);
    if (!e) {
        pthread_mutex_unlock(&I.lock);
        release_import(imp);
        return refuse(&h, "out of memory");
    }
    e->key = k;
    e->ptr = vmm__import_ptr(imp);
    e->refs = 1;
    e->ctx = ctx;
    e->imp = imp;
    HASH_ADD(hh, I.by_key, key, sizeof e->key, e);
    opened *head = NULL;
    HASH_FIND(hp, I.by_ptr, &e->ptr, sizeof e->ptr, head);
    if (head) {
        e->same_ptr = head->same_ptr;
        head->same_ptr = e;
    } else {
        HASH_ADD(hp, I.by_ptr, ptr, sizeof e->ptr, e);
    }
    *ptr = e->ptr;
    pthread_mutex_unlock(&I.lock);
    return VMM__DONE;
}

vmm__result vmm__ipc_close(uint64_t ptr)
{
    opened *e = NULL;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&I.lock);
    HASH_FIND(hp, I.by_ptr, &ptr, sizeof ptr, e);
    if (!e) {
        pthread_mutex_unlock(&I.lock);
        return VMM__PASS;
    }
    if (--e->refs > 0) {
        pthread_mutex_unlock(&I.lock);
        return VMM__DONE;
    }
    HASH_DELETE(hh, I.by_key, e);
    HASH_DELETE(hp, I.by_ptr, e);
    if (e->same_ptr) HASH_ADD(hp, I.by_ptr, ptr, sizeof e->same_ptr->ptr, e->same_ptr);
    pthread_mutex_unlock(&I.lock);
    sync_context(e->ctx);
    release_import(e->imp);
    free(e);
    return VMM__DONE;
}
