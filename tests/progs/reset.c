/* cudaDeviceReset with live and cached memory: prints what the program sees, which must be the
 * same natively and under the shim.  Allocates (a big, a small, a stream-ordered one, and one
 * freed again so the pool caches its chunk), resets, frees the old pointers (native: they are
 * gone), allocates and uses memory again; with an argument, prints "ready <pid> <address>" on
 * stderr and waits for a line on stdin before freeing it and exiting. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    (void)argv;
    void *a = NULL, *b = NULL, *c = NULL, *d = NULL, *e = NULL;
    printf("malloc a: %s\n", cudaGetErrorName(cudaMalloc(&a, 64u << 20)));
    printf("malloc b: %s\n", cudaGetErrorName(cudaMalloc(&b, 4096)));
    printf("mallocAsync c: %s\n", cudaGetErrorName(cudaMallocAsync(&c, 8u << 20, 0)));
    printf("malloc d: %s\n", cudaGetErrorName(cudaMalloc(&d, 3u << 20)));
    printf("free d: %s\n", cudaGetErrorName(cudaFree(d)));
    printf("sync: %s\n", cudaGetErrorName(cudaDeviceSynchronize()));
    printf("reset: %s\n", cudaGetErrorName(cudaDeviceReset()));
    printf("free a after reset: %s\n", cudaGetErrorName(cudaFree(a)));
    cudaGetLastError();
    printf("free b after reset: %s\n", cudaGetErrorName(cudaFree(b)));
    cudaGetLastError();
    printf("malloc e after reset: %s\n", cudaGetErrorName(cudaMalloc(&e, 64u << 20)));
    unsigned char h = 0;
    cudaMemset(e, 0x5a, 64u << 20);
    cudaError_t rc = cudaMemcpy(&h, (char *)e + (63u << 20), 1, cudaMemcpyDeviceToHost);
    printf("e holds what was written: %s 0x%02x\n", cudaGetErrorName(rc), h);
    fflush(stdout);
    if (argc > 1) {
        fprintf(stderr, "ready %d 0x%llx\n", (int)getpid(), (unsigned long long)(uintptr_t)e);
        char line[16];
        if (!fgets(line, sizeof line, stdin)) return 1;
    }
    printf("free e: %s\n", cudaGetErrorName(cudaFree(e)));
    return 0;
}
