/* A cudaFreeAsync of shim memory captured into a graph, over the emulated driver: tests/progs/
 * graph_free runs natively and under the shim.  As natively, the memory stays held until the
 * graph is launched, and is back (release threshold 0) or reused by another stream (threshold
 * UINT64_MAX) once the launch is synchronized; a second launch frees nothing more; and when no
 * marker can be captured the block is retired, with a warning, as before. */
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

static void run(int shim, const char *arg, const char *extra, run_out *o)
{
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/graph_free", g_build);
    char *const argv[] = {prog, (char *)arg, NULL};
    const char *with_shim[] = {g_preload, extra, NULL}, *native[] = {extra, NULL};
    o->rc = spawn_capture(argv, shim ? with_shim : native, o->out, sizeof o->out, o->err, sizeof o->err, 60);
}

static double value(const run_out *o, const char *key)
{
    char pat[80];
    snprintf(pat, sizeof pat, "%s ", key);
    for (const char *p = o->out; (p = strstr(p, pat)); p++)
        if (p == o->out || p[-1] == '\n') return strtod(p + strlen(pat), NULL);
    return -1e300;
}

/* The lines a real GPU run prints too (no counters): what the program's calls returned. */
static void calls_only(const char *out, char *dst, size_t len)
{
    size_t n = 0;
    for (const char *l = out; *l;) {
        const char *e = strchr(l, '\n');
        size_t k = e ? (size_t)(e - l) + 1 : strlen(l);
        if (strstr(l, "cuda") && strstr(l, "cuda") < l + k && n + k < len) {
            memcpy(dst + n, l, k);
            n += k;
        }
        l += k;
    }
    dst[n] = 0;
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);

    static run_out native, shimmed, again, nomark;
    run(0, NULL, "VMMSHIM_GIVE_BACK_MS=200", &native);
    CHECK(native.rc == 0, "natively: rc %d\n%s%s", native.rc, native.out, native.err);
    CHECK(value(&native, "held_before_launch") == 64 * MiB && value(&native, "left_after_launch") == 0,
          "natively the captured free happens at the launch:\n%s", native.out);

    run(1, NULL, "VMMSHIM_GIVE_BACK_MS=200", &shimmed);
    CHECK(shimmed.rc == 0, "under the shim: rc %d\n%s%s", shimmed.rc, shimmed.out, shimmed.err);
    CHECK(!strstr(shimmed.err, "vmmshim:"), "the shim printed: %s", shimmed.err);
    static char a[4096], c[4096];
    calls_only(native.out, a, sizeof a);
    calls_only(shimmed.out, c, sizeof c);
    CHECK(a[0] && !strcmp(a, c), "the calls' results differ from native:\n%s---\n%s", a, c);
    CHECK(value(&shimmed, "held_before_launch") == 64 * MiB,
          "before the launch the memory must stay held (natively it does): %.0f bytes", value(&shimmed, "held_before_launch"));
    CHECK(value(&shimmed, "left_after_launch") == 0,
          "after launch + synchronize (threshold 0) %.0f bytes stay (the block was retired?)",
          value(&shimmed, "left_after_launch"));
    CHECK(value(&shimmed, "same_address") == 1, "threshold UINT64_MAX: another stream's same-size allocation after "
          "the launch did not get the freed block\n%s", shimmed.out);

    /* the give-back thread and the allocation path reap too, with no give-back delay as well */
    run(1, "relaunch", "VMMSHIM_GIVE_BACK_MS=0", &again);
    CHECK(again.rc == 0 && !strstr(again.err, "vmmshim:"), "relaunch: rc %d\n%s%s", again.rc, again.out, again.err);
    CHECK(strstr(again.out, "relaunch cudaSuccess sync cudaSuccess") != NULL, "a second launch fails:\n%s", again.out);
    CHECK(value(&again, "relaunch_held") == 64 * MiB,
          "a second launch must not free the block again: the new allocation holds %.0f bytes of 64 MiB",
          value(&again, "relaunch_held"));
    CHECK(value(&again, "end_left") == 0, "at the end %.0f bytes stay", value(&again, "end_left"));

    run(1, NULL, "FAKECUDA_FAIL=cuMemsetD32Async/libvmmshim.so:2", &nomark);
    CHECK(nomark.rc == 0, "no marker: rc %d\n%s%s", nomark.rc, nomark.out, nomark.err);
    CHECK(strstr(nomark.err, "its block is retired") != NULL, "no marker: no warning: %s", nomark.err);
    CHECK(value(&nomark, "left_after_launch") == 64 * MiB,
          "no marker: the block must stay retired (never reused while the graph may free it): %.0f bytes",
          value(&nomark, "left_after_launch"));
    CHECK_DONE();
}
