/* The pool's policy (pool.h says what it decides; README.md why these numbers). */
#include "pool/pool.h"
#include "pool/event.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
static uint64_t end_of(const vmm__block *b) { return b->addr + b->size; }

/* TLSF-style classes: 8 per power of two from 512 bytes, so a class's blocks differ by < 12.5%. */
static int class_of(uint64_t size)
{
    int fl = 63 - __builtin_clzll(size);
    if (fl < 9) return 0;
    int c = (fl - 9) * 8 + (int)((size >> (fl - 3)) & 7);
    return c < VMM_POOL_CLASSES ? c : VMM_POOL_CLASSES - 1;
}

static vmm__pool_bins *bins_of(vmm__pool *p, const vmm__block *b) { return &p->bins[b->arena->small][b->backed]; }

static void bin_insert(vmm__pool *p, vmm__block *b)
{
    vmm__pool_bins *bins = bins_of(p, b);
    int c = b->cls = class_of(b->size);
    if (b->arena->paused) { /* kept out of every bin: never found for a new allocation */
        b->fprev = b->fnext = NULL;
        return;
    }
    b->fprev = NULL;
    b->fnext = bins->head[c]; /* newest first: the block just freed is the one reused next */
    if (b->fnext) b->fnext->fprev = b;
    bins->head[c] = b;
    bins->map[c / 64] |= 1ull << (c % 64);
}

static void bin_remove(vmm__pool *p, vmm__block *b)
{
    vmm__pool_bins *bins = bins_of(p, b);
    if (b->arena->paused) {
        b->fprev = b->fnext = NULL;
        return;
    }
    if (b->fprev) b->fprev->fnext = b->fnext;
    else bins->head[b->cls] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    if (!bins->head[b->cls]) bins->map[b->cls / 64] &= ~(1ull << (b->cls % 64));
    b->fprev = b->fnext = NULL;
}

static int next_class(const vmm__pool_bins *bins, int from)
{
    for (int w = from / 64; w < (VMM_POOL_CLASSES + 63) / 64; w++) {
        uint64_t m = bins->map[w];
        if (w == from / 64) m &= ~0ull << (from % 64);
        if (m) return w * 64 + __builtin_ctzll(m);
    }
    return -1;
}

static vmm__block *block_new(vmm__pool *p)
{
    vmm__block *b = p->spare;
    if (b) p->spare = b->fnext;
    else if (!(b = malloc(sizeof *b))) return NULL;
    memset(b, 0, sizeof *b);
    return b;
}

static void block_recycle(vmm__pool *p, vmm__block *b)
{
    b->fnext = p->spare;
    p->spare = b;
}

/* ---- pages: which segment is mapped at, and which block holds, each granule of an arena ---- */

static uint64_t page_of(const vmm__pool *p, const vmm__arena *a, uint64_t addr) { return (addr - a->base) / p->granule; }

/* b holds every page whose first byte lies in [from, to). */
static void own_pages(vmm__pool *p, vmm__block *b, uint64_t from, uint64_t to)
{
    vmm__arena *a = b->arena;
    uint64_t i = round_up(from - a->base, p->granule) / p->granule, end = round_up(to - a->base, p->granule) / p->granule;
    for (; i < end; i++) a->blk[i] = b;
}

vmm__seg *vmm__pool_seg_at(const vmm__arena *a, uint64_t granule, uint64_t addr) { return a->seg[(addr - a->base) / granule]; }

vmm__block *vmm__pool_block_at(const vmm__arena *a, uint64_t granule, uint64_t addr)
{
    vmm__block *b = a->blk[(addr - a->base) / granule];
    while (b && addr >= end_of(b)) b = b->next;
    return b;
}

vmm__arena *vmm__pool_arena_at(const vmm__pool *p, uint64_t addr)
{
    for (vmm__arena *a = p->arenas; a; a = a->next)
        if (addr >= a->base && addr - a->base < a->size) return a;
    return NULL;
}

/* ---- splitting and joining free blocks (neither is in a bin meanwhile) ---- */

/* Cut b at `at` (inside it) into *l and *r; the larger piece keeps b's struct, so only the
 * smaller one's pages are rewritten.  0, or -ENOMEM with b untouched. */
static int split(vmm__pool *p, vmm__block *b, uint64_t at, vmm__block **l, vmm__block **r)
{
    vmm__block *n = block_new(p);
    if (!n) return -ENOMEM;
    uint64_t lo = b->addr, hi = end_of(b);
    n->arena = b->arena;
    n->free = b->free;
    n->backed = b->backed;
    n->stream = b->stream;
    n->event = b->event;
    if (n->event) n->event->refs++;
    if (at - lo >= hi - at) { /* n is the right piece */
        n->addr = at;
        n->size = hi - at;
        b->size = at - lo;
        n->prev = b;
        n->next = b->next;
        if (b->next) b->next->prev = n;
        b->next = n;
        own_pages(p, n, at, hi);
        *l = b;
        *r = n;
    } else { /* n is the left piece */
        n->addr = lo;
        n->size = at - lo;
        b->addr = at;
        b->size = hi - at;
        n->next = b;
        n->prev = b->prev;
        if (b->prev) b->prev->next = n;
        else b->arena->first = n;
        b->prev = n;
        own_pages(p, n, lo, at);
        *l = n;
        *r = b;
    }
    return 0;
}

/* l and r (adjacent, l first) become one block waiting on `ev` (one of theirs, or NULL). */
static vmm__block *join(vmm__pool *p, vmm__block *l, vmm__block *r, vmm__ev *ev, uint64_t stream)
{
    vmm__block *keep = l->size >= r->size ? l : r, *gone = keep == l ? r : l;
    if (ev) ev->refs++;
    vmm__ev_put(p, l->event);
    vmm__ev_put(p, r->event);
    own_pages(p, keep, gone->addr, end_of(gone));
    vmm__block *prev = l->prev, *next = r->next;
    keep->addr = l->addr;
    keep->size = l->size + r->size;
    keep->prev = prev;
    keep->next = next;
    if (prev) prev->next = keep;
    else keep->arena->first = keep;
    if (next) next->prev = keep;
    keep->event = ev;
    keep->stream = ev ? stream : 0;
    block_recycle(p, gone);
    return keep;
}

/* Free neighbours merge when both are mapped or both are not, and they wait on at most one
 * stream: a settled block joins a pending one (the whole then waits on that stream's event, a
 * short wait that keeps free space whole). */
static int compatible(vmm__pool *p, vmm__block *a, vmm__block *b)
{
    if (!a->free || a->backed != b->backed) return 0;
    if (a->event && a->event->e) vmm__ev_reached(p, a); /* never records one: a free must stay cheap */
    return !a->event || !b->event || (a->stream == b->stream && a->event->sctx == b->event->sctx);
}

/* Free block b (in no bin) merges with its compatible free neighbours and goes into its bin.
 * Of two events on one stream the newer (b's) is kept: reaching it means reaching the other. */
static vmm__block *coalesce(vmm__pool *p, vmm__block *b)
{
    if (!p->isolate || !b->backed) {
        vmm__block *n = b->next;
        if (n && compatible(p, n, b)) {
            bin_remove(p, n);
            vmm__ev *ev = b->event ? b->event : n->event;
            b = join(p, b, n, ev, ev == b->event ? b->stream : n->stream);
        }
        vmm__block *v = b->prev;
        if (v && compatible(p, v, b)) {
            bin_remove(p, v);
            vmm__ev *ev = b->event ? b->event : v->event;
            b = join(p, v, b, ev, ev == b->event ? b->stream : v->stream);
        }
    }
    bin_insert(p, b);
    return b;
}

/* ---- segments ---- */

static void retired_poll(vmm__pool *p);

static void empty_unlink(vmm__pool *p, vmm__seg *s)
{
    if (s->eprev) s->eprev->enext = s->enext;
    else p->empty_head = s->enext;
    if (s->enext) s->enext->eprev = s->eprev;
    else p->empty_tail = s->eprev;
    s->eprev = s->enext = NULL;
    p->empty_bytes -= s->size;
}

static void touch(vmm__pool *p, vmm__seg *s)
{
    if (s->n_live++ == 0) empty_unlink(p, s);
}

/* Returns 1 when s became empty.  *now: the clock, read once for all segments of one free (0:
 * not read yet). */
static int untouch(vmm__pool *p, vmm__seg *s, uint64_t *now)
{
    if (--s->n_live) return 0;
    if (!*now) *now = p->ops.now_ns(p->ops.ctx);
    s->empty_since = *now;
    s->enext = NULL;
    s->eprev = p->empty_tail;
    if (p->empty_tail) p->empty_tail->enext = s;
    else p->empty_head = s;
    p->empty_tail = s;
    p->empty_bytes += s->size;
    return 1;
}

/* Every segment under [lo, hi), which must all be mapped. */
#define FOR_SEGS(p, a, lo, hi, s)                                                                          \
    for (vmm__seg *s = vmm__pool_seg_at(a, (p)->granule, lo); s; \
         s = s->base + s->size < (hi) ? vmm__pool_seg_at(a, (p)->granule, s->base + s->size) : NULL)

/* No block in s is allocated, and no free in flight touches it (reached ones are cleared). */
static int seg_idle(vmm__pool *p, vmm__seg *s)
{
    vmm__arena *a = s->arena;
    for (vmm__block *b = a->blk[page_of(p, a, s->base)]; b && b->addr < s->base + s->size; b = b->next)
        if (!b->free || !vmm__ev_reached(p, b)) return 0;
    return 1;
}

/* The free blocks in [lo, hi) (page-aligned, all free), cut at lo and hi and joined into one,
 * out of every bin; NULL (nothing changed that matters) when no block struct can be had. */
static vmm__block *gather(vmm__pool *p, vmm__arena *a, uint64_t lo, uint64_t hi)
{
    vmm__block *b = vmm__pool_block_at(a, p->granule, lo), *l, *r;
    bin_remove(p, b);
    if (b->addr < lo) {
        if (split(p, b, lo, &l, &r)) return bin_insert(p, b), NULL;
        bin_insert(p, l);
        b = r;
    }
    vmm__block *inner = NULL;
    for (;;) {
        if (end_of(b) > hi) {
            if (split(p, b, hi, &l, &r)) {
                bin_insert(p, b);
                if (inner) bin_insert(p, inner);
                return NULL;
            }
            bin_insert(p, r);
            b = l;
        }
        inner = inner ? join(p, inner, b, NULL, 0) : b;
        if (end_of(inner) >= hi) return inner;
        b = inner->next;
        bin_remove(p, b);
    }
}

/* The free blocks in [lo, hi) (page-aligned, all free, none waiting on an event) change from
 * mapped to unmapped or back, merged with their like neighbours.  -ENOMEM (nothing changed that
 * matters) when no block struct can be had. */
static int set_backed(vmm__pool *p, vmm__arena *a, uint64_t lo, uint64_t hi, int backed)
{
    vmm__block *inner = gather(p, a, lo, hi);
    if (!inner) return -ENOMEM;
    inner->backed = backed;
    coalesce(p, inner);
    return 0;
}

/* The last arena dropped is parked whole (its address space, its per-page tables and its one
 * free block) rather than rebuilt: a program that frees and allocates the same large size (a
 * native 1 GiB pair costs ~700 us) would otherwise reserve and free the address space (~65 us a
 * pair on an H200) and allocate, fill and unmap tables of a pointer per 2 MiB page of a device-sized
 * arena (1.1 MiB on an H200) every pair.  Nothing is mapped there: it holds no memory. */
static void arena_free(vmm__pool *p, vmm__arena *a)
{
    for (vmm__block *b = a->first, *n; b; b = n) {
        n = b->next;
        bin_remove(p, b);
        vmm__ev_put(p, b->event);
        b->event = NULL;
        block_recycle(p, b);
    }
    p->ops.unreserve(p->ops.ctx, a->base, a->size);
    free(a->seg);
    free(a->blk);
    free(a);
}

static void unpark(vmm__pool *p)
{
    if (p->parked) arena_free(p, p->parked);
    p->parked = NULL;
}

/* An arena with no segment holds only free, unmapped blocks: it goes, but for the last one given
 * back, parked when it is one free block (the pool coalesces free neighbours of one kind).  One
 * whose growth failed goes whole: a program that fails to allocate and exits leaves nothing
 * reserved, as natively. */
static void arena_drop(vmm__pool *p, vmm__arena *a, int keep)
{
    for (vmm__arena **pp = &p->arenas; *pp; pp = &(*pp)->next)
        if (*pp == a) {
            *pp = a->next;
            break;
        }
    vmm__block *b = a->first;
    if (!keep || a->paused || b->next || !b->free || b->backed) {
        arena_free(p, a);
        return;
    }
    unpark(p);
    bin_remove(p, b);
    vmm__ev_put(p, b->event);
    b->event = NULL;
    a->next = NULL;
    p->parked = a;
    p->parked_since = p->ops.now_ns(p->ops.ctx);
}

/* The parked arena when it has this size, back in the pool with its free block binned. */
static vmm__arena *unpark_for(vmm__pool *p, int small, uint64_t size)
{
    vmm__arena *a = p->parked;
    if (!a || a->size != size) return NULL;
    p->parked = NULL;
    a->small = small;
    a->next = p->arenas;
    p->arenas = a;
    vmm__block *b = a->first; /* as new: every page's table entry names it still */
    memset(b, 0, sizeof *b);
    b->arena = a;
    b->addr = a->base;
    b->size = a->size;
    b->free = 1;
    bin_insert(p, b);
    return a;
}

static void seg_release(vmm__pool *p, vmm__seg *s)
{
    vmm__arena *a = s->arena;
    if (set_backed(p, a, s->base, s->base + s->size, 0) != 0) return; /* kept until a block struct can be had */
    for (uint64_t i = page_of(p, a, s->base), n = s->size / p->granule; n--; i++) a->seg[i] = NULL;
    if (s->n_live == 0) empty_unlink(p, s);
    if (s->sprev) s->sprev->snext = s->snext;
    else p->segs = s->snext;
    if (s->snext) s->snext->sprev = s->sprev;
    p->reserved -= s->size;
    p->n_segs--;
    p->segs_released++;
    p->ops.seg_destroy(p->ops.ctx, s);
    free(s);
    if (--a->n_segs == 0 && !a->n_retired) arena_drop(p, a, 1);
}

/* Empty segment s goes back unless a free in flight still touches it: the bytes given back. */
static uint64_t release_idle(vmm__pool *p, vmm__seg *s)
{
    if (!seg_idle(p, s)) return 0;
    uint64_t size = s->size, before = p->reserved;
    seg_release(p, s);
    return p->reserved < before ? size : 0;
}

static uint64_t release_until(vmm__pool *p, uint64_t keep_reserved, uint64_t keep_empty, uint64_t until)
{
    uint64_t given = 0;
    if (p->retired) retired_poll(p);
    for (vmm__seg *s = p->empty_head, *next; s && p->reserved > keep_reserved && p->empty_bytes > keep_empty; s = next) {
        next = s->enext;
        if (s->empty_since > until) break; /* oldest first: the rest are younger still */
        given += release_idle(p, s);
    }
    return given;
}

/* The kept address space goes when a give-back reaches its time, as an empty segment would; the
 * pool's own give-backs before it grows keep it: the growth may want it. */
uint64_t vmm__pool_release(vmm__pool *p, uint64_t keep_reserved, uint64_t keep_empty, uint64_t until)
{
    uint64_t given = release_until(p, keep_reserved, keep_empty, until);
    if (p->parked && p->parked_since <= until) unpark(p);
    return given;
}

uint64_t vmm__pool_release_newest(vmm__pool *p, uint64_t keep_empty)
{
    uint64_t given = 0;
    for (vmm__seg *s = p->empty_tail, *prev; s && p->empty_bytes > keep_empty; s = prev) {
        prev = s->eprev;
        given += release_idle(p, s);
    }
    return given;
}

/* Map segments over the unmapped [lo, hi) of arena a: 0, or the mechanism's error with nothing
 * made. */
static int seg_add(vmm__pool *p, vmm__arena *a, uint64_t lo, uint64_t hi)
{
    vmm__seg *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->base = lo;
    s->size = hi - lo;
    s->arena = a;
    int rc = p->ops.seg_create(p->ops.ctx, s);
    if (rc) {
        free(s);
        return rc;
    }
    if (set_backed(p, a, lo, hi, 1) != 0) {
        p->ops.seg_destroy(p->ops.ctx, s);
        free(s);
        return -ENOMEM;
    }
    for (uint64_t i = page_of(p, a, lo), n = s->size / p->granule; n--; i++) a->seg[i] = s;
    a->n_segs++;
    s->snext = p->segs;
    if (p->segs) p->segs->sprev = s;
    p->segs = s;
    p->n_segs++;
    p->segs_made++;
    p->reserved += s->size;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    if (p->reserved > p->footprint_high) p->footprint_high = p->reserved;
    s->n_live = 1; /* the caller's block touches it; untouch files it as empty if not */
    return 0;
}

/* ---- moving an empty segment whose frees are still in flight on the requesting stream ----
 *
 * A program that runs ahead of its GPU frees blocks long before the stream reaches the frees.
 * The stream that freed them may reuse them at once (its later work runs after the frees), and
 * does where they lie; but when a request needs more contiguous space than the free blocks offer,
 * an empty segment whose frees are not reached can be neither reused there nor given back, so
 * the pool would grow by new memory while the old sits idle (a transformer with varying sequence
 * lengths on a host far ahead of its H200: 1.22x its live bytes, native 1.08x).  Instead the
 * segment's memory is mapped at the place the request needs as well: only work queued after the
 * frees can reach it there, and the old place stays mapped, out of use, until its event is
 * reached, then only its mapping goes.  An empty segment whose frees are all reached moves too
 * (its old place unmapped at once) where new memory would raise a keep-all pool past its peak: the
 * release before growing found it still waiting, and a growth that maps many segments outlasts a
 * short lag (a GPU 0.2 ms behind: 1.14x the live bytes when only waiting segments moved). */

/* Empty segment s of arena a lies outside [lo, hi), and each free block in it is reached or
 * waits on `stream` alone, in one context (which a new event on the stream needs: a free whose
 * event was recorded at once names none, and is let be).  1 with *pending set when one waits. */
static int seg_movable(vmm__pool *p, const vmm__seg *s, const vmm__arena *a, uint64_t lo, uint64_t hi,
                       uint64_t stream, vmm__block **pending)
{
    if (s->arena != a || (s->base < hi && s->base + s->size > lo)) return 0;
    *pending = NULL;
    for (vmm__block *b = a->blk[page_of(p, a, s->base)]; b && b->addr < s->base + s->size; b = b->next) {
        if (!b->free) return 0;
        if (!b->event || (b->event->e && p->ops.event_done(p->ops.ctx, b->event->e))) continue;
        if (b->stream != stream || !b->event->sctx) return 0;
        if (*pending && (*pending)->event->sctx != b->event->sctx) return 0;
        *pending = b;
    }
    return 1;
}

static int spares(vmm__pool *p, int n)
{
    for (vmm__block *b = p->spare; b && n; b = b->fnext) n--;
    while (n--) {
        vmm__block *b = malloc(sizeof *b);
        if (!b) return -ENOMEM;
        block_recycle(p, b);
    }
    return 0;
}

/* The old place of a moved segment, reached: its mapping goes and its space is free again. */
static void retired_done(vmm__pool *p, vmm__block *r)
{
    p->ops.unmap_old(p->ops.ctx, r->addr, r->size);
    vmm__ev_put(p, r->event);
    r->event = NULL;
    r->stream = 0;
    r->retired = 0;
    r->free = 1;
    r->backed = 0;
    r->arena->n_retired--;
    coalesce(p, r);
}

/* Every old place whose event was reached goes (never waits). */
static void retired_poll(vmm__pool *p)
{
    for (vmm__block **pp = &p->retired; *pp;) {
        vmm__block *r = *pp;
        if (r->event && !(r->event->e && p->ops.event_done(p->ops.ctx, r->event->e))) {
            pp = &r->fnext;
            continue;
        }
        *pp = r->fnext;
        r->fnext = NULL;
        vmm__arena *a = r->arena;
        retired_done(p, r);
        if (!a->n_segs && !a->n_retired) arena_drop(p, a, 1);
    }
}

/* Map empty segment s (seg_movable, *pending its waiting block or NULL) over the unmapped [lo,
 * lo + s->size) of its arena instead of new memory: 0, or nonzero with nothing changed. */
static int seg_move(vmm__pool *p, vmm__seg *s, uint64_t lo, vmm__block *pending)
{
    vmm__arena *a = s->arena;
    uint64_t old = s->base, size = s->size, stream = pending ? pending->stream : 0;
    void *e = NULL;
    if (spares(p, 6) != 0) return -ENOMEM; /* the cuts below cannot fail half-way */
    /* one event recorded now on the stream covers every free in the segment */
    if (pending && p->ops.event_record(p->ops.ctx, pending->stream, pending->event->sctx, &e) <= 0) return -EAGAIN;
    vmm__ev *ev = vmm__ev_wrap(p, e);
    if (e && !ev) return -ENOMEM;
    if (p->ops.seg_move(p->ops.ctx, s, lo) != 0) {
        vmm__ev_put(p, ev);
        return -EIO;
    }
    /* the old place: its free blocks become one retired block, out of every bin */
    vmm__block *inner = gather(p, a, old, old + size); /* cannot fail: spares */
    vmm__ev_put(p, inner->event);
    inner->event = ev;
    inner->stream = ev ? stream : 0;
    inner->free = 0;
    inner->retired = 1;
    a->n_retired++;
    for (uint64_t i = page_of(p, a, old), n = size / p->granule; n--; i++) a->seg[i] = NULL;
    empty_unlink(p, s);
    /* the new place */
    set_backed(p, a, lo, lo + size, 1);
    for (uint64_t i = page_of(p, a, lo), n = size / p->granule; n--; i++) a->seg[i] = s;
    s->base = lo;
    s->n_live = 1; /* as seg_add: the caller's block touches it */
    p->segs_moved++;
    if (!ev) retired_done(p, inner);
    else {
        vmm__block **pp = &p->retired;
        while (*pp) pp = &(*pp)->fnext;
        inner->fnext = NULL;
        *pp = inner;
    }
    return 0;
}

/* A budget as large as the arena: nothing empty ever goes back by itself (PyTorch and CuPy set
 * the threshold to UINT64_MAX).  Only such a pool needs small segments and a bounded peak: any
 * other gives its empty segments back whole at synchronizations or after the idle delay, so it
 * keeps large segments, each one driver call to make. */
static int keeps_all(const vmm__pool *p) { return p->retain >= p->arena_size; }

/* Map [at, hi) of arena a for a request of `stream` (ordered), the part [guard, hi) of the arena
 * being the request's: an empty segment that fits moves there when one can (the rest is new
 * memory, at most cap a segment).  Returns the end of what was mapped, or at with *rc set. */
static uint64_t map_one(vmm__pool *p, vmm__arena *a, uint64_t at, uint64_t hi, uint64_t cap, int ordered,
                        uint64_t stream, uint64_t guard, int *rc)
{
    uint64_t to = cap && hi - at > cap ? at + cap : hi;
    int past_peak = keeps_all(p) && p->reserved + (to - at) > p->footprint_high;
    if (ordered && p->ops.seg_move && !p->isolate)
        for (vmm__seg *s = p->empty_head; s; s = s->enext) {
            vmm__block *pending;
            if (s->size <= hi - at && seg_movable(p, s, a, guard, hi, stream, &pending) && (pending || past_peak) &&
                seg_move(p, s, at, pending) == 0)
                return at + s->size;
        }
    if ((*rc = seg_add(p, a, at, to)) == 0) return to;
    return at;
}

/* ---- arenas ---- */

static vmm__arena *arena_add(vmm__pool *p, int small, uint64_t need)
{
    uint64_t size = need > p->arena_size ? round_up(need, p->granule) : p->arena_size;
    vmm__arena *a = unpark_for(p, small, size);
    if (a) return a;
    uint64_t pages = size / p->granule;
    a = calloc(1, sizeof *a);
    vmm__block *b = block_new(p);
    if (a) a->seg = calloc(pages, sizeof *a->seg);
    if (a) a->blk = calloc(pages, sizeof *a->blk);
    if (!a || !b || !a->seg || !a->blk || p->ops.reserve(p->ops.ctx, size, &a->base) != 0) {
        if (a) free(a->seg), free(a->blk);
        free(a);
        if (b) block_recycle(p, b);
        return NULL;
    }
    a->pool = p;
    a->size = size;
    a->small = small;
    a->next = p->arenas;
    p->arenas = a;
    b->arena = a;
    b->addr = a->base;
    b->size = size;
    b->free = 1;
    a->first = b;
    for (uint64_t i = 0; i < pages; i++) a->blk[i] = b;
    bin_insert(p, b);
    return a;
}

/* ---- allocation ---- */

static uint64_t front_gap(const vmm__block *b, uint64_t align) { return round_up(b->addr, align) - b->addr; }

/* Carving [.., end) out of free block b would leave most of an empty segment free behind a live
 * block, where no give-back can reach it until that block goes: better to give the segment back
 * and map what the request needs. */
static int pins_empty_tail(const vmm__pool *p, const vmm__block *b, uint64_t end)
{
    const vmm__seg *s = vmm__pool_seg_at(b->arena, p->granule, end - 1);
    uint64_t tail = s->base + s->size - end;
    return s->n_live == 0 && tail > p->granule && tail > (end - b->addr) / 32;
}

static int fits(vmm__pool *p, vmm__block *b, uint64_t need, uint64_t align, int ordered, uint64_t stream)
{
    if (b->size < need + front_gap(b, align)) return 0;
    if (p->isolate && b->backed) { /* only a block that is exactly one segment of this size */
        vmm__seg *s = vmm__pool_seg_at(b->arena, p->granule, b->addr);
        if (b->size != need || s->base != b->addr || s->size != need) return 0;
    }
    if (b->backed && p->exact && !b->arena->small && pins_empty_tail(p, b, round_up(b->addr, align) + need)) return 0;
    return !b->backed || vmm__ev_usable(p, b, ordered, stream);
}

static vmm__block *find_free(vmm__pool *p, int small, int backed, uint64_t need, uint64_t align, int ordered,
                             uint64_t stream)
{
    vmm__pool_bins *bins = &p->bins[small][backed];
    int c = class_of(need);
    for (vmm__block *b = bins->head[c]; b; b = b->fnext)
        if (fits(p, b, need, align, ordered, stream)) return b;
    for (c = next_class(bins, c + 1); c >= 0; c = next_class(bins, c + 1))
        for (vmm__block *b = bins->head[c]; b; b = b->fnext)
            if (fits(p, b, need, align, ordered, stream)) return b;
    return NULL;
}

/* [start, start + need) lies in mapped free blocks from b on, each usable by the caller: it
 * becomes one allocated block, the rest around it stays free. */
static vmm__block *carve(vmm__pool *p, vmm__block *b, uint64_t start, uint64_t need, int *err)
{
    uint64_t end = start + need;
    vmm__block *l, *r, *got = NULL;
    bin_remove(p, b);
    if (b->addr < start) {
        if (split(p, b, start, &l, &r)) goto nomem;
        bin_insert(p, l);
        b = r;
    }
    for (;;) {
        if (end_of(b) > end) {
            /* a large arena's rest under 1 MiB would only ever serve requests that go to the
             * small arenas: it stays with the block (counted as used by the request alone) */
            uint64_t rest = end_of(b) - end;
            if (b->arena->small || p->isolate || rest > VMM_POOL_SMALL_MAX) {
                if (split(p, b, end, &l, &r)) goto nomem;
                bin_insert(p, r); /* still waiting on the free's event: work queued before it may use it */
                b = l;
            }
        }
        vmm__ev_clear(p, b); /* usable by the caller, so nothing of what it takes is waited for */
        got = got ? join(p, got, b, NULL, 0) : b;
        if (end_of(got) >= end) break;
        b = got->next;
        bin_remove(p, b);
    }
    got->free = 0;
    got->charged = round_up(need, VMM_POOL_ALIGN);
    FOR_SEGS(p, got->arena, got->addr, end_of(got), s) touch(p, s);
    p->used += got->charged;
    if (p->used > p->used_high) p->used_high = p->used;
    return got;
nomem:
    if (got) coalesce(p, got);
    coalesce(p, b);
    *err = -ENOMEM;
    return NULL;
}

/* Grow: place the request on unmapped space (after the mapped free block just before it, when
 * that one can take its start) and map what it needs, at least the arena's growth step. */
static vmm__block *grow(vmm__pool *p, int small, uint64_t need, uint64_t align, int ordered, uint64_t stream, int *err)
{
    vmm__block *u = find_free(p, small, 0, need, align, ordered, stream);
    if (!u) {
        vmm__arena *fresh = arena_add(p, small, need);
        if (!fresh) {
            *err = -ENOMEM;
            return NULL;
        }
        u = fresh->first;
    }
    vmm__arena *a = u->arena;
    vmm__block *l = u->prev;
    uint64_t lo = u->addr, u_end = end_of(u), start = round_up(u->addr, align);
    if (!p->isolate && l && l->free && l->backed && vmm__ev_usable(p, l, ordered, stream) && round_up(l->addr, align) < lo &&
        round_up(l->addr, align) + need > lo) /* else l alone holds it, and was refused (pins_empty_tail) */
        start = round_up(l->addr, align);
    uint64_t hi = round_up(start + need, p->granule);
    uint64_t step = p->isolate || (p->exact && !small) ? 0 : small ? p->granule : VMM_POOL_MIN_GROWTH;
    if (hi - lo < step) hi = lo + step;
    if (hi > u_end) hi = u_end;
    /* at most seg_max bytes a segment, so free space inside a large block's extent can go back in
     * pieces once no live block touches them */
    uint64_t at = lo, cap = keeps_all(p) ? p->seg_max : 0, guard = start / p->granule * p->granule;
    int rc = 0;
    while (at < hi && rc == 0) /* u and l may be joined with the new space from here on */
        at = map_one(p, a, at, hi, cap, ordered, stream, guard, &rc);
    vmm__block *got = NULL;
    if (rc == 0) got = carve(p, vmm__pool_block_at(a, p->granule, start), start, need, err);
    else *err = rc;
    uint64_t now = 0;
    for (uint64_t x = lo; x < at;) { /* seg_add counted the caller's block, which carve counted again */
        vmm__seg *s = vmm__pool_seg_at(a, p->granule, x);
        x = s->base + s->size;
        untouch(p, s, &now);
    }
    if (!a->n_segs && !a->n_retired) arena_drop(p, a, 0);
    return got;
}

vmm__block *vmm__pool_alloc(vmm__pool *p, uint64_t size, int stream_ordered, uint64_t stream, int *err)
{
    *err = 0;
    if (size == 0 || size > UINT64_MAX / 2) {
        *err = -EINVAL;
        return NULL;
    }
    uint64_t need = p->isolate ? round_up(size, p->granule) : round_up(size, VMM_POOL_ALIGN);
    int small = !p->isolate && need <= VMM_POOL_SMALL_MAX;
    if (p->retired) retired_poll(p);
    /* Native cudaMalloc gives requests over 1 MiB whole 2 MiB pages; cudaMallocAsync packs them at
     * 512 bytes (measured, README.md).  Each gets at least what native gives it. */
    uint64_t align = VMM_POOL_ALIGN;
    if (p->isolate || (!small && !stream_ordered)) {
        need = round_up(need, p->granule);
        align = p->granule;
    }
    vmm__block *b = find_free(p, small, 1, need, align, stream_ordered, stream);
    if (b) return carve(p, b, round_up(b->addr, align), need, err);
    if (stream_ordered && p->reuse & VMM_POOL_REUSE_INTERNAL && p->ops.stream_wait) {
        /* another stream's free not reached yet, the stream made to wait for it, before new memory */
        p->waiting = 1;
        b = find_free(p, small, 1, need, align, stream_ordered, stream);
        p->waiting = 0;
        if (b) return carve(p, b, round_up(b->addr, align), need, err);
    }
    /* Growing: what sits empty beyond the budget goes first, so the footprint follows the live
     * bytes rather than adding new memory on top of memory this request could not use. */
    release_until(p, 0, p->retain, UINT64_MAX);
    /* A pool that keeps what it has (its budget unbounded: PyTorch and CuPy set the threshold to
     * UINT64_MAX) grows past its own peak only when no idle empty segment is left to make room,
     * so empty segments stranded between live blocks cannot add up to more than the live bytes
     * ever needed. */
    uint64_t growth = round_up(need, p->granule), step = small ? p->granule : p->exact ? 0 : VMM_POOL_MIN_GROWTH;
    if (growth < step) growth = step;
    if (keeps_all(p) && p->empty_bytes && p->reserved + growth > p->footprint_high)
        release_until(p, p->footprint_high > growth ? p->footprint_high - growth : 0, 0, UINT64_MAX);
    b = grow(p, small, need, align, stream_ordered, stream, err);
    if (b || *err != -ENOMEM) return b;
    /* The device is full: every empty segment goes, and the request is tried once more. */
    release_until(p, 0, 0, UINT64_MAX);
    if ((b = find_free(p, small, 1, need, align, stream_ordered, stream)))
        return carve(p, b, round_up(b->addr, align), need, err);
    *err = 0;
    return grow(p, small, need, align, stream_ordered, stream, err);
}

static int free_with(vmm__pool *p, vmm__block *b, uint64_t stream, vmm__ev *ev)
{
    int emptied = 0;
    uint64_t now = 0;
    p->used -= b->charged;
    b->charged = 0;
    FOR_SEGS(p, b->arena, b->addr, end_of(b), s) emptied |= untouch(p, s, &now);
    b->free = 1;
    b->backed = 1;
    b->event = ev;
    b->stream = ev ? stream : 0;
    coalesce(p, b);
    return emptied;
}

int vmm__pool_free(vmm__pool *p, vmm__block *b, uint64_t stream, void *event)
{
    return free_with(p, b, stream, vmm__ev_wrap(p, event));
}

int vmm__pool_free_unrecorded(vmm__pool *p, vmm__block *b, uint64_t stream, void *stream_ctx, uint64_t seq)
{
    vmm__ev *ev = vmm__ev_alloc(p);
    if (!ev) {
        void *e = NULL;
        /* no memory for the note: record now, or as a last resort count the free complete */
        if (p->ops.event_record(p->ops.ctx, stream, stream_ctx, &e) > 0) return vmm__pool_free(p, b, stream, e);
        return free_with(p, b, stream, NULL);
    }
    ev->sctx = stream_ctx;
    ev->seq = seq;
    p->n_unrecorded++;
    p->n_tracked++;
    return free_with(p, b, stream, ev);
}

/* Every free block waiting on an event, each once per event-holding piece. */
#define FOR_PENDING(p, b)                                                                                  \
    for (int k_ = 0; k_ < 2; k_++)                                                                     \
        for (int c_ = next_class(&(p)->bins[k_][1], 0); c_ >= 0; c_ = next_class(&(p)->bins[k_][1], c_ + 1)) \
            for (vmm__block *b = (p)->bins[k_][1].head[c_], *b##_next; b && ((b##_next = b->fnext), 1); b = b##_next)

/* A synchronization that began after the free covers it, whether its event was recorded since
 * (a give-back or another stream asked) or not: on a GPU lagging its host, an event recorded after
 * the synchronization would complete only later, and the free would wait for nothing. */
void vmm__pool_reached_by_sync(vmm__pool *p, int any_stream, uint64_t stream, void *stream_ctx, uint64_t before_seq)
{
    if (!p->n_tracked) return;
    FOR_PENDING(p, b)
        if (b->event && b->event->seq && b->event->seq < before_seq && b->event->sctx == stream_ctx &&
            (any_stream || b->stream == stream))
            vmm__ev_clear(p, b);
}

void vmm__pool_record_stream(vmm__pool *p, uint64_t stream)
{
    if (!p->n_unrecorded) return;
    FOR_PENDING(p, b)
        if (b->event && !b->event->e && b->stream == stream && vmm__ev_record(p, b->event, b->stream) < 0) vmm__ev_clear(p, b);
}

uint64_t vmm__pool_oldest_empty(const vmm__pool *p) { return p->empty_head ? p->empty_head->empty_since : UINT64_MAX; }

uint64_t vmm__pool_empty_bytes(const vmm__pool *p) { return p->empty_bytes; }

unsigned vmm__pool_pending_events(vmm__pool *p, void **events, unsigned max)
{
    unsigned n = 0;
    FOR_PENDING(p, b) {
        if (n == max) break;
        if (b->event && vmm__ev_record(p, b->event, b->stream) < 0) vmm__ev_clear(p, b);
        if (b->event && b->event->e) events[n++] = b->event->e;
    }
    return n;
}

void vmm__pool_init(vmm__pool *p, const vmm__pool_ops *ops, uint64_t granule, uint64_t arena_size, uint64_t retain,
                    int isolate)
{
    memset(p, 0, sizeof *p);
    p->ops = *ops;
    p->granule = granule ? granule : 2u << 20;
    p->arena_size = round_up(arena_size > p->granule ? arena_size : p->granule, p->granule);
    p->retain = retain;
    p->isolate = isolate;
    p->reuse = VMM_POOL_REUSE_ALL;
}

void vmm__pool_settle(vmm__pool *p)
{
    FOR_PENDING(p, b)
        if (b->event) vmm__ev_clear(p, b);
    while (p->retired) { /* every free that pinned an old place is reached: each goes now */
        vmm__block *r = p->retired;
        p->retired = r->fnext;
        r->fnext = NULL;
        vmm__arena *a = r->arena;
        retired_done(p, r);
        if (!a->n_segs && !a->n_retired) arena_drop(p, a, 1);
    }
}

uint64_t vmm__pool_release_arena(vmm__pool *p, vmm__arena *a, int *dropped)
{
    uint64_t given = 0;
    *dropped = 0;
    for (vmm__seg *s = p->segs, *next; s; s = next) {
        next = s->snext;
        if (s->arena != a || s->n_live) continue;
        int last = a->n_segs == 1 && !a->n_retired; /* the arena goes with it */
        uint64_t got = release_idle(p, s);
        given += got;
        if (got && last) {
            *dropped = 1;
            break;
        }
    }
    return given;
}

void vmm__pool_set_paused(vmm__pool *p, vmm__arena *a, int paused)
{
    if (!a->paused == !paused) return;
    if (paused) {
        for (vmm__block *b = a->first; b; b = b->next)
            if (b->free) bin_remove(p, b);
        a->paused = 1;
    } else {
        a->paused = 0;
        for (vmm__block *b = a->first; b; b = b->next)
            if (b->free) bin_insert(p, b);
    }
}

void vmm__pool_destroy(vmm__pool *p)
{
    for (vmm__block *r = p->retired; r; r = r->fnext) p->ops.unmap_old(p->ops.ctx, r->addr, r->size);
    p->retired = NULL;
    while (p->segs) {
        vmm__seg *s = p->segs;
        p->segs = s->snext;
        p->ops.seg_destroy(p->ops.ctx, s);
        free(s);
    }
    while (p->arenas) {
        vmm__arena *a = p->arenas;
        p->arenas = a->next;
        for (vmm__block *b = a->first, *n; b; b = n) {
            n = b->next;
            vmm__ev_put(p, b->event);
            free(b);
        }
        p->ops.unreserve(p->ops.ctx, a->base, a->size);
        free(a->seg);
        free(a->blk);
        free(a);
    }
    unpark(p);
    while (p->spare) {
        vmm__block *b = p->spare;
        p->spare = b->fnext;
        free(b);
    }
    while (p->spare_ev) {
        vmm__ev *ev = p->spare_ev;
        p->spare_ev = ev->next;
        free(ev);
    }
    vmm__pool_ops ops = p->ops;
    uint64_t g = p->granule, as = p->arena_size, retain = p->retain;
    uint64_t seg_max = p->seg_max;
    int iso = p->isolate, exact = p->exact;
    uint32_t tag = p->tag;
    vmm__pool_init(p, &ops, g, as, retain, iso);
    p->exact = exact;
    p->tag = tag;
    p->seg_max = seg_max;
}
