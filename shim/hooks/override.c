/* The interposed CUDA runtime surface.  Forwarding only: each hook asks shim/backing whether the
 * call is the shim's, and otherwise calls the real function.  Calls the shim itself makes into
 * CUDA (vmm__in_shim) always go straight through, so nothing is wrapped twice. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <string.h>

#include "backing/backing.h"
#include "hooks/real.h"
#include "registry/layout.h"

#define VMM_HOOK __attribute__((visibility("default")))

cudaError_t cudaMallocAsync_ptsz(void **ptr, size_t size, cudaStream_t stream);
cudaError_t cudaFreeAsync_ptsz(void *ptr, cudaStream_t stream);

typedef cudaError_t (*malloc_fn)(void **, size_t);
typedef cudaError_t (*free_fn)(void *);
typedef cudaError_t (*malloc_async_fn)(void **, size_t, cudaStream_t);
typedef cudaError_t (*free_async_fn)(void *, cudaStream_t);


/* The per-thread default stream variants mean stream 0 as that thread's stream. */
static CUstream per_thread(cudaStream_t s) { return s ? (CUstream)s : CU_STREAM_PER_THREAD; }

/* The real allocator's answer to a call the shim passed on for `why`. */
static cudaError_t forward_malloc(vmm__result why, cudaError_t rc, void **ptr, size_t size, uint32_t api, CUstream stream)
{
    if (rc == cudaSuccess) vmm__note_passthrough(why, *ptr, size, api, stream);
    return rc;
}

static cudaError_t call_real_malloc(malloc_fn real, void **ptr, size_t size)
{
    vmm__enter();
    cudaError_t rc = real(ptr, size);
    vmm__leave();
    return rc;
}

VMM_HOOK cudaError_t cudaMalloc(void **ptr, size_t size)
{
    VMM_REAL_RUNTIME(cudaMalloc, cudaErrorInitializationError);
    if (vmm__in_shim()) return real_(ptr, size);
    vmm__result why = vmm__alloc(size, VMM_API_CUDA_MALLOC, 0, NULL, ptr);
    switch (why) {
    case VMM__DONE: return cudaSuccess;
    case VMM__REFUSED: return cudaErrorNotSupported;
    case VMM__MARGIN: return cudaErrorMemoryAllocation;
    default: /* the real allocator decides, so OOM (and the sticky last error) stay native */
        return forward_malloc(why, call_real_malloc(real_, ptr, size), ptr, size, VMM_API_CUDA_MALLOC, NULL);
    }
}

/* A double free or an interior pointer of shim memory: let the runtime itself produce (and
 * record as its last error) the error it gives for a pointer that is no allocation, without
 * letting it near the shim's mapping.  A host address is never device memory. */
static cudaError_t runtime_invalid_free(free_fn real)
{
    char not_device_memory;
    vmm__enter();
    cudaError_t rc = real(&not_device_memory);
    vmm__leave();
    return rc;
}

VMM_HOOK cudaError_t cudaFree(void *ptr)
{
    VMM_REAL_RUNTIME(cudaFree, cudaErrorInitializationError);
    if (!vmm__in_shim()) switch (vmm__free(ptr, 0, NULL)) {
        case VMM__DONE: return cudaSuccess;
        case VMM__INVALID: return runtime_invalid_free(real_);
        default: break;
        }
    vmm__enter();
    cudaError_t rc = real_(ptr);
    vmm__leave();
    return rc;
}

static cudaError_t malloc_async(malloc_async_fn real, void **ptr, size_t size,
                                cudaStream_t stream, CUstream cu_stream)
{
    if (vmm__in_shim()) return real(ptr, size, stream);
    vmm__result why = vmm__stream_capturing(cu_stream) ? VMM__CAPTURED
                                                      : vmm__alloc(size, VMM_API_CUDA_MALLOC_ASYNC, 1, cu_stream, ptr);
    if (why == VMM__DONE) return cudaSuccess;
    if (why == VMM__REFUSED) return cudaErrorNotSupported;
    if (why == VMM__MARGIN) return cudaErrorMemoryAllocation;
    /* captured into a graph, or the device is full: the real pool's memory, noted as not exportable */
    vmm__enter();
    cudaError_t rc = real(ptr, size, stream);
    vmm__leave();
    return forward_malloc(why, rc, ptr, size, VMM_API_CUDA_MALLOC_ASYNC, cu_stream);
}

static cudaError_t free_async(free_async_fn real, void *ptr, cudaStream_t stream, CUstream cu_stream)
{
    char not_device_memory;
    if (!vmm__in_shim()) switch (vmm__free(ptr, 1, cu_stream)) {
        case VMM__DONE: return cudaSuccess;
        case VMM__INVALID: ptr = &not_device_memory; break; /* the runtime's own error, as in cudaFree */
        default: break;
        }
    vmm__enter();
    cudaError_t rc = real(ptr, stream);
    vmm__leave();
    return rc;
}

VMM_HOOK cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream)
{
    VMM_REAL_RUNTIME(cudaMallocAsync, cudaErrorInitializationError);
    return malloc_async(real_, ptr, size, stream, (CUstream)stream);
}

VMM_HOOK cudaError_t cudaMallocAsync_ptsz(void **ptr, size_t size, cudaStream_t stream)
{
    VMM_REAL_RUNTIME(cudaMallocAsync_ptsz, cudaErrorInitializationError);
    return malloc_async(real_, ptr, size, stream, per_thread(stream));
}

VMM_HOOK cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream)
{
    VMM_REAL_RUNTIME(cudaFreeAsync, cudaErrorInitializationError);
    return free_async(real_, ptr, stream, (CUstream)stream);
}

VMM_HOOK cudaError_t cudaFreeAsync_ptsz(void *ptr, cudaStream_t stream)
{
    VMM_REAL_RUNTIME(cudaFreeAsync_ptsz, cudaErrorInitializationError);
    return free_async(real_, ptr, stream, per_thread(stream));
}

/* The runtime may reset the context without the driver entry point the shim wraps. */
VMM_HOOK cudaError_t cudaDeviceReset(void)
{
    VMM_REAL_RUNTIME(cudaDeviceReset, cudaErrorInitializationError);
    if (!vmm__in_shim()) vmm__device_reset(-1);
    vmm__enter();
    cudaError_t rc = real_();
    vmm__leave();
    return rc;
}

VMM_HOOK cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total)
{
    VMM_REAL_RUNTIME(cudaMemGetInfo, cudaErrorInitializationError);
    vmm__enter();
    cudaError_t rc = real_(free_bytes, total);
    vmm__leave();
    if (rc == cudaSuccess && free_bytes) *free_bytes += vmm__pool_free_bytes_current(); /* the pool's free bytes are ours to give back */
    return rc;
}
