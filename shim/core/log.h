/* One-line log messages: "vmmshim: <level>: <text>\n", written with a single write(2) so
 * lines from many threads and processes never interleave.  Callable before main, inside
 * hooks and from the options code itself; never allocates and preserves errno. */
#ifndef VMM_CORE_LOG_H
#define VMM_CORE_LOG_H

#include <stdbool.h>
#include <stddef.h>

typedef enum { VMM__LOG_ERROR, VMM__LOG_WARNING, VMM__LOG_INFO, VMM__LOG_DEBUG } vmm__log_level;

/* Filtered by VMMSHIM_LOG_LEVEL and capped at 50 lines per second per level. */
void vmm__log(vmm__log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Unfiltered and uncapped: for output the user asked for explicitly (VMMSHIM_VERBOSE). */
void vmm__log_print(vmm__log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* "vmmshim: <text>", unfiltered and uncapped: a report the user asked for (VMMSHIM_STATS), which
 * is no message of any level. */
void vmm__log_report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define vmm__error(...) vmm__log(VMM__LOG_ERROR, __VA_ARGS__)
#define vmm__warn(...)  vmm__log(VMM__LOG_WARNING, __VA_ARGS__)
#define vmm__info(...)  vmm__log(VMM__LOG_INFO, __VA_ARGS__)
#define vmm__debug(...) vmm__log(VMM__LOG_DEBUG, __VA_ARGS__)

bool vmm__log_enabled(vmm__log_level level);

/* fd >= 0: every line goes to fd.  fd < 0: back to normal; VMMSHIM_LOG_FILE is opened again
 * (as the options hold it now) on the next line.  Tests only. */
void vmm__log_set_fd_for_test(int fd);

/* strerror without its static buffer or allocation; returns buf or a constant string. */
const char *vmm__strerror(int err, char *buf, size_t len);

#endif
