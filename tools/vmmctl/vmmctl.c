/* vmmctl: look at the vmmshim registry from a shell.  This file is only the usage text and the
 * dispatch to the command families (one file each, sharing format.c); nothing calls back here.
 *
 *   vmmctl [--registry NAME] COMMAND [options]
 *
 * Reads the registry only through the companion API (tools/include/vmmshim.h); `config` prints
 * the options table of shim/core/options.  Exit status: 0 ok, 1 problems found or the registry
 * could not be read, 2 usage error.  Every error is one line on stderr, "vmmctl: error: ...". */
#include "vmmshim.h"

#include "core/version.h"

#include "format.h"
#include "vmmctl.h"

#include <stdio.h>
#include <string.h>

static const char usage_text[] =
    "usage: vmmctl [--registry NAME] COMMAND [options]\n"
    "\n"
    "Shows the allocations that processes running under libvmmshim.so publish in the registry.\n"
    "\n"
    "commands:\n"
    "  list [--pid PID] [--json] [--all] [--names]\n"
    "                 one row per allocation; --all also shows those of dead processes;\n"
    "                 --names: one row per tensor a living process publishes by name\n"
    "                 (vmm_publish, vmmshim.publish): name, dtype, shape, address, size\n"
    "  ps [--json]    one row per registered process: its live totals, and what became of its\n"
    "                 allocations since it started (made, backed, passed through and why)\n"
    "  check          validate the registry; exit 1 if dead owners' records, torn records\n"
    "                 or a damaged segment are found\n"
    "  gc             reclaim the records of dead processes\n"
    "  show PID ADDR  one allocation (any address inside it) in full, with its chunk, the\n"
    "                 other live allocations sharing it and its call sites (VMMSHIM_FRAMES)\n"
    "  import-test PID ADDR [LEN]\n"
    "                 import it as a companion does, print the FNV-1a checksum of LEN bytes\n"
    "                 from ADDR (default: to the end of the allocation) and the import times;\n"
    "                 a LEN past the allocation imports the range across the allocations\n"
    "                 that follow it (pages the program mapped itself)\n"
    "  dump PID [ADDR] -o PATH\n"
    "                 copy device memory to files: with ADDR, that allocation's bytes to the\n"
    "                 file PATH; without, every live allocation of PID into the new (or empty)\n"
    "                 directory PATH, one file each, and manifest.json (XXH3-64 checksums; what\n"
    "                 was skipped and why).  All are imported before the first byte is copied,\n"
    "                 so the dump completes even if PID dies meanwhile.  A progress bar on a\n"
    "                 terminal's stderr; a summary line on stdout.  Exit 1 if anything asked\n"
    "                 for could not be dumped (skipped allocations do not count)\n"
    "  watch [--pid PID] [--interval S] [--count N]\n"
    "                 every S seconds (default 1) each process's allocations and bytes and\n"
    "                 their change since the tick before: a redrawn table on a terminal, else\n"
    "                 one JSON line per tick; stops after N ticks, or on SIGINT/SIGTERM\n"
    "  keep PID... | --all [--tag T] [--on-exit dump DIR] [--settle MS] [--daemon [--log FILE]]\n"
    "                 hold the memory of the processes named (--all: of every process under the\n"
    "                 shim, now and later; --tag: only allocations with tag T) so that it\n"
    "                 outlives them: what they free is let go of at once; when one dies (a\n"
    "                 signal, or exit with a status other than 0) its allocations stay, kept,\n"
    "                 and list --all, dump, import-test and the client library serve them;\n"
    "                 --on-exit dump DIR: dump it to DIR/PID then.  One line per event; stops\n"
    "                 (letting go of everything) on SIGINT/SIGTERM, or when nothing is left\n"
    "                 to keep.  A process kept by another keeper is refused\n"
    "  release PID    ask the keeper of PID to let go of it, and wait until it has\n"
    "  pause PID [--tag T] [--discard | --to-file]\n"
    "                 have PID give its memory (--tag: tag T's) back to the device, as its own\n"
    "                 vmm_pause would: contents kept in its host memory (--to-file: an unlinked\n"
    "                 file; --discard: not kept); PID must run with VMMSHIM_REMOTE_PAUSE=1,\n"
    "                 else it refuses.  One line: what was released and kept, and how long;\n"
    "                 then, when companions still hold imports of it after PID's wait, a\n"
    "                 second: \"still held by pid P, Q: N bytes\" (\"unknown\" when PID's shim\n"
    "                 predates saying so)\n"
    "  resume PID [--tag T]\n"
    "                 map PID's paused memory again at the same addresses, contents restored\n"
    "  config         every VMMSHIM_* option: its value and where it came from\n";
/* apart: one string literal may be 4095 bytes at most in ISO C (-Woverlength-strings) */
static const char usage_options[] =
    "\n"
    "options:\n"
    "  --registry NAME  registry shm name, /NAME or NAME (default: $VMMSHIM_REGISTRY, the\n"
    "                   config file's, else /vmmshim-<uid>)\n"
    "  -h, --help       this text\n"
    "  -V, --version    the version\n"
    "\n"
    "exit status: 0 ok, 1 problems found or the registry could not be read, 2 usage error\n";

int main(int argc, char **argv)
{
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage_text, stdout);
            fputs(usage_options, stdout);
            return EXIT_OK;
        }
        if (strcmp(a, "-V") == 0 || strcmp(a, "--version") == 0) {
            printf("vmmctl %s\n", VMM_VERSION_STRING);
            return EXIT_OK;
        }
        if (!vmm__ctl_take_registry(argc, argv, &i)) vmm__ctl_usage_error("unknown option '%s'", a);
    }
    if (i >= argc) vmm__ctl_usage_error("no command given");
    const char *cmd = argv[i++];
    int n = argc - i;
    char **rest = argv + i;
    if (strcmp(cmd, "list") == 0) return vmm__ctl_cmd_list(n, rest);
    if (strcmp(cmd, "ps") == 0) return vmm__ctl_cmd_ps(n, rest);
    if (strcmp(cmd, "check") == 0) return vmm__ctl_cmd_check(n, rest);
    if (strcmp(cmd, "gc") == 0) return vmm__ctl_cmd_gc(n, rest);
    if (strcmp(cmd, "config") == 0) return vmm__ctl_cmd_config(n, rest);
    if (strcmp(cmd, "show") == 0) return vmm__ctl_cmd_show(n, rest);
    if (strcmp(cmd, "import-test") == 0) return vmm__ctl_cmd_import_test(n, rest);
    if (strcmp(cmd, "dump") == 0) return vmm__ctl_cmd_dump(n, rest);
    if (strcmp(cmd, "watch") == 0) return vmm__ctl_cmd_watch(n, rest);
    if (strcmp(cmd, "keep") == 0) return vmm__ctl_cmd_keep(n, rest);
    if (strcmp(cmd, "release") == 0) return vmm__ctl_cmd_release(n, rest);
    if (strcmp(cmd, "pause") == 0) return vmm__ctl_cmd_pause(n, rest);
    if (strcmp(cmd, "resume") == 0) return vmm__ctl_cmd_resume(n, rest);
    if (strcmp(cmd, "help") == 0) {
        fputs(usage_text, stdout);
        fputs(usage_options, stdout);
        return EXIT_OK;
    }
    vmm__ctl_usage_error("unknown command '%s'", cmd);
}
