/* Named tensors, the reader's side (layout.h NAMES): map another process's table read-only, check
 * it, and walk its live entries, each checked against the registry record it names; the owners'
 * update seqlock (VERSIONS).  The writer's side is names.c. */
#include "registry/internal.h"
#include "registry/names.h"
#include "registry/seq.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SNAPSHOT_S 0.05 /* longest a reader waits for one moment's names */

int vmm__names_validate(const void *base, size_t size, uint32_t pid, uint64_t start_time, char *err, size_t errlen)
{
    const vmm_names_header *h = base;
    if (size < sizeof *h) return vmm__names_say(err, errlen, -EPROTO, "name table: %zu bytes, shorter than its header", size);
    if (h->magic != VMM_NAMES_MAGIC) return vmm__names_say(err, errlen, -EPROTO, "name table: wrong magic (not a vmmshim name table)");
    if (__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE) != 1)
        return vmm__names_say(err, errlen, -EAGAIN, "name table: not initialised (its owner is still making it, or died doing so)");
    if (h->compat_version > VMM_NAMES_VERSION)
        return vmm__names_say(err, errlen, -ENOTSUP, "name table: layout version %u needs a reader of version %u; this one reads %u",
                   h->version, h->compat_version, VMM_NAMES_VERSION);
    if (h->entry_size != sizeof(vmm_names_entry) || h->header_size < sizeof *h || (h->header_size & 7) ||
        h->capacity == 0 || h->capacity > (1u << 24) ||
        h->header_size > size || (uint64_t)h->capacity * h->entry_size > size - h->header_size)
        return vmm__names_say(err, errlen, -EPROTO, "name table: corrupt header (sizes)");
    if (__atomic_load_n(&h->used, __ATOMIC_ACQUIRE) > h->capacity)
        return vmm__names_say(err, errlen, -EPROTO, "name table: corrupt header (more entries used than it holds)");
    if (h->pid != pid || h->start_time != start_time)
        return vmm__names_say(err, errlen, -EPROTO, "name table: it is of pid %u (start time %llu), not of pid %u (start time %llu)",
                   h->pid, (unsigned long long)h->start_time, pid, (unsigned long long)start_time);
    return 0;
}

int vmm__names_open(const vmm__reg *r, uint32_t pid, uint64_t start_time, vmm__names_map *m, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    m->fd = -1;
    char path[sizeof r->name + 48];
    if (vmm__names_path(r, pid, start_time, path, sizeof path)) return vmm__names_say(err, errlen, -ENAMETOOLONG, "name table name too long");
    int fd = shm_open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) return vmm__names_say(err, errlen, -errno, "name table %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return vmm__names_say(err, errlen, -e, "name table %s: %s", path, strerror(e));
    }
    if ((size_t)st.st_size < sizeof(vmm_names_header)) {
        close(fd);
        return vmm__names_say(err, errlen, st.st_size == 0 ? -EAGAIN : -EPROTO, "name table %s: %s", path,
                   st.st_size == 0 ? "empty (its owner is still making it)" : "shorter than its header");
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        return vmm__names_say(err, errlen, -e, "name table %s: mmap: %s", path, strerror(e));
    }
    int rc = vmm__names_validate(p, (size_t)st.st_size, pid, start_time, err, errlen);
    if (rc) {
        munmap(p, (size_t)st.st_size);
        close(fd);
        return rc;
    }
    m->fd = fd;
    m->base = p;
    m->size = (size_t)st.st_size;
    m->hdr = p;
    return 0;
}

void vmm__names_close(vmm__names_map *m)
{
    if (m->base) munmap((void *)m->base, m->size);
    if (m->fd >= 0) close(m->fd);
    memset(m, 0, sizeof *m);
    m->fd = -1;
}

/* layout.h NAMES (2): the registry record the entry names still holds it. */
static bool entry_held(const vmm__reg *r, const vmm_names_header *h, const vmm_names_entry *e, vmm__reg_wait *w)
{
    if (e->rec_slot >= r->hdr->capacity) return false;
    /* a record chunk nobody owns may be a hole of the sparse registry: reading it would back it */
    const uint64_t *chunks = (const uint64_t *)(r->base + r->hdr->chunk_off);
    if (__atomic_load_n(&chunks[e->rec_slot / VMM_REG_CHUNK_RECORDS], __ATOMIC_ACQUIRE) == 0) return false;
    vmm_reg_alloc rec;
    if (vmm__reg_read_alloc_within(r, e->rec_slot, &rec, w) != 0) return false;
    return rec.state == VMM_REG_LIVE && rec.pid == h->pid && rec.start_time == h->start_time &&
           memcmp(rec.alloc_id, e->alloc_id, sizeof rec.alloc_id) == 0 && rec.address <= e->address &&
           e->address - rec.address < rec.extent;
}

/* An entry read from another process's memory is checked before anyone uses its fields. */
static bool entry_sane(vmm_names_entry *e)
{
    e->name[sizeof e->name - 1] = 0;
    if (!e->name[0] || e->ndim > VMM_NAMES_MAX_DIMS || e->mesh_ndim > VMM_NAMES_MESH_MAX_DIMS || !e->dtype_bits || !e->dtype_lanes || !e->nbytes ||
        e->address > UINT64_MAX - e->nbytes)
        return false;
    for (uint32_t i = 0; i < e->ndim; i++)
        if (e->shape[i] < 0 || e->strides[i] < 0) return false;
    return true;
}

int vmm__names_for_each(const vmm__reg *r, const vmm__names_map *m, vmm__names_fn fn, void *ctx)
{
    const vmm_names_header *h = m->hdr;
    const uint8_t *entries = m->base + h->header_size;
    vmm_names_entry *got = NULL;
    size_t n = 0, cap = 0;
    vmm__reg_wait w = {0};
    double give_up = monotonic_s() + SNAPSHOT_S;
    for (int attempt = 0;; attempt++) {
        uint64_t c1 = __atomic_load_n(&h->changes, __ATOMIC_ACQUIRE);
        bool late = monotonic_s() > give_up;
        if ((c1 & 1u) && !late) {
            if (attempt > 64) sched_yield();
            continue;
        }
        n = 0;
        uint64_t used = __atomic_load_n(&h->used, __ATOMIC_ACQUIRE);
        if (used > h->capacity) used = h->capacity;
        for (uint64_t i = 0; i < used; i++) {
            const vmm_names_entry *src = (const vmm_names_entry *)(entries + i * sizeof(vmm_names_entry));
            vmm_names_entry e = {0};
            if (seq_read(src, sizeof e, &src->seq, &e, &w) != 0 || e.state != VMM_NAMES_LIVE || !entry_sane(&e)) continue;
            if (!entry_held(r, h, &e, &w)) continue;
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 64;
                vmm_names_entry *g = realloc(got, nc * sizeof *g);
                if (!g) {
                    free(got);
                    return -ENOMEM;
                }
                got = g, cap = nc;
            }
            got[n++] = e;
        }
        SEQ_FENCE(__ATOMIC_ACQUIRE);
        /* one moment's names; past the wait, each entry consistent on its own will do (an owner
         * in another pid namespace that died mid-change leaves changes odd for good) */
        if ((__atomic_load_n(&h->changes, __ATOMIC_RELAXED) == c1 && !(c1 & 1u)) || late) break;
    }
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) rc = fn(ctx, &got[i]) ? 1 : 0;
    free(got);
    return 0;
}

void vmm__names_state(const vmm__names_map *m, uint64_t *seq, uint64_t *version, char job[24])
{
    const vmm_names_header *h = m->hdr;
    uint64_t s1, v;
    do {
        s1 = __atomic_load_n(&h->weights_seq, __ATOMIC_ACQUIRE);
        v = __atomic_load_n(&h->weights_version, __ATOMIC_RELAXED);
        SEQ_FENCE(__ATOMIC_ACQUIRE);
    } while (__atomic_load_n(&h->weights_seq, __ATOMIC_RELAXED) != s1 && !(s1 & 1u));
    *seq = s1, *version = v;
    memcpy(job, (const char *)h->job, 24);
    job[23] = 0;
}
