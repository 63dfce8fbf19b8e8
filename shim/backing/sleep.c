/* Sleep and wake: the physical memory under a tag's pools goes back to the device, the address
 * reservations stay, and later fresh handles are mapped at exactly the old places with the same
 * access, the kept contents copied back.  Every allocation is already a VMM handle mapped where
 * the shim chose, so this works under any allocator of the program.
 *
 * Pools are chosen in one place only (pools_of): a thread tag's allocations lie in pools of
 * their own (tags.c), so pausing a tag gives whole segments back.
 *
 * Pausing works arena by arena.  A paused arena keeps its blocks (live ones still found by their
 * address, so frees and lookups work), but its free blocks are in no bin (vmm__pool_set_paused),
 * so the pool places nothing there: allocations made while paused go to new arenas.  Its empty
 * segments go back outright; each other segment is unmapped and its handle released, its fds
 * closed (vseg.paused).  A segment emptied while paused goes back through the pool as any empty
 * one, and seg_destroy then touches no driver handle.  Records stay live, flagged
 * VMM_REG_F_PAUSED, offering no handle, so a companion's import is refused (the broker finds the
 * segment paused too); at resume each segment gets a new id, so no import cache keyed on the old
 * one serves a mapping of the released handle.
 *
 * The copies (host memory, pinned from 1 MiB and kept across cycles, or the file; queued and
 * waited for once an arena) are sleep_copy.c's.
 *
 * All of it runs under vmm__S.lock, after the devices were synchronized outside it: the pool
 * cannot change under a pause, and the broker cannot pin a segment meanwhile (it pins under the
 * lock).  The program must not queue work on the memory while it is paused: the shim cannot
 * stop a kernel that touches an unmapped address.
 *
 * The program's own VMM memory (cuMemCreate + cuMemMap) joins each call through the table
 * adopt_sleep.c hands in (vmm__sleep_adopted_by): surveyed and waited for with the pools, paused
 * after them and resumed before them, always with vmm__S.lock let go, since adopt.c takes it under
 * its own lock when it publishes.  A resume of both is all or nothing within each: a full device
 * in the pools after the program's memory was mapped leaves that mapped and the pools paused, and a
 * second vmm_resume maps the rest. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api/vmm_api.h"
#include "backing/internal.h"
#include "backing/sleep.h"
#include "broker/broker.h"
#include "broker/holders.h"
#include "broker/protocol.h"
#include "core/log.h"
#include "core/options.h"
#include "registry/keep.h"

#define MAX_POOLS (2 * (VMM__MAX_TAGS + 1))
#define MAX_CTX 16

/* The one place a tag becomes pools.  NULL: every pool of d; the process's tag (VMMSHIM_TAG, ""
 * by default): the untagged pair; a thread tag (tags.c): that tag's pair. */
static int pools_of(device_state *d, const char *tag, vmm__pool **out, int max)
{
    int n = 0;
    if (!d->pool_ready) return 0;
    if (!tag) {
        VMM__FOR_POOLS(d, p, k)
            if (n < max) out[n++] = p;
        return n;
    }
    if (strncmp(tag, vmm__S.tag, sizeof vmm__S.tag) == 0)
        for (int k = 0; k < 2 && n < max; k++) out[n++] = &d->pool[k];
    uint32_t t = vmm__tag_find(tag);
    vmm__pool *pair = t ? vmm__pools_of_locked(d, t, 0) : NULL;
    for (int k = 0; pair && k < 2 && n < max; k++) out[n++] = &pair[k];
    return n;
}

void vmm__sleep_forget_locked(vmm__block *b)
{
    vmm__sleep_kept_free(b->kept);
    b->kept = NULL;
}

static int push(CUcontext ctx) { return vmm__sleep_push(ctx); }

static void pop(void) { vmm__sleep_pop(); }

static const vmm__sleep_adopted *adopted; /* NULL until adopt_sleep.c's constructor ran */

void vmm__sleep_adopted_by(const vmm__sleep_adopted *ops) { __atomic_store_n(&adopted, ops, __ATOMIC_RELEASE); }

static const vmm__sleep_adopted *adopted_ops(void) { return __atomic_load_n(&adopted, __ATOMIC_ACQUIRE); }

/* ---- waiting for the device ---- */

/* The contexts live allocations of the chosen pools were made in, each once. */
static int contexts_locked(const char *tag, CUcontext *ctx, int max)
{
    int n = 0;
    for (vmm__block *b = vmm__S.by_addr; b; b = b->hh.next) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(vmm__dev_of_block(b), tag, pools, MAX_POOLS), mine = 0;
        for (int i = 0; i < np; i++) mine |= pools[i] == b->arena->pool;
        if (!mine || !b->ctx) continue;
        int seen = 0;
        for (int i = 0; i < n; i++) seen |= ctx[i] == b->ctx;
        if (!seen && n < max) ctx[n++] = b->ctx;
    }
    return n;
}

static void wait_for_devices(const char *tag)
{
    CUcontext ctx[MAX_CTX];
    pthread_mutex_lock(&vmm__S.lock);
    int n = contexts_locked(tag, ctx, MAX_CTX);
    pthread_mutex_unlock(&vmm__S.lock);
    const vmm__sleep_adopted *a = adopted_ops();
    CUcontext more[MAX_CTX];
    int m = a ? a->contexts(tag, more, MAX_CTX) : 0;
    for (int j = 0; j < m; j++) {
        int seen = 0;
        for (int i = 0; i < n; i++) seen |= ctx[i] == more[j];
        if (!seen && n < MAX_CTX) ctx[n++] = more[j];
    }
    for (int i = 0; i < n; i++)
        if (push(ctx[i])) {
            vmm__cu.CtxSynchronize();
            pop();
        }
}

/* The broker exports a segment's handle with the lock let go, the segment pinned: wait (with the
 * lock let go, at most ~2 s) until no segment of the chosen pools is pinned.  Lock held on return. */
static int unpinned_locked(const char *tag)
{
    for (int tries = 0; tries < 2000; tries++) {
        int pinned = 0;
        for (int i = 0; i < MAX_DEVICES && !pinned; i++) {
            vmm__pool *pools[MAX_POOLS];
            int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
            for (int k = 0; k < np && !pinned; k++)
                for (vmm__seg *s = pools[k]->segs; s && !pinned; s = s->snext) pinned = ((vseg *)s->mech)->exporting != 0;
        }
        if (!pinned) return 0;
        pthread_mutex_unlock(&vmm__S.lock);
        usleep(1000);
        pthread_mutex_lock(&vmm__S.lock);
    }
    return -EBUSY;
}

/* What state the chosen pools are in: *any_pools, *paused (an arena paused), *awake (one not). */
static void survey_locked(const char *tag, int *any_pools, int *paused, int *awake)
{
    *any_pools = *paused = *awake = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
        *any_pools |= np > 0;
        for (int k = 0; k < np; k++)
            for (vmm__arena *a = pools[k]->arenas; a; a = a->next) {
                *paused |= a->paused;
                *awake |= !a->paused;
            }
    }
}

static uint64_t not_shim_locked(void)
{
    uint64_t bytes = 0;
    for (note *n = vmm__S.notes; n; n = n->hh.next) bytes += n->size;
    return bytes;
}

/* ---- pause ---- */

/* VMMSHIM_PAUSE_GUARD: the scratch chunk at the place of paused segment s, with the access its
 * memory had (a failure leaves it unmapped, as without the guard). */
static void guard(vmm__seg *s)
{
    vseg *c = s->mech;
    if (!vmm__guard_on()) return;
    device_state *d = &vmm__S.dev[c->dev];
    CUmemAccessDesc acc[MAX_DEVICES];
    size_t n = (size_t)vmm__access_list(d, acc, vmm__pool_kind(d, s->arena->pool) == 0);
    c->guarded = vmm__guard_map(d, s->base, s->size, acc, n) == 0;
}

static void unguard(vmm__seg *s)
{
    vseg *c = s->mech;
    if (c->guarded) vmm__guard_unmap(&vmm__S.dev[c->dev], s->base, s->size);
    c->guarded = 0;
}

static void release_seg(vmm__seg *s)
{
    vseg *c = s->mech;
    if (c->exported_fd >= 0) close(c->exported_fd);
    if (c->broker_fd >= 0) {
        close(c->broker_fd);
        __atomic_store_n(&vmm__S.kept_fds, vmm__S.kept_fds - 1, __ATOMIC_RELAXED);
    }
    c->exported_fd = c->broker_fd = -1;
    c->has_fabric = 0;
    CUresult unmap = VMM__TWICE(vmm__cu.MemUnmap(s->base, s->size));
    CUresult release = VMM__TWICE(vmm__cu.MemRelease(c->handle));
    if (unmap || release)
        vmm__log(VMM__LOG_WARNING, "pause: %s of %llu bytes failed twice (CUDA error %d); the driver keeps them until exit",
                 unmap ? "cuMemUnmap" : "cuMemRelease", (unsigned long long)s->size, (int)(unmap ? unmap : release));
    c->handle = 0;
    c->paused = 1;
    guard(s);
}

/* A released segment's key and size, for the wait for its holders (a failed growth leaves that
 * segment out of the wait: it is still released, and its holders go unreported). */
static void note_gone(vmm__sleep_out *out, uint64_t key, uint64_t size)
{
    if (out->n_gone == out->cap_gone) {
        size_t cap = out->cap_gone ? 2 * out->cap_gone : 64;
        uint64_t *k = realloc(out->gone_keys, cap * sizeof *k);
        if (k) out->gone_keys = k;
        uint64_t *z = k ? realloc(out->gone_sizes, cap * sizeof *z) : NULL;
        if (z) out->gone_sizes = z;
        if (!k || !z) return;
        out->cap_gone = cap;
    }
    out->gone_keys[out->n_gone] = key;
    out->gone_sizes[out->n_gone++] = size;
}

/* After a pause released segments (and rang the keeper): wait a bounded time for the companions
 * that imported them to let go, then report who still holds what, in out and in one warning line.
 * The keeper, rung already, closed its fds without a word (it took them raw): its pid is dropped. */
static void wait_for_holders(vmm__sleep_out *out)
{
    if (out->n_gone && vmm__S.registry_ok) {
        vmm_reg_proc *me = vmm__reg_self(&vmm__S.reg);
        uint32_t keeper = me ? __atomic_load_n(&me->keeper_pid, __ATOMIC_RELAXED) : 0;
        if (keeper) vmm__holders_drop((pid_t)keeper, out->gone_keys, out->n_gone);
    }
    vmm__held h;
    vmm__holders_wait(out->gone_keys, out->gone_sizes, out->n_gone, (unsigned)vmm__opt_int(VMM__OPT_PAUSE_HOLD_WAIT_MS),
                      &h);
    free(out->gone_keys);
    free(out->gone_sizes);
    out->gone_keys = out->gone_sizes = NULL;
    out->n_gone = out->cap_gone = 0;
    out->held = h.bytes;
    out->n_holders = h.n_pids;
    memcpy(out->holders, h.pids, sizeof out->holders);
    if (!h.n_pids) return;
    char pids[8 * 12 + 32]; /* on the stack: a warning never allocates */
    size_t at = 0;
    uint32_t shown = h.n_pids < VMM__HOLDERS_REPORT ? h.n_pids : VMM__HOLDERS_REPORT;
    for (uint32_t i = 0; i < shown; i++)
        at += (size_t)snprintf(pids + at, sizeof pids - at, "%s%u", i ? ", " : "", h.pids[i]);
    if (h.n_pids > shown) snprintf(pids + at, sizeof pids - at, " and %u more", h.n_pids - shown);
    vmm__log(VMM__LOG_WARNING, "pause: %llu bytes of paused memory still held by pid %s (imports not released); the "
             "device gets them back when they let go", (unsigned long long)h.bytes, pids);
}

static void mark_records_locked(vmm__arena *a, int paused)
{
    if (!vmm__S.registry_ok) return;
    for (vmm__block *b = a->first; b; b = b->next) {
        if (b->free || !b->live || b->slot == NO_SLOT) continue;
        if (paused) {
            vmm__reg_set_paused(&vmm__S.reg, b->slot, 1, 0, 0, -1, NULL);
            continue;
        }
        uint32_t n;
        uint64_t bytes;
        vseg *c = vmm__span_of(b, &n, &bytes)->mech;
        uint32_t kinds = __atomic_load_n(&vmm__S.broker_started, __ATOMIC_ACQUIRE) > 0 ? VMM_HANDLE_BROKER : 0;
        if (n == 1 && c->exported_fd >= 0) kinds |= VMM_HANDLE_PIDFD;
        if (n == 1 && c->has_fabric) kinds |= VMM_HANDLE_FABRIC;
        vmm__reg_set_paused(&vmm__S.reg, b->slot, 0, c->id, kinds, c->exported_fd, c->has_fabric ? c->fabric : NULL);
    }
}

/* Release the arena's segments (in address order from *at) that end at or below `below`. */
static void release_below(vmm__pool *p, vmm__arena *a, uint64_t *at, uint64_t below, vmm__sleep_out *out)
{
    uint64_t end = a->base + a->size;
    while (*at < end) {
        vmm__seg *s = vmm__pool_seg_at(a, p->granule, *at);
        if (!s) {
            *at += p->granule;
            continue;
        }
        if (s->base + s->size > below) return;
        *at = s->base + s->size;
        if (((vseg *)s->mech)->paused) continue;
        note_gone(out, ((vseg *)s->mech)->id, s->size);
        release_seg(s);
        out->released += s->size;
        out->segments++;
    }
}

/* Queue the copies of a's live blocks, in address order, with marks (sleep.h) naming the end of the
 * last block copied.  0, or an error with the copies waited for and nothing of the arena held. */
static int copy_arena(vmm__arena *a, vmm__sleep_io *io, vmm__sleep_marks *mk, uint64_t *kept, char *why, size_t len)
{
    int rc = 0;
    vmm__block *b;
    for (b = a->first; b && !rc; b = b->next) {
        if (b->free || !b->live) continue;
        int pushed = push(b->ctx);
        rc = vmm__sleep_keep(io, b->addr, b->requested, &b->kept);
        if (pushed) pop();
        if (rc) {
            vmm__sleep_say(why, len, rc, "copying %llu bytes at 0x%llx out %s", (unsigned long long)b->requested,
                           (unsigned long long)b->addr,
                           rc == -ENOMEM ? "failed: no host memory" : io->f ? "to the file failed" : "failed (a driver call)");
            break;
        }
        *kept += b->requested;
        vmm__sleep_marks_add(io, mk, b->requested, (uintptr_t)(b->addr + b->size));
    }
    if (!rc) return 0;
    /* nothing of the arena is released: the contents copied so far go, their buffers stay */
    vmm__sleep_marks_end(mk);
    (void)vmm__sleep_wait(io);
    for (vmm__block *u = a->first; u != b; u = u->next)
        if (vmm__sleep_holds(u->kept)) vmm__sleep_kept_done(&u->kept);
    return rc;
}

/* Pause arena a of p: copy out, release, mark.  0, or an error: one found while queueing the
 * copies (no host memory, a driver call refused) leaves nothing of a released; a copy that fails
 * on the device (a sticky error: the context is lost anyway) is reported after the arena went. */
static int pause_arena(vmm__pool *p, vmm__arena *a, unsigned flags, vmm__sleep_io *io, vmm__sleep_out *out, char *why,
                       size_t len)
{
    int dropped, rc = 0, failed = 0;
    uint64_t t0 = vmm__now_ns(NULL);
    out->released += vmm__pool_release_arena(p, a, &dropped); /* its empty segments first */
    out->ns_release += vmm__now_ns(NULL) - t0;
    if (dropped) return 0;
    t0 = vmm__now_ns(NULL);
    vmm__sleep_marks mk = {0};
    uint64_t kept = 0, at = a->base;
    uintptr_t upto;
    if (!(flags & VMM_PAUSE_DISCARD) && (rc = copy_arena(a, io, &mk, &kept, why, len))) return rc;
    for (vmm__block *b = a->first; b; b = b->next) out->allocations += !b->free && b->live;
    vmm__pool_set_paused(p, a, 1);
    while (vmm__sleep_marks_next(&mk, &upto, &failed)) /* what is copied goes while the rest still moves */
        release_below(p, a, &at, upto, out);
    vmm__sleep_marks_end(&mk);
    if (vmm__sleep_wait(io) || failed)
        rc = vmm__sleep_say(why, len, -EIO, "a copy out failed on the device; the contents are undefined");
    out->kept += kept;
    uint64_t t1 = vmm__now_ns(NULL);
    out->ns_copy += t1 - t0; /* the releases under the copies count as copying: they cost nothing more */
    release_below(p, a, &at, UINT64_MAX, out);
    mark_records_locked(a, 1);
    out->ns_release += vmm__now_ns(NULL) - t1;
    return rc;
}

/* The live allocations of the chosen pools' awake arenas (an array the caller frees, *n of them;
 * as many as memory allowed). */
static vmm__block **awake_blocks_locked(const char *tag, size_t *n)
{
    size_t cap = 0;
    vmm__block **v = NULL;
    *n = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
        for (int k = 0; k < np; k++)
            for (vmm__arena *a = pools[k]->arenas; a; a = a->next)
                for (vmm__block *b = a->paused ? NULL : a->first; b; b = b->next) {
                    if (b->free || !b->live) continue;
                    if (*n == cap) {
                        size_t c = cap ? 2 * cap : 256;
                        vmm__block **m = realloc(v, c * sizeof *m);
                        if (!m) return v;
                        v = m;
                        cap = c;
                    }
                    v[(*n)++] = b;
                }
    }
    return v;
}

/* The pinned buffers the chosen pools' live allocations lack, made at once (sleep_copy.c). */
static void pin_ahead_locked(const char *tag)
{
    size_t n;
    vmm__block **blocks = awake_blocks_locked(tag, &n);
    void ***slots = n ? malloc(n * sizeof *slots) : NULL;
    uint64_t *sizes = n ? malloc(n * sizeof *sizes) : NULL;
    for (size_t i = 0; slots && sizes && i < n; i++) {
        slots[i] = &blocks[i]->kept;
        sizes[i] = blocks[i]->requested;
    }
    if (slots && sizes) (void)vmm__sleep_pin_ahead(slots, sizes, n);
    free(blocks);
    free(slots);
    free(sizes);
}

int vmm__sleep_pause(const char *tag, unsigned flags, vmm__sleep_out *out, char *why, size_t len)
{
    memset(out, 0, sizeof *out);
    *why = 0;
    if (!vmm__S.ready) return vmm__sleep_say(why, len, -ENODEV, "the shim is not active in this process");
    if ((flags & ~(unsigned)(VMM_PAUSE_DISCARD | VMM_PAUSE_FILE)) || (flags & VMM_PAUSE_DISCARD && flags & VMM_PAUSE_FILE))
        return vmm__sleep_say(why, len, -EINVAL, "bad flags 0x%x", flags);
    if (!(flags & VMM_PAUSE_DISCARD) && (!vmm__cu.MemcpyDtoH || !vmm__cu.MemcpyHtoD))
        return vmm__sleep_say(why, len, -EIO, "the driver lacks cuMemcpyDtoH/cuMemcpyHtoD: only VMM_PAUSE_DISCARD works");
    if (__atomic_load_n(&vmm__S.captures, __ATOMIC_ACQUIRE) > 0)
        return vmm__sleep_say(why, len, -EBUSY, "a stream is being captured: waiting for the device would break the capture");
    uint64_t t0 = vmm__now_ns(NULL);
    wait_for_devices(tag); /* no queued work may touch memory about to go */
    out->ns_device = vmm__now_ns(NULL) - t0;
    /* the program's own VMM memory is surveyed and paused with no lock of ours held: adopt.c
     * takes vmm__S.lock under its own */
    const vmm__sleep_adopted *ad = adopted_ops();
    int a_any = 0, a_paused = 0, a_awake = 0;
    uint64_t a_left = 0;
    if (ad) ad->survey(tag, &a_any, &a_paused, &a_awake, &a_left);
    pthread_mutex_lock(&vmm__S.lock);
    int any, paused, awake, rc = unpinned_locked(tag);
    survey_locked(tag, &any, &paused, &awake);
    any |= a_any;
    paused |= a_paused;
    awake |= a_awake;
    if (rc) vmm__sleep_say(why, len, rc, "the broker kept exporting a segment for 2 s");
    else if (!any) rc = vmm__sleep_say(why, len, -ENOENT, "no memory is tagged \"%s\"", tag ? tag : "");
    /* what is paused already stays so (a tag paused before a pause of everything): only when
     * nothing is left awake is the call a no-op */
    else if (paused && !awake) rc = vmm__sleep_say(why, len, -EALREADY, "already paused: resume first");
    vmm__sleep_io io = {0};
    if (!rc && (flags & VMM_PAUSE_FILE)) rc = vmm__sleep_io_file(&io, why, len);
    if (!rc && !flags) pin_ahead_locked(tag);
    for (int i = 0; i < MAX_DEVICES && !rc; i++) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
        for (int k = 0; k < np && !rc; k++) {
            vmm__pool_settle(pools[k]); /* the device was waited for: every free is reached */
            for (vmm__arena *a = pools[k]->arenas, *next; a && !rc; a = next) {
                next = a->next;
                if (!a->paused) rc = pause_arena(pools[k], a, flags, &io, out, why, len);
            }
        }
    }
    out->not_shim = not_shim_locked() + a_left;
    pthread_mutex_unlock(&vmm__S.lock);
    if (!rc && a_awake) rc = ad->pause(tag, flags, &io, out, why, len);
    vmm__sleep_io_end(&io);
    if (rc && out->segments) { /* what was paused before the failure stays paused, and resumable */
        size_t used = strlen(why);
        snprintf(why + used, len - used, "; %llu bytes paused before it stay paused: vmm_resume restores them",
                 (unsigned long long)out->released);
    }
    /* a keeper holding these segments lets go of them before the call returns (at most
     * VMM__KEEP_LET_GO_MS; one relaxed load when nobody keeps us) */
    if (out->segments && vmm__S.registry_ok) vmm__keep_ring(&vmm__S.reg, VMM__KEEP_LET_GO_MS);
    wait_for_holders(out);
    if (!rc)
        vmm__info("pause of %s%s%s: %llu bytes released, %llu kept in %.1f ms (waiting for the device %.1f ms, "
                  "copies %.1f ms, releases %.1f ms; the program's own memory, the keeper and holders the rest)",
                  tag ? "\"" : "everything", tag ? tag : "", tag ? "\"" : "", (unsigned long long)out->released,
                  (unsigned long long)out->kept, (double)(vmm__now_ns(NULL) - t0) / 1e6, (double)out->ns_device / 1e6,
                  (double)out->ns_copy / 1e6, (double)out->ns_release / 1e6);
    return rc;
}

/* ---- ahead of a pause ---- */

int64_t vmm__sleep_prepare(const char *tag)
{
    if (!vmm__S.ready) return -ENODEV;
    size_t n = 0, all;
    CUcontext ctx = NULL;
    pthread_mutex_lock(&vmm__S.lock);
    vmm__block **blocks = awake_blocks_locked(tag, &all);
    uint64_t *addrs = all ? malloc(all * sizeof *addrs) : NULL, *sizes = all ? malloc(all * sizeof *sizes) : NULL;
    for (size_t i = 0; addrs && sizes && i < all; i++) {
        vmm__block *b = blocks[i];
        if (!vmm__sleep_lacks_buffer(&b->kept, b->requested)) continue;
        if (!ctx) ctx = b->ctx;
        addrs[n] = b->addr;
        sizes[n++] = b->requested;
    }
    free(blocks);
    pthread_mutex_unlock(&vmm__S.lock);
    void **made = n ? calloc(n, sizeof *made) : NULL;
    int64_t ready = 0;
    if (made) vmm__sleep_prepare_buffers(ctx, sizes, made, n); /* the slow part, with no lock held */
    pthread_mutex_lock(&vmm__S.lock);
    for (size_t i = 0; made && i < n; i++) {
        if (!made[i]) continue;
        vmm__block *b = NULL;
        uint64_t at = addrs[i];
        HASH_FIND(hh, vmm__S.by_addr, &at, sizeof at, b);
        /* still the same allocation, awake, and still without one (a pause meanwhile made its own) */
        if (b && b->live && !b->free && b->requested == sizes[i] && !b->arena->paused &&
            vmm__sleep_lacks_buffer(&b->kept, sizes[i])) {
            vmm__sleep_kept_free(b->kept);
            b->kept = made[i];
            ready += (int64_t)sizes[i];
        } else
            vmm__sleep_kept_free(made[i]);
    }
    pthread_mutex_unlock(&vmm__S.lock);
    free(made);
    free(addrs);
    free(sizes);
    const vmm__sleep_adopted *ad = adopted_ops();
    if (ad && ad->prepare) ready += (int64_t)ad->prepare(tag);
    return ready;
}

static int any_overlap(uint64_t lo, uint64_t hi, const uint64_t *starts, const uint64_t *sizes, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (starts[i] < hi && lo < starts[i] + sizes[i]) return 1;
    return 0;
}

int vmm__sleep_overlaps(const uint64_t *starts, const uint64_t *sizes, size_t n)
{
    int hit = 0;
    if (!vmm__S.ready) return 0;
    pthread_mutex_lock(&vmm__S.lock);
    for (int i = 0; i < MAX_DEVICES && !hit; i++) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(&vmm__S.dev[i], NULL, pools, MAX_POOLS);
        for (int k = 0; k < np && !hit; k++)
            for (vmm__arena *a = pools[k]->arenas; a && !hit; a = a->next)
                hit = a->paused && any_overlap(a->base, a->base + a->size, starts, sizes, n);
    }
    pthread_mutex_unlock(&vmm__S.lock);
    const vmm__sleep_adopted *ad = adopted_ops();
    if (!hit && ad && ad->overlaps) hit = ad->overlaps(starts, sizes, n);
    return hit;
}

/* ---- the host copies, for a program that reads them (vmm_sleep_host) or wants them gone ---- */

int vmm__sleep_host(uint64_t addr, void **host, uint64_t *bytes)
{
    if (!vmm__S.ready) return -ENOENT;
    pthread_mutex_lock(&vmm__S.lock);
    vmm__block *b = vmm__block_containing_locked(addr);
    int ours = b != NULL, rc = ours ? vmm__sleep_host_at(b->kept, addr - b->addr, host, bytes) : -ENOENT;
    pthread_mutex_unlock(&vmm__S.lock);
    const vmm__sleep_adopted *ad = adopted_ops();
    if (!ours && ad && ad->host) rc = ad->host(addr, host, bytes);
    return rc;
}

uint64_t vmm__sleep_drop_host(const char *tag)
{
    uint64_t freed = 0;
    if (!vmm__S.ready) return 0;
    pthread_mutex_lock(&vmm__S.lock);
    for (int i = 0; i < MAX_DEVICES; i++) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
        for (int k = 0; k < np; k++)
            for (vmm__arena *a = pools[k]->arenas; a; a = a->next)
                for (vmm__block *b = a->paused ? NULL : a->first; b; b = b->next)
                    if (b->live && !b->free) freed += vmm__sleep_drop_idle(&b->kept);
    }
    pthread_mutex_unlock(&vmm__S.lock);
    const vmm__sleep_adopted *ad = adopted_ops();
    if (ad && ad->drop_host) freed += ad->drop_host(tag);
    return freed;
}

/* ---- resume ---- */

/* Map a fresh handle at paused segment s (marked 2 until the resume commits): 0, or -ENOMEM /
 * -EIO with nothing made. */
static int remap_seg(device_state *d, vmm__seg *s)
{
    vseg *c = s->mech;
    CUmemAllocationProp p = {0};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = d->index;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | (d->fabric ? CU_MEM_HANDLE_TYPE_FABRIC : 0);
    CUmemGenericAllocationHandle h;
    CUresult rc = vmm__cu.MemCreate(&h, s->size, &p, 0);
    if (rc != CUDA_SUCCESS) return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    CUmemAccessDesc acc[MAX_DEVICES];
    unguard(s);
    if ((rc = vmm__cu.MemMap(s->base, s->size, 0, h, 0)) != CUDA_SUCCESS) {
        (void)VMM__TWICE(vmm__cu.MemRelease(h));
        guard(s);
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    }
    /* the access it would get now: peer grants made while paused count too */
    if ((rc = vmm__cu.MemSetAccess(s->base, s->size, acc, (size_t)vmm__access_list(d, acc, vmm__pool_kind(d, s->arena->pool) == 0))) !=
        CUDA_SUCCESS) {
        (void)VMM__TWICE(vmm__cu.MemUnmap(s->base, s->size));
        (void)VMM__TWICE(vmm__cu.MemRelease(h));
        guard(s);
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    }
    c->handle = h;
    c->paused = 2;
    return 0;
}

/* Every segment mapped by this resume so far goes back to paused (commit 0), or stays (1). */
static void settle_remapped(const char *tag, int commit, vmm__sleep_out *out)
{
    for (int i = 0; i < MAX_DEVICES; i++) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
        for (int k = 0; k < np; k++)
            for (vmm__seg *s = pools[k]->segs; s; s = s->snext) {
                vseg *c = s->mech;
                if (c->paused != 2) continue;
                if (commit) {
                    c->paused = 0;
                    c->id = vmm__new_chunk_id(); /* importers never take it for the released one */
                    vmm__export_seg(c);
                    out->released += s->size;
                    out->segments++;
                    continue;
                }
                (void)VMM__TWICE(vmm__cu.MemUnmap(s->base, s->size));
                (void)VMM__TWICE(vmm__cu.MemRelease(c->handle));
                c->handle = 0;
                c->paused = 1;
                guard(s);
            }
    }
}

int vmm__sleep_resume(const char *tag, vmm__sleep_out *out, char *why, size_t len)
{
    memset(out, 0, sizeof *out);
    *why = 0;
    if (!vmm__S.ready) return vmm__sleep_say(why, len, -ENODEV, "the shim is not active in this process");
    const vmm__sleep_adopted *ad = adopted_ops();
    int a_any = 0, a_paused = 0, a_awake = 0;
    uint64_t a_left = 0;
    if (ad) ad->survey(tag, &a_any, &a_paused, &a_awake, &a_left);
    pthread_mutex_lock(&vmm__S.lock);
    int any, paused, awake, rc = 0;
    survey_locked(tag, &any, &paused, &awake);
    if (!any && !a_any) rc = vmm__sleep_say(why, len, -ENOENT, "no memory is tagged \"%s\"", tag ? tag : "");
    else if (!paused && !a_paused) rc = vmm__sleep_say(why, len, -EALREADY, "not paused");
    if (!rc && a_paused) {
        /* the program's own memory first, with our lock let go (adopt.c takes it under its own):
         * a full device there changes nothing at all; one in the pools below leaves the program's
         * memory resumed and the pools paused, and a second vmm_resume maps the rest */
        pthread_mutex_unlock(&vmm__S.lock);
        vmm__sleep_io io = {0};
        rc = ad->resume(tag, &io, out, why, len);
        vmm__sleep_io_end(&io);
        pthread_mutex_lock(&vmm__S.lock);
    }
    /* first everything is mapped, so that a full device changes nothing */
    for (int i = 0; i < MAX_DEVICES && !rc; i++) {
        device_state *d = &vmm__S.dev[i];
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(d, tag, pools, MAX_POOLS);
        for (int k = 0; k < np; k++) /* what was emptied while paused goes, not mapped again */
            for (vmm__arena *a = pools[k]->arenas, *next; a; a = next) {
                int dropped;
                next = a->next;
                if (a->paused) vmm__pool_release_arena(pools[k], a, &dropped);
            }
        /* a give-back below drops only arenas with no segment left, never a paused one */
        for (int k = 0; k < np && !rc; k++)
            for (vmm__arena *a = pools[k]->arenas; a && !rc; a = a->next) {
                if (!a->paused) continue;
                for (vmm__seg *s = pools[k]->segs; s && !rc; s = s->snext) {
                    if (s->arena != a || ((vseg *)s->mech)->paused != 1) continue;
                    if ((rc = remap_seg(d, s)) == 0) continue;
                    if (rc == -ENOMEM) { /* the empty segments the pools keep go first, as for an allocation */
                        for (int j = 0; j < 2; j++) vmm__pool_release(&d->pool[j], 0, 0, UINT64_MAX);
                        if ((rc = remap_seg(d, s)) == 0) continue;
                    }
                    vmm__sleep_say(why, len, rc, "%s %llu bytes on device %d failed%s",
                        rc == -ENOMEM ? "the device is full: making" : "making and mapping", (unsigned long long)s->size,
                        d->index, "; nothing was lost: the memory stays paused, resume again once memory is free");
                }
            }
    }
    if (rc) {
        settle_remapped(tag, 0, out);
        pthread_mutex_unlock(&vmm__S.lock);
        if (rc == -ENOMEM || rc == -EIO) vmm__log(VMM__LOG_ERROR, "vmm_resume: %s", why);
        return rc;
    }
    settle_remapped(tag, 1, out);
    /* the copies back are queued, all of them, and waited for once before any arena is awake
     * again (a companion may import it then) */
    vmm__sleep_io io = {0};
    int lost = 0, queued = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && vmm__sleep_wait(&io)) { /* which of them failed is not known */
            lost += queued;
            out->kept = 0;
        }
        for (int i = 0; i < MAX_DEVICES; i++) {
            vmm__pool *pools[MAX_POOLS];
            int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
            for (int k = 0; k < np; k++)
                for (vmm__arena *a = pools[k]->arenas; a; a = a->next) {
                    if (!a->paused) continue;
                    for (vmm__block *b = a->first; b; b = b->next) {
                        if (b->free || !b->live || !vmm__sleep_holds(b->kept)) continue; /* none: discarded */
                        if (pass == 1) {
                            vmm__sleep_kept_done(&b->kept); /* its pinned buffer stays for the next pause */
                            continue;
                        }
                        int pushed = push(b->ctx);
                        if (vmm__sleep_restore(&io, b->addr, b->kept) == 0) {
                            out->kept += b->requested;
                            queued++;
                        } else
                            lost++;
                        if (pushed) pop();
                    }
                    if (pass == 0) continue;
                    for (vmm__block *b = a->first; b; b = b->next) out->allocations += !b->free && b->live;
                    vmm__pool_set_paused(pools[k], a, 0);
                    mark_records_locked(a, 0);
                }
        }
    }
    vmm__sleep_io_end(&io);
    out->not_shim = not_shim_locked() + a_left;
    for (int i = 0; i < MAX_DEVICES; i++) {
        uint64_t first, written = vmm__S.dev[i].scratch_va ? vmm__guard_check(&vmm__S.dev[i], &first) : 0;
        if (written)
            vmm__log(VMM__LOG_WARNING, "resume: while paused, kernels wrote %llu bytes into paused memory on device %d "
                     "(the first at offset 0x%llx of a %zu-byte piece); VMMSHIM_PAUSE_GUARD took them into a scratch "
                     "chunk, so they are lost: the program touched memory it had paused", (unsigned long long)written, i,
                     (unsigned long long)first, vmm__S.dev[i].granularity);
    }
    pthread_mutex_unlock(&vmm__S.lock);
    /* a keeper takes the new chunks at once: the records changed without a publish it would see */
    if (out->segments && vmm__S.registry_ok) vmm__keep_ring(&vmm__S.reg, 0);
    if (lost) {
        vmm__log(VMM__LOG_ERROR, "vmm_resume: copying the kept contents of %d allocations back failed; their bytes are undefined", lost);
        return vmm__sleep_say(why, len, -EIO, "copying the kept contents of %d allocations back failed", lost);
    }
    return 0;
}

/* ---- from outside the process (protocol v4, on the broker thread) ---- */

static uint64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* A peer with an import's rights asks to pause or resume.  The safety rule: only the program
 * knows whether it will launch kernels on the memory meanwhile (one that does crashes), so it must
 * opt in (VMMSHIM_REMOTE_PAUSE=1); without it a pause and a resume alike are refused and nothing
 * is touched.  With it this is exactly an in-process vmm_pause (devices waited for first); the
 * broker thread holds no lock and pins no segment here, so the pause's own waits cannot wait for
 * it, and an in-process pause at the same time is serialized by vmm__S.lock. */
static void remote_control(const vmm_broker_request4 *q, vmm_broker_reply4 *rep, vmm_broker_held4 *held)
{
    if (!vmm__opt_bool(VMM__OPT_REMOTE_PAUSE)) {
        rep->status = -EPERM;
        snprintf(rep->why, sizeof rep->why, "pid %d does not accept remote pause: it must opt in with "
                 "VMMSHIM_REMOTE_PAUSE=1 (a kernel touching paused memory would crash it)", (int)getpid());
        return;
    }
    uint64_t t0 = mono_ns();
    vmm__sleep_out o;
    const char *tag = q->tag[0] ? q->tag : NULL;
    int rc = q->op == VMM_BROKER_OP_PAUSE ? vmm__sleep_pause(tag, q->flags, &o, rep->why, sizeof rep->why)
                                          : vmm__sleep_resume(tag, &o, rep->why, sizeof rep->why);
    rep->status = rc;
    if (rc == 0) rep->why[0] = 0;
    rep->bytes_released = o.released;
    rep->bytes_kept = o.kept;
    rep->bytes_not_shim = o.not_shim;
    rep->segments = o.segments;
    rep->allocations = o.allocations;
    rep->ns = mono_ns() - t0;
    held->bytes_held = o.held; /* the wait's findings, as vmm_pause_ex's report has them */
    held->n_holders = o.n_holders;
    memcpy(held->holders, o.holders, sizeof held->holders);
}

void vmm__sleep_serve_remote(void) { vmm__broker_set_control(remote_control); }
