/* vmmctl watch [--pid PID] [--interval S] [--count N]: the registered processes, tick by tick.
 *
 * On a terminal the screen is redrawn each tick (as `watch nvidia-smi` does) with one row per
 * process: its allocations and bytes and how much each moved since the tick before.  Anywhere
 * else each tick is one JSON line, for a log or a pipe.  SIGINT and SIGTERM end it at once,
 * with status 0. */
#include "format.h"
#include "vmmctl.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop_requested;

static void request_stop(int sig)
{
    (void)sig;
    stop_requested = 1;
}

/* One process as a tick saw it, and what moved since the tick before. */
typedef struct row {
    vmm_proc_info p;
    int64_t d_allocs, d_requested, d_mapped;
    bool is_new; /* not in the tick before (every row of the first tick is not) */
} row;

typedef struct tick {
    row *r;
    size_t n, cap;
    uint32_t pid; /* 0: every process */
    bool out_of_memory;
} tick;

static int add_row(void *ctx, const vmm_proc_info *p)
{
    tick *t = ctx;
    if (t->pid && p->pid != t->pid) return 0;
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 16;
        row *r = realloc(t->r, cap * sizeof *r);
        if (!r) {
            t->out_of_memory = true;
            return 1;
        }
        t->r = r;
        t->cap = cap;
    }
    memset(&t->r[t->n], 0, sizeof t->r[t->n]);
    t->r[t->n++].p = *p;
    return 0;
}

static bool same_process(const vmm_proc_info *a, const vmm_proc_info *b)
{
    return a->pid == b->pid && a->start_time == b->start_time && a->pidns == b->pidns;
}

/* The change since prev; a process prev lacks moved from nothing, except on the first tick,
 * which has no before. */
static void deltas(tick *now, const tick *prev, bool first)
{
    for (size_t i = 0; i < now->n; i++) {
        row *r = &now->r[i];
        const vmm_proc_info *was = NULL;
        for (size_t k = 0; k < prev->n && !was; k++)
            if (same_process(&prev->r[k].p, &r->p)) was = &prev->r[k].p;
        r->is_new = !was;
        if (first) continue;
        r->d_allocs = (int64_t)(r->p.n_allocs - (was ? was->n_allocs : 0));
        r->d_requested = (int64_t)(r->p.bytes_requested - (was ? was->bytes_requested : 0));
        r->d_mapped = (int64_t)(r->p.bytes_mapped - (was ? was->bytes_mapped : 0));
    }
}

static void print_json(const tick *t, uint64_t seq, uint64_t now_ns)
{
    char when[32];
    time_t secs = (time_t)(now_ns / 1000000000ull);
    struct tm tm;
    gmtime_r(&secs, &tm);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    printf("{\"tick\": %llu, \"time\": \"%s\", \"time_ns\": %llu, \"processes\": [", (unsigned long long)seq, when,
           (unsigned long long)now_ns);
    for (size_t i = 0; i < t->n; i++) {
        const row *r = &t->r[i];
        printf("%s{\"pid\": %u, \"state\": \"%s\", \"start_time\": %llu, \"new\": %s, \"n_allocs\": %llu, "
               "\"bytes_requested\": %llu, \"bytes_mapped\": %llu, \"delta_allocs\": %lld, "
               "\"delta_bytes_requested\": %lld, \"delta_bytes_mapped\": %lld, \"cmdline\": ",
               i ? ", " : "", r->p.pid, vmm__ctl_owner_name(r->p.alive, true), (unsigned long long)r->p.start_time,
               r->is_new ? "true" : "false", (unsigned long long)r->p.n_allocs,
               (unsigned long long)r->p.bytes_requested, (unsigned long long)r->p.bytes_mapped,
               (long long)r->d_allocs, (long long)r->d_requested, (long long)r->d_mapped);
        vmm__ctl_json_str(stdout, r->p.cmdline);
        putchar('}');
    }
    printf("]}\n");
}

/* "+2.0 MiB", "-512 B", "" for no change. */
static const char *signed_human(int64_t v, hbuf *b)
{
    if (!v) return "";
    hbuf h;
    uint64_t mag = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    snprintf(b->s, sizeof b->s, "%c%s", v < 0 ? '-' : '+', vmm__ctl_human(mag, &h));
    return b->s;
}

static void print_table(const tick *t, double interval, uint64_t now_ns)
{
    char when[32];
    time_t secs = (time_t)(now_ns / 1000000000ull);
    struct tm tm;
    localtime_r(&secs, &tm);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    /* home and clear, then the frame: the terminal shows one table, not a scroll of them */
    printf("\033[H\033[2JEvery %.1fs: vmmctl watch    %s\n\n", interval, when);
    printf("%7s %-7s %7s %6s %10s %11s %10s %11s  %s\n", "PID", "STATE", "ALLOCS", "+/-", "REQUESTED", "+/-", "MAPPED",
           "+/-", "CMD");
    uint64_t allocs = 0, req = 0, map = 0;
    for (size_t i = 0; i < t->n; i++) {
        const row *r = &t->r[i];
        hbuf h1, h2, h3, h4;
        char dn[24] = "", cmd[sizeof r->p.cmdline];
        if (r->d_allocs) snprintf(dn, sizeof dn, "%+lld", (long long)r->d_allocs);
        printf("%7u %-7s %7llu %6s %10s %11s %10s %11s  %s\n", r->p.pid, vmm__ctl_owner_name(r->p.alive, false),
               (unsigned long long)r->p.n_allocs, dn, vmm__ctl_human(r->p.bytes_requested, &h1),
               signed_human(r->d_requested, &h2), vmm__ctl_human(r->p.bytes_mapped, &h3),
               signed_human(r->d_mapped, &h4), vmm__ctl_cell(r->p.cmdline, cmd, sizeof cmd));
        allocs += r->p.n_allocs;
        req += r->p.bytes_requested;
        map += r->p.bytes_mapped;
    }
    hbuf h1, h2;
    printf("\n%zu process%s, %llu allocation%s, %s requested, %s mapped\n", t->n, t->n == 1 ? "" : "es",
           (unsigned long long)allocs, allocs == 1 ? "" : "s", vmm__ctl_human(req, &h1), vmm__ctl_human(map, &h2));
}

/* SIGINT and SIGTERM stay blocked except inside ppoll, which unblocks them atomically: a signal
 * that came between the check of stop_requested and the sleep would otherwise go unseen until the
 * sleep ended, a whole interval later. */
static sigset_t waking;

/* Sleep until `until` (CLOCK_MONOTONIC), or a signal asks to stop. */
static void sleep_until(const struct timespec *until)
{
    while (!stop_requested) {
        struct timespec now, left;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long ns = (long long)(until->tv_sec - now.tv_sec) * 1000000000 + (until->tv_nsec - now.tv_nsec);
        if (ns <= 0) return;
        left.tv_sec = (time_t)(ns / 1000000000);
        left.tv_nsec = (long)(ns % 1000000000);
        (void)ppoll(NULL, 0, &left, &waking);
    }
}

int vmm__ctl_cmd_watch(int argc, char **argv)
{
    tick now = {0}, prev = {0};
    double interval = 1.0;
    unsigned long long count = 0; /* 0: until stopped */
    for (int i = 0; i < argc; i++) {
        if (vmm__ctl_take_registry(argc, argv, &i)) continue;
        const char *a = argv[i], *v = NULL;
        if (!strcmp(a, "--pid") || !strcmp(a, "--interval") || !strcmp(a, "--count")) {
            if (i + 1 >= argc) vmm__ctl_usage_error("watch: %s needs a value", a);
            v = argv[++i];
        } else if (!strncmp(a, "--pid=", 6) || !strncmp(a, "--interval=", 11) || !strncmp(a, "--count=", 8)) {
            v = strchr(a, '=') + 1;
        } else {
            vmm__ctl_usage_error("watch: unknown option '%s'", a);
        }
        char *end;
        errno = 0;
        if (!strncmp(a, "--pid", 5)) {
            now.pid = prev.pid = vmm__ctl_parse_pid(v);
        } else if (!strncmp(a, "--interval", 10)) {
            interval = strtod(v, &end);
            if (!*v || *end || errno || !(interval >= 0.05 && interval <= 86400)) /* NaN too */
                vmm__ctl_usage_error("watch: bad interval '%s' (seconds, 0.05 to 86400)", v);
        } else {
            count = strtoull(v, &end, 10);
            if (*v < '0' || *v > '9' || *end || errno || count == 0)
                vmm__ctl_usage_error("watch: bad count '%s' (a number of ticks, at least 1)", v);
        }
    }
    vmm_registry *reg;
    int rc = vmm__ctl_open_registry(&reg, false);
    if (rc) return rc;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = request_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigset_t stops;
    sigemptyset(&stops);
    sigaddset(&stops, SIGINT);
    sigaddset(&stops, SIGTERM);
    sigprocmask(SIG_BLOCK, &stops, &waking);
    sigdelset(&waking, SIGINT);
    sigdelset(&waking, SIGTERM);
    bool tty = isatty(STDOUT_FILENO) == 1;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    /* ticks keep to the interval's grid, however long a tick's own work takes */
    long long step_ns = (long long)(interval * 1e9 + 0.5);
    for (unsigned long long seq = 1; !stop_requested && (!count || seq <= count); seq++) {
        tick t = prev;
        prev = now;
        now = t;
        now.n = 0;
        vmm_status st = vmm_foreach_proc(reg, add_row, &now);
        if (st != VMM_OK || now.out_of_memory) {
            rc = st != VMM_OK ? vmm__ctl_api_error(st) : vmm__ctl_error("watch: out of memory");
            break;
        }
        deltas(&now, &prev, seq == 1);
        uint64_t wall = vmm__ctl_now_ns();
        if (tty)
            print_table(&now, interval, wall);
        else
            print_json(&now, seq, wall);
        if (fflush(stdout) != 0) {
            rc = vmm__ctl_error("writing the output: %s", strerror(errno));
            break;
        }
        if (count && seq == count) break;
        next.tv_sec += (time_t)(step_ns / 1000000000LL);
        next.tv_nsec += (long)(step_ns % 1000000000LL);
        if (next.tv_nsec >= 1000000000L) {
            next.tv_sec++;
            next.tv_nsec -= 1000000000L;
        }
        sleep_until(&next);
    }
    free(now.r);
    free(prev.r);
    vmm_close(reg);
    return rc;
}
