/* Driver-API semantics a program can observe, linked against libcuda.so.1 and calling the
 * allocation entry points directly.  One line per observation, never a raw address, so that
 * the tests can require identical output natively and under the shim.
 *   driver_api          allocation, free, range and attribute queries, memory info, pitch
 *   driver_api peer     (2 devices) access of device 0 memory from device 1 around
 *                       cuCtxEnablePeerAccess / cuCtxDisablePeerAccess, as cuMemGetAccess sees it */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *ename(CUresult r)
{
    static char buf[32];
    const char *s = NULL;
    if (cuGetErrorName(r, &s) == CUDA_SUCCESS && s) return s;
    snprintf(buf, sizeof buf, "CUresult %d", (int)r);
    return buf;
}

static void show(const char *what, CUresult r) { printf("%-52s %s\n", what, ename(r)); }
static void say(const char *what, const char *v) { printf("%-52s %s\n", what, v); }
static void num(const char *what, unsigned long long v) { printf("%-52s %llu\n", what, v); }
static const char *yes(int c) { return c ? "yes" : "NO"; }

static int semantics(void)
{
    CUdeviceptr p = 0, q = 0, base = 0;
    size_t size = 0, f0 = 0, f1 = 0, total = 0;
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    show("cuInit", cuInit(0));
    show("cuMemAlloc(&p, 1 MiB) without a context", cuMemAlloc(&p, 1u << 20));
    show("cuMemAllocAsync(&p, 1 MiB) without a context", cuMemAllocAsync(&p, 1u << 20, NULL));
    show("cuMemGetInfo without a context", cuMemGetInfo(&f0, &total));
    show("cuDeviceGet(0)", cuDeviceGet(&dev, 0));
    show("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, dev));
    show("cuCtxSetCurrent", cuCtxSetCurrent(ctx));

    show("cuMemAlloc(NULL, 1)", cuMemAlloc(NULL, 1));
    show("cuMemAlloc(&p, 0)", cuMemAlloc(&p, 0));
    show("cuMemAlloc(&p, 3 MiB)", cuMemAlloc(&p, 3u << 20));
    size_t n = 3u << 20;
    unsigned char *host = malloc(n), *back = malloc(n);
    if (!host || !back) return 1;
    for (size_t i = 0; i < n; i++) host[i] = (unsigned char)(i * 7 + 3);
    show("  cuMemcpyHtoD 3 MiB", cuMemcpyHtoD(p, host, n));
    show("  cuMemcpyDtoH 3 MiB", cuMemcpyDtoH(back, p, n));
    say("  bytes round-trip", memcmp(host, back, n) ? "DIFFER" : "same");
    show("  cuMemsetD8(p + 1 MiB, 0xab, 4096)", cuMemsetD8(p + (1u << 20), 0xab, 4096));
    show("  cuMemcpyDtoH 8 KiB at p + 1 MiB - 4 KiB", cuMemcpyDtoH(back, p + (1u << 20) - 4096, 8192));
    int memset_ok = 1;
    for (size_t i = 0; i < 8192; i++) memset_ok &= back[i] == (i < 4096 ? host[(1u << 20) - 4096 + i] : 0xab);
    say("  memset visible, neighbours intact", yes(memset_ok));

    show("  cuMemGetAddressRange(p)", cuMemGetAddressRange(&base, &size, p));
    say("    base is p", yes(base == p));
    num("    size", size);
    base = 0, size = 0;
    show("  cuMemGetAddressRange(p + 12345)", cuMemGetAddressRange(&base, &size, p + 12345));
    say("    base is p", yes(base == p));
    num("    size", size);
    show("  cuMemGetAddressRange(p + 3 MiB - 1)", cuMemGetAddressRange(&base, NULL, p + n - 1));
    say("    base is p", yes(base == p));
    show("  cuMemGetAddressRange(NULL, NULL, p + 1)", cuMemGetAddressRange(NULL, NULL, p + 1));
    char on_stack;
    show("cuMemGetAddressRange(host address)", cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)&on_stack));

    size_t rsize = 0;
    CUdeviceptr rstart = 0;
    unsigned mtype = 0;
    int ordinal = -1;
    show("  cuPointerGetAttribute(RANGE_SIZE, p + 4096)", cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p + 4096));
    num("    range size", rsize);
    show("  cuPointerGetAttribute(RANGE_START_ADDR, p + 4096)",
         cuPointerGetAttribute(&rstart, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p + 4096));
    say("    range start is p", yes(rstart == p));
    show("  cuPointerGetAttribute(MEMORY_TYPE, p + 4096)", cuPointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p + 4096));
    say("    memory type", mtype == CU_MEMORYTYPE_DEVICE ? "DEVICE" : mtype == CU_MEMORYTYPE_HOST ? "HOST" : "other");
    show("  cuPointerGetAttribute(DEVICE_ORDINAL, p)", cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
    num("    device ordinal", (unsigned long long)ordinal);
    {
        CUpointer_attribute attrs[4] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                        CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
        CUdeviceptr s2 = 0;
        size_t z2 = 0;
        unsigned t2 = 0;
        int o2 = -1;
        void *data[4] = {&s2, &z2, &t2, &o2};
        show("  cuPointerGetAttributes(4 attributes, p + 2 MiB)", cuPointerGetAttributes(4, attrs, data, p + (2u << 20)));
        say("    start is p, size 3 MiB, device, ordinal 0",
            yes(s2 == p && z2 == n && t2 == CU_MEMORYTYPE_DEVICE && o2 == 0));
    }
    show("cuPointerGetAttribute(RANGE_SIZE, host address)",
         cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, (CUdeviceptr)(uintptr_t)&on_stack));

    show("  cuMemFree(p + 4096) (interior)", cuMemFree(p + 4096));
    show("  cuMemcpyDtoH after the interior free", cuMemcpyDtoH(back, p, 4096));
    say("    still holds its bytes", yes(memcmp(back, host, 4096) == 0));
    show("  cuMemFree(p)", cuMemFree(p));
    show("  cuMemFree(p) again (double free)", cuMemFree(p));
    show("  cuMemGetAddressRange(freed p)", cuMemGetAddressRange(&base, &size, p));
    show("  cuPointerGetAttribute(RANGE_SIZE, freed p)", cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p));
    show("cuMemFree(0)", cuMemFree(0));

    show("cuMemAlloc(&p, 1 TiB)", cuMemAlloc(&p, 1ull << 40));
    show("cuMemAlloc(&p, 4 KiB) after OOM", cuMemAlloc(&p, 4096));
    show("  cuMemGetAddressRange(p)", cuMemGetAddressRange(NULL, &size, p));
    num("    size", size);
    show("  cuMemFree(p)", cuMemFree(p));

    size_t pitch = 0;
    show("cuMemAllocPitch(&p, &pitch, 1000, 37, 4)", cuMemAllocPitch(&p, &pitch, 1000, 37, 4));
    num("  pitch", pitch);
    show("  cuMemGetAddressRange(p + pitch)", cuMemGetAddressRange(&base, &size, p + pitch));
    say("    base is p", yes(base == p));
    num("    size", size);
    show("  cuMemsetD8 pitch x 37", cuMemsetD8(p, 0x11, pitch * 37));
    show("  cuMemFree(p)", cuMemFree(p));
    size_t pitch2 = 12345;
    show("cuMemAllocPitch(&p, &pitch, 64, 8, 3) bad element", cuMemAllocPitch(&p, &pitch2, 64, 8, 3));
    num("  pitch left as it was", pitch2);
    show("cuMemAllocPitch(&p, &pitch, 0, 8, 4) no width", cuMemAllocPitch(&p, &pitch2, 0, 8, 4));
    show("cuMemAllocPitch(&p, &pitch, 4096, 0, 4) no height", cuMemAllocPitch(&p, &pitch2, 4096, 0, 4));
    show("cuMemAllocPitch(&p, &pitch, 3000, 1, 16)", cuMemAllocPitch(&p, &pitch2, 3000, 1, 16));
    num("  pitch", pitch2);
    show("  cuMemFree(p)", cuMemFree(p));

    CUstream s = NULL;
    show("cuStreamCreate", cuStreamCreate(&s, 0));
    show("cuMemAllocAsync(&q, 5 MiB, s)", cuMemAllocAsync(&q, 5u << 20, s));
    show("  cuMemsetD8Async", cuMemsetD8Async(q, 0x5a, 5u << 20, s));
    show("  cuStreamSynchronize", cuStreamSynchronize(s));
    show("  cuMemcpyDtoH 1 MiB", cuMemcpyDtoH(back, q + (4u << 20), 1u << 20));
    int ok = 1;
    for (size_t i = 0; i < (1u << 20); i++) ok &= back[i] == 0x5a;
    say("  memset visible", yes(ok));
    show("  cuMemGetAddressRange(q + 5 MiB - 1)", cuMemGetAddressRange(&base, &size, q + (5u << 20) - 1));
    say("    base is q", yes(base == q));
    num("    size", size);
    show("  cuMemFreeAsync(q + 4096, s) (interior)", cuMemFreeAsync(q + 4096, s));
    show("  cuMemFreeAsync(q, s)", cuMemFreeAsync(q, s));
    show("  cuStreamSynchronize", cuStreamSynchronize(s));
    show("cuMemAllocAsync(NULL, 1, s)", cuMemAllocAsync(NULL, 1, s));
    show("cuMemAllocAsync(&q, 0, s)", cuMemAllocAsync(&q, 0, s));
    show("cuMemAllocAsync(&q, 2 MiB, s) then cuMemFree(q)", cuMemAllocAsync(&q, 2u << 20, s));
    show("  cuStreamSynchronize", cuStreamSynchronize(s));
    show("  cuMemFree(q)", cuMemFree(q));

    show("cuMemGetInfo", cuMemGetInfo(&f0, &total));
    say("  free <= total", yes(f0 <= total && total > 0));
    show("cuMemAlloc(&p, 64 MiB)", cuMemAlloc(&p, 64u << 20));
    cuMemGetInfo(&f1, &total);
    say("  free dropped by at least 64 MiB", yes(f1 + (64u << 20) <= f0));
    show("  cuMemFree(p)", cuMemFree(p));
    cuMemGetInfo(&f1, &total);
    say("  free back to where it was", yes(f1 == f0));
    show("cuStreamDestroy", cuStreamDestroy(s));
    show("cuCtxSynchronize", cuCtxSynchronize());
    free(host);
    free(back);
    return 0;
}

static const char *access_of(CUdevice dev, CUdeviceptr p)
{
    static char buf[4][64];
    static int k;
    char *out = buf[k++ % 4];
    CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev};
    unsigned long long flags = 0;
    CUresult r = cuMemGetAccess(&flags, &loc, p);
    if (r != CUDA_SUCCESS) snprintf(out, 64, "error %s", ename(r));
    else snprintf(out, 64, "%s", flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? "READWRITE"
                                 : flags == CU_MEM_ACCESS_FLAGS_PROT_READ    ? "READ"
                                 : flags == CU_MEM_ACCESS_FLAGS_PROT_NONE    ? "NONE"
                                                                             : "other");
    return out;
}

static int peer(void)
{
    int count = 0;
    CUdevice d0, d1;
    CUcontext c0, c1;
    CUdeviceptr a = 0, b = 0, c = 0;
    show("cuInit", cuInit(0));
    cuDeviceGetCount(&count);
    num("devices", (unsigned long long)count);
    if (count < 2) return 1;
    cuDeviceGet(&d0, 0);
    cuDeviceGet(&d1, 1);
    int can = 0;
    cuDeviceCanAccessPeer(&can, d1, d0);
    say("device 1 can access device 0", yes(can));
    show("retain device 0", cuDevicePrimaryCtxRetain(&c0, d0));
    show("retain device 1", cuDevicePrimaryCtxRetain(&c1, d1));
    cuCtxSetCurrent(c0);
    show("cuMemAlloc(&a, 2 MiB) on device 0", cuMemAlloc(&a, 2u << 20));
    say("  a: device 0 access", access_of(d0, a));
    say("  a: device 1 access", access_of(d1, a));
    cuCtxSetCurrent(c1);
    show("device 1: cuCtxEnablePeerAccess(device 0)", cuCtxEnablePeerAccess(c0, 0));
    show("device 1: cuCtxEnablePeerAccess again", cuCtxEnablePeerAccess(c0, 0));
    say("  a: device 1 access", access_of(d1, a));
    say("  a: device 0 access", access_of(d0, a));
    cuCtxSetCurrent(c0);
    show("cuMemAlloc(&b, 3 MiB) on device 0 after enabling", cuMemAlloc(&b, 3u << 20));
    say("  b: device 1 access", access_of(d1, b));
    say("  b: device 0 access", access_of(d0, b));
    cuCtxSetCurrent(c1);
    show("device 1: cuCtxDisablePeerAccess(device 0)", cuCtxDisablePeerAccess(c0));
    show("device 1: cuCtxDisablePeerAccess again", cuCtxDisablePeerAccess(c0));
    say("  a: device 1 access", access_of(d1, a));
    say("  b: device 1 access", access_of(d1, b));
    say("  a: device 0 access", access_of(d0, a));
    cuCtxSetCurrent(c0);
    unsigned char h[4096], back[4096];
    memset(h, 0x3c, sizeof h);
    show("device 0: cuMemcpyHtoD(a) after disabling", cuMemcpyHtoD(a, h, sizeof h));
    show("device 0: cuMemcpyDtoH(a)", cuMemcpyDtoH(back, a, sizeof back));
    say("  device 0 still reads and writes a", yes(memcmp(h, back, sizeof h) == 0));
    show("cuMemAlloc(&c, 2 MiB) on device 0 after disabling", cuMemAlloc(&c, 2u << 20));
    say("  c: device 1 access", access_of(d1, c));
    show("cuMemFree(a)", cuMemFree(a));
    show("cuMemFree(b)", cuMemFree(b));
    show("cuMemFree(c)", cuMemFree(c));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "peer")) return peer();
    return semantics();
}
