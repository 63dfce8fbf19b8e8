/* Devices and access.  Every kind of import (one allocation, a range, a batch) finds the calling
 * thread's context and the devices to grant here, so that they all grant alike.  Calls cache.c
 * (a mapped chunk's devices) and driver.c.
 *
 * Which devices a mapping is granted read-write access to.  The memory lies on the device the
 * record names (by UUID: the owner's ordinal may name another device here, CUDA_VISIBLE_DEVICES
 * differing between processes).  A mapping is granted to that device, when it is visible here, so
 * its kernels and copies reach the memory locally, and to the importing thread's device, when it
 * is that device or can access it as a peer (cuDeviceCanAccessPeer): a companion on GPU 1
 * importing memory of GPU 0 gets a mapping that kernels on GPU 1 (over NVLink or PCIe) and on
 * GPU 0 both use.  A device that cannot reach the memory is not granted (the driver would refuse
 * the whole cuMemSetAccess), and the import is then reported for the memory's own device.  When
 * the record's device is not known here (no UUID, or not visible), the thread's device alone, as
 * before.  Each further device a thread of this process imports from is granted too
 * (vmm__grant_device).  The import's device (vmm_import_device, the DLPack device in Python) is the
 * thread's own when the thread had a context and was granted, else the memory's device. */
#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "import/internal.h"

#define MAX_DEVICES 64

static pthread_mutex_t devices_lock = PTHREAD_MUTEX_INITIALIZER;
static int devices_known; /* 1 once the table below is filled (read with acquire) */
static int n_devices;
static uint8_t device_uuid[MAX_DEVICES][16];

/* Lock held: every visible device's UUID.  A failure leaves the table unknown, to be tried again
 * by the next import. */
static void devices_load_locked(void)
{
    int n = 0;
    if (!vmm__import_cu.DeviceGetCount || !vmm__import_cu.DeviceGetUuid || vmm__import_cu.DeviceGetCount(&n) != CUDA_SUCCESS || n <= 0)
        return;
    if (n > MAX_DEVICES) n = MAX_DEVICES;
    for (int i = 0; i < n; i++) {
        CUdevice d = i;
        CUuuid u;
        if ((vmm__import_cu.DeviceGet && vmm__import_cu.DeviceGet(&d, i) != CUDA_SUCCESS) ||
            vmm__import_cu.DeviceGetUuid(&u, d) != CUDA_SUCCESS)
            return;
        memcpy(device_uuid[i], u.bytes, 16);
    }
    n_devices = n;
    __atomic_store_n(&devices_known, 1, __ATOMIC_RELEASE);
}

/* The device the record's memory lies on, as an ordinal of this process; -1 when unknown. */
static int resident_device(const vmm_alloc_info *a)
{
    static const uint8_t zero[16];
    if (memcmp(a->device_uuid, zero, sizeof zero) == 0) return -1;
    if (!__atomic_load_n(&devices_known, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&devices_lock);
        if (!devices_known) devices_load_locked();
        pthread_mutex_unlock(&devices_lock);
        if (!__atomic_load_n(&devices_known, __ATOMIC_ACQUIRE)) return -1;
    }
    for (int i = 0; i < n_devices; i++)
        if (memcmp(device_uuid[i], a->device_uuid, 16) == 0) return i;
    return -1;
}

static void access_for(CUmemAccessDesc *acc, CUdevice dev)
{
    memset(acc, 0, sizeof *acc);
    acc->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc->location.id = (int)dev;
    acc->flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

/* The devices a new mapping of record a gets access for, imported by a thread on `here`: acc[0..*n),
 * and *use, the device the import is reported for. */
void vmm__plan_access(const vmm_alloc_info *a, here_device here, CUmemAccessDesc acc[2], size_t *n, CUdevice *use)
{
    int res = resident_device(a);
    *n = 0;
    *use = here.dev;
    if (res < 0 || res == (int)here.dev) {
        access_for(&acc[(*n)++], here.dev);
        return;
    }
    access_for(&acc[(*n)++], (CUdevice)res);
    int can = 0;
    if (vmm__import_cu.DeviceCanAccessPeer && vmm__import_cu.DeviceCanAccessPeer(&can, here.dev, (CUdevice)res) == CUDA_SUCCESS &&
        can)
        access_for(&acc[(*n)++], here.dev);
    if (*n == 1 || !here.own) *use = (CUdevice)res;
}

uint64_t vmm__device_bits(const CUmemAccessDesc *acc, size_t n)
{
    uint64_t bits = 0;
    for (size_t i = 0; i < n; i++)
        if (acc[i].location.id >= 0 && acc[i].location.id < 64) bits |= 1ull << acc[i].location.id;
    return bits;
}

/* Access for dev on chunk c, unless it has it already. */
static vmm_status grant_one(chunk *c, CUdevice dev)
{
    uint64_t bit = dev >= 0 && dev < 64 ? 1ull << dev : 0;
    pthread_mutex_lock(&vmm__chunks_lock);
    bool has = bit && (c->devices & bit);
    pthread_mutex_unlock(&vmm__chunks_lock);
    if (has) return VMM_OK;
    CUmemAccessDesc acc;
    access_for(&acc, dev);
    CUresult r = vmm__import_cu.MemSetAccess(c->base, c->size, &acc, 1);
    if (r != CUDA_SUCCESS) return vmm__cu_fail("cuMemSetAccess", r);
    pthread_mutex_lock(&vmm__chunks_lock);
    c->devices |= bit;
    pthread_mutex_unlock(&vmm__chunks_lock);
    return VMM_OK;
}

/* A chunk mapped already, imported by a thread on `here`: that device needs access too (one
 * address range serves every device of the process), when it can reach the memory, and so does
 * the memory's own device (it has it, unless it was not known when the chunk was mapped).  *use:
 * the device the import is reported for. */
vmm_status vmm__grant_device(chunk *c, const vmm_alloc_info *a, here_device here, CUdevice *use)
{
    int res = resident_device(a);
    *use = here.dev;
    if (res >= 0 && res != (int)here.dev) {
        vmm_status st = grant_one(c, (CUdevice)res);
        if (st != VMM_OK) return st;
        int can = 0;
        if (!vmm__import_cu.DeviceCanAccessPeer ||
            vmm__import_cu.DeviceCanAccessPeer(&can, here.dev, (CUdevice)res) != CUDA_SUCCESS)
            can = 0;
        if (!can || !here.own) *use = (CUdevice)res;
        if (!can) return VMM_OK;
    }
    return grant_one(c, here.dev);
}

/* The calling thread's context, or device 0's primary context made current; and its device
 * (here->own: the thread had a context of its own). */
vmm_status vmm__current_context(CUcontext *ctx, here_device *here)
{
    static int inited; /* cuInit succeeded once: it holds for the process's life */
    CUresult r;
    *ctx = NULL;
    here->dev = 0;
    here->own = true;
    if (!__atomic_load_n(&inited, __ATOMIC_ACQUIRE)) {
        if ((r = vmm__import_cu.Init(0)) != CUDA_SUCCESS) return vmm__cu_fail("cuInit", r);
        __atomic_store_n(&inited, 1, __ATOMIC_RELEASE);
    }
    if ((r = vmm__import_cu.CtxGetCurrent(ctx)) != CUDA_SUCCESS) return vmm__cu_fail("cuCtxGetCurrent", r);
    if (!*ctx) {
        /* no context on this thread: device 0's primary one (retained for the process's life) */
        CUdevice d0 = 0;
        here->own = false;
        if (vmm__import_cu.DeviceGet && (r = vmm__import_cu.DeviceGet(&d0, 0)) != CUDA_SUCCESS) return vmm__cu_fail("cuDeviceGet", r);
        if ((r = vmm__import_cu.DevicePrimaryCtxRetain(ctx, d0)) != CUDA_SUCCESS)
            return vmm__cu_fail("cuDevicePrimaryCtxRetain", r);
        if ((r = vmm__import_cu.CtxSetCurrent(*ctx)) != CUDA_SUCCESS) return vmm__cu_fail("cuCtxSetCurrent", r);
    }
    if ((r = vmm__import_cu.CtxGetDevice(&here->dev)) != CUDA_SUCCESS) return vmm__cu_fail("cuCtxGetDevice", r);
    return VMM_OK;
}

