/* vmmshim companion API: the one header a companion compiles against (link -lvmmshim-client,
 * or `pkg-config --cflags --libs vmmshim`).  It reads the registry that processes running under
 * libvmmshim.so publish their device allocations in.
 *
 * Every call returns a vmm_status; on failure vmm_last_error() holds a one-line reason for the
 * calling thread.  The library never exits, never prints, and links no CUDA library. */
#ifndef VMMSHIM_H
#define VMMSHIM_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VMM_VERSION_MAJOR 0
#define VMM_VERSION_MINOR 1
#define VMM_VERSION_PATCH 0

/* The types, and the owner-side functions the shim defines (vmm_publish and family): shared with
 * the shim, which may include nothing from tools/.  The installed vmmshim.h holds them in place of
 * this line (`make install`). */
#include "../../shim/api/vmm_api.h"

typedef struct vmm_gc_report {
    unsigned procs_alive, procs_dead, procs_unknown;
    unsigned records_reclaimed, chunks_reclaimed, index_rebuilt;
} vmm_gc_report;

const char *vmm_strerror(vmm_status status);
/* The calling thread's last failure, one line; "" when none. */
const char *vmm_last_error(void);

/* Open the registry read-only (name NULL: $VMMSHIM_REGISTRY, else "/vmmshim-<uid>"; a name
 * without its leading '/', as "jobs", means "/jobs", as the shim takes VMMSHIM_REGISTRY). */
vmm_status vmm_open(const char *name, vmm_registry **out);
/* Open it for reclaiming dead owners' records (vmm_gc). */
vmm_status vmm_open_writable(const char *name, vmm_registry **out);
void vmm_close(vmm_registry *reg);
vmm_status vmm_registry_describe(vmm_registry *reg, vmm_registry_info *out);

/* Iterate (vmm_alloc_fn, vmm_proc_fn).  The callback returns 0 to go on, anything else to stop
 * (returned as VMM_OK). */
vmm_status vmm_foreach_alloc(vmm_registry *reg, vmm_alloc_fn fn, void *ctx);
vmm_status vmm_foreach_proc(vmm_registry *reg, vmm_proc_fn fn, void *ctx);

/* The live allocation of process `pid` containing `address` (any interior address). */
vmm_status vmm_find(vmm_registry *reg, uint32_t pid, uint64_t address, vmm_alloc_info *out);
vmm_status vmm_find_proc(vmm_registry *reg, uint32_t pid, vmm_proc_info *out);
/* Check the segment and count dead owners' records (a read-only walk). */
vmm_status vmm_check(vmm_registry *reg, vmm_gc_report *out);
/* Reclaim every record whose owner is dead (needs vmm_open_writable). */
vmm_status vmm_gc(vmm_registry *reg, vmm_gc_report *out);

/* ---- Import ------------------------------------------------------------------------------
 * Map another process's live allocation into this one.  The fd comes from the owner's broker
 * (VMM_KIND_BROKER; the owner's uid, or a member of its VMMSHIM_BROKER_GROUP) or from
 * pidfd_getfd (VMM_KIND_PIDFD; needs ptrace permission over the owner).  The CUDA driver
 * (libcuda.so.1) is loaded on first use.  The mapping keeps the memory alive even after its
 * owner frees it or exits.  Failures: VMM_ERR_STALE (freed since it was read), VMM_ERR_OWNER_DEAD,
 * VMM_ERR_ACCESS (broker refused this uid, or no ptrace permission), VMM_ERR_CUDA (the message
 * names the driver call and its CUDA_ERROR_*), VMM_ERR_IO (also: the owner's chunk size differs
 * from the record's).
 *
 * What is mapped is the allocation's whole chunk (mapped_size bytes); the pointer handed back is
 * the chunk's base + chunk_offset.  A VMM_ALLOC_MULTI_HANDLE record's chunk is n_handles handles:
 * each comes from the owner's broker (several in a reply), and they are mapped back to back in
 * one reservation, with one cuMemSetAccess; such a mapping is shared only by imports of that
 * same allocation.  Imported chunks are shared within this process and kept: while
 * a chunk is mapped here, importing an allocation of it (the same one again, or another) asks
 * neither the owner's broker nor the driver to import or map anything -- it re-reads the
 * allocation's record (still live, same generation, same chunk) and the owner's liveness, and
 * costs microseconds.  When its last vmm_imported is released a chunk stays mapped ("idle") as
 * long as the owner holds it: a thread of this library (started on demand, taking no signals)
 * looks every 100 ms and unmaps an idle chunk once the allocation last imported from it is
 * freed, its owner exits, or the registry it was read through is closed (vmm_close), so an idle
 * mapping never keeps memory its owner has let go of.  vmm_import_drop_idle unmaps them all at
 * once.  The library keeps, per owner, one pidfd (to tell its exit cheaply) and one connection to
 * its broker (an import costs one round trip), both close-on-exec, closed after 30 s unused or
 * when the owner exits.  Imports are thread-safe.  Since the whole chunk is mapped, the bytes of
 * other allocations sharing it are reachable through the mapping too (the broker hands them to
 * the same users anyway). */
/* (The handle type cannot share the function's name in C: it is vmm_imported, declared above.) */
/* Import into the calling thread's CUDA context, or into device 0's primary context (made
 * current on this thread) when it has none: cuMemImportFromShareableHandle, cuMemAddressReserve,
 * cuMemMap, and one cuMemSetAccess, read-write for
 *   - the device the memory lies on (the record's device_uuid, looked up among this process's
 *     devices: the owner's ordinal may name another device here), when it is visible here, and
 *   - the calling thread's device, when it is that device or can access it as a peer
 *     (cuDeviceCanAccessPeer).
 * So a companion on GPU 1 importing memory of GPU 0 gets one pointer that kernels and copies on
 * GPU 1 (peer) and on GPU 0 (local) both use.  A device that cannot reach the memory is not
 * granted (the import is then usable from the memory's device only); when the memory's device is
 * not visible here, the thread's device alone is granted.  A chunk imported already gets access
 * for a further thread's device with one cuMemSetAccess.  vmm_import_device says which device the
 * import is for. */
vmm_status vmm_import(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported **out);
/* The allocation's device pointer here (for vmm_import_range: where the range's first byte is). */
uint64_t vmm_import_ptr(const vmm_imported *imp);
/* The owner's requested size (for vmm_import_range: the length asked for). */
uint64_t vmm_import_size(const vmm_imported *imp);
/* Drop this handle's reference to the chunk; after the last one the chunk stays mapped while its
 * owner holds it (above), else it is unmapped, its handle released and its reservation freed.  A range import (vmm_import_range) is unmapped and its reservation freed
 * at once.  NULL is fine.  imp is freed either way. */
vmm_status vmm_import_release(vmm_imported *imp);
/* Just the fd of the allocation's chunk (a POSIX file descriptor, close-on-exec), for companions
 * that import it themselves: map alloc->mapped_size bytes and add alloc->chunk_offset.  Each call
 * asks the owner again; the caller closes the fd.  VMM_ERR_INVALID for a VMM_ALLOC_MULTI_HANDLE
 * record: one fd cannot carry its handles. */
vmm_status vmm_import_fd(vmm_registry *reg, const vmm_alloc_info *alloc, int *fd);
/* Every handle of the allocation's chunk as an fd (close-on-exec), in address order, with each
 * handle's size in sizes: one for a one-handle record (as vmm_import_fd, sizes[0] its mapped_size),
 * alloc->n_handles for a VMM_ALLOC_MULTI_HANDLE one (from the owner's broker, protocol v2).  max is
 * the room in fds and sizes: less than the handles the record names is VMM_ERR_INVALID.  *n says
 * how many were given; the caller closes them.  Each call asks the owner again.  An fd keeps its
 * handle's memory alive until it is closed, after the owner frees it or exits too: what a keeper
 * (vmmctl keep) holds. */
vmm_status vmm_import_fds(vmm_registry *reg, const vmm_alloc_info *alloc, int *fds, uint64_t *sizes, uint32_t max,
                          uint32_t *n);

/* Map the owner's bytes [address, address+length) of process `pid` here as one contiguous range,
 * also when they lie in several allocations: a program that maps memory itself with the driver's
 * VMM API publishes one record per mapping (VMM_FROM_CU_MEM_MAP), and PyTorch maps 2 MiB or
 * 20 MiB pages, each its own handle, back to back, so one tensor may span several records.
 * vmm_import_ptr(*out) is where the byte at `address` is, and the length bytes follow it;
 * vmm_import_size(*out) is length.
 *
 * The live records of one living owner must cover the range, each starting where the one before
 * ends.  Each record's handle comes as vmm_import's does (the owner's broker, else pidfd_getfd),
 * once per handle; one reservation is made for the range and every handle mapped into it at its
 * place (consecutive records of one chunk as one mapping), read-write for the devices vmm_import
 * grants (the first record's device standing for the range's), and the imported handles are released
 * at once: the mappings keep the memory alive, after its owner frees it or exits too, until
 * vmm_import_release.  Each handle is mapped whole (the driver maps a handle only from its
 * offset 0), at the place its bytes have in the owner, so the chunks of a range must lie back to
 * back in the owner, as an expandable segment's pages do.  Nothing is cached or shared between range imports or
 * with vmm_import's chunks: each call asks the owner again.
 *
 * Failures, each naming the owner's address concerned: VMM_ERR_NOT_FOUND (no live allocation of
 * pid at the first byte not covered: a gap, or freed meanwhile), VMM_ERR_ACCESS (a record is not
 * exportable, or offers only a FABRIC handle; or the broker refused), VMM_ERR_INVALID (length 0
 * or past the end of the address space, or two chunks of the range that do not lie back to back
 * in the owner), VMM_ERR_STALE (a record was freed between finding and importing it, or the
 * records read disagree: one begins inside the one before, freed and its place reused meanwhile),
 * VMM_ERR_OWNER_DEAD, VMM_ERR_CUDA, VMM_ERR_IO, as vmm_import.  On failure nothing stays
 * mapped and *out is NULL. */
vmm_status vmm_import_range(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t length,
                            vmm_imported **out);

/* Import n byte ranges of process `pid` at once, each as its own import, as vmm_import_range
 * returns one: vmm_import_ptr(out[i]) is where the byte at addresses[i] is, vmm_import_size(out[i])
 * the range's length.  sizes[i] 0 (or sizes NULL) means the whole allocation holding addresses[i]
 * (any interior address), as vmm_import maps it: the pointer is where the allocation starts and
 * the size its requested size.  All ranges must be of one owner (the process the first is of).
 * The ranges may lie anywhere: inside one allocation, across allocations or mappings, several in
 * one chunk, overlapping.
 *
 * The work is shared: a range inside one chunk (one allocation, or allocations of the shim's pool
 * side by side in one chunk, or one MULTI-HANDLE allocation) is a reference to that chunk's
 * mapping in vmm_import's table, so however many ranges of the call lie in a chunk, it is fetched,
 * imported and mapped here once; a chunk mapped here before the call is not fetched at all.
 * Releasing such an import is vmm_import_release on a vmm_import.  A range across several chunks
 * gets a mapping of its own, as vmm_import_range makes, sharing the handles fetched.  Every handle
 * the call needs comes from the owner's broker in one round trip (protocol v3: one request, fds
 * streamed 64 a message; more than 2048 allocations take one request per 2048; an owner whose
 * broker predates v3 is asked one allocation at a time), each is imported once, and everything new
 * is mapped into one reservation (cuMemAddressReserve once) and granted access with one
 * cuMemSetAccess (one per set of devices granted, when the ranges' memory lies on several GPUs).
 * With VMMSHIM_IMPORT_THREADS=N (1 to 16, default 1; read at each call) N threads import the
 * handles as they arrive and map them; whether more than one pays is measured on a GPU
 * (tests/gpu/weight_sync.sh).  A bad value fails the call with VMM_ERR_INVALID.
 * vmm_import_many_last_timing says where the call's time went.
 *
 * All or nothing: on any failure every import the call made is released, out[0..n) are all NULL,
 * and vmm_last_error names the failing range (its index, address and size) and the reason, with
 * the statuses of vmm_import_range (VMM_ERR_NOT_FOUND also for a range of another process with
 * the same pid).  n 0 is VMM_OK, importing nothing. */
vmm_status vmm_import_many(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *sizes,
                           size_t n, vmm_imported **out);

/* The device (an ordinal of this process) the import is for: the calling thread's device when the
 * thread had a context of its own and that device was granted access, else the device the memory
 * lies on (vmm_import says which devices are granted); -1 for NULL.  The Python package uses it
 * as the buffer's DLPack device. */
int vmm_import_device(const vmm_imported *imp);
/* The records the import covers, as read when it was made (owner_alive as judged then): for
 * vmm_import the allocation's, for vmm_import_range and vmm_import_many the records under the
 * range, in address order (the first holds its first byte).  Copies at most max of them to out
 * (out may be NULL with max 0) and returns how many there are; 0 for NULL.  What a companion
 * needs to describe an import without looking the records up again. */
size_t vmm_import_records(const vmm_imported *imp, vmm_alloc_info *out, size_t max);

/* What a binding needs of each import, for n of them in one call (vmm_import_many's out): where
 * a binding would make three calls an import (about a microsecond each through Python's ctypes,
 * a sixth of taking a GPT-2's 148 tensors), it makes one.  Fixed-width fields, no padding. */
typedef struct vmm_import_desc {
    uint64_t ptr;         /* vmm_import_ptr */
    uint64_t size;        /* vmm_import_size */
    int32_t device;       /* vmm_import_device */
    uint32_t n_records;   /* vmm_import_records' count */
    uint8_t alloc_id[16]; /* of the record holding the first byte (vmm_alloc_info.alloc_id) */
} vmm_import_desc;
/* Fills out[0..n) for imps[0..n).  VMM_ERR_INVALID when imps or out is NULL (with n > 0) or an
 * imps[i] is NULL, and then out is left as it was. */
vmm_status vmm_import_describe(vmm_imported *const *imps, size_t n, vmm_import_desc *out);
/* vmm_import_many in two halves, so that a binding builds its objects over the pointers while the
 * driver grants access to them (cuMemSetAccess, a third of taking a 1.76 GiB model on an H200):
 * vmm_import_many_begin does everything vmm_import_many does but the grant, which runs on a
 * thread of the library's, and fills desc[0..n) as vmm_import_describe would the imports.  The
 * memory is mapped there but not accessible yet: nothing may touch it (a kernel, a copy) before
 * vmm_import_many_end returns VMM_OK.  vmm_import_many_end(job, out) waits for the grant and
 * fills out[0..n) as vmm_import_many does, all or nothing; on a failure every pointer desc gave is
 * no memory any more.  A pointer of desc may differ from vmm_import_ptr(out[i]) only when another
 * thread of this process mapped the same chunk meanwhile: compare them.  Every job begun must be
 * ended once, on any thread; vmm_import_many_last_timing then tells the ending thread of the whole
 * call.  A failed begin leaves *job NULL and nothing to end. */
typedef struct vmm_import_job vmm_import_job;
vmm_status vmm_import_many_begin(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *sizes,
                                 size_t n, vmm_import_desc *desc, vmm_import_job **job);
vmm_status vmm_import_many_end(vmm_import_job *job, vmm_imported **out);
/* Is the allocation imp was imported from (vmm_import) still live in its owner?  VMM_OK;
 * VMM_ERR_STALE once the owner freed it -- also when the same address or record slot now holds
 * another allocation (its generation tells them apart); VMM_ERR_OWNER_DEAD once the owner exited.
 * The mapping stays valid memory in every case, until vmm_import_release.  A range import gets
 * VMM_ERR_INVALID: check its records with vmm_find. */
vmm_status vmm_import_check(vmm_registry *reg, const vmm_imported *imp);
/* Unmap every imported chunk no vmm_imported holds now; returns once they are unmapped, also
 * those the library's own thread had begun to unmap. */
vmm_status vmm_import_drop_idle(void);

/* ---- Keepers ------------------------------------------------------------------------------
 * A keeper (`vmmctl keep`) holds the memory of processes it keeps, as a companion holding their
 * chunks' fds, so that it outlives them.  While such a process lives, the keeper holds what it
 * publishes and lets go of what it frees.  When it dies (a signal, or exit() with a status other
 * than 0), its records stay in the registry with VMM_ALLOC_KEPT, owner_alive (and vmm_proc_info's
 * alive) read VMM_OWNER_KEPT while the keeper lives, and the keeper answers the owner's broker
 * requests: vmm_import, vmm_import_range, vmm_import_many, vmm_foreach_tensor work on them as on
 * a living owner's.  vmm_gc leaves them until the keeper lets go (vmmctl release, or the keeper
 * stops or dies). */
enum { VMM_KEEPER_WATCHING = 1 /* the process lives */, VMM_KEEPER_KEPT = 2 /* it died: its memory is kept */ };
/* How the kept process ended, as the keeper learnt it. */
enum { VMM_END_NONE = 0 /* not yet */, VMM_END_EXIT = 1 /* exit code end_value */,
       VMM_END_SIGNAL = 2 /* killed by signal end_value */, VMM_END_UNKNOWN = 3 /* vanished */ };
typedef struct vmm_keeper_info {
    uint32_t owner_pid;
    uint32_t keeper_pid;
    int state;             /* VMM_KEEPER_* */
    int end_kind;          /* VMM_END_* */
    int end_value;
    uint64_t since_ns;     /* CLOCK_REALTIME when keeping began */
    uint64_t ended_ns;     /* CLOCK_REALTIME when the keeper found the process gone; 0 while it lives */
    uint64_t held_allocs;  /* allocations whose memory the keeper holds */
    uint64_t held_bytes;   /* bytes of the chunks it holds */
    char socket[112];      /* the keeper's broker socket */
} vmm_keeper_info;
/* The living keeper that keeps process `pid` (the living process of that pid, else a dead one
 * with a record).  VMM_ERR_NOT_FOUND: no such process, or nobody keeps it. */
vmm_status vmm_keeper_of(vmm_registry *reg, uint32_t pid, vmm_keeper_info *out);

/* Where the calling thread's last successful vmm_import spent its time (vmm_import_timing). */
vmm_status vmm_import_last_timing(vmm_import_timing *out);

/* Where the calling thread's last vmm_import_many spent its time (vmm_import_many_timing). */
vmm_status vmm_import_many_last_timing(vmm_import_many_timing *out);

/* ---- Reading imported bytes ----------------------------------------------------------------
 * Both copy device-to-host from vmm_import_ptr(imp) + offset, on the import's device (its primary
 * context is made current on the calling thread when the thread has none, as vmm_import does);
 * [offset, offset + length) must lie within vmm_import_size(imp).  Failures: VMM_ERR_INVALID,
 * VMM_ERR_CUDA (the message names the driver call), VMM_ERR_NOMEM. */
/* Copy into dst (any host memory), synchronously. */
vmm_status vmm_import_read(const vmm_imported *imp, uint64_t offset, void *dst, uint64_t length);
/* Stream the bytes to sink in order, through two pinned host buffers so that the copy of one
 * overlaps the sink's work on the other (what `vmmctl dump` writes files with).  sink gets each
 * piece (data valid only during the call) and the bytes handed over before it; a non-zero return
 * stops the copy, which then fails with VMM_ERR_IO.  Pieces are a quarter of the length, at least
 * 1 MiB and at most 16 MiB.  The pinned buffers are kept for later calls (one pair for each call
 * running at once, at most 2 x 16 MiB each, until the process exits), since pinning memory is
 * slower than copying it. */
vmm_status vmm_import_copy(const vmm_imported *imp, uint64_t offset, uint64_t length, vmm_sink_fn sink, void *ctx);

/* ---- Named tensors --------------------------------------------------------------------------
 * An unmodified program publishes allocations, not tensors.  A program that wants its tensors
 * found by name publishes them (owner side); a companion lists them and imports them by name.
 *
 * OWNER SIDE, in a process running under libvmmshim.so (LD_PRELOAD): vmm_publish,
 * vmm_publish_many, vmm_unpublish and vmm_publish_error are the shim's own functions.  Link
 * -lvmmshim-client to build against them: under the shim its definitions are the ones called;
 * without it, the client library's answer VMM_ERR_NO_SHIM ("not running under the shim").  The
 * reason for a failure is in vmm_publish_error() (not vmm_last_error(): the shim and the client
 * library keep their own), one line, per thread.
 *
 * A name is 1 to VMM_NAME_MAX bytes of UTF-8 without control characters (bytes below 0x20, 0x7f),
 * unique in its process.  Publishing a name that is published already replaces it, as assigning
 * to a dict key does (the same tensor again changes nothing).  The tensor's bytes -- itemsize x
 * (1 + sum((shape[i] - 1) x strides[i])) from address, itemsize = bits x lanes / 8, strides in
 * elements, none negative; no element (a 0 in shape) is refused -- must lie in live, exportable
 * allocations of this process that the shim published (cudaMalloc, cudaMallocAsync, cuMemAlloc,
 * the program's own cuMemMap ranges).  A name lives until it is unpublished, published again, or
 * any allocation under its bytes is freed (every free route of the shim drops it), and goes with
 * the process.  A caching allocator's frees do not reach the shim: PyTorch keeps a freed tensor's
 * block, so unpublish a tensor the program drops, or its name outlives it.  Failures (nothing
 * changes): VMM_ERR_INVALID (a bad name, dtype, ndim, shape or strides; a name twice in one
 * vmm_publish_many), VMM_ERR_NOT_FOUND (bytes not in the shim's live memory of this process; for
 * vmm_unpublish, no such name), VMM_ERR_ACCESS (memory the shim could not make exportable: made
 * during a stream capture or with the device full), VMM_ERR_NOMEM (also: the process's table of
 * 262144 names is full), VMM_ERR_NO_SHIM, VMM_ERR_IO (the table beside the registry could not be
 * made).  The names live in a table beside the registry (shim/registry/layout.h, NAMES). */
/* The limits (VMM_NAME_MAX 127, VMM_MAX_DIMS 8), the element type (vmm_dtype, VMM_DTYPE_*), one
 * tensor of vmm_publish_many (vmm_tensor_desc) and the owner side -- vmm_publish (one tensor by
 * name), vmm_publish_many (n at once, all or none: one failure leaves every name as it was),
 * vmm_unpublish (VMM_ERR_NOT_FOUND when this process does not publish it) and vmm_publish_error
 * (the calling thread's last failure of those three, one line; "" when none) -- are declared
 * above, with the types: the shim defines them too. */

/* ---- Sleep and wake (owner side) -------------------------------------------------------------
 * In a process running under libvmmshim.so, vmm_pause gives the physical memory under a tag's
 * allocations back to the device and keeps their addresses reserved; vmm_resume maps fresh memory
 * at exactly those addresses, with the same access (peer access and the default pool's grants),
 * and copies the kept contents back bit for bit.  Pointers, tensors and captured CUDA graphs stay
 * valid across the pair.  Like vmm_publish, the shim defines them and the client library's stand-ins
 * answer VMM_ERR_NO_SHIM; the reason for a failure is in vmm_sleep_error() (one line, per thread).
 *
 * tag NULL: every allocation the shim backs in this process; the process's tag (VMMSHIM_TAG) is the
 * same today; another tag: VMM_ERR_NOT_FOUND.  vmm_pause first waits for the devices (synchronizes
 * the contexts the allocations were made in), then copies the live allocations' bytes out (unless
 * VMM_PAUSE_DISCARD; VMM_PAUSE_FILE: into an unlinked file in VMMSHIM_PAUSE_DIR, else pinned host
 * memory for allocations of 1 MiB or more, kept after the resume for the next pause within
 * VMMSHIM_PAUSE_HOST_CACHE, and pageable below), then releases every handle under
 * them and the pools' empty ones: the memory is back on the device when the call returns.  The
 * program must not queue work that touches paused memory; it may allocate (new memory, elsewhere)
 * and free (a paused allocation's copy goes at its free) while paused.  Memory the shim does not
 * own stays, and the report says how much.
 * Results: VMM_OK; VMM_ERR_STATE for a pause when some of the tag's memory is paused already (resume
 * first), or a resume when none is: nothing changes, a clear no-op; VMM_ERR_BUSY while a stream is
 * being captured (waiting for the device would break the capture); VMM_ERR_NOMEM when the host copy
 * cannot be made, or at resume when the device is full: then nothing changes, the memory stays
 * paused with its copy (a later resume succeeds once memory is free) and a one-line error is
 * logged; VMM_ERR_IO (a driver call or the file failed); VMM_ERR_INVALID (bad flags).
 * While paused, the registry records stay live, flagged VMM_ALLOC_PAUSED, and a companion's import
 * fails with VMM_ERR_PAUSED; after the resume it imports the new memory (the records name new
 * chunk ids).  A companion that still holds an import keeps the old memory alive: the device gets
 * it back only once it lets go.  vmm_pause_ex and vmm_resume_ex fill the first report_size bytes of
 * *report (vmm_sleep_report; NULL or 0: nothing).  The functions and types are declared above, with
 * the shim's part of the API. */

/* ---- Sleep and wake from outside (companion side) -------------------------------------------
 * vmm_pause_process / vmm_resume_process ask process pid's broker (the one its registry record
 * names) to do vmm_pause_ex(tag, flags) / vmm_resume_ex(tag) there, with an import's rights (the
 * owner's uid, or its VMMSHIM_BROKER_GROUP).  The owner must have opted in with
 * VMMSHIM_REMOTE_PAUSE=1, for a pause and a resume alike: a program that launches a kernel on
 * memory paused under it crashes, and only the program knows when it is idle.  Without it:
 * VMM_ERR_ACCESS ("pid N does not accept remote pause: ..."), nothing touched.  With it the owner
 * waits for its devices, then does exactly what its own vmm_pause would, and the call returns once
 * it is done (seconds for GBs; up to 10 min is waited).  tag NULL or "": the whole process.  The
 * results are vmm_pause's (VMM_ERR_STATE, _NOT_FOUND, _BUSY, _NOMEM, _IO, _INVALID), and:
 * VMM_ERR_NOT_FOUND (pid not in the registry, or no broker yet), VMM_ERR_OWNER_DEAD,
 * VMM_ERR_NO_SHIM (the socket's server pauses nothing: a keeper), VMM_ERR_VERSION (the owner's
 * shim predates remote pause).  The owner's report (its time, ns, is the owner's) goes into the
 * first report_size bytes of *report; the reason into vmm_last_error().  A pause's report names
 * the companions still holding imports of what it released after the owner's wait (bytes_held,
 * n_holders, holders), as vmm_pause_ex's does; an owner whose shim predates saying so is asked
 * again without, and its report has VMM_SLEEP_HOLDERS_UNKNOWN in flags (0 holders: unknown). */
vmm_status vmm_pause_process(vmm_registry *reg, uint32_t pid, const char *tag, unsigned flags,
                             vmm_sleep_report *report, size_t report_size);
vmm_status vmm_resume_process(vmm_registry *reg, uint32_t pid, const char *tag, vmm_sleep_report *report,
                              size_t report_size);

/* COMPANION SIDE: the names a living owner publishes now, each checked against the live
 * allocation it lies in (a name whose allocation was freed, or whose owner died, is never
 * given).  Import them with vmm_import_many (address, nbytes). */
typedef struct vmm_tensor_info {
    char name[VMM_NAME_MAX + 1];
    uint32_t pid;
    vmm_dtype dtype;
    uint32_t ndim;
    uint64_t address;              /* the owner's device pointer of the first element */
    uint64_t nbytes;               /* bytes from address the tensor spans */
    int64_t shape[VMM_MAX_DIMS];
    int64_t strides[VMM_MAX_DIMS]; /* in elements */
    uint8_t alloc_id[16];          /* the allocation holding address (vmm_alloc_info.alloc_id) */
    uint64_t published_ns;         /* CLOCK_REALTIME */
} vmm_tensor_info;
typedef int (*vmm_tensor_fn)(void *ctx, const vmm_tensor_info *tensor);
/* Every name process `pid` publishes, as of one moment (when the owner is not changing its
 * names for tens of milliseconds on end); the callback returns 0 to go on.  VMM_ERR_NOT_FOUND:
 * pid has no record in the registry (it does not run under the shim, or under another
 * registry); VMM_ERR_OWNER_DEAD: it has exited; a living owner that publishes no names: VMM_OK
 * and no call.  VMM_ERR_CORRUPT, VMM_ERR_VERSION, VMM_ERR_ACCESS: its table cannot be read. */
vmm_status vmm_foreach_tensor(vmm_registry *reg, uint32_t pid, vmm_tensor_fn fn, void *ctx);
/* One name of pid; VMM_ERR_NOT_FOUND when pid publishes none by that name (or as above). */
vmm_status vmm_find_tensor(vmm_registry *reg, uint32_t pid, const char *name, vmm_tensor_info *out);
/* vmm_foreach_tensor into an array, for callers to whom a callback a name costs (Python's ctypes:
 * ~1 us each): out[0..min(max, *n)) filled, *n every name pid publishes now, so *n > max asks
 * for a larger array (the names may change between two calls).  Statuses as vmm_foreach_tensor. */
vmm_status vmm_list_tensors(vmm_registry *reg, uint32_t pid, vmm_tensor_info *out, size_t max, size_t *n);
/* Where a name lies in a larger tensor (vmm_publish_shards), and the version it was published at. */
typedef struct vmm_tensor_shard {
    uint64_t version;
    vmm_shard shard; /* mesh_ndim 0: a whole tensor */
} vmm_tensor_shard;
/* vmm_list_tensors with each name's shard beside it (shards[i] for out[i]). */
vmm_status vmm_list_shards(vmm_registry *reg, uint32_t pid, vmm_tensor_info *out, vmm_tensor_shard *shards, size_t max,
                           size_t *n);
/* vmm_list_tensors into tensors[0..min(max, *n)) and vmm_import_many_begin of every one of them
 * (addresses and nbytes), desc[i] for tensors[i], in one call: the import takes each record the
 * name table points at instead of searching the registry's index for it (a cold companion's
 * index search costs a page fault).  End the job with vmm_import_many_end.  No job (*job NULL)
 * when pid publishes no names (*n 0) or more than max (*n of them: call again with room for
 * them).  Statuses as vmm_list_tensors', then vmm_import_many_begin's. */
vmm_status vmm_import_tensors_begin(vmm_registry *reg, uint32_t pid, vmm_tensor_info *tensors, size_t max, size_t *n,
                                    vmm_import_desc *desc, vmm_import_job **job);
/* What a reader checks around its copies to get one version of an owner's tensors (vmm_update_begin):
 * seq is odd while the owner changes them, and moves with every change; version is the one the
 * last change ended at; job the owner's job tag ("" none).  A living owner that publishes no
 * names: all 0.  Statuses as vmm_foreach_tensor. */
typedef struct vmm_weights_info {
    uint64_t seq;
    uint64_t version;
    char job[24];
} vmm_weights_info;
vmm_status vmm_weights_state(vmm_registry *reg, uint32_t pid, vmm_weights_info *out);

#ifdef __cplusplus
}
#endif
#endif
