/* Segments and arenas: the mechanism the pool (shim/pool) calls through its ops, always under
 * vmm__S.lock.  An arena is address space reserved once (cuMemAddressReserve); a segment is one
 * cuMemCreate handle, POSIX-fd exportable, mapped into an arena with the access its pool's
 * devices need; the events that tell the pool a stream reached a stream-ordered free come from a
 * per-device pool of them.  Where an allocation goes is the pool's decision: nothing here decides,
 * publishes or gives back on its own. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "backing/internal.h"
#include "core/log.h"
#include "registry/keep.h"

void vmm__export_seg(vseg *c)
{
    if (vmm__S.export_pidfd) {
        int fd = -1;
        if (vmm__cu.MemExportToShareableHandle(&fd, c->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_SUCCESS) {
            c->exported_fd = fcntl(fd, F_DUPFD_CLOEXEC, 1024); /* above 1023 so select() users never see it */
            close(fd);
        }
    }
    if (vmm__S.dev[c->dev].fabric &&
        vmm__cu.MemExportToShareableHandle(c->fabric, c->handle, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_SUCCESS)
        c->has_fabric = 1;
}

/* Give back a segment's mapping and handle, as far as they exist, each call made twice if need
 * be (VMM__TWICE); what still fails stays with the driver until the process exits (one warning). */
static void seg_undo(CUdeviceptr va, uint64_t size, CUmemGenericAllocationHandle h, int mapped)
{
    CUresult unmap = mapped ? VMM__TWICE(vmm__cu.MemUnmap(va, size)) : CUDA_SUCCESS;
    CUresult release = VMM__TWICE(vmm__cu.MemRelease(h));
    if (unmap || release)
        vmm__log(VMM__LOG_WARNING, "giving back %llu bytes: %s failed twice (CUDA error %d); the driver keeps them "
                 "until exit", (unsigned long long)size, unmap ? "cuMemUnmap" : "cuMemRelease", (int)(unmap ? unmap : release));
}

/* Natively any context copies from a cudaMalloc'd block of any device, while the driver copies
 * VMM memory only in a context whose device was granted it (an H100 answers
 * cudaErrorInvalidValue): so cudaMalloc's segments are granted to every device that can reach
 * this one, besides the ones peer access was enabled for.  The stream-ordered pool's follow the
 * default pool's access instead (cudaMemPoolSetAccess), as natively. */
int vmm__access_list(device_state *d, CUmemAccessDesc *acc, int synchronous_pool)
{
    int n = 0;
    uint64_t accessors = __atomic_load_n(&d->accessors, __ATOMIC_ACQUIRE) | (1ull << d->index) | (synchronous_pool ? d->peers : 0);
    for (int i = 0; i < MAX_DEVICES; i++)
        if (accessors & (1ull << i))
            acc[n++] = (CUmemAccessDesc){.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = i},
                                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    return n;
}

/* torch_memory_saver's memory_margin_bytes: a segment that would leave the device with less than
 * the margin free is refused as the driver refuses one that does not fit, so the program (PyTorch
 * frees its cache and retries, then raises) fails early and leaves room for its neighbour.  One
 * cuMemGetInfo per new segment, none while the margin is 0. */
static _Thread_local int margin_refused; /* the verdict of this thread's last segment */

int vmm__margin_refused(void) { return margin_refused; }

void vmm__set_alloc_margin(uint64_t bytes) { __atomic_store_n(&vmm__S.alloc_margin, bytes, __ATOMIC_RELAXED); }

static int within_margin(uint64_t size)
{
    uint64_t margin = __atomic_load_n(&vmm__S.alloc_margin, __ATOMIC_RELAXED);
    size_t free_bytes = 0, total = 0;
    int ok = !margin || !vmm__cu.MemGetInfo || vmm__cu.MemGetInfo(&free_bytes, &total) != CUDA_SUCCESS ||
             ((uint64_t)free_bytes >= margin && (uint64_t)free_bytes - margin >= size);
    margin_refused = !ok;
    return ok;
}

static int seg_create(void *ctx, vmm__seg *ps)
{
    device_state *d = ctx;
    int dev = d->index;
    if (!within_margin(ps->size)) return -ENOMEM;
    CUmemAllocationProp p = {0};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | (d->fabric ? CU_MEM_HANDLE_TYPE_FABRIC : 0);
    CUmemGenericAllocationHandle h;
    CUresult rc = vmm__cu.MemCreate(&h, ps->size, &p, 0);
    if (rc != CUDA_SUCCESS) return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    int mapped = 0;
    if ((rc = vmm__cu.MemMap(ps->base, ps->size, 0, h, 0)) != CUDA_SUCCESS) goto undo;
    mapped = 1;
    CUmemAccessDesc acc[MAX_DEVICES];
    if ((rc = vmm__cu.MemSetAccess(ps->base, ps->size, acc, (size_t)vmm__access_list(d, acc, vmm__pool_kind(d, ps->arena->pool) == 0))) !=
        CUDA_SUCCESS)
        goto undo;
    vseg *c = calloc(1, sizeof *c);
    if (!c) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto undo;
    }
    c->handle = h;
    c->dev = dev;
    c->exported_fd = -1;
    c->broker_fd = -1;
    c->id = vmm__new_chunk_id();
    vmm__export_seg(c);
    ps->mech = c;
    return 0;
undo:
    seg_undo(ps->base, ps->size, h, mapped);
    return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
}

/* The pool calls this only for segments no allocation touches, every free's event reached (or
 * for everything at a device reset). */
static void seg_destroy(void *ctx, vmm__seg *ps)
{
    (void)ctx;
    vseg *c = ps->mech;
    if (c->paused) { /* emptied while paused: its handle went at the pause, nothing is mapped */
        if (c->guarded) vmm__guard_unmap(&vmm__S.dev[c->dev], ps->base, ps->size); /* but the scratch */
        free(c);
        return;
    }
    if (c->exported_fd >= 0) close(c->exported_fd); /* its records were retracted before */
    if (c->broker_fd >= 0) {
        close(c->broker_fd);
        __atomic_store_n(&vmm__S.kept_fds, vmm__S.kept_fds - 1, __ATOMIC_RELAXED);
    }
    c->exported_fd = c->broker_fd = -1;
    if (c->exporting) { /* its space goes now; its handle once the broker's export is done */
        CUresult unmap = VMM__TWICE(vmm__cu.MemUnmap(ps->base, ps->size));
        if (unmap)
            vmm__log(VMM__LOG_WARNING, "giving back %llu bytes: cuMemUnmap failed twice (CUDA error %d); the driver "
                     "keeps them until exit", (unsigned long long)ps->size, (int)unmap);
        c->dead = 1;
    } else {
        seg_undo(ps->base, ps->size, c->handle, 1);
        free(c);
    }
    /* a keeper holding this segment lets go of it now rather than at its next tick (one relaxed
     * load when nobody keeps this process) */
    if (vmm__S.registry_ok) vmm__keep_ring(&vmm__S.reg, 0);
}

/* The stream-ordered pool maps an empty segment's handle at a second place, where a request of
 * the stream whose frees are still in flight in it needs room (shim/pool, "moving"). */
static int seg_move(void *ctx, vmm__seg *from, uint64_t base)
{
    device_state *d = ctx;
    vseg *c = from->mech;
    if (vmm__cu.MemMap(base, from->size, 0, c->handle, 0) != CUDA_SUCCESS) return -EIO;
    CUmemAccessDesc acc[MAX_DEVICES];
    if (vmm__cu.MemSetAccess(base, from->size, acc, (size_t)vmm__access_list(d, acc, vmm__pool_kind(d, from->arena->pool) == 0)) != CUDA_SUCCESS) {
        (void)VMM__TWICE(vmm__cu.MemUnmap(base, from->size));
        return -EIO;
    }
    return 0;
}

/* The old place of a moved segment, once the stream reached the frees there: only the mapping goes. */
static void unmap_old(void *ctx, uint64_t base, uint64_t size)
{
    (void)ctx;
    CUresult rc = VMM__TWICE(vmm__cu.MemUnmap(base, size));
    if (rc)
        vmm__log(VMM__LOG_WARNING, "unmapping the old place of a moved segment failed twice (CUDA error %d); its "
                 "address space stays mapped until exit", (int)rc);
}

static int arena_reserve(void *ctx, uint64_t size, uint64_t *base)
{
    device_state *d = ctx;
    CUdeviceptr va = 0;
    if (vmm__cu.MemAddressReserve(&va, size, d->granularity, 0, 0) != CUDA_SUCCESS) return -ENOMEM;
    *base = va;
    return 0;
}

static void arena_unreserve(void *ctx, uint64_t base, uint64_t size)
{
    (void)ctx;
    if (VMM__TWICE(vmm__cu.MemAddressFree(base, size)) != CUDA_SUCCESS)
        vmm__log(VMM__LOG_WARNING, "freeing %llu bytes of address space failed twice; kept until exit", (unsigned long long)size);
}

uint64_t vmm__now_ns(void *ctx)
{
    (void)ctx;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int vmm__event_done(void *ctx, void *e)
{
    (void)ctx;
    CUresult rc = vmm__cu.EventQuery((CUevent)e);
    return rc != CUDA_ERROR_NOT_READY; /* an error will never become "reached": do not wait on it */
}

static void event_release(void *ctx, void *e)
{
    device_state *d = ctx;
    if (d->n_events == d->cap_events) {
        size_t n = d->cap_events ? d->cap_events * 2 : 64;
        CUevent *p = realloc(d->events, n * sizeof *p);
        if (!p) {
            vmm__cu.EventDestroy((CUevent)e);
            return;
        }
        d->events = p;
        d->cap_events = n;
    }
    d->events[d->n_events++] = (CUevent)e;
}

CUevent vmm__event_get_locked(device_state *d)
{
    if (d->n_events) return d->events[--d->n_events];
    CUevent e = NULL;
    return vmm__cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS ? e : NULL;
}

/* The pool asks for the event of a free made without one (vmm__free): recorded now, in the
 * stream's context, it covers the work queued before that free and more. */
static int record_now(void *ctx, uint64_t stream_id, void *stream_ctx, void **out)
{
    device_state *d = ctx;
    CUstream stream = (CUstream)(uintptr_t)stream_id;
    CUcontext popped;
    if (vmm__cu.CtxPushCurrent((CUcontext)stream_ctx) != CUDA_SUCCESS) return -1; /* its context is gone */
    int r = -1;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (__atomic_load_n(&vmm__S.captures, __ATOMIC_ACQUIRE) > 0 && vmm__cu.StreamIsCapturing(stream, &st) == CUDA_SUCCESS &&
        st != CU_STREAM_CAPTURE_STATUS_NONE) {
        r = 0; /* a record now would be a node of the graph: after the capture */
    } else {
        CUevent e = vmm__event_get_locked(d);
        if (e && vmm__cu.EventRecord(e, stream) != CUDA_SUCCESS) {
            vmm__cu.EventDestroy(e); /* perhaps made in another context: one of this one */
            if (vmm__cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) e = NULL;
            else if (vmm__cu.EventRecord(e, stream) != CUDA_SUCCESS) vmm__cu.EventDestroy(e), e = NULL;
        }
        if (e) *out = e, r = 1; /* else the stream is gone (destroyed with its context) */
    }
    vmm__cu.CtxPopCurrent(&popped);
    return r;
}

/* A key of vmm__stream_key (streams.c) back into the handle: the allocating thread's own call resolves
 * CU_STREAM_PER_THREAD to that thread's stream. */
static CUstream stream_of_key(uint64_t key) { return (key & 1) && key > 2 ? CU_STREAM_PER_THREAD : (CUstream)(uintptr_t)key; }

/* Another stream takes a free not reached yet (pool.h, VMM_POOL_REUSE_INTERNAL): it waits for the
 * free's event, as the native pool makes it (cudaMemPoolReuseAllowInternalDependencies). */
static int stream_wait(void *ctx, uint64_t stream, void *event)
{
    (void)ctx;
    return vmm__cu.StreamWaitEvent(stream_of_key(stream), (CUevent)event, 0) != CUDA_SUCCESS;
}

/* Stream-ordered memory stays mapped up to the default pool's release threshold, as natively;
 * synchronous memory up to VMMSHIM_CACHE_SIZE (0: native cudaFree keeps none). */
uint64_t vmm__retain_of(const device_state *d, int k) { return k ? d->release_threshold : vmm__S.cache_limit; }

/* Address space reserved at a time: the device's memory, so one arena serves a pool that fills
 * the device (and a program with several pools never runs address space short). */
static uint64_t arena_bytes(device_state *d)
{
    size_t total = 0;
    const uint64_t gib = 1ull << 30;
    if (vmm__cu.DeviceTotalMem(&total, d->index) != CUDA_SUCCESS || total == 0) total = 64 * gib;
    return ((uint64_t)total + gib - 1) / gib * gib;
}

void vmm__pair_init_locked(device_state *d, vmm__pool *pair, uint32_t tag)
{
    vmm__pool_ops ops = {.ctx = d,
                         .reserve = arena_reserve,
                         .unreserve = arena_unreserve,
                         .seg_create = seg_create,
                         .seg_destroy = seg_destroy,
                         .event_done = vmm__event_done,
                         .event_record = record_now,
                         .event_release = event_release,
                         .now_ns = vmm__now_ns,
                         .seg_move = seg_move,
                         .unmap_old = unmap_old,
                         .stream_wait = vmm__cu.StreamWaitEvent ? stream_wait : NULL,
                         .followed = vmm__followed};
    uint64_t arena = arena_bytes(d);
    for (int k = 0; k < 2; k++) {
        vmm__pool_init(&pair[k], &ops, d->granularity, arena, vmm__retain_of(d, k), vmm__S.isolate);
        pair[k].tag = tag;
        if (k) pair[k].reuse &= ~d->reuse_off;
    }
    pair[0].exact = 1; /* cudaMalloc: natively each allocation is memory of its own, gone at its free */
    if (!vmm__S.isolate) pair[1].seg_max = VMM_POOL_SEG_MAX; /* a pool that is seldom trimmed: holes go back in pieces */
}

void vmm__pools_ready_locked(device_state *d)
{
    if (d->pool_ready) return;
    vmm__pair_init_locked(d, d->pool, 0);
    d->pool_ready = 1;
}

device_state *vmm__dev_of_block(const vmm__block *b)
{
    return &vmm__S.dev[((vseg *)vmm__pool_seg_at(b->arena, b->arena->pool->granule, b->addr)->mech)->dev];
}

/* The segments under block b, in address order: the first, their number and their bytes. */
vmm__seg *vmm__span_of(const vmm__block *b, uint32_t *n, uint64_t *bytes)
{
    uint64_t g = b->arena->pool->granule, end = b->addr + b->size;
    vmm__seg *first = vmm__pool_seg_at(b->arena, g, b->addr);
    *n = 0;
    *bytes = 0;
    for (vmm__seg *s = first; s; s = s->base + s->size < end ? vmm__pool_seg_at(b->arena, g, s->base + s->size) : NULL) {
        (*n)++;
        *bytes += s->size;
    }
    return first;
}
