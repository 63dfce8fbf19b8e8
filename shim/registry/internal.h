/* What the registry's own files share and no other part of the project may use: where the
 * regions of the segment lie, and the few steps of the writer that gc repeats.  It exists so that
 * the registry could be split by who runs each part (the segment and its readers, the owner's
 * writer, gc) without copying the layout arithmetic into each. */
#ifndef VMM_REGISTRY_INTERNAL_H
#define VMM_REGISTRY_INTERNAL_H
#include <pthread.h>
#include <stdint.h>

#include "registry/registry.h"

/* ---- layout arithmetic ---- */

static inline vmm_reg_proc *proc_at(const vmm__reg *r, uint32_t i)
{
    return (vmm_reg_proc *)(r->base + r->hdr->proc_off + (uint64_t)i * sizeof(vmm_reg_proc));
}
static inline uint64_t *chunk_at(const vmm__reg *r, uint64_t c) { return (uint64_t *)(r->base + r->hdr->chunk_off) + c; }
static inline uint32_t *index_at(const vmm__reg *r) { return (uint32_t *)(r->base + r->hdr->index_off); }
static inline vmm_reg_alloc *rec_at(const vmm__reg *r, uint64_t slot)
{
    return (vmm_reg_alloc *)(r->base + r->hdr->rec_off + slot * sizeof(vmm_reg_alloc));
}

/* ---- registry.c: the segment ---- */

/* The open file description's lock on one byte of the segment (layout.h, locks). */
int vmm__reg_ofd_lock(int fd, int byte, short type);
void vmm__reg_ofd_unlock(int fd, int byte);
/* Pre-allocate pages so a full /dev/shm reports ENOSPC here instead of SIGBUS in the writer. */
int vmm__reg_back_range(int fd, uint64_t off, uint64_t len);

/* ---- writer.c: what gc does as the writer does it ---- */

/* The index lock word and the OFD gc lock both name a process, not a thread: these serialise the
 * threads of this process before the shared lock serialises the processes (a fork child makes
 * them anew: vmm__reg_forget_after_fork). */
extern pthread_mutex_t vmm__reg_gc_mutex;
/* The counters outside the seq protocol, zero for a new owner of the slot. */
void vmm__reg_counters_clear(vmm_reg_proc *p);
/* Release a chunk's records and the chunk itself; the caller holds whatever excludes its owner.
 * Returns how many records were live. */
unsigned vmm__reg_chunk_release(vmm__reg *r, uint64_t c);
void vmm__reg_index_lock(vmm__reg *r);
void vmm__reg_index_unlock(vmm__reg *r);
/* Only gc rebuilds (to sweep tombstones and entries a dead writer left). */
void vmm__reg_index_rebuild_locked(vmm__reg *r);

/* ---- names.c, for names_read.c ---- */

/* The table's object name for (pid, start_time) beside r; 0 or -ENAMETOOLONG. */
int vmm__names_path(const vmm__reg *r, uint32_t pid, uint64_t start_time, char *buf, size_t len);
/* The reason into err (may be NULL); returns code. */
int vmm__names_say(char *err, size_t errlen, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

#endif
