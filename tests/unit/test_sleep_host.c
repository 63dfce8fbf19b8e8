/* The host side of a kept pause (shim/backing/sleep_copy.c), over the emulated driver: pinned
 * buffers kept from one pause to the next, and the queued copies.
 *
 * The owner is tests/progs/spans under the shim with FAKECUDA_ASYNC_DEFER=1, so a queued copy
 * moves its bytes only at a synchronization: a pause that released memory before waiting for its
 * copies, or a resume that woke an arena (or let go of a buffer) first, reads wrong bytes or
 * faults, and the bytes checked after each cycle differ.  Counted through the emulated driver's
 * calls (spans' `m`): the first kept pause pins one buffer per allocation of 1 MiB or more and
 * queues one copy out each; the resume queues one copy back each and frees none; the next pauses
 * of the same memory pin nothing; a discarding pause and a pause into a file leave the buffers as
 * they are; a free after the resume and a free while paused each free the allocation's buffer,
 * so at the end no host allocation is left.  VMMSHIM_PAUSE_HOST_CACHE caps the buffers kept (the
 * rest are freed at the resume and pinned anew at the next pause; 0 keeps none), a pause whose
 * copy fails releases nothing and leaks no buffer, and a bad value of the setting is one line.
 * Pinned buffers are the shim's own mappings page-locked (cuMemHostRegister), cuMemHostAlloc'd
 * where the driver refuses that; marks let a pause release what is copied while the rest moves. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define TAG "hostcache"

static char defer_env[] = "FAKECUDA_ASYNC_DEFER=1";

static void spans_stop(void)
{
    int wst = spans_quit();
    CHECK(wst == 0, "the owner exited with 0x%x", wst);
}

/* An owner with these settings ("NAME=value", NULL-ended) besides the deferred copies; stderr,
 * when given, becomes the file's. */
static bool owner_with(char *const *env, const char *stderr_path)
{
    char *all[8] = {defer_env};
    for (int i = 1; env && *env && i < 7; env++) all[i++] = *env;
    return spans_start_env(all, stderr_path);
}

/* An owner with these settings besides the deferred copies, its stderr to a fresh file made from the
 * mkstemp template path. */
static bool owner_with_log(char *const *env, char *path)
{
    char *all[8] = {defer_env};
    for (int i = 1; env && *env && i < 7; env++) all[i++] = *env;
    return owner_logging(all, path);
}

/* Every cycle: new contents, a kept pause, a resume, the contents checked word by word. */
static void test_cycles(void)
{
    CHECK(owner_with(NULL, NULL), "cannot start the owner");
    owner_mem_t base = owner_mem();
    uint64_t x_addr, y_addr, z_addr;
    int x = alloc_filled('a', 24 * MIB, 11, &x_addr), y = alloc_filled('A', 4 * MIB, 12, &y_addr),
        z = alloc_filled('a', 64 * 1024, 13, &z_addr);
    CHECK(x >= 0 && y >= 0 && z >= 0, "the owner could not allocate");

    /* 1. the first kept pause pins the two large copies and queues them; the resume frees nothing */
    owner_mem_t m0 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t m1 = owner_mem();
    CHECK(p.ok && p.kept == 28 * MIB + 64 * 1024 && m1.phys == 0, "pause: %s (live %llu)", p.line, m1.phys);
    CHECK_EQ(m1.host_made - m0.host_made, 2);
    CHECK_EQ(m1.registered - m0.registered, 2); /* the program's own mapping, page-locked */
    CHECK_EQ(m1.host - m0.host, 2);
    CHECK_EQ(m1.dtoh_async - m0.dtoh_async, 2);
    p = sleep_cmd("R");
    owner_mem_t m2 = owner_mem();
    CHECK(p.ok && p.kept == 28 * MIB + 64 * 1024, "resume: %s", p.line);
    CHECK_EQ(m2.htod_async - m1.htod_async, 2);
    CHECK_EQ(m2.host_freed - m1.host_freed, 0);
    CHECK_EQ(m2.host - m0.host, 2); /* the two pinned buffers stay for the next pause */
    CHECK(verify(x, 11) && verify(y, 12) && verify(z, 13), "bytes differ after the first cycle");

    /* 2. the next cycles pin nothing and free nothing, and every byte comes back */
    for (uint64_t cycle = 2; cycle <= 5; cycle++) {
        uint64_t sx = 100 * cycle + 1, sy = 100 * cycle + 2, sz = 100 * cycle + 3;
        CHECK(owner_cmd(NULL, "w %d %llu", x, (unsigned long long)sx) && owner_cmd(NULL, "w %d %llu", y, (unsigned long long)sy) &&
                  owner_cmd(NULL, "w %d %llu", z, (unsigned long long)sz),
              "writing before cycle %llu", (unsigned long long)cycle);
        owner_mem_t a = owner_mem();
        p = sleep_cmd("P 0");
        owner_mem_t b = owner_mem();
        CHECK(p.ok && b.phys == 0, "pause %llu: %s (live %llu)", (unsigned long long)cycle, p.line, b.phys);
        CHECK(b.host_made == a.host_made, "pause %llu pinned %llu buffers anew", (unsigned long long)cycle, b.host_made - a.host_made);
        CHECK_EQ(b.dtoh_async - a.dtoh_async, 2);
        p = sleep_cmd("R");
        owner_mem_t c = owner_mem();
        CHECK(p.ok, "resume %llu: %s", (unsigned long long)cycle, p.line);
        CHECK(c.host_freed == a.host_freed && c.host == a.host, "cycle %llu: freed %llu, live %llu -> %llu",
              (unsigned long long)cycle, c.host_freed - a.host_freed, a.host, c.host);
        CHECK(verify(x, sx) && verify(y, sy) && verify(z, sz), "bytes differ after cycle %llu", (unsigned long long)cycle);
    }

    /* 3. a discarding pause and a pause into a file leave the kept buffers as they are */
    owner_mem_t d0 = owner_mem();
    p = sleep_cmd("P 1");
    CHECK(p.ok && p.kept == 0, "a discarding pause: %s", p.line);
    p = sleep_cmd("R");
    owner_mem_t d1 = owner_mem();
    CHECK(p.ok && d1.host_made == d0.host_made && d1.host_freed == d0.host_freed, "discard: %s (made %llu, freed %llu)", p.line,
          d1.host_made - d0.host_made, d1.host_freed - d0.host_freed);
    CHECK(owner_cmd(NULL, "w %d 601", x) && owner_cmd(NULL, "w %d 602", y) && owner_cmd(NULL, "w %d 603", z), "writing");
    p = sleep_cmd("P 2");
    CHECK(p.ok && p.kept == 28 * MIB + 64 * 1024, "a pause into a file: %s", p.line);
    p = sleep_cmd("R");
    owner_mem_t d2 = owner_mem();
    CHECK(p.ok && verify(x, 601) && verify(y, 602) && verify(z, 603), "bytes after the file: %s", p.line);
    CHECK(d2.host == d1.host, "after the file %llu host allocations, before %llu (the stage goes, the buffers stay)", d2.host,
          d1.host);
    /* and the next kept pause still copies into them */
    owner_mem_t e0 = owner_mem();
    p = sleep_cmd("P 0");
    owner_mem_t e1 = owner_mem();
    CHECK(p.ok && e1.host_made == e0.host_made, "the pause after a file pinned %llu anew: %s", e1.host_made - e0.host_made, p.line);
    p = sleep_cmd("R");
    CHECK(p.ok && verify(x, 601) && verify(y, 602), "bytes: %s", p.line);

    /* 4. a free after the resume frees the allocation's buffer */
    owner_mem_t f0 = owner_mem();
    CHECK(owner_cmd(NULL, "f %d", y), "free");
    owner_mem_t f1 = owner_mem();
    CHECK(f1.host_freed - f0.host_freed == 1 && f1.host == f0.host - 1, "a free after the resume: freed %llu, live %llu -> %llu",
          f1.host_freed - f0.host_freed, f0.host, f1.host);

    /* 5. a free while paused frees the buffer holding its contents */
    p = sleep_cmd("P 0");
    owner_mem_t g0 = owner_mem();
    CHECK(p.ok && g0.host_made == f1.host_made, "pause: %s", p.line);
    CHECK(owner_cmd(NULL, "f %d", x), "free while paused");
    owner_mem_t g1 = owner_mem();
    CHECK(g1.host_freed - g0.host_freed == 1 && g1.host == g0.host - 1, "a free while paused: freed %llu, live %llu -> %llu",
          g1.host_freed - g0.host_freed, g0.host, g1.host);
    p = sleep_cmd("R");
    CHECK(p.ok && verify(z, 603), "resume: %s", p.line);
    owner_mem_t g2 = owner_mem();
    CHECK(g2.host == base.host, "%llu host allocations left, %llu before any pause", g2.host, base.host);
    CHECK(owner_cmd(NULL, "f %d", z), "free");
    spans_stop();
}

/* VMMSHIM_PAUSE_HOST_CACHE: the buffers kept fit it; those beyond it are freed at the resume and
 * pinned anew at the next pause.  0: none kept. */
static void test_cap(const char *setting, int kept_after)
{
    char env[64];
    snprintf(env, sizeof env, "VMMSHIM_PAUSE_HOST_CACHE=%s", setting);
    char *envs[] = {env, NULL};
    CHECK(owner_with(envs, NULL), "cannot start the owner");
    owner_mem_t base = owner_mem();
    uint64_t addr[3];
    int buf[3];
    for (int i = 0; i < 3; i++) buf[i] = alloc_filled('a', 4 * MIB, 20 + (uint64_t)i, &addr[i]);
    CHECK(buf[0] >= 0 && buf[1] >= 0 && buf[2] >= 0, "allocations");
    for (int cycle = 1; cycle <= 3; cycle++) {
        owner_mem_t a = owner_mem();
        sleep_ans p = sleep_cmd("P 0");
        owner_mem_t b = owner_mem();
        int want_made = cycle == 1 ? 3 : 3 - kept_after;
        CHECK(p.ok && b.host_made - a.host_made == (unsigned long long)want_made, "%s, pause %d: %s; pinned %llu, want %d",
              setting, cycle, p.line, b.host_made - a.host_made, want_made);
        p = sleep_cmd("R");
        owner_mem_t c = owner_mem();
        CHECK(p.ok && c.host_freed - b.host_freed == (unsigned long long)(3 - kept_after) &&
                  c.host - base.host == (unsigned long long)kept_after,
              "%s, resume %d: %s; freed %llu, %llu kept, want %d", setting, cycle, p.line, c.host_freed - b.host_freed,
              c.host - base.host, kept_after);
        for (int i = 0; i < 3; i++) CHECK(verify(buf[i], 20 + (uint64_t)i), "%s: bytes of %d after cycle %d", setting, i, cycle);
    }
    for (int i = 0; i < 3; i++) CHECK(owner_cmd(NULL, "f %d", buf[i]), "free");
    CHECK_EQ(owner_mem().host, base.host);
    spans_stop();
}

/* The second queued copy out fails: the pause releases nothing, the bytes stay, the two buffers it
 * pinned ahead stay idle (as after a resume) and the next pause copies into them, pinning none;
 * nothing is left once the allocations go. */
static void test_failed_copy(void)
{
    char fail[] = "FAKECUDA_FAIL=cuMemcpyDtoHAsync/libvmmshim.so@2:1";
    char *envs[] = {fail, NULL};
    CHECK(owner_with(envs, NULL), "cannot start the owner");
    owner_mem_t base = owner_mem();
    uint64_t ua, va;
    int u = alloc_filled('a', 2 * MIB, 31, &ua), v = alloc_filled('a', 2 * MIB, 32, &va);
    CHECK(u >= 0 && v >= 0, "allocations");
    owner_mem_t a = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t b = owner_mem();
    CHECK(!p.ok && p.status == VMM_ERR_IO && strstr(p.line, "out failed"), "a pause whose copy fails: %s", p.line);
    CHECK(b.phys == a.phys, "a failed pause released memory: live %llu -> %llu", a.phys, b.phys);
    CHECK(b.host - base.host == 2, "%llu host allocations after a failed pause", b.host - base.host);
    CHECK(verify(u, 31) && verify(v, 32), "bytes after a failed pause");
    p = sleep_cmd("P 0");
    owner_mem_t c = owner_mem();
    CHECK(p.ok && c.phys == 0, "the pause after: %s", p.line);
    CHECK(c.host_made == b.host_made, "the pause after pinned %llu buffers anew", c.host_made - b.host_made);
    p = sleep_cmd("R");
    CHECK(p.ok && verify(u, 31) && verify(v, 32), "resume: %s", p.line);
    CHECK(owner_cmd(NULL, "f %d", u) && owner_cmd(NULL, "f %d", v), "free");
    CHECK_EQ(owner_mem().host, base.host);
    spans_stop();
}

/* A pause of more than a mark's worth of copies (128 MiB) over several allocations: the segments
 * whose copies a mark covers go while the later copies are still queued (held back here until a
 * synchronization, so a segment released before its copy makes the owner fault or read wrong
 * bytes); marks were taken, and every byte comes back. */
static void test_marks(void)
{
    CHECK(owner_with(NULL, NULL), "cannot start the owner");
    int idx[5];
    uint64_t addr;
    for (int i = 0; i < 5; i++) idx[i] = alloc_filled('a', 48 * MIB, 70 + (uint64_t)i, &addr);
    CHECK(idx[0] >= 0 && idx[4] >= 0, "the owner could not allocate");
    owner_mem_t a = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t b = owner_mem();
    CHECK(p.ok && p.kept == 5 * 48 * MIB && b.phys == 0, "pause: %s (live %llu)", p.line, b.phys);
    CHECK(b.event_records > a.event_records, "no mark taken: %llu events recorded", b.event_records - a.event_records);
    p = sleep_cmd("R");
    CHECK(p.ok, "resume: %s", p.line);
    int same = 1;
    for (int i = 0; i < 5; i++) same &= verify(idx[i], 70 + (uint64_t)i);
    CHECK(same, "bytes differ after a pause released segments under its marks");
    for (int i = 0; i < 5; i++) owner_cmd(NULL, "f %d", idx[i]);
    spans_stop();
}

/* The driver refuses to page-lock the shim's own mapping: the buffers come from cuMemHostAlloc,
 * the cycle keeps every byte, and a free gives each back the way it was made. */
static void test_register_refused(void)
{
    char fail[] = "FAKECUDA_FAIL=cuMemHostRegister/libvmmshim.so@1:1000";
    char *envs[] = {fail, NULL};
    CHECK(owner_with(envs, NULL), "cannot start the owner");
    owner_mem_t base = owner_mem();
    uint64_t ua, va;
    int u = alloc_filled('a', 3 * MIB, 61, &ua), v = alloc_filled('a', 2 * MIB, 62, &va);
    owner_mem_t a = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t b = owner_mem();
    CHECK(u >= 0 && v >= 0 && p.ok && b.phys == 0, "pause: %s", p.line);
    CHECK(b.registered == a.registered && b.host_made - a.host_made == 2, "buffers made: %llu registered, %llu in all",
          b.registered - a.registered, b.host_made - a.host_made);
    p = sleep_cmd("R");
    CHECK(p.ok && verify(u, 61) && verify(v, 62), "resume: %s", p.line);
    CHECK(owner_cmd(NULL, "f %d", u) && owner_cmd(NULL, "f %d", v), "free");
    owner_mem_t c = owner_mem();
    CHECK(c.host == base.host && c.host_freed - b.host_freed == 2, "after the frees: %llu host buffers live (%llu before), %llu freed",
          c.host, base.host, c.host_freed - b.host_freed);
    spans_stop();
}

/* A bad value: one warning line naming it, and the default in force (the buffers kept). */
static void test_bad_value(void)
{
    char bad[] = "VMMSHIM_PAUSE_HOST_CACHE=12Q", path[] = "/tmp/vmmshim-sleephost-XXXXXX";
    char *envs[] = {bad, NULL};
    CHECK(owner_with_log(envs, path), "cannot start the owner");
    owner_mem_t base = owner_mem();
    uint64_t addr;
    int x = alloc_filled('a', 2 * MIB, 41, &addr);
    sleep_ans p = sleep_cmd("P 0"), r = sleep_cmd("R");
    CHECK(x >= 0 && p.ok && r.ok && verify(x, 41), "a cycle: %s / %s", p.line, r.line);
    CHECK_EQ(owner_mem().host - base.host, 1); /* the default (64G) keeps it */
    spans_stop();
    char text[2048];
    owner_log_read(path, text, sizeof text);
    int lines = 0;
    for (char *c = text; *c; c++) lines += *c == '\n';
    CHECK(lines == 1 && !strncmp(text, "vmmshim: warning: VMMSHIM_PAUSE_HOST_CACHE='12Q' is not a size", 62) &&
              strstr(text, "using default 64G"),
          "the owner's stderr: %s", text);
}

/* VMMSHIM_LOG_LEVEL=info: a pause ends with one line saying where its time went (the device
 * wait, the copies, the releases), so a pause under the link's bandwidth can be taken apart. */
static void test_phases(void)
{
    char info[] = "VMMSHIM_LOG_LEVEL=info", path[] = "/tmp/vmmshim-sleephost-XXXXXX";
    char *envs[] = {info, NULL};
    CHECK(owner_with_log(envs, path), "cannot start the owner");
    uint64_t addr;
    int x = alloc_filled('a', 24 * MIB, 51, &addr);
    sleep_ans p = sleep_cmd("P 0"), r = sleep_cmd("R"), d = sleep_cmd("P 1"), r2 = sleep_cmd("R");
    CHECK(x >= 0 && p.ok && r.ok && d.ok && r2.ok, "two cycles: %s / %s / %s / %s", p.line, r.line, d.line, r2.line);
    spans_stop();
    char text[8192];
    owner_log_read(path, text, sizeof text);
    int lines = 0;
    double total = -1, dev = -1, copies = -1, rel = -1;
    unsigned long long released = 0, kept = 1;
    for (char *l = text; (l = strstr(l, "vmmshim: info: pause of everything: ")); l++, lines++)
        if (lines == 0 && sscanf(l, "vmmshim: info: pause of everything: %llu bytes released, %llu kept in %lf ms (waiting for "
                                 "the device %lf ms, copies %lf ms, releases %lf ms",
                                 &released, &kept, &total, &dev, &copies, &rel) != 6)
            total = -2;
    CHECK(lines == 2, "one line a pause (kept, then discarded): %d in %s", lines, text);
    CHECK(released >= 24 * MIB && kept == 24 * MIB, "the kept pause's line: %llu released, %llu kept (%s)", released, kept, text);
    CHECK(total >= 0 && dev >= 0 && copies >= 0 && rel >= 0 && dev + copies + rel <= total + 0.05,
          "its phases fit in its time: %.3f >= %.3f + %.3f + %.3f ms", total, dev, copies, rel);
}

/* A first kept pause pins every buffer it needs before its copies, on several threads at once
 * (each cuMemHostRegister made to take 100 ms: they overlap), and copies into them: a later pause
 * pins nothing. */
static void test_pin_ahead(void)
{
    char delay[] = "FAKECUDA_HOST_REGISTER_DELAY_US=100000";
    char *envs[] = {delay, NULL};
    CHECK(owner_with(envs, NULL), "cannot start the owner");
    uint64_t addr;
    int buf[4];
    for (int i = 0; i < 4; i++) buf[i] = alloc_filled('a', (2 + (uint64_t)i) * MIB, 60 + (uint64_t)i, &addr);
    CHECK(buf[0] >= 0 && buf[3] >= 0, "allocations");
    owner_mem_t a = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t b = owner_mem();
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    CHECK(p.ok && b.host_made - a.host_made == 4, "first pause: %s; pinned %llu", p.line, b.host_made - a.host_made);
    CHECK(b.register_peak >= (cpus >= 2 ? 2u : 1u), "%llu registers in flight at most, with %ld CPUs", b.register_peak, cpus);
    p = sleep_cmd("R");
    CHECK(p.ok, "resume: %s", p.line);
    for (int i = 0; i < 4; i++) CHECK(verify(buf[i], 60 + (uint64_t)i), "bytes of %d", i);
    owner_mem_t c = owner_mem();
    p = sleep_cmd("P 0");
    CHECK(p.ok && owner_mem().host_made == c.host_made, "a later pause pins nothing: %s", p.line);
    p = sleep_cmd("R");
    for (int i = 0; i < 4; i++) CHECK(verify(buf[i], 60 + (uint64_t)i) && owner_cmd(NULL, "f %d", buf[i]), "bytes of %d", i);
    spans_stop();
}

/* vmm_pause_prepare pins ahead what a first pause would (allocations of 1 MiB or more, not the
 * small one), while the program goes on allocating; the pause after it pins nothing, and a second
 * prepare finds nothing to do.  A tag selects its memory only. */
static void test_prepare(void)
{
    CHECK(owner_with(NULL, NULL), "cannot start the owner");
    uint64_t addr;
    int x = alloc_filled('a', 3 * MIB, 91, &addr), y = alloc_filled('a', 4096, 92, &addr);
    CHECK(owner_cmd(NULL, "g kv"), "tag");
    int z = alloc_filled('a', 2 * MIB, 93, &addr);
    CHECK(owner_cmd(NULL, "g"), "untag");
    CHECK(x >= 0 && y >= 0 && z >= 0, "allocations");
    owner_mem_t a = owner_mem();
    char line[256];
    unsigned long long ready = 0;
    CHECK(owner_cmd(line, "Q kv") && sscanf(line, "ok %llu", &ready) == 1 && ready == 2 * MIB, "prepare kv: %s", line);
    CHECK(owner_cmd(line, "Q") && sscanf(line, "ok %llu", &ready) == 1 && ready == 3 * MIB, "prepare the rest: %s", line);
    owner_mem_t b = owner_mem();
    CHECK_EQ(b.host_made - a.host_made, 2);
    CHECK(owner_cmd(line, "Q") && sscanf(line, "ok %llu", &ready) == 1 && ready == 0, "a second prepare: %s", line);
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t c = owner_mem();
    CHECK(p.ok && c.host_made == b.host_made, "the pause after pinned %llu anew: %s", c.host_made - b.host_made, p.line);
    p = sleep_cmd("R");
    CHECK(p.ok && verify(x, 91) && verify(y, 92) && verify(z, 93), "resume: %s", p.line);
    for (int i = 0; i < 3; i++) CHECK(owner_cmd(NULL, "f %d", i == 0 ? x : i == 1 ? y : z), "free");
    spans_stop();
}

int main(void)
{
    spans_setup("sleephost");
    setenv("VMMSHIM_TAG", TAG, 1);
    test_cycles();
    test_cap("10M", 2);
    test_cap("0", 0);
    test_failed_copy();
    test_marks();
    test_register_refused();
    test_bad_value();
    test_phases();
    test_pin_ahead();
    test_prepare();
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", g_reg);
    unlink(path);
    CHECK_DONE();
}
