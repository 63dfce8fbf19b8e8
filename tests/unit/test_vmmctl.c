/* vmmctl, the real binary ($VMMSHIM_TEST_BUILD/vmmctl), against a registry this test writes:
 * list (rows, human sizes, footer, --pid, --all, --json), ps, check and gc around a SIGKILLed
 * child, config, usage errors (exit 2, one line) and a missing registry (exit 1, one line);
 * the registry named by --registry and by VMMSHIM_REGISTRY.  Allocations that share a chunk (the
 * shim's pool), published by a second child: list counts extents, --json names the chunk, show
 * prints the chunk and its other live allocations. */
#include "registry/registry.h"

#include "core/options.h"

#include "check.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define MiB (1ull << 20)
#define GiB (1ull << 30)

static char vmmctl[4096];
static char reg_name[64];

/* ---- running vmmctl ---- */

typedef struct {
    int status; /* exit code, or 128 + signal */
    char out[65536], err[4096];
} result;

static void slurp(FILE *f, char *buf, size_t len)
{
    rewind(f);
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = 0;
    fclose(f);
}

/* env: "NAME=VALUE" to set, "NAME" to unset; NULL-terminated.  argv excludes argv[0]. */
static void run(result *r, const char *const *env, const char *const *args)
{
    const char *argv[32];
    int n = 0;
    argv[n++] = "vmmctl";
    for (; args[n - 1] && n < 31; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    FILE *o = tmpfile(), *e = tmpfile();
    r->status = -1;
    r->out[0] = r->err[0] = 0;
    if (!o || !e) {
        if (o) fclose(o);
        if (e) fclose(e);
        return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fileno(o), 1);
        dup2(fileno(e), 2);
        for (const char *const *v = env; v && *v; v++) {
            const char *eq = strchr(*v, '=');
            if (eq) {
                char name[128];
                snprintf(name, sizeof name, "%.*s", (int)(eq - *v), *v);
                setenv(name, eq + 1, 1);
            } else {
                unsetenv(*v);
            }
        }
        execv(vmmctl, (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    if (pid > 0) waitpid(pid, &st, 0);
    r->status = pid < 0 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    slurp(o, r->out, sizeof r->out);
    slurp(e, r->err, sizeof r->err);
}

#define RUN(r, env, ...)                                       \
    do {                                                       \
        const char *const args_[] = {__VA_ARGS__, NULL};       \
        run((r), (env), args_);                                \
    } while (0)

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        if (*s == '\n') n++;
    return n;
}

/* Lines of s containing needle. */
static int count_matching(const char *s, const char *needle)
{
    int n = 0;
    while (*s) {
        const char *eol = strchr(s, '\n');
        size_t len = eol ? (size_t)(eol - s) : strlen(s);
        char line[1024];
        snprintf(line, sizeof line, "%.*s", (int)(len < sizeof line ? len : sizeof line - 1), s);
        if (strstr(line, needle)) n++;
        s += len + (eol ? 1 : 0);
    }
    return n;
}

/* The line of s containing needle, or "". */
static const char *line_with(const char *s, const char *needle, char *buf, size_t len)
{
    const char *p = strstr(s, needle);
    buf[0] = 0;
    if (!p) return buf;
    while (p > s && p[-1] != '\n') p--;
    const char *eol = strchr(p, '\n');
    snprintf(buf, len, "%.*s", (int)(eol ? eol - p : (long)strlen(p)), p);
    return buf;
}

/* One line, "vmmctl: error: ...", nothing on stdout. */
static bool one_error_line(const result *r)
{
    return r->out[0] == 0 && strncmp(r->err, "vmmctl: error: ", 15) == 0 && count_lines(r->err) == 1 &&
           r->err[strlen(r->err) - 1] == '\n';
}

/* ---- a small JSON validator: the whole grammar, values skipped, top-level array counted ---- */

typedef struct {
    const char *p;
    bool ok;
} jp;

static void j_ws(jp *j)
{
    while (*j->p == ' ' || *j->p == '\n' || *j->p == '\t' || *j->p == '\r') j->p++;
}

static void j_value(jp *j, int depth);

static void j_string(jp *j)
{
    if (*j->p != '"') {
        j->ok = false;
        return;
    }
    for (j->p++; j->ok && *j->p != '"'; j->p++) {
        unsigned char c = (unsigned char)*j->p;
        if (c < 0x20) j->ok = false;
        if (c == '\\') {
            j->p++;
            if (*j->p == 'u') {
                for (int i = 1; i <= 4; i++)
                    if (!isxdigit((unsigned char)j->p[i])) j->ok = false;
                if (j->ok) j->p += 4;
            } else if (!strchr("\"\\/bfnrt", *j->p) || !*j->p) {
                j->ok = false;
            }
        }
    }
    if (j->ok) j->p++;
}

static void j_number(jp *j)
{
    const char *s = j->p;
    if (*j->p == '-') j->p++;
    if (*j->p == '0')
        j->p++;
    else if (*j->p >= '1' && *j->p <= '9')
        while (isdigit((unsigned char)*j->p)) j->p++;
    else
        j->ok = false;
    if (*j->p == '.') {
        j->p++;
        if (!isdigit((unsigned char)*j->p)) j->ok = false;
        while (isdigit((unsigned char)*j->p)) j->p++;
    }
    if (*j->p == 'e' || *j->p == 'E') {
        j->p++;
        if (*j->p == '+' || *j->p == '-') j->p++;
        if (!isdigit((unsigned char)*j->p)) j->ok = false;
        while (isdigit((unsigned char)*j->p)) j->p++;
    }
    if (j->p == s) j->ok = false;
}

/* Returns the element count of an array or member count of an object. */
static int j_container(jp *j, char open, char close, int depth)
{
    int n = 0;
    j->p++;
    j_ws(j);
    if (*j->p == close) {
        j->p++;
        return 0;
    }
    while (j->ok) {
        j_ws(j);
        if (open == '{') {
            j_string(j);
            j_ws(j);
            if (*j->p != ':') j->ok = false;
            j->p++;
        }
        j_value(j, depth + 1);
        n++;
        j_ws(j);
        if (*j->p == ',') {
            j->p++;
            continue;
        }
        if (*j->p == close) {
            j->p++;
            return n;
        }
        j->ok = false;
    }
    return n;
}

static void j_value(jp *j, int depth)
{
    j_ws(j);
    if (depth > 32) j->ok = false;
    if (!j->ok) return;
    if (*j->p == '{')
        j_container(j, '{', '}', depth);
    else if (*j->p == '[')
        j_container(j, '[', ']', depth);
    else if (*j->p == '"')
        j_string(j);
    else if (!strncmp(j->p, "true", 4) || !strncmp(j->p, "null", 4))
        j->p += 4;
    else if (!strncmp(j->p, "false", 5))
        j->p += 5;
    else
        j_number(j);
}

/* -1 when s is not exactly one valid JSON array, else its element count. */
static int json_array_len(const char *s)
{
    jp j = {s, true};
    j_ws(&j);
    if (*j.p != '[') return -1;
    int n = j_container(&j, '[', ']', 0);
    j_ws(&j);
    return j.ok && *j.p == 0 ? n : -1;
}

/* ---- a child that publishes and waits to be killed ---- */

static pid_t spawn_child(void)
{
    int p[2];
    if (pipe(p) != 0) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        alarm(120);
        vmm__reg w;
        char err[256];
        if (vmm__reg_open(&w, reg_name, VMM__REG_WRITE, 0, NULL, err, sizeof err) != 0 || vmm__reg_attach(&w, "") != 0)
            _exit(3);
        for (int k = 0; k < 2; k++) {
            uint32_t slot;
            vmm_reg_alloc d;
            memset(&d, 0, sizeof d);
            d.requested_size = 512;
            d.api = VMM_API_CU_MEM_ALLOC;
            snprintf(d.tag, sizeof d.tag, "kid%d", k);
            if (vmm__reg_bind(&w, 0x7e0000000000ull + (uint64_t)k * 2 * MiB, 2 * MiB, &slot) != 0 ||
                vmm__reg_publish(&w, slot, &d, NULL) != 0)
                _exit(4);
        }
        if (write(p[1], "k", 1) != 1) _exit(5);
        for (;;) pause();
    }
    close(p[1]);
    char c;
    ssize_t n = pid > 0 ? read(p[0], &c, 1) : -1;
    close(p[0]);
    if (n != 1 && pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return pid;
}

/* ---- a child whose allocations share chunks, as the shim's pool publishes them ---- */

#define POOL_BASE 0x7d0000000000ull

static const struct {
    uint64_t chunk_id, offset, extent, requested;
    const char *tag;
} PACKED[] = {
    {9, 0, 4096, 1000, "p0"},               /* three in chunk 9 */
    {9, 4096, 4096, 4096, "p1"},
    {9, 65536, 65536, 65536, "p2"},
    {10, 0, 8192, 5000, "p3"},              /* alone in chunk 10, which could take more */
    {0, 0, 2 * MiB, MiB, "p4"},             /* its own chunk (a record without a chunk id) */
};
#define N_PACKED (sizeof PACKED / sizeof PACKED[0])

static uint64_t packed_address(size_t i)
{
    uint64_t chunk_base = PACKED[i].chunk_id == 9 ? POOL_BASE : PACKED[i].chunk_id == 10 ? POOL_BASE + 2 * MiB
                                                                                        : POOL_BASE + 4 * MiB;
    return chunk_base + PACKED[i].offset;
}

static pid_t spawn_packed_child(void)
{
    int p[2];
    if (pipe(p) != 0) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        alarm(120);
        vmm__reg w;
        char err[256];
        if (vmm__reg_open(&w, reg_name, VMM__REG_WRITE, 0, NULL, err, sizeof err) != 0 || vmm__reg_attach(&w, "") != 0)
            _exit(3);
        for (size_t k = 0; k < N_PACKED; k++) {
            uint32_t slot;
            vmm_reg_alloc d;
            memset(&d, 0, sizeof d);
            d.requested_size = PACKED[k].requested;
            d.api = VMM_API_CUDA_MALLOC;
            d.handle_kinds = VMM_HANDLE_BROKER;
            if (PACKED[k].chunk_id) {
                d.mapped_size = 2 * MiB;
                d.chunk_id = PACKED[k].chunk_id;
                d.chunk_offset = PACKED[k].offset;
                d.flags = VMM_REG_F_SHARED_CHUNK;
            }
            snprintf(d.tag, sizeof d.tag, "%s", PACKED[k].tag);
            if (vmm__reg_bind(&w, packed_address(k), PACKED[k].extent, &slot) != 0 ||
                vmm__reg_publish(&w, slot, &d, NULL) != 0)
                _exit(4);
        }
        if (write(p[1], "k", 1) != 1) _exit(5);
        for (;;) pause();
    }
    close(p[1]);
    char c;
    ssize_t n = pid > 0 ? read(p[0], &c, 1) : -1;
    close(p[0]);
    if (n != 1 && pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return pid;
}

static void test_packed(const char *reg_opt)
{
    static result r;
    const char *const no_env[] = {NULL};
    char pidbuf[32], addr[32], line[1024];
    pid_t child = spawn_packed_child();
    CHECK(child > 0, "packed child did not start");
    if (child <= 0) return;
    snprintf(pidbuf, sizeof pidbuf, "%d", (int)child);

    /* the rows and the total count extents: the chunks' 2 MiB each would make 10 MiB */
    RUN(&r, no_env, reg_opt, "list", "--pid", pidbuf);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(count_matching(r.out, " 0x7d00"), 5);
    line_with(r.out, "0x7d0000001000", line, sizeof line);
    CHECK(strstr(line, "4.0 KiB    4.0 KiB") && strstr(line, "p1"), "p1's row: %s", line);
    line_with(r.out, "0x7d0000400000", line, sizeof line);
    CHECK(strstr(line, "1.0 MiB    2.0 MiB") && strstr(line, "p4"), "p4's row: %s", line);
    /* 1000 + 4096 + 65536 + 5000 + 1 MiB requested; 4 + 4 + 64 + 8 KiB + 2 MiB held */
    CHECK(strstr(r.out, "\n5 allocations, 1.1 MiB requested, 2.1 MiB mapped\n") != NULL, "packed footer: %s", r.out);
    RUN(&r, no_env, reg_opt, "ps");
    line_with(r.out, pidbuf, line, sizeof line);
    CHECK(strstr(line, "1.1 MiB") && strstr(line, "2.1 MiB"), "ps row of the packed child: %s", line);

    RUN(&r, no_env, reg_opt, "list", "--json", "--pid", pidbuf);
    CHECK(r.status == 0 && json_array_len(r.out) == 5, "packed json: %s", r.out);
    CHECK(strstr(r.out, "\"mapped_size\": 2097152, \"chunk_id\": 9, \"chunk_offset\": 4096, \"extent\": 4096, "
                        "\"shared_chunk\": true,") != NULL,
          "p1's chunk in json: %s", r.out);
    CHECK(strstr(r.out, "\"chunk_id\": 0, \"chunk_offset\": 0, \"extent\": 2097152, \"shared_chunk\": false,") != NULL,
          "p4's own chunk in json: %s", r.out);
    CHECK_EQ(count_matching(r.out, "\"chunk_id\": 9,"), 3);

    /* show: the chunk, and how many other live allocations share it */
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)packed_address(1) + 10);
    RUN(&r, no_env, reg_opt, "show", pidbuf, addr);
    CHECK(r.status == 0 && strstr(r.out, "size         4.0 KiB requested, extent 4.0 KiB\n") &&
              strstr(r.out, "chunk        id 9 at 0x7d0000000000, offset 4096 (0x1000), chunk size 2.0 MiB\n") &&
              strstr(r.out, "sharing      shares its chunk with 2 other live allocations\n") &&
              strstr(r.out, "(offset 10 of the given address)"),
          "show p1: %d %s %s", r.status, r.out, r.err);
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)packed_address(3) + 8191);
    RUN(&r, no_env, reg_opt, "show", pidbuf, addr);
    CHECK(r.status == 0 &&
              strstr(r.out, "chunk        id 10 at 0x7d0000200000, offset 0 (0x0), chunk size 2.0 MiB\n") &&
              strstr(r.out, "sharing      alone in its chunk (others may join it)\n"),
          "show p3: %s", r.out);
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)packed_address(4));
    RUN(&r, no_env, reg_opt, "show", pidbuf, addr);
    CHECK(r.status == 0 && strstr(r.out, "chunk        its own, chunk size 2.0 MiB\n") && !strstr(r.out, "sharing"),
          "show p4: %s", r.out);
    /* past p0's extent and before p1: nobody's */
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)packed_address(2) - 1);
    RUN(&r, no_env, reg_opt, "show", pidbuf, addr);
    CHECK(r.status == 1 && one_error_line(&r) && strstr(r.err, "no live allocation"), "show between allocations: %d %s",
          r.status, r.err);
    /* LEN is bounded by the allocation, never by its chunk (checked before any import) */
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)packed_address(1));
    RUN(&r, no_env, reg_opt, "import-test", pidbuf, addr, "4097");
    CHECK(r.status == 2 && one_error_line(&r) && strstr(r.err, "runs past the allocation (4096 bytes"),
          "import-test LEN past p1: %d %s", r.status, r.err);

    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    RUN(&r, no_env, reg_opt, "gc");
    CHECK(r.status == 0 && strstr(r.out, "reclaimed 5 records from 1 dead process"), "gc of the packed child: %s",
          r.out);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(vmmctl, sizeof vmmctl, "%s/vmmctl", b && *b ? b : "build");
    CHECK(access(vmmctl, X_OK) == 0, "%s is not there", vmmctl);
    if (access(vmmctl, X_OK) != 0) CHECK_DONE();
    snprintf(reg_name, sizeof reg_name, "/vmmshim-tv-%d", (int)getpid());
    shm_unlink(reg_name);
    char reg_opt[96], missing[96], pidbuf[32], line[1024];
    snprintf(reg_opt, sizeof reg_opt, "--registry=%s", reg_name);
    snprintf(missing, sizeof missing, "%s-missing", reg_name);
    const char *const no_env[] = {NULL};
    static result r;

    /* ---- the registry: three allocations of this process ---- */
    vmm__reg w;
    char err[256] = "";
    int rc = vmm__reg_open(&w, reg_name, VMM__REG_CREATE, 256, NULL, err, sizeof err);
    CHECK(rc == 0, "create: %s", err);
    if (rc) CHECK_DONE();
    CHECK_EQ(vmm__reg_attach(&w, "/tmp/vmmshim-tv/broker.sock"), 0);
    struct {
        uint64_t address, mapped, requested;
        uint32_t api, kinds;
        const char *tag;
        vmm_reg_alloc pub;
    } R[3] = {
        {0x7f0000000000ull, 2 * MiB, 4096, VMM_API_CUDA_MALLOC, VMM_HANDLE_BROKER, "alpha", {0}},
        {0x7f0000400000ull, 4 * MiB, 3 * MiB, VMM_API_CUDA_MALLOC_ASYNC, VMM_HANDLE_BROKER | VMM_HANDLE_PIDFD,
         "q\"uo\\te\x01", {0}},
        {0x7f0080000000ull, 2 * GiB, 3 * GiB / 2, VMM_API_CU_MEM_ALLOC_PITCH, 0, "", {0}},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t slot;
        vmm_reg_alloc d;
        memset(&d, 0, sizeof d);
        d.requested_size = R[i].requested;
        d.api = R[i].api;
        d.handle_kinds = R[i].kinds;
        d.exported_fd = 1100;
        snprintf(d.tag, sizeof d.tag, "%s", R[i].tag);
        CHECK_EQ(vmm__reg_bind(&w, R[i].address, R[i].mapped, &slot), 0);
        CHECK_EQ(vmm__reg_publish(&w, slot, &d, &R[i].pub), 0);
    }
    char ids[3][33];
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < 16; k++) snprintf(ids[i] + 2 * k, 3, "%02x", R[i].pub.alloc_id[k]);
    char mypid[16];
    snprintf(mypid, sizeof mypid, "%d", (int)getpid());

    /* ---- help, version ---- */
    RUN(&r, no_env, "--help");
    CHECK(r.status == 0 && strstr(r.out, "usage: vmmctl") && strstr(r.out, "list") && strstr(r.out, "gc"),
          "--help: %d", r.status);
    RUN(&r, no_env, "--version");
    CHECK(r.status == 0 && strstr(r.out, "0.1.0") && count_lines(r.out) == 1, "--version: %d %s", r.status, r.out);

    /* ---- list ---- */
    RUN(&r, no_env, "--registry", reg_name, "list");
    CHECK_EQ(r.status, 0);
    CHECK(r.err[0] == 0, "stderr: %s", r.err);
    CHECK(strncmp(r.out, "    PID", 7) == 0 && strstr(r.out, "ADDRESS") && strstr(r.out, "MAPPED") &&
              strstr(r.out, "KINDS") && strstr(r.out, "OWNER"),
          "header: %s", r.out);
    CHECK_EQ(count_matching(r.out, " 0x7f00"), 3);
    CHECK_EQ(count_lines(r.out), 5); /* header, 3 rows, footer */
    line_with(r.out, "0x7f0000000000", line, sizeof line);
    CHECK(strstr(line, mypid) && strstr(line, "4.0 KiB") && strstr(line, "2.0 MiB") && strstr(line, "cudaMalloc ") &&
              strstr(line, " broker ") && strstr(line, "alive") && strstr(line, "alpha"),
          "alpha row: %s", line);
    char id16[17];
    snprintf(id16, sizeof id16, "%.16s", ids[0] + 16);
    CHECK(strstr(line, id16) != NULL && strstr(line, ids[0]) == NULL, "alpha row shows the last 8 id bytes: %s", line);
    line_with(r.out, "0x7f0000400000", line, sizeof line);
    snprintf(id16, sizeof id16, "%.16s", ids[1] + 16);
    CHECK(strstr(line, id16) != NULL, "second row has its own id: %s", line);
    line_with(r.out, "0x7f0000400000", line, sizeof line);
    CHECK(strstr(line, "3.0 MiB") && strstr(line, "4.0 MiB") && strstr(line, "cudaMallocAsync") &&
              strstr(line, "broker,pidfd") && strstr(line, "q\"uo\\te?"),
          "second row: %s", line);
    line_with(r.out, "0x7f0080000000", line, sizeof line);
    CHECK(strstr(line, "1.50 GiB") && strstr(line, "2.00 GiB") && strstr(line, "cuMemAllocPitch") &&
              strstr(line, " - "),
          "third row: %s", line);
    /* 4096 + 3 MiB + 1.5 GiB requested; 2 MiB + 4 MiB + 2 GiB mapped */
    CHECK(strstr(r.out, "\n3 allocations, 1.50 GiB requested, 2.01 GiB mapped\n") != NULL, "footer: %s", r.out);

    /* the registry from VMMSHIM_REGISTRY; --registry wins over it */
    char env_reg[160], env_missing[160];
    snprintf(env_reg, sizeof env_reg, "VMMSHIM_REGISTRY=%s", reg_name);
    snprintf(env_missing, sizeof env_missing, "VMMSHIM_REGISTRY=%s", missing);
    const char *const env_good[] = {env_reg, NULL};
    const char *const env_bad[] = {env_missing, NULL};
    RUN(&r, env_good, "list");
    CHECK(r.status == 0 && count_matching(r.out, " 0x7f00") == 3, "list via VMMSHIM_REGISTRY: %d %s", r.status, r.err);
    RUN(&r, env_bad, "list", "--registry", reg_name);
    CHECK(r.status == 0 && count_matching(r.out, " 0x7f00") == 3, "--registry after the command: %d %s", r.status,
          r.err);

    /* ---- a child with two allocations ---- */
    pid_t child = spawn_child();
    CHECK(child > 0, "child did not start");
    snprintf(pidbuf, sizeof pidbuf, "%d", (int)child);

    RUN(&r, no_env, reg_opt, "list");
    CHECK_EQ(count_matching(r.out, " 0x7e00"), 2);
    CHECK(strstr(r.out, "\n5 allocations,") != NULL, "footer with the child: %s", r.out);
    RUN(&r, no_env, reg_opt, "list", "--pid", pidbuf);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(count_matching(r.out, " 0x7e00"), 2);
    CHECK_EQ(count_matching(r.out, " 0x7f00"), 0);
    CHECK(strstr(r.out, "\n2 allocations, 1.0 KiB requested, 4.0 MiB mapped\n") && strstr(r.out, "cuMemAlloc "),
          "--pid footer: %s", r.out);
    RUN(&r, no_env, reg_opt, "list", "--pid=999999");
    CHECK(r.status == 0 && strstr(r.out, "\n0 allocations, 0 B requested, 0 B mapped\n"), "no such pid: %s", r.out);

    /* ---- list --json ---- */
    RUN(&r, no_env, reg_opt, "list", "--json");
    CHECK_EQ(r.status, 0);
    CHECK_EQ(json_array_len(r.out), 5);
    for (int i = 0; i < 3; i++) {
        char key[160];
        snprintf(key, sizeof key, "\"id\": \"%s\"", ids[i]);
        CHECK(strstr(r.out, key) != NULL, "json id %s", ids[i]);
    }
    CHECK(strstr(r.out, "\"requested_size\": 4096,") && strstr(r.out, "\"mapped_size\": 2147483648,") &&
              strstr(r.out, "\"requested_size\": 1610612736,") && strstr(r.out, "\"address\": 139637976727552,"),
          "json numbers");
    CHECK(strstr(r.out, "\"tag\": \"q\\\"uo\\\\te\\u0001\"") != NULL, "json escaping");
    CHECK(strstr(r.out, "\"handle_kinds\": [\"broker\", \"pidfd\"]") && strstr(r.out, "\"api\": \"cudaMallocAsync\"") &&
              strstr(r.out, "\"owner\": \"alive\"") && strstr(r.out, "\"exported_fd\": 1100"),
          "json fields");
    CHECK_EQ(count_matching(r.out, "\"pid\": "), 5);
    CHECK(strstr(r.out, "allocations") == NULL, "no footer in json");
    RUN(&r, no_env, reg_opt, "list", "--json", "--pid", "999999");
    CHECK(r.status == 0 && json_array_len(r.out) == 0, "empty json: %s", r.out);
    CHECK(json_array_len("[{\"a\": 1,}]") == -1 && json_array_len("[{\"a\" 1}]") == -1 &&
              json_array_len("[1, 2") == -1 && json_array_len("[\"x\\q\"]") == -1 && json_array_len("[{}, []]") == 2,
          "the json checker itself");

    /* ---- ps ---- */
    RUN(&r, no_env, reg_opt, "ps");
    CHECK_EQ(r.status, 0);
    CHECK(strstr(r.out, "STATE") && strstr(r.out, "BROKER") && strstr(r.out, "CMD"), "ps header: %s", r.out);
    line_with(r.out, "/tmp/vmmshim-tv/broker.sock", line, sizeof line);
    CHECK(strstr(line, mypid) && strstr(line, "alive") && strstr(line, "test_vmmctl") && strstr(line, "1.50 GiB"),
          "ps row: %s", line);
    CHECK(strstr(r.out, "\n2 processes (2 alive, 0 dead, 0 unknown), 5 allocations, 1.50 GiB requested, 2.01 GiB mapped\n"),
          "ps totals: %s", r.out);
    RUN(&r, no_env, reg_opt, "ps", "--json");
    CHECK(r.status == 0 && json_array_len(r.out) == 2 && strstr(r.out, "\"broker_path\": \"/tmp/vmmshim-tv/broker.sock\""),
          "ps --json: %s", r.out);

    /* the coverage counters, as a shim keeps them in its record; the child's as a layout-2 writer
     * leaves them (not its own): unknown, not zero */
    vmm_reg_proc *self = vmm__reg_self(&w);
    uint64_t *counters[] = {&self->allocs, &self->allocs_backed, &self->unpublished, &self->passed_capture,
                            &self->passed_device_full, &self->passed_unsupported, &self->maps_adopted};
    const uint64_t values[] = {7, 4, 3, 1, 1, 1, 2};
    for (int i = 0; i < 7; i++) __atomic_store_n(counters[i], values[i], __ATOMIC_RELAXED);
    vmm_reg_proc cp;
    uint32_t cidx = 0;
    if (child > 0 && vmm__reg_find_proc(&w, (uint32_t)child, &cp, &cidx) == 0)
        __atomic_store_n(&((vmm_reg_proc *)(w.base + w.hdr->proc_off))[cidx].stats_generation, cp.generation - 1,
                         __ATOMIC_RELAXED);
    RUN(&r, no_env, reg_opt, "ps");
    CHECK(strstr(r.out, "PEAK") && strstr(r.out, "MADE") && strstr(r.out, "BACKED") && strstr(r.out, "UNPUB") &&
              strstr(r.out, "CAPTURE") &&
              strstr(r.out, "FULL") && strstr(r.out, "UNSUPP") && strstr(r.out, "ADOPTED"),
          "ps coverage header: %s", r.out);
    line_with(r.out, "/tmp/vmmshim-tv/broker.sock", line, sizeof line);
    CHECK(strstr(line, "   3   1.50 GiB   2.01 GiB          -   1.50 GiB       7       4       3       1       1       1       2 "),
          "ps coverage: %s", line);
    line_with(r.out, pidbuf, line, sizeof line);
    CHECK(strstr(line, "    -       -       -       -       -       -       -       - ") != NULL, "ps of an older writer: %s", line);
    RUN(&r, no_env, reg_opt, "ps", "--json");
    CHECK(r.status == 0 && json_array_len(r.out) == 2 &&
              strstr(r.out, "\"allocations_made\": 7, \"allocations_backed\": 4, \"allocations_unpublished\": 3, "
                            "\"passed_capture\": 1, "
                            "\"passed_device_full\": 1, \"passed_unsupported\": 1, \"maps_adopted\": 2, "
                            "\"peak_bytes_requested\": 1613762560, ") &&
              strstr(r.out, "\"allocations_made\": null, ") && strstr(r.out, "\"peak_bytes_requested\": null, "),
          "ps --json coverage: %s", r.out);

    /* ---- check: clean, then with a dead owner; gc; clean again ---- */
    RUN(&r, no_env, reg_opt, "check");
    CHECK_EQ(r.status, 0);
    CHECK(strstr(r.out, reg_name) && strstr(r.out, "capacity 256") && strstr(r.out, "5 live") &&
              strstr(r.out, "touched of") && strstr(r.out, "ok: no problems found"),
          "clean check: %s", r.out);
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        RUN(&r, no_env, reg_opt, "check");
        CHECK_EQ(r.status, 1);
        char dead[64];
        snprintf(dead, sizeof dead, "dead owner: pid %d, 2 records", (int)child);
        CHECK(strstr(r.out, dead) && strstr(r.out, "1 alive, 1 dead") && strstr(r.out, "problem:") &&
                  !strstr(r.out, "ok: no problems"),
              "check with a dead owner: %s", r.out);

        RUN(&r, no_env, reg_opt, "list");
        CHECK(count_matching(r.out, " 0x7e00") == 0 && strstr(r.out, "\n3 allocations,") &&
                  strstr(r.out, "(2 more of dead processes not shown"),
              "list hides dead owners: %s", r.out);
        RUN(&r, no_env, reg_opt, "list", "--all");
        line_with(r.out, "0x7e0000000000", line, sizeof line);
        CHECK(strstr(r.out, "\n5 allocations,") && strstr(line, " dead ") && strstr(line, "kid0"),
              "list --all shows them: %s", r.out);
        RUN(&r, no_env, reg_opt, "list", "--all", "--json");
        CHECK(json_array_len(r.out) == 5 && strstr(r.out, "\"owner\": \"dead\""), "json --all");
        RUN(&r, no_env, reg_opt, "ps");
        CHECK(strstr(r.out, "2 processes (1 alive, 1 dead, 0 unknown)") != NULL, "ps with a dead one: %s", r.out);

        RUN(&r, no_env, reg_opt, "gc");
        CHECK(r.status == 0 && strstr(r.out, "reclaimed 2 records from 1 dead process; rebuilt the index\n"), "gc: %d %s %s", r.status,
              r.out, r.err);
        RUN(&r, no_env, reg_opt, "check");
        CHECK(r.status == 0 && strstr(r.out, "ok: no problems found") && strstr(r.out, "1 alive, 0 dead"),
              "check after gc: %s", r.out);
        RUN(&r, no_env, reg_opt, "gc");
        CHECK(r.status == 0 && strstr(r.out, "reclaimed 0 records from 0 dead processes\n"), "gc again: %s", r.out);
        RUN(&r, no_env, reg_opt, "ps");
        CHECK(strstr(r.out, "1 process (1 alive, 0 dead, 0 unknown), 3 allocations") != NULL, "ps after gc: %s",
              r.out);
    }

    test_packed(reg_opt);

    /* ---- config ---- */
    const char *const env_cfg[] = {"VMMSHIM_CACHE_SIZE=2G", "VMMSHIM_CONFIG", NULL};
    RUN(&r, env_cfg, "config");
    CHECK_EQ(r.status, 0);
    for (int id = 0; id < VMM__OPT_COUNT; id++)
        CHECK(count_matching(r.out, vmm__opt_name((vmm__opt_id)id)) >= 1, "config lacks %s",
              vmm__opt_name((vmm__opt_id)id));
    CHECK(strstr(r.out, "SOURCE") != NULL, "source column: %s", r.out);
    line_with(r.out, "VMMSHIM_CACHE_SIZE", line, sizeof line);
    CHECK(strstr(line, " 2G ") && strstr(line, " env "), "cache size line: %s", line);
    line_with(r.out, "VMMSHIM_FABRIC", line, sizeof line);
    CHECK(strstr(line, " default ") != NULL, "fabric line: %s", line);

    /* ---- usage errors: exit 2, one line ---- */
    RUN(&r, no_env, reg_opt, "bogus");
    CHECK(r.status == 2 && one_error_line(&r) && strstr(r.err, "'bogus'") && strstr(r.err, "(see vmmctl --help)"),
          "unknown command: %d %s", r.status, r.err);
    RUN(&r, no_env, reg_opt, "list", "--frob");
    CHECK(r.status == 2 && one_error_line(&r) && strstr(r.err, "--frob"), "unknown option: %d %s", r.status, r.err);
    RUN(&r, no_env, reg_opt, "list", "--pid", "12x");
    CHECK(r.status == 2 && one_error_line(&r) && strstr(r.err, "12x"), "bad pid: %d %s", r.status, r.err);
    RUN(&r, no_env, reg_opt, "list", "--pid", "-3");
    CHECK(r.status == 2 && one_error_line(&r), "negative pid: %d %s", r.status, r.err);
    RUN(&r, no_env, reg_opt, "list", "--pid");
    CHECK(r.status == 2 && one_error_line(&r), "--pid without a value: %d %s", r.status, r.err);
    RUN(&r, no_env, "--frob", "list");
    CHECK(r.status == 2 && one_error_line(&r), "unknown global option: %d %s", r.status, r.err);
    RUN(&r, no_env, reg_opt);
    CHECK(r.status == 2 && one_error_line(&r), "no command: %d %s", r.status, r.err);
    RUN(&r, no_env, "ps", "--registry");
    CHECK(r.status == 2 && one_error_line(&r), "--registry without a name: %d %s", r.status, r.err);
    RUN(&r, no_env, reg_opt, "gc", "now");
    CHECK(r.status == 2 && one_error_line(&r), "gc with an argument: %d %s", r.status, r.err);

    /* ---- a missing registry: exit 1, one line ---- */
    char want[256];
    snprintf(want, sizeof want, "vmmctl: error: registry %s: does not exist (no process has run under the shim yet)\n",
             missing);
    const char *const cmds[] = {"list", "ps", "check", "gc"};
    for (int i = 0; i < 4; i++) {
        RUN(&r, no_env, "--registry", missing, cmds[i]);
        CHECK(r.status == 1 && strcmp(r.err, want) == 0 && r.out[0] == 0, "missing registry, %s: %d '%s'", cmds[i],
              r.status, r.err);
    }
    RUN(&r, env_bad, "list");
    CHECK(r.status == 1 && strcmp(r.err, want) == 0, "missing registry via VMMSHIM_REGISTRY: %d '%s'", r.status,
          r.err);
    /* A name without its leading '/' is the name with it, from --registry and VMMSHIM_REGISTRY
     * alike (as the shim takes it), and the error names the object looked for. */
    char env_bare[160];
    snprintf(env_bare, sizeof env_bare, "VMMSHIM_REGISTRY=%s", reg_name + 1);
    const char *const env_bare_name[] = {env_bare, NULL};
    RUN(&r, no_env, "--registry", reg_name + 1, "list");
    CHECK(r.status == 0 && count_matching(r.out, " 0x7f00") == 3, "--registry without '/': %d %s", r.status, r.err);
    RUN(&r, env_bare_name, "ps");
    CHECK(r.status == 0 && strstr(r.out, mypid), "VMMSHIM_REGISTRY without '/': %d %s", r.status, r.err);
    RUN(&r, no_env, "--registry", missing + 1, "list");
    CHECK(r.status == 1 && strcmp(r.err, want) == 0, "missing registry named without '/': %d '%s'", r.status, r.err);
    /* not a registry: exit 1, one line */
    char junk[96];
    snprintf(junk, sizeof junk, "%s-junk", reg_name);
    int fd = shm_open(junk, O_CREAT | O_RDWR, 0600);
    CHECK(fd >= 0 && ftruncate(fd, 1 << 16) == 0 && pwrite(fd, "not a registry, just bytes", 26, 0) == 26, "junk");
    if (fd >= 0) close(fd);
    RUN(&r, no_env, "--registry", junk, "check");
    CHECK(r.status == 1 && one_error_line(&r) && strstr(r.err, "magic"), "junk segment: %d %s", r.status, r.err);

    vmm__reg_close(&w);
    CHECK_EQ(shm_unlink(reg_name), 0);
    CHECK_EQ(shm_unlink(junk), 0);
    CHECK_DONE();
}
