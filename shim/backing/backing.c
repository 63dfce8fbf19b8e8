/* The backing's entry points, which the forwarding-only hooks (shim/hooks) call: allocation
 * (from the pool, with the retries before the device counts as full), free (a synchronous free
 * waits for its context, or for the end of a capture; a stream-ordered one becomes reusable once
 * an event shows the stream reached it), lookups, peer access, capture and stream bookkeeping, and
 * a device's reset.  Each device has two pools, as natively cudaMalloc's memory and the default
 * pool's are apart.  The mechanism they use lies on the floors below (internal.h): this file holds
 * the order in which it is used, and no state of its own. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backing/internal.h"
#include "backing/sleep.h"
#include "core/log.h"
#include "core/options.h"
#include "registry/keep.h"

/* Every empty segment of d's pools but `keep` goes (the device is full). */
static void release_others_locked(device_state *d, const vmm__pool *keep)
{
    VMM__FOR_POOLS(d, p, k)
        if (p != keep) vmm__pool_release(p, 0, 0, UINT64_MAX);
}

/* From pool p of d (the pair of the caller's tag, of the call's kind).  When the device is full,
 * the other pools' empty segments go too, and then the frees still in flight are waited for
 * (outside the lock: a wait under it would stall every thread) before one more try; only then is
 * the device full for the shim. */
static vmm__block *alloc_locked(device_state *d, vmm__pool *p, size_t size, int ordered, uint64_t stream, int *err)
{
    vmm__block *b = vmm__pool_alloc(p, size, ordered, stream, err);
    if (b || *err != -ENOMEM) return b;
    release_others_locked(d, p);
    if ((b = vmm__pool_alloc(p, size, ordered, stream, err)) || *err != -ENOMEM) return b;
    void *ev[64];
    unsigned n = 0;
    VMM__FOR_POOLS(d, q, k) n += vmm__pool_pending_events(q, ev + n, 64 - n);
    if (n == 0) return NULL;
    pthread_mutex_unlock(&vmm__S.lock);
    for (unsigned i = 0; i < n; i++) vmm__cu.EventSynchronize((CUevent)ev[i]); /* one recycled meanwhile only waits longer */
    pthread_mutex_lock(&vmm__S.lock);
    release_others_locked(d, p);
    return vmm__pool_alloc(p, size, ordered, stream, err);
}

static int kept_by_a_keeper(void)
{
    vmm_reg_proc *self = vmm__S.ready && vmm__S.registry_ok ? vmm__reg_self(&vmm__S.reg) : NULL;
    return self && __atomic_load_n(&self->keeper_pid, __ATOMIC_RELAXED);
}

int vmm__keep_let_go(void)
{
    if (!kept_by_a_keeper()) return 0;
    vmm__keep_ring(&vmm__S.reg, VMM__KEEP_LET_GO_MS);
    return 1;
}

/* alloc_locked, and when the device is full for it and a keeper keeps this process: the keeper
 * may still hold segments given back a moment ago, so ask it to let go (outside the lock; at most
 * VMM__KEEP_LET_GO_MS) and try once more. */
static vmm__block *alloc_kept_locked(device_state *d, vmm__pool *p, size_t size, int ordered, uint64_t stream, int *err)
{
    vmm__block *b = alloc_locked(d, p, size, ordered, stream, err);
    if (b || *err != -ENOMEM || !kept_by_a_keeper()) return b;
    pthread_mutex_unlock(&vmm__S.lock);
    vmm__keep_ring(&vmm__S.reg, VMM__KEEP_LET_GO_MS);
    pthread_mutex_lock(&vmm__S.lock);
    return vmm__pool_alloc(p, size, ordered, stream, err);
}

vmm__result vmm__alloc(size_t size, uint32_t api, int stream_ordered, CUstream stream, void **ptr)
{
    if (!vmm__ensure_init()) return vmm__S.failed && vmm__opt_bool(VMM__OPT_STRICT) ? VMM__REFUSED : VMM__DISABLED;
    if (!ptr || size == 0) return VMM__PASS; /* the runtime's own answer for these */
    CUcontext ctx;
    int runtime_api = api == VMM_API_CUDA_MALLOC || api == VMM_API_CUDA_MALLOC_ASYNC;
    int dev = vmm__current_device(&ctx, runtime_api);
    if (dev < 0 || !vmm__device_usable(dev)) return vmm__opt_bool(VMM__OPT_STRICT) && dev >= 0 ? VMM__REFUSED : VMM__UNSUPPORTED;
    device_state *d = &vmm__S.dev[dev];
    /* the program's own pool is current: its allocations are its pool's, noted, not exportable */
    if (stream_ordered && __atomic_load_n(&d->custom_pool, __ATOMIC_ACQUIRE)) return VMM__OWN_POOL;
    vmm__start_broker(); /* one atomic load once it has started */
    vmm__frames f;
    vmm__frames_capture(&f); /* before the lock: it takes the loader lock */

    pthread_mutex_lock(&vmm__S.lock);
    vmm__pools_ready_locked(d);
    int err;
    vmm__pool *pair = vmm__pools_of_locked(d, vmm__thread_tag, 1);
    if (!pair) pair = d->pool; /* no memory for a tag's pools: its allocation goes with the untagged */
    vmm__block *b = alloc_kept_locked(d, &pair[stream_ordered], size, stream_ordered, vmm__stream_key(stream), &err);
    if (!b) {
        pthread_mutex_unlock(&vmm__S.lock);
        if (err == -ENOMEM) return vmm__margin_refused() ? VMM__MARGIN : VMM__NOMEM;
        vmm__log(VMM__LOG_WARNING, "VMM allocation of %zu bytes failed (%s); passing it through", size, strerror(-err));
        return VMM__UNSUPPORTED;
    }
    b->requested = size;
    b->api = api;
    b->ctx = ctx;
    b->live = 1;
    HASH_ADD(hh, vmm__S.by_addr, addr, sizeof(uint64_t), b);
    vmm__publish_locked(b, stream, &f);
    pthread_mutex_unlock(&vmm__S.lock);
    vmm_reg_proc *c = vmm__coverage_now();
    vmm__count(&c->allocs);
    vmm__count(&c->allocs_backed);
    *ptr = (void *)(uintptr_t)b->addr;
    return VMM__DONE;
}

static void sync_ctx(CUcontext ctx)
{
    CUcontext prev = NULL;
    /* a current context that cannot be read cannot be restored either: then no switch */
    int switched = vmm__cu.CtxGetCurrent(&prev) == CUDA_SUCCESS && prev != ctx && vmm__cu.CtxSetCurrent(ctx) == CUDA_SUCCESS;
    vmm__cu.CtxSynchronize();
    if (switched) (void)VMM__TWICE(vmm__cu.CtxSetCurrent(prev)); /* else the thread stays in ctx */
}

/* Lock held.  Detach the deferred blocks of ctx: a synchronization of ctx covers them. */
static vmm__block *take_deferred_locked(CUcontext ctx)
{
    vmm__block *mine = NULL, **pp = &vmm__S.deferred;
    while (*pp) {
        vmm__block *b = *pp;
        if (b->ctx == ctx) {
            *pp = b->fnext;
            b->fnext = mine;
            mine = b;
        } else {
            pp = &b->fnext;
        }
    }
    return mine;
}

static void pool_free_list_locked(vmm__block *list)
{
    while (list) {
        vmm__block *b = list;
        list = b->fnext;
        if (vmm__pool_free(b->arena->pool, b, 0, NULL)) vmm__emptied_locked(b->arena->pool, 0);
    }
}

vmm__result vmm__free(void *ptr, int stream_ordered, CUstream stream)
{
    if (!ptr || !vmm__S.ready) return VMM__PASS;
    uint64_t p = (uint64_t)(uintptr_t)ptr;
    int capturing = stream_ordered && vmm__stream_capturing(stream); /* a driver call: not under the lock */
    /* A stream-ordered free records its event only when someone needs it (vmm__pool_free_unrecorded):
     * that needs the stream's context, here the current one.  Another thread's per-thread
     * stream cannot be named later, so its frees record at once. */
    CUcontext stream_ctx = NULL;
    if (stream_ordered && !capturing && stream != CU_STREAM_PER_THREAD && vmm__cu.CtxGetCurrent(&stream_ctx) != CUDA_SUCCESS)
        stream_ctx = NULL;
    pthread_mutex_lock(&vmm__S.lock);
    vmm__block *b = NULL;
    HASH_FIND(hh, vmm__S.by_addr, &p, sizeof p, b);
    if (!b) {
        note *n = NULL;
        HASH_FIND(hh, vmm__S.notes, &p, sizeof p, n);
        if (n) HASH_DELETE(hh, vmm__S.notes, n); /* the real runtime owns it; drop our note of it */
        vmm__result r = n ? VMM__PASS : vmm__arena_containing_locked(p) ? VMM__INVALID : VMM__PASS;
        pthread_mutex_unlock(&vmm__S.lock);
        if (n) {
            if (n->slot != NO_SLOT) vmm__reg_remove(&vmm__S.reg, n->slot);
            free(n);
        }
        return r;
    }
    if (capturing) {
        /* Natively (an H100, driver 580) a stream-ordered free, captured, of memory allocated
         * before the capture fails with cudaErrorInvalidValue, the capture goes on and the memory
         * stays allocated; the shim's memory was all allocated outside any capture. */
        pthread_mutex_unlock(&vmm__S.lock);
        return VMM__INVALID;
    }
    HASH_DELETE(hh, vmm__S.by_addr, b);
    vmm__retract_locked(b); /* out of the registry before the memory can be reused */
    b->live = 0;
    if (b->kept) vmm__sleep_forget_locked(b); /* paused contents, or the pinned buffer kept for the next pause */
    device_state *d = vmm__dev_of_block(b);
    vmm__pool *pool = b->arena->pool;
    CUevent ev = NULL;
    if (stream_ordered && stream_ctx) {
        if (vmm__pool_free_unrecorded(pool, b, (uint64_t)(uintptr_t)stream, stream_ctx,
                                      __atomic_add_fetch(&vmm__S.free_seq, 1, __ATOMIC_RELEASE)))
            vmm__emptied_locked(pool, 1);
        if (!__atomic_load_n(&vmm__sync.unrecorded_due, __ATOMIC_RELAXED)) __atomic_store_n(&vmm__sync.unrecorded_due, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&vmm__S.lock);
        return VMM__DONE;
    }
    if (stream_ordered) {
        ev = vmm__event_get_locked(d);
        pthread_mutex_unlock(&vmm__S.lock);
        if (!ev || vmm__cu.EventRecord(ev, stream) != CUDA_SUCCESS) {
            if (ev) vmm__cu.EventDestroy(ev);
            ev = NULL;
            vmm__cu.StreamSynchronize(stream);
        }
    } else {
        if (__atomic_load_n(&vmm__S.captures, __ATOMIC_ACQUIRE) > 0) {
            /* synchronizing now would invalidate the capture: the block waits for a later sync */
            b->fnext = vmm__S.deferred;
            vmm__S.deferred = b;
            pthread_mutex_unlock(&vmm__S.lock);
            return VMM__DONE;
        }
        vmm__block *covered = take_deferred_locked(b->ctx);
        pthread_mutex_unlock(&vmm__S.lock);
        sync_ctx(b->ctx); /* cudaFree waits for the device, and so must we before reuse */
        pthread_mutex_lock(&vmm__S.lock);
        pool_free_list_locked(covered);
    }
    if (stream_ordered) pthread_mutex_lock(&vmm__S.lock); /* the other branch holds it already */
    if (vmm__pool_free(pool, b, vmm__stream_key(stream), ev)) vmm__emptied_locked(pool, stream_ordered);
    pthread_mutex_unlock(&vmm__S.lock);
    return VMM__DONE;
}

void vmm__stream_destroying(CUstream stream)
{
    if (!vmm__S.ready || !__atomic_load_n(&vmm__sync.unrecorded_due, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&vmm__S.lock);
    for (int i = 0; i < MAX_DEVICES; i++) {
        if (!vmm__S.dev[i].pool_ready) continue;
        VMM__FOR_POOLS(&vmm__S.dev[i], p, k) vmm__pool_record_stream(p, (uint64_t)(uintptr_t)stream);
    }
    pthread_mutex_unlock(&vmm__S.lock);
}

void vmm__capture_begun(void) { __atomic_add_fetch(&vmm__S.captures, 1, __ATOMIC_ACQ_REL); }

/* The last capture ended: the frees deferred meanwhile are synchronized and reused now. */
void vmm__capture_ended(void)
{
    int left = __atomic_sub_fetch(&vmm__S.captures, 1, __ATOMIC_ACQ_REL);
    if (left < 0) __atomic_store_n(&vmm__S.captures, left = 0, __ATOMIC_RELEASE); /* a capture begun before the shim loaded */
    if (left > 0 || !vmm__S.ready) return;
    for (;;) {
        pthread_mutex_lock(&vmm__S.lock);
        CUcontext ctx = vmm__S.deferred ? vmm__S.deferred->ctx : NULL;
        vmm__block *covered = ctx ? take_deferred_locked(ctx) : NULL;
        pthread_mutex_unlock(&vmm__S.lock);
        if (!covered) return;
        sync_ctx(ctx);
        pthread_mutex_lock(&vmm__S.lock);
        pool_free_list_locked(covered);
        pthread_mutex_unlock(&vmm__S.lock);
    }
}

size_t vmm__pool_free_bytes_current(void)
{
    if (!vmm__S.ready) return 0;
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (vmm__cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx || vmm__cu.CtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES)
        return 0;
    pthread_mutex_lock(&vmm__S.lock);
    device_state *d = &vmm__S.dev[dev];
    /* what a request could get: empty segments go when a pool must grow or the device is full;
     * free space between live blocks serves only requests that fit there */
    size_t n = 0;
    if (d->pool_ready) VMM__FOR_POOLS(d, p, k) n += vmm__pool_empty_bytes(p);
    pthread_mutex_unlock(&vmm__S.lock);
    return n;
}

int vmm__stream_capturing(CUstream stream)
{
    /* No stream of the process captures (every capture begins through the hooks that count
     * them): no driver call on every stream-ordered allocation and free. */
    if (__atomic_load_n(&vmm__S.captures, __ATOMIC_ACQUIRE) == 0) return 0;
    if (!vmm__ensure_init()) return 0;
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return vmm__cu.StreamIsCapturing(stream, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

int vmm__lookup(uint64_t ptr, vmm__alloc_ref *out)
{
    if (!vmm__S.ready || !ptr) return 0;
    pthread_mutex_lock(&vmm__S.lock);
    vmm__block *b = vmm__block_containing_locked(ptr);
    if (b) {
        uint32_t n;
        uint64_t bytes;
        vmm__seg *first = vmm__span_of(b, &n, &bytes);
        out->base = b->addr;
        out->requested = b->requested;
        out->mapped = bytes;
        out->chunk_offset = b->addr - first->base;
        out->dev = ((vseg *)first->mech)->dev;
        out->slot = b->slot;
        out->generation = b->generation;
        memcpy(out->alloc_id, b->alloc_id, 16);
    }
    pthread_mutex_unlock(&vmm__S.lock);
    return b != NULL;
}

int vmm__owned(uint64_t ptr)
{
    if (!vmm__S.ready || !ptr) return 0;
    pthread_mutex_lock(&vmm__S.lock);
    int owned = vmm__arena_containing_locked(ptr) != NULL;
    pthread_mutex_unlock(&vmm__S.lock);
    return owned;
}

/* acc on each mapping of d's pools that peer `bit` reaches through cuMemSetAccess (cudaMalloc's
 * segments only while the two devices are no peers), in one order, up to `stop` (NULL: all).
 * Returns the first that refused (*rc its error), or NULL; with `unrestored`, refusals are
 * counted (each tried twice) and the walk goes on. */
static vmm__seg *set_access_until(device_state *d, uint64_t bit, const CUmemAccessDesc *acc, const vmm__seg *stop,
                                  CUresult *rc, unsigned *unrestored)
{
    if (!d->pool_ready) return NULL;
    VMM__FOR_POOLS(d, p, k) {
        if (k == 0 && (d->peers & bit)) continue;
        for (vmm__seg *s = p->segs; s; s = s->snext) {
            if (s == stop) return NULL;
            if (((vseg *)s->mech)->paused) continue; /* no mapping now: resume maps it with the access of then */
            if (unrestored) {
                if (VMM__TWICE(vmm__cu.MemSetAccess(s->base, s->size, acc, 1)) != CUDA_SUCCESS) (*unrestored)++;
            } else if ((*rc = vmm__cu.MemSetAccess(s->base, s->size, acc, 1)) != CUDA_SUCCESS)
                return s;
        }
    }
    return NULL;
}

/* Peer access is granted per mapping with cuMemSetAccess: enabling it in the driver does not
 * cover VMM memory.  accessor may then use owner's chunks, now and in future.  All or nothing: if
 * one chunk refuses, the ones changed before it are set back and the call's error returned, so
 * the program's call can fail whole as a real one would. */
CUresult vmm__peer_access(int accessor, int owner, int enable, int *changed)
{
    if (changed) *changed = 0;
    if (!vmm__ensure_init() || accessor < 0 || owner < 0 || accessor >= MAX_DEVICES || owner >= MAX_DEVICES || accessor == owner)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&vmm__S.lock);
    device_state *d = &vmm__S.dev[owner];
    uint64_t bit = 1ull << accessor;
    int was = (__atomic_load_n(&d->accessors, __ATOMIC_ACQUIRE) & bit) != 0;
    CUresult rc = CUDA_SUCCESS;
    if (was != !!enable) {
        CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = accessor},
                               .flags = enable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE};
        unsigned unrestored = 0;
        vmm__seg *failed = set_access_until(d, bit, &acc, NULL, &rc, NULL);
        if (failed) {
            acc.flags = was ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
            CUresult ignored;
            set_access_until(d, bit, &acc, failed, &ignored, &unrestored);
            if (unrestored)
                vmm__log(VMM__LOG_WARNING, "peer access %d->%d: %u mappings could not be set back after a failed %s", accessor,
                         owner, unrestored, enable ? "grant" : "revoke");
        } else {
            if (enable) __atomic_or_fetch(&d->accessors, bit, __ATOMIC_RELEASE);
            else __atomic_and_fetch(&d->accessors, ~bit, __ATOMIC_RELEASE);
            if (changed) *changed = 1;
        }
    }
    pthread_mutex_unlock(&vmm__S.lock);
    return rc;
}

/* The device's primary context is about to be reset: native frees every allocation made on it,
 * and the default pool's settings go back to their defaults.  The shim's memory would survive a
 * reset (VMM mappings are not the context's), so it is let go of here, before the driver's
 * reset: each live allocation's record retracted and its block forgotten, every chunk unmapped
 * and released, the pool's events destroyed while their context still exists.  A free of an old
 * pointer afterwards then reaches the driver, which refuses it as native does. */
void vmm__device_reset(int dev)
{
    if (!vmm__S.ready) return;
    if (dev < 0) {
        CUcontext ctx = NULL;
        CUdevice cur = -1;
        if (vmm__cu.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx || vmm__cu.CtxGetDevice(&cur) != CUDA_SUCCESS) return;
        dev = (int)cur;
    }
    if (dev < 0 || dev >= MAX_DEVICES) return;
    pthread_mutex_lock(&vmm__S.lock);
    device_state *d = &vmm__S.dev[dev];
    vmm__block *b, *bt;
    HASH_ITER(hh, vmm__S.by_addr, b, bt) {
        if (vmm__dev_of_block(b) != d) continue;
        HASH_DELETE(hh, vmm__S.by_addr, b);
        vmm__retract_locked(b);
        b->live = 0;
        if (b->kept) vmm__sleep_forget_locked(b);
    }
    note *n, *nt;
    HASH_ITER(hh, vmm__S.notes, n, nt) {
        if (n->dev != dev) continue;
        HASH_DELETE(hh, vmm__S.notes, n);
        if (n->slot != NO_SLOT) vmm__reg_remove(&vmm__S.reg, n->slot);
        free(n);
    }
    for (vmm__block **pp = &vmm__S.deferred; *pp;) /* their segments go with the pool */
        if (vmm__dev_of_block(*pp) == d) *pp = (*pp)->fnext;
        else pp = &(*pp)->fnext;
    if (d->pool_ready) {
        vmm__pool_destroy(&d->pool[0]);
        vmm__pool_destroy(&d->pool[1]);
        vmm__tags_destroy_locked(d);
        d->pool_ready = 0;
    }
    while (d->n_events) vmm__cu.EventDestroy(d->events[--d->n_events]);
    d->release_threshold = 0;
    d->reuse_off = 0;
    __atomic_store_n(&d->custom_pool, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&vmm__S.lock);
}
