/* Row a (and a2): a plain CUDA runtime program.  Built with `nvcc -O2 -arch=sm_90` the runtime is
 * linked statically and reaches the driver through cuGetProcAddress; a2 builds the same source
 * with -cudart shared.  cudaMalloc and cudaMallocAsync buffers, kernels that fill, combine and
 * check them, a churn of allocations (reuse), and the error codes a program can observe. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define CK(call)                                                                                       \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            printf("error %s: %s\n", #call, cudaGetErrorName(e_));                                     \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

__global__ void fill(unsigned *p, size_t n, unsigned seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = mix(i, seed);
}

__global__ void combine(unsigned *c, const unsigned *a, const unsigned *b, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        c[i] = a[i] * 3u + b[i];
}

__global__ void check(const unsigned *c, size_t n, unsigned sa, unsigned sb, unsigned long long *bad)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        if (c[i] != mix(i, sa) * 3u + mix(i, sb)) atomicAdd(bad, 1ull);
}

__global__ void sum(const unsigned *p, size_t n, unsigned long long *out)
{
    unsigned long long s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) s += p[i];
    atomicAdd(out, s);
}

static void show(const char *what, cudaError_t e) { printf("%-40s %s\n", what, cudaGetErrorName(e)); }

int main(void)
{
    unsigned *a, *b, *c, *d;
    unsigned long long *counters, host[2];
    cudaStream_t s;
    size_t na = (3u << 20) / 4, nb = ((5u << 20) + 123) / 4, nc = (6u << 20) / 4, nd = (1u << 20) / 4;
    CK(cudaStreamCreate(&s));
    CK(cudaMalloc((void **)&a, na * 4));
    CK(cudaMalloc((void **)&b, nb * 4));
    CK(cudaMallocAsync((void **)&c, nc * 4, s));
    CK(cudaMallocAsync((void **)&d, nd * 4, 0));
    CK(cudaMalloc((void **)&counters, 2 * sizeof *counters));
    printf("# a %p b %p c %p d %p\n", (void *)a, (void *)b, (void *)c, (void *)d);
    CK(cudaMemset(counters, 0, 2 * sizeof *counters));
    fill<<<256, 256>>>(a, na, 1);
    fill<<<256, 256>>>(b, nb, 2);
    CK(cudaDeviceSynchronize());
    combine<<<256, 256, 0, s>>>(c, a, b, na);
    check<<<256, 256, 0, s>>>(c, na, 1, 2, counters);
    sum<<<256, 256, 0, s>>>(c, na, counters + 1);
    fill<<<64, 256>>>(d, nd, 3);
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(host, counters, sizeof host, cudaMemcpyDeviceToHost));
    printf("combine: %llu bad words, checksum %llu\n", host[0], host[1]);
    unsigned *h = (unsigned *)malloc(nd * 4);
    CK(cudaMemcpy(h, d, nd * 4, cudaMemcpyDeviceToHost));
    int ok = 1;
    for (size_t i = 0; i < nd; i++) ok &= h[i] == mix(i, 3);
    printf("async buffer on the legacy stream, read by the host: %s\n", ok ? "ok" : "BAD");
    free(h);

    pause_point(); /* a, b, c, d are live */

    /* churn: allocate, fill, sum and free, alternating the APIs; freed memory is reused */
    unsigned long long total = 0;
    for (int i = 0; i < 40; i++) {
        size_t n = (((size_t)i * 7919) % 50 + 1) * (64u << 10) / 4;
        unsigned *p;
        int async = i & 1;
        if (async) CK(cudaMallocAsync((void **)&p, n * 4, s));
        else CK(cudaMalloc((void **)&p, n * 4));
        CK(cudaMemsetAsync(counters, 0, sizeof *counters, s));
        fill<<<128, 256, 0, s>>>(p, n, 100 + i);
        sum<<<128, 256, 0, s>>>(p, n, counters);
        CK(cudaMemcpyAsync(host, counters, sizeof *host, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        total += host[0];
        if (async) CK(cudaFreeAsync(p, s));
        else CK(cudaFree(p));
    }
    CK(cudaStreamSynchronize(s));
    printf("churn: 40 allocations, checksum %llu\n", total);

    /* what a program can observe */
    size_t f0 = 0, f1 = 0, t = 0;
    unsigned *big = NULL;
    CK(cudaMemGetInfo(&f0, &t));
    CK(cudaMalloc((void **)&big, 64u << 20));
    CK(cudaMemGetInfo(&f1, &t));
    printf("cudaMemGetInfo: free dropped by >= 64 MiB: %s\n", f1 + (64u << 20) <= f0 ? "yes" : "NO");
    CK(cudaFree(big));
    show("cudaFree(a + 4096) (interior)", cudaFree((char *)a + 4096));
    show("  cudaGetLastError", cudaGetLastError());
    show("cudaFree(a)", cudaFree(a));
    show("cudaFree(a) again", cudaFree(a));
    show("  cudaGetLastError", cudaGetLastError());
    void *huge = NULL;
    show("cudaMalloc(1 TiB)", cudaMalloc(&huge, 1ull << 40));
    show("  cudaGetLastError", cudaGetLastError());
    show("cudaMalloc(4 KiB) after that", cudaMalloc(&huge, 4096));
    show("cudaFree(4 KiB)", cudaFree(huge));
    show("cudaFreeAsync(c)", cudaFreeAsync(c, s));
    show("cudaFree(d) (cudaMallocAsync'd)", cudaFree(d));
    show("cudaFree(b)", cudaFree(b));
    show("cudaFree(counters)", cudaFree(counters));
    show("cudaStreamDestroy", cudaStreamDestroy(s));
    show("cudaDeviceSynchronize", cudaDeviceSynchronize());
    printf("done\n");
    return 0;
}
