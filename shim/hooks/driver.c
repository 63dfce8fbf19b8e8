/* The interposed CUDA driver surface: the exact ABI names a program links against, and the
 * wrappers the resolvers (resolve.c) hand out for them.  Forwarding only, as override.c: each asks
 * shim/backing whether the call is the shim's, else calls the real driver function. */
#define __CUDA_API_VERSION_INTERNAL 1 /* cuda.h then renames nothing: we define exact ABI names */
#include <cuda.h>
#include <string.h>

#include "backing/adopt.h"
#include "backing/backing.h"
#include "backing/mempool.h"
#include "hooks/real.h"
#include "registry/layout.h"

#define VMM_HOOK __attribute__((visibility("default")))


#define PASS_THROUGH(call)                                                                            \
    do {                                                                                              \
        vmm__enter();                                                                                 \
        CUresult rc_ = call;                                                                          \
        vmm__leave();                                                                                 \
        return rc_;                                                                                   \
    } while (0)

static CUstream per_thread(CUstream s) { return s ? s : CU_STREAM_PER_THREAD; }

/* The real allocator's answer to a call the shim passed on for `why`. */
static CUresult forward_alloc(vmm__result why, CUresult rc, CUdeviceptr *dptr, size_t size, uint32_t api, CUstream stream)
{
    if (rc == CUDA_SUCCESS) vmm__note_passthrough(why, (void *)(uintptr_t)*dptr, size, api, stream);
    return rc;
}

static CUresult alloc(CUresult (*real)(CUdeviceptr *, size_t), CUdeviceptr *dptr, size_t size)
{
    void *p = NULL;
    if (vmm__in_shim() || !dptr) PASS_THROUGH(real(dptr, size));
    vmm__result why = vmm__alloc(size, VMM_API_CU_MEM_ALLOC, 0, NULL, &p);
    if (why == VMM__DONE) {
        *dptr = (CUdeviceptr)(uintptr_t)p;
        return CUDA_SUCCESS;
    }
    if (why == VMM__REFUSED) return CUDA_ERROR_NOT_SUPPORTED;
    if (why == VMM__MARGIN) return CUDA_ERROR_OUT_OF_MEMORY;
    vmm__enter(); /* the real allocator decides, so an OOM stays native */
    CUresult rc = real(dptr, size);
    vmm__leave();
    return forward_alloc(why, rc, dptr, size, VMM_API_CU_MEM_ALLOC, NULL);
}

VMM_HOOK CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    VMM_REAL_DRIVER(cuMemAlloc_v2, CUDA_ERROR_NOT_INITIALIZED);
    return alloc(real_, dptr, size);
}

/* A double free or interior pointer of shim memory: the driver's own error for a pointer that
 * is no allocation, without letting it near the shim's mapping (a host address never is). */
static CUresult invalid_free(CUresult (*real)(CUdeviceptr))
{
    char not_device_memory;
    PASS_THROUGH(real((CUdeviceptr)(uintptr_t)&not_device_memory));
}

VMM_HOOK CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    VMM_REAL_DRIVER(cuMemFree_v2, CUDA_ERROR_NOT_INITIALIZED);
    if (!vmm__in_shim()) switch (vmm__free((void *)(uintptr_t)dptr, 0, NULL)) {
        case VMM__DONE: return CUDA_SUCCESS;
        case VMM__INVALID: return invalid_free(real_);
        default: break;
        }
    PASS_THROUGH(real_(dptr));
}

static CUresult alloc_async(CUresult (*real)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t size, CUstream stream,
                            CUstream cu_stream)
{
    void *p = NULL;
    if (vmm__in_shim() || !dptr) return real(dptr, size, stream);
    vmm__result why = vmm__stream_capturing(cu_stream) ? VMM__CAPTURED
                                                      : vmm__alloc(size, VMM_API_CU_MEM_ALLOC_ASYNC, 1, cu_stream, &p);
    if (why == VMM__DONE) {
        *dptr = (CUdeviceptr)(uintptr_t)p;
        return CUDA_SUCCESS;
    }
    if (why == VMM__REFUSED) return CUDA_ERROR_NOT_SUPPORTED;
    if (why == VMM__MARGIN) return CUDA_ERROR_OUT_OF_MEMORY;
    /* captured into a graph, or the device is full: the real pool's memory, noted not exportable */
    vmm__enter();
    CUresult rc = real(dptr, size, stream);
    vmm__leave();
    return forward_alloc(why, rc, dptr, size, VMM_API_CU_MEM_ALLOC_ASYNC, cu_stream);
}

VMM_HOOK CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream)
{
    VMM_REAL_DRIVER(cuMemAllocAsync, CUDA_ERROR_NOT_INITIALIZED);
    return alloc_async(real_, dptr, size, stream, stream);
}

VMM_HOOK CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream stream)
{
    VMM_REAL_DRIVER(cuMemAllocAsync_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    return alloc_async(real_, dptr, size, stream, per_thread(stream));
}

static CUresult free_async(CUresult (*real)(CUdeviceptr, CUstream), CUdeviceptr dptr, CUstream stream, CUstream cu_stream)
{
    char not_device_memory;
    if (!vmm__in_shim()) switch (vmm__free((void *)(uintptr_t)dptr, 1, cu_stream)) {
        case VMM__DONE: return CUDA_SUCCESS;
        case VMM__INVALID: dptr = (CUdeviceptr)(uintptr_t)&not_device_memory; break;
        default: break;
        }
    PASS_THROUGH(real(dptr, stream));
}

VMM_HOOK CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    VMM_REAL_DRIVER(cuMemFreeAsync, CUDA_ERROR_NOT_INITIALIZED);
    return free_async(real_, dptr, stream, stream);
}

VMM_HOOK CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    VMM_REAL_DRIVER(cuMemFreeAsync_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    return free_async(real_, dptr, stream, per_thread(stream));
}

/* The pitch is the driver's own: ask it with a one-row allocation, then back pitch x height. */
VMM_HOOK CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned elem)
{
    VMM_REAL_DRIVER(cuMemAllocPitch_v2, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim() || !dptr || !pitch || width == 0 || height == 0) return real_(dptr, pitch, width, height, elem);
    CUdeviceptr probe = 0;
    size_t p = 0;
    vmm__enter();
    CUresult rc = real_(&probe, &p, width, 1, elem);
    if (rc == CUDA_SUCCESS) {
        static void *free_slot;
        __typeof__(&cuMemFree_v2) real_free;
        void *f = vmm__real_driver_once(&free_slot, "cuMemFree_v2");
        memcpy(&real_free, &f, sizeof f);
        if (real_free) real_free(probe);
    }
    vmm__leave();
    void *ptr = NULL;
    vmm__result why = rc != CUDA_SUCCESS || p == 0 || height > SIZE_MAX / p
                          ? VMM__UNSUPPORTED /* no pitch to back the rows with */
                          : vmm__alloc(p * height, VMM_API_CU_MEM_ALLOC_PITCH, 0, NULL, &ptr);
    if (why == VMM__DONE) {
        *dptr = (CUdeviceptr)(uintptr_t)ptr;
        *pitch = p;
        return CUDA_SUCCESS;
    }
    if (why == VMM__REFUSED) return CUDA_ERROR_NOT_SUPPORTED;
    if (why == VMM__MARGIN) return CUDA_ERROR_OUT_OF_MEMORY;
    vmm__enter();
    rc = real_(dptr, pitch, width, height, elem);
    vmm__leave();
    return forward_alloc(why, rc, dptr, rc == CUDA_SUCCESS ? *pitch * height : 0, VMM_API_CU_MEM_ALLOC_PITCH, NULL);
}

VMM_HOOK CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    VMM_REAL_DRIVER(cuMemGetInfo_v2, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(free_bytes, total);
    vmm__enter();
    CUresult rc = real_(free_bytes, total);
    vmm__leave();
    if (rc == CUDA_SUCCESS && free_bytes) *free_bytes += vmm__pool_free_bytes_current(); /* the pool's free bytes are ours to give back */
    return rc;
}

/* A reset frees every allocation of the device natively: the shim lets its own go first. */
VMM_HOOK CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    VMM_REAL_DRIVER(cuDevicePrimaryCtxReset_v2, CUDA_ERROR_NOT_INITIALIZED);
    if (!vmm__in_shim()) vmm__device_reset((int)dev);
    PASS_THROUGH(real_(dev));
}

/* ---- queries: a shim allocation answers with its requested base and size ---- */

/* A pointer into shim memory that is no live allocation (freed, or past the requested
 * end) is, to the program, no allocation at all: the driver answers for a host address instead. */
static CUdeviceptr as_seen_by_program(CUdeviceptr p, const char *host)
{
    return vmm__owned(p) ? (CUdeviceptr)(uintptr_t)host : p;
}

VMM_HOOK CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
{
    VMM_REAL_DRIVER(cuMemGetAddressRange_v2, CUDA_ERROR_NOT_INITIALIZED);
    vmm__alloc_ref a;
    char host;
    if (vmm__in_shim()) return real_(base, size, dptr);
    if (!vmm__lookup(dptr, &a)) PASS_THROUGH(real_(base, size, as_seen_by_program(dptr, &host)));
    if (base) *base = a.base;
    if (size) *size = a.requested;
    return CUDA_SUCCESS;
}

/* Patch the attributes whose answer differs for VMM memory; the rest come from the driver. */
static void patch_attribute(CUpointer_attribute attr, void *data, const vmm__alloc_ref *a)
{
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = a->base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = a->requested; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = 1; break; /* the shim emulates it */
    default: break;
    }
}

VMM_HOOK CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr)
{
    VMM_REAL_DRIVER(cuPointerGetAttribute, CUDA_ERROR_NOT_INITIALIZED);
    vmm__alloc_ref a;
    char host;
    if (vmm__in_shim()) return real_(data, attr, ptr);
    int live = vmm__lookup(ptr, &a);
    vmm__enter();
    CUresult rc = real_(data, attr, live ? ptr : as_seen_by_program(ptr, &host));
    vmm__leave();
    if (rc == CUDA_SUCCESS && data && live) patch_attribute(attr, data, &a);
    return rc;
}

VMM_HOOK CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute *attrs, void **data, CUdeviceptr ptr)
{
    VMM_REAL_DRIVER(cuPointerGetAttributes, CUDA_ERROR_NOT_INITIALIZED);
    vmm__alloc_ref a;
    char host;
    if (vmm__in_shim()) return real_(n, attrs, data, ptr);
    int live = vmm__lookup(ptr, &a);
    vmm__enter();
    CUresult rc = real_(n, attrs, data, live ? ptr : as_seen_by_program(ptr, &host));
    vmm__leave();
    if (rc == CUDA_SUCCESS && attrs && data && live)
        for (unsigned i = 0; i < n; i++)
            if (data[i]) patch_attribute(attrs[i], data[i], &a);
    return rc;
}

/* ---- peer access: VMM mappings need their own cuMemSetAccess grant ---- */

/* The device of ctx (NULL: the current context) into *dev; the driver's error if it cannot tell.
 * Inside the guard. */
static CUresult ctx_device(CUcontext ctx, int *dev)
{
    static void *slots[3];
    __typeof__(&cuCtxPushCurrent_v2) push;
    __typeof__(&cuCtxPopCurrent_v2) pop;
    __typeof__(&cuCtxGetDevice) get;
    void *a = vmm__real_driver_once(&slots[0], "cuCtxPushCurrent_v2"), *b = vmm__real_driver_once(&slots[1], "cuCtxPopCurrent_v2"),
         *c = vmm__real_driver_once(&slots[2], "cuCtxGetDevice");
    memcpy(&push, &a, sizeof a);
    memcpy(&pop, &b, sizeof b);
    memcpy(&get, &c, sizeof c);
    if (!push || !pop || !get) return CUDA_ERROR_NOT_INITIALIZED;
    CUdevice d = -1;
    CUcontext popped;
    CUresult rc = ctx ? push(ctx) : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        rc = get(&d);
        CUresult back = ctx ? VMM__TWICE(pop(&popped)) : CUDA_SUCCESS; /* else the thread stays in ctx */
        if (rc == CUDA_SUCCESS) rc = back;
    }
    *dev = d;
    return rc;
}

/* The driver answers first (so a bad call gets its own error), then the shim's grant follows: a
 * call the shim cannot follow through (neither context's device found, or a grant refused) is
 * undone in the driver and fails with the shim's error, as a real one may, instead of
 * succeeding without the grant. */
VMM_HOOK CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags)
{
    VMM_REAL_DRIVER(cuCtxEnablePeerAccess, CUDA_ERROR_NOT_INITIALIZED);
    static void *disable_slot;
    __typeof__(&cuCtxDisablePeerAccess) disable;
    void *f = vmm__real_driver_once(&disable_slot, "cuCtxDisablePeerAccess");
    memcpy(&disable, &f, sizeof f);
    int me = -1, owner = -1;
    vmm__enter();
    CUresult look = ctx_device(NULL, &me);
    if (look == CUDA_SUCCESS) look = ctx_device(peer, &owner);
    CUresult rc = real_(peer, flags);
    if (rc == CUDA_SUCCESS || rc == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
        CUresult g = look != CUDA_SUCCESS ? look : vmm__peer_access(me, owner, 1, NULL);
        if (g != CUDA_SUCCESS) {
            if (rc == CUDA_SUCCESS && disable) disable(peer);
            rc = g;
        }
    }
    vmm__leave();
    return rc;
}

VMM_HOOK CUresult cuCtxDisablePeerAccess(CUcontext peer)
{
    VMM_REAL_DRIVER(cuCtxDisablePeerAccess, CUDA_ERROR_NOT_INITIALIZED);
    static void *enable_slot;
    __typeof__(&cuCtxEnablePeerAccess) enable;
    void *f = vmm__real_driver_once(&enable_slot, "cuCtxEnablePeerAccess");
    memcpy(&enable, &f, sizeof f);
    int me = -1, owner = -1;
    vmm__enter();
    CUresult look = ctx_device(NULL, &me);
    if (look == CUDA_SUCCESS) look = ctx_device(peer, &owner);
    CUresult rc = real_(peer);
    if (rc == CUDA_SUCCESS) {
        CUresult g = look != CUDA_SUCCESS ? look : vmm__peer_access(me, owner, 0, NULL);
        if (g != CUDA_SUCCESS) {
            if (enable) enable(peer, 0);
            rc = g;
        }
    }
    vmm__leave();
    return rc;
}

/* ---- the device's default memory pool: cudaMallocAsync's memory is the shim's ----
 * Real first, always: the real pool keeps every setting the program made (so the getters and
 * cuMemPoolGetAccess stay the driver's), and only a successful call reaches shim/backing.  Which
 * device's default pool it is comes before (`lookup`): a call the shim could not follow through
 * fails whole with the lookup's error, never half done. */

#define REAL_THEN(call, after) LOOKUP_THEN(CUDA_SUCCESS, call, after)
#define LOOKUP_THEN(lookup, call, after)                                                              \
    do {                                                                                              \
        if (vmm__in_shim()) return call;                                                              \
        CUresult rc_ = lookup;                                                                        \
        if (rc_ != CUDA_SUCCESS) return rc_;                                                          \
        vmm__enter();                                                                                 \
        rc_ = call;                                                                                   \
        vmm__leave();                                                                                 \
        if (rc_ == CUDA_SUCCESS) after;                                                               \
        return rc_;                                                                                   \
    } while (0)

VMM_HOOK CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)
{
    VMM_REAL_DRIVER(cuMemPoolSetAccess, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(pool, map, count);
    int dev;
    CUresult rc = vmm__mempool_device(pool, &dev);
    return rc != CUDA_SUCCESS ? rc : vmm__mempool_set_access(real_, pool, dev, map, count);
}

VMM_HOOK CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    VMM_REAL_DRIVER(cuMemPoolGetAttribute, CUDA_ERROR_NOT_INITIALIZED);
    int dev = -1;
    LOOKUP_THEN(vmm__mempool_device(pool, &dev), real_(pool, attr, value), vmm__mempool_attribute_got(dev, attr, value));
}

VMM_HOOK CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    VMM_REAL_DRIVER(cuMemPoolSetAttribute, CUDA_ERROR_NOT_INITIALIZED);
    int dev = -1;
    LOOKUP_THEN(vmm__mempool_device(pool, &dev), real_(pool, attr, value), vmm__mempool_attribute_set(dev, attr, value));
}

VMM_HOOK CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    VMM_REAL_DRIVER(cuMemPoolTrimTo, CUDA_ERROR_NOT_INITIALIZED);
    int dev = -1;
    LOOKUP_THEN(vmm__mempool_device(pool, &dev), real_(pool, keep), vmm__mempool_trimmed(dev, keep));
}

VMM_HOOK CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    VMM_REAL_DRIVER(cuDeviceSetMemPool, CUDA_ERROR_NOT_INITIALIZED);
    CUmemoryPool def = NULL;
    LOOKUP_THEN(vmm__mempool_default(dev, &def), real_(dev, pool), if (def) vmm__mempool_current_set(dev, pool == def));
}

/* CUDA 13's location form; for a device's pinned memory it is cuDeviceSetMemPool. */
VMM_HOOK CUresult cuMemSetMemPool(CUmemLocation *location, CUmemAllocationType type, CUmemoryPool pool)
{
    VMM_REAL_DRIVER(cuMemSetMemPool, CUDA_ERROR_NOT_INITIALIZED);
    int dev = location && location->type == CU_MEM_LOCATION_TYPE_DEVICE && type == CU_MEM_ALLOCATION_TYPE_PINNED
                  ? location->id
                  : -1;
    CUmemoryPool def = NULL;
    LOOKUP_THEN(dev >= 0 ? vmm__mempool_default(dev, &def) : CUDA_SUCCESS, real_(location, type, pool),
                if (def) vmm__mempool_current_set(dev, pool == def));
}

/* ---- the program's own VMM memory: made exportable and published (backing/adopt.c) ---- */

VMM_HOOK CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                              unsigned long long flags)
{
    VMM_REAL_DRIVER(cuMemCreate, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(handle, size, prop, flags);
    return vmm__adopt_create(real_, handle, size, prop, flags, __builtin_return_address(0));
}

/* A handle argument that is one of the shim's stand-ins (VMMSHIM_SLEEP_ADOPTED=1, adopt.h) is
 * translated to the driver's handle; any other value goes to the driver as it came (one compare). */

VMM_HOOK CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
    VMM_REAL_DRIVER(cuMemGetAllocationPropertiesFromHandle, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(prop, handle);
    if (vmm__adopt_is_stand_in(handle)) return vmm__adopt_get_props(real_, prop, handle);
    REAL_THEN(real_(prop, handle), vmm__adopt_props(prop, handle));
}

VMM_HOOK CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                           unsigned long long flags)
{
    VMM_REAL_DRIVER(cuMemMap, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(ptr, size, offset, handle, flags);
    if (!vmm__adopt_is_stand_in(handle))
        REAL_THEN(real_(ptr, size, offset, handle, flags), vmm__adopt_mapped(ptr, size, offset, handle));
    CUmemGenericAllocationHandle real_handle;
    CUresult rc = vmm__adopt_pin(handle, &real_handle);
    if (rc != CUDA_SUCCESS) return rc;
    vmm__enter();
    rc = real_(ptr, size, offset, real_handle, flags);
    vmm__leave();
    if (rc == CUDA_SUCCESS) vmm__adopt_mapped(ptr, size, offset, handle);
    vmm__adopt_unpin(handle);
    return rc;
}

VMM_HOOK CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    VMM_REAL_DRIVER(cuMemUnmap, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(ptr, size);
    CUresult rc = CUDA_SUCCESS;
    if (!vmm__adopt_unmapping(ptr, size)) { /* else: paused memory, of which the driver maps nothing */
        vmm__enter();
        rc = real_(ptr, size);
        vmm__leave();
    }
    vmm__adopt_unmapped(ptr, size, rc == CUDA_SUCCESS);
    return rc;
}

VMM_HOOK CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    VMM_REAL_DRIVER(cuMemRelease, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(handle);
    if (vmm__adopt_is_stand_in(handle)) return vmm__adopt_release(real_, handle);
    REAL_THEN(real_(handle), vmm__adopt_released(handle));
}

VMM_HOOK CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle,
                                               CUmemAllocationHandleType type, unsigned long long flags)
{
    VMM_REAL_DRIVER(cuMemExportToShareableHandle, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(shareable, handle, type, flags);
    if (!vmm__adopt_is_stand_in(handle)) PASS_THROUGH(real_(shareable, handle, type, flags));
    CUmemGenericAllocationHandle real_handle;
    CUresult rc = vmm__adopt_pin(handle, &real_handle);
    if (rc != CUDA_SUCCESS) return rc;
    vmm__enter();
    rc = real_(shareable, real_handle, type, flags);
    vmm__leave();
    if (rc == CUDA_SUCCESS) vmm__adopt_shared(handle);
    vmm__adopt_unpin(handle);
    return rc;
}

/* The driver answers with its own handle; memory with a stand-in answers with the stand-in. */
VMM_HOOK CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    VMM_REAL_DRIVER(cuMemRetainAllocationHandle, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(handle, addr);
    REAL_THEN(real_(handle, addr), vmm__adopt_retained(handle));
}

/* ---- stream capture: counted, so that a free never synchronizes the context while a stream of
 * it captures (a context synchronization invalidates every capture in it, where native cudaFree
 * invalidates none in relaxed or thread-local mode) ---- */

static CUresult begun(CUresult rc)
{
    if (rc == CUDA_SUCCESS) vmm__capture_begun();
    return rc;
}

VMM_HOOK CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    VMM_REAL_DRIVER(cuStreamBeginCapture_v2, CUDA_ERROR_NOT_INITIALIZED);
    return begun(real_(s, mode));
}

VMM_HOOK CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode)
{
    VMM_REAL_DRIVER(cuStreamBeginCapture_v2_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    return begun(real_(s, mode));
}

VMM_HOOK CUresult cuStreamBeginCapture(CUstream s)
{
    VMM_REAL_DRIVER(cuStreamBeginCapture, CUDA_ERROR_NOT_INITIALIZED);
    return begun(real_(s));
}

VMM_HOOK CUresult cuStreamBeginCapture_ptsz(CUstream s)
{
    VMM_REAL_DRIVER(cuStreamBeginCapture_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    return begun(real_(s));
}

VMM_HOOK CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps,
                                              const CUgraphEdgeData *data, size_t n, CUstreamCaptureMode mode)
{
    VMM_REAL_DRIVER(cuStreamBeginCaptureToGraph, CUDA_ERROR_NOT_INITIALIZED);
    return begun(real_(s, g, deps, data, n, mode));
}

VMM_HOOK CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode *deps,
                                                   const CUgraphEdgeData *data, size_t n, CUstreamCaptureMode mode)
{
    VMM_REAL_DRIVER(cuStreamBeginCaptureToGraph_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    return begun(real_(s, g, deps, data, n, mode));
}

/* Ending a capture ends it, invalidated or not. */
static CUresult end_capture(CUresult (*real)(CUstream, CUgraph *), CUstream s, CUgraph *g)
{
    int was = vmm__stream_capturing(s);
    CUresult rc = real(s, g);
    if (was && !vmm__stream_capturing(s)) vmm__capture_ended();
    return rc;
}

VMM_HOOK CUresult cuStreamEndCapture(CUstream s, CUgraph *g)
{
    VMM_REAL_DRIVER(cuStreamEndCapture, CUDA_ERROR_NOT_INITIALIZED);
    return end_capture(real_, s, g);
}

VMM_HOOK CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g)
{
    VMM_REAL_DRIVER(cuStreamEndCapture_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    return end_capture(real_, per_thread(s), g);
}

/* A synchronization is where the default pool gives back what lies beyond its release threshold
 * (natively too), and where frees waiting on the work just finished become idle.  Nothing waiting
 * (the common case: a training step synchronizes every step): the real call and two loads. */
#define SYNCHRONIZED(call, whole_context, s)                                                          \
    do {                                                                                              \
        if (!vmm__sync_watching()) return call;                                                       \
        uint64_t mark_ = vmm__free_mark();                                                            \
        CUresult rc_ = call;                                                                          \
        if (rc_ == CUDA_SUCCESS && !vmm__in_shim()) vmm__synchronized(whole_context, s, mark_);       \
        return rc_;                                                                                   \
    } while (0)

VMM_HOOK CUresult cuCtxSynchronize(void)
{
    VMM_REAL_DRIVER(cuCtxSynchronize, CUDA_ERROR_NOT_INITIALIZED);
    SYNCHRONIZED(real_(), 1, NULL);
}

VMM_HOOK CUresult cuStreamSynchronize(CUstream s)
{
    VMM_REAL_DRIVER(cuStreamSynchronize, CUDA_ERROR_NOT_INITIALIZED);
    SYNCHRONIZED(real_(s), 0, s);
}

VMM_HOOK CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    VMM_REAL_DRIVER(cuStreamSynchronize_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    SYNCHRONIZED(real_(s), 0, s ? s : CU_STREAM_PER_THREAD);
}

/* Frees on a stream whose event was left for later get it before the stream goes. */
VMM_HOOK CUresult cuStreamDestroy_v2(CUstream s)
{
    VMM_REAL_DRIVER(cuStreamDestroy_v2, CUDA_ERROR_NOT_INITIALIZED);
    if (!vmm__in_shim()) vmm__stream_destroying(s);
    return real_(s);
}

VMM_HOOK CUresult cuStreamDestroy(CUstream s)
{
    VMM_REAL_DRIVER(cuStreamDestroy, CUDA_ERROR_NOT_INITIALIZED);
    if (!vmm__in_shim()) vmm__stream_destroying(s);
    return real_(s);
}

/* The program's event dependencies between streams, for a default pool that follows them
 * (backing/streams.c); one load while none does.  A record or wait into a capture is a node of a
 * graph, not an order between the streams now. */
#define RECORDED(call, e, s)                                                                          \
    do {                                                                                              \
        if (!vmm__following() || vmm__in_shim()) return call;                                         \
        uint64_t mark_ = vmm__free_mark();                                                            \
        CUresult rc_ = call;                                                                          \
        if (rc_ == CUDA_SUCCESS && !vmm__stream_capturing(s)) vmm__follow_recorded(e, s, mark_);      \
        return rc_;                                                                                   \
    } while (0)

#define WAITED(call, s, e)                                                                            \
    do {                                                                                              \
        if (!vmm__following() || vmm__in_shim()) return call;                                         \
        CUresult rc_ = call;                                                                          \
        if (rc_ == CUDA_SUCCESS && !vmm__stream_capturing(s)) vmm__follow_waited(s, e);               \
        return rc_;                                                                                   \
    } while (0)

VMM_HOOK CUresult cuEventRecord(CUevent e, CUstream s)
{
    VMM_REAL_DRIVER(cuEventRecord, CUDA_ERROR_NOT_INITIALIZED);
    RECORDED(real_(e, s), e, s);
}

VMM_HOOK CUresult cuEventRecord_ptsz(CUevent e, CUstream s)
{
    VMM_REAL_DRIVER(cuEventRecord_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    RECORDED(real_(e, s), e, per_thread(s));
}

VMM_HOOK CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned flags)
{
    VMM_REAL_DRIVER(cuEventRecordWithFlags, CUDA_ERROR_NOT_INITIALIZED);
    RECORDED(real_(e, s, flags), e, s);
}

VMM_HOOK CUresult cuEventRecordWithFlags_ptsz(CUevent e, CUstream s, unsigned flags)
{
    VMM_REAL_DRIVER(cuEventRecordWithFlags_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    RECORDED(real_(e, s, flags), e, per_thread(s));
}

VMM_HOOK CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags)
{
    VMM_REAL_DRIVER(cuStreamWaitEvent, CUDA_ERROR_NOT_INITIALIZED);
    WAITED(real_(s, e, flags), s, e);
}

VMM_HOOK CUresult cuStreamWaitEvent_ptsz(CUstream s, CUevent e, unsigned flags)
{
    VMM_REAL_DRIVER(cuStreamWaitEvent_ptsz, CUDA_ERROR_NOT_INITIALIZED);
    WAITED(real_(s, e, flags), per_thread(s), e);
}

/* A destroyed event's handle may name a new one, never recorded: what its record said goes. */
VMM_HOOK CUresult cuEventDestroy_v2(CUevent e)
{
    VMM_REAL_DRIVER(cuEventDestroy_v2, CUDA_ERROR_NOT_INITIALIZED);
    if (!vmm__in_shim()) vmm__follow_forget(e);
    return real_(e);
}

VMM_HOOK CUresult cuEventDestroy(CUevent e)
{
    VMM_REAL_DRIVER(cuEventDestroy, CUDA_ERROR_NOT_INITIALIZED);
    if (!vmm__in_shim()) vmm__follow_forget(e);
    return real_(e);
}
