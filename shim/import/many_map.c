/* vmm_import_many, steps 3 and 4: one reservation for everything the call maps anew, each chunk
 * and each range across chunks at a place of its own in it (a segment two of them reach mapped
 * once), every handle mapped by the call's threads, one cuMemSetAccess per group of devices (on
 * the caller's thread, or on a thread of its own while the caller builds on the pointers);
 * then the new chunks enter the chunk cache and the ranges become range imports, each giving back
 * its part of the reservation when it goes.  cuMemSetAccess is an import's dear step on a GPU, so
 * laying out for one call per group is the point of this file.  Calls many_units.c, range.c,
 * cache.c, devices.c, driver.c and records.c. */
#include <stdlib.h>
#include <string.h>

#include "import/many.h"

/* The handles a new chunk maps: all of its unit's, back to back from where the chunk starts in the
 * owner. */
static vmm_status chunk_placed(const unit *u, placed **out, size_t *n)
{
    placed *v = calloc(u->n, sizeof *v);
    if (!v) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    uint64_t at = u->a.address - u->a.chunk_offset;
    for (uint32_t i = 0; i < u->n; i++) {
        v[i] = (placed){at, u->size[i], u->h[i]};
        at += u->size[i];
    }
    *out = v;
    *n = u->n;
    return VMM_OK;
}

/* The handles a range across chunks maps: vmm__range_place over its pieces' units. */
static vmm_status range_placed(many *m, many_range *r, placed **out, size_t *n)
{
    for (size_t k = 0; k < r->p.n_pc; k++) {
        piece *pc = &r->p.pc[k];
        const unit *u = &m->u[r->unit_of[k]];
        pc->handle_of = k;
        memset(&pc->parts, 0, sizeof pc->parts);
        if (u->a.flags & VMM_ALLOC_MULTI_HANDLE) {
            pc->parts.n = u->n; /* borrowed: the unit releases them */
            pc->parts.h = u->h;
            pc->parts.size = u->size;
        } else {
            pc->handle = u->h[0];
            pc->size = u->size[0];
        }
    }
    return vmm__range_place(&r->p, out, n);
}

/* By group, then where they start in the owner: consumers that reach the same segments meet. */
static int consumer_order(const void *x, const void *y)
{
    const consumer *a = x, *b = y;
    if (a->group != b->group) return a->group < b->group ? -1 : 1;
    if (a->v[0].at != b->v[0].at) return a->v[0].at < b->v[0].at ? -1 : 1;
    return a->is_range != b->is_range ? (a->is_range ? 1 : -1) : (a->index < b->index ? -1 : a->index > b->index);
}

/* A segment mapped in the call's reservation. */
typedef struct seg_place {
    uint64_t at, size; /* in the owner */
    uint32_t users;    /* consumers whose parts it is */
    uint32_t shared;   /* 1 + its counter in the slab, once users > 1 */
} seg_place;

/* Where each consumer lies in the reservation, and one map operation per segment of the owner.
 * Consumers of one group whose owner ranges overlap form a run laid out as the owner lays it out,
 * so a segment two of them reach is mapped once (access grants cost the same per mapping,
 * whatever its size).  A consumer whose handles do not coincide with the run's where they overlap
 * (records read at different moments: never seen, but not assumed) starts a run of its own.
 * Returns the reservation's size; sp (the segments, in op order) and ops are filled. */
static uint64_t many_layout(many *m, seg_place *sp, size_t *n_sp)
{
    uint64_t total = 0, run_base = 0, run_lo = 0, run_hi = 0, run_group = 0;
    size_t run_first = 0;
    for (size_t k = 0; k < m->n_cs; k++) {
        consumer *c = &m->cs[k];
        bool joins = k > 0 && c->group == run_group && c->v[0].at < run_hi;
        size_t at_seg = run_first;
        for (size_t j = 0; joins && j < c->nv && c->v[j].at < run_hi; j++) {
            while (at_seg < *n_sp && sp[at_seg].at < c->v[j].at) at_seg++;
            joins = at_seg < *n_sp && sp[at_seg].at == c->v[j].at && sp[at_seg].size == c->v[j].size;
        }
        if (!joins) {
            run_base = total;
            run_lo = run_hi = c->v[0].at;
            run_first = *n_sp;
            run_group = c->group;
        }
        c->at = run_base + (c->v[0].at - run_lo);
        at_seg = run_first;
        for (size_t j = 0; j < c->nv; j++) {
            const placed *v = &c->v[j];
            if (v->at < run_hi) {
                while (sp[at_seg].at < v->at) at_seg++;
                sp[at_seg].users++;
                c->shared[j] = (uint32_t)at_seg + 1; /* its segment, for now */
                continue;
            }
            sp[*n_sp] = (seg_place){v->at, v->size, 1, 0};
            c->shared[j] = (uint32_t)++*n_sp;
            m->ops[m->n_ops++] = (map_op){(CUdeviceptr)(run_base + (v->at - run_lo)), (size_t)v->size, v->handle, false};
            run_hi = v->at + v->size;
        }
        total = run_base + (run_hi - run_lo);
    }
    return total;
}

static void *map_worker(void *arg)
{
    many *m = arg;
    CUcontext cur = NULL;
    bool set =
        vmm__import_cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != m->ctx && vmm__import_cu.CtxSetCurrent(m->ctx) == CUDA_SUCCESS;
    for (;;) {
        size_t i = __atomic_fetch_add(&m->op_next, 1, __ATOMIC_RELAXED);
        if (i >= m->n_ops || vmm__many_failed(m)) break;
        map_op *op = &m->ops[i];
        uint64_t t0 = vmm__now_ns();
        CUresult r = vmm__import_cu.MemMap(op->va, op->len, 0, op->h, 0);
        __atomic_add_fetch(&m->map_ns, vmm__now_ns() - t0, __ATOMIC_RELAXED);
        if (r == CUDA_SUCCESS)
            op->done = true;
        else
            vmm__many_fail(m, vmm__cu_fail("cuMemMap", r));
    }
    if (set) (void)vmm__import_cu.CtxSetCurrent(cur);
    return NULL;
}

/* Lay out every consumer, reserve once, map every handle (vmm__many_grant grants access). */
vmm_status vmm__many_map(many *m)
{
    m->n_cs = m->n_nc;
    for (size_t i = 0; i < m->n; i++) m->n_cs += m->r[i].across;
    if (!m->n_cs) return VMM_OK;
    m->cs = calloc(m->n_cs, sizeof *m->cs);
    if (!m->cs) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    size_t k = 0;
    vmm_status st = VMM_OK;
    for (size_t i = 0; i < m->n_nc && st == VMM_OK; i++, k++) {
        consumer *c = &m->cs[k];
        c->index = (uint32_t)i;
        vmm__plan_access(&m->nc[i].a, m->here, c->acc, &c->n_acc, &c->use);
        st = chunk_placed(&m->u[m->nc[i].unit], &c->v, &c->nv);
    }
    for (size_t i = 0; i < m->n && st == VMM_OK; i++) {
        if (!m->r[i].across) continue;
        consumer *c = &m->cs[k++];
        c->is_range = true;
        c->index = (uint32_t)i;
        /* the range's records are one owner's, side by side: the first one's device stands for all */
        vmm__plan_access(&m->r[i].p.rec[0], m->here, c->acc, &c->n_acc, &c->use);
        if ((st = range_placed(m, &m->r[i], &c->v, &c->nv)) != VMM_OK) m->fail_range = i;
    }
    if (st != VMM_OK) return st;
    size_t n_ops = 0;
    for (k = 0; k < m->n_cs; k++) {
        consumer *c = &m->cs[k];
        c->size = c->v[c->nv - 1].at + c->v[c->nv - 1].size - c->v[0].at;
        c->group = vmm__device_bits(c->acc, c->n_acc) << 1 | (c->n_acc > 1);
        n_ops += c->nv;
        if (!(c->shared = calloc(c->nv, sizeof *c->shared))) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    qsort(m->cs, m->n_cs, sizeof *m->cs, consumer_order);
    for (k = 0; k < m->n_cs; k++) {
        if (m->cs[k].is_range)
            m->r[m->cs[k].index].consumer = (uint32_t)k;
        else
            m->nc[m->cs[k].index].consumer = (uint32_t)k;
    }
    m->s = calloc(1, sizeof *m->s);
    m->ops = calloc(n_ops, sizeof *m->ops);
    seg_place *sp = calloc(n_ops, sizeof *sp);
    if (!m->s || !m->ops || !sp) {
        free(sp);
        return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    size_t n_sp = 0;
    uint64_t total = many_layout(m, sp, &n_sp);
    /* the segments more than one consumer reaches get a counter; the others are their part's alone */
    uint32_t n_shared = 0;
    for (size_t i = 0; i < n_sp; i++)
        if (sp[i].users > 1) sp[i].shared = ++n_shared;
    if (n_shared && !(m->s->shared_refs = calloc(n_shared, sizeof *m->s->shared_refs))) {
        free(sp);
        return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    for (size_t i = 0; i < n_sp; i++)
        if (sp[i].shared) m->s->shared_refs[sp[i].shared - 1] = sp[i].users;
    for (k = 0; k < m->n_cs; k++)
        for (size_t j = 0; j < m->cs[k].nv; j++) m->cs[k].shared[j] = sp[m->cs[k].shared[j] - 1].shared;
    free(sp);
    uint64_t t0 = vmm__now_ns();
    CUresult r = vmm__import_cu.MemAddressReserve(&m->s->base, (size_t)total, 0, 0, 0);
    vmm__mt.reserve_ns += vmm__now_ns() - t0;
    vmm__mt.reserves++;
    if (r != CUDA_SUCCESS) {
        free(m->s->shared_refs);
        free(m->s);
        m->s = NULL;
        return vmm__cu_fail("cuMemAddressReserve", r);
    }
    m->s->size = (size_t)total;
    for (size_t i = 0; i < m->n_ops; i++) m->ops[i].va += m->s->base; /* many_layout gave offsets */
    vmm__mt.maps = (uint32_t)m->n_ops;
    m->op_next = 0;
    vmm__crew_run(m->threads < m->n_ops ? m->threads : (uint32_t)m->n_ops, map_worker, m);
    if (m->st != VMM_OK) return set_err(m->st, "%s", m->why);
    return VMM_OK;
}

/* One SetAccess over each group's consumers, laid out back to back (overlapping within a run) and
 * all mapped.  Runs on the caller's thread or on vmm_import_many_begin's granting thread: its
 * time goes to m, not to a thread's vmm__mt. */
vmm_status vmm__many_grant(many *m)
{
    for (size_t k = 0; k < m->n_cs;) {
        size_t j = k;
        uint64_t end = m->cs[k].at + m->cs[k].size;
        while (j + 1 < m->n_cs && m->cs[j + 1].group == m->cs[k].group) {
            j++;
            if (m->cs[j].at + m->cs[j].size > end) end = m->cs[j].at + m->cs[j].size;
        }
        uint64_t t1 = vmm__now_ns();
        CUresult r =
            vmm__import_cu.MemSetAccess(m->s->base + m->cs[k].at, (size_t)(end - m->cs[k].at), m->cs[k].acc, m->cs[k].n_acc);
        m->access_ns += vmm__now_ns() - t1;
        m->access_calls++;
        if (r != CUDA_SUCCESS) return vmm__cu_fail("cuMemSetAccess", r);
        k = j + 1;
    }
    return VMM_OK;
}

/* Undo what vmm__many_map made of the reservation (nothing has been handed out): unmap each mapping,
 * free the range unless the driver kept a mapping in it. */
void vmm__many_unmap(many *m)
{
    if (!m->s) return;
    bool kept = false;
    for (size_t i = 0; i < m->n_ops; i++)
        if (m->ops[i].done) kept |= TWICE(vmm__import_cu.MemUnmap(m->ops[i].va, m->ops[i].len)) != CUDA_SUCCESS;
    if (!kept && m->s->size) (void)TWICE(vmm__import_cu.MemAddressFree(m->s->base, m->s->size));
    free(m->s->shared_refs);
    free(m->s);
    m->s = NULL;
}

/* A consumer that could not be handed out gives back its part of the reservation. */
static void consumer_drop(slab *s, const consumer *c)
{
    bool kept = false;
    for (size_t j = 0; j < c->nv; j++)
        if (vmm__mapping_last(s, c->shared, j))
            kept |= TWICE(vmm__import_cu.MemUnmap(s->base + c->at + (c->v[j].at - c->v[0].at), (size_t)c->v[j].size)) !=
                    CUDA_SUCCESS;
    if (!kept) (void)vmm__slab_put(s);
}

/* How far range r's first byte lies from the start of the mapping that serves it: its chunk's or,
 * across chunks, its own (the consumer's). */
static uint64_t range_offset(const many *m, const many_range *r)
{
    if (r->across) return r->p.address - m->cs[r->consumer].v[0].at;
    const vmm_alloc_info *a = &r->p.rec[0];
    return a->chunk_offset + (r->p.address - a->address);
}

void vmm__many_place(const many *m, size_t i, uint64_t *ptr, int *device)
{
    const many_range *r = &m->r[i];
    if (r->c) { /* a chunk mapped here before the call */
        *ptr = (uint64_t)r->c->base + range_offset(m, r);
        *device = (int)r->use;
        return;
    }
    const consumer *c = r->across ? &m->cs[r->consumer] : &m->cs[m->nc[r->fresh - 1].consumer];
    *ptr = (uint64_t)m->s->base + c->at + range_offset(m, r);
    *device = (int)c->use;
}

/* The new chunks into the chunk table, the ranges across chunks as range maps: what out[] holds.
 * Cannot fail but for a chunk another thread mapped meanwhile, whose grant may. */
vmm_status vmm__many_hand_out(many *m, vmm_imported **out)
{
    slab *s = m->s; /* NULL when every range's chunk was mapped here already */
    if (s) s->refs = m->n_cs;
    m->s = NULL; /* from here each consumer gives its part back */
    vmm_status st = VMM_OK;
    for (size_t k = 0; k < m->n_cs; k++) {
        consumer *c = &m->cs[k];
        if (c->is_range) continue;
        new_chunk *n = &m->nc[c->index];
        chunk *fresh = calloc(1, sizeof *fresh);
        uint64_t *len = calloc(c->nv, sizeof *len);
        if (!fresh || !len) { /* the mapping goes: the ranges in it fail below */
            free(fresh);
            free(len);
            consumer_drop(s, c);
            st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
            continue;
        }
        for (size_t j = 0; j < c->nv; j++) len[j] = c->v[j].size;
        fresh->key = n->key;
        fresh->owner = m->owner;
        fresh->base = s->base + c->at;
        fresh->size = (size_t)c->size;
        fresh->n_parts = (uint32_t)c->nv;
        fresh->part_len = len;
        fresh->slab = s;
        fresh->shared = c->shared;
        c->shared = NULL;
        fresh->ctx = m->ctx;
        fresh->devices = vmm__device_bits(c->acc, c->n_acc);
        fresh->refs = n->users; /* one reference per range in it */
        n->c = vmm__chunk_enter(fresh, m->reg, &n->a);
        if (n->c != fresh) { /* another thread mapped it meanwhile: use that mapping, drop ours */
            (void)vmm__unmap_chunk(fresh);
            vmm__chunk_free(fresh);
            CUdevice use;
            vmm_status g = vmm__grant_device(n->c, &n->a, m->here, &use);
            if (g != VMM_OK && st == VMM_OK) st = g;
        }
    }
    for (size_t i = 0; i < m->n; i++) {
        many_range *r = &m->r[i];
        vmm_imported *imp = calloc(1, sizeof *imp);
        if (!imp) st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
        if (r->across) {
            consumer *c = &m->cs[r->consumer];
            range_map *rm = malloc(sizeof *rm + c->nv * sizeof rm->map[0]);
            if (!rm) {
                st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
                consumer_drop(s, c);
                free(imp);
                continue;
            }
            memset(rm, 0, sizeof *rm);
            rm->base = s->base + c->at;
            rm->size = (size_t)c->size;
            rm->slab = s;
            rm->shared = c->shared;
            c->shared = NULL;
            rm->ctx = m->ctx;
            for (size_t j = 0; j < c->nv; j++) {
                rm->map[rm->n].at = (size_t)(c->v[j].at - c->v[0].at);
                rm->map[rm->n++].len = (size_t)c->v[j].size;
            }
            if (!imp) {
                (void)vmm__range_unmap(rm);
                continue;
            }
            imp->range = rm;
            imp->ptr = (uint64_t)rm->base + range_offset(m, r);
            imp->device = (int)c->use;
        } else {
            chunk *ch = r->c ? r->c : m->nc[r->fresh - 1].c;
            if (!r->c) r->use = m->cs[m->nc[r->fresh - 1].consumer].use;
            r->c = NULL; /* the import holds the reference now (or gives it back below) */
            if (!ch) {
                free(imp);
                continue; /* its chunk could not be made: its references never existed */
            }
            if (!imp) {
                (void)vmm__chunk_unref(ch);
                continue;
            }
            const vmm_alloc_info *a = &r->p.rec[0];
            imp->c = ch;
            imp->ptr = (uint64_t)ch->base + range_offset(m, r);
            imp->alloc = *a;
            imp->device = (int)r->use;
        }
        imp->requested_size = r->p.end - r->p.address;
        imp->alloc = r->p.rec[0];
        imp->recs = r->p.rec; /* vmm_import_records */
        imp->n_recs = r->p.n_rec;
        r->p.rec = NULL;
        out[i] = imp;
    }
    return st;
}
