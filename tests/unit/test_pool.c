/* The pool's policy over a mechanism made of plain numbers: a device of FAKE_CAPACITY bytes whose
 * chunks are address ranges, and events that are reached when a test says so.  Packing and
 * alignment, split and coalesce, stream-ordered reuse, give-back on out-of-memory, isolation,
 * 50,000 small blocks, and random mixed-size churn checked against the pool's own bookkeeping. */
#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "check.h"
#include "pool/pool.c"

#define MiB (1ull << 20)
#define GRANULE (2 * MiB)

static struct {
    uint64_t capacity, in_use, next_va;
    unsigned creates, destroys, waits;
} dev;

typedef struct fake_event {
    int done, released;
} fake_event;

/* Events are never freed, so a test may mark any of them reached; the pool must release each once. */
static fake_event events[40000];
static int n_events, live_events, double_releases;

static int fk_create(void *ctx, vmm__chunk *c)
{
    (void)ctx;
    uint64_t size = c->size;
    if (dev.in_use + size > dev.capacity) return -ENOMEM;
    dev.in_use += size;
    c->base = dev.next_va;
    dev.next_va += size + GRANULE; /* a hole after each, so chunks are never contiguous */
    dev.creates++;
    return 0;
}

static void fk_destroy(void *ctx, vmm__chunk *c)
{
    (void)ctx;
    dev.in_use -= c->size;
    dev.destroys++;
}

static int fk_done(void *ctx, void *e)
{
    (void)ctx;
    return ((fake_event *)e)->done;
}

static void fk_wait(void *ctx, void *e)
{
    (void)ctx;
    ((fake_event *)e)->done = 1;
    dev.waits++;
}

static void fk_release(void *ctx, void *e)
{
    (void)ctx;
    fake_event *f = e;
    double_releases += f->released;
    f->released = 1;
    live_events--;
}

static fake_event *ev_new(void)
{
    if (n_events == (int)(sizeof events / sizeof *events)) n_events = 0; /* old ones are long settled */
    live_events++;
    events[n_events] = (fake_event){0, 0};
    return &events[n_events++];
}

static void reach_all(void)
{
    for (int i = 0; i < n_events; i++) events[i].done = 1;
}

static void setup(vmm__pool *p, uint64_t capacity, uint64_t retain, int isolate)
{
    memset(&dev, 0, sizeof dev);
    dev.capacity = capacity;
    dev.next_va = 1ull << 40;
    live_events = n_events = 0;
    vmm__pool_ops ops = {NULL, fk_create, fk_destroy, fk_done, fk_wait, fk_release};
    vmm__pool_init(p, &ops, GRANULE, retain, isolate);
}

static vmm__block *take(vmm__pool *p, uint64_t size, int ordered, uint64_t stream)
{
    int err;
    return vmm__pool_alloc(p, size, ordered, stream, &err);
}

/* Every chunk is tiled by its blocks, in order, and the pool's counters agree with them. */
static int consistent(const vmm__pool *p)
{
    uint64_t reserved = 0, used = 0, empty = 0;
    for (const vmm__chunk *c = p->chunks; c; c = c->next) {
        uint64_t at = c->base;
        uint32_t live = 0;
        for (const vmm__block *b = c->first; b; b = b->next) {
            if (b->addr != at || b->size == 0 || b->addr % VMM_POOL_ALIGN || b->chunk != c) return 0;
            if (b->next && b->next->prev != b) return 0;
            at += b->size;
            if (!b->free) {
                live++;
                used += b->size;
            }
        }
        if (at != c->base + c->size || live != c->n_live) return 0;
        reserved += c->size;
        if (!live) empty += c->size;
    }
    return reserved == p->reserved && used == p->used && empty == p->empty_bytes && reserved == dev.in_use;
}

static void test_packing(void)
{
    vmm__pool p;
    setup(&p, 64 * MiB, 1ull << 40, 0);
    vmm__block *b[1000];
    int ok = 1;
    for (int i = 0; i < 1000; i++) ok &= (b[i] = take(&p, 4096, 0, 0)) != NULL;
    CHECK(ok, "1000 x 4 KiB");
    CHECK_EQ(p.n_chunks, 2); /* 4,096,000 bytes in 2 MiB chunks */
    CHECK_EQ(p.used, 1000 * 4096);
    uint64_t sizes[] = {1, 100, 256, 511, 512, 513, 1000, 4097, 65535, MiB - 1, MiB};
    for (unsigned i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        vmm__block *x = take(&p, sizes[i], 0, 0);
        CHECK(x && x->addr % VMM_POOL_ALIGN == 0 && x->size >= sizes[i] && x->size % VMM_POOL_ALIGN == 0 &&
                  x->size - sizes[i] < VMM_POOL_ALIGN && x->chunk->small,
              "size %" PRIu64 ": addr %#" PRIx64 " extent %" PRIu64, sizes[i], x ? x->addr : 0, x ? x->size : 0);
    }
    CHECK(consistent(&p), "bookkeeping after packing");
    for (int i = 0; i < 1000; i++) vmm__pool_free(&p, b[i], 0, NULL);
    CHECK(consistent(&p), "bookkeeping after freeing");
    vmm__pool_destroy(&p);
}

static void test_split_coalesce(void)
{
    vmm__pool p;
    setup(&p, 64 * MiB, 1ull << 40, 0);
    vmm__block *a = take(&p, 100 * 1024, 0, 0), *b = take(&p, 200 * 1024, 0, 0), *c = take(&p, 300 * 1024, 0, 0);
    CHECK(a && b && c && a->chunk == b->chunk && b->chunk == c->chunk, "three in one chunk");
    CHECK(b->addr == a->addr + a->size && c->addr == b->addr + b->size, "split in address order");
    uint64_t a_addr = a->addr;
    vmm__pool_free(&p, b, 0, NULL);
    vmm__pool_free(&p, a, 0, NULL); /* a absorbs b */
    CHECK(consistent(&p), "after two frees");
    vmm__block *ab = take(&p, 300 * 1024, 0, 0); /* fits only in a+b coalesced */
    CHECK(ab && ab->addr == a_addr, "coalesced a+b reused for a request neither fitted alone");
    vmm__pool_free(&p, ab, 0, NULL);
    vmm__pool_free(&p, c, 0, NULL);
    vmm__chunk *ch = p.chunks;
    CHECK(ch && ch->first && !ch->first->next && ch->first->free && ch->first->size == ch->size,
          "an empty chunk is one free block again");
    /* medium requests split out of one 20 MiB chunk */
    vmm__block *m1 = take(&p, 3 * MiB, 0, 0), *m2 = take(&p, 5 * MiB, 0, 0);
    CHECK(m1 && m2 && m1->chunk == m2->chunk && m1->chunk->size == 20 * MiB, "two medium requests share a 20 MiB chunk");
    /* a large one gets a chunk of its own size */
    vmm__block *l = take(&p, 33 * MiB + 5, 0, 0);
    CHECK(l && l->chunk->size == 34 * MiB && l->addr == l->chunk->base, "a large request's own chunk, 2 MiB-rounded");
    CHECK(consistent(&p), "bookkeeping");
    vmm__pool_destroy(&p);
}

/* Native cudaMalloc gives requests over 1 MiB whole 2 MiB pages; cudaMallocAsync packs at 512 B. */
static void test_alignment(void)
{
    vmm__pool p;
    setup(&p, 256 * MiB, 1ull << 40, 0);
    vmm__block *a = take(&p, MiB + 512, 1, 1);
    vmm__block *s = take(&p, 3 * MiB, 0, 0);
    CHECK(a && a->size == MiB + 512 && a->addr % VMM_POOL_ALIGN == 0, "stream-ordered: 512-byte packing");
    CHECK(s && s->chunk == a->chunk && s->addr % GRANULE == 0 && s->size == 4 * MiB,
          "synchronous over 1 MiB: a 2 MiB-aligned, 2 MiB-rounded block in the same chunk (at %#" PRIx64 ", %" PRIu64 " bytes)",
          s ? s->addr : 0, s ? s->size : 0);
    vmm__block *gap = s ? s->prev : NULL;
    CHECK(gap && gap->free && gap->addr == a->addr + a->size && gap->addr + gap->size == s->addr, "the gap before it stays free");
    vmm__block *fill = take(&p, MiB / 2 + 1024, 1, 1); /* large-pool requests are > 1 MiB: this goes to a small chunk */
    CHECK(fill && fill->chunk->small, "a small request does not land in a large chunk's gap");
    uint64_t base = a->addr;
    vmm__pool_free(&p, a, 0, NULL); /* joins the gap: 2 MiB free before s */
    vmm__block *g2 = take(&p, 2 * MiB, 1, 1);
    CHECK(g2 && g2->addr == base, "the gap rejoins its neighbour when that is freed");
    CHECK(consistent(&p), "bookkeeping");
    vmm__pool_destroy(&p);
}

static void test_streams(void)
{
    vmm__pool p;
    setup(&p, 64 * MiB, 1ull << 40, 0);
    vmm__block *x = take(&p, 8192, 1, 1);
    uint64_t at = x->addr;
    vmm__chunk *a = x->chunk;
    fake_event *e1 = ev_new();
    vmm__pool_free(&p, x, 1, e1);
    vmm__block *y = take(&p, 8192, 1, 1);
    CHECK(y && y->addr == at && !y->event, "the freeing stream reuses its block at once");
    fake_event *e2 = ev_new();
    vmm__pool_free(&p, y, 1, e2); /* the chunk's free space now waits on e2, the newer event */
    CHECK_EQ(live_events, 1);
    vmm__block *z = take(&p, MiB, 1, 2);
    CHECK(z && z->chunk != a, "another stream does not, before the event");
    vmm__block *s = take(&p, 512 * 1024, 0, 0);
    CHECK(s && s->chunk != a, "nor does a synchronous allocation");
    e2->done = 1;
    vmm__block *w = take(&p, MiB, 1, 2); /* fits only in the first chunk */
    CHECK(w && w->addr == at, "another stream does once the event is reached");
    CHECK_EQ(live_events, 0);
    /* a settled block and a pending neighbour merge; the whole waits on the pending one's event */
    vmm__block *n1 = take(&p, 4096, 0, 0), *n2 = take(&p, 4096, 0, 0);
    CHECK(n1 && n2 && n2->addr == n1->addr + n1->size, "neighbours");
    uint64_t n1_addr = n1->addr;
    vmm__pool_free(&p, n1, 0, NULL);
    fake_event *e3 = ev_new();
    vmm__pool_free(&p, n2, 3, e3);
    vmm__block *m = vmm__pool_block_at(n1->chunk, n1_addr);
    CHECK(m && m->free && m->event == e3 && m->stream == 3 && m->size >= 8192, "settled and pending neighbours merged");
    CHECK(consistent(&p), "bookkeeping");
    vmm__pool_destroy(&p);
    CHECK_EQ(live_events, 0);
}

static void test_oom_gives_back(void)
{
    vmm__pool p;
    setup(&p, 8 * MiB, 1ull << 40, 0);
    vmm__block *b[4];
    for (int i = 0; i < 4; i++) b[i] = take(&p, MiB + 0, 0, 0); /* 1 MiB: small; two share a chunk */
    vmm__block *more[4];
    for (int i = 0; i < 4; i++) more[i] = take(&p, MiB, 0, 0);
    CHECK(b[3] && more[3] && p.n_chunks == 4 && dev.in_use == 8 * MiB, "the device is full of small chunks");
    for (int i = 0; i < 4; i++) vmm__pool_free(&p, b[i], 0, NULL);
    fake_event *pending = ev_new();
    vmm__pool_free(&p, more[0], 5, pending); /* in flight on stream 5 */
    vmm__pool_free(&p, more[1], 0, NULL);
    CHECK(p.n_chunks == 4 && p.empty_bytes >= 4 * MiB, "empty chunks are kept for reuse");
    int err = 0;
    vmm__block *big = vmm__pool_alloc(&p, 5 * MiB, 0, 0, &err);
    CHECK(big != NULL, "a 5 MiB request after giving back the empty chunks (err %d)", err);
    CHECK(dev.destroys >= 3 && dev.waits >= 1, "gave back %u chunks, waited for %u frees in flight", dev.destroys, dev.waits);
    vmm__block *none = vmm__pool_alloc(&p, 8 * MiB, 0, 0, &err);
    CHECK(!none && err == -ENOMEM, "a request the device cannot hold fails with -ENOMEM");
    CHECK(consistent(&p), "bookkeeping");
    vmm__pool_destroy(&p);
}

static void test_isolate(void)
{
    vmm__pool p;
    setup(&p, 256 * MiB, 1ull << 40, 1);
    vmm__block *b[10];
    for (int i = 0; i < 10; i++) b[i] = take(&p, 4096, 0, 0);
    CHECK(p.n_chunks == 10 && b[9]->size == GRANULE && b[9]->addr == b[9]->chunk->base, "ten chunks of their own");
    uint64_t at = b[4]->addr;
    vmm__pool_free(&p, b[4], 0, NULL);
    vmm__block *big = take(&p, 3 * MiB, 0, 0);
    CHECK(big && big->addr != at && big->size == 4 * MiB, "a freed chunk is reused only for its own size");
    vmm__block *again = take(&p, 100, 0, 0);
    CHECK(again && again->addr == at && again->size == GRANULE, "and is, whole");
    CHECK(consistent(&p), "bookkeeping");
    vmm__pool_destroy(&p);
}

static void test_many_small(void)
{
    vmm__pool p;
    setup(&p, 1ull << 30, 1ull << 30, 0);
    static vmm__block *b[50000];
    int failed = 0;
    for (int i = 0; i < 50000; i++) failed += !(b[i] = take(&p, 4096, 0, 0));
    CHECK_EQ(failed, 0);
    CHECK(p.reserved <= 50000ull * 4096 + GRANULE, "50,000 x 4 KiB reserve %" PRIu64 " bytes", p.reserved);
    for (int i = 0; i < 50000; i += 2) vmm__pool_free(&p, b[i], 0, NULL);
    for (int i = 1; i < 50000; i += 2) vmm__pool_free(&p, b[i], 0, NULL);
    CHECK(consistent(&p) && p.used == 0, "all freed");
    CHECK_EQ(vmm__pool_give_back(&p, 0), 50000ull * 4096 / GRANULE * GRANULE + GRANULE);
    CHECK_EQ(p.reserved, 0);
    vmm__pool_destroy(&p);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Random mixed sizes, 256 B to 256 MiB log-uniform, up to 64 live, some stream-ordered frees. */
static void test_mixed_churn(void)
{
    vmm__pool p;
    setup(&p, 64ull << 30, 1ull << 30, 0);
    vmm__block *live[64];
    uint64_t req[64];
    int n = 0, failed = 0, bad = 0, overlaps = 0;
    for (int op = 0; op < 20000; op++) {
        if (n == 64 || (n > 0 && rnd() % 2)) {
            int k = (int)(rnd() % (uint64_t)n);
            uint64_t s = rnd() % 4;
            fake_event *e = s ? ev_new() : NULL;
            vmm__pool_free(&p, live[k], s, e);
            live[k] = live[--n];
            req[k] = req[n];
        } else {
            uint64_t base = 1ull << (8 + rnd() % 20); /* 2^8 .. 2^28, log-uniform within each power */
            uint64_t size = base + rnd() % base;
            vmm__block *b = take(&p, size, rnd() % 2, rnd() % 4);
            if (!b) {
                failed++;
                continue;
            }
            if (b->size < size || b->addr % VMM_POOL_ALIGN) bad++;
            for (int i = 0; i < n; i++)
                if (b->addr < live[i]->addr + live[i]->size && live[i]->addr < b->addr + b->size) overlaps++;
            live[n] = b;
            req[n++] = size;
        }
        if (op % 97 == 0) reach_all();
        if (op % 16 == 0 && !consistent(&p)) {
            bad++;
            break;
        }
    }
    CHECK(failed == 0 && bad == 0 && overlaps == 0, "mixed churn: %d failed, %d bad, %d overlaps", failed, bad, overlaps);
    CHECK(consistent(&p), "bookkeeping after mixed churn");
    CHECK(p.chunks_made < 2000, "mixed churn reuses free space: %" PRIu64 " chunks made for 20,000 operations", p.chunks_made);
    vmm__pool_destroy(&p);
    CHECK_EQ(live_events, 0);
    CHECK_EQ(double_releases, 0);
}

static void test_retain(void)
{
    vmm__pool p;
    setup(&p, 1ull << 30, 8 * MiB, 0);
    vmm__block *b[8];
    for (int i = 0; i < 8; i++) b[i] = take(&p, 64 * MiB, 0, 0);
    for (int i = 0; i < 8; i++) vmm__pool_free(&p, b[i], 0, NULL);
    CHECK(p.empty_bytes <= 64 * MiB && dev.destroys >= 7, "empty chunks beyond the retain limit go back: %" PRIu64 " kept",
          p.empty_bytes);
    CHECK(consistent(&p), "bookkeeping");
    vmm__pool_destroy(&p);
}

int main(void)
{
    test_packing();
    test_split_coalesce();
    test_alignment();
    test_streams();
    test_oom_gives_back();
    test_isolate();
    test_many_small();
    test_mixed_churn();
    test_retain();
    CHECK_DONE();
}
