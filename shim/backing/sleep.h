/* Sleep and wake (sleep.c): give the physical memory under a tag's pools back to the device while
 * their address reservations stay, and map fresh memory at the same addresses later.  Called by
 * shim/hooks/publish.c (vmm_pause, vmm_resume) and, for the one check a free of paused memory
 * needs, by backing.c. */
#ifndef VMM_BACKING_SLEEP_H
#define VMM_BACKING_SLEEP_H
#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

#include "pool/pool.h"

typedef struct vmm__sleep_out {
    uint64_t released;    /* pause: bytes given back; resume: bytes mapped again */
    uint64_t kept;        /* bytes of contents copied out (pause) or back (resume) */
    uint64_t not_shim;    /* the real allocator's memory of this process, and the program's own VMM memory
                             the pause cannot release (no stand-in), left on the device */
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
/* The one-line reason of a failed pause or resume into why, and rc back (both sides' calls). */
int vmm__sleep_say(char *why, size_t len, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* ---- the program's own VMM memory (adopt_sleep.c), paused and resumed inside the same calls ----
 * adopt_sleep.c stands above this file (it calls the copy helpers below), so this file reaches it
 * only through the functions it hands in (as export.c reaches adopt.c), never by name. */

/* One pause's copy state: the unlinked file (VMM_PAUSE_FILE) and the staging buffer. */
typedef struct vmm__sleep_io vmm__sleep_io;
/* Copy n bytes at addr out (the memory's context current): *kept holds them until
 * vmm__sleep_kept_free.  0, -ENOMEM, -ENOSPC or -EIO. */
int vmm__sleep_keep(vmm__sleep_io *io, CUdeviceptr addr, uint64_t n, void **kept);
/* Copy kept bytes back to addr (context current): 0 or -ENOMEM / -EIO. */
int vmm__sleep_restore(vmm__sleep_io *io, CUdeviceptr addr, void *kept);
void vmm__sleep_kept_free(void *kept);

typedef struct vmm__sleep_adopted {
    /* What the tag selects: *any pausable memory, *paused some of it, *awake some not; *left the
     * bytes it cannot pause (VMMSHIM_SLEEP_ADOPTED off), reported in bytes_not_shim. */
    void (*survey)(const char *tag, int *any, int *paused, int *awake, uint64_t *left);
    /* The contexts its memory was made in, each once, to be waited for before a pause. */
    int (*contexts)(const char *tag, CUcontext *ctx, int max);
    /* As vmm__sleep_pause / vmm__sleep_resume, with no lock of this file held (adopt.c takes
     * vmm__S.lock under its own when it publishes). */
    int (*pause)(const char *tag, unsigned flags, vmm__sleep_io *io, vmm__sleep_out *out, char *why, size_t len);
    int (*resume)(const char *tag, vmm__sleep_io *io, vmm__sleep_out *out, char *why, size_t len);
} vmm__sleep_adopted;
/* Called once, from adopt_sleep.c's constructor (an atomic store). */
void vmm__sleep_adopted_by(const vmm__sleep_adopted *ops);
#endif
