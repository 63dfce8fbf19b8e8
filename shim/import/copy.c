/* The import mechanism (shim/import): reading an import's bytes into host memory (vmm_import_read, vmm_import_copy).
 *
 * vmm_import_copy is a two-stage pipeline: the driver copies piece k+1 device-to-host into one
 * pinned buffer on a private stream while the caller's sink consumes piece k from the other, so
 * a sink that writes a file hides the copy (or the copy hides a fast sink) instead of adding to
 * it.  The driver is dlopen'ed on first use, as in driver.c; nothing here links it.  Rules as
 * in records.c: never print, never exit, every failure leaves a one-line reason. */
#include "api/vmm_api.h"

#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "import/import.h"

#define set_err vmm__error

/* Pieces are a quarter of the copy, so that a short copy overlaps too, between 1 MiB and
 * 16 MiB.  The bus reaches its full rate well below 16 MiB per copy, and at 16 MiB a piece
 * still takes ~300 us at 50 GB/s, ample time for the loop to queue the next one; a larger piece
 * gains nothing but costs more to pin (pinning runs at a few GB/s: 2 x 64 MiB would cost a
 * 4 GiB copy a large part of its own time). */
#define PIECE_MIN ((uint64_t)1 << 20)
#define PIECE_MAX ((uint64_t)16 << 20)

/* ------------------------------------------------------------------------------------------ */
/* The driver, found at run time                                                              */

typedef struct copy_api {
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned int);
    CUresult (*MemFreeHost)(void *);
    CUresult (*StreamCreate)(CUstream *, unsigned int);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*GetErrorName)(CUresult, const char **);
} copy_api;

static copy_api drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static char drv_error[200]; /* why the driver cannot be used; "" when it can */

/* The exported ABI names (cuda.h maps cuMemcpyDtoH and friends to these _v2 symbols). */
static void driver_load(void)
{
    const vmm__driver_sym syms[] = {
#define SYM(field, name) {name, (void **)&drv.field, false}
        SYM(CtxGetCurrent, "cuCtxGetCurrent"),
        SYM(CtxSetCurrent, "cuCtxSetCurrent"),
        SYM(CtxGetDevice, "cuCtxGetDevice"),
        SYM(CtxPushCurrent, "cuCtxPushCurrent_v2"),
        SYM(CtxPopCurrent, "cuCtxPopCurrent_v2"),
        SYM(DeviceGet, "cuDeviceGet"),
        SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
        SYM(MemcpyDtoH, "cuMemcpyDtoH_v2"),
        SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
        SYM(MemHostAlloc, "cuMemHostAlloc"),
        SYM(MemFreeHost, "cuMemFreeHost"),
        SYM(StreamCreate, "cuStreamCreate"),
        SYM(StreamSynchronize, "cuStreamSynchronize"),
        SYM(StreamDestroy, "cuStreamDestroy_v2"),
        SYM(EventCreate, "cuEventCreate"),
        SYM(EventRecord, "cuEventRecord"),
        SYM(EventSynchronize, "cuEventSynchronize"),
        SYM(EventDestroy, "cuEventDestroy_v2"),
        SYM(GetErrorName, "cuGetErrorName"),
#undef SYM
    };
    (void)vmm__driver_load(syms, sizeof syms / sizeof syms[0], &drv, sizeof drv, drv_error, sizeof drv_error);
}

static vmm_status driver_ready(void)
{
    pthread_once(&drv_once, driver_load);
    return drv_error[0] ? set_err(VMM_ERR_CUDA, "%s", drv_error) : VMM_OK;
}

static vmm_status cu_fail(const char *what, CUresult r)
{
    const char *name = NULL;
    if (drv.GetErrorName(r, &name) != CUDA_SUCCESS || !name) name = "CUDA_ERROR_UNKNOWN";
    return set_err(VMM_ERR_CUDA, "%s failed: %s (%d)", what, name, (int)r);
}

/* The device's primary context (retained for the process's life, as vmm_import retains it). */
static vmm_status primary_context(int device, CUcontext *ctx)
{
    CUdevice dev;
    CUresult r;
    if ((r = drv.DeviceGet(&dev, device)) != CUDA_SUCCESS) return cu_fail("cuDeviceGet", r);
    if ((r = drv.DevicePrimaryCtxRetain(ctx, dev)) != CUDA_SUCCESS) return cu_fail("cuDevicePrimaryCtxRetain", r);
    return VMM_OK;
}

/* A copy runs in the current context, and the driver refuses one of VMM memory that context's
 * device was not granted (CUDA_ERROR_INVALID_VALUE on an H100).  A thread without a context gets
 * the import's device's primary one; a thread on another device has that one pushed for the copy
 * (*pushed: pop it after). */
static vmm_status use_context(int device, int *pushed)
{
    CUcontext cur = NULL;
    CUdevice on;
    *pushed = 0;
    CUresult r = drv.CtxGetCurrent(&cur);
    if (r != CUDA_SUCCESS) return cu_fail("cuCtxGetCurrent", r);
    if (cur && drv.CtxGetDevice(&on) == CUDA_SUCCESS && on == device) return VMM_OK;
    CUcontext mine;
    vmm_status st = primary_context(device, &mine);
    if (st != VMM_OK) return st;
    if (!cur) return (r = drv.CtxSetCurrent(mine)) == CUDA_SUCCESS ? VMM_OK : cu_fail("cuCtxSetCurrent", r);
    if ((r = drv.CtxPushCurrent(mine)) != CUDA_SUCCESS) return cu_fail("cuCtxPushCurrent", r);
    *pushed = 1;
    return VMM_OK;
}

static void done_with_context(int pushed)
{
    CUcontext popped;
    if (pushed) (void)drv.CtxPopCurrent(&popped);
}

/* [offset, offset + length) within the import, and the driver ready in a context. */
static vmm_status prepare(const vmm_imported *imp, uint64_t offset, uint64_t length, const char *fn, int *pushed)
{
    *pushed = 0;
    if (!imp) return set_err(VMM_ERR_INVALID, "%s: imp is NULL", fn);
    uint64_t size = vmm__import_size(imp);
    if (offset > size || length > size - offset)
        return set_err(VMM_ERR_INVALID, "%s: %llu bytes at offset %llu run past the import's %llu bytes", fn,
                       (unsigned long long)length, (unsigned long long)offset, (unsigned long long)size);
    vmm_status st = driver_ready();
    return st == VMM_OK ? use_context(vmm__import_device(imp), pushed) : st;
}

vmm_status vmm__import_read(const vmm_imported *imp, uint64_t offset, void *dst, uint64_t length)
{
    if (length && !dst) return set_err(VMM_ERR_INVALID, "vmm_import_read: dst is NULL");
    int pushed;
    vmm_status st = prepare(imp, offset, length, "vmm_import_read", &pushed);
    if (st == VMM_OK && length) {
        CUresult r = drv.MemcpyDtoH(dst, (CUdeviceptr)(vmm__import_ptr(imp) + offset), (size_t)length);
        if (r != CUDA_SUCCESS) st = cu_fail("cuMemcpyDtoH", r);
    }
    done_with_context(pushed);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Pinned buffers                                                                              */

/* Pinning is slower per byte than the copy itself, so a pair made for each call would cost a
 * dump of many allocations more than its copies.  Pairs are kept instead, in a process-wide
 * free list rather than per thread: a call takes a pair and gives it back, so
 * threads that come and go (a pool's workers) leave no pinned memory behind and no driver call
 * is needed in a thread's exit path, and the list holds as many pairs as calls ever ran at once.
 * Each buffer is made under its device's primary context (which this library never releases)
 * and portable (pinned for every context of the process), so that no context the caller
 * destroys takes it along.  A program that resets that primary context itself
 * (cuDevicePrimaryCtxReset, cudaDeviceReset) frees them behind the list's back: not supported. */
typedef struct staging {
    void *buf[2];
    size_t size; /* bytes of each buffer; 0 before the first use */
    int device;  /* whose primary context made them */
    struct staging *next;
} staging;

static staging *idle_staging;
static pthread_mutex_t staging_lock = PTHREAD_MUTEX_INITIALIZER;

static staging *staging_take(void)
{
    pthread_mutex_lock(&staging_lock);
    staging *s = idle_staging;
    if (s) idle_staging = s->next;
    pthread_mutex_unlock(&staging_lock);
    return s ? s : calloc(1, sizeof *s);
}

static void staging_give(staging *s)
{
    pthread_mutex_lock(&staging_lock);
    s->next = idle_staging;
    idle_staging = s;
    pthread_mutex_unlock(&staging_lock);
}

/* Buffers are made and freed under their device's primary context; *prev is the caller's. */
static vmm_status enter_primary(int device, CUcontext *prev)
{
    CUcontext prim = NULL;
    CUresult r = drv.CtxGetCurrent(prev);
    if (r != CUDA_SUCCESS) return cu_fail("cuCtxGetCurrent", r);
    vmm_status st = primary_context(device, &prim);
    if (st == VMM_OK && (r = drv.CtxSetCurrent(prim)) != CUDA_SUCCESS) st = cu_fail("cuCtxSetCurrent", r);
    return st;
}

/* Buffers of at least `need` bytes (sizes double from PIECE_MIN, so a pair serving copies of
 * every size is remade at most four times). */
static vmm_status staging_fit(staging *s, uint64_t need, int device)
{
    if (s->size >= need) return VMM_OK;
    size_t size = (size_t)PIECE_MIN;
    while (size < need) size *= 2;
    CUcontext prev = NULL;
    vmm_status st;
    if (s->size) {
        if ((st = enter_primary(s->device, &prev)) != VMM_OK) return st;
        (void)drv.MemFreeHost(s->buf[0]);
        (void)drv.MemFreeHost(s->buf[1]);
        s->buf[0] = s->buf[1] = NULL;
        s->size = 0;
        (void)drv.CtxSetCurrent(prev);
    }
    if ((st = enter_primary(device, &prev)) != VMM_OK) return st;
    for (int i = 0; i < 2 && st == VMM_OK; i++) {
        CUresult r = drv.MemHostAlloc(&s->buf[i], size, CU_MEMHOSTALLOC_PORTABLE);
        if (r == CUDA_SUCCESS) continue;
        s->buf[i] = NULL;
        st = r == CUDA_ERROR_OUT_OF_MEMORY
                 ? set_err(VMM_ERR_NOMEM, "cuMemHostAlloc of %zu bytes: out of page-locked memory", size)
                 : cu_fail("cuMemHostAlloc", r);
    }
    if (st == VMM_OK) {
        s->size = size;
        s->device = device;
    } else if (s->buf[0]) {
        (void)drv.MemFreeHost(s->buf[0]);
        s->buf[0] = NULL;
    }
    (void)drv.CtxSetCurrent(prev);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* The pipeline                                                                                */

typedef struct pipeline {
    CUstream stream;
    CUevent done[2]; /* done[b]: the copy into buffer b has landed */
    staging *s;
    CUdeviceptr src;
    uint64_t length, piece;
} pipeline;

/* Queue the copy of piece k into buffer k % 2 and the event that tells it has landed. */
static vmm_status issue(pipeline *p, uint64_t k)
{
    uint64_t at = k * p->piece, len = p->length - at < p->piece ? p->length - at : p->piece;
    CUresult r = drv.MemcpyDtoHAsync(p->s->buf[k & 1], p->src + at, (size_t)len, p->stream);
    if (r != CUDA_SUCCESS) return cu_fail("cuMemcpyDtoHAsync", r);
    if ((r = drv.EventRecord(p->done[k & 1], p->stream)) != CUDA_SUCCESS) return cu_fail("cuEventRecord", r);
    return VMM_OK;
}

static vmm_status run(pipeline *p, vmm_sink_fn sink, void *ctx)
{
    uint64_t n = (p->length + p->piece - 1) / p->piece;
    vmm_status st = issue(p, 0);
    for (uint64_t k = 0; k < n && st == VMM_OK; k++) {
        /* buffer (k+1) % 2 was consumed by the sink's previous call: refill it first */
        if (k + 1 < n && (st = issue(p, k + 1)) != VMM_OK) break;
        CUresult r = drv.EventSynchronize(p->done[k & 1]);
        if (r != CUDA_SUCCESS) return cu_fail("cuEventSynchronize", r);
        uint64_t at = k * p->piece, len = p->length - at < p->piece ? p->length - at : p->piece;
        if (sink(ctx, p->s->buf[k & 1], len, at) != 0)
            st = set_err(VMM_ERR_IO, "vmm_import_copy: the sink stopped the copy after %llu of %llu bytes",
                         (unsigned long long)at, (unsigned long long)p->length);
    }
    return st;
}

static vmm_status copy_in_context(const vmm_imported *imp, uint64_t offset, uint64_t length, vmm_sink_fn sink, void *ctx)
{
    vmm_status st = VMM_OK;
    pipeline p = {.src = (CUdeviceptr)(vmm__import_ptr(imp) + offset), .length = length};
    p.piece = length / 4 < PIECE_MIN ? PIECE_MIN : length / 4 > PIECE_MAX ? PIECE_MAX : length / 4;
    if (!(p.s = staging_take())) return set_err(VMM_ERR_NOMEM, "vmm_import_copy: out of memory");
    if ((st = staging_fit(p.s, length < p.piece ? length : p.piece, vmm__import_device(imp))) != VMM_OK) {
        staging_give(p.s);
        return st;
    }
    CUresult r = drv.StreamCreate(&p.stream, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) {
        staging_give(p.s);
        return cu_fail("cuStreamCreate", r);
    }
    int events = 0;
    for (; events < 2; events++)
        if ((r = drv.EventCreate(&p.done[events], CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS) {
            st = cu_fail("cuEventCreate", r);
            break;
        }
    if (st == VMM_OK) st = run(&p, sink, ctx);
    /* A copy may still be in flight into a buffer (a failure or a stopping sink left it there):
     * the buffers go back to the list only once the stream is idle.  If even that fails the
     * context is broken and the pair is left alone, neither reused nor freed under a copy. */
    bool idle = (r = drv.StreamSynchronize(p.stream)) == CUDA_SUCCESS;
    if (!idle && st == VMM_OK) st = cu_fail("cuStreamSynchronize", r);
    for (int i = 0; i < events; i++) (void)drv.EventDestroy(p.done[i]);
    (void)drv.StreamDestroy(p.stream);
    if (idle) staging_give(p.s);
    return st;
}

vmm_status vmm__import_copy(const vmm_imported *imp, uint64_t offset, uint64_t length, vmm_sink_fn sink,
                                      void *ctx)
{
    if (!sink) return set_err(VMM_ERR_INVALID, "vmm_import_copy: sink is NULL");
    int pushed;
    vmm_status st = prepare(imp, offset, length, "vmm_import_copy", &pushed);
    if (st == VMM_OK && length) st = copy_in_context(imp, offset, length, sink, ctx);
    done_with_context(pushed);
    return st;
}
