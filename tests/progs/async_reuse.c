/* Stream-ordered reuse as the shim promises it, with blocks big enough to be whole chunks of the
 * pool, so reuse shows as the same address (run under the shim with the emulated driver's
 * FAKECUDA_EVENT_DELAY_US, so a recorded free stays pending for a while).  As the native default
 * pool: another stream takes a free not reached yet and is made to wait for it (its work is then
 * queued behind the free: cuStreamQuery answers not ready); with
 * cudaMemPoolReuseAllowInternalDependencies off it gets new memory instead. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>

#include "../fakecuda/fakecuda.h"

static unsigned long long event_records(void)
{
    struct fakecuda_counters c;
    fakecuda_counters_fn get;
    void *sym = dlsym(RTLD_DEFAULT, "fakecuda_counters");
    if (!sym) return 0;
    *(void **)&get = sym;
    get(&c);
    return c.calls_cuEventRecord;
}

int main(void)
{
    cudaStream_t a, b, c;
    cudaMemPool_t pool;
    unsigned long long keep = ~0ull;
    cudaDeviceGetDefaultMemPool(&pool, 0);
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep); /* as PyTorch: a synchronization keeps it */
    cudaStreamCreate(&a);
    cudaStreamCreate(&b);
    cudaStreamCreate(&c);
    void *p, *q, *r, *t;
    cudaMallocAsync(&p, 16u << 20, a);
    cudaFreeAsync(p, a);
    cudaMallocAsync(&q, 16u << 20, a);
    printf("same stream reuses at once: %s\n", q == p ? "yes" : "no");
    cudaFreeAsync(q, a);
    cudaMallocAsync(&r, 16u << 20, b);
    printf("other stream before the free completes: %s, made to wait: %s\n", r == q ? "reused" : "new",
           cuStreamQuery((CUstream)b) == CUDA_ERROR_NOT_READY ? "yes" : "no");
    cudaFreeAsync(r, b);
    cudaStreamSynchronize(b);
    cudaMallocAsync(&t, 16u << 20, c);
    printf("other stream after the free completes: %s, made to wait: %s\n", t == q ? "reused" : "new",
           cuStreamQuery((CUstream)c) == CUDA_ERROR_NOT_READY ? "yes" : "no");
    cudaFreeAsync(t, c);
    cudaDeviceSynchronize();

    /* internal dependencies refused on the default pool: the other stream gets new memory */
    int off = 0, on = 1;
    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &off);
    cudaMallocAsync(&p, 16u << 20, a);
    cudaFreeAsync(p, a);
    cudaMallocAsync(&q, 16u << 20, b);
    printf("internal dependencies refused, other stream before the free completes: %s\n", q == p ? "reused" : "new");
    cudaFreeAsync(q, b);
    cudaDeviceSynchronize();

    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &on);

    /* a free's event is recorded only when needed: none for a stream reusing its own blocks */
    unsigned long long before = event_records();
    for (int i = 0; i < 1000; i++) {
        cudaMallocAsync(&p, 4096, a);
        cudaFreeAsync(p, a);
    }
    printf("event records for 1000 same-stream pairs: %llu\n", event_records() - before);
    cudaStreamSynchronize(a);

    /* a stream destroyed with a free in flight: that free is still waited for */
    cudaStream_t d;
    cudaStreamCreate(&d);
    void *u, *v;
    cudaMallocAsync(&u, 16u << 20, d);
    cudaFreeAsync(u, d);
    cudaStreamDestroy(d);
    cudaMallocAsync(&v, 16u << 20, c);
    printf("other stream after the freeing stream was destroyed: %s, made to wait: %s\n", v == u ? "reused" : "new",
           cuStreamQuery((CUstream)c) == CUDA_ERROR_NOT_READY ? "yes" : "no");
    cudaFreeAsync(v, c);
    cudaDeviceSynchronize();
    return 0;
}
