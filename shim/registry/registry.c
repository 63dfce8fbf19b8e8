/* The shared-memory registry: creation, the writer side (attach, bind, publish, retract), the
 * reader side (seq-checked copies, find by interior address) and reclamation of dead owners.
 * The protocol every reader follows is written down in layout.h. */
#include "registry/registry.h"
#include "registry/keep.h"
#include "registry/names.h"
#include "registry/seq.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PROC_CAPACITY 4096u
#define FIND_RETRY_S 0.05 /* longest a lookup retries while the index is rebuilt */
#define PAGE 4096u

/* Creation stamps only show ages: the coarse clock (a few ms) costs a fraction of the precise one. */
static uint64_t now_coarse_ns(void) { return clock_ns(CLOCK_REALTIME_COARSE); }

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static uint64_t pow2_ceil(uint64_t v)
{
    uint64_t p = 1;
    while (p < v) p <<= 1;
    return p;
}

/* ---- layout arithmetic ---- */

static vmm_reg_proc *proc_at(const vmm__reg *r, uint32_t i)
{
    return (vmm_reg_proc *)(r->base + r->hdr->proc_off + (uint64_t)i * sizeof(vmm_reg_proc));
}
static uint64_t *chunk_at(const vmm__reg *r, uint64_t c) { return (uint64_t *)(r->base + r->hdr->chunk_off) + c; }
static uint32_t *index_at(const vmm__reg *r) { return (uint32_t *)(r->base + r->hdr->index_off); }
static vmm_reg_alloc *rec_at(const vmm__reg *r, uint64_t slot)
{
    return (vmm_reg_alloc *)(r->base + r->hdr->rec_off + slot * sizeof(vmm_reg_alloc));
}

void vmm__reg_default_name(char *buf, size_t len)
{
    const char *env = getenv("VMMSHIM_REGISTRY");
    if (env && *env)
        snprintf(buf, len, "%s", env);
    else
        snprintf(buf, len, "/vmmshim-%u", (unsigned)getuid());
}

static int fail(char *err, size_t errlen, int code, const char *fmt, const char *name, const char *detail)
{
    if (err && errlen) snprintf(err, errlen, fmt, name, detail);
    return code;
}

int vmm__reg_validate(const void *base, size_t size, char *err, size_t errlen)
{
    const vmm_reg_header *h = base;
    char d[160];
    if (size < sizeof(vmm_reg_header)) {
        snprintf(d, sizeof d, "segment is %zu bytes, shorter than its header", size);
        return fail(err, errlen, -EPROTO, "registry%s: %s", "", d);
    }
    if (h->magic != VMM_REG_MAGIC) return fail(err, errlen, -EPROTO, "registry%s: %s", "", "wrong magic (not a vmmshim registry)");
    if (__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE) != 1)
        return fail(err, errlen, -EAGAIN, "registry%s: %s", "", "not initialised (its creator died or is still creating it)");
    if (h->compat_version > VMM_REG_VERSION) {
        snprintf(d, sizeof d, "layout version %u needs a reader of version %u; this one reads %u", h->version,
                 h->compat_version, VMM_REG_VERSION);
        return fail(err, errlen, -EPROTO, "registry%s: %s", "", d);
    }
    if (h->header_size < sizeof(vmm_reg_header) || h->proc_size < sizeof(vmm_reg_proc) ||
        h->alloc_size < sizeof(vmm_reg_alloc) || h->proc_size != sizeof(vmm_reg_proc) ||
        h->alloc_size != sizeof(vmm_reg_alloc))
        return fail(err, errlen, -EPROTO, "registry%s: %s", "", "record sizes do not match this reader");
    uint64_t cap = h->capacity, ch = h->chunk_count, slots = h->index_slots;
    /* chunk_count by division: the product wraps (2^61 + 1 chunks "hold" 64 records) */
    if (h->chunk_records != VMM_REG_CHUNK_RECORDS || cap == 0 || cap > (1ull << 28) || cap % VMM_REG_CHUNK_RECORDS ||
        ch != cap / VMM_REG_CHUNK_RECORDS ||
        slots < cap || slots > (1ull << 32) || (slots & (slots - 1)) || h->proc_capacity == 0 ||
        h->proc_capacity > (1u << 20))
        return fail(err, errlen, -EPROTO, "registry%s: %s", "", "corrupt header (capacity fields)");
    /* Every offset within the object first, so the sums below cannot wrap (sizes are bounded
     * above); 8-byte aligned, so the 8-byte atomics never straddle. */
    if (h->total_size > size)
        return fail(err, errlen, -EPROTO, "registry%s: %s", "", "segment is shorter than its header says (truncated)");
    if (h->proc_off > size || h->chunk_off > size || h->index_off > size || h->rec_off > size ||
        ((h->proc_off | h->chunk_off | h->index_off | h->rec_off) & 7) || h->proc_off < h->header_size ||
        h->chunk_off < h->proc_off + (uint64_t)h->proc_capacity * h->proc_size || h->index_off < h->chunk_off + ch * 8 ||
        h->rec_off < h->index_off + slots * 4 || h->total_size < h->rec_off + cap * h->alloc_size)
        return fail(err, errlen, -EPROTO, "registry%s: %s", "", "corrupt header (region offsets overlap or are misaligned)");
    return 0;
}

static int ofd_lock(int fd, int byte, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    while (fcntl(fd, F_OFD_SETLKW, &fl) != 0)
        if (errno != EINTR) return -errno;
    return 0;
}

static void ofd_unlock(int fd, int byte)
{
    struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    (void)fcntl(fd, F_OFD_SETLK, &fl);
}

/* Pre-allocate pages so a full /dev/shm reports ENOSPC here instead of SIGBUS in the writer. */
static int back_range(int fd, uint64_t off, uint64_t len)
{
    uint64_t a = off / PAGE * PAGE, e = round_up(off + len, PAGE);
    int rc = posix_fallocate(fd, (off_t)a, (off_t)(e - a));
    return rc == EOPNOTSUPP || rc == EINVAL ? 0 : -rc;
}

static int init_segment(int fd, uint64_t capacity, char *err, size_t errlen)
{
    vmm_reg_header h;
    memset(&h, 0, sizeof h);
    capacity = round_up(capacity < VMM_REG_CHUNK_RECORDS ? VMM_REG_CHUNK_RECORDS : capacity, VMM_REG_CHUNK_RECORDS);
    h.magic = VMM_REG_MAGIC;
    h.version = VMM_REG_VERSION;
    h.compat_version = VMM_REG_COMPAT_VERSION;
    h.header_size = PAGE;
    h.proc_size = sizeof(vmm_reg_proc);
    h.alloc_size = sizeof(vmm_reg_alloc);
    h.chunk_records = VMM_REG_CHUNK_RECORDS;
    h.proc_capacity = PROC_CAPACITY;
    h.capacity = capacity;
    h.chunk_count = capacity / VMM_REG_CHUNK_RECORDS;
    h.index_slots = pow2_ceil(capacity * 2);
    h.proc_off = PAGE;
    h.chunk_off = round_up(h.proc_off + (uint64_t)PROC_CAPACITY * sizeof(vmm_reg_proc), PAGE);
    h.index_off = round_up(h.chunk_off + h.chunk_count * 8, PAGE);
    h.rec_off = round_up(h.index_off + h.index_slots * 4, PAGE);
    h.total_size = round_up(h.rec_off + capacity * sizeof(vmm_reg_alloc), PAGE);
    h.created_ns = clock_ns(CLOCK_REALTIME);
    h.creator_pid = (uint32_t)getpid();
    h.creator_uid = (uint32_t)getuid();
    if (ftruncate(fd, (off_t)h.total_size) != 0)
        return fail(err, errlen, -errno, "registry%s: cannot size it: %s", "", strerror(errno));
    int rc = back_range(fd, 0, PAGE);
    if (!rc) rc = back_range(fd, h.chunk_off, h.rec_off - h.chunk_off);
    if (rc) return fail(err, errlen, rc, "registry%s: cannot back it in /dev/shm: %s", "", strerror(-rc));
    uint8_t *m = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return fail(err, errlen, -errno, "registry%s: mmap: %s", "", strerror(errno));
    h.ready = 0;
    memcpy(m, &h, sizeof h);
    __atomic_store_n(&((vmm_reg_header *)m)->ready, 1u, __ATOMIC_RELEASE);
    munmap(m, PAGE);
    return 0;
}

static int set_group(int fd, const char *group, char *err, size_t errlen)
{
    if (!group || !*group) return fchmod(fd, 0600) ? -errno : 0;
    char *end;
    gid_t gid;
    unsigned long n = strtoul(group, &end, 10);
    if (*end == 0) {
        gid = (gid_t)n;
    } else {
        struct group gr, *res = NULL;
        char buf[4096];
        if (getgrnam_r(group, &gr, buf, sizeof buf, &res) != 0 || !res)
            return fail(err, errlen, -EINVAL, "registry group '%s' %s", group, "does not exist");
        gid = res->gr_gid;
    }
    if (fchown(fd, (uid_t)-1, gid) != 0) return fail(err, errlen, -errno, "registry group '%s': %s", group, strerror(errno));
    return fchmod(fd, 0660) ? -errno : 0;
}

/* Refuse a segment someone else planted under our name, unless a shared group was configured. */
/* A publisher (the shim) writes only into a segment its own user made, root included: anyone can
 * create /dev/shm/vmmshim-0 first and would then read root's allocations.  Root may still open
 * another user's segment to reclaim it (VMM__REG_WRITE, vmmctl gc). */
static int check_owner(const char *name, const struct stat *st, int mode, const char *group, char *err, size_t errlen)
{
    char d[160];
    if (st->st_mode & 0007) {
        snprintf(d, sizeof d, "mode %03o lets every user in; refusing it", (unsigned)(st->st_mode & 0777));
        return fail(err, errlen, -EACCES, "registry %s: %s", name, d);
    }
    if (st->st_uid == geteuid() || mode == VMM__REG_READ || (mode == VMM__REG_WRITE && geteuid() == 0)) return 0;
    if (group && *group && (st->st_mode & 0060) == 0060) return 0;
    snprintf(d, sizeof d, "owned by uid %u, not by this user; refusing to write to it", (unsigned)st->st_uid);
    return fail(err, errlen, -EACCES, "registry %s: %s", name, d);
}

int vmm__reg_open(vmm__reg *r, const char *name, int mode, uint64_t capacity, const char *group, char *err,
                  size_t errlen)
{
    memset(r, 0, sizeof *r);
    r->fd = -1;
    char given[sizeof r->name];
    if (name && *name)
        snprintf(given, sizeof given, "%s", name);
    else
        vmm__reg_default_name(given, sizeof given);
    /* "name" means "/name", as VMMSHIM_REGISTRY takes it: every message then names the object opened. */
    if (snprintf(r->name, sizeof r->name, "%s%s", given[0] == '/' ? "" : "/", given) >= (int)sizeof r->name)
        return fail(err, errlen, -ENAMETOOLONG, "registry %s: %s", given, "name is too long");
    r->writable = mode != VMM__REG_READ;
    int oflags = (r->writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW;
    if (mode == VMM__REG_CREATE) oflags |= O_CREAT;
    /* Created 0600 whatever the umask (shm_open applies it); the group mode is set afterwards. */
    int fd = shm_open(r->name, oflags, 0600);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) return fail(err, errlen, -ENOENT, "registry %s: %s", r->name, "does not exist (no process has run under the shim yet)");
        if (e == EACCES) return fail(err, errlen, -EACCES, "registry %s: %s", r->name, "permission denied (it belongs to another user)");
        return fail(err, errlen, -e, "registry %s: %s", r->name, strerror(e));
    }
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0) {
        rc = fail(err, errlen, -errno, "registry %s: %s", r->name, strerror(errno));
        goto out_close;
    }
    if ((rc = check_owner(r->name, &st, mode, group, err, errlen)) != 0) goto out_close;
    if (mode == VMM__REG_CREATE) {
        if ((rc = ofd_lock(fd, VMM_REG_LOCK_INIT, F_WRLCK)) != 0) {
            fail(err, errlen, rc, "registry %s: lock: %s", r->name, strerror(-rc));
            goto out_close;
        }
        vmm_reg_header h;
        memset(&h, 0, sizeof h);
        if (pread(fd, &h, sizeof h, 0) < 0) h.ready = 0;
        if (h.ready != 1) {
            if (h.magic != 0 && h.magic != VMM_REG_MAGIC) {
                rc = fail(err, errlen, -EPROTO, "registry %s: %s", r->name, "exists but is not a vmmshim registry; not touching it");
            } else {
                rc = init_segment(fd, capacity, err, errlen);
                if (!rc) rc = set_group(fd, group, err, errlen);
            }
        }
        ofd_unlock(fd, VMM_REG_LOCK_INIT);
        if (rc) goto out_close;
        if (fstat(fd, &st) != 0) {
            rc = -errno;
            goto out_close;
        }
    }
    if ((size_t)st.st_size < sizeof(vmm_reg_header)) {
        rc = fail(err, errlen, -EPROTO, "registry %s: %s", r->name, st.st_size == 0 ? "is empty (its creator died while creating it; run vmmctl gc or remove it)" : "is shorter than its header (truncated)");
        goto out_close;
    }
    r->map_size = (size_t)st.st_size;
    r->base = mmap(NULL, r->map_size, r->writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    if (r->base == MAP_FAILED) {
        r->base = NULL;
        rc = fail(err, errlen, -errno, "registry %s: mmap: %s", r->name, strerror(errno));
        goto out_close;
    }
    char why[200];
    if ((rc = vmm__reg_validate(r->base, r->map_size, why, sizeof why)) != 0) {
        fail(err, errlen, rc, "registry %s%s", r->name, why + strlen("registry"));
        munmap(r->base, r->map_size);
        r->base = NULL;
        goto out_close;
    }
    r->hdr = (vmm_reg_header *)r->base;
    r->fd = fd;
    pthread_mutex_init(&r->lock, NULL);
    return 0;
out_close:
    close(fd);
    return rc;
}

void vmm__reg_close(vmm__reg *r)
{
    if (!r->base) return;
    if (r->attached) vmm__reg_detach(r);
    vmm__names_release(r, false);
    munmap(r->base, r->map_size);
    close(r->fd);
    free(r->free_slots);
    free(r->chunks);
    pthread_mutex_destroy(&r->lock);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

/* ---- owners and liveness ---- */

int vmm__proc_identity(uint32_t pid, uint64_t *start_time, uint64_t *pidns)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -EIO;
    buf[n] = 0;
    /* comm may hold spaces and parentheses: fields restart after the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p) return -EIO;
    p++;
    /* a zombie (or a dying task) has exited: nobody will ever free its records */
    if (p[0] == ' ' && (p[1] == 'Z' || p[1] == 'X')) return -ESRCH;
    for (int field = 3; field < 22 && p; field++) p = strchr(p + 1, ' ');
    if (!p) return -EIO;
    *start_time = strtoull(p + 1, NULL, 10);
    if (pidns) {
        struct stat st;
        snprintf(path, sizeof path, "/proc/%u/ns/pid", pid);
        *pidns = stat(path, &st) == 0 ? (uint64_t)st.st_ino : 0;
    }
    return 0;
}

static bool pid_exists(uint32_t pid)
{
    char path[32];
    snprintf(path, sizeof path, "/proc/%u", pid);
    return access(path, F_OK) == 0;
}

static uint64_t self_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

int vmm__reg_liveness(uint32_t pid, uint64_t start_time, uint64_t pidns)
{
    if (pid == 0) return VMM__DEAD;
    if (pidns && pidns != self_pidns()) return VMM__UNKNOWN;
    uint64_t st;
    int rc = vmm__proc_identity(pid, &st, NULL);
    if (rc == -ENOENT || rc == -ESRCH) return VMM__DEAD;
    if (rc) return VMM__UNKNOWN;
    return st == start_time ? VMM__ALIVE : VMM__DEAD;
}

/* ---- writer ---- */

/* The counters outside the seq protocol, zero for a new owner of the slot. */
static void counters_clear(vmm_reg_proc *p)
{
    uint64_t *c[] = {&p->n_allocs,      &p->bytes_requested,    &p->bytes_mapped,       &p->allocs,
                     &p->allocs_backed, &p->passed_capture,     &p->passed_device_full, &p->passed_unsupported,
                     &p->maps_adopted,  &p->peak_requested};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) __atomic_store_n(c[i], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->keeper_pid, 0, __ATOMIC_RELAXED); /* an earlier owner's keeper is not this one's */
}

static uint64_t chunk_tag(const vmm__reg *r) { return ((uint64_t)r->proc_gen << 32) | (r->proc_index + 1); }

int vmm__reg_attach(vmm__reg *r, const char *broker_path)
{
    if (!r->writable) return -EPERM;
    if (r->attached) return 0;
    uint32_t pid = (uint32_t)getpid();
    uint64_t start, ns;
    int rc = vmm__proc_identity(pid, &start, &ns);
    if (rc) return rc;
    uint32_t cap = r->hdr->proc_capacity;
    for (uint32_t k = 0; k < cap; k++) {
        uint32_t i = (pid + k) % cap;
        vmm_reg_proc *p = proc_at(r, i);
        uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)c != 0) continue;
        uint32_t gen = (uint32_t)(c >> 32) + 1;
        if (!__atomic_compare_exchange_n(&p->claim, &c, ((uint64_t)gen << 32) | pid, false, __ATOMIC_ACQ_REL,
                                         __ATOMIC_RELAXED))
            continue;
        if ((rc = back_range(r->fd, (uint64_t)((uint8_t *)p - r->base), sizeof *p)) != 0) {
            __atomic_store_n(&p->claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
            return rc;
        }
        vmm_reg_proc v;
        memset(&v, 0, sizeof v);
        v.claim = ((uint64_t)gen << 32) | pid;
        v.pid = pid;
        v.start_time = start;
        v.pidns = ns;
        v.registered_ns = clock_ns(CLOCK_REALTIME);
        v.uid = (uint32_t)getuid();
        v.generation = gen;
        if (broker_path) snprintf(v.broker_path, sizeof v.broker_path, "%s", broker_path);
        int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t n = read(fd, v.cmdline, sizeof v.cmdline - 1);
            (void)n;
            close(fd);
        }
        seq_begin(&p->seq);
        v.seq = __atomic_load_n(&p->seq, __ATOMIC_RELAXED);
        /* claim stays as CAS'd; copy everything after seq up to the counters */
        copy_words_in((uint8_t *)p + 16, (uint8_t *)&v + 16, offsetof(vmm_reg_proc, n_allocs) - 16);
        __atomic_store_n(&p->pid, pid, __ATOMIC_RELAXED);
        counters_clear(p);
        __atomic_store_n(&p->stats_generation, gen, __ATOMIC_RELAXED);
        seq_end(&p->seq);
        r->proc_index = i;
        r->proc_gen = gen;
        r->pid = pid;
        r->start_time = start;
        r->pidns = ns;
        if (getrandom(&r->id_nonce, sizeof r->id_nonce, 0) != sizeof r->id_nonce)
            r->id_nonce = clock_ns(CLOCK_REALTIME) ^ ((uint64_t)pid << 40);
        r->attached = true;
        /* a table of this (pid, start time) is an earlier image's (exec keeps both): it has
         * published nothing yet */
        vmm__names_unlink(r, pid, start);
        return 0;
    }
    return -ENOSPC;
}

vmm_reg_proc *vmm__reg_self(vmm__reg *r) { return r->attached ? proc_at(r, r->proc_index) : NULL; }

int vmm__reg_set_broker(vmm__reg *r, const char *broker_path)
{
    if (!r->attached) return -EINVAL;
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    char buf[sizeof p->broker_path];
    memset(buf, 0, sizeof buf);
    snprintf(buf, sizeof buf, "%s", broker_path ? broker_path : "");
    seq_begin(&p->seq);
    copy_words_in(p->broker_path, buf, sizeof buf);
    seq_end(&p->seq);
    return 0;
}

/* The index lock word and the OFD gc lock both name a process, not a thread: these serialise the
 * threads of this process before the shared lock serialises the processes. */
static pthread_mutex_t index_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t gc_mutex = PTHREAD_MUTEX_INITIALIZER;

void vmm__reg_forget_after_fork(vmm__reg *r)
{
    pthread_mutex_init(&r->lock, NULL);
    pthread_mutex_init(&index_mutex, NULL);
    pthread_mutex_init(&gc_mutex, NULL);
    r->attached = false;
    r->n_free = r->n_chunks = 0;
    vmm__names_forget_after_fork(r);
    vmm__keep_forget_after_fork();
    /* The inherited fd shares the parent's open file description, so its OFD locks would not
     * exclude the parent's: open the same object again (by /proc/self/fd, no name lookup, works
     * if unlinked) for a description of our own, under the same fd number.  No snprintf: this
     * may run in an atfork handler. */
    if (r->fd < 0) return;
    char path[32] = "/proc/self/fd/", digits[12];
    int n = 0, len = (int)strlen(path);
    for (unsigned v = (unsigned)r->fd; n == 0 || v; v /= 10) digits[n++] = (char)('0' + v % 10);
    while (n) path[len++] = digits[--n];
    path[len] = 0;
    int fd = open(path, (r->writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0 || dup3(fd, r->fd, O_CLOEXEC) < 0) r->writable = false; /* cannot lock safely: no writing */
    if (fd >= 0) close(fd);
}

static void index_lock(vmm__reg *r);
static void index_unlock(vmm__reg *r);
static void index_insert_locked(vmm__reg *r, uint32_t slot, uint32_t pid, uint64_t key);
static void index_remove_locked(vmm__reg *r, uint64_t slot, uint32_t pid, uint64_t key);

/* Reset a record to UNBOUND; its generation moves on so stale references stay stale. */
static void record_clear(vmm_reg_alloc *a)
{
    uint64_t gen = __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1;
    seq_begin(&a->seq);
    vmm_reg_alloc z;
    memset(&z, 0, sizeof z);
    z.generation = gen;
    z.exported_fd = -1;
    copy_words_in((uint8_t *)a + 8, (uint8_t *)&z + 8, sizeof z - 8);
    __atomic_store_n(&a->state, VMM_REG_UNBOUND, __ATOMIC_RELAXED);
    seq_end(&a->seq);
}

/* Release a chunk's records and the chunk itself; the caller holds whatever excludes its owner. */
static unsigned chunk_release(vmm__reg *r, uint64_t c)
{
    unsigned n = 0;
    index_lock(r);
    for (uint64_t s = c * VMM_REG_CHUNK_RECORDS; s < (c + 1) * VMM_REG_CHUNK_RECORDS; s++) {
        vmm_reg_alloc *a = rec_at(r, s);
        uint32_t state = __atomic_load_n(&a->state, __ATOMIC_RELAXED);
        if (state == VMM_REG_UNBOUND && !(__atomic_load_n(&a->seq, __ATOMIC_RELAXED) & 1u)) continue;
        if (state != VMM_REG_UNBOUND)
            index_remove_locked(r, s, __atomic_load_n(&a->pid, __ATOMIC_RELAXED),
                                vmm_reg_key(__atomic_load_n(&a->address, __ATOMIC_RELAXED),
                                            __atomic_load_n(&a->extent, __ATOMIC_RELAXED)));
        if (state == VMM_REG_LIVE) n++;
        record_clear(a);
    }
    index_unlock(r);
    __atomic_store_n(chunk_at(r, c), 0, __ATOMIC_RELEASE);
    return n;
}

void vmm__reg_detach(vmm__reg *r)
{
    if (!r->attached) return;
    vmm__names_release(r, true); /* names first: readers check them against the records */
    pthread_mutex_lock(&r->lock);
    for (size_t i = 0; i < r->n_chunks; i++) chunk_release(r, r->chunks[i]);
    r->n_chunks = r->n_free = 0;
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    seq_begin(&p->seq);
    __atomic_store_n(&p->pid, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->start_time, 0, __ATOMIC_RELAXED);
    seq_end(&p->seq);
    __atomic_store_n(&p->claim, (uint64_t)r->proc_gen << 32, __ATOMIC_RELEASE);
    r->attached = false;
    pthread_mutex_unlock(&r->lock);
}

static int grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap * 2 : 256;
    while (n < need) n *= 2;
    void *p = realloc(*arr, n * elem);
    if (!p) return -ENOMEM;
    *arr = p;
    *cap = n;
    return 0;
}

/* Claim a chunk: bump allocation first (touches memory in order), then any chunk freed by a
 * detach or a reclaim. */
static int claim_chunk(vmm__reg *r)
{
    uint64_t count = r->hdr->chunk_count, tag = chunk_tag(r), c = UINT64_MAX;
    if (grow((void **)&r->chunks, &r->cap_chunks, r->n_chunks + 1, sizeof *r->chunks) ||
        grow((void **)&r->free_slots, &r->cap_free, (r->n_chunks + 1) * VMM_REG_CHUNK_RECORDS, sizeof *r->free_slots))
        return -ENOMEM;
    if (__atomic_load_n(&r->hdr->chunks_hwm, __ATOMIC_RELAXED) < count) {
        uint64_t h = __atomic_fetch_add(&r->hdr->chunks_hwm, 1, __ATOMIC_ACQ_REL);
        uint64_t zero = 0;
        if (h < count && __atomic_compare_exchange_n(chunk_at(r, h), &zero, tag, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            c = h;
    }
    for (uint64_t i = 0; c == UINT64_MAX && i < count; i++) {
        uint64_t zero = 0;
        if (__atomic_load_n(chunk_at(r, i), __ATOMIC_RELAXED) == 0 &&
            __atomic_compare_exchange_n(chunk_at(r, i), &zero, tag, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            c = i;
    }
    if (c == UINT64_MAX) return -ENOSPC;
    int rc = back_range(r->fd, r->hdr->rec_off + c * VMM_REG_CHUNK_RECORDS * sizeof(vmm_reg_alloc),
                        VMM_REG_CHUNK_RECORDS * sizeof(vmm_reg_alloc));
    if (rc) {
        __atomic_store_n(chunk_at(r, c), 0, __ATOMIC_RELEASE);
        return rc;
    }
    r->chunks[r->n_chunks++] = (uint32_t)c;
    for (uint32_t k = VMM_REG_CHUNK_RECORDS; k-- > 0;) r->free_slots[r->n_free++] = (uint32_t)(c * VMM_REG_CHUNK_RECORDS + k);
    return 0;
}

static bool owns_slot(const vmm__reg *r, uint32_t slot)
{
    return slot < r->hdr->capacity &&
           (__atomic_load_n(chunk_at(r, slot / VMM_REG_CHUNK_RECORDS), __ATOMIC_RELAXED)) == chunk_tag(r);
}

/* A free record slot of this process (claiming a chunk when none is left). */
static int take_slot(vmm__reg *r, uint32_t *slot)
{
    pthread_mutex_lock(&r->lock);
    int rc = r->n_free ? 0 : claim_chunk(r);
    if (rc == 0) *slot = r->free_slots[--r->n_free];
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static void write_bound(vmm__reg *r, uint32_t s, uint64_t address, uint64_t extent, uint32_t flags)
{
    vmm_reg_alloc *a = rec_at(r, s);
    seq_begin(&a->seq);
    __atomic_store_n(&a->generation, __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->proc_index, r->proc_index, __ATOMIC_RELAXED);
    __atomic_store_n(&a->pid, r->pid, __ATOMIC_RELAXED);
    __atomic_store_n(&a->start_time, r->start_time, __ATOMIC_RELAXED);
    __atomic_store_n(&a->pidns, r->pidns, __ATOMIC_RELAXED);
    __atomic_store_n(&a->address, address, __ATOMIC_RELAXED);
    __atomic_store_n(&a->mapped_size, extent, __ATOMIC_RELAXED);
    __atomic_store_n(&a->extent, extent, __ATOMIC_RELAXED);
    __atomic_store_n(&a->chunk_id, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->chunk_offset, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->exported_fd, -1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->flags, flags, __ATOMIC_RELAXED);
    __atomic_store_n(&a->state, VMM_REG_BOUND, __ATOMIC_RELAXED);
    seq_end(&a->seq);
}

static int bind_flags(vmm__reg *r, uint64_t address, uint64_t extent, uint32_t flags, uint32_t *slot)
{
    if (!r->attached) return -EINVAL;
    if (address == 0 || extent == 0 || extent > (1ull << VMM_REG_MAX_LEVEL) || address > UINT64_MAX - extent) return -EINVAL;
    uint32_t s;
    int rc = take_slot(r, &s); /* outside the index lock: detach takes the two the other way round */
    if (rc) return rc;
    write_bound(r, s, address, extent, flags); /* complete before its index entry can lead a reader to it */
    index_lock(r);
    index_insert_locked(r, s, r->pid, vmm_reg_key(address, extent));
    index_unlock(r);
    *slot = s;
    return 0;
}

int vmm__reg_bind(vmm__reg *r, uint64_t address, uint64_t extent, uint32_t *slot)
{
    return bind_flags(r, address, extent, 0, slot);
}

/* Write record a as LIVE from d (one seq write) and count it; address and extent as given. */
static void write_live(vmm__reg *r, vmm_reg_alloc *a, const vmm_reg_alloc *d, uint64_t address, uint64_t extent,
                       vmm_reg_alloc *published)
{
    vmm_reg_alloc v = *d;
    static const uint8_t zero_id[16];
    if (!memcmp(v.alloc_id, zero_id, 16)) {
        uint64_t n = __atomic_add_fetch(&r->id_counter, 1, __ATOMIC_RELAXED);
        /* splitmix64 is a bijection: ids stay unique per process and look random across them */
        uint64_t x = n + r->id_nonce; /* both halves then differ between processes */
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        x ^= x >> 31;
        memcpy(v.alloc_id, &r->id_nonce, 8);
        memcpy(v.alloc_id + 8, &x, 8);
    }
    v.state = VMM_REG_LIVE;
    v.generation = __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1;
    v.proc_index = r->proc_index;
    v.pid = r->pid;
    v.start_time = r->start_time;
    v.pidns = r->pidns;
    v.address = address;
    v.extent = extent;
    if (!v.mapped_size) v.mapped_size = v.extent; /* an allocation that is its own chunk */
    if (!v.created_ns) v.created_ns = now_coarse_ns();
    if (!(v.handle_kinds & VMM_HANDLE_PIDFD)) v.exported_fd = -1;
    v.tag[sizeof v.tag - 1] = 0;
    if (v.n_frames > 8) v.n_frames = 8;
    seq_begin(&a->seq);
    copy_words_in((uint8_t *)a + 8, (uint8_t *)&v + 8, sizeof v - 8);
    __atomic_store_n(&a->state, VMM_REG_LIVE, __ATOMIC_RELAXED);
    seq_end(&a->seq);
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    __atomic_add_fetch(&p->n_allocs, 1, __ATOMIC_RELAXED);
    uint64_t live = __atomic_add_fetch(&p->bytes_requested, v.requested_size, __ATOMIC_RELAXED);
    /* a compare-and-swap only while a new peak is being set */
    uint64_t peak = __atomic_load_n(&p->peak_requested, __ATOMIC_RELAXED);
    while (live > peak && !__atomic_compare_exchange_n(&p->peak_requested, &peak, live, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    __atomic_add_fetch(&p->bytes_mapped, v.extent, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->hdr->stat_publishes, 1, __ATOMIC_RELAXED);
    if (published) {
        v.seq = 0;
        *published = v;
    }
}

int vmm__reg_publish(vmm__reg *r, uint32_t slot, const vmm_reg_alloc *d, vmm_reg_alloc *published)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    if (__atomic_load_n(&a->state, __ATOMIC_RELAXED) != VMM_REG_BOUND) return -EINVAL;
    write_live(r, a, d, __atomic_load_n(&a->address, __ATOMIC_RELAXED), __atomic_load_n(&a->extent, __ATOMIC_RELAXED),
               published);
    return 0;
}

/* bind + publish in one: the allocation path's, with one record write and one index insert. */
int vmm__reg_add(vmm__reg *r, uint64_t address, uint64_t extent, const vmm_reg_alloc *d, uint32_t *slot,
                 vmm_reg_alloc *published)
{
    if (!r->attached) return -EINVAL;
    if (address == 0 || extent == 0 || extent > (1ull << VMM_REG_MAX_LEVEL) || address > UINT64_MAX - extent) return -EINVAL;
    uint32_t s;
    int rc = take_slot(r, &s);
    if (rc) return rc;
    write_live(r, rec_at(r, s), d, address, extent, published); /* complete before the index leads to it */
    index_lock(r);
    index_insert_locked(r, s, r->pid, vmm_reg_key(address, extent));
    index_unlock(r);
    *slot = s;
    return 0;
}

/* retract + unbind in one: the free path's.  Only state and generation change (one short write):
 * readers skip unbound records whatever else they hold. */
int vmm__reg_remove(vmm__reg *r, uint32_t slot)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    uint32_t state = __atomic_load_n(&a->state, __ATOMIC_RELAXED);
    if (state == VMM_REG_UNBOUND) return -EINVAL;
    uint64_t address = __atomic_load_n(&a->address, __ATOMIC_RELAXED), extent = __atomic_load_n(&a->extent, __ATOMIC_RELAXED);
    if (state == VMM_REG_LIVE) {
        vmm_reg_proc *p = proc_at(r, r->proc_index);
        __atomic_sub_fetch(&p->n_allocs, 1, __ATOMIC_RELAXED);
        __atomic_sub_fetch(&p->bytes_requested, __atomic_load_n(&a->requested_size, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
        __atomic_sub_fetch(&p->bytes_mapped, extent, __ATOMIC_RELAXED);
        __atomic_add_fetch(&r->hdr->stat_retracts, 1, __ATOMIC_RELAXED);
    }
    seq_begin(&a->seq);
    __atomic_store_n(&a->generation, __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 2, __ATOMIC_RELAXED);
    __atomic_store_n(&a->state, VMM_REG_UNBOUND, __ATOMIC_RELAXED);
    __atomic_store_n(&a->handle_kinds, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->exported_fd, -1, __ATOMIC_RELAXED);
    seq_end(&a->seq);
    index_lock(r);
    index_remove_locked(r, slot, r->pid, vmm_reg_key(address, extent));
    index_unlock(r);
    /* the names in it go before the slot can be reused; with no names, one relaxed load */
    if (__atomic_load_n(&r->names_live, __ATOMIC_RELAXED)) vmm__names_drop_slot(r, slot);
    pthread_mutex_lock(&r->lock);
    r->free_slots[r->n_free++] = slot; /* cap_free covers every slot of our chunks */
    pthread_mutex_unlock(&r->lock);
    return 0;
}

int vmm__reg_retract(vmm__reg *r, uint32_t slot)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    if (__atomic_load_n(&a->state, __ATOMIC_RELAXED) != VMM_REG_LIVE) return -EINVAL;
    uint64_t req = __atomic_load_n(&a->requested_size, __ATOMIC_RELAXED);
    uint64_t mapped = __atomic_load_n(&a->extent, __ATOMIC_RELAXED);
    seq_begin(&a->seq);
    __atomic_store_n(&a->generation, __atomic_load_n(&a->generation, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->state, VMM_REG_BOUND, __ATOMIC_RELAXED);
    __atomic_store_n(&a->exported_fd, -1, __ATOMIC_RELAXED);
    __atomic_store_n(&a->handle_kinds, 0, __ATOMIC_RELAXED);
    seq_end(&a->seq);
    if (__atomic_load_n(&r->names_live, __ATOMIC_RELAXED)) vmm__names_drop_slot(r, slot);
    vmm_reg_proc *p = proc_at(r, r->proc_index);
    __atomic_sub_fetch(&p->n_allocs, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&p->bytes_requested, req, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&p->bytes_mapped, mapped, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->hdr->stat_retracts, 1, __ATOMIC_RELAXED);
    return 0;
}

int vmm__reg_unbind(vmm__reg *r, uint32_t slot)
{
    if (!r->attached || !owns_slot(r, slot)) return -EINVAL;
    vmm_reg_alloc *a = rec_at(r, slot);
    uint32_t state = __atomic_load_n(&a->state, __ATOMIC_RELAXED);
    if (state == VMM_REG_UNBOUND) return -EINVAL;
    if (state == VMM_REG_LIVE) vmm__reg_retract(r, slot);
    index_lock(r);
    index_remove_locked(r, slot, r->pid,
                        vmm_reg_key(__atomic_load_n(&a->address, __ATOMIC_RELAXED), __atomic_load_n(&a->extent, __ATOMIC_RELAXED)));
    index_unlock(r);
    record_clear(a); /* after its entry is gone: a reader that still reaches it sees it change */
    pthread_mutex_lock(&r->lock);
    r->free_slots[r->n_free++] = slot; /* cap_free covers every slot of our chunks */
    pthread_mutex_unlock(&r->lock);
    return 0;
}

/* ---- the index: writers serialised by a lock word, readers lock-free ---- */

/* Only gc rebuilds (to sweep tombstones and entries a dead writer left): readers see index_seq odd. */
static void index_rebuild_locked(vmm__reg *r)
{
    uint32_t *ix = index_at(r);
    uint64_t mask = r->hdr->index_slots - 1;
    uint64_t seq = __atomic_load_n(&r->hdr->index_seq, __ATOMIC_RELAXED) | 1u; /* odd already if a rebuild died */
    __atomic_store_n(&r->hdr->index_seq, seq, __ATOMIC_RELAXED);
    SEQ_FENCE(__ATOMIC_RELEASE);
    for (uint64_t i = 0; i <= mask; i++) __atomic_store_n(&ix[i], VMM_REG_IX_EMPTY, SEQ_WORD_STORE);
    uint64_t hwm = __atomic_load_n(&r->hdr->chunks_hwm, __ATOMIC_RELAXED);
    if (hwm > r->hdr->chunk_count) hwm = r->hdr->chunk_count;
    for (uint64_t s = 0; s < hwm * VMM_REG_CHUNK_RECORDS; s++) {
        vmm_reg_alloc *a = rec_at(r, s);
        if (__atomic_load_n(&a->state, __ATOMIC_RELAXED) == VMM_REG_UNBOUND) continue;
        index_insert_locked(r, (uint32_t)s, __atomic_load_n(&a->pid, __ATOMIC_RELAXED),
                            vmm_reg_key(__atomic_load_n(&a->address, __ATOMIC_RELAXED), __atomic_load_n(&a->extent, __ATOMIC_RELAXED)));
    }
    __atomic_store_n(&r->hdr->index_seq, seq + 1, __ATOMIC_RELEASE);
}

/* May a waiter take the index lock from holder `w`?  Yes when the holder's proc slot has moved on
 * or its owner is dead; when liveness cannot be judged (another pid namespace), after 2 s, far
 * beyond the few stores a holder makes. */
static bool index_holder_gone(const vmm__reg *r, uint64_t w, double waited)
{
    uint32_t idx = (uint32_t)w - 1, gen = (uint32_t)(w >> 32);
    if (idx >= r->hdr->proc_capacity) return true; /* not a holder we know: a corrupt word */
    uint64_t claim = __atomic_load_n(&proc_at(r, idx)->claim, __ATOMIC_ACQUIRE);
    if ((uint32_t)claim == 0 || (uint32_t)(claim >> 32) != gen) return true;
    vmm_reg_proc p;
    int live = vmm__reg_read_proc(r, idx, &p) == 0 && p.start_time ? vmm__reg_liveness(p.pid, p.start_time, p.pidns) : VMM__UNKNOWN;
    return live == VMM__DEAD || (live == VMM__UNKNOWN && waited > 2.0);
}

static void index_lock(vmm__reg *r)
{
    pthread_mutex_lock(&index_mutex); /* this process's threads queue here, not on the shared word */
    uint64_t me = chunk_tag(r), w = 0;
    double since = 0;
    for (unsigned n = 0; !__atomic_compare_exchange_n(&r->hdr->index_lock, &w, me, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED); n++) {
        if (n >= 64) sched_yield();
        if (n % 256 == 255) {
            double t = monotonic_s();
            if (since == 0) since = t;
            if (index_holder_gone(r, w, t - since) &&
                __atomic_compare_exchange_n(&r->hdr->index_lock, &w, me, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
                break; /* every change leaves the index readable, so taking over needs no repair */
        }
        w = 0;
    }
}

static void index_unlock(vmm__reg *r)
{
    __atomic_store_n(&r->hdr->index_lock, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&index_mutex);
}

static void index_insert_locked(vmm__reg *r, uint32_t slot, uint32_t pid, uint64_t key)
{
    uint32_t *ix = index_at(r);
    uint64_t mask = r->hdr->index_slots - 1, i = vmm_reg_hash(pid, key) & mask;
    for (uint64_t n = 0; n <= mask; n++, i = (i + 1) & mask) {
        uint32_t e = __atomic_load_n(&ix[i], __ATOMIC_RELAXED);
        if (e == VMM_REG_IX_EMPTY || e == VMM_REG_IX_TOMB) {
            __atomic_store_n(&ix[i], slot + 1, __ATOMIC_RELEASE);
            return;
        }
    }
}

/* The entry becomes a tombstone, so no other entry moves under a reader; a run of tombstones just
 * before an empty entry is the end of every run through it, and turns back into empty entries. */
static void index_remove_locked(vmm__reg *r, uint64_t slot, uint32_t pid, uint64_t key)
{
    uint32_t *ix = index_at(r);
    uint64_t mask = r->hdr->index_slots - 1, i = vmm_reg_hash(pid, key) & mask;
    for (uint64_t n = 0;; n++, i = (i + 1) & mask) {
        uint32_t e = __atomic_load_n(&ix[i], __ATOMIC_RELAXED);
        if (e == VMM_REG_IX_EMPTY || n > mask) return;
        if (e == slot + 1) break;
    }
    __atomic_store_n(&ix[i], VMM_REG_IX_TOMB, __ATOMIC_RELEASE);
    if (__atomic_load_n(&ix[(i + 1) & mask], __ATOMIC_RELAXED) != VMM_REG_IX_EMPTY) return;
    for (uint64_t n = 0; n <= mask && __atomic_load_n(&ix[i], __ATOMIC_RELAXED) == VMM_REG_IX_TOMB; n++, i = (i - 1) & mask)
        __atomic_store_n(&ix[i], VMM_REG_IX_EMPTY, __ATOMIC_RELEASE);
}

/* ---- readers ---- */

int vmm__reg_read_alloc_within(const vmm__reg *r, uint64_t slot, vmm_reg_alloc *out, vmm__reg_wait *w)
{
    if (slot >= r->hdr->capacity) return -EINVAL;
    const vmm_reg_alloc *a = rec_at(r, slot);
    return seq_read(a, sizeof *a, &a->seq, out, w);
}

int vmm__reg_read_alloc(const vmm__reg *r, uint64_t slot, vmm_reg_alloc *out)
{
    vmm__reg_wait w = {0};
    return vmm__reg_read_alloc_within(r, slot, out, &w);
}

int vmm__reg_read_proc_within(const vmm__reg *r, uint32_t index, vmm_reg_proc *out, vmm__reg_wait *w)
{
    if (index >= r->hdr->proc_capacity) return -EINVAL;
    const vmm_reg_proc *p = proc_at(r, index);
    int rc = seq_read(p, sizeof *p, &p->seq, out, w);
    out->claim = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
    out->n_allocs = __atomic_load_n(&p->n_allocs, __ATOMIC_RELAXED);
    out->bytes_requested = __atomic_load_n(&p->bytes_requested, __ATOMIC_RELAXED);
    out->bytes_mapped = __atomic_load_n(&p->bytes_mapped, __ATOMIC_RELAXED);
    out->allocs = __atomic_load_n(&p->allocs, __ATOMIC_RELAXED);
    out->allocs_backed = __atomic_load_n(&p->allocs_backed, __ATOMIC_RELAXED);
    out->passed_capture = __atomic_load_n(&p->passed_capture, __ATOMIC_RELAXED);
    out->passed_device_full = __atomic_load_n(&p->passed_device_full, __ATOMIC_RELAXED);
    out->passed_unsupported = __atomic_load_n(&p->passed_unsupported, __ATOMIC_RELAXED);
    out->maps_adopted = __atomic_load_n(&p->maps_adopted, __ATOMIC_RELAXED);
    out->peak_requested = __atomic_load_n(&p->peak_requested, __ATOMIC_RELAXED);
    return rc;
}

int vmm__reg_read_proc(const vmm__reg *r, uint32_t index, vmm_reg_proc *out)
{
    vmm__reg_wait w = {0};
    return vmm__reg_read_proc_within(r, index, out, &w);
}

/* Search key (pid, key) for the live record covering `address`: 1 = found (in *out), 0 = not there. */
static int index_search(const vmm__reg *r, uint32_t pid, uint64_t key, uint64_t address, vmm_reg_alloc *out, uint64_t *slot,
                        vmm__reg_wait *w)
{
    const uint32_t *ix = index_at(r);
    uint64_t mask = r->hdr->index_slots - 1, cap = r->hdr->capacity;
    uint64_t i = vmm_reg_hash(pid, key) & mask;
    for (uint64_t n = 0; n <= mask; n++, i = (i + 1) & mask) {
        uint32_t e = __atomic_load_n(&ix[i], __ATOMIC_ACQUIRE);
        if (e == VMM_REG_IX_EMPTY) return 0;
        if (e == VMM_REG_IX_TOMB || e - 1 >= cap) continue; /* a corrupt entry is ignored, never dereferenced */
        const vmm_reg_alloc *a = rec_at(r, e - 1);
        if (__atomic_load_n(&a->pid, SEQ_WORD_LOAD) != pid ||
            vmm_reg_key(__atomic_load_n(&a->address, SEQ_WORD_LOAD), __atomic_load_n(&a->extent, SEQ_WORD_LOAD)) != key)
            continue;
        if (seq_read(a, sizeof *a, &a->seq, out, w) == 0 && out->pid == pid && vmm_reg_key(out->address, out->extent) == key &&
            out->state == VMM_REG_LIVE && out->address <= address && address - out->address < out->extent) {
            *slot = e - 1;
            return 1;
        }
    }
    return 0;
}

/* One level's two index searches for the record of pid holding address (it starts in address's
 * block of 2^g bytes or the one before). */
static bool level_search(const vmm__reg *r, uint32_t pid, unsigned g, uint64_t address, vmm_reg_alloc *out, uint64_t *slot,
                         vmm__reg_wait *w)
{
    uint64_t block = address & ~((1ull << g) - 1);
    return index_search(r, pid, block | g, address, out, slot, w) ||
           (block >= (1ull << g) && index_search(r, pid, (block - (1ull << g)) | g, address, out, slot, w));
}

int vmm__reg_find(const vmm__reg *r, uint32_t pid, uint64_t address, vmm_reg_alloc *out, uint64_t *slot)
{
    return vmm__reg_find_near(r, pid, address, 0, out, slot);
}

int vmm__reg_find_near(const vmm__reg *r, uint32_t pid, uint64_t address, uint64_t size, vmm_reg_alloc *out,
                       uint64_t *slot)
{
    /* a record holding [address, address + size) is at least size bytes: its level is size's or
     * above, so those levels are searched first (an importer's range inside one allocation is
     * found in a few searches, not two a level from the lowest); then the levels below, for a
     * range across records, whose first may be smaller */
    unsigned g0 = size ? vmm_reg_level(size) : VMM_REG_MIN_LEVEL;
    if (g0 > VMM_REG_MAX_LEVEL) g0 = VMM_REG_MAX_LEVEL;
    uint64_t dummy;
    double give_up = 0;
    vmm__reg_wait w = {0}; /* an index may lead to one busy record many times */
    if (!slot) slot = &dummy;
    for (int attempt = 0; attempt < READ_RETRIES; attempt++) {
        uint64_t s1 = __atomic_load_n(&r->hdr->index_seq, __ATOMIC_ACQUIRE);
        /* Search even while gc rebuilds the index: what a search finds is checked against the
         * record itself; only "not found" needs a quiet index. */
        if ((s1 & 1u) && attempt > 64) sched_yield();
        for (unsigned g = g0; g <= VMM_REG_MAX_LEVEL; g++)
            if (level_search(r, pid, g, address, out, slot, &w)) return 0;
        for (unsigned g = g0; g-- > VMM_REG_MIN_LEVEL;)
            if (level_search(r, pid, g, address, out, slot, &w)) return 0;
        SEQ_FENCE(__ATOMIC_ACQUIRE);
        if (!(s1 & 1u) && __atomic_load_n(&r->hdr->index_seq, __ATOMIC_RELAXED) == s1) return -ENOENT;
        /* Retrying waits out a rebuild, which takes milliseconds.  An index that stays odd (gc
         * died mid-rebuild, or a corrupt header) whose every search is long would otherwise hold
         * the reader for READ_RETRIES full searches: hours on a full 2M-entry index. */
        double now = monotonic_s();
        if (give_up == 0) give_up = now + FIND_RETRY_S;
        else if (now > give_up) break;
    }
    return -EAGAIN;
}

int vmm__reg_find_proc(const vmm__reg *r, uint32_t pid, vmm_reg_proc *out, uint32_t *index)
{
    vmm__reg_wait w = {0};
    for (uint32_t i = 0; i < r->hdr->proc_capacity; i++) {
        if ((uint32_t)__atomic_load_n(&proc_at(r, i)->claim, __ATOMIC_ACQUIRE) != pid) continue;
        if (vmm__reg_read_proc_within(r, i, out, &w) == 0) {
            if (index) *index = i;
            return 0;
        }
    }
    return -ENOENT;
}

int vmm__reg_for_each(const vmm__reg *r, vmm__reg_visit_fn fn, void *ctx)
{
    uint64_t hwm = __atomic_load_n(&r->hdr->chunks_hwm, __ATOMIC_ACQUIRE);
    if (hwm > r->hdr->chunk_count) hwm = r->hdr->chunk_count;
    vmm_reg_alloc rec;
    vmm__reg_wait w = {0};
    for (uint64_t c = 0; c < hwm; c++) {
        if (__atomic_load_n(chunk_at(r, c), __ATOMIC_ACQUIRE) == 0) continue;
        for (uint64_t s = c * VMM_REG_CHUNK_RECORDS; s < (c + 1) * VMM_REG_CHUNK_RECORDS; s++) {
            int rc = vmm__reg_read_alloc_within(r, s, &rec, &w);
            if (rc == 0 && rec.state == VMM_REG_UNBOUND) continue;
            int stop = fn(ctx, s, &rec, rc);
            if (stop) return stop;
        }
    }
    return 0;
}

/* ---- reclamation ---- */

unsigned vmm__reg_sweep_files(const vmm__reg *r, const char *kind, bool tmp_too, vmm__reg_file_dead_fn dead)
{
    /* Linux keeps POSIX shared memory objects as files in /dev/shm ("/name" is /dev/shm/name) */
    char prefix[sizeof r->name + 16];
    int plen = snprintf(prefix, sizeof prefix, "%s.%s.", r->name[0] == '/' ? r->name + 1 : r->name, kind);
    if (plen <= 0 || (size_t)plen >= sizeof prefix) return 0;
    DIR *dir = opendir("/dev/shm");
    if (!dir) return 0;
    unsigned removed = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        unsigned pid;
        unsigned long long start;
        int end = 0;
        if (strncmp(de->d_name, prefix, (size_t)plen) != 0 ||
            sscanf(de->d_name + plen, "%u.%llu%n", &pid, &start, &end) != 2 ||
            (de->d_name[plen + end] != 0 && !(tmp_too && strcmp(de->d_name + plen + end, ".tmp") == 0)))
            continue;
        char name[sizeof r->name + 48];
        if (snprintf(name, sizeof name, "/%s", de->d_name) >= (int)sizeof name) continue;
        if (dead(r, name, pid, start) && shm_unlink(name) == 0) removed++;
    }
    closedir(dir);
    return removed;
}

/* A dead owner's call-site names (layout.h, FRAMES) go with its records. */
static void remove_frames_file(const vmm__reg *r, uint32_t pid, uint64_t start_time)
{
    char name[sizeof r->name + 48];
    if (pid && start_time &&
        snprintf(name, sizeof name, VMM_REG_FRAMES_NAME, r->name, pid, (unsigned long long)start_time) < (int)sizeof name)
        shm_unlink(name);
}

int vmm__reg_gc(vmm__reg *r, vmm__reg_gc_stats *st)
{
    vmm__reg_gc_stats z = {0};
    if (!st) st = &z;
    memset(st, 0, sizeof *st);
    if (!r->writable) return -EPERM;
    pthread_mutex_lock(&gc_mutex);
    int rc = ofd_lock(r->fd, VMM_REG_LOCK_GC, F_WRLCK);
    if (rc) {
        pthread_mutex_unlock(&gc_mutex);
        return rc;
    }
    /* the index lock names its holder by proc slot: gc holds one for the run */
    bool attached_here = !r->attached && vmm__reg_attach(r, NULL) == 0;
    if (!r->attached) {
        ofd_unlock(r->fd, VMM_REG_LOCK_GC);
        pthread_mutex_unlock(&gc_mutex);
        return -ENOSPC;
    }
    uint32_t cap = r->hdr->proc_capacity;
    uint8_t *state = calloc(cap, 1); /* per proc slot: 0 unknown/alive, 1 dead */
    uint32_t *gens = calloc(cap, sizeof *gens);
    if (!state || !gens) {
        free(state);
        free(gens);
        if (attached_here) vmm__reg_detach(r);
        ofd_unlock(r->fd, VMM_REG_LOCK_GC);
        pthread_mutex_unlock(&gc_mutex);
        return -ENOMEM;
    }
    vmm__reg_wait w = {0};
    for (uint32_t i = 0; i < cap; i++) {
        uint64_t c = __atomic_load_n(&proc_at(r, i)->claim, __ATOMIC_ACQUIRE);
        gens[i] = (uint32_t)(c >> 32);
        if (attached_here && i == r->proc_index) continue; /* gc itself */
        if ((uint32_t)c == 0) {
            state[i] = 2; /* free slot: any chunk still tagged with it is an orphan */
            continue;
        }
        vmm_reg_proc p;
        int live = VMM__UNKNOWN;
        bool known = vmm__reg_read_proc_within(r, i, &p, &w) == 0 && p.start_time != 0;
        if (known)
            live = vmm__reg_liveness(p.pid, p.start_time, p.pidns);
        else /* died (or is) between claiming the slot and writing its identity: judge by pid */
            live = pid_exists((uint32_t)c) ? VMM__UNKNOWN : VMM__DEAD;
        if (live == VMM__ALIVE) st->procs_alive++;
        if (live == VMM__UNKNOWN) st->procs_unknown++;
        /* a dead owner whose memory a living keeper holds stays, records, names and all, until
         * the keeper lets go (layout.h KEEP) */
        if (live == VMM__DEAD && known && __atomic_load_n(&proc_at(r, i)->keeper_pid, __ATOMIC_ACQUIRE) &&
            vmm__keep_held(r, p.pid, p.start_time)) {
            st->procs_kept++;
            continue;
        }
        if (live == VMM__DEAD) {
            st->procs_dead++;
            state[i] = 1;
        }
    }
    for (uint64_t ch = 0; ch < r->hdr->chunk_count; ch++) {
        uint64_t o = __atomic_load_n(chunk_at(r, ch), __ATOMIC_ACQUIRE);
        if (o == 0) continue;
        uint64_t t = o & ~VMM_REG_CHUNK_RECLAIMING;
        uint32_t idx = (uint32_t)t - 1, gen = (uint32_t)(t >> 32);
        if (idx >= cap) continue;
        /* Re-read the claim now: a slot seen free may have been claimed again since. A chunk whose
         * tag names a generation the slot has moved past, or a slot its owner freed, is orphaned. */
        uint64_t claim = __atomic_load_n(&proc_at(r, idx)->claim, __ATOMIC_ACQUIRE);
        bool orphan = (uint32_t)(claim >> 32) != gen || (uint32_t)claim == 0;
        bool dead = state[idx] == 1 && gens[idx] == gen;
        if (!dead && !orphan) continue;
        if (!__atomic_compare_exchange_n(chunk_at(r, ch), &o, t | VMM_REG_CHUNK_RECLAIMING, false, __ATOMIC_ACQ_REL,
                                         __ATOMIC_RELAXED))
            continue;
        st->records_reclaimed += chunk_release(r, ch);
        st->chunks_reclaimed++;
    }
    for (uint32_t i = 0; i < cap; i++) {
        if (state[i] != 1) continue;
        vmm_reg_proc *p = proc_at(r, i);
        uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)(c >> 32) != gens[i]) continue;
        remove_frames_file(r, __atomic_load_n(&p->pid, __ATOMIC_RELAXED), __atomic_load_n(&p->start_time, __ATOMIC_RELAXED));
        vmm__names_unlink(r, __atomic_load_n(&p->pid, __ATOMIC_RELAXED), __atomic_load_n(&p->start_time, __ATOMIC_RELAXED));
        vmm__keep_unlink_unheld(r, __atomic_load_n(&p->pid, __ATOMIC_RELAXED), __atomic_load_n(&p->start_time, __ATOMIC_RELAXED));
        seq_begin(&p->seq);
        __atomic_store_n(&p->pid, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&p->start_time, 0, __ATOMIC_RELAXED);
        seq_end(&p->seq);
        counters_clear(p);
        __atomic_compare_exchange_n(&p->claim, &c, (uint64_t)gens[i] << 32, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    }
    __atomic_add_fetch(&r->hdr->stat_reclaimed, st->records_reclaimed, __ATOMIC_RELAXED);
    st->names_removed = vmm__names_sweep(r); /* tables whose owners died with their slots reclaimed before */
    st->keep_removed = vmm__keep_sweep(r);   /* keep files no keeper holds, of dead owners */
    if (st->chunks_reclaimed || (__atomic_load_n(&r->hdr->index_seq, __ATOMIC_ACQUIRE) & 1u)) {
        /* sweep the tombstones (and whatever a writer that died mid-change left) */
        index_lock(r);
        index_rebuild_locked(r);
        index_unlock(r);
        st->index_rebuilt = 1;
    }
    free(state);
    free(gens);
    if (attached_here) vmm__reg_detach(r);
    ofd_unlock(r->fd, VMM_REG_LOCK_GC);
    pthread_mutex_unlock(&gc_mutex);
    return 0;
}

uint64_t vmm__reg_footprint(const vmm__reg *r)
{
    struct stat st;
    return fstat(r->fd, &st) == 0 ? (uint64_t)st.st_blocks * 512ull : 0;
}
