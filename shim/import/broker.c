/* The owner's broker, as a client sees it: connecting within a deadline, one request and its
 * reply with the fds it carries (SCM_RIGHTS; wire format in shim/broker/protocol.h), the kept
 * connection opened again when the broker closed it, and the broker's refusals as statuses.  One
 * file so that every request form (v1 here, v2 in fetch.c, v3 in many_fetch.c) goes through the
 * same socket handling and says the same things when it fails.  Calls owners.c, cache.c (the
 * owner's entry) and records.c. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "broker/protocol.h"
#include "registry/registry.h"

#include "import/internal.h"

#define CONNECT_TIMEOUT_MS 2000
/* The broker serves connections one at a time and gives each at most 1 s. */
#define REPLY_TIMEOUT_MS 5000

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
int vmm__broker_recv_raw(int s, void *buf, size_t cap, size_t *len, int *fds, uint32_t max_fds, uint32_t *n_fds)
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
    int rc = vmm__broker_recv_raw(s, in.raw, sizeof in.raw, &n, fd, 1, &got);
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
        if (vmm__owner_liveness(a) == VMM__DEAD) return vmm__owner_dead(a);
        return set_err(VMM_ERR_NOT_FOUND, "no process record for owner pid %u in the registry", a->pid);
    }
    if (!proc.broker_path[0]) {
        if (vmm__owner_liveness(a) == VMM__DEAD) return vmm__owner_dead(a);
        return set_err(VMM_ERR_NOT_FOUND, "owner pid %u has no broker (not started yet)", a->pid);
    }
    snprintf(path, len, "%s", proc.broker_path);
    return VMM_OK;
}

vmm_status vmm__broker_open(vmm_registry *reg, const vmm_alloc_info *a, int *sock)
{
    char path[sizeof ((vmm_proc_info *)0)->broker_path];
    vmm_status st = broker_path_of(reg, a, path, sizeof path);
    if (st != VMM_OK) return st;
    uint64_t t0 = vmm__now_ns();
    int s = broker_connect(path);
    vmm__tm.connect_ns = vmm__now_ns() - t0;
    if (s >= 0) {
        *sock = s;
        return VMM_OK;
    }
    int e = -s;
    if (e == ECONNREFUSED || e == ENOENT || e == ENOTDIR) {
        if (vmm__owner_liveness(a) == VMM__DEAD) return vmm__owner_dead(a);
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
int vmm__broker_roundtrip(vmm_registry *reg, const vmm_alloc_info *a, owner_ref *o, const void *req, size_t req_len,
                          int (*recv_fn)(int, void *), void *recv_ctx, vmm_status *open_st)
{
    *open_st = VMM_OK;
    for (int attempt = 0;; attempt++) {
        bool fresh = o->sock < 0;
        if (fresh && (*open_st = vmm__broker_open(reg, a, &o->sock)) != VMM_OK) return -ENOTCONN;
        if (fresh) vmm__release_note_path(o);
        uint64_t t0 = vmm__now_ns();
        ssize_t n;
        do n = send(o->sock, req, req_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        int rc = n == (ssize_t)req_len ? recv_fn(o->sock, recv_ctx) : -(n < 0 ? errno : EIO);
        vmm__tm.request_ns += vmm__now_ns() - t0;
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
    return vmm__broker_roundtrip(reg, a, o, &req, sizeof req, recv_v1, &r, open_st);
}

/* A failed exchange (no reply) as the caller's status. */
vmm_status vmm__exchange_failed(const vmm_alloc_info *a, int rc)
{
    if ((rc == -ECONNRESET || rc == -EPIPE) && vmm__owner_liveness(a) == VMM__DEAD) return vmm__owner_dead(a);
    if (rc == -ETIMEDOUT)
        return set_err(VMM_ERR_IO, "owner pid %u's broker did not reply within %d s", a->pid, REPLY_TIMEOUT_MS / 1000);
    if (rc == -EPROTO) return set_err(VMM_ERR_IO, "owner pid %u's broker sent a malformed reply", a->pid);
    if (rc == -ECONNRESET)
        return set_err(VMM_ERR_IO, "owner pid %u's broker closed the connection without replying", a->pid);
    return set_err(VMM_ERR_IO, "owner pid %u's broker: %s", a->pid, strerror(-rc));
}

/* A reply's non-zero status as the caller's status. */
vmm_status vmm__reply_failed(const vmm_alloc_info *a, int32_t status)
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
    case VMM_BROKER_PAUSED: return vmm__paused(a);
    case -EPROTO: return set_err(VMM_ERR_IO, "owner pid %u's broker rejected the request (protocol mismatch)", a->pid);
    case -EPROTONOSUPPORT:
        return set_err(VMM_ERR_IO, "owner pid %u's broker: the allocation spans several handles, which a one-handle "
                                   "(v1) request cannot fetch", a->pid);
    default:
        return set_err(VMM_ERR_IO, "owner pid %u's broker could not export the allocation: %s", a->pid,
                       status < 0 && status > -4096 ? strerror(-status) : "unknown status");
    }
}

vmm_status vmm__broker_fetch(vmm_registry *reg, const vmm_alloc_info *a, int *fd_out)
{
    owner_ref *o;
    vmm_status st = vmm__owner_get(a, &o);
    if (st != VMM_OK) return st;
    vmm_broker_reply rep;
    memset(&rep, 0, sizeof rep);
    int fd = -1;
    pthread_mutex_lock(&o->io);
    int rc = broker_exchange(reg, a, o, &rep, &fd, &st);
    pthread_mutex_unlock(&o->io);
    vmm__owner_put(o);
    if (st != VMM_OK) return st; /* could not connect: its reason */
    if (rc) return vmm__exchange_failed(a, rc);
    vmm__tm.export_ns = rep.export_ns;
    if (rep.status != 0) return vmm__reply_failed(a, rep.status);
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

