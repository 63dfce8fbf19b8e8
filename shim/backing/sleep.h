/* Sleep and wake (sleep.c): give the physical memory under a tag's pools back to the device while
 * their address reservations stay, and map fresh memory at the same addresses later.  Called by
 * shim/hooks/publish.c (vmm_pause, vmm_resume) and, for the one check a free of paused memory
 * needs, by backing.c. */
#ifndef VMM_BACKING_SLEEP_H
#define VMM_BACKING_SLEEP_H
#include <stddef.h>
#include <stdint.h>

#include "pool/pool.h"

typedef struct vmm__sleep_out {
    uint64_t released;    /* pause: bytes given back; resume: bytes mapped again */
    uint64_t kept;        /* bytes of contents copied out (pause) or back (resume) */
    uint64_t not_shim;    /* the real allocator's memory of this process, left on the device */
    uint64_t segments;    /* handles released or made */
    uint64_t allocations; /* live allocations paused or resumed */
} vmm__sleep_out;

/* flags: VMM_PAUSE_* (api/vmm_api.h).  0, or: -ENODEV the shim is not active; -ENOENT no pool
 * holds memory of that tag; -EALREADY some of it is paused already (resume first); -EBUSY a stream
 * is being captured, or the broker kept exporting a segment; -ENOMEM the host copy could not be
 * made (nothing of that arena was released); -EIO a driver call or the file failed.  why: one line. */
int vmm__sleep_pause(const char *tag, unsigned flags, vmm__sleep_out *out, char *why, size_t len);
/* 0, or: -ENODEV; -ENOENT; -EALREADY nothing of it is paused; -ENOMEM the device is full: nothing
 * changed, the memory stays paused with its contents, and a later resume may succeed; -EIO. */
int vmm__sleep_resume(const char *tag, vmm__sleep_out *out, char *why, size_t len);
/* Hands the broker the control function that serves pause and resume from outside the process
 * (protocol v4), refused unless VMMSHIM_REMOTE_PAUSE=1.  An atomic store: called once, from the
 * face's constructor (shim/hooks/pause.c), so that the allocation path gains nothing. */
void vmm__sleep_serve_remote(void);
/* vmm__S.lock held: a live allocation of a paused arena is being freed: its kept contents go. */
void vmm__sleep_forget_locked(vmm__block *b);
#endif
