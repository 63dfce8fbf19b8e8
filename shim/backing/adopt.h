/* Memory the program makes itself with the VMM driver API (cuMemCreate + cuMemMap: PyTorch's
 * expandable segments, NCCL's buffers), made exportable and published without changing what the
 * program sees.  The driver hooks (hooks/driver.c) hand each call here; nothing here is called
 * while the shim itself is calling CUDA. */
#ifndef VMM_BACKING_ADOPT_H
#define VMM_BACKING_ADOPT_H
#include <cuda.h>
#include <stdint.h>

typedef CUresult (*vmm__mem_create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                       unsigned long long);
/* cuMemCreate with POSIX_FD added to the handle types the program asked for (never removing
 * one); if the driver refuses that, the program's own request, remembered as not exportable.
 * caller: the hook's return address; memory a communication library makes (NCCL, RCCL, NVSHMEM:
 * its kernels, proxy thread and peers use it at any time) gets no stand-in, so no pause takes it. */
CUresult vmm__adopt_create(vmm__mem_create_fn real, CUmemGenericAllocationHandle *handle, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags, const void *caller);
/* Stand-in handles (VMMSHIM_SLEEP_ADOPTED=1): the program gets, for memory it makes itself, a
 * value the shim makes, so that the shim holds the driver's handle and can release and make it
 * again (vmm_pause, vmm_resume).  A stand-in is 0xFA57 in the top 16 bits and a counter below:
 * a non-canonical address on x86-64 (neither a user nor a kernel pointer), and far above any
 * small counter, the two shapes a driver's opaque handle takes; a driver handle that happens to
 * look like one gets no stand-in (one warning).  Every call that takes a handle translates a
 * stand-in the shim made; any other value, and a stand-in the shim no longer knows, reaches the
 * driver untouched, which answers it as the invalid handle it is.  cuMemMapArrayAsync needs no
 * translation: it maps only handles made with CU_MEM_CREATE_USAGE_TILE_POOL, which get none. */
#define VMM__STAND_IN_TOP 0xFA57ull
static inline int vmm__adopt_is_stand_in(CUmemGenericAllocationHandle h) { return (h >> 48) == VMM__STAND_IN_TOP; }
/* For a call that takes stand-in h (cuMemMap, cuMemExportToShareableHandle): the driver's handle
 * in *real, held valid until vmm__adopt_unpin(h); CUDA_ERROR_INVALID_HANDLE while it is paused
 * (no memory stands behind it until vmm_resume).  A stand-in the shim does not know: *real = h. */
CUresult vmm__adopt_pin(CUmemGenericAllocationHandle h, CUmemGenericAllocationHandle *real);
void vmm__adopt_unpin(CUmemGenericAllocationHandle h);
/* The program exported stand-in h itself (cuMemExportToShareableHandle succeeded): another process
 * (NCCL's peer, a torch.multiprocessing receiver) may map the same physical memory, which a pause
 * cannot tell to let go and a resume could not give back, so h stays on the device from now on,
 * counted in the pause's bytes_not_shim. */
void vmm__adopt_shared(CUmemGenericAllocationHandle h);
typedef CUresult (*vmm__mem_release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*vmm__mem_props_fn)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
/* cuMemRelease and cuMemGetAllocationPropertiesFromHandle of stand-in h (paused: the program's
 * reference goes and the remembered properties answer, no driver call). */
CUresult vmm__adopt_release(vmm__mem_release_fn real, CUmemGenericAllocationHandle h);
CUresult vmm__adopt_get_props(vmm__mem_props_fn real, CUmemAllocationProp *prop, CUmemGenericAllocationHandle h);
/* After a successful cuMemRetainAllocationHandle: the driver's handle of memory with a stand-in
 * becomes the stand-in, one more reference of the program's (the driver keeps one of the shim's). */
void vmm__adopt_retained(CUmemGenericAllocationHandle *handle);
/* After a successful cuMemGetAllocationPropertiesFromHandle: the handle types it asked for. */
void vmm__adopt_props(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle);
/* After a successful cuMemMap: publish the range if its handle is adopted. */
void vmm__adopt_mapped(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle);
/* Before cuMemUnmap: retract the ranges inside [ptr, ptr+size); after it (ok = its success),
 * forget them, or publish them again if the driver kept them.  Returns 1 when the whole range is
 * memory vmm_pause released: the driver maps nothing there, so the hook makes no call and the
 * unmap succeeds, as it would have. */
int vmm__adopt_unmapping(CUdeviceptr ptr, size_t size);
void vmm__adopt_unmapped(CUdeviceptr ptr, size_t size, int ok);
/* After a successful cuMemRelease. */
void vmm__adopt_released(CUmemGenericAllocationHandle handle);
#endif
