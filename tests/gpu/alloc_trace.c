/* An LD_PRELOAD logger of a real program's allocation calls (test equipment, never shipped):
 * every cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync and the synchronizations and event
 * calls that order them, one line each, to ALLOC_TRACE (a path; default stderr), written at exit.
 * Lines: "T_NS TID OP ARGS... [DUR_NS]" with T_NS on CLOCK_MONOTONIC from the first call, TID a
 * small thread number, pointers and streams in hex; a synchronization also gives how long it
 * waited (how far the GPU lagged behind the host).  tests/unit/test_trace_replay.c replays such
 * a trace over the emulated driver, with the GPU's lag played by FAKECUDA_EVENT_DELAY_US.
 * Built like the shim, without linking libcudart: the real functions come from RTLD_NEXT. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void *cudaMemPool_t;

#define EXPORT __attribute__((visibility("default")))

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char *buf;
static size_t len, cap;
static uint64_t t0;
static int next_tid;
static __thread int tid;

static uint64_t now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void line(uint64_t t, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n <= 0) return;
    pthread_mutex_lock(&lock);
    if (!tid) tid = ++next_tid;
    if (!t0) t0 = t;
    if (len + (size_t)n + 48 > cap) {
        size_t c = cap ? cap * 2 : 1u << 24;
        char *b = realloc(buf, c);
        if (!b) {
            pthread_mutex_unlock(&lock);
            return;
        }
        buf = b;
        cap = c;
    }
    len += (size_t)snprintf(buf + len, cap - len, "%llu %d ", (unsigned long long)(t - t0), tid);
    memcpy(buf + len, tmp, (size_t)n);
    len += (size_t)n;
    buf[len++] = '\n';
    pthread_mutex_unlock(&lock);
}

__attribute__((destructor)) static void flush_trace(void)
{
    const char *path = getenv("ALLOC_TRACE");
    FILE *f = path && *path ? fopen(path, "w") : stderr;
    if (!f) return;
    pthread_mutex_lock(&lock);
    fwrite(buf, 1, len, f);
    pthread_mutex_unlock(&lock);
    if (f != stderr) fclose(f);
}

#define REAL(name, params)                                                                                 \
    static cudaError_t(*real_) params;                                                                 \
    if (!real_) *(void **)&real_ = dlsym(RTLD_NEXT, name)

EXPORT cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s)
{
    REAL("cudaMallocAsync", (void **, size_t, cudaStream_t));
    cudaError_t rc = real_(p, size, s);
    line(now(), "ma %p %zu %p %d", rc ? NULL : *p, size, s, rc);
    return rc;
}

EXPORT cudaError_t cudaFreeAsync(void *p, cudaStream_t s)
{
    REAL("cudaFreeAsync", (void *, cudaStream_t));
    line(now(), "fa %p %p", p, s);
    return real_(p, s);
}

EXPORT cudaError_t cudaMalloc(void **p, size_t size)
{
    REAL("cudaMalloc", (void **, size_t));
    cudaError_t rc = real_(p, size);
    line(now(), "m %p %zu %d", rc ? NULL : *p, size, rc);
    return rc;
}

EXPORT cudaError_t cudaFree(void *p)
{
    REAL("cudaFree", (void *));
    line(now(), "f %p", p);
    return real_(p);
}

EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    REAL("cudaStreamSynchronize", (cudaStream_t));
    uint64_t t = now();
    cudaError_t rc = real_(s);
    line(t, "ss %p %llu", s, (unsigned long long)(now() - t));
    return rc;
}

EXPORT cudaError_t cudaDeviceSynchronize(void)
{
    REAL("cudaDeviceSynchronize", (void));
    uint64_t t = now();
    cudaError_t rc = real_();
    line(t, "ds %llu", (unsigned long long)(now() - t));
    return rc;
}

EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    REAL("cudaEventSynchronize", (cudaEvent_t));
    uint64_t t = now();
    cudaError_t rc = real_(e);
    line(t, "es %p %llu", e, (unsigned long long)(now() - t));
    return rc;
}

EXPORT cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    REAL("cudaEventRecord", (cudaEvent_t, cudaStream_t));
    line(now(), "er %p %p", e, s);
    return real_(e, s);
}

EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    REAL("cudaStreamWaitEvent", (cudaStream_t, cudaEvent_t, unsigned));
    line(now(), "we %p %p", s, e);
    return real_(s, e, flags);
}

EXPORT cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t keep)
{
    REAL("cudaMemPoolTrimTo", (cudaMemPool_t, size_t));
    line(now(), "trim %zu", keep);
    return real_(pool, keep);
}

EXPORT cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, int attr, void *value)
{
    REAL("cudaMemPoolSetAttribute", (cudaMemPool_t, int, void *));
    /* "pa2": the value as its type has it (a cuuint64_t threshold, an int reuse policy); older
     * traces' "pa" lines logged every policy as 0 */
    line(now(), "pa2 %d %llu", attr, attr == 4 /* release threshold */ ? *(unsigned long long *)value
                                                                      : (unsigned long long)*(int *)value);
    return real_(pool, attr, value);
}
