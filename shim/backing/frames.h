/* Call-site frames (VMMSHIM_FRAMES > 0): each allocation's return addresses for its record, and
 * for people the module, offset and function of each address, resolved once per process and
 * appended to a file beside the registry that outlives the process (layout.h, FRAMES), so
 * `vmmctl show` can name them after the owner is gone.  With VMMSHIM_FRAMES=0 nothing here runs. */
#ifndef VMM_BACKING_FRAMES_H
#define VMM_BACKING_FRAMES_H
#include <stdint.h>

#include "registry/registry.h"

typedef struct vmm__frames {
    uint32_t n;
    uint64_t pc[8]; /* the innermost first, the shim's own frames left out */
} vmm__frames;

/* At start, with this process attached to r: load the unwinder (beside the shim) and make this
 * process's frames file. */
void vmm__frames_init(int depth, const vmm__reg *r);
/* The caller's frames, resolving addresses not seen before into the file.  Takes the loader
 * lock (the unwinder and dladdr do): never call it holding a lock of the shim, or a thread in
 * dlopen whose constructor allocates would wait for us while we wait for it. */
void vmm__frames_capture(vmm__frames *f);
/* In a fork child, attached again as itself: a file of its own (the parent's stays its parent's). */
void vmm__frames_after_fork(const vmm__reg *r);
/* At exit: the file goes with the process's records. */
void vmm__frames_exit(void);
#endif
