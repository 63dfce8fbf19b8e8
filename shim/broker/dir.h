/* The broker's directory (dir.c), for broker.c only. */
#ifndef VMM_BROKER_DIR_H
#define VMM_BROKER_DIR_H
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* One warning line until vmm__broker_warn_again (a fork child): a broker that cannot start is
 * retried on later allocations. */
void vmm__broker_warn_start(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void vmm__broker_warn_again(void);
/* A group named by number or by name: 0, or -1. */
int vmm__broker_resolve_group(const char *name, gid_t *gid);
/* The directory the sockets go in: 0, or -1 (said). */
int vmm__broker_choose_dir(char *dir, size_t len);
/* dir made or checked (ours, not writable by others, not a symlink; given to the group): an fd of
 * it, or -1 (said). */
int vmm__broker_open_dir(const char *dir, bool have_group, gid_t gid);
/* Best effort: "<pid>.sock" files of dead pids that nobody listens on go. */
void vmm__broker_remove_stale(int dirfd, const char *dir);
#endif
