/* Importing allocations that share a chunk (the shim's pool), over the emulated driver.
 *
 * A forked child plays the owner: one exportable 2 MiB VMM chunk (chunk id 41) holding three
 * allocations at offsets 0, 4096 and 1 MiB, and one allocation that is its own chunk (chunk id 0,
 * as records of older writers are), all published with the registry writer API and served by the
 * real broker (broker.c, included as test_broker does) through an export function that counts
 * its requests.  This process imports through the client library and reads the emulated
 * driver's counters: distinct pointers at chunk base + offset, the owner's bytes through each,
 * no broker request and no driver import for a second allocation of an imported chunk, the chunk
 * kept while any import of it is held and unmapped at the last release, stale records refused
 * (with and without the chunk mapped), a broker that disagrees on the chunk size refused, many
 * threads at once, a dead owner.  `vmmctl import-test` and `show` read the same allocations, and
 * emulated legacy IPC opens two of them in another process (this test re-executed under the
 * shim as `test_import_chunks ipc ...`), and a third allocation the owner placed where a held one
 * was freed. */
#include "../../shim/broker/broker.c" /* test equipment: a real broker in the owner */
#include "../../shim/broker/dir.c"
#include "../../shim/broker/holders.c"
#include "../../shim/broker/control.c"

#include "../fakecuda/fakecuda.h"
#include "backing/ipc.h"
#include "check.h"
#include "fakeowner.h"
#include "registry/registry.h"
#include "spawn.h"
#include "vmmshim.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/wait.h>

#define CHUNK (2ull << 20)
#define CHUNK_ID 41u
#define THREADS 8
#define ROUNDS 300

enum { A, B, C, L, N_REC };

/* Where each allocation lives: its chunk (0: the shared one, 1: its own), offset, sizes. */
static const struct {
    int chunk;
    uint64_t offset, requested, extent;
    char name;
} LAYOUT[N_REC] = {
    {0, 0, 3000, 4096, 'A'},
    {0, 4096, 4096, 4096, 'B'},
    {0, 1u << 20, 100000, 128u << 10, 'C'},
    {1, 0, CHUNK - 12345, CHUNK, 'L'},
};

static uint8_t pattern(unsigned seed, uint64_t k) { return (uint8_t)(seed * 31u + k * 7u + (k >> 8)); }

static bool pattern_at(const uint8_t *p, uint64_t n, unsigned seed)
{
    for (uint64_t k = 0; k < n; k++)
        if (p[k] != pattern(seed, k)) return false;
    return true;
}

static long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static char g_reg[64], g_dir[128], g_build[512];

/* ------------------------------------------------------------------------------------------ */
/* The owner                                                                                   */

typedef struct rec_info {
    uint64_t address, slot, generation;
    uint8_t id[16];
} rec_info;

typedef struct owner_info {
    int rc; /* 0, or the failing step */
    char err[160];
    int32_t pid;
    rec_info rec[N_REC];
} owner_info;

static pthread_mutex_t o_lock = PTHREAD_MUTEX_INITIALIZER;
static vmm__reg o_reg;
static CUmemGenericAllocationHandle o_handle[2];
static CUdeviceptr o_base[2];
static owner_info o_info;
static uint32_t o_slot[N_REC];
static uint64_t o_requests; /* broker requests served (any outcome) */
static int o_lie;           /* 1: the broker misstates the chunk size */

static int owner_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                        int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total, uint32_t *device)
{
    (void)keys; /* no key: every handle passed each time it is asked for */
    pthread_mutex_lock(&o_lock);
    o_requests++;
    int rc = -ENOENT, chunk = 0;
    for (int i = 0; i < N_REC; i++)
        if (o_slot[i] == slot) {
            rc = generation == o_info.rec[i].generation && !memcmp(alloc_id, o_info.rec[i].id, 16) ? 0 : -ESTALE;
            chunk = LAYOUT[i].chunk;
        }
    CUmemGenericAllocationHandle h = o_handle[chunk];
    int lie = o_lie;
    pthread_mutex_unlock(&o_lock);
    if (rc) return rc;
    *n_total = 1; /* one handle per record here */
    if (first != 0 || max == 0) return -ERANGE;
    if (drv.MemExportToShareableHandle(&fds[0], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) return -EIO;
    sizes[0] = lie ? 2 * CHUNK : CHUNK;
    *n_here = 1;
    *device = 0;
    return 0;
}

/* Lock held.  Publish record i in its bound slot. */
static int owner_publish(int i)
{
    vmm_reg_alloc d, pub;
    memset(&d, 0, sizeof d);
    d.api = VMM_API_TEST;
    d.requested_size = LAYOUT[i].requested;
    d.handle_kinds = VMM_HANDLE_BROKER;
    if (LAYOUT[i].chunk == 0) {
        d.mapped_size = CHUNK;
        d.chunk_id = CHUNK_ID;
        d.chunk_offset = LAYOUT[i].offset;
        d.flags = VMM_REG_F_SHARED_CHUNK;
    }
    snprintf(d.tag, sizeof d.tag, "rec-%c", LAYOUT[i].name);
    int rc = vmm__reg_publish(&o_reg, o_slot[i], &d, &pub);
    if (rc) return rc;
    o_info.rec[i].slot = o_slot[i];
    o_info.rec[i].generation = pub.generation;
    memcpy(o_info.rec[i].id, pub.alloc_id, 16);
    return 0;
}

#define OWNER_FAIL(step, ...)                                                                    \
    do {                                                                                         \
        o_info.rc = step;                                                                        \
        snprintf(o_info.err, sizeof o_info.err, __VA_ARGS__);                                    \
        (void)write_full(rep, &o_info, sizeof o_info);                                           \
        _exit(1);                                                                                \
    } while (0)

static void owner_main(int cmd, int rep)
{
    alarm(300); /* never outlive a broken test */
    o_info.pid = (int32_t)getpid();
    setenv("VMMSHIM_BROKER_DIR", g_dir, 1);
    vmm__opt_reload_for_test();
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    CUresult r = owner_driver_start(&prop, &acc);
    if (r) OWNER_FAIL(1, "driver init: %d", (int)r);
    for (int c = 0; c < 2; c++) {
        if ((r = drv.MemCreate(&o_handle[c], CHUNK, &prop, 0))) OWNER_FAIL(2, "cuMemCreate: %d", (int)r);
        if ((r = drv.MemAddressReserve(&o_base[c], CHUNK, CHUNK, 0, 0))) OWNER_FAIL(3, "reserve: %d", (int)r);
        if ((r = drv.MemMap(o_base[c], CHUNK, 0, o_handle[c], 0))) OWNER_FAIL(4, "cuMemMap: %d", (int)r);
        if ((r = drv.MemSetAccess(o_base[c], CHUNK, &acc, 1))) OWNER_FAIL(5, "cuMemSetAccess: %d", (int)r);
    }
    char err[256] = "";
    int rc = vmm__reg_open(&o_reg, g_reg, VMM__REG_CREATE, 1024, NULL, err, sizeof err);
    if (rc) OWNER_FAIL(6, "registry: %s", err);
    if ((rc = vmm__reg_attach(&o_reg, NULL))) OWNER_FAIL(7, "attach: %d", rc);
    pthread_mutex_lock(&o_lock);
    for (int i = 0; i < N_REC; i++) {
        uint64_t addr = o_base[LAYOUT[i].chunk] + LAYOUT[i].offset;
        uint8_t *host = (uint8_t *)(uintptr_t)addr; /* emulated device memory is host memory */
        for (uint64_t k = 0; k < LAYOUT[i].requested; k++) host[k] = pattern((unsigned)i + 1, k);
        o_info.rec[i].address = addr;
        if ((rc = vmm__reg_bind(&o_reg, addr, LAYOUT[i].extent, &o_slot[i]))) OWNER_FAIL(8, "bind: %d", rc);
        if ((rc = owner_publish(i))) OWNER_FAIL(9, "publish: %d", rc);
    }
    pthread_mutex_unlock(&o_lock);
    char sock[112];
    if ((rc = vmm__broker_start(owner_export, sock, sizeof sock))) OWNER_FAIL(10, "broker: %s", strerror(-rc));
    if ((rc = vmm__reg_set_broker(&o_reg, sock))) OWNER_FAIL(11, "set_broker: %d", rc);
    if (!write_full(rep, &o_info, sizeof o_info)) _exit(1);

    for (;;) {
        uint8_t c[3];
        if (!read_command(cmd, c, 3)) _exit(0);
        int i = c[1] < N_REC ? c[1] : 0;
        if (c[0] == 'N') { /* broker requests so far */
            pthread_mutex_lock(&o_lock);
            uint64_t n = o_requests;
            pthread_mutex_unlock(&o_lock);
            (void)write_full(rep, &n, sizeof n);
        } else if (c[0] == 'R') { /* free record i and allocate it again in the same place */
            pthread_mutex_lock(&o_lock);
            rc = vmm__reg_retract(&o_reg, o_slot[i]);
            if (!rc) rc = owner_publish(i);
            o_info.rc = rc;
            pthread_mutex_unlock(&o_lock);
            (void)write_full(rep, &o_info, sizeof o_info);
        } else if (c[0] == 'V') { /* does record i hold pattern(c[2])? */
            uint8_t ok = pattern_at((const uint8_t *)(uintptr_t)o_info.rec[i].address, LAYOUT[i].requested, c[2]);
            (void)write_full(rep, &ok, 1);
        } else if (c[0] == 'L') {
            pthread_mutex_lock(&o_lock);
            o_lie = c[2];
            pthread_mutex_unlock(&o_lock);
            (void)write_full(rep, c, 1);
        } else if (c[0] == 'Q') {
            exit(0);
        }
    }
}

typedef struct owner {
    pid_t pid;
    int cmd, rep;
    owner_info info;
} owner;

static bool owner_start(owner *o)
{
    memset(o, 0, sizeof *o);
    int c[2], r[2];
    if (pipe2(c, O_CLOEXEC) != 0 || pipe2(r, O_CLOEXEC) != 0) return false;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(c[1]);
        close(r[0]);
        owner_main(c[0], r[1]);
        _exit(0);
    }
    close(c[0]);
    close(r[1]);
    o->pid = pid;
    o->cmd = c[1];
    o->rep = r[0];
    bool ok = read_full(o->rep, &o->info, sizeof o->info);
    CHECK(ok && o->info.rc == 0, "owner did not start: step %d: %s", o->info.rc, ok ? o->info.err : "no report");
    return ok && o->info.rc == 0;
}

static bool owner_cmd(owner *o, char op, int i, int arg, void *reply, size_t len)
{
    uint8_t c[3] = {(uint8_t)op, (uint8_t)i, (uint8_t)arg};
    return write_full(o->cmd, c, 3) && read_full(o->rep, reply, len);
}

static uint64_t broker_requests(owner *o)
{
    uint64_t n = UINT64_MAX;
    owner_cmd(o, 'N', 0, 0, &n, sizeof n);
    return n;
}

static bool owner_verify(owner *o, int i, unsigned seed)
{
    uint8_t ok = 0;
    return owner_cmd(o, 'V', i, (int)seed, &ok, 1) && ok == 1;
}

static void owner_end(owner *o, bool kill_it)
{
    if (kill_it) {
        kill(o->pid, SIGKILL);
    } else {
        uint8_t c[3] = {'Q', 0, 0};
        (void)write_full(o->cmd, c, 3);
    }
    waitpid(o->pid, NULL, 0);
    close(o->cmd);
    close(o->rep);
}

/* ------------------------------------------------------------------------------------------ */
/* The cases                                                                                   */

static vmm_registry *g_client;
static unsigned g_seed[N_REC] = {1, 2, 3, 4}; /* the pattern each allocation holds now */

static bool find(owner *o, int i, uint64_t inside, vmm_alloc_info *a)
{
    vmm_status st = vmm_find(g_client, (uint32_t)o->info.pid, o->info.rec[i].address + inside, a);
    CHECK(st == VMM_OK, "find %c: %s", LAYOUT[i].name, vmm_last_error());
    return st == VMM_OK;
}

#define CHECK_SAME_DRIVER_STATE(before, after, what)                                                             \
    CHECK((after).mappings_live == (before).mappings_live &&                                                       \
              (after).reservations_live == (before).reservations_live &&                                           \
              (after).imports_live == (before).imports_live && (after).handles_live == (before).handles_live,      \
          "%s: mappings %llu->%llu reservations %llu->%llu imports %llu->%llu handles %llu->%llu", what,           \
          (before).mappings_live, (after).mappings_live, (before).reservations_live, (after).reservations_live,    \
          (before).imports_live, (after).imports_live, (before).handles_live, (after).handles_live)

static void case_records(owner *o)
{
    vmm_alloc_info a;
    for (int i = 0; i < N_REC; i++) {
        if (!find(o, i, LAYOUT[i].extent - 1, &a)) continue;
        bool pooled = LAYOUT[i].chunk == 0;
        CHECK(a.address == o->info.rec[i].address && a.mapped_size == CHUNK && a.extent == LAYOUT[i].extent &&
                  a.requested_size == LAYOUT[i].requested && a.chunk_id == (pooled ? CHUNK_ID : 0) &&
                  a.chunk_offset == (pooled ? LAYOUT[i].offset : 0) &&
                  a.flags == (pooled ? VMM_ALLOC_SHARED_CHUNK : 0),
              "record %c: address %llx mapped %llu extent %llu chunk %llu+%llu flags %u", LAYOUT[i].name,
              (unsigned long long)a.address, (unsigned long long)a.mapped_size, (unsigned long long)a.extent,
              (unsigned long long)a.chunk_id, (unsigned long long)a.chunk_offset, a.flags);
    }
}

/* Two allocations of one chunk: one import of the chunk, two pointers into it. */
static void case_two_in_one_chunk(owner *o)
{
    vmm_alloc_info a, b;
    if (!find(o, A, 100, &a) || !find(o, B, 4095, &b)) return;
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);

    vmm_imported *ia = NULL, *ib = NULL, *ia2 = NULL;
    long long t0 = now_us();
    vmm_status st = vmm_import(g_client, &a, &ia);
    long long t1 = now_us();
    CHECK(st == VMM_OK, "import A: %s", vmm_last_error());
    if (st != VMM_OK) return;
    struct fakecuda_counters c1 = counters();
    CHECK_EQ(broker_requests(o), r0 + 1);
    CHECK_EQ(c1.imports, c0.imports + 1);
    CHECK_EQ(c1.mappings_live, c0.mappings_live + 1);
    const uint8_t *pa = (const uint8_t *)(uintptr_t)vmm_import_ptr(ia);
    CHECK_EQ(vmm_import_size(ia), LAYOUT[A].requested);
    CHECK(pattern_at(pa, LAYOUT[A].requested, g_seed[A]), "A's bytes through the import");

    long long t2 = now_us();
    st = vmm_import(g_client, &b, &ib);
    long long t3 = now_us();
    CHECK(st == VMM_OK, "import B: %s", vmm_last_error());
    if (st != VMM_OK) {
        vmm_import_release(ia);
        return;
    }
    struct fakecuda_counters c2 = counters();
    uint8_t *pb = (uint8_t *)(uintptr_t)vmm_import_ptr(ib);
    CHECK((uintptr_t)pb == (uintptr_t)pa + 4096, "B at %p, A at %p: B must be A's chunk base + 4096", (void *)pb,
          (const void *)pa);
    CHECK_EQ(vmm_import_size(ib), LAYOUT[B].requested);
    CHECK(pattern_at(pb, LAYOUT[B].requested, g_seed[B]), "B's bytes through the import");
    /* the proof that the second import asked no one: the owner's broker and the driver agree */
    CHECK_EQ(broker_requests(o), r0 + 1);
    CHECK_EQ(c2.imports, c1.imports);
    CHECK_EQ(c2.calls_cuMemMap, c1.calls_cuMemMap);
    CHECK_SAME_DRIVER_STATE(c1, c2, "a second allocation of the chunk");
    long long t4 = now_us();
    int hits = 0;
    for (int n = 0; n < 1000; n++) {
        vmm_imported *x = NULL;
        hits += vmm_import(g_client, n % 2 ? &a : &b, &x) == VMM_OK;
        vmm_import_release(x);
    }
    long long t5 = now_us();
    CHECK_EQ(hits, 1000);
    CHECK_EQ(broker_requests(o), r0 + 1);
    printf("stat: importing an allocation took %lld us; another of the same chunk %lld us (%.1f us on average over "
           "1000 more)\n",
           t1 - t0, t3 - t2, (double)(t5 - t4) / 1000.0);

    /* the same allocation again: the same pointer, still no one asked */
    CHECK_EQ(vmm_import(g_client, &a, &ia2), VMM_OK);
    CHECK(vmm_import_ptr(ia2) == (uint64_t)(uintptr_t)pa, "A imported twice at two places");
    CHECK_EQ(broker_requests(o), r0 + 1);

    /* writes through one allocation's pointer land in the owner's allocation */
    for (uint64_t k = 0; k < LAYOUT[B].requested; k++) pb[k] = pattern(77, k);
    g_seed[B] = 77;
    CHECK(owner_verify(o, B, 77), "the owner does not see the write through B");
    CHECK(owner_verify(o, A, g_seed[A]), "the write through B touched A");

    /* releasing A (both handles) keeps B's chunk mapped */
    CHECK_EQ(vmm_import_release(ia), VMM_OK);
    CHECK_EQ(vmm_import_release(ia2), VMM_OK);
    struct fakecuda_counters c3 = counters();
    CHECK_SAME_DRIVER_STATE(c1, c3, "A released, B held");
    CHECK(pattern_at(pb, LAYOUT[B].requested, 77), "B's bytes after A was released");

    /* the last release leaves the chunk mapped, idle, while the owner holds it */
    CHECK_EQ(vmm_import_release(ib), VMM_OK);
    struct fakecuda_counters c4 = counters();
    CHECK_SAME_DRIVER_STATE(c1, c4, "both released, the chunk idle");

    /* so the next import costs no broker request and no driver import */
    ib = NULL;
    CHECK_EQ(vmm_import(g_client, &b, &ib), VMM_OK);
    CHECK_EQ(broker_requests(o), r0 + 1);
    CHECK_SAME_DRIVER_STATE(c1, counters(), "B imported again from the idle chunk");
    vmm_import_timing t;
    CHECK_EQ(vmm_import_last_timing(&t), VMM_OK);
    CHECK(t.cached == 1 && t.route == 0 && t.request_ns == 0 && t.map_ns == 0 && t.total_ns > 0,
          "timing of a cached import: cached %u route %u request %llu map %llu total %llu", t.cached, t.route,
          (unsigned long long)t.request_ns, (unsigned long long)t.map_ns, (unsigned long long)t.total_ns);
    CHECK(ib && pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(ib), LAYOUT[B].requested, 77), "B again");
    CHECK_EQ(vmm_import_release(ib), VMM_OK);

    /* vmm_import_drop_idle unmaps it and lets the imported handle go */
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK);
    struct fakecuda_counters c5 = counters();
    CHECK(c5.calls_cuMemRelease > c4.calls_cuMemRelease, "the imported handle was not released");
    CHECK_SAME_DRIVER_STATE(c0, c5, "idle chunk dropped");

    /* then the next import asks the broker again, on the kept connection, and times each step */
    ib = NULL;
    CHECK_EQ(vmm_import(g_client, &b, &ib), VMM_OK);
    CHECK_EQ(broker_requests(o), r0 + 2);
    CHECK_EQ(vmm_import_last_timing(&t), VMM_OK);
    CHECK(t.cached == 0 && t.route == VMM_KIND_BROKER && t.request_ns > 0 && t.import_ns > 0 && t.map_ns > 0 &&
              t.access_ns > 0 && t.total_ns >= t.request_ns + t.import_ns + t.map_ns,
          "timing of a broker import: cached %u route %u request %llu import %llu map %llu total %llu", t.cached,
          t.route, (unsigned long long)t.request_ns, (unsigned long long)t.import_ns, (unsigned long long)t.map_ns,
          (unsigned long long)t.total_ns);
    CHECK(ib && pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(ib), LAYOUT[B].requested, 77), "B again");
    CHECK_EQ(vmm_import_release(ib), VMM_OK);
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "B imported and released again");
}

/* Freed and published again at the same slot: the old description is refused whether its chunk
 * is mapped here (no broker asked) or not (the broker refuses). */
static void case_stale(owner *o)
{
    vmm_alloc_info a, old_b, new_b;
    if (!find(o, A, 0, &a) || !find(o, B, 0, &old_b)) return;
    struct fakecuda_counters c0 = counters();
    vmm_imported *ia = NULL, *ib = NULL;
    CHECK_EQ(vmm_import(g_client, &a, &ia), VMM_OK);
    if (!ia) return;
    owner_info now;
    CHECK(owner_cmd(o, 'R', B, 0, &now, sizeof now) && now.rc == 0, "re-publishing B failed");
    CHECK(now.rec[B].slot == o->info.rec[B].slot && now.rec[B].generation != o->info.rec[B].generation,
          "B was not re-published in its slot");
    o->info = now;
    uint64_t r0 = broker_requests(o);
    vmm_status st = vmm_import(g_client, &old_b, &ib);
    CHECK(st == VMM_ERR_STALE && ib == NULL, "stale B with its chunk mapped: %d %s", st, vmm_last_error());
    char want[64];
    snprintf(want, sizeof want, "generation %llu is gone", (unsigned long long)old_b.generation);
    CHECK(strstr(vmm_last_error(), want) != NULL, "message: %s", vmm_last_error());
    CHECK_EQ(broker_requests(o), r0);

    /* a description that misplaces the allocation in its chunk */
    vmm_alloc_info moved = a;
    moved.chunk_offset = 8192;
    CHECK_EQ(vmm_import(g_client, &moved, &ib), VMM_ERR_STALE);
    CHECK(strstr(vmm_last_error(), "offset 0 of chunk 41") != NULL, "message: %s", vmm_last_error());
    /* ... or outside it altogether */
    moved.chunk_offset = CHUNK - 100;
    CHECK_EQ(vmm_import(g_client, &moved, &ib), VMM_ERR_INVALID);

    /* the new allocation in the same place imports, from the mapped chunk */
    if (find(o, B, 10, &new_b)) {
        CHECK(new_b.slot == old_b.slot && new_b.generation != old_b.generation, "B's record moved on");
        CHECK_EQ(vmm_import(g_client, &new_b, &ib), VMM_OK);
        CHECK(ib && vmm_import_ptr(ib) == vmm_import_ptr(ia) + 4096, "new B at its offset");
        CHECK_EQ(broker_requests(o), r0);
        vmm_import_release(ib);
        ib = NULL;
    }
    CHECK_EQ(vmm_import_release(ia), VMM_OK);
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "after the stale imports");

    /* nothing mapped: the owner's broker refuses the old generation */
    st = vmm_import(g_client, &old_b, &ib);
    CHECK(st == VMM_ERR_STALE && ib == NULL, "stale B, nothing mapped: %d %s", st, vmm_last_error());
    CHECK_EQ(broker_requests(o), r0 + 1);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "after the refused import");
}

/* An idle mapping goes when its witness (the allocation last imported from it) is freed, and when
 * the registry it was read through is closed; held ones stay. */
static bool driver_state_back(const struct fakecuda_counters *c0, int ms)
{
    for (int waited = 0;; waited += 10) {
        struct fakecuda_counters c = counters();
        if (c.mappings_live == c0->mappings_live && c.reservations_live == c0->reservations_live &&
            c.imports_live == c0->imports_live && c.handles_live == c0->handles_live)
            return true;
        if (waited >= ms) return false;
        usleep(10000);
    }
}

/* The owner frees B and allocates it again (its idle chunk's witness gone) while each cuMemUnmap
 * takes 500 ms; returns once the reaper is asleep inside the unmap of B's chunk, holding no lock. */
static void reaper_unmapping_b(owner *o)
{
    owner_info now;
    drv.set_unmap_delay_us(500000);
    unsigned long long unmaps = counters().calls_cuMemUnmap;
    CHECK(owner_cmd(o, 'R', B, 0, &now, sizeof now) && now.rc == 0, "re-publishing B failed");
    o->info = now;
    for (int i = 0; i < 300 && counters().calls_cuMemUnmap == unmaps; i++) usleep(10000); /* 100 ms ticks */
    CHECK(counters().calls_cuMemUnmap > unmaps, "the reaper never began to unmap B's chunk");
}

static void case_idle(owner *o)
{
    vmm_alloc_info a, b;
    if (!find(o, A, 0, &a) || !find(o, B, 0, &b)) return;
    struct fakecuda_counters c0 = counters();
    vmm_imported *ib = NULL, *held = NULL;
    CHECK_EQ(vmm_import(g_client, &b, &ib), VMM_OK);
    CHECK_EQ(vmm_import(g_client, &b, &held), VMM_OK);
    CHECK_EQ(vmm_import_check(g_client, held), VMM_OK);
    CHECK_EQ(vmm_import_release(ib), VMM_OK);
    CHECK_EQ(counters().mappings_live, c0.mappings_live + 1);
    /* the owner frees B and allocates it again, in the same place and slot: the held import stays
     * valid memory and tells the allocation is gone (its generation moved on) */
    owner_info now;
    CHECK(owner_cmd(o, 'R', B, 0, &now, sizeof now) && now.rc == 0, "re-publishing B failed");
    o->info = now;
    vmm_status st = held ? vmm_import_check(g_client, held) : VMM_ERR_INVALID;
    CHECK(st == VMM_ERR_STALE && strstr(vmm_last_error(), "generation"), "check after B was freed: %d %s", st,
          vmm_last_error());
    CHECK(held && pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(held), LAYOUT[B].requested, g_seed[B]),
          "the held import's bytes after the owner freed B");
    CHECK_EQ(vmm_import_release(held), VMM_OK);
    /* and with nothing held, the reaper unmaps the idle chunk */
    double t0 = now_us();
    CHECK(driver_state_back(&c0, 3000), "the idle chunk was still mapped 3 s after its witness was freed");
    printf("stat: an idle chunk was unmapped %.0f ms after its witness was freed\n", (now_us() - t0) / 1000);

    /* vmm_import_drop_idle returns once no idle mapping is left, also one the reaper took a moment
     * before and is still unmapping (each cuMemUnmap 500 ms here) */
    if (!find(o, B, 0, &b)) return;
    ib = NULL;
    CHECK_EQ(vmm_import(g_client, &b, &ib), VMM_OK);
    CHECK_EQ(vmm_import_release(ib), VMM_OK);
    reaper_unmapping_b(o);
    t0 = now_us();
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK);
    double waited_ms = (now_us() - t0) / 1000;
    struct fakecuda_counters after = counters();
    drv.set_unmap_delay_us(0);
    CHECK(after.mappings_live == c0.mappings_live && after.reservations_live == c0.reservations_live &&
              after.imports_live == c0.imports_live,
          "drop_idle returned after %.0f ms with %llu mappings and %llu reservations live (before the import: %llu, %llu)",
          waited_ms, after.mappings_live, after.reservations_live, c0.mappings_live, c0.reservations_live);
    printf("stat: drop_idle waited %.0f ms for the reaper's unmap of an idle chunk\n", waited_ms);

    /* ... and a child forked while the reaper unmaps waits only for its own unmaps: it inherits
     * the count of the parent's sweep, but not the thread that would bring it down */
    vmm_alloc_info l;
    if (!find(o, B, 0, &b) || !find(o, L, 0, &l)) return;
    vmm_imported *il = NULL;
    ib = NULL;
    CHECK(vmm_import(g_client, &b, &ib) == VMM_OK && vmm_import(g_client, &l, &il) == VMM_OK, "B and L: %s",
          vmm_last_error());
    CHECK(vmm_import_release(ib) == VMM_OK && vmm_import_release(il) == VMM_OK, "releases");
    reaper_unmapping_b(o); /* L's chunk stays idle, its witness live */
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        alarm(10);
        _exit(vmm_import_drop_idle() == VMM_OK ? 0 : 1); /* unmaps L's chunk (500 ms) and returns */
    }
    int wst = 0;
    bool ended = false;
    for (int i = 0; i < 500 && !ended; i++) {
        ended = child > 0 && waitpid(child, &wst, WNOHANG) == child;
        if (!ended) usleep(10000);
    }
    if (!ended && child > 0) {
        kill(child, SIGKILL);
        waitpid(child, &wst, 0);
    }
    CHECK(ended && WIFEXITED(wst) && WEXITSTATUS(wst) == 0,
          "a child forked during the reaper's unmap: drop_idle %s (status 0x%x)", ended ? "returned" : "hung 5 s", wst);
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK);
    drv.set_unmap_delay_us(0);
    CHECK(driver_state_back(&c0, 0), "after the fork case");

    /* closing the registry handle an idle chunk was read through unmaps it; a held one stays */
    vmm_registry *second = NULL;
    CHECK_EQ(vmm_open(g_reg, &second), VMM_OK);
    if (!second || !find(o, B, 0, &b)) return;
    vmm_imported *ia = NULL;
    ib = NULL;
    CHECK_EQ(vmm_import(second, &b, &ib), VMM_OK);
    CHECK_EQ(vmm_import_release(ib), VMM_OK);
    CHECK_EQ(vmm_import(second, &a, &ia), VMM_OK);
    CHECK_EQ(counters().mappings_live, c0.mappings_live + (a.chunk_id == b.chunk_id ? 1 : 2));
    vmm_close(second);
    CHECK(ia && pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(ia), LAYOUT[A].requested, g_seed[A]),
          "A, held, after its registry handle was closed");
    if (a.chunk_id != b.chunk_id) CHECK_EQ(counters().mappings_live, c0.mappings_live + 1);
    CHECK_EQ(vmm_import_release(ia), VMM_OK);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "idle and held chunks of a closed registry handle");
}

/* The broker hands over a chunk of another size than the record's: refused, nothing left over. */
static void case_size_mismatch(owner *o)
{
    vmm_alloc_info c;
    if (!find(o, C, 0, &c)) return;
    struct fakecuda_counters c0 = counters();
    uint8_t ack;
    CHECK(owner_cmd(o, 'L', 0, 1, &ack, 1), "owner: lie");
    vmm_imported *ic = NULL;
    vmm_status st = vmm_import(g_client, &c, &ic);
    CHECK(st == VMM_ERR_IO && ic == NULL, "size mismatch: %d %s", st, vmm_last_error());
    CHECK(strstr(vmm_last_error(), "4194304") && strstr(vmm_last_error(), "2097152"), "message: %s", vmm_last_error());
    CHECK(owner_cmd(o, 'L', 0, 0, &ack, 1), "owner: truth");
    struct fakecuda_counters c1 = counters();
    CHECK_SAME_DRIVER_STATE(c0, c1, "refused chunk");
    CHECK_EQ(c1.imports, c0.imports);
    CHECK_EQ(vmm_import(g_client, &c, &ic), VMM_OK);
    CHECK(ic && pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(ic), LAYOUT[C].requested, g_seed[C]),
          "C's bytes");
    vmm_import_release(ic);
}

/* A record without a chunk id (its own chunk): imported as before, and a second import of it
 * while held is served here too, by slot and generation. */
static void case_own_chunk(owner *o)
{
    vmm_alloc_info l, a;
    if (!find(o, L, 12345, &l) || !find(o, A, 0, &a)) return;
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    vmm_imported *i1 = NULL, *i2 = NULL, *ia = NULL;
    CHECK_EQ(vmm_import(g_client, &l, &i1), VMM_OK);
    CHECK_EQ(vmm_import(g_client, &l, &i2), VMM_OK);
    CHECK_EQ(vmm_import(g_client, &a, &ia), VMM_OK);
    if (i1 && i2 && ia) {
        CHECK(vmm_import_ptr(i1) == vmm_import_ptr(i2), "one mapping for one allocation");
        CHECK(vmm_import_ptr(i1) != vmm_import_ptr(ia), "two chunks, one pointer");
        CHECK(pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(i1), LAYOUT[L].requested, g_seed[L]), "L's bytes");
        struct fakecuda_counters c1 = counters();
        CHECK_EQ(c1.imports, c0.imports + 2);
        CHECK_EQ(c1.mappings_live, c0.mappings_live + 2);
        CHECK_EQ(broker_requests(o), r0 + 2);
    }
    vmm_import_release(i1);
    vmm_import_release(ia);
    CHECK(i2 && pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(i2), LAYOUT[L].requested, g_seed[L]),
          "L after one of its two imports was released");
    vmm_import_release(i2);
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "own chunk released");
}

/* Many threads importing and releasing allocations of one chunk at once. */
typedef struct {
    vmm_alloc_info rec[3];
    pthread_barrier_t *gate;
    int t, failures;
    char why[200];
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    pthread_barrier_wait(w->gate);
    for (int n = 0; n < ROUNDS && !w->failures; n++) {
        int x = (w->t + n) % 3, y = (w->t + n + 1) % 3;
        vmm_imported *ix = NULL, *iy = NULL;
        vmm_status sx = vmm_import(g_client, &w->rec[x], &ix), sy = vmm_import(g_client, &w->rec[y], &iy);
        if (sx != VMM_OK || sy != VMM_OK) {
            snprintf(w->why, sizeof w->why, "import: %s", vmm_last_error());
            w->failures++;
        } else {
            const uint8_t *px = (const uint8_t *)(uintptr_t)vmm_import_ptr(ix);
            const uint8_t *py = (const uint8_t *)(uintptr_t)vmm_import_ptr(iy);
            uint64_t nx = LAYOUT[x].requested;
            if ((uintptr_t)py - (uintptr_t)px != LAYOUT[y].offset - LAYOUT[x].offset ||
                px[0] != pattern(g_seed[x], 0) || px[nx - 1] != pattern(g_seed[x], nx - 1)) {
                snprintf(w->why, sizeof w->why, "round %d: %c and %c misplaced or wrong", n, LAYOUT[x].name,
                         LAYOUT[y].name);
                w->failures++;
            }
        }
        if (vmm_import_release(ix) != VMM_OK || vmm_import_release(iy) != VMM_OK) {
            snprintf(w->why, sizeof w->why, "release: %s", vmm_last_error());
            w->failures++;
        }
    }
    return NULL;
}

static void case_threads(owner *o)
{
    worker w[THREADS];
    pthread_t th[THREADS];
    pthread_barrier_t gate;
    pthread_barrier_init(&gate, NULL, THREADS);
    memset(w, 0, sizeof w);
    for (int i = 0; i < 3; i++)
        if (!find(o, i, 0, &w[0].rec[i])) return;
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    for (int t = 0; t < THREADS; t++) {
        memcpy(w[t].rec, w[0].rec, sizeof w[t].rec);
        w[t].gate = &gate;
        w[t].t = t;
        pthread_create(&th[t], NULL, work, &w[t]);
    }
    int failures = 0;
    for (int t = 0; t < THREADS; t++) {
        pthread_join(th[t], NULL);
        CHECK(w[t].failures == 0, "thread %d: %s", t, w[t].why);
        failures += w[t].failures;
    }
    pthread_barrier_destroy(&gate);
    /* the chunk stayed mapped, idle, between rounds: only threads racing in the first round
     * (each missing it before another had mapped it) asked the owner */
    CHECK(broker_requests(o) - r0 <= THREADS, "%llu broker requests for %d threads",
          (unsigned long long)(broker_requests(o) - r0), THREADS);
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK);
    struct fakecuda_counters c1 = counters();
    CHECK_SAME_DRIVER_STATE(c0, c1, "after the threads");
    printf("stat: %d threads x %d rounds of two imports of one chunk: %llu broker requests, %llu driver imports\n",
           THREADS, ROUNDS, (unsigned long long)(broker_requests(o) - r0),
           (unsigned long long)(c1.imports - c0.imports));
}

/* ------------------------------------------------------------------------------------------ */
/* vmmctl                                                                                      */

static uint64_t fnv_of(unsigned seed, uint64_t from, uint64_t n, uint64_t requested)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint64_t k = from; k < from + n; k++) h = (h ^ (k < requested ? pattern(seed, k) : 0)) * 0x100000001b3ull;
    return h;
}

static int vmmctl(char *out, size_t len, const char *cmd, pid_t pid, uint64_t addr, uint64_t n)
{
    char ctl[600], pid_s[16], addr_s[32], len_s[32], err[2048];
    snprintf(ctl, sizeof ctl, "%s/vmmctl", g_build);
    snprintf(pid_s, sizeof pid_s, "%d", (int)pid);
    snprintf(addr_s, sizeof addr_s, "0x%llx", (unsigned long long)addr);
    snprintf(len_s, sizeof len_s, "%llu", (unsigned long long)n);
    char *argv[] = {ctl, "--registry", g_reg, (char *)cmd, pid_s, addr_s, n ? len_s : NULL, NULL};
    int rc = spawn_capture(argv, NULL, out, len, err, sizeof err, 60);
    if (rc) snprintf(out + strlen(out), len - strlen(out), "%s", err);
    return rc;
}

static void case_vmmctl(owner *o)
{
    char out[4096], want[64];
    uint64_t b = o->info.rec[B].address, a = o->info.rec[A].address;
    int rc = vmmctl(out, sizeof out, "import-test", o->pid, b, 0);
    snprintf(want, sizeof want, "fnv %016llx", (unsigned long long)fnv_of(g_seed[B], 0, 4096, 4096));
    CHECK(rc == 0 && strstr(out, want) && strstr(out, "offset 4096 of chunk 41") && strstr(out, "4096 bytes from"),
          "import-test B: want %s: %s", want, out);
    rc = vmmctl(out, sizeof out, "import-test", o->pid, b + 100, 3996);
    snprintf(want, sizeof want, "fnv %016llx", (unsigned long long)fnv_of(g_seed[B], 100, 3996, 4096));
    CHECK(rc == 0 && strstr(out, want), "import-test B+100 3996: want %s: %s", want, out);
    rc = vmmctl(out, sizeof out, "import-test", o->pid, b + 100, 3997);
    CHECK(rc == 2 && strstr(out, "runs past the allocation (3996 bytes"), "LEN past B's end: %d %s", rc, out);
    /* A's padding, past its requested 3000 bytes up to its 4096-byte extent */
    rc = vmmctl(out, sizeof out, "import-test", o->pid, a + 3500, 0);
    snprintf(want, sizeof want, "fnv %016llx", (unsigned long long)fnv_of(g_seed[A], 3500, 596, 3000));
    CHECK(rc == 0 && strstr(out, want) && strstr(out, "596 bytes from"), "import-test in A's padding: %s", out);

    rc = vmmctl(out, sizeof out, "show", o->pid, b + 5, 0);
    snprintf(want, sizeof want, "0x%llx", (unsigned long long)(b - 4096));
    CHECK(rc == 0 && strstr(out, "chunk        id 41 at ") && strstr(out, want) &&
              strstr(out, "offset 4096 (0x1000)") &&
              strstr(out, "chunk size 2.0 MiB") && strstr(out, "extent 4.0 KiB") &&
              strstr(out, "shares its chunk with 2 other live allocations"),
          "show B: %s", out);
    rc = vmmctl(out, sizeof out, "show", o->pid, o->info.rec[L].address, 0);
    CHECK(rc == 0 && strstr(out, "chunk        its own, chunk size 2.0 MiB") && !strstr(out, "sharing"), "show L: %s",
          out);
}

/* ------------------------------------------------------------------------------------------ */
/* Legacy IPC: `test_import_chunks ipc HA HB HSTALE SEED_A SEED_B`, run under the shim          */

static void to_hex(const unsigned char b[64], char out[129])
{
    for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

static int from_hex(const char *s, unsigned char b[64])
{
    if (strlen(s) != 128) return -1;
    for (int i = 0; i < 64; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
        b[i] = (unsigned char)v;
    }
    return 0;
}

static void make_handle(const vmm_alloc_info *a, char hex[129])
{
    vmm__ipc_handle h;
    unsigned char b[64];
    memset(&h, 0, sizeof h);
    memcpy(h.magic, VMM__IPC_MAGIC, sizeof h.magic);
    h.version = VMM__IPC_VERSION;
    h.pid = a->pid;
    h.start_time = a->owner_start_time;
    h.slot = a->slot;
    h.generation = a->generation;
    memcpy(h.alloc_id, a->alloc_id, 16);
    memcpy(b, &h, sizeof b);
    h.check = vmm__ipc_check(b);
    memcpy(b, &h, sizeof b);
    to_hex(b, hex);
}

typedef int (*open_fn)(void **, cudaIpcMemHandle_t, unsigned);
typedef int (*close_fn)(void *);

static void say(const char *what, long long v)
{
    printf("ipc: %-44s %lld\n", what, v);
    fflush(stdout);
}

static int ipc_helper(char **argv)
{
    unsigned char b[3][64];
    for (int i = 0; i < 3; i++)
        if (from_hex(argv[2 + i], b[i])) return 2;
    unsigned seed_a = (unsigned)atoi(argv[5]), seed_b = (unsigned)atoi(argv[6]);
    void *rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_GLOBAL), *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    void *o = dlsym(RTLD_DEFAULT, "cudaIpcOpenMemHandle"), *c = dlsym(RTLD_DEFAULT, "cudaIpcCloseMemHandle");
    void *k = cuda ? dlsym(cuda, "fakecuda_counters") : NULL;
    if (!rt || !o || !c || !k) {
        printf("ipc: missing runtime, driver or symbols\n");
        return 1;
    }
    open_fn open_h;
    close_fn close_h;
    fakecuda_counters_fn cnt;
    memcpy(&open_h, &o, sizeof o);
    memcpy(&close_h, &c, sizeof c);
    memcpy(&cnt, &k, sizeof k);
    Dl_info di;
    say("cudaIpcOpenMemHandle is the shim's", dladdr(o, &di) && di.dli_fname && strstr(di.dli_fname, "libvmmshim"));
    cudaIpcMemHandle_t ha, hb, hs;
    memcpy(ha.reserved, b[0], 64);
    memcpy(hb.reserved, b[1], 64);
    memcpy(hs.reserved, b[2], 64);
    struct fakecuda_counters c0, c1;
    cnt(&c0);
    void *pa = NULL, *pb = NULL, *pa2 = NULL, *ps = NULL;
    say("open A", open_h(&pa, ha, cudaIpcMemLazyEnablePeerAccess));
    say("open B", open_h(&pb, hb, cudaIpcMemLazyEnablePeerAccess));
    if (!pa || !pb) return 1;
    cnt(&c1);
    say("B - A", (long long)((uintptr_t)pb - (uintptr_t)pa));
    say("driver imports for both", (long long)(c1.imports - c0.imports));
    say("mappings for both", (long long)(c1.mappings_live - c0.mappings_live));
    say("A's bytes", pattern_at(pa, LAYOUT[A].requested, seed_a));
    say("B's bytes", pattern_at(pb, LAYOUT[B].requested, seed_b));
    say("open A again", open_h(&pa2, ha, cudaIpcMemLazyEnablePeerAccess));
    say("open A again: same pointer", pa2 == pa);
    say("open a stale handle", open_h(&ps, hs, cudaIpcMemLazyEnablePeerAccess));
    say("close A", close_h(pa));
    say("close A again", close_h(pa));
    cnt(&c1);
    say("mappings with A closed", (long long)(c1.mappings_live - c0.mappings_live));
    say("B's bytes with A closed", pattern_at(pb, LAYOUT[B].requested, seed_b));
    for (uint64_t i = 0; i < LAYOUT[B].requested; i++) ((uint8_t *)pb)[i] = pattern(99, i);
    say("close B", close_h(pb));
    cnt(&c1);
    say("mappings with both closed", (long long)(c1.mappings_live - c0.mappings_live));
    say("close B once too often", close_h(pb) != 0);

    /* The owner frees B and allocates anew in B's place: the new allocation's handle opens at the
     * held old one's pointer (the same bytes of the same chunk), and each open takes a close. */
    void *old_b = NULL, *new_b = NULL;
    say("open B to hold it", open_h(&old_b, hb, cudaIpcMemLazyEnablePeerAccess));
    printf("ipc: waiting for the new B\n");
    fflush(stdout);
    char line[200];
    unsigned char nb[64];
    if (!fgets(line, sizeof line, stdin) || (line[strcspn(line, "\n")] = 0, from_hex(line, nb))) return 3;
    cudaIpcMemHandle_t hn;
    memcpy(hn.reserved, nb, 64);
    say("open the new B", open_h(&new_b, hn, cudaIpcMemLazyEnablePeerAccess));
    say("the new B at the old B's pointer", new_b && new_b == old_b);
    say("open the old B again", open_h(&pb, hb, cudaIpcMemLazyEnablePeerAccess));
    cnt(&c1);
    say("mappings for old and new B", (long long)(c1.mappings_live - c0.mappings_live));
    say("close B's pointer", close_h(old_b));
    say("close B's pointer again", close_h(old_b));
    say("close B's pointer a third time", close_h(old_b));
    cnt(&c1);
    say("mappings with every B closed", (long long)(c1.mappings_live - c0.mappings_live));
    say("close B's pointer once too often", close_h(old_b) != 0);
    return 0;
}

/* The observation `what` of the helper's output, or LLONG_MIN. */
static long long seen(const char *out, const char *what)
{
    char key[80];
    snprintf(key, sizeof key, "ipc: %-44s ", what);
    const char *p = strstr(out, key);
    return p ? strtoll(p + strlen(key), NULL, 10) : LLONG_MIN;
}

/* Runs the helper under the shim; when it asks, re-publishes B and hands it the new handle. */
static int run_helper(char **argv, const char *preload, const char *reg, owner *o, char *out, size_t outlen, char *err,
                      size_t errlen)
{
    int pin[2], pout[2];
    FILE *ef = tmpfile();
    if (!ef || pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC)) return -1;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        dup2(fileno(ef), 2);
        putenv((char *)preload);
        putenv((char *)reg);
        alarm(60);
        execv(argv[0], argv);
        _exit(127);
    }
    close(pin[0]);
    close(pout[1]);
    FILE *in = fdopen(pin[1], "w"), *from = fdopen(pout[0], "r");
    size_t used = 0;
    char line[512];
    out[0] = 0;
    while (fgets(line, sizeof line, from)) {
        used += (size_t)snprintf(out + used, outlen - used, "%s", line);
        if (used >= outlen) used = outlen - 1;
        if (strncmp(line, "ipc: waiting for the new B", 26) != 0) continue;
        owner_info now;
        vmm_alloc_info b;
        char hex[129] = "";
        if (owner_cmd(o, 'R', B, 0, &now, sizeof now) && now.rc == 0) {
            o->info = now;
            if (find(o, B, 0, &b)) make_handle(&b, hex);
        }
        fprintf(in, "%s\n", hex);
        fflush(in);
    }
    fclose(in);
    fclose(from);
    int st = 0;
    waitpid(pid, &st, 0);
    rewind(ef);
    size_t n = fread(err, 1, errlen - 1, ef);
    err[n] = 0;
    fclose(ef);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void case_ipc(owner *o, const vmm_alloc_info *stale_b)
{
    vmm_alloc_info a, b;
    if (!find(o, A, 0, &a) || !find(o, B, 0, &b)) return;
    char ha[129], hb[129], hs[129], sa[16], sb[16], exe[600], shim[600], preload[700], reg[128];
    make_handle(&a, ha);
    make_handle(&b, hb);
    make_handle(stale_b, hs);
    snprintf(sa, sizeof sa, "%u", g_seed[A]);
    snprintf(sb, sizeof sb, "%u", g_seed[B]);
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = 0;
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(preload, sizeof preload, shim);
    snprintf(reg, sizeof reg, "VMMSHIM_REGISTRY=%s", g_reg);
    char *argv[] = {exe, "ipc", ha, hb, hs, sa, sb, NULL};
    static char out[8192], err[8192];
    int rc = run_helper(argv, preload, reg, o, out, sizeof out, err, sizeof err);
    CHECK(rc == 0, "ipc helper exited %d\n%s%s", rc, out, err);
    static const struct {
        const char *what;
        long long want;
    } W[] = {
        {"cudaIpcOpenMemHandle is the shim's", 1},
        {"open A", 0},
        {"open B", 0},
        {"B - A", 4096}, /* each at its own offset of one mapping of the chunk */
        {"driver imports for both", 1},
        {"mappings for both", 1},
        {"A's bytes", 1},
        {"B's bytes", 1},
        {"open A again", 0},
        {"open A again: same pointer", 1},
        {"open a stale handle", 1}, /* cudaErrorInvalidValue */
        {"close A", 0},
        {"close A again", 0},
        {"mappings with A closed", 1},
        {"B's bytes with A closed", 1},
        {"close B", 0},
        {"mappings with both closed", 0},
        {"close B once too often", 1},
        {"open B to hold it", 0},
        {"open the new B", 0},
        {"the new B at the old B's pointer", 1},
        {"open the old B again", 0},
        {"mappings for old and new B", 1},
        {"close B's pointer", 0},
        {"close B's pointer again", 0},
        {"close B's pointer a third time", 0},
        {"mappings with every B closed", 0},
        {"close B's pointer once too often", 1},
    };
    for (size_t i = 0; i < sizeof W / sizeof W[0]; i++)
        CHECK(seen(out, W[i].what) == W[i].want, "ipc: %s: want %lld, got %lld\n%s%s", W[i].what, W[i].want,
              seen(out, W[i].what), out, err);
    g_seed[B] = 99;
    CHECK(owner_verify(o, B, 99), "the owner does not see the write through the IPC mapping");
    CHECK(strstr(err, "vmmshim:") == NULL, "the shim printed: %s", err);
}

/* The owner dies while a chunk of it is mapped here: a further import is refused, the mapping
 * stays readable until released. */
static void case_owner_dead(owner *o)
{
    vmm_alloc_info a, b;
    if (!find(o, A, 0, &a) || !find(o, B, 0, &b)) return;
    vmm_imported *ia = NULL, *ib = NULL;
    CHECK_EQ(vmm_import(g_client, &a, &ia), VMM_OK);
    owner_end(o, true);
    vmm_status st = vmm_import(g_client, &b, &ib);
    CHECK(st == VMM_ERR_OWNER_DEAD && ib == NULL, "chunk mapped, owner dead: %d %s", st, vmm_last_error());
    CHECK(ia && pattern_at((const uint8_t *)(uintptr_t)vmm_import_ptr(ia), LAYOUT[A].requested, g_seed[A]),
          "A's bytes after the owner died");
    st = ia ? vmm_import_check(g_client, ia) : VMM_ERR_INVALID;
    CHECK(st == VMM_ERR_OWNER_DEAD, "check after the owner died: %d %s", st, vmm_last_error());
    vmm_import_release(ia);
    st = vmm_import(g_client, &b, &ib);
    CHECK(st == VMM_ERR_OWNER_DEAD && ib == NULL, "nothing mapped, owner dead: %d %s", st, vmm_last_error());
}

int main(int argc, char **argv)
{
    if (argc == 7 && !strcmp(argv[1], "ipc")) return ipc_helper(argv);
    const char *build = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", build && *build ? build : "build");
    snprintf(g_reg, sizeof g_reg, "/vmmshim-tic-%d", (int)getpid());
    snprintf(g_dir, sizeof g_dir, "/tmp/vmmshim-tic-%d", (int)getpid());
    shm_unlink(g_reg);
    if (!load_driver()) {
        printf("skip: test_import_chunks needs the emulated driver (build/fakecuda/libcuda.so.1 on LD_LIBRARY_PATH)\n");
        CHECK_DONE();
    }
    owner o;
    if (!owner_start(&o)) CHECK_DONE();
    CHECK(vmm_open(g_reg, &g_client) == VMM_OK, "open: %s", vmm_last_error());
    if (g_client) {
        case_records(&o);
        (void)vmm_import_drop_idle(); /* each case starts with nothing mapped */
        case_two_in_one_chunk(&o);
        vmm_alloc_info stale_b;
        bool have_b = find(&o, B, 0, &stale_b);
        (void)vmm_import_drop_idle();
        case_stale(&o);
        (void)vmm_import_drop_idle();
        case_idle(&o);
        (void)vmm_import_drop_idle();
        case_size_mismatch(&o);
        (void)vmm_import_drop_idle();
        case_own_chunk(&o);
        (void)vmm_import_drop_idle();
        case_threads(&o);
        (void)vmm_import_drop_idle();
        case_vmmctl(&o);
        (void)vmm_import_drop_idle();
        if (have_b) case_ipc(&o, &stale_b);
        (void)vmm_import_drop_idle();
        case_owner_dead(&o);
        vmm_close(g_client);
    } else {
        owner_end(&o, true);
    }
    char sock[200];
    snprintf(sock, sizeof sock, "%s/%d.sock", g_dir, (int)o.pid);
    unlink(sock);
    rmdir(g_dir);
    shm_unlink(g_reg);
    CHECK_DONE();
}
