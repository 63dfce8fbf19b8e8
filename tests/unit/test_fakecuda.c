/* The emulated driver (build/fakecuda/libcuda.so.1) itself: the contract the shim's tests rely on.
 * Reached with dlopen("libcuda.so.1") + dlsym like every caller; knobs read at load time are
 * checked in forked children that set the environment before their own dlopen. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>

#include "../fakecuda/fakecuda.h"
#include "check.h"

#define MiB ((size_t)1 << 20)
#define GRAN (2 * MiB)

#define STR_(x) #x
#define STR(x) STR_(x)
/* p_X has the type of X as cuda.h declares it; dlsym gets the macro-expanded (exported) name. */
#define FNS(X)                                                                                   \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetName)        \
    X(cuDeviceGetUuid) X(cuDeviceTotalMem) X(cuDeviceGetAttribute) X(cuDeviceCanAccessPeer)      \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxGetCurrent)                  \
    X(cuCtxSetCurrent) X(cuCtxGetDevice) X(cuCtxSynchronize) X(cuCtxPushCurrent)                 \
    X(cuCtxPopCurrent) X(cuCtxEnablePeerAccess) X(cuGetErrorName) X(cuGetErrorString)            \
    X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate)   \
    X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemRelease) X(cuMemExportToShareableHandle)  \
    X(cuMemImportFromShareableHandle) X(cuMemRetainAllocationHandle) X(cuMemGetAddressRange)     \
    X(cuPointerGetAttribute) X(cuMemAlloc) X(cuMemFree) X(cuMemAllocAsync) X(cuMemFreeAsync)     \
    X(cuMemGetInfo) X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemcpyDtoD) X(cuMemsetD8) X(cuMemsetD32) \
    X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamQuery)                 \
    X(cuStreamWaitEvent) X(cuStreamBeginCapture) X(cuStreamEndCapture) X(cuStreamIsCapturing)    \
    X(cuEventCreate) X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy)    \
    X(cuGetProcAddress) X(cuIpcGetMemHandle) X(cuMemGetAccess) X(cuDeviceGetDefaultMemPool)        \
    X(cuDeviceGetMemPool) X(cuDeviceSetMemPool) X(cuMemGetDefaultMemPool) X(cuMemGetMemPool)     \
    X(cuMemSetMemPool) X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuMemPoolSetAccess)              \
    X(cuMemPoolGetAccess) X(cuMemPoolSetAttribute) X(cuMemPoolGetAttribute) X(cuMemPoolTrimTo)   \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocHost) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemcpyDtoHAsync)      \
    X(cuMemHostRegister) X(cuMemHostUnregister)

#define DECL(name) static __typeof__(&name) p_##name;
FNS(DECL)
#undef DECL

static void *lib;
static fakecuda_fail_next_fn fc_fail_next;
static fakecuda_set_budget_fn fc_set_budget;
static fakecuda_set_event_delay_us_fn fc_set_delay;
static fakecuda_set_copy_delay_us_fn fc_set_copy_delay;
static fakecuda_counters_fn fc_counters;

static void *sym(const char *name)
{
    void *p = dlsym(lib, name);
    CHECK(p != NULL, "dlsym %s", name);
    return p;
}

#define LOAD(name) do { void *p_ = sym(STR(name)); memcpy(&p_##name, &p_, sizeof p_); } while (0);
#define LOAD_CTL(var, name) do { void *p_ = sym(name); memcpy(&var, &p_, sizeof p_); } while (0)

static int open_driver(void)
{
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    CHECK(lib != NULL, "dlopen libcuda.so.1: %s", dlerror());
    if (!lib) return -1;
    int before = check__failed;
    FNS(LOAD)
    LOAD_CTL(fc_fail_next, "fakecuda_fail_next");
    LOAD_CTL(fc_set_budget, "fakecuda_set_budget");
    LOAD_CTL(fc_set_delay, "fakecuda_set_event_delay_us");
    LOAD_CTL(fc_set_copy_delay, "fakecuda_set_copy_delay_us");
    LOAD_CTL(fc_counters, "fakecuda_counters");
    return check__failed == before ? 0 : -1;
}

static CUcontext setup_ctx(int dev)
{
    CUcontext ctx = NULL;
    CHECK_EQ(p_cuInit(0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS);
    CHECK_EQ(p_cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    return ctx;
}

static CUmemAllocationProp prop_for(int dev, CUmemAllocationHandleType types)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = types;
    return prop;
}

static CUmemAccessDesc access_for(int dev, CUmemAccess_flags flags)
{
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = dev;
    d.flags = flags;
    return d;
}

/* cuMemCreate + reserve + map + read/write access; 0 on success. */
static int make_mapping(size_t size, CUmemGenericAllocationHandle *h, CUdeviceptr *va)
{
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemAccessDesc acc = access_for(0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    if (p_cuMemCreate(h, size, &prop, 0) != CUDA_SUCCESS) return -1;
    if (p_cuMemAddressReserve(va, size, 0, 0, 0) != CUDA_SUCCESS) return -1;
    if (p_cuMemMap(*va, size, 0, *h, 0) != CUDA_SUCCESS) return -1;
    return p_cuMemSetAccess(*va, size, &acc, 1) == CUDA_SUCCESS ? 0 : -1;
}

static void drop_mapping(size_t size, CUmemGenericAllocationHandle h, CUdeviceptr va)
{
    CHECK_EQ(p_cuMemUnmap(va, size), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAddressFree(va, size), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemRelease(h), CUDA_SUCCESS);
}

static struct fakecuda_counters counters(void)
{
    struct fakecuda_counters c;
    fc_counters(&c);
    return c;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Runs body in a forked child with extra environment; returns the child's exit status (0 when
 * every check in the child passed) or 128+signal. */
static int in_child(const char *const env[], void (*body)(void))
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        int before = check__failed;
        body();
        fflush(stderr);
        _exit(check__failed != before);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* ---- children: environment knobs read at load time ----------------------------------------- */

static void child_fail_env(void)
{
    if (open_driver()) return;
    CUcontext ctx = NULL;
    CHECK_EQ(p_cuInit(0), CUDA_ERROR_NO_DEVICE); /* cuInit:1:CUDA_ERROR_NO_DEVICE */
    CHECK_EQ(p_cuInit(0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    CUdeviceptr d = 0;
    CHECK_EQ(p_cuMemAlloc(&d, 4096), CUDA_ERROR_OUT_OF_MEMORY); /* cuMemAlloc_v2:2 */
    CHECK_EQ(p_cuMemAlloc(&d, 4096), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(p_cuMemAlloc(&d, 4096), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFree(d), CUDA_SUCCESS);
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h;
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_CONTEXT); /* cuMemCreate:1:201 */
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemRelease(h), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamQuery(NULL), CUDA_SUCCESS); /* the malformed entry was ignored */
    CHECK_EQ(counters().failures_injected, 4);
}

/* FAKECUDA_FAIL=cuMemAlloc@2,cuStreamQuery/test_fakecuda@3:2:NOT_READY,cuCtxSynchronize/other.so@1,
 * cuMemFree/@1: positions count from load, per calling object when one is named. */
static void child_fail_at(void)
{
    if (open_driver()) return;
    setup_ctx(0);
    CUdeviceptr d[3] = {0, 0, 0};
    CHECK_EQ(p_cuMemAlloc(&d[0], 4096), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAlloc(&d[1], 4096), CUDA_ERROR_OUT_OF_MEMORY); /* cuMemAlloc@2 */
    CHECK_EQ(p_cuMemAlloc(&d[2], 4096), CUDA_SUCCESS);
    CUresult want[] = {CUDA_SUCCESS, CUDA_SUCCESS, CUDA_ERROR_NOT_READY, CUDA_ERROR_NOT_READY, CUDA_SUCCESS};
    for (int i = 0; i < 5; i++) CHECK(p_cuStreamQuery(NULL) == want[i], "cuStreamQuery call %d", i + 1);
    CHECK_EQ(p_cuCtxSynchronize(), CUDA_SUCCESS); /* only other.so's first call would fail */
    CHECK_EQ(p_cuMemFree(d[0]), CUDA_SUCCESS);   /* the malformed entry was ignored */
    CHECK_EQ(p_cuMemFree(d[2]), CUDA_SUCCESS);
    CHECK_EQ(counters().failures_injected, 3);
}

static void child_no_vmm(void)
{
    if (open_driver()) return;
    setup_ctx(0);
    int v = -1;
    CHECK_EQ(p_cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0), CUDA_SUCCESS);
    CHECK_EQ(v, 0);
    CHECK_EQ(p_cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0),
             CUDA_SUCCESS);
    CHECK_EQ(v, 0);
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h;
    CUdeviceptr va, d;
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ(p_cuMemAddressReserve(&va, GRAN, 0, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ(p_cuMemAlloc(&d, 1000), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFree(d), CUDA_SUCCESS);
}

static void child_no_devices(void)
{
    if (open_driver()) return;
    int n = -1;
    CHECK_EQ(p_cuInit(0), CUDA_ERROR_NO_DEVICE);
    CHECK_EQ(p_cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
}

static void child_three_devices(void)
{
    if (open_driver()) return;
    int n = -1, can = -1;
    CHECK_EQ(p_cuInit(0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDeviceGetCount(&n), CUDA_SUCCESS);
    CHECK_EQ(n, 3);
    CUuuid a, b;
    CHECK_EQ(p_cuDeviceGetUuid(&a, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDeviceGetUuid(&b, 2), CUDA_SUCCESS);
    CHECK(memcmp(&a, &b, sizeof a) != 0, "uuids of devices 0 and 2 are equal");
    CUdevice d;
    CHECK_EQ(p_cuDeviceGet(&d, 3), CUDA_ERROR_INVALID_DEVICE);
    CHECK_EQ(p_cuDeviceCanAccessPeer(&can, 0, 1), CUDA_SUCCESS);
    CHECK_EQ(can, 1);
    CUcontext c1;
    setup_ctx(0);
    CHECK_EQ(p_cuDevicePrimaryCtxRetain(&c1, 1), CUDA_SUCCESS);
    CHECK_EQ(p_cuCtxEnablePeerAccess(c1, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuCtxEnablePeerAccess(c1, 0), CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    CUmemAllocationProp prop = prop_for(2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAddressReserve(&va, GRAN, 0, 0, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemMap(va, GRAN, 0, h, 0), CUDA_SUCCESS);
    int ord = -1;
    CHECK_EQ(p_cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va), CUDA_SUCCESS);
    CHECK_EQ(ord, 2);
    drop_mapping(GRAN, h, va);
}

static void child_budget(void)
{
    if (open_driver()) return;
    setup_ctx(0);
    size_t total = 0, free_b = 0;
    CHECK_EQ(p_cuDeviceTotalMem(&total, 0), CUDA_SUCCESS);
    CHECK_EQ(total, 6 * MiB);
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h1, h2;
    CHECK_EQ(p_cuMemCreate(&h1, 4 * MiB, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemCreate(&h2, 4 * MiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(p_cuMemGetInfo(&free_b, &total), CUDA_SUCCESS);
    CHECK_EQ(free_b, 2 * MiB);
    CHECK_EQ(p_cuMemRelease(h1), CUDA_SUCCESS);
}

static void child_delay_env(void)
{
    if (open_driver()) return;
    setup_ctx(0);
    CUevent e;
    CHECK_EQ(p_cuEventCreate(&e, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventRecord(e, NULL), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventQuery(e), CUDA_ERROR_NOT_READY);
    CHECK_EQ(p_cuEventSynchronize(e), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventQuery(e), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventDestroy(e), CUDA_SUCCESS);
}

static void child_copy_delay_env(void)
{
    if (open_driver()) return;
    setup_ctx(0);
    char a[64] = "x", b[64] = "";
    double t0 = now_s();
    CHECK_EQ(p_cuMemcpyDtoH(b, (CUdeviceptr)(uintptr_t)a, sizeof a), CUDA_SUCCESS);
    CHECK(now_s() - t0 >= 0.09 && b[0] == 'x', "a copy under FAKECUDA_COPY_DELAY_US took %.3f s", now_s() - t0);
}

static void child_counters_at_exit(void)
{
    if (open_driver()) return;
    setup_ctx(0);
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h;
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_SUCCESS); /* left alive on purpose */
    fflush(stderr);
    exit(check__failed ? 1 : 0); /* exit, not _exit: the dump runs at unload */
}

/* Memory pools on two devices: what the shim's pool tests compare against. */
static unsigned long long pool_attr(CUmemoryPool p, CUmemPool_attribute a)
{
    cuuint64_t v = 0xdeadull;
    CHECK_EQ(p_cuMemPoolGetAttribute(p, a, &v), CUDA_SUCCESS);
    return v;
}

static void child_mem_pools(void)
{
    if (open_driver()) return;
    setup_ctx(0);
    CUmemoryPool def0, def1, cur, mine;
    CHECK_EQ(p_cuDeviceGetDefaultMemPool(&def0, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDeviceGetDefaultMemPool(&def1, 1), CUDA_SUCCESS);
    CHECK(def0 && def1 && def0 != def1, "one default pool per device");
    CHECK_EQ(p_cuDeviceGetDefaultMemPool(&cur, 2), CUDA_ERROR_INVALID_DEVICE);
    CHECK_EQ(p_cuDeviceGetMemPool(&cur, 0), CUDA_SUCCESS);
    CHECK(cur == def0, "the default pool is current at first");
    CUmemLocation loc0 = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0};
    CHECK_EQ(p_cuMemGetDefaultMemPool(&cur, &loc0, CU_MEM_ALLOCATION_TYPE_PINNED), CUDA_SUCCESS);
    CHECK(cur == def0, "cuMemGetDefaultMemPool");

    /* attributes and accounting: 2 MiB-rounded blocks; freed bytes stay up to the threshold */
    int reuse = -1;
    CHECK_EQ(p_cuMemPoolGetAttribute(def0, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, &reuse), CUDA_SUCCESS);
    CHECK_EQ(reuse, 1);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), 0);
    size_t free0 = 0, total = 0, free1 = 0;
    CHECK_EQ(p_cuMemGetInfo(&free0, &total), CUDA_SUCCESS);
    CUdeviceptr a, b;
    CHECK_EQ(p_cuMemAllocAsync(&a, 3 * MiB, NULL), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAllocAsync(&b, 1 * MiB, NULL), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 6 * MiB);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 6 * MiB);
    CHECK_EQ(p_cuMemFreeAsync(b, NULL), CUDA_SUCCESS); /* threshold 0: released at once */
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 4 * MiB);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), 6 * MiB);
    cuuint64_t v = 64 * MiB;
    CHECK_EQ(p_cuMemPoolSetAttribute(def0, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), 64 * MiB);
    CHECK_EQ(p_cuMemFreeAsync(a, NULL), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 4 * MiB);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 0);
    CHECK_EQ(p_cuMemGetInfo(&free1, &total), CUDA_SUCCESS);
    CHECK_EQ(free0 - free1, 4 * MiB); /* idle pool memory stays the device's */
    CHECK_EQ(p_cuMemAllocAsync(&a, 2 * MiB, NULL), CUDA_SUCCESS); /* reuses idle bytes */
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 4 * MiB);
    CHECK_EQ(p_cuMemFree(a), CUDA_SUCCESS); /* cuMemFree returns pool memory too */
    v = 1;
    CHECK_EQ(p_cuMemPoolSetAttribute(def0, CU_MEMPOOL_ATTR_USED_MEM_HIGH, &v), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemPoolSetAttribute(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &v), CUDA_ERROR_INVALID_VALUE);
    v = 0;
    CHECK_EQ(p_cuMemPoolSetAttribute(def0, CU_MEMPOOL_ATTR_USED_MEM_HIGH, &v), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemPoolSetAttribute(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &v), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_USED_MEM_HIGH), 0);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), 4 * MiB);
    CHECK_EQ(p_cuMemPoolTrimTo(def0, 2 * MiB), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 2 * MiB);
    CHECK_EQ(p_cuMemPoolTrimTo(def0, 0), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 0);
    CHECK_EQ(p_cuMemGetInfo(&free1, &total), CUDA_SUCCESS);
    CHECK_EQ(free1, free0);

    /* a pool of the program's own: current for cuMemAllocAsync, then destroyed while in use */
    CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                            .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    CHECK_EQ(p_cuMemPoolCreate(&mine, &props), CUDA_SUCCESS);
    CHECK_EQ(p_cuDeviceSetMemPool(1, mine), CUDA_ERROR_INVALID_VALUE); /* another device's pool */
    CHECK_EQ(p_cuDeviceSetMemPool(0, mine), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemGetMemPool(&cur, &loc0, CU_MEM_ALLOCATION_TYPE_PINNED), CUDA_SUCCESS);
    CHECK(cur == mine, "the program's pool is current");
    CHECK_EQ(p_cuMemAllocAsync(&a, 1 * MiB, NULL), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(mine, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 2 * MiB);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 0);
    CHECK_EQ(p_cuMemAllocFromPoolAsync(&b, 4096, def0, NULL), CUDA_SUCCESS);
    CHECK_EQ(pool_attr(def0, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 4096);
    CHECK_EQ(p_cuMemFreeAsync(b, NULL), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemPoolDestroy(def0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemPoolDestroy(mine), CUDA_SUCCESS);
    CHECK_EQ(p_cuDeviceGetMemPool(&cur, 0), CUDA_SUCCESS);
    CHECK(cur == def0, "destroying the current pool makes the default current");
    CHECK_EQ(p_cuMemPoolGetAttribute(mine, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &v), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemFreeAsync(a, NULL), CUDA_SUCCESS); /* its last allocation frees it */
    CHECK_EQ(p_cuMemSetMemPool(&loc0, CU_MEM_ALLOCATION_TYPE_PINNED, def0), CUDA_SUCCESS);

    /* access: the pool's table, which cuMemGetAccess reports for its allocations */
    CUmemLocation loc1 = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 1};
    CUmemAccess_flags f = CU_MEM_ACCESS_FLAGS_PROT_MAX;
    unsigned long long g = 99;
    CHECK_EQ(p_cuMemAllocAsync(&a, 2 * MiB, NULL), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemPoolGetAccess(&f, def0, &loc1), CUDA_SUCCESS);
    CHECK_EQ(f, CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CHECK_EQ(p_cuMemGetAccess(&g, &loc1, a), CUDA_SUCCESS);
    CHECK_EQ(g, CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CUmemAccessDesc grant = access_for(1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
                    own = access_for(0, CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CHECK_EQ(p_cuMemPoolSetAccess(def0, &grant, 1), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemGetAccess(&g, &loc1, a), CUDA_SUCCESS);
    CHECK_EQ(g, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CHECK_EQ(p_cuMemPoolGetAccess(&f, def1, &loc0), CUDA_SUCCESS);
    CHECK_EQ(f, CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CHECK_EQ(p_cuMemPoolSetAccess(def0, &own, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemGetAccess(&g, &loc0, a), CUDA_SUCCESS);
    CHECK_EQ(g, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CHECK_EQ(p_cuMemFreeAsync(a, NULL), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAlloc(&a, 4096), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemGetAccess(&g, &loc0, a), CUDA_ERROR_INVALID_VALUE); /* no pool, no VMM mapping */
    CHECK_EQ(p_cuMemFree(a), CUDA_SUCCESS);
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    CHECK_EQ(p_cuGetProcAddress("cuMemPoolSetAccess", &fn, 12000, 0, &st), CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemPoolSetAccess"), "cuGetProcAddress(cuMemPoolSetAccess)");
    CHECK_EQ(p_cuGetProcAddress("cuMemAllocFromPoolAsync", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st),
             CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemAllocFromPoolAsync_ptsz"), "per-thread variant");
    CHECK_EQ(counters().memalloc_live, 0);
    CHECK_EQ(counters().phys_bytes_live, 2 * MiB); /* below the release threshold: kept */
    CHECK_EQ(p_cuMemPoolTrimTo(def0, 0), CUDA_SUCCESS);
    CHECK_EQ(counters().phys_bytes_live, 0);
}

/* ---- in the parent ------------------------------------------------------------------------- */

static void *thread_ctx(void *arg)
{
    (void)arg;
    CUcontext c = (CUcontext)1;
    CUdevice d;
    CUdeviceptr p;
    CHECK_EQ(p_cuCtxGetCurrent(&c), CUDA_SUCCESS);
    CHECK(c == NULL, "a new thread has a current context");
    CHECK_EQ(p_cuCtxGetDevice(&d), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_EQ(p_cuMemAlloc(&p, 4096), CUDA_ERROR_INVALID_CONTEXT);
    return NULL;
}

static void test_basics(void)
{
    int n = -1, v = -1;
    CHECK_EQ(p_cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_EQ(p_cuDriverGetVersion(&v), CUDA_SUCCESS);
    CHECK_EQ(v, 13000);
    CHECK_EQ(p_cuInit(0), CUDA_SUCCESS);
    CHECK_EQ(p_cuDeviceGetCount(&n), CUDA_SUCCESS);
    CHECK_EQ(n, 1);
    char name[128] = "";
    CHECK_EQ(p_cuDeviceGetName(name, sizeof name, 0), CUDA_SUCCESS);
    CHECK(name[0] != 0, "empty device name");
    CUuuid u1, u2;
    void *uuid_v1 = sym("cuDeviceGetUuid");
    CUresult (*get_uuid_v1)(CUuuid *, CUdevice);
    memcpy(&get_uuid_v1, &uuid_v1, sizeof uuid_v1);
    CHECK_EQ(p_cuDeviceGetUuid(&u1, 0), CUDA_SUCCESS);
    CHECK_EQ(get_uuid_v1(&u2, 0), CUDA_SUCCESS);
    CHECK(!memcmp(&u1, &u2, sizeof u1), "uuid v1 and v2 differ");
    static const struct { CUdevice_attribute a; int want; } attrs[] = {
        {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, 0},
        {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0},
    };
    for (size_t i = 0; i < sizeof attrs / sizeof attrs[0]; i++) {
        CHECK_EQ(p_cuDeviceGetAttribute(&v, attrs[i].a, 0), CUDA_SUCCESS);
        CHECK_EQ(v, attrs[i].want);
    }
    const char *s = NULL;
    CHECK_EQ(p_cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s), CUDA_SUCCESS);
    CHECK(s && !strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY"), "error name %s", s ? s : "(null)");
    CHECK_EQ(p_cuGetErrorString(CUDA_ERROR_INVALID_VALUE, &s), CUDA_SUCCESS);
    CHECK_EQ(p_cuGetErrorName((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);

    CUcontext ctx = setup_ctx(0), c = NULL;
    CUdevice d = -1;
    CHECK_EQ(p_cuCtxGetCurrent(&c), CUDA_SUCCESS);
    CHECK(c == ctx, "current context");
    CHECK_EQ(p_cuCtxGetDevice(&d), CUDA_SUCCESS);
    CHECK_EQ(d, 0);
    CHECK_EQ(p_cuCtxPushCurrent(ctx), CUDA_SUCCESS);
    CHECK_EQ(p_cuCtxPopCurrent(&c), CUDA_SUCCESS);
    CHECK(c == ctx, "popped context");
    CHECK_EQ(p_cuCtxSynchronize(), CUDA_SUCCESS);
    pthread_t t;
    pthread_create(&t, NULL, thread_ctx, NULL);
    pthread_join(t, NULL);
}

static void test_granularity_and_reserve(void)
{
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    size_t g = 0;
    CHECK_EQ(p_cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
    CHECK_EQ(g, GRAN);
    CHECK_EQ(p_cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), CUDA_SUCCESS);
    CHECK_EQ(g, GRAN);

    static const size_t aligns[] = {0, 4096, GRAN, 64 * MiB, (size_t)1 << 30, (size_t)1 << 40};
    size_t n_aligns = sizeof aligns / sizeof aligns[0];
#ifdef __SANITIZE_THREAD__
    n_aligns--;
    printf("skip: a 1 TiB-aligned reservation (ThreadSanitizer's memory layout has no room for one)\n");
#endif
    for (size_t i = 0; i < n_aligns; i++) {
        CUdeviceptr va = 0;
        size_t want = aligns[i] > GRAN ? aligns[i] : GRAN;
        CHECK_EQ(p_cuMemAddressReserve(&va, 3 * GRAN, aligns[i], 0, 0), CUDA_SUCCESS);
        CHECK(va && va % want == 0, "alignment %zu: got %#llx", aligns[i], (unsigned long long)va);
        CHECK_EQ(p_cuMemAddressFree(va, 3 * GRAN), CUDA_SUCCESS);
    }
    CUdeviceptr va = 0;
    CHECK_EQ(p_cuMemAddressReserve(&va, 3 * GRAN, 3 * MiB, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemAddressReserve(&va, GRAN + 4096, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemAddressReserve(&va, 2 * GRAN, 0, 0, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAddressFree(va, GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(counters().reservations_live, 1);
    CHECK_EQ(p_cuMemAddressFree(va, 2 * GRAN), CUDA_SUCCESS);
    CHECK_EQ(counters().reservations_live, 0);
}

static CUdeviceptr fault_va;
static void child_touch_unmapped_access(void)
{
    signal(SIGSEGV, SIG_DFL); /* a sanitizer's handler would turn the fault into an exit */
    volatile unsigned char *p = (volatile unsigned char *)(uintptr_t)fault_va;
    (void)p[0];
}

static void test_map_access(void)
{
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h = 0, h2 = 0;
    CUdeviceptr va = 0, base = 0;
    size_t size = 2 * GRAN, rs = 0;
    CHECK_EQ(p_cuMemCreate(&h, GRAN + 1, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemCreate(&h, size, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAddressReserve(&va, 2 * size, 0, 0, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemMap(va + 2 * size, size, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* outside */
    CHECK_EQ(p_cuMemMap(va, size, 0, h, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemMap(va, size, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* already mapped */
    struct fakecuda_counters c = counters();
    CHECK_EQ(c.handles_live, 1);
    CHECK_EQ(c.mappings_live, 1);
    CHECK_EQ(c.phys_bytes_live, size);

    fault_va = va;
    CHECK_EQ(in_child(NULL, child_touch_unmapped_access), 128 + SIGSEGV);

    CUmemAccessDesc acc = access_for(0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CHECK_EQ(p_cuMemSetAccess(va + size, size, &acc, 1), CUDA_ERROR_INVALID_VALUE); /* not mapped */
    CHECK_EQ(p_cuMemSetAccess(va, size, &acc, 1), CUDA_SUCCESS);
    unsigned char *p = (unsigned char *)(uintptr_t)va;
    for (size_t i = 0; i < size; i++) p[i] = (unsigned char)(i * 3);
    unsigned char back[4096];
    CHECK_EQ(p_cuMemcpyDtoH(back, va + size - sizeof back, sizeof back), CUDA_SUCCESS);
    CHECK(back[17] == (unsigned char)((size - sizeof back + 17) * 3), "read back");
    CHECK_EQ(p_cuMemsetD8(va + 5, 0xab, 3), CUDA_SUCCESS);
    CHECK(p[4] == 12 && p[5] == 0xab && p[7] == 0xab && p[8] == 24, "memset D8");
    CHECK_EQ(p_cuMemsetD32(va + 64, 0xdeadbeef, 2), CUDA_SUCCESS);
    CHECK(((unsigned *)p)[16] == 0xdeadbeef && ((unsigned *)p)[17] == 0xdeadbeef, "memset D32");
    CHECK_EQ(p_cuMemsetD32(va + 2, 1, 2), CUDA_ERROR_INVALID_VALUE);

    CHECK_EQ(p_cuMemGetAddressRange(&base, &rs, va + 12345), CUDA_SUCCESS);
    CHECK(base == va && rs == size, "address range of a mapping");
    CHECK_EQ(p_cuMemGetAddressRange(&base, &rs, va + size + 1), CUDA_ERROR_NOT_FOUND);
    unsigned int mt = 0;
    int ord = -1;
    CUdeviceptr start = 0;
    size_t psz = 0;
    CHECK_EQ(p_cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va + 1), CUDA_SUCCESS);
    CHECK_EQ(mt, CU_MEMORYTYPE_DEVICE);
    CHECK_EQ(p_cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va + 1), CUDA_SUCCESS);
    CHECK_EQ(ord, 0);
    CHECK_EQ(p_cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, va + 100), CUDA_SUCCESS);
    CHECK(start == va, "range start");
    CHECK_EQ(p_cuPointerGetAttribute(&psz, CU_POINTER_ATTRIBUTE_RANGE_SIZE, va + 100), CUDA_SUCCESS);
    CHECK_EQ(psz, size);
    int local;
    CHECK_EQ(p_cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)&local),
             CUDA_ERROR_INVALID_VALUE);
    CUipcMemHandle ipc;
    CHECK_EQ(p_cuIpcGetMemHandle(&ipc, va), CUDA_ERROR_INVALID_VALUE);

    /* Retain adds a reference; release while mapped keeps memory and budget. */
    CHECK_EQ(p_cuMemRetainAllocationHandle(&h2, (void *)(uintptr_t)(va + 100)), CUDA_SUCCESS);
    CHECK(h2 == h, "retained handle");
    CHECK_EQ(p_cuMemRelease(h2), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemRelease(h), CUDA_SUCCESS);
    c = counters();
    CHECK_EQ(c.handles_live, 1);
    CHECK_EQ(c.phys_bytes_live, size);
    CHECK(p[1000] == (unsigned char)3000, "memory survives release while mapped");
    CHECK_EQ(p_cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemAddressFree(va, 2 * size), CUDA_ERROR_INVALID_VALUE); /* still mapped */
    CHECK_EQ(p_cuMemUnmap(va, size), CUDA_SUCCESS);
    c = counters();
    CHECK_EQ(c.handles_live, 0);
    CHECK_EQ(c.mappings_live, 0);
    CHECK_EQ(c.phys_bytes_live, 0);
    CHECK_EQ(p_cuMemUnmap(va, size), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemAddressFree(va, 2 * size), CUDA_SUCCESS);
}

static void test_oom_and_handles(void)
{
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h1, h2, h3;
    CUdeviceptr d;
    size_t free_b = 0, total = 0;
    fc_set_budget(8 * MiB);
    CHECK_EQ(p_cuMemCreate(&h1, 4 * MiB, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemCreate(&h2, 4 * MiB, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemCreate(&h3, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(p_cuMemAlloc(&d, 256), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(p_cuMemGetInfo(&free_b, &total), CUDA_SUCCESS);
    CHECK_EQ(free_b, 0);
    CHECK_EQ(total, 8 * MiB);
    CHECK_EQ(p_cuMemRelease(h2), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemCreate(&h3, GRAN, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemGetInfo(&free_b, &total), CUDA_SUCCESS);
    CHECK_EQ(free_b, 2 * MiB);
    CHECK_EQ(p_cuMemRelease(h1), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemRelease(h3), CUDA_SUCCESS);
    fc_set_budget(8ULL << 30);

    /* Handle types: fabric is never permitted; export needs the type requested at create. */
    CUmemAllocationProp fab = prop_for(0, CU_MEM_HANDLE_TYPE_FABRIC);
    CHECK_EQ(p_cuMemCreate(&h1, GRAN, &fab, 0), CUDA_ERROR_NOT_PERMITTED);
    CUmemAllocationProp none = prop_for(0, CU_MEM_HANDLE_TYPE_NONE);
    int fd = -1;
    CHECK_EQ(p_cuMemCreate(&h1, GRAN, &none, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemExportToShareableHandle(&fd, h1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemRelease(h1), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemCreate(&h1, GRAN, &prop, 0), CUDA_SUCCESS);
    char fabric_handle[64];
    CHECK_EQ(p_cuMemExportToShareableHandle(fabric_handle, h1, CU_MEM_HANDLE_TYPE_FABRIC, 0),
             CUDA_ERROR_NOT_PERMITTED);
    CHECK_EQ(p_cuMemExportToShareableHandle(&fd, h1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
    CHECK(fd >= 0 && (fcntl(fd, F_GETFD) & FD_CLOEXEC), "exported fd is close-on-exec");
    /* An import in the same process is a new handle over the same memory. */
    CHECK_EQ(p_cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             CUDA_SUCCESS);
    close(fd);
    struct fakecuda_counters c = counters();
    CHECK_EQ(c.imports_live, 1);
    CHECK_EQ(c.handles_live, 2);
    CHECK_EQ(c.phys_bytes_live, GRAN); /* imports are not charged again */
    CHECK_EQ(p_cuMemImportFromShareableHandle(&h3, (void *)(intptr_t)0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemRelease(h1), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemRelease(h2), CUDA_SUCCESS);
    c = counters();
    CHECK_EQ(c.imports_live, 0);
    CHECK_EQ(c.handles_live, 0);
}

static void test_fault_injection(void)
{
    CUmemAllocationProp prop = prop_for(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h;
    CUdeviceptr d;
    CUstream s;
    unsigned long long inj = counters().failures_injected;
    CHECK_EQ(fc_fail_next("cuMemCreate", 2, 0), 0);
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(p_cuMemCreate(&h, GRAN, &prop, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemRelease(h), CUDA_SUCCESS);
    CHECK_EQ(fc_fail_next("cuStreamCreate", 1, 0), 0);
    CHECK_EQ(p_cuStreamCreate(&s, 0), CUDA_ERROR_UNKNOWN);
    CHECK_EQ(fc_fail_next("cuMemAllocAsync_ptsz", 1, CUDA_ERROR_INVALID_VALUE), 0); /* suffix ignored */
    CHECK_EQ(p_cuMemAllocAsync(&d, 4096, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(fc_fail_next("cuMemAlloc", 3, 0), 0);
    CHECK_EQ(fc_fail_next("cuMemAlloc", 0, 0), 0); /* disarms */
    CHECK_EQ(p_cuMemAlloc(&d, 4096), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFree(d), CUDA_SUCCESS);
    CHECK_EQ(fc_fail_next("cuNoSuchFunction", 1, 0), -1);
    CHECK_EQ(counters().failures_injected - inj, 4);
}

static void test_get_proc_address(void)
{
    void *fn = (void *)1;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CHECK_EQ(p_cuGetProcAddress("cuMemAlloc", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st), CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemAlloc_v2") && st == CU_GET_PROC_ADDRESS_SUCCESS, "cuMemAlloc -> _v2");
    CHECK_EQ(p_cuGetProcAddress("cuMemCreate", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st), CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemCreate"), "cuMemCreate");
    CHECK_EQ(p_cuGetProcAddress("cuNoSuchFunction", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st), CUDA_SUCCESS);
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, "unknown symbol");
    fn = (void *)1;
    CHECK_EQ(p_cuGetProcAddress("cuMemAllocAsync", &fn, 11000, CU_GET_PROC_ADDRESS_DEFAULT, &st), CUDA_SUCCESS);
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, "version too low");
    CHECK_EQ(p_cuGetProcAddress("cuMemAllocAsync", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st), CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemAllocAsync"), "default stream variant");
    CHECK_EQ(p_cuGetProcAddress("cuMemAllocAsync", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st),
             CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemAllocAsync_ptsz"), "per-thread variant");
    CHECK_EQ(p_cuGetProcAddress("cuStreamSynchronize", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st),
             CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuStreamSynchronize_ptsz"), "per-thread variant");
    CHECK_EQ(p_cuGetProcAddress("cuMemcpyHtoD", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st),
             CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemcpyHtoD_v2_ptds"), "per-thread variant of a copy");
    CHECK_EQ(p_cuGetProcAddress("cuGetProcAddress", &fn, 13000, 0, &st), CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuGetProcAddress_v2"), "cuGetProcAddress itself");

    /* The first ABI: no status, a miss is CUDA_ERROR_NOT_FOUND. */
    CUresult (*gpa1)(const char *, void **, int, cuuint64_t);
    void *g = sym("cuGetProcAddress");
    memcpy(&gpa1, &g, sizeof g);
    CHECK_EQ(gpa1("cuMemFree", &fn, 12000, 0), CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemFree_v2"), "v1 lookup");
    CHECK_EQ(gpa1("cuNoSuchFunction", &fn, 12000, 0), CUDA_ERROR_NOT_FOUND);

    /* Asking for a pre-3.2 version hands out the 32-bit entry point, which counts as a bug. */
    unsigned long long legacy = counters().calls_legacy_abi;
    CHECK_EQ(p_cuGetProcAddress("cuMemAlloc", &fn, 3000, 0, &st), CUDA_SUCCESS);
    CHECK(fn == dlsym(lib, "cuMemAlloc"), "legacy entry");
    CUresult (*alloc_v1)(unsigned int *, unsigned int);
    memcpy(&alloc_v1, &fn, sizeof fn);
    unsigned int d32;
    fprintf(stderr, "(an expected fakecuda legacy warning follows)\n");
    CHECK_EQ(alloc_v1(&d32, 16), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ(counters().calls_legacy_abi - legacy, 1);
}

static void test_streams_events(void)
{
    CUstream s;
    CUevent e;
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    CUgraph graph = NULL;
    CHECK_EQ(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventCreate(&e, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventQuery(e), CUDA_SUCCESS); /* never recorded */

    /* Without a delay, work completes at once. */
    CHECK_EQ(p_cuEventRecord(e, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventQuery(e), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamQuery(s), CUDA_SUCCESS);

    fc_set_delay(200000);
    double t0 = now_s();
    CHECK_EQ(p_cuEventRecord(e, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventQuery(e), CUDA_ERROR_NOT_READY);
    CHECK_EQ(p_cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    CHECK_EQ(p_cuStreamQuery(NULL), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventSynchronize(e), CUDA_SUCCESS);
    CHECK(now_s() - t0 >= 0.19, "cuEventSynchronize returned after %.3f s", now_s() - t0);
    CHECK_EQ(p_cuEventQuery(e), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamQuery(s), CUDA_SUCCESS);

    t0 = now_s();
    CHECK_EQ(p_cuEventRecord(e, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamWaitEvent(CU_STREAM_LEGACY, e, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamQuery(CU_STREAM_LEGACY), CUDA_ERROR_NOT_READY);
    CHECK_EQ(p_cuStreamSynchronize(CU_STREAM_LEGACY), CUDA_SUCCESS);
    CHECK(now_s() - t0 >= 0.19, "cuStreamSynchronize returned after %.3f s", now_s() - t0);

    t0 = now_s();
    CHECK_EQ(p_cuEventRecord(e, CU_STREAM_PER_THREAD), CUDA_SUCCESS);
    CHECK_EQ(p_cuCtxSynchronize(), CUDA_SUCCESS);
    CHECK(now_s() - t0 >= 0.19, "cuCtxSynchronize returned after %.3f s", now_s() - t0);
    CHECK_EQ(p_cuEventQuery(e), CUDA_SUCCESS);
    fc_set_delay(0);

    CHECK_EQ(p_cuStreamIsCapturing(s, &cs), CUDA_SUCCESS);
    CHECK_EQ(cs, CU_STREAM_CAPTURE_STATUS_NONE);
    CHECK_EQ(p_cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamIsCapturing(s, &cs), CUDA_SUCCESS);
    CHECK_EQ(cs, CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CHECK_EQ(p_cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamIsCapturing(s, &cs), CUDA_SUCCESS);
    CHECK_EQ(cs, CU_STREAM_CAPTURE_STATUS_NONE);
    CHECK_EQ(p_cuStreamEndCapture(s, &graph), CUDA_ERROR_ILLEGAL_STATE);
    CHECK_EQ(p_cuStreamBeginCapture(NULL, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK_EQ(p_cuStreamIsCapturing(NULL, &cs), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamIsCapturing(CU_STREAM_PER_THREAD, &cs), CUDA_SUCCESS);

    CHECK_EQ(p_cuEventDestroy(e), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamDestroy(s), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
}

/* Pinned host memory, and copies that take time (FAKECUDA_COPY_DELAY_US): what
 * vmm_import_copy's pipeline is tested against. */
static void test_host_memory_and_copy_delay(void)
{
    void *p = NULL, *q = NULL, *fn = NULL;
    unsigned long long live = counters().host_allocs_live;
    CHECK_EQ(p_cuMemAllocHost(&p, 5000), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemHostAlloc(&q, MiB, CU_MEMHOSTALLOC_PORTABLE), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemHostAlloc(&q, MiB, 0x80), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemAllocHost(&p, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(counters().host_allocs_live - live, 2);
    if (p && q) {
        memset(p, 1, 5000);
        memset(q, 2, MiB);
    }
    CHECK_EQ(p_cuMemFreeHost((char *)p + 4096), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemFreeHost(p), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFreeHost(p), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemFreeHost(q), CUDA_SUCCESS);
    CHECK_EQ(counters().host_allocs_live, live);
    CUdriverProcAddressQueryResult st;
    CHECK(p_cuGetProcAddress("cuMemHostAlloc", &fn, 13000, 0, &st) == CUDA_SUCCESS && fn, "cuMemHostAlloc by name");
    CHECK(p_cuGetProcAddress("cuMemFreeHost", &fn, 13000, 0, &st) == CUDA_SUCCESS && fn, "cuMemFreeHost by name");

    /* the program's own memory page-locked: an overlap, a stray or a second unregister refused */
    static char own[3 * 4096] __attribute__((aligned(4096)));
    unsigned long long reg = counters().host_registered_live;
    CHECK_EQ(p_cuMemHostRegister(own, 2 * 4096, CU_MEMHOSTREGISTER_PORTABLE), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemHostRegister(own + 4096, 2 * 4096, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CHECK_EQ(p_cuMemHostRegister(own + 2 * 4096, 4096, 0), CUDA_SUCCESS);
    CHECK_EQ(counters().host_registered_live - reg, 2);
    CHECK_EQ(p_cuMemHostUnregister(own + 4096), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    CHECK_EQ(p_cuMemHostUnregister(own), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemHostUnregister(own), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    CHECK_EQ(p_cuMemHostUnregister(own + 2 * 4096), CUDA_SUCCESS);
    CHECK_EQ(counters().host_registered_live, reg);
    CHECK(p_cuGetProcAddress("cuMemHostRegister", &fn, 13000, 0, &st) == CUDA_SUCCESS && fn, "cuMemHostRegister by name");

    /* An asynchronous copy returns at once; an event recorded after it completes only when it
     * does, and a second copy queued behind it takes as long again. */
    char src[256], dst[256];
    memset(src, 7, sizeof src);
    CUstream s;
    CUevent e;
    CHECK_EQ(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
    unsigned long long calls = counters().calls_cuMemcpyDtoHAsync;
    fc_set_copy_delay(100000);
    double t0 = now_s();
    CHECK_EQ(p_cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, sizeof dst, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, sizeof dst, s), CUDA_SUCCESS);
    CHECK(now_s() - t0 < 0.09, "cuMemcpyDtoHAsync waited %.3f s", now_s() - t0);
    CHECK_EQ(p_cuEventRecord(e, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventQuery(e), CUDA_ERROR_NOT_READY);
    CHECK_EQ(p_cuEventSynchronize(e), CUDA_SUCCESS);
    CHECK(now_s() - t0 >= 0.19 && dst[0] == 7, "two queued copies were done after %.3f s", now_s() - t0);
    CHECK_EQ(counters().calls_cuMemcpyDtoHAsync - calls, 2);
    t0 = now_s();
    CHECK_EQ(p_cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, sizeof dst), CUDA_SUCCESS);
    CHECK(now_s() - t0 >= 0.09, "a synchronous copy returned after %.3f s", now_s() - t0);
    fc_set_copy_delay(0);
    t0 = now_s();
    CHECK_EQ(p_cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, sizeof dst, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventRecord(e, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuEventSynchronize(e), CUDA_SUCCESS);
    CHECK(now_s() - t0 < 0.09, "without a delay a copy took %.3f s", now_s() - t0);
    CHECK_EQ(p_cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, sizeof dst, (CUstream)(uintptr_t)0x1234),
             CUDA_ERROR_INVALID_HANDLE);
    CHECK_EQ(p_cuEventDestroy(e), CUDA_SUCCESS);
    CHECK_EQ(p_cuStreamDestroy(s), CUDA_SUCCESS);
}

static void test_memalloc(void)
{
    CUdeviceptr d = 0, d2 = 0, base = 0;
    size_t sz = 0;
    unsigned long long live = counters().memalloc_live;
    CHECK_EQ(p_cuMemAlloc(&d, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemFree(0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAlloc(&d, 1000), CUDA_SUCCESS);
    CHECK(d && d % 256 == 0, "alignment");
    CHECK_EQ(p_cuMemAlloc(&d2, 5 * MiB), CUDA_SUCCESS);
    CHECK(d2 && d2 % GRAN == 0, "large allocation alignment");
    CHECK_EQ(counters().memalloc_live - live, 2);
    char msg[] = "hello, device";
    char back[sizeof msg] = "";
    CHECK_EQ(p_cuMemcpyHtoD(d, msg, sizeof msg), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemcpyDtoD(d2 + 100, d, sizeof msg), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemcpyDtoH(back, d2 + 100, sizeof msg), CUDA_SUCCESS);
    CHECK(!strcmp(back, msg), "copies");
    CHECK_EQ(p_cuMemGetAddressRange(&base, &sz, d + 999), CUDA_SUCCESS);
    CHECK(base == d && sz == 1000, "address range of a cuMemAlloc block");
    CHECK_EQ(p_cuMemGetAddressRange(&base, &sz, d + 1000), CUDA_ERROR_NOT_FOUND);
    int ipc_ok = 0;
    CHECK_EQ(p_cuPointerGetAttribute(&ipc_ok, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, d), CUDA_SUCCESS);
    CHECK_EQ(ipc_ok, 1);
    CUipcMemHandle ipc;
    CHECK_EQ(p_cuIpcGetMemHandle(&ipc, d), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFree(d + 256), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemFree(d), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFree(d), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(p_cuMemFree(d2), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFree((CUdeviceptr)(uintptr_t)&ipc), CUDA_ERROR_INVALID_VALUE);

    unsigned long long a0 = counters().calls_cuMemAllocAsync, f0 = counters().calls_cuMemFreeAsync;
    CUstream s;
    CHECK_EQ(p_cuStreamCreate(&s, 0), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAllocAsync(&d, 4096, s), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemFreeAsync(d, s), CUDA_SUCCESS);
    CUresult (*alloc_ptsz)(CUdeviceptr *, size_t, CUstream);
    CUresult (*free_ptsz)(CUdeviceptr, CUstream);
    void *a = sym("cuMemAllocAsync_ptsz"), *f = sym("cuMemFreeAsync_ptsz");
    memcpy(&alloc_ptsz, &a, sizeof a);
    memcpy(&free_ptsz, &f, sizeof f);
    CHECK_EQ(alloc_ptsz(&d, 4096, NULL), CUDA_SUCCESS);
    CHECK_EQ(free_ptsz(d, NULL), CUDA_SUCCESS);
    CHECK_EQ(p_cuMemAllocAsync(&d, 4096, (CUstream)(uintptr_t)0x1234), CUDA_ERROR_INVALID_HANDLE);
    CHECK_EQ(counters().calls_cuMemAllocAsync - a0, 3);
    CHECK_EQ(counters().calls_cuMemFreeAsync - f0, 2);
    CHECK_EQ(p_cuStreamDestroy(s), CUDA_SUCCESS);
    CHECK_EQ(counters().memalloc_live, live);
}

/* Parent exports, a separate exec'd process imports; both see the same bytes, and the memory
 * outlives the exporter's release while the importer still holds it. */
static void test_cross_process(void)
{
    const size_t size = 2 * GRAN;
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CHECK_EQ(make_mapping(size, &h, &va), 0);
    unsigned char *p = (unsigned char *)(uintptr_t)va;
    for (size_t i = 0; i < size; i++) p[i] = (unsigned char)(i * 7 + 1);
    int fd = -1;
    unsigned long long exports = counters().exports;
    CHECK_EQ(p_cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
    CHECK_EQ(counters().exports - exports, 1);

    const char *b = getenv("VMMSHIM_TEST_BUILD");
    char prog[1024];
    snprintf(prog, sizeof prog, "%s/tests/prog_fakecuda_import", b && *b ? b : "build");
    int ready[2], go[2];
    CHECK(pipe(ready) == 0 && pipe(go) == 0, "pipe");
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        fcntl(fd, F_SETFD, 0); /* inherited across exec */
        close(ready[0]);
        close(go[1]);
        char a1[16], a2[32], a3[16], a4[16];
        snprintf(a1, sizeof a1, "%d", fd);
        snprintf(a2, sizeof a2, "%zu", size);
        snprintf(a3, sizeof a3, "%d", ready[1]);
        snprintf(a4, sizeof a4, "%d", go[0]);
        execl(prog, prog, a1, a2, a3, a4, (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", prog, strerror(errno));
        _exit(127);
    }
    close(ready[1]);
    close(go[0]);
    char c = 0;
    CHECK(read(ready[0], &c, 1) == 1 && c == '1', "importer did not report");
    int same = 1;
    for (size_t i = 0; i < size; i++)
        if (p[i] != (unsigned char)(i * 13 + 5)) { same = 0; break; }
    CHECK(same, "pattern B written by the importer is not visible to the exporter");

    /* Drop everything on this side, then let the importer check the memory survived. */
    drop_mapping(size, h, va);
    close(fd);
    struct fakecuda_counters k = counters();
    CHECK_EQ(k.handles_live, 0);
    CHECK_EQ(k.phys_bytes_live, 0);
    CHECK(write(go[1], "g", 1) == 1, "go pipe");
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "importer status %#x", st);
    close(ready[0]);
    close(go[1]);
}

/* An exported fd keeps its memory after the handle's release: fds_open counts it until closed. */
static void test_stray_fds(void)
{
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CHECK_EQ(make_mapping(GRAN, &h, &va), 0);
    int fd = -1;
    CHECK_EQ(p_cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_SUCCESS);
    CHECK_EQ(counters().fds_open, 0); /* the memory of a live handle */
    drop_mapping(GRAN, h, va);
    CHECK_EQ(counters().fds_open, 1);
    close(fd);
    CHECK_EQ(counters().fds_open, 0);
}

int main(void)
{
    /* Knobs read at load: each child sets its environment, then loads the driver itself. */
    const char *fail_env[] = {"FAKECUDA_FAIL=cuInit:1:CUDA_ERROR_NO_DEVICE,cuMemAlloc_v2:2,cuMemCreate:1:201,"
                              "cuStreamQuery:x,cuNoSuchFunction:1",
                              NULL};
    const char *novmm_env[] = {"FAKECUDA_NO_VMM=1", NULL};
    const char *nodev_env[] = {"FAKECUDA_DEVICES=0", NULL};
    const char *threedev_env[] = {"FAKECUDA_DEVICES=3", NULL};
    const char *twodev_env[] = {"FAKECUDA_DEVICES=2", NULL};
    const char *budget_env[] = {"FAKECUDA_MEM_BYTES=6M", NULL};
    const char *delay_env[] = {"FAKECUDA_EVENT_DELAY_US=100000", NULL};
    const char *copy_delay_env[] = {"FAKECUDA_COPY_DELAY_US=100000", NULL};
    fprintf(stderr, "(expected fakecuda FAKECUDA_FAIL warnings follow)\n");
    CHECK_EQ(in_child(fail_env, child_fail_env), 0);
    CHECK_EQ(in_child(novmm_env, child_no_vmm), 0);
    CHECK_EQ(in_child(nodev_env, child_no_devices), 0);
    CHECK_EQ(in_child(threedev_env, child_three_devices), 0);
    CHECK_EQ(in_child(twodev_env, child_mem_pools), 0);
    CHECK_EQ(in_child(budget_env, child_budget), 0);
    CHECK_EQ(in_child(delay_env, child_delay_env), 0);
    CHECK_EQ(in_child(copy_delay_env, child_copy_delay_env), 0);

    char dir[] = "/tmp/fakecuda-test-XXXXXX", envbuf[200];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(envbuf, sizeof envbuf, "FAKECUDA_COUNTERS_AT_EXIT=%s/counters.%%p", dir);
    const char *counters_env[] = {envbuf, NULL};
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        putenv((char *)counters_env[0]);
        child_counters_at_exit();
        _exit(1);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "counters child status %#x", st);
    char path[300], text[4096] = "";
    snprintf(path, sizeof path, "%s/counters.%ld", dir, (long)pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "no counters file %s", path);
    if (f) {
        size_t n = fread(text, 1, sizeof text - 1, f);
        text[n] = 0;
        fclose(f);
        unlink(path);
    }
    CHECK(strstr(text, "handles_created=1\n") && strstr(text, "handles_live=1\n") &&
              strstr(text, "phys_bytes_live=2097152\n") && strstr(text, "failures_injected=0\n"),
          "counters file:\n%s", text);

    /* a failure at a position, per calling object, and the calls each object made */
    char fail_at[] = "FAKECUDA_FAIL=cuMemAlloc@2,cuStreamQuery/test_fakecuda@3:2:NOT_READY,"
                     "cuCtxSynchronize/other.so@1,cuMemFree/@1";
    snprintf(envbuf, sizeof envbuf, "FAKECUDA_CALLS_AT_EXIT=%s/calls.%%p", dir);
    const char *at_env[] = {fail_at, envbuf, NULL};
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid == 0) {
        for (int i = 0; at_env[i]; i++) putenv((char *)at_env[i]);
        int before = check__failed;
        child_fail_at();
        fflush(stderr);
        exit(check__failed != before); /* exit, not _exit: the calls are written at exit */
    }
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fail-at child status %#x", st);
    snprintf(path, sizeof path, "%s/calls.%ld", dir, (long)pid);
    text[0] = 0;
    if ((f = fopen(path, "r"))) {
        size_t n = fread(text, 1, sizeof text - 1, f);
        text[n] = 0;
        fclose(f);
        unlink(path);
    }
    CHECK(strstr(text, "cuMemAlloc test_fakecuda 3\n") && strstr(text, "cuStreamQuery test_fakecuda 5\n") &&
              strstr(text, "cuMemFree test_fakecuda 2\n"),
          "calls file:\n%s", text);
    rmdir(dir);

    if (open_driver() != 0) CHECK_DONE();
    test_basics();
    test_granularity_and_reserve();
    test_map_access();
    test_oom_and_handles();
    test_fault_injection();
    test_get_proc_address();
    test_streams_events();
    test_host_memory_and_copy_delay();
    test_memalloc();
    test_cross_process();
    test_stray_fds();
    struct fakecuda_counters c = counters();
    CHECK_EQ(c.handles_live, 0);
    CHECK_EQ(c.mappings_live, 0);
    CHECK_EQ(c.reservations_live, 0);
    CHECK_EQ(c.phys_bytes_live, 0);
    CHECK_EQ(c.memalloc_live, 0);
    CHECK_EQ(c.host_allocs_live, 0);
    CHECK_DONE();
}
