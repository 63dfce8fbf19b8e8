// Peer access through the default memory pool (needs two GPUs): GPU 1 is granted read-write
// access to GPU 0's default pool with cudaMemPoolSetAccess (and nothing else: no
// cudaDeviceEnablePeerAccess), then a kernel on GPU 1 reads and bumps memory cudaMallocAsync'd on
// GPU 0, once for an allocation made before the grant and once for one made after, and GPU 0
// checks the bumps.  Prints one line of results, the same natively and under the shim when the
// grant reaches the shim's memory; exits 0 when every word was right.
#include <cuda_runtime.h>
#include <stdio.h>

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

int main() {
    int n_dev = 0, can = 0;
    cudaGetDeviceCount(&n_dev);
    if (n_dev < 2) { printf("mempool_peer: needs two GPUs, found %d\n", n_dev); return 2; }
    cudaDeviceCanAccessPeer(&can, 1, 0);
    if (!can) { printf("mempool_peer: GPU 1 cannot access GPU 0\n"); return 2; }
    const size_t n = (64u << 20) / 4;
    unsigned *before = NULL, *after = NULL, *bad1 = NULL, *bad0 = NULL, h1[2] = {~0u, ~0u}, h0[2] = {~0u, ~0u};
    cudaStream_t s0, s1;
    cudaMemPool_t pool0;

    cudaSetDevice(0);
    cudaStreamCreate(&s0);
    cudaDeviceGetDefaultMemPool(&pool0, 0);
    cudaMallocAsync((void **)&before, n * 4, s0);
    fill<<<132, 256, 0, s0>>>(before, n, 11);
    cudaMemAccessDesc desc = {};
    desc.location.type = cudaMemLocationTypeDevice;
    desc.location.id = 1;
    desc.flags = cudaMemAccessFlagsProtReadWrite;
    cudaError_t grant = cudaMemPoolSetAccess(pool0, &desc, 1);
    cudaMallocAsync((void **)&after, n * 4, s0);
    fill<<<132, 256, 0, s0>>>(after, n, 22);
    cudaStreamSynchronize(s0);

    cudaSetDevice(1);                             // GPU 1 reads and writes GPU 0's pool memory
    cudaStreamCreate(&s1);
    cudaMalloc((void **)&bad1, sizeof h1);
    cudaMemsetAsync(bad1, 0, sizeof h1, s1);
    bump_and_check<<<132, 256, 0, s1>>>(before, n, 11, bad1);
    bump_and_check<<<132, 256, 0, s1>>>(after, n, 22, bad1 + 1);
    cudaError_t on_gpu1 = cudaStreamSynchronize(s1);
    cudaMemcpy(h1, bad1, sizeof h1, cudaMemcpyDeviceToHost);

    cudaSetDevice(0);                             // GPU 0 sees GPU 1's writes
    cudaMalloc((void **)&bad0, sizeof h0);
    cudaMemsetAsync(bad0, 0, sizeof h0, s0);
    check_bumped<<<132, 256, 0, s0>>>(before, n, 11, bad0);
    check_bumped<<<132, 256, 0, s0>>>(after, n, 22, bad0 + 1);
    cudaError_t on_gpu0 = cudaStreamSynchronize(s0);
    cudaMemcpy(h0, bad0, sizeof h0, cudaMemcpyDeviceToHost);

    printf("mempool_peer: cudaMemPoolSetAccess %s; GPU 1 kernel %s, bad words read %u (made before the grant) %u (after); "
           "GPU 0 %s, bad words seen %u %u\n",
           cudaGetErrorName(grant), cudaGetErrorName(on_gpu1), h1[0], h1[1], cudaGetErrorName(on_gpu0), h0[0], h0[1]);
    cudaFreeAsync(before, s0);
    cudaFreeAsync(after, s0);
    cudaFree(bad0);
    cudaStreamSynchronize(s0);
    cudaSetDevice(1);
    cudaFree(bad1);
    int ok = grant == cudaSuccess && on_gpu1 == cudaSuccess && on_gpu0 == cudaSuccess && !h1[0] && !h1[1] && !h0[0] && !h0[1];
    return ok ? 0 : 1;
}
