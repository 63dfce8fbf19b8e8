/* A free's event inside shim/pool (event.c): for pool.c only. */
#ifndef VMM_POOL_EVENT_H
#define VMM_POOL_EVENT_H
#include "pool/pool.h"

/* A free's event, shared by the pieces a pending free block is split into: each piece holds a
 * reference, and the mechanism gets the event back when the last one lets go.  e NULL: not
 * recorded yet (vmm__pool_free_unrecorded); sctx and seq say where to record it and which
 * synchronizations cover it. */
struct vmm__ev {
    void *e, *sctx;
    uint64_t seq;
    uint32_t refs;
    vmm__ev *next;
};

vmm__ev *vmm__ev_alloc(vmm__pool *p);
/* An event the mechanism recorded, wrapped (NULL when e is, or with no memory: the free then counts
 * as complete). */
vmm__ev *vmm__ev_wrap(vmm__pool *p, void *e);
void vmm__ev_put(vmm__pool *p, vmm__ev *ev);
/* Record ev now: 1 done, 0 not now, -1 its stream is gone (its frees count as reached). */
int vmm__ev_record(vmm__pool *p, vmm__ev *ev, uint64_t stream);
/* Free block b waits on nothing any more. */
void vmm__ev_clear(vmm__pool *p, vmm__block *b);
/* Has the stream reached free block b's free (recording its event first if need be)? */
int vmm__ev_reached(vmm__pool *p, vmm__block *b);
/* May `stream` (any stream when !ordered) use free block b now? */
int vmm__ev_usable(vmm__pool *p, vmm__block *b, int ordered, uint64_t stream);
#endif
