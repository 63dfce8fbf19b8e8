/* A companion process for test_broker: uses only the public API (vmmshim.h).
 *
 *   prog_broker_companion import <registry> <pid> <address> <seed> <seed2>
 *       find the allocation containing address, import it, check every byte of the requested
 *       size against pattern(seed), write pattern(seed2), release.  Exit 0 when all held.
 *   prog_broker_companion try <registry> <pid> <address> [generation]
 *       import (with the generation replaced, when given) and exit with the vmm_status.
 *   prog_broker_companion fd <registry> <pid> <address>
 *       vmm_import_fd only; exit with the vmm_status (60: the fd was not close-on-exec).
 *   prog_broker_companion hold <registry> <pid> <address> <seed> <seed3>
 *       import, check pattern(seed), print "ready", wait for a byte on stdin (meanwhile the
 *       test kills the owner), check pattern(seed) again, write and check pattern(seed3).
 *
 * Every mode prints "status <n> <vmm_last_error()>" for the call under test on stdout.
 * Exit codes: the vmm_status of that call, 40+status (vmm_open failed), 50+status (vmm_find
 * failed), 61/62/63 (pattern mismatch), 64 (usage), 65 (wrong size), 70+status (release). */
#include "vmmshim.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint8_t pattern(unsigned seed, uint64_t i) { return (uint8_t)(seed + i * 31u + (i >> 9)); }

static uint64_t first_mismatch(const uint8_t *p, uint64_t n, unsigned seed)
{
    for (uint64_t i = 0; i < n; i++)
        if (p[i] != pattern(seed, i)) return i;
    return UINT64_MAX;
}

static void report(vmm_status st)
{
    printf("status %d %s\n", (int)st, st == VMM_OK ? "" : vmm_last_error());
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc < 5) return 64;
    const char *mode = argv[1];
    uint32_t pid = (uint32_t)strtoul(argv[3], NULL, 0);
    uint64_t address = strtoull(argv[4], NULL, 0);
    vmm_registry *reg = NULL;
    vmm_status st = vmm_open(argv[2], &reg);
    if (st != VMM_OK) {
        report(st);
        return 40 + (int)st;
    }
    vmm_alloc_info a;
    st = vmm_find(reg, pid, address, &a);
    if (st != VMM_OK) {
        report(st);
        vmm_close(reg);
        return 50 + (int)st;
    }
    int rc = 0;
    if (!strcmp(mode, "try")) {
        if (argc > 5) a.generation = strtoull(argv[5], NULL, 0);
        vmm_imported *imp = NULL;
        st = vmm_import(reg, &a, &imp);
        report(st);
        if (st == VMM_OK && imp == NULL) rc = 66;
        if (st != VMM_OK && imp != NULL) rc = 67;
        vmm_import_release(imp);
        rc = rc ? rc : (int)st;
    } else if (!strcmp(mode, "fd")) {
        int fd = -1;
        st = vmm_import_fd(reg, &a, &fd);
        report(st);
        rc = (int)st;
        if (st == VMM_OK) {
            int fl = fcntl(fd, F_GETFD);
            if (fl < 0 || !(fl & FD_CLOEXEC)) rc = 60;
            close(fd);
        } else if (fd != -1) {
            rc = 68;
        }
    } else if ((!strcmp(mode, "import") || !strcmp(mode, "hold")) && argc >= 7) {
        unsigned seed = (unsigned)strtoul(argv[5], NULL, 0), seed2 = (unsigned)strtoul(argv[6], NULL, 0);
        vmm_imported *imp = NULL;
        st = vmm_import(reg, &a, &imp);
        report(st);
        if (st != VMM_OK) {
            vmm_close(reg);
            return (int)st;
        }
        /* with the emulated driver, device pointers are host addresses */
        uint8_t *p = (uint8_t *)(uintptr_t)vmm_import_ptr(imp);
        uint64_t n = vmm_import_size(imp);
        if (n != a.requested_size || !p) {
            fprintf(stderr, "companion: size %llu, expected %llu\n", (unsigned long long)n,
                    (unsigned long long)a.requested_size);
            rc = 65;
        } else if (first_mismatch(p, n, seed) != UINT64_MAX) {
            fprintf(stderr, "companion: byte %llu differs\n", (unsigned long long)first_mismatch(p, n, seed));
            rc = 61;
        } else {
            if (!strcmp(mode, "hold")) {
                printf("ready\n");
                fflush(stdout);
                char c;
                if (read(0, &c, 1) != 1) rc = 64;
                if (!rc && first_mismatch(p, n, seed) != UINT64_MAX) rc = 62;
            }
            if (!rc) {
                for (uint64_t i = 0; i < n; i++) p[i] = pattern(seed2, i);
                if (first_mismatch(p, n, seed2) != UINT64_MAX) rc = 63;
            }
        }
        vmm_status rs = vmm_import_release(imp);
        if (!rc && rs != VMM_OK) {
            report(rs);
            rc = 70 + (int)rs;
        }
    } else {
        rc = 64;
    }
    vmm_close(reg);
    return rc;
}
