/* Keepers (layout.h, KEEP): a companion that holds an owner's memory so that it outlives the
 * owner keeps one file per owner beside the registry and holds a lock on it.  Three sides use
 * this: the owner (the shim) rings its keeper when memory goes back and before it fails for lack
 * of it, and leaves its records at an abnormal exit(); readers (the client library, gc) ask
 * whether a living keeper keeps an owner; the keeper (vmmctl keep) claims, marks and lets go. */
#ifndef VMM_REGISTRY_KEEP_H
#define VMM_REGISTRY_KEEP_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "registry/registry.h"

/* The owner waits for its keeper this long at most before it fails for lack of memory.  The wait
 * ends as soon as the keeper's pass has closed what the owner freed; that pass can take over 100 ms
 * when the owner has hundreds of thousands of allocations or gave back tens of GiB (closing the
 * last fd of a 76 GiB handle frees it), and a shorter bound failed a program on an H100 that
 * natively succeeds (bench oom with a keeper: a ballast allocated right after the last one's free). */
#define VMM__KEEP_LET_GO_MS 2000u
/* An owner exiting with a failure waits this long at most for its keeper to take what it holds. */
#define VMM__KEEP_EXIT_WAIT_MS 2000u
/* An owner waits only for a keeper whose heartbeat is this recent. */
#define VMM__KEEP_HEARTBEAT_NS 1000000000ull

/* ---- owner side (the shim; r attached) ----
 * Ring this process's keeper, if one keeps it (one relaxed load when none does); with wait_ms,
 * wait that long at most for a pass of the keeper that began after the ring (it has let go of
 * every chunk this process no longer publishes).  Never fails: without a keeper, or one that
 * does not answer, it returns. */
void vmm__keep_ring(vmm__reg *r, unsigned wait_ms);
/* exit(status) runs: a keeper that keeps this process learns the status; true when the process
 * should leave its records (and name table, frames file) for the keeper, as a crash would:
 * a living keeper keeps it and status is not 0.  Then it also waits (VMM__KEEP_EXIT_WAIT_MS at
 * most) for the keeper to take every chunk it has not taken yet, while the broker still serves. */
bool vmm__keep_exiting(vmm__reg *r, int status);
/* vmmctl release: ask the keeper of (pid, start_time) to let go, and wait wait_ms at most until
 * it has.  0; -ENOENT or -ESRCH when no keeper keeps it; -ETIMEDOUT; another -errno. */
int vmm__keep_ask_release(const vmm__reg *r, uint32_t pid, uint64_t start_time, unsigned wait_ms);
/* In a fork child: the parent's keeper is not the child's. */
void vmm__keep_forget_after_fork(void);

/* ---- readers ----
 * The keep file of owner (pid, start_time) beside r: 0 with *out filled when a living keeper keeps
 * it (its lock is held); -ESRCH (out filled) when the file is there but no keeper holds it (the
 * keeper died, or is letting go); -ENOENT when there is none; -EPROTO when it is not a valid keep
 * file of that owner; another -errno when it cannot be read.  out may be NULL. */
int vmm__keep_read(const vmm__reg *r, uint32_t pid, uint64_t start_time, vmm_keep_file *out);
/* A living keeper keeps owner (pid, start_time). */
bool vmm__keep_held(const vmm__reg *r, uint32_t pid, uint64_t start_time);
/* gc: remove the keep file of (pid, start_time) unless a keeper holds it; and every keep file
 * beside r that no keeper holds and whose owner is dead (how many went). */
void vmm__keep_unlink_unheld(const vmm__reg *r, uint32_t pid, uint64_t start_time);
unsigned vmm__keep_sweep(const vmm__reg *r);

/* ---- keeper side (r opened writable; nothing attached) ---- */
typedef struct vmm__keep {
    int fd;
    vmm_keep_file *f;
    char name[256];
    uint32_t proc_index, proc_gen, owner_pid;
    uint64_t owner_start_time;
} vmm__keep;
/* Keep the owner in proc slot `index` (whose record reads as p): make or take its keep file, lock
 * it, fill it (socket: this keeper's broker socket) and store this pid in the owner's keeper_pid.
 * 0; -EBUSY when another keeper holds it (*holder: its pid, when the file says); -ESRCH when the
 * slot no longer holds that owner; another -errno; a one-line reason in err. */
int vmm__keep_claim(vmm__reg *r, uint32_t index, const vmm_reg_proc *p, const char *socket, vmm__keep *k,
                    uint32_t *holder, char *err, size_t errlen);
/* Wait until the bell moves past `seen` or ms pass; returns the bell. */
uint32_t vmm__keep_wait(vmm__keep *k, uint32_t seen, unsigned ms);
/* A pass that began with bell `bell` has dropped what the owner no longer publishes. */
void vmm__keep_done(vmm__keep *k, uint32_t bell);
/* Wake the keeper's own wait on the bell (a thread of the keeper saw the owner end). */
void vmm__keep_nudge(vmm__keep *k);
/* The keeper is there (the heartbeat an owner checks before it waits), with no pass finished. */
void vmm__keep_beat(vmm__keep *k);
/* The owner has died: set VMM_REG_F_KEPT on record `slot` if it still is (owner, generation).
 * 0, or -ESTALE. */
int vmm__keep_mark(vmm__reg *r, const vmm__keep *k, uint64_t slot, uint64_t generation);
/* The owner has died: its broker_path names this keeper's socket from now on.  0, or -ESRCH when
 * its slot holds another process. */
int vmm__keep_take_broker(vmm__reg *r, const vmm__keep *k, const char *socket);
/* Let go: clear the owner's keeper_pid (if it still names this keeper), state RELEASED, remove
 * the file and drop the lock. */
void vmm__keep_end(vmm__reg *r, vmm__keep *k);
#endif
