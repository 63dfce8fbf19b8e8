/* vmm_import_many in four steps, each done once for the whole call rather than once per range:
 *   1. find: the records under every range (registry reads only; a range that cannot be
 *      imported fails here, before the owner is asked), and which ranges lie in a chunk mapped
 *      here already (a reference, nothing fetched);
 *   2. fetch: every handle the other ranges need, each asked for once ("units"), in one broker
 *      round trip (protocol v3, fds streamed 64 a message), each imported as it arrives, by
 *      VMMSHIM_IMPORT_THREADS threads;
 *   3. map: one reservation for everything new, each chunk and each range across chunks at a
 *      place of its own in it ("consumers", laid out back to back, grouped by the devices they
 *      are granted to), every handle mapped where it is needed, one cuMemSetAccess per group;
 *   4. hand out: new chunks enter the chunk table (shared with vmm_import), ranges across chunks
 *      become range imports, and the imported handles are released (the mappings keep them).
 * cuMemSetAccess and cuMemImportFromShareableHandle are an import's dear steps on a GPU (~46 and
 * ~35 us a call on an H100): one SetAccess for all, and imports that may overlap the transfer.
 *
 * vmm_import_many_begin and _end are the same call in two halves: begin returns once everything is
 * mapped, the grant running on a thread of its own, so that a binding makes its objects over the
 * pointers meanwhile; end waits for the grant and hands out (step 4), or undoes it all.
 *
 * This file holds the call and its registry reads (the find, and the re-reading after the fetch);
 * the fetch is many_fetch.c, the map and the hand-out many_map.c, the call's bookkeeping
 * many_units.c.  Nothing outside calls any of them but through vmm__import_many. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "import/many.h"

/* ---- 1. find ---- */

/* Range i's records, and whether it lies in one chunk; NOT_FOUND and the like as vmm_import_range. */
static vmm_status many_find(many *m, size_t i, uint64_t address, uint64_t size)
{
    many_range *r = &m->r[i];
    r->p.pid = m->pid;
    r->p.address = address;
    r->p.live = &m->live;
    if (m->hint && m->hint[i].extent) r->p.hint = &m->hint[i];
    if (i > 0) { /* a model's tensors lie in their allocations in the order they are named */
        r->p.seen = m->r[i - 1].p.rec;
        r->p.n_seen = m->r[i - 1].p.n_rec;
    }
    if (size == 0) { /* the whole allocation holding address, as vmm_import maps it */
        vmm_alloc_info a;
        vmm_status st = vmm__find_cached(m->reg, m->pid, address, &a, &m->live);
        if (st != VMM_OK) return st;
        r->p.address = a.address;
        size = a.requested_size ? a.requested_size : a.extent;
    } else if (address > UINT64_MAX - size) {
        return set_err(VMM_ERR_INVALID, "the range runs past the end of the address space");
    }
    r->p.end = r->p.address + size;
    vmm_status st = vmm__range_walk(m->reg, &r->p);
    if (st != VMM_OK) return st;
    const vmm_alloc_info *a = &r->p.rec[0], *first = &m->r[0].p.rec[0];
    /* every range must be of the one owner the first is of (a pid may have been reused) */
    if (i > 0 && (a->owner_start_time != first->owner_start_time || a->owner_pidns != first->owner_pidns))
        return set_err(VMM_ERR_NOT_FOUND,
                       "the allocation at 0x%llx belongs to another process with pid %u than the first range's (an "
                       "exited one's records stay until vmmctl gc)",
                       (unsigned long long)r->p.address, m->pid);
    if (r->p.n_rec > 1) {
        if ((st = vmm__range_layout(&r->p)) != VMM_OK) return st;
        if (r->p.n_pc != 1 || (a->flags & VMM_ALLOC_MULTI_HANDLE)) {
            r->across = true;
            return VMM_OK;
        }
    }
    return vmm__importable(m->reg, a);
}

/* Each range inside one chunk: a reference to the chunk when it is mapped here, else its new
 * chunk; each range across chunks: the units of its pieces. */
static vmm_status many_sort(many *m)
{
    for (size_t i = 0; i < m->n; i++) {
        many_range *r = &m->r[i];
        if (r->across) {
            r->unit_of = calloc(r->p.n_pc, sizeof *r->unit_of);
            if (!r->unit_of) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
            for (size_t k = 0; k < r->p.n_pc; k++) {
                long u = vmm__unit_of(m, &r->p.rec[r->p.pc[k].first]);
                if (u < 0) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
                r->unit_of[k] = (uint32_t)u;
            }
            continue;
        }
        chunk_key k = vmm__key_of(&r->p.rec[0]);
        pthread_mutex_lock(&vmm__chunks_lock);
        r->c = vmm__chunk_ref_locked(&k);
        pthread_mutex_unlock(&vmm__chunks_lock);
        if (r->c) {
            vmm__mt.chunks_cached++;
            continue;
        }
        long c = vmm__new_chunk_of(m, &k, &r->p.rec[0]);
        if (c < 0) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
        r->fresh = (uint32_t)c + 1;
        m->nc[c].users++;
    }
    return VMM_OK;
}

/* ---- the fetch vouched for, and the call ---- */

/* Every record of every range that the owner's broker did not vouch for (it checked the records
 * it was asked about, as it exported them) must still be the live allocation the walk found; a
 * range in a chunk mapped here before must still be live with its owner alive, and be granted to
 * this thread's device. */
static vmm_status many_verify(many *m)
{
    uint64_t t0 = vmm__now_ns();
    vmm_status st = VMM_OK;
    for (size_t i = 0; i < m->n && st == VMM_OK; i++) {
        many_range *r = &m->r[i];
        size_t from = 0;
        if (r->c) {
            if ((st = vmm__still_live(m->reg, &r->p.rec[0], r->c->owner)) == VMM_OK)
                st = vmm__grant_device(r->c, &r->p.rec[0], m->here, &r->use);
            from = 1;
        }
        for (size_t j = from; j < r->p.n_rec && st == VMM_OK; j++) {
            const vmm_alloc_info *a = &r->p.rec[j];
            if (!r->c) {
                bool asked = false;
                for (size_t h = vmm__unit_hash(a) & m->units_ix.mask; m->units_ix.slot[h] && !asked;
                     h = (h + 1) & m->units_ix.mask)
                    asked = vmm__same_record(&m->u[m->units_ix.slot[h] - 1].a, a);
                if (asked) continue;
            }
            st = vmm__record_unchanged(m->reg, a);
        }
        if (st != VMM_OK) m->fail_range = i;
    }
    vmm__mt.find_ns += vmm__now_ns() - t0;
    return st;
}

/* The granting thread of vmm_import_many_begin: the context of the call current on it, as the
 * mapping threads have, and its failure's line kept for the end (the error line is per thread). */
static void *grant_worker(void *arg)
{
    many *m = arg;
    CUcontext cur = NULL;
    bool set =
        vmm__import_cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != m->ctx && vmm__import_cu.CtxSetCurrent(m->ctx) == CUDA_SUCCESS;
    m->grant_st = vmm__many_grant(m);
    if (m->grant_st != VMM_OK) snprintf(m->grant_why, sizeof m->grant_why, "%s", vmm__error_text());
    if (set) (void)vmm__import_cu.CtxSetCurrent(cur);
    return NULL;
}

/* Steps 1 to 3, the grant on a thread of its own when `async` (inline otherwise, and where no
 * thread can start).  VMM_OK, or the first failure (m->fail_range names its range). */
static vmm_status many_prepare(many *m, bool async)
{
    size_t n = m->n;
    vmm_status st = vmm__import_threads(&m->threads);
    vmm__mt.threads = m->threads;
    if (st == VMM_OK) st = vmm__cuda_ready();
    if (st == VMM_OK) {
        uint64_t t0 = vmm__now_ns();
        st = vmm__current_context(&m->ctx, &m->here);
        vmm__mt.context_ns = vmm__now_ns() - t0;
    }
    m->r = st == VMM_OK ? calloc(n, sizeof *m->r) : NULL;
    if (st == VMM_OK && !m->r) st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    /* 1. find */
    uint64_t t0 = vmm__now_ns();
    for (size_t i = 0; i < n && st == VMM_OK; i++)
        if ((st = many_find(m, i, m->addresses[i], m->sizes[i])) != VMM_OK) m->fail_range = i;
    vmm__mt.find_ns = vmm__now_ns() - t0;
    size_t most = 0; /* units there can be: one a range inside a chunk, one a piece of the others */
    for (size_t i = 0; i < n && st == VMM_OK; i++) most += m->r[i].across ? m->r[i].p.n_pc : 1;
    if (st == VMM_OK && (!vmm__ix_init(&m->units_ix, most) || !vmm__ix_init(&m->chunks_ix, n)))
        st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    if (st == VMM_OK) st = vmm__owner_get(&m->r[0].p.rec[0], &m->owner);
    if (st == VMM_OK) st = many_sort(m);
    vmm__mt.chunks_new = (uint32_t)m->n_nc;
    for (size_t i = 0; i < n && m->r; i++) vmm__mt.ranges_mapped += m->r[i].across;
    /* 2. fetch, 3. map, and the grant */
    if (st == VMM_OK) st = vmm__many_fetch(m);
    if (st == VMM_OK) st = many_verify(m);
    if (st == VMM_OK) st = vmm__many_map(m);
    if (st != VMM_OK || !m->s) return st; /* no reservation: every range's chunk was mapped here already */
    if (async) {
        sigset_t all, old; /* no signals on it: the threads are the application's */
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        m->granting = pthread_create(&m->granter, NULL, grant_worker, m) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (m->granting) return VMM_OK;
    }
    return vmm__many_grant(m);
}

/* Step 4, or the undoing of everything on a failure (st, or one of the grant or the hand-out);
 * then the call's memory goes and its timing is the calling thread's.  out may be NULL when st
 * is a failure. */
static vmm_status many_complete(many *m, vmm_status st, vmm_imported **out)
{
    size_t n = m->n;
    if (m->granting) {
        pthread_join(m->granter, NULL);
        m->granting = false;
        if (st == VMM_OK && m->grant_st != VMM_OK) st = set_err(m->grant_st, "%s", m->grant_why);
    }
    if (st == VMM_OK && n) {
        vmm__many_release_handles(m); /* the mappings keep the memory */
        st = vmm__many_hand_out(m, out);
    }
    if (st != VMM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", vmm__error_text());
        vmm__many_unmap(m);
        for (size_t i = 0; i < n; i++) {
            if (m->r && m->r[i].c) (void)vmm__chunk_unref(m->r[i].c);
            if (out) {
                (void)vmm__import_release(out[i]);
                out[i] = NULL;
            }
        }
        /* a failure names its range: one of those found, or the first whose records are the
         * failing fetch's */
        size_t failed = m->fail_range;
        for (size_t i = 0; failed == n && m->fail_unit < m->n_units && i < n; i++)
            for (size_t j = 0; j < m->r[i].p.n_rec && failed == n; j++)
                if (vmm__same_unit(&m->u[m->fail_unit].a, &m->r[i].p.rec[j])) failed = i;
        if (failed < n)
            set_err(st, "vmm_import_many: range %zu of %zu (pid %u, 0x%llx, %llu bytes): %s; nothing imported", failed,
                    n, m->pid, (unsigned long long)m->addresses[failed], (unsigned long long)m->sizes[failed], why);
        else
            set_err(st, "vmm_import_many: %zu ranges of pid %u: %s; nothing imported", n, m->pid, why);
    }
    vmm__many_release_handles(m);
    if (m->owner) vmm__owner_put(m->owner);
    for (size_t i = 0; m->r && i < n; i++) {
        free(m->r[i].p.rec);
        free(m->r[i].p.pc);
        free(m->r[i].unit_of);
    }
    for (size_t k = 0; m->cs && k < m->n_cs; k++) {
        free(m->cs[k].v);
        free(m->cs[k].shared);
    }
    free(m->cs);
    free(m->ops);
    free(m->q);
    free(m->segs);
    free(m->nc);
    free(m->r);
    free(m->units_ix.slot);
    free(m->chunks_ix.slot);
    free(m->addresses);
    free(m->hint);
    pthread_mutex_destroy(&m->lock);
    pthread_cond_destroy(&m->cv);
    vmm__mt.import_ns = m->import_ns;
    vmm__mt.map_ns = m->map_ns;
    vmm__mt.access_ns += m->access_ns;
    vmm__mt.access_calls += m->access_calls;
    vmm__mt.total_ns = vmm__now_ns() - m->t_start;
    /* vmm_import_last_timing gives the same call's steps, summed */
    vmm__tm.total_ns = vmm__mt.total_ns;
    vmm__tm.context_ns = vmm__mt.context_ns;
    vmm__tm.lookup_ns = vmm__mt.find_ns;
    vmm__tm.connect_ns = vmm__mt.connect_ns;
    vmm__tm.request_ns = vmm__mt.broker_ns;
    vmm__tm.export_ns = vmm__mt.export_ns;
    vmm__tm.import_ns = vmm__mt.import_ns;
    vmm__tm.reserve_ns = vmm__mt.reserve_ns;
    vmm__tm.map_ns = vmm__mt.map_ns;
    vmm__tm.access_ns = vmm__mt.access_ns;
    vmm__tm.cached = vmm__mt.handles == 0;
    vmm__tm.route = vmm__mt.handles ? VMM_KIND_BROKER : 0;
    free(m);
    return st;
}

/* The call's state, its inputs copied (the end may come after the caller's arrays are gone). */
static vmm_status many_new(const char *fn, vmm_registry *reg, uint32_t pid, const uint64_t *addresses,
                           const uint64_t *sizes, size_t n, many **out)
{
    uint64_t t_start = vmm__now_ns();
    memset(&vmm__mt, 0, sizeof vmm__mt);
    memset(&vmm__tm, 0, sizeof vmm__tm);
    *out = NULL;
    const char *bad = !reg ? "reg is NULL" : !pid ? "pid is 0" : !addresses && n ? "addresses is NULL"
                      : n > UINT32_MAX ? "n is too large" : NULL;
    if (bad) return set_err(VMM_ERR_INVALID, "%s: %s", fn, bad);
    vmm__mt.ranges = (uint32_t)n;
    many *m = calloc(1, sizeof *m);
    uint64_t *in = calloc(2 * n + 1, sizeof *in);
    if (!m || !in) {
        free(m);
        free(in);
        return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    if (n) memcpy(in, addresses, n * sizeof *in);
    if (n && sizes) memcpy(in + n, sizes, n * sizeof *in);
    m->addresses = in;
    m->sizes = in + n;
    m->reg = reg;
    m->pid = pid;
    m->n = n;
    m->t_start = t_start;
    m->fail_range = n;
    m->fail_unit = SIZE_MAX;
    pthread_mutex_init(&m->lock, NULL);
    pthread_cond_init(&m->cv, NULL);
    *out = m;
    return VMM_OK;
}

vmm_status vmm__import_many(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *sizes,
                            size_t n, vmm_imported **out)
{
    NEED(out || n == 0, "out is NULL");
    for (size_t i = 0; i < n; i++) out[i] = NULL;
    many *m;
    vmm_status st = many_new("vmm_import_many", reg, pid, addresses, sizes, n, &m);
    if (st != VMM_OK) return st;
    return many_complete(m, n ? many_prepare(m, false) : VMM_OK, out);
}

vmm_status vmm__import_many_begin(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *sizes,
                                  vmm_alloc_info *hints, size_t n, many **job)
{
    if (!job) {
        free(hints);
        return set_err(VMM_ERR_INVALID, "vmm_import_many_begin: job is NULL");
    }
    *job = NULL;
    many *m;
    vmm_status st = many_new("vmm_import_many_begin", reg, pid, addresses, sizes, n, &m);
    if (st != VMM_OK) {
        free(hints);
        return st;
    }
    m->hint = hints;
    st = n ? many_prepare(m, true) : VMM_OK;
    if (st != VMM_OK) return many_complete(m, st, NULL);
    m->mt = vmm__mt;
    *job = m;
    return VMM_OK;
}

/* Range i's place as begun: vmm__many_place's, and what the range is. */
void vmm__import_many_place(const many *m, size_t i, uint64_t *ptr, uint64_t *size, int *device, uint32_t *n_records,
                            uint8_t alloc_id[16])
{
    const many_range *r = &m->r[i];
    *size = r->p.end - r->p.address;
    *n_records = r->p.n_rec > UINT32_MAX ? UINT32_MAX : (uint32_t)r->p.n_rec;
    memcpy(alloc_id, r->p.rec[0].alloc_id, sizeof r->p.rec[0].alloc_id);
    vmm__many_place(m, i, ptr, device);
}

vmm_status vmm__import_many_end(many *m, vmm_imported **out)
{
    NEED(m, "job is NULL");
    vmm__mt = m->mt;
    if (!out && m->n) {
        (void)many_complete(m, set_err(VMM_ERR_INVALID, "out is NULL"), NULL);
        return set_err(VMM_ERR_INVALID, "vmm_import_many_end: out is NULL (the job was undone)");
    }
    for (size_t i = 0; i < m->n; i++) out[i] = NULL;
    return many_complete(m, VMM_OK, out);
}
