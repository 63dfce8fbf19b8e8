/* vmm_import_many, step 2: every handle the call's units need, from the owner's broker in one
 * request (protocol v3: fds streamed up to 64 a message, a segment two units share passed once),
 * each imported as it arrives by VMMSHIM_IMPORT_THREADS threads so that the driver's imports
 * overlap the transfer; an owner whose broker predates v3, or that offers only pidfd, is asked
 * one allocation at a time as vmm_import asks.  Calls many_units.c, broker.c, fetch.c, owners.c,
 * driver.c and records.c. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "broker/protocol.h"
#include "registry/registry.h"

#include "import/many.h"

static void import_handle(many *m, uint32_t ui, uint32_t hi, int fd)
{
    unit *u = &m->u[ui];
    uint64_t t0 = vmm__now_ns();
    CUresult r = vmm__import_cu.MemImportFromShareableHandle(&u->h[hi], (void *)(uintptr_t)fd,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    __atomic_add_fetch(&m->import_ns, vmm__now_ns() - t0, __ATOMIC_RELAXED); /* vmm__mt is the calling thread's */
    close(fd); /* the driver keeps its own reference */
    if (r == CUDA_SUCCESS)
        __atomic_store_n(&u->ok[hi], 1, __ATOMIC_RELEASE);
    else
        vmm__many_fail(m, vmm__cu_fail("cuMemImportFromShareableHandle", r));
}

/* An importing thread: takes the fds the receiving thread queues until it closes the queue. */
static void *import_worker(void *arg)
{
    many *m = arg;
    CUcontext cur = NULL;
    bool set =
        vmm__import_cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != m->ctx && vmm__import_cu.CtxSetCurrent(m->ctx) == CUDA_SUCCESS;
    for (;;) {
        pthread_mutex_lock(&m->lock);
        while (m->q_next == m->q_len && !m->q_closed) pthread_cond_wait(&m->cv, &m->lock);
        if (m->q_next == m->q_len) {
            pthread_mutex_unlock(&m->lock);
            break;
        }
        struct job j = m->q[m->q_next++];
        bool failed = m->st != VMM_OK;
        pthread_mutex_unlock(&m->lock);
        if (failed)
            close(j.fd);
        else
            import_handle(m, j.unit, j.handle, j.fd);
    }
    if (set) (void)vmm__import_cu.CtxSetCurrent(cur);
    return NULL;
}

/* The receiving thread: with no other threads, import at once; else queue it. */
static void hand_over(many *m, uint32_t ui, uint32_t hi, int fd)
{
    if (m->threads <= 1) {
        import_handle(m, ui, hi, fd);
        return;
    }
    pthread_mutex_lock(&m->lock);
    m->q[m->q_len++] = (struct job){fd, ui, hi};
    pthread_cond_signal(&m->cv);
    pthread_mutex_unlock(&m->lock);
}

/* The stream's handles are the owner's segments, and a segment may come more than once: in a
 * stream-ordered pool one segment holds the end of one MULTI-HANDLE allocation and the start of
 * the next, and each unit brings all of its handles.  Imports and access grants cost the same per
 * handle whatever its size (~26 and ~29 us on an H200 for another process's handle), so a segment
 * is imported once and only mapped again.  Two records of the call that were live together and
 * reach the same address with a handle of the same size reach the same segment: an address holds
 * one mapping at a time, and neither record could have outlived it (many_verify re-reads every
 * record after the fetch).  True, with *alias set, when (at, size) came before for another unit. */
static bool seen_before(many *m, uint64_t at, uint64_t size, uint32_t ui, uint32_t hi, uint64_t *alias)
{
    if (!m->segs) return false;
    for (size_t i = vmm_reg_hash((uint32_t)(at >> 21), at ^ size) & m->segs_mask;; i = (i + 1) & m->segs_mask) {
        struct seg_seen *e = &m->segs[i];
        if (!e->size) {
            *e = (struct seg_seen){at, size, ui, hi};
            return false;
        }
        if (e->at == at && e->size == size && e->unit != ui) {
            *alias = 1 + ((uint64_t)e->unit << 32 | e->handle);
            return true;
        }
        if (e->at == at && e->size == size) return false;
    }
}

/* One reply of a v3 stream for the units list[0 .. count) of this request; *done at its last. */
typedef struct stream {
    const uint32_t *list;
    uint32_t count, at, seq;
    bool done, fallback;
    bool repeats;         /* asked with VMM_BROKER_REQ3_REPEATS */
    bool ask_plain;       /* refused that flag: a broker older than it */
} stream;

static vmm_status take_reply(many *m, stream *sm, const vmm_broker_reply3 *rep, size_t len, int *fds, uint32_t nf)
{
    const vmm_alloc_info *a0 = &m->u[sm->list[0]].a;
    vmm_status st = VMM_OK;
    if (len == sizeof(vmm_broker_reply) && rep->status != 0 && sm->seq == 0) {
        /* the v1 form: a request this broker could not read (older than v3), or a refused peer */
        if (rep->status == -EPROTO) {
            sm->fallback = true;
            return VMM_OK;
        }
        return vmm__reply_failed(a0, rep->status);
    }
    uint32_t passed = 0; /* fds[] entries that come with an fd */
    for (uint32_t k = 0; len == sizeof *rep && k < rep->n_here && k < VMM_BROKER_MAX_FDS; k++)
        passed += !(sm->repeats && (rep->fds[k].device & VMM_BROKER_FD3_REPEAT));
    if (len != sizeof *rep || rep->version != VMM_BROKER_VERSION3 || rep->seq != sm->seq || passed != nf ||
        rep->n_here > VMM_BROKER_MAX_FDS)
        return set_err(VMM_ERR_IO, "owner pid %u's broker sent a malformed reply (message %u of a batch)", m->pid,
                       sm->seq);
    sm->seq++;
    vmm__mt.export_ns += rep->export_ns;
    if (rep->status == -EINVAL && sm->repeats && rep->entry == sm->count && sm->seq == 1 &&
        (rep->flags & VMM_BROKER_REPLY_LAST)) {
        sm->ask_plain = true; /* a broker that predates the flag refuses the whole request */
        return VMM_OK;
    }
    if (rep->status != 0) {
        if (rep->entry >= sm->count) return vmm__reply_failed(a0, rep->status);
        m->fail_unit = sm->list[rep->entry];
        unit *u = &m->u[sm->list[rep->entry]];
        if (rep->status == -ERANGE)
            return set_err(VMM_ERR_STALE, "owner pid %u's allocation at 0x%llx no longer has the %u handles its record "
                                          "says",
                           m->pid, (unsigned long long)u->a.address, u->n);
        st = vmm__reply_failed(&u->a, rep->status);
        return set_err(st, "the allocation at 0x%llx: %s", (unsigned long long)u->a.address, vmm__error_text());
    }
    for (uint32_t k = 0, at_fd = 0; k < rep->n_here && st == VMM_OK; k++) {
        const vmm_broker_fd3 *f = &rep->fds[k];
        bool again = sm->repeats && (f->device & VMM_BROKER_FD3_REPEAT);
        while (st == VMM_OK && sm->at < sm->count && f->entry > sm->at) { /* the next entry begins */
            unit *u = &m->u[sm->list[sm->at]];
            if (u->got != u->n)
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u of the %u handles of the allocation at 0x%llx",
                             m->pid, u->got, u->n, (unsigned long long)u->a.address);
            sm->at++;
        }
        if (st != VMM_OK) break;
        unit *u = sm->at < sm->count && f->entry == sm->at ? &m->u[sm->list[sm->at]] : NULL;
        if (!u || f->handle != u->got)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent handles out of order (entry %u, handle %u)", m->pid,
                         f->entry, f->handle);
        else if (f->n_total != u->n)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker says the allocation at 0x%llx has %u handles; the record "
                                     "says %u",
                         m->pid, (unsigned long long)u->a.address, f->n_total, u->n);
        else if (f->size == 0 || f->size > u->a.mapped_size - u->bytes)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent handles of more bytes than the record's %llu (the "
                                     "allocation at 0x%llx)",
                         m->pid, (unsigned long long)u->a.mapped_size, (unsigned long long)u->a.address);
        if (st != VMM_OK) break;
        uint32_t hi = u->got++;
        uint64_t at = u->a.address - u->a.chunk_offset + u->bytes; /* the owner's address of this handle */
        u->size[hi] = f->size;
        u->bytes += f->size;
        if (again) { /* passed before in this batch: for another unit, at the same address */
            if (seen_before(m, at, f->size, sm->list[sm->at], hi, &u->alias[hi]))
                vmm__mt.shared++;
            else
                st = set_err(VMM_ERR_IO, "owner pid %u's broker named again a handle it had not passed (the allocation "
                                         "at 0x%llx, handle %u)",
                             m->pid, (unsigned long long)u->a.address, hi);
            continue;
        }
        int fd = fds[at_fd];
        fds[at_fd++] = -1;
        if (seen_before(m, at, f->size, sm->list[sm->at], hi, &u->alias[hi])) {
            close(fd);
            vmm__mt.shared++;
        } else {
            hand_over(m, sm->list[sm->at], hi, fd);
        }
    }
    if (st == VMM_OK && (rep->flags & VMM_BROKER_REPLY_LAST)) {
        for (; st == VMM_OK && sm->at < sm->count; sm->at++) {
            unit *u = &m->u[sm->list[sm->at]];
            if (u->got != u->n || u->bytes != u->a.mapped_size)
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u of %u handles (%llu bytes; the record says "
                                         "%llu) of the allocation at 0x%llx",
                             m->pid, u->got, u->n, (unsigned long long)u->bytes,
                             (unsigned long long)u->a.mapped_size, (unsigned long long)u->a.address);
        }
        sm->done = true;
    }
    return st;
}

/* One v3 request for units list[0 .. count) and its stream, on the owner's kept connection
 * (o->io held); a kept connection found closed is opened again once, as vmm__broker_roundtrip does. */
static vmm_status batch_request(many *m, const uint32_t *list, uint32_t count, bool *fallback)
{
    owner_ref *o = m->owner;
    const vmm_alloc_info *a0 = &m->u[list[0]].a;
    size_t len = sizeof(vmm_broker_request3) + count * sizeof(vmm_broker_entry3);
    uint8_t *req = malloc(len);
    if (!req) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    /* repeats are known by the segments seen (seen_before): without that table, every fd comes */
    vmm_broker_request3 h = {.magic = VMM_BROKER_MAGIC, .version = VMM_BROKER_VERSION3, .n_entries = count,
                             .flags = o->no_repeats || !m->segs ? 0 : VMM_BROKER_REQ3_REPEATS};
    memcpy(req, &h, sizeof h);
    for (uint32_t i = 0; i < count; i++) {
        const vmm_alloc_info *a = &m->u[list[i]].a;
        vmm_broker_entry3 e = {.slot = a->slot, .generation = a->generation, .first = 0, .count = 0};
        memcpy(e.alloc_id, a->alloc_id, sizeof e.alloc_id);
        memcpy(req + sizeof h + i * sizeof e, &e, sizeof e);
    }
    vmm_status st = VMM_OK;
    stream sm = {.list = list, .count = count, .repeats = h.flags != 0};
    for (int attempt = 0;; attempt++) {
        bool fresh = o->sock < 0;
        if (fresh) {
            uint64_t t0 = vmm__now_ns();
            st = vmm__broker_open(m->reg, a0, &o->sock);
            vmm__mt.connect_ns += vmm__now_ns() - t0;
            if (st != VMM_OK) break;
            vmm__release_note_path(o);
            vmm__mt.connects++;
        }
        uint64_t t0 = vmm__now_ns(), imported0 = __atomic_load_n(&m->import_ns, __ATOMIC_RELAXED);
        ssize_t n;
        do n = send(o->sock, req, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        int rc = n == (ssize_t)len ? 0 : -(n < 0 ? errno : EIO);
        if (rc == 0) vmm__mt.requests++;
        while (rc == 0 && st == VMM_OK && !sm.done && !sm.fallback && !sm.ask_plain && !vmm__many_failed(m)) {
            union {
                vmm_broker_reply3 rep;
                uint8_t raw[sizeof(vmm_broker_reply3) + 32];
            } in;
            int fds[VMM_BROKER_MAX_FDS];
            uint32_t nf = 0;
            size_t got = 0;
            memset(&in.rep, 0, sizeof in.rep);
            rc = vmm__broker_recv_raw(o->sock, in.raw, sizeof in.raw, &got, fds, VMM_BROKER_MAX_FDS, &nf);
            if (rc) break;
            vmm__mt.messages++;
            if (in.rep.magic != VMM_BROKER_MAGIC) {
                while (nf) close(fds[--nf]);
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent a malformed reply", m->pid);
                break;
            }
            st = take_reply(m, &sm, &in.rep, got, fds, nf);
            for (uint32_t k = 0; k < nf; k++) /* those it did not take */
                if (fds[k] >= 0) close(fds[k]);
        }
        /* this thread's own imports (no other threads) are not the broker's time */
        uint64_t imported = m->threads <= 1 ? __atomic_load_n(&m->import_ns, __ATOMIC_RELAXED) - imported0 : 0;
        vmm__mt.broker_ns += vmm__now_ns() - t0 - imported;
        if (rc == 0 && st == VMM_OK && sm.done) break;
        if (rc == 0 && st == VMM_OK && sm.ask_plain) { /* the same request without the flag, same connection */
            o->no_repeats = true;
            h.flags = 0;
            memcpy(req, &h, sizeof h);
            sm = (stream){.list = list, .count = count};
            attempt--;
            continue;
        }
        /* a stream broken off, a failure, or an old broker (which closes the connection): the
         * connection's state is unknown, so it goes */
        close(o->sock);
        o->sock = -1;
        if (st != VMM_OK || sm.fallback || (rc == 0 && vmm__many_failed(m))) break;
        if (fresh || attempt > 0 || sm.seq > 0 || !(rc == -EPIPE || rc == -ECONNRESET || rc == -ENOTCONN)) {
            st = vmm__exchange_failed(a0, rc);
            break;
        }
    }
    free(req);
    *fallback = sm.fallback;
    return st;
}

/* Unit u's handles one allocation at a time (v1 or pidfd for one handle, v2 for several), as
 * vmm_import fetches them: for an owner whose broker predates v3, or offers none. */
static vmm_status unit_fetch_alone(many *m, unit *u)
{
    memset(&vmm__tm, 0, sizeof vmm__tm);
    vmm_status st;
    if (!(u->a.flags & VMM_ALLOC_MULTI_HANDLE)) {
        st = vmm__fetch_handle(m->reg, &u->a, &u->h[0]);
        if (st == VMM_OK) {
            u->size[0] = u->a.mapped_size;
            u->ok[0] = 1;
            u->got = 1;
            u->bytes = u->a.mapped_size;
        }
        vmm__mt.requests++;
    } else {
        multi_parts mp;
        st = vmm__multi_fetch(m->reg, &u->a, &mp);
        if (st == VMM_OK) {
            memcpy(u->h, mp.h, u->n * sizeof *u->h);
            memcpy(u->size, mp.size, u->n * sizeof *u->size);
            memset(u->ok, 1, u->n);
            u->got = u->n;
            u->bytes = u->a.mapped_size;
            free(mp.h);
            free(mp.size);
        }
        vmm__mt.requests += (u->n + VMM_BROKER_MAX_FDS - 1) / VMM_BROKER_MAX_FDS;
    }
    vmm__mt.connect_ns += vmm__tm.connect_ns;
    vmm__mt.connects += vmm__tm.connect_ns != 0;
    vmm__mt.broker_ns += vmm__tm.request_ns;
    vmm__mt.export_ns += vmm__tm.export_ns;
    m->import_ns += vmm__tm.import_ns;
    return st;
}

/* Every unit's handles from the owner, imported. */
vmm_status vmm__many_fetch(many *m)
{
    if (!m->n_units) return VMM_OK;
    vmm__mt.handles = (uint32_t)m->n_handles;
    m->q = calloc(m->n_handles, sizeof *m->q);
    uint32_t *list = calloc(m->n_units, sizeof *list);
    size_t segs = 16;
    while (segs < 2 * m->n_handles + 2) segs <<= 1;
    m->segs = calloc(segs, sizeof *m->segs); /* without it (out of memory) every handle is imported */
    m->segs_mask = segs - 1;
    if (!m->q || !list) {
        free(list);
        return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    uint32_t n_list = 0;
    for (uint32_t i = 0; i < m->n_units; i++)
        if (m->u[i].a.handle_kinds & VMM_KIND_BROKER) list[n_list++] = i;
    /* the importing threads wait for the fds the broker's stream brings */
    pthread_t th[MAX_IMPORT_THREADS];
    uint32_t started = 0;
    if (m->threads > 1 && n_list) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (uint32_t i = 0; i < m->threads && i < MAX_IMPORT_THREADS; i++)
            if (pthread_create(&th[started], NULL, import_worker, m) == 0) started++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!started) m->threads = 1;
    }
    vmm_status st = VMM_OK;
    bool fallback = false;
    if (n_list) {
        pthread_mutex_lock(&m->owner->io);
        for (uint32_t at = 0; at < n_list && st == VMM_OK && !fallback; at += VMM_BROKER_MAX_ENTRIES) {
            uint32_t count = n_list - at < VMM_BROKER_MAX_ENTRIES ? n_list - at : VMM_BROKER_MAX_ENTRIES;
            st = batch_request(m, list + at, count, &fallback);
            /* a broker not started yet is no reason to give up when pidfd works too */
            if (st == VMM_ERR_NOT_FOUND && at == 0) {
                bool pidfd = true;
                for (uint32_t i = 0; i < n_list && pidfd; i++) pidfd = m->u[list[i]].a.handle_kinds & VMM_KIND_PIDFD;
                if (pidfd) {
                    st = VMM_OK;
                    fallback = true;
                }
            }
        }
        pthread_mutex_unlock(&m->owner->io);
    }
    pthread_mutex_lock(&m->lock);
    m->q_closed = true;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->lock);
    for (uint32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (st != VMM_OK) vmm__many_fail(m, st);
    if (m->st != VMM_OK) {
        free(list);
        return set_err(m->st, "%s", m->why);
    }
    if (fallback) vmm__mt.fallback = 1;
    /* what the batch did not bring: every unit after an old broker's refusal, and those that offer
     * no broker (pidfd only) */
    for (uint32_t i = 0; i < m->n_units && st == VMM_OK; i++) {
        unit *u = &m->u[i];
        if (u->got == u->n) continue;
        if (u->got) { /* an old broker that answered part of a stream: start the unit afresh */
            for (uint32_t k = 0; k < u->n; k++)
                if (u->ok[k]) (void)TWICE(vmm__import_cu.MemRelease(u->h[k]));
            memset(u->ok, 0, u->n);
            memset(u->alias, 0, u->n * sizeof *u->alias); /* only complete units are aliased to */
            u->got = 0;
            u->bytes = 0;
        }
        if ((st = unit_fetch_alone(m, u)) != VMM_OK) {
            m->fail_unit = i;
            st = set_err(st, "the allocation at 0x%llx: %s", (unsigned long long)u->a.address, vmm__error_text());
        }
    }
    free(list);
    for (uint32_t i = 0; i < m->n_units && st == VMM_OK; i++) /* a repeated segment: the import made first */
        for (uint32_t k = 0; k < m->u[i].n && st == VMM_OK; k++) {
            uint64_t al = m->u[i].alias[k];
            if (!al) continue;
            const unit *src = &m->u[(al - 1) >> 32];
            uint32_t sk = (uint32_t)(al - 1);
            if (src->ok[sk])
                m->u[i].h[k] = src->h[sk];
            else
                st = set_err(VMM_ERR_IO, "owner pid %u's segment at the allocation at 0x%llx was not imported", m->pid,
                             (unsigned long long)m->u[i].a.address);
        }
    return st;
}
