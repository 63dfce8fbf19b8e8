/* Who an owner is, and whether it still lives: a pid alone names no process (pids are reused),
 * so an owner is its pid, start time and pid namespace, judged through /proc or, once an entry
 * holds one, through a pidfd (one poll, where /proc costs more than a whole cached import).
 * Also the per-thread timing of vmm_import that every step writes into.  Calls only records.c
 * and the registry: the broker client, the cache and the imports all ask here. */
#include <errno.h>
#include <poll.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <unistd.h>

#include "registry/registry.h"

#include "import/internal.h"

_Thread_local vmm_import_timing vmm__tm;

int vmm__owner_liveness(const vmm_alloc_info *a)
{
    return vmm__reg_liveness(a->pid, a->owner_start_time, a->owner_pidns);
}

vmm_status vmm__owner_dead(const vmm_alloc_info *a)
{
    return set_err(VMM_ERR_OWNER_DEAD, "owner pid %u has exited", a->pid);
}

/* A pidfd of the allocation's owner, or -1.  Opened first and judged after: if the process
 * behind the pid is the owner now, the pidfd is the owner's for good (it never follows a reused
 * pid). */
int vmm__owner_pidfd(const vmm_alloc_info *a)
{
    int fd = (int)syscall(SYS_pidfd_open, (pid_t)a->pid, 0); /* close-on-exec */
    if (fd >= 0 && vmm__owner_liveness(a) != VMM__ALIVE) {
        close(fd);
        fd = -1;
    }
    return fd;
}

void vmm__owner_free(owner_ref *o)
{
    if (o->sock >= 0) close(o->sock);
    if (o->rel_sock >= 0) close(o->rel_sock);
    if (o->pidfd >= 0) close(o->pidfd);
    pthread_mutex_destroy(&o->io);
    pthread_mutex_destroy(&o->rel_io);
    free(o);
}

bool vmm__owner_exited(const owner_ref *o)
{
    if (o->pidfd < 0) return vmm__reg_liveness(o->pid, o->start_time, o->pidns) == VMM__DEAD;
    struct pollfd p = {.fd = o->pidfd, .events = POLLIN};
    int n;
    do n = poll(&p, 1, 0);
    while (n < 0 && errno == EINTR);
    return n > 0; /* a pidfd turns readable when its process exits */
}
