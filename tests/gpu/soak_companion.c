/* The soak's companion: for SECONDS, imports random live allocations of PID one after another,
 * copies up to 4 MiB of each to the host and checksums it (FNV-1a), asks whether the allocation
 * is still live, releases it.  An allocation freed between listing and importing is counted as
 * stale, not as an error: the trainer frees all the time.  Prints a line every 10 s and a last
 * "companion:" line with the totals.  With DEVICE, every import and copy is made from that
 * device's primary context (current on this thread from the start): a companion on another GPU
 * than the owner's memory.  Run by tests/gpu/soak.sh and tests/gpu/ddp_soak.sh. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "vmmshim.h"

#define MAX_SEEN 8192
#define READ_MAX (4u << 20)

typedef struct {
    uint32_t pid;
    size_t n;
    vmm_alloc_info a[MAX_SEEN];
} seen;

static int collect(void *ctx, const vmm_alloc_info *a)
{
    seen *s = ctx;
    if (a->pid == s->pid && (a->handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD)) && s->n < MAX_SEEN) s->a[s->n++] = *a;
    return 0;
}

/* Make device dev's primary context current on this thread (the driver's API, dlopen'ed: this
 * program links no CUDA library).  0, else the step that failed. */
static const char *use_device(int dev)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    void *f_init = h ? dlsym(h, "cuInit") : NULL, *f_get = h ? dlsym(h, "cuDeviceGet") : NULL;
    void *f_retain = h ? dlsym(h, "cuDevicePrimaryCtxRetain") : NULL, *f_set = h ? dlsym(h, "cuCtxSetCurrent") : NULL;
    int (*init)(unsigned), (*get)(int *, int), (*retain)(void **, int), (*set)(void *);
    if (!f_init || !f_get || !f_retain || !f_set) return "libcuda.so.1";
    memcpy(&init, &f_init, sizeof init);
    memcpy(&get, &f_get, sizeof get);
    memcpy(&retain, &f_retain, sizeof retain);
    memcpy(&set, &f_set, sizeof set);
    int d = 0;
    void *ctx = NULL;
    if (init(0) != 0) return "cuInit";
    if (get(&d, dev) != 0) return "cuDeviceGet";
    if (retain(&ctx, d) != 0) return "cuDevicePrimaryCtxRetain";
    if (set(ctx) != 0) return "cuCtxSetCurrent";
    return NULL;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: soak_companion PID SECONDS [DEVICE]\n");
        return 2;
    }
    if (argc == 4) {
        const char *why = use_device(atoi(argv[3]));
        if (why) {
            fprintf(stderr, "companion: error: cannot make device %s's primary context current: %s failed\n", argv[3], why);
            return 1;
        }
        printf("# importing pid %s's allocations from GPU %s\n", argv[1], argv[3]);
        fflush(stdout);
    }
    static seen s;
    static unsigned char buf[READ_MAX];
    s.pid = (uint32_t)atoi(argv[1]);
    double seconds = atof(argv[2]), start = now_s(), next_report = start + 10;
    vmm_registry *reg;
    if (vmm_open(NULL, &reg) != VMM_OK) {
        fprintf(stderr, "companion: %s\n", vmm_last_error());
        return 1;
    }
    unsigned long long imports = 0, stale = 0, errors = 0, bytes = 0, lists = 0;
    uint64_t sum = 0;
    srand(1);
    while (now_s() - start < seconds) {
        s.n = 0;
        if (vmm_foreach_alloc(reg, collect, &s) != VMM_OK) {
            if (errors++ < 10) fprintf(stderr, "companion: error: list: %s\n", vmm_last_error());
            continue;
        }
        lists++;
        for (int k = 0; k < 64 && s.n; k++) {
            const vmm_alloc_info *a = &s.a[(size_t)rand() % s.n];
            vmm_imported *imp = NULL;
            vmm_status st = vmm_import(reg, a, &imp);
            if (st == VMM_OK) {
                uint64_t size = vmm_import_size(imp), len = size < READ_MAX ? size : READ_MAX;
                uint64_t off = size > len ? ((uint64_t)rand() % (size - len)) & ~4095ull : 0;
                st = vmm_import_read(imp, off, buf, len);
                if (st == VMM_OK) {
                    uint64_t h = 0xcbf29ce484222325ull;
                    for (uint64_t i = 0; i < len; i++) h = (h ^ buf[i]) * 0x100000001b3ull;
                    sum ^= h;
                    bytes += len;
                    vmm_status live = vmm_import_check(reg, imp);
                    if (live != VMM_OK && live != VMM_ERR_STALE) st = live;
                }
                vmm_import_release(imp);
                imports++;
            }
            if (st == VMM_ERR_STALE) stale++;
            else if (st != VMM_OK && errors++ < 10) fprintf(stderr, "companion: error: import of 0x%llx: %s\n", (unsigned long long)a->address, vmm_last_error());
            if (st == VMM_ERR_OWNER_DEAD) goto done;
        }
        if (now_s() >= next_report) {
            double t = now_s() - start;
            printf("companion t=%.0f s: %llu imports (%.0f/s), %llu stale, %llu errors, %.1f GiB read\n", t, imports,
                   imports / t, stale, errors, bytes / 1073741824.0);
            fflush(stdout);
            next_report += 10;
        }
    }
done:;
    double t = now_s() - start;
    printf("companion: %llu imports in %.0f s (%.0f/s), %llu stale, %llu errors, %llu listings, %.1f GiB read, xor of checksums %016llx\n",
           imports, t, imports / t, stale, errors, lists, bytes / 1073741824.0, (unsigned long long)sum);
    vmm_close(reg);
    return errors ? 1 : 0;
}
