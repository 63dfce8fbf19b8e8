/* The allocation benchmark of `make bench-gpu`: tests/gpu/bench.sh runs it natively and under the
 * shim, alternating, and turns its lines into the shim/native table.  argv[1] picks the mode:
 *   churn  same-size allocate+free pairs, then mixed-size churn (cudaMalloc and cudaMallocAsync)
 *   many   N live 4 KiB / 1 MiB cudaMallocs: device bytes used, failures, registry records
 *   oom    cudaMalloc until the first failure: bytes reached, records flagged not exportable
 *   align  alignment and spacing of 32 live blocks per size (cudaMalloc, cudaMallocAsync)
 * Each result is one line "R <case> key=value ..." (the only format bench.sh reads); "#" lines
 * are commentary, "P" lines the phases of BENCH_PHASES (churn only).  Random sizes come from fixed seeds, so native and shim runs ask for the same
 * sequence.  It links the client library to count this process's registry records, which exist
 * only under the shim: a native run prints records=na.  Every sub-case stops at a deadline
 * (BENCH_CASE_SECONDS, default per mode) and says so, so a slow case cannot starve the others. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <vmmshim.h>

#define KiB (1ull << 10)
#define MiB (1ull << 20)
#define GiB (1ull << 30)

static double case_seconds; /* per sub-case; 0 until main picks the mode's default */

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* splitmix64: tiny, and the same sequence on every machine and libc. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Log-uniform over [256 B, 256 MiB): as many tiny requests as huge ones, as in real programs. */
static size_t mixed_size(uint64_t *s)
{
    double u = (double)(rng_next(s) >> 11) * 0x1.0p-53;
    return (size_t)exp2(8.0 + 20.0 * u);
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (!p) {
        fprintf(stderr, "bench: out of host memory for %zu entries\n", n);
        exit(1);
    }
    return p;
}

/* ---- this process's registry records (only a shim run has a registry to read) ---- */

typedef struct {
    uint32_t pid;
    unsigned long long total, exportable;
} rec_count;

static int count_record(void *ctx, const vmm_alloc_info *a)
{
    rec_count *c = ctx;
    if (a->pid == c->pid) {
        c->total++;
        if (a->handle_kinds != 0) c->exportable++;
    }
    return 0;
}

/* "records=T exportable=E notexp=N", or all three na when there is no registry to read. */
static void records(char *out, size_t len)
{
    vmm_registry *reg;
    rec_count c = {.pid = (uint32_t)getpid()};
    if (vmm_open(NULL, &reg) != VMM_OK) {
        snprintf(out, len, "records=na exportable=na notexp=na");
        return;
    }
    vmm_status st = vmm_foreach_alloc(reg, count_record, &c);
    vmm_close(reg);
    if (st != VMM_OK) snprintf(out, len, "records=na exportable=na notexp=na");
    else snprintf(out, len, "records=%llu exportable=%llu notexp=%llu", c.total, c.exportable, c.total - c.exportable);
}

/* ---- churn: same-size pairs, then mixed sizes ---- */

static const struct {
    size_t size;
    const char *name;
    int sync_pairs; /* a native 1 GiB cudaMalloc+cudaFree takes 1-2 ms: fewer of them */
} PAIRS[] = {{4 * KiB, "4KiB", 2000}, {2 * MiB, "2MiB", 2000}, {64 * MiB, "64MiB", 2000}, {1 * GiB, "1GiB", 500}};
enum { ASYNC_PAIRS = 2000, MAX_PAIRS = 2000, WARM_PAIRS = 20 };

static void churn_same(int async, cudaStream_t s)
{
    double *t = xcalloc(MAX_PAIRS, sizeof *t);
    for (size_t k = 0; k < sizeof PAIRS / sizeof PAIRS[0]; k++) {
        int n = async ? ASYNC_PAIRS : PAIRS[k].sync_pairs, done = 0, fails = 0, timed_out = 0;
        double deadline = now_us() + case_seconds * 1e6;
        for (int i = -WARM_PAIRS; i < n; i++) {
            void *p = NULL;
            double t0 = now_us();
            cudaError_t e = async ? cudaMallocAsync(&p, PAIRS[k].size, s) : cudaMalloc(&p, PAIRS[k].size);
            if (e == cudaSuccess) e = async ? cudaFreeAsync(p, s) : cudaFree(p);
            double t1 = now_us();
            if (e != cudaSuccess) {
                fails++;
                cudaGetLastError();
            }
            if (i >= 0) t[done++] = t1 - t0;
            if (t1 > deadline) {
                timed_out = 1;
                break;
            }
        }
        if (async) cudaStreamSynchronize(s);
        printf("R pair/%s/%s us=%.3f pairs=%d fail=%d timeout=%d\n", async ? "async" : "sync", PAIRS[k].name,
               median(t, done), done, fails, timed_out);
        fflush(stdout);
    }
    free(t);
}

enum { MIX_LIVE = 64, MIX_WARM = 300, MIX_OPS = 6000 };

/* Each op frees a random live block when 64 are live or on a coin flip, else allocates one. */
static void churn_mixed(int async, cudaStream_t s)
{
    uint64_t rng = 0x5eed0001;
    void *live[MIX_LIVE];
    int n = 0, timed_out = 0, ops = 0;
    long n_alloc = 0, n_free = 0, fails = 0;
    double t_alloc = 0, t_free = 0, deadline = now_us() + case_seconds * 1e6;
    for (int op = -MIX_WARM; op < MIX_OPS; op++) {
        uint64_t r = rng_next(&rng);
        double t0, t1;
        cudaError_t e;
        if (n == MIX_LIVE || (n > 0 && (r & 1))) {
            int i = (int)((r >> 1) % (uint64_t)n);
            t0 = now_us();
            e = async ? cudaFreeAsync(live[i], s) : cudaFree(live[i]);
            t1 = now_us();
            live[i] = live[--n];
            if (op >= 0) {
                t_free += t1 - t0;
                n_free++;
            }
        } else {
            size_t size = mixed_size(&rng);
            void *p = NULL;
            t0 = now_us();
            e = async ? cudaMallocAsync(&p, size, s) : cudaMalloc(&p, size);
            t1 = now_us();
            if (e == cudaSuccess) live[n++] = p;
            if (op >= 0) {
                t_alloc += t1 - t0;
                n_alloc++;
            }
        }
        if (e != cudaSuccess) {
            if (op >= 0) fails++;
            cudaGetLastError();
        }
        if (op >= 0) ops++;
        if (t1 > deadline) {
            timed_out = 1;
            break;
        }
    }
    while (n > 0) {
        n--;
        if (async) cudaFreeAsync(live[n], s);
        else cudaFree(live[n]);
    }
    cudaDeviceSynchronize();
    printf("R mix/%s us=%.3f alloc_us=%.3f free_us=%.3f ops=%d fail=%ld timeout=%d\n", async ? "async" : "sync",
           ops ? (t_alloc + t_free) / ops : 0, n_alloc ? t_alloc / n_alloc : 0, n_free ? t_free / n_free : 0, ops,
           fails, timed_out);
    fflush(stdout);
}

/* ---- many: N live small allocations ---- */

static void many(void)
{
    static const size_t size[] = {4 * KiB, 1 * MiB};
    static const char *name[] = {"4KiB", "1MiB"};
    static const int count[] = {10000, 50000};
    void **p = xcalloc(50000, sizeof *p);
    for (int k = 0; k < 2; k++) {
        for (int c = 0; c < 2; c++) {
            int n = count[c], done = 0, fails = 0, timed_out = 0;
            size_t f0 = 0, f1 = 0, total = 0;
            char rec[128];
            cudaDeviceSynchronize();
            cudaMemGetInfo(&f0, &total);
            double deadline = now_us() + case_seconds * 1e6, t0 = now_us();
            for (int i = 0; i < n; i++) {
                if (cudaMalloc(&p[i], size[k]) != cudaSuccess) {
                    p[i] = NULL;
                    fails++;
                    cudaGetLastError();
                }
                done++;
                if ((i & 255) == 255 && now_us() > deadline) {
                    timed_out = 1;
                    break;
                }
            }
            double t1 = now_us();
            cudaDeviceSynchronize();
            cudaMemGetInfo(&f1, &total);
            records(rec, sizeof rec); /* while every block is still live */
            double t2 = now_us();
            for (int i = 0; i < done; i++)
                if (p[i]) cudaFree(p[i]);
            double t3 = now_us();
            cudaDeviceSynchronize();
            printf("R many/%s/%d bytes=%lld fail=%d us=%.3f free_us=%.3f calls=%d timeout=%d %s\n", name[k], n,
                   (long long)f0 - (long long)f1, fails, done ? (t1 - t0) / done : 0, done ? (t3 - t2) / done : 0,
                   done, timed_out, rec);
            fflush(stdout);
        }
    }
    free(p);
}

/* ---- oom: allocate until the first failure ---- */

static const struct {
    const char *name;
    size_t block;    /* 0: the mixed distribution */
    size_t headroom; /* the ballast leaves this much free; 0: no ballast */
} OOM[] = {{"4KiB", 4 * KiB, 2 * GiB}, {"1MiB", 1 * MiB, 8 * GiB}, {"64MiB", 64 * MiB, 0}, {"mix", 0, 8 * GiB}};

static void oom(void)
{
    for (size_t k = 0; k < sizeof OOM / sizeof OOM[0]; k++) {
        size_t free0 = 0, total = 0, ballast = 0, got = 0, n = 0;
        void *bp = NULL;
        int ballast_failed = 0;
        const char *stopped = "oom";
        cudaError_t err = cudaSuccess;
        char rec[128] = "records=na exportable=na notexp=na";
        cudaDeviceSynchronize();
        cudaMemGetInfo(&free0, &total);
        /* One big block first, so that reaching the end in 4 KiB steps takes half a million
         * calls instead of twenty million. */
        if (OOM[k].headroom && free0 > OOM[k].headroom + 2 * MiB) {
            ballast = (free0 - OOM[k].headroom) & ~(size_t)(2 * MiB - 1);
            if (cudaMalloc(&bp, ballast) != cudaSuccess) {
                cudaGetLastError();
                ballast_failed = 1;
                ballast = 0;
                bp = NULL;
            }
        }
        size_t room = OOM[k].headroom ? OOM[k].headroom : free0;
        /* Twice what should fit: a bound on time and memory if free memory is misreported. */
        size_t cap = OOM[k].block ? 2 * (room / OOM[k].block) + 1024 : 100000;
        void **p = xcalloc(cap, sizeof *p);
        uint64_t rng = 0x5eed0002;
        double deadline = now_us() + case_seconds * 1e6;
        if (ballast_failed) stopped = "ballast";
        while (!ballast_failed) {
            if (n == cap) {
                stopped = "cap";
                break;
            }
            size_t size = OOM[k].block ? OOM[k].block : mixed_size(&rng);
            if ((err = cudaMalloc(&p[n], size)) != cudaSuccess) {
                cudaGetLastError();
                break;
            }
            n++;
            got += size;
            if ((n & 1023) == 0 && now_us() > deadline) {
                stopped = "time";
                break;
            }
        }
        if (!ballast_failed) records(rec, sizeof rec); /* at the peak */
        for (size_t i = 0; i < n; i++) cudaFree(p[i]);
        if (bp) cudaFree(bp);
        cudaDeviceSynchronize();
        free(p);
        printf("R oom/%s reach=%zu ballast=%zu obtained=%zu blocks=%zu stopped=%s err=%d free0=%zu total=%zu %s\n",
               OOM[k].name, ballast_failed ? 0 : ballast + got, ballast, got, n, stopped, (int)err, free0, total, rec);
        fflush(stdout);
    }
}

/* ---- align: what alignment and spacing native cudaMalloc gives per size ---- */

static void align(cudaStream_t s)
{
    static const size_t sizes[] = {1,       100,     256,     257,     512,      513,     1000,   4096,    5000,
                                   65536,   MiB - 1, MiB,     MiB + 1, 2 * MiB,  3 * MiB, 10 * MiB, 64 * MiB + 1};
    enum { BLOCKS = 32 };
    for (int async = 0; async < 2; async++) {
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            void *p[BLOCKS];
            uint64_t a[BLOCKS], bits = 0, gap = 0;
            int got = 0, fails = 0;
            for (int i = 0; i < BLOCKS; i++) {
                void *q = NULL;
                if ((async ? cudaMallocAsync(&q, sizes[k], s) : cudaMalloc(&q, sizes[k])) != cudaSuccess) {
                    fails++;
                    cudaGetLastError();
                    continue;
                }
                p[got] = q;
                a[got++] = (uint64_t)(uintptr_t)q;
            }
            for (int i = 0; i < got; i++) bits |= a[i];
            uint64_t al = bits ? bits & (~bits + 1) : 2 * MiB; /* lowest set bit of every address */
            if (al > 2 * MiB) al = 2 * MiB;
            qsort(a, (size_t)got, sizeof *a, cmp_u64);
            for (int i = 1; i < got; i++)
                if (gap == 0 || a[i] - a[i - 1] < gap) gap = a[i] - a[i - 1];
            for (int i = 0; i < got; i++) {
                if (async) cudaFreeAsync(p[i], s);
                else cudaFree(p[i]);
            }
            cudaStreamSynchronize(s);
            printf("R align/%s/%zu align=%llu gap=%llu fail=%d\n", async ? "async" : "malloc", sizes[k],
                   (unsigned long long)al, (unsigned long long)gap, fails);
        }
    }
    fflush(stdout);
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    int known = !strcmp(mode, "churn") || !strcmp(mode, "many") || !strcmp(mode, "oom") || !strcmp(mode, "align");
    if (!known) {
        fprintf(stderr, "usage: bench churn|many|oom|align\n");
        return 2;
    }
    /* churn has ten sub-cases, many four, oom four: each mode's worst case stays near two minutes */
    case_seconds = !strcmp(mode, "churn") ? 10 : !strcmp(mode, "many") ? 25 : 30;
    const char *cs = getenv("BENCH_CASE_SECONDS");
    if (cs && *cs && atof(cs) > 0) case_seconds = atof(cs);
    cudaError_t e = cudaFree(0); /* start the context outside every timed region */
    cudaStream_t s;
    if (e == cudaSuccess) e = cudaStreamCreate(&s);
    if (e != cudaSuccess) {
        fprintf(stderr, "bench: cannot start CUDA (error %d)\n", (int)e);
        return 1;
    }
    printf("# bench %s pid %d\n", mode, (int)getpid());
    if (!strcmp(mode, "churn")) {
        /* BENCH_PHASES=N: the cases N times in this one process, each set after a line on stdin
         * ("P ready K" asks for it), so that bench.sh can attach a keeper for some of them and
         * compare the process with itself (processes of one machine differ by more than 2%). */
        const char *ph = getenv("BENCH_PHASES");
        int phases = ph && atoi(ph) > 1 && atoi(ph) <= 8 ? atoi(ph) : 1;
        if (phases > 1) { /* the shim makes its registry at the first allocation: there for a keeper */
            void *first = NULL;
            if (cudaMalloc(&first, 4 * KiB) == cudaSuccess) cudaFree(first);
        }
        for (int p = 0; p < phases; p++) {
            char go[16];
            if (phases > 1) {
                printf("P ready %d\n", p);
                fflush(stdout);
                if (!fgets(go, sizeof go, stdin)) break;
            }
            churn_same(0, s);
            churn_same(1, s);
            churn_mixed(0, s);
            churn_mixed(1, s);
        }
        if (phases > 1) printf("P done\n");
    } else if (!strcmp(mode, "many")) {
        many();
    } else if (!strcmp(mode, "oom")) {
        oom();
    } else {
        align(s);
    }
    cudaStreamDestroy(s);
    return 0;
}
