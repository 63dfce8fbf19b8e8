/* The shim's logic: VMM-backed allocations from the pool, publishing.  Called by the
 * forwarding-only hooks in shim/hooks; it knows nothing of which API route a call came from
 * beyond the `api` tag it records. */
#ifndef VMM_BACKING_H
#define VMM_BACKING_H
#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

/* A driver call that undoes (gives memory back, pops a context pushed), made once more if it
 * fails: nothing else would ever undo it, and a failure may be passing.  The second result stands. */
#define VMM__TWICE(call) ((call) == CUDA_SUCCESS ? CUDA_SUCCESS : (call))

/* What the shim made of a call.  For an allocation, every answer but DONE, REFUSED and MARGIN
 * sends it to the real function, and says why (the coverage counters, layout.h). */
typedef enum {
    VMM__DONE = 0,        /* handled by the shim: *ptr set */
    VMM__PASS = 1,        /* not the shim's: call the real function (an allocation of no bytes, or none) */
    VMM__NOMEM = 2,       /* out of memory even after giving back empty segments: the real allocator decides,
                             and the result is noted */
    VMM__INVALID = 3,     /* the shim's memory, but a double free or interior pointer */
    VMM__REFUSED = 4,     /* VMMSHIM_STRICT=1 and the shim could not start */
    VMM__UNSUPPORTED = 5, /* the device lacks VMM or export, or the driver refused the shim's VMM calls */
    VMM__OWN_POOL = 6,    /* the program's own pool is current: its memory, noted */
    VMM__CAPTURED = 7,    /* (the hooks' answer) the stream is being captured: the real pool's memory, noted */
    VMM__DISABLED = 8,    /* the shim is not active in this process (VMMSHIM_ENABLE=0, a failed start) */
    VMM__MARGIN = 9       /* it would leave less than vmm_set_alloc_margin free: out of memory, not passed on */
} vmm__result;

/* Allocate `size` bytes on the current context's device (binding the device's primary context
 * when the thread has none, as the runtime does).  stream_ordered: free-reuse follows `stream`. */
vmm__result vmm__alloc(size_t size, uint32_t api, int stream_ordered, CUstream stream, void **ptr);
/* Free a pointer; async frees complete in `stream` order. */
vmm__result vmm__free(void *ptr, int stream_ordered, CUstream stream);
/* The real function made the allocation that vmm__alloc (or the capture check) answered `why`:
 * count it by reason, and publish it flagged not exportable when the shim notes such memory
 * (NOMEM, OWN_POOL, CAPTURED). */
void vmm__note_passthrough(vmm__result why, void *ptr, size_t size, uint32_t api, CUstream stream);
/* Bytes of empty segments of the current device, which a request would get (cudaMemGetInfo counts them free). */
size_t vmm__pool_free_bytes_current(void);
/* A live shim allocation as the rest of the shim sees it. */
typedef struct vmm__alloc_ref {
    uint64_t base, requested, mapped; /* mapped: the bytes of the segments it spans */
    uint64_t chunk_offset;            /* base - its first segment's base */
    int dev;
    uint32_t slot;
    uint64_t generation;
    uint8_t alloc_id[16];
} vmm__alloc_ref;
/* The live shim allocation containing ptr (any interior address): 1 and *out filled, else 0. */
int vmm__lookup(uint64_t ptr, vmm__alloc_ref *out);
/* Inside any arena the shim holds, allocated or free (or past an allocation's requested end). */
int vmm__owned(uint64_t ptr);
/* fn(arg) on a driver thread once `stream` (of the current context) reaches this point, or at once
 * after a wait for it when the driver has no host functions.  0, -ENOSYS (the shim is not active)
 * or -EIO.  fn must make no CUDA call. */
int vmm__when_reached(void *stream, void (*fn)(void *), void *arg);
/* The registry the shim publishes in, with this process attached; NULL when the shim is not active. */
struct vmm__reg *vmm__registry(void);
/* Exported fds the broker keeps (above 1023), of segments and of adopted handles: what exporting
 * ahead of requests (preexport.c) is bounded by. */
unsigned long vmm__backing_kept_fds(void);
/* Device `accessor` gains (or loses) access to device `owner`'s shim memory, existing and future;
 * all or nothing: a driver failure leaves the access as it was and is returned.  *changed (when
 * not NULL): whether the access was not already so. */
CUresult vmm__peer_access(int accessor, int owner, int enable, int *changed);
/* ---- for adopt.c: ranges the program maps itself ---- */
/* The shim started, and dev's memory can be exported as a POSIX fd (VMM and export supported). */
int vmm__device_exportable(int dev);
/* An id for a chunk, unique in this process and never reused (the pool's chunks use the same). */
uint64_t vmm__new_chunk_id(void);
/* adopt.c kept an exported fd of a handle (delta 1) or closed it (-1): vmm__backing_kept_fds counts it. */
void vmm__backing_kept_adopted(int delta);
/* The broker's export of a range the program mapped (adopt.c's): 0 and a fresh fd of the handle
 * mapped at registry slot `slot`, else -ENOENT or -ESTALE. */
typedef int (*vmm__adopted_export_fn)(uint64_t slot, uint64_t generation, const uint8_t id[16], int *fd,
                                      uint64_t *mapped, uint32_t *device);
/* adopt.c hands its export in before it publishes its first range; the broker's requests for a
 * slot that is no allocation of the pool's go to it. */
void vmm__export_adopted_by(vmm__adopted_export_fn fn);
struct vmm__frames;
typedef struct vmm__published {
    uint32_t slot; /* UINT32_MAX: not published (no registry, or it is full) */
    uint64_t generation;
    uint8_t alloc_id[16];
} vmm__published;
/* Publish [address, address+extent), which maps `handle_size` bytes of a handle from
 * `handle_offset` on: one record, found by any interior address, imported through the broker;
 * f: the mapping's call site (frames.h). */
void vmm__publish_range(uint64_t address, uint64_t extent, uint64_t handle_size, uint64_t handle_offset,
                        uint64_t chunk_id, int dev, int exportable, const struct vmm__frames *f, vmm__published *out);
void vmm__retract_range(vmm__published *pub);
/* A published range's memory was released by vmm_pause (paused 1: flagged paused, offering no
 * handle) or mapped again (0: live under chunk_id, exportable through the broker or not). */
void vmm__range_set_paused(const vmm__published *pub, int paused, uint64_t chunk_id, int exportable);
/* dev's primary context is about to be reset (cudaDeviceReset, cuDevicePrimaryCtxReset): its
 * allocations and empty segments go, as native reset frees them.  dev -1: the calling thread's
 * current device (nothing when no context is current). */
void vmm__device_reset(int dev);
/* A stream of this process began or ended capturing (the driver hooks count them): while any
 * does, a free never synchronizes a context, and its block waits for a safe moment. */
void vmm__capture_begun(void);
void vmm__capture_ended(void);
/* What a synchronization may have to do: empty segments of the default pool waiting for one
 * (sync_due), stream-ordered frees whose event is not recorded yet (unrecorded_due).  Written by
 * giveback.c, backing.c and mempool.c; the synchronize hooks read them before anything else, so
 * that with both 0 (the common case: nothing waiting) a synchronization costs the shim these two
 * loads and nothing more (no call, no thread-local guard, no lock, no driver call). */
typedef struct vmm__sync_flags {
    int sync_due, unrecorded_due;
} vmm__sync_flags;
extern __attribute__((visibility("hidden"))) vmm__sync_flags vmm__sync;
static inline int vmm__sync_watching(void)
{
    return __atomic_load_n(&vmm__sync.sync_due, __ATOMIC_ACQUIRE) | __atomic_load_n(&vmm__sync.unrecorded_due, __ATOMIC_ACQUIRE);
}
/* Taken before a synchronization begins: the stream-ordered frees it covers are those below it. */
uint64_t vmm__free_mark(void);
/* The program synchronized `stream`, or its current context (whole_context), successfully; mark
 * from vmm__free_mark() before the call. */
void vmm__synchronized(int whole_context, CUstream stream, uint64_t mark);
/* The program's event dependencies between streams (streams.c), reported by the driver hooks while
 * vmm__following(): some default pool refuses internal dependencies and follows events, so a free on
 * one stream serves another once that one waited for an event recorded after the free.  mark: from
 * vmm__free_mark() before the real record.  Not for a stream being captured. */
extern __attribute__((visibility("hidden"))) int vmm__follow_on;
static inline int vmm__following(void) { return __atomic_load_n(&vmm__follow_on, __ATOMIC_RELAXED); }
void vmm__follow_recorded(CUevent e, CUstream s, uint64_t mark);
void vmm__follow_waited(CUstream s, CUevent e);
void vmm__follow_forget(CUevent e);
/* `stream` is about to be destroyed: the frees on it still without an event get one now. */
void vmm__stream_destroying(CUstream stream);
/* The device is full for the program's own cuMemCreate: when a keeper keeps this process, ask it
 * to let go of what the process gave back (registry/layout.h KEEP) and return 1 (try again once);
 * 0 when nobody keeps it. */
int vmm__keep_let_go(void);
/* The calling thread's tag (vmm_set_thread_tag): what it allocates carries the tag, in pools of the
 * tag's own.  Returns the previous one (NULL: none); *rc 0, or -1 too long / -2 too many tags
 * (said once in a line), the thread's tag unchanged. */
const char *vmm__thread_tag_set(const char *name, int *rc);
const char *vmm__thread_tag_get(void);
/* The calling thread's tag number (0: none), and whether vmm_pause(tag) selects memory of tag
 * number t (NULL: all of it; the process's tag, VMMSHIM_TAG: the untagged, as sleep.c's pools). */
uint32_t vmm__tag_current(void);
int vmm__tag_selects(const char *tag, uint32_t t);
/* The program mapped a range of a handle the shim made exportable (maps_adopted, layout.h). */
void vmm__count_adopted(void);
/* True when stream is being captured into a graph. */
int vmm__stream_capturing(CUstream stream);
#endif
