/* The device's default memory pool as the program sees it; see mempool.h.  Which pool is a
 * device's default is asked of the real driver once per device and remembered: a device's
 * default pool never changes in a process's life.  What a call on it means for the shim's
 * memory (the stream-ordered pool's figures, its release threshold, a trim, which pool is
 * current) is done here too, on the backing's state (internal.h), since no other file asks. */
#include "backing/mempool.h"

#include <pthread.h>
#include <sched.h>
#include <string.h>

#include "backing/internal.h"
#include "core/log.h"
#include "hooks/real.h"

static struct {
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGetDefaultMemPool)(CUmemoryPool *, CUdevice);
} cu;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int n_devices;                          /* 0 until the driver has answered */
static CUmemoryPool default_pool[MAX_DEVICES]; /* NULL until asked */

static void load_driver(void)
{
    void *count = vmm__real_driver("cuDeviceGetCount"), *pool = vmm__real_driver("cuDeviceGetDefaultMemPool");
    memcpy(&cu.DeviceGetCount, &count, sizeof count);
    memcpy(&cu.DeviceGetDefaultMemPool, &pool, sizeof pool);
}

/* The number of devices into *n (at most MAX_DEVICES).  Inside the guard. */
static CUresult device_count(int *n)
{
    *n = __atomic_load_n(&n_devices, __ATOMIC_ACQUIRE);
    if (*n > 0) return CUDA_SUCCESS;
    if (!cu.DeviceGetCount) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = cu.DeviceGetCount(n);
    if (rc != CUDA_SUCCESS) return rc;
    if (*n > MAX_DEVICES) *n = MAX_DEVICES;
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

/* ---- the shim's memory under the default pool: its figures and the work ---- */

/* What cudaMallocAsync draws from the default pool is the shim's memory, so the calls that read
 * and configure the default pool reach it here. */
typedef struct usage {
    uint64_t reserved, reserved_high; /* bytes of the stream-ordered pool's segments on the device */
    uint64_t used, used_high;         /* its live allocations, each rounded to 512 bytes */
} usage;

static device_state *dev_at(int dev) { return vmm__S.ready && dev >= 0 && dev < MAX_DEVICES ? &vmm__S.dev[dev] : NULL; }

/* 1 and *out filled when the shim backs allocations on dev; 0 when it does not. */
static int usage_get(int dev, usage *out)
{
    memset(out, 0, sizeof *out);
    device_state *d = dev_at(dev);
    if (!d) return 0;
    pthread_mutex_lock(&vmm__S.lock);
    /* the default pool's figures: stream-ordered memory only, as natively; a thread tag's pools are
     * the default pool's too for the program (their high-water marks add up: an upper bound) */
    if (d->pool_ready) VMM__FOR_POOLS(d, p, k) {
        if (!k) continue;
        out->reserved += p->reserved;
        out->reserved_high += p->reserved_high;
        out->used += p->used;
        out->used_high += p->used_high;
    }
    pthread_mutex_unlock(&vmm__S.lock);
    return 1;
}

/* Reset a high-water mark to its current value (cudaMemPoolAttrReservedMemHigh / UsedMemHigh). */
enum { HIGH_RESERVED = 0, HIGH_USED = 1 };
static void reset_high(int dev, int which)
{
    device_state *d = dev_at(dev);
    if (!d) return;
    pthread_mutex_lock(&vmm__S.lock);
    if (d->pool_ready) VMM__FOR_POOLS(d, p, k) {
        if (!k) continue;
        if (which == HIGH_RESERVED) p->reserved_high = p->reserved;
        else p->used_high = p->used;
    }
    pthread_mutex_unlock(&vmm__S.lock);
}

/* Release empty stream-ordered segments of dev until at most `keep` bytes are reserved, or none
 * is left to release (cudaMemPoolTrimTo).  Natively a trim gives back what frees the device has
 * completed, synchronized or not.  A free whose event the shim has not recorded yet gets it now;
 * an idle stream reaches it a few microseconds later, so the trim waits that long (outside the
 * lock, at most TRIM_SETTLE_NS) before it looks again.  A stream still busy then keeps its
 * memory, as natively. */
#define TRIM_SETTLE_NS 2000000u
/* A thread tag's stream-ordered pools are trimmed whole first, then the untagged one to what keep
 * leaves (a trim keeping more than nothing is rare: TrimTo(0) is what frameworks call). */
static void trim_locked(device_state *d, uint64_t keep)
{
    if (!d->pool_ready) return;
    uint64_t tagged = 0;
    VMM__FOR_POOLS(d, p, k)
        if (k && p != &d->pool[1]) {
            vmm__pool_release(p, 0, 0, UINT64_MAX);
            tagged += p->reserved;
        }
    vmm__pool_release(&d->pool[1], keep > tagged ? keep - tagged : 0, 0, UINT64_MAX);
}

static void trim(int dev, uint64_t keep)
{
    device_state *d = dev_at(dev);
    if (!d) return;
    void *ev[64];
    unsigned n = 0;
    pthread_mutex_lock(&vmm__S.lock);
    if (d->pool_ready) VMM__FOR_POOLS(d, p, k)
        if (k && p->n_unrecorded) n += vmm__pool_pending_events(p, ev + n, 64 - n);
    trim_locked(d, keep);
    pthread_mutex_unlock(&vmm__S.lock);
    if (!n) return;
    uint64_t give_up = vmm__now_ns(NULL) + TRIM_SETTLE_NS;
    for (unsigned i = 0; i < n; i++) /* one recycled meanwhile is only looked at longer */
        while (!vmm__event_done(NULL, ev[i]) && vmm__now_ns(NULL) < give_up) sched_yield();
    pthread_mutex_lock(&vmm__S.lock);
    trim_locked(d, keep);
    pthread_mutex_unlock(&vmm__S.lock);
}

/* cudaMemPoolAttrReleaseThreshold of dev's default pool: its empty segments stay while it reserves
 * no more than this; beyond it they go back at a synchronization or after the give-back delay. */
static void set_release_threshold(int dev, uint64_t bytes)
{
    /* PyTorch and CuPy set it before their first allocation, which may be before anything else
     * started the shim: it must not be lost. */
    device_state *d = vmm__ensure_init() ? dev_at(dev) : NULL;
    if (!d) return;
    pthread_mutex_lock(&vmm__S.lock);
    d->release_threshold = bytes;
    if (d->pool_ready) VMM__FOR_POOLS(d, p, k)
        if (k) p->retain = vmm__retain_of(d, 1);
    /* a lower threshold may put memory past it: gone at the next synchronization, as natively */
    __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED);
    vmm__purge_kick_locked();
    pthread_mutex_unlock(&vmm__S.lock);
}

/* The program made another pool current on dev (cudaDeviceSetMemPool): while is_default is 0,
 * stream-ordered allocations on dev pass through to that pool untouched. */
static void current_is_default(int dev, int is_default)
{
    device_state *d = dev_at(dev);
    if (d) __atomic_store_n(&d->custom_pool, !is_default, __ATOMIC_RELEASE);
}

/* ---- the pool hooks ---- */

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
static unsigned long long logged_reads[MAX_DEVICES * 4 / 64];

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
    usage u;
    int backed = usage_get(dev, &u);
    if (backed)
        *(cuuint64_t *)value += attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ? u.reserved
                                : attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH  ? u.reserved_high
                                : attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT   ? u.used
                                                                              : u.used_high;
    if (first_read(dev, attr))
        vmm__debug("default memory pool of device %d: %s read%s", dev, name,
                   backed ? " with the shim's memory added" : "; the shim backs no allocations there yet");
}

/* The program set one of the default pool's reuse policies: the shim's stream-ordered pools of dev
 * (the tags' too) follow it, as the real pool does (pool.h says what each means there). */
static void set_reuse(int dev, unsigned bit, int on)
{
    device_state *d = vmm__ensure_init() ? dev_at(dev) : NULL;
    if (!d) return;
    pthread_mutex_lock(&vmm__S.lock);
    d->reuse_off = on ? d->reuse_off & ~bit : d->reuse_off | bit;
    if (d->pool_ready) VMM__FOR_POOLS(d, p, k)
        if (k) p->reuse = VMM_POOL_REUSE_ALL & ~d->reuse_off;
    /* with internal dependencies allowed, the waiting pass covers what following events would */
    int follow = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        unsigned off = vmm__S.dev[i].reuse_off;
        follow |= (off & VMM_POOL_REUSE_INTERNAL) && !(off & VMM_POOL_REUSE_FOLLOW);
    }
    vmm__follow_set(follow);
    pthread_mutex_unlock(&vmm__S.lock);
}

static unsigned reuse_bit(CUmemPool_attribute attr)
{
    return attr == CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC            ? VMM_POOL_REUSE_OPPORTUNISTIC
           : attr == CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES  ? VMM_POOL_REUSE_INTERNAL
           : attr == CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES   ? VMM_POOL_REUSE_FOLLOW
                                                                         : 0;
}

void vmm__mempool_attribute_set(int dev, CUmemPool_attribute attr, const void *value)
{
    unsigned bit = reuse_bit(attr);
    if (dev >= 0 && value && bit) {
        int on = *(const int *)value != 0;
        vmm__debug("default memory pool of device %d: %s reuse %s on the shim's memory", dev,
                   bit == VMM_POOL_REUSE_OPPORTUNISTIC ? "opportunistic"
                   : bit == VMM_POOL_REUSE_INTERNAL    ? "internal-dependency"
                                                       : "event-dependency",
                   on ? "allowed" : "refused");
        set_reuse(dev, bit, on);
        return;
    }
    if (dev < 0 || !value ||
        (attr != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD && attr != CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH &&
         attr != CU_MEMPOOL_ATTR_USED_MEM_HIGH))
        return;
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
        uint64_t bytes = *(const cuuint64_t *)value;
        vmm__debug("default memory pool of device %d: release threshold %llu bytes set on the shim's memory", dev,
                   (unsigned long long)bytes);
        set_release_threshold(dev, bytes);
    } else {
        int which = attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH ? HIGH_RESERVED : HIGH_USED;
        vmm__debug("default memory pool of device %d: %s high-water mark reset on the shim's memory", dev,
                   which == HIGH_RESERVED ? "reserved" : "used");
        reset_high(dev, which);
    }
}

void vmm__mempool_trimmed(int dev, size_t keep)
{
    if (dev < 0) return;
    vmm__debug("default memory pool of device %d: trimmed to %zu bytes with the shim's memory", dev, keep);
    vmm__enter();
    trim(dev, keep);
    vmm__leave();
}

void vmm__mempool_current_set(int dev, int is_default)
{
    vmm__debug("device %d: %s", dev,
               is_default ? "the default memory pool is current: the shim backs stream-ordered allocations"
                          : "a memory pool of the program's own is current: stream-ordered allocations pass through");
    current_is_default(dev, is_default);
}
