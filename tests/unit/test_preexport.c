/* Exporting ahead of requests (shim/backing/preexport.c), over the emulated driver with every
 * export slowed to 50 ms (an H100's is ~0.6 ms).
 *
 * The owner is tests/progs/spans under the shim with VMMSHIM_PREEXPORT_MS=150.  Its buffers
 * lie unexported while nothing is named (nobody asked: the emulated driver counts no export).
 * Three are named (vmm_publish); while the broker thread exports the segments under them in the
 * background, the owner's cudaMalloc/cudaFree pairs never wait on an export (the slowest pair
 * stays well under one).  Then this process, a companion, takes the three with one
 * vmm_import_many: no export in the owner, and in much less than one export's time (the code
 * before exported each segment at the first take: at least 300 ms here).  A buffer never named
 * is still exported at its first take (slow, as before), and a buffer named and freed within
 * the delay is never exported.  With VMMSHIM_PREEXPORT_FDS=1 one segment is exported ahead and
 * the others at the take. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>

#define MIB (1ull << 20)
#define EXPORT_US 100000ull

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The owner's successful exports so far, or -1. */
static long long owner_exports(void)
{
    char a[256];
    unsigned long long n = 0;
    if (!owner_cmd(a, "c") || sscanf(a, "ok %llu", &n) != 1) return -1;
    return (long long)n;
}

/* The owner's exports once they stop changing (each is 100 ms: 400 ms without one is the end). */
static long long exports_settled(void)
{
    long long last = owner_exports();
    for (int i = 0; i < 100; i++) {
        sleep_ms(400);
        long long now = owner_exports();
        if (now == last) return now;
        last = now;
    }
    return last;
}

static int owner_alloc(uint64_t bytes, uint64_t seed, uint64_t *addr)
{
    int idx = owner_alloc_with('a', bytes, addr);
    if (idx < 0 || !owner_cmd(NULL, "w %d %llu", idx, (unsigned long long)seed)) return -1;
    return idx;
}

/* One take of n buffers: its milliseconds (negative when it failed); every first word checked. */
static double take(vmm_registry *reg, const uint64_t *addr, const uint64_t *seed, size_t n)
{
    vmm_imported *out[8];
    double t0 = now_ms();
    vmm_status st = vmm_import_many(reg, (uint32_t)g_pid, addr, NULL, n, out);
    double ms = now_ms() - t0;
    CHECK(st == VMM_OK, "vmm_import_many: %d: %s", (int)st, vmm_last_error());
    if (st != VMM_OK) return -1;
    for (size_t i = 0; i < n; i++) {
        uint64_t w = *(const volatile uint64_t *)(uintptr_t)vmm_import_ptr(out[i]);
        CHECK(w == word(seed[i], 0), "buffer %zu reads 0x%llx, want 0x%llx", i, (unsigned long long)w,
              (unsigned long long)word(seed[i], 0));
        CHECK(vmm_import_release(out[i]) == VMM_OK, "release: %s", vmm_last_error());
    }
    CHECK(vmm_import_drop_idle() == VMM_OK, "drop_idle: %s", vmm_last_error());
    return ms;
}

static bool stop_owner(void) { return spans_quit() == 0; }

int main(void)
{
    spans_setup("preexport");
    setenv("VMMSHIM_PREEXPORT_MS", "150", 1);
    /* kept fds live above 1023: the owner (which inherits this limit) needs room there */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 4096 && rl.rlim_max > rl.rlim_cur) {
        rl.rlim_cur = rl.rlim_max < 4096 ? rl.rlim_max : 4096;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur < 1024 + 64 + 16) {
        printf("note: RLIMIT_NOFILE %llu leaves no fd numbers above 1023 to keep exports in: nothing to test\n",
               (unsigned long long)rl.rlim_cur);
        CHECK_DONE();
    }
    CHECK(spans_start(), "cannot start the owner");
    CHECK(owner_cmd(NULL, "e %llu", EXPORT_US), "the owner cannot slow its exports");

    /* three buffers to be named, one never named; each of several segments' size */
    uint64_t named[3], seed[3] = {11, 12, 13}, lazy = 0;
    int idx[3];
    for (int i = 0; i < 3; i++) idx[i] = owner_alloc(24 * MIB, seed[i], &named[i]);
    int lidx = owner_alloc(24 * MIB, 14, &lazy);
    CHECK(idx[0] >= 0 && idx[1] >= 0 && idx[2] >= 0 && lidx >= 0, "the owner could not allocate");
    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg || lidx < 0) CHECK_DONE();

    /* 1. nothing named, nothing asked: nothing exported */
    sleep_ms(400);
    CHECK(owner_exports() == 0, "%lld exports in an owner nobody asked", owner_exports());

    /* 2. named: exported in the background, the owner's allocations never waiting on it */
    for (int i = 0; i < 3; i++) CHECK(owner_cmd(NULL, "p %d w%d", idx[i], i), "vmm_publish of buffer %d", i);
    char a[256];
    double slowest_us = -1;
    unsigned long long pairs = 0;
    CHECK(owner_cmd(a, "t 700") && sscanf(a, "ok %lf %llu", &slowest_us, &pairs) == 2, "t: %s", a);
    long long during = owner_exports();
    printf("stat: %llu cudaMalloc/cudaFree pairs while exporting, the slowest %.0f us; %lld exports by then\n", pairs,
           slowest_us, during);
    CHECK(during > 0, "no export within 700 ms of naming (VMMSHIM_PREEXPORT_MS=150)");
    CHECK(slowest_us >= 0 && slowest_us < EXPORT_US / 2.0,
          "a cudaMalloc/cudaFree pair took %.0f us while the broker exported (an export takes %llu)", slowest_us, EXPORT_US);
    long long settled = exports_settled();
    CHECK(settled >= 3, "%lld exports for three named buffers", settled);

    /* 3. the companion's first take pays no export */
    double ms = take(reg, named, seed, 3);
    long long after = owner_exports();
    printf("stat: first take of the three named buffers %.1f ms, %lld exports in the owner\n", ms, after - settled);
    CHECK(after == settled, "the first take exported %lld segments", after - settled);
    CHECK(ms >= 0 && ms < EXPORT_US / 1000.0 / 2, "the first take took %.1f ms (an export is %llu ms)", ms,
          EXPORT_US / 1000);

    /* 4. a buffer never named is exported at its first take, as before */
    uint64_t lseed = 14;
    ms = take(reg, &lazy, &lseed, 1);
    long long lazy_exports = owner_exports() - after;
    printf("stat: first take of a buffer never named %.1f ms, %lld exports\n", ms, lazy_exports);
    CHECK(lazy_exports >= 1 && ms >= EXPORT_US / 1000.0, "never named: %lld exports, %.1f ms", lazy_exports, ms);

    /* 5. named and freed within the delay: never exported */
    long long before = owner_exports();
    uint64_t churn = 0;
    int cidx = owner_alloc(24 * MIB, 15, &churn);
    CHECK(cidx >= 0 && owner_cmd(NULL, "p %d churn", cidx) && owner_cmd(NULL, "f %d", cidx), "churn buffer");
    sleep_ms(600);
    CHECK(owner_exports() == before, "a buffer freed within the delay: %lld exports", owner_exports() - before);

    CHECK(stop_owner(), "the owner did not end cleanly");

    /* 6. the kept fds are bounded: VMMSHIM_PREEXPORT_FDS=1 keeps one, the rest wait for a request */
    setenv("VMMSHIM_PREEXPORT_FDS", "1", 1);
    CHECK(spans_start() && owner_cmd(NULL, "e %llu", EXPORT_US / 10), "cannot start the second owner");
    for (int i = 0; i < 3; i++) idx[i] = owner_alloc(24 * MIB, seed[i], &named[i]);
    for (int i = 0; i < 3; i++) CHECK(idx[i] >= 0 && owner_cmd(NULL, "p %d w%d", idx[i], i), "second owner: buffer %d", i);
    settled = exports_settled();
    CHECK(settled == 1, "VMMSHIM_PREEXPORT_FDS=1: %lld exports ahead of requests", settled);
    ms = take(reg, named, seed, 3);
    CHECK(owner_exports() == settled + 2, "the take exported %lld (the two not kept)", owner_exports() - settled);
    CHECK(stop_owner(), "the second owner did not end cleanly");

    vmm_close(reg);
    shm_unlink(g_reg);
    CHECK_DONE();
}
