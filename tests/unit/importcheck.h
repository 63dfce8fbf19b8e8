/* What the tests of vmm_import_many and its halves (test_import_many, test_import_begin,
 * test_import_multi) check an import with, over the emulated driver and the `progs/spans` owner:
 * the driver's counters, the words a buffer holds, and that nothing is left mapped, reserved or
 * held after a call.  Header-only, for tests/unit only; the test sets g_counters from the
 * emulated driver (dlsym "fakecuda_counters") before it counts. */
#ifndef VMMSHIM_TESTS_IMPORTCHECK_H
#define VMMSHIM_TESTS_IMPORTCHECK_H
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spansowner.h"
#include "vmmshim.h"

static fakecuda_counters_fn g_counters;

/* Allocate with cudaMalloc and fill with seed's words; the buffer's index, or -1. */
static inline int owner_alloc_filled(uint64_t bytes, uint64_t seed, uint64_t *addr)
{
    int idx = owner_alloc_with('a', bytes, addr);
    if (idx < 0 || !owner_cmd(NULL, "w %d %llu", idx, (unsigned long long)seed)) return -1;
    return idx;
}

static inline struct fakecuda_counters counters(void)
{
    struct fakecuda_counters c;
    memset(&c, 0, sizeof c);
    if (g_counters) g_counters(&c);
    return c;
}

/* The words of [p, p + bytes) are seed's from word index k0 on: the first wrong one, or -1. */
static inline long long first_wrong(uint64_t p, uint64_t bytes, uint64_t seed, uint64_t k0)
{
    const volatile uint64_t *w = (const volatile uint64_t *)(uintptr_t)p;
    for (uint64_t k = 0; k < bytes / 8; k++)
        if (w[k] != word(seed, k0 + k)) return (long long)k;
    return -1;
}

static inline bool all_null(vmm_imported **out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (out[i]) return false;
    return true;
}

static inline double mono_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static inline void release_all(vmm_imported **out, size_t n)
{
    for (size_t i = 0; i < n; i++) CHECK(vmm_import_release(out[i]) == VMM_OK, "release %zu: %s", i, vmm_last_error());
}

/* Once the idle chunks are dropped, the driver holds what it held at c0: mappings, reservations,
 * handles, imports. */
static inline bool same_as_before(struct fakecuda_counters c0, const char *what)
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
#endif
