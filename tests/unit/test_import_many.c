/* vmm_import_many: several byte ranges of one owner in one call, over the emulated driver.
 *
 * The owner is tests/progs/spans under the shim, driven line by line (as in test_import_multi.c).
 * Small cudaMalloc buffers share one pooled chunk (read from their records, never assumed); this
 * process imports ranges of them with one vmm_import_many, reads every byte through the returned
 * pointers (the emulated driver's device pointers are host addresses) and counts its own driver
 * calls: however many ranges lie in one chunk, it is imported once and mapped once.  A range over
 * two side-by-side buffers of the chunk shares it too; ranges of a MULTI-HANDLE allocation share
 * its handles.  A bad entry (a gap, a freed buffer, a size past the address space) fails the
 * whole call with out[] all NULL, the error naming the entry, and nothing left mapped. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define SEG (20 * MIB)
#define KIB (1ull << 10)

static fakecuda_counters_fn g_counters;

/* Allocate and fill with seed's words; the buffer's index, or -1. */
static int owner_alloc(uint64_t bytes, uint64_t seed, uint64_t *addr)
{
    int idx = owner_alloc_with('a', bytes, addr);
    if (idx < 0 || !owner_cmd(NULL, "w %d %llu", idx, (unsigned long long)seed)) return -1;
    return idx;
}

static struct fakecuda_counters counters(void)
{
    struct fakecuda_counters c;
    memset(&c, 0, sizeof c);
    if (g_counters) g_counters(&c);
    return c;
}

/* The words of [p, p + bytes) are seed's from word index k0 on: the first wrong one, or -1. */
static long long first_wrong(uint64_t p, uint64_t bytes, uint64_t seed, uint64_t k0)
{
    const volatile uint64_t *w = (const volatile uint64_t *)(uintptr_t)p;
    for (uint64_t k = 0; k < bytes / 8; k++)
        if (w[k] != word(seed, k0 + k)) return (long long)k;
    return -1;
}

static bool all_null(vmm_imported **out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (out[i]) return false;
    return true;
}

static void release_all(vmm_imported **out, size_t n)
{
    for (size_t i = 0; i < n; i++) CHECK(vmm_import_release(out[i]) == VMM_OK, "release %zu: %s", i, vmm_last_error());
}

static bool same_as_before(struct fakecuda_counters c0, const char *what)
{
    CHECK(vmm_import_drop_idle() == VMM_OK, "%s: drop_idle: %s", what, vmm_last_error());
    struct fakecuda_counters c = counters();
    bool same = c.mappings_live == c0.mappings_live && c.reservations_live == c0.reservations_live &&
                c.handles_live == c0.handles_live && c.imports_live == c0.imports_live;
    CHECK(same, "%s: mappings %llu reservations %llu handles %llu imports %llu (before: %llu %llu %llu %llu)", what,
          c.mappings_live, c.reservations_live, c.handles_live, c.imports_live, c0.mappings_live,
          c0.reservations_live, c0.handles_live, c0.imports_live);
    return same;
}

#define NSMALL 3

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_reg, sizeof g_reg, "/vmmshim-many-%d", (int)getpid());
    setenv("VMMSHIM_REGISTRY", g_reg, 1);
    signal(SIGPIPE, SIG_IGN);
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *fn = drv ? dlsym(drv, "fakecuda_counters") : NULL;
    memcpy(&g_counters, &fn, sizeof fn);
    CHECK(g_counters != NULL, "the emulated driver is not on LD_LIBRARY_PATH");
    CHECK(spans_start(), "cannot start the owner");

    /* three small buffers (one pooled chunk), one of 4 MiB (a chunk of its own) */
    uint64_t small[NSMALL] = {0}, big = 0;
    int sidx[NSMALL];
    for (int i = 0; i < NSMALL; i++) sidx[i] = owner_alloc(256 * KIB, 100 + (uint64_t)i, &small[i]);
    int bidx = owner_alloc(4 * MIB, 200, &big);
    CHECK(sidx[0] >= 0 && sidx[1] >= 0 && sidx[2] >= 0 && bidx >= 0, "the owner could not allocate");
    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg || bidx < 0) CHECK_DONE();
    uint32_t pid = (uint32_t)g_pid;
    vmm_alloc_info s[NSMALL], a_big;
    for (int i = 0; i < NSMALL; i++) CHECK(vmm_find(reg, pid, small[i], &s[i]) == VMM_OK, "find: %s", vmm_last_error());
    CHECK(vmm_find(reg, pid, big, &a_big) == VMM_OK, "find big: %s", vmm_last_error());
    CHECK(s[0].chunk_id && s[0].chunk_id == s[1].chunk_id && s[1].chunk_id == s[2].chunk_id &&
              a_big.chunk_id != s[0].chunk_id,
          "layout: chunks %llu %llu %llu, big %llu: the small buffers do not share one chunk",
          (unsigned long long)s[0].chunk_id, (unsigned long long)s[1].chunk_id, (unsigned long long)s[2].chunk_id,
          (unsigned long long)a_big.chunk_id);
    bool adjacent = s[1].address == s[0].address + s[0].extent;
    printf("stat: small buffers at chunk offsets %llu %llu %llu (extent %llu), %s\n",
           (unsigned long long)s[0].chunk_offset, (unsigned long long)s[1].chunk_offset,
           (unsigned long long)s[2].chunk_offset, (unsigned long long)s[0].extent,
           adjacent ? "side by side" : "not side by side");

    /* 1. N ranges in one chunk: one import, one mapping */
    {
        struct fakecuda_counters c0 = counters();
        uint64_t addr[5] = {small[0], small[1] + 64 * KIB, small[2], small[2] + 8 * KIB, small[1] + 8};
        uint64_t size[5] = {0, 32 * KIB, 256 * KIB, 0, 16};
        vmm_imported *out[5];
        vmm_status st = vmm_import_many(reg, pid, addr, size, 5, out);
        CHECK(st == VMM_OK, "one chunk: %s", vmm_last_error());
        if (st == VMM_OK) {
            struct fakecuda_counters c1 = counters();
            CHECK(c1.imports - c0.imports == 1 && c1.mappings_live - c0.mappings_live == 1 &&
                      c1.reservations_live - c0.reservations_live == 1,
                  "one chunk: %llu imports, %llu mappings, %llu reservations for 5 ranges",
                  c1.imports - c0.imports, c1.mappings_live - c0.mappings_live,
                  c1.reservations_live - c0.reservations_live);
            /* size 0 is the whole allocation, also from an interior address (range 3) */
            uint64_t want_size[5] = {s[0].requested_size, 32 * KIB, 256 * KIB, s[2].requested_size, 16};
            uint64_t seed[5] = {100, 101, 102, 102, 101}, k0[5] = {0, 64 * KIB / 8, 0, 0, 1};
            for (int i = 0; i < 5; i++) {
                CHECK(vmm_import_size(out[i]) == want_size[i], "one chunk: range %d: size %llu, want %llu", i,
                      (unsigned long long)vmm_import_size(out[i]), (unsigned long long)want_size[i]);
                long long bad = first_wrong(vmm_import_ptr(out[i]), want_size[i], seed[i], k0[i]);
                CHECK(bad < 0, "one chunk: range %d: word %lld reads wrong", i, bad);
                CHECK(vmm_import_check(reg, out[i]) == VMM_OK, "one chunk: check %d: %s", i, vmm_last_error());
            }
            CHECK(vmm_import_ptr(out[1]) - vmm_import_ptr(out[0]) == small[1] + 64 * KIB - small[0] &&
                      vmm_import_ptr(out[3]) == vmm_import_ptr(out[2]),
                  "one chunk: ranges are not at their places in one mapping");
            uint8_t host[16];
            CHECK(vmm_import_read(out[4], 0, host, 16) == VMM_OK && memcmp(host, (void *)(uintptr_t)vmm_import_ptr(out[4]), 16) == 0,
                  "one chunk: vmm_import_read: %s", vmm_last_error());
            CHECK(vmm_import_read(out[4], 8, host, 16) == VMM_ERR_INVALID, "one chunk: read past a 16-byte range");
            /* a second call finds the chunk mapped: nothing imported or mapped */
            vmm_imported *again[2];
            uint64_t a2[2] = {small[0], small[2]};
            st = vmm_import_many(reg, pid, a2, NULL, 2, again);
            struct fakecuda_counters c2 = counters();
            CHECK(st == VMM_OK && c2.imports == c1.imports && c2.mappings_live == c1.mappings_live &&
                      vmm_import_ptr(again[0]) == vmm_import_ptr(out[0]),
                  "again: %d, %llu more imports: %s", (int)st, c2.imports - c1.imports, vmm_last_error());
            if (st == VMM_OK) release_all(again, 2);
            release_all(out, 5);
        }
        same_as_before(c0, "one chunk");
    }

    /* 2. two chunks, and a range over two side-by-side buffers of the pooled one */
    {
        struct fakecuda_counters c0 = counters();
        uint64_t addr[4] = {big + MIB, small[1], small[0], big};
        uint64_t size[4] = {MIB, 0, adjacent ? s[0].extent + s[1].requested_size : 8, 0};
        vmm_imported *out[4];
        vmm_status st = vmm_import_many(reg, pid, addr, size, 4, out);
        CHECK(st == VMM_OK, "two chunks: %s", vmm_last_error());
        if (st == VMM_OK) {
            struct fakecuda_counters c1 = counters();
            CHECK(c1.imports - c0.imports == 2 && c1.mappings_live - c0.mappings_live == 2,
                  "two chunks: %llu imports, %llu mappings for 4 ranges", c1.imports - c0.imports,
                  c1.mappings_live - c0.mappings_live);
            CHECK(first_wrong(vmm_import_ptr(out[0]), MIB, 200, MIB / 8) < 0, "two chunks: big's 2nd MiB reads wrong");
            CHECK(first_wrong(vmm_import_ptr(out[3]), 4 * MIB, 200, 0) < 0 && vmm_import_size(out[3]) == 4 * MIB,
                  "two chunks: big reads wrong");
            CHECK(first_wrong(vmm_import_ptr(out[1]), 256 * KIB, 101, 0) < 0, "two chunks: small 1 reads wrong");
            if (adjacent) {
                CHECK(first_wrong(vmm_import_ptr(out[2]), 256 * KIB, 100, 0) < 0 &&
                          first_wrong(vmm_import_ptr(out[2]) + s[0].extent, 256 * KIB, 101, 0) < 0,
                      "across two buffers: reads wrong");
                CHECK(vmm_import_ptr(out[2]) + (small[1] - small[0]) == vmm_import_ptr(out[1]),
                      "across two buffers: not in the chunk's one mapping");
            }
            release_all(out, 4);
        }
        same_as_before(c0, "two chunks");
    }

    /* 3. all or nothing: a gap, an overflowing size; nothing stays imported or mapped */
    {
        struct fakecuda_counters c0 = counters();
        uint64_t addr[3] = {small[0], big, 0x1000};
        uint64_t size[3] = {0, 0, 64};
        vmm_imported *out[3] = {(vmm_imported *)1, (vmm_imported *)1, (vmm_imported *)1};
        vmm_status st = vmm_import_many(reg, pid, addr, size, 3, out);
        CHECK(st == VMM_ERR_NOT_FOUND && all_null(out, 3) && strstr(vmm_last_error(), "range 2 of 3") &&
                  strstr(vmm_last_error(), "0x1000"),
              "a gap: %d: %s", (int)st, vmm_last_error());
        same_as_before(c0, "a gap");
        addr[2] = big + 8;
        size[2] = UINT64_MAX;
        st = vmm_import_many(reg, pid, addr, size, 3, out);
        CHECK(st == VMM_ERR_INVALID && all_null(out, 3) && strstr(vmm_last_error(), "range 2 of 3"),
              "overflow: %d: %s", (int)st, vmm_last_error());
        size[2] = 8 * MIB; /* past the end of big, into nothing */
        st = vmm_import_many(reg, pid, addr, size, 3, out);
        CHECK(st != VMM_OK && all_null(out, 3) && strstr(vmm_last_error(), "range 2 of 3"),
              "past the end: %d: %s", (int)st, vmm_last_error());
        same_as_before(c0, "past the end");
        CHECK(vmm_import_many(reg, pid, addr, size, 0, out) == VMM_OK, "n 0: %s", vmm_last_error());
        CHECK(vmm_import_many(reg, 0, addr, size, 1, out) == VMM_ERR_INVALID && all_null(out, 1), "pid 0");
        CHECK(vmm_import_many(reg, pid, NULL, size, 1, out) == VMM_ERR_INVALID && all_null(out, 1), "addresses NULL");
    }

    /* 4. stale: a buffer freed since its record was read; a held import keeps its memory */
    {
        struct fakecuda_counters c0 = counters();
        vmm_imported *held[1];
        uint64_t a1[1] = {small[2]};
        CHECK(vmm_import_many(reg, pid, a1, NULL, 1, held) == VMM_OK, "held: %s", vmm_last_error());
        CHECK(owner_cmd(NULL, "f %d", sidx[2]), "the owner did not free small 2");
        uint64_t addr[2] = {small[0], small[2]};
        vmm_imported *out[2];
        vmm_status st = vmm_import_many(reg, pid, addr, NULL, 2, out);
        CHECK((st == VMM_ERR_NOT_FOUND || st == VMM_ERR_STALE) && all_null(out, 2) &&
                  strstr(vmm_last_error(), "range 1 of 2"),
              "freed: %d: %s", (int)st, vmm_last_error());
        CHECK(vmm_import_check(reg, held[0]) == VMM_ERR_STALE, "held after the free: %s", vmm_last_error());
        CHECK(first_wrong(vmm_import_ptr(held[0]), 256 * KIB, 102, 0) < 0, "held: memory gone after the free");
        CHECK(vmm_import_release(held[0]) == VMM_OK, "held release: %s", vmm_last_error());
        same_as_before(c0, "freed");
    }

    /* 5. ranges of a MULTI-HANDLE allocation share its handles */
    {
        uint64_t unused, span = 0;
        int first = -1;
        for (int i = 0; i < 3; i++) {
            char a[256];
            int k = -1;
            unsigned long long p = 0;
            if (owner_cmd(a, "a %llu", (unsigned long long)SEG) && sscanf(a, "ok %d 0x%llx", &k, &p) == 2 && i == 0)
                first = k;
            unused = p;
        }
        (void)unused;
        for (int i = 0; i < 3 && first >= 0; i++) CHECK(owner_cmd(NULL, "f %d", first + i), "free segment %d", i);
        int mi = first >= 0 ? owner_alloc(3 * SEG, 300, &span) : -1;
        vmm_alloc_info m;
        if (mi >= 0 && vmm_find(reg, pid, span, &m) == VMM_OK && (m.flags & VMM_ALLOC_MULTI_HANDLE)) {
            struct fakecuda_counters c0 = counters();
            uint64_t addr[3] = {span + MIB, span + SEG + 4 * MIB, span};
            uint64_t size[3] = {MIB, SEG, 0};
            vmm_imported *out[3];
            vmm_status st = vmm_import_many(reg, pid, addr, size, 3, out);
            CHECK(st == VMM_OK, "multi: %s", vmm_last_error());
            if (st == VMM_OK) {
                struct fakecuda_counters c1 = counters();
                CHECK(c1.imports - c0.imports == m.n_handles && c1.mappings_live - c0.mappings_live == m.n_handles,
                      "multi: %llu imports, %llu mappings for %u handles", c1.imports - c0.imports,
                      c1.mappings_live - c0.mappings_live, m.n_handles);
                CHECK(first_wrong(vmm_import_ptr(out[0]), MIB, 300, MIB / 8) < 0 &&
                          first_wrong(vmm_import_ptr(out[1]), SEG, 300, (SEG + 4 * MIB) / 8) < 0 &&
                          first_wrong(vmm_import_ptr(out[2]), 3 * SEG, 300, 0) < 0,
                      "multi: reads wrong");
                release_all(out, 3);
            }
            same_as_before(c0, "multi");
        } else {
            CHECK(0, "the owner could not make a multi-handle allocation");
        }
    }

    /* 6. a dead owner: nothing imported */
    fputs("q\n", g_to);
    fclose(g_to);
    g_to = NULL;
    int wst = 0;
    waitpid(g_pid, &wst, 0);
    CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "the owner ended with status 0x%x", wst);
    {
        uint64_t addr[2] = {small[0], big};
        vmm_imported *out[2];
        vmm_status st = vmm_import_many(reg, pid, addr, NULL, 2, out);
        CHECK(st != VMM_OK && all_null(out, 2) && strstr(vmm_last_error(), "range 0 of 2"), "dead owner: %d: %s",
              (int)st, vmm_last_error());
    }
    CHECK(vmm_import_drop_idle() == VMM_OK, "drop_idle: %s", vmm_last_error());
    CHECK(counters().fds_open == 0, "%llu fds on imported memory left open", counters().fds_open);
    if (g_from) fclose(g_from);
    vmm_close(reg);
    shm_unlink(g_reg);
    CHECK_DONE();
}
