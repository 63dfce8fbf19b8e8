/* Pause or resume another process's memory through its broker (protocol v4: vmm_pause_process,
 * vmm_resume_process, vmmctl pause/resume).  The owner is found by pid among the registry's
 * process records (its broker_path), connected to as an import connects (broker.c), asked once on
 * a connection of its own (a pause may take seconds: no kept import connection waits behind it),
 * and its one-line reason becomes the caller's.  Calls broker.c, owners.c and records.c. */
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

vmm_status vmm__remote_sleep(vmm_registry *reg, uint32_t pid, uint32_t op, const char *tag, unsigned flags,
                             vmm_sleep_report *report, size_t report_size)
{
    const char *fn = op == VMM_BROKER_OP_PAUSE ? "vmm_pause_process" : "vmm_resume_process";
    vmm_broker_request4 q;
    memset(&q, 0, sizeof q);
    q.magic = VMM_BROKER_MAGIC;
    q.version = VMM_BROKER_VERSION4;
    q.op = op;
    q.flags = flags;
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

    ssize_t n;
    do n = send(s, &q, sizeof q, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    int rc = n == (ssize_t)sizeof q ? 0 : -(n < 0 ? errno : EIO);
    struct pollfd p = {.fd = s, .events = POLLIN};
    int pr = 0;
    if (rc == 0) {
        do pr = poll(&p, 1, CONTROL_TIMEOUT_MS);
        while (pr < 0 && errno == EINTR);
        rc = pr < 0 ? -errno : pr == 0 ? -ETIMEDOUT : 0;
    }
    union {
        vmm_broker_reply4 rep;
        vmm_broker_reply rep1;
        uint8_t raw[sizeof(vmm_broker_reply4) + 32];
    } in;
    memset(&in, 0, sizeof in);
    size_t len = 0;
    uint32_t n_fds = 0;
    int no_fd;
    if (rc == 0) rc = vmm__broker_recv_raw(s, in.raw, sizeof in.raw, &len, &no_fd, 0, &n_fds);
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
    if (len != sizeof(vmm_broker_reply4) || in.rep.magic != VMM_BROKER_MAGIC || in.rep.version != VMM_BROKER_VERSION4)
        return set_err(VMM_ERR_IO, "%s: pid %u's broker sent a malformed reply", fn, pid);
    in.rep.why[sizeof in.rep.why - 1] = 0;
    if (report && report_size) {
        vmm_sleep_report r = {.bytes_released = in.rep.bytes_released, .bytes_kept = in.rep.bytes_kept,
                              .bytes_not_shim = in.rep.bytes_not_shim, .ns = in.rep.ns,
                              .segments = in.rep.segments, .allocations = in.rep.allocations};
        memcpy(report, &r, report_size < sizeof r ? report_size : sizeof r);
    }
    if (in.rep.status != 0) return refused(fn, pid, in.rep.status, in.rep.why);
    vmm__error(VMM_OK, "%s", ""); /* no stale reason */
    return VMM_OK;
}
