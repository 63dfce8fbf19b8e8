/* What every vmmctl command shares: one-line errors, argument parsing, the registry to open and
 * the formatting of sizes, owners, cells and JSON strings.  It is the floor of tools/vmmctl: each
 * command family's file calls it and it calls none of them, so the commands never call each
 * other for a helper (format.h). */
#include "vmmshim.h"

#include "core/options.h"

#include "format.h"

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

const char *vmm__ctl_kinds_text(uint32_t k, char *buf, size_t len)
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

uint64_t vmm__ctl_age_s(uint64_t created_ns, uint64_t now)
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

/* The bytes an allocation holds: its extent of a shared chunk (the whole chunk is mapped_size,
 * and adding that up would count a shared chunk once per allocation in it). */
uint64_t vmm__ctl_held_bytes(const vmm_alloc_info *a) { return a->extent ? a->extent : a->mapped_size; }

uint64_t vmm__ctl_parse_addr(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (!*s || *end || errno || v == 0) vmm__ctl_usage_error("bad address '%s'", s);
    return v;
}

/* ------------------------------------------------------------------------------------------ */
/* Kept processes                                                                              */

const char *vmm__ctl_end_text(int kind, int value, char *buf, size_t len)
{
    if (kind == VMM_END_EXIT) snprintf(buf, len, "exited with code %d", value);
    else if (kind == VMM_END_SIGNAL) {
        const char *abbrev = sigabbrev_np(value);
        snprintf(buf, len, "killed by signal %d%s%s%s", value, abbrev ? " (SIG" : "", abbrev ? abbrev : "",
                 abbrev ? ")" : "");
    } else if (kind == VMM_END_UNKNOWN)
        snprintf(buf, len, "unknown: vanished");
    else
        snprintf(buf, len, "still running");
    return buf;
}

void vmm__ctl_keeper_line(vmm_registry *reg, uint32_t pid)
{
    vmm_keeper_info k;
    if (vmm_keeper_of(reg, pid, &k) != VMM_OK) return;
    char since[32], how[80];
    time_t t = (time_t)(k.since_ns / 1000000000u);
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(since, sizeof since, "%Y-%m-%d %H:%M:%S", &tm);
    hbuf h;
    printf("pid %u: kept by keeper pid %u since %s (%llu allocation%s, %s held); it %s\n", pid, k.keeper_pid, since,
           (unsigned long long)k.held_allocs, k.held_allocs == 1 ? "" : "s", vmm__ctl_human(k.held_bytes, &h),
           vmm__ctl_end_text(k.end_kind, k.end_value, how, sizeof how));
}
