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
 * closed); every fd it hands over is closed once the request is served.  A v3 batch (up to 6
 * entries fit a datagram here) is answered by a stream of messages, pumped as the peer reads them:
 * a model of the broker (v3_model) says which fds must come, in which message, and which status
 * ends the stream; the export function checks each call against the same model.  Each handle
 * has a key (bits 3.. of its slot and its index), so that with VMM_BROKER_REQ3_REPEATS a batch
 * naming a handle again (the same slot twice, or two slots that share those bits) must name it
 * as a repeat, with no fd.  A well-formed v5 release (n entries of 24 bytes: at most 9 fit here)
 * must be taken in silence, the connection kept; a malformed one gets -EPROTO like any other.
 * A v4 control request (80 bytes) gets one reply4, followed by a held4 (304 bytes in all) exactly
 * when it asked with VMM_BROKER_REQ4_HOLDERS: a bad op or a tag without its NUL -EINVAL, else the
 * fake control function's answer, which never sees the holders bit (it aborts if it does) and
 * names more pids than n_holders, so that the reply must show the first n_holders only. */
#include "../../shim/broker/broker.c"
#include "../../shim/broker/dir.c"
#include "../../shim/broker/holders.c"
#include "../../shim/broker/control.c"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_DATAGRAMS 64

#define MAX_ENTRIES 8 /* more than 255 bytes can carry */

/* A request as the peer sent it: v1's fields, and v2's first and max (v1: 0 and 1); a v3 batch's
 * entries (the header's fields in v3_n and v3_flags). */
typedef struct sent {
    int version; /* 1, 2 or 3: read by the broker; 0: not a request it reads */
    uint64_t slot, generation;
    uint8_t id[16];
    uint32_t first, max;
    uint32_t v3_n, v3_flags;
    vmm_broker_entry3 e[MAX_ENTRIES];
    vmm_broker_request4 q4; /* version 4: the request as sent */
} sent;

/* Where the export calls of a v3 batch stand, as the broker should make them. */
static struct {
    uint32_t at, next, in_msg;
} g_v3;

static sent g_sent;               /* the request now being served */
static bool g_sent_sound;         /* ... and whether the broker should pass it on */
static int g_exports;             /* export calls made for the request now being served */
static int g_memfd = -1;          /* what a successful export hands out (duplicates of it) */
static int g_given[MAX_ENTRIES * 128 + 1]; /* the fds the export gave the broker for the request */
static int g_n_given;

static uint32_t handles_of(uint64_t slot) { return 1 + (uint32_t)((slot >> 3) & 127); }
static uint64_t size_of(uint32_t i) { return (uint64_t)(i + 1) << 21; }
static uint64_t key_of(uint64_t slot, uint32_t handle) { return (slot >> 3) << 8 | handle; }

static int give(int *fds, uint64_t *sizes, uint64_t *keys, uint64_t slot, uint32_t first, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        fds[i] = g_given[g_n_given++] = dup(g_memfd);
        if (fds[i] < 0) return -EMFILE;
        sizes[i] = size_of(first + i);
        keys[i] = key_of(slot, first + i);
    }
    return 0;
}

/* The export function's answer to a call for handles [first, first + max) of slot: a status, and
 * on success k handles of n. */
static int answer(uint64_t slot, uint32_t first, uint32_t max, uint32_t *k)
{
    uint32_t n = handles_of(slot);
    *k = 0;
    switch (slot & 7) {
    case 1: return -ESTALE;
    case 2: return -ENOENT;
    case 3: return -EIO;
    default: break;
    }
    if (first >= n) return -ERANGE;
    *k = n - first < max ? n - first : max;
    switch (slot & 7) {
    case 4: return -EIO;  /* success without an fd */
    case 5: return -EBUSY;
    case 7: return -EIO;  /* claims one more than it gave */
    default: return 0;
    }
}

/* The max the broker must ask for next in a v3 batch (entry g_v3.at from handle g_v3.next). */
static uint32_t v3_max(const vmm_broker_entry3 *e)
{
    uint32_t max = VMM_BROKER_MAX_FDS - g_v3.in_msg;
    if (e->count && (uint64_t)e->first + e->count - g_v3.next < max)
        max = (uint32_t)((uint64_t)e->first + e->count - g_v3.next);
    return max;
}

/* After an answer of k handles (status rc) for the batch's call: where the next call stands. */
static void v3_advance(int rc, uint32_t k)
{
    if (rc != 0) {
        g_v3.at = g_sent.v3_n; /* the batch ends */
        return;
    }
    const vmm_broker_entry3 *e = &g_sent.e[g_v3.at];
    g_v3.next += k;
    g_v3.in_msg = (g_v3.in_msg + k) % VMM_BROKER_MAX_FDS;
    uint32_t end = e->count ? e->first + e->count : handles_of(e->slot);
    if (g_v3.next >= end && ++g_v3.at < g_sent.v3_n) g_v3.next = g_sent.e[g_v3.at].first;
}

static int fake_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                       int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total,
                       uint32_t *device)
{
    g_exports++;
    if (g_sent.version == 3) {
        /* the entry the batch stands at, from the handle it stands at, as many as fit */
        const vmm_broker_entry3 *e = &g_sent.e[g_v3.at];
        if (!g_sent_sound || g_v3.at >= g_sent.v3_n || slot != e->slot || generation != e->generation ||
            memcmp(alloc_id, e->alloc_id, sizeof e->alloc_id) != 0 || first != g_v3.next || max == 0 ||
            max != v3_max(e))
            abort();
        uint32_t k = 0;
        int rc = answer(slot, first, max, &k);
        v3_advance(rc, k);
    } else if (!g_sent_sound || slot != g_sent.slot || generation != g_sent.generation ||
               memcmp(alloc_id, g_sent.id, sizeof g_sent.id) != 0 || first != g_sent.first || max == 0 ||
               max != (g_sent.max < VMM_BROKER_MAX_FDS ? g_sent.max : VMM_BROKER_MAX_FDS)) {
        abort(); /* the broker passed on something the peer did not send */
    }
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
    case 5: *n_here = k; return give(fds, sizes, keys, slot, first, k) ? -EMFILE : -EBUSY;
    case 7: *n_here = k + 1; return give(fds, sizes, keys, slot, first, k); /* claims one more than it gave */
    default: *n_here = k; return give(fds, sizes, keys, slot, first, k);
    }
}

/* The control function (v4): a status from the flags, and held fields from the tag's first byte:
 * n_holders = tag[0] % 12, every one of the 8 pids set (the broker zeroes those past n_holders). */
static void fake_control(const vmm_broker_request4 *q, vmm_broker_reply4 *rep, vmm_broker_held4 *held)
{
    if (q->flags & VMM_BROKER_REQ4_HOLDERS) abort(); /* the wire's bit, never the pause's */
    rep->status = -(int32_t)(q->flags & 0x3f);
    rep->bytes_released = q->op;
    held->bytes_held = 4096;
    held->n_holders = (uint8_t)q->tag[0] % 12;
    for (uint32_t i = 0; i < VMM_BROKER_HELD_PIDS; i++) held->holders[i] = 100 + i;
}

/* Read and check the one answer a v4 request owes (allowed peer). */
static void take_reply4(int fd, const vmm_broker_request4 *q)
{
    vmm_broker_reply4h rep;
    uint8_t raw[sizeof rep + 8];
    ssize_t n = recv(fd, raw, sizeof raw, MSG_DONTWAIT);
    bool held = q->flags & VMM_BROKER_REQ4_HOLDERS;
    if (n != (ssize_t)(held ? sizeof rep : sizeof rep.r)) abort();
    memset(&rep, 0, sizeof rep);
    memcpy(&rep, raw, (size_t)n);
    bool sound = (q->op == VMM_BROKER_OP_PAUSE || q->op == VMM_BROKER_OP_RESUME) && memchr(q->tag, 0, sizeof q->tag);
    uint32_t pause_flags = q->flags & ~VMM_BROKER_REQ4_HOLDERS;
    int32_t want = sound ? -(int32_t)(pause_flags & 0x3f) : -EINVAL;
    if (rep.r.magic != VMM_BROKER_MAGIC || rep.r.version != VMM_BROKER_VERSION4 || rep.r.op != q->op ||
        rep.r.status != want || rep.r.why[sizeof rep.r.why - 1] != 0 || rep.r.bytes_released != (sound ? q->op : 0))
        abort();
    if (!held) return;
    uint32_t n_holders = sound ? (uint8_t)q->tag[0] % 12 : 0;
    if (rep.held.n_holders != n_holders || rep.held.bytes_held != (sound ? 4096u : 0u) || rep.held.reserved) abort();
    for (uint32_t i = 0; i < VMM_BROKER_HELD_PIDS; i++)
        if (rep.held.holders[i] != (i < n_holders ? 100 + i : 0)) abort();
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
    vmm_broker_request3 h;
    memcpy(&h, &r, sizeof h);
    if (r.version == VMM_BROKER_VERSION3 && len >= sizeof h && h.n_entries <= MAX_ENTRIES &&
        len == sizeof h + h.n_entries * sizeof(vmm_broker_entry3)) {
        q.version = 3;
        q.v3_n = h.n_entries;
        q.v3_flags = h.flags;
        memcpy(q.e, dg + sizeof h, h.n_entries * sizeof(vmm_broker_entry3));
        return q;
    }
    vmm_broker_release5 g;
    memcpy(&g, &r, sizeof g);
    if (r.version == VMM_BROKER_VERSION5 && len >= sizeof g && g.flags == 0 && g.n >= 1 &&
        g.n <= VMM_BROKER_MAX_RELEASES && len == sizeof g + g.n * sizeof(vmm_broker_gone5)) {
        q.version = 5; /* a release: applied to the holders table, never answered */
        return q;
    }
    if (r.version == VMM_BROKER_VERSION4 && len == sizeof(vmm_broker_request4)) {
        q.version = 4;
        memcpy(&q.q4, dg, sizeof q.q4);
        return q;
    }
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
static bool exports(bool allowed, const sent *q)
{
    if (q->version == 3) return allowed && q->v3_n > 0 && !(q->v3_flags & ~VMM_BROKER_REQ3_REPEATS);
    return allowed && q->version && q->max != 0;
}

/* The stream a v3 batch must get: the fds of each message sent (entry, handle), the status and
 * failing entry of the last one, the messages and the export calls. */
typedef struct v3_want {
    uint32_t n_fds, fd_entry[MAX_ENTRIES * 128], fd_handle[MAX_ENTRIES * 128];
    bool fd_repeat[MAX_ENTRIES * 128]; /* named again with no fd (VMM_BROKER_REQ3_REPEATS) */
    uint32_t msgs, calls, entry;
    int32_t status;
} v3_want;

/* With repeats: did an entry before this one (of the batch's fds so far) bring this handle? */
static bool brought_before(const sent *q, const v3_want *w, uint64_t key)
{
    for (uint32_t i = 0; i < w->n_fds; i++)
        if (!w->fd_repeat[i] && key_of(q->e[w->fd_entry[i]].slot, w->fd_handle[i]) == key) return true;
    return false;
}

static void v3_model(const sent *q, v3_want *w)
{
    memset(w, 0, sizeof *w);
    if (q->v3_n == 0 || (q->v3_flags & ~VMM_BROKER_REQ3_REPEATS)) {
        w->status = -EINVAL;
        w->entry = q->v3_n;
        w->msgs = 1;
        return;
    }
    uint32_t at = 0, next = q->e[0].first, in_msg = 0, msg_start = 0;
    while (at < q->v3_n) {
        const vmm_broker_entry3 *e = &q->e[at];
        if (e->count && (uint64_t)e->first + e->count > UINT32_MAX) {
            w->status = -ERANGE;
            break;
        }
        uint32_t max = VMM_BROKER_MAX_FDS - in_msg, k;
        if (e->count && e->first + e->count - next < max) max = e->first + e->count - next;
        w->calls++;
        int rc = answer(e->slot, next, max, &k);
        if (rc != 0) {
            w->status = rc;
            break;
        }
        for (uint32_t i = 0; i < k; i++) {
            w->fd_repeat[w->n_fds] = (q->v3_flags & VMM_BROKER_REQ3_REPEATS) && brought_before(q, w, key_of(e->slot, next + i));
            w->fd_entry[w->n_fds] = at;
            w->fd_handle[w->n_fds++] = next + i;
        }
        next += k;
        in_msg += k;
        if (in_msg == VMM_BROKER_MAX_FDS) { /* a full message goes */
            in_msg = 0;
            msg_start = w->n_fds;
            w->msgs++;
        }
        uint32_t end = e->count ? e->first + e->count : handles_of(e->slot);
        if (next >= end && ++at < q->v3_n) next = q->e[at].first;
    }
    if (w->status != 0) {
        w->n_fds = msg_start; /* the message that failed goes without its fds */
        w->entry = at;
        w->msgs++;
    } else if (in_msg > 0 || w->msgs == 0) {
        w->msgs++;
    }
}

/* Read what the peer has of a v3 stream (all of it when `all`, pumping the broker for more):
 * each message checked against the model; true once the last one came. */
static bool take_stream(int fd, const v3_want *w, uint32_t *msgs, uint32_t *fds_seen)
{
    for (;;) {
        vmm_broker_reply3 m;
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE((VMM_BROKER_MAX_FDS + 4) * sizeof(int))];
        } ctl;
        struct iovec iov = {.iov_base = &m, .iov_len = sizeof m};
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof ctl.buf;
        ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EAGAIN) return false;
        if (n != (ssize_t)sizeof m || m.magic != VMM_BROKER_MAGIC || m.version != VMM_BROKER_VERSION3 ||
            m.seq != *msgs || m.n_here > VMM_BROKER_MAX_FDS || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
            abort();
        uint32_t got = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int f;
                memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
                close(f);
                got++;
            }
        }
        uint32_t passed = 0;
        for (uint32_t i = 0; i < VMM_BROKER_MAX_FDS; i++) {
            const vmm_broker_fd3 *f = &m.fds[i];
            if (i >= m.n_here) {
                if (f->entry || f->handle || f->n_total || f->device || f->size) abort();
                continue;
            }
            uint32_t at = *fds_seen + i;
            if (at >= w->n_fds || f->entry != w->fd_entry[at] || f->handle != w->fd_handle[at]) abort();
            const sent *q = &g_sent;
            uint64_t slot = q->e[f->entry].slot;
            uint32_t device = (uint32_t)(q->e[f->entry].generation & 7) | (w->fd_repeat[at] ? VMM_BROKER_FD3_REPEAT : 0);
            if (f->n_total != handles_of(slot) || f->device != device || f->size != size_of(f->handle)) abort();
            passed += !w->fd_repeat[at];
        }
        if (got != passed) abort();
        *fds_seen += m.n_here;
        (*msgs)++;
        bool last = m.flags & VMM_BROKER_REPLY_LAST;
        if (m.flags & ~VMM_BROKER_REPLY_LAST) abort();
        if (!last) {
            if (m.status != 0 || *msgs >= w->msgs) abort();
            continue;
        }
        if (m.status != w->status || *msgs != w->msgs || *fds_seen != w->n_fds ||
            (m.status != 0 && (m.entry != w->entry || m.n_here != 0)))
            abort();
        return true;
    }
}

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

    vmm__broker_set_control(fake_control);
    broker_cfg cfg = {.listen_fd = -1, .export_fn = fake_export, .uid = geteuid()};
    broker_conn c = {.fd = sv[0], .allowed = allowed, .slot = -1, .pid = getpid()}; /* the holders table fills */
    size_t served = 0;
    for (;; served++) {
        g_exports = 0;
        g_n_given = 0;
        memset(&g_v3, 0, sizeof g_v3);
        if (served < n) {
            g_sent = parse(dg[served], len[served]);
            g_sent_sound = exports(allowed, &g_sent);
            if (g_sent.version == 3 && g_sent.v3_n) g_v3.next = g_sent.e[0].first;
        } else {
            memset(&g_sent, 0, sizeof g_sent);
            g_sent_sound = false;
        }
        bool keep = serve_request(&cfg, &c);
        if (g_sent.version == 3 && allowed && served < n && len[served] != 0) {
            /* the stream: read what came, pump the broker for the rest, until the last message */
            static v3_want w;
            v3_model(&g_sent, &w);
            uint32_t msgs = 0, seen = 0;
            bool done = false;
            for (int spins = 0; !done; spins++) {
                done = take_stream(sv[1], &w, &msgs, &seen);
                if (done) break;
                if (!c.batch || spins > 10000) abort(); /* the stream ended without its last message */
                struct timespec now;
                clock_gettime(CLOCK_MONOTONIC, &now);
                if (!batch_pump(&cfg, &c, &now)) abort();
            }
            if (c.batch || !keep || g_exports != (int)w.calls) abort();
            for (int i = 0; i < g_n_given; i++)
                if (g_given[i] >= 0 && fcntl(g_given[i], F_GETFD) != -1) abort();
            continue;
        }
        if (g_sent.version == 4 && allowed && served < n) {
            if (!keep || g_exports) abort(); /* control keeps the connection and exports nothing */
            take_reply4(sv[1], &g_sent.q4);
            continue;
        }
        if (g_sent.version == 5 && allowed && served < n) {
            uint8_t none[8];
            if (!keep || g_exports || recv(sv[1], none, sizeof none, MSG_DONTWAIT) != -1 || errno != EAGAIN)
                abort(); /* a release keeps the connection, exports nothing and gets no reply */
            continue;
        }
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
