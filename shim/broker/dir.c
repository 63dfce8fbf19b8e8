/* The broker's directory and socket names: which directory (VMMSHIM_BROKER_DIR, else the user's
 * runtime directory), made or checked so that nobody else can plant a socket there (owner, mode,
 * symlinks, the broker group), and stale sockets of dead processes swept.  Apart from broker.c,
 * which serves requests: none of this runs once the broker listens. */
#include "broker/dir.h"

#include "core/log.h"
#include "core/options.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#define BROKER_STALE_SCAN_MAX 4096 /* directory entries looked at when removing stale sockets */

/* A broker that cannot start is retried on later allocations: it says why once. */
static int warned;

void vmm__broker_warn_start(const char *fmt, ...)
{
    if (__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED)) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    vmm__log(VMM__LOG_WARNING, "%s", line);
}

void vmm__broker_warn_again(void) { __atomic_store_n(&warned, 0, __ATOMIC_RELAXED); }

/* A group named by number or by name; 0 = ok. */
int vmm__broker_resolve_group(const char *name, gid_t *gid)
{
    char *end;
    errno = 0;
    unsigned long n = strtoul(name, &end, 10);
    if (*name && *end == 0 && errno == 0 && n < (unsigned long)UINT32_MAX) {
        *gid = (gid_t)n;
        return 0;
    }
    struct group gr, *res = NULL;
    char buf[4096];
    if (getgrnam_r(name, &gr, buf, sizeof buf, &res) != 0 || !res) return -ENOENT;
    *gid = res->gr_gid;
    return 0;
}

/* The broker directory: the option, else $XDG_RUNTIME_DIR/vmmshim, else /tmp/vmmshim-<uid>. */
int vmm__broker_choose_dir(char *dir, size_t len)
{
    const char *opt = vmm__opt_str(VMM__OPT_BROKER_DIR);
    int n;
    if (opt && *opt) {
        n = snprintf(dir, len, "%s", opt);
    } else {
        const char *xdg = getenv("XDG_RUNTIME_DIR");
        if (xdg && xdg[0] == '/' && access(xdg, W_OK | X_OK) == 0)
            n = snprintf(dir, len, "%s/vmmshim", xdg);
        else
            n = snprintf(dir, len, "/tmp/vmmshim-%u", (unsigned)geteuid());
    }
    if (n < 0 || (size_t)n >= len) return -ENAMETOOLONG;
    /* strip trailing slashes (but keep "/") */
    while (n > 1 && dir[n - 1] == '/') dir[--n] = 0;
    return 0;
}

/* chmod through an O_PATH descriptor: the very inode we checked, whatever happens to the name.
 * /proc/self/fd is the way (fchmod refuses O_PATH); without /proc, chmod the name and check
 * through the descriptor that it was this inode that changed. */
static int chmod_opath(int pfd, const char *dir, mode_t mode)
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", pfd);
    if (chmod(link, mode) != 0) {
        if (errno != ENOENT) return -errno;
        if (chmod(dir, mode) != 0) return -errno;
    }
    struct stat st;
    if (fstat(pfd, &st) != 0) return -errno;
    return (st.st_mode & 07777) == mode ? 0 : -EAGAIN;
}

/* Create (or accept) the directory and open it.  Refuses a symlink, a non-directory, a
 * directory owned by another user, and one that others may write to.  Returns a directory fd
 * (readable when we may read it, else O_PATH: good for the *at calls either way). */
int vmm__broker_open_dir(const char *dir, bool have_group, gid_t gid)
{
    mode_t want = have_group ? 0750 : 0700;
    bool created = false;
    char eb[96];
    if (mkdir(dir, want) == 0) {
        created = true;
    } else if (errno != EEXIST) {
        int e = errno;
        vmm__broker_warn_start("broker: cannot create directory %s: %s", dir, vmm__strerror(e, eb, sizeof eb));
        return -e;
    }
    struct stat ls, st;
    if (lstat(dir, &ls) != 0) {
        int e = errno;
        vmm__broker_warn_start("broker: cannot stat directory %s: %s", dir, vmm__strerror(e, eb, sizeof eb));
        return -e;
    }
    if (S_ISLNK(ls.st_mode) || !S_ISDIR(ls.st_mode)) {
        vmm__broker_warn_start("broker: %s %s; refusing it", dir, S_ISLNK(ls.st_mode) ? "is a symlink" : "is not a directory");
        return -ENOTDIR;
    }
    /* O_PATH: needs no permission on the directory itself, which the umask may have left at
     * 0000 for now. */
    int pfd = open(dir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (pfd < 0) {
        int e = errno;
        vmm__broker_warn_start("broker: cannot open directory %s: %s", dir, vmm__strerror(e, eb, sizeof eb));
        return -e;
    }
    /* the directory we opened must be the one we checked (no swap in between) */
    if (fstat(pfd, &st) != 0 || st.st_dev != ls.st_dev || st.st_ino != ls.st_ino || !S_ISDIR(st.st_mode)) {
        close(pfd);
        vmm__broker_warn_start("broker: directory %s changed while being opened; refusing it", dir);
        return -EAGAIN;
    }
    if (st.st_uid != geteuid()) {
        close(pfd);
        vmm__broker_warn_start("broker: directory %s is owned by uid %u, not by this user; refusing it", dir, (unsigned)st.st_uid);
        return -EACCES;
    }
    if (st.st_mode & 0022) {
        close(pfd);
        vmm__broker_warn_start("broker: directory %s has mode %03o (writable by others); refusing it", dir,
                   (unsigned)(st.st_mode & 0777));
        return -EACCES;
    }
    /* Ours: set group and mode explicitly (mkdir applied the umask); never call umask(). */
    if (have_group && st.st_gid != gid && fchownat(pfd, "", (uid_t)-1, gid, AT_EMPTY_PATH) != 0) {
        int e = errno;
        close(pfd);
        vmm__broker_warn_start("broker: cannot give directory %s to the broker group: %s", dir, vmm__strerror(e, eb, sizeof eb));
        return -e;
    }
    if ((created || have_group) && (st.st_mode & 07777) != want) {
        int rc = chmod_opath(pfd, dir, want);
        if (rc) {
            close(pfd);
            vmm__broker_warn_start("broker: cannot chmod directory %s: %s", dir, vmm__strerror(-rc, eb, sizeof eb));
            return rc;
        }
    }
    int fd = openat(pfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return pfd; /* e.g. an existing 0300 directory: no stale-socket scan then */
    close(pfd);
    return fd;
}

/* Is there a listener on this socket?  A non-blocking connect answers at once. */
static bool socket_has_listener(const char *path)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof sa.sun_path) return true; /* cannot tell: keep it */
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) return true;
    int rc = connect(s, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    close(s);
    return rc == 0 || (e != ECONNREFUSED && e != ENOENT);
}

/* Best effort: remove "<pid>.sock" files whose pid is gone and nobody listens on. */
void vmm__broker_remove_stale(int dirfd, const char *dir)
{
    int fd = dup(dirfd);
    if (fd < 0) return;
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return;
    }
    pid_t self = getpid();
    struct dirent *de;
    for (int seen = 0; seen < BROKER_STALE_SCAN_MAX && (de = readdir(d)) != NULL; seen++) {
        const char *n = de->d_name;
        char *end;
        if (n[0] < '1' || n[0] > '9') continue;
        errno = 0;
        unsigned long pid = strtoul(n, &end, 10);
        if (errno || strcmp(end, ".sock") != 0 || pid > INT32_MAX || (pid_t)pid == self) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* alive (or not ours to judge) */
        struct stat st;
        if (fstatat(dirfd, n, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISSOCK(st.st_mode) || st.st_uid != geteuid())
            continue;
        /* The pid may be alive in another pid namespace sharing this directory: a listener says so. */
        char full[PATH_MAX];
        if (snprintf(full, sizeof full, "%s/%s", dir, n) >= (int)sizeof full) continue;
        if (socket_has_listener(full)) continue;
        (void)unlinkat(dirfd, n, 0);
    }
    closedir(d);
}
