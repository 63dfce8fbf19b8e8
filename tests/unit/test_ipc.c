/* Legacy CUDA IPC emulated for shim memory: progs/ipc_pair run under the real shim over the
 * emulated driver and runtime.  Handles of shim memory open in another process (the same
 * pointer for repeated opens, counted closes), a damaged handle and a stale one are refused, a
 * dead owner's handle fails at once, and handles the shim did not make reach the real
 * functions: with the shim disabled, or on memory it passed through, the output equals a run
 * without the shim.  progs/ipc_chunks shares three small allocations, as a framework shares small
 * tensors: each opens at its own pointer with its own bytes, closing one leaves the others, and
 * where the shim placed them in one chunk (its pool) they open at the owner's distances apart.
 * `test_ipc driver HEX` is this test's own helper for the driver route. */
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backing/ipc.h"
#include "check.h"
#include "spawn.h"
#include "registry/registry.h"
#include "vmmshim.h"

static char build[512], shim[600], registry[64], preload[700], prog[600], chunks_prog[600], self_exe[600];

static int run(char *const argv[], const char *const env[], char *out, size_t outlen, char *err, size_t errlen)
{
    return spawn_capture(argv, env, out, outlen, err, errlen, 60);
}

/* The result printed for observation `what` ("<prefix><what>   <result>"), or "(missing)". */
static const char *result_of(const char *out, const char *prefix, const char *what, char *buf, size_t len)
{
    size_t pl = strlen(prefix), wl = strlen(what);
    for (const char *line = out; *line;) {
        const char *end = strchr(line, '\n');
        size_t ll = end ? (size_t)(end - line) : strlen(line);
        if (ll > pl + wl && !strncmp(line, prefix, pl) && !strncmp(line + pl, what, wl) && line[pl + wl] == ' ') {
            const char *v = line + pl + wl;
            while (*v == ' ') v++;
            size_t vl = (size_t)(line + ll - v);
            if (!memchr(v, ' ', vl)) { /* else `what` was only the start of a longer label */
                if (vl >= len) vl = len - 1;
                memcpy(buf, v, vl);
                buf[vl] = 0;
                return buf;
            }
        }
        line += ll + (end ? 1 : 0);
    }
    snprintf(buf, len, "(missing)");
    return buf;
}

#define CHECK_SAW(out, prefix, what, want)                                                            \
    do {                                                                                              \
        char got_[128];                                                                               \
        result_of(out, prefix, what, got_, sizeof got_);                                              \
        CHECK(strcmp(got_, want) == 0, "%s%s: want %s, got %s", prefix, what, want, got_);          \
    } while (0)

static unsigned char pattern1(size_t k) { return (unsigned char)(k * 13 + 5); }

/* ---- the pair under the shim ---- */

static void test_pair(void)
{
    static char out[16384], err[16384];
    char *argv[] = {prog, NULL};
    const char *env[] = {preload, NULL};
    int rc = run(argv, env, out, sizeof out, err, sizeof err);
    CHECK(rc == 0, "ipc_pair exited %d\n%s%s", rc, out, err);
    static const char *const want[][2] = {
        {"parent cudaMalloc 3 MiB", "cudaSuccess"},
        {"parent cudaMemcpy pattern in", "cudaSuccess"},
        {"parent cudaIpcGetMemHandle(base)", "cudaSuccess"},
        {"parent cudaIpcGetMemHandle(base + 12345)", "cudaSuccess"},
        {"parent opens its own handle", "cudaErrorInvalidValue"},
        {"child cudaIpcOpenMemHandle", "cudaSuccess"},
        {"child cudaIpcOpenMemHandle again", "cudaSuccess"},
        {"open twice: same pointer", "ok"},
        {"child opens the interior pointer's handle", "cudaSuccess"},
        {"interior pointer's handle: same pointer", "ok"},
        {"child cudaMemcpy out", "cudaSuccess"},
        {"child reads the parent's pattern", "ok"},
        {"child cudaMemcpy second pattern in", "cudaSuccess"},
        {"child cudaDeviceSynchronize", "cudaSuccess"},
        {"child cudaIpcCloseMemHandle (interior)", "cudaSuccess"},
        {"child cudaIpcCloseMemHandle", "cudaSuccess"},
        {"child cudaIpcCloseMemHandle again", "cudaSuccess"},
        {"child cudaIpcCloseMemHandle once too often", "cudaErrorInvalidValue"},
        {"child opens a corrupted handle", "cudaErrorInvalidValue"},
        {"  cudaGetLastError after the corrupted handle", "cudaErrorInvalidValue"},
        {"child opens random bytes", "cudaErrorNotSupported"}, /* not ours: the real function's answer */
        {"  cudaGetLastError after random bytes", "cudaErrorNotSupported"},
        {"8 threads open at once", "cudaSuccess"},
        {"8 threads open at once: one pointer", "ok"},
        {"8 closes succeed", "ok"},
        {"child exit status", "0"},
        {"parent cudaMemcpy back", "cudaSuccess"},
        {"parent sees the child's writes", "ok"},
        {"parent cudaFree", "cudaSuccess"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) CHECK_SAW(out, "ipc: ", want[i][0], want[i][1]);
    CHECK(strstr(out, "FAILED") == NULL, "an observation failed:\n%s", out);
    CHECK(strstr(err, "vmmshim:") == NULL, "the shim printed: %s", err);
}

/* ---- handles the shim did not make: exactly as without the shim ---- */

static void test_not_ours(void)
{
    static char nat[16384], sh[16384], e1[16384], e2[16384];
    char *argv[] = {prog, NULL};
    int r1 = run(argv, NULL, nat, sizeof nat, e1, sizeof e1);
    const char *disabled[] = {preload, "VMMSHIM_ENABLE=0", NULL};
    int r2 = run(argv, disabled, sh, sizeof sh, e2, sizeof e2);
    CHECK(r1 == 0 && r2 == 0 && strcmp(nat, sh) == 0, "VMMSHIM_ENABLE=0 differs from native (rc %d %d)\n--- native\n%s--- shim\n%s",
          r1, r2, nat, sh);
    /* the emulated driver's own legacy IPC: handles for cuMemAlloc memory, no opening */
    CHECK_SAW(nat, "ipc: ", "parent cudaIpcGetMemHandle(base)", "cudaSuccess");
    CHECK_SAW(nat, "ipc: ", "child cudaIpcOpenMemHandle", "cudaErrorNotSupported");
    CHECK_SAW(sh, "ipc: ", "parent cudaIpcGetMemHandle(base)", "cudaSuccess");
    CHECK_SAW(sh, "ipc: ", "child cudaIpcOpenMemHandle", "cudaErrorNotSupported");
    CHECK(strstr(e2, "vmmshim") == NULL, "VMMSHIM_ENABLE=0 printed: %s", e2);

    /* memory the shim passed through (no VMM on the device): the real functions throughout */
    const char *novmm[] = {"FAKECUDA_NO_VMM=1", NULL};
    r1 = run(argv, novmm, nat, sizeof nat, e1, sizeof e1);
    const char *novmm_shim[] = {preload, "FAKECUDA_NO_VMM=1", NULL};
    r2 = run(argv, novmm_shim, sh, sizeof sh, e2, sizeof e2);
    CHECK(r1 == 0 && r2 == 0 && strcmp(nat, sh) == 0, "passed-through memory differs from native (rc %d %d)\n--- native\n%s--- shim\n%s",
          r1, r2, nat, sh);
    CHECK_SAW(sh, "ipc: ", "parent cudaIpcGetMemHandle(base)", "cudaSuccess");
}

/* ---- freed before the child opens it ---- */

static void test_stale(void)
{
    static char out[8192], err[8192];
    char mode[] = "stale";
    char *argv[] = {prog, mode, NULL};
    const char *env[] = {preload, NULL};
    int rc = run(argv, env, out, sizeof out, err, sizeof err);
    CHECK(rc == 0, "ipc_pair stale exited %d\n%s%s", rc, out, err);
    CHECK_SAW(out, "ipc: ", "parent cudaIpcGetMemHandle", "cudaSuccess");
    CHECK_SAW(out, "ipc: ", "parent cudaFree before the child opens", "cudaSuccess");
    CHECK_SAW(out, "ipc: ", "parent cudaMalloc 3 MiB again", "cudaSuccess");
    CHECK_SAW(out, "ipc: ", "cudaIpcOpenMemHandle", "cudaErrorInvalidValue");
    CHECK_SAW(out, "ipc: ", "child exit status", "0");
}

/* ---- a long-lived owner: handle layout, opening from elsewhere, the driver route, death ---- */

typedef struct server {
    pid_t pid;
    FILE *in, *out;
    char hex[129];
    unsigned long long addr;
} server;

static int server_start(server *s)
{
    int pi[2], po[2];
    if (pipe(pi) || pipe(po)) return -1;
    s->pid = fork();
    if (s->pid == 0) {
        dup2(pi[0], 0);
        dup2(po[1], 1);
        close(pi[1]);
        close(po[0]);
        putenv(preload);
        char mode[] = "serve";
        char *argv[] = {prog, mode, NULL};
        execv(prog, argv);
        _exit(127);
    }
    close(pi[0]);
    close(po[1]);
    s->in = fdopen(pi[1], "w");
    s->out = fdopen(po[0], "r");
    char line[512];
    while (fgets(line, sizeof line, s->out))
        if (sscanf(line, "handle %128s %llx", s->hex, &s->addr) == 2) return 0;
    return -1;
}

static void hex_bytes(const char *hex, unsigned char b[64])
{
    for (int i = 0; i < 64; i++) {
        unsigned v = 0;
        sscanf(hex + 2 * i, "%2x", &v);
        b[i] = (unsigned char)v;
    }
}

static void check_layout(const server *s)
{
    unsigned char b[64];
    hex_bytes(s->hex, b);
    vmm__ipc_handle h;
    memcpy(&h, b, sizeof h);
    CHECK(memcmp(h.magic, "VMMIPC", 6) == 0 && h.version == VMM__IPC_VERSION && h.zero == 0 && h.flags == 0,
          "handle header: %.6s v%u", h.magic, h.version);
    CHECK(h.pid == (uint32_t)s->pid, "handle pid %u, owner %d", h.pid, (int)s->pid);
    uint64_t start = 0, ns = 0;
    CHECK(vmm__proc_identity((uint32_t)s->pid, &start, &ns) == 0 && h.start_time == start, "start time %llu vs %llu",
          (unsigned long long)h.start_time, (unsigned long long)start);
    CHECK(h.check == vmm__ipc_check(b), "check word");
    vmm_registry *reg = NULL;
    vmm_alloc_info a;
    CHECK(vmm_open(registry, &reg) == VMM_OK, "open: %s", vmm_last_error());
    if (!reg) return;
    /* the owner asked for the handle of an interior pointer: the handle names the allocation */
    CHECK(vmm_find(reg, (uint32_t)s->pid, s->addr + 4096, &a) == VMM_OK, "find: %s", vmm_last_error());
    CHECK(a.address == s->addr && a.slot == h.slot && a.generation == h.generation &&
              memcmp(a.alloc_id, h.alloc_id, 16) == 0,
          "handle names slot %llu gen %llu, the record is slot %llu gen %llu", (unsigned long long)h.slot,
          (unsigned long long)h.generation, (unsigned long long)a.slot, (unsigned long long)a.generation);
    vmm_close(reg);
}

static void test_owner(void)
{
    server s;
    CHECK(server_start(&s) == 0, "ipc_pair serve did not start");
    if (!s.hex[0]) return;
    check_layout(&s);

    static char out[8192], err[8192];
    char mode[] = "open";
    char *argv[] = {prog, mode, s.hex, NULL};
    const char *env[] = {preload, NULL};
    int rc = run(argv, env, out, sizeof out, err, sizeof err);
    CHECK(rc == 0, "open exited %d\n%s%s", rc, out, err);
    CHECK_SAW(out, "ipc: ", "cudaIpcOpenMemHandle", "cudaSuccess");
    CHECK_SAW(out, "ipc: ", "first 4 KiB hold the owner's pattern", "ok");
    CHECK_SAW(out, "ipc: ", "cudaIpcCloseMemHandle", "cudaSuccess");

    /* a process without the shim hands a vmmshim handle to the real function */
    rc = run(argv, NULL, out, sizeof out, err, sizeof err);
    CHECK_SAW(out, "ipc: ", "cudaIpcOpenMemHandle", "cudaErrorNotSupported");

    /* the driver route, through the shim's exported cuIpc* */
    char drv[] = "driver";
    char *dargv[] = {self_exe, drv, s.hex, NULL};
    rc = run(dargv, env, out, sizeof out, err, sizeof err);
    CHECK(rc == 0, "driver helper exited %d\n%s%s", rc, out, err);
    CHECK_SAW(out, "drv: ", "cuIpcOpenMemHandle is the shim's", "1");
    CHECK_SAW(out, "drv: ", "open without a context", "801"); /* the real function's answer */
    CHECK_SAW(out, "drv: ", "open", "0");
    CHECK_SAW(out, "drv: ", "open again", "0");
    CHECK_SAW(out, "drv: ", "same pointer", "1");
    CHECK_SAW(out, "drv: ", "cuMemcpyDtoH", "0");
    CHECK_SAW(out, "drv: ", "owner's pattern", "1");
    CHECK_SAW(out, "drv: ", "close", "0");
    CHECK_SAW(out, "drv: ", "close again", "0");
    CHECK_SAW(out, "drv: ", "close once too often", "1");
    CHECK_SAW(out, "drv: ", "open a corrupted handle", "1");

    /* the owner dies: its handle fails at once, never hangs */
    kill(s.pid, SIGKILL);
    int st;
    waitpid(s.pid, &st, 0);
    fclose(s.in);
    fclose(s.out);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rc = run(argv, env, out, sizeof out, err, sizeof err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    CHECK(rc == 0, "open after the owner died exited %d\n%s%s", rc, out, err);
    CHECK_SAW(out, "ipc: ", "cudaIpcOpenMemHandle", "cudaErrorInvalidValue");
    CHECK(secs < 10.0, "opening a dead owner's handle took %.1f s", secs);
    printf("stat: opening a dead owner's handle failed in %.3f s\n", secs);
}

/* ---- several small allocations, possibly sharing a chunk ---- */

/* The shim's pool packs the three small allocations into one chunk; every open gets its
 * allocation's own base and bytes, and their pointers in the opener are exactly as far apart as in
 * the owner (one mapping of the chunk, each at its offset). */
static void test_chunks(void)
{
    int pi[2], po[2];
    if (pipe(pi) || pipe(po)) return;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pi[0], 0);
        dup2(po[1], 1);
        close(pi[1]);
        close(po[0]);
        putenv(preload);
        char mode[] = "serve";
        char *argv[] = {chunks_prog, mode, NULL};
        execv(chunks_prog, argv);
        _exit(127);
    }
    close(pi[0]);
    close(po[1]);
    FILE *in = fdopen(pi[1], "w"), *outf = fdopen(po[0], "r");
    char hex[3][129], line[512];
    unsigned long long addr[3];
    size_t size[3];
    int n = 0;
    while (n < 3 && fgets(line, sizeof line, outf))
        if (sscanf(line, "handle %128s %llx %zu", hex[n], &addr[n], &size[n]) == 3) n++;
    CHECK(n == 3, "ipc_chunks serve printed %d handles", n);
    if (n == 3) {
        vmm_registry *reg = NULL;
        vmm_alloc_info a[3];
        int found = 0;
        CHECK(vmm_open(registry, &reg) == VMM_OK, "open: %s", vmm_last_error());
        for (int i = 0; reg && i < 3; i++) {
            vmm_status st = vmm_find(reg, (uint32_t)pid, addr[i], &a[i]);
            CHECK(st == VMM_OK && a[i].address == addr[i], "find buffer %d: %s", i, vmm_last_error());
            found += st == VMM_OK;
        }
        vmm_close(reg);
        bool packed = found == 3 && a[0].chunk_id && a[0].chunk_id == a[1].chunk_id && a[1].chunk_id == a[2].chunk_id;
        printf("stat: the three small allocations %s\n", packed ? "share one chunk" : "are not in one chunk");
        CHECK(packed, "the shim did not pack three small allocations into one chunk");

        static char out[8192], err[8192];
        char mode[] = "open";
        char *argv[] = {chunks_prog, mode, hex[0], hex[1], hex[2], NULL};
        const char *env[] = {preload, NULL};
        int rc = run(argv, env, out, sizeof out, err, sizeof err);
        CHECK(rc == 0, "ipc_chunks open exited %d\n%s%s", rc, out, err);
        static const char *const want[][2] = {
            {"open 0", "cudaSuccess"},
            {"open 1", "cudaSuccess"},
            {"open 2", "cudaSuccess"},
            {"three distinct pointers", "ok"},
            {"buffer 0 holds the owner's pattern", "ok"},
            {"buffer 1 holds the owner's pattern", "ok"}, /* its handle came from an interior pointer */
            {"buffer 2 holds the owner's pattern", "ok"},
            {"buffer 0 written", "cudaSuccess"},
            {"buffer 1 written", "cudaSuccess"},
            {"buffer 2 written", "cudaSuccess"},
            {"close 0", "cudaSuccess"},
            {"buffers 1 and 2 readable with 0 closed", "ok"},
            {"open 1 again", "cudaSuccess"},
            {"open 1 again: same pointer", "ok"},
            {"close 1", "cudaSuccess"},
            {"close 1 again", "cudaSuccess"},
            {"buffer 2 readable with 0 and 1 closed", "ok"},
            {"close 2", "cudaSuccess"},
            {"close 2 once too often", "cudaErrorInvalidValue"},
        };
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) CHECK_SAW(out, "ipc: ", want[i][0], want[i][1]);
        CHECK(strstr(out, "FAILED") == NULL, "an observation failed:\n%s", out);
        CHECK(strstr(err, "vmmshim:") == NULL, "the shim printed: %s", err);
        for (int i = 1; found == 3 && i < 3; i++) {
            if (!a[i].chunk_id || a[i].chunk_id != a[0].chunk_id) continue;
            char key[32], d[64];
            snprintf(key, sizeof key, "distance %d ", i);
            const char *p = strstr(out, key);
            long long got = p ? strtoll(p + strlen(key), NULL, 10) : LLONG_MIN;
            snprintf(d, sizeof d, "%lld", (long long)(addr[i] - addr[0]));
            CHECK(got == (long long)(addr[i] - addr[0]), "buffer %d opened %lld bytes from buffer 0; %s in the owner",
                  i, got, d);
        }
        fprintf(in, "verify\n");
        fflush(in);
        CHECK(fgets(line, sizeof line, outf) && !strncmp(line, "verify ok", 9), "the owner does not see the writes: %s",
              line);
    }
    fclose(in);
    fclose(outf);
    int st;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "ipc_chunks serve: wait status 0x%x", st);
}

/* ---- `test_ipc driver HEX`: run under the shim by test_owner ---- */

#define SYM(var, handle, name)                                                                        \
    do {                                                                                              \
        void *p_ = dlsym(handle, name);                                                               \
        memcpy(&var, &p_, sizeof p_);                                                                 \
        if (!var) {                                                                                   \
            printf("drv: missing %s\n", name);                                                        \
            return 1;                                                                                 \
        }                                                                                             \
    } while (0)

static int driver_helper(const char *hex)
{
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) {
        printf("drv: no libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    CUresult (*init)(unsigned);
    CUresult (*retain)(CUcontext *, CUdevice);
    CUresult (*set_current)(CUcontext);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*open_h)(CUdeviceptr *, CUipcMemHandle, unsigned);
    CUresult (*close_h)(CUdeviceptr);
    SYM(init, cuda, "cuInit");
    SYM(retain, cuda, "cuDevicePrimaryCtxRetain");
    SYM(set_current, cuda, "cuCtxSetCurrent");
    SYM(dtoh, cuda, "cuMemcpyDtoH_v2");
    SYM(open_h, RTLD_DEFAULT, "cuIpcOpenMemHandle_v2"); /* what a driver-API program binds to */
    SYM(close_h, RTLD_DEFAULT, "cuIpcCloseMemHandle");
    Dl_info di;
    void *open_obj;
    memcpy(&open_obj, &open_h, sizeof open_obj);
    printf("drv: %-40s %d\n", "cuIpcOpenMemHandle is the shim's",
           dladdr(open_obj, &di) && di.dli_fname && strstr(di.dli_fname, "libvmmshim") != NULL);
    CUipcMemHandle h;
    unsigned char b[64];
    hex_bytes(hex, b);
    memcpy(h.reserved, b, sizeof b);
    CUdeviceptr p = 0, q = 0;
    printf("drv: %-40s %d\n", "cuInit", (int)init(0));
    printf("drv: %-40s %d\n", "open without a context", (int)open_h(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    CUcontext ctx = NULL;
    if (retain(&ctx, 0) != CUDA_SUCCESS || set_current(ctx) != CUDA_SUCCESS) {
        printf("drv: no context\n");
        return 1;
    }
    CUresult r1 = open_h(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("drv: %-40s %d\n", "open", (int)r1);
    CUresult r2 = open_h(&q, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    printf("drv: %-40s %d\n", "open again", (int)r2);
    printf("drv: %-40s %d\n", "same pointer", r1 == CUDA_SUCCESS && p == q);
    if (r1 == CUDA_SUCCESS) {
        unsigned char buf[4096];
        printf("drv: %-40s %d\n", "cuMemcpyDtoH", (int)dtoh(buf, p, sizeof buf));
        int ok = 1;
        for (size_t k = 0; k < sizeof buf; k++) ok &= buf[k] == pattern1(k);
        printf("drv: %-40s %d\n", "owner's pattern", ok);
        printf("drv: %-40s %d\n", "close", (int)close_h(p));
    }
    if (r2 == CUDA_SUCCESS) printf("drv: %-40s %d\n", "close again", (int)close_h(q));
    printf("drv: %-40s %d\n", "close once too often", (int)close_h(p));
    h.reserved[44] ^= 1;
    printf("drv: %-40s %d\n", "open a corrupted handle", (int)open_h(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    return 0;
}


int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "driver")) return driver_helper(argv[2]);
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(build, sizeof build, "%s", b ? b : "build");
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", build);
    snprintf(prog, sizeof prog, "%s/progs/ipc_pair", build);
    snprintf(chunks_prog, sizeof chunks_prog, "%s/progs/ipc_chunks", build);
    ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
    self_exe[n > 0 ? n : 0] = 0;
    spawn_preload(preload, sizeof preload, shim);
    snprintf(registry, sizeof registry, "/vmmshim-tipc-%d", (int)getpid());
    setenv("VMMSHIM_REGISTRY", registry, 1);
    test_pair();
    test_not_ours();
    test_stale();
    test_owner();
    test_chunks();
    shm_unlink(registry);
    CHECK_DONE();
}
