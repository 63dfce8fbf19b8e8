/* Pause and resume from outside the process (protocol v4: vmm_pause_process, vmm_resume_process,
 * vmmctl pause/resume), over the emulated driver.
 *
 * The owner is tests/progs/spans under the shim (spansowner.h); this process is the companion and
 * runs the real vmmctl.  First an owner that did not opt in: every remote pause and resume is
 * refused with one line naming VMMSHIM_REMOTE_PAUSE, and its memory stays as it was (the emulated
 * driver's live bytes, its contents, its records).  Then one with VMMSHIM_REMOTE_PAUSE=1: vmmctl
 * pause releases the memory (live bytes to 0) and prints what it released and kept; a companion's
 * import gets VMM_ERR_PAUSED; vmmctl resume maps it again and the companion reads every word it
 * read before.  Also: discard and by tag through the API (the report's fields), to a file, an
 * unknown tag, pause twice and resume what is not paused, a remote and an in-process pause at once
 * (one wins, the other is told, nothing hangs), and a dead owner, a pid that is no process and a
 * bad argument, each with a one-line error. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define TAG "sleeper"

static char vmmctl[700];

typedef struct {
    int status; /* exit code, or 128 + signal */
    char out[4096], err[4096];
} result;

typedef struct {
    pid_t pid;
    FILE *o, *e;
} running;

static void slurp(FILE *f, char *buf, size_t len)
{
    size_t n = 0;
    if (f) {
        rewind(f);
        n = fread(buf, 1, len - 1, f);
        fclose(f);
    }
    buf[n] = 0;
}

/* vmmctl --registry REG args... started, its stdout and stderr into temporary files. */
static running ctl_start(const char *const *args)
{
    const char *argv[16] = {"vmmctl", "--registry", g_reg};
    int n = 3;
    for (; *args && n < 15; args++) argv[n++] = *args;
    argv[n] = NULL;
    running r = {.pid = -1, .o = tmpfile(), .e = tmpfile()};
    if (!r.o || !r.e) return r;
    fflush(stdout);
    fflush(stderr);
    r.pid = fork();
    if (r.pid == 0) {
        dup2(fileno(r.o), 1);
        dup2(fileno(r.e), 2);
        execv(vmmctl, (char *const *)argv);
        _exit(127);
    }
    return r;
}

static void ctl_wait(running *run, result *r)
{
    int st = 0;
    r->status = -1;
    if (run->pid > 0 && waitpid(run->pid, &st, 0) == run->pid)
        r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    slurp(run->o, r->out, sizeof r->out);
    slurp(run->e, r->err, sizeof r->err);
}

#define CTL(r, ...)                                         \
    do {                                                    \
        const char *const args_[] = {__VA_ARGS__, NULL};    \
        running run_ = ctl_start(args_);                    \
        ctl_wait(&run_, (r));                               \
    } while (0)

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

/* One line, "vmmctl: error: ...", nothing on stdout, exit 1. */
static bool one_error(const result *r) {
    return r->status == 1 && r->out[0] == 0 && strncmp(r->err, "vmmctl: error: ", 15) == 0 && count_lines(r->err) == 1;
}

static unsigned long long owner_phys(void) { return owner_mem().phys; }

/* The companion imports the allocation at addr and checks each of its words against seed: true
 * when all match; *st the import's status. */
static bool companion_reads(vmm_registry *reg, uint64_t addr, uint64_t bytes, uint64_t seed, vmm_status *st)
{
    vmm_alloc_info info;
    *st = vmm_find(reg, (uint32_t)g_pid, addr, &info);
    if (*st != VMM_OK) return false;
    vmm_imported *imp = NULL;
    if ((*st = vmm_import(reg, &info, &imp)) != VMM_OK) return false;
    const volatile uint64_t *w = (const volatile uint64_t *)(uintptr_t)vmm_import_ptr(imp);
    bool same = true;
    for (uint64_t k = 0; k < bytes / 8 && same; k++) same = w[k] == word(seed, k);
    vmm_import_release(imp);
    return same;
}

static bool paused_flag(vmm_registry *reg, uint64_t addr)
{
    vmm_alloc_info info;
    return vmm_find(reg, (uint32_t)g_pid, addr, &info) == VMM_OK && (info.flags & VMM_ALLOC_PAUSED);
}

static void owner_stop(void) { (void)spans_quit(); }

int main(void)
{
    spans_setup("rpause");
    snprintf(vmmctl, sizeof vmmctl, "%s/vmmctl", g_build);
    setenv("VMMSHIM_TAG", TAG, 1);
    char pause_dir[] = "/tmp/vmmshim-rpause-XXXXXX";
    CHECK(mkdtemp(pause_dir) != NULL, "mkdtemp");
    setenv("VMMSHIM_PAUSE_DIR", pause_dir, 1);
    char pid_s[32];
    result r;
    vmm_sleep_report rep;
    vmm_status st;

    /* 1. an owner that did not opt in: refused, untouched */
    unsetenv("VMMSHIM_REMOTE_PAUSE");
    CHECK(spans_start(), "cannot start the first owner");
    uint64_t a_addr = 0;
    int a = alloc_filled('a', 8 * MIB, 201, &a_addr);
    CHECK(a >= 0, "the first owner could not allocate");
    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg) CHECK_DONE();
    snprintf(pid_s, sizeof pid_s, "%d", (int)g_pid);
    unsigned long long phys0 = owner_phys();
    CTL(&r, "pause", pid_s);
    CHECK(one_error(&r) && strstr(r.err, "does not accept remote pause") && strstr(r.err, "VMMSHIM_REMOTE_PAUSE=1") &&
              strstr(r.err, pid_s),
          "refusal without the opt-in: exit %d, out '%s', err '%s'", r.status, r.out, r.err);
    CTL(&r, "resume", pid_s);
    CHECK(one_error(&r) && strstr(r.err, "does not accept remote pause"), "resume without the opt-in: %d '%s'",
          r.status, r.err);
    st = vmm_pause_process(reg, (uint32_t)g_pid, NULL, VMM_PAUSE_DISCARD, &rep, sizeof rep);
    CHECK(st == VMM_ERR_ACCESS && strstr(vmm_last_error(), "VMMSHIM_REMOTE_PAUSE"), "API refusal: %d: %s", (int)st,
          vmm_last_error());
    CHECK(owner_phys() == phys0 && phys0 >= 8 * MIB, "a refused pause changed the device's live bytes: %llu -> %llu",
          phys0, owner_phys());
    CHECK(verify(a, 201) && !paused_flag(reg, a_addr), "a refused pause touched the memory or its record");
    CHECK(companion_reads(reg, a_addr, 8 * MIB, 201, &st) && st == VMM_OK, "import after a refusal: %s",
          vmm_last_error());
    owner_stop();
    vmm_close(reg);
    reg = NULL;

    /* 2. an owner that opted in: vmmctl pause releases, vmmctl resume restores */
    setenv("VMMSHIM_REMOTE_PAUSE", "1", 1);
    CHECK(spans_start(), "cannot start the second owner");
    uint64_t s_addr = 0, c_addr = 0;
    a = alloc_filled('a', 24 * MIB, 101, &a_addr);
    int s = alloc_filled('A', 3 * MIB, 102, &s_addr), c = alloc_filled('a', 64 * 1024, 103, &c_addr);
    CHECK(a >= 0 && s >= 0 && c >= 0, "the second owner could not allocate");
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg) CHECK_DONE();
    snprintf(pid_s, sizeof pid_s, "%d", (int)g_pid);
    CHECK(companion_reads(reg, a_addr, 24 * MIB, 101, &st) && st == VMM_OK, "import before the pause: %s",
          vmm_last_error());
    phys0 = owner_phys();
    CTL(&r, "pause", pid_s);
    unsigned long long phys1 = owner_phys();
    CHECK(r.status == 0 && r.err[0] == 0 && count_lines(r.out) == 1 && strstr(r.out, "paused all its memory") &&
              strstr(r.out, "released") && strstr(r.out, "kept 27.1 MiB of 3 allocations") && strstr(r.out, " ms"),
          "vmmctl pause: exit %d, out '%s', err '%s'", r.status, r.out, r.err);
    printf("note: %s", r.out);
    CHECK(phys1 == 0 && phys0 > 0, "the device's live bytes went from %llu to %llu (want 0)", phys0, phys1);
    CHECK(paused_flag(reg, a_addr) && paused_flag(reg, c_addr), "the records are not marked paused");
    CHECK(!companion_reads(reg, a_addr, 24 * MIB, 101, &st) && st == VMM_ERR_PAUSED, "import while paused: %d: %s",
          (int)st, vmm_last_error());
    CTL(&r, "pause", pid_s);
    CHECK(one_error(&r) && strstr(r.err, "paused"), "a second pause: %d '%s'", r.status, r.err);
    CTL(&r, "resume", pid_s);
    CHECK(r.status == 0 && count_lines(r.out) == 1 && strstr(r.out, "resumed all its memory") &&
              strstr(r.out, "restored 27.1 MiB of 3 allocations"),
          "vmmctl resume: exit %d, out '%s', err '%s'", r.status, r.out, r.err);
    printf("note: %s", r.out);
    CHECK(owner_phys() == phys0, "live bytes after the resume: %llu, before the pause %llu", owner_phys(), phys0);
    CHECK(!paused_flag(reg, a_addr), "the record is still marked paused");
    CHECK(companion_reads(reg, a_addr, 24 * MIB, 101, &st) && st == VMM_OK,
          "the companion does not read the same bytes after the resume: %d: %s", (int)st, vmm_last_error());
    CHECK(companion_reads(reg, c_addr, 64 * 1024, 103, &st) && st == VMM_OK, "the small one after the resume: %s",
          vmm_last_error());
    CHECK(verify(a, 101) && verify(s, 102) && verify(c, 103), "the owner's bytes after the resume");
    CTL(&r, "resume", pid_s);
    CHECK(one_error(&r), "resume of nothing paused: %d '%s'", r.status, r.err);

    /* 3. by tag, discarded, through the API: the report's fields */
    memset(&rep, 0, sizeof rep);
    st = vmm_pause_process(reg, (uint32_t)g_pid, TAG, VMM_PAUSE_DISCARD, &rep, sizeof rep);
    CHECK(st == VMM_OK, "pause by tag, discarded: %d: %s", (int)st, vmm_last_error());
    CHECK(rep.bytes_kept == 0 && rep.bytes_released >= 27 * MIB && rep.allocations == 3 && rep.segments > 0 &&
              rep.ns > 0,
          "report: released %llu kept %llu allocations %llu segments %llu ns %llu",
          (unsigned long long)rep.bytes_released, (unsigned long long)rep.bytes_kept,
          (unsigned long long)rep.allocations, (unsigned long long)rep.segments, (unsigned long long)rep.ns);
    CHECK(owner_phys() == 0, "live bytes after a discarding pause by tag: %llu", owner_phys());
    st = vmm_resume_process(reg, (uint32_t)g_pid, "nosuchtag", &rep, sizeof rep);
    CHECK(st == VMM_ERR_NOT_FOUND, "resume of an unknown tag: %d: %s", (int)st, vmm_last_error());
    memset(&rep, 0, sizeof rep);
    st = vmm_resume_process(reg, (uint32_t)g_pid, TAG, &rep, sizeof rep);
    CHECK(st == VMM_OK && rep.bytes_kept == 0 && rep.bytes_released >= 27 * MIB, "resume by tag: %d: %s", (int)st,
          vmm_last_error());
    CHECK(owner_phys() == phys0, "live bytes after the resume by tag: %llu", owner_phys());
    st = vmm_resume_process(reg, (uint32_t)g_pid, NULL, NULL, 0);
    CHECK(st == VMM_ERR_STATE, "resume of nothing paused: %d: %s", (int)st, vmm_last_error());
    st = vmm_pause_process(reg, (uint32_t)g_pid, NULL, 4, NULL, 0);
    CHECK(st == VMM_ERR_INVALID, "bad flags: %d", (int)st);

    /* 4. to a file, by tag, through vmmctl */
    /* the discarding pause left undefined bytes: new ones */
    CHECK(owner_cmd(NULL, "w %d 301", a) && owner_cmd(NULL, "w %d 102", s) && owner_cmd(NULL, "w %d 103", c), "rewrite");
    CTL(&r, "pause", pid_s, "--tag", TAG, "--to-file");
    CHECK(r.status == 0 && strstr(r.out, "paused tag " TAG) && strstr(r.out, "(in a file)"),
          "vmmctl pause --to-file: exit %d, out '%s', err '%s'", r.status, r.out, r.err);
    CHECK(owner_phys() == 0, "live bytes after a pause to a file: %llu", owner_phys());
    CTL(&r, "pause", pid_s, "--tag", "nosuchtag");
    CHECK(one_error(&r), "pause of an unknown tag: %d '%s'", r.status, r.err);
    CTL(&r, "resume", pid_s, "--tag", TAG);
    CHECK(r.status == 0 && strstr(r.out, "resumed tag " TAG), "vmmctl resume --tag: %d '%s' '%s'", r.status, r.out,
          r.err);
    CHECK(companion_reads(reg, a_addr, 24 * MIB, 301, &st) && st == VMM_OK, "bytes back from the file: %s",
          vmm_last_error());
    CHECK(verify(a, 301) && verify(s, 102) && verify(c, 103), "the owner's bytes back from the file");

    /* 5. a remote and an in-process pause at once: one does it, the other is told, nothing hangs */
    {
        const char *const args[] = {"pause", pid_s, NULL};
        running run = ctl_start(args);
        char ans[256];
        bool mine = owner_cmd(ans, "P 0");
        ctl_wait(&run, &r);
        CHECK((mine ? 1 : 0) + (r.status == 0 ? 1 : 0) == 1,
              "in-process pause '%.60s' and vmmctl pause (exit %d, '%s') at once: want exactly one", ans, r.status,
              r.err);
        CHECK(owner_phys() == 0, "live bytes after the two pauses: %llu", owner_phys());
        CTL(&r, "resume", pid_s);
        CHECK(r.status == 0, "resume after the race: %d '%s'", r.status, r.err);
        CHECK(verify(a, 301) && verify(c, 103), "bytes after the race");
    }

    /* 6. a dead owner, a pid that is no process, bad arguments: one line each */
    pid_t dead = g_pid;
    kill(g_pid, SIGKILL);
    waitpid(g_pid, NULL, 0);
    fclose(g_to);
    fclose(g_from);
    CTL(&r, "pause", pid_s);
    CHECK(one_error(&r) && strstr(r.err, "has exited"), "dead owner: %d '%s'", r.status, r.err);
    st = vmm_resume_process(reg, (uint32_t)dead, NULL, NULL, 0);
    CHECK(st == VMM_ERR_OWNER_DEAD, "API, dead owner: %d: %s", (int)st, vmm_last_error());
    uint32_t nopid = 4000000;
    while (nopid > 2 && (kill((pid_t)nopid, 0) == 0 || errno != ESRCH)) nopid--;
    char nopid_s[32];
    snprintf(nopid_s, sizeof nopid_s, "%u", nopid);
    CTL(&r, "pause", nopid_s);
    CHECK(one_error(&r) && strstr(r.err, "not in the registry"), "no such pid: %d '%s'", r.status, r.err);
    CTL(&r, "pause", "xyz");
    CHECK(r.status == 2 && count_lines(r.err) == 1, "a bad pid argument: %d '%s'", r.status, r.err);
    CTL(&r, "pause", pid_s, "--discard", "--to-file");
    CHECK(r.status == 2 && count_lines(r.err) == 1, "--discard with --to-file: %d '%s'", r.status, r.err);

    vmm_close(reg);
    rmdir(pause_dir);
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", g_reg);
    unlink(path);
    CHECK_DONE();
}
