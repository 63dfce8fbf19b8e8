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
 * one); if the driver refuses that, the program's own request, remembered as not exportable. */
CUresult vmm__adopt_create(vmm__mem_create_fn real, CUmemGenericAllocationHandle *handle, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags);
/* After a successful cuMemGetAllocationPropertiesFromHandle: the handle types it asked for. */
void vmm__adopt_props(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle);
/* After a successful cuMemMap: publish the range if its handle is adopted. */
void vmm__adopt_mapped(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle);
/* Before cuMemUnmap: retract the ranges inside [ptr, ptr+size); after it (ok = its success),
 * forget them, or publish them again if the driver kept them. */
void vmm__adopt_unmapping(CUdeviceptr ptr, size_t size);
void vmm__adopt_unmapped(CUdeviceptr ptr, size_t size, int ok);
/* After a successful cuMemRelease. */
void vmm__adopt_released(CUmemGenericAllocationHandle handle);
#endif
