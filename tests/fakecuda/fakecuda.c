/* Emulated CUDA driver (build/fakecuda/libcuda.so.1): test equipment only, never installed.
 *
 * Device memory is host memory: cuMemAlloc is an anonymous mapping, cuMemCreate is a memfd,
 * cuMemMap maps that memfd MAP_SHARED|MAP_FIXED inside a PROT_NONE reservation, and
 * cuMemSetAccess is mprotect.  So exported POSIX file descriptors really share bytes across
 * processes, and touching memory before cuMemSetAccess really faults.  Copies and memsets are
 * synchronous; streams and events only model completion times (FAKECUDA_EVENT_DELAY_US, and
 * FAKECUDA_COPY_DELAY_US for copies).  Page-locked host memory (cuMemHostAlloc) is plain
 * anonymous memory, tracked so that cuMemFreeHost refuses anything else.
 *
 * Built with __CUDA_API_VERSION_INTERNAL so that cuda.h renames nothing: every function below
 * carries exactly the name that NVIDIA's libcuda.so.1 exports.  The control API and the
 * environment knobs are described in fakecuda.h.
 */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#include <ctype.h>
#include <dlfcn.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <uthash.h>

#include "fakecuda.h"

#define FC_API __attribute__((visibility("default")))
#define FC_GRAN ((size_t)2 << 20)
#define FC_MAX_DEV 8
#define FC_MAX_ALIGN ((size_t)1 << 40)
#define FC_DRIVER_VERSION 13000

typedef void (*fc_fn)(void);

/* ------------------------------------------------------------------------------------------ */
/* State                                                                                        */

struct fc_ctx {
    int dev;
    int prim_refs;
    unsigned peer_mask; /* devices whose memory this context may access (peer access enabled) */
};

typedef struct fc_handle {
    unsigned long long id;
    int fd;
    size_t size;
    int dev;
    int user_refs; /* cuMemCreate/Import/Retain minus cuMemRelease */
    int map_count; /* live cuMemMap ranges */
    unsigned long long types;
    int imported;
    size_t charged;
    UT_hash_handle hh;
} fc_handle;

/* A stream-ordered memory pool.  Allocations are cuMemAlloc blocks that remember their pool;
 * freed bytes stay reserved (and charged to the device) as the pool's idle memory until the
 * release threshold or cuMemPoolTrimTo lets them go.  The real driver releases at the next
 * synchronization; this one releases at the free itself, which no synchronized caller can tell
 * apart.  Access is the pool's table, which cuMemGetAccess reports for its allocations. */
typedef struct fc_pool {
    int dev;
    int destroyed; /* cuMemPoolDestroy with allocations still live: gone once they are freed */
    unsigned long long release_threshold;
    int reuse_follow_events, reuse_opportunistic, reuse_internal_deps;
    unsigned long long reserved, reserved_high, used, used_high;
    unsigned long long live; /* allocations not yet freed */
    unsigned char access[FC_MAX_DEV]; /* CU_MEM_ACCESS_FLAGS_* per device */
    struct fc_pool *next;             /* created pools (the defaults are g_default_pool) */
} fc_pool;

/* Reservations, mappings and cuMemAlloc blocks. */
typedef struct fc_range {
    uintptr_t base;
    size_t size;     /* reservation/mapping size; for cuMemAlloc the requested size */
    size_t map_len;  /* cuMemAlloc: bytes actually mapped */
    fc_handle *h;    /* mappings */
    size_t offset;   /* mappings */
    int prot;        /* mappings: current mprotect (the union of access[]: this process is every device) */
    unsigned char access[FC_MAX_DEV]; /* mappings: CU_MEM_ACCESS_FLAGS_* per device (cuMemSetAccess) */
    int dev;
    size_t charged;  /* cuMemAlloc */
    fc_pool *pool;   /* cuMemAlloc blocks from a memory pool */
    unsigned long long buffer_id;
    UT_hash_handle hh;
} fc_range;

typedef struct fc_stream {
    void *self;
    unsigned flags;
    int capturing;
    int invalidated; /* a capture broken by a synchronization, as the real driver breaks it */
    CUstreamCaptureMode mode;
    unsigned long long busy_until; /* CLOCK_MONOTONIC ns */
    UT_hash_handle hh;
} fc_stream;

typedef struct fc_event {
    void *self;
    unsigned flags;
    int recorded;
    unsigned long long done_at;
    unsigned long long copies; /* FAKECUDA_ASYNC_DEFER: the copies queued before its record */
    UT_hash_handle hh;
} fc_event;

/* An armed failure: calls of `name` (from an object named `caller`, when set) let `skip` pass,
 * then `remaining` fail with err. */
struct fc_fail {
    char name[64];
    char caller[64];
    int skip, remaining;
    CUresult err;
};

/* Calls of one entry point from one calling object (FAKECUDA_CALLS_AT_EXIT). */
struct fc_calls {
    char name[64];
    char caller[64];
    unsigned long long n;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_ndev = 1;
static unsigned long long g_budget = 8ULL << 30;
static int g_no_vmm;
static unsigned long long g_delay_us;
static unsigned long long g_copy_delay_us;
/* FAKECUDA_ASYNC_DEFER: asynchronous copies wait in this queue (under g_mu) for the next
 * synchronization, so a caller that skips one reads stale bytes or frees memory a copy still
 * needs (the real driver moves them at some time before then; this is the latest). */
typedef struct fc_pending {
    void *dst;
    const void *src;
    size_t n;
    unsigned long long seq;
    struct fc_pending *next;
} fc_pending;
static int g_async_defer;
static fc_pending *g_pending, **g_pending_tail = &g_pending;
static unsigned long long g_pending_seq; /* copies ever queued; an event's record notes it */
static void pending_flush(void);
static void pending_flush_through(unsigned long long seq);
static unsigned long long g_export_delay_us; /* each POSIX fd export takes this long (an H100: ~600) */
static unsigned long long g_unmap_delay_us;  /* each cuMemUnmap takes this long */
static unsigned long long g_access_delay_us; /* each cuMemSetAccess takes this long (FAKECUDA_ACCESS_DELAY_US) */
static unsigned long long g_register_delay_us; /* each cuMemHostRegister takes this long (FAKECUDA_HOST_REGISTER_DELAY_US) */
static unsigned long long g_registering;       /* cuMemHostRegister calls in flight */
static int g_initialized;
static unsigned long long g_used[FC_MAX_DEV];
static struct fc_ctx g_ctx[FC_MAX_DEV];
static struct fakecuda_counters g_cnt;
static char g_counters_path[4096];
static unsigned long long g_next_handle = 0xfc0001;
static unsigned long long g_next_buffer_id = 1;

static fc_handle *g_handles;
static fc_range *g_resv, *g_maps, *g_allocs, *g_host, *g_registered;
static fc_stream *g_streams;
static fc_event *g_events;
static fc_stream g_legacy_stream, g_ptds_stream;
static fc_pool g_default_pool[FC_MAX_DEV];
static fc_pool *g_current_pool[FC_MAX_DEV]; /* NULL: the default pool */
static fc_pool *g_pools;

static struct fc_fail g_fail[64];
static int g_fail_armed;
/* Calls are attributed to the object that made them only when something asks for it: dladdr
 * per call costs more than most emulated calls. */
static int g_attribute;
static char g_calls_path[4096];
static struct fc_calls g_calls[512];

static __thread CUcontext t_stack[64];
static __thread int t_depth;

static char g_dummy_graph;

/* Copies done, released after each: a device synchronization (cuCtxSynchronize) acquires it, so
 * that a copy one thread made is ordered before what another thread does after synchronizing, as
 * on a real device.  Without it ThreadSanitizer sees a race wherever the order came through
 * another process (the owner's thread writes, a companion asks over a socket, the shim's broker
 * thread synchronizes and reads: vmmctl pause). */
static unsigned long long g_copies_done;

#define LOCK() pthread_mutex_lock(&g_mu)
#define UNLOCK() pthread_mutex_unlock(&g_mu)
#define CNT_ADD(f, n) __atomic_add_fetch(&g_cnt.f, (unsigned long long)(n), __ATOMIC_RELAXED)
#define CNT_SUB(f, n) __atomic_sub_fetch(&g_cnt.f, (unsigned long long)(n), __ATOMIC_RELAXED)

static int sym_known(const char *base);

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                      */

static unsigned long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

static void sleep_until(unsigned long long t)
{
    for (;;) {
        unsigned long long n = now_ns();
        if (n >= t) return;
        unsigned long long d = t - n;
        struct timespec ts = {(time_t)(d / 1000000000ULL), (long)(d % 1000000000ULL)};
        nanosleep(&ts, NULL);
    }
}

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static int is_pow2(size_t v) { return v && !(v & (v - 1)); }

static CUcontext cur_ctx(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

static struct fc_ctx *ctx_of(CUcontext c)
{
    for (int i = 0; i < g_ndev; i++)
        if ((void *)c == (void *)&g_ctx[i]) return &g_ctx[i];
    return NULL;
}

static int dev_ok(CUdevice d) { return d >= 0 && d < g_ndev; }

static void base_name(const char *in, char *out, size_t n)
{
    snprintf(out, n, "%s", in);
    for (;;) {
        size_t l = strlen(out);
        if (l > 5 && (!strcmp(out + l - 5, "_ptsz") || !strcmp(out + l - 5, "_ptds")))
            out[l - 5] = 0;
        else if (l > 3 && out[l - 3] == '_' && out[l - 2] == 'v' && isdigit((unsigned char)out[l - 1]))
            out[l - 3] = 0;
        else
            break;
    }
}

static CUresult default_fail_error(const char *base)
{
    static const char *const oom[] = {"cuMemCreate", "cuMemAlloc", "cuMemAllocAsync", "cuMemAllocPitch",
                                      "cuMemAllocManaged"};
    for (size_t i = 0; i < sizeof oom / sizeof oom[0]; i++)
        if (!strcmp(base, oom[i])) return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_ERROR_UNKNOWN;
}

static void fail_recount(void) /* lock held */
{
    int armed = 0;
    for (size_t i = 0; i < sizeof g_fail / sizeof g_fail[0]; i++)
        if (g_fail[i].remaining > 0) armed++;
    __atomic_store_n(&g_fail_armed, armed, __ATOMIC_RELEASE);
}

/* The file name (no directory) of the object holding code address `at`: the calling library or
 * program, so a test can tell the shim's own calls from the program's. */
static void object_name(const void *at, char *out, size_t n)
{
    Dl_info di;
    const char *name = at && dladdr(at, &di) && di.dli_fname && *di.dli_fname ? di.dli_fname : "?";
    const char *slash = strrchr(name, '/');
    snprintf(out, n, "%s", slash ? slash + 1 : name);
}

static void count_call(const char *name, const char *caller) /* lock held */
{
    for (size_t i = 0; i < sizeof g_calls / sizeof g_calls[0]; i++) {
        struct fc_calls *c = &g_calls[i];
        if (!c->name[0]) {
            snprintf(c->name, sizeof c->name, "%s", name);
            snprintf(c->caller, sizeof c->caller, "%s", caller);
        }
        if (!strcmp(c->name, name) && !strcmp(c->caller, caller)) {
            c->n++;
            return;
        }
    }
}

static CUresult fail_check(const char *name, const void *caller_at)
{
    int attribute = __atomic_load_n(&g_attribute, __ATOMIC_RELAXED);
    if (!__atomic_load_n(&g_fail_armed, __ATOMIC_ACQUIRE) && !attribute) return CUDA_SUCCESS;
    char caller[64] = "";
    if (attribute) object_name(caller_at, caller, sizeof caller);
    CUresult r = CUDA_SUCCESS;
    LOCK();
    if (g_calls_path[0]) count_call(name, caller);
    for (size_t i = 0; i < sizeof g_fail / sizeof g_fail[0]; i++) {
        struct fc_fail *f = &g_fail[i];
        if (f->remaining <= 0 || strcmp(f->name, name) || (f->caller[0] && strcmp(f->caller, caller))) continue;
        if (f->skip > 0) {
            f->skip--;
            continue;
        }
        f->remaining--;
        r = f->err;
        fail_recount();
        break;
    }
    UNLOCK();
    if (r != CUDA_SUCCESS) CNT_ADD(failures_injected, 1);
    return r;
}

static CUresult fc_enter(const char *name, int need_init, const void *caller)
{
    CUresult r = fail_check(name, caller);
    if (r != CUDA_SUCCESS) return r;
    if (need_init && !__atomic_load_n(&g_initialized, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

/* Where an entry point returns to: its caller.  Taken in the exported function itself (a static
 * helper may not be inlined, and would see this library instead). */
#define FC_CALLER __builtin_return_address(0)
#define FC_ENTER_FROM(name, caller)                                                              \
    do {                                                                                         \
        CUresult fc_r_ = fc_enter(name, 1, caller);                                              \
        if (fc_r_ != CUDA_SUCCESS) return fc_r_;                                                 \
    } while (0)
#define FC_ENTER(name) FC_ENTER_FROM(name, FC_CALLER)
#define FC_ENTER_NOINIT(name)                                                                    \
    do {                                                                                         \
        CUresult fc_r_ = fc_enter(name, 0, FC_CALLER);                                           \
        if (fc_r_ != CUDA_SUCCESS) return fc_r_;                                                 \
    } while (0)

/* Anonymous mapping of len bytes aligned to align (over-reserve, then trim). */
static void *map_aligned(size_t len, size_t align, int prot)
{
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (align <= page) {
        void *p = mmap(NULL, len, prot, flags, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    if (len + align < len) return NULL;
    void *p = mmap(NULL, len + align, prot, flags, -1, 0);
    if (p == MAP_FAILED) return NULL;
    uintptr_t raw = (uintptr_t)p, start = (raw + align - 1) & ~(uintptr_t)(align - 1);
    if (start > raw) munmap(p, start - raw);
    uintptr_t end = start + len, raw_end = raw + len + align;
    if (raw_end > end) munmap((void *)end, raw_end - end);
    return (void *)start;
}

static int charge(int dev, size_t bytes) /* lock held; 0 or -1 */
{
    if (g_used[dev] + bytes < g_used[dev] || g_used[dev] + bytes > g_budget) return -1;
    g_used[dev] += bytes;
    CNT_ADD(phys_bytes_live, bytes);
    return 0;
}

static void uncharge(int dev, size_t bytes) /* lock held */
{
    g_used[dev] -= bytes;
    CNT_SUB(phys_bytes_live, bytes);
}

static fc_range *range_containing(fc_range *table, uintptr_t p, size_t len) /* lock held */
{
    fc_range *r, *tmp;
    HASH_ITER(hh, table, r, tmp) {
        if (p >= r->base && p - r->base < r->size && (len == 0 || len <= r->size - (p - r->base))) return r;
    }
    return NULL;
}

static int overlaps(fc_range *table, uintptr_t p, size_t len) /* lock held */
{
    fc_range *r, *tmp;
    HASH_ITER(hh, table, r, tmp) {
        if (p < r->base + r->size && r->base < p + len) return 1;
    }
    return 0;
}

static void handle_maybe_destroy(fc_handle *h) /* lock held */
{
    if (h->user_refs > 0 || h->map_count > 0) return;
    HASH_DEL(g_handles, h);
    close(h->fd);
    if (h->charged) uncharge(h->dev, h->charged);
    CNT_SUB(handles_live, 1);
    if (h->imported) CNT_SUB(imports_live, 1);
    free(h);
}

static fc_stream *stream_get(CUstream s) /* lock held */
{
    if (s == NULL || s == CU_STREAM_LEGACY) return &g_legacy_stream;
    if (s == CU_STREAM_PER_THREAD) return &g_ptds_stream;
    fc_stream *st;
    void *key = (void *)s;
    HASH_FIND_PTR(g_streams, &key, st);
    return st;
}

static fc_event *event_get(CUevent e) /* lock held */
{
    fc_event *ev;
    void *key = (void *)e;
    if (!key) return NULL;
    HASH_FIND_PTR(g_events, &key, ev);
    return ev;
}

/* ------------------------------------------------------------------------------------------ */
/* Load / unload                                                                                */

static unsigned long long parse_bytes(const char *s, int *ok)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    *ok = !errno && end != s;
    switch (*end) {
    case 'k': case 'K': v <<= 10; end++; break;
    case 'm': case 'M': v <<= 20; end++; break;
    case 'g': case 'G': v <<= 30; end++; break;
    case 't': case 'T': v <<= 40; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) *ok = 0;
    return v;
}

static int error_by_name(const char *s, CUresult *out);

static int fail_arm(const char *fn, const char *caller, int skip, int n, int cuda_error);

/* FAKECUDA_FAIL entries: fn[/caller][@k][:n[:err]] (fakecuda.h). */
static void parse_fail_env(const char *spec)
{
    char *copy = strdup(spec), *save = NULL;
    if (!copy) return;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char entry[256];
        snprintf(entry, sizeof entry, "%s", tok);
        char *fn = tok, *ns = strchr(tok, ':'), *es = NULL;
        if (ns) *ns++ = 0;
        char *at = strchr(fn, '@'), *caller = strchr(fn, '/'), *end;
        if (at) *at++ = 0;
        if (caller) *caller++ = 0;
        long n = 1, k = 1;
        int ok = (ns || at) && (!caller || *caller);
        if (ok && at) {
            k = strtol(at, &end, 10);
            ok = *at && !*end && k >= 1 && k <= INT_MAX;
        }
        if (ok && ns) {
            es = strchr(ns, ':');
            if (es) *es++ = 0;
            n = strtol(ns, &end, 10);
            ok = *ns && !*end && n >= 0 && n <= INT_MAX;
        }
        CUresult err = CUDA_SUCCESS;
        if (ok && es) {
            long e = strtol(es, &end, 0);
            if (*es && !*end && e >= 0) err = (CUresult)e;
            else ok = error_by_name(es, &err) == 0;
        }
        if (!ok || fail_arm(fn, caller ? caller : "", (int)k - 1, (int)n, (int)err) != 0)
            fprintf(stderr, "fakecuda: FAKECUDA_FAIL: ignoring '%s' (want fn[/caller][@k][:n[:err]])\n", entry);
    }
    free(copy);
}

static void fc_atfork_prepare(void) { LOCK(); }
static void fc_atfork_parent(void) { UNLOCK(); }
static void fc_atfork_child(void) { UNLOCK(); } /* the forking thread holds it, in the child too */

__attribute__((constructor)) static void fc_load(void)
{
    const char *s;
    int ok;
    if ((s = getenv("FAKECUDA_DEVICES")) && *s) {
        long n = strtol(s, NULL, 10);
        g_ndev = n < 0 ? 0 : n > FC_MAX_DEV ? FC_MAX_DEV : (int)n;
    }
    if ((s = getenv("FAKECUDA_MEM_BYTES")) && *s) {
        unsigned long long v = parse_bytes(s, &ok);
        if (ok) g_budget = v;
        else fprintf(stderr, "fakecuda: ignoring FAKECUDA_MEM_BYTES=%s\n", s);
    }
    if ((s = getenv("FAKECUDA_NO_VMM")) && *s && strcmp(s, "0")) g_no_vmm = 1;
    if ((s = getenv("FAKECUDA_EVENT_DELAY_US")) && *s) g_delay_us = strtoull(s, NULL, 10);
    if ((s = getenv("FAKECUDA_COPY_DELAY_US")) && *s) g_copy_delay_us = strtoull(s, NULL, 10);
    if ((s = getenv("FAKECUDA_ACCESS_DELAY_US")) && *s) g_access_delay_us = strtoull(s, NULL, 10);
    if ((s = getenv("FAKECUDA_HOST_REGISTER_DELAY_US")) && *s) g_register_delay_us = strtoull(s, NULL, 10);
    if ((s = getenv("FAKECUDA_ASYNC_DEFER")) && *s && strcmp(s, "0")) g_async_defer = 1;
    if ((s = getenv("FAKECUDA_COUNTERS_AT_EXIT")) && *s) snprintf(g_counters_path, sizeof g_counters_path, "%s", s);
    for (int i = 0; i < FC_MAX_DEV; i++) {
        g_ctx[i].dev = i;
        fc_pool *p = &g_default_pool[i];
        p->dev = i;
        p->reuse_follow_events = p->reuse_opportunistic = p->reuse_internal_deps = 1;
        p->access[i] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    if ((s = getenv("FAKECUDA_CALLS_AT_EXIT")) && *s) {
        snprintf(g_calls_path, sizeof g_calls_path, "%s", s);
        g_attribute = 1;
    }
    if ((s = getenv("FAKECUDA_FAIL")) && *s) parse_fail_env(s);
    pthread_atfork(fc_atfork_prepare, fc_atfork_parent, fc_atfork_child);
}

/* path with "%p" replaced by the process id. */
static void expand_pid(const char *path, char *out, size_t n)
{
    size_t o = 0;
    for (const char *p = path; *p && o + 24 < n; p++) {
        if (p[0] == '%' && p[1] == 'p') {
            o += (size_t)snprintf(out + o, n - o, "%ld", (long)getpid());
            p++;
        } else {
            out[o++] = *p;
        }
    }
    out[o] = 0;
}

__attribute__((destructor)) static void fc_unload(void)
{
    char path[4200];
    FILE *f;
    if (g_counters_path[0]) {
        expand_pid(g_counters_path, path, sizeof path);
        struct fakecuda_counters c;
        fakecuda_counters(&c);
        if ((f = fopen(path, "w"))) {
#define FC_DUMP(name) fprintf(f, #name "=%llu\n", c.name);
            FAKECUDA_COUNTER_FIELDS(FC_DUMP)
#undef FC_DUMP
            fclose(f);
        }
    }
    if (g_calls_path[0]) {
        expand_pid(g_calls_path, path, sizeof path);
        if ((f = fopen(path, "w"))) {
            LOCK();
            for (size_t i = 0; i < sizeof g_calls / sizeof g_calls[0] && g_calls[i].name[0]; i++)
                fprintf(f, "%s %s %llu\n", g_calls[i].name, g_calls[i].caller, g_calls[i].n);
            UNLOCK();
            fclose(f);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Control API                                                                                  */

static int fail_arm(const char *fn, const char *caller, int skip, int n, int cuda_error)
{
    if (!fn) return -1;
    char base[64];
    base_name(fn, base, sizeof base);
    if (!sym_known(base) || strlen(caller) >= sizeof g_fail[0].caller) return -1;
    if (n < 0) n = 0;
    CUresult err = cuda_error ? (CUresult)cuda_error : default_fail_error(base);
    int rc = -1;
    LOCK();
    struct fc_fail *slot = NULL;
    for (size_t i = 0; i < sizeof g_fail / sizeof g_fail[0]; i++) {
        if (!strcmp(g_fail[i].name, base) && !strcmp(g_fail[i].caller, caller)) { slot = &g_fail[i]; break; }
        if (!slot && !g_fail[i].name[0]) slot = &g_fail[i];
    }
    if (slot) {
        snprintf(slot->name, sizeof slot->name, "%s", base);
        snprintf(slot->caller, sizeof slot->caller, "%s", caller);
        slot->skip = skip;
        slot->remaining = n;
        slot->err = err;
        rc = 0;
    }
    if (caller[0]) __atomic_store_n(&g_attribute, 1, __ATOMIC_RELAXED);
    fail_recount();
    UNLOCK();
    return rc;
}

FC_API int fakecuda_fail_next(const char *fn, int n, int cuda_error) { return fail_arm(fn, "", 0, n, cuda_error); }

FC_API void fakecuda_set_budget(unsigned long long bytes)
{
    LOCK();
    g_budget = bytes;
    UNLOCK();
}

FC_API void fakecuda_set_event_delay_us(unsigned long long us)
{
    LOCK();
    g_delay_us = us;
    UNLOCK();
}

FC_API void fakecuda_set_copy_delay_us(unsigned long long us)
{
    LOCK();
    g_copy_delay_us = us;
    UNLOCK();
}

FC_API void fakecuda_set_export_delay_us(unsigned long long us)
{
    __atomic_store_n(&g_export_delay_us, us, __ATOMIC_RELAXED);
}

FC_API void fakecuda_set_unmap_delay_us(unsigned long long us)
{
    __atomic_store_n(&g_unmap_delay_us, us, __ATOMIC_RELAXED);
}

FC_API void fakecuda_set_access_delay_us(unsigned long long us)
{
    __atomic_store_n(&g_access_delay_us, us, __ATOMIC_RELAXED);
}

/* Sleeps us microseconds outside the driver's lock, as a slow real call lets other calls go on. */
static void fc_take(unsigned long long us)
{
    if (!us) return;
    struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* Open fds on the memory of no live handle: exported or received fds nobody closed, each keeping
 * memory alive that the driver no longer accounts for.  Nobody tells the driver when such an fd
 * is closed, so they are found in the fd table. */
static unsigned long long count_stray_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return 0;
    unsigned long long n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char link[64], target[128];
        int fd = atoi(e->d_name);
        struct stat st;
        if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        /* by path, not by fd: another thread may close the fd meanwhile, and then it simply goes */
        ssize_t len = readlink(link, target, sizeof target - 1);
        if (len <= 0 || stat(link, &st) != 0) continue;
        target[len] = 0;
        if (strncmp(target, "/memfd:fakecuda.d", 17)) continue;
        int live = 0;
        fc_handle *h, *tmp;
        LOCK();
        HASH_ITER(hh, g_handles, h, tmp) {
            struct stat hs;
            if (fstat(h->fd, &hs) == 0 && hs.st_ino == st.st_ino && hs.st_dev == st.st_dev) live = 1;
        }
        UNLOCK();
        n += !live;
    }
    closedir(d);
    return n;
}

FC_API void fakecuda_counters(struct fakecuda_counters *out)
{
    if (!out) return;
#define FC_SNAP(name) out->name = __atomic_load_n(&g_cnt.name, __ATOMIC_RELAXED);
    FAKECUDA_COUNTER_FIELDS(FC_SNAP)
#undef FC_SNAP
    out->fds_open = count_stray_fds();
}

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                       */

#define FC_ERRORS(X)                                                                              \
    X(CUDA_SUCCESS, "no error")                                                                   \
    X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                               \
    X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                                  \
    X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                                         \
    X(CUDA_ERROR_DEINITIALIZED, "driver shutting down")                                           \
    X(CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library")                                   \
    X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                                 \
    X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                        \
    X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                                       \
    X(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current")                              \
    X(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed")                                   \
    X(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped")                                       \
    X(CUDA_ERROR_NOT_MAPPED, "resource not mapped")                                               \
    X(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices") \
    X(CUDA_ERROR_INVALID_SOURCE, "device kernel image is invalid")                                \
    X(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS")        \
    X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                                       \
    X(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state")         \
    X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                             \
    X(CUDA_ERROR_NOT_READY, "device not ready")                                                   \
    X(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")                     \
    X(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")                                     \
    X(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled")                   \
    X(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled")                     \
    X(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "cannot set while device is active in this process")     \
    X(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed")                                    \
    X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                                        \
    X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                                        \
    X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing")  \
    X(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture") \
    X(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "operation would result in a merge of separate capture sequences") \
    X(CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "capture sequence contains a fork that was not joined to the primary stream") \
    X(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "operation would make the legacy stream depend on a capturing blocking stream") \
    X(CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a capturing stream") \
    X(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "attempt to terminate a thread-local capture sequence from another thread") \
    X(CUDA_ERROR_UNKNOWN, "unknown error")

static const struct {
    CUresult code;
    const char *name, *desc;
} g_errors[] = {
#define FC_ERR_ROW(code, desc) {code, #code, desc},
    FC_ERRORS(FC_ERR_ROW)
#undef FC_ERR_ROW
};

static int error_by_name(const char *s, CUresult *out)
{
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (!strcmp(s, g_errors[i].name) || !strcmp(s, g_errors[i].name + strlen("CUDA_ERROR_"))) {
            *out = g_errors[i].code;
            return 0;
        }
    }
    return -1;
}

FC_API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == error) {
            *pStr = g_errors[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == error) {
            *pStr = g_errors[i].desc;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------------------------------ */
/* Initialization, devices                                                                      */

FC_API CUresult cuInit(unsigned int Flags)
{
    FC_ENTER_NOINIT("cuInit");
    if (Flags) return CUDA_ERROR_INVALID_VALUE;
    if (g_ndev == 0) return CUDA_ERROR_NO_DEVICE;
    __atomic_store_n(&g_initialized, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDriverGetVersion(int *driverVersion)
{
    FC_ENTER_NOINIT("cuDriverGetVersion");
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = FC_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetCount(int *count)
{
    FC_ENTER("cuDeviceGetCount");
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = g_ndev;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    FC_ENTER("cuDeviceGet");
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    FC_ENTER("cuDeviceGetName");
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "fakecuda emulated GPU %d", dev);
    return CUDA_SUCCESS;
}

static CUresult get_uuid(CUuuid *uuid, CUdevice dev)
{
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    static const unsigned char prefix[12] = {'f', 'a', 'k', 'e', 'c', 'u', 'd', 'a', 0x13, 0x00, 0x4d, 0x9e};
    memcpy(uuid->bytes, prefix, sizeof prefix);
    uuid->bytes[12] = 0x50;
    uuid->bytes[13] = 0x0d;
    uuid->bytes[14] = 0x00;
    uuid->bytes[15] = (char)dev;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    FC_ENTER("cuDeviceGetUuid");
    return get_uuid(uuid, dev);
}

FC_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    FC_ENTER("cuDeviceGetUuid");
    return get_uuid(uuid, dev);
}

FC_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    FC_ENTER("cuDeviceTotalMem");
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    LOCK();
    *bytes = (size_t)g_budget;
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    FC_ENTER("cuDeviceGetAttribute");
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if ((int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    int vmm = !g_no_vmm, v = 0;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = INT_MAX; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: v = INT_MAX; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 132; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = 0x10 + dev; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 52428800; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 3; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: v = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: v = 232448; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = vmm; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = vmm; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: v = vmm ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0; break;
    case CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED: v = 1; break;
    default: v = 0; break;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    FC_ENTER("cuDeviceCanAccessPeer");
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev) || !dev_ok(peerDev)) return CUDA_ERROR_INVALID_DEVICE;
    *canAccessPeer = dev != peerDev;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Contexts                                                                                     */

FC_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    FC_ENTER("cuDevicePrimaryCtxRetain");
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    LOCK();
    g_ctx[dev].prim_refs++;
    UNLOCK();
    *pctx = (CUcontext)(void *)&g_ctx[dev];
    return CUDA_SUCCESS;
}

static CUresult prim_release(CUdevice dev)
{
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult r = CUDA_SUCCESS;
    LOCK();
    if (g_ctx[dev].prim_refs > 0) g_ctx[dev].prim_refs--;
    else r = CUDA_ERROR_INVALID_CONTEXT;
    UNLOCK();
    return r;
}

FC_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    FC_ENTER("cuDevicePrimaryCtxRelease");
    return prim_release(dev);
}

FC_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    FC_ENTER("cuDevicePrimaryCtxRelease");
    return prim_release(dev);
}

static CUresult memfree(CUdeviceptr dptr);

/* A reset frees every cuMemAlloc-family allocation made on the device, as the real driver does;
 * VMM handles and mappings are the process's, not the context's, and survive (as on an H100). */
static CUresult prim_reset(CUdevice dev)
{
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    for (;;) {
        uintptr_t base = 0;
        LOCK();
        for (fc_range *r = g_allocs; r; r = r->hh.next)
            if (r->dev == (int)dev) {
                base = r->base;
                break;
            }
        UNLOCK();
        if (!base) return CUDA_SUCCESS;
        (void)memfree((CUdeviceptr)base);
    }
}

FC_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    FC_ENTER("cuDevicePrimaryCtxReset");
    return prim_reset(dev);
}

FC_API CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    FC_ENTER("cuDevicePrimaryCtxReset");
    return prim_reset(dev);
}

FC_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    FC_ENTER("cuDevicePrimaryCtxGetState");
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    LOCK();
    *flags = 0;
    *active = g_ctx[dev].prim_refs > 0;
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    FC_ENTER("cuCtxGetCurrent");
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = cur_ctx();
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    FC_ENTER("cuCtxSetCurrent");
    if (ctx && !ctx_of(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth) t_stack[t_depth - 1] = ctx;
    else if (ctx) t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

static CUresult ctx_push(CUcontext ctx)
{
    if (!ctx || !ctx_of(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth >= (int)(sizeof t_stack / sizeof t_stack[0])) return CUDA_ERROR_OUT_OF_MEMORY;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

static CUresult ctx_pop(CUcontext *pctx)
{
    if (!t_depth) return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t_stack[--t_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    FC_ENTER("cuCtxPushCurrent");
    return ctx_push(ctx);
}

FC_API CUresult cuCtxPushCurrent(CUcontext ctx)
{
    FC_ENTER("cuCtxPushCurrent");
    return ctx_push(ctx);
}

FC_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    FC_ENTER("cuCtxPopCurrent");
    return ctx_pop(pctx);
}

FC_API CUresult cuCtxPopCurrent(CUcontext *pctx)
{
    FC_ENTER("cuCtxPopCurrent");
    return ctx_pop(pctx);
}

FC_API CUresult cuCtxGetDevice(CUdevice *device)
{
    FC_ENTER("cuCtxGetDevice");
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    struct fc_ctx *c = ctx_of(cur_ctx());
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->dev;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxSynchronize(void)
{
    FC_ENTER("cuCtxSynchronize");
    if (!ctx_of(cur_ctx())) return CUDA_ERROR_INVALID_CONTEXT;
    pending_flush();
    (void)__atomic_load_n(&g_copies_done, __ATOMIC_ACQUIRE); /* every copy done so far is ordered before */
    LOCK();
    unsigned long long t = g_legacy_stream.busy_until;
    if (g_ptds_stream.busy_until > t) t = g_ptds_stream.busy_until;
    fc_stream *s, *tmp;
    int broke = 0;
    HASH_ITER(hh, g_streams, s, tmp) {
        if (s->busy_until > t) t = s->busy_until;
        /* synchronizing a context waits for its capturing streams too: the real driver
         * invalidates their captures (seen on an H100), whatever the capture mode */
        if (s->capturing && !s->invalidated) s->invalidated = broke = 1;
    }
    UNLOCK();
    if (broke) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    sleep_until(t);
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    FC_ENTER("cuCtxEnablePeerAccess");
    struct fc_ctx *c = ctx_of(cur_ctx()), *p = ctx_of(peerContext);
    if (!c || !p) return CUDA_ERROR_INVALID_CONTEXT;
    if (Flags) return CUDA_ERROR_INVALID_VALUE;
    if (c == p) return CUDA_ERROR_INVALID_DEVICE;
    CUresult r = CUDA_SUCCESS;
    LOCK();
    if (c->peer_mask & (1u << p->dev)) r = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    else c->peer_mask |= 1u << p->dev;
    UNLOCK();
    return r;
}

FC_API CUresult cuCtxDisablePeerAccess(CUcontext peerContext)
{
    FC_ENTER("cuCtxDisablePeerAccess");
    struct fc_ctx *c = ctx_of(cur_ctx()), *p = ctx_of(peerContext);
    if (!c || !p) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult r = CUDA_SUCCESS;
    LOCK();
    if (!(c->peer_mask & (1u << p->dev))) r = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
    else c->peer_mask &= ~(1u << p->dev);
    UNLOCK();
    return r;
}

/* ------------------------------------------------------------------------------------------ */
/* Virtual memory management                                                                    */

FC_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                              CUmemAllocationGranularity_flags option)
{
    FC_ENTER("cuMemGetAllocationGranularity");
    if (!granularity || !prop) return CUDA_ERROR_INVALID_VALUE;
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && !dev_ok(prop->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    *granularity = FC_GRAN;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags)
{
    FC_ENTER("cuMemAddressReserve");
    if (g_no_vmm) return CUDA_ERROR_NOT_SUPPORTED;
    if (!ptr || !size || size % FC_GRAN || flags) return CUDA_ERROR_INVALID_VALUE;
    if (alignment && (!is_pow2(alignment) || alignment > FC_MAX_ALIGN)) return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > FC_GRAN ? alignment : FC_GRAN;
    void *p = NULL;
    if (addr && !(addr % align)) { /* a hint, as with the real driver */
        void *q = mmap((void *)(uintptr_t)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (q != MAP_FAILED && (uintptr_t)q == addr) p = q;
        else if (q != MAP_FAILED) munmap(q, size);
    }
    if (!p) p = map_aligned(size, align, PROT_NONE);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    fc_range *r = calloc(1, sizeof *r);
    if (!r) {
        munmap(p, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r->base = (uintptr_t)p;
    r->size = size;
    LOCK();
    HASH_ADD(hh, g_resv, base, sizeof r->base, r);
    UNLOCK();
    CNT_ADD(reservations_live, 1);
    *ptr = (CUdeviceptr)r->base;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    FC_ENTER("cuMemAddressFree");
    uintptr_t base = (uintptr_t)ptr;
    fc_range *r;
    LOCK();
    HASH_FIND(hh, g_resv, &base, sizeof base, r);
    if (!r || r->size != size || overlaps(g_maps, r->base, r->size)) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    HASH_DEL(g_resv, r);
    UNLOCK();
    munmap((void *)r->base, r->size);
    free(r);
    CNT_SUB(reservations_live, 1);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    CNT_ADD(calls_cuMemCreate, 1);
    FC_ENTER("cuMemCreate");
    if (g_no_vmm) return CUDA_ERROR_NOT_SUPPORTED;
    if (!handle || !prop || !size || size % FC_GRAN || flags) return CUDA_ERROR_INVALID_VALUE;
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    unsigned long long types = (unsigned long long)prop->requestedHandleTypes;
    if (types & CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_PERMITTED;
    if (types & ~(unsigned long long)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int dev = prop->location.id;

    fc_handle *h = calloc(1, sizeof *h);
    if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
    LOCK();
    if (charge(dev, size)) {
        UNLOCK();
        free(h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    UNLOCK();
    char name[32];
    snprintf(name, sizeof name, "fakecuda.d%d", dev);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        LOCK();
        uncharge(dev, size);
        UNLOCK();
        free(h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->fd = fd;
    h->size = size;
    h->dev = dev;
    h->user_refs = 1;
    h->types = types;
    h->charged = size;
    LOCK();
    h->id = g_next_handle++;
    HASH_ADD(hh, g_handles, id, sizeof h->id, h);
    UNLOCK();
    CNT_ADD(handles_live, 1);
    CNT_ADD(handles_created, 1);
    *handle = h->id;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CNT_ADD(calls_cuMemRelease, 1);
    FC_ENTER("cuMemRelease");
    fc_handle *h;
    LOCK();
    HASH_FIND(hh, g_handles, &handle, sizeof handle, h);
    if (!h || h->user_refs <= 0) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    h->user_refs--;
    handle_maybe_destroy(h);
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags)
{
    CNT_ADD(calls_cuMemMap, 1);
    FC_ENTER("cuMemMap");
    uintptr_t p = (uintptr_t)ptr;
    if (!p || !size || flags || p % FC_GRAN || size % FC_GRAN || offset % FC_GRAN) return CUDA_ERROR_INVALID_VALUE;
    /* as the real driver (H100, CUDA 13.0): a handle maps only from its offset 0 */
    if (offset) return CUDA_ERROR_NOT_SUPPORTED;
    fc_handle *h;
    LOCK();
    HASH_FIND(hh, g_handles, &handle, sizeof handle, h);
    if (!h || h->user_refs <= 0) {
        UNLOCK();
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (offset > h->size || size > h->size - offset || !range_containing(g_resv, p, size) ||
        overlaps(g_maps, p, size)) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    fc_range *m = calloc(1, sizeof *m);
    void *q = m ? mmap((void *)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset) : MAP_FAILED;
    if (q == MAP_FAILED) {
        UNLOCK();
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->base = p;
    m->size = size;
    m->h = h;
    m->offset = offset;
    m->prot = PROT_NONE;
    m->dev = h->dev;
    m->buffer_id = g_next_buffer_id++;
    h->map_count++;
    HASH_ADD(hh, g_maps, base, sizeof m->base, m);
    UNLOCK();
    CNT_ADD(mappings_live, 1);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    FC_ENTER("cuMemUnmap");
    uintptr_t p = (uintptr_t)ptr;
    if (!p || !size) return CUDA_ERROR_INVALID_VALUE;
    CNT_ADD(calls_cuMemUnmap, 1);
    fc_take(__atomic_load_n(&g_unmap_delay_us, __ATOMIC_RELAXED));
    LOCK();
    /* Every mapping touching the range must lie entirely inside it. */
    fc_range *m, *tmp;
    int found = 0;
    HASH_ITER(hh, g_maps, m, tmp) {
        if (m->base < p + size && p < m->base + m->size) {
            if (m->base < p || m->base + m->size > p + size) {
                UNLOCK();
                return CUDA_ERROR_INVALID_VALUE;
            }
            found++;
        }
    }
    if (!found) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    HASH_ITER(hh, g_maps, m, tmp) {
        if (m->base >= p && m->base + m->size <= p + size) {
            mmap((void *)m->base, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            HASH_DEL(g_maps, m);
            m->h->map_count--;
            handle_maybe_destroy(m->h);
            free(m);
            CNT_SUB(mappings_live, 1);
        }
    }
    UNLOCK();
    return CUDA_SUCCESS;
}

/* Checks that [p, p+size) is covered by mappings without holes; lock held. */
static int fully_mapped(uintptr_t p, size_t size)
{
    uintptr_t at = p;
    while (at < p + size) {
        fc_range *m = range_containing(g_maps, at, 0);
        if (!m) return 0;
        at = m->base + m->size;
    }
    return 1;
}

FC_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    FC_ENTER("cuMemSetAccess");
    CNT_ADD(calls_cuMemSetAccess, 1);
    uintptr_t p = (uintptr_t)ptr;
    if (!p || !size || !desc || !count || p % FC_GRAN || size % FC_GRAN) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
        if (!dev_ok(desc[i].location.id)) return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    /* the pages change at the end of the call: until then the memory is not accessible */
    fc_take(__atomic_load_n(&g_access_delay_us, __ATOMIC_RELAXED));
    LOCK();
    if (!fully_mapped(p, size)) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* Each listed device gets its flags; the others keep theirs.  The pages get the union. */
    CUresult r = CUDA_SUCCESS;
    fc_range *m, *tmp;
    HASH_ITER(hh, g_maps, m, tmp) {
        if (m->base >= p + size || m->base + m->size <= p) continue;
        for (size_t i = 0; i < count; i++) m->access[desc[i].location.id] = (unsigned char)desc[i].flags;
        int prot = PROT_NONE;
        for (int d = 0; d < FC_MAX_DEV; d++)
            prot |= m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
                    : m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READ    ? PROT_READ
                                                                       : PROT_NONE;
        uintptr_t lo = m->base > p ? m->base : p, hi = m->base + m->size < p + size ? m->base + m->size : p + size;
        if (mprotect((void *)lo, hi - lo, prot) != 0) r = CUDA_ERROR_INVALID_VALUE;
        m->prot = prot;
    }
    UNLOCK();
    return r;
}

FC_API CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr)
{
    FC_ENTER("cuMemGetAccess");
    if (!flags || !location || location->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(location->id)) return CUDA_ERROR_INVALID_DEVICE;
    LOCK();
    fc_range *m = range_containing(g_maps, (uintptr_t)ptr, 0);
    fc_range *a = m ? NULL : range_containing(g_allocs, (uintptr_t)ptr, 0);
    if (!m && !(a && a->pool)) { /* plain cuMemAlloc blocks are no VMM mapping */
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    *flags = m ? m->access[location->id] : a->pool->access[location->id];
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                             CUmemAllocationHandleType handleType, unsigned long long flags)
{
    FC_ENTER("cuMemExportToShareableHandle");
    if (!shareableHandle || flags) return CUDA_ERROR_INVALID_VALUE;
    if (handleType == CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_PERMITTED;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    fc_take(__atomic_load_n(&g_export_delay_us, __ATOMIC_RELAXED));
    fc_handle *h;
    LOCK();
    HASH_FIND(hh, g_handles, &handle, sizeof handle, h);
    if (!h || h->user_refs <= 0) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!(h->types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    int fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0);
    UNLOCK();
    if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
    *(int *)shareableHandle = fd;
    CNT_ADD(exports, 1);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                               CUmemAllocationHandleType shHandleType)
{
    FC_ENTER("cuMemImportFromShareableHandle");
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    if (shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) return CUDA_ERROR_NOT_PERMITTED;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int fd = (int)(intptr_t)osHandle;
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 || (size_t)st.st_size % FC_GRAN)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = 0;
    char link[64], target[256];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n > 0) {
        target[n] = 0;
        if (sscanf(target, "/memfd:fakecuda.d%d", &dev) != 1) return CUDA_ERROR_INVALID_VALUE;
        if (!dev_ok(dev)) dev = 0;
    }
    fc_handle *h = calloc(1, sizeof *h);
    if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
    h->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (h->fd < 0) {
        free(h);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    h->size = (size_t)st.st_size;
    h->dev = dev;
    h->user_refs = 1;
    h->types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    h->imported = 1;
    LOCK();
    h->id = g_next_handle++;
    HASH_ADD(hh, g_handles, id, sizeof h->id, h);
    UNLOCK();
    CNT_ADD(handles_live, 1);
    CNT_ADD(imports, 1);
    CNT_ADD(imports_live, 1);
    *handle = h->id;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
    FC_ENTER("cuMemGetAllocationPropertiesFromHandle");
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    fc_handle *h;
    LOCK();
    HASH_FIND(hh, g_handles, &handle, sizeof handle, h);
    if (!h) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = h->dev;
    prop->requestedHandleTypes = (CUmemAllocationHandleType)h->types;
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    FC_ENTER("cuMemRetainAllocationHandle");
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_range *m = range_containing(g_maps, (uintptr_t)addr, 0);
    if (!m) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    m->h->user_refs++;
    *handle = m->h->id;
    UNLOCK();
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Classic allocations                                                                          */

/* ---- memory pools: lock held in all helpers ---- */

static fc_pool *pool_of(CUmemoryPool handle)
{
    fc_pool *p = (fc_pool *)(void *)handle;
    for (int i = 0; i < g_ndev; i++)
        if (p == &g_default_pool[i]) return p;
    for (fc_pool *q = g_pools; q; q = q->next)
        if (q == p && !q->destroyed) return q;
    return NULL;
}

static fc_pool *pool_current(int dev) { return g_current_pool[dev] ? g_current_pool[dev] : &g_default_pool[dev]; }

static void pool_note_high(fc_pool *p)
{
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    if (p->used > p->used_high) p->used_high = p->used;
}

/* Give idle bytes back to the device until at most `keep` bytes stay reserved. */
static void pool_release_to(fc_pool *p, unsigned long long keep)
{
    unsigned long long idle = p->reserved - p->used;
    unsigned long long over = p->reserved > keep ? p->reserved - keep : 0;
    unsigned long long n = idle < over ? idle : over;
    p->reserved -= n;
    uncharge(p->dev, (size_t)n);
}

static void pool_unlink_free(fc_pool *p)
{
    for (fc_pool **at = &g_pools; *at; at = &(*at)->next)
        if (*at == p) {
            *at = p->next;
            break;
        }
    pool_release_to(p, 0);
    free(p);
}

/* ---- allocations ---- */

enum { FROM_NO_POOL, FROM_CURRENT_POOL, FROM_GIVEN_POOL };

/* A block of size bytes on dev; from_pool: none, dev's current pool, or `given` (whose device
 * it lands on).  Bytes a pool holds idle are reused before the device is charged for more. */
static CUresult memalloc_on(CUdeviceptr *dptr, size_t size, int dev, int from_pool, CUmemoryPool given)
{
    if (!dptr || !size) return CUDA_ERROR_INVALID_VALUE;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = size >= FC_GRAN / 2 ? round_up(size, FC_GRAN) : round_up(size, page);
    size_t align = len >= FC_GRAN ? FC_GRAN : page;
    if (len < size) return CUDA_ERROR_OUT_OF_MEMORY;
    fc_range *r = calloc(1, sizeof *r);
    if (!r) return CUDA_ERROR_OUT_OF_MEMORY;
    LOCK();
    fc_pool *pool = NULL;
    if (from_pool == FROM_GIVEN_POOL && !(pool = pool_of(given))) {
        UNLOCK();
        free(r);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (from_pool == FROM_CURRENT_POOL) pool = pool_current(dev);
    if (pool) dev = pool->dev;
    size_t reused = 0;
    if (pool) {
        unsigned long long idle = pool->reserved - pool->used;
        reused = idle < len ? (size_t)idle : len;
    }
    if (charge(dev, len - reused)) {
        UNLOCK();
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (pool) {
        pool->reserved += len - reused;
        pool->used += len;
        pool->live++;
        pool_note_high(pool);
    }
    UNLOCK();
    void *p = map_aligned(len, align, PROT_READ | PROT_WRITE);
    LOCK();
    if (!p) {
        if (pool) {
            pool->used -= len;
            pool->live--;
            pool_release_to(pool, pool->release_threshold);
        } else {
            uncharge(dev, len);
        }
        UNLOCK();
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r->base = (uintptr_t)p;
    r->size = size;
    r->map_len = len;
    r->dev = dev;
    r->charged = len;
    r->pool = pool;
    r->buffer_id = g_next_buffer_id++;
    HASH_ADD(hh, g_allocs, base, sizeof r->base, r);
    UNLOCK();
    CNT_ADD(memalloc_live, 1);
    *dptr = (CUdeviceptr)r->base;
    return CUDA_SUCCESS;
}

static CUresult memalloc(CUdeviceptr *dptr, size_t size)
{
    struct fc_ctx *c = ctx_of(cur_ctx());
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    return memalloc_on(dptr, size, c->dev, FROM_NO_POOL, NULL);
}

static CUresult memfree(CUdeviceptr dptr)
{
    if (!dptr) return CUDA_SUCCESS;
    uintptr_t base = (uintptr_t)dptr;
    fc_range *r;
    LOCK();
    HASH_FIND(hh, g_allocs, &base, sizeof base, r);
    if (!r) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    HASH_DEL(g_allocs, r);
    fc_pool *pool = r->pool;
    if (pool) { /* the bytes stay the pool's, idle, as far as its release threshold allows */
        pool->used -= r->charged;
        pool->live--;
        pool_release_to(pool, pool->release_threshold);
        if (pool->destroyed && !pool->live) pool_unlink_free(pool);
    } else {
        uncharge(r->dev, r->charged);
    }
    UNLOCK();
    munmap((void *)r->base, r->map_len);
    free(r);
    CNT_SUB(memalloc_live, 1);
    return CUDA_SUCCESS;
}

static CUresult stream_check(CUstream s)
{
    LOCK();
    fc_stream *st = stream_get(s);
    UNLOCK();
    return st ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FC_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    CNT_ADD(calls_cuMemAlloc, 1);
    FC_ENTER("cuMemAlloc");
    return memalloc(dptr, bytesize);
}

FC_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                   unsigned int ElementSizeBytes)
{
    FC_ENTER("cuMemAllocPitch");
    if (!pPitch || !WidthInBytes || !Height) return CUDA_ERROR_INVALID_VALUE;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16) return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = round_up(WidthInBytes, 512);
    if (Height > SIZE_MAX / pitch) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = memalloc(dptr, pitch * Height);
    if (r == CUDA_SUCCESS) *pPitch = pitch;
    return r;
}

FC_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    FC_ENTER("cuMemAllocManaged");
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
    return memalloc(dptr, bytesize);
}

FC_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CNT_ADD(calls_cuMemFree, 1);
    FC_ENTER("cuMemFree");
    return memfree(dptr);
}

static CUresult alloc_async(const void *caller, CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    CNT_ADD(calls_cuMemAllocAsync, 1);
    FC_ENTER_FROM("cuMemAllocAsync", caller);
    CUresult r = stream_check(hStream);
    if (r != CUDA_SUCCESS) return r;
    struct fc_ctx *c = ctx_of(cur_ctx());
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    return memalloc_on(dptr, bytesize, c->dev, FROM_CURRENT_POOL, NULL);
}

static CUresult free_async(const void *caller, CUdeviceptr dptr, CUstream hStream)
{
    CNT_ADD(calls_cuMemFreeAsync, 1);
    FC_ENTER_FROM("cuMemFreeAsync", caller);
    CUresult r = stream_check(hStream);
    if (r != CUDA_SUCCESS) return r;
    /* Seen on an H100 (driver 580): freeing memory allocated before a capture, on the capturing
     * stream, is refused and the capture goes on.  Nothing is allocated in a capture here. */
    LOCK();
    fc_stream *s = hStream && hStream != CU_STREAM_LEGACY ? stream_get(hStream) : NULL;
    int capturing = s && s->capturing;
    UNLOCK();
    if (capturing) return CUDA_ERROR_INVALID_VALUE;
    return memfree(dptr);
}

FC_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(FC_CALLER, dptr, bytesize, hStream);
}

FC_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(FC_CALLER, dptr, bytesize, hStream ? hStream : CU_STREAM_PER_THREAD);
}

FC_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(FC_CALLER, dptr, hStream); }

FC_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(FC_CALLER, dptr, hStream ? hStream : CU_STREAM_PER_THREAD);
}

/* ------------------------------------------------------------------------------------------ */
/* Memory pools                                                                                 */

static CUresult alloc_from_pool(const void *caller, CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                CUstream hStream)
{
    CNT_ADD(calls_cuMemAllocFromPoolAsync, 1);
    FC_ENTER_FROM("cuMemAllocFromPoolAsync", caller);
    CUresult r = stream_check(hStream);
    return r != CUDA_SUCCESS ? r : memalloc_on(dptr, bytesize, 0, FROM_GIVEN_POOL, pool);
}

FC_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    return alloc_from_pool(FC_CALLER, dptr, bytesize, pool, hStream);
}

FC_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    return alloc_from_pool(FC_CALLER, dptr, bytesize, pool, hStream ? hStream : CU_STREAM_PER_THREAD);
}

static CUresult get_default_pool(CUmemoryPool *pool_out, CUdevice dev)
{
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pool_out = (CUmemoryPool)(void *)&g_default_pool[dev];
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    FC_ENTER("cuDeviceGetDefaultMemPool");
    return get_default_pool(pool_out, dev);
}

static CUresult get_current_pool(CUmemoryPool *pool, CUdevice dev)
{
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    LOCK();
    *pool = (CUmemoryPool)(void *)pool_current(dev);
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    FC_ENTER("cuDeviceGetMemPool");
    return get_current_pool(pool, dev);
}

static CUresult set_mem_pool(CUdevice dev, CUmemoryPool pool)
{
    CNT_ADD(calls_cuDeviceSetMemPool, 1);
    if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    LOCK();
    fc_pool *p = pool_of(pool);
    CUresult r = p && p->dev == dev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) g_current_pool[dev] = p == &g_default_pool[dev] ? NULL : p;
    UNLOCK();
    return r;
}

FC_API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    FC_ENTER("cuDeviceSetMemPool");
    return set_mem_pool(dev, pool);
}

/* The location-based forms (CUDA 13): device locations and pinned memory only. */
static CUresult device_location(const CUmemLocation *location, CUmemAllocationType type, int *dev)
{
    if (!location || type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (location->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dev_ok(location->id)) return CUDA_ERROR_INVALID_VALUE;
    *dev = location->id;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool_out, CUmemLocation *location, CUmemAllocationType type)
{
    FC_ENTER("cuMemGetDefaultMemPool");
    int dev = 0;
    CUresult r = device_location(location, type, &dev);
    return r != CUDA_SUCCESS ? r : get_default_pool(pool_out, dev);
}

FC_API CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *location, CUmemAllocationType type)
{
    FC_ENTER("cuMemGetMemPool");
    int dev = 0;
    CUresult r = device_location(location, type, &dev);
    return r != CUDA_SUCCESS ? r : get_current_pool(pool, dev);
}

FC_API CUresult cuMemSetMemPool(CUmemLocation *location, CUmemAllocationType type, CUmemoryPool pool)
{
    FC_ENTER("cuMemSetMemPool");
    int dev = 0;
    CUresult r = device_location(location, type, &dev);
    return r != CUDA_SUCCESS ? r : set_mem_pool(dev, pool);
}

FC_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    FC_ENTER("cuMemPoolCreate");
    if (!pool || !props || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(props->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    if (props->handleTypes & ~(unsigned long long)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    fc_pool *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->dev = props->location.id;
    p->reuse_follow_events = p->reuse_opportunistic = p->reuse_internal_deps = 1;
    p->access[p->dev] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    LOCK();
    p->next = g_pools;
    g_pools = p;
    UNLOCK();
    *pool = (CUmemoryPool)(void *)p;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    FC_ENTER("cuMemPoolDestroy");
    LOCK();
    fc_pool *p = pool_of(pool);
    if (!p || p == &g_default_pool[p->dev]) {
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (g_current_pool[p->dev] == p) g_current_pool[p->dev] = NULL; /* the default becomes current again */
    if (p->live) p->destroyed = 1; /* freed with its last allocation */
    else pool_unlink_free(p);
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)
{
    CNT_ADD(calls_cuMemPoolSetAccess, 1);
    FC_ENTER("cuMemPoolSetAccess");
    if (count && !map) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_pool *p = pool_of(pool);
    CUresult r = p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; r == CUDA_SUCCESS && i < count; i++) {
        const CUmemAccessDesc *d = &map[i];
        if (d->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !dev_ok(d->location.id)) r = CUDA_ERROR_INVALID_VALUE;
        else if (d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && d->flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
                 d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            r = CUDA_ERROR_INVALID_VALUE;
        else if (d->location.id == p->dev && d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            r = CUDA_ERROR_INVALID_VALUE; /* the pool's own device keeps full access */
    }
    for (size_t i = 0; r == CUDA_SUCCESS && i < count; i++) p->access[map[i].location.id] = (unsigned char)map[i].flags;
    UNLOCK();
    return r;
}

FC_API CUresult cuMemPoolGetAccess(CUmemAccess_flags *flags, CUmemoryPool memPool, CUmemLocation *location)
{
    FC_ENTER("cuMemPoolGetAccess");
    if (!flags || !location || location->type != CU_MEM_LOCATION_TYPE_DEVICE || !dev_ok(location->id))
        return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_pool *p = pool_of(memPool);
    if (p) *flags = (CUmemAccess_flags)p->access[location->id];
    UNLOCK();
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    CNT_ADD(calls_cuMemPoolSetAttribute, 1);
    FC_ENTER("cuMemPoolSetAttribute");
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_pool *p = pool_of(pool);
    CUresult r = p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (p) switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            p->release_threshold = *(cuuint64_t *)value;
            pool_release_to(p, p->release_threshold);
            break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: p->reuse_follow_events = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: p->reuse_opportunistic = *(int *)value != 0; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: p->reuse_internal_deps = *(int *)value != 0; break;
        /* high-water marks can only be reset, which starts them again from the current value */
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
            if (*(cuuint64_t *)value) r = CUDA_ERROR_INVALID_VALUE;
            else p->reserved_high = p->reserved;
            break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
            if (*(cuuint64_t *)value) r = CUDA_ERROR_INVALID_VALUE;
            else p->used_high = p->used;
            break;
        default: r = CUDA_ERROR_INVALID_VALUE; break; /* the current figures are read-only */
        }
    UNLOCK();
    return r;
}

FC_API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    CNT_ADD(calls_cuMemPoolGetAttribute, 1);
    FC_ENTER("cuMemPoolGetAttribute");
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_pool *p = pool_of(pool);
    CUresult r = p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (p) switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = p->release_threshold; break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: *(int *)value = p->reuse_follow_events; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: *(int *)value = p->reuse_opportunistic; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *(int *)value = p->reuse_internal_deps; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = p->reserved; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = p->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = p->used; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = p->used_high; break;
        default: r = CUDA_ERROR_INVALID_VALUE; break;
        }
    UNLOCK();
    return r;
}

FC_API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    CNT_ADD(calls_cuMemPoolTrimTo, 1);
    FC_ENTER("cuMemPoolTrimTo");
    LOCK();
    fc_pool *p = pool_of(pool);
    if (p) pool_release_to(p, minBytesToKeep);
    UNLOCK();
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    FC_ENTER("cuMemGetInfo");
    struct fc_ctx *c = ctx_of(cur_ctx());
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    *total = (size_t)g_budget;
    *free_bytes = g_used[c->dev] >= g_budget ? 0 : (size_t)(g_budget - g_used[c->dev]);
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    FC_ENTER("cuMemGetAddressRange");
    LOCK();
    fc_range *r = range_containing(g_maps, (uintptr_t)dptr, 0);
    if (!r) r = range_containing(g_allocs, (uintptr_t)dptr, 0);
    if (!r) {
        UNLOCK();
        return CUDA_ERROR_NOT_FOUND;
    }
    if (pbase) *pbase = (CUdeviceptr)r->base;
    if (psize) *psize = r->size;
    UNLOCK();
    return CUDA_SUCCESS;
}

/* One attribute of a known pointer; lock held.  mapping says whether r is a VMM mapping. */
static CUresult pointer_attr(void *data, CUpointer_attribute attribute, fc_range *r, int mapping, CUdeviceptr ptr)
{
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = (CUcontext)(void *)&g_ctx[r->dev]; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: return CUDA_ERROR_INVALID_VALUE;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: *(int *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = r->buffer_id; break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = r->dev; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = !mapping; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = (CUdeviceptr)r->base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = r->size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *(unsigned long long *)data = mapping ? r->h->types : 0;
        break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
        *(unsigned int *)data = (!mapping || (r->prot & PROT_WRITE)) ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE
                                : (r->prot & PROT_READ)             ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ
                                                                    : CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE;
        break;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *(void **)data = NULL; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

static fc_range *pointer_lookup(CUdeviceptr ptr, int *mapping) /* lock held */
{
    fc_range *r = range_containing(g_maps, (uintptr_t)ptr, 0);
    *mapping = r != NULL;
    if (!r) r = range_containing(g_allocs, (uintptr_t)ptr, 0);
    return r;
}

FC_API CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    FC_ENTER("cuPointerGetAttribute");
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    int mapping;
    LOCK();
    fc_range *r = pointer_lookup(ptr, &mapping);
    CUresult res = r ? pointer_attr(data, attribute, r, mapping, ptr) : CUDA_ERROR_INVALID_VALUE;
    UNLOCK();
    return res;
}

FC_API CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                       CUdeviceptr ptr)
{
    FC_ENTER("cuPointerGetAttributes");
    if (!attributes || !data) return CUDA_ERROR_INVALID_VALUE;
    int mapping;
    LOCK();
    fc_range *r = pointer_lookup(ptr, &mapping);
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!data[i]) continue;
        if (r && pointer_attr(data[i], attributes[i], r, mapping, ptr) == CUDA_SUCCESS) continue;
        /* Unknown pointers (and unsupported attributes) read as zero, like the real driver. */
        switch (attributes[i]) {
        case CU_POINTER_ATTRIBUTE_CONTEXT: case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
            *(void **)data[i] = NULL; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        case CU_POINTER_ATTRIBUTE_BUFFER_ID: case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
            *(unsigned long long *)data[i] = 0; break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data[i] = 0; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data[i] = -2; break;
        default: *(int *)data[i] = 0; break;
        }
    }
    UNLOCK();
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Page-locked host memory                                                                      */

/* Pinned memory belongs to a context, as the real driver's does: a current one is needed. */
static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags)
{
    if (!pp || !bytesize) return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED))
        return CUDA_ERROR_INVALID_VALUE;
    if (!ctx_of(cur_ctx())) return CUDA_ERROR_INVALID_CONTEXT;
    size_t len = round_up(bytesize, (size_t)sysconf(_SC_PAGESIZE));
    fc_range *r = calloc(1, sizeof *r);
    void *p = r && len >= bytesize ? map_aligned(len, 0, PROT_READ | PROT_WRITE) : NULL;
    if (!p) {
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r->base = (uintptr_t)p;
    r->size = bytesize;
    r->map_len = len;
    LOCK();
    HASH_ADD(hh, g_host, base, sizeof r->base, r);
    UNLOCK();
    CNT_ADD(host_allocs_live, 1);
    *pp = p;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    FC_ENTER("cuMemAllocHost");
    return host_alloc(pp, bytesize, 0);
}

FC_API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    FC_ENTER("cuMemHostAlloc");
    CUresult r = host_alloc(pp, bytesize, Flags);
    if (r == CUDA_SUCCESS) CNT_ADD(calls_cuMemHostAlloc, 1);
    return r;
}

/* The range of *set starting at p, taken out of it; NULL when none does. */
static fc_range *range_take(fc_range **set, const void *p)
{
    uintptr_t base = (uintptr_t)p;
    fc_range *r;
    LOCK();
    HASH_FIND(hh, *set, &base, sizeof base, r);
    if (r) HASH_DEL(*set, r);
    UNLOCK();
    return r;
}

FC_API CUresult cuMemFreeHost(void *p)
{
    FC_ENTER("cuMemFreeHost");
    fc_range *r = range_take(&g_host, p);
    if (!r) return CUDA_ERROR_INVALID_VALUE;
    munmap(p, r->map_len);
    free(r);
    CNT_SUB(host_allocs_live, 1);
    CNT_ADD(calls_cuMemFreeHost, 1);
    return CUDA_SUCCESS;
}

/* Page-locking the program's own memory: tracked, so that an overlap, an unregister of anything
 * else, or a second unregister fail as the driver's do. */
FC_API CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    FC_ENTER("cuMemHostRegister");
    uintptr_t base = (uintptr_t)p;
    if (!p || !bytesize || (Flags & ~0xFu)) return CUDA_ERROR_INVALID_VALUE;
    if (!ctx_of(cur_ctx())) return CUDA_ERROR_INVALID_CONTEXT;
    fc_range *r = calloc(1, sizeof *r), *q, *tmp;
    if (!r) return CUDA_ERROR_OUT_OF_MEMORY;
    r->base = base;
    r->size = bytesize;
    if (g_register_delay_us) { /* outside the lock, as a driver pinning pages: calls overlap */
        unsigned long long now = __atomic_add_fetch(&g_registering, 1, __ATOMIC_RELAXED);
        LOCK();
        if (now > g_cnt.host_register_peak) g_cnt.host_register_peak = now;
        UNLOCK();
        usleep((useconds_t)g_register_delay_us);
        __atomic_sub_fetch(&g_registering, 1, __ATOMIC_RELAXED);
    }
    LOCK(); /* checked and added under one hold: two overlapping registers cannot both pass */
    HASH_ITER(hh, g_registered, q, tmp) {
        if (base < q->base + q->size && q->base < base + bytesize) {
            UNLOCK();
            free(r);
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        }
    }
    HASH_ADD(hh, g_registered, base, sizeof r->base, r);
    UNLOCK();
    CNT_ADD(host_registered_live, 1);
    CNT_ADD(calls_cuMemHostRegister, 1);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemHostUnregister(void *p)
{
    FC_ENTER("cuMemHostUnregister");
    fc_range *r = range_take(&g_registered, p);
    if (!r) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    free(r);
    CNT_SUB(host_registered_live, 1);
    CNT_ADD(calls_cuMemHostUnregister, 1);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Copies and memsets: synchronous host operations                                              */

/* A copy runs in the current context, and a cuMemMap'd range takes part only when that context's
 * device was granted access to it (cuMemSetAccess): else CUDA_ERROR_INVALID_VALUE, as an H100
 * answers a cudaMemcpy of another device's VMM memory (driver 580).  Memory from cuMemAlloc
 * belongs to its context and copies from any. */
static int copy_allowed(const void *ptr, size_t n)
{
    struct fc_ctx *c = ctx_of(cur_ctx());
    if (!c) return 1; /* the copy fails later for want of a context, as before */
    uintptr_t p = (uintptr_t)ptr;
    int ok = 1;
    fc_range *m, *tmp;
    LOCK();
    HASH_ITER(hh, g_maps, m, tmp)
        if (m->base < p + n && p < m->base + m->size && m->access[c->dev] == CU_MEM_ACCESS_FLAGS_PROT_NONE) ok = 0;
    UNLOCK();
    return ok;
}

static CUresult copy_bytes(void *dst, const void *src, size_t n)
{
    if (!n) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    if (!copy_allowed(dst, n) || !copy_allowed(src, n)) return CUDA_ERROR_INVALID_VALUE;
    memmove(dst, src, n);
    __atomic_fetch_add(&g_copies_done, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

/* A synchronous copy returns once it is done: FAKECUDA_COPY_DELAY_US later. */
static CUresult copy(void *dst, const void *src, size_t n)
{
    CUresult r = copy_bytes(dst, src, n);
    unsigned long long us = __atomic_load_n(&g_copy_delay_us, __ATOMIC_RELAXED);
    if (r == CUDA_SUCCESS && us) sleep_until(now_ns() + us * 1000ULL);
    return r;
}

/* The bytes move at once, but the stream is busy FAKECUDA_COPY_DELAY_US longer, after what was
 * queued on it before: an event recorded after the copy completes then, so a caller that reads
 * the destination only after waiting for its event sees copies that take time. */
static CUresult copy_async(void *dst, const void *src, size_t n, CUstream s)
{
    LOCK();
    fc_stream *st = stream_get(s);
    if (st && g_copy_delay_us) {
        unsigned long long t = now_ns();
        st->busy_until = (st->busy_until > t ? st->busy_until : t) + g_copy_delay_us * 1000ULL;
    }
    UNLOCK();
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    if (!g_async_defer || !n) return copy_bytes(dst, src, n);
    /* checked now, as the real driver checks at the call; the bytes move at the next sync */
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    if (!copy_allowed(dst, n) || !copy_allowed(src, n)) return CUDA_ERROR_INVALID_VALUE;
    fc_pending *q = malloc(sizeof *q);
    if (!q) return CUDA_ERROR_OUT_OF_MEMORY;
    *q = (fc_pending){dst, src, n, 0, NULL};
    LOCK();
    q->seq = ++g_pending_seq;
    *g_pending_tail = q;
    g_pending_tail = &q->next;
    UNLOCK();
    return CUDA_SUCCESS;
}

/* FAKECUDA_ASYNC_DEFER: a synchronization moves the queued copies' bytes, oldest first; an
 * event's, those queued before its record (on any stream: the real driver may move them earlier). */
static void pending_flush(void) { pending_flush_through(~0ull); }

static void pending_flush_through(unsigned long long seq)
{
    LOCK();
    fc_pending *q = NULL, **cut = &g_pending;
    while (*cut && (*cut)->seq <= seq) cut = &(*cut)->next;
    if (cut != &g_pending) { /* [g_pending, *cut) move now; cut is the last one's next */
        q = g_pending;
        g_pending = *cut;
        *cut = NULL;
        if (!g_pending) g_pending_tail = &g_pending;
    }
    UNLOCK();
    while (q) {
        fc_pending *next = q->next;
        memmove(q->dst, q->src, q->n);
        __atomic_fetch_add(&g_copies_done, 1, __ATOMIC_RELEASE);
        free(q);
        q = next;
    }
}

#define DP(x) ((void *)(uintptr_t)(x))

FC_API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { FC_ENTER("cuMemcpy"); return copy(DP(dst), DP(src), n); }
FC_API CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { FC_ENTER("cuMemcpy"); return copy(DP(dst), DP(src), n); }
FC_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { FC_ENTER("cuMemcpyHtoD"); return copy(DP(dst), src, n); }
FC_API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) { FC_ENTER("cuMemcpyHtoD"); return copy(DP(dst), src, n); }
FC_API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { FC_ENTER("cuMemcpyDtoH"); return copy(dst, DP(src), n); }
FC_API CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) { FC_ENTER("cuMemcpyDtoH"); return copy(dst, DP(src), n); }
FC_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { FC_ENTER("cuMemcpyDtoD"); return copy(DP(dst), DP(src), n); }
FC_API CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { FC_ENTER("cuMemcpyDtoD"); return copy(DP(dst), DP(src), n); }

FC_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { FC_ENTER("cuMemcpyAsync"); return copy_async(DP(dst), DP(src), n, s); }
FC_API CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { FC_ENTER("cuMemcpyAsync"); return copy_async(DP(dst), DP(src), n, s); }
FC_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) { CNT_ADD(calls_cuMemcpyHtoDAsync, 1); FC_ENTER("cuMemcpyHtoDAsync"); return copy_async(DP(dst), src, n, s); }
FC_API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s) { CNT_ADD(calls_cuMemcpyHtoDAsync, 1); FC_ENTER("cuMemcpyHtoDAsync"); return copy_async(DP(dst), src, n, s); }
FC_API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) { CNT_ADD(calls_cuMemcpyDtoHAsync, 1); FC_ENTER("cuMemcpyDtoHAsync"); return copy_async(dst, DP(src), n, s); }
FC_API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s) { CNT_ADD(calls_cuMemcpyDtoHAsync, 1); FC_ENTER("cuMemcpyDtoHAsync"); return copy_async(dst, DP(src), n, s); }
FC_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { FC_ENTER("cuMemcpyDtoDAsync"); return copy_async(DP(dst), DP(src), n, s); }
FC_API CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { FC_ENTER("cuMemcpyDtoDAsync"); return copy_async(DP(dst), DP(src), n, s); }

static CUresult set8(CUdeviceptr dst, unsigned char v, size_t n)
{
    if (!n) return CUDA_SUCCESS;
    if (!dst) return CUDA_ERROR_INVALID_VALUE;
    memset(DP(dst), v, n);
    return CUDA_SUCCESS;
}

static CUresult set32(CUdeviceptr dst, unsigned int v, size_t n)
{
    if (!n) return CUDA_SUCCESS;
    if (!dst || dst % 4) return CUDA_ERROR_INVALID_VALUE;
    unsigned int *p = DP(dst);
    for (size_t i = 0; i < n; i++) p[i] = v;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n) { FC_ENTER("cuMemsetD8"); return set8(dst, uc, n); }
FC_API CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n) { FC_ENTER("cuMemsetD8"); return set8(dst, uc, n); }
FC_API CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int ui, size_t n) { FC_ENTER("cuMemsetD32"); return set32(dst, ui, n); }
FC_API CUresult cuMemsetD32_v2_ptds(CUdeviceptr dst, unsigned int ui, size_t n) { FC_ENTER("cuMemsetD32"); return set32(dst, ui, n); }

static CUresult set8_async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s)
{
    CUresult r = stream_check(s);
    return r != CUDA_SUCCESS ? r : set8(dst, uc, n);
}

static CUresult set32_async(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s)
{
    CUresult r = stream_check(s);
    return r != CUDA_SUCCESS ? r : set32(dst, ui, n);
}

FC_API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) { FC_ENTER("cuMemsetD8Async"); return set8_async(dst, uc, n, s); }
FC_API CUresult cuMemsetD8Async_ptsz(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) { FC_ENTER("cuMemsetD8Async"); return set8_async(dst, uc, n, s); }
FC_API CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s) { FC_ENTER("cuMemsetD32Async"); return set32_async(dst, ui, n, s); }
FC_API CUresult cuMemsetD32Async_ptsz(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s) { FC_ENTER("cuMemsetD32Async"); return set32_async(dst, ui, n, s); }

/* ------------------------------------------------------------------------------------------ */
/* Streams and events                                                                           */

static CUresult stream_create(CUstream *phStream, unsigned int Flags)
{
    if (!ctx_of(cur_ctx())) return CUDA_ERROR_INVALID_CONTEXT;
    if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    fc_stream *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->self = s;
    s->flags = Flags;
    LOCK();
    HASH_ADD_PTR(g_streams, self, s);
    UNLOCK();
    *phStream = (CUstream)(void *)s;
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    FC_ENTER("cuStreamCreate");
    return stream_create(phStream, Flags);
}

FC_API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    FC_ENTER("cuStreamCreateWithPriority");
    (void)priority;
    return stream_create(phStream, flags);
}

static CUresult stream_destroy(CUstream hStream)
{
    void *key = (void *)hStream;
    fc_stream *s = NULL;
    LOCK();
    if (key && hStream != CU_STREAM_LEGACY && hStream != CU_STREAM_PER_THREAD) HASH_FIND_PTR(g_streams, &key, s);
    if (!s) {
        UNLOCK();
        return CUDA_ERROR_INVALID_HANDLE;
    }
    HASH_DEL(g_streams, s);
    UNLOCK();
    free(s);
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamDestroy_v2(CUstream hStream) { FC_ENTER("cuStreamDestroy"); return stream_destroy(hStream); }
FC_API CUresult cuStreamDestroy(CUstream hStream) { FC_ENTER("cuStreamDestroy"); return stream_destroy(hStream); }

static CUresult stream_sync(CUstream hStream)
{
    LOCK();
    fc_stream *s = stream_get(hStream);
    unsigned long long t = s ? s->busy_until : 0;
    UNLOCK();
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    pending_flush();
    sleep_until(t);
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamSynchronize(CUstream hStream) { FC_ENTER("cuStreamSynchronize"); return stream_sync(hStream); }
FC_API CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    FC_ENTER("cuStreamSynchronize");
    return stream_sync(hStream ? hStream : CU_STREAM_PER_THREAD);
}

static CUresult stream_query(CUstream hStream)
{
    LOCK();
    fc_stream *s = stream_get(hStream);
    unsigned long long t = s ? s->busy_until : 0;
    UNLOCK();
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    return now_ns() < t ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

FC_API CUresult cuStreamQuery(CUstream hStream) { FC_ENTER("cuStreamQuery"); return stream_query(hStream); }
FC_API CUresult cuStreamQuery_ptsz(CUstream hStream)
{
    FC_ENTER("cuStreamQuery");
    return stream_query(hStream ? hStream : CU_STREAM_PER_THREAD);
}

static CUresult stream_wait_event(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    (void)Flags;
    LOCK();
    fc_stream *s = stream_get(hStream);
    fc_event *e = event_get(hEvent);
    if (!s || !e) {
        UNLOCK();
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (e->recorded && e->done_at > s->busy_until) s->busy_until = e->done_at;
    UNLOCK();
    CNT_ADD(calls_cuStreamWaitEvent, 1);
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    FC_ENTER("cuStreamWaitEvent");
    return stream_wait_event(hStream, hEvent, Flags);
}

FC_API CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    FC_ENTER("cuStreamWaitEvent");
    return stream_wait_event(hStream ? hStream : CU_STREAM_PER_THREAD, hEvent, Flags);
}

static CUresult begin_capture(CUstream hStream, CUstreamCaptureMode mode)
{
    if (!hStream || hStream == CU_STREAM_LEGACY) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    LOCK();
    fc_stream *s = stream_get(hStream);
    CUresult r = CUDA_SUCCESS;
    if (!s) r = CUDA_ERROR_INVALID_HANDLE;
    else if (s->capturing) r = CUDA_ERROR_ILLEGAL_STATE;
    else {
        s->capturing = 1;
        s->mode = mode;
    }
    UNLOCK();
    return r;
}

FC_API CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    FC_ENTER("cuStreamBeginCapture");
    return begin_capture(hStream, mode);
}

FC_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    FC_ENTER("cuStreamBeginCapture");
    return begin_capture(hStream ? hStream : CU_STREAM_PER_THREAD, mode);
}

FC_API CUresult cuStreamBeginCapture(CUstream hStream)
{
    FC_ENTER("cuStreamBeginCapture");
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

FC_API CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    FC_ENTER("cuStreamBeginCapture");
    return begin_capture(hStream ? hStream : CU_STREAM_PER_THREAD, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

static CUresult end_capture(CUstream hStream, CUgraph *phGraph)
{
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_stream *s = stream_get(hStream);
    CUresult r = CUDA_SUCCESS;
    if (!s) r = CUDA_ERROR_INVALID_HANDLE;
    else if (!s->capturing) r = CUDA_ERROR_ILLEGAL_STATE;
    else {
        if (s->invalidated) r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        s->capturing = s->invalidated = 0;
    }
    UNLOCK();
    if (r == CUDA_SUCCESS) *phGraph = (CUgraph)(void *)&g_dummy_graph;
    return r;
}

FC_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    FC_ENTER("cuStreamEndCapture");
    return end_capture(hStream, phGraph);
}

FC_API CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    FC_ENTER("cuStreamEndCapture");
    return end_capture(hStream ? hStream : CU_STREAM_PER_THREAD, phGraph);
}

static CUresult is_capturing(CUstream hStream, CUstreamCaptureStatus *status)
{
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_stream *s = stream_get(hStream);
    if (s)
        *status = !s->capturing    ? CU_STREAM_CAPTURE_STATUS_NONE
                  : s->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                   : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    UNLOCK();
    return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FC_API CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    FC_ENTER("cuStreamIsCapturing");
    return is_capturing(hStream, captureStatus);
}

FC_API CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    FC_ENTER("cuStreamIsCapturing");
    return is_capturing(hStream ? hStream : CU_STREAM_PER_THREAD, captureStatus);
}

FC_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    FC_ENTER("cuEventCreate");
    if (!ctx_of(cur_ctx())) return CUDA_ERROR_INVALID_CONTEXT;
    if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
    fc_event *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->self = e;
    e->flags = Flags;
    LOCK();
    HASH_ADD_PTR(g_events, self, e);
    UNLOCK();
    *phEvent = (CUevent)(void *)e;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent hEvent, CUstream hStream)
{
    CNT_ADD(calls_cuEventRecord, 1);
    LOCK();
    fc_event *e = event_get(hEvent);
    fc_stream *s = stream_get(hStream);
    if (!e || !s) {
        UNLOCK();
        return CUDA_ERROR_INVALID_HANDLE;
    }
    unsigned long long t = now_ns() + g_delay_us * 1000ULL;
    if (s->busy_until > t) t = s->busy_until;
    s->busy_until = t;
    e->recorded = 1;
    e->done_at = t;
    e->copies = g_pending_seq;
    UNLOCK();
    return CUDA_SUCCESS;
}

/* A host function runs once the stream reaches it: at once when nothing on it is late, else on a
 * thread of its own at the time the stream's work completes (FAKECUDA_EVENT_DELAY_US). */
typedef struct host_call {
    CUhostFn fn;
    void *data;
    unsigned long long at;
} host_call;

static void *host_call_run(void *arg)
{
    host_call *c = arg;
    unsigned long long now = now_ns();
    if (c->at > now) {
        struct timespec ts = {.tv_sec = (time_t)((c->at - now) / 1000000000ULL), .tv_nsec = (long)((c->at - now) % 1000000000ULL)};
        nanosleep(&ts, NULL);
    }
    c->fn(c->data);
    free(c);
    return NULL;
}

static CUresult launch_host_func(CUstream hStream, CUhostFn fn, void *data)
{
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_stream *s = stream_get(hStream);
    if (!s) {
        UNLOCK();
        return CUDA_ERROR_INVALID_HANDLE;
    }
    unsigned long long now = now_ns(), t = now + g_delay_us * 1000ULL;
    if (s->busy_until > t) t = s->busy_until;
    s->busy_until = t;
    UNLOCK();
    CNT_ADD(calls_cuLaunchHostFunc, 1);
    if (t <= now) {
        fn(data);
        return CUDA_SUCCESS;
    }
    host_call *c = malloc(sizeof *c);
    pthread_t th;
    pthread_attr_t attr;
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    *c = (host_call){.fn = fn, .data = data, .at = t};
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &attr, host_call_run, c);
    pthread_attr_destroy(&attr);
    if (rc) {
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

FC_API CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    FC_ENTER("cuLaunchHostFunc");
    return launch_host_func(hStream, fn, userData);
}

FC_API CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    FC_ENTER("cuLaunchHostFunc");
    return launch_host_func(hStream ? hStream : CU_STREAM_PER_THREAD, fn, userData);
}

FC_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { FC_ENTER("cuEventRecord"); return event_record(hEvent, hStream); }
FC_API CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    FC_ENTER("cuEventRecord");
    return event_record(hEvent, hStream ? hStream : CU_STREAM_PER_THREAD);
}

FC_API CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    FC_ENTER("cuEventRecordWithFlags");
    (void)flags;
    return event_record(hEvent, hStream);
}

FC_API CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    FC_ENTER("cuEventRecordWithFlags");
    (void)flags;
    return event_record(hEvent, hStream ? hStream : CU_STREAM_PER_THREAD);
}

FC_API CUresult cuEventQuery(CUevent hEvent)
{
    FC_ENTER("cuEventQuery");
    LOCK();
    fc_event *e = event_get(hEvent);
    unsigned long long t = e ? e->done_at : 0;
    UNLOCK();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    return now_ns() < t ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

FC_API CUresult cuEventSynchronize(CUevent hEvent)
{
    FC_ENTER("cuEventSynchronize");
    LOCK();
    fc_event *e = event_get(hEvent);
    unsigned long long t = e ? e->done_at : 0, copies = e ? e->copies : 0;
    UNLOCK();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    sleep_until(t);
    if (g_async_defer) pending_flush_through(copies);
    return CUDA_SUCCESS;
}

static CUresult event_destroy(CUevent hEvent)
{
    LOCK();
    fc_event *e = event_get(hEvent);
    if (e) HASH_DEL(g_events, e);
    UNLOCK();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    free(e);
    return CUDA_SUCCESS;
}

FC_API CUresult cuEventDestroy_v2(CUevent hEvent) { FC_ENTER("cuEventDestroy"); return event_destroy(hEvent); }
FC_API CUresult cuEventDestroy(CUevent hEvent) { FC_ENTER("cuEventDestroy"); return event_destroy(hEvent); }

/* ------------------------------------------------------------------------------------------ */
/* Legacy CUDA IPC                                                                              */

FC_API CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    FC_ENTER("cuIpcGetMemHandle");
    if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
    LOCK();
    fc_range *r = range_containing(g_allocs, (uintptr_t)dptr, 0);
    if (!r) { /* VMM mappings are not legacy-IPC capable, like on the real driver */
        UNLOCK();
        return CUDA_ERROR_INVALID_VALUE;
    }
    memset(pHandle, 0, sizeof *pHandle);
    unsigned long long words[4] = {0x616475636b6166ULL /* "fakecuda" */, (unsigned long long)getpid(),
                                   (unsigned long long)r->base, (unsigned long long)r->size};
    memcpy(pHandle->reserved, words, sizeof words);
    UNLOCK();
    return CUDA_SUCCESS;
}

FC_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    FC_ENTER("cuIpcOpenMemHandle");
    (void)pdptr;
    (void)handle;
    (void)Flags;
    return CUDA_ERROR_NOT_SUPPORTED;
}

FC_API CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    FC_ENTER("cuIpcOpenMemHandle");
    (void)pdptr;
    (void)handle;
    (void)Flags;
    return CUDA_ERROR_NOT_SUPPORTED;
}

FC_API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    FC_ENTER("cuIpcCloseMemHandle");
    (void)dptr;
    return CUDA_ERROR_INVALID_VALUE; /* nothing can have been opened */
}

/* ------------------------------------------------------------------------------------------ */
/* Pre-3.2 entry points with 32-bit device pointers: reaching one is always a bug.              */

static CUresult legacy(const char *name)
{
    CNT_ADD(calls_legacy_abi, 1);
    fprintf(stderr, "fakecuda: legacy 32-bit entry point %s called\n", name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

FC_API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) { (void)dptr; (void)bytesize; return legacy("cuMemAlloc"); }
FC_API CUresult cuMemFree(CUdeviceptr_v1 dptr) { (void)dptr; return legacy("cuMemFree"); }
FC_API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total) { (void)free_bytes; (void)total; return legacy("cuMemGetInfo"); }
FC_API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int w, unsigned int h, unsigned int e)
{
    (void)dptr; (void)pPitch; (void)w; (void)h; (void)e;
    return legacy("cuMemAllocPitch");
}
FC_API CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 dptr)
{
    (void)pbase; (void)psize; (void)dptr;
    return legacy("cuMemGetAddressRange");
}
FC_API CUresult cuMemcpyHtoD(CUdeviceptr_v1 dst, const void *src, unsigned int n) { (void)dst; (void)src; (void)n; return legacy("cuMemcpyHtoD"); }
FC_API CUresult cuMemcpyDtoH(void *dst, CUdeviceptr_v1 src, unsigned int n) { (void)dst; (void)src; (void)n; return legacy("cuMemcpyDtoH"); }
FC_API CUresult cuMemcpyDtoD(CUdeviceptr_v1 dst, CUdeviceptr_v1 src, unsigned int n) { (void)dst; (void)src; (void)n; return legacy("cuMemcpyDtoD"); }
FC_API CUresult cuMemAllocHost(void **pp, unsigned int bytesize) { (void)pp; (void)bytesize; return legacy("cuMemAllocHost"); }
FC_API CUresult cuMemsetD8(CUdeviceptr_v1 dst, unsigned char uc, unsigned int n) { (void)dst; (void)uc; (void)n; return legacy("cuMemsetD8"); }
FC_API CUresult cuMemsetD32(CUdeviceptr_v1 dst, unsigned int ui, unsigned int n) { (void)dst; (void)ui; (void)n; return legacy("cuMemsetD32"); }
FC_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) { (void)bytes; (void)dev; return legacy("cuDeviceTotalMem"); }

/* ------------------------------------------------------------------------------------------ */
/* cuGetProcAddress                                                                             */

FC_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus);

struct fc_sym {
    const char *name;
    int min_version; /* first cudaVersion that gets this entry point */
    fc_fn fn, ptsz;
};

/* The table, as an X-macro so that every entry point also gets a hidden alias: the addresses
 * handed out are this library's own, bound at link time like NVIDIA's driver does (a plain
 * address of an exported function would be resolved through the dynamic linker, so an
 * LD_PRELOADed library defining the same name would silently replace the answer).
 * Entries of one name are listed newest first. */
#define FC_SYM_TABLE(S, P) \
    S("cuInit", 2000, cuInit)                                                                   \
    S("cuDriverGetVersion", 2020, cuDriverGetVersion)                                           \
    S("cuGetErrorName", 6000, cuGetErrorName)                                                   \
    S("cuGetErrorString", 6000, cuGetErrorString)                                               \
    S("cuGetProcAddress", 12000, cuGetProcAddress_v2)                                           \
    S("cuGetProcAddress", 11030, cuGetProcAddress)                                              \
    S("cuDeviceGetCount", 2000, cuDeviceGetCount)                                               \
    S("cuDeviceGet", 2000, cuDeviceGet)                                                         \
    S("cuDeviceGetName", 2000, cuDeviceGetName)                                                 \
    S("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2)                                             \
    S("cuDeviceGetUuid", 9020, cuDeviceGetUuid)                                                 \
    S("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2)                                            \
    S("cuDeviceTotalMem", 2000, cuDeviceTotalMem)                                               \
    S("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute)                                       \
    S("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer)                                     \
    S("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain)                               \
    S("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2)                         \
    S("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease)                             \
    S("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2)                             \
    S("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset)                                 \
    S("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState)                           \
    S("cuCtxGetCurrent", 4000, cuCtxGetCurrent)                                                 \
    S("cuCtxSetCurrent", 4000, cuCtxSetCurrent)                                                 \
    S("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2)                                            \
    S("cuCtxPushCurrent", 2000, cuCtxPushCurrent)                                               \
    S("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2)                                              \
    S("cuCtxPopCurrent", 2000, cuCtxPopCurrent)                                                 \
    S("cuCtxGetDevice", 2000, cuCtxGetDevice)                                                   \
    S("cuCtxSynchronize", 2000, cuCtxSynchronize)                                               \
    S("cuCtxEnablePeerAccess", 4000, cuCtxEnablePeerAccess)                                     \
    S("cuCtxDisablePeerAccess", 4000, cuCtxDisablePeerAccess)                                   \
    S("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity)                    \
    S("cuMemAddressReserve", 10020, cuMemAddressReserve)                                        \
    S("cuMemAddressFree", 10020, cuMemAddressFree)                                              \
    S("cuMemCreate", 10020, cuMemCreate)                                                        \
    S("cuMemRelease", 10020, cuMemRelease)                                                      \
    S("cuMemMap", 10020, cuMemMap)                                                              \
    S("cuMemUnmap", 10020, cuMemUnmap)                                                          \
    S("cuMemSetAccess", 10020, cuMemSetAccess)                                                  \
    S("cuMemGetAccess", 10020, cuMemGetAccess)                                                  \
    S("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle)                      \
    S("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle)                  \
    S("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle)  \
    S("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle)                        \
    S("cuMemAlloc", 3020, cuMemAlloc_v2)                                                        \
    S("cuMemAlloc", 2000, cuMemAlloc)                                                           \
    S("cuMemAllocPitch", 3020, cuMemAllocPitch_v2)                                              \
    S("cuMemAllocPitch", 2000, cuMemAllocPitch)                                                 \
    S("cuMemAllocManaged", 6000, cuMemAllocManaged)                                             \
    S("cuMemFree", 3020, cuMemFree_v2)                                                          \
    S("cuMemFree", 2000, cuMemFree)                                                             \
    P("cuMemAllocAsync", 11020, cuMemAllocAsync, cuMemAllocAsync_ptsz)                          \
    P("cuMemFreeAsync", 11020, cuMemFreeAsync, cuMemFreeAsync_ptsz)                             \
    P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz)  \
    S("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool)                            \
    S("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool)                                          \
    S("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool)                                          \
    S("cuMemGetDefaultMemPool", 13000, cuMemGetDefaultMemPool)                                  \
    S("cuMemGetMemPool", 13000, cuMemGetMemPool)                                                \
    S("cuMemSetMemPool", 13000, cuMemSetMemPool)                                                \
    S("cuMemPoolCreate", 11020, cuMemPoolCreate)                                                \
    S("cuMemPoolDestroy", 11020, cuMemPoolDestroy)                                              \
    S("cuMemPoolSetAccess", 11020, cuMemPoolSetAccess)                                          \
    S("cuMemPoolGetAccess", 11020, cuMemPoolGetAccess)                                          \
    S("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute)                                    \
    S("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute)                                    \
    S("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo)                                                \
    S("cuMemGetInfo", 3020, cuMemGetInfo_v2)                                                    \
    S("cuMemGetInfo", 2000, cuMemGetInfo)                                                       \
    S("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2)                                    \
    S("cuMemGetAddressRange", 2000, cuMemGetAddressRange)                                       \
    S("cuPointerGetAttribute", 4000, cuPointerGetAttribute)                                     \
    S("cuMemAllocHost", 3020, cuMemAllocHost_v2)                                                \
    S("cuMemAllocHost", 2000, cuMemAllocHost)                                                   \
    S("cuMemHostAlloc", 2020, cuMemHostAlloc)                                                   \
    S("cuMemFreeHost", 2000, cuMemFreeHost)                                                     \
    S("cuMemHostRegister", 6050, cuMemHostRegister_v2)                                          \
    S("cuMemHostUnregister", 4000, cuMemHostUnregister)                                         \
    S("cuPointerGetAttributes", 7000, cuPointerGetAttributes)                                   \
    P("cuMemcpy", 4000, cuMemcpy, cuMemcpy_ptds)                                                \
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds)                              \
    S("cuMemcpyHtoD", 2000, cuMemcpyHtoD)                                                       \
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds)                              \
    S("cuMemcpyDtoH", 2000, cuMemcpyDtoH)                                                       \
    P("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds)                              \
    S("cuMemcpyDtoD", 2000, cuMemcpyDtoD)                                                       \
    P("cuMemcpyAsync", 4000, cuMemcpyAsync, cuMemcpyAsync_ptsz)                                 \
    P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz)               \
    P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz)               \
    P("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz)               \
    P("cuMemsetD8", 3020, cuMemsetD8_v2, cuMemsetD8_v2_ptds)                                    \
    S("cuMemsetD8", 2000, cuMemsetD8)                                                           \
    P("cuMemsetD32", 3020, cuMemsetD32_v2, cuMemsetD32_v2_ptds)                                 \
    S("cuMemsetD32", 2000, cuMemsetD32)                                                         \
    P("cuMemsetD8Async", 3020, cuMemsetD8Async, cuMemsetD8Async_ptsz)                           \
    P("cuMemsetD32Async", 3020, cuMemsetD32Async, cuMemsetD32Async_ptsz)                        \
    S("cuStreamCreate", 2000, cuStreamCreate)                                                   \
    S("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority)                           \
    S("cuStreamDestroy", 4000, cuStreamDestroy_v2)                                              \
    S("cuStreamDestroy", 2000, cuStreamDestroy)                                                 \
    P("cuStreamSynchronize", 2000, cuStreamSynchronize, cuStreamSynchronize_ptsz)               \
    P("cuStreamQuery", 2000, cuStreamQuery, cuStreamQuery_ptsz)                                 \
    P("cuStreamWaitEvent", 3020, cuStreamWaitEvent, cuStreamWaitEvent_ptsz)                     \
    P("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz)     \
    P("cuStreamBeginCapture", 10000, cuStreamBeginCapture, cuStreamBeginCapture_ptsz)           \
    P("cuStreamEndCapture", 10000, cuStreamEndCapture, cuStreamEndCapture_ptsz)                 \
    P("cuStreamIsCapturing", 10000, cuStreamIsCapturing, cuStreamIsCapturing_ptsz)              \
    S("cuEventCreate", 2000, cuEventCreate)                                                     \
    P("cuEventRecord", 2000, cuEventRecord, cuEventRecord_ptsz)                                 \
    P("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags, cuEventRecordWithFlags_ptsz)     \
    S("cuEventQuery", 2000, cuEventQuery)                                                       \
    S("cuEventSynchronize", 2000, cuEventSynchronize)                                           \
    S("cuEventDestroy", 4000, cuEventDestroy_v2)                                                \
    S("cuEventDestroy", 2000, cuEventDestroy)                                                   \
    S("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle)                                             \
    S("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2)                                       \
    S("cuIpcOpenMemHandle", 4010, cuIpcOpenMemHandle)                                           \
    S("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle)

#define FC_LOCAL_ALIAS(fn) extern __typeof__(fn) fc_local_##fn __attribute__((alias(#fn), visibility("hidden")));
#define ALIAS_S(name, min, fn) FC_LOCAL_ALIAS(fn)
#define ALIAS_P(name, min, fn, ptsz) FC_LOCAL_ALIAS(fn) FC_LOCAL_ALIAS(ptsz)
FC_SYM_TABLE(ALIAS_S, ALIAS_P)
#undef ALIAS_S
#undef ALIAS_P
#undef FC_LOCAL_ALIAS

#define S(name, min, fn) {name, min, (fc_fn)fc_local_##fn, NULL},
#define P(name, min, fn, ptsz) {name, min, (fc_fn)fc_local_##fn, (fc_fn)fc_local_##ptsz},
static const struct fc_sym g_syms[] = {FC_SYM_TABLE(S, P)};
#undef S
#undef P

static int sym_known(const char *base)
{
    for (size_t i = 0; i < sizeof g_syms / sizeof g_syms[0]; i++)
        if (!strcmp(g_syms[i].name, base)) return 1;
    return 0;
}

static CUresult proc_lookup(const void *caller, const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                            CUdriverProcAddressQueryResult *status)
{
    CNT_ADD(calls_cuGetProcAddress, 1);
    CUresult fc_r_ = fc_enter("cuGetProcAddress", 0, caller);
    if (fc_r_ != CUDA_SUCCESS) return fc_r_;
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof g_syms / sizeof g_syms[0]; i++) {
        if (strcmp(g_syms[i].name, symbol)) continue;
        known = 1;
        if (cudaVersion < g_syms[i].min_version) continue;
        fc_fn f = g_syms[i].fn;
        if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && g_syms[i].ptsz) f = g_syms[i].ptsz;
        memcpy(pfn, &f, sizeof f);
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    if (status) *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus)
{
    return proc_lookup(FC_CALLER, symbol, pfn, cudaVersion, flags, symbolStatus);
}

FC_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult r = proc_lookup(FC_CALLER, symbol, pfn, cudaVersion, flags, &status);
    /* The first ABI has no status: a miss is CUDA_ERROR_NOT_FOUND. */
    return r == CUDA_SUCCESS && status != CU_GET_PROC_ADDRESS_SUCCESS ? CUDA_ERROR_NOT_FOUND : r;
}
