/* What the files of shim/import share and nobody outside it may see: the driver table, the owner
 * entries, the chunk cache's entries, the range plans and the vmm_imported handle itself.  One
 * import touches all of them (a vmm_import_many call reaches into every file here), so they are
 * declared once, below every file of the folder; import.h stays the folder's face to the client
 * library and the shim.  Calls between the files go one way only (README.md: the floors);
 * tests/scripts/circles.py checks it. */
#ifndef VMM_IMPORT_INTERNAL_H
#define VMM_IMPORT_INTERNAL_H
#include <cuda.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "import/import.h"

/* ---- errors and the driver (driver.c) ---- */

#define set_err vmm__error

/* The name a caller knows a function by: vmm__import is vmm_import of vmmshim.h. */
const char *vmm__public_name(const char *fn);

/* An argument check that names the public function in its reason. */
#define NEED(cond, what)                                                                          \
    do {                                                                                          \
        if (!(cond)) return set_err(VMM_ERR_INVALID, "%s: %s", vmm__public_name(__func__), what); \
    } while (0)

typedef struct cuda_api {
    CUresult (*Init)(unsigned int);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    CUresult (*GetErrorName)(CUresult, const char **);
} cuda_api;
extern cuda_api vmm__import_cu;

/* The driver loaded, or VMM_ERR_CUDA and why. */
vmm_status vmm__cuda_ready(void);
/* A failed driver call as VMM_ERR_CUDA, its CUDA_ERROR_* name in the reason. */
vmm_status vmm__cu_fail(const char *what, CUresult r);

/* A driver call that undoes (gives memory back, restores a context), made once more if it fails:
 * nothing else would ever undo it, and a failure may be passing.  The second result stands. */
#define TWICE(call) ((call) == CUDA_SUCCESS ? CUDA_SUCCESS : (call))

/* ---- owners and timing (owners.c, the owner table in cache.c) ---- */

/* The calling thread's last vmm_import, step by step (vmm_import_last_timing). */
extern _Thread_local vmm_import_timing vmm__tm;

static inline uint64_t vmm__now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* An owner this process imports from: its kept broker connection, and a pidfd that tells in one
 * poll() whether it has exited (reading /proc/<pid>/stat costs more than a whole cached import).
 * Entries go when the owner has exited, or has been idle for OWNER_IDLE_NS, and nothing of it is
 * mapped or in use (the reaper, cache.c). */
typedef struct owner_ref {
    uint32_t pid;
    uint64_t start_time, pidns;
    int pidfd;            /* -1: judged through /proc each time (another pid namespace, no pidfd_open) */
    int sock;             /* the kept connection to its broker, -1 none; used under io */
    pthread_mutex_t io;   /* one request at a time on sock */
    bool no_repeats;      /* its broker predates VMM_BROKER_REQ3_REPEATS (under io) */
    /* Telling its broker what the chunk cache unmapped (protocol v5, release.c), under rel_io: a
     * connection of its own, so that no reply we do not wait for lands among those io waits for */
    pthread_mutex_t rel_io;
    int rel_sock;         /* -1 none */
    bool no_release;      /* its broker predates v5 (it answered -EPROTO): told nothing more */
    char path[108];       /* its broker's socket, as the kept connection found it ("" not yet) */
    unsigned long chunks; /* chunks of it in the chunk table, held or idle */
    unsigned long busy;   /* threads using the entry outside vmm__chunks_lock */
    uint64_t last_used_ns;
    struct owner_ref *next;
} owner_ref;

int vmm__owner_liveness(const vmm_alloc_info *a);
vmm_status vmm__owner_dead(const vmm_alloc_info *a);
/* The owner paused a's memory: VMM_ERR_PAUSED, with its one-line reason. */
vmm_status vmm__paused(const vmm_alloc_info *a);
/* A pidfd of the allocation's owner, or -1 (it is not the owner, or no pidfd_open). */
int vmm__owner_pidfd(const vmm_alloc_info *a);
bool vmm__owner_exited(const owner_ref *o);
void vmm__owner_free(owner_ref *o);
/* The owner's entry, made when new, marked busy until vmm__owner_put (cache.c). */
vmm_status vmm__owner_get(const vmm_alloc_info *a, owner_ref **out);
void vmm__owner_put(owner_ref *o);

/* ---- the owner's broker (broker.c) ---- */

/* Receive one datagram (its length in *len) and at most max_fds fds (any extra are closed).
 * Returns 0 or -errno; on failure no fd is left open. */
int vmm__broker_recv_raw(int s, void *buf, size_t cap, size_t *len, int *fds, uint32_t max_fds, uint32_t *n_fds);
/* Connect to the owner's broker, as its process record names it. */
vmm_status vmm__broker_open(vmm_registry *reg, const vmm_alloc_info *a, int *sock);
/* One request and its reply (recv_fn) on the owner's kept connection (o->io held), opened again
 * once when the broker had closed it.  0, or -errno; *open_st says why it could not connect. */
int vmm__broker_roundtrip(vmm_registry *reg, const vmm_alloc_info *a, owner_ref *o, const void *req, size_t req_len,
                          int (*recv_fn)(int, void *), void *recv_ctx, vmm_status *open_st);
/* A failed exchange (no reply), and a reply's non-zero status, as the caller's status. */
vmm_status vmm__exchange_failed(const vmm_alloc_info *a, int rc);
vmm_status vmm__reply_failed(const vmm_alloc_info *a, int32_t status);
/* The chunk's fd from the owner's broker (protocol v1). */
vmm_status vmm__broker_fetch(vmm_registry *reg, const vmm_alloc_info *a, int *fd_out);

/* ---- fetching handles (fetch.c) ---- */

/* A multi-handle allocation's handles, imported here, in address order. */
typedef struct multi_parts {
    uint32_t n, n_imported;
    CUmemGenericAllocationHandle *h;
    uint64_t *size;
} multi_parts;

void vmm__parts_release(multi_parts *p, uint32_t n_imported);
/* Every handle of a MULTI-HANDLE allocation, each imported. */
vmm_status vmm__multi_fetch(vmm_registry *reg, const vmm_alloc_info *a, multi_parts *p);
/* The chunk's fd, by the route the record offers (broker, else pidfd). */
vmm_status vmm__fetch_fd(vmm_registry *reg, const vmm_alloc_info *a, int *fd);
/* The allocation's chunk as a handle of this process: its fd from the owner, imported.  The
 * caller maps it or releases it (cuMemRelease). */
vmm_status vmm__fetch_handle(vmm_registry *reg, const vmm_alloc_info *a, CUmemGenericAllocationHandle *handle);

/* ---- the chunk cache (cache.c) ---- */

/* One reservation that several mappings share: vmm_import_many maps every chunk and range it
 * makes into one (one cuMemAddressReserve, one cuMemSetAccess over the lot), and each of them
 * unmaps its own part when it goes.  The driver frees an address range only whole, so the
 * reservation goes with the last part (refs: the parts still mapped in it). */
typedef struct slab {
    CUdeviceptr base;
    size_t size;
    unsigned long refs;
    /* A segment of the owner that several parts reach (a stream-ordered pool's segment under the
     * end of one allocation and the start of the next) is mapped once, where both parts lie: its
     * counter says how many parts still use that mapping, and the last one unmaps it. */
    unsigned long *shared_refs;
} slab;

/* Every import maps its allocation's whole chunk; allocations of one chunk share one mapping.
 * A pooled chunk is named by its owner and chunk_id (never reused by that owner), with its
 * mapped size as a second guard; a record without a chunk id (its own chunk, older writers) by
 * its owner, slot and generation, which change whenever the slot is published again.  Never by
 * fd number or address: both are reused. */
typedef struct chunk_key {
    uint32_t pid;
    uint32_t by_slot; /* 1: id is the record's slot and generation its generation (chunk_id 0) */
    uint64_t start_time, pidns;
    uint64_t id, generation, mapped_size;
    uint64_t first; /* by_slot: the first handle's chunk_id */
} chunk_key;

/* A mapping no vmm_imported holds stays mapped ("idle") while its owner still holds the chunk, so
 * that importing from it again costs a registry read, not a broker round trip and four driver
 * calls.  The last allocation imported from it is its witness: while that record stays live the
 * owner holds the chunk.  When the witness is freed (the chunk may live on with other
 * allocations: the mapping is dropped anyway, never kept on a guess), the owner exits, or the
 * registry it was read from is closed, the reaper unmaps it: an idle mapping never keeps memory
 * the owner has let go of. */
typedef struct chunk {
    chunk_key key;
    owner_ref *owner;
    vmm_registry *reg;  /* read the witness through it; NULL once closed (unmapped when unheld) */
    CUdeviceptr base;
    size_t size;
    CUmemGenericAllocationHandle handle; /* when n_parts is 0 */
    /* A MULTI-HANDLE allocation: n_parts handles mapped back to back, part_len[i] bytes each.
     * Their handles are released once mapped (the mappings keep the memory alive), so only the
     * lengths are kept, to unmap one mapping at a time. */
    uint32_t n_parts;
    uint64_t *part_len;
    slab *slab;         /* mapped by vmm_import_many: its place in that call's reservation */
    uint32_t *shared;   /* with slab: each part's vmm__mapping_last counter (NULL: none shared) */
    CUcontext ctx;      /* current when it was mapped: released from it */
    uint64_t devices;   /* bit d: device d was granted access (devices 0..63) */
    unsigned long refs; /* vmm_imported handles on it; 0: idle */
    uint64_t witness_slot, witness_generation;
    uint8_t witness_id[16];
    struct chunk *next;
} chunk;

/* The owner table and the chunk table; driver and broker calls are never made under it. */
extern pthread_mutex_t vmm__chunks_lock;

/* One part of s is unmapped: the last one frees the reservation. */
vmm_status vmm__slab_put(slab *s);
/* A mapping in s goes from one of the parts using it: true when that part was its last user. */
bool vmm__mapping_last(slab *s, const uint32_t *shared, size_t i);
chunk_key vmm__key_of(const vmm_alloc_info *a);
bool vmm__same_key(const chunk_key *x, const chunk_key *y);
/* Lock held.  The entry for k with one more reference, or NULL. */
chunk *vmm__chunk_ref_locked(const chunk_key *k);
/* fresh (its key, owner and refs set) into the table, witnessed by a read through reg; or, when
 * another thread entered that chunk meanwhile, that entry with fresh->refs more references, and
 * fresh left to the caller to unmap.  Returns the entry now in the table. */
chunk *vmm__chunk_enter(chunk *fresh, vmm_registry *reg, const vmm_alloc_info *a);
/* Lock held: the allocation last imported from c, read through reg, is its witness now. */
void vmm__set_witness_locked(chunk *c, vmm_registry *reg, const vmm_alloc_info *a);
/* Make ctx current when it is not: true when switched, *prev to restore then. */
bool vmm__ctx_enter(CUcontext ctx, CUcontext *prev);
/* Give back the pieces of a mapping, as far as they exist; the first failure's status. */
vmm_status vmm__undo(CUdeviceptr base, size_t size, CUmemGenericAllocationHandle handle, bool mapped, bool reserved);
vmm_status vmm__unmap_chunk(const chunk *c);
void vmm__chunk_free(chunk *c);
/* Drop one reference: the last leaves the mapping idle while its owner holds the chunk. */
vmm_status vmm__chunk_unref(chunk *c);
/* A cached chunk's allocation, without asking the broker: still live, its owner alive. */
vmm_status vmm__still_live(vmm_registry *reg, const vmm_alloc_info *a, const owner_ref *owner);

/* ---- devices and access (devices.c) ---- */

/* The calling thread's device and whether the thread had a context of its own (vmm__current_context). */
typedef struct {
    CUdevice dev;
    bool own;
} here_device;

/* The calling thread's context, or device 0's primary context made current; and its device. */
vmm_status vmm__current_context(CUcontext *ctx, here_device *here);
/* The devices a new mapping of record a gets access for: acc[0..*n), *use the import's device. */
void vmm__plan_access(const vmm_alloc_info *a, here_device here, CUmemAccessDesc acc[2], size_t *n, CUdevice *use);
uint64_t vmm__device_bits(const CUmemAccessDesc *acc, size_t n);
/* A chunk mapped already, imported by a thread on `here`: access for the devices that need it. */
vmm_status vmm__grant_device(chunk *c, const vmm_alloc_info *a, here_device here, CUdevice *use);

/* ---- imports (import.c) ---- */

typedef struct range_map range_map;

struct vmm_imported {
    chunk *c;                /* a vmm_import: its chunk's reference; NULL for a range */
    range_map *range;        /* a vmm_import_range: its own mappings; NULL for an allocation */
    uint64_t ptr;            /* c->base + the allocation's chunk_offset, or the range's first byte */
    uint64_t requested_size; /* a range's length */
    int device;              /* the device it is mapped read-write for here */
    vmm_alloc_info alloc;    /* a vmm_import: the record it was imported from (vmm_import_check) */
    vmm_alloc_info *recs;    /* a range's records, as walked (vmm_import_records); NULL: alloc alone */
    size_t n_recs;
};

/* Can vmm_import map this record's chunk?  Its reason when not. */
vmm_status vmm__importable(vmm_registry *reg, const vmm_alloc_info *alloc);

/* ---- ranges across allocations (range.c) ---- */

/* A range import owns its reservation and mappings outright: nothing of it is in the chunk table
 * or shared with another import, so it needs no lock and no owner bookkeeping. */
struct range_map {
    CUdeviceptr base;
    size_t size;  /* the reservation; 0 until it is made */
    slab *slab;    /* vmm_import_many's: [base, base + size) is its part of that reservation */
    uint32_t *shared; /* with slab: each mapping's vmm__mapping_last counter (NULL: none shared) */
    CUcontext ctx; /* current when it was mapped: unmapped from it */
    size_t n;      /* mappings made so far, each [base + at, + len) */
    struct {
        size_t at, len;
    } map[];
};

/* One mapping of a range: bytes [from, to) of one chunk are needed, and the whole chunk is mapped
 * (the driver maps a handle only from offset 0).  Consecutive records of one chunk (allocations
 * the shim's pool placed side by side) make one piece. */
typedef struct piece {
    size_t first, last;  /* its records, in range order */
    uint64_t owner_at;   /* the owner's address of byte `from` */
    uint64_t from, to, size;
    size_t handle_of;    /* the piece whose fetched handle it maps: itself, or an earlier one */
    CUmemGenericAllocationHandle handle;
    multi_parts parts;   /* a MULTI-HANDLE record's handles instead (parts.n 0: one handle) */
} piece;

typedef struct range_plan {
    vmm__liveness_cache *live; /* the owner's liveness, judged once for the call (NULL: each lookup) */
    /* records this call read already (the range before's): one holding a place serves it with no
     * index search, the call checking every record it used against the registry before it maps */
    const vmm_alloc_info *seen;
    size_t n_seen;
    const vmm_alloc_info *hint; /* the record the caller read for the range's start (NULL: none), used alike */
    uint32_t pid;
    uint64_t address, end;
    vmm_alloc_info *rec; /* the records covering [address, end), in order */
    size_t n_rec, cap_rec;
    piece *pc;
    size_t n_pc, cap_pc;
} range_plan;

/* One handle at its place in the owner: what a range maps. */
typedef struct placed {
    uint64_t at, size; /* the owner's address of the handle's first byte, its bytes */
    CUmemGenericAllocationHandle handle;
} placed;

/* arr with room for element n (moved, perhaps), or NULL with arr untouched. */
void *vmm__grow(void *arr, size_t *cap, size_t n, size_t elem);
/* Pooled records name their chunk; a record without a chunk id is a chunk of its own. */
bool vmm__same_chunk(const vmm_alloc_info *x, const vmm_alloc_info *y);
/* The live records covering the range; registry reads only. */
vmm_status vmm__range_walk(vmm_registry *reg, range_plan *p);
/* Which chunk goes where: the range's pieces, which must lie back to back in the owner. */
vmm_status vmm__range_layout(range_plan *p);
/* Where each fetched handle lies in the owner, those the range touches, in address order. */
vmm_status vmm__range_place(const range_plan *p, placed **out, size_t *n_out);
/* Unmap what was mapped, free the reservation (or give back the range's part of it), free m. */
vmm_status vmm__range_unmap(range_map *m);

/* ---- telling the owner's broker what was let go of (release.c) ---- */

/* o->sock was just connected (o->io held): its peer's path is where releases go. */
void vmm__release_note_path(owner_ref *o);
/* c's mapping is gone: tell its owner's broker, fire and forget (never blocks for long). */
void vmm__release_tell(const chunk *c);

#endif
