/* Unit tests of the shared-memory registry (shim/registry): the created layout, publish / retract /
 * find, a million live records, owners killed mid-write, pid reuse, corrupt segments, a second
 * uid, concurrent attach from processes and threads.  Every test uses its own registry name
 * ("/vmmshim-t-<pid>-<n>") and unlinks it at the end. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "registry/registry.h"

#define MiB (UINT64_C(1) << 20)
#define TWO_MIB (2 * MiB)
#define BASE_ADDR 0x7f0000000000ull

/* ---- small helpers ---- */

static pid_t g_main_pid;
static char g_names[64][64];
static int g_nnames;

static const char *new_name(void)
{
    snprintf(g_names[g_nnames], sizeof g_names[0], "/vmmshim-t-%d-%d", (int)getpid(), g_nnames);
    return g_names[g_nnames++];
}

static void unlink_all(void)
{
    if (getpid() != g_main_pid) return;
    for (int i = 0; i < g_nnames; i++) shm_unlink(g_names[i]);
}

/* the watchdog (alarm) or a runner's timeout: remove our registries, then die of the signal */
static void on_fatal(int sig)
{
    unlink_all();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* fork whose child dies with its parent: a failed or killed test leaves no process behind */
static pid_t xfork(void)
{
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(99);
    }
    return pid;
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    uint64_t x = g_rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return g_rng = x;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static int open_reg(vmm__reg *r, const char *name, int mode, uint64_t cap)
{
    char err[256] = "";
    int rc = vmm__reg_open(r, name, mode, cap, NULL, err, sizeof err);
    CHECK(rc == 0, "open %s mode %d: %d %s", name, mode, rc, err);
    return rc;
}

static uint32_t *ix_of(const vmm__reg *r) { return (uint32_t *)(r->base + r->hdr->index_off); }
static uint64_t *chunks_of(const vmm__reg *r) { return (uint64_t *)(r->base + r->hdr->chunk_off); }
static vmm_reg_alloc *rec_of(const vmm__reg *r, uint64_t s)
{
    return (vmm_reg_alloc *)(r->base + r->hdr->rec_off + s * sizeof(vmm_reg_alloc));
}
static vmm_reg_proc *proc_of(const vmm__reg *r, uint32_t i)
{
    return (vmm_reg_proc *)(r->base + r->hdr->proc_off + (uint64_t)i * sizeof(vmm_reg_proc));
}

/* Index entries naming `slot` (UINT64_MAX: every non-empty entry), by scanning the index region. */
static uint64_t index_count(const vmm__reg *r, uint64_t slot)
{
    const uint32_t *ix = ix_of(r);
    uint64_t n = 0;
    for (uint64_t i = 0; i < r->hdr->index_slots; i++) {
        uint32_t e = __atomic_load_n(&ix[i], __ATOMIC_RELAXED);
        if (e != VMM_REG_IX_EMPTY && e != VMM_REG_IX_TOMB && (slot == UINT64_MAX || e == slot + 1)) n++;
    }
    return n;
}

static uint64_t chunks_owned(const vmm__reg *r)
{
    uint64_t n = 0;
    for (uint64_t c = 0; c < r->hdr->chunk_count; c++) n += __atomic_load_n(&chunks_of(r)[c], __ATOMIC_RELAXED) != 0;
    return n;
}

static void desc(vmm_reg_alloc *d, uint64_t req, const char *tag, uint32_t dev, uint32_t api)
{
    memset(d, 0, sizeof *d);
    d->requested_size = req;
    d->device = dev;
    d->api = api;
    d->exported_fd = -1;
    snprintf(d->tag, sizeof d->tag, "%s", tag);
}

typedef struct {
    uint32_t pid; /* 0: every record */
    uint64_t n, n_err, n_live, n_bound, dup;
    uint8_t *seen;
    uint64_t seen_len;
} visit_ctx;

static int visit_cb(void *ctx, uint64_t slot, const vmm_reg_alloc *rec, int rc)
{
    visit_ctx *v = ctx;
    if (v->pid && rc == 0 && rec->pid != v->pid) return 0;
    v->n++;
    if (rc) {
        v->n_err++;
        return 0;
    }
    if (rec->state == VMM_REG_LIVE) v->n_live++;
    if (rec->state == VMM_REG_BOUND) v->n_bound++;
    if (v->seen && slot < v->seen_len) {
        if (v->seen[slot]) v->dup++;
        v->seen[slot] = 1;
    }
    return 0;
}

static visit_ctx visit(const vmm__reg *r, uint32_t pid)
{
    visit_ctx v;
    memset(&v, 0, sizeof v);
    v.pid = pid;
    CHECK_EQ(vmm__reg_for_each(r, visit_cb, &v), 0);
    return v;
}

/* Forked children run CHECKs of their own and hand their counts back through a pipe. */
static pid_t fork_checked(int *fd)
{
    int p[2];
    if (pipe(p) != 0) return -1;
    fflush(NULL);
    pid_t pid = xfork();
    if (pid == 0) {
        close(p[0]);
        check__passed = check__failed = 0;
        *fd = p[1];
    } else {
        close(p[1]);
        *fd = p[0];
    }
    return pid;
}

static void child_done(int fd)
{
    int v[2] = {check__passed, check__failed};
    ssize_t n = write(fd, v, sizeof v);
    (void)n;
    _exit(check__failed ? 1 : 0);
}

static void child_merge(pid_t pid, int fd, const char *what)
{
    int v[2] = {0, 0}, st = 0;
    ssize_t n = read(fd, v, sizeof v);
    close(fd);
    waitpid(pid, &st, 0);
    if (n == (ssize_t)sizeof v) {
        check__passed += v[0];
        check__failed += v[1];
    }
    CHECK(n == (ssize_t)sizeof v && WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: child reported nothing or failed (status %#x)", what, st);
}

static int wait_killed(pid_t pid)
{
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
}

static int read_full(int fd, void *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, (char *)buf + got, len - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

static void shm_path(char *buf, size_t len, const char *name) { snprintf(buf, len, "/dev/shm%s", name); }

/* ---- layout of a created segment ---- */

static void check_header(const vmm__reg *r, const char *name, uint64_t want_cap)
{
    const vmm_reg_header *h = r->hdr;
    CHECK(h->magic == VMM_REG_MAGIC, "magic %#" PRIx64, h->magic);
    CHECK_EQ(h->version, VMM_REG_VERSION);
    CHECK_EQ(h->compat_version, VMM_REG_COMPAT_VERSION);
    CHECK(h->compat_version <= h->version, "compat %u > version %u", h->compat_version, h->version);
    CHECK_EQ(__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE), 1);
    CHECK(h->header_size >= sizeof(vmm_reg_header), "header_size %u", h->header_size);
    CHECK_EQ(h->proc_size, sizeof(vmm_reg_proc));
    CHECK_EQ(h->alloc_size, sizeof(vmm_reg_alloc));
    CHECK_EQ(h->chunk_records, VMM_REG_CHUNK_RECORDS);
    CHECK(h->capacity >= want_cap && h->capacity % VMM_REG_CHUNK_RECORDS == 0, "capacity %" PRIu64, h->capacity);
    CHECK(h->capacity < want_cap + VMM_REG_CHUNK_RECORDS, "capacity %" PRIu64 " for %" PRIu64, h->capacity, want_cap);
    CHECK_EQ(h->chunk_count * VMM_REG_CHUNK_RECORDS, h->capacity);
    CHECK(h->index_slots >= h->capacity && (h->index_slots & (h->index_slots - 1)) == 0, "index_slots %" PRIu64,
          h->index_slots);
    CHECK(h->proc_capacity > 0, "proc_capacity %u", h->proc_capacity);
    CHECK(h->proc_off >= h->header_size, "proc_off %" PRIu64, h->proc_off);
    CHECK(h->proc_off < h->chunk_off && h->chunk_off < h->index_off && h->index_off < h->rec_off,
          "offsets %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64, h->proc_off, h->chunk_off, h->index_off, h->rec_off);
    CHECK(h->chunk_off >= h->proc_off + (uint64_t)h->proc_capacity * h->proc_size, "proc table overlaps");
    CHECK(h->index_off >= h->chunk_off + h->chunk_count * 8, "chunk table overlaps");
    CHECK(h->rec_off >= h->index_off + h->index_slots * 4, "index overlaps");
    CHECK(h->total_size >= h->rec_off + h->capacity * h->alloc_size, "records overflow total_size");
    CHECK(h->proc_off % 8 == 0 && h->chunk_off % 8 == 0 && h->index_off % 8 == 0 && h->rec_off % 8 == 0, "alignment");
    CHECK_EQ(h->creator_pid, getpid());
    CHECK_EQ(h->creator_uid, getuid());
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    CHECK(h->created_ns <= now && now - h->created_ns < 600ull * 1000000000ull, "created_ns %" PRIu64, h->created_ns);
    CHECK_EQ(h->index_seq & 1, 0);
    CHECK_EQ(r->map_size, h->total_size);
    char path[128];
    struct stat st;
    shm_path(path, sizeof path, name);
    CHECK(stat(path, &st) == 0, "stat %s: %s", path, strerror(errno));
    CHECK_EQ(st.st_size, h->total_size);
    CHECK_EQ(st.st_uid, geteuid());
    char err[256] = "";
    CHECK_EQ(vmm__reg_validate(r->base, r->map_size, err, sizeof err), 0);
}

static void test_layout(void)
{
    vmm__reg r;
    char path[128], err[256];
    struct stat st;

    /* mode 0600 whatever the umask: 0 would give 0666 if the code relied on it, 0277 gives 0400 */
    static const mode_t masks[] = {0, 0277};
    for (int m = 0; m < 2; m++) {
        const char *name = new_name();
        mode_t old = umask(masks[m]);
        int rc = open_reg(&r, name, VMM__REG_CREATE, 1000);
        umask(old);
        if (rc) continue;
        check_header(&r, name, 1000);
        shm_path(path, sizeof path, name);
        CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600, "umask %03o: mode %03o", (unsigned)masks[m],
              (unsigned)(st.st_mode & 0777));
        if (m == 0) {
            /* sparse: only the header page, chunk table and index are backed before any attach */
            uint64_t fp = vmm__reg_footprint(&r), h0 = r.hdr->rec_off - r.hdr->chunk_off;
            CHECK(fp >= r.hdr->index_slots * 4 && fp <= 4096 + h0 + 64 * 1024, "fresh footprint %" PRIu64, fp);
            /* opening it again (even with CREATE and another capacity) maps the same segment */
            vmm__reg r2;
            if (open_reg(&r2, name, VMM__REG_CREATE, 500000) == 0) {
                CHECK_EQ(r2.hdr->capacity, r.hdr->capacity);
                CHECK_EQ(r2.hdr->created_ns, r.hdr->created_ns);
                vmm__reg_close(&r2);
            }
            if (open_reg(&r2, name, VMM__REG_READ, 0) == 0) {
                CHECK(!r2.writable, "read handle writable");
                CHECK_EQ(r2.hdr->total_size, r.hdr->total_size);
                vmm__reg_close(&r2);
            }
        }
        vmm__reg_close(&r);
        shm_unlink(name);
    }

    /* REGISTRY_GROUP as our primary gid number, and by name: 0660 with that group */
    char gnum[32];
    snprintf(gnum, sizeof gnum, "%u", (unsigned)getgid());
    struct group *gr = getgrgid(getgid());
    char gname[64] = "";
    if (gr) snprintf(gname, sizeof gname, "%s", gr->gr_name);
    const char *groups[2] = {gnum, gname};
    for (int g = 0; g < 2; g++) {
        if (!*groups[g]) continue;
        const char *name = new_name();
        mode_t old = umask(0);
        int rc = vmm__reg_open(&r, name, VMM__REG_CREATE, 64, groups[g], err, sizeof err);
        umask(old);
        CHECK(rc == 0, "group %s: %d %s", groups[g], rc, err);
        if (rc) continue;
        shm_path(path, sizeof path, name);
        CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0660 && st.st_gid == getgid(), "group %s: mode %03o gid %u",
              groups[g], (unsigned)(st.st_mode & 0777), (unsigned)st.st_gid);
        vmm__reg_close(&r);
        shm_unlink(name);
    }
    const char *name = new_name();
    int rc = vmm__reg_open(&r, name, VMM__REG_CREATE, 64, "vmmshim-no-such-group-x", err, sizeof err);
    CHECK(rc < 0 && strstr(err, "does not exist") && !strchr(err, '\n'), "missing group: %d %s", rc, err);
    if (rc == 0) vmm__reg_close(&r);
    shm_unlink(name);
    /* READ and WRITE never create */
    name = new_name();
    rc = vmm__reg_open(&r, name, VMM__REG_READ, 0, NULL, err, sizeof err);
    CHECK(rc == -ENOENT && strstr(err, "does not exist"), "read of missing: %d %s", rc, err);
    rc = vmm__reg_open(&r, name, VMM__REG_WRITE, 0, NULL, err, sizeof err);
    CHECK(rc == -ENOENT, "write of missing: %d %s", rc, err);
    shm_path(path, sizeof path, name);
    CHECK(access(path, F_OK) != 0, "READ/WRITE created %s", path);
}

/* ---- publish, retract, lookup ---- */

/* The allocation path's one-step add and the free path's one-step remove. */
static void test_add_remove(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 1024)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    const uint32_t me = (uint32_t)getpid();
    vmm_reg_alloc d, out, pub;
    uint64_t fs;
    uint32_t s;
    desc(&d, 4000, "added", 0, VMM_API_CUDA_MALLOC);
    d.mapped_size = TWO_MIB;
    d.chunk_id = 9;
    d.chunk_offset = 8192;
    CHECK_EQ(vmm__reg_add(&r, BASE_ADDR + 8192, 4096, &d, &s, &pub), 0);
    CHECK(pub.state == VMM_REG_LIVE && pub.address == BASE_ADDR + 8192 && pub.extent == 4096, "published copy");
    CHECK(vmm__reg_find(&r, me, BASE_ADDR + 8192 + 4095, &out, &fs) == 0 && fs == s && out.requested_size == 4000 &&
              out.mapped_size == TWO_MIB && out.chunk_id == 9 && out.chunk_offset == 8192 && out.generation == pub.generation &&
              !memcmp(out.alloc_id, pub.alloc_id, 16),
          "find what vmm__reg_add published");
    vmm_reg_proc p;
    uint32_t pi = r.proc_index;
    CHECK(vmm__reg_read_proc(&r, pi, &p) == 0 && p.n_allocs == 1 && p.bytes_requested == 4000 && p.bytes_mapped == 4096,
          "counters after add");
    CHECK_EQ(vmm__reg_remove(&r, s), 0);
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR + 8192, &out, &fs), -ENOENT);
    CHECK(vmm__reg_read_alloc(&r, s, &out) == 0 && out.state == VMM_REG_UNBOUND && out.generation == pub.generation + 2,
          "removed: unbound, generation moved on");
    CHECK(vmm__reg_read_proc(&r, pi, &p) == 0 && p.n_allocs == 0 && p.bytes_requested == 0 && p.bytes_mapped == 0,
          "counters after remove");
    CHECK_EQ(vmm__reg_remove(&r, s), -EINVAL);
    CHECK_EQ(index_count(&r, UINT64_MAX), 0);
    CHECK(p.stats_generation == p.generation && p.peak_requested == 4000, "coverage kept: stats generation %u of %u, peak %llu",
          p.stats_generation, p.generation, (unsigned long long)p.peak_requested);
    uint32_t s2;
    CHECK(vmm__reg_add(&r, BASE_ADDR, 512, &d, &s2, NULL) == 0 && s2 == s, "the slot is reused");
    CHECK_EQ(vmm__reg_add(&r, 0, 512, &d, &s2, NULL), -EINVAL);
    CHECK_EQ(vmm__reg_add(&r, BASE_ADDR, 0, &d, &s2, NULL), -EINVAL);
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* vmm__reg_find_near: the size hint orders the index levels searched, never the answer.  Records
 * of many sizes back to back; each found at its base, inside and at its end with hints smaller
 * than it, as large as it, and larger (a range across it and the next: the levels below searched
 * after), the same record as vmm__reg_find; a hole is not found whatever the hint. */
static void test_find_near(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 1024)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    const uint32_t me = (uint32_t)getpid();
    static const uint64_t sizes[] = {512, 4096, 3 * 4096, 1ull << 20, TWO_MIB, 20ull << 20, 4096, 256};
    uint64_t at = BASE_ADDR, base[8];
    uint32_t slot[8];
    for (int i = 0; i < 8; i++) {
        vmm_reg_alloc d;
        desc(&d, sizes[i], "near", 0, VMM_API_CUDA_MALLOC);
        base[i] = at;
        CHECK_EQ(vmm__reg_add(&r, at, sizes[i], &d, &slot[i], NULL), 0);
        at += sizes[i];
    }
    uint64_t hole = at + 8192;
    int same = 0, total = 0, learned = 0, learned_total = 0;
    for (int i = 0; i < 8; i++) {
        uint64_t where[3] = {base[i], base[i] + sizes[i] / 2, base[i] + sizes[i] - 1};
        uint64_t hints[6] = {0, 1, sizes[i] / 3 + 1, sizes[i], 4 * sizes[i] + 4096, 1ull << 40};
        for (int w = 0; w < 3; w++)
            for (int h = 0; h < 6; h++) {
                vmm_reg_alloc a, b;
                uint64_t sa = 0, sb = 0;
                int ra = vmm__reg_find(&r, me, where[w], &a, &sa);
                int rb = vmm__reg_find_near(&r, me, where[w], hints[h], NULL, &b, &sb);
                total++;
                same += ra == 0 && rb == 0 && sa == slot[i] && sb == slot[i] && b.address == base[i];
                /* levels searched first, right ones, wrong ones or all, change no answer; a level
                 * learned is the record's own */
                uint64_t masks[4] = {0, 1ull << vmm_reg_level(sizes[(i + 1) % 8]), ~0ull, 1ull << vmm_reg_level(sizes[i])};
                for (int k = 0; k < 4; k++) {
                    uint64_t levels = masks[k], sc = 0;
                    vmm_reg_alloc c;
                    int rc = vmm__reg_find_near(&r, me, where[w], hints[h], &levels, &c, &sc);
                    learned_total++;
                    learned += rc == 0 && sc == slot[i] && c.address == base[i] &&
                               (levels == masks[k] || levels == (masks[k] | 1ull << vmm_reg_level(sizes[i]))) &&
                               (levels >> vmm_reg_level(sizes[i]) & 1);
                }
            }
    }
    CHECK(same == total, "vmm__reg_find_near found the record vmm__reg_find finds %d times of %d", same, total);
    CHECK(learned == learned_total, "vmm__reg_find_near with levels to search first found the same record and learned its "
                                    "level %d times of %d", learned, learned_total);
    vmm_reg_alloc out;
    uint64_t fs;
    CHECK(vmm__reg_find_near(&r, me, hole, 0, NULL, &out, &fs) == -ENOENT && vmm__reg_find_near(&r, me, hole, 4096, NULL, &out, &fs) == -ENOENT &&
              vmm__reg_find_near(&r, me, hole, 1ull << 40, NULL, &out, &fs) == -ENOENT,
          "a hole is not found, whatever the hint");
    uint64_t all = ~0ull;
    CHECK(vmm__reg_find_near(&r, me, hole, 4096, &all, &out, &fs) == -ENOENT, "a hole is not found with every level first");
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* The coverage counters: the peak of bytes_requested follows adds and stays past removes; the
 * writer's own counters through vmm__reg_self; a new owner of the slot starts from zero with
 * its own stats_generation, and an owner that did not write one (a layout-2 writer) is told. */
static void test_coverage(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 1024)) return;
    CHECK(vmm__reg_self(&r) == NULL, "no record before attach");
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    vmm_reg_proc *self = vmm__reg_self(&r), p;
    uint32_t pi = r.proc_index, s[3];
    vmm_reg_alloc d;
    desc(&d, 0, "peak", 0, VMM_API_CUDA_MALLOC);
    for (int i = 0; i < 3; i++) {
        d.requested_size = (uint64_t)(i + 1) * 1000;
        CHECK_EQ(vmm__reg_add(&r, BASE_ADDR + (uint64_t)i * TWO_MIB, TWO_MIB, &d, &s[i], NULL), 0);
    }
    CHECK_EQ(vmm__reg_remove(&r, s[2]), 0);
    CHECK_EQ(vmm__reg_remove(&r, s[0]), 0);
    d.requested_size = 3500; /* live 5500 now, below the 6000 of before */
    CHECK_EQ(vmm__reg_add(&r, BASE_ADDR, TWO_MIB, &d, &s[0], NULL), 0);
    CHECK(self != NULL, "vmm__reg_self");
    if (self) {
        __atomic_add_fetch(&self->allocs, 4, __ATOMIC_RELAXED);
        __atomic_add_fetch(&self->passed_device_full, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&self->unpublished, 2, __ATOMIC_RELAXED);
    }
    CHECK(vmm__reg_read_proc(&r, pi, &p) == 0 && p.bytes_requested == 5500 && p.peak_requested == 6000 &&
              p.allocs == 4 && p.passed_device_full == 1 && p.unpublished == 2 && p.stats_generation == p.generation,
          "live %llu peak %llu allocs %llu full %llu stats generation %u of %u", (unsigned long long)p.bytes_requested,
          (unsigned long long)p.peak_requested, (unsigned long long)p.allocs, (unsigned long long)p.passed_device_full,
          p.stats_generation, p.generation);
    vmm__reg_detach(&r);
    CHECK(vmm__reg_self(&r) == NULL, "no record after detach");
    /* a slot left reads 0 at 504, which an older writer claiming it next leaves alone */
    CHECK(((vmm_reg_proc *)(r.base + r.hdr->proc_off))[pi].unpublished == 0, "unpublished left behind by detach");
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    CHECK(r.proc_index == pi && vmm__reg_read_proc(&r, pi, &p) == 0 && p.allocs == 0 && p.peak_requested == 0 &&
              p.passed_device_full == 0 && p.unpublished == 0 && p.stats_generation == p.generation,
          "the slot again: allocs %llu peak %llu, stats generation %u of %u", (unsigned long long)p.allocs,
          (unsigned long long)p.peak_requested, p.stats_generation, p.generation);
    /* a layout-2 writer claims a slot without touching 440..511 */
    __atomic_store_n(&vmm__reg_self(&r)->stats_generation, p.generation - 1, __ATOMIC_RELAXED);
    CHECK(vmm__reg_read_proc(&r, pi, &p) == 0 && p.stats_generation != p.generation, "an older writer's record");
    vmm__reg_close(&r);
    shm_unlink(name);
}

static void test_publish(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 4096)) return;
    const uint32_t me = (uint32_t)getpid();
    vmm_reg_alloc out, pub, pub64, pub3, d;
    vmm_reg_proc p;
    uint64_t fs = 0;
    uint32_t s0 = 0, s64 = 0, s3 = 0, pi = 0;

    CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR, TWO_MIB, &s0), -EINVAL); /* not attached */
    CHECK_EQ(vmm__reg_attach(&r, "/tmp/vmmshim-test.sock"), 0);
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0); /* idempotent */
    CHECK_EQ(vmm__reg_find_proc(&r, me, &p, &pi), 0);
    uint64_t st0 = 0, ns0 = 0;
    CHECK_EQ(vmm__proc_identity(me, &st0, &ns0), 0);
    CHECK_EQ(p.pid, me);
    CHECK_EQ(pi, r.proc_index);
    CHECK_EQ(p.start_time, st0);
    CHECK_EQ(p.pidns, ns0);
    CHECK_EQ(p.uid, getuid());
    CHECK(p.claim == (((uint64_t)p.generation << 32) | me), "claim %#" PRIx64, p.claim);
    CHECK(strcmp(p.broker_path, "/tmp/vmmshim-test.sock") == 0, "broker %s", p.broker_path);
    CHECK(p.cmdline[0] != 0, "cmdline empty");
    CHECK_EQ(p.n_allocs, 0);
    CHECK_EQ(vmm__reg_set_broker(&r, "/tmp/other.sock"), 0);
    CHECK(vmm__reg_read_proc(&r, pi, &p) == 0 && strcmp(p.broker_path, "/tmp/other.sock") == 0, "broker %s", p.broker_path);

    /* bind: BOUND, in the index, not findable */
    CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR, TWO_MIB, &s0), 0);
    CHECK_EQ(vmm__reg_read_alloc(&r, s0, &out), 0);
    CHECK_EQ(out.state, VMM_REG_BOUND);
    CHECK_EQ(out.pid, me);
    CHECK_EQ(out.proc_index, pi);
    CHECK_EQ(out.start_time, st0);
    CHECK(out.address == BASE_ADDR && out.mapped_size == TWO_MIB, "bound %#" PRIx64 " %" PRIu64, out.address, out.mapped_size);
    CHECK_EQ(out.exported_fd, -1);
    CHECK_EQ(out.seq & 1, 0);
    uint64_t gen_bound = out.generation;
    CHECK_EQ(index_count(&r, s0), 1);
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR, &out, &fs), -ENOENT);

    /* publish */
    uint64_t pubs0 = r.hdr->stat_publishes, retr0 = r.hdr->stat_retracts;
    desc(&d, 1234567, "hello", 3, VMM_API_TEST);
    CHECK_EQ(vmm__reg_publish(&r, s0, &d, &pub), 0);
    static const uint8_t zero16[16];
    CHECK_EQ(pub.state, VMM_REG_LIVE);
    CHECK(pub.address == BASE_ADDR && pub.mapped_size == TWO_MIB && pub.pid == me, "published copy");
    CHECK(memcmp(pub.alloc_id, zero16, 16) != 0, "alloc_id left zero");
    CHECK(pub.generation != gen_bound, "generation unchanged by publish");
    CHECK(pub.created_ns != 0, "created_ns");
    CHECK_EQ(vmm__reg_read_alloc(&r, s0, &out), 0);
    CHECK(out.state == VMM_REG_LIVE && out.generation == pub.generation && !memcmp(out.alloc_id, pub.alloc_id, 16),
          "read back after publish");
    CHECK(out.requested_size == 1234567 && out.device == 3 && out.api == VMM_API_TEST && !strcmp(out.tag, "hello"),
          "fields %" PRIu64 " %u %u %s", out.requested_size, out.device, out.api, out.tag);
    CHECK_EQ(r.hdr->stat_publishes, pubs0 + 1);

    /* find by base, interior, last byte; not past the end, before it, or for another pid */
    memset(&out, 0, sizeof out);
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR, &out, &fs), 0);
    CHECK(fs == s0 && !memcmp(out.alloc_id, pub.alloc_id, 16) && out.requested_size == 1234567, "find by base");
    fs = UINT64_MAX;
    CHECK(vmm__reg_find(&r, me, BASE_ADDR + 1, &out, &fs) == 0 && fs == s0, "find base+1");
    fs = UINT64_MAX;
    CHECK(vmm__reg_find(&r, me, BASE_ADDR + TWO_MIB - 1, &out, &fs) == 0 && fs == s0, "find last byte");
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR + TWO_MIB, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR - 1, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_find(&r, me + 1, BASE_ADDR + 5, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_find(&r, 0, BASE_ADDR + 5, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR + 5, &out, NULL), 0); /* slot pointer optional */

    /* a 64 MiB record at a merely 2 MiB-aligned address, found 40 MiB in: no alignment is needed */
    const uint64_t A64 = BASE_ADDR + (1ull << 32) + TWO_MIB;
    CHECK_EQ(vmm__reg_bind(&r, A64, 64 * MiB, &s64), 0);
    desc(&d, 50 * MiB, "big", 1, VMM_API_CU_MEM_ALLOC);
    CHECK_EQ(vmm__reg_publish(&r, s64, &d, &pub64), 0);
    fs = UINT64_MAX;
    CHECK(vmm__reg_find(&r, me, A64 + 40 * MiB, &out, &fs) == 0 && fs == s64 && out.address == A64 &&
              out.mapped_size == 64 * MiB && out.extent == 64 * MiB && out.requested_size == 50 * MiB,
          "find 40 MiB into a 64 MiB record: slot %" PRIu64, fs);
    CHECK(vmm__reg_find(&r, me, A64 + 64 * MiB - 1, &out, &fs) == 0 && fs == s64, "last byte of 64 MiB");
    CHECK_EQ(vmm__reg_find(&r, me, A64 + 64 * MiB, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_find(&r, me, A64 - 1, &out, &fs), -ENOENT);
    CHECK(memcmp(pub64.alloc_id, pub.alloc_id, 16) != 0, "two publishes share an alloc_id");

    /* 3 MiB (not a power of two) inside a chunk: the chunk's fields come from the publisher */
    const uint64_t A3 = BASE_ADDR + (2ull << 32);
    CHECK_EQ(vmm__reg_bind(&r, A3 + TWO_MIB, 3 * MiB, &s3), 0);
    desc(&d, 3 * MiB - 5, "three", 0, VMM_API_CUDA_MALLOC);
    d.mapped_size = 20 * MiB;
    d.chunk_id = 77;
    d.chunk_offset = TWO_MIB;
    CHECK_EQ(vmm__reg_publish(&r, s3, &d, &pub3), 0);
    CHECK(vmm__reg_find(&r, me, A3 + TWO_MIB + 3 * MiB - 1, &out, &fs) == 0 && fs == s3 && out.mapped_size == 20 * MiB &&
              out.chunk_id == 77 && out.chunk_offset == TWO_MIB && out.extent == 3 * MiB,
          "last byte of 3 MiB, with its chunk");
    CHECK_EQ(vmm__reg_find(&r, me, A3 + TWO_MIB + 3 * MiB, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_find(&r, me, A3 + TWO_MIB - 1, &out, &fs), -ENOENT);
    d.mapped_size = d.chunk_id = d.chunk_offset = 0;

    /* packed neighbours of one level share index keys; each address finds its own */
    const uint64_t AP = BASE_ADDR + (3ull << 32);
    uint32_t sp[3];
    CHECK_EQ(vmm__reg_bind(&r, AP, 300, &sp[0]), 0);
    CHECK_EQ(vmm__reg_bind(&r, AP + 300, 200, &sp[1]), 0);
    CHECK_EQ(vmm__reg_bind(&r, AP + 512, 4096, &sp[2]), 0);
    desc(&d, 1, "packed", 0, VMM_API_CUDA_MALLOC);
    for (int i = 0; i < 3; i++) CHECK_EQ(vmm__reg_publish(&r, sp[i], &d, NULL), 0);
    CHECK(vmm__reg_find(&r, me, AP + 299, &out, &fs) == 0 && fs == sp[0], "packed: last byte of the first");
    CHECK(vmm__reg_find(&r, me, AP + 300, &out, &fs) == 0 && fs == sp[1], "packed: first byte of the second");
    CHECK(vmm__reg_find(&r, me, AP + 499, &out, &fs) == 0 && fs == sp[1], "packed: last byte of the second");
    CHECK_EQ(vmm__reg_find(&r, me, AP + 500, &out, &fs), -ENOENT); /* the gap */
    CHECK(vmm__reg_find(&r, me, AP + 512 + 4095, &out, &fs) == 0 && fs == sp[2], "packed: a 4 KiB one across blocks");
    CHECK_EQ(vmm__reg_unbind(&r, sp[1]), 0);
    CHECK_EQ(vmm__reg_find(&r, me, AP + 300, &out, &fs), -ENOENT);
    CHECK(vmm__reg_find(&r, me, AP + 5, &out, &fs) == 0 && fs == sp[0], "packed: the first after the second went");
    CHECK_EQ(vmm__reg_unbind(&r, sp[0]), 0);
    CHECK_EQ(vmm__reg_unbind(&r, sp[2]), 0);

    /* bind rejects what readers could not find */
    uint32_t sx;
    CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR + 4 * MiB, 0, &sx), -EINVAL);
    CHECK_EQ(vmm__reg_bind(&r, 0, TWO_MIB, &sx), -EINVAL);
    CHECK_EQ(vmm__reg_bind(&r, 1ull << 48, (1ull << 47) + 1, &sx), -EINVAL); /* beyond level 47 */
    CHECK_EQ(vmm__reg_bind(&r, UINT64_MAX - 4096, 8192, &sx), -EINVAL);    /* wraps */

    /* counters follow publish */
    CHECK_EQ(vmm__reg_read_proc(&r, pi, &p), 0);
    CHECK_EQ(p.n_allocs, 3);
    CHECK_EQ(p.bytes_requested, 1234567 + 50 * MiB + 3 * MiB - 5);
    CHECK_EQ(p.bytes_mapped, TWO_MIB + 64 * MiB + 3 * MiB);

    /* retract: BOUND again, generation moves, not found, counters drop */
    CHECK_EQ(vmm__reg_retract(&r, s0), 0);
    CHECK_EQ(vmm__reg_read_alloc(&r, s0, &out), 0);
    CHECK_EQ(out.state, VMM_REG_BOUND);
    CHECK(out.generation != pub.generation && out.generation != gen_bound, "generation unchanged by retract");
    uint64_t gen_retracted = out.generation;
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR + 7, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_retract(&r, s0), -EINVAL);
    CHECK_EQ(index_count(&r, s0), 1); /* still bound */
    CHECK_EQ(r.hdr->stat_retracts, retr0 + 4) /* 3 packed ones unbound live, then this one */;
    CHECK_EQ(vmm__reg_read_proc(&r, pi, &p), 0);
    CHECK_EQ(p.n_allocs, 2);
    CHECK_EQ(p.bytes_requested, 50 * MiB + 3 * MiB - 5);
    CHECK_EQ(p.bytes_mapped, 64 * MiB + 3 * MiB);

    /* publish again on the same slot: a new alloc_id and generation; an explicit alloc_id is kept */
    vmm_reg_alloc pub2;
    desc(&d, 99, "again", 2, VMM_API_TEST);
    CHECK_EQ(vmm__reg_publish(&r, s0, &d, &pub2), 0);
    CHECK(memcmp(pub2.alloc_id, pub.alloc_id, 16) && memcmp(pub2.alloc_id, pub64.alloc_id, 16) &&
              memcmp(pub2.alloc_id, pub3.alloc_id, 16),
          "republished alloc_id reused");
    CHECK(pub2.generation != gen_retracted && pub2.generation != pub.generation, "generation after republish");
    CHECK(vmm__reg_find(&r, me, BASE_ADDR + 7, &out, &fs) == 0 && out.requested_size == 99, "find after republish");
    CHECK_EQ(vmm__reg_retract(&r, s0), 0);
    desc(&d, 100, "explicit", 2, VMM_API_TEST);
    for (int i = 0; i < 16; i++) d.alloc_id[i] = (uint8_t)(0xa0 + i);
    CHECK_EQ(vmm__reg_publish(&r, s0, &d, &pub2), 0);
    CHECK(vmm__reg_find(&r, me, BASE_ADDR, &out, &fs) == 0 && !memcmp(out.alloc_id, d.alloc_id, 16), "explicit alloc_id");
    CHECK_EQ(vmm__reg_publish(&r, s0, &d, &pub2), -EINVAL); /* already LIVE */

    /* unbind (of a LIVE record: retracts it first) */
    CHECK_EQ(vmm__reg_unbind(&r, s0), 0);
    CHECK_EQ(vmm__reg_read_alloc(&r, s0, &out), 0);
    CHECK_EQ(out.state, VMM_REG_UNBOUND);
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR, &out, &fs), -ENOENT);
    CHECK_EQ(index_count(&r, s0), 0);
    CHECK_EQ(vmm__reg_unbind(&r, s0), -EINVAL);
    CHECK_EQ(vmm__reg_retract(&r, s0), -EINVAL);
    CHECK_EQ(vmm__reg_publish(&r, s0, &d, NULL), -EINVAL);
    CHECK_EQ(vmm__reg_read_proc(&r, pi, &p), 0);
    CHECK_EQ(p.n_allocs, 2);
    CHECK_EQ(p.bytes_mapped, 64 * MiB + 3 * MiB);
    /* slots of chunks we do not own */
    uint32_t foreign = (uint32_t)r.hdr->capacity - 1;
    CHECK_EQ(vmm__reg_publish(&r, foreign, &d, NULL), -EINVAL);
    CHECK_EQ(vmm__reg_unbind(&r, foreign), -EINVAL);
    CHECK_EQ(vmm__reg_publish(&r, (uint32_t)r.hdr->capacity, &d, NULL), -EINVAL);
    CHECK_EQ(vmm__reg_read_alloc(&r, r.hdr->capacity, &out), -EINVAL);

    /* for_each visits exactly the bound and live records */
    uint32_t extra[6];
    for (int i = 0; i < 6; i++) {
        CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR + (3ull << 32) + (uint64_t)i * TWO_MIB, TWO_MIB, &extra[i]), 0);
        if (i % 2 == 0) {
            desc(&d, (uint64_t)i + 1, "extra", 0, VMM_API_TEST);
            CHECK_EQ(vmm__reg_publish(&r, extra[i], &d, NULL), 0);
        }
    }
    uint8_t *seen = calloc(r.hdr->capacity, 1);
    visit_ctx v;
    memset(&v, 0, sizeof v);
    v.seen = seen;
    v.seen_len = r.hdr->capacity;
    CHECK_EQ(vmm__reg_for_each(&r, visit_cb, &v), 0);
    CHECK(v.n == 8 && v.n_live == 5 && v.n_bound == 3 && v.n_err == 0 && v.dup == 0,
          "for_each: %" PRIu64 " visited, %" PRIu64 " live, %" PRIu64 " bound", v.n, v.n_live, v.n_bound);
    int exact = seen && seen[s64] && seen[s3]; /* s0 was unbound; its slot may serve an extra */
    for (int i = 0; i < 6 && seen; i++) exact = exact && seen[extra[i]];
    CHECK(exact, "for_each visited the wrong slots");
    free(seen);
    CHECK_EQ(index_count(&r, UINT64_MAX), 8);

    /* a read-only handle sees the same and may not write */
    vmm__reg rd;
    if (open_reg(&rd, name, VMM__REG_READ, 0) == 0) {
        CHECK(vmm__reg_find(&rd, me, A64 + 40 * MiB, &out, &fs) == 0 && fs == s64, "find through a read handle");
        CHECK_EQ(vmm__reg_attach(&rd, NULL), -EPERM);
        CHECK_EQ(vmm__reg_gc(&rd, NULL), -EPERM);
        vmm__reg_close(&rd);
    }

    /* detach removes everything */
    vmm__reg_detach(&r);
    visit_ctx after = visit(&r, 0);
    CHECK_EQ(after.n, 0);
    CHECK_EQ(index_count(&r, UINT64_MAX), 0);
    CHECK_EQ(chunks_owned(&r), 0);
    CHECK_EQ(vmm__reg_find(&r, me, A64 + 40 * MiB, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_find_proc(&r, me, &p, NULL), -ENOENT);
    CHECK_EQ((uint32_t)proc_of(&r, pi)->claim, 0);
    CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR, TWO_MIB, &sx), -EINVAL);
    /* and a second attach works from scratch */
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR, TWO_MIB, &sx), 0);
    desc(&d, 1, "re", 0, VMM_API_TEST);
    CHECK_EQ(vmm__reg_publish(&r, sx, &d, NULL), 0);
    CHECK_EQ(vmm__reg_find(&r, me, BASE_ADDR + 1, &out, &fs), 0);
    vmm__reg_close(&r); /* detaches */
    if (open_reg(&rd, name, VMM__REG_READ, 0) == 0) {
        CHECK_EQ(index_count(&rd, UINT64_MAX), 0);
        CHECK_EQ(visit(&rd, 0).n, 0);
        vmm__reg_close(&rd);
    }
    shm_unlink(name);
}

/* A size near 2^64 must be refused, not loop forever rounding it up: run it in a child. */
static void test_bind_huge_size(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 64)) return;
    fflush(NULL);
    pid_t c = xfork();
    if (c == 0) {
        vmm__reg_forget_after_fork(&r);
        if (vmm__reg_attach(&r, NULL)) _exit(100);
        uint32_t s;
        int a = vmm__reg_bind(&r, 1ull << 46, UINT64_MAX, &s);
        int b = vmm__reg_bind(&r, 1ull << 46, (1ull << 63) + 1, &s);
        _exit(a == -EINVAL && b == -EINVAL ? 0 : 1);
    }
    int st = 0, done = 0;
    for (int i = 0; i < 500 && !done; i++) {
        done = waitpid(c, &st, WNOHANG) == c;
        if (!done) sleep_us(10000);
    }
    if (!done) {
        kill(c, SIGKILL);
        waitpid(c, &st, 0);
    }
    CHECK(done && WIFEXITED(st) && WEXITSTATUS(st) == 0, "bind with a size near 2^64 %s", done ? "not refused" : "hung");
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* ---- a million live records ---- */

static void test_million(void)
{
    /* Under TSan each record's atomics get sync objects of their own: a million took 10 GB there
     * (400 MB in the other builds), so that build binds a tenth; the capacity stays. */
    const char *san = getenv("SAN");
    const bool tsan = san && !strcmp(san, "tsan");
    const uint64_t N = tsan ? 100000 : 1000000, CAP = 1048576, NFIND = 100000;
    const char *many = tsan ? "100k records" : "1M records";
    struct statvfs vf;
    uint64_t need = CAP * sizeof(vmm_reg_alloc) + 64 * MiB;
    if (statvfs("/dev/shm", &vf) == 0 && (uint64_t)vf.f_bavail * vf.f_frsize < need) {
        printf("skip: %s: /dev/shm has %" PRIu64 " MiB free, needs about %" PRIu64 " MiB\n", many,
               (uint64_t)vf.f_bavail * vf.f_frsize / MiB, need / MiB);
        return;
    }
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, CAP)) return;
    CHECK_EQ(r.hdr->capacity, CAP);
    const uint64_t total = r.hdr->total_size;
    uint64_t fp0 = vmm__reg_footprint(&r);
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    const uint32_t me = (uint32_t)getpid();
    uint32_t *slots = malloc(N * sizeof *slots);
    uint8_t *seen = calloc(CAP, 1);
    if (!slots || !seen) {
        CHECK(0, "out of memory");
        free(slots);
        free(seen);
        vmm__reg_close(&r);
        shm_unlink(name);
        return;
    }
    uint64_t bad = 0, dup = 0;
    double t0 = now_s();
    for (uint64_t i = 0; i < N; i++) {
        if (vmm__reg_bind(&r, BASE_ADDR + i * TWO_MIB, TWO_MIB, &slots[i]) != 0) {
            bad++;
            slots[i] = UINT32_MAX;
            continue;
        }
        if (seen[slots[i]]++) dup++;
    }
    double t1 = now_s();
    vmm_reg_alloc d;
    desc(&d, 0, "million", 0, VMM_API_TEST);
    for (uint64_t i = 0; i < N; i++) {
        d.requested_size = i * 7 + 1;
        d.device = (uint32_t)(i % 8);
        if (slots[i] == UINT32_MAX || vmm__reg_publish(&r, slots[i], &d, NULL) != 0) bad++;
    }
    double t2 = now_s();
    CHECK(bad == 0 && dup == 0, "%s: %" PRIu64 " bind/publish failures, %" PRIu64 " duplicate slots", many, bad, dup);
    uint64_t miss = 0, wrong = 0;
    vmm_reg_alloc out;
    uint64_t fs;
    for (uint64_t k = 0; k < NFIND; k++) {
        uint64_t i = rnd() % N, a = BASE_ADDR + i * TWO_MIB + rnd() % TWO_MIB;
        if (vmm__reg_find(&r, me, a, &out, &fs) != 0) {
            miss++;
            continue;
        }
        if (fs != slots[i] || out.address != BASE_ADDR + i * TWO_MIB || out.requested_size != i * 7 + 1 ||
            out.device != i % 8 || out.state != VMM_REG_LIVE)
            wrong++;
    }
    double t3 = now_s();
    CHECK(miss == 0 && wrong == 0, "%s: %" PRIu64 " of %" PRIu64 " finds missed, %" PRIu64 " wrong", many, miss, NFIND,
          wrong);
    vmm_reg_proc p;
    CHECK(vmm__reg_read_proc(&r, r.proc_index, &p) == 0 && p.n_allocs == N && p.bytes_mapped == N * TWO_MIB,
          "%s: counters %" PRIu64 " %" PRIu64, many, p.n_allocs, p.bytes_mapped);
    CHECK_EQ(index_count(&r, UINT64_MAX), N);

    uint64_t fp = vmm__reg_footprint(&r);
    const vmm_reg_header *h = r.hdr;
    uint64_t chunks = (N + VMM_REG_CHUNK_RECORDS - 1) / VMM_REG_CHUNK_RECORDS;
    /* what must be backed: every used chunk's records, the index, the chunk table, the header
     * page and our proc record's page; nothing else (unused chunks and proc slots stay sparse) */
    uint64_t expect = chunks * VMM_REG_CHUNK_RECORDS * sizeof(vmm_reg_alloc) + h->index_slots * 4 +
                      (h->index_off - h->chunk_off) + 2 * 4096;
    printf("figure: %s: publish %.0f/s, find %.0f/s, shm touched %.1f MiB of %.1f MiB\n", many, (double)N / (t2 - t1),
           (double)NFIND / (t3 - t2), (double)fp / MiB, (double)total / MiB);
    printf("stat: %s: bind %.0f/s; fresh capacity-%" PRIu64 " registry touched %.1f MiB (%.1f%%); "
           "with them %.1f%% (records %.1f MiB + index %.1f MiB)\n",
           many, (double)N / (t1 - t0), CAP, (double)fp0 / MiB, 100.0 * (double)fp0 / (double)total,
           100.0 * (double)fp / (double)total, (double)(chunks * VMM_REG_CHUNK_RECORDS * sizeof(vmm_reg_alloc)) / MiB,
           (double)(h->index_slots * 4) / MiB);
    CHECK(fp0 * 20 < total, "fresh registry not sparse: %" PRIu64 " of %" PRIu64, fp0, total);
    CHECK(fp >= N * sizeof(vmm_reg_alloc) && fp <= expect + MiB,
          "footprint %" PRIu64 " outside [%" PRIu64 ", %" PRIu64 "]", fp, N * sizeof(vmm_reg_alloc), expect + MiB);

    /* retract and unbind all: nothing found, index empty */
    double t4 = now_s();
    bad = 0;
    for (uint64_t i = 0; i < N; i++) {
        if (vmm__reg_retract(&r, slots[i]) != 0) bad++;
        if (vmm__reg_unbind(&r, slots[i]) != 0) bad++;
    }
    double t5 = now_s();
    CHECK_EQ(bad, 0);
    miss = 0;
    for (uint64_t k = 0; k < 10000; k++) {
        uint64_t i = rnd() % N;
        if (vmm__reg_find(&r, me, BASE_ADDR + i * TWO_MIB + rnd() % TWO_MIB, &out, &fs) != -ENOENT) miss++;
    }
    CHECK(miss == 0, "%" PRIu64 " finds succeeded after unbind", miss);
    CHECK_EQ(index_count(&r, UINT64_MAX), 0);
    CHECK(vmm__reg_read_proc(&r, r.proc_index, &p) == 0 && p.n_allocs == 0 && p.bytes_mapped == 0 && p.bytes_requested == 0,
          "counters after unbind");
    printf("stat: %s: retract+unbind %.0f/s\n", many, (double)N / (t5 - t4));
    /* the slots come back: bind again reuses them (no new chunks) */
    uint64_t owned = chunks_owned(&r);
    CHECK_EQ(owned, chunks);
    uint32_t s;
    CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR, TWO_MIB, &s), 0);
    CHECK_EQ(chunks_owned(&r), owned);
    vmm__reg_detach(&r);
    CHECK_EQ(chunks_owned(&r), 0);
    CHECK_EQ(index_count(&r, UINT64_MAX), 0);
    free(slots);
    free(seen);
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* ---- owners killed mid-write ---- */

static void check_gone(const vmm__reg *r, uint32_t pid, const uint32_t *slots, int n, uint32_t proc)
{
    vmm_reg_alloc out;
    vmm_reg_proc p;
    for (int i = 0; i < n; i++) {
        CHECK(vmm__reg_read_alloc(r, slots[i], &out) == 0 && out.state == VMM_REG_UNBOUND && out.pid == 0,
              "slot %u not cleared (state %u)", slots[i], out.state);
        CHECK_EQ(__atomic_load_n(&rec_of(r, slots[i])->seq, __ATOMIC_RELAXED) & 1, 0);
        CHECK_EQ(index_count(r, slots[i]), 0);
        CHECK_EQ(__atomic_load_n(&chunks_of(r)[slots[i] / VMM_REG_CHUNK_RECORDS], __ATOMIC_RELAXED), 0);
    }
    CHECK_EQ(visit(r, pid).n, 0);
    CHECK_EQ(vmm__reg_find_proc(r, pid, &p, NULL), -ENOENT);
    CHECK_EQ((uint32_t)__atomic_load_n(&proc_of(r, proc)->claim, __ATOMIC_RELAXED), 0);
    CHECK_EQ(proc_of(r, proc)->pid, 0);
    CHECK_EQ(proc_of(r, proc)->n_allocs, 0);
}

static void test_kill_mid_publish(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 1024)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    const uint32_t me = (uint32_t)getpid();
    vmm_reg_alloc d, out;
    uint64_t fs;
    uint32_t ps[3];
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR + (uint64_t)i * TWO_MIB, TWO_MIB, &ps[i]), 0);
        desc(&d, 10 + (uint64_t)i, "parent", 0, VMM_API_TEST);
        CHECK_EQ(vmm__reg_publish(&r, ps[i], &d, NULL), 0);
    }
    const uint64_t CA = BASE_ADDR + (1ull << 36);
    struct {
        uint32_t slots[3], proc;
    } msg;
    int pfd[2];
    if (pipe(pfd) != 0) return;
    fflush(NULL);
    pid_t c = xfork();
    if (c == 0) {
        close(pfd[0]);
        vmm__reg_forget_after_fork(&r);
        if (vmm__reg_attach(&r, NULL)) _exit(2);
        for (int i = 0; i < 3; i++) {
            if (vmm__reg_bind(&r, CA + (uint64_t)i * TWO_MIB, TWO_MIB, &msg.slots[i])) _exit(3);
            desc(&d, 100 + (uint64_t)i, "child", 1, VMM_API_TEST);
            if (i < 2 && vmm__reg_publish(&r, msg.slots[i], &d, NULL)) _exit(4);
        }
        msg.proc = r.proc_index;
        if (write(pfd[1], &msg, sizeof msg) != (ssize_t)sizeof msg) _exit(5);
        /* begin publishing the third record by hand (seq odd, a field half-written), then die */
        vmm_reg_alloc *a = rec_of(&r, msg.slots[2]);
        uint32_t s = __atomic_load_n(&a->seq, __ATOMIC_RELAXED);
        __atomic_store_n(&a->seq, s + 1, __ATOMIC_RELAXED);
        __atomic_store_n(&a->requested_size, 777, __ATOMIC_RELEASE); /* after the seq, as a writer's */
        raise(SIGKILL);
        _exit(6);
    }
    close(pfd[1]);
    int got = read_full(pfd[0], &msg, sizeof msg);
    close(pfd[0]);
    CHECK(wait_killed(c), "child not killed");
    CHECK(got == 0, "child did not report");
    if (got) {
        vmm__reg_close(&r);
        shm_unlink(name);
        return;
    }
    CHECK_EQ(__atomic_load_n(&rec_of(&r, msg.slots[2])->seq, __ATOMIC_RELAXED) & 1, 1);

    /* readers never hang on the odd record */
    double t0 = now_s();
    CHECK_EQ(vmm__reg_read_alloc(&r, msg.slots[2], &out), -EAGAIN);
    int frc = vmm__reg_find(&r, (uint32_t)c, CA + 2 * TWO_MIB + 5, &out, &fs);
    CHECK(frc == -ENOENT || frc == -EAGAIN, "find on a record dead mid-write: %d", frc);
    visit_ctx v = visit(&r, 0);
    double dt = now_s() - t0;
    CHECK(dt < 2.0, "reads of a record dead mid-write took %.2f s", dt);
    CHECK(v.n == 6 && v.n_err == 1 && v.n_live == 5, "for_each: %" PRIu64 " visited, %" PRIu64 " busy", v.n, v.n_err);
    /* the dead child's finished records are still there until gc, and its owner reads as dead */
    CHECK(vmm__reg_find(&r, (uint32_t)c, CA + 1, &out, &fs) == 0 && fs == msg.slots[0], "child's live record before gc");
    CHECK_EQ(vmm__reg_liveness(out.pid, out.start_time, out.pidns), VMM__DEAD);

    /* other writers keep going */
    uint32_t np;
    CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR + 10 * TWO_MIB, TWO_MIB, &np), 0);
    desc(&d, 5, "more", 0, VMM_API_TEST);
    CHECK_EQ(vmm__reg_publish(&r, np, &d, NULL), 0);
    CHECK(vmm__reg_find(&r, me, BASE_ADDR + 10 * TWO_MIB + 3, &out, &fs) == 0 && fs == np, "parent publishes after the kill");

    uint64_t reclaimed0 = r.hdr->stat_reclaimed;
    vmm__reg_gc_stats gs;
    CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
    CHECK(gs.procs_dead == 1 && gs.procs_alive >= 1 && gs.chunks_reclaimed == 1 && gs.records_reclaimed >= 2 &&
              gs.records_reclaimed <= 3,
          "gc: %u dead, %u alive, %u chunks, %u records", gs.procs_dead, gs.procs_alive, gs.chunks_reclaimed,
          gs.records_reclaimed);
    CHECK_EQ(r.hdr->stat_reclaimed, reclaimed0 + gs.records_reclaimed);
    check_gone(&r, (uint32_t)c, msg.slots, 3, msg.proc);
    CHECK_EQ(vmm__reg_find(&r, (uint32_t)c, CA + 1, &out, &fs), -ENOENT);
    CHECK_EQ(vmm__reg_read_alloc(&r, msg.slots[2], &out), 0);

    /* fully usable: the parent's records are intact, 70 more bind (claiming chunks), publish, find */
    for (int i = 0; i < 3; i++)
        CHECK(vmm__reg_find(&r, me, BASE_ADDR + (uint64_t)i * TWO_MIB + 9, &out, &fs) == 0 && fs == ps[i], "parent record %d", i);
    uint32_t more[70];
    int bad = 0;
    for (int i = 0; i < 70; i++) {
        uint64_t a = BASE_ADDR + (2ull << 36) + (uint64_t)i * TWO_MIB;
        if (vmm__reg_bind(&r, a, TWO_MIB, &more[i]) || vmm__reg_publish(&r, more[i], &d, NULL) ||
            vmm__reg_find(&r, me, a + 1, &out, &fs) || fs != more[i])
            bad++;
    }
    CHECK_EQ(bad, 0);
    CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
    CHECK(gs.procs_dead == 0 && gs.chunks_reclaimed == 0 && gs.records_reclaimed == 0, "second gc reclaimed %u/%u",
          gs.chunks_reclaimed, gs.records_reclaimed);
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* A child publishing and retracting in a loop, SIGKILLed at a random moment, 50 times. */
static void churn(vmm__reg *r, uint64_t cb, int ready_fd)
{
    vmm__reg_forget_after_fork(r);
    if (vmm__reg_attach(r, NULL)) _exit(2);
    uint32_t perm, s[16];
    int st[16] = {0};
    uint64_t ad[16] = {0}, n = 0;
    vmm_reg_alloc d;
    desc(&d, 1, "churn", 0, VMM_API_TEST);
    if (vmm__reg_bind(r, cb, TWO_MIB, &perm) || vmm__reg_publish(r, perm, &d, NULL)) _exit(3);
    if (write(ready_fd, "r", 1) != 1) _exit(4);
    g_rng ^= (uint64_t)getpid() << 17;
    for (;; n++) {
        int j = (int)(rnd() % 16);
        switch (st[j]) {
        case 0:
            ad[j] = cb + (uint64_t)(j + 1) * 64 * MiB + (n % 16) * 4 * MiB;
            if (vmm__reg_bind(r, ad[j], (n & 1) ? 4 * MiB : TWO_MIB, &s[j]) == 0) st[j] = 1;
            break;
        case 1:
            d.requested_size = n;
            if (vmm__reg_publish(r, s[j], &d, NULL) == 0) st[j] = 2;
            break;
        default:
            if (rnd() % 2) {
                if (vmm__reg_retract(r, s[j]) == 0) st[j] = 1;
            } else if (vmm__reg_unbind(r, s[j]) == 0) {
                st[j] = 0;
            }
        }
    }
}

static void test_kill_random(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 4096)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    const uint32_t me = (uint32_t)getpid();
    vmm_reg_alloc d, out;
    uint64_t fs;
    uint32_t ps[4];
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR + (uint64_t)i * TWO_MIB, TWO_MIB, &ps[i]), 0);
        desc(&d, 1, "parent", 0, VMM_API_TEST);
        CHECK_EQ(vmm__reg_publish(&r, ps[i], &d, NULL), 0);
    }
    const uint64_t CB = BASE_ADDR + (1ull << 38);
    unsigned kills = 0, rec_total = 0, chunk_total = 0, rebuilt = 0, odd_seen = 0, torn_index = 0;
    int fails0 = check__failed;
    double worst = 0;
    for (int it = 0; it < 50 && check__failed - fails0 < 10; it++) {
        int pfd[2];
        if (pipe(pfd) != 0) break;
        fflush(NULL);
        pid_t c = xfork();
        if (c == 0) {
            close(pfd[0]);
            churn(&r, CB, pfd[1]);
        }
        close(pfd[1]);
        char b;
        int ready = read(pfd[0], &b, 1) == 1;
        close(pfd[0]);
        CHECK(ready, "churn child %d did not start", it);
        sleep_us((long)(rnd() % 3000));
        kill(c, SIGKILL);
        CHECK(wait_killed(c), "churn child %d not killed", it);
        kills++;
        torn_index += (unsigned)(__atomic_load_n(&r.hdr->index_seq, __ATOMIC_RELAXED) & 1);
        /* readers never hang, and find what is there */
        double t0 = now_s();
        visit_ctx v = visit(&r, 0);
        odd_seen += (unsigned)v.n_err;
        for (int i = 0; i < 4; i++)
            CHECK(vmm__reg_find(&r, me, BASE_ADDR + (uint64_t)i * TWO_MIB + 1, &out, &fs) == 0 && fs == ps[i],
                  "iteration %d: parent record %d not found before repair", it, i);
        CHECK(vmm__reg_find(&r, (uint32_t)c, CB + 1, &out, &fs) == 0, "iteration %d: child's permanent record", it);
        double dt = now_s() - t0;
        if (dt > worst) worst = dt;
        CHECK(dt < 5.0, "iteration %d: reads took %.2f s", it, dt);
        uint32_t cproc = 0;
        vmm_reg_proc p;
        CHECK_EQ(vmm__reg_find_proc(&r, (uint32_t)c, &p, &cproc), 0);
        /* the parent keeps writing (its first index change repairs a torn index) */
        uint32_t s;
        int wrc = vmm__reg_bind(&r, BASE_ADDR + 64 * MiB, TWO_MIB, &s);
        if (!wrc) wrc = vmm__reg_publish(&r, s, &d, NULL);
        if (!wrc) wrc = vmm__reg_find(&r, me, BASE_ADDR + 64 * MiB + 1, &out, &fs);
        if (!wrc) wrc = vmm__reg_unbind(&r, s);
        CHECK(wrc == 0, "iteration %d: parent write after the kill: %d", it, wrc);
        vmm__reg_gc_stats gs;
        CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
        CHECK(gs.procs_dead == 1 && gs.chunks_reclaimed >= 1 && gs.records_reclaimed >= 1,
              "iteration %d: gc %u dead, %u chunks, %u records", it, gs.procs_dead, gs.chunks_reclaimed, gs.records_reclaimed);
        rec_total += gs.records_reclaimed;
        chunk_total += gs.chunks_reclaimed;
        rebuilt += gs.index_rebuilt;
        CHECK_EQ(visit(&r, (uint32_t)c).n, 0);
        CHECK_EQ(visit(&r, 0).n, 4);
        CHECK_EQ(index_count(&r, UINT64_MAX), 4);
        CHECK_EQ(r.hdr->index_seq & 1, 0);
        CHECK_EQ((uint32_t)proc_of(&r, cproc)->claim, 0);
        CHECK_EQ(vmm__reg_find(&r, (uint32_t)c, CB + 1, &out, &fs), -ENOENT);
        for (int i = 0; i < 4; i++)
            CHECK(vmm__reg_find(&r, me, BASE_ADDR + (uint64_t)i * TWO_MIB + 1, &out, &fs) == 0 && fs == ps[i],
                  "iteration %d: parent record %d after gc", it, i);
    }
    printf("stat: SIGKILL at random points: %u kills, %u records and %u chunks reclaimed, index left mid-change %u "
           "times (rebuilt by gc %u), %u records left mid-write, slowest read pass %.3f s\n",
           kills, rec_total, chunk_total, torn_index, rebuilt, odd_seen, worst);
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* A child dies holding the index lock: readers never notice, the next writer takes the lock over;
 * a gc that died mid-rebuild (index_seq odd, index wiped) makes finds busy until gc runs again. */
static void test_kill_index_writer(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 1024)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    const uint32_t me = (uint32_t)getpid();
    vmm_reg_alloc d, out;
    uint64_t fs;
    uint32_t ps[8];
    desc(&d, 1, "parent", 0, VMM_API_TEST);
    for (int i = 0; i < 8; i++) {
        CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR + (uint64_t)i * TWO_MIB, TWO_MIB, &ps[i]), 0);
        CHECK_EQ(vmm__reg_publish(&r, ps[i], &d, NULL), 0);
    }
    for (int variant = 0; variant < 2; variant++) {
        fflush(NULL);
        pid_t c = xfork();
        if (c == 0) {
            vmm__reg w;
            if (vmm__reg_open(&w, name, VMM__REG_WRITE, 0, NULL, NULL, 0) || vmm__reg_attach(&w, NULL)) _exit(2);
            uint64_t zero = 0, tag = ((uint64_t)w.proc_gen << 32) | (w.proc_index + 1);
            if (!__atomic_compare_exchange_n(&w.hdr->index_lock, &zero, tag, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) _exit(3);
            if (variant > 0) { /* a rebuild in progress */
                __atomic_add_fetch(&w.hdr->index_seq, 1, __ATOMIC_RELEASE);
                for (uint64_t i = 0; i < w.hdr->index_slots; i++) __atomic_store_n(&ix_of(&w)[i], 0, __ATOMIC_RELAXED);
            }
            raise(SIGKILL);
            _exit(4);
        }
        CHECK(wait_killed(c), "index writer not killed");
        CHECK(__atomic_load_n(&r.hdr->index_lock, __ATOMIC_RELAXED) != 0, "variant %d: the dead child holds the lock", variant);
        double t0 = now_s();
        int rc = vmm__reg_find(&r, me, BASE_ADDR + 3 * TWO_MIB + 1, &out, &fs);
        double dt = now_s() - t0;
        CHECK(dt < 2.0, "find with a dead index writer took %.2f s", dt);
        if (variant == 0) /* the index is intact: the entry is still there */
            CHECK(rc == 0 && fs == ps[3], "variant %d: find with a dead lock holder: %d", variant, rc);
        else /* nothing found while the index is mid-rebuild: busy, never "absent" */
            CHECK(rc == -EAGAIN, "variant %d: find in a wiped index: %d", variant, rc);
        /* the next writer takes the lock over from the dead holder, at once */
        uint32_t s;
        t0 = now_s();
        CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR + 32 * TWO_MIB, TWO_MIB, &s), 0);
        CHECK_EQ(vmm__reg_unbind(&r, s), 0);
        dt = now_s() - t0;
        CHECK(dt < 1.0, "variant %d: taking the lock over from a dead holder took %.2f s", variant, dt);
        CHECK_EQ(__atomic_load_n(&r.hdr->index_lock, __ATOMIC_RELAXED), 0);
        vmm__reg_gc_stats gs;
        CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
        CHECK_EQ(gs.procs_dead, 1);
        if (variant == 1) CHECK_EQ(gs.index_rebuilt, 1);
        CHECK_EQ(r.hdr->index_seq & 1, 0);
        CHECK_EQ(index_count(&r, UINT64_MAX), 8);
        for (int i = 0; i < 8; i++)
            CHECK(vmm__reg_find(&r, me, BASE_ADDR + (uint64_t)i * TWO_MIB + 7, &out, &fs) == 0 && fs == ps[i],
                  "variant %d: record %d after repair", variant, i);
    }
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* ---- pid reuse ---- */

static pid_t fork_sleeper(void)
{
    fflush(NULL);
    pid_t c = xfork();
    if (c == 0) {
        for (;;) pause();
    }
    return c;
}

/* A child that attaches, publishes two records, reports, and waits to be killed. */
static pid_t fork_publisher(vmm__reg *r, uint64_t addr, uint32_t *slots, uint32_t *proc)
{
    int pfd[2];
    if (pipe(pfd) != 0) return -1;
    fflush(NULL);
    pid_t c = xfork();
    if (c == 0) {
        close(pfd[0]);
        vmm__reg_forget_after_fork(r);
        uint32_t msg[3];
        vmm_reg_alloc d;
        desc(&d, 4096, "victim", 0, VMM_API_TEST);
        if (vmm__reg_attach(r, NULL)) _exit(2);
        for (int i = 0; i < 2; i++)
            if (vmm__reg_bind(r, addr + (uint64_t)i * TWO_MIB, TWO_MIB, &msg[i]) || vmm__reg_publish(r, msg[i], &d, NULL))
                _exit(3);
        msg[2] = r->proc_index;
        if (write(pfd[1], msg, sizeof msg) != (ssize_t)sizeof msg) _exit(4);
        for (;;) pause();
    }
    close(pfd[1]);
    uint32_t msg[3];
    int rc = read_full(pfd[0], msg, sizeof msg);
    close(pfd[0]);
    if (rc) {
        kill(c, SIGKILL);
        waitpid(c, NULL, 0);
        return -1;
    }
    slots[0] = msg[0];
    slots[1] = msg[1];
    *proc = msg[2];
    return c;
}

static void test_pid_reuse(void)
{
    /* liveness basics */
    uint64_t st_self = 0, ns_self = 0;
    CHECK_EQ(vmm__proc_identity((uint32_t)getpid(), &st_self, &ns_self), 0);
    CHECK_EQ(vmm__reg_liveness((uint32_t)getpid(), st_self, ns_self), VMM__ALIVE);
    CHECK_EQ(vmm__reg_liveness((uint32_t)getpid(), st_self, 0), VMM__ALIVE);
    CHECK_EQ(vmm__reg_liveness((uint32_t)getpid(), st_self + 1, ns_self), VMM__DEAD);
    CHECK_EQ(vmm__reg_liveness(0, st_self, ns_self), VMM__DEAD);
    CHECK_EQ(vmm__reg_liveness(0x7ffffff0u, 1, ns_self), VMM__DEAD); /* above any pid_max */
    CHECK_EQ(vmm__reg_liveness((uint32_t)getpid(), st_self, ns_self + 12345), VMM__UNKNOWN);
    CHECK_EQ(vmm__proc_identity(0x7ffffff0u, &st_self, NULL), -ENOENT);

    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 1024)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    const uint64_t VA = BASE_ADDR + (1ull << 37);
    vmm_reg_alloc out;
    uint64_t fs;
    vmm__reg_gc_stats gs;

    /* 1. simulated: the dead owner's pid now names a live process (a sleeping child).  Start
     * times count clock ticks (10 ms): the two must not start in the same tick, or no reader
     * could tell them apart (a limit of the (pid, start_time) identity, not of the code). */
    uint32_t slots[2], proc;
    pid_t live = fork_sleeper();
    sleep_us(30000);
    pid_t victim = fork_publisher(&r, VA, slots, &proc);
    CHECK(victim > 0, "publisher child failed");
    if (victim > 0 && live > 0) {
        kill(victim, SIGKILL);
        CHECK(wait_killed(victim), "victim not killed");
        vmm_reg_proc *p = proc_of(&r, proc);
        uint64_t dead_start = p->start_time;
        uint64_t live_start = 0;
        CHECK_EQ(vmm__proc_identity((uint32_t)live, &live_start, NULL), 0);
        CHECK(dead_start != live_start, "start times equal");
        /* rewrite the owner's pid everywhere, under the seq protocol, keeping the dead start_time */
        uint64_t claim = __atomic_load_n(&p->claim, __ATOMIC_RELAXED);
        __atomic_store_n(&p->claim, (claim & ~0xffffffffull) | (uint32_t)live, __ATOMIC_RELEASE);
        uint32_t s = p->seq;
        __atomic_store_n(&p->seq, s + 1, __ATOMIC_RELAXED);
        __atomic_store_n(&p->pid, (uint32_t)live, __ATOMIC_RELAXED);
        __atomic_store_n(&p->seq, s + 2, __ATOMIC_RELEASE);
        for (int i = 0; i < 2; i++) {
            vmm_reg_alloc *a = rec_of(&r, slots[i]);
            s = a->seq;
            __atomic_store_n(&a->seq, s + 1, __ATOMIC_RELAXED);
            __atomic_store_n(&a->pid, (uint32_t)live, __ATOMIC_RELAXED);
            __atomic_store_n(&a->seq, s + 2, __ATOMIC_RELEASE);
        }
        /* the index is keyed by (pid, address): leave it mid-change so the next writer rebuilds it */
        __atomic_add_fetch(&r.hdr->index_seq, 1, __ATOMIC_RELEASE);
        vmm_reg_proc pr;
        uint32_t pidx = 0;
        CHECK(vmm__reg_find_proc(&r, (uint32_t)live, &pr, &pidx) == 0 && pidx == proc, "find_proc by the reused pid");
        CHECK_EQ(pr.start_time, dead_start);
        CHECK_EQ(vmm__reg_liveness(pr.pid, pr.start_time, pr.pidns), VMM__DEAD);
        CHECK_EQ(vmm__reg_liveness((uint32_t)live, live_start, pr.pidns), VMM__ALIVE);
        CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
        CHECK(gs.procs_dead == 1 && gs.records_reclaimed == 2 && gs.chunks_reclaimed == 1 && gs.index_rebuilt == 1,
              "gc after simulated pid reuse: %u dead, %u records, %u chunks, rebuilt %u", gs.procs_dead,
              gs.records_reclaimed, gs.chunks_reclaimed, gs.index_rebuilt);
        check_gone(&r, (uint32_t)live, slots, 2, proc);
        CHECK_EQ(vmm__reg_find(&r, (uint32_t)live, VA + 1, &out, &fs), -ENOENT);
        CHECK_EQ(index_count(&r, UINT64_MAX), 0);
    }
    if (live > 0) {
        kill(live, SIGKILL);
        waitpid(live, NULL, 0);
    }

    /* 2. real: the next fork gets the dead owner's pid (root, through ns_last_pid) */
    victim = fork_publisher(&r, VA, slots, &proc);
    CHECK(victim > 0, "publisher child failed");
    if (victim > 0) {
        sleep_us(30000); /* the pid's next owner starts in a later clock tick */
        kill(victim, SIGKILL);
        CHECK(wait_killed(victim), "victim not killed");
        pid_t reuse = -1;
        for (int attempt = 0; attempt < 20 && reuse < 0; attempt++) {
            int fd = open("/proc/sys/kernel/ns_last_pid", O_RDWR | O_CLOEXEC);
            if (fd < 0) break;
            char buf[32];
            int len = snprintf(buf, sizeof buf, "%d", (int)victim - 1);
            fflush(NULL);
            if (write(fd, buf, (size_t)len) != len) {
                close(fd);
                break;
            }
            close(fd);
            pid_t c = xfork();
            if (c == 0) {
                for (;;) pause();
            }
            if (c == victim) {
                reuse = c;
            } else if (c > 0) {
                kill(c, SIGKILL);
                waitpid(c, NULL, 0);
            }
        }
        if (reuse < 0) {
            printf("skip: real pid reuse: cannot steer the next pid through /proc/sys/kernel/ns_last_pid\n");
        } else {
            vmm_reg_proc pr;
            CHECK_EQ(vmm__reg_find_proc(&r, (uint32_t)reuse, &pr, NULL), 0);
            CHECK_EQ(vmm__reg_liveness(pr.pid, pr.start_time, pr.pidns), VMM__DEAD);
            /* before gc its records are still findable by (pid, address): a reader must judge the owner */
            CHECK(vmm__reg_find(&r, (uint32_t)reuse, VA + 1, &out, &fs) == 0 &&
                      vmm__reg_liveness(out.pid, out.start_time, out.pidns) == VMM__DEAD,
                  "record of the dead owner of a reused pid");
            CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
            CHECK(gs.procs_dead == 1 && gs.records_reclaimed == 2, "gc after real pid reuse: %u dead, %u records",
                  gs.procs_dead, gs.records_reclaimed);
            check_gone(&r, (uint32_t)reuse, slots, 2, proc);
            printf("stat: pid reuse: a real process got the dead owner's pid %d; it read as dead and was reclaimed\n",
                   (int)reuse);
            kill(reuse, SIGKILL);
            waitpid(reuse, NULL, 0);
        }
        /* whatever happened, the victim's records go now */
        CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
        check_gone(&r, (uint32_t)victim, slots, 2, proc);
    }
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* ---- corrupt, short, foreign segments ---- */

static int make_obj(const char *name, const void *bytes, size_t len, size_t size)
{
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return -errno;
    int rc = ftruncate(fd, (off_t)size) == 0 && (len == 0 || pwrite(fd, bytes, len, 0) == (ssize_t)len) ? 0 : -errno;
    close(fd);
    return rc;
}

static int obj_equals(const char *name, const void *bytes, size_t len, size_t size)
{
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) return 0;
    struct stat st;
    int ok = fstat(fd, &st) == 0 && (size_t)st.st_size == size;
    char *buf = malloc(len + 1);
    ok = ok && buf && (len == 0 || (pread(fd, buf, len, 0) == (ssize_t)len && memcmp(buf, bytes, len) == 0));
    free(buf);
    close(fd);
    return ok;
}

/* Open a hand-made object: must fail, with a one-line message naming the registry and the
 * problem (one of the words), and must leave the object as it was. */
static void expect_refused(const char *what, const void *bytes, size_t len, size_t size, int mode, const char *w1,
                           const char *w2)
{
    const char *name = new_name();
    if (make_obj(name, bytes, len, size) != 0) {
        CHECK(0, "%s: cannot create the object", what);
        return;
    }
    vmm__reg r;
    char err[256] = "";
    int rc = vmm__reg_open(&r, name, mode, 64, NULL, err, sizeof err);
    CHECK(rc < 0, "%s (mode %d): opened", what, mode);
    if (rc == 0) {
        vmm__reg_close(&r);
    } else {
        CHECK((strstr(err, w1) || (w2 && strstr(err, w2))) && strstr(err, name) && !strchr(err, '\n'),
              "%s (mode %d): message \"%s\" should name %s and say %s%s%s", what, mode, err, name, w1, w2 ? " or " : "",
              w2 ? w2 : "");
    }
    CHECK(obj_equals(name, bytes, len, size), "%s (mode %d): object modified", what, mode);
    shm_unlink(name);
}

static void test_corrupt(void)
{
    /* a real segment as template */
    const char *tname = new_name();
    vmm__reg t;
    if (open_reg(&t, tname, VMM__REG_CREATE, 64)) return;
    size_t size = t.map_size;
    uint8_t *img = malloc(size), *buf = malloc(size + 8192);
    if (!img || !buf) {
        free(img);
        free(buf);
        vmm__reg_close(&t);
        return;
    }
    memcpy(img, t.base, size);
    vmm__reg_close(&t);
    shm_unlink(tname);
    const vmm_reg_header h0 = *(const vmm_reg_header *)img;
    vmm_reg_header *h = (vmm_reg_header *)buf;
#define RESET() memcpy(buf, img, size)

    expect_refused("empty", NULL, 0, 0, VMM__REG_READ, "empty", "not initialised");
    expect_refused("empty", NULL, 0, 0, VMM__REG_WRITE, "empty", "not initialised");
    RESET();
    expect_refused("100 bytes", buf, 100, 100, VMM__REG_READ, "shorter", "truncated");
    expect_refused("511 bytes", buf, 511, 511, VMM__REG_READ, "shorter", "truncated");
    RESET();
    h->magic ^= 1;
    expect_refused("wrong magic", buf, size, size, VMM__REG_READ, "magic", NULL);
    expect_refused("wrong magic", buf, size, size, VMM__REG_CREATE, "magic", "not a vmmshim registry");
    h->ready = 0;
    expect_refused("wrong magic, not ready", buf, size, size, VMM__REG_CREATE, "not a vmmshim registry", "magic");
    expect_refused("wrong magic, not ready", buf, size, size, VMM__REG_READ, "magic", "not initialised");
    for (size_t i = 0; i < 8192; i++) buf[i] = (uint8_t)rnd();
    expect_refused("random bytes", buf, 8192, 8192, VMM__REG_CREATE, "not a vmmshim registry", "magic");
    expect_refused("random bytes", buf, 8192, 8192, VMM__REG_READ, "magic", NULL);
    RESET();
    h->ready = 0;
    expect_refused("not ready", buf, size, size, VMM__REG_READ, "not initialised", NULL);
    RESET();
    h->compat_version = 99;
    expect_refused("compat_version 99", buf, size, size, VMM__REG_READ, "version", NULL);
    expect_refused("compat_version 99", buf, size, size, VMM__REG_WRITE, "version", NULL);
    expect_refused("compat_version 99", buf, size, size, VMM__REG_CREATE, "version", NULL);
    RESET();
    expect_refused("truncated to half", buf, size / 2, size / 2, VMM__REG_READ, "truncated", "shorter");
    h->total_size = size + 4096;
    expect_refused("total_size beyond the object", buf, size, size, VMM__REG_READ, "truncated", "shorter");
    RESET();
    h->capacity = 0;
    expect_refused("capacity 0", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->capacity = h0.capacity + VMM_REG_CHUNK_RECORDS;
    expect_refused("capacity != chunk_count * 64", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->index_slots = h0.index_slots - 1;
    expect_refused("index_slots not a power of two", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->index_slots = h0.capacity / 2;
    expect_refused("index_slots < capacity", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->index_slots = 1ull << 62; /* slots * 4 wraps to 0 */
    expect_refused("index_slots 2^62", buf, size, size, VMM__REG_READ, "corrupt", "truncated");
    RESET();
    h->proc_capacity = 0;
    expect_refused("proc_capacity 0", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->proc_off = 64;
    expect_refused("proc table inside the header", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->index_off = h0.chunk_off;
    expect_refused("index over the chunk table", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->rec_off = 0 - h0.capacity * sizeof(vmm_reg_alloc); /* rec_off + records wraps to 0 */
    expect_refused("rec_off near 2^64", buf, size, size, VMM__REG_READ, "corrupt", "truncated");
    RESET();
    h->chunk_off = UINT64_MAX - 7; /* chunk_off + chunk table wraps */
    expect_refused("chunk_off near 2^64", buf, size, size, VMM__REG_READ, "corrupt", "truncated");
    RESET();
    memset(buf + size, 0, 8192);
    h->rec_off = h0.rec_off + 4; /* misaligned records (8-byte atomics would straddle) */
    h->total_size = size + 8192;
    expect_refused("misaligned rec_off", buf, size + 8192, size + 8192, VMM__REG_READ, "corrupt", NULL);
    RESET();
    h->alloc_size = 999;
    expect_refused("alloc_size 999", buf, size, size, VMM__REG_READ, "sizes", "corrupt");
    RESET();
    h->header_size = 100;
    expect_refused("header_size 100", buf, size, size, VMM__REG_READ, "sizes", "corrupt");
    RESET();
    h->chunk_records = 32;
    expect_refused("chunk_records 32", buf, size, size, VMM__REG_READ, "corrupt", NULL);
    /* the template itself opens (so the refusals above are about the damage) */
    const char *okname = new_name();
    vmm__reg r;
    RESET();
    if (make_obj(okname, buf, size, size) == 0 && open_reg(&r, okname, VMM__REG_READ, 0) == 0) vmm__reg_close(&r);
    shm_unlink(okname);
    /* validate directly, as `vmmctl check` uses it */
    char err[256] = "";
    CHECK_EQ(vmm__reg_validate(img, size, err, sizeof err), 0);
    CHECK(vmm__reg_validate(img, 100, err, sizeof err) < 0 && strstr(err, "shorter") && !strstr(err, " :"),
          "validate short: \"%s\"", err);
    CHECK(vmm__reg_validate(img, size - 4096, err, sizeof err) < 0 && strstr(err, "truncated"), "validate truncated: \"%s\"", err);
    free(img);
    free(buf);
#undef RESET

    /* garbage in the index: readers never crash, find says -ENOENT (or finds a true record) */
    const char *name = new_name();
    vmm__reg w, rd;
    if (open_reg(&w, name, VMM__REG_CREATE, 64) || open_reg(&rd, name, VMM__REG_READ, 0)) return;
    CHECK_EQ(vmm__reg_attach(&w, NULL), 0);
    const uint32_t me = (uint32_t)getpid();
    uint32_t slots[10];
    vmm_reg_alloc d, out;
    uint64_t fs;
    desc(&d, 1, "victim", 0, VMM_API_TEST);
    for (int i = 0; i < 10; i++) {
        CHECK_EQ(vmm__reg_bind(&w, BASE_ADDR + (uint64_t)i * TWO_MIB, TWO_MIB, &slots[i]), 0);
        CHECK_EQ(vmm__reg_publish(&w, slots[i], &d, NULL), 0);
    }
    uint32_t *ix = ix_of(&w);
    uint64_t nslots = w.hdr->index_slots, cap = w.hdr->capacity;
    for (int pass = 0; pass < 2; pass++) {
        for (uint64_t i = 0; i < nslots; i++)
            ix[i] = pass == 0 ? (rnd() & 1 ? (uint32_t)(rnd() % (cap + 1)) : (uint32_t)rnd()) : 0xffffffffu;
        int bad = 0;
        double t0 = now_s();
        for (int k = 0; k < 400; k++) { /* an all-tombstone index makes every probe a full scan */
            uint64_t a = k % 2 ? BASE_ADDR + rnd() % (20 * TWO_MIB) : rnd() & ((1ull << 47) - 1);
            int rc = vmm__reg_find(&rd, me, a, &out, &fs);
            if (rc == 0 && !(out.pid == me && out.address <= a && a < out.address + out.extent && fs < cap)) bad++;
            if (rc != 0 && rc != -ENOENT) bad++;
        }
        double dt = now_s() - t0;
        CHECK(bad == 0 && dt < 10, "garbage index pass %d: %d bad answers, %.2f s", pass, bad, dt);
    }
    /* mark it mid-rebuild: gc rebuilds it and every record is found again */
    memset(ix, 0xff, nslots * 4);
    __atomic_add_fetch(&w.hdr->index_seq, 1, __ATOMIC_RELEASE);
    vmm__reg_gc_stats gcs;
    CHECK(vmm__reg_gc(&w, &gcs) == 0 && gcs.index_rebuilt == 1, "gc rebuilds a garbage index");
    uint32_t s;
    CHECK_EQ(vmm__reg_bind(&w, BASE_ADDR + 64 * TWO_MIB, TWO_MIB, &s), 0);
    CHECK_EQ(index_count(&w, UINT64_MAX), 11);
    int found = 0;
    for (int i = 0; i < 10; i++) found += vmm__reg_find(&rd, me, BASE_ADDR + (uint64_t)i * TWO_MIB + 1, &out, &fs) == 0 && fs == slots[i];
    CHECK_EQ(found, 10);

    /* garbage records: reads return a copy or -EAGAIN, in bounded time, and never crash */
    for (uint64_t i = 0; i < VMM_REG_CHUNK_RECORDS * sizeof(vmm_reg_alloc); i++) ((uint8_t *)rec_of(&w, 0))[i] = (uint8_t)rnd();
    double t0 = now_s();
    visit_ctx v = visit(&rd, 0);
    int odd = 0;
    for (uint64_t i = 0; i < cap; i++) {
        int rc = vmm__reg_read_alloc(&rd, i, &out);
        CHECK(rc == 0 || rc == -EAGAIN, "read_alloc of garbage: %d", rc);
        odd += rc == -EAGAIN;
    }
    for (int k = 0; k < 200; k++) {
        int rc = vmm__reg_find(&rd, me, BASE_ADDR + rnd() % (20 * TWO_MIB), &out, &fs);
        CHECK(rc == 0 || rc == -ENOENT || rc == -EAGAIN, "find over garbage records: %d", rc);
    }
    double dt = now_s() - t0;
    CHECK(dt < 10, "reads of garbage records took %.2f s", dt);
    CHECK(v.n <= VMM_REG_CHUNK_RECORDS, "for_each visited %" PRIu64, v.n);
    printf("stat: garbage records: %d of %" PRIu64 " read as busy (odd seq), for_each visited %" PRIu64 "\n", odd, cap, v.n);
    vmm__reg_close(&rd);
    vmm__reg_forget_after_fork(&w); /* do not detach through the garbage */
    vmm__reg_close(&w);
    shm_unlink(name);
}

/* ---- a second uid ---- */

static void become(uid_t u, gid_t g)
{
    if (setgroups(0, NULL) != 0 || setresgid(g, g, g) != 0 || setresuid(u, u, u) != 0) {
        fprintf(stderr, "cannot switch to uid %u gid %u: %s\n", (unsigned)u, (unsigned)g, strerror(errno));
        _exit(90);
    }
}

static void test_second_uid(void)
{
    if (geteuid() != 0) {
        printf("skip: second uid: not root, cannot switch to another uid\n");
        return;
    }
    uid_t u = 54321;
    gid_t g = 54321;
    const char *who = "raw uid (no passwd entry)";
    struct passwd *pw = getpwnam("vmmshim-test");
    if (!pw && access("/usr/sbin/useradd", X_OK) == 0) {
        fflush(NULL);
        int rc = system("useradd -M -r -s /usr/sbin/nologin vmmshim-test >/dev/null 2>&1");
        (void)rc;
        pw = getpwnam("vmmshim-test");
    }
    if (pw) {
        u = pw->pw_uid;
        g = pw->pw_gid;
        who = "user vmmshim-test";
    }
    uid_t u2 = 54399;
    while (getpwuid(u2) && u2 < 60000) u2++;
    printf("stat: second uid: %s, uid %u gid %u; third uid %u\n", who, (unsigned)u, (unsigned)g, (unsigned)u2);
    CHECK(u != 0 && u != u2, "uids");

    /* 1. another user's (0600) registry: denied for read, write and create */
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 64)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    int fd;
    pid_t c = fork_checked(&fd);
    if (c == 0) {
        become(u, g);
        CHECK_EQ(geteuid(), u);
        static const int modes[] = {VMM__REG_READ, VMM__REG_WRITE, VMM__REG_CREATE};
        for (int m = 0; m < 3; m++) {
            vmm__reg x;
            char err[256] = "";
            int rc = vmm__reg_open(&x, name, modes[m], 64, NULL, err, sizeof err);
            CHECK(rc == -EACCES && strstr(err, "permission denied") && strstr(err, name), "uid %u mode %d: %d %s",
                  (unsigned)u, modes[m], rc, err);
            if (rc == 0) vmm__reg_close(&x);
        }
        child_done(fd);
    }
    child_merge(c, fd, "second uid denied");
    vmm__reg_close(&r);
    shm_unlink(name);

    /* 2. squatting: another uid pre-creates our name with mode 0666 (empty, or a real registry) */
    for (int variant = 0; variant < 2; variant++) {
        name = new_name();
        c = fork_checked(&fd);
        if (c == 0) {
            become(u, g);
            umask(0);
            if (variant == 0) {
                int o = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0666);
                CHECK(o >= 0 && fchmod(o, 0666) == 0, "squat: %s", strerror(errno));
                if (o >= 0) close(o);
            } else {
                vmm__reg x;
                if (open_reg(&x, name, VMM__REG_CREATE, 64) == 0) {
                    CHECK_EQ(fchmod(x.fd, 0666), 0);
                    vmm__reg_close(&x);
                }
            }
            child_done(fd);
        }
        child_merge(c, fd, "squatter");
        char path[128];
        struct stat st0, st1;
        shm_path(path, sizeof path, name);
        CHECK(stat(path, &st0) == 0 && st0.st_uid == u && (st0.st_mode & 0777) == 0666, "squatted object");
        static const int modes[] = {VMM__REG_CREATE, VMM__REG_WRITE, VMM__REG_READ};
        for (int m = 0; m < 3; m++) {
            char err[256] = "";
            int rc = vmm__reg_open(&r, name, modes[m], 64, NULL, err, sizeof err);
            CHECK(rc == -EACCES && strstr(err, "every user") && strstr(err, name), "squat variant %d mode %d: %d %s",
                  variant, modes[m], rc, err);
            if (rc == 0) vmm__reg_close(&r);
        }
        CHECK(stat(path, &st1) == 0 && st1.st_size == st0.st_size && st1.st_uid == u && (st1.st_mode & 0777) == 0666,
              "squatted object changed");
        shm_unlink(name);
    }

    /* 2b. a 0600 registry another uid planted under our name: root's shim must not publish into
     * it (its planter would read root's allocations), but root may still open it to reclaim */
    name = new_name();
    c = fork_checked(&fd);
    if (c == 0) {
        become(u, g);
        vmm__reg x;
        CHECK(open_reg(&x, name, VMM__REG_CREATE, 64) == 0, "planting a registry");
        vmm__reg_close(&x);
        child_done(fd);
    }
    child_merge(c, fd, "planter");
    {
        char err[256] = "";
        int rc = vmm__reg_open(&r, name, VMM__REG_CREATE, 64, NULL, err, sizeof err);
        CHECK(rc == -EACCES && strstr(err, "owned by uid") && strstr(err, name), "root publisher accepted a planted registry: %d %s",
              rc, err);
        if (rc == 0) vmm__reg_close(&r);
        rc = vmm__reg_open(&r, name, geteuid() == 0 ? VMM__REG_WRITE : VMM__REG_READ, 64, NULL, err, sizeof err);
        CHECK(rc == 0, "root cannot open another user's registry to reclaim it: %s", err);
        if (rc == 0) vmm__reg_close(&r);
    }
    shm_unlink(name);

    /* 3. a group registry (0660) of uid u: a third uid in the group may read; may write only when
     * it asked for the group; outside the group it is denied */
    name = new_name();
    char gs[32];
    snprintf(gs, sizeof gs, "%u", (unsigned)g);
    c = fork_checked(&fd);
    if (c == 0) {
        become(u, g);
        vmm__reg x;
        char err[256] = "";
        int rc = vmm__reg_open(&x, name, VMM__REG_CREATE, 64, gs, err, sizeof err);
        CHECK(rc == 0, "group create: %d %s", rc, err);
        if (rc == 0) vmm__reg_close(&x);
        child_done(fd);
    }
    child_merge(c, fd, "group creator");
    c = fork_checked(&fd);
    if (c == 0) {
        become(u2, g);
        vmm__reg x;
        char err[256] = "";
        int rc = vmm__reg_open(&x, name, VMM__REG_WRITE, 0, NULL, err, sizeof err);
        CHECK(rc == -EACCES && strstr(err, "owned by uid"), "group member writing without the group: %d %s", rc, err);
        if (rc == 0) vmm__reg_close(&x);
        rc = vmm__reg_open(&x, name, VMM__REG_READ, 0, NULL, err, sizeof err);
        CHECK(rc == 0, "group member reading: %d %s", rc, err);
        if (rc == 0) vmm__reg_close(&x);
        rc = vmm__reg_open(&x, name, VMM__REG_WRITE, 0, gs, err, sizeof err);
        CHECK(rc == 0, "group member writing with the group: %d %s", rc, err);
        if (rc == 0) {
            CHECK_EQ(vmm__reg_attach(&x, NULL), 0);
            uint32_t s;
            CHECK_EQ(vmm__reg_bind(&x, BASE_ADDR, TWO_MIB, &s), 0);
            vmm__reg_close(&x);
        }
        child_done(fd);
    }
    child_merge(c, fd, "group member");
    c = fork_checked(&fd);
    if (c == 0) {
        become(u2, (gid_t)u2);
        vmm__reg x;
        char err[256] = "";
        int rc = vmm__reg_open(&x, name, VMM__REG_READ, 0, NULL, err, sizeof err);
        CHECK(rc == -EACCES && strstr(err, "permission denied"), "outsider reading a group registry: %d %s", rc, err);
        if (rc == 0) vmm__reg_close(&x);
        child_done(fd);
    }
    child_merge(c, fd, "outsider");
    shm_unlink(name);
}

/* ---- concurrent attach from 8 processes ---- */

#define NPROC 8
#define PER_PROC 1000

static void test_concurrent_attach(void)
{
    const char *name = new_name();
    typedef struct {
        uint32_t pid[NPROC], proc[NPROC], slots[NPROC][PER_PROC];
        int ok[NPROC];
    } shared;
    shared *sh = mmap(NULL, sizeof(shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return;
    memset(sh, 0, sizeof *sh);
    int go[2], done[2];
    if (pipe(go) || pipe(done)) return;
    pid_t kids[NPROC];
    int fds[NPROC];
    for (int k = 0; k < NPROC; k++) {
        kids[k] = fork_checked(&fds[k]);
        if (kids[k] == 0) {
            close(go[1]);
            close(done[1]);
            char b;
            CHECK(read(go[0], &b, 1) == 0, "start barrier");
            vmm__reg x; /* all create the same fresh registry at once */
            if (open_reg(&x, name, VMM__REG_CREATE, 16384) == 0) {
                CHECK_EQ(vmm__reg_attach(&x, NULL), 0);
                vmm_reg_alloc d;
                int bad = 0;
                for (int i = 0; i < PER_PROC; i++) {
                    uint64_t a = BASE_ADDR + ((uint64_t)k * PER_PROC + (uint64_t)i) * TWO_MIB;
                    desc(&d, (uint64_t)k * PER_PROC + (uint64_t)i + 1, "conc", (uint32_t)k, VMM_API_TEST);
                    if (vmm__reg_bind(&x, a, TWO_MIB, &sh->slots[k][i]) || vmm__reg_publish(&x, sh->slots[k][i], &d, NULL))
                        bad++;
                }
                CHECK_EQ(bad, 0);
                sh->pid[k] = (uint32_t)getpid();
                sh->proc[k] = x.proc_index;
                __atomic_store_n(&sh->ok[k], 1, __ATOMIC_RELEASE);
                CHECK(read(done[0], &b, 1) == 0, "done barrier"); /* keep the records until the parent looked */
                vmm__reg_close(&x);                               /* detach */
            }
            child_done(fds[k]);
        }
    }
    close(go[0]);
    close(done[0]);
    close(go[1]); /* go */
    double t0 = now_s();
    for (int k = 0; k < NPROC; k++)
        while (!__atomic_load_n(&sh->ok[k], __ATOMIC_ACQUIRE) && now_s() - t0 < 30) sleep_us(2000);
    int all = 1;
    for (int k = 0; k < NPROC; k++) all = all && sh->ok[k];
    CHECK(all, "not every process published");
    vmm__reg r;
    if (all && open_reg(&r, name, VMM__REG_READ, 0) == 0) {
        uint8_t *seen = calloc(r.hdr->capacity, 1);
        uint64_t miss = 0, wrong = 0, dup = 0;
        vmm_reg_alloc out;
        uint64_t fs;
        for (int k = 0; k < NPROC && seen; k++) {
            for (int i = 0; i < PER_PROC; i++) {
                uint64_t a = BASE_ADDR + ((uint64_t)k * PER_PROC + (uint64_t)i) * TWO_MIB;
                if (vmm__reg_find(&r, sh->pid[k], a + rnd() % TWO_MIB, &out, &fs)) {
                    miss++;
                    continue;
                }
                if (fs != sh->slots[k][i] || out.address != a || out.requested_size != (uint64_t)k * PER_PROC + (uint64_t)i + 1 ||
                    out.proc_index != sh->proc[k])
                    wrong++;
                if (seen[fs]++) dup++;
            }
            for (int j = 0; j < k; j++) CHECK(sh->proc[j] != sh->proc[k], "processes %d and %d share proc slot %u", j, k, sh->proc[k]);
        }
        CHECK(seen && miss == 0 && wrong == 0 && dup == 0,
              "concurrent attach: %" PRIu64 " missed, %" PRIu64 " wrong, %" PRIu64 " slots shared", miss, wrong, dup);
        CHECK_EQ(visit(&r, 0).n_live, NPROC * PER_PROC);
        CHECK_EQ(index_count(&r, UINT64_MAX), NPROC * PER_PROC);
        free(seen);
        close(done[1]);
        done[1] = -1;
        for (int k = 0; k < NPROC; k++) child_merge(kids[k], fds[k], "concurrent attach");
        CHECK_EQ(visit(&r, 0).n, 0);
        CHECK_EQ(index_count(&r, UINT64_MAX), 0);
        vmm__reg_close(&r);
    } else {
        close(done[1]);
        done[1] = -1;
        for (int k = 0; k < NPROC; k++) child_merge(kids[k], fds[k], "concurrent attach");
    }
    munmap(sh, sizeof *sh);
    shm_unlink(name);
}

/* ---- threads of one process share a handle; a forked child gets a lock of its own ---- */

typedef struct {
    vmm__reg *r;
    int t;
    int bad;
} thr_arg;

static void *thr_main(void *p)
{
    thr_arg *a = p;
    uint32_t s[16];
    int st[16] = {0};
    vmm_reg_alloc d, out;
    uint64_t fs;
    const uint32_t me = (uint32_t)getpid();
    desc(&d, 1, "thread", 0, VMM_API_TEST);
    for (int n = 0; n < 6016; n++) {
        int j = n % 16;
        uint64_t addr = BASE_ADDR + ((uint64_t)a->t << 36) + (uint64_t)j * 64 * MiB + (uint64_t)((n / 16) % 8) * 4 * MiB;
        if (!st[j]) {
            if (vmm__reg_bind(a->r, addr, TWO_MIB, &s[j]) || vmm__reg_publish(a->r, s[j], &d, NULL)) {
                a->bad++;
                continue;
            }
            st[j] = 1;
            if (vmm__reg_find(a->r, me, addr + 1, &out, &fs) != 0 || fs != s[j]) a->bad++;
        } else {
            if (vmm__reg_unbind(a->r, s[j])) a->bad++;
            st[j] = 0;
        }
    }
    return NULL;
}

static void test_threads_and_fork_lock(void)
{
    const char *name = new_name();
    vmm__reg r;
    if (open_reg(&r, name, VMM__REG_CREATE, 4096)) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    pthread_t th[4];
    thr_arg args[4];
    for (int t = 0; t < 4; t++) {
        args[t] = (thr_arg){&r, t, 0};
        pthread_create(&th[t], NULL, thr_main, &args[t]);
    }
    int bad = 0;
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        bad += args[t].bad;
    }
    CHECK(bad == 0, "4 threads binding and unbinding: %d failures", bad);
    CHECK_EQ(r.hdr->index_seq & 1, 0);
    /* every thread ends with its 16 records unbound (6016 ops = 376 rounds of 16) */
    CHECK_EQ(index_count(&r, UINT64_MAX), 0);
    CHECK_EQ(visit(&r, 0).n, 0);

    /* after fork the child writes as a process of its own: the parent's hold on the index lock
     * excludes the child's bind until the parent lets go */
    uint64_t zero = 0, tag = ((uint64_t)r.proc_gen << 32) | (r.proc_index + 1);
    CHECK(__atomic_compare_exchange_n(&r.hdr->index_lock, &zero, tag, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED), "parent takes the lock");
    int fd;
    pid_t c = fork_checked(&fd);
    if (c == 0) {
        vmm__reg_forget_after_fork(&r);
        CHECK_EQ(vmm__reg_attach(&r, NULL), 0); /* and still works as a writer of its own */
        CHECK(r.attached && r.pid == (uint32_t)getpid(), "child attach");
        double t0 = now_s();
        uint32_t s;
        CHECK_EQ(vmm__reg_bind(&r, BASE_ADDR, TWO_MIB, &s), 0);
        double dt = now_s() - t0;
        CHECK(dt >= 0.15, "the child's bind went ahead while its parent held the index lock (%.3f s)", dt);
        CHECK_EQ(vmm__reg_unbind(&r, s), 0);
        child_done(fd);
    }
    struct timespec hold = {0, 200 * 1000 * 1000};
    nanosleep(&hold, NULL);
    __atomic_store_n(&r.hdr->index_lock, 0, __ATOMIC_RELEASE);
    child_merge(c, fd, "fork lock");
    vmm__reg_gc_stats gs;
    CHECK_EQ(vmm__reg_gc(&r, &gs), 0); /* the child attached and exited without detaching */
    CHECK_EQ(gs.procs_dead, 1);
    vmm__reg_close(&r);
    shm_unlink(name);
}

int main(void)
{
    g_main_pid = getpid();
    g_rng ^= (uint64_t)getpid() * 0x2545f4914f6cdd1dull ^ (uint64_t)time(NULL);
    atexit(unlink_all);
    signal(SIGALRM, on_fatal);
    signal(SIGTERM, on_fatal);
    alarm(170); /* a hang fails the run instead of stalling it */
    struct {
        const char *name;
        void (*fn)(void);
    } tests[] = {
        {"layout", test_layout},
        {"publish", test_publish},
        {"add_remove", test_add_remove},
        {"find_near", test_find_near},
        {"coverage", test_coverage},
        {"bind_huge_size", test_bind_huge_size},
        {"million", test_million},
        {"kill_mid_publish", test_kill_mid_publish},
        {"kill_random", test_kill_random},
        {"kill_index_writer", test_kill_index_writer},
        {"pid_reuse", test_pid_reuse},
        {"corrupt", test_corrupt},
        {"second_uid", test_second_uid},
        {"concurrent_attach", test_concurrent_attach},
        {"threads_and_fork_lock", test_threads_and_fork_lock},
    };
    const char *only = getenv("VMMSHIM_TEST_ONLY");
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        if (only && *only && !strstr(tests[i].name, only)) continue;
        int f0 = check__failed;
        double t0 = now_s();
        tests[i].fn();
        printf("%-22s %s (%.2f s)\n", tests[i].name, check__failed == f0 ? "ok" : "FAILED", now_s() - t0);
        fflush(stdout);
    }
    CHECK_DONE();
}
