/* Protocol v4's answer (pause or resume from outside the process): the form checked here, the
 * backing's control function deciding, and the reply built in the form the peer asked for, a
 * vmm_broker_reply4 alone or followed by a vmm_broker_held4 (VMM_BROKER_REQ4_HOLDERS).  Apart from
 * broker.c, which only sends what this builds, so that the wire's forms live in one place. */
#include "broker/broker.h"
#include "broker/protocol.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static vmm__broker_control_fn g_control; /* NULL: answered -EOPNOTSUPP */

void vmm__broker_set_control(vmm__broker_control_fn fn) { __atomic_store_n(&g_control, fn, __ATOMIC_RELEASE); }

size_t vmm__broker_control(const vmm_broker_request4 *q, vmm_broker_reply4h *out)
{
    memset(out, 0, sizeof *out);
    vmm_broker_reply4 *rep = &out->r;
    /* the control function sees the pause's own flags only: the holders bit is the wire's, and
     * a pause told of it would refuse it as unknown, as an older owner's does */
    vmm_broker_request4 asked = *q;
    bool holders = asked.flags & VMM_BROKER_REQ4_HOLDERS;
    asked.flags &= ~VMM_BROKER_REQ4_HOLDERS;
    vmm__broker_control_fn control = __atomic_load_n(&g_control, __ATOMIC_ACQUIRE);
    if ((q->op != VMM_BROKER_OP_PAUSE && q->op != VMM_BROKER_OP_RESUME) ||
        memchr(q->tag, 0, sizeof q->tag) == NULL) {
        rep->status = -EINVAL;
        snprintf(rep->why, sizeof rep->why, "malformed control request (op %u)", (unsigned)q->op);
    } else if (!control) {
        rep->status = -EOPNOTSUPP;
        snprintf(rep->why, sizeof rep->why, "this broker pauses nothing (a keeper, or no memory of the shim's pools yet)");
    } else
        control(&asked, rep, &out->held);
    rep->magic = VMM_BROKER_MAGIC;
    rep->version = VMM_BROKER_VERSION4;
    rep->op = q->op;
    rep->why[sizeof rep->why - 1] = 0;
    /* what a control function left past the first min(n, 8) pids is not sent: the rest are 0 */
    for (uint32_t i = out->held.n_holders; i < VMM_BROKER_HELD_PIDS; i++) out->held.holders[i] = 0;
    out->held.reserved = 0;
    return holders ? sizeof *out : sizeof *rep;
}
