/* Named tensors: an owner's name table beside the registry (layout.h, NAMES).  The writer side
 * (publish, unpublish, and dropping the names of a freed record, called by the registry's own
 * remove and retract) runs in the owner; the reader side maps another process's table and checks
 * each name against the registry record it names. */
#ifndef VMM_REGISTRY_NAMES_H
#define VMM_REGISTRY_NAMES_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "registry/registry.h"

/* Entries of a table: 96 MiB of sparse object at most, pages backed as entries are first used. */
#define VMM__NAMES_CAPACITY (1u << 18)

/* Where a shard lies in its whole tensor (layout.h SHARDS), as vmm_shard in vmmshim.h. */
typedef struct vmm__name_shard {
    uint8_t mesh_ndim;
    uint8_t kind[VMM_NAMES_MESH_MAX_DIMS], dim[VMM_NAMES_MESH_MAX_DIMS];
    uint16_t mesh[VMM_NAMES_MESH_MAX_DIMS], coord[VMM_NAMES_MESH_MAX_DIMS];
    int64_t global_extent[VMM_NAMES_MESH_MAX_DIMS];
} vmm__name_shard;

/* One tensor to publish, as vmm_tensor_desc in vmmshim.h. */
typedef struct vmm__name_desc {
    const char *name;
    uint64_t address;
    uint8_t code, bits;
    uint16_t lanes;
    uint32_t ndim;
    const int64_t *shape;
    const int64_t *strides; /* in elements; NULL: row-major */
    const vmm__name_shard *shard; /* NULL: a whole tensor */
    uint64_t version;
} vmm__name_desc;

/* ---- writer (the owner, attached to r) ----
 * Publish n names at once, all or none: each name replaces a name published before (its entry is
 * rewritten in place).  0, or on failure (nothing changed) a one-line reason in err and
 * -EINVAL (a bad name, dtype, shape or strides; a name twice in one call), -ENOENT (an address
 * not in a live record of this process), -EACCES (memory the shim could not make exportable),
 * -ENOSPC (the table is full), -ENOMEM, or another -errno (the table's object could not be made). */
int vmm__names_publish(vmm__reg *r, const vmm__name_desc *d, size_t n, char *err, size_t errlen);
/* 0, or -ENOENT (no such name), -EINVAL (a bad name), with the reason in err. */
int vmm__names_unpublish(vmm__reg *r, const char *name, char *err, size_t errlen);
/* Record `slot` of this process is being freed: its names go.  Called by the registry's remove and
 * retract only while r->names_live is non-zero. */
void vmm__names_drop_slot(vmm__reg *r, uint32_t slot);
/* The job tag readers find this owner by (layout.h: job); at most 23 bytes.  0, -EINVAL, or the
 * table's making failed; the reason in err. */
int vmm__names_set_job(vmm__reg *r, const char *job, char *err, size_t errlen);
/* layout.h VERSIONS: the owner starts changing its tensors in place (weights_seq made odd; nested
 * updates count), and the device has done so (the last one stores version, weights_seq even).
 * update_end may run on a driver thread (a host function): it takes no lock but its own. */
int vmm__names_update_begin(vmm__reg *r, char *err, size_t errlen);
void vmm__names_update_end(vmm__reg *r, uint64_t version);
/* Detach or close: forget every name; with unlink_table, remove the table's object too. */
void vmm__names_release(vmm__reg *r, bool unlink_table);
/* In a fork child: the parent's table stays the parent's; nothing shared is touched. */
void vmm__names_forget_after_fork(vmm__reg *r);
/* Remove the table of (pid, start_time) beside r: gc for a dead owner, attach for a new image of
 * this process (exec keeps pid and start time). */
void vmm__names_unlink(const vmm__reg *r, uint32_t pid, uint64_t start_time);

/* Remove every table beside r whose owner is dead (its header names the owner), also one whose
 * proc slot was reclaimed before: gc.  Returns how many went. */
unsigned vmm__names_sweep(const vmm__reg *r);

/* ---- reader ---- */
typedef struct vmm__names_map {
    int fd;
    const uint8_t *base;
    size_t size;
    const vmm_names_header *hdr;
} vmm__names_map;
/* Map the table of owner (pid, start_time) beside r read-only.  0; -ENOENT when the owner has none
 * (it publishes no names); -EACCES; -ENOTSUP (a newer layout); -EAGAIN (still being made);
 * -EPROTO (not a valid table, or not that owner's); the reason in err. */
int vmm__names_open(const vmm__reg *r, uint32_t pid, uint64_t start_time, vmm__names_map *m, char *err, size_t errlen);
void vmm__names_close(vmm__names_map *m);
/* Check a mapped table as vmm__names_open does (for the fuzzer too): 0, -EPROTO, -ENOTSUP, -EAGAIN. */
int vmm__names_validate(const void *base, size_t size, uint32_t pid, uint64_t start_time, char *err, size_t errlen);
/* Every live entry of the table whose registry record still holds it (layout.h NAMES (2)); one
 * moment's names when the owner allows (changes), else each entry consistent on its own.  fn
 * returning non-zero stops the walk.  0, or -ENOMEM. */
typedef int (*vmm__names_fn)(void *ctx, const vmm_names_entry *e);
int vmm__names_for_each(const vmm__reg *r, const vmm__names_map *m, vmm__names_fn fn, void *ctx);
/* The table's VERSIONS state, read as layout.h says (seq odd: an update in progress). */
void vmm__names_state(const vmm__names_map *m, uint64_t *seq, uint64_t *version, char job[24]);
/* bytes a tensor spans: itemsize x (1 + sum((shape[i] - 1) x strides[i])); 0 when it has no
 * element; UINT64_MAX on overflow. */
uint64_t vmm__names_span(uint32_t itemsize, uint32_t ndim, const int64_t *shape, const int64_t *strides);

#endif
