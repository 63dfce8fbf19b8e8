/* The floor of shim/import: errors named for the public function, and the CUDA driver, found at
 * run time.  Nothing here links libcuda: the client library must load in a process without a GPU
 * (vmmctl list), and the shim must not pull the driver in before the program does.  Every other
 * file of the folder calls down into this one; this one calls only records.c (the error line).
 * Rules as in records.c: never print, never exit, every failure leaves a one-line reason. */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "import/internal.h"

/* The name a caller knows a function by: vmm__import is vmm_import of vmmshim.h. */
const char *vmm__public_name(const char *fn)
{
    static const char *const names[][2] = {
        {"vmm__import", "vmm_import"},         {"vmm__import_fd", "vmm_import_fd"},
        {"vmm__import_check", "vmm_import_check"}, {"vmm__import_last_timing", "vmm_import_last_timing"},
        {"vmm__import_range", "vmm_import_range"}, {"vmm__import_many", "vmm_import_many"},
        {"vmm__import_many_last_timing", "vmm_import_many_last_timing"},
        {"vmm__import_many_begin", "vmm_import_many_begin"}, {"vmm__import_many_end", "vmm_import_many_end"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(fn, names[i][0]) == 0) return names[i][1];
    return fn;
}

/* ------------------------------------------------------------------------------------------ */
/* The driver, found at run time                                                              */

cuda_api vmm__import_cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static char cu_error[200]; /* why the driver cannot be used; "" when it can */

int vmm__driver_load(const vmm__driver_sym *syms, size_t n, void *table, size_t size, char *err, size_t errlen)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(err, errlen, "libcuda.so.1 not found: %s", e ? e : "dlopen failed");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        void *p = dlsym(h, syms[i].name);
        if (!p && !syms[i].optional) {
            snprintf(err, errlen, "libcuda.so.1 lacks %s (driver too old?)", syms[i].name);
            memset(table, 0, size);
            return -1; /* the handle stays open: harmless, and dlclose of a driver is not */
        }
        memcpy(syms[i].slot, &p, sizeof p);
    }
    return 0;
}

/* The exported ABI names: none of these is renamed to a _v2 by cuda.h at CUDA 13 (the macros in
 * cuda.h only cover e.g. cuDevicePrimaryCtxRelease_v2 and cuMemcpyDtoH_v2, not used here). */
static void cuda_load(void)
{
    const vmm__driver_sym syms[] = {
#define SYM(field, name, opt) {name, (void **)&vmm__import_cu.field, opt}
        SYM(Init, "cuInit", false),
        SYM(CtxGetCurrent, "cuCtxGetCurrent", false),
        SYM(CtxSetCurrent, "cuCtxSetCurrent", false),
        SYM(CtxGetDevice, "cuCtxGetDevice", false),
        SYM(DeviceGet, "cuDeviceGet", true),
        /* which devices a mapping is granted to (devices.c): without them, the calling
         * context's device alone, as before they were used */
        SYM(DeviceGetCount, "cuDeviceGetCount", true),
        SYM(DeviceGetUuid, "cuDeviceGetUuid_v2", true), /* what the shim names a device by */
        SYM(DeviceCanAccessPeer, "cuDeviceCanAccessPeer", true),
        SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", false),
        SYM(MemImportFromShareableHandle, "cuMemImportFromShareableHandle", false),
        SYM(MemAddressReserve, "cuMemAddressReserve", false),
        SYM(MemAddressFree, "cuMemAddressFree", false),
        SYM(MemMap, "cuMemMap", false),
        SYM(MemUnmap, "cuMemUnmap", false),
        SYM(MemSetAccess, "cuMemSetAccess", false),
        SYM(MemRelease, "cuMemRelease", false),
        SYM(MemGetAllocationGranularity, "cuMemGetAllocationGranularity", false),
        SYM(GetErrorName, "cuGetErrorName", true),
#undef SYM
    };
    (void)vmm__driver_load(syms, sizeof syms / sizeof syms[0], &vmm__import_cu, sizeof vmm__import_cu, cu_error, sizeof cu_error);
}

vmm_status vmm__cuda_ready(void)
{
    pthread_once(&cu_once, cuda_load);
    return cu_error[0] ? set_err(VMM_ERR_CUDA, "%s", cu_error) : VMM_OK;
}

vmm_status vmm__cu_fail(const char *what, CUresult r)
{
    const char *name = NULL;
    if (!vmm__import_cu.GetErrorName || vmm__import_cu.GetErrorName(r, &name) != CUDA_SUCCESS || !name) name = "CUDA_ERROR_UNKNOWN";
    return set_err(VMM_ERR_CUDA, "%s failed: %s (%d)", what, name, (int)r);
}
