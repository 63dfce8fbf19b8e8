// Peer access on shim memory (needs two GPUs): a kernel on GPU 1 reads and writes an allocation
// of GPU 0, for an allocation made before and one made after peer access was enabled, and peer
// copies go both ways.  Prints observations only, so native and shim runs compare line by line.
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

static unsigned run_bad(int dev, void (*k)(const unsigned *, size_t, unsigned, unsigned *), const unsigned *p, size_t n, unsigned seed) {
    unsigned *bad, h = 0;
    cudaSetDevice(dev);
    cudaMalloc(&bad, 4);
    cudaMemset(bad, 0, 4);
    k<<<132, 256>>>(p, n, seed, bad);
    cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost);
    cudaFree(bad);
    return h;
}

int main() {
    int n_dev = 0, can = 0;
    cudaGetDeviceCount(&n_dev);
    if (n_dev < 2) { printf("peer: needs two GPUs, found %d\n", n_dev); return 2; }
    cudaDeviceCanAccessPeer(&can, 1, 0);
    printf("peer: GPU 1 can access GPU 0: %s\n", can ? "yes" : "no");
    size_t n = (64u << 20) / 4;
    unsigned *a0, *b0, *a1, *bad;
    cudaSetDevice(0);
    cudaMalloc(&a0, n * 4);                       // made before peer access is enabled
    fill<<<132, 256>>>(a0, n, 11);
    cudaDeviceSynchronize();
    cudaSetDevice(1);
    printf("peer: cudaDeviceEnablePeerAccess(0) on GPU 1: %s\n", cudaGetErrorName(cudaDeviceEnablePeerAccess(0, 0)));
    cudaSetDevice(0);
    cudaMalloc(&b0, n * 4);                       // made after
    fill<<<132, 256>>>(b0, n, 22);
    cudaDeviceSynchronize();
    for (int k = 0; k < 2; k++) {
        unsigned *p = k ? b0 : a0, seed = k ? 22 : 11, h = 0;
        cudaSetDevice(1);
        cudaMalloc(&bad, 4);
        cudaMemset(bad, 0, 4);
        bump_and_check<<<132, 256>>>(p, n, seed, bad);  // GPU 1 reads and writes GPU 0's memory
        cudaError_t e = cudaDeviceSynchronize();
        cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost);
        cudaFree(bad);
        printf("peer: GPU 1 kernel on GPU 0 allocation %s: %s, %u bad words read\n", k ? "made after" : "made before", cudaGetErrorName(e), h);
        printf("peer: GPU 0 sees GPU 1's writes: %u bad words\n",
               run_bad(0, (void (*)(const unsigned *, size_t, unsigned, unsigned *))check_bumped, p, n, seed));
    }
    cudaSetDevice(1);
    cudaMalloc(&a1, n * 4);
    cudaMemcpyPeer(a1, 1, a0, 0, n * 4);          // 0 -> 1
    fill<<<132, 256>>>(a0, n, 33);                // GPU 1 overwrites GPU 0's buffer directly
    cudaDeviceSynchronize();
    cudaMemcpyPeer(a0, 0, a1, 1, n * 4);          // 1 -> 0: back to the bumped pattern
    printf("peer: copies both ways: %s, %u bad words\n", cudaGetErrorName(cudaGetLastError()),
           run_bad(0, (void (*)(const unsigned *, size_t, unsigned, unsigned *))check_bumped, a0, n, 11));
    cudaSetDevice(1);
    printf("peer: cudaDeviceDisablePeerAccess(0): %s\n", cudaGetErrorName(cudaDeviceDisablePeerAccess(0)));
    return 0;
}
