/* The device's default memory pool as the program sees it; see mempool.h.  Which pool is a
 * device's default is asked of the real driver once per device and remembered: a device's
 * default pool never changes in a process's life. */
#include "backing/mempool.h"

#include <pthread.h>
#include <string.h>

#include "backing/backing.h"
#include "core/log.h"
#include "hooks/real.h"

#define MAX_POOL_DEVICES 64 /* as many as the backing tracks */

static struct {
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGetDefaultMemPool)(CUmemoryPool *, CUdevice);
} cu;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int n_devices;                                 /* 0 until the driver has answered */
static CUmemoryPool default_pool[MAX_POOL_DEVICES]; /* NULL until asked */

static void load_driver(void)
{
    void *count = vmm__real_driver("cuDeviceGetCount"), *pool = vmm__real_driver("cuDeviceGetDefaultMemPool");
    memcpy(&cu.DeviceGetCount, &count, sizeof count);
    memcpy(&cu.DeviceGetDefaultMemPool, &pool, sizeof pool);
}

/* The number of devices into *n (at most MAX_POOL_DEVICES).  Inside the guard. */
static CUresult device_count(int *n)
{
    *n = __atomic_load_n(&n_devices, __ATOMIC_ACQUIRE);
    if (*n > 0) return CUDA_SUCCESS;
    if (!cu.DeviceGetCount) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = cu.DeviceGetCount(n);
    if (rc != CUDA_SUCCESS) return rc;
    if (*n > MAX_POOL_DEVICES) *n = MAX_POOL_DEVICES;
    if (*n > 0) __atomic_store_n(&n_devices, *n, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

/* dev's default pool into *pool (NULL: no such device).  Inside the guard. */
static CUresult default_pool_of(int dev, CUmemoryPool *pool)
{
    int n;
    CUresult rc = device_count(&n);
    *pool = NULL;
    if (rc != CUDA_SUCCESS || dev < 0 || dev >= n) return rc;
    if ((*pool = __atomic_load_n(&default_pool[dev], __ATOMIC_ACQUIRE))) return CUDA_SUCCESS;
    if (!cu.DeviceGetDefaultMemPool) return CUDA_ERROR_NOT_INITIALIZED;
    if ((rc = cu.DeviceGetDefaultMemPool(pool, dev)) != CUDA_SUCCESS) *pool = NULL;
    else __atomic_store_n(&default_pool[dev], *pool, __ATOMIC_RELEASE);
    return rc;
}

CUresult vmm__mempool_default(int dev, CUmemoryPool *pool)
{
    vmm__enter();
    pthread_once(&load_once, load_driver);
    CUresult rc = default_pool_of(dev, pool);
    vmm__leave();
    return rc;
}

CUresult vmm__mempool_device(CUmemoryPool pool, int *dev)
{
    *dev = -1;
    if (!pool) return CUDA_SUCCESS;
    vmm__enter();
    pthread_once(&load_once, load_driver);
    int n = 0;
    CUresult rc = device_count(&n);
    for (int d = 0; rc == CUDA_SUCCESS && d < n && *dev < 0; d++) {
        CUmemoryPool p;
        if ((rc = default_pool_of(d, &p)) == CUDA_SUCCESS && p == pool) *dev = d;
    }
    vmm__leave();
    return rc;
}

CUresult vmm__mempool_set_access(vmm__pool_set_access_fn real, CUmemoryPool pool, int owner,
                                 const CUmemAccessDesc *descs, size_t count)
{
    enum { MAX_UNDO = 64 };
    int undo[MAX_UNDO], n_undo = 0; /* accessors changed: d granted, -1 - d revoked */
    CUresult rc = CUDA_SUCCESS;
    vmm__enter();
    for (size_t i = 0; owner >= 0 && descs && i < count && rc == CUDA_SUCCESS; i++) {
        const CUmemAccessDesc *a = &descs[i];
        /* the owner's own access cannot change (the driver refuses it); other locations hold no shim memory */
        if (a->location.type != CU_MEM_LOCATION_TYPE_DEVICE || a->location.id == owner) continue;
        /* read-only is granted as read-write: the shim keeps one grant per accessor and owner,
         * shared with cuCtxEnablePeerAccess */
        int enable = a->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE, changed = 0;
        rc = vmm__peer_access(a->location.id, owner, enable, &changed);
        if (changed && n_undo < MAX_UNDO) undo[n_undo++] = enable ? a->location.id : -1 - a->location.id;
        vmm__debug("default memory pool of device %d: access of device %d %s on the shim's memory%s", owner,
                   a->location.id, enable ? "granted" : "revoked", rc == CUDA_SUCCESS ? "" : " failed");
    }
    if (rc == CUDA_SUCCESS) rc = real(pool, descs, count);
    while (rc != CUDA_SUCCESS && n_undo > 0) {
        int u = undo[--n_undo];
        (void)vmm__peer_access(u >= 0 ? u : -1 - u, owner, u < 0, NULL);
    }
    vmm__leave();
    return rc;
}

static const char *usage_attribute_name(CUmemPool_attribute attr)
{
    switch (attr) {
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: return "reserved";
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: return "reserved high";
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: return "used";
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: return "used high";
    default: return NULL;
    }
}

/* Bit (4 * dev + which figure) once that figure of dev's default pool has been logged: programs
 * read them often (PyTorch on every memory_stats()), so the debug log says it once. */
static unsigned long long logged_reads[MAX_POOL_DEVICES * 4 / 64];

static int first_read(int dev, CUmemPool_attribute attr)
{
    unsigned bit = (unsigned)dev * 4 + (unsigned)(attr - CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    unsigned long long mask = 1ull << (bit % 64);
    return !(__atomic_fetch_or(&logged_reads[bit / 64], mask, __ATOMIC_RELAXED) & mask);
}

void vmm__mempool_attribute_got(int dev, CUmemPool_attribute attr, void *value)
{
    const char *name = usage_attribute_name(attr);
    if (dev < 0 || !name || !value) return; /* every other attribute is the real pool's own */
    vmm__pool_usage u;
    int backed = vmm__pool_usage_get(dev, &u);
    if (backed)
        *(cuuint64_t *)value += attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ? u.reserved
                                : attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH  ? u.reserved_high
                                : attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT   ? u.used
                                                                              : u.used_high;
    if (first_read(dev, attr))
        vmm__debug("default memory pool of device %d: %s read%s", dev, name,
                   backed ? " with the shim's memory added" : "; the shim backs no allocations there yet");
}

void vmm__mempool_attribute_set(int dev, CUmemPool_attribute attr, const void *value)
{
    if (dev < 0 || !value ||
        (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD && attr != CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH &&
         attr != CU_MEMPOOL_ATTR_USED_MEM_HIGH))
        return; /* the reuse policies only steer the real pool's reuse */
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
        uint64_t bytes = *(const cuuint64_t *)value;
        vmm__debug("default memory pool of device %d: release threshold %llu bytes set on the shim's memory", dev,
                   (unsigned long long)bytes);
        vmm__pool_set_release_threshold(dev, bytes);
    } else {
        int which = attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH ? VMM__HIGH_RESERVED : VMM__HIGH_USED;
        vmm__debug("default memory pool of device %d: %s high-water mark reset on the shim's memory", dev,
                   which == VMM__HIGH_RESERVED ? "reserved" : "used");
        vmm__pool_usage_reset_high(dev, which);
    }
}

void vmm__mempool_trimmed(int dev, size_t keep)
{
    if (dev < 0) return;
    vmm__debug("default memory pool of device %d: trimmed to %zu bytes with the shim's memory", dev, keep);
    vmm__enter();
    vmm__pool_trim(dev, keep);
    vmm__leave();
}

void vmm__mempool_current_set(int dev, int is_default)
{
    vmm__debug("device %d: %s", dev,
               is_default ? "the default memory pool is current: the shim backs stream-ordered allocations"
                          : "a memory pool of the program's own is current: stream-ordered allocations pass through");
    vmm__pool_current_is_default(dev, is_default);
}
