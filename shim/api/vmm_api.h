/* The part of the vmmshim API that the shim itself implements or fills: the status codes, the
 * records it publishes as the reader sees them (vmm_alloc_info, vmm_proc_info, vmm_registry_info),
 * the import handles and timings of the import mechanism (shim/import), and the owner side of
 * named tensors (vmm_publish and family, which the shim exports).  It lives below the shim so that
 * nothing in shim/ includes a header of tools/; the public header, tools/include/vmmshim.h,
 * includes it, and make writes both into one file, $BUILD/include/vmmshim.h, the one installed.
 * The documentation of the calls is vmmshim.h's; a change here is a change of the public ABI. */
#ifndef VMM_API_H
#define VMM_API_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum vmm_status {
    VMM_OK = 0,
    VMM_ERR_INVALID = 1,    /* bad argument */
    VMM_ERR_NOT_FOUND = 2,  /* no registry / no such process or allocation */
    VMM_ERR_ACCESS = 3,     /* permission denied (registry or broker) */
    VMM_ERR_CORRUPT = 4,    /* the registry is not a valid vmmshim segment */
    VMM_ERR_VERSION = 5,    /* the registry's layout is newer than this library reads */
    VMM_ERR_BUSY = 6,       /* a writer is mid-update (or died mid-update): retry, or run gc */
    VMM_ERR_STALE = 7,      /* the allocation was freed since it was read */
    VMM_ERR_OWNER_DEAD = 8, /* the owning process has exited */
    VMM_ERR_CUDA = 9,       /* a CUDA driver call failed (the message names it) */
    VMM_ERR_NOMEM = 10,
    VMM_ERR_IO = 11,
    VMM_ERR_NO_SHIM = 12,   /* owner side: this process does not run under an active libvmmshim.so */
    VMM_ERR_PAUSED = 13,    /* the owner paused this memory (vmm_pause): it can be imported once resumed */
    VMM_ERR_STATE = 14      /* owner side: not in the state the call needs (vmm_pause of paused memory,
                               vmm_resume of memory not paused); nothing changed */
} vmm_status;

/* Liveness of an owner, judged by pid and process start time (never pid alone).  KEPT: it has
 * exited, and a keeper (vmmctl keep; see Keepers in vmmshim.h) holds this allocation's memory and serves
 * its imports, so import it as from a living owner. */
enum { VMM_OWNER_DEAD = 0, VMM_OWNER_ALIVE = 1, VMM_OWNER_UNKNOWN = 2 /* other pid namespace */, VMM_OWNER_KEPT = 3 };

/* How a companion may obtain an allocation's memory (vmm_alloc_info.handle_kinds). */
enum { VMM_KIND_BROKER = 1u << 0, VMM_KIND_PIDFD = 1u << 1, VMM_KIND_FABRIC = 1u << 2 };

/* Which call made it (vmm_alloc_info.api). */
enum {
    VMM_FROM_UNKNOWN = 0,
    VMM_FROM_CUDA_MALLOC = 1,
    VMM_FROM_CUDA_MALLOC_ASYNC = 2,
    VMM_FROM_CU_MEM_ALLOC = 3,
    VMM_FROM_CU_MEM_ALLOC_ASYNC = 4,
    VMM_FROM_CU_MEM_ALLOC_PITCH = 5,
    /* Memory the program mapped itself with the driver's VMM API (PyTorch's expandable segments,
     * NCCL buffers): one record per cuMemMap'd range.  address and extent are the mapping's,
     * mapped_size is the size of the handle mapped there, chunk_offset where in that handle the
     * mapping starts, chunk_id names the handle.  A buffer of the program may span several such
     * records: vmm_import_range maps it in one piece. */
    VMM_FROM_CU_MEM_MAP = 6,
    VMM_FROM_TEST = 15
};

typedef struct vmm_registry vmm_registry;

typedef struct vmm_alloc_info {
    uint8_t alloc_id[16];     /* random, never reused */
    uint64_t generation;      /* with slot, names this allocation; changes when it is freed */
    uint64_t slot;            /* record index in the registry */
    uint32_t pid;             /* owner, in the owner's pid namespace */
    int owner_alive;          /* VMM_OWNER_* at the time of reading */
    uint64_t owner_start_time;
    uint64_t owner_pidns;
    uint32_t device;          /* ordinal in the owner */
    uint8_t device_uuid[16];
    uint64_t address;         /* the owner's device pointer */
    uint64_t requested_size;
    uint64_t mapped_size;     /* its chunk's size (a multiple of 2 MiB): what an importer maps */
    uint64_t stream;          /* owner's stream for stream-ordered allocations, else 0 */
    uint64_t created_ns;      /* CLOCK_REALTIME */
    uint32_t api;             /* VMM_FROM_* */
    uint32_t handle_kinds;    /* VMM_KIND_*; 0 = not exportable */
    int32_t exported_fd;      /* fd number in the owner when VMM_KIND_PIDFD */
    uint32_t n_frames;
    uint64_t frames[8];       /* call-site return addresses in the owner */
    char tag[32];
    /* Allocations live in chunks (one exportable handle each); small ones share a chunk with other
     * allocations of the same owner.  An import maps the whole chunk and adds chunk_offset. */
    uint64_t chunk_id;        /* the chunk within its owner; never reused */
    uint64_t chunk_offset;    /* address - the chunk's base in the owner */
    uint64_t extent;          /* bytes of the chunk it occupies (>= requested_size) */
    uint32_t flags;           /* VMM_ALLOC_* */
    /* Handles its chunk is made of: 1, or with VMM_ALLOC_MULTI_HANDLE several, mapped back to
     * back in the owner (its pool maps many handles into one range, and an allocation may span
     * some).  chunk_id then names the first, mapped_size is their sum, and chunk_offset counts
     * from the first one's base.  vmm_import maps them all; vmm_import_fd cannot hand them out. */
    uint32_t n_handles;
} vmm_alloc_info;

/* vmm_alloc_info.flags */
enum {
    VMM_ALLOC_NOT_EXPORTABLE = 1u << 0, /* made by the real allocator (device full, stream capture) */
    VMM_ALLOC_SHARED_CHUNK = 1u << 1,   /* its chunk may hold other allocations of the same owner */
    VMM_ALLOC_MULTI_HANDLE = 1u << 2,   /* its chunk is n_handles handles back to back (broker only) */
    VMM_ALLOC_KEPT = 1u << 3,           /* its owner died and a keeper holds its memory (owner_alive says
                                           VMM_OWNER_KEPT while that keeper lives) */
    VMM_ALLOC_PAUSED = 1u << 4          /* its owner paused its memory (vmm_pause): an import fails with
                                           VMM_ERR_PAUSED until the owner resumes it */
};

typedef struct vmm_proc_info {
    uint32_t pid;
    int alive;                /* VMM_OWNER_* */
    uint64_t start_time;
    uint64_t pidns;
    uint32_t uid;
    uint64_t registered_ns;
    char broker_path[112];    /* "" until the owner's broker has started */
    char cmdline[256];        /* arguments joined by spaces */
    uint64_t n_allocs, bytes_requested, bytes_mapped;
    /* What became of the process's allocations since it started (the registry's COVERAGE, in
     * layout.h), read with relaxed loads while it runs, so one may be ahead of another.
     * stats_known is 0, and the rest 0, for an owner whose shim predates them. */
    int stats_known;
    uint64_t allocs;             /* allocations made: allocs_backed + the three passed_* */
    uint64_t allocs_backed;      /* by the shim's VMM pool: exportable */
    uint64_t passed_capture;     /* to the real allocator: its stream was being captured */
    uint64_t passed_device_full; /* to the real allocator: the pool could not grow */
    uint64_t passed_unsupported; /* to the real allocator: no VMM or export on the device, the
                                    program's own memory pool current, the driver refused */
    uint64_t maps_adopted;       /* ranges the program mapped itself, made exportable */
    uint64_t peak_requested;     /* highest bytes_requested since it started */
    uint64_t unpublished;        /* of allocs_backed, those the registry was too full to publish
                                    (0 for an owner whose shim predates the count) */
    uint64_t bytes_paused;       /* of bytes_mapped, the extents of its allocations paused now (vmm_pause):
                                    summed over its records flagged VMM_ALLOC_PAUSED as they were read */
} vmm_proc_info;

typedef struct vmm_registry_info {
    char name[224];
    uint32_t version, compat_version;
    uint64_t capacity, used_chunks, chunk_records;
    uint64_t created_ns;
    uint64_t total_bytes;     /* size of the segment (sparse) */
    uint64_t touched_bytes;   /* memory actually backing it */
    uint64_t publishes, retracts, reclaimed;
} vmm_registry_info;

/* Iterate (vmm_foreach_alloc, vmm_foreach_proc).  The callback returns 0 to go on, anything else to
 * stop (returned as VMM_OK). */
typedef int (*vmm_alloc_fn)(void *ctx, const vmm_alloc_info *alloc);
typedef int (*vmm_proc_fn)(void *ctx, const vmm_proc_info *proc);

/* (The handle type cannot share the function's name in C: it is vmm_imported.) */
typedef struct vmm_imported vmm_imported;

/* Where the calling thread's last successful vmm_import spent its time, in nanoseconds (for
 * `vmmctl import-test` and benchmarks).  Steps not taken are 0. */
typedef struct vmm_import_timing {
    uint64_t total_ns;   /* the whole call */
    uint64_t context_ns; /* finding (or making current) the CUDA context */
    uint64_t lookup_ns;  /* the imported-chunk table; when cached, also re-reading the record: all a cached import costs besides context_ns */
    uint64_t connect_ns; /* connecting to the owner's broker (0: the kept connection served) */
    uint64_t request_ns; /* request sent to reply and fd received (SCM_RIGHTS), or pidfd_getfd */
    uint64_t export_ns;  /* of request_ns, what the owner spent exporting the fd (its broker says) */
    uint64_t import_ns;  /* cuMemImportFromShareableHandle */
    uint64_t reserve_ns; /* cuMemAddressReserve */
    uint64_t map_ns;     /* cuMemMap */
    uint64_t access_ns;  /* cuMemSetAccess */
    uint32_t cached;     /* 1: the chunk was mapped here already */
    uint32_t route;      /* VMM_KIND_BROKER or VMM_KIND_PIDFD; 0 when cached */
} vmm_import_timing;

/* Where the calling thread's last vmm_import_many spent its time (a failed call's too, up to its
 * failure), in nanoseconds, with what it did.  Times of work done by several threads at once
 * (VMMSHIM_IMPORT_THREADS) are summed over them, so they may add up to more than total_ns. */
typedef struct vmm_import_many_timing {
    uint64_t total_ns;   /* the whole call */
    uint64_t find_ns;    /* registry reads: the records under every range, and re-reading them after the fetch */
    uint64_t context_ns; /* finding (or making current) the CUDA context */
    uint64_t connect_ns; /* connecting to the owner's broker (0: the kept connection served) */
    uint64_t broker_ns;  /* waiting on the broker: each request sent until its last reply came, less the imports
                            this thread made meanwhile */
    uint64_t export_ns;  /* of broker_ns, what the owner spent exporting (its broker says) */
    uint64_t import_ns;  /* cuMemImportFromShareableHandle */
    uint64_t reserve_ns; /* cuMemAddressReserve */
    uint64_t map_ns;     /* cuMemMap */
    uint64_t access_ns;  /* cuMemSetAccess (of new mappings, and of mapped chunks for a further device) */
    uint64_t release_ns; /* cuMemRelease of the imported handles once mapped (the mappings keep the memory) */
    uint32_t ranges;     /* n */
    uint32_t chunks_cached; /* chunks the ranges lie in that were mapped here already: nothing fetched */
    uint32_t chunks_new;    /* chunks mapped for ranges inside one chunk */
    uint32_t ranges_mapped; /* ranges across chunks, each mapped on its own */
    uint32_t handles;    /* handles fetched (each imported, but for the shared ones) */
    uint32_t requests;   /* broker requests (round trips): 1 when everything fits one batch, 0 when cached */
    uint32_t connects;   /* broker connections opened (0: the kept one served) */
    uint32_t messages;   /* broker replies received */
    uint32_t reserves;   /* cuMemAddressReserve calls */
    uint32_t maps;       /* cuMemMap calls */
    uint32_t access_calls; /* cuMemSetAccess calls */
    uint32_t threads;    /* threads that imported and mapped (VMMSHIM_IMPORT_THREADS) */
    uint32_t fallback;   /* 1: the owner's broker predates protocol v3 (or has not started and pidfd served):
                            one request per allocation */
    uint32_t shared;     /* of handles, those the owner's stream brought again (one segment under two
                            allocations of a stream-ordered pool): mapped again, imported once */
} vmm_import_many_timing;

/* vmm_import_copy's sink: each piece in order, with the bytes handed over before it. */
typedef int (*vmm_sink_fn)(void *ctx, const void *data, uint64_t length, uint64_t done);

/* ---- Named tensors (the owner side: the shim defines these functions) ---- */
#define VMM_NAME_MAX 127
#define VMM_MAX_DIMS 8

/* An element type: DLPack's DLDataType (dlpack.h), code as DLDataTypeCode numbers it. */
typedef struct vmm_dtype {
    uint8_t code; /* VMM_DTYPE_*, or any other DLDataTypeCode */
    uint8_t bits; /* bits per lane */
    uint16_t lanes; /* 1 for scalars */
} vmm_dtype;
enum {
    VMM_DTYPE_INT = 0,
    VMM_DTYPE_UINT = 1,
    VMM_DTYPE_FLOAT = 2,
    VMM_DTYPE_BFLOAT = 4,
    VMM_DTYPE_COMPLEX = 5,
    VMM_DTYPE_BOOL = 6,
    VMM_DTYPE_FLOAT8_E4M3FN = 10,
    VMM_DTYPE_FLOAT8_E5M2 = 12
};

/* One tensor of vmm_publish_many. */
typedef struct vmm_tensor_desc {
    const char *name;
    uint64_t address;       /* the device pointer of its first element */
    vmm_dtype dtype;
    uint32_t ndim;          /* 0 (a scalar) .. VMM_MAX_DIMS */
    const int64_t *shape;   /* ndim extents */
    const int64_t *strides; /* ndim strides in elements; NULL: row-major, contiguous */
} vmm_tensor_desc;

/* A tensor that is one piece of a larger one laid over a device mesh (PyTorch's DTensor, whose
 * local tensor is published): along each mesh dimension, how the whole tensor is placed and where
 * this piece sits.  A split is torch.chunk's: pieces of ceil(global_extent / mesh) along dim. */
#define VMM_MESH_MAX_DIMS 3
enum { VMM_PLACE_NONE = 0, VMM_PLACE_REPLICATE = 1, VMM_PLACE_PARTIAL = 2, VMM_PLACE_SHARD = 3 };
typedef struct vmm_placement {
    uint8_t kind;          /* VMM_PLACE_* */
    uint8_t dim;           /* VMM_PLACE_SHARD: the tensor dimension split */
    uint16_t mesh;         /* the mesh's extent along this mesh dimension */
    uint16_t coord;        /* this piece's coordinate along it */
    uint16_t reserved;
    int64_t global_extent; /* VMM_PLACE_SHARD: the whole tensor's extent along dim */
} vmm_placement;
typedef struct vmm_shard {
    uint32_t mesh_ndim;    /* 0: a whole tensor; else 1..VMM_MESH_MAX_DIMS */
    uint32_t reserved;
    vmm_placement place[VMM_MESH_MAX_DIMS];
} vmm_shard;

/* Publish one tensor by name (owner side). */
vmm_status vmm_publish(const char *name, uint64_t address, vmm_dtype dtype, uint32_t ndim, const int64_t *shape,
                       const int64_t *strides);
/* Publish n tensors at once, all or none (a state dict): one failure leaves every name as it was. */
vmm_status vmm_publish_many(const vmm_tensor_desc *tensors, size_t n);
/* vmm_publish_many with each tensor's place in a larger one (shards may be NULL: all whole) and the
 * version they are published at (0: none), which a reader sees per name. */
vmm_status vmm_publish_shards(const vmm_tensor_desc *tensors, const vmm_shard *shards, size_t n, uint64_t version);
/* The job tag (at most 23 bytes; NULL or "" clears it) under which companions find this process
 * with the other ranks of its job (vmm_weights_state). */
vmm_status vmm_publish_job(const char *job);
/* The owner is about to change its published tensors in place (an optimizer step): readers that
 * check vmm_weights_state around their copies see it and copy again.  vmm_update_end marks the
 * change done, at `version`, once `stream` (a CUstream of the current context; NULL: the legacy
 * default stream) has reached the point where it is called: the call itself does not wait.
 * Nested begins end with the last end. */
vmm_status vmm_update_begin(void);
vmm_status vmm_update_end(uint64_t version, void *stream);
/* Drop a name (owner side); VMM_ERR_NOT_FOUND when this process does not publish it. */
vmm_status vmm_unpublish(const char *name);
/* The calling thread's last failure of the three above, one line; "" when none. */
const char *vmm_publish_error(void);

/* The calling thread's tag (owner side).  What the shim backs while a thread tag is set carries it
 * in its record (vmmctl list's TAG) instead of VMMSHIM_TAG, and comes from pools of that tag's own:
 * a tag's allocations never share a segment with another's, so pausing the tag gives whole
 * segments back.  NULL or "" clears it.  Returns the previous tag (NULL: none), a string valid for
 * the life of the process, so that vmm_set_thread_tag(previous) restores it.  A tag of 32 bytes or
 * more, or a 33rd distinct tag, leaves the thread's tag as it was (one warning line, and
 * vmm_publish_error() says why).  Not under the shim (the client library's): NULL, nothing set. */
const char *vmm_set_thread_tag(const char *tag);
/* The calling thread's tag; NULL when none is set (or not under the shim). */
const char *vmm_thread_tag(void);

/* ---- Sleep and wake (the owner side: the shim defines these functions) ---- */
/* vmm_pause flags.  Neither: the contents are kept in host memory (pinned for allocations of 1 MiB or
 * more, pageable below; the pinned buffers stay after the resume for the next pause, within
 * VMMSHIM_PAUSE_HOST_CACHE). */
enum {
    VMM_PAUSE_DISCARD = 1u << 0, /* nothing is copied: resumed memory holds undefined bytes (a KV cache) */
    VMM_PAUSE_FILE = 1u << 1     /* the contents go to an unlinked file in VMMSHIM_PAUSE_DIR */
};

/* What one vmm_pause_ex / vmm_resume_ex did.  The call fills the first report_size bytes, so a
 * caller built against an older, shorter struct gets what it knows; fields are only ever appended. */
typedef struct vmm_sleep_report {
    uint64_t bytes_released; /* pause: physical bytes given back to the device; resume: bytes mapped again */
    uint64_t bytes_kept;     /* pause: contents copied to host memory or the file; resume: copied back */
    uint64_t bytes_not_shim; /* this process's device memory the shim does not own, left on the device
                                (allocations of the real allocator: during a capture, with the device full;
                                and the tag's memory the program made itself with cuMemCreate unless
                                VMMSHIM_SLEEP_ADOPTED=1 gave it stand-in handles) */
    uint64_t ns;             /* how long the call took */
    uint64_t segments;       /* physical handles released (pause) or made (resume) */
    uint64_t allocations;    /* live allocations paused or resumed */
    /* Appended (a caller passing the shorter struct's size gets the six fields above only).  Pause:
     * of bytes_released, the bytes companions still held after the wait (VMMSHIM_PAUSE_HOLD_WAIT_MS)
     * with live imports of it; the device gets them back when those let go.  0 for a resume. */
    uint64_t bytes_held;
    uint32_t n_holders;      /* how many processes hold them */
    uint32_t holders[8];     /* the first n_holders (at most 8) of their pids */
    /* Appended in the struct's tail padding (its size stays 96, so a caller of the older struct
     * passing sizeof gets it written where it reads nothing): VMM_SLEEP_HOLDERS_UNKNOWN when
     * bytes_held and n_holders are 0 because nobody could say, not because nobody holds: a pause
     * from outside (vmm_pause_process) of an owner whose shim predates reporting them. */
    uint32_t flags;
} vmm_sleep_report;
#define VMM_SLEEP_HOLDERS_UNKNOWN 1u /* vmm_sleep_report.flags */

vmm_status vmm_pause(const char *tag, unsigned flags);
vmm_status vmm_resume(const char *tag);
vmm_status vmm_pause_ex(const char *tag, unsigned flags, vmm_sleep_report *report, size_t report_size);
vmm_status vmm_resume_ex(const char *tag, vmm_sleep_report *report, size_t report_size);
/* Ahead of a first kept pause: the pinned host buffers a pause of tag (NULL: everything) would make
 * for its live allocations now are made now, on several threads, holding no lock of the shim's
 * while they are made (the program allocates and frees meanwhile), so that the pause copies at
 * once.  Returns when they are made (call it on a thread of its own to have it in the background);
 * *bytes_ready (may be NULL): the bytes made ready.  They count in VMMSHIM_PAUSE_HOST_CACHE, and go
 * with their allocations. */
vmm_status vmm_pause_prepare(const char *tag, uint64_t *bytes_ready);
/* Whether any of the n ranges [starts[i], starts[i] + sizes[i]) overlaps memory of this process
 * that is paused now: 1 or 0 (0 too when not under the shim).  A framework's allocator asks it of
 * the blocks it would hand out (vmmshim's Python side: PyTorch's default pool's segments). */
int vmm_paused_overlaps(const uint64_t *starts, const uint64_t *sizes, size_t n);
/* The host copy of this process's byte at addr: the contents a kept pause holds in host memory, or,
 * once resumed, the pinned buffer that allocation keeps for its next pause (VMMSHIM_PAUSE_HOST_CACHE),
 * which holds what its last pause copied.  *host: the copy of that byte; *bytes: how many of the
 * allocation's bytes follow it contiguously there.  VMM_ERR_NOT_FOUND when host memory holds no copy
 * of it (awake with no buffer kept, discarded, kept in a file, not the shim's memory). */
vmm_status vmm_sleep_host(uint64_t addr, void **host, uint64_t *bytes);
/* Free the pinned buffers that the awake allocations under tag (NULL: all) keep for their next kept
 * pause, so that host memory holds nothing between cycles (at the cost of pinning anew at the next
 * pause); paused contents are untouched.  Returns the bytes freed. */
uint64_t vmm_sleep_drop_host(const char *tag);
/* What cudaMalloc freed and the shim still holds for quick reuse (VMMSHIM_GIVE_BACK_HOLD, for
 * VMMSHIM_GIVE_BACK_MS) goes back to the device now, beyond VMMSHIM_CACHE_SIZE; for a program that
 * just emptied its own cache and wants the device to see it.  Returns the bytes given back. */
uint64_t vmm_give_back(void);
/* From now on the shim's pools make no new memory that would leave the device with less than
 * `bytes` free (cuMemGetInfo): such an allocation fails with out-of-memory, as one the device
 * cannot hold (torch_memory_saver's memory_margin_bytes).  0 (the default) turns it off.  Memory
 * the program maps itself (expandable_segments) is not checked. */
void vmm_set_alloc_margin(uint64_t bytes);
/* torch_memory_saver's C entry points tms_pause(tag) and tms_resume(tag), which the shim exports
 * for programs that call them through the process's symbols, go to these once set (vmmshim's
 * stand-in for that module sets its own); before, they pause what TMS_INIT_ENABLE=1 makes TMS's. */
void vmm_tms_entries(int (*pause)(const char *tag), int (*resume)(const char *tag));
/* The calling thread's last failure of the calls above, one line; "" when none. */
const char *vmm_sleep_error(void);

#ifdef __cplusplus
}
#endif
#endif
