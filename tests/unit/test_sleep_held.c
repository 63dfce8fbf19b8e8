/* Issue 29: "pause waits a bounded time for [companions that still hold imports], and then reports
 * exactly what is still held and by which pid".  A `progs/spans` owner under the shim allocates
 * and fills a buffer; five companion processes (forked from this one, the client library only)
 * import it: H keeps its import live; R releases it and drops its idle mapping before the pause
 * (its import cache tells the owner's broker, protocol v5); I releases it but leaves the mapping
 * idle in its cache, which its reaper unmaps only once the pause marked the record paused, so it
 * must let go during the pause's wait; K is SIGKILLed and reaped before the pause; Z is SIGKILLed
 * and left a zombie.  The pause must report exactly H's pid, and bytes held within what it
 * released; a second pause after H let go (after a resume, H imports the new memory and releases
 * it) must report nobody. */
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>

#define MIB (1024ull * 1024)

typedef struct comp {
    pid_t pid;
    int to, from; /* commands to it, answers from it */
} comp;

/* The child's side: import the buffer at addr, then as mode says; answer 'r' when ready.  Later
 * commands: 'i' import it again and keep it; 'q' release everything and drop idle mappings;
 * each answered 'r' (or 'e' on failure). */
static void child(uint64_t addr, char mode, int in, int out)
{
    vmm_registry *reg = NULL;
    vmm_imported *imp = NULL;
    char ans = 'e';
    for (char cmd = 'i';; ans = 'e') {
        if (cmd == 'i') {
            vmm_alloc_info info;
            if ((reg || vmm_open(g_reg, &reg) == VMM_OK) && vmm_find(reg, (uint32_t)g_pid, addr, &info) == VMM_OK &&
                vmm_import(reg, &info, &imp) == VMM_OK &&
                *(const volatile uint64_t *)(uintptr_t)vmm_import_ptr(imp) == word(7, 0))
                ans = 'r';
            if (mode == 'R' || mode == 'I') {
                vmm_import_release(imp);
                imp = NULL;
                if (mode == 'R') (void)vmm_import_drop_idle();
            }
            mode = 'H';
        } else if (cmd == 'q') {
            if (imp) vmm_import_release(imp);
            imp = NULL;
            ans = vmm_import_drop_idle() == VMM_OK ? 'r' : 'e';
        }
        if (write(out, &ans, 1) != 1 || read(in, &cmd, 1) != 1) _exit(0);
    }
}

static bool start(comp *c, uint64_t addr, char mode)
{
    int a[2], b[2];
    if (pipe(a) || pipe(b)) return false;
    c->pid = fork();
    if (c->pid == 0) {
        close(a[1]);
        close(b[0]);
        child(addr, mode, a[0], b[1]);
    }
    close(a[0]);
    close(b[1]);
    c->to = a[1];
    c->from = b[0];
    char ans = 0;
    return c->pid > 0 && read(c->from, &ans, 1) == 1 && ans == 'r';
}

static bool tell(comp *c, char cmd)
{
    char ans = 0;
    return write(c->to, &cmd, 1) == 1 && read(c->from, &ans, 1) == 1 && ans == 'r';
}

/* A pause's answer: ok, released, held, holders and their pids. */
typedef struct held_ans {
    bool ok;
    unsigned long long released, held;
    unsigned n, pids[8];
    char line[256];
} held_ans;

static held_ans pause_held(void)
{
    held_ans h;
    memset(&h, 0, sizeof h);
    unsigned long long skip;
    int used = 0;
    h.ok = owner_cmd(h.line, "P 0") && sscanf(h.line, "ok %llu %llu %llu %llu %llu %llu %u%n", &h.released, &skip, &skip,
                                              &skip, &skip, &h.held, &h.n, &used) == 7;
    for (unsigned i = 0; h.ok && i < h.n && i < 8; i++) {
        int more = 0;
        h.ok = sscanf(h.line + used, " %u%n", &h.pids[i], &more) == 1;
        used += more;
    }
    return h;
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_reg, sizeof g_reg, "/vmmshim-held-%d", (int)getpid());
    setenv("VMMSHIM_REGISTRY", g_reg, 1);
    signal(SIGPIPE, SIG_IGN);
    CHECK(spans_start(), "cannot start the owner");
    uint64_t addr = 0;
    int buf = alloc_filled('a', 8 * MIB, 7, &addr);
    CHECK(buf >= 0, "the owner could not allocate");
    if (buf < 0) CHECK_DONE();

    comp h, r, i, k, z;
    CHECK(start(&h, addr, 'H'), "companion H could not import");
    CHECK(start(&r, addr, 'R'), "companion R could not import");
    CHECK(start(&i, addr, 'I'), "companion I could not import");
    CHECK(start(&k, addr, 'H'), "companion K could not import");
    CHECK(start(&z, addr, 'H'), "companion Z could not import");
    kill(k.pid, SIGKILL);
    CHECK(waitpid(k.pid, NULL, 0) == k.pid, "reaping K");
    kill(z.pid, SIGKILL); /* left a zombie until the end: it holds nothing */

    held_ans p = pause_held();
    CHECK(p.ok, "pause: %s", p.line);
    CHECK(p.n == 1 && p.pids[0] == (unsigned)h.pid,
          "holders: want exactly H (%d); R %d, I %d, K %d, Z %d must not be named: %s", (int)h.pid, (int)r.pid,
          (int)i.pid, (int)k.pid, (int)z.pid, p.line);
    CHECK(p.held >= 8 * MIB && p.held <= p.released, "bytes held %llu of %llu released (the buffer is 8 MiB)", p.held,
          p.released);

    /* after a resume H takes the new memory too, then lets go of everything: nobody is named */
    char ans[256];
    CHECK(owner_cmd(ans, "R"), "resume: %s", ans);
    CHECK(tell(&h, 'i'), "H could not import the resumed memory");
    CHECK(tell(&h, 'q'), "H could not let go");
    p = pause_held();
    CHECK(p.ok && p.n == 0 && p.held == 0, "a pause after H let go: %s", p.line);

    /* and one that holds again is named again: the table forgot nothing it should not have */
    CHECK(owner_cmd(ans, "R"), "second resume: %s", ans);
    CHECK(tell(&h, 'i'), "H could not import again");
    p = pause_held();
    CHECK(p.ok && p.n == 1 && p.pids[0] == (unsigned)h.pid && p.held >= 8 * MIB, "H holding again: %s", p.line);

    comp *all[] = {&h, &r, &i, &z};
    for (int n = 0; n < 4; n++) {
        close(all[n]->to);
        close(all[n]->from);
        kill(all[n]->pid, SIGKILL);
        waitpid(all[n]->pid, NULL, 0);
    }
    owner_cmd(NULL, "x 0");
    waitpid(g_pid, NULL, 0);
    shm_unlink(g_reg);
    CHECK_DONE();
}
