/* vmmctl check, gc and config: the registry's upkeep (validate it, reclaim dead owners' records)
 * and the options it is run with.  Kept apart from the listings because these judge the registry
 * rather than show it. */
#include "vmmshim.h"

#include "core/options.h"

#include "format.h"
#include "vmmctl.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------ */
/* check, gc                                                                                   */

static int count_alloc(void *ctx, const vmm_alloc_info *a)
{
    (void)a;
    ++*(uint64_t *)ctx;
    return 0;
}

static int count_kept(void *ctx, const vmm_proc_info *p)
{
    if (p->alive == VMM_OWNER_KEPT) ++*(unsigned *)ctx;
    return 0;
}

static int dead_row(void *ctx, const vmm_proc_info *p)
{
    if (p->alive != VMM_OWNER_DEAD) return 0;
    char cmd[sizeof p->cmdline];
    printf("dead owner: pid %u, %llu record%s, %s\n", p->pid, (unsigned long long)p->n_allocs,
           p->n_allocs == 1 ? "" : "s", vmm__ctl_cell(p->cmdline, cmd, sizeof cmd));
    ++*(unsigned *)ctx;
    return 0;
}

int vmm__ctl_cmd_check(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!vmm__ctl_take_registry(argc, argv, &i)) vmm__ctl_usage_error("check: unknown option '%s'", argv[i]);
    vmm_registry *reg;
    int rc = vmm__ctl_open_registry(&reg, false);
    if (rc) return rc;
    vmm_registry_info info;
    vmm_status st = vmm_registry_describe(reg, &info);
    if (st != VMM_OK) {
        rc = vmm__ctl_api_error(st);
        vmm_close(reg);
        return rc;
    }
    uint64_t live = 0;
    vmm_foreach_alloc(reg, count_alloc, &live);
    vmm_gc_report rep;
    st = vmm_check(reg, &rep);
    if (st != VMM_OK && st != VMM_ERR_BUSY) {
        rc = vmm__ctl_api_error(st);
        vmm_close(reg);
        return rc;
    }
    char busy[512] = "";
    if (st == VMM_ERR_BUSY) snprintf(busy, sizeof busy, "%s", vmm_last_error());
    hbuf touched, total;
    printf("registry %s: layout version %u (readers of version %u and up), capacity %llu records\n", info.name,
           info.version, info.compat_version, (unsigned long long)info.capacity);
    printf("  records in use: %llu live, in %llu chunk%s of %llu\n", (unsigned long long)live,
           (unsigned long long)info.used_chunks, info.used_chunks == 1 ? "" : "s",
           (unsigned long long)info.chunk_records);
    printf("  memory: %s touched of %s\n", vmm__ctl_human(info.touched_bytes, &touched),
           vmm__ctl_human(info.total_bytes, &total));
    printf("  totals: %llu published, %llu retracted, %llu reclaimed\n", (unsigned long long)info.publishes,
           (unsigned long long)info.retracts, (unsigned long long)info.reclaimed);
    unsigned kept = 0;
    vmm_foreach_proc(reg, count_kept, &kept);
    printf("  processes: %u alive, %u dead, %u unknown", rep.procs_alive, rep.procs_dead, rep.procs_unknown);
    if (kept) printf(", %u kept (dead, their memory held by a keeper: not a problem)", kept);
    printf("\n");
    unsigned dead_listed = 0;
    if (rep.procs_dead) vmm_foreach_proc(reg, dead_row, &dead_listed);
    vmm_close(reg);

    unsigned problems = 0;
    if (rep.procs_dead || rep.records_reclaimed || rep.chunks_reclaimed) {
        printf("problem: %u dead process%s hold%s %u record%s (%u chunk%s); `vmmctl gc` reclaims them\n",
               rep.procs_dead, rep.procs_dead == 1 ? "" : "es", rep.procs_dead == 1 ? "s" : "", rep.records_reclaimed,
               rep.records_reclaimed == 1 ? "" : "s", rep.chunks_reclaimed, rep.chunks_reclaimed == 1 ? "" : "s");
        problems++;
    }
    if (rep.index_rebuilt) {
        printf("problem: the index was left mid-update by a writer that died; `vmmctl gc` rebuilds it\n");
        problems++;
    }
    if (busy[0]) {
        printf("problem: %s\n", busy);
        problems++;
    }
    if (!problems) printf("ok: no problems found\n");
    fflush(stdout);
    return problems ? EXIT_PROBLEMS : EXIT_OK;
}

int vmm__ctl_cmd_gc(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!vmm__ctl_take_registry(argc, argv, &i)) vmm__ctl_usage_error("gc: unknown option '%s'", argv[i]);
    vmm_registry *reg;
    int rc = vmm__ctl_open_registry(&reg, true);
    if (rc) return rc;
    vmm_gc_report rep;
    vmm_status st = vmm_gc(reg, &rep);
    unsigned kept = 0;
    if (st == VMM_OK) vmm_foreach_proc(reg, count_kept, &kept);
    vmm_close(reg);
    if (st != VMM_OK) return vmm__ctl_api_error(st);
    printf("reclaimed %u record%s from %u dead process%s", rep.records_reclaimed,
           rep.records_reclaimed == 1 ? "" : "s", rep.procs_dead, rep.procs_dead == 1 ? "" : "es");
    if (kept) printf("; left %u kept process%s to %s keeper", kept, kept == 1 ? "" : "es", kept == 1 ? "its" : "their");
    if (rep.index_rebuilt) printf("; rebuilt the index");
    printf("\n");
    fflush(stdout);
    return EXIT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* config                                                                                      */

int vmm__ctl_cmd_config(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!vmm__ctl_take_registry(argc, argv, &i)) vmm__ctl_usage_error("config: unknown option '%s'", argv[i]);
    fflush(stdout);
    int rc = vmm__opt_init();
    vmm__opt_print_table(STDOUT_FILENO, true);
    return rc < 0 ? EXIT_PROBLEMS : EXIT_OK;
}

