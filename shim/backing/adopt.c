/* The program's own VMM memory (adopt.h says what each call does).  One record per cuMemMap'd
 * range: PyTorch maps its 2 MiB or 20 MiB pages one by one and unmaps them one by one, so a
 * mapping is the unit that appears and goes; a companion reading a tensor across pages imports a
 * range of records (vmm_import_range).  The broker exports the handle mapped at a range through
 * cuMemRetainAllocationHandle, so a program that released its handle after mapping it (the usual
 * VMM idiom) stays importable. */
#include "backing/adopt.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uthash.h>

#include "backing/backing.h"
#include "backing/frames.h"
#include "core/log.h"
#include "core/options.h"
#include "hooks/real.h"

typedef struct handle_entry {
    CUmemGenericAllocationHandle handle; /* key */
    uint64_t size, chunk_id;
    int dev, exportable, released;
    unsigned asked_types; /* the handle types the program asked for */
    unsigned n_maps;
    int broker_fd; /* exported at the first broker request, dup'ed for each after (as a segment's, export.c) */
    UT_hash_handle hh;
} handle_entry;

typedef struct range {
    uint64_t addr; /* key */
    uint64_t size, offset;
    handle_entry *h;
    vmm__frames frames;
    vmm__published pub;
    int unmapping;
    UT_hash_handle hh, hs; /* by address, by registry slot */
} range;

static struct {
    pthread_mutex_t lock;
    handle_entry *handles;
    range *by_addr, *by_slot;
    CUresult (*RetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
    CUresult (*ExportToShareableHandle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
    CUresult (*Release)(CUmemGenericAllocationHandle);
} A = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int adopting(void)
{
    static int on = -1;
    int v = __atomic_load_n(&on, __ATOMIC_ACQUIRE);
    if (v < 0) {
        v = vmm__opt_bool(VMM__OPT_ADOPT) && vmm__opt_bool(VMM__OPT_ENABLE);
        __atomic_store_n(&on, v, __ATOMIC_RELEASE);
    }
    return v;
}

static int export_range(uint64_t slot, uint64_t generation, const uint8_t id[16], int *fd, uint64_t *mapped,
                        uint32_t *device);

static void resolve_driver(void)
{
    void *r = vmm__real_driver("cuMemRetainAllocationHandle"), *e = vmm__real_driver("cuMemExportToShareableHandle"),
         *l = vmm__real_driver("cuMemRelease");
    if (!r || !e || !l) return;
    memcpy(&A.RetainAllocationHandle, &r, sizeof r);
    memcpy(&A.ExportToShareableHandle, &e, sizeof e);
    memcpy(&A.Release, &l, sizeof l);
    vmm__export_adopted_by(export_range); /* before any range is published */
}

static int load_driver(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, resolve_driver);
    return A.Release != NULL;
}

static void entry_free(handle_entry *e)
{
    if (e->broker_fd >= 0) {
        close(e->broker_fd);
        vmm__backing_kept_adopted(-1);
    }
    free(e);
}

CUresult vmm__adopt_create(vmm__mem_create_fn real, CUmemGenericAllocationHandle *handle, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUresult rc;
    int eligible = handle && prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
                   prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && adopting() &&
                   vmm__device_exportable(prop->location.id) && load_driver();
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
    e->handle = *handle;
    e->size = size;
    e->dev = prop->location.id;
    e->exportable = exportable;
    e->asked_types = (unsigned)prop->requestedHandleTypes;
    e->chunk_id = vmm__new_chunk_id();
    e->broker_fd = -1;
    pthread_mutex_lock(&A.lock);
    handle_entry *old = NULL;
    HASH_FIND(hh, A.handles, &e->handle, sizeof e->handle, old);
    if (old) { /* a handle value the driver reused after a release we did not see */
        HASH_DELETE(hh, A.handles, old);
        if (!old->n_maps) entry_free(old);
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
        e->n_maps++;
        if (e->exportable) vmm__count_adopted();
        vmm__publish_range(r->addr, size, e->size, offset, e->chunk_id, e->dev, e->exportable, &f, &r->pub);
        range *old = NULL;
        HASH_FIND(hh, A.by_addr, &r->addr, sizeof r->addr, old);
        if (old) HASH_DELETE(hh, A.by_addr, old); /* stale: its unmap went by unseen */
        HASH_ADD(hh, A.by_addr, addr, sizeof r->addr, r);
        if (r->pub.slot != UINT32_MAX) HASH_ADD(hs, A.by_slot, pub.slot, sizeof(uint32_t), r);
    }
    pthread_mutex_unlock(&A.lock);
}

static void forget_handle_if_done(handle_entry *e)
{
    if (e->released && !e->n_maps) {
        HASH_DELETE(hh, A.handles, e);
        entry_free(e);
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

void vmm__adopt_unmapping(CUdeviceptr ptr, size_t size)
{
    if (!__atomic_load_n(&A.by_addr, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&A.lock);
    for (range *r = range_at((uint64_t)ptr); r && r->addr < (uint64_t)ptr + size; r = next_range(r)) {
        if (r->pub.slot != UINT32_MAX) HASH_DELETE(hs, A.by_slot, r);
        vmm__retract_range(&r->pub); /* gone from the registry before the memory goes */
        r->unmapping = 1;
    }
    pthread_mutex_unlock(&A.lock);
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
            continue;
        }
        handle_entry *e = r->h;
        HASH_DELETE(hh, A.by_addr, r);
        free(r);
        e->n_maps--;
        forget_handle_if_done(e);
    }
    pthread_mutex_unlock(&A.lock);
}

void vmm__adopt_released(CUmemGenericAllocationHandle handle)
{
    if (!__atomic_load_n(&A.handles, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&A.lock);
    handle_entry *e = NULL;
    HASH_FIND(hh, A.handles, &handle, sizeof handle, e);
    if (e) {
        e->released = 1;
        forget_handle_if_done(e);
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
    if (rc == 0 && A.RetainAllocationHandle(&h, (void *)(uintptr_t)r->addr) != CUDA_SUCCESS) rc = -EIO;
    pthread_mutex_unlock(&A.lock);
    if (rc) return rc;
    *fd = -1;
    if (A.ExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) rc = -EIO;
    if (VMM__TWICE(A.Release(h)) != CUDA_SUCCESS)
        vmm__log(VMM__LOG_WARNING, "cuMemRelease of a handle retained for an export failed twice; the driver keeps "
                 "its memory until exit");
    pthread_mutex_lock(&A.lock);
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
