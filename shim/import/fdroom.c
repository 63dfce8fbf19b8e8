/* Room in the fd table before the first take.  A broker reply brings up to VMM_BROKER_MAX_FDS
 * handles by SCM_RIGHTS, and the kernel installs them all inside recvmsg.  When they do not fit
 * the fd table, the table is reallocated, and in a process of several threads the kernel waits
 * for an RCU grace period before freeing the old one: 5 to 30 ms on an H200 host, inside the
 * first take of a cold companion (measured: the owner sent its reply 0.2 ms after the request,
 * the companion's recvmsg returned 28 ms later; the next one, with no growth, took 12 us).
 * Tables only grow, so growing once, early and off the caller's thread, takes that wait out of
 * every take.  What it costs is the table itself: a pointer and two bits an fd. */
#include "import/fdroom.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include "broker/protocol.h"
#include "core/thread.h"

/* The highest fd open now, or -1 when /proc is not there to say. */
static int highest_fd(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int top = -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        char *end;
        long fd = strtol(e->d_name, &end, 10);
        if (end != e->d_name && !*end && fd > top && fd < 1 << 30) top = (int)fd;
    }
    closedir(d);
    return top;
}

static void *grow(void *arg)
{
    (void)arg;
    int top = highest_fd();
    struct rlimit rl;
    if (top < 0 || getrlimit(RLIMIT_NOFILE, &rl) != 0) return NULL;
    /* a reply's handles, those of a reply still being imported by worker threads, and the fds
     * the program opens meanwhile (CUDA's own, when the registry is opened before CUDA starts) */
    unsigned long want = (unsigned long)top + 3 * VMM_BROKER_MAX_FDS;
    if (rl.rlim_cur != RLIM_INFINITY && want >= rl.rlim_cur) want = rl.rlim_cur - 1;
    if (want <= (unsigned long)top) return NULL;
    int fd = fcntl(0, F_DUPFD_CLOEXEC, (int)want);
    if (fd < 0) fd = fcntl(top, F_DUPFD_CLOEXEC, (int)want); /* fd 0 closed: any open one will do */
    if (fd >= 0) close(fd);
    return NULL;
}

static void start(void)
{
    pthread_t th;
    if (vmm__thread_detached(&th, grow, NULL) != 0) (void)grow(NULL);
}

void vmm__fd_room_grow(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, start);
}
