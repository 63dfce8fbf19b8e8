/* vmmshim registry: the shared-memory layout.  This file is the whole contract for a reader in
 * any language; nothing else is needed to read the registry.
 *
 * WHERE: a POSIX shared-memory object (/dev/shm/<name>), name from VMMSHIM_REGISTRY, default
 * "/vmmshim-<uid>", mode 0600 (0660 when VMMSHIM_REGISTRY_GROUP names a group).  All integers are
 * little-endian fixed-width; every reference is an offset from the start of the segment, never a
 * pointer.  The file is never shrunk (readers would get SIGBUS); it is created sparse and pages
 * are allocated (fallocate) as chunks of records are first used.
 *
 *   0                 header_size        proc_off           chunk_off       index_off      rec_off
 *   +-----------------+------------------+------------------+---------------+--------------+----------------------+
 *   | vmm_reg_header  | (reserved)       | proc_capacity x  | chunk_count x | index_slots x| capacity x           |
 *   | 512 bytes       |                  | vmm_reg_proc     | u64 owner     | u32 entry    | vmm_reg_alloc        |
 *   +-----------------+------------------+------------------+---------------+--------------+----------------------+
 *
 * OPENING (readers):  map the object read-only.  Refuse unless magic == VMM_REG_MAGIC, ready == 1,
 * compat_version <= the version you implement, header_size is at least the size you know, the
 * record sizes equal the sizes you know (a layout with other record sizes raises compat_version),
 * and every region lies inside the object's size.  Never guess at a layout you do not know.
 * Header bytes beyond the size you know are for newer versions: skip them.
 *
 * READING A RECORD (vmm_reg_alloc or vmm_reg_proc) -- a sequence counter, like Linux's
 * perf_event_mmap_page:
 *     do {
 *         s1 = load_acquire(&rec->seq);
 *         if (s1 & 1) { retry, at most a few thousand times, then treat the record as busy }
 *         copy the record with 8-byte loads (relaxed atomics in C/C++/Rust);
 *         fence_acquire();
 *         s2 = load_relaxed(&rec->seq);
 *     } while (s1 != s2);
 * An odd seq means a write is in progress.  A seq that stays odd means the writer died mid-write:
 * check the owner (below) and treat the record as dead.  A reader walking many records bounds its
 * waiting for all of them together (some tens of milliseconds), not per record: a corrupt or
 * hostile segment may hold millions of odd ones.  The writer increments seq (relaxed
 * store), issues a release fence, writes the fields with 8-byte stores, then stores seq+1 again
 * with release.  The counters of vmm_reg_proc (n_allocs... and the coverage counters below) are
 * outside that protocol: plain 8-byte atomic loads.
 *
 * COVERAGE (vmm_reg_proc 440..499, layout version 3; 504..511, version 6): what became of the process's allocations
 * since it started, kept with relaxed atomic adds, so a reader may see one counter ahead of
 * another.  allocs counts allocation calls that made an allocation (cudaMalloc, cudaMallocAsync,
 * cuMemAlloc, cuMemAllocAsync, cuMemAllocPitch; zero bytes or a failed call is none):
 * allocs == allocs_backed + passed_capture + passed_device_full + passed_unsupported, where
 *   allocs_backed        the shim's VMM pool backed it: exportable (published unless the registry is full)
 *   passed_capture       its stream was being captured into a graph: the real pool's memory
 *   passed_device_full   the pool could not grow even after giving back its empty chunks: the real allocator's
 *   passed_unsupported   the device lacks VMM or POSIX-fd export, a pool of the program's own was
 *                        current (stream-ordered calls), the driver refused the shim's VMM calls
 *                        for another reason, or it would not tell cuMemAllocPitch's pitch
 * (a process in which the shim is disabled, VMMSHIM_ENABLE=0 or a failed start, never registers:
 * VMMSHIM_STATS=1 reports its passed-through allocations).  unpublished (version 6) counts those
 * of allocs_backed that got no record, the registry being full (or its record not being
 * writable): they work, and are exportable, but no companion can find them; unpublished <=
 * allocs_backed.  maps_adopted counts ranges the
 * program mapped itself (cuMemMap) from handles the shim made exportable; they are not
 * allocations.  peak_requested is the highest bytes_requested has been: the peak of what the
 * program asked for among the memory it has records of (the shim's, what it noted for capture
 * or a full device, adopted ranges; not what it passed through as unsupported, which it does
 * not publish).  The counters are meaningful only while stats_generation == generation: a
 * writer of layout version 2 leaves 440..511 alone, so a slot it claims may hold an earlier
 * owner's values, and there stats_generation names that earlier generation.  stats_generation is
 * written with the identity, under seq.  unpublished came later, in bytes that were reserved:
 * writers of versions 3 to 5 never write it, so their records read 0 there (a reader of those
 * versions skips it).  A writer of version 6 zeroes it with the other counters when it claims a
 * slot, when it leaves it and when its gc reclaims it, so that a slot an older writer claims
 * after it reads 0 too; only a version-6 owner that died and was reclaimed by an older gc, in a
 * registry writers of both versions share, can leave a stale value to an older claimant.
 *
 * OWNERS AND LIVENESS: a record's owner is (pid, start_time, pidns).  A process is alive iff
 * /proc/<pid>/stat exists in a reader sharing pidns (compare the inode of /proc/self/ns/pid) and
 * its field 22 (starttime, clock ticks since boot) equals start_time.  Never judge by pid alone:
 * pids are reused.  A reader in another pid namespace cannot judge and must say "unknown".
 *
 * RECORDS never move while bound.  Records come in record chunks of chunk_records slots; the
 * chunk table holds each chunk's owner as (proc_generation << 32 | (proc_index + 1)), 0 = free,
 * bit 63 set while a reclaimer clears it.  A process writes only its own chunks' records.
 *
 * ALLOCATIONS AND CHUNKS: one record per live allocation.  An allocation lives inside a chunk (one
 * exportable CUDA VMM handle, mapped at chunk address - chunk_offset in the owner, mapped_size
 * bytes); small allocations share chunks.  To import one, obtain the chunk's handle (handle_kinds),
 * map mapped_size bytes, and use base + chunk_offset.  chunk_id names the chunk within its owner and
 * is never reused, so (owner, chunk_id) keys a cache of imported chunks.  extent is the bytes of the
 * chunk the allocation occupies (>= requested_size): the allocation covers [address, address+extent).
 *
 * MULTI-HANDLE (layout version 4): the owner's pool maps many handles into one address range, so
 * free space merges across them, and an allocation may span several.  Such a record has
 * VMM_REG_F_MULTI_HANDLE and n_handles >= 2: its "chunk" is n_handles handles mapped back to back
 * in the owner, chunk_id names the first, chunk_offset is address - the first handle's base, and
 * mapped_size is the sum of their sizes.  An importer obtains every handle (the broker's protocol
 * v2 hands them out in order, with their sizes), maps each whole handle at its place in one
 * reservation of mapped_size bytes, and uses base + chunk_offset.  pidfd and fabric export name
 * one handle: such a record offers VMM_HANDLE_BROKER only.  A reader of an older version sees
 * mapped_size larger than the one handle it gets, and its import fails: it must not guess.
 *
 * PAUSED (layout version 7): the owner paused the allocation's memory (vmm_pause): its physical
 * handles are released, its address stays reserved in the owner.  The owner sets
 * VMM_REG_F_PAUSED and clears handle_kinds and exported_fd in one seq-protected write; the record
 * stays live (same slot, generation and alloc_id: names published on it stay).  A reader must
 * not import it (the broker refuses its segments with -EHOSTDOWN).  At resume the owner clears
 * the flag, restores handle_kinds (and exported_fd, fabric) and writes a new chunk_id, in one
 * write: the memory under it is new, so a mapping an importer cached under the old chunk_id must
 * not serve it.  A reader of an older version sees handle_kinds 0 while paused (not exportable)
 * and a new chunk_id afterwards.  The process's paused bytes are no field of its record (every
 * byte of vmm_reg_proc is taken, and a larger record would raise compat_version): a reader sums
 * the extents of its records flagged paused.
 *
 * FINDING (pid, address) without scanning: a record's level is g = max(8, ceil(log2(extent)));
 * its key is (address rounded down to 2^g) | g, and the index holds one entry per bound record,
 * under vmm_reg_hash(pid, key).  Since extent <= 2^g, the allocation covering A, if any, starts in
 * the 2^g-block of A or the one before.  So for g = 8 .. 47 and for B in {A & ~(2^g-1), that - 2^g}:
 * look up key B | g: linear probing over index_slots u32 entries from vmm_reg_hash(pid, B | g) &
 * (index_slots - 1) until an EMPTY entry; skip TOMB entries; any other entry is record index + 1.
 * Check each candidate record (seq protocol): pid, level g, address rounded down to 2^g == B,
 * state LIVE, address <= A < address + extent.  Entries never move while readers look: a removed
 * entry becomes TOMB, and TOMBs turn back into EMPTY only at the end of a run (just before an EMPTY
 * entry), which cuts no other entry's run.  Only a rebuild (vmm_gc) moves entries: it brackets the
 * work by incrementing index_seq (odd while rebuilding), and a reader whose search found nothing
 * retries if index_seq was odd or changed meanwhile, for some tens of milliseconds at most (an
 * index_seq that stays odd means a rebuild died: report "busy" rather than wait for it).
 *
 * FRAMES: vmm_reg_alloc.frames[] are raw return addresses in the owner, the innermost first (the
 * shim's own frames left out).  With VMMSHIM_FRAMES > 0 the owner also keeps a text file beside
 * the registry, the shm object VMM_REG_FRAMES_NAME (registry name, owner pid, owner start_time;
 * as readable as the registry), which names each address it recorded once, on one line:
 *     0x<address> 0x<offset from the module's base> <function, or ?> <module path to the end of the line>
 * after a first line VMM_REG_FRAMES_HEADER; lines starting with '#' are comments.  The module's
 * base is where its ELF header is mapped (dladdr's dli_fbase); the function is the exported
 * symbol whose extent holds the address, else "?" (a reader may look in the module's .symtab,
 * at offset + the first PT_LOAD's p_vaddr - p_offset).  An address missing from the file (the
 * file was full, or the address is in no module) has no line: a reader of a living owner may
 * look in /proc/<pid>/maps.  The owner removes the file at exit; gc removes those of the dead
 * owners it reclaims.
 *
 * NAMES (named tensors): an owner that publishes names for its tensors (vmm_publish, Python's
 * vmmshim.publish) keeps them in a table of its own beside the registry, the shm object
 * VMM_REG_NAMES_NAME (registry name, owner pid, owner start_time; as readable as the registry),
 * made at its first publish (whole under that name with ".tmp" appended, then renamed into place:
 * a reader finds a complete table or none) and removed at its exit (gc removes a dead owner's).
 * No such object: the owner publishes no names.  The registry's own layout is untouched by it.
 *   0                header_size
 *   +----------------+------------------------------------------+
 *   | vmm_names_header | capacity x vmm_names_entry (384 bytes)  |
 *   +----------------+------------------------------------------+
 * Open it read-only and refuse unless magic == VMM_NAMES_MAGIC, ready == 1, compat_version <= the
 * version you implement, entry_size equals the size you know, header_size >= 128, the object
 * holds header_size + capacity x entry_size bytes, used <= capacity, and pid and start_time are
 * the owner's.  Read entries [0, used) only (the rest may be holes of the sparse object), each
 * with the seq protocol of READING A RECORD.  An entry with state VMM_NAMES_LIVE names the tensor
 * whose first element is at address in the owner: nbytes bytes from there hold it (shape and
 * strides, in elements, as DLPack counts them: nbytes = itemsize x (1 + sum((shape[i] - 1) x
 * strides[i])), itemsize = bits x lanes / 8; no negative strides; ndim <= VMM_NAMES_MAX_DIMS).
 * dtype is DLPack's DLDataType (code as dlpack.h 1.1 numbers DLDataTypeCode).  A name is 1 to
 * VMM_NAMES_NAME_MAX bytes (UTF-8, no byte below 0x20 nor 0x7f), NUL-terminated, unique among the
 * live entries of one owner: publishing a name again rewrites its entry in place.
 * A live entry counts only while (1) its owner is alive (OWNERS AND LIVENESS) and (2) the
 * registry record at rec_slot, read with the seq protocol, is LIVE with the owner's pid and
 * start_time, the entry's alloc_id, and address <= entry.address < address + extent.  The owner
 * drops a name when any allocation under its nbytes is freed; (2) keeps a reader from serving a
 * name its owner died holding, or one left by a publish racing a free.  changes counts the
 * owner's changes to the table and is odd while one (a publish of several names, a drop of all
 * the names of a freed allocation) is in progress: a reader wanting every name of one moment
 * loads it (acquire) before the walk and (after an acquire fence) again after, and walks again
 * if it was odd or moved, for some tens of milliseconds at most.  Only the owner writes the table.
 * SHARDS: an entry with mesh_ndim > 0 is the owner's part of a larger tensor laid over a device
 * mesh (PyTorch's DTensor; FSDP2's parameters): along mesh dimension i of extent mesh[i] the owner
 * sits at coord[i], and the tensor is replicated there (REPLICATE), a partial sum (PARTIAL), or
 * split along its dimension place_dim[i] (SHARD), whose whole extent is global_extent[i].  A split
 * is torch.chunk's: pieces of ceil(extent / mesh[i]) along the dimension, the last ones shorter or
 * empty; splits of one dimension by several mesh dimensions nest in mesh order.  The entry's shape
 * is the owner's piece; the padding FSDP keeps after a short piece is not part of it.
 * VERSIONS: weights_seq is a seqlock over the tensors' contents, not the table: the owner makes it
 * odd before it starts changing them in place (an optimizer step) and even, with weights_version
 * stored before it (release), once the device has done so.  A reader wanting one version of every
 * owner's tensors loads each owner's weights_seq (acquire) and weights_version before its copies
 * and weights_seq again after they completed: all even, equal before and after and the versions
 * equal, or it copies again.  An owner that never updates leaves them 0.
 *
 * KEEP (layout version 5): a keeper (`vmmctl keep`) is a companion that holds an owner's memory (the
 * fds of its chunks, fetched from the owner's broker as any companion fetches them) so that it
 * outlives the owner.  For each owner it keeps, it makes the shm object VMM_REG_KEEP_NAME (registry
 * name, owner pid, owner start_time; as readable and writable as the registry), a vmm_keep_file,
 * and holds an open-file-description write lock (F_OFD_SETLK) on its byte 0 for as long as it
 * keeps that owner.  The kernel drops the lock when the keeper dies, so "a living keeper keeps this
 * owner" reads: the object exists, names the owner, and F_OFD_GETLK on its byte 0 finds a write
 * lock (pid reuse cannot fake it).  A second keeper of the same owner finds the lock taken.  While
 * it keeps the owner the keeper stores its pid in the owner's vmm_reg_proc.keeper_pid (an atomic
 * store outside the seq protocol, like the counters; 0 = none; a value left by a keeper that died
 * is judged by the lock), so that the owner tells with one load whether anybody keeps it.
 * While the owner lives, memory it gives back must reach the device as it would without a keeper:
 * the keeper drops (closes the fds of) a chunk within its tick (10 ms) of the registry showing no
 * live allocation in it.  The owner rings the keeper (bell += 1, FUTEX_WAKE on bell: a shared
 * futex) when it gives a segment back, and before it fails for lack of memory it rings and waits
 * (FUTEX_WAIT on done, 2 s at most: as long as the pass takes) until done reaches its ring: the keeper
 * stores in done the bell value it read before a pass over the registry that dropped every chunk
 * without a live allocation.  An owner waits only while heartbeat_ns (CLOCK_MONOTONIC, stored by
 * the keeper every tick) is less than a second old.  When an owner that a living keeper keeps
 * calls exit() with a status other than 0, it stores exit_status (and exit_seen = 1) and leaves
 * its records, its name table and its frames file in place, as a crash leaves them.
 * When the owner has died, the keeper sets VMM_REG_F_KEPT (seq protocol) on each of its records
 * whose memory it holds, rewrites the owner's vmm_reg_proc.broker_path (seq protocol) to its own
 * socket, which answers the broker protocol (shim/broker/protocol.h) for those records, and sets
 * state VMM_KEEP_KEPT with how the owner ended.  A reader judges a dead owner's record with
 * VMM_REG_F_KEPT whose keep file is locked "kept": it imports it through broker_path as from a
 * living owner.  gc reclaims none of a kept owner's records, nor its proc slot, name table or
 * frames file; it removes the keep file of an owner it reclaims, and every keep file beside the
 * registry that no keeper locks.  Only the keeper writes the file, except bell and exit_* (the
 * owner) and bell and release (`vmmctl release`, asking the keeper to let go).
 *
 * LOCKS: readers take none.  Index writers exclude each other with index_lock, a word in the
 * header: 0 = free, else (holder's proc generation << 32) | (holder's proc index + 1), taken by CAS
 * and held for a few index stores.  A waiter may take it over when the holder's proc slot has moved
 * on or its owner is dead (liveness, below), or after 2 s when liveness is unknown.  Segment
 * creation and reclamation use open-file-description locks (fcntl F_OFD_SETLKW), which the kernel
 * drops when their holder dies: byte VMM_REG_LOCK_INIT while creating the segment, byte
 * VMM_REG_LOCK_GC while reclaiming dead owners.
 */
#ifndef VMM_REGISTRY_LAYOUT_H
#define VMM_REGISTRY_LAYOUT_H
#include <stddef.h>
#include <stdint.h>

#define VMM_REG_MAGIC 0x4745525348534d56ull /* "VMMSHREG" little-endian */
/* 3: the coverage counters of vmm_reg_proc, in bytes that were reserved (zero) before: a
 * version-2 reader reads a version-3 segment as it always did, so compat_version stays 2.  The
 * version still moves on so that a reader can tell a segment made by a writer that knows them;
 * since writers of both versions may share one segment, each record says for itself
 * (stats_generation).  4: MULTI-HANDLE records (n_handles at 320, in bytes that were reserved).
 * 5: KEEP (keeper_pid at 500 of the proc record, VMM_REG_F_KEPT, the keep files).  6: the
 * unpublished counter at 504 of the proc record (COVERAGE), in bytes that were reserved.  7:
 * VMM_REG_F_PAUSED (PAUSED); no offset moved. */
#define VMM_REG_VERSION 7u
#define VMM_REG_COMPAT_VERSION 2u /* 2: one record per pooled allocation, index by level */
#define VMM_REG_CHUNK_RECORDS 64u
#define VMM_REG_MIN_LEVEL 8u  /* 256 bytes */
#define VMM_REG_MAX_LEVEL 47u /* 128 TiB */
#define VMM_REG_IX_EMPTY 0u
#define VMM_REG_IX_TOMB 0xffffffffu
#define VMM_REG_LOCK_INIT 0
#define VMM_REG_LOCK_GC 2
#define VMM_REG_CHUNK_RECLAIMING (1ull << 63)
#define VMM_REG_FRAMES_NAME "%s.frames.%u.%llu" /* registry name, pid, start_time (FRAMES) */
#define VMM_REG_FRAMES_HEADER "# vmmshim frames 1: address offset function module"
#define VMM_REG_NAMES_NAME "%s.names.%u.%llu" /* registry name, pid, start_time (NAMES) */
#define VMM_REG_KEEP_NAME "%s.keep.%u.%llu"   /* registry name, owner pid, owner start_time (KEEP) */
#define VMM_KEEP_MAGIC 0x5045454b534d4d56ull /* "VMMSKEEP" little-endian */
#define VMM_KEEP_VERSION 1u
#define VMM_NAMES_MAGIC 0x4d414e48534d4d56ull /* "VMMSHNAM" little-endian */
/* 2: shards, versions and the job tag (SHARDS, VERSIONS), in bytes that were reserved (zero): a
 * version-1 reader reads a version-2 table as it always did, so compat_version stays 1. */
#define VMM_NAMES_VERSION 2u
#define VMM_NAMES_COMPAT_VERSION 1u
#define VMM_NAMES_MESH_MAX_DIMS 3u
#define VMM_NAMES_NAME_MAX 127u /* bytes of a name, without its NUL */
#define VMM_NAMES_MAX_DIMS 8u

/* vmm_names_entry.place_kind */
enum { VMM_NAMES_PLACE_NONE = 0, VMM_NAMES_PLACE_REPLICATE = 1, VMM_NAMES_PLACE_PARTIAL = 2, VMM_NAMES_PLACE_SHARD = 3 };

/* vmm_reg_alloc.state */
enum { VMM_REG_UNBOUND = 0, VMM_REG_BOUND = 1, VMM_REG_LIVE = 2 };

/* vmm_reg_alloc.handle_kinds: how a companion can obtain the memory */
enum {
    VMM_HANDLE_BROKER = 1u << 0, /* ask the owner's broker socket (vmm_reg_proc.broker_path) */
    VMM_HANDLE_PIDFD = 1u << 1,  /* pidfd_getfd(owner, exported_fd) */
    VMM_HANDLE_FABRIC = 1u << 2  /* fabric[] bytes, cuMemImportFromShareableHandle(FABRIC) */
};

/* vmm_reg_alloc.flags */
enum {
    VMM_REG_F_NOT_EXPORTABLE = 1u << 0, /* passed through (e.g. during stream capture) */
    VMM_REG_F_SHARED_CHUNK = 1u << 1,   /* its chunk may hold other allocations of the same owner */
    VMM_REG_F_MULTI_HANDLE = 1u << 2,   /* its chunk is n_handles handles back to back (MULTI-HANDLE) */
    VMM_REG_F_KEPT = 1u << 3,           /* its owner died and a keeper holds its memory (KEEP) */
    VMM_REG_F_PAUSED = 1u << 4          /* its owner paused its memory (PAUSED): nothing to import until resumed */
};

/* vmm_reg_alloc.api: the call that made the allocation */
enum {
    VMM_API_UNKNOWN = 0,
    VMM_API_CUDA_MALLOC = 1,
    VMM_API_CUDA_MALLOC_ASYNC = 2,
    VMM_API_CU_MEM_ALLOC = 3,
    VMM_API_CU_MEM_ALLOC_ASYNC = 4,
    VMM_API_CU_MEM_ALLOC_PITCH = 5,
    VMM_API_CU_MEM_MAP = 6, /* a range the program mapped itself (cuMemCreate + cuMemMap) */
    VMM_API_TEST = 15
};

typedef struct vmm_reg_header {
    uint64_t magic;            /*   0 */
    uint32_t version;          /*   8 layout version of the writer */
    uint32_t compat_version;   /*  12 lowest reader version that can read it */
    uint32_t header_size;      /*  16 */
    uint32_t ready;            /*  20 1 once initialised (release store) */
    uint32_t proc_size;        /*  24 sizeof(vmm_reg_proc) */
    uint32_t alloc_size;       /*  28 sizeof(vmm_reg_alloc) */
    uint32_t chunk_records;    /*  32 */
    uint32_t proc_capacity;    /*  36 */
    uint64_t capacity;         /*  40 allocation records */
    uint64_t chunk_count;      /*  48 */
    uint64_t index_slots;      /*  56 power of two */
    uint64_t proc_off;         /*  64 */
    uint64_t chunk_off;        /*  72 */
    uint64_t index_off;        /*  80 */
    uint64_t rec_off;          /*  88 */
    uint64_t total_size;       /*  96 */
    uint64_t created_ns;       /* 104 CLOCK_REALTIME */
    uint64_t chunks_hwm;       /* 112 chunks ever handed out by bump allocation (atomic) */
    uint64_t index_seq;        /* 120 odd while the index is rebuilt */
    uint64_t stat_publishes;   /* 128 total publishes (atomic) */
    uint64_t stat_retracts;    /* 136 total retracts (atomic) */
    uint64_t stat_reclaimed;   /* 144 records reclaimed from dead owners (atomic) */
    uint32_t creator_pid;      /* 152 */
    uint32_t creator_uid;      /* 156 */
    uint64_t index_lock;       /* 160 index writers' lock word (LOCKS below) */
    uint8_t reserved[344];     /* 168 */
} vmm_reg_header;              /* 512 */

typedef struct vmm_reg_proc {
    uint64_t claim;            /*   0 (generation << 32) | pid; pid 0 = free slot (CAS) */
    uint32_t seq;              /*   8 sequence counter over the fields up to the counters, and stats_generation */
    uint32_t pid;              /*  12 in the owner's pid namespace */
    uint64_t start_time;       /*  16 /proc/<pid>/stat field 22 */
    uint64_t pidns;            /*  24 inode of the owner's /proc/self/ns/pid */
    uint64_t registered_ns;    /*  32 CLOCK_REALTIME */
    uint32_t uid;              /*  40 */
    uint32_t generation;       /*  44 equals claim >> 32 */
    char broker_path[112];     /*  48 Unix socket of the owner's broker; "" = none yet */
    char cmdline[256];         /* 160 NUL-separated argv, truncated */
    uint64_t n_allocs;         /* 416 live counters, atomic, outside the seq protocol */
    uint64_t bytes_requested;  /* 424 */
    uint64_t bytes_mapped;     /* 432 sum of the live allocations' extents */
    uint64_t allocs;           /* 440 coverage (COVERAGE above), cumulative, atomic, outside seq */
    uint64_t allocs_backed;    /* 448 */
    uint64_t passed_capture;   /* 456 */
    uint64_t passed_device_full; /* 464 */
    uint64_t passed_unsupported; /* 472 */
    uint64_t maps_adopted;     /* 480 */
    uint64_t peak_requested;   /* 488 highest bytes_requested, in bytes */
    uint32_t stats_generation; /* 496 == generation when the counters 440..495 and 504 are this owner's */
    uint32_t keeper_pid;       /* 500 the keeper that keeps this process (KEEP), 0 = none; atomic, outside seq */
    uint64_t unpublished;      /* 504 of allocs_backed, those the registry had no room for (COVERAGE, version 6) */
} vmm_reg_proc;                /* 512 */

typedef struct vmm_reg_alloc {
    uint32_t seq;              /*   0 sequence counter; odd while written */
    uint32_t state;            /*   4 VMM_REG_UNBOUND / BOUND / LIVE */
    uint64_t generation;       /*   8 changes at every publish and retract */
    uint8_t alloc_id[16];      /*  16 random, never reused */
    uint32_t proc_index;       /*  32 owner's slot in the proc table */
    uint32_t pid;              /*  36 */
    uint64_t start_time;       /*  40 */
    uint64_t pidns;            /*  48 */
    uint32_t device;           /*  56 ordinal in the owner */
    uint32_t api;              /*  60 VMM_API_* */
    uint8_t device_uuid[16];   /*  64 */
    uint64_t address;          /*  80 owner's virtual address of the allocation */
    uint64_t requested_size;   /*  88 */
    uint64_t mapped_size;      /*  96 the chunk's mapped size: what an importer maps */
    uint64_t stream;           /* 104 for async allocations, the owner's stream handle */
    uint64_t created_ns;       /* 112 CLOCK_REALTIME */
    uint32_t handle_kinds;     /* 120 VMM_HANDLE_* */
    int32_t exported_fd;       /* 124 fd number in the owner when VMM_HANDLE_PIDFD, else -1 */
    uint32_t flags;            /* 128 VMM_REG_F_* */
    uint32_t n_frames;         /* 132 valid entries of frames[] */
    char tag[32];              /* 136 user tag, NUL-terminated */
    uint64_t frames[8];        /* 168 call-site return addresses in the owner */
    uint8_t fabric[64];        /* 232 CUmemFabricHandle when VMM_HANDLE_FABRIC */
    uint64_t chunk_id;         /* 296 the chunk within its owner, never reused (0 = none) */
    uint64_t chunk_offset;     /* 304 address - the chunk's base */
    uint64_t extent;           /* 312 bytes of the chunk the allocation occupies (the index's key) */
    uint32_t n_handles;        /* 320 handles back to back from the chunk's base (MULTI-HANDLE); 0 or 1: one */
    uint8_t reserved[60];      /* 324 */
} vmm_reg_alloc;               /* 384 */

#define VMM_ASSERT_OFF(T, f, o) _Static_assert(offsetof(T, f) == (o), #T "." #f " offset")
_Static_assert(sizeof(vmm_reg_header) == 512, "header size");
VMM_ASSERT_OFF(vmm_reg_header, magic, 0);
VMM_ASSERT_OFF(vmm_reg_header, version, 8);
VMM_ASSERT_OFF(vmm_reg_header, compat_version, 12);
VMM_ASSERT_OFF(vmm_reg_header, header_size, 16);
VMM_ASSERT_OFF(vmm_reg_header, ready, 20);
VMM_ASSERT_OFF(vmm_reg_header, proc_size, 24);
VMM_ASSERT_OFF(vmm_reg_header, alloc_size, 28);
VMM_ASSERT_OFF(vmm_reg_header, chunk_records, 32);
VMM_ASSERT_OFF(vmm_reg_header, proc_capacity, 36);
VMM_ASSERT_OFF(vmm_reg_header, capacity, 40);
VMM_ASSERT_OFF(vmm_reg_header, chunk_count, 48);
VMM_ASSERT_OFF(vmm_reg_header, index_slots, 56);
VMM_ASSERT_OFF(vmm_reg_header, proc_off, 64);
VMM_ASSERT_OFF(vmm_reg_header, chunk_off, 72);
VMM_ASSERT_OFF(vmm_reg_header, index_off, 80);
VMM_ASSERT_OFF(vmm_reg_header, rec_off, 88);
VMM_ASSERT_OFF(vmm_reg_header, total_size, 96);
VMM_ASSERT_OFF(vmm_reg_header, created_ns, 104);
VMM_ASSERT_OFF(vmm_reg_header, chunks_hwm, 112);
VMM_ASSERT_OFF(vmm_reg_header, index_seq, 120);
VMM_ASSERT_OFF(vmm_reg_header, stat_publishes, 128);
VMM_ASSERT_OFF(vmm_reg_header, stat_retracts, 136);
VMM_ASSERT_OFF(vmm_reg_header, stat_reclaimed, 144);
VMM_ASSERT_OFF(vmm_reg_header, creator_pid, 152);
VMM_ASSERT_OFF(vmm_reg_header, creator_uid, 156);
VMM_ASSERT_OFF(vmm_reg_header, index_lock, 160);
VMM_ASSERT_OFF(vmm_reg_header, reserved, 168);

_Static_assert(sizeof(vmm_reg_proc) == 512, "proc record size");
VMM_ASSERT_OFF(vmm_reg_proc, claim, 0);
VMM_ASSERT_OFF(vmm_reg_proc, seq, 8);
VMM_ASSERT_OFF(vmm_reg_proc, pid, 12);
VMM_ASSERT_OFF(vmm_reg_proc, start_time, 16);
VMM_ASSERT_OFF(vmm_reg_proc, pidns, 24);
VMM_ASSERT_OFF(vmm_reg_proc, registered_ns, 32);
VMM_ASSERT_OFF(vmm_reg_proc, uid, 40);
VMM_ASSERT_OFF(vmm_reg_proc, generation, 44);
VMM_ASSERT_OFF(vmm_reg_proc, broker_path, 48);
VMM_ASSERT_OFF(vmm_reg_proc, cmdline, 160);
VMM_ASSERT_OFF(vmm_reg_proc, n_allocs, 416);
VMM_ASSERT_OFF(vmm_reg_proc, bytes_requested, 424);
VMM_ASSERT_OFF(vmm_reg_proc, bytes_mapped, 432);
VMM_ASSERT_OFF(vmm_reg_proc, allocs, 440);
VMM_ASSERT_OFF(vmm_reg_proc, allocs_backed, 448);
VMM_ASSERT_OFF(vmm_reg_proc, passed_capture, 456);
VMM_ASSERT_OFF(vmm_reg_proc, passed_device_full, 464);
VMM_ASSERT_OFF(vmm_reg_proc, passed_unsupported, 472);
VMM_ASSERT_OFF(vmm_reg_proc, maps_adopted, 480);
VMM_ASSERT_OFF(vmm_reg_proc, peak_requested, 488);
VMM_ASSERT_OFF(vmm_reg_proc, stats_generation, 496);
VMM_ASSERT_OFF(vmm_reg_proc, keeper_pid, 500);
VMM_ASSERT_OFF(vmm_reg_proc, unpublished, 504);

_Static_assert(sizeof(vmm_reg_alloc) == 384, "alloc record size");
VMM_ASSERT_OFF(vmm_reg_alloc, seq, 0);
VMM_ASSERT_OFF(vmm_reg_alloc, state, 4);
VMM_ASSERT_OFF(vmm_reg_alloc, generation, 8);
VMM_ASSERT_OFF(vmm_reg_alloc, alloc_id, 16);
VMM_ASSERT_OFF(vmm_reg_alloc, proc_index, 32);
VMM_ASSERT_OFF(vmm_reg_alloc, pid, 36);
VMM_ASSERT_OFF(vmm_reg_alloc, start_time, 40);
VMM_ASSERT_OFF(vmm_reg_alloc, pidns, 48);
VMM_ASSERT_OFF(vmm_reg_alloc, device, 56);
VMM_ASSERT_OFF(vmm_reg_alloc, api, 60);
VMM_ASSERT_OFF(vmm_reg_alloc, device_uuid, 64);
VMM_ASSERT_OFF(vmm_reg_alloc, address, 80);
VMM_ASSERT_OFF(vmm_reg_alloc, requested_size, 88);
VMM_ASSERT_OFF(vmm_reg_alloc, mapped_size, 96);
VMM_ASSERT_OFF(vmm_reg_alloc, stream, 104);
VMM_ASSERT_OFF(vmm_reg_alloc, created_ns, 112);
VMM_ASSERT_OFF(vmm_reg_alloc, handle_kinds, 120);
VMM_ASSERT_OFF(vmm_reg_alloc, exported_fd, 124);
VMM_ASSERT_OFF(vmm_reg_alloc, flags, 128);
VMM_ASSERT_OFF(vmm_reg_alloc, n_frames, 132);
VMM_ASSERT_OFF(vmm_reg_alloc, tag, 136);
VMM_ASSERT_OFF(vmm_reg_alloc, frames, 168);
VMM_ASSERT_OFF(vmm_reg_alloc, fabric, 232);
VMM_ASSERT_OFF(vmm_reg_alloc, chunk_id, 296);
VMM_ASSERT_OFF(vmm_reg_alloc, chunk_offset, 304);
VMM_ASSERT_OFF(vmm_reg_alloc, extent, 312);
VMM_ASSERT_OFF(vmm_reg_alloc, n_handles, 320);
VMM_ASSERT_OFF(vmm_reg_alloc, reserved, 324);

/* NAMES: the header of an owner's name table, and one name. */
enum { VMM_NAMES_FREE = 0, VMM_NAMES_LIVE = 1 };

typedef struct vmm_names_header {
    uint64_t magic;            /*   0 VMM_NAMES_MAGIC */
    uint32_t version;          /*   8 */
    uint32_t compat_version;   /*  12 lowest reader version that can read it */
    uint32_t header_size;      /*  16 offset of entry 0 */
    uint32_t entry_size;       /*  20 sizeof(vmm_names_entry) */
    uint32_t capacity;         /*  24 entries */
    uint32_t ready;            /*  28 1 once initialised (release store) */
    uint32_t pid;              /*  32 the owner */
    uint32_t max_dims;         /*  36 VMM_NAMES_MAX_DIMS */
    uint64_t start_time;       /*  40 */
    uint64_t pidns;            /*  48 */
    uint64_t used;             /*  56 entries ever written: read [0, used) (atomic, release) */
    uint64_t count;            /*  64 live names (atomic) */
    uint64_t changes;          /*  72 odd while the owner changes the table (atomic, release) */
    uint64_t created_ns;       /*  80 CLOCK_REALTIME */
    uint64_t weights_seq;      /*  88 odd while the owner updates its tensors in place (atomic; VERSIONS) */
    uint64_t weights_version;  /*  96 the version the last update ended at (atomic; VERSIONS) */
    char job[24];              /* 104 the owner's job tag, NUL-terminated; "" none (version 2) */
} vmm_names_header;            /* 128 */

typedef struct vmm_names_entry {
    uint32_t seq;              /*   0 sequence counter; odd while written */
    uint32_t state;            /*   4 VMM_NAMES_FREE / LIVE */
    uint64_t generation;       /*   8 changes at every write of the entry */
    uint64_t address;          /*  16 owner's device pointer of the first element */
    uint64_t nbytes;           /*  24 bytes from address the tensor spans */
    uint8_t alloc_id[16];      /*  32 the registry record holding address */
    uint64_t rec_slot;         /*  48 that record's slot */
    uint8_t dtype_code;        /*  56 DLPack DLDataTypeCode */
    uint8_t dtype_bits;        /*  57 */
    uint16_t dtype_lanes;      /*  58 */
    uint32_t ndim;             /*  60 0..VMM_NAMES_MAX_DIMS */
    int64_t shape[8];          /*  64 */
    int64_t strides[8];        /* 128 in elements */
    uint64_t published_ns;     /* 192 CLOCK_REALTIME */
    char name[128];            /* 200 NUL-terminated */
    uint64_t version;          /* 328 the version it was published at (0: none given) (version 2) */
    uint8_t mesh_ndim;         /* 336 0: a whole tensor; 1..3: a shard of a tensor over a device mesh (SHARDS) */
    uint8_t place_kind[3];     /* 337 per mesh dimension: VMM_NAMES_PLACE_* */
    uint8_t place_dim[3];      /* 340 VMM_NAMES_PLACE_SHARD: the tensor dimension it splits */
    uint8_t reserved0;         /* 343 */
    uint16_t mesh[3];          /* 344 the mesh's extent along each mesh dimension */
    uint16_t coord[3];         /* 350 this shard's coordinate along each */
    uint32_t reserved1;        /* 356 */
    int64_t global_extent[3];  /* 360 VMM_NAMES_PLACE_SHARD: the whole tensor's extent along place_dim */
} vmm_names_entry;             /* 384 */

_Static_assert(sizeof(vmm_names_header) == 128, "names header size");
VMM_ASSERT_OFF(vmm_names_header, magic, 0);
VMM_ASSERT_OFF(vmm_names_header, version, 8);
VMM_ASSERT_OFF(vmm_names_header, compat_version, 12);
VMM_ASSERT_OFF(vmm_names_header, header_size, 16);
VMM_ASSERT_OFF(vmm_names_header, entry_size, 20);
VMM_ASSERT_OFF(vmm_names_header, capacity, 24);
VMM_ASSERT_OFF(vmm_names_header, ready, 28);
VMM_ASSERT_OFF(vmm_names_header, pid, 32);
VMM_ASSERT_OFF(vmm_names_header, max_dims, 36);
VMM_ASSERT_OFF(vmm_names_header, start_time, 40);
VMM_ASSERT_OFF(vmm_names_header, pidns, 48);
VMM_ASSERT_OFF(vmm_names_header, used, 56);
VMM_ASSERT_OFF(vmm_names_header, count, 64);
VMM_ASSERT_OFF(vmm_names_header, changes, 72);
VMM_ASSERT_OFF(vmm_names_header, created_ns, 80);
VMM_ASSERT_OFF(vmm_names_header, weights_seq, 88);
VMM_ASSERT_OFF(vmm_names_header, weights_version, 96);
VMM_ASSERT_OFF(vmm_names_header, job, 104);

_Static_assert(sizeof(vmm_names_entry) == 384, "names entry size");
VMM_ASSERT_OFF(vmm_names_entry, seq, 0);
VMM_ASSERT_OFF(vmm_names_entry, state, 4);
VMM_ASSERT_OFF(vmm_names_entry, generation, 8);
VMM_ASSERT_OFF(vmm_names_entry, address, 16);
VMM_ASSERT_OFF(vmm_names_entry, nbytes, 24);
VMM_ASSERT_OFF(vmm_names_entry, alloc_id, 32);
VMM_ASSERT_OFF(vmm_names_entry, rec_slot, 48);
VMM_ASSERT_OFF(vmm_names_entry, dtype_code, 56);
VMM_ASSERT_OFF(vmm_names_entry, dtype_bits, 57);
VMM_ASSERT_OFF(vmm_names_entry, dtype_lanes, 58);
VMM_ASSERT_OFF(vmm_names_entry, ndim, 60);
VMM_ASSERT_OFF(vmm_names_entry, shape, 64);
VMM_ASSERT_OFF(vmm_names_entry, strides, 128);
VMM_ASSERT_OFF(vmm_names_entry, published_ns, 192);
VMM_ASSERT_OFF(vmm_names_entry, name, 200);
VMM_ASSERT_OFF(vmm_names_entry, version, 328);
VMM_ASSERT_OFF(vmm_names_entry, mesh_ndim, 336);
VMM_ASSERT_OFF(vmm_names_entry, place_kind, 337);
VMM_ASSERT_OFF(vmm_names_entry, place_dim, 340);
VMM_ASSERT_OFF(vmm_names_entry, reserved0, 343);
VMM_ASSERT_OFF(vmm_names_entry, mesh, 344);
VMM_ASSERT_OFF(vmm_names_entry, coord, 350);
VMM_ASSERT_OFF(vmm_names_entry, reserved1, 356);
VMM_ASSERT_OFF(vmm_names_entry, global_extent, 360);
_Static_assert(sizeof(((vmm_names_entry *)0)->name) == VMM_NAMES_NAME_MAX + 1, "name size");
_Static_assert(sizeof(((vmm_names_entry *)0)->shape) == VMM_NAMES_MAX_DIMS * 8, "shape size");

/* KEEP: the file a keeper keeps beside the registry for one owner. */
enum { VMM_KEEP_WATCHING = 1, VMM_KEEP_KEPT = 2, VMM_KEEP_RELEASED = 3 };
/* vmm_keep_file.end_kind: how the owner ended, as the keeper learnt it */
enum { VMM_KEEP_END_NONE = 0, VMM_KEEP_END_EXIT = 1, VMM_KEEP_END_SIGNAL = 2, VMM_KEEP_END_UNKNOWN = 3 };

typedef struct vmm_keep_file {
    uint64_t magic;            /*   0 VMM_KEEP_MAGIC */
    uint32_t version;          /*   8 VMM_KEEP_VERSION */
    uint32_t size;             /*  12 sizeof(vmm_keep_file) */
    uint32_t ready;            /*  16 1 once the keeper filled it (release store) */
    uint32_t state;            /*  20 VMM_KEEP_* (atomic) */
    uint32_t owner_pid;        /*  24 */
    uint32_t keeper_pid;       /*  28 */
    uint64_t owner_start_time; /*  32 */
    uint64_t keeper_start_time;/*  40 */
    uint64_t pidns;            /*  48 the owner's (the keeper shares it) */
    uint32_t bell;             /*  56 rung by the owner and by vmmctl release (atomic add, FUTEX_WAKE) */
    uint32_t done;             /*  60 the bell a full pass of the keeper began with (atomic, FUTEX_WAKE) */
    uint64_t heartbeat_ns;     /*  64 CLOCK_MONOTONIC of the keeper's last pass (atomic) */
    uint32_t release;          /*  72 1: vmmctl release asks the keeper to let go (atomic) */
    int32_t exit_status;       /*  76 the status the owner passed to exit() (written by the owner) */
    uint32_t exit_seen;        /*  80 1 once the owner wrote exit_status (release store) */
    uint32_t end_kind;         /*  84 VMM_KEEP_END_*: how the owner ended (keeper) */
    int32_t end_value;         /*  88 the exit code or the signal */
    uint32_t reserved0;        /*  92 */
    uint64_t ended_ns;         /*  96 CLOCK_REALTIME when the keeper found the owner gone */
    uint64_t since_ns;         /* 104 CLOCK_REALTIME when keeping began */
    uint64_t held_allocs;      /* 112 allocations whose memory the keeper holds (atomic) */
    uint64_t held_bytes;       /* 120 bytes of the chunks it holds (atomic) */
    char socket[112];          /* 128 the keeper's broker socket */
    uint8_t reserved[16];      /* 240 */
} vmm_keep_file;               /* 256 */

_Static_assert(sizeof(vmm_keep_file) == 256, "keep file size");
VMM_ASSERT_OFF(vmm_keep_file, magic, 0);
VMM_ASSERT_OFF(vmm_keep_file, version, 8);
VMM_ASSERT_OFF(vmm_keep_file, size, 12);
VMM_ASSERT_OFF(vmm_keep_file, ready, 16);
VMM_ASSERT_OFF(vmm_keep_file, state, 20);
VMM_ASSERT_OFF(vmm_keep_file, owner_pid, 24);
VMM_ASSERT_OFF(vmm_keep_file, keeper_pid, 28);
VMM_ASSERT_OFF(vmm_keep_file, owner_start_time, 32);
VMM_ASSERT_OFF(vmm_keep_file, keeper_start_time, 40);
VMM_ASSERT_OFF(vmm_keep_file, pidns, 48);
VMM_ASSERT_OFF(vmm_keep_file, bell, 56);
VMM_ASSERT_OFF(vmm_keep_file, done, 60);
VMM_ASSERT_OFF(vmm_keep_file, heartbeat_ns, 64);
VMM_ASSERT_OFF(vmm_keep_file, release, 72);
VMM_ASSERT_OFF(vmm_keep_file, exit_status, 76);
VMM_ASSERT_OFF(vmm_keep_file, exit_seen, 80);
VMM_ASSERT_OFF(vmm_keep_file, end_kind, 84);
VMM_ASSERT_OFF(vmm_keep_file, end_value, 88);
VMM_ASSERT_OFF(vmm_keep_file, reserved0, 92);
VMM_ASSERT_OFF(vmm_keep_file, ended_ns, 96);
VMM_ASSERT_OFF(vmm_keep_file, since_ns, 104);
VMM_ASSERT_OFF(vmm_keep_file, held_allocs, 112);
VMM_ASSERT_OFF(vmm_keep_file, held_bytes, 120);
VMM_ASSERT_OFF(vmm_keep_file, socket, 128);
VMM_ASSERT_OFF(vmm_keep_file, reserved, 240);

/* A record's level in the index: the smallest g >= 8 with extent <= 2^g. */
static inline unsigned vmm_reg_level(uint64_t extent)
{
    unsigned g = VMM_REG_MIN_LEVEL;
    while (g < 63 && (1ull << g) < extent) g++;
    return g;
}

/* A record's index key. */
static inline uint64_t vmm_reg_key(uint64_t address, uint64_t extent)
{
    unsigned g = vmm_reg_level(extent);
    return (address & ~((1ull << g) - 1)) | g;
}

/* The index hash: a 64-bit mix of pid and address (splitmix64 finaliser). */
static inline uint64_t vmm_reg_hash(uint32_t pid, uint64_t address)
{
    uint64_t x = address ^ ((uint64_t)pid * 0x9e3779b97f4a7c15ull);
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

#endif
