/* vmmctl: look at the vmmshim registry from a shell.
 *
 *   vmmctl [--registry NAME] COMMAND [options]
 *
 * Reads the registry only through the companion API (tools/include/vmmshim.h); `config` prints
 * the options table of shim/core/options.  Exit status: 0 ok, 1 problems found or the registry
 * could not be read, 2 usage error.  Every error is one line on stderr, "vmmctl: error: ...". */
#include "vmmshim.h"

#include "callsite.h"
#include "core/options.h"
#include "core/version.h"

#include "vmmctl.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    "  config         every VMMSHIM_* option: its value and where it came from\n"
    "\n"
    "options:\n"
    "  --registry NAME  registry shm name, /NAME or NAME (default: $VMMSHIM_REGISTRY, the\n"
    "                   config file's, else /vmmshim-<uid>)\n"
    "  -h, --help       this text\n"
    "  -V, --version    the version\n"
    "\n"
    "exit status: 0 ok, 1 problems found or the registry could not be read, 2 usage error\n";

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                      */

/* An error is exactly one line, whatever an argument or a registry name holds. */
static void one_line(char *msg)
{
    for (char *p = msg; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
}

__attribute__((format(printf, 1, 2), noreturn)) void vmm__ctl_usage_error(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    one_line(msg);
    fflush(stdout);
    fprintf(stderr, "vmmctl: error: %s (see vmmctl --help)\n", msg);
    exit(EXIT_USAGE);
}

__attribute__((format(printf, 1, 2))) int vmm__ctl_error(const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    one_line(msg);
    fflush(stdout);
    fprintf(stderr, "vmmctl: error: %s\n", msg);
    return EXIT_PROBLEMS;
}

int vmm__ctl_api_error(vmm_status st)
{
    const char *why = vmm_last_error();
    return vmm__ctl_error("%s", *why ? why : vmm_strerror(st));
}

/* ------------------------------------------------------------------------------------------ */
/* Formatting                                                                                  */

/* 512 B, 4.0 KiB, 2.0 MiB, 1.50 GiB: one decimal up to MiB, two from GiB on. */
const char *vmm__ctl_human(uint64_t v, hbuf *b)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (v < 1024) {
        snprintf(b->s, sizeof b->s, "%llu B", (unsigned long long)v);
        return b->s;
    }
    int u = 0;
    double d = (double)v;
    while (u < 6 && d >= 1024.0) d /= 1024.0, u++;
    /* 1048575 bytes would print as "1024.0 KiB": move up a unit when rounding reaches 1024 */
    if (u < 6 && d >= (u < 3 ? 1023.95 : 1023.995)) d /= 1024.0, u++;
    snprintf(b->s, sizeof b->s, u < 3 ? "%.1f %s" : "%.2f %s", d, units[u]);
    return b->s;
}

const char *vmm__ctl_api_name(uint32_t api)
{
    switch (api) {
    case VMM_FROM_CUDA_MALLOC: return "cudaMalloc";
    case VMM_FROM_CUDA_MALLOC_ASYNC: return "cudaMallocAsync";
    case VMM_FROM_CU_MEM_ALLOC: return "cuMemAlloc";
    case VMM_FROM_CU_MEM_ALLOC_ASYNC: return "cuMemAllocAsync";
    case VMM_FROM_CU_MEM_ALLOC_PITCH: return "cuMemAllocPitch";
    case VMM_FROM_CU_MEM_MAP: return "cuMemMap";
    case VMM_FROM_TEST: return "test";
    default: return "unknown";
    }
}

const char *vmm__ctl_owner_name(int alive, bool json)
{
    if (alive == VMM_OWNER_ALIVE) return "alive";
    if (alive == VMM_OWNER_DEAD) return "dead";
    if (alive == VMM_OWNER_KEPT) return "kept";
    return json ? "unknown" : "?";
}

static const char *kinds_text(uint32_t k, char *buf, size_t len)
{
    snprintf(buf, len, "%s%s%s%s%s", k & VMM_KIND_BROKER ? "broker" : "",
             (k & VMM_KIND_BROKER) && (k & (VMM_KIND_PIDFD | VMM_KIND_FABRIC)) ? "," : "",
             k & VMM_KIND_PIDFD ? "pidfd" : "", (k & VMM_KIND_PIDFD) && (k & VMM_KIND_FABRIC) ? "," : "",
             k & VMM_KIND_FABRIC ? "fabric" : "");
    if (!buf[0]) snprintf(buf, len, "-");
    return buf;
}

/* For table cells: control characters would break the row, so they print as '?'. */
const char *vmm__ctl_cell(const char *s, char *buf, size_t len)
{
    size_t i = 0;
    for (; s[i] && i + 1 < len; i++) buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    buf[i] = 0;
    return i ? buf : "-";
}

void vmm__ctl_hex(const uint8_t *p, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[p[i] >> 4];
        out[2 * i + 1] = digits[p[i] & 15];
    }
    out[2 * n] = 0;
}

/* A JSON string: escapes, and U+FFFD for bytes that are not UTF-8 (the registry holds bytes). */
void vmm__ctl_json_str(FILE *f, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    fputc('"', f);
    while (*p) {
        unsigned c = *p;
        if (c == '"' || c == '\\') {
            fputc('\\', f);
            fputc((int)c, f);
            p++;
        } else if (c < 0x20 || c == 0x7f) {
            fprintf(f, "\\u%04x", c);
            p++;
        } else if (c < 0x80) {
            fputc((int)c, f);
            p++;
        } else {
            int n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c <= 0xdf ? 2 : 0;
            if (c >= 0xf5) n = 0;
            bool ok = n > 0;
            for (int i = 1; ok && i < n; i++) ok = (p[i] & 0xc0) == 0x80;
            if (ok && n == 3) { /* no overlongs, no surrogates */
                unsigned cp = (c & 0x0f) << 12 | (p[1] & 0x3fu) << 6 | (p[2] & 0x3fu);
                ok = cp >= 0x800 && (cp < 0xd800 || cp > 0xdfff);
            }
            if (ok && n == 4) {
                unsigned cp = (c & 0x07) << 18 | (p[1] & 0x3fu) << 12 | (p[2] & 0x3fu) << 6 | (p[3] & 0x3fu);
                ok = cp >= 0x10000 && cp <= 0x10ffff;
            }
            if (ok) {
                fwrite(p, 1, (size_t)n, f);
                p += n;
            } else {
                fputs("\\ufffd", f);
                p++;
            }
        }
    }
    fputc('"', f);
}

uint64_t vmm__ctl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t vmm__ctl_fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t age_s(uint64_t created_ns, uint64_t now)
{
    return created_ns && created_ns < now ? (now - created_ns) / 1000000000ull : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Arguments                                                                                   */

static const char *registry_opt; /* --registry */
static bool registry_given;

bool vmm__ctl_take_registry(int argc, char **argv, int *i)
{
    const char *a = argv[*i];
    if (strcmp(a, "--registry") == 0) {
        if (*i + 1 >= argc) vmm__ctl_usage_error("--registry needs a name");
        registry_opt = argv[++*i];
    } else if (strncmp(a, "--registry=", 11) == 0) {
        registry_opt = a + 11;
    } else {
        return false;
    }
    if (!*registry_opt) vmm__ctl_usage_error("--registry needs a name");
    registry_given = true;
    return true;
}

uint32_t vmm__ctl_parse_pid(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (!*s || *s < '0' || *s > '9' || *end || errno || v == 0 || v > INT_MAX) vmm__ctl_usage_error("bad pid '%s'", s);
    return (uint32_t)v;
}

/* The registry the shim would use: --registry, else the options' VMMSHIM_REGISTRY (environment
 * or config file), else the library's per-user default. */
static const char *registry_name(void)
{
    if (registry_given) return registry_opt;
    vmm__opt_init();
    const char *n = vmm__opt_str(VMM__OPT_REGISTRY);
    return n && *n ? n : NULL;
}

const char *vmm__ctl_registry_name(void) { return registry_name(); }

int vmm__ctl_open_registry(vmm_registry **reg, bool writable)
{
    const char *name = registry_name();
    vmm_status st = writable ? vmm_open_writable(name, reg) : vmm_open(name, reg);
    return st == VMM_OK ? EXIT_OK : vmm__ctl_api_error(st);
}

/* ------------------------------------------------------------------------------------------ */
/* list                                                                                        */

typedef struct {
    uint32_t pid; /* 0: every process */
    bool json, all, names;
    uint64_t now, n, requested, mapped, hidden;
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

/* The bytes an allocation holds: its extent of a shared chunk (the whole chunk is mapped_size,
 * and adding that up would count a shared chunk once per allocation in it). */
static uint64_t held_bytes(const vmm_alloc_info *a) { return a->extent ? a->extent : a->mapped_size; }

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
               "\"n_handles\": %u, \"stream\": %llu, \"created_ns\": %llu, \"age_s\": %llu, \"api\": \"%s\", \"handle_kinds\": [",
               c->n ? "," : "", id, (unsigned long long)a->slot, (unsigned long long)a->generation, a->pid,
               vmm__ctl_owner_name(a->owner_alive, true), (unsigned long long)a->owner_start_time,
               (unsigned long long)a->owner_pidns, a->device, uuid, (unsigned long long)a->address,
               (unsigned long long)a->address, (unsigned long long)a->requested_size,
               (unsigned long long)a->mapped_size, (unsigned long long)a->chunk_id,
               (unsigned long long)a->chunk_offset, (unsigned long long)held_bytes(a),
               a->flags & VMM_ALLOC_SHARED_CHUNK ? "true" : "false", a->n_handles, (unsigned long long)a->stream,
               (unsigned long long)a->created_ns,
               (unsigned long long)age_s(a->created_ns, c->now), vmm__ctl_api_name(a->api));
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
        snprintf(age, sizeof age, "%llus", (unsigned long long)age_s(a->created_ns, c->now));
        /* The short id is the last 8 bytes: the registry makes the first 8 a per-process nonce,
         * the same on every row of a process. */
        printf("%7u %3u 0x%012llx %10s %10s %-15s %-19s %-5s %7s %-16s %s\n", a->pid, a->device,
               (unsigned long long)a->address, vmm__ctl_human(a->requested_size, &req),
               vmm__ctl_human(held_bytes(a), &map), vmm__ctl_api_name(a->api),
               kinds_text(a->handle_kinds, kinds, sizeof kinds), vmm__ctl_owner_name(a->owner_alive, false),
               age, vmm__ctl_cell(a->tag, tag, sizeof tag), id + 16);
    }
    c->n++;
    c->requested += a->requested_size;
    c->mapped += held_bytes(a);
    return 0;
}

static int cmd_list(int argc, char **argv)
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
        hbuf req, map;
        printf("%llu allocation%s, %s requested, %s mapped\n", (unsigned long long)c.n, c.n == 1 ? "" : "s",
               vmm__ctl_human(c.requested, &req), vmm__ctl_human(c.mapped, &map));
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

/* The coverage counters in ps's order: made, backed, passed for capture, full device, unsupported,
 * adopted ranges. */
#define N_COVERAGE 6
static void coverage_of(const vmm_proc_info *p, uint64_t v[N_COVERAGE])
{
    v[0] = p->allocs, v[1] = p->allocs_backed, v[2] = p->passed_capture, v[3] = p->passed_device_full;
    v[4] = p->passed_unsupported, v[5] = p->maps_adopted;
}

static int ps_row(void *ctx, const vmm_proc_info *p)
{
    ps_ctx *c = ctx;
    uint64_t cov[N_COVERAGE];
    coverage_of(p, cov);
    if (c->json) {
        static const char *const keys[N_COVERAGE] = {"allocations_made",   "allocations_backed", "passed_capture",
                                                     "passed_device_full", "passed_unsupported", "maps_adopted"};
        printf("%s\n  {\"pid\": %u, \"state\": \"%s\", \"start_time\": %llu, \"pidns\": %llu, \"uid\": %u, "
               "\"registered_ns\": %llu, \"n_allocs\": %llu, \"bytes_requested\": %llu, \"bytes_mapped\": %llu, ",
               c->n ? "," : "", p->pid, vmm__ctl_owner_name(p->alive, true), (unsigned long long)p->start_time,
               (unsigned long long)p->pidns, p->uid, (unsigned long long)p->registered_ns,
               (unsigned long long)p->n_allocs, (unsigned long long)p->bytes_requested,
               (unsigned long long)p->bytes_mapped);
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
        hbuf req, map, peak;
        char broker[sizeof p->broker_path], cmd[sizeof p->cmdline], n[N_COVERAGE][24];
        for (int i = 0; i < N_COVERAGE; i++) {
            if (p->stats_known) snprintf(n[i], sizeof n[i], "%llu", (unsigned long long)cov[i]);
            else snprintf(n[i], sizeof n[i], "-");
        }
        printf("%7u %-5s %7llu %10s %10s %10s %7s %7s %7s %7s %7s %7s %-24s %s\n", p->pid, vmm__ctl_owner_name(p->alive, false),
               (unsigned long long)p->n_allocs, vmm__ctl_human(p->bytes_requested, &req), vmm__ctl_human(p->bytes_mapped, &map),
               p->stats_known ? vmm__ctl_human(p->peak_requested, &peak) : "-", n[0], n[1], n[2], n[3], n[4], n[5],
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

static int cmd_ps(int argc, char **argv)
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
        printf("%7s %-5s %7s %10s %10s %10s %7s %7s %7s %7s %7s %7s %-24s %s\n", "PID", "STATE", "ALLOCS", "REQUESTED",
               "MAPPED", "PEAK", "MADE", "BACKED", "CAPTURE", "FULL", "UNSUPP", "ADOPTED", "BROKER", "CMD");
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

static int cmd_check(int argc, char **argv)
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

static int cmd_gc(int argc, char **argv)
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

static int cmd_config(int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!vmm__ctl_take_registry(argc, argv, &i)) vmm__ctl_usage_error("config: unknown option '%s'", argv[i]);
    fflush(stdout);
    int rc = vmm__opt_init();
    vmm__opt_print_table(STDOUT_FILENO, true);
    return rc < 0 ? EXIT_PROBLEMS : EXIT_OK;
}

/* ------------------------------------------------------------------------------------------ */

/* ------------------------------------------------------------------------------------------ */
/* show, import-test                                                                           */

uint64_t vmm__ctl_parse_addr(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (!*s || *end || errno || v == 0) vmm__ctl_usage_error("bad address '%s'", s);
    return v;
}

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

static int cmd_show(int argc, char **argv)
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
           vmm__ctl_human(held_bytes(&a), &h2));
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
    printf("\nexport       %s", kinds_text(a.handle_kinds, kinds, sizeof kinds));
    if (a.exported_fd >= 0) printf(" (fd %d in the owner)", a.exported_fd);
    printf("\ncreated      %llu s ago\n", (unsigned long long)age_s(a.created_ns, vmm__ctl_now_ns()));
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
    while (at - addr < want && vmm_find(reg, pid, at, &r) == VMM_OK && r.address + held_bytes(&r) > at) {
        at = r.address + held_bytes(&r);
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

static int cmd_import_test(int argc, char **argv)
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
    uint64_t off = addr - a.address, end = off < a.requested_size ? a.requested_size : held_bytes(&a);
    if (len_arg > held_bytes(&a) - off) return import_test_range(reg, &a, addr, len_arg);
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

int main(int argc, char **argv)
{
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage_text, stdout);
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
    if (strcmp(cmd, "list") == 0) return cmd_list(n, rest);
    if (strcmp(cmd, "ps") == 0) return cmd_ps(n, rest);
    if (strcmp(cmd, "check") == 0) return cmd_check(n, rest);
    if (strcmp(cmd, "gc") == 0) return cmd_gc(n, rest);
    if (strcmp(cmd, "config") == 0) return cmd_config(n, rest);
    if (strcmp(cmd, "show") == 0) return cmd_show(n, rest);
    if (strcmp(cmd, "import-test") == 0) return cmd_import_test(n, rest);
    if (strcmp(cmd, "dump") == 0) return vmm__ctl_cmd_dump(n, rest);
    if (strcmp(cmd, "watch") == 0) return vmm__ctl_cmd_watch(n, rest);
    if (strcmp(cmd, "keep") == 0) return vmm__ctl_cmd_keep(n, rest);
    if (strcmp(cmd, "release") == 0) return vmm__ctl_cmd_release(n, rest);
    if (strcmp(cmd, "help") == 0) {
        fputs(usage_text, stdout);
        return EXIT_OK;
    }
    vmm__ctl_usage_error("unknown command '%s'", cmd);
}
