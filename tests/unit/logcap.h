/* Capturing what vmm__log writes, for the tests of logging and options.  Header-only, for
 * tests/unit only; the test sets cap_fd (a memfd) before the first cap_begin(). */
#ifndef VMM_TEST_LOGCAP_H
#define VMM_TEST_LOGCAP_H
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

#include "core/log.h"
#include "core/options.h"

static int cap_fd = -1;
static char cap_buf[1 << 20];

/* Captures everything the log writes from here until cap_text(). */
static inline void cap_begin(void)
{
    if (ftruncate(cap_fd, 0) != 0 || lseek(cap_fd, 0, SEEK_SET) != 0) abort();
    vmm__log_set_fd_for_test(cap_fd); /* also forgets the rate cap, so no case is throttled */
}

static inline const char *cap_text(void)
{
    off_t n = lseek(cap_fd, 0, SEEK_CUR);
    if (n < 0 || (size_t)n >= sizeof cap_buf || pread(cap_fd, cap_buf, (size_t)n, 0) != n) abort();
    cap_buf[n] = 0;
    return cap_buf;
}

static inline int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

/* Every VMMSHIM_* variable unset, so a case sees only what it sets. */
static inline void clear_env(void)
{
    for (int id = 0; id < VMM__OPT_COUNT; id++) unsetenv(vmm__opt_name((vmm__opt_id)id));
}
#endif
