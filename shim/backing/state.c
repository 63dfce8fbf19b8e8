/* The backing's state and its start: the one state every file of the folder shares (vmm__S,
 * under its lock) and the driver's entry points (vmm__cu); the lazy one-time start (options,
 * driver, registry); what happens at exit (the coverage counters, a keeper's records) and in a
 * fork child (the parent's tables forgotten); and the devices (which one a call is on, whether it
 * can back allocations).  It is the bottom floor of internal.h: it calls no other file of the
 * backing but frames.c, so that adopt.c and preexport.c can use what it keeps (the registry, the
 * chunk ids, the kept fds) without a circle. */
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backing/internal.h"
#include "broker/broker.h"
#include "core/log.h"
#include "core/options.h"
#include "hooks/real.h"
#include "registry/keep.h"

vmm__driver vmm__cu;
__thread uint32_t vmm__thread_tag __attribute__((tls_model("initial-exec")));
vmm__state vmm__S = {.lock = PTHREAD_MUTEX_INITIALIZER};

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

vmm_reg_proc *vmm__coverage_now(void) { return __atomic_load_n(&coverage, __ATOMIC_ACQUIRE); }

void vmm__count_disabled(void) { vmm__count(&passed_disabled); }

#define STR_(x) #x
#define STR(x) STR_(x)
/* cuda.h maps API names to their current ABI names (cuMemAlloc -> cuMemAlloc_v2); stringify
 * after expansion so dlsym asks for the exact exported symbol. */
#define LOAD(field, api) (*(void **)&vmm__cu.field = vmm__real_driver(STR(api)))

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
    if (ok) LOAD(StreamWaitEvent, cuStreamWaitEvent); /* without it a free reaches another stream once reached */
    if (ok) { /* sleep.c's, not needed to back allocations */
        LOAD(MemcpyDtoH, cuMemcpyDtoH);
        LOAD(MemcpyHtoD, cuMemcpyHtoD);
        LOAD(MemHostAlloc, cuMemHostAlloc);
        LOAD(MemFreeHost, cuMemFreeHost);
        LOAD(MemHostRegister, cuMemHostRegister);
        LOAD(MemHostUnregister, cuMemHostUnregister);
        LOAD(MemcpyDtoHAsync, cuMemcpyDtoHAsync);
        LOAD(MemcpyHtoDAsync, cuMemcpyHtoDAsync);
        LOAD(MemGetInfo, cuMemGetInfo);
        LOAD(LaunchHostFunc, cuLaunchHostFunc);
    }
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
    vmm__log_report("stats: pid %d: %llu allocation%s, %llu backed and exportable (%llu unpublished), %llu passed through "
                    "(capture %llu, device full %llu, unsupported %llu, disabled %llu), %llu cuMemMap range%s adopted, peak %s",
                    (int)getpid(), (unsigned long long)(made + dis), made + dis == 1 ? "" : "s",
                    (unsigned long long)__atomic_load_n(&c->allocs_backed, __ATOMIC_RELAXED),
                    (unsigned long long)__atomic_load_n(&c->unpublished, __ATOMIC_RELAXED),
                    (unsigned long long)(cap + full + uns + dis), (unsigned long long)cap, (unsigned long long)full,
                    (unsigned long long)uns, (unsigned long long)dis, (unsigned long long)maps, maps == 1 ? "" : "s",
                    human_size(__atomic_load_n(&c->peak_requested, __ATOMIC_RELAXED), peak, sizeof peak));
}

static int exit_status; /* what exit() was given (on_exit): a keeper keeps what a failed process leaves */
static int keep_at_exit = -1; /* vmm__backing_keep_exiting's answer, once it ran: leave the records for a keeper */

/* exit() handlers run last registered first: this one, registered once the broker runs, comes
 * before the broker's own (which unlinks its socket), so that a keeper can still take what it has
 * not yet (registry/layout.h KEEP). */
void vmm__backing_keep_exiting(int status, void *arg)
{
    (void)arg;
    if (vmm__S.registry_ok) __atomic_store_n(&keep_at_exit, vmm__keep_exiting(&vmm__S.reg, status), __ATOMIC_RELEASE);
}

static void at_exit(void)
{
    pthread_mutex_lock(&vmm__S.lock);
    vmm__S.stopping = 1; /* CUDA may be torn down next: the give-back thread makes no more calls */
    pthread_mutex_unlock(&vmm__S.lock);
    /* Pure shared-memory work: CUDA may already be torn down at exit.  The counters move back
     * here first: once detached, the record may be another process's. */
    if (vmm__S.registry_ok) {
        const vmm_reg_proc *c = vmm__coverage_now();
        uint64_t *to[] = {&local_coverage.allocs, &local_coverage.allocs_backed, &local_coverage.passed_capture,
                          &local_coverage.passed_device_full, &local_coverage.passed_unsupported,
                          &local_coverage.maps_adopted, &local_coverage.peak_requested, &local_coverage.unpublished};
        const uint64_t *from[] = {&c->allocs, &c->allocs_backed, &c->passed_capture, &c->passed_device_full,
                                  &c->passed_unsupported, &c->maps_adopted, &c->peak_requested, &c->unpublished};
        for (size_t i = 0; i < sizeof to / sizeof to[0]; i++)
            __atomic_store_n(to[i], __atomic_load_n(from[i], __ATOMIC_RELAXED), __ATOMIC_RELAXED);
        __atomic_store_n(&coverage, &local_coverage, __ATOMIC_RELEASE);
        /* A process that a keeper keeps and that fails leaves its records (names, frames) as a
         * crash leaves them, for the keeper to keep (registry/layout.h KEEP). */
        int keep = __atomic_load_n(&keep_at_exit, __ATOMIC_ACQUIRE);
        if (keep < 0) keep = vmm__keep_exiting(&vmm__S.reg, exit_status);
        if (!keep) {
            vmm__reg_detach(&vmm__S.reg);
            vmm__frames_exit();
        }
    }
    if (vmm__opt_bool(VMM__OPT_STATS)) print_coverage(&local_coverage);
    if (vmm__opt_bool(VMM__OPT_VERBOSE))
        for (int i = 0; i < MAX_DEVICES; i++) {
            if (!vmm__S.dev[i].pool_ready) continue;
            VMM__FOR_POOLS(&vmm__S.dev[i], p, k)
                vmm__log(VMM__LOG_INFO, "device %d %s pool%s%s: %llu segments made, %llu given back; peak %llu MiB reserved, %llu MiB used",
                         i, k ? "stream-ordered" : "synchronous", p->tag ? " of tag " : "", p->tag ? vmm__tag_name(p->tag) : "",
                         (unsigned long long)p->segs_made,
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
        vmm__pool *tagged[VMM__MAX_TAGS];
        CUevent *events;
    } dev[MAX_DEVICES];
} inherited;

static void purge_cond_init(void)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&vmm__S.purge_wake, &ca);
    pthread_condattr_destroy(&ca);
}

static void after_fork_child(void)
{
    /* The child owns none of its parent's memory: forget it all, and start afresh if it ever
     * allocates (CUDA itself is not usable across fork unless the child re-initialises). */
    pthread_mutex_init(&vmm__S.lock, NULL);
    inherited.by_addr = vmm__S.by_addr;
    inherited.by_slot = vmm__S.by_slot;
    inherited.notes = vmm__S.notes;
    for (int i = 0; i < MAX_DEVICES; i++) {
        memcpy((void *)inherited.dev[i].pool, vmm__S.dev[i].pool, sizeof vmm__S.dev[i].pool);
        memcpy((void *)inherited.dev[i].tagged, vmm__S.dev[i].tagged, sizeof vmm__S.dev[i].tagged);
        inherited.dev[i].events = vmm__S.dev[i].events;
    }
    vmm__S.by_addr = vmm__S.by_slot = NULL; /* parent's segments leak in the child by design */
    /* Never pthread_cond_destroy: it waits for the parent's give-back thread, which waited on it
     * at the fork and does not exist here, forever. */
    memset(&vmm__S.purge_wake, 0, sizeof vmm__S.purge_wake);
    purge_cond_init();
    vmm__S.purge_state = 0; /* the parent's give-back thread is not here */
    vmm__S.notes = NULL;
    vmm__S.deferred = NULL;
    __atomic_store_n(&vmm__S.captures, 0, __ATOMIC_RELAXED); /* the parent's capturing threads are not here */
    vmm__S.unpublished_said = 0; /* a process of its own: it says so for itself */
    memset(vmm__S.dev, 0, sizeof vmm__S.dev);
    if (vmm__S.registry_ok) vmm__reg_forget_after_fork(&vmm__S.reg);
    vmm__S.broker_started = 0;
    vmm__S.broker_path[0] = 0;
    vmm__S.kept_fds = 0;
    vmm__broker_forget_after_fork();
    if (vmm__S.registry_ok && vmm__reg_attach(&vmm__S.reg, "") != 0) vmm__S.registry_ok = 0;
    if (vmm__S.registry_ok) {
        coverage = vmm__reg_self(&vmm__S.reg);
        vmm__frames_after_fork(&vmm__S.reg);
    }
}

static void at_exit_status(int status, void *arg)
{
    (void)arg;
    exit_status = status;
    at_exit();
}

/* torch_memory_saver's preload hook defines cudaMalloc and cudaFree too: with both loaded, each
 * takes the calls the loader's order gives it and frees memory the other made.  Found by its file
 * name among the loaded objects (LD_PRELOAD'ed ones are loaded before any CUDA call). */
static int find_tms_hook(struct dl_phdr_info *info, size_t size, void *found)
{
    (void)size;
    const char *slash = strrchr(info->dlpi_name, '/');
    const char *base = slash ? slash + 1 : info->dlpi_name;
    if (strncmp(base, "torch_memory_saver_hook_mode_preload", 36) != 0) return 0;
    snprintf(found, 128, "%s", base);
    return 1;
}

static void init(void)
{
    int opt_rc = vmm__opt_init();
    /* Before anything can make the shim pass calls through: those are counted too. */
    on_exit(at_exit_status, NULL); /* atexit's, with the status: a keeper learns it */
    pthread_atfork(NULL, NULL, coverage_after_fork);
    if (vmm__opt_bool(VMM__OPT_VERBOSE)) vmm__log(VMM__LOG_INFO, "backing allocations with exportable VMM memory");
    if (opt_rc != 0) {
        vmm__S.failed = 1;
        return; /* strict mode refused an option; the message is out already */
    }
    if (!vmm__opt_bool(VMM__OPT_ENABLE)) return;
    char tms[128];
    if (dl_iterate_phdr(find_tms_hook, tms)) {
        vmm__log(vmm__opt_bool(VMM__OPT_STRICT) ? VMM__LOG_ERROR : VMM__LOG_WARNING,
                 "torch_memory_saver's hook %s is loaded too, and both would back cudaMalloc; passing every call "
                 "through (`vmmshim run --torch-memory-saver` runs its API on the shim)", tms);
        vmm__S.failed = 1;
        return;
    }
    char why[200];
    if (load_driver(why, sizeof why) != 0) {
        vmm__log(vmm__opt_bool(VMM__OPT_STRICT) ? VMM__LOG_ERROR : VMM__LOG_WARNING,
                 "cannot use the CUDA driver (%s); passing every call through", why);
        vmm__S.failed = 1;
        return;
    }
    vmm__S.export_pidfd = vmm__opt_enum(VMM__OPT_EXPORT) == 1;
    vmm__S.cache_limit = vmm__opt_size(VMM__OPT_CACHE_SIZE);
    vmm__S.hold_limit = vmm__opt_size(VMM__OPT_GIVE_BACK_HOLD);
    if (vmm__S.hold_limit < vmm__S.cache_limit) vmm__S.hold_limit = vmm__S.cache_limit;
    vmm__S.give_back_ns = (uint64_t)vmm__opt_int(VMM__OPT_GIVE_BACK_MS) * 1000000u;
    purge_cond_init();
    vmm__S.isolate = vmm__opt_bool(VMM__OPT_ISOLATE);
    snprintf(vmm__S.tag, sizeof vmm__S.tag, "%s", vmm__opt_str(VMM__OPT_TAG));
    const char *name = vmm__opt_str(VMM__OPT_REGISTRY);
    int rc = vmm__reg_open(&vmm__S.reg, *name ? name : NULL, VMM__REG_CREATE, (uint64_t)vmm__opt_int(VMM__OPT_REGISTRY_CAPACITY),
                           vmm__opt_str(VMM__OPT_REGISTRY_GROUP), why, sizeof why);
    if (rc == 0 && (rc = vmm__reg_attach(&vmm__S.reg, "")) != 0) {
        snprintf(why, sizeof why, "cannot register this process: %s", strerror(-rc));
        vmm__reg_close(&vmm__S.reg);
    }
    if (rc != 0) {
        vmm__log(vmm__opt_bool(VMM__OPT_STRICT) ? VMM__LOG_ERROR : VMM__LOG_WARNING, "%s; passing every call through", why);
        vmm__S.failed = 1;
        return;
    }
    vmm__S.registry_ok = 1;
    __atomic_store_n(&coverage, vmm__reg_self(&vmm__S.reg), __ATOMIC_RELEASE);
    vmm__frames_init((int)vmm__opt_int(VMM__OPT_FRAMES), &vmm__S.reg);
    pthread_atfork(NULL, NULL, after_fork_child);
    vmm__S.ready = 1;
}

int vmm__ensure_init(void)
{
    pthread_once(&init_once, init);
    return vmm__S.ready;
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
    if (vmm__cu.MemCreate(&h, vmm__S.dev[dev].granularity, &p, 0) != CUDA_SUCCESS) return 0;
    CUmemFabricHandle fh;
    int ok = vmm__cu.MemExportToShareableHandle(&fh, h, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_SUCCESS &&
             vmm__cu.MemImportFromShareableHandle(&h2, &fh, CU_MEM_HANDLE_TYPE_FABRIC) == CUDA_SUCCESS;
    if (ok) vmm__cu.MemRelease(h2);
    vmm__cu.MemRelease(h);
    return ok;
}

/* The device an allocation lands on: the current context's.  Runtime calls on a thread with no
 * context bind the primary context of the runtime's current device, as cudaMalloc does; driver
 * calls (bind_primary 0) leave that case to the real driver, which reports it. */
int vmm__current_device(CUcontext *ctx_out, int bind_primary)
{
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (vmm__cu.CtxGetCurrent(&ctx) == CUDA_ERROR_NOT_INITIALIZED) {
        if (!bind_primary || vmm__cu.Init(0) != CUDA_SUCCESS) return -1;
        vmm__cu.CtxGetCurrent(&ctx);
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
        ctx = __atomic_load_n(&vmm__S.dev[d].primary, __ATOMIC_ACQUIRE);
        if (!ctx) {
            CUcontext fresh = NULL, none = NULL;
            if (vmm__cu.DevicePrimaryCtxRetain(&fresh, d) != CUDA_SUCCESS) return -1;
            /* threads binding at once each retain it: one harmless extra reference to the same context */
            ctx = __atomic_compare_exchange_n(&vmm__S.dev[d].primary, &none, fresh, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) ? fresh
                                                                                                                   : none;
        }
        if (vmm__cu.CtxSetCurrent(ctx) != CUDA_SUCCESS) return -1;
    }
    if (vmm__cu.CtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES) return -1;
    *ctx_out = ctx;
    return dev;
}

int vmm__device_usable(int dev)
{
    device_state *d = &vmm__S.dev[dev];
    if (__atomic_load_n(&d->checked, __ATOMIC_ACQUIRE)) return d->usable;
    pthread_mutex_lock(&vmm__S.lock);
    if (!d->checked) {
        d->index = dev;
        int vmm = 0, posix = 0;
        vmm__cu.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
        vmm__cu.DeviceGetAttribute(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
        CUmemAllocationProp p = {0};
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = dev;
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        if (vmm && posix &&
            vmm__cu.MemGetAllocationGranularity(&d->granularity, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS &&
            d->granularity) {
            d->usable = 1;
            int count = 0, can = 0;
            if (vmm__cu.DeviceGetCount(&count) != CUDA_SUCCESS) count = 0;
            for (int i = 0; i < count && i < MAX_DEVICES; i++)
                if (i != dev && vmm__cu.DeviceCanAccessPeer(&can, i, dev) == CUDA_SUCCESS && can) d->peers |= 1ull << i;
            CUuuid u;
            if (vmm__cu.DeviceGetUuid(&u, dev) == CUDA_SUCCESS) memcpy(d->uuid, u.bytes, 16);
            int fabric_attr = 0;
            vmm__cu.DeviceGetAttribute(&fabric_attr, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev);
            d->fabric = vmm__opt_enum(VMM__OPT_FABRIC) == 0 && fabric_attr && fabric_self_test(dev);
            vmm__log(VMM__LOG_INFO, "device %d: VMM with POSIX fd export, granularity %zu, fabric %s", dev,
                     d->granularity, d->fabric ? "on" : "off");
        } else {
            vmm__log(vmm__opt_bool(VMM__OPT_STRICT) ? VMM__LOG_ERROR : VMM__LOG_WARNING,
                     "device %d lacks VMM or POSIX fd export; its allocations pass through", dev);
        }
        __atomic_store_n(&d->checked, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&vmm__S.lock);
    return d->usable;
}

/* ---- what adopt.c and preexport.c share with the rest ---- */

struct vmm__reg *vmm__registry(void)
{
    return vmm__ensure_init() && vmm__S.registry_ok ? &vmm__S.reg : NULL;
}

int vmm__device_exportable(int dev)
{
    return vmm__ensure_init() && dev >= 0 && dev < MAX_DEVICES && vmm__device_usable(dev);
}

uint64_t vmm__new_chunk_id(void) { return __atomic_add_fetch(&vmm__S.next_chunk_id, 1, __ATOMIC_RELAXED); }

void vmm__count_adopted(void) { vmm__count(&vmm__coverage_now()->maps_adopted); }

/* Adopted handles whose exported fd adopt.c keeps: its own count, which a fork child keeps as
 * adopt.c keeps those fds (a segment's go with its tables). */
static unsigned long kept_adopted;

void vmm__backing_kept_adopted(int delta)
{
    if (delta > 0) __atomic_add_fetch(&kept_adopted, 1, __ATOMIC_RELAXED);
    else __atomic_sub_fetch(&kept_adopted, 1, __ATOMIC_RELAXED);
}

unsigned long vmm__backing_kept_fds(void)
{
    return __atomic_load_n(&vmm__S.kept_fds, __ATOMIC_RELAXED) + __atomic_load_n(&kept_adopted, __ATOMIC_RELAXED);
}

int vmm__when_reached(void *stream, void (*fn)(void *), void *arg)
{
    if (!vmm__S.ready) return -ENOSYS;
    if (vmm__cu.LaunchHostFunc) return vmm__cu.LaunchHostFunc((CUstream)stream, fn, arg) == CUDA_SUCCESS ? 0 : -EIO;
    if (vmm__cu.StreamSynchronize((CUstream)stream) != CUDA_SUCCESS) return -EIO;
    fn(arg);
    return 0;
}
