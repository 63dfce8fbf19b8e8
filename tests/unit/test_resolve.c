/* The driver surface of the shim and its resolvers, over the emulated driver and runtime:
 * dlsym on a libcuda handle and cuGetProcAddress (both ABIs) hand out the shim's wrappers for
 * exactly the functions it wraps and the driver's own answer (pointer, return code, status) for
 * everything else; a program that reaches the driver only through cuGetProcAddress (as a static
 * runtime does) gets its allocations backed and published exactly once; driver-API semantics
 * are those of a run without the shim; peer access reaches shim memory, existing and new.
 * `test_resolve --child` is this test's own helper: it performs the resolver queries of the
 * table below in a process of its own (run natively, and with the shim preloaded) and prints
 * one line per query. */
#define __CUDA_API_VERSION_INTERNAL 1 /* cuda.h then renames nothing: exact ABI names below */
#include <cuda.h>
#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "spawn.h"
#include "vmmshim.h"

static char build[512], shim[600], registry[64], preload[700], self_exe[600], tmpdir[64];

/* ---- the resolver queries ---- */

enum { Q_DLSYM, Q_GPA2, Q_GPA1, Q_GPA2_NULL_PFN, Q_GPA2_VIA_GPA2 };
#define PTDS CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
#define LEGACY CU_GET_PROC_ADDRESS_LEGACY_STREAM

typedef struct query {
    int kind;
    const char *symbol;
    int version;
    unsigned long long flags;
    const char *wrapped; /* under the shim: the shim's function of this name; NULL: the driver's answer */
} query;

static const query queries[] = {
    /* dlsym(libcuda handle, name): the exact ABI names */
    {Q_DLSYM, "cuMemAlloc_v2", 0, 0, "cuMemAlloc_v2"},
    {Q_DLSYM, "cuMemFree_v2", 0, 0, "cuMemFree_v2"},
    {Q_DLSYM, "cuMemAllocAsync", 0, 0, "cuMemAllocAsync"},
    {Q_DLSYM, "cuMemAllocAsync_ptsz", 0, 0, "cuMemAllocAsync_ptsz"},
    {Q_DLSYM, "cuMemFreeAsync", 0, 0, "cuMemFreeAsync"},
    {Q_DLSYM, "cuMemFreeAsync_ptsz", 0, 0, "cuMemFreeAsync_ptsz"},
    {Q_DLSYM, "cuMemAllocPitch_v2", 0, 0, "cuMemAllocPitch_v2"},
    {Q_DLSYM, "cuMemGetInfo_v2", 0, 0, "cuMemGetInfo_v2"},
    {Q_DLSYM, "cuMemGetAddressRange_v2", 0, 0, "cuMemGetAddressRange_v2"},
    {Q_DLSYM, "cuPointerGetAttribute", 0, 0, "cuPointerGetAttribute"},
    {Q_DLSYM, "cuPointerGetAttributes", 0, 0, "cuPointerGetAttributes"},
    {Q_DLSYM, "cuCtxEnablePeerAccess", 0, 0, "cuCtxEnablePeerAccess"},
    {Q_DLSYM, "cuCtxDisablePeerAccess", 0, 0, "cuCtxDisablePeerAccess"},
    {Q_DLSYM, "cuIpcGetMemHandle", 0, 0, "cuIpcGetMemHandle"},
    {Q_DLSYM, "cuIpcOpenMemHandle_v2", 0, 0, "cuIpcOpenMemHandle_v2"},
    {Q_DLSYM, "cuIpcCloseMemHandle", 0, 0, "cuIpcCloseMemHandle"},
    {Q_DLSYM, "cuMemPoolSetAccess", 0, 0, "cuMemPoolSetAccess"},
    {Q_DLSYM, "cuMemPoolGetAttribute", 0, 0, "cuMemPoolGetAttribute"},
    {Q_DLSYM, "cuMemPoolSetAttribute", 0, 0, "cuMemPoolSetAttribute"},
    {Q_DLSYM, "cuMemPoolTrimTo", 0, 0, "cuMemPoolTrimTo"},
    {Q_DLSYM, "cuDeviceSetMemPool", 0, 0, "cuDeviceSetMemPool"},
    {Q_DLSYM, "cuMemSetMemPool", 0, 0, "cuMemSetMemPool"},
    {Q_DLSYM, "cuMemPoolGetAccess", 0, 0, NULL}, /* the real pool holds what the program set */
    {Q_DLSYM, "cuDeviceGetDefaultMemPool", 0, 0, NULL},
    {Q_DLSYM, "cuMemAllocFromPoolAsync", 0, 0, NULL}, /* explicit pools are never touched */
    {Q_DLSYM, "cuGetProcAddress", 0, 0, "cuGetProcAddress"},
    {Q_DLSYM, "cuGetProcAddress_v2", 0, 0, "cuGetProcAddress_v2"},
    {Q_DLSYM, "cuMemAlloc", 0, 0, NULL}, /* the 32-bit legacy entry point is not the shim's */
    {Q_DLSYM, "cuMemcpy", 0, 0, NULL},
    {Q_DLSYM, "cuCtxGetCurrent", 0, 0, NULL},
    {Q_DLSYM, "cuMemCreate", 0, 0, "cuMemCreate"},
    {Q_DLSYM, "cuMemAllocManaged", 0, 0, NULL},
    {Q_DLSYM, "cuIpcOpenMemHandle", 0, 0, NULL},
    {Q_DLSYM, "cudnnCreate", 0, 0, NULL}, /* absent: NULL, with and without the shim */
    {Q_DLSYM, "cuNoSuchThing", 0, 0, NULL},
    /* cuGetProcAddress_v2(name, version, flags) */
    {Q_GPA2, "cuMemAlloc", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemAlloc_v2"},
    {Q_GPA2, "cuMemAlloc", 3020, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemAlloc_v2"},
    {Q_GPA2, "cuMemAlloc", 2000, CU_GET_PROC_ADDRESS_DEFAULT, NULL}, /* legacy ABI: untouched */
    {Q_GPA2, "cuMemFree", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemFree_v2"},
    {Q_GPA2, "cuMemAllocAsync", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemAllocAsync"},
    {Q_GPA2, "cuMemAllocAsync", 12000, LEGACY, "cuMemAllocAsync"},
    {Q_GPA2, "cuMemAllocAsync", 12000, PTDS, "cuMemAllocAsync_ptsz"},
    {Q_GPA2, "cuMemAllocAsync", 11000, CU_GET_PROC_ADDRESS_DEFAULT, NULL}, /* too old: VERSION_NOT_SUFFICIENT */
    {Q_GPA2, "cuMemAllocAsync", 11000, PTDS, NULL},
    {Q_GPA2, "cuMemFreeAsync", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemFreeAsync"},
    {Q_GPA2, "cuMemFreeAsync", 12000, PTDS, "cuMemFreeAsync_ptsz"},
    {Q_GPA2, "cuMemAllocPitch", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemAllocPitch_v2"},
    {Q_GPA2, "cuMemGetInfo", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemGetInfo_v2"},
    {Q_GPA2, "cuMemGetAddressRange", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemGetAddressRange_v2"},
    {Q_GPA2, "cuPointerGetAttribute", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuPointerGetAttribute"},
    {Q_GPA2, "cuPointerGetAttributes", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuPointerGetAttributes"},
    {Q_GPA2, "cuCtxEnablePeerAccess", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuCtxEnablePeerAccess"},
    {Q_GPA2, "cuCtxDisablePeerAccess", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuCtxDisablePeerAccess"},
    {Q_GPA2, "cuIpcGetMemHandle", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuIpcGetMemHandle"},
    {Q_GPA2, "cuIpcOpenMemHandle", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuIpcOpenMemHandle_v2"},
    {Q_GPA2, "cuIpcCloseMemHandle", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuIpcCloseMemHandle"},
    {Q_GPA2, "cuMemPoolSetAccess", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemPoolSetAccess"},
    {Q_GPA2, "cuMemPoolGetAttribute", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemPoolGetAttribute"},
    {Q_GPA2, "cuMemPoolSetAttribute", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemPoolSetAttribute"},
    {Q_GPA2, "cuMemPoolTrimTo", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemPoolTrimTo"},
    {Q_GPA2, "cuDeviceSetMemPool", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuDeviceSetMemPool"},
    {Q_GPA2, "cuMemSetMemPool", 13000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemSetMemPool"},
    {Q_GPA2, "cuMemSetMemPool", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL}, /* too old: VERSION_NOT_SUFFICIENT */
    {Q_GPA2, "cuMemPoolGetAccess", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA2, "cuMemPoolCreate", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA2, "cuMemAllocFromPoolAsync", 12000, PTDS, NULL},
    {Q_GPA2, "cuGetProcAddress", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuGetProcAddress_v2"},
    {Q_GPA2, "cuGetProcAddress", 11030, CU_GET_PROC_ADDRESS_DEFAULT, "cuGetProcAddress"},
    {Q_GPA2, "cuMemcpy", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA2, "cuMemcpy", 12000, PTDS, NULL},
    {Q_GPA2, "cuCtxGetCurrent", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA2, "cuMemCreate", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemCreate"},
    {Q_GPA2, "cuNoSuchThing", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL}, /* SYMBOL_NOT_FOUND */
    {Q_GPA2, "cudnnCreate", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA2, "cuMemAlloc", 12000, 0x100, NULL}, /* bad flags: the driver's own error */
    {Q_GPA2_NULL_PFN, "cuMemAlloc", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    /* the v1 ABI: no status, a miss is an error */
    {Q_GPA1, "cuMemAlloc", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemAlloc_v2"},
    {Q_GPA1, "cuMemAllocAsync", 12000, PTDS, "cuMemAllocAsync_ptsz"},
    {Q_GPA1, "cuMemFreeAsync", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemFreeAsync"},
    {Q_GPA1, "cuMemAllocAsync", 11000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA1, "cuNoSuchThing", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA1, "cuMemcpy", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA1, "cuGetProcAddress", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuGetProcAddress_v2"},
    {Q_GPA1, "cuMemPoolGetAttribute", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemPoolGetAttribute"},
    /* through the resolver the resolver handed out */
    {Q_GPA2_VIA_GPA2, "cuMemAlloc", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemAlloc_v2"},
    {Q_GPA2_VIA_GPA2, "cuMemAllocAsync", 12000, PTDS, "cuMemAllocAsync_ptsz"},
    {Q_GPA2_VIA_GPA2, "cuMemcpy", 12000, CU_GET_PROC_ADDRESS_DEFAULT, NULL},
    {Q_GPA2_VIA_GPA2, "cuMemPoolSetAccess", 12000, CU_GET_PROC_ADDRESS_DEFAULT, "cuMemPoolSetAccess"},
};
#define N_QUERIES (sizeof queries / sizeof queries[0])

typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);

static void *const SENTINEL = (void *)(uintptr_t)0x5e5e;

/* "file symbol" of a function pointer: the object's base name and the symbol at that address */
static void describe(void *p, char *out, size_t len)
{
    Dl_info info;
    if (!p) snprintf(out, len, "NULL -");
    else if (p == SENTINEL) snprintf(out, len, "untouched -");
    else if (!dladdr(p, &info) || !info.dli_fname) snprintf(out, len, "unknown -");
    else {
        const char *slash = strrchr(info.dli_fname, '/');
        snprintf(out, len, "%s %s", slash ? slash + 1 : info.dli_fname,
                 info.dli_sname && info.dli_saddr == p ? info.dli_sname : "(inside)");
    }
}

/* The helper: each query's line "INDEX RC STATUS FILE SYMBOL". */
static int child(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        printf("dlopen: %s\n", dlerror());
        return 1;
    }
    gpa2_fn gpa2 = NULL;
    gpa1_fn gpa1 = NULL;
    void *g2 = dlsym(h, "cuGetProcAddress_v2"), *g1 = dlsym(h, "cuGetProcAddress");
    memcpy(&gpa2, &g2, sizeof g2);
    memcpy(&gpa1, &g1, sizeof g1);
    if (!gpa2 || !gpa1) {
        printf("no cuGetProcAddress\n");
        return 1;
    }
    for (size_t i = 0; i < N_QUERIES; i++) {
        const query *q = &queries[i];
        void *pfn = SENTINEL;
        int rc = 0, status = -1;
        CUdriverProcAddressQueryResult st = (CUdriverProcAddressQueryResult)-1;
        switch (q->kind) {
        case Q_DLSYM: pfn = dlsym(h, q->symbol); break;
        case Q_GPA2:
            rc = gpa2(q->symbol, &pfn, q->version, q->flags, &st);
            status = (int)st;
            break;
        case Q_GPA2_NULL_PFN:
            rc = gpa2(q->symbol, NULL, q->version, q->flags, &st);
            status = (int)st;
            break;
        case Q_GPA1: rc = gpa1(q->symbol, &pfn, q->version, q->flags); break;
        case Q_GPA2_VIA_GPA2: {
            void *inner = NULL;
            gpa2_fn via = NULL;
            rc = gpa2("cuGetProcAddress", &inner, 12000, 0, &st);
            memcpy(&via, &inner, sizeof inner);
            if (rc == CUDA_SUCCESS && via) {
                rc = via(q->symbol, &pfn, q->version, q->flags, &st);
                status = (int)st;
            }
            break;
        }
        }
        char d[300];
        describe(pfn, d, sizeof d);
        printf("%zu %d %d %s\n", i, rc, status, d);
    }
    /* the same pointer as plain dlsym gives, for a function the shim does not wrap */
    void *a = dlsym(h, "cuMemcpy"), *b = NULL;
    CUdriverProcAddressQueryResult st;
    gpa2("cuMemcpy", &b, 12000, 0, &st);
    printf("cuMemcpy: cuGetProcAddress_v2 == dlsym: %s\n", a && a == b ? "yes" : "no");
    return 0;
}

/* ---- running programs ---- */

static int run(char *const argv[], const char *const env[], char *out, size_t outlen, char *err, size_t errlen)
{
    return spawn_capture(argv, env, out, outlen, err, errlen, 120);
}

/* One counter from a FAKECUDA_COUNTERS_AT_EXIT file; -1 when absent. */
static long long counter(const char *path, const char *name)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[128];
    size_t nl = strlen(name);
    long long v = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, name, nl) && line[nl] == '=') v = atoll(line + nl + 1);
    fclose(f);
    return v;
}

/* The line of output `out` that starts with `prefix`, copied into buf ("" when none). */
static const char *line_of(const char *out, const char *prefix, char *buf, size_t len)
{
    size_t pl = strlen(prefix);
    buf[0] = 0;
    for (const char *l = out; l && *l;) {
        const char *end = strchr(l, '\n');
        size_t ll = end ? (size_t)(end - l) : strlen(l);
        if (ll >= pl && !strncmp(l, prefix, pl)) {
            if (ll >= len) ll = len - 1;
            memcpy(buf, l, ll);
            buf[ll] = 0;
            return buf;
        }
        l = end ? end + 1 : NULL;
    }
    return buf;
}

/* Does `out` hold the observation line "what   value" exactly as driver_api prints it? */
static int has_obs(const char *out, const char *what, const char *value)
{
    char want[256];
    snprintf(want, sizeof want, "%-52s %s\n", what, value);
    return strstr(out, want) != NULL;
}

/* ---- dlsym and cuGetProcAddress ---- */

static void test_resolvers(void)
{
    static char nat[65536], sh[65536], e1[16384], e2[16384];
    char *argv[] = {self_exe, "--child", NULL};
    int r1 = run(argv, NULL, nat, sizeof nat, e1, sizeof e1);
    const char *env[] = {preload, NULL};
    int r2 = run(argv, env, sh, sizeof sh, e2, sizeof e2);
    CHECK(r1 == 0 && r2 == 0, "helper exit codes native %d shim %d\n%s%s---\n%s%s", r1, r2, nat, e1, sh, e2);
    CHECK(strstr(e2, "vmmshim:") == NULL, "the shim printed: %s", e2);
    int compared = 0;
    for (size_t i = 0; i < N_QUERIES; i++) {
        const query *q = &queries[i];
        char key[16], ln[400], ls[400];
        snprintf(key, sizeof key, "%zu ", i);
        line_of(nat, key, ln, sizeof ln);
        line_of(sh, key, ls, sizeof ls);
        int rn = -99, rs = -99, sn = -99, ss = -99;
        char fn[200] = "", symn[200] = "", fs[200] = "", syms[200] = "";
        size_t idx;
        int okn = sscanf(ln, "%zu %d %d %199s %199s", &idx, &rn, &sn, fn, symn) == 5;
        int oks = sscanf(ls, "%zu %d %d %199s %199s", &idx, &rs, &ss, fs, syms) == 5;
        const char *what = q->kind == Q_DLSYM ? "dlsym" : q->kind == Q_GPA1 ? "cuGetProcAddress" : "cuGetProcAddress_v2";
        CHECK(okn && oks, "%s(%s): no answer: native '%s' shim '%s'", what, q->symbol, ln, ls);
        if (!okn || !oks) continue;
        compared++;
        /* the driver's return code and status, always */
        CHECK(rn == rs && sn == ss, "%s(%s, %d, 0x%llx): rc/status native %d/%d, shim %d/%d", what, q->symbol, q->version,
              q->flags, rn, sn, rs, ss);
        CHECK((strcmp(fn, "NULL") == 0) == (strcmp(fs, "NULL") == 0) &&
                  (strcmp(fn, "untouched") == 0) == (strcmp(fs, "untouched") == 0),
              "%s(%s, %d, 0x%llx): pointer native %s, shim %s", what, q->symbol, q->version, q->flags, fn, fs);
        if (q->wrapped) {
            CHECK(strcmp(fn, "libcuda.so.1") == 0 && rn == 0 && (q->kind != Q_DLSYM || strcmp(symn, q->symbol) == 0),
                  "%s(%s, %d, 0x%llx) natively: %s %s rc %d", what, q->symbol, q->version, q->flags, fn, symn, rn);
            CHECK(strcmp(fs, "libvmmshim.so") == 0 && strcmp(syms, q->wrapped) == 0,
                  "%s(%s, %d, 0x%llx) under the shim: %s %s, want libvmmshim.so %s", what, q->symbol, q->version, q->flags,
                  fs, syms, q->wrapped);
        } else {
            CHECK(strcmp(fn, fs) == 0 && strcmp(symn, syms) == 0,
                  "%s(%s, %d, 0x%llx): native %s %s, shim %s %s (want the driver's own answer)", what, q->symbol, q->version,
                  q->flags, fn, symn, fs, syms);
            CHECK(strcmp(fn, "libvmmshim.so") != 0, "natively the shim answered?");
        }
    }
    CHECK_EQ(compared, N_QUERIES);
    /* spot checks of the answers themselves, so that the comparison above is not vacuous */
    char l[400];
    for (size_t i = 0; i < N_QUERIES; i++) {
        char key[16];
        snprintf(key, sizeof key, "%zu ", i);
        line_of(sh, key, l, sizeof l);
        const query *q = &queries[i];
        if (q->kind == Q_GPA2 && q->version == 11000) {
            int rc = -1, status = -1;
            sscanf(l, "%*u %d %d", &rc, &status);
            CHECK(rc == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT && strstr(l, "NULL"),
                  "too-old version under the shim: %s", l);
        }
        if (q->kind == Q_GPA2 && !strcmp(q->symbol, "cuNoSuchThing")) {
            int rc = -1, status = -1;
            sscanf(l, "%*u %d %d", &rc, &status);
            CHECK(rc == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && strstr(l, "NULL"), "%s", l);
        }
        if (q->kind == Q_GPA1 && (!strcmp(q->symbol, "cuNoSuchThing") || q->version == 11000)) {
            int rc = -1;
            sscanf(l, "%*u %d", &rc);
            CHECK(rc == CUDA_ERROR_NOT_FOUND, "v1 miss: %s", l);
        }
        if (q->kind == Q_DLSYM && (!strcmp(q->symbol, "cudnnCreate") || !strcmp(q->symbol, "cuNoSuchThing")))
            CHECK(strstr(l, "NULL") != NULL, "absent name under the shim: %s", l);
        if (q->kind == Q_GPA2 && q->flags == 0x100) {
            int rc = -1;
            sscanf(l, "%*u %d", &rc);
            CHECK(rc == CUDA_ERROR_INVALID_VALUE, "bad flags: %s", l);
        }
    }
    CHECK(strstr(sh, "cuMemcpy: cuGetProcAddress_v2 == dlsym: yes") != NULL, "under the shim:\n%s", sh);
    CHECK(strstr(nat, "cuMemcpy: cuGetProcAddress_v2 == dlsym: yes") != NULL, "native:\n%s", nat);
}

/* ---- a program that reaches the driver only through cuGetProcAddress ---- */

typedef struct prog_run {
    pid_t pid;
    FILE *in, *out;
} prog_run;

static int start(prog_run *r, char *const argv[], const char *const env[])
{
    int pi[2], po[2];
    if (pipe(pi) || pipe(po)) return -1;
    r->pid = fork();
    if (r->pid == 0) {
        dup2(pi[0], 0);
        dup2(po[1], 1);
        close(pi[1]);
        close(po[0]);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        alarm(120);
        execv(argv[0], argv);
        _exit(127);
    }
    close(pi[0]);
    close(po[1]);
    r->in = fdopen(pi[1], "w");
    r->out = fdopen(po[0], "r");
    return r->in && r->out ? 0 : -1;
}

static int finish(prog_run *r)
{
    if (r->in) fclose(r->in);
    if (r->out) fclose(r->out);
    int st;
    waitpid(r->pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* procaddr: start it, read "ready PID A B" and "pattern ...", let `inspect` look, then let it free. */
static void run_procaddr(int under_shim, const char *counters, unsigned long long *a, unsigned long long *b, int *pid,
                         char *pattern, size_t plen, void (*inspect)(int, unsigned long long, unsigned long long))
{
    char prog[600], cnt[300], line[256];
    snprintf(prog, sizeof prog, "%s/progs/procaddr", build);
    snprintf(cnt, sizeof cnt, "FAKECUDA_COUNTERS_AT_EXIT=%s", counters);
    char *argv[] = {prog, NULL};
    const char *env_shim[] = {preload, cnt, NULL}, *env_nat[] = {cnt, NULL};
    prog_run r = {0, NULL, NULL};
    *a = *b = 0;
    *pid = 0;
    pattern[0] = 0;
    if (start(&r, argv, under_shim ? env_shim : env_nat) != 0) {
        CHECK(0, "cannot start procaddr");
        return;
    }
    while (fgets(line, sizeof line, r.out)) {
        if (sscanf(line, "ready %d %llx %llx", pid, a, b) == 3) continue;
        if (!strncmp(line, "pattern ", 8)) {
            snprintf(pattern, plen, "%.60s", line + 8);
            break;
        }
        fprintf(stderr, "procaddr: %s", line);
    }
    CHECK(*pid > 0 && *a && *b, "procaddr (%s) did not get ready", under_shim ? "shim" : "native");
    if (*pid > 0 && inspect) inspect(*pid, *a, *b);
    fprintf(r.in, "go\n");
    fflush(r.in);
    int freed = fgets(line, sizeof line, r.out) && !strncmp(line, "freed", 5);
    CHECK(freed, "procaddr did not free: %s", line);
    if (freed && under_shim) {
        vmm_registry *reg = NULL;
        vmm_alloc_info gone;
        if (vmm_open(registry, &reg) == VMM_OK) {
            CHECK(vmm_find(reg, (uint32_t)*pid, *a, &gone) == VMM_ERR_NOT_FOUND, "freed allocation still published");
            vmm_close(reg);
        }
    }
    int rc = finish(&r);
    CHECK(rc == 0, "procaddr exit %d", rc);
}

static void inspect_published(int pid, unsigned long long a, unsigned long long b)
{
    vmm_registry *reg = NULL;
    CHECK(vmm_open(registry, &reg) == VMM_OK, "open: %s", vmm_last_error());
    if (!reg) return;
    vmm_alloc_info ia, ib;
    CHECK(vmm_find(reg, (uint32_t)pid, a + 4096, &ia) == VMM_OK, "cuMemAlloc'd memory not published: %s", vmm_last_error());
    CHECK(ia.address == a && ia.api == VMM_FROM_CU_MEM_ALLOC && ia.requested_size == 3u << 20 && ia.mapped_size == 4u << 20 && ia.extent == 4u << 20 &&
              (ia.handle_kinds & VMM_KIND_BROKER),
          "cuMemAlloc record: address ok %d api %u requested %llu mapped %llu kinds %u", ia.address == a, ia.api,
          (unsigned long long)ia.requested_size, (unsigned long long)ia.mapped_size, ia.handle_kinds);
    CHECK(vmm_find(reg, (uint32_t)pid, b, &ib) == VMM_OK, "cuMemAllocAsync'd memory not published: %s", vmm_last_error());
    CHECK(ib.address == b && ib.api == VMM_FROM_CU_MEM_ALLOC_ASYNC && ib.requested_size == 1u << 20 &&
              ib.mapped_size == 2u << 20 && (ib.handle_kinds & VMM_KIND_BROKER),
          "cuMemAllocAsync record: api %u requested %llu mapped %llu kinds %u", ib.api, (unsigned long long)ib.requested_size,
          (unsigned long long)ib.mapped_size, ib.handle_kinds);
    vmm_proc_info pi;
    CHECK(vmm_find_proc(reg, (uint32_t)pid, &pi) == VMM_OK && pi.n_allocs == 2, "process record: %llu allocations",
          (unsigned long long)pi.n_allocs);
    /* a companion sees the bytes the program wrote through the resolved cuMemcpyHtoD */
    vmm_imported *imp = NULL;
    CHECK(vmm_import(reg, &ia, &imp) == VMM_OK, "import: %s", vmm_last_error());
    if (imp) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)vmm_import_ptr(imp);
        int same = 1;
        for (size_t i = 0; i < (3u << 20) && same; i++) same = p[i] == (uint8_t)(i * 13 + 7);
        CHECK(same, "the companion does not see the program's bytes");
        vmm_import_release(imp);
    }
    vmm_close(reg);
}

static void test_procaddr(void)
{
    char cn[300], cs[300], pn[64], ps[64];
    unsigned long long a, b;
    int pid;
    snprintf(cn, sizeof cn, "%s/procaddr-native.txt", tmpdir);
    snprintf(cs, sizeof cs, "%s/procaddr-shim.txt", tmpdir);
    run_procaddr(0, cn, &a, &b, &pid, pn, sizeof pn, NULL);
    CHECK(!strncmp(pn, "ok", 2), "native pattern: %s", pn);
    /* natively the driver made both allocations: the counters do count */
    CHECK_EQ(counter(cn, "calls_cuMemAlloc"), 1);
    CHECK_EQ(counter(cn, "calls_cuMemAllocAsync"), 1);
    CHECK_EQ(counter(cn, "calls_cuMemCreate"), 0);
    run_procaddr(1, cs, &a, &b, &pid, ps, sizeof ps, inspect_published);
    CHECK(!strncmp(ps, "ok", 2), "pattern under the shim: %s", ps);
    /* backed exactly once: two cuMemCreate, and neither allocation reached the driver's allocator */
    CHECK_EQ(counter(cs, "calls_cuMemCreate"), 2);
    CHECK_EQ(counter(cs, "calls_cuMemAlloc"), 0);
    CHECK_EQ(counter(cs, "calls_cuMemAllocAsync"), 0);
    CHECK_EQ(counter(cs, "calls_cuMemFree"), 0);
    CHECK_EQ(counter(cs, "calls_cuMemFreeAsync"), 0);
    /* each resolver call of the program reached the driver's resolver once, and only those */
    CHECK(counter(cs, "calls_cuGetProcAddress") == counter(cn, "calls_cuGetProcAddress") &&
              counter(cn, "calls_cuGetProcAddress") > 0,
          "cuGetProcAddress calls: native %lld, shim %lld", counter(cn, "calls_cuGetProcAddress"),
          counter(cs, "calls_cuGetProcAddress"));
}

/* ---- driver-API semantics, and no double wrapping ---- */

static void test_driver_api(void)
{
    static char nat[32768], sh[32768], e1[16384], e2[16384];
    char prog[600], cn[300], cs[300], envn[340], envs[340];
    snprintf(prog, sizeof prog, "%s/progs/driver_api", build);
    snprintf(cn, sizeof cn, "%s/driver_api-native.txt", tmpdir);
    snprintf(cs, sizeof cs, "%s/driver_api-shim.txt", tmpdir);
    snprintf(envn, sizeof envn, "FAKECUDA_COUNTERS_AT_EXIT=%s", cn);
    snprintf(envs, sizeof envs, "FAKECUDA_COUNTERS_AT_EXIT=%s", cs);
    char *argv[] = {prog, NULL};
    const char *env_nat[] = {envn, NULL}, *env_shim[] = {preload, envs, NULL};
    int r1 = run(argv, env_nat, nat, sizeof nat, e1, sizeof e1);
    int r2 = run(argv, env_shim, sh, sizeof sh, e2, sizeof e2);
    CHECK(r1 == 0 && r2 == 0, "exit codes native %d shim %d: %s %s", r1, r2, e1, e2);
    CHECK(strlen(nat) > 2000, "native output too short:\n%s", nat);
    CHECK(strcmp(nat, sh) == 0, "output differs\n--- native\n%s--- shim\n%s", nat, sh);
    CHECK(strstr(e2, "vmmshim:") == NULL, "the shim printed: %s", e2);
    /* the observations the comparison rests on, as the emulated driver answers them */
    CHECK(has_obs(sh, "cuMemAlloc(&p, 1 MiB) without a context", "CUDA_ERROR_INVALID_CONTEXT"), "%s", sh);
    CHECK(has_obs(sh, "  cuMemFree(p + 4096) (interior)", "CUDA_ERROR_INVALID_VALUE"), "%s", sh);
    CHECK(has_obs(sh, "  cuMemFree(p) again (double free)", "CUDA_ERROR_INVALID_VALUE"), "%s", sh);
    CHECK(has_obs(sh, "    range size", "3145728") && has_obs(sh, "    range start is p", "yes"), "%s", sh);
    CHECK(has_obs(sh, "  pitch", "1024") && has_obs(sh, "    size", "37888"), "%s", sh);
    CHECK(has_obs(sh, "cuMemAlloc(&p, 1 TiB)", "CUDA_ERROR_OUT_OF_MEMORY"), "%s", sh);
    CHECK(has_obs(sh, "  free back to where it was", "yes"), "%s", sh);
    /* Natively the driver's allocator makes all 7 cuMemAlloc and 5 cuMemAllocAsync calls.  Under
     * the shim exactly the calls it deliberately passes through reach it, each once: cuMemAlloc
     * without a context, cuMemAlloc(NULL, 1), cuMemAlloc(&p, 0) (the driver's own errors) and the
     * 1 TiB one (no VMM memory for it, so the real allocator decides: the native OOM) = 4; and
     * cuMemAllocAsync without a context, with NULL, with size 0 = 3.  The 3 MiB, 4 KiB and
     * 64 MiB cuMemAlloc and the 5 MiB and 2 MiB cuMemAllocAsync are VMM-backed. */
    CHECK_EQ(counter(cn, "calls_cuMemAlloc"), 7);
    CHECK_EQ(counter(cn, "calls_cuMemAllocAsync"), 5);
    CHECK_EQ(counter(cs, "calls_cuMemAlloc"), 4);
    CHECK_EQ(counter(cs, "calls_cuMemAllocAsync"), 3);
}

static void test_runtime_no_double_wrap(void)
{
    static char nat[16384], sh[16384], e1[16384], e2[16384];
    char prog[600], cn[300], cs[300], envn[340], envs[340];
    snprintf(prog, sizeof prog, "%s/progs/semantics", build);
    snprintf(cn, sizeof cn, "%s/semantics-native.txt", tmpdir);
    snprintf(cs, sizeof cs, "%s/semantics-shim.txt", tmpdir);
    snprintf(envn, sizeof envn, "FAKECUDA_COUNTERS_AT_EXIT=%s", cn);
    snprintf(envs, sizeof envs, "FAKECUDA_COUNTERS_AT_EXIT=%s", cs);
    char *argv[] = {prog, NULL};
    const char *env_nat[] = {envn, NULL}, *env_shim[] = {preload, envs, NULL};
    int r1 = run(argv, env_nat, nat, sizeof nat, e1, sizeof e1);
    int r2 = run(argv, env_shim, sh, sizeof sh, e2, sizeof e2);
    CHECK(r1 == 0 && r2 == 0 && strcmp(nat, sh) == 0, "semantics: rc %d/%d, outputs %s", r1, r2,
          strcmp(nat, sh) ? "differ" : "same");
    /* progs/semantics natively: cudaMalloc of 3 MiB, 1 TiB, 4 KiB and 64 MiB reach cuMemAlloc
     * (cudaMalloc(NULL, 1) and size 0 are answered by the runtime) = 4; cudaMallocAsync of 5 MiB
     * reaches cuMemAllocAsync = 1; cuMemFree: the interior free, the free, the double free,
     * cudaFree of the cudaMallocAsync'd 5 MiB and of the 64 MiB = 5.
     * Under the shim the runtime's allocations go through the shim's cuMemAlloc wrapper too (the
     * emulated runtime calls the exported driver names, NVIDIA's resolves them with
     * cuGetProcAddress): what the shim hands to the runtime must reach the driver exactly once,
     * and what it backs, never.  Only the 1 TiB cudaMalloc is passed through (the device cannot
     * back it, so the real allocator gives the native OOM) = 1 cuMemAlloc, 0 cuMemAllocAsync; the
     * interior and the double free of shim memory are handed to the runtime with a host address
     * so that it produces its own error = 2 cuMemFree; everything else is the shim's. */
    CHECK_EQ(counter(cn, "calls_cuMemAlloc"), 4);
    CHECK_EQ(counter(cn, "calls_cuMemAllocAsync"), 1);
    CHECK_EQ(counter(cn, "calls_cuMemFree"), 5);
    CHECK_EQ(counter(cs, "calls_cuMemAlloc"), 1);
    CHECK_EQ(counter(cs, "calls_cuMemAllocAsync"), 0);
    CHECK_EQ(counter(cs, "calls_cuMemFree"), 2);
    CHECK_EQ(counter(cs, "calls_cuMemFreeAsync"), 0);
}

/* ---- peer access on two emulated devices ---- */

static void test_peer(void)
{
    static char nat[16384], sh[16384], e1[16384], e2[16384];
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/driver_api", build);
    char *argv[] = {prog, "peer", NULL};
    const char *env_nat[] = {"FAKECUDA_DEVICES=2", NULL}, *env_shim[] = {preload, "FAKECUDA_DEVICES=2", NULL};
    int r1 = run(argv, env_nat, nat, sizeof nat, e1, sizeof e1);
    int r2 = run(argv, env_shim, sh, sizeof sh, e2, sizeof e2);
    CHECK(r1 == 0, "native peer run: rc %d\n%s%s", r1, nat, e1);
    CHECK(r2 == 0, "peer run under the shim: rc %d\n%s%s", r2, sh, e2);
    /* the driver's own answers are the same with and without the shim */
    const char *same[] = {"device 1: cuCtxEnablePeerAccess(device 0)", "device 1: cuCtxEnablePeerAccess again",
                          "device 1: cuCtxDisablePeerAccess(device 0)", "device 1: cuCtxDisablePeerAccess again",
                          "  device 0 still reads and writes a"};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        char a[256], b[256];
        line_of(nat, same[i], a, sizeof a);
        line_of(sh, same[i], b, sizeof b);
        CHECK(a[0] && strcmp(a, b) == 0, "'%s' native vs shim:\n%s\n%s", same[i], a, b);
    }
    /* shim memory as cuMemGetAccess sees it: cudaMalloc-style memory is granted to every device
     * that can reach its own, so that any context copies from it as natively (the emulated driver,
     * like an H100, refuses a copy of VMM memory not granted to the current device); enabling and
     * disabling peer access leaves that grant, and device 0 keeps its own */
    struct {
        const char *what, *want;
    } obs[] = {
        {"  a: device 0 access", "READWRITE"},
        {"device 1: cuCtxEnablePeerAccess(device 0)", "CUDA_SUCCESS"},
        {"device 1: cuCtxEnablePeerAccess again", "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"},
        {"  b: device 1 access", "READWRITE"},
        {"device 1: cuCtxDisablePeerAccess(device 0)", "CUDA_SUCCESS"},
        {"  c: device 1 access", "READWRITE"},
        {"  device 0 still reads and writes a", "yes"},
    };
    for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++)
        CHECK(has_obs(sh, obs[i].what, obs[i].want), "want '%s %s' in:\n%s", obs[i].what, obs[i].want, sh);
    /* a's device-1 access, in order: READWRITE before enabling, after, and after disabling; b's too */
    const char *p = sh;
    const char *seq[][2] = {{"  a: device 1 access", "READWRITE"},
                            {"  a: device 1 access", "READWRITE"},
                            {"  a: device 1 access", "READWRITE"},
                            {"  b: device 1 access", "READWRITE"}};
    int ordered = 1;
    for (size_t i = 0; i < sizeof seq / sizeof seq[0] && ordered; i++) {
        char want[256];
        snprintf(want, sizeof want, "%-52s %s\n", seq[i][0], seq[i][1]);
        const char *at = strstr(p, want);
        ordered = at != NULL;
        if (at) p = at + strlen(want);
    }
    CHECK(ordered, "device 1's access to a and b over enable/disable:\n%s", sh);
}


int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--child")) return child();
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(build, sizeof build, "%s", b ? b : "build");
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", build);
    ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
    self_exe[n > 0 ? n : 0] = 0;
    spawn_preload(preload, sizeof preload, shim);
    snprintf(registry, sizeof registry, "/vmmshim-tresolve-%d", (int)getpid());
    setenv("VMMSHIM_REGISTRY", registry, 1);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/vmmshim-tresolve-XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_resolvers();
    test_procaddr();
    test_driver_api();
    test_runtime_no_double_wrap();
    test_peer();
    shm_unlink(registry);
    const char *files[] = {"procaddr-native.txt", "procaddr-shim.txt", "driver_api-native.txt", "driver_api-shim.txt",
                           "semantics-native.txt", "semantics-shim.txt"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[400];
        snprintf(path, sizeof path, "%s/%s", tmpdir, files[i]);
        unlink(path);
    }
    rmdir(tmpdir);
    CHECK_DONE();
}
