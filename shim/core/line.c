/* The log's line writer, split from the log so the options loader can warn without calling back
 * into the log that reads its settings (log.c reads the options, the options write through
 * here).  Each message becomes one line, formatted into a stack buffer and written with a single
 * write(2): O_APPEND files and pipes keep such writes whole, so lines from threads and processes
 * never interleave.  Nothing allocates and no lock is taken, because this runs inside CUDA hooks,
 * before main and from the options loader while it holds pthread_once. */
#include "core/line.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define LOG_LINE_BYTES 512 /* including the newline; PIPE_BUF keeps pipe writes whole */
#define LOG_RATE       50  /* lines per second per level */
#define LEVELS         4

#define FD_UNRESOLVED (-1)
#define FD_OPENING    (-2)

static const char *const prefixes[LEVELS] = {
    "vmmshim: error: ", "vmmshim: warning: ", "vmmshim: info: ", "vmmshim: debug: ",
};

static atomic_int test_fd = -1;
/* The resolved destination: stderr or the VMMSHIM_LOG_FILE fd.  Its identity is kept so a
 * line is never written into some other file after the application closed our fd and the
 * number got reused. */
static atomic_int out_fd = FD_UNRESOLVED;
static atomic_ullong out_dev, out_ino;
static atomic_int open_failure_said;

/* Token bucket per level: (CLOCK_MONOTONIC second << 32) | lines written in that second,
 * updated with one CAS so no two threads can both take the 51st line. */
static atomic_ullong rate[LEVELS];
static atomic_ulong suppressed[LEVELS];

const char *vmm__strerror(int err, char *buf, size_t len)
{
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
    return strerror_r(err, buf, len);
#else
    if (strerror_r(err, buf, len) != 0) snprintf(buf, len, "error %d", err);
    return buf;
#endif
}

void vmm__line_write_all(int fd, const char *s, size_t n)
{
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return; /* nowhere left to report it */
        s += w, n -= (size_t)w;
    }
}

void vmm__line_prefixed(int fd, const char *prefix, const char *fmt, va_list ap)
{
    char line[LOG_LINE_BYTES + 1]; /* + the NUL vsnprintf insists on */
    const size_t plen = strlen(prefix);
    const size_t text_max = LOG_LINE_BYTES - 1 - plen;
    size_t len;

    memcpy(line, prefix, plen);
    int n = vsnprintf(line + plen, text_max + 1, fmt, ap);
    if (n < 0) {
        len = plen + (size_t)snprintf(line + plen, text_max + 1, "(unformattable message: %s)", fmt);
        if (len > plen + text_max) len = plen + text_max;
    } else if ((size_t)n > text_max) {
        /* Cut on a UTF-8 boundary so the "..." does not follow half a character. */
        size_t end = plen + text_max - 3;
        while (end > plen && ((unsigned char)line[end] & 0xC0) == 0x80) end--;
        memcpy(line + end, "...", 3);
        len = end + 3;
    } else {
        len = plen + (size_t)n;
    }
    for (size_t i = plen; i < len; i++) {
        if (line[i] == '\n' || line[i] == '\r') line[i] = ' ';
    }
    line[len++] = '\n';
    vmm__line_write_all(fd, line, len);
}

vmm__log_level vmm__line_clamp(vmm__log_level level)
{
    return (unsigned)level < LEVELS ? level : VMM__LOG_DEBUG;
}

const char *vmm__line_prefix(vmm__log_level level)
{
    return prefixes[vmm__line_clamp(level)];
}

void vmm__line_print(int fd, vmm__log_level level, const char *fmt, ...)
{
    int saved = errno;
    va_list ap;
    va_start(ap, fmt);
    vmm__line_prefixed(fd, prefixes[vmm__line_clamp(level)], fmt, ap);
    va_end(ap);
    errno = saved;
}

static bool same_file(int fd)
{
    struct stat st;
    return fstat(fd, &st) == 0 && (unsigned long long)st.st_dev == atomic_load(&out_dev) &&
           (unsigned long long)st.st_ino == atomic_load(&out_ino);
}

static int open_log_file(const char *path)
{
    char eb[128];
    struct stat st;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0 && fd <= STDERR_FILENO) {
        /* The application closed its std streams; keep its next printf out of our file. */
        int high = fcntl(fd, F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
        close(fd);
        fd = high;
    }
    if (fd >= 0 && fstat(fd, &st) == 0) {
        atomic_store(&out_dev, (unsigned long long)st.st_dev);
        atomic_store(&out_ino, (unsigned long long)st.st_ino);
        return fd;
    }
    int err = errno;
    if (fd >= 0) close(fd);
    if (!atomic_exchange(&open_failure_said, 1))
        vmm__line_print(STDERR_FILENO, VMM__LOG_WARNING, "cannot open log file '%s' (%s); logging to stderr",
                        path, vmm__strerror(err, eb, sizeof eb));
    return STDERR_FILENO;
}

int vmm__line_fd(const char *path)
{
    int fd = atomic_load(&test_fd);
    if (fd >= 0) return fd;
    if (!path) return STDERR_FILENO;

    fd = atomic_load_explicit(&out_fd, memory_order_acquire);
    if (fd == STDERR_FILENO || (fd >= 0 && same_file(fd))) return fd;
    if (fd == FD_OPENING) return STDERR_FILENO; /* another thread is opening it right now */
    if (fd >= 0) {
        /* Not ours any more: forget it (without closing: it is the application's now). */
        if (!atomic_compare_exchange_strong(&out_fd, &fd, FD_UNRESOLVED)) return STDERR_FILENO;
        fd = FD_UNRESOLVED;
    }
    if (!atomic_compare_exchange_strong(&out_fd, &fd, FD_OPENING)) return STDERR_FILENO;
    fd = path[0] ? open_log_file(path) : STDERR_FILENO;
    atomic_store_explicit(&out_fd, fd, memory_order_release);
    return fd;
}

static unsigned now_second(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned)ts.tv_sec;
}

/* The count of lines dropped in a second that has ended, once, by whichever thread sees it
 * first; a second that ends with nobody logging afterwards reports at the next line. */
static void report_suppressed(int fd, unsigned now)
{
    for (int l = 0; l < LEVELS; l++) {
        if (atomic_load(&suppressed[l]) == 0) continue;
        if ((unsigned)(atomic_load(&rate[l]) >> 32) == now) continue;
        unsigned long n = atomic_exchange(&suppressed[l], 0);
        if (n) vmm__line_print(fd, VMM__LOG_WARNING, "%lu log lines suppressed", n);
    }
}

static bool rate_take(vmm__log_level level, unsigned now)
{
    unsigned long long v = atomic_load(&rate[level]);
    for (;;) {
        unsigned long long next;
        if ((unsigned)(v >> 32) != now) {
            next = (unsigned long long)now << 32 | 1;
        } else if ((unsigned)v >= LOG_RATE) {
            atomic_fetch_add(&suppressed[level], 1);
            return false;
        } else {
            next = v + 1;
        }
        if (atomic_compare_exchange_weak(&rate[level], &v, next)) return true;
    }
}

void vmm__line_limited(int fd, vmm__log_level level, const char *fmt, va_list ap)
{
    unsigned now = now_second();
    level = vmm__line_clamp(level);
    report_suppressed(fd, now);
    if (rate_take(level, now)) vmm__line_prefixed(fd, prefixes[level], fmt, ap);
}

void vmm__line_early(vmm__log_level level, const char *fmt, ...)
{
    int saved = errno;
    if ((int)vmm__line_clamp(level) <= VMM__LOG_WARNING) {
        va_list ap;
        va_start(ap, fmt);
        vmm__line_limited(vmm__line_fd(NULL), level, fmt, ap);
        va_end(ap);
    }
    errno = saved;
}

void vmm__log_set_fd_for_test(int fd)
{
    if (fd < 0) {
        int old = atomic_exchange(&out_fd, FD_UNRESOLVED);
        if (old > STDERR_FILENO && same_file(old)) close(old);
        atomic_store(&open_failure_said, 0);
    }
    for (int l = 0; l < LEVELS; l++) {
        atomic_store(&rate[l], 0);
        atomic_store(&suppressed[l], 0);
    }
    atomic_store(&test_fd, fd < 0 ? -1 : fd);
}
