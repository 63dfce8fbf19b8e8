/* vmmctl list and ps: the tables of what the registry holds, one row per allocation (or named
 * tensor, names.c) and one per registered process.  They are one family because both read every
 * record once and print a table or JSON; nothing here writes the registry. */
#include "vmmshim.h"

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
/* list                                                                                        */

typedef struct {
    uint32_t pid; /* 0: every process */
    bool json, all, names;
    uint64_t now, n, requested, mapped, hidden, paused;
    vmm_registry *reg;
    uint32_t kept[64], n_kept; /* kept processes met, named after the table */
    uint32_t last_kept, last_keeper;
} list_ctx;

/* The keeper of a kept allocation's owner (0: none), asked once per owner in a row. */
static uint32_t keeper_of(list_ctx *c, const vmm_alloc_info *a)
{
    if (a->owner_alive != VMM_OWNER_KEPT) return 0;
    if (c->last_kept != a->pid) {
        vmm_keeper_info k;
        c->last_kept = a->pid;
        c->last_keeper = vmm_keeper_of(c->reg, a->pid, &k) == VMM_OK ? k.keeper_pid : 0;
        bool seen = false;
        for (uint32_t i = 0; i < c->n_kept; i++) seen |= c->kept[i] == a->pid;
        if (!seen && c->n_kept < 64) c->kept[c->n_kept++] = a->pid;
    }
    return c->last_keeper;
}

static int list_row(void *ctx, const vmm_alloc_info *a)
{
    list_ctx *c = ctx;
    if (c->pid && a->pid != c->pid) return 0;
    if (!c->all && a->owner_alive == VMM_OWNER_DEAD) {
        c->hidden++;
        return 0;
    }
    char id[33], kinds[32], tag[sizeof a->tag];
    vmm__ctl_hex(a->alloc_id, sizeof a->alloc_id, id);
    if (c->json) {
        char uuid[33];
        vmm__ctl_hex(a->device_uuid, sizeof a->device_uuid, uuid);
        printf("%s\n  {\"id\": \"%s\", \"slot\": %llu, \"generation\": %llu, \"pid\": %u, \"owner\": \"%s\", "
               "\"owner_start_time\": %llu, \"owner_pidns\": %llu, \"device\": %u, \"device_uuid\": \"%s\", "
               "\"address\": %llu, \"address_hex\": \"0x%llx\", \"requested_size\": %llu, \"mapped_size\": %llu, "
               "\"chunk_id\": %llu, \"chunk_offset\": %llu, \"extent\": %llu, \"shared_chunk\": %s, "
               "\"n_handles\": %u, \"paused\": %s, \"stream\": %llu, \"created_ns\": %llu, \"age_s\": %llu, \"api\": \"%s\", "
               "\"handle_kinds\": [",
               c->n ? "," : "", id, (unsigned long long)a->slot, (unsigned long long)a->generation, a->pid,
               vmm__ctl_owner_name(a->owner_alive, true), (unsigned long long)a->owner_start_time,
               (unsigned long long)a->owner_pidns, a->device, uuid, (unsigned long long)a->address,
               (unsigned long long)a->address, (unsigned long long)a->requested_size,
               (unsigned long long)a->mapped_size, (unsigned long long)a->chunk_id,
               (unsigned long long)a->chunk_offset, (unsigned long long)vmm__ctl_held_bytes(a),
               a->flags & VMM_ALLOC_SHARED_CHUNK ? "true" : "false", a->n_handles,
               a->flags & VMM_ALLOC_PAUSED ? "true" : "false", (unsigned long long)a->stream,
               (unsigned long long)a->created_ns,
               (unsigned long long)vmm__ctl_age_s(a->created_ns, c->now), vmm__ctl_api_name(a->api));
        const char *sep = "";
        if (a->handle_kinds & VMM_KIND_BROKER) printf("%s\"broker\"", sep), sep = ", ";
        if (a->handle_kinds & VMM_KIND_PIDFD) printf("%s\"pidfd\"", sep), sep = ", ";
        if (a->handle_kinds & VMM_KIND_FABRIC) printf("%s\"fabric\"", sep);
        uint32_t keeper = keeper_of(c, a);
        printf("], \"exported_fd\": %d, \"kept_by\": ", a->exported_fd);
        if (keeper) printf("%u", keeper);
        else printf("null");
        printf(", \"frames\": [");
        for (uint32_t i = 0; i < a->n_frames && i < 8; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)a->frames[i]);
        printf("], \"tag\": ");
        vmm__ctl_json_str(stdout, a->tag);
        putchar('}');
    } else {
        hbuf req, map;
        char age[24];
        (void)keeper_of(c, a);
        snprintf(age, sizeof age, "%llus", (unsigned long long)vmm__ctl_age_s(a->created_ns, c->now));
        /* The short id is the last 8 bytes: the registry makes the first 8 a per-process nonce,
         * the same on every row of a process. */
        printf("%7u %3u 0x%012llx %10s %10s %-15s %-19s %-5s %7s %-16s %s\n", a->pid, a->device,
               (unsigned long long)a->address, vmm__ctl_human(a->requested_size, &req),
               vmm__ctl_human(vmm__ctl_held_bytes(a), &map), vmm__ctl_api_name(a->api),
               /* paused memory offers no handle until resumed: the column says why */
               a->flags & VMM_ALLOC_PAUSED ? "paused" : vmm__ctl_kinds_text(a->handle_kinds, kinds, sizeof kinds),
               vmm__ctl_owner_name(a->owner_alive, false),
               age, vmm__ctl_cell(a->tag, tag, sizeof tag), id + 16);
    }
    c->n++;
    c->requested += a->requested_size;
    c->mapped += vmm__ctl_held_bytes(a);
    if (a->flags & VMM_ALLOC_PAUSED) c->paused += vmm__ctl_held_bytes(a);
    return 0;
}

int vmm__ctl_cmd_list(int argc, char **argv)
{
    list_ctx c = {.now = vmm__ctl_now_ns()};
    for (int i = 0; i < argc; i++) {
        if (vmm__ctl_take_registry(argc, argv, &i)) continue;
        if (strcmp(argv[i], "--json") == 0)
            c.json = true;
        else if (strcmp(argv[i], "--all") == 0)
            c.all = true;
        else if (strcmp(argv[i], "--names") == 0)
            c.names = true;
        else if (strcmp(argv[i], "--pid") == 0) {
            if (i + 1 >= argc) vmm__ctl_usage_error("--pid needs a pid");
            c.pid = vmm__ctl_parse_pid(argv[++i]);
        } else if (strncmp(argv[i], "--pid=", 6) == 0)
            c.pid = vmm__ctl_parse_pid(argv[i] + 6);
        else
            vmm__ctl_usage_error("list: unknown option '%s'", argv[i]);
    }
    if (c.names && c.all)
        vmm__ctl_usage_error("list: --names shows living processes only (a dead one's names went with it); drop --all");
    if (c.names) return vmm__ctl_list_names(c.pid, c.json);
    vmm_registry *reg;
    int rc = vmm__ctl_open_registry(&reg, false);
    if (rc) return rc;
    if (c.json)
        putchar('[');
    else
        printf("%7s %3s %-14s %10s %10s %-15s %-19s %-5s %7s %-16s %s\n", "PID", "DEV", "ADDRESS", "SIZE", "MAPPED",
               "API", "KINDS", "OWNER", "AGE", "TAG", "ID");
    c.reg = reg;
    vmm_status st = vmm_foreach_alloc(reg, list_row, &c);
    if (st != VMM_OK) {
        vmm_close(reg);
        return vmm__ctl_api_error(st);
    }
    if (c.json) {
        printf("%s]\n", c.n ? "\n" : "");
    } else {
        hbuf req, map, paused;
        char paused_text[48] = "";
        if (c.paused) snprintf(paused_text, sizeof paused_text, ", %s of it paused", vmm__ctl_human(c.paused, &paused));
        printf("%llu allocation%s, %s requested, %s mapped%s\n", (unsigned long long)c.n, c.n == 1 ? "" : "s",
               vmm__ctl_human(c.requested, &req), vmm__ctl_human(c.mapped, &map), paused_text);
        for (uint32_t i = 0; i < c.n_kept; i++) vmm__ctl_keeper_line(reg, c.kept[i]);
        if (c.hidden)
            printf("(%llu more of dead processes not shown: `vmmctl list --all` shows them, `vmmctl gc` reclaims "
                   "them)\n",
                   (unsigned long long)c.hidden);
    }
    vmm_close(reg);
    return fflush(stdout) == 0 ? EXIT_OK : vmm__ctl_error("writing the output: %s", strerror(errno));
}

/* ------------------------------------------------------------------------------------------ */
/* ps                                                                                          */

typedef struct {
    bool json;
    uint64_t n, allocs, requested, mapped;
    unsigned alive, dead, unknown, kept;
} ps_ctx;

/* The coverage counters in ps's order: made, backed, of those unpublished (the registry full),
 * passed for capture, full device, unsupported, adopted ranges. */
#define N_COVERAGE 7
static void coverage_of(const vmm_proc_info *p, uint64_t v[N_COVERAGE])
{
    v[0] = p->allocs, v[1] = p->allocs_backed, v[2] = p->unpublished, v[3] = p->passed_capture;
    v[4] = p->passed_device_full, v[5] = p->passed_unsupported, v[6] = p->maps_adopted;
}

static int ps_row(void *ctx, const vmm_proc_info *p)
{
    ps_ctx *c = ctx;
    uint64_t cov[N_COVERAGE];
    coverage_of(p, cov);
    if (c->json) {
        static const char *const keys[N_COVERAGE] = {"allocations_made",   "allocations_backed", "allocations_unpublished",
                                                     "passed_capture",     "passed_device_full", "passed_unsupported",
                                                     "maps_adopted"};
        printf("%s\n  {\"pid\": %u, \"state\": \"%s\", \"start_time\": %llu, \"pidns\": %llu, \"uid\": %u, "
               "\"registered_ns\": %llu, \"n_allocs\": %llu, \"bytes_requested\": %llu, \"bytes_mapped\": %llu, "
               "\"bytes_paused\": %llu, ",
               c->n ? "," : "", p->pid, vmm__ctl_owner_name(p->alive, true), (unsigned long long)p->start_time,
               (unsigned long long)p->pidns, p->uid, (unsigned long long)p->registered_ns,
               (unsigned long long)p->n_allocs, (unsigned long long)p->bytes_requested,
               (unsigned long long)p->bytes_mapped, (unsigned long long)p->bytes_paused);
        /* null: an owner whose shim does not keep them */
        char v[24] = "null";
        for (int i = 0; i < N_COVERAGE; i++) {
            if (p->stats_known) snprintf(v, sizeof v, "%llu", (unsigned long long)cov[i]);
            printf("\"%s\": %s, ", keys[i], v);
        }
        if (p->stats_known) snprintf(v, sizeof v, "%llu", (unsigned long long)p->peak_requested);
        printf("\"peak_bytes_requested\": %s, \"broker_path\": ", v);
        vmm__ctl_json_str(stdout, p->broker_path);
        printf(", \"cmdline\": ");
        vmm__ctl_json_str(stdout, p->cmdline);
        putchar('}');
    } else {
        hbuf req, map, peak, paused;
        char broker[sizeof p->broker_path], cmd[sizeof p->cmdline], n[N_COVERAGE][24];
        for (int i = 0; i < N_COVERAGE; i++) {
            if (p->stats_known) snprintf(n[i], sizeof n[i], "%llu", (unsigned long long)cov[i]);
            else snprintf(n[i], sizeof n[i], "-");
        }
        printf("%7u %-5s %7llu %10s %10s %10s %10s %7s %7s %7s %7s %7s %7s %7s %-24s %s\n", p->pid,
               vmm__ctl_owner_name(p->alive, false), (unsigned long long)p->n_allocs, vmm__ctl_human(p->bytes_requested, &req),
               vmm__ctl_human(p->bytes_mapped, &map), p->bytes_paused ? vmm__ctl_human(p->bytes_paused, &paused) : "-",
               p->stats_known ? vmm__ctl_human(p->peak_requested, &peak) : "-", n[0], n[1], n[2], n[3], n[4], n[5], n[6],
               vmm__ctl_cell(p->broker_path, broker, sizeof broker), vmm__ctl_cell(p->cmdline, cmd, sizeof cmd));
    }
    c->n++;
    c->allocs += p->n_allocs;
    c->requested += p->bytes_requested;
    c->mapped += p->bytes_mapped;
    if (p->alive == VMM_OWNER_ALIVE) c->alive++;
    else if (p->alive == VMM_OWNER_DEAD) c->dead++;
    else if (p->alive == VMM_OWNER_KEPT) c->kept++;
    else c->unknown++;
    return 0;
}

int vmm__ctl_cmd_ps(int argc, char **argv)
{
    ps_ctx c = {0};
    for (int i = 0; i < argc; i++) {
        if (vmm__ctl_take_registry(argc, argv, &i)) continue;
        if (strcmp(argv[i], "--json") == 0)
            c.json = true;
        else
            vmm__ctl_usage_error("ps: unknown option '%s'", argv[i]);
    }
    vmm_registry *reg;
    int rc = vmm__ctl_open_registry(&reg, false);
    if (rc) return rc;
    if (c.json)
        putchar('[');
    else
        printf("%7s %-5s %7s %10s %10s %10s %10s %7s %7s %7s %7s %7s %7s %7s %-24s %s\n", "PID", "STATE", "ALLOCS",
               "REQUESTED", "MAPPED", "PAUSED", "PEAK", "MADE", "BACKED", "UNPUB", "CAPTURE", "FULL", "UNSUPP", "ADOPTED", "BROKER", "CMD");
    vmm_status st = vmm_foreach_proc(reg, ps_row, &c);
    vmm_close(reg);
    if (st != VMM_OK) return vmm__ctl_api_error(st);
    if (c.json) {
        printf("%s]\n", c.n ? "\n" : "");
    } else {
        hbuf req, map;
        char kept[32] = "";
        if (c.kept) snprintf(kept, sizeof kept, ", %u kept", c.kept);
        printf("%llu process%s (%u alive, %u dead, %u unknown%s), %llu allocation%s, %s requested, %s mapped\n",
               (unsigned long long)c.n, c.n == 1 ? "" : "es", c.alive, c.dead, c.unknown, kept,
               (unsigned long long)c.allocs, c.allocs == 1 ? "" : "s", vmm__ctl_human(c.requested, &req),
               vmm__ctl_human(c.mapped, &map));
    }
    return fflush(stdout) == 0 ? EXIT_OK : vmm__ctl_error("writing the output: %s", strerror(errno));
}

