/* VMM backing: the mechanism under the pool (shim/pool decides where allocations go).  A chunk
 * is one cuMemCreate handle (POSIX-fd exportable), mapped into its own reservation aligned to the
 * next power of two of its size, so the chunk holding any address is found by a few exact
 * lookups.  Every allocation is published in the registry with its chunk; the broker exports the
 * chunk's handle.  Stream-ordered frees become reusable once an event shows the stream reached
 * them (at once on the same stream): the pool asks through the event callbacks here. */
#include "backing/backing.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uthash.h>

#include "backing/adopt.h"
#include "backing/frames.h"
#include "broker/broker.h"
#include "core/log.h"
#include "core/options.h"
#include "hooks/real.h"
#include "pool/pool.h"
#include "registry/registry.h"

#define MAX_DEVICES 64
#define NO_SLOT UINT32_MAX

/* A chunk as the mechanism knows it. */
typedef struct vchunk {
    uint64_t base, size; /* key of the table: base */
    CUmemGenericAllocationHandle handle;
    int dev, exported_fd, has_fabric;
    /* The fd the broker hands out duplicates of: exported at the first request for the chunk
     * (an export costs ~0.6 ms on an H100, a dup microseconds), kept above 1023 like exported_fd;
     * -1 until then, or for good when no such fd number is free (each request exports then). */
    int broker_fd;
    uint64_t id;
    uint8_t fabric[64];
    vmm__chunk *pool_chunk;
    UT_hash_handle hh;
} vchunk;

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
    CUcontext primary;
    size_t granularity;
    uint8_t uuid[16];
    vmm__pool pool;
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
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
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
    vmm__block *by_addr, *by_slot; /* live allocations */
    vmm__block *deferred;          /* freed while a stream captured, not yet synchronized (via fnext) */
    vchunk *chunks;                /* by base */
    note *notes;                   /* by address */
    uint64_t next_chunk_id;
    size_t cache_limit;
    char tag[32];
    device_state dev[MAX_DEVICES];
} S = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Streams being captured right now, process-wide (vmm__capture_begun). */
static int captures;

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
             LOAD(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain) && LOAD(DeviceGetAttribute, cuDeviceGetAttribute) &&
             LOAD(DeviceGetUuid, cuDeviceGetUuid) && LOAD(MemGetAllocationGranularity, cuMemGetAllocationGranularity) &&
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

static void at_exit(void)
{
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
        vmm__reg_detach(&S.reg);
        vmm__frames_exit();
    }
    if (vmm__opt_bool(VMM__OPT_STATS)) print_coverage(&local_coverage);
    if (vmm__opt_bool(VMM__OPT_VERBOSE))
        for (int i = 0; i < MAX_DEVICES; i++) {
            const vmm__pool *p = &S.dev[i].pool;
            if (S.dev[i].pool_ready)
                vmm__log(VMM__LOG_INFO, "device %d pool: %llu chunks made, %llu given back; peak %llu MiB reserved, %llu MiB used",
                         i, (unsigned long long)p->chunks_made, (unsigned long long)p->chunks_released,
                         (unsigned long long)(p->reserved_high >> 20), (unsigned long long)(p->used_high >> 20));
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
    vchunk *chunks;
    note *notes;
    struct {
        vmm__chunk *chunks;
        vmm__block *spare;
        CUevent *events;
    } dev[MAX_DEVICES];
} inherited;

static void after_fork_child(void)
{
    /* The child owns none of its parent's memory: forget it all, and start afresh if it ever
     * allocates (CUDA itself is not usable across fork unless the child re-initialises). */
    pthread_mutex_init(&S.lock, NULL);
    inherited.by_addr = S.by_addr;
    inherited.by_slot = S.by_slot;
    inherited.chunks = S.chunks;
    inherited.notes = S.notes;
    for (int i = 0; i < MAX_DEVICES; i++) {
        inherited.dev[i].chunks = S.dev[i].pool.chunks;
        inherited.dev[i].spare = S.dev[i].pool.spare;
        inherited.dev[i].events = S.dev[i].events;
    }
    S.by_addr = S.by_slot = NULL; /* parent's chunks leak in the child by design */
    S.chunks = NULL;
    S.notes = NULL;
    S.deferred = NULL;
    __atomic_store_n(&captures, 0, __ATOMIC_RELAXED); /* the parent's capturing threads are not here */
    memset(S.dev, 0, sizeof S.dev);
    if (S.registry_ok) vmm__reg_forget_after_fork(&S.reg);
    S.broker_started = 0;
    S.broker_path[0] = 0;
    vmm__broker_forget_after_fork();
    if (S.registry_ok && vmm__reg_attach(&S.reg, "") != 0) S.registry_ok = 0;
    if (S.registry_ok) {
        coverage = vmm__reg_self(&S.reg);
        vmm__frames_after_fork(&S.reg);
    }
}

static void init(void)
{
    int opt_rc = vmm__opt_init();
    /* Before anything can make the shim pass calls through: those are counted too. */
    atexit(at_exit);
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
    S.cache_limit = (size_t)vmm__opt_size(VMM__OPT_CACHE_SIZE);
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

/* ---- chunks: the mechanism the pool calls (under S.lock) ---- */

static uint64_t pow2_ceil(uint64_t v)
{
    uint64_t p = 1;
    while (p < v) p <<= 1;
    return p;
}

static void export_chunk(vchunk *c)
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

/* Give back what a chunk holds: its mapping, reservation and handle, as far as they exist, each
 * call made twice if need be (VMM__TWICE); what still fails stays with the driver until the
 * process exits (one warning), and a range still holding its mapping is not freed under it. */
static void chunk_undo(CUdeviceptr va, uint64_t size, CUmemGenericAllocationHandle h, int mapped, int reserved)
{
    CUresult unmap = mapped ? VMM__TWICE(cu.MemUnmap(va, size)) : CUDA_SUCCESS;
    CUresult unreserve = reserved && unmap == CUDA_SUCCESS ? VMM__TWICE(cu.MemAddressFree(va, size)) : CUDA_SUCCESS;
    CUresult release = VMM__TWICE(cu.MemRelease(h));
    const char *what = unmap ? "cuMemUnmap" : unreserve ? "cuMemAddressFree" : release ? "cuMemRelease" : NULL;
    if (what)
        vmm__log(VMM__LOG_WARNING, "giving back a chunk of %llu bytes: %s failed twice (CUDA error %d); the driver keeps it "
                 "until exit", (unsigned long long)size, what, (int)(unmap ? unmap : unreserve ? unreserve : release));
}

static int chunk_create(void *ctx, vmm__chunk *pc)
{
    device_state *d = ctx;
    uint64_t size = pc->size;
    int dev = d->index;
    CUmemAllocationProp p = {0};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | (d->fabric ? CU_MEM_HANDLE_TYPE_FABRIC : 0);
    CUmemGenericAllocationHandle h;
    CUresult rc = cu.MemCreate(&h, size, &p, 0);
    if (rc != CUDA_SUCCESS) return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    CUdeviceptr va = 0;
    int reserved = 0, mapped = 0;
    if ((rc = cu.MemAddressReserve(&va, size, pow2_ceil(size), 0, 0)) != CUDA_SUCCESS) goto undo;
    reserved = 1;
    if ((rc = cu.MemMap(va, size, 0, h, 0)) != CUDA_SUCCESS) goto undo;
    mapped = 1;
    CUmemAccessDesc acc[MAX_DEVICES];
    size_t n_acc = 0;
    uint64_t accessors = __atomic_load_n(&d->accessors, __ATOMIC_ACQUIRE) | (1ull << dev);
    for (int i = 0; i < MAX_DEVICES; i++)
        if (accessors & (1ull << i))
            acc[n_acc++] = (CUmemAccessDesc){.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = i},
                                             .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((rc = cu.MemSetAccess(va, size, acc, n_acc)) != CUDA_SUCCESS) goto undo;
    vchunk *c = calloc(1, sizeof *c);
    if (!c) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto undo;
    }
    c->base = va;
    c->size = size;
    c->handle = h;
    c->dev = dev;
    c->exported_fd = -1;
    c->broker_fd = -1;
    c->id = vmm__new_chunk_id();
    c->pool_chunk = pc;
    export_chunk(c);
    HASH_ADD(hh, S.chunks, base, sizeof(uint64_t), c);
    pc->base = va;
    pc->mech = c;
    return 0;
undo:
    chunk_undo(va, size, h, mapped, reserved);
    return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
}

/* The pool calls this only for chunks with no allocation left and every free's event reached. */
static void chunk_destroy(void *ctx, vmm__chunk *pc)
{
    (void)ctx;
    vchunk *c = pc->mech;
    HASH_DELETE(hh, S.chunks, c);
    if (c->exported_fd >= 0) close(c->exported_fd); /* its records were retracted before */
    if (c->broker_fd >= 0) close(c->broker_fd);
    chunk_undo(c->base, c->size, c->handle, 1, 1);
    free(c);
}

static int event_done(void *ctx, void *e)
{
    (void)ctx;
    CUresult rc = cu.EventQuery((CUevent)e);
    return rc != CUDA_ERROR_NOT_READY; /* an error will never become "reached": do not wait on it */
}

static void event_wait(void *ctx, void *e)
{
    (void)ctx;
    cu.EventSynchronize((CUevent)e);
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

static uint64_t retain_bytes(const device_state *d)
{
    return d->release_threshold > S.cache_limit ? d->release_threshold : S.cache_limit;
}

static vmm__pool *pool_of_locked(device_state *d)
{
    if (!d->pool_ready) {
        vmm__pool_ops ops = {.ctx = d,
                             .chunk_create = chunk_create,
                             .chunk_destroy = chunk_destroy,
                             .event_done = event_done,
                             .event_wait = event_wait,
                             .event_release = event_release};
        vmm__pool_init(&d->pool, &ops, d->granularity, retain_bytes(d), S.isolate);
        d->pool_ready = 1;
    }
    return &d->pool;
}

/* ---- publishing and the broker ---- */

static int broker_export(uint64_t slot, uint64_t generation, const uint8_t id[16], int *fd, uint64_t *mapped,
                         uint32_t *device)
{
    pthread_mutex_lock(&S.lock);
    vmm__block *b = NULL;
    uint32_t key = (uint32_t)slot;
    HASH_FIND(hs, S.by_slot, &key, sizeof key, b);
    int rc;
    if (!b) {
        pthread_mutex_unlock(&S.lock);
        return vmm__adopt_export(slot, generation, id, fd, mapped, device); /* a range the program mapped */
    }
    if (!b->live)
        rc = -ENOENT;
    else if (b->generation != generation || memcmp(b->alloc_id, id, 16) != 0)
        rc = -ESTALE;
    else {
        vchunk *c = b->chunk->mech;
        int kept = c->broker_fd >= 0 ? c->broker_fd : c->exported_fd;
        rc = 0;
        if (kept >= 0) {
            if ((*fd = fcntl(kept, F_DUPFD_CLOEXEC, 0)) < 0) rc = -errno;
        } else if (cu.MemExportToShareableHandle(fd, c->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) !=
                   CUDA_SUCCESS) {
            rc = -EIO;
        } else {
            c->broker_fd = fcntl(*fd, F_DUPFD_CLOEXEC, 1024);
        }
        if (rc == 0) {
            *mapped = c->size;
            *device = (uint32_t)c->dev;
        }
    }
    pthread_mutex_unlock(&S.lock);
    return rc;
}

static void start_broker(void)
{
    if (__atomic_load_n(&S.broker_started, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&S.lock);
    if (!S.broker_started) {
        int rc = vmm__broker_start(broker_export, S.broker_path, sizeof S.broker_path);
        if (rc == 0) vmm__reg_set_broker(&S.reg, S.broker_path);
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

/* One record per allocation: bound (and indexed) at its address and extent, published with its
 * chunk.  Under S.lock, so the broker never sees a half-published block. */
static void publish_locked(vmm__block *b, CUstream stream, const vmm__frames *f)
{
    b->slot = NO_SLOT;
    if (!S.registry_ok) return;
    vchunk *c = b->chunk->mech;
    vmm_reg_alloc d;
    fill_common(&d, c->dev, b->api, stream, b->requested, f);
    d.mapped_size = c->size;
    d.chunk_id = c->id;
    d.chunk_offset = b->addr - c->base;
    d.flags = b->size < c->size ? VMM_REG_F_SHARED_CHUNK : 0;
    d.handle_kinds = __atomic_load_n(&S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
    if (c->exported_fd >= 0) {
        d.handle_kinds |= VMM_HANDLE_PIDFD;
        d.exported_fd = c->exported_fd;
    }
    if (c->has_fabric) {
        d.handle_kinds |= VMM_HANDLE_FABRIC;
        memcpy(d.fabric, c->fabric, sizeof d.fabric);
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
    int err;
    vmm__block *b = vmm__pool_alloc(pool_of_locked(d), size, stream_ordered, (uint64_t)(uintptr_t)stream, &err);
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

/* The chunk holding p, of any state: chunks are aligned to the next power of two of their size,
 * so the base is p rounded down to one of a few dozen alignments. */
static vchunk *chunk_containing_locked(uint64_t p)
{
    for (unsigned k = 21; k <= 47; k++) {
        uint64_t base = p & ~((1ull << k) - 1);
        vchunk *c = NULL;
        HASH_FIND(hh, S.chunks, &base, sizeof base, c);
        if (c) return p - c->base < c->size ? c : NULL;
    }
    return NULL;
}

/* The live allocation whose [addr, addr + requested) holds p. */
static vmm__block *block_containing_locked(uint64_t p)
{
    vmm__block *b = NULL;
    HASH_FIND(hh, S.by_addr, &p, sizeof p, b);
    if (!b) {
        vchunk *c = chunk_containing_locked(p);
        if (!c) return NULL;
        vmm_reg_alloc rec;
        uint64_t slot;
        if (S.registry_ok && vmm__reg_find(&S.reg, S.reg.pid, p, &rec, &slot) == 0) {
            uint32_t key = (uint32_t)slot;
            HASH_FIND(hs, S.by_slot, &key, sizeof key, b);
        } else {
            b = vmm__pool_block_at(c->pool_chunk, p); /* unpublished: walk the chunk */
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
        vmm__pool_free(&S.dev[((vchunk *)b->chunk->mech)->dev].pool, b, 0, NULL);
    }
}

vmm__result vmm__free(void *ptr, int stream_ordered, CUstream stream)
{
    if (!ptr || !S.ready) return VMM__PASS;
    uint64_t p = (uint64_t)(uintptr_t)ptr;
    int capturing = stream_ordered && vmm__stream_capturing(stream); /* a driver call: not under the lock */
    pthread_mutex_lock(&S.lock);
    vmm__block *b = NULL;
    HASH_FIND(hh, S.by_addr, &p, sizeof p, b);
    if (!b) {
        note *n = NULL;
        HASH_FIND(hh, S.notes, &p, sizeof p, n);
        if (n) HASH_DELETE(hh, S.notes, n); /* the real runtime owns it; drop our note of it */
        vmm__result r = n ? VMM__PASS : chunk_containing_locked(p) ? VMM__INVALID : VMM__PASS;
        pthread_mutex_unlock(&S.lock);
        if (n) {
            if (n->slot != NO_SLOT) vmm__reg_remove(&S.reg, n->slot);
            free(n);
        }
        return r;
    }
    HASH_DELETE(hh, S.by_addr, b);
    retract_locked(b); /* out of the registry before the memory can be reused */
    b->live = 0;
    device_state *d = &S.dev[((vchunk *)b->chunk->mech)->dev];
    CUevent ev = NULL;
    if (stream_ordered) {
        if (capturing) {
            /* The free happens when the graph runs, which we cannot observe: never reuse it. */
            pthread_mutex_unlock(&S.lock);
            vmm__log(VMM__LOG_WARNING, "stream-ordered free of shim memory during graph capture; its block is retired");
            return VMM__DONE;
        }
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
    vmm__pool_free(&d->pool, b, (uint64_t)(uintptr_t)stream, ev);
    pthread_mutex_unlock(&S.lock);
    return VMM__DONE;
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
    size_t n = d->pool_ready ? d->pool.reserved - d->pool.used : 0;
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
        vchunk *c = b->chunk->mech;
        out->base = b->addr;
        out->requested = b->requested;
        out->mapped = c->size;
        out->chunk_offset = b->addr - c->base;
        out->dev = c->dev;
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
    int owned = chunk_containing_locked(ptr) != NULL;
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
        vchunk *c, *failed = NULL;
        for (c = S.chunks; c && !failed; c = c->hh.next)
            if (c->dev == owner && (rc = cu.MemSetAccess(c->base, c->size, &acc, 1)) != CUDA_SUCCESS) failed = c;
        if (failed) {
            acc.flags = was ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
            unsigned unrestored = 0;
            for (c = S.chunks; c != failed; c = c->hh.next)
                if (c->dev == owner && VMM__TWICE(cu.MemSetAccess(c->base, c->size, &acc, 1)) != CUDA_SUCCESS) unrestored++;
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
        if (((vchunk *)b->chunk->mech)->dev != dev) continue;
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
    for (vmm__block **pp = &S.deferred; *pp;) /* their chunks go with the pool */
        if (((vchunk *)(*pp)->chunk->mech)->dev == dev) *pp = (*pp)->fnext;
        else pp = &(*pp)->fnext;
    if (d->pool_ready) {
        vmm__pool_destroy(&d->pool);
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
    if (d->pool_ready) {
        out->reserved = d->pool.reserved;
        out->reserved_high = d->pool.reserved_high;
        out->used = d->pool.used;
        out->used_high = d->pool.used_high;
    }
    pthread_mutex_unlock(&S.lock);
    return 1;
}

void vmm__pool_usage_reset_high(int dev, int which)
{
    device_state *d = dev_at(dev);
    if (!d) return;
    pthread_mutex_lock(&S.lock);
    if (which == VMM__HIGH_RESERVED) d->pool.reserved_high = d->pool.reserved;
    else d->pool.used_high = d->pool.used;
    pthread_mutex_unlock(&S.lock);
}

void vmm__pool_trim(int dev, uint64_t keep)
{
    device_state *d = dev_at(dev);
    if (!d) return;
    pthread_mutex_lock(&S.lock);
    if (d->pool_ready) vmm__pool_give_back(&d->pool, keep);
    pthread_mutex_unlock(&S.lock);
}

void vmm__pool_set_release_threshold(int dev, uint64_t bytes)
{
    device_state *d = dev_at(dev);
    if (!d) return;
    pthread_mutex_lock(&S.lock);
    d->release_threshold = bytes;
    if (d->pool_ready) d->pool.retain = retain_bytes(d);
    pthread_mutex_unlock(&S.lock);
}

void vmm__pool_current_is_default(int dev, int is_default)
{
    device_state *d = dev_at(dev);
    if (d) __atomic_store_n(&d->custom_pool, !is_default, __ATOMIC_RELEASE);
}
