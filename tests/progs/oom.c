/* Allocate 64 MiB blocks until the device is full, report the total, free everything, then
 * show the program recovers (one more round fits again). */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    size_t block = 64u << 20, max = argc > 1 ? strtoull(argv[1], NULL, 10) : 100000;
    void **p = calloc(max, sizeof *p);
    size_t n = 0;
    cudaError_t e = cudaSuccess;
    while (n < max && (e = cudaMalloc(&p[n], block)) == cudaSuccess) n++;
    printf("oom: %zu blocks of 64 MiB = %.2f GiB, then %s\n", n, n * 64.0 / 1024, cudaGetErrorName(e));
    cudaGetLastError();
    for (size_t i = 0; i < n; i++) cudaFree(p[i]);
    size_t again = 0;
    while (again < n && cudaMalloc(&p[again], block) == cudaSuccess) again++;
    printf("recovered: %zu of %zu blocks again\n", again, n);
    for (size_t i = 0; i < again; i++) cudaFree(p[i]);
    free(p);
    return again == n ? 0 : 1;
}
