/* libvmmshim-client: importing a live allocation into the calling process.
 *
 * The fd comes from the owner's broker (VMM_KIND_BROKER: one SOCK_SEQPACKET request, the reply
 * carries the fd with SCM_RIGHTS; wire format in shim/broker/protocol.h) or straight out of the
 * owner's fd table (VMM_KIND_PIDFD: pidfd_getfd, which needs ptrace permission over the owner).
 * Either way the fd is the allocation's chunk: it is mapped whole, once per process, and shared
 * by every import of an allocation in it (see "Imported chunks").  A range import (vmm_import_range,
 * "Ranges across allocations") maps several records' whole chunks back to back, as in the owner, into
 * one reservation of its own instead, and shares nothing.  The CUDA driver is dlopen'ed
 * on first use; this library links none.  Rules as in client.c: never print, never exit, every
 * failure leaves a one-line reason in vmm_last_error(). */
#include "vmmshim.h"

#include "broker/protocol.h"
#include "registry/registry.h"

#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"

#define VMM_PUBLIC __attribute__((visibility("default")))
#define CONNECT_TIMEOUT_MS 2000
/* The broker serves connections one at a time and gives each at most 1 s. */
#define REPLY_TIMEOUT_MS 5000

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */

#define set_err vmm__client_error

#define NEED(cond, what)                                                                          \
    do {                                                                                          \
        if (!(cond)) return set_err(VMM_ERR_INVALID, "%s: %s", __func__, what);                   \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* The driver, found at run time                                                              */

typedef struct cuda_api {
    CUresult (*Init)(unsigned int);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    CUresult (*GetErrorName)(CUresult, const char **);
} cuda_api;

static cuda_api cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static char cu_error[200]; /* why the driver cannot be used; "" when it can */

/* The exported ABI names: none of these is renamed to a _v2 by cuda.h at CUDA 13 (the macros in
 * cuda.h only cover e.g. cuDevicePrimaryCtxRelease_v2 and cuMemcpyDtoH_v2, not used here). */
static void cuda_load(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(cu_error, sizeof cu_error, "libcuda.so.1 not found: %s", e ? e : "dlopen failed");
        return;
    }
    struct {
        const char *name;
        void **slot;
        bool optional;
    } syms[] = {
#define SYM(field, name, opt) {name, (void **)&cu.field, opt}
        SYM(Init, "cuInit", false),
        SYM(CtxGetCurrent, "cuCtxGetCurrent", false),
        SYM(CtxSetCurrent, "cuCtxSetCurrent", false),
        SYM(CtxGetDevice, "cuCtxGetDevice", false),
        SYM(DeviceGet, "cuDeviceGet", true),
        SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", false),
        SYM(MemImportFromShareableHandle, "cuMemImportFromShareableHandle", false),
        SYM(MemAddressReserve, "cuMemAddressReserve", false),
        SYM(MemAddressFree, "cuMemAddressFree", false),
        SYM(MemMap, "cuMemMap", false),
        SYM(MemUnmap, "cuMemUnmap", false),
        SYM(MemSetAccess, "cuMemSetAccess", false),
        SYM(MemRelease, "cuMemRelease", false),
        SYM(MemGetAllocationGranularity, "cuMemGetAllocationGranularity", false),
        SYM(GetErrorName, "cuGetErrorName", true),
#undef SYM
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *p = dlsym(h, syms[i].name);
        if (!p && !syms[i].optional) {
            snprintf(cu_error, sizeof cu_error, "libcuda.so.1 lacks %s (driver too old?)", syms[i].name);
            memset(&cu, 0, sizeof cu);
            return; /* the handle stays open: harmless, and dlclose of a driver is not */
        }
        memcpy(syms[i].slot, &p, sizeof p);
    }
}

static vmm_status cuda_ready(void)
{
    pthread_once(&cu_once, cuda_load);
    return cu_error[0] ? set_err(VMM_ERR_CUDA, "%s", cu_error) : VMM_OK;
}

static vmm_status cu_fail(const char *what, CUresult r)
{
    const char *name = NULL;
    if (!cu.GetErrorName || cu.GetErrorName(r, &name) != CUDA_SUCCESS || !name) name = "CUDA_ERROR_UNKNOWN";
    return set_err(VMM_ERR_CUDA, "%s failed: %s (%d)", what, name, (int)r);
}

/* ------------------------------------------------------------------------------------------ */
/* Owner identity                                                                              */

typedef struct {
    const vmm_alloc_info *alloc;
    vmm_proc_info *out;
    bool found;
} proc_match;

static int match_proc(void *ctx, const vmm_proc_info *p)
{
    proc_match *m = ctx;
    if (p->pid != m->alloc->pid || p->start_time != m->alloc->owner_start_time ||
        (m->alloc->owner_pidns && p->pidns && p->pidns != m->alloc->owner_pidns))
        return 0;
    *m->out = *p;
    m->found = true;
    return 1;
}

static int owner_liveness(const vmm_alloc_info *a)
{
    return vmm__reg_liveness(a->pid, a->owner_start_time, a->owner_pidns);
}

static vmm_status owner_dead(const vmm_alloc_info *a)
{
    return set_err(VMM_ERR_OWNER_DEAD, "owner pid %u has exited", a->pid);
}

/* ------------------------------------------------------------------------------------------ */
/* Broker                                                                                      */

static long ms_left(const struct timespec *deadline)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long ms = (long)(deadline->tv_sec - now.tv_sec) * 1000 + (deadline->tv_nsec - now.tv_nsec) / 1000000;
    return ms < 0 ? 0 : ms;
}

static void deadline_in(struct timespec *d, long ms)
{
    clock_gettime(CLOCK_MONOTONIC, d);
    d->tv_sec += ms / 1000;
    d->tv_nsec += (ms % 1000) * 1000000;
    if (d->tv_nsec >= 1000000000) {
        d->tv_sec++;
        d->tv_nsec -= 1000000000;
    }
}

/* Connect (non-blocking) within CONNECT_TIMEOUT_MS.  Returns the socket or -errno. */
static int broker_connect(const char *path)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t len = strlen(path);
    if (len >= sizeof sa.sun_path) return -ENAMETOOLONG;
    memcpy(sa.sun_path, path, len + 1);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) return -errno;
    struct timespec deadline;
    deadline_in(&deadline, CONNECT_TIMEOUT_MS);
    for (;;) {
        if (connect(s, (struct sockaddr *)&sa, sizeof sa) == 0) return s;
        int e = errno;
        if (e == EINTR) continue;
        if (e == EAGAIN) { /* the listener's backlog is full: it is busy, wait a little */
            long left = ms_left(&deadline);
            if (left == 0) break;
            (void)poll(NULL, 0, left < 10 ? (int)left : 10);
            continue;
        }
        if (e == EINPROGRESS) {
            struct pollfd p = {.fd = s, .events = POLLOUT};
            int pr;
            do pr = poll(&p, 1, (int)ms_left(&deadline));
            while (pr < 0 && errno == EINTR);
            if (pr <= 0) break;
            int soerr = 0;
            socklen_t sl = sizeof soerr;
            if (getsockopt(s, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0) soerr = errno;
            if (soerr == 0) return s;
            close(s);
            return -soerr;
        }
        close(s);
        return -e;
    }
    close(s);
    return -ETIMEDOUT;
}

/* Receive the reply and at most one fd (any extra fds are closed).  Returns 0 or -errno. */
static int broker_recv(int s, vmm_broker_reply *rep, int *fd)
{
    *fd = -1;
    struct pollfd p = {.fd = s, .events = POLLIN};
    int pr;
    do pr = poll(&p, 1, REPLY_TIMEOUT_MS);
    while (pr < 0 && errno == EINTR);
    if (pr < 0) return -errno;
    if (pr == 0) return -ETIMEDOUT;
    union {
        vmm_broker_reply rep;
        uint8_t raw[sizeof(vmm_broker_reply) + 32];
    } in;
    memset(&in, 0, sizeof in);
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(4 * sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = in.raw, .iov_len = sizeof in.raw};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof ctl.buf;
    ssize_t n;
    do n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0) return -errno;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int f;
            memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
            if (*fd < 0)
                *fd = f;
            else
                close(f);
        }
    }
    if (n == 0) {
        if (*fd >= 0) close(*fd);
        *fd = -1;
        return -ECONNRESET; /* closed without a word */
    }
    if ((size_t)n != sizeof(vmm_broker_reply) || in.rep.magic != VMM_BROKER_MAGIC) {
        if (*fd >= 0) close(*fd);
        *fd = -1;
        return -EPROTO;
    }
    *rep = in.rep;
    if (rep->status != 0 && *fd >= 0) {
        close(*fd);
        *fd = -1;
    }
    return 0;
}

static vmm_status broker_fetch(vmm_registry *reg, const vmm_alloc_info *a, int *fd_out)
{
    vmm_proc_info proc;
    proc_match m = {.alloc = a, .out = &proc};
    vmm_status st = vmm_foreach_proc(reg, match_proc, &m);
    if (st != VMM_OK) return st;
    if (!m.found) {
        if (owner_liveness(a) == VMM__DEAD) return owner_dead(a);
        return set_err(VMM_ERR_NOT_FOUND, "no process record for owner pid %u in the registry", a->pid);
    }
    if (!proc.broker_path[0]) {
        if (owner_liveness(a) == VMM__DEAD) return owner_dead(a);
        return set_err(VMM_ERR_NOT_FOUND, "owner pid %u has no broker (not started yet)", a->pid);
    }
    int s = broker_connect(proc.broker_path);
    if (s < 0) {
        int e = -s;
        if (e == ECONNREFUSED || e == ENOENT || e == ENOTDIR) {
            if (owner_liveness(a) == VMM__DEAD) return owner_dead(a);
            return set_err(VMM_ERR_IO, "owner pid %u's broker %s is not listening: %s", a->pid, proc.broker_path,
                           strerror(e));
        }
        if (e == EACCES || e == EPERM)
            return set_err(VMM_ERR_ACCESS, "cannot reach owner pid %u's broker %s: %s (is this user in the "
                                           "owner's VMMSHIM_BROKER_GROUP?)",
                           a->pid, proc.broker_path, strerror(e));
        if (e == ETIMEDOUT)
            return set_err(VMM_ERR_IO, "owner pid %u's broker %s: connect timed out", a->pid, proc.broker_path);
        return set_err(VMM_ERR_IO, "owner pid %u's broker %s: connect: %s", a->pid, proc.broker_path, strerror(e));
    }
    vmm_broker_request req;
    memset(&req, 0, sizeof req);
    req.magic = VMM_BROKER_MAGIC;
    req.version = VMM_BROKER_VERSION;
    req.slot = a->slot;
    req.generation = a->generation;
    memcpy(req.alloc_id, a->alloc_id, sizeof req.alloc_id);
    ssize_t n;
    do n = send(s, &req, sizeof req, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof req) {
        int e = n < 0 ? errno : EIO;
        close(s);
        if ((e == EPIPE || e == ECONNRESET) && owner_liveness(a) == VMM__DEAD) return owner_dead(a);
        return set_err(VMM_ERR_IO, "owner pid %u's broker: send: %s", a->pid, strerror(e));
    }
    vmm_broker_reply rep;
    memset(&rep, 0, sizeof rep);
    int fd = -1;
    int rc = broker_recv(s, &rep, &fd);
    close(s);
    if (rc) {
        if ((rc == -ECONNRESET || rc == -EPIPE) && owner_liveness(a) == VMM__DEAD) return owner_dead(a);
        if (rc == -ETIMEDOUT)
            return set_err(VMM_ERR_IO, "owner pid %u's broker did not reply within %d s", a->pid,
                           REPLY_TIMEOUT_MS / 1000);
        if (rc == -EPROTO) return set_err(VMM_ERR_IO, "owner pid %u's broker sent a malformed reply", a->pid);
        if (rc == -ECONNRESET)
            return set_err(VMM_ERR_IO, "owner pid %u's broker closed the connection without replying", a->pid);
        return set_err(VMM_ERR_IO, "owner pid %u's broker: recv: %s", a->pid, strerror(-rc));
    }
    switch (rep.status) {
    case 0: break;
    case -ESTALE:
        return set_err(VMM_ERR_STALE, "allocation was freed (generation %llu is gone)",
                       (unsigned long long)a->generation);
    case -ENOENT:
        return set_err(VMM_ERR_STALE, "allocation was freed (slot %llu is no longer live in pid %u)",
                       (unsigned long long)a->slot, a->pid);
    case -EACCES:
        return set_err(VMM_ERR_ACCESS, "owner's broker refused this uid (%u); the owner's VMMSHIM_BROKER_GROUP "
                                       "decides who else may import",
                       (unsigned)geteuid());
    case -EPROTO: return set_err(VMM_ERR_IO, "owner pid %u's broker rejected the request (protocol mismatch)", a->pid);
    default:
        return set_err(VMM_ERR_IO, "owner pid %u's broker could not export the allocation: %s", a->pid,
                       rep.status < 0 && rep.status > -4096 ? strerror(-rep.status) : "unknown status");
    }
    if (fd < 0) return set_err(VMM_ERR_IO, "owner pid %u's broker replied without an fd", a->pid);
    /* The fd is the allocation's chunk; an importer maps the size the record gives.  (0: an owner
     * that does not say.) */
    if (rep.mapped_size && rep.mapped_size != a->mapped_size) {
        close(fd);
        return set_err(VMM_ERR_IO, "owner pid %u's broker sent a chunk of %llu bytes; the record says %llu", a->pid,
                       (unsigned long long)rep.mapped_size, (unsigned long long)a->mapped_size);
    }
    *fd_out = fd;
    return VMM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* pidfd                                                                                       */

static vmm_status pidfd_fetch(vmm_registry *reg, const vmm_alloc_info *a, int *fd_out)
{
    if (a->exported_fd < 0) return set_err(VMM_ERR_INVALID, "allocation has no exported fd for pidfd_getfd");
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)a->pid, 0);
    if (pidfd < 0) {
        int e = errno;
        if (e == ESRCH) return owner_dead(a);
        if (e == ENOSYS) return set_err(VMM_ERR_IO, "pidfd_open: not supported by this kernel (Linux >= 5.6 needed)");
        return set_err(VMM_ERR_IO, "pidfd_open(%u): %s", a->pid, strerror(e));
    }
    /* The pidfd pins the process: if it is the owner now, it is the owner for good. */
    int live = owner_liveness(a);
    if (live != VMM__ALIVE) {
        close(pidfd);
        if (live == VMM__DEAD) return owner_dead(a);
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
        if (e == ESRCH) return owner_dead(a);
        if (e == EBADF)
            return set_err(VMM_ERR_STALE, "allocation was freed (fd %d is closed in pid %u)", a->exported_fd, a->pid);
        if (e == ENOSYS) return set_err(VMM_ERR_IO, "pidfd_getfd: not supported by this kernel (Linux >= 5.6 needed)");
        return set_err(VMM_ERR_IO, "pidfd_getfd(pid %u, fd %d): %s", a->pid, a->exported_fd, strerror(e));
    }
    /* The number may have been reused after a free: the record must still be this allocation.
     * (The shim retracts the record before it closes the exported fd.) */
    vmm_alloc_info now;
    vmm_status st = vmm_find(reg, a->pid, a->address, &now);
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

/* ------------------------------------------------------------------------------------------ */
/* Imported chunks                                                                             */

/* Every import maps its allocation's whole chunk; allocations of one chunk share one mapping.
 * A pooled chunk is named by its owner and chunk_id (never reused by that owner), with its
 * mapped size as a second guard; a record without a chunk id (its own chunk, older writers) by
 * its owner, slot and generation, which change whenever the slot is published again.  Never by
 * fd number or address: both are reused. */
typedef struct chunk_key {
    uint32_t pid;
    uint32_t by_slot; /* 1: id is the record's slot and generation its generation (chunk_id 0) */
    uint64_t start_time, pidns;
    uint64_t id, generation, mapped_size;
} chunk_key;

/* An owner this process holds chunks of.  A pidfd tells in one poll() whether it has exited,
 * where reading /proc/<pid>/stat costs more than the rest of a cached import together. */
typedef struct owner_ref {
    uint32_t pid;
    uint64_t start_time, pidns;
    int pidfd;              /* -1: judged through /proc each time (another pid namespace, no pidfd_open) */
    unsigned long chunks;   /* chunks of it mapped here; the entry (and the pidfd) goes with the last */
    struct owner_ref *next;
} owner_ref;

typedef struct chunk {
    chunk_key key;
    owner_ref *owner;
    CUdeviceptr base;
    size_t size;
    CUmemGenericAllocationHandle handle;
    CUcontext ctx;     /* current when it was mapped: released from it */
    uint64_t devices;  /* bit d: device d was granted access (devices 0..63) */
    unsigned long refs; /* vmm_imported handles on it; the mapping goes with the last */
    struct chunk *next;
} chunk;

/* A fixed table of chains: no growth path, so no allocation that could fail besides the entry's
 * own (a table library would exit on out-of-memory, and this library never exits).  Lookups and
 * the reference counts are under chunks_lock; driver and broker calls never are, so a slow
 * owner stalls only the imports that wait for it. */
#define CHUNK_BUCKETS 1024u
static chunk *chunk_table[CHUNK_BUCKETS];
static owner_ref *owners; /* a short list: the owners this process imports from */
static pthread_mutex_t chunks_lock = PTHREAD_MUTEX_INITIALIZER;

static chunk_key key_of(const vmm_alloc_info *a)
{
    chunk_key k;
    memset(&k, 0, sizeof k);
    k.pid = a->pid;
    k.start_time = a->owner_start_time;
    k.pidns = a->owner_pidns;
    k.mapped_size = a->mapped_size;
    if (a->chunk_id) {
        k.id = a->chunk_id;
    } else {
        k.by_slot = 1;
        k.id = a->slot;
        k.generation = a->generation;
    }
    return k;
}

static bool same_key(const chunk_key *x, const chunk_key *y)
{
    return x->pid == y->pid && x->by_slot == y->by_slot && x->start_time == y->start_time && x->pidns == y->pidns &&
           x->id == y->id && x->generation == y->generation && x->mapped_size == y->mapped_size;
}

static chunk **bucket_of(const chunk_key *k)
{
    uint64_t h = vmm_reg_hash(k->pid, k->id ^ (k->generation * 0x9e3779b97f4a7c15ull) ^ k->start_time ^ k->pidns ^
                                          (k->mapped_size << 1) ^ k->by_slot);
    return &chunk_table[h % CHUNK_BUCKETS];
}

/* Lock held.  The entry for k with one more reference, or NULL. */
static chunk *chunk_ref_locked(const chunk_key *k)
{
    for (chunk *c = *bucket_of(k); c; c = c->next)
        if (same_key(&c->key, k)) {
            c->refs++;
            return c;
        }
    return NULL;
}

/* Memory is unmapped from the context it was mapped in, whichever is current on the releasing
 * thread.  True when ctx was made current here; *prev is what to restore then.  (cuda_ready()
 * succeeded when the memory was mapped; the table never changes after.) */
static bool ctx_enter(CUcontext ctx, CUcontext *prev)
{
    *prev = NULL;
    return cu.CtxGetCurrent(prev) == CUDA_SUCCESS && *prev != ctx && cu.CtxSetCurrent(ctx) == CUDA_SUCCESS;
}

/* Unmap, release and free the address range of a mapping no reference points to any more. */
static vmm_status unmap_chunk(CUdeviceptr base, size_t size, CUmemGenericAllocationHandle handle, CUcontext ctx)
{
    CUcontext cur;
    bool switched = ctx_enter(ctx, &cur);
    vmm_status st = VMM_OK;
    CUresult r;
    if ((r = cu.MemUnmap(base, size)) != CUDA_SUCCESS) st = cu_fail("cuMemUnmap", r);
    if ((r = cu.MemRelease(handle)) != CUDA_SUCCESS && st == VMM_OK) st = cu_fail("cuMemRelease", r);
    if ((r = cu.MemAddressFree(base, size)) != CUDA_SUCCESS && st == VMM_OK) st = cu_fail("cuMemAddressFree", r);
    if (switched) (void)cu.CtxSetCurrent(cur);
    return st;
}

/* A pidfd of the allocation's owner, or -1.  Opened first and judged after: if the process
 * behind the pid is the owner now, the pidfd is the owner's for good (it never follows a reused
 * pid). */
static int owner_pidfd(const vmm_alloc_info *a)
{
    int fd = (int)syscall(SYS_pidfd_open, (pid_t)a->pid, 0); /* close-on-exec */
    if (fd >= 0 && owner_liveness(a) != VMM__ALIVE) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* Lock held. */
static bool owner_known_locked(const vmm_alloc_info *a)
{
    for (owner_ref *o = owners; o; o = o->next)
        if (o->pid == a->pid && o->start_time == a->owner_start_time && o->pidns == a->owner_pidns) return true;
    return false;
}

/* Lock held.  The owner entry of a, taking *pidfd when a new entry needs it. */
static owner_ref *owner_ref_locked(const vmm_alloc_info *a, owner_ref *spare, int *pidfd)
{
    for (owner_ref *o = owners; o; o = o->next)
        if (o->pid == a->pid && o->start_time == a->owner_start_time && o->pidns == a->owner_pidns) {
            o->chunks++;
            return o;
        }
    /* (a pidfd -1 here, when the entry went away meanwhile, only makes its checks slower) */
    spare->pid = a->pid;
    spare->start_time = a->owner_start_time;
    spare->pidns = a->owner_pidns;
    spare->pidfd = *pidfd;
    *pidfd = -1;
    spare->chunks = 1;
    spare->next = owners;
    owners = spare;
    return spare;
}

static bool owner_exited(const owner_ref *o)
{
    if (o->pidfd < 0) return vmm__reg_liveness(o->pid, o->start_time, o->pidns) == VMM__DEAD;
    struct pollfd p = {.fd = o->pidfd, .events = POLLIN};
    int n;
    do n = poll(&p, 1, 0);
    while (n < 0 && errno == EINTR);
    return n > 0; /* a pidfd turns readable when its process exits */
}

/* Drop one reference; the last one unmaps the chunk (outside the lock).  Unreferenced mappings
 * are not kept: an importer that releases everything gets its address space and the owner's
 * memory back at once, and a later import asks the broker again. */
static vmm_status chunk_unref(chunk *c)
{
    owner_ref *gone = NULL;
    pthread_mutex_lock(&chunks_lock);
    bool last = --c->refs == 0;
    if (last) {
        for (chunk **pp = bucket_of(&c->key); *pp; pp = &(*pp)->next)
            if (*pp == c) {
                *pp = c->next;
                break;
            }
        if (--c->owner->chunks == 0) {
            gone = c->owner;
            for (owner_ref **pp = &owners; *pp; pp = &(*pp)->next)
                if (*pp == gone) {
                    *pp = gone->next;
                    break;
                }
        }
    }
    pthread_mutex_unlock(&chunks_lock);
    if (!last) return VMM_OK;
    vmm_status st = unmap_chunk(c->base, c->size, c->handle, c->ctx);
    free(c);
    if (gone) {
        if (gone->pidfd >= 0) close(gone->pidfd);
        free(gone);
    }
    return st;
}

static void access_for(CUmemAccessDesc *acc, CUdevice dev)
{
    memset(acc, 0, sizeof *acc);
    acc->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc->location.id = (int)dev;
    acc->flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

/* A chunk mapped for one device, imported by a thread of another: that device needs access too
 * (one address range serves every device of the process). */
static vmm_status grant_device(chunk *c, CUdevice dev)
{
    uint64_t bit = dev >= 0 && dev < 64 ? 1ull << dev : 0;
    pthread_mutex_lock(&chunks_lock);
    bool has = bit && (c->devices & bit);
    pthread_mutex_unlock(&chunks_lock);
    if (has) return VMM_OK;
    CUmemAccessDesc acc;
    access_for(&acc, dev);
    CUresult r = cu.MemSetAccess(c->base, c->size, &acc, 1);
    if (r != CUDA_SUCCESS) return cu_fail("cuMemSetAccess", r);
    pthread_mutex_lock(&chunks_lock);
    c->devices |= bit;
    pthread_mutex_unlock(&chunks_lock);
    return VMM_OK;
}

/* The registry still shows this very allocation, live, at its place in its chunk. */
static vmm_status record_unchanged(vmm_registry *reg, const vmm_alloc_info *a)
{
    vmm_alloc_info now;
    vmm_status st = vmm__client_read_slot(reg, a->slot, &now);
    bool same = st == VMM_OK && now.generation == a->generation &&
                memcmp(now.alloc_id, a->alloc_id, sizeof now.alloc_id) == 0 && now.pid == a->pid &&
                now.owner_start_time == a->owner_start_time;
    if (st == VMM_ERR_STALE || (st == VMM_OK && !same))
        return set_err(VMM_ERR_STALE, "allocation was freed (generation %llu is gone)",
                       (unsigned long long)a->generation);
    if (st != VMM_OK) return st;
    if (now.chunk_id != a->chunk_id || now.chunk_offset != a->chunk_offset || now.mapped_size != a->mapped_size)
        return set_err(VMM_ERR_STALE, "the registry places this allocation at offset %llu of chunk %llu (%llu bytes), "
                                      "not as described",
                       (unsigned long long)now.chunk_offset, (unsigned long long)now.chunk_id,
                       (unsigned long long)now.mapped_size);
    return VMM_OK;
}

/* The chunk is mapped here already, so the owner's broker is not asked: the registry must still
 * show this very allocation, live, in that chunk, and its owner alive (what the broker would
 * have checked). */
static vmm_status still_live(vmm_registry *reg, const vmm_alloc_info *a, const owner_ref *owner)
{
    vmm_status st = record_unchanged(reg, a);
    if (st != VMM_OK) return st;
    if (owner_exited(owner)) return owner_dead(a);
    return VMM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Public                                                                                      */

typedef struct range_map range_map;

struct vmm_imported {
    chunk *c;                /* a vmm_import: its chunk's reference; NULL for a range */
    range_map *range;        /* a vmm_import_range: its own mappings; NULL for an allocation */
    uint64_t ptr;            /* c->base + the allocation's chunk_offset, or the range's first byte */
    uint64_t requested_size; /* a range's length */
    int device;              /* the device it is mapped read-write for here */
};

static vmm_status fetch_fd(vmm_registry *reg, const vmm_alloc_info *a, int *fd)
{
    *fd = -1;
    if (a->handle_kinds & VMM_KIND_BROKER) {
        vmm_status st = broker_fetch(reg, a, fd);
        /* a broker that has not started yet is no reason to give up when pidfd works too */
        if (st == VMM_ERR_NOT_FOUND && (a->handle_kinds & VMM_KIND_PIDFD)) return pidfd_fetch(reg, a, fd);
        return st;
    }
    if (a->handle_kinds & VMM_KIND_PIDFD) return pidfd_fetch(reg, a, fd);
    if (a->handle_kinds & VMM_KIND_FABRIC)
        return set_err(VMM_ERR_INVALID, "allocation offers only a FABRIC handle; this library imports fds");
    return set_err(VMM_ERR_INVALID, "allocation is not exportable (its owner passed it through)");
}

VMM_PUBLIC vmm_status vmm_import_fd(vmm_registry *reg, const vmm_alloc_info *alloc, int *fd)
{
    NEED(reg, "reg is NULL");
    NEED(alloc, "alloc is NULL");
    NEED(fd, "fd is NULL");
    *fd = -1;
    NEED(alloc->pid != 0, "alloc->pid is 0");
    return fetch_fd(reg, alloc, fd);
}

/* The calling thread's context, or device 0's primary context made current; and its device. */
static vmm_status current_context(CUcontext *ctx, CUdevice *dev)
{
    CUresult r;
    *ctx = NULL;
    if ((r = cu.Init(0)) != CUDA_SUCCESS) return cu_fail("cuInit", r);
    if ((r = cu.CtxGetCurrent(ctx)) != CUDA_SUCCESS) return cu_fail("cuCtxGetCurrent", r);
    if (!*ctx) {
        /* no context on this thread: device 0's primary one (retained for the process's life) */
        CUdevice d0 = 0;
        if (cu.DeviceGet && (r = cu.DeviceGet(&d0, 0)) != CUDA_SUCCESS) return cu_fail("cuDeviceGet", r);
        if ((r = cu.DevicePrimaryCtxRetain(ctx, d0)) != CUDA_SUCCESS) return cu_fail("cuDevicePrimaryCtxRetain", r);
        if ((r = cu.CtxSetCurrent(*ctx)) != CUDA_SUCCESS) return cu_fail("cuCtxSetCurrent", r);
    }
    if ((r = cu.CtxGetDevice(dev)) != CUDA_SUCCESS) return cu_fail("cuCtxGetDevice", r);
    return VMM_OK;
}

/* The allocation's chunk as a handle of this process: its fd from the owner, imported.  The
 * caller maps it or releases it (cuMemRelease). */
static vmm_status fetch_handle(vmm_registry *reg, const vmm_alloc_info *a, CUmemGenericAllocationHandle *handle)
{
    int fd = -1;
    vmm_status st = fetch_fd(reg, a, &fd);
    if (st != VMM_OK) return st;
    CUresult r = cu.MemImportFromShareableHandle(handle, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd); /* the driver keeps its own reference */
    return r == CUDA_SUCCESS ? VMM_OK : cu_fail("cuMemImportFromShareableHandle", r);
}

/* Map all of the chunk behind handle (consumed: released on failure) read-write for dev. */
static vmm_status map_chunk(CUmemGenericAllocationHandle handle, size_t size, CUdevice dev, chunk *c)
{
    c->handle = handle;
    CUresult r;
    const char *what;
    if ((r = cu.MemAddressReserve(&c->base, size, 0, 0, 0)) != CUDA_SUCCESS) {
        what = "cuMemAddressReserve";
        goto release;
    }
    if ((r = cu.MemMap(c->base, size, 0, c->handle, 0)) != CUDA_SUCCESS) {
        what = "cuMemMap";
        goto free_range;
    }
    CUmemAccessDesc acc;
    access_for(&acc, dev);
    if ((r = cu.MemSetAccess(c->base, size, &acc, 1)) != CUDA_SUCCESS) {
        what = "cuMemSetAccess";
        (void)cu.MemUnmap(c->base, size);
        goto free_range;
    }
    c->size = size;
    c->devices = dev >= 0 && dev < 64 ? 1ull << dev : 0;
    return VMM_OK;
free_range:
    (void)cu.MemAddressFree(c->base, size);
release:
    (void)cu.MemRelease(c->handle);
    return cu_fail(what, r);
}

VMM_PUBLIC vmm_status vmm_import(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported **out)
{
    NEED(out, "out is NULL");
    *out = NULL;
    NEED(reg, "reg is NULL");
    NEED(alloc, "alloc is NULL");
    NEED(alloc->pid != 0, "alloc->pid is 0");
    NEED(alloc->mapped_size != 0, "alloc->mapped_size is 0");
    uint64_t span = alloc->extent > alloc->requested_size ? alloc->extent : alloc->requested_size;
    NEED(alloc->chunk_offset < alloc->mapped_size && span <= alloc->mapped_size - alloc->chunk_offset,
         "the allocation does not lie inside its chunk (chunk_offset, extent, mapped_size)");
    if (!(alloc->handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD))) {
        int unused;
        return fetch_fd(reg, alloc, &unused); /* its reason */
    }
    vmm_status st = cuda_ready();
    if (st != VMM_OK) return st;
    vmm_imported *imp = calloc(1, sizeof *imp);
    if (!imp) return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    CUcontext ctx;
    CUdevice dev = 0;
    if ((st = current_context(&ctx, &dev)) != VMM_OK) {
        free(imp);
        return st;
    }

    chunk_key k = key_of(alloc);
    pthread_mutex_lock(&chunks_lock);
    chunk *c = chunk_ref_locked(&k);
    pthread_mutex_unlock(&chunks_lock);
    if (c) { /* mapped already: no broker, no import, no mapping */
        if ((st = still_live(reg, alloc, c->owner)) != VMM_OK || (st = grant_device(c, dev)) != VMM_OK) {
            (void)chunk_unref(c);
            free(imp);
            return st;
        }
    } else {
        CUmemGenericAllocationHandle handle = 0;
        chunk *fresh = calloc(1, sizeof *fresh);
        owner_ref *spare = calloc(1, sizeof *spare);
        if (!fresh || !spare) st = set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
        if (st == VMM_OK) st = fetch_handle(reg, alloc, &handle);
        if (st == VMM_OK) st = map_chunk(handle, (size_t)alloc->mapped_size, dev, fresh);
        if (st != VMM_OK) {
            free(fresh);
            free(spare);
            free(imp);
            return st;
        }
        fresh->key = k;
        fresh->ctx = ctx;
        fresh->refs = 1;
        pthread_mutex_lock(&chunks_lock);
        bool known = owner_known_locked(alloc);
        pthread_mutex_unlock(&chunks_lock);
        int pidfd = known ? -1 : owner_pidfd(alloc);
        pthread_mutex_lock(&chunks_lock);
        c = chunk_ref_locked(&k);
        if (!c) {
            chunk **b = bucket_of(&k);
            fresh->next = *b;
            *b = fresh;
            fresh->owner = owner_ref_locked(alloc, spare, &pidfd);
            if (fresh->owner == spare) spare = NULL;
            c = fresh;
        }
        pthread_mutex_unlock(&chunks_lock);
        if (pidfd >= 0) close(pidfd);
        free(spare);
        if (c != fresh) { /* another thread mapped it meanwhile: use that mapping, drop ours */
            (void)unmap_chunk(fresh->base, fresh->size, fresh->handle, fresh->ctx);
            free(fresh);
            if ((st = grant_device(c, dev)) != VMM_OK) {
                (void)chunk_unref(c);
                free(imp);
                return st;
            }
        }
    }
    imp->c = c;
    imp->ptr = (uint64_t)c->base + alloc->chunk_offset;
    imp->requested_size = alloc->requested_size ? alloc->requested_size : span;
    imp->device = (int)dev;
    *out = imp;
    return VMM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Ranges across allocations                                                                   */

/* A range import owns its reservation and mappings outright: nothing of it is in the chunk table
 * or shared with another import, so it needs no lock and no owner bookkeeping. */
struct range_map {
    CUdeviceptr base;
    size_t size;  /* the reservation; 0 until it is made */
    CUcontext ctx; /* current when it was mapped: unmapped from it */
    size_t n;      /* mappings made so far, each [base + at, + len) */
    struct {
        size_t at, len;
    } map[];
};

/* One mapping of a range: bytes [from, to) of one chunk are needed, and the whole chunk is mapped
 * (the driver maps a handle only from offset 0).  Consecutive records of one chunk (allocations
 * the shim's pool placed side by side) make one piece. */
typedef struct piece {
    size_t first, last;  /* its records, in range order */
    uint64_t owner_at;   /* the owner's address of byte `from` */
    uint64_t from, to, size;
    size_t handle_of;    /* the piece whose fetched handle it maps: itself, or an earlier one */
    CUmemGenericAllocationHandle handle;
} piece;

typedef struct range_plan {
    uint32_t pid;
    uint64_t address, end;
    vmm_alloc_info *rec; /* the records covering [address, end), in order */
    size_t n_rec, cap_rec;
    piece *pc;
    size_t n_pc, cap_pc;
} range_plan;

/* arr with room for element n (moved, perhaps), or NULL with arr untouched. */
static void *grow(void *arr, size_t *cap, size_t n, size_t elem)
{
    if (n < *cap) return arr;
    size_t c = *cap ? 2 * *cap : 16;
    void *p = c < SIZE_MAX / elem ? realloc(arr, c * elem) : NULL;
    if (p) *cap = c;
    return p;
}

/* Pooled records name their chunk; a record without a chunk id is a chunk of its own. */
static bool same_chunk(const vmm_alloc_info *x, const vmm_alloc_info *y)
{
    return x->chunk_id && x->chunk_id == y->chunk_id && x->mapped_size == y->mapped_size;
}

/* The live records covering the range, each starting where the one before ends.  Registry reads
 * only: a gap or a record that cannot be imported fails here, before any owner is asked. */
static vmm_status range_walk(vmm_registry *reg, range_plan *p)
{
    for (uint64_t at = p->address; at < p->end;) {
        vmm_alloc_info a;
        vmm_status st = vmm_find(reg, p->pid, at, &a);
        if (st == VMM_ERR_NOT_FOUND) {
            if (at == p->address)
                return set_err(VMM_ERR_NOT_FOUND, "pid %u has no live allocation at 0x%llx, where the range starts",
                               p->pid, (unsigned long long)at);
            return set_err(VMM_ERR_NOT_FOUND,
                           "pid %u has no live allocation at 0x%llx: its allocations cover the range 0x%llx..0x%llx "
                           "only up to there (a gap, or freed)",
                           p->pid, (unsigned long long)at, (unsigned long long)p->address,
                           (unsigned long long)p->end);
        }
        if (st != VMM_OK) return st; /* vmm_find's reason */
        if (p->n_rec && (a.owner_start_time != p->rec[0].owner_start_time || a.owner_pidns != p->rec[0].owner_pidns))
            return set_err(VMM_ERR_NOT_FOUND,
                           "the allocation at 0x%llx belongs to another process with pid %u than the range's start "
                           "(an exited one's records stay until vmmctl gc)",
                           (unsigned long long)at, p->pid);
        if (a.owner_alive == VMM_OWNER_DEAD) return owner_dead(&a);
        if (!(a.handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD)))
            return set_err(VMM_ERR_ACCESS, "the range reaches pid %u's allocation at 0x%llx, which %s", p->pid,
                           (unsigned long long)a.address,
                           a.handle_kinds & VMM_KIND_FABRIC ? "offers only a FABRIC handle; this library imports fds"
                                                            : "is not exportable (its owner passed it through)");
        /* vmm_find returned the record holding `at`, so it ends past it: the walk moves on. */
        if (!a.mapped_size || a.chunk_offset >= a.mapped_size || a.extent > a.mapped_size - a.chunk_offset ||
            a.address > at || a.extent <= at - a.address || a.extent > UINT64_MAX - a.address)
            return set_err(VMM_ERR_INVALID,
                           "pid %u's allocation at 0x%llx does not lie inside its chunk (chunk_offset %llu, extent "
                           "%llu, mapped_size %llu)",
                           p->pid, (unsigned long long)a.address, (unsigned long long)a.chunk_offset,
                           (unsigned long long)a.extent, (unsigned long long)a.mapped_size);
        vmm_alloc_info *more = grow(p->rec, &p->cap_rec, p->n_rec, sizeof *p->rec);
        if (!more) return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
        p->rec = more;
        p->rec[p->n_rec++] = a;
        at = a.address + a.extent;
    }
    return VMM_OK;
}

/* Which chunk goes where.  Every chunk is mapped whole, at the place its bytes have in the owner,
 * so the chunks must lie back to back there (a PyTorch expandable segment's pages do); otherwise
 * the range cannot be one contiguous mapping here. */
static vmm_status range_layout(range_plan *p)
{
    for (size_t i = 0; i < p->n_rec; i++) {
        const vmm_alloc_info *a = &p->rec[i];
        uint64_t lo = a->address > p->address ? a->address : p->address;
        uint64_t hi = a->address + a->extent < p->end ? a->address + a->extent : p->end;
        uint64_t from = a->chunk_offset + (lo - a->address), to = from + (hi - lo);
        piece *last = p->n_pc ? &p->pc[p->n_pc - 1] : NULL;
        if (last && same_chunk(&p->rec[last->last], a) && last->to == from) {
            last->to = to;
            last->last = i;
            continue;
        }
        if (last && (last->to != last->size || from != 0)) {
            const vmm_alloc_info *b = &p->rec[last->last];
            return set_err(VMM_ERR_INVALID,
                           "at 0x%llx pid %u's bytes pass from offset %llu of chunk %llu (%llu bytes) to offset %llu "
                           "of chunk %llu: the chunks do not lie back to back, so the range cannot be mapped as one",
                           (unsigned long long)lo, p->pid, (unsigned long long)last->to, (unsigned long long)b->chunk_id,
                           (unsigned long long)last->size, (unsigned long long)from, (unsigned long long)a->chunk_id);
        }
        piece *more = grow(p->pc, &p->cap_pc, p->n_pc, sizeof *p->pc);
        if (!more) return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
        p->pc = more;
        piece *k = &p->pc[p->n_pc++];
        memset(k, 0, sizeof *k);
        k->first = k->last = i;
        k->owner_at = lo;
        k->from = from;
        k->to = to;
        k->size = a->mapped_size;
    }
    return VMM_OK;
}

/* One handle per chunk, from its owner as vmm_import gets it.  A record whose chunk came with
 * another record's handle was not checked by the owner: it must still be the live allocation
 * the walk found (as a cached chunk's must, in vmm_import). */
static vmm_status range_fetch(vmm_registry *reg, range_plan *p)
{
    for (size_t k = 0; k < p->n_pc; k++) {
        piece *c = &p->pc[k];
        c->handle_of = k;
        for (size_t j = 0; j < k; j++)
            if (same_chunk(&p->rec[p->pc[j].first], &p->rec[c->first])) {
                c->handle_of = p->pc[j].handle_of;
                break;
            }
        if (c->handle_of != k) {
            c->handle = p->pc[c->handle_of].handle;
            continue;
        }
        const vmm_alloc_info *a = &p->rec[c->first];
        vmm_status st = fetch_handle(reg, a, &c->handle);
        if (st != VMM_OK) {
            c->handle_of = SIZE_MAX; /* nothing to release */
            p->n_pc = k + 1;         /* the pieces after it have no handle either */
            return set_err(st, "importing pid %u's allocation at 0x%llx: %s", p->pid, (unsigned long long)a->address,
                           vmm_last_error());
        }
    }
    for (size_t k = 0; k < p->n_pc; k++)
        for (size_t i = p->pc[k].first; i <= p->pc[k].last; i++) {
            if (p->pc[k].handle_of == k && i == p->pc[k].first) continue; /* its owner checked it */
            vmm_status st = record_unchanged(reg, &p->rec[i]);
            if (st != VMM_OK)
                return set_err(st, "pid %u's allocation at 0x%llx: %s", p->pid,
                               (unsigned long long)p->rec[i].address, vmm_last_error());
        }
    return VMM_OK;
}

/* Drop the handles fetched: a mapping keeps its memory alive without them. */
static void range_release_handles(range_plan *p)
{
    for (size_t k = 0; k < p->n_pc; k++)
        if (p->pc[k].handle_of == k) (void)cu.MemRelease(p->pc[k].handle);
}

/* Unmap what was mapped (all of it, or what a failed import got to), free the reservation. */
static vmm_status range_unmap(range_map *m)
{
    CUcontext cur;
    bool switched = ctx_enter(m->ctx, &cur);
    vmm_status st = VMM_OK;
    CUresult r;
    /* one call per mapping: a driver need not unmap several mappings in one call */
    for (size_t k = 0; k < m->n; k++)
        if ((r = cu.MemUnmap(m->base + m->map[k].at, m->map[k].len)) != CUDA_SUCCESS && st == VMM_OK)
            st = cu_fail("cuMemUnmap", r);
    if (m->size && (r = cu.MemAddressFree(m->base, m->size)) != CUDA_SUCCESS && st == VMM_OK)
        st = cu_fail("cuMemAddressFree", r);
    if (switched) (void)cu.CtxSetCurrent(cur);
    free(m);
    return st;
}

/* Reserve the range's address space and map every piece at its place, read-write for dev. */
static vmm_status range_map_all(const range_plan *p, CUcontext ctx, CUdevice dev, range_map **out)
{
    range_map *m = malloc(sizeof *m + p->n_pc * sizeof m->map[0]);
    if (!m) return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    memset(m, 0, sizeof *m);
    m->ctx = ctx;
    size_t total = 0;
    for (size_t k = 0; k < p->n_pc; k++) total += (size_t)p->pc[k].size;
    CUresult r = cu.MemAddressReserve(&m->base, total, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        free(m);
        return cu_fail("cuMemAddressReserve", r);
    }
    m->size = total;
    size_t at = 0;
    for (size_t k = 0; k < p->n_pc; k++) {
        const piece *c = &p->pc[k];
        size_t len = (size_t)c->size;
        if ((r = cu.MemMap(m->base + at, len, 0, c->handle, 0)) != CUDA_SUCCESS) {
            (void)range_unmap(m);
            return cu_fail("cuMemMap", r);
        }
        m->map[m->n].at = at;
        m->map[m->n++].len = len;
        at += len;
    }
    CUmemAccessDesc acc;
    access_for(&acc, dev);
    if ((r = cu.MemSetAccess(m->base, m->size, &acc, 1)) != CUDA_SUCCESS) {
        (void)range_unmap(m);
        return cu_fail("cuMemSetAccess", r);
    }
    *out = m;
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_import_range(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t length,
                                       vmm_imported **out)
{
    NEED(out, "out is NULL");
    *out = NULL;
    NEED(reg, "reg is NULL");
    NEED(pid != 0, "pid is 0");
    NEED(length != 0, "length is 0");
    NEED(address <= UINT64_MAX - length, "the range runs past the end of the address space");
    range_plan p = {.pid = pid, .address = address, .end = address + length};
    vmm_status st = range_walk(reg, &p);
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (st == VMM_OK) st = cuda_ready();
    if (st == VMM_OK) st = current_context(&ctx, &dev);
    if (st == VMM_OK) st = range_layout(&p);
    vmm_imported *imp = NULL;
    if (st == VMM_OK && !(imp = calloc(1, sizeof *imp))) st = set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    bool fetching = st == VMM_OK;
    if (fetching) st = range_fetch(reg, &p);
    range_map *m = NULL;
    if (st == VMM_OK) st = range_map_all(&p, ctx, dev, &m);
    if (fetching) range_release_handles(&p);
    if (st == VMM_OK) {
        imp->range = m;
        imp->ptr = (uint64_t)m->base + p.pc[0].from;
        imp->requested_size = length;
        imp->device = (int)dev;
        *out = imp;
    } else {
        free(imp);
    }
    free(p.rec);
    free(p.pc);
    return st;
}

VMM_PUBLIC uint64_t vmm_import_ptr(const vmm_imported *imp) { return imp ? imp->ptr : 0; }

VMM_PUBLIC uint64_t vmm_import_size(const vmm_imported *imp) { return imp ? imp->requested_size : 0; }

VMM_PUBLIC int vmm_import_device(const vmm_imported *imp) { return imp ? imp->device : -1; }

VMM_PUBLIC vmm_status vmm_import_release(vmm_imported *imp)
{
    if (!imp) return VMM_OK;
    vmm_status st = imp->range ? range_unmap(imp->range) : chunk_unref(imp->c);
    free(imp);
    return st;
}
