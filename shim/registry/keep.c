/* Keepers (layout.h KEEP; keep.h says who calls what).  The keep file is a shared futex pair
 * (bell, done) plus what readers need to know about the keeper; the lock on its byte 0 is the
 * keeper's liveness, since the kernel drops it when the keeper dies, however it dies. */
#include "registry/keep.h"
#include "registry/internal.h"

#include "registry/seq.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Shared (not private) futexes: the words live in a file two processes map. */
static void futex_wake(uint32_t *w)
{
    (void)syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void futex_wait(uint32_t *w, uint32_t val, uint64_t ns)
{
    struct timespec t = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
    (void)syscall(SYS_futex, w, FUTEX_WAIT, val, &t, NULL, 0);
}

static int keep_name(const vmm__reg *r, uint32_t pid, uint64_t start_time, char *buf, size_t len)
{
    int n = snprintf(buf, len, VMM_REG_KEEP_NAME, r->name, pid, (unsigned long long)start_time);
    return n > 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

/* A write lock on byte 0 held by another open file description: a living keeper. */
static bool locked(int fd)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return false;
    return fl.l_type != F_UNLCK;
}

static bool file_of(const vmm_keep_file *f, uint32_t pid, uint64_t start_time)
{
    return f->magic == VMM_KEEP_MAGIC && f->version >= 1 && f->size >= sizeof *f && f->owner_pid == pid &&
           f->owner_start_time == start_time;
}

/* ------------------------------------------------------------------------------------------ */
/* Owner side                                                                                   */

/* This process's keep file, mapped at the first ring after a keeper claimed it.  A mapping is
 * never unmapped: another thread may be ringing through it (a keeper that changes costs a page). */
static struct {
    pthread_mutex_t lock;
    uint32_t pid, keeper; /* what the mapping was made for; keeper 0: none yet */
    vmm_keep_file *f;     /* NULL: none could be mapped for that keeper */
} own = {.lock = PTHREAD_MUTEX_INITIALIZER};

void vmm__keep_forget_after_fork(void)
{
    pthread_mutex_init(&own.lock, NULL);
    own.pid = own.keeper = 0;
    own.f = NULL;
}

static vmm_keep_file *own_file(vmm__reg *r)
{
    vmm_reg_proc *p = vmm__reg_self(r);
    uint32_t keeper = p ? __atomic_load_n(&p->keeper_pid, __ATOMIC_RELAXED) : 0;
    if (!keeper) return NULL;
    pthread_mutex_lock(&own.lock);
    if (own.keeper != keeper || own.pid != r->pid) {
        own.keeper = keeper;
        own.pid = r->pid;
        own.f = NULL;
        char name[sizeof r->name + 48];
        int fd = keep_name(r, r->pid, r->start_time, name, sizeof name) ? -1
                 : shm_open(name, O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size >= (off_t)sizeof(vmm_keep_file)) {
            void *m = mmap(NULL, sizeof(vmm_keep_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED) {
                vmm_keep_file *f = m;
                if (__atomic_load_n(&f->ready, __ATOMIC_ACQUIRE) == 1 && file_of(f, r->pid, r->start_time))
                    own.f = f;
                else
                    munmap(m, sizeof *f); /* nobody rings through it yet */
            }
        }
        if (fd >= 0) close(fd);
    }
    vmm_keep_file *f = own.f;
    pthread_mutex_unlock(&own.lock);
    return f;
}

static bool beating(const vmm_keep_file *f)
{
    uint64_t hb = __atomic_load_n(&f->heartbeat_ns, __ATOMIC_ACQUIRE);
    return hb && clock_ns(CLOCK_MONOTONIC) - hb < VMM__KEEP_HEARTBEAT_NS;
}

static void ring_wait(vmm_keep_file *f, unsigned wait_ms)
{
    uint32_t b = __atomic_add_fetch(&f->bell, 1, __ATOMIC_ACQ_REL);
    futex_wake(&f->bell);
    if (!wait_ms || !beating(f)) return;
    uint64_t until = clock_ns(CLOCK_MONOTONIC) + (uint64_t)wait_ms * 1000000u;
    for (;;) {
        uint32_t d = __atomic_load_n(&f->done, __ATOMIC_ACQUIRE);
        if ((int32_t)(d - b) >= 0) return;
        uint64_t now = clock_ns(CLOCK_MONOTONIC);
        if (now >= until || __atomic_load_n(&f->state, __ATOMIC_ACQUIRE) != VMM_KEEP_WATCHING) return;
        futex_wait(&f->done, d, until - now);
    }
}

void vmm__keep_ring(vmm__reg *r, unsigned wait_ms)
{
    vmm_keep_file *f = own_file(r);
    if (f) ring_wait(f, wait_ms);
}

bool vmm__keep_exiting(vmm__reg *r, int status)
{
    vmm_keep_file *f = own_file(r);
    if (!f || !beating(f) || __atomic_load_n(&f->state, __ATOMIC_ACQUIRE) != VMM_KEEP_WATCHING) return false;
    f->exit_status = status;
    __atomic_store_n(&f->exit_seen, 1, __ATOMIC_RELEASE);
    /* with a failure, its memory is to be kept: the keeper takes what it has not yet, now */
    ring_wait(f, status != 0 ? VMM__KEEP_EXIT_WAIT_MS : 0);
    return status != 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Readers                                                                                      */

int vmm__keep_read(const vmm__reg *r, uint32_t pid, uint64_t start_time, vmm_keep_file *out)
{
    char name[sizeof r->name + 48];
    if (keep_name(r, pid, start_time, name, sizeof name)) return -ENAMETOOLONG;
    int fd = shm_open(name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0) return -errno;
    vmm_keep_file f;
    ssize_t got = pread(fd, &f, sizeof f, 0);
    int rc = got == (ssize_t)sizeof f && file_of(&f, pid, start_time) ? 0 : -EPROTO;
    if (!rc && !locked(fd)) rc = -ESRCH;
    close(fd);
    if (out && rc != -EPROTO) *out = f;
    return rc;
}

bool vmm__keep_held(const vmm__reg *r, uint32_t pid, uint64_t start_time)
{
    return vmm__keep_read(r, pid, start_time, NULL) == 0;
}

void vmm__keep_unlink_unheld(const vmm__reg *r, uint32_t pid, uint64_t start_time)
{
    char name[sizeof r->name + 48];
    if (!pid || !start_time || keep_name(r, pid, start_time, name, sizeof name)) return;
    int fd = shm_open(name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0) return;
    if (!locked(fd)) shm_unlink(name);
    close(fd);
}

/* A keep file whose owner died and that no keeper holds; one whose owner lives may be claimed
 * right now (the file made, not yet locked). */
static bool keep_file_dead(const vmm__reg *r, const char *name, uint32_t pid, uint64_t start)
{
    (void)r;
    int fd = shm_open(name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0) return false;
    vmm_keep_file f;
    bool ours = pread(fd, &f, sizeof f, 0) == (ssize_t)sizeof f && file_of(&f, pid, start);
    bool dead = ours && !locked(fd) && vmm__reg_liveness(pid, start, f.pidns) == VMM__DEAD;
    close(fd);
    return dead;
}

unsigned vmm__keep_sweep(const vmm__reg *r) { return vmm__reg_sweep_files(r, "keep", false, keep_file_dead); }

int vmm__keep_ask_release(const vmm__reg *r, uint32_t pid, uint64_t start_time, unsigned wait_ms)
{
    char name[sizeof r->name + 48];
    if (keep_name(r, pid, start_time, name, sizeof name)) return -ENAMETOOLONG;
    int fd = shm_open(name, O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0) return -errno;
    struct stat st;
    void *m = MAP_FAILED;
    int rc = fstat(fd, &st) != 0 ? -errno : st.st_size < (off_t)sizeof(vmm_keep_file) ? -EPROTO : 0;
    if (!rc && (m = mmap(NULL, sizeof(vmm_keep_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        rc = -errno;
    vmm_keep_file *f = m == MAP_FAILED ? NULL : m;
    if (!rc && !file_of(f, pid, start_time)) rc = -EPROTO;
    if (!rc && !locked(fd)) rc = -ESRCH;
    if (!rc) {
        __atomic_store_n(&f->release, 1, __ATOMIC_RELEASE);
        __atomic_add_fetch(&f->bell, 1, __ATOMIC_ACQ_REL);
        futex_wake(&f->bell);
        uint64_t until = clock_ns(CLOCK_MONOTONIC) + (uint64_t)wait_ms * 1000000u;
        rc = -ETIMEDOUT;
        while (clock_ns(CLOCK_MONOTONIC) < until) {
            if (!locked(fd) || __atomic_load_n(&f->state, __ATOMIC_ACQUIRE) == VMM_KEEP_RELEASED) {
                rc = 0;
                break;
            }
            struct timespec t = {0, 5 * 1000000};
            nanosleep(&t, NULL);
        }
    }
    if (f) munmap(f, sizeof *f);
    close(fd);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* Keeper side                                                                                  */

/* The slot still holds the owner k keeps. */
static bool still_owner(vmm__reg *r, const vmm__keep *k)
{
    vmm_reg_proc *p = proc_at(r, k->proc_index);
    uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
    return (uint32_t)c == k->owner_pid && (uint32_t)(c >> 32) == k->proc_gen &&
           __atomic_load_n(&p->start_time, __ATOMIC_RELAXED) == k->owner_start_time;
}

int vmm__keep_claim(vmm__reg *r, uint32_t index, const vmm_reg_proc *p, const char *socket, vmm__keep *k,
                    uint32_t *holder, char *err, size_t errlen)
{
    memset(k, 0, sizeof *k);
    k->fd = -1;
    *holder = 0;
    if (!r->writable || index >= r->hdr->proc_capacity) {
        snprintf(err, errlen, "the registry is not open for writing");
        return -EPERM;
    }
    k->proc_index = index;
    k->proc_gen = p->generation;
    k->owner_pid = p->pid;
    k->owner_start_time = p->start_time;
    if (keep_name(r, p->pid, p->start_time, k->name, sizeof k->name)) {
        snprintf(err, errlen, "the keep file's name (registry %s) is too long", r->name);
        return -ENAMETOOLONG;
    }
    const char *step = "shm_open";
    int rc = 0;
    k->fd = shm_open(k->name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (k->fd < 0) rc = -errno;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    if (!rc && fcntl(k->fd, F_OFD_SETLK, &fl) != 0) {
        rc = errno == EAGAIN || errno == EACCES ? -EBUSY : -errno;
        step = "lock";
        vmm_keep_file f;
        if (rc == -EBUSY && pread(k->fd, &f, sizeof f, 0) == (ssize_t)sizeof f && file_of(&f, p->pid, p->start_time))
            *holder = f.keeper_pid;
    }
    /* the owner rings it (bell, exit status): whoever may write the registry may write this */
    struct stat reg;
    if (!rc && fstat(r->fd, &reg) == 0 && (reg.st_mode & 0060) && fchown(k->fd, (uid_t)-1, reg.st_gid) == 0)
        (void)fchmod(k->fd, reg.st_mode & 0660);
    struct stat st;
    if (!rc && fstat(k->fd, &st) != 0) rc = -errno, step = "fstat";
    if (!rc && st.st_size < (off_t)sizeof(vmm_keep_file) && ftruncate(k->fd, sizeof(vmm_keep_file)) != 0)
        rc = -errno, step = "ftruncate";
    if (!rc) {
        void *m = mmap(NULL, sizeof(vmm_keep_file), PROT_READ | PROT_WRITE, MAP_SHARED, k->fd, 0);
        if (m == MAP_FAILED) rc = -errno, step = "mmap";
        else k->f = m;
    }
    if (rc) {
        if (rc == -EBUSY)
            snprintf(err, errlen, "pid %u is kept already, by keeper pid %u", p->pid, *holder);
        else
            snprintf(err, errlen, "cannot make the keep file %s: %s: %s", k->name, step, strerror(-rc));
        if (k->fd >= 0) close(k->fd);
        k->fd = -1;
        return rc;
    }
    vmm_keep_file *f = k->f;
    /* An owner of an earlier keeper may have this very file mapped and be waiting on done: the
     * bell goes on from where it was, and done catches up with it. */
    bool was = file_of(f, p->pid, p->start_time);
    uint32_t bell = was ? __atomic_load_n(&f->bell, __ATOMIC_ACQUIRE) : 0;
    __atomic_store_n(&f->ready, 0, __ATOMIC_RELEASE);
    f->magic = VMM_KEEP_MAGIC;
    f->version = VMM_KEEP_VERSION;
    f->size = sizeof *f;
    f->owner_pid = p->pid;
    f->owner_start_time = p->start_time;
    f->pidns = p->pidns;
    f->keeper_pid = (uint32_t)getpid();
    uint64_t ks = 0;
    (void)vmm__proc_identity(f->keeper_pid, &ks, NULL);
    f->keeper_start_time = ks;
    if (!was) __atomic_store_n(&f->bell, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&f->done, bell, __ATOMIC_RELEASE);
    __atomic_store_n(&f->release, 0, __ATOMIC_RELAXED);
    f->exit_status = 0;
    __atomic_store_n(&f->exit_seen, 0, __ATOMIC_RELAXED);
    f->end_kind = VMM_KEEP_END_NONE;
    f->end_value = 0;
    f->ended_ns = 0;
    f->since_ns = clock_ns(CLOCK_REALTIME);
    __atomic_store_n(&f->held_allocs, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&f->held_bytes, 0, __ATOMIC_RELAXED);
    memset(f->socket, 0, sizeof f->socket);
    snprintf(f->socket, sizeof f->socket, "%s", socket ? socket : "");
    __atomic_store_n(&f->state, VMM_KEEP_WATCHING, __ATOMIC_RELEASE);
    __atomic_store_n(&f->heartbeat_ns, clock_ns(CLOCK_MONOTONIC), __ATOMIC_RELEASE);
    __atomic_store_n(&f->ready, 1, __ATOMIC_RELEASE);
    /* the owner tells with one load that it is kept; then make sure it was that owner */
    __atomic_store_n(&proc_at(r, index)->keeper_pid, f->keeper_pid, __ATOMIC_RELEASE);
    if (!still_owner(r, k)) {
        snprintf(err, errlen, "pid %u left the registry meanwhile", p->pid);
        vmm__keep_end(r, k);
        return -ESRCH;
    }
    return 0;
}

uint32_t vmm__keep_wait(vmm__keep *k, uint32_t seen, unsigned ms)
{
    uint32_t b = __atomic_load_n(&k->f->bell, __ATOMIC_ACQUIRE);
    if (b == seen && ms) futex_wait(&k->f->bell, seen, (uint64_t)ms * 1000000u);
    return __atomic_load_n(&k->f->bell, __ATOMIC_ACQUIRE);
}

void vmm__keep_nudge(vmm__keep *k)
{
    __atomic_add_fetch(&k->f->bell, 1, __ATOMIC_ACQ_REL);
    futex_wake(&k->f->bell);
}

void vmm__keep_beat(vmm__keep *k) { __atomic_store_n(&k->f->heartbeat_ns, clock_ns(CLOCK_MONOTONIC), __ATOMIC_RELEASE); }

void vmm__keep_done(vmm__keep *k, uint32_t bell)
{
    __atomic_store_n(&k->f->heartbeat_ns, clock_ns(CLOCK_MONOTONIC), __ATOMIC_RELEASE);
    if (__atomic_exchange_n(&k->f->done, bell, __ATOMIC_ACQ_REL) != bell) futex_wake(&k->f->done);
}

int vmm__keep_mark(vmm__reg *r, const vmm__keep *k, uint64_t slot, uint64_t generation)
{
    if (slot >= r->hdr->capacity) return -ESTALE;
    vmm_reg_alloc *a = (vmm_reg_alloc *)(r->base + r->hdr->rec_off) + slot;
    /* its owner is dead: nobody else writes the record while the keeper holds the lock (gc
     * leaves a kept owner alone) */
    if (__atomic_load_n(&a->state, __ATOMIC_ACQUIRE) != VMM_REG_LIVE ||
        __atomic_load_n(&a->generation, __ATOMIC_RELAXED) != generation ||
        __atomic_load_n(&a->pid, __ATOMIC_RELAXED) != k->owner_pid ||
        __atomic_load_n(&a->start_time, __ATOMIC_RELAXED) != k->owner_start_time)
        return -ESTALE;
    seq_begin(&a->seq);
    __atomic_or_fetch(&a->flags, VMM_REG_F_KEPT, SEQ_WORD_STORE);
    seq_end(&a->seq);
    return 0;
}

int vmm__keep_take_broker(vmm__reg *r, const vmm__keep *k, const char *socket)
{
    if (!still_owner(r, k)) return -ESRCH;
    vmm_reg_proc *p = proc_at(r, k->proc_index);
    char buf[sizeof p->broker_path];
    memset(buf, 0, sizeof buf);
    snprintf(buf, sizeof buf, "%s", socket);
    seq_begin(&p->seq);
    copy_words_in(p->broker_path, buf, sizeof buf);
    seq_end(&p->seq);
    return 0;
}

void vmm__keep_end(vmm__reg *r, vmm__keep *k)
{
    if (k->fd < 0) return;
    uint32_t me = (uint32_t)getpid();
    if (still_owner(r, k)) __atomic_compare_exchange_n(&proc_at(r, k->proc_index)->keeper_pid, &me, 0, false,
                                                       __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    if (k->f) {
        __atomic_store_n(&k->f->state, VMM_KEEP_RELEASED, __ATOMIC_RELEASE);
        __atomic_store_n(&k->f->held_allocs, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&k->f->held_bytes, 0, __ATOMIC_RELAXED);
        futex_wake(&k->f->done); /* an owner waiting for this keeper waits no more */
        munmap(k->f, sizeof *k->f);
        k->f = NULL;
    }
    /* unlinked while the lock is held: no other keeper has it in between */
    shm_unlink(k->name);
    close(k->fd); /* drops the lock */
    k->fd = -1;
}
