/* The pool's footprint follows the program's live bytes (issue 15), over the emulated driver:
 * tests/progs/footprint runs natively and under the shim, and the shim's figures are held to
 * native's: memory given back after the give-back delay with no further CUDA call, the default
 * pool's release at a synchronization, its attributes counting only stream-ordered memory, a trim
 * to 0 while a cudaMalloc block stays live, and a varying-size trace whose physical peak stays
 * within 1.10x of its live peak. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "spawn.h"

#define MiB (1ull << 20)

static char g_build[512], g_preload[1200];

typedef struct run_out {
    int rc;
    char out[4096], err[4096];
} run_out;

/* event_delay_us: how long after cuEventRecord the emulated driver reports the event reached (a
 * real GPU takes microseconds even on an idle stream; 0 makes it instant) */
static void run(int shim, const char *give_back_ms, const char *event_delay_us, run_out *o)
{
    char prog[600], gb[64], delay[64];
    snprintf(prog, sizeof prog, "%s/progs/footprint", g_build);
    snprintf(gb, sizeof gb, "VMMSHIM_GIVE_BACK_MS=%s", give_back_ms);
    snprintf(delay, sizeof delay, "FAKECUDA_EVENT_DELAY_US=%s", event_delay_us);
    char *const argv[] = {prog, NULL};
    const char *with_shim[] = {g_preload, gb, delay, NULL}, *native[] = {gb, delay, NULL};
    const char *const *env = shim ? with_shim : native;
    o->rc = spawn_capture(argv, env, o->out, sizeof o->out, o->err, sizeof o->err, 60);
}

static double value(const run_out *o, const char *key)
{
    char pat[80];
    snprintf(pat, sizeof pat, "%s ", key);
    for (const char *p = o->out; (p = strstr(p, pat)); p++)
        if (p == o->out || p[-1] == '\n') return strtod(p + strlen(pat), NULL);
    return -1e300;
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);

    static run_out native, shimmed, quick;
    run(0, "200", "0", &native);
    CHECK(native.rc == 0, "natively: rc %d\n%s%s", native.rc, native.out, native.err);
    CHECK(value(&native, "giveback_left") == 0 && value(&native, "sync_left") == 0,
          "natively memory goes back at the free:\n%s", native.out);

    run(1, "200", "0", &shimmed);
    CHECK(shimmed.rc == 0, "under the shim: rc %d\n%s%s", shimmed.rc, shimmed.out, shimmed.err);
    CHECK(!strstr(shimmed.err, "vmmshim:"), "the shim printed: %s", shimmed.err);
    CHECK(value(&shimmed, "early_threshold_held") >= 50 * MiB && value(&native, "early_threshold_held") >= 50 * MiB,
          "a release threshold set before the first allocation holds: %.0f bytes kept (natively %.0f)",
          value(&shimmed, "early_threshold_held"), value(&native, "early_threshold_held"));
    double ms = value(&shimmed, "giveback_ms");
    CHECK(value(&shimmed, "giveback_left") == 0 && ms >= 190 && ms <= 450,
          "a cudaFree'd 64 MiB goes back 200 ms later with no further call: %.0f ms, %.0f bytes left", ms,
          value(&shimmed, "giveback_left"));
    CHECK(value(&native, "large_free_left") == 0 && value(&shimmed, "large_free_left") == 0,
          "a cudaFree'd 1 GiB is the device's again when cudaFree returns, for a neighbour to allocate: %.0f bytes "
          "left (natively %.0f)", value(&shimmed, "large_free_left"), value(&native, "large_free_left"));
    CHECK(value(&shimmed, "large_pairs_purge_wakes") >= 0 && value(&shimmed, "large_pairs_purge_wakes") <= 2,
          "50 pairs of 1 GiB cudaMalloc + cudaFree woke the give-back thread %.0f times (each free went back whole)",
          value(&shimmed, "large_pairs_purge_wakes"));
    CHECK(value(&shimmed, "small_free_left") == 16 * MiB,
          "a cudaFree'd 16 MiB waits out the delay for reuse (VMMSHIM_GIVE_BACK_HOLD): %.0f bytes held",
          value(&shimmed, "small_free_left"));
    CHECK(value(&shimmed, "sync_left") == 0, "after cudaFreeAsync + synchronize (threshold 0) %.0f bytes stay",
          value(&shimmed, "sync_left"));
    CHECK(value(&shimmed, "attr_used") == value(&native, "attr_used") && value(&shimmed, "attr_used") == 8 * MiB,
          "UsedMemCurrent %.0f, natively %.0f", value(&shimmed, "attr_used"), value(&native, "attr_used"));
    CHECK(value(&shimmed, "attr_reserved") >= 8 * MiB && value(&shimmed, "attr_reserved") <= 32 * MiB,
          "ReservedMemCurrent %.0f must not count the 100 MiB cudaMalloc block", value(&shimmed, "attr_reserved"));
    CHECK(value(&shimmed, "trim_reserved") == 0 && value(&shimmed, "trim_extra") == 0,
          "TrimTo(0) with a cudaMalloc block live: reserved %.0f, %.0f bytes held beyond the live block",
          value(&shimmed, "trim_reserved"), value(&shimmed, "trim_extra"));
    CHECK(value(&native, "unsynced_reserved") == 0 && value(&native, "unsynced_extra") == 0,
          "natively TrimTo(0) after an unsynchronized, completed cudaFreeAsync gives it back: reserved %.0f, %.0f bytes held",
          value(&native, "unsynced_reserved"), value(&native, "unsynced_extra"));
    CHECK(value(&shimmed, "unsynced_reserved") == 0 && value(&shimmed, "unsynced_extra") == 0,
          "TrimTo(0) after an unsynchronized, completed cudaFreeAsync: reserved %.0f, %.0f bytes held",
          value(&shimmed, "unsynced_reserved"), value(&shimmed, "unsynced_extra"));
    /* The free's event, recorded only at the trim, is reached 100 us later, as on a GPU: the trim
     * still gives the memory back (it held all 24 MiB before it waited for such events). */
    static run_out late;
    run(1, "200", "100", &late);
    CHECK(late.rc == 0 && value(&late, "unsynced_reserved") == 0 && value(&late, "unsynced_extra") == 0,
          "TrimTo(0) when an event is reached 100 us after it is recorded: rc %d, reserved %.0f, %.0f bytes held", late.rc,
          value(&late, "unsynced_reserved"), value(&late, "unsynced_extra"));
    double live = value(&shimmed, "trace_live_peak"), phys = value(&shimmed, "trace_phys_peak");
    CHECK(live > 500 * MiB && live == value(&native, "trace_live_peak") && phys <= 1.10 * live,
          "varying-size trace: physical peak %.1f MiB over a live peak of %.1f MiB (%.3fx; at most 1.10x)", phys / MiB,
          live / MiB, phys / live);
    CHECK(value(&shimmed, "trace_held") > 0 && value(&shimmed, "lowered_left") <= 0,
          "threshold UINT64_MAX keeps %.0f bytes; lowered to 0, a synchronization leaves %.0f",
          value(&shimmed, "trace_held"), value(&shimmed, "lowered_left"));
    CHECK(value(&shimmed, "end_left") == 0, "at the end %.0f bytes stay", value(&shimmed, "end_left"));
    printf("stat: varying-size trace: live peak %.1f MiB, physical peak natively %.1f MiB, under the shim %.1f MiB "
           "(%.3fx); give-back %.0f ms after cudaFree (delay 200 ms)\n",
           live / MiB, value(&native, "trace_phys_peak") / MiB, phys / MiB, phys / live, ms);

    run(1, "40", "0", &quick);
    ms = value(&quick, "giveback_ms");
    CHECK(quick.rc == 0 && value(&quick, "giveback_left") == 0 && ms >= 35 && ms <= 250,
          "VMMSHIM_GIVE_BACK_MS=40: back after %.0f ms (rc %d)\n%s", ms, quick.rc, quick.err);
    run(1, "0", "0", &quick);
    ms = value(&quick, "giveback_ms");
    CHECK(quick.rc == 0 && ms >= 0 && ms < 20, "VMMSHIM_GIVE_BACK_MS=0: back after %.0f ms (at the free)", ms);
    CHECK_DONE();
}
