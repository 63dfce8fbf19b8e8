/* Stream-ordered reuse as the shim promises it, with blocks big enough to be whole chunks of the
 * pool, so reuse shows as the same address (run under the shim with the emulated driver's
 * FAKECUDA_EVENT_DELAY_US, so a recorded free stays pending for a while). */
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
    printf("other stream before the free completes: %s\n", r == q ? "reused" : "new");
    cudaStreamSynchronize(a);
    cudaMallocAsync(&t, 16u << 20, c);
    printf("other stream after the free completes: %s\n", t == q ? "reused" : "new");
    cudaFreeAsync(r, b);
    cudaFreeAsync(t, c);
    cudaDeviceSynchronize();

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
    printf("other stream after the freeing stream was destroyed: %s\n", v == u ? "reused" : "new");
    cudaFreeAsync(v, c);
    cudaDeviceSynchronize();
    return 0;
}
