/* Pause or resume another process's memory through its broker (protocol v4: vmm_pause_process,
 * vmm_resume_process, vmmctl pause/resume).  The owner is found by pid among the registry's
 * process records (its broker_path), connected to as an import connects (broker.c), asked once on
 * a connection of its own (a pause may take seconds: no kept import connection waits behind it),
 * and its one-line reason becomes the caller's.  A pause asks for the holders too
 * (VMM_BROKER_REQ4_HOLDERS); an owner that predates them is asked again without, and its report
 * says they are unknown.  Calls broker.c, owners.c and records.c. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "broker/protocol.h"
#include "registry/registry.h"

#include "import/internal.h"

/* The owner does the whole copy before it answers (GBs at the link's bandwidth, or to a file). */
#define CONTROL_TIMEOUT_MS (600 * 1000)

typedef struct {
    uint32_t pid;
    vmm_proc_info *out;
    bool found;
} pid_match;

/* The pid's record, a living one before any other (a dead image of a reused pid may linger). */
static int match_pid(void *ctx, const vmm_proc_info *p)
{
    pid_match *m = ctx;
    if (p->pid != m->pid) return 0;
    if (!m->found || p->alive == VMM_OWNER_ALIVE) *m->out = *p;
    m->found = true;
    return p->alive == VMM_OWNER_ALIVE;
}

static vmm_status refused(const char *fn, uint32_t pid, int32_t status, const char *why)
{
    vmm_status st;
    switch (-status) {
    case EPERM: st = VMM_ERR_ACCESS; break;
    case EOPNOTSUPP:
    case ENODEV: st = VMM_ERR_NO_SHIM; break;
    case ENOENT: st = VMM_ERR_NOT_FOUND; break;
    case EALREADY: st = VMM_ERR_STATE; break;
    case EBUSY: st = VMM_ERR_BUSY; break;
    case ENOSPC:
    case ENOMEM: st = VMM_ERR_NOMEM; break;
    case EINVAL: st = VMM_ERR_INVALID; break;
    case EACCES:
        return set_err(VMM_ERR_ACCESS, "%s: owner pid %u's broker refused this uid (%u); the owner's "
                                       "VMMSHIM_BROKER_GROUP decides who else may", fn, pid, (unsigned)geteuid());
    default: st = VMM_ERR_IO; break;
    }
    if (why[0] && -status == EPERM) return set_err(st, "%s", why); /* it names the pid and the option */
    if (why[0]) return set_err(st, "%s: pid %u: %s", fn, pid, why);
    return set_err(st, "%s: pid %u: %s", fn, pid, status < 0 && status > -4096 ? strerror(-status) : "unknown status");
}

/* The report's tail padding took flags (api/vmm_api.h): a caller of the older struct passes 96. */
_Static_assert(sizeof(vmm_sleep_report) == 96, "vmm_sleep_report grew: older callers' report_size");
_Static_assert(sizeof(((vmm_sleep_report *)0)->holders) == VMM_BROKER_HELD_PIDS * sizeof(uint32_t), "holders[8]");

typedef union {
    vmm_broker_reply4h rep;
    vmm_broker_reply rep1;
    uint8_t raw[sizeof(vmm_broker_reply4h) + 32];
} control_reply;

/* One request on s and its one answer into *in (*len its length): 0, or -errno (-ETIMEDOUT). */
static int ask(int s, const vmm_broker_request4 *q, control_reply *in, size_t *len)
{
    ssize_t n;
    do n = send(s, q, sizeof *q, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    int rc = n == (ssize_t)sizeof *q ? 0 : -(n < 0 ? errno : EIO);
    struct pollfd p = {.fd = s, .events = POLLIN};
    int pr = 0;
    if (rc == 0) {
        do pr = poll(&p, 1, CONTROL_TIMEOUT_MS);
        while (pr < 0 && errno == EINTR);
        rc = pr < 0 ? -errno : pr == 0 ? -ETIMEDOUT : 0;
    }
    memset(in, 0, sizeof *in);
    *len = 0;
    uint32_t n_fds = 0;
    int no_fd;
    if (rc == 0) rc = vmm__broker_recv_raw(s, in->raw, sizeof in->raw, len, &no_fd, 0, &n_fds);
    return rc;
}

/* A reply4 alone (the 256-byte form) from the owner's broker. */
static bool short_form(const control_reply *in, size_t len)
{
    return len == sizeof(vmm_broker_reply4) && in->rep.r.magic == VMM_BROKER_MAGIC &&
           in->rep.r.version == VMM_BROKER_VERSION4;
}

vmm_status vmm__remote_sleep(vmm_registry *reg, uint32_t pid, uint32_t op, const char *tag, unsigned flags,
                             vmm_sleep_report *report, size_t report_size)
{
    const char *fn = op == VMM_BROKER_OP_PAUSE ? "vmm_pause_process" : "vmm_resume_process";
    vmm_broker_request4 q;
    memset(&q, 0, sizeof q);
    q.magic = VMM_BROKER_MAGIC;
    q.version = VMM_BROKER_VERSION4;
    q.op = op;
    /* only a pause has holders to tell (a resume's are 0 by definition, never unknown) */
    q.flags = flags | (op == VMM_BROKER_OP_PAUSE ? VMM_BROKER_REQ4_HOLDERS : 0);
    if (tag && strlen(tag) >= sizeof q.tag)
        return set_err(VMM_ERR_INVALID, "%s: tag longer than %u bytes", fn, (unsigned)sizeof q.tag - 1);
    if (tag) memcpy(q.tag, tag, strlen(tag));

    vmm_proc_info proc;
    pid_match m = {.pid = pid, .out = &proc};
    vmm_status st = vmm__foreach_proc(reg, match_pid, &m);
    if (st != VMM_OK) return st;
    if (!m.found)
        return set_err(VMM_ERR_NOT_FOUND, "%s: pid %u is not in the registry (%s)", fn, pid,
                       vmm__pid_exists(pid) ? "not running under the shim, or another registry" : "no such process");
    if (proc.alive == VMM_OWNER_DEAD || proc.alive == VMM_OWNER_KEPT)
        return set_err(VMM_ERR_OWNER_DEAD, "%s: pid %u has exited%s", fn, pid,
                       proc.alive == VMM_OWNER_KEPT ? " (a keeper holds its memory: nothing to pause)" : "");
    if (!proc.broker_path[0])
        return set_err(VMM_ERR_NOT_FOUND, "%s: pid %u has no broker yet (it allocated nothing through the shim)", fn,
                       pid);
    vmm_alloc_info owner;
    memset(&owner, 0, sizeof owner);
    owner.pid = pid;
    owner.owner_start_time = proc.start_time;
    owner.owner_pidns = proc.pidns;
    int s = -1;
    if ((st = vmm__broker_open(reg, &owner, &s)) != VMM_OK) return st;

    control_reply in;
    size_t len = 0;
    int rc = ask(s, &q, &in, &len);
    /* The short form to a flagged request: an owner that predates the holders.  Its pause took the
     * flag for an unknown pause flag and refused before touching anything (-EINVAL), so asking
     * again without it is safe; any other refusal (-EPERM: no opt-in) stands as it came. */
    bool unknown = false;
    if (rc == 0 && (q.flags & VMM_BROKER_REQ4_HOLDERS) && short_form(&in, len)) {
        unknown = true;
        q.flags &= ~VMM_BROKER_REQ4_HOLDERS;
        if (in.rep.r.status == -EINVAL) rc = ask(s, &q, &in, &len);
    }
    close(s);
    if (rc == -ETIMEDOUT)
        return set_err(VMM_ERR_IO, "%s: pid %u's broker did not answer within %d s", fn, pid, CONTROL_TIMEOUT_MS / 1000);
    if (rc) {
        if (vmm__owner_liveness(&owner) == VMM__DEAD) return set_err(VMM_ERR_OWNER_DEAD, "%s: pid %u has exited", fn, pid);
        return set_err(VMM_ERR_IO, "%s: pid %u's broker: %s", fn, pid, strerror(-rc));
    }
    if (len == sizeof(vmm_broker_reply) && in.rep1.magic == VMM_BROKER_MAGIC) {
        if (in.rep1.status == -EPROTO)
            return set_err(VMM_ERR_VERSION, "%s: pid %u's shim predates remote pause (its broker does not speak "
                                            "protocol v4)", fn, pid);
        return refused(fn, pid, in.rep1.status, "");
    }
    bool with_held = q.flags & VMM_BROKER_REQ4_HOLDERS;
    if (len != (with_held ? sizeof(vmm_broker_reply4h) : sizeof(vmm_broker_reply4)) ||
        in.rep.r.magic != VMM_BROKER_MAGIC || in.rep.r.version != VMM_BROKER_VERSION4)
        return set_err(VMM_ERR_IO, "%s: pid %u's broker sent a malformed reply", fn, pid);
    const vmm_broker_reply4 *rep = &in.rep.r;
    in.rep.r.why[sizeof in.rep.r.why - 1] = 0;
    if (report && report_size) {
        vmm_sleep_report r = {.bytes_released = rep->bytes_released, .bytes_kept = rep->bytes_kept,
                              .bytes_not_shim = rep->bytes_not_shim, .ns = rep->ns,
                              .segments = rep->segments, .allocations = rep->allocations,
                              .flags = unknown ? VMM_SLEEP_HOLDERS_UNKNOWN : 0};
        if (with_held) {
            const vmm_broker_held4 *h = &in.rep.held;
            r.bytes_held = h->bytes_held;
            r.n_holders = h->n_holders;
            uint32_t named = h->n_holders < VMM_BROKER_HELD_PIDS ? h->n_holders : VMM_BROKER_HELD_PIDS;
            memcpy(r.holders, h->holders, named * sizeof r.holders[0]);
        }
        memcpy(report, &r, report_size < sizeof r ? report_size : sizeof r);
    }
    if (rep->status != 0) return refused(fn, pid, rep->status, rep->why);
    vmm__error(VMM_OK, "%s", ""); /* no stale reason */
    return VMM_OK;
}
