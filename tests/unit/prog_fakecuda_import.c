/* Helper of test_fakecuda: the importing side of the cross-process export/import check.
 *
 *   prog_fakecuda_import FD SIZE READY_WFD GO_RFD
 *
 * FD is an inherited POSIX file descriptor exported by the parent.  Imports it, closes FD (the
 * import must hold its own reference), maps it, checks pattern A (byte i is (i*7+1)&0xff),
 * writes pattern B ((i*13+5)&0xff) and reports on READY_WFD.  Then waits for a byte on GO_RFD,
 * sent once the parent has released everything of its own, and checks that the memory survived:
 * the old mapping still reads B, and a fresh mapping of the imported handle does too.
 * Exit status 0 when every check passed. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>

#include "check.h"

#define STR_(x) #x
#define STR(x) STR_(x)
#define DECL(name) static __typeof__(&name) p_##name;
#define LOAD(name) load(lib, STR(name), &p_##name, sizeof p_##name)

DECL(cuInit)
DECL(cuDeviceGet)
DECL(cuDevicePrimaryCtxRetain)
DECL(cuCtxSetCurrent)
DECL(cuMemImportFromShareableHandle)
DECL(cuMemAddressReserve)
DECL(cuMemAddressFree)
DECL(cuMemMap)
DECL(cuMemUnmap)
DECL(cuMemSetAccess)
DECL(cuMemRelease)

static void load(void *lib, const char *name, void *slot, size_t n)
{
    void *p = dlsym(lib, name);
    CHECK(p != NULL, "dlsym %s", name);
    memcpy(slot, &p, n);
}

static int pattern_ok(const unsigned char *p, size_t size, unsigned mul, unsigned add)
{
    for (size_t i = 0; i < size; i++)
        if (p[i] != (unsigned char)(i * mul + add)) return 0;
    return 1;
}

static int finish(void)
{
    printf("prog_fakecuda_import: %d checks passed, %d failed\n", check__passed, check__failed);
    fflush(stdout);
    return check__failed ? 1 : 0;
}

static CUresult map_rw(CUmemGenericAllocationHandle h, size_t size, CUdeviceptr *va)
{
    CUresult r = p_cuMemAddressReserve(va, size, 0, 0, 0);
    if (r != CUDA_SUCCESS) return r;
    if ((r = p_cuMemMap(*va, size, 0, h, 0)) != CUDA_SUCCESS) return r;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return p_cuMemSetAccess(*va, size, &acc, 1);
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s FD SIZE READY_WFD GO_RFD\n", argv[0]);
        return 2;
    }
    int fd = atoi(argv[1]), ready = atoi(argv[3]), go = atoi(argv[4]);
    size_t size = (size_t)strtoull(argv[2], NULL, 10);

    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    CHECK(lib != NULL, "dlopen: %s", dlerror());
    if (!lib) return finish();
    LOAD(cuInit);
    LOAD(cuDeviceGet);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxSetCurrent);
    LOAD(cuMemImportFromShareableHandle);
    LOAD(cuMemAddressReserve);
    LOAD(cuMemAddressFree);
    LOAD(cuMemMap);
    LOAD(cuMemUnmap);
    LOAD(cuMemSetAccess);
    LOAD(cuMemRelease);
    if (check__failed) return finish();

    CUdevice dev;
    CUcontext ctx;
    CHECK_EQ(p_cuInit(0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDeviceGet(&dev, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS);
    CHECK_EQ(p_cuCtxSetCurrent(ctx), CUDA_SUCCESS);

    CUmemGenericAllocationHandle h = 0;
    CHECK_EQ(p_cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             CUDA_SUCCESS);
    close(fd); /* the import holds its own reference */
    CUdeviceptr va = 0;
    CHECK_EQ(map_rw(h, size, &va), CUDA_SUCCESS);
    unsigned char *p = (unsigned char *)(uintptr_t)va;
    CHECK(va && pattern_ok(p, size, 7, 1), "pattern A not visible in the importer");
    if (va)
        for (size_t i = 0; i < size; i++) p[i] = (unsigned char)(i * 13 + 5);
    CHECK(write(ready, "1", 1) == 1, "ready pipe");

    char c;
    CHECK(read(go, &c, 1) == 1, "go pipe");
    /* The exporter has released its handle, unmapped and closed every fd by now. */
    CHECK(va && pattern_ok(p, size, 13, 5), "old mapping lost pattern B");
    CHECK_EQ(p_cuMemUnmap(va, size), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAddressFree(va, size), CUDA_SUCCESS);
    CUdeviceptr va2 = 0;
    CHECK_EQ(map_rw(h, size, &va2), CUDA_SUCCESS);
    CHECK(va2 && pattern_ok((unsigned char *)(uintptr_t)va2, size, 13, 5), "fresh mapping lost pattern B");
    CHECK_EQ(p_cuMemUnmap(va2, size), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAddressFree(va2, size), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemRelease(h), CUDA_SUCCESS);
    return finish();
}
