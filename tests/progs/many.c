/* N live cudaMalloc allocations of SIZE bytes: prints how many failed and how much device memory
 * they took (cudaMemGetInfo before and after), then frees them.  many N SIZE */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: many N SIZE\n");
        return 2;
    }
    int n = atoi(argv[1]);
    size_t size = strtoull(argv[2], NULL, 0);
    void **p = calloc((size_t)n, sizeof *p);
    size_t free0 = 0, free1 = 0, total = 0;
    if (!p || cudaFree(0) != cudaSuccess || cudaMemGetInfo(&free0, &total) != cudaSuccess) return 1;
    int failed = 0;
    for (int i = 0; i < n; i++)
        if (cudaMalloc(&p[i], size) != cudaSuccess) {
            p[i] = NULL;
            failed++;
        }
    cudaMemGetInfo(&free1, &total);
    printf("allocated=%d failures=%d used=%zu\n", n - failed, failed, free0 - free1);
    for (int i = 0; i < n; i++) cudaFree(p[i]);
    free(p);
    return 0;
}
