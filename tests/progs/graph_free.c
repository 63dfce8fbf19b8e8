/* A cudaFreeAsync captured into a graph: natively the free is a node of the graph, and the memory
 * goes back when a launch reaches it, not before.  cudaMallocAsync outside the capture, free it
 * inside, instantiate, then launch.  Prints the calls' results (the same natively and under the
 * shim, on a GPU too), and, over tests/fakecuda only (its counters), "key value" lines:
 *   held_before_launch   bytes still held after instantiating, 100 ms later (natively: all 64 MiB)
 *   left_after_launch    bytes held after launch + cudaStreamSynchronize, release threshold 0
 *   same_address         threshold UINT64_MAX: a same-size cudaMallocAsync on another stream after
 *                        the launch got the freed address (the pool reused it)
 * With the argument "relaunch" (under the shim: natively a second free of the memory is an
 * error), the graph is launched once more after the freed memory went to a new allocation:
 *   relaunch_held        bytes held after the second launch while the new allocation lives
 *   end_left             bytes held once it is freed too */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../fakecuda/fakecuda.h"

#define MiB (1ull << 20)
#define SIZE (64 * MiB)

static fakecuda_counters_fn counters;

static long long phys(void)
{
    struct fakecuda_counters c;
    counters(&c);
    return (long long)c.phys_bytes_live;
}

static void set_threshold(uint64_t bytes)
{
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess)
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &bytes);
}

/* Allocates SIZE on s, frees it in a capture of s: *x is the instantiated graph. */
static void *captured_free(cudaStream_t s, cudaGraph_t *g, cudaGraphExec_t *x, const char *tag)
{
    void *p = NULL;
    cudaError_t a = cudaMallocAsync(&p, SIZE, s);
    cudaError_t m = cudaMemsetAsync(p, 7, SIZE, s);
    cudaStreamSynchronize(s);
    cudaError_t b = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaError_t f = cudaFreeAsync(p, s);
    cudaError_t e = cudaStreamEndCapture(s, g);
    cudaError_t i = cudaGraphInstantiate(x, *g, 0);
    printf("%s: malloc %s memset %s begin %s free %s end %s instantiate %s\n", tag, cudaGetErrorName(a),
           cudaGetErrorName(m), cudaGetErrorName(b), cudaGetErrorName(f), cudaGetErrorName(e), cudaGetErrorName(i));
    return p;
}

int main(int argc, char **argv)
{
    int relaunch = argc > 1 && !strcmp(argv[1], "relaunch");
    void *sym = dlsym(RTLD_DEFAULT, "fakecuda_counters");
    memcpy(&counters, &sym, sizeof sym);
    cudaStream_t s, s2;
    cudaSetDevice(0);
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
    void *warm = NULL; /* the shim's pool and marker slots exist before the measured part */
    cudaMallocAsync(&warm, 1, s);
    cudaFreeAsync(warm, s);
    cudaStreamSynchronize(s);

    set_threshold(0);
    long long base = counters ? phys() : 0;
    cudaGraph_t g;
    cudaGraphExec_t x;
    captured_free(s, &g, &x, "threshold 0");
    cudaStreamSynchronize(s);
    usleep(100000); /* time for memory wrongly thought free to go back */
    if (counters) printf("held_before_launch %lld\n", phys() - base);
    cudaError_t l = cudaGraphLaunch(x, s), y = cudaStreamSynchronize(s);
    printf("launch %s sync %s\n", cudaGetErrorName(l), cudaGetErrorName(y));
    if (counters) printf("left_after_launch %lld\n", phys() - base);
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);

    set_threshold(UINT64_MAX);
    void *p = captured_free(s, &g, &x, "threshold max");
    l = cudaGraphLaunch(x, s);
    y = cudaStreamSynchronize(s);
    void *q = NULL;
    cudaError_t a = cudaMallocAsync(&q, SIZE, s2);
    printf("launch %s sync %s; malloc on another stream %s\n", cudaGetErrorName(l), cudaGetErrorName(y),
           cudaGetErrorName(a));
    if (counters) printf("same_address %d\n", p == q);
    if (relaunch) {
        l = cudaGraphLaunch(x, s);
        y = cudaStreamSynchronize(s);
        printf("relaunch %s sync %s\n", cudaGetErrorName(l), cudaGetErrorName(y));
        if (counters) printf("relaunch_held %lld\n", phys() - base);
    }
    set_threshold(0);
    cudaError_t f = cudaFreeAsync(q, s2);
    y = cudaStreamSynchronize(s2);
    printf("free %s sync %s\n", cudaGetErrorName(f), cudaGetErrorName(y));
    if (counters && relaunch) printf("end_left %lld\n", phys() - base);
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    return 0;
}
