/* The `progs/spans` owner under the shim, driven line by line over pipes, shared by the tests of
 * imports across the pool's segments (test_import_multi, test_import_many).  Its freed segments
 * stay (VMMSHIM_GIVE_BACK_MS and VMMSHIM_CACHE_SIZE high) so a later request can span them.
 * Header-only, for tests/unit only; the test calls spans_setup first. */
#ifndef VMMSHIM_TESTS_SPANSOWNER_H
#define VMMSHIM_TESTS_SPANSOWNER_H
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "spawn.h"
#include "vmmshim.h"

static char g_build[512], g_preload[700], g_reg[64];
static FILE *g_to, *g_from;
static pid_t g_pid;
/* "NAME=value" settings for the next owner only (NULL-ended; this process's environment is
 * left alone, so its own emulated driver and client library read none of them). */
static char *g_owner_env[8];

/* The k-th 64-bit word `w <index> <seed>` writes. */
static inline uint64_t word(uint64_t seed, uint64_t k) { return seed * 0x9e3779b97f4a7c15ull + k; }

/* A test's start: its build (VMMSHIM_TEST_BUILD, else "build"), the shim its owners preload, a
 * registry of its own (/vmmshim-NAME-PID), and no death by a pipe whose owner went away. */
static inline void spans_setup(const char *name)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_reg, sizeof g_reg, "/vmmshim-%s-%d", name, (int)getpid());
    setenv("VMMSHIM_REGISTRY", g_reg, 1);
    signal(SIGPIPE, SIG_IGN);
}

static inline bool spans_start(void)
{
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC)) return false;
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/spans", g_build);
    g_pid = fork();
    if (g_pid < 0) return false;
    if (g_pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        putenv(g_preload);
        for (int i = 0; i < 8 && g_owner_env[i]; i++) putenv(g_owner_env[i]);
        setenv("VMMSHIM_GIVE_BACK_MS", "60000", 1); /* freed segments stay for the next request */
        setenv("VMMSHIM_CACHE_SIZE", "8G", 1);
        alarm(300);
        char *argv[] = {prog, NULL};
        execv(prog, argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    g_to = fdopen(in[1], "w");
    g_from = fdopen(out[0], "r");
    return g_to && g_from;
}

/* The owner asked to quit (its stdin closed) and reaped: its wait status, 0 when it exited with 0
 * (-1: none was started).  Its pipes are closed. */
static inline int spans_quit(void)
{
    if (g_to) {
        fputs("q\n", g_to);
        fclose(g_to);
    }
    int wst = -1;
    if (g_pid > 0 && waitpid(g_pid, &wst, 0) != g_pid) wst = -1;
    if (g_from) fclose(g_from);
    g_to = g_from = NULL;
    g_pid = 0;
    return wst;
}

/* One command and its answer line; true when it is "ok". */
__attribute__((format(printf, 2, 3))) static inline bool owner_cmd(char *answer, const char *fmt, ...)
{
    static char sink[256];
    char *a = answer ? answer : sink;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(g_to, fmt, ap);
    va_end(ap);
    fputc('\n', g_to);
    fflush(g_to);
    a[0] = 0;
    if (!fgets(a, 256, g_from)) return false;
    return strncmp(a, "ok", 2) == 0;
}

/* Allocate with `a` (cudaMalloc) or `A` (cudaMallocAsync); the buffer's index, or -1.  *addr: its
 * address in the owner. */
static inline int owner_alloc_with(char how, uint64_t bytes, uint64_t *addr)
{
    char a[256];
    int idx = -1;
    unsigned long long p = 0;
    if (!owner_cmd(a, "%c %llu", how, (unsigned long long)bytes) || sscanf(a, "ok %d 0x%llx", &idx, &p) != 2) {
        fprintf(stderr, "owner: %s", a);
        return -1;
    }
    *addr = p;
    return idx;
}
/* The emulated device as the owner sees it (`m`): live physical bytes, handles, pinned host buffers
 * (cuMemHostAlloc'd or cuMemHostRegister'd); the pinned buffers made and freed so far (either way),
 * the calls of cuMemcpyDtoHAsync, cuMemcpyHtoDAsync and cuEventRecord, and of cuMemHostRegister. */
typedef struct owner_mem_t {
    unsigned long long phys, handles, host;
    unsigned long long host_made, host_freed, dtoh_async, htod_async, event_records, registered, register_peak;
} owner_mem_t;

static inline owner_mem_t owner_mem(void)
{
    owner_mem_t m;
    memset(&m, 0, sizeof m);
    char a[256];
    if (!owner_cmd(a, "m") || sscanf(a, "ok %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &m.phys, &m.handles, &m.host,
                                     &m.host_made, &m.host_freed, &m.dtoh_async, &m.htod_async, &m.event_records,
                                     &m.registered, &m.register_peak) != 10)
        fprintf(stderr, "owner: m: %s", a);
    return m;
}

/* An owner with these settings ("NAME=value", NULL-ended, at most 7); its stderr, when a path is
 * given, goes to that file. */
static inline bool spans_start_env(char *const *env, const char *stderr_path)
{
    int i = 0;
    for (; env && *env && i < 7; env++) g_owner_env[i++] = *env;
    g_owner_env[i] = NULL;
    int saved = -1;
    if (stderr_path) {
        int fd = open(stderr_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        saved = dup(2);
        dup2(fd, 2);
        close(fd);
    }
    bool ok = spans_start();
    if (saved >= 0) {
        dup2(saved, 2);
        close(saved);
    }
    return ok;
}

/* The same, its stderr to a fresh file made from the mkstemp template path. */
static inline bool owner_logging(char *const *env, char *path)
{
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0) return false;
    close(fd);
    return spans_start_env(env, path);
}

/* What that owner wrote to its stderr (read once it stopped); the file goes. */
static inline void owner_log_read(const char *path, char *text, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(text, 1, cap - 1, f) : 0;
    text[n] = 0;
    if (f) fclose(f);
    unlink(path);
}

/* Allocate and fill with `w <index> <seed>`: the index, or -1. */
static inline int alloc_filled(char how, uint64_t bytes, uint64_t seed, uint64_t *addr)
{
    int idx = owner_alloc_with(how, bytes, addr);
    if (idx < 0 || !owner_cmd(NULL, "w %d %llu", idx, (unsigned long long)seed)) return -1;
    return idx;
}

/* The owner reads buffer idx back and finds what `w <idx> <seed>` wrote. */
static inline bool verify(int idx, uint64_t seed)
{
    char a[256];
    bool ok = owner_cmd(a, "v %d %llu", idx, (unsigned long long)seed);
    if (!ok) fprintf(stderr, "owner: v %d: %s", idx, a);
    return ok;
}
/* The answer to "P <flags> [tag]" / "R [tag]": the report's fields, or the error's status. */
typedef struct sleep_ans {
    int ok, status;
    unsigned long long released, kept, not_shim, segments, allocations;
    char line[256];
} sleep_ans;

static inline sleep_ans sleep_cmd(const char *cmd)
{
    sleep_ans r;
    memset(&r, 0, sizeof r);
    r.ok = owner_cmd(r.line, "%s", cmd);
    if (r.ok)
        sscanf(r.line, "ok %llu %llu %llu %llu %llu", &r.released, &r.kept, &r.not_shim, &r.segments, &r.allocations);
    else
        sscanf(r.line, "error %d", &r.status);
    return r;
}
/* A companion's import of the owner's memory at addr (this process, vmmshim.h's client): its first
 * word, or 0 with *st set.  The mapping stays cached (idle) while the owner holds the chunk. */
static inline uint64_t import_first_word(vmm_registry *reg, uint64_t addr, vmm_status *st)
{
    vmm_alloc_info info;
    *st = vmm_find(reg, (uint32_t)g_pid, addr, &info);
    if (*st != VMM_OK) return 0;
    vmm_imported *imp = NULL;
    if ((*st = vmm_import(reg, &info, &imp)) != VMM_OK) return 0;
    uint64_t w = *(const volatile uint64_t *)(uintptr_t)vmm_import_ptr(imp);
    vmm_import_release(imp);
    return w;
}
#endif
