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
 * Host memory: pinned (cuMemHostAlloc) for an allocation of 1 MiB or more, since only a pinned
 * destination reaches the link's device-to-host bandwidth (a pageable one goes through the
 * driver's staging buffer at about half of it); pageable malloc below that, where pinning (a
 * syscall and page locking each) costs more than the copy.  A pinned allocation that fails (a
 * locked-memory limit) falls back to pageable.  Each allocation has its own copy, so a free of a
 * paused allocation gives its copy back at once.
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
#include "broker/protocol.h"
#include "core/log.h"
#include "core/options.h"
#include "registry/keep.h"

#define PINNED_MIN (1u << 20)
#define STAGE_BYTES (8u << 20) /* the file's staging buffer */
#define MAX_POOLS (2 * (VMM__MAX_TAGS + 1))
#define MAX_CTX 16

/* The contents of one paused allocation: in host memory, or at `off` in the pause's file. */
typedef struct sleep_file {
    int fd;
    unsigned refs;
} sleep_file;

typedef struct kept {
    void *host;
    int pinned;
    sleep_file *file;
    uint64_t off, bytes;
} kept;

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

int vmm__sleep_say(char *why, size_t len, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
    return rc;
}

static int push(CUcontext ctx)
{
    return ctx && vmm__cu.CtxPushCurrent(ctx) == CUDA_SUCCESS;
}

static void pop(void)
{
    CUcontext popped;
    (void)VMM__TWICE(vmm__cu.CtxPopCurrent(&popped));
}

static void kept_free(kept *k)
{
    if (!k) return;
    if (k->host && k->pinned) vmm__cu.MemFreeHost(k->host);
    else free(k->host);
    if (k->file) {
        /* give the file's blocks back now: a long pause of many frees keeps no dead bytes */
        (void)fallocate(k->file->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)k->off, (off_t)k->bytes);
        if (--k->file->refs == 0) {
            close(k->file->fd);
            free(k->file);
        }
    }
    free(k);
}

void vmm__sleep_forget_locked(vmm__block *b)
{
    kept_free(b->kept);
    b->kept = NULL;
}

/* ---- copies ---- */

typedef struct stage {
    void *buf;
    int pinned;
} stage;

static int stage_get(stage *s)
{
    if (s->buf) return 0;
    if (vmm__cu.MemHostAlloc && vmm__cu.MemHostAlloc(&s->buf, STAGE_BYTES, 0) == CUDA_SUCCESS) s->pinned = 1;
    else if (!(s->buf = malloc(STAGE_BYTES))) return -ENOMEM;
    return 0;
}

static void stage_put(stage *s)
{
    if (!s->buf) return;
    if (s->pinned) vmm__cu.MemFreeHost(s->buf);
    else free(s->buf);
    s->buf = NULL;
}

struct vmm__sleep_io {
    sleep_file *f; /* VMM_PAUSE_FILE: the contents go to its end */
    uint64_t file_end;
    stage st;
};

/* Copy n bytes at addr out (context pushed): into host memory, or at the end of the io's file. */
static int keep_bytes(vmm__sleep_io *io, CUdeviceptr addr, uint64_t n, kept **out)
{
    sleep_file *f = io->f;
    kept *k = calloc(1, sizeof *k);
    if (!k) return -ENOMEM;
    k->bytes = n;
    if (f) {
        if (stage_get(&io->st)) return free(k), -ENOMEM;
        k->off = io->file_end;
        for (uint64_t at = 0; at < n;) {
            size_t piece = n - at < STAGE_BYTES ? (size_t)(n - at) : STAGE_BYTES;
            if (vmm__cu.MemcpyDtoH(io->st.buf, addr + at, piece) != CUDA_SUCCESS) return free(k), -EIO;
            for (size_t w = 0; w < piece;) {
                ssize_t got = pwrite(f->fd, (char *)io->st.buf + w, piece - w, (off_t)(k->off + at + w));
                if (got <= 0) return free(k), got < 0 && errno == ENOSPC ? -ENOSPC : -EIO;
                w += (size_t)got;
            }
            at += piece;
        }
        io->file_end += n;
        k->file = f;
        f->refs++;
    } else {
        if (n >= PINNED_MIN && vmm__cu.MemHostAlloc && vmm__cu.MemHostAlloc(&k->host, n, 0) == CUDA_SUCCESS) k->pinned = 1;
        else if (!(k->host = malloc(n ? n : 1))) return free(k), -ENOMEM;
        if (vmm__cu.MemcpyDtoH(k->host, addr, n) != CUDA_SUCCESS) return kept_free(k), -EIO;
    }
    *out = k;
    return 0;
}

/* Copy kept bytes back to addr (context pushed). */
static int restore_bytes(vmm__sleep_io *io, CUdeviceptr addr, const kept *k)
{
    if (!k->file) return vmm__cu.MemcpyHtoD(addr, k->host, k->bytes) == CUDA_SUCCESS ? 0 : -EIO;
    if (stage_get(&io->st)) return -ENOMEM;
    for (uint64_t at = 0; at < k->bytes;) {
        size_t piece = k->bytes - at < STAGE_BYTES ? (size_t)(k->bytes - at) : STAGE_BYTES;
        for (size_t r = 0; r < piece;) {
            ssize_t got = pread(k->file->fd, (char *)io->st.buf + r, piece - r, (off_t)(k->off + at + r));
            if (got <= 0) return -EIO;
            r += (size_t)got;
        }
        if (vmm__cu.MemcpyHtoD(addr + at, io->st.buf, piece) != CUDA_SUCCESS) return -EIO;
        at += piece;
    }
    return 0;
}

int vmm__sleep_keep(vmm__sleep_io *io, CUdeviceptr addr, uint64_t n, void **out)
{
    if (!vmm__cu.MemcpyDtoH) return -EIO;
    kept *k = NULL;
    int rc = keep_bytes(io, addr, n, &k);
    *out = k;
    return rc;
}

int vmm__sleep_restore(vmm__sleep_io *io, CUdeviceptr addr, void *k)
{
    return vmm__cu.MemcpyHtoD ? restore_bytes(io, addr, k) : -EIO;
}

void vmm__sleep_kept_free(void *k) { kept_free(k); }

static const vmm__sleep_adopted *adopted; /* NULL until adopt_sleep.c's constructor ran */

void vmm__sleep_adopted_by(const vmm__sleep_adopted *ops) { __atomic_store_n(&adopted, ops, __ATOMIC_RELEASE); }

static const vmm__sleep_adopted *adopted_ops(void) { return __atomic_load_n(&adopted, __ATOMIC_ACQUIRE); }

static sleep_file *file_open(char *why, size_t len)
{
    const char *dir = vmm__opt_str(VMM__OPT_PAUSE_DIR);
    if (!*dir) dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = "/tmp";
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600); /* unlinked: it goes with the process */
    if (fd < 0) {
        vmm__sleep_say(why, len, 0, "cannot make an unlinked file in %s (VMMSHIM_PAUSE_DIR): %s", dir, strerror(errno));
        return NULL;
    }
    sleep_file *f = calloc(1, sizeof *f);
    if (!f) {
        close(fd);
        vmm__sleep_say(why, len, 0, "out of memory");
        return NULL;
    }
    f->fd = fd;
    return f;
}

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

/* Pause arena a of p: copy out, release, mark.  0, or an error with nothing of a released. */
static int pause_arena(vmm__pool *p, vmm__arena *a, unsigned flags, vmm__sleep_io *io, vmm__sleep_out *out, char *why,
                       size_t len)
{
    int dropped;
    out->released += vmm__pool_release_arena(p, a, &dropped);
    if (dropped) return 0;
    if (!(flags & VMM_PAUSE_DISCARD)) {
        for (vmm__block *b = a->first; b; b = b->next) {
            if (b->free || !b->live) continue;
            int pushed = push(b->ctx), rc = keep_bytes(io, b->addr, b->requested, (kept **)&b->kept);
            if (pushed) pop();
            if (rc) {
                for (vmm__block *u = a->first; u != b; u = u->next) vmm__sleep_forget_locked(u);
                return vmm__sleep_say(why, len, rc, "copying %llu bytes at 0x%llx out %s", (unsigned long long)b->requested,
                           (unsigned long long)b->addr,
                           rc == -ENOMEM ? "failed: no host memory" : io->f ? "to the file failed" : "failed (a driver call)");
            }
            out->kept += b->requested;
        }
    }
    for (vmm__block *b = a->first; b; b = b->next) out->allocations += !b->free && b->live;
    vmm__pool_set_paused(p, a, 1);
    for (vmm__seg *s = p->segs; s; s = s->snext) {
        if (s->arena != a || ((vseg *)s->mech)->paused) continue;
        release_seg(s);
        out->released += s->size;
        out->segments++;
    }
    mark_records_locked(a, 1);
    return 0;
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
    wait_for_devices(tag); /* no queued work may touch memory about to go */
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
    if (!rc && (flags & VMM_PAUSE_FILE) && !(io.f = file_open(why, len))) rc = -EIO;
    sleep_file *f = io.f;
    if (f) f->refs++; /* the call's own reference, until its end */
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
    stage_put(&io.st);
    if (rc && out->segments) { /* what was paused before the failure stays paused, and resumable */
        size_t used = strlen(why);
        snprintf(why + used, len - used, "; %llu bytes paused before it stay paused: vmm_resume restores them",
                 (unsigned long long)out->released);
    }
    if (f && --f->refs == 0) {
        close(f->fd);
        free(f);
    }
    /* a keeper holding these segments lets go of them before the call returns (at most
     * VMM__KEEP_LET_GO_MS; one relaxed load when nobody keeps us) */
    if (out->segments && vmm__S.registry_ok) vmm__keep_ring(&vmm__S.reg, VMM__KEEP_LET_GO_MS);
    return rc;
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
    if ((rc = vmm__cu.MemMap(s->base, s->size, 0, h, 0)) != CUDA_SUCCESS) {
        (void)VMM__TWICE(vmm__cu.MemRelease(h));
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
    }
    /* the access it would get now: peer grants made while paused count too */
    if ((rc = vmm__cu.MemSetAccess(s->base, s->size, acc, (size_t)vmm__access_list(d, acc, vmm__pool_kind(d, s->arena->pool) == 0))) !=
        CUDA_SUCCESS) {
        (void)VMM__TWICE(vmm__cu.MemUnmap(s->base, s->size));
        (void)VMM__TWICE(vmm__cu.MemRelease(h));
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
        stage_put(&io.st);
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
    vmm__sleep_io io = {0};
    int lost = 0;
    for (int i = 0; i < MAX_DEVICES; i++) {
        vmm__pool *pools[MAX_POOLS];
        int np = pools_of(&vmm__S.dev[i], tag, pools, MAX_POOLS);
        for (int k = 0; k < np; k++)
            for (vmm__arena *a = pools[k]->arenas; a; a = a->next) {
                if (!a->paused) continue;
                for (vmm__block *b = a->first; b; b = b->next) {
                    if (b->free || !b->live) continue;
                    out->allocations++;
                    if (!b->kept) continue; /* discarded */
                    int pushed = push(b->ctx);
                    if (restore_bytes(&io, b->addr, b->kept) == 0) out->kept += b->requested;
                    else lost++;
                    if (pushed) pop();
                    vmm__sleep_forget_locked(b);
                }
                vmm__pool_set_paused(pools[k], a, 0);
                mark_records_locked(a, 0);
            }
    }
    stage_put(&io.st);
    out->not_shim = not_shim_locked() + a_left;
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
static void remote_control(const vmm_broker_request4 *q, vmm_broker_reply4 *rep)
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
}

void vmm__sleep_serve_remote(void) { vmm__broker_set_control(remote_control); }
