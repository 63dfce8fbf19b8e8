/* The pool's policy: which chunk and where in it a request goes (size classes, good fit, split,
 * coalesce), when chunks are made and given back, and when a freed block may be reused by which
 * stream.  The mechanism (making and releasing chunks, asking whether a stream reached an event)
 * comes in through vmm__pool_ops, so nothing here knows CUDA.  Not thread-safe: the caller holds
 * one lock per pool. */
#ifndef VMM_POOL_H
#define VMM_POOL_H
#include <stdint.h>
#include <uthash.h>

/* Every block starts on, and is a multiple of, this many bytes: what native cudaMalloc gives
 * (measured on an H100; README.md, "The pool"). */
#define VMM_POOL_ALIGN 512u
/* Requests up to this size share small chunks of one granule (2 MiB). */
#define VMM_POOL_SMALL_MAX (1u << 20)
/* Requests up to this size are split out of medium chunks; larger ones get a chunk of their own
 * size (rounded to the granule), which later frees may split for others. */
#define VMM_POOL_MEDIUM_MAX (10u << 20)
#define VMM_POOL_MEDIUM_CHUNK (20u << 20)

typedef struct vmm__chunk vmm__chunk;

typedef struct vmm__block {
    uint64_t addr, size;                 /* size: the block's extent in its chunk */
    vmm__chunk *chunk;
    struct vmm__block *prev, *next;      /* neighbours in the chunk, by address */
    struct vmm__block *fprev, *fnext;    /* free list of its size class, while free */
    int free, cls;
    uint64_t stream;                     /* free: the stream that freed it (0: any stream may use it) */
    void *event;                         /* free: recorded on `stream` at the free; NULL once reached */
    /* the rest belongs to the caller (shim/backing): the allocation living in the block */
    uint64_t requested, generation;
    uint32_t slot, api;
    int live;
    void *ctx;                           /* the context it was made in: cudaFree syncs that */
    uint8_t alloc_id[16];
    UT_hash_handle hh, hs;               /* caller's tables: by address, by registry slot */
} vmm__block;

struct vmm__chunk {
    uint64_t base, size;
    void *mech;                          /* the mechanism's handle for it */
    int small;                           /* holds requests up to VMM_POOL_SMALL_MAX, packed */
    uint32_t n_live;                     /* allocated blocks in it */
    vmm__block *first;                   /* lowest block */
    vmm__chunk *prev, *next;             /* every chunk of the pool */
};

typedef struct vmm__pool_ops {
    void *ctx;
    /* Make chunk c of c->size bytes: 0 with c->base and c->mech set; -ENOMEM when the device is
     * full; any other negative value for other failures. */
    int (*chunk_create)(void *ctx, vmm__chunk *c);
    void (*chunk_destroy)(void *ctx, vmm__chunk *c);
    int (*event_done)(void *ctx, void *event); /* 1 once the stream reached it */
    void (*event_wait)(void *ctx, void *event);
    void (*event_release)(void *ctx, void *event);
} vmm__pool_ops;

#define VMM_POOL_CLASSES 320

typedef struct vmm__pool_bins {
    vmm__block *head[VMM_POOL_CLASSES];
    uint64_t map[(VMM_POOL_CLASSES + 63) / 64];
} vmm__pool_bins;

typedef struct vmm__pool {
    vmm__pool_ops ops;
    uint64_t granule;
    uint64_t retain;                     /* bytes of empty chunks kept for reuse */
    int isolate;                         /* every allocation its own chunk, never shared */
    vmm__pool_bins bins[2];              /* [1]: small chunks' free blocks, [0]: the others' */
    vmm__chunk *chunks;
    vmm__block *spare;                   /* recycled block structs */
    uint64_t reserved, reserved_high, used, used_high, empty_bytes;
    uint64_t n_chunks, chunks_made, chunks_released;
} vmm__pool;

void vmm__pool_init(vmm__pool *p, const vmm__pool_ops *ops, uint64_t granule, uint64_t retain, int isolate);
/* A block of at least `size` bytes that `stream` may use at once (any stream when !stream_ordered),
 * from free space or a new chunk.  NULL with *err = -ENOMEM when the device is full even after
 * giving back every empty chunk, or another negative error from the mechanism. */
vmm__block *vmm__pool_alloc(vmm__pool *p, uint64_t size, int stream_ordered, uint64_t stream, int *err);
/* Give a block back.  event NULL: every stream may reuse it at once; else `stream` at once and
 * other streams once the event is reached. */
void vmm__pool_free(vmm__pool *p, vmm__block *b, uint64_t stream, void *event);
/* Give back empty chunks (waiting for their frees to complete) until at most `keep` bytes are
 * reserved or none is left; returns the bytes given back. */
uint64_t vmm__pool_give_back(vmm__pool *p, uint64_t keep);
/* The block containing addr, if addr is in one of the pool's chunks (walks that chunk's blocks). */
vmm__block *vmm__pool_block_at(const vmm__chunk *c, uint64_t addr);
/* Give back every chunk (at exit of a test); blocks still allocated are dropped. */
void vmm__pool_destroy(vmm__pool *p);
#endif
