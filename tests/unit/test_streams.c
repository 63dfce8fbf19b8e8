/* Many threads on many streams under the shim (tests/progs/streams.c: stream-ordered and
 * synchronous allocations and frees, events, frees on another thread's stream, work completing
 * late) while threads of this process import the owner's live allocations through its broker
 * and the client library.  No deadlock (a timeout), the owner's bytes intact and its line the
 * same as native's, each import ending in success or a clean "freed since", and nothing left in
 * either driver or in the registry.  Under ThreadSanitizer (the tsan variant) this is the test of
 * the threads of the shim, its pool and broker, and the client library. */
#include "vmmshim.h"
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "checkpoint.h"
#include "spawn.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define TIMEOUT_S 120
#define IMPORTERS 4
#define MAX_SEEN 64

static char g_build[512], g_preload[700], g_registry[64], g_counters[200];
static uint32_t g_owner;
static int g_stop;

typedef struct importer {
    pthread_t th;
    int ok, stale, other;
    char why[300];
} importer;

typedef struct seen {
    vmm_alloc_info a[MAX_SEEN];
    int n;
} seen;

static int collect(void *ctx, const vmm_alloc_info *a)
{
    seen *s = ctx;
    if (a->pid == g_owner && (a->handle_kinds & VMM_KIND_BROKER) && s->n < MAX_SEEN) s->a[s->n++] = *a;
    return 0;
}

static void *import_loop(void *arg)
{
    importer *im = arg;
    vmm_registry *reg = NULL;
    while (vmm_open(g_registry, &reg) != VMM_OK) { /* the owner's shim makes it */
        if (__atomic_load_n(&g_stop, __ATOMIC_ACQUIRE)) return NULL;
        usleep(1000);
    }
    static seen none;
    seen *s = malloc(sizeof *s);
    while (s && !__atomic_load_n(&g_stop, __ATOMIC_ACQUIRE)) {
        *s = none;
        vmm_foreach_alloc(reg, collect, s);
        for (int i = 0; i < s->n; i++) {
            vmm_imported *imp = NULL;
            vmm_status st = i % 4 == 3 ? vmm_import_range(reg, s->a[i].pid, s->a[i].address, s->a[i].requested_size, &imp)
                                       : vmm_import(reg, &s->a[i], &imp);
            if (st == VMM_OK) {
                /* with the emulated driver, device pointers are host addresses */
                volatile const uint8_t *p = (const uint8_t *)(uintptr_t)vmm_import_ptr(imp);
                (void)p[0];
                im->ok++;
                if ((st = vmm_import_release(imp)) != VMM_OK) {
                    im->other++;
                    snprintf(im->why, sizeof im->why, "release: %s", vmm_last_error());
                }
            } else if (st == VMM_ERR_STALE || (i % 4 == 3 && st == VMM_ERR_NOT_FOUND)) {
                im->stale++; /* freed since it was read (a range finds no live record there) */
            } else {
                im->other++;
                snprintf(im->why, sizeof im->why, "import: %s (%d)", vmm_last_error(), (int)st);
            }
        }
        if (!s->n) usleep(1000);
    }
    free(s);
    vmm_close(reg);
    return NULL;
}

/* Run streams with `threads` and `rounds` (under the shim when shim, with importers then). */
static int run_streams(int shim, const char *threads, const char *rounds, char *out, size_t outlen, char *err, size_t errlen,
                       importer *im)
{
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/streams", g_build);
    int pin[2], pout[2], perr[2];
    if (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC)) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        dup2(perr[1], 2);
        setenv("FAKECUDA_COUNTERS_AT_EXIT", g_counters, 1);
        if (shim) putenv(g_preload);
        alarm(TIMEOUT_S);
        char *argv[] = {prog, (char *)threads, (char *)rounds, NULL};
        execv(prog, argv);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    close(perr[1]);
    g_owner = (uint32_t)pid;
    __atomic_store_n(&g_stop, 0, __ATOMIC_RELEASE);
    int started = 0;
    for (int i = 0; shim && i < IMPORTERS; i++) started += pthread_create(&im[i].th, NULL, import_loop, &im[i]) == 0;
    FILE *in = fdopen(pout[0], "r");
    char line[256];
    out[0] = 0;
    while (in && fgets(line, sizeof line, in)) {
        if (!strncmp(line, "checkpoint ", 11)) {
            /* the threads are done: the importers stop while the owner is alive */
            __atomic_store_n(&g_stop, 1, __ATOMIC_RELEASE);
            for (int i = 0; i < started; i++) pthread_join(im[i].th, NULL);
            started = 0;
            if (write(pin[1], "go\n", 3) != 3) break;
        } else if (strlen(out) + strlen(line) < outlen) {
            strcat(out, line);
        }
    }
    __atomic_store_n(&g_stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < started; i++) pthread_join(im[i].th, NULL);
    if (in) fclose(in);
    close(pin[1]);
    ssize_t r = read(perr[0], err, errlen - 1);
    err[r > 0 ? r : 0] = 0;
    close(perr[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static long long counter(const char *name)
{
    char path[256], line[128], want[64];
    snprintf(path, sizeof path, "%s", g_counters);
    snprintf(want, sizeof want, "%s=", name);
    long long v = -1;
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, want, strlen(want))) v = atoll(line + strlen(want));
    if (f) fclose(f);
    return v;
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD"), *san = getenv("SAN");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_registry, sizeof g_registry, "/vmmshim-streams-%d", (int)getpid());
    snprintf(g_counters, sizeof g_counters, "/tmp/vmmshim-streams-%d-counters", (int)getpid());
    setenv("VMMSHIM_REGISTRY", g_registry, 1);
    setenv("VMMSHIM_REGISTRY_CAPACITY", "4096", 1);
    setenv("VMMSHIM_CACHE_SIZE", "0", 1);
    setenv("VMMSHIM_GIVE_BACK_MS", "0", 1); /* freed memory goes back at once: only live memory stays */
    setenv("FAKECUDA_EVENT_DELAY_US", "200", 1); /* work completes late: frees wait on events */
    signal(SIGPIPE, SIG_IGN);
    const char *threads = "8", *rounds = san && *san ? "100" : "300";

    static char nat[1024], sh[1024], e1[8192], e2[8192];
    static importer im[IMPORTERS];
    int r1 = run_streams(0, threads, rounds, nat, sizeof nat, e1, sizeof e1, NULL);
    int r2 = run_streams(1, threads, rounds, sh, sizeof sh, e2, sizeof e2, im);
    CHECK(r1 == 0 && strstr(nat, "failures=0"), "native: rc %d: %s%s", r1, nat, e1);
    CHECK(r2 == 0 && strcmp(nat, sh) == 0, "under the shim: rc %d: %s%s", r2, sh, e2);
    CHECK(!strstr(e2, "ThreadSanitizer") && !strstr(e2, "vmmshim:"), "the owner printed:\n%s", e2);
    int ok = 0, stale = 0;
    for (int i = 0; i < IMPORTERS; i++) {
        CHECK(im[i].other == 0, "importer %d: %d failures, the last: %s", i, im[i].other, im[i].why);
        ok += im[i].ok;
        stale += im[i].stale;
    }
    CHECK(ok > 0, "no import succeeded (%d stale)", stale);
    printf("stat: %s threads x %s rounds on 2 streams each under the shim, %d importer threads: %d imports made, %d "
           "refused as freed meanwhile\n",
           threads, rounds, IMPORTERS, ok, stale);

    static const char *const live[] = {"handles_live", "mappings_live", "reservations_live", "phys_bytes_live",
                                       "memalloc_live", "fds_open"};
    for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) {
        long long v = counter(live[i]);
        CHECK(v == 0, "the owner left %s=%lld at its exit", live[i], v);
    }
    char bad[300] = "";
    checkpoint_registry(g_registry, g_owner, NULL, -1, bad, sizeof bad);
    CHECK(!bad[0], "after the owner's exit: %s", bad);
    /* this process's own driver, through which the client imported */
    CHECK(vmm_import_drop_idle() == VMM_OK, "drop idle: %s", vmm_last_error());
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *sym = lib ? dlsym(lib, "fakecuda_counters") : NULL;
    if (sym) {
        fakecuda_counters_fn counters;
        memcpy(&counters, &sym, sizeof sym);
        struct fakecuda_counters c;
        counters(&c);
        CHECK(c.handles_live == 0 && c.mappings_live == 0 && c.reservations_live == 0 && c.fds_open == 0,
              "the importers left handles %llu mappings %llu reservations %llu fds %llu", c.handles_live, c.mappings_live,
              c.reservations_live, c.fds_open);
    }
    if (lib) dlclose(lib);
    unlink(g_counters);
    shm_unlink(g_registry);
    CHECK_DONE();
}
