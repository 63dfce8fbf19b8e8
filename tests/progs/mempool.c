/* Memory pools as a program sees them.  One line per observation, never a raw address, so the
 * tests can compare runs natively and under the shim; the default pool's usage figures are the
 * lines starting "figures" (and "own pool after cudaMallocAsync"), whose numbers may differ
 * between runs while keeping their meaning.
 *   mempool          (runtime API) the default pool's attributes, high-water resets and trim
 *                    around cudaMallocAsync; a pool of the program's own, allocated from with
 *                    cudaMallocFromPoolAsync and made current with cudaDeviceSetMemPool and
 *                    cudaMemSetMemPool
 *   mempool peer     (runtime API, 2 devices) cudaMemPoolSetAccess on the default pools, with
 *                    each allocation's access as cuMemGetAccess sees it
 *   mempool driver   (driver API, 2 devices) the same calls as cuMemPool* / cuDeviceSetMemPool */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MiB (1ull << 20)

static void show(const char *what, cudaError_t e) { printf("%-64s %s\n", what, cudaGetErrorName(e)); }
static void say(const char *what, const char *v) { printf("%-64s %s\n", what, v); }
static void num(const char *what, unsigned long long v) { printf("%-64s %llu\n", what, v); }
static const char *yes(int c) { return c ? "yes" : "NO"; }

static const char *dname(CUresult r)
{
    static char buf[32];
    const char *s = NULL;
    if (cuGetErrorName(r, &s) == CUDA_SUCCESS && s) return s;
    snprintf(buf, sizeof buf, "CUresult %d", (int)r);
    return buf;
}

static void dshow(const char *what, CUresult r) { printf("%-64s %s\n", what, dname(r)); }

/* Device `dev`'s access to the allocation at p, as the driver reports it for that address. */
static const char *access_of(int dev, const void *p)
{
    static char buf[4][64];
    static int k;
    char *out = buf[k++ % 4];
    CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev};
    unsigned long long flags = 0;
    CUresult r = cuMemGetAccess(&flags, &loc, (CUdeviceptr)(uintptr_t)p);
    if (r != CUDA_SUCCESS) snprintf(out, 64, "error %s", dname(r));
    else snprintf(out, 64, "%s", flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? "READWRITE"
                                 : flags == CU_MEM_ACCESS_FLAGS_PROT_READ    ? "READ"
                                 : flags == CU_MEM_ACCESS_FLAGS_PROT_NONE    ? "NONE"
                                                                             : "other");
    return out;
}

static const char *flags_name(int f)
{
    return f == cudaMemAccessFlagsProtReadWrite ? "READWRITE" : f == cudaMemAccessFlagsProtRead ? "READ"
           : f == cudaMemAccessFlagsProtNone                                                    ? "NONE"
                                                                                                : "other";
}

static void pool_access(const char *what, cudaMemPool_t pool, int dev)
{
    struct cudaMemLocation loc = {.type = cudaMemLocationTypeDevice, .id = dev};
    enum cudaMemAccessFlags f = cudaMemAccessFlagsProtNone;
    cudaError_t e = cudaMemPoolGetAccess(&f, pool, &loc);
    say(what, e == cudaSuccess ? flags_name(f) : cudaGetErrorName(e));
}

static void figures(cudaMemPool_t pool, const char *when)
{
    unsigned long long r = 0, u = 0, rh = 0, uh = 0;
    cudaError_t e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &r);
    if (e == cudaSuccess) e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &u);
    if (e == cudaSuccess) e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &rh);
    if (e == cudaSuccess) e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &uh);
    if (e != cudaSuccess) printf("figures %s: error %s\n", when, cudaGetErrorName(e));
    else printf("figures %s: reserved %llu used %llu reserved_high %llu used_high %llu\n", when, r, u, rh, uh);
}

static void set_u64(const char *what, cudaMemPool_t pool, enum cudaMemPoolAttr attr, unsigned long long v)
{
    show(what, cudaMemPoolSetAttribute(pool, attr, &v));
}

static void get_u64(const char *what, cudaMemPool_t pool, enum cudaMemPoolAttr attr)
{
    unsigned long long v = 0;
    cudaError_t e = cudaMemPoolGetAttribute(pool, attr, &v);
    if (e == cudaSuccess) num(what, v);
    else say(what, cudaGetErrorName(e));
}

static void get_int(const char *what, cudaMemPool_t pool, enum cudaMemPoolAttr attr)
{
    int v = -1;
    cudaError_t e = cudaMemPoolGetAttribute(pool, attr, &v);
    if (e == cudaSuccess) num(what, (unsigned long long)v);
    else say(what, cudaGetErrorName(e));
}

static int fill_and_check(void *p, size_t n, unsigned char v, cudaStream_t s)
{
    unsigned char *back = malloc(n);
    if (!back) return 0;
    cudaMemsetAsync(p, v, n, s);
    cudaStreamSynchronize(s);
    cudaMemcpy(back, p, n, cudaMemcpyDeviceToHost);
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= back[i] == v;
    free(back);
    return ok;
}

static int single(void)
{
    cudaMemPool_t def = NULL, cur = NULL, mine = NULL;
    cudaStream_t s;
    void *a = NULL, *b = NULL, *c = NULL, *d = NULL, *e = NULL;
    const size_t na = 3 * MiB, nb = 5 * MiB + 1;
    show("cudaSetDevice(0)", cudaSetDevice(0));
    show("cudaDeviceGetDefaultMemPool(0)", cudaDeviceGetDefaultMemPool(&def, 0));
    show("cudaDeviceGetMemPool(0)", cudaDeviceGetMemPool(&cur, 0));
    say("  the default pool is current", yes(cur == def && def));
    show("cudaStreamCreate", cudaStreamCreate(&s));
    get_u64("release threshold", def, cudaMemPoolAttrReleaseThreshold);
    get_int("reuse: follow event dependencies", def, cudaMemPoolReuseFollowEventDependencies);
    get_int("reuse: allow opportunistic", def, cudaMemPoolReuseAllowOpportunistic);
    get_int("reuse: allow internal dependencies", def, cudaMemPoolReuseAllowInternalDependencies);
    figures(def, "start");

    show("cudaMallocAsync(&a, 3 MiB)", cudaMallocAsync(&a, na, s));
    show("cudaMallocAsync(&b, 5 MiB + 1)", cudaMallocAsync(&b, nb, s));
    say("  a and b hold what was written", yes(fill_and_check(a, na, 0x3a, s) && fill_and_check(b, nb, 0x3b, s)));
    figures(def, "a and b live");

    set_u64("set release threshold 64 MiB", def, cudaMemPoolAttrReleaseThreshold, 64 * MiB);
    get_u64("  release threshold", def, cudaMemPoolAttrReleaseThreshold);
    {
        int off = 0, on = 1;
        show("set reuse: allow opportunistic 0", cudaMemPoolSetAttribute(def, cudaMemPoolReuseAllowOpportunistic, &off));
        get_int("  reuse: allow opportunistic", def, cudaMemPoolReuseAllowOpportunistic);
        show("set reuse: allow opportunistic 1", cudaMemPoolSetAttribute(def, cudaMemPoolReuseAllowOpportunistic, &on));
    }
    set_u64("set reserved current (read-only)", def, cudaMemPoolAttrReservedMemCurrent, 0);
    set_u64("set used high 5 (only a reset to 0 is allowed)", def, cudaMemPoolAttrUsedMemHigh, 5);
    get_u64("get attribute 99 (no such attribute)", def, (enum cudaMemPoolAttr)99);

    show("cudaFreeAsync(b)", cudaFreeAsync(b, s));
    show("  cudaStreamSynchronize", cudaStreamSynchronize(s));
    figures(def, "b freed");
    set_u64("reset used high", def, cudaMemPoolAttrUsedMemHigh, 0);
    set_u64("reset reserved high", def, cudaMemPoolAttrReservedMemHigh, 0);
    figures(def, "high-water marks reset");
    show("cudaFreeAsync(a)", cudaFreeAsync(a, s));
    show("  cudaStreamSynchronize", cudaStreamSynchronize(s));
    figures(def, "a freed");
    show("cudaMemPoolTrimTo(default, 0)", cudaMemPoolTrimTo(def, 0));
    figures(def, "trimmed");

    struct cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    show("cudaMemPoolCreate(own pool on device 0)", cudaMemPoolCreate(&mine, &props));
    set_u64("own pool: set release threshold 12345", mine, cudaMemPoolAttrReleaseThreshold, 12345);
    get_u64("  own pool: release threshold", mine, cudaMemPoolAttrReleaseThreshold);
    show("cudaMallocFromPoolAsync(&c, 1 MiB, own pool)", cudaMallocFromPoolAsync(&c, MiB, mine, s));
    say("  c holds what was written", yes(fill_and_check(c, MiB, 0x3c, s)));
    get_u64("  own pool: used", mine, cudaMemPoolAttrUsedMemCurrent);
    get_u64("  own pool: reserved", mine, cudaMemPoolAttrReservedMemCurrent);
    figures(def, "own pool allocation live");
    show("cudaDeviceSetMemPool(0, own pool)", cudaDeviceSetMemPool(0, mine));
    show("cudaDeviceGetMemPool(0)", cudaDeviceGetMemPool(&cur, 0));
    say("  the own pool is current", yes(cur == mine));
    show("cudaMallocAsync(&d, 2 MiB) with the own pool current", cudaMallocAsync(&d, 2 * MiB, s));
    say("  d holds what was written", yes(fill_and_check(d, 2 * MiB, 0x3d, s)));
    {
        unsigned long long r = 0, u = 0;
        cudaMemPoolGetAttribute(mine, cudaMemPoolAttrReservedMemCurrent, &r);
        cudaMemPoolGetAttribute(mine, cudaMemPoolAttrUsedMemCurrent, &u);
        printf("own pool after cudaMallocAsync: reserved %llu used %llu\n", r, u);
    }
    show("cudaFreeAsync(d)", cudaFreeAsync(d, s));
    show("cudaFreeAsync(c)", cudaFreeAsync(c, s));
    show("  cudaStreamSynchronize", cudaStreamSynchronize(s));
    show("own pool: cudaMemPoolTrimTo(0)", cudaMemPoolTrimTo(mine, 0));

    struct cudaMemLocation dev0 = {.type = cudaMemLocationTypeDevice, .id = 0};
    show("cudaMemSetMemPool(device 0, pinned, default)", cudaMemSetMemPool(&dev0, cudaMemAllocationTypePinned, def));
    show("cudaMemGetMemPool(device 0, pinned)", cudaMemGetMemPool(&cur, &dev0, cudaMemAllocationTypePinned));
    say("  the default pool is current", yes(cur == def));
    show("cudaMallocAsync(&e, 2 MiB) with the default pool current", cudaMallocAsync(&e, 2 * MiB, s));
    figures(def, "default pool current again");
    show("cudaFreeAsync(e)", cudaFreeAsync(e, s));
    show("cudaMemSetMemPool(device 0, pinned, own pool)", cudaMemSetMemPool(&dev0, cudaMemAllocationTypePinned, mine));
    show("cudaDeviceSetMemPool(0, default)", cudaDeviceSetMemPool(0, def));
    show("cudaDeviceGetMemPool(0)", cudaDeviceGetMemPool(&cur, 0));
    say("  the default pool is current", yes(cur == def));
    show("cudaDeviceSetMemPool(0, NULL)", cudaDeviceSetMemPool(0, NULL));
    show("cudaMemPoolDestroy(own pool)", cudaMemPoolDestroy(mine));
    show("cudaMemPoolDestroy(default)", cudaMemPoolDestroy(def));
    show("  cudaStreamSynchronize", cudaStreamSynchronize(s));
    show("cudaMemPoolTrimTo(default, 0)", cudaMemPoolTrimTo(def, 0));
    figures(def, "end");
    show("cudaStreamDestroy", cudaStreamDestroy(s));
    return 0;
}

static void grant(const char *what, cudaMemPool_t pool, int dev, enum cudaMemAccessFlags flags)
{
    struct cudaMemAccessDesc desc = {.location = {.type = cudaMemLocationTypeDevice, .id = dev}, .flags = flags};
    show(what, cudaMemPoolSetAccess(pool, &desc, 1));
}

static int peer(void)
{
    int n = 0;
    cudaMemPool_t def0 = NULL, def1 = NULL, mine = NULL;
    cudaStream_t s0, s1;
    void *a = NULL, *b = NULL, *c = NULL;
    show("cudaGetDeviceCount", cudaGetDeviceCount(&n));
    num("devices", (unsigned long long)n);
    if (n < 2) return 1;
    cudaSetDevice(0);
    cudaStreamCreate(&s0);
    show("cudaDeviceGetDefaultMemPool(0)", cudaDeviceGetDefaultMemPool(&def0, 0));
    show("cudaDeviceGetDefaultMemPool(1)", cudaDeviceGetDefaultMemPool(&def1, 1));
    show("cudaMallocAsync(&a, 2 MiB) on device 0", cudaMallocAsync(&a, 2 * MiB, s0));
    cudaStreamSynchronize(s0);
    say("  a: device 1 access", access_of(1, a));
    pool_access("default pool 0: device 1 access", def0, 1);

    struct cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    show("cudaMemPoolCreate(own pool on device 0)", cudaMemPoolCreate(&mine, &props));
    grant("own pool: grant device 1 read-write", mine, 1, cudaMemAccessFlagsProtReadWrite);
    pool_access("  own pool: device 1 access", mine, 1);
    say("  a: device 1 access", access_of(1, a));

    grant("default pool 0: grant device 1 read-write", def0, 1, cudaMemAccessFlagsProtReadWrite);
    pool_access("  default pool 0: device 1 access", def0, 1);
    say("  a: device 1 access", access_of(1, a));
    say("  a: device 0 access", access_of(0, a));
    show("cudaMallocAsync(&b, 3 MiB) on device 0 after the grant", cudaMallocAsync(&b, 3 * MiB, s0));
    cudaStreamSynchronize(s0);
    say("  b: device 1 access", access_of(1, b));
    say("  b: device 0 access", access_of(0, b));

    cudaSetDevice(1);
    cudaStreamCreate(&s1);
    show("cudaMallocAsync(&c, 2 MiB) on device 1", cudaMallocAsync(&c, 2 * MiB, s1));
    cudaStreamSynchronize(s1);
    say("  c: device 0 access", access_of(0, c));
    say("  c: device 1 access", access_of(1, c));

    grant("default pool 0: revoke device 0's own access", def0, 0, cudaMemAccessFlagsProtNone);
    say("  a: device 0 access", access_of(0, a));
    grant("default pool 0: revoke device 1", def0, 1, cudaMemAccessFlagsProtNone);
    pool_access("  default pool 0: device 1 access", def0, 1);
    say("  a: device 1 access", access_of(1, a));
    say("  b: device 1 access", access_of(1, b));
    say("  a: device 0 access", access_of(0, a));
    grant("default pool 1: grant device 0 read-write", def1, 0, cudaMemAccessFlagsProtReadWrite);
    say("  c: device 0 access", access_of(0, c));
    say("  a: device 1 access", access_of(1, a));
    grant("default pool 1: revoke device 0", def1, 0, cudaMemAccessFlagsProtNone);
    say("  c: device 0 access", access_of(0, c));

    show("cudaFreeAsync(c)", cudaFreeAsync(c, s1));
    cudaStreamSynchronize(s1);
    cudaSetDevice(0);
    show("cudaFreeAsync(a)", cudaFreeAsync(a, s0));
    show("cudaFreeAsync(b)", cudaFreeAsync(b, s0));
    cudaStreamSynchronize(s0);
    show("cudaMemPoolDestroy(own pool)", cudaMemPoolDestroy(mine));
    return 0;
}

static int driver(void)
{
    int n = 0;
    CUdevice d0 = 0, d1 = 1;
    CUcontext c0;
    CUmemoryPool def0 = NULL, cur = NULL, mine = NULL;
    CUdeviceptr a = 0;
    dshow("cuInit", cuInit(0));
    cuDeviceGetCount(&n);
    num("devices", (unsigned long long)n);
    if (n < 2) return 1;
    dshow("cuDevicePrimaryCtxRetain(0)", cuDevicePrimaryCtxRetain(&c0, d0));
    cuCtxSetCurrent(c0);
    dshow("cuDeviceGetDefaultMemPool(0)", cuDeviceGetDefaultMemPool(&def0, d0));
    dshow("cuMemAllocAsync(&a, 2 MiB)", cuMemAllocAsync(&a, 2 * MiB, NULL));
    cuStreamSynchronize(NULL);
    say("  a: device 1 access", access_of(1, (void *)(uintptr_t)a));
    CUmemAccessDesc desc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d1},
                            .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    dshow("cuMemPoolSetAccess(default 0, device 1 read-write)", cuMemPoolSetAccess(def0, &desc, 1));
    say("  a: device 1 access", access_of(1, (void *)(uintptr_t)a));
    cuuint64_t v = 32 * MiB;
    dshow("cuMemPoolSetAttribute(default 0, release threshold 32 MiB)",
          cuMemPoolSetAttribute(def0, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v));
    v = 0;
    dshow("cuMemPoolGetAttribute(default 0, release threshold)",
          cuMemPoolGetAttribute(def0, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v));
    num("  release threshold", v);
    v = 0;
    dshow("cuMemPoolSetAttribute(default 0, reset used high)", cuMemPoolSetAttribute(def0, CU_MEMPOOL_ATTR_USED_MEM_HIGH, &v));
    cuuint64_t used = 0;
    dshow("cuMemPoolGetAttribute(default 0, used)", cuMemPoolGetAttribute(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used));
    printf("figures driver: used %llu\n", (unsigned long long)used);
    dshow("cuMemFreeAsync(a)", cuMemFreeAsync(a, NULL));
    cuStreamSynchronize(NULL);
    dshow("cuMemPoolTrimTo(default 0, 0)", cuMemPoolTrimTo(def0, 0));
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    dshow("cuMemPoolSetAccess(default 0, device 1 none)", cuMemPoolSetAccess(def0, &desc, 1));

    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = d0;
    dshow("cuMemPoolCreate(own pool on device 0)", cuMemPoolCreate(&mine, &props));
    dshow("cuDeviceSetMemPool(0, own pool)", cuDeviceSetMemPool(d0, mine));
    dshow("cuDeviceGetMemPool(0)", cuDeviceGetMemPool(&cur, d0));
    say("  the own pool is current", yes(cur == mine));
    CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d0};
    dshow("cuMemSetMemPool(device 0, pinned, default)", cuMemSetMemPool(&loc, CU_MEM_ALLOCATION_TYPE_PINNED, def0));
    dshow("cuMemGetMemPool(device 0, pinned)", cuMemGetMemPool(&cur, &loc, CU_MEM_ALLOCATION_TYPE_PINNED));
    say("  the default pool is current", yes(cur == def0));
    dshow("cuDeviceSetMemPool(1, own pool of device 0)", cuDeviceSetMemPool(d1, mine));
    dshow("cuMemPoolDestroy(own pool)", cuMemPoolDestroy(mine));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "peer")) return peer();
    if (argc > 1 && !strcmp(argv[1], "driver")) return driver();
    return single();
}
