/* Every allocation path the shim backs, in one short run for the fault sweep (test_faults):
 * cudaMalloc of a packed, a split and a whole-chunk size, cudaMallocAsync on two streams,
 * driver-API cuMemAlloc, memory mapped with cuMemCreate + cuMemMap (its handle released once
 * mapped), and with two devices peer
 * access enabled and disabled around allocations on the peer; then sync and stream-ordered
 * frees, reuse on the same and on another stream behind an event, and everything freed.
 * It makes the same calls whatever fails, and prints one line per call with its result, never a
 * pointer, so runs compare line by line natively and under the shim.
 *
 * Three times it stops at a "checkpoint <name> <pid> <address>:<size>:<sum>..." line listing its
 * live allocations (the checksum of their bytes, 0 when unknown) and waits for a line on stdin (end
 * of input goes on at once), so a test can look at the registry and import them meanwhile. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MiB (1u << 20)

typedef struct buf {
    const char *name;
    void *p;
    size_t size;
    unsigned long long sum; /* sum_of its bytes; 0: unknown */
    int no_access; /* mapped, but cuMemSetAccess failed: touching it would fault */
} buf;

static void show(const char *what, const char *name, cudaError_t e)
{
    char line[96];
    snprintf(line, sizeof line, "%s %s", what, name);
    printf("%-52s %s\n", line, cudaGetErrorName(e));
}

static void dshow(const char *what, CUresult r)
{
    const char *s = NULL;
    printf("%-52s %s\n", what, cuGetErrorName(r, &s) == CUDA_SUCCESS && s ? s : "unknown CUresult");
}

/* FNV-1a over 64-bit words: every byte counts, at a fraction of a bytewise pass (sizes here are
 * multiples of 8).  prog_fault_companion computes the same. */
static unsigned long long sum_of(const unsigned long long *w, size_t bytes)
{
    unsigned long long f = 0xcbf29ce484222325ull;
    for (size_t k = 0; k < bytes / 8; k++) f = (f ^ w[k]) * 0x100000001b3ull;
    return f;
}

/* Fill with words of the buffer's own pattern; the checksum is what a companion must read. */
static void fill(buf *b, int seed)
{
    if (b->no_access) {
        show("cudaMemcpy pattern into", b->name, cudaSuccess);
        printf("%-52s %s\n", "  skipped: no access", "");
        return;
    }
    unsigned long long *h = malloc(b->size);
    for (size_t k = 0; k < b->size / 8; k++) h[k] = (k + 1) * 0x9e3779b97f4a7c15ull + (unsigned long long)seed;
    b->sum = sum_of(h, b->size);
    cudaError_t e = cudaMemcpy(b->p, h, b->size, cudaMemcpyHostToDevice);
    show("cudaMemcpy pattern into", b->name, e);
    if (e != cudaSuccess) b->sum = 0;
    free(h);
}

static void intact(buf *b)
{
    if (b->no_access) return;
    unsigned long long *h = malloc(b->size);
    cudaError_t e = cudaMemcpy(h, b->p, b->size, cudaMemcpyDeviceToHost);
    show("cudaMemcpy back from", b->name, e);
    if (e == cudaSuccess && b->sum) printf("%-52s %s\n", "  bytes intact", sum_of(h, b->size) == b->sum ? "yes" : "NO");
    free(h);
}

static void checkpoint(const char *name, buf *const *live, int n)
{
    printf("checkpoint %s %d", name, (int)getpid());
    for (int i = 0; i < n; i++)
        if (live[i]->p) printf(" 0x%llx:%zu:%llx", (unsigned long long)(uintptr_t)live[i]->p, live[i]->size, live[i]->sum);
    printf("\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return;
}

static void sync_alloc(buf *b, const char *name, size_t size)
{
    b->name = name;
    b->size = size;
    b->p = NULL;
    show("cudaMalloc", name, cudaMalloc(&b->p, size));
}

static void async_alloc(buf *b, const char *name, size_t size, cudaStream_t s)
{
    b->name = name;
    b->size = size;
    b->p = NULL;
    show("cudaMallocAsync", name, cudaMallocAsync(&b->p, size, s));
}

/* The program's own VMM memory, as PyTorch's expandable segments make it: the handle released
 * once mapped (the usual idiom), so only the mapping holds the memory. */
typedef struct own {
    CUdeviceptr va;
    int reserved, mapped;
} own;

static void own_map(own *o, buf *b)
{
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h = 0;
    CUresult r = cuMemCreate(&h, 2 * MiB, &prop, 0);
    dshow("cuMemCreate(2 MiB)", r);
    int made = r == CUDA_SUCCESS;
    r = cuMemAddressReserve(&o->va, 4 * MiB, 0, 0, 0);
    dshow("cuMemAddressReserve(4 MiB)", r);
    o->reserved = r == CUDA_SUCCESS;
    r = made && o->reserved ? cuMemMap(o->va, 2 * MiB, 0, h, 0) : CUDA_ERROR_INVALID_VALUE;
    dshow("cuMemMap", r);
    o->mapped = r == CUDA_SUCCESS;
    CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    r = o->mapped ? cuMemSetAccess(o->va, 2 * MiB, &acc, 1) : CUDA_ERROR_INVALID_VALUE;
    dshow("cuMemSetAccess", r);
    dshow("cuMemRelease once mapped", made ? cuMemRelease(h) : CUDA_ERROR_INVALID_VALUE);
    b->name = "own";
    b->size = 2 * MiB;
    b->p = o->mapped ? (void *)(uintptr_t)o->va : NULL;
    b->no_access = o->mapped && r != CUDA_SUCCESS;
}

static void own_unmap(own *o, buf *b)
{
    CUresult r = o->mapped ? cuMemUnmap(o->va, 2 * MiB) : CUDA_ERROR_INVALID_VALUE;
    dshow("cuMemUnmap", r);
    if (r == CUDA_SUCCESS) b->p = NULL;
    dshow("cuMemAddressFree", o->reserved ? cuMemAddressFree(o->va, 4 * MiB) : CUDA_ERROR_INVALID_VALUE);
}

static void sync_free(buf *b)
{
    cudaError_t e = cudaFree(b->p);
    show("cudaFree", b->name, e);
    if (e == cudaSuccess) b->p = NULL; /* else still the program's, as natively */
}

static void async_free(buf *b, cudaStream_t s, const char *stream)
{
    char what[64];
    snprintf(what, sizeof what, "cudaFreeAsync on %s", stream);
    cudaError_t e = cudaFreeAsync(b->p, s);
    show(what, b->name, e);
    if (e == cudaSuccess) b->p = NULL;
}

enum { SMALL, MEDIUM, LARGE, AS1, AS2, DRV, OWN, AS1B, AS2B, PEER_BEFORE, PEER_AFTER, N_BUFS };

/* Device 1's memory around peer access from device 0: allocated before enabling it, after, and
 * copied from while it is on. */
static void peer(buf *b)
{
    CUcontext c1 = NULL;
    show("cudaSetDevice", "1", cudaSetDevice(1));
    dshow("cuCtxGetCurrent", cuCtxGetCurrent(&c1));
    sync_alloc(&b[PEER_BEFORE], "peer-before", 2 * MiB);
    fill(&b[PEER_BEFORE], 5);
    show("cudaSetDevice", "0", cudaSetDevice(0));
    dshow("cuCtxEnablePeerAccess(device 1)", cuCtxEnablePeerAccess(c1, 0));
    show("cudaSetDevice", "1", cudaSetDevice(1));
    sync_alloc(&b[PEER_AFTER], "peer-after", 1 * MiB);
    show("cudaSetDevice", "0", cudaSetDevice(0));
    show("cudaMemcpy peer-before to", b[SMALL].name,
         cudaMemcpy(b[SMALL].p, b[PEER_BEFORE].p, 4096, cudaMemcpyDeviceToDevice));
    dshow("cuCtxDisablePeerAccess(device 1)", cuCtxDisablePeerAccess(c1));
    show("cudaSetDevice", "1", cudaSetDevice(1));
    sync_free(&b[PEER_BEFORE]);
    sync_free(&b[PEER_AFTER]);
    show("cudaSetDevice", "0", cudaSetDevice(0));
}

int main(void)
{
    int ndev = 0;
    show("cudaGetDeviceCount", "", cudaGetDeviceCount(&ndev));
    printf("%-52s %d\n", "  devices", ndev);
    show("cudaSetDevice", "0", cudaSetDevice(0));
    static buf b[N_BUFS];
    buf *all[N_BUFS];
    for (int i = 0; i < N_BUFS; i++) all[i] = &b[i];
    sync_alloc(&b[SMALL], "small", 4096);
    sync_alloc(&b[MEDIUM], "medium", 3 * MiB);
    sync_alloc(&b[LARGE], "large", 12 * MiB);
    cudaStream_t s1 = NULL, s2 = NULL;
    show("cudaStreamCreate", "s1", cudaStreamCreate(&s1));
    show("cudaStreamCreate", "s2", cudaStreamCreate(&s2));
    async_alloc(&b[AS1], "async-s1", 64 * 1024, s1);
    async_alloc(&b[AS2], "async-s2", 5 * MiB, s2);
    CUdeviceptr d = 0;
    CUresult r = cuMemAlloc(&d, MiB);
    dshow("cuMemAlloc drv", r);
    b[DRV] = (buf){.name = "drv", .p = r == CUDA_SUCCESS ? (void *)(uintptr_t)d : NULL, .size = MiB};
    own o = {0};
    own_map(&o, &b[OWN]);
    for (int i = SMALL; i <= OWN; i++) fill(&b[i], i);
    checkpoint("allocated", all, N_BUFS);

    if (ndev > 1) peer(b);
    else printf("%-52s %s\n", "peer access", "one device");

    sync_free(&b[SMALL]);
    async_free(&b[AS1], s1, "s1");
    async_alloc(&b[AS1B], "async-s1 again", 64 * 1024, s1);
    async_free(&b[AS2], s2, "s2");
    cudaEvent_t ev = NULL;
    show("cudaEventCreate", "", cudaEventCreate(&ev));
    show("cudaEventRecord", "s2", cudaEventRecord(ev, s2));
    async_alloc(&b[AS2B], "async-s2 on s1", 5 * MiB, s1);
    show("cudaEventSynchronize", "", cudaEventSynchronize(ev));
    r = cuMemFree(d);
    dshow("cuMemFree drv", r);
    if (r == CUDA_SUCCESS) b[DRV].p = NULL;
    fill(&b[AS1B], 11);
    fill(&b[AS2B], 12);
    checkpoint("churned", all, N_BUFS);

    intact(&b[MEDIUM]);
    intact(&b[LARGE]);
    intact(&b[OWN]);
    sync_free(&b[MEDIUM]);
    sync_free(&b[LARGE]);
    async_free(&b[AS1B], s1, "s1");
    async_free(&b[AS2B], s1, "s1");
    own_unmap(&o, &b[OWN]);
    show("cudaStreamSynchronize", "s1", cudaStreamSynchronize(s1));
    show("cudaEventDestroy", "", cudaEventDestroy(ev));
    show("cudaStreamDestroy", "s1", cudaStreamDestroy(s1));
    show("cudaStreamDestroy", "s2", cudaStreamDestroy(s2));
    show("cudaDeviceSynchronize", "", cudaDeviceSynchronize());
    checkpoint("freed", all, N_BUFS);
    return 0;
}
