/* vmm_import_many: several byte ranges of one owner in one call, over the emulated driver.
 *
 * The owner is tests/progs/spans under the shim, driven line by line (as in test_import_multi.c).
 * Small cudaMalloc buffers share one pooled chunk (read from their records, never assumed); this
 * process imports ranges of them with one vmm_import_many, reads every byte through the returned
 * pointers (the emulated driver's device pointers are host addresses) and counts its own driver
 * calls: however many ranges lie in one chunk, it is imported once and mapped once.  A range over
 * two side-by-side buffers of the chunk shares it too; ranges of a MULTI-HANDLE allocation share
 * its handles.  A bad entry (a gap, a freed buffer, a size past the address space) fails the
 * whole call with out[] all NULL, the error naming the entry, and nothing left mapped.
 *
 * Then the batch: 150 buffers of their own chunks in one call are one broker request (protocol
 * v3) whose 150 fds come in 3 messages, one reservation and one cuMemSetAccess; counted by the
 * client (vmm_import_many_last_timing) and, independently, by this test's own send() and
 * connect(), which the client library (linked statically here) calls instead of libc's.  The
 * same hooks free a buffer in the owner, or kill the owner, or turn the request into one the
 * broker cannot read (as a broker older than v3 answers), at the moment the request goes:
 * a clean error naming the range, nothing left (handles, imports, mappings, reservations, fds),
 * or the same imports made one allocation at a time.  With VMMSHIM_IMPORT_THREADS=4 the same
 * bytes; ranges across two chunks share the handles of the whole-buffer ranges beside them; memory
 * on two devices gets one cuMemSetAccess per set of devices granted. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "importcheck.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define SEG (20 * MIB)
#define KIB (1ull << 10)


/* ---- hooks: the client library's send() and connect() come here (it is linked statically) ---- */

#include "broker/protocol.h"
#include <sys/socket.h>
#include <sys/un.h>

static unsigned long g_sent_v3, g_sent_other, g_connects;
static unsigned long g_sent_repeats_flag; /* v3 requests asking for VMM_BROKER_REQ3_REPEATS */
static unsigned long g_recv_fds, g_recv_repeats; /* of v3 replies: fds passed, entries named again without one */
/* HOOK_NO_REPEATS: a broker that predates VMM_BROKER_REQ3_REPEATS, as far as the request goes: the
 * flag becomes one no broker knows, which the real one refuses whole, as an older one refuses it */
static enum { HOOK_NONE, HOOK_FREE, HOOK_KILL, HOOK_OLD_BROKER, HOOK_NO_REPEATS } g_hook;
static int g_hook_index; /* the buffer HOOK_FREE frees */


ssize_t send(int fd, const void *buf, size_t len, int flags)
{
    static ssize_t (*real)(int, const void *, size_t, int);
    if (!real) {
        void *f = dlsym(RTLD_NEXT, "send");
        memcpy(&real, &f, sizeof f);
    }
    uint32_t head[2] = {0, 0};
    if (len >= sizeof head) memcpy(head, buf, sizeof head);
    if (head[0] == VMM_BROKER_MAGIC && head[1] == VMM_BROKER_VERSION3) {
        g_sent_v3++;
        vmm_broker_request3 h;
        memset(&h, 0, sizeof h);
        memcpy(&h, buf, len < sizeof h ? len : sizeof h);
        if (h.flags & VMM_BROKER_REQ3_REPEATS) g_sent_repeats_flag++;
        if (g_hook == HOOK_NO_REPEATS && (h.flags & VMM_BROKER_REQ3_REPEATS)) {
            static uint8_t copy[sizeof(vmm_broker_request3) + VMM_BROKER_MAX_ENTRIES * sizeof(vmm_broker_entry3)];
            if (len <= sizeof copy) {
                memcpy(copy, buf, len);
                h.flags = 1u << 30;
                memcpy(copy, &h, sizeof h);
                return real(fd, copy, len, flags);
            }
        }
        if (g_hook == HOOK_FREE) {
            g_hook = HOOK_NONE;
            (void)owner_cmd(NULL, "f %d", g_hook_index);
        } else if (g_hook == HOOK_KILL) {
            g_hook = HOOK_NONE;
            kill(g_pid, SIGKILL);
            waitpid(g_pid, NULL, 0);
        } else if (g_hook == HOOK_OLD_BROKER) { /* a version it does not know: what an old broker gets */
            static uint8_t copy[sizeof(vmm_broker_request3) + VMM_BROKER_MAX_ENTRIES * sizeof(vmm_broker_entry3)];
            if (len <= sizeof copy) {
                memcpy(copy, buf, len);
                copy[4] = 7;
                return real(fd, copy, len, flags);
            }
        }
    } else if (head[0] == VMM_BROKER_MAGIC) {
        g_sent_other++;
    }
    return real(fd, buf, len, flags);
}

/* The v3 replies the client library reads: the fds passed, and the entries named again without one. */
ssize_t recvmsg(int fd, struct msghdr *mh, int flags)
{
    static ssize_t (*real)(int, struct msghdr *, int);
    if (!real) {
        void *f = dlsym(RTLD_NEXT, "recvmsg");
        memcpy(&real, &f, sizeof f);
    }
    ssize_t n = real(fd, mh, flags);
    vmm_broker_reply3 m;
    if (n == (ssize_t)sizeof m && mh->msg_iovlen >= 1 && mh->msg_iov[0].iov_len >= sizeof m) {
        memcpy(&m, mh->msg_iov[0].iov_base, sizeof m);
        if (m.magic == VMM_BROKER_MAGIC && m.version == VMM_BROKER_VERSION3 && m.n_here <= VMM_BROKER_MAX_FDS) {
            for (uint32_t i = 0; i < m.n_here; i++) g_recv_repeats += (m.fds[i].device & VMM_BROKER_FD3_REPEAT) != 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c))
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
                    g_recv_fds += (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        }
    }
    return n;
}

/* glibc declares the address as a transparent union under _GNU_SOURCE */
int connect(int fd, __CONST_SOCKADDR_ARG sa, socklen_t len)
{
    static int (*real)(int, __CONST_SOCKADDR_ARG, socklen_t);
    if (!real) {
        void *f = dlsym(RTLD_NEXT, "connect");
        memcpy(&real, &f, sizeof f);
    }
    const struct sockaddr *p = sa.__sockaddr__;
    if (p && p->sa_family == AF_UNIX) g_connects++;
    return real(fd, sa, len);
}

typedef struct import_job {
    vmm_registry *reg;
    vmm_alloc_info a;
    vmm_imported *imp;
    vmm_status st;
} import_job;

static void *import_thread(void *arg)
{
    import_job *j = arg;
    j->st = vmm_import(j->reg, &j->a, &j->imp);
    return NULL;
}

#define NSMALL 3

int main(void)
{
    spans_setup("many");
    setenv("FAKECUDA_DEVICES", "2", 1); /* the owner's memory may lie on either (case 9) */
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *fn = drv ? dlsym(drv, "fakecuda_counters") : NULL;
    memcpy(&g_counters, &fn, sizeof fn);
    CHECK(g_counters != NULL, "the emulated driver is not on LD_LIBRARY_PATH");
    CHECK(spans_start(), "cannot start the owner");

    /* three small buffers (one pooled chunk), one of 4 MiB (a chunk of its own) */
    uint64_t small[NSMALL] = {0}, big = 0;
    int sidx[NSMALL];
    for (int i = 0; i < NSMALL; i++) sidx[i] = owner_alloc_filled(256 * KIB, 100 + (uint64_t)i, &small[i]);
    int bidx = owner_alloc_filled(4 * MIB, 200, &big);
    CHECK(sidx[0] >= 0 && sidx[1] >= 0 && sidx[2] >= 0 && bidx >= 0, "the owner could not allocate");
    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg || bidx < 0) CHECK_DONE();
    uint32_t pid = (uint32_t)g_pid;
    vmm_alloc_info s[NSMALL], a_big;
    for (int i = 0; i < NSMALL; i++) CHECK(vmm_find(reg, pid, small[i], &s[i]) == VMM_OK, "find: %s", vmm_last_error());
    CHECK(vmm_find(reg, pid, big, &a_big) == VMM_OK, "find big: %s", vmm_last_error());
    CHECK(s[0].chunk_id && s[0].chunk_id == s[1].chunk_id && s[1].chunk_id == s[2].chunk_id &&
              a_big.chunk_id != s[0].chunk_id,
          "layout: chunks %llu %llu %llu, big %llu: the small buffers do not share one chunk",
          (unsigned long long)s[0].chunk_id, (unsigned long long)s[1].chunk_id, (unsigned long long)s[2].chunk_id,
          (unsigned long long)a_big.chunk_id);
    bool adjacent = s[1].address == s[0].address + s[0].extent;
    printf("stat: small buffers at chunk offsets %llu %llu %llu (extent %llu), %s\n",
           (unsigned long long)s[0].chunk_offset, (unsigned long long)s[1].chunk_offset,
           (unsigned long long)s[2].chunk_offset, (unsigned long long)s[0].extent,
           adjacent ? "side by side" : "not side by side");

    /* 1. N ranges in one chunk: one import, one mapping */
    {
        struct fakecuda_counters c0 = counters();
        uint64_t addr[5] = {small[0], small[1] + 64 * KIB, small[2], small[2] + 8 * KIB, small[1] + 8};
        uint64_t size[5] = {0, 32 * KIB, 256 * KIB, 0, 16};
        vmm_imported *out[5];
        vmm_status st = vmm_import_many(reg, pid, addr, size, 5, out);
        CHECK(st == VMM_OK, "one chunk: %s", vmm_last_error());
        if (st == VMM_OK) {
            struct fakecuda_counters c1 = counters();
            CHECK(c1.imports - c0.imports == 1 && c1.mappings_live - c0.mappings_live == 1 &&
                      c1.reservations_live - c0.reservations_live == 1,
                  "one chunk: %llu imports, %llu mappings, %llu reservations for 5 ranges",
                  c1.imports - c0.imports, c1.mappings_live - c0.mappings_live,
                  c1.reservations_live - c0.reservations_live);
            /* size 0 is the whole allocation, also from an interior address (range 3) */
            uint64_t want_size[5] = {s[0].requested_size, 32 * KIB, 256 * KIB, s[2].requested_size, 16};
            uint64_t seed[5] = {100, 101, 102, 102, 101}, k0[5] = {0, 64 * KIB / 8, 0, 0, 1};
            for (int i = 0; i < 5; i++) {
                CHECK(vmm_import_size(out[i]) == want_size[i], "one chunk: range %d: size %llu, want %llu", i,
                      (unsigned long long)vmm_import_size(out[i]), (unsigned long long)want_size[i]);
                long long bad = first_wrong(vmm_import_ptr(out[i]), want_size[i], seed[i], k0[i]);
                CHECK(bad < 0, "one chunk: range %d: word %lld reads wrong", i, bad);
                CHECK(vmm_import_check(reg, out[i]) == VMM_OK, "one chunk: check %d: %s", i, vmm_last_error());
            }
            CHECK(vmm_import_ptr(out[1]) - vmm_import_ptr(out[0]) == small[1] + 64 * KIB - small[0] &&
                      vmm_import_ptr(out[3]) == vmm_import_ptr(out[2]),
                  "one chunk: ranges are not at their places in one mapping");
            uint8_t host[16];
            CHECK(vmm_import_read(out[4], 0, host, 16) == VMM_OK && memcmp(host, (void *)(uintptr_t)vmm_import_ptr(out[4]), 16) == 0,
                  "one chunk: vmm_import_read: %s", vmm_last_error());
            CHECK(vmm_import_read(out[4], 8, host, 16) == VMM_ERR_INVALID, "one chunk: read past a 16-byte range");
            /* a second call finds the chunk mapped: nothing imported or mapped */
            vmm_imported *again[2];
            uint64_t a2[2] = {small[0], small[2]};
            st = vmm_import_many(reg, pid, a2, NULL, 2, again);
            struct fakecuda_counters c2 = counters();
            CHECK(st == VMM_OK && c2.imports == c1.imports && c2.mappings_live == c1.mappings_live &&
                      vmm_import_ptr(again[0]) == vmm_import_ptr(out[0]),
                  "again: %d, %llu more imports: %s", (int)st, c2.imports - c1.imports, vmm_last_error());
            if (st == VMM_OK) release_all(again, 2);
            release_all(out, 5);
        }
        same_as_before(c0, "one chunk");
    }

    /* 2. two chunks, and a range over two side-by-side buffers of the pooled one */
    {
        struct fakecuda_counters c0 = counters();
        uint64_t addr[4] = {big + MIB, small[1], small[0], big};
        uint64_t size[4] = {MIB, 0, adjacent ? s[0].extent + s[1].requested_size : 8, 0};
        vmm_imported *out[4];
        vmm_status st = vmm_import_many(reg, pid, addr, size, 4, out);
        CHECK(st == VMM_OK, "two chunks: %s", vmm_last_error());
        if (st == VMM_OK) {
            struct fakecuda_counters c1 = counters();
            CHECK(c1.imports - c0.imports == 2 && c1.mappings_live - c0.mappings_live == 2,
                  "two chunks: %llu imports, %llu mappings for 4 ranges", c1.imports - c0.imports,
                  c1.mappings_live - c0.mappings_live);
            CHECK(first_wrong(vmm_import_ptr(out[0]), MIB, 200, MIB / 8) < 0, "two chunks: big's 2nd MiB reads wrong");
            CHECK(first_wrong(vmm_import_ptr(out[3]), 4 * MIB, 200, 0) < 0 && vmm_import_size(out[3]) == 4 * MIB,
                  "two chunks: big reads wrong");
            CHECK(first_wrong(vmm_import_ptr(out[1]), 256 * KIB, 101, 0) < 0, "two chunks: small 1 reads wrong");
            if (adjacent) {
                CHECK(first_wrong(vmm_import_ptr(out[2]), 256 * KIB, 100, 0) < 0 &&
                          first_wrong(vmm_import_ptr(out[2]) + s[0].extent, 256 * KIB, 101, 0) < 0,
                      "across two buffers: reads wrong");
                CHECK(vmm_import_ptr(out[2]) + (small[1] - small[0]) == vmm_import_ptr(out[1]),
                      "across two buffers: not in the chunk's one mapping");
            }
            release_all(out, 4);
        }
        same_as_before(c0, "two chunks");
    }

    /* 3. all or nothing: a gap, an overflowing size; nothing stays imported or mapped */
    {
        struct fakecuda_counters c0 = counters();
        uint64_t addr[3] = {small[0], big, 0x1000};
        uint64_t size[3] = {0, 0, 64};
        vmm_imported *out[3] = {(vmm_imported *)1, (vmm_imported *)1, (vmm_imported *)1};
        vmm_status st = vmm_import_many(reg, pid, addr, size, 3, out);
        CHECK(st == VMM_ERR_NOT_FOUND && all_null(out, 3) && strstr(vmm_last_error(), "range 2 of 3") &&
                  strstr(vmm_last_error(), "0x1000"),
              "a gap: %d: %s", (int)st, vmm_last_error());
        same_as_before(c0, "a gap");
        addr[2] = big + 8;
        size[2] = UINT64_MAX;
        st = vmm_import_many(reg, pid, addr, size, 3, out);
        CHECK(st == VMM_ERR_INVALID && all_null(out, 3) && strstr(vmm_last_error(), "range 2 of 3"),
              "overflow: %d: %s", (int)st, vmm_last_error());
        size[2] = 8 * MIB; /* past the end of big, into nothing */
        st = vmm_import_many(reg, pid, addr, size, 3, out);
        CHECK(st != VMM_OK && all_null(out, 3) && strstr(vmm_last_error(), "range 2 of 3"),
              "past the end: %d: %s", (int)st, vmm_last_error());
        same_as_before(c0, "past the end");
        CHECK(vmm_import_many(reg, pid, addr, size, 0, out) == VMM_OK, "n 0: %s", vmm_last_error());
        CHECK(vmm_import_many(reg, 0, addr, size, 1, out) == VMM_ERR_INVALID && all_null(out, 1), "pid 0");
        CHECK(vmm_import_many(reg, pid, NULL, size, 1, out) == VMM_ERR_INVALID && all_null(out, 1), "addresses NULL");
    }

    /* 4. stale: a buffer freed since its record was read; a held import keeps its memory */
    {
        struct fakecuda_counters c0 = counters();
        vmm_imported *held[1];
        uint64_t a1[1] = {small[2]};
        CHECK(vmm_import_many(reg, pid, a1, NULL, 1, held) == VMM_OK, "held: %s", vmm_last_error());
        CHECK(owner_cmd(NULL, "f %d", sidx[2]), "the owner did not free small 2");
        uint64_t addr[2] = {small[0], small[2]};
        vmm_imported *out[2];
        vmm_status st = vmm_import_many(reg, pid, addr, NULL, 2, out);
        CHECK((st == VMM_ERR_NOT_FOUND || st == VMM_ERR_STALE) && all_null(out, 2) &&
                  strstr(vmm_last_error(), "range 1 of 2"),
              "freed: %d: %s", (int)st, vmm_last_error());
        CHECK(vmm_import_check(reg, held[0]) == VMM_ERR_STALE, "held after the free: %s", vmm_last_error());
        CHECK(first_wrong(vmm_import_ptr(held[0]), 256 * KIB, 102, 0) < 0, "held: memory gone after the free");
        CHECK(vmm_import_release(held[0]) == VMM_OK, "held release: %s", vmm_last_error());
        same_as_before(c0, "freed");
    }

    /* 5. ranges of a MULTI-HANDLE allocation share its handles */
    {
        uint64_t unused, span = 0;
        int first = -1;
        for (int i = 0; i < 3; i++) {
            char a[256];
            int k = -1;
            unsigned long long p = 0;
            if (owner_cmd(a, "a %llu", (unsigned long long)SEG) && sscanf(a, "ok %d 0x%llx", &k, &p) == 2 && i == 0)
                first = k;
            unused = p;
        }
        (void)unused;
        for (int i = 0; i < 3 && first >= 0; i++) CHECK(owner_cmd(NULL, "f %d", first + i), "free segment %d", i);
        int mi = first >= 0 ? owner_alloc_filled(3 * SEG, 300, &span) : -1;
        vmm_alloc_info m;
        if (mi >= 0 && vmm_find(reg, pid, span, &m) == VMM_OK && (m.flags & VMM_ALLOC_MULTI_HANDLE)) {
            struct fakecuda_counters c0 = counters();
            uint64_t addr[3] = {span + MIB, span + SEG + 4 * MIB, span};
            uint64_t size[3] = {MIB, SEG, 0};
            vmm_imported *out[3];
            vmm_status st = vmm_import_many(reg, pid, addr, size, 3, out);
            CHECK(st == VMM_OK, "multi: %s", vmm_last_error());
            if (st == VMM_OK) {
                struct fakecuda_counters c1 = counters();
                CHECK(c1.imports - c0.imports == m.n_handles && c1.mappings_live - c0.mappings_live == m.n_handles,
                      "multi: %llu imports, %llu mappings for %u handles", c1.imports - c0.imports,
                      c1.mappings_live - c0.mappings_live, m.n_handles);
                CHECK(first_wrong(vmm_import_ptr(out[0]), MIB, 300, MIB / 8) < 0 &&
                          first_wrong(vmm_import_ptr(out[1]), SEG, 300, (SEG + 4 * MIB) / 8) < 0 &&
                          first_wrong(vmm_import_ptr(out[2]), 3 * SEG, 300, 0) < 0,
                      "multi: reads wrong");
                release_all(out, 3);
            }
            same_as_before(c0, "multi");
        } else {
            CHECK(0, "the owner could not make a multi-handle allocation");
        }
    }

    /* 5b. two MULTI-HANDLE allocations that reach into one segment (as a stream-ordered pool lays
     * tensors out): the owner's stream brings that segment twice, and it is imported once */
    {
        CHECK(owner_cmd(NULL, "k"), "the owner's default pool keeps what is freed");
        int first = -1;
        for (int i = 0; i < 4; i++) { /* four segments of the stream-ordered pool, left empty */
            uint64_t at;
            int k = owner_alloc_with('A', SEG, &at);
            if (i == 0) first = k;
        }
        for (int i = 0; i < 4 && first >= 0; i++) CHECK(owner_cmd(NULL, "f %d", first + i), "free segment %d", i);
        uint64_t x = 0, y = 0;
        int xi = first >= 0 ? owner_alloc_with('A', SEG + SEG / 2, &x) : -1;
        int yi = xi >= 0 ? owner_alloc_with('A', SEG + SEG / 2, &y) : -1;
        if (xi < 0 || yi < 0 || !owner_cmd(NULL, "w %d 310", xi) || !owner_cmd(NULL, "w %d 311", yi)) xi = yi = -1;
        vmm_alloc_info ax = {0}, ay = {0};
        bool arranged = yi >= 0 && vmm_find(reg, pid, x, &ax) == VMM_OK && vmm_find(reg, pid, y, &ay) == VMM_OK &&
                        (ax.flags & ay.flags & VMM_ALLOC_MULTI_HANDLE) &&
                        ay.address - ay.chunk_offset < ax.address - ax.chunk_offset + ax.mapped_size &&
                        ax.address - ax.chunk_offset < ay.address - ay.chunk_offset + ay.mapped_size;
        if (arranged) {
            struct fakecuda_counters c0 = counters();
            uint64_t addr[2] = {x, y};
            vmm_imported *out[2];
            vmm_import_many_timing t;
            unsigned long fds0 = g_recv_fds, rep0 = g_recv_repeats, flag0 = g_sent_repeats_flag;
            vmm_status st = vmm_import_many(reg, pid, addr, NULL, 2, out);
            CHECK(st == VMM_OK, "a shared segment: %s", vmm_last_error());
            if (st == VMM_OK) {
                struct fakecuda_counters c1 = counters();
                uint32_t handles = ax.n_handles + ay.n_handles;
                /* the owner's broker passed the shared segment's fd once, and named it again */
                CHECK(g_sent_repeats_flag - flag0 == 1 && g_recv_fds - fds0 == handles - 1 && g_recv_repeats - rep0 == 1,
                      "a shared segment: %lu requests with REPEATS, %lu fds and %lu repeats came (want 1, %u, 1)",
                      g_sent_repeats_flag - flag0, g_recv_fds - fds0, g_recv_repeats - rep0, handles - 1);
                CHECK(vmm_import_many_last_timing(&t) == VMM_OK && t.handles == handles && t.shared == 1 &&
                          c1.imports - c0.imports == handles - 1 && c1.mappings_live - c0.mappings_live == handles - 1 &&
                          t.maps == handles - 1,
                      "a shared segment: %u handles, %u shared, %llu imports, %llu mappings (want %u, 1, %u, %u)",
                      t.handles, t.shared, c1.imports - c0.imports, c1.mappings_live - c0.mappings_live, handles,
                      handles - 1, handles - 1);
                /* one mapping of the segment serves both: they lie as far apart as in the owner */
                CHECK(vmm_import_ptr(out[1]) - vmm_import_ptr(out[0]) == y - x, "a shared segment: 0x%llx apart, not 0x%llx",
                      (unsigned long long)(vmm_import_ptr(out[1]) - vmm_import_ptr(out[0])), (unsigned long long)(y - x));
                CHECK(first_wrong(vmm_import_ptr(out[0]), SEG + SEG / 2, 310, 0) < 0 &&
                          first_wrong(vmm_import_ptr(out[1]), SEG + SEG / 2, 311, 0) < 0,
                      "a shared segment: reads wrong");
                /* the first one gone, its own segment is unmapped and the shared one stays for the other */
                CHECK(vmm_import_release(out[0]) == VMM_OK && vmm_import_drop_idle() == VMM_OK, "release x: %s",
                      vmm_last_error());
                struct fakecuda_counters c2 = counters();
                CHECK(c2.mappings_live - c0.mappings_live == ay.n_handles &&
                          first_wrong(vmm_import_ptr(out[1]), SEG + SEG / 2, 311, 0) < 0,
                      "a shared segment: %llu mappings left for y (want %u), its bytes readable",
                      c2.mappings_live - c0.mappings_live, ay.n_handles);
                release_all(out + 1, 1);
            }
            same_as_before(c0, "a shared segment");
            /* a broker that predates REPEATS refuses the flag: the same request goes again without it
             * on the same connection, every fd comes, and the library dedupes; later requests to
             * that owner no longer ask */
            unsigned long v3_0 = g_sent_v3, conn0 = g_connects;
            fds0 = g_recv_fds, rep0 = g_recv_repeats, flag0 = g_sent_repeats_flag;
            g_hook = HOOK_NO_REPEATS;
            st = vmm_import_many(reg, pid, addr, NULL, 2, out);
            g_hook = HOOK_NONE;
            CHECK(st == VMM_OK, "a broker without REPEATS: %s", vmm_last_error());
            if (st == VMM_OK) {
                uint32_t handles = ax.n_handles + ay.n_handles;
                CHECK(g_sent_v3 - v3_0 == 2 && g_sent_repeats_flag - flag0 == 1 && g_connects == conn0 &&
                          g_recv_fds - fds0 == handles && g_recv_repeats == rep0,
                      "a broker without REPEATS: %lu v3 requests (%lu flagged), %lu connects, %lu fds, %lu repeats "
                      "(want 2 (1), 0, %u, 0)",
                      g_sent_v3 - v3_0, g_sent_repeats_flag - flag0, g_connects - conn0, g_recv_fds - fds0,
                      g_recv_repeats - rep0, handles);
                CHECK(vmm_import_many_last_timing(&t) == VMM_OK && t.shared == 1 && t.maps == handles - 1 &&
                          t.requests == 2 && t.fallback == 0,
                      "a broker without REPEATS: %u shared, %u maps, %u round trips (the refused one too), fallback %u",
                      t.shared, t.maps,
                      t.requests, t.fallback);
                CHECK(first_wrong(vmm_import_ptr(out[0]), SEG + SEG / 2, 310, 0) < 0 &&
                          first_wrong(vmm_import_ptr(out[1]), SEG + SEG / 2, 311, 0) < 0,
                      "a broker without REPEATS: reads wrong");
                release_all(out, 2);
                same_as_before(c0, "a broker without REPEATS");
                flag0 = g_sent_repeats_flag;
                v3_0 = g_sent_v3;
                st = vmm_import_many(reg, pid, addr, NULL, 2, out);
                CHECK(st == VMM_OK && g_sent_v3 - v3_0 == 1 && g_sent_repeats_flag == flag0,
                      "after it: %s, %lu requests, %lu flagged (want 1, 0)", st == VMM_OK ? "ok" : vmm_last_error(),
                      g_sent_v3 - v3_0, g_sent_repeats_flag - flag0);
                if (st == VMM_OK) release_all(out, 2);
                same_as_before(c0, "after a broker without REPEATS");
            }
        } else {
            CHECK(0, "the owner did not lay two MULTI-HANDLE allocations over one segment (0x%llx: %u handles from "
                     "0x%llx, %llu bytes; 0x%llx: %u handles from 0x%llx, %llu bytes)",
                  (unsigned long long)x, ax.n_handles, (unsigned long long)(ax.address - ax.chunk_offset),
                  (unsigned long long)ax.mapped_size, (unsigned long long)y, ay.n_handles,
                  (unsigned long long)(ay.address - ay.chunk_offset), (unsigned long long)ay.mapped_size);
        }
        if (xi >= 0) CHECK(owner_cmd(NULL, "f %d", xi), "free x");
        if (yi >= 0) CHECK(owner_cmd(NULL, "f %d", yi), "free y");
    }

    /* 5c. the owner's broker exports a segment for the first time (~0.6 ms on an H100; 1 s here)
     * without the owner's allocator lock: a cudaFree meanwhile goes on at once, and when the
     * allocation is freed and its segments given back during the export, the import ends stale
     * and the owner goes on */
    {
        char ans[256] = "";
        uint64_t at = 0;
        CHECK(owner_cmd(NULL, "T"), "the owner trims its stream-ordered pool");
        int k = owner_alloc_with('A', 3 * SEG, &at); /* new segments: never exported */
        vmm_alloc_info a;
        bool ready = k >= 0 && vmm_find(reg, pid, at, &a) == VMM_OK && owner_cmd(ans, "e 1000000");
        if (ready) {
            import_job job = {.reg = reg, .a = a};
            pthread_t th;
            bool started = pthread_create(&th, NULL, import_thread, &job) == 0;
            struct timespec wait = {0, 300 * 1000000L}; /* the broker is inside the export by then */
            nanosleep(&wait, NULL);
            double t0 = mono_ms();
            bool freed = owner_cmd(NULL, "f %d", k);
            double free_ms = mono_ms() - t0;
            bool trimmed = owner_cmd(NULL, "T");
            if (started) pthread_join(th, NULL);
            CHECK(freed && free_ms < 300,
                  "a cudaFree while the broker exported took %.0f ms (the export holds no allocator lock)", free_ms);
            CHECK(started && trimmed && job.st == VMM_ERR_STALE && !job.imp,
                  "an import whose allocation was freed and given back during the export: %s (%s)",
                  vmm_strerror(job.st), vmm_last_error());
            if (job.imp) (void)vmm_import_release(job.imp);
            CHECK(owner_cmd(NULL, "e 0"), "export delay off");
            uint64_t at2 = 0;
            vmm_imported *imp = NULL;
            int k2 = owner_alloc_filled(2 * MIB, 320, &at2);
            CHECK(k2 >= 0 && vmm_find(reg, pid, at2, &a) == VMM_OK && vmm_import(reg, &a, &imp) == VMM_OK &&
                      first_wrong(vmm_import_ptr(imp), 2 * MIB, 320, 0) < 0,
                  "the owner exports and serves after it: %s", vmm_last_error());
            if (imp) CHECK(vmm_import_release(imp) == VMM_OK, "release: %s", vmm_last_error());
            if (k2 >= 0) CHECK(owner_cmd(NULL, "f %d", k2), "free");
        } else {
            CHECK(0, "the owner could not be set up for a slow export (%d, %s)", k, ans);
        }
    }

    /* 7. the batch: 150 buffers of 2 MiB, each a chunk of its own, in one call */
    enum { NB = 150 };
    static uint64_t bb[NB];
    int bidx0 = -1;
    bool made = true;
    for (int i = 0; i < NB && made; i++) {
        int k = owner_alloc_with('a', 2 * MIB, &bb[i]);
        if (i == 0) bidx0 = k;
        made = k >= 0 && (i % 10 || owner_cmd(NULL, "w %d %llu", k, 1000ull + (unsigned long long)i));
    }
    CHECK(made, "the owner could not make %d buffers", NB);
    /* A chunk 5c left idle may be one the owner's pools reuse for these buffers until the reaper
     * (100 ms ticks) sees its witness freed; a reused chunk is rightly not imported again, so the
     * count of new chunks below holds only from an empty cache. */
    CHECK(vmm_import_drop_idle() == VMM_OK, "drop_idle before the batch: %s", vmm_last_error());
    if (made) {
        uint64_t sz[NB];
        for (int i = 0; i < NB; i++) sz[i] = 0;
        static vmm_imported *out[NB];
        vmm_import_many_timing t;
        struct fakecuda_counters c0 = counters();
        unsigned long v3 = g_sent_v3, other = g_sent_other, conn = g_connects;
        vmm_status st = vmm_import_many(reg, pid, bb, sz, NB, out);
        struct fakecuda_counters c1 = counters();
        CHECK(st == VMM_OK, "150 buffers: %s", vmm_last_error());
        CHECK(vmm_import_many_last_timing(&t) == VMM_OK, "timing: %s", vmm_last_error());
        CHECK(g_sent_v3 - v3 == 1 && g_sent_other == other && g_connects - conn <= 1,
              "150 buffers: %lu v3 requests, %lu others, %lu connects (want 1, 0, at most 1)", g_sent_v3 - v3,
              g_sent_other - other, g_connects - conn);
        CHECK(t.requests == 1 && t.messages == 3 && t.handles == NB && t.chunks_new == NB && t.reserves == 1 &&
                  t.access_calls == 1 && t.maps == NB && !t.fallback,
              "150 buffers: timing says %u requests, %u messages, %u handles, %u new chunks, %u reserves, %u "
              "SetAccess, %u maps, fallback %u",
              t.requests, t.messages, t.handles, t.chunks_new, t.reserves, t.access_calls, t.maps, t.fallback);
        CHECK(c1.imports - c0.imports == NB && c1.mappings_live - c0.mappings_live == NB &&
                  c1.reservations_live - c0.reservations_live == 1 &&
                  c1.calls_cuMemSetAccess - c0.calls_cuMemSetAccess == 1,
              "150 buffers: the driver saw %llu imports, %llu mappings, %llu reservations, %llu SetAccess",
              c1.imports - c0.imports, c1.mappings_live - c0.mappings_live,
              c1.reservations_live - c0.reservations_live, c1.calls_cuMemSetAccess - c0.calls_cuMemSetAccess);
        printf("stat: 150 chunks in one vmm_import_many: %u request, %u messages, %llu us (find %llu, connect %llu, "
               "broker %llu of which export %llu, import %llu, map %llu, access %llu, release %llu)\n",
               t.requests, t.messages, (unsigned long long)t.total_ns / 1000, (unsigned long long)t.find_ns / 1000,
               (unsigned long long)t.connect_ns / 1000, (unsigned long long)t.broker_ns / 1000,
               (unsigned long long)t.export_ns / 1000, (unsigned long long)t.import_ns / 1000,
               (unsigned long long)t.map_ns / 1000, (unsigned long long)t.access_ns / 1000,
               (unsigned long long)t.release_ns / 1000);
        if (st == VMM_OK) {
            int wrong = 0;
            for (int i = 0; i < NB; i += 10) wrong += first_wrong(vmm_import_ptr(out[i]), 2 * MIB, 1000 + (uint64_t)i, 0) >= 0;
            CHECK(wrong == 0, "150 buffers: %d of 15 written ones read wrong", wrong);
            release_all(out, NB);
        }
        same_as_before(c0, "150 buffers");

        /* the same with 4 importing threads */
        setenv("VMMSHIM_IMPORT_THREADS", "4", 1);
        c0 = counters();
        st = vmm_import_many(reg, pid, bb, sz, NB, out);
        CHECK(st == VMM_OK, "4 threads: %s", vmm_last_error());
        CHECK(vmm_import_many_last_timing(&t) == VMM_OK && t.threads == 4 && t.handles == NB && t.access_calls == 1 &&
                  t.import_ns > 0 && t.map_ns > 0,
              "4 threads: %u threads, %u handles, %u SetAccess, import %llu ns, map %llu ns (the threads' times)",
              t.threads, t.handles, t.access_calls, (unsigned long long)t.import_ns, (unsigned long long)t.map_ns);
        if (st == VMM_OK) {
            int wrong = 0;
            for (int i = 0; i < NB; i += 10) wrong += first_wrong(vmm_import_ptr(out[i]), 2 * MIB, 1000 + (uint64_t)i, 0) >= 0;
            CHECK(wrong == 0, "4 threads: %d of 15 written ones read wrong", wrong);
            release_all(out, NB);
        }
        same_as_before(c0, "4 threads");
        setenv("VMMSHIM_IMPORT_THREADS", "17", 1);
        st = vmm_import_many(reg, pid, bb, sz, 2, out);
        CHECK(st == VMM_ERR_INVALID && all_null(out, 2) && strstr(vmm_last_error(), "VMMSHIM_IMPORT_THREADS"),
              "VMMSHIM_IMPORT_THREADS=17: %d: %s", (int)st, vmm_last_error());
        unsetenv("VMMSHIM_IMPORT_THREADS");

        /* ranges across two chunks beside the whole ones: the handles are fetched once */
        uint64_t xa[4] = {bb[20], bb[21], bb[20] + MIB, bb[20] + 4 * KIB};
        uint64_t xs[4] = {0, 0, 2 * MIB, 4 * MIB - 8 * KIB};
        bool side = bb[21] == bb[20] + 2 * MIB && bb[22] == bb[21] + 2 * MIB;
        if (side) {
            xa[3] = bb[20] + 4 * KIB; /* across three chunks */
            xs[3] = 6 * MIB - 8 * KIB;
            c0 = counters();
            st = vmm_import_many(reg, pid, xa, xs, 4, out);
            CHECK(st == VMM_OK, "across chunks: %s", vmm_last_error());
            c1 = counters();
            CHECK(vmm_import_many_last_timing(&t) == VMM_OK && t.handles == 3 && t.requests == 1 &&
                      t.ranges_mapped == 2 && t.reserves == 1 && t.access_calls == 1 &&
                      c1.imports - c0.imports == 3,
                  "across chunks: %u handles (3 wanted), %u requests, %u ranges across, %u reserves, %u SetAccess, "
                  "%llu imports",
                  t.handles, t.requests, t.ranges_mapped, t.reserves, t.access_calls, c1.imports - c0.imports);
            if (st == VMM_OK) {
                CHECK(first_wrong(vmm_import_ptr(out[0]), 2 * MIB, 1020, 0) < 0 &&
                          first_wrong(vmm_import_ptr(out[2]), MIB, 1020, MIB / 8) < 0,
                      "across chunks: bytes of buffer 20 read wrong");
                CHECK(vmm_import_size(out[3]) == 6 * MIB - 8 * KIB &&
                          first_wrong(vmm_import_ptr(out[3]), 2 * MIB - 4 * KIB, 1020, 4 * KIB / 8) < 0,
                      "across three chunks: reads wrong");
                /* the records each covers, as the call read them */
                vmm_alloc_info rec[4];
                size_t n0 = vmm_import_records(out[0], rec, 1);
                CHECK(n0 == 1 && rec[0].address == bb[20], "records of a whole buffer: %zu, 0x%llx", n0,
                      (unsigned long long)rec[0].address);
                size_t nr = vmm_import_records(out[3], rec, 4);
                CHECK(nr == 3 && rec[0].address == bb[20] && rec[1].address == bb[21] && rec[2].address == bb[22] &&
                          vmm_import_records(out[3], NULL, 0) == 3 && vmm_import_records(NULL, rec, 4) == 0,
                      "records across three chunks: %zu", nr);
                /* all of it in one call, as the Python package reads it */
                vmm_import_desc d[4];
                memset(d, 0xab, sizeof d);
                bool described = vmm_import_describe(out, 4, d) == VMM_OK;
                for (int i = 0; i < 4 && described; i++) {
                    vmm_alloc_info first;
                    size_t records = vmm_import_records(out[i], &first, 1);
                    described = d[i].ptr == vmm_import_ptr(out[i]) && d[i].size == vmm_import_size(out[i]) &&
                                d[i].device == vmm_import_device(out[i]) && d[i].n_records == records &&
                                memcmp(d[i].alloc_id, first.alloc_id, sizeof first.alloc_id) == 0;
                }
                CHECK(described && d[3].n_records == 3 && d[3].size == 6 * MIB - 8 * KIB,
                      "vmm_import_describe gives each import's pointer, size, device, records and first id");
                vmm_imported *with_null[2] = {out[0], NULL};
                memset(d, 0xab, sizeof d);
                CHECK(vmm_import_describe(with_null, 2, d) == VMM_ERR_INVALID && strstr(vmm_last_error(), "imps[1]") &&
                          d[0].ptr == 0xababababababababull && vmm_import_describe(NULL, 1, d) == VMM_ERR_INVALID &&
                          vmm_import_describe(out, 1, NULL) == VMM_ERR_INVALID && vmm_import_describe(NULL, 0, NULL) == VMM_OK,
                      "vmm_import_describe refuses NULLs and writes nothing: %s", vmm_last_error());
                release_all(out, 4);
            }
            same_as_before(c0, "across chunks");
        } else {
            printf("note: buffers 20..22 are not side by side: ranges across chunks not checked\n");
        }

        /* an old broker: the v3 request comes back -EPROTO, and each chunk is asked alone */
        g_hook = HOOK_OLD_BROKER;
        c0 = counters();
        other = g_sent_other;
        st = vmm_import_many(reg, pid, bb, sz, 40, out);
        g_hook = HOOK_NONE;
        CHECK(st == VMM_OK && vmm_import_many_last_timing(&t) == VMM_OK && t.fallback == 1 &&
                  g_sent_other - other == 40 && t.handles == 40,
              "an old broker: %d, fallback %u, %lu v1/v2 requests, %u handles: %s", (int)st, t.fallback,
              g_sent_other - other, t.handles, vmm_last_error());
        if (st == VMM_OK) {
            CHECK(first_wrong(vmm_import_ptr(out[30]), 2 * MIB, 1030, 0) < 0, "an old broker: buffer 30 reads wrong");
            release_all(out, 40);
        }
        same_as_before(c0, "an old broker");

        /* a buffer freed as the request goes: the broker says stale mid-stream; nothing stays */
        c0 = counters();
        g_hook = HOOK_FREE;
        g_hook_index = bidx0 + 100;
        st = vmm_import_many(reg, pid, bb, sz, NB, out);
        g_hook = HOOK_NONE;
        CHECK(st == VMM_ERR_STALE && all_null(out, NB) && strstr(vmm_last_error(), "range 100 of 150"),
              "freed as the request went: %d: %s", (int)st, vmm_last_error());
        same_as_before(c0, "freed as the request went");
        struct fakecuda_counters c2 = counters();
        CHECK(c2.fds_open == c0.fds_open, "freed as the request went: %llu fds open (%llu before)", c2.fds_open,
              c0.fds_open);
        /* and freed before: the find says so, before the owner is asked */
        v3 = g_sent_v3;
        st = vmm_import_many(reg, pid, bb, sz, NB, out);
        CHECK(st == VMM_ERR_NOT_FOUND && all_null(out, NB) && strstr(vmm_last_error(), "range 100 of 150") &&
                  g_sent_v3 == v3,
              "freed before: %d, %lu requests: %s", (int)st, g_sent_v3 - v3, vmm_last_error());
        same_as_before(c0, "freed before");
    }

    /* 9. memory on two devices: one SetAccess for each set of devices granted; each import says
     * its device, and its bytes copy out (a copy needs a context its memory is granted to) */
    {
        uint64_t d0 = 0, d1a = 0, d1b = 0;
        bool ok = owner_cmd(NULL, "d 1") && owner_alloc_filled(3 * MIB, 901, &d1a) >= 0 && owner_alloc_filled(5 * MIB, 902, &d1b) >= 0 &&
                  owner_cmd(NULL, "d 0") && owner_alloc_filled(3 * MIB, 900, &d0) >= 0;
        CHECK(ok, "the owner could not allocate on two devices");
        if (ok) {
            uint64_t a[3] = {d0, d1a, d1b};
            vmm_imported *out[3];
            vmm_import_many_timing t;
            struct fakecuda_counters c0 = counters();
            vmm_status st = vmm_import_many(reg, pid, a, NULL, 3, out);
            CHECK(st == VMM_OK, "two devices: %s", vmm_last_error());
            CHECK(vmm_import_many_last_timing(&t) == VMM_OK && t.access_calls == 2 && t.reserves == 1 && t.handles == 3,
                  "two devices: %u SetAccess (one per device set), %u reserves, %u handles", t.access_calls,
                  t.reserves, t.handles);
            if (st == VMM_OK) {
                uint64_t w[2] = {0, 0};
                CHECK(vmm_import_read(out[1], 0, w, sizeof w) == VMM_OK && w[0] == word(901, 0) && w[1] == word(901, 1),
                      "two devices: device 1's bytes: %s", vmm_last_error());
                CHECK(vmm_import_read(out[0], 8, w, 8) == VMM_OK && w[0] == word(900, 1),
                      "two devices: device 0's bytes: %s", vmm_last_error());
                CHECK(first_wrong(vmm_import_ptr(out[2]), 5 * MIB, 902, 0) < 0, "two devices: device 1's second reads wrong");
                printf("stat: two devices: imports report devices %d, %d, %d\n", vmm_import_device(out[0]),
                       vmm_import_device(out[1]), vmm_import_device(out[2]));
                release_all(out, 3);
            }
            same_as_before(c0, "two devices");
        }
    }

    /* 6. a dead owner: nothing imported */
    int wst = spans_quit();
    CHECK(wst == 0, "the owner ended with status 0x%x", wst);
    {
        uint64_t addr[2] = {small[0], big};
        vmm_imported *out[2];
        vmm_status st = vmm_import_many(reg, pid, addr, NULL, 2, out);
        CHECK(st != VMM_OK && all_null(out, 2) && strstr(vmm_last_error(), "range 0 of 2"), "dead owner: %d: %s",
              (int)st, vmm_last_error());
    }
    /* 8. an owner killed as the request goes: a clean error, nothing left */
    if (spans_start()) {
        uint64_t kb[80];
        bool ok = true;
        for (int i = 0; i < 80 && ok; i++) ok = owner_alloc_with('a', 2 * MIB, &kb[i]) >= 0;
        CHECK(ok, "the second owner could not allocate");
        vmm_imported *out[80];
        struct fakecuda_counters c0 = counters();
        g_hook = HOOK_KILL;
        vmm_status st = ok ? vmm_import_many(reg, (uint32_t)g_pid, kb, NULL, 80, out) : VMM_ERR_OWNER_DEAD;
        g_hook = HOOK_NONE;
        CHECK(st == VMM_ERR_OWNER_DEAD && all_null(out, 80), "an owner killed as the request went: %d: %s", (int)st,
              vmm_last_error());
        same_as_before(c0, "an owner killed");
        if (g_to) fclose(g_to);
        if (g_from) fclose(g_from);
        g_to = g_from = NULL;
    } else {
        CHECK(0, "cannot start the second owner");
    }
    CHECK(vmm_import_drop_idle() == VMM_OK, "drop_idle: %s", vmm_last_error());
    CHECK(counters().fds_open == 0, "%llu fds on imported memory left open", counters().fds_open);
    if (g_from) fclose(g_from);
    vmm_close(reg);
    shm_unlink(g_reg);
    CHECK_DONE();
}
