/* libvmmshim-client: the companion API of tools/include/vmmshim.h, the public face over the
 * import mechanism in shim/import (which the shim's legacy IPC shares).
 *
 * Reader side: open the registry (read-only, or writable for gc), describe it, iterate its
 * allocation and process records, find an allocation by (pid, interior address), and check or
 * reclaim dead owners' records.  The argument checks and error strings are here; opening,
 * record conversion, liveness and lookup are shim/import/records.c.  Everything goes through the
 * internal registry API (shim/registry/registry.h) and the published layout
 * (shim/registry/layout.h).
 *
 * Rules: this library never prints, never exits and links no CUDA library.  Every failure
 * leaves a one-line reason in a thread-local buffer (vmm_last_error()).  Reads never touch
 * pages of the shared segment that no writer has backed (a read fault on a tmpfs hole would
 * allocate it): the sparse process table is scanned with pread, not through the mapping. */
#include "vmmshim.h"
#include "import/import.h"
#include "import/fdroom.h"

#include "registry/keep.h"
#include "registry/registry.h"

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define VMM_PUBLIC __attribute__((visibility("default")))

/* ------------------------------------------------------------------------------------------ */
/* Errors (the reasons themselves are recorded by shim/import/records.c)                       */

VMM_PUBLIC const char *vmm_strerror(vmm_status status) { return vmm__status_text(status); }

VMM_PUBLIC const char *vmm_last_error(void) { return vmm__error_text(); }

#define set_error vmm__error
#define SAME(a, b) ((int)(a) == (int)(b))

#define NEED(cond, what)                                                                          \
    do {                                                                                          \
        if (!(cond)) return set_error(VMM_ERR_INVALID, "%s: %s", __func__, what);                 \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* Open, close, describe                                                                       */

VMM_PUBLIC vmm_status vmm_open(const char *name, vmm_registry **out)
{
    vmm_status st = vmm__open(name, VMM__REG_READ, out);
    if (st == VMM_OK) vmm__fd_room_grow(); /* a companion: takes will follow */
    return st;
}

VMM_PUBLIC vmm_status vmm_open_writable(const char *name, vmm_registry **out)
{
    return vmm__open(name, VMM__REG_WRITE, out);
}

VMM_PUBLIC void vmm_close(vmm_registry *reg) { vmm__close(reg); }

static uint64_t chunks_hwm(const vmm__reg *r)
{
    uint64_t hwm = __atomic_load_n(&r->hdr->chunks_hwm, __ATOMIC_ACQUIRE);
    return hwm > r->hdr->chunk_count ? r->hdr->chunk_count : hwm;
}

VMM_PUBLIC vmm_status vmm_registry_describe(vmm_registry *reg, vmm_registry_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    const vmm__reg *r = &reg->r;
    const vmm_reg_header *h = r->hdr;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", r->name);
    out->version = h->version;
    out->compat_version = h->compat_version;
    out->capacity = h->capacity;
    out->chunk_records = h->chunk_records;
    out->created_ns = h->created_ns;
    out->total_bytes = h->total_size;
    out->touched_bytes = vmm__reg_footprint(r);
    /* Chunks beyond the high-water mark were never handed out; their table is backed anyway. */
    const uint64_t *ct = vmm__chunk_table(r);
    for (uint64_t c = 0, hwm = chunks_hwm(r); c < hwm; c++)
        if (__atomic_load_n(&ct[c], __ATOMIC_ACQUIRE) != 0) out->used_chunks++;
    out->publishes = __atomic_load_n(&h->stat_publishes, __ATOMIC_RELAXED);
    out->retracts = __atomic_load_n(&h->stat_retracts, __ATOMIC_RELAXED);
    out->reclaimed = __atomic_load_n(&h->stat_reclaimed, __ATOMIC_RELAXED);
    return VMM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Check (read-only; mirrors vmm__reg_gc's decisions) and gc                                   */

/* Per proc slot, as gc judges it: its claim generation, and whether it is dead. */
typedef struct {
    const vmm__reg *r;
    uint32_t *gens;
    uint8_t *dead;
    vmm_gc_report *rep;
    vmm__reg_wait wait;
} check_walk;

static int check_proc(void *ctx, uint32_t index, uint64_t claim)
{
    check_walk *w = ctx;
    vmm_reg_proc p;
    uint32_t pid;
    int alive;
    w->gens[index] = (uint32_t)(claim >> 32);
    int rc = vmm__read_claimed_proc(w->r, index, claim, &p, &pid, &alive, &w->wait);
    if (rc == -ENOENT) return 0; /* released meanwhile */
    if (rc) alive = vmm__pid_exists((uint32_t)claim) ? VMM__UNKNOWN : VMM__DEAD;
    if (alive == VMM__ALIVE) w->rep->procs_alive++;
    if (alive == VMM__UNKNOWN) w->rep->procs_unknown++;
    if (alive == VMM__DEAD) {
        w->rep->procs_dead++;
        w->dead[index] = 1;
    }
    return 0;
}

/* True when the index stays odd (gc died mid-rebuild) and no writer holds its lock. */
static bool index_torn(const vmm__reg *r)
{
    for (int i = 0; i < 200; i++) {
        if (!(__atomic_load_n(&r->hdr->index_seq, __ATOMIC_ACQUIRE) & 1u)) return false;
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    if (__atomic_load_n(&r->hdr->index_lock, __ATOMIC_ACQUIRE) != 0) return false; /* a writer is at it */
    return (__atomic_load_n(&r->hdr->index_seq, __ATOMIC_ACQUIRE) & 1u) != 0;
}

VMM_PUBLIC vmm_status vmm_check(vmm_registry *reg, vmm_gc_report *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    memset(out, 0, sizeof *out);
    const vmm__reg *r = &reg->r;
    char why[200];
    int rc = vmm__reg_validate(r->base, r->map_size, why, sizeof why);
    if (rc) {
        /* why reads "registry: <reason>": put the name in */
        const char *reason = strncmp(why, "registry", 8) == 0 ? why + 8 : why;
        while (*reason == ' ') reason++;
        if (*reason != ':') reason = "";
        return set_error(vmm__status_of(rc, rc == -EPROTO && vmm__header_too_new(r->hdr)), "registry %s%s", r->name, reason);
    }
    uint32_t cap = r->hdr->proc_capacity;
    check_walk w = {.r = r, .gens = calloc(cap, sizeof(uint32_t)), .dead = calloc(cap, 1), .rep = out};
    if (!w.gens || !w.dead) {
        free(w.gens);
        free(w.dead);
        return set_error(VMM_ERR_NOMEM, "vmm_check: out of memory");
    }
    vmm__scan_claims(r, check_proc, &w);

    unsigned busy = 0;
    const uint64_t *ct = vmm__chunk_table(r);
    vmm_reg_alloc rec;
    vmm__reg_wait wait = {0};
    for (uint64_t ch = 0; ch < r->hdr->chunk_count; ch++) {
        uint64_t o = __atomic_load_n(&ct[ch], __ATOMIC_ACQUIRE);
        if (o == 0) continue;
        uint64_t t = o & ~VMM_REG_CHUNK_RECLAIMING;
        uint32_t idx = (uint32_t)t - 1, gen = (uint32_t)(t >> 32);
        if (idx >= cap) continue;
        /* As gc decides: the owner slot is dead in this generation, or moved on / was freed. */
        uint64_t claim = __atomic_load_n(
            &((const vmm_reg_proc *)(r->base + r->hdr->proc_off))[idx].claim, __ATOMIC_ACQUIRE);
        bool orphan = (uint32_t)(claim >> 32) != gen || (uint32_t)claim == 0;
        bool dead = w.dead[idx] && w.gens[idx] == gen;
        uint64_t first = ch * VMM_REG_CHUNK_RECORDS;
        if (dead || orphan) {
            const vmm_reg_alloc *recs = (const vmm_reg_alloc *)(r->base + r->hdr->rec_off);
            for (uint64_t s = first; s < first + VMM_REG_CHUNK_RECORDS; s++)
                if (__atomic_load_n(&recs[s].state, __ATOMIC_RELAXED) == VMM_REG_LIVE) out->records_reclaimed++;
            out->chunks_reclaimed++;
            continue;
        }
        for (uint64_t s = first; s < first + VMM_REG_CHUNK_RECORDS; s++)
            if (vmm__reg_read_alloc_within(r, s, &rec, &wait) == -EAGAIN) busy++;
    }
    free(w.gens);
    free(w.dead);
    out->index_rebuilt = index_torn(r);
    if (busy)
        return set_error(VMM_ERR_BUSY,
                         "registry %s: %u record%s of living processes stayed mid-update; retry (a process that "
                         "dies leaves them to gc)",
                         r->name, busy, busy == 1 ? "" : "s");
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_gc(vmm_registry *reg, vmm_gc_report *out)
{
    NEED(reg, "reg is NULL");
    vmm_gc_report z;
    if (!out) out = &z;
    memset(out, 0, sizeof *out);
    if (!reg->r.writable)
        return set_error(VMM_ERR_INVALID, "vmm_gc: registry %s was opened read-only; use vmm_open_writable",
                         reg->r.name);
    vmm__reg_gc_stats st;
    int rc = vmm__reg_gc(&reg->r, &st);
    if (rc) {
        char eb[128];
        return set_error(vmm__status_of(rc, false), "registry %s: gc: %s", reg->r.name, strerror_r(-rc, eb, sizeof eb));
    }
    out->procs_alive = st.procs_alive;
    out->procs_dead = st.procs_dead;
    out->procs_unknown = st.procs_unknown;
    out->records_reclaimed = st.records_reclaimed;
    out->chunks_reclaimed = st.chunks_reclaimed;
    out->index_rebuilt = st.index_rebuilt;
    return VMM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Iteration and lookup: argument checks over shim/import/records.c                           */

VMM_PUBLIC vmm_status vmm_foreach_alloc(vmm_registry *reg, vmm_alloc_fn fn, void *ctx)
{
    NEED(reg, "reg is NULL");
    NEED(fn, "fn is NULL");
    return vmm__foreach_alloc(reg, fn, ctx);
}

VMM_PUBLIC vmm_status vmm_foreach_proc(vmm_registry *reg, vmm_proc_fn fn, void *ctx)
{
    NEED(reg, "reg is NULL");
    NEED(fn, "fn is NULL");
    return vmm__foreach_proc(reg, fn, ctx);
}

VMM_PUBLIC vmm_status vmm_find_proc(vmm_registry *reg, uint32_t pid, vmm_proc_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    NEED(pid != 0, "pid is 0");
    return vmm__find_proc(reg, pid, out);
}

_Static_assert(SAME(VMM_KEEPER_WATCHING, VMM_KEEP_WATCHING) && SAME(VMM_KEEPER_KEPT, VMM_KEEP_KEPT) &&
                   SAME(VMM_END_NONE, VMM_KEEP_END_NONE) && SAME(VMM_END_EXIT, VMM_KEEP_END_EXIT) &&
                   SAME(VMM_END_SIGNAL, VMM_KEEP_END_SIGNAL) && SAME(VMM_END_UNKNOWN, VMM_KEEP_END_UNKNOWN),
               "keeper states mirror the keep file's");
_Static_assert(sizeof(((vmm_keeper_info *)0)->socket) == sizeof(((vmm_keep_file *)0)->socket), "keeper socket size");

VMM_PUBLIC vmm_status vmm_keeper_of(vmm_registry *reg, uint32_t pid, vmm_keeper_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    NEED(pid != 0, "pid is 0");
    memset(out, 0, sizeof *out);
    vmm_proc_info p;
    vmm_status st = vmm__find_proc_identity(reg, pid, &p);
    if (st != VMM_OK) return st;
    vmm_keep_file f;
    int rc = vmm__keep_read(&reg->r, pid, p.start_time, &f);
    if (rc == -ENOENT || rc == -ESRCH || (rc == 0 && f.state == VMM_KEEP_RELEASED))
        return set_error(VMM_ERR_NOT_FOUND, "pid %u is not kept (no keeper holds it)", pid);
    if (rc == -EPROTO)
        return set_error(VMM_ERR_CORRUPT, "pid %u: its keep file beside registry %s is not valid", pid, reg->r.name);
    if (rc) return vmm__reg_error(rc, NULL, false);
    out->owner_pid = pid;
    out->keeper_pid = f.keeper_pid;
    out->state = (int)f.state;
    out->end_kind = (int)f.end_kind;
    out->end_value = f.end_value;
    out->since_ns = f.since_ns;
    out->ended_ns = f.ended_ns;
    out->held_allocs = f.held_allocs;
    out->held_bytes = f.held_bytes;
    memcpy(out->socket, f.socket, sizeof out->socket);
    out->socket[sizeof out->socket - 1] = 0;
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_find(vmm_registry *reg, uint32_t pid, uint64_t address, vmm_alloc_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    NEED(pid != 0, "pid is 0");
    return vmm__find(reg, pid, address, out);
}
