/* The client library's reader side (tools/include/vmmshim.h), against a registry this test
 * writes through the internal writer API: iteration, lookup by interior address, describe,
 * check/gc around a child that published and was SIGKILLed, torn records and index, and the
 * error paths (missing, corrupt, too-new segments; read-only gc; NULL arguments). */
#include "vmmshim.h"

#include "registry/registry.h"

#include "check.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MiB (1ull << 20)
#define GiB (1ull << 30)

static char reg_name[64];

static bool one_line(const char *s) { return s && *s && !strchr(s, '\n'); }

/* The fd table's size (FDSize in /proc/self/status), or -1. */
static long fd_table_size(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long n = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "FDSize: %ld", &n) == 1) break;
    fclose(f);
    return n;
}

/* ---- the child: re-executed with arguments so its cmdline has several words ---- */

static int child_main(const char *name, int ready_fd)
{
    alarm(120); /* never outlive a broken parent */
    vmm__reg w;
    char err[256];
    if (vmm__reg_open(&w, name, VMM__REG_WRITE, 0, NULL, err, sizeof err) != 0) return 3;
    if (vmm__reg_attach(&w, "") != 0) return 4;
    for (int k = 0; k < 2; k++) {
        uint32_t slot;
        vmm_reg_alloc d;
        memset(&d, 0, sizeof d);
        d.requested_size = MiB;
        d.api = VMM_API_CUDA_MALLOC;
        snprintf(d.tag, sizeof d.tag, "child-%d", k);
        if (vmm__reg_bind(&w, 0x7e0000000000ull + (uint64_t)k * 2 * MiB, 2 * MiB, &slot) != 0) return 5;
        if (vmm__reg_publish(&w, slot, &d, NULL) != 0) return 6;
    }
    if (write(ready_fd, "k", 1) != 1) return 7;
    for (;;) pause();
}

static pid_t spawn_child(const char *argv0)
{
    int p[2];
    if (pipe(p) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        char fd[16];
        snprintf(fd, sizeof fd, "%d", p[1]);
        execl("/proc/self/exe", argv0, "--child", reg_name, fd, "extra words", (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    char c = 0;
    ssize_t n = pid > 0 ? read(p[0], &c, 1) : -1;
    close(p[0]);
    if (n != 1) {
        if (pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        return -1;
    }
    return pid;
}

/* ---- collecting iteration results ---- */

typedef struct {
    int n;
    vmm_alloc_info a[16];
} allocs;

static int collect(void *ctx, const vmm_alloc_info *a)
{
    allocs *c = ctx;
    if (c->n < 16) c->a[c->n] = *a;
    c->n++;
    return 0;
}

static const vmm_alloc_info *by_tag(const allocs *c, const char *tag)
{
    for (int i = 0; i < c->n && i < 16; i++)
        if (strcmp(c->a[i].tag, tag) == 0) return &c->a[i];
    return NULL;
}

static int stop_at_first(void *ctx, const vmm_alloc_info *a)
{
    (void)a;
    ++*(int *)ctx;
    return 1;
}

typedef struct {
    int n;
    vmm_proc_info p[8];
} procs;

static int collect_proc(void *ctx, const vmm_proc_info *p)
{
    procs *c = ctx;
    if (c->n < 8) c->p[c->n] = *p;
    c->n++;
    return 0;
}

static void *thread_errors(void *arg)
{
    (void)arg;
    static char seen[600];
    snprintf(seen, sizeof seen, "%s", vmm_last_error()); /* fresh thread: nothing yet */
    vmm_find_proc(NULL, 1, NULL);                         /* a failure of this thread's own */
    return seen;
}

/* ---- segments built by hand for the error paths ---- */

static int make_segment(const char *name, const void *hdr, size_t hdr_len, off_t size)
{
    shm_unlink(name);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return -1;
    int rc = ftruncate(fd, size);
    if (rc == 0 && hdr_len) rc = pwrite(fd, hdr, hdr_len, 0) == (ssize_t)hdr_len ? 0 : -1;
    close(fd);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--child") == 0) return child_main(argv[2], atoi(argv[3]));

    snprintf(reg_name, sizeof reg_name, "/vmmshim-tc-%d", (int)getpid());
    shm_unlink(reg_name);
    uint32_t me = (uint32_t)getpid();

    /* ---- write a registry through the internal API ---- */
    vmm__reg w;
    char err[256] = "";
    int rc = vmm__reg_open(&w, reg_name, VMM__REG_CREATE, 256, NULL, err, sizeof err);
    CHECK(rc == 0, "create: %d %s", rc, err);
    if (rc) CHECK_DONE();
    CHECK_EQ(vmm__reg_attach(&w, "/tmp/vmmshim-test/broker.sock"), 0);

    struct {
        uint64_t address, mapped, requested;
        uint32_t api, kinds;
        int32_t fd;
        const char *tag;
        uint32_t slot;
        vmm_reg_alloc pub;
    } R[3] = {
        {0x7f0000000000ull, 2 * MiB, 4096, VMM_API_CUDA_MALLOC, VMM_HANDLE_BROKER, -1, "alpha", 0, {0}},
        {0x7f0000400000ull, 4 * MiB, 3 * MiB + 1, VMM_API_CU_MEM_ALLOC_ASYNC, VMM_HANDLE_BROKER | VMM_HANDLE_PIDFD,
         1050, "beta", 0, {0}},
        {0x7f0040000000ull, GiB, 768 * MiB, VMM_API_TEST, 0, -1, "gamma", 0, {0}},
    };
    for (int i = 0; i < 3; i++) {
        vmm_reg_alloc d;
        memset(&d, 0, sizeof d);
        d.requested_size = R[i].requested;
        d.api = R[i].api;
        d.handle_kinds = R[i].kinds;
        d.exported_fd = R[i].fd;
        d.device = (uint32_t)i;
        d.stream = i == 1 ? 0xabcdef : 0;
        d.n_frames = 2;
        d.frames[0] = 0x1000 + (uint64_t)i;
        d.frames[1] = 0x2000;
        snprintf(d.tag, sizeof d.tag, "%s", R[i].tag);
        CHECK_EQ(vmm__reg_bind(&w, R[i].address, R[i].mapped, &R[i].slot), 0);
        CHECK_EQ(vmm__reg_publish(&w, R[i].slot, &d, &R[i].pub), 0);
    }
    /* a bare reservation (BOUND, never published) and a retracted one: neither is listed */
    uint32_t bound_slot, retracted_slot;
    CHECK_EQ(vmm__reg_bind(&w, 0x7f0080000000ull, 2 * MiB, &bound_slot), 0);
    CHECK_EQ(vmm__reg_bind(&w, 0x7f00c0000000ull, 2 * MiB, &retracted_slot), 0);
    {
        vmm_reg_alloc d;
        memset(&d, 0, sizeof d);
        d.requested_size = 100;
        CHECK_EQ(vmm__reg_publish(&w, retracted_slot, &d, NULL), 0);
        CHECK_EQ(vmm__reg_retract(&w, retracted_slot), 0);
    }

    /* ---- the public API ---- */
    vmm_registry *reg = NULL;
    long table_before = fd_table_size();
    vmm_status st = vmm_open(reg_name, &reg);
    CHECK(st == VMM_OK && reg, "vmm_open: %d %s", st, vmm_last_error());
    if (!reg) CHECK_DONE();
    /* a companion's fd table grows at open, in a thread of the library's, so that no take waits
     * for the kernel to grow it under a reply's handles (shim/import/fdroom.c) */
    {
        long table = fd_table_size();
        for (int i = 0; i < 200 && table < table_before + 3 * 64; i++) {
            usleep(10000);
            table = fd_table_size();
        }
        CHECK(table_before > 0 && table >= table_before + 3 * 64,
              "vmm_open grows the fd table by a reply's handles and more: FDSize %ld -> %ld", table_before, table);
    }
    vmm_registry_info info;
    CHECK_EQ(vmm_registry_describe(reg, &info), VMM_OK);
    uint64_t touched_before = info.touched_bytes;

    allocs c = {0};
    CHECK_EQ(vmm_foreach_alloc(reg, collect, &c), VMM_OK);
    CHECK_EQ(c.n, 3);
    for (int i = 0; i < 3; i++) {
        const vmm_alloc_info *a = by_tag(&c, R[i].tag);
        CHECK(a != NULL, "record %s not listed", R[i].tag);
        if (!a) continue;
        CHECK(memcmp(a->alloc_id, R[i].pub.alloc_id, 16) == 0, "alloc_id of %s", R[i].tag);
        CHECK_EQ(a->slot, R[i].slot);
        CHECK_EQ(a->generation, R[i].pub.generation);
        CHECK_EQ(a->pid, me);
        CHECK_EQ(a->owner_alive, VMM_OWNER_ALIVE);
        CHECK_EQ(a->owner_start_time, w.start_time);
        CHECK_EQ(a->device, i);
        CHECK_EQ(a->address, R[i].address);
        CHECK_EQ(a->requested_size, R[i].requested);
        CHECK_EQ(a->mapped_size, R[i].mapped);
        CHECK_EQ(a->api, R[i].api);
        CHECK_EQ(a->handle_kinds, R[i].kinds);
        CHECK_EQ(a->exported_fd, R[i].kinds & VMM_HANDLE_PIDFD ? R[i].fd : -1);
        CHECK_EQ(a->n_frames, 2);
        CHECK_EQ(a->frames[0], 0x1000 + i);
        CHECK(a->created_ns > 0, "created_ns");
    }
    const vmm_alloc_info *beta = by_tag(&c, "beta");
    CHECK(beta && beta->stream == 0xabcdef && beta->api == VMM_FROM_CU_MEM_ALLOC_ASYNC &&
              beta->handle_kinds == (VMM_KIND_BROKER | VMM_KIND_PIDFD),
          "beta's public fields");

    int calls = 0;
    CHECK_EQ(vmm_foreach_alloc(reg, stop_at_first, &calls), VMM_OK);
    CHECK_EQ(calls, 1);

    /* find: interior addresses, the edges, and what is not a live allocation */
    vmm_alloc_info f;
    CHECK_EQ(vmm_find(reg, me, R[1].address + 12345, &f), VMM_OK);
    CHECK(strcmp(f.tag, "beta") == 0 && f.slot == R[1].slot && f.owner_alive == VMM_OWNER_ALIVE, "find beta: %s",
          f.tag);
    CHECK_EQ(vmm_find(reg, me, R[2].address + GiB - 1, &f), VMM_OK);
    CHECK(strcmp(f.tag, "gamma") == 0, "find gamma's last byte: %s", f.tag);
    CHECK_EQ(vmm_find(reg, me, R[0].address, &f), VMM_OK);
    CHECK(strcmp(f.tag, "alpha") == 0, "find alpha's base: %s", f.tag);
    st = vmm_find(reg, me, R[1].address + 4 * MiB, &f);
    CHECK_EQ(st, VMM_ERR_NOT_FOUND);
    CHECK(one_line(vmm_last_error()) && strstr(vmm_last_error(), "no live allocation"), "msg: %s", vmm_last_error());
    CHECK_EQ(vmm_find(reg, me, 0x7f0080000000ull + 10, &f), VMM_ERR_NOT_FOUND);   /* bound only */
    CHECK_EQ(vmm_find(reg, me, 0x7f00c0000000ull, &f), VMM_ERR_NOT_FOUND);        /* retracted */
    CHECK_EQ(vmm_find(reg, me + 1, R[1].address, &f), VMM_ERR_NOT_FOUND);         /* other pid */

    /* processes */
    vmm_proc_info p;
    CHECK_EQ(vmm_find_proc(reg, me, &p), VMM_OK);
    CHECK_EQ(p.pid, me);
    CHECK_EQ(p.alive, VMM_OWNER_ALIVE);
    CHECK_EQ(p.start_time, w.start_time);
    CHECK_EQ(p.uid, getuid());
    CHECK(strcmp(p.broker_path, "/tmp/vmmshim-test/broker.sock") == 0, "broker_path %s", p.broker_path);
    CHECK(strstr(p.cmdline, "test_client") != NULL, "cmdline %s", p.cmdline);
    CHECK_EQ(p.n_allocs, 3);
    CHECK_EQ(p.bytes_requested, 4096 + 3 * MiB + 1 + 768 * MiB);
    CHECK_EQ(p.bytes_mapped, 2 * MiB + 4 * MiB + GiB);
    CHECK_EQ(vmm_find_proc(reg, 0x7ffffff0u, &p), VMM_ERR_NOT_FOUND);
    CHECK(strstr(vmm_last_error(), "no process") != NULL, "msg: %s", vmm_last_error());

    procs pr = {0};
    CHECK_EQ(vmm_foreach_proc(reg, collect_proc, &pr), VMM_OK);
    CHECK_EQ(pr.n, 1);
    CHECK(pr.n >= 1 && pr.p[0].pid == me && pr.p[0].n_allocs == 3, "foreach_proc sees this process");

    /* describe */
    CHECK_EQ(vmm_registry_describe(reg, &info), VMM_OK);
    CHECK(strcmp(info.name, reg_name) == 0, "name %s", info.name);
    CHECK_EQ(info.version, VMM_REG_VERSION);
    CHECK_EQ(info.compat_version, VMM_REG_COMPAT_VERSION);
    CHECK_EQ(info.capacity, 256);
    CHECK_EQ(info.chunk_records, 64);
    CHECK_EQ(info.used_chunks, 1);
    CHECK_EQ(info.publishes, 4);
    CHECK_EQ(info.retracts, 1);
    CHECK_EQ(info.reclaimed, 0);
    CHECK(info.total_bytes > 0 && info.touched_bytes > 0 && info.touched_bytes <= info.total_bytes,
          "bytes %llu of %llu", (unsigned long long)info.touched_bytes, (unsigned long long)info.total_bytes);
    CHECK(info.created_ns > 0, "created_ns");
    /* a clean check; and no read so far touched a page of the sparse tables */
    vmm_gc_report rep;
    CHECK_EQ(vmm_check(reg, &rep), VMM_OK);
    CHECK(rep.procs_alive == 1 && rep.procs_dead == 0 && rep.procs_unknown == 0 && rep.records_reclaimed == 0 &&
              rep.chunks_reclaimed == 0 && rep.index_rebuilt == 0,
          "clean check: %u %u %u %u", rep.procs_alive, rep.procs_dead, rep.records_reclaimed, rep.index_rebuilt);
    CHECK_EQ(vmm_registry_describe(reg, &info), VMM_OK);
    CHECK_EQ(info.touched_bytes, touched_before);

    /* ---- a child publishes two records and is SIGKILLed ---- */
    pid_t child = spawn_child(argv[0]);
    CHECK(child > 0, "child did not start");
    if (child > 0) {
        c.n = 0;
        vmm_foreach_alloc(reg, collect, &c);
        CHECK_EQ(c.n, 5);
        const vmm_alloc_info *ca = by_tag(&c, "child-1");
        CHECK(ca && ca->pid == (uint32_t)child && ca->owner_alive == VMM_OWNER_ALIVE, "child's record, alive");
        CHECK_EQ(vmm_find_proc(reg, (uint32_t)child, &p), VMM_OK);
        CHECK(strstr(p.cmdline, "--child") && strstr(p.cmdline, "extra words") && strstr(p.cmdline, reg_name),
              "cmdline joined by spaces: '%s'", p.cmdline);
        CHECK(strstr(p.cmdline, " --child ") != NULL, "separators are spaces: '%s'", p.cmdline);
        CHECK_EQ(vmm_check(reg, &rep), VMM_OK);
        CHECK(rep.procs_alive == 2 && rep.procs_dead == 0, "check with a live child: %u %u", rep.procs_alive,
              rep.procs_dead);

        kill(child, SIGKILL);
        waitpid(child, NULL, 0);

        c.n = 0;
        vmm_foreach_alloc(reg, collect, &c);
        CHECK_EQ(c.n, 5);
        ca = by_tag(&c, "child-0");
        CHECK(ca && ca->owner_alive == VMM_OWNER_DEAD, "child's record, dead");
        CHECK(by_tag(&c, "alpha") && by_tag(&c, "alpha")->owner_alive == VMM_OWNER_ALIVE, "ours still alive");
        CHECK_EQ(vmm_find(reg, (uint32_t)child, 0x7e0000000000ull + 2 * MiB + 5, &f), VMM_OK);
        CHECK(strcmp(f.tag, "child-1") == 0 && f.owner_alive == VMM_OWNER_DEAD, "find a dead owner's record");
        CHECK_EQ(vmm_find_proc(reg, (uint32_t)child, &p), VMM_OK);
        CHECK(p.alive == VMM_OWNER_DEAD && p.n_allocs == 2, "dead proc: alive %d n %llu", p.alive,
              (unsigned long long)p.n_allocs);

        CHECK_EQ(vmm_check(reg, &rep), VMM_OK);
        CHECK(rep.procs_alive == 1 && rep.procs_dead == 1 && rep.records_reclaimed == 2 && rep.chunks_reclaimed == 1,
              "check with a dead child: alive %u dead %u records %u chunks %u", rep.procs_alive, rep.procs_dead,
              rep.records_reclaimed, rep.chunks_reclaimed);

        /* gc needs a writable handle */
        memset(&rep, 0xff, sizeof rep);
        CHECK_EQ(vmm_gc(reg, &rep), VMM_ERR_INVALID);
        CHECK(one_line(vmm_last_error()) && strstr(vmm_last_error(), "read-only"), "msg: %s", vmm_last_error());
        CHECK_EQ(rep.records_reclaimed, 0);
        vmm_registry *wreg = NULL;
        st = vmm_open_writable(reg_name, &wreg);
        CHECK(st == VMM_OK, "open_writable: %s", vmm_last_error());
        if (wreg) {
            CHECK_EQ(vmm_gc(wreg, &rep), VMM_OK);
            CHECK(rep.records_reclaimed == 2 && rep.procs_dead == 1 && rep.procs_alive == 1 && rep.chunks_reclaimed == 1,
                  "gc: records %u dead %u alive %u", rep.records_reclaimed, rep.procs_dead, rep.procs_alive);
            CHECK_EQ(vmm_gc(wreg, &rep), VMM_OK);
            CHECK_EQ(rep.records_reclaimed, 0);
            vmm_close(wreg);
        }
        CHECK_EQ(vmm_check(reg, &rep), VMM_OK);
        CHECK(rep.procs_dead == 0 && rep.records_reclaimed == 0 && rep.procs_alive == 1, "clean after gc");
        c.n = 0;
        vmm_foreach_alloc(reg, collect, &c);
        CHECK_EQ(c.n, 3);
        CHECK_EQ(vmm_find_proc(reg, (uint32_t)child, &p), VMM_ERR_NOT_FOUND);
        CHECK_EQ(vmm_registry_describe(reg, &info), VMM_OK);
        CHECK_EQ(info.reclaimed, 2);
    }

    /* ---- a record left mid-write: skipped by foreach, counted by check ---- */
    {
        vmm_reg_alloc *recs = (vmm_reg_alloc *)(w.base + w.hdr->rec_off);
        uint32_t *seq = &recs[R[0].slot].seq;
        __atomic_fetch_add(seq, 1, __ATOMIC_RELEASE);
        c.n = 0;
        vmm_foreach_alloc(reg, collect, &c);
        CHECK_EQ(c.n, 2);
        CHECK(by_tag(&c, "alpha") == NULL, "a torn record is not listed");
        st = vmm_check(reg, &rep);
        CHECK_EQ(st, VMM_ERR_BUSY);
        CHECK(strstr(vmm_last_error(), "1 record ") != NULL, "msg: %s", vmm_last_error());
        CHECK_EQ(rep.procs_alive, 1);
        __atomic_fetch_add(seq, 1, __ATOMIC_RELEASE);
        CHECK_EQ(vmm_check(reg, &rep), VMM_OK);

        /* the index left odd by a writer that died mid-change */
        __atomic_fetch_add(&w.hdr->index_seq, 1, __ATOMIC_RELEASE);
        CHECK_EQ(vmm_check(reg, &rep), VMM_OK);
        CHECK_EQ(rep.index_rebuilt, 1);
        /* a find still succeeds through it: what it finds is checked against the record */
        CHECK_EQ(vmm_find(reg, me, R[0].address, &f), VMM_OK);
        CHECK_EQ(vmm_find(reg, 1, R[0].address, &f), VMM_ERR_BUSY); /* "not found" needs a quiet index */
        __atomic_fetch_add(&w.hdr->index_seq, 1, __ATOMIC_RELEASE);
        CHECK_EQ(vmm_check(reg, &rep), VMM_OK);
        CHECK_EQ(rep.index_rebuilt, 0);
        CHECK_EQ(vmm_find(reg, me, R[0].address, &f), VMM_OK);
    }

    /* ---- NULL arguments ---- */
    CHECK_EQ(vmm_open(reg_name, NULL), VMM_ERR_INVALID);
    CHECK(one_line(vmm_last_error()), "msg: %s", vmm_last_error());
    CHECK_EQ(vmm_open_writable(reg_name, NULL), VMM_ERR_INVALID);
    CHECK_EQ(vmm_registry_describe(NULL, &info), VMM_ERR_INVALID);
    CHECK_EQ(vmm_registry_describe(reg, NULL), VMM_ERR_INVALID);
    CHECK_EQ(vmm_foreach_alloc(NULL, collect, &c), VMM_ERR_INVALID);
    CHECK_EQ(vmm_foreach_alloc(reg, NULL, &c), VMM_ERR_INVALID);
    CHECK_EQ(vmm_foreach_proc(NULL, collect_proc, &pr), VMM_ERR_INVALID);
    CHECK_EQ(vmm_foreach_proc(reg, NULL, &pr), VMM_ERR_INVALID);
    CHECK_EQ(vmm_find(NULL, me, R[0].address, &f), VMM_ERR_INVALID);
    CHECK_EQ(vmm_find(reg, me, R[0].address, NULL), VMM_ERR_INVALID);
    CHECK_EQ(vmm_find(reg, 0, R[0].address, &f), VMM_ERR_INVALID);
    CHECK_EQ(vmm_find_proc(NULL, me, &p), VMM_ERR_INVALID);
    CHECK_EQ(vmm_find_proc(reg, me, NULL), VMM_ERR_INVALID);
    CHECK_EQ(vmm_check(NULL, &rep), VMM_ERR_INVALID);
    CHECK_EQ(vmm_check(reg, NULL), VMM_ERR_INVALID);
    CHECK_EQ(vmm_gc(NULL, &rep), VMM_ERR_INVALID);
    CHECK(strstr(vmm_last_error(), "vmm_gc") != NULL, "msg names the call: %s", vmm_last_error());
    vmm_close(NULL);

    /* the last error is per thread */
    char before[600];
    snprintf(before, sizeof before, "%s", vmm_last_error());
    pthread_t th;
    void *seen = NULL;
    CHECK_EQ(pthread_create(&th, NULL, thread_errors, NULL), 0);
    pthread_join(th, &seen);
    CHECK(seen && ((char *)seen)[0] == 0, "a new thread starts with no error: '%s'", seen ? (char *)seen : "?");
    CHECK(strcmp(before, vmm_last_error()) == 0, "another thread's failure left ours alone");

    /* ---- error paths of open ---- */
    char name[96];
    vmm_registry *bad = NULL;
    snprintf(name, sizeof name, "%s-missing", reg_name);
    st = vmm_open(name, &bad);
    CHECK_EQ(st, VMM_ERR_NOT_FOUND);
    CHECK(bad == NULL, "no handle on failure");
    CHECK(one_line(vmm_last_error()) && strstr(vmm_last_error(), "does not exist") && strstr(vmm_last_error(), name),
          "msg: %s", vmm_last_error());
    CHECK_EQ(vmm_open_writable(name, &bad), VMM_ERR_NOT_FOUND);

    char longname[300];
    memset(longname, 'x', sizeof longname - 1);
    longname[0] = '/';
    longname[sizeof longname - 1] = 0;
    CHECK_EQ(vmm_open(longname, &bad), VMM_ERR_INVALID);

    char corrupt[96], newer[96], empty[96];
    snprintf(corrupt, sizeof corrupt, "%s-corrupt", reg_name);
    snprintf(newer, sizeof newer, "%s-newer", reg_name);
    snprintf(empty, sizeof empty, "%s-empty", reg_name);

    vmm_reg_header h;
    memset(&h, 0, sizeof h);
    h.magic = 0x0123456789abcdefull;
    h.ready = 1;
    CHECK_EQ(make_segment(corrupt, &h, sizeof h, 1 << 20), 0);
    CHECK_EQ(vmm_open(corrupt, &bad), VMM_ERR_CORRUPT);
    CHECK(one_line(vmm_last_error()) && strstr(vmm_last_error(), "magic") && strstr(vmm_last_error(), corrupt),
          "msg: %s", vmm_last_error());

    CHECK_EQ(make_segment(empty, NULL, 0, 0), 0);
    CHECK_EQ(vmm_open(empty, &bad), VMM_ERR_CORRUPT);

    /* a valid registry whose layout claims to need a newer reader */
    vmm__reg nw;
    rc = vmm__reg_open(&nw, newer, VMM__REG_CREATE, 64, NULL, err, sizeof err);
    CHECK(rc == 0, "create newer: %s", err);
    if (rc == 0) {
        __atomic_store_n(&nw.hdr->version, VMM_REG_VERSION + 1, __ATOMIC_RELAXED);
        __atomic_store_n(&nw.hdr->compat_version, VMM_REG_VERSION + 1, __ATOMIC_RELEASE);
        vmm__reg_close(&nw);
        CHECK_EQ(vmm_open(newer, &bad), VMM_ERR_VERSION);
        CHECK(one_line(vmm_last_error()) && strstr(vmm_last_error(), "version"), "msg: %s", vmm_last_error());
        CHECK_EQ(vmm_open_writable(newer, &bad), VMM_ERR_VERSION);
    }

    /* strerror: every status has its own text */
    for (int a = VMM_OK; a <= VMM_ERR_IO; a++) {
        const char *sa = vmm_strerror((vmm_status)a);
        CHECK(sa && *sa, "strerror(%d)", a);
        for (int b = VMM_OK; b < a; b++)
            CHECK(strcmp(sa, vmm_strerror((vmm_status)b)) != 0, "strerror(%d) == strerror(%d)", a, b);
    }
    CHECK(strcmp(vmm_strerror((vmm_status)99), "unknown status") == 0, "strerror(99)");

    vmm_close(reg);
    vmm__reg_close(&w);
    CHECK_EQ(shm_unlink(reg_name), 0);
    CHECK_EQ(shm_unlink(corrupt), 0);
    CHECK_EQ(shm_unlink(empty), 0);
    CHECK_EQ(shm_unlink(newer), 0);
    CHECK_DONE();
}
