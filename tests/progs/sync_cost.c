/* What a training step's per-step driver calls cost: ns per call of the synchronizations and
 * queries a framework makes every step (JAX: cuStreamSynchronize, cuCtxSynchronize, cuEventQuery,
 * cuEventSynchronize through cuGetProcAddress; PyTorch: cudaStreamSynchronize), N calls each
 * (argv[1], default 1,000,000), best of 3 passes, natively or under the shim alike:
 *   NAME ns=X
 * Before the passes it does what a step does to the shim's memory: cudaMalloc and
 * cudaMallocAsync blocks live, a pair freed (one stream-ordered, then the stream synchronized),
 * so the shim is in its steady state with nothing waiting.  Ends with "sync_cost ok".
 * With argv[2] = "pending" the stream-ordered free is left unsynchronized on a stream of its own
 * and the timed calls synchronize another one: the shim then has a free waiting. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef CUresult (*stream_fn)(CUstream);
typedef CUresult (*ctx_fn)(void);
typedef CUresult (*event_fn)(CUevent);
typedef CUresult (*attr_fn)(void *, CUpointer_attribute, CUdeviceptr);

#define CK(call)                                                                                      \
    do {                                                                                              \
        int rc_ = (int)(call);                                                                        \
        if (rc_ != 0) {                                                                               \
            printf("error %s: %d\n", #call, rc_);                                                     \
            exit(1);                                                                                  \
        }                                                                                             \
    } while (0)

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void *proc(const char *name)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CK(cuGetProcAddress(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    if (!p || st != CU_GET_PROC_ADDRESS_SUCCESS) {
        printf("error cuGetProcAddress(%s)\n", name);
        exit(1);
    }
    return p;
}

static long n_calls = 1000000;

/* Times `body` n_calls times, best of 3 passes, and prints ns per call. */
#define TIME(name, body)                                                                              \
    do {                                                                                              \
        double best_ = 1e30;                                                                          \
        for (int pass_ = 0; pass_ < 3; pass_++) {                                                     \
            double t0_ = now_ns();                                                                    \
            for (long i_ = 0; i_ < n_calls; i_++) CK(body);                                           \
            double ns_ = (now_ns() - t0_) / (double)n_calls;                                          \
            if (ns_ < best_) best_ = ns_;                                                             \
        }                                                                                             \
        printf("%-34s ns=%.1f\n", name, best_);                                                       \
        fflush(stdout);                                                                               \
    } while (0)

int main(int argc, char **argv)
{
    if (argc > 1) n_calls = atol(argv[1]);
    int pending = argc > 2 && strcmp(argv[2], "pending") == 0;
    if (n_calls <= 0) n_calls = 1;
    cudaStream_t s, other;
    CK(cudaFree(NULL));
    CK(cudaStreamCreate(&s));
    CK(cudaStreamCreate(&other));
    void *live = NULL, *live_async = NULL, *gone = NULL, *gone_async = NULL;
    CK(cudaMalloc(&live, 64u << 20));
    CK(cudaMallocAsync(&live_async, 1u << 20, s));
    CK(cudaMalloc(&gone, 1u << 20));
    CK(cudaMallocAsync(&gone_async, 1u << 20, pending ? other : s));
    CK(cudaFree(gone));
    CK(cudaFreeAsync(gone_async, pending ? other : s));
    CK(cudaStreamSynchronize(s));

    CUstream cs = (CUstream)s;
    CUevent ev;
    CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CK(cuEventRecord(ev, cs));
    stream_fn stream_sync;
    ctx_fn ctx_sync;
    event_fn event_query, event_sync;
    attr_fn ptr_attr;
    void *p;
    p = proc("cuStreamSynchronize"), memcpy(&stream_sync, &p, sizeof p);
    p = proc("cuCtxSynchronize"), memcpy(&ctx_sync, &p, sizeof p);
    p = proc("cuEventQuery"), memcpy(&event_query, &p, sizeof p);
    p = proc("cuEventSynchronize"), memcpy(&event_sync, &p, sizeof p);
    p = proc("cuPointerGetAttribute"), memcpy(&ptr_attr, &p, sizeof p);
    CUdeviceptr inner = (CUdeviceptr)(uintptr_t)live + (1u << 20); /* as a suballocator's buffer */
    int mem_type = 0;

    TIME("cuStreamSynchronize(linked)", cuStreamSynchronize(cs));
    TIME("cuStreamSynchronize(procaddr)", stream_sync(cs));
    TIME("cuStreamSynchronize(procaddr,0)", stream_sync(NULL));
    TIME("cuCtxSynchronize(procaddr)", ctx_sync());
    TIME("cuEventQuery(procaddr)", event_query(ev));
    TIME("cuEventSynchronize(procaddr)", event_sync(ev));
    TIME("cudaStreamSynchronize", cudaStreamSynchronize(s));
    TIME("cudaDeviceSynchronize", cudaDeviceSynchronize());
    TIME("cuPointerGetAttribute(interior)", ptr_attr(&mem_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, inner));

    CK(cuEventDestroy(ev));
    CK(cudaFreeAsync(live_async, s));
    CK(cudaFree(live));
    CK(cudaStreamSynchronize(s));
    CK(cudaStreamSynchronize(other));
    CK(cudaStreamDestroy(s));
    CK(cudaStreamDestroy(other));
    printf("sync_cost ok\n");
    return 0;
}
