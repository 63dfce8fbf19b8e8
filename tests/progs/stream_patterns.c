/* The two multi-stream patterns of issue 38, with stream-ordered memory only, for a run under the
 * shim over the emulated driver with the GPU lagging (FAKECUDA_EVENT_DELAY_US):
 *   turns  three streams in turn, each allocating 64 MiB, touching it and freeing it;
 *   fsdp   FSDP's shape: a 64 MiB buffer made on a gather stream and used on the compute stream
 *          after an event, freed on the gather stream once that waited on the compute stream,
 *          then 64 MiB allocated, touched and freed on the compute stream.
 * STREAM_PATTERNS_ROUNDS (24) rounds each, no synchronization inside (the 256 MiB shows the
 * same; 64 MiB keeps the emulated device's memory, which the touches write, small).  Prints "R pattern=P rounds=N live_peak=B
 * reserved_high=B" with the default pool's ReservedMemHigh as a program reads it (the high-water
 * mark reset before each pattern).  STREAM_PATTERNS_NO_INTERNAL=1 first turns the default pool's
 * cudaMemPoolReuseAllowInternalDependencies off. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#define MIB (1ull << 20)
#define BYTES (64 * MIB)

static cudaMemPool_t pool;
static int ROUNDS = 24;

static void report(const char *name)
{
    unsigned long long high = 0;
    cudaDeviceSynchronize();
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &high);
    printf("R pattern=%s rounds=%d live_peak=%llu reserved_high=%llu\n", name, ROUNDS, BYTES, high);
    unsigned long long zero = 0;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
}

int main(void)
{
    const char *rounds = getenv("STREAM_PATTERNS_ROUNDS");
    if (rounds && atoi(rounds) > 0) ROUNDS = atoi(rounds);
    cudaDeviceGetDefaultMemPool(&pool, 0);
    unsigned long long keep = ~0ull, zero = 0;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep); /* as PyTorch and CuPy set it */
    const char *no_internal = getenv("STREAM_PATTERNS_NO_INTERNAL");
    if (no_internal && *no_internal == '1') {
        int off = 0;
        cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &off);
    }
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
    cudaStream_t s[3];
    for (int i = 0; i < 3; i++) cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking);
    for (int r = 0; r < ROUNDS; r++) {
        void *p;
        cudaStream_t t = s[r % 3];
        if (cudaMallocAsync(&p, BYTES, t) != cudaSuccess) return 1;
        cudaMemsetAsync(p, r, BYTES, t);
        cudaFreeAsync(p, t);
    }
    report("turns");
    cudaStream_t gather = s[0], compute = s[1];
    cudaEvent_t gathered, used;
    cudaEventCreate(&gathered);
    cudaEventCreate(&used);
    for (int r = 0; r < ROUNDS; r++) {
        void *buf, *x;
        if (cudaMallocAsync(&buf, BYTES, gather) != cudaSuccess) return 1;
        cudaMemsetAsync(buf, r, BYTES, gather);
        cudaEventRecord(gathered, gather);
        cudaStreamWaitEvent(compute, gathered, 0);
        cudaMemsetAsync(buf, r + 1, BYTES, compute);
        cudaEventRecord(used, compute);
        cudaStreamWaitEvent(gather, used, 0);
        cudaFreeAsync(buf, gather);
        if (cudaMallocAsync(&x, BYTES, compute) != cudaSuccess) return 1;
        cudaMemsetAsync(x, r, BYTES, compute);
        cudaFreeAsync(x, compute);
    }
    report("fsdp");
    return 0;
}
