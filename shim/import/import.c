/* The import mechanism (shim/import): importing a live allocation into the calling process, for
 * the client library's vmm_import* (tools/client/import_api.c) and the shim's legacy IPC.
 *
 * The fd comes from the owner's broker (VMM_KIND_BROKER: one SOCK_SEQPACKET request, the reply
 * carries the fd with SCM_RIGHTS; wire format in shim/broker/protocol.h) or straight out of the
 * owner's fd table (VMM_KIND_PIDFD: pidfd_getfd, which needs ptrace permission over the owner).
 * Either way the fd is the allocation's chunk: it is mapped whole, once per process, and shared
 * by every import of an allocation in it (see "Imported chunks").  A MULTI-HANDLE record's chunk
 * is several handles, whose fds only the broker hands out (protocol v2, several a reply): they
 * are mapped back to back in one reservation ("multi_fetch", "map_multi").  A range import (vmm_import_range,
 * "Ranges across allocations") maps several records' whole chunks back to back, as in the owner, into
 * one reservation of its own instead, and shares nothing.  The CUDA driver is dlopen'ed
 * on first use; nothing here links it.  Rules as in records.c: never print, never exit, every
 * failure leaves a one-line reason in vmm__error_text(). */
#include "vmmshim.h"

#include "broker/protocol.h"
#include "registry/registry.h"

#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
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

#include "import/import.h"

#define CONNECT_TIMEOUT_MS 2000
/* The broker serves connections one at a time and gives each at most 1 s. */
#define REPLY_TIMEOUT_MS 5000

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */

#define set_err vmm__error

/* The name a caller knows a function by: vmm__import is vmm_import of vmmshim.h. */
static const char *public_name(const char *fn)
{
    static const char *const names[][2] = {
        {"vmm__import", "vmm_import"},         {"vmm__import_fd", "vmm_import_fd"},
        {"vmm__import_check", "vmm_import_check"}, {"vmm__import_last_timing", "vmm_import_last_timing"},
        {"vmm__import_range", "vmm_import_range"}, {"vmm__import_many", "vmm_import_many"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(fn, names[i][0]) == 0) return names[i][1];
    return fn;
}

#define NEED(cond, what)                                                                          \
    do {                                                                                          \
        if (!(cond)) return set_err(VMM_ERR_INVALID, "%s: %s", public_name(__func__), what);     \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* The driver, found at run time                                                              */

typedef struct cuda_api {
    CUresult (*Init)(unsigned int);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
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
        /* which devices a mapping is granted to ("Devices"): without them, the calling
         * context's device alone, as before they were used */
        SYM(DeviceGetCount, "cuDeviceGetCount", true),
        SYM(DeviceGetUuid, "cuDeviceGetUuid_v2", true), /* what the shim names a device by */
        SYM(DeviceCanAccessPeer, "cuDeviceCanAccessPeer", true),
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

/* A driver call that undoes (gives memory back, restores a context), made once more if it fails:
 * nothing else would ever undo it, and a failure may be passing.  The second result stands. */
#define TWICE(call) ((call) == CUDA_SUCCESS ? CUDA_SUCCESS : (call))

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
/* Owners and timing                                                                           */

/* The calling thread's last vmm_import, step by step (vmm_import_last_timing). */
static _Thread_local vmm_import_timing tm;

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* An owner this process imports from: its kept broker connection, and a pidfd that tells in one
 * poll() whether it has exited (reading /proc/<pid>/stat costs more than a whole cached import).
 * Entries go when the owner has exited, or has been idle for OWNER_IDLE_NS, and nothing of it is
 * mapped or in use (the reaper below). */
typedef struct owner_ref {
    uint32_t pid;
    uint64_t start_time, pidns;
    int pidfd;            /* -1: judged through /proc each time (another pid namespace, no pidfd_open) */
    int sock;             /* the kept connection to its broker, -1 none; used under io */
    pthread_mutex_t io;   /* one request at a time on sock */
    unsigned long chunks; /* chunks of it in the chunk table, held or idle */
    unsigned long busy;   /* threads using the entry outside chunks_lock */
    uint64_t last_used_ns;
    struct owner_ref *next;
} owner_ref;

#define OWNER_IDLE_NS (30ull * 1000000000u) /* under the broker's 60 s, so it never closes a kept one first */

/* Lookups and counts are under chunks_lock; driver and broker calls never are, so a slow owner
 * stalls only the imports that wait for it. */
static owner_ref *owners;
static pthread_mutex_t chunks_lock = PTHREAD_MUTEX_INITIALIZER;
static bool keep_nothing; /* vmm__import_keep_nothing */
static void reaper_wake_locked(void);

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
static owner_ref *owner_find_locked(const vmm_alloc_info *a)
{
    for (owner_ref *o = owners; o; o = o->next)
        if (o->pid == a->pid && o->start_time == a->owner_start_time && o->pidns == a->owner_pidns) return o;
    return NULL;
}

static void owner_free(owner_ref *o)
{
    if (o->sock >= 0) close(o->sock);
    if (o->pidfd >= 0) close(o->pidfd);
    pthread_mutex_destroy(&o->io);
    free(o);
}

/* The owner's entry, made when new, marked busy until owner_put. */
static vmm_status owner_get(const vmm_alloc_info *a, owner_ref **out)
{
    pthread_mutex_lock(&chunks_lock);
    owner_ref *o = owner_find_locked(a);
    if (o) o->busy++;
    pthread_mutex_unlock(&chunks_lock);
    if (o) {
        *out = o;
        return VMM_OK;
    }
    owner_ref *fresh = calloc(1, sizeof *fresh);
    if (!fresh) return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    fresh->pid = a->pid;
    fresh->start_time = a->owner_start_time;
    fresh->pidns = a->owner_pidns;
    fresh->pidfd = owner_pidfd(a);
    fresh->sock = -1;
    pthread_mutex_init(&fresh->io, NULL);
    fresh->busy = 1;
    pthread_mutex_lock(&chunks_lock);
    if ((o = owner_find_locked(a)) != NULL) {
        o->busy++;
    } else {
        fresh->next = owners;
        owners = o = fresh;
        fresh = NULL;
        reaper_wake_locked();
    }
    pthread_mutex_unlock(&chunks_lock);
    if (fresh) owner_free(fresh);
    *out = o;
    return VMM_OK;
}

static void owner_put(owner_ref *o)
{
    pthread_mutex_lock(&chunks_lock);
    o->busy--;
    o->last_used_ns = now_ns();
    bool drop = keep_nothing && o->busy == 0 && o->chunks == 0;
    if (drop)
        for (owner_ref **pp = &owners; *pp; pp = &(*pp)->next)
            if (*pp == o) {
                *pp = o->next;
                break;
            }
    pthread_mutex_unlock(&chunks_lock);
    if (drop) owner_free(o);
}

void vmm__import_keep_nothing(void)
{
    pthread_mutex_lock(&chunks_lock);
    keep_nothing = true;
    pthread_mutex_unlock(&chunks_lock);
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

/* Receive one datagram (its length in *len) and at most max_fds fds (any extra are closed).
 * Returns 0 or -errno; on failure no fd is left open. */
static int broker_recv_raw(int s, void *buf, size_t cap, size_t *len, int *fds, uint32_t max_fds, uint32_t *n_fds)
{
    *n_fds = 0;
    *len = 0;
    struct pollfd p = {.fd = s, .events = POLLIN};
    int pr;
    do pr = poll(&p, 1, REPLY_TIMEOUT_MS);
    while (pr < 0 && errno == EINTR);
    if (pr < 0) return -errno;
    if (pr == 0) return -ETIMEDOUT;
    /* room for a few more than the protocol allows, so that extras are seen and closed */
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE((VMM_BROKER_MAX_FDS + 4) * sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = cap};
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
            if (*n_fds < max_fds)
                fds[(*n_fds)++] = f;
            else
                close(f);
        }
    }
    int rc = 0;
    if (n == 0)
        rc = -ECONNRESET; /* closed without a word */
    else if ((size_t)n > cap || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
        rc = -EPROTO;
    if (rc) {
        while (*n_fds) close(fds[--*n_fds]);
        return rc;
    }
    *len = (size_t)n;
    return 0;
}

/* Receive a v1 reply and at most one fd.  Returns 0 or -errno. */
static int broker_recv(int s, vmm_broker_reply *rep, int *fd)
{
    *fd = -1;
    union {
        vmm_broker_reply rep;
        uint8_t raw[sizeof(vmm_broker_reply) + 32];
    } in;
    memset(&in, 0, sizeof in);
    size_t n;
    uint32_t got;
    int rc = broker_recv_raw(s, in.raw, sizeof in.raw, &n, fd, 1, &got);
    if (rc) return rc;
    if (n != sizeof(vmm_broker_reply) || in.rep.magic != VMM_BROKER_MAGIC) {
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

/* The owner's broker socket, as its process record names it. */
static vmm_status broker_path_of(vmm_registry *reg, const vmm_alloc_info *a, char *path, size_t len)
{
    vmm_proc_info proc;
    proc_match m = {.alloc = a, .out = &proc};
    vmm_status st = vmm__foreach_proc(reg, match_proc, &m);
    if (st != VMM_OK) return st;
    if (!m.found) {
        if (owner_liveness(a) == VMM__DEAD) return owner_dead(a);
        return set_err(VMM_ERR_NOT_FOUND, "no process record for owner pid %u in the registry", a->pid);
    }
    if (!proc.broker_path[0]) {
        if (owner_liveness(a) == VMM__DEAD) return owner_dead(a);
        return set_err(VMM_ERR_NOT_FOUND, "owner pid %u has no broker (not started yet)", a->pid);
    }
    snprintf(path, len, "%s", proc.broker_path);
    return VMM_OK;
}

static vmm_status broker_open(vmm_registry *reg, const vmm_alloc_info *a, int *sock)
{
    char path[sizeof ((vmm_proc_info *)0)->broker_path];
    vmm_status st = broker_path_of(reg, a, path, sizeof path);
    if (st != VMM_OK) return st;
    uint64_t t0 = now_ns();
    int s = broker_connect(path);
    tm.connect_ns = now_ns() - t0;
    if (s >= 0) {
        *sock = s;
        return VMM_OK;
    }
    int e = -s;
    if (e == ECONNREFUSED || e == ENOENT || e == ENOTDIR) {
        if (owner_liveness(a) == VMM__DEAD) return owner_dead(a);
        return set_err(VMM_ERR_IO, "owner pid %u's broker %s is not listening: %s", a->pid, path, strerror(e));
    }
    if (e == EACCES || e == EPERM)
        return set_err(VMM_ERR_ACCESS, "cannot reach owner pid %u's broker %s: %s (is this user in the "
                                       "owner's VMMSHIM_BROKER_GROUP?)",
                       a->pid, path, strerror(e));
    if (e == ETIMEDOUT) return set_err(VMM_ERR_IO, "owner pid %u's broker %s: connect timed out", a->pid, path);
    return set_err(VMM_ERR_IO, "owner pid %u's broker %s: connect: %s", a->pid, path, strerror(e));
}

/* One request and its reply on the owner's kept connection (o->io held).  The broker closes
 * idle connections, and drops the longest idle one when it has too many: a kept connection that
 * turns out closed is opened again once.  0, or -errno. */
static int broker_roundtrip(vmm_registry *reg, const vmm_alloc_info *a, owner_ref *o, const void *req, size_t req_len,
                            int (*recv_fn)(int, void *), void *recv_ctx, vmm_status *open_st)
{
    *open_st = VMM_OK;
    for (int attempt = 0;; attempt++) {
        bool fresh = o->sock < 0;
        if (fresh && (*open_st = broker_open(reg, a, &o->sock)) != VMM_OK) return -ENOTCONN;
        uint64_t t0 = now_ns();
        ssize_t n;
        do n = send(o->sock, req, req_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        int rc = n == (ssize_t)req_len ? recv_fn(o->sock, recv_ctx) : -(n < 0 ? errno : EIO);
        tm.request_ns += now_ns() - t0;
        if (rc == 0) return 0;
        close(o->sock);
        o->sock = -1;
        if (fresh || attempt > 0 || !(rc == -EPIPE || rc == -ECONNRESET || rc == -ENOTCONN)) return rc;
    }
}

typedef struct v1_recv {
    vmm_broker_reply *rep;
    int *fd;
} v1_recv;

static int recv_v1(int s, void *ctx)
{
    v1_recv *r = ctx;
    return broker_recv(s, r->rep, r->fd);
}

static int broker_exchange(vmm_registry *reg, const vmm_alloc_info *a, owner_ref *o, vmm_broker_reply *rep, int *fd,
                           vmm_status *open_st)
{
    vmm_broker_request req;
    memset(&req, 0, sizeof req);
    req.magic = VMM_BROKER_MAGIC;
    req.version = VMM_BROKER_VERSION;
    req.slot = a->slot;
    req.generation = a->generation;
    memcpy(req.alloc_id, a->alloc_id, sizeof req.alloc_id);
    v1_recv r = {rep, fd};
    return broker_roundtrip(reg, a, o, &req, sizeof req, recv_v1, &r, open_st);
}

/* A failed exchange (no reply) as the caller's status. */
static vmm_status exchange_failed(const vmm_alloc_info *a, int rc)
{
    if ((rc == -ECONNRESET || rc == -EPIPE) && owner_liveness(a) == VMM__DEAD) return owner_dead(a);
    if (rc == -ETIMEDOUT)
        return set_err(VMM_ERR_IO, "owner pid %u's broker did not reply within %d s", a->pid, REPLY_TIMEOUT_MS / 1000);
    if (rc == -EPROTO) return set_err(VMM_ERR_IO, "owner pid %u's broker sent a malformed reply", a->pid);
    if (rc == -ECONNRESET)
        return set_err(VMM_ERR_IO, "owner pid %u's broker closed the connection without replying", a->pid);
    return set_err(VMM_ERR_IO, "owner pid %u's broker: %s", a->pid, strerror(-rc));
}

/* A reply's non-zero status as the caller's status. */
static vmm_status reply_failed(const vmm_alloc_info *a, int32_t status)
{
    switch (status) {
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
    case -EPROTONOSUPPORT:
        return set_err(VMM_ERR_IO, "owner pid %u's broker: the allocation spans several handles, which a one-handle "
                                   "(v1) request cannot fetch", a->pid);
    default:
        return set_err(VMM_ERR_IO, "owner pid %u's broker could not export the allocation: %s", a->pid,
                       status < 0 && status > -4096 ? strerror(-status) : "unknown status");
    }
}

static vmm_status broker_fetch(vmm_registry *reg, const vmm_alloc_info *a, int *fd_out)
{
    owner_ref *o;
    vmm_status st = owner_get(a, &o);
    if (st != VMM_OK) return st;
    vmm_broker_reply rep;
    memset(&rep, 0, sizeof rep);
    int fd = -1;
    pthread_mutex_lock(&o->io);
    int rc = broker_exchange(reg, a, o, &rep, &fd, &st);
    pthread_mutex_unlock(&o->io);
    owner_put(o);
    if (st != VMM_OK) return st; /* could not connect: its reason */
    if (rc) return exchange_failed(a, rc);
    tm.export_ns = rep.export_ns;
    if (rep.status != 0) return reply_failed(a, rep.status);
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

/* A multi-handle allocation's handles, imported here, in address order. */
typedef struct multi_parts {
    uint32_t n;
    CUmemGenericAllocationHandle *h;
    uint64_t *size;
} multi_parts;

static void parts_release(multi_parts *p, uint32_t n_imported)
{
    for (uint32_t i = 0; i < n_imported; i++) (void)TWICE(cu.MemRelease(p->h[i]));
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
    int rc = broker_recv_raw(s, in.raw, sizeof in.raw, &r->len, r->fds, VMM_BROKER_MAX_FDS, &r->n_fds);
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
 * reply, asking again from where the last reply ended), each imported.  The broker checks the
 * allocation anew on each request, so one freed midway fails as stale, never mixes handles. */
static vmm_status multi_fetch(vmm_registry *reg, const vmm_alloc_info *a, multi_parts *p)
{
    memset(p, 0, sizeof *p);
    p->n = a->n_handles;
    p->h = calloc(p->n, sizeof *p->h);
    p->size = calloc(p->n, sizeof *p->size);
    if (!p->h || !p->size) {
        parts_release(p, 0);
        return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    }
    tm.route = VMM_KIND_BROKER;
    owner_ref *o;
    vmm_status st = owner_get(a, &o);
    if (st != VMM_OK) {
        parts_release(p, 0);
        return st;
    }
    uint32_t have = 0;
    uint64_t bytes = 0;
    while (st == VMM_OK && have < p->n) {
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
        int rc = broker_roundtrip(reg, a, o, &req, sizeof req, recv_v2, &r, &st);
        pthread_mutex_unlock(&o->io);
        if (st != VMM_OK) break; /* could not connect: its reason */
        if (rc) {
            st = exchange_failed(a, rc);
            break;
        }
        if (rep.status == -EPROTO)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker does not speak protocol v2, which a multi-handle "
                                     "allocation (%u handles) needs; its shim is older than this library",
                         a->pid, p->n);
        else if (rep.status == -ERANGE)
            st = set_err(VMM_ERR_STALE, "owner pid %u's allocation no longer has the %u handles its record says "
                                        "(no handle %u)", a->pid, p->n, have);
        else if (rep.status != 0)
            st = reply_failed(a, rep.status);
        else if (rep.n_total != p->n)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker says the allocation has %u handles; the record says %u",
                         a->pid, rep.n_total, p->n);
        else if (rep.n_here == 0 || rep.n_here != r.n_fds || rep.n_here > p->n - have)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u fds for %u handles from handle %u of %u", a->pid,
                         r.n_fds, rep.n_here, have, p->n);
        tm.export_ns += rep.export_ns;
        for (uint32_t i = 0; i < r.n_fds; i++) {
            if (st == VMM_OK && (rep.sizes[i] == 0 || rep.sizes[i] > a->mapped_size - bytes))
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent handles of more bytes than the record's %llu",
                             a->pid, (unsigned long long)a->mapped_size);
            if (st == VMM_OK) {
                uint64_t t0 = now_ns();
                CUresult cr = cu.MemImportFromShareableHandle(&p->h[have], (void *)(uintptr_t)fds[i],
                                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
                tm.import_ns += now_ns() - t0;
                if (cr != CUDA_SUCCESS) {
                    st = cu_fail("cuMemImportFromShareableHandle", cr);
                } else {
                    p->size[have++] = rep.sizes[i];
                    bytes += rep.sizes[i];
                }
            }
            close(fds[i]); /* the driver keeps its own reference */
        }
    }
    owner_put(o);
    if (st == VMM_OK && bytes != a->mapped_size)
        st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u handles of %llu bytes; the record says %llu", a->pid,
                     p->n, (unsigned long long)bytes, (unsigned long long)a->mapped_size);
    if (st != VMM_OK) parts_release(p, have);
    return st;
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

/* A mapping no vmm_imported holds stays mapped ("idle") while its owner still holds the chunk, so
 * that importing from it again costs a registry read, not a broker round trip and four driver
 * calls.  The last allocation imported from it is its witness: while that record stays live the
 * owner holds the chunk.  When the witness is freed (the chunk may live on with other
 * allocations: the mapping is dropped anyway, never kept on a guess), the owner exits, or the
 * registry it was read from is closed, the reaper unmaps it: an idle mapping never keeps memory
 * the owner has let go of. */
typedef struct chunk {
    chunk_key key;
    owner_ref *owner;
    vmm_registry *reg;  /* read the witness through it; NULL once closed (unmapped when unheld) */
    CUdeviceptr base;
    size_t size;
    CUmemGenericAllocationHandle handle; /* when n_parts is 0 */
    /* A MULTI-HANDLE allocation: n_parts handles mapped back to back, part_len[i] bytes each.
     * Their handles are released once mapped (the mappings keep the memory alive), so only the
     * lengths are kept, to unmap one mapping at a time. */
    uint32_t n_parts;
    uint64_t *part_len;
    CUcontext ctx;      /* current when it was mapped: released from it */
    uint64_t devices;   /* bit d: device d was granted access (devices 0..63) */
    unsigned long refs; /* vmm_imported handles on it; 0: idle */
    uint64_t witness_slot, witness_generation;
    uint8_t witness_id[16];
    struct chunk *next;
} chunk;

/* A fixed table of chains: no growth path, so no allocation that could fail besides the entry's
 * own (a table library would exit on out-of-memory, and this library never exits). */
#define CHUNK_BUCKETS 1024u
static chunk *chunk_table[CHUNK_BUCKETS];
static unsigned long idle_chunks;

static chunk_key key_of(const vmm_alloc_info *a)
{
    chunk_key k;
    memset(&k, 0, sizeof k);
    k.pid = a->pid;
    k.start_time = a->owner_start_time;
    k.pidns = a->owner_pidns;
    k.mapped_size = a->mapped_size;
    /* A MULTI-HANDLE record's chunk_id names only its first handle: while the allocation lives,
     * the handles after it are its own, but once it is freed the owner may give them back and map
     * others of the same sizes there, so another allocation with the same first handle and size
     * may span other handles.  Its mapping serves that one allocation: keyed by slot and
     * generation. */
    if (a->chunk_id && !(a->flags & VMM_ALLOC_MULTI_HANDLE)) {
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
            if (c->refs++ == 0) idle_chunks--;
            return c;
        }
    return NULL;
}

/* Lock held: take c out of the table (its mapping is the caller's to undo). */
static void chunk_unlink_locked(chunk *c)
{
    for (chunk **pp = bucket_of(&c->key); *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    c->owner->chunks--;
    c->owner->last_used_ns = now_ns();
}

static void set_witness_locked(chunk *c, vmm_registry *reg, const vmm_alloc_info *a)
{
    c->reg = reg;
    c->witness_slot = a->slot;
    c->witness_generation = a->generation;
    memcpy(c->witness_id, a->alloc_id, sizeof c->witness_id);
}

/* Memory is unmapped from the context it was mapped in, whichever is current on the releasing
 * thread.  True when ctx was made current here; *prev is what to restore then.  (cuda_ready()
 * succeeded when the memory was mapped; the table never changes after.) */
static bool ctx_enter(CUcontext ctx, CUcontext *prev)
{
    *prev = NULL;
    return cu.CtxGetCurrent(prev) == CUDA_SUCCESS && *prev != ctx && cu.CtxSetCurrent(ctx) == CUDA_SUCCESS;
}

/* Give back the pieces of a mapping, as far as they exist: the mapping, the handle, the address
 * range (not freed under a mapping the driver kept).  The first failure's status. */
static vmm_status undo(CUdeviceptr base, size_t size, CUmemGenericAllocationHandle handle, bool mapped, bool reserved)
{
    vmm_status st = VMM_OK;
    CUresult r;
    if (mapped && (r = TWICE(cu.MemUnmap(base, size))) != CUDA_SUCCESS) {
        st = cu_fail("cuMemUnmap", r);
        reserved = false;
    }
    if ((r = TWICE(cu.MemRelease(handle))) != CUDA_SUCCESS && st == VMM_OK) st = cu_fail("cuMemRelease", r);
    if (reserved && (r = TWICE(cu.MemAddressFree(base, size))) != CUDA_SUCCESS && st == VMM_OK)
        st = cu_fail("cuMemAddressFree", r);
    return st;
}

/* Unmap, release and free the address range of a mapping no reference points to any more. */
static vmm_status unmap_chunk(const chunk *c)
{
    CUcontext cur;
    bool switched = ctx_enter(c->ctx, &cur);
    vmm_status st = VMM_OK;
    if (!c->n_parts) {
        st = undo(c->base, c->size, c->handle, true, true);
    } else {
        /* one call per mapping, as a range import's; the range is not freed under a mapping the
         * driver kept */
        CUresult r;
        uint64_t at = 0;
        for (uint32_t i = 0; i < c->n_parts; at += c->part_len[i++])
            if ((r = TWICE(cu.MemUnmap(c->base + at, c->part_len[i]))) != CUDA_SUCCESS && st == VMM_OK)
                st = cu_fail("cuMemUnmap", r);
        if (st == VMM_OK && (r = TWICE(cu.MemAddressFree(c->base, c->size))) != CUDA_SUCCESS)
            st = cu_fail("cuMemAddressFree", r);
    }
    if (switched) (void)TWICE(cu.CtxSetCurrent(cur)); /* else the thread stays in ctx */
    return st;
}

static void chunk_free(chunk *c)
{
    free(c->part_len);
    free(c);
}

/* Unmap a list of unlinked chunks (chained through next); the first failure's status. */
static vmm_status unmap_list(chunk *list)
{
    vmm_status st = VMM_OK;
    while (list) {
        chunk *c = list;
        list = c->next;
        vmm_status s1 = unmap_chunk(c);
        if (st == VMM_OK) st = s1;
        chunk_free(c);
    }
    return st;
}

/* Lock held.  The idle chunk's owner still holds it, as far as the registry tells. */
static bool witness_live_locked(const chunk *c)
{
    if (!c->reg || owner_exited(c->owner)) return false;
    vmm_alloc_info now;
    return vmm__read_slot(c->reg, c->witness_slot, &now) == VMM_OK &&
           now.generation == c->witness_generation && memcmp(now.alloc_id, c->witness_id, sizeof now.alloc_id) == 0;
}

/* Drop one reference.  The last one leaves the mapping idle while its owner holds the chunk,
 * and unmaps it otherwise (outside the lock). */
static vmm_status chunk_unref(chunk *c)
{
    pthread_mutex_lock(&chunks_lock);
    bool unmap = false;
    if (--c->refs == 0) {
        if (!keep_nothing && witness_live_locked(c)) {
            idle_chunks++;
            reaper_wake_locked();
        } else {
            chunk_unlink_locked(c);
            unmap = true;
        }
    }
    owner_ref *o = unmap ? c->owner : NULL;
    if (o) o->busy++; /* the owner entry outlives the unlink until owner_put */
    pthread_mutex_unlock(&chunks_lock);
    if (!unmap) return VMM_OK;
    c->next = NULL;
    vmm_status st = unmap_list(c);
    owner_put(o);
    return st;
}

/* ---- the reaper: a thread that looks after idle mappings and kept connections ------------ */

#define REAPER_TICK_MS 100
static bool reaper_running;

/* Lock held.  Unlink what nobody needs any more onto *dead_chunks / *dead_owners.  `all`: every
 * idle chunk (vmm_import_drop_idle); `reg`: the idle chunks read through it (vmm_close). */
static void sweep_locked(bool all, const vmm_registry *reg, chunk **dead_chunks, owner_ref **dead_owners)
{
    uint64_t now = now_ns();
    for (unsigned b = 0; b < CHUNK_BUCKETS; b++)
        for (chunk **pp = &chunk_table[b]; *pp;) {
            chunk *c = *pp;
            if (reg && c->reg == reg) c->reg = NULL; /* a held one goes at its last release */
            if (c->refs == 0 && (all || !witness_live_locked(c))) {
                *pp = c->next;
                c->owner->chunks--;
                c->owner->last_used_ns = now;
                idle_chunks--;
                c->next = *dead_chunks;
                *dead_chunks = c;
                continue;
            }
            pp = &c->next;
        }
    for (owner_ref **pp = &owners; *pp;) {
        owner_ref *o = *pp;
        if (o->chunks == 0 && o->busy == 0 && (now - o->last_used_ns > OWNER_IDLE_NS || owner_exited(o))) {
            *pp = o->next;
            o->next = *dead_owners;
            *dead_owners = o;
            continue;
        }
        pp = &o->next;
    }
}

static vmm_status reap(chunk *dead_chunks, owner_ref *dead_owners)
{
    vmm_status st = unmap_list(dead_chunks);
    while (dead_owners) {
        owner_ref *o = dead_owners;
        dead_owners = o->next;
        owner_free(o);
    }
    return st;
}

static void *reaper_main(void *arg)
{
    (void)arg;
    for (;;) {
        struct timespec ts = {0, REAPER_TICK_MS * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
        chunk *dead_chunks = NULL;
        owner_ref *dead_owners = NULL;
        pthread_mutex_lock(&chunks_lock);
        sweep_locked(false, NULL, &dead_chunks, &dead_owners);
        bool done = idle_chunks == 0 && owners == NULL;
        if (done) reaper_running = false;
        pthread_mutex_unlock(&chunks_lock);
        (void)reap(dead_chunks, dead_owners);
        if (done) return NULL;
    }
}

/* Lock held.  Start the reaper if it is not running.  It takes no signals (they are the
 * application's).  Should it fail to start, idle mappings and connections still go at
 * vmm_import_drop_idle and vmm_close. */
static void reaper_wake_locked(void)
{
    if (reaper_running || keep_nothing) return;
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_t th;
    sigfillset(&all);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    reaper_running = pthread_create(&th, &attr, reaper_main, NULL) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
}

vmm_status vmm__import_drop_idle(void)
{
    chunk *dead_chunks = NULL;
    owner_ref *dead_owners = NULL;
    pthread_mutex_lock(&chunks_lock);
    sweep_locked(true, NULL, &dead_chunks, &dead_owners);
    pthread_mutex_unlock(&chunks_lock);
    return reap(dead_chunks, dead_owners);
}

void vmm__import_forget_registry(vmm_registry *reg)
{
    chunk *dead_chunks = NULL;
    owner_ref *dead_owners = NULL;
    pthread_mutex_lock(&chunks_lock);
    sweep_locked(false, reg, &dead_chunks, &dead_owners);
    pthread_mutex_unlock(&chunks_lock);
    (void)reap(dead_chunks, dead_owners);
}

static void access_for(CUmemAccessDesc *acc, CUdevice dev)
{
    memset(acc, 0, sizeof *acc);
    acc->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc->location.id = (int)dev;
    acc->flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

/* ------------------------------------------------------------------------------------------ */
/* Devices                                                                                     */
/* Which devices a mapping is granted read-write access to.  The memory lies on the device the
 * record names (by UUID: the owner's ordinal may name another device here, CUDA_VISIBLE_DEVICES
 * differing between processes).  A mapping is granted to that device, when it is visible here, so
 * its kernels and copies reach the memory locally, and to the importing thread's device, when it
 * is that device or can access it as a peer (cuDeviceCanAccessPeer): a companion on GPU 1
 * importing memory of GPU 0 gets a mapping that kernels on GPU 1 (over NVLink or PCIe) and on
 * GPU 0 both use.  A device that cannot reach the memory is not granted (the driver would refuse
 * the whole cuMemSetAccess), and the import is then reported for the memory's own device.  When
 * the record's device is not known here (no UUID, or not visible), the thread's device alone, as
 * before.  Each further device a thread of this process imports from is granted too
 * (grant_device).  The import's device (vmm_import_device, the DLPack device in Python) is the
 * thread's own when the thread had a context and was granted, else the memory's device. */

#define MAX_DEVICES 64

static pthread_mutex_t devices_lock = PTHREAD_MUTEX_INITIALIZER;
static int devices_known; /* 1 once the table below is filled (read with acquire) */
static int n_devices;
static uint8_t device_uuid[MAX_DEVICES][16];

/* Lock held: every visible device's UUID.  A failure leaves the table unknown, to be tried again
 * by the next import. */
static void devices_load_locked(void)
{
    int n = 0;
    if (!cu.DeviceGetCount || !cu.DeviceGetUuid || cu.DeviceGetCount(&n) != CUDA_SUCCESS || n <= 0) return;
    if (n > MAX_DEVICES) n = MAX_DEVICES;
    for (int i = 0; i < n; i++) {
        CUdevice d = i;
        CUuuid u;
        if ((cu.DeviceGet && cu.DeviceGet(&d, i) != CUDA_SUCCESS) || cu.DeviceGetUuid(&u, d) != CUDA_SUCCESS) return;
        memcpy(device_uuid[i], u.bytes, 16);
    }
    n_devices = n;
    __atomic_store_n(&devices_known, 1, __ATOMIC_RELEASE);
}

/* The device the record's memory lies on, as an ordinal of this process; -1 when unknown. */
static int resident_device(const vmm_alloc_info *a)
{
    static const uint8_t zero[16];
    if (memcmp(a->device_uuid, zero, sizeof zero) == 0) return -1;
    if (!__atomic_load_n(&devices_known, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&devices_lock);
        if (!devices_known) devices_load_locked();
        pthread_mutex_unlock(&devices_lock);
        if (!__atomic_load_n(&devices_known, __ATOMIC_ACQUIRE)) return -1;
    }
    for (int i = 0; i < n_devices; i++)
        if (memcmp(device_uuid[i], a->device_uuid, 16) == 0) return i;
    return -1;
}

/* The calling thread's device and whether the thread had a context of its own (current_context). */
typedef struct {
    CUdevice dev;
    bool own;
} here_device;

/* The devices a new mapping of record a gets access for, imported by a thread on `here`: acc[0..*n),
 * and *use, the device the import is reported for. */
static void plan_access(const vmm_alloc_info *a, here_device here, CUmemAccessDesc acc[2], size_t *n, CUdevice *use)
{
    int res = resident_device(a);
    *n = 0;
    *use = here.dev;
    if (res < 0 || res == (int)here.dev) {
        access_for(&acc[(*n)++], here.dev);
        return;
    }
    access_for(&acc[(*n)++], (CUdevice)res);
    int can = 0;
    if (cu.DeviceCanAccessPeer && cu.DeviceCanAccessPeer(&can, here.dev, (CUdevice)res) == CUDA_SUCCESS && can)
        access_for(&acc[(*n)++], here.dev);
    if (*n == 1 || !here.own) *use = (CUdevice)res;
}

static uint64_t device_bits(const CUmemAccessDesc *acc, size_t n)
{
    uint64_t bits = 0;
    for (size_t i = 0; i < n; i++)
        if (acc[i].location.id >= 0 && acc[i].location.id < 64) bits |= 1ull << acc[i].location.id;
    return bits;
}

/* Access for dev on chunk c, unless it has it already. */
static vmm_status grant_one(chunk *c, CUdevice dev)
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

/* A chunk mapped already, imported by a thread on `here`: that device needs access too (one
 * address range serves every device of the process), when it can reach the memory, and so does
 * the memory's own device (it has it, unless it was not known when the chunk was mapped).  *use:
 * the device the import is reported for. */
static vmm_status grant_device(chunk *c, const vmm_alloc_info *a, here_device here, CUdevice *use)
{
    int res = resident_device(a);
    *use = here.dev;
    if (res >= 0 && res != (int)here.dev) {
        vmm_status st = grant_one(c, (CUdevice)res);
        if (st != VMM_OK) return st;
        int can = 0;
        if (!cu.DeviceCanAccessPeer || cu.DeviceCanAccessPeer(&can, here.dev, (CUdevice)res) != CUDA_SUCCESS) can = 0;
        if (!can || !here.own) *use = (CUdevice)res;
        if (!can) return VMM_OK;
    }
    return grant_one(c, here.dev);
}

/* The registry still shows this very allocation, live, at its place in its chunk. */
static vmm_status record_unchanged(vmm_registry *reg, const vmm_alloc_info *a)
{
    vmm_alloc_info now;
    vmm_status st = vmm__read_slot(reg, a->slot, &now);
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
    if (owner_exited(owner) && !vmm__kept_now(reg, a)) return owner_dead(a); /* a keeper serves a kept one */
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
    vmm_alloc_info alloc;    /* a vmm_import: the record it was imported from (vmm_import_check) */
};

static vmm_status fetch_fd(vmm_registry *reg, const vmm_alloc_info *a, int *fd)
{
    *fd = -1;
    if (a->flags & VMM_ALLOC_MULTI_HANDLE)
        return set_err(VMM_ERR_INVALID, "the allocation spans %u handles (a multi-handle record); one fd cannot carry "
                                        "it: use vmm_import", a->n_handles);
    if (a->handle_kinds & VMM_KIND_BROKER) {
        tm.route = VMM_KIND_BROKER;
        vmm_status st = broker_fetch(reg, a, fd);
        /* a broker that has not started yet is no reason to give up when pidfd works too */
        if (st != VMM_ERR_NOT_FOUND || !(a->handle_kinds & VMM_KIND_PIDFD)) return st;
    }
    if (a->handle_kinds & VMM_KIND_PIDFD) {
        tm.route = VMM_KIND_PIDFD;
        uint64_t t0 = now_ns();
        vmm_status st = pidfd_fetch(reg, a, fd);
        tm.request_ns = now_ns() - t0;
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
    return fetch_fd(reg, alloc, fd);
}

/* The calling thread's context, or device 0's primary context made current; and its device
 * (here->own: the thread had a context of its own). */
static vmm_status current_context(CUcontext *ctx, here_device *here)
{
    static int inited; /* cuInit succeeded once: it holds for the process's life */
    CUresult r;
    *ctx = NULL;
    here->dev = 0;
    here->own = true;
    if (!__atomic_load_n(&inited, __ATOMIC_ACQUIRE)) {
        if ((r = cu.Init(0)) != CUDA_SUCCESS) return cu_fail("cuInit", r);
        __atomic_store_n(&inited, 1, __ATOMIC_RELEASE);
    }
    if ((r = cu.CtxGetCurrent(ctx)) != CUDA_SUCCESS) return cu_fail("cuCtxGetCurrent", r);
    if (!*ctx) {
        /* no context on this thread: device 0's primary one (retained for the process's life) */
        CUdevice d0 = 0;
        here->own = false;
        if (cu.DeviceGet && (r = cu.DeviceGet(&d0, 0)) != CUDA_SUCCESS) return cu_fail("cuDeviceGet", r);
        if ((r = cu.DevicePrimaryCtxRetain(ctx, d0)) != CUDA_SUCCESS) return cu_fail("cuDevicePrimaryCtxRetain", r);
        if ((r = cu.CtxSetCurrent(*ctx)) != CUDA_SUCCESS) return cu_fail("cuCtxSetCurrent", r);
    }
    if ((r = cu.CtxGetDevice(&here->dev)) != CUDA_SUCCESS) return cu_fail("cuCtxGetDevice", r);
    return VMM_OK;
}

/* The allocation's chunk as a handle of this process: its fd from the owner, imported.  The
 * caller maps it or releases it (cuMemRelease). */
static vmm_status fetch_handle(vmm_registry *reg, const vmm_alloc_info *a, CUmemGenericAllocationHandle *handle)
{
    int fd = -1;
    vmm_status st = fetch_fd(reg, a, &fd);
    if (st != VMM_OK) return st;
    uint64_t t0 = now_ns();
    CUresult r = cu.MemImportFromShareableHandle(handle, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    tm.import_ns = now_ns() - t0;
    close(fd); /* the driver keeps its own reference */
    return r == CUDA_SUCCESS ? VMM_OK : cu_fail("cuMemImportFromShareableHandle", r);
}

/* Map all of the chunk behind handle (consumed: released on failure) read-write for the n
 * devices of acc. */
static vmm_status map_chunk(CUmemGenericAllocationHandle handle, size_t size, const CUmemAccessDesc *acc, size_t n,
                            chunk *c)
{
    c->handle = handle;
    CUresult r;
    const char *what;
    uint64_t t0 = now_ns();
    r = cu.MemAddressReserve(&c->base, size, 0, 0, 0);
    uint64_t t1 = now_ns();
    tm.reserve_ns = t1 - t0;
    bool reserved = false, mapped = false;
    if (r != CUDA_SUCCESS) {
        what = "cuMemAddressReserve";
        goto undo;
    }
    reserved = true;
    r = cu.MemMap(c->base, size, 0, c->handle, 0);
    uint64_t t2 = now_ns();
    tm.map_ns = t2 - t1;
    if (r != CUDA_SUCCESS) {
        what = "cuMemMap";
        goto undo;
    }
    mapped = true;
    r = cu.MemSetAccess(c->base, size, acc, n);
    tm.access_ns = now_ns() - t2;
    if (r != CUDA_SUCCESS) {
        what = "cuMemSetAccess";
        goto undo;
    }
    c->size = size;
    c->devices = device_bits(acc, n);
    return VMM_OK;
undo:
    (void)undo(c->base, size, c->handle, mapped, reserved);
    return cu_fail(what, r);
}

/* Map a MULTI-HANDLE allocation's handles (consumed: released either way) back to back in one
 * reservation, read-write for the n devices of acc, with one cuMemSetAccess over the whole. */
static vmm_status map_multi(multi_parts *p, size_t size, const CUmemAccessDesc *acc, size_t n, chunk *c)
{
    c->part_len = malloc(p->n * sizeof *c->part_len);
    if (!c->part_len) {
        parts_release(p, p->n);
        return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    }
    CUresult r;
    const char *what = "cuMemAddressReserve";
    uint64_t t0 = now_ns();
    r = cu.MemAddressReserve(&c->base, size, 0, 0, 0);
    uint64_t t1 = now_ns();
    tm.reserve_ns = t1 - t0;
    c->size = size;
    c->n_parts = 0;
    if (r == CUDA_SUCCESS) {
        uint64_t at = 0;
        for (uint32_t i = 0; i < p->n && r == CUDA_SUCCESS; at += p->size[i++]) {
            what = "cuMemMap";
            if ((r = cu.MemMap(c->base + at, p->size[i], 0, p->h[i], 0)) == CUDA_SUCCESS)
                c->part_len[c->n_parts++] = p->size[i];
        }
    }
    uint64_t t2 = now_ns();
    tm.map_ns = t2 - t1;
    if (r == CUDA_SUCCESS) {
        what = "cuMemSetAccess";
        r = cu.MemSetAccess(c->base, size, acc, n);
        tm.access_ns = now_ns() - t2;
    }
    parts_release(p, p->n); /* mapped, they keep their memory; unmapped, it goes */
    if (r != CUDA_SUCCESS) {
        vmm_status st = cu_fail(what, r);
        if (c->base) {
            uint64_t at = 0;
            bool kept = false;
            for (uint32_t i = 0; i < c->n_parts; at += c->part_len[i++])
                kept |= TWICE(cu.MemUnmap(c->base + at, c->part_len[i])) != CUDA_SUCCESS;
            if (!kept) (void)TWICE(cu.MemAddressFree(c->base, size));
        }
        free(c->part_len);
        c->part_len = NULL;
        c->n_parts = 0;
        return st;
    }
    c->devices = device_bits(acc, n);
    return VMM_OK;
}

static vmm_status import_chunk(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported *imp)
{
    CUcontext ctx;
    here_device here;
    CUdevice use = 0;
    uint64_t t0 = now_ns();
    vmm_status st = current_context(&ctx, &here);
    uint64_t t1 = now_ns();
    tm.context_ns = t1 - t0;
    if (st != VMM_OK) return st;

    chunk_key k = key_of(alloc);
    pthread_mutex_lock(&chunks_lock);
    chunk *c = chunk_ref_locked(&k);
    pthread_mutex_unlock(&chunks_lock);
    if (c) { /* mapped already: no broker, no import, no mapping */
        tm.cached = 1;
        if ((st = still_live(reg, alloc, c->owner)) != VMM_OK || (st = grant_device(c, alloc, here, &use)) != VMM_OK) {
            (void)chunk_unref(c);
            return st;
        }
        pthread_mutex_lock(&chunks_lock);
        set_witness_locked(c, reg, alloc);
        pthread_mutex_unlock(&chunks_lock);
        tm.lookup_ns = now_ns() - t1;
    } else {
        tm.lookup_ns = now_ns() - t1;
        owner_ref *o;
        if ((st = owner_get(alloc, &o)) != VMM_OK) return st;
        CUmemGenericAllocationHandle handle = 0;
        CUmemAccessDesc acc[2];
        size_t n_acc;
        plan_access(alloc, here, acc, &n_acc, &use);
        chunk *fresh = calloc(1, sizeof *fresh);
        if (!fresh) st = set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
        if (alloc->flags & VMM_ALLOC_MULTI_HANDLE) {
            multi_parts parts;
            if (st == VMM_OK) st = multi_fetch(reg, alloc, &parts);
            if (st == VMM_OK) st = map_multi(&parts, (size_t)alloc->mapped_size, acc, n_acc, fresh);
        } else {
            if (st == VMM_OK) st = fetch_handle(reg, alloc, &handle);
            if (st == VMM_OK) st = map_chunk(handle, (size_t)alloc->mapped_size, acc, n_acc, fresh);
        }
        if (st != VMM_OK) {
            owner_put(o);
            if (fresh) chunk_free(fresh);
            return st;
        }
        fresh->key = k;
        fresh->ctx = ctx;
        fresh->refs = 1;
        fresh->owner = o;
        pthread_mutex_lock(&chunks_lock);
        c = chunk_ref_locked(&k);
        if (!c) {
            chunk **b = bucket_of(&k);
            fresh->next = *b;
            *b = fresh;
            o->chunks++;
            set_witness_locked(fresh, reg, alloc);
            c = fresh;
        }
        pthread_mutex_unlock(&chunks_lock);
        owner_put(o);
        if (c != fresh) { /* another thread mapped it meanwhile: use that mapping, drop ours */
            (void)unmap_chunk(fresh);
            chunk_free(fresh);
            if ((st = grant_device(c, alloc, here, &use)) != VMM_OK) {
                (void)chunk_unref(c);
                return st;
            }
        }
    }
    imp->c = c;
    imp->ptr = (uint64_t)c->base + alloc->chunk_offset;
    imp->device = (int)use;
    return VMM_OK;
}

/* Can vmm_import map this record's chunk?  Its reason when not. */
static vmm_status importable(vmm_registry *reg, const vmm_alloc_info *alloc)
{
    NEED(alloc->mapped_size != 0, "alloc->mapped_size is 0");
    uint64_t span = alloc->extent > alloc->requested_size ? alloc->extent : alloc->requested_size;
    NEED(alloc->chunk_offset < alloc->mapped_size && span <= alloc->mapped_size - alloc->chunk_offset,
         "the allocation does not lie inside its chunk (chunk_offset, extent, mapped_size)");
    if (alloc->flags & VMM_ALLOC_MULTI_HANDLE) {
        NEED(alloc->n_handles >= 2, "a multi-handle record with fewer than 2 handles (n_handles)");
        if (!(alloc->handle_kinds & VMM_KIND_BROKER))
            return set_err(VMM_ERR_ACCESS, "the allocation spans %u handles, which only its owner's broker hands out, "
                                           "and the record offers no broker",
                           alloc->n_handles);
    } else if (!(alloc->handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD))) {
        int unused;
        return fetch_fd(reg, alloc, &unused); /* its reason */
    }
    return VMM_OK;
}

vmm_status vmm__import(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported **out)
{
    uint64_t t0 = now_ns();
    memset(&tm, 0, sizeof tm);
    NEED(out, "out is NULL");
    *out = NULL;
    NEED(reg, "reg is NULL");
    NEED(alloc, "alloc is NULL");
    NEED(alloc->pid != 0, "alloc->pid is 0");
    vmm_status st = importable(reg, alloc);
    if (st != VMM_OK) return st;
    uint64_t span = alloc->extent > alloc->requested_size ? alloc->extent : alloc->requested_size;
    st = cuda_ready();
    if (st != VMM_OK) return st;
    vmm_imported *imp = calloc(1, sizeof *imp);
    if (!imp) return set_err(VMM_ERR_NOMEM, "vmm_import: out of memory");
    if ((st = import_chunk(reg, alloc, imp)) != VMM_OK) {
        free(imp);
        return st;
    }
    imp->requested_size = alloc->requested_size ? alloc->requested_size : span;
    imp->alloc = *alloc;
    *out = imp;
    tm.total_ns = now_ns() - t0;
    return VMM_OK;
}

vmm_status vmm__import_check(vmm_registry *reg, const vmm_imported *imp)
{
    NEED(reg, "reg is NULL");
    NEED(imp, "imp is NULL");
    NEED(!imp->range, "a range import: check the records of its range with vmm_find");
    vmm_status st = record_unchanged(reg, &imp->alloc);
    if (st == VMM_ERR_STALE && owner_liveness(&imp->alloc) == VMM__DEAD) return owner_dead(&imp->alloc);
    if (st != VMM_OK) return st;
    if (owner_exited(imp->c->owner) && !vmm__kept_now(reg, &imp->alloc)) return owner_dead(&imp->alloc);
    return VMM_OK;
}

vmm_status vmm__import_last_timing(vmm_import_timing *out)
{
    NEED(out, "out is NULL");
    *out = tm;
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
    multi_parts parts;   /* a MULTI-HANDLE record's handles instead (parts.n 0: one handle) */
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
    return x->chunk_id && x->chunk_id == y->chunk_id && x->mapped_size == y->mapped_size &&
           (x->flags & VMM_ALLOC_MULTI_HANDLE) == (y->flags & VMM_ALLOC_MULTI_HANDLE) && x->n_handles == y->n_handles;
}

/* The live records covering the range, each starting where the one before ends.  Registry reads
 * only: a gap or a record that cannot be imported fails here, before any owner is asked. */
static vmm_status range_walk(vmm_registry *reg, range_plan *p)
{
    for (uint64_t at = p->address; at < p->end;) {
        vmm_alloc_info a;
        vmm_status st = vmm__find(reg, p->pid, at, &a);
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
        /* a MULTI-HANDLE record's chunk may overlap its neighbour's: judged handle by handle once
         * their sizes are known (range_place) */
        bool multi = (p->rec[last ? last->last : i].flags | a->flags) & VMM_ALLOC_MULTI_HANDLE;
        if (last && !multi && (last->to != last->size || from != 0)) {
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
        vmm_status st = a->flags & VMM_ALLOC_MULTI_HANDLE ? multi_fetch(reg, a, &c->parts) : fetch_handle(reg, a, &c->handle);
        if (st != VMM_OK) {
            c->handle_of = SIZE_MAX; /* nothing to release */
            p->n_pc = k + 1;         /* the pieces after it have no handle either */
            return set_err(st, "importing pid %u's allocation at 0x%llx: %s", p->pid, (unsigned long long)a->address,
                           vmm__error_text());
        }
    }
    for (size_t k = 0; k < p->n_pc; k++)
        for (size_t i = p->pc[k].first; i <= p->pc[k].last; i++) {
            if (p->pc[k].handle_of == k && i == p->pc[k].first) continue; /* its owner checked it */
            vmm_status st = record_unchanged(reg, &p->rec[i]);
            if (st != VMM_OK)
                return set_err(st, "pid %u's allocation at 0x%llx: %s", p->pid,
                               (unsigned long long)p->rec[i].address, vmm__error_text());
        }
    return VMM_OK;
}

/* Drop the handles fetched: a mapping keeps its memory alive without them. */
static void range_release_handles(range_plan *p)
{
    for (size_t k = 0; k < p->n_pc; k++)
        if (p->pc[k].handle_of == k) {
            if (p->pc[k].parts.n)
                parts_release(&p->pc[k].parts, p->pc[k].parts.n);
            else
                (void)TWICE(cu.MemRelease(p->pc[k].handle));
        }
}

/* Unmap what was mapped (all of it, or what a failed import got to), free the reservation. */
static vmm_status range_unmap(range_map *m)
{
    CUcontext cur;
    bool switched = ctx_enter(m->ctx, &cur);
    vmm_status st = VMM_OK;
    CUresult r;
    /* one call per mapping: a driver need not unmap several mappings in one call; the range is
     * not freed under a mapping the driver kept */
    for (size_t k = 0; k < m->n; k++)
        if ((r = TWICE(cu.MemUnmap(m->base + m->map[k].at, m->map[k].len))) != CUDA_SUCCESS && st == VMM_OK)
            st = cu_fail("cuMemUnmap", r);
    if (m->size && st == VMM_OK && (r = TWICE(cu.MemAddressFree(m->base, m->size))) != CUDA_SUCCESS)
        st = cu_fail("cuMemAddressFree", r);
    if (switched) (void)TWICE(cu.CtxSetCurrent(cur));
    free(m);
    return st;
}

/* Reserve the range's address space and map every piece at its place, read-write for dev. */
/* One handle at its place in the owner: what a range maps. */
typedef struct placed {
    uint64_t at, size; /* the owner's address of the handle's first byte, its bytes */
    CUmemGenericAllocationHandle handle;
} placed;

/* Where each fetched handle lies in the owner, keeping those the range touches, in address
 * order.  A MULTI-HANDLE record's chunk names only its first handle, so the chunks of two
 * records may overlap (an allocation across segments 1 and 2 beside one across 2 and 3): a
 * handle at a place one is kept at already is that same segment (both records were live at
 * once), mapped once.  The kept handles must lie back to back over the whole range. */
static vmm_status range_place(const range_plan *p, placed **out, size_t *n_out)
{
    size_t cap = 0;
    for (size_t k = 0; k < p->n_pc; k++) {
        const multi_parts *mp = &p->pc[p->pc[k].handle_of].parts;
        cap += mp->n ? mp->n : 1;
    }
    placed *v = calloc(cap, sizeof *v);
    if (!v) return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    size_t n = 0;
    uint64_t have = 0; /* the owner's bytes up to here are placed */
    vmm_status st = VMM_OK;
    for (size_t k = 0; k < p->n_pc && st == VMM_OK; k++) {
        const piece *c = &p->pc[k];
        const multi_parts *mp = &p->pc[c->handle_of].parts;
        const vmm_alloc_info *a = &p->rec[c->first];
        uint64_t at = a->address - a->chunk_offset;
        for (uint32_t i = 0; i < (mp->n ? mp->n : 1) && st == VMM_OK; i++) {
            uint64_t size = mp->n ? mp->size[i] : c->size;
            placed h = {at, size, mp->n ? mp->h[i] : c->handle};
            at += size;
            if (h.at + h.size <= p->address || h.at >= p->end) continue;
            if (n && h.at < have) {
                bool same = false;
                for (size_t j = 0; j < n && !same; j++) same = v[j].at == h.at && v[j].size == h.size;
                if (!same)
                    st = set_err(VMM_ERR_STALE,
                                 "pid %u's handle of %llu bytes at 0x%llx overlaps another one that does not start "
                                 "there: its segments changed while the range was imported",
                                 p->pid, (unsigned long long)h.size, (unsigned long long)h.at);
                continue;
            }
            if ((n && h.at != have) || (!n && h.at > p->address)) {
                st = set_err(VMM_ERR_INVALID,
                             "at 0x%llx pid %u's handles do not lie back to back (the next one starts at 0x%llx), so "
                             "the range cannot be mapped as one",
                             (unsigned long long)(n ? have : p->address), p->pid, (unsigned long long)h.at);
                break;
            }
            v[n++] = h;
            have = h.at + h.size;
        }
    }
    if (st == VMM_OK && (!n || have < p->end))
        st = set_err(VMM_ERR_INVALID, "pid %u's handles cover the range 0x%llx..0x%llx only up to 0x%llx", p->pid,
                     (unsigned long long)p->address, (unsigned long long)p->end, (unsigned long long)have);
    if (st != VMM_OK) {
        free(v);
        return st;
    }
    *out = v;
    *n_out = n;
    return VMM_OK;
}

/* Reserve the range's address space and map every placed handle at its place, read-write for
 * the n devices of acc.  *ptr: where the range's first byte is. */
static vmm_status range_map_all(const range_plan *p, CUcontext ctx, const CUmemAccessDesc *acc, size_t n_acc,
                                range_map **out, uint64_t *ptr)
{
    placed *v = NULL;
    size_t n = 0;
    vmm_status st = range_place(p, &v, &n);
    if (st != VMM_OK) return st;
    range_map *m = malloc(sizeof *m + n * sizeof m->map[0]);
    if (!m) {
        free(v);
        return set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    }
    memset(m, 0, sizeof *m);
    m->ctx = ctx;
    size_t total = (size_t)(v[n - 1].at + v[n - 1].size - v[0].at);
    CUresult r = cu.MemAddressReserve(&m->base, total, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        free(m);
        free(v);
        return cu_fail("cuMemAddressReserve", r);
    }
    m->size = total;
    for (size_t k = 0; k < n; k++) {
        size_t at = (size_t)(v[k].at - v[0].at), len = (size_t)v[k].size;
        if ((r = cu.MemMap(m->base + at, len, 0, v[k].handle, 0)) != CUDA_SUCCESS) {
            (void)range_unmap(m);
            free(v);
            return cu_fail("cuMemMap", r);
        }
        m->map[m->n].at = at;
        m->map[m->n++].len = len;
    }
    *ptr = (uint64_t)m->base + (p->address - v[0].at);
    free(v);
    if ((r = cu.MemSetAccess(m->base, m->size, acc, n_acc)) != CUDA_SUCCESS) {
        (void)range_unmap(m);
        return cu_fail("cuMemSetAccess", r);
    }
    *out = m;
    return VMM_OK;
}

vmm_status vmm__import_range(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t length,
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
    here_device here = {0, true};
    CUmemAccessDesc acc[2];
    size_t n_acc = 0;
    CUdevice use = 0;
    if (st == VMM_OK) st = cuda_ready();
    if (st == VMM_OK) st = current_context(&ctx, &here);
    /* the range's records are one owner's, side by side: the first one's device stands for all */
    if (st == VMM_OK) plan_access(&p.rec[0], here, acc, &n_acc, &use);
    if (st == VMM_OK) st = range_layout(&p);
    vmm_imported *imp = NULL;
    if (st == VMM_OK && !(imp = calloc(1, sizeof *imp))) st = set_err(VMM_ERR_NOMEM, "vmm_import_range: out of memory");
    bool fetching = st == VMM_OK;
    if (fetching) st = range_fetch(reg, &p);
    range_map *m = NULL;
    uint64_t ptr = 0;
    if (st == VMM_OK) st = range_map_all(&p, ctx, acc, n_acc, &m, &ptr);
    if (fetching) range_release_handles(&p);
    if (st == VMM_OK) {
        imp->range = m;
        imp->ptr = ptr;
        imp->requested_size = length;
        imp->device = (int)use;
        *out = imp;
    } else {
        free(imp);
    }
    free(p.rec);
    free(p.pc);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Several ranges of one owner                                                                 */

/* One range of vmm_import_many that lies in one chunk (one record, or records the pool placed
 * side by side in it): a reference to the chunk table's mapping, so every range of the call in
 * that chunk shares one export, one import and one mapping (the first range maps it, the others
 * find it mapped and re-read their records).  *imp stays NULL, with VMM_OK, when the range is not
 * in one single-handle chunk (or one MULTI-HANDLE record): the caller maps it as a range. */
static vmm_status many_in_chunk(vmm_registry *reg, range_plan *p, vmm_imported **imp)
{
    *imp = NULL;
    vmm_status st = range_walk(reg, p);
    if (st != VMM_OK) return st;
    const vmm_alloc_info *a = &p->rec[0];
    if (p->n_rec > 1) {
        if ((st = range_layout(p)) != VMM_OK) return st;
        if (p->n_pc != 1 || (a->flags & VMM_ALLOC_MULTI_HANDLE)) return VMM_OK;
    }
    if ((st = importable(reg, a)) != VMM_OK) return st;
    vmm_imported *m = calloc(1, sizeof *m);
    if (!m) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    if ((st = import_chunk(reg, a, m)) != VMM_OK) {
        free(m);
        return st;
    }
    /* the chunk's owner (or the table) vouched for the first record only */
    for (size_t i = 1; i < p->n_rec && st == VMM_OK; i++) st = record_unchanged(reg, &p->rec[i]);
    if (st != VMM_OK) {
        (void)chunk_unref(m->c);
        free(m);
        return st;
    }
    m->ptr += p->address - a->address;
    m->requested_size = p->end - p->address;
    m->alloc = *a;
    *imp = m;
    return VMM_OK;
}

vmm_status vmm__import_many(vmm_registry *reg, uint32_t pid, const uint64_t *addresses,
                                      const uint64_t *sizes, size_t n, vmm_imported **out)
{
    memset(&tm, 0, sizeof tm);
    NEED(out || n == 0, "out is NULL");
    for (size_t i = 0; i < n; i++) out[i] = NULL;
    NEED(reg, "reg is NULL");
    NEED(pid != 0, "pid is 0");
    NEED(addresses || n == 0, "addresses is NULL");
    vmm_status st = n ? cuda_ready() : VMM_OK;
    uint64_t start_time = 0, pidns = 0;
    size_t i = 0;
    for (; i < n && st == VMM_OK; i++) {
        uint64_t address = addresses[i], size = sizes ? sizes[i] : 0;
        range_plan p = {.pid = pid, .address = address};
        vmm_alloc_info a;
        if (size == 0) { /* the whole allocation holding address, as vmm_import maps it */
            if ((st = vmm__find(reg, pid, address, &a)) != VMM_OK) break;
            p.address = address = a.address;
            size = a.requested_size ? a.requested_size : a.extent;
        } else if (address > UINT64_MAX - size) {
            st = set_err(VMM_ERR_INVALID, "the range runs past the end of the address space");
            break;
        }
        p.end = address + size;
        vmm_imported *imp = NULL;
        st = many_in_chunk(reg, &p, &imp);
        if (st == VMM_OK) {
            /* every range must be of the one owner the first is of (a pid may have been reused) */
            if (i == 0) {
                start_time = p.rec[0].owner_start_time;
                pidns = p.rec[0].owner_pidns;
            } else if (p.rec[0].owner_start_time != start_time || p.rec[0].owner_pidns != pidns) {
                st = set_err(VMM_ERR_NOT_FOUND,
                             "the allocation at 0x%llx belongs to another process with pid %u than the first "
                             "range's (an exited one's records stay until vmmctl gc)",
                             (unsigned long long)address, pid);
            }
        }
        if (st == VMM_OK && !imp) st = vmm__import_range(reg, pid, address, size, &imp);
        free(p.rec);
        free(p.pc);
        if (st != VMM_OK) {
            if (imp) (void)vmm__import_release(imp);
            break;
        }
        out[i] = imp;
    }
    if (st == VMM_OK) return VMM_OK;
    size_t failed = i; /* the loop stopped at the failing range */
    char why[512];
    snprintf(why, sizeof why, "%s", vmm__error_text());
    while (i-- > 0) {
        (void)vmm__import_release(out[i]);
        out[i] = NULL;
    }
    return set_err(st, "vmm_import_many: range %zu of %zu (pid %u, 0x%llx, %llu bytes): %s; nothing imported",
                   failed, n, pid, (unsigned long long)addresses[failed],
                   (unsigned long long)(sizes ? sizes[failed] : 0), why);
}

uint64_t vmm__import_ptr(const vmm_imported *imp) { return imp ? imp->ptr : 0; }

uint64_t vmm__import_size(const vmm_imported *imp) { return imp ? imp->requested_size : 0; }

int vmm__import_device(const vmm_imported *imp) { return imp ? imp->device : -1; }

vmm_status vmm__import_release(vmm_imported *imp)
{
    if (!imp) return VMM_OK;
    vmm_status st = imp->range ? range_unmap(imp->range) : chunk_unref(imp->c);
    free(imp);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Every handle's fd (vmm_import_fds)                                                           */

/* A MULTI-HANDLE record's handles as fds, asked of its owner's broker as multi_fetch asks (v2,
 * up to 64 a reply), not imported: for a companion that keeps or maps them itself (vmmctl keep). */
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
        vmm_status st = fetch_fd(reg, a, &fds[0]);
        if (st != VMM_OK) return st;
        sizes[0] = a->mapped_size;
        *n = 1;
        return VMM_OK;
    }
    if (want < 2 || !(a->handle_kinds & VMM_KIND_BROKER))
        return set_err(VMM_ERR_INVALID, "a multi-handle record with %u handles and no broker", want);
    owner_ref *o;
    vmm_status st = owner_get(a, &o);
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
        int got[VMM_BROKER_MAX_FDS];
        v2_recv r = {.rep = &rep, .fds = got};
        pthread_mutex_lock(&o->io);
        int rc = broker_roundtrip(reg, a, o, &req, sizeof req, recv_v2, &r, &st);
        pthread_mutex_unlock(&o->io);
        if (st != VMM_OK) break;
        if (rc) {
            st = exchange_failed(a, rc);
            break;
        }
        if (rep.status == -ERANGE)
            st = set_err(VMM_ERR_STALE, "owner pid %u's allocation no longer has the %u handles its record says", a->pid,
                         want);
        else if (rep.status != 0)
            st = reply_failed(a, rep.status);
        else if (rep.n_total != want || rep.n_here == 0 || rep.n_here != r.n_fds || rep.n_here > want - have)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u fds of %u handles from handle %u; the record says %u",
                         a->pid, r.n_fds, rep.n_total, have, want);
        for (uint32_t i = 0; i < r.n_fds; i++) {
            if (st == VMM_OK && (rep.sizes[i] == 0 || rep.sizes[i] > a->mapped_size - bytes))
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent handles of more bytes than the record's %llu",
                             a->pid, (unsigned long long)a->mapped_size);
            if (st == VMM_OK) {
                fds[have] = got[i];
                sizes[have++] = rep.sizes[i];
                bytes += rep.sizes[i];
            } else {
                close(got[i]);
            }
        }
    }
    owner_put(o);
    if (st == VMM_OK && bytes != a->mapped_size)
        st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u handles of %llu bytes; the record says %llu", a->pid,
                     have, (unsigned long long)bytes, (unsigned long long)a->mapped_size);
    if (st != VMM_OK) {
        while (have) close(fds[--have]);
        return st;
    }
    *n = have;
    return VMM_OK;
}
