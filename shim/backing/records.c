/* Registry records: one per allocation of the shim's (MULTI-HANDLE when it spans segments),
 * published under vmm__S.lock so the broker never sees a half-published block, and retracted
 * before the memory can be reused; one per range the program maps itself (adopt.c's); and one,
 * flagged not exportable, per allocation the real allocator made that the shim notes.  The
 * coverage counters say which of these became of each allocation (state.c keeps them). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backing/internal.h"
#include "broker/protocol.h"
#include "core/log.h"

/* tag: the tag number the allocation carries (its pool's, or the thread's for what is not the pool's). */
static void fill_common(vmm_reg_alloc *d, int dev, uint32_t api, CUstream stream, uint64_t requested,
                        const vmm__frames *f, uint32_t tag)
{
    memset(d, 0, sizeof *d);
    d->device = (uint32_t)dev;
    d->api = api;
    memcpy(d->device_uuid, vmm__S.dev[dev].uuid, 16);
    d->requested_size = requested;
    d->stream = (uint64_t)(uintptr_t)stream;
    d->exported_fd = -1;
    memcpy(d->tag, vmm__tag_name(tag), sizeof d->tag);
    d->n_frames = f->n;
    memcpy(d->frames, f->pc, f->n * sizeof f->pc[0]); /* the rest stays zero: no stack bytes in shared memory */
}

/* An allocation the shim backed that got no record: counted (layout.h, COVERAGE: unpublished),
 * and said once.  Once per process, not once per time the registry fills: the line tells what
 * happened and where to look, the counter in `vmmctl ps` tells how often, and a registry
 * hovering at its capacity (a free, then an allocation that fits, then one that does not) would
 * otherwise say it again at every turn.  A fork child says it again (after_fork_child): it is
 * another process, with a record and counters of its own. */
static void unpublished_locked(int rc)
{
    vmm__count(&vmm__coverage_now()->unpublished);
    if (vmm__S.unpublished_said) return;
    vmm__S.unpublished_said = 1;
    if (rc == -ENOSPC)
        vmm__log(VMM__LOG_WARNING,
                 "the registry is full (%llu records): this and later allocations go unpublished, counted in vmmctl ps "
                 "(raise VMMSHIM_REGISTRY_CAPACITY)",
                 (unsigned long long)vmm__S.reg.hdr->capacity);
    else
        vmm__log(VMM__LOG_WARNING,
                 "cannot publish an allocation in the registry (%s): it and later ones that cannot go unpublished, "
                 "counted in vmmctl ps",
                 strerror(-rc));
}

/* One record per allocation: bound (and indexed) at its address and extent, published with the
 * segments it spans.  Under vmm__S.lock, so the broker never sees a half-published block. */
void vmm__publish_locked(vmm__block *b, CUstream stream, const vmm__frames *f)
{
    b->slot = NO_SLOT;
    if (!vmm__S.registry_ok) return;
    uint32_t n;
    uint64_t bytes;
    vmm__seg *first = vmm__span_of(b, &n, &bytes);
    vseg *c = first->mech;
    vmm_reg_alloc d;
    fill_common(&d, c->dev, b->api, stream, b->requested, f, b->arena->pool->tag);
    d.mapped_size = bytes;
    d.chunk_id = c->id;
    d.chunk_offset = b->addr - first->base;
    d.flags = b->size < bytes ? VMM_REG_F_SHARED_CHUNK : 0;
    d.handle_kinds = __atomic_load_n(&vmm__S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
    if (n > 1) { /* pidfd and fabric name one handle */
        d.flags |= VMM_REG_F_MULTI_HANDLE;
        d.n_handles = n;
    } else {
        d.n_handles = 1;
        if (c->exported_fd >= 0) {
            d.handle_kinds |= VMM_HANDLE_PIDFD;
            d.exported_fd = c->exported_fd;
        }
        if (c->has_fabric) {
            d.handle_kinds |= VMM_HANDLE_FABRIC;
            memcpy(d.fabric, c->fabric, sizeof d.fabric);
        }
    }
    vmm_reg_alloc out;
    int rc = vmm__reg_add(&vmm__S.reg, b->addr, b->size, &d, &b->slot, &out);
    if (rc != 0) {
        b->slot = NO_SLOT;
        unpublished_locked(rc);
        return;
    }
    b->generation = out.generation;
    memcpy(b->alloc_id, out.alloc_id, 16);
    HASH_ADD(hs, vmm__S.by_slot, slot, sizeof(uint32_t), b);
}

void vmm__retract_locked(vmm__block *b)
{
    if (b->slot == NO_SLOT) return;
    HASH_DELETE(hs, vmm__S.by_slot, b);
    vmm__reg_remove(&vmm__S.reg, b->slot); /* out of the registry before any reuse */
    b->slot = NO_SLOT;
}

void vmm__note_passthrough(vmm__result why, void *ptr, size_t size, uint32_t api, CUstream stream)
{
    if (!ptr || size == 0) return; /* no allocation was made */
    vmm_reg_proc *c = vmm__coverage_now();
    switch (why) {
    case VMM__DISABLED: vmm__count_disabled(); return;
    case VMM__UNSUPPORTED: vmm__count(&c->passed_unsupported); break;
    case VMM__OWN_POOL: vmm__count(&c->passed_unsupported); break;
    case VMM__NOMEM: vmm__count(&c->passed_device_full); break;
    case VMM__CAPTURED: vmm__count(&c->passed_capture); break;
    default: return;
    }
    vmm__count(&c->allocs);
    if (why == VMM__UNSUPPORTED || !vmm__S.ready || !vmm__S.registry_ok) return;
    note *n = calloc(1, sizeof *n);
    if (!n) return;
    n->va = (uint64_t)(uintptr_t)ptr;
    n->size = size;
    n->slot = NO_SLOT;
    CUcontext ctx;
    int dev = vmm__current_device(&ctx, 0);
    if (dev < 0) dev = 0;
    n->dev = dev;
    vmm__frames f;
    vmm__frames_capture(&f);
    pthread_mutex_lock(&vmm__S.lock);
    note *old = NULL;
    HASH_FIND(hh, vmm__S.notes, &n->va, sizeof n->va, old);
    if (old) {
        pthread_mutex_unlock(&vmm__S.lock);
        free(n);
        return;
    }
    vmm_reg_alloc d;
    fill_common(&d, dev, api, stream, size, &f, vmm__thread_tag);
    d.flags = VMM_REG_F_NOT_EXPORTABLE;
    if (vmm__reg_add(&vmm__S.reg, n->va, size, &d, &n->slot, NULL) != 0) n->slot = NO_SLOT;
    HASH_ADD(hh, vmm__S.notes, va, sizeof(uint64_t), n);
    pthread_mutex_unlock(&vmm__S.lock);
}

void vmm__publish_range(uint64_t address, uint64_t extent, uint64_t handle_size, uint64_t handle_offset,
                        uint64_t chunk_id, int dev, int exportable, const vmm__frames *f, vmm__published *out)
{
    out->slot = NO_SLOT;
    if (!vmm__S.registry_ok) return;
    vmm__start_broker();
    vmm_reg_alloc d;
    fill_common(&d, dev, VMM_API_CU_MEM_MAP, NULL, extent, f, vmm__thread_tag);
    d.mapped_size = handle_size;
    d.chunk_id = chunk_id;
    d.chunk_offset = handle_offset;
    if (exportable) d.handle_kinds = __atomic_load_n(&vmm__S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
    else d.flags = VMM_REG_F_NOT_EXPORTABLE;
    vmm_reg_alloc pub;
    if (vmm__reg_add(&vmm__S.reg, address, extent, &d, &out->slot, &pub) != 0) {
        out->slot = NO_SLOT;
        return;
    }
    out->generation = pub.generation;
    memcpy(out->alloc_id, pub.alloc_id, 16);
}

void vmm__retract_range(vmm__published *pub)
{
    if (pub->slot != NO_SLOT) vmm__reg_remove(&vmm__S.reg, pub->slot);
    pub->slot = NO_SLOT;
}

void vmm__range_set_paused(const vmm__published *pub, int paused, uint64_t chunk_id, int exportable)
{
    if (pub->slot == NO_SLOT || !vmm__S.registry_ok) return;
    uint32_t kinds = exportable && __atomic_load_n(&vmm__S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
    vmm__reg_set_paused(&vmm__S.reg, pub->slot, paused, paused ? 0 : chunk_id, paused ? 0 : kinds, -1, NULL);
}

/* ---- lookups by address (backing.c's frees and queries, sleep.c's host copies) ---- */

/* The arena of one of the shim's pools holding p (allocated, free or not mapped), or NULL. */
vmm__arena *vmm__arena_containing_locked(uint64_t p)
{
    for (int i = 0; i < MAX_DEVICES; i++) {
        if (!vmm__S.dev[i].pool_ready) continue;
        VMM__FOR_POOLS(&vmm__S.dev[i], q, k) {
            vmm__arena *a = vmm__pool_arena_at(q, p);
            if (a) return a;
        }
    }
    return NULL;
}

/* The live allocation whose [addr, addr + requested) holds p. */
vmm__block *vmm__block_containing_locked(uint64_t p)
{
    vmm__block *b = NULL;
    HASH_FIND(hh, vmm__S.by_addr, &p, sizeof p, b);
    if (!b) {
        vmm__arena *a = vmm__arena_containing_locked(p);
        if (!a) return NULL;
        vmm_reg_alloc rec;
        uint64_t slot;
        if (vmm__S.registry_ok && vmm__reg_find(&vmm__S.reg, vmm__S.reg.pid, p, &rec, &slot) == 0) {
            uint32_t key = (uint32_t)slot;
            HASH_FIND(hs, vmm__S.by_slot, &key, sizeof key, b);
        } else {
            b = vmm__pool_block_at(a, a->pool->granule, p); /* unpublished: walk the arena */
        }
    }
    return b && b->live && p - b->addr < b->requested + (b->requested == 0) ? b : NULL;
}
