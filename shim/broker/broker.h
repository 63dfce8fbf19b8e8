/* The owner-side fd broker: a thread serving allocation fds over a Unix socket (SCM_RIGHTS).
 * Wire format (shared with tools/client/import.c) is in broker/protocol.h. */
#ifndef VMM_BROKER_H
#define VMM_BROKER_H
#include <stdint.h>

/* Supplied by the shim's backing: export a fresh fd for the live allocation (slot, generation)
 * whose id matches.  Returns 0 with *fd set, -ESTALE when the generation moved on, -ENOENT when
 * the slot is not a live allocation of this process, or another -errno. */
typedef int (*vmm__broker_export_fn)(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], int *fd,
                                     uint64_t *mapped_size, uint32_t *device);

/* Start the broker thread once (idempotent, thread-safe).  Writes the socket path into path
 * (for the registry).  Returns 0 or -errno; never blocks the caller for long. */
int vmm__broker_start(vmm__broker_export_fn export_fn, char *path, unsigned long path_len);
/* After fork(): the child has no broker thread and must not serve its parent's memory. */
void vmm__broker_forget_after_fork(void);
#endif
