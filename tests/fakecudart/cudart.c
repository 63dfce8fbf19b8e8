/* An emulated CUDA runtime over the emulated driver: just enough of libcudart for the shim's
 * CPU tests.  Semantics follow the real runtime where the tests look: error codes, the sticky
 * last error, cudaFree synchronizing, cudaFree(NULL) succeeding, primary-context binding. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#define API __attribute__((visibility("default")))

static __thread int cur_dev;
static __thread cudaError_t last_error;

static cudaError_t map(CUresult r)
{
    switch (r) {
    case CUDA_SUCCESS: return cudaSuccess;
    case CUDA_ERROR_OUT_OF_MEMORY: return cudaErrorMemoryAllocation;
    case CUDA_ERROR_INVALID_VALUE: return cudaErrorInvalidValue;
    case CUDA_ERROR_NOT_READY: return cudaErrorNotReady;
    case CUDA_ERROR_INVALID_DEVICE: return cudaErrorInvalidDevice;
    case CUDA_ERROR_NOT_SUPPORTED: return cudaErrorNotSupported;
    case CUDA_ERROR_INVALID_HANDLE: return cudaErrorInvalidResourceHandle;
    default: return cudaErrorUnknown;
    }
}

static cudaError_t ret(cudaError_t e)
{
    if (e != cudaSuccess && e != cudaErrorNotReady) last_error = e;
    return e;
}

/* The runtime binds the current device's primary context on a thread's first call. */
static cudaError_t ensure_ctx(void)
{
    CUresult r = cuInit(0);
    if (r != CUDA_SUCCESS) return map(r);
    CUcontext ctx = NULL;
    cuCtxGetCurrent(&ctx);
    if (ctx) return cudaSuccess;
    if ((r = cuDevicePrimaryCtxRetain(&ctx, cur_dev)) != CUDA_SUCCESS) return map(r);
    return map(cuCtxSetCurrent(ctx));
}

#define ENSURE()                                                                                        \
    do {                                                                                                \
        cudaError_t e_ = ensure_ctx();                                                                  \
        if (e_ != cudaSuccess) return ret(e_);                                                          \
    } while (0)

/* The version of the headers it was built with (CUDA 13's, also as tests' libcudart.so.11.0); the
 * driver's from the driver, as NVIDIA's runtime reports it. */
API cudaError_t cudaRuntimeGetVersion(int *v)
{
    if (!v) return ret(cudaErrorInvalidValue);
    *v = CUDART_VERSION;
    return cudaSuccess;
}

API cudaError_t cudaDriverGetVersion(int *v)
{
    if (!v) return ret(cudaErrorInvalidValue);
    return ret(map(cuDriverGetVersion(v)));
}

API cudaError_t cudaGetDeviceCount(int *n)
{
    cuInit(0);
    return ret(map(cuDeviceGetCount(n)));
}
API cudaError_t cudaGetDevice(int *d)
{
    if (!d) return ret(cudaErrorInvalidValue);
    *d = cur_dev;
    return cudaSuccess;
}
API cudaError_t cudaSetDevice(int d)
{
    int n = 0;
    cuInit(0);
    cuDeviceGetCount(&n);
    if (d < 0 || d >= n) return ret(cudaErrorInvalidDevice);
    cur_dev = d;
    CUcontext ctx;
    CUresult r = cuDevicePrimaryCtxRetain(&ctx, d);
    if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(ctx);
    return ret(map(r));
}
API cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
API cudaError_t cudaPeekAtLastError(void) { return last_error; }
API const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    default: return "cudaErrorUnknown";
    }
}
API const char *cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

API cudaError_t cudaMalloc(void **p, size_t size)
{
    if (!p) return ret(cudaErrorInvalidValue);
    ENSURE();
    if (size == 0) {
        *p = NULL;
        return cudaSuccess;
    }
    CUdeviceptr d = 0;
    cudaError_t e = map(cuMemAlloc(&d, size));
    if (e == cudaSuccess) *p = (void *)(uintptr_t)d;
    return ret(e);
}
/* Streams capturing now: the real cudaFree then defers its synchronization instead of breaking
 * the captures (seen on an H100 in relaxed and thread-local mode). */
static int captures;

API cudaError_t cudaFree(void *p)
{
    ENSURE();
    if (!p) return cudaSuccess;
    if (!__atomic_load_n(&captures, __ATOMIC_ACQUIRE)) cuCtxSynchronize();
    return ret(map(cuMemFree((CUdeviceptr)(uintptr_t)p)));
}
static cudaError_t malloc_async(void **p, size_t size, CUstream s)
{
    if (!p) return ret(cudaErrorInvalidValue);
    ENSURE();
    if (size == 0) {
        *p = NULL;
        return cudaSuccess;
    }
    CUdeviceptr d = 0;
    cudaError_t e = map(cuMemAllocAsync(&d, size, s));
    if (e == cudaSuccess) *p = (void *)(uintptr_t)d;
    return ret(e);
}
API cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s) { return malloc_async(p, size, (CUstream)s); }
API cudaError_t cudaMallocAsync_ptsz(void **p, size_t size, cudaStream_t s)
{
    return malloc_async(p, size, s ? (CUstream)s : CU_STREAM_PER_THREAD);
}
static cudaError_t free_async(void *p, CUstream s)
{
    ENSURE();
    if (!p) return cudaSuccess;
    return ret(map(cuMemFreeAsync((CUdeviceptr)(uintptr_t)p, s)));
}
API cudaError_t cudaFreeAsync(void *p, cudaStream_t s) { return free_async(p, (CUstream)s); }
API cudaError_t cudaFreeAsync_ptsz(void *p, cudaStream_t s) { return free_async(p, s ? (CUstream)s : CU_STREAM_PER_THREAD); }
API cudaError_t cudaMemGetInfo(size_t *f, size_t *t)
{
    ENSURE();
    return ret(map(cuMemGetInfo(f, t)));
}
API cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
    (void)kind;
    ENSURE();
    return ret(map(cuMemcpy((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n)));
}
API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s)
{
    (void)s;
    return cudaMemcpy(dst, src, n, kind);
}
API cudaError_t cudaMemset(void *p, int v, size_t n)
{
    ENSURE();
    return ret(map(cuMemsetD8((CUdeviceptr)(uintptr_t)p, (unsigned char)v, n)));
}
API cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s)
{
    (void)s;
    return cudaMemset(p, v, n);
}
API cudaError_t cudaDeviceReset(void)
{
    cuInit(0);
    return ret(map(cuDevicePrimaryCtxReset_v2(cur_dev)));
}
API cudaError_t cudaDeviceSynchronize(void)
{
    ENSURE();
    return ret(map(cuCtxSynchronize()));
}
API cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    ENSURE();
    return ret(map(cuStreamCreate((CUstream *)s, 0)));
}
API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    ENSURE();
    return ret(map(cuStreamCreate((CUstream *)s, flags)));
}
API cudaError_t cudaStreamDestroy(cudaStream_t s) { return ret(map(cuStreamDestroy((CUstream)s))); }
API cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    ENSURE();
    return ret(map(cuStreamSynchronize((CUstream)s)));
}
API cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode)
{
    CUresult r = cuStreamBeginCapture((CUstream)s, (CUstreamCaptureMode)mode);
    if (r == CUDA_SUCCESS) __atomic_add_fetch(&captures, 1, __ATOMIC_ACQ_REL);
    return ret(map(r));
}
API cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g)
{
    CUstreamCaptureStatus was = CU_STREAM_CAPTURE_STATUS_NONE;
    cuStreamIsCapturing((CUstream)s, &was);
    CUresult r = cuStreamEndCapture((CUstream)s, (CUgraph *)g);
    if (was != CU_STREAM_CAPTURE_STATUS_NONE) __atomic_sub_fetch(&captures, 1, __ATOMIC_ACQ_REL);
    return ret(map(r));
}
/* A captured graph holds no work here (the emulated driver runs nothing): instantiating and
 * launching it succeed and do nothing, enough for programs that capture to run. */
static int the_exec;
API cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags)
{
    (void)flags;
    if (!x || !g) return ret(cudaErrorInvalidValue);
    *x = (cudaGraphExec_t)(void *)&the_exec;
    return cudaSuccess;
}
API cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s)
{
    (void)s;
    return x ? cudaSuccess : ret(cudaErrorInvalidValue);
}
API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x) { return x ? cudaSuccess : ret(cudaErrorInvalidValue); }
API cudaError_t cudaGraphDestroy(cudaGraph_t g) { return g ? cudaSuccess : ret(cudaErrorInvalidValue); }
API cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st)
{
    return ret(map(cuStreamIsCapturing((CUstream)s, (CUstreamCaptureStatus *)st)));
}
API cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    ENSURE();
    return ret(map(cuEventCreate((CUevent *)e, 0)));
}
API cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return ret(map(cuEventRecord((CUevent)e, (CUstream)s))); }
API cudaError_t cudaEventSynchronize(cudaEvent_t e) { return ret(map(cuEventSynchronize((CUevent)e))); }
API cudaError_t cudaEventQuery(cudaEvent_t e) { return ret(map(cuEventQuery((CUevent)e))); }
API cudaError_t cudaEventDestroy(cudaEvent_t e) { return ret(map(cuEventDestroy((CUevent)e))); }
API cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags)
{
    return ret(map(cuStreamWaitEvent((CUstream)s, (CUevent)e, flags)));
}

/* Legacy IPC over the driver's cuIpc* (the emulated driver opens none: NOT_SUPPORTED). */
API cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr)
{
    if (!handle) return ret(cudaErrorInvalidValue);
    ENSURE();
    CUipcMemHandle h;
    cudaError_t e = map(cuIpcGetMemHandle(&h, (CUdeviceptr)(uintptr_t)devPtr));
    if (e == cudaSuccess) memcpy(handle->reserved, h.reserved, sizeof handle->reserved);
    return ret(e);
}
API cudaError_t cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags)
{
    if (!devPtr) return ret(cudaErrorInvalidValue);
    ENSURE();
    CUipcMemHandle h;
    memcpy(h.reserved, handle.reserved, sizeof h.reserved);
    CUdeviceptr d = 0;
    cudaError_t e = map(cuIpcOpenMemHandle(&d, h, flags));
    if (e == cudaSuccess) *devPtr = (void *)(uintptr_t)d;
    return ret(e);
}
API cudaError_t cudaIpcCloseMemHandle(void *devPtr)
{
    ENSURE();
    return ret(map(cuIpcCloseMemHandle((CUdeviceptr)(uintptr_t)devPtr)));
}

/* ---- memory pools ----
 * NVIDIA's runtime (shared or static) links no driver symbol: it dlopen()s libcuda.so.1, takes
 * cuGetProcAddress with dlsym and finds every entry point through it.  The pool functions reach
 * the driver exactly that way, so the shim's tests see them arrive the way NVIDIA's runtime
 * sends them: through the resolvers, never through symbol interposition. */

typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static void *driver_entry(const char *name)
{
    static gpa_fn gpa;
    gpa_fn g = __atomic_load_n(&gpa, __ATOMIC_ACQUIRE);
    if (!g) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        void *sym = h ? dlsym(h, "cuGetProcAddress_v2") : NULL;
        memcpy(&g, &sym, sizeof sym);
        if (!g) return NULL;
        __atomic_store_n(&gpa, g, __ATOMIC_RELEASE);
    }
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (g(name, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS)
        return NULL;
    return fn;
}

/* `var`: the driver's entry point `fn`, found once through cuGetProcAddress. */
#define DRIVER(var, fn)                                                                                 \
    static __typeof__(&fn) var;                                                                         \
    if (!var) {                                                                                         \
        void *p_ = driver_entry(#fn);                                                                   \
        memcpy(&var, &p_, sizeof p_);                                                                   \
    }                                                                                                   \
    if (!var) return ret(cudaErrorInitializationError)

API cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device)
{
    DRIVER(get, cuDeviceGetDefaultMemPool);
    ENSURE();
    return ret(map(get((CUmemoryPool *)pool, device)));
}

API cudaError_t cudaDeviceGetMemPool(cudaMemPool_t *pool, int device)
{
    DRIVER(get, cuDeviceGetMemPool);
    ENSURE();
    return ret(map(get((CUmemoryPool *)pool, device)));
}

API cudaError_t cudaDeviceSetMemPool(int device, cudaMemPool_t pool)
{
    DRIVER(set, cuDeviceSetMemPool);
    ENSURE();
    return ret(map(set(device, (CUmemoryPool)pool)));
}

static CUmemLocation cu_location(const struct cudaMemLocation *l)
{
    CUmemLocation c = {.type = (CUmemLocationType)l->type, .id = l->id};
    return c;
}

API cudaError_t cudaMemGetDefaultMemPool(cudaMemPool_t *pool, struct cudaMemLocation *location, enum cudaMemAllocationType type)
{
    DRIVER(get, cuMemGetDefaultMemPool);
    if (!location) return ret(cudaErrorInvalidValue);
    ENSURE();
    CUmemLocation l = cu_location(location);
    return ret(map(get((CUmemoryPool *)pool, &l, (CUmemAllocationType)type)));
}

API cudaError_t cudaMemGetMemPool(cudaMemPool_t *pool, struct cudaMemLocation *location, enum cudaMemAllocationType type)
{
    DRIVER(get, cuMemGetMemPool);
    if (!location) return ret(cudaErrorInvalidValue);
    ENSURE();
    CUmemLocation l = cu_location(location);
    return ret(map(get((CUmemoryPool *)pool, &l, (CUmemAllocationType)type)));
}

API cudaError_t cudaMemSetMemPool(struct cudaMemLocation *location, enum cudaMemAllocationType type, cudaMemPool_t pool)
{
    DRIVER(set, cuMemSetMemPool);
    if (!location) return ret(cudaErrorInvalidValue);
    ENSURE();
    CUmemLocation l = cu_location(location);
    return ret(map(set(&l, (CUmemAllocationType)type, (CUmemoryPool)pool)));
}

API cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const struct cudaMemPoolProps *props)
{
    DRIVER(create, cuMemPoolCreate);
    if (!props) return ret(cudaErrorInvalidValue);
    ENSURE();
    CUmemPoolProps p;
    memset(&p, 0, sizeof p);
    p.allocType = (CUmemAllocationType)props->allocType;
    p.handleTypes = (CUmemAllocationHandleType)props->handleTypes;
    p.location = cu_location(&props->location);
    p.maxSize = props->maxSize;
    p.usage = props->usage;
    return ret(map(create((CUmemoryPool *)pool, &p)));
}

API cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool)
{
    DRIVER(destroy, cuMemPoolDestroy);
    return ret(map(destroy((CUmemoryPool)pool)));
}

API cudaError_t cudaMemPoolSetAccess(cudaMemPool_t pool, const struct cudaMemAccessDesc *descs, size_t count)
{
    DRIVER(set, cuMemPoolSetAccess);
    if (count && !descs) return ret(cudaErrorInvalidValue);
    CUmemAccessDesc *d = calloc(count ? count : 1, sizeof *d);
    if (!d) return ret(cudaErrorMemoryAllocation);
    for (size_t i = 0; i < count; i++) {
        d[i].location = cu_location(&descs[i].location);
        d[i].flags = (CUmemAccess_flags)descs[i].flags;
    }
    cudaError_t e = map(set((CUmemoryPool)pool, d, count));
    free(d);
    return ret(e);
}

API cudaError_t cudaMemPoolGetAccess(enum cudaMemAccessFlags *flags, cudaMemPool_t pool, struct cudaMemLocation *location)
{
    DRIVER(get, cuMemPoolGetAccess);
    if (!flags || !location) return ret(cudaErrorInvalidValue);
    CUmemLocation l = cu_location(location);
    CUmemAccess_flags f = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    cudaError_t e = map(get(&f, (CUmemoryPool)pool, &l));
    if (e == cudaSuccess) *flags = (enum cudaMemAccessFlags)f;
    return ret(e);
}

API cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value)
{
    DRIVER(set, cuMemPoolSetAttribute);
    return ret(map(set((CUmemoryPool)pool, (CUmemPool_attribute)attr, value)));
}

API cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value)
{
    DRIVER(get, cuMemPoolGetAttribute);
    return ret(map(get((CUmemoryPool)pool, (CUmemPool_attribute)attr, value)));
}

API cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t keep)
{
    DRIVER(trim, cuMemPoolTrimTo);
    return ret(map(trim((CUmemoryPool)pool, keep)));
}

API cudaError_t cudaMallocFromPoolAsync(void **p, size_t size, cudaMemPool_t pool, cudaStream_t s)
{
    DRIVER(alloc, cuMemAllocFromPoolAsync);
    if (!p) return ret(cudaErrorInvalidValue);
    ENSURE();
    if (size == 0) {
        *p = NULL;
        return cudaSuccess;
    }
    CUdeviceptr d = 0;
    cudaError_t e = map(alloc(&d, size, (CUmemoryPool)pool, (CUstream)s));
    if (e == cudaSuccess) *p = (void *)(uintptr_t)d;
    return ret(e);
}
