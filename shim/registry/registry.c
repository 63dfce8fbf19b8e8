/* The shared-memory registry's segment and its readers: creation and opening, the owners'
 * liveness, seq-checked copies, find by interior address, and the files beside it.  Everything
 * here reads or makes the segment and calls nothing else of the registry, so the writer
 * (writer.c), gc (gc.c), the name tables (names.c) and the keepers (keep.c) all stand on it and
 * none of them is called back.  The protocol every reader follows is written down in layout.h. */
#include "registry/registry.h"
#include "registry/internal.h"
#include "registry/seq.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PROC_CAPACITY 4096u
#define FIND_RETRY_S 0.05 /* longest a lookup retries while the index is rebuilt */
#define PAGE 4096u

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static uint64_t pow2_ceil(uint64_t v)
{
    uint64_t p = 1;
    while (p < v) p <<= 1;
    return p;
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

int vmm__reg_ofd_lock(int fd, int byte, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    while (fcntl(fd, F_OFD_SETLKW, &fl) != 0)
        if (errno != EINTR) return -errno;
    return 0;
}

void vmm__reg_ofd_unlock(int fd, int byte)
{
    struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    (void)fcntl(fd, F_OFD_SETLK, &fl);
}

int vmm__reg_back_range(int fd, uint64_t off, uint64_t len)
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
    int rc = vmm__reg_back_range(fd, 0, PAGE);
    if (!rc) rc = vmm__reg_back_range(fd, h.chunk_off, h.rec_off - h.chunk_off);
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
        if ((rc = vmm__reg_ofd_lock(fd, VMM_REG_LOCK_INIT, F_WRLCK)) != 0) {
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
        vmm__reg_ofd_unlock(fd, VMM_REG_LOCK_INIT);
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
    out->unpublished = __atomic_load_n(&p->unpublished, __ATOMIC_RELAXED);
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
    return vmm__reg_find_near(r, pid, address, 0, NULL, out, slot);
}

#define LEVEL_BITS (((1ull << (VMM_REG_MAX_LEVEL + 1)) - 1) & ~((1ull << VMM_REG_MIN_LEVEL) - 1))

static int found_at(uint64_t *levels, unsigned g)
{
    if (levels) *levels |= 1ull << g;
    return 0;
}

int vmm__reg_find_near(const vmm__reg *r, uint32_t pid, uint64_t address, uint64_t size, uint64_t *levels,
                       vmm_reg_alloc *out, uint64_t *slot)
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
        uint64_t first = levels ? *levels & LEVEL_BITS : 0;
        for (uint64_t bits = first; bits; bits &= bits - 1)
            if (level_search(r, pid, (unsigned)__builtin_ctzll(bits), address, out, slot, &w)) return 0;
        for (unsigned g = g0; g <= VMM_REG_MAX_LEVEL; g++)
            if (!(first >> g & 1) && level_search(r, pid, g, address, out, slot, &w)) return found_at(levels, g);
        for (unsigned g = g0; g-- > VMM_REG_MIN_LEVEL;)
            if (!(first >> g & 1) && level_search(r, pid, g, address, out, slot, &w)) return found_at(levels, g);
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

/* Atomic: other threads ask without the lock (a pause from outside runs on the broker thread, which
 * may still be at it while the exit path detaches under the lock). */
vmm_reg_proc *vmm__reg_self(vmm__reg *r)
{
    return __atomic_load_n(&r->attached, __ATOMIC_ACQUIRE) ? proc_at(r, r->proc_index) : NULL;
}

/* ---- the files beside the registry ---- */

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

uint64_t vmm__reg_footprint(const vmm__reg *r)
{
    struct stat st;
    return fstat(r->fd, &st) == 0 ? (uint64_t)st.st_blocks * 512ull : 0;
}
