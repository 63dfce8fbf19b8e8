/* Issue 29: "pause waits a bounded time for [companions that still hold imports], and then reports
 * exactly what is still held and by which pid".  A `progs/spans` owner under the shim allocates
 * and fills a buffer; five companion processes (forked from this one, the client library only)
 * import it: H keeps its import live; R releases it and drops its idle mapping before the pause
 * (its import cache tells the owner's broker, protocol v5); I releases it but leaves the mapping
 * idle in its cache, which its reaper unmaps only once the pause marked the record paused, so it
 * must let go during the pause's wait; K is SIGKILLed and reaped before the pause; Z is SIGKILLed
 * and left a zombie.  The pause must report exactly H's pid, and bytes held within what it
 * released; a second pause after H let go (after a resume, H imports the new memory and releases
 * it) must report nobody.
 *
 * From outside (protocol v4 with VMM_BROKER_REQ4_HOLDERS): this process, neither owner nor
 * holder, pauses the owner with vmm_pause_process and must get the same answer: H named, R2 (let
 * go before) and I2 (an idle mapping its reaper drops during the wait, on a connection the
 * broker has to accept while the pause runs on its thread) not; vmmctl pause prints the held line.
 * By tag: O holds only memory of tag "other" (spans' "g other"): a pause of "other", in the
 * process and from outside, names O and not H, who holds only memory of another tag.  And an
 * owner that predates the flag (a send hook turns it into a pause flag nobody knows, which the
 * real owner's pause refuses as an older owner's refuses the flag itself): the client asks again
 * without it, the pause happens, and the report says the holders are unknown. */
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

/* ---- the client library's send() comes here (it is linked statically) ---- */
#include "broker/protocol.h"
#include <dlfcn.h>
#include <sys/socket.h>

static unsigned long g_v4_sent, g_v4_flagged; /* v4 requests, and those asking for the holders */
static bool g_old_owner; /* the flag goes as a pause flag no owner knows: what an older owner sees */

ssize_t send(int fd, const void *buf, size_t len, int flags)
{
    static ssize_t (*real)(int, const void *, size_t, int);
    if (!real) {
        void *f = dlsym(RTLD_NEXT, "send");
        memcpy(&real, &f, sizeof f);
    }
    vmm_broker_request4 q;
    if (len == sizeof q) {
        memcpy(&q, buf, sizeof q);
        if (q.magic == VMM_BROKER_MAGIC && q.version == VMM_BROKER_VERSION4) {
            g_v4_sent++;
            g_v4_flagged += (q.flags & VMM_BROKER_REQ4_HOLDERS) != 0;
            if (g_old_owner && (q.flags & VMM_BROKER_REQ4_HOLDERS)) {
                q.flags = (q.flags & ~VMM_BROKER_REQ4_HOLDERS) | 1u << 30;
                return real(fd, &q, sizeof q, flags);
            }
        }
    }
    return real(fd, buf, len, flags);
}

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

static held_ans pause_held_tag(const char *tag)
{
    held_ans h;
    memset(&h, 0, sizeof h);
    unsigned long long skip;
    int used = 0;
    h.ok = owner_cmd(h.line, "P 0%s%s", tag ? " " : "", tag ? tag : "") && sscanf(h.line, "ok %llu %llu %llu %llu %llu %llu %u%n", &h.released, &skip, &skip,
                                              &skip, &skip, &h.held, &h.n, &used) == 7;
    for (unsigned i = 0; h.ok && i < h.n && i < 8; i++) {
        int more = 0;
        h.ok = sscanf(h.line + used, " %u%n", &h.pids[i], &more) == 1;
        used += more;
    }
    return h;
}

static held_ans pause_held(void) { return pause_held_tag(NULL); }

/* This process pauses the owner from outside: the report, and the status. */
static vmm_status remote_pause(vmm_registry *reg, const char *tag, vmm_sleep_report *rep)
{
    memset(rep, 0xee, sizeof *rep); /* what the call leaves unset shows */
    return vmm_pause_process(reg, (uint32_t)g_pid, tag, 0, rep, sizeof *rep);
}

static bool only(const vmm_sleep_report *rep, pid_t pid, uint64_t at_least)
{
    return rep->flags == 0 && rep->n_holders == 1 && rep->holders[0] == (uint32_t)pid && rep->holders[1] == 0 &&
           rep->bytes_held >= at_least && rep->bytes_held <= rep->bytes_released;
}

/* vmmctl pause PID's stdout (its stderr to ours). */
static bool ctl_pause(char *out, size_t len)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/vmmctl --registry %s pause %d", g_build, g_reg, (int)g_pid);
    fflush(stdout);
    FILE *f = popen(cmd, "r");
    size_t n = f ? fread(out, 1, len - 1, f) : 0;
    out[n] = 0;
    return f && pclose(f) == 0;
}

int main(void)
{
    spans_setup("held");
    static char remote[] = "VMMSHIM_REMOTE_PAUSE=1"; /* the owner only: for the pauses from outside */
    g_owner_env[0] = remote;
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

    /* from outside: the same answer, in vmm_pause_process's report */
    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    CHECK(owner_cmd(ans, "R"), "resume before the remote pause: %s", ans);
    comp r2, i2, o;
    CHECK(tell(&h, 'i'), "H could not import the resumed memory");
    CHECK(start(&r2, addr, 'R'), "companion R2 could not import");
    CHECK(start(&i2, addr, 'I'), "companion I2 could not import");
    vmm_sleep_report rep;
    g_v4_sent = g_v4_flagged = 0;
    vmm_status st = remote_pause(reg, NULL, &rep);
    CHECK(st == VMM_OK, "remote pause: %d: %s", (int)st, vmm_last_error());
    CHECK(only(&rep, h.pid, 8 * MIB),
          "remote pause: want exactly H (%d), not R2 (%d) nor I2 (%d): %u holders (%u, %u), %llu of %llu bytes held, "
          "flags %u", (int)h.pid, (int)r2.pid, (int)i2.pid, rep.n_holders, rep.holders[0], rep.holders[1],
          (unsigned long long)rep.bytes_held, (unsigned long long)rep.bytes_released, rep.flags);
    CHECK(g_v4_sent == 1 && g_v4_flagged == 1, "a current owner: %lu v4 requests, %lu flagged (want 1, 1)", g_v4_sent,
          g_v4_flagged);
    st = remote_pause(reg, NULL, &rep);
    CHECK(st == VMM_ERR_STATE && strstr(vmm_last_error(), "paused"), "a second remote pause: %d: %s", (int)st,
          vmm_last_error());

    /* vmmctl pause says it in a second line */
    CHECK(owner_cmd(ans, "R"), "resume before vmmctl pause: %s", ans);
    CHECK(tell(&h, 'i'), "H could not import for vmmctl");
    char out[1024], want[64];
    snprintf(want, sizeof want, "\nstill held by pid %d: ", (int)h.pid);
    CHECK(ctl_pause(out, sizeof out) && strstr(out, "paused all its memory") && strstr(out, want) &&
              strstr(out, " MiB (imports not released"),
          "vmmctl pause: want a line naming H (%d): '%s'", (int)h.pid, out);
    printf("note: %s", out);
    CHECK(owner_cmd(ans, "R"), "resume after vmmctl pause: %s", ans);

    /* by tag: O holds only "other"'s memory, H only the first buffer's */
    uint64_t o_addr = 0;
    int o_buf = -1;
    CHECK(owner_cmd(ans, "g other"), "thread tag: %s", ans);
    if (ans[0] == 'o') o_buf = alloc_filled('a', 4 * MIB, 7, &o_addr);
    CHECK(owner_cmd(ans, "g"), "thread tag cleared: %s", ans);
    CHECK(o_buf >= 0, "the owner could not allocate under tag other");
    vmm_alloc_info oi;
    CHECK(o_buf >= 0 && vmm_find(reg, (uint32_t)g_pid, o_addr, &oi) == VMM_OK && strcmp(oi.tag, "other") == 0,
          "the buffer's tag is '%s', want 'other'", o_buf >= 0 ? oi.tag : "?");
    CHECK(tell(&h, 'i'), "H could not import the resumed memory");
    CHECK(start(&o, o_addr, 'H'), "companion O could not import the other tag's buffer");
    p = pause_held_tag("other");
    CHECK(p.ok && p.n == 1 && p.pids[0] == (unsigned)o.pid && p.held >= 4 * MIB,
          "in-process pause of tag other: want exactly O (%d), not H (%d): %s", (int)o.pid, (int)h.pid, p.line);
    CHECK(owner_cmd(ans, "R other"), "resume of tag other: %s", ans);
    CHECK(tell(&o, 'i'), "O could not import the resumed buffer");
    st = remote_pause(reg, "other", &rep);
    CHECK(st == VMM_OK && only(&rep, o.pid, 4 * MIB),
          "remote pause of tag other: want exactly O (%d), not H (%d): %d, %u holders (%u), %llu bytes held", (int)o.pid,
          (int)h.pid, (int)st, rep.n_holders, rep.holders[0], (unsigned long long)rep.bytes_held);
    CHECK(owner_cmd(ans, "R other"), "second resume of tag other: %s", ans);

    /* an owner that predates the flag: asked again without it; holders unknown, not none */
    CHECK(tell(&h, 'i') && tell(&o, 'i'), "H and O could not import again");
    g_v4_sent = g_v4_flagged = 0;
    g_old_owner = true;
    st = remote_pause(reg, NULL, &rep);
    g_old_owner = false;
    CHECK(st == VMM_OK && rep.bytes_released >= 12 * MIB && rep.allocations == 2,
          "remote pause of an older owner: %d: %s; released %llu of %llu allocations", (int)st, vmm_last_error(),
          (unsigned long long)rep.bytes_released, (unsigned long long)rep.allocations);
    CHECK(rep.flags == VMM_SLEEP_HOLDERS_UNKNOWN && rep.n_holders == 0 && rep.bytes_held == 0 && rep.holders[0] == 0,
          "an older owner's report: flags %u, %u holders, %llu bytes held (want unknown, 0, 0)", rep.flags, rep.n_holders,
          (unsigned long long)rep.bytes_held);
    CHECK(g_v4_sent == 2 && g_v4_flagged == 1, "an older owner: %lu v4 requests, %lu flagged (want 2, the first)",
          g_v4_sent, g_v4_flagged);
    CHECK(owner_cmd(ans, "R"), "resume after the older owner's pause: %s", ans);
    vmm_close(reg);

    comp *all[] = {&h, &r, &i, &z, &r2, &i2, &o};
    for (int n = 0; n < 7; n++) {
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
