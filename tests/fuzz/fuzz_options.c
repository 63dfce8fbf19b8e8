/* Fuzz target: the option value parsers and the config file parser (shim/core/options.c,
 * included so the static parsers and the value table are reachable), through the same loader
 * that runs when the shim starts.
 *
 * Input: byte 0 picks the mode.
 *   bit 0 clear: the rest is a config file (VMMSHIM_CONFIG names it); bit 1 sets
 *                VMMSHIM_STRICT=1, bit 2 VMMSHIM_STRICT=0, neither leaves the file to decide.
 *   bit 0 set:   the rest is environment values separated by NUL bytes, the k-th for option
 *                (byte 0 >> 1) + k (VMMSHIM_CONFIG skipped: it would open whatever path the
 *                input names); each value is also run through every parser over its full range.
 * After loading, every option must hold a value of its type within its range that formats
 * to text which parses back to the very same value; the integer and size parsers, over their
 * full range, must round-trip the same way.  Log lines go to /dev/null (and their rate limit is
 * reset per input, so each one is formatted). */
#include "../../shim/core/options.c"

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int g_devnull = -1, g_conf = -1;
static char g_conf_path[64];

static void clear_env(void)
{
    for (int id = 0; id < VMM__OPT_COUNT; id++) unsetenv(opt_table[id].name);
}

/* Each option's value is in range, and survives format -> parse unchanged. */
static void check_values(void)
{
    char text[OPT_STR_MAX + 8];
    for (int i = 0; i < VMM__OPT_COUNT; i++) {
        vmm__opt_id id = (vmm__opt_id)i;
        const opt_desc *d = &opt_table[id];
        opt_value before = opt_values[id];
        switch (d->type) {
        case T_BOOL:
            if (before.num != 0 && before.num != 1) abort();
            break;
        case T_INT:
            if (before.num < d->min || before.num > d->max) abort();
            break;
        case T_SIZE:
            if (before.size < (unsigned long long)d->min || before.size > (unsigned long long)d->max) abort();
            break;
        case T_ENUM: {
            long long n = 0;
            while (d->values[n]) n++;
            if (before.num < 0 || before.num >= n) abort();
            break;
        }
        case T_STRING:
            if (!memchr(opt_strings[id], 0, OPT_STR_MAX)) abort();
            break;
        }
        int n = vmm__opt_format(id, text, sizeof text);
        if (n < 0 || (size_t)n >= sizeof text) abort();
        if (apply(id, text, before.src, NULL, 0) != 0) abort();
        if (opt_values[id].num != before.num || opt_values[id].size != before.size) abort();
    }
}

/* The parsers over their full range: what they accept formats back to itself. */
static void check_parsers(const char *s)
{
    long long b, i, back, e;
    unsigned long long z, again;
    char text[64];
    if (parse_bool(s, &b) == P_OK && b != 0 && b != 1) abort();
    if (parse_int(s, LLONG_MIN, LLONG_MAX, &i) == P_OK) {
        snprintf(text, sizeof text, "%lld", i);
        if (parse_int(text, LLONG_MIN, LLONG_MAX, &back) != P_OK || back != i) abort();
    }
    if (parse_size(s, 0, ~0ULL, &z) == P_OK) {
        format_size(z, text, sizeof text);
        if (parse_size(text, 0, ~0ULL, &again) != P_OK || again != z) abort();
    }
    if (parse_enum(s, log_levels, &e) == P_OK && (e < 0 || e > 3)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    if (g_devnull < 0 && (g_devnull = open("/dev/null", O_WRONLY | O_CLOEXEC)) < 0) abort();
    if (g_conf < 0) {
        if ((g_conf = memfd_create("vmmshim-fuzz.conf", MFD_CLOEXEC)) < 0) abort();
        snprintf(g_conf_path, sizeof g_conf_path, "/proc/self/fd/%d", g_conf);
    }
    vmm__log_set_fd_for_test(g_devnull);
    clear_env();
    uint8_t mode = data[0];
    data++, size--;

    if (!(mode & 1)) {
        if (ftruncate(g_conf, 0) != 0 || pwrite(g_conf, data, size, 0) != (ssize_t)size) abort();
        setenv(opt_table[VMM__OPT_CONFIG].name, g_conf_path, 1);
        if (mode & 2) setenv(opt_table[VMM__OPT_STRICT].name, "1", 1);
        else if (mode & 4) setenv(opt_table[VMM__OPT_STRICT].name, "0", 1);
    } else {
        char *copy = malloc(size + 1); /* NUL-terminated pieces, each its own string */
        if (!copy) return 0;
        memcpy(copy, data, size);
        copy[size] = 0;
        int id = (mode >> 1) % VMM__OPT_COUNT;
        for (char *p = copy; p <= copy + size; p += strlen(p) + 1, id = (id + 1) % VMM__OPT_COUNT) {
            check_parsers(p);
            if (id != VMM__OPT_CONFIG) setenv(opt_table[id].name, p, 1);
        }
        free(copy);
    }
    int rc = vmm__opt_reload_for_test();
    if (rc != 0 && rc != -1) abort();
    check_values();
    clear_env();
    return 0;
}
