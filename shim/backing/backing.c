/* VMM backing: every allocation is its own cuMemCreate (POSIX-fd exportable) handle mapped into
 * its own reservation, aligned to the next power of two of its size so the registry can find it
 * from any interior address.  Freed chunks go to a bounded per-device cache; stream-ordered frees
 * become reusable once an event shows the stream reached them (or at once on the same stream). */
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

#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>

#include "broker/broker.h"
#include "core/log.h"
#include "core/options.h"
#include "hooks/real.h"
#include "registry/registry.h"

#define MAX_DEVICES 64
#define NO_SLOT UINT32_MAX

enum { CH_LIVE, CH_FREEING, CH_CACHED, CH_PASSTHROUGH };

typedef struct chunk {
    uint64_t va; /* key of the table */
    uint64_t mapped, requested;
    CUmemGenericAllocationHandle handle;
    CUcontext ctx;
    int dev, state, exported_fd;
    uint32_t slot, api;
    uint64_t generation, stream;
    uint8_t alloc_id[16];
    CUevent free_event; /* pending stream-ordered free; NULL once reusable */
    CUstream free_stream;
    struct chunk *lru_prev, *lru_next; /* cache order, per device, newest at head */
    UT_hash_handle hh;                 /* by va */
    UT_hash_handle hs;                 /* by registry slot */
} chunk;

typedef struct device_state {
    int checked, usable, fabric;
    uint64_t accessors; /* other devices granted access to this device's chunks (peer access) */
    CUcontext primary;
    size_t granularity;
    uint8_t uuid[16];
    chunk *lru_head, *lru_tail;
    size_t cached_bytes;
    CUevent *events; /* pool of timing-free events */
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
    pthread_mutex_t lock;
    int ready;  /* 1: backing active; 0: pass every call through */
    int failed; /* the start failed (strict mode refuses instead of passing through) */
    int export_pidfd;
    int n_frames;
    vmm__reg reg;
    int registry_ok;
    char broker_path[112];
    int broker_started;
    chunk *by_va, *by_slot;
    size_t cache_limit;
    char tag[32];
    device_state dev[MAX_DEVICES];
} S = {.lock = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* libunwind exports _Unwind_* and a weak backtrace(): loaded globally it would take over the
 * host's C++ exception unwinding.  So it is opened privately, from beside the shim, and only
 * when call-site frames are asked for. */
static int (*unwind_backtrace)(void **, int);

static void load_unwinder(void)
{
    Dl_info self;
    char path[PATH_MAX];
    void *h = NULL;
    if (dladdr((void *)&S, &self) && self.dli_fname) {
        snprintf(path, sizeof path, "%s", self.dli_fname);
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s/libunwind.so.8", dirname(path));
        h = dlopen(dir, RTLD_NOW | RTLD_LOCAL);
    }
    if (!h) h = dlopen("libunwind.so.8", RTLD_NOW | RTLD_LOCAL);
    void *fn = h ? vmm__real_dlsym(h, "unw_backtrace") : NULL;
    memcpy(&unwind_backtrace, &fn, sizeof fn);
    if (!unwind_backtrace) vmm__log(VMM__LOG_WARNING, "VMMSHIM_FRAMES needs libunwind.so.8 beside the shim; frames are not recorded");
}

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

static void on_exit_detach(void)
{
    /* Pure shared-memory work: CUDA may already be torn down at exit. */
    if (S.registry_ok) vmm__reg_detach(&S.reg);
}

static void after_fork_child(void)
{
    /* The child owns none of its parent's memory: forget it all, and start afresh if it ever
     * allocates (CUDA itself is not usable across fork unless the child re-initialises). */
    pthread_mutex_init(&S.lock, NULL);
    S.by_va = S.by_slot = NULL; /* parent's chunks leak in the child by design */
    memset(S.dev, 0, sizeof S.dev);
    if (S.registry_ok) vmm__reg_forget_after_fork(&S.reg);
    S.broker_started = 0;
    S.broker_path[0] = 0;
    vmm__broker_forget_after_fork();
    if (S.registry_ok && vmm__reg_attach(&S.reg, "") != 0) S.registry_ok = 0;
}

static void init(void)
{
    int opt_rc = vmm__opt_init();
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
    S.n_frames = (int)vmm__opt_int(VMM__OPT_FRAMES);
    if (S.n_frames > 0) load_unwinder();
    S.cache_limit = (size_t)vmm__opt_size(VMM__OPT_CACHE_SIZE);
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
    atexit(on_exit_detach);
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
        if (!S.dev[d].primary && cu.DevicePrimaryCtxRetain(&S.dev[d].primary, d) != CUDA_SUCCESS) return -1;
        if (cu.CtxSetCurrent(S.dev[d].primary) != CUDA_SUCCESS) return -1;
        ctx = S.dev[d].primary;
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

/* ---- chunk lifecycle ---- */

static uint64_t pow2_ceil(uint64_t v)
{
    uint64_t p = 1;
    while (p < v) p <<= 1;
    return p;
}

static CUresult create_chunk(int dev, CUcontext ctx, uint64_t mapped, chunk **out)
{
    device_state *d = &S.dev[dev];
    CUmemAllocationProp p = {0};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | (d->fabric ? CU_MEM_HANDLE_TYPE_FABRIC : 0);
    CUmemGenericAllocationHandle h;
    CUresult rc = cu.MemCreate(&h, mapped, &p, 0);
    if (rc != CUDA_SUCCESS) return rc;
    CUdeviceptr va = 0;
    uint64_t align = pow2_ceil(mapped);
    rc = cu.MemAddressReserve(&va, mapped, align, 0, 0);
    if (rc != CUDA_SUCCESS) goto release;
    if ((rc = cu.MemMap(va, mapped, 0, h, 0)) != CUDA_SUCCESS) goto unreserve;
    CUmemAccessDesc acc[MAX_DEVICES];
    size_t n_acc = 0;
    uint64_t accessors = __atomic_load_n(&d->accessors, __ATOMIC_ACQUIRE) | (1ull << dev);
    for (int i = 0; i < MAX_DEVICES; i++)
        if (accessors & (1ull << i))
            acc[n_acc++] = (CUmemAccessDesc){.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = i},
                                             .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((rc = cu.MemSetAccess(va, mapped, acc, n_acc)) != CUDA_SUCCESS) goto unmap;
    chunk *c = calloc(1, sizeof *c);
    if (!c) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto unmap;
    }
    c->va = va;
    c->mapped = mapped;
    c->handle = h;
    c->ctx = ctx;
    c->dev = dev;
    c->exported_fd = -1;
    c->slot = NO_SLOT;
    if (S.registry_ok && vmm__reg_bind(&S.reg, va, mapped, &c->slot) != 0) c->slot = NO_SLOT;
    *out = c;
    return CUDA_SUCCESS;
unmap:
    cu.MemUnmap(va, mapped);
unreserve:
    cu.MemAddressFree(va, mapped);
release:
    cu.MemRelease(h);
    return rc;
}

/* Callers have made sure no work in flight still uses the chunk. */
static void destroy_chunk(chunk *c)
{
    if (c->free_event) {
        cu.EventSynchronize(c->free_event);
        cu.EventDestroy(c->free_event);
    }
    if (c->slot != NO_SLOT) vmm__reg_unbind(&S.reg, c->slot);
    cu.MemUnmap(c->va, c->mapped);
    cu.MemAddressFree(c->va, c->mapped);
    cu.MemRelease(c->handle);
    free(c);
}

static void lru_unlink(device_state *d, chunk *c)
{
    if (c->lru_prev) c->lru_prev->lru_next = c->lru_next;
    else d->lru_head = c->lru_next;
    if (c->lru_next) c->lru_next->lru_prev = c->lru_prev;
    else d->lru_tail = c->lru_prev;
    c->lru_prev = c->lru_next = NULL;
    d->cached_bytes -= c->mapped;
}

static void lru_push(device_state *d, chunk *c)
{
    c->lru_prev = NULL;
    c->lru_next = d->lru_head;
    if (d->lru_head) d->lru_head->lru_prev = c;
    else d->lru_tail = c;
    d->lru_head = c;
    d->cached_bytes += c->mapped;
}

/* Take cached chunks out of the tables until the cache holds at most `keep` bytes; the caller
 * destroys the returned list outside the lock. */
static chunk *evict_locked(device_state *d, size_t keep)
{
    chunk *victims = NULL;
    while (d->lru_tail && d->cached_bytes > keep) {
        chunk *c = d->lru_tail;
        lru_unlink(d, c);
        HASH_DELETE(hh, S.by_va, c);
        if (c->slot != NO_SLOT) HASH_DELETE(hs, S.by_slot, c);
        c->lru_next = victims;
        victims = c;
    }
    return victims;
}

static void destroy_list(chunk *c)
{
    while (c) {
        chunk *n = c->lru_next;
        destroy_chunk(c);
        c = n;
    }
}

static CUevent event_get(device_state *d)
{
    if (d->n_events) return d->events[--d->n_events];
    CUevent e = NULL;
    return cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS ? e : NULL;
}

static void event_put_locked(device_state *d, CUevent e)
{
    if (d->n_events == d->cap_events) {
        size_t n = d->cap_events ? d->cap_events * 2 : 64;
        CUevent *p = realloc(d->events, n * sizeof *p);
        if (!p) {
            cu.EventDestroy(e);
            return;
        }
        d->events = p;
        d->cap_events = n;
    }
    d->events[d->n_events++] = e;
}

/* A cached chunk of exactly `mapped` bytes that `stream` may use now. */
static chunk *cache_take_locked(device_state *d, uint64_t mapped, int stream_ordered, CUstream stream)
{
    for (chunk *c = d->lru_head; c; c = c->lru_next) {
        if (c->mapped != mapped) continue;
        if (c->free_event) {
            bool same_stream = stream_ordered && c->free_stream == stream;
            if (!same_stream && cu.EventQuery(c->free_event) != CUDA_SUCCESS) continue;
            event_put_locked(d, c->free_event);
            c->free_event = NULL;
        }
        lru_unlink(d, c);
        return c;
    }
    return NULL;
}

/* ---- publishing and the broker ---- */

static int broker_export(uint64_t slot, uint64_t generation, const uint8_t id[16], int *fd, uint64_t *mapped,
                         uint32_t *device)
{
    pthread_mutex_lock(&S.lock);
    chunk *c = NULL;
    HASH_FIND(hs, S.by_slot, &slot, sizeof(uint32_t), c);
    int rc;
    if (!c || c->state != CH_LIVE)
        rc = -ENOENT;
    else if (c->generation != generation || memcmp(c->alloc_id, id, 16) != 0)
        rc = -ESTALE;
    else if (cu.MemExportToShareableHandle(fd, c->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS)
        rc = -EIO;
    else {
        rc = 0;
        *mapped = c->mapped;
        *device = (uint32_t)c->dev;
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

static void publish(chunk *c, uint32_t api, CUstream stream, uint32_t flags)
{
    if (c->slot == NO_SLOT) return;
    vmm_reg_alloc d;
    memset(&d, 0, sizeof d);
    d.device = (uint32_t)c->dev;
    d.api = api;
    memcpy(d.device_uuid, S.dev[c->dev].uuid, 16);
    d.requested_size = c->requested;
    d.stream = (uint64_t)(uintptr_t)stream;
    d.flags = flags;
    d.exported_fd = -1;
    if (!(flags & VMM_REG_F_NOT_EXPORTABLE)) {
        d.handle_kinds = __atomic_load_n(&S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
        if (S.export_pidfd) {
            int fd = -1;
            if (cu.MemExportToShareableHandle(&fd, c->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_SUCCESS) {
                /* above 1023 so select() users never see it */
                int high = fcntl(fd, F_DUPFD_CLOEXEC, 1024);
                close(fd);
                c->exported_fd = high;
                if (high >= 0) {
                    d.handle_kinds |= VMM_HANDLE_PIDFD;
                    d.exported_fd = high;
                }
            }
        }
        if (S.dev[c->dev].fabric &&
            cu.MemExportToShareableHandle(d.fabric, c->handle, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_SUCCESS)
            d.handle_kinds |= VMM_HANDLE_FABRIC;
    }
    memcpy(d.tag, S.tag, sizeof d.tag);
    if (S.n_frames > 0 && unwind_backtrace) {
        void *frames[8 + 3];
        int n = unwind_backtrace(frames, S.n_frames + 3);
        for (int i = 3; i < n && d.n_frames < 8; i++) d.frames[d.n_frames++] = (uint64_t)(uintptr_t)frames[i];
    }
    vmm_reg_alloc out;
    if (vmm__reg_publish(&S.reg, c->slot, &d, &out) == 0) {
        c->generation = out.generation;
        memcpy(c->alloc_id, out.alloc_id, 16);
    }
}

static void retract(chunk *c)
{
    if (c->slot != NO_SLOT) vmm__reg_retract(&S.reg, c->slot);
    if (c->exported_fd >= 0) {
        close(c->exported_fd);
        c->exported_fd = -1;
    }
}

/* ---- the API ---- */

vmm__result vmm__alloc(size_t size, uint32_t api, int stream_ordered, CUstream stream, void **ptr)
{
    if (!ensure_init()) return S.failed && vmm__opt_bool(VMM__OPT_STRICT) ? VMM__REFUSED : VMM__PASS;
    if (!ptr || size == 0) return VMM__PASS; /* the runtime's own answer for these */
    CUcontext ctx;
    int runtime_api = api == VMM_API_CUDA_MALLOC || api == VMM_API_CUDA_MALLOC_ASYNC;
    int dev = current_device(&ctx, runtime_api);
    if (dev < 0 || !device_usable(dev)) return vmm__opt_bool(VMM__OPT_STRICT) && dev >= 0 ? VMM__REFUSED : VMM__PASS;
    device_state *d = &S.dev[dev];
    if (size > UINT64_MAX - d->granularity) return VMM__NOMEM;
    uint64_t mapped = (size + d->granularity - 1) / d->granularity * d->granularity;
    start_broker(); /* one atomic load once it has started */

    pthread_mutex_lock(&S.lock);
    chunk *c = cache_take_locked(d, mapped, stream_ordered, stream);
    pthread_mutex_unlock(&S.lock);
    if (!c) {
        CUresult rc = create_chunk(dev, ctx, mapped, &c);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            /* Never fail earlier than the driver would: give back everything cached, retry. */
            pthread_mutex_lock(&S.lock);
            chunk *victims = evict_locked(d, 0);
            pthread_mutex_unlock(&S.lock);
            destroy_list(victims);
            rc = create_chunk(dev, ctx, mapped, &c);
        }
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) return VMM__NOMEM;
        if (rc != CUDA_SUCCESS) {
            vmm__log(VMM__LOG_WARNING, "VMM allocation of %zu bytes failed (CUDA error %d); passing it through", size, (int)rc);
            return VMM__PASS;
        }
        pthread_mutex_lock(&S.lock);
        HASH_ADD(hh, S.by_va, va, sizeof(uint64_t), c);
        if (c->slot != NO_SLOT) HASH_ADD(hs, S.by_slot, slot, sizeof(uint32_t), c);
        pthread_mutex_unlock(&S.lock);
    }
    c->requested = size;
    c->api = api;
    c->stream = (uint64_t)(uintptr_t)stream;
    publish(c, api, stream, 0);
    __atomic_store_n(&c->state, CH_LIVE, __ATOMIC_RELEASE);
    *ptr = (void *)(uintptr_t)c->va;
    return VMM__DONE;
}

/* Is ptr inside one of our chunks (of any state)?  Chunks are aligned to the next power of two
 * of their size, so the base is ptr rounded down to one of a few dozen alignments. */
static chunk *find_containing_locked(uint64_t p)
{
    for (unsigned k = 21; k <= 47; k++) {
        uint64_t base = p & ~((1ull << k) - 1);
        chunk *c = NULL;
        HASH_FIND(hh, S.by_va, &base, sizeof base, c);
        if (c) return p < c->va + c->mapped ? c : NULL;
    }
    return NULL;
}

static void sync_ctx(CUcontext ctx)
{
    CUcontext prev = NULL;
    cu.CtxGetCurrent(&prev);
    if (prev != ctx) cu.CtxSetCurrent(ctx);
    cu.CtxSynchronize();
    if (prev != ctx) cu.CtxSetCurrent(prev);
}

vmm__result vmm__free(void *ptr, int stream_ordered, CUstream stream)
{
    if (!ptr || !S.ready) return VMM__PASS;
    uint64_t p = (uint64_t)(uintptr_t)ptr;
    pthread_mutex_lock(&S.lock);
    chunk *c = NULL;
    HASH_FIND(hh, S.by_va, &p, sizeof p, c);
    if (!c) {
        vmm__result r = find_containing_locked(p) ? VMM__INVALID : VMM__PASS;
        pthread_mutex_unlock(&S.lock);
        return r;
    }
    if (c->state == CH_PASSTHROUGH) {
        /* the real runtime owns it; we only drop the registry's note of it */
        HASH_DELETE(hh, S.by_va, c);
        if (c->slot != NO_SLOT) HASH_DELETE(hs, S.by_slot, c);
        pthread_mutex_unlock(&S.lock);
        if (c->slot != NO_SLOT) vmm__reg_unbind(&S.reg, c->slot);
        free(c);
        return VMM__PASS;
    }
    if (c->state != CH_LIVE) {
        pthread_mutex_unlock(&S.lock);
        return VMM__INVALID;
    }
    c->state = CH_FREEING;
    pthread_mutex_unlock(&S.lock);

    retract(c); /* out of the registry before the memory can be reused */
    device_state *d = &S.dev[c->dev];
    CUevent ev = NULL;
    if (stream_ordered) {
        if (vmm__stream_capturing(stream)) {
            /* The free happens when the graph runs, which we cannot observe: never reuse it. */
            vmm__log(VMM__LOG_WARNING, "stream-ordered free of shim memory during graph capture; its chunk is retired");
            pthread_mutex_lock(&S.lock);
            c->state = CH_CACHED;
            c->free_event = NULL;
            HASH_DELETE(hh, S.by_va, c);
            if (c->slot != NO_SLOT) HASH_DELETE(hs, S.by_slot, c);
            pthread_mutex_unlock(&S.lock);
            return VMM__DONE;
        }
        pthread_mutex_lock(&S.lock);
        ev = event_get(d);
        pthread_mutex_unlock(&S.lock);
        if (!ev || cu.EventRecord(ev, stream) != CUDA_SUCCESS) {
            if (ev) cu.EventDestroy(ev);
            ev = NULL;
            cu.StreamSynchronize(stream);
        }
    } else {
        sync_ctx(c->ctx); /* cudaFree waits for the device, and so must we before reuse */
    }
    pthread_mutex_lock(&S.lock);
    c->state = CH_CACHED;
    c->free_event = ev;
    c->free_stream = stream;
    lru_push(d, c);
    chunk *victims = evict_locked(d, S.cache_limit);
    pthread_mutex_unlock(&S.lock);
    destroy_list(victims);
    return VMM__DONE;
}

void vmm__note_passthrough(void *ptr, size_t size, uint32_t api, CUstream stream)
{
    if (!S.ready || !ptr || !S.registry_ok) return;
    chunk *c = calloc(1, sizeof *c);
    if (!c) return;
    c->va = (uint64_t)(uintptr_t)ptr;
    c->requested = size;
    c->mapped = size;
    c->state = CH_PASSTHROUGH;
    c->exported_fd = -1;
    c->slot = NO_SLOT;
    CUcontext ctx;
    int dev = current_device(&ctx, 0);
    c->dev = dev < 0 ? 0 : dev;
    if (vmm__reg_bind_unindexed(&S.reg, c->va, size, &c->slot) != 0) c->slot = NO_SLOT;
    publish(c, api, stream, VMM_REG_F_NOT_EXPORTABLE);
    pthread_mutex_lock(&S.lock);
    chunk *old = NULL;
    HASH_FIND(hh, S.by_va, &c->va, sizeof c->va, old);
    if (!old) {
        HASH_ADD(hh, S.by_va, va, sizeof(uint64_t), c);
        if (c->slot != NO_SLOT) HASH_ADD(hs, S.by_slot, slot, sizeof(uint32_t), c);
    }
    pthread_mutex_unlock(&S.lock);
    if (old) {
        if (c->slot != NO_SLOT) vmm__reg_unbind(&S.reg, c->slot);
        free(c);
    }
}

size_t vmm__cached_bytes_current(void)
{
    if (!S.ready) return 0;
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx || cu.CtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES)
        return 0;
    pthread_mutex_lock(&S.lock);
    size_t n = S.dev[dev].cached_bytes;
    pthread_mutex_unlock(&S.lock);
    return n;
}

int vmm__stream_capturing(CUstream stream)
{
    if (!ensure_init()) return 0;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return cu.StreamIsCapturing(stream, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

int vmm__lookup(uint64_t ptr, vmm__alloc_ref *out)
{
    if (!S.ready || !ptr) return 0;
    pthread_mutex_lock(&S.lock);
    chunk *c = find_containing_locked(ptr);
    int found = c && c->state == CH_LIVE && ptr < c->va + c->requested + (c->requested == 0);
    if (found) {
        out->base = c->va;
        out->requested = c->requested;
        out->mapped = c->mapped;
        out->dev = c->dev;
        out->slot = c->slot;
        out->generation = c->generation;
        memcpy(out->alloc_id, c->alloc_id, 16);
    }
    pthread_mutex_unlock(&S.lock);
    return found;
}

int vmm__owned(uint64_t ptr)
{
    if (!S.ready || !ptr) return 0;
    pthread_mutex_lock(&S.lock);
    chunk *c = find_containing_locked(ptr);
    int owned = c && c->state != CH_PASSTHROUGH;
    pthread_mutex_unlock(&S.lock);
    return owned;
}

struct vmm__reg *vmm__registry(void)
{
    return ensure_init() && S.registry_ok ? &S.reg : NULL;
}

/* Peer access is granted per mapping with cuMemSetAccess: enabling it in the driver does not
 * cover VMM memory.  accessor may then use owner's chunks, now and in future. */
void vmm__peer_access(int accessor, int owner, int enable)
{
    if (!ensure_init() || accessor < 0 || owner < 0 || accessor >= MAX_DEVICES || owner >= MAX_DEVICES || accessor == owner) return;
    pthread_mutex_lock(&S.lock);
    device_state *d = &S.dev[owner];
    if (enable) __atomic_or_fetch(&d->accessors, 1ull << accessor, __ATOMIC_RELEASE);
    else __atomic_and_fetch(&d->accessors, ~(1ull << accessor), __ATOMIC_RELEASE);
    CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = accessor},
                           .flags = enable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE};
    unsigned failed = 0;
    for (chunk *c = S.by_va; c; c = c->hh.next)
        if (c->dev == owner && c->state != CH_PASSTHROUGH && cu.MemSetAccess(c->va, c->mapped, &acc, 1) != CUDA_SUCCESS)
            failed++;
    pthread_mutex_unlock(&S.lock);
    if (failed) vmm__log(VMM__LOG_WARNING, "peer access %d->%d: %u mappings could not be %s", accessor, owner, failed,
                         enable ? "granted" : "revoked");
}

/* ---- the default memory pool's view (stubs until the pool lands) ---- */
int vmm__pool_usage_get(int dev, vmm__pool_usage *out)
{
    (void)dev;
    memset(out, 0, sizeof *out);
    return 0;
}
void vmm__pool_usage_reset_high(int dev, int which) { (void)dev, (void)which; }
void vmm__pool_trim(int dev, uint64_t keep) { (void)dev, (void)keep; }
void vmm__pool_set_release_threshold(int dev, uint64_t bytes) { (void)dev, (void)bytes; }
void vmm__pool_current_is_default(int dev, int is_default) { (void)dev, (void)is_default; }
