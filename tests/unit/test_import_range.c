/* Importing a range of an owner's bytes across several records (vmm_import_range), over the
 * emulated driver.
 *
 * A forked child plays a program that maps device memory itself with the driver's VMM API, as
 * PyTorch's expandable segments do: one 10 MiB reservation with five 2 MiB handles mapped back to
 * back (the fifth published as not exportable), a 4 MiB handle of which only the second half is
 * mapped, a reservation with an unmapped page between two mapped ones, and a 2 MiB chunk holding
 * two pooled allocations side by side plus a record that claims another chunk right after them.
 * It publishes one record per mapping (api cuMemMap) with the registry writer API and serves
 * them with the real broker (broker.c, included as test_broker does), counting requests.  This
 * process imports ranges through the client library and reads the emulated driver's counters:
 * the owner's bytes across page boundaries at one pointer, a chunk offset honoured, one mapping
 * per chunk, handles released once mapped and everything gone at release; a gap, a record that
 * is not exportable, chunks meeting off a granule boundary, a record freed between lookup and
 * import, records of two moments (one beginning inside the one before), and a freed page all refused with the address concerned and nothing left mapped; the
 * owner releasing and unmapping a page while it is imported here; threads; `vmmctl import-test`
 * over several pages; a dead owner. */
#include "../../shim/broker/broker.c" /* test equipment: a real broker in the owner */
#include "../../shim/broker/dir.c"
#include "../../shim/broker/holders.c"
#include "../../shim/broker/control.c"

#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "fakeowner.h"
#include "registry/registry.h"
#include "spawn.h"
#include "vmmshim.h"

#include <cuda.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/wait.h>

#define KiB (1ull << 10)
#define MiB (1ull << 20)
#define PAGE (2 * MiB) /* the emulated driver's granularity, and PyTorch's small page */
#define THREADS 4
#define ROUNDS 20

/* The owner's reservations. */
enum { R_MAIN, R_OFF, R_HOLE, R_POOL, N_REGION };
static const uint64_t REGION_SIZE[N_REGION] = {5 * PAGE, 2 * PAGE, 3 * PAGE, PAGE};

/* Its handles, and where each is mapped (region, offset there, handle offset, length; a length 0:
 * not mapped). */
#define N_HANDLE 10
static const struct {
    uint64_t size;
    int region;
    uint64_t at, offset, len;
} HANDLE[N_HANDLE] = {
    {PAGE, R_MAIN, 0, 0, PAGE},        {PAGE, R_MAIN, PAGE, 0, PAGE},     {PAGE, R_MAIN, 2 * PAGE, 0, PAGE},
    {PAGE, R_MAIN, 3 * PAGE, 0, PAGE}, {PAGE, R_MAIN, 4 * PAGE, 0, PAGE}, {2 * PAGE, R_OFF, 0, 0, 2 * PAGE},
    {PAGE, R_HOLE, 0, 0, PAGE},        {PAGE, R_HOLE, 2 * PAGE, 0, PAGE}, {PAGE, R_POOL, 0, 0, PAGE},
    {PAGE, R_POOL, 0, 0, 0},
};

/* Its records: one per mapping, and three pooled allocations. */
enum { PG1, PG2, PG3, PG4, NX, OFS, H0, H2, P1, P2, P3, N_REC };
static const struct {
    int region;
    uint64_t at, extent;
    int handle;
    uint64_t chunk_offset, chunk_id;
    uint32_t api, kinds;
    const char *name;
} REC[N_REC] = {
    {R_MAIN, 0, PAGE, 0, 0, 1, VMM_FROM_CU_MEM_MAP, VMM_KIND_BROKER, "page 1"},
    {R_MAIN, PAGE, PAGE, 1, 0, 2, VMM_FROM_CU_MEM_MAP, VMM_KIND_BROKER, "page 2"},
    {R_MAIN, 2 * PAGE, PAGE, 2, 0, 3, VMM_FROM_CU_MEM_MAP, VMM_KIND_BROKER, "page 3"},
    {R_MAIN, 3 * PAGE, PAGE, 3, 0, 4, VMM_FROM_CU_MEM_MAP, VMM_KIND_BROKER, "page 4"},
    {R_MAIN, 4 * PAGE, PAGE, 4, 0, 5, VMM_FROM_CU_MEM_MAP, 0, "page 5 (not exportable)"},
    {R_OFF, PAGE, PAGE, 5, PAGE, 6, VMM_FROM_TEST, VMM_KIND_BROKER, "second half of a 4 MiB chunk"},
    {R_HOLE, 0, PAGE, 6, 0, 7, VMM_FROM_CU_MEM_MAP, VMM_KIND_BROKER, "before the hole"},
    {R_HOLE, 2 * PAGE, PAGE, 7, 0, 8, VMM_FROM_CU_MEM_MAP, VMM_KIND_BROKER, "after the hole"},
    {R_POOL, 0, 64 * KiB, 8, 0, 9, VMM_FROM_TEST, VMM_KIND_BROKER, "pooled 1"},
    {R_POOL, 64 * KiB, 64 * KiB, 8, 64 * KiB, 9, VMM_FROM_TEST, VMM_KIND_BROKER, "pooled 2"},
    /* claims offset 0 of another chunk for the bytes right after pooled 2: no mapping can do that */
    {R_POOL, 128 * KiB, 64 * KiB, 9, 0, 10, VMM_FROM_TEST, VMM_KIND_BROKER, "pooled 3, another chunk"},
};

/* The byte at offset k of a region, in the owner; every page and position different. */
static uint8_t pattern(int region, uint64_t k)
{
    return (uint8_t)((unsigned)region * 59u + k * 7u + (k >> 9) * 3u + (k >> 21) * 101u);
}

static uint64_t fnv(const uint8_t *p, uint64_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint64_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static char g_reg[64], g_dir[128], g_build[512];

/* ------------------------------------------------------------------------------------------ */
/* The owner                                                                                   */

typedef struct owner_info {
    int rc; /* 0, or the failing step */
    char err[160];
    int32_t pid;
    uint64_t base[N_REGION];
    uint64_t value;                  /* a command's answer */
    struct fakecuda_counters driver; /* the owner's, after the command */
} owner_info;

typedef struct owner_cmd {
    uint8_t op, i, arg;
    uint64_t a, b;
} owner_cmd;

static pthread_mutex_t o_lock = PTHREAD_MUTEX_INITIALIZER;
static vmm__reg o_reg;
static CUmemGenericAllocationHandle o_handle[N_HANDLE];
static owner_info o_info;
static uint32_t o_slot[N_REC];
static uint64_t o_gen[N_REC];
static uint8_t o_id[N_REC][16];
static uint64_t o_requests; /* broker requests served (any outcome) */
static int o_refuse = -1;   /* a record the broker answers as freed while the registry still shows it */

static int owner_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                        int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total, uint32_t *device)
{
    (void)keys; /* no key: every handle passed each time it is asked for */
    pthread_mutex_lock(&o_lock);
    o_requests++;
    int rc = -ENOENT, h = 0;
    for (int i = 0; i < N_REC; i++)
        if (o_slot[i] == slot) {
            rc = generation == o_gen[i] && !memcmp(alloc_id, o_id[i], 16) && i != o_refuse ? 0 : -ESTALE;
            h = REC[i].handle;
        }
    CUmemGenericAllocationHandle handle = o_handle[h];
    pthread_mutex_unlock(&o_lock);
    if (rc) return rc;
    *n_total = 1; /* one handle per record here */
    if (first != 0 || max == 0) return -ERANGE;
    if (drv.MemExportToShareableHandle(&fds[0], handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS)
        return -EIO;
    sizes[0] = HANDLE[h].size;
    *n_here = 1;
    *device = 0;
    return 0;
}

/* o_lock held.  Bind and publish record i's allocation at offset `at` of its region, `extent`
 * bytes at chunk_offset in its chunk (REC[i]'s own place, or another: 'Y'). */
static int owner_publish(int i, uint64_t at, uint64_t extent, uint64_t chunk_offset)
{
    int rc = vmm__reg_bind(&o_reg, o_info.base[REC[i].region] + at, extent, &o_slot[i]);
    if (rc) return rc;
    vmm_reg_alloc d, pub;
    memset(&d, 0, sizeof d);
    d.api = REC[i].api;
    d.requested_size = extent;
    d.mapped_size = HANDLE[REC[i].handle].size;
    d.chunk_id = REC[i].chunk_id;
    d.chunk_offset = chunk_offset;
    d.handle_kinds = REC[i].kinds;
    d.flags = REC[i].kinds ? 0 : VMM_REG_F_NOT_EXPORTABLE;
    if (REC[i].api == VMM_FROM_TEST) d.flags |= VMM_REG_F_SHARED_CHUNK;
    snprintf(d.tag, sizeof d.tag, "%.31s", REC[i].name);
    if ((rc = vmm__reg_publish(&o_reg, o_slot[i], &d, &pub))) return rc;
    o_gen[i] = pub.generation;
    memcpy(o_id[i], pub.alloc_id, 16);
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
    /* a spare page after each region, so that no other region can follow it in the address space
     * (a range runs on into whatever record comes next) */
    for (int g = 0; g < N_REGION; g++) {
        CUdeviceptr base;
        if ((r = drv.MemAddressReserve(&base, REGION_SIZE[g] + PAGE, PAGE, 0, 0))) OWNER_FAIL(2, "reserve: %d", (int)r);
        o_info.base[g] = base;
    }
    for (int h = 0; h < N_HANDLE; h++) {
        if ((r = drv.MemCreate(&o_handle[h], HANDLE[h].size, &prop, 0))) OWNER_FAIL(3, "cuMemCreate: %d", (int)r);
        if (!HANDLE[h].len) continue;
        CUdeviceptr at = o_info.base[HANDLE[h].region] + HANDLE[h].at;
        if ((r = drv.MemMap(at, HANDLE[h].len, HANDLE[h].offset, o_handle[h], 0))) OWNER_FAIL(4, "cuMemMap: %d", (int)r);
        if ((r = drv.MemSetAccess(at, HANDLE[h].len, &acc, 1))) OWNER_FAIL(5, "cuMemSetAccess: %d", (int)r);
        uint8_t *host = (uint8_t *)(uintptr_t)at; /* emulated device memory is host memory */
        for (uint64_t k = 0; k < HANDLE[h].len; k++) host[k] = pattern(HANDLE[h].region, HANDLE[h].at + k);
    }
    /* The first half of the 4 MiB chunk, which no record names, holds other bytes: an import that
     * ignored the record's chunk_offset would show them. */
    memset((void *)(uintptr_t)(o_info.base[R_OFF]), 0xee, PAGE);

    char err[256] = "";
    int rc = vmm__reg_open(&o_reg, g_reg, VMM__REG_CREATE, 1024, NULL, err, sizeof err);
    if (rc) OWNER_FAIL(7, "registry: %s", err);
    if ((rc = vmm__reg_attach(&o_reg, NULL))) OWNER_FAIL(8, "attach: %d", rc);
    pthread_mutex_lock(&o_lock);
    for (int i = 0; i < N_REC; i++) {
        if ((rc = owner_publish(i, REC[i].at, REC[i].extent, REC[i].chunk_offset)))
            OWNER_FAIL(9, "publish record %d: %d", i, rc);
    }
    pthread_mutex_unlock(&o_lock);
    char sock[112];
    if ((rc = vmm__broker_start(owner_export, sock, sizeof sock))) OWNER_FAIL(11, "broker: %s", strerror(-rc));
    if ((rc = vmm__reg_set_broker(&o_reg, sock))) OWNER_FAIL(12, "set_broker: %d", rc);
    drv.counters(&o_info.driver);
    if (!write_full(rep, &o_info, sizeof o_info)) _exit(1);

    for (;;) {
        owner_cmd c;
        if (!read_command(cmd, &c, sizeof c)) _exit(0);
        int i = c.i < N_REC ? c.i : 0;
        o_info.rc = 0;
        if (c.op == 'N') { /* broker requests so far */
            pthread_mutex_lock(&o_lock);
            o_info.value = o_requests;
            pthread_mutex_unlock(&o_lock);
        } else if (c.op == 'S') { /* the broker answers record i as freed (arg 1), or truthfully again */
            pthread_mutex_lock(&o_lock);
            o_refuse = c.arg ? i : -1;
            pthread_mutex_unlock(&o_lock);
        } else if (c.op == 'F') {
            /* free record i's page as a program does: release the handle while it is still mapped
             * (the mapping keeps the memory), unmap it, and the record goes */
            CUdeviceptr at = o_info.base[REC[i].region] + REC[i].at;
            if ((r = drv.MemRelease(o_handle[REC[i].handle])) || (r = drv.MemUnmap(at, REC[i].extent)))
                o_info.rc = (int)r;
            pthread_mutex_lock(&o_lock);
            if (!o_info.rc) o_info.rc = vmm__reg_retract(&o_reg, o_slot[i]);
            pthread_mutex_unlock(&o_lock);
        } else if (c.op == 'Y') {
            /* record i goes, and comes back a bytes earlier and as many bytes longer, in the same
             * chunk (arg 1), or at its own place again (arg 0): with arg 1 it overlaps the record
             * before it, as a walk reading two moments of a busy owner sees them */
            uint64_t back = c.arg ? c.a : 0;
            pthread_mutex_lock(&o_lock);
            o_info.rc = vmm__reg_retract(&o_reg, o_slot[i]);
            if (!o_info.rc)
                o_info.rc = owner_publish(i, REC[i].at - back, REC[i].extent + back, REC[i].chunk_offset - back);
            pthread_mutex_unlock(&o_lock);
        } else if (c.op == 'H') { /* the fnv of the owner's bytes [a, a + b) */
            o_info.value = fnv((const uint8_t *)(uintptr_t)c.a, c.b);
        } else if (c.op == 'Q') {
            exit(0);
        }
        drv.counters(&o_info.driver);
        (void)write_full(rep, &o_info, sizeof o_info);
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

/* Run a command in the owner; its report (and false when it failed or did not answer). */
static bool owner_do(owner *o, char op, int i, int arg, uint64_t a, uint64_t b, owner_info *out)
{
    owner_cmd c;
    memset(&c, 0, sizeof c);
    c.op = (uint8_t)op;
    c.i = (uint8_t)i;
    c.arg = (uint8_t)arg;
    c.a = a;
    c.b = b;
    owner_info tmp;
    if (!out) out = &tmp;
    return write_full(o->cmd, &c, sizeof c) && read_full(o->rep, out, sizeof *out) && out->rc == 0;
}

static uint64_t broker_requests(owner *o)
{
    owner_info r;
    return owner_do(o, 'N', 0, 0, 0, 0, &r) ? r.value : UINT64_MAX;
}

static void owner_end(owner *o, bool kill_it)
{
    if (kill_it) {
        kill(o->pid, SIGKILL);
    } else {
        owner_cmd c = {.op = 'Q'};
        (void)write_full(o->cmd, &c, sizeof c);
    }
    waitpid(o->pid, NULL, 0);
    close(o->cmd);
    close(o->rep);
}

/* ------------------------------------------------------------------------------------------ */
/* The cases                                                                                   */

static vmm_registry *g_client;
static uint64_t g_base[N_REGION];
static uint32_t g_pid;

static uint64_t rec_addr(int i) { return g_base[REC[i].region] + REC[i].at; }

/* Does p show the owner's bytes [addr, addr + n) of region g? */
static bool bytes_are(const uint8_t *p, int g, uint64_t addr, uint64_t n)
{
    uint64_t k0 = addr - g_base[g];
    for (uint64_t k = 0; k < n; k++)
        if (p[k] != pattern(g, k0 + k)) {
            fprintf(stderr, "byte %llu of the range (0x%llx in the owner): %u, want %u\n", (unsigned long long)k,
                    (unsigned long long)(addr + k), p[k], pattern(g, k0 + k));
            return false;
        }
    return true;
}

static const uint8_t *ptr_of(const vmm_imported *imp) { return (const uint8_t *)(uintptr_t)vmm_import_ptr(imp); }

#define CHECK_SAME_DRIVER_STATE(before, after, what)                                                             \
    CHECK((after).mappings_live == (before).mappings_live &&                                                       \
              (after).reservations_live == (before).reservations_live &&                                           \
              (after).imports_live == (before).imports_live && (after).handles_live == (before).handles_live,      \
          "%s: mappings %llu->%llu reservations %llu->%llu imports %llu->%llu handles %llu->%llu", what,           \
          (before).mappings_live, (after).mappings_live, (before).reservations_live, (after).reservations_live,    \
          (before).imports_live, (after).imports_live, (before).handles_live, (after).handles_live)

/* A refused range: the status, the reason naming `where`, nothing asked of the owner beyond
 * `requests` broker requests, and nothing left mapped. */
static void check_refused(owner *o, uint64_t addr, uint64_t len, vmm_status want, const char *phrase, uint64_t where,
                          uint64_t requests, const char *what)
{
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    vmm_imported *imp = (vmm_imported *)&imp; /* must come back NULL */
    vmm_status st = vmm_import_range(g_client, g_pid, addr, len, &imp);
    char hex[32];
    snprintf(hex, sizeof hex, "0x%llx", (unsigned long long)where);
    CHECK(st == want && imp == NULL, "%s: status %d (want %d), %s", what, st, want, vmm_last_error());
    CHECK(strstr(vmm_last_error(), phrase) && (!where || strstr(vmm_last_error(), hex)) &&
              !strchr(vmm_last_error(), '\n'),
          "%s: the reason should say '%s' and name %s: %s", what, phrase, hex, vmm_last_error());
    CHECK(broker_requests(o) == r0 + requests, "%s: %llu broker requests, want %llu", what,
          (unsigned long long)(broker_requests(o) - r0), (unsigned long long)requests);
    CHECK_SAME_DRIVER_STATE(c0, counters(), what);
}

static void case_records(void)
{
    vmm_alloc_info a;
    vmm_status st = vmm_find(g_client, g_pid, rec_addr(PG3) + 12345, &a);
    CHECK(st == VMM_OK, "find in page 3: %s", vmm_last_error());
    CHECK(a.address == rec_addr(PG3) && a.extent == PAGE && a.mapped_size == PAGE && a.chunk_offset == 0 &&
              a.chunk_id == 3 && a.api == VMM_FROM_CU_MEM_MAP && a.handle_kinds == VMM_KIND_BROKER,
          "page 3's record: address %llx extent %llu mapped %llu chunk %llu+%llu api %u", (unsigned long long)a.address,
          (unsigned long long)a.extent, (unsigned long long)a.mapped_size, (unsigned long long)a.chunk_id,
          (unsigned long long)a.chunk_offset, a.api);
    st = vmm_find(g_client, g_pid, rec_addr(OFS) + PAGE - 1, &a);
    CHECK(st == VMM_OK && a.address == rec_addr(OFS) && a.chunk_offset == PAGE && a.mapped_size == 2 * PAGE,
          "the second half's record: %d chunk_offset %llu mapped %llu", st, (unsigned long long)a.chunk_offset,
          (unsigned long long)a.mapped_size);
}

/* [page 1 + 100, page 3 + 500): three handles at one pointer, the owner's bytes across both
 * boundaries, writes landing in the owner, and nothing left at release. */
static void case_across_pages(owner *o)
{
    uint64_t addr = rec_addr(PG1) + 100, len = 2 * PAGE + 400;
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    vmm_imported *imp = NULL;
    vmm_status st = vmm_import_range(g_client, g_pid, addr, len, &imp);
    CHECK(st == VMM_OK && imp, "range over pages 1-3: %s", vmm_last_error());
    if (st != VMM_OK) return;
    struct fakecuda_counters c1 = counters();
    CHECK_EQ(vmm_import_size(imp), len);
    CHECK_EQ(vmm_import_ptr(imp) % PAGE, 100); /* the first granule is mapped whole */
    CHECK(bytes_are(ptr_of(imp), R_MAIN, addr, len), "the owner's bytes across pages 1-3");
    CHECK_EQ(broker_requests(o), r0 + 3);
    CHECK_EQ(c1.imports, c0.imports + 3);
    CHECK_EQ(c1.calls_cuMemMap, c0.calls_cuMemMap + 3);
    CHECK_EQ(c1.mappings_live, c0.mappings_live + 3);
    CHECK_EQ(c1.reservations_live, c0.reservations_live + 1);
    /* the imported handles are released once mapped; the mappings keep the memory */
    CHECK_EQ(c1.calls_cuMemRelease, c0.calls_cuMemRelease + 3);
    CHECK_EQ(c1.imports_live, c0.imports_live + 3);

    /* a write across the page 1/2 boundary lands in the owner's two handles */
    uint8_t *w = (uint8_t *)(uintptr_t)vmm_import_ptr(imp) + (PAGE - 100 - 1000);
    uint8_t saved[2000];
    memcpy(saved, w, sizeof saved);
    for (int k = 0; k < 2000; k++) w[k] = (uint8_t)(k * 13 + 5);
    owner_info rep;
    CHECK(owner_do(o, 'H', 0, 0, rec_addr(PG2) - 1000, 2000, &rep) && rep.value == fnv(w, 2000),
          "the owner does not see the write across the page boundary");
    memcpy(w, saved, sizeof saved);

    CHECK_EQ(vmm_import_release(imp), VMM_OK);
    struct fakecuda_counters c2 = counters();
    CHECK_SAME_DRIVER_STATE(c0, c2, "range released");
    CHECK_EQ(c2.calls_cuMemMap, c1.calls_cuMemMap);

    /* all four pages, exactly */
    imp = NULL;
    st = vmm_import_range(g_client, g_pid, rec_addr(PG1), 4 * PAGE, &imp);
    CHECK(st == VMM_OK && imp && vmm_import_ptr(imp) % PAGE == 0 && bytes_are(ptr_of(imp), R_MAIN, rec_addr(PG1), 4 * PAGE),
          "pages 1-4: %s", vmm_last_error());
    CHECK_EQ(counters().mappings_live, c0.mappings_live + 4);
    CHECK_EQ(vmm_import_release(imp), VMM_OK);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "pages 1-4 released");
}

/* Inside one record: just the granules needed; alongside a vmm_import of the same chunk, each
 * released on its own. */
static void case_single(owner *o)
{
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    vmm_imported *r = NULL, *whole = NULL;
    uint64_t addr = rec_addr(PG3) + 100;
    vmm_status st = vmm_import_range(g_client, g_pid, addr, 200, &r);
    CHECK(st == VMM_OK && r && bytes_are(ptr_of(r), R_MAIN, addr, 200), "inside page 3: %s", vmm_last_error());
    CHECK_EQ(broker_requests(o), r0 + 1);
    CHECK_EQ(counters().mappings_live, c0.mappings_live + 1);
    vmm_alloc_info a;
    CHECK_EQ(vmm_find(g_client, g_pid, addr, &a), VMM_OK);
    CHECK_EQ(vmm_import(g_client, &a, &whole), VMM_OK);
    if (r && whole) {
        CHECK(vmm_import_ptr(whole) + 100 != vmm_import_ptr(r), "a range import is its own mapping");
        CHECK(memcmp(ptr_of(whole) + 100, ptr_of(r), 200) == 0, "the same bytes both ways");
    }
    CHECK_EQ(vmm_import_release(r), VMM_OK);
    CHECK(whole && bytes_are(ptr_of(whole), R_MAIN, rec_addr(PG3), PAGE), "the chunk import outlives the range");
    CHECK_EQ(vmm_import_release(whole), VMM_OK);
    CHECK_EQ(vmm_import_drop_idle(), VMM_OK); /* the chunk import's mapping stayed, idle */
    CHECK_SAME_DRIVER_STATE(c0, counters(), "range and chunk import released");

    /* a pooled allocation at an offset of its chunk that is no granule boundary */
    r = NULL;
    addr = rec_addr(P2) + 5;
    st = vmm_import_range(g_client, g_pid, addr, 1000, &r);
    CHECK(st == VMM_OK && r && bytes_are(ptr_of(r), R_POOL, addr, 1000), "inside pooled 2: %s", vmm_last_error());
    CHECK_EQ(vmm_import_ptr(r) % PAGE, 64 * KiB + 5);
    vmm_import_release(r);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "pooled range released");
}

/* The second half of a 4 MiB chunk (the driver maps a handle only whole): the record's chunk_offset
 * decides which bytes show. */
static void case_offset(owner *o)
{
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    vmm_imported *r = NULL;
    vmm_status st = vmm_import_range(g_client, g_pid, rec_addr(OFS), PAGE, &r);
    CHECK(st == VMM_OK && r && bytes_are(ptr_of(r), R_OFF, rec_addr(OFS), PAGE), "the second half of a chunk: %s",
          vmm_last_error());
    vmm_import_release(r);
    r = NULL;
    st = vmm_import_range(g_client, g_pid, rec_addr(OFS) + 1000, MiB, &r);
    CHECK(st == VMM_OK && r && bytes_are(ptr_of(r), R_OFF, rec_addr(OFS) + 1000, MiB), "inside it: %s",
          vmm_last_error());
    vmm_import_release(r);
    CHECK_EQ(broker_requests(o), r0 + 2);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "second half released");
}

/* Two pooled allocations side by side in one chunk: one handle, one mapping. */
static void case_merged(owner *o)
{
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    vmm_imported *r = NULL;
    uint64_t addr = rec_addr(P1) + 10, len = 100 * KiB;
    vmm_status st = vmm_import_range(g_client, g_pid, addr, len, &r);
    CHECK(st == VMM_OK && r && bytes_are(ptr_of(r), R_POOL, addr, len), "pooled 1 and 2: %s", vmm_last_error());
    CHECK_EQ(broker_requests(o), r0 + 1);
    CHECK_EQ(counters().calls_cuMemMap, c0.calls_cuMemMap + 1);
    vmm_import_release(r);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "pooled pair released");
}

static void case_refusals(owner *o)
{
    /* a gap: the unmapped, unpublished page between two mapped ones */
    uint64_t hole = g_base[R_HOLE] + PAGE;
    check_refused(o, g_base[R_HOLE] + 100, 5 * MiB, VMM_ERR_NOT_FOUND, "only up to there", hole, 0,
                  "a range over a hole");
    check_refused(o, hole + 1, 100, VMM_ERR_NOT_FOUND, "where the range starts", hole + 1, 0, "a range in the hole");
    /* a record that is not exportable, after three that are: refused before any owner is asked */
    check_refused(o, rec_addr(PG2) + 5, 4 * PAGE, VMM_ERR_ACCESS, "is not exportable", rec_addr(NX), 0,
                  "a range into a record that is not exportable");
    /* pooled 2 (chunk 9) followed by pooled 3, claiming offset 0 of chunk 10: the bytes would have
     * to meet mid-granule */
    check_refused(o, rec_addr(P2) + 100, 64 * KiB, VMM_ERR_INVALID, "cannot be mapped as one", rec_addr(P3), 0,
                  "chunks meeting off a granule boundary");
    /* the same, ending in it */
    check_refused(o, rec_addr(PG4), 2 * PAGE, VMM_ERR_ACCESS, "not exportable", rec_addr(NX), 0,
                  "a range ending in a record that is not exportable");

    /* arguments */
    vmm_imported *r = NULL;
    CHECK_EQ(vmm_import_range(g_client, g_pid, rec_addr(PG1), 0, &r), VMM_ERR_INVALID);
    CHECK(strstr(vmm_last_error(), "length is 0") != NULL, "length 0: %s", vmm_last_error());
    CHECK_EQ(vmm_import_range(g_client, g_pid, UINT64_MAX - 10, 11, &r), VMM_ERR_INVALID);
    CHECK_EQ(vmm_import_range(g_client, 0, rec_addr(PG1), 1, &r), VMM_ERR_INVALID);
    CHECK_EQ(vmm_import_range(NULL, g_pid, rec_addr(PG1), 1, &r), VMM_ERR_INVALID);
    CHECK_EQ(vmm_import_range(g_client, g_pid, rec_addr(PG1), 1, NULL), VMM_ERR_INVALID);
    CHECK(r == NULL, "a refused range left a handle");
}

/* The owner frees page 2 between the lookup and the import (its broker says so while the
 * registry still shows it): stale, naming the page, page 1's handle not leaked. */
static void case_stale(owner *o)
{
    CHECK(owner_do(o, 'S', PG2, 1, 0, 0, NULL), "owner: refuse page 2");
    check_refused(o, rec_addr(PG1) + 100, 2 * PAGE, VMM_ERR_STALE, "was freed", rec_addr(PG2), 2,
                  "a record freed between lookup and import");
    CHECK(owner_do(o, 'S', PG2, 0, 0, 0, NULL), "owner: page 2 again");
}

/* A walk that reads the owner at two moments: pooled 1, then, at its end, a record that begins
 * halfway into it (pooled 2, freed meanwhile and its place reused by an allocation starting
 * earlier).  No moment of the owner shows both: stale, not a layout that cannot be mapped. */
static void case_overlap(owner *o)
{
    CHECK(owner_do(o, 'Y', P2, 1, 32 * KiB, 0, NULL), "owner: pooled 2 from 32 KiB earlier");
    check_refused(o, rec_addr(P1), 128 * KiB, VMM_ERR_STALE, "changed while the range was read", rec_addr(P2), 0,
                  "records of two moments");
    CHECK(owner_do(o, 'Y', P2, 0, 0, 0, NULL), "owner: pooled 2 at its place again");
    case_merged(o);
}

/* Threads importing overlapping ranges at once (each its own reservation and mappings). */
typedef struct {
    pthread_barrier_t *gate;
    int t, failures;
    char why[200];
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    pthread_barrier_wait(w->gate);
    for (int n = 0; n < ROUNDS && !w->failures; n++) {
        uint64_t addr = rec_addr(PG1) + (uint64_t)(w->t * 4096 + n), len = 2 * PAGE + 1 + (uint64_t)n * 777;
        vmm_imported *r = NULL;
        vmm_status st = vmm_import_range(g_client, g_pid, addr, len, &r);
        const uint8_t *p = r ? ptr_of(r) : NULL;
        uint64_t k0 = addr - g_base[R_MAIN], last = len - 1;
        if (st != VMM_OK) {
            snprintf(w->why, sizeof w->why, "round %d: %s", n, vmm_last_error());
            w->failures++;
        } else if (p[0] != pattern(R_MAIN, k0) || p[PAGE] != pattern(R_MAIN, k0 + PAGE) ||
                   p[last] != pattern(R_MAIN, k0 + last)) {
            snprintf(w->why, sizeof w->why, "round %d: wrong bytes", n);
            w->failures++;
        }
        if (vmm_import_release(r) != VMM_OK) {
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
    struct fakecuda_counters c0 = counters();
    uint64_t r0 = broker_requests(o);
    for (int t = 0; t < THREADS; t++) {
        w[t].gate = &gate;
        w[t].t = t;
        pthread_create(&th[t], NULL, work, &w[t]);
    }
    for (int t = 0; t < THREADS; t++) {
        pthread_join(th[t], NULL);
        CHECK(w[t].failures == 0, "thread %d: %s", t, w[t].why);
    }
    pthread_barrier_destroy(&gate);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "after the threads");
    CHECK_EQ(broker_requests(o), r0 + (uint64_t)THREADS * ROUNDS * 3);
}

/* ------------------------------------------------------------------------------------------ */
/* vmmctl                                                                                      */

static int vmmctl(char *out, size_t len, const char *cmd, uint64_t addr, uint64_t n)
{
    char ctl[600], pid_s[16], addr_s[32], len_s[32], err[2048];
    snprintf(ctl, sizeof ctl, "%s/vmmctl", g_build);
    snprintf(pid_s, sizeof pid_s, "%u", g_pid);
    snprintf(addr_s, sizeof addr_s, "0x%llx", (unsigned long long)addr);
    snprintf(len_s, sizeof len_s, "%llu", (unsigned long long)n);
    char *argv[] = {ctl, "--registry", g_reg, (char *)cmd, pid_s, addr_s, n ? len_s : NULL, NULL};
    out[0] = 0;
    int rc = spawn_capture(argv, NULL, out, len, err, sizeof err, 60);
    snprintf(out + strlen(out), len - strlen(out), "%s", err);
    return rc;
}

/* The fnv vmmctl prints for the owner's bytes [addr, addr + n) of region g. */
static uint64_t fnv_of(int g, uint64_t addr, uint64_t n)
{
    uint64_t h = 0xcbf29ce484222325ull, k0 = addr - g_base[g];
    for (uint64_t k = k0; k < k0 + n; k++) h = (h ^ pattern(g, k)) * 0x100000001b3ull;
    return h;
}

static void case_vmmctl(void)
{
    char out[4096], want[64];
    uint64_t addr = rec_addr(PG1) + 100, len = 2 * PAGE + 400;
    int rc = vmmctl(out, sizeof out, "import-test", addr, len);
    snprintf(want, sizeof want, "fnv %016llx", (unsigned long long)fnv_of(R_MAIN, addr, len));
    CHECK(rc == 0 && strstr(out, want) && strstr(out, "a range over 3 allocations") && strstr(out, "4194704 bytes from"),
          "import-test over pages 1-3: want %s: %s", want, out);
    /* within one page: a plain import, as before */
    rc = vmmctl(out, sizeof out, "import-test", addr, 1000);
    snprintf(want, sizeof want, "fnv %016llx", (unsigned long long)fnv_of(R_MAIN, addr, 1000));
    CHECK(rc == 0 && strstr(out, want) && strstr(out, "offset 0 of chunk 1"), "import-test inside page 1: %s", out);
    /* into the hole: the caller's mistake, told before any import */
    rc = vmmctl(out, sizeof out, "import-test", g_base[R_HOLE] + 100, 3 * MiB);
    CHECK(rc == 2 && strstr(out, "runs past the allocation (2097052 bytes"), "import-test into the hole: %d %s", rc, out);
    rc = vmmctl(out, sizeof out, "import-test", addr, 6 * PAGE);
    snprintf(want, sizeof want, "none at 0x%llx", (unsigned long long)(g_base[R_MAIN] + 5 * PAGE));
    CHECK(rc == 2 && strstr(out, "runs past the 5 allocations") && strstr(out, want),
          "import-test past the reservation: %d %s", rc, out);
    /* into the record that is not exportable: the library's reason */
    rc = vmmctl(out, sizeof out, "import-test", addr, 4 * PAGE);
    CHECK(rc == 1 && strstr(out, "vmmctl: error: ") && strstr(out, "is not exportable"),
          "import-test into page 5: %d %s", rc, out);

    char *argv[] = {NULL, "--registry", g_reg, "list", "--pid", NULL, NULL};
    char ctl[600], pid_s[16], err[2048];
    snprintf(ctl, sizeof ctl, "%s/vmmctl", g_build);
    snprintf(pid_s, sizeof pid_s, "%u", g_pid);
    argv[0] = ctl;
    argv[5] = pid_s;
    static char list[16384];
    rc = spawn_capture(argv, NULL, list, sizeof list, err, sizeof err, 60);
    int n = 0;
    for (const char *p = list; (p = strstr(p, " cuMemMap ")); p++) n++;
    CHECK(rc == 0 && n == 7, "vmmctl list names the api of the 7 mappings: %d rows\n%s%s", n, list, err);
}

/* The owner releases page 2's handle while it is still mapped, unmaps it and retracts its record,
 * all while a range import over it is held here: the import still reads it (the memory goes
 * with its last mapping); a new range over the page is refused, naming it. */
static void case_owner_frees(owner *o)
{
    struct fakecuda_counters c0 = counters();
    uint64_t addr = rec_addr(PG1) + PAGE / 2, len = 2 * PAGE;
    vmm_imported *r = NULL;
    vmm_status st = vmm_import_range(g_client, g_pid, addr, len, &r);
    CHECK(st == VMM_OK && r, "range over pages 1-3: %s", vmm_last_error());
    if (!r) return;
    owner_info before = o->info, after;
    CHECK(owner_do(o, 'N', 0, 0, 0, 0, &before), "owner: counters");
    CHECK(owner_do(o, 'F', PG2, 0, 0, 0, &after), "owner: free page 2: %d", after.rc);
    CHECK(after.driver.handles_live == before.driver.handles_live - 1 &&
              after.driver.mappings_live == before.driver.mappings_live - 1,
          "the owner let page 2 go: handles %llu->%llu mappings %llu->%llu", before.driver.handles_live,
          after.driver.handles_live, before.driver.mappings_live, after.driver.mappings_live);
    CHECK(bytes_are(ptr_of(r), R_MAIN, addr, len), "the range after its owner freed page 2");
    check_refused(o, rec_addr(PG1), 3 * PAGE, VMM_ERR_NOT_FOUND, "no live allocation", rec_addr(PG2), 0,
                  "a range over the freed page");
    CHECK_EQ(vmm_import_release(r), VMM_OK);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "range over a freed page released");
    /* pages 3 and 4 are still there */
    r = NULL;
    CHECK(vmm_import_range(g_client, g_pid, rec_addr(PG3), 2 * PAGE, &r) == VMM_OK && r &&
              bytes_are(ptr_of(r), R_MAIN, rec_addr(PG3), 2 * PAGE),
          "pages 3-4 after page 2 went: %s", vmm_last_error());
    vmm_import_release(r);
}

/* The owner dies while a range of it is imported: the import stays readable, a new one is
 * refused. */
static void case_owner_dead(owner *o)
{
    struct fakecuda_counters c0 = counters();
    vmm_imported *r = NULL, *again = NULL;
    CHECK_EQ(vmm_import_range(g_client, g_pid, rec_addr(PG3) + 1, PAGE, &r), VMM_OK);
    owner_end(o, true);
    vmm_status st = vmm_import_range(g_client, g_pid, rec_addr(PG3) + 1, PAGE, &again);
    CHECK(st == VMM_ERR_OWNER_DEAD && again == NULL, "owner dead: %d %s", st, vmm_last_error());
    CHECK(r && bytes_are(ptr_of(r), R_MAIN, rec_addr(PG3) + 1, PAGE), "the range after its owner died");
    CHECK_EQ(vmm_import_release(r), VMM_OK);
    CHECK_SAME_DRIVER_STATE(c0, counters(), "after the owner died");
}

int main(void)
{
    const char *build = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", build && *build ? build : "build");
    snprintf(g_reg, sizeof g_reg, "/vmmshim-tir-%d", (int)getpid());
    snprintf(g_dir, sizeof g_dir, "/tmp/vmmshim-tir-%d", (int)getpid());
    shm_unlink(g_reg);
    if (!load_driver()) {
        printf("skip: test_import_range needs the emulated driver (build/fakecuda/libcuda.so.1 on LD_LIBRARY_PATH)\n");
        CHECK_DONE();
    }
    owner o;
    if (!owner_start(&o)) CHECK_DONE();
    memcpy(g_base, o.info.base, sizeof g_base);
    g_pid = (uint32_t)o.info.pid;
    CHECK(vmm_open(g_reg, &g_client) == VMM_OK, "open: %s", vmm_last_error());
    if (g_client) {
        case_records();
        case_across_pages(&o);
        case_single(&o);
        case_offset(&o);
        case_merged(&o);
        case_refusals(&o);
        case_stale(&o);
        case_overlap(&o);
        case_threads(&o);
        case_vmmctl();
        case_owner_frees(&o);
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
