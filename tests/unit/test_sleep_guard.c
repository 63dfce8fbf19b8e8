/* VMMSHIM_PAUSE_GUARD (shim/backing/guard.c), over the emulated driver: the owner is
 * tests/progs/spans under the shim.  Guarded, a paused allocation's place is mapped onto the
 * device's scratch chunk: a copy into it while paused succeeds and a copy out of it reads zeros,
 * and neither reaches the kept contents, which come back whole at the resume; the resume then
 * says, in one warning line, how many bytes were written while paused and on which device.  The
 * scratch is one granule on the device however much is paused, an allocation can be freed while
 * guarded, and a cycle where nothing touched paused memory says nothing.  Unguarded, the same copy
 * finds nothing mapped and kills the owner. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>

#define MIB (1ull << 20)

static void stop(void)
{
    int wst = spans_quit();
    CHECK(wst == 0, "the owner exited with 0x%x", wst);
}

static void guarded(void)
{
    char guard[] = "VMMSHIM_PAUSE_GUARD=1", path[] = "/tmp/vmmshim-guard-XXXXXX";
    char *envs[] = {guard, NULL};
    CHECK(owner_logging(envs, path), "cannot start the owner");
    owner_mem_t m0 = owner_mem();
    uint64_t a1, a2, a3;
    int x = alloc_filled('a', 6 * MIB, 71, &a1), y = alloc_filled('A', 2 * MIB, 72, &a2), z = alloc_filled('a', 4 * MIB, 73, &a3);
    CHECK(x >= 0 && y >= 0 && z >= 0, "allocations");
    owner_mem_t m1 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t m2 = owner_mem();
    CHECK(p.ok, "pause: %s", p.line);
    /* everything went back but one granule of scratch, however much is paused */
    CHECK_EQ(m2.phys, m0.phys + 2 * MIB);
    CHECK_EQ(m2.handles, m0.handles + 1);
    char a[256];
    (void)owner_cmd(a, "v %d 71", x);
    CHECK(!strncmp(a, "error mismatch at word 0", 24), "reading paused memory: %s", a);
    CHECK(owner_cmd(NULL, "w %d 99", x), "writing paused memory is taken by the scratch");
    CHECK(owner_cmd(NULL, "f %d", z), "a guarded allocation freed while paused");
    p = sleep_cmd("R");
    CHECK(p.ok, "resume: %s", p.line);
    CHECK(verify(x, 71) && verify(y, 72), "the kept contents, untouched by the writes while paused");
    owner_mem_t m3 = owner_mem();
    CHECK_EQ(m3.phys, m1.phys - 4 * MIB + 2 * MIB); /* z went; the scratch stays for the next pause */
    p = sleep_cmd("P 0");
    CHECK(p.ok && owner_mem().handles == m0.handles + 1, "a second pause reuses the scratch: %s", p.line);
    p = sleep_cmd("R");
    CHECK(p.ok && verify(x, 71), "second resume: %s", p.line);
    CHECK(owner_cmd(NULL, "f %d", x) && owner_cmd(NULL, "f %d", y), "free");
    stop();
    char text[4096];
    owner_log_read(path, text, sizeof text);
    int lines = 0;
    for (char *l = text; (l = strstr(l, "vmmshim: warning: resume: while paused, kernels wrote ")); l++) lines++;
    CHECK(lines == 1 && strstr(text, "bytes into paused memory on device 0 (the first at offset 0x0 of a 2097152-byte piece)"),
          "one warning, from the first resume only: %s", text);
}

/* Unguarded, the same copy into paused memory finds nothing mapped there: the emulated driver's
 * owner dies of it (SIGSEGV), as a GPU context faults. */
static void unguarded(void)
{
    CHECK(spans_start_env(NULL, NULL), "cannot start the owner");
    uint64_t a1;
    int x = alloc_filled('a', 2 * MIB, 81, &a1);
    owner_mem_t m0 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    CHECK(p.ok && owner_mem().phys == m0.phys - 2 * MIB, "pause: %s", p.line);
    char a[256] = "";
    CHECK(!owner_cmd(a, "w %d 99", x), "unguarded, a copy into paused memory answered: %s", a);
    int wst = spans_quit();
    /* SIGSEGV; in a sanitizer build its handler reports the fault and exits non-zero instead */
    CHECK((WIFSIGNALED(wst) && WTERMSIG(wst) == SIGSEGV) || (WIFEXITED(wst) && WEXITSTATUS(wst) != 0),
          "the owner's end: 0x%x", wst);
}

int main(void)
{
    spans_setup("sleepguard");
    guarded();
    unguarded();
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", g_reg);
    unlink(path);
    CHECK_DONE();
}
