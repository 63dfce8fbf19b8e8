/* Sleep and wake for the memory the program makes itself (cuMemCreate + cuMemMap: expandable
 * segments, XLA's arena, NCCL's buffers), with VMMSHIM_SLEEP_ADOPTED=1.  The program holds a
 * stand-in (adopt.h), the shim the driver's handle, so the physical memory can really go: unmapping
 * alone frees nothing while a handle has a reference, and the program's references are the shim's
 * to count (adopt_int.h: while the program holds any, the driver's handle carries exactly one of
 * the shim's; at none, only its mappings hold it).
 *
 * A pause, per chosen handle: each mapped range's access (cuMemGetAccess per device) and contents
 * (sleep.c's copies: host memory or the pause's file; nothing with VMM_PAUSE_DISCARD) are kept,
 * every range is unmapped, the broker's kept fd closed, and the shim's one reference released, so
 * the driver frees the memory; the address reservations are the program's and stay.  The records
 * are flagged paused and the broker refuses imports (VMM_BROKER_PAUSED).  A resume makes a handle
 * with the same properties, maps every range at its old address and offset, sets the kept access,
 * copies the contents back, lets go of the creation reference when the program had released its
 * handle (its mappings hold it then, as before), and names the memory as a new chunk.  All or
 * nothing: a full device changes nothing, and the kept contents stay for a later resume.
 *
 * Chosen by the tag of the thread that made the handle (NULL: all; the process's tag: untagged),
 * as sleep.c chooses pools.  sleep.c calls these through the table handed in by the constructor
 * below, with no lock of its own held: adopt.c publishes under A.lock and takes vmm__S.lock inside
 * (the broker's start), so A.lock always comes first.  While paused, adopt.c answers the program:
 * cuMemUnmap and cuMemRelease succeed with nothing of the driver's touched,
 * cuMemGetAllocationPropertiesFromHandle answers what it did before, cuMemMap and
 * cuMemExportToShareableHandle fail with CUDA_ERROR_INVALID_HANDLE (no memory stands behind the
 * handle until vmm_resume), and cuMemRetainAllocationHandle fails as for any unmapped address.
 * The program must not touch the memory while paused, as for the pools.  A handle the program
 * exported itself (NCCL's buffers, which its peers map while a communicator lives; a tensor sent
 * through torch.multiprocessing) is never chosen: a peer's mapping would keep the old memory alive
 * and never see the new, so it stays on the device, counted in bytes_not_shim. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "api/vmm_api.h"
#include "backing/adopt_int.h"
#include "backing/sleep.h"
#include "core/log.h"

#define A vmm__A
typedef vmm__adopt_handle handle_entry;
typedef vmm__adopt_range range;


static int pausable(void) { return vmm__adopt_sleeping() && vmm__adopt_load() && A.Create; }

static int push(CUcontext ctx) { return ctx && A.CtxPushCurrent(ctx) == CUDA_SUCCESS; }

static void pop(int pushed)
{
    CUcontext popped;
    if (pushed) (void)VMM__TWICE(A.CtxPopCurrent(&popped));
}

static void survey(const char *tag, int *any, int *paused, int *awake, uint64_t *left)
{
    *any = *paused = *awake = 0;
    *left = 0;
    if (!vmm__adopt_on()) return;
    int can = pausable();
    pthread_mutex_lock(&A.lock);
    for (handle_entry *e = A.handles; e; e = e->hh.next) {
        if (!vmm__tag_selects(tag, e->tag)) continue;
        if (!can || !e->stand_in || e->shared) { /* the program holds the driver's handle, or shared it: it stays */
            *left += e->size;
            continue;
        }
        *any = 1;
        *paused |= e->paused;
        *awake |= !e->paused;
    }
    pthread_mutex_unlock(&A.lock);
}

static int contexts(const char *tag, CUcontext *ctx, int max)
{
    int n = 0;
    if (!pausable()) return 0;
    pthread_mutex_lock(&A.lock);
    for (handle_entry *e = A.handles; e; e = e->hh.next) {
        if (!e->stand_in || e->shared || e->paused || !e->ctx || !vmm__tag_selects(tag, e->tag)) continue;
        int seen = 0;
        for (int i = 0; i < n; i++) seen |= ctx[i] == e->ctx;
        if (!seen && n < max) ctx[n++] = e->ctx;
    }
    pthread_mutex_unlock(&A.lock);
    return n;
}

/* A.lock held: mark the handles the call works on (paused: those paused, else those awake);
 * -EBUSY when one stayed pinned for 2 s (the lock let go meanwhile: an export or a translated call
 * uses the driver's handle), 0 otherwise. */
static int choose_locked(const char *tag, int paused)
{
    for (int tries = 0; tries < 2000; tries++) {
        int pinned = 0;
        for (handle_entry *e = A.handles; e; e = e->hh.next) {
            e->mark = e->stand_in && !e->shared && e->paused == paused && vmm__tag_selects(tag, e->tag);
            pinned |= e->mark && e->pins;
        }
        if (!pinned) return 0;
        pthread_mutex_unlock(&A.lock);
        usleep(1000);
        pthread_mutex_lock(&A.lock);
    }
    return -EBUSY;
}

static int device_count(void)
{
    int n = 0;
    if (A.DeviceGetCount(&n) != CUDA_SUCCESS || n < 0) return 0;
    return n < VMM__ADOPT_MAX_DEV ? n : VMM__ADOPT_MAX_DEV;
}

/* A failed pause undone: the contents copied so far go (after the queued copies are done), their
 * pinned buffers stay for the next pause, as after a resume. */
static void drop_kept_locked(vmm__sleep_io *io)
{
    (void)vmm__sleep_wait(io);
    for (handle_entry *e = A.handles; e; e = e->hh.next)
        for (range *r = e->mark ? e->ranges : NULL; r; r = r->next_of)
            if (vmm__sleep_holds(r->kept)) vmm__sleep_kept_done(&r->kept);
}

/* The pinned buffers the chosen handles' ranges lack, made at once (sleep_copy.c). */
static void pin_ahead_locked(void)
{
    size_t n = 0;
    for (handle_entry *e = A.handles; e; e = e->hh.next)
        for (range *r = e->mark ? e->ranges : NULL; r; r = r->next_of) n++;
    void ***slots = n ? malloc(n * sizeof *slots) : NULL;
    uint64_t *sizes = n ? malloc(n * sizeof *sizes) : NULL;
    size_t i = 0;
    for (handle_entry *e = slots && sizes ? A.handles : NULL; e; e = e->hh.next)
        for (range *r = e->mark ? e->ranges : NULL; r; r = r->next_of) {
            slots[i] = &r->kept;
            sizes[i++] = r->size;
        }
    if (i) (void)vmm__sleep_pin_ahead(slots, sizes, i);
    free(slots);
    free(sizes);
}

/* Keep the chosen handles' access and contents (copies queued, with marks (sleep.h) naming the last
 * handle copied): 0, or an error with the copies waited for and nothing kept. */
static int keep_chosen_locked(unsigned flags, int ndev, vmm__sleep_io *io, vmm__sleep_marks *mk, char *why, size_t len)
{
    if (!flags) pin_ahead_locked();
    for (handle_entry *e = A.handles; e; e = e->hh.next) {
        if (!e->mark) continue;
        int pushed = push(e->ctx);
        uint64_t bytes = 0;
        for (range *r = e->ranges; r; r = r->next_of) {
            memset(r->access, 0, sizeof r->access);
            for (int d = 0; d < ndev; d++) {
                CUmemLocation at = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d};
                unsigned long long f = 0;
                if (A.GetAccess(&f, &at, (CUdeviceptr)r->addr) == CUDA_SUCCESS) r->access[d] = (unsigned char)f;
            }
            if (flags & VMM_PAUSE_DISCARD) continue;
            int rc = vmm__sleep_keep(io, (CUdeviceptr)r->addr, r->size, &r->kept);
            if (rc) {
                pop(pushed);
                vmm__sleep_marks_end(mk);
                drop_kept_locked(io);
                return vmm__sleep_say(why, len, rc, "copying %llu bytes of the program's own VMM memory at 0x%llx out failed%s",
                                      (unsigned long long)r->size, (unsigned long long)r->addr, rc == -ENOMEM ? ": no host memory" : "");
            }
            bytes += r->size;
        }
        pop(pushed);
        vmm__sleep_marks_add(io, mk, bytes, (uintptr_t)e);
    }
    return 0;
}

static int pause_adopted(const char *tag, unsigned flags, vmm__sleep_io *io, vmm__sleep_out *out, char *why, size_t len)
{
    if (!pausable()) return 0;
    int ndev = device_count();
    pthread_mutex_lock(&A.lock);
    if (choose_locked(tag, 0)) {
        pthread_mutex_unlock(&A.lock);
        return vmm__sleep_say(why, len, -EBUSY, "a call on the program's own VMM memory kept its handle for 2 s");
    }
    /* first everything is kept (queued), so that a failure to queue releases nothing */
    vmm__sleep_marks mk = {0};
    int rc = keep_chosen_locked(flags, ndev, io, &mk, why, len);
    if (rc) {
        pthread_mutex_unlock(&A.lock);
        return rc;
    }
    /* a handle goes once its copies are done (its mark reached, else all of them): the later
     * copies still move meanwhile.  One that fails on the device (a sticky error) is reported after. */
    uintptr_t copied_upto = 0;
    int all_copied = (flags & VMM_PAUSE_DISCARD) != 0, failed = 0;
    for (handle_entry *e = A.handles; e; e = e->hh.next) {
        if (!e->mark) continue;
        if (!all_copied && !copied_upto && !vmm__sleep_marks_next(&mk, &copied_upto, &failed)) {
            failed |= vmm__sleep_wait(io) != 0;
            all_copied = 1;
        }
        int pushed = push(e->ctx);
        CUresult unmap = CUDA_SUCCESS, release = CUDA_SUCCESS;
        for (range *r = e->ranges; r; r = r->next_of) {
            CUresult u = VMM__TWICE(A.Unmap((CUdeviceptr)r->addr, r->size));
            if (u) unmap = u;
            vmm__range_set_paused(&r->pub, 1, 0, 0);
            out->allocations++;
            if (vmm__sleep_holds(r->kept)) out->kept += r->size;
        }
        if (e->broker_fd >= 0) { /* the broker's kept export would hold the memory */
            close(e->broker_fd);
            e->broker_fd = -1;
            vmm__backing_kept_adopted(-1);
        }
        if (e->refs) release = VMM__TWICE(A.Release(e->real)); /* the shim's one reference: the memory goes */
        pop(pushed);
        if (unmap || release)
            vmm__log(VMM__LOG_WARNING, "pause: %s of the program's own %llu bytes failed twice (CUDA error %d); the "
                     "driver keeps them until exit", unmap ? "cuMemUnmap" : "cuMemRelease", (unsigned long long)e->size,
                     (int)(unmap ? unmap : release));
        HASH_DELETE(hr, A.by_real, e);
        e->real = 0;
        e->paused = 1;
        out->released += e->size;
        out->segments++;
        if ((uintptr_t)e == copied_upto) copied_upto = 0;
    }
    vmm__sleep_marks_end(&mk);
    pthread_mutex_unlock(&A.lock);
    if (failed)
        return vmm__sleep_say(why, len, -EIO, "copying the program's own VMM memory out failed on the device; the contents "
                              "are undefined");
    return 0;
}

/* A.lock held: handle h of e, made by this resume and mapped at e's ranges before `stop`, goes. */
static void unmake(handle_entry *e, CUmemGenericAllocationHandle h, range *stop)
{
    for (range *r = e->ranges; r != stop; r = r->next_of) (void)VMM__TWICE(A.Unmap((CUdeviceptr)r->addr, r->size));
    (void)VMM__TWICE(A.Release(h));
}

/* A.lock held: a fresh handle for paused e, mapped at every range with the kept access: 0, or a
 * CUresult with nothing made. */
static CUresult remake(handle_entry *e, CUmemGenericAllocationHandle *out)
{
    CUmemGenericAllocationHandle h;
    CUresult rc = A.Create(&h, e->size, &e->prop, 0);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && vmm__keep_let_go()) rc = A.Create(&h, e->size, &e->prop, 0);
    if (rc != CUDA_SUCCESS) return rc;
    for (range *r = e->ranges; r; r = r->next_of) {
        CUmemAccessDesc acc[VMM__ADOPT_MAX_DEV];
        size_t n = 0;
        for (int d = 0; d < VMM__ADOPT_MAX_DEV; d++)
            if (r->access[d]) {
                acc[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                acc[n].location.id = d;
                acc[n++].flags = (CUmemAccess_flags)r->access[d];
            }
        if ((rc = A.Map((CUdeviceptr)r->addr, r->size, r->offset, h, 0)) != CUDA_SUCCESS) {
            unmake(e, h, r);
            return rc;
        }
        if (n && (rc = A.SetAccess((CUdeviceptr)r->addr, r->size, acc, n)) != CUDA_SUCCESS) {
            unmake(e, h, r->next_of);
            return rc;
        }
    }
    *out = h;
    return CUDA_SUCCESS;
}

static int resume_adopted(const char *tag, vmm__sleep_io *io, vmm__sleep_out *out, char *why, size_t len)
{
    if (!pausable()) return 0;
    pthread_mutex_lock(&A.lock);
    (void)choose_locked(tag, 1); /* a paused handle is never pinned */
    CUresult rc = CUDA_SUCCESS;
    handle_entry *failed = NULL;
    for (handle_entry *e = A.handles; e && rc == CUDA_SUCCESS; e = e->hh.next) {
        if (!e->mark) continue;
        int pushed = push(e->ctx);
        rc = remake(e, &e->real);
        pop(pushed);
        if (rc == CUDA_SUCCESS) e->mark = 2;
        else failed = e;
    }
    if (rc != CUDA_SUCCESS) { /* all or nothing: what this resume made goes again */
        for (handle_entry *e = A.handles; e; e = e->hh.next)
            if (e->mark == 2) {
                int pushed = push(e->ctx);
                unmake(e, e->real, NULL);
                pop(pushed);
                e->real = 0;
            }
        pthread_mutex_unlock(&A.lock);
        vmm__sleep_say(why, len, rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO,
            "%s %llu bytes of the program's own VMM memory on device %d failed (CUDA error %d); nothing was lost: the "
            "memory stays paused, resume again once memory is free",
            rc == CUDA_ERROR_OUT_OF_MEMORY ? "the device is full: making" : "making and mapping",
            (unsigned long long)failed->size, failed->dev, (int)rc);
        vmm__log(VMM__LOG_ERROR, "vmm_resume: %s", why);
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    }
    /* the copies back are queued, and waited for once before any record is live again */
    int lost = 0, queued = 0;
    for (handle_entry *e = A.handles; e; e = e->hh.next) {
        if (!e->mark) continue;
        int pushed = push(e->ctx);
        for (range *r = e->ranges; r; r = r->next_of)
            if (vmm__sleep_holds(r->kept)) {
                if (vmm__sleep_restore(io, (CUdeviceptr)r->addr, r->kept) == 0) {
                    out->kept += r->size;
                    queued++;
                } else
                    lost++;
            }
        pop(pushed);
    }
    if (vmm__sleep_wait(io)) { /* which of them failed is not known */
        lost += queued;
        out->kept = 0;
    }
    for (handle_entry *e = A.handles; e; e = e->hh.next) {
        if (!e->mark) continue;
        int pushed = push(e->ctx);
        for (range *r = e->ranges; r; r = r->next_of) {
            if (vmm__sleep_holds(r->kept)) vmm__sleep_kept_done(&r->kept); /* its pinned buffer stays for the next pause */
            out->allocations++;
        }
        /* the program had released its handle: its mappings hold the memory, as before the pause */
        if (!e->refs && VMM__TWICE(A.Release(e->real)) != CUDA_SUCCESS)
            vmm__log(VMM__LOG_WARNING, "resume: cuMemRelease of a creation reference failed twice; the driver keeps "
                     "its memory until exit");
        pop(pushed);
        e->paused = 0;
        e->mark = 0;
        e->chunk_id = vmm__new_chunk_id(); /* importers never take it for the released one */
        HASH_ADD(hr, A.by_real, real, sizeof e->real, e);
        for (range *r = e->ranges; r; r = r->next_of) vmm__range_set_paused(&r->pub, 0, e->chunk_id, e->exportable);
        out->released += e->size;
        out->segments++;
    }
    pthread_mutex_unlock(&A.lock);
    if (lost) {
        vmm__log(VMM__LOG_ERROR, "vmm_resume: copying the kept contents of %d ranges of the program's own VMM memory "
                 "back failed; their bytes are undefined", lost);
        return vmm__sleep_say(why, len, -EIO, "copying the kept contents of %d ranges back failed", lost);
    }
    return 0;
}

static uint64_t prepare_adopted(const char *tag)
{
    if (!pausable()) return 0;
    size_t n = 0, i = 0;
    CUcontext ctx = NULL;
    pthread_mutex_lock(&A.lock);
    for (handle_entry *e = A.handles; e; e = e->hh.next)
        if (vmm__tag_selects(tag, e->tag) && e->stand_in && !e->shared && !e->paused)
            for (range *r = e->ranges; r; r = r->next_of) n += vmm__sleep_lacks_buffer(&r->kept, r->size);
    uint64_t *addrs = n ? malloc(n * sizeof *addrs) : NULL, *sizes = n ? malloc(n * sizeof *sizes) : NULL;
    for (handle_entry *e = addrs && sizes ? A.handles : NULL; e; e = e->hh.next)
        if (vmm__tag_selects(tag, e->tag) && e->stand_in && !e->shared && !e->paused)
            for (range *r = e->ranges; r && i < n; r = r->next_of)
                if (vmm__sleep_lacks_buffer(&r->kept, r->size)) {
                    if (!ctx) ctx = e->ctx;
                    addrs[i] = r->addr;
                    sizes[i++] = r->size;
                }
    pthread_mutex_unlock(&A.lock);
    void **made = i ? calloc(i, sizeof *made) : NULL;
    uint64_t ready = 0;
    if (made) vmm__sleep_prepare_buffers(ctx, sizes, made, i); /* with no lock held */
    pthread_mutex_lock(&A.lock);
    for (size_t k = 0; made && k < i; k++) {
        if (!made[k]) continue;
        range *r = NULL;
        HASH_FIND(hh, A.by_addr, &addrs[k], sizeof addrs[k], r);
        if (r && r->size == sizes[k] && !r->h->paused && !r->unmapping && vmm__sleep_lacks_buffer(&r->kept, sizes[k])) {
            vmm__sleep_kept_free(r->kept);
            r->kept = made[k];
            ready += sizes[k];
        } else
            vmm__sleep_kept_free(made[k]);
    }
    pthread_mutex_unlock(&A.lock);
    free(made);
    free(addrs);
    free(sizes);
    return ready;
}

static int overlaps_adopted(const uint64_t *starts, const uint64_t *sizes, size_t n)
{
    int hit = 0;
    if (!vmm__adopt_on()) return 0;
    pthread_mutex_lock(&A.lock);
    for (range *r = A.by_addr, *next; r && !hit; r = next) {
        next = r->hh.next;
        for (size_t i = 0; r->h->paused && i < n && !hit; i++) hit = starts[i] < r->addr + r->size && r->addr < starts[i] + sizes[i];
    }
    pthread_mutex_unlock(&A.lock);
    return hit;
}

static int host_adopted(uint64_t addr, void **host, uint64_t *bytes)
{
    int rc = -ENOENT;
    if (!vmm__adopt_on()) return rc;
    pthread_mutex_lock(&A.lock);
    for (range *r = A.by_addr; r; r = r->hh.next) {
        if (addr < r->addr || addr - r->addr >= r->size) continue;
        rc = vmm__sleep_host_at(r->kept, addr - r->addr, host, bytes);
        break;
    }
    pthread_mutex_unlock(&A.lock);
    return rc;
}

static uint64_t drop_host_adopted(const char *tag)
{
    uint64_t freed = 0;
    if (!vmm__adopt_on()) return 0;
    pthread_mutex_lock(&A.lock);
    for (range *r = A.by_addr; r; r = r->hh.next)
        if (!r->h->paused && vmm__tag_selects(tag, r->h->tag)) freed += vmm__sleep_drop_idle(&r->kept);
    pthread_mutex_unlock(&A.lock);
    return freed;
}

static const vmm__sleep_adopted ops = {survey,          contexts,         pause_adopted, resume_adopted, prepare_adopted,
                                       overlaps_adopted, host_adopted, drop_host_adopted};

/* One atomic store, no CUDA call and nothing read: whether anything is pausable is decided when a
 * pause comes (VMMSHIM_SLEEP_ADOPTED). */
__attribute__((constructor)) static void hand_in(void) { vmm__sleep_adopted_by(&ops); }
