/* Test equipment shared by the import tests: the emulated driver's owner-side entry points,
 * resolved by name (the tests link no CUDA library), and full reads and writes on the pipes
 * between a test and the owner process it forks.  Include after check.h and fakecuda.h. */
#ifndef VMM_TEST_FAKEOWNER_H
#define VMM_TEST_FAKEOWNER_H
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>


static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                           unsigned long long);
    fakecuda_counters_fn counters;
    fakecuda_set_unmap_delay_us_fn set_unmap_delay_us;
} drv;

static bool load_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return false;
    struct {
        const char *n;
        void **p;
    } s[] = {
        {"cuInit", (void **)&drv.Init},
        {"cuDeviceGet", (void **)&drv.DeviceGet},
        {"cuDevicePrimaryCtxRetain", (void **)&drv.DevicePrimaryCtxRetain},
        {"cuCtxSetCurrent", (void **)&drv.CtxSetCurrent},
        {"cuMemCreate", (void **)&drv.MemCreate},
        {"cuMemRelease", (void **)&drv.MemRelease},
        {"cuMemAddressReserve", (void **)&drv.MemAddressReserve},
        {"cuMemAddressFree", (void **)&drv.MemAddressFree},
        {"cuMemMap", (void **)&drv.MemMap},
        {"cuMemUnmap", (void **)&drv.MemUnmap},
        {"cuMemSetAccess", (void **)&drv.MemSetAccess},
        {"cuMemExportToShareableHandle", (void **)&drv.MemExportToShareableHandle},
        {"fakecuda_counters", (void **)&drv.counters},
        {"fakecuda_set_unmap_delay_us", (void **)&drv.set_unmap_delay_us},
    };
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
        void *p = dlsym(h, s[i].n);
        if (!p) return false;
        memcpy(s[i].p, &p, sizeof p);
    }
    return true;
}

/* A fake owner's start: device 0's primary context made current, and the properties and the
 * read-write access of an exportable (POSIX fd) chunk on it.  The driver's error, or success. */
static CUresult owner_driver_start(CUmemAllocationProp *prop, CUmemAccessDesc *acc)
{
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    CUresult r;
    if ((r = drv.Init(0)) || (r = drv.DeviceGet(&dev, 0)) || (r = drv.DevicePrimaryCtxRetain(&ctx, dev)) ||
        (r = drv.CtxSetCurrent(ctx)))
        return r;
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = (int)dev;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    memset(acc, 0, sizeof *acc);
    acc->location = prop->location;
    acc->flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return CUDA_SUCCESS;
}

static struct fakecuda_counters counters(void)
{
    struct fakecuda_counters c;
    drv.counters(&c);
    return c;
}

/* ------------------------------------------------------------------------------------------ */
/* Pipes                                                                                       */

static bool write_full(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        p += n, len -= (size_t)n;
    }
    return true;
}

/* len bytes, each wait for more at most wait_ms (-1: until they come or the writer is gone). */
static bool read_full_within(int fd, void *buf, size_t len, int wait_ms)
{
    char *p = buf;
    while (len) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int ready = poll(&pf, 1, wait_ms);
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) return false;
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        p += n, len -= (size_t)n;
    }
    return true;
}

/* A reply the test waits for: 30 s is a hung peer. */
static bool read_full(int fd, void *buf, size_t len)
{
    return read_full_within(fd, buf, len, 30000);
}

/* A forked owner's next command: the test may run other cases for minutes in between (a TSan
 * build on a busy machine), and its exit closes the pipe, which ends the owner. */
static bool read_command(int fd, void *buf, size_t len)
{
    return read_full_within(fd, buf, len, -1);
}

#endif
