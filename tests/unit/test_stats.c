/* What a user sees of a process under the shim, over the emulated driver: its coverage counters
 * (allocations made, backed, passed through by reason, adopted ranges, peak) in `vmmctl ps`, its
 * --json and the client library, and VMMSHIM_STATS's line at exit, with the shim working, on a
 * device without VMM, and disabled; call sites named in `vmmctl show` (VMMSHIM_FRAMES) from the
 * owner's frames file, after it died too, and from /proc while it lives, the file gone with the
 * owner's exit or with gc; the registry named without its leading '/'; a registry too small for
 * the allocations: one line said, the rest counted unpublished. */
#include <errno.h>
#include <stdbool.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "registry/layout.h"
#include "spawn.h"
#include "vmmshim.h"

static char build[512], shim[600], preload[700], registry[64], reg_env[96];

/* A program under the shim that talks on stdin/stdout; its stderr goes to a file read at the end. */
typedef struct child {
    pid_t pid;
    FILE *in, *out, *err;
} child;

static int child_start(child *c, char *const argv[], const char *const env[])
{
    int pi[2], po[2];
    memset(c, 0, sizeof *c);
    c->err = tmpfile();
    if (!c->err || pipe(pi) || pipe(po)) return -1;
    fflush(stdout);
    c->pid = fork();
    if (c->pid == 0) {
        dup2(pi[0], 0);
        dup2(po[1], 1);
        dup2(fileno(c->err), 2);
        close(pi[1]);
        close(po[0]);
        putenv(preload);
        putenv(reg_env);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        alarm(120);
        execv(argv[0], argv);
        _exit(127);
    }
    close(pi[0]);
    close(po[1]);
    c->in = fdopen(pi[1], "w");
    c->out = fdopen(po[0], "r");
    return c->pid > 0 && c->in && c->out ? 0 : -1;
}

/* The next line of the child's stdout that starts with `prefix`; "" at its end. */
static const char *child_line(child *c, const char *prefix, char *buf, size_t len)
{
    while (fgets(buf, (int)len, c->out))
        if (!strncmp(buf, prefix, strlen(prefix))) return buf;
    buf[0] = 0;
    return buf;
}

static void child_say(child *c, const char *line)
{
    fprintf(c->in, "%s\n", line);
    fflush(c->in);
}

/* Waits for the child; its stderr into err.  Returns its exit status (128 + signal). */
static int child_end(child *c, char *err, size_t errlen)
{
    fclose(c->in);
    fclose(c->out);
    int st = 0;
    waitpid(c->pid, &st, 0);
    rewind(c->err);
    size_t n = fread(err, 1, errlen - 1, c->err);
    err[n] = 0;
    fclose(c->err);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static char owner[600]; /* tests/progs/owner: allocates the sizes it is given, then waits for commands */

/* VMMSHIM_REGISTRY=name (no leading '/') is the registry /name, without a warning. */
static void test_registry_name(void)
{
    char line[256], err[4096], bare[96];
    char *argv[] = {owner, "1", NULL};
    snprintf(bare, sizeof bare, "VMMSHIM_REGISTRY=%s", registry + 1);
    const char *env[] = {bare, NULL};
    child c;
    int started = child_start(&c, argv, env) == 0;
    CHECK(started, "owner did not start");
    if (!started) return;
    unsigned long long addr = 0;
    int pid = 0;
    CHECK(sscanf(child_line(&c, "ready", line, sizeof line), "ready %d %llx", &pid, &addr) == 2, "owner: %s", line);
    vmm_registry *reg = NULL;
    vmm_alloc_info a;
    CHECK(vmm_open(registry, &reg) == VMM_OK && vmm_find(reg, (uint32_t)pid, addr, &a) == VMM_OK &&
              (a.handle_kinds & VMM_KIND_BROKER),
          "not published in %s: %s", registry, vmm_last_error());
    if (reg) vmm_close(reg);
    child_say(&c, "quit");
    CHECK(child_end(&c, err, sizeof err) == 0 && !strstr(err, "vmmshim"), "owner under VMMSHIM_REGISTRY=%s: %s",
          registry + 1, err);
}

static char vmmctl[600];

static int ctl(char *out, size_t outlen, const char *a1, const char *a2)
{
    char err[4096];
    char *argv[] = {vmmctl, "--registry", registry, (char *)a1, (char *)a2, NULL};
    return spawn_capture(argv, NULL, out, outlen, err, sizeof err, 60);
}

/* The line of s holding needle, or "". */
static const char *line_with(const char *s, const char *needle, char *buf, size_t len)
{
    const char *p = strstr(s, needle);
    buf[0] = 0;
    if (!p) return buf;
    while (p > s && p[-1] != '\n') p--;
    const char *eol = strchr(p, '\n');
    snprintf(buf, len, "%.*s", (int)(eol ? eol - p : (long)strlen(p)), p);
    return buf;
}

/* Starts the owner with its buffers, waits for all of them; its pid, or 0. */
static int owner_up(child *c, const char *const env[], char *const argv[])
{
    char line[256];
    int n = 0, want = 0, pid = 0;
    for (int i = 1; argv[i]; i++) want++;
    if (child_start(c, argv, env) != 0) return 0;
    while (n < want && sscanf(child_line(c, "ready", line, sizeof line), "ready %d", &pid) == 1) n++;
    return n == want ? pid : 0;
}

static int count_of(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* Two 1 MiB allocations fill one 2 MiB chunk; one is made while its stream is captured; with 5 MiB
 * on the device a half MiB more needs a new chunk, which does not fit, while the real allocator
 * still has room for it: 4 made, 2 backed, 1 captured, 1 to a full device; 3.5 MiB at the peak. */
static void test_coverage(void)
{
    char out[16384], line[1024], err[8192], pidtxt[16];
    char *argv[] = {owner, "1", "1", "1c", "0.5", NULL};
    const char *env[] = {"FAKECUDA_MEM_BYTES=5M", "VMMSHIM_STATS=1", NULL};
    child c;
    int pid = owner_up(&c, env, argv);
    CHECK(pid > 0, "owner did not start");
    if (!pid) {
        child_end(&c, err, sizeof err);
        return;
    }
    snprintf(pidtxt, sizeof pidtxt, "%7d ", pid);
    CHECK_EQ(ctl(out, sizeof out, "ps", NULL), 0);
    line_with(out, pidtxt, line, sizeof line);
    CHECK(strstr(line, " alive       4    3.5 MiB    3.5 MiB          -    3.5 MiB       4       2       0       1       1       0       0 "),
          "ps row (4 live, 3.5 MiB requested and held, peak 3.5 MiB; made 4, backed 2 (none unpublished), 1 captured, "
          "1 full):\n%s",
          out);
    CHECK_EQ(ctl(out, sizeof out, "ps", "--json"), 0);
    CHECK(strstr(out, "\"allocations_made\": 4, \"allocations_backed\": 2, \"allocations_unpublished\": 0, "
                      "\"passed_capture\": 1, \"passed_device_full\": 1, \"passed_unsupported\": 0, \"maps_adopted\": 0, "
                      "\"peak_bytes_requested\": 3670016, ") != NULL,
          "ps --json: %s", out);

    child_say(&c, "free");
    child_line(&c, "freed", line, sizeof line);
    vmm_registry *reg = NULL;
    vmm_proc_info pi;
    CHECK(vmm_open(registry, &reg) == VMM_OK && vmm_find_proc(reg, (uint32_t)pid, &pi) == VMM_OK, "find_proc: %s",
          vmm_last_error());
    CHECK(pi.stats_known && pi.n_allocs == 0 && pi.bytes_requested == 0 && pi.peak_requested == 3670016 &&
              pi.allocs == 4 && pi.allocs_backed == 2 && pi.passed_capture == 1 && pi.passed_device_full == 1 &&
              pi.passed_unsupported == 0 && pi.maps_adopted == 0 && pi.unpublished == 0,
          "after the frees: known %d live %llu peak %llu made %llu", pi.stats_known, (unsigned long long)pi.n_allocs,
          (unsigned long long)pi.peak_requested, (unsigned long long)pi.allocs);
    if (reg) vmm_close(reg);
    child_say(&c, "quit");
    CHECK_EQ(child_end(&c, err, sizeof err), 0);
    char want[512];
    snprintf(want, sizeof want,
             "vmmshim: stats: pid %d: 4 allocations, 2 backed and exportable (0 unpublished), 2 passed through (capture 1, "
             "device full 1, unsupported 0, disabled 0), 0 cuMemMap ranges adopted, peak 3.5 MiB\n",
             pid);
    CHECK(strcmp(err, want) == 0, "stderr:\n%s\nwant:\n%s", err, want);
}

/* On a device without VMM every allocation is passed through as unsupported; with the shim
 * disabled the registry never sees the process, and only the line at exit counts them; without
 * VMMSHIM_STATS there is no line. */
static void test_coverage_passed(void)
{
    char out[16384], line[1024], err[8192], pidtxt[16], want[512];
    char *argv[] = {owner, "1", "2a", NULL};
    const char *novmm[] = {"FAKECUDA_NO_VMM=1", "VMMSHIM_STATS=1", NULL};
    child c;
    int pid = owner_up(&c, novmm, argv);
    CHECK(pid > 0, "owner on a device without VMM did not start");
    if (pid) {
        snprintf(pidtxt, sizeof pidtxt, "%7d ", pid);
        ctl(out, sizeof out, "ps", NULL);
        line_with(out, pidtxt, line, sizeof line);
        CHECK(strstr(line, " alive       0        0 B        0 B          -        0 B       2       0       0       0       0       2       0 "),
              "ps row without VMM:\n%s", out);
        child_say(&c, "quit");
    }
    CHECK_EQ(child_end(&c, err, sizeof err), 0);
    snprintf(want, sizeof want,
             "vmmshim: stats: pid %d: 2 allocations, 0 backed and exportable (0 unpublished), 2 passed through (capture 0, "
             "device full 0, unsupported 2, disabled 0), 0 cuMemMap ranges adopted, peak 0 B\n",
             pid);
    CHECK(strstr(err, want) && count_of(err, "vmmshim: warning:") == 1 && count_of(err, "\n") == 2, "stderr without VMM:\n%s",
          err);

    const char *off[] = {"VMMSHIM_ENABLE=0", "VMMSHIM_STATS=1", NULL};
    pid = owner_up(&c, off, argv);
    CHECK(pid > 0, "owner with the shim disabled did not start");
    if (pid) {
        vmm_registry *reg = NULL;
        vmm_proc_info pi;
        CHECK(vmm_open(registry, &reg) != VMM_OK || vmm_find_proc(reg, (uint32_t)pid, &pi) == VMM_ERR_NOT_FOUND,
              "a disabled shim registered its process");
        if (reg) vmm_close(reg);
        child_say(&c, "quit");
    }
    CHECK_EQ(child_end(&c, err, sizeof err), 0);
    snprintf(want, sizeof want,
             "vmmshim: stats: pid %d: 2 allocations, 0 backed and exportable (0 unpublished), 2 passed through (capture 0, "
             "device full 0, unsupported 0, disabled 2), 0 cuMemMap ranges adopted, peak 0 B\n",
             pid);
    CHECK(strcmp(err, want) == 0, "stderr with the shim disabled:\n%s", err);

    const char *quiet[] = {"FAKECUDA_NO_VMM=0", NULL};
    pid = owner_up(&c, quiet, argv);
    CHECK(pid > 0, "owner did not start");
    if (pid) child_say(&c, "quit");
    CHECK(child_end(&c, err, sizeof err) == 0 && err[0] == 0, "without VMMSHIM_STATS: %s", err);

    /* ranges the program maps itself are no allocations, but adopted */
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/own_vmm", build);
    char *own[] = {prog, NULL};
    const char *stats[] = {"VMMSHIM_STATS=1", NULL};
    CHECK(child_start(&c, own, stats) == 0, "own_vmm did not start");
    while (fgets(line, sizeof line, c.out)) {}
    CHECK(child_end(&c, err, sizeof err) == 0 &&
              strstr(err, ": 0 allocations, 0 backed and exportable (0 unpublished), 0 passed through") &&
              strstr(err, "), 2 cuMemMap ranges adopted, peak 6.0 MiB\n"),
          "own_vmm: %s", err);
}

/* A registry of 1024 records and 1100 allocations: they all work, 1024 are published, and the
 * 76 the registry has no room for are counted (ps, its JSON, the client library, VMMSHIM_STATS),
 * with one line said when it filled, not one per allocation.  Ten freed make room for ten more,
 * and ten beyond those do not fit again: no second line (once per process), 86 unpublished. */
static void test_registry_full(void)
{
    char small[128], line[512], out[16384], err[16384], want[512], pidtxt[16], errs[4096], prog[600];
    char full[96];
    snprintf(full, sizeof full, "%s-full", registry);
    snprintf(small, sizeof small, "VMMSHIM_REGISTRY=%s", full);
    snprintf(prog, sizeof prog, "%s/progs/many", build);
    char *argv[] = {prog, "1100", "4096", "hold", NULL};
    const char *env[] = {small, "VMMSHIM_REGISTRY_CAPACITY=1024", "VMMSHIM_STATS=1", NULL};
    child c;
    int pid = 0, made = -1, failed = -1, bad = -1;
    unsigned long long used = 0;
    CHECK(child_start(&c, argv, env) == 0, "many did not start");
    CHECK(sscanf(child_line(&c, "ready", line, sizeof line), "ready %d allocated=%d failures=%d used=%llu bad=%d", &pid,
                 &made, &failed, &used, &bad) == 5 &&
              made == 1100 && failed == 0 && bad == 0,
          "1100 allocations in a registry of 1024 records: %s", line);
    if (pid <= 0) {
        child_end(&c, err, sizeof err);
        shm_unlink(full);
        return;
    }
    vmm_registry *reg = NULL;
    vmm_registry_info ri;
    vmm_proc_info pi;
    CHECK(vmm_open(full, &reg) == VMM_OK && vmm_registry_describe(reg, &ri) == VMM_OK && ri.capacity == 1024,
          "the small registry: %s (capacity %llu)", vmm_last_error(), reg ? (unsigned long long)ri.capacity : 0ull);
    CHECK(reg && vmm_find_proc(reg, (uint32_t)pid, &pi) == VMM_OK && pi.stats_known && pi.n_allocs == 1024 &&
              pi.allocs == 1100 && pi.allocs_backed == 1100 && pi.unpublished == 76,
          "find_proc: %s: %llu live, %llu made, %llu backed, %llu unpublished", vmm_last_error(),
          (unsigned long long)pi.n_allocs, (unsigned long long)pi.allocs, (unsigned long long)pi.allocs_backed,
          (unsigned long long)pi.unpublished);

    char *ps[] = {vmmctl, "--registry", full, "ps", NULL}, *ps_json[] = {vmmctl, "--registry", full, "ps", "--json", NULL};
    snprintf(pidtxt, sizeof pidtxt, "%7d ", pid);
    CHECK_EQ(spawn_capture(ps, NULL, out, sizeof out, errs, sizeof errs, 60), 0);
    CHECK(strstr(out, "   MADE  BACKED   UNPUB CAPTURE ") != NULL, "ps header: %s", out);
    line_with(out, pidtxt, line, sizeof line);
    CHECK(strstr(line, " alive    1024    4.0 MiB    4.0 MiB          -    4.0 MiB    1100    1100      76       0       0       0       0 "),
          "ps row (1024 published of 1100 backed, 76 unpublished):\n%s", out);
    CHECK_EQ(spawn_capture(ps_json, NULL, out, sizeof out, errs, sizeof errs, 60), 0);
    CHECK(strstr(out, "\"allocations_made\": 1100, \"allocations_backed\": 1100, \"allocations_unpublished\": 76, "
                      "\"passed_capture\": 0, ") != NULL,
          "ps --json: %s", out);

    child_say(&c, "more");
    CHECK(sscanf(child_line(&c, "more", line, sizeof line), "more allocated=%d failures=%d bad=%d", &made, &failed, &bad) == 3 &&
              made == 20 && failed == 0 && bad == 0,
          "ten freed, twenty more: %s", line);
    CHECK(reg && vmm_find_proc(reg, (uint32_t)pid, &pi) == VMM_OK && pi.n_allocs == 1024 && pi.allocs_backed == 1120 &&
              pi.unpublished == 86,
          "after ten more: %llu live, %llu backed, %llu unpublished", (unsigned long long)pi.n_allocs,
          (unsigned long long)pi.allocs_backed, (unsigned long long)pi.unpublished);
    if (reg) vmm_close(reg);
    child_say(&c, "quit");
    CHECK_EQ(child_end(&c, err, sizeof err), 0);
    CHECK(count_of(err, "registry is full") == 1 && count_of(err, "vmmshim: warning:") == 1 &&
              strstr(err, "vmmshim: warning: the registry is full (1024 records): this and later allocations go "
                          "unpublished, counted in vmmctl ps (raise VMMSHIM_REGISTRY_CAPACITY)\n"),
          "one line when the registry filled:\n%s", err);
    snprintf(want, sizeof want,
             "vmmshim: stats: pid %d: 1120 allocations, 1120 backed and exportable (86 unpublished), 0 passed through "
             "(capture 0, device full 0, unsupported 0, disabled 0), 0 cuMemMap ranges adopted, peak 4.0 MiB\n",
             pid);
    CHECK(strstr(err, want) && count_of(err, "\n") == 2, "stderr:\n%s\nwant the stats line:\n%s", err, want);
    shm_unlink(full);
}

/* The owner's frames file in /dev/shm (layout.h, FRAMES), found by its pid and start time. */
static void frames_file(char *path, size_t len, int pid, uint64_t *start)
{
    vmm_registry *reg = NULL;
    vmm_proc_info pi;
    *start = 0;
    if (vmm_open(registry, &reg) == VMM_OK && vmm_find_proc(reg, (uint32_t)pid, &pi) == VMM_OK) *start = pi.start_time;
    if (reg) vmm_close(reg);
    char name[256];
    snprintf(name, sizeof name, VMM_REG_FRAMES_NAME, registry, (unsigned)pid, (unsigned long long)*start);
    snprintf(path, len, "/dev/shm%s", name);
}

static int callsite_up(child *c, const char *const env[], char *addr, size_t len)
{
    char prog[600], line[256];
    snprintf(prog, sizeof prog, "%s/progs/callsite", build);
    char *argv[] = {prog, NULL};
    int pid = 0;
    unsigned long long a = 0;
    if (child_start(c, argv, env) != 0 ||
        sscanf(child_line(c, "ready", line, sizeof line), "ready %d %llx", &pid, &a) != 2)
        return 0;
    snprintf(addr, len, "0x%llx", a + 100);
    return pid;
}

static void show(char *out, size_t len, int pid, const char *addr)
{
    char pidtxt[16];
    snprintf(pidtxt, sizeof pidtxt, "%d", pid);
    char err[4096];
    char *argv[] = {vmmctl, "--registry", registry, "show", pidtxt, (char *)addr, NULL};
    int rc = spawn_capture(argv, NULL, out, len, err, sizeof err, 60);
    if (rc) snprintf(out, len, "(vmmctl show: exit %d: %s)", rc, err);
}

/* callsite_allocate of tests/progs/callsite, exported, made the allocation: `vmmctl show` names
 * it at its place in the program, from the name the owner wrote; still after the owner is
 * killed; gc takes the file with the dead owner's records.  A living owner whose file is gone is
 * read from /proc (the function from the program's symbol table); an owner that exits removes
 * its file; without VMMSHIM_FRAMES there is no file at all. */
static void test_frames(void)
{
    char out[8192], err[4096], addr[32], path[512], line[512];
    const char *frames4[] = {"VMMSHIM_FRAMES=4", NULL};
    uint64_t start;
    child c;
    int pid = callsite_up(&c, frames4, addr, sizeof addr);
    CHECK(pid > 0, "callsite did not start");
    if (!pid) {
        child_end(&c, err, sizeof err);
        return;
    }
    frames_file(path, sizeof path, pid, &start);
    FILE *f = fopen(path, "r");
    bool named = false;
    CHECK(f && fgets(line, sizeof line, f) && strcmp(line, VMM_REG_FRAMES_HEADER "\n") == 0, "frames file %s: %s", path,
          f ? line : strerror(errno));
    while (f && fgets(line, sizeof line, f)) named |= strstr(line, " callsite_allocate /") && strstr(line, "/progs/callsite\n");
    if (f) fclose(f);
    CHECK(named, "the owner did not name callsite_allocate in %s", path);
    show(out, sizeof out, pid, addr);
    CHECK(strstr(out, "frame 0      callsite+0x") && strstr(out, " (callsite_allocate)\nframe 1      callsite+0x") &&
              strstr(out, "frame 3      "),
          "vmmctl show:\n%s", out);
    kill(c.pid, SIGKILL);
    CHECK_EQ(child_end(&c, err, sizeof err), 128 + SIGKILL);
    show(out, sizeof out, pid, addr);
    CHECK(strstr(out, ", dead,") && strstr(out, "frame 0      callsite+0x") && strstr(out, " (callsite_allocate)\n"),
          "vmmctl show of the dead owner:\n%s", out);
    CHECK(access(path, F_OK) == 0, "the dead owner's file went before gc");
    CHECK(ctl(out, sizeof out, "gc", NULL) == 0 && strstr(out, "reclaimed 1 record from 1 dead process"), "gc: %s", out);
    CHECK(access(path, F_OK) != 0 && errno == ENOENT, "gc left %s", path);

    pid = callsite_up(&c, frames4, addr, sizeof addr);
    CHECK(pid > 0, "callsite did not start");
    if (pid) {
        frames_file(path, sizeof path, pid, &start);
        CHECK(unlink(path) == 0, "%s: %s", path, strerror(errno));
        show(out, sizeof out, pid, addr);
        CHECK(strstr(out, "frame 0      callsite+0x") && strstr(out, " (callsite_allocate)\nframe 1      callsite+0x") &&
                  strstr(out, " (main)\n"),
              "vmmctl show from /proc:\n%s", out);
        child_say(&c, "quit");
    }
    CHECK(child_end(&c, err, sizeof err) == 0 && err[0] == 0, "callsite: %s", err);

    pid = callsite_up(&c, frames4, addr, sizeof addr);
    CHECK(pid > 0, "callsite did not start");
    if (pid) {
        frames_file(path, sizeof path, pid, &start);
        CHECK(access(path, R_OK) == 0, "%s: %s", path, strerror(errno));
        child_say(&c, "quit");
    }
    CHECK(child_end(&c, err, sizeof err) == 0 && err[0] == 0, "callsite: %s", err);
    CHECK(access(path, F_OK) != 0, "%s outlived its owner's exit", path);

    const char *none[] = {"VMMSHIM_FRAMES=0", NULL};
    pid = callsite_up(&c, none, addr, sizeof addr);
    CHECK(pid > 0, "callsite did not start");
    if (pid) {
        frames_file(path, sizeof path, pid, &start);
        CHECK(start != 0 && access(path, F_OK) != 0, "%s made without VMMSHIM_FRAMES", path);
        show(out, sizeof out, pid, addr);
        CHECK(strstr(out, "allocation ") && !strstr(out, "frame"), "vmmctl show without frames:\n%s", out);
        child_say(&c, "quit");
    }
    child_end(&c, err, sizeof err);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(build, sizeof build, "%s", b ? b : "build");
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", build);
    spawn_preload(preload, sizeof preload, shim);
    snprintf(owner, sizeof owner, "%s/progs/owner", build);
    snprintf(registry, sizeof registry, "/vmmshim-tstats-%d", (int)getpid());
    snprintf(reg_env, sizeof reg_env, "VMMSHIM_REGISTRY=%s", registry);
    snprintf(vmmctl, sizeof vmmctl, "%s/vmmctl", build);
    test_registry_name();
    test_coverage();
    test_coverage_passed();
    test_registry_full();
    test_frames();
    shm_unlink(registry);
    CHECK_DONE();
}
