/* A plain host-only C program linked against CUDA 11's runtime (libcudart.so.11.0), to run under
 * the shim as a CUDA 13 program does: `make cuda11` builds it against CUDA 11.8's headers and
 * Debian's libcudart.so.11.0 for a GPU (tests/gpu/cuda11.sh), `make` against CUDA 13's headers and
 * the emulated runtime as libcudart.so.11.0 for CI (tests/python/test_cuda11.py).  It prints
 * the runtime and driver versions, allocates with cudaMalloc, copies a pattern in and back, and
 * prints `ready PID ADDRESS SIZE` then waits for a line on stdin (so a script can look at the
 * registry while the allocation lives), frees, and prints `ok` (exit 0) or what failed (exit 1). */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fail(const char *what, cudaError_t e)
{
    printf("FAIL %s: %s (%d)\n", what, cudaGetErrorString(e), (int)e);
    return 1;
}

int main(int argc, char **argv)
{
    size_t size = argc > 1 ? strtoull(argv[1], NULL, 0) : (size_t)8 << 20;
    int rt = 0, drv = 0;
    cudaError_t e;
    if ((e = cudaRuntimeGetVersion(&rt)) != cudaSuccess) return fail("cudaRuntimeGetVersion", e);
    if ((e = cudaDriverGetVersion(&drv)) != cudaSuccess) return fail("cudaDriverGetVersion", e);
    printf("runtime %d driver %d (built with CUDART_VERSION %d)\n", rt, drv, CUDART_VERSION);
    void *d = NULL;
    if ((e = cudaMalloc(&d, size)) != cudaSuccess) return fail("cudaMalloc", e);
    unsigned char *h = malloc(size), *back = malloc(size);
    if (!h || !back) return 1;
    for (size_t i = 0; i < size; i++) h[i] = (unsigned char)(i * 7 + 3);
    if ((e = cudaMemcpy(d, h, size, cudaMemcpyHostToDevice)) != cudaSuccess) return fail("cudaMemcpy H2D", e);
    if ((e = cudaMemcpy(back, d, size, cudaMemcpyDeviceToHost)) != cudaSuccess) return fail("cudaMemcpy D2H", e);
    if (memcmp(h, back, size) != 0) {
        printf("FAIL the bytes read back differ\n");
        return 1;
    }
    printf("ready %d 0x%llx %zu\n", (int)getpid(), (unsigned long long)(uintptr_t)d, size);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;
    if ((e = cudaFree(d)) != cudaSuccess) return fail("cudaFree", e);
    free(h);
    free(back);
    printf("ok\n");
    return 0;
}
