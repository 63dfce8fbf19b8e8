/* The owner-side fd broker: a thread serving allocation fds over a Unix socket (SCM_RIGHTS).
 * Wire format (shared with shim/import/import.c) is in broker/protocol.h. */
#ifndef VMM_BROKER_H
#define VMM_BROKER_H
#include <stddef.h>
#include <stdint.h>

#include "broker/protocol.h"

/* Supplied by the shim's backing: fresh fds for handles [first, first + max) of the live
 * allocation (slot, generation) whose id matches, in address order (an allocation may span
 * several handles mapped back to back).  Returns 0 with *n_here (1 .. max) fds in fds[], each
 * handle's size in sizes[], *n_total the handles the allocation has and *device its device; the
 * broker closes the fds.  keys[i], where given, tells handle i apart from every other live
 * handle of the process (its address in the owner), so that a batch passes it once; left as the
 * broker set it (VMM_BROKER_NO_KEY), the handle is passed every time it is asked for.  Else -ESTALE when the generation moved on, -ENOENT when the slot is
 * not a live allocation of this process, -ERANGE when first >= *n_total, or another -errno; on
 * failure the broker closes fds[0 .. *n_here) (the shim's backing leaves *n_here 0). */
#define VMM_BROKER_NO_KEY UINT64_MAX
typedef int (*vmm__broker_export_fn)(uint64_t slot, uint64_t generation, const uint8_t id[16], uint32_t first,
                                     uint32_t max, int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here,
                                     uint32_t *n_total, uint32_t *device);

/* Start the broker thread once (idempotent, thread-safe).  Writes the socket path into path
 * (for the registry).  Returns 0 or -errno; never blocks the caller for long. */
int vmm__broker_start(vmm__broker_export_fn export_fn, char *path, unsigned long path_len);
/* After fork(): the child has no broker thread and must not serve its parent's memory. */
void vmm__broker_forget_after_fork(void);

/* Background work on the broker thread between requests (the shim's pre-export,
 * shim/backing/preexport.c): called after every round of polling with the export function; it
 * does at most one slow step and returns the milliseconds until it wants to run again (0: at
 * once, after the sockets were polled; -1: not before vmm__broker_wake()).  Set before the broker
 * starts or at any time (atomic). */
typedef int (*vmm__broker_idle_fn)(vmm__broker_export_fn export_fn);
void vmm__broker_set_idle(vmm__broker_idle_fn fn);
/* Control requests (protocol v4: pause or resume the owner's memory from outside), run on the
 * broker thread itself, one at a time like every request: fills rep's status, report fields and
 * why (magic, version and op are the broker's), and held's fields for a pause (who still holds
 * the released memory: sent only to a peer that asked, VMM_BROKER_REQ4_HOLDERS, a bit the
 * function never sees in q->flags).  Supplied by the shim's backing (shim/backing/sleep.c), which
 * decides whether the process accepts them; a broker without one (a keeper's) answers
 * -EOPNOTSUPP.  Set at any time (atomic). */
typedef void (*vmm__broker_control_fn)(const vmm_broker_request4 *q, vmm_broker_reply4 *rep, vmm_broker_held4 *held);
void vmm__broker_set_control(vmm__broker_control_fn fn);
/* The answer to v4 request q (control.c): built into *out, its length returned, sizeof(reply4) or,
 * when q asked for the holders, sizeof(reply4h). */
size_t vmm__broker_control(const vmm_broker_request4 *q, vmm_broker_reply4h *out);
/* Has the broker thread call its idle function soon (an eventfd write; nothing while no broker runs). */
void vmm__broker_wake(void);
#endif
