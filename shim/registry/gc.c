/* Reclamation of dead owners: their records, chunks, proc slots, frames files, name tables and
 * keep files.  It is the top of the registry: it reads the segment, repeats the writer's steps
 * (internal.h) and asks the keepers and the name tables what may go, and nothing in the
 * registry calls it; kept apart so that the writer knows nothing of keepers' liveness. */
#include "registry/registry.h"
#include "registry/internal.h"
#include "registry/keep.h"
#include "registry/names.h"
#include "registry/seq.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static bool pid_exists(uint32_t pid)
{
    char path[32];
    snprintf(path, sizeof path, "/proc/%u", pid);
    return access(path, F_OK) == 0;
}

/* A dead owner's call-site names (layout.h, FRAMES) go with its records. */
static void remove_frames_file(const vmm__reg *r, uint32_t pid, uint64_t start_time)
{
    char name[sizeof r->name + 48];
    if (pid && start_time &&
        snprintf(name, sizeof name, VMM_REG_FRAMES_NAME, r->name, pid, (unsigned long long)start_time) < (int)sizeof name)
        shm_unlink(name);
}

int vmm__reg_gc(vmm__reg *r, vmm__reg_gc_stats *st)
{
    vmm__reg_gc_stats z = {0};
    if (!st) st = &z;
    memset(st, 0, sizeof *st);
    if (!r->writable) return -EPERM;
    pthread_mutex_lock(&vmm__reg_gc_mutex);
    int rc = vmm__reg_ofd_lock(r->fd, VMM_REG_LOCK_GC, F_WRLCK);
    if (rc) {
        pthread_mutex_unlock(&vmm__reg_gc_mutex);
        return rc;
    }
    /* the index lock names its holder by proc slot: gc holds one for the run */
    bool attached_here = !r->attached && vmm__reg_attach(r, NULL) == 0;
    if (!r->attached) {
        vmm__reg_ofd_unlock(r->fd, VMM_REG_LOCK_GC);
        pthread_mutex_unlock(&vmm__reg_gc_mutex);
        return -ENOSPC;
    }
    uint32_t cap = r->hdr->proc_capacity;
    uint8_t *state = calloc(cap, 1); /* per proc slot: 0 unknown/alive, 1 dead */
    uint32_t *gens = calloc(cap, sizeof *gens);
    if (!state || !gens) {
        free(state);
        free(gens);
        if (attached_here) vmm__reg_detach(r);
        vmm__reg_ofd_unlock(r->fd, VMM_REG_LOCK_GC);
        pthread_mutex_unlock(&vmm__reg_gc_mutex);
        return -ENOMEM;
    }
    vmm__reg_wait w = {0};
    for (uint32_t i = 0; i < cap; i++) {
        uint64_t c = __atomic_load_n(&proc_at(r, i)->claim, __ATOMIC_ACQUIRE);
        gens[i] = (uint32_t)(c >> 32);
        if (attached_here && i == r->proc_index) continue; /* gc itself */
        if ((uint32_t)c == 0) {
            state[i] = 2; /* free slot: any chunk still tagged with it is an orphan */
            continue;
        }
        vmm_reg_proc p;
        int live = VMM__UNKNOWN;
        bool known = vmm__reg_read_proc_within(r, i, &p, &w) == 0 && p.start_time != 0;
        if (known)
            live = vmm__reg_liveness(p.pid, p.start_time, p.pidns);
        else /* died (or is) between claiming the slot and writing its identity: judge by pid */
            live = pid_exists((uint32_t)c) ? VMM__UNKNOWN : VMM__DEAD;
        if (live == VMM__ALIVE) st->procs_alive++;
        if (live == VMM__UNKNOWN) st->procs_unknown++;
        /* a dead owner whose memory a living keeper holds stays, records, names and all, until
         * the keeper lets go (layout.h KEEP) */
        if (live == VMM__DEAD && known && __atomic_load_n(&proc_at(r, i)->keeper_pid, __ATOMIC_ACQUIRE) &&
            vmm__keep_held(r, p.pid, p.start_time)) {
            st->procs_kept++;
            continue;
        }
        if (live == VMM__DEAD) {
            st->procs_dead++;
            state[i] = 1;
        }
    }
    for (uint64_t ch = 0; ch < r->hdr->chunk_count; ch++) {
        uint64_t o = __atomic_load_n(chunk_at(r, ch), __ATOMIC_ACQUIRE);
        if (o == 0) continue;
        uint64_t t = o & ~VMM_REG_CHUNK_RECLAIMING;
        uint32_t idx = (uint32_t)t - 1, gen = (uint32_t)(t >> 32);
        if (idx >= cap) continue;
        /* Re-read the claim now: a slot seen free may have been claimed again since. A chunk whose
         * tag names a generation the slot has moved past, or a slot its owner freed, is orphaned. */
        uint64_t claim = __atomic_load_n(&proc_at(r, idx)->claim, __ATOMIC_ACQUIRE);
        bool orphan = (uint32_t)(claim >> 32) != gen || (uint32_t)claim == 0;
        bool dead = state[idx] == 1 && gens[idx] == gen;
        if (!dead && !orphan) continue;
        if (!__atomic_compare_exchange_n(chunk_at(r, ch), &o, t | VMM_REG_CHUNK_RECLAIMING, false, __ATOMIC_ACQ_REL,
                                         __ATOMIC_RELAXED))
            continue;
        st->records_reclaimed += vmm__reg_chunk_release(r, ch);
        st->chunks_reclaimed++;
    }
    for (uint32_t i = 0; i < cap; i++) {
        if (state[i] != 1) continue;
        vmm_reg_proc *p = proc_at(r, i);
        uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)(c >> 32) != gens[i]) continue;
        remove_frames_file(r, __atomic_load_n(&p->pid, __ATOMIC_RELAXED), __atomic_load_n(&p->start_time, __ATOMIC_RELAXED));
        vmm__names_unlink(r, __atomic_load_n(&p->pid, __ATOMIC_RELAXED), __atomic_load_n(&p->start_time, __ATOMIC_RELAXED));
        vmm__keep_unlink_unheld(r, __atomic_load_n(&p->pid, __ATOMIC_RELAXED), __atomic_load_n(&p->start_time, __ATOMIC_RELAXED));
        seq_begin(&p->seq);
        __atomic_store_n(&p->pid, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&p->start_time, 0, __ATOMIC_RELAXED);
        seq_end(&p->seq);
        vmm__reg_counters_clear(p);
        __atomic_compare_exchange_n(&p->claim, &c, (uint64_t)gens[i] << 32, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    }
    __atomic_add_fetch(&r->hdr->stat_reclaimed, st->records_reclaimed, __ATOMIC_RELAXED);
    st->names_removed = vmm__names_sweep(r); /* tables whose owners died with their slots reclaimed before */
    st->keep_removed = vmm__keep_sweep(r);   /* keep files no keeper holds, of dead owners */
    if (st->chunks_reclaimed || (__atomic_load_n(&r->hdr->index_seq, __ATOMIC_ACQUIRE) & 1u)) {
        /* sweep the tombstones (and whatever a writer that died mid-change left) */
        vmm__reg_index_lock(r);
        vmm__reg_index_rebuild_locked(r);
        vmm__reg_index_unlock(r);
        st->index_rebuilt = 1;
    }
    free(state);
    free(gens);
    if (attached_here) vmm__reg_detach(r);
    vmm__reg_ofd_unlock(r->fd, VMM_REG_LOCK_GC);
    pthread_mutex_unlock(&vmm__reg_gc_mutex);
    return 0;
}
