/* Injected driver failures, one call at a time, under the shim and in its companions.
 *
 * Each workload (a program of tests/progs: lifecycle with two devices and a companion,
 * semantics, oom on a small device, mempool's three modes) runs once natively and once under the
 * shim with the emulated driver counting its calls by entry point and calling object
 * (FAKECUDA_CALLS_AT_EXIT); the shim's run of lifecycle includes a companion
 * (prog_fault_companion) importing the owner's allocations through its broker while the owner
 * waits at a checkpoint.  The functions swept are the ones the shim called (at every position of
 * every caller, the program's own calls of them too) and every one the companion's client
 * library called: nothing is listed here, so the sweep follows the code.  For each position k
 * the workload runs again with exactly that call failing (FAKECUDA_FAIL=fn/caller@k:1:err, with
 * CUDA_ERROR_UNKNOWN, and with CUDA_ERROR_OUT_OF_MEMORY too for the calls that allocate), and:
 *   - nothing hangs (a timeout) and no sanitizer reports;
 *   - the program's output and exit status are the clean run's (the shim absorbed the failure),
 *     or what native gives: for a call of the program's own, native with the same call failing
 *     (when it makes as many of them natively); for any other, native with some one call
 *     failing with the same error (searched for); a program that dies must die so natively;
 *   - at exit the owner's and the companion's driver hold no more handles, mappings,
 *     reservations, imports, allocations, bytes or allocation fds than native leaves (where
 *     native's pool keeps idle bytes, the shim's pool may keep whole chunks);
 *   - at every checkpoint each registry record of the owner is an allocation the owner lists as
 *     live; after its exit none is left, nor its process record: a process that exits detaches,
 *     so a record left behind would describe memory that no longer exists until gc reclaims it,
 *     which only an owner that died should need;
 *   - the companion gets its bytes or a clean error (a vmm_status with a reason), never wrong
 *     bytes or a broken promise (a handle with an error).
 * The ASan and UBSan builds (SAN set, as by `make test SAN=...`) try the first, second and last
 * position of each function and caller only; the TSan build skips the sweep. */
#include "vmmshim.h"
#include "check.h"
#include "checkpoint.h"
#include "spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_S 30
#define MAX_CALLS 256
#define MAX_LIVE 32
#define SEARCH_CAP 400
#define SHIM_OBJ "libvmmshim.so"

typedef struct workload {
    const char *prog;    /* tests/progs program */
    const char *arg;     /* its one argument, or NULL */
    const char *devices; /* FAKECUDA_DEVICES */
    const char *env;     /* one more variable, or NULL */
    int companion;       /* import at its "allocated" checkpoint */
    const char *vary;    /* lines starting so may hold other numbers under the shim (pool figures) */
} workload;

static const workload WORKLOADS[] = {
    {"lifecycle", NULL, "2", NULL, 1, NULL},
    {"semantics", NULL, "1", NULL, 0, NULL},
    {"oom", NULL, "1", "FAKECUDA_MEM_BYTES=300M", 0, NULL},
    {"mempool", NULL, "1", NULL, 0, "figures"},
    {"mempool", "peer", "2", NULL, 0, NULL},
    {"mempool", "driver", "2", NULL, 0, NULL},
};

/* Driver counters that must come back to what native leaves. */
static const char *const LIVE[] = {"handles_live", "mappings_live", "reservations_live", "imports_live",
                                   "memalloc_live", "ipc_opens_live", "phys_bytes_live", "fds_open"};
#define N_LIVE (sizeof LIVE / sizeof LIVE[0])
enum { L_HANDLES, L_MAPPINGS, L_RESERVATIONS, L_IMPORTS, L_MEMALLOC, L_IPC, L_PHYS, L_FDS };
static const long long NOTHING[N_LIVE]; /* what a companion may leave */

typedef struct call_count {
    char fn[64], caller[64];
    int n;
} call_count;

typedef struct calls {
    call_count c[MAX_CALLS];
    int n;
} calls;

typedef struct run_cfg {
    const workload *w;
    int shim;
    char owner_fail[200];     /* FAKECUDA_FAIL of the owner, "" none */
    char companion_fail[200]; /* of the companion */
    int count;                /* record call counts */
} run_cfg;

typedef struct run_out {
    int rc;            /* exit status, or 128 + signal */
    int timed_out;
    char out[32768];   /* stdout without the checkpoint lines */
    char err[8192];
    long long live[N_LIVE];
    long long injected; /* failures the owner's driver injected */
    char stale[300];   /* the first registry record of memory that does not exist; "" */
    int comp_runs, comp_bad, comp_errors, comp_timed_out;
    char comp_out[4096];
    long long comp_live[N_LIVE];
    long long comp_injected;
    calls owner_calls, comp_calls;
} run_out;

static char g_build[512], g_preload[700], g_registry[64], g_dir[128];
static int g_sampled;

enum { O_ABSORBED, O_AS_NATIVE, O_NATIVE_ERROR, O_REFUSED, O_NOT_REACHED, O_CRASH, O_HANG, O_LEAK, O_STALE,
       O_DIFFERS, O_BROKEN, N_OUTCOMES };
static const char *const OUTCOME[N_OUTCOMES] = {"absorbed",    "as native", "native error", "companion refused",
                                                "not reached", "crash",     "hang",         "leak",
                                                "stale record", "differs",  "companion broken"};
static int g_outcomes[N_OUTCOMES], g_cases;

/* ---- files the emulated driver writes at exit ------------------------------------------------ */

static void path_of(char *out, size_t n, const char *what) { snprintf(out, n, "%s/%s", g_dir, what); }

static void read_counters(const char *what, long long live[N_LIVE], long long *injected)
{
    char path[256], line[128];
    path_of(path, sizeof path, what);
    for (size_t i = 0; i < N_LIVE; i++) live[i] = -1;
    *injected = -1;
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        long long v = atoll(eq + 1);
        for (size_t i = 0; i < N_LIVE; i++)
            if (!strcmp(line, LIVE[i])) live[i] = v;
        if (!strcmp(line, "failures_injected")) *injected = v;
    }
    if (f) fclose(f);
    unlink(path);
}

static void read_calls(const char *what, calls *c)
{
    char path[256];
    path_of(path, sizeof path, what);
    c->n = 0;
    FILE *f = fopen(path, "r");
    while (f && c->n < MAX_CALLS && fscanf(f, "%63s %63s %d", c->c[c->n].fn, c->c[c->n].caller, &c->c[c->n].n) == 3)
        c->n++;
    if (f) fclose(f);
    unlink(path);
}

static int calls_of(const calls *c, const char *fn, const char *caller)
{
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->c[i].fn, fn) && !strcmp(c->c[i].caller, caller)) return c->c[i].n;
    return 0;
}

static int calls_any(const calls *c, const char *fn, const char *caller)
{
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->c[i].fn, fn) && (!caller || !strcmp(c->c[i].caller, caller))) return 1;
    return 0;
}

/* ---- running a workload --------------------------------------------------------------------- */

static int run_companion(const run_cfg *c, run_out *o, int pid, const live_alloc *live, int n_live)
{
    char prog[600], pid_s[16], cnt[300], calls_env[300], fail[260], dev[40], specs[MAX_LIVE][64];
    char *argv[MAX_LIVE + 4];
    snprintf(prog, sizeof prog, "%s/tests/prog_fault_companion", g_build);
    snprintf(pid_s, sizeof pid_s, "%d", pid);
    int n = 0;
    argv[n++] = prog;
    argv[n++] = g_registry;
    argv[n++] = pid_s;
    for (int i = 0; i < n_live; i++) {
        snprintf(specs[i], sizeof specs[i], "0x%llx:%llu:%llx", live[i].address, live[i].size, live[i].sum);
        argv[n++] = specs[i];
    }
    argv[n] = NULL;
    snprintf(cnt, sizeof cnt, "FAKECUDA_COUNTERS_AT_EXIT=%s/companion.cnt", g_dir);
    snprintf(calls_env, sizeof calls_env, "FAKECUDA_CALLS_AT_EXIT=%s/companion.calls", g_dir);
    snprintf(fail, sizeof fail, "FAKECUDA_FAIL=%s", c->companion_fail);
    snprintf(dev, sizeof dev, "FAKECUDA_DEVICES=%s", c->w->devices);
    const char *env[5] = {cnt, dev};
    int e = 2;
    if (c->count) env[e++] = calls_env;
    if (c->companion_fail[0]) env[e++] = fail;
    char out[4096], err[4096];
    int rc = spawn_capture(argv, env, out, sizeof out, err, sizeof err, TIMEOUT_S);
    o->comp_runs++;
    if (rc == 128 + SIGALRM) o->comp_timed_out = 1;
    if (rc != 0 || strstr(err, "Sanitizer") || strstr(err, "runtime error:")) {
        o->comp_bad = 1;
        snprintf(o->comp_out + strlen(o->comp_out), sizeof o->comp_out - strlen(o->comp_out), "[rc %d] %s%s", rc, out,
                 err);
    } else {
        snprintf(o->comp_out + strlen(o->comp_out), sizeof o->comp_out - strlen(o->comp_out), "%s", out);
    }
    for (char *l = out; (l = strstr(l, " error ")); l++) o->comp_errors++;
    if (strstr(out, "bytes differ")) o->comp_bad = 1;
    read_counters("companion.cnt", o->comp_live, &o->comp_injected);
    if (o->comp_injected < 0 && rc == 0) { /* no counters: it never loaded the driver, which holds nothing */
        for (size_t i = 0; i < N_LIVE; i++) o->comp_live[i] = 0;
        o->comp_injected = 0;
    }
    if (c->count) read_calls("companion.calls", &o->comp_calls);
    return rc;
}

/* A checkpoint line: look at the registry, import. */
static void at_checkpoint(const run_cfg *c, run_out *o, char *line)
{
    char name[32];
    int pid = 0;
    live_alloc live[MAX_LIVE];
    int n = checkpoint_parse(line, name, &pid, live, MAX_LIVE);
    if (n < 0 || !c->shim) return;
    checkpoint_registry(g_registry, (uint32_t)pid, live, n, o->stale, sizeof o->stale);
    if (c->w->companion && !strcmp(name, "allocated") && n > 0) run_companion(c, o, pid, live, n);
}

static void set_env(const run_cfg *c)
{
    char v[300];
    setenv("FAKECUDA_DEVICES", c->w->devices, 1);
    setenv("VMMSHIM_CACHE_SIZE", "0", 1);
    setenv("VMMSHIM_GIVE_BACK_MS", "0", 1); /* freed memory goes back at once: only live memory stays */
    setenv("VMMSHIM_REGISTRY", g_registry, 1);
    setenv("VMMSHIM_REGISTRY_CAPACITY", "4096", 1); /* every check walks it all: keep it small */
    snprintf(v, sizeof v, "%s/owner.cnt", g_dir);
    setenv("FAKECUDA_COUNTERS_AT_EXIT", v, 1);
    snprintf(v, sizeof v, "%s/owner.calls", g_dir);
    if (c->count) setenv("FAKECUDA_CALLS_AT_EXIT", v, 1);
    if (c->owner_fail[0]) setenv("FAKECUDA_FAIL", c->owner_fail, 1);
    if (c->w->env) putenv((char *)c->w->env);
    if (c->shim) putenv(g_preload);
}

static void append(char *buf, size_t len, const char *s, size_t n)
{
    size_t used = strlen(buf);
    if (used + n >= len) n = len - used - 1;
    memcpy(buf + used, s, n);
    buf[used + n] = 0;
}

static void drop_digits(char *s)
{
    char *o = s;
    for (; *s; s++)
        if (*s < '0' || *s > '9') *o++ = *s;
    *o = 0;
}

static void run(const run_cfg *c, run_out *o)
{
    memset(o, 0, offsetof(run_out, owner_calls));
    o->owner_calls.n = o->comp_calls.n = 0;
    for (size_t i = 0; i < N_LIVE; i++) o->comp_live[i] = 0;
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/%s", g_build, c->w->prog);
    int pin[2], pout[2], perr[2];
    if (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC)) {
        o->rc = -1;
        return;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        dup2(perr[1], 2);
        set_env(c);
        alarm(TIMEOUT_S);
        char *argv[] = {prog, (char *)c->w->arg, NULL};
        execv(prog, argv);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    close(perr[1]);
    char line[8192];
    size_t ll = 0;
    struct pollfd fds[2] = {{.fd = pout[0], .events = POLLIN}, {.fd = perr[0], .events = POLLIN}};
    time_t deadline = time(NULL) + TIMEOUT_S + 10;
    for (int open_fds = 2; open_fds > 0;) {
        int left = (int)(deadline - time(NULL));
        if (left <= 0 || poll(fds, 2, left * 1000) == 0) {
            kill(pid, SIGKILL);
            o->timed_out = 1;
            break;
        }
        for (int i = 0; i < 2; i++) {
            if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            char buf[4096];
            ssize_t r = read(fds[i].fd, buf, sizeof buf);
            if (r <= 0) {
                close(fds[i].fd);
                fds[i].fd = -1;
                open_fds--;
                continue;
            }
            if (i == 1) {
                append(o->err, sizeof o->err, buf, (size_t)r);
                continue;
            }
            for (ssize_t k = 0; k < r; k++) {
                if (ll < sizeof line - 1) line[ll++] = buf[k];
                if (buf[k] != '\n') continue;
                line[ll] = 0;
                if (!strncmp(line, "checkpoint ", 11)) {
                    at_checkpoint(c, o, line);
                    if (write(pin[1], "go\n", 3) != 3) {
                    }
                } else {
                    if (c->w->vary && !strncmp(line, c->w->vary, strlen(c->w->vary))) drop_digits(line);
                    append(o->out, sizeof o->out, line, strlen(line));
                }
                ll = 0;
            }
        }
    }
    for (int i = 0; i < 2; i++)
        if (fds[i].fd >= 0) close(fds[i].fd);
    close(pin[1]);
    int st = 0;
    waitpid(pid, &st, 0);
    o->rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (o->rc == 128 + SIGALRM) o->timed_out = 1;
    read_counters("owner.cnt", o->live, &o->injected);
    if (c->count) read_calls("owner.calls", &o->owner_calls);
    if (c->shim) checkpoint_registry(g_registry, (uint32_t)pid, NULL, -1, o->stale, sizeof o->stale);
}

/* ---- judging one case ----------------------------------------------------------------------- */

static int sanitizer_report(const char *err) { return strstr(err, "Sanitizer") || strstr(err, "runtime error:"); }

/* live (or -1: unknown) within the reference's.  Where native's pool keeps idle memory at exit
 * (a failed cudaMemPoolTrimTo, say: bytes charged that no allocation or handle accounts for),
 * the shim's pool may keep its chunks as well, each a handle mapped in a reservation of its own. */
static int leaks(const long long *live, const long long *ref, char *why, size_t len, const char *who)
{
    int pool_keeps = ref[L_PHYS] > 0 && ref[L_HANDLES] == 0 && ref[L_MEMALLOC] == 0;
    for (size_t i = 0; i < N_LIVE; i++) {
        long long r = ref[i] < 0 ? 0 : ref[i];
        int chunk_part = i == L_HANDLES || i == L_MAPPINGS || i == L_RESERVATIONS || i == L_PHYS;
        if (pool_keeps && chunk_part && live[L_MAPPINGS] == live[L_RESERVATIONS] &&
            live[L_HANDLES] == live[L_MAPPINGS])
            continue;
        if (live[i] < 0 || live[i] > r) {
            snprintf(why, len, "%s: %s=%lld at exit (native leaves %lld)", who, LIVE[i], live[i], r);
            return 1;
        }
    }
    return 0;
}

/* The errors each call fails with: any call with CUDA_ERROR_UNKNOWN, and the ones that allocate
 * with CUDA_ERROR_OUT_OF_MEMORY too (the shim takes another road for a full device). */
static int errors_for(const char *fn, const char *err[2])
{
    err[0] = "UNKNOWN";
    err[1] = "OUT_OF_MEMORY";
    return !strcmp(fn, "cuMemCreate") || !strncmp(fn, "cuMemAlloc", 10) ? 2 : 1;
}

/* Native with some one call failing with err gives exactly `want`'s output: that call's
 * reference counters in *ref.  Calls of fn are tried first, position k0 first (a call the shim
 * forwards for the program is often the program's k0-th), then the calls the shim forwards
 * (those it makes too: a failure of its own may surface as theirs), then the rest. */
static int native_equivalent(const workload *w, const calls *native, const calls *shim, const char *fn, int k0,
                             const char *err, const run_out *want, run_out *scratch, long long ref[N_LIVE])
{
    int tried = 0;
    for (int pass = 0; pass < 3; pass++)
        for (int i = 0; i < native->n; i++) {
            const call_count *cc = &native->c[i];
            int which = !strcmp(cc->fn, fn) ? 0 : calls_any(shim, cc->fn, SHIM_OBJ) ? 1 : 2;
            if (which != pass) continue;
            int first = pass == 0 && k0 <= cc->n ? k0 : 0;
            for (int j = first ? 0 : 1; j <= cc->n && tried < SEARCH_CAP; j++) {
                int k = j ? j : first; /* k0 first, then every other position */
                if (j && j == first) continue;
                tried++;
                run_cfg c = {.w = w};
                snprintf(c.owner_fail, sizeof c.owner_fail, "%s/%s@%d:1:%s", cc->fn, cc->caller, k, err);
                run(&c, scratch);
                if (scratch->rc == want->rc && !strcmp(scratch->out, want->out)) {
                    memcpy(ref, scratch->live, sizeof scratch->live);
                    return 1;
                }
            }
        }
    return 0;
}

typedef struct baseline {
    const workload *w;
    char name[64]; /* the program and its argument */
    run_out native, shim;
} baseline;

static run_out g_case, g_scratch, g_ref;

/* One case: the owner's k-th call of fn from caller fails with err (owner_side), or the
 * companion's. */
static void judge(const baseline *b, const char *fn, const char *caller, int k, const char *err, int owner_side)
{
    run_cfg c = {.w = b->w, .shim = 1};
    char *spec = owner_side ? c.owner_fail : c.companion_fail, why[8192] = "";
    snprintf(spec, sizeof c.owner_fail, "%s/%s@%d:1:%s", fn, caller, k, err);
    run(&c, &g_case);
    const run_out *o = &g_case;
    long long ref[N_LIVE];
    memcpy(ref, b->native.live, sizeof ref);
    int outcome;
    long long injected = owner_side ? o->injected : o->comp_injected;
    int died = o->rc >= 128 || sanitizer_report(o->err);
    if (o->timed_out || o->comp_timed_out) {
        outcome = O_HANG;
        snprintf(why, sizeof why, "timed out after %d s", TIMEOUT_S);
    } else if (sanitizer_report(o->err)) {
        outcome = O_CRASH;
        snprintf(why, sizeof why, "a sanitizer reported (exit %d)", o->rc);
    } else if (o->comp_bad) {
        outcome = O_BROKEN;
        snprintf(why, sizeof why, "companion: %.500s", o->comp_out);
    } else if (o->stale[0]) {
        outcome = O_STALE;
        snprintf(why, sizeof why, "%.299s", o->stale);
    } else if (injected == 0) {
        outcome = O_NOT_REACHED;
    } else if (o->rc == b->shim.rc && !strcmp(o->out, b->shim.out)) {
        outcome = o->comp_errors ? O_REFUSED : O_ABSORBED;
    } else if (owner_side && strcmp(caller, SHIM_OBJ) && calls_of(&b->native.owner_calls, fn, caller) ==
                                                            calls_of(&b->shim.owner_calls, fn, caller)) {
        /* the program's own call, made as often natively: native with that call failing (a
         * program that dies of its own failed call dies natively too) */
        run_cfg n = {.w = b->w};
        snprintf(n.owner_fail, sizeof n.owner_fail, "%s", c.owner_fail);
        run(&n, &g_ref);
        memcpy(ref, g_ref.live, sizeof ref);
        outcome = g_ref.rc == o->rc && !strcmp(g_ref.out, o->out) ? O_AS_NATIVE : died ? O_CRASH : O_DIFFERS;
        if (outcome != O_AS_NATIVE)
            snprintf(why, sizeof why, "rc %d vs native %d\n--- native\n%.2000s--- shim\n%.2000s", o->rc, g_ref.rc,
                     g_ref.out, o->out);
    } else if (native_equivalent(b->w, &b->native.owner_calls, &b->shim.owner_calls, fn, k, err, o, &g_scratch, ref)) {
        outcome = O_NATIVE_ERROR;
    } else {
        outcome = died ? O_CRASH : O_DIFFERS;
        snprintf(why, sizeof why, "no native run with one call failing gives this (rc %d)\n--- clean\n%.2000s--- now\n%.2000s",
                 o->rc, b->shim.out, o->out);
    }
    if (outcome < O_CRASH && (leaks(o->live, ref, why, sizeof why, "owner") ||
                              leaks(o->comp_live, NOTHING, why, sizeof why, "companion")))
        outcome = O_LEAK;
    g_cases++;
    g_outcomes[outcome]++;
    CHECK(outcome < O_CRASH, "%s: %s fails (%s) at its call %d from %s (%s): %s: %s\n%.1500s", b->name, fn, err, k,
          caller, owner_side ? "owner" : "companion", OUTCOME[outcome], why, o->err);
}

/* Positions to try of n calls: all, or the first, second and last. */
static int next_position(int k, int n) { return !g_sampled || k < 2 || k >= n - 1 ? k + 1 : n; }

/* Every call of cc whose function `functions` shows called from fn_caller (NULL: from anywhere). */
static void sweep_calls(const baseline *b, const calls *cc, const calls *functions, const char *fn_caller,
                        int owner_side, int *cases)
{
    for (int i = 0; i < cc->n; i++) {
        const call_count *x = &cc->c[i];
        if (!calls_any(functions, x->fn, fn_caller)) continue;
        const char *err[2];
        int n_err = errors_for(x->fn, err);
        for (int k = 1; k <= x->n; k = next_position(k, x->n))
            for (int e = 0; e < n_err; e++) {
                judge(b, x->fn, x->caller, k, err[e], owner_side);
                (*cases)++;
            }
    }
}

static void sweep(const workload *w)
{
    static baseline b;
    b.w = w;
    snprintf(b.name, sizeof b.name, "%s%s%s", w->prog, w->arg ? " " : "", w->arg ? w->arg : "");
    const char *name = b.name;
    run_cfg nat = {.w = w, .count = 1}, sh = {.w = w, .shim = 1, .count = 1};
    run(&nat, &b.native);
    run(&sh, &b.shim);
    CHECK(b.native.rc == 0 && b.shim.rc == 0 && !b.shim.timed_out, "%s: clean runs exit %d natively, %d under the shim: %s",
          name, b.native.rc, b.shim.rc, b.shim.err);
    CHECK(strcmp(b.native.out, b.shim.out) == 0, "%s: clean output differs\n--- native\n%s--- shim\n%s", name,
          b.native.out, b.shim.out);
    CHECK(!b.shim.stale[0], "%s: clean run: %s", name, b.shim.stale);
    char why[300] = "";
    CHECK(!leaks(b.shim.live, b.native.live, why, sizeof why, "owner") &&
              !leaks(b.shim.comp_live, NOTHING, why, sizeof why, "companion"),
          "%s: clean run: %s", name, why);
    CHECK(!w->companion || (b.shim.comp_runs == 1 && !b.shim.comp_bad && !b.shim.comp_errors &&
                            strstr(b.shim.comp_out, "import 0 ok")),
          "%s: clean companion: %s", name, b.shim.comp_out);
    CHECK(calls_any(&b.shim.owner_calls, "cuMemCreate", SHIM_OBJ), "%s: the shim made no chunk", name);
    time_t t0 = time(NULL);
    int before = g_cases, owner_cases = 0, comp_cases = 0;
    int before_out[N_OUTCOMES];
    memcpy(before_out, g_outcomes, sizeof before_out);
    /* the functions the shim calls, at every position of every caller (the program's too) */
    sweep_calls(&b, &b.shim.owner_calls, &b.shim.owner_calls, SHIM_OBJ, 1, &owner_cases);
    /* every call of the companion's client library */
    sweep_calls(&b, &b.shim.comp_calls, &b.shim.comp_calls, NULL, 0, &comp_cases);
    char summary[600];
    int o = snprintf(summary, sizeof summary, "stat: %s: %d cases (%d owner, %d companion):", name, g_cases - before,
                     owner_cases, comp_cases);
    for (int i = 0; i < N_OUTCOMES; i++)
        if (g_outcomes[i] - before_out[i])
            o += snprintf(summary + o, sizeof summary - (size_t)o, " %d %s,", g_outcomes[i] - before_out[i], OUTCOME[i]);
    snprintf(summary + o - 1, sizeof summary - (size_t)o + 1, " (%lld s)\n", (long long)(time(NULL) - t0));
    fputs(summary, stdout);
    fflush(stdout);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD"), *san = getenv("SAN");
    if (san && !strcmp(san, "tsan")) {
        printf("skip: under ThreadSanitizer each of the sweep's runs takes seconds, and its workloads are single-threaded "
               "(test_streams runs the threads)\n");
        CHECK_DONE();
    }
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_registry, sizeof g_registry, "/vmmshim-faults-%d", (int)getpid());
    snprintf(g_dir, sizeof g_dir, "/tmp/vmmshim-faults-%d", (int)getpid());
    if (mkdir(g_dir, 0700) != 0 && errno != EEXIST) {
        CHECK(0, "mkdir %s: %s", g_dir, strerror(errno));
        CHECK_DONE();
    }
    g_sampled = san && *san;
    signal(SIGPIPE, SIG_IGN); /* a workload that died still gets its "go" */
    unsetenv("FAKECUDA_FAIL");
    unsetenv("FAKECUDA_CALLS_AT_EXIT");
    for (size_t i = 0; i < sizeof WORKLOADS / sizeof WORKLOADS[0]; i++) sweep(&WORKLOADS[i]);
    printf("stat: %d (call, position) cases%s:", g_cases, g_sampled ? " (sanitizer build: first, second and last positions only)" : "");
    for (int i = 0; i < N_OUTCOMES; i++) printf(" %d %s%s", g_outcomes[i], OUTCOME[i], i + 1 < N_OUTCOMES ? "," : "\n");
    shm_unlink(g_registry);
    rmdir(g_dir);
    CHECK_DONE();
}
