/* The program's own VMM memory (adopt.h says what each call does).  One record per cuMemMap'd
 * range: PyTorch maps its 2 MiB or 20 MiB pages one by one and unmaps them one by one, so a
 * mapping is the unit that appears and goes; a companion reading a tensor across pages imports a
 * range of records (vmm_import_range).  The broker exports the handle mapped at a range through
 * cuMemRetainAllocationHandle, so a program that released its handle after mapping it (the usual
 * VMM idiom) stays importable. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uthash.h>

#include "backing/adopt_int.h"
#include "backing/sleep.h"
#include "broker/protocol.h"
#include "core/log.h"
#include "core/options.h"
#include "hooks/real.h"

typedef vmm__adopt_handle handle_entry;
typedef vmm__adopt_range range;

vmm__adopt_state vmm__A = {.lock = PTHREAD_MUTEX_INITIALIZER};
#define A vmm__A

static int opt_once(int *slot, int v_if_unset)
{
    int v = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (v < 0) {
        v = v_if_unset;
        __atomic_store_n(slot, v, __ATOMIC_RELEASE);
    }
    return v;
}

static int adopting(void)
{
    static int on = -1;
    if (__atomic_load_n(&on, __ATOMIC_ACQUIRE) >= 0) return on;
    return opt_once(&on, vmm__opt_bool(VMM__OPT_ADOPT) && vmm__opt_bool(VMM__OPT_ENABLE));
}

int vmm__adopt_on(void) { return adopting(); }

int vmm__adopt_sleeping(void)
{
    static int on = -1;
    if (__atomic_load_n(&on, __ATOMIC_ACQUIRE) >= 0) return on;
    return opt_once(&on, adopting() && vmm__opt_bool(VMM__OPT_SLEEP_ADOPTED));
}

static int export_range(uint64_t slot, uint64_t generation, const uint8_t id[16], int *fd, uint64_t *mapped,
                        uint32_t *device);

#define REAL(field, name) {offsetof(vmm__adopt_state, field), name}
static void resolve_driver(void)
{
    /* the sleep set only where a stand-in may be made: without one nothing else is needed */
    static const struct {
        size_t at;
        const char *name;
    } need[] = {REAL(RetainAllocationHandle, "cuMemRetainAllocationHandle"),
                REAL(ExportToShareableHandle, "cuMemExportToShareableHandle"), REAL(Release, "cuMemRelease"),
                REAL(Create, "cuMemCreate"), REAL(Map, "cuMemMap"), REAL(Unmap, "cuMemUnmap"),
                REAL(SetAccess, "cuMemSetAccess"), REAL(GetAccess, "cuMemGetAccess"),
                REAL(CtxGetCurrent, "cuCtxGetCurrent"), REAL(CtxPushCurrent, "cuCtxPushCurrent_v2"),
                REAL(CtxPopCurrent, "cuCtxPopCurrent_v2"), REAL(DeviceGetCount, "cuDeviceGetCount")};
    size_t n = vmm__adopt_sleeping() ? sizeof need / sizeof need[0] : 3;
    for (size_t i = 0; i < n; i++)
        if (!vmm__real_driver(need[i].name)) return;
    for (size_t i = 0; i < n; i++) {
        void *p = vmm__real_driver(need[i].name);
        memcpy((char *)&A + need[i].at, &p, sizeof p); /* ISO C has no object-to-function cast */
    }
    vmm__export_adopted_by(export_range); /* before any range is published */
}
#undef REAL

int vmm__adopt_load(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, resolve_driver);
    return A.Release != NULL;
}

static void range_free(range *r)
{
    vmm__sleep_kept_free(r->kept); /* paused, unmapped by the program: its copy goes */
    free(r);
}

static void entry_free(handle_entry *e)
{
    if (e->broker_fd >= 0) {
        close(e->broker_fd);
        vmm__backing_kept_adopted(-1);
    }
    free(e);
}

/* Whether code at caller lies in a communication library (by its file's name).  NCCL's own
 * memory must stay through a pause of everything, or the program's next collective faults: only
 * the memory NCCL exports to its peers would stay otherwise (vmm__adopt_shared). */
static int comm_library(const void *caller)
{
    Dl_info info;
    if (!caller || !dladdr(caller, &info) || !info.dli_fname) return 0;
    const char *base = strrchr(info.dli_fname, '/');
    base = base ? base + 1 : info.dli_fname;
    return !strncmp(base, "libnccl", 7) || !strncmp(base, "librccl", 7) || !strncmp(base, "libnvshmem", 10);
}

CUresult vmm__adopt_create(vmm__mem_create_fn real, CUmemGenericAllocationHandle *handle, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags, const void *caller)
{
    CUresult rc;
    int eligible = handle && prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
                   prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && adopting() &&
                   vmm__device_exportable(prop->location.id) && vmm__adopt_load();
    if (!eligible) {
        vmm__enter();
        rc = real(handle, size, prop, flags);
        vmm__leave();
        return rc;
    }
    CUmemAllocationProp with_fd = *prop;
    with_fd.requestedHandleTypes = (CUmemAllocationHandleType)(with_fd.requestedHandleTypes | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    int exportable = 1;
    vmm__enter();
    rc = real(handle, size, &with_fd, flags);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && vmm__keep_let_go()) rc = real(handle, size, &with_fd, flags);
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_OUT_OF_MEMORY && with_fd.requestedHandleTypes != prop->requestedHandleTypes) {
        CUresult first = rc;
        rc = real(handle, size, prop, flags);
        if (rc == CUDA_SUCCESS) {
            exportable = 0;
            vmm__log(VMM__LOG_WARNING, "cuMemCreate refused a POSIX fd handle type (CUDA error %d); the program's own "
                     "handles are published as not exportable", (int)first);
        }
    }
    vmm__leave();
    if (rc != CUDA_SUCCESS) return rc;
    handle_entry *e = calloc(1, sizeof *e);
    if (!e) return rc; /* not published: the program's call still succeeded */
    e->handle = e->real = *handle;
    e->size = size;
    e->dev = prop->location.id;
    e->exportable = exportable;
    e->asked_types = (unsigned)prop->requestedHandleTypes;
    e->chunk_id = vmm__new_chunk_id();
    e->broker_fd = -1;
    e->refs = 1;
    e->tag = vmm__tag_current();
    e->prop = exportable ? with_fd : *prop;
    /* a tile pool's handle goes to cuMemMapArrayAsync, which the shim does not translate */
    e->stand_in = vmm__adopt_sleeping() && !(prop->allocFlags.usage & CU_MEM_CREATE_USAGE_TILE_POOL) &&
                  !comm_library(caller);
    if (e->stand_in && vmm__adopt_is_stand_in(*handle)) {
        static int said;
        if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
            vmm__log(VMM__LOG_WARNING, "the driver made a handle that looks like the shim's stand-ins (0x%llx); such "
                     "memory stays on the device through vmm_pause", (unsigned long long)*handle);
        e->stand_in = 0;
    }
    if (e->stand_in && A.CtxGetCurrent(&e->ctx) != CUDA_SUCCESS) e->ctx = NULL;
    pthread_mutex_lock(&A.lock);
    handle_entry *old = NULL;
    if (e->stand_in) {
        HASH_FIND(hr, A.by_real, &e->real, sizeof e->real, old);
        if (old) HASH_DELETE(hr, A.by_real, old); /* cannot happen: the shim sees every release of its own */
        e->handle = VMM__STAND_IN_TOP << 48 | ++A.stand_ins;
        HASH_ADD(hr, A.by_real, real, sizeof e->real, e);
        *handle = e->handle; /* the program holds the stand-in from here on */
    } else {
        HASH_FIND(hh, A.handles, &e->handle, sizeof e->handle, old);
        if (old) { /* a handle value the driver reused after a release we did not see */
            HASH_DELETE(hh, A.handles, old);
            if (!old->n_maps) entry_free(old);
        }
    }
    HASH_ADD(hh, A.handles, handle, sizeof e->handle, e);
    pthread_mutex_unlock(&A.lock);
    return rc;
}

void vmm__adopt_props(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
    if (!prop) return;
    pthread_mutex_lock(&A.lock);
    handle_entry *e = NULL;
    HASH_FIND(hh, A.handles, &handle, sizeof handle, e);
    if (e) prop->requestedHandleTypes = (CUmemAllocationHandleType)e->asked_types;
    pthread_mutex_unlock(&A.lock);
}

static void unlink_range(range *r);

void vmm__adopt_mapped(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle)
{
    if (!__atomic_load_n(&A.handles, __ATOMIC_ACQUIRE)) return; /* nothing adopted: one load */
    vmm__frames f;
    vmm__frames_capture(&f); /* before the lock: it takes the loader lock */
    pthread_mutex_lock(&A.lock);
    handle_entry *e = NULL;
    HASH_FIND(hh, A.handles, &handle, sizeof handle, e);
    range *r = e ? calloc(1, sizeof *r) : NULL;
    if (r) {
        r->addr = (uint64_t)ptr;
        r->size = size;
        r->offset = offset;
        r->h = e;
        r->frames = f;
        r->next_of = e->ranges;
        e->ranges = r;
        e->n_maps++;
        if (e->exportable) vmm__count_adopted();
        vmm__publish_range(r->addr, size, e->size, offset, e->chunk_id, e->dev, e->exportable, &f, &r->pub);
        range *old = NULL;
        HASH_FIND(hh, A.by_addr, &r->addr, sizeof r->addr, old);
        if (old) { /* stale: its unmap went by unseen */
            handle_entry *oh = old->h;
            HASH_DELETE(hh, A.by_addr, old);
            if (old->pub.slot != UINT32_MAX) HASH_DELETE(hs, A.by_slot, old);
            vmm__retract_range(&old->pub);
            unlink_range(old);
            range_free(old);
            oh->n_maps--;
            vmm__adopt_forget_if_done(oh);
        }
        HASH_ADD(hh, A.by_addr, addr, sizeof r->addr, r);
        if (r->pub.slot != UINT32_MAX) HASH_ADD(hs, A.by_slot, pub.slot, sizeof(uint32_t), r);
    }
    pthread_mutex_unlock(&A.lock);
}

void vmm__adopt_forget_if_done(handle_entry *e)
{
    if (e->refs || e->n_maps || e->pins) return;
    HASH_DELETE(hh, A.handles, e);
    if (e->stand_in && !e->paused) HASH_DELETE(hr, A.by_real, e);
    entry_free(e);
}

static void unlink_range(range *r)
{
    for (range **at = &r->h->ranges; *at; at = &(*at)->next_of)
        if (*at == r) {
            *at = r->next_of;
            return;
        }
}

/* The range that follows r directly (an unmap may cover several mapped back to back). */
static range *next_range(const range *r)
{
    uint64_t at = r->addr + r->size;
    range *n = NULL;
    HASH_FIND(hh, A.by_addr, &at, sizeof at, n);
    return n;
}

static range *range_at(uint64_t addr)
{
    range *r = NULL;
    HASH_FIND(hh, A.by_addr, &addr, sizeof addr, r);
    return r;
}

int vmm__adopt_unmapping(CUdeviceptr ptr, size_t size)
{
    if (!__atomic_load_n(&A.by_addr, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&A.lock);
    uint64_t end = (uint64_t)ptr + size, covered = (uint64_t)ptr;
    int all_paused = 1;
    for (range *r = range_at((uint64_t)ptr); r && r->addr < end; r = next_range(r)) {
        if (r->pub.slot != UINT32_MAX) HASH_DELETE(hs, A.by_slot, r);
        vmm__retract_range(&r->pub); /* gone from the registry before the memory goes */
        r->unmapping = 1;
        all_paused &= r->h->paused;
        covered = r->addr + r->size;
    }
    /* released by vmm_pause from end to end: nothing of the driver's to unmap */
    int skip = all_paused && covered == end && range_at((uint64_t)ptr);
    pthread_mutex_unlock(&A.lock);
    return skip;
}

void vmm__adopt_unmapped(CUdeviceptr ptr, size_t size, int ok)
{
    if (!__atomic_load_n(&A.by_addr, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&A.lock);
    for (range *r = range_at((uint64_t)ptr), *n; r && r->addr < (uint64_t)ptr + size; r = n) {
        n = next_range(r);
        if (!r->unmapping) continue;
        r->unmapping = 0;
        if (!ok) { /* the driver kept the mapping: so does the registry */
            vmm__publish_range(r->addr, r->size, r->h->size, r->offset, r->h->chunk_id, r->h->dev, r->h->exportable,
                               &r->frames, &r->pub);
            if (r->pub.slot != UINT32_MAX) HASH_ADD(hs, A.by_slot, pub.slot, sizeof(uint32_t), r);
            if (r->h->paused) vmm__range_set_paused(&r->pub, 1, 0, 0);
            continue;
        }
        handle_entry *e = r->h;
        HASH_DELETE(hh, A.by_addr, r);
        unlink_range(r);
        range_free(r);
        e->n_maps--;
        vmm__adopt_forget_if_done(e);
    }
    pthread_mutex_unlock(&A.lock);
}

void vmm__adopt_released(CUmemGenericAllocationHandle handle)
{
    if (!__atomic_load_n(&A.handles, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&A.lock);
    handle_entry *e = NULL;
    HASH_FIND(hh, A.handles, &handle, sizeof handle, e);
    if (e && !e->stand_in) { /* without a stand-in the driver counts the references: one release is enough */
        e->refs = 0;
        vmm__adopt_forget_if_done(e);
    }
    pthread_mutex_unlock(&A.lock);
}

/* ---- stand-ins (VMMSHIM_SLEEP_ADOPTED): adopt.h says what each call does ---- */

static handle_entry *stand_in_locked(CUmemGenericAllocationHandle h)
{
    handle_entry *e = NULL;
    HASH_FIND(hh, A.handles, &h, sizeof h, e);
    return e && e->stand_in ? e : NULL;
}

CUresult vmm__adopt_pin(CUmemGenericAllocationHandle h, CUmemGenericAllocationHandle *real)
{
    *real = h;
    pthread_mutex_lock(&A.lock);
    handle_entry *e = stand_in_locked(h);
    CUresult rc = CUDA_SUCCESS;
    if (e && e->paused) rc = CUDA_ERROR_INVALID_HANDLE;
    else if (e) {
        e->pins++; /* a pause waits for the call: the driver's handle stays valid through it */
        *real = e->real;
    }
    pthread_mutex_unlock(&A.lock);
    return rc;
}

void vmm__adopt_shared(CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&A.lock);
    handle_entry *e = stand_in_locked(h);
    if (e) e->shared = 1;
    pthread_mutex_unlock(&A.lock);
}

void vmm__adopt_unpin(CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&A.lock);
    handle_entry *e = stand_in_locked(h);
    if (e && e->pins) {
        e->pins--;
        vmm__adopt_forget_if_done(e);
    }
    pthread_mutex_unlock(&A.lock);
}

CUresult vmm__adopt_release(vmm__mem_release_fn real, CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&A.lock);
    handle_entry *e = stand_in_locked(h);
    if (!e) {
        pthread_mutex_unlock(&A.lock);
        vmm__enter(); /* not one of ours (any more): the driver answers */
        CUresult rc = real(h);
        vmm__leave();
        return rc;
    }
    CUresult rc = CUDA_SUCCESS;
    if (!e->refs) rc = CUDA_ERROR_INVALID_VALUE; /* released already, as the driver answers then */
    else if (e->refs == 1 && !e->paused) {       /* the program's last reference: the shim's goes with it */
        vmm__enter();
        rc = real(e->real);
        vmm__leave();
    }
    if (rc == CUDA_SUCCESS) {
        e->refs--;
        vmm__adopt_forget_if_done(e); /* paused and unmapped: only the shim's record was left */
    }
    pthread_mutex_unlock(&A.lock);
    return rc;
}

CUresult vmm__adopt_get_props(vmm__mem_props_fn real, CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&A.lock);
    handle_entry *e = stand_in_locked(h);
    if (e && e->paused) { /* what the driver answered before the pause */
        *prop = e->prop;
        prop->requestedHandleTypes = (CUmemAllocationHandleType)e->asked_types;
        pthread_mutex_unlock(&A.lock);
        return CUDA_SUCCESS;
    }
    CUmemGenericAllocationHandle r = e ? e->real : h;
    if (e) e->pins++;
    pthread_mutex_unlock(&A.lock);
    vmm__enter();
    CUresult rc = real(prop, r);
    vmm__leave();
    if (!e) return rc;
    pthread_mutex_lock(&A.lock);
    if (rc == CUDA_SUCCESS) prop->requestedHandleTypes = (CUmemAllocationHandleType)e->asked_types;
    e->pins--;
    vmm__adopt_forget_if_done(e);
    pthread_mutex_unlock(&A.lock);
    return rc;
}

void vmm__adopt_retained(CUmemGenericAllocationHandle *handle)
{
    if (!handle || !__atomic_load_n(&A.by_real, __ATOMIC_ACQUIRE)) return; /* no stand-in made: one load */
    pthread_mutex_lock(&A.lock);
    handle_entry *e = NULL;
    HASH_FIND(hr, A.by_real, handle, sizeof *handle, e);
    if (e) {
        /* the driver took a reference; the shim keeps exactly one while the program holds any */
        if (e->refs && VMM__TWICE(A.Release(e->real)) != CUDA_SUCCESS)
            vmm__log(VMM__LOG_WARNING, "cuMemRelease of a retained handle's extra reference failed twice; the driver "
                     "keeps its memory until exit");
        e->refs++;
        *handle = e->handle;
    }
    pthread_mutex_unlock(&A.lock);
}

/* The range of registry slot `slot` with this generation and id, under A.lock; -ENOENT/-ESTALE. */
static int find_published(uint64_t slot, uint64_t generation, const uint8_t id[16], range **out)
{
    range *r = NULL;
    uint32_t key = (uint32_t)slot;
    HASH_FIND(hs, A.by_slot, &key, sizeof key, r);
    *out = r;
    if (!r) return -ENOENT;
    if (r->pub.generation != generation || memcmp(r->pub.alloc_id, id, 16) != 0) return -ESTALE;
    if (r->h->paused) return VMM_BROKER_PAUSED; /* released by vmm_pause: nothing to hand out until resumed */
    return r->h->exportable ? 0 : -ENOENT;
}

/* The broker's export for a published range (vmm__adopted_export_fn, handed to export.c): 0 and a
 * fresh fd of the handle mapped there. */
static int export_range(uint64_t slot, uint64_t generation, const uint8_t id[16], int *fd, uint64_t *mapped,
                        uint32_t *device)
{
    pthread_mutex_lock(&A.lock);
    range *r;
    int rc = find_published(slot, generation, id, &r);
    if (rc == 0 && r->h->broker_fd >= 0) { /* exported before: a duplicate */
        rc = (*fd = fcntl(r->h->broker_fd, F_DUPFD_CLOEXEC, 0)) < 0 ? -errno : 0;
        if (rc == 0) {
            *mapped = r->h->size;
            *device = (uint32_t)r->h->dev;
        }
        pthread_mutex_unlock(&A.lock);
        return rc;
    }
    /* the program may have released its handle already: take our own reference from the mapping,
     * and export it with A.lock let go (an export is ~0.6 ms the program's cuMemMap and cuMemUnmap
     * would otherwise wait; the reference keeps the handle valid if the range goes meanwhile) */
    CUmemGenericAllocationHandle h;
    handle_entry *pinned = NULL;
    if (rc == 0 && A.RetainAllocationHandle(&h, (void *)(uintptr_t)r->addr) != CUDA_SUCCESS) rc = -EIO;
    if (rc == 0 && r->h->stand_in) (pinned = r->h)->pins++; /* a pause waits: its memory goes before it returns */
    pthread_mutex_unlock(&A.lock);
    if (rc) return rc;
    *fd = -1;
    if (A.ExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) rc = -EIO;
    if (VMM__TWICE(A.Release(h)) != CUDA_SUCCESS)
        vmm__log(VMM__LOG_WARNING, "cuMemRelease of a handle retained for an export failed twice; the driver keeps "
                 "its memory until exit");
    pthread_mutex_lock(&A.lock);
    if (pinned) {
        pinned->pins--;
        vmm__adopt_forget_if_done(pinned);
    }
    if (rc == 0 && (rc = find_published(slot, generation, id, &r)) == 0) {
        if (r->h->broker_fd < 0) {
            r->h->broker_fd = fcntl(*fd, F_DUPFD_CLOEXEC, 1024);
            if (r->h->broker_fd >= 0) vmm__backing_kept_adopted(1);
        }
        *mapped = r->h->size;
        *device = (uint32_t)r->h->dev;
    }
    pthread_mutex_unlock(&A.lock);
    if (rc && *fd >= 0) {
        close(*fd); /* unmapped while it was exported */
        *fd = -1;
    }
    return rc;
}
