/* The device's default memory pool as the program sees it.  cudaMallocAsync draws from the
 * device's current pool; under the shim that memory is the shim's, so what the program sets on
 * or reads from a device's DEFAULT pool must reach the shim's memory too.  The driver-level pool
 * hooks (hooks/driver.c) find the pool's device here first, make the real call, and hand each
 * successful one here; a pool that is no device's default pool is never touched. */
#ifndef VMM_BACKING_MEMPOOL_H
#define VMM_BACKING_MEMPOOL_H
#include <cuda.h>
#include <stddef.h>

/* Before the real call of a pool hook: which device's default pool `pool` is (*dev, -1: none),
 * or dev's default pool (*pool, NULL: no such device), asked of the driver once per device.  A
 * failure is for the program's call to return before anything changed: a call the shim could not
 * follow through fails whole, as a real one may, instead of succeeding half done. */
CUresult vmm__mempool_device(CUmemoryPool pool, int *dev);
CUresult vmm__mempool_default(int dev, CUmemoryPool *pool);
typedef CUresult (*vmm__pool_set_access_fn)(CUmemoryPool, const CUmemAccessDesc *, size_t);
/* cuMemPoolSetAccess of `pool`, owner's default pool (-1: none): peer devices gain or lose access
 * to the shim's memory, then the real call is made; if either fails, both stay as they were. */
CUresult vmm__mempool_set_access(vmm__pool_set_access_fn real, CUmemoryPool pool, int owner,
                                 const CUmemAccessDesc *descs, size_t count);
/* After a successful cuMemPoolGetAttribute of dev's default pool (dev -1: another pool, left
 * alone): the reserved and used figures (current and high) get the shim's own added to the real
 * pool's (which still holds, e.g., allocations made during stream capture). */
void vmm__mempool_attribute_got(int dev, CUmemPool_attribute attr, void *value);
/* After a successful cuMemPoolSetAttribute: the release threshold and the high-water resets. */
void vmm__mempool_attribute_set(int dev, CUmemPool_attribute attr, const void *value);
/* After a successful cuMemPoolTrimTo. */
void vmm__mempool_trimmed(int dev, size_t keep);
/* After a successful cuDeviceSetMemPool or cuMemSetMemPool of dev: is its default pool current? */
void vmm__mempool_current_set(int dev, int is_default);
#endif
