// Peer access on shim memory (needs two GPUs): a kernel on GPU 1 reads and writes allocations of
// GPU 0 and GPU 0 checks the writes, for four allocations: one made before peer access was
// enabled, one after, and one of each kind that the shim's pool places across two of its
// segments (two cudaMalloc'd neighbours freed, then one request as big as both: a MULTI-HANDLE
// record, so every handle of it must be granted).  Peer copies go both ways.  Prints observations
// only (error names, bad-word counts), so native and shim runs compare line by line; exits 0 when
// every call succeeded and every word was right.  With PEER_PAUSE_DIR set (tests/gpu/peer.sh's
// shim run) it names the allocations in PEER_PAUSE_DIR/allocs and waits for PEER_PAUSE_DIR/go
// before disabling peer access, printing nothing more, so the script can check the registry.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

__global__ void fill(unsigned *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = seed ^ (unsigned)(i * 2654435761u);
}
__global__ void bump_and_check(unsigned *p, size_t n, unsigned seed, unsigned *bad) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        if (p[i] != (seed ^ (unsigned)(i * 2654435761u))) atomicAdd(bad, 1u);
        p[i] += 1;
    }
}
__global__ void check_bumped(const unsigned *p, size_t n, unsigned seed, unsigned *bad) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (p[i] != (seed ^ (unsigned)(i * 2654435761u)) + 1) atomicAdd(bad, 1u);
}

static int all_ok = 1;

static const char *name(cudaError_t e) {
    if (e != cudaSuccess) all_ok = 0;
    return cudaGetErrorName(e);
}

static unsigned count_bad(unsigned h) {
    if (h) all_ok = 0;
    return h;
}

// Bad words check_bumped finds in p, from a kernel on GPU dev.
static unsigned run_check(int dev, const unsigned *p, size_t n, unsigned seed, cudaError_t *e) {
    unsigned *bad = NULL, h = ~0u;
    cudaSetDevice(dev);
    cudaMalloc(&bad, 4);
    cudaMemset(bad, 0, 4);
    check_bumped<<<132, 256>>>(p, n, seed, bad);
    *e = cudaDeviceSynchronize();
    cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost);
    cudaFree(bad);
    return h;
}

// n words on GPU 0 filled with seed's pattern.  multi: two neighbours of half the size each are
// allocated and freed first, so the shim's pool places this one across their two segments.
static unsigned *make0(size_t n, unsigned seed, int multi) {
    unsigned *p = NULL, *x = NULL, *y = NULL;
    cudaSetDevice(0);
    if (multi) {
        name(cudaMalloc(&x, n * 2));
        name(cudaMalloc(&y, n * 2));
        name(cudaFree(x));
        name(cudaFree(y));
    }
    name(cudaMalloc(&p, n * 4));
    fill<<<132, 256>>>(p, n, seed);
    name(cudaDeviceSynchronize());
    return p;
}

// A kernel on GPU 1 reads and bumps every word of GPU 0's p; GPU 0 checks the bumps.
static void exercise(const char *what, unsigned *p, size_t n, unsigned seed) {
    unsigned *bad = NULL, h = ~0u;
    cudaSetDevice(1);
    cudaMalloc(&bad, 4);
    cudaMemset(bad, 0, 4);
    bump_and_check<<<132, 256>>>(p, n, seed, bad);
    cudaError_t e = cudaDeviceSynchronize();
    cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost);
    cudaFree(bad);
    printf("peer: GPU 1 kernel on GPU 0 allocation %s: %s, %u bad words read\n", what, name(e), count_bad(h));
    cudaError_t e0;
    unsigned h0 = run_check(0, p, n, seed, &e0);
    printf("peer: GPU 0 sees GPU 1's writes to the allocation %s: %s, %u bad words\n", what, name(e0), count_bad(h0));
}

// PEER_PAUSE_DIR: name the allocations ("NAME PID 0xADDR" lines in allocs), create ready, wait
// (at most 60 s) for go.  Prints nothing.
static void pause_for_registry(const char *const *names, void *const *ptrs, int n) {
    const char *dir = getenv("PEER_PAUSE_DIR");
    if (!dir || !*dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/allocs", dir);
    FILE *f = fopen(path, "w");
    if (!f) return;
    for (int i = 0; i < n; i++) fprintf(f, "%s %d 0x%llx\n", names[i], (int)getpid(), (unsigned long long)(uintptr_t)ptrs[i]);
    fclose(f);
    snprintf(path, sizeof path, "%s/ready", dir);
    if ((f = fopen(path, "w"))) fclose(f);
    snprintf(path, sizeof path, "%s/go", dir);
    for (int i = 0; i < 600 && access(path, F_OK) != 0; i++) usleep(100000);
}

int main() {
    int n_dev = 0, can = 0;
    cudaGetDeviceCount(&n_dev);
    if (n_dev < 2) { printf("peer: needs two GPUs, found %d\n", n_dev); return 2; }
    cudaDeviceCanAccessPeer(&can, 1, 0);
    printf("peer: GPU 1 can access GPU 0: %s\n", can ? "yes" : "no");
    if (!can) return 2;
    const size_t n = (64u << 20) / 4, nm = (60u << 20) / 4;
    unsigned *before = make0(n, 11, 0);           // made before peer access is enabled
    unsigned *multi_before = make0(nm, 44, 1);    // across two segments, before
    cudaSetDevice(1);
    printf("peer: cudaDeviceEnablePeerAccess(0) on GPU 1: %s\n", name(cudaDeviceEnablePeerAccess(0, 0)));
    unsigned *after = make0(n, 22, 0);            // made after
    unsigned *multi_after = make0(nm, 55, 1);     // across two segments, after
    exercise("made before", before, n, 11);
    exercise("made before, over two segments", multi_before, nm, 44);
    exercise("made after", after, n, 22);
    exercise("made after, over two segments", multi_after, nm, 55);

    unsigned *a1 = NULL;
    cudaSetDevice(1);
    name(cudaMalloc(&a1, n * 4));
    name(cudaMemcpyPeer(a1, 1, before, 0, n * 4));       // 0 -> 1 (the bumped pattern)
    fill<<<132, 256>>>(before, n, 33);                    // GPU 1 overwrites GPU 0's buffer directly
    name(cudaDeviceSynchronize());
    name(cudaMemcpyPeer(before, 0, a1, 1, n * 4));       // 1 -> 0: back to the bumped pattern
    cudaError_t e0;
    unsigned h = run_check(0, before, n, 11, &e0);
    printf("peer: copies both ways: %s, %s, %u bad words\n", name(cudaGetLastError()), name(e0), count_bad(h));
    cudaSetDevice(1);                                     // the same copies of a multi-segment allocation
    name(cudaMemcpyPeer(a1, 1, multi_after, 0, nm * 4));
    fill<<<132, 256>>>(multi_after, nm, 66);
    name(cudaDeviceSynchronize());
    name(cudaMemcpyPeer(multi_after, 0, a1, 1, nm * 4));
    h = run_check(0, multi_after, nm, 55, &e0);
    printf("peer: copies both ways, over two segments: %s, %s, %u bad words\n", name(cudaGetLastError()), name(e0), count_bad(h));

    const char *names[] = {"before", "multi_before", "after", "multi_after"};
    void *ptrs[] = {before, multi_before, after, multi_after};
    pause_for_registry(names, ptrs, 4);
    cudaSetDevice(1);
    printf("peer: cudaDeviceDisablePeerAccess(0): %s\n", name(cudaDeviceDisablePeerAccess(0)));
    cudaFree(a1);
    cudaSetDevice(0);
    cudaFree(before);
    cudaFree(multi_before);
    cudaFree(after);
    cudaFree(multi_after);
    printf("peer: %s\n", all_ok ? "every call succeeded, every word right" : "something failed");
    return all_ok ? 0 : 1;
}
