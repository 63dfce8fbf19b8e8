/* The device's default memory pool under the shim, over the emulated driver and runtime:
 * progs/mempool runs natively and with the shim preloaded, and everything the program can see of
 * pools is the same, apart from the default pool's usage figures, whose meaning is checked
 * instead (check_usage_semantics).  The driver-level wrappers are reached from the runtime API
 * (which the emulated runtime, like NVIDIA's, sends through cuGetProcAddress) and from the
 * driver API; the real call is made exactly once, first; only a device's default pool reaches
 * the shim's memory; access granted on it reaches the shim's allocations, from the right device
 * to the right owner, existing and future. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "spawn.h"

#define MiB (1ull << 20)

static char build[512], shim[600], registry[64], preload[700], tmpdir[64];

typedef struct run {
    int rc;
    char out[65536], err[262144];
    char counters[300];
} run;

/* progs/mempool MODE on `devices` emulated devices, natively or under the shim (logging at debug
 * level, so the wrappers' work shows). */
static void run_mempool(const char *mode, int under_shim, int devices, run *r)
{
    char prog[600], ndev[40], cnt[340];
    snprintf(prog, sizeof prog, "%s/progs/mempool", build);
    snprintf(r->counters, sizeof r->counters, "%s/%s-%s.counters", tmpdir, mode ? mode : "single",
             under_shim ? "shim" : "native");
    snprintf(ndev, sizeof ndev, "FAKECUDA_DEVICES=%d", devices);
    snprintf(cnt, sizeof cnt, "FAKECUDA_COUNTERS_AT_EXIT=%s", r->counters);
    char *argv[] = {prog, (char *)mode, NULL};
    const char *env_native[] = {ndev, cnt, NULL};
    const char *env_shim[] = {preload, ndev, cnt, "VMMSHIM_LOG_LEVEL=debug", NULL};
    r->rc = spawn_capture(argv, under_shim ? env_shim : env_native, r->out, sizeof r->out, r->err, sizeof r->err, 120);
}

/* One counter from a FAKECUDA_COUNTERS_AT_EXIT file; -1 when absent. */
static long long counter(const char *path, const char *name)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[128];
    size_t nl = strlen(name);
    long long v = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, name, nl) && line[nl] == '=') v = atoll(line + nl + 1);
    fclose(f);
    return v;
}

static int occurrences(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* Does `out` hold the observation line "what   value" exactly as progs/mempool prints it? */
static int has_obs(const char *out, const char *what, const char *value)
{
    char want[256];
    snprintf(want, sizeof want, "%-64s %s\n", what, value);
    return strstr(out, want) != NULL;
}

/* The lines whose numbers may differ between the runs: the default pool's figures. */
static int is_figure_line(const char *line)
{
    return !strncmp(line, "figures ", 8) || !strncmp(line, "own pool after cudaMallocAsync:", 31);
}

static void without_figures(const char *in, char *out, size_t len)
{
    size_t o = 0;
    for (const char *l = in; *l;) {
        const char *end = strchr(l, '\n');
        size_t n = end ? (size_t)(end - l + 1) : strlen(l);
        if (!is_figure_line(l) && o + n < len) {
            memcpy(out + o, l, n);
            o += n;
        }
        l += n;
    }
    out[o] = 0;
}

static void check_same_apart_from_figures(const char *what, const run *nat, const run *sh)
{
    static char a[65536], b[65536];
    without_figures(nat->out, a, sizeof a);
    without_figures(sh->out, b, sizeof b);
    CHECK(strcmp(a, b) == 0, "%s: output differs\n--- native\n%s--- shim\n%s", what, nat->out, sh->out);
}

static void check_quiet(const char *what, const run *sh)
{
    CHECK(!strstr(sh->err, "vmmshim: warning") && !strstr(sh->err, "vmmshim: error"), "%s: the shim complained:\n%s", what,
          sh->err);
}

/* The real driver saw each of the program's pool calls exactly once: real first, never twice. */
static void check_real_calls_once(const char *what, const run *nat, const run *sh)
{
    static const char *const calls[] = {"calls_cuMemPoolSetAccess", "calls_cuMemPoolGetAttribute",
                                        "calls_cuMemPoolSetAttribute", "calls_cuMemPoolTrimTo",
                                        "calls_cuDeviceSetMemPool", "calls_cuMemAllocFromPoolAsync"};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        long long n = counter(nat->counters, calls[i]), s = counter(sh->counters, calls[i]);
        CHECK(n >= 0 && n == s, "%s: %s natively %lld, under the shim %lld", what, calls[i], n, s);
    }
}

/* ---- the runtime API on one device ---- */

static run single_native, single_shim;

static void test_single(void)
{
    run *nat = &single_native, *sh = &single_shim;
    run_mempool(NULL, 0, 1, nat);
    run_mempool(NULL, 1, 1, sh);
    CHECK(nat->rc == 0 && sh->rc == 0, "exit codes native %d shim %d\n%s%s---\n%s%s", nat->rc, sh->rc, nat->out, nat->err,
          sh->out, sh->err);
    CHECK(strlen(nat->out) > 3000, "native output too short:\n%s", nat->out);
    check_same_apart_from_figures("mempool", nat, sh);
    check_quiet("mempool", sh);
    check_real_calls_once("mempool", nat, sh);
    CHECK(counter(nat->counters, "calls_cuMemPoolGetAttribute") > 30, "the program's reads did not reach the driver");
    /* what the comparison rests on, as the emulated driver answers it */
    const char *obs[][2] = {
        {"  the default pool is current", "yes"},
        {"  release threshold", "67108864"},
        {"  reuse: allow opportunistic", "0"},
        {"set reserved current (read-only)", "cudaErrorInvalidValue"},
        {"set used high 5 (only a reset to 0 is allowed)", "cudaErrorInvalidValue"},
        {"cudaMemPoolTrimTo(default, 0)", "cudaSuccess"},
        {"  own pool: release threshold", "12345"},
        {"  own pool: used", "2097152"},
        {"  the own pool is current", "yes"},
        {"  d holds what was written", "yes"},
        {"cudaMemSetMemPool(device 0, pinned, default)", "cudaSuccess"},
        {"cudaDeviceSetMemPool(0, NULL)", "cudaErrorInvalidValue"},
        {"cudaMemPoolDestroy(default)", "cudaErrorInvalidValue"},
    };
    for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++)
        CHECK(has_obs(sh->out, obs[i][0], obs[i][1]), "want '%s %s' in:\n%s", obs[i][0], obs[i][1], sh->out);

    /* The wrappers were reached through the runtime and recognised the default pool, and only it:
     * the own pool's threshold, trim and reads reach nothing, nor do calls the driver refused
     * (the used-high "reset" to 5, cudaDeviceSetMemPool(0, NULL)). */
    const char *e = sh->err;
    int n_figures = occurrences(nat->out, "\nfigures ");
    CHECK_EQ(occurrences(e, "default memory pool of device 0: release threshold 67108864 bytes set on the shim's memory"), 1);
    CHECK_EQ(occurrences(e, "release threshold"), 1);
    CHECK_EQ(occurrences(e, "default memory pool of device 0: used high-water mark reset"), 1);
    CHECK_EQ(occurrences(e, "default memory pool of device 0: reserved high-water mark reset"), 1);
    CHECK_EQ(occurrences(e, "default memory pool of device 0: trimmed to 0 bytes"), 2);
    CHECK_EQ(occurrences(e, "trimmed to"), 2);
    /* reads are logged once per figure: programs read them all the time */
    CHECK_EQ(occurrences(e, "default memory pool of device 0: reserved read"), 1);
    CHECK_EQ(occurrences(e, "default memory pool of device 0: reserved high read"), 1);
    CHECK_EQ(occurrences(e, "default memory pool of device 0: used read"), 1);
    CHECK_EQ(occurrences(e, "default memory pool of device 0: used high read"), 1);
    CHECK_EQ(occurrences(e, "device 0: a memory pool of the program's own is current"), 2);
    CHECK_EQ(occurrences(e, "device 0: the default memory pool is current"), 2);
    CHECK(n_figures == 9, "figures lines: %d\n%s", n_figures, nat->out);
}

/* ---- the meaning of the default pool's figures ---- */

typedef struct figures {
    int found;
    unsigned long long reserved, used, reserved_high, used_high;
} figures;

static figures figures_at(const char *out, const char *when)
{
    figures f = {0};
    char key[128];
    snprintf(key, sizeof key, "figures %s: ", when);
    const char *l = strstr(out, key);
    if (l && (l == out || l[-1] == '\n'))
        f.found = sscanf(l + strlen(key), "reserved %llu used %llu reserved_high %llu used_high %llu", &f.reserved, &f.used,
                         &f.reserved_high, &f.used_high) == 4;
    return f;
}

/* The default pool's figures mean what they mean natively: reserved covers the live
 * allocations, used their requested sizes, the highs never read below the currents and reset to
 * them, memory kept under the release threshold reads as reserved until trimmed away, and a
 * pool of the program's own made current takes cudaMallocAsync's allocations.  Under the shim
 * these hold only once shim/backing/mempool.c answers the usage figures and honours a pool made
 * current (stubs until the pool lands). */
static void check_usage_semantics(const char *label, const char *out, const char *native_out)
{
    const unsigned long long na = 3 * MiB, nb = 5 * MiB + 1;
    figures start = figures_at(out, "start"), live = figures_at(out, "a and b live"), b_freed = figures_at(out, "b freed"),
            reset = figures_at(out, "high-water marks reset"), a_freed = figures_at(out, "a freed"),
            trimmed = figures_at(out, "trimmed"), own = figures_at(out, "own pool allocation live"),
            again = figures_at(out, "default pool current again");
    CHECK(start.found && live.found && b_freed.found && reset.found && a_freed.found && trimmed.found && own.found && again.found,
          "%s: figures missing in:\n%s", label, out);
    CHECK(start.used == 0, "%s: used %llu before any allocation", label, start.used);
    CHECK(live.reserved >= na + nb, "%s: a and b live: reserved %llu < %llu", label, live.reserved, na + nb);
    CHECK(live.used >= na + nb, "%s: a and b live: used %llu < %llu", label, live.used, na + nb);
    CHECK(live.reserved >= live.used, "%s: a and b live: reserved %llu < used %llu", label, live.reserved, live.used);
    CHECK(live.reserved_high >= live.reserved && live.used_high >= live.used,
          "%s: a and b live: highs %llu/%llu below currents %llu/%llu", label, live.reserved_high, live.used_high,
          live.reserved, live.used);
    CHECK(b_freed.used >= na && b_freed.used < na + nb, "%s: b freed: used %llu, want [%llu, %llu)", label, b_freed.used,
          na, na + nb);
    CHECK(b_freed.used_high >= na + nb, "%s: b freed: used high %llu forgot b", label, b_freed.used_high);
    CHECK(b_freed.reserved >= b_freed.used, "%s: b freed: reserved %llu < used %llu", label, b_freed.reserved, b_freed.used);
    CHECK(reset.used_high == reset.used && reset.reserved_high == reset.reserved && reset.used >= na,
          "%s: after the resets: used %llu high %llu, reserved %llu high %llu", label, reset.used, reset.used_high,
          reset.reserved, reset.reserved_high);
    CHECK(a_freed.used == 0 && a_freed.used_high >= na, "%s: a freed: used %llu, used high %llu", label, a_freed.used,
          a_freed.used_high);
    CHECK(a_freed.reserved > 0, "%s: a freed under a 64 MiB release threshold: nothing stays reserved", label);
    CHECK(trimmed.reserved == 0 && trimmed.used == 0, "%s: trimmed to 0 with nothing live: reserved %llu used %llu", label,
          trimmed.reserved, trimmed.used);
    CHECK(own.used == 0, "%s: cudaMallocFromPoolAsync on the own pool counted in the default pool: used %llu", label,
          own.used);
    CHECK(again.used >= 2 * MiB, "%s: default pool current again: used %llu after a 2 MiB cudaMallocAsync", label,
          again.used);
    if (native_out) {
        const char *want = strstr(native_out, "own pool after cudaMallocAsync:"), *got = strstr(out, "own pool after cudaMallocAsync:");
        size_t wl = want ? strcspn(want, "\n") : 0, gl = got ? strcspn(got, "\n") : 0;
        CHECK(want && got && wl == gl && !strncmp(want, got, wl),
              "%s: cudaMallocAsync with the program's own pool current did not land in that pool:\n  native %.*s\n  shim   %.*s",
              label, (int)wl, want ? want : "", (int)gl, got ? got : "");
    }
}

static void test_usage_semantics(void)
{
    check_usage_semantics("native", single_native.out, NULL); /* the emulated driver, and the checks themselves */
    check_usage_semantics("under the shim", single_shim.out, single_native.out);
}

/* ---- peer access on two devices ---- */

static void test_peer(void)
{
    static run nat, sh;
    run_mempool("peer", 0, 2, &nat);
    run_mempool("peer", 1, 2, &sh);
    CHECK(nat.rc == 0 && sh.rc == 0, "exit codes native %d shim %d\n%s%s---\n%s%s", nat.rc, sh.rc, nat.out, nat.err, sh.out,
          sh.err);
    CHECK(strcmp(nat.out, sh.out) == 0, "peer: output differs\n--- native\n%s--- shim\n%s", nat.out, sh.out);
    check_quiet("peer", &sh);
    check_real_calls_once("peer", &nat, &sh);
    /* the observations, in order: the own pool's grant leaves the default pool's memory alone;
     * the default pool's grant reaches a (existing) and b (made after) for device 1 only, not
     * device 1's own c for device 0; the owner's access cannot be revoked; revoking, and
     * device 1's pool granting device 0, reach the right memory */
    const char *seq[][2] = {
        {"  a: device 1 access", "NONE"},
        {"own pool: grant device 1 read-write", "cudaSuccess"},
        {"  a: device 1 access", "NONE"},
        {"default pool 0: grant device 1 read-write", "cudaSuccess"},
        {"  a: device 1 access", "READWRITE"},
        {"  a: device 0 access", "READWRITE"},
        {"  b: device 1 access", "READWRITE"},
        {"  c: device 0 access", "NONE"},
        {"default pool 0: revoke device 0's own access", "cudaErrorInvalidValue"},
        {"  a: device 0 access", "READWRITE"},
        {"default pool 0: revoke device 1", "cudaSuccess"},
        {"  a: device 1 access", "NONE"},
        {"  b: device 1 access", "NONE"},
        {"  a: device 0 access", "READWRITE"},
        {"default pool 1: grant device 0 read-write", "cudaSuccess"},
        {"  c: device 0 access", "READWRITE"},
        {"  a: device 1 access", "NONE"},
        {"default pool 1: revoke device 0", "cudaSuccess"},
        {"  c: device 0 access", "NONE"},
    };
    const char *p = sh.out;
    size_t i = 0;
    for (; i < sizeof seq / sizeof seq[0]; i++) {
        char want[256];
        snprintf(want, sizeof want, "%-64s %s\n", seq[i][0], seq[i][1]);
        const char *at = strstr(p, want);
        if (!at) break;
        p = at + strlen(want);
    }
    CHECK(i == sizeof seq / sizeof seq[0], "peer: observation %zu ('%s %s') missing or out of order:\n%s", i,
          i < sizeof seq / sizeof seq[0] ? seq[i][0] : "", i < sizeof seq / sizeof seq[0] ? seq[i][1] : "", sh.out);
    /* vmm__peer_access(accessor, owner): once per successful grant or revoke on a default pool */
    CHECK_EQ(occurrences(sh.err, "default memory pool of device 0: access of device 1 granted"), 1);
    CHECK_EQ(occurrences(sh.err, "default memory pool of device 0: access of device 1 revoked"), 1);
    CHECK_EQ(occurrences(sh.err, "default memory pool of device 1: access of device 0 granted"), 1);
    CHECK_EQ(occurrences(sh.err, "default memory pool of device 1: access of device 0 revoked"), 1);
    CHECK_EQ(occurrences(sh.err, "access of device"), 4);
}

/* ---- the driver API, linked directly ---- */

static void test_driver_api(void)
{
    static run nat, sh;
    run_mempool("driver", 0, 2, &nat);
    run_mempool("driver", 1, 2, &sh);
    CHECK(nat.rc == 0 && sh.rc == 0, "exit codes native %d shim %d\n%s%s---\n%s%s", nat.rc, sh.rc, nat.out, nat.err, sh.out,
          sh.err);
    check_same_apart_from_figures("mempool driver", &nat, &sh);
    check_quiet("mempool driver", &sh);
    check_real_calls_once("mempool driver", &nat, &sh);
    const char *obs[][2] = {
        {"  a: device 1 access", "READWRITE"},
        {"  release threshold", "33554432"},
        {"  the own pool is current", "yes"},
        {"  the default pool is current", "yes"},
        {"cuDeviceSetMemPool(1, own pool of device 0)", "CUDA_ERROR_INVALID_VALUE"},
    };
    for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++)
        CHECK(has_obs(sh.out, obs[i][0], obs[i][1]), "want '%s %s' in:\n%s", obs[i][0], obs[i][1], sh.out);
    const char *want[] = {"default memory pool of device 0: access of device 1 granted",
                          "default memory pool of device 0: release threshold 33554432 bytes set",
                          "default memory pool of device 0: used high-water mark reset",
                          "default memory pool of device 0: used read",
                          "default memory pool of device 0: trimmed to 0 bytes",
                          "default memory pool of device 0: access of device 1 revoked",
                          "device 0: a memory pool of the program's own is current",
                          "device 0: the default memory pool is current"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        CHECK_EQ(occurrences(sh.err, want[i]), 1);
    CHECK(!strstr(sh.err, "device 1: "), "the refused cuDeviceSetMemPool(1, ...) reached the shim:\n%s", sh.err);
}

/* ---- which route the runtime takes ---- */

/* The dynamic symbols of a library, as nm lists them, one name per line. */
static void dynamic_symbols(const char *lib, const char *which, char *out, size_t len)
{
    char cmd[900];
    snprintf(cmd, sizeof cmd, "nm -D %s '%s' 2>/dev/null | awk '{print $NF}'", which, lib);
    FILE *f = popen(cmd, "r");
    size_t n = f ? fread(out, 1, len - 1, f) : 0;
    out[n] = 0;
    if (f) pclose(f);
}

static int lists(const char *syms, const char *name)
{
    size_t nl = strlen(name);
    for (const char *p = syms; (p = strstr(p, name)); p += nl)
        if ((p == syms || p[-1] == '\n') && (p[nl] == '\n' || p[nl] == '@' || !p[nl])) return 1;
    return 0;
}

/* NVIDIA's runtime (shared and static) imports no driver symbol and finds each entry point with
 * cuGetProcAddress; the emulated one does the same for the pool functions.  So the runtime can
 * only have reached the wrappers, as test_single and test_peer saw it do, through the shim's
 * resolvers: and the shim has no cudaMemPool* hook of its own to have done it instead. */
static void test_runtime_route(void)
{
    static char rt_undef[65536], rt_def[65536], shim_def[65536];
    char rt[600];
    snprintf(rt, sizeof rt, "%s/fakecuda/libcudart.so.13", build);
    dynamic_symbols(rt, "--undefined-only", rt_undef, sizeof rt_undef);
    dynamic_symbols(rt, "--defined-only", rt_def, sizeof rt_def);
    dynamic_symbols(shim, "--defined-only", shim_def, sizeof shim_def);
    CHECK(lists(rt_undef, "cuMemAllocAsync") && lists(rt_def, "cudaMemPoolSetAccess") && lists(shim_def, "cudaMallocAsync"),
          "nm gave no usable listing:\n%s\n---\n%s", rt_undef, shim_def);
    const char *wrapped[] = {"cuMemPoolSetAccess", "cuMemPoolGetAttribute", "cuMemPoolSetAttribute",
                             "cuMemPoolTrimTo",    "cuDeviceSetMemPool",    "cuMemSetMemPool"};
    for (size_t i = 0; i < sizeof wrapped / sizeof wrapped[0]; i++) {
        CHECK(!lists(rt_undef, wrapped[i]), "the emulated runtime links %s instead of resolving it", wrapped[i]);
        CHECK(lists(shim_def, wrapped[i]), "the shim does not export %s (driver-API programs link it)", wrapped[i]);
    }
    const char *runtime[] = {"cudaMemPoolSetAccess", "cudaMemPoolGetAttribute", "cudaMemPoolSetAttribute",
                             "cudaMemPoolTrimTo",    "cudaDeviceSetMemPool",    "cudaMemSetMemPool"};
    for (size_t i = 0; i < sizeof runtime / sizeof runtime[0]; i++)
        CHECK(!lists(shim_def, runtime[i]), "the shim hooks %s: the runtime route is then unproven", runtime[i]);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(build, sizeof build, "%s", b ? b : "build");
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", build);
    spawn_preload(preload, sizeof preload, shim);
    snprintf(registry, sizeof registry, "/vmmshim-tmempool-%d", (int)getpid());
    setenv("VMMSHIM_REGISTRY", registry, 1);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/vmmshim-tmempool-XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_single();
    test_usage_semantics();
    test_peer();
    test_driver_api();
    test_runtime_route();
    shm_unlink(registry);
    const char *modes[] = {"single", "peer", "driver"};
    for (size_t i = 0; i < 3; i++)
        for (int s = 0; s < 2; s++) {
            char path[400];
            snprintf(path, sizeof path, "%s/%s-%s.counters", tmpdir, modes[i], s ? "shim" : "native");
            unlink(path);
        }
    rmdir(tmpdir);
    CHECK_DONE();
}
