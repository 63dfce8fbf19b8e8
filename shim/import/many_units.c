/* The floor of vmm_import_many: what one call keeps track of while its steps run -- the units it
 * fetches (each set of handles asked for once), the open-addressed indexes that find them, the
 * threads it imports and maps with, and the first failure any of them meets.  The steps above
 * (many.c, many_fetch.c, many_map.c) all record into the same call through these, so they sit
 * below all three.  Calls range.c (vmm__grow, vmm__same_chunk), cache.c, driver.c and records.c. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "registry/registry.h"

#include "import/many.h"

/* The calling thread's last vmm_import_many, step by step (vmm_import_many_last_timing). */
_Thread_local vmm_import_many_timing vmm__mt;

vmm_status vmm__import_many_last_timing(vmm_import_many_timing *out)
{
    NEED(out, "out is NULL");
    *out = vmm__mt;
    return VMM_OK;
}

/* VMMSHIM_IMPORT_THREADS, read at each call (so a benchmark may compare settings in one process). */
vmm_status vmm__import_threads(uint32_t *out)
{
    const char *e = getenv("VMMSHIM_IMPORT_THREADS");
    *out = 1;
    if (!e || !*e) return VMM_OK;
    char *end;
    errno = 0;
    long v = strtol(e, &end, 10);
    if (errno || *end || v < 1 || v > MAX_IMPORT_THREADS)
        return set_err(VMM_ERR_INVALID, "vmm_import_many: VMMSHIM_IMPORT_THREADS='%s' is not a number from 1 to %d", e,
                       MAX_IMPORT_THREADS);
    *out = (uint32_t)v;
    return VMM_OK;
}

/* Run fn(arg) on n - 1 new threads and the calling thread, and wait for all (no signals on the
 * new ones: they are the application's).  Threads that cannot start leave their share to the
 * others (fn takes work until none is left). */
void vmm__crew_run(uint32_t n, void *(*fn)(void *), void *arg)
{
    pthread_t th[MAX_IMPORT_THREADS];
    uint32_t started = 0;
    if (n > 1) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (uint32_t i = 1; i < n && i < MAX_IMPORT_THREADS; i++)
            if (pthread_create(&th[started], NULL, fn, arg) == 0) started++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    (void)fn(arg);
    for (uint32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
}
/* Records whose handles are the same: a pooled chunk by its id (as vmm__same_chunk), a MULTI-HANDLE
 * record or one without a chunk id by itself. */
bool vmm__same_record(const vmm_alloc_info *x, const vmm_alloc_info *y)
{
    return x->slot == y->slot && x->generation == y->generation && memcmp(x->alloc_id, y->alloc_id, 16) == 0;
}

bool vmm__same_unit(const vmm_alloc_info *x, const vmm_alloc_info *y)
{
    if ((x->flags | y->flags) & VMM_ALLOC_MULTI_HANDLE) return vmm__same_record(x, y);
    return vmm__same_chunk(x, y) || vmm__same_record(x, y);
}

uint64_t vmm__unit_hash(const vmm_alloc_info *a)
{
    if (a->chunk_id && !(a->flags & VMM_ALLOC_MULTI_HANDLE)) return a->chunk_id * 0x9e3779b97f4a7c15ull ^ a->mapped_size;
    return (a->slot + 1) * 0xbf58476d1ce4e5b9ull ^ a->generation;
}

bool vmm__ix_init(ix *t, size_t n)
{
    size_t cap = 16;
    while (cap < 2 * n + 2) cap <<= 1;
    t->slot = calloc(cap, sizeof *t->slot);
    t->mask = cap - 1;
    return t->slot != NULL;
}

/* Record a failure found on any thread (its reason is that thread's vmm__error_text); the first stands. */
void vmm__many_fail(many *m, vmm_status st)
{
    pthread_mutex_lock(&m->lock);
    if (m->st == VMM_OK) {
        m->st = st;
        snprintf(m->why, sizeof m->why, "%s", vmm__error_text());
    }
    pthread_mutex_unlock(&m->lock);
}

bool vmm__many_failed(many *m)
{
    pthread_mutex_lock(&m->lock);
    bool f = m->st != VMM_OK;
    pthread_mutex_unlock(&m->lock);
    return f;
}

/* The unit for record a (made when new); its index, or -1 out of memory. */
long vmm__unit_of(many *m, const vmm_alloc_info *a)
{
    for (size_t h = vmm__unit_hash(a) & m->units_ix.mask;; h = (h + 1) & m->units_ix.mask) {
        uint32_t k = m->units_ix.slot[h];
        if (!k) {
            unit *more = vmm__grow(m->u, &m->cap_units, m->n_units, sizeof *m->u);
            if (!more) return -1;
            m->u = more;
            unit *u = &m->u[m->n_units];
            memset(u, 0, sizeof *u);
            u->a = *a;
            u->n = (a->flags & VMM_ALLOC_MULTI_HANDLE) ? a->n_handles : 1;
            u->h = calloc(u->n, sizeof *u->h);
            u->size = calloc(u->n, sizeof *u->size);
            u->ok = calloc(u->n, 1);
            u->alias = calloc(u->n, sizeof *u->alias);
            if (!u->h || !u->size || !u->ok || !u->alias) {
                free(u->h);
                free(u->size);
                free(u->ok);
                free(u->alias);
                return -1;
            }
            m->n_handles += u->n;
            m->units_ix.slot[h] = (uint32_t)++m->n_units;
            return (long)m->n_units - 1;
        }
        if (vmm__same_unit(&m->u[k - 1].a, a)) return (long)k - 1;
    }
}

/* The new chunk of key k (made when new, for record a); its index, or -1 out of memory. */
long vmm__new_chunk_of(many *m, const chunk_key *k, const vmm_alloc_info *a)
{
    uint64_t hash = vmm_reg_hash(k->pid, k->id ^ (k->generation * 0x9e3779b97f4a7c15ull) ^ (k->mapped_size << 1) ^
                                             k->by_slot);
    for (size_t h = hash & m->chunks_ix.mask;; h = (h + 1) & m->chunks_ix.mask) {
        uint32_t i = m->chunks_ix.slot[h];
        if (!i) {
            new_chunk *more = vmm__grow(m->nc, &m->cap_nc, m->n_nc, sizeof *m->nc);
            if (!more) return -1;
            m->nc = more;
            new_chunk *c = &m->nc[m->n_nc];
            memset(c, 0, sizeof *c);
            c->key = *k;
            c->a = *a;
            long u = vmm__unit_of(m, a);
            if (u < 0) return -1;
            c->unit = (uint32_t)u;
            m->chunks_ix.slot[h] = (uint32_t)++m->n_nc;
            return (long)m->n_nc - 1;
        }
        if (vmm__same_key(&m->nc[i - 1].key, k)) return (long)i - 1;
    }
}

/* Release every imported handle: mapped, they keep their memory; unmapped, it goes. */
void vmm__many_release_handles(many *m)
{
    uint64_t t0 = vmm__now_ns();
    for (size_t i = 0; i < m->n_units; i++) {
        unit *u = &m->u[i];
        for (uint32_t k = 0; k < u->n; k++)
            if (u->ok[k]) (void)TWICE(vmm__import_cu.MemRelease(u->h[k]));
        free(u->h);
        free(u->size);
        free(u->ok);
        free(u->alias);
    }
    free(m->u);
    m->u = NULL;
    m->n_units = 0;
    vmm__mt.release_ns += vmm__now_ns() - t0;
}
