// Kernels for the GPU checks: an owner that writes a pattern with a kernel into shim memory
// (cudaMalloc and cudaMallocAsync on several streams, with reuse), and a companion that imports
// the owner's allocation through the client library and verifies it with a kernel.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "vmmshim.h"

__global__ void fill(unsigned *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = seed ^ (unsigned)(i * 2654435761u);
}
__global__ void verify(const unsigned *p, size_t n, unsigned seed, unsigned *bad) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (p[i] != (seed ^ (unsigned)(i * 2654435761u))) atomicAdd(bad, 1u);
}

static unsigned check(const unsigned *p, size_t n, unsigned seed, cudaStream_t s) {
    unsigned *bad, h = 0;
    cudaMallocAsync((void **)&bad, sizeof *bad, s);
    cudaMemsetAsync(bad, 0, sizeof *bad, s);
    verify<<<264, 256, 0, s>>>(p, n, seed, bad);
    cudaMemcpyAsync(&h, bad, sizeof h, cudaMemcpyDeviceToHost, s);
    cudaFreeAsync(bad, s);
    cudaStreamSynchronize(s);
    return h;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "owner")) {
        size_t n = (48u << 20) / 4;
        unsigned *p;
        if (cudaMalloc((void **)&p, n * 4) != cudaSuccess) return 1;
        fill<<<264, 256>>>(p, n, 0xC0FFEEu);
        cudaDeviceSynchronize();
        printf("ready %d 0x%llx %zu\n", (int)getpid(), (unsigned long long)p, n * 4);
        fflush(stdout);
        char line[32];
        if (fgets(line, sizeof line, stdin)) {
            unsigned bad = check(p, 1024, 0xBEEFu, 0);  // the companion overwrote the first 4 KiB
            printf("owner sees companion's kernel writes: %s\n", bad ? "NO" : "yes");
        }
        return 0;
    }
    if (argc > 3 && !strcmp(argv[1], "companion")) {
        vmm_registry *reg;
        vmm_alloc_info a;
        vmm_imported *imp;
        if (vmm_open(NULL, &reg) || vmm_find(reg, atoi(argv[2]), strtoull(argv[3], 0, 16), &a) || vmm_import(reg, &a, &imp)) {
            printf("companion: %s\n", vmm_last_error());
            return 1;
        }
        unsigned *p = (unsigned *)vmm_import_ptr(imp);
        unsigned bad = check(p, a.requested_size / 4, 0xC0FFEEu, 0);
        printf("companion kernel verifies the owner's pattern: %s (%u bad words)\n", bad ? "NO" : "yes", bad);
        fill<<<4, 256>>>(p, 1024, 0xBEEFu);
        cudaDeviceSynchronize();
        vmm_import_release(imp);
        vmm_close(reg);
        return bad != 0;
    }
    // streams: cudaMallocAsync/cudaFreeAsync on several streams with reuse, checked by kernels
    cudaStream_t s[4];
    unsigned total_bad = 0;
    for (int i = 0; i < 4; i++) cudaStreamCreate(&s[i]);
    for (int round = 0; round < 200; round++) {
        for (int i = 0; i < 4; i++) {
            unsigned *p;
            size_t n = ((size_t)(1 + (round * 7 + i) % 5) << 20) / 4;
            if (cudaMallocAsync((void **)&p, n * 4, s[i]) != cudaSuccess) { total_bad++; continue; }
            fill<<<132, 256, 0, s[i]>>>(p, n, round * 4 + i);
            total_bad += check(p, n, round * 4 + i, s[i]);
            cudaFreeAsync(p, s[i]);
        }
    }
    cudaDeviceSynchronize();
    printf("async streams: 800 allocations on 4 streams, %u bad words, last error %s\n", total_bad, cudaGetErrorName(cudaGetLastError()));
    return total_bad != 0;
}
