/* vmm_import_many's own declarations, shared by its four files (many.c, many_units.c,
 * many_fetch.c, many_map.c) and by nobody else: one call's state (struct many) passes through
 * every step, so its types are declared once here.  many_units.c is the batch's floor (the
 * call's units, its index, its threads, its first failure); many_fetch.c and many_map.c call it;
 * many.c calls all three and is the only one anything outside calls. */
#ifndef VMM_IMPORT_MANY_H
#define VMM_IMPORT_MANY_H
#include <pthread.h>

#include "import/internal.h"

#define MAX_IMPORT_THREADS 16

/* The calling thread's last vmm_import_many, step by step (vmm_import_many_last_timing). */
extern _Thread_local vmm_import_many_timing vmm__mt;

/* What the call fetches from the owner: one allocation's handles (a single-handle chunk, or every
 * handle of a MULTI-HANDLE record).  Every chunk and range needing the same handles shares one
 * unit: asked for once, each handle imported once and mapped wherever it is needed, released once
 * all is mapped. */
typedef struct unit {
    vmm_alloc_info a;    /* the record the owner is asked about */
    uint32_t n;          /* its handles */
    uint32_t got;        /* handles received so far, in order */
    uint64_t bytes;      /* their bytes */
    CUmemGenericAllocationHandle *h;
    uint64_t *size;
    uint8_t *ok;         /* h[i] is imported (threads import them in any order) */
    uint64_t *alias;     /* 0, or 1 + (unit << 32 | handle) of the same segment brought earlier: h[i] is that
                            one's import (not released here) */
} unit;

/* An open-addressed index of small integers (stored + 1), sized for n entries: the call may name
 * thousands of chunks, and a list searched for each would cost the square of that. */
typedef struct ix {
    uint32_t *slot;
    size_t mask;
} ix;

typedef struct many_range {
    range_plan p;        /* the records under it; for a range across chunks, its pieces too */
    bool across;         /* across chunks: a mapping of its own */
    chunk *c;            /* inside one chunk: that chunk (one reference of this range's) */
    uint32_t fresh;      /* inside one chunk not mapped here before: 1 + its index in new chunks */
    uint32_t consumer;   /* across: its place in the reservation */
    uint32_t *unit_of;   /* across: each piece's unit */
    CUdevice use;
} many_range;

typedef struct new_chunk {
    chunk_key key;
    vmm_alloc_info a;    /* the first range's first record: its witness */
    uint32_t unit;
    uint32_t users;      /* ranges in it */
    uint32_t consumer;
    chunk *c;            /* the chunk table's entry, once made */
} new_chunk;

/* Something new mapped into the call's reservation: a new chunk (whole) or a range across chunks
 * (its handles at their places, as in the owner). */
typedef struct consumer {
    uint64_t at, size;   /* its place in the reservation */
    uint64_t group;      /* the devices it is granted to (those laid out together get one SetAccess) */
    CUmemAccessDesc acc[2];
    size_t n_acc;
    CUdevice use;
    placed *v;           /* the handles mapped, at the owner's addresses (v[0] at `at`) */
    size_t nv;
    uint32_t *shared;    /* each handle's vmm__mapping_last counter, 0: mapped for this consumer alone */
    bool is_range;
    uint32_t index;      /* into new chunks or ranges */
} consumer;

typedef struct map_op {
    CUdeviceptr va;
    size_t len;
    CUmemGenericAllocationHandle h;
    bool done;
} map_op;

/* Everything one call holds, so that a failure anywhere undoes it all in one place. */
typedef struct many {
    vmm_registry *reg;
    vmm__liveness_cache live;
    vmm_alloc_info *hint; /* per range, the record its caller read (vmm__import_many_begin's hints), or NULL */
    uint32_t pid, threads;
    CUcontext ctx;
    here_device here;
    owner_ref *owner;
    many_range *r;
    size_t n;
    unit *u;
    size_t n_units, cap_units, n_handles;
    ix units_ix, chunks_ix;
    new_chunk *nc;
    size_t n_nc, cap_nc;
    consumer *cs;
    size_t n_cs;
    slab *s;
    map_op *ops;
    size_t n_ops;
    /* the fetch's hand-over to importing threads, and the first failure of any thread */
    pthread_mutex_t lock;
    pthread_cond_t cv;
    struct job {
        int fd;
        uint32_t unit, handle;
    } *q;
    size_t q_len, q_next;
    bool q_closed;
    size_t op_next;
    /* every handle the stream brought, by the owner's address and size of its segment */
    struct seg_seen {
        uint64_t at, size; /* size 0: an empty slot */
        uint32_t unit, handle;
    } *segs;
    size_t segs_mask;
    vmm_status st;
    char why[400];
    uint64_t import_ns, map_ns; /* summed over the threads (vmm__mt is each thread's own) */
    uint64_t access_ns;  /* vmm__many_grant's */
    uint32_t access_calls;
    /* vmm_import_many_begin: the call's inputs (for the failure line at the end), its start, the
     * granting thread, and begin's timing (vmm__mt is its thread's, and the end may be another's) */
    uint64_t *addresses, *sizes;
    uint64_t t_start;
    pthread_t granter;
    bool granting;
    vmm_status grant_st;
    char grant_why[400];
    vmm_import_many_timing mt;
    size_t fail_range;   /* the range a failure after the find concerns, n when none */
    size_t fail_unit;    /* the unit a fetch failure concerns, SIZE_MAX when none */
} many;

/* ---- the call's bookkeeping (many_units.c) ---- */

/* VMMSHIM_IMPORT_THREADS, read at each call. */
vmm_status vmm__import_threads(uint32_t *out);
/* Run fn(arg) on n - 1 new threads and the calling thread, and wait for all. */
void vmm__crew_run(uint32_t n, void *(*fn)(void *), void *arg);
bool vmm__same_record(const vmm_alloc_info *x, const vmm_alloc_info *y);
bool vmm__same_unit(const vmm_alloc_info *x, const vmm_alloc_info *y);
uint64_t vmm__unit_hash(const vmm_alloc_info *a);
bool vmm__ix_init(ix *t, size_t n);
/* Record a failure found on any thread; the first stands. */
void vmm__many_fail(many *m, vmm_status st);
bool vmm__many_failed(many *m);
/* The unit for record a (made when new); its index, or -1 out of memory. */
long vmm__unit_of(many *m, const vmm_alloc_info *a);
/* The new chunk of key k (made when new, for record a); its index, or -1 out of memory. */
long vmm__new_chunk_of(many *m, const chunk_key *k, const vmm_alloc_info *a);
/* Release every imported handle: mapped, they keep their memory; unmapped, it goes. */
void vmm__many_release_handles(many *m);

/* ---- 2. fetch (many_fetch.c) ---- */

/* Every unit's handles from the owner, imported. */
vmm_status vmm__many_fetch(many *m);

/* ---- 3. map, 4. hand out, and undo (many_map.c) ---- */

/* Lay out every consumer, reserve once, map every handle. */
vmm_status vmm__many_map(many *m);
/* Grant access to everything vmm__many_map mapped, one cuMemSetAccess per group of devices; its
 * time into m->access_ns (it may run on a thread of its own). */
vmm_status vmm__many_grant(many *m);
/* Where range i's first byte is mapped and for which device, before the hand-out: what the hand-out
 * gives its import, unless another thread of this process enters the same chunk first. */
void vmm__many_place(const many *m, size_t i, uint64_t *ptr, int *device);
/* The new chunks into the chunk table, the ranges across chunks as range maps: out[]. */
vmm_status vmm__many_hand_out(many *m, vmm_imported **out);
/* Undo what vmm__many_map made of the reservation (nothing has been handed out). */
void vmm__many_unmap(many *m);
#endif
