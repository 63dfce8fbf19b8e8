/* Fuzz target: the broker's request parser (serve_request in shim/broker/broker.c, included here
 * as tests/unit/test_broker.c does, so its statics are reachable) fed datagrams from a peer on
 * one SOCK_SEQPACKET connection, as many as a kept connection carries.
 *
 * Input: byte 0 bit 0 says whether the peer passed the credentials check; then datagrams, each
 * a length byte and that many bytes (a short last one is sent as it is).  All are queued before
 * the broker reads, like a peer that pipelines, then the peer shuts its side.  Each request the
 * broker reads must get exactly one reply of its version's form: a sound one its export
 * function's answer (fds passed only with status 0, as many as n_here, sizes as exported),
 * anything else -EPROTO or, for a refused peer, -EACCES, after which the broker drops the
 * connection.  The export function checks it is handed the request's very fields and answers by
 * the slot: bits 3..9 give the allocation 1..128 handles, bits 0..2 an fd run, -ESTALE, -ENOENT,
 * a positive errno (the broker negates it), success with no fd (the broker must say -EIO), fds
 * with an error (the broker must close them), or a count larger than asked for (-EIO, fds
 * closed); every fd it hands over is closed once the request is served. */
#include "../../shim/broker/broker.c"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_DATAGRAMS 64

/* A request as the peer sent it: v1's fields, and v2's first and max (v1: 0 and 1). */
typedef struct sent {
    int version; /* 1 or 2: read by the broker; 0: not a request it reads */
    uint64_t slot, generation;
    uint8_t id[16];
    uint32_t first, max;
} sent;

static sent g_sent;               /* the request now being served */
static bool g_sent_sound;         /* ... and whether the broker should pass it on */
static int g_exports;             /* export calls made for the request now being served */
static int g_memfd = -1;          /* what a successful export hands out (duplicates of it) */
static int g_given[VMM_BROKER_MAX_FDS + 1]; /* the fds the export gave the broker for the request */
static int g_n_given;

static uint32_t handles_of(uint64_t slot) { return 1 + (uint32_t)((slot >> 3) & 127); }
static uint64_t size_of(uint32_t i) { return (uint64_t)(i + 1) << 21; }

static int give(int *fds, uint64_t *sizes, uint32_t first, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        fds[i] = g_given[g_n_given++] = dup(g_memfd);
        if (fds[i] < 0) return -EMFILE;
        sizes[i] = size_of(first + i);
    }
    return 0;
}

static int fake_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                       int *fds, uint64_t *sizes, uint32_t *n_here, uint32_t *n_total, uint32_t *device)
{
    g_exports++;
    if (!g_sent_sound || slot != g_sent.slot || generation != g_sent.generation ||
        memcmp(alloc_id, g_sent.id, sizeof g_sent.id) != 0 || first != g_sent.first || max == 0 ||
        max != (g_sent.max < VMM_BROKER_MAX_FDS ? g_sent.max : VMM_BROKER_MAX_FDS))
        abort(); /* the broker passed on something the peer did not send */
    uint32_t n = handles_of(slot);
    *device = (uint32_t)(generation & 7);
    switch (slot & 7) {
    case 1: return -ESTALE;
    case 2: return -ENOENT;
    case 3: return EIO;
    default: break;
    }
    *n_total = n;
    if (first >= n) return -ERANGE;
    uint32_t k = n - first < max ? n - first : max;
    switch (slot & 7) {
    case 4: return 0; /* success without an fd */
    case 5: *n_here = k; return give(fds, sizes, first, k) ? -EMFILE : -EBUSY;
    case 7: *n_here = k + 1; return give(fds, sizes, first, k); /* claims one more than it gave */
    default: *n_here = k; return give(fds, sizes, first, k);
    }
}

/* What the peer sent, as the broker should read it. */
static sent parse(const uint8_t *dg, size_t len)
{
    sent q;
    memset(&q, 0, sizeof q);
    vmm_broker_request2 r;
    memset(&r, 0, sizeof r);
    memcpy(&r, dg, len < sizeof r ? len : sizeof r);
    if (r.magic != VMM_BROKER_MAGIC) return q;
    if (r.version == VMM_BROKER_VERSION && len == sizeof(vmm_broker_request)) {
        q.version = 1;
        q.max = 1;
    } else if (r.version == VMM_BROKER_VERSION2 && len == sizeof(vmm_broker_request2)) {
        q.version = 2;
        q.first = r.first;
        q.max = r.max;
    } else {
        return q;
    }
    q.slot = r.slot;
    q.generation = r.generation;
    memcpy(q.id, r.alloc_id, sizeof q.id);
    return q;
}

/* The expected status of a served request, and the fds its reply carries. */
static int32_t expected_status(bool allowed, const sent *q, uint32_t *n_fds)
{
    *n_fds = 0;
    if (!allowed) return -EACCES;
    if (!q->version) return -EPROTO;
    if (q->max == 0) return -EINVAL;
    uint32_t n = handles_of(q->slot), max = q->max < VMM_BROKER_MAX_FDS ? q->max : VMM_BROKER_MAX_FDS;
    switch (q->slot & 7) {
    case 1: return -ESTALE;
    case 2: return -ENOENT;
    case 3: return -EIO;
    default: break;
    }
    if (q->first >= n) return -ERANGE;
    switch (q->slot & 7) {
    case 4: return -EIO;
    case 5: return -EBUSY;
    case 7: return -EIO;
    default: break;
    }
    if (q->version == 1 && n != 1) return -EPROTONOSUPPORT;
    *n_fds = n - q->first < max ? n - q->first : max;
    return 0;
}

/* Did the broker call the export function for this request? */
static bool exports(bool allowed, const sent *q) { return allowed && q->version && q->max != 0; }

/* Read the one reply the broker owes: form, status, sizes checked, any fds closed. */
static void take_reply(int fd, const sent *q, int32_t want, uint32_t n_fds)
{
    union {
        vmm_broker_reply r1;
        vmm_broker_reply2 r2;
        uint8_t raw[sizeof(vmm_broker_reply2) + 8];
    } rep;
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE((VMM_BROKER_MAX_FDS + 4) * sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = &rep, .iov_len = sizeof rep};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof ctl.buf;
    ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    bool v2 = q->version == 2 && want != -EPROTO && want != -EACCES;
    size_t form = v2 ? sizeof rep.r2 : sizeof rep.r1;
    if (n != (ssize_t)form || rep.r1.magic != VMM_BROKER_MAGIC || rep.r1.status != want) abort();
    uint32_t fds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int got;
            memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
            close(got);
            fds++;
        }
    }
    if (fds != n_fds || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) abort();
    if (!v2) {
        if (want == 0 && rep.r1.mapped_size != size_of(0)) abort();
        return;
    }
    if (want == 0 && (rep.r2.n_here != n_fds || rep.r2.n_total != handles_of(q->slot) ||
                      rep.r2.device != (uint32_t)(q->generation & 7)))
        abort();
    for (uint32_t i = 0; i < VMM_BROKER_MAX_FDS; i++)
        if (rep.r2.sizes[i] != (i < n_fds ? size_of(q->first + i) : 0)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    if (g_memfd < 0 && (g_memfd = memfd_create("vmmshim-fuzz-broker", MFD_CLOEXEC)) < 0) abort();
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) abort();
    /* Room for every queued datagram (a Unix socket's queue is bounded by its sender's buffer), and
     * non-blocking so that running out of it aborts instead of hanging on the broker it drives. */
    int room = 1 << 20;
    (void)setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &room, sizeof room);
    if (fcntl(sv[1], F_SETFL, O_NONBLOCK) != 0) abort();

    bool allowed = data[0] & 1;
    const uint8_t *dg[MAX_DATAGRAMS];
    size_t len[MAX_DATAGRAMS], n = 0;
    for (size_t at = 1; at < size && n < MAX_DATAGRAMS;) {
        size_t want = data[at++];
        len[n] = want < size - at ? want : size - at;
        dg[n] = data + at;
        at += len[n];
        /* A zero-length datagram reads as end of stream on SEQPACKET: keep it, it is a case. */
        if (send(sv[1], dg[n], len[n], MSG_NOSIGNAL) != (ssize_t)len[n]) abort();
        n++;
    }
    shutdown(sv[1], SHUT_WR);

    broker_cfg cfg = {.listen_fd = -1, .export_fn = fake_export, .uid = geteuid()};
    broker_conn c = {.fd = sv[0], .allowed = allowed};
    size_t served = 0;
    for (;; served++) {
        g_exports = 0;
        g_n_given = 0;
        if (served < n) {
            g_sent = parse(dg[served], len[served]);
            g_sent_sound = exports(allowed, &g_sent);
        } else {
            memset(&g_sent, 0, sizeof g_sent);
            g_sent_sound = false;
        }
        bool keep = serve_request(&cfg, &c);
        for (int i = 0; i < g_n_given; i++)
            if (g_given[i] >= 0 && fcntl(g_given[i], F_GETFD) != -1) abort(); /* the broker kept its copy */
        if (served == n || len[served] == 0) {
            if (keep) abort(); /* end of stream: the connection is done with */
            break;
        }
        uint32_t n_fds;
        int32_t want = expected_status(allowed, &g_sent, &n_fds);
        if (g_exports != (int)exports(allowed, &g_sent)) abort();
        take_reply(sv[1], &g_sent, want, n_fds);
        if (keep != (want != -EPROTO && want != -EACCES)) abort();
        if (!keep) break;
    }
    close(sv[0]);
    close(sv[1]);
    return 0;
}
