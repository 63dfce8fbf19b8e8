/* vmmctl dump and watch, and the client's vmm_import_read / vmm_import_copy, over the emulated
 * driver.
 *
 * Two kinds of owner.  build/progs/owner under the shim (its pool, its broker: what a user
 * dumps) gives the bytes to compare: buffer i holds (i*31 + k) & 0xff and the owner prints each
 * buffer's FNV-1a.  A forked child of this test publishes two records of its own chunks with the
 * registry writer and serves them with the real broker (broker.c, included as
 * test_import_chunks does), whose export can be held at the first record: that lets the test
 * free the second record between vmmctl's listing and its import, and publish more between two
 * ticks of vmmctl watch.
 *
 * Cases: the in-process API (bytes, bounds, the pipeline's pieces, the copy of the next piece
 * queued before the sink gets the current one, overlap in time under FAKECUDA_COPY_DELAY_US, a
 * stopping sink, threads without a context, the pinned pairs kept and shared); dump of one
 * allocation (bytes, usage errors, a stale address, a write error, a progress bar only on a
 * terminal); dump of a whole process (files, manifest fields and checksums, a not-exportable
 * allocation skipped, an import failure, a non-empty directory refused); an allocation freed
 * between listing and importing; a dead owner; the owner SIGKILLed mid-dump (post-mortem);
 * watch's JSON ticks with deltas, its table on a terminal, SIGTERM. */
#include "../../shim/broker/broker.c" /* test equipment: a real broker in the forked owner */
#include "../../shim/broker/dir.c"
#include "../../shim/broker/holders.c"
#include "../../shim/broker/control.c"

#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "fakeowner.h"
#include "registry/registry.h"
#include "spawn.h"
#include "vmmshim.h"

#include <dirent.h>
#include <sys/mman.h>
#define XXH_INLINE_ALL
#include <xxhash.h>
#include <sys/stat.h>
#include <sys/wait.h>

#define MiB (1ull << 20)
#define CHUNK (2 * MiB)

static char g_build[512], g_reg[64], g_dir[128], g_tmp[128], g_ctl[600], g_preload[700];
static fakecuda_set_copy_delay_us_fn set_copy_delay;

static uint64_t fnv_bytes(uint64_t h, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* FNV-1a of a file's bytes (what the owner prints), its size and, when xxh3 is not NULL, its
 * XXH3-64 in one pass (what the manifest must say); false when it cannot be read. */
static bool fnv_file_xxh3(const char *path, uint64_t *fnv, uint64_t *size, uint64_t *xxh3)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    static uint8_t buf[1 << 16];
    uint8_t *whole = NULL;
    *fnv = 0xcbf29ce484222325ull;
    *size = 0;
    for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;) {
        *fnv = fnv_bytes(*fnv, buf, n);
        uint8_t *grown = xxh3 ? realloc(whole, *size + n) : NULL;
        if (grown) memcpy(grown + *size, buf, n);
        whole = grown;
        *size += n;
    }
    fclose(f);
    if (xxh3) *xxh3 = whole || *size == 0 ? XXH3_64bits(whole, (size_t)*size) : 0;
    free(whole);
    return true;
}

static bool fnv_file(const char *path, uint64_t *fnv, uint64_t *size) { return fnv_file_xxh3(path, fnv, size, NULL); }

static bool slurp(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = 0;
    fclose(f);
    return true;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++) n += *s == '\n';
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

/* ------------------------------------------------------------------------------------------ */
/* Running vmmctl                                                                              */

typedef struct result {
    int status;
    char out[16384], err[8192];
} result;

static result g_r;

/* vmmctl with args (NULL-terminated) and extra environment. */
static int ctl(const char *const env[], const char *const args[])
{
    char *argv[24] = {g_ctl};
    int n = 1;
    for (; args[n - 1] && n < 23; n++) argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    g_r.status = spawn_capture(argv, env, g_r.out, sizeof g_r.out, g_r.err, sizeof g_r.err, 60);
    return g_r.status;
}

#define CTL(env, ...)                                           \
    do {                                                        \
        const char *const args_[] = {__VA_ARGS__, NULL};        \
        ctl((env), args_);                                      \
    } while (0)

static bool one_error_line(const result *r)
{
    return strncmp(r->err, "vmmctl: error: ", 15) == 0 && count_lines(r->err) == 1;
}

/* vmmctl started in the background, stdout and stderr to files under g_tmp. */
static pid_t ctl_start(const char *const env[], const char *const args[], const char *tag)
{
    char *argv[24] = {g_ctl};
    int n = 1;
    for (; args[n - 1] && n < 23; n++) argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    char out[256], err[256];
    snprintf(out, sizeof out, "%s/%s.out", g_tmp, tag);
    snprintf(err, sizeof err, "%s/%s.err", g_tmp, tag);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600), e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(o, 1);
        dup2(e, 2);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        alarm(60);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static int wait_status(pid_t pid)
{
    int st = 0;
    if (waitpid(pid, &st, 0) != pid) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* vmmctl with stdout and stderr on a terminal; what the terminal showed goes to out. */
static int ctl_on_tty(const char *const args[], char *out, size_t len)
{
    int m = posix_openpt(O_RDWR | O_NOCTTY);
    if (m < 0 || grantpt(m) || unlockpt(m)) return -1;
    char *argv[24] = {g_ctl};
    int n = 1;
    for (; args[n - 1] && n < 23; n++) argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    const char *slave = ptsname(m);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        int s = open(slave, O_RDWR);
        dup2(s, 1);
        dup2(s, 2);
        close(m);
        alarm(60);
        execv(argv[0], argv);
        _exit(127);
    }
    size_t used = 0;
    for (;;) { /* until the child's side closes (EIO) */
        struct pollfd p = {.fd = m, .events = POLLIN};
        if (poll(&p, 1, 30000) <= 0) break;
        ssize_t k = read(m, out + used, len - 1 - used);
        if (k <= 0) break;
        used += (size_t)k;
        if (used == len - 1) break;
    }
    out[used] = 0;
    close(m);
    return wait_status(pid);
}

/* ------------------------------------------------------------------------------------------ */
/* build/progs/owner under the shim                                                            */

typedef struct owner {
    pid_t pid;
    FILE *in, *out;
    uint64_t addr[8], size[8], fnv[8];
    int n;
} owner;

static bool owner_start(owner *o, const char *sizes)
{
    memset(o, 0, sizeof *o);
    int pi[2], po[2];
    if (pipe2(pi, O_CLOEXEC) || pipe2(po, O_CLOEXEC)) return false;
    fflush(stdout);
    fflush(stderr);
    o->pid = fork();
    if (o->pid == 0) {
        dup2(pi[0], 0);
        dup2(po[1], 1);
        putenv(g_preload);
        char prog[600], s[128];
        snprintf(prog, sizeof prog, "%s/progs/owner", g_build);
        snprintf(s, sizeof s, "%s", sizes);
        char *argv[10] = {prog};
        int n = 1;
        for (char *t = strtok(s, " "); t && n < 9; t = strtok(NULL, " ")) argv[n++] = t;
        alarm(120);
        execv(prog, argv);
        _exit(127);
    }
    close(pi[0]);
    close(po[1]);
    o->in = fdopen(pi[1], "w");
    o->out = fdopen(po[0], "r");
    int want = 1;
    for (const char *p = sizes; *p; p++) want += *p == ' ';
    char line[256];
    while (o->n < want && fgets(line, sizeof line, o->out)) {
        int pid;
        unsigned long long a, s, f;
        if (sscanf(line, "ready %d %llx %llu fnv %llx", &pid, &a, &s, &f) == 4) {
            o->addr[o->n] = a;
            o->size[o->n] = s;
            o->fnv[o->n++] = f;
        }
    }
    CHECK(o->n == want, "owner %s started with %d of %d buffers", sizes, o->n, want);
    return o->n == want;
}

static void owner_end(owner *o, bool kill_it)
{
    if (kill_it)
        kill(o->pid, SIGKILL);
    else
        fprintf(o->in, "quit\n");
    fclose(o->in);
    fclose(o->out);
    waitpid(o->pid, NULL, 0);
}

static bool pattern_ok(const uint8_t *p, uint64_t from, uint64_t n, int buf)
{
    for (uint64_t k = 0; k < n; k++)
        if (p[k] != (uint8_t)((uint64_t)buf * 31 + from + k)) return false;
    return true;
}

/* ------------------------------------------------------------------------------------------ */
/* The forked owner: two records of its own chunks, its broker can be held                     */

typedef struct fo_info {
    int rc;
    char err[160];
    int32_t pid;
    uint64_t addr[2], requested[2], fnv[2];
    int first; /* the record at the lower address: a dump imports it first */
} fo_info;

static const uint64_t FO_REQUESTED[2] = {300000, 1234567};

static pthread_mutex_t fo_lock = PTHREAD_MUTEX_INITIALIZER;
static vmm__reg fo_reg;
static CUmemGenericAllocationHandle fo_handle[2];
static uint32_t fo_slot[2];
static vmm_reg_alloc fo_pub[2];
static bool fo_live[2], fo_hold;
static int fo_first;
static int fo_evt = -1, fo_go = -1; /* broker thread -> test, test -> broker thread */

static int fo_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                     int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total, uint32_t *device)
{
    (void)keys; /* no key: every handle passed each time it is asked for */
    pthread_mutex_lock(&fo_lock);
    int i = slot == fo_slot[0] && fo_live[0] ? 0 : slot == fo_slot[1] && fo_live[1] ? 1 : -1;
    bool hold = i == fo_first && fo_hold;
    pthread_mutex_unlock(&fo_lock);
    if (hold) { /* the test frees what it likes, then lets this request go on */
        char c = 'x';
        if (!write_full(fo_evt, &c, 1) || !read_full(fo_go, &c, 1)) return -EIO;
    }
    pthread_mutex_lock(&fo_lock);
    int rc = i < 0 || !fo_live[i] ? -ENOENT
             : generation != fo_pub[i].generation || memcmp(alloc_id, fo_pub[i].alloc_id, 16) ? -ESTALE
                                                                                               : 0;
    CUmemGenericAllocationHandle h = i >= 0 ? fo_handle[i] : 0;
    pthread_mutex_unlock(&fo_lock);
    if (rc) return rc;
    *n_total = 1; /* one handle per record here */
    if (first != 0 || max == 0) return -ERANGE;
    if (drv.MemExportToShareableHandle(&fds[0], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) return -EIO;
    sizes[0] = CHUNK;
    *n_here = 1;
    *device = 0;
    return 0;
}

#define FO_FAIL(step, ...)                                                                       \
    do {                                                                                         \
        info.rc = step;                                                                          \
        snprintf(info.err, sizeof info.err, __VA_ARGS__);                                        \
        (void)write_full(rep, &info, sizeof info);                                               \
        _exit(1);                                                                                \
    } while (0)

static void fo_main(int cmd, int rep)
{
    alarm(300);
    fo_info info;
    memset(&info, 0, sizeof info);
    info.pid = (int32_t)getpid();
    setenv("VMMSHIM_BROKER_DIR", g_dir, 1);
    vmm__opt_reload_for_test();
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    CUresult r = owner_driver_start(&prop, &acc);
    if (r) FO_FAIL(1, "driver init: %d", (int)r);
    char err[256] = "";
    int rc = vmm__reg_open(&fo_reg, g_reg, VMM__REG_CREATE, 1024, NULL, err, sizeof err);
    if (rc || (rc = vmm__reg_attach(&fo_reg, NULL))) FO_FAIL(2, "registry: %d %s", rc, err);
    for (int i = 0; i < 2; i++) {
        CUdeviceptr base;
        if ((r = drv.MemCreate(&fo_handle[i], CHUNK, &prop, 0)) ||
            (r = drv.MemAddressReserve(&base, CHUNK, CHUNK, 0, 0)) ||
            (r = drv.MemMap(base, CHUNK, 0, fo_handle[i], 0)) || (r = drv.MemSetAccess(base, CHUNK, &acc, 1)))
            FO_FAIL(3, "chunk %d: %d", i, (int)r);
        uint8_t *p = (uint8_t *)(uintptr_t)base; /* emulated device memory is host memory */
        for (uint64_t k = 0; k < FO_REQUESTED[i]; k++) p[k] = (uint8_t)(k * 7 + (k >> 9) + (uint64_t)i);
        info.addr[i] = base;
        info.requested[i] = FO_REQUESTED[i];
        info.fnv[i] = fnv_bytes(0xcbf29ce484222325ull, p, FO_REQUESTED[i]);
        vmm_reg_alloc d;
        memset(&d, 0, sizeof d);
        d.api = VMM_API_TEST;
        d.requested_size = FO_REQUESTED[i];
        d.mapped_size = CHUNK;
        d.handle_kinds = VMM_HANDLE_BROKER;
        snprintf(d.tag, sizeof d.tag, "fo-%d", i);
        if ((rc = vmm__reg_add(&fo_reg, base, CHUNK, &d, &fo_slot[i], &fo_pub[i]))) FO_FAIL(4, "add: %d", rc);
        fo_live[i] = true;
    }
    fo_first = info.first = info.addr[1] < info.addr[0];
    char sock[112];
    if ((rc = vmm__broker_start(fo_export, sock, sizeof sock)) || (rc = vmm__reg_set_broker(&fo_reg, sock)))
        FO_FAIL(5, "broker: %d", rc);
    if (!write_full(rep, &info, sizeof info)) _exit(1);
    for (uint64_t extra = 0;;) {
        uint8_t c[2];
        if (!read_command(cmd, c, 2)) _exit(0);
        pthread_mutex_lock(&fo_lock);
        if (c[0] == 'H') { /* hold the broker at the first record's next request */
            fo_hold = c[1];
            rc = 0;
        } else if (c[0] == 'R') { /* free record c[1] */
            rc = vmm__reg_remove(&fo_reg, fo_slot[c[1] & 1]);
            fo_live[c[1] & 1] = false;
        } else if (c[0] == 'P') { /* publish one more allocation of 123456 bytes (records only) */
            vmm_reg_alloc d;
            uint32_t slot;
            memset(&d, 0, sizeof d);
            d.api = VMM_API_TEST;
            d.requested_size = 123456;
            d.mapped_size = CHUNK;
            rc = vmm__reg_add(&fo_reg, 0x7e0000000000ull + CHUNK * extra++, CHUNK, &d, &slot, NULL);
        }
        pthread_mutex_unlock(&fo_lock);
        if (!write_full(rep, &rc, sizeof rc)) _exit(0);
    }
}

typedef struct fork_owner {
    pid_t pid;
    int cmd, rep, evt, go;
    fo_info info;
} fork_owner;

static bool fo_start(fork_owner *o)
{
    memset(o, 0, sizeof *o);
    int c[2], r[2], e[2], g[2];
    if (pipe2(c, O_CLOEXEC) || pipe2(r, O_CLOEXEC) || pipe2(e, O_CLOEXEC) || pipe2(g, O_CLOEXEC)) return false;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        fo_evt = e[1];
        fo_go = g[0];
        fo_main(c[0], r[1]);
        _exit(0);
    }
    close(c[0]);
    close(r[1]);
    close(e[1]);
    close(g[0]);
    *o = (fork_owner){.pid = pid, .cmd = c[1], .rep = r[0], .evt = e[0], .go = g[1]};
    bool ok = read_full(o->rep, &o->info, sizeof o->info);
    CHECK(ok && o->info.rc == 0, "forked owner did not start: step %d: %s", o->info.rc, ok ? o->info.err : "no report");
    return ok && o->info.rc == 0;
}

static bool fo_cmd(fork_owner *o, char op, int arg)
{
    uint8_t c[2] = {(uint8_t)op, (uint8_t)arg};
    int rc = -1;
    if (write_full(o->cmd, c, 2) && read_full(o->rep, &rc, sizeof rc)) return rc == 0;
    /* the owner is gone: say how, where a dead pipe would only have said "no answer" */
    int st = 0;
    pid_t w = waitpid(o->pid, &st, WNOHANG);
    printf("note: the forked owner %d did not answer '%c': %s %d\n", (int)o->pid, op,
           w != o->pid          ? "still running, errno"
           : WIFSIGNALED(st)    ? "killed by signal"
                                : "exited with status",
           w != o->pid ? errno : WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    return false;
}

static void fo_end(fork_owner *o)
{
    kill(o->pid, SIGKILL);
    waitpid(o->pid, NULL, 0);
    close(o->cmd);
    close(o->rep);
    close(o->evt);
    close(o->go);
    char sock[200];
    snprintf(sock, sizeof sock, "%s/%d.sock", g_dir, (int)o->pid);
    unlink(sock);
}

/* ------------------------------------------------------------------------------------------ */
/* The manifest                                                                                */

/* The manifest's line for the allocation at addr, or "". */
static const char *entry_of(const char *manifest, uint64_t addr, char *buf, size_t len)
{
    char key[64];
    snprintf(key, sizeof key, "\"address_hex\": \"0x%llx\"", (unsigned long long)addr);
    return line_with(manifest, key, buf, len);
}

/* The allocation at addr is listed dumped, its file holds size bytes whose FNV-1a is the owner's
 * fnv, and the manifest gives the file's XXH3-64 (libxxhash's, over the whole file at once). */
static void check_dumped(const char *dir, const char *manifest, uint64_t addr, uint64_t size, uint64_t fnv)
{
    char line[1024], want[200], path[512];
    entry_of(manifest, addr, line, sizeof line);
    snprintf(want, sizeof want, "\"size\": %llu, ", (unsigned long long)size);
    CHECK(strstr(line, want) && strstr(line, "\"status\": \"dumped\""), "entry of 0x%llx: %s",
          (unsigned long long)addr, line);
    snprintf(path, sizeof path, "%s/0x%llx.bin", dir, (unsigned long long)addr);
    uint64_t got = 0, got_size = 0, xxh3 = 0;
    CHECK(fnv_file_xxh3(path, &got, &got_size, &xxh3) && got == fnv && got_size == size,
          "%s: fnv %016llx size %llu, want %016llx size %llu", path, (unsigned long long)got,
          (unsigned long long)got_size, (unsigned long long)fnv, (unsigned long long)size);
    snprintf(want, sizeof want, "\"file\": \"0x%llx.bin\", \"xxh3_64\": \"%016llx\", \"reason\": null}",
             (unsigned long long)addr, (unsigned long long)xxh3);
    CHECK(strstr(line, want) != NULL, "want %s in %s", want, line);
}

/* ------------------------------------------------------------------------------------------ */
/* The client API                                                                              */

typedef struct seen {
    uint8_t *copy;
    uint64_t n_expected; /* pieces the copy should come in */
    uint64_t pieces, bytes, piece_len;
    int out_of_order, not_queued, uneven;
    unsigned long long calls_base;
    uint64_t stop_at;   /* return non-zero at this piece (1-based); 0 never */
    unsigned sleep_us;  /* work the sink does per piece */
    pthread_barrier_t *meet; /* threads meet here in their first piece */
} seen;

static int record_piece(void *ctx, const void *data, uint64_t len, uint64_t done)
{
    seen *s = ctx;
    if (done != s->bytes) s->out_of_order++;
    if (s->pieces == 0) s->piece_len = len;
    else if (len > s->piece_len) s->uneven++;
    if (s->copy) memcpy(s->copy + done, data, len);
    /* the copy of the next piece is queued before this one is handed over */
    uint64_t queued = counters().calls_cuMemcpyDtoHAsync - s->calls_base;
    uint64_t want = s->pieces + 2 < s->n_expected ? s->pieces + 2 : s->n_expected;
    if (!s->meet && queued != want) s->not_queued++;
    if (s->meet && s->pieces == 0) pthread_barrier_wait(s->meet);
    if (s->sleep_us) usleep(s->sleep_us);
    s->pieces++;
    s->bytes += len;
    return s->pieces == s->stop_at;
}

typedef struct thread_job {
    vmm_imported *imp;
    seen s;
    vmm_status st;
    bool had_context;
} thread_job;

static CUresult (*ctx_get_current)(CUcontext *);

static void *copy_in_thread(void *arg)
{
    thread_job *j = arg;
    CUcontext c = NULL;
    j->had_context = ctx_get_current(&c) == CUDA_SUCCESS && c != NULL;
    j->st = vmm_import_copy(j->imp, 0, vmm_import_size(j->imp), record_piece, &j->s);
    return NULL;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void case_api(void)
{
    owner o;
    if (!owner_start(&o, "16 3")) return;
    vmm_registry *reg = NULL;
    vmm_alloc_info a, b;
    vmm_imported *ia = NULL, *ib = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "open: %s", vmm_last_error());
    if (!reg || vmm_find(reg, (uint32_t)o.pid, o.addr[0], &a) != VMM_OK ||
        vmm_find(reg, (uint32_t)o.pid, o.addr[1], &b) != VMM_OK || vmm_import(reg, &a, &ia) != VMM_OK ||
        vmm_import(reg, &b, &ib) != VMM_OK) {
        CHECK(0, "importing the owner's buffers: %s", vmm_last_error());
        goto out;
    }
    const uint64_t n = 16 * MiB;
    uint8_t *buf = malloc(n);
    if (!buf) goto out;

    /* vmm_import_read: all of it, a middle part, nothing, and refusals */
    memset(buf, 0, n);
    CHECK(vmm_import_read(ia, 0, buf, n) == VMM_OK && pattern_ok(buf, 0, n, 0), "read all: %s", vmm_last_error());
    CHECK(vmm_import_read(ib, 1000, buf, 5000) == VMM_OK && pattern_ok(buf, 1000, 5000, 1), "read at 1000: %s",
          vmm_last_error());
    CHECK_EQ(vmm_import_read(ia, n, buf, 0), VMM_OK);
    CHECK(vmm_import_read(ia, n - 10, buf, 11) == VMM_ERR_INVALID && strstr(vmm_last_error(), "run past"),
          "read past the end: %s", vmm_last_error());
    CHECK(vmm_import_read(ia, n + 1, buf, 0) == VMM_ERR_INVALID, "offset past the end: %s", vmm_last_error());
    CHECK(vmm_import_read(ia, UINT64_MAX, buf, 2) == VMM_ERR_INVALID, "offset wrapping: %s", vmm_last_error());
    CHECK_EQ(vmm_import_read(NULL, 0, buf, 1), VMM_ERR_INVALID);
    CHECK_EQ(vmm_import_read(ia, 0, NULL, 1), VMM_ERR_INVALID);
    CHECK_EQ(vmm_import_copy(ia, 0, 1, NULL, NULL), VMM_ERR_INVALID);
    CHECK_EQ(vmm_import_copy(ia, 1, n, record_piece, NULL), VMM_ERR_INVALID);

    /* vmm_import_copy: 16 MiB come as four 4 MiB pieces in order, each next one queued before
     * the sink gets the one before it, through one pinned pair that is kept */
    unsigned long long pinned = counters().host_allocs_live;
    memset(buf, 0, n);
    seen s = {.copy = buf, .n_expected = 4, .calls_base = counters().calls_cuMemcpyDtoHAsync};
    CHECK(vmm_import_copy(ia, 0, n, record_piece, &s) == VMM_OK, "copy: %s", vmm_last_error());
    CHECK(s.pieces == 4 && s.piece_len == 4 * MiB && s.bytes == n && !s.out_of_order && !s.uneven,
          "pieces %llu of %llu bytes, %llu in all, %d out of order", (unsigned long long)s.pieces,
          (unsigned long long)s.piece_len, (unsigned long long)s.bytes, s.out_of_order);
    CHECK(s.not_queued == 0, "%d pieces reached the sink before the next copy was queued", s.not_queued);
    CHECK(pattern_ok(buf, 0, n, 0), "copied bytes differ from the owner's");
    CHECK_EQ(counters().host_allocs_live - pinned, 2);
    /* a part of the 3 MiB buffer: one piece (under 1 MiB a piece), the same pair */
    memset(buf, 0, n);
    s = (seen){.copy = buf, .n_expected = 1, .calls_base = counters().calls_cuMemcpyDtoHAsync};
    CHECK(vmm_import_copy(ib, 4096, 100000, record_piece, &s) == VMM_OK && s.pieces == 1 && s.bytes == 100000 &&
              pattern_ok(buf, 4096, 100000, 1),
          "copy at 4096: %s", vmm_last_error());
    CHECK_EQ(counters().host_allocs_live - pinned, 2);
    CHECK_EQ(vmm_import_copy(ib, 3 * MiB, 0, record_piece, &s), VMM_OK);

    /* a sink that stops: VMM_ERR_IO, no further piece, the pair back for the next call */
    s = (seen){.n_expected = 4, .calls_base = counters().calls_cuMemcpyDtoHAsync, .stop_at = 2};
    vmm_status st = vmm_import_copy(ia, 0, n, record_piece, &s);
    CHECK(st == VMM_ERR_IO && s.pieces == 2 && strstr(vmm_last_error(), "sink stopped the copy after 4194304 of"),
          "stopping sink: %d after %llu pieces: %s", st, (unsigned long long)s.pieces, vmm_last_error());
    CHECK_EQ(counters().host_allocs_live - pinned, 2);

    /* overlap in time: copies and the sink's work each take 150 ms a piece; one after the
     * other 4 pieces take 1.2 s, overlapped 0.75 s */
    set_copy_delay(150000);
    s = (seen){.n_expected = 4, .calls_base = counters().calls_cuMemcpyDtoHAsync, .sleep_us = 150000};
    double t0 = now_s();
    st = vmm_import_copy(ia, 0, n, record_piece, &s);
    double took = now_s() - t0;
    set_copy_delay(0);
    CHECK(st == VMM_OK && took >= 0.7 && took < 1.0, "4 pieces of 150 ms copy + 150 ms sink took %.3f s", took);

    /* threads without a context get the import's device's; two calls at once take two pairs,
     * both kept for later calls */
    pthread_barrier_t meet;
    pthread_barrier_init(&meet, NULL, 2);
    thread_job j[2] = {{.imp = ia, .s = {.n_expected = 4, .meet = &meet}},
                       {.imp = ib, .s = {.n_expected = 3, .meet = &meet}}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, copy_in_thread, &j[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&meet);
    CHECK(!j[0].had_context && !j[1].had_context, "the threads started with a context");
    CHECK(j[0].st == VMM_OK && j[0].s.bytes == n && j[1].st == VMM_OK && j[1].s.bytes == 3 * MiB,
          "copies in threads: %d %d", j[0].st, j[1].st);
    CHECK_EQ(counters().host_allocs_live - pinned, 4);
    free(buf);
out:
    vmm_import_release(ia);
    vmm_import_release(ib);
    vmm_close(reg);
    owner_end(&o, false);
}

/* ------------------------------------------------------------------------------------------ */
/* dump                                                                                        */

static void case_dump_one(void)
{
    owner o;
    if (!owner_start(&o, "3 1c")) return;
    char pid[16], inside[32], path[256], line[512], bogus[32], captured[32];
    snprintf(pid, sizeof pid, "%d", (int)o.pid);
    snprintf(inside, sizeof inside, "0x%llx", (unsigned long long)(o.addr[0] + 12345));
    snprintf(captured, sizeof captured, "0x%llx", (unsigned long long)o.addr[1]);
    snprintf(bogus, sizeof bogus, "0x%llx", (unsigned long long)(o.addr[0] + 512 * MiB));
    snprintf(path, sizeof path, "%s/one.bin", g_tmp);

    /* any interior address: the allocation's requested bytes from its start */
    CTL(NULL, "dump", pid, inside, "-o", path);
    uint64_t fnv = 0, size = 0;
    CHECK(g_r.status == 0 && g_r.err[0] == 0 && fnv_file(path, &fnv, &size) && fnv == o.fnv[0] && size == 3 * MiB,
          "dump %s: rc %d, fnv %016llx size %llu (want %016llx): %s%s", inside, g_r.status, (unsigned long long)fnv,
          (unsigned long long)size, (unsigned long long)o.fnv[0], g_r.out, g_r.err);
    snprintf(line, sizeof line, "dumped 1 allocation of pid %s to %s: 3145728 bytes (3.0 MiB) in ", pid, path);
    CHECK(strncmp(g_r.out, line, strlen(line)) == 0 && count_lines(g_r.out) == 1 && strstr(g_r.out, " GB/s"),
          "summary: %s", g_r.out);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0600, "file mode %o", sb.st_mode & 0777);
    CTL(NULL, "dump", pid, inside, "--output", "/dev/null");
    CHECK(g_r.status == 0 && strstr(g_r.out, "3145728 bytes"), "to /dev/null: %d %s%s", g_r.status, g_r.out, g_r.err);

    /* a progress bar when stderr is a terminal */
    char tty[8192];
    const char *const on_tty[] = {"dump", pid, inside, "-o", path, NULL};
    int rc = ctl_on_tty(on_tty, tty, sizeof tty);
    CHECK(rc == 0 && strstr(tty, "\r\033[Kdump: ") && strstr(tty, " of 3.0 MiB (") &&
              strstr(tty, "dumped 1 allocation"),
          "on a terminal: rc %d: %s", rc, tty);

    CTL(NULL, "--help");
    CHECK(strstr(g_r.out, "\n  dump PID [ADDR] -o PATH\n") &&
              strstr(g_r.out, "\n  watch [--pid PID] [--interval S] [--count N]\n"),
          "usage text: %s", g_r.out);

    /* refusals: one line each, nothing written */
    unlink(path);
    CTL(NULL, "dump", pid, bogus, "-o", path);
    CHECK(g_r.status == 1 && one_error_line(&g_r) && g_r.out[0] == 0 && access(path, F_OK) != 0,
          "stale address: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", pid, captured, "-o", path);
    CHECK(g_r.status == 1 && one_error_line(&g_r) && strstr(g_r.err, "not exportable") && access(path, F_OK) != 0,
          "not exportable: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", pid, inside, "-o", "/dev/full");
    CHECK(g_r.status == 1 && one_error_line(&g_r) && strstr(g_r.err, "writing /dev/full: No space left on device"),
          "write error: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", pid, inside, "-o", "/nonexistent-dir/x.bin");
    CHECK(g_r.status == 1 && one_error_line(&g_r) && strstr(g_r.err, "cannot open /nonexistent-dir/x.bin"),
          "unwritable path: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", pid, inside);
    CHECK(g_r.status == 2 && one_error_line(&g_r) && strstr(g_r.err, "-o PATH"), "no -o: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", "-o", path);
    CHECK(g_r.status == 2 && one_error_line(&g_r), "no pid: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", pid, inside, "x", "-o", path);
    CHECK(g_r.status == 2 && one_error_line(&g_r), "too many: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", pid, "-o", path, "--frob");
    CHECK(g_r.status == 2 && one_error_line(&g_r) && strstr(g_r.err, "--frob"), "unknown option: %d %s", g_r.status,
          g_r.err);
    CTL(NULL, "dump", "12x", "-o", path);
    CHECK(g_r.status == 2 && one_error_line(&g_r), "bad pid: %d %s", g_r.status, g_r.err);
    owner_end(&o, false);
}

static void case_dump_all(void)
{
    owner o;
    if (!owner_start(&o, "3 1a 0.5 1c 16")) return;
    char pid[16], dir[256], path[512], manifest[16384], line[1024], want[512];
    snprintf(pid, sizeof pid, "%d", (int)o.pid);
    snprintf(dir, sizeof dir, "%s/all", g_tmp);
    CTL(NULL, "dump", pid, "-o", dir);
    CHECK(g_r.status == 0, "dump of the process: %d %s%s", g_r.status, g_r.out, g_r.err);
    snprintf(want, sizeof want, "dumped 4 allocations of pid %s to %s: %llu bytes (", pid, dir,
             (unsigned long long)(20 * MiB + MiB / 2));
    CHECK(strncmp(g_r.out, want, strlen(want)) == 0 && strstr(g_r.out, "; 1 skipped, 0 failed\n") &&
              count_lines(g_r.out) == 1,
          "summary: %s", g_r.out);
    snprintf(want, sizeof want, "vmmctl: skipped pid %s's allocation at 0x%llx: not exportable", pid,
             (unsigned long long)o.addr[3]);
    CHECK(strncmp(g_r.err, want, strlen(want)) == 0 && count_lines(g_r.err) == 1, "stderr: %s", g_r.err);
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    CHECK(slurp(path, manifest, sizeof manifest), "no %s", path);
    snprintf(want, sizeof want, "\n  \"pid\": %s,\n", pid);
    CHECK(strstr(manifest, want) && strstr(manifest, "\"cmdline\": \"") &&
              strstr(manifest, "/progs/owner 3 1a 0.5 1c 16\"") &&
              strstr(manifest, "\n  \"owner_alive_after\": true,\n") && strstr(manifest, "\n  \"taken\": \"20") &&
              strstr(manifest, "\n  \"dumped\": 4,\n  \"skipped\": 1,\n  \"failed\": 0,\n"),
          "manifest header:\n%s", manifest);
    snprintf(want, sizeof want, "\n  \"bytes\": %llu,\n", (unsigned long long)(20 * MiB + MiB / 2));
    CHECK(strstr(manifest, want) != NULL, "manifest bytes:\n%s", manifest);
    for (int i = 0; i < 5; i++)
        if (i != 3) check_dumped(dir, manifest, o.addr[i], o.size[i], o.fnv[i]);
    entry_of(manifest, o.addr[3], line, sizeof line);
    CHECK(strstr(line, "\"api\": \"cudaMallocAsync\"") && strstr(line, "\"status\": \"skipped\"") &&
              strstr(line, "\"file\": null, \"xxh3_64\": null, \"reason\": \"not exportable"),
          "the captured allocation: %s", line);
    entry_of(manifest, o.addr[0], line, sizeof line);
    CHECK(strstr(line, "\"api\": \"cudaMalloc\", \"device\": 0, \"tag\": \"\", \"id\": \"") &&
              strstr(line, "\", \"generation\": "),
          "fields: %s", line);
    /* one file per dumped allocation, the manifest, nothing else; private */
    int files = 0;
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) files += e->d_name[0] != '.';
    if (d) closedir(d);
    struct stat sb;
    CHECK(files == 5 && stat(dir, &sb) == 0 && (sb.st_mode & 0777) == 0700, "%d files, mode %o", files,
          sb.st_mode & 0777);

    /* a directory that is not empty is refused; an empty one is fine */
    CTL(NULL, "dump", pid, "-o", dir);
    CHECK(g_r.status == 1 && one_error_line(&g_r) && strstr(g_r.err, "not an empty directory"), "again: %d %s",
          g_r.status, g_r.err);
    snprintf(dir, sizeof dir, "%s/empty", g_tmp);
    mkdir(dir, 0755);
    CTL(NULL, "dump", pid, "-o", dir);
    CHECK(g_r.status == 0, "into an empty directory: %d %s", g_r.status, g_r.err);

    /* an import that fails: the others are dumped, the manifest says which and why, exit 1 */
    const char *const fail_import[] = {"FAKECUDA_FAIL=cuMemImportFromShareableHandle:1", NULL};
    snprintf(dir, sizeof dir, "%s/fail", g_tmp);
    CTL(fail_import, "dump", pid, "-o", dir);
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    CHECK(g_r.status == 1 && strstr(g_r.out, "dumped 3 allocations") && strstr(g_r.out, "; 1 skipped, 1 failed\n") &&
              strstr(g_r.err, "could not be dumped: cuMemImportFromShareableHandle failed") &&
              slurp(path, manifest, sizeof manifest) && strstr(manifest, "\"failed\": 1,") &&
              strstr(manifest, "\"status\": \"failed\", \"file\": null, \"xxh3_64\": null, \"reason\": "
                               "\"cuMemImportFromShareableHandle failed"),
          "a failed import: %d %s%s", g_r.status, g_r.out, g_r.err);
    owner_end(&o, false);
}

/* The owner exits before the dump, or is SIGKILLed in the middle of it. */
static void case_dead_owner(void)
{
    owner o;
    if (!owner_start(&o, "3 2 1 0.5")) return;
    char pid[16], dir[256], addr[32], path[512], manifest[16384], out[4096], err[4096];
    snprintf(pid, sizeof pid, "%d", (int)o.pid);
    snprintf(dir, sizeof dir, "%s/pm", g_tmp);

    /* every import is made before the first file: the first file means the owner may go.  The
     * copies take 300 ms a piece (7 pieces), so the dump is still running when it does */
    const char *const slow[] = {"FAKECUDA_COPY_DELAY_US=300000", NULL};
    const char *const args[] = {"dump", pid, "-o", dir, NULL};
    pid_t dump = ctl_start(slow, args, "pm");
    bool copying = false;
    for (int i = 0; i < 3000 && !copying; i++) {
        DIR *d = opendir(dir);
        for (struct dirent *e; d && (e = readdir(d));) copying |= strstr(e->d_name, ".bin") != NULL;
        if (d) closedir(d);
        if (!copying) usleep(10000);
    }
    CHECK(copying, "the dump never started copying");
    owner_end(&o, true);
    CHECK(waitpid(dump, NULL, WNOHANG) == 0, "the dump ended before the owner was killed: nothing proven");
    int rc = wait_status(dump);
    snprintf(path, sizeof path, "%s/pm.out", g_tmp);
    slurp(path, out, sizeof out);
    snprintf(path, sizeof path, "%s/pm.err", g_tmp);
    slurp(path, err, sizeof err);
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    CHECK(rc == 0 && strstr(out, "dumped 4 allocations") && err[0] == 0 && slurp(path, manifest, sizeof manifest) &&
              strstr(manifest, "\"owner_alive_after\": false,") && strstr(manifest, "\"dumped\": 4,"),
          "post-mortem dump: rc %d: %s%s", rc, out, err);
    for (int i = 0; i < 4; i++) check_dumped(dir, manifest, o.addr[i], o.size[i], o.fnv[i]);

    /* now it is dead: one line, nothing made */
    snprintf(dir, sizeof dir, "%s/dead", g_tmp);
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)o.addr[0]);
    CTL(NULL, "dump", pid, "-o", dir);
    CHECK(g_r.status == 1 && one_error_line(&g_r) && strstr(g_r.err, "has exited") && access(dir, F_OK) != 0,
          "dead owner: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", pid, addr, "-o", dir);
    CHECK(g_r.status == 1 && one_error_line(&g_r) && strstr(g_r.err, "has exited") && access(dir, F_OK) != 0,
          "dead owner, one address: %d %s", g_r.status, g_r.err);
    CTL(NULL, "dump", "4000000", "-o", dir);
    CHECK(g_r.status == 1 && one_error_line(&g_r) && strstr(g_r.err, "no process 4000000"), "unknown pid: %d %s",
          g_r.status, g_r.err);
    CTL(NULL, "gc");
}

/* An allocation freed after the listing, before its import: skipped, not fatal; asked for by
 * address, it fails the dump. */
static void case_freed_meanwhile(fork_owner *o)
{
    char pid[16], dir[256], path[512], manifest[8192], out[4096], err[4096], line[1024], want[256], addr[32];
    snprintf(pid, sizeof pid, "%d", (int)o->pid);
    snprintf(dir, sizeof dir, "%s/freed", g_tmp);
    CHECK(fo_cmd(o, 'H', 1), "hold");
    const char *const args[] = {"dump", pid, "-o", dir, NULL};
    pid_t dump = ctl_start(NULL, args, "freed");
    char c = 0;
    CHECK(read_full(o->evt, &c, 1) && c == 'x', "the dump never asked for the first allocation");
    int first = o->info.first, second = !first;
    CHECK(fo_cmd(o, 'R', second), "free the second");
    CHECK(write_full(o->go, "g", 1), "release the broker");
    int rc = wait_status(dump);
    snprintf(path, sizeof path, "%s/freed.out", g_tmp);
    slurp(path, out, sizeof out);
    snprintf(path, sizeof path, "%s/freed.err", g_tmp);
    slurp(path, err, sizeof err);
    snprintf(want, sizeof want, "vmmctl: skipped pid %s's allocation at 0x%llx: freed before it could be imported",
             pid, (unsigned long long)o->info.addr[second]);
    CHECK(rc == 0 && strstr(out, "dumped 1 allocation of pid") && strstr(out, "; 1 skipped, 0 failed") &&
              strncmp(err, want, strlen(want)) == 0 && count_lines(err) == 1,
          "freed meanwhile: rc %d: %s%s", rc, out, err);
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    CHECK(slurp(path, manifest, sizeof manifest), "no manifest");
    check_dumped(dir, manifest, o->info.addr[first], o->info.requested[first], o->info.fnv[first]);
    entry_of(manifest, o->info.addr[second], line, sizeof line);
    snprintf(want, sizeof want, "\"tag\": \"fo-%d\"", second);
    CHECK(strstr(line, "\"api\": \"test\"") && strstr(line, want) &&
              strstr(line, "\"status\": \"skipped\", \"file\": null, \"xxh3_64\": null, \"reason\": \"freed before"),
          "the freed allocation: %s", line);

    /* by address: the same race fails the dump, and leaves no file */
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)o->info.addr[first]);
    snprintf(path, sizeof path, "%s/freed.bin", g_tmp);
    const char *const one[] = {"dump", pid, addr, "-o", path, NULL};
    dump = ctl_start(NULL, one, "freed1");
    CHECK(read_full(o->evt, &c, 1), "the dump never asked for it");
    CHECK(fo_cmd(o, 'R', first), "free it");
    CHECK(write_full(o->go, "g", 1), "release the broker");
    rc = wait_status(dump);
    snprintf(path, sizeof path, "%s/freed1.err", g_tmp);
    slurp(path, err, sizeof err);
    snprintf(path, sizeof path, "%s/freed.bin", g_tmp);
    CHECK(rc == 1 && strstr(err, "vmmctl: error: ") && strstr(err, "freed before it could be imported") &&
              count_lines(err) == 1 && access(path, F_OK) != 0,
          "freed meanwhile, by address: rc %d: %s", rc, err);
    CHECK(fo_cmd(o, 'H', 0), "stop holding");
}

/* ------------------------------------------------------------------------------------------ */
/* watch                                                                                       */

static void case_watch(fork_owner *o)
{
    char pid[16], l1[2048] = "", l2[2048] = "", want[256];
    snprintf(pid, sizeof pid, "%d", (int)o->pid);
    int p[2];
    if (pipe(p)) return;
    fflush(stdout);
    pid_t w = fork();
    if (w == 0) {
        dup2(p[1], 1);
        close(p[0]);
        alarm(60);
        execl(g_ctl, g_ctl, "watch", "--pid", pid, "--count", "2", "--interval", "1.5", (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    FILE *f = fdopen(p[0], "r");
    /* the owner publishes an allocation between the two ticks */
    bool got1 = f && fgets(l1, sizeof l1, f);
    CHECK(got1 && fo_cmd(o, 'P', 0), "first tick: %s", l1);
    bool got2 = f && fgets(l2, sizeof l2, f);
    CHECK(got2 && f && !fgets(want, sizeof want, f), "second tick, then the end: %s", l2);
    if (f) fclose(f);
    CHECK_EQ(wait_status(w), 0);
    snprintf(want, sizeof want, "{\"pid\": %s, \"state\": \"alive\", \"start_time\": ", pid);
    CHECK(strncmp(l1, "{\"tick\": 1, \"time\": \"20", 23) == 0 && strstr(l1, want) && strstr(l1, "\"new\": true") &&
              strstr(l1, "\"n_allocs\": 0, \"bytes_requested\": 0, \"bytes_mapped\": 0, \"delta_allocs\": 0, "
                         "\"delta_bytes_requested\": 0, \"delta_bytes_mapped\": 0, \"cmdline\": \"") &&
              l1[strlen(l1) - 2] == '}',
          "first tick: %s", l1);
    CHECK(strncmp(l2, "{\"tick\": 2, ", 12) == 0 && strstr(l2, want) && strstr(l2, "\"new\": false") &&
              strstr(l2, "\"n_allocs\": 1, \"bytes_requested\": 123456, \"bytes_mapped\": 2097152, "
                         "\"delta_allocs\": 1, \"delta_bytes_requested\": 123456, \"delta_bytes_mapped\": 2097152,"),
          "second tick: %s", l2);

    /* on a terminal: the screen cleared and a table */
    char tty[8192], row[512], cell[32];
    const char *const args[] = {"watch", "--pid", pid, "--count", "1", NULL};
    int rc = ctl_on_tty(args, tty, sizeof tty);
    snprintf(cell, sizeof cell, "%7s alive ", pid);
    line_with(tty, cell, row, sizeof row);
    CHECK(rc == 0 && strncmp(tty, "\033[H\033[2JEvery 1.0s: vmmctl watch", 28) == 0 && strstr(tty, "REQUESTED") &&
              strstr(row, "120.6 KiB") && strstr(tty, "1 process, 1 allocation,"),
          "on a terminal: rc %d: %s", rc, tty);

    /* SIGTERM ends it at once, cleanly */
    if (pipe(p)) return;
    w = fork();
    if (w == 0) {
        dup2(p[1], 1);
        close(p[0]);
        alarm(60);
        execl(g_ctl, g_ctl, "watch", "--interval", "30", (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    f = fdopen(p[0], "r");
    CHECK(f && fgets(l1, sizeof l1, f), "a first tick");
    double t0 = now_s();
    kill(w, SIGTERM);
    rc = wait_status(w);
    CHECK(rc == 0 && now_s() - t0 < 5, "SIGTERM: rc %d after %.1f s", rc, now_s() - t0);
    if (f) fclose(f);

    CTL(NULL, "watch", "--count", "0");
    CHECK(g_r.status == 2 && one_error_line(&g_r), "count 0: %d %s", g_r.status, g_r.err);
    CTL(NULL, "watch", "--interval", "nan");
    CHECK(g_r.status == 2 && one_error_line(&g_r), "interval nan: %d %s", g_r.status, g_r.err);
    CTL(NULL, "watch", "--pid");
    CHECK(g_r.status == 2 && one_error_line(&g_r), "--pid without a value: %d %s", g_r.status, g_r.err);
}

/* ------------------------------------------------------------------------------------------ */

static void remove_tree(const char *path)
{
    DIR *d = opendir(path);
    if (!d) {
        unlink(path);
        return;
    }
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        remove_tree(sub);
    }
    closedir(d);
    rmdir(path);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b && *b ? b : "build");
    snprintf(g_ctl, sizeof g_ctl, "%s/vmmctl", g_build);
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_reg, sizeof g_reg, "/vmmshim-tdump-%d", (int)getpid());
    snprintf(g_dir, sizeof g_dir, "/tmp/vmmshim-tdump-%d", (int)getpid());
    snprintf(g_tmp, sizeof g_tmp, "/tmp/vmmshim-tdump-out-%d", (int)getpid());
    /* the owners, vmmctl and this process all use this registry and broker directory */
    setenv("VMMSHIM_REGISTRY", g_reg, 1);
    setenv("VMMSHIM_BROKER_DIR", g_dir, 1);
    if (!load_driver()) {
        printf("skip: test_dump needs the emulated driver (build/fakecuda/libcuda.so.1 on LD_LIBRARY_PATH)\n");
        CHECK_DONE();
    }
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), *sym = h ? dlsym(h, "fakecuda_set_copy_delay_us") : NULL;
    memcpy(&set_copy_delay, &sym, sizeof sym);
    sym = h ? dlsym(h, "cuCtxGetCurrent") : NULL;
    memcpy(&ctx_get_current, &sym, sizeof sym);
    CHECK(set_copy_delay && ctx_get_current, "fakecuda_set_copy_delay_us, cuCtxGetCurrent");
    if (!set_copy_delay || !ctx_get_current) CHECK_DONE();
    CHECK(mkdir(g_tmp, 0700) == 0, "mkdir %s", g_tmp);

    /* a forked owner that died fails its checks, and says how (fo_cmd), instead of SIGPIPE */
    signal(SIGPIPE, SIG_IGN);
    /* the forked owner first, while this process has imported nothing it could inherit */
    fork_owner fo;
    bool have_fo = fo_start(&fo);
    case_api();
    case_dump_one();
    case_dump_all();
    case_dead_owner();
    if (have_fo) {
        case_freed_meanwhile(&fo);
        case_watch(&fo);
        fo_end(&fo);
    }
    remove_tree(g_tmp);
    remove_tree(g_dir);
    shm_unlink(g_reg);
    CHECK_DONE();
}
