/* vmmctl keep and release: the command side of a keeper, a companion that holds the memory of
 * the processes it keeps so that it outlives them (shim/registry/layout.h KEEP says how owner and
 * keeper agree).  This file chooses and claims the processes (named, or --all as they appear),
 * starts the broker and the daemon, and asks a keeper to let go (release); keeper.c, below it,
 * holds the memory and watches each process.
 * The registry is written only through shim/registry/keep.h; the rest is the client library. */
#include "vmmshim.h"

#include "broker/broker.h"
#include "core/options.h"
#include "registry/keep.h"
#include "registry/registry.h"

#include "format.h"
#include "vmmctl.h"
#include "keeper.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uthash.h>
#include <utlist.h>

#define DISCOVER_MS 100u       /* --all: how often new processes are looked for */
#define RELEASE_WAIT_MS 5000u  /* vmmctl release: how long the keeper may take */

/* ------------------------------------------------------------------------------------------ */
/* Claiming                                                                                    */

typedef struct slot_find {
    uint32_t pid;
    uint64_t start_time;
} slot_find;

/* The proc slot of (pid, start_time), read; -1 when none. */
static int64_t find_slot(uint32_t pid, uint64_t start_time, vmm_reg_proc *out)
{
    for (uint32_t i = 0; i < vmm__ctl_kp.wreg.hdr->proc_capacity; i++) {
        const vmm_reg_proc *p = (const vmm_reg_proc *)(vmm__ctl_kp.wreg.base + vmm__ctl_kp.wreg.hdr->proc_off) + i;
        if ((uint32_t)__atomic_load_n(&p->claim, __ATOMIC_ACQUIRE) != pid) continue;
        if (vmm__reg_read_proc(&vmm__ctl_kp.wreg, i, out) == 0 && out->pid == pid && out->start_time == start_time) return i;
    }
    return -1;
}

/* Keep process p (alive, found through the client library).  0, or -EBUSY (kept by another
 * keeper: *holder), or another -errno with a reason in err. */
static int claim(const vmm_proc_info *pi, owner **out, uint32_t *holder, char *err, size_t errlen)
{
    *holder = 0;
    vmm_reg_proc p;
    int64_t slot = find_slot(pi->pid, pi->start_time, &p);
    if (slot < 0) {
        snprintf(err, errlen, "pid %u left the registry meanwhile", pi->pid);
        return -ESRCH;
    }
    owner *o = calloc(1, sizeof *o);
    if (!o) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    o->pid = pi->pid;
    o->start_time = pi->start_time;
    o->pidns = pi->pidns;
    snprintf(o->cmdline, sizeof o->cmdline, "%.*s", (int)sizeof o->cmdline - 1, pi->cmdline);
    /* the pidfd first, judged after: if the pid is the owner now, the pidfd is the owner's */
    o->pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pi->pid, 0);
    if (o->pidfd >= 0 && vmm__reg_liveness(pi->pid, pi->start_time, pi->pidns) != VMM__ALIVE) {
        close(o->pidfd);
        free(o);
        snprintf(err, errlen, "pid %u has exited", pi->pid);
        return -ESRCH;
    }
    int rc = vmm__keep_claim(&vmm__ctl_kp.wreg, (uint32_t)slot, &p, vmm__ctl_kp.sock, &o->k, holder, err, errlen);
    if (rc) {
        if (o->pidfd >= 0) close(o->pidfd);
        free(o);
        return rc;
    }
    *out = o;
    return 0;
}

static owner *g_owners; /* the main thread's list */

static bool start_watcher(owner *o)
{
    if (!vmm__ctl_keep_start(o)) return false;
    o->next = g_owners;
    g_owners = o;
    vmm__ctl_keep_event("pid %u: keeping (%s); this keeper is pid %d", o->pid, o->cmdline, (int)getpid());
    return true;
}

static bool kept_here(uint32_t pid, uint64_t start_time)
{
    for (owner *o = g_owners; o; o = o->next)
        if (o->pid == pid && o->start_time == start_time && !__atomic_load_n(&o->done, __ATOMIC_ACQUIRE)) return true;
    return false;
}

/* --all: every living process of the registry not kept yet. */
typedef struct discover_ctx {
    vmm_proc_info *p;
    size_t n, cap;
} discover_ctx;

static int discover_proc(void *ctx, const vmm_proc_info *p)
{
    discover_ctx *d = ctx;
    if (p->alive != VMM_OWNER_ALIVE || p->pid == (uint32_t)getpid() || kept_here(p->pid, p->start_time)) return 0;
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 16;
        vmm_proc_info *m = realloc(d->p, cap * sizeof *m);
        if (!m) return 1;
        d->p = m;
        d->cap = cap;
    }
    d->p[d->n++] = *p;
    return 0;
}

typedef struct refused {
    uint32_t pid;
    uint64_t start_time;
    UT_hash_handle hh;
} refused;
static refused *g_refused; /* --all: processes another keeper keeps, told once */

static void discover(void)
{
    discover_ctx d = {0};
    vmm_foreach_proc(vmm__ctl_kp.reg, discover_proc, &d);
    for (size_t i = 0; i < d.n; i++) {
        refused *r = NULL;
        HASH_FIND(hh, g_refused, &d.p[i].pid, sizeof d.p[i].pid, r);
        if (r && r->start_time == d.p[i].start_time) continue;
        owner *o;
        uint32_t holder;
        char err[300];
        int rc = claim(&d.p[i], &o, &holder, err, sizeof err);
        if (rc == 0 && start_watcher(o)) continue;
        if (rc == 0) { /* no thread: give it back */
            vmm__keep_end(&vmm__ctl_kp.wreg, &o->k);
            if (o->pidfd >= 0) close(o->pidfd);
            free(o);
            continue;
        }
        if (rc == -ESRCH) continue; /* gone meanwhile */
        if ((r = r ? r : calloc(1, sizeof *r)) != NULL) {
            if (!r->pid) {
                r->pid = d.p[i].pid;
                HASH_ADD(hh, g_refused, pid, sizeof r->pid, r);
            }
            r->start_time = d.p[i].start_time;
        }
        vmm__ctl_keep_event("pid %u: not kept: %s", d.p[i].pid, err);
    }
    free(d.p);
}

/* ------------------------------------------------------------------------------------------ */
/* The command                                                                                 */

__attribute__((noreturn)) static void keep_usage(void)
{
    vmm__ctl_usage_error("keep takes PID... or --all, and [--tag T] [--on-exit dump DIR] [--settle MS] [--daemon "
                         "[--log FILE]]");
}

/* The processes named: living, under the shim, kept by nobody.  EXIT_OK or the error printed. */
static int check_named(uint32_t *pids, size_t n, vmm_proc_info *procs, const char *reg_name)
{
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < i; k++)
            if (pids[k] == pids[i]) return vmm__ctl_error("pid %u is named twice", pids[i]);
        vmm_status st = vmm_find_proc(vmm__ctl_kp.reg, pids[i], &procs[i]);
        if (st == VMM_ERR_NOT_FOUND)
            return vmm__ctl_error("pid %u does not run under the shim (no record of it in registry %s)", pids[i],
                                  reg_name);
        if (st != VMM_OK) return vmm__ctl_api_error(st);
        vmm_keeper_info ki;
        if (vmm_keeper_of(vmm__ctl_kp.reg, pids[i], &ki) == VMM_OK)
            return vmm__ctl_error("pid %u is kept already, by keeper pid %u (stop that keeper, or `vmmctl release "
                                  "%u`, first)",
                                  pids[i], ki.keeper_pid, pids[i]);
        if (procs[i].alive == VMM_OWNER_UNKNOWN)
            return vmm__ctl_error("pid %u runs in another pid namespace: this keeper cannot tell when it ends",
                                  pids[i]);
        if (procs[i].alive != VMM_OWNER_ALIVE)
            return vmm__ctl_error("pid %u has exited: its memory went with it (a keeper holds a process's memory "
                                  "from while it lives)",
                                  pids[i]);
    }
    return EXIT_OK;
}

/* --daemon: the parent waits for the child's setup (its output comes through a pipe until the
 * child points stdout and stderr at the log) and exits with its verdict. */
static int daemonize(const char *log, int *relay_out)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) != 0) return vmm__ctl_error("pipe: %s", strerror(errno));
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    if (child < 0) return vmm__ctl_error("fork: %s", strerror(errno));
    if (child > 0) {
        close(pfd[1]);
        FILE *in = fdopen(pfd[0], "r");
        char line[1024];
        bool failed = false, ok = false;
        while (in && fgets(line, sizeof line, in)) {
            if (!strncmp(line, "vmmctl: error: ", 15)) {
                failed = true;
                fputs(line, stderr);
            } else {
                ok = true;
                fputs(line, stdout);
            }
        }
        if (in) fclose(in);
        if (!failed && !ok) return vmm__ctl_error("the keeper (pid %d) ended before it was set up", (int)child);
        exit(failed ? EXIT_PROBLEMS : EXIT_OK);
    }
    close(pfd[0]);
    setsid();
    int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (nul >= 0) dup2(nul, 0);
    dup2(pfd[1], 1);
    dup2(pfd[1], 2);
    /* nothing else of the parent's stays open here: whoever waits for its output gets EOF */
    close_range(3, ~0u, 0);
    int logfd = log ? open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600) : open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (logfd < 0) return vmm__ctl_error("cannot open the log %s: %s", log, strerror(errno));
    *relay_out = logfd;
    return EXIT_OK;
}

static uint32_t *g_pids;
static vmm_proc_info *g_procs;
static bool g_wreg_open;

/* Everything the command made, for a clean exit (the sanitizer builds check it). */
static void keep_cleanup(void)
{
    free(g_pids);
    free(g_procs);
    for (owner *o = g_owners, *next; o; o = next) { /* every watcher was joined */
        next = o->next;
        free(o);
    }
    g_owners = NULL;
    refused *r, *tmp;
    HASH_ITER(hh, g_refused, r, tmp)
    {
        HASH_DEL(g_refused, r);
        free(r);
    }
    if (vmm__ctl_kp.reg) vmm_close(vmm__ctl_kp.reg);
    vmm__ctl_kp.reg = NULL;
    if (g_wreg_open) vmm__reg_close(&vmm__ctl_kp.wreg);
    g_wreg_open = false;
}

static int keep_main(int argc, char **argv)
{
    bool all = false, daemon = false;
    const char *log = NULL;
    uint32_t *pids = g_pids = calloc((size_t)argc + 1, sizeof *pids);
    size_t n = 0;
    if (!pids) return vmm__ctl_error("out of memory");
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--all")) all = true;
        else if (!strcmp(a, "--daemon")) daemon = true;
        else if (!strcmp(a, "--tag") && i + 1 < argc) vmm__ctl_kp.tag = argv[++i];
        else if (!strcmp(a, "--log") && i + 1 < argc) log = argv[++i];
        else if (!strcmp(a, "--settle") && i + 1 < argc) {
            char *end;
            unsigned long v = strtoul(argv[++i], &end, 10);
            if (*end || end == argv[i] || v > 60000) vmm__ctl_usage_error("--settle takes milliseconds, 0..60000");
            vmm__ctl_kp.settle_ms = (unsigned)v;
        } else if (!strcmp(a, "--on-exit") && i + 2 < argc && !strcmp(argv[i + 1], "dump")) {
            vmm__ctl_kp.dump_dir = argv[i + 2];
            i += 2;
        } else if (!strcmp(a, "--on-exit"))
            vmm__ctl_usage_error("--on-exit takes `dump DIR`");
        else if (a[0] == '-')
            vmm__ctl_usage_error("keep: unknown option %s", a);
        else
            pids[n++] = vmm__ctl_parse_pid(a);
    }
    if ((n == 0) == !all) keep_usage();
    if (log && !daemon) vmm__ctl_usage_error("--log goes with --daemon");
    if (vmm__ctl_kp.tag && strlen(vmm__ctl_kp.tag) >= sizeof(((vmm_alloc_info *)0)->tag))
        vmm__ctl_usage_error("--tag: a tag is at most 31 bytes");
    /* the background process does everything, its setup's lines (and errors) relayed */
    int logfd = -1, rc;
    if (daemon && (rc = daemonize(log, &logfd)) != EXIT_OK) return rc;
    /* --all before any process made the registry: wait for it (a keeper started with the job) */
    uint64_t half_made_until = 0; /* a registry being made reads as not valid for a moment */
    for (bool told = false; all; told = true) {
        vmm_status o = vmm_open(vmm__ctl_registry_name(), &vmm__ctl_kp.reg);
        if (o == VMM_OK) break;
        if (o != VMM_ERR_NOT_FOUND) {
            if (!half_made_until) half_made_until = mono_ns() + 2000000000ull;
            if (mono_ns() > half_made_until) break; /* a real error: said below */
        }
        if (!told) vmm__ctl_keep_event("waiting for the registry to be made (by the first process under the shim)");
        sigset_t stop;
        sigemptyset(&stop);
        sigaddset(&stop, SIGINT);
        sigaddset(&stop, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &stop, NULL);
        struct timespec t = {0, 20 * 1000000};
        if (sigtimedwait(&stop, NULL, &t) > 0) return EXIT_OK;
    }
    rc = vmm__ctl_kp.reg ? EXIT_OK : vmm__ctl_open_registry(&vmm__ctl_kp.reg, false);
    if (rc) return rc;
    vmm_registry_info info;
    vmm_status st = vmm_registry_describe(vmm__ctl_kp.reg, &info);
    if (st != VMM_OK) return vmm__ctl_api_error(st);
    vmm_proc_info *procs = g_procs = calloc(n + 1, sizeof *procs);
    if (!procs) return vmm__ctl_error("out of memory");
    if ((rc = check_named(pids, n, procs, info.name)) != EXIT_OK) return rc;
    if (vmm__ctl_kp.dump_dir && mkdir(vmm__ctl_kp.dump_dir, 0700) != 0 && errno != EEXIST)
        return vmm__ctl_error("cannot make the dump directory %s: %s", vmm__ctl_kp.dump_dir, strerror(errno));
    char why[300];
    if (vmm__reg_open(&vmm__ctl_kp.wreg, info.name, VMM__REG_WRITE, 0, getenv("VMMSHIM_REGISTRY_GROUP"), why, sizeof why) != 0)
        return vmm__ctl_error("cannot open registry %s for writing: %s", info.name, why);
    g_wreg_open = true;

    /* Signals go to the main thread's sigtimedwait; every thread starts with them blocked. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* a fd per handle held: a large job has thousands */
    struct rlimit nofile;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &nofile);
    }

    vmm__opt_init(); /* the broker's directory and group, as an owner's broker takes them */
    rc = vmm__broker_start(vmm__ctl_keep_export, vmm__ctl_kp.sock, sizeof vmm__ctl_kp.sock);
    if (rc) return vmm__ctl_error("cannot start the keeper's broker socket: %s", strerror(-rc));
    for (size_t i = 0; i < n; i++) {
        owner *o;
        uint32_t holder;
        int c = claim(&procs[i], &o, &holder, why, sizeof why);
        if (c == 0 && !start_watcher(o)) {
            vmm__keep_end(&vmm__ctl_kp.wreg, &o->k);
            if (o->pidfd >= 0) close(o->pidfd);
            free(o);
            snprintf(why, sizeof why, "cannot start a thread");
            c = -EAGAIN;
        }
        if (c) { /* all or nothing: let go of those claimed */
            __atomic_store_n(&vmm__ctl_kp.stop, 1, __ATOMIC_RELEASE);
            for (owner *w = g_owners; w; w = w->next) pthread_join(w->th, NULL);
            return vmm__ctl_error("%s", why);
        }
    }
    if (all) discover();
    if (daemon) {
        vmm__ctl_keep_event("keeper pid %d runs in the background%s%s", (int)getpid(), log ? "; events go to " : "", log ? log : "");
        fflush(stdout);
        dup2(logfd, 1);
        dup2(logfd, 2);
        close(logfd);
    }
    uint64_t next_discover = mono_ns() + DISCOVER_MS * 1000000ull;
    for (;;) {
        struct timespec t = {0, 20 * 1000000};
        int sig = sigtimedwait(&stop, NULL, &t);
        if (sig > 0) {
            vmm__ctl_keep_event("signal %d: letting go of everything", sig);
            break;
        }
        if (all && mono_ns() >= next_discover) {
            discover();
            next_discover = mono_ns() + DISCOVER_MS * 1000000ull;
        }
        if (!all) {
            bool any = false;
            for (owner *o = g_owners; o; o = o->next) any |= !__atomic_load_n(&o->done, __ATOMIC_ACQUIRE);
            if (!any) break;
        }
    }
    __atomic_store_n(&vmm__ctl_kp.stop, 1, __ATOMIC_RELEASE);
    for (owner *o = g_owners; o; o = o->next) pthread_join(o->th, NULL);
    vmm__ctl_keep_event("keeper pid %d stops", (int)getpid());
    return EXIT_OK;
}

int vmm__ctl_cmd_keep(int argc, char **argv)
{
    int rc = keep_main(argc, argv);
    keep_cleanup();
    return rc;
}

/* vmmctl release PID: ask the keeper of PID to let go, and wait until it has. */
static int release_main(int argc, char **argv)
{
    if (argc != 1 || argv[0][0] == '-') vmm__ctl_usage_error("release takes one PID");
    uint32_t pid = vmm__ctl_parse_pid(argv[0]);
    int rc = vmm__ctl_open_registry(&vmm__ctl_kp.reg, false);
    if (rc) return rc;
    vmm_keeper_info ki;
    vmm_status st = vmm_keeper_of(vmm__ctl_kp.reg, pid, &ki);
    if (st != VMM_OK) return vmm__ctl_api_error(st);
    vmm_proc_info p;
    if ((st = vmm_find_proc(vmm__ctl_kp.reg, pid, &p)) != VMM_OK) return vmm__ctl_api_error(st);
    vmm_registry_info info;
    if ((st = vmm_registry_describe(vmm__ctl_kp.reg, &info)) != VMM_OK) return vmm__ctl_api_error(st);
    char why[300];
    if (vmm__reg_open(&vmm__ctl_kp.wreg, info.name, VMM__REG_READ, 0, NULL, why, sizeof why) != 0)
        return vmm__ctl_error("cannot open registry %s: %s", info.name, why);
    g_wreg_open = true;
    rc = vmm__keep_ask_release(&vmm__ctl_kp.wreg, pid, p.start_time, RELEASE_WAIT_MS);
    if (rc == -ETIMEDOUT)
        return vmm__ctl_error("keeper pid %u did not let go of pid %u within %u s", ki.keeper_pid, pid,
                              RELEASE_WAIT_MS / 1000);
    if (rc == -ENOENT || rc == -ESRCH) return vmm__ctl_error("pid %u is not kept (no keeper holds it)", pid);
    if (rc) return vmm__ctl_error("cannot ask pid %u's keeper to let go: %s", pid, strerror(-rc));
    hbuf h;
    printf("released pid %u: keeper pid %u let go of %llu allocation%s, %s\n", pid, ki.keeper_pid,
           (unsigned long long)ki.held_allocs, ki.held_allocs == 1 ? "" : "s", vmm__ctl_human(ki.held_bytes, &h));
    return EXIT_OK;
}

int vmm__ctl_cmd_release(int argc, char **argv)
{
    int rc = release_main(argc, argv);
    keep_cleanup();
    return rc;
}

