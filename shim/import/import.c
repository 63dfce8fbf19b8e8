/* The public single import: vmm_import maps an allocation's whole chunk once per process and
 * shares it through the chunk cache, so that importing from a chunk mapped already costs a
 * registry read; vmm_import_check, the accessors and vmm_import_release serve every kind of
 * import (one allocation, a range, a batch), since they all hand out the same vmm_imported.
 * The fd comes from the owner's broker or pidfd_getfd (fetch.c); a MULTI-HANDLE record's handles
 * are mapped back to back in one reservation.  Calls fetch.c, cache.c, devices.c, range.c (a
 * range's unmap), owners.c, driver.c and records.c; of the folder only many.c (vmm__importable)
 * and copy.c (the accessors) call in. */
#include <stdlib.h>
#include <string.h>

#include "registry/registry.h"

#include "import/internal.h"

/* Map all of the chunk behind handle (consumed: released on failure) read-write for the n
 * devices of acc. */
static vmm_status map_chunk(CUmemGenericAllocationHandle handle, size_t size, const CUmemAccessDesc *acc, size_t n,
                            chunk *c)
{
    c->handle = handle;
    CUresult r;
    const char *what;
    uint64_t t0 = vmm__now_ns();
    r = vmm__import_cu.MemAddressReserve(&c->base, size, 0, 0, 0);
    uint64_t t1 = vmm__now_ns();
    vmm__tm.reserve_ns = t1 - t0;
    bool reserved = false, mapped = false;
    if (r != CUDA_SUCCESS) {
        what = "cuMemAddressReserve";
        goto undo;
    }
    reserved = true;
    r = vmm__import_cu.MemMap(c->base, size, 0, c->handle, 0);
    uint64_t t2 = vmm__now_ns();
    vmm__tm.map_ns = t2 - t1;
    if (r != CUDA_SUCCESS) {
        what = "cuMemMap";
        goto undo;
    }
    mapped = true;
    r = vmm__import_cu.MemSetAccess(c->base, size, acc, n);
    vmm__tm.access_ns = vmm__now_ns() - t2;
    if (r != CUDA_SUCCESS) {
        what = "cuMemSetAccess";
        goto undo;
    }
    c->size = size;
    c->devices = vmm__device_bits(acc, n);
    return VMM_OK;
undo:
    (void)vmm__undo(c->base, size, c->handle, mapped, reserved);
    return vmm__cu_fail(what, r);
}

/* Map a MULTI-HANDLE allocation's handles (consumed: released either way) back to back in one
 * reservation, read-write for the n devices of acc, with one cuMemSetAccess over the whole. */
static vmm_status map_multi(multi_parts *p, size_t size, const CUmemAccessDesc *acc, size_t n, chunk *c)
{
    c->part_len = malloc(p->n * sizeof *c->part_len);
    if (!c->part_len) {
        vmm__parts_release(p, p->n);
        return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    }
    CUresult r;
    const char *what = "cuMemAddressReserve";
    uint64_t t0 = vmm__now_ns();
    r = vmm__import_cu.MemAddressReserve(&c->base, size, 0, 0, 0);
    uint64_t t1 = vmm__now_ns();
    vmm__tm.reserve_ns = t1 - t0;
    c->size = size;
    c->n_parts = 0;
    if (r == CUDA_SUCCESS) {
        uint64_t at = 0;
        for (uint32_t i = 0; i < p->n && r == CUDA_SUCCESS; at += p->size[i++]) {
            what = "cuMemMap";
            if ((r = vmm__import_cu.MemMap(c->base + at, p->size[i], 0, p->h[i], 0)) == CUDA_SUCCESS)
                c->part_len[c->n_parts++] = p->size[i];
        }
    }
    uint64_t t2 = vmm__now_ns();
    vmm__tm.map_ns = t2 - t1;
    if (r == CUDA_SUCCESS) {
        what = "cuMemSetAccess";
        r = vmm__import_cu.MemSetAccess(c->base, size, acc, n);
        vmm__tm.access_ns = vmm__now_ns() - t2;
    }
    vmm__parts_release(p, p->n); /* mapped, they keep their memory; unmapped, it goes */
    if (r != CUDA_SUCCESS) {
        vmm_status st = vmm__cu_fail(what, r);
        if (c->base) {
            uint64_t at = 0;
            bool kept = false;
            for (uint32_t i = 0; i < c->n_parts; at += c->part_len[i++])
                kept |= TWICE(vmm__import_cu.MemUnmap(c->base + at, c->part_len[i])) != CUDA_SUCCESS;
            if (!kept) (void)TWICE(vmm__import_cu.MemAddressFree(c->base, size));
        }
        free(c->part_len);
        c->part_len = NULL;
        c->n_parts = 0;
        return st;
    }
    c->devices = vmm__device_bits(acc, n);
    return VMM_OK;
}

static vmm_status import_chunk(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported *imp)
{
    CUcontext ctx;
    here_device here;
    CUdevice use = 0;
    uint64_t t0 = vmm__now_ns();
    vmm_status st = vmm__current_context(&ctx, &here);
    uint64_t t1 = vmm__now_ns();
    vmm__tm.context_ns = t1 - t0;
    if (st != VMM_OK) return st;

    chunk_key k = vmm__key_of(alloc);
    pthread_mutex_lock(&vmm__chunks_lock);
    chunk *c = vmm__chunk_ref_locked(&k);
    pthread_mutex_unlock(&vmm__chunks_lock);
    if (c) { /* mapped already: no broker, no import, no mapping */
        vmm__tm.cached = 1;
        if ((st = vmm__still_live(reg, alloc, c->owner)) != VMM_OK ||
            (st = vmm__grant_device(c, alloc, here, &use)) != VMM_OK) {
            (void)vmm__chunk_unref(c);
            return st;
        }
        pthread_mutex_lock(&vmm__chunks_lock);
        vmm__set_witness_locked(c, reg, alloc);
        pthread_mutex_unlock(&vmm__chunks_lock);
        vmm__tm.lookup_ns = vmm__now_ns() - t1;
    } else {
        vmm__tm.lookup_ns = vmm__now_ns() - t1;
        owner_ref *o;
        if ((st = vmm__owner_get(alloc, &o)) != VMM_OK) return st;
        CUmemGenericAllocationHandle handle = 0;
        CUmemAccessDesc acc[2];
        size_t n_acc;
        vmm__plan_access(alloc, here, acc, &n_acc, &use);
        chunk *fresh = calloc(1, sizeof *fresh);
        if (!fresh) st = set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
        if (alloc->flags & VMM_ALLOC_MULTI_HANDLE) {
            multi_parts parts;
            if (st == VMM_OK) st = vmm__multi_fetch(reg, alloc, &parts);
            if (st == VMM_OK) st = map_multi(&parts, (size_t)alloc->mapped_size, acc, n_acc, fresh);
        } else {
            if (st == VMM_OK) st = vmm__fetch_handle(reg, alloc, &handle);
            if (st == VMM_OK) st = map_chunk(handle, (size_t)alloc->mapped_size, acc, n_acc, fresh);
        }
        if (st != VMM_OK) {
            vmm__owner_put(o);
            if (fresh) vmm__chunk_free(fresh);
            return st;
        }
        fresh->key = k;
        fresh->ctx = ctx;
        fresh->refs = 1;
        fresh->owner = o;
        c = vmm__chunk_enter(fresh, reg, alloc);
        vmm__owner_put(o);
        if (c != fresh) { /* another thread mapped it meanwhile: use that mapping, drop ours */
            (void)vmm__unmap_chunk(fresh);
            vmm__chunk_free(fresh);
            if ((st = vmm__grant_device(c, alloc, here, &use)) != VMM_OK) {
                (void)vmm__chunk_unref(c);
                return st;
            }
        }
    }
    imp->c = c;
    imp->ptr = (uint64_t)c->base + alloc->chunk_offset;
    imp->device = (int)use;
    return VMM_OK;
}

/* Can vmm_import map this record's chunk?  Its reason when not. */
vmm_status vmm__importable(vmm_registry *reg, const vmm_alloc_info *alloc)
{
    if (alloc->flags & VMM_ALLOC_PAUSED) return vmm__paused(alloc);
    NEED(alloc->mapped_size != 0, "alloc->mapped_size is 0");
    uint64_t span = alloc->extent > alloc->requested_size ? alloc->extent : alloc->requested_size;
    NEED(alloc->chunk_offset < alloc->mapped_size && span <= alloc->mapped_size - alloc->chunk_offset,
         "the allocation does not lie inside its chunk (chunk_offset, extent, mapped_size)");
    if (alloc->flags & VMM_ALLOC_MULTI_HANDLE) {
        NEED(alloc->n_handles >= 2, "a multi-handle record with fewer than 2 handles (n_handles)");
        if (!(alloc->handle_kinds & VMM_KIND_BROKER))
            return set_err(VMM_ERR_ACCESS, "the allocation spans %u handles, which only its owner's broker hands out, "
                                           "and the record offers no broker",
                           alloc->n_handles);
    } else if (!(alloc->handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD))) {
        int unused;
        return vmm__fetch_fd(reg, alloc, &unused); /* its reason */
    }
    return VMM_OK;
}

vmm_status vmm__import(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported **out)
{
    uint64_t t0 = vmm__now_ns();
    memset(&vmm__tm, 0, sizeof vmm__tm);
    NEED(out, "out is NULL");
    *out = NULL;
    NEED(reg, "reg is NULL");
    NEED(alloc, "alloc is NULL");
    NEED(alloc->pid != 0, "alloc->pid is 0");
    vmm_status st = vmm__importable(reg, alloc);
    if (st != VMM_OK) return st;
    uint64_t span = alloc->extent > alloc->requested_size ? alloc->extent : alloc->requested_size;
    st = vmm__cuda_ready();
    if (st != VMM_OK) return st;
    vmm_imported *imp = calloc(1, sizeof *imp);
    if (!imp) return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    if ((st = import_chunk(reg, alloc, imp)) != VMM_OK) {
        free(imp);
        return st;
    }
    imp->requested_size = alloc->requested_size ? alloc->requested_size : span;
    imp->alloc = *alloc;
    *out = imp;
    vmm__tm.total_ns = vmm__now_ns() - t0;
    return VMM_OK;
}

vmm_status vmm__import_check(vmm_registry *reg, const vmm_imported *imp)
{
    NEED(reg, "reg is NULL");
    NEED(imp, "imp is NULL");
    NEED(!imp->range, "a range import: check the records of its range with vmm_find");
    vmm_status st = vmm__record_unchanged(reg, &imp->alloc);
    if (st == VMM_ERR_STALE && vmm__owner_liveness(&imp->alloc) == VMM__DEAD) return vmm__owner_dead(&imp->alloc);
    if (st != VMM_OK) return st;
    if (vmm__owner_exited(imp->c->owner) && !vmm__kept_now(reg, &imp->alloc)) return vmm__owner_dead(&imp->alloc);
    return VMM_OK;
}

vmm_status vmm__import_last_timing(vmm_import_timing *out)
{
    NEED(out, "out is NULL");
    *out = vmm__tm;
    return VMM_OK;
}

uint64_t vmm__import_ptr(const vmm_imported *imp) { return imp ? imp->ptr : 0; }

uint64_t vmm__import_size(const vmm_imported *imp) { return imp ? imp->requested_size : 0; }

int vmm__import_device(const vmm_imported *imp) { return imp ? imp->device : -1; }

size_t vmm__import_records(const vmm_imported *imp, vmm_alloc_info *out, size_t max)
{
    if (!imp) return 0;
    const vmm_alloc_info *r = imp->recs ? imp->recs : &imp->alloc;
    size_t n = imp->recs ? imp->n_recs : 1;
    for (size_t i = 0; out && i < n && i < max; i++) out[i] = r[i];
    return n;
}

vmm_status vmm__import_release(vmm_imported *imp)
{
    if (!imp) return VMM_OK;
    vmm_status st = imp->range ? vmm__range_unmap(imp->range) : vmm__chunk_unref(imp->c);
    free(imp->recs);
    free(imp);
    return st;
}
