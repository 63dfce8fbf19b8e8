/* Stream-ordered reuse as the shim promises it, with blocks big enough to be whole chunks of the
 * pool, so reuse shows as the same address (run under the shim with the emulated driver's
 * FAKECUDA_EVENT_DELAY_US, so a recorded free stays pending for a while). */
#include <cuda_runtime_api.h>
#include <stdio.h>

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
    return 0;
}
