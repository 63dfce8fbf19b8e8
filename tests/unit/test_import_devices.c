/* Which devices an import is granted to, over the emulated driver with two devices.
 *
 * The owner is tests/progs/spans under the shim (spansowner.h): an 8 MiB cudaMalloc on device 1
 * (X1) and, on device 0, an allocation across two freed segments (M0, a MULTI-HANDLE record).
 * This process imports them from threads in different states, each a fresh thread: with device
 * 1's or device 0's primary context current, or with no context at all.  A mapping must be
 * granted read-write (cuMemGetAccess) to the device the memory lies on (found by the record's
 * UUID) and to the importing thread's device when that one can access it as a peer
 * (cuDeviceCanAccessPeer), in one cuMemSetAccess; to nothing else; and vmm_import_device names
 * the thread's device when it had a context of its own, else the memory's.  When the thread's
 * device cannot reach the memory (cuDeviceCanAccessPeer fails here), only the memory's device is
 * granted and named; an import from a further device of a mapped chunk grants that device too.
 * vmm_import_range and vmm_import_many follow the same rule.  Every byte reads right. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define SEG (20 * MIB)

static fakecuda_counters_fn g_counters;
static fakecuda_fail_next_fn g_fail_next;
static CUresult (*p_retain)(CUcontext *, CUdevice);
static CUresult (*p_set_current)(CUcontext);
static CUresult (*p_get_access)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
static vmm_registry *g_r;

static unsigned long long set_access_calls(void)
{
    struct fakecuda_counters c;
    memset(&c, 0, sizeof c);
    if (g_counters) g_counters(&c);
    return c.calls_cuMemSetAccess;
}

/* The access flags device dev has on ptr here, or 99 when the driver says nothing. */
static unsigned long long access_of(uint64_t ptr, int dev)
{
    CUmemLocation loc;
    memset(&loc, 0, sizeof loc);
    loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
    loc.id = dev;
    unsigned long long f = 99;
    if (!p_get_access || p_get_access(&f, &loc, (CUdeviceptr)ptr) != CUDA_SUCCESS) return 99;
    return f;
}

static long long first_wrong(uint64_t p, uint64_t bytes, uint64_t seed)
{
    const volatile uint64_t *w = (const volatile uint64_t *)(uintptr_t)p;
    for (uint64_t k = 0; k < bytes / 8; k++)
        if (w[k] != word(seed, k)) return (long long)k;
    return -1;
}

/* ---- one case, on a fresh thread -------------------------------------------------------- */

typedef enum { WHOLE, RANGE, MANY } how;

typedef struct {
    const char *what;
    int ctx_dev;                /* the primary context made current first; -1: none */
    how how;
    const vmm_alloc_info *a[2]; /* MANY: both, else a[0] */
    uint64_t seed[2];
    int want_device;            /* vmm_import_device of each import */
    unsigned want_access[2];    /* per import, bit d: device d must have read-write access, the others none */
    int want_set_access;        /* cuMemSetAccess calls the import makes (-1: not checked) */
} kase;

static void check_one(const kase *k, vmm_imported *imp, const vmm_alloc_info *a, uint64_t seed, unsigned want_access)
{
    uint64_t p = vmm_import_ptr(imp);
    CHECK(vmm_import_device(imp) == k->want_device, "%s: vmm_import_device %d, want %d", k->what,
          vmm_import_device(imp), k->want_device);
    for (int d = 0; d < 2; d++) {
        unsigned long long want = (want_access >> d) & 1 ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : 0;
        unsigned long long got = access_of(p, d);
        CHECK(got == want, "%s: device %d has access flags %llu, want %llu", k->what, d, got, want);
    }
    long long bad = first_wrong(p, a->requested_size, seed);
    CHECK(bad < 0, "%s: word %lld reads wrong", k->what, bad);
    unsigned char b[16];
    CHECK(vmm_import_read(imp, 0, b, sizeof b) == VMM_OK, "%s: vmm_import_read: %s", k->what, vmm_last_error());
}

static void *run_case(void *arg)
{
    const kase *k = arg;
    if (k->ctx_dev >= 0) {
        CUcontext ctx = NULL;
        CHECK(p_retain(&ctx, k->ctx_dev) == CUDA_SUCCESS && p_set_current(ctx) == CUDA_SUCCESS,
              "%s: cannot make device %d's primary context current", k->what, k->ctx_dev);
    }
    unsigned long long calls0 = set_access_calls();
    vmm_imported *imp[2] = {NULL, NULL};
    vmm_status st;
    int n = k->how == MANY ? 2 : 1;
    if (k->how == WHOLE) {
        st = vmm_import(g_r, k->a[0], &imp[0]);
    } else if (k->how == RANGE) {
        st = vmm_import_range(g_r, k->a[0]->pid, k->a[0]->address, k->a[0]->requested_size, &imp[0]);
    } else {
        uint64_t addr[2] = {k->a[0]->address, k->a[1]->address};
        st = vmm_import_many(g_r, k->a[0]->pid, addr, NULL, 2, imp);
    }
    CHECK(st == VMM_OK, "%s: %s", k->what, vmm_last_error());
    if (st == VMM_OK) {
        if (k->want_set_access >= 0)
            CHECK((int)(set_access_calls() - calls0) == k->want_set_access, "%s: %llu cuMemSetAccess calls, want %d",
                  k->what, set_access_calls() - calls0, k->want_set_access);
        for (int i = 0; i < n; i++) check_one(k, imp[i], k->a[i], k->seed[i], k->want_access[i]);
    }
    for (int i = 0; i < n; i++) vmm_import_release(imp[i]);
    return NULL;
}

static void on_thread(kase k)
{
    pthread_t t;
    if (pthread_create(&t, NULL, run_case, &k) != 0) {
        CHECK(0, "%s: pthread_create", k.what);
        return;
    }
    pthread_join(t, NULL);
}

static void drop_all(void) { CHECK(vmm_import_drop_idle() == VMM_OK, "drop_idle: %s", vmm_last_error()); }

int main(void)
{
    spans_setup("devices");
    setenv("FAKECUDA_DEVICES", "2", 1); /* here and in the owner: read when the driver loads */
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *fn = drv ? dlsym(drv, "fakecuda_counters") : NULL;
    memcpy(&g_counters, &fn, sizeof fn);
    fn = drv ? dlsym(drv, "fakecuda_fail_next") : NULL;
    memcpy(&g_fail_next, &fn, sizeof fn);
    fn = drv ? dlsym(drv, "cuDevicePrimaryCtxRetain") : NULL;
    memcpy(&p_retain, &fn, sizeof fn);
    fn = drv ? dlsym(drv, "cuCtxSetCurrent") : NULL;
    memcpy(&p_set_current, &fn, sizeof fn);
    fn = drv ? dlsym(drv, "cuMemGetAccess") : NULL;
    memcpy(&p_get_access, &fn, sizeof fn);
    if (!g_counters || !g_fail_next || !p_retain || !p_set_current || !p_get_access) {
        CHECK(0, "the emulated driver is not on LD_LIBRARY_PATH");
        CHECK_DONE();
    }
    CUresult (*init)(unsigned) = NULL;
    fn = dlsym(drv, "cuInit");
    memcpy(&init, &fn, sizeof fn);
    CHECK(init && init(0) == CUDA_SUCCESS, "cuInit");

    CHECK(spans_start(), "cannot start the owner");
    uint64_t x1 = 0, m0 = 0, u0 = 0, u1 = 0;
    int xi = -1, mi = -1, f0 = -1, f1 = -1;
    bool made = owner_cmd(NULL, "d 1") && (xi = owner_alloc_with('a', 8 * MIB, &x1)) >= 0 &&
                owner_cmd(NULL, "w %d 31", xi) && owner_cmd(NULL, "d 0") &&
                (f0 = owner_alloc_with('a', SEG, &u0)) >= 0 && (f1 = owner_alloc_with('a', SEG, &u1)) >= 0 &&
                owner_cmd(NULL, "f %d", f0) && owner_cmd(NULL, "f %d", f1) &&
                (mi = owner_alloc_with('a', 2 * SEG, &m0)) >= 0 && owner_cmd(NULL, "w %d 32", mi);
    CHECK(made, "the owner could not make its allocations");
    CHECK(vmm_open(g_reg, &g_r) == VMM_OK, "vmm_open: %s", vmm_last_error());
    vmm_alloc_info ax, am;
    memset(&ax, 0, sizeof ax);
    memset(&am, 0, sizeof am);
    if (made && g_r && vmm_find(g_r, (uint32_t)g_pid, x1, &ax) == VMM_OK &&
        vmm_find(g_r, (uint32_t)g_pid, m0, &am) == VMM_OK) {
        CHECK(ax.device == 1 && ax.device_uuid[15] == 1, "X1: device %u, uuid ends %u", ax.device, ax.device_uuid[15]);
        CHECK(am.device == 0 && (am.flags & VMM_ALLOC_MULTI_HANDLE) && am.n_handles >= 2,
              "M0: device %u, flags 0x%x, %u handles (not the layout this test needs)", am.device, am.flags,
              am.n_handles);
        printf("stat: X1 %llu MiB on device %u; M0 %llu MiB on device %u over %u handles\n",
               (unsigned long long)(ax.requested_size / MIB), ax.device,
               (unsigned long long)(am.requested_size / MIB), am.device, am.n_handles);

        /* GPU 1's thread takes GPU 0's multi-handle allocation: both devices, one call */
        on_thread((kase){"device 1 imports M0", 1, WHOLE, {&am}, {32}, 1, {3}, 1});
        drop_all();
        /* no context: device 0's primary one is made current, as before; the import is the
         * memory's device's (1), and device 0 may use it too (peer) */
        on_thread((kase){"no context imports X1", -1, WHOLE, {&ax}, {31}, 1, {3}, 1});
        /* X1's chunk stays mapped (idle): device 0's thread finds it and has access already */
        on_thread((kase){"device 0 imports X1, mapped already", 0, WHOLE, {&ax}, {31}, 0, {3}, 0});
        drop_all();
        /* the memory's own device alone: nothing else is granted */
        on_thread((kase){"device 0 imports M0", 0, WHOLE, {&am}, {32}, 0, {1}, 1});
        /* mapped already, for device 0 only: device 1's thread adds itself */
        on_thread((kase){"device 1 imports M0, mapped for device 0", 1, WHOLE, {&am}, {32}, 1, {3}, 1});
        drop_all();
        /* device 1 cannot reach device 0's memory: granted to device 0 alone, reported so */
        g_fail_next("cuDeviceCanAccessPeer", 1000, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
        on_thread((kase){"device 1 imports M0, no peer access", 1, WHOLE, {&am}, {32}, 0, {1}, 1});
        on_thread((kase){"device 1 imports M0 again, no peer access", 1, WHOLE, {&am}, {32}, 0, {1}, 0});
        g_fail_next("cuDeviceCanAccessPeer", 0, 0);
        /* peer access again: the mapped chunk gets device 1 too */
        on_thread((kase){"device 1 imports M0 again, peer access", 1, WHOLE, {&am}, {32}, 1, {3}, 1});
        drop_all();
        on_thread((kase){"device 0 imports X1 as a range", 0, RANGE, {&ax}, {31}, 0, {3}, 1});
        on_thread((kase){"device 1 imports X1 as a range", 1, RANGE, {&ax}, {31}, 1, {2}, 1});
        on_thread((kase){"device 1 imports X1 and M0 at once", 1, MANY, {&ax, &am}, {31, 32}, 1, {2, 3}, -1});
        drop_all();
    }
    struct fakecuda_counters c;
    memset(&c, 0, sizeof c);
    g_counters(&c);
    CHECK(c.fds_open == 0, "%llu fds on imported memory left open", c.fds_open);
    int wst = spans_quit();
    CHECK(wst == 0, "the owner ended with status 0x%x", wst);
    if (g_r) vmm_close(g_r);
    shm_unlink(g_reg);
    CHECK_DONE();
}
