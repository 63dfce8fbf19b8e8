/* VMMSHIM_PAUSE_GUARD: a paused segment's place is mapped onto the device's scratch chunk (one
 * granule, made at the first pause and zeroed), piece by piece, instead of left unmapped.  A kernel
 * that touches paused memory then reads zeros and writes into the scratch, where the resume finds
 * what it wrote, instead of faulting the context (which loses every allocation and the resume).
 * Which allocation it touched cannot be told: every piece maps the same chunk.  It costs one
 * cuMemMap and one cuMemUnmap a granule of paused memory.  Calls only the driver table (state.c):
 * segment.c unmaps a guarded segment emptied while paused, sleep.c maps and checks. */
#include <stdlib.h>
#include <string.h>

#include "backing/internal.h"
#include "core/options.h"

int vmm__guard_on(void) { return vmm__opt_bool(VMM__OPT_PAUSE_GUARD); }

/* d's primary context current for a copy of its scratch (1), or nothing to undo (0). */
static int push(device_state *d) { return d->primary && vmm__cu.CtxPushCurrent(d->primary) == CUDA_SUCCESS; }

static void pop(int pushed)
{
    CUcontext c;
    if (pushed) (void)vmm__cu.CtxPopCurrent(&c);
}

/* The device's scratch chunk, made, viewed and zeroed at its first use: 0, or -1. */
static int scratch_ready(device_state *d)
{
    if (d->scratch_va) return 0;
    size_t g = d->granularity;
    CUmemAllocationProp p = {0};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = d->index;
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, d->index}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle h;
    CUdeviceptr va = 0;
    void *zero = calloc(1, g);
    if (!g || !zero || vmm__cu.MemCreate(&h, g, &p, 0) != CUDA_SUCCESS) {
        free(zero);
        return -1;
    }
    if (vmm__cu.MemAddressReserve(&va, g, g, 0, 0) != CUDA_SUCCESS) goto fail;
    int pushed = push(d), ok = vmm__cu.MemMap(va, g, 0, h, 0) == CUDA_SUCCESS &&
                              vmm__cu.MemSetAccess(va, g, &acc, 1) == CUDA_SUCCESS && vmm__cu.MemcpyHtoD &&
                              vmm__cu.MemcpyHtoD(va, zero, g) == CUDA_SUCCESS;
    pop(pushed);
    if (!ok) {
        (void)vmm__cu.MemUnmap(va, g);
        (void)vmm__cu.MemAddressFree(va, g);
        goto fail;
    }
    free(zero);
    d->scratch = h;
    d->scratch_va = va;
    return 0;
fail:
    free(zero);
    (void)vmm__cu.MemRelease(h);
    return -1;
}

void vmm__guard_unmap(device_state *d, CUdeviceptr base, uint64_t size)
{
    for (uint64_t at = 0; d->granularity && at < size; at += d->granularity)
        (void)VMM__TWICE(vmm__cu.MemUnmap(base + at, d->granularity));
}

int vmm__guard_map(device_state *d, CUdeviceptr base, uint64_t size, const CUmemAccessDesc *acc, size_t n_acc)
{
    size_t g = d->granularity;
    if (!g || size % g || scratch_ready(d)) return -1;
    uint64_t at = 0;
    for (; at < size; at += g)
        if (vmm__cu.MemMap(base + at, g, 0, d->scratch, 0) != CUDA_SUCCESS) break;
    if (at == size && vmm__cu.MemSetAccess(base, size, acc, n_acc) == CUDA_SUCCESS) return 0;
    vmm__guard_unmap(d, base, at);
    return -1;
}

uint64_t vmm__guard_check(device_state *d, uint64_t *first)
{
    size_t g = d->granularity;
    unsigned char *host = d->scratch_va ? malloc(g) : NULL;
    uint64_t written = 0;
    *first = 0;
    int pushed = push(d);
    if (host && vmm__cu.MemcpyDtoH && vmm__cu.MemcpyDtoH(host, d->scratch_va, g) == CUDA_SUCCESS) {
        for (size_t i = 0; i < g; i++)
            if (host[i] && !written++) *first = i;
        if (written) {
            memset(host, 0, g);
            (void)vmm__cu.MemcpyHtoD(d->scratch_va, host, g);
        }
    }
    pop(pushed);
    free(host);
    return written;
}
