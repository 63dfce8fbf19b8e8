/* How much device memory a program holds, as the emulated driver counts it (phys_bytes_live), at
 * the moments the shim's pool promises to follow native (issue 15).  One "key value" line each:
 *   early_threshold_held          bytes a pool whose threshold was set to UINT64_MAX before any
 *                                 allocation keeps after a free and a synchronization (all 50 MiB)
 *   giveback_left / giveback_ms   bytes still held 2 s after a cudaFree with no further CUDA call,
 *                                 and when they went back (the shim: after VMMSHIM_GIVE_BACK_MS)
 *   large_free_left / small_free_left   bytes still held right after a cudaFree of 1 GiB (natively
 *                                 none: a neighbour may allocate it at once) and of 16 MiB
 *   large_pairs_purge_wakes       context switches of the shim's give-back thread over 50 pairs of
 *                                 1 GiB cudaMalloc + cudaFree (each free goes back whole: no deadline)
 *   sync_left                     bytes held right after cudaFreeAsync + cudaStreamSynchronize
 *                                 (release threshold 0: natively nothing stays)
 *   attr_used / attr_reserved     the default pool's UsedMemCurrent / ReservedMemCurrent with a
 *                                 100 MiB cudaMalloc block and an 8 MiB cudaMallocAsync block live
 *   trim_reserved / trim_extra    after freeing the async block, synchronize and TrimTo(0): the
 *                                 pool's reserved bytes, and bytes held beyond the cudaMalloc block
 *   unsynced_reserved / unsynced_extra   the same after cudaFreeAsync with no synchronization, the
 *                                 stream idle for 20 ms, then TrimTo(0): natively the driver sees the
 *                                 free has completed and gives its memory back
 *   trace_live_peak / trace_phys_peak   a transformer-like trace (varying sequence lengths,
 *                                 stream-ordered, release threshold UINT64_MAX as PyTorch sets it)
 *   trace_held / lowered_left     what that pool keeps once all is freed, and what stays after the
 *                                 threshold is lowered to 0 and the stream synchronized
 * Only meaningful over tests/fakecuda (the counters are its own). */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../fakecuda/fakecuda.h"

#define MiB (1ull << 20)

static fakecuda_counters_fn counters_fn;

static unsigned long long phys(void)
{
    struct fakecuda_counters c;
    counters_fn(&c);
    return c.phys_bytes_live;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void must(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        printf("error %s: %s\n", what, cudaGetErrorName(e));
        exit(1);
    }
}

static void giveback(void)
{
    void *p;
    unsigned long long base = phys();
    must(cudaMalloc(&p, 64 * MiB), "cudaMalloc");
    must(cudaFree(p), "cudaFree");
    double t0 = now_ms(), back = -1;
    while (now_ms() - t0 < 2000) { /* no CUDA call: only the shim's own thread may give it back */
        if (phys() <= base) {
            back = now_ms() - t0;
            break;
        }
        usleep(2000);
    }
    printf("giveback_left %llu\n", phys() - base);
    printf("giveback_ms %.0f\n", back);
}

/* Context switches so far of the shim's give-back thread ("vmmshim-purge"), 0 when it does not exist. */
static long purge_switches(void)
{
    char path[96], line[128];
    long n = 0;
    for (int tid = getpid(), last = tid + 4096; tid < last; tid++) {
        snprintf(path, sizeof path, "/proc/self/task/%d/comm", tid);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        int purge = fgets(line, sizeof line, f) && !strncmp(line, "vmmshim-purge", 13);
        fclose(f);
        if (!purge) continue;
        snprintf(path, sizeof path, "/proc/self/task/%d/status", tid);
        if (!(f = fopen(path, "r"))) continue;
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "voluntary_ctxt_switches:", 24) || !strncmp(line, "nonvoluntary_ctxt_switches:", 27))
                n += strtol(strchr(line, ':') + 1, NULL, 10);
        fclose(f);
    }
    return n;
}

static void free_at_once(void)
{
    void *p;
    unsigned long long base = phys();
    must(cudaMalloc(&p, 1024 * MiB), "cudaMalloc");
    must(cudaMemset(p, 1, 1024 * MiB), "cudaMemset");
    must(cudaFree(p), "cudaFree");
    printf("large_free_left %llu\n", phys() - base);
    /* a pair whose free goes back whole leaves the give-back thread no deadline: it must sleep on
     * rather than wake to contend for the shim's lock at every pair (natively there is no thread) */
    long before = purge_switches();
    for (int i = 0; i < 50; i++) {
        must(cudaMalloc(&p, 1024 * MiB), "cudaMalloc");
        must(cudaFree(p), "cudaFree");
    }
    printf("large_pairs_purge_wakes %ld\n", purge_switches() - before);
    must(cudaMalloc(&p, 16 * MiB), "cudaMalloc");
    must(cudaFree(p), "cudaFree");
    printf("small_free_left %llu\n", phys() - base);
    for (double t0 = now_ms(); phys() > base && now_ms() - t0 < 2000;) usleep(2000); /* the next cases start from nothing held */
}

static void sync_release(cudaStream_t s)
{
    void *p;
    unsigned long long base = phys();
    must(cudaMallocAsync(&p, 64 * MiB, s), "cudaMallocAsync");
    must(cudaFreeAsync(p, s), "cudaFreeAsync");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    printf("sync_left %llu\n", phys() - base);
}

static void attributes_and_trim(cudaStream_t s)
{
    cudaMemPool_t pool;
    must(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
    void *sync_block, *async_block;
    unsigned long long base = phys(), used = 0, reserved = 0;
    must(cudaMalloc(&sync_block, 100 * MiB), "cudaMalloc");
    must(cudaMallocAsync(&async_block, 8 * MiB, s), "cudaMallocAsync");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    must(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used), "UsedMemCurrent");
    must(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved), "ReservedMemCurrent");
    printf("attr_used %llu\nattr_reserved %llu\n", used, reserved);
    uint64_t keep = UINT64_MAX; /* nothing goes back at the synchronization: only the trim may */
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    must(cudaFreeAsync(async_block, s), "cudaFreeAsync");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    must(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
    must(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved), "ReservedMemCurrent");
    printf("trim_reserved %llu\ntrim_extra %llu\n", reserved, phys() - base - 100 * MiB);
    keep = 0;
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    must(cudaFree(sync_block), "cudaFree");
}

/* cudaFreeAsync, nothing synchronized, the stream idle: a trim finds the free completed. */
static void trim_unsynced(cudaStream_t s)
{
    cudaMemPool_t pool;
    must(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
    uint64_t keep = UINT64_MAX;
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    unsigned long long base = phys(), reserved = 0;
    void *p;
    must(cudaMallocAsync(&p, 24 * MiB, s), "cudaMallocAsync");
    must(cudaFreeAsync(p, s), "cudaFreeAsync");
    usleep(20000);
    must(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
    must(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved), "ReservedMemCurrent");
    printf("unsynced_reserved %llu\nunsynced_extra %lld\n", reserved, (long long)(phys() - base));
    keep = 0;
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

/* Six layers whose activations scale with a sequence length drawn per step, freed in reverse
 * order after the "backward", over long-lived weights: the shape that split the old pool's chunks. */
static void trace(cudaStream_t s)
{
    cudaMemPool_t pool;
    must(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
    uint64_t keep = UINT64_MAX;
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    enum { LAYERS = 6, PER_LAYER = 4, STEPS = 60 };
    unsigned long long base = phys(), live = 0, live_peak = 0, phys_peak = 0;
    void *weights[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        must(cudaMallocAsync(&weights[l], 48 * MiB + 4096u * (unsigned)l, s), "weights");
        live += 48 * MiB + 4096u * (unsigned)l;
    }
    srand(7);
    for (int step = 0; step < STEPS; step++) {
        unsigned long long seq = 64 + (unsigned long long)(rand() % 449); /* 64..512 */
        void *act[LAYERS * PER_LAYER];
        size_t sz[LAYERS * PER_LAYER];
        for (int i = 0; i < LAYERS * PER_LAYER; i++) {
            sz[i] = i % PER_LAYER == 3 ? seq * seq * 64 : seq * 24 * 1024 * (1 + i % PER_LAYER); /* attention, mlp */
            must(cudaMallocAsync(&act[i], sz[i], s), "activation");
            live += sz[i];
            if (live > live_peak) live_peak = live;
            if (phys() - base > phys_peak) phys_peak = phys() - base;
        }
        for (int i = LAYERS * PER_LAYER; i--;) {
            must(cudaFreeAsync(act[i], s), "activation free");
            live -= sz[i];
        }
        if (step % 10 == 9) must(cudaStreamSynchronize(s), "step sync");
    }
    for (int l = 0; l < LAYERS; l++) must(cudaFreeAsync(weights[l], s), "weights free");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    printf("trace_live_peak %llu\ntrace_phys_peak %llu\n", live_peak, phys_peak);
    printf("trace_held %llu\n", phys() - base); /* threshold UINT64_MAX: the pool keeps it */
    keep = 0; /* natively the next synchronization releases what lies beyond the lower threshold */
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    printf("lowered_left %lld\n", (long long)(phys() - base)); /* below 0: memory held before the trace went too */
    must(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
}

/* PyTorch and CuPy set the release threshold before their first allocation: it must hold. */
static void early_threshold(cudaStream_t s)
{
    cudaMemPool_t pool;
    void *p;
    uint64_t keep = UINT64_MAX;
    must(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    unsigned long long base = phys();
    must(cudaMallocAsync(&p, 50 * MiB, s), "cudaMallocAsync");
    must(cudaFreeAsync(p, s), "cudaFreeAsync");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    printf("early_threshold_held %llu\n", phys() - base);
    keep = 0;
    must(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "ReleaseThreshold");
    must(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

int main(void)
{
    void *sym = dlsym(RTLD_DEFAULT, "fakecuda_counters");
    if (!sym) {
        printf("error: not over the emulated driver\n");
        return 2;
    }
    *(void **)&counters_fn = sym;
    cudaStream_t s;
    must(cudaFree(0), "cudaFree(0)");
    must(cudaStreamCreate(&s), "cudaStreamCreate");
    early_threshold(s); /* first: before any allocation started the shim */
    giveback();
    free_at_once();
    sync_release(s);
    attributes_and_trim(s);
    trim_unsynced(s);
    trace(s);
    must(cudaStreamDestroy(s), "cudaStreamDestroy");
    printf("end_left %llu\n", phys());
    return 0;
}
