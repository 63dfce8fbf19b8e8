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
        {"vmm__import_many_last_timing", "vmm_import_many_last_timing"},
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

int vmm__driver_load(const vmm__driver_sym *syms, size_t n, void *table, size_t size, char *err, size_t errlen)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(err, errlen, "libcuda.so.1 not found: %s", e ? e : "dlopen failed");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        void *p = dlsym(h, syms[i].name);
        if (!p && !syms[i].optional) {
            snprintf(err, errlen, "libcuda.so.1 lacks %s (driver too old?)", syms[i].name);
            memset(table, 0, size);
            return -1; /* the handle stays open: harmless, and dlclose of a driver is not */
        }
        memcpy(syms[i].slot, &p, sizeof p);
    }
    return 0;
}

/* The exported ABI names: none of these is renamed to a _v2 by cuda.h at CUDA 13 (the macros in
 * cuda.h only cover e.g. cuDevicePrimaryCtxRelease_v2 and cuMemcpyDtoH_v2, not used here). */
static void cuda_load(void)
{
    const vmm__driver_sym syms[] = {
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
    (void)vmm__driver_load(syms, sizeof syms / sizeof syms[0], &cu, sizeof cu, cu_error, sizeof cu_error);
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
    bool no_repeats;      /* its broker predates VMM_BROKER_REQ3_REPEATS (under io) */
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
    uint32_t n, n_imported;
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
 * reply, asking again from where the last reply ended), handed to take() a reply at a time, in
 * order: take owns the fds it is given (closes or keeps each, also when it fails).  The broker
 * checks the allocation anew on each request, so one freed midway fails as stale, never mixes
 * handles. */
typedef vmm_status (*handles_fn)(void *ctx, const int *fds, const uint64_t *sizes, uint32_t n, uint32_t first);

static vmm_status fetch_handles(vmm_registry *reg, const vmm_alloc_info *a, uint32_t want, handles_fn take, void *ctx)
{
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
                         a->pid, want);
        else if (rep.status == -ERANGE)
            st = set_err(VMM_ERR_STALE, "owner pid %u's allocation no longer has the %u handles its record says "
                                        "(no handle %u)", a->pid, want, have);
        else if (rep.status != 0)
            st = reply_failed(a, rep.status);
        else if (rep.n_total != want)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker says the allocation has %u handles; the record says %u",
                         a->pid, rep.n_total, want);
        else if (rep.n_here == 0 || rep.n_here != r.n_fds || rep.n_here > want - have)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u fds for %u handles from handle %u of %u", a->pid,
                         r.n_fds, rep.n_here, have, want);
        tm.export_ns += rep.export_ns;
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
    owner_put(o);
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
            uint64_t t0 = now_ns();
            CUresult cr = cu.MemImportFromShareableHandle(&p->h[first + i], (void *)(uintptr_t)fds[i],
                                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            tm.import_ns += now_ns() - t0;
            if (cr != CUDA_SUCCESS) st = cu_fail("cuMemImportFromShareableHandle", cr);
            else p->size[p->n_imported++] = sizes[i];
        }
        close(fds[i]);
    }
    return st;
}

/* Every handle of a MULTI-HANDLE allocation, each imported. */
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
    vmm_status st = fetch_handles(reg, a, p->n, import_handles, p);
    if (st != VMM_OK) parts_release(p, p->n_imported);
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

/* One reservation that several mappings share: vmm_import_many maps every chunk and range it
 * makes into one (one cuMemAddressReserve, one cuMemSetAccess over the lot), and each of them
 * unmaps its own part when it goes.  The driver frees an address range only whole, so the
 * reservation goes with the last part (refs: the parts still mapped in it). */
typedef struct slab {
    CUdeviceptr base;
    size_t size;
    unsigned long refs;
    /* A segment of the owner that several parts reach (a stream-ordered pool's segment under the
     * end of one allocation and the start of the next) is mapped once, where both parts lie: its
     * counter says how many parts still use that mapping, and the last one unmaps it. */
    unsigned long *shared_refs;
} slab;

/* One part of s is unmapped: the last one frees the reservation (in the context current, which
 * the caller made the one it was mapped in).  A part the driver kept mapped never calls this, so
 * the range stays reserved under it. */
static vmm_status slab_put(slab *s)
{
    if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) != 0) return VMM_OK;
    CUresult r = TWICE(cu.MemAddressFree(s->base, s->size));
    free(s->shared_refs);
    free(s);
    return r == CUDA_SUCCESS ? VMM_OK : cu_fail("cuMemAddressFree", r);
}

/* A mapping in s goes from one of the parts using it: true when that part was its last user, so
 * the caller unmaps it.  shared: 0 for a mapping of that part alone, else 1 + its counter. */
static bool mapping_last(slab *s, const uint32_t *shared, size_t i)
{
    return !s || !shared || !shared[i] || __atomic_sub_fetch(&s->shared_refs[shared[i] - 1], 1, __ATOMIC_ACQ_REL) == 0;
}

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
    slab *slab;         /* mapped by vmm_import_many: its place in that call's reservation */
    uint32_t *shared;   /* with slab: each part's mapping_last counter (NULL: none shared) */
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
            if (mapping_last(c->slab, c->shared, i) &&
                (r = TWICE(cu.MemUnmap(c->base + at, c->part_len[i]))) != CUDA_SUCCESS && st == VMM_OK)
                st = cu_fail("cuMemUnmap", r);
        if (st == VMM_OK && c->slab)
            st = slab_put(c->slab);
        else if (st == VMM_OK && (r = TWICE(cu.MemAddressFree(c->base, c->size))) != CUDA_SUCCESS)
            st = cu_fail("cuMemAddressFree", r);
    }
    if (switched) (void)TWICE(cu.CtxSetCurrent(cur)); /* else the thread stays in ctx */
    return st;
}

static void chunk_free(chunk *c)
{
    free(c->part_len);
    free(c->shared);
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

/* Sweeps whose unmaps run outside chunks_lock now: vmm_import_drop_idle waits for them, so that
 * an idle mapping the reaper took a moment before is gone too when it returns.  The count belongs
 * to the process that swept: a child forked meanwhile inherits it without the threads that would
 * bring it down, so there it starts again from 0. */
static pthread_cond_t reaped = PTHREAD_COND_INITIALIZER;
static unsigned long reaping;
static pid_t reaping_pid;

/* Lock held: this process's sweeps in flight. */
static unsigned long *reaping_here_locked(void)
{
    pid_t me = getpid();
    if (reaping_pid != me) {
        reaping_pid = me;
        reaping = 0;
    }
    return &reaping;
}

/* Lock held, after a sweep into these lists: their unmaps begin. */
static void reap_begin_locked(const chunk *dead_chunks, const owner_ref *dead_owners)
{
    if (dead_chunks || dead_owners) (*reaping_here_locked())++;
}

static vmm_status reap(chunk *dead_chunks, owner_ref *dead_owners)
{
    if (!dead_chunks && !dead_owners) return VMM_OK;
    vmm_status st = unmap_list(dead_chunks);
    while (dead_owners) {
        owner_ref *o = dead_owners;
        dead_owners = o->next;
        owner_free(o);
    }
    pthread_mutex_lock(&chunks_lock);
    unsigned long *n = reaping_here_locked();
    if (*n && --*n == 0) pthread_cond_broadcast(&reaped);
    pthread_mutex_unlock(&chunks_lock);
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
        reap_begin_locked(dead_chunks, dead_owners);
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
    reap_begin_locked(dead_chunks, dead_owners);
    pthread_mutex_unlock(&chunks_lock);
    vmm_status st = reap(dead_chunks, dead_owners);
    pthread_mutex_lock(&chunks_lock);
    while (*reaping_here_locked()) pthread_cond_wait(&reaped, &chunks_lock);
    pthread_mutex_unlock(&chunks_lock);
    return st;
}

void vmm__import_forget_registry(vmm_registry *reg)
{
    chunk *dead_chunks = NULL;
    owner_ref *dead_owners = NULL;
    pthread_mutex_lock(&chunks_lock);
    sweep_locked(false, reg, &dead_chunks, &dead_owners);
    reap_begin_locked(dead_chunks, dead_owners);
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
    vmm_alloc_info *recs;    /* a range's records, as walked (vmm_import_records); NULL: alloc alone */
    size_t n_recs;
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
    slab *slab;    /* vmm_import_many's: [base, base + size) is its part of that reservation */
    uint32_t *shared; /* with slab: each mapping's mapping_last counter (NULL: none shared) */
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
    vmm__liveness_cache *live; /* the owner's liveness, judged once for the call (NULL: each lookup) */
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
        vmm_status st = p->live ? vmm__find_cached_near(reg, p->pid, at, p->end - at, &a, p->live)
                                : vmm__find(reg, p->pid, at, &a);
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
        /* each record after the first begins where the one before ends: one that begins inside it
         * was read at another moment (an allocation freed and its place reused during the walk) */
        if (p->n_rec && a.address != at)
            return set_err(VMM_ERR_STALE,
                           "pid %u's allocations changed while the range was read: the one holding 0x%llx begins at "
                           "0x%llx, inside the one before it (freed and its place reused meanwhile)",
                           p->pid, (unsigned long long)at, (unsigned long long)a.address);
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
        if (mapping_last(m->slab, m->shared, k) &&
            (r = TWICE(cu.MemUnmap(m->base + m->map[k].at, m->map[k].len))) != CUDA_SUCCESS && st == VMM_OK)
            st = cu_fail("cuMemUnmap", r);
    if (m->size && st == VMM_OK && m->slab)
        st = slab_put(m->slab);
    else if (m->size && st == VMM_OK && (r = TWICE(cu.MemAddressFree(m->base, m->size))) != CUDA_SUCCESS)
        st = cu_fail("cuMemAddressFree", r);
    if (switched) (void)TWICE(cu.CtxSetCurrent(cur));
    free(m->shared);
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
    vmm__liveness_cache live = {0};
    range_plan p = {.live = &live, .pid = pid, .address = address, .end = address + length};
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
        imp->alloc = p.rec[0];
        imp->recs = p.rec; /* vmm_import_records */
        imp->n_recs = p.n_rec;
        p.rec = NULL;
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

/* vmm_import_many in four steps, each done once for the whole call rather than once per range:
 *   1. find: the records under every range (registry reads only; a range that cannot be
 *      imported fails here, before the owner is asked), and which ranges lie in a chunk mapped
 *      here already (a reference, nothing fetched);
 *   2. fetch: every handle the other ranges need, each asked for once ("units"), in one broker
 *      round trip (protocol v3, fds streamed 64 a message), each imported as it arrives, by
 *      VMMSHIM_IMPORT_THREADS threads;
 *   3. map: one reservation for everything new, each chunk and each range across chunks at a
 *      place of its own in it ("consumers", laid out back to back, grouped by the devices they
 *      are granted to), every handle mapped where it is needed, one cuMemSetAccess per group;
 *   4. hand out: new chunks enter the chunk table (shared with vmm_import), ranges across chunks
 *      become range imports, and the imported handles are released (the mappings keep them).
 * cuMemSetAccess and cuMemImportFromShareableHandle are an import's dear steps on a GPU (~46 and
 * ~35 us a call on an H100): one SetAccess for all, and imports that may overlap the transfer. */

/* The calling thread's last vmm_import_many, step by step (vmm_import_many_last_timing). */
static _Thread_local vmm_import_many_timing mt;

vmm_status vmm__import_many_last_timing(vmm_import_many_timing *out)
{
    NEED(out, "out is NULL");
    *out = mt;
    return VMM_OK;
}

#define MAX_IMPORT_THREADS 16

/* VMMSHIM_IMPORT_THREADS, read at each call (so a benchmark may compare settings in one process). */
static vmm_status import_threads(uint32_t *out)
{
    const char *e = getenv("VMMSHIM_IMPORT_THREADS");
    *out = 1;
    if (!e || !*e) return VMM_OK;
    char *end;
    errno = 0;
    long v = strtol(e, &end, 10);
    if (errno || *end || v < 1 || v > MAX_IMPORT_THREADS)
        return set_err(VMM_ERR_INVALID, "vmm_import_many: VMMSHIM_IMPORT_THREADS='%s' is not a number from 1 to %d", e,
                       MAX_IMPORT_THREADS);
    *out = (uint32_t)v;
    return VMM_OK;
}

/* Run fn(arg) on n - 1 new threads and the calling thread, and wait for all (no signals on the
 * new ones: they are the application's).  Threads that cannot start leave their share to the
 * others (fn takes work until none is left). */
static void crew_run(uint32_t n, void *(*fn)(void *), void *arg)
{
    pthread_t th[MAX_IMPORT_THREADS];
    uint32_t started = 0;
    if (n > 1) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (uint32_t i = 1; i < n && i < MAX_IMPORT_THREADS; i++)
            if (pthread_create(&th[started], NULL, fn, arg) == 0) started++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    (void)fn(arg);
    for (uint32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
}

/* What the call fetches from the owner: one allocation's handles (a single-handle chunk, or every
 * handle of a MULTI-HANDLE record).  Every chunk and range needing the same handles shares one
 * unit: asked for once, each handle imported once and mapped wherever it is needed, released once
 * all is mapped. */
typedef struct unit {
    vmm_alloc_info a;    /* the record the owner is asked about */
    uint32_t n;          /* its handles */
    uint32_t got;        /* handles received so far, in order */
    uint64_t bytes;      /* their bytes */
    CUmemGenericAllocationHandle *h;
    uint64_t *size;
    uint8_t *ok;         /* h[i] is imported (threads import them in any order) */
    uint64_t *alias;     /* 0, or 1 + (unit << 32 | handle) of the same segment brought earlier: h[i] is that
                            one's import (not released here) */
} unit;

/* Records whose handles are the same: a pooled chunk by its id (as same_chunk), a MULTI-HANDLE
 * record or one without a chunk id by itself. */
static bool same_record(const vmm_alloc_info *x, const vmm_alloc_info *y)
{
    return x->slot == y->slot && x->generation == y->generation && memcmp(x->alloc_id, y->alloc_id, 16) == 0;
}

static bool same_unit(const vmm_alloc_info *x, const vmm_alloc_info *y)
{
    if ((x->flags | y->flags) & VMM_ALLOC_MULTI_HANDLE) return same_record(x, y);
    return same_chunk(x, y) || same_record(x, y);
}

static uint64_t unit_hash(const vmm_alloc_info *a)
{
    if (a->chunk_id && !(a->flags & VMM_ALLOC_MULTI_HANDLE)) return a->chunk_id * 0x9e3779b97f4a7c15ull ^ a->mapped_size;
    return (a->slot + 1) * 0xbf58476d1ce4e5b9ull ^ a->generation;
}

/* An open-addressed index of small integers (stored + 1), sized for n entries: the call may name
 * thousands of chunks, and a list searched for each would cost the square of that. */
typedef struct ix {
    uint32_t *slot;
    size_t mask;
} ix;

static bool ix_init(ix *t, size_t n)
{
    size_t cap = 16;
    while (cap < 2 * n + 2) cap <<= 1;
    t->slot = calloc(cap, sizeof *t->slot);
    t->mask = cap - 1;
    return t->slot != NULL;
}

typedef struct many_range {
    range_plan p;        /* the records under it; for a range across chunks, its pieces too */
    bool across;         /* across chunks: a mapping of its own */
    chunk *c;            /* inside one chunk: that chunk (one reference of this range's) */
    uint32_t fresh;      /* inside one chunk not mapped here before: 1 + its index in new chunks */
    uint32_t consumer;   /* across: its place in the reservation */
    uint32_t *unit_of;   /* across: each piece's unit */
    CUdevice use;
} many_range;

typedef struct new_chunk {
    chunk_key key;
    vmm_alloc_info a;    /* the first range's first record: its witness */
    uint32_t unit;
    uint32_t users;      /* ranges in it */
    uint32_t consumer;
    chunk *c;            /* the chunk table's entry, once made */
} new_chunk;

/* Something new mapped into the call's reservation: a new chunk (whole) or a range across chunks
 * (its handles at their places, as in the owner). */
typedef struct consumer {
    uint64_t at, size;   /* its place in the reservation */
    uint64_t group;      /* the devices it is granted to (those laid out together get one SetAccess) */
    CUmemAccessDesc acc[2];
    size_t n_acc;
    CUdevice use;
    placed *v;           /* the handles mapped, at the owner's addresses (v[0] at `at`) */
    size_t nv;
    uint32_t *shared;    /* each handle's mapping_last counter, 0: mapped for this consumer alone */
    bool is_range;
    uint32_t index;      /* into new chunks or ranges */
} consumer;

typedef struct map_op {
    CUdeviceptr va;
    size_t len;
    CUmemGenericAllocationHandle h;
    bool done;
} map_op;

/* Everything one call holds, so that a failure anywhere undoes it all in one place. */
typedef struct many {
    vmm_registry *reg;
    vmm__liveness_cache live;
    uint32_t pid, threads;
    CUcontext ctx;
    here_device here;
    owner_ref *owner;
    many_range *r;
    size_t n;
    unit *u;
    size_t n_units, cap_units, n_handles;
    ix units_ix, chunks_ix;
    new_chunk *nc;
    size_t n_nc, cap_nc;
    consumer *cs;
    size_t n_cs;
    slab *s;
    map_op *ops;
    size_t n_ops;
    /* the fetch's hand-over to importing threads, and the first failure of any thread */
    pthread_mutex_t lock;
    pthread_cond_t cv;
    struct job {
        int fd;
        uint32_t unit, handle;
    } *q;
    size_t q_len, q_next;
    bool q_closed;
    size_t op_next;
    /* every handle the stream brought, by the owner's address and size of its segment */
    struct seg_seen {
        uint64_t at, size; /* size 0: an empty slot */
        uint32_t unit, handle;
    } *segs;
    size_t segs_mask;
    vmm_status st;
    char why[400];
    uint64_t import_ns, map_ns; /* summed over the threads (mt is each thread's own) */
    size_t fail_range;   /* the range a failure after the find concerns, n when none */
    size_t fail_unit;    /* the unit a fetch failure concerns, SIZE_MAX when none */
} many;

/* Record a failure found on any thread (its reason is that thread's vmm__error_text); the first stands. */
static void many_fail(many *m, vmm_status st)
{
    pthread_mutex_lock(&m->lock);
    if (m->st == VMM_OK) {
        m->st = st;
        snprintf(m->why, sizeof m->why, "%s", vmm__error_text());
    }
    pthread_mutex_unlock(&m->lock);
}

static bool many_failed(many *m)
{
    pthread_mutex_lock(&m->lock);
    bool f = m->st != VMM_OK;
    pthread_mutex_unlock(&m->lock);
    return f;
}

/* The unit for record a (made when new); its index, or -1 out of memory. */
static long unit_of(many *m, const vmm_alloc_info *a)
{
    for (size_t h = unit_hash(a) & m->units_ix.mask;; h = (h + 1) & m->units_ix.mask) {
        uint32_t k = m->units_ix.slot[h];
        if (!k) {
            unit *more = grow(m->u, &m->cap_units, m->n_units, sizeof *m->u);
            if (!more) return -1;
            m->u = more;
            unit *u = &m->u[m->n_units];
            memset(u, 0, sizeof *u);
            u->a = *a;
            u->n = (a->flags & VMM_ALLOC_MULTI_HANDLE) ? a->n_handles : 1;
            u->h = calloc(u->n, sizeof *u->h);
            u->size = calloc(u->n, sizeof *u->size);
            u->ok = calloc(u->n, 1);
            u->alias = calloc(u->n, sizeof *u->alias);
            if (!u->h || !u->size || !u->ok || !u->alias) {
                free(u->h);
                free(u->size);
                free(u->ok);
                free(u->alias);
                return -1;
            }
            m->n_handles += u->n;
            m->units_ix.slot[h] = (uint32_t)++m->n_units;
            return (long)m->n_units - 1;
        }
        if (same_unit(&m->u[k - 1].a, a)) return (long)k - 1;
    }
}

/* The new chunk of key k (made when new, for record a); its index, or -1 out of memory. */
static long new_chunk_of(many *m, const chunk_key *k, const vmm_alloc_info *a)
{
    uint64_t hash = vmm_reg_hash(k->pid, k->id ^ (k->generation * 0x9e3779b97f4a7c15ull) ^ (k->mapped_size << 1) ^
                                             k->by_slot);
    for (size_t h = hash & m->chunks_ix.mask;; h = (h + 1) & m->chunks_ix.mask) {
        uint32_t i = m->chunks_ix.slot[h];
        if (!i) {
            new_chunk *more = grow(m->nc, &m->cap_nc, m->n_nc, sizeof *m->nc);
            if (!more) return -1;
            m->nc = more;
            new_chunk *c = &m->nc[m->n_nc];
            memset(c, 0, sizeof *c);
            c->key = *k;
            c->a = *a;
            long u = unit_of(m, a);
            if (u < 0) return -1;
            c->unit = (uint32_t)u;
            m->chunks_ix.slot[h] = (uint32_t)++m->n_nc;
            return (long)m->n_nc - 1;
        }
        if (same_key(&m->nc[i - 1].key, k)) return (long)i - 1;
    }
}

/* ---- 1. find ---- */

/* Range i's records, and whether it lies in one chunk; NOT_FOUND and the like as vmm_import_range. */
static vmm_status many_find(many *m, size_t i, uint64_t address, uint64_t size)
{
    many_range *r = &m->r[i];
    r->p.pid = m->pid;
    r->p.address = address;
    r->p.live = &m->live;
    if (size == 0) { /* the whole allocation holding address, as vmm_import maps it */
        vmm_alloc_info a;
        vmm_status st = vmm__find_cached(m->reg, m->pid, address, &a, &m->live);
        if (st != VMM_OK) return st;
        r->p.address = a.address;
        size = a.requested_size ? a.requested_size : a.extent;
    } else if (address > UINT64_MAX - size) {
        return set_err(VMM_ERR_INVALID, "the range runs past the end of the address space");
    }
    r->p.end = r->p.address + size;
    vmm_status st = range_walk(m->reg, &r->p);
    if (st != VMM_OK) return st;
    const vmm_alloc_info *a = &r->p.rec[0], *first = &m->r[0].p.rec[0];
    /* every range must be of the one owner the first is of (a pid may have been reused) */
    if (i > 0 && (a->owner_start_time != first->owner_start_time || a->owner_pidns != first->owner_pidns))
        return set_err(VMM_ERR_NOT_FOUND,
                       "the allocation at 0x%llx belongs to another process with pid %u than the first range's (an "
                       "exited one's records stay until vmmctl gc)",
                       (unsigned long long)r->p.address, m->pid);
    if (r->p.n_rec > 1) {
        if ((st = range_layout(&r->p)) != VMM_OK) return st;
        if (r->p.n_pc != 1 || (a->flags & VMM_ALLOC_MULTI_HANDLE)) {
            r->across = true;
            return VMM_OK;
        }
    }
    return importable(m->reg, a);
}

/* Each range inside one chunk: a reference to the chunk when it is mapped here, else its new
 * chunk; each range across chunks: the units of its pieces. */
static vmm_status many_sort(many *m)
{
    for (size_t i = 0; i < m->n; i++) {
        many_range *r = &m->r[i];
        if (r->across) {
            r->unit_of = calloc(r->p.n_pc, sizeof *r->unit_of);
            if (!r->unit_of) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
            for (size_t k = 0; k < r->p.n_pc; k++) {
                long u = unit_of(m, &r->p.rec[r->p.pc[k].first]);
                if (u < 0) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
                r->unit_of[k] = (uint32_t)u;
            }
            continue;
        }
        chunk_key k = key_of(&r->p.rec[0]);
        pthread_mutex_lock(&chunks_lock);
        r->c = chunk_ref_locked(&k);
        pthread_mutex_unlock(&chunks_lock);
        if (r->c) {
            mt.chunks_cached++;
            continue;
        }
        long c = new_chunk_of(m, &k, &r->p.rec[0]);
        if (c < 0) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
        r->fresh = (uint32_t)c + 1;
        m->nc[c].users++;
    }
    return VMM_OK;
}

/* ---- 2. fetch ---- */

static void import_handle(many *m, uint32_t ui, uint32_t hi, int fd)
{
    unit *u = &m->u[ui];
    uint64_t t0 = now_ns();
    CUresult r = cu.MemImportFromShareableHandle(&u->h[hi], (void *)(uintptr_t)fd,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    __atomic_add_fetch(&m->import_ns, now_ns() - t0, __ATOMIC_RELAXED); /* mt is the calling thread's */
    close(fd); /* the driver keeps its own reference */
    if (r == CUDA_SUCCESS)
        __atomic_store_n(&u->ok[hi], 1, __ATOMIC_RELEASE);
    else
        many_fail(m, cu_fail("cuMemImportFromShareableHandle", r));
}

/* An importing thread: takes the fds the receiving thread queues until it closes the queue. */
static void *import_worker(void *arg)
{
    many *m = arg;
    CUcontext cur = NULL;
    bool set = cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != m->ctx && cu.CtxSetCurrent(m->ctx) == CUDA_SUCCESS;
    for (;;) {
        pthread_mutex_lock(&m->lock);
        while (m->q_next == m->q_len && !m->q_closed) pthread_cond_wait(&m->cv, &m->lock);
        if (m->q_next == m->q_len) {
            pthread_mutex_unlock(&m->lock);
            break;
        }
        struct job j = m->q[m->q_next++];
        bool failed = m->st != VMM_OK;
        pthread_mutex_unlock(&m->lock);
        if (failed)
            close(j.fd);
        else
            import_handle(m, j.unit, j.handle, j.fd);
    }
    if (set) (void)cu.CtxSetCurrent(cur);
    return NULL;
}

/* The receiving thread: with no other threads, import at once; else queue it. */
static void hand_over(many *m, uint32_t ui, uint32_t hi, int fd)
{
    if (m->threads <= 1) {
        import_handle(m, ui, hi, fd);
        return;
    }
    pthread_mutex_lock(&m->lock);
    m->q[m->q_len++] = (struct job){fd, ui, hi};
    pthread_cond_signal(&m->cv);
    pthread_mutex_unlock(&m->lock);
}

/* The stream's handles are the owner's segments, and a segment may come more than once: in a
 * stream-ordered pool one segment holds the end of one MULTI-HANDLE allocation and the start of
 * the next, and each unit brings all of its handles.  Imports and access grants cost the same per
 * handle whatever its size (~26 and ~29 us on an H200 for another process's handle), so a segment
 * is imported once and only mapped again.  Two records of the call that were live together and
 * reach the same address with a handle of the same size reach the same segment: an address holds
 * one mapping at a time, and neither record could have outlived it (many_verify re-reads every
 * record after the fetch).  True, with *alias set, when (at, size) came before for another unit. */
static bool seen_before(many *m, uint64_t at, uint64_t size, uint32_t ui, uint32_t hi, uint64_t *alias)
{
    if (!m->segs) return false;
    for (size_t i = vmm_reg_hash((uint32_t)(at >> 21), at ^ size) & m->segs_mask;; i = (i + 1) & m->segs_mask) {
        struct seg_seen *e = &m->segs[i];
        if (!e->size) {
            *e = (struct seg_seen){at, size, ui, hi};
            return false;
        }
        if (e->at == at && e->size == size && e->unit != ui) {
            *alias = 1 + ((uint64_t)e->unit << 32 | e->handle);
            return true;
        }
        if (e->at == at && e->size == size) return false;
    }
}

/* One reply of a v3 stream for the units list[0 .. count) of this request; *done at its last. */
typedef struct stream {
    const uint32_t *list;
    uint32_t count, at, seq;
    bool done, fallback;
    bool repeats;         /* asked with VMM_BROKER_REQ3_REPEATS */
    bool ask_plain;       /* refused that flag: a broker older than it */
} stream;

static vmm_status take_reply(many *m, stream *sm, const vmm_broker_reply3 *rep, size_t len, int *fds, uint32_t nf)
{
    const vmm_alloc_info *a0 = &m->u[sm->list[0]].a;
    vmm_status st = VMM_OK;
    if (len == sizeof(vmm_broker_reply) && rep->status != 0 && sm->seq == 0) {
        /* the v1 form: a request this broker could not read (older than v3), or a refused peer */
        if (rep->status == -EPROTO) {
            sm->fallback = true;
            return VMM_OK;
        }
        return reply_failed(a0, rep->status);
    }
    uint32_t passed = 0; /* fds[] entries that come with an fd */
    for (uint32_t k = 0; len == sizeof *rep && k < rep->n_here && k < VMM_BROKER_MAX_FDS; k++)
        passed += !(sm->repeats && (rep->fds[k].device & VMM_BROKER_FD3_REPEAT));
    if (len != sizeof *rep || rep->version != VMM_BROKER_VERSION3 || rep->seq != sm->seq || passed != nf ||
        rep->n_here > VMM_BROKER_MAX_FDS)
        return set_err(VMM_ERR_IO, "owner pid %u's broker sent a malformed reply (message %u of a batch)", m->pid,
                       sm->seq);
    sm->seq++;
    mt.export_ns += rep->export_ns;
    if (rep->status == -EINVAL && sm->repeats && rep->entry == sm->count && sm->seq == 1 &&
        (rep->flags & VMM_BROKER_REPLY_LAST)) {
        sm->ask_plain = true; /* a broker that predates the flag refuses the whole request */
        return VMM_OK;
    }
    if (rep->status != 0) {
        if (rep->entry >= sm->count) return reply_failed(a0, rep->status);
        m->fail_unit = sm->list[rep->entry];
        unit *u = &m->u[sm->list[rep->entry]];
        if (rep->status == -ERANGE)
            return set_err(VMM_ERR_STALE, "owner pid %u's allocation at 0x%llx no longer has the %u handles its record "
                                          "says",
                           m->pid, (unsigned long long)u->a.address, u->n);
        st = reply_failed(&u->a, rep->status);
        return set_err(st, "the allocation at 0x%llx: %s", (unsigned long long)u->a.address, vmm__error_text());
    }
    for (uint32_t k = 0, at_fd = 0; k < rep->n_here && st == VMM_OK; k++) {
        const vmm_broker_fd3 *f = &rep->fds[k];
        bool again = sm->repeats && (f->device & VMM_BROKER_FD3_REPEAT);
        while (st == VMM_OK && sm->at < sm->count && f->entry > sm->at) { /* the next entry begins */
            unit *u = &m->u[sm->list[sm->at]];
            if (u->got != u->n)
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u of the %u handles of the allocation at 0x%llx",
                             m->pid, u->got, u->n, (unsigned long long)u->a.address);
            sm->at++;
        }
        if (st != VMM_OK) break;
        unit *u = sm->at < sm->count && f->entry == sm->at ? &m->u[sm->list[sm->at]] : NULL;
        if (!u || f->handle != u->got)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent handles out of order (entry %u, handle %u)", m->pid,
                         f->entry, f->handle);
        else if (f->n_total != u->n)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker says the allocation at 0x%llx has %u handles; the record "
                                     "says %u",
                         m->pid, (unsigned long long)u->a.address, f->n_total, u->n);
        else if (f->size == 0 || f->size > u->a.mapped_size - u->bytes)
            st = set_err(VMM_ERR_IO, "owner pid %u's broker sent handles of more bytes than the record's %llu (the "
                                     "allocation at 0x%llx)",
                         m->pid, (unsigned long long)u->a.mapped_size, (unsigned long long)u->a.address);
        if (st != VMM_OK) break;
        uint32_t hi = u->got++;
        uint64_t at = u->a.address - u->a.chunk_offset + u->bytes; /* the owner's address of this handle */
        u->size[hi] = f->size;
        u->bytes += f->size;
        if (again) { /* passed before in this batch: for another unit, at the same address */
            if (seen_before(m, at, f->size, sm->list[sm->at], hi, &u->alias[hi]))
                mt.shared++;
            else
                st = set_err(VMM_ERR_IO, "owner pid %u's broker named again a handle it had not passed (the allocation "
                                         "at 0x%llx, handle %u)",
                             m->pid, (unsigned long long)u->a.address, hi);
            continue;
        }
        int fd = fds[at_fd];
        fds[at_fd++] = -1;
        if (seen_before(m, at, f->size, sm->list[sm->at], hi, &u->alias[hi])) {
            close(fd);
            mt.shared++;
        } else {
            hand_over(m, sm->list[sm->at], hi, fd);
        }
    }
    if (st == VMM_OK && (rep->flags & VMM_BROKER_REPLY_LAST)) {
        for (; st == VMM_OK && sm->at < sm->count; sm->at++) {
            unit *u = &m->u[sm->list[sm->at]];
            if (u->got != u->n || u->bytes != u->a.mapped_size)
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent %u of %u handles (%llu bytes; the record says "
                                         "%llu) of the allocation at 0x%llx",
                             m->pid, u->got, u->n, (unsigned long long)u->bytes,
                             (unsigned long long)u->a.mapped_size, (unsigned long long)u->a.address);
        }
        sm->done = true;
    }
    return st;
}

/* One v3 request for units list[0 .. count) and its stream, on the owner's kept connection
 * (o->io held); a kept connection found closed is opened again once, as broker_roundtrip does. */
static vmm_status batch_request(many *m, const uint32_t *list, uint32_t count, bool *fallback)
{
    owner_ref *o = m->owner;
    const vmm_alloc_info *a0 = &m->u[list[0]].a;
    size_t len = sizeof(vmm_broker_request3) + count * sizeof(vmm_broker_entry3);
    uint8_t *req = malloc(len);
    if (!req) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    /* repeats are known by the segments seen (seen_before): without that table, every fd comes */
    vmm_broker_request3 h = {.magic = VMM_BROKER_MAGIC, .version = VMM_BROKER_VERSION3, .n_entries = count,
                             .flags = o->no_repeats || !m->segs ? 0 : VMM_BROKER_REQ3_REPEATS};
    memcpy(req, &h, sizeof h);
    for (uint32_t i = 0; i < count; i++) {
        const vmm_alloc_info *a = &m->u[list[i]].a;
        vmm_broker_entry3 e = {.slot = a->slot, .generation = a->generation, .first = 0, .count = 0};
        memcpy(e.alloc_id, a->alloc_id, sizeof e.alloc_id);
        memcpy(req + sizeof h + i * sizeof e, &e, sizeof e);
    }
    vmm_status st = VMM_OK;
    stream sm = {.list = list, .count = count, .repeats = h.flags != 0};
    for (int attempt = 0;; attempt++) {
        bool fresh = o->sock < 0;
        if (fresh) {
            uint64_t t0 = now_ns();
            st = broker_open(m->reg, a0, &o->sock);
            mt.connect_ns += now_ns() - t0;
            if (st != VMM_OK) break;
            mt.connects++;
        }
        uint64_t t0 = now_ns(), imported0 = __atomic_load_n(&m->import_ns, __ATOMIC_RELAXED);
        ssize_t n;
        do n = send(o->sock, req, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        int rc = n == (ssize_t)len ? 0 : -(n < 0 ? errno : EIO);
        if (rc == 0) mt.requests++;
        while (rc == 0 && st == VMM_OK && !sm.done && !sm.fallback && !sm.ask_plain && !many_failed(m)) {
            union {
                vmm_broker_reply3 rep;
                uint8_t raw[sizeof(vmm_broker_reply3) + 32];
            } in;
            int fds[VMM_BROKER_MAX_FDS];
            uint32_t nf = 0;
            size_t got = 0;
            memset(&in.rep, 0, sizeof in.rep);
            rc = broker_recv_raw(o->sock, in.raw, sizeof in.raw, &got, fds, VMM_BROKER_MAX_FDS, &nf);
            if (rc) break;
            mt.messages++;
            if (in.rep.magic != VMM_BROKER_MAGIC) {
                while (nf) close(fds[--nf]);
                st = set_err(VMM_ERR_IO, "owner pid %u's broker sent a malformed reply", m->pid);
                break;
            }
            st = take_reply(m, &sm, &in.rep, got, fds, nf);
            for (uint32_t k = 0; k < nf; k++) /* those it did not take */
                if (fds[k] >= 0) close(fds[k]);
        }
        /* this thread's own imports (no other threads) are not the broker's time */
        uint64_t imported = m->threads <= 1 ? __atomic_load_n(&m->import_ns, __ATOMIC_RELAXED) - imported0 : 0;
        mt.broker_ns += now_ns() - t0 - imported;
        if (rc == 0 && st == VMM_OK && sm.done) break;
        if (rc == 0 && st == VMM_OK && sm.ask_plain) { /* the same request without the flag, same connection */
            o->no_repeats = true;
            h.flags = 0;
            memcpy(req, &h, sizeof h);
            sm = (stream){.list = list, .count = count};
            attempt--;
            continue;
        }
        /* a stream broken off, a failure, or an old broker (which closes the connection): the
         * connection's state is unknown, so it goes */
        close(o->sock);
        o->sock = -1;
        if (st != VMM_OK || sm.fallback || (rc == 0 && many_failed(m))) break;
        if (fresh || attempt > 0 || sm.seq > 0 || !(rc == -EPIPE || rc == -ECONNRESET || rc == -ENOTCONN)) {
            st = exchange_failed(a0, rc);
            break;
        }
    }
    free(req);
    *fallback = sm.fallback;
    return st;
}

/* Unit u's handles one allocation at a time (v1 or pidfd for one handle, v2 for several), as
 * vmm_import fetches them: for an owner whose broker predates v3, or offers none. */
static vmm_status unit_fetch_alone(many *m, unit *u)
{
    memset(&tm, 0, sizeof tm);
    vmm_status st;
    if (!(u->a.flags & VMM_ALLOC_MULTI_HANDLE)) {
        st = fetch_handle(m->reg, &u->a, &u->h[0]);
        if (st == VMM_OK) {
            u->size[0] = u->a.mapped_size;
            u->ok[0] = 1;
            u->got = 1;
            u->bytes = u->a.mapped_size;
        }
        mt.requests++;
    } else {
        multi_parts mp;
        st = multi_fetch(m->reg, &u->a, &mp);
        if (st == VMM_OK) {
            memcpy(u->h, mp.h, u->n * sizeof *u->h);
            memcpy(u->size, mp.size, u->n * sizeof *u->size);
            memset(u->ok, 1, u->n);
            u->got = u->n;
            u->bytes = u->a.mapped_size;
            free(mp.h);
            free(mp.size);
        }
        mt.requests += (u->n + VMM_BROKER_MAX_FDS - 1) / VMM_BROKER_MAX_FDS;
    }
    mt.connect_ns += tm.connect_ns;
    mt.connects += tm.connect_ns != 0;
    mt.broker_ns += tm.request_ns;
    mt.export_ns += tm.export_ns;
    m->import_ns += tm.import_ns;
    return st;
}

/* Every unit's handles from the owner, imported. */
static vmm_status many_fetch(many *m)
{
    if (!m->n_units) return VMM_OK;
    mt.handles = (uint32_t)m->n_handles;
    m->q = calloc(m->n_handles, sizeof *m->q);
    uint32_t *list = calloc(m->n_units, sizeof *list);
    size_t segs = 16;
    while (segs < 2 * m->n_handles + 2) segs <<= 1;
    m->segs = calloc(segs, sizeof *m->segs); /* without it (out of memory) every handle is imported */
    m->segs_mask = segs - 1;
    if (!m->q || !list) {
        free(list);
        return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    uint32_t n_list = 0;
    for (uint32_t i = 0; i < m->n_units; i++)
        if (m->u[i].a.handle_kinds & VMM_KIND_BROKER) list[n_list++] = i;
    /* the importing threads wait for the fds the broker's stream brings */
    pthread_t th[MAX_IMPORT_THREADS];
    uint32_t started = 0;
    if (m->threads > 1 && n_list) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (uint32_t i = 0; i < m->threads && i < MAX_IMPORT_THREADS; i++)
            if (pthread_create(&th[started], NULL, import_worker, m) == 0) started++;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!started) m->threads = 1;
    }
    vmm_status st = VMM_OK;
    bool fallback = false;
    if (n_list) {
        pthread_mutex_lock(&m->owner->io);
        for (uint32_t at = 0; at < n_list && st == VMM_OK && !fallback; at += VMM_BROKER_MAX_ENTRIES) {
            uint32_t count = n_list - at < VMM_BROKER_MAX_ENTRIES ? n_list - at : VMM_BROKER_MAX_ENTRIES;
            st = batch_request(m, list + at, count, &fallback);
            /* a broker not started yet is no reason to give up when pidfd works too */
            if (st == VMM_ERR_NOT_FOUND && at == 0) {
                bool pidfd = true;
                for (uint32_t i = 0; i < n_list && pidfd; i++) pidfd = m->u[list[i]].a.handle_kinds & VMM_KIND_PIDFD;
                if (pidfd) {
                    st = VMM_OK;
                    fallback = true;
                }
            }
        }
        pthread_mutex_unlock(&m->owner->io);
    }
    pthread_mutex_lock(&m->lock);
    m->q_closed = true;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->lock);
    for (uint32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (st != VMM_OK) many_fail(m, st);
    if (m->st != VMM_OK) {
        free(list);
        return set_err(m->st, "%s", m->why);
    }
    if (fallback) mt.fallback = 1;
    /* what the batch did not bring: every unit after an old broker's refusal, and those that offer
     * no broker (pidfd only) */
    for (uint32_t i = 0; i < m->n_units && st == VMM_OK; i++) {
        unit *u = &m->u[i];
        if (u->got == u->n) continue;
        if (u->got) { /* an old broker that answered part of a stream: start the unit afresh */
            for (uint32_t k = 0; k < u->n; k++)
                if (u->ok[k]) (void)TWICE(cu.MemRelease(u->h[k]));
            memset(u->ok, 0, u->n);
            memset(u->alias, 0, u->n * sizeof *u->alias); /* only complete units are aliased to */
            u->got = 0;
            u->bytes = 0;
        }
        if ((st = unit_fetch_alone(m, u)) != VMM_OK) {
            m->fail_unit = i;
            st = set_err(st, "the allocation at 0x%llx: %s", (unsigned long long)u->a.address, vmm__error_text());
        }
    }
    free(list);
    for (uint32_t i = 0; i < m->n_units && st == VMM_OK; i++) /* a repeated segment: the import made first */
        for (uint32_t k = 0; k < m->u[i].n && st == VMM_OK; k++) {
            uint64_t al = m->u[i].alias[k];
            if (!al) continue;
            const unit *src = &m->u[(al - 1) >> 32];
            uint32_t sk = (uint32_t)(al - 1);
            if (src->ok[sk])
                m->u[i].h[k] = src->h[sk];
            else
                st = set_err(VMM_ERR_IO, "owner pid %u's segment at the allocation at 0x%llx was not imported", m->pid,
                             (unsigned long long)m->u[i].a.address);
        }
    return st;
}

/* ---- 3. map ---- */

/* The handles a new chunk maps: all of its unit's, back to back from where the chunk starts in the
 * owner. */
static vmm_status chunk_placed(const unit *u, placed **out, size_t *n)
{
    placed *v = calloc(u->n, sizeof *v);
    if (!v) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    uint64_t at = u->a.address - u->a.chunk_offset;
    for (uint32_t i = 0; i < u->n; i++) {
        v[i] = (placed){at, u->size[i], u->h[i]};
        at += u->size[i];
    }
    *out = v;
    *n = u->n;
    return VMM_OK;
}

/* The handles a range across chunks maps: range_place over its pieces' units. */
static vmm_status range_placed(many *m, many_range *r, placed **out, size_t *n)
{
    for (size_t k = 0; k < r->p.n_pc; k++) {
        piece *pc = &r->p.pc[k];
        const unit *u = &m->u[r->unit_of[k]];
        pc->handle_of = k;
        memset(&pc->parts, 0, sizeof pc->parts);
        if (u->a.flags & VMM_ALLOC_MULTI_HANDLE) {
            pc->parts.n = u->n; /* borrowed: the unit releases them */
            pc->parts.h = u->h;
            pc->parts.size = u->size;
        } else {
            pc->handle = u->h[0];
            pc->size = u->size[0];
        }
    }
    return range_place(&r->p, out, n);
}

/* By group, then where they start in the owner: consumers that reach the same segments meet. */
static int consumer_order(const void *x, const void *y)
{
    const consumer *a = x, *b = y;
    if (a->group != b->group) return a->group < b->group ? -1 : 1;
    if (a->v[0].at != b->v[0].at) return a->v[0].at < b->v[0].at ? -1 : 1;
    return a->is_range != b->is_range ? (a->is_range ? 1 : -1) : (a->index < b->index ? -1 : a->index > b->index);
}

/* A segment mapped in the call's reservation. */
typedef struct seg_place {
    uint64_t at, size; /* in the owner */
    uint32_t users;    /* consumers whose parts it is */
    uint32_t shared;   /* 1 + its counter in the slab, once users > 1 */
} seg_place;

/* Where each consumer lies in the reservation, and one map operation per segment of the owner.
 * Consumers of one group whose owner ranges overlap form a run laid out as the owner lays it out,
 * so a segment two of them reach is mapped once (access grants cost the same per mapping,
 * whatever its size).  A consumer whose handles do not coincide with the run's where they overlap
 * (records read at different moments: never seen, but not assumed) starts a run of its own.
 * Returns the reservation's size; sp (the segments, in op order) and ops are filled. */
static uint64_t many_layout(many *m, seg_place *sp, size_t *n_sp)
{
    uint64_t total = 0, run_base = 0, run_lo = 0, run_hi = 0, run_group = 0;
    size_t run_first = 0;
    for (size_t k = 0; k < m->n_cs; k++) {
        consumer *c = &m->cs[k];
        bool joins = k > 0 && c->group == run_group && c->v[0].at < run_hi;
        size_t at_seg = run_first;
        for (size_t j = 0; joins && j < c->nv && c->v[j].at < run_hi; j++) {
            while (at_seg < *n_sp && sp[at_seg].at < c->v[j].at) at_seg++;
            joins = at_seg < *n_sp && sp[at_seg].at == c->v[j].at && sp[at_seg].size == c->v[j].size;
        }
        if (!joins) {
            run_base = total;
            run_lo = run_hi = c->v[0].at;
            run_first = *n_sp;
            run_group = c->group;
        }
        c->at = run_base + (c->v[0].at - run_lo);
        at_seg = run_first;
        for (size_t j = 0; j < c->nv; j++) {
            const placed *v = &c->v[j];
            if (v->at < run_hi) {
                while (sp[at_seg].at < v->at) at_seg++;
                sp[at_seg].users++;
                c->shared[j] = (uint32_t)at_seg + 1; /* its segment, for now */
                continue;
            }
            sp[*n_sp] = (seg_place){v->at, v->size, 1, 0};
            c->shared[j] = (uint32_t)++*n_sp;
            m->ops[m->n_ops++] = (map_op){(CUdeviceptr)(run_base + (v->at - run_lo)), (size_t)v->size, v->handle, false};
            run_hi = v->at + v->size;
        }
        total = run_base + (run_hi - run_lo);
    }
    return total;
}

static void *map_worker(void *arg)
{
    many *m = arg;
    CUcontext cur = NULL;
    bool set = cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != m->ctx && cu.CtxSetCurrent(m->ctx) == CUDA_SUCCESS;
    for (;;) {
        size_t i = __atomic_fetch_add(&m->op_next, 1, __ATOMIC_RELAXED);
        if (i >= m->n_ops || many_failed(m)) break;
        map_op *op = &m->ops[i];
        uint64_t t0 = now_ns();
        CUresult r = cu.MemMap(op->va, op->len, 0, op->h, 0);
        __atomic_add_fetch(&m->map_ns, now_ns() - t0, __ATOMIC_RELAXED);
        if (r == CUDA_SUCCESS)
            op->done = true;
        else
            many_fail(m, cu_fail("cuMemMap", r));
    }
    if (set) (void)cu.CtxSetCurrent(cur);
    return NULL;
}

/* Lay out every consumer, reserve once, map every handle, grant access per group. */
static vmm_status many_map(many *m)
{
    m->n_cs = m->n_nc;
    for (size_t i = 0; i < m->n; i++) m->n_cs += m->r[i].across;
    if (!m->n_cs) return VMM_OK;
    m->cs = calloc(m->n_cs, sizeof *m->cs);
    if (!m->cs) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    size_t k = 0;
    vmm_status st = VMM_OK;
    for (size_t i = 0; i < m->n_nc && st == VMM_OK; i++, k++) {
        consumer *c = &m->cs[k];
        c->index = (uint32_t)i;
        plan_access(&m->nc[i].a, m->here, c->acc, &c->n_acc, &c->use);
        st = chunk_placed(&m->u[m->nc[i].unit], &c->v, &c->nv);
    }
    for (size_t i = 0; i < m->n && st == VMM_OK; i++) {
        if (!m->r[i].across) continue;
        consumer *c = &m->cs[k++];
        c->is_range = true;
        c->index = (uint32_t)i;
        /* the range's records are one owner's, side by side: the first one's device stands for all */
        plan_access(&m->r[i].p.rec[0], m->here, c->acc, &c->n_acc, &c->use);
        if ((st = range_placed(m, &m->r[i], &c->v, &c->nv)) != VMM_OK) m->fail_range = i;
    }
    if (st != VMM_OK) return st;
    size_t n_ops = 0;
    for (k = 0; k < m->n_cs; k++) {
        consumer *c = &m->cs[k];
        c->size = c->v[c->nv - 1].at + c->v[c->nv - 1].size - c->v[0].at;
        c->group = device_bits(c->acc, c->n_acc) << 1 | (c->n_acc > 1);
        n_ops += c->nv;
        if (!(c->shared = calloc(c->nv, sizeof *c->shared))) return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    qsort(m->cs, m->n_cs, sizeof *m->cs, consumer_order);
    for (k = 0; k < m->n_cs; k++) {
        if (m->cs[k].is_range)
            m->r[m->cs[k].index].consumer = (uint32_t)k;
        else
            m->nc[m->cs[k].index].consumer = (uint32_t)k;
    }
    m->s = calloc(1, sizeof *m->s);
    m->ops = calloc(n_ops, sizeof *m->ops);
    seg_place *sp = calloc(n_ops, sizeof *sp);
    if (!m->s || !m->ops || !sp) {
        free(sp);
        return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    size_t n_sp = 0;
    uint64_t total = many_layout(m, sp, &n_sp);
    /* the segments more than one consumer reaches get a counter; the others are their part's alone */
    uint32_t n_shared = 0;
    for (size_t i = 0; i < n_sp; i++)
        if (sp[i].users > 1) sp[i].shared = ++n_shared;
    if (n_shared && !(m->s->shared_refs = calloc(n_shared, sizeof *m->s->shared_refs))) {
        free(sp);
        return set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    }
    for (size_t i = 0; i < n_sp; i++)
        if (sp[i].shared) m->s->shared_refs[sp[i].shared - 1] = sp[i].users;
    for (k = 0; k < m->n_cs; k++)
        for (size_t j = 0; j < m->cs[k].nv; j++) m->cs[k].shared[j] = sp[m->cs[k].shared[j] - 1].shared;
    free(sp);
    uint64_t t0 = now_ns();
    CUresult r = cu.MemAddressReserve(&m->s->base, (size_t)total, 0, 0, 0);
    mt.reserve_ns += now_ns() - t0;
    mt.reserves++;
    if (r != CUDA_SUCCESS) {
        free(m->s->shared_refs);
        free(m->s);
        m->s = NULL;
        return cu_fail("cuMemAddressReserve", r);
    }
    m->s->size = (size_t)total;
    for (size_t i = 0; i < m->n_ops; i++) m->ops[i].va += m->s->base; /* many_layout gave offsets */
    mt.maps = (uint32_t)m->n_ops;
    m->op_next = 0;
    crew_run(m->threads < m->n_ops ? m->threads : (uint32_t)m->n_ops, map_worker, m);
    if (m->st != VMM_OK) return set_err(m->st, "%s", m->why);
    /* one SetAccess over each group's consumers, laid out back to back (overlapping within a run)
     * and all mapped */
    for (k = 0; k < m->n_cs;) {
        size_t j = k;
        uint64_t end = m->cs[k].at + m->cs[k].size;
        while (j + 1 < m->n_cs && m->cs[j + 1].group == m->cs[k].group) {
            j++;
            if (m->cs[j].at + m->cs[j].size > end) end = m->cs[j].at + m->cs[j].size;
        }
        uint64_t t1 = now_ns();
        r = cu.MemSetAccess(m->s->base + m->cs[k].at, (size_t)(end - m->cs[k].at), m->cs[k].acc, m->cs[k].n_acc);
        mt.access_ns += now_ns() - t1;
        mt.access_calls++;
        if (r != CUDA_SUCCESS) return cu_fail("cuMemSetAccess", r);
        k = j + 1;
    }
    return VMM_OK;
}

/* ---- 4. hand out, and undo ---- */

/* Undo what many_map made of the reservation (nothing has been handed out): unmap each mapping,
 * free the range unless the driver kept a mapping in it. */
static void many_unmap(many *m)
{
    if (!m->s) return;
    bool kept = false;
    for (size_t i = 0; i < m->n_ops; i++)
        if (m->ops[i].done) kept |= TWICE(cu.MemUnmap(m->ops[i].va, m->ops[i].len)) != CUDA_SUCCESS;
    if (!kept && m->s->size) (void)TWICE(cu.MemAddressFree(m->s->base, m->s->size));
    free(m->s->shared_refs);
    free(m->s);
    m->s = NULL;
}

/* Release every imported handle: mapped, they keep their memory; unmapped, it goes. */
static void many_release_handles(many *m)
{
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < m->n_units; i++) {
        unit *u = &m->u[i];
        for (uint32_t k = 0; k < u->n; k++)
            if (u->ok[k]) (void)TWICE(cu.MemRelease(u->h[k]));
        free(u->h);
        free(u->size);
        free(u->ok);
        free(u->alias);
    }
    free(m->u);
    m->u = NULL;
    m->n_units = 0;
    mt.release_ns += now_ns() - t0;
}

/* Every record of every range that the owner's broker did not vouch for (it checked the records
 * it was asked about, as it exported them) must still be the live allocation the walk found; a
 * range in a chunk mapped here before must still be live with its owner alive, and be granted to
 * this thread's device. */
static vmm_status many_verify(many *m)
{
    uint64_t t0 = now_ns();
    vmm_status st = VMM_OK;
    for (size_t i = 0; i < m->n && st == VMM_OK; i++) {
        many_range *r = &m->r[i];
        size_t from = 0;
        if (r->c) {
            if ((st = still_live(m->reg, &r->p.rec[0], r->c->owner)) == VMM_OK)
                st = grant_device(r->c, &r->p.rec[0], m->here, &r->use);
            from = 1;
        }
        for (size_t j = from; j < r->p.n_rec && st == VMM_OK; j++) {
            const vmm_alloc_info *a = &r->p.rec[j];
            if (!r->c) {
                bool asked = false;
                for (size_t h = unit_hash(a) & m->units_ix.mask; m->units_ix.slot[h] && !asked;
                     h = (h + 1) & m->units_ix.mask)
                    asked = same_record(&m->u[m->units_ix.slot[h] - 1].a, a);
                if (asked) continue;
            }
            st = record_unchanged(m->reg, a);
        }
        if (st != VMM_OK) m->fail_range = i;
    }
    mt.find_ns += now_ns() - t0;
    return st;
}

/* A consumer that could not be handed out gives back its part of the reservation. */
static void consumer_drop(slab *s, const consumer *c)
{
    bool kept = false;
    for (size_t j = 0; j < c->nv; j++)
        if (mapping_last(s, c->shared, j))
            kept |= TWICE(cu.MemUnmap(s->base + c->at + (c->v[j].at - c->v[0].at), (size_t)c->v[j].size)) !=
                    CUDA_SUCCESS;
    if (!kept) (void)slab_put(s);
}

/* The new chunks into the chunk table, the ranges across chunks as range maps: what out[] holds.
 * Cannot fail but for a chunk another thread mapped meanwhile, whose grant may. */
static vmm_status many_hand_out(many *m, vmm_imported **out)
{
    slab *s = m->s; /* NULL when every range's chunk was mapped here already */
    if (s) s->refs = m->n_cs;
    m->s = NULL; /* from here each consumer gives its part back */
    vmm_status st = VMM_OK;
    for (size_t k = 0; k < m->n_cs; k++) {
        consumer *c = &m->cs[k];
        if (c->is_range) continue;
        new_chunk *n = &m->nc[c->index];
        chunk *fresh = calloc(1, sizeof *fresh);
        uint64_t *len = calloc(c->nv, sizeof *len);
        if (!fresh || !len) { /* the mapping goes: the ranges in it fail below */
            free(fresh);
            free(len);
            consumer_drop(s, c);
            st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
            continue;
        }
        for (size_t j = 0; j < c->nv; j++) len[j] = c->v[j].size;
        fresh->key = n->key;
        fresh->owner = m->owner;
        fresh->base = s->base + c->at;
        fresh->size = (size_t)c->size;
        fresh->n_parts = (uint32_t)c->nv;
        fresh->part_len = len;
        fresh->slab = s;
        fresh->shared = c->shared;
        c->shared = NULL;
        fresh->ctx = m->ctx;
        fresh->devices = device_bits(c->acc, c->n_acc);
        fresh->refs = n->users;
        pthread_mutex_lock(&chunks_lock);
        chunk *had = chunk_ref_locked(&n->key);
        if (!had) {
            chunk **b = bucket_of(&n->key);
            fresh->next = *b;
            *b = fresh;
            m->owner->chunks++;
            set_witness_locked(fresh, m->reg, &n->a);
            n->c = fresh;
        } else {
            had->refs += n->users - 1; /* one reference per range in it, as a fresh one would have */
            n->c = had;
        }
        pthread_mutex_unlock(&chunks_lock);
        if (had) { /* another thread mapped it meanwhile: use that mapping, drop ours */
            (void)unmap_chunk(fresh);
            chunk_free(fresh);
            CUdevice use;
            vmm_status g = grant_device(had, &n->a, m->here, &use);
            if (g != VMM_OK && st == VMM_OK) st = g;
        }
    }
    for (size_t i = 0; i < m->n; i++) {
        many_range *r = &m->r[i];
        vmm_imported *imp = calloc(1, sizeof *imp);
        if (!imp) st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
        if (r->across) {
            consumer *c = &m->cs[r->consumer];
            range_map *rm = malloc(sizeof *rm + c->nv * sizeof rm->map[0]);
            if (!rm) {
                st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
                consumer_drop(s, c);
                free(imp);
                continue;
            }
            memset(rm, 0, sizeof *rm);
            rm->base = s->base + c->at;
            rm->size = (size_t)c->size;
            rm->slab = s;
            rm->shared = c->shared;
            c->shared = NULL;
            rm->ctx = m->ctx;
            for (size_t j = 0; j < c->nv; j++) {
                rm->map[rm->n].at = (size_t)(c->v[j].at - c->v[0].at);
                rm->map[rm->n++].len = (size_t)c->v[j].size;
            }
            if (!imp) {
                (void)range_unmap(rm);
                continue;
            }
            imp->range = rm;
            imp->ptr = (uint64_t)rm->base + (r->p.address - c->v[0].at);
            imp->device = (int)c->use;
        } else {
            chunk *ch = r->c ? r->c : m->nc[r->fresh - 1].c;
            if (!r->c) r->use = m->cs[m->nc[r->fresh - 1].consumer].use;
            r->c = NULL; /* the import holds the reference now (or gives it back below) */
            if (!ch) {
                free(imp);
                continue; /* its chunk could not be made: its references never existed */
            }
            if (!imp) {
                (void)chunk_unref(ch);
                continue;
            }
            const vmm_alloc_info *a = &r->p.rec[0];
            imp->c = ch;
            imp->ptr = (uint64_t)ch->base + a->chunk_offset + (r->p.address - a->address);
            imp->alloc = *a;
            imp->device = (int)r->use;
        }
        imp->requested_size = r->p.end - r->p.address;
        imp->alloc = r->p.rec[0];
        imp->recs = r->p.rec; /* vmm_import_records */
        imp->n_recs = r->p.n_rec;
        r->p.rec = NULL;
        out[i] = imp;
    }
    return st;
}

vmm_status vmm__import_many(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *sizes,
                            size_t n, vmm_imported **out)
{
    uint64_t t_start = now_ns();
    memset(&mt, 0, sizeof mt);
    memset(&tm, 0, sizeof tm);
    NEED(out || n == 0, "out is NULL");
    for (size_t i = 0; i < n; i++) out[i] = NULL;
    NEED(reg, "reg is NULL");
    NEED(pid != 0, "pid is 0");
    NEED(addresses || n == 0, "addresses is NULL");
    NEED(n <= UINT32_MAX, "n is too large");
    mt.ranges = (uint32_t)n;
    if (n == 0) return VMM_OK;
    many m;
    memset(&m, 0, sizeof m);
    m.reg = reg;
    m.pid = pid;
    m.n = n;
    pthread_mutex_init(&m.lock, NULL);
    pthread_cond_init(&m.cv, NULL);
    vmm_status st = import_threads(&m.threads);
    mt.threads = m.threads;
    if (st == VMM_OK) st = cuda_ready();
    if (st == VMM_OK) {
        uint64_t t0 = now_ns();
        st = current_context(&m.ctx, &m.here);
        mt.context_ns = now_ns() - t0;
    }
    m.fail_range = n;
    m.fail_unit = SIZE_MAX;
    m.r = st == VMM_OK ? calloc(n, sizeof *m.r) : NULL;
    if (st == VMM_OK && !m.r) st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    /* 1. find */
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n && st == VMM_OK; i++)
        if ((st = many_find(&m, i, addresses[i], sizes ? sizes[i] : 0)) != VMM_OK) m.fail_range = i;
    mt.find_ns = now_ns() - t0;
    size_t most = 0; /* units there can be: one a range inside a chunk, one a piece of the others */
    for (size_t i = 0; i < n && st == VMM_OK; i++) most += m.r[i].across ? m.r[i].p.n_pc : 1;
    if (st == VMM_OK && (!ix_init(&m.units_ix, most) || !ix_init(&m.chunks_ix, n)))
        st = set_err(VMM_ERR_NOMEM, "vmm_import_many: out of memory");
    if (st == VMM_OK) st = owner_get(&m.r[0].p.rec[0], &m.owner);
    if (st == VMM_OK) st = many_sort(&m);
    mt.chunks_new = (uint32_t)m.n_nc;
    for (size_t i = 0; i < n && m.r; i++) mt.ranges_mapped += m.r[i].across;
    /* 2. fetch, 3. map, 4. hand out */
    if (st == VMM_OK) st = many_fetch(&m);
    if (st == VMM_OK) st = many_verify(&m);
    if (st == VMM_OK) st = many_map(&m);
    if (st == VMM_OK) {
        many_release_handles(&m); /* the mappings keep the memory */
        st = many_hand_out(&m, out);
    }
    if (st != VMM_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", vmm__error_text());
        many_unmap(&m);
        for (size_t i = 0; i < n; i++) {
            if (m.r && m.r[i].c) (void)chunk_unref(m.r[i].c);
            (void)vmm__import_release(out[i]);
            out[i] = NULL;
        }
        /* a failure names its range: one of those found, or the first whose records are the
         * failing fetch's */
        size_t failed = m.fail_range;
        for (size_t i = 0; failed == n && m.fail_unit < m.n_units && i < n; i++)
            for (size_t j = 0; j < m.r[i].p.n_rec && failed == n; j++)
                if (same_unit(&m.u[m.fail_unit].a, &m.r[i].p.rec[j])) failed = i;
        if (failed < n)
            set_err(st, "vmm_import_many: range %zu of %zu (pid %u, 0x%llx, %llu bytes): %s; nothing imported", failed,
                    n, pid, (unsigned long long)addresses[failed], (unsigned long long)(sizes ? sizes[failed] : 0),
                    why);
        else
            set_err(st, "vmm_import_many: %zu ranges of pid %u: %s; nothing imported", n, pid, why);
    }
    many_release_handles(&m);
    if (m.owner) owner_put(m.owner);
    for (size_t i = 0; m.r && i < n; i++) {
        free(m.r[i].p.rec);
        free(m.r[i].p.pc);
        free(m.r[i].unit_of);
    }
    for (size_t k = 0; m.cs && k < m.n_cs; k++) {
        free(m.cs[k].v);
        free(m.cs[k].shared);
    }
    free(m.cs);
    free(m.ops);
    free(m.q);
    free(m.segs);
    free(m.nc);
    free(m.r);
    free(m.units_ix.slot);
    free(m.chunks_ix.slot);
    pthread_mutex_destroy(&m.lock);
    pthread_cond_destroy(&m.cv);
    mt.import_ns = m.import_ns;
    mt.map_ns = m.map_ns;
    mt.total_ns = now_ns() - t_start;
    /* vmm_import_last_timing gives the same call's steps, summed */
    tm.total_ns = mt.total_ns;
    tm.context_ns = mt.context_ns;
    tm.lookup_ns = mt.find_ns;
    tm.connect_ns = mt.connect_ns;
    tm.request_ns = mt.broker_ns;
    tm.export_ns = mt.export_ns;
    tm.import_ns = mt.import_ns;
    tm.reserve_ns = mt.reserve_ns;
    tm.map_ns = mt.map_ns;
    tm.access_ns = mt.access_ns;
    tm.cached = mt.handles == 0;
    tm.route = mt.handles ? VMM_KIND_BROKER : 0;
    return st;
}

uint64_t vmm__import_ptr(const vmm_imported *imp) { return imp ? imp->ptr : 0; }

uint64_t vmm__import_size(const vmm_imported *imp) { return imp ? imp->requested_size : 0; }

int vmm__import_device(const vmm_imported *imp) { return imp ? imp->device : -1; }

size_t vmm__import_records(const vmm_imported *imp, vmm_alloc_info *out, size_t max)
{
    if (!imp) return 0;
    const vmm_alloc_info *r = imp->recs ? imp->recs : &imp->alloc;
    size_t n = imp->recs ? imp->n_recs : 1;
    for (size_t i = 0; out && i < n && i < max; i++) out[i] = r[i];
    return n;
}

vmm_status vmm__import_release(vmm_imported *imp)
{
    if (!imp) return VMM_OK;
    vmm_status st = imp->range ? range_unmap(imp->range) : chunk_unref(imp->c);
    free(imp->recs);
    free(imp);
    return st;
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

/* A record's handles as fds, asked of its owner's broker as multi_fetch asks, not imported: for
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
        vmm_status st = fetch_fd(reg, a, &fds[0]);
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
