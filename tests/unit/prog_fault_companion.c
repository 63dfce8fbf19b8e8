/* The companion of test_faults: imports an owner's allocations through the public API while the
 * owner waits at a checkpoint, and says for each what it got.
 *
 *   prog_fault_companion <registry> <pid> <address>:<size>:<sum>...
 *
 * Each allocation is imported twice (the second time from the chunk already mapped here), then
 * as a range of its own bytes (vmm_import_range), its bytes checked each time against the
 * owner's checksum (0: unknown, not checked), and released; then all of them at once with
 * vmm_import_many (each whole, and a piece of each), once with one thread and, after every idle
 * chunk is unmapped, once with VMMSHIM_IMPORT_THREADS=3; at the end every idle chunk is
 * unmapped, so the driver holds nothing of the owner at exit.  One line per import:
 * "import <i> ok", "import <i> bytes differ", or "import <i> error <status> <reason>" ("range"
 * for the range import, "many <threads>" for vmm_import_many),
 * and "release error ..." or "drop error ..." when those fail.  Exit 0, or 1 when an import
 * broke the API's promise (a handle with an error, none with success), 64 on bad arguments. */
#include "vmmshim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* tests/progs/lifecycle.c's checksum: FNV-1a over 64-bit words. */
static uint64_t sum_of(const uint64_t *w, uint64_t bytes)
{
    uint64_t f = 0xcbf29ce484222325ull;
    for (uint64_t k = 0; k < bytes / 8; k++) f = (f ^ w[k]) * 0x100000001b3ull;
    return f;
}

/* vmm_import (range 0) or vmm_import_range of the allocation at address. */
static int import_once(vmm_registry *reg, uint32_t pid, int i, uint64_t address, uint64_t size, uint64_t sum, int range)
{
    const char *what = range ? "range" : "import";
    vmm_alloc_info a;
    vmm_imported *imp = NULL;
    vmm_status st = range ? vmm_import_range(reg, pid, address, size, &imp) : vmm_find(reg, pid, address, &a);
    if (st == VMM_OK && !range) st = vmm_import(reg, &a, &imp);
    if (st != VMM_OK) {
        printf("%s %d error %d %s\n", what, i, (int)st, vmm_last_error());
        return imp != NULL;
    }
    if (!imp) return 1;
    /* with the emulated driver, device pointers are host addresses */
    const uint64_t *p = (const uint64_t *)(uintptr_t)vmm_import_ptr(imp);
    int same = vmm_import_size(imp) == size && (!sum || sum_of(p, size) == sum);
    printf("%s %d %s\n", what, i, same ? "ok" : "bytes differ");
    if ((st = vmm_import_release(imp)) != VMM_OK) printf("release error %d %s\n", (int)st, vmm_last_error());
    return 0;
}

/* Every allocation whole and its second half (from the 8-byte word nearest the middle), in one
 * vmm_import_many; 1 when it broke the API's promise (a NULL with success, a non-NULL with an error). */
static int import_many(vmm_registry *reg, uint32_t pid, int n, const uint64_t *address, const uint64_t *size,
                       const uint64_t *sum, const char *threads)
{
    enum { MAX = 64 };
    uint64_t a[2 * MAX], z[2 * MAX];
    vmm_imported *out[2 * MAX];
    if (n > MAX) n = MAX;
    for (int i = 0; i < n; i++) {
        uint64_t half = size[i] / 16 * 8;
        a[2 * i] = address[i];
        z[2 * i] = size[i];
        a[2 * i + 1] = address[i] + half;
        z[2 * i + 1] = size[i] - half;
    }
    setenv("VMMSHIM_IMPORT_THREADS", threads, 1);
    vmm_status st = vmm_import_many(reg, pid, a, z, (size_t)(2 * n), out);
    unsetenv("VMMSHIM_IMPORT_THREADS");
    int broken = 0;
    if (st != VMM_OK) {
        printf("many %s error %d %s\n", threads, (int)st, vmm_last_error());
        for (int i = 0; i < 2 * n; i++) broken |= out[i] != NULL;
        return broken;
    }
    int same = 1;
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < 2; k++) broken |= out[2 * i + k] == NULL;
        if (broken) break;
        const uint64_t *p = (const uint64_t *)(uintptr_t)vmm_import_ptr(out[2 * i]);
        const uint64_t *q = (const uint64_t *)(uintptr_t)vmm_import_ptr(out[2 * i + 1]);
        same &= vmm_import_size(out[2 * i]) == size[i] && (!sum[i] || sum_of(p, size[i]) == sum[i]);
        same &= q == p + size[i] / 16 && vmm_import_size(out[2 * i + 1]) == z[2 * i + 1];
    }
    printf("many %s %s\n", threads, broken ? "broken" : same ? "ok" : "bytes differ");
    for (int i = 0; i < 2 * n; i++)
        if ((st = vmm_import_release(out[i])) != VMM_OK) printf("release error %d %s\n", (int)st, vmm_last_error());
    return broken;
}

int main(int argc, char **argv)
{
    if (argc < 3) return 64;
    vmm_registry *reg = NULL;
    if (vmm_open(argv[1], &reg) != VMM_OK) {
        printf("open error %s\n", vmm_last_error());
        return 1;
    }
    uint32_t pid = (uint32_t)strtoul(argv[2], NULL, 0);
    int broken = 0, n = 0;
    uint64_t addr[64], len[64], sums[64];
    for (int i = 3; i < argc; i++) {
        unsigned long long address, size, sum;
        if (sscanf(argv[i], "%llx:%llu:%llx", &address, &size, &sum) != 3) return 64;
        for (int twice = 0; twice < 2; twice++) broken |= import_once(reg, pid, i - 3, address, size, sum, 0);
        broken |= import_once(reg, pid, i - 3, address, size, sum, 1);
        if (n < 64) {
            addr[n] = address;
            len[n] = size;
            sums[n++] = sum;
        }
    }
    vmm_status st = vmm_import_drop_idle();
    if (st != VMM_OK) printf("drop error %d %s\n", (int)st, vmm_last_error());
    if (n) {
        broken |= import_many(reg, pid, n, addr, len, sums, "1");
        if ((st = vmm_import_drop_idle()) != VMM_OK) printf("drop error %d %s\n", (int)st, vmm_last_error());
        broken |= import_many(reg, pid, n, addr, len, sums, "3");
    }
    if ((st = vmm_import_drop_idle()) != VMM_OK) printf("drop error %d %s\n", (int)st, vmm_last_error());
    vmm_close(reg);
    fflush(stdout);
    return broken;
}
