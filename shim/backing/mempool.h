/* The device's default memory pool as the program sees it.  cudaMallocAsync draws from the
 * device's current pool; under the shim that memory is the shim's, so what the program sets on
 * or reads from a device's DEFAULT pool must reach the shim's memory too.  The driver-level pool
 * hooks (hooks/driver.c) make the real call first and hand each successful one here; a pool that
 * is no device's default pool is never touched. */
#ifndef VMM_BACKING_MEMPOOL_H
#define VMM_BACKING_MEMPOOL_H
#include <cuda.h>
#include <stddef.h>

/* After a successful cuMemPoolSetAccess: peer devices gain or lose access to the shim's memory. */
void vmm__mempool_access_set(CUmemoryPool pool, const CUmemAccessDesc *descs, size_t count);
/* After a successful cuMemPoolGetAttribute: the reserved and used figures (current and high)
 * get the shim's own added to the real pool's (which still holds, e.g., allocations made during
 * stream capture). */
void vmm__mempool_attribute_got(CUmemoryPool pool, CUmemPool_attribute attr, void *value);
/* After a successful cuMemPoolSetAttribute: the release threshold and the high-water resets. */
void vmm__mempool_attribute_set(CUmemoryPool pool, CUmemPool_attribute attr, const void *value);
/* After a successful cuMemPoolTrimTo. */
void vmm__mempool_trimmed(CUmemoryPool pool, size_t keep);
/* After a successful cuDeviceSetMemPool. */
void vmm__mempool_current_set(int dev, CUmemoryPool pool);
/* After a successful cuMemSetMemPool: a device's pinned pool is what cuDeviceSetMemPool sets. */
void vmm__mempool_location_current_set(const CUmemLocation *location, CUmemAllocationType type, CUmemoryPool pool);
#endif
