/* The broker and the export callback it serves requests with: started at the first allocation
 * or adopted mapping, it asks for the fds of a live allocation's segments.  A segment's first
 * export (~0.6 ms on an H100) is made with vmm__S.lock let go, the segment pinned meanwhile, and
 * its fd kept (broker_fd, above 1023) so that later requests cost a dup.  A slot that is no
 * allocation of the pool's is a range the program mapped itself: adopt.c's export answers it,
 * handed in through vmm__export_adopted_by, so that this file never calls up into adopt.c. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backing/internal.h"
#include "broker/broker.h"
#include "broker/protocol.h"
#include "core/log.h"

static vmm__adopted_export_fn adopted_export; /* NULL until adopt.c adopts a handle */

void vmm__export_adopted_by(vmm__adopted_export_fn fn) { __atomic_store_n(&adopted_export, fn, __ATOMIC_RELEASE); }

/* vmm__S.lock held: an fd for segment c, a duplicate of the one kept (1), or 0 when none is kept: the
 * caller exports it after letting go of the lock (broker_export_many), c pinned meanwhile. */
static int seg_fd_kept_locked(vseg *c, int *fd)
{
    int kept = c->broker_fd >= 0 ? c->broker_fd : c->exported_fd;
    if (kept < 0) {
        c->exporting++;
        return 0;
    }
    return (*fd = fcntl(kept, F_DUPFD_CLOEXEC, 0)) < 0 ? -errno : 1;
}

/* vmm__S.lock held again after pinned segments were exported (fd -1: the export failed): keep a
 * duplicate for the next request, or finish a segment destroyed meanwhile. */
static void seg_exported_locked(vseg *c, int fd)
{
    c->exporting--;
    if (c->dead) {
        if (!c->exporting) {
            CUresult release = VMM__TWICE(vmm__cu.MemRelease(c->handle));
            if (release)
                vmm__log(VMM__LOG_WARNING, "cuMemRelease of a given-back segment failed twice (CUDA error %d); the "
                         "driver keeps it until exit", (int)release);
            free(c);
        }
    } else if (fd >= 0 && c->broker_fd < 0) {
        c->broker_fd = fcntl(fd, F_DUPFD_CLOEXEC, 1024);
        if (c->broker_fd >= 0) __atomic_store_n(&vmm__S.kept_fds, vmm__S.kept_fds + 1, __ATOMIC_RELAXED);
    }
}

/* The broker asks for handles [first, first + max) of a live allocation's span: their fds (the
 * broker closes them), sizes and keys (a segment's id, never reused: one segment may lie under
 * two allocations, and a batch passes it once), in address order.  A range the program mapped
 * itself has no key: its handle may be mapped at several places. */
static int broker_export_many(uint64_t slot, uint64_t generation, const uint8_t id[16], uint32_t first, uint32_t max,
                              int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total,
                              uint32_t *device)
{
    *n_here = *n_total = 0;
    pthread_mutex_lock(&vmm__S.lock);
    vmm__block *b = NULL;
    uint32_t key = (uint32_t)slot;
    HASH_FIND(hs, vmm__S.by_slot, &key, sizeof key, b);
    if (!b) {
        pthread_mutex_unlock(&vmm__S.lock);
        uint64_t mapped = 0;
        if (first != 0 || max == 0) return -EINVAL;
        vmm__adopted_export_fn adopted = __atomic_load_n(&adopted_export, __ATOMIC_ACQUIRE);
        int rc = adopted ? adopted(slot, generation, id, &fds[0], &mapped, device) : -ENOENT; /* a range the program mapped */
        if (rc == 0) {
            sizes[0] = mapped;
            *n_here = *n_total = 1;
        }
        return rc;
    }
    int rc = 0;
    vseg *pinned[VMM_BROKER_MAX_FDS] = {0}; /* pinned[k]: fds[k] is to be exported */
    uint32_t n_pinned = 0;
    if (max > VMM_BROKER_MAX_FDS) max = VMM_BROKER_MAX_FDS;
    if (!b->live)
        rc = -ENOENT;
    else if (b->generation != generation || memcmp(b->alloc_id, id, 16) != 0)
        rc = -ESTALE;
    else {
        uint64_t bytes, g = b->arena->pool->granule;
        uint32_t n, i = 0;
        vmm__seg *s = vmm__span_of(b, &n, &bytes);
        *n_total = n;
        *device = (uint32_t)((vseg *)s->mech)->dev;
        if (first >= n) rc = -ERANGE;
        for (; s && rc == 0 && *n_here < max && i < n; i++, s = i < n ? vmm__pool_seg_at(b->arena, g, s->base + s->size) : NULL) {
            if (i < first) continue;
            if (((vseg *)s->mech)->paused) { /* released by vmm_pause: nothing to hand out until resumed */
                rc = VMM_BROKER_PAUSED;
                break;
            }
            fds[*n_here] = -1;
            int kept = seg_fd_kept_locked(s->mech, &fds[*n_here]);
            if (kept < 0) {
                rc = kept;
                break;
            }
            if (!kept) {
                pinned[*n_here] = s->mech;
                n_pinned++;
            }
            keys[*n_here] = ((vseg *)s->mech)->id;
            sizes[(*n_here)++] = s->size;
        }
    }
    if (n_pinned) {
        /* the first export of a segment, the only slow step: without the lock, so that the
         * owner's allocations go on meanwhile (a segment freed and destroyed meanwhile stays
         * pinned, its handle valid, and the allocation is found gone below) */
        pthread_mutex_unlock(&vmm__S.lock);
        for (uint32_t k = 0; k < *n_here; k++)
            if (pinned[k] && vmm__cu.MemExportToShareableHandle(&fds[k], pinned[k]->handle,
                                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) {
                fds[k] = -1;
                if (rc == 0) rc = -EIO;
            }
        pthread_mutex_lock(&vmm__S.lock);
        for (uint32_t k = 0; k < *n_here; k++)
            if (pinned[k]) seg_exported_locked(pinned[k], fds[k]);
        b = NULL;
        HASH_FIND(hs, vmm__S.by_slot, &key, sizeof key, b);
        if (rc == 0 && (!b || !b->live || b->generation != generation || memcmp(b->alloc_id, id, 16) != 0))
            rc = -ESTALE; /* freed while its handles were exported */
    }
    if (rc != 0) {
        while (*n_here)
            if (fds[--*n_here] >= 0) close(fds[*n_here]);
    }
    pthread_mutex_unlock(&vmm__S.lock);
    return rc;
}

void vmm__start_broker(void)
{
    if (__atomic_load_n(&vmm__S.broker_started, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&vmm__S.lock);
    if (!vmm__S.broker_started) {
        int rc = vmm__broker_start(broker_export_many, vmm__S.broker_path, sizeof vmm__S.broker_path);
        if (rc == 0) vmm__reg_set_broker(&vmm__S.reg, vmm__S.broker_path);
        if (rc == 0) on_exit(vmm__backing_keep_exiting, NULL);
        else vmm__log(VMM__LOG_WARNING, "broker did not start (%s); companions can import only via pidfd", strerror(-rc));
        __atomic_store_n(&vmm__S.broker_started, rc == 0 ? 1 : -1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&vmm__S.lock);
}
