// The owner of tests/gpu/xdev_import.sh, run under the shim on two GPUs: allocations on GPU 0 and
// GPU 1 filled with known words, each announced with the FNV-1a 64 of its bytes (copied to the
// host), then commands from stdin while companions import them.
//   X0  GPU 0, cudaMalloc 64 MiB
//   M0  GPU 0, cudaMalloc 60 MiB across two of the pool's segments (two 30 MiB neighbours
//       allocated and freed first: a MULTI-HANDLE record; run with VMMSHIM_GIVE_BACK_MS high)
//   Y1  GPU 1, cudaMalloc 32 MiB
//   A1  GPU 1, cudaMallocAsync 48 MiB (the stream-ordered pool)
//   W0  GPU 0, cudaMalloc 16 MiB of zeros, for a companion to write into
// Prints "alloc NAME DEV 0xADDR BYTES FNV" per allocation, "range NAME 0xADDR BYTES FNV" for a
// piece of X0 (1 MiB in, 4 MiB long), then "ready PID".  Commands: "check W0 SEED" counts, with a
// kernel on GPU 0, the words of W0 that differ from SEED's pattern and answers "checked W0 BAD";
// "quit" frees everything and exits 0.  Any CUDA failure prints "error ..." and exits 1.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__global__ void fill(unsigned *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = seed ^ (unsigned)(i * 2654435761u);
}
__global__ void count_bad(const unsigned *p, size_t n, unsigned seed, unsigned *bad) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (p[i] != (seed ^ (unsigned)(i * 2654435761u))) atomicAdd(bad, 1u);
}

#define CK(call)                                                                             \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            printf("error %s: %s\n", #call, cudaGetErrorName(e_));                           \
            fflush(stdout);                                                                  \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

static unsigned long long fnv1a(const unsigned char *p, size_t n) {
    unsigned long long h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static unsigned long long device_fnv(const void *d, size_t bytes) {
    unsigned char *h = (unsigned char *)malloc(bytes);
    if (!h) { printf("error malloc\n"); exit(1); }
    CK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    unsigned long long f = fnv1a(h, bytes);
    free(h);
    return f;
}

int main() {
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    if (n < 2) { printf("error needs two GPUs, found %d\n", n); return 1; }
    const size_t MiB = 1u << 20;
    unsigned *x0, *m0, *y1, *a1, *w0, *t0, *t1, *bad;
    cudaStream_t s1;

    CK(cudaSetDevice(0));
    CK(cudaMalloc(&x0, 64 * MiB));
    fill<<<132, 256>>>(x0, 64 * MiB / 4, 0x11);
    CK(cudaMalloc(&t0, 30 * MiB));
    CK(cudaMalloc(&t1, 30 * MiB));
    CK(cudaFree(t0));
    CK(cudaFree(t1));
    CK(cudaMalloc(&m0, 60 * MiB));                // the freed neighbours' two segments
    fill<<<132, 256>>>(m0, 60 * MiB / 4, 0x22);
    CK(cudaMalloc(&w0, 16 * MiB));
    CK(cudaMemset(w0, 0, 16 * MiB));
    CK(cudaMalloc(&bad, 4));
    CK(cudaDeviceSynchronize());

    CK(cudaSetDevice(1));
    CK(cudaStreamCreate(&s1));
    CK(cudaMalloc(&y1, 32 * MiB));
    fill<<<132, 256>>>(y1, 32 * MiB / 4, 0x44);
    CK(cudaMallocAsync((void **)&a1, 48 * MiB, s1));
    fill<<<132, 256, 0, s1>>>(a1, 48 * MiB / 4, 0x33);
    CK(cudaStreamSynchronize(s1));
    CK(cudaDeviceSynchronize());

    printf("alloc X0 0 0x%llx %zu %016llx\n", (unsigned long long)(uintptr_t)x0, 64 * MiB, device_fnv(x0, 64 * MiB));
    printf("alloc M0 0 0x%llx %zu %016llx\n", (unsigned long long)(uintptr_t)m0, 60 * MiB, device_fnv(m0, 60 * MiB));
    printf("alloc Y1 1 0x%llx %zu %016llx\n", (unsigned long long)(uintptr_t)y1, 32 * MiB, device_fnv(y1, 32 * MiB));
    printf("alloc A1 1 0x%llx %zu %016llx\n", (unsigned long long)(uintptr_t)a1, 48 * MiB, device_fnv(a1, 48 * MiB));
    printf("alloc W0 0 0x%llx %zu %016llx\n", (unsigned long long)(uintptr_t)w0, 16 * MiB, device_fnv(w0, 16 * MiB));
    printf("range X0 0x%llx %zu %016llx\n", (unsigned long long)(uintptr_t)x0 + MiB, 4 * MiB,
           device_fnv((const char *)x0 + MiB, 4 * MiB));
    printf("ready %d\n", (int)getpid());
    fflush(stdout);

    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        unsigned seed = 0, h = ~0u;
        if (strncmp(line, "quit", 4) == 0) break;
        if (sscanf(line, "check W0 %u", &seed) == 1) {
            CK(cudaSetDevice(0));
            CK(cudaMemset(bad, 0, 4));
            count_bad<<<132, 256>>>(w0, 16 * MiB / 4, seed, bad);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost));
            printf("checked W0 %u\n", h);
        } else {
            printf("error unknown command\n");
        }
        fflush(stdout);
    }
    CK(cudaSetDevice(1));
    CK(cudaFreeAsync(a1, s1));
    CK(cudaStreamSynchronize(s1));
    CK(cudaFree(y1));
    CK(cudaSetDevice(0));
    CK(cudaFree(x0));
    CK(cudaFree(m0));
    CK(cudaFree(w0));
    CK(cudaFree(bad));
    return 0;
}
