/* Running programs from the tests: capture their output, and preload the shim the way a user
 * would (behind the ASan runtime in the ASan build).  Header-only, for tests/unit only. */
#ifndef VMM_TEST_SPAWN_H
#define VMM_TEST_SPAWN_H
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Run argv with extra environment ("K=V" strings, NULL-terminated); capture stdout and stderr
 * (output past the buffers is read and dropped, so a chatty child never blocks).  A child still
 * running after timeout_s is killed.  Returns the exit status, or 128 + signal. */
static inline int spawn_capture(char *const argv[], const char *const env[], char *out, size_t outlen, char *err,
                                size_t errlen, unsigned timeout_s)
{
    int po[2], pe[2];
    if (pipe(po) || pipe(pe)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(po[1], 1);
        dup2(pe[1], 2);
        close(po[0]);
        close(pe[0]);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        alarm(timeout_s);
        execv(argv[0], argv);
        _exit(127);
    }
    close(po[1]);
    close(pe[1]);
    struct pollfd fds[2] = {{.fd = po[0], .events = POLLIN}, {.fd = pe[0], .events = POLLIN}};
    char *buf[2] = {out, err};
    size_t len[2] = {outlen, errlen}, used[2] = {0, 0};
    for (int open_fds = 2; open_fds > 0;) {
        if (poll(fds, 2, -1) < 0) break;
        for (int i = 0; i < 2; i++) {
            if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            char sink[4096];
            size_t room = len[i] - 1 - used[i];
            ssize_t n = room ? read(fds[i].fd, buf[i] + used[i], room) : read(fds[i].fd, sink, sizeof sink);
            if (n > 0 && room) used[i] += (size_t)n;
            if (n <= 0) {
                close(fds[i].fd);
                fds[i].fd = -1;
                open_fds--;
            }
        }
    }
    out[used[0]] = 0;
    err[used[1]] = 0;
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static inline int spawn__find_sanitizer(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    if (!strstr(info->dlpi_name, "libasan.so") && !strstr(info->dlpi_name, "libtsan.so")) return 0;
    snprintf(data, 300, "%s", info->dlpi_name);
    return 1;
}

/* "LD_PRELOAD=<shim>" — with the ASan or TSan runtime this test runs with in front of it, since
 * a sanitizer runtime must come first in the initial library list (and the shim's dlsym, asked
 * by the runtime for what comes after it, must find libc's functions, not the runtime's). */
static inline void spawn_preload(char *buf, size_t len, const char *shim)
{
    char san[300] = "";
    dl_iterate_phdr(spawn__find_sanitizer, san);
    snprintf(buf, len, "LD_PRELOAD=%s%s%s", san, *san ? " " : "", shim);
}
#endif
