/* The pool's policy: where in its address space a request goes (size classes, good fit, split,
 * coalesce), when physical memory is mapped under that space and when it is given back, and when
 * a freed block may be reused by which stream.
 *
 * A pool owns arenas: large address reservations made once, in which physical handles
 * ("segments", each one exportable VMM handle) are mapped where allocations need them.  Free space
 * is one address-ordered list per arena, so it merges across segment boundaries, and an
 * allocation may span several segments.  A segment no live block touches is "empty"; empty
 * segments are given back by vmm__pool_release (after an idle delay, beyond a byte budget, on trim,
 * or when the device is full), and their address space stays free for later growth.
 *
 * The mechanism (reserving, making and releasing segments, asking whether a stream reached an
 * event) comes in through vmm__pool_ops, so nothing here knows CUDA, and nothing here blocks.
 * Not thread-safe: the caller holds one lock over the pool. */
#ifndef VMM_POOL_H
#define VMM_POOL_H
#include <stdint.h>
#include <uthash.h>

/* Every block starts on, and is a multiple of, this many bytes: what native cudaMalloc gives
 * (measured on an H100; this folder's README.md). */
#define VMM_POOL_ALIGN 512u
/* Requests up to this size live in the small arenas, packed; larger ones in the large arenas, so
 * a long-lived small block never pins a segment a large one freed. */
#define VMM_POOL_SMALL_MAX (1u << 20)
/* A large arena grows by at least this much when the free space it maps is too small, so a run of
 * medium requests makes one segment, not one each (PyTorch's large segments are 20 MiB too). */
#define VMM_POOL_MIN_GROWTH (20u << 20)

/* A stream-ordered pool that never gives back by itself (its release threshold at least the
 * device's memory) maps no segment larger than this, so free space inside the extent of large
 * blocks goes back in pieces once no live block touches a piece.  Measured on a mixed trace
 * that never trims (test_pool, test_mixed_keep_all; live peak 1,767 MiB): physical peak 2,140 MiB
 * with no limit, 2,002 at 64 MiB, 1,900 at 32 MiB, 1,858 at 20 MiB with 1.6 times the segments of
 * 32 MiB.  Every segment is one more handle for a companion to import; 32 MiB is the balance. */
#define VMM_POOL_SEG_MAX (32u << 20)

typedef struct vmm__arena vmm__arena;
typedef struct vmm__ev vmm__ev;

typedef struct vmm__block {
    uint64_t addr, size;                 /* size: the block's extent */
    vmm__arena *arena;
    struct vmm__block *prev, *next;      /* neighbours in the arena, by address */
    struct vmm__block *fprev, *fnext;    /* free list of its size class, while free */
    int free, cls;
    int backed;                          /* free: 1 all of it mapped, 0 none of it (never mixed) */
    uint64_t stream;                     /* free: the stream that freed it */
    vmm__ev *event;                      /* free: recorded on `stream` at the free; NULL once reached */
    uint64_t charged;                    /* allocated: bytes counted as used (the request, 512-rounded) */
    /* the rest belongs to the caller (shim/backing): the allocation living in the block */
    uint64_t requested, generation;
    uint32_t slot, api;
    int live;
    int retired;                         /* a moved segment's old place, still mapped until its event is reached */
    void *ctx;                           /* the context it was made in: cudaFree syncs that */
    void *kept;                          /* paused: where its contents are; awake: NULL or the pinned buffer
                                            kept for its next pause (shim/backing/sleep_copy.c) */
    uint8_t alloc_id[16];
    UT_hash_handle hh, hs;               /* caller's tables: by address, by registry slot */
} vmm__block;

typedef struct vmm__seg {
    uint64_t base, size;
    void *mech;                          /* the mechanism's handle for it */
    vmm__arena *arena;
    uint32_t n_live;                     /* allocated blocks touching it */
    uint64_t empty_since;                /* ops.now_ns() when n_live fell to 0 */
    struct vmm__seg *eprev, *enext;      /* the pool's empty segments, oldest first */
    struct vmm__seg *sprev, *snext;      /* every segment of the pool */
} vmm__seg;

struct vmm__arena {
    struct vmm__pool *pool;
    int small;
    /* paused (shim/backing/sleep.c): its free blocks are in no bin, so nothing is placed here.
     * Beside `pool`, so a free's check of it reads the 16 bytes it reads already. */
    int paused;
    uint64_t base, size;
    vmm__seg **seg;                      /* per granule page: the segment mapped there, or NULL */
    vmm__block **blk;                    /* per granule page: the block holding the page's first byte */
    vmm__block *first;
    uint32_t n_segs;                     /* none left: the arena's address space goes back too */
    uint32_t n_retired;                  /* ... once no moved segment's old place is mapped either */
    vmm__arena *next;
};

typedef struct vmm__pool_ops {
    void *ctx;
    /* Reserve `size` bytes of address space (granule-aligned): 0 and *base, or -errno. */
    int (*reserve)(void *ctx, uint64_t size, uint64_t *base);
    void (*unreserve)(void *ctx, uint64_t base, uint64_t size);
    /* Map a new segment of s->size bytes at s->base: 0 with s->mech set; -ENOMEM when the device
     * is full; any other negative value for other failures. */
    int (*seg_create)(void *ctx, vmm__seg *s);
    void (*seg_destroy)(void *ctx, vmm__seg *s);
    int (*event_done)(void *ctx, void *event); /* 1 once the stream reached it; never blocks */
    /* Record an event now on `stream` (of stream_ctx) for a free made earlier without one: 1 with
     * *event set, 0 when it cannot be now (the stream is being captured), -1 when the stream is
     * gone.  Never blocks. */
    int (*event_record)(void *ctx, uint64_t stream, void *stream_ctx, void **event);
    void (*event_release)(void *ctx, void *event);
    uint64_t (*now_ns)(void *ctx);
    /* Optional (NULL: segments never move).  Map the handle of empty segment `from` at `base` as
     * well, with the same access: 0, or a negative errno with nothing changed.  Its old mapping
     * stays until unmap_old, once the frees that last touched it are reached. */
    int (*seg_move)(void *ctx, vmm__seg *from, uint64_t base);
    void (*unmap_old)(void *ctx, uint64_t base, uint64_t size);
    /* Optional (NULL: a free reaches another stream only once its event is reached).  Make
     * `stream` wait for recorded event (cuStreamWaitEvent): 0, or nonzero with nothing changed. */
    int (*stream_wait)(void *ctx, uint64_t stream, void *event);
    /* Optional (NULL: no dependency is followed).  The highest free number (vmm__pool_free_unrecorded's
     * seq) that `waiter` waited past on `source` through the program's own events: frees below it
     * on source are behind waiter's work.  0: none. */
    uint64_t (*followed)(void *ctx, uint64_t waiter, uint64_t source);
} vmm__pool_ops;

/* How a stream-ordered pool lets a free reach another stream, as the native pool's reuse
 * attributes say (cudaMemPoolReuse*; all on by default, and for this pool's `reuse`):
 * OPPORTUNISTIC  a free whose event the stream reached already serves any stream;
 * INTERNAL       a free not reached yet serves another stream, which is made to wait for it
 *                (ops.stream_wait), when no free block is usable without a wait, before growing.
 * FOLLOW         a free not reached yet serves another stream that waited for an event recorded
 *                on the free's stream after it (ops.followed), with no wait added.
 * With none, a free serves another stream once a synchronization covered it.  A free the pool
 * has seen reached (a synchronization, the give-back's polling) no longer says which stream freed
 * it and serves any stream, OPPORTUNISTIC or not. */
#define VMM_POOL_REUSE_OPPORTUNISTIC 1u
#define VMM_POOL_REUSE_INTERNAL 2u
#define VMM_POOL_REUSE_FOLLOW 4u
#define VMM_POOL_REUSE_ALL (VMM_POOL_REUSE_OPPORTUNISTIC | VMM_POOL_REUSE_INTERNAL | VMM_POOL_REUSE_FOLLOW)

#define VMM_POOL_CLASSES 320

typedef struct vmm__pool_bins {
    vmm__block *head[VMM_POOL_CLASSES];
    uint64_t map[(VMM_POOL_CLASSES + 63) / 64];
} vmm__pool_bins;

typedef struct vmm__pool {
    vmm__pool_ops ops;
    uint64_t granule, arena_size;
    uint64_t retain;                     /* bytes of empty segments kept when memory is given back */
    uint64_t seg_max;                    /* no segment larger (0: no limit); see VMM_POOL_SEG_MAX */
    int isolate;                         /* every allocation its own segments, never shared */
    int exact;                           /* large requests grow by exactly their size, and an empty segment is
                                            never split for a much smaller one: what a free empties goes back
                                            whole, as native cudaFree's memory does (cudaMalloc's pool) */
    vmm__pool_bins bins[2][2];           /* [small arena][backed] */
    vmm__arena *arenas;
    vmm__seg *segs, *empty_head, *empty_tail;
    vmm__block *spare;
    vmm__block *retired;                 /* old places of moved segments (via fnext), oldest first */
    vmm__ev *spare_ev;
    vmm__arena *parked;                  /* the last arena dropped, whole and empty, kept for the next until a
                                            give-back reaches it (parked_since: ops.now_ns) */
    uint64_t parked_since;
    uint64_t reserved, reserved_high, used, used_high, empty_bytes;
    uint64_t footprint_high;             /* reserved_high, but never reset by the program */
    uint64_t n_segs, segs_made, segs_released, segs_moved;
    uint64_t n_unrecorded;               /* events of frees not recorded yet */
    uint64_t n_tracked;                  /* events of frees made without one (free_unrecorded), recorded since or
                                            not, still held: a synchronization may settle them */
    uint32_t tag;                        /* the caller's own (shim/backing: which tag's pools these are) */
    unsigned reuse;                      /* VMM_POOL_REUSE_*: both after vmm__pool_init */
    int waiting;                         /* inside the allocation's pass that may make a stream wait */
    uint64_t cross_waits;                /* frees handed to another stream with a wait (statistics) */
} vmm__pool;

/* arena_size: address space reserved at a time (more arenas are added when one is full). */
void vmm__pool_init(vmm__pool *p, const vmm__pool_ops *ops, uint64_t granule, uint64_t arena_size, uint64_t retain,
                    int isolate);
/* A block of at least `size` bytes that `stream` may use at once (any stream when !stream_ordered).
 * Free space already mapped is preferred; else the pool grows, first giving back empty segments
 * beyond `retain`.  NULL with *err = -ENOMEM when the device is full even after giving back every
 * empty segment it could, or another negative error from the mechanism. */
vmm__block *vmm__pool_alloc(vmm__pool *p, uint64_t size, int stream_ordered, uint64_t stream, int *err);
/* Give a block back.  event NULL: every stream may reuse it at once; else `stream` at once and
 * other streams once the event is reached.  Returns 1 when a segment became empty. */
int vmm__pool_free(vmm__pool *p, vmm__block *b, uint64_t stream, void *event);
/* The same, with no event recorded: the free costs no driver call.  The event is recorded on
 * `stream` only once another stream, a give-back or a wait needs it (ops.event_record, which then
 * covers at least the work queued before this free), unless a synchronization covering the free
 * comes first (vmm__pool_reached_by_sync).  seq (1 or more) orders the free against
 * synchronizations. */
int vmm__pool_free_unrecorded(vmm__pool *p, vmm__block *b, uint64_t stream, void *stream_ctx, uint64_t seq);
/* A synchronization of `stream` (of every stream of stream_ctx when any_stream) that began after
 * every free numbered below before_seq: those frees are reached, their events recorded since or not. */
void vmm__pool_reached_by_sync(vmm__pool *p, int any_stream, uint64_t stream, void *stream_ctx, uint64_t before_seq);
/* Record the events of `stream`'s unrecorded frees now (it is about to be destroyed). */
void vmm__pool_record_stream(vmm__pool *p, uint64_t stream);
/* Give back empty segments, oldest first, while more than keep_reserved bytes are reserved and
 * more than keep_empty bytes are in empty segments, among those empty since `until` (ops.now_ns
 * clock) or earlier.  A segment some free still in flight touches is skipped, never waited for.
 * Returns the bytes given back. */
uint64_t vmm__pool_release(vmm__pool *p, uint64_t keep_reserved, uint64_t keep_empty, uint64_t until);
/* The same, newest first, while more than keep_empty bytes are in empty segments: what a free
 * just emptied goes before what waits for its delay.  Returns the bytes given back. */
uint64_t vmm__pool_release_newest(vmm__pool *p, uint64_t keep_empty);
/* When the oldest empty segment became empty (UINT64_MAX: none is). */
uint64_t vmm__pool_oldest_empty(const vmm__pool *p);
/* Up to `max` events that frees still in flight wait on (to wait for outside the caller's lock);
 * unrecorded ones are recorded first. */
unsigned vmm__pool_pending_events(vmm__pool *p, void **events, unsigned max);
/* Bytes a request could get without growing: every empty segment. */
uint64_t vmm__pool_empty_bytes(const vmm__pool *p);
/* The arena holding addr, or NULL. */
vmm__arena *vmm__pool_arena_at(const vmm__pool *p, uint64_t addr);
/* The segment mapped at addr in arena a, or NULL. */
vmm__seg *vmm__pool_seg_at(const vmm__arena *a, uint64_t granule, uint64_t addr);
/* The block (free or not) holding addr in arena a, or NULL. */
vmm__block *vmm__pool_block_at(const vmm__arena *a, uint64_t granule, uint64_t addr);
/* Pausing (shim/backing/sleep.c), with the device idle: every free counts as reached (the caller
 * synchronized), and every old place of a moved segment is unmapped. */
void vmm__pool_settle(vmm__pool *p);
/* Give back every empty segment of arena a (paused or not): the bytes given back; *dropped set
 * when a itself went with its last segment. */
uint64_t vmm__pool_release_arena(vmm__pool *p, vmm__arena *a, int *dropped);
/* Arena a is paused (its free blocks leave the bins: nothing new is placed in it) or resumed
 * (they come back). */
void vmm__pool_set_paused(vmm__pool *p, vmm__arena *a, int paused);
/* Give back everything (a device reset, or a test's end); blocks still allocated are dropped. */
void vmm__pool_destroy(vmm__pool *p);
#endif
