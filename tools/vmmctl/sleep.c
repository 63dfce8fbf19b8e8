/* vmmctl pause PID [--tag T] [--discard | --to-file] and vmmctl resume PID [--tag T]: sleep and
 * wake of another process's memory through its broker (vmm_pause_process, vmm_resume_process);
 * a pause also says which companions still hold imports of what it released.
 * The owner decides whether it accepts them (VMMSHIM_REMOTE_PAUSE=1); a refusal is its one line. */
#include "format.h"
#include "vmmctl.h"

#include <string.h>

typedef struct {
    uint32_t pid;
    const char *tag;
    unsigned flags;
} sleep_args;

static void parse(int argc, char **argv, bool pause, sleep_args *a)
{
    const char *cmd = pause ? "pause" : "resume";
    memset(a, 0, sizeof *a);
    for (int i = 0; i < argc; i++) {
        const char *s = argv[i];
        if (strcmp(s, "--tag") == 0) {
            if (i + 1 >= argc) vmm__ctl_usage_error("%s: --tag needs a value", cmd);
            a->tag = argv[++i];
        } else if (strncmp(s, "--tag=", 6) == 0)
            a->tag = s + 6;
        else if (pause && strcmp(s, "--discard") == 0)
            a->flags |= VMM_PAUSE_DISCARD;
        else if (pause && strcmp(s, "--to-file") == 0)
            a->flags |= VMM_PAUSE_FILE;
        else if (s[0] == '-')
            vmm__ctl_usage_error("%s: unknown option '%s'", cmd, s);
        else if (a->pid)
            vmm__ctl_usage_error("%s: one PID only", cmd);
        else
            a->pid = vmm__ctl_parse_pid(s);
    }
    if (!a->pid) vmm__ctl_usage_error("%s needs a PID", cmd);
    if ((a->flags & VMM_PAUSE_DISCARD) && (a->flags & VMM_PAUSE_FILE))
        vmm__ctl_usage_error("pause: --discard and --to-file exclude each other");
}

/* A second line only when there is something to say: who still holds imports of the released
 * memory after the owner's wait (the device gets those bytes back when they let go), or that the
 * owner's shim cannot say (it predates the holders reply): "unknown", never a silent "nobody". */
static void print_held(uint32_t pid, const vmm_sleep_report *r)
{
    if (r->flags & VMM_SLEEP_HOLDERS_UNKNOWN) {
        printf("still held: unknown (pid %u's shim predates reporting who holds its paused memory)\n", pid);
        return;
    }
    if (!r->n_holders) return;
    hbuf held;
    printf("still held by pid ");
    uint32_t named = r->n_holders < 8 ? r->n_holders : 8;
    for (uint32_t i = 0; i < named; i++) printf("%s%u", i ? ", " : "", r->holders[i]);
    if (r->n_holders > named) printf(" and %u more", r->n_holders - named);
    printf(": %s (imports not released; the device gets them back when they let go)\n",
           vmm__ctl_human(r->bytes_held, &held));
}

static int run(int argc, char **argv, bool pause)
{
    sleep_args a;
    parse(argc, argv, pause, &a);
    vmm_registry *reg;
    int rc = vmm__ctl_open_registry(&reg, false);
    if (rc != EXIT_OK) return rc;
    vmm_sleep_report r;
    memset(&r, 0, sizeof r);
    vmm_status st = pause ? vmm_pause_process(reg, a.pid, a.tag, a.flags, &r, sizeof r)
                          : vmm_resume_process(reg, a.pid, a.tag, &r, sizeof r);
    if (st != VMM_OK) {
        rc = vmm__ctl_api_error(st);
        vmm_close(reg);
        return rc;
    }
    vmm_close(reg);
    hbuf released, kept, other;
    char what[96];
    if (a.tag && a.tag[0]) snprintf(what, sizeof what, "tag %s", a.tag);
    else snprintf(what, sizeof what, "all its memory");
    double ms = (double)r.ns / 1e6;
    if (pause) {
        printf("pid %u paused %s: released %s in %llu segments, %s %s of %llu allocations%s; %s left on the "
               "device (not the shim's); %.1f ms\n",
               a.pid, what, vmm__ctl_human(r.bytes_released, &released), (unsigned long long)r.segments,
               a.flags & VMM_PAUSE_DISCARD ? "discarded, kept" : "kept", vmm__ctl_human(r.bytes_kept, &kept),
               (unsigned long long)r.allocations, a.flags & VMM_PAUSE_FILE ? " (in a file)" : "",
               vmm__ctl_human(r.bytes_not_shim, &other), ms);
        print_held(a.pid, &r);
    } else
        printf("pid %u resumed %s: mapped %s in %llu segments, restored %s of %llu allocations; %.1f ms\n", a.pid,
               what, vmm__ctl_human(r.bytes_released, &released), (unsigned long long)r.segments,
               vmm__ctl_human(r.bytes_kept, &kept), (unsigned long long)r.allocations, ms);
    return EXIT_OK;
}

int vmm__ctl_cmd_pause(int argc, char **argv) { return run(argc, argv, true); }

int vmm__ctl_cmd_resume(int argc, char **argv) { return run(argc, argv, false); }
