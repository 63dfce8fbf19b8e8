/* Thread tags across fork (shim/backing/tags.c): a fork while another thread holds the lock that
 * guards the tag names must not leave the child's copy of that lock held by a thread the child
 * does not have.  A thread of this test holds the lock (reachable: tags.c is included) while the
 * main thread forks; the child's first new tag must come back (within 5 s, else SIGALRM kills it),
 * see its parent's names, and take the next number; the parent's table is unchanged.  Without
 * tags.c's fork handlers the child waits forever and this test fails. */
#include "../../shim/backing/tags.c" /* test equipment: names_lock stays reachable */
#include "check.h"

#include <signal.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* What tags.c needs of the rest of the backing, which this test does not link. */
vmm__state vmm__S = {.lock = PTHREAD_MUTEX_INITIALIZER};
__thread uint32_t vmm__thread_tag __attribute__((tls_model("initial-exec")));
void vmm__pair_init_locked(device_state *d, vmm__pool *pair, uint32_t tag)
{
    (void)d;
    (void)pair;
    (void)tag;
}
void vmm__pool_destroy(vmm__pool *p) { (void)p; }

static int held[2]; /* the holder writes a byte once it holds the lock */

static void *holder(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&names_lock);
    (void)!write(held[1], "h", 1);
    struct timespec ts = {0, 200 * 1000 * 1000};
    nanosleep(&ts, NULL); /* the fork comes meanwhile */
    pthread_mutex_unlock(&names_lock);
    return NULL;
}

/* A fork while the holder holds the lock: 0 when the child's tags worked, 1 when they were wrong,
 * 128 + the signal that ended a child that never answered (SIGALRM: it waited for the lock). */
static int fork_while_held(void)
{
    pthread_t th;
    char c;
    int answer[2];
    CHECK(pipe(held) == 0 && pipe(answer) == 0, "pipe");
    CHECK(pthread_create(&th, NULL, holder, NULL) == 0, "pthread_create");
    CHECK(read(held[0], &c, 1) == 1, "the holder never took the lock");
    pid_t pid = fork();
    if (pid == 0) {
        alarm(5);
        uint32_t t = 0, p = 0;
        int rc = vmm__tag_number("child", &t);
        int rp = vmm__tag_number("parent", &p);
        /* the answer goes through a pipe, and the child leaves by the raw system call: TSan's checks
         * at _exit would count the holder thread (absent here) as leaked and change the status */
        (void)!write(answer[1], rc == 0 && t == 2 && rp == 0 && p == 1 ? "0" : "1", 1);
        syscall(SYS_exit_group, 0);
    }
    close(answer[1]);
    int st = 0;
    CHECK(pid > 0 && waitpid(pid, &st, 0) == pid, "fork");
    pthread_join(th, NULL);
    char got = 0;
    int n = (int)read(answer[0], &got, 1);
    close(answer[0]);
    close(held[0]);
    close(held[1]);
    if (n == 1) return got - '0';
    return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : 1;
}

int main(void)
{
    uint32_t t = 0;
    CHECK(vmm__tag_number("parent", &t) == 0 && t == 1, "the parent's first tag: %u", t);
    int st = fork_while_held();
    CHECK(st == 0, "the child of a fork while the names' lock was held: exit %d (%s)", st,
          st == 128 + SIGALRM ? "it waited for the lock forever" : "its tags were wrong");
    /* and again: the handlers hold for every fork, not only the first */
    st = fork_while_held();
    CHECK(st == 0, "a second such fork: exit %d", st);
    /* the parent's own table is as it was: the child's name is not in it */
    CHECK(vmm__tag_find("child") == 0, "the child's tag leaked into the parent");
    CHECK(vmm__tag_number("second", &t) == 0 && t == 2, "the parent's next tag: %u", t);
    CHECK(vmm__tag_find("parent") == 1, "the parent's first tag");
    CHECK_DONE();
}
