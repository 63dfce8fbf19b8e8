/* The pool's policy over a mechanism made of plain numbers: a device of a given capacity whose
 * segments are counted bytes, arenas that are address ranges, events reached when a test says so,
 * and a clock the test moves.  Packing, free space merging across segments, growth into the
 * unmapped space after a mapped free block, give-back by age and budget, trim while blocks live,
 * stream-ordered reuse, out of memory, isolation, and a varying-size trace whose physical peak
 * must follow its live peak, each checked against the pool's own bookkeeping. */
#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "check.h"
#include "pool/event.c"
#include "pool/pool.c"

#define MiB (1ull << 20)
#define GiB (1ull << 30)
#define GRANULE (2 * MiB)

static struct {
    uint64_t capacity, in_use, peak, next_va, now;
    unsigned creates, destroys, reserves, unreserves, moves, old_unmaps;
    uint64_t old_mapped; /* bytes of moved segments' old places still mapped */
} dev;

typedef struct fake_event {
    int done, released;
} fake_event;

static fake_event events[4096];
static int n_events, live_events, double_releases;

static int fk_reserve(void *ctx, uint64_t size, uint64_t *base)
{
    (void)ctx;
    *base = dev.next_va;
    dev.next_va += size + GiB; /* arenas are never adjacent */
    dev.reserves++;
    return 0;
}

static void fk_unreserve(void *ctx, uint64_t base, uint64_t size)
{
    (void)ctx, (void)base, (void)size;
    dev.unreserves++;
}

static int fk_create(void *ctx, vmm__seg *s)
{
    (void)ctx;
    if (dev.in_use + s->size > dev.capacity) return -ENOMEM;
    dev.in_use += s->size;
    if (dev.in_use > dev.peak) dev.peak = dev.in_use;
    s->mech = s;
    dev.creates++;
    return 0;
}

static void fk_destroy(void *ctx, vmm__seg *s)
{
    (void)ctx;
    dev.in_use -= s->size;
    dev.destroys++;
}

static int fk_done(void *ctx, void *e)
{
    (void)ctx;
    return ((fake_event *)e)->done;
}

static void fk_release(void *ctx, void *e)
{
    (void)ctx;
    fake_event *f = e;
    double_releases += f->released;
    f->released = 1;
    live_events--;
}

static int record_answer = 1, records;

static fake_event *ev_new(void);

static int fk_record(void *ctx, uint64_t stream, void *stream_ctx, void **e)
{
    (void)ctx, (void)stream, (void)stream_ctx;
    if (record_answer > 0) *e = ev_new(), records++;
    return record_answer;
}

static uint64_t fk_now(void *ctx)
{
    (void)ctx;
    return dev.now;
}

static int move_answer = 0;

static int fk_move(void *ctx, vmm__seg *s, uint64_t base)
{
    (void)ctx, (void)base;
    if (move_answer) return move_answer;
    dev.moves++;
    dev.old_mapped += s->size;
    return 0;
}

static void fk_unmap_old(void *ctx, uint64_t base, uint64_t size)
{
    (void)ctx, (void)base;
    dev.old_unmaps++;
    dev.old_mapped -= size;
}

static fake_event *ev_new(void)
{
    if (n_events == (int)(sizeof events / sizeof *events)) n_events = 0; /* old ones are long settled */
    live_events++;
    events[n_events] = (fake_event){0, 0};
    return &events[n_events++];
}

static void setup(vmm__pool *p, uint64_t capacity, uint64_t retain, int isolate)
{
    memset(&dev, 0, sizeof dev);
    dev.capacity = capacity;
    dev.next_va = 1ull << 40;
    dev.now = 1000;
    live_events = n_events = double_releases = records = 0;
    record_answer = 1;
    move_answer = 0;
    vmm__pool_ops ops = {NULL,   fk_reserve, fk_unreserve, fk_create, fk_destroy, fk_done, fk_record, fk_release,
                         fk_now, fk_move,    fk_unmap_old, NULL,      NULL};
    vmm__pool_init(p, &ops, GRANULE, 16 * GiB, retain, isolate);
}

static vmm__block *take(vmm__pool *p, uint64_t size, int ordered, uint64_t stream)
{
    int err;
    return vmm__pool_alloc(p, size, ordered, stream, &err);
}

/* Every arena is tiled by its blocks; no two free neighbours could merge; pages name the block
 * holding their first byte and the segment mapped there; allocated blocks lie on mapped pages;
 * the counters agree with all of it. */
static int events_cleared_late; /* a free's event reached later leaves it beside a free neighbour, unmerged */

static int consistent(vmm__pool *p)
{
    uint64_t used = 0, reserved = 0, empty = 0;
    for (vmm__seg *s = p->segs; s; s = s->snext) {
        reserved += s->size;
        if (s->n_live == 0) empty += s->size;
        unsigned touching = 0;
        for (vmm__block *b = vmm__pool_block_at(s->arena, GRANULE, s->base); b && b->addr < s->base + s->size; b = b->next)
            touching += !b->free;
        if (touching != s->n_live) return 0;
    }
    for (vmm__arena *a = p->arenas; a; a = a->next) {
        uint64_t at = a->base;
        for (vmm__block *b = a->first; b; b = b->next) {
            if (b->addr != at || b->size == 0 || b->arena != a || (b->next && b->next->prev != b)) return 0;
            if (!b->free) used += b->charged;
            if (b->retired) { /* a moved segment's old place: no segment, out of every bin */
                for (uint64_t x = b->addr; x < b->addr + b->size; x += GRANULE)
                    if (a->seg[(x - a->base) / GRANULE]) return 0;
                at += b->size;
                continue;
            }
            if (b->free && b->next && b->next->free && b->backed == b->next->backed && !b->event && !b->next->event &&
                !(p->isolate && b->backed) && !events_cleared_late)
                return 0;
            for (uint64_t x = b->addr; x < b->addr + b->size; x += GRANULE) {
                uint64_t pg = (x - a->base) / GRANULE;
                vmm__seg *s = a->seg[pg];
                if ((!b->free || b->backed) && !s) return 0;
                if (b->free && !b->backed && s) return 0;
                if ((x - a->base) % GRANULE == 0 && a->blk[pg] != b) return 0;
            }
            at += b->size;
        }
        if (at != a->base + a->size) return 0;
    }
    return used == p->used && reserved == p->reserved && empty == p->empty_bytes && reserved == dev.in_use;
}

static void test_small_packing(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, 0, 0);
    vmm__block *b[1000];
    for (int i = 0; i < 1000; i++) b[i] = take(&p, 4096, 0, 0);
    CHECK(b[0] && b[999] && b[1]->addr - b[0]->addr == 4096, "4 KiB blocks packed at 4 KiB");
    CHECK(p.reserved == 2 * GRANULE, "1000 x 4 KiB take %" PRIu64 " bytes (want 4 MiB: two 2 MiB segments)", p.reserved);
    CHECK(b[0]->addr % VMM_POOL_ALIGN == 0 && b[5]->addr % VMM_POOL_ALIGN == 0, "512-byte aligned");
    CHECK(consistent(&p), "consistent after packing");
    for (int i = 0; i < 1000; i++) vmm__pool_free(&p, b[i], 0, NULL);
    CHECK(p.used == 0 && p.empty_bytes == p.reserved, "all empty after the frees");
    CHECK(consistent(&p), "consistent after freeing");
    vmm__pool_destroy(&p);
    CHECK(dev.in_use == 0 && dev.unreserves == dev.reserves, "destroy gives back every segment and arena");
}

static void test_merge_across_segments(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, 0, 0);
    vmm__block *a = take(&p, 30 * MiB, 1, 1), *b = take(&p, 30 * MiB, 1, 1), *keep = take(&p, 30 * MiB, 1, 1);
    CHECK(a && b && keep && p.n_segs == 3, "three 30 MiB blocks grew three segments (%" PRIu64 ")", p.n_segs);
    unsigned made = dev.creates;
    vmm__pool_free(&p, a, 1, NULL);
    vmm__pool_free(&p, b, 1, NULL);
    CHECK(consistent(&p), "consistent after two frees");
    vmm__block *big = take(&p, 60 * MiB, 1, 1);
    CHECK(big && big->addr == a->addr && dev.creates == made, "a 60 MiB request takes the two freed segments' space, "
          "merged, and maps nothing new (%u segments made)", dev.creates - made);
    CHECK(vmm__pool_seg_at(big->arena, GRANULE, big->addr) != vmm__pool_seg_at(big->arena, GRANULE, big->addr + big->size - 1),
          "the block spans two segments");
    CHECK(consistent(&p), "consistent with a block over two segments");
    /* growth: a freed block followed by unmapped space serves a larger request with only the difference mapped */
    vmm__pool_free(&p, keep, 1, NULL);
    uint64_t before = p.reserved;
    vmm__block *grown = take(&p, 50 * MiB, 1, 1);
    CHECK(grown && grown->addr == keep->addr && p.reserved - before <= 20 * MiB + GRANULE,
          "a 50 MiB request after a freed 30 MiB block maps about 20 MiB more (%" PRIu64 " MiB)", (p.reserved - before) >> 20);
    CHECK(consistent(&p), "consistent after growing into unmapped space");
    vmm__pool_destroy(&p);
}

static void test_give_back(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, 0, 0);
    vmm__block *x = take(&p, 100 * MiB, 0, 0), *y = take(&p, 4096, 0, 0), *z = take(&p, 64 * MiB, 0, 0);
    CHECK(x && y && z, "allocated");
    dev.now = 2000;
    CHECK(vmm__pool_free(&p, x, 0, NULL) == 1, "freeing the only block of a segment empties it");
    CHECK(vmm__pool_oldest_empty(&p) == 2000, "the segment is empty since the free");
    CHECK(vmm__pool_release(&p, 0, 0, 1999) == 0 && p.reserved > 100 * MiB, "not given back before its time");
    uint64_t given = vmm__pool_release(&p, 0, 0, 2000);
    CHECK(given >= 100 * MiB && dev.in_use == p.reserved, "given back once due (%" PRIu64 " MiB)", given >> 20);
    CHECK(consistent(&p), "consistent after give-back");
    /* trim while blocks live: z's segment goes when z is freed even though y lives on */
    vmm__pool_free(&p, z, 0, NULL);
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(dev.in_use == GRANULE && p.reserved == GRANULE, "trimmed to y's one page while y lives (%" PRIu64 " bytes)", dev.in_use);
    /* a budget keeps the youngest empty segments */
    vmm__block *u = take(&p, 40 * MiB, 0, 0);
    vmm__pool_free(&p, u, 0, NULL);
    vmm__pool_release(&p, 0, 40 * MiB, UINT64_MAX);
    CHECK(p.empty_bytes >= 40 * MiB, "a 40 MiB budget keeps the 40 MiB empty");
    vmm__pool_free(&p, y, 0, NULL);
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(dev.in_use == 0 && p.reserved == 0, "everything back with no block left");
    CHECK(consistent(&p), "consistent when empty");
    vmm__block *again = take(&p, 100 * MiB, 0, 0);
    CHECK(again && consistent(&p), "the address space of given-back segments serves again");
    vmm__pool_destroy(&p);
}

/* cudaMalloc's pool: large requests map exactly their size, and a much smaller request never
 * splits an empty segment (the remainder would stay pinned behind it) but replaces it. */
static void test_exact(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, 0, 0);
    p.exact = 1;
    vmm__block *a = take(&p, 3 * MiB, 0, 0);
    CHECK(a && p.reserved == 4 * MiB && dev.in_use == 4 * MiB, "3 MiB maps its 2 MiB-rounded 4 MiB, not a 20 MiB step (%" PRIu64 ")", p.reserved);
    vmm__block *big = take(&p, 100 * MiB, 0, 0);
    vmm__pool_free(&p, big, 0, NULL);
    vmm__block *c = take(&p, 30 * MiB, 0, 0);
    CHECK(c && p.reserved == 34 * MiB && dev.in_use == 34 * MiB,
          "30 MiB after freeing 100 MiB holds 30 MiB, not the 100 MiB segment (%" PRIu64 " MiB)", p.reserved >> 20);
    vmm__block *d = take(&p, 30 * MiB, 0, 0);
    vmm__pool_free(&p, d, 0, NULL);
    vmm__block *e = take(&p, 29 * MiB, 0, 0);
    CHECK(e && p.reserved == 64 * MiB && p.segs_made == 4, "a near fit reuses the empty segment (%" PRIu64 " MiB, %" PRIu64 " made)",
          p.reserved >> 20, p.segs_made);
    vmm__pool_free(&p, a, 0, NULL);
    vmm__pool_free(&p, c, 0, NULL);
    vmm__pool_free(&p, e, 0, NULL);
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(p.reserved == 0 && dev.in_use == 0 && consistent(&p), "all back");
    vmm__pool_destroy(&p);
}

/* A large allocation above the arena size gets an arena of its own; freed and given back, its
 * address space is kept for the next request of that size (no reserve, the same address), and
 * goes once a give-back reaches its time, or at destroy. */
static void test_va_kept(void)
{
    vmm__pool p;
    setup(&p, 64 * GiB, 0, 0);
    p.exact = 1;
    vmm__block *a = take(&p, 20 * GiB, 0, 0);
    uint64_t at = a ? a->addr : 0;
    unsigned reserves = dev.reserves;
    vmm__pool_free(&p, a, 0, NULL);
    vmm__pool_release_newest(&p, 0);
    CHECK(p.reserved == 0 && dev.in_use == 0 && dev.unreserves == 0, "the memory goes back, its address space stays "
          "(%" PRIu64 " reserved, %u unreserves)", p.reserved, dev.unreserves);
    vmm__arena *parked = p.parked;
    CHECK(!p.arenas && parked && parked->base == at && parked->first && !parked->first->next && !parked->first->backed,
          "the arena is parked whole: out of the pool's list, one unmapped free block");
    vmm__block *b = take(&p, 20 * GiB, 0, 0);
    CHECK(b && b->addr == at && dev.reserves == reserves, "the same size again: the same address, no reserve "
          "(%u reserves, want %u)", dev.reserves, reserves);
    CHECK(b && b->arena == parked && p.arenas == parked && !p.parked && vmm__pool_block_at(parked, p.granule, at + 10 * GiB) == b,
          "it comes back as it was parked, its page tables kept (not rebuilt: a pointer per 2 MiB of a device)");
    vmm__pool_free(&p, b, 0, NULL);
    vmm__pool_release_newest(&p, 0);
    vmm__block *c = take(&p, 30 * GiB, 0, 0);
    CHECK(c && dev.reserves == reserves + 1 && dev.unreserves == 0, "another size reserves anew; the kept one stays "
          "until another is dropped (%u unreserves)", dev.unreserves);
    vmm__pool_free(&p, c, 0, NULL);
    vmm__pool_release_newest(&p, 0);
    CHECK(dev.unreserves == 1, "dropping the 30 GiB arena gives the 20 GiB one back (%u)", dev.unreserves);
    dev.now += 10;
    CHECK(vmm__pool_release(&p, 0, 0, dev.now - 20) == 0 && dev.unreserves == 1, "a give-back before its time keeps it");
    vmm__pool_release(&p, 0, 0, dev.now);
    CHECK(dev.unreserves == 2 && dev.unreserves == dev.reserves, "a give-back at its time frees it (%u of %u)",
          dev.unreserves, dev.reserves);
    vmm__pool_destroy(&p);
    CHECK(dev.unreserves == dev.reserves, "destroy leaves nothing reserved");
}

static void test_streams(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, 0, 0);
    vmm__block *a = take(&p, 8 * MiB, 1, 7);
    uint64_t addr = a->addr;
    fake_event *e = ev_new();
    vmm__pool_free(&p, a, 7, e);
    vmm__block *other = take(&p, 8 * MiB, 1, 9);
    CHECK(other && other->addr != addr, "another stream does not get a block whose free is in flight");
    vmm__block *same = take(&p, 16 * MiB, 1, 7); /* more than the free space after `other` */
    CHECK(same && same->addr == addr, "the freeing stream gets it at once");
    vmm__pool_free(&p, same, 7, ev_new());
    vmm__pool_free(&p, other, 9, NULL);
    CHECK(vmm__pool_release(&p, 0, 0, UINT64_MAX) < p.reserved + 1 && p.reserved > 0,
          "a segment a free in flight touches is not given back");
    for (int i = 0; i < n_events; i++) events[i].done = 1;
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(p.reserved == 0 && dev.in_use == 0, "given back once the frees are reached");
    CHECK(live_events == 0 && double_releases == 0, "every event released once (%d live, %d twice)", live_events, double_releases);
    CHECK(consistent(&p), "consistent");
    vmm__pool_destroy(&p);
}

static int waits, wait_answer;
static uint64_t waited_stream;
static void *waited_event;

static int fk_wait(void *ctx, uint64_t stream, void *event)
{
    (void)ctx;
    if (wait_answer) return wait_answer;
    waits++;
    waited_stream = stream;
    waited_event = event;
    return 0;
}

/* Another stream and a free in flight, with the mechanism able to make a stream wait
 * (VMM_POOL_REUSE_INTERNAL, the native pool's default): when no free block is usable at once, the
 * other stream takes the pending one, made to wait for exactly its free's event (recorded then,
 * as it was not); with INTERNAL off, or the wait refused, it gets new memory; the cudaMalloc pool
 * (!ordered) never waits. */
static void test_internal_dependencies(void)
{
    vmm__pool p;
    for (int variant = 0; variant < 4; variant++) {
        setup(&p, 8 * GiB, 0, 0);
        p.ops.stream_wait = fk_wait;
        waits = wait_answer = 0;
        if (variant == 1) p.reuse &= ~VMM_POOL_REUSE_INTERNAL;
        if (variant == 2) wait_answer = -1;
        int ordered = variant != 3;
        vmm__block *a = take(&p, 8 * MiB, ordered, 7);
        uint64_t addr = a->addr, reserved = p.reserved;
        if (ordered) vmm__pool_free_unrecorded(&p, a, 7, (void *)0x1, 1);
        else vmm__pool_free(&p, a, 7, ev_new());
        vmm__block *c = take(&p, 8 * MiB, ordered, 9); /* the free merged with the segment's free rest: all pending */
        if (variant == 0) {
            CHECK(c && c->addr == addr && p.reserved == reserved, "another stream takes the pending free");
            CHECK(waits == 1 && waited_stream == 9 && waited_event == &events[n_events - 1] && p.cross_waits == 1,
                  "made to wait for its free's event, recorded now (%d waits on %llu)", waits, (unsigned long long)waited_stream);
        } else {
            CHECK(c && c->addr != addr && waits == 0 && p.reserved > reserved, "variant %d: new memory, no wait", variant);
        }
        vmm__pool_free(&p, c, 9, NULL);
        for (int i = 0; i < n_events; i++) events[i].done = 1;
        vmm__pool_release(&p, 0, 0, UINT64_MAX);
        CHECK(p.reserved == 0 && live_events == 0 && double_releases == 0 && consistent(&p),
              "variant %d: all given back, every event released once", variant);
        vmm__pool_destroy(&p);
    }
}

/* The end of a cross-stream variant: the other stream's block freed, every free reached and
 * settled, and everything must go back with every event released once. */
static void cross_stream_end(vmm__pool *p, vmm__block *c, int variant)
{
    vmm__pool_free(p, c, 9, NULL);
    for (int i = 0; i < n_events; i++) events[i].done = 1;
    vmm__pool_reached_by_sync(p, 1, 0, (void *)0x1, 100);
    vmm__pool_release(p, 0, 0, UINT64_MAX);
    CHECK(p->reserved == 0 && live_events == 0 && double_releases == 0 && consistent(p),
          "variant %d: all given back, every event released once", variant);
    vmm__pool_destroy(p);
}

/* Opportunistic reuse (VMM_POOL_REUSE_OPPORTUNISTIC), internal dependencies refused: a free on
 * another stream whose event was reached serves the asking stream at once with no wait; one not
 * reached yet does not (new memory).  With OPPORTUNISTIC off the pool does not ask, but a free it
 * has seen reached on its own (a give-back's look, growing) still serves any stream (pool.h): not
 * tested as native, which is not measured. */
static void test_opportunistic(void)
{
    vmm__pool p;
    for (int variant = 0; variant < 2; variant++) {
        setup(&p, 8 * GiB, 0, 0);
        p.ops.stream_wait = fk_wait;
        p.reuse &= ~VMM_POOL_REUSE_INTERNAL;
        waits = wait_answer = 0;
        vmm__block *a = take(&p, 8 * MiB, 1, 7);
        uint64_t addr = a->addr, reserved = p.reserved;
        unsigned made = dev.creates;
        vmm__pool_free(&p, a, 7, ev_new());
        if (variant == 0) events[n_events - 1].done = 1; /* the GPU reached the free */
        vmm__block *c = take(&p, 8 * MiB, 1, 9);
        if (variant == 0)
            CHECK(c && c->addr == addr && p.reserved == reserved && dev.creates == made && waits == 0,
                  "a reached free serves another stream at once, no segment made, no wait (%u made, %d waits)",
                  dev.creates - made, waits);
        else
            CHECK(c && c->addr != addr && p.reserved > reserved && waits == 0, "variant %d: new memory", variant);
        cross_stream_end(&p, c, variant);
    }
}

static uint64_t follow_waiter, follow_source, follow_mark;

static uint64_t fk_followed(void *ctx, uint64_t waiter, uint64_t source)
{
    (void)ctx;
    return waiter == follow_waiter && source == follow_source ? follow_mark : 0;
}

/* The program's own event dependencies (VMM_POOL_REUSE_FOLLOW), internal dependencies refused:
 * another stream that waited for an event recorded on the freeing stream after the free (a mark
 * above the free's number) takes the pending free at once, with no wait added; a mark at the free's
 * number or below (the event recorded before the free), a wait on another stream, or FOLLOW off:
 * new memory. */
static void test_follow_dependencies(void)
{
    vmm__pool p;
    for (int variant = 0; variant < 4; variant++) {
        setup(&p, 8 * GiB, 0, 0);
        p.ops.stream_wait = fk_wait;
        p.ops.followed = fk_followed;
        p.reuse &= ~VMM_POOL_REUSE_INTERNAL;
        waits = wait_answer = 0;
        follow_waiter = 9, follow_source = 7, follow_mark = 2; /* frees numbered 1 were before the record */
        if (variant == 1) follow_mark = 1;
        if (variant == 2) follow_source = 5;
        if (variant == 3) p.reuse &= ~VMM_POOL_REUSE_FOLLOW;
        vmm__block *a = take(&p, 8 * MiB, 1, 7);
        uint64_t addr = a->addr, reserved = p.reserved;
        vmm__pool_free_unrecorded(&p, a, 7, (void *)0x1, 1);
        vmm__block *c = take(&p, 8 * MiB, 1, 9);
        if (variant == 0)
            CHECK(c && c->addr == addr && p.reserved == reserved && waits == 0 && records == 0,
                  "a stream that waited past the free takes it, no wait or record added (%d waits, %d records)", waits,
                  records);
        else
            CHECK(c && c->addr != addr && p.reserved > reserved && waits == 0, "variant %d: new memory", variant);
        cross_stream_end(&p, c, variant);
    }
}

/* The freeing stream takes part of a block whose free is in flight: the rest still waits on the
 * free, since work queued before it may still use that memory (it was given back, unmapped, under
 * a running kernel on the GPU when the rest lost its event). */
static void test_rest_keeps_waiting(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, 0, 0);
    vmm__block *a = take(&p, 32 * MiB, 1, 7);
    uint64_t addr = a->addr;
    vmm__pool_free(&p, a, 7, ev_new());
    vmm__block *part = take(&p, 4 * MiB, 1, 7);
    CHECK(part && part->addr == addr, "the freeing stream takes the front of it at once");
    vmm__block *other = take(&p, 8 * MiB, 1, 9);
    CHECK(other && (other->addr >= addr + 32 * MiB || other->addr + 8 * MiB <= addr), "another stream does not get the rest");
    vmm__pool_free(&p, other, 9, NULL);
    vmm__pool_free(&p, part, 7, NULL);
    CHECK(vmm__pool_release(&p, 0, 0, UINT64_MAX) < 32 * MiB && p.reserved >= 32 * MiB,
          "the segment under the rest is not given back while the free is in flight");
    for (int i = 0; i < n_events; i++) events[i].done = 1;
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(p.reserved == 0 && live_events == 0 && double_releases == 0, "all given back once it is reached");
    CHECK(consistent(&p), "consistent");
    vmm__pool_destroy(&p);
}

/* A stream-ordered free may leave its event unrecorded: the freeing stream reuses the block with
 * no event at all, and the event is recorded only when another stream, a give-back or a wait
 * needs it, unless a synchronization covering the free comes first. */
static void test_unrecorded(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, 0, 0);
    static int sctx;
    vmm__block *a = take(&p, 8 * MiB, 1, 7);
    uint64_t addr = a->addr;
    vmm__pool_free_unrecorded(&p, a, 7, &sctx, 1);
    vmm__block *same = take(&p, 8 * MiB, 1, 7);
    CHECK(same && same->addr == addr && records == 0, "the freeing stream reuses it with no event recorded (%d)", records);
    vmm__pool_free_unrecorded(&p, same, 7, &sctx, 2);
    vmm__block *other = take(&p, 8 * MiB, 1, 9);
    CHECK(other && other->addr != addr && records == 1 && p.n_unrecorded == 0,
          "another stream makes it recorded (%d) and does not get it while it is in flight", records);
    vmm__pool_free(&p, other, 9, NULL);
    for (int i = 0; i < n_events; i++) events[i].done = 1;
    vmm__block *again = take(&p, 8 * MiB, 1, 9);
    CHECK(again && again->addr == addr, "and gets it once the recorded event is reached");
    vmm__pool_free_unrecorded(&p, again, 9, &sctx, 3);
    vmm__pool_reached_by_sync(&p, 0, 9, &sctx, 3);
    CHECK(p.n_unrecorded == 1, "a synchronization that began before the free does not cover it");
    vmm__pool_reached_by_sync(&p, 0, 5, &sctx, 9);
    CHECK(p.n_unrecorded == 1, "nor one of another stream");
    static int other_ctx;
    vmm__pool_reached_by_sync(&p, 1, 0, &other_ctx, 9);
    CHECK(p.n_unrecorded == 1, "nor one of another context");
    vmm__pool_reached_by_sync(&p, 0, 9, &sctx, 4);
    CHECK(p.n_unrecorded == 0 && records == 1, "one of its stream after it does, with no event recorded (%d)", records);
    vmm__block *x = take(&p, 8 * MiB, 1, 11);
    CHECK(x && x->addr == addr, "so any stream gets it at once");
    vmm__pool_free_unrecorded(&p, x, 11, &sctx, 5);
    record_answer = 0; /* being captured */
    CHECK(vmm__pool_release(&p, 0, 0, UINT64_MAX) == 0 && p.n_unrecorded == 1, "no give-back while it cannot be recorded");
    record_answer = -1; /* the stream is gone */
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(p.reserved == 0 && dev.in_use == 0 && p.n_unrecorded == 0, "a free on a stream gone counts as reached");
    record_answer = 1;
    vmm__block *y = take(&p, 8 * MiB, 1, 11);
    vmm__pool_free_unrecorded(&p, y, 11, &sctx, 6);
    vmm__pool_record_stream(&p, 12);
    CHECK(p.n_unrecorded == 1, "recording another stream's frees leaves it");
    vmm__pool_record_stream(&p, 11);
    CHECK(p.n_unrecorded == 0 && vmm__pool_release(&p, 0, 0, UINT64_MAX) == 0, "recorded before its stream goes, and in flight");
    vmm__block *z = take(&p, 2 * MiB, 1, 11);
    vmm__pool_free_unrecorded(&p, z, 11, &sctx, 7);
    void *pending[8];
    unsigned np = vmm__pool_pending_events(&p, pending, 8);
    CHECK(np >= 1 && p.n_unrecorded == 0, "a wait for frees in flight records them first (%u events)", np);
    for (int i = 0; i < n_events; i++) events[i].done = 1;
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(p.reserved == 0 && live_events == 0 && double_releases == 0, "all given back; every event released once (%d live, %d twice)",
          live_events, double_releases);
    CHECK(consistent(&p), "consistent");
    vmm__pool_destroy(&p);
}

static void test_oom(void)
{
    vmm__pool p;
    setup(&p, 256 * MiB, UINT64_MAX, 0);
    vmm__block *a = take(&p, 200 * MiB, 0, 0);
    int err = 0;
    vmm__block *b = vmm__pool_alloc(&p, 100 * MiB, 0, 0, &err);
    CHECK(a && !b && err == -ENOMEM, "past the device's capacity: -ENOMEM (%d)", err);
    vmm__pool_free(&p, a, 0, NULL);
    b = vmm__pool_alloc(&p, 250 * MiB, 0, 0, &err);
    CHECK(b && dev.in_use <= 256 * MiB, "a budget that keeps everything still gives back for a request the device needs");
    CHECK(consistent(&p), "consistent after out of memory");
    vmm__pool_destroy(&p);
}

static void test_isolate(void)
{
    vmm__pool p;
    setup(&p, 8 * GiB, UINT64_MAX, 1);
    vmm__block *a = take(&p, 4096, 0, 0), *b = take(&p, 4096, 0, 0);
    CHECK(a && b && p.n_segs == 2 && a->size == GRANULE, "every allocation its own 2 MiB segment");
    vmm__pool_free(&p, a, 0, NULL);
    vmm__block *c = take(&p, 6 * MiB, 0, 0);
    CHECK(c && vmm__pool_seg_at(c->arena, GRANULE, c->addr)->size == 6 * MiB, "a larger one is never placed over a freed one");
    vmm__block *d = take(&p, 1000, 0, 0);
    CHECK(d && d->addr == a->addr, "the same rounded size reuses it");
    CHECK(consistent(&p), "consistent");
    vmm__pool_destroy(&p);
}

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}

/* A transformer-like trace: per step, activations whose size follows a sequence length that
 * changes every step, freed in reverse, over weights that live throughout; the stream-ordered
 * pool keeps everything (PyTorch sets the release threshold to UINT64_MAX). */
static void test_varying_trace(int ordered)
{
    vmm__pool p;
    setup(&p, 64 * GiB, ordered ? UINT64_MAX : 0, 0);
    vmm__block *w[24], *act[64];
    uint64_t live = 0, live_peak = 0;
    for (int i = 0; i < 24; i++) {
        w[i] = take(&p, (4 + i % 5) * MiB + 1024 * (uint64_t)i, ordered, 1);
        live += w[i]->charged;
    }
    int ok = 1;
    for (int step = 0; step < 300 && ok; step++) {
        uint64_t seq = 128 + next_rand() % 896;
        int n = 0;
        for (int l = 0; l < 12; l++)
            for (int k = 0; k < 4 && n < 64; k++) {
                uint64_t sz = seq * (1024 + 512 * (uint64_t)k) * 8 + next_rand() % 4096;
                act[n] = take(&p, sz, ordered, 1);
                if (!act[n]) ok = 0;
                else live += act[n]->charged, n++;
            }
        if (live > live_peak) live_peak = live;
        while (n--) {
            live -= act[n]->charged;
            vmm__pool_free(&p, act[n], 1, NULL);
        }
        if (!ordered && step % 10 == 9) vmm__pool_release(&p, 0, 0, UINT64_MAX); /* the idle give-back */
    }
    CHECK(ok, "%s trace: every request served", ordered ? "stream-ordered" : "synchronous");
    CHECK(dev.peak <= live_peak + live_peak / 10, "%s trace: physical peak %" PRIu64 " MiB <= 1.10 x live peak %" PRIu64 " MiB",
          ordered ? "stream-ordered" : "synchronous", dev.peak >> 20, live_peak >> 20);
    CHECK(consistent(&p), "consistent after the trace");
    vmm__pool_destroy(&p);
}

/* bench_mem's pool row: mixed sizes, 256 B to 256 MiB spread evenly over the powers of two, at most 64 live, stream-ordered,
 * with nothing ever trimmed (the release threshold at UINT64_MAX).  Empty segments stranded
 * between live blocks must not pile up: the physical peak follows the live peak. */
static void test_mixed_keep_all(void)
{
    vmm__pool p;
    setup(&p, 64 * GiB, UINT64_MAX, 0);
    p.seg_max = VMM_POOL_SEG_MAX;
    vmm__block *live[64];
    int n = 0, ok = 1;
    uint64_t bytes = 0, bytes_peak = 0;
    for (int op = 0; op < 3000 && ok; op++) {
        uint64_t r = next_rand();
        if (n == 64 || (n > 0 && (r & 1))) {
            int i = (int)((r >> 1) % (uint64_t)n);
            bytes -= live[i]->charged;
            vmm__pool_free(&p, live[i], 1, NULL);
            live[i] = live[--n];
        } else {
            uint64_t base = 256ull << (next_rand() % 20), sz = base + next_rand() % base;
            if (!(live[n] = take(&p, sz, 1, 1))) ok = 0;
            else bytes += live[n++]->charged;
            if (bytes > bytes_peak) bytes_peak = bytes;
        }
    }
    CHECK(ok, "mixed trace, nothing trimmed: every request served");
    printf("stat: mixed trace, nothing trimmed: physical peak %" PRIu64 " MiB, live peak %" PRIu64 " MiB, %u segments made, %u given back\n",
           dev.peak >> 20, bytes_peak >> 20, dev.creates, dev.destroys);
    CHECK(dev.peak <= bytes_peak + bytes_peak / 20 + 64 * MiB,
          "mixed trace, nothing trimmed: physical peak %" PRIu64 " MiB <= 1.05 x live peak %" PRIu64 " MiB + 64 MiB (%u segments made)",
          dev.peak >> 20, bytes_peak >> 20, dev.creates);
    int capped = 1;
    for (vmm__seg *s = p.segs; s; s = s->snext) capped &= s->size <= VMM_POOL_SEG_MAX;
    CHECK(capped, "no segment is larger than %u MiB", VMM_POOL_SEG_MAX >> 20);
    CHECK(consistent(&p), "consistent after the mixed trace");
    vmm__pool_destroy(&p);
}

/* Random mixed sizes and frees, checked against the bookkeeping at every step.  Half the
 * stream-ordered frees leave their event unrecorded and the streams reach them only now and
 * then, so empty segments move while their frees are in flight (tests/unit/test_shim.c replays a
 * real program's trace for what that saves). */
static void test_random(void)
{
    vmm__pool p;
    static int sctx;
    setup(&p, 64 * GiB, 0, 0);
    vmm__block *live[64] = {0};
    uint64_t stream_of[64] = {0}, seq = 0;
    int ok = 1;
    events_cleared_late = 1;
    for (int i = 0; i < 4000 && ok; i++) {
        int k = (int)(next_rand() % 64);
        if (live[k]) {
            uint64_t how = next_rand() % 3;
            if (how == 2) vmm__pool_free_unrecorded(&p, live[k], stream_of[k], &sctx, ++seq);
            else vmm__pool_free(&p, live[k], stream_of[k], how ? ev_new() : NULL);
            live[k] = NULL;
        } else {
            uint64_t sz = 256ull << (next_rand() % 20);
            sz += next_rand() % sz;
            int ordered = (int)(next_rand() % 2);
            stream_of[k] = ordered ? 1 + next_rand() % 3 : 0;
            live[k] = take(&p, sz, ordered, stream_of[k]);
            if (!live[k]) ok = 0;
        }
        if (i % 7 == 0) vmm__pool_release(&p, 0, 0, UINT64_MAX);
        if (i % 13 == 0)
            for (int e = 0; e < n_events; e++) events[e].done = 1;
        if (i % 50 == 0 && !consistent(&p)) ok = 0;
    }
    CHECK(ok && consistent(&p), "4000 random operations keep the pool consistent (%u segments moved)", dev.moves);
    CHECK(dev.moves > 0, "segments moved while their frees were in flight");
    for (int e = 0; e < n_events; e++) events[e].done = 1;
    vmm__pool_reached_by_sync(&p, 1, 0, &sctx, UINT64_MAX);
    vmm__pool_release(&p, 0, 0, UINT64_MAX);
    CHECK(dev.old_mapped == 0 && !p.retired, "every old place is unmapped once reached (%" PRIu64 " bytes left)", dev.old_mapped);
    CHECK(consistent(&p), "consistent at the end");
    events_cleared_late = 0;
    vmm__pool_destroy(&p);
}

int main(void)
{
    test_small_packing();
    test_merge_across_segments();
    test_give_back();
    test_exact();
    test_va_kept();
    test_streams();
    test_internal_dependencies();
    test_follow_dependencies();
    test_opportunistic();
    test_unrecorded();
    test_rest_keeps_waiting();
    test_oom();
    test_isolate();
    test_varying_trace(1);
    test_varying_trace(0);
    test_mixed_keep_all();
    test_random();
    CHECK_DONE();
}
