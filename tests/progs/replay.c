/* Replays a real program's allocation trace (tests/gpu/alloc_trace.c's lines) through the CUDA
 * runtime: every cudaMallocAsync / cudaFreeAsync / cudaMalloc / cudaFree in order, each on a
 * stream of its own for each stream the program used (the default stream as itself), the events
 * it recorded and the stream waits on them (which order its streams' frees and allocations), the
 * stream, event and device synchronizations where the program made them, and the default pool's
 * attributes as it set them.  Run under the shim over the emulated driver with FAKECUDA_EVENT_DELAY_US, it plays
 * the program on a GPU that lags behind the host.  REPLAY_SYNC_EVERY=N adds a stream
 * synchronization every N calls (a training loop reading its loss).  Prints
 * "R replay calls=N live_peak=B reserved_high=B used_high=B fail=N" (the default pool's figures).
 * A TRACE ending in .gz is read through gzip.  traces/ holds real programs' traces. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uthash.h>

typedef struct {
    unsigned long long from;
    void *to;
    size_t size;
    UT_hash_handle hh;
} ptr_map;

static ptr_map *live;

/* The program's streams and events, each replayed by one of this process's own. */
typedef struct {
    unsigned long long from;
    void *to;
    UT_hash_handle hh;
} handle_map;

static handle_map *streams, *events;

static void *mapped(handle_map **table, unsigned long long from, int stream)
{
    if (!from) return NULL;
    handle_map *m = NULL;
    HASH_FIND(hh, *table, &from, sizeof from, m);
    if (m) return m->to;
    m = calloc(1, sizeof *m);
    m->from = from;
    if (stream) cudaStreamCreateWithFlags((cudaStream_t *)&m->to, cudaStreamNonBlocking);
    else cudaEventCreate((cudaEvent_t *)&m->to);
    HASH_ADD(hh, *table, from, sizeof m->from, m);
    return m->to;
}

/* A pointer, stream or event of the trace: hex, or "(nil)" (0). */
static int handle_at(const char **rest, unsigned long long *v)
{
    int used = 0;
    *v = 0;
    if (sscanf(*rest, " (nil)%n", &used) == 0 && used) {
        *rest += used;
        return 1;
    }
    if (sscanf(*rest, " %llx%n", v, &used) == 1) {
        *rest += used;
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: replay TRACE\n");
        return 2;
    }
    size_t n = strlen(argv[1]);
    char cmd[4200];
    int gz = n > 3 && !strcmp(argv[1] + n - 3, ".gz");
    if (gz) snprintf(cmd, sizeof cmd, "gzip -dc '%s'", argv[1]);
    FILE *f = gz ? popen(cmd, "r") : fopen(argv[1], "r");
    if (!f) {
        perror(argv[1]);
        return 2;
    }
    const char *every_s = getenv("REPLAY_SYNC_EVERY");
    long every = every_s ? atol(every_s) : 0;
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, 0) != cudaSuccess) {
        fprintf(stderr, "replay: no default pool\n");
        return 1;
    }
    char line[512], op[16];
    unsigned long long t, a;
    int tid;
    long calls = 0, fails = 0;
    size_t live_bytes = 0, live_peak = 0;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "%llu %d %15s", &t, &tid, op) != 3) continue;
        const char *rest = line;
        for (int k = 0; k < 3 && rest; k++) rest = strchr(rest + (k > 0), ' ');
        if (!rest) rest = "";
        int async = !strcmp(op, "ma") || !strcmp(op, "fa");
        if (!strcmp(op, "ma") || !strcmp(op, "m")) {
            unsigned long long size, s = 0;
            if (!strncmp(rest, " (nil)", 6)) continue; /* it failed natively too */
            if (!handle_at(&rest, &a) || sscanf(rest, " %llu%n", &size, &(int){0}) != 1) continue;
            if (async) {
                int used = 0;
                (void)sscanf(rest, " %*u%n", &used);
                rest += used;
                handle_at(&rest, &s);
            }
            void *q = NULL;
            cudaError_t e = async ? cudaMallocAsync(&q, size, mapped(&streams, s, 1)) : cudaMalloc(&q, size);
            calls++;
            if (e != cudaSuccess) {
                fails++;
                continue;
            }
            ptr_map *m = malloc(sizeof *m);
            m->from = a;
            m->to = q;
            m->size = size;
            HASH_ADD(hh, live, from, sizeof m->from, m);
            live_bytes += size;
            if (live_bytes > live_peak) live_peak = live_bytes;
        } else if (!strcmp(op, "fa") || !strcmp(op, "f")) {
            unsigned long long s = 0;
            if (!handle_at(&rest, &a)) continue;
            if (async) handle_at(&rest, &s);
            ptr_map *m = NULL;
            HASH_FIND(hh, live, &a, sizeof a, m);
            if (!m) continue;
            if (async) cudaFreeAsync(m->to, mapped(&streams, s, 1));
            else cudaFree(m->to);
            calls++;
            live_bytes -= m->size;
            HASH_DEL(live, m);
            free(m);
        } else if (!strcmp(op, "ss")) {
            unsigned long long s = 0;
            handle_at(&rest, &s);
            cudaStreamSynchronize(mapped(&streams, s, 1));
        } else if (!strcmp(op, "er")) {
            unsigned long long e = 0, s = 0;
            if (handle_at(&rest, &e) && handle_at(&rest, &s) && e)
                cudaEventRecord(mapped(&events, e, 0), mapped(&streams, s, 1));
        } else if (!strcmp(op, "we")) {
            unsigned long long s = 0, e = 0;
            if (handle_at(&rest, &s) && handle_at(&rest, &e) && e)
                cudaStreamWaitEvent(mapped(&streams, s, 1), mapped(&events, e, 0), 0);
        } else if (!strcmp(op, "es")) {
            unsigned long long e = 0;
            if (handle_at(&rest, &e) && e) cudaEventSynchronize(mapped(&events, e, 0));
        } else if (!strcmp(op, "ds")) {
            cudaDeviceSynchronize();
        } else if (!strcmp(op, "pa") || !strcmp(op, "pa2")) {
            /* "pa" lines logged a reuse policy's value as 0 whatever it was (the logger before
             * "pa2"): only their release threshold is replayed */
            int attr;
            unsigned long long v;
            if (sscanf(rest, " %d %llu", &attr, &v) != 2) continue;
            if (attr == cudaMemPoolAttrReleaseThreshold) {
                cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &v);
            } else if (!strcmp(op, "pa2")) {
                int on = (int)v;
                cudaMemPoolSetAttribute(pool, (enum cudaMemPoolAttr)attr, &on);
            }
        }
        if (every && calls && calls % every == 0) cudaStreamSynchronize(0);
    }
    if (gz ? pclose(f) != 0 : fclose(f) != 0) {
        fprintf(stderr, "replay: reading %s failed\n", argv[1]);
        return 1;
    }
    unsigned long long reserved = 0, used = 0;
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved);
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used);
    printf("R replay calls=%ld live_peak=%zu reserved_high=%llu used_high=%llu fail=%ld\n", calls, live_peak, reserved,
           used, fails);
    return 0;
}
