/* The options table.  Every VMMSHIM_* setting is declared once in opt_table below (name,
 * type, default, range or values, help) and everything else — parsing, the warnings, the
 * `vmmctl config` table, the README table, the sample config — is derived from that entry.
 *
 * The values are read lazily from inside CUDA hooks and constructors, so this file never
 * allocates: the config file is read into a static buffer and string values are copied into
 * static storage.  Loading happens once under pthread_once.  The loader's own warnings go
 * to the line writer below the log (core/line.c), at the log's defaults, never through the log,
 * which reads these options: so the two never call each other, and a warning never waits on
 * the pthread_once it is written from. */
#include "core/options.h"
#include "core/line.h"
#include "core/version.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define OPT_PREFIX     "VMMSHIM_"
#define OPT_PREFIX_LEN (sizeof OPT_PREFIX - 1)
#define OPT_STR_MAX    4096        /* PATH_MAX: room for any path, including the NUL */
#define CONF_MAX       (64 * 1024) /* a config file is a few hundred bytes; more is a mistake */
#define SHOW_MAX       64          /* bytes of a bad value quoted back in a warning */

typedef enum { T_BOOL, T_INT, T_SIZE, T_ENUM, T_STRING } opt_type;

/* Extra validation of a string value: NULL when fine, else the complaint ("is not ...").  A
 * value that means the same as another spelling may be written out in that spelling into
 * `norm` (len bytes), which is then stored instead; norm left "" keeps the value as given. */
typedef const char *(*opt_check)(const char *value, char *norm, size_t len);

typedef struct {
    const char *name;           /* with the prefix, so vmm__opt_name() needs no buffer */
    opt_type type;
    const char *def;            /* parsed exactly like a user's value, so the text is the truth */
    long long min, max;         /* T_INT and T_SIZE */
    const char *const *values;  /* T_ENUM, NULL-terminated */
    opt_check check;            /* T_STRING, optional */
    const char *help;
} opt_desc;

static const char *check_registry(const char *v, char *norm, size_t len);
static const char *check_abs_path(const char *v, char *norm, size_t len);
static const char *check_tag(const char *v, char *norm, size_t len);

static const char *const log_levels[] = {"error", "warning", "info", "debug", NULL};
static const char *const export_modes[] = {"broker", "pidfd", NULL};
static const char *const fabric_modes[] = {"auto", "off", NULL};

#define KiB 1024LL
#define GiB (KiB * KiB * KiB)
#define TiB (GiB * KiB)

#define OPT(id, type, def, min, max, values, check, help) \
    [VMM__OPT_##id] = {OPT_PREFIX #id, type, def, min, max, values, check, help}

static const opt_desc opt_table[VMM__OPT_COUNT] = {
    OPT(STRICT, T_BOOL, "0", 0, 0, NULL, NULL,
        "Refuse instead of falling back (bad option values, failed start)."),
    OPT(VERBOSE, T_BOOL, "0", 0, 0, NULL, NULL,
        "Print the version and every effective option once at start."),
    OPT(LOG_LEVEL, T_ENUM, "warning", 0, 0, log_levels, NULL,
        "Most detailed level of log line printed."),
    OPT(LOG_FILE, T_STRING, "", 0, 0, NULL, NULL,
        "Append log lines to this file instead of stderr."),
    OPT(CONFIG, T_STRING, "", 0, 0, NULL, NULL,
        "Path of a config file (`key = value` lines); read only from the environment."),
    OPT(ENABLE, T_BOOL, "1", 0, 0, NULL, NULL,
        "0 passes every call through untouched."),
    OPT(REGISTRY, T_STRING, "", 0, 0, NULL, check_registry,
        "POSIX shm name of the registry (`/name`, or `name` meaning `/name`; at most 200 chars); "
        "empty means per-user `/vmmshim-<uid>`."),
    OPT(REGISTRY_GROUP, T_STRING, "", 0, 0, NULL, NULL,
        "Group name or numeric gid given read-write access to the registry (mode 0660 "
        "instead of 0600)."),
    OPT(REGISTRY_CAPACITY, T_INT, "1048576", 1024, 16777216, NULL, NULL,
        "Allocation records the registry can hold; past them allocations still work but go unpublished "
        "(one warning, counted in `vmmctl ps`)."),
    OPT(CACHE_SIZE, T_SIZE, "0", 0, TiB, NULL, NULL,
        "Bytes of freed `cudaMalloc` memory kept per device past the give-back delay (0: all of it goes back, as natively)."),
    OPT(GIVE_BACK_MS, T_INT, "200", 0, 60000, NULL, NULL,
        "Milliseconds freed memory stays mapped for reuse before it goes back to the device (stream-ordered memory: beyond the pool's release threshold)."),
    OPT(GIVE_BACK_HOLD, T_SIZE, "64M", 0, TiB, NULL, NULL,
        "Bytes of freed `cudaMalloc` memory per device that may wait out the give-back delay; a free beyond them goes back at once, as natively, so another process can have it."),
    OPT(ISOLATE, T_BOOL, "0", 0, 0, NULL, NULL,
        "1 gives every allocation a chunk of its own, so an importer maps nothing of its neighbours."),
    OPT(ADOPT, T_BOOL, "1", 0, 0, NULL, NULL,
        "Make memory the program maps itself (cuMemCreate + cuMemMap) exportable and publish it; 0 leaves it alone."),
    OPT(EXPORT, T_ENUM, "broker", 0, 0, export_modes, NULL,
        "How companions get an allocation's fd: `broker`, or `pidfd` (every fd pre-exported "
        "above 1023 for pidfd_getfd)."),
    OPT(PREEXPORT_MS, T_INT, "100", -1, 60000, NULL, NULL,
        "Milliseconds after the program names tensors (`vmm_publish`, `publish_many`) before the broker thread "
        "exports the segments still under them, so a companion's first take pays no export; -1: never (each "
        "segment is exported at its first request). Nothing is exported for a process that names nothing."),
    OPT(PREEXPORT_FDS, T_INT, "4096", 0, 1048576, NULL, NULL,
        "Most exported fds the broker keeps (above 1023, one per segment) before it stops exporting ahead of "
        "requests; never more than `RLIMIT_NOFILE` leaves room for above 1024."),
    OPT(BROKER_DIR, T_STRING, "", 0, 0, NULL, check_abs_path,
        "Directory (created 0700) for the broker sockets; empty means "
        "`$XDG_RUNTIME_DIR/vmmshim` or `/tmp/vmmshim-<uid>`."),
    OPT(BROKER_GROUP, T_STRING, "", 0, 0, NULL, NULL,
        "Group whose members may import allocations (besides the same uid)."),
    OPT(FABRIC, T_ENUM, "auto", 0, 0, fabric_modes, NULL,
        "Try FABRIC handles only if a start-up self-test proves they work (`auto`), or never "
        "(`off`)."),
    OPT(TAG, T_STRING, "", 0, 0, NULL, check_tag,
        "User tag stored with each allocation record (at most 31 bytes)."),
    OPT(FRAMES, T_INT, "0", 0, 8, NULL, NULL,
        "Call-site frames recorded per allocation."),
    OPT(STATS, T_BOOL, "0", 0, 0, NULL, NULL,
        "At exit, print one line: allocations made, how many were backed, how many passed through "
        "and why, the peak requested."),
    OPT(PAUSE_DIR, T_STRING, "", 0, 0, NULL, check_abs_path,
        "Directory of the unlinked file `vmm_pause(tag, VMM_PAUSE_FILE)` keeps paused contents in; empty means "
        "`$TMPDIR` or `/tmp`."),
    /* 64G: the memory was pinned during the pause anyway, so keeping it raises no peak, only how long
     * it stays locked; a colocated-RL trainer pauses the same optimizer state and gradients every
     * step (AdamW's two fp32 moments and bf16 gradients: 10 bytes a parameter, so 64G covers ~6B
     * parameters), while a process that pauses once keeps no more than this locked for good. */
    /* 500 ms: five ticks of a companion's reaper (100 ms), which unmaps an idle mapping of paused memory */
    OPT(PAUSE_HOLD_WAIT_MS, T_INT, "500", 0, 60000, NULL, NULL,
        "How long `vmm_pause` waits, after releasing, for companions holding imports of the paused memory to let "
        "go (their import caches tell the owner's broker; a pid that exits counts as let go); then it reports what "
        "is still held and by which pid (one warning line; `vmm_sleep_report.bytes_held` and `holders`). 0: no wait."),
    OPT(PAUSE_HOST_CACHE, T_SIZE, "64G", 0, TiB, NULL, NULL,
        "Bytes of pinned host memory a process keeps from one kept pause to the next: after a resume each "
        "allocation's pinned copy stays (while they fit) and its next pause copies straight into it, since pinning "
        "costs more than the copy; freeing the allocation frees it. The default covers the AdamW moments and bf16 "
        "gradients of a ~6B-parameter trainer (10 bytes a parameter). 0: every pause pins anew, every resume unpins."),
    OPT(REMOTE_PAUSE, T_BOOL, "0", 0, 0, NULL, NULL,
        "Lets another process of the broker's users pause and resume this process's memory through its broker "
        "(`vmmctl pause PID`, `vmm_pause_process`); the device is waited for first. Set it only when the "
        "program launches no kernel on that memory while paused: a kernel touching it crashes the program."),
    OPT(SLEEP_ADOPTED, T_BOOL, "0", 0, 0, NULL, NULL,
        "Lets `vmm_pause` release the memory the program makes itself (cuMemCreate + cuMemMap: expandable "
        "segments, XLA's arena, NCCL): the shim keeps the driver's handle and gives the program a stand-in value "
        "it translates in every call taking a handle. 0 leaves that memory on the device through a pause, counted "
        "in `bytes_not_shim`."),
    OPT(PAUSE_GUARD, T_BOOL, "0", 0, 0, NULL, NULL,
        "A debugging aid: paused memory is mapped onto one 2 MiB scratch chunk per device instead of nothing, so a "
        "kernel that touches it reads zeros and writes nowhere that matters instead of faulting the context; the "
        "resume then names the device and how many bytes were written while paused. Costs one cuMemMap a 2 MiB "
        "of paused memory at each pause and resume. The program's own VMM memory (VMMSHIM_SLEEP_ADOPTED) is not "
        "guarded."),
};

typedef struct {
    long long num;            /* T_BOOL, T_INT, T_ENUM (the index) */
    unsigned long long size;  /* T_SIZE */
    vmm__opt_source src;
} opt_value;

static opt_value opt_values[VMM__OPT_COUNT];
/* Only string options touch their row, so the rest stays untouched zero pages. */
static char opt_strings[VMM__OPT_COUNT][OPT_STR_MAX];

static pthread_once_t opt_once = PTHREAD_ONCE_INIT;
static atomic_int opt_ready;
static int opt_result;

/* Set while this thread loads the options: anything the loader reaches that reads an option
 * (a log line, through vmm__opt_usable) must use the defaults rather than call back into
 * vmm__opt_init.
 * initial-exec because the shim is preloaded and __tls_get_addr may allocate. */
static _Thread_local int opt_loading __attribute__((tls_model("initial-exec")));

/* Loader state; only touched by the loading thread (pthread_once, or a test's reload). */
static bool load_strict;
static int load_status;
static const char *load_conf_path;
static char conf_buf[CONF_MAX + 1];
static char conf_value[OPT_STR_MAX + 1];
static char norm_value[OPT_STR_MAX]; /* a check's normalised spelling, static: apply may run on a small stack */

/* ------------------------------------------------------------------------------------- */
/* Parsing                                                                                */

enum { P_OK, P_SYNTAX, P_RANGE };

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static void trim(const char **s, size_t *n)
{
    while (*n && is_space(**s)) (*s)++, (*n)--;
    while (*n && is_space((*s)[*n - 1])) (*n)--;
}

static bool word_is(const char *s, size_t n, const char *word)
{
    return strlen(word) == n && strncasecmp(s, word, n) == 0;
}

static int parse_bool(const char *s, long long *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    size_t n = strlen(s);
    trim(&s, &n);
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
        if (word_is(s, n, yes[i])) { *out = 1; return P_OK; }
        if (word_is(s, n, no[i])) { *out = 0; return P_OK; }
    }
    return P_SYNTAX;
}

/* Digits by hand: strtoull accepts "-1" and wraps it, and strtoll's ERANGE is no help for
 * telling "not a number" from "too big". */
static int parse_digits(const char **s, size_t *n, unsigned long long *out)
{
    unsigned long long v = 0;
    bool overflow = false;
    size_t i = 0;
    for (; i < *n && (*s)[i] >= '0' && (*s)[i] <= '9'; i++) {
        unsigned d = (unsigned)((*s)[i] - '0');
        if (v > (~0ULL - d) / 10) overflow = true;
        else v = v * 10 + d;
    }
    if (i == 0) return P_SYNTAX;
    *s += i, *n -= i;
    *out = v;
    return overflow ? P_RANGE : P_OK;
}

static int parse_int(const char *s, long long min, long long max, long long *out)
{
    size_t n = strlen(s);
    bool neg = false;
    unsigned long long mag;
    long long v;
    trim(&s, &n);
    if (n && (*s == '-' || *s == '+')) neg = *s == '-', s++, n--;
    int st = parse_digits(&s, &n, &mag);
    if (st == P_SYNTAX || n) return P_SYNTAX;
    if (st == P_RANGE || mag > (unsigned long long)LLONG_MAX + neg) return P_RANGE;
    if (!neg) v = (long long)mag;
    else v = mag == (unsigned long long)LLONG_MAX + 1 ? LLONG_MIN : -(long long)mag;
    if (v < min || v > max) return P_RANGE;
    *out = v;
    return P_OK;
}

static int parse_size(const char *s, unsigned long long min, unsigned long long max,
                      unsigned long long *out)
{
    static const struct { const char *suffix; unsigned shift; } units[] = {
        {"", 0},    {"b", 0},    {"k", 10},   {"kb", 10},  {"kib", 10}, {"m", 20},
        {"mb", 20}, {"mib", 20}, {"g", 30},   {"gb", 30},  {"gib", 30}, {"t", 40},
        {"tb", 40}, {"tib", 40},
    };
    size_t n = strlen(s);
    unsigned long long v;
    trim(&s, &n);
    int st = parse_digits(&s, &n, &v);
    if (st == P_SYNTAX) return P_SYNTAX;
    trim(&s, &n);
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (!word_is(s, n, units[i].suffix)) continue;
        if (st == P_RANGE || (units[i].shift && v > (~0ULL >> units[i].shift))) return P_RANGE;
        v <<= units[i].shift;
        if (v < min || v > max) return P_RANGE;
        *out = v;
        return P_OK;
    }
    return P_SYNTAX;
}

static int parse_enum(const char *s, const char *const *values, long long *out)
{
    size_t n = strlen(s);
    trim(&s, &n);
    for (int i = 0; values[i]; i++) {
        if (word_is(s, n, values[i])) { *out = i; return P_OK; }
    }
    return P_SYNTAX;
}

/* "name" is taken as "/name", as the client library and vmmctl take it: the message a user
 * gets from either then names the object the shim would have used. */
static const char *check_registry(const char *v, char *norm, size_t len)
{
    if (v[0] == 0) return NULL; /* the per-user default */
    const char *name = v[0] == '/' ? v + 1 : v;
    size_t n = strlen(name);
    if (n == 0 || n > 199 || strchr(name, '/'))
        return "is not a valid shm name (use '/name' or 'name' with no other '/', at most 200 chars)";
    if (name == v) snprintf(norm, len, "/%s", v);
    return NULL;
}

/* The shim and its companions run in different working directories; a relative broker
 * directory would name a different place for each of them. */
static const char *check_abs_path(const char *v, char *norm, size_t len)
{
    (void)norm, (void)len;
    return v[0] && v[0] != '/' ? "is not an absolute path" : NULL;
}

static const char *check_tag(const char *v, char *norm, size_t len)
{
    (void)norm, (void)len;
    return strlen(v) > 31 ? "is too long (at most 31 bytes)" : NULL;
}

/* ------------------------------------------------------------------------------------- */
/* Formatting                                                                             */

static void format_size(unsigned long long v, char *buf, size_t len)
{
    static const char units[] = "TGMK";
    for (int i = 0; v && i < 4; i++) {
        unsigned shift = 10u * (unsigned)(4 - i);
        if ((v & ((1ULL << shift) - 1)) == 0) {
            snprintf(buf, len, "%llu%c", v >> shift, units[i]);
            return;
        }
    }
    snprintf(buf, len, "%llu", v);
}

static int format_value(vmm__opt_id id, char *buf, size_t len)
{
    const opt_desc *d = &opt_table[id];
    const opt_value *v = &opt_values[id];
    char tmp[32];
    switch (d->type) {
    case T_BOOL: return snprintf(buf, len, "%d", v->num ? 1 : 0);
    case T_INT: return snprintf(buf, len, "%lld", v->num);
    case T_SIZE: format_size(v->size, tmp, sizeof tmp); return snprintf(buf, len, "%s", tmp);
    case T_ENUM: return snprintf(buf, len, "%s", d->values[v->num]);
    case T_STRING: return snprintf(buf, len, "%s", opt_strings[id]);
    }
    return -1;
}

/* What a user may write, for messages and docs: "0..1T", "1024..16777216", "a|b|c". */
static void allowed_text(const opt_desc *d, char *buf, size_t len)
{
    char lo[32], hi[32];
    size_t used = 0;
    buf[0] = 0;
    switch (d->type) {
    case T_BOOL: snprintf(buf, len, "1/0, true/false, yes/no, on/off"); break;
    case T_INT: snprintf(buf, len, "%lld..%lld", d->min, d->max); break;
    case T_SIZE:
        format_size((unsigned long long)d->min, lo, sizeof lo);
        format_size((unsigned long long)d->max, hi, sizeof hi);
        snprintf(buf, len, "%s..%s", lo, hi);
        break;
    case T_ENUM:
        for (int i = 0; d->values[i] && used < len; i++) {
            int w = snprintf(buf + used, len - used, "%s%s", i ? "|" : "", d->values[i]);
            if (w < 0) break;
            used += (size_t)w;
        }
        break;
    case T_STRING: break;
    }
}

static const char *display(const char *s)
{
    return s[0] ? s : "''";
}

/* ------------------------------------------------------------------------------------- */
/* Loading                                                                                */

/* One line per problem; under STRICT the same line as an error and the load fails. */
__attribute__((format(printf, 2, 3)))
static void complain(const char *fallback, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (load_strict) {
        load_status = -1;
        vmm__line_early(VMM__LOG_ERROR, "%s; refused (" OPT_PREFIX "STRICT=1)", msg);
    } else {
        vmm__line_early(VMM__LOG_WARNING, "%s; %s", msg, fallback);
    }
}

static void set_default(vmm__opt_id id)
{
    const opt_desc *d = &opt_table[id];
    opt_value *v = &opt_values[id];
    v->num = 0, v->size = 0, v->src = VMM__SRC_DEFAULT;
    switch (d->type) {
    case T_BOOL: parse_bool(d->def, &v->num); break;
    case T_INT: parse_int(d->def, d->min, d->max, &v->num); break;
    case T_SIZE: parse_size(d->def, (unsigned long long)d->min, (unsigned long long)d->max, &v->size); break;
    case T_ENUM: parse_enum(d->def, d->values, &v->num); break;
    case T_STRING: snprintf(opt_strings[id], OPT_STR_MAX, "%s", d->def); break;
    }
}

/* Sets one option from text.  A bad value leaves whatever the option held before (its
 * default, or the config file's value when the environment's is the bad one) and says so. */
static int apply(vmm__opt_id id, const char *text, vmm__opt_source src, const char *where,
                 unsigned line)
{
    const opt_desc *d = &opt_table[id];
    opt_value *v = &opt_values[id];
    long long num = 0;
    unsigned long long size = 0;
    const char *why = NULL;
    char allowed[128], why_buf[192];
    int st = P_OK;

    allowed_text(d, allowed, sizeof allowed);
    switch (d->type) {
    case T_BOOL:
        if ((st = parse_bool(text, &num)) != P_OK)
            snprintf(why_buf, sizeof why_buf, "is not a boolean (use %s)", allowed), why = why_buf;
        break;
    case T_INT:
        if ((st = parse_int(text, d->min, d->max, &num)) != P_OK)
            snprintf(why_buf, sizeof why_buf, "%s (use %s)",
                     st == P_RANGE ? "is out of range" : "is not an integer", allowed), why = why_buf;
        break;
    case T_SIZE:
        if ((st = parse_size(text, (unsigned long long)d->min, (unsigned long long)d->max, &size)) != P_OK)
            snprintf(why_buf, sizeof why_buf, "%s (use bytes or K/M/G/T suffix, %s)",
                     st == P_RANGE ? "is out of range" : "is not a size", allowed), why = why_buf;
        break;
    case T_ENUM:
        if ((st = parse_enum(text, d->values, &num)) != P_OK)
            snprintf(why_buf, sizeof why_buf, "is not one of %s", allowed), why = why_buf;
        break;
    case T_STRING:
        if (strlen(text) >= OPT_STR_MAX)
            snprintf(why_buf, sizeof why_buf, "is too long (at most %d bytes)", OPT_STR_MAX - 1), why = why_buf;
        else if (d->check) {
            norm_value[0] = 0;
            why = d->check(text, norm_value, sizeof norm_value);
            if (!why && norm_value[0]) text = norm_value;
        }
        break;
    }

    if (why) {
        /* Sized to the 512-byte log line, not to the longest value: this may run on a
         * small application stack inside a hook. */
        char where_buf[320] = "", now[SHOW_MAX + 8], fallback[320];
        size_t n = strlen(text);
        if (where) snprintf(where_buf, sizeof where_buf, "%s:%u: ", where, line);
        format_value(id, now, sizeof now);
        if (v->src == VMM__SRC_DEFAULT)
            snprintf(fallback, sizeof fallback, "using default %s", display(now));
        else
            snprintf(fallback, sizeof fallback, "using %s from %s", display(now), load_conf_path);
        complain(fallback, "%s%s='%.*s%s' %s", where_buf, d->name, SHOW_MAX, text,
                 n > SHOW_MAX ? "..." : "", why);
        return -1;
    }

    switch (d->type) {
    case T_SIZE: v->size = size; break;
    case T_STRING: memcpy(opt_strings[id], text, strlen(text) + 1); break;
    default: v->num = num; break;
    }
    v->src = src;
    return 0;
}

/* secure_getenv: a setuid program must not let its caller choose the log file it appends
 * to.  An empty value means "not set", except for strings, where "" is a value. */
static const char *env_value(vmm__opt_id id)
{
    const char *s = secure_getenv(opt_table[id].name);
    if (s && !s[0] && opt_table[id].type != T_STRING) return NULL;
    return s;
}

static int conf_read(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    size_t used = 0;
    if (fd < 0) return errno;
    for (;;) {
        ssize_t r = read(fd, conf_buf + used, sizeof conf_buf - used);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { int e = errno; close(fd); return e; }
        if (r == 0) break;
        used += (size_t)r;
        if (used == sizeof conf_buf) { close(fd); return EFBIG; }
    }
    close(fd);
    *len = used;
    return 0;
}

typedef struct {
    const char *key, *val;
    size_t klen, vlen;
} conf_entry;

/* 0: blank or comment, 1: an entry, -1: malformed. */
static int conf_parse_line(const char *p, size_t n, conf_entry *e)
{
    trim(&p, &n);
    if (n == 0 || p[0] == '#') return 0;
    const char *eq = memchr(p, '=', n);
    if (!eq || memchr(p, 0, n)) return -1;
    e->key = p, e->klen = (size_t)(eq - p);
    e->val = eq + 1, e->vlen = n - e->klen - 1;
    trim(&e->key, &e->klen);
    trim(&e->val, &e->vlen);
    if (e->klen == 0) return -1;
    for (size_t i = 0; i < e->klen; i++) {
        char c = e->key[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
            return -1;
    }
    if (e->vlen >= 2 && (e->val[0] == '"' || e->val[0] == '\'') && e->val[e->vlen - 1] == e->val[0]) {
        e->val++, e->vlen -= 2;
        return 1;
    }
    for (size_t i = 1; i < e->vlen; i++) {
        if (e->val[i] == '#' && is_space(e->val[i - 1])) {
            e->vlen = i;
            trim(&e->val, &e->vlen);
            break;
        }
    }
    return 1;
}

static int conf_lookup(const char *key, size_t klen)
{
    if (klen > OPT_PREFIX_LEN && strncasecmp(key, OPT_PREFIX, OPT_PREFIX_LEN) == 0)
        key += OPT_PREFIX_LEN, klen -= OPT_PREFIX_LEN;
    for (int id = 0; id < VMM__OPT_COUNT; id++) {
        if (word_is(key, klen, opt_table[id].name + OPT_PREFIX_LEN)) return id;
    }
    return -1;
}

static const char *conf_copy_value(const conf_entry *e)
{
    size_t n = e->vlen < OPT_STR_MAX ? e->vlen : OPT_STR_MAX; /* one over: still "too long" */
    memcpy(conf_value, e->val, n);
    conf_value[n] = 0;
    return conf_value;
}

/* Walks the file; with only_strict, silently looks for a usable STRICT line (the strictness
 * decides how every other problem in the file is reported, so it is settled first). */
static void conf_apply(size_t len, bool only_strict, long long *strict)
{
    unsigned line = 0;
    for (size_t pos = 0; pos < len;) {
        const char *p = conf_buf + pos;
        const char *nl = memchr(p, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - p) : len - pos;
        conf_entry e;
        pos += n + 1;
        line++;
        int kind = conf_parse_line(p, n, &e);
        if (kind == 0) continue;
        int id = kind > 0 ? conf_lookup(e.key, e.klen) : -1;
        if (only_strict) {
            if (id == VMM__OPT_STRICT) parse_bool(conf_copy_value(&e), strict);
            continue;
        }
        if (kind < 0) {
            complain("line ignored", "%s:%u: expected 'key = value'", load_conf_path, line);
        } else if (id < 0) {
            complain("line ignored", "%s:%u: unknown option '%.*s'", load_conf_path, line,
                     e.klen > SHOW_MAX ? SHOW_MAX : (int)e.klen, e.key);
        } else if (id == VMM__OPT_CONFIG) {
            complain("line ignored", "%s:%u: %s is read only from the environment",
                     load_conf_path, line, opt_table[id].name);
        } else if (e.vlen || opt_table[id].type == T_STRING) {
            apply((vmm__opt_id)id, conf_copy_value(&e), VMM__SRC_FILE, load_conf_path, line);
        }
    }
}

static int load_all(void)
{
    const char *strict_env = env_value(VMM__OPT_STRICT);
    const char *conf_env = env_value(VMM__OPT_CONFIG);
    long long strict = 0;
    size_t conf_len = 0;
    int conf_err = 0;
    bool have_conf = false;

    opt_loading = 1;
    load_status = 0;
    load_strict = false;
    load_conf_path = NULL;
    for (int id = 0; id < VMM__OPT_COUNT; id++) set_default((vmm__opt_id)id);

    if (conf_env && conf_env[0] && strlen(conf_env) < OPT_STR_MAX) {
        have_conf = true;
        conf_err = conf_read(conf_env, &conf_len);
    }
    if (!strict_env || parse_bool(strict_env, &strict) != P_OK) {
        strict = 0;
        if (have_conf && !conf_err) conf_apply(conf_len, true, &strict);
    }
    load_strict = strict != 0;

    if (conf_env) apply(VMM__OPT_CONFIG, conf_env, VMM__SRC_ENV, NULL, 0);
    if (have_conf) {
        load_conf_path = opt_strings[VMM__OPT_CONFIG];
        if (conf_err == EFBIG) {
            complain("file ignored", "%s: config file is larger than %d KiB", load_conf_path, CONF_MAX / 1024);
        } else if (conf_err) {
            char eb[128];
            complain("file ignored", "%s: cannot read config file (%s)", load_conf_path,
                     vmm__strerror(conf_err, eb, sizeof eb));
        } else {
            conf_apply(conf_len, false, NULL);
        }
    }
    for (int id = 0; id < VMM__OPT_COUNT; id++) {
        const char *s = id == VMM__OPT_CONFIG ? NULL : env_value((vmm__opt_id)id);
        if (s) apply((vmm__opt_id)id, s, VMM__SRC_ENV, NULL, 0);
    }
    opt_loading = 0;
    return load_status;
}

static void print_verbose(void)
{
    int count[3] = {0, 0, 0};
    char conf_part[320] = "";
    if (!opt_values[VMM__OPT_VERBOSE].num) return;
    for (int id = 0; id < VMM__OPT_COUNT; id++) count[opt_values[id].src]++;
    if (opt_strings[VMM__OPT_CONFIG][0])
        snprintf(conf_part, sizeof conf_part, ", %d from %.300s", count[VMM__SRC_FILE],
                 opt_strings[VMM__OPT_CONFIG]);
    int fd = vmm__line_fd(opt_strings[VMM__OPT_LOG_FILE]);
    vmm__line_print(fd, VMM__LOG_INFO, "vmmshim %s (options: %d from the environment%s, %d defaults)",
                   VMM_VERSION_STRING, count[VMM__SRC_ENV], conf_part, count[VMM__SRC_DEFAULT]);
    for (int id = 0; id < VMM__OPT_COUNT; id++) {
        char val[512];
        format_value((vmm__opt_id)id, val, sizeof val);
        vmm__line_print(fd, VMM__LOG_INFO, "  %s = %s (%s)", opt_table[id].name, display(val),
                       vmm__opt_source_name(opt_values[id].src));
    }
}

static void init_once(void)
{
    opt_result = load_all();
    atomic_store_explicit(&opt_ready, 1, memory_order_release);
    print_verbose();
}

/* ------------------------------------------------------------------------------------- */
/* API                                                                                    */

int vmm__opt_init(void)
{
    if (opt_loading) return load_status; /* called back from our own warnings */
    if (!atomic_load_explicit(&opt_ready, memory_order_acquire)) {
        int saved = errno; /* the first getter may run inside a hook; its caller reads errno */
        pthread_once(&opt_once, init_once);
        errno = saved;
    }
    return opt_result;
}

bool vmm__opt_usable(void)
{
    if (opt_loading) return false;
    vmm__opt_init();
    return true;
}

static inline bool valid(vmm__opt_id id)
{
    if ((unsigned)id >= VMM__OPT_COUNT) return false;
    if (!opt_loading && !atomic_load_explicit(&opt_ready, memory_order_acquire)) vmm__opt_init();
    return true;
}

bool vmm__opt_bool(vmm__opt_id id)
{
    if (!valid(id)) return false;
    return opt_table[id].type == T_SIZE ? opt_values[id].size != 0 : opt_values[id].num != 0;
}

long long vmm__opt_int(vmm__opt_id id)
{
    if (!valid(id)) return 0;
    if (opt_table[id].type == T_SIZE)
        return opt_values[id].size > (unsigned long long)LLONG_MAX ? LLONG_MAX : (long long)opt_values[id].size;
    return opt_values[id].num;
}

unsigned long long vmm__opt_size(vmm__opt_id id)
{
    if (!valid(id)) return 0;
    if (opt_table[id].type == T_SIZE) return opt_values[id].size;
    return opt_values[id].num < 0 ? 0 : (unsigned long long)opt_values[id].num;
}

int vmm__opt_enum(vmm__opt_id id)
{
    if (!valid(id)) return 0;
    return (int)opt_values[id].num;
}

const char *vmm__opt_str(vmm__opt_id id)
{
    if (!valid(id) || opt_table[id].type != T_STRING) return "";
    return opt_strings[id];
}

const char *vmm__opt_name(vmm__opt_id id)
{
    return (unsigned)id < VMM__OPT_COUNT ? opt_table[id].name : "";
}

int vmm__opt_format(vmm__opt_id id, char *buf, size_t len)
{
    if (!valid(id)) {
        if (len) buf[0] = 0;
        return -1;
    }
    return format_value(id, buf, len);
}

vmm__opt_source vmm__opt_source_of(vmm__opt_id id)
{
    return valid(id) ? opt_values[id].src : VMM__SRC_DEFAULT;
}

const char *vmm__opt_source_name(vmm__opt_source src)
{
    switch (src) {
    case VMM__SRC_DEFAULT: return "default";
    case VMM__SRC_FILE: return "file";
    case VMM__SRC_ENV: return "env";
    }
    return "?";
}

const char *vmm__opt_help(vmm__opt_id id)
{
    return (unsigned)id < VMM__OPT_COUNT ? opt_table[id].help : "";
}

const char *vmm__opt_type_name(vmm__opt_id id)
{
    static const char *const names[] = {"bool", "integer", "size", "enum", "string"};
    return (unsigned)id < VMM__OPT_COUNT ? names[opt_table[id].type] : "";
}

const char *vmm__opt_default_text(vmm__opt_id id)
{
    return (unsigned)id < VMM__OPT_COUNT ? opt_table[id].def : "";
}

int vmm__opt_reload_for_test(void)
{
    vmm__opt_init();
    opt_result = load_all();
    print_verbose();
    return opt_result;
}

/* ------------------------------------------------------------------------------------- */
/* Tables for people                                                                      */

__attribute__((format(printf, 2, 3)))
static void out(int fd, const char *fmt, ...)
{
    char line[OPT_STR_MAX + 512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    vmm__line_write_all(fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

/* "size 0..1T", "enum: error, warning, info, debug": the Type column and the conf header. */
static void type_text(const opt_desc *d, char *buf, size_t len)
{
    char allowed[128];
    allowed_text(d, allowed, sizeof allowed);
    switch (d->type) {
    case T_BOOL: snprintf(buf, len, "bool"); break;
    case T_INT: snprintf(buf, len, "integer %s", allowed); break;
    case T_SIZE: snprintf(buf, len, "size %s", allowed); break;
    case T_STRING: snprintf(buf, len, "string"); break;
    case T_ENUM: {
        size_t used = (size_t)snprintf(buf, len, "enum:");
        for (int i = 0; d->values[i] && used < len; i++)
            used += (size_t)snprintf(buf + used, len - used, "%s %s", i ? "," : "", d->values[i]);
        break;
    }
    }
}

void vmm__opt_print_table(int fd, bool with_source)
{
    int name_w = 8, val_w = 5;
    char val[OPT_STR_MAX];
    for (int id = 0; id < VMM__OPT_COUNT; id++) {
        int n = (int)strlen(opt_table[id].name);
        if (n > name_w) name_w = n;
        n = vmm__opt_format((vmm__opt_id)id, val, sizeof val);
        if (n < 2) n = 2; /* '' */
        if (n > val_w) val_w = n > 24 ? 24 : n;
    }
    if (with_source)
        out(fd, "%-*s  %-*s  %-7s  %s\n", name_w, "VARIABLE", val_w, "VALUE", "SOURCE", "MEANING");
    else
        out(fd, "%-*s  %-*s  %s\n", name_w, "VARIABLE", val_w, "VALUE", "MEANING");
    for (int id = 0; id < VMM__OPT_COUNT; id++) {
        vmm__opt_format((vmm__opt_id)id, val, sizeof val);
        if (with_source)
            out(fd, "%-*s  %-*s  %-7s  %s\n", name_w, opt_table[id].name, val_w, display(val),
                vmm__opt_source_name(opt_values[id].src), opt_table[id].help);
        else
            out(fd, "%-*s  %-*s  %s\n", name_w, opt_table[id].name, val_w, display(val), opt_table[id].help);
    }
}

void vmm__opt_print_markdown(int fd)
{
    char type[160];
    out(fd, "| Variable | Type | Default | Meaning |\n|---|---|---|---|\n");
    for (int id = 0; id < VMM__OPT_COUNT; id++) {
        const opt_desc *d = &opt_table[id];
        type_text(d, type, sizeof type);
        if (d->def[0])
            out(fd, "| `%s` | %s | `%s` | %s |\n", d->name, type, d->def, d->help);
        else
            out(fd, "| `%s` | %s | (empty) | %s |\n", d->name, type, d->help);
    }
}

void vmm__opt_print_conf(int fd)
{
    char type[160], key[64];
    out(fd, "# vmmshim sample configuration: every option, commented out at its default.\n"
            "# Used when VMMSHIM_CONFIG names this file (or a copy).  Lines are `key = value`;\n"
            "# keys are the variable names with or without the VMMSHIM_ prefix, any case.\n"
            "# A VMMSHIM_* environment variable wins over the same key here.\n"
            "# Generated from shim/core/options.c by tests/scripts/gen_options_doc.sh.\n");
    for (int id = 0; id < VMM__OPT_COUNT; id++) {
        const opt_desc *d = &opt_table[id];
        size_t i = 0;
        for (const char *s = d->name + OPT_PREFIX_LEN; *s && i + 1 < sizeof key; s++)
            key[i++] = (char)(*s >= 'A' && *s <= 'Z' ? *s - 'A' + 'a' : *s);
        key[i] = 0;
        type_text(d, type, sizeof type);
        out(fd, "\n# %s (%s)\n# %s\n# %s =%s%s\n", d->name, type, d->help, key, d->def[0] ? " " : "", d->def);
    }
}
