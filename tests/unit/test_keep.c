/* vmmctl keep and release (a keeper: shim/registry/layout.h KEEP), over the emulated driver.
 *
 * Owners are tests/progs/spans under the shim, driven line by line: buffers filled with known
 * words, freed, an exit code, a crash; tests/progs/named for named tensors.  The keeper is
 * build/vmmctl keep in the background, its events read from its output file.  The emulated
 * driver's memory is memfds, so what a process holds is the set of memfd inodes in its fd table
 * (/proc/PID/fd): the keeper holds nothing the owner let go of when its inodes are a subset of
 * the owner's, and memory is back when nobody holds an inode.
 *
 * Cases: keep, SIGKILL the owner, then `list --all` (kept, naming the keeper), `dump` (checksums
 * against the words written, manifest naming the keeper and the signal), `import-test`, the
 * client library in this process (vmm_find says kept; vmm_import of two allocations of one chunk,
 * the second from the chunk cache; vmm_import_check; vmm_import_range; vmm_import_many over a
 * multi-handle allocation), `gc` leaving them, `release`, then gc reclaiming them and the memory
 * gone; free and reallocate under a keeper (each freed chunk let go of within the give-back delay,
 * at once with no delay: the owner rings; nothing held beyond the owner's own at the end); the
 * out-of-memory handshake (the owner rings and the keeper answers before the shim gives up); a
 * keeper SIGKILLed while its owner lives (the owner goes on; a second keeper takes over) and
 * after it died (gc reclaims the records and the keep file); two owners kept by one keeper;
 * exit(3) kept, exit(0) not; a crash (SIGSEGV); --on-exit dump; named tensors after the owner's
 * death; --all picking up a later process; --daemon and release; bad input: a pid not under
 * the shim, a second keeper for one pid (refused), a dead pid, release of an unkept pid, usage;
 * and the device full when the keeper starts. */
#include "check.h"
#include "registry/layout.h"
#include "spawn.h"
#include "vmmshim.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define MIB (1ull << 20)
#define SEG (20 * MIB) /* one 20 MiB request: one new segment of the stream-ordered pool's size */
#define K 0x9e3779b97f4a7c15ull

static char g_build[512], g_preload[700], g_ctl[600], g_reg[64], g_tmp[128];

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&t, NULL);
}

/* XXH3-64 (the dump manifest's checksum, libxxhash's) of `bytes` bytes of the words
 * `w <index> <seed>` writes. */
static uint64_t words_xxh3(uint64_t seed, uint64_t bytes)
{
    uint64_t *words = calloc(1, bytes ? bytes : 1);
    if (!words) return 0;
    for (uint64_t k = 0; k < bytes / 8; k++) {
        uint64_t w = seed * K + k;
        for (int b = 0; b < 8; b++) ((uint8_t *)words)[8 * k + b] = (uint8_t)(w >> (8 * b));
    }
    uint64_t h = XXH3_64bits(words, bytes);
    free(words);
    return h;
}

static bool slurp(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    buf[0] = 0;
    if (!f) return false;
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = 0;
    fclose(f);
    return true;
}

/* ------------------------------------------------------------------------------------------ */
/* Owners                                                                                      */

typedef struct owner {
    pid_t pid;
    FILE *to, *from;
    bool reaped;
} owner;

/* progs/<prog> under the shim, extra environment ("K=V", NULL-terminated). */
static bool owner_start(owner *o, const char *prog, const char *const env[])
{
    memset(o, 0, sizeof *o);
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC)) return false;
    char path[600];
    snprintf(path, sizeof path, "%s/progs/%s", g_build, prog);
    fflush(stdout);
    fflush(stderr);
    o->pid = fork();
    if (o->pid < 0) return false;
    if (o->pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        putenv(g_preload);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        struct rlimit no_core = {0, 0}; /* a crash case leaves no core file */
        setrlimit(RLIMIT_CORE, &no_core);
        alarm(300);
        char *argv[] = {path, NULL};
        execv(path, argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    o->to = fdopen(in[1], "w");
    o->from = fdopen(out[0], "r");
    return o->to && o->from;
}

__attribute__((format(printf, 3, 4))) static bool cmd(owner *o, char *answer, const char *fmt, ...)
{
    char sink[256], *a = answer ? answer : sink;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(o->to, fmt, ap);
    va_end(ap);
    fputc('\n', o->to);
    fflush(o->to);
    a[0] = 0;
    if (!fgets(a, 256, o->from)) return false;
    return strncmp(a, "ok", 2) == 0;
}

/* cudaMalloc ('a') or cudaMallocAsync ('A') of bytes, filled with seed's words: its index. */
static int alloc_fill(owner *o, char how, uint64_t bytes, uint64_t seed, uint64_t *addr)
{
    char a[256];
    int idx = -1;
    unsigned long long p = 0;
    if (!cmd(o, a, "%c %llu", how, (unsigned long long)bytes) || sscanf(a, "ok %d 0x%llx", &idx, &p) != 2) {
        fprintf(stderr, "owner: %s", a);
        return -1;
    }
    if (!cmd(o, NULL, "w %d %llu", idx, (unsigned long long)seed)) return -1;
    *addr = p;
    return idx;
}

static int reap(owner *o)
{
    if (o->reaped) return 0;
    int st = 0;
    if (o->to) fclose(o->to);
    if (o->from) fclose(o->from);
    o->to = o->from = NULL;
    waitpid(o->pid, &st, 0);
    o->reaped = true;
    return st;
}

static void owner_quit(owner *o)
{
    if (o->reaped) return;
    fprintf(o->to, "q\n");
    fflush(o->to);
    reap(o);
}

/* ------------------------------------------------------------------------------------------ */
/* vmmctl                                                                                      */

typedef struct result {
    int status;
    char out[32768], err[8192];
} result;
static result R;

static int ctl_v(const char *const args[])
{
    char *argv[24] = {g_ctl};
    int n = 1;
    for (; args[n - 1] && n < 23; n++) argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    R.status = spawn_capture(argv, NULL, R.out, sizeof R.out, R.err, sizeof R.err, 60);
    return R.status;
}

#define CTL(...)                                         \
    do {                                                 \
        const char *const args_[] = {__VA_ARGS__, NULL}; \
        ctl_v(args_);                                    \
    } while (0)

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static bool one_error_line(void) { return strncmp(R.err, "vmmctl: error: ", 15) == 0 && count_lines(R.err) == 1; }

typedef struct keeper {
    pid_t pid;
    char out[256];
    bool reaped;
    int status;
} keeper;

/* vmmctl keep ARGS... in the background, its output to a file. */
static bool keeper_start_v(keeper *k, const char *tag, const char *const args[])
{
    memset(k, 0, sizeof *k);
    snprintf(k->out, sizeof k->out, "%s/%s.out", g_tmp, tag);
    char *argv[24] = {g_ctl, "keep"};
    int n = 2;
    for (; args[n - 2] && n < 23; n++) argv[n] = (char *)args[n - 2];
    argv[n] = NULL;
    fflush(stdout);
    fflush(stderr);
    k->pid = fork();
    if (k->pid == 0) {
        int o = open(k->out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(o, 1);
        dup2(o, 2);
        alarm(200);
        execv(argv[0], argv);
        _exit(127);
    }
    return k->pid > 0;
}

#define KEEPER(k, tag, ...)                              \
    do {                                                 \
        const char *const args_[] = {__VA_ARGS__, NULL}; \
        keeper_start_v((k), (tag), args_);               \
    } while (0)

/* Wait until the keeper's output holds `needle` `times` times, within ms; false on timeout. */
static bool keeper_says(keeper *k, const char *needle, int times, unsigned ms)
{
    static char buf[65536];
    uint64_t until = now_ms() + ms;
    do {
        slurp(k->out, buf, sizeof buf);
        int n = 0;
        for (const char *p = buf; (p = strstr(p, needle)) != NULL; p++) n++;
        if (n >= times) return true;
        sleep_ms(5);
    } while (now_ms() < until);
    fprintf(stderr, "keeper output (waiting for %d x \"%s\"):\n%s", times, needle, buf);
    return false;
}

static int keeper_wait(keeper *k, unsigned ms)
{
    if (k->reaped) return k->status;
    uint64_t until = now_ms() + ms;
    int st = 0;
    while (waitpid(k->pid, &st, WNOHANG) == 0) {
        if (now_ms() > until) {
            kill(k->pid, SIGKILL);
            waitpid(k->pid, &st, 0);
            k->reaped = true;
            return k->status = -1;
        }
        sleep_ms(5);
    }
    k->reaped = true;
    return k->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* ------------------------------------------------------------------------------------------ */
/* What a process holds: the emulated driver's memfd inodes in its fd table                    */

typedef struct inodes {
    uint64_t ino[512];
    int n;
} inodes;

static void memfds(pid_t pid, inodes *s)
{
    s->n = 0;
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        char link[600], target[256];
        snprintf(link, sizeof link, "%s/%s", dir, e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        struct stat st;
        if (strncmp(target, "/memfd:fakecuda", 15) != 0 || stat(link, &st) != 0) continue;
        bool seen = false;
        for (int i = 0; i < s->n; i++) seen |= s->ino[i] == (uint64_t)st.st_ino;
        if (!seen && s->n < 512) s->ino[s->n++] = (uint64_t)st.st_ino;
    }
    closedir(d);
}

/* Also the memfds the process maps (the owner's chunks are mapped, their fds may be closed). */
static void memfds_mapped(pid_t pid, inodes *s)
{
    memfds(pid, s);
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        unsigned long long ino;
        char name[300];
        if (!strstr(line, "/memfd:fakecuda") || sscanf(line, "%*s %*s %*s %*s %llu %299s", &ino, name) != 2) continue;
        bool seen = false;
        for (int i = 0; i < s->n; i++) seen |= s->ino[i] == ino;
        if (!seen && s->n < 512) s->ino[s->n++] = ino;
    }
    fclose(f);
}

/* Inodes of a that b lacks. */
static int beyond(const inodes *a, const inodes *b)
{
    int n = 0;
    for (int i = 0; i < a->n; i++) {
        bool in = false;
        for (int k = 0; k < b->n; k++) in |= a->ino[i] == b->ino[k];
        n += !in;
    }
    return n;
}

/* The keeper holds nothing beyond what the owner holds (fds and mappings). */
static bool nothing_extra(pid_t keeper, pid_t owner)
{
    inodes k, o;
    memfds(keeper, &k);
    memfds_mapped(owner, &o);
    return beyond(&k, &o) == 0;
}

/* Wait until the keeper holds no memfd at all; the ms it took, or -1 past limit_ms. */
static long until_none(pid_t keeper, unsigned limit_ms)
{
    uint64_t t0 = now_ms();
    do {
        inodes k;
        memfds(keeper, &k);
        if (k.n == 0) return (long)(now_ms() - t0);
        sleep_ms(1);
    } while (now_ms() - t0 < limit_ms);
    return -1;
}

/* The keep file of pid, as /dev/shm names it (registry name, pid, start time). */
static bool keep_file_of(pid_t pid, char *path, size_t len)
{
    char prefix[128];
    snprintf(prefix, sizeof prefix, "%s.keep.%d.", g_reg + 1, (int)pid);
    DIR *d = opendir("/dev/shm");
    bool found = false;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;)
        if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) {
            snprintf(path, len, "/dev/shm/%s", e->d_name);
            found = true;
        }
    if (d) closedir(d);
    return found;
}

static void pid_str(pid_t pid, char *buf) { sprintf(buf, "%d", (int)pid); }

/* ------------------------------------------------------------------------------------------ */
/* Cases                                                                                       */

/* Keep, SIGKILL the owner, read it back every way, release. */
static void t_killed(void)
{
    owner o;
    const char *env[] = {"VMMSHIM_GIVE_BACK_MS=60000", "VMMSHIM_CACHE_SIZE=8G", NULL};
    if (!owner_start(&o, "spans", env)) {
        CHECK(false, "cannot start the owner");
        return;
    }
    uint64_t big, small1, small2, span;
    int ib = alloc_fill(&o, 'a', 3 * MIB, 11, &big);
    int is1 = alloc_fill(&o, 'a', 4096, 12, &small1), is2 = alloc_fill(&o, 'a', 8192, 13, &small2);
    /* three freed 20 MiB segments, then their total: an allocation across them (MULTI-HANDLE) */
    uint64_t unused;
    int first = alloc_fill(&o, 'A', SEG, 1, &unused);
    alloc_fill(&o, 'A', SEG, 2, &unused);
    alloc_fill(&o, 'A', SEG, 3, &unused);
    for (int i = 0; i < 3; i++) cmd(&o, NULL, "f %d", first + i);
    int isp = alloc_fill(&o, 'A', 3 * SEG, 14, &span);
    CHECK(ib >= 0 && is1 >= 0 && is2 >= 0 && first >= 0 && isp >= 0, "the owner's allocations");
    char pid[16];
    pid_str(o.pid, pid);

    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    vmm_alloc_info sp;
    memset(&sp, 0, sizeof sp);
    CHECK(reg && vmm_find(reg, (uint32_t)o.pid, span, &sp) == VMM_OK && (sp.flags & VMM_ALLOC_MULTI_HANDLE) &&
              sp.n_handles >= 2,
          "the 60 MiB allocation spans several handles (flags 0x%x, %u)", sp.flags, sp.n_handles);

    keeper k;
    KEEPER(&k, "killed", pid, "--settle", "0");
    CHECK(keeper_says(&k, "holding 4 allocations", 1, 10000), "the keeper holds the owner's 4 allocations");
    CHECK(nothing_extra(k.pid, o.pid), "the keeper holds nothing the owner does not");
    CTL("ps");
    CHECK(R.status == 0 && strstr(R.out, " alive "), "ps while kept and alive: %s", R.out);
    /* a second keeper for the same pid is refused, nothing lost */
    CTL("keep", pid);
    CHECK(R.status == 1 && one_error_line() && strstr(R.err, "kept already, by keeper pid"), "second keeper: %d %s",
          R.status, R.err);

    kill(o.pid, SIGKILL); /* not reaped yet: the keeper reads how it ended from its zombie */
    CHECK(keeper_says(&k, "killed by signal 9 (SIGKILL): keeping 4 allocations", 1, 10000), "the keeper keeps them");
    reap(&o);

    CTL("list", "--all");
    CHECK(R.status == 0 && strstr(R.out, " kept ") && strstr(R.out, "kept by keeper pid") &&
              strstr(R.out, "killed by signal 9"),
          "list --all: %s", R.out);
    CTL("ps");
    CHECK(strstr(R.out, " kept ") && strstr(R.out, "1 kept"), "ps: %s", R.out);

    /* dump: every byte as written */
    char dir[256], man[300], manifest[16384];
    snprintf(dir, sizeof dir, "%s/dump-killed", g_tmp);
    CTL("dump", pid, "-o", dir);
    CHECK(R.status == 0 && strstr(R.out, "dumped 4 allocations"), "dump of the dead, kept pid: %d %s %s", R.status,
          R.out, R.err);
    snprintf(man, sizeof man, "%s/manifest.json", dir);
    slurp(man, manifest, sizeof manifest);
    struct {
        uint64_t addr, size, seed;
    } want[] = {{big, 3 * MIB, 11}, {small1, 4096, 12}, {small2, 8192, 13}, {span, 3 * SEG, 14}};
    for (size_t i = 0; i < 4; i++) {
        char needle[160];
        snprintf(needle, sizeof needle, "\"address_hex\": \"0x%llx\", \"size\": %llu,", (unsigned long long)want[i].addr,
                 (unsigned long long)want[i].size);
        const char *line = strstr(manifest, needle);
        char sum[48];
        snprintf(sum, sizeof sum, "\"xxh3_64\": \"%016llx\"", (unsigned long long)words_xxh3(want[i].seed, want[i].size));
        const char *eol = line ? strchr(line, '\n') : NULL;
        const char *hit = line ? strstr(line, sum) : NULL;
        CHECK(hit && (!eol || hit < eol), "dump checksum of 0x%llx", (unsigned long long)want[i].addr);
    }
    char kb[64];
    snprintf(kb, sizeof kb, "\"kept_by\": %d,", (int)k.pid);
    CHECK(strstr(manifest, kb) && strstr(manifest, "\"owner_ended\": \"killed by signal 9 (SIGKILL)\"") &&
              strstr(manifest, "\"owner_alive_after\": false"),
          "manifest names the keeper and the end: %.600s", manifest);

    /* import-test, and this process through the client library */
    char addr[32];
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)small2);
    CTL("import-test", pid, addr);
    CHECK(R.status == 0, "import-test of a kept allocation: %s %s", R.out, R.err);
    vmm_alloc_info a1, a2;
    if (reg && vmm_find(reg, (uint32_t)o.pid, small1, &a1) == VMM_OK && vmm_find(reg, (uint32_t)o.pid, small2, &a2) == VMM_OK) {
        CHECK(a1.owner_alive == VMM_OWNER_KEPT && (a1.flags & VMM_ALLOC_KEPT), "kept: owner %d flags 0x%x",
              a1.owner_alive, a1.flags);
        CHECK(a1.chunk_id == a2.chunk_id, "the small allocations share a chunk");
        vmm_imported *i1 = NULL, *i2 = NULL;
        vmm_status s1 = vmm_import(reg, &a1, &i1), s2 = vmm_import(reg, &a2, &i2);
        vmm_import_timing tm;
        vmm_import_last_timing(&tm);
        CHECK(s1 == VMM_OK && s2 == VMM_OK && tm.cached == 1, "imports of one kept chunk (%d %d, cached %u): %s", s1,
              s2, tm.cached, vmm_last_error());
        uint64_t w[2] = {0, 0};
        if (i2) vmm_import_read(i2, 8, w, 16);
        CHECK(w[0] == 13 * K + 1 && w[1] == 13 * K + 2, "bytes of a kept allocation");
        CHECK(i2 && vmm_import_check(reg, i2) == VMM_OK, "vmm_import_check of a kept allocation: %s", vmm_last_error());
        vmm_import_release(i1);
        vmm_import_release(i2);
        vmm_imported *r = NULL;
        CHECK(vmm_import_range(reg, (uint32_t)o.pid, big + MIB, MIB, &r) == VMM_OK, "range import: %s",
              vmm_last_error());
        if (r) {
            vmm_import_read(r, 0, w, 8);
            CHECK(w[0] == 11 * K + MIB / 8, "range bytes");
            vmm_import_release(r);
        }
        uint64_t addrs[2] = {span, big}, sizes[2] = {0, 0};
        vmm_imported *m[2] = {NULL, NULL};
        CHECK(vmm_import_many(reg, (uint32_t)o.pid, addrs, sizes, 2, m) == VMM_OK, "import_many: %s", vmm_last_error());
        if (m[0]) {
            vmm_import_read(m[0], 3 * SEG - 8, w, 8);
            CHECK(w[0] == 14 * K + 3 * SEG / 8 - 1, "the multi-handle allocation's last word");
        }
        for (int i = 0; i < 2; i++) vmm_import_release(m[i]);
        vmm_import_drop_idle();
    } else {
        CHECK(false, "vmm_find of the kept allocations: %s", vmm_last_error());
    }

    CTL("gc");
    CHECK(R.status == 0 && strstr(R.out, "reclaimed 0 records") && strstr(R.out, "left 1 kept process"), "gc: %s",
          R.out);
    inodes held;
    memfds(k.pid, &held);
    CHECK(held.n >= 4, "the keeper holds the chunks (%d memfds)", held.n);
    CTL("release", pid);
    CHECK(R.status == 0 && strstr(R.out, "released pid"), "release: %d %s %s", R.status, R.out, R.err);
    CHECK(keeper_wait(&k, 5000) == 0, "the keeper stops once nothing is left to keep (%d)", k.status);
    CHECK(!vmm_find(reg, (uint32_t)o.pid, big, &a1) && a1.owner_alive == VMM_OWNER_DEAD, "released: dead again");
    CTL("gc");
    CHECK(R.status == 0 && strstr(R.out, "reclaimed 4 records from 1 dead process"), "gc after release: %s", R.out);
    char kf[300];
    CHECK(!keep_file_of(o.pid, kf, sizeof kf), "the keep file is gone");
    vmm_close(reg);
}

/* Free and reallocate under a keeper: what the owner gives back, the keeper has let go of. */
static void t_churn(void)
{
    for (int round = 0; round < 2; round++) {
        const char *delay = round == 0 ? "VMMSHIM_GIVE_BACK_MS=200" : "VMMSHIM_GIVE_BACK_MS=0";
        const char *env[] = {delay, NULL};
        owner o;
        if (!owner_start(&o, "spans", env)) {
            CHECK(false, "cannot start the owner");
            return;
        }
        char pid[16];
        pid_str(o.pid, pid);
        uint64_t first;
        int f0 = alloc_fill(&o, 'a', 1024, 1, &first); /* the owner registers at its first allocation */
        CHECK(f0 >= 0 && cmd(&o, NULL, "f %d", f0), "the owner's first allocation");
        keeper k;
        KEEPER(&k, round ? "churn0" : "churn200", pid, "--settle", "0");
        CHECK(keeper_says(&k, "keeping (", 1, 5000), "the keeper starts");
        uint64_t a;
        long worst = 0;
        for (int i = 0; i < 6; i++) {
            int idx = alloc_fill(&o, 'a', (uint64_t)(i + 2) * MIB, 20 + (uint64_t)i, &a);
            char want[64];
            snprintf(want, sizeof want, "holding 1 allocation in");
            CHECK(idx >= 0 && keeper_says(&k, want, i + 1, 5000), "round %d: held %d", round, i);
            inodes kh;
            memfds(k.pid, &kh);
            CHECK(kh.n >= 1, "the keeper holds the new chunk");
            cmd(&o, NULL, "f %d", idx);
            /* the bound: the owner's give-back delay and the 100 ms a busy CI machine may add */
            long ms = until_none(k.pid, 2000);
            CHECK(ms >= 0 && ms <= (round == 0 ? 300 : 100), "round %d: freed chunk %d let go of after %ld ms", round,
                  i, ms);
            if (ms > worst) worst = ms;
        }
        printf("figure: GIVE_BACK_MS=%d: a freed chunk let go of by the keeper within %ld ms\n", round ? 0 : 200,
               worst);
        sleep_ms(round == 0 ? 400 : 50); /* the owner gives its segments back */
        inodes kh, oh;
        memfds(k.pid, &kh);
        memfds_mapped(o.pid, &oh);
        CHECK(kh.n == 0, "nothing is held once the owner freed everything (%d memfds in the keeper, %d in the owner)",
              kh.n, oh.n);
        owner_quit(&o);
        CHECK(keeper_says(&k, "exited with code 0: nothing of it was held", 1, 5000), "a clean exit: nothing kept");
        CHECK(keeper_wait(&k, 5000) == 0, "the keeper stops");
    }
}

/* A paused owner's memory leaves the device although a keeper held it: the pause rings the
 * keeper, which lets go of paused records before the pause returns (else its fds would be all that
 * keeps the released handles alive); at resume it takes the new chunks again. */
static void t_pause(void)
{
    owner o;
    if (!owner_start(&o, "spans", NULL)) {
        CHECK(false, "cannot start the owner");
        return;
    }
    char pid[16], answer[256];
    pid_str(o.pid, pid);
    uint64_t a;
    int i0 = alloc_fill(&o, 'a', 6 * MIB, 31, &a), i1 = alloc_fill(&o, 'a', 3 * MIB, 32, &a);
    keeper k;
    KEEPER(&k, "pause", pid, "--settle", "0");
    CHECK(i0 >= 0 && i1 >= 0 && keeper_says(&k, "holding 2 allocations in", 1, 5000), "the keeper holds both");
    inodes kh;
    memfds(k.pid, &kh);
    CHECK(kh.n >= 2, "the keeper holds the chunks (%d memfds)", kh.n);
    CHECK(cmd(&o, answer, "P 0") && !strncmp(answer, "ok ", 3), "pause: %s", answer);
    memfds(k.pid, &kh);
    inodes oh;
    memfds_mapped(o.pid, &oh);
    CHECK(kh.n == 0 && oh.n == 0, "paused: the keeper holds %d memfds and the owner %d (the memory would stay alive)", kh.n,
          oh.n);
    CHECK(cmd(&o, answer, "R") && !strncmp(answer, "ok ", 3), "resume: %s", answer);
    CHECK(cmd(&o, answer, "v %d 31", i0) && cmd(&o, answer, "v %d 32", i1), "the bytes came back: %s", answer);
    long ms = -1;
    for (unsigned waited = 0; waited < 5000 && ms < 0; waited += 20) {
        memfds(k.pid, &kh);
        if (kh.n >= 2) ms = waited;
        else sleep_ms(20);
    }
    CHECK(ms >= 0, "the keeper holds the resumed chunks again (%d memfds)", kh.n);
    owner_quit(&o);
    CHECK(keeper_wait(&k, 5000) == 0, "the keeper stops");
}

/* The owner's out-of-memory path rings its keeper and waits for its answer. */
static void t_oom_handshake(void)
{
    const char *env[] = {"FAKECUDA_MEM_BYTES=8M", NULL};
    owner o;
    if (!owner_start(&o, "spans", env)) {
        CHECK(false, "cannot start the owner");
        return;
    }
    char pid[16];
    pid_str(o.pid, pid);
    uint64_t a;
    CHECK(alloc_fill(&o, 'a', 2 * MIB, 5, &a) >= 0, "first allocation");
    keeper k;
    KEEPER(&k, "oom", pid, "--settle", "0");
    CHECK(keeper_says(&k, "holding 1 allocation", 1, 5000), "held");
    char kf[300];
    uint32_t bell0 = 0, done0 = 0, bell1 = 0, done1 = 0;
    int fd = keep_file_of(o.pid, kf, sizeof kf) ? open(kf, O_RDONLY) : -1;
    CHECK(fd >= 0, "the keep file is there");
    if (fd >= 0) {
        (void)!pread(fd, &bell0, 4, 56);
        (void)!pread(fd, &done0, 4, 60);
    }
    uint64_t t0 = now_ms();
    int i2 = alloc_fill(&o, 'a', 64 * MIB, 6, &a); /* the device is full: it fails, as natively */
    uint64_t took = now_ms() - t0;
    if (fd >= 0) {
        (void)!pread(fd, &bell1, 4, 56);
        (void)!pread(fd, &done1, 4, 60);
        close(fd);
    }
    CHECK(i2 < 0, "the allocation fails for memory");
    CHECK(bell1 > bell0 && (int32_t)(done1 - bell1) >= 0, "the owner rang (bell %u -> %u) and the keeper answered (done %u)",
          bell0, bell1, done1);
    CHECK(took < 2000, "out of memory with a keeper took %llu ms", (unsigned long long)took);
    printf("figure: an allocation failing for memory with a keeper attached: %llu ms (the let-go handshake included)\n",
           (unsigned long long)took);
    CHECK(alloc_fill(&o, 'a', 4 * MIB, 7, &a) >= 0, "what fits still does");
    owner_quit(&o);
    CHECK(keeper_wait(&k, 5000) == 0, "the keeper stops");
}

/* A keeper SIGKILLed: while its owner lives (nothing changes for the owner; another keeper takes
 * over), and after the owner died (its holds end with it; gc cleans up). */
static void t_keeper_killed(void)
{
    owner o;
    if (!owner_start(&o, "spans", NULL)) {
        CHECK(false, "cannot start the owner");
        return;
    }
    char pid[16];
    pid_str(o.pid, pid);
    uint64_t a;
    CHECK(alloc_fill(&o, 'a', 4 * MIB, 31, &a) >= 0, "allocation");
    keeper k1;
    KEEPER(&k1, "killed1", pid, "--settle", "0");
    CHECK(keeper_says(&k1, "holding 1 allocation", 1, 5000), "held");
    kill(k1.pid, SIGKILL);
    keeper_wait(&k1, 5000);
    int i2 = alloc_fill(&o, 'a', 6 * MIB, 32, &a);
    CHECK(i2 >= 0 && cmd(&o, NULL, "f %d", i2), "the owner goes on after its keeper died");
    CTL("list");
    CHECK(strstr(R.out, " alive "), "its allocations are as they were: %s", R.out);
    keeper k2;
    KEEPER(&k2, "killed2", pid, "--settle", "0");
    CHECK(keeper_says(&k2, "holding 1 allocation", 1, 5000), "a second keeper takes over from the dead one");
    kill(o.pid, SIGKILL);
    CHECK(keeper_says(&k2, "keeping 1 allocation", 1, 5000), "kept by the second keeper");
    reap(&o);
    kill(k2.pid, SIGKILL);
    keeper_wait(&k2, 5000);
    CTL("list", "--all");
    CHECK(strstr(R.out, " dead ") && !strstr(R.out, " kept "), "its keeper dead, the owner's records are dead: %s",
          R.out);
    CTL("gc");
    CHECK(strstr(R.out, "reclaimed 1 record from 1 dead process"), "gc: %s", R.out);
    char kf[300];
    CHECK(!keep_file_of(o.pid, kf, sizeof kf), "gc removed the dead keeper's keep file");
}

/* Two MULTI-HANDLE allocations that share a handle: the keeper holds that handle through both
 * chunks, and says it holds the device memory once (what NVML would show), not the sum. */
static void t_shared_handle(void)
{
    owner o;
    const char *env[] = {"VMMSHIM_GIVE_BACK_MS=60000", NULL};
    if (!owner_start(&o, "spans", env)) {
        CHECK(false, "cannot start the owner");
        return;
    }
    char pid[16];
    pid_str(o.pid, pid);
    uint64_t unused, a[2];
    int first = alloc_fill(&o, 'A', SEG, 1, &unused);
    alloc_fill(&o, 'A', SEG, 2, &unused);
    alloc_fill(&o, 'A', SEG, 3, &unused);
    for (int i = 0; i < 3; i++) cmd(&o, NULL, "f %d", first + i);
    int i0 = alloc_fill(&o, 'A', 3 * SEG / 2, 41, &a[0]), i1 = alloc_fill(&o, 'A', 3 * SEG / 2, 42, &a[1]);
    CHECK(first >= 0 && i0 >= 0 && i1 >= 0, "the owner's allocations");
    vmm_registry *reg = NULL;
    vmm_alloc_info r[2];
    memset(r, 0, sizeof r);
    bool found = vmm_open(g_reg, &reg) == VMM_OK && vmm_find(reg, (uint32_t)o.pid, a[0], &r[0]) == VMM_OK &&
                 vmm_find(reg, (uint32_t)o.pid, a[1], &r[1]) == VMM_OK;
    if (reg) vmm_close(reg);
    uint64_t lo[2], hi[2];
    for (int i = 0; i < 2; i++) {
        lo[i] = r[i].address - r[i].chunk_offset;
        hi[i] = lo[i] + r[i].mapped_size;
    }
    uint64_t sum = r[0].mapped_size + r[1].mapped_size;
    uint64_t both = (hi[0] > hi[1] ? hi[0] : hi[1]) - (lo[0] < lo[1] ? lo[0] : lo[1]);
    bool shared = found && (r[0].flags & r[1].flags & VMM_ALLOC_MULTI_HANDLE) && lo[0] < hi[1] && lo[1] < hi[0];
    CHECK(shared && both < sum, "two multi-handle allocations sharing a handle (chunks 0x%llx+%llu, 0x%llx+%llu)",
          (unsigned long long)lo[0], (unsigned long long)r[0].mapped_size, (unsigned long long)lo[1],
          (unsigned long long)r[1].mapped_size);
    keeper k;
    KEEPER(&k, "shared", pid, "--settle", "0");
    char want[96];
    snprintf(want, sizeof want, "holding 2 allocations in 2 chunks, %.1f MiB", (double)both / MIB);
    CHECK(keeper_says(&k, want, 1, 10000), "the keeper counts the shared handle once: \"%s\"", want);
    CHECK(nothing_extra(k.pid, o.pid), "the keeper holds nothing the owner does not");
    char kf[300], raw[sizeof(vmm_keep_file)];
    vmm_keep_file f;
    memset(&f, 0, sizeof f);
    int fd = keep_file_of(o.pid, kf, sizeof kf) ? open(kf, O_RDONLY) : -1;
    bool read_ok = fd >= 0 && pread(fd, raw, sizeof raw, 0) == (ssize_t)sizeof f;
    if (read_ok) memcpy(&f, raw, sizeof f);
    if (fd >= 0) close(fd);
    CHECK(read_ok && f.held_bytes == both && f.held_allocs == 2, "the keep file's held_bytes %llu (want %llu)",
          (unsigned long long)f.held_bytes, (unsigned long long)both);
    CTL("release", pid);
    char said[96];
    snprintf(said, sizeof said, "let go of 2 allocations, %.1f MiB", (double)both / MIB);
    CHECK(R.status == 0 && strstr(R.out, said), "release: %s %s", R.out, R.err);
    keeper_wait(&k, 5000);
    owner_quit(&o);
}

/* Two owners, one keeper; exit(3) kept, a crash kept, --on-exit dump, SIGTERM lets go of all. */
static void t_two_owners(void)
{
    owner o1, o2;
    if (!owner_start(&o1, "spans", NULL) || !owner_start(&o2, "spans", NULL)) {
        CHECK(false, "cannot start the owners");
        return;
    }
    char p1[16], p2[16], dumps[256];
    pid_str(o1.pid, p1);
    pid_str(o2.pid, p2);
    snprintf(dumps, sizeof dumps, "%s/ondeath", g_tmp);
    uint64_t a1, a2;
    CHECK(alloc_fill(&o1, 'a', 2 * MIB, 41, &a1) >= 0 && alloc_fill(&o2, 'A', 5 * MIB, 42, &a2) >= 0, "allocations");
    keeper k;
    KEEPER(&k, "two", p1, p2, "--settle", "0", "--on-exit", "dump", dumps);
    CHECK(keeper_says(&k, "holding 1 allocation", 2, 5000), "both held");
    fprintf(o1.to, "x 3\n");
    fflush(o1.to);
    CHECK(keeper_says(&k, "exited with code 3: keeping 1 allocation", 1, 5000), "exit(3) kept");
    CHECK(keeper_says(&k, "dump written to", 1, 20000), "--on-exit dump");
    reap(&o1);
    char man[300], manifest[8192];
    snprintf(man, sizeof man, "%s/%d/manifest.json", dumps, (int)o1.pid);
    slurp(man, manifest, sizeof manifest);
    char sum[48];
    snprintf(sum, sizeof sum, "\"xxh3_64\": \"%016llx\"", (unsigned long long)words_xxh3(41, 2 * MIB));
    CHECK(strstr(manifest, "\"owner_ended\": \"exited with code 3\"") && strstr(manifest, sum) &&
              strstr(manifest, "\"owner_ended_at\": \"20"),
          "the dump on exit: %.500s", manifest);
    fprintf(o2.to, "s\n"); /* a crash: SIGSEGV, no handler of its own (ASan's exits with 1) */
    fflush(o2.to);
    CHECK(keeper_says(&k, ": keeping 1 allocation", 2, 5000), "the crashed owner kept");
    CHECK(keeper_says(&k, "dump written to", 2, 20000), "its dump too");
    reap(&o2);
    {
        char buf[8192];
        slurp(k.out, buf, sizeof buf);
        char exited[64]; /* a sanitizer's handler turns the crash into an exit with its code */
        snprintf(exited, sizeof exited, "pid %d exited with code ", (int)o2.pid);
        CHECK(strstr(buf, "killed by signal 11 (SIGSEGV)") || strstr(buf, exited), "the crash: %s", buf);
    }
    CTL("list", "--all");
    CHECK(strstr(R.out, "2 allocations") && count_lines(R.out) >= 5, "both kept: %s", R.out);
    CTL("release", p1);
    CHECK(R.status == 0, "release of one: %s", R.err);
    CTL("list", "--all");
    CHECK(strstr(R.out, " dead ") && strstr(R.out, " kept "), "one released, one kept: %s", R.out);
    kill(k.pid, SIGTERM);
    CHECK(keeper_wait(&k, 5000) == 0, "SIGTERM: the keeper lets go and stops with 0");
    CTL("gc");
    CHECK(strstr(R.out, "reclaimed 2 records from 2 dead processes"), "gc: %s", R.out);
}

/* The settle time: an allocation younger than it is not held when its owner is killed, but an
 * owner exiting with a failure waits for its keeper to take everything. */
static void t_settle(void)
{
    owner o1, o2;
    if (!owner_start(&o1, "spans", NULL) || !owner_start(&o2, "spans", NULL)) {
        CHECK(false, "cannot start the owners");
        return;
    }
    char p1[16], p2[16];
    pid_str(o1.pid, p1);
    pid_str(o2.pid, p2);
    uint64_t a;
    CHECK(alloc_fill(&o1, 'a', 2 * MIB, 71, &a) >= 0 && alloc_fill(&o2, 'a', 2 * MIB, 72, &a) >= 0, "allocations");
    keeper k;
    KEEPER(&k, "settle", p1, p2, "--settle", "60000");
    CHECK(keeper_says(&k, "keeping (", 2, 5000), "kept from now on");
    CHECK(alloc_fill(&o1, 'a', 4 * MIB, 73, &a) >= 0, "another allocation");
    sleep_ms(100);
    char buf[4096];
    slurp(k.out, buf, sizeof buf);
    CHECK(!strstr(buf, "holding"), "nothing held before the settle time: %s", buf);
    fprintf(o1.to, "x 5\n");
    fflush(o1.to);
    CHECK(keeper_says(&k, "exited with code 5: keeping 2 allocations", 1, 5000), "exit(5): all taken as it exits");
    reap(&o1);
    kill(o2.pid, SIGKILL);
    CHECK(keeper_says(&k, "killed by signal 9 (SIGKILL): nothing of it was held", 1, 5000), "killed unsettled");
    reap(&o2);
    kill(k.pid, SIGTERM);
    CHECK(keeper_wait(&k, 5000) == 0, "stopped");
    CTL("gc");
    CHECK(strstr(R.out, "reclaimed 3 records from 2 dead processes"), "gc: %s", R.out);
}

/* Named tensors survive their owner. */
static void t_names(void)
{
    owner o;
    if (!owner_start(&o, "named", NULL)) {
        CHECK(false, "cannot start the owner");
        return;
    }
    char pid[16];
    pid_str(o.pid, pid);
    uint64_t a;
    int idx = alloc_fill(&o, 'a', MIB, 51, &a);
    char ans[256];
    CHECK(idx >= 0 && cmd(&o, ans, "p weight %d 0 f32 4x8", idx), "publish: %s", ans);
    keeper k;
    KEEPER(&k, "names", pid, "--settle", "0");
    CHECK(keeper_says(&k, "holding 1 allocation", 1, 5000), "held");
    kill(o.pid, SIGKILL);
    CHECK(keeper_says(&k, "keeping 1 allocation", 1, 5000), "kept");
    reap(&o);
    CTL("gc");
    CTL("list", "--names", "--pid", pid);
    CHECK(R.status == 0 && strstr(R.out, "weight"), "the names of a kept process: %s %s", R.out, R.err);
    vmm_registry *reg = NULL;
    vmm_tensor_info t;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK && vmm_find_tensor(reg, (uint32_t)o.pid, "weight", &t) == VMM_OK &&
              t.ndim == 2 && t.shape[1] == 8,
          "vmm_find_tensor on the dead pid: %s", vmm_last_error());
    uint64_t addrs[1] = {t.address}, sizes[1] = {t.nbytes}, w = 0;
    vmm_imported *m[1] = {NULL};
    CHECK(reg && vmm_import_many(reg, (uint32_t)o.pid, addrs, sizes, 1, m) == VMM_OK && m[0] &&
              vmm_import_read(m[0], 8, &w, 8) == VMM_OK && w == 51 * K + 1,
          "its bytes: %s", vmm_last_error());
    vmm_import_release(m[0]);
    vmm_import_drop_idle();
    vmm_close(reg);
    kill(k.pid, SIGINT);
    CHECK(keeper_wait(&k, 5000) == 0, "SIGINT stops the keeper");
    CTL("gc");
    CTL("list", "--names", "--pid", pid);
    CHECK(!strstr(R.out, "weight"), "names gone with the records: %s", R.out);
}

/* --all picks up a process started later; --daemon; device full at the start. */
static void t_all_daemon_full(void)
{
    keeper k;
    KEEPER(&k, "all", "--all", "--settle", "0", "--tag", "keepme");
    owner o, skip;
    const char *env[] = {"VMMSHIM_TAG=keepme", "FAKECUDA_MEM_BYTES=16M", NULL};
    const char *other[] = {"VMMSHIM_TAG=other", NULL};
    if (!owner_start(&o, "spans", env) || !owner_start(&skip, "spans", other)) {
        CHECK(false, "cannot start the owners");
        return;
    }
    uint64_t a;
    /* the owner's device fills up: 16 MiB of 16 */
    CHECK(alloc_fill(&o, 'a', 8 * MIB, 61, &a) >= 0 && alloc_fill(&o, 'a', 8 * MIB, 62, &a) >= 0 &&
              alloc_fill(&skip, 'a', MIB, 63, &a) >= 0,
          "allocations");
    char want[64];
    snprintf(want, sizeof want, "pid %d: holding 2 allocations", (int)o.pid);
    CHECK(keeper_says(&k, want, 1, 5000), "--all --tag: the tagged process's allocations held");
    char buf[8192];
    snprintf(want, sizeof want, "pid %d: holding", (int)skip.pid);
    slurp(k.out, buf, sizeof buf);
    CHECK(!strstr(buf, want), "the other tag's allocations are not held");
    kill(k.pid, SIGTERM);
    CHECK(keeper_wait(&k, 5000) == 0, "stopped");
    owner_quit(&skip);

    /* --daemon: the command returns once the keeper is set up; release ends it */
    char pid[16], log[256];
    pid_str(o.pid, pid);
    snprintf(log, sizeof log, "%s/daemon.log", g_tmp);
    CTL("keep", pid, "--settle", "0", "--daemon", "--log", log);
    CHECK(R.status == 0 && strstr(R.out, "runs in the background"), "--daemon: %d %s %s", R.status, R.out, R.err);
    keeper d = {.pid = 0};
    snprintf(d.out, sizeof d.out, "%s", log);
    CHECK(keeper_says(&d, "holding 2 allocations", 1, 5000), "the daemon holds the full device's memory");
    kill(o.pid, SIGKILL);
    CHECK(keeper_says(&d, "keeping 2 allocations", 1, 5000), "the daemon keeps them");
    reap(&o);
    char dir[256];
    snprintf(dir, sizeof dir, "%s/dump-daemon", g_tmp);
    CTL("dump", pid, "-o", dir);
    CHECK(R.status == 0 && strstr(R.out, "dumped 2 allocations"), "dump: %s %s", R.out, R.err);
    CTL("release", pid);
    CHECK(R.status == 0, "release: %s", R.err);
    CHECK(keeper_says(&d, "stops", 1, 5000), "the daemon stops with nothing left");
    CTL("gc");
}

static void t_bad_input(void)
{
    char self[16], dead[16];
    pid_str(getpid(), self);
    CTL("keep", self);
    CHECK(R.status == 1 && one_error_line() && strstr(R.err, "does not run under the shim"), "not under the shim: %s",
          R.err);
    owner o;
    if (owner_start(&o, "spans", NULL)) {
        uint64_t a;
        alloc_fill(&o, 'a', MIB, 1, &a);
        pid_str(o.pid, dead);
        kill(o.pid, SIGKILL); /* dead with its records, not kept */
        reap(&o);
        CTL("keep", dead);
        CHECK(R.status == 1 && one_error_line() && strstr(R.err, "has exited"), "a dead pid: %s", R.err);
        CTL("release", dead);
        CHECK(R.status == 1 && one_error_line() && strstr(R.err, "not kept"), "release of an unkept pid: %s", R.err);
        CTL("gc");
    }
    CTL("keep");
    CHECK(R.status == 2, "keep without a pid: usage (%d)", R.status);
    CTL("keep", "--all", "1");
    CHECK(R.status == 2, "keep with both: usage (%d)", R.status);
    CTL("keep", "1", "--on-exit", "dance");
    CHECK(R.status == 2, "a bad --on-exit: usage (%d)", R.status);
    CTL("release");
    CHECK(R.status == 2, "release without a pid: usage (%d)", R.status);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_ctl, sizeof g_ctl, "%s/vmmctl", g_build);
    snprintf(g_reg, sizeof g_reg, "/vmmshim-keep-%d", (int)getpid());
    setenv("VMMSHIM_REGISTRY", g_reg, 1);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/vmmshim-keep-test-%d", (int)getpid());
    mkdir(g_tmp, 0700);
    signal(SIGPIPE, SIG_IGN);

    struct {
        const char *name;
        void (*fn)(void);
    } cases[] = {{"killed", t_killed},     {"churn", t_churn},   {"oom_handshake", t_oom_handshake},
                 {"keeper_killed", t_keeper_killed}, {"shared_handle", t_shared_handle}, {"two_owners", t_two_owners}, {"settle", t_settle}, {"names", t_names}, {"pause", t_pause},
                 {"all_daemon_full", t_all_daemon_full}, {"bad_input", t_bad_input}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int f0 = check__failed;
        uint64_t t0 = now_ms();
        cases[i].fn();
        printf("%-22s %s (%.2f s)\n", cases[i].name, check__failed == f0 ? "ok" : "FAILED", (now_ms() - t0) / 1000.0);
        fflush(stdout);
    }
    char cmdline[400];
    snprintf(cmdline, sizeof cmdline, "%s", getenv("KEEP_TEST_KEEP_FILES") ? "true" : "");
    if (!cmdline[0]) snprintf(cmdline, sizeof cmdline, "rm -rf %s /dev/shm%s /dev/shm%s.*", g_tmp, g_reg, g_reg);
    (void)!system(cmdline);
    CHECK_DONE();
}
