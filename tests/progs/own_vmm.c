/* A program that makes, maps, unmaps and releases its own VMM memory with the driver API, as
 * PyTorch's expandable segments and NCCL do: one page of a handle asking for no shareable type,
 * then two pages of a handle asking for POSIX fds, mapped back to back.  Prints what it observes.
 * With "hold" it also prints "ready <pid> <va> <page> fnv <sum>" after mapping, "released" after
 * releasing the first handle (still mapped) and "unmapped" at the end, each time waiting for a
 * line on stdin, so a companion can look in between.  Byte k of the mapped range is (k*7+3)&0xff. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void say(const char *what, long long v) { printf("%-52s %lld\n", what, v); }

static void stop(int hold, const char *line)
{
    if (!hold) return;
    printf("%s\n", line);
    fflush(stdout);
    char buf[64];
    if (!fgets(buf, sizeof buf, stdin)) exit(3);
}

int main(int argc, char **argv)
{
    int hold = argc > 1 && !strcmp(argv[1], "hold");
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) return 1;
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t page = 0;
    say("cuMemGetAllocationGranularity", cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle h1, h2;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    say("cuMemCreate(1 page, no shareable type)", cuMemCreate(&h1, page, &prop, 0));
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    say("cuMemCreate(2 pages, POSIX fd)", cuMemCreate(&h2, 2 * page, &prop, 0));
    CUmemAllocationProp got;
    memset(&got, 0, sizeof got);
    say("cuMemGetAllocationPropertiesFromHandle(h1)", cuMemGetAllocationPropertiesFromHandle(&got, h1));
    say("  its handle types", got.requestedHandleTypes);
    say("  its type and location (10 x type + location)", got.type * 10 + got.location.type);
    memset(&got, 0, sizeof got);
    say("cuMemGetAllocationPropertiesFromHandle(h2)", cuMemGetAllocationPropertiesFromHandle(&got, h2));
    say("  its handle types", got.requestedHandleTypes);
    int fd = -1;
    CUresult rc = cuMemExportToShareableHandle(&fd, h2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    say("cuMemExportToShareableHandle(h2, POSIX fd)", rc);
    if (fd >= 0) close(fd);

    CUdeviceptr va;
    say("cuMemAddressReserve(4 pages)", cuMemAddressReserve(&va, 4 * page, 0, 0, 0));
    say("cuMemMap(h1 at page 0)", cuMemMap(va, page, 0, h1, 0));
    say("cuMemMap(h2 at pages 1-2)", cuMemMap(va + page, 2 * page, 0, h2, 0));
    CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    say("cuMemSetAccess(3 pages)", cuMemSetAccess(va, 3 * page, &acc, 1));
    size_t len = 3 * page;
    uint8_t *h = malloc(len);
    uint64_t fnv = 0xcbf29ce484222325ull; /* FNV-1a 64, as vmmctl prints it */
    for (size_t k = 0; k < len; k++) {
        h[k] = (uint8_t)(k * 7 + 3);
        fnv = (fnv ^ h[k]) * 1099511628211ull;
    }
    say("cuMemcpyHtoD(3 pages)", cuMemcpyHtoD(va, h, len));
    char line[160];
    snprintf(line, sizeof line, "ready %d 0x%llx %zu fnv %016llx", (int)getpid(), (unsigned long long)va, page,
             (unsigned long long)fnv);
    stop(hold, line);

    say("cuMemRelease(h1) while mapped", cuMemRelease(h1));
    stop(hold, "released");
    memset(h, 0, len);
    say("cuMemcpyDtoH(3 pages) after the release", cuMemcpyDtoH(h, va, len));
    int same = 1;
    for (size_t k = 0; k < len; k++) same &= h[k] == (uint8_t)(k * 7 + 3);
    say("  bytes intact", same);
    say("cuMemUnmap(page 0)", cuMemUnmap(va, page));
    say("cuMemUnmap(pages 1-2)", cuMemUnmap(va + page, 2 * page));
    say("cuMemRelease(h2)", cuMemRelease(h2));
    say("cuMemAddressFree", cuMemAddressFree(va, 4 * page));
    free(h);
    stop(hold, "unmapped");
    return 0;
}
