/* Replays inputs through one fuzz target's LLVMFuzzerTestOneInput without libFuzzer, so the
 * plain, ASan and UBSan builds of `make check` run every seed and every crash regression.
 *
 *   test_fuzz_<target> [FILE|DIR...]
 *
 * Without arguments: tests/fuzz/corpus/<target>/ and tests/fuzz/regress/<target>/, relative to the
 * repository root (tests/run.sh runs from there); the target's name comes from the program's.
 * Each input runs in a child of its own, from a heap copy of exactly its size, so a crash, a hang
 * (60 s) or, under ASan, a leak fails that input alone and names it. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define PREFIX "test_fuzz_"
#define INPUT_SECONDS 60

static int passed, failed;

static int read_file(const char *path, uint8_t **data, size_t *size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) return -1;
    *size = (size_t)st.st_size;
    *data = malloc(*size ? *size : 1);
    size_t have = 0;
    while (*data && have < *size) {
        ssize_t n = read(fd, *data + have, *size - have);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        have += (size_t)n;
    }
    close(fd);
    return *data && have == *size ? 0 : -1;
}

static void run_one(const char *path)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        printf("FAIL %s: fork: %s\n", path, strerror(errno));
        failed++;
        return;
    }
    if (pid == 0) {
        uint8_t *data;
        size_t size;
        if (read_file(path, &data, &size) != 0) {
            printf("FAIL %s: cannot read it\n", path);
            fflush(stdout);
            _exit(2);
        }
        alarm(INPUT_SECONDS);
        LLVMFuzzerTestOneInput(data, size);
        free(data);
        exit(0); /* exit, not _exit: LeakSanitizer runs at exit */
    }
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        passed++;
        return;
    }
    failed++;
    if (WIFSIGNALED(status))
        printf("FAIL %s: killed by signal %d%s\n", path, WTERMSIG(status),
                WTERMSIG(status) == SIGALRM ? " (ran over 60 s)" : "");
    else
        printf("FAIL %s: exit status %d\n", path, WEXITSTATUS(status));
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every regular file of a directory, in name order so failures read the same on every run.
 * Returns the number of inputs run, or -1 when the directory cannot be read. */
static int run_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **grown = realloc(names, cap * sizeof *names);
            if (!grown) break;
            names = grown;
        }
        size_t len = strlen(dir) + strlen(de->d_name) + 2;
        if (!(names[n] = malloc(len))) break;
        snprintf(names[n++], len, "%s/%s", dir, de->d_name);
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, by_name);
    int ran = 0;
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        if (stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
            run_one(names[i]);
            ran++;
        }
        free(names[i]);
    }
    free(names);
    return ran;
}

int main(int argc, char **argv)
{
    const char *self = strrchr(argv[0], '/');
    self = self ? self + 1 : argv[0];
    const char *target = strncmp(self, PREFIX, strlen(PREFIX)) == 0 ? self + strlen(PREFIX) : self;
    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            struct stat st;
            if (stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode)) {
                if (run_dir(argv[i]) < 0) {
                    printf("FAIL %s: cannot read it\n", argv[i]);
                    failed++;
                }
            } else {
                run_one(argv[i]);
            }
        }
    } else {
        char seeds[256], regress[256];
        snprintf(seeds, sizeof seeds, "tests/fuzz/corpus/%s", target);
        snprintf(regress, sizeof regress, "tests/fuzz/regress/%s", target);
        int s = run_dir(seeds);
        if (s <= 0) {
            printf("FAIL %s: no seeds there (run from the repository root)\n", seeds);
            failed++;
        }
        int r = run_dir(regress); /* absent until this target's first crash */
        printf("stat: %s: %d seeds and %d regression inputs replayed\n", target, s < 0 ? 0 : s, r < 0 ? 0 : r);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
