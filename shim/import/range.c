/* Ranges across allocations: vmm_import_range maps the records under [address, address +
 * length) of one owner -- a buffer the owner's allocator made of several allocations side by
 * side, such as a PyTorch expandable segment -- as one contiguous mapping, each chunk whole at
 * the place its bytes have in the owner.  A range import owns its reservation and mappings
 * outright: nothing of it is in the chunk table or shared with another import, so it needs no
 * lock and no owner bookkeeping.  vmm_import_many plans its ranges with the same walk, layout and
 * placement.  Calls fetch.c, devices.c, cache.c (the shared reservation's parts), owners.c,
 * driver.c and records.c. */
#include <stdlib.h>
#include <string.h>

#include "import/internal.h"

/* arr with room for element n (moved, perhaps), or NULL with arr untouched. */
void *vmm__grow(void *arr, size_t *cap, size_t n, size_t elem)
{
    if (n < *cap) return arr;
    size_t c = *cap ? 2 * *cap : 16;
    void *p = c < SIZE_MAX / elem ? realloc(arr, c * elem) : NULL;
    if (p) *cap = c;
    return p;
}

/* Pooled records name their chunk; a record without a chunk id is a chunk of its own. */
bool vmm__same_chunk(const vmm_alloc_info *x, const vmm_alloc_info *y)
{
    return x->chunk_id && x->chunk_id == y->chunk_id && x->mapped_size == y->mapped_size &&
           (x->flags & VMM_ALLOC_MULTI_HANDLE) == (y->flags & VMM_ALLOC_MULTI_HANDLE) && x->n_handles == y->n_handles;
}

/* The live records covering the range, each starting where the one before ends.  Registry reads
 * only: a gap or a record that cannot be imported fails here, before any owner is asked. */
vmm_status vmm__range_walk(vmm_registry *reg, range_plan *p)
{
    for (uint64_t at = p->address; at < p->end;) {
        vmm_alloc_info a;
        const vmm_alloc_info *seen =
            p->hint && p->hint->address <= at && at - p->hint->address < p->hint->extent ? p->hint : NULL;
        for (size_t k = 0; k < p->n_seen && !seen; k++)
            if (p->seen[k].address <= at && at - p->seen[k].address < p->seen[k].extent) seen = &p->seen[k];
        vmm_status st = seen ? VMM_OK
                        : p->live ? vmm__find_cached_near(reg, p->pid, at, p->end - at, &a, p->live)
                                  : vmm__find(reg, p->pid, at, &a);
        if (seen) a = *seen;
        if (st == VMM_ERR_NOT_FOUND) {
            if (at == p->address)
                return set_err(VMM_ERR_NOT_FOUND, "pid %u has no live allocation at 0x%llx, where the range starts",
                               p->pid, (unsigned long long)at);
            return set_err(VMM_ERR_NOT_FOUND,
                           "pid %u has no live allocation at 0x%llx: its allocations cover the range 0x%llx..0x%llx "
                           "only up to there (a gap, or freed)",
                           p->pid, (unsigned long long)at, (unsigned long long)p->address,
                           (unsigned long long)p->end);
        }
        if (st != VMM_OK) return st; /* vmm_find's reason */
        /* each record after the first begins where the one before ends: one that begins inside it
         * was read at another moment (an allocation freed and its place reused during the walk) */
        if (p->n_rec && a.address != at)
            return set_err(VMM_ERR_STALE,
                           "pid %u's allocations changed while the range was read: the one holding 0x%llx begins at "
                           "0x%llx, inside the one before it (freed and its place reused meanwhile)",
                           p->pid, (unsigned long long)at, (unsigned long long)a.address);
        if (p->n_rec && (a.owner_start_time != p->rec[0].owner_start_time || a.owner_pidns != p->rec[0].owner_pidns))
            return set_err(VMM_ERR_NOT_FOUND,
                           "the allocation at 0x%llx belongs to another process with pid %u than the range's start "
                           "(an exited one's records stay until vmmctl gc)",
                           (unsigned long long)at, p->pid);
        if (a.owner_alive == VMM_OWNER_DEAD) return vmm__owner_dead(&a);
        if (a.flags & VMM_ALLOC_PAUSED) return vmm__paused(&a);
        if (!(a.handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD)))
            return set_err(VMM_ERR_ACCESS, "the range reaches pid %u's allocation at 0x%llx, which %s", p->pid,
                           (unsigned long long)a.address,
                           a.handle_kinds & VMM_KIND_FABRIC ? "offers only a FABRIC handle; this library imports fds"
                                                            : "is not exportable (its owner passed it through)");
        /* vmm_find returned the record holding `at`, so it ends past it: the walk moves on. */
        if (!a.mapped_size || a.chunk_offset >= a.mapped_size || a.extent > a.mapped_size - a.chunk_offset ||
            a.address > at || a.extent <= at - a.address || a.extent > UINT64_MAX - a.address)
            return set_err(VMM_ERR_INVALID,
                           "pid %u's allocation at 0x%llx does not lie inside its chunk (chunk_offset %llu, extent "
                           "%llu, mapped_size %llu)",
                           p->pid, (unsigned long long)a.address, (unsigned long long)a.chunk_offset,
                           (unsigned long long)a.extent, (unsigned long long)a.mapped_size);
        vmm_alloc_info *more = vmm__grow(p->rec, &p->cap_rec, p->n_rec, sizeof *p->rec);
        if (!more) return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
        p->rec = more;
        p->rec[p->n_rec++] = a;
        at = a.address + a.extent;
    }
    return VMM_OK;
}

/* Which chunk goes where.  Every chunk is mapped whole, at the place its bytes have in the owner,
 * so the chunks must lie back to back there (a PyTorch expandable segment's pages do); otherwise
 * the range cannot be one contiguous mapping here. */
vmm_status vmm__range_layout(range_plan *p)
{
    for (size_t i = 0; i < p->n_rec; i++) {
        const vmm_alloc_info *a = &p->rec[i];
        uint64_t lo = a->address > p->address ? a->address : p->address;
        uint64_t hi = a->address + a->extent < p->end ? a->address + a->extent : p->end;
        uint64_t from = a->chunk_offset + (lo - a->address), to = from + (hi - lo);
        piece *last = p->n_pc ? &p->pc[p->n_pc - 1] : NULL;
        if (last && vmm__same_chunk(&p->rec[last->last], a) && last->to == from) {
            last->to = to;
            last->last = i;
            continue;
        }
        /* a MULTI-HANDLE record's chunk may overlap its neighbour's: judged handle by handle once
         * their sizes are known (vmm__range_place) */
        bool multi = (p->rec[last ? last->last : i].flags | a->flags) & VMM_ALLOC_MULTI_HANDLE;
        if (last && !multi && (last->to != last->size || from != 0)) {
            const vmm_alloc_info *b = &p->rec[last->last];
            return set_err(VMM_ERR_INVALID,
                           "at 0x%llx pid %u's bytes pass from offset %llu of chunk %llu (%llu bytes) to offset %llu "
                           "of chunk %llu: the chunks do not lie back to back, so the range cannot be mapped as one",
                           (unsigned long long)lo, p->pid, (unsigned long long)last->to, (unsigned long long)b->chunk_id,
                           (unsigned long long)last->size, (unsigned long long)from, (unsigned long long)a->chunk_id);
        }
        piece *more = vmm__grow(p->pc, &p->cap_pc, p->n_pc, sizeof *p->pc);
        if (!more) return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
        p->pc = more;
        piece *k = &p->pc[p->n_pc++];
        memset(k, 0, sizeof *k);
        k->first = k->last = i;
        k->owner_at = lo;
        k->from = from;
        k->to = to;
        k->size = a->mapped_size;
    }
    return VMM_OK;
}

/* One handle per chunk, from its owner as vmm_import gets it.  A record whose chunk came with
 * another record's handle was not checked by the owner: it must still be the live allocation
 * the walk found (as a cached chunk's must, in vmm_import). */
static vmm_status range_fetch(vmm_registry *reg, range_plan *p)
{
    for (size_t k = 0; k < p->n_pc; k++) {
        piece *c = &p->pc[k];
        c->handle_of = k;
        for (size_t j = 0; j < k; j++)
            if (vmm__same_chunk(&p->rec[p->pc[j].first], &p->rec[c->first])) {
                c->handle_of = p->pc[j].handle_of;
                break;
            }
        if (c->handle_of != k) {
            c->handle = p->pc[c->handle_of].handle;
            continue;
        }
        const vmm_alloc_info *a = &p->rec[c->first];
        vmm_status st = a->flags & VMM_ALLOC_MULTI_HANDLE ? vmm__multi_fetch(reg, a, &c->parts)
                                                          : vmm__fetch_handle(reg, a, &c->handle);
        if (st != VMM_OK) {
            c->handle_of = SIZE_MAX; /* nothing to release */
            p->n_pc = k + 1;         /* the pieces after it have no handle either */
            return set_err(st, "importing pid %u's allocation at 0x%llx: %s", p->pid, (unsigned long long)a->address,
                           vmm__error_text());
        }
    }
    for (size_t k = 0; k < p->n_pc; k++)
        for (size_t i = p->pc[k].first; i <= p->pc[k].last; i++) {
            if (p->pc[k].handle_of == k && i == p->pc[k].first) continue; /* its owner checked it */
            vmm_status st = vmm__record_unchanged(reg, &p->rec[i]);
            if (st != VMM_OK)
                return set_err(st, "pid %u's allocation at 0x%llx: %s", p->pid,
                               (unsigned long long)p->rec[i].address, vmm__error_text());
        }
    return VMM_OK;
}

/* Drop the handles fetched: a mapping keeps its memory alive without them. */
static void range_release_handles(range_plan *p)
{
    for (size_t k = 0; k < p->n_pc; k++)
        if (p->pc[k].handle_of == k) {
            if (p->pc[k].parts.n)
                vmm__parts_release(&p->pc[k].parts, p->pc[k].parts.n);
            else
                (void)TWICE(vmm__import_cu.MemRelease(p->pc[k].handle));
        }
}

/* Unmap what was mapped (all of it, or what a failed import got to), free the reservation. */
vmm_status vmm__range_unmap(range_map *m)
{
    CUcontext cur;
    bool switched = vmm__ctx_enter(m->ctx, &cur);
    vmm_status st = VMM_OK;
    CUresult r;
    /* one call per mapping: a driver need not unmap several mappings in one call; the range is
     * not freed under a mapping the driver kept */
    for (size_t k = 0; k < m->n; k++)
        if (vmm__mapping_last(m->slab, m->shared, k) &&
            (r = TWICE(vmm__import_cu.MemUnmap(m->base + m->map[k].at, m->map[k].len))) != CUDA_SUCCESS && st == VMM_OK)
            st = vmm__cu_fail("cuMemUnmap", r);
    if (m->size && st == VMM_OK && m->slab)
        st = vmm__slab_put(m->slab);
    else if (m->size && st == VMM_OK && (r = TWICE(vmm__import_cu.MemAddressFree(m->base, m->size))) != CUDA_SUCCESS)
        st = vmm__cu_fail("cuMemAddressFree", r);
    if (switched) (void)TWICE(vmm__import_cu.CtxSetCurrent(cur));
    free(m->shared);
    free(m);
    return st;
}

/* Where each fetched handle lies in the owner, keeping those the range touches, in address
 * order.  A MULTI-HANDLE record's chunk names only its first handle, so the chunks of two
 * records may overlap (an allocation across segments 1 and 2 beside one across 2 and 3): a
 * handle at a place one is kept at already is that same segment (both records were live at
 * once), mapped once.  The kept handles must lie back to back over the whole range. */
vmm_status vmm__range_place(const range_plan *p, placed **out, size_t *n_out)
{
    size_t cap = 0;
    for (size_t k = 0; k < p->n_pc; k++) {
        const multi_parts *mp = &p->pc[p->pc[k].handle_of].parts;
        cap += mp->n ? mp->n : 1;
    }
    placed *v = calloc(cap, sizeof *v);
    if (!v) return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    size_t n = 0;
    uint64_t have = 0; /* the owner's bytes up to here are placed */
    vmm_status st = VMM_OK;
    for (size_t k = 0; k < p->n_pc && st == VMM_OK; k++) {
        const piece *c = &p->pc[k];
        const multi_parts *mp = &p->pc[c->handle_of].parts;
        const vmm_alloc_info *a = &p->rec[c->first];
        uint64_t at = a->address - a->chunk_offset;
        for (uint32_t i = 0; i < (mp->n ? mp->n : 1) && st == VMM_OK; i++) {
            uint64_t size = mp->n ? mp->size[i] : c->size;
            placed h = {at, size, mp->n ? mp->h[i] : c->handle};
            at += size;
            if (h.at + h.size <= p->address || h.at >= p->end) continue;
            if (n && h.at < have) {
                bool same = false;
                for (size_t j = 0; j < n && !same; j++) same = v[j].at == h.at && v[j].size == h.size;
                if (!same)
                    st = set_err(VMM_ERR_STALE,
                                 "pid %u's handle of %llu bytes at 0x%llx overlaps another one that does not start "
                                 "there: its segments changed while the range was imported",
                                 p->pid, (unsigned long long)h.size, (unsigned long long)h.at);
                continue;
            }
            if ((n && h.at != have) || (!n && h.at > p->address)) {
                st = set_err(VMM_ERR_INVALID,
                             "at 0x%llx pid %u's handles do not lie back to back (the next one starts at 0x%llx), so "
                             "the range cannot be mapped as one",
                             (unsigned long long)(n ? have : p->address), p->pid, (unsigned long long)h.at);
                break;
            }
            v[n++] = h;
            have = h.at + h.size;
        }
    }
    if (st == VMM_OK && (!n || have < p->end))
        st = set_err(VMM_ERR_INVALID, "pid %u's handles cover the range 0x%llx..0x%llx only up to 0x%llx", p->pid,
                     (unsigned long long)p->address, (unsigned long long)p->end, (unsigned long long)have);
    if (st != VMM_OK) {
        free(v);
        return st;
    }
    *out = v;
    *n_out = n;
    return VMM_OK;
}

/* Reserve the range's address space and map every placed handle at its place, read-write for
 * the n devices of acc.  *ptr: where the range's first byte is. */
static vmm_status range_map_all(const range_plan *p, CUcontext ctx, const CUmemAccessDesc *acc, size_t n_acc,
                                range_map **out, uint64_t *ptr)
{
    placed *v = NULL;
    size_t n = 0;
    vmm_status st = vmm__range_place(p, &v, &n);
    if (st != VMM_OK) return st;
    range_map *m = malloc(sizeof *m + n * sizeof m->map[0]);
    if (!m) {
        free(v);
        return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    }
    memset(m, 0, sizeof *m);
    m->ctx = ctx;
    size_t total = (size_t)(v[n - 1].at + v[n - 1].size - v[0].at);
    CUresult r = vmm__import_cu.MemAddressReserve(&m->base, total, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        free(m);
        free(v);
        return vmm__cu_fail("cuMemAddressReserve", r);
    }
    m->size = total;
    for (size_t k = 0; k < n; k++) {
        size_t at = (size_t)(v[k].at - v[0].at), len = (size_t)v[k].size;
        if ((r = vmm__import_cu.MemMap(m->base + at, len, 0, v[k].handle, 0)) != CUDA_SUCCESS) {
            (void)vmm__range_unmap(m);
            free(v);
            return vmm__cu_fail("cuMemMap", r);
        }
        m->map[m->n].at = at;
        m->map[m->n++].len = len;
    }
    *ptr = (uint64_t)m->base + (p->address - v[0].at);
    free(v);
    if ((r = vmm__import_cu.MemSetAccess(m->base, m->size, acc, n_acc)) != CUDA_SUCCESS) {
        (void)vmm__range_unmap(m);
        return vmm__cu_fail("cuMemSetAccess", r);
    }
    *out = m;
    return VMM_OK;
}

vmm_status vmm__import_range(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t length,
                                       vmm_imported **out)
{
    NEED(out, "out is NULL");
    *out = NULL;
    NEED(reg, "reg is NULL");
    NEED(pid != 0, "pid is 0");
    NEED(length != 0, "length is 0");
    NEED(address <= UINT64_MAX - length, "the range runs past the end of the address space");
    vmm__liveness_cache live = {0};
    range_plan p = {.live = &live, .pid = pid, .address = address, .end = address + length};
    vmm_status st = vmm__range_walk(reg, &p);
    CUcontext ctx = NULL;
    here_device here = {0, true};
    CUmemAccessDesc acc[2];
    size_t n_acc = 0;
    CUdevice use = 0;
    if (st == VMM_OK) st = vmm__cuda_ready();
    if (st == VMM_OK) st = vmm__current_context(&ctx, &here);
    /* the range's records are one owner's, side by side: the first one's device stands for all */
    if (st == VMM_OK) vmm__plan_access(&p.rec[0], here, acc, &n_acc, &use);
    if (st == VMM_OK) st = vmm__range_layout(&p);
    vmm_imported *imp = NULL;
    if (st == VMM_OK && !(imp = calloc(1, sizeof *imp))) st = set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    bool fetching = st == VMM_OK;
    if (fetching) st = range_fetch(reg, &p);
    range_map *m = NULL;
    uint64_t ptr = 0;
    if (st == VMM_OK) st = range_map_all(&p, ctx, acc, n_acc, &m, &ptr);
    if (fetching) range_release_handles(&p);
    if (st == VMM_OK) {
        imp->range = m;
        imp->ptr = ptr;
        imp->requested_size = length;
        imp->device = (int)use;
        imp->alloc = p.rec[0];
        imp->recs = p.rec; /* vmm_import_records */
        imp->n_recs = p.n_rec;
        p.rec = NULL;
        *out = imp;
    } else {
        free(imp);
    }
    free(p.rec);
    free(p.pc);
    return st;
}
