/* Many threads allocating, writing, verifying and freeing at once (argv: threads, iterations). */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int iterations;
static int failures;

static void *worker(void *arg)
{
    unsigned id = (unsigned)(uintptr_t)arg, seed = id * 2654435761u + 1;
    for (int i = 0; i < iterations; i++) {
        seed = seed * 1103515245u + 12345u;
        size_t size = 1 + (seed >> 8) % (3u << 20);
        void *p = NULL;
        int async = (seed >> 4) & 1;
        cudaError_t e = async ? cudaMallocAsync(&p, size, cudaStreamPerThread) : cudaMalloc(&p, size);
        if (e != cudaSuccess) {
            __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
            continue;
        }
        uint32_t tag = id << 20 | (uint32_t)i, back = 0;
        cudaMemcpy(p, &tag, sizeof tag, cudaMemcpyHostToDevice);
        cudaMemcpy((char *)p + size - 1, &tag, 1, cudaMemcpyHostToDevice);
        cudaMemcpy(&back, p, sizeof back, cudaMemcpyDeviceToHost);
        if (size >= 4 && back != tag) __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
        e = async ? cudaFreeAsync(p, cudaStreamPerThread) : cudaFree(p);
        if (e != cudaSuccess) __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
    }
    cudaStreamSynchronize(cudaStreamPerThread);
    return NULL;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 16;
    iterations = argc > 2 ? atoi(argv[2]) : 10000;
    pthread_t t[64];
    if (n > 64) n = 64;
    for (int i = 0; i < n; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)i);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    printf("threads=%d iterations=%d failures=%d\n", n, iterations, failures);
    return failures != 0;
}
