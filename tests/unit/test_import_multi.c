/* Importing allocations that span several of the owner's segments (MULTI-HANDLE records), over
 * the emulated driver.
 *
 * The owner is tests/progs/spans under the shim, driven line by line: it allocates 20 MiB
 * buffers (each exactly one segment: the large pool grows by 20 MiB at least), frees them while
 * the shim keeps their segments (VMMSHIM_GIVE_BACK_MS and VMMSHIM_CACHE_SIZE high), then
 * allocates their total, which the pool places across the freed segments.  How many handles that
 * allocation spans is read from its registry record, never assumed.  This process imports it
 * through the client library with one vmm_import and reads every byte (the emulated driver's
 * device pointers are host addresses), and counts this process's driver calls and live
 * mappings: one reservation, one mapping per handle, one cuMemSetAccess, all undone at release.
 * An allocation of more than 64 handles needs several broker replies.  The broker's wire format
 * is spoken raw too: a v1 request for a multi-handle record is refused with -EPROTONOSUPPORT, a
 * v2 one past the last handle gets -ERANGE, a stale generation -ESTALE; and vmm_import refuses a
 * stale generation and an allocation freed meanwhile.  A range over two allocations whose chunks
 * overlap in a segment maps each handle once.  `vmmctl show` prints the handle count. */
#include "../fakecuda/fakecuda.h"
#include "broker/protocol.h"
#include "check.h"
#include "importcheck.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define SEG (20 * MIB) /* VMM_POOL_MIN_GROWTH: one 20 MiB request fills one new segment */
#define MANY 66        /* segments for the allocation that needs more than one broker reply */


/* ---- the owner -------------------------------------------------------------------------- */

static int owner_alloc(uint64_t bytes, uint64_t *addr) { return owner_alloc_with('a', bytes, addr); }

/* n segments' worth made and freed, then one allocation of their total, filled with seed's
 * words: most likely it spans those segments (the caller reads how many from the record). */
static int owner_span_of(unsigned n, uint64_t seg, uint64_t seed, uint64_t *addr)
{
    int first = -1;
    for (unsigned i = 0; i < n; i++) {
        uint64_t unused;
        int k = owner_alloc(seg, &unused);
        if (k < 0) return -1;
        if (i == 0) first = k;
    }
    for (unsigned i = 0; i < n; i++)
        if (!owner_cmd(NULL, "f %d", first + (int)i)) return -1;
    int idx = owner_alloc(n * seg, addr);
    if (idx < 0 || !owner_cmd(NULL, "w %d %llu", idx, (unsigned long long)seed)) return -1;
    return idx;
}

/* ---- this process ----------------------------------------------------------------------- */

static int broker_connect(vmm_registry *reg)
{
    vmm_proc_info proc;
    if (vmm_find_proc(reg, (uint32_t)g_pid, &proc) != VMM_OK || !proc.broker_path[0]) return -1;
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    if (strlen(proc.broker_path) >= sizeof sa.sun_path) return -1;
    memcpy(sa.sun_path, proc.broker_path, strlen(proc.broker_path) + 1);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s >= 0 && connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(s);
        s = -1;
    }
    return s;
}

/* Send a request; receive the reply into rep (its length returned, -1 on failure) and count
 * (and close) the fds it carried. */
static ssize_t raw_exchange(int s, const void *req, size_t len, void *rep, size_t cap, unsigned *n_fds)
{
    *n_fds = 0;
    if (send(s, req, len, MSG_NOSIGNAL) != (ssize_t)len) return -1;
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(128 * sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = rep, .iov_len = cap};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof ctl.buf;
    ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); n >= 0 && c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
                int f;
                memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
                close(f);
                (*n_fds)++;
            }
    return n;
}

static vmm_broker_request2 request2(const vmm_alloc_info *a, uint32_t first, uint32_t max)
{
    vmm_broker_request2 q;
    memset(&q, 0, sizeof q);
    q.magic = VMM_BROKER_MAGIC;
    q.version = VMM_BROKER_VERSION2;
    q.slot = a->slot;
    q.generation = a->generation;
    memcpy(q.alloc_id, a->alloc_id, sizeof q.alloc_id);
    q.first = first;
    q.max = max;
    return q;
}

/* A v2 exchange: the reply's status (or INT32_MIN when none came), its fields in *rep. */
static int32_t ask2(int s, const vmm_broker_request2 *q, vmm_broker_reply2 *rep, unsigned *n_fds)
{
    memset(rep, 0, sizeof *rep);
    ssize_t n = raw_exchange(s, q, sizeof *q, rep, sizeof *rep, n_fds);
    if (n != (ssize_t)sizeof *rep || rep->magic != VMM_BROKER_MAGIC) return INT32_MIN;
    return rep->status;
}

/* ---- cases ------------------------------------------------------------------------------ */

/* One vmm_import maps the whole span: one reservation, a mapping per handle, one access call;
 * every byte the owner wrote reads right; a second import is served from the mapping; the last
 * release and vmm_import_drop_idle undo it all. */
static void import_whole(vmm_registry *reg, const vmm_alloc_info *a, uint64_t seed, const char *what)
{
    struct fakecuda_counters c0 = counters();
    vmm_imported *imp = NULL, *again = NULL;
    vmm_status st = vmm_import(reg, a, &imp);
    CHECK(st == VMM_OK, "%s: vmm_import: %s", what, vmm_last_error());
    if (st != VMM_OK) return;
    vmm_import_timing t;
    vmm_import_last_timing(&t);
    CHECK(t.cached == 0 && t.route == VMM_KIND_BROKER, "%s: cached %u route %u", what, t.cached, t.route);
    struct fakecuda_counters c1 = counters();
    CHECK(c1.reservations_live - c0.reservations_live == 1, "%s: %llu reservations", what,
          c1.reservations_live - c0.reservations_live);
    CHECK(c1.mappings_live - c0.mappings_live == a->n_handles, "%s: %llu mappings for %u handles", what,
          c1.mappings_live - c0.mappings_live, a->n_handles);
    CHECK(c1.calls_cuMemSetAccess - c0.calls_cuMemSetAccess == 1, "%s: %llu cuMemSetAccess calls", what,
          c1.calls_cuMemSetAccess - c0.calls_cuMemSetAccess);
    long long bad = first_wrong(vmm_import_ptr(imp), a->requested_size, seed, 0);
    CHECK(bad < 0, "%s: word %lld of %llu reads wrong", what, bad, (unsigned long long)(a->requested_size / 8));
    CHECK(vmm_import_size(imp) == a->requested_size, "%s: size %llu", what, (unsigned long long)vmm_import_size(imp));

    st = vmm_import(reg, a, &again);
    vmm_import_last_timing(&t);
    CHECK(st == VMM_OK && t.cached == 1 && vmm_import_ptr(again) == vmm_import_ptr(imp),
          "%s: second import: %d cached %u: %s", what, (int)st, t.cached, vmm_last_error());
    CHECK(counters().mappings_live == c1.mappings_live, "%s: the second import mapped again", what);
    CHECK(vmm_import_release(again) == VMM_OK && vmm_import_release(imp) == VMM_OK, "%s: release: %s", what,
          vmm_last_error());
    CHECK(vmm_import_drop_idle() == VMM_OK, "%s: drop_idle: %s", what, vmm_last_error());
    struct fakecuda_counters c2 = counters();
    CHECK(c2.mappings_live == c0.mappings_live && c2.reservations_live == c0.reservations_live &&
              c2.handles_live == c0.handles_live && c2.imports_live == c0.imports_live,
          "%s: after release: mappings %llu reservations %llu handles %llu imports %llu (before: %llu %llu %llu %llu)",
          what, c2.mappings_live, c2.reservations_live, c2.handles_live, c2.imports_live, c0.mappings_live,
          c0.reservations_live, c0.handles_live, c0.imports_live);
}

static void range_whole(vmm_registry *reg, const vmm_alloc_info *a, uint64_t seed)
{
    struct fakecuda_counters c0 = counters();
    vmm_imported *imp = NULL;
    vmm_status st = vmm_import_range(reg, a->pid, a->address, a->requested_size, &imp);
    CHECK(st == VMM_OK, "vmm_import_range: %s", vmm_last_error());
    if (st != VMM_OK) return;
    CHECK(counters().mappings_live - c0.mappings_live == a->n_handles, "range: %llu mappings for %u handles",
          counters().mappings_live - c0.mappings_live, a->n_handles);
    long long bad = first_wrong(vmm_import_ptr(imp), a->requested_size, seed, 0);
    CHECK(bad < 0, "range: word %lld reads wrong", bad);
    CHECK(vmm_import_release(imp) == VMM_OK, "range release: %s", vmm_last_error());
    struct fakecuda_counters c1 = counters();
    CHECK(c1.mappings_live == c0.mappings_live && c1.reservations_live == c0.reservations_live &&
              c1.handles_live == c0.handles_live,
          "range: after release: mappings %llu reservations %llu handles %llu", c1.mappings_live,
          c1.reservations_live, c1.handles_live);
}

/* Two allocations across three segments, X over the first and half the second, Y over the rest:
 * their chunks (named by their first handles) overlap in the middle segment.  One range import
 * over both maps each of the three handles once, and reads both right.  Stream-ordered: the
 * cudaMalloc pool never splits an empty segment so (it would pin the rest), the default pool does. */
static void overlapping_range(vmm_registry *reg)
{
    int first = -1;
    uint64_t unused, x = 0, y = 0;
    for (int i = 0; i < 3; i++) {
        int k = owner_alloc_with('A', SEG, &unused);
        if (i == 0) first = k;
        CHECK(k >= 0, "overlap: segment %d", i);
    }
    for (int i = 0; i < 3; i++) CHECK(owner_cmd(NULL, "f %d", first + i), "overlap: free %d", i);
    int xi = owner_alloc_with('A', SEG * 3 / 2, &x), yi = owner_alloc_with('A', SEG * 3 / 2, &y);
    CHECK(xi >= 0 && yi >= 0 && owner_cmd(NULL, "w %d 21", xi) && owner_cmd(NULL, "w %d 22", yi),
          "overlap: the owner could not make X and Y");
    vmm_alloc_info ax, ay;
    if (xi < 0 || yi < 0 || vmm_find(reg, (uint32_t)g_pid, x, &ax) != VMM_OK ||
        vmm_find(reg, (uint32_t)g_pid, y, &ay) != VMM_OK)
        return;
    CHECK(y == x + ax.extent && ax.n_handles >= 2 && ay.n_handles >= 2 && ay.chunk_offset > 0 &&
              ax.chunk_id != ay.chunk_id,
          "overlap: X at 0x%llx (%u handles), Y at 0x%llx (%u handles, offset %llu): not the layout this case needs",
          (unsigned long long)x, ax.n_handles, (unsigned long long)y, ay.n_handles,
          (unsigned long long)ay.chunk_offset);
    struct fakecuda_counters c0 = counters();
    vmm_imported *imp = NULL;
    vmm_status st = vmm_import_range(reg, (uint32_t)g_pid, x, ax.requested_size + ay.requested_size, &imp);
    CHECK(st == VMM_OK, "overlap: vmm_import_range: %s", vmm_last_error());
    if (st != VMM_OK) return;
    CHECK(counters().mappings_live - c0.mappings_live == 3, "overlap: %llu mappings for 3 segments",
          counters().mappings_live - c0.mappings_live);
    long long bx = first_wrong(vmm_import_ptr(imp), ax.requested_size, 21, 0);
    long long by = first_wrong(vmm_import_ptr(imp) + (y - x), ay.requested_size, 22, 0);
    CHECK(bx < 0 && by < 0, "overlap: X's word %lld, Y's word %lld read wrong", bx, by);
    CHECK(vmm_import_release(imp) == VMM_OK, "overlap: release: %s", vmm_last_error());
    CHECK(counters().mappings_live == c0.mappings_live, "overlap: mappings left after release");
}

/* The wire format, spoken raw. */
static void raw_protocol(vmm_registry *reg, const vmm_alloc_info *a)
{
    int s = broker_connect(reg);
    CHECK(s >= 0, "cannot connect to the owner's broker");
    if (s < 0) return;
    vmm_broker_request q1;
    memset(&q1, 0, sizeof q1);
    q1.magic = VMM_BROKER_MAGIC;
    q1.version = VMM_BROKER_VERSION;
    q1.slot = a->slot;
    q1.generation = a->generation;
    memcpy(q1.alloc_id, a->alloc_id, sizeof q1.alloc_id);
    vmm_broker_reply r1;
    unsigned fds = 0;
    ssize_t n = raw_exchange(s, &q1, sizeof q1, &r1, sizeof r1, &fds);
    CHECK(n == (ssize_t)sizeof r1 && r1.status == -EPROTONOSUPPORT && fds == 0,
          "v1 request for a multi-handle record: %zd bytes, status %d, %u fds", n, n > 0 ? r1.status : 0, fds);

    vmm_broker_reply2 r;
    vmm_broker_request2 q = request2(a, 0, VMM_BROKER_MAX_FDS);
    int32_t st = ask2(s, &q, &r, &fds); /* the connection is still open: a refusal is not its end */
    uint64_t sum = 0;
    for (uint32_t i = 0; i < r.n_here && i < VMM_BROKER_MAX_FDS; i++) sum += r.sizes[i];
    CHECK(st == 0 && r.n_total == a->n_handles && r.n_here == a->n_handles && fds == a->n_handles &&
              sum == a->mapped_size,
          "v2 all: status %d n_total %u n_here %u fds %u bytes %llu (record: %u handles, %llu bytes)", st, r.n_total,
          r.n_here, fds, (unsigned long long)sum, a->n_handles, (unsigned long long)a->mapped_size);

    q = request2(a, 1, 1);
    st = ask2(s, &q, &r, &fds);
    CHECK(st == 0 && r.n_here == 1 && fds == 1 && r.sizes[0] > 0 && r.sizes[1] == 0 && r.n_total == a->n_handles,
          "v2 handle 1 alone: status %d n_here %u fds %u size %llu", st, r.n_here, fds,
          (unsigned long long)r.sizes[0]);

    q = request2(a, a->n_handles, 1);
    st = ask2(s, &q, &r, &fds);
    CHECK(st == -ERANGE && fds == 0, "v2 first past the end: status %d, %u fds", st, fds);

    q = request2(a, 0, 0);
    st = ask2(s, &q, &r, &fds);
    CHECK(st == -EINVAL && fds == 0, "v2 max 0: status %d, %u fds", st, fds);

    q = request2(a, 0, 4);
    q.generation++;
    st = ask2(s, &q, &r, &fds);
    CHECK(st == -ESTALE && fds == 0, "v2 stale generation: status %d, %u fds", st, fds);
    close(s);
}

/* More than 64 handles: a raw request gets 64 and the rest on asking again; vmm_import asks as
 * often as it takes. */
static void many_handles(vmm_registry *reg, const vmm_alloc_info *a, uint64_t seed)
{
    CHECK(a->n_handles > VMM_BROKER_MAX_FDS, "the %u-segment allocation spans %u handles", MANY, a->n_handles);
    int s = broker_connect(reg);
    CHECK(s >= 0, "cannot connect to the owner's broker");
    if (s >= 0) {
        vmm_broker_reply2 r;
        unsigned fds;
        vmm_broker_request2 q = request2(a, 0, 1000);
        int32_t st = ask2(s, &q, &r, &fds);
        CHECK(st == 0 && r.n_here == VMM_BROKER_MAX_FDS && fds == VMM_BROKER_MAX_FDS && r.n_total == a->n_handles,
              "first reply: status %d n_here %u fds %u n_total %u", st, r.n_here, fds, r.n_total);
        q = request2(a, VMM_BROKER_MAX_FDS, 1000);
        st = ask2(s, &q, &r, &fds);
        CHECK(st == 0 && r.n_here == a->n_handles - VMM_BROKER_MAX_FDS && fds == r.n_here,
              "second reply: status %d n_here %u fds %u", st, r.n_here, fds);
        close(s);
    }
    import_whole(reg, a, seed, "more than 64 handles");
}

/* A record read before its allocation was freed, or with another generation, is refused. */
static void stale_cases(vmm_registry *reg, const vmm_alloc_info *a, int idx)
{
    vmm_alloc_info wrong = *a;
    wrong.generation++;
    vmm_imported *imp = NULL;
    vmm_status st = vmm_import(reg, &wrong, &imp);
    CHECK(st == VMM_ERR_STALE && !imp, "stale generation: %d: %s", (int)st, vmm_last_error());

    /* held across the free: the mapping keeps the memory; vmm_import_check tells */
    vmm_imported *held = NULL;
    st = vmm_import(reg, a, &held);
    CHECK(st == VMM_OK, "import before the free: %s", vmm_last_error());
    CHECK(owner_cmd(NULL, "f %d", idx), "the owner did not free buffer %d", idx);
    st = vmm_import(reg, a, &imp);
    CHECK(st == VMM_ERR_STALE && !imp, "freed meanwhile (mapping held here): %d: %s", (int)st, vmm_last_error());
    if (held) {
        CHECK(vmm_import_check(reg, held) == VMM_ERR_STALE, "vmm_import_check after the free: %s", vmm_last_error());
        CHECK(vmm_import_release(held) == VMM_OK, "release: %s", vmm_last_error());
    }
    CHECK(vmm_import_drop_idle() == VMM_OK, "drop_idle: %s", vmm_last_error());
    st = vmm_import(reg, a, &imp); /* nothing mapped here now: the broker answers */
    CHECK(st == VMM_ERR_STALE && !imp, "freed meanwhile: %d: %s", (int)st, vmm_last_error());
}

int main(void)
{
    spans_setup("multi");
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *fn = drv ? dlsym(drv, "fakecuda_counters") : NULL;
    memcpy(&g_counters, &fn, sizeof fn);
    CHECK(g_counters != NULL, "the emulated driver is not on LD_LIBRARY_PATH");

    CHECK(spans_start(), "cannot start the owner");
    vmm_registry *reg = NULL;
    uint64_t addr = 0;
    int idx = owner_span_of(3, SEG, 7, &addr);
    CHECK(idx >= 0, "the owner could not make the 3-segment allocation");
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    vmm_alloc_info a;
    memset(&a, 0, sizeof a);
    if (idx >= 0 && reg) {
        vmm_status st = vmm_find(reg, (uint32_t)g_pid, addr, &a);
        CHECK(st == VMM_OK, "vmm_find: %s", vmm_last_error());
        CHECK((a.flags & VMM_ALLOC_MULTI_HANDLE) && a.n_handles >= 3,
              "the 60 MiB allocation: flags 0x%x, %u handles (the pool did not place it across the freed "
              "segments)", a.flags, a.n_handles);
        CHECK(a.mapped_size >= a.chunk_offset + a.requested_size && a.handle_kinds == VMM_KIND_BROKER,
              "record: mapped %llu offset %llu requested %llu kinds %u", (unsigned long long)a.mapped_size,
              (unsigned long long)a.chunk_offset, (unsigned long long)a.requested_size, a.handle_kinds);
        printf("stat: a %llu MiB allocation over %u handles (%llu MiB mapped, at offset %llu)\n",
               (unsigned long long)(a.requested_size / MIB), a.n_handles, (unsigned long long)(a.mapped_size / MIB),
               (unsigned long long)a.chunk_offset);
        if (st == VMM_OK && a.n_handles >= 2) {
            import_whole(reg, &a, 7, "3 segments");
            range_whole(reg, &a, 7);
            int fd = -1;
            st = vmm_import_fd(reg, &a, &fd);
            CHECK(st == VMM_ERR_INVALID && fd < 0 && strstr(vmm_last_error(), "handles"),
                  "vmm_import_fd of a multi-handle record: %d: %s", (int)st, vmm_last_error());
            char vmmctl[600], pid[16], at[32], out[4096], err[1024], want[64];
            snprintf(vmmctl, sizeof vmmctl, "%s/vmmctl", g_build);
            snprintf(pid, sizeof pid, "%d", (int)g_pid);
            snprintf(at, sizeof at, "0x%llx", (unsigned long long)addr);
            snprintf(want, sizeof want, "\nhandles      %u, back to back", a.n_handles);
            char *argv[] = {vmmctl, "show", pid, at, NULL};
            int rc = spawn_capture(argv, NULL, out, sizeof out, err, sizeof err, 30);
            CHECK(rc == 0 && strstr(out, want), "vmmctl show: rc %d:\n%s%s", rc, out, err);
            raw_protocol(reg, &a);
            stale_cases(reg, &a, idx);
        }

        overlapping_range(reg);

        uint64_t big = 0;
        int bi = owner_span_of(MANY, 2 * MIB, 11, &big);
        CHECK(bi >= 0, "the owner could not make the %u-segment allocation", MANY);
        vmm_alloc_info m;
        if (bi >= 0 && vmm_find(reg, (uint32_t)g_pid, big, &m) == VMM_OK) many_handles(reg, &m, 11);

        /* a one-handle record still goes over v1, as before */
        uint64_t one = 0;
        int oi = owner_alloc(4 * MIB, &one);
        vmm_alloc_info s1;
        if (oi >= 0 && owner_cmd(NULL, "w %d 5", oi) && vmm_find(reg, (uint32_t)g_pid, one, &s1) == VMM_OK) {
            CHECK(!(s1.flags & VMM_ALLOC_MULTI_HANDLE) && s1.n_handles == 1, "4 MiB: flags 0x%x, %u handles",
                  s1.flags, s1.n_handles);
            vmm_imported *imp = NULL;
            st = vmm_import(reg, &s1, &imp);
            CHECK(st == VMM_OK && first_wrong(vmm_import_ptr(imp), s1.requested_size, 5, 0) < 0,
                  "one-handle import: %s", vmm_last_error());
            vmm_import_release(imp);
        } else {
            CHECK(0, "the owner could not make a 4 MiB allocation");
        }
    }
    CHECK(vmm_import_drop_idle() == VMM_OK, "drop_idle: %s", vmm_last_error());
    CHECK(counters().fds_open == 0, "%llu fds on imported memory left open", counters().fds_open);
    int wst = spans_quit();
    CHECK(wst == 0, "the owner ended with status 0x%x", wst);
    if (reg) vmm_close(reg);
    shm_unlink(g_reg);
    CHECK_DONE();
}
