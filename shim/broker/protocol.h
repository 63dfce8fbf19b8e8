/* Broker wire format: on a SOCK_SEQPACKET connection, each request gets one reply (+ SCM_RIGHTS
 * fds when status is 0); a peer may send any number of requests, one at a time, on one connection.
 * The broker closes a connection idle for 60 s, or the longest idle one when it has 64 open: a
 * peer reconnects when its next request finds the connection closed.  Little-endian fixed-width
 * fields; a reader in any language can speak it.
 *
 * Five request versions, told apart by `version` and the datagram's exact length:
 *
 *   v1 (vmm_broker_request, 40 bytes): one handle.  The reply is a vmm_broker_reply (24 bytes)
 *   with one fd.  An allocation made of several handles (registry MULTI-HANDLE records) cannot be
 *   served this way: its v1 request gets -EPROTONOSUPPORT, never a part of it.
 *
 *   v2 (vmm_broker_request2, 48 bytes): handles [first, first + max) of the allocation, in
 *   address order.  The reply is a vmm_broker_reply2 (536 bytes) whose n_here fds (1 <= n_here <=
 *   min(max, VMM_BROKER_MAX_FDS)) come in one SCM_RIGHTS message, in order, with sizes[i] the
 *   size of the handle of fd i (entries from n_here on are 0).  n_total is how many handles the
 *   allocation has; a peer wanting more asks again from first + n_here.  Each request is checked
 *   anew (slot, generation, id), so an allocation freed between two requests gets -ESTALE or
 *   -ENOENT, never handles of another.  first >= n_total gets -ERANGE, max 0 gets -EINVAL.
 *   A one-handle allocation answers v2 too (n_total 1).
 *
 *   v3 (vmm_broker_request3, 16 + 40 * n_entries bytes): a batch, so that a companion taking many
 *   allocations at once (vmm_import_many) makes one round trip, not one per chunk.  Entry i names
 *   an allocation as a v2 request does (slot, generation, alloc_id) and the run of its handles
 *   wanted: [first, first + count), count 0 meaning "to the last".  The answer is a stream of
 *   vmm_broker_reply3 messages (1568 bytes each, seq 0, 1, 2, ...), the last one flagged
 *   VMM_BROKER_REPLY_LAST.  A message carries 0..64 fds in one SCM_RIGHTS message; fds[k] says
 *   which entry and which handle of it fd k is, with the handle's size, the allocation's handle
 *   count and its device.  Handles come in request order: entry 0's first..., then entry 1's.  Each
 *   entry is checked anew as its handles are exported (a v2 request's checks); the first entry that
 *   fails ends the batch: the last message then has status (-ESTALE, -ENOENT, -ERANGE, ...) and
 *   `entry` set to it, and carries no fd; fds sent before it are the peer's (to close).  An empty
 *   last message (status 0, n_here 0) may close a batch whose final handles went in the message
 *   before.  n_entries 0 or above VMM_BROKER_MAX_ENTRIES, or flags other than 0 or
 *   VMM_BROKER_REQ3_REPEATS, get one last message with -EINVAL.  The broker reads no further request from the connection until the batch's last
 *   message is queued, so a peer sends its next request after receiving that one.  The broker
 *   queues messages as the peer's socket takes them (one slow peer stalls nobody else); a peer
 *   that reads nothing for 60 s is disconnected.  A broker older than v3 answers -EPROTO (v1 form)
 *   and closes the connection: the peer reconnects and asks with v1/v2, one allocation at a time.
 *   Repeats (flags VMM_BROKER_REQ3_REPEATS): a stream-ordered pool packs the end of one
 *   allocation and the start of the next into one handle, so a batch may name a handle twice.
 *   With this flag the broker passes each handle's fd once a batch; a later entry's handle that
 *   the batch passed already comes as an fds[k] with VMM_BROKER_FD3_REPEAT set in `device` and no
 *   fd (the peer knows it by its address in the owner and its size).  n_here then counts every
 *   fds[] entry, and the SCM_RIGHTS message carries one fd per entry without the bit, in order.
 *   A broker that predates the flag refuses such a request (-EINVAL, entry = n_entries, the
 *   connection kept); the peer asks again without it.
 *
 *   v4 (vmm_broker_request4, 80 bytes): control, not memory: pause or resume the owner's memory
 *   (vmm_pause / vmm_resume from outside the process).  `op` is VMM_BROKER_OP_PAUSE or
 *   VMM_BROKER_OP_RESUME, `flags` VMM_PAUSE_DISCARD | VMM_PAUSE_FILE for a pause (0 for a resume),
 *   `tag` NUL-padded (all zero: the whole process).  The reply is a vmm_broker_reply4 (256 bytes,
 *   no fd): status, the op echoed, the vmm_sleep_report's six fields and a one-line
 *   `why` when status != 0.  The peer's rights are an import's (checked at connect).  Besides the
 *   vmm_pause statuses (-ENOENT, -EALREADY, -EBUSY, -ENOMEM, -EIO), -EPERM: the owner did not opt
 *   in (VMMSHIM_REMOTE_PAUSE=1), since a program that launches kernels while its memory goes
 *   away crashes; -EOPNOTSUPP: this broker serves no control (a keeper; an owner that allocated
 *   nothing from the shim's pools yet); -EINVAL: unknown op or flags, or a tag not NUL-terminated.
 *   The broker thread runs the pause itself (the device waited for first), so the reply may take
 *   as long as the copy (seconds for GBs) and other peers wait meanwhile.  A broker that
 *   predates v4 answers -EPROTO (v1 form) and closes the connection: the client says the owner's
 *   shim is too old for a remote pause; there is nothing to fall back to.
 *   Holders (flags | VMM_BROKER_REQ4_HOLDERS, a bit of the wire's, never passed on as a pause
 *   flag): the reply is a vmm_broker_reply4 followed by a vmm_broker_held4 (304 bytes in all,
 *   whatever the status), which says what vmm_pause's report appended: of bytes_released, the
 *   bytes companions still held after the owner's bounded wait, how many pids held them and the
 *   first 8 of those (all 0 for a resume).  A reply4 alone had no room for them.  A broker that
 *   predates the flag hands it to its pause with the rest of the flags, which refuses it as
 *   unknown before touching anything: its reply is the 256-byte form with -EINVAL (or an earlier
 *   refusal, -EPERM ...).  So a 256-byte answer to a flagged request means "an owner that cannot
 *   say who holds": the peer asks again on the same connection without the flag (a refusal other
 *   than -EINVAL is final as it stands) and reports the holders as unknown, not as none.
 *
 *   v5 (vmm_broker_release5, 16 + 24 * n bytes): no reply, no fd.  A companion says which imports
 *   of the owner's memory it let go of (its import cache unmapped them), so that a pause can tell
 *   who still holds paused memory (shim/broker/holders.c).  Entry i names what went: `key` (a
 *   segment id as the owner's export gave it: the chunk id of a one-handle record) drops every
 *   entry of that key the sender's pid holds; with key VMM_BROKER_NO_KEY, (slot, generation)
 *   drops what the sender took by asking for that allocation.  n is 1 .. VMM_BROKER_MAX_RELEASES,
 *   flags 0; anything else is -EPROTO (v1 form) and the connection closes, as a broker older than
 *   v5 answers any v5 datagram: a client that finds that answer queued stops telling that owner.
 *   The client sends these on a connection of their own, never on its request connection, so
 *   that no reply it does not wait for lands among those it does.
 *
 * An error reply to a v2 request is a vmm_broker_reply2 as well, and to a v3 request a
 * vmm_broker_reply3, except for requests the broker cannot read (wrong length, magic or version:
 * -EPROTO) and refused peers (-EACCES): those get a vmm_broker_reply, whatever was sent, since the
 * broker cannot tell what its peer speaks.  magic and status sit at the same offsets in all four,
 * so a peer reads them first.  A broker that predates v2 answers a v2 request with -EPROTO. */
#ifndef VMM_BROKER_PROTOCOL_H
#define VMM_BROKER_PROTOCOL_H
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#define VMM_BROKER_MAGIC 0x424d4d56u /* "VMMB" */
#define VMM_BROKER_VERSION 1u        /* vmm_broker_request: one handle */
#define VMM_BROKER_VERSION2 2u       /* vmm_broker_request2: a run of handles */
#define VMM_BROKER_VERSION3 3u       /* vmm_broker_request3: a batch of runs, a stream of replies */
#define VMM_BROKER_VERSION4 4u       /* vmm_broker_request4: pause or resume, one vmm_broker_reply4 */
#define VMM_BROKER_VERSION5 5u       /* vmm_broker_release5: imports let go of, no reply */
#define VMM_BROKER_MAX_RELEASES 2048u /* entries in one v5 datagram: 16 + 24 * 2048 bytes (48 KiB) */
#define VMM_BROKER_OP_PAUSE 1u       /* vmm_broker_request4.op */
#define VMM_BROKER_OP_RESUME 2u
/* vmm_broker_request4.flags: answer with a vmm_broker_held4 after the reply4.  The top bit, far
 * from the VMM_PAUSE_* bits (which grow from the bottom), so that no pause flag ever means it. */
#define VMM_BROKER_REQ4_HOLDERS 0x80000000u
#define VMM_BROKER_HELD_PIDS 8u      /* vmm_broker_held4.holders: vmm_sleep_report's holders[8] */
#define VMM_BROKER_TAG_LEN 64u       /* vmm_broker_request4.tag: a tag and its NUL (a shim's tag has 32) */
#define VMM_BROKER_WHY_LEN 192u      /* vmm_broker_reply4.why: one line, NUL-terminated */
/* fds in one v2 or v3 reply: 64 ints of SCM_RIGHTS stay far under the kernel's 253 per message */
#define VMM_BROKER_MAX_FDS 64u
/* A reply's status when the owner paused the allocation's memory (vmm_pause): no handle exists
 * until it resumes; "host is down" is the errno nearest to asleep. */
#define VMM_BROKER_PAUSED (-EHOSTDOWN)
/* entries in one v3 request: 16 + 40 * 2048 bytes (80 KiB) stays well under a socket's default
 * send buffer (~208 KiB), the most one datagram can be; a peer wanting more sends several */
#define VMM_BROKER_MAX_ENTRIES 2048u
#define VMM_BROKER_REPLY_LAST 1u     /* vmm_broker_reply3.flags: the batch's last message */
#define VMM_BROKER_REQ3_REPEATS 1u   /* vmm_broker_request3.flags: each handle's fd once a batch */
#define VMM_BROKER_FD3_REPEAT 0x80000000u /* vmm_broker_fd3.device: passed before in this batch, no fd */

typedef struct vmm_broker_request {
    uint32_t magic;
    uint32_t version;     /* VMM_BROKER_VERSION */
    uint64_t slot;
    uint64_t generation;
    uint8_t alloc_id[16];
} vmm_broker_request; /* 40 */

typedef struct vmm_broker_reply {
    uint32_t magic;
    int32_t status;       /* 0, or a negative errno: -ESTALE, -ENOENT, -EACCES, -EPROTO, VMM_BROKER_PAUSED, ... */
    uint64_t mapped_size;
    uint32_t device;
    uint32_t export_ns;   /* how long the owner took to export the fd (saturating): for profiles */
} vmm_broker_reply; /* 24 */

typedef struct vmm_broker_request2 {
    uint32_t magic;
    uint32_t version;     /* VMM_BROKER_VERSION2 */
    uint64_t slot;
    uint64_t generation;
    uint8_t alloc_id[16];
    uint32_t first;       /* the first handle wanted, 0-based in address order */
    uint32_t max;         /* the most handles wanted in this reply (>= 1; more than 64 reads as 64) */
} vmm_broker_request2; /* 48 */

typedef struct vmm_broker_reply2 {
    uint32_t magic;
    int32_t status;       /* as vmm_broker_reply's, and -ERANGE, -EINVAL, -EPROTONOSUPPORT (v1 only) */
    uint32_t device;
    uint32_t export_ns;   /* the owner's time exporting this reply's fds (saturating) */
    uint32_t n_total;     /* handles the allocation has */
    uint32_t n_here;      /* fds passed with this reply: handles first .. first + n_here - 1 */
    uint64_t sizes[VMM_BROKER_MAX_FDS]; /* bytes of each handle passed; the rest 0 */
} vmm_broker_reply2; /* 536 */

typedef struct vmm_broker_entry3 {
    uint64_t slot;
    uint64_t generation;
    uint8_t alloc_id[16];
    uint32_t first;       /* the first handle wanted, 0-based in address order */
    uint32_t count;       /* handles wanted from first on; 0: all of them to the last */
} vmm_broker_entry3; /* 40 */

typedef struct vmm_broker_request3 {
    uint32_t magic;
    uint32_t version;     /* VMM_BROKER_VERSION3 */
    uint32_t n_entries;   /* 1 .. VMM_BROKER_MAX_ENTRIES; the datagram is 16 + 40 * n_entries bytes */
    uint32_t flags;       /* 0 or VMM_BROKER_REQ3_REPEATS */
    /* followed by n_entries vmm_broker_entry3 */
} vmm_broker_request3; /* 16 */

typedef struct vmm_broker_fd3 {
    uint32_t entry;       /* the request entry this fd answers (entries in order, never going back) */
    uint32_t handle;      /* which handle of its allocation, 0-based in address order */
    uint32_t n_total;     /* handles the allocation has */
    uint32_t device;      /* the device the handle's memory lies on (the owner's ordinal), with
                             VMM_BROKER_FD3_REPEAT when no fd comes with this entry */
    uint64_t size;        /* the handle's bytes */
} vmm_broker_fd3; /* 24 */

typedef struct vmm_broker_reply3 {
    uint32_t magic;
    int32_t status;       /* 0, or entry `entry`'s -errno (as reply2's): the batch ends here, no fds */
    uint32_t version;     /* VMM_BROKER_VERSION3 */
    uint32_t flags;       /* VMM_BROKER_REPLY_LAST on the batch's last message */
    uint32_t entry;       /* with status != 0: the failing entry (n_entries for a malformed batch) */
    uint32_t n_here;      /* fds[] entries in this message, 0 .. 64 (fds passed: those without
                             VMM_BROKER_FD3_REPEAT); fds[n_here..] are 0 */
    uint32_t export_ns;   /* the owner's time exporting this message's fds (saturating) */
    uint32_t seq;         /* this message's place in the batch's stream, from 0 */
    vmm_broker_fd3 fds[VMM_BROKER_MAX_FDS];
} vmm_broker_reply3; /* 1568 */

typedef struct vmm_broker_request4 {
    uint32_t magic;
    uint32_t version;     /* VMM_BROKER_VERSION4 */
    uint32_t op;          /* VMM_BROKER_OP_PAUSE or VMM_BROKER_OP_RESUME */
    uint32_t flags;       /* pause: VMM_PAUSE_DISCARD | VMM_PAUSE_FILE (api/vmm_api.h); resume: 0 */
    char tag[VMM_BROKER_TAG_LEN]; /* NUL-padded; "" the whole process */
} vmm_broker_request4; /* 80 */

typedef struct vmm_broker_reply4 {
    uint32_t magic;
    int32_t status;       /* 0, or -EPERM (no opt-in), -EOPNOTSUPP, -ENOENT, -EALREADY, -EBUSY, -ENOMEM, -EIO, -EINVAL */
    uint32_t version;     /* VMM_BROKER_VERSION4 */
    uint32_t op;          /* the request's op */
    uint64_t bytes_released, bytes_kept, bytes_not_shim, ns, segments, allocations; /* vmm_sleep_report's */
    char why[VMM_BROKER_WHY_LEN]; /* with status != 0: the owner's one line, NUL-terminated */
} vmm_broker_reply4; /* 256 */

/* After a vmm_broker_reply4 in the answer to a request flagged VMM_BROKER_REQ4_HOLDERS. */
typedef struct vmm_broker_held4 {
    uint64_t bytes_held;  /* of bytes_released, what companions still held after the wait */
    uint32_t n_holders;   /* how many pids held it (all of them; holders names the first 8) */
    uint32_t reserved;    /* 0 */
    uint32_t holders[VMM_BROKER_HELD_PIDS]; /* the first min(n_holders, 8) pids; the rest 0 */
} vmm_broker_held4; /* 48 */

/* The whole answer to a flagged v4 request, as one datagram. */
typedef struct vmm_broker_reply4h {
    vmm_broker_reply4 r;
    vmm_broker_held4 held;
} vmm_broker_reply4h; /* 304 */

typedef struct vmm_broker_release5 {
    uint32_t magic;
    uint32_t version;     /* VMM_BROKER_VERSION5 */
    uint32_t n;           /* 1 .. VMM_BROKER_MAX_RELEASES; the datagram is 16 + 24 * n bytes */
    uint32_t flags;       /* 0 */
    /* followed by n vmm_broker_gone5 */
} vmm_broker_release5; /* 16 */

typedef struct vmm_broker_gone5 {
    uint64_t key;         /* a segment id, or VMM_BROKER_NO_KEY (UINT64_MAX): by slot and generation */
    uint64_t slot;
    uint64_t generation;
} vmm_broker_gone5; /* 24 */

_Static_assert(sizeof(vmm_broker_request) == 40, "request size");
_Static_assert(sizeof(vmm_broker_release5) == 16, "release5 size");
_Static_assert(offsetof(vmm_broker_release5, n) == 8, "release5.n");
_Static_assert(sizeof(vmm_broker_gone5) == 24, "gone5 size");
_Static_assert(offsetof(vmm_broker_gone5, generation) == 16, "gone5.generation");
_Static_assert(offsetof(vmm_broker_request, slot) == 8, "request.slot");
_Static_assert(offsetof(vmm_broker_request, generation) == 16, "request.generation");
_Static_assert(offsetof(vmm_broker_request, alloc_id) == 24, "request.alloc_id");
_Static_assert(sizeof(vmm_broker_reply) == 24, "reply size");
_Static_assert(offsetof(vmm_broker_reply, status) == 4, "reply.status");
_Static_assert(offsetof(vmm_broker_reply, mapped_size) == 8, "reply.mapped_size");
_Static_assert(offsetof(vmm_broker_reply, device) == 16, "reply.device");
_Static_assert(offsetof(vmm_broker_reply, export_ns) == 20, "reply.export_ns");

_Static_assert(sizeof(vmm_broker_request2) == 48, "request2 size");
_Static_assert(offsetof(vmm_broker_request2, version) == 4, "request2.version");
_Static_assert(offsetof(vmm_broker_request2, slot) == 8, "request2.slot");
_Static_assert(offsetof(vmm_broker_request2, generation) == 16, "request2.generation");
_Static_assert(offsetof(vmm_broker_request2, alloc_id) == 24, "request2.alloc_id");
_Static_assert(offsetof(vmm_broker_request2, first) == 40, "request2.first");
_Static_assert(offsetof(vmm_broker_request2, max) == 44, "request2.max");
_Static_assert(sizeof(vmm_broker_reply2) == 24 + 8 * VMM_BROKER_MAX_FDS, "reply2 size");
_Static_assert(offsetof(vmm_broker_reply2, status) == 4, "reply2.status");
_Static_assert(offsetof(vmm_broker_reply2, device) == 8, "reply2.device");
_Static_assert(offsetof(vmm_broker_reply2, export_ns) == 12, "reply2.export_ns");
_Static_assert(offsetof(vmm_broker_reply2, n_total) == 16, "reply2.n_total");
_Static_assert(offsetof(vmm_broker_reply2, n_here) == 20, "reply2.n_here");
_Static_assert(offsetof(vmm_broker_reply2, sizes) == 24, "reply2.sizes");

_Static_assert(sizeof(vmm_broker_entry3) == 40, "entry3 size");
_Static_assert(offsetof(vmm_broker_entry3, generation) == 8, "entry3.generation");
_Static_assert(offsetof(vmm_broker_entry3, alloc_id) == 16, "entry3.alloc_id");
_Static_assert(offsetof(vmm_broker_entry3, first) == 32, "entry3.first");
_Static_assert(offsetof(vmm_broker_entry3, count) == 36, "entry3.count");
_Static_assert(sizeof(vmm_broker_request3) == 16, "request3 header size");
_Static_assert(offsetof(vmm_broker_request3, version) == 4, "request3.version");
_Static_assert(offsetof(vmm_broker_request3, n_entries) == 8, "request3.n_entries");
_Static_assert(offsetof(vmm_broker_request3, flags) == 12, "request3.flags");
_Static_assert(sizeof(vmm_broker_fd3) == 24, "fd3 size");
_Static_assert(offsetof(vmm_broker_fd3, size) == 16, "fd3.size");
_Static_assert(sizeof(vmm_broker_reply3) == 32 + 24 * VMM_BROKER_MAX_FDS, "reply3 size");
_Static_assert(offsetof(vmm_broker_reply3, status) == 4, "reply3.status");
_Static_assert(offsetof(vmm_broker_reply3, version) == 8, "reply3.version");
_Static_assert(offsetof(vmm_broker_reply3, flags) == 12, "reply3.flags");
_Static_assert(offsetof(vmm_broker_reply3, entry) == 16, "reply3.entry");
_Static_assert(offsetof(vmm_broker_reply3, n_here) == 20, "reply3.n_here");
_Static_assert(offsetof(vmm_broker_reply3, export_ns) == 24, "reply3.export_ns");
_Static_assert(offsetof(vmm_broker_reply3, seq) == 28, "reply3.seq");
_Static_assert(offsetof(vmm_broker_reply3, fds) == 32, "reply3.fds");

_Static_assert(sizeof(vmm_broker_request4) == 80, "request4 size");
_Static_assert(offsetof(vmm_broker_request4, version) == 4, "request4.version");
_Static_assert(offsetof(vmm_broker_request4, op) == 8, "request4.op");
_Static_assert(offsetof(vmm_broker_request4, flags) == 12, "request4.flags");
_Static_assert(offsetof(vmm_broker_request4, tag) == 16, "request4.tag");
_Static_assert(sizeof(vmm_broker_reply4) == 256, "reply4 size");
_Static_assert(offsetof(vmm_broker_reply4, status) == 4, "reply4.status");
_Static_assert(offsetof(vmm_broker_reply4, version) == 8, "reply4.version");
_Static_assert(offsetof(vmm_broker_reply4, op) == 12, "reply4.op");
_Static_assert(offsetof(vmm_broker_reply4, bytes_released) == 16, "reply4.bytes_released");
_Static_assert(offsetof(vmm_broker_reply4, allocations) == 56, "reply4.allocations");
_Static_assert(offsetof(vmm_broker_reply4, why) == 64, "reply4.why");
_Static_assert(sizeof(vmm_broker_held4) == 48, "held4 size");
_Static_assert(offsetof(vmm_broker_held4, n_holders) == 8, "held4.n_holders");
_Static_assert(offsetof(vmm_broker_held4, holders) == 16, "held4.holders");
_Static_assert(sizeof(vmm_broker_reply4h) == 304, "reply4h size");
_Static_assert(offsetof(vmm_broker_reply4h, held) == 256, "reply4h.held");
#endif
