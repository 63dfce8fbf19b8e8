/* The CUDA side of the memory rows of `make bench-gpu` (issue 15): tests/gpu/bench_mem.py runs it
 * natively and under the shim, alternating, while it samples the device's used memory through NVML
 * from its own process (never cudaMemGetInfo here: under the shim that hides what the pool holds).
 * argv[1] picks the mode:
 *   mixed sync|async     mixed-size churn, 256 B..256 MiB, at most 64 live (bench.c's sequence),
 *                        pausing at every new live peak so a 2 ms sampler sees it; then the last
 *                        live set held through a settle and a steady window
 *   giveback sync|async  BENCH_GIVEBACK_FRACTION (0.6) of the device's memory allocated and filled,
 *                        then cudaFree (sync) or cudaFreeAsync + cudaStreamSynchronize +
 *                        cudaMemPoolTrimTo(pool, 0) (async); the moment that returns, a neighbour
 *                        (this program again, started before with its own context and no
 *                        LD_PRELOAD) allocates the same bytes with cudaMalloc; then no CUDA call
 *                        at all while the sampler watches the memory come back
 *   neighbour            that neighbour: answers a line "BYTES" on stdin with "ok=0|1 err=E
 *                        free=F ms=T" (cudaMemGetInfo's free bytes just before its cudaMalloc)
 *   pool                 a mixed async workload on the default pool with the release threshold at
 *                        UINT64_MAX (as PyTorch and CuPy set it): ReservedMemCurrent and
 *                        UsedMemCurrent with the live set held, then after freeing everything,
 *                        synchronize and TrimTo(0)
 *   coloc IDX CAP GOFILE one of several processes sharing the GPU: waits for GOFILE, then churns
 *                        mixed sizes (any number live) with the live bytes climbing to CAP and
 *                        then kept between 7/8 of it and all of it (even IDX cudaMalloc/cudaFree,
 *                        odd IDX cudaMallocAsync/cudaFreeAsync) for BENCH_COLOC_SECONDS (5), and
 *                        counts the allocations that failed
 * Output: "M name t=SECONDS" marks (CLOCK_MONOTONIC, the clock Python's time.monotonic() reads,
 * so the sampler's timestamps line up) and one "R case key=value ..." line.  Sizes come from fixed
 * seeds, so native and shim ask for the same sequence. */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MiB (1ull << 20)
#define GiB (1ull << 30)

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void mark(const char *name)
{
    printf("M %s t=%.6f\n", name, now_s());
    fflush(stdout);
}

static void sleep_ms(double ms)
{
    struct timespec t = {(time_t)(ms / 1000), (long)(fmod(ms, 1000) * 1e6)};
    while (nanosleep(&t, &t) == -1 && errno == EINTR) {
    }
}

static double env_ms(const char *name, double dflt)
{
    const char *v = getenv(name);
    return v && *v && atof(v) >= 0 ? atof(v) : dflt;
}

/* splitmix64 and the log-uniform size of bench.c: the same sequence on every machine. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t mixed_size(uint64_t *s)
{
    double u = (double)(rng_next(s) >> 11) * 0x1.0p-53;
    return (size_t)exp2(8.0 + 20.0 * u);
}

static cudaError_t dalloc(int async, void **p, size_t n, cudaStream_t s)
{
    return async ? cudaMallocAsync(p, n, s) : cudaMalloc(p, n);
}

static cudaError_t dfree(int async, void *p, cudaStream_t s)
{
    return async ? cudaFreeAsync(p, s) : cudaFree(p);
}

enum { LIVE = 64 };

/* ---- mixed: NVML peak against the live peak ---- */

static int mixed(int async, cudaStream_t s)
{
    enum { WARM = 300, OPS = 6000 };
    uint64_t rng = 0x5eed0001;
    void *live[LIVE];
    size_t sz[LIVE], cur = 0, peak = 0;
    int n = 0, peaks = 0;
    long fails = 0;
    double pause = env_ms("BENCH_PEAK_PAUSE_MS", 6);
    mark("ready");
    sleep_ms(150);
    mark("start");
    for (int op = -WARM; op < OPS; op++) {
        uint64_t r = rng_next(&rng);
        if (n == LIVE || (n > 0 && (r & 1))) {
            int i = (int)((r >> 1) % (uint64_t)n);
            if (dfree(async, live[i], s) != cudaSuccess) cudaGetLastError();
            cur -= sz[i];
            live[i] = live[--n];
            sz[i] = sz[n];
        } else {
            size_t size = mixed_size(&rng);
            void *p = NULL;
            if (dalloc(async, &p, size, s) != cudaSuccess) {
                fails++;
                cudaGetLastError();
                continue;
            }
            live[n] = p;
            sz[n++] = size;
            cur += size;
            if (cur > peak) {
                peak = cur;
                peaks++;
                if (async) cudaStreamSynchronize(s);
                sleep_ms(pause); /* at least two samples of every new peak */
            }
        }
    }
    cudaStreamSynchronize(s);
    cudaDeviceSynchronize();
    mark("settle"); /* the live set stays; what was freed may take the give-back delay to go */
    sleep_ms(env_ms("BENCH_SETTLE_MS", 600));
    mark("steady_begin");
    sleep_ms(300);
    mark("steady_end");
    printf("R mixed/%s live_peak=%zu final_live=%zu final_blocks=%d peaks=%d fail=%ld\n", async ? "async" : "sync", peak,
           cur, n, peaks, fails);
    fflush(stdout);
    while (n > 0) dfree(async, live[--n], s);
    cudaDeviceSynchronize();
    return 0;
}

/* ---- giveback: when another process sees a freed 2.4 GiB free ---- */

/* The neighbour: a process of its own, started before the free, whose context is up. */
static int neighbour(void)
{
    char line[64];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    size_t bytes = (size_t)strtoull(line, NULL, 10), free_b = 0, total = 0;
    double t0 = now_s();
    cudaMemGetInfo(&free_b, &total);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    printf("ok=%d err=%d free=%zu ms=%.3f\n", e == cudaSuccess, (int)e, free_b, (now_s() - t0) * 1e3);
    fflush(stdout);
    if (e == cudaSuccess) cudaFree(p);
    return 0;
}

/* Starts the neighbour (this binary without LD_PRELOAD) before this process starts CUDA: a
 * process that forks after would hand the child a CUDA it cannot use. */
static pid_t neighbour_start(FILE **to, FILE **from)
{
    int in[2], out[2];
    if (pipe(in) || pipe(out)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[1]);
        close(out[0]);
        unsetenv("LD_PRELOAD");
        execl("/proc/self/exe", "bench_mem", "neighbour", (char *)NULL);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    *to = fdopen(in[1], "w");
    *from = fdopen(out[0], "r");
    return pid;
}

static FILE *nb_to, *nb_from;
static pid_t nb_pid = -1;

static int giveback(int async, cudaStream_t s)
{
    size_t free_b = 0, total = 0;
    cudaMemGetInfo(&free_b, &total); /* the device's size: its total is the same under the shim */
    double fraction = env_ms("BENCH_GIVEBACK_FRACTION", 0.6);
    size_t bytes = (size_t)((double)total * fraction) / (2 * MiB) * (2 * MiB);
    char line[256] = "";
    if (nb_pid > 0 && !fgets(line, sizeof line, nb_from)) nb_pid = -1; /* its context is up */
    void *p = NULL;
    mark("ready");
    sleep_ms(150);
    mark("before");
    cudaError_t e = dalloc(async, &p, bytes, s);
    if (e == cudaSuccess) e = cudaMemsetAsync(p, 0x5a, bytes, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) {
        printf("R giveback/%s bytes=%zu fail=1 err=%d\n", async ? "async" : "sync", bytes, (int)e);
        return 1;
    }
    mark("allocated");
    sleep_ms(200);
    mark("free_call");
    if (async) {
        cudaMemPool_t pool;
        int dev = 0;
        e = cudaFreeAsync(p, s);
        if (e == cudaSuccess) e = cudaStreamSynchronize(s);
        if (e == cudaSuccess) e = cudaGetDevice(&dev);
        if (e == cudaSuccess) e = cudaDeviceGetDefaultMemPool(&pool, dev);
        if (e == cudaSuccess) e = cudaMemPoolTrimTo(pool, 0);
    } else {
        e = cudaFree(p);
    }
    mark("freed");
    /* No CUDA call from here on: whatever gives the memory back must do it on its own, while a
     * neighbour allocates what was freed at once. */
    line[0] = 0;
    if (nb_pid > 0) {
        fprintf(nb_to, "%zu\n", bytes);
        fflush(nb_to);
        if (!fgets(line, sizeof line, nb_from)) line[0] = 0;
        line[strcspn(line, "\n")] = 0;
    }
    int nb_ok = -1, nb_err = 0;
    unsigned long long nb_free = 0;
    double nb_ms = 0;
    sscanf(line, "ok=%d err=%d free=%llu ms=%lf", &nb_ok, &nb_err, &nb_free, &nb_ms);
    mark("neighbour");
    sleep_ms(env_ms("BENCH_GIVEBACK_WAIT_MS", 1500));
    mark("end");
    printf("R giveback/%s bytes=%zu fail=0 err=%d neighbour_ok=%d neighbour_err=%d neighbour_free=%llu neighbour_ms=%.3f\n",
           async ? "async" : "sync", bytes, (int)e, nb_ok, nb_err, nb_free, nb_ms);
    fflush(stdout);
    return 0;
}

/* ---- pool: the default pool's own figures ---- */

static int pool_attrs(cudaMemPool_t pool, unsigned long long *reserved, unsigned long long *used)
{
    uint64_t r = 0, u = 0; /* the attributes are cuuint64_t, a 64-bit unsigned integer */
    cudaError_t e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &r);
    if (e == cudaSuccess) e = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &u);
    *reserved = r;
    *used = u;
    return e == cudaSuccess ? 0 : (int)e;
}

static int pool(cudaStream_t s)
{
    enum { OPS = 3000 };
    cudaMemPool_t mp;
    int dev = 0;
    uint64_t rng = 0x5eed0003, thr = UINT64_MAX;
    void *live[LIVE];
    size_t sz[LIVE], cur = 0;
    int n = 0;
    long fails = 0;
    unsigned long long r1, u1, r2, u2;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetDefaultMemPool(&mp, dev) != cudaSuccess ||
        cudaMemPoolSetAttribute(mp, cudaMemPoolAttrReleaseThreshold, &thr) != cudaSuccess) {
        printf("R pool fail=1 err=setup\n");
        return 1;
    }
    mark("ready");
    sleep_ms(150);
    for (int op = 0; op < OPS; op++) {
        uint64_t r = rng_next(&rng);
        if (n == LIVE || (n > 0 && (r & 1))) {
            int i = (int)((r >> 1) % (uint64_t)n);
            cudaFreeAsync(live[i], s);
            cur -= sz[i];
            live[i] = live[--n];
            sz[i] = sz[n];
        } else {
            size_t size = mixed_size(&rng);
            void *p = NULL;
            if (cudaMallocAsync(&p, size, s) != cudaSuccess) {
                fails++;
                cudaGetLastError();
                continue;
            }
            live[n] = p;
            sz[n++] = size;
            cur += size;
        }
        if ((op & 255) == 255) cudaStreamSynchronize(s);
    }
    cudaStreamSynchronize(s);
    int e1 = pool_attrs(mp, &r1, &u1);
    mark("held_begin");
    sleep_ms(300);
    mark("held_end");
    while (n > 0) cudaFreeAsync(live[--n], s);
    cudaStreamSynchronize(s);
    cudaMemPoolTrimTo(mp, 0);
    int e2 = pool_attrs(mp, &r2, &u2);
    mark("trimmed");
    sleep_ms(400); /* no CUDA call: NVML must already be back */
    mark("end");
    printf("R pool live=%zu reserved_held=%llu used_held=%llu reserved_trim=%llu used_trim=%llu fail=%ld err=%d\n", cur,
           r1, u1, r2, u2, fails, e1 ? e1 : e2);
    fflush(stdout);
    return 0;
}

/* ---- coloc: one of several processes on one GPU ---- */

enum { COLOC_LIVE = 8192 }; /* a tenth of 141 GB at the mean size (18.5 MiB) is ~760 blocks */

static int coloc(int idx, size_t cap, const char *gofile)
{
    int async = idx & 1;
    double secs = env_ms("BENCH_COLOC_SECONDS", 5);
    uint64_t rng = 0x5eed1000 + (uint64_t)idx;
    static void *live[COLOC_LIVE];
    static size_t sz[COLOC_LIVE];
    size_t cur = 0, peak = 0;
    int n = 0;
    long fails = 0, ops = 0, allocs = 0;
    cudaStream_t s;
    if (cudaStreamCreate(&s) != cudaSuccess) return 1;
    mark("ready");
    for (double t0 = now_s(); access(gofile, F_OK) != 0; sleep_ms(1))
        if (now_s() - t0 > 120) {
            fprintf(stderr, "bench_mem coloc %d: no start signal\n", idx);
            return 1;
        }
    mark("start");
    double end = now_s() + secs;
    while (now_s() < end) {
        uint64_t r = rng_next(&rng);
        size_t size = mixed_size(&rng);
        /* Free first when the table is full, to make room, or on a coin flip once over 7/8 of the
         * cap: the live bytes climb to the cap and then stay between 7/8 of it and all of it. */
        while (n > 0 && (n == COLOC_LIVE || cur + size > cap || (cur > cap - cap / 8 && (r & 1)))) {
            int i = (int)((r >> 1) % (uint64_t)n);
            r = rng_next(&rng);
            dfree(async, live[i], s);
            cur -= sz[i];
            live[i] = live[--n];
            sz[i] = sz[n];
        }
        if (cur + size > cap) continue;
        void *p = NULL;
        allocs++;
        cudaError_t e = dalloc(async, &p, size, s);
        if (e == cudaSuccess) e = cudaMemsetAsync(p, 1, size < 4096 ? size : 4096, s);
        if (e != cudaSuccess) {
            fails++;
            cudaGetLastError();
            if (p) dfree(async, p, s);
        } else {
            live[n] = p;
            sz[n++] = size;
            cur += size;
            if (cur > peak) peak = cur;
        }
        if ((++ops & 63) == 0) cudaStreamSynchronize(s);
    }
    cudaStreamSynchronize(s);
    mark("done");
    printf("R coloc/%d api=%s cap=%zu live_peak=%zu allocs=%ld fail=%ld\n", idx, async ? "async" : "sync", cap, peak,
           allocs, fails);
    fflush(stdout);
    while (n > 0) dfree(async, live[--n], s);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    return 0;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    const char *api = argc > 2 ? argv[2] : "";
    if (!strcmp(mode, "neighbour")) return neighbour();
    int ok = ((!strcmp(mode, "mixed") || !strcmp(mode, "giveback")) && (!strcmp(api, "sync") || !strcmp(api, "async"))) ||
             !strcmp(mode, "pool") || (!strcmp(mode, "coloc") && argc > 4);
    if (!ok) {
        fprintf(stderr, "usage: bench_mem mixed|giveback sync|async | pool | coloc IDX CAP_BYTES GOFILE\n");
        return 2;
    }
    if (!strcmp(mode, "giveback")) nb_pid = neighbour_start(&nb_to, &nb_from);
    cudaStream_t s;
    cudaError_t e = cudaFree(0); /* the context first: "ready" marks the level with it */
    if (e == cudaSuccess) e = cudaStreamCreate(&s);
    if (e != cudaSuccess) {
        fprintf(stderr, "bench_mem: cannot start CUDA (error %d)\n", (int)e);
        return 1;
    }
    int rc;
    if (!strcmp(mode, "mixed")) rc = mixed(!strcmp(api, "async"), s);
    else if (!strcmp(mode, "giveback")) rc = giveback(!strcmp(api, "async"), s);
    else if (!strcmp(mode, "pool")) rc = pool(s);
    else rc = coloc(atoi(argv[2]), (size_t)strtoull(argv[3], NULL, 10), argv[4]);
    cudaStreamDestroy(s);
    if (nb_pid > 0) {
        fclose(nb_to);
        waitpid(nb_pid, NULL, 0);
    }
    return rc;
}
