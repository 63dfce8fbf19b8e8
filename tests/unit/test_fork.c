/* fork() after CUDA started, as PyTorch's DataLoader does (tests/progs/forks.c): a worker that
 * never touches CUDA and one that does, both exiting normally with the parent's atexit handlers.
 * Under the shim the workers must print what they print natively over the emulated driver, and
 * the parent must not notice them: before and after, its records are exactly its live
 * allocations, its broker socket is there, and a companion (prog_fault_companion) imports its
 * bytes through that broker; the workers leave no record and no process record behind, and at
 * the parent's exit its driver holds nothing and the registry nothing of it. */
#include "vmmshim.h"
#include "check.h"
#include "checkpoint.h"
#include "spawn.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_S 60
#define MAX_LIVE 8

static char g_build[512], g_preload[700], g_registry[64], g_counters[200];

typedef struct run_out {
    int pid, rc;
    char out[16384], err[8192];
    int workers[2];
    int checkpoints;
} run_out;

/* At a checkpoint of the parent (under the shim): its records, its broker, an import. */
static void at_checkpoint(run_out *o, char *line)
{
    char name[32], bad[300] = "";
    int pid = 0;
    live_alloc live[MAX_LIVE];
    int n = checkpoint_parse(line, name, &pid, live, MAX_LIVE);
    if (n < 0) return;
    o->checkpoints++;
    CHECK(n == 2, "checkpoint %s: %d live allocations, expected 2", name, n);
    checkpoint_registry(g_registry, (uint32_t)pid, live, n, bad, sizeof bad);
    CHECK(!bad[0], "checkpoint %s: %s", name, bad);
    vmm_registry *reg = NULL;
    vmm_proc_info p;
    CHECK(vmm_open(g_registry, &reg) == VMM_OK && vmm_find_proc(reg, (uint32_t)pid, &p) == VMM_OK,
          "checkpoint %s: the parent's process record: %s", name, vmm_last_error());
    if (reg) {
        struct stat st;
        CHECK(p.broker_path[0] && stat(p.broker_path, &st) == 0 && S_ISSOCK(st.st_mode),
              "checkpoint %s: the parent's broker socket '%s' is gone", name, p.broker_path);
        for (int i = 0; i < n; i++) {
            vmm_alloc_info a;
            CHECK(vmm_find(reg, (uint32_t)pid, live[i].address, &a) == VMM_OK && a.requested_size == live[i].size,
                  "checkpoint %s: the parent's allocation %d is not published", name, i);
        }
        for (int w = 0; !strcmp(name, "after") && w < 2; w++) {
            char none[300] = "";
            checkpoint_registry(g_registry, (uint32_t)o->workers[w], NULL, -1, none, sizeof none);
            CHECK(!none[0], "worker %d: %s", w, none);
        }
        vmm_close(reg);
    }
    char prog[600], pid_s[16], specs[MAX_LIVE][64], out[2048], err[2048], *argv[MAX_LIVE + 4];
    snprintf(prog, sizeof prog, "%s/tests/prog_fault_companion", g_build);
    snprintf(pid_s, sizeof pid_s, "%d", pid);
    int a = 0;
    argv[a++] = prog;
    argv[a++] = g_registry;
    argv[a++] = pid_s;
    for (int i = 0; i < n; i++) {
        snprintf(specs[i], sizeof specs[i], "0x%llx:%llu:%llx", live[i].address, live[i].size, live[i].sum);
        argv[a++] = specs[i];
    }
    argv[a] = NULL;
    int rc = spawn_capture(argv, NULL, out, sizeof out, err, sizeof err, TIMEOUT_S);
    CHECK(rc == 0 && !strstr(out, "error") && !strstr(out, "differ") && strstr(out, "range 1 ok"),
          "checkpoint %s: the companion (rc %d):\n%s%s", name, rc, out, err);
}

/* Run forks (under the shim when shim), answering its checkpoints. */
static void run(int shim, run_out *o)
{
    memset(o, 0, sizeof *o);
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/forks", g_build);
    int pin[2], pout[2], perr[2];
    if (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC)) {
        o->rc = -1;
        return;
    }
    fflush(stdout);
    pid_t pid = o->pid = fork();
    if (pid == 0) {
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        dup2(perr[1], 2);
        setenv("FAKECUDA_COUNTERS_AT_EXIT", g_counters, 1);
        if (shim) putenv(g_preload);
        alarm(TIMEOUT_S);
        char *argv[] = {prog, NULL};
        execv(prog, argv);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    close(perr[1]);
    FILE *in = fdopen(pout[0], "r");
    char line[4096];
    while (in && fgets(line, sizeof line, in)) {
        if (!strncmp(line, "checkpoint ", 11)) {
            if (shim) at_checkpoint(o, line);
            if (write(pin[1], "go\n", 3) != 3) break;
        } else if (sscanf(line, "workers %d %d", &o->workers[0], &o->workers[1]) == 2) {
            continue;
        } else if (strlen(o->out) + strlen(line) < sizeof o->out) {
            strcat(o->out, line);
        }
    }
    if (in) fclose(in);
    close(pin[1]);
    ssize_t r = read(perr[0], o->err, sizeof o->err - 1);
    o->err[r > 0 ? r : 0] = 0;
    close(perr[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    o->rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (shim) {
        char bad[300] = "";
        checkpoint_registry(g_registry, (uint32_t)pid, NULL, -1, bad, sizeof bad);
        CHECK(!bad[0], "after the parent's exit: %s", bad);
    }
}

/* A counter of pid's driver at its exit; -1 when absent. */
static long long counter(int pid, const char *name)
{
    char path[256], line[128], want[64];
    snprintf(path, sizeof path, "%s", g_counters);
    char *p = strstr(path, "%p");
    if (p) snprintf(p, sizeof path - (size_t)(p - path), "%d", pid);
    snprintf(want, sizeof want, "%s=", name);
    long long v = -1;
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, want, strlen(want))) v = atoll(line + strlen(want));
    if (f) fclose(f);
    return v;
}

static void remove_counters(void)
{
    char pattern[256];
    snprintf(pattern, sizeof pattern, "%s", g_counters);
    *strstr(pattern, "%p") = 0;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -f '%s'*", pattern);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s*\n", pattern);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_registry, sizeof g_registry, "/vmmshim-fork-%d", (int)getpid());
    snprintf(g_counters, sizeof g_counters, "/tmp/vmmshim-fork-%d-counters.%%p", (int)getpid());
    setenv("VMMSHIM_REGISTRY", g_registry, 1);
    setenv("VMMSHIM_REGISTRY_CAPACITY", "4096", 1);
    setenv("VMMSHIM_CACHE_SIZE", "0", 1);
    setenv("VMMSHIM_GIVE_BACK_MS", "0", 1); /* freed memory goes back at once: only live memory stays */
    signal(SIGPIPE, SIG_IGN);

    static run_out native, shimmed;
    run(0, &native);
    run(1, &shimmed);
    CHECK(native.rc == 0 && shimmed.rc == 0, "exit natively %d, under the shim %d:\n%s", native.rc, shimmed.rc, shimmed.err);
    CHECK(strstr(native.out, "worker: cudaFree") && strstr(native.out, "worker with CUDA exited with                         0"),
          "the workers did not run:\n%s", native.out);
    CHECK(strcmp(native.out, shimmed.out) == 0, "output differs\n--- native\n%s--- shim\n%s", native.out, shimmed.out);
    CHECK_EQ(shimmed.checkpoints, 2);
    CHECK(!strstr(shimmed.err, "vmmshim:"), "the shim printed: %s", shimmed.err);
    static const char *const live[] = {"handles_live", "mappings_live", "reservations_live", "phys_bytes_live",
                                       "memalloc_live", "fds_open"};
    for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) {
        long long v = counter(shimmed.pid, live[i]);
        CHECK(v == 0, "the parent left %s=%lld at its exit", live[i], v);
    }
    remove_counters();
    shm_unlink(g_registry);
    CHECK_DONE();
}
