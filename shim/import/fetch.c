/* Getting an allocation's handles out of its owner, by every route a record may offer: one fd
 * from the broker (v1) or straight out of the owner's fd table (pidfd_getfd), and a MULTI-HANDLE
 * record's many handles from the broker (v2, several a reply).  vmm_import, vmm_import_range and
 * vmm_import_many's fallback for old brokers all fetch through here, so the route is chosen in
 * one place; vmm_import_fd and vmm_import_fds hand the fds out as they come.  Calls broker.c,
 * cache.c (the owner's entry), owners.c, driver.c and records.c. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "broker/protocol.h"
#include "registry/registry.h"

#include "import/internal.h"

void vmm__parts_release(multi_parts *p, uint32_t n_imported)
{
    for (uint32_t i = 0; i < n_imported; i++) (void)TWICE(vmm__import_cu.MemRelease(p->h[i]));
    free(p->h);
    free(p->size);
    p->h = NULL;
    p->size = NULL;
}

typedef struct v2_recv {
    vmm_broker_reply2 *rep;
    size_t len;
    int *fds;
    uint32_t n_fds;
} v2_recv;

static int recv_v2(int s, void *ctx)
{
    v2_recv *r = ctx;
    union {
        vmm_broker_reply2 rep;
        uint8_t raw[sizeof(vmm_broker_reply2) + 32];
    } in;
    memset(&in, 0, sizeof in);
    int rc = vmm__broker_recv_raw(s, in.raw, sizeof in.raw, &r->len, r->fds, VMM_BROKER_MAX_FDS, &r->n_fds);
    if (rc) return rc;
    /* a request the broker could not read gets the v1 form (protocol.h); magic and status sit
     * at the same offsets in both */
    bool ok = in.rep.magic == VMM_BROKER_MAGIC &&
              (r->len == sizeof(vmm_broker_reply2) || (r->len == sizeof(vmm_broker_reply) && in.rep.status != 0));
    if (!ok || in.rep.status != 0) {
        while (r->n_fds) close(r->fds[--r->n_fds]);
        if (!ok) return -EPROTO;
    }
    *r->rep = in.rep;
    return 0;
}

/* Every handle of a MULTI-HANDLE allocation from its owner's broker (protocol v2: up to 64 a
 * reply, asking again from where the last reply ended), handed to take() a reply at a time, in
 * order: take owns the fds it is given (closes or keeps each, also when it fails).  The broker
 * checks the allocation anew on each request, so one freed midway fails as stale, never mixes
 * handles. */
typedef vmm_status (*handles_fn)(void *ctx, const int *fds, const uint64_t *sizes, uint32_t n, uint32_t first);

static vmm_status fetch_handles(vmm_registry *reg, const vmm_alloc_info *a, uint32_t want, handles_fn take, void *ctx)
{
    owner_ref *o;
    vmm_status st = vmm__owner_get(a, &o);
    if (st != VMM_OK) return st;
    uint32_t have = 0;
    uint64_t bytes = 0;
    while (st == VMM_OK && have < want) {
        vmm_broker_request2 req;
        memset(&req, 0, sizeof req);
        req.magic = VMM_BROKER_MAGIC;
        req.version = VMM_BROKER_VERSION2;
        req.slot = a->slot;
        req.generation = a->generation;
        memcpy(req.alloc_id, a->alloc_id, sizeof req.alloc_id);
        req.first = have;
        req.max = VMM_BROKER_MAX_FDS;
        vmm_broker_reply2 rep;
        int fds[VMM_BROKER_MAX_FDS];
        v2_recv r = {.rep = &rep, .fds = fds};
        pthread_mutex_lock(&o->io);
        int rc = vmm__broker_roundtrip(reg, a, o, &req, sizeof req, recv_v2, &r, &st);
        pthread_mutex_unlock(&o->io);
        if (st != VMM_OK) break; /* could not connect: its reason */
        if (rc) {
            st = vmm__exchange_failed(a, rc);
            break;
        }
        if (rep.status == -EPROTO)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker does not speak protocol v2, which a multi-handle "
                                     "allocation (%u handles) needs; its shim is older than this library",
                         a->pid, want);
        else if (rep.status == -ERANGE)
            st = set_err(VMM_ERR_STALE, "owner pid %u's allocation no longer has the %u handles its record says "
                                        "(no handle %u)", a->pid, want, have);
        else if (rep.status != 0)
            st = vmm__reply_failed(a, rep.status);
        else if (rep.n_total != want)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker says the allocation has %u handles; the record says %u",
                         a->pid, rep.n_total, want);
        else if (rep.n_here == 0 || rep.n_here != r.n_fds || rep.n_here > want - have)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u fds for %u handles from handle %u of %u", a->pid,
                         r.n_fds, rep.n_here, have, want);
        vmm__tm.export_ns += rep.export_ns;
        for (uint32_t i = 0; i < r.n_fds && st == VMM_OK; i++) {
            if (rep.sizes[i] == 0 || rep.sizes[i] > a->mapped_size - bytes)
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent handles of more bytes than the record's %llu",
                             a->pid, (unsigned long long)a->mapped_size);
            else
                bytes += rep.sizes[i];
        }
        if (st == VMM_OK) {
            st = take(ctx, fds, rep.sizes, r.n_fds, have);
            have += r.n_fds;
        } else {
            for (uint32_t i = 0; i < r.n_fds; i++) close(fds[i]);
        }
    }
    vmm__owner_put(o);
    if (st == VMM_OK && bytes != a->mapped_size)
        st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u handles of %llu bytes; the record says %llu", a->pid,
                     want, (unsigned long long)bytes, (unsigned long long)a->mapped_size);
    return st;
}

/* fetch_handles' take for an import: each fd becomes a handle of p (the driver keeps its own
 * reference, so the fd is closed either way). */
static vmm_status import_handles(void *ctx, const int *fds, const uint64_t *sizes, uint32_t n, uint32_t first)
{
    multi_parts *p = ctx;
    vmm_status st = VMM_OK;
    for (uint32_t i = 0; i < n; i++) {
        if (st == VMM_OK) {
            uint64_t t0 = vmm__now_ns();
            CUresult cr = vmm__import_cu.MemImportFromShareableHandle(&p->h[first + i], (void *)(uintptr_t)fds[i],
                                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            vmm__tm.import_ns += vmm__now_ns() - t0;
            if (cr != CUDA_SUCCESS) st = vmm__cu_fail("cuMemImportFromShareableHandle", cr);
            else p->size[p->n_imported++] = sizes[i];
        }
        close(fds[i]);
    }
    return st;
}

/* Every handle of a MULTI-HANDLE allocation, each imported. */
vmm_status vmm__multi_fetch(vmm_registry *reg, const vmm_alloc_info *a, multi_parts *p)
{
    memset(p, 0, sizeof *p);
    p->n = a->n_handles;
    p->h = calloc(p->n, sizeof *p->h);
    p->size = calloc(p->n, sizeof *p->size);
    if (!p->h || !p->size) {
        vmm__parts_release(p, 0);
        return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    }
    vmm__tm.route = VMM_KIND_BROKER;
    vmm_status st = fetch_handles(reg, a, p->n, import_handles, p);
    if (st != VMM_OK) vmm__parts_release(p, p->n_imported);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Routes                                                                                      */

static vmm_status pidfd_fetch(vmm_registry *reg, const vmm_alloc_info *a, int *fd_out)
{
    if (a->exported_fd < 0) return set_err(VMM_ERR_INVALID, "allocation has no exported fd for pidfd_getfd");
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)a->pid, 0);
    if (pidfd < 0) {
        int e = errno;
        if (e == ESRCH) return vmm__owner_dead(a);
        if (e == ENOSYS) return set_err(VMM_ERR_IO, "pidfd_open: not supported by this kernel (Linux >= 5.6 needed)");
        return set_err(VMM_ERR_IO, "pidfd_open(%u): %s", a->pid, strerror(e));
    }
    /* The pidfd pins the process: if it is the owner now, it is the owner for good. */
    int live = vmm__owner_liveness(a);
    if (live != VMM__ALIVE) {
        close(pidfd);
        if (live == VMM__DEAD) return vmm__owner_dead(a);
        return set_err(VMM_ERR_ACCESS, "owner pid %u is in another pid namespace; pidfd_getfd cannot reach it", a->pid);
    }
    int fd = (int)syscall(SYS_pidfd_getfd, pidfd, a->exported_fd, 0); /* the new fd is close-on-exec */
    int e = errno;
    close(pidfd);
    if (fd < 0) {
        if (e == EPERM || e == EACCES)
            return set_err(VMM_ERR_ACCESS, "pidfd_getfd(pid %u, fd %d) denied: needs ptrace permission over the owner "
                                           "(same uid and kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE)",
                           a->pid, a->exported_fd);
        if (e == ESRCH) return vmm__owner_dead(a);
        if (e == EBADF)
            return set_err(VMM_ERR_STALE, "allocation was freed (fd %d is closed in pid %u)", a->exported_fd, a->pid);
        if (e == ENOSYS) return set_err(VMM_ERR_IO, "pidfd_getfd: not supported by this kernel (Linux >= 5.6 needed)");
        return set_err(VMM_ERR_IO, "pidfd_getfd(pid %u, fd %d): %s", a->pid, a->exported_fd, strerror(e));
    }
    /* The number may have been reused after a free: the record must still be this allocation.
     * (The shim retracts the record before it closes the exported fd.) */
    vmm_alloc_info now;
    vmm_status st = vmm__find(reg, a->pid, a->address, &now);
    if (st == VMM_OK && (now.slot != a->slot || now.generation != a->generation ||
                         memcmp(now.alloc_id, a->alloc_id, sizeof now.alloc_id) != 0))
        st = VMM_ERR_STALE;
    if (st != VMM_OK) {
        close(fd);
        if (st == VMM_ERR_STALE || st == VMM_ERR_NOT_FOUND)
            return set_err(VMM_ERR_STALE, "allocation was freed (generation %llu is gone)",
                           (unsigned long long)a->generation);
        return st; /* vmm_find's reason stands */
    }
    *fd_out = fd;
    return VMM_OK;
}

vmm_status vmm__fetch_fd(vmm_registry *reg, const vmm_alloc_info *a, int *fd)
{
    *fd = -1;
    if (a->flags & VMM_ALLOC_MULTI_HANDLE)
        return set_err(VMM_ERR_INVALID, "the allocation spans %u handles (a multi-handle record); one fd cannot carry "
                                        "it: use vmm_import", a->n_handles);
    if (a->handle_kinds & VMM_KIND_BROKER) {
        vmm__tm.route = VMM_KIND_BROKER;
        vmm_status st = vmm__broker_fetch(reg, a, fd);
        /* a broker that has not started yet is no reason to give up when pidfd works too */
        if (st != VMM_ERR_NOT_FOUND || !(a->handle_kinds & VMM_KIND_PIDFD)) return st;
    }
    if (a->handle_kinds & VMM_KIND_PIDFD) {
        vmm__tm.route = VMM_KIND_PIDFD;
        uint64_t t0 = vmm__now_ns();
        vmm_status st = pidfd_fetch(reg, a, fd);
        vmm__tm.request_ns = vmm__now_ns() - t0;
        return st;
    }
    if (a->handle_kinds & VMM_KIND_FABRIC)
        return set_err(VMM_ERR_INVALID, "allocation offers only a FABRIC handle; this library imports fds");
    return set_err(VMM_ERR_INVALID, "allocation is not exportable (its owner passed it through)");
}

vmm_status vmm__import_fd(vmm_registry *reg, const vmm_alloc_info *alloc, int *fd)
{
    NEED(reg, "reg is NULL");
    NEED(alloc, "alloc is NULL");
    NEED(fd, "fd is NULL");
    *fd = -1;
    NEED(alloc->pid != 0, "alloc->pid is 0");
    return vmm__fetch_fd(reg, alloc, fd);
}

/* The allocation's chunk as a handle of this process: its fd from the owner, imported.  The
 * caller maps it or releases it (cuMemRelease). */
vmm_status vmm__fetch_handle(vmm_registry *reg, const vmm_alloc_info *a, CUmemGenericAllocationHandle *handle)
{
    int fd = -1;
    vmm_status st = vmm__fetch_fd(reg, a, &fd);
    if (st != VMM_OK) return st;
    uint64_t t0 = vmm__now_ns();
    CUresult r =
        vmm__import_cu.MemImportFromShareableHandle(handle, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    vmm__tm.import_ns = vmm__now_ns() - t0;
    close(fd); /* the driver keeps its own reference */
    return r == CUDA_SUCCESS ? VMM_OK : vmm__cu_fail("cuMemImportFromShareableHandle", r);
}

/* ------------------------------------------------------------------------------------------ */
/* Every handle's fd (vmm_import_fds)                                                           */

/* fetch_handles' take for vmm__import_fds: the fds are the caller's. */
typedef struct fds_out {
    int *fds;
    uint64_t *sizes;
    uint32_t n;
} fds_out;

static vmm_status keep_fds(void *ctx, const int *fds, const uint64_t *sizes, uint32_t n, uint32_t first)
{
    fds_out *out = ctx;
    (void)first;
    for (uint32_t i = 0; i < n; i++) {
        out->fds[out->n] = fds[i];
        out->sizes[out->n++] = sizes[i];
    }
    return VMM_OK;
}

/* A record's handles as fds, asked of its owner's broker as vmm__multi_fetch asks, not imported: for
 * a companion that keeps or maps them itself (vmmctl keep). */
vmm_status vmm__import_fds(vmm_registry *reg, const vmm_alloc_info *a, int *fds, uint64_t *sizes, uint32_t max,
                           uint32_t *n)
{
    NEED(n, "n is NULL");
    *n = 0;
    NEED(reg, "reg is NULL");
    NEED(a, "alloc is NULL");
    NEED(fds && sizes, "fds or sizes is NULL");
    NEED(a->pid != 0, "alloc->pid is 0");
    uint32_t want = (a->flags & VMM_ALLOC_MULTI_HANDLE) ? a->n_handles : 1;
    if (want > max)
        return set_err(VMM_ERR_INVALID, "the allocation spans %u handles; room for %u was given", want, max);
    if (!(a->flags & VMM_ALLOC_MULTI_HANDLE)) {
        vmm_status st = vmm__fetch_fd(reg, a, &fds[0]);
        if (st != VMM_OK) return st;
        sizes[0] = a->mapped_size;
        *n = 1;
        return VMM_OK;
    }
    if (want < 2 || !(a->handle_kinds & VMM_KIND_BROKER))
        return set_err(VMM_ERR_INVALID, "a multi-handle record with %u handles and no broker", want);
    fds_out out = {.fds = fds, .sizes = sizes};
    vmm_status st = fetch_handles(reg, a, want, keep_fds, &out);
    if (st != VMM_OK) {
        while (out.n) close(fds[--out.n]);
        return st;
    }
    *n = out.n;
    return VMM_OK;
}
