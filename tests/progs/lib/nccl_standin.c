/* Test equipment: built as libnccl-standin.so, a library whose file name says NCCL, making VMM
 * memory the way NCCL makes its own buffers (cuMemCreate with no shareable type, reserve, map,
 * read-write access on device 0).  tests/progs/spans.c's "N" loads it (VMMSHIM_TEST_NCCL_LIB), so
 * that the shim's hook sees a caller inside it (backing/adopt.c: such memory gets no stand-in). */
#include <cuda.h>
#include <stddef.h>

__attribute__((visibility("default"))) CUresult nccl_standin_alloc(size_t bytes, CUdeviceptr *va)
{
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle h;
    CUresult r;
    if ((r = cuMemCreate(&h, bytes, &prop, 0)) != CUDA_SUCCESS) return r;
    if ((r = cuMemAddressReserve(va, bytes, 0, 0, 0)) != CUDA_SUCCESS || (r = cuMemMap(*va, bytes, 0, h, 0)) != CUDA_SUCCESS ||
        (r = cuMemSetAccess(*va, bytes, &acc, 1)) != CUDA_SUCCESS)
        return r;
    return cuMemRelease(h); /* mapped, it stays */
}
