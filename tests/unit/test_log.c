/* Logging: prefixes and level filtering, one line whatever the message holds, truncation,
 * VMMSHIM_LOG_FILE, the rate cap, errno, whole lines from many threads, and logging before
 * main while the options are still unloaded (the loader's own warning goes through the log). */
#include "core/log.h"
#include "core/options.h"

#include "check.h"
#include "logcap.h"

#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static char tmpdir[64];

static void set_level(const char *level)
{
    clear_env();
    if (level) setenv("VMMSHIM_LOG_LEVEL", level, 1);
    vmm__opt_reload_for_test();
}

static unsigned now_second(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned)ts.tv_sec;
}

static void wait_next_second(void)
{
    unsigned s = now_second();
    while (now_second() == s) usleep(2000);
}

/* ------------------------------------------------------------------------------------- */

/* Before main: the first line is also the first use of the options, whose loader warns
 * about a bad value through this same log while holding its pthread_once. */
static int early_fd = -1;
__attribute__((constructor)) static void log_before_main(void)
{
    clear_env();
    setenv("VMMSHIM_FRAMES", "many", 1);
    early_fd = memfd_create("early", MFD_CLOEXEC);
    vmm__log_set_fd_for_test(early_fd);
    vmm__warn("before main %d", 1);
    vmm__log_set_fd_for_test(-1);
    unsetenv("VMMSHIM_FRAMES");
}

static void test_before_main(void)
{
    char buf[1024];
    ssize_t n = pread(early_fd, buf, sizeof buf - 1, 0);
    buf[n > 0 ? n : 0] = 0;
    CHECK_EQ(count_lines(buf), 2);
    CHECK(strstr(buf, "vmmshim: warning: VMMSHIM_FRAMES='many' is not an integer") == buf, "%s", buf);
    CHECK(strstr(buf, "\nvmmshim: warning: before main 1\n") != NULL, "%s", buf);
    close(early_fd);
}

static void test_levels(void)
{
    set_level(NULL);
    cap_begin();
    vmm__error("e %d", 1);
    vmm__warn("w %s", "2");
    vmm__info("i");
    vmm__debug("d");
    CHECK(strcmp(cap_text(), "vmmshim: error: e 1\nvmmshim: warning: w 2\n") == 0, "%s", cap_buf);
    CHECK(vmm__log_enabled(VMM__LOG_ERROR) && vmm__log_enabled(VMM__LOG_WARNING), "default level");
    CHECK(!vmm__log_enabled(VMM__LOG_INFO) && !vmm__log_enabled(VMM__LOG_DEBUG), "default level");

    set_level("debug");
    cap_begin();
    vmm__error("e");
    vmm__warn("w");
    vmm__info("i");
    vmm__debug("d");
    CHECK(strcmp(cap_text(), "vmmshim: error: e\nvmmshim: warning: w\nvmmshim: info: i\nvmmshim: debug: d\n") == 0,
          "%s", cap_buf);
    CHECK(vmm__log_enabled(VMM__LOG_DEBUG), "debug");

    set_level("error");
    cap_begin();
    vmm__error("e");
    vmm__warn("w");
    vmm__info("i");
    CHECK(strcmp(cap_text(), "vmmshim: error: e\n") == 0, "%s", cap_buf);
    CHECK(!vmm__log_enabled(VMM__LOG_WARNING), "error only");

    set_level("info");
    cap_begin();
    vmm__info("i");
    vmm__debug("d");
    vmm__log_print(VMM__LOG_DEBUG, "asked for"); /* VERBOSE output ignores the level */
    CHECK(strcmp(cap_text(), "vmmshim: info: i\nvmmshim: debug: asked for\n") == 0, "%s", cap_buf);

    /* VMMSHIM_STATS's report has no level, and takes no budget of any: all 60 lines come out */
    set_level("error");
    cap_begin();
    for (int i = 0; i < 60; i++) vmm__log_report("stats: %d", i);
    CHECK(count_lines(cap_text()) == 60 && strncmp(cap_buf, "vmmshim: stats: 0\n", 18) == 0 &&
              strstr(cap_buf, "vmmshim: stats: 59\n"),
          "%s", cap_buf);
    set_level(NULL);
}

static void test_one_line(void)
{
    static char big[4096];
    cap_begin();
    vmm__warn("a\nb\r\nc\n");
    CHECK(strcmp(cap_text(), "vmmshim: warning: a b  c \n") == 0, "%s", cap_buf);

    /* The longest text that fits: 512 bytes with the prefix and the newline. */
    const size_t fit = 512 - strlen("vmmshim: warning: ") - 1;
    memset(big, 'x', sizeof big - 1);
    cap_begin();
    vmm__warn("%.*s", (int)fit, big);
    CHECK_EQ(strlen(cap_text()), 512);
    CHECK(cap_buf[510] == 'x' && cap_buf[511] == '\n', "not truncated");

    cap_begin();
    vmm__warn("%.*s", (int)fit + 1, big);
    CHECK_EQ(strlen(cap_text()), 512);
    CHECK(strcmp(cap_buf + 508, "...\n") == 0, "%s", cap_buf + 500);

    cap_begin();
    vmm__error("%s\n%s", big, big);
    CHECK_EQ(count_lines(cap_text()), 1);
    CHECK(strlen(cap_buf) <= 512 && strncmp(cap_buf, "vmmshim: error: xxx", 19) == 0, "%zu", strlen(cap_buf));
    CHECK(strcmp(cap_buf + strlen(cap_buf) - 4, "...\n") == 0, "ends in ...");

    /* Cut between characters, not inside one. */
    char utf8[1200] = "";
    for (int i = 0; i < 500; i++) strcat(utf8, "\xc3\xa9");
    cap_begin();
    vmm__warn("x%s", utf8); /* the cut would fall on the second byte of a character */
    size_t n = strlen(cap_text());
    CHECK(n <= 512 && strcmp(cap_buf + n - 4, "...\n") == 0, "utf8 cut");
    CHECK(((unsigned char)cap_buf[n - 5] & 0xC0) != 0xC0, "half a character before ...");
    CHECK((n - 4 - strlen("vmmshim: warning: x")) % 2 == 0, "odd byte count");
}

static void test_errno(void)
{
    set_level(NULL);
    cap_begin();
    errno = EDOM;
    vmm__warn("printed");
    CHECK_EQ(errno, EDOM);
    errno = ERANGE;
    vmm__debug("filtered");
    CHECK_EQ(errno, ERANGE);
    errno = EBADF;
    CHECK(vmm__log_enabled(VMM__LOG_ERROR), "enabled");
    CHECK_EQ(errno, EBADF);
    errno = EACCES;
    vmm__log_set_fd_for_test(999); /* a closed fd: the write fails */
    vmm__error("lost");
    CHECK_EQ(errno, EACCES);
}

static int find_fd_of(const char *path)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int found = -1;
    while (d && (e = readdir(d)) != NULL) {
        char link[300], target[4096];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        if (strcmp(target, path) == 0) found = atoi(e->d_name);
    }
    if (d) closedir(d);
    return found;
}

static void test_log_file(void)
{
    char path[128], other[128], buf[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/vmm.log", tmpdir);
    snprintf(other, sizeof other, "%s/other", tmpdir);
    FILE *f = fopen(path, "w");
    fputs("earlier\n", f);
    fclose(f);
    chmod(path, 0600);

    clear_env();
    setenv("VMMSHIM_LOG_FILE", path, 1);
    vmm__opt_reload_for_test();
    vmm__log_set_fd_for_test(-1);
    vmm__warn("to the file %d", 1);
    vmm__error("and again");
    f = fopen(path, "r");
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    CHECK(strcmp(buf, "earlier\nvmmshim: warning: to the file 1\nvmmshim: error: and again\n") == 0, "%s", buf);

    /* The application closes our fd and the number comes back for its own file: the log must
     * not write into that file. */
    int fd = find_fd_of(path);
    CHECK(fd > 2, "log fd %d", fd);
    if (fd > 2) {
        close(fd);
        int app = open(other, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (app != fd) { dup2(app, fd); close(app); }
        vmm__warn("after the swap");
        CHECK(stat(other, &st) == 0 && st.st_size == 0, "wrote into the application's file");
        close(fd);
        f = fopen(path, "r");
        n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        CHECK(strstr(buf, "vmmshim: warning: after the swap\n") != NULL, "%s", buf);
    }

    /* A new file is created 0600. */
    unlink(path);
    vmm__log_set_fd_for_test(-1);
    vmm__warn("fresh");
    CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600, "mode %o", st.st_mode & 0777);

    /* Cannot open it: stderr, and one line saying so. */
    setenv("VMMSHIM_LOG_FILE", "/nonexistent-dir/vmm.log", 1);
    vmm__opt_reload_for_test();
    int saved = dup(STDERR_FILENO);
    if (ftruncate(cap_fd, 0) != 0 || lseek(cap_fd, 0, SEEK_SET) != 0) abort();
    dup2(cap_fd, STDERR_FILENO);
    vmm__log_set_fd_for_test(-1);
    vmm__warn("one");
    vmm__warn("two");
    dup2(saved, STDERR_FILENO);
    close(saved);
    const char *t = cap_text();
    CHECK_EQ(count_lines(t), 3);
    CHECK(strncmp(t, "vmmshim: warning: cannot open log file '/nonexistent-dir/vmm.log' (No such file or "
                     "directory); logging to stderr\n", 100) == 0, "%s", t);
    CHECK(strstr(t, "vmmshim: warning: one\nvmmshim: warning: two\n") != NULL, "%s", t);
    unlink(path);
    unlink(other);
    clear_env();
    vmm__opt_reload_for_test();
}

static void test_rate_cap(void)
{
    char line[128];
    for (int attempt = 0; attempt < 3; attempt++) {
        set_level(NULL);
        cap_begin();
        wait_next_second();
        unsigned s = now_second();
        for (int i = 0; i < 500; i++) vmm__warn("burst %d", i);
        vmm__error("other levels keep their own budget");
        bool same_second = now_second() == s;
        const char *t = cap_text();
        int lines = count_lines(t);
        if (!same_second) continue; /* a very slow machine: try again */
        CHECK_EQ(lines, 51);
        CHECK(strstr(t, "vmmshim: warning: burst 49\n") && !strstr(t, "burst 50\n"), "%s", t);
        CHECK(strstr(t, "vmmshim: error: other levels keep their own budget\n") != NULL, "%s", t);
        wait_next_second();
        vmm__info("filtered: no report yet");
        CHECK_EQ(count_lines(cap_text()), 51);
        vmm__warn("next second");
        t = cap_text();
        snprintf(line, sizeof line, "vmmshim: warning: %d log lines suppressed\nvmmshim: warning: next second\n", 450);
        CHECK(strlen(t) > strlen(line) && strcmp(t + strlen(t) - strlen(line), line) == 0, "%s", t + 1000);
        CHECK_EQ(count_lines(t), 53);
        return;
    }
    CHECK(0, "500 lines never fit in one second");
}

/* ------------------------------------------------------------------------------------- */
/* Many threads, one pipe: every line must arrive whole.                                  */

#define THREADS 8
#define PER_THREAD 100

static int pipe_fd[2];
static char pipe_buf[1 << 20];
static size_t pipe_len;

static void *reader(void *arg)
{
    (void)arg;
    for (;;) {
        ssize_t r = read(pipe_fd[0], pipe_buf + pipe_len, sizeof pipe_buf - 1 - pipe_len);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        pipe_len += (size_t)r;
    }
    pipe_buf[pipe_len] = 0;
    return NULL;
}

static void payload(char *buf, int t, int seq)
{
    int len = (t * 37 + seq * 53) % 420;
    for (int i = 0; i < len; i++) buf[i] = (char)('a' + (t + seq + i) % 26);
    buf[len] = 0;
}

static void *writer(void *arg)
{
    int t = (int)(long)arg;
    char p[512];
    for (int seq = 0; seq < PER_THREAD; seq++) {
        payload(p, t, seq);
        vmm__log((vmm__log_level)(seq % 4), "T%d S%d %s", t, seq, p);
    }
    return NULL;
}

static void test_threads(void)
{
    static const char *const prefix[] = {"vmmshim: error: ", "vmmshim: warning: ", "vmmshim: info: ",
                                         "vmmshim: debug: "};
    pthread_t w[THREADS], r;
    int seen = 0, suppressed = 0, bad = 0, notes = 0;

    set_level("debug");
    if (pipe(pipe_fd) != 0) abort();
    pthread_create(&r, NULL, reader, NULL);
    vmm__log_set_fd_for_test(pipe_fd[1]);
    for (long t = 0; t < THREADS; t++) pthread_create(&w[t], NULL, writer, (void *)t);
    for (int t = 0; t < THREADS; t++) pthread_join(w[t], NULL);
    wait_next_second();
    vmm__error("end");
    vmm__log_set_fd_for_test(cap_fd);
    close(pipe_fd[1]);
    pthread_join(r, NULL);
    close(pipe_fd[0]);

    CHECK(pipe_len > 0 && pipe_buf[pipe_len - 1] == '\n', "last line cut");
    for (char *line = pipe_buf, *nl; (nl = strchr(line, '\n')) != NULL; line = nl + 1) {
        int t, seq, used = 0;
        unsigned long n;
        char want[640], p[512];
        *nl = 0;
        if (strcmp(line, "vmmshim: error: end") == 0) continue;
        if (sscanf(line, "vmmshim: warning: %lu log lines suppressed%n", &n, &used) == 1 && line[used] == 0) {
            suppressed += (int)n, notes++;
            continue;
        }
        const char *sp = strstr(line, ": T");
        if (!sp || sscanf(sp, ": T%d S%d", &t, &seq) != 2 || t < 0 || t >= THREADS || seq < 0 || seq >= PER_THREAD) {
            if (bad++ < 3) CHECK(0, "stray line: %.80s", line);
            continue;
        }
        payload(p, t, seq);
        snprintf(want, sizeof want, "%sT%d S%d %s", prefix[seq % 4], t, seq, p);
        if (strcmp(line, want) != 0 && bad++ < 3) CHECK(0, "mangled line: %.80s", line);
        seen++;
    }
    CHECK_EQ(bad, 0);
    CHECK(seen >= 4 * 50, "only %d lines got through", seen);
    CHECK(notes >= 1, "no suppressed note");
    CHECK_EQ(seen + suppressed, THREADS * PER_THREAD);
    set_level(NULL);
}

int main(void)
{
    cap_fd = memfd_create("test_log", MFD_CLOEXEC);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/vmmshim-test-log-XXXXXX");
    if (cap_fd < 0 || !mkdtemp(tmpdir)) {
        perror("setup");
        return 1;
    }
    test_before_main();
    test_levels();
    test_one_line();
    test_errno();
    test_log_file();
    test_rate_cap();
    test_threads();
    vmm__log_set_fd_for_test(-1);
    rmdir(tmpdir);
    CHECK_DONE();
}
