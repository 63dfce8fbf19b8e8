/* What a user sees of a process under the shim, over the emulated driver: the registry named
 * without its leading '/'. */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "spawn.h"
#include "vmmshim.h"

static char build[512], shim[600], preload[700], registry[64], reg_env[96];

/* A program under the shim that talks on stdin/stdout; its stderr goes to a file read at the end. */
typedef struct child {
    pid_t pid;
    FILE *in, *out, *err;
} child;

static int child_start(child *c, char *const argv[], const char *const env[])
{
    int pi[2], po[2];
    memset(c, 0, sizeof *c);
    c->err = tmpfile();
    if (!c->err || pipe(pi) || pipe(po)) return -1;
    fflush(stdout);
    c->pid = fork();
    if (c->pid == 0) {
        dup2(pi[0], 0);
        dup2(po[1], 1);
        dup2(fileno(c->err), 2);
        close(pi[1]);
        close(po[0]);
        putenv(preload);
        putenv(reg_env);
        for (int i = 0; env && env[i]; i++) putenv((char *)env[i]);
        alarm(120);
        execv(argv[0], argv);
        _exit(127);
    }
    close(pi[0]);
    close(po[1]);
    c->in = fdopen(pi[1], "w");
    c->out = fdopen(po[0], "r");
    return c->pid > 0 && c->in && c->out ? 0 : -1;
}

/* The next line of the child's stdout that starts with `prefix`; "" at its end. */
static const char *child_line(child *c, const char *prefix, char *buf, size_t len)
{
    while (fgets(buf, (int)len, c->out))
        if (!strncmp(buf, prefix, strlen(prefix))) return buf;
    buf[0] = 0;
    return buf;
}

static void child_say(child *c, const char *line)
{
    fprintf(c->in, "%s\n", line);
    fflush(c->in);
}

/* Waits for the child; its stderr into err.  Returns its exit status (128 + signal). */
static int child_end(child *c, char *err, size_t errlen)
{
    fclose(c->in);
    fclose(c->out);
    int st = 0;
    waitpid(c->pid, &st, 0);
    rewind(c->err);
    size_t n = fread(err, 1, errlen - 1, c->err);
    err[n] = 0;
    fclose(c->err);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static char owner[600]; /* tests/progs/owner: allocates the sizes it is given, then waits for commands */

/* VMMSHIM_REGISTRY=name (no leading '/') is the registry /name, without a warning. */
static void test_registry_name(void)
{
    char line[256], err[4096], bare[96];
    char *argv[] = {owner, "1", NULL};
    snprintf(bare, sizeof bare, "VMMSHIM_REGISTRY=%s", registry + 1);
    const char *env[] = {bare, NULL};
    child c;
    int started = child_start(&c, argv, env) == 0;
    CHECK(started, "owner did not start");
    if (!started) return;
    unsigned long long addr = 0;
    int pid = 0;
    CHECK(sscanf(child_line(&c, "ready", line, sizeof line), "ready %d %llx", &pid, &addr) == 2, "owner: %s", line);
    vmm_registry *reg = NULL;
    vmm_alloc_info a;
    CHECK(vmm_open(registry, &reg) == VMM_OK && vmm_find(reg, (uint32_t)pid, addr, &a) == VMM_OK &&
              (a.handle_kinds & VMM_KIND_BROKER),
          "not published in %s: %s", registry, vmm_last_error());
    if (reg) vmm_close(reg);
    child_say(&c, "quit");
    CHECK(child_end(&c, err, sizeof err) == 0 && !strstr(err, "vmmshim"), "owner under VMMSHIM_REGISTRY=%s: %s",
          registry + 1, err);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(build, sizeof build, "%s", b ? b : "build");
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", build);
    spawn_preload(preload, sizeof preload, shim);
    snprintf(owner, sizeof owner, "%s/progs/owner", build);
    snprintf(registry, sizeof registry, "/vmmshim-tstats-%d", (int)getpid());
    snprintf(reg_env, sizeof reg_env, "VMMSHIM_REGISTRY=%s", registry);
    test_registry_name();
    shm_unlink(registry);
    CHECK_DONE();
}
