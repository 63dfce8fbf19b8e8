/* The pool's policy (pool.h says what it decides; README.md why these numbers). */
#include "pool/pool.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* TLSF-style classes: 8 per power of two from 512 bytes, so a class's blocks differ by < 12.5%. */
static int class_of(uint64_t size)
{
    int fl = 63 - __builtin_clzll(size);
    if (fl < 9) return 0;
    int c = (fl - 9) * 8 + (int)((size >> (fl - 3)) & 7);
    return c < VMM_POOL_CLASSES ? c : VMM_POOL_CLASSES - 1;
}

static vmm__pool_bins *bins_of(vmm__pool *p, const vmm__block *b) { return &p->bins[b->chunk->small ? 1 : 0]; }

static void bin_insert(vmm__pool *p, vmm__block *b)
{
    vmm__pool_bins *bins = bins_of(p, b);
    int c = b->cls = class_of(b->size);
    b->fprev = NULL;
    b->fnext = bins->head[c]; /* newest first: the block just freed is the one reused next */
    if (b->fnext) b->fnext->fprev = b;
    bins->head[c] = b;
    bins->map[c / 64] |= 1ull << (c % 64);
}

static void bin_remove(vmm__pool *p, vmm__block *b)
{
    vmm__pool_bins *bins = bins_of(p, b);
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

static void event_clear(vmm__pool *p, vmm__block *b)
{
    if (b->event) p->ops.event_release(p->ops.ctx, b->event);
    b->event = NULL;
    b->stream = 0;
}

/* May `stream` (any stream when !ordered) use free block b now?  Its own stream may at once:
 * work it queues runs after the free.  Others only once the free's event was reached. */
static int usable(vmm__pool *p, vmm__block *b, int ordered, uint64_t stream)
{
    if (!b->event) return 1;
    if (ordered && b->stream == stream) return 1;
    if (!p->ops.event_done(p->ops.ctx, b->event)) return 0;
    event_clear(p, b);
    return 1;
}

static uint64_t front_gap(const vmm__block *b, uint64_t align) { return round_up(b->addr, align) - b->addr; }

static vmm__block *find_free(vmm__pool *p, uint64_t need, uint64_t align, int small, int ordered, uint64_t stream)
{
    vmm__pool_bins *bins = &p->bins[small];
    int c = class_of(need);
    for (vmm__block *b = bins->head[c]; b; b = b->fnext)
        if ((p->isolate ? b->size == need : b->size >= need + front_gap(b, align)) && usable(p, b, ordered, stream)) return b;
    if (p->isolate) return NULL; /* a chunk is never shared, so only its own size will do */
    for (c = next_class(bins, c + 1); c >= 0; c = next_class(bins, c + 1))
        for (vmm__block *b = bins->head[c]; b; b = b->fnext)
            if (b->size >= need + front_gap(b, align) && usable(p, b, ordered, stream)) return b;
    return NULL;
}

static void note_used(vmm__pool *p, int64_t delta)
{
    p->used += (uint64_t)delta;
    if (p->used > p->used_high) p->used_high = p->used;
}

/* Take `need` bytes from free block b at the first `align`ed address, leaving what is before and
 * after free where it is worth it.  NULL (b untouched) only when no block struct can be had. */
static vmm__block *carve(vmm__pool *p, vmm__block *b, uint64_t need, uint64_t align)
{
    uint64_t front = front_gap(b, align);
    bin_remove(p, b);
    if (front) { /* the gap stays free, with whatever event it waits on; the rest is used now */
        vmm__block *nb = block_new(p);
        if (!nb) {
            bin_insert(p, b);
            return NULL;
        }
        nb->addr = b->addr + front;
        nb->size = b->size - front;
        nb->chunk = b->chunk;
        nb->prev = b;
        nb->next = b->next;
        if (b->next) b->next->prev = nb;
        b->next = nb;
        b->size = front;
        bin_insert(p, b);
        b = nb;
    }
    uint64_t rest = b->size - need;
    /* A small chunk's rest serves any small request; a large rest under 1 MiB would only ever
     * serve requests that go to small chunks, so it stays with the block. */
    uint64_t min_rest = b->chunk->small ? VMM_POOL_ALIGN : VMM_POOL_SMALL_MAX + 1;
    vmm__block *r = !p->isolate && rest >= min_rest ? block_new(p) : NULL;
    if (r) {
        r->addr = b->addr + need;
        r->size = rest;
        r->chunk = b->chunk;
        r->prev = b;
        r->next = b->next;
        if (b->next) b->next->prev = r;
        b->next = r;
        r->free = 1;
        r->stream = b->stream; /* the rest is still what that free gave back */
        r->event = b->event;
        b->event = NULL;
        b->size = need;
        bin_insert(p, r);
    }
    event_clear(p, b);
    if (b->chunk->n_live++ == 0) p->empty_bytes -= b->chunk->size;
    b->free = 0;
    note_used(p, (int64_t)b->size);
    return b;
}

static void chunk_release(vmm__pool *p, vmm__chunk *c)
{
    for (vmm__block *b = c->first, *n; b; b = n) {
        n = b->next;
        if (b->event) p->ops.event_wait(p->ops.ctx, b->event);
        event_clear(p, b);
        if (b->free) bin_remove(p, b);
        block_recycle(p, b);
    }
    if (c->prev) c->prev->next = c->next;
    else p->chunks = c->next;
    if (c->next) c->next->prev = c->prev;
    if (c->n_live == 0) p->empty_bytes -= c->size;
    p->reserved -= c->size;
    p->n_chunks--;
    p->chunks_released++;
    p->ops.chunk_destroy(p->ops.ctx, c);
    free(c);
}

/* Give back empty chunks, oldest first, until `over` says stop. */
static uint64_t release_empty(vmm__pool *p, uint64_t keep_reserved, uint64_t keep_empty)
{
    uint64_t given = 0;
    vmm__chunk *last = p->chunks;
    while (last && last->next) last = last->next;
    for (vmm__chunk *c = last, *prev; c && (p->reserved > keep_reserved && p->empty_bytes > keep_empty); c = prev) {
        prev = c->prev;
        if (c->n_live) continue;
        given += c->size;
        chunk_release(p, c);
    }
    return given;
}

static int chunk_add(vmm__pool *p, uint64_t size, int small, vmm__block **out)
{
    vmm__chunk *c = calloc(1, sizeof *c);
    vmm__block *b = block_new(p);
    if (c) c->size = size;
    int rc = c && b ? p->ops.chunk_create(p->ops.ctx, c) : -ENOMEM;
    if (rc) {
        free(c);
        if (b) block_recycle(p, b);
        return rc;
    }
    c->small = small;
    c->first = b;
    c->next = p->chunks;
    if (p->chunks) p->chunks->prev = c;
    p->chunks = c;
    p->n_chunks++;
    p->chunks_made++;
    p->reserved += size;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    p->empty_bytes += size;
    b->addr = c->base;
    b->size = size;
    b->chunk = c;
    b->free = 1;
    bin_insert(p, b);
    *out = b;
    return 0;
}

/* The device is full: every free that is still in flight is waited for, so its block is usable. */
static void settle_events(vmm__pool *p)
{
    for (int k = 0; k < 2; k++)
        for (int c = next_class(&p->bins[k], 0); c >= 0; c = next_class(&p->bins[k], c + 1))
            for (vmm__block *b = p->bins[k].head[c]; b; b = b->fnext)
                if (b->event) {
                    p->ops.event_wait(p->ops.ctx, b->event);
                    event_clear(p, b);
                }
}

static vmm__block *carve_or_fail(vmm__pool *p, vmm__block *b, uint64_t need, uint64_t align, int *err)
{
    vmm__block *got = carve(p, b, need, align);
    if (!got) *err = -ENOMEM;
    return got;
}

vmm__block *vmm__pool_alloc(vmm__pool *p, uint64_t size, int stream_ordered, uint64_t stream, int *err)
{
    *err = 0;
    if (size == 0 || size > UINT64_MAX - p->granule) {
        *err = -EINVAL;
        return NULL;
    }
    uint64_t need = p->isolate ? round_up(size, p->granule) : round_up(size, VMM_POOL_ALIGN);
    int small = !p->isolate && need <= VMM_POOL_SMALL_MAX;
    /* Native cudaMalloc gives requests over 1 MiB whole 2 MiB pages; cudaMallocAsync packs them at
     * 512 bytes (measured, README.md).  Each gets at least what native gives it. */
    uint64_t align = VMM_POOL_ALIGN;
    if (!small && !stream_ordered) {
        need = round_up(need, p->granule);
        align = p->granule;
    }
    vmm__block *b = find_free(p, need, align, small, stream_ordered, stream);
    if (b) return carve_or_fail(p, b, need, align, err);

    uint64_t exact = round_up(need, p->granule);
    uint64_t chunk = small ? round_up(p->granule, VMM_POOL_ALIGN)
                     : !p->isolate && need <= VMM_POOL_MEDIUM_MAX ? round_up(VMM_POOL_MEDIUM_CHUNK, p->granule)
                                                                 : exact;
    if (chunk < exact) chunk = exact;
    int rc = chunk_add(p, chunk, small, &b);
    if (rc == -ENOMEM && chunk != exact) rc = chunk_add(p, chunk = exact, small, &b);
    if (rc == -ENOMEM) {
        /* Never fail before the driver would: wait for frees in flight, give back every empty
         * chunk, and look again before asking once more. */
        settle_events(p);
        release_empty(p, 0, 0);
        if ((b = find_free(p, need, align, small, stream_ordered, stream))) return carve_or_fail(p, b, need, align, err);
        rc = chunk_add(p, exact, small, &b);
    }
    if (rc) {
        *err = rc;
        return NULL;
    }
    return carve_or_fail(p, b, need, align, err); /* a new chunk's base is aligned: no gap */
}

/* Free neighbours merge unless they wait on different streams: a settled block joins a pending
 * one (the whole then waits on that stream's event, a short wait that keeps free space whole). */
static int compatible(vmm__pool *p, vmm__block *a, const vmm__block *b)
{
    if (a->event && p->ops.event_done(p->ops.ctx, a->event)) event_clear(p, a);
    return !a->event || !b->event || a->stream == b->stream;
}

/* b absorbs its free neighbour n (n follows b).  Of two events on one stream the newer is kept:
 * reaching it means reaching the older one too. */
static void absorb(vmm__pool *p, vmm__block *b, vmm__block *n, int n_is_newer)
{
    if (n->event && (!b->event || n_is_newer)) {
        if (b->event) p->ops.event_release(p->ops.ctx, b->event);
        b->event = n->event;
        b->stream = n->stream;
    } else if (n->event) {
        p->ops.event_release(p->ops.ctx, n->event);
    }
    n->event = NULL;
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    block_recycle(p, n);
}

void vmm__pool_free(vmm__pool *p, vmm__block *b, uint64_t stream, void *event)
{
    vmm__chunk *c = b->chunk;
    note_used(p, -(int64_t)b->size);
    b->free = 1;
    b->stream = event ? stream : 0;
    b->event = event;
    if (!p->isolate) {
        vmm__block *n = b->next;
        if (n && n->free && compatible(p, n, b)) {
            bin_remove(p, n);
            absorb(p, b, n, 0);
        }
        vmm__block *v = b->prev;
        if (v && v->free && compatible(p, v, b)) {
            bin_remove(p, v);
            absorb(p, v, b, 1);
            b = v;
        }
    }
    bin_insert(p, b);
    if (--c->n_live == 0) {
        p->empty_bytes += c->size;
        if (p->empty_bytes > p->retain) release_empty(p, 0, p->retain);
    }
}

uint64_t vmm__pool_give_back(vmm__pool *p, uint64_t keep)
{
    return release_empty(p, keep, 0);
}

vmm__block *vmm__pool_block_at(const vmm__chunk *c, uint64_t addr)
{
    for (vmm__block *b = c->first; b; b = b->next)
        if (addr >= b->addr && addr - b->addr < b->size) return b;
    return NULL;
}

void vmm__pool_init(vmm__pool *p, const vmm__pool_ops *ops, uint64_t granule, uint64_t retain, int isolate)
{
    memset(p, 0, sizeof *p);
    p->ops = *ops;
    p->granule = granule ? granule : 2u << 20;
    p->retain = retain;
    p->isolate = isolate;
}

void vmm__pool_destroy(vmm__pool *p)
{
    while (p->chunks) {
        p->chunks->n_live = 0;
        p->empty_bytes += p->chunks->size;
        chunk_release(p, p->chunks);
    }
    while (p->spare) {
        vmm__block *b = p->spare;
        p->spare = b->fnext;
        free(b);
    }
}
