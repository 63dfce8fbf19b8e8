/* Legacy CUDA IPC, runtime and driver routes.  Forwarding only: shim/backing/ipc.c decides
 * whether a pointer or handle is the shim's; everything else goes to the real function, which
 * also produces the native error for a NULL out-pointer, unknown flags or a missing context.
 * Calls the shim itself makes (vmm__in_shim) go straight through. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <string.h>

#include "backing/ipc.h"
#include "hooks/real.h"

#define VMM_HOOK __attribute__((visibility("default")))

_Static_assert(sizeof(cudaIpcMemHandle_t) == 64 && sizeof(CUipcMemHandle) == 64, "IPC handles are 64 bytes");

typedef CUresult (*drv_ctx_fn)(CUcontext *);



/* Only the flags the real functions accept are emulated; others get the real function's answer. */
static int flags_known(unsigned int flags) { return (flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) == 0; }

/* ---- runtime ---- */

VMM_HOOK cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr)
{
    VMM_REAL_RUNTIME(cudaIpcGetMemHandle, cudaErrorInitializationError);
    if (vmm__in_shim()) return real_(handle, devPtr);
    unsigned char bytes[64];
    if (handle && vmm__ipc_get_handle((uint64_t)(uintptr_t)devPtr, bytes) == VMM__DONE) {
        memcpy(handle->reserved, bytes, sizeof bytes);
        return cudaSuccess;
    }
    vmm__enter();
    cudaError_t rc = real_(handle, devPtr);
    vmm__leave();
    return rc;
}

VMM_HOOK cudaError_t cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle, unsigned int flags)
{
    VMM_REAL_RUNTIME(cudaIpcOpenMemHandle, cudaErrorInitializationError);
    if (vmm__in_shim()) return real_(devPtr, handle, flags);
    cudaError_t rc;
    if (devPtr && flags_known(flags)) {
        uint64_t p = 0;
        unsigned char bytes[64];
        memcpy(bytes, handle.reserved, sizeof bytes);
        switch (vmm__ipc_open(bytes, &p)) {
        case VMM__DONE: *devPtr = (void *)(uintptr_t)p; return cudaSuccess;
        case VMM__INVALID:
            /* The runtime's own invalid-value (and its last error), without letting it near the
             * handle: a NULL out-pointer is refused before anything else. */
            vmm__enter();
            rc = real_(NULL, handle, flags);
            vmm__leave();
            return rc != cudaSuccess ? rc : cudaErrorInvalidValue;
        default: break;
        }
    }
    vmm__enter();
    rc = real_(devPtr, handle, flags);
    vmm__leave();
    return rc;
}

VMM_HOOK cudaError_t cudaIpcCloseMemHandle(void *devPtr)
{
    VMM_REAL_RUNTIME(cudaIpcCloseMemHandle, cudaErrorInitializationError);
    if (vmm__in_shim()) return real_(devPtr);
    if (vmm__ipc_close((uint64_t)(uintptr_t)devPtr) == VMM__DONE) return cudaSuccess;
    vmm__enter();
    cudaError_t rc = real_(devPtr);
    vmm__leave();
    return rc;
}

/* ---- driver (also what the cuGetProcAddress table hands out for these names) ---- */

VMM_HOOK CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    VMM_REAL_DRIVER(cuIpcGetMemHandle, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(pHandle, dptr);
    unsigned char bytes[64];
    if (pHandle && vmm__ipc_get_handle((uint64_t)dptr, bytes) == VMM__DONE) {
        memcpy(pHandle->reserved, bytes, sizeof bytes);
        return CUDA_SUCCESS;
    }
    vmm__enter();
    CUresult rc = real_(pHandle, dptr);
    vmm__leave();
    return rc;
}

/* The driver route needs a current context, as the real one does (it answers INVALID_CONTEXT). */
static int has_context(void)
{
    static drv_ctx_fn get_current;
    if (!get_current) {
        void *found = vmm__real_driver("cuCtxGetCurrent");
        memcpy(&get_current, &found, sizeof found);
    }
    CUcontext ctx = NULL;
    vmm__enter();
    int ok = get_current && get_current(&ctx) == CUDA_SUCCESS && ctx;
    vmm__leave();
    return ok;
}

/* cuda.h names this cuIpcOpenMemHandle (a macro for the _v2 ABI name). */
VMM_HOOK CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    VMM_REAL_DRIVER(cuIpcOpenMemHandle_v2, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(pdptr, handle, Flags);
    if (pdptr && flags_known(Flags) && has_context()) {
        uint64_t p = 0;
        unsigned char bytes[64];
        memcpy(bytes, handle.reserved, sizeof bytes);
        switch (vmm__ipc_open(bytes, &p)) {
        case VMM__DONE: *pdptr = (CUdeviceptr)p; return CUDA_SUCCESS;
        case VMM__INVALID: return CUDA_ERROR_INVALID_VALUE;
        default: break;
        }
    }
    vmm__enter();
    CUresult rc = real_(pdptr, handle, Flags);
    vmm__leave();
    return rc;
}

VMM_HOOK CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    VMM_REAL_DRIVER(cuIpcCloseMemHandle, CUDA_ERROR_NOT_INITIALIZED);
    if (vmm__in_shim()) return real_(dptr);
    if (vmm__ipc_close((uint64_t)dptr) == VMM__DONE) return CUDA_SUCCESS;
    vmm__enter();
    CUresult rc = real_(dptr);
    vmm__leave();
    return rc;
}
