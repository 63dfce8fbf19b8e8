// Peer access through the default memory pool (needs two GPUs): GPU 1 is granted read-write
// access to GPU 0's default pool with cudaMemPoolSetAccess (and nothing else: no
// cudaDeviceEnablePeerAccess), then a kernel on GPU 1 reads and bumps memory cudaMallocAsync'd on
// GPU 0 and GPU 0 checks the bumps, for four allocations: one made before the grant, one after,
// and one of each that the shim's stream-ordered pool places across two of its segments (two
// neighbours cudaMallocAsync'd and cudaFreeAsync'd on the stream, then one request as big as
// both on the same stream, which reuses their memory at once: a MULTI-HANDLE record).  Prints one
// line per allocation (error names and bad-word counts, the same natively and under the shim when
// the grant reaches every handle of the shim's memory); exits 0 when every word was right.
// PEER_PAUSE_DIR: as tests/gpu/peer.cu, before the frees.
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

static cudaError_t note(cudaError_t e) {
    if (e != cudaSuccess) all_ok = 0;
    return e;
}

// n words cudaMallocAsync'd on s (GPU 0's), filled with seed's pattern.  multi: two neighbours
// of half the size each are allocated and freed on s first.
static unsigned *make0(cudaStream_t s, size_t n, unsigned seed, int multi) {
    unsigned *p = NULL, *x = NULL, *y = NULL;
    if (multi) {
        note(cudaMallocAsync((void **)&x, n * 2, s));
        note(cudaMallocAsync((void **)&y, n * 2, s));
        note(cudaFreeAsync(x, s));
        note(cudaFreeAsync(y, s));
    }
    note(cudaMallocAsync((void **)&p, n * 4, s));
    fill<<<132, 256, 0, s>>>(p, n, seed);
    return p;
}

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

#define K 4

int main() {
    int n_dev = 0, can = 0;
    cudaGetDeviceCount(&n_dev);
    if (n_dev < 2) { printf("mempool_peer: needs two GPUs, found %d\n", n_dev); return 2; }
    cudaDeviceCanAccessPeer(&can, 1, 0);
    if (!can) { printf("mempool_peer: GPU 1 cannot access GPU 0\n"); return 2; }
    const size_t n = (64u << 20) / 4, nm = (80u << 20) / 4;
    const char *what[K] = {"made before the grant", "made before the grant, over two segments", "made after the grant",
                           "made after the grant, over two segments"};
    const char *names[K] = {"before", "multi_before", "after", "multi_after"};
    const size_t words[K] = {n, nm, n, nm};
    const unsigned seed[K] = {11, 44, 22, 55};
    unsigned *p[K], *bad1 = NULL, *bad0 = NULL, h1[K], h0[K];
    cudaStream_t s0, s1;
    cudaMemPool_t pool0;
    for (int k = 0; k < K; k++) h1[k] = h0[k] = ~0u;

    cudaSetDevice(0);
    note(cudaStreamCreate(&s0));
    note(cudaDeviceGetDefaultMemPool(&pool0, 0));
    p[0] = make0(s0, words[0], seed[0], 0);
    p[1] = make0(s0, words[1], seed[1], 1);
    cudaMemAccessDesc desc = {};
    desc.location.type = cudaMemLocationTypeDevice;
    desc.location.id = 1;
    desc.flags = cudaMemAccessFlagsProtReadWrite;
    cudaError_t grant = note(cudaMemPoolSetAccess(pool0, &desc, 1));
    p[2] = make0(s0, words[2], seed[2], 0);
    p[3] = make0(s0, words[3], seed[3], 1);
    note(cudaStreamSynchronize(s0));

    cudaSetDevice(1);                             // GPU 1 reads and writes GPU 0's pool memory
    note(cudaStreamCreate(&s1));
    note(cudaMalloc((void **)&bad1, sizeof h1));
    cudaMemsetAsync(bad1, 0, sizeof h1, s1);
    for (int k = 0; k < K; k++) bump_and_check<<<132, 256, 0, s1>>>(p[k], words[k], seed[k], bad1 + k);
    cudaError_t on_gpu1 = note(cudaStreamSynchronize(s1));
    cudaMemcpy(h1, bad1, sizeof h1, cudaMemcpyDeviceToHost);

    cudaSetDevice(0);                             // GPU 0 sees GPU 1's writes
    note(cudaMalloc((void **)&bad0, sizeof h0));
    cudaMemsetAsync(bad0, 0, sizeof h0, s0);
    for (int k = 0; k < K; k++) check_bumped<<<132, 256, 0, s0>>>(p[k], words[k], seed[k], bad0 + k);
    cudaError_t on_gpu0 = note(cudaStreamSynchronize(s0));
    cudaMemcpy(h0, bad0, sizeof h0, cudaMemcpyDeviceToHost);

    printf("mempool_peer: cudaMemPoolSetAccess %s; GPU 1 kernels %s; GPU 0 kernels %s\n", cudaGetErrorName(grant),
           cudaGetErrorName(on_gpu1), cudaGetErrorName(on_gpu0));
    for (int k = 0; k < K; k++) {
        printf("mempool_peer: %s: %u bad words read by GPU 1, %u bad words seen by GPU 0\n", what[k], h1[k], h0[k]);
        if (h1[k] || h0[k]) all_ok = 0;
    }
    pause_for_registry(names, (void *const *)p, K);
    for (int k = 0; k < K; k++) cudaFreeAsync(p[k], s0);
    cudaFree(bad0);
    cudaStreamSynchronize(s0);
    cudaSetDevice(1);
    cudaFree(bad1);
    return all_ok ? 0 : 1;
}
