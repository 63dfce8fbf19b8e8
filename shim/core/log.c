/* The log as the rest of the project sees it: messages filtered by VMMSHIM_LOG_LEVEL and written
 * to VMMSHIM_LOG_FILE.  It is the one part of the logging that reads the options, kept apart from
 * the line writer below it (line.c) so that the options loader, which writes its warnings there,
 * and the log never call each other.  Nothing allocates, no lock is taken and errno is kept:
 * this runs inside CUDA hooks and before main. */
#include "core/log.h"
#include "core/options.h"

#include <errno.h>
#include <stdarg.h>

/* Where the next line goes.  Before the options can be read (or while this thread is the one
 * loading them) that is stderr, without settling anything. */
static int log_fd(bool options_usable)
{
    return vmm__line_fd(options_usable ? vmm__opt_str(VMM__OPT_LOG_FILE) : NULL);
}

static bool enabled(vmm__log_level level, bool options_usable)
{
    int max = options_usable ? vmm__opt_enum(VMM__OPT_LOG_LEVEL) : VMM__LOG_WARNING;
    return (int)level <= max;
}

bool vmm__log_enabled(vmm__log_level level)
{
    int saved = errno;
    bool on = enabled(vmm__line_clamp(level), vmm__opt_usable());
    errno = saved;
    return on;
}

void vmm__log(vmm__log_level level, const char *fmt, ...)
{
    int saved = errno;
    bool usable = vmm__opt_usable();
    level = vmm__line_clamp(level);
    if (enabled(level, usable)) {
        va_list ap;
        va_start(ap, fmt);
        vmm__line_limited(log_fd(usable), level, fmt, ap);
        va_end(ap);
    }
    errno = saved;
}

void vmm__log_print(vmm__log_level level, const char *fmt, ...)
{
    int saved = errno;
    va_list ap;
    va_start(ap, fmt);
    vmm__line_prefixed(log_fd(vmm__opt_usable()), vmm__line_prefix(level), fmt, ap);
    va_end(ap);
    errno = saved;
}

void vmm__log_report(const char *fmt, ...)
{
    int saved = errno;
    va_list ap;
    va_start(ap, fmt);
    vmm__line_prefixed(log_fd(vmm__opt_usable()), "vmmshim: ", fmt, ap);
    va_end(ap);
    errno = saved;
}
