/* Thread A captures a stream in the mode given (1 thread-local, 2 relaxed) while thread B makes
 * and frees memory (cudaMalloc + cudaFree, then 4 KiB the same way) on the same device: prints
 * what B got and how A's capture ended.  Natively neither mode lets B's calls break A's capture. */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static volatile int phase;
static cudaError_t b_malloc, b_free, b_malloc_small, b_free_small;

static void *thread_b(void *arg)
{
    (void)arg;
    cudaSetDevice(0);
    while (__atomic_load_n(&phase, __ATOMIC_ACQUIRE) != 1) {
    }
    void *p = NULL, *q = NULL;
    b_malloc = cudaMalloc(&p, 64u << 20);
    b_free = cudaFree(p);
    b_malloc_small = cudaMalloc(&q, 4096);
    b_free_small = cudaFree(q);
    __atomic_store_n(&phase, 2, __ATOMIC_RELEASE);
    return NULL;
}

int main(int argc, char **argv)
{
    int mode = argc > 1 ? atoi(argv[1]) : 1;
    void *warm = NULL;
    cudaMalloc(&warm, 1);
    cudaFree(warm);
    cudaStream_t sa;
    cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking);
    pthread_t tb;
    pthread_create(&tb, NULL, thread_b, NULL);
    cudaError_t begin = cudaStreamBeginCapture(sa, (enum cudaStreamCaptureMode)mode);
    __atomic_store_n(&phase, 1, __ATOMIC_RELEASE);
    while (__atomic_load_n(&phase, __ATOMIC_ACQUIRE) != 2) {
    }
    cudaGraph_t g = NULL;
    cudaError_t end = cudaStreamEndCapture(sa, &g);
    pthread_join(tb, NULL);
    printf("mode %d: B malloc %s free %s, 4 KiB malloc %s free %s; A begin %s end %s\n", mode,
           cudaGetErrorName(b_malloc), cudaGetErrorName(b_free), cudaGetErrorName(b_malloc_small),
           cudaGetErrorName(b_free_small), cudaGetErrorName(begin), cudaGetErrorName(end));
    return end == cudaSuccess ? 0 : 1;
}
