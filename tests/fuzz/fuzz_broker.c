/* Fuzz target: the broker's request parser (serve_request in shim/broker/broker.c, included here
 * as tests/unit/test_broker.c does, so its statics are reachable) fed datagrams from a peer on
 * one SOCK_SEQPACKET connection, as many as a kept connection carries.
 *
 * Input: byte 0 bit 0 says whether the peer passed the credentials check; then datagrams, each
 * a length byte and that many bytes (a short last one is sent as it is).  All are queued before
 * the broker reads, like a peer that pipelines, then the peer shuts its side.  Each request the
 * broker reads must get exactly one reply: a sound one its export function's answer (an fd passed
 * only with status 0), anything else -EPROTO or, for a refused peer, -EACCES, after which the
 * broker drops the connection.  The export function checks it is handed the request's very
 * fields and answers by the slot's low bits: an fd, -ESTALE, -ENOENT, a positive errno (the broker
 * negates it), success with no fd (the broker must not pass one), or an fd with an error (the
 * broker must close it); every fd it is given is closed once the request is served. */
#include "../../shim/broker/broker.c"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_DATAGRAMS 64

static vmm_broker_request g_sent;   /* the request now being served, as the peer sent it */
static bool g_sent_sound;           /* ... and whether the broker should pass it on */
static int g_exports;               /* export calls made for the request now being served */
static int g_memfd = -1;            /* what a successful export hands out (a duplicate of it) */
static int g_given = -1;            /* the fd the export gave the broker for the request */

static int fake_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], int *fd, uint64_t *mapped_size,
                       uint32_t *device)
{
    g_exports++;
    if (!g_sent_sound || slot != g_sent.slot || generation != g_sent.generation ||
        memcmp(alloc_id, g_sent.alloc_id, sizeof g_sent.alloc_id) != 0)
        abort(); /* the broker passed on something the peer did not send */
    *mapped_size = 2u << 20;
    *device = (uint32_t)(generation & 7);
    switch (slot & 7) {
    case 1: return -ESTALE;
    case 2: return -ENOENT;
    case 3: return EIO;
    case 4: return 0; /* success without an fd */
    case 5: *fd = g_given = dup(g_memfd); return -EBUSY;
    default: *fd = g_given = dup(g_memfd); return g_given < 0 ? -EMFILE : 0;
    }
}

/* The expected status of a served request. */
static int32_t expected_status(bool allowed, const uint8_t *dg, size_t len)
{
    if (!allowed) return -EACCES;
    vmm_broker_request q;
    if (len != sizeof q) return -EPROTO;
    memcpy(&q, dg, sizeof q);
    if (q.magic != VMM_BROKER_MAGIC || q.version != VMM_BROKER_VERSION) return -EPROTO;
    switch (q.slot & 7) {
    case 1: return -ESTALE;
    case 2: return -ENOENT;
    case 3: return -EIO;
    case 4: return -EIO;
    case 5: return -EBUSY;
    default: return 0;
    }
}

/* Read the one reply the broker owes: status checked, any fd closed. */
static void take_reply(int fd, int32_t want)
{
    vmm_broker_reply rep;
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(4 * sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = &rep, .iov_len = sizeof rep};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof ctl.buf;
    ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n != (ssize_t)sizeof rep || rep.magic != VMM_BROKER_MAGIC || rep.status != want) abort();
    int fds = 0;
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
    if (fds != (want == 0) || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) abort();
    if (want == 0 && rep.mapped_size != (2u << 20)) abort();
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
        g_given = -1;
        if (served < n) {
            int32_t st = expected_status(allowed, dg[served], len[served]);
            g_sent_sound = st != -EPROTO && st != -EACCES;
            memset(&g_sent, 0, sizeof g_sent);
            memcpy(&g_sent, dg[served], len[served] < sizeof g_sent ? len[served] : sizeof g_sent);
        } else {
            g_sent_sound = false;
        }
        bool keep = serve_request(&cfg, &c);
        if (g_given >= 0 && fcntl(g_given, F_GETFD) != -1) abort(); /* the broker kept its copy */
        if (served == n || len[served] == 0) {
            if (keep) abort(); /* end of stream: the connection is done with */
            break;
        }
        int32_t want = expected_status(allowed, dg[served], len[served]);
        if (g_exports != (want != -EPROTO && want != -EACCES)) abort();
        take_reply(sv[1], want);
        if (keep != (want != -EPROTO && want != -EACCES)) abort();
        if (!keep) break;
    }
    close(sv[0]);
    close(sv[1]);
    return 0;
}
