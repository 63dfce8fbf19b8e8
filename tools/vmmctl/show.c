/* vmmctl show and import-test: one allocation, found by any address inside it, shown in full
 * or imported as a companion would import it.  One family because both start from the same
 * lookup (find_alloc) and speak of one allocation and its chunk. */
#include "vmmshim.h"

#include "callsite.h"

#include "format.h"
#include "vmmctl.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------ */
/* show, import-test                                                                           */

static int find_alloc(int argc, char **argv, const char *cmd, vmm_registry **reg, vmm_alloc_info *a, uint64_t *addr,
                      uint64_t *extra)
{
    int pos = 0;
    const char *args[3] = {0};
    for (int i = 0; i < argc; i++) {
        if (vmm__ctl_take_registry(argc, argv, &i)) continue;
        if (pos == 3) vmm__ctl_usage_error("%s: too many arguments", cmd);
        args[pos++] = argv[i];
    }
    if (pos < 2) vmm__ctl_usage_error("%s needs PID and ADDR", cmd);
    uint32_t pid = vmm__ctl_parse_pid(args[0]);
    *addr = vmm__ctl_parse_addr(args[1]);
    *extra = pos == 3 ? vmm__ctl_parse_addr(args[2]) : 0;
    int rc = vmm__ctl_open_registry(reg, false);
    if (rc) return rc;
    vmm_status st = vmm_find(*reg, pid, *addr, a);
    if (st != VMM_OK) {
        vmm_close(*reg);
        return vmm__ctl_api_error(st);
    }
    return EXIT_OK;
}

typedef struct {
    const vmm_alloc_info *self;
    uint64_t n;
} sharers;

static int count_sharers(void *ctx, const vmm_alloc_info *o)
{
    sharers *s = ctx;
    const vmm_alloc_info *a = s->self;
    if (o->chunk_id == a->chunk_id && o->pid == a->pid && o->owner_start_time == a->owner_start_time &&
        o->owner_pidns == a->owner_pidns && o->slot != a->slot)
        s->n++;
    return 0;
}

int vmm__ctl_cmd_show(int argc, char **argv)
{
    vmm_registry *reg;
    vmm_alloc_info a;
    uint64_t addr;
    uint64_t extra;
    int rc = find_alloc(argc, argv, "show", &reg, &a, &addr, &extra);
    if (rc) return rc;
    char id[33], uuid[33], kinds[64];
    hbuf h1, h2;
    vmm__ctl_hex(a.alloc_id, 16, id);
    vmm__ctl_hex(a.device_uuid, 16, uuid);
    printf("allocation   %s (slot %llu, generation %llu)\n", id, (unsigned long long)a.slot, (unsigned long long)a.generation);
    printf("owner        pid %u, %s, start time %llu, pid namespace %llu\n", a.pid,
           vmm__ctl_owner_name(a.owner_alive, false),
           (unsigned long long)a.owner_start_time, (unsigned long long)a.owner_pidns);
    printf("device       %u (uuid %s)\n", a.device, uuid);
    printf("address      0x%llx (offset %llu of the given address)\n", (unsigned long long)a.address,
           (unsigned long long)(addr - a.address));
    printf("size         %s requested, extent %s\n", vmm__ctl_human(a.requested_size, &h1),
           vmm__ctl_human(vmm__ctl_held_bytes(&a), &h2));
    if (a.chunk_id) {
        /* the others in the chunk: a walk of the registry, which is fine for a tool */
        sharers sh = {.self = &a};
        vmm_foreach_alloc(reg, count_sharers, &sh);
        printf("chunk        id %llu at 0x%llx, offset %llu (0x%llx), chunk size %s\n", (unsigned long long)a.chunk_id,
               (unsigned long long)(a.address - a.chunk_offset), (unsigned long long)a.chunk_offset,
               (unsigned long long)a.chunk_offset, vmm__ctl_human(a.mapped_size, &h1));
        if (sh.n)
            printf("sharing      shares its chunk with %llu other live allocation%s\n", (unsigned long long)sh.n,
                   sh.n == 1 ? "" : "s");
        else
            printf("sharing      alone in its chunk%s\n",
                   a.flags & VMM_ALLOC_SHARED_CHUNK ? " (others may join it)" : "");
    } else {
        printf("chunk        its own, chunk size %s\n", vmm__ctl_human(a.mapped_size, &h1));
    }
    if (a.flags & VMM_ALLOC_MULTI_HANDLE)
        printf("handles      %u, back to back from the chunk's base (chunk id names the first); the owner's broker "
               "hands them out (protocol v2)\n", a.n_handles);
    else
        printf("handles      1\n");
    printf("made by      %s", vmm__ctl_api_name(a.api));
    if (a.stream) printf(" on stream 0x%llx", (unsigned long long)a.stream);
    printf("\nexport       %s", vmm__ctl_kinds_text(a.handle_kinds, kinds, sizeof kinds));
    if (a.exported_fd >= 0) printf(" (fd %d in the owner)", a.exported_fd);
    printf("\ncreated      %llu s ago\n", (unsigned long long)vmm__ctl_age_s(a.created_ns, vmm__ctl_now_ns()));
    printf("tag          %s\n", a.tag[0] ? a.tag : "-");
    vmm_registry_info info;
    if (a.n_frames && vmm_registry_describe(reg, &info) == VMM_OK) vmm__callsites_print(info.name, &a);
    vmm_close(reg);
    return EXIT_OK;
}

typedef int (*dtoh_fn)(void *, unsigned long long, size_t);

/* FNV-1a of len bytes at the device pointer ptr, copied out with the driver (the client library
 * opened libcuda.so.1 already; vmmctl links none).  0, else the CUDA error, or -1. */
static int checksum(uint64_t ptr, uint64_t len, uint64_t *fnv)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), *sym = h ? dlsym(h, "cuMemcpyDtoH_v2") : NULL;
    dtoh_fn dtoh;
    memcpy(&dtoh, &sym, sizeof sym);
    size_t chunk = 64u << 20;
    unsigned char *buf = malloc(chunk);
    *fnv = VMM__FNV_BASIS;
    int copy_rc = dtoh && buf ? 0 : -1;
    for (uint64_t done = 0; copy_rc == 0 && done < len; done += chunk) {
        size_t n = len - done < chunk ? (size_t)(len - done) : chunk;
        copy_rc = dtoh(buf, ptr + done, n);
        if (copy_rc == 0) *fnv = vmm__ctl_fnv1a(*fnv, buf, n);
    }
    free(buf);
    return copy_rc;
}

static double ms_between(const struct timespec *a, const struct timespec *b)
{
    return (double)(b->tv_sec - a->tv_sec) * 1e3 + (double)(b->tv_nsec - a->tv_nsec) / 1e6;
}

/* The bytes from addr (at most want) that live allocations of pid cover one after another,
 * and how many allocations that takes. */
static uint64_t covered(vmm_registry *reg, uint32_t pid, uint64_t addr, uint64_t want, unsigned *n)
{
    vmm_alloc_info r;
    uint64_t at = addr;
    *n = 0;
    while (at - addr < want && vmm_find(reg, pid, at, &r) == VMM_OK && r.address + vmm__ctl_held_bytes(&r) > at) {
        at = r.address + vmm__ctl_held_bytes(&r);
        ++*n;
    }
    return at - addr < want ? at - addr : want;
}

/* LEN runs past the allocation at ADDR: import the bytes as one range across the allocations
 * that follow it, as a companion reading a buffer the program mapped page by page does. */
static int import_test_range(vmm_registry *reg, const vmm_alloc_info *a, uint64_t addr, uint64_t len)
{
    /* a LEN past what is there is the caller's mistake, told before any import */
    unsigned n;
    uint64_t have = covered(reg, a->pid, addr, len, &n);
    if (have < len && n <= 1)
        vmm__ctl_usage_error("import-test: LEN runs past the allocation (%llu bytes from ADDR at most)",
                             (unsigned long long)have);
    if (have < len)
        vmm__ctl_usage_error("import-test: LEN runs past the %u allocations that follow each other from ADDR "
                             "(%llu bytes from ADDR at most; none at 0x%llx)",
                             n, (unsigned long long)have, (unsigned long long)(addr + have));
    struct timespec t0, t1, t2;
    vmm_imported *imp = NULL;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    vmm_status st = vmm_import_range(reg, a->pid, addr, len, &imp);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (st == VMM_OK) { /* the first import also starts CUDA in this process: time a second one */
        vmm_import_release(imp);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        st = vmm_import_range(reg, a->pid, addr, len, &imp);
    }
    clock_gettime(CLOCK_MONOTONIC, &t2);
    if (st != VMM_OK) {
        vmm_close(reg);
        return vmm__ctl_api_error(st);
    }
    uint64_t fnv;
    int copy_rc = checksum(vmm_import_ptr(imp), len, &fnv);
    vmm_import_release(imp);
    vmm_close(reg);
    if (copy_rc) return vmm__ctl_error("could not copy the imported bytes (CUDA error %d)", copy_rc);
    printf("imported pid %u 0x%llx (a range over %u allocations) in %.0f us (first import, with CUDA start-up: "
           "%.1f ms); %llu bytes from 0x%llx: fnv %016llx\n",
           a->pid, (unsigned long long)addr, n, ms_between(&t1, &t2) * 1e3, ms_between(&t0, &t1),
           (unsigned long long)len, (unsigned long long)addr, (unsigned long long)fnv);
    return EXIT_OK;
}

#define IMPORT_ROUNDS 1000

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

/* IMPORT_ROUNDS imports of a in a row, each released before the next: `fresh`, each after
 * vmm_import_drop_idle (a first import every time), else from the mapped chunk. */
static int import_rounds(vmm_registry *reg, const vmm_alloc_info *a, bool fresh)
{
    static uint64_t ns[IMPORT_ROUNDS];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < IMPORT_ROUNDS; i++) {
        if (fresh) vmm_import_drop_idle();
        vmm_imported *imp = NULL;
        vmm_status st = vmm_import(reg, a, &imp);
        vmm_import_timing t;
        vmm_import_last_timing(&t);
        ns[i] = t.total_ns;
        vmm_import_release(imp);
        if (st != VMM_OK) return vmm__ctl_api_error(st);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    qsort(ns, IMPORT_ROUNDS, sizeof ns[0], cmp_u64);
    double wall = ms_between(&t0, &t1) / 1e3;
    printf("%d %s imports in a row: median %.1f us, p90 %.1f us, min %.1f us, max %.1f us; %.0f imports/s "
           "(with the releases%s)\n",
           IMPORT_ROUNDS, fresh ? "first" : "repeat", ns[IMPORT_ROUNDS / 2] / 1e3, ns[IMPORT_ROUNDS * 9 / 10] / 1e3,
           ns[0] / 1e3, ns[IMPORT_ROUNDS - 1] / 1e3, IMPORT_ROUNDS / wall, fresh ? " and unmaps" : "");
    return EXIT_OK;
}

int vmm__ctl_cmd_import_test(int argc, char **argv)
{
    vmm_registry *reg;
    vmm_alloc_info a;
    uint64_t addr;
    uint64_t len_arg;
    int rc = find_alloc(argc, argv, "import-test", &reg, &a, &addr, &len_arg);
    if (rc) return rc;
    /* By default the allocation's bytes, never the rest of its chunk: to the end of what was
     * requested, or of its extent when ADDR lies in the padding past that.  A LEN past its
     * extent goes on into the allocations after it. */
    uint64_t off = addr - a.address, end = off < a.requested_size ? a.requested_size : vmm__ctl_held_bytes(&a);
    if (len_arg > vmm__ctl_held_bytes(&a) - off) return import_test_range(reg, &a, addr, len_arg);
    uint64_t len = len_arg ? len_arg : end - off;
    /* The first import also starts CUDA (and opens the broker connection) in this process: then
     * time a first import on its own (the idle mapping dropped, so the chunk is imported again,
     * on the kept connection), one while that holds the chunk (served by this process's chunk
     * cache), and IMPORT_ROUNDS of each in a row. */
    struct timespec t0, t1;
    vmm_imported *imp = NULL, *again = NULL;
    vmm_import_timing startup, first, repeat;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    vmm_status st = vmm_import(reg, &a, &imp);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    vmm_import_last_timing(&startup);
    if (st == VMM_OK) {
        vmm_import_release(imp);
        vmm_import_drop_idle();
        st = vmm_import(reg, &a, &imp);
    }
    vmm_import_last_timing(&first);
    if (st == VMM_OK) st = vmm_import(reg, &a, &again);
    vmm_import_last_timing(&repeat);
    if (st == VMM_OK && vmm_import_ptr(again) != vmm_import_ptr(imp)) {
        vmm_import_release(again);
        vmm_import_release(imp);
        vmm_close(reg);
        return vmm__ctl_error("a second import of pid %u 0x%llx landed elsewhere", a.pid,
                              (unsigned long long)a.address);
    }
    vmm_import_release(again);
    if (st != VMM_OK) {
        vmm_import_release(imp);
        vmm_close(reg);
        return vmm__ctl_api_error(st);
    }
    uint64_t fnv;
    int copy_rc = checksum(vmm_import_ptr(imp) + off, len, &fnv);
    vmm_import_release(imp);
    if (copy_rc) {
        vmm_close(reg);
        return vmm__ctl_error("could not copy the imported bytes (CUDA error %d)", copy_rc);
    }
    char where[64] = "its own chunk";
    if (a.chunk_id) snprintf(where, sizeof where, "offset %llu of chunk %llu", (unsigned long long)a.chunk_offset,
                             (unsigned long long)a.chunk_id);
    printf("imported pid %u 0x%llx (%s, %llu bytes mapped) in %.0f us (first import, with CUDA start-up: %.1f ms; "
           "again while mapped: %.1f us); %llu bytes from 0x%llx: fnv %016llx\n",
           a.pid, (unsigned long long)a.address, where, (unsigned long long)a.mapped_size, first.total_ns / 1e3,
           ms_between(&t0, &t1), repeat.total_ns / 1e3, (unsigned long long)len, (unsigned long long)addr,
           (unsigned long long)fnv);
    printf("first import, step by step (us): context %.1f, chunk table %.1f, broker connect %.1f (the start-up "
           "import's: it stays open), request and reply %.1f (of which the owner's export %.1f), "
           "cuMemImportFromShareableHandle %.1f, cuMemAddressReserve %.1f, cuMemMap %.1f, cuMemSetAccess %.1f; via %s\n",
           first.context_ns / 1e3, first.lookup_ns / 1e3, startup.connect_ns / 1e3, first.request_ns / 1e3,
           first.export_ns / 1e3, first.import_ns / 1e3, first.reserve_ns / 1e3, first.map_ns / 1e3,
           first.access_ns / 1e3, first.route == VMM_KIND_PIDFD ? "pidfd_getfd" : "the broker");
    printf("repeat import, step by step (us): context %.1f, chunk table and record check %.1f\n",
           repeat.context_ns / 1e3, repeat.lookup_ns / 1e3);
    rc = import_rounds(reg, &a, true);
    if (rc == EXIT_OK) rc = import_rounds(reg, &a, false);
    vmm_close(reg);
    return rc;
}
