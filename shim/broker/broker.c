/* The owner-side fd broker.  A detached thread, started on the first successful allocation,
 * listens on "<dir>/<pid>.sock" (SOCK_SEQPACKET) and answers each request (broker/protocol.h)
 * with freshly exported fds of the named allocation's handles (one, or a run of them: an
 * allocation may span several), passed with SCM_RIGHTS, or a batch of such runs (v3) with a
 * stream of messages of up to 64 fds each, queued as the peer's socket takes them.  Peers are
 * judged by SO_PEERCRED: the same uid as this process, or a member of VMMSHIM_BROKER_GROUP.
 * See README.md in this directory for the design and its threats. */
#include "broker/broker.h"
#include "broker/dir.h"
#include "broker/holders.h"

#include "broker/protocol.h"
#include "core/log.h"
#include "core/options.h"
#include "core/thread.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define BROKER_MAX_CONNS 64  /* open peer connections; the longest idle makes room for a new one */
#define BROKER_IDLE_MS 60000 /* a connection without a request for this long is closed */
#define BROKER_BACKLOG 64
#define BROKER_MAX_GROUPS 1024

enum { ST_IDLE = 0, ST_STARTING = 1, ST_RUNNING = 2 };

/* Start state.  An atomic state machine rather than a mutex, so that the child of a fork taken
 * while another thread was starting the broker can simply reset it. */
static int g_state = ST_IDLE;
static pid_t g_owner_pid;                      /* the process whose socket g_path is */
static char g_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static int g_listen_fd = -1;
static int g_conn_fds[BROKER_MAX_CONNS];       /* fd + 1 of each open connection (0: none), for the fork child */
/* fd + 1 of the exported fds a connection's v3 message holds until its peer's socket takes it, so
 * a fork child closes them too (it would keep up to 64 per connection otherwise) */
static int g_batch_fds[BROKER_MAX_CONNS][VMM_BROKER_MAX_FDS];
static int g_atexit_done;
static int g_wake_fd = -1;                     /* eventfd: vmm__broker_wake has the thread run g_idle */
static vmm__broker_idle_fn g_idle;

/* Everything the thread needs, fixed before it starts. */
typedef struct broker_cfg {
    int listen_fd;
    vmm__broker_export_fn export_fn;
    uid_t uid;
    bool have_group;
    gid_t group;
} broker_cfg;
/* Static, not malloc'ed: after a fork the parent's thread is gone but its config must not look
 * leaked, and a process runs at most one broker at a time (a fork child starts its own). */
static broker_cfg g_cfg;

/* ---- helpers ---- */

static void at_exit_unlink(void)
{
    /* cheap and non-blocking; never for a parent's socket (atexit handlers survive fork) */
    if (__atomic_load_n(&g_state, __ATOMIC_ACQUIRE) == ST_RUNNING && g_owner_pid == getpid() && g_path[0])
        (void)unlink(g_path);
}

/* ---- serving ---- */

/* The peer's supplementary groups: SO_PEERGROUPS (taken at connect time), else /proc. */
static bool peer_in_group(int fd, pid_t pid, gid_t gid)
{
    gid_t groups[BROKER_MAX_GROUPS];
    socklen_t len = sizeof groups;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
        for (size_t i = 0; i < len / sizeof(gid_t); i++)
            if (groups[i] == gid) return true;
        return false;
    }
    if (pid <= 0) return false;
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    int sfd = open(path, O_RDONLY | O_CLOEXEC);
    if (sfd < 0) return false;
    size_t have = 0;
    ssize_t n;
    while (have < sizeof buf - 1 && (n = read(sfd, buf + have, sizeof buf - 1 - have)) > 0) have += (size_t)n;
    close(sfd);
    buf[have] = 0;
    char *line = strstr(buf, "\nGroups:");
    if (!line) return false;
    line += strlen("\nGroups:");
    for (;;) {
        while (*line == ' ' || *line == '\t') line++;
        if (*line < '0' || *line > '9') return false;
        char *end;
        unsigned long g = strtoul(line, &end, 10);
        if (end == line) return false;
        if ((gid_t)g == gid) return true;
        line = end;
    }
}

/* One datagram, with fds (n of them, perhaps 0) by SCM_RIGHTS, never blocking.  0, or -errno:
 * -EAGAIN when the peer's socket holds all it takes for now, -ETOOMANYREFS when too many fds of
 * this user are in flight (both pass as the peer reads). */
static int send_msg(int fd, const void *msg, size_t len, const int *fds, uint32_t n)
{
    struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(VMM_BROKER_MAX_FDS * sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (n > 0 && n <= VMM_BROKER_MAX_FDS) {
        mh.msg_control = ctl.buf;
        mh.msg_controllen = CMSG_SPACE(n * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(n * sizeof(int));
        memcpy(CMSG_DATA(c), fds, n * sizeof(int));
    }
    ssize_t r;
    do r = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    return r < 0 ? -errno : 0;
}

/* One small datagram into an empty queue (a v1 or v2 reply): never blocks; a vanished peer is
 * just skipped. */
static void send_datagram(int fd, const void *msg, size_t len, const int *fds, uint32_t n)
{
    (void)send_msg(fd, msg, len, fds, n);
}

static void send_reply(int fd, int32_t status, uint64_t mapped_size, uint32_t device, int pass_fd, uint32_t export_ns)
{
    vmm_broker_reply rep;
    memset(&rep, 0, sizeof rep);
    rep.magic = VMM_BROKER_MAGIC;
    rep.status = status;
    rep.mapped_size = mapped_size;
    rep.device = device;
    rep.export_ns = export_ns;
    send_datagram(fd, &rep, sizeof rep, &pass_fd, pass_fd >= 0 ? 1 : 0);
}

/* A connection stays open for as many requests as its peer makes: a companion keeps one per
 * owner, so an import costs one round trip, not a connect and an accept too.  Peers are judged
 * once, at accept (SO_PEERCRED is the connecting process's credentials anyway). */
typedef struct broker_batch broker_batch;
typedef struct broker_conn {
    int fd; /* -1: free */
    bool allowed;
    bool stalled;         /* its batch's last send met ETOOMANYREFS: tried again after a tick */
    int slot;             /* its index among the connections (g_batch_fds), -1 outside the thread */
    pid_t pid;            /* the peer and its start time, for the holders table (holders.c) */
    uint64_t start;
    struct timespec last; /* CLOCK_MONOTONIC of its last request, or of its batch's last message queued */
    broker_batch *batch;  /* a v3 batch being answered: no request is read meanwhile */
} broker_conn;

/* A v3 batch being answered: its entries, and where the stream of messages stands. */
struct broker_batch {
    uint32_t n;           /* entries */
    uint32_t at;          /* the entry whose handles go next */
    uint32_t next;        /* the handle of entry `at` that goes next */
    uint32_t seq;         /* the next message's seq */
    bool done;            /* the last message is built */
    bool pending;         /* msg (with fds[0 .. n_fds)) is built and not yet queued */
    bool repeats;         /* VMM_BROKER_REQ3_REPEATS: each handle's fd once */
    uint32_t n_fds;       /* fds msg passes: its entries without VMM_BROKER_FD3_REPEAT */
    uint64_t *passed;     /* with repeats: the keys of the handles passed so far, open-addressed (0: free) */
    size_t passed_mask, n_passed;
    vmm_broker_reply3 msg;
    int fds[VMM_BROKER_MAX_FDS];
    vmm_broker_entry3 entries[];
};

/* Messages queued for one connection before the others get their turn. */
#define BROKER_PUMP_MAX 4
/* How long a connection whose peer has too many fds in flight waits before the next try. */
#define BROKER_STALL_MS 2

static long ms_since(const struct timespec *t, const struct timespec *now)
{
    return (long)(now->tv_sec - t->tv_sec) * 1000 + (now->tv_nsec - t->tv_nsec) / 1000000;
}

static bool peer_allowed(const broker_cfg *cfg, int fd)
{
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || clen != sizeof cred) return false;
    bool ok = cred.uid == cfg->uid;
    if (!ok && cfg->have_group) ok = cred.gid == cfg->group || peer_in_group(fd, cred.pid, cfg->group);
    if (!ok) vmm__log(VMM__LOG_WARNING, "broker: refused uid %u (pid %d)", (unsigned)cred.uid, (int)cred.pid);
    return ok;
}

static uint32_t saturate_ns(const struct timespec *t0, const struct timespec *t1)
{
    int64_t ns = (int64_t)(t1->tv_sec - t0->tv_sec) * 1000000000 + (t1->tv_nsec - t0->tv_nsec);
    return ns < 0 ? 0 : ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns;
}

/* Ask the backing for handles [first, first + max) and hold it to its contract: on success
 * 1 <= *n_here <= max valid fds within *n_total, else none (any it passed are closed here). */
static int export_checked(const broker_cfg *cfg, const uint8_t *id, uint64_t slot, uint64_t generation,
                          uint32_t first, uint32_t max, int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here,
                          uint32_t *n_total, uint32_t *device, uint32_t *ns)
{
    *n_here = *n_total = 0;
    *device = 0;
    for (uint32_t i = 0; i < max; i++) {
        fds[i] = -1;
        sizes[i] = 0;
        keys[i] = VMM_BROKER_NO_KEY;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = cfg->export_fn(slot, generation, id, first, max, fds, sizes, keys, n_here, n_total, device);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *ns = saturate_ns(&t0, &t1);
    if (rc > 0) rc = -rc;
    uint32_t got = *n_here <= max ? *n_here : max;
    if (rc == 0 && (got == 0 || *n_here > max || *n_total < got || first > *n_total - got)) rc = -EIO;
    for (uint32_t i = 0; rc == 0 && i < got; i++)
        if (fds[i] < 0) rc = -EIO;
    if (rc != 0) {
        for (uint32_t i = 0; i < got; i++)
            if (fds[i] >= 0) close(fds[i]);
        *n_here = 0;
    }
    return rc;
}

/* v1: the allocation's one handle, or -EPROTONOSUPPORT when it has several. */
static void serve_v1(const broker_cfg *cfg, const broker_conn *c, const vmm_broker_request *q)
{
    int sock = c->fd;
    int fd = -1;
    uint64_t size = 0, key;
    uint32_t n_here, n_total, device, ns;
    int rc = export_checked(cfg, q->alloc_id, q->slot, q->generation, 0, 1, &fd, &size, &key, &n_here, &n_total,
                            &device, &ns);
    if (rc == 0 && n_total != 1) {
        close(fd);
        rc = -EPROTONOSUPPORT; /* a part of it would map as if it were the whole */
    }
    if (rc != 0) {
        send_reply(sock, rc, 0, 0, -1, 0);
        return;
    }
    send_reply(sock, 0, size, device, fd, ns);
    vmm__holders_add(c->pid, c->start, q->slot, q->generation, &key, 1);
    close(fd); /* the peer holds its own reference now (or never will) */
}

static void serve_v2(const broker_cfg *cfg, const broker_conn *c, const vmm_broker_request2 *q)
{
    int sock = c->fd;
    vmm_broker_reply2 rep;
    memset(&rep, 0, sizeof rep);
    rep.magic = VMM_BROKER_MAGIC;
    int fds[VMM_BROKER_MAX_FDS];
    uint64_t keys[VMM_BROKER_MAX_FDS];
    uint32_t max = q->max < VMM_BROKER_MAX_FDS ? q->max : VMM_BROKER_MAX_FDS;
    int rc = -EINVAL;
    if (max > 0)
        rc = export_checked(cfg, q->alloc_id, q->slot, q->generation, q->first, max, fds, rep.sizes, keys,
                            &rep.n_here, &rep.n_total, &rep.device, &rep.export_ns);
    if (rc != 0) {
        memset(&rep, 0, sizeof rep);
        rep.magic = VMM_BROKER_MAGIC;
        rep.status = rc;
        send_datagram(sock, &rep, sizeof rep, NULL, 0);
        return;
    }
    send_datagram(sock, &rep, sizeof rep, fds, rep.n_here);
    vmm__holders_add(c->pid, c->start, q->slot, q->generation, keys, rep.n_here);
    for (uint32_t i = 0; i < rep.n_here; i++) close(fds[i]);
}

/* ---- v3: batches ---- */

static void batch_note_fds(const broker_conn *c, const int *fds, uint32_t n)
{
    if (c->slot < 0) return;
    for (uint32_t i = 0; i < VMM_BROKER_MAX_FDS; i++)
        __atomic_store_n(&g_batch_fds[c->slot][i], i < n ? fds[i] + 1 : 0, __ATOMIC_RELEASE);
}

/* Close the fds of a message not queued (built, then dropped). */
static void batch_drop_pending(broker_conn *c)
{
    broker_batch *b = c->batch;
    if (!b || !b->pending) return;
    batch_note_fds(c, NULL, 0);
    for (uint32_t i = 0; i < b->n_fds; i++) close(b->fds[i]);
    b->pending = false;
}

static void batch_end(broker_conn *c)
{
    batch_drop_pending(c);
    if (c->batch) free(c->batch->passed);
    free(c->batch);
    c->batch = NULL;
    c->stalled = false;
}

/* With repeats: true when the handle of this key went in the batch already, else noted as gone
 * now.  Keys are stored + 1 (0 marks a free place); a table that cannot grow passes every fd. */
static bool passed_before(broker_batch *b, uint64_t key)
{
    if (key == VMM_BROKER_NO_KEY) return false;
    if (2 * (b->n_passed + 1) > b->passed_mask + 1) {
        size_t cap = b->passed ? 2 * (b->passed_mask + 1) : 64;
        uint64_t *t = calloc(cap, sizeof *t);
        if (!t) return false;
        for (size_t i = 0; b->passed && i <= b->passed_mask; i++)
            if (b->passed[i]) {
                size_t j = (size_t)(b->passed[i] * 0x9e3779b97f4a7c15ull >> 20) & (cap - 1);
                while (t[j]) j = (j + 1) & (cap - 1);
                t[j] = b->passed[i];
            }
        free(b->passed);
        b->passed = t;
        b->passed_mask = cap - 1;
    }
    for (size_t j = (size_t)((key + 1) * 0x9e3779b97f4a7c15ull >> 20) & b->passed_mask;; j = (j + 1) & b->passed_mask) {
        if (b->passed[j] == key + 1) return true;
        if (!b->passed[j]) {
            b->passed[j] = key + 1;
            b->n_passed++;
            return false;
        }
    }
}

/* Build the batch's next message: the handles that follow, up to 64, entry after entry; the
 * first entry that fails ends the batch with its status instead (the fds this message had
 * gathered are closed: the peer gives up the whole batch anyway). */
static void batch_build(const broker_cfg *cfg, broker_conn *c)
{
    broker_batch *b = c->batch;
    vmm_broker_reply3 *m = &b->msg;
    memset(m, 0, sizeof *m);
    m->magic = VMM_BROKER_MAGIC;
    m->version = VMM_BROKER_VERSION3;
    m->seq = b->seq++;
    b->n_fds = 0;
    uint64_t ns_total = 0;
    int rc = 0;
    while (rc == 0 && b->at < b->n && m->n_here < VMM_BROKER_MAX_FDS) {
        const vmm_broker_entry3 *e = &b->entries[b->at];
        uint32_t max = VMM_BROKER_MAX_FDS - m->n_here;
        if (e->count) {
            uint64_t end = (uint64_t)e->first + e->count;
            if (end > UINT32_MAX) {
                rc = -ERANGE;
                break;
            }
            if (end - b->next < max) max = (uint32_t)(end - b->next);
        }
        uint64_t sizes[VMM_BROKER_MAX_FDS], keys[VMM_BROKER_MAX_FDS];
        int got_fds[VMM_BROKER_MAX_FDS];
        uint32_t got, n_total, device, ns;
        rc = export_checked(cfg, e->alloc_id, e->slot, e->generation, b->next, max, got_fds, sizes, keys, &got,
                            &n_total, &device, &ns);
        if (rc != 0) break;
        ns_total += ns;
        vmm__holders_add(c->pid, c->start, e->slot, e->generation, keys, got); /* repeats too: per allocation */
        for (uint32_t k = 0; k < got; k++) {
            bool again = b->repeats && passed_before(b, keys[k]);
            if (again)
                close(got_fds[k]);
            else
                b->fds[b->n_fds++] = got_fds[k];
            m->fds[m->n_here + k] =
                (vmm_broker_fd3){.entry = b->at, .handle = b->next + k, .n_total = n_total,
                                 .device = device | (again ? VMM_BROKER_FD3_REPEAT : 0), .size = sizes[k]};
        }
        m->n_here += got;
        b->next += got;
        uint32_t end = e->count ? e->first + e->count : n_total;
        if (b->next >= end) {
            /* a count past the allocation's last handle: the next export says -ERANGE */
            if (++b->at < b->n) b->next = b->entries[b->at].first;
        }
    }
    if (rc != 0) {
        for (uint32_t i = 0; i < b->n_fds; i++) close(b->fds[i]);
        b->n_fds = 0;
        uint32_t seq = m->seq;
        memset(m, 0, sizeof *m);
        m->magic = VMM_BROKER_MAGIC;
        m->version = VMM_BROKER_VERSION3;
        m->seq = seq;
        m->status = rc;
        m->entry = b->at;
    }
    m->export_ns = ns_total > UINT32_MAX ? UINT32_MAX : (uint32_t)ns_total;
    if (rc != 0 || b->at >= b->n) {
        m->flags = VMM_BROKER_REPLY_LAST;
        b->done = true;
    }
    b->pending = true;
    batch_note_fds(c, b->fds, b->n_fds);
}

/* Queue the batch's messages while the peer's socket takes them (at most BROKER_PUMP_MAX, so
 * the other connections get their turn).  False when the connection is done with. */
static bool batch_pump(const broker_cfg *cfg, broker_conn *c, const struct timespec *now)
{
    c->stalled = false;
    for (int k = 0; k < BROKER_PUMP_MAX && c->batch; k++) {
        broker_batch *b = c->batch;
        if (!b->pending) batch_build(cfg, c);
        int rc = send_msg(c->fd, &b->msg, sizeof b->msg, b->fds, b->n_fds);
        if (rc == -EAGAIN || rc == -EWOULDBLOCK) return true; /* POLLOUT says when */
        if (rc == -ETOOMANYREFS) {
            c->stalled = true;
            return true;
        }
        if (rc != 0) return false; /* the peer went away */
        batch_note_fds(c, NULL, 0);
        for (uint32_t i = 0; i < b->n_fds; i++) close(b->fds[i]); /* the peer holds them now */
        b->pending = false;
        c->last = *now;
        if (b->done) batch_end(c);
    }
    return true;
}

/* A batch refused whole: one last message with the status and no fds. */
static void refuse_batch(int fd, int status, uint32_t entry)
{
    vmm_broker_reply3 m;
    memset(&m, 0, sizeof m);
    m.magic = VMM_BROKER_MAGIC;
    m.version = VMM_BROKER_VERSION3;
    m.status = status;
    m.flags = VMM_BROKER_REPLY_LAST;
    m.entry = entry;
    send_datagram(fd, &m, sizeof m, NULL, 0);
}

/* A v3 request of n bytes in raw: start its batch (answered by batch_pump), or refuse it. */
static bool serve_v3(const broker_cfg *cfg, broker_conn *c, const uint8_t *raw, size_t n, const struct timespec *now)
{
    vmm_broker_request3 h;
    memcpy(&h, raw, sizeof h);
    uint64_t want = sizeof h + (uint64_t)h.n_entries * sizeof(vmm_broker_entry3);
    if (want != n) {
        send_reply(c->fd, -EPROTO, 0, 0, -1, 0);
        return false;
    }
    if (h.n_entries == 0 || h.n_entries > VMM_BROKER_MAX_ENTRIES || (h.flags & ~VMM_BROKER_REQ3_REPEATS)) {
        refuse_batch(c->fd, -EINVAL, h.n_entries);
        return true;
    }
    broker_batch *b = malloc(sizeof *b + h.n_entries * sizeof(vmm_broker_entry3));
    if (!b) {
        refuse_batch(c->fd, -ENOMEM, 0);
        return true;
    }
    memset(b, 0, sizeof *b);
    b->n = h.n_entries;
    b->repeats = h.flags & VMM_BROKER_REQ3_REPEATS;
    memcpy(b->entries, raw + sizeof h, h.n_entries * sizeof(vmm_broker_entry3));
    b->next = b->entries[0].first;
    c->batch = b;
    return batch_pump(cfg, c, now);
}

/* v4: pause or resume, run here on the broker thread (every peer waits meanwhile, as for an
 * export: the owner's memory is what they would import anyway); control.c builds the answer. */
static void serve_v4(int sock, const vmm_broker_request4 *q)
{
    vmm_broker_reply4h rep;
    size_t len = vmm__broker_control(q, &rep);
    send_datagram(sock, &rep, len, NULL, 0);
}

/* The longest datagram a peer may send: a full v3 batch. */
#define BROKER_MAX_REQUEST (sizeof(vmm_broker_request3) + VMM_BROKER_MAX_ENTRIES * sizeof(vmm_broker_entry3))

/* Answer one request.  False when the connection is done with (closed, broken, or refused). */
static bool serve_request(const broker_cfg *cfg, broker_conn *c)
{
    union {
        vmm_broker_request req;
        vmm_broker_request2 req2;
        vmm_broker_request3 req3;
        vmm_broker_request4 req4;
        uint8_t raw[sizeof(vmm_broker_request4) + 64];
    } in;
    memset(&in, 0, sizeof in);
    /* MSG_TRUNC: the datagram's real length, so an oversized one is caught; any fds a peer
     * tried to pass are discarded by the kernel (no control buffer given).  A v3 batch is longer
     * than the buffer: peeked at first, then read whole into one of its size. */
    ssize_t n;
    do n = recv(c->fd, in.raw, sizeof in.raw, MSG_DONTWAIT | MSG_TRUNC | MSG_PEEK);
    while (n < 0 && errno == EINTR);
    if (n < 0) return errno == EAGAIN;
    uint8_t *big = NULL;
    if ((size_t)n > sizeof in.raw && (size_t)n <= BROKER_MAX_REQUEST && c->allowed &&
        in.req.magic == VMM_BROKER_MAGIC && (in.req.version == VMM_BROKER_VERSION3 || in.req.version == VMM_BROKER_VERSION5))
        big = malloc((size_t)n);
    do n = big ? recv(c->fd, big, (size_t)n, MSG_DONTWAIT | MSG_TRUNC)
               : recv(c->fd, in.raw, sizeof in.raw, MSG_DONTWAIT | MSG_TRUNC);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
        free(big);
        return errno == EAGAIN;
    }
    if (n == 0) {
        free(big);
        return false;
    }
    if (!c->allowed) {
        send_reply(c->fd, -EACCES, 0, 0, -1, 0);
        return false;
    }
    if (in.req.magic == VMM_BROKER_MAGIC && in.req.version == VMM_BROKER_VERSION3 &&
        (size_t)n >= sizeof(vmm_broker_request3) && (big || (size_t)n <= sizeof in.raw)) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        bool keep = serve_v3(cfg, c, big ? big : in.raw, (size_t)n, &now);
        free(big);
        return keep;
    }
    if (in.req.magic == VMM_BROKER_MAGIC && in.req.version == VMM_BROKER_VERSION5 && (big || (size_t)n <= sizeof in.raw) &&
        vmm__holders_serve_release(c->pid, big ? big : in.raw, (size_t)n)) {
        free(big);
        return true; /* no reply: the peer is not listening for one */
    }
    free(big);
    /* magic and version lie at the same offsets in both requests */
    if (in.req.magic == VMM_BROKER_MAGIC && in.req.version == VMM_BROKER_VERSION &&
        (size_t)n == sizeof(vmm_broker_request)) {
        serve_v1(cfg, c, &in.req);
        return true; /* a stale allocation is the peer's news, not the connection's fault */
    }
    if (in.req.magic == VMM_BROKER_MAGIC && in.req.version == VMM_BROKER_VERSION2 &&
        (size_t)n == sizeof(vmm_broker_request2)) {
        serve_v2(cfg, c, &in.req2);
        return true;
    }
    if (in.req.magic == VMM_BROKER_MAGIC && in.req.version == VMM_BROKER_VERSION4 &&
        (size_t)n == sizeof(vmm_broker_request4)) {
        serve_v4(c->fd, &in.req4);
        return true;
    }
    send_reply(c->fd, -EPROTO, 0, 0, -1, 0);
    return false;
}

static void conn_close(broker_conn *c, int slot)
{
    batch_end(c); /* a batch in progress: its message not queued is dropped */
    /* cleared before the close, so a fork child never closes a number reused meanwhile */
    __atomic_store_n(&g_conn_fds[slot], 0, __ATOMIC_RELEASE);
    close(c->fd);
    c->fd = -1;
}

/* A new peer.  When every slot is taken, the connection idle the longest makes room (unless
 * !evict: then the peer waits in the backlog): its peer reconnects on its next request. */
static void conn_accept(const broker_cfg *cfg, broker_conn *conns, const struct timespec *now, bool evict)
{
    bool room = evict;
    for (int i = 0; i < BROKER_MAX_CONNS && !room; i++) room = conns[i].fd < 0;
    if (!room) return;
    int fd = accept4(cfg->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM)
            (void)poll(NULL, 0, 100); /* out of fds: back off instead of spinning */
        return;
    }
    int slot = -1;
    for (int i = 0; i < BROKER_MAX_CONNS; i++) {
        if (conns[i].fd < 0) {
            slot = i;
            break;
        }
        if (slot < 0 || ms_since(&conns[i].last, now) > ms_since(&conns[slot].last, now)) slot = i;
    }
    if (conns[slot].fd >= 0) conn_close(&conns[slot], slot);
    conns[slot].fd = fd;
    conns[slot].allowed = peer_allowed(cfg, fd);
    conns[slot].last = *now;
    conns[slot].slot = slot;
    conns[slot].stalled = false;
    conns[slot].batch = NULL;
    vmm__holders_peer(fd, &conns[slot].pid, &conns[slot].start);
    __atomic_store_n(&g_conn_fds[slot], fd + 1, __ATOMIC_RELEASE);
}

/* The holders' wait during a pause served here (holders.h): new peers only into free slots, so
 * that no connection the loop is serving, the pause's own included, is closed under it. */
static _Thread_local const broker_cfg *t_cfg;
static _Thread_local broker_conn *t_conns;
static void accept_in_wait(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    conn_accept(t_cfg, t_conns, &now, false);
}

static void *broker_thread(void *arg)
{
    broker_cfg cfg = *(const broker_cfg *)arg;
    broker_conn conns[BROKER_MAX_CONNS];
    t_cfg = &cfg;
    t_conns = conns;
    vmm__holders_broker_conns = g_conn_fds;
    vmm__holders_broker_listen = cfg.listen_fd;
    vmm__holders_broker_accept = accept_in_wait;
    for (int i = 0; i < BROKER_MAX_CONNS; i++) conns[i] = (broker_conn){.fd = -1, .slot = i};
    struct pollfd pf[2 + BROKER_MAX_CONNS]; /* the last one after the connections: the wake fd */
    int at[1 + BROKER_MAX_CONNS]; /* pf[k] watches conns[at[k]] */
    int idle_ms = -1;             /* what the idle function asked for last */
    for (;;) {
        int n = 0;
        bool stalled = false;
        pf[n++] = (struct pollfd){.fd = cfg.listen_fd, .events = POLLIN};
        for (int i = 0; i < BROKER_MAX_CONNS; i++)
            if (conns[i].fd >= 0) {
                /* a connection answering a batch waits for room in its peer's socket, not for a
                 * request; one stalled on fds in flight is tried again after a tick */
                short ev = !conns[i].batch ? POLLIN : conns[i].stalled ? 0 : POLLOUT;
                stalled |= conns[i].batch && conns[i].stalled;
                at[n] = i;
                pf[n++] = (struct pollfd){.fd = conns[i].fd, .events = ev};
            }
        int timeout = stalled ? BROKER_STALL_MS : BROKER_IDLE_MS / 4;
        if (idle_ms >= 0 && idle_ms < timeout) timeout = idle_ms;
        int wake = __atomic_load_n(&g_wake_fd, __ATOMIC_ACQUIRE);
        if (wake >= 0) pf[n] = (struct pollfd){.fd = wake, .events = POLLIN};
        int pr = poll(pf, (nfds_t)n + (wake >= 0), timeout);
        if (pr < 0 && errno != EINTR) return NULL;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (pr > 0 && (pf[0].revents & (POLLERR | POLLHUP | POLLNVAL))) return NULL; /* the listening socket is gone */
        for (int k = 1; k < n; k++) {
            broker_conn *c = &conns[at[k]];
            if (c->batch) {
                if (pf[k].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                    conn_close(c, at[k]);
                } else if ((pf[k].revents & POLLOUT) || c->stalled) {
                    if (!batch_pump(&cfg, c, &now)) conn_close(c, at[k]);
                }
                continue;
            }
            if (pr <= 0 || !pf[k].revents) continue;
            if (!(pf[k].revents & POLLIN) || !serve_request(&cfg, c)) {
                conn_close(c, at[k]);
                continue;
            }
            c->last = now;
        }
        for (int i = 0; i < BROKER_MAX_CONNS; i++)
            if (conns[i].fd >= 0 && ms_since(&conns[i].last, &now) > BROKER_IDLE_MS) conn_close(&conns[i], i);
        if (pr > 0 && (pf[0].revents & POLLIN)) conn_accept(&cfg, conns, &now, true);
        if (pr > 0 && wake >= 0 && (pf[n].revents & POLLIN)) {
            uint64_t v;
            (void)!read(wake, &v, sizeof v);
        }
        vmm__broker_idle_fn idle = __atomic_load_n(&g_idle, __ATOMIC_ACQUIRE);
        idle_ms = idle ? idle(cfg.export_fn) : -1;
    }
}

/* ---- start ---- */

static int start_locked(vmm__broker_export_fn export_fn)
{
    char dir[PATH_MAX];
    int rc = vmm__broker_choose_dir(dir, sizeof dir);
    if (rc) {
        vmm__broker_warn_start("broker: directory name too long");
        return rc;
    }
    const char *gname = vmm__opt_str(VMM__OPT_BROKER_GROUP);
    bool have_group = gname && *gname;
    gid_t gid = 0;
    if (have_group && vmm__broker_resolve_group(gname, &gid) != 0) {
        vmm__broker_warn_start("broker: VMMSHIM_BROKER_GROUP '%s' does not exist; broker not started", gname);
        return -EINVAL;
    }
    int dirfd = vmm__broker_open_dir(dir, have_group, gid);
    if (dirfd < 0) return dirfd;

    pid_t pid = getpid();
    char name[32], path[sizeof g_path];
    snprintf(name, sizeof name, "%d.sock", (int)pid);
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path) {
        close(dirfd);
        vmm__broker_warn_start("broker: socket path %s/%s is too long for a Unix socket", dir, name);
        return -ENAMETOOLONG;
    }
    vmm__broker_remove_stale(dirfd, dir);
    (void)unlinkat(dirfd, name, 0); /* ours from before an exec, or a dead namesake's */

    int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (lfd < 0) {
        rc = -errno;
        goto fail_dir;
    }
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    /* The directory is 0700/0750, so nobody else can reach the socket before its chmod. */
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        rc = -errno;
        goto fail_sock;
    }
    if (have_group && fchownat(dirfd, name, (uid_t)-1, gid, AT_SYMLINK_NOFOLLOW) != 0) {
        rc = -errno;
        goto fail_bound;
    }
    if (fchmodat(dirfd, name, have_group ? 0660 : 0600, 0) != 0 || listen(lfd, BROKER_BACKLOG) != 0) {
        rc = -errno;
        goto fail_bound;
    }
    broker_cfg *cfg = &g_cfg;
    cfg->listen_fd = lfd;
    cfg->export_fn = export_fn;
    cfg->uid = geteuid();
    cfg->have_group = have_group;
    cfg->group = gid;

    int wfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); /* none: background work waits for the next request */
    __atomic_store_n(&g_wake_fd, wfd, __ATOMIC_RELEASE);
    pthread_t th;
    int prc = vmm__thread_detached(&th, broker_thread, cfg); /* takes no signals: the application's */
    if (prc != 0) {
        rc = -prc;
        wfd = __atomic_exchange_n(&g_wake_fd, -1, __ATOMIC_ACQ_REL);
        if (wfd >= 0) close(wfd);
        goto fail_bound;
    }
    (void)pthread_setname_np(th, "vmmshim-broker");
    close(dirfd);
    memcpy(g_path, path, sizeof g_path);
    g_owner_pid = pid;
    __atomic_store_n(&g_listen_fd, lfd, __ATOMIC_RELEASE);
    if (!__atomic_exchange_n(&g_atexit_done, 1, __ATOMIC_RELAXED)) atexit(at_exit_unlink);
    return 0;

fail_bound:
    (void)unlinkat(dirfd, name, 0);
fail_sock:
    close(lfd);
fail_dir:
    close(dirfd);
    {
        char eb[96];
        vmm__broker_warn_start("broker: cannot listen on %s: %s", path, vmm__strerror(-rc, eb, sizeof eb));
    }
    return rc;
}

int vmm__broker_start(vmm__broker_export_fn export_fn, char *path, unsigned long path_len)
{
    if (!export_fn) return -EINVAL;
    for (;;) {
        int s = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
        if (s == ST_RUNNING) break;
        if (s == ST_STARTING) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
            continue;
        }
        if (!__atomic_compare_exchange_n(&g_state, &s, ST_STARTING, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        int rc = start_locked(export_fn);
        __atomic_store_n(&g_state, rc == 0 ? ST_RUNNING : ST_IDLE, __ATOMIC_RELEASE);
        if (rc) return rc;
        break;
    }
    if (path && path_len) {
        if (strlen(g_path) >= path_len) return -ENAMETOOLONG;
        memcpy(path, g_path, strlen(g_path) + 1);
    }
    return 0;
}

void vmm__broker_forget_after_fork(void)
{
    /* Only this thread exists in the child.  Drop our copies of the parent's listening socket
     * and connection (the parent keeps serving through its own), never its socket file. */
    int fd = __atomic_exchange_n(&g_listen_fd, -1, __ATOMIC_ACQ_REL);
    if (fd >= 0) close(fd);
    fd = __atomic_exchange_n(&g_wake_fd, -1, __ATOMIC_ACQ_REL);
    if (fd >= 0) close(fd);
    for (int i = 0; i < BROKER_MAX_CONNS; i++) {
        fd = __atomic_exchange_n(&g_conn_fds[i], 0, __ATOMIC_ACQ_REL) - 1;
        if (fd >= 0) close(fd);
        for (unsigned k = 0; k < VMM_BROKER_MAX_FDS; k++) {
            fd = __atomic_exchange_n(&g_batch_fds[i][k], 0, __ATOMIC_ACQ_REL) - 1;
            if (fd >= 0) close(fd);
        }
    }
    g_path[0] = 0;
    g_owner_pid = 0;
    vmm__holders_forget_after_fork();
    vmm__broker_warn_again();
    __atomic_store_n(&g_state, ST_IDLE, __ATOMIC_RELEASE);
}

void vmm__broker_set_idle(vmm__broker_idle_fn fn) { __atomic_store_n(&g_idle, fn, __ATOMIC_RELEASE); }

void vmm__broker_wake(void)
{
    int fd = __atomic_load_n(&g_wake_fd, __ATOMIC_ACQUIRE);
    uint64_t one = 1;
    if (fd >= 0) (void)!write(fd, &one, sizeof one);
}
