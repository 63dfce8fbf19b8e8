/* What the files of shim/backing share and nothing outside the folder sees: the state under one
 * lock (vmm__S), the driver's entry points (vmm__cu), and the functions one file makes for
 * another.  The files stand on floors, and each calls only the floors below its own
 * (tests/scripts/circles.py checks): state.c at the bottom, guard.c beside it; segment.c; giveback.c and export.c;
 * records.c; sleep_copy.c (a pause's copies); sleep.c (pause and resume); then the entry points, backing.c and mempool.c.  adopt.c and preexport.c use
 * backing.h only, and nothing here calls them: adopt.c hands its export to export.c, and
 * preexport.c forgets its queue in a fork child by itself (as sleep_copy.c its kept buffers).  adopt_sleep.c
 * stands above adopt.c and sleep.c and hands sleep.c its pause and resume (vmm__sleep_adopted_by). */
#ifndef VMM_BACKING_INTERNAL_H
#define VMM_BACKING_INTERNAL_H
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <uthash.h>

#include "backing/backing.h"
#include "backing/frames.h"
#include "pool/pool.h"
#include "registry/registry.h"

#define MAX_DEVICES 64
#define NO_SLOT UINT32_MAX
/* Distinct thread tags a process may name (vmm_set_thread_tag); each has pools of its own. */
#define VMM__MAX_TAGS 32

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
    /* Paused (sleep.c): the handle is released and nothing is mapped at the segment's place; its
     * reservation stays, and resume maps a fresh handle there under a new id. */
    int paused;
    int guarded; /* paused, and the device's scratch chunk mapped at its place (guard.c) */
    uint64_t id;
    uint8_t fabric[64];
} vseg;

/* An allocation the real allocator made, which the shim only notes in the registry. */
typedef struct note {
    uint64_t va, size;
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
    /* The same pair for each thread tag, made at the tag's first allocation on this device: a
     * tag's allocations never share a segment with another's, so pausing a tag releases whole
     * segments (tags.c). */
    vmm__pool *tagged[VMM__MAX_TAGS];
    int pool_ready;
    int custom_pool;            /* the program made another pool current: stream-ordered calls pass */
    uint64_t release_threshold; /* the default pool's, as the program set it */
    unsigned reuse_off;         /* the default pool's reuse policies the program turned off (VMM_POOL_REUSE_*) */
    CUevent *events;            /* pool of timing-free events */
    size_t n_events, cap_events;
    /* VMMSHIM_PAUSE_GUARD (guard.c): the chunk paused segments are mapped onto, and its own view */
    CUmemGenericAllocationHandle scratch;
    CUdeviceptr scratch_va;
} device_state;

/* Driver entry points, resolved once (state.c). */
typedef struct vmm__driver {
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
    CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned); /* optional: cross-stream reuse (pool.h) */
    /* sleep.c's copies; optional (NULL: a pause with keep is refused) */
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned);
    CUresult (*MemFreeHost)(void *);
    CUresult (*MemHostRegister)(void *, size_t, unsigned);
    CUresult (*MemHostUnregister)(void *);
    /* queued copies to and from pinned memory, waited for once (sleep_copy.c); optional too */
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*MemGetInfo)(size_t *, size_t *); /* optional: the allocation margin (vmm_set_alloc_margin) */
    CUresult (*LaunchHostFunc)(CUstream, CUhostFn, void *); /* optional: vmm_update_end without a wait */
} vmm__driver;

typedef struct vmm__state {
    pthread_mutex_t lock; /* every table and pool below */
    int ready;  /* 1: backing active; 0: pass every call through */
    int failed; /* the start failed (strict mode refuses instead of passing through) */
    int export_pidfd;
    int isolate;
    vmm__reg reg;
    int registry_ok;
    char broker_path[112];
    int broker_started;
    unsigned long kept_fds;        /* segments' broker_fd kept open (vmm__backing_kept_fds counts them) */
    vmm__block *by_addr, *by_slot; /* live allocations */
    vmm__block *deferred;          /* freed while a stream captured, not yet synchronized (via fnext) */
    note *notes;                   /* by address */
    uint64_t next_chunk_id;
    uint64_t cache_limit;          /* bytes of empty synchronous memory kept past the give-back delay */
    uint64_t hold_limit;           /* bytes of it that may wait out the delay (at least cache_limit) */
    uint64_t give_back_ns;
    uint64_t alloc_margin;         /* vmm_set_alloc_margin: a new segment must leave this much free (atomic) */
    pthread_cond_t purge_wake;     /* the give-back thread waits on it (CLOCK_MONOTONIC) */
    int purge_state;               /* 0 not started, 1 waiting for work, 2 waiting for a deadline, -1 could not start */
    int stopping;                  /* at exit: no more driver calls from the give-back thread */
    uint64_t free_seq;             /* stream-ordered frees so far: orders them against synchronizations */
    char tag[32];                  /* the process's (VMMSHIM_TAG) */
    char tags[VMM__MAX_TAGS][32];  /* thread tags named so far (tags.c), never renamed: index + 1 is a tag's number */
    unsigned n_tags;
    int captures;                  /* streams being captured right now, process-wide (vmm__capture_begun) */
    int unpublished_said;          /* the line about an allocation the registry had no room for is out (records.c) */
    device_state dev[MAX_DEVICES];
} vmm__state;

extern vmm__driver vmm__cu;
extern vmm__state vmm__S;

/* ---- state.c: start, exit, fork, the coverage counters, devices ---- */
/* The one-time start (options, driver, registry): 1 when the shim backs allocations. */
int vmm__ensure_init(void);
/* The coverage counters now (in the registry record once attached, else the process's own). */
vmm_reg_proc *vmm__coverage_now(void);
static inline void vmm__count(uint64_t *counter) { __atomic_add_fetch(counter, 1, __ATOMIC_RELAXED); }
/* An allocation passed through because the shim is not active (it has no field in the record). */
void vmm__count_disabled(void);
/* The on_exit handler export.c registers once the broker runs (state.c says why then). */
void vmm__backing_keep_exiting(int status, void *arg);
/* The current context's device (binding the primary context when bind_primary and the thread
 * has none), or -1; whether dev can back allocations (checked once). */
int vmm__current_device(CUcontext *ctx_out, int bind_primary);
int vmm__device_usable(int dev);

/* ---- segment.c: the segments, arenas and events the pool asks for (under vmm__S.lock) ---- */
uint64_t vmm__now_ns(void *ctx);
int vmm__event_done(void *ctx, void *e);
CUevent vmm__event_get_locked(device_state *d);
/* The bytes of empty memory pool k of d keeps past the give-back delay. */
uint64_t vmm__retain_of(const device_state *d, int k);
void vmm__pools_ready_locked(device_state *d);
/* Make pair ([0] synchronous, [1] stream-ordered) the pools of tag number `tag` on d. */
void vmm__pair_init_locked(device_state *d, vmm__pool *pair, uint32_t tag);
device_state *vmm__dev_of_block(const vmm__block *b);
/* The segments under block b, in address order: the first, their number and their bytes. */
vmm__seg *vmm__span_of(const vmm__block *b, uint32_t *n, uint64_t *bytes);
/* The access a segment of pool synchronous_pool ? 0 : 1 of d is mapped with: the descriptors' count. */
int vmm__access_list(device_state *d, CUmemAccessDesc *acc, int synchronous_pool);
/* VMMSHIM_PAUSE_GUARD (guard.c): whether it is on; d's scratch chunk mapped over a paused
 * segment's place (0, or -1 with nothing mapped), unmapped again; and the bytes written into the
 * scratch since the last check (*first: the offset of the first), zeroed again. */
int vmm__guard_on(void);
int vmm__guard_map(device_state *d, CUdeviceptr base, uint64_t size, const CUmemAccessDesc *acc, size_t n_acc);
void vmm__guard_unmap(device_state *d, CUdeviceptr base, uint64_t size);
uint64_t vmm__guard_check(device_state *d, uint64_t *first);
/* Export a fresh segment's handle as the options say (pidfd's fd, fabric). */
void vmm__export_seg(vseg *c);

/* ---- tags.c: thread tags and their pools ---- */
/* The calling thread's tag number: 0 none (the process's tag), else vmm__S.tags[n - 1]. */
extern __thread uint32_t vmm__thread_tag __attribute__((tls_model("initial-exec")));
/* The number of tag `name` (0 for NULL or ""), named on first use: 0, -1 too long, -2 no room. */
int vmm__tag_number(const char *name, uint32_t *t);
/* The number of tag `name` if a thread named it, else 0. */
uint32_t vmm__tag_find(const char *name);
/* A device's tagged pools go (its reset). */
void vmm__tags_destroy_locked(device_state *d);
/* The pool pair of tag number t on d (0: d->pool), made on first use when make; NULL if not made
 * (or no memory for it). */
vmm__pool *vmm__pools_of_locked(device_state *d, uint32_t t, int make);
/* The name of tag number t (0: the process's tag). */
static inline const char *vmm__tag_name(uint32_t t) { return t ? vmm__S.tags[t - 1] : vmm__S.tag; }
/* Which of its pair p is: 0 synchronous (cudaMalloc's), 1 stream-ordered. */
static inline int vmm__pool_kind(const device_state *d, const vmm__pool *p)
{
    return (int)(p - (p->tag ? d->tagged[p->tag - 1] : d->pool));
}
/* Every pool pair of device d made so far, the untagged one first (pp points at [0] and [1]). */
#define VMM__FOR_PAIRS(d, pp)                                                                              \
    for (uint32_t t_ = 0; t_ <= VMM__MAX_TAGS; t_++)                                                       \
        for (vmm__pool *pp = t_ ? (d)->tagged[t_ - 1] : (d)->pool; pp; pp = NULL)
/* Every pool of device d: p, and k its kind (0 synchronous, 1 stream-ordered). */
#define VMM__FOR_POOLS(d, p, k) VMM__FOR_PAIRS(d, pp_##p) for (int k = 0; k < 2; k++) for (vmm__pool *p = &pp_##p[k]; p; p = NULL)

/* ---- giveback.c: giving memory back after the idle delay and at synchronizations ---- */
/* A free emptied a segment of p. */
void vmm__emptied_locked(vmm__pool *p, int stream_ordered);
/* A segment became empty, or a budget shrank: the give-back thread has a deadline to keep. */
void vmm__purge_kick_locked(void);
/* vmm_give_back: what cudaMalloc freed and the give-back delay still holds goes back now (beyond
 * each pool's VMMSHIM_CACHE_SIZE budget); the bytes given back. */
uint64_t vmm__give_back_now(void);
/* vmm_set_alloc_margin (segment.c checks it when the pools grow); whether the calling thread's
 * last new segment was refused for it. */
void vmm__set_alloc_margin(uint64_t bytes);
int vmm__margin_refused(void);

/* ---- export.c: the broker and its export callback ---- */
/* Start the broker once (one atomic load after that). */
void vmm__start_broker(void);

/* ---- records.c: one registry record per allocation ---- */
/* streams.c: the key the pools know a stream by (the per-thread default stream: one per thread), and
 * the highest free number `waiter` waited past on `source` through the program's own events (the
 * pools' ops.followed; 0: none known). */
uint64_t vmm__stream_key(CUstream s);
uint64_t vmm__followed(void *ctx, uint64_t waiter, uint64_t source);
void vmm__follow_set(int on);
/* records.c: the arena of one of the shim's pools holding p (allocated, free or not mapped), and the
 * live allocation whose [addr, addr + requested) holds p (paused ones too); NULL when none. */
vmm__arena *vmm__arena_containing_locked(uint64_t p);
vmm__block *vmm__block_containing_locked(uint64_t p);
void vmm__publish_locked(vmm__block *b, CUstream stream, const vmm__frames *f);
void vmm__retract_locked(vmm__block *b);
#endif
