/* The resolvers through which programs reach the driver without linking it: dlsym (a static
 * runtime dlopen()s libcuda.so.1 and asks for cuGetProcAddress_v2), the driver's own
 * cuGetProcAddress, and the runtime's cudaGetDriverEntryPoint*.  Real-first: the real resolver
 * answers with the caller's exact arguments, and only a successful answer whose function pointer
 * IS one of the driver functions the shim wraps is swapped for the wrapper.  Names are never
 * guessed from (cudnn*, other cu* names and missing symbols come back untouched). */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hooks/real.h"

#define VMM_HOOK __attribute__((visibility("default")))
/* dlsym is called by sanitizer runtimes while they start, before their shadow memory exists:
 * what runs on that path must not be instrumented in the sanitizer builds. */
#define VMM_EARLY __attribute__((no_sanitize_address, no_sanitize_thread))

/* ---- which driver functions are wrapped: exact ABI names, matched by pointer identity ---- */

#define WRAPPED(X)                                                                                    \
    X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemFreeAsync)     \
    X(cuMemFreeAsync_ptsz) X(cuMemAllocPitch_v2) X(cuMemGetInfo_v2) X(cuMemGetAddressRange_v2)        \
    X(cuPointerGetAttribute) X(cuPointerGetAttributes) X(cuCtxEnablePeerAccess)                       \
    X(cuCtxDisablePeerAccess) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle)  \
    X(cuMemPoolSetAccess) X(cuMemPoolGetAttribute) X(cuMemPoolSetAttribute) X(cuMemPoolTrimTo)        \
    X(cuDeviceSetMemPool) X(cuMemSetMemPool) X(cuMemCreate) X(cuMemGetAllocationPropertiesFromHandle)       \
    X(cuMemMap) X(cuMemUnmap) X(cuMemRelease) X(cuMemExportToShareableHandle) X(cuMemRetainAllocationHandle) \
    X(cuDevicePrimaryCtxReset_v2) X(cuStreamBeginCapture_v2)          \
    X(cuStreamBeginCapture_v2_ptsz) X(cuStreamBeginCapture) X(cuStreamBeginCapture_ptsz)              \
    X(cuStreamBeginCaptureToGraph) X(cuStreamBeginCaptureToGraph_ptsz) X(cuStreamEndCapture)          \
    X(cuStreamEndCapture_ptsz) X(cuCtxSynchronize) X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz)   \
    X(cuStreamDestroy_v2) X(cuStreamDestroy) X(cuEventRecord) X(cuEventRecord_ptsz)                  \
    X(cuEventRecordWithFlags) X(cuEventRecordWithFlags_ptsz) X(cuStreamWaitEvent)                     \
    X(cuStreamWaitEvent_ptsz) X(cuEventDestroy_v2) X(cuEventDestroy)                                  \
    X(cuGetProcAddress) X(cuGetProcAddress_v2)

typedef struct wrap_entry {
    const char *name;
    void *wrapper, *real;
} wrap_entry;

#define ENTRY(fn) {#fn, NULL, NULL},
static wrap_entry table[] = {WRAPPED(ENTRY)};
#undef ENTRY
#define N_WRAPPED (sizeof table / sizeof table[0])
static int table_ready;
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_table(void)
{
    size_t i = 0;
    /* the wrappers are this library's own definitions of the same names */
#define FILL(fn)                                                                                      \
    {                                                                                                 \
        __typeof__(&fn) w_ = fn;                                                                      \
        memcpy(&table[i].wrapper, &w_, sizeof w_);                                                    \
        table[i].real = vmm__real_driver(#fn);                                                        \
        i++;                                                                                          \
    }
    WRAPPED(FILL)
#undef FILL
    __atomic_store_n(&table_ready, 1, __ATOMIC_RELEASE);
}

/* The wrapper for a real driver function pointer, or the pointer itself. */
VMM_EARLY static void *wrap_driver_fn(void *fn)
{
    if (!fn) return fn;
    if (!__atomic_load_n(&table_ready, __ATOMIC_ACQUIRE)) {
        /* only once the process has loaded the driver: never load it on someone's behalf */
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!h) return fn;
        dlclose(h);
        pthread_once(&table_once, build_table);
    }
    for (size_t i = 0; i < N_WRAPPED; i++)
        if (table[i].real == fn) return table[i].wrapper;
    return fn;
}

/* ---- dlsym ---- */

/* RTLD_NEXT means "after the caller's object"; forwarded from here it would mean "after the shim",
 * so search the objects loaded after the caller ourselves. */
static int loader_done; /* set once this library's constructors run: dlopen is safe from then on */
__attribute__((constructor)) static void mark_loaded(void) { __atomic_store_n(&loader_done, 1, __ATOMIC_RELEASE); }

VMM_EARLY static void *next_after(const void *caller, const char *name)
{
    Dl_info info;
    struct link_map *lm = NULL;
    /* Before the loader has finished (a sanitizer runtime resolving its interceptors), dlopen may
     * not be called; the callers then are the preloads ahead of the shim, for whom "after the
     * shim" is the same search but for the shim's own exports. */
    if (!__atomic_load_n(&loader_done, __ATOMIC_ACQUIRE) || !dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) || !lm)
        return vmm__real_dlsym(RTLD_NEXT, name);
    for (struct link_map *l = lm->l_next; l; l = l->l_next) {
        void *h = dlopen(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        void *p = vmm__real_dlsym(h, name);
        dlclose(h);
        if (p) return p;
    }
    return NULL;
}

VMM_HOOK VMM_EARLY void *dlsym(void *handle, const char *name)
{
    void *p = handle == RTLD_NEXT ? next_after(__builtin_return_address(0), name) : vmm__real_dlsym(handle, name);
    /* cheap filter first: every wrapped name starts with "cu" */
    if (p && name[0] == 'c' && name[1] == 'u') p = wrap_driver_fn(p);
    return p;
}

/* ---- the driver's resolver ---- */


VMM_HOOK CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags)
{
    VMM_REAL_DRIVER(cuGetProcAddress, CUDA_ERROR_NOT_INITIALIZED);
    CUresult rc = real_(symbol, pfn, cuda_version, flags);
    if (rc == CUDA_SUCCESS && pfn) *pfn = wrap_driver_fn(*pfn);
    return rc;
}

VMM_HOOK CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
                                      CUdriverProcAddressQueryResult *status)
{
    VMM_REAL_DRIVER(cuGetProcAddress_v2, CUDA_ERROR_NOT_INITIALIZED);
    CUresult rc = real_(symbol, pfn, cuda_version, flags, status);
    if (rc == CUDA_SUCCESS && pfn) *pfn = wrap_driver_fn(*pfn);
    return rc;
}

/* ---- the runtime's resolvers (they reach the driver's resolver internally; wrap what they return) ----
 * cudaGetDriverEntryPoint is deprecated, but programs still call it: interposing it is the point. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

cudaError_t cudaGetDriverEntryPoint_ptsz(const char *, void **, unsigned long long, enum cudaDriverEntryPointQueryResult *);
cudaError_t cudaGetDriverEntryPointByVersion_ptsz(const char *, void **, unsigned int, unsigned long long,
                                                  enum cudaDriverEntryPointQueryResult *);


VMM_HOOK cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **pfn, unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status)
{
    VMM_REAL_RUNTIME(cudaGetDriverEntryPoint, cudaErrorInitializationError);
    cudaError_t rc = real_(symbol, pfn, flags, status);
    if (rc == cudaSuccess && pfn) *pfn = wrap_driver_fn(*pfn);
    return rc;
}

VMM_HOOK cudaError_t cudaGetDriverEntryPoint_ptsz(const char *symbol, void **pfn, unsigned long long flags,
                                                  enum cudaDriverEntryPointQueryResult *status)
{
    VMM_REAL_RUNTIME(cudaGetDriverEntryPoint_ptsz, cudaErrorInitializationError);
    cudaError_t rc = real_(symbol, pfn, flags, status);
    if (rc == cudaSuccess && pfn) *pfn = wrap_driver_fn(*pfn);
    return rc;
}

VMM_HOOK cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **pfn, unsigned int version,
                                                      unsigned long long flags, enum cudaDriverEntryPointQueryResult *status)
{
    VMM_REAL_RUNTIME(cudaGetDriverEntryPointByVersion, cudaErrorInitializationError);
    cudaError_t rc = real_(symbol, pfn, version, flags, status);
    if (rc == cudaSuccess && pfn) *pfn = wrap_driver_fn(*pfn);
    return rc;
}

VMM_HOOK cudaError_t cudaGetDriverEntryPointByVersion_ptsz(const char *symbol, void **pfn, unsigned int version,
                                                           unsigned long long flags,
                                                           enum cudaDriverEntryPointQueryResult *status)
{
    VMM_REAL_RUNTIME(cudaGetDriverEntryPointByVersion_ptsz, cudaErrorInitializationError);
    cudaError_t rc = real_(symbol, pfn, version, flags, status);
    if (rc == cudaSuccess && pfn) *pfn = wrap_driver_fn(*pfn);
    return rc;
}
