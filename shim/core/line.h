/* The log's line writer, below both the log and the options: it formats and writes one line,
 * keeps the destination file and the rate limit, and reads no setting itself (the caller says
 * where lines go).  Never allocates and preserves errno. */
#ifndef VMM_CORE_LINE_H
#define VMM_CORE_LINE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

typedef enum { VMM__LOG_ERROR, VMM__LOG_WARNING, VMM__LOG_INFO, VMM__LOG_DEBUG } vmm__log_level;

/* A level past the last counts as debug. */
vmm__log_level vmm__line_clamp(vmm__log_level level);
/* "vmmshim: warning: " (clamped like vmm__line_clamp). */
const char *vmm__line_prefix(vmm__log_level level);

/* Where the next line goes: the test's fd when one is set; else, with path NULL (the settings
 * cannot be read yet), stderr without settling anything; else the file at path ("" = stderr),
 * opened on first use and kept while it is still the same file. */
int vmm__line_fd(const char *path);

/* One line "<level prefix><text>\n" to fd, rate-limited to 50 lines a second per level (the
 * count of lines dropped is reported once the second is over). */
void vmm__line_limited(int fd, vmm__log_level level, const char *fmt, va_list ap);
/* One line "<prefix><text>\n" to fd, neither filtered nor limited. */
void vmm__line_prefixed(int fd, const char *prefix, const char *fmt, va_list ap);
/* One line "<level prefix><text>\n" to fd, neither filtered nor limited. */
void vmm__line_print(int fd, vmm__log_level level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* A message while the settings cannot be read (the options loader's own warnings): the log's
 * defaults, errors and warnings to stderr (or the test's fd), limited like every line. */
void vmm__line_early(vmm__log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* write(2) until all of s is written or the fd fails. */
void vmm__line_write_all(int fd, const char *s, size_t n);

/* fd >= 0: every line goes to fd.  fd < 0: back to normal; VMMSHIM_LOG_FILE is opened again
 * (as the options hold it now) on the next line.  Tests only. */
void vmm__log_set_fd_for_test(int fd);

/* strerror without its static buffer or allocation; returns buf or a constant string. */
const char *vmm__strerror(int err, char *buf, size_t len);

#endif
