/* VMM backing: the mechanism under the pool (shim/pool decides where allocations go).  Each
 * device has two pools, as natively cudaMalloc memory and the default pool's are apart: one for
 * synchronous allocations, one for stream-ordered ones.  A pool reserves large arenas of address
 * space once and maps segments (one cuMemCreate handle each, POSIX-fd exportable) into them where
 * allocations need memory; every allocation is published in the registry with the segments it
 * spans, and the broker exports them.  Freed memory goes back to the device after an idle delay
 * (VMMSHIM_GIVE_BACK_MS), from a thread of the shim's own, so a program that frees and makes no
 * further call still gives it back.  Stream-ordered frees become reusable once an event shows the
 * stream reached them (at once on the same stream): the pool asks through the event callbacks. */
#include "backing/backing.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uthash.h>

#include "backing/adopt.h"
#include "backing/frames.h"
#include "backing/preexport.h"
#include "broker/broker.h"
#include "broker/protocol.h"
#include "core/log.h"
#include "core/options.h"
#include "hooks/real.h"
#include "pool/pool.h"
#include "registry/keep.h"
#include "registry/registry.h"

#define MAX_DEVICES 64
#define NO_SLOT UINT32_MAX

/* A segment as the mechanism knows it (the pool's vmm__seg has its place and size). */
typedef struct vseg {
    CUmemGenericAllocationHandle handle;
    int dev, exported_fd, has_fabric;
    /* The fd the broker hands out duplicates of: exported at the first request for the segment
     * (an export costs ~0.6 ms on an H100, a dup microseconds), kept above 1023 like exported_fd;
     * -1 until then, or for good when no such fd number is free (each request exports then). */
    int broker_fd;
    /* Broker threads exporting its handle with S.lock let go (an export is ~0.6 ms the owner's
     * allocator would otherwise wait); a segment destroyed meanwhile is unmapped at once and
     * `dead`: the last of them releases its handle and frees it. */
    unsigned exporting;
    int dead;
    uint64_t id;
    uint8_t fabric[64];
} vseg;

/* An allocation the real allocator made, which the shim only notes in the registry. */
typedef struct note {
    uint64_t va;
    uint32_t slot;
    int dev;
    UT_hash_handle hh;
} note;

typedef struct device_state {
    int checked, usable, fabric;
    int index;
    uint64_t accessors; /* other devices granted access to this device's chunks (peer access) */
    uint64_t peers;     /* devices that can reach this one: cudaMalloc's segments are theirs to copy from */
    CUcontext primary;
    size_t granularity;
    uint8_t uuid[16];
    vmm__pool pool[2];          /* [0] synchronous allocations, [1] stream-ordered (the default pool's) */
    int pool_ready;
    int custom_pool;            /* the program made another pool current: stream-ordered calls pass */
    uint64_t release_threshold; /* the default pool's, as the program set it */
    CUevent *events;            /* pool of timing-free events */
    size_t n_events, cap_events;
} device_state;

/* Driver entry points, resolved once. */
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*CtxSynchronize)(void);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
    CUresult (*DeviceTotalMem)(size_t *, CUdevice);
    CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                           unsigned long long);
    CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventQuery)(CUevent);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*StreamIsCapturing)(CUstream, CUstreamCaptureStatus *);
} cu;

static struct {
    pthread_mutex_t lock; /* every table and pool below */
    int ready;  /* 1: backing active; 0: pass every call through */
    int failed; /* the start failed (strict mode refuses instead of passing through) */
    int export_pidfd;
    int isolate;
    vmm__reg reg;
    int registry_ok;
    char broker_path[112];
    int broker_started;
    unsigned long kept_fds;        /* segments' broker_fd kept open (preexport.c bounds its own by it) */
    vmm__block *by_addr, *by_slot; /* live allocations */
    vmm__block *deferred;          /* freed while a stream captured, not yet synchronized (via fnext) */
    note *notes;                   /* by address */
    uint64_t next_chunk_id;
    uint64_t cache_limit;          /* bytes of empty synchronous memory kept past the give-back delay */
    uint64_t hold_limit;           /* bytes of it that may wait out the delay (at least cache_limit) */
    uint64_t give_back_ns;
    pthread_cond_t purge_wake;     /* the give-back thread waits on it (CLOCK_MONOTONIC) */
    int purge_state;               /* 0 not started, 1 waiting for work, 2 waiting for a deadline, -1 could not start */
    int stopping;                  /* at exit: no more driver calls from the give-back thread */
    uint64_t free_seq;             /* stream-ordered frees so far: orders them against synchronizations */
    char tag[32];
    device_state dev[MAX_DEVICES];
} S = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Streams being captured right now, process-wide (vmm__capture_begun). */
static int captures;

/* What a synchronization has to do (backing.h): read by the synchronize hooks first. */
vmm__sync_flags vmm__sync;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* The coverage counters (layout.h, COVERAGE) live in this process's registry record once it is
 * attached, so companions see them; until then, and in a process the registry never sees (the
 * shim disabled), here, so VMMSHIM_STATS can report them.  A disabled process never registers:
 * its count has no field in the record. */
static vmm_reg_proc local_coverage;
static vmm_reg_proc *coverage = &local_coverage;
static uint64_t passed_disabled;

static void count(uint64_t *counter) { __atomic_add_fetch(counter, 1, __ATOMIC_RELAXED); }
static vmm_reg_proc *coverage_now(void) { return __atomic_load_n(&coverage, __ATOMIC_ACQUIRE); }

#define STR_(x) #x
#define STR(x) STR_(x)
/* cuda.h maps API names to their current ABI names (cuMemAlloc -> cuMemAlloc_v2); stringify
 * after expansion so dlsym asks for the exact exported symbol. */
#define LOAD(field, api) (*(void **)&cu.field = vmm__real_driver(STR(api)))

static int load_driver(char *why, size_t len)
{
    if (!vmm__real_libcuda(why, len)) return -1;
    int ok = LOAD(Init, cuInit) && LOAD(CtxGetCurrent, cuCtxGetCurrent) && LOAD(CtxSetCurrent, cuCtxSetCurrent) &&
             LOAD(CtxGetDevice, cuCtxGetDevice) && LOAD(CtxSynchronize, cuCtxSynchronize) &&
             LOAD(CtxPushCurrent, cuCtxPushCurrent) && LOAD(CtxPopCurrent, cuCtxPopCurrent) &&
             LOAD(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain) && LOAD(DeviceGetAttribute, cuDeviceGetAttribute) &&
             LOAD(DeviceGetCount, cuDeviceGetCount) && LOAD(DeviceCanAccessPeer, cuDeviceCanAccessPeer) &&
             LOAD(DeviceGetUuid, cuDeviceGetUuid) && LOAD(DeviceTotalMem, cuDeviceTotalMem) && LOAD(MemGetAllocationGranularity, cuMemGetAllocationGranularity) &&
             LOAD(MemCreate, cuMemCreate) && LOAD(MemRelease, cuMemRelease) &&
             LOAD(MemAddressReserve, cuMemAddressReserve) && LOAD(MemAddressFree, cuMemAddressFree) &&
             LOAD(MemMap, cuMemMap) && LOAD(MemUnmap, cuMemUnmap) && LOAD(MemSetAccess, cuMemSetAccess) &&
             LOAD(MemExportToShareableHandle, cuMemExportToShareableHandle) &&
             LOAD(MemImportFromShareableHandle, cuMemImportFromShareableHandle) && LOAD(EventCreate, cuEventCreate) &&
             LOAD(EventRecord, cuEventRecord) && LOAD(EventQuery, cuEventQuery) &&
             LOAD(EventSynchronize, cuEventSynchronize) && LOAD(EventDestroy, cuEventDestroy) &&
             LOAD(StreamSynchronize, cuStreamSynchronize) && LOAD(StreamIsCapturing, cuStreamIsCapturing);
    if (!ok) {
        snprintf(why, len, "libcuda.so.1 lacks the VMM entry points");
        return -1;
    }
    return 0;
}

/* 1.2 GiB: the size a person reads, formatted without allocating. */
static const char *human_size(uint64_t v, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int u = 0;
    double d = (double)v;
    while (u < 6 && d >= 1024.0) d /= 1024.0, u++;
    snprintf(buf, len, u ? "%.1f %s" : "%.0f %s", d, units[u]);
    return buf;
}

/* VMMSHIM_STATS=1: one line, like MIMALLOC_SHOW_STATS, whatever the log level. */
static void print_coverage(const vmm_reg_proc *c)
{
    uint64_t made = __atomic_load_n(&c->allocs, __ATOMIC_RELAXED), dis = __atomic_load_n(&passed_disabled, __ATOMIC_RELAXED);
    uint64_t cap = __atomic_load_n(&c->passed_capture, __ATOMIC_RELAXED), full = __atomic_load_n(&c->passed_device_full, __ATOMIC_RELAXED);
    uint64_t uns = __atomic_load_n(&c->passed_unsupported, __ATOMIC_RELAXED), maps = __atomic_load_n(&c->maps_adopted, __ATOMIC_RELAXED);
    char peak[32];
    vmm__log_report("stats: pid %d: %llu allocation%s, %llu backed and exportable, %llu passed through (capture %llu, "
                    "device full %llu, unsupported %llu, disabled %llu), %llu cuMemMap range%s adopted, peak %s",
                    (int)getpid(), (unsigned long long)(made + dis), made + dis == 1 ? "" : "s",
                    (unsigned long long)__atomic_load_n(&c->allocs_backed, __ATOMIC_RELAXED),
                    (unsigned long long)(cap + full + uns + dis), (unsigned long long)cap, (unsigned long long)full,
                    (unsigned long long)uns, (unsigned long long)dis, (unsigned long long)maps, maps == 1 ? "" : "s",
                    human_size(__atomic_load_n(&c->peak_requested, __ATOMIC_RELAXED), peak, sizeof peak));
}

static int exit_status; /* what exit() was given (on_exit): a keeper keeps what a failed process leaves */
static int keep_at_exit = -1; /* keep_exiting's answer, once it ran: leave the records for a keeper */

/* exit() handlers run last registered first: this one, registered once the broker runs, comes
 * before the broker's own (which unlinks its socket), so that a keeper can still take what it has
 * not yet (registry/layout.h KEEP). */
static void keep_exiting(int status, void *arg)
{
    (void)arg;
    if (S.registry_ok) __atomic_store_n(&keep_at_exit, vmm__keep_exiting(&S.reg, status), __ATOMIC_RELEASE);
}

static void at_exit(void)
{
    pthread_mutex_lock(&S.lock);
    S.stopping = 1; /* CUDA may be torn down next: the give-back thread makes no more calls */
    pthread_mutex_unlock(&S.lock);
    /* Pure shared-memory work: CUDA may already be torn down at exit.  The counters move back
     * here first: once detached, the record may be another process's. */
    if (S.registry_ok) {
        const vmm_reg_proc *c = coverage_now();
        uint64_t *to[] = {&local_coverage.allocs, &local_coverage.allocs_backed, &local_coverage.passed_capture,
                          &local_coverage.passed_device_full, &local_coverage.passed_unsupported,
                          &local_coverage.maps_adopted, &local_coverage.peak_requested};
        const uint64_t *from[] = {&c->allocs, &c->allocs_backed, &c->passed_capture, &c->passed_device_full,
                                  &c->passed_unsupported, &c->maps_adopted, &c->peak_requested};
        for (size_t i = 0; i < sizeof to / sizeof to[0]; i++)
            __atomic_store_n(to[i], __atomic_load_n(from[i], __ATOMIC_RELAXED), __ATOMIC_RELAXED);
        __atomic_store_n(&coverage, &local_coverage, __ATOMIC_RELEASE);
        /* A process that a keeper keeps and that fails leaves its records (names, frames) as a
         * crash leaves them, for the keeper to keep (registry/layout.h KEEP). */
        int keep = __atomic_load_n(&keep_at_exit, __ATOMIC_ACQUIRE);
        if (keep < 0) keep = vmm__keep_exiting(&S.reg, exit_status);
        if (!keep) {
            vmm__reg_detach(&S.reg);
            vmm__frames_exit();
        }
    }
    if (vmm__opt_bool(VMM__OPT_STATS)) print_coverage(&local_coverage);
    if (vmm__opt_bool(VMM__OPT_VERBOSE))
        for (int i = 0; i < MAX_DEVICES; i++)
            for (int k = 0; k < 2 && S.dev[i].pool_ready; k++) {
                const vmm__pool *p = &S.dev[i].pool[k];
                vmm__log(VMM__LOG_INFO, "device %d %s pool: %llu segments made, %llu given back; peak %llu MiB reserved, %llu MiB used",
                         i, k ? "stream-ordered" : "synchronous", (unsigned long long)p->segs_made,
                         (unsigned long long)p->segs_released, (unsigned long long)(p->reserved_high >> 20),
                         (unsigned long long)(p->used_high >> 20));
            }
}

/* The child has made no allocation yet, whatever its parent counted. */
static void coverage_after_fork(void)
{
    memset(&local_coverage, 0, sizeof local_coverage);
    passed_disabled = 0;
    coverage = &local_coverage;
}

/* The parent's tables as a fork child inherited them: never used there, never freed (another
 * thread of the parent may have been changing them at the fork), only kept reachable, so that a
 * leak checker (the ASan build's) does not blame the child for what it never allocated.
 * Volatile: stores nothing reads would be optimised away. */
static volatile struct {
    vmm__block *by_addr, *by_slot;
    note *notes;
    struct {
        vmm__pool pool[2];
        CUevent *events;
    } dev[MAX_DEVICES];
} inherited;

static void purge_cond_init(void);

static void after_fork_child(void)
{
    /* The child owns none of its parent's memory: forget it all, and start afresh if it ever
     * allocates (CUDA itself is not usable across fork unless the child re-initialises). */
    pthread_mutex_init(&S.lock, NULL);
    inherited.by_addr = S.by_addr;
    inherited.by_slot = S.by_slot;
    inherited.notes = S.notes;
    for (int i = 0; i < MAX_DEVICES; i++) {
        memcpy((void *)inherited.dev[i].pool, S.dev[i].pool, sizeof S.dev[i].pool);
        inherited.dev[i].events = S.dev[i].events;
    }
    S.by_addr = S.by_slot = NULL; /* parent's segments leak in the child by design */
    /* Never pthread_cond_destroy: it waits for the parent's give-back thread, which waited on it
     * at the fork and does not exist here, forever. */
    memset(&S.purge_wake, 0, sizeof S.purge_wake);
    purge_cond_init();
    S.purge_state = 0; /* the parent's give-back thread is not here */
    S.notes = NULL;
    S.deferred = NULL;
    __atomic_store_n(&captures, 0, __ATOMIC_RELAXED); /* the parent's capturing threads are not here */
    memset(S.dev, 0, sizeof S.dev);
    if (S.registry_ok) vmm__reg_forget_after_fork(&S.reg);
    S.broker_started = 0;
    S.broker_path[0] = 0;
    S.kept_fds = 0;
    vmm__broker_forget_after_fork();
    vmm__preexport_forget_after_fork();
    if (S.registry_ok && vmm__reg_attach(&S.reg, "") != 0) S.registry_ok = 0;
    if (S.registry_ok) {
        coverage = vmm__reg_self(&S.reg);
        vmm__frames_after_fork(&S.reg);
    }
}

static void at_exit_status(int status, void *arg)
{
    (void)arg;
    exit_status = status;
    at_exit();
}

static void purge_cond_init(void)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&S.purge_wake, &ca);
    pthread_condattr_destroy(&ca);
}

static void init(void)
{
    int opt_rc = vmm__opt_init();
    /* Before anything can make the shim pass calls through: those are counted too. */
    on_exit(at_exit_status, NULL); /* atexit's, with the status: a keeper learns it */
    pthread_atfork(NULL, NULL, coverage_after_fork);
    if (vmm__opt_bool(VMM__OPT_VERBOSE)) vmm__log(VMM__LOG_INFO, "backing allocations with exportable VMM memory");
    if (opt_rc != 0) {
        S.failed = 1;
        return; /* strict mode refused an option; the message is out already */
    }
    if (!vmm__opt_bool(VMM__OPT_ENABLE)) return;
    char why[200];
    if (load_driver(why, sizeof why) != 0) {
        vmm__log(vmm__opt_bool(VMM__OPT_STRICT) ? VMM__LOG_ERROR : VMM__LOG_WARNING,
                 "cannot use the CUDA driver (%s); passing every call through", why);
        S.failed = 1;
        return;
    }
    S.export_pidfd = vmm__opt_enum(VMM__OPT_EXPORT) == 1;
    S.cache_limit = vmm__opt_size(VMM__OPT_CACHE_SIZE);
    S.hold_limit = vmm__opt_size(VMM__OPT_GIVE_BACK_HOLD);
    if (S.hold_limit < S.cache_limit) S.hold_limit = S.cache_limit;
    S.give_back_ns = (uint64_t)vmm__opt_int(VMM__OPT_GIVE_BACK_MS) * 1000000u;
    purge_cond_init();
    S.isolate = vmm__opt_bool(VMM__OPT_ISOLATE);
    snprintf(S.tag, sizeof S.tag, "%s", vmm__opt_str(VMM__OPT_TAG));
    const char *name = vmm__opt_str(VMM__OPT_REGISTRY);
    int rc = vmm__reg_open(&S.reg, *name ? name : NULL, VMM__REG_CREATE, (uint64_t)vmm__opt_int(VMM__OPT_REGISTRY_CAPACITY),
                           vmm__opt_str(VMM__OPT_REGISTRY_GROUP), why, sizeof why);
    if (rc == 0 && (rc = vmm__reg_attach(&S.reg, "")) != 0) {
        snprintf(why, sizeof why, "cannot register this process: %s", strerror(-rc));
        vmm__reg_close(&S.reg);
    }
    if (rc != 0) {
        vmm__log(vmm__opt_bool(VMM__OPT_STRICT) ? VMM__LOG_ERROR : VMM__LOG_WARNING, "%s; passing every call through", why);
        S.failed = 1;
        return;
    }
    S.registry_ok = 1;
    __atomic_store_n(&coverage, vmm__reg_self(&S.reg), __ATOMIC_RELEASE);
    vmm__frames_init((int)vmm__opt_int(VMM__OPT_FRAMES), &S.reg);
    pthread_atfork(NULL, NULL, after_fork_child);
    S.ready = 1;
}

static int ensure_init(void)
{
    pthread_once(&init_once, init);
    return S.ready;
}

/* ---- devices ---- */

static int fabric_self_test(int dev)
{
    CUmemAllocationProp p = {0};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h, h2;
    if (cu.MemCreate(&h, S.dev[dev].granularity, &p, 0) != CUDA_SUCCESS) return 0;
    CUmemFabricHandle fh;
    int ok = cu.MemExportToShareableHandle(&fh, h, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_SUCCESS &&
             cu.MemImportFromShareableHandle(&h2, &fh, CU_MEM_HANDLE_TYPE_FABRIC) == CUDA_SUCCESS;
    if (ok) cu.MemRelease(h2);
    cu.MemRelease(h);
    return ok;
}

/* The device an allocation lands on: the current context's.  Runtime calls on a thread with no
 * context bind the primary context of the runtime's current device, as cudaMalloc does; driver
 * calls (bind_primary 0) leave that case to the real driver, which reports it. */
static int current_device(CUcontext *ctx_out, int bind_primary)
{
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (cu.CtxGetCurrent(&ctx) == CUDA_ERROR_NOT_INITIALIZED) {
        if (!bind_primary || cu.Init(0) != CUDA_SUCCESS) return -1;
        cu.CtxGetCurrent(&ctx);
    }
    if (!ctx && !bind_primary) return -1; /* the driver API answers that itself */
    if (!ctx) {
        int (*get_device)(int *);
        void *sym = vmm__real_runtime("cudaGetDevice", NULL);
        memcpy(&get_device, &sym, sizeof sym);
        int d = 0;
        if (get_device) {
            vmm__enter();
            get_device(&d);
            vmm__leave();
        }
        if (d < 0 || d >= MAX_DEVICES) return -1;
        ctx = __atomic_load_n(&S.dev[d].primary, __ATOMIC_ACQUIRE);
        if (!ctx) {
            CUcontext fresh = NULL, none = NULL;
            if (cu.DevicePrimaryCtxRetain(&fresh, d) != CUDA_SUCCESS) return -1;
            /* threads binding at once each retain it: one harmless extra reference to the same context */
            ctx = __atomic_compare_exchange_n(&S.dev[d].primary, &none, fresh, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) ? fresh
                                                                                                                   : none;
        }
        if (cu.CtxSetCurrent(ctx) != CUDA_SUCCESS) return -1;
    }
    if (cu.CtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES) return -1;
    *ctx_out = ctx;
    return dev;
}

static int device_usable(int dev)
{
    device_state *d = &S.dev[dev];
    if (__atomic_load_n(&d->checked, __ATOMIC_ACQUIRE)) return d->usable;
    pthread_mutex_lock(&S.lock);
    if (!d->checked) {
        d->index = dev;
        int vmm = 0, posix = 0;
        cu.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
        cu.DeviceGetAttribute(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
        CUmemAllocationProp p = {0};
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = dev;
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        if (vmm && posix && cu.MemGetAllocationGranularity(&d->granularity, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS &&
            d->granularity) {
            d->usable = 1;
            int count = 0, can = 0;
            if (cu.DeviceGetCount(&count) != CUDA_SUCCESS) count = 0;
            for (int i = 0; i < count && i < MAX_DEVICES; i++)
                if (i != dev && cu.DeviceCanAccessPeer(&can, i, dev) == CUDA_SUCCESS && can) d->peers |= 1ull << i;
            CUuuid u;
            if (cu.DeviceGetUuid(&u, dev) == CUDA_SUCCESS) memcpy(d->uuid, u.bytes, 16);
            int fabric_attr = 0;
            cu.DeviceGetAttribute(&fabric_attr, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev);
            d->fabric = vmm__opt_enum(VMM__OPT_FABRIC) == 0 && fabric_attr && fabric_self_test(dev);
            vmm__log(VMM__LOG_INFO, "device %d: VMM with POSIX fd export, granularity %zu, fabric %s", dev,
                     d->granularity, d->fabric ? "on" : "off");
        } else {
            vmm__log(vmm__opt_bool(VMM__OPT_STRICT) ? VMM__LOG_ERROR : VMM__LOG_WARNING,
                     "device %d lacks VMM or POSIX fd export; its allocations pass through", dev);
        }
        __atomic_store_n(&d->checked, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&S.lock);
    return d->usable;
}

/* ---- segments: the mechanism the pool calls (under S.lock) ---- */

static void export_seg(vseg *c)
{
    if (S.export_pidfd) {
        int fd = -1;
        if (cu.MemExportToShareableHandle(&fd, c->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_SUCCESS) {
            c->exported_fd = fcntl(fd, F_DUPFD_CLOEXEC, 1024); /* above 1023 so select() users never see it */
            close(fd);
        }
    }
    if (S.dev[c->dev].fabric &&
        cu.MemExportToShareableHandle(c->fabric, c->handle, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_SUCCESS)
        c->has_fabric = 1;
}

/* Give back a segment's mapping and handle, as far as they exist, each call made twice if need
 * be (VMM__TWICE); what still fails stays with the driver until the process exits (one warning). */
static void seg_undo(CUdeviceptr va, uint64_t size, CUmemGenericAllocationHandle h, int mapped)
{
    CUresult unmap = mapped ? VMM__TWICE(cu.MemUnmap(va, size)) : CUDA_SUCCESS;
    CUresult release = VMM__TWICE(cu.MemRelease(h));
    if (unmap || release)
        vmm__log(VMM__LOG_WARNING, "giving back %llu bytes: %s failed twice (CUDA error %d); the driver keeps them "
                 "until exit", (unsigned long long)size, unmap ? "cuMemUnmap" : "cuMemRelease", (int)(unmap ? unmap : release));
}

/* Natively any context copies from a cudaMalloc'd block of any device, while the driver copies
 * VMM memory only in a context whose device was granted it (an H100 answers
 * cudaErrorInvalidValue): so cudaMalloc's segments are granted to every device that can reach
 * this one, besides the ones peer access was enabled for.  The stream-ordered pool's follow the
 * default pool's access instead (cudaMemPoolSetAccess), as natively. */
static int access_list(device_state *d, CUmemAccessDesc *acc, int synchronous_pool)
{
    int n = 0;
    uint64_t accessors = __atomic_load_n(&d->accessors, __ATOMIC_ACQUIRE) | (1ull << d->index) | (synchronous_pool ? d->peers : 0);
    for (int i = 0; i < MAX_DEVICES; i++)
        if (accessors & (1ull << i))
            acc[n++] = (CUmemAccessDesc){.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = i},
                                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    return n;
}

static int seg_create(void *ctx, vmm__seg *ps)
{
    device_state *d = ctx;
    int dev = d->index;
    CUmemAllocationProp p = {0};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | (d->fabric ? CU_MEM_HANDLE_TYPE_FABRIC : 0);
    CUmemGenericAllocationHandle h;
    CUresult rc = cu.MemCreate(&h, ps->size, &p, 0);
    if (rc != CUDA_SUCCESS) return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    int mapped = 0;
    if ((rc = cu.MemMap(ps->base, ps->size, 0, h, 0)) != CUDA_SUCCESS) goto undo;
    mapped = 1;
    CUmemAccessDesc acc[MAX_DEVICES];
    if ((rc = cu.MemSetAccess(ps->base, ps->size, acc, (size_t)access_list(d, acc, ps->arena->pool == &d->pool[0]))) !=
        CUDA_SUCCESS)
        goto undo;
    vseg *c = calloc(1, sizeof *c);
    if (!c) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto undo;
    }
    c->handle = h;
    c->dev = dev;
    c->exported_fd = -1;
    c->broker_fd = -1;
    c->id = vmm__new_chunk_id();
    export_seg(c);
    ps->mech = c;
    return 0;
undo:
    seg_undo(ps->base, ps->size, h, mapped);
    return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
}

/* The pool calls this only for segments no allocation touches, every free's event reached (or
 * for everything at a device reset). */
static void seg_destroy(void *ctx, vmm__seg *ps)
{
    (void)ctx;
    vseg *c = ps->mech;
    if (c->exported_fd >= 0) close(c->exported_fd); /* its records were retracted before */
    if (c->broker_fd >= 0) {
        close(c->broker_fd);
        __atomic_store_n(&S.kept_fds, S.kept_fds - 1, __ATOMIC_RELAXED);
    }
    c->exported_fd = c->broker_fd = -1;
    if (c->exporting) { /* its space goes now; its handle once the broker's export is done */
        CUresult unmap = VMM__TWICE(cu.MemUnmap(ps->base, ps->size));
        if (unmap)
            vmm__log(VMM__LOG_WARNING, "giving back %llu bytes: cuMemUnmap failed twice (CUDA error %d); the driver "
                     "keeps them until exit", (unsigned long long)ps->size, (int)unmap);
        c->dead = 1;
    } else {
        seg_undo(ps->base, ps->size, c->handle, 1);
        free(c);
    }
    /* a keeper holding this segment lets go of it now rather than at its next tick (one relaxed
     * load when nobody keeps this process) */
    if (S.registry_ok) vmm__keep_ring(&S.reg, 0);
}

/* The stream-ordered pool maps an empty segment's handle at a second place, where a request of
 * the stream whose frees are still in flight in it needs room (shim/pool, "moving"). */
static int seg_move(void *ctx, vmm__seg *from, uint64_t base)
{
    device_state *d = ctx;
    vseg *c = from->mech;
    if (cu.MemMap(base, from->size, 0, c->handle, 0) != CUDA_SUCCESS) return -EIO;
    CUmemAccessDesc acc[MAX_DEVICES];
    if (cu.MemSetAccess(base, from->size, acc, (size_t)access_list(d, acc, from->arena->pool == &d->pool[0])) != CUDA_SUCCESS) {
        (void)VMM__TWICE(cu.MemUnmap(base, from->size));
        return -EIO;
    }
    return 0;
}

/* The old place of a moved segment, once the stream reached the frees there: only the mapping goes. */
static void unmap_old(void *ctx, uint64_t base, uint64_t size)
{
    (void)ctx;
    CUresult rc = VMM__TWICE(cu.MemUnmap(base, size));
    if (rc)
        vmm__log(VMM__LOG_WARNING, "unmapping the old place of a moved segment failed twice (CUDA error %d); its "
                 "address space stays mapped until exit", (int)rc);
}

static int arena_reserve(void *ctx, uint64_t size, uint64_t *base)
{
    device_state *d = ctx;
    CUdeviceptr va = 0;
    if (cu.MemAddressReserve(&va, size, d->granularity, 0, 0) != CUDA_SUCCESS) return -ENOMEM;
    *base = va;
    return 0;
}

static void arena_unreserve(void *ctx, uint64_t base, uint64_t size)
{
    (void)ctx;
    if (VMM__TWICE(cu.MemAddressFree(base, size)) != CUDA_SUCCESS)
        vmm__log(VMM__LOG_WARNING, "freeing %llu bytes of address space failed twice; kept until exit", (unsigned long long)size);
}

static uint64_t now_ns(void *ctx)
{
    (void)ctx;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int event_done(void *ctx, void *e)
{
    (void)ctx;
    CUresult rc = cu.EventQuery((CUevent)e);
    return rc != CUDA_ERROR_NOT_READY; /* an error will never become "reached": do not wait on it */
}

static void event_release(void *ctx, void *e)
{
    device_state *d = ctx;
    if (d->n_events == d->cap_events) {
        size_t n = d->cap_events ? d->cap_events * 2 : 64;
        CUevent *p = realloc(d->events, n * sizeof *p);
        if (!p) {
            cu.EventDestroy((CUevent)e);
            return;
        }
        d->events = p;
        d->cap_events = n;
    }
    d->events[d->n_events++] = (CUevent)e;
}

static CUevent event_get_locked(device_state *d)
{
    if (d->n_events) return d->events[--d->n_events];
    CUevent e = NULL;
    return cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS ? e : NULL;
}

/* The pool asks for the event of a free made without one (vmm__free): recorded now, in the
 * stream's context, it covers the work queued before that free and more. */
static int record_now(void *ctx, uint64_t stream_id, void *stream_ctx, void **out)
{
    device_state *d = ctx;
    CUstream stream = (CUstream)(uintptr_t)stream_id;
    CUcontext popped;
    if (cu.CtxPushCurrent((CUcontext)stream_ctx) != CUDA_SUCCESS) return -1; /* its context is gone */
    int r = -1;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (__atomic_load_n(&captures, __ATOMIC_ACQUIRE) > 0 && cu.StreamIsCapturing(stream, &st) == CUDA_SUCCESS &&
        st != CU_STREAM_CAPTURE_STATUS_NONE) {
        r = 0; /* a record now would be a node of the graph: after the capture */
    } else {
        CUevent e = event_get_locked(d);
        if (e && cu.EventRecord(e, stream) != CUDA_SUCCESS) {
            cu.EventDestroy(e); /* perhaps made in another context: one of this one */
            if (cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) e = NULL;
            else if (cu.EventRecord(e, stream) != CUDA_SUCCESS) cu.EventDestroy(e), e = NULL;
        }
        if (e) *out = e, r = 1; /* else the stream is gone (destroyed with its context) */
    }
    cu.CtxPopCurrent(&popped);
    return r;
}

/* Stream-ordered memory stays mapped up to the default pool's release threshold, as natively;
 * synchronous memory up to VMMSHIM_CACHE_SIZE (0: native cudaFree keeps none). */
static uint64_t retain_of(const device_state *d, int k) { return k ? d->release_threshold : S.cache_limit; }

/* Address space reserved at a time: the device's memory, so one arena serves a pool that fills
 * the device (and a program with several pools never runs address space short). */
static uint64_t arena_bytes(device_state *d)
{
    size_t total = 0;
    const uint64_t gib = 1ull << 30;
    if (cu.DeviceTotalMem(&total, d->index) != CUDA_SUCCESS || total == 0) total = 64 * gib;
    return ((uint64_t)total + gib - 1) / gib * gib;
}

static void pools_ready_locked(device_state *d)
{
    if (d->pool_ready) return;
    vmm__pool_ops ops = {.ctx = d,
                         .reserve = arena_reserve,
                         .unreserve = arena_unreserve,
                         .seg_create = seg_create,
                         .seg_destroy = seg_destroy,
                         .event_done = event_done,
                         .event_record = record_now,
                         .event_release = event_release,
                         .now_ns = now_ns,
                         .seg_move = seg_move,
                         .unmap_old = unmap_old};
    uint64_t arena = arena_bytes(d);
    for (int k = 0; k < 2; k++) vmm__pool_init(&d->pool[k], &ops, d->granularity, arena, retain_of(d, k), S.isolate);
    d->pool[0].exact = 1; /* cudaMalloc: natively each allocation is memory of its own, gone at its free */
    if (!S.isolate) d->pool[1].seg_max = VMM_POOL_SEG_MAX; /* a pool that is seldom trimmed: holes go back in pieces */
    d->pool_ready = 1;
}

/* ---- giving memory back after the idle delay ---- */

/* The budget of each pool: what cudaMalloc freed may stay empty up to VMMSHIM_CACHE_SIZE bytes;
 * the default pool keeps up to its release threshold reserved, as natively. */
static void release_locked(vmm__pool *p, int stream_ordered, uint64_t until)
{
    if (stream_ordered) vmm__pool_release(p, p->retain, 0, until);
    else vmm__pool_release(p, 0, p->retain, until);
}

static int settled(const vmm__pool *p, int stream_ordered)
{
    return !vmm__pool_empty_bytes(p) || (stream_ordered ? p->reserved <= p->retain : vmm__pool_empty_bytes(p) <= p->retain);
}

/* One pass over every pool: what has been empty for the delay goes back (beyond each pool's
 * budget).  Returns when the next segment falls due (UINT64_MAX: none is waiting). */
static uint64_t purge_pass_locked(uint64_t now)
{
    uint64_t next = UINT64_MAX, delay = S.give_back_ns;
    if (__atomic_load_n(&captures, __ATOMIC_ACQUIRE) > 0) return now + (delay ? delay : 1000000u); /* after the capture */
    for (int i = 0; i < MAX_DEVICES; i++) {
        device_state *d = &S.dev[i];
        for (int k = 0; k < 2 && d->pool_ready; k++) {
            vmm__pool *p = &d->pool[k];
            if (now >= delay) release_locked(p, k, now - delay);
            uint64_t oldest = vmm__pool_oldest_empty(p);
            if (oldest != UINT64_MAX && !settled(p, k) && oldest + delay < next) next = oldest + delay;
        }
    }
    /* a segment a free in flight still touches is looked at again a little later, never spun on */
    if (next != UINT64_MAX && next < now + 5000000u) next = now + 5000000u;
    return next;
}

static void *purge_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&S.lock);
    while (!S.stopping) {
        uint64_t next = purge_pass_locked(now_ns(NULL));
        if (next == UINT64_MAX) {
            S.purge_state = 1;
            pthread_cond_wait(&S.purge_wake, &S.lock);
        } else {
            S.purge_state = 2;
            struct timespec t = {.tv_sec = (time_t)(next / 1000000000u), .tv_nsec = (long)(next % 1000000000u)};
            pthread_cond_timedwait(&S.purge_wake, &S.lock, &t);
        }
    }
    S.purge_state = 1;
    pthread_mutex_unlock(&S.lock);
    return NULL;
}

static void purge_kick_locked(void);

/* Under S.lock: a free emptied a segment of p.  With no give-back delay it goes back at once, as
 * natively (unless a free in flight still touches it: then at the next synchronization or pass). */
static void emptied_locked(vmm__pool *p, int stream_ordered)
{
    if (stream_ordered) __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED);
    /* Natively cudaFree's memory is the device's again when it returns, and a neighbour woken by
     * the free (a rollout engine after empty_cache) may allocate it at once: the delay keeps
     * only a little of it, what a program that frees and allocates the same sizes reuses. */
    else if (vmm__pool_empty_bytes(p) > S.hold_limit) vmm__pool_release_newest(p, S.hold_limit);
    if (!S.give_back_ns) {
        release_locked(p, stream_ordered, UINT64_MAX);
        if (settled(p, stream_ordered)) return;
        __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED);
    }
    purge_kick_locked();
}

/* Under S.lock: a segment became empty, so the give-back thread has a deadline to keep.  Started
 * on the first one, with every signal blocked (the program's handlers never run on it); woken only
 * when it waits with no deadline, so a free costs no system call while one is set. */
static void purge_kick_locked(void)
{
    if (S.purge_state == 1) {
        pthread_cond_signal(&S.purge_wake);
        S.purge_state = 2;
    } else if (S.purge_state == 0) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pthread_t t;
        int rc = pthread_create(&t, &at, purge_main, NULL);
        pthread_attr_destroy(&at);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc == 0) {
            pthread_setname_np(t, "vmmshim-purge");
            S.purge_state = 2;
        } else {
            S.purge_state = -1;
            vmm__log(VMM__LOG_WARNING, "the give-back thread did not start (%s); freed memory goes back when the "
                     "pool next grows or is trimmed", strerror(rc));
        }
    }
}

/* ---- publishing and the broker ---- */

static device_state *dev_of_block(const vmm__block *b)
{
    return &S.dev[((vseg *)vmm__pool_seg_at(b->arena, b->arena->pool->granule, b->addr)->mech)->dev];
}

/* The segments under block b, in address order: the first, their number and their bytes. */
static vmm__seg *span_of(const vmm__block *b, uint32_t *n, uint64_t *bytes)
{
    uint64_t g = b->arena->pool->granule, end = b->addr + b->size;
    vmm__seg *first = vmm__pool_seg_at(b->arena, g, b->addr);
    *n = 0;
    *bytes = 0;
    for (vmm__seg *s = first; s; s = s->base + s->size < end ? vmm__pool_seg_at(b->arena, g, s->base + s->size) : NULL) {
        (*n)++;
        *bytes += s->size;
    }
    return first;
}

/* S.lock held: an fd for segment c, a duplicate of the one kept (1), or 0 when none is kept: the
 * caller exports it after letting go of the lock (broker_export_many), c pinned meanwhile. */
static int seg_fd_kept_locked(vseg *c, int *fd)
{
    int kept = c->broker_fd >= 0 ? c->broker_fd : c->exported_fd;
    if (kept < 0) {
        c->exporting++;
        return 0;
    }
    return (*fd = fcntl(kept, F_DUPFD_CLOEXEC, 0)) < 0 ? -errno : 1;
}

/* S.lock held again after pinned segments were exported (fd -1: the export failed): keep a
 * duplicate for the next request, or finish a segment destroyed meanwhile. */
static void seg_exported_locked(vseg *c, int fd)
{
    c->exporting--;
    if (c->dead) {
        if (!c->exporting) {
            CUresult release = VMM__TWICE(cu.MemRelease(c->handle));
            if (release)
                vmm__log(VMM__LOG_WARNING, "cuMemRelease of a given-back segment failed twice (CUDA error %d); the "
                         "driver keeps it until exit", (int)release);
            free(c);
        }
    } else if (fd >= 0 && c->broker_fd < 0) {
        c->broker_fd = fcntl(fd, F_DUPFD_CLOEXEC, 1024);
        if (c->broker_fd >= 0) __atomic_store_n(&S.kept_fds, S.kept_fds + 1, __ATOMIC_RELAXED);
    }
}

unsigned long vmm__backing_kept_fds(void) { return __atomic_load_n(&S.kept_fds, __ATOMIC_RELAXED) + vmm__adopt_kept_fds(); }

/* The broker asks for handles [first, first + max) of a live allocation's span: their fds (the
 * broker closes them), sizes and keys (a segment's id, never reused: one segment may lie under
 * two allocations, and a batch passes it once), in address order.  A range the program mapped
 * itself has no key: its handle may be mapped at several places. */
static int broker_export_many(uint64_t slot, uint64_t generation, const uint8_t id[16], uint32_t first, uint32_t max,
                              int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total,
                              uint32_t *device)
{
    *n_here = *n_total = 0;
    pthread_mutex_lock(&S.lock);
    vmm__block *b = NULL;
    uint32_t key = (uint32_t)slot;
    HASH_FIND(hs, S.by_slot, &key, sizeof key, b);
    if (!b) {
        pthread_mutex_unlock(&S.lock);
        uint64_t mapped = 0;
        if (first != 0 || max == 0) return -EINVAL;
        int rc = vmm__adopt_export(slot, generation, id, &fds[0], &mapped, device); /* a range the program mapped */
        if (rc == 0) {
            sizes[0] = mapped;
            *n_here = *n_total = 1;
        }
        return rc;
    }
    int rc = 0;
    vseg *pinned[VMM_BROKER_MAX_FDS] = {0}; /* pinned[k]: fds[k] is to be exported */
    uint32_t n_pinned = 0;
    if (max > VMM_BROKER_MAX_FDS) max = VMM_BROKER_MAX_FDS;
    if (!b->live)
        rc = -ENOENT;
    else if (b->generation != generation || memcmp(b->alloc_id, id, 16) != 0)
        rc = -ESTALE;
    else {
        uint64_t bytes, g = b->arena->pool->granule;
        uint32_t n, i = 0;
        vmm__seg *s = span_of(b, &n, &bytes);
        *n_total = n;
        *device = (uint32_t)((vseg *)s->mech)->dev;
        if (first >= n) rc = -ERANGE;
        for (; s && rc == 0 && *n_here < max && i < n; i++, s = i < n ? vmm__pool_seg_at(b->arena, g, s->base + s->size) : NULL) {
            if (i < first) continue;
            fds[*n_here] = -1;
            int kept = seg_fd_kept_locked(s->mech, &fds[*n_here]);
            if (kept < 0) {
                rc = kept;
                break;
            }
            if (!kept) {
                pinned[*n_here] = s->mech;
                n_pinned++;
            }
            keys[*n_here] = ((vseg *)s->mech)->id;
            sizes[(*n_here)++] = s->size;
        }
    }
    if (n_pinned) {
        /* the first export of a segment, the only slow step: without the lock, so that the
         * owner's allocations go on meanwhile (a segment freed and destroyed meanwhile stays
         * pinned, its handle valid, and the allocation is found gone below) */
        pthread_mutex_unlock(&S.lock);
        for (uint32_t k = 0; k < *n_here; k++)
            if (pinned[k] && cu.MemExportToShareableHandle(&fds[k], pinned[k]->handle,
                                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) {
                fds[k] = -1;
                if (rc == 0) rc = -EIO;
            }
        pthread_mutex_lock(&S.lock);
        for (uint32_t k = 0; k < *n_here; k++)
            if (pinned[k]) seg_exported_locked(pinned[k], fds[k]);
        b = NULL;
        HASH_FIND(hs, S.by_slot, &key, sizeof key, b);
        if (rc == 0 && (!b || !b->live || b->generation != generation || memcmp(b->alloc_id, id, 16) != 0))
            rc = -ESTALE; /* freed while its handles were exported */
    }
    if (rc != 0) {
        while (*n_here)
            if (fds[--*n_here] >= 0) close(fds[*n_here]);
    }
    pthread_mutex_unlock(&S.lock);
    return rc;
}

static void start_broker(void)
{
    if (__atomic_load_n(&S.broker_started, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&S.lock);
    if (!S.broker_started) {
        int rc = vmm__broker_start(broker_export_many, S.broker_path, sizeof S.broker_path);
        if (rc == 0) vmm__reg_set_broker(&S.reg, S.broker_path);
        if (rc == 0) on_exit(keep_exiting, NULL);
        else vmm__log(VMM__LOG_WARNING, "broker did not start (%s); companions can import only via pidfd", strerror(-rc));
        __atomic_store_n(&S.broker_started, rc == 0 ? 1 : -1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&S.lock);
}

static void fill_common(vmm_reg_alloc *d, int dev, uint32_t api, CUstream stream, uint64_t requested,
                        const vmm__frames *f)
{
    memset(d, 0, sizeof *d);
    d->device = (uint32_t)dev;
    d->api = api;
    memcpy(d->device_uuid, S.dev[dev].uuid, 16);
    d->requested_size = requested;
    d->stream = (uint64_t)(uintptr_t)stream;
    d->exported_fd = -1;
    memcpy(d->tag, S.tag, sizeof d->tag);
    d->n_frames = f->n;
    memcpy(d->frames, f->pc, f->n * sizeof f->pc[0]); /* the rest stays zero: no stack bytes in shared memory */
}

/* One record per allocation: bound (and indexed) at its address and extent, published with the
 * segments it spans.  Under S.lock, so the broker never sees a half-published block. */
static void publish_locked(vmm__block *b, CUstream stream, const vmm__frames *f)
{
    b->slot = NO_SLOT;
    if (!S.registry_ok) return;
    uint32_t n;
    uint64_t bytes;
    vmm__seg *first = span_of(b, &n, &bytes);
    vseg *c = first->mech;
    vmm_reg_alloc d;
    fill_common(&d, c->dev, b->api, stream, b->requested, f);
    d.mapped_size = bytes;
    d.chunk_id = c->id;
    d.chunk_offset = b->addr - first->base;
    d.flags = b->size < bytes ? VMM_REG_F_SHARED_CHUNK : 0;
    d.handle_kinds = __atomic_load_n(&S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
    if (n > 1) { /* pidfd and fabric name one handle */
        d.flags |= VMM_REG_F_MULTI_HANDLE;
        d.n_handles = n;
    } else {
        d.n_handles = 1;
        if (c->exported_fd >= 0) {
            d.handle_kinds |= VMM_HANDLE_PIDFD;
            d.exported_fd = c->exported_fd;
        }
        if (c->has_fabric) {
            d.handle_kinds |= VMM_HANDLE_FABRIC;
            memcpy(d.fabric, c->fabric, sizeof d.fabric);
        }
    }
    vmm_reg_alloc out;
    if (vmm__reg_add(&S.reg, b->addr, b->size, &d, &b->slot, &out) != 0) {
        b->slot = NO_SLOT;
        vmm__log(VMM__LOG_WARNING, "the registry is full: allocations go unpublished (raise VMMSHIM_REGISTRY_CAPACITY)");
        return;
    }
    b->generation = out.generation;
    memcpy(b->alloc_id, out.alloc_id, 16);
    HASH_ADD(hs, S.by_slot, slot, sizeof(uint32_t), b);
}

static void retract_locked(vmm__block *b)
{
    if (b->slot == NO_SLOT) return;
    HASH_DELETE(hs, S.by_slot, b);
    vmm__reg_remove(&S.reg, b->slot); /* out of the registry before any reuse */
    b->slot = NO_SLOT;
}

/* ---- the API ---- */

/* From dev's pool for the call's kind.  When the device is full, the other pool's empty segments
 * go too, and then the frees still in flight are waited for (outside the lock: a wait under it
 * would stall every thread) before one more try; only then is the device full for the shim. */
static vmm__block *alloc_locked(device_state *d, size_t size, int ordered, uint64_t stream, int *err)
{
    vmm__block *b = vmm__pool_alloc(&d->pool[ordered], size, ordered, stream, err);
    if (b || *err != -ENOMEM) return b;
    vmm__pool_release(&d->pool[!ordered], 0, 0, UINT64_MAX);
    if ((b = vmm__pool_alloc(&d->pool[ordered], size, ordered, stream, err)) || *err != -ENOMEM) return b;
    void *ev[64];
    unsigned n = vmm__pool_pending_events(&d->pool[0], ev, 64);
    n += vmm__pool_pending_events(&d->pool[1], ev + n, 64 - n);
    if (n == 0) return NULL;
    pthread_mutex_unlock(&S.lock);
    for (unsigned i = 0; i < n; i++) cu.EventSynchronize((CUevent)ev[i]); /* one recycled meanwhile only waits longer */
    pthread_mutex_lock(&S.lock);
    vmm__pool_release(&d->pool[!ordered], 0, 0, UINT64_MAX);
    return vmm__pool_alloc(&d->pool[ordered], size, ordered, stream, err);
}

static int kept_by_a_keeper(void)
{
    vmm_reg_proc *self = S.ready && S.registry_ok ? vmm__reg_self(&S.reg) : NULL;
    return self && __atomic_load_n(&self->keeper_pid, __ATOMIC_RELAXED);
}

int vmm__keep_let_go(void)
{
    if (!kept_by_a_keeper()) return 0;
    vmm__keep_ring(&S.reg, VMM__KEEP_LET_GO_MS);
    return 1;
}

/* alloc_locked, and when the device is full for it and a keeper keeps this process: the keeper
 * may still hold segments given back a moment ago, so ask it to let go (outside the lock; at most
 * VMM__KEEP_LET_GO_MS) and try once more. */
static vmm__block *alloc_kept_locked(device_state *d, size_t size, int ordered, uint64_t stream, int *err)
{
    vmm__block *b = alloc_locked(d, size, ordered, stream, err);
    if (b || *err != -ENOMEM || !kept_by_a_keeper()) return b;
    pthread_mutex_unlock(&S.lock);
    vmm__keep_ring(&S.reg, VMM__KEEP_LET_GO_MS);
    pthread_mutex_lock(&S.lock);
    return vmm__pool_alloc(&d->pool[ordered], size, ordered, stream, err);
}

vmm__result vmm__alloc(size_t size, uint32_t api, int stream_ordered, CUstream stream, void **ptr)
{
    if (!ensure_init()) return S.failed && vmm__opt_bool(VMM__OPT_STRICT) ? VMM__REFUSED : VMM__DISABLED;
    if (!ptr || size == 0) return VMM__PASS; /* the runtime's own answer for these */
    CUcontext ctx;
    int runtime_api = api == VMM_API_CUDA_MALLOC || api == VMM_API_CUDA_MALLOC_ASYNC;
    int dev = current_device(&ctx, runtime_api);
    if (dev < 0 || !device_usable(dev)) return vmm__opt_bool(VMM__OPT_STRICT) && dev >= 0 ? VMM__REFUSED : VMM__UNSUPPORTED;
    device_state *d = &S.dev[dev];
    /* the program's own pool is current: its allocations are its pool's, noted, not exportable */
    if (stream_ordered && __atomic_load_n(&d->custom_pool, __ATOMIC_ACQUIRE)) return VMM__OWN_POOL;
    start_broker(); /* one atomic load once it has started */
    vmm__frames f;
    vmm__frames_capture(&f); /* before the lock: it takes the loader lock */

    pthread_mutex_lock(&S.lock);
    pools_ready_locked(d);
    int err;
    vmm__block *b = alloc_kept_locked(d, size, stream_ordered, (uint64_t)(uintptr_t)stream, &err);
    if (!b) {
        pthread_mutex_unlock(&S.lock);
        if (err == -ENOMEM) return VMM__NOMEM;
        vmm__log(VMM__LOG_WARNING, "VMM allocation of %zu bytes failed (%s); passing it through", size, strerror(-err));
        return VMM__UNSUPPORTED;
    }
    b->requested = size;
    b->api = api;
    b->ctx = ctx;
    b->live = 1;
    HASH_ADD(hh, S.by_addr, addr, sizeof(uint64_t), b);
    publish_locked(b, stream, &f);
    pthread_mutex_unlock(&S.lock);
    vmm_reg_proc *c = coverage_now();
    count(&c->allocs);
    count(&c->allocs_backed);
    *ptr = (void *)(uintptr_t)b->addr;
    return VMM__DONE;
}

/* The arena of one of the shim's pools holding p (allocated, free or not mapped), or NULL. */
static vmm__arena *arena_containing_locked(uint64_t p)
{
    for (int i = 0; i < MAX_DEVICES; i++)
        for (int k = 0; k < 2 && S.dev[i].pool_ready; k++) {
            vmm__arena *a = vmm__pool_arena_at(&S.dev[i].pool[k], p);
            if (a) return a;
        }
    return NULL;
}

/* The live allocation whose [addr, addr + requested) holds p. */
static vmm__block *block_containing_locked(uint64_t p)
{
    vmm__block *b = NULL;
    HASH_FIND(hh, S.by_addr, &p, sizeof p, b);
    if (!b) {
        vmm__arena *a = arena_containing_locked(p);
        if (!a) return NULL;
        vmm_reg_alloc rec;
        uint64_t slot;
        if (S.registry_ok && vmm__reg_find(&S.reg, S.reg.pid, p, &rec, &slot) == 0) {
            uint32_t key = (uint32_t)slot;
            HASH_FIND(hs, S.by_slot, &key, sizeof key, b);
        } else {
            b = vmm__pool_block_at(a, a->pool->granule, p); /* unpublished: walk the arena */
        }
    }
    return b && b->live && p - b->addr < b->requested + (b->requested == 0) ? b : NULL;
}

static void sync_ctx(CUcontext ctx)
{
    CUcontext prev = NULL;
    /* a current context that cannot be read cannot be restored either: then no switch */
    int switched = cu.CtxGetCurrent(&prev) == CUDA_SUCCESS && prev != ctx && cu.CtxSetCurrent(ctx) == CUDA_SUCCESS;
    cu.CtxSynchronize();
    if (switched) (void)VMM__TWICE(cu.CtxSetCurrent(prev)); /* else the thread stays in ctx */
}

/* Lock held.  Detach the deferred blocks of ctx: a synchronization of ctx covers them. */
static vmm__block *take_deferred_locked(CUcontext ctx)
{
    vmm__block *mine = NULL, **pp = &S.deferred;
    while (*pp) {
        vmm__block *b = *pp;
        if (b->ctx == ctx) {
            *pp = b->fnext;
            b->fnext = mine;
            mine = b;
        } else {
            pp = &b->fnext;
        }
    }
    return mine;
}

static void pool_free_list_locked(vmm__block *list)
{
    while (list) {
        vmm__block *b = list;
        list = b->fnext;
        if (vmm__pool_free(b->arena->pool, b, 0, NULL)) emptied_locked(b->arena->pool, 0);
    }
}

vmm__result vmm__free(void *ptr, int stream_ordered, CUstream stream)
{
    if (!ptr || !S.ready) return VMM__PASS;
    uint64_t p = (uint64_t)(uintptr_t)ptr;
    int capturing = stream_ordered && vmm__stream_capturing(stream); /* a driver call: not under the lock */
    /* A stream-ordered free records its event only when someone needs it (vmm__pool_free_unrecorded):
     * that needs the stream's context, here the current one.  Another thread's per-thread
     * stream cannot be named later, so its frees record at once. */
    CUcontext stream_ctx = NULL;
    if (stream_ordered && !capturing && stream != CU_STREAM_PER_THREAD && cu.CtxGetCurrent(&stream_ctx) != CUDA_SUCCESS)
        stream_ctx = NULL;
    pthread_mutex_lock(&S.lock);
    vmm__block *b = NULL;
    HASH_FIND(hh, S.by_addr, &p, sizeof p, b);
    if (!b) {
        note *n = NULL;
        HASH_FIND(hh, S.notes, &p, sizeof p, n);
        if (n) HASH_DELETE(hh, S.notes, n); /* the real runtime owns it; drop our note of it */
        vmm__result r = n ? VMM__PASS : arena_containing_locked(p) ? VMM__INVALID : VMM__PASS;
        pthread_mutex_unlock(&S.lock);
        if (n) {
            if (n->slot != NO_SLOT) vmm__reg_remove(&S.reg, n->slot);
            free(n);
        }
        return r;
    }
    if (capturing) {
        /* Natively (an H100, driver 580) a stream-ordered free, captured, of memory allocated
         * before the capture fails with cudaErrorInvalidValue, the capture goes on and the memory
         * stays allocated; the shim's memory was all allocated outside any capture. */
        pthread_mutex_unlock(&S.lock);
        return VMM__INVALID;
    }
    HASH_DELETE(hh, S.by_addr, b);
    retract_locked(b); /* out of the registry before the memory can be reused */
    b->live = 0;
    device_state *d = dev_of_block(b);
    vmm__pool *pool = b->arena->pool;
    CUevent ev = NULL;
    if (stream_ordered && stream_ctx) {
        if (vmm__pool_free_unrecorded(pool, b, (uint64_t)(uintptr_t)stream, stream_ctx, __atomic_add_fetch(&S.free_seq, 1, __ATOMIC_RELEASE)))
            emptied_locked(pool, 1);
        if (!__atomic_load_n(&vmm__sync.unrecorded_due, __ATOMIC_RELAXED)) __atomic_store_n(&vmm__sync.unrecorded_due, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&S.lock);
        return VMM__DONE;
    }
    if (stream_ordered) {
        ev = event_get_locked(d);
        pthread_mutex_unlock(&S.lock);
        if (!ev || cu.EventRecord(ev, stream) != CUDA_SUCCESS) {
            if (ev) cu.EventDestroy(ev);
            ev = NULL;
            cu.StreamSynchronize(stream);
        }
    } else {
        if (__atomic_load_n(&captures, __ATOMIC_ACQUIRE) > 0) {
            /* synchronizing now would invalidate the capture: the block waits for a later sync */
            b->fnext = S.deferred;
            S.deferred = b;
            pthread_mutex_unlock(&S.lock);
            return VMM__DONE;
        }
        vmm__block *covered = take_deferred_locked(b->ctx);
        pthread_mutex_unlock(&S.lock);
        sync_ctx(b->ctx); /* cudaFree waits for the device, and so must we before reuse */
        pthread_mutex_lock(&S.lock);
        pool_free_list_locked(covered);
    }
    if (stream_ordered) pthread_mutex_lock(&S.lock); /* the other branch holds it already */
    if (vmm__pool_free(pool, b, (uint64_t)(uintptr_t)stream, ev)) emptied_locked(pool, stream_ordered);
    pthread_mutex_unlock(&S.lock);
    return VMM__DONE;
}

/* Natively a synchronization releases the default pool's memory beyond its threshold; with no
 * give-back delay, what cudaMalloc freed goes then too.  The hooks come here only when
 * vmm__sync_watching() said something waits (backing.h). */
uint64_t vmm__free_mark(void) { return __atomic_load_n(&S.free_seq, __ATOMIC_ACQUIRE) + 1; }

static int legacy_stream(CUstream s) { return s == NULL || s == CU_STREAM_LEGACY; }

void vmm__synchronized(int whole_context, CUstream stream, uint64_t mark)
{
    if (!S.ready) return;
    int sync_due = __atomic_load_n(&vmm__sync.sync_due, __ATOMIC_ACQUIRE), unrecorded = __atomic_load_n(&vmm__sync.unrecorded_due, __ATOMIC_ACQUIRE);
    if (!sync_due && !unrecorded) return;
    CUcontext ctx = NULL;
    if (unrecorded && (cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)) unrecorded = 0;
    pthread_mutex_lock(&S.lock);
    __atomic_store_n(&vmm__sync.sync_due, 0, __ATOMIC_RELAXED);
    int left = 0;
    uint64_t still_unrecorded = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        device_state *d = &S.dev[i];
        for (int k = 0; k < 2 && d->pool_ready && unrecorded; k++) {
            /* the frees this synchronization covers are reached, with no event recorded at all;
             * the legacy stream has two names */
            vmm__pool *p = &d->pool[k];
            vmm__pool_reached_by_sync(p, whole_context, (uint64_t)(uintptr_t)stream, ctx, mark);
            if (!whole_context && legacy_stream(stream))
                vmm__pool_reached_by_sync(p, 0, (uint64_t)(uintptr_t)(stream ? NULL : CU_STREAM_LEGACY), ctx, mark);
            still_unrecorded += p->n_unrecorded;
        }
        for (int k = 0; k < 2 && d->pool_ready; k++) {
            if (k == 0 && S.give_back_ns) continue;
            release_locked(&d->pool[k], k, UINT64_MAX);
            left |= !settled(&d->pool[k], k);
        }
    }
    if (left) __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED); /* frees of streams not synchronized yet */
    if (unrecorded && !still_unrecorded) __atomic_store_n(&vmm__sync.unrecorded_due, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&S.lock);
}

void vmm__stream_destroying(CUstream stream)
{
    if (!S.ready || !__atomic_load_n(&vmm__sync.unrecorded_due, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&S.lock);
    for (int i = 0; i < MAX_DEVICES; i++)
        for (int k = 0; k < 2 && S.dev[i].pool_ready; k++) vmm__pool_record_stream(&S.dev[i].pool[k], (uint64_t)(uintptr_t)stream);
    pthread_mutex_unlock(&S.lock);
}

void vmm__capture_begun(void) { __atomic_add_fetch(&captures, 1, __ATOMIC_ACQ_REL); }

/* The last capture ended: the frees deferred meanwhile are synchronized and reused now. */
void vmm__capture_ended(void)
{
    int left = __atomic_sub_fetch(&captures, 1, __ATOMIC_ACQ_REL);
    if (left < 0) __atomic_store_n(&captures, left = 0, __ATOMIC_RELEASE); /* a capture begun before the shim loaded */
    if (left > 0 || !S.ready) return;
    for (;;) {
        pthread_mutex_lock(&S.lock);
        CUcontext ctx = S.deferred ? S.deferred->ctx : NULL;
        vmm__block *covered = ctx ? take_deferred_locked(ctx) : NULL;
        pthread_mutex_unlock(&S.lock);
        if (!covered) return;
        sync_ctx(ctx);
        pthread_mutex_lock(&S.lock);
        pool_free_list_locked(covered);
        pthread_mutex_unlock(&S.lock);
    }
}

void vmm__note_passthrough(vmm__result why, void *ptr, size_t size, uint32_t api, CUstream stream)
{
    if (!ptr || size == 0) return; /* no allocation was made */
    vmm_reg_proc *c = coverage_now();
    switch (why) {
    case VMM__DISABLED: count(&passed_disabled); return;
    case VMM__UNSUPPORTED: count(&c->passed_unsupported); break;
    case VMM__OWN_POOL: count(&c->passed_unsupported); break;
    case VMM__NOMEM: count(&c->passed_device_full); break;
    case VMM__CAPTURED: count(&c->passed_capture); break;
    default: return;
    }
    count(&c->allocs);
    if (why == VMM__UNSUPPORTED || !S.ready || !S.registry_ok) return;
    note *n = calloc(1, sizeof *n);
    if (!n) return;
    n->va = (uint64_t)(uintptr_t)ptr;
    n->slot = NO_SLOT;
    CUcontext ctx;
    int dev = current_device(&ctx, 0);
    if (dev < 0) dev = 0;
    n->dev = dev;
    vmm__frames f;
    vmm__frames_capture(&f);
    pthread_mutex_lock(&S.lock);
    note *old = NULL;
    HASH_FIND(hh, S.notes, &n->va, sizeof n->va, old);
    if (old) {
        pthread_mutex_unlock(&S.lock);
        free(n);
        return;
    }
    vmm_reg_alloc d;
    fill_common(&d, dev, api, stream, size, &f);
    d.flags = VMM_REG_F_NOT_EXPORTABLE;
    if (vmm__reg_add(&S.reg, n->va, size, &d, &n->slot, NULL) != 0) n->slot = NO_SLOT;
    HASH_ADD(hh, S.notes, va, sizeof(uint64_t), n);
    pthread_mutex_unlock(&S.lock);
}

size_t vmm__pool_free_bytes_current(void)
{
    if (!S.ready) return 0;
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx || cu.CtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES)
        return 0;
    pthread_mutex_lock(&S.lock);
    device_state *d = &S.dev[dev];
    /* what a request could get: empty segments go when a pool must grow or the device is full;
     * free space between live blocks serves only requests that fit there */
    size_t n = d->pool_ready ? vmm__pool_empty_bytes(&d->pool[0]) + vmm__pool_empty_bytes(&d->pool[1]) : 0;
    pthread_mutex_unlock(&S.lock);
    return n;
}

int vmm__stream_capturing(CUstream stream)
{
    /* No stream of the process captures (every capture begins through the hooks that count
     * them): no driver call on every stream-ordered allocation and free. */
    if (__atomic_load_n(&captures, __ATOMIC_ACQUIRE) == 0) return 0;
    if (!ensure_init()) return 0;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return cu.StreamIsCapturing(stream, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

int vmm__lookup(uint64_t ptr, vmm__alloc_ref *out)
{
    if (!S.ready || !ptr) return 0;
    pthread_mutex_lock(&S.lock);
    vmm__block *b = block_containing_locked(ptr);
    if (b) {
        uint32_t n;
        uint64_t bytes;
        vmm__seg *first = span_of(b, &n, &bytes);
        out->base = b->addr;
        out->requested = b->requested;
        out->mapped = bytes;
        out->chunk_offset = b->addr - first->base;
        out->dev = ((vseg *)first->mech)->dev;
        out->slot = b->slot;
        out->generation = b->generation;
        memcpy(out->alloc_id, b->alloc_id, 16);
    }
    pthread_mutex_unlock(&S.lock);
    return b != NULL;
}

int vmm__owned(uint64_t ptr)
{
    if (!S.ready || !ptr) return 0;
    pthread_mutex_lock(&S.lock);
    int owned = arena_containing_locked(ptr) != NULL;
    pthread_mutex_unlock(&S.lock);
    return owned;
}

struct vmm__reg *vmm__registry(void)
{
    return ensure_init() && S.registry_ok ? &S.reg : NULL;
}

/* Peer access is granted per mapping with cuMemSetAccess: enabling it in the driver does not
 * cover VMM memory.  accessor may then use owner's chunks, now and in future.  All or nothing: if
 * one chunk refuses, the ones changed before it are set back and the call's error returned, so
 * the program's call can fail whole as a real one would. */
CUresult vmm__peer_access(int accessor, int owner, int enable, int *changed)
{
    if (changed) *changed = 0;
    if (!ensure_init() || accessor < 0 || owner < 0 || accessor >= MAX_DEVICES || owner >= MAX_DEVICES || accessor == owner)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&S.lock);
    device_state *d = &S.dev[owner];
    uint64_t bit = 1ull << accessor;
    int was = (__atomic_load_n(&d->accessors, __ATOMIC_ACQUIRE) & bit) != 0;
    CUresult rc = CUDA_SUCCESS;
    if (was != !!enable) {
        CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = accessor},
                               .flags = enable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE};
        vmm__seg *s = NULL, *failed = NULL;
        int k, failed_k = 2;
        for (k = 0; k < 2 && d->pool_ready && !failed; k++)
            for (s = d->pool[k].segs; s && !failed && !(k == 0 && (d->peers & bit)); s = s->snext)
                if ((rc = cu.MemSetAccess(s->base, s->size, &acc, 1)) != CUDA_SUCCESS) failed = s, failed_k = k;
        if (failed) {
            acc.flags = was ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
            unsigned unrestored = 0;
            for (k = 0; k <= failed_k && k < 2; k++)
                for (s = d->pool[k].segs; s && s != failed && !(k == 0 && (d->peers & bit)); s = s->snext)
                    if (VMM__TWICE(cu.MemSetAccess(s->base, s->size, &acc, 1)) != CUDA_SUCCESS) unrestored++;
            if (unrestored)
                vmm__log(VMM__LOG_WARNING, "peer access %d->%d: %u mappings could not be set back after a failed %s", accessor,
                         owner, unrestored, enable ? "grant" : "revoke");
        } else {
            if (enable) __atomic_or_fetch(&d->accessors, bit, __ATOMIC_RELEASE);
            else __atomic_and_fetch(&d->accessors, ~bit, __ATOMIC_RELEASE);
            if (changed) *changed = 1;
        }
    }
    pthread_mutex_unlock(&S.lock);
    return rc;
}

/* ---- ranges the program maps itself (adopt.c) ---- */

int vmm__device_exportable(int dev)
{
    return ensure_init() && dev >= 0 && dev < MAX_DEVICES && device_usable(dev);
}

uint64_t vmm__new_chunk_id(void) { return __atomic_add_fetch(&S.next_chunk_id, 1, __ATOMIC_RELAXED); }

void vmm__publish_range(uint64_t address, uint64_t extent, uint64_t handle_size, uint64_t handle_offset,
                        uint64_t chunk_id, int dev, int exportable, const vmm__frames *f, vmm__published *out)
{
    out->slot = NO_SLOT;
    if (!S.registry_ok) return;
    start_broker();
    vmm_reg_alloc d;
    fill_common(&d, dev, VMM_API_CU_MEM_MAP, NULL, extent, f);
    d.mapped_size = handle_size;
    d.chunk_id = chunk_id;
    d.chunk_offset = handle_offset;
    if (exportable) d.handle_kinds = __atomic_load_n(&S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
    else d.flags = VMM_REG_F_NOT_EXPORTABLE;
    vmm_reg_alloc pub;
    if (vmm__reg_add(&S.reg, address, extent, &d, &out->slot, &pub) != 0) {
        out->slot = NO_SLOT;
        return;
    }
    out->generation = pub.generation;
    memcpy(out->alloc_id, pub.alloc_id, 16);
}

void vmm__count_adopted(void) { count(&coverage_now()->maps_adopted); }

void vmm__retract_range(vmm__published *pub)
{
    if (pub->slot != NO_SLOT) vmm__reg_remove(&S.reg, pub->slot);
    pub->slot = NO_SLOT;
}

/* ---- the default memory pool as the program sees it ---- */

/* The device's primary context is about to be reset: native frees every allocation made on it,
 * and the default pool's settings go back to their defaults.  The shim's memory would survive a
 * reset (VMM mappings are not the context's), so it is let go of here, before the driver's
 * reset: each live allocation's record retracted and its block forgotten, every chunk unmapped
 * and released, the pool's events destroyed while their context still exists.  A free of an old
 * pointer afterwards then reaches the driver, which refuses it as native does. */
void vmm__device_reset(int dev)
{
    if (!S.ready) return;
    if (dev < 0) {
        CUcontext ctx = NULL;
        CUdevice cur = -1;
        if (cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx || cu.CtxGetDevice(&cur) != CUDA_SUCCESS) return;
        dev = (int)cur;
    }
    if (dev < 0 || dev >= MAX_DEVICES) return;
    pthread_mutex_lock(&S.lock);
    device_state *d = &S.dev[dev];
    vmm__block *b, *bt;
    HASH_ITER(hh, S.by_addr, b, bt) {
        if (dev_of_block(b) != d) continue;
        HASH_DELETE(hh, S.by_addr, b);
        retract_locked(b);
        b->live = 0;
    }
    note *n, *nt;
    HASH_ITER(hh, S.notes, n, nt) {
        if (n->dev != dev) continue;
        HASH_DELETE(hh, S.notes, n);
        if (n->slot != NO_SLOT) vmm__reg_remove(&S.reg, n->slot);
        free(n);
    }
    for (vmm__block **pp = &S.deferred; *pp;) /* their segments go with the pool */
        if (dev_of_block(*pp) == d) *pp = (*pp)->fnext;
        else pp = &(*pp)->fnext;
    if (d->pool_ready) {
        vmm__pool_destroy(&d->pool[0]);
        vmm__pool_destroy(&d->pool[1]);
        d->pool_ready = 0;
    }
    while (d->n_events) cu.EventDestroy(d->events[--d->n_events]);
    d->release_threshold = 0;
    __atomic_store_n(&d->custom_pool, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&S.lock);
}

static device_state *dev_at(int dev) { return S.ready && dev >= 0 && dev < MAX_DEVICES ? &S.dev[dev] : NULL; }

int vmm__pool_usage_get(int dev, vmm__pool_usage *out)
{
    memset(out, 0, sizeof *out);
    device_state *d = dev_at(dev);
    if (!d) return 0;
    pthread_mutex_lock(&S.lock);
    if (d->pool_ready) { /* the default pool's figures: stream-ordered memory only, as natively */
        out->reserved = d->pool[1].reserved;
        out->reserved_high = d->pool[1].reserved_high;
        out->used = d->pool[1].used;
        out->used_high = d->pool[1].used_high;
    }
    pthread_mutex_unlock(&S.lock);
    return 1;
}

void vmm__pool_usage_reset_high(int dev, int which)
{
    device_state *d = dev_at(dev);
    if (!d) return;
    pthread_mutex_lock(&S.lock);
    if (which == VMM__HIGH_RESERVED) d->pool[1].reserved_high = d->pool[1].reserved;
    else d->pool[1].used_high = d->pool[1].used;
    pthread_mutex_unlock(&S.lock);
}

/* Natively a trim gives back what frees the device has completed, synchronized or not.  A free
 * whose event the shim has not recorded yet gets it now; an idle stream reaches it a few
 * microseconds later, so the trim waits that long (outside the lock, at most TRIM_SETTLE_NS) before
 * it looks again.  A stream still busy then keeps its memory, as natively. */
#define TRIM_SETTLE_NS 2000000u
void vmm__pool_trim(int dev, uint64_t keep)
{
    device_state *d = dev_at(dev);
    if (!d) return;
    void *ev[64];
    unsigned n = 0;
    pthread_mutex_lock(&S.lock);
    if (d->pool_ready && d->pool[1].n_unrecorded) n = vmm__pool_pending_events(&d->pool[1], ev, 64);
    if (d->pool_ready) vmm__pool_release(&d->pool[1], keep, 0, UINT64_MAX);
    pthread_mutex_unlock(&S.lock);
    if (!n) return;
    uint64_t give_up = now_ns(NULL) + TRIM_SETTLE_NS;
    for (unsigned i = 0; i < n; i++) /* one recycled meanwhile is only looked at longer */
        while (!event_done(NULL, ev[i]) && now_ns(NULL) < give_up) sched_yield();
    pthread_mutex_lock(&S.lock);
    if (d->pool_ready) vmm__pool_release(&d->pool[1], keep, 0, UINT64_MAX);
    pthread_mutex_unlock(&S.lock);
}

void vmm__pool_set_release_threshold(int dev, uint64_t bytes)
{
    /* PyTorch and CuPy set it before their first allocation, which may be before anything else
     * started the shim: it must not be lost. */
    device_state *d = ensure_init() ? dev_at(dev) : NULL;
    if (!d) return;
    pthread_mutex_lock(&S.lock);
    d->release_threshold = bytes;
    if (d->pool_ready) d->pool[1].retain = retain_of(d, 1);
    /* a lower threshold may put memory past it: gone at the next synchronization, as natively */
    __atomic_store_n(&vmm__sync.sync_due, 1, __ATOMIC_RELAXED);
    purge_kick_locked();
    pthread_mutex_unlock(&S.lock);
}

void vmm__pool_current_is_default(int dev, int is_default)
{
    device_state *d = dev_at(dev);
    if (d) __atomic_store_n(&d->custom_pool, !is_default, __ATOMIC_RELEASE);
}
