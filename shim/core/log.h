/* One-line log messages: "vmmshim: <level>: <text>\n", written with a single write(2) so
 * lines from many threads and processes never interleave.  Callable before main, inside
 * hooks and from the options code itself; never allocates and preserves errno. */
#ifndef VMM_CORE_LOG_H
#define VMM_CORE_LOG_H

#include <stdbool.h>
#include <stddef.h>

/* the levels, vmm__strerror and vmm__log_set_fd_for_test */
#include "core/line.h"

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

#endif
