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
    /* pause: of the bytes released, those companions still held after the wait
     * (VMMSHIM_PAUSE_HOLD_WAIT_MS), how many pids held them, the first of those */
    uint64_t held;
    uint32_t n_holders;
    uint32_t holders[8];
    /* pause: where its time went (the one info line at its end; VMMSHIM_LOG_LEVEL=info), since
     * a kept pause is judged against the link's bandwidth and only the copies move bytes */
    uint64_t ns_device, ns_copy, ns_release;
    /* pause, while it runs: each released segment's key (its id) and size, for that wait */
    uint64_t *gone_keys, *gone_sizes;
    size_t n_gone, cap_gone;
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
/* vmm__S.lock held: a live allocation with a copy (b->kept) is being freed: the copy goes, whether
 * it holds paused contents or is the pinned buffer kept for the next pause. */
void vmm__sleep_forget_locked(vmm__block *b);

/* ---- the copies (sleep_copy.c), for this file's pause and resume and adopt_sleep.c's ---- */

/* The one-line reason of a failed pause or resume into why, and rc back (both sides' calls). */
int vmm__sleep_say(char *why, size_t len, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* Make ctx current (1), or nothing when it is NULL or cannot be (0); vmm__sleep_pop undoes a 1. */
int vmm__sleep_push(CUcontext ctx);
void vmm__sleep_pop(void);

#define VMM__SLEEP_IO_CTX 16
typedef struct vmm__sleep_file vmm__sleep_file;
/* One call's copy state, zeroed by the caller, ended with vmm__sleep_io_end; the fields are
 * sleep_copy.c's. */
typedef struct vmm__sleep_io {
    vmm__sleep_file *f;                /* VMM_PAUSE_FILE: the contents go to its end */
    uint64_t file_end;
    void *stage;                       /* the file's staging buffer */
    int stage_pinned;
    CUcontext ctx[VMM__SLEEP_IO_CTX];  /* contexts with copies queued, waited for by vmm__sleep_wait */
    int n_ctx;
} vmm__sleep_io;
/* The call keeps contents in an unlinked file in VMMSHIM_PAUSE_DIR: 0, or -EIO with why said. */
int vmm__sleep_io_file(vmm__sleep_io *io, char *why, size_t len);
/* Waits for what is queued, gives the staging buffer back and drops the call's hold on the file. */
void vmm__sleep_io_end(vmm__sleep_io *io);
/* Waits for every copy queued through io: 0, or -EIO when one failed (which one is not known). */
int vmm__sleep_wait(vmm__sleep_io *io);
/* Marks behind the copies queued through an io, one every 128 MiB of them while they all go to
 * one context (else, or with no event or memory to be had, no more are taken): each names the
 * caller's position (an address, a handle) up to which everything queued is copied once the mark
 * is reached, so a pause can release that while the later copies still move.  Zeroed by the caller. */
typedef struct vmm__sleep_marks {
    struct vmm__sleep_mark *m;
    size_t n, cap, next;
    uint64_t since; /* bytes queued since the last mark */
    int off;
} vmm__sleep_marks;
/* `bytes` more were queued through io, everything up to `upto` with them. */
void vmm__sleep_marks_add(vmm__sleep_io *io, vmm__sleep_marks *mk, uint64_t bytes, uintptr_t upto);
/* Waits for the next mark: 1 with *upto (*failed set when a copy before it failed), 0 when none is left. */
int vmm__sleep_marks_next(vmm__sleep_marks *mk, uintptr_t *upto, int *failed);
/* The marks not reached yet are waited for, and all of them go. */
void vmm__sleep_marks_end(vmm__sleep_marks *mk);

/* Copy n bytes at addr out (the memory's context current), into *kept: a copy made now, or the
 * buffer *kept kept idle from the last cycle.  The copy may be queued: nothing reads or frees the
 * memory before vmm__sleep_wait.  0, or -ENOMEM, -ENOSPC, -EIO with nothing held (*kept is then
 * NULL or idle again). */
int vmm__sleep_keep(vmm__sleep_io *io, CUdeviceptr addr, uint64_t n, void **kept);
/* Before a kept pause's copies to host memory: the pinned buffers its vmm__sleep_keep calls would
 * make one by one (slots[i] for sizes[i] bytes) made now, on several threads, and left in the
 * slots for keep to copy into.  What cannot be made here keep makes itself.  Returns how many. */
int vmm__sleep_pin_ahead(void **slots[], const uint64_t sizes[], size_t n);
/* Whether a kept pause would pin a new buffer for n bytes in slot (1 MiB or more, and none there
 * that large). */
int vmm__sleep_lacks_buffer(void *const *slot, uint64_t n);
/* Made ahead of a pause, outside any lock: the buffers for (addrs[i], sizes[i]) in out[i] (NULL
 * where none), with ctx current for the driver; the caller attaches them under its lock to the
 * allocations still there and still lacking one, and frees the rest (vmm__sleep_kept_free). */
void vmm__sleep_prepare_buffers(CUcontext ctx, const uint64_t sizes[], void *out[], size_t n);
/* vmm_pause_prepare: the pinned buffers a kept pause of tag (NULL: everything) would make, made
 * now on several threads with no lock held while they are made, and left with their allocations.
 * Returns the bytes made ready; -ENODEV when the shim is not active. */
int64_t vmm__sleep_prepare(const char *tag);
/* vmm_paused_overlaps: whether any of the n ranges [starts[i], starts[i] + sizes[i]) overlaps memory
 * of this process that is paused now (the pools' paused arenas, the program's own paused ranges). */
int vmm__sleep_overlaps(const uint64_t *starts, const uint64_t *sizes, size_t n);
/* vmm_sleep_host / vmm_sleep_drop_host (vmm_api.h): 0 or -ENOENT; the bytes freed. */
int vmm__sleep_host(uint64_t addr, void **host, uint64_t *bytes);
uint64_t vmm__sleep_drop_host(const char *tag);
/* Where kept's host bytes (its contents, or the idle pinned buffer, which holds its last pause's)
 * hold the byte at off: *host and the *bytes from there; 0, or -ENOENT when it holds none there
 * (discarded, in a file, off past them). */
int vmm__sleep_host_at(const void *kept, uint64_t off, void **host, uint64_t *bytes);
/* An idle pinned buffer (holding no contents) goes: the bytes freed, *kept NULL then; else 0. */
uint64_t vmm__sleep_drop_idle(void **kept);
/* Whether kept holds contents (a discarded pause keeps none, an idle buffer holds none). */
int vmm__sleep_holds(const void *kept);
/* Copy the kept contents back to addr (context current); maybe queued, as vmm__sleep_keep's.
 * 0 or -ENOMEM / -EIO. */
int vmm__sleep_restore(vmm__sleep_io *io, CUdeviceptr addr, void *kept);
/* The contents are no longer needed (restored and waited for, or a failed pause undone): the
 * pinned buffer stays, idle, for the next pause while VMMSHIM_PAUSE_HOST_CACHE allows, else
 * goes (*kept NULL then). */
void vmm__sleep_kept_done(void **kept);
/* The allocation goes: its copy, contents or idle buffer, goes too. */
void vmm__sleep_kept_free(void *kept);

/* ---- the program's own VMM memory (adopt_sleep.c), paused and resumed inside the same calls ----
 * adopt_sleep.c stands above this file (it calls the copies above), so sleep.c reaches it
 * only through the functions it hands in (as export.c reaches adopt.c), never by name. */

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
    /* As vmm__sleep_prepare, for the program's own memory: the bytes made ready. */
    uint64_t (*prepare)(const char *tag);
    /* Whether any of the n ranges overlaps the program's own memory that is paused now. */
    int (*overlaps)(const uint64_t *starts, const uint64_t *sizes, size_t n);
    /* As vmm__sleep_host and vmm__sleep_drop_host, for the program's own memory. */
    int (*host)(uint64_t addr, void **host, uint64_t *bytes);
    uint64_t (*drop_host)(const char *tag);
} vmm__sleep_adopted;
/* Called once, from adopt_sleep.c's constructor (an atomic store). */
void vmm__sleep_adopted_by(const vmm__sleep_adopted *ops);
#endif
