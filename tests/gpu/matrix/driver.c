/* Row b: a driver-API program (no CUDA runtime: built with nvcc -cudart none, linked -lcuda).
 * cuMemAlloc, cuMemAllocAsync and cuMemAllocPitch buffers, a kernel loaded from PTX (argv[1],
 * made from scale_ptx.cu) run over them, memcpy round trips checked by checksum, and the range,
 * attribute and error answers a program can observe. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static const char *ename(CUresult r)
{
    const char *s = NULL;
    return cuGetErrorName(r, &s) == CUDA_SUCCESS && s ? s : "?";
}

#define CK(call)                                                                                       \
    do {                                                                                               \
        CUresult r_ = (call);                                                                          \
        if (r_ != CUDA_SUCCESS) {                                                                      \
            printf("error %s: %s\n", #call, ename(r_));                                                \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

static void show(const char *what, CUresult r) { printf("%-44s %s\n", what, ename(r)); }

static unsigned long long fnv(const unsigned *p, size_t n)
{
    unsigned long long h = 0xcbf29ce484222325ull;
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n * 4; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static CUfunction scale;

static void launch(CUdeviceptr x, unsigned long long n, unsigned mul, unsigned add, CUstream s)
{
    void *args[] = {&x, &n, &mul, &add};
    CK(cuLaunchKernel(scale, 128, 1, 1, 256, 1, 1, 0, s, args, NULL));
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        printf("usage: driver SCALE.ptx\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        printf("cannot open %s\n", argv[1]);
        return 1;
    }
    static char ptx[1 << 20];
    size_t len = fread(ptx, 1, sizeof ptx - 1, f);
    fclose(f);
    ptx[len] = 0;

    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUstream s;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CUdeviceptr early = 0;
    show("cuMemAlloc without a context", cuMemAlloc(&early, 1u << 20));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CK(cuModuleLoadData(&mod, ptx));
    CK(cuModuleGetFunction(&scale, mod, "scale"));
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

    size_t na = (3u << 20) / 4, nb = (1u << 20) / 4;
    CUdeviceptr a, b, pitched;
    size_t pitch = 0;
    CK(cuMemAlloc(&a, na * 4));
    CK(cuMemAllocAsync(&b, nb * 4, s));
    CK(cuMemAllocPitch(&pitched, &pitch, 1000, 37, 4));
    printf("# a 0x%llx b 0x%llx pitched 0x%llx\n", (unsigned long long)a, (unsigned long long)b,
           (unsigned long long)pitched);
    printf("cuMemAllocPitch(1000 x 37, 4): pitch %zu\n", pitch);

    unsigned *h = malloc(na * 4), *back = malloc(na * 4);
    for (size_t i = 0; i < na; i++) h[i] = mix(i, 11);
    CK(cuMemcpyHtoD(a, h, na * 4));
    launch(a, na, 3, 1, NULL);
    CK(cuCtxSynchronize());
    CK(cuMemcpyDtoH(back, a, na * 4));
    for (size_t i = 0; i < na; i++) h[i] = h[i] * 3 + 1;
    printf("cuMemAlloc buffer through the kernel: %s, fnv %016llx\n", memcmp(h, back, na * 4) ? "DIFFERS" : "as computed",
           fnv(back, na));
    CK(cuMemsetD32Async(b, 7, nb, s));
    launch(b, nb, 5, 2, s);
    CK(cuMemcpyDtoHAsync(back, b, nb * 4, s));
    CK(cuStreamSynchronize(s));
    int ok = 1;
    for (size_t i = 0; i < nb; i++) ok &= back[i] == 37;
    printf("cuMemAllocAsync buffer memset+kernel on the stream: %s, fnv %016llx\n", ok ? "as computed" : "DIFFERS",
           fnv(back, nb));
    CK(cuMemsetD8(pitched, 0x11, pitch * 37));
    CK(cuMemcpyDtoH(back, pitched + pitch * 36, 1000));
    printf("pitched last row: %s\n", back[0] == 0x11111111u && back[249] == 0x11111111u ? "as written" : "DIFFERS");

    CUdeviceptr base = 0;
    size_t size = 0;
    show("cuMemGetAddressRange(a + 12345)", cuMemGetAddressRange(&base, &size, a + 12345));
    printf("  base is a: %s, size %zu\n", base == a ? "yes" : "NO", size);
    show("cuMemGetAddressRange(b + 1 MiB - 1)", cuMemGetAddressRange(&base, &size, b + (1u << 20) - 1));
    printf("  base is b: %s, size %zu\n", base == b ? "yes" : "NO", size);
    CUdeviceptr start = 0;
    unsigned mtype = 0;
    int ordinal = -1;
    show("cuPointerGetAttribute(RANGE_SIZE, a + 4096)", cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, a + 4096));
    show("cuPointerGetAttribute(RANGE_START, a + 4096)",
         cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a + 4096));
    show("cuPointerGetAttribute(MEMORY_TYPE, a)", cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, a));
    show("cuPointerGetAttribute(DEVICE_ORDINAL, b)", cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, b));
    printf("  range %zu, start is a: %s, device memory: %s, ordinal %d\n", size, start == a ? "yes" : "NO",
           mtype == CU_MEMORYTYPE_DEVICE ? "yes" : "NO", ordinal);

    pause_point(); /* a, b, pitched are live */

    show("cuMemFree(a + 4096) (interior)", cuMemFree(a + 4096));
    show("cuMemFree(a)", cuMemFree(a));
    show("cuMemFree(a) again", cuMemFree(a));
    show("cuMemFreeAsync(b, s)", cuMemFreeAsync(b, s));
    show("cuStreamSynchronize", cuStreamSynchronize(s));
    show("cuMemFree(pitched)", cuMemFree(pitched));
    CUdeviceptr huge = 0;
    show("cuMemAlloc(1 TiB)", cuMemAlloc(&huge, 1ull << 40));
    show("cuMemAlloc(4 KiB) after that", cuMemAlloc(&huge, 4096));
    show("cuMemFree(4 KiB)", cuMemFree(huge));
    size_t f0, f1, t;
    CK(cuMemGetInfo(&f0, &t));
    CK(cuMemAlloc(&huge, 64u << 20));
    CK(cuMemGetInfo(&f1, &t));
    printf("cuMemGetInfo: free dropped by >= 64 MiB: %s\n", f1 + (64u << 20) <= f0 ? "yes" : "NO");
    show("cuMemFree(64 MiB)", cuMemFree(huge));
    show("cuStreamDestroy", cuStreamDestroy(s));
    show("cuModuleUnload", cuModuleUnload(mod));
    free(h);
    free(back);
    printf("done\n");
    return 0;
}
