/* The copies of a pause and a resume: an allocation's bytes out to host memory or the pause's
 * file, and back (sleep.c for the pools' allocations, adopt_sleep.c for the program's own VMM
 * memory, through sleep.h).  The floor under both: it calls only the driver table (state.c).
 *
 * Host memory: pinned for an allocation of 1 MiB or more, since only a pinned destination reaches
 * the link's device-to-host bandwidth (a pageable one goes through the driver's staging buffer at
 * about half of it); pageable malloc below that, where pinning (a syscall and page locking each)
 * costs more than the copy.  Pinned means an anonymous mapping with huge pages asked for, touched,
 * then page-locked (cuMemHostRegister): on an H100, 1 GiB took 194 ms to make and 23 ms to give
 * back, against cuMemHostAlloc's 499-571 ms and 144-149 ms (the kernel faults 2 MiB pages, and the
 * driver locks 512 times fewer), which is what a process's first pause costs; cuMemHostAlloc where
 * that fails, pageable where both do.  Each allocation has its own copy, so a free of a
 * paused allocation gives its copy back at once.
 *
 * Kept across cycles: pinning a buffer (faulting and locking every page) takes longer than
 * copying the same bytes over the link, so a pause that pinned anew each time could never reach
 * the copy's bandwidth, and colocated jobs pause and resume the same memory every step.  After
 * a resume an allocation keeps its pinned buffer, emptied ("idle"), while the process's idle
 * pinned bytes stay within VMMSHIM_PAUSE_HOST_CACHE (first come, in the order the resume
 * walks, the same each cycle), and its next kept pause copies straight into it.  The buffer
 * goes with the allocation (a free: vmm__sleep_kept_free from backing.c and adopt.c), and a
 * fork child never counts or frees its parent's (the epoch below).  Pageable buffers are not
 * kept: malloc of less than 1 MiB costs next to nothing.
 *
 * Batched: a copy between device memory and a pinned buffer is queued (cuMemcpyDtoHAsync /
 * HtoDAsync on the legacy stream of the context current at the call), and vmm__sleep_wait
 * synchronizes each context that queued one, once; so the per-call cost of many pieces
 * overlaps their transfers instead of adding up.  Nothing may read, unmap or free either side
 * before that wait (FAKECUDA_ASYNC_DEFER makes the tests catch it).  Pageable and file copies
 * stay synchronous: the driver stages pageable memory through its own pinned buffer anyway.
 * Marks (events behind the copies queued so far) let a pause release the segments whose copies
 * are done while the rest still move: releasing takes ~25 us a segment, ~10% of a pause of many
 * allocations if it waited for the last copy. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backing/internal.h"
#include "backing/sleep.h"
#include "core/options.h"

#define PINNED_MIN (1u << 20)
#define HUGE_PAGE (2u << 20)
#define STAGE_BYTES (8u << 20) /* the file's staging buffer */

/* The pause's unlinked file, shared by every allocation kept in it. */
struct vmm__sleep_file {
    int fd;
    unsigned refs;
};

/* One allocation's copy.  host: a buffer of cap bytes, holding the contents (full, file NULL) or
 * idle (pinned, counted in idle_bytes) or, with the contents in the file, idle beside it. */
typedef struct kept {
    void *host;
    uint64_t cap;
    uint64_t mapped; /* pinned: the length of its own mapping, or 0 when cuMemHostAlloc made it */
    int pinned, idle, full;
    unsigned epoch;      /* the process image it was made in: a fork child leaves its parent's alone */
    vmm__sleep_file *file;
    uint64_t off, bytes; /* the contents: bytes, at off in file when file is set */
} kept;

/* Pinned bytes kept idle between cycles (at most VMMSHIM_PAUSE_HOST_CACHE), and the fork epoch:
 * both atomics, since the pools' copies run under vmm__S.lock and the adopted ones under adopt.c's. */
static uint64_t idle_bytes;
static unsigned epoch;

static void forget_after_fork(void)
{
    /* the parent's buffers are not the child's: with a real driver its pinned pages are not even
     * mapped here (the driver marks them DONTFORK), and its file is shared with the parent */
    __atomic_store_n(&idle_bytes, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&epoch, 1, __ATOMIC_RELAXED);
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, forget_after_fork); }

static unsigned epoch_now(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_atfork); /* before this image makes its first copy */
    return __atomic_load_n(&epoch, __ATOMIC_RELAXED);
}

int vmm__sleep_say(char *why, size_t len, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
    return rc;
}

int vmm__sleep_push(CUcontext ctx) { return ctx && vmm__cu.CtxPushCurrent(ctx) == CUDA_SUCCESS; }

void vmm__sleep_pop(void)
{
    CUcontext popped;
    (void)VMM__TWICE(vmm__cu.CtxPopCurrent(&popped));
}

/* ---- the file and its staging buffer ---- */

static void file_drop(vmm__sleep_file *f)
{
    if (f && --f->refs == 0) {
        close(f->fd);
        free(f);
    }
}

int vmm__sleep_io_file(vmm__sleep_io *io, char *why, size_t len)
{
    const char *dir = vmm__opt_str(VMM__OPT_PAUSE_DIR);
    if (!*dir) dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = "/tmp";
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600); /* unlinked: it goes with the process */
    if (fd < 0)
        return vmm__sleep_say(why, len, -EIO, "cannot make an unlinked file in %s (VMMSHIM_PAUSE_DIR): %s", dir, strerror(errno));
    vmm__sleep_file *f = calloc(1, sizeof *f);
    if (!f) {
        close(fd);
        return vmm__sleep_say(why, len, -EIO, "out of memory");
    }
    f->fd = fd;
    f->refs = 1; /* the call's own, until vmm__sleep_io_end */
    io->f = f;
    return 0;
}

static int stage_get(vmm__sleep_io *io)
{
    if (io->stage) return 0;
    if (vmm__cu.MemHostAlloc && vmm__cu.MemHostAlloc(&io->stage, STAGE_BYTES, 0) == CUDA_SUCCESS) io->stage_pinned = 1;
    else if (!(io->stage = malloc(STAGE_BYTES))) return -ENOMEM;
    return 0;
}

void vmm__sleep_io_end(vmm__sleep_io *io)
{
    (void)vmm__sleep_wait(io); /* nothing queued may outlive the call */
    if (io->stage && io->stage_pinned) vmm__cu.MemFreeHost(io->stage);
    else free(io->stage);
    io->stage = NULL;
    file_drop(io->f);
    io->f = NULL;
}

/* ---- queued copies ---- */

/* Whether a copy may be queued in the current context: it is noted, to be waited for once. */
static int queue_here(vmm__sleep_io *io, int dtoh)
{
    CUcontext c = NULL;
    if ((dtoh ? !vmm__cu.MemcpyDtoHAsync : !vmm__cu.MemcpyHtoDAsync) || !vmm__cu.StreamSynchronize ||
        vmm__cu.CtxGetCurrent(&c) != CUDA_SUCCESS || !c)
        return 0;
    for (int i = 0; i < io->n_ctx; i++)
        if (io->ctx[i] == c) return 1;
    if (io->n_ctx == VMM__SLEEP_IO_CTX) return 0; /* more contexts than that: this one copies synchronously */
    io->ctx[io->n_ctx++] = c;
    return 1;
}

int vmm__sleep_wait(vmm__sleep_io *io)
{
    int rc = 0;
    for (int i = 0; i < io->n_ctx; i++) {
        if (!vmm__sleep_push(io->ctx[i])) {
            rc = -EIO;
            continue;
        }
        /* the legacy stream of that context: every copy queued there is done after it */
        if (vmm__cu.StreamSynchronize(NULL) != CUDA_SUCCESS) rc = -EIO;
        vmm__sleep_pop();
    }
    io->n_ctx = 0;
    return rc;
}

#define MARK_BYTES (128ull << 20)

struct vmm__sleep_mark {
    CUevent ev;
    uintptr_t upto;
};

void vmm__sleep_marks_add(vmm__sleep_io *io, vmm__sleep_marks *mk, uint64_t bytes, uintptr_t upto)
{
    if (mk->off || (mk->since += bytes) < MARK_BYTES) return;
    mk->since = 0;
    if (mk->n == mk->cap) {
        size_t cap = mk->cap ? 2 * mk->cap : 64;
        struct vmm__sleep_mark *m = realloc(mk->m, cap * sizeof *m);
        if (!m) {
            mk->off = 1;
            return;
        }
        mk->m = m;
        mk->cap = cap;
    }
    CUevent ev;
    if (io->n_ctx != 1 || !vmm__sleep_push(io->ctx[0])) {
        mk->off = 1;
        return;
    }
    int ok = vmm__cu.EventCreate(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS;
    if (ok && vmm__cu.EventRecord(ev, NULL) != CUDA_SUCCESS) { /* the legacy stream, as the copies */
        vmm__cu.EventDestroy(ev);
        ok = 0;
    }
    vmm__sleep_pop();
    if (!ok) {
        mk->off = 1;
        return;
    }
    mk->m[mk->n++] = (struct vmm__sleep_mark){ev, upto};
}

int vmm__sleep_marks_next(vmm__sleep_marks *mk, uintptr_t *upto, int *failed)
{
    if (mk->next == mk->n) return 0;
    struct vmm__sleep_mark *m = &mk->m[mk->next++];
    if (vmm__cu.EventSynchronize(m->ev) != CUDA_SUCCESS) *failed = 1;
    vmm__cu.EventDestroy(m->ev);
    *upto = m->upto;
    return 1;
}

void vmm__sleep_marks_end(vmm__sleep_marks *mk)
{
    uintptr_t upto;
    int failed = 0;
    while (vmm__sleep_marks_next(mk, &upto, &failed)) {
    }
    free(mk->m);
    memset(mk, 0, sizeof *mk);
}

/* ---- pinned buffers ---- */

/* An anonymous mapping of n bytes (rounded up to pages, *len) for a pinned buffer, not yet touched,
 * from a 2 MiB boundary so that the kernel can back all but the tail with huge pages; NULL when
 * the driver cannot register host memory or the mapping fails. */
static char *host_map(uint64_t n, size_t *len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (!vmm__cu.MemHostRegister || !vmm__cu.MemHostUnregister || n > SIZE_MAX - 2 * HUGE_PAGE) return NULL;
    size_t align = n >= HUGE_PAGE ? HUGE_PAGE : page, span;
    *len = (n + page - 1) / page * page;
    span = *len + align - page;
    char *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    char *p = (char *)(((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1));
    if (p > m) munmap(m, (size_t)(p - m));
    if (p + *len < m + span) munmap(p + *len, (size_t)(m + span - (p + *len)));
    (void)madvise(p, *len, MADV_HUGEPAGE); /* refused where huge pages are off: small pages then */
    (void)madvise(p, *len, MADV_DONTFORK); /* a fork child never sees the parent's buffers */
    return p;
}

/* Faulted here, not one page at a time by the driver. */
static void host_touch(char *p, size_t len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t i = 0; i < len; i += page) p[i] = 0;
}

/* n bytes of pinned host memory, *mapped set as kept.mapped says; NULL when neither way works. */
static void *pinned_new(uint64_t n, uint64_t *mapped)
{
    size_t len;
    char *p = host_map(n, &len);
    *mapped = 0;
    if (p) {
        host_touch(p, len);
        if (vmm__cu.MemHostRegister(p, len, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS) {
            *mapped = len;
            return p;
        }
        munmap(p, len);
    }
    void *h = NULL;
    return vmm__cu.MemHostAlloc && vmm__cu.MemHostAlloc(&h, n, 0) == CUDA_SUCCESS ? h : NULL;
}

static void host_free(kept *k);
static int idle_reserve(uint64_t n);

/* ---- pinning ahead, on several threads ----
 * A process's first kept pause pins a buffer for every allocation; faulting the pages in is most
 * of that (~190 ms a GiB on one thread), and it scales with threads.  So the buffers a pause is
 * about to need are made together: each is cut into pieces that up to PIN_THREADS threads fault in
 * at once, and the thread that faults a buffer's last piece registers it. */
#define PIN_THREADS 16
#define PIN_PIECE (64ull << 20)

typedef struct pin_job {
    void **slot;
    uint64_t n;
    char *p;
    size_t len;
    unsigned pieces, left; /* left: atomic */
    int ok;
} pin_job;

typedef struct pin_work {
    pin_job *jobs;
    size_t n_jobs, n_pieces, next; /* next: the next piece to take, atomic */
    size_t *job_of, *first;        /* per piece its job; per job its first piece */
    CUcontext ctx;                 /* cuMemHostRegister wants a context current */
} pin_work;

static void *pin_worker(void *arg)
{
    pin_work *w = arg;
    int pushed = -1;
    for (;;) {
        size_t i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (i >= w->n_pieces) break;
        pin_job *j = &w->jobs[w->job_of[i]];
        size_t off = (i - w->first[w->job_of[i]]) * PIN_PIECE, piece = j->len - off < PIN_PIECE ? j->len - off : PIN_PIECE;
        host_touch(j->p + off, piece);
        if (__atomic_sub_fetch(&j->left, 1, __ATOMIC_ACQ_REL)) continue;
        if (pushed < 0) pushed = vmm__sleep_push(w->ctx);
        j->ok = vmm__cu.MemHostRegister(j->p, j->len, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
    }
    if (pushed > 0) vmm__sleep_pop();
    return NULL;
}

static unsigned pin_threads(size_t pieces)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t t = cpus > 0 ? (size_t)cpus : 1;
    if (t > PIN_THREADS) t = PIN_THREADS;
    return (unsigned)(t < pieces ? t : pieces);
}

/* Whether keep would pin a new buffer for n bytes in slot. */
int vmm__sleep_lacks_buffer(void *const *slot, uint64_t n)
{
    const kept *k = *slot;
    if (n < PINNED_MIN) return 0;
    if (k && k->epoch != epoch_now()) return 0; /* a parent's: keep deals with it */
    return !k || !k->host || k->cap < n;
}

int vmm__sleep_pin_ahead(void **slots[], const uint64_t sizes[], size_t n)
{
    pin_work w = {0};
    size_t made = 0;
    if (!(w.jobs = calloc(n ? n : 1, sizeof *w.jobs)) || !(w.first = calloc(n ? n : 1, sizeof *w.first))) goto out;
    for (size_t i = 0; i < n; i++) {
        /* only what the host cache may keep idle: a buffer past it is made and given back by the
         * pause and resume themselves, as before */
        if (!vmm__sleep_lacks_buffer(slots[i], sizes[i]) || !idle_reserve(sizes[i])) continue;
        pin_job *j = &w.jobs[w.n_jobs];
        if (!(j->p = host_map(sizes[i], &j->len))) {
            __atomic_sub_fetch(&idle_bytes, sizes[i], __ATOMIC_RELAXED);
            continue;
        }
        j->slot = slots[i];
        j->n = sizes[i];
        j->pieces = j->left = (unsigned)((j->len + PIN_PIECE - 1) / PIN_PIECE);
        w.first[w.n_jobs++] = w.n_pieces;
        w.n_pieces += j->pieces;
    }
    if (!w.n_jobs || !(w.job_of = malloc(w.n_pieces * sizeof *w.job_of))) goto out;
    for (size_t j = 0; j < w.n_jobs; j++)
        for (unsigned k = 0; k < w.jobs[j].pieces; k++) w.job_of[w.first[j] + k] = j;
    if (vmm__cu.CtxGetCurrent(&w.ctx) != CUDA_SUCCESS) w.ctx = NULL;
    pthread_t th[PIN_THREADS];
    unsigned started = 0, want = pin_threads(w.n_pieces);
    while (started + 1 < want && pthread_create(&th[started], NULL, pin_worker, &w) == 0) started++;
    pin_worker(&w); /* this thread too, the current context already its own */
    for (unsigned t = 0; t < started; t++) pthread_join(th[t], NULL);
    for (size_t i = 0; i < w.n_jobs; i++) {
        pin_job *j = &w.jobs[i];
        kept *k = *j->slot;
        if (j->ok && !k && (k = calloc(1, sizeof *k))) {
            k->epoch = epoch_now();
            *j->slot = k;
        }
        if (!j->ok || !k) {
            if (j->ok) vmm__cu.MemHostUnregister(j->p);
            munmap(j->p, j->len);
            __atomic_sub_fetch(&idle_bytes, j->n, __ATOMIC_RELAXED);
            continue;
        }
        host_free(k); /* a smaller buffer of an earlier cycle */
        k->host = j->p;
        k->cap = j->n;
        k->mapped = j->len;
        k->pinned = k->idle = 1; /* as one kept from an earlier cycle: counted, and left so if the pause fails */
        made++;
    }
out:
    free(w.jobs);
    free(w.first);
    free(w.job_of);
    return (int)made;
}

static void pinned_free(void *p, uint64_t mapped)
{
    if (!mapped) {
        vmm__cu.MemFreeHost(p);
        return;
    }
    vmm__cu.MemHostUnregister(p);
    munmap(p, mapped);
}

void vmm__sleep_prepare_buffers(CUcontext ctx, const uint64_t sizes[], void *out[], size_t n)
{
    void ***slots = malloc((n ? n : 1) * sizeof *slots);
    for (size_t i = 0; i < n; i++) out[i] = NULL;
    if (!slots) return;
    for (size_t i = 0; i < n; i++) slots[i] = &out[i];
    int pushed = vmm__sleep_push(ctx);
    (void)vmm__sleep_pin_ahead(slots, sizes, n);
    if (pushed) vmm__sleep_pop();
    free(slots);
}

/* ---- one allocation's copy ---- */

static void idle_leave(kept *k)
{
    if (!k->idle) return;
    __atomic_sub_fetch(&idle_bytes, k->cap, __ATOMIC_RELAXED);
    k->idle = 0;
}

/* n more idle pinned bytes, if the process's fit VMMSHIM_PAUSE_HOST_CACHE with them: 1, counted;
 * a CAS so that two calls at once (the pools' and the adopted memory's locks differ) never
 * overshoot it. */
static int idle_reserve(uint64_t n)
{
    uint64_t cap = vmm__opt_size(VMM__OPT_PAUSE_HOST_CACHE), cur = __atomic_load_n(&idle_bytes, __ATOMIC_RELAXED);
    while (cur + n <= cap && !__atomic_compare_exchange_n(&idle_bytes, &cur, cur + n, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return cur + n <= cap;
}

static void host_free(kept *k)
{
    idle_leave(k);
    if (k->host && k->pinned) pinned_free(k->host, k->mapped);
    else free(k->host);
    k->host = NULL;
    k->cap = k->mapped = 0;
    k->pinned = 0;
}

/* The contents in the file go, its blocks given back now: a long pause of many frees keeps no
 * dead bytes. */
static void file_forget(kept *k)
{
    if (!k->file) return;
    (void)fallocate(k->file->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)k->off, (off_t)k->bytes);
    file_drop(k->file);
    k->file = NULL;
}

void vmm__sleep_kept_free(void *p)
{
    kept *k = p;
    if (!k) return;
    if (k->epoch == epoch_now()) { /* a parent's copy in a fork child: only the struct is the child's */
        file_forget(k);
        host_free(k);
    }
    free(k);
}

int vmm__sleep_host_at(const void *p, uint64_t off, void **host, uint64_t *bytes)
{
    const kept *k = p;
    if (!k || !k->host || k->file || k->epoch != epoch_now() || !(k->full || k->idle) || off >= k->bytes) return -ENOENT;
    *host = (char *)k->host + off;
    *bytes = k->bytes - off;
    return 0;
}

uint64_t vmm__sleep_drop_idle(void **pk)
{
    kept *k = *pk;
    if (!k || k->full || !k->idle || k->file) return 0;
    uint64_t n = k->cap;
    vmm__sleep_kept_free(k);
    *pk = NULL;
    return n;
}

int vmm__sleep_holds(const void *p)
{
    const kept *k = p;
    return k && k->full;
}

void vmm__sleep_kept_done(void **pk)
{
    kept *k = *pk;
    if (!k) return;
    if (k->epoch != epoch_now()) {
        vmm__sleep_kept_free(k);
        *pk = NULL;
        return;
    }
    file_forget(k);
    k->full = 0;
    if (k->host && k->pinned && !k->idle) k->idle = idle_reserve(k->cap);
    if (!k->idle) host_free(k);
    if (!k->host) {
        free(k);
        *pk = NULL;
    }
}

/* Into the file, through the staging buffer (synchronous copies: the buffer is reused at once). */
static int keep_in_file(vmm__sleep_io *io, CUdeviceptr addr, uint64_t n, kept *k)
{
    if (stage_get(io)) return -ENOMEM;
    k->off = io->file_end;
    for (uint64_t at = 0; at < n;) {
        size_t piece = n - at < STAGE_BYTES ? (size_t)(n - at) : STAGE_BYTES;
        if (vmm__cu.MemcpyDtoH(io->stage, addr + at, piece) != CUDA_SUCCESS) return -EIO;
        for (size_t w = 0; w < piece;) {
            ssize_t got = pwrite(io->f->fd, (char *)io->stage + w, piece - w, (off_t)(k->off + at + w));
            if (got <= 0) return got < 0 && errno == ENOSPC ? -ENOSPC : -EIO;
            w += (size_t)got;
        }
        at += piece;
    }
    io->file_end += n;
    k->file = io->f;
    io->f->refs++;
    return 0;
}

int vmm__sleep_keep(vmm__sleep_io *io, CUdeviceptr addr, uint64_t n, void **pk)
{
    if (!vmm__cu.MemcpyDtoH) return -EIO;
    kept *k = *pk;
    if (k && k->epoch != epoch_now()) { /* a parent's: never touched in a fork child */
        free(k);
        k = *pk = NULL;
    }
    int made = !k;
    if (made) {
        if (!(k = calloc(1, sizeof *k))) return -ENOMEM;
        k->epoch = epoch_now();
    }
    k->bytes = n;
    int rc = 0;
    if (io->f) rc = keep_in_file(io, addr, n, k);
    else {
        if (k->host && k->cap >= n) idle_leave(k); /* its buffer from the last cycle */
        else {
            host_free(k);
            if (n >= PINNED_MIN && (k->host = pinned_new(n, &k->mapped))) k->pinned = 1;
            else if (!(k->host = malloc(n ? n : 1))) rc = -ENOMEM;
            k->cap = k->host ? n : 0;
        }
        if (!rc) {
            CUresult c = k->pinned && queue_here(io, 1) ? vmm__cu.MemcpyDtoHAsync(k->host, addr, n, NULL)
                                                        : vmm__cu.MemcpyDtoH(k->host, addr, n);
            if (c != CUDA_SUCCESS) rc = -EIO;
        }
    }
    k->full = !rc;
    if (rc && made) { /* a buffer made for nothing goes; one from the last cycle stays idle */
        (void)vmm__sleep_wait(io);
        vmm__sleep_kept_free(k);
        k = NULL;
    } else if (rc) {
        (void)vmm__sleep_wait(io);
        vmm__sleep_kept_done((void **)&k);
    }
    *pk = k;
    return rc;
}

int vmm__sleep_restore(vmm__sleep_io *io, CUdeviceptr addr, void *p)
{
    const kept *k = p;
    if (!vmm__cu.MemcpyHtoD || !k || !k->full) return -EIO;
    if (!k->file) {
        CUresult c = k->pinned && queue_here(io, 0) ? vmm__cu.MemcpyHtoDAsync(addr, k->host, k->bytes, NULL)
                                                    : vmm__cu.MemcpyHtoD(addr, k->host, k->bytes);
        return c == CUDA_SUCCESS ? 0 : -EIO;
    }
    if (stage_get(io)) return -ENOMEM;
    for (uint64_t at = 0; at < k->bytes;) {
        size_t piece = k->bytes - at < STAGE_BYTES ? (size_t)(k->bytes - at) : STAGE_BYTES;
        for (size_t r = 0; r < piece;) {
            ssize_t got = pread(k->file->fd, (char *)io->stage + r, piece - r, (off_t)(k->off + at + r));
            if (got <= 0) return -EIO;
            r += (size_t)got;
        }
        if (vmm__cu.MemcpyHtoD(addr + at, io->stage, piece) != CUDA_SUCCESS) return -EIO;
        at += piece;
    }
    return 0;
}
