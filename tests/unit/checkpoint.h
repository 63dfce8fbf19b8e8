/* The checkpoints of tests/progs/lifecycle.c and forks.c ("checkpoint <name> <pid>
 * <address>:<size>:<sum>...", after which the program waits for a line on stdin), and the
 * registry's account of such an owner: every record of it must be an allocation it lists as
 * live.  Header-only, for tests/unit only; include after vmmshim.h. */
#ifndef VMM_TEST_CHECKPOINT_H
#define VMM_TEST_CHECKPOINT_H
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct live_alloc {
    unsigned long long address, size, sum;
} live_alloc;

/* Parse a checkpoint line (tokens are cut out of it): its name, owner and up to max live
 * allocations.  The number of allocations, or -1 when line is no checkpoint. */
static inline int checkpoint_parse(char *line, char name[32], int *pid, live_alloc *live, int max)
{
    int off = 0, n = 0;
    if (sscanf(line, "checkpoint %31s %d%n", name, pid, &off) != 2) return -1;
    for (char *t = strtok(line + off, " \n"); t && n < max; t = strtok(NULL, " \n"))
        if (sscanf(t, "%llx:%llu:%llx", &live[n].address, &live[n].size, &live[n].sum) == 3) n++;
    return n;
}

typedef struct checkpoint__ctx {
    uint32_t pid;
    const live_alloc *live;
    int n;
    char *bad;
    size_t badlen;
} checkpoint__ctx;

static inline int checkpoint__record(void *ctx, const vmm_alloc_info *a)
{
    checkpoint__ctx *c = ctx;
    if (a->pid != c->pid || c->bad[0]) return 0;
    for (int i = 0; i < c->n; i++)
        if (c->live[i].address == a->address && c->live[i].size == a->requested_size) return 0;
    snprintf(c->bad, c->badlen, "pid %u has a record of 0x%llx (%llu bytes, api %u), which it %s", a->pid,
             (unsigned long long)a->address, (unsigned long long)a->requested_size, a->api,
             c->n < 0 ? "left behind at exit" : "does not hold");
    return 1;
}

/* Every record of pid in registry must be one of live[0..n) (n < 0: pid has exited, and neither
 * a record nor its process record may be left).  The first one that is not goes to bad (when it
 * is still empty).  A registry no shim has made yet holds nothing. */
static inline void checkpoint_registry(const char *registry, uint32_t pid, const live_alloc *live, int n, char *bad,
                                       size_t badlen)
{
    vmm_registry *reg = NULL;
    if (bad[0] || vmm_open(registry, &reg) != VMM_OK) return;
    checkpoint__ctx c = {.pid = pid, .live = live, .n = n, .bad = bad, .badlen = badlen};
    vmm_foreach_alloc(reg, checkpoint__record, &c);
    vmm_proc_info p;
    if (n < 0 && !bad[0] && vmm_find_proc(reg, pid, &p) == VMM_OK)
        snprintf(bad, badlen, "pid %u's process record outlived it", pid);
    vmm_close(reg);
}
#endif
