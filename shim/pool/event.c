/* A free's event as the pool keeps it (event.h): made and recycled without a malloc a free, recorded
 * only when someone needs to know, shared by the pieces of a split block.  Part of the pool's
 * policy (pool.c), apart because the rest of the pool only asks the questions below. */
#include "pool/event.h"

#include <stdlib.h>
#include <string.h>

vmm__ev *vmm__ev_alloc(vmm__pool *p)
{
    vmm__ev *ev = p->spare_ev;
    if (ev) p->spare_ev = ev->next;
    else if (!(ev = malloc(sizeof *ev))) return NULL;
    memset(ev, 0, sizeof *ev);
    ev->refs = 1;
    return ev;
}

vmm__ev *vmm__ev_wrap(vmm__pool *p, void *e)
{
    if (!e) return NULL;
    vmm__ev *ev = vmm__ev_alloc(p);
    if (!ev) {
        /* No memory even for 40 bytes: the free is treated as complete (as a synchronous one). */
        p->ops.event_release(p->ops.ctx, e);
        return NULL;
    }
    ev->e = e;
    return ev;
}

void vmm__ev_put(vmm__pool *p, vmm__ev *ev)
{
    if (!ev || --ev->refs) return;
    if (ev->e) p->ops.event_release(p->ops.ctx, ev->e);
    else p->n_unrecorded--;
    if (ev->seq) p->n_tracked--;
    ev->next = p->spare_ev;
    p->spare_ev = ev;
}

/* Record ev now: 1 done, 0 not now, -1 its stream is gone (its frees count as reached). */
int vmm__ev_record(vmm__pool *p, vmm__ev *ev, uint64_t stream)
{
    if (ev->e) return 1;
    int r = p->ops.event_record(p->ops.ctx, stream, ev->sctx, &ev->e);
    if (r > 0) p->n_unrecorded--;
    return r;
}

void vmm__ev_clear(vmm__pool *p, vmm__block *b)
{
    vmm__ev_put(p, b->event);
    b->event = NULL;
    b->stream = 0;
}

int vmm__ev_reached(vmm__pool *p, vmm__block *b)
{
    if (!b->event) return 1;
    int r = vmm__ev_record(p, b->event, b->stream); /* someone needs to know now */
    if (r == 0) return 0;
    if (r > 0 && !p->ops.event_done(p->ops.ctx, b->event->e)) return 0;
    vmm__ev_clear(p, b);
    return 1;
}

/* May `stream` (any stream when !ordered) use free block b now?  Its own stream may at once:
 * work it queues runs after the free.  Others once the free's event was reached (OPPORTUNISTIC),
 * or at once when the stream waited for an event recorded after the free (FOLLOW), or, in the
 * allocation's waiting pass, at once with the stream made to wait for the free's event (INTERNAL),
 * as the native pool does. */
int vmm__ev_usable(vmm__pool *p, vmm__block *b, int ordered, uint64_t stream)
{
    if (!b->event) return 1;
    if (ordered && b->stream == stream) return 1;
    if (ordered && p->reuse & VMM_POOL_REUSE_FOLLOW && b->event->seq && p->ops.followed &&
        b->event->seq < p->ops.followed(p->ops.ctx, stream, b->stream))
        return 1; /* before asking the event: no record needed */
    if ((!ordered || p->reuse & VMM_POOL_REUSE_OPPORTUNISTIC) && vmm__ev_reached(p, b)) return 1;
    if (!ordered || !p->waiting || !(p->reuse & VMM_POOL_REUSE_INTERNAL) || !p->ops.stream_wait) return 0;
    int r = vmm__ev_record(p, b->event, b->stream);
    if (r < 0) { /* its stream is gone: its frees count as reached */
        vmm__ev_clear(p, b);
        return 1;
    }
    if (r == 0 || p->ops.stream_wait(p->ops.ctx, stream, b->event->e)) return 0;
    p->cross_waits++;
    return 1;
}
