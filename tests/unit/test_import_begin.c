/* vmm_import_many_begin / vmm_import_many_end over the emulated driver: vmm_import_many in two
 * halves, the grant (cuMemSetAccess) running on the library's thread in between.
 *
 * The owner is tests/progs/spans under the shim (spansowner.h).  With each cuMemSetAccess made
 * to take a second (FAKECUDA_ACCESS_DELAY_US, through fakecuda_set_access_delay_us), begin must
 * come back with the pointers before the grant is done: the memory there is mapped and not yet
 * accessible (cuMemGetAccess); end then gives imports at exactly those pointers, readable, with
 * the call's timing on the ending thread, also when that is another thread.  The ranges cover
 * the three kinds of place: a chunk new to the call, a chunk mapped here before (a cached one),
 * and a range across two chunks.  A grant that fails undoes everything (out all NULL, nothing
 * mapped, reserved or held); a bad argument or a range in no allocation fails begin with no job;
 * n 0 is a job that ends at once; end with out NULL undoes the job; a chunk another thread maps
 * while the grant is under way serves the end's import, whose pointer then differs from begin's
 * (what vmmshim.h tells a binding to compare).  Records handed in as hints (vmm_import_tensors_begin's)
 * serve when right, are passed over when of another allocation, and fail the call when stale. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "import/import.h"
#include "importcheck.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define MIB (1ull << 20)
#define KIB (1ull << 10)
#define DELAY_US 1000000ull

static fakecuda_set_access_delay_us_fn g_access_delay;
static fakecuda_fail_next_fn g_fail_next;
static CUresult (*g_get_access)(unsigned long long *, const CUmemLocation *, CUdeviceptr);

/* What device 0 may do at p: CU_MEM_ACCESS_FLAGS_*, or -1 when the driver says p is no mapping. */
static long long access_at(uint64_t p)
{
    CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0};
    unsigned long long f = 0;
    return g_get_access(&f, &loc, (CUdeviceptr)p) == CUDA_SUCCESS ? (long long)f : -1;
}

/* Range i of the calls below reads its owner's words at p (the range across two buffers: the end
 * of one, then the start of the other). */
static bool reads_right(int i, uint64_t p, bool side)
{
    static const uint64_t seed[5] = {100, 101, 200, 300, 203}, k0[5] = {0, 8 * KIB, 0, 512, 0};
    static const uint64_t bytes[5] = {256 * KIB, 32 * KIB, 2 * MIB, 2 * MIB - 4 * KIB, 2 * MIB};
    if (i == 4 && side) return first_wrong(p, MIB, 201, MIB / 8) < 0 && first_wrong(p + MIB, MIB, 202, 0) < 0;
    return first_wrong(p, bytes[i], seed[i], k0[i]) < 0;
}

typedef struct ender {
    vmm_import_job *job;
    vmm_imported **out;
    vmm_status st;
    vmm_import_many_timing t;
} ender;

static void *end_elsewhere(void *arg)
{
    ender *e = arg;
    e->st = vmm_import_many_end(e->job, e->out);
    memset(&e->t, 0, sizeof e->t);
    (void)vmm_import_many_last_timing(&e->t);
    return NULL;
}

#define N 5

int main(void)
{
    spans_setup("begin");
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *f1 = drv ? dlsym(drv, "fakecuda_counters") : NULL, *f2 = drv ? dlsym(drv, "fakecuda_set_access_delay_us") : NULL,
         *f3 = drv ? dlsym(drv, "fakecuda_fail_next") : NULL, *f4 = drv ? dlsym(drv, "cuMemGetAccess") : NULL;
    memcpy(&g_counters, &f1, sizeof f1);
    memcpy(&g_access_delay, &f2, sizeof f2);
    memcpy(&g_fail_next, &f3, sizeof f3);
    memcpy(&g_get_access, &f4, sizeof f4);
    CHECK(g_counters && g_access_delay && g_fail_next && g_get_access, "the emulated driver is not on LD_LIBRARY_PATH");
    if (!g_counters || !g_access_delay || !g_fail_next || !g_get_access) CHECK_DONE();
    CHECK(spans_start(), "cannot start the owner");

    /* two small buffers (one pooled chunk), four of 2 MiB (a chunk each, side by side as a rule),
     * one more of 2 MiB that this process maps before the calls (a cached chunk) */
    uint64_t small[2] = {0}, big[4] = {0}, pre = 0;
    bool made = true;
    for (int i = 0; i < 2; i++) made &= owner_alloc_filled(256 * KIB, 100 + (uint64_t)i, &small[i]) >= 0;
    for (int i = 0; i < 4; i++) made &= owner_alloc_filled(2 * MIB, 200 + (uint64_t)i, &big[i]) >= 0;
    made &= owner_alloc_filled(2 * MIB, 300, &pre) >= 0;
    CHECK(made, "the owner could not allocate");
    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!made || !reg) CHECK_DONE();
    uint32_t pid = (uint32_t)g_pid;
    bool side = big[1] + 2 * MIB == big[2];
    if (!side) printf("note: buffers 1 and 2 of 2 MiB are not side by side: the range across chunks is left out\n");
    struct fakecuda_counters c_base = counters();

    vmm_alloc_info a_pre;
    vmm_imported *held = NULL;
    CHECK(vmm_find(reg, pid, pre, &a_pre) == VMM_OK && vmm_import(reg, &a_pre, &held) == VMM_OK,
          "the chunk mapped before: %s", vmm_last_error());
    /* ranges: a small buffer whole, a piece of the other, a 2 MiB buffer whole, the cached chunk's
     * buffer from 4 KiB on, and 1 MiB across big[1] and big[2] (or big[3] whole) */
    uint64_t addr[N] = {small[0], small[1] + 64 * KIB, big[0], pre + 4 * KIB, side ? big[1] + MIB : big[3]};
    uint64_t size[N] = {0, 32 * KIB, 0, 2 * MIB - 4 * KIB, side ? 2 * MIB : 0};
    uint64_t want_size[N] = {256 * KIB, 32 * KIB, 2 * MIB, 2 * MIB - 4 * KIB, 2 * MIB};

    /* 1. begin comes back before the grant; end gives the imports at begin's pointers */
    {
        struct fakecuda_counters c0 = counters();
        g_access_delay(DELAY_US);
        vmm_import_desc desc[N];
        vmm_import_job *job = NULL;
        double t0 = mono_ms();
        vmm_status st = vmm_import_many_begin(reg, pid, addr, size, N, desc, &job);
        double t_begin = mono_ms() - t0;
        CHECK(st == VMM_OK && job, "begin: %s", vmm_last_error());
        if (st == VMM_OK && job) {
            /* the grant has a second to go: nothing new is accessible yet (the cached chunk is) */
            CHECK(t_begin < DELAY_US / 1000.0, "begin took %.0f ms: it waited for the grant", t_begin);
            CHECK(access_at(desc[0].ptr) == CU_MEM_ACCESS_FLAGS_PROT_NONE &&
                      access_at(desc[2].ptr) == CU_MEM_ACCESS_FLAGS_PROT_NONE &&
                      access_at(desc[3].ptr) == CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                  "begin: access at the new chunks %lld %lld (want none yet), at the cached one %lld",
                  access_at(desc[0].ptr), access_at(desc[2].ptr), access_at(desc[3].ptr));
            CHECK(desc[3].ptr == vmm_import_ptr(held) + 4 * KIB, "begin: the cached chunk's range at 0x%llx, not 0x%llx",
                  (unsigned long long)desc[3].ptr, (unsigned long long)(vmm_import_ptr(held) + 4 * KIB));
            CHECK(desc[1].ptr - desc[0].ptr == addr[1] - addr[0], "begin: two ranges of one chunk 0x%llx apart, not 0x%llx",
                  (unsigned long long)(desc[1].ptr - desc[0].ptr), (unsigned long long)(addr[1] - addr[0]));
            for (int i = 0; i < N; i++)
                CHECK(desc[i].size == want_size[i] && desc[i].device == 0 && desc[i].n_records == (side && i == 4 ? 2u : 1u),
                      "begin: range %d: size %llu, device %d, %u records", i, (unsigned long long)desc[i].size,
                      desc[i].device, desc[i].n_records);
            vmm_alloc_info a0;
            CHECK(vmm_find(reg, pid, small[0], &a0) == VMM_OK && memcmp(desc[0].alloc_id, a0.alloc_id, 16) == 0,
                  "begin: the first record's id");
            vmm_imported *out[N];
            st = vmm_import_many_end(job, out);
            double t_all = mono_ms() - t0;
            CHECK(st == VMM_OK, "end: %s", vmm_last_error());
            CHECK(t_all >= DELAY_US / 1000.0, "end came back after %.0f ms, before the grant", t_all);
            if (st == VMM_OK) {
                for (int i = 0; i < N; i++) {
                    CHECK(vmm_import_ptr(out[i]) == desc[i].ptr && vmm_import_size(out[i]) == want_size[i],
                          "end: range %d at 0x%llx (%llu bytes), begin said 0x%llx", i,
                          (unsigned long long)vmm_import_ptr(out[i]), (unsigned long long)vmm_import_size(out[i]),
                          (unsigned long long)desc[i].ptr);
                    CHECK(reads_right(i, desc[i].ptr, side), "end: range %d reads wrong", i);
                }
                vmm_import_many_timing t;
                CHECK(vmm_import_many_last_timing(&t) == VMM_OK && t.ranges == N && t.access_calls == 1 &&
                          t.access_ns >= DELAY_US * 1000 && t.chunks_cached == 1 && t.reserves == 1 &&
                          t.total_ns >= DELAY_US * 1000,
                      "end: timing says %u ranges, %u SetAccess of %llu ns, %u cached, %u reserves, total %llu ns",
                      t.ranges, t.access_calls, (unsigned long long)t.access_ns, t.chunks_cached, t.reserves,
                      (unsigned long long)t.total_ns);
                release_all(out, N);
            }
        }
        g_access_delay(0);
        same_as_before(c0, "begin and end");
    }

    /* 2. the end on another thread: its timing is that thread's */
    {
        struct fakecuda_counters c0 = counters();
        vmm_import_desc desc[N];
        vmm_import_job *job = NULL;
        vmm_imported *out[N];
        vmm_status st = vmm_import_many_begin(reg, pid, addr, size, N, desc, &job);
        CHECK(st == VMM_OK, "begin (ended elsewhere): %s", vmm_last_error());
        ender e = {.job = job, .out = out, .st = VMM_ERR_INVALID};
        pthread_t th;
        if (st == VMM_OK && pthread_create(&th, NULL, end_elsewhere, &e) == 0) {
            pthread_join(th, NULL);
            CHECK(e.st == VMM_OK && e.t.ranges == N && e.t.access_calls == 1 && e.t.find_ns > 0,
                  "ended elsewhere: %d, that thread's timing: %u ranges, %u SetAccess, find %llu ns", (int)e.st,
                  e.t.ranges, e.t.access_calls, (unsigned long long)e.t.find_ns);
            if (e.st == VMM_OK) {
                for (int i = 0; i < N; i++)
                    CHECK(vmm_import_ptr(out[i]) == desc[i].ptr && reads_right(i, desc[i].ptr, side),
                          "ended elsewhere: range %d", i);
                release_all(out, N);
            }
        } else if (st == VMM_OK) {
            CHECK(0, "no thread to end on");
            (void)vmm_import_many_end(job, out);
            release_all(out, N);
        }
        same_as_before(c0, "ended elsewhere");
    }

    /* 3. a grant that fails undoes the whole call at the end */
    {
        struct fakecuda_counters c0 = counters();
        vmm_import_desc desc[N];
        vmm_import_job *job = NULL;
        vmm_imported *out[N];
        for (int i = 0; i < N; i++) out[i] = (vmm_imported *)1; /* must come back NULL */
        CHECK(g_fail_next("cuMemSetAccess", 1, CUDA_ERROR_OUT_OF_MEMORY) == 0, "cannot arm the failure");
        vmm_status st = vmm_import_many_begin(reg, pid, addr, size, N, desc, &job);
        CHECK(st == VMM_OK && job, "begin (failing grant): %s", vmm_last_error());
        if (st == VMM_OK) {
            st = vmm_import_many_end(job, out);
            CHECK(st == VMM_ERR_CUDA && all_null(out, N) && strstr(vmm_last_error(), "cuMemSetAccess") &&
                      strstr(vmm_last_error(), "nothing imported"),
                  "a failing grant: %d: %s", (int)st, vmm_last_error());
        }
        g_fail_next("cuMemSetAccess", 0, 0);
        same_as_before(c0, "a failing grant");
        /* the cached chunk kept its one holder: the held import still reads */
        CHECK(first_wrong(vmm_import_ptr(held), 2 * MIB, 300, 0) < 0, "a failing grant: the cached chunk reads wrong");
    }

    /* 4. bad arguments and a range in no allocation: no job */
    {
        struct fakecuda_counters c0 = counters();
        vmm_import_desc desc[N];
        vmm_import_job *job = (vmm_import_job *)1;
        CHECK(vmm_import_many_begin(reg, pid, addr, size, N, desc, NULL) == VMM_ERR_INVALID &&
                  strstr(vmm_last_error(), "vmm_import_many_begin: job is NULL"),
              "job NULL: %s", vmm_last_error());
        CHECK(vmm_import_many_begin(reg, pid, addr, size, N, NULL, &job) == VMM_ERR_INVALID && job == NULL &&
                  strstr(vmm_last_error(), "desc is NULL"),
              "desc NULL: %s", vmm_last_error());
        job = (vmm_import_job *)1;
        CHECK(vmm_import_many_begin(reg, 0, addr, size, N, desc, &job) == VMM_ERR_INVALID && job == NULL &&
                  strstr(vmm_last_error(), "vmm_import_many_begin: pid is 0"),
              "pid 0: %s", vmm_last_error());
        uint64_t bad_addr[2] = {big[0], 0x10}, bad_size[2] = {0, 16};
        job = (vmm_import_job *)1;
        vmm_status st = vmm_import_many_begin(reg, pid, bad_addr, bad_size, 2, desc, &job);
        CHECK(st == VMM_ERR_NOT_FOUND && job == NULL && strstr(vmm_last_error(), "range 1 of 2"),
              "a range in no allocation: %d: %s", (int)st, vmm_last_error());
        CHECK(vmm_import_many_end(NULL, NULL) == VMM_ERR_INVALID && strstr(vmm_last_error(), "vmm_import_many_end"),
              "end of no job: %s", vmm_last_error());
        same_as_before(c0, "refused");
    }

    /* 5. n 0: a job that ends at once; out NULL at the end undoes the job */
    {
        struct fakecuda_counters c0 = counters();
        vmm_import_job *job = NULL;
        CHECK(vmm_import_many_begin(reg, pid, NULL, NULL, 0, NULL, &job) == VMM_OK && job &&
                  vmm_import_many_end(job, NULL) == VMM_OK,
              "n 0: %s", vmm_last_error());
        vmm_import_desc desc[N];
        vmm_status st = vmm_import_many_begin(reg, pid, addr, size, N, desc, &job);
        CHECK(st == VMM_OK && vmm_import_many_end(job, NULL) == VMM_ERR_INVALID &&
                  strstr(vmm_last_error(), "out is NULL"),
              "end with out NULL: %s", vmm_last_error());
        same_as_before(c0, "end with out NULL");
    }

    /* 6. a chunk that another import maps while the grant is under way serves the end */
    {
        struct fakecuda_counters c0 = counters();
        g_access_delay(DELAY_US / 2);
        vmm_import_desc desc[N];
        vmm_import_job *job = NULL;
        vmm_imported *out[N], *other = NULL;
        vmm_status st = vmm_import_many_begin(reg, pid, addr, size, N, desc, &job);
        CHECK(st == VMM_OK, "begin (raced): %s", vmm_last_error());
        vmm_alloc_info a_big;
        CHECK(vmm_find(reg, pid, big[0], &a_big) == VMM_OK && vmm_import(reg, &a_big, &other) == VMM_OK,
              "the other import: %s", vmm_last_error());
        if (st == VMM_OK) {
            st = vmm_import_many_end(job, out);
            CHECK(st == VMM_OK, "end (raced): %s", vmm_last_error());
            if (st == VMM_OK) {
                CHECK(other && vmm_import_ptr(out[2]) == vmm_import_ptr(other) && vmm_import_ptr(out[2]) != desc[2].ptr,
                      "raced: the end's import at 0x%llx, the other's 0x%llx, begin's 0x%llx",
                      (unsigned long long)vmm_import_ptr(out[2]), (unsigned long long)(other ? vmm_import_ptr(other) : 0),
                      (unsigned long long)desc[2].ptr);
                CHECK(first_wrong(vmm_import_ptr(out[2]), 2 * MIB, 200, 0) < 0 &&
                          vmm_import_ptr(out[0]) == desc[0].ptr && first_wrong(desc[0].ptr, 256 * KIB, 100, 0) < 0,
                      "raced: reads wrong");
                release_all(out, N);
            }
        }
        if (other) CHECK(vmm_import_release(other) == VMM_OK, "release the other: %s", vmm_last_error());
        g_access_delay(0);
        same_as_before(c0, "raced");
    }

    /* 7. hints (vmm_import_tensors_begin's records, read by the name table's slots): right ones
     * serve with the same bytes; one of another allocation is passed over; a stale one (its
     * generation gone) fails the call as a record freed since the find does, nothing left */
    {
        struct fakecuda_counters c0 = counters();
        vmm_alloc_info a0, a3;
        CHECK(vmm_find(reg, pid, big[0], &a0) == VMM_OK && vmm_find(reg, pid, big[3], &a3) == VMM_OK, "find: %s",
              vmm_last_error());
        uint64_t ha[2] = {big[0] + 4 * KIB, big[3]}, hs[2] = {MIB, 2 * MIB};
        for (int round = 0; round < 2; round++) {
            vmm_alloc_info *hints = calloc(2, sizeof *hints);
            hints[0] = a0;
            hints[1] = a0; /* covers neither byte of range 1 */
            if (round) hints[0].generation++;
            struct many *m = NULL;
            vmm_imported *out[2] = {0};
            vmm_status st = vmm__import_many_begin(reg, pid, ha, hs, hints, 2, &m);
            if (st == VMM_OK) st = vmm__import_many_end(m, out);
            if (!round) {
                CHECK(st == VMM_OK && first_wrong(vmm_import_ptr(out[0]), MIB, 200, KIB / 2) < 0 &&
                          first_wrong(vmm_import_ptr(out[1]), 2 * MIB, 203, 0) < 0,
                      "hints: the ranges' bytes (%s)", vmm_last_error());
                release_all(out, 2);
            } else {
                CHECK(st == VMM_ERR_STALE && !out[0] && !out[1], "a stale hint: status %d (%s)", st, vmm_last_error());
            }
        }
        same_as_before(c0, "hints");
    }

    CHECK(vmm_import_release(held) == VMM_OK, "release the cached chunk's import: %s", vmm_last_error());
    same_as_before(c_base, "the end");
    vmm_close(reg);
    CHECK(spans_quit() == 0, "the owner did not exit cleanly");
    shm_unlink(g_reg);
    CHECK_DONE();
}
