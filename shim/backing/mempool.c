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

static int device_count(void)
{
    int n = __atomic_load_n(&n_devices, __ATOMIC_ACQUIRE);
    if (n > 0) return n;
    if (!cu.DeviceGetCount || cu.DeviceGetCount(&n) != CUDA_SUCCESS || n <= 0) return 0;
    if (n > MAX_POOL_DEVICES) n = MAX_POOL_DEVICES;
    __atomic_store_n(&n_devices, n, __ATOMIC_RELEASE);
    return n;
}

/* dev's default pool, or NULL.  Inside the guard. */
static CUmemoryPool default_pool_of(int dev)
{
    if (dev < 0 || dev >= device_count()) return NULL;
    CUmemoryPool p = __atomic_load_n(&default_pool[dev], __ATOMIC_ACQUIRE);
    if (p) return p;
    if (!cu.DeviceGetDefaultMemPool || cu.DeviceGetDefaultMemPool(&p, dev) != CUDA_SUCCESS) return NULL;
    __atomic_store_n(&default_pool[dev], p, __ATOMIC_RELEASE);
    return p;
}

/* The device whose default pool `pool` is, or -1.  Inside the guard. */
static int default_pool_device(CUmemoryPool pool)
{
    pthread_once(&load_once, load_driver);
    if (!pool) return -1;
    int n = device_count();
    for (int dev = 0; dev < n; dev++)
        if (default_pool_of(dev) == pool) return dev;
    return -1;
}

void vmm__mempool_access_set(CUmemoryPool pool, const CUmemAccessDesc *descs, size_t count)
{
    vmm__enter();
    int owner = default_pool_device(pool);
    for (size_t i = 0; owner >= 0 && descs && i < count; i++) {
        const CUmemAccessDesc *a = &descs[i];
        /* the owner's own access cannot change (the driver refuses it); other locations hold no shim memory */
        if (a->location.type != CU_MEM_LOCATION_TYPE_DEVICE || a->location.id == owner) continue;
        /* read-only is granted as read-write: the shim keeps one grant per accessor and owner,
         * shared with cuCtxEnablePeerAccess */
        int enable = a->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE;
        vmm__debug("default memory pool of device %d: access of device %d %s on the shim's memory", owner,
                   a->location.id, enable ? "granted" : "revoked");
        vmm__peer_access(a->location.id, owner, enable);
    }
    vmm__leave();
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

void vmm__mempool_attribute_got(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    const char *name = usage_attribute_name(attr);
    if (!name || !value) return; /* every other attribute is the real pool's own */
    vmm__enter();
    int dev = default_pool_device(pool);
    vmm__pool_usage u;
    int backed = dev >= 0 && vmm__pool_usage_get(dev, &u);
    if (backed)
        *(cuuint64_t *)value += attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ? u.reserved
                                : attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH  ? u.reserved_high
                                : attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT   ? u.used
                                                                              : u.used_high;
    if (dev >= 0 && first_read(dev, attr))
        vmm__debug("default memory pool of device %d: %s read%s", dev, name,
                   backed ? " with the shim's memory added" : "; the shim backs no allocations there yet");
    vmm__leave();
}

void vmm__mempool_attribute_set(CUmemoryPool pool, CUmemPool_attribute attr, const void *value)
{
    if (!value || (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD && attr != CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH &&
                   attr != CU_MEMPOOL_ATTR_USED_MEM_HIGH))
        return; /* the reuse policies only steer the real pool's reuse */
    vmm__enter();
    int dev = default_pool_device(pool);
    if (dev >= 0 && attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
        uint64_t bytes = *(const cuuint64_t *)value;
        vmm__debug("default memory pool of device %d: release threshold %llu bytes set on the shim's memory", dev,
                   (unsigned long long)bytes);
        vmm__pool_set_release_threshold(dev, bytes);
    } else if (dev >= 0) {
        int which = attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH ? VMM__HIGH_RESERVED : VMM__HIGH_USED;
        vmm__debug("default memory pool of device %d: %s high-water mark reset on the shim's memory", dev,
                   which == VMM__HIGH_RESERVED ? "reserved" : "used");
        vmm__pool_usage_reset_high(dev, which);
    }
    vmm__leave();
}

void vmm__mempool_trimmed(CUmemoryPool pool, size_t keep)
{
    vmm__enter();
    int dev = default_pool_device(pool);
    if (dev >= 0) {
        vmm__debug("default memory pool of device %d: trimmed to %zu bytes with the shim's memory", dev, keep);
        vmm__pool_trim(dev, keep);
    }
    vmm__leave();
}

void vmm__mempool_current_set(int dev, CUmemoryPool pool)
{
    vmm__enter();
    pthread_once(&load_once, load_driver);
    CUmemoryPool def = default_pool_of(dev);
    if (def) {
        vmm__debug("device %d: %s", dev,
                   pool == def ? "the default memory pool is current: the shim backs stream-ordered allocations"
                               : "a memory pool of the program's own is current: stream-ordered allocations pass through");
        vmm__pool_current_is_default(dev, pool == def);
    }
    vmm__leave();
}

void vmm__mempool_location_current_set(const CUmemLocation *location, CUmemAllocationType type, CUmemoryPool pool)
{
    if (location && location->type == CU_MEM_LOCATION_TYPE_DEVICE && type == CU_MEM_ALLOCATION_TYPE_PINNED)
        vmm__mempool_current_set(location->id, pool);
}
