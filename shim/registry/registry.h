/* Internal C API of the shared-memory registry (layout and reader protocol: layout.h).
 * Writers (the shim) bind a record slot to each reservation they own, then publish and retract
 * it as allocations come and go; readers (client library, vmmctl) copy records out. */
#ifndef VMM_REGISTRY_H
#define VMM_REGISTRY_H
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "registry/layout.h"

enum { VMM__REG_READ = 0, VMM__REG_WRITE = 1, VMM__REG_CREATE = 3 };
enum { VMM__DEAD = 0, VMM__ALIVE = 1, VMM__UNKNOWN = 2, VMM__KEPT = 3 /* dead, its memory kept (layout.h KEEP) */ };

typedef struct vmm__reg {
    int fd;
    uint8_t *base;
    size_t map_size;
    bool writable;
    vmm_reg_header *hdr;
    char name[224];
    /* writer state: this process's proc slot and the record slots it owns (process-local) */
    pthread_mutex_t lock;
    bool attached;
    uint32_t proc_index, proc_gen, pid;
    uint64_t start_time, pidns, id_nonce, id_counter;
    uint32_t *free_slots;
    size_t n_free, cap_free;
    uint32_t *chunks;
    size_t n_chunks, cap_chunks;
    /* this process's name table (names.c), made at its first publish; names_live counts its
     * names, so that a remove with none to drop costs one relaxed load */
    struct vmm__names *names;
    uint64_t names_live;
} vmm__reg;

typedef struct vmm__reg_gc_stats {
    unsigned procs_dead, procs_unknown, procs_alive, records_reclaimed, chunks_reclaimed, index_rebuilt;
    unsigned names_removed; /* name tables of dead owners removed (layout.h NAMES) */
    unsigned procs_kept;    /* dead owners a living keeper keeps: left alone (layout.h KEEP) */
    unsigned keep_removed;  /* keep files no keeper holds removed */
} vmm__reg_gc_stats;

/* Open (and with VMM__REG_CREATE create) the registry.  `name` NULL means VMMSHIM_REGISTRY or
 * the per-user default; a name without its leading '/' means "/name".  On failure returns
 * -errno-ish code and writes a one-line reason. */
int vmm__reg_open(vmm__reg *r, const char *name, int mode, uint64_t capacity, const char *group, char *err,
                  size_t errlen);
void vmm__reg_close(vmm__reg *r);
void vmm__reg_default_name(char *buf, size_t len);
/* Validate a mapped segment; used by open and by `vmmctl check`. */
int vmm__reg_validate(const void *base, size_t size, char *err, size_t errlen);

/* Writer: claim this process's proc slot; detach releases every record it still holds. */
int vmm__reg_attach(vmm__reg *r, const char *broker_path);
int vmm__reg_set_broker(vmm__reg *r, const char *broker_path);
/* This process's record (NULL unless attached), for the writer's coverage counters (layout.h,
 * COVERAGE): relaxed atomic adds, outside the seq protocol. */
vmm_reg_proc *vmm__reg_self(vmm__reg *r);
void vmm__reg_detach(vmm__reg *r);
/* After fork(), the child must not write as its parent: drop writer state without touching
 * shared memory. */
void vmm__reg_forget_after_fork(vmm__reg *r);

/* Bind a record slot to a reservation [address, address+mapped_size).  address must be aligned to
 * the next power of two >= mapped_size (and >= 2 MiB) so readers can find interior pointers. */
int vmm__reg_bind(vmm__reg *r, uint64_t address, uint64_t mapped_size, uint32_t *slot);
/* Fill the record from `d` (alloc_id zero = generate one) and make it LIVE. */
int vmm__reg_publish(vmm__reg *r, uint32_t slot, const vmm_reg_alloc *d, vmm_reg_alloc *published);
int vmm__reg_retract(vmm__reg *r, uint32_t slot);
int vmm__reg_unbind(vmm__reg *r, uint32_t slot);
/* The allocation path's bind + publish and the free path's retract + unbind, each in one step. */
int vmm__reg_add(vmm__reg *r, uint64_t address, uint64_t extent, const vmm_reg_alloc *d, uint32_t *slot,
                 vmm_reg_alloc *published);
int vmm__reg_remove(vmm__reg *r, uint32_t slot);
/* A live record's memory was paused (VMM_REG_F_PAUSED set; the handle fields as given: a paused
 * one offers none) or resumed (flag cleared, and chunk_id, when not 0, names the fresh handle, so
 * an importer's cache never serves a mapping of the released one).  Seq protocol; -EINVAL when
 * slot is not a live record of this process. */
int vmm__reg_set_paused(vmm__reg *r, uint32_t slot, int paused, uint64_t chunk_id, uint32_t handle_kinds,
                        int32_t exported_fd, const uint8_t *fabric);

/* Readers.  Return 0, -ENOENT, -EAGAIN (a writer is mid-write, or died mid-write), -EINVAL. */
int vmm__reg_read_alloc(const vmm__reg *r, uint64_t slot, vmm_reg_alloc *out);
int vmm__reg_read_proc(const vmm__reg *r, uint32_t index, vmm_reg_proc *out);
/* One wait (some tens of milliseconds) shared by every record a walk reads: a writer is mid-write
 * for nanoseconds, or milliseconds when preempted, but one that died there leaves its record odd
 * for good, and waiting for each such record in turn would take hours in a full (or hostile)
 * registry.  Zeroed before the walk; the first record that needs waiting starts the clock. */
typedef struct vmm__reg_wait {
    double until;
} vmm__reg_wait;
int vmm__reg_read_alloc_within(const vmm__reg *r, uint64_t slot, vmm_reg_alloc *out, vmm__reg_wait *w);
int vmm__reg_read_proc_within(const vmm__reg *r, uint32_t index, vmm_reg_proc *out, vmm__reg_wait *w);
int vmm__reg_find(const vmm__reg *r, uint32_t pid, uint64_t address, vmm_reg_alloc *out, uint64_t *slot);
/* The same, told that the caller's range [address, address + size) most likely lies in one record
 * (size 0: no hint): the levels it can be at are searched first, the same answer in fewer searches.
 * levels (NULL: none), a bit per index level, names levels to search before those: where earlier
 * searches of one caller found their records (the bit of this one's is set).  A cold reader pays a
 * page fault a search (the index is megabytes); a model's tensors lie in allocations of a few sizes. */
int vmm__reg_find_near(const vmm__reg *r, uint32_t pid, uint64_t address, uint64_t size, uint64_t *levels,
                       vmm_reg_alloc *out, uint64_t *slot);
/* Proc slot of a live-or-dead owner by pid (first match), for tools. */
int vmm__reg_find_proc(const vmm__reg *r, uint32_t pid, vmm_reg_proc *out, uint32_t *index);
/* Visit every record in a bound chunk: callback gets the slot and a consistent copy. */
typedef int (*vmm__reg_visit_fn)(void *ctx, uint64_t slot, const vmm_reg_alloc *rec, int read_rc);
int vmm__reg_for_each(const vmm__reg *r, vmm__reg_visit_fn fn, void *ctx);

int vmm__reg_liveness(uint32_t pid, uint64_t start_time, uint64_t pidns);
int vmm__proc_identity(uint32_t pid, uint64_t *start_time, uint64_t *pidns);
/* Reclaim the records of dead owners (needs write access). */
int vmm__reg_gc(vmm__reg *r, vmm__reg_gc_stats *st);
/* The files beside registry r of one kind ("<r's name>.<kind>.<pid>.<start time>" in /dev/shm,
 * with a ".tmp" one an owner died making too when tmp_too): `dead` opens its "/name" and says
 * whether its owner is gone for good; those it says so of are unlinked.  Returns how many. */
typedef bool (*vmm__reg_file_dead_fn)(const vmm__reg *r, const char *name, uint32_t pid, uint64_t start_time);
unsigned vmm__reg_sweep_files(const vmm__reg *r, const char *kind, bool tmp_too, vmm__reg_file_dead_fn dead);
/* Bytes of the segment actually backed by memory. */
uint64_t vmm__reg_footprint(const vmm__reg *r);

#endif
