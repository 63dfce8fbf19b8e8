/* cudaMemPoolReuseFollowEventDependencies on the default pool, with opportunistic reuse and internal
 * dependencies refused: a free on stream a serves stream b once b waited for an event recorded on a
 * after the free, and only then.  One line per case, "reused" or "new" (run natively and under the
 * shim: the lines must be the same); blocks of 16 MiB, whole chunks of the pool, and the pool
 * trimmed between cases, so reuse shows as the same address.  Stream a sleeps 100 ms on the host
 * (cuLaunchHostFunc) before each free, so on a GPU too the free is still pending when b asks.  Then the same with following refused too, and everything back on. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <time.h>

static cudaStream_t a, b;
static cudaEvent_t e;
static cudaMemPool_t pool;

static void CUDA_CB nap(void *arg)
{
    (void)arg;
    struct timespec t = {0, 100 * 1000 * 1000};
    nanosleep(&t, NULL);
}

/* order: 0 record after the free, b waits; 1 no record or wait; 2 record before the free, b waits */
static const char *one_case(int order)
{
    void *p = NULL, *q = NULL;
    if (cudaMallocAsync(&p, 16u << 20, a) != cudaSuccess) return "failed";
    cuLaunchHostFunc((CUstream)a, nap, NULL);
    if (order == 2) cudaEventRecord(e, a);
    cudaFreeAsync(p, a);
    if (order == 0) cudaEventRecord(e, a);
    if (order != 1) cudaStreamWaitEvent(b, e, 0);
    if (cudaMallocAsync(&q, 16u << 20, b) != cudaSuccess) return "failed";
    cudaFreeAsync(q, b);
    cudaDeviceSynchronize();
    cudaMemPoolTrimTo(pool, 0); /* no free block left that b could take instead */
    return q == p ? "reused" : "new";
}

int main(void)
{
    unsigned long long keep = ~0ull;
    int off = 0, on = 1;
    if (cudaDeviceGetDefaultMemPool(&pool, 0) != cudaSuccess) return 1;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &off);
    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &off);
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaEventCreate(&e);
    printf("b waited for an event recorded after the free: %s\n", one_case(0));
    printf("b waited for nothing: %s\n", one_case(1));
    printf("b waited for an event recorded before the free: %s\n", one_case(2));
    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseFollowEventDependencies, &off);
    printf("following refused, b waited for an event recorded after the free: %s\n", one_case(0));
    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseFollowEventDependencies, &on);
    printf("following allowed again: %s\n", one_case(0));
    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &on);
    cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &on);
    cudaEventDestroy(e);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
    return 0;
}
