/* Named tensors: each owner's name table beside the registry (layout.h, NAMES).
 *
 * Why a table per owner beside the registry rather than records in it: only the owner writes
 * it, so it needs no lock shared between processes, no claiming of slots and no reclaiming
 * inside the registry; it goes with its owner (unlinked at exit, by gc after a crash) as the
 * frames file does; and the registry's layout, which every reader, the fuzzer and vmmctl check
 * by version, stays as it is.  A reader in another language reads one more fixed-width file with
 * the same seq protocol, and checks each name against the registry record it names.
 *
 * The writer keeps, process-locally, every name by its text (to replace or unpublish it) and by
 * the registry slots its bytes lie in (to drop it when one is freed: the registry's remove and
 * retract call vmm__names_drop_slot, so every free route is covered).  One mutex serialises the
 * writer's threads; publish prepares everything that can fail (checks, the records, memory, the
 * object's pages) before it writes the first entry, so a failed call changes nothing. */
#include "registry/internal.h"
#include "registry/keep.h"
#include "registry/names.h"
#include "registry/seq.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uthash.h>
#include <utlist.h>

#define PAGE 4096u
#define HEADER_SIZE PAGE
#define MAX_SPAN (1ull << VMM_REG_MAX_LEVEL) /* no allocation is larger */

typedef struct nm_name nm_name;
typedef struct nm_rec nm_rec;

/* A name's bytes lie in one record, or in several back to back (a program's own mappings). */
typedef struct nm_link {
    nm_name *name;
    nm_rec *rec;
    struct nm_link *prev, *next;
} nm_link;

struct nm_name {
    char key[VMM_NAMES_NAME_MAX + 1];
    uint32_t entry;
    uint32_t n_links;
    nm_link *links;
    UT_hash_handle hh;
};

/* The names whose bytes lie in registry slot `slot`. */
struct nm_rec {
    uint32_t slot;
    nm_link *head;
    UT_hash_handle hh;
};

struct vmm__names {
    int fd;
    uint8_t *base;
    size_t size;
    vmm_names_header *hdr;
    char path[sizeof(((vmm__reg *)0)->name) + 48];
    nm_name *by_name;
    nm_rec *by_rec;
    uint32_t *free_entries; /* room for every entry used, so a drop never allocates */
    uint32_t n_free, cap_free;
    uint64_t backed; /* entries [0, backed) lie in backed pages */
    uint64_t count;
};

/* One writer per process (one table per process); threads queue here. */
static pthread_mutex_t names_mutex = PTHREAD_MUTEX_INITIALIZER;
/* A fork child's copy of its parent's table state: never used or freed there, only kept
 * reachable so a leak checker does not blame the child for it. */
static struct vmm__names *volatile inherited;

int vmm__names_say(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

int vmm__names_path(const vmm__reg *r, uint32_t pid, uint64_t start_time, char *buf, size_t len)
{
    int n = snprintf(buf, len, VMM_REG_NAMES_NAME, r->name, pid, (unsigned long long)start_time);
    return n > 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

static vmm_names_entry *entry_at(const struct vmm__names *t, uint64_t i)
{
    return (vmm_names_entry *)(t->base + HEADER_SIZE + i * sizeof(vmm_names_entry));
}

uint64_t vmm__names_span(uint32_t itemsize, uint32_t ndim, const int64_t *shape, const int64_t *strides)
{
    uint64_t last = 0; /* index of the last element, in elements */
    for (uint32_t i = 0; i < ndim; i++) {
        if (shape[i] == 0) return 0;
        uint64_t step;
        if (__builtin_mul_overflow((uint64_t)(shape[i] - 1), (uint64_t)strides[i], &step) ||
            __builtin_add_overflow(last, step, &last))
            return UINT64_MAX;
    }
    uint64_t bytes;
    if (__builtin_add_overflow(last, 1, &last) || __builtin_mul_overflow(last, (uint64_t)itemsize, &bytes)) return UINT64_MAX;
    return bytes;
}

/* ---- writer ---- */

static void changes_step(struct vmm__names *t)
{
    __atomic_store_n(&t->hdr->changes, __atomic_load_n(&t->hdr->changes, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
    SEQ_FENCE(__ATOMIC_RELEASE); /* the entries written next are seen only with the count moved */
}

static void entry_write(vmm_names_entry *e, const vmm_names_entry *v)
{
    seq_begin(&e->seq);
    copy_words_in((uint8_t *)e + 8, (uint8_t *)v + 8, sizeof *v - 8);
    __atomic_store_n(&e->state, VMM_NAMES_LIVE, __ATOMIC_RELAXED);
    seq_end(&e->seq);
}

static void entry_clear(vmm_names_entry *e)
{
    seq_begin(&e->seq);
    __atomic_store_n(&e->generation, __atomic_load_n(&e->generation, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&e->state, VMM_NAMES_FREE, __ATOMIC_RELAXED);
    seq_end(&e->seq);
}

/* Back the pages of entries [t->backed, upto), so a full /dev/shm fails a publish, not a store. */
static int back_entries(struct vmm__names *t, uint64_t upto)
{
    if (upto <= t->backed) return 0;
    uint64_t a = (HEADER_SIZE + t->backed * sizeof(vmm_names_entry)) / PAGE * PAGE;
    uint64_t e = (HEADER_SIZE + upto * sizeof(vmm_names_entry) + PAGE - 1) / PAGE * PAGE;
    int rc = posix_fallocate(t->fd, (off_t)a, (off_t)(e - a));
    if (rc && rc != EOPNOTSUPP && rc != EINVAL) return -rc;
    t->backed = upto;
    return 0;
}

static void table_free(struct vmm__names *t)
{
    nm_name *n, *tmp;
    HASH_ITER(hh, t->by_name, n, tmp) {
        HASH_DEL(t->by_name, n);
        free(n->links);
        free(n);
    }
    nm_rec *rc, *rtmp;
    HASH_ITER(hh, t->by_rec, rc, rtmp) {
        HASH_DEL(t->by_rec, rc);
        free(rc);
    }
    if (t->base) munmap(t->base, t->size);
    if (t->fd >= 0) close(t->fd);
    free(t->free_entries);
    free(t);
}

/* Linux keeps POSIX shared memory objects as files in /dev/shm ("/name" is /dev/shm/name). */
static int shm_file(const char *name, char *buf, size_t len)
{
    int n = snprintf(buf, len, "/dev/shm/%s", name[0] == '/' ? name + 1 : name);
    return n > 0 && (size_t)n < len ? 0 : -ENAMETOOLONG;
}

/* This process's table, made at its first publish: complete under a temporary name, then renamed
 * into place (replacing one an earlier image of this process left: exec keeps pid and start
 * time), so a reader finds a whole table or none. */
static int table_make(vmm__reg *r, char *err, size_t errlen)
{
    struct vmm__names *t = calloc(1, sizeof *t);
    if (!t) return vmm__names_say(err, errlen, -ENOMEM, "out of memory");
    t->fd = -1;
    char tmp[sizeof t->path + 8], tmp_file[sizeof tmp + 16], file[sizeof t->path + 16];
    if (vmm__names_path(r, r->pid, r->start_time, t->path, sizeof t->path) ||
        snprintf(tmp, sizeof tmp, "%s.tmp", t->path) >= (int)sizeof tmp || shm_file(tmp, tmp_file, sizeof tmp_file) ||
        shm_file(t->path, file, sizeof file)) {
        free(t);
        return vmm__names_say(err, errlen, -ENAMETOOLONG, "the name table's object name (registry %s) is too long", r->name);
    }
    shm_unlink(tmp); /* a crash of this process's earlier image mid-make */
    t->fd = shm_open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    t->size = HEADER_SIZE + (size_t)VMM__NAMES_CAPACITY * sizeof(vmm_names_entry);
    struct stat reg;
    int rc = t->fd < 0 ? -errno : 0;
    const char *step = "shm_open";
    /* whoever may read the registry may read the names (only the owner writes them) */
    if (!rc && fstat(r->fd, &reg) == 0 && (reg.st_mode & 0060) && fchown(t->fd, (uid_t)-1, reg.st_gid) == 0)
        (void)fchmod(t->fd, reg.st_mode & 0640);
    if (!rc && ftruncate(t->fd, (off_t)t->size) != 0) rc = -errno, step = "ftruncate";
    if (!rc) {
        int f = posix_fallocate(t->fd, 0, HEADER_SIZE);
        if (f && f != EOPNOTSUPP && f != EINVAL) rc = -f, step = "fallocate";
    }
    if (!rc) {
        void *p = mmap(NULL, t->size, PROT_READ | PROT_WRITE, MAP_SHARED, t->fd, 0);
        if (p == MAP_FAILED) rc = -errno, step = "mmap";
        else t->base = p;
    }
    if (!rc) {
        vmm_names_header *h = (vmm_names_header *)t->base;
        h->magic = VMM_NAMES_MAGIC;
        h->version = VMM_NAMES_VERSION;
        h->compat_version = VMM_NAMES_COMPAT_VERSION;
        h->header_size = HEADER_SIZE;
        h->entry_size = sizeof(vmm_names_entry);
        h->capacity = VMM__NAMES_CAPACITY;
        h->pid = r->pid;
        h->max_dims = VMM_NAMES_MAX_DIMS;
        h->start_time = r->start_time;
        h->pidns = r->pidns;
        h->created_ns = clock_ns(CLOCK_REALTIME);
        __atomic_store_n(&h->ready, 1, __ATOMIC_RELEASE);
        if (rename(tmp_file, file) != 0) rc = -errno, step = "rename";
    }
    if (rc) {
        vmm__names_say(err, errlen, rc, "cannot make the name table %s: %s: %s", t->path, step, strerror(-rc));
        if (t->fd >= 0) shm_unlink(tmp);
        table_free(t);
        return rc;
    }
    t->hdr = (vmm_names_header *)t->base;
    r->names = t;
    return 0;
}

static void unlink_from_recs(struct vmm__names *t, nm_name *n)
{
    for (uint32_t i = 0; i < n->n_links; i++) {
        nm_rec *rec = n->links[i].rec;
        DL_DELETE(rec->head, &n->links[i]);
        if (!rec->head) {
            HASH_DEL(t->by_rec, rec);
            free(rec);
        }
    }
}

static void drop_name(vmm__reg *r, struct vmm__names *t, nm_name *n)
{
    unlink_from_recs(t, n);
    entry_clear(entry_at(t, n->entry));
    t->free_entries[t->n_free++] = n->entry;
    HASH_DEL(t->by_name, n);
    free(n->links);
    free(n);
    t->count--;
    __atomic_store_n(&t->hdr->count, t->count, __ATOMIC_RELAXED);
    __atomic_store_n(&r->names_live, t->count, __ATOMIC_RELAXED);
}

static int check_name(const char *name, char *err, size_t errlen)
{
    if (!name) return vmm__names_say(err, errlen, -EINVAL, "a name is NULL");
    size_t len = strnlen(name, VMM_NAMES_NAME_MAX + 1);
    if (len == 0) return vmm__names_say(err, errlen, -EINVAL, "a name is empty");
    if (len > VMM_NAMES_NAME_MAX)
        return vmm__names_say(err, errlen, -EINVAL, "name \"%.40s...\" is %zu bytes long; at most %u", name, strlen(name),
                   VMM_NAMES_NAME_MAX);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
            return vmm__names_say(err, errlen, -EINVAL, "name \"%.*s\" holds a control character (byte 0x%02x at %zu)", (int)i, name,
                       (unsigned char)name[i], i);
    return 0;
}

/* One tensor of a publish, checked and located, ready to be written. */
typedef struct plan {
    const vmm__name_desc *d;
    vmm_names_entry v;  /* the entry to write */
    uint32_t *slots;    /* the records its bytes lie in */
    uint32_t n_slots;
    nm_name *existing;  /* the name published before, replaced */
    nm_name *fresh;     /* or a new one */
    nm_link *links;
    nm_rec **spare;     /* one per link, for records that have no names yet */
    UT_hash_handle hh;  /* names of this call, to refuse one given twice */
} plan;

/* A shard's place (layout.h SHARDS): each split dimension exists, the coordinate lies in the
 * mesh, and the piece fits in the whole. */
static int check_shard(const vmm__name_shard *sh, vmm_names_entry *v, char *err, size_t errlen)
{
    const char *nm = v->name;
    if (sh->mesh_ndim > VMM_NAMES_MESH_MAX_DIMS)
        return vmm__names_say(err, errlen, -EINVAL, "\"%s\": a mesh of %u dimensions; at most %u", nm, sh->mesh_ndim, VMM_NAMES_MESH_MAX_DIMS);
    for (uint32_t i = 0; i < sh->mesh_ndim; i++) {
        if (sh->kind[i] < VMM_NAMES_PLACE_REPLICATE || sh->kind[i] > VMM_NAMES_PLACE_SHARD)
            return vmm__names_say(err, errlen, -EINVAL, "\"%s\": placement %u of mesh dimension %u is none of replicate, partial, shard", nm,
                       sh->kind[i], i);
        if (sh->mesh[i] == 0 || sh->coord[i] >= sh->mesh[i])
            return vmm__names_say(err, errlen, -EINVAL, "\"%s\": coordinate %u outside mesh dimension %u of extent %u", nm, sh->coord[i], i,
                       sh->mesh[i]);
        if (sh->kind[i] == VMM_NAMES_PLACE_SHARD &&
            (sh->dim[i] >= v->ndim || sh->global_extent[i] < v->shape[sh->dim[i]]))
            return vmm__names_say(err, errlen, -EINVAL, "\"%s\": mesh dimension %u splits dimension %u of %u with a whole extent of %lld", nm, i,
                       sh->dim[i], v->ndim, (long long)sh->global_extent[i]);
        v->place_kind[i] = sh->kind[i];
        v->place_dim[i] = sh->kind[i] == VMM_NAMES_PLACE_SHARD ? sh->dim[i] : 0;
        v->mesh[i] = sh->mesh[i];
        v->coord[i] = sh->coord[i];
        v->global_extent[i] = sh->kind[i] == VMM_NAMES_PLACE_SHARD ? sh->global_extent[i] : 0;
    }
    /* the piece torch.chunk's splits give, nested in mesh order, is the shape published */
    int64_t left[VMM_NAMES_MAX_DIMS], whole[VMM_NAMES_MAX_DIMS];
    bool split[VMM_NAMES_MAX_DIMS] = {false};
    for (uint32_t i = 0; i < sh->mesh_ndim; i++) {
        if (sh->kind[i] != VMM_NAMES_PLACE_SHARD) continue;
        uint32_t d = sh->dim[i];
        if (split[d] && sh->global_extent[i] != whole[d])
            return vmm__names_say(err, errlen, -EINVAL, "\"%s\": two splits of dimension %u disagree on its whole extent", nm, d);
        if (!split[d]) left[d] = whole[d] = sh->global_extent[i], split[d] = true;
        int64_t piece = (left[d] + sh->mesh[i] - 1) / sh->mesh[i], start = (int64_t)sh->coord[i] * piece;
        if (start > left[d]) start = left[d];
        left[d] = (start + piece < left[d] ? start + piece : left[d]) - start;
    }
    for (uint32_t d = 0; d < v->ndim; d++)
        if (split[d] && left[d] != v->shape[d])
            return vmm__names_say(err, errlen, -EINVAL, "\"%s\": its extent %lld along dimension %u is not the %lld its place gives", nm,
                       (long long)v->shape[d], d, (long long)left[d]);
    v->mesh_ndim = sh->mesh_ndim;
    return 0;
}

static int check_desc(plan *p, char *err, size_t errlen)
{
    const vmm__name_desc *d = p->d;
    int rc = check_name(d->name, err, errlen);
    if (rc) return rc;
    const char *nm = d->name;
    uint32_t bits = (uint32_t)d->bits * d->lanes;
    if (d->bits == 0 || d->lanes == 0 || bits % 8)
        return vmm__names_say(err, errlen, -EINVAL, "\"%s\": dtype (code %u, %u bits, %u lanes) is not a whole number of bytes", nm,
                   d->code, d->bits, d->lanes);
    if (d->ndim > VMM_NAMES_MAX_DIMS)
        return vmm__names_say(err, errlen, -EINVAL, "\"%s\": %u dimensions; at most %u", nm, d->ndim, VMM_NAMES_MAX_DIMS);
    if (d->ndim && !d->shape) return vmm__names_say(err, errlen, -EINVAL, "\"%s\": shape is NULL", nm);
    vmm_names_entry *v = &p->v;
    memset(v, 0, sizeof *v);
    uint64_t step = 1;
    bool too_big = false;
    for (uint32_t i = d->ndim; i-- > 0;) {
        if (d->shape[i] < 0) return vmm__names_say(err, errlen, -EINVAL, "\"%s\": negative extent %lld in dimension %u", nm, (long long)d->shape[i], i);
        if (d->strides && d->strides[i] < 0)
            return vmm__names_say(err, errlen, -EINVAL, "\"%s\": negative stride %lld in dimension %u (not supported)", nm,
                       (long long)d->strides[i], i);
        v->shape[i] = d->shape[i];
        v->strides[i] = d->strides ? d->strides[i] : (int64_t)step;
        if (!d->strides && (step > INT64_MAX || __builtin_mul_overflow(step, (uint64_t)(d->shape[i] ? d->shape[i] : 1), &step)))
            too_big = true;
    }
    uint64_t nbytes = vmm__names_span(bits / 8, d->ndim, v->shape, v->strides);
    if (nbytes == 0) return vmm__names_say(err, errlen, -EINVAL, "\"%s\": the tensor has no elements (nothing to share)", nm);
    if (too_big || nbytes > MAX_SPAN || d->address > UINT64_MAX - nbytes)
        return vmm__names_say(err, errlen, -EINVAL, "\"%s\": shape and strides span more than any allocation holds", nm);
    v->address = d->address;
    v->nbytes = nbytes;
    v->dtype_code = d->code;
    v->dtype_bits = d->bits;
    v->dtype_lanes = d->lanes;
    v->ndim = d->ndim;
    v->version = d->version;
    memcpy(v->name, nm, strlen(nm) + 1);
    return d->shard ? check_shard(d->shard, v, err, errlen) : 0;
}

/* The live records of this process under [address, address + nbytes), each exportable. */
static int locate(vmm__reg *r, plan *p, char *err, size_t errlen)
{
    const char *nm = p->d->name;
    uint64_t at = p->v.address, end = p->v.address + p->v.nbytes;
    uint32_t cap = 0;
    while (at < end) {
        vmm_reg_alloc rec;
        uint64_t slot;
        int rc = vmm__reg_find(r, r->pid, at, &rec, &slot);
        if (rc == -ENOENT && at == p->v.address)
            return vmm__names_say(err, errlen, -ENOENT, "\"%s\": 0x%llx is not in the shim's memory of this process (no live allocation holds it)",
                       nm, (unsigned long long)at);
        if (rc == -ENOENT)
            return vmm__names_say(err, errlen, -ENOENT, "\"%s\": its %llu bytes from 0x%llx run past the shim's memory of this process at 0x%llx", nm,
                       (unsigned long long)p->v.nbytes, (unsigned long long)p->v.address, (unsigned long long)at);
        if (rc) return vmm__names_say(err, errlen, rc, "\"%s\": the registry's record at 0x%llx stayed mid-update", nm, (unsigned long long)at);
        if (!(rec.handle_kinds & (VMM_HANDLE_BROKER | VMM_HANDLE_PIDFD)) || (rec.flags & VMM_REG_F_NOT_EXPORTABLE))
            return vmm__names_say(err, errlen, -EACCES,
                       "\"%s\": 0x%llx lies in memory the shim could not make exportable (allocated during a stream capture "
                       "or with the device full), which no companion can open", nm, (unsigned long long)at);
        if (rec.address + rec.extent <= at) return vmm__names_say(err, errlen, -EIO, "\"%s\": the registry's record for 0x%llx does not hold it", nm, (unsigned long long)at);
        if (p->n_slots == cap) {
            cap = cap ? cap * 2 : 1;
            uint32_t *s = realloc(p->slots, cap * sizeof *s);
            if (!s) return vmm__names_say(err, errlen, -ENOMEM, "out of memory");
            p->slots = s;
        }
        if (p->n_slots == 0) {
            memcpy(p->v.alloc_id, rec.alloc_id, sizeof p->v.alloc_id);
            p->v.rec_slot = slot;
        }
        p->slots[p->n_slots++] = (uint32_t)slot;
        at = rec.address + rec.extent;
    }
    return 0;
}

static int prepare_memory(plan *p, char *err, size_t errlen)
{
    p->links = calloc(p->n_slots, sizeof *p->links);
    p->spare = calloc(p->n_slots, sizeof *p->spare);
    if (!p->links || !p->spare) return vmm__names_say(err, errlen, -ENOMEM, "out of memory");
    for (uint32_t i = 0; i < p->n_slots; i++)
        if (!(p->spare[i] = calloc(1, sizeof **p->spare))) return vmm__names_say(err, errlen, -ENOMEM, "out of memory");
    if (!p->existing && !(p->fresh = calloc(1, sizeof *p->fresh))) return vmm__names_say(err, errlen, -ENOMEM, "out of memory");
    return 0;
}

static void plan_free(plan *p)
{
    free(p->slots);
    free(p->links);
    if (p->spare)
        for (uint32_t i = 0; i < p->n_slots; i++) free(p->spare[i]);
    free(p->spare);
    free(p->fresh);
}

/* Write one prepared tensor: from here nothing fails. */
static void commit(struct vmm__names *t, plan *p, uint32_t entry)
{
    nm_name *n = p->existing;
    if (n) {
        unlink_from_recs(t, n);
        free(n->links);
    } else {
        n = p->fresh;
        p->fresh = NULL;
        memcpy(n->key, p->v.name, sizeof n->key);
        n->entry = entry;
        HASH_ADD_STR(t->by_name, key, n);
        t->count++;
    }
    n->links = p->links;
    n->n_links = p->n_slots;
    p->links = NULL;
    for (uint32_t i = 0; i < p->n_slots; i++) {
        nm_rec *rec;
        HASH_FIND(hh, t->by_rec, &p->slots[i], sizeof(uint32_t), rec);
        if (!rec) {
            rec = p->spare[i];
            p->spare[i] = NULL;
            rec->slot = p->slots[i];
            HASH_ADD(hh, t->by_rec, slot, sizeof(uint32_t), rec);
        }
        n->links[i].name = n;
        n->links[i].rec = rec;
        DL_APPEND(rec->head, &n->links[i]);
    }
    vmm_names_entry *e = entry_at(t, n->entry);
    p->v.generation = __atomic_load_n(&e->generation, __ATOMIC_RELAXED) + 1;
    p->v.published_ns = clock_ns(CLOCK_REALTIME);
    entry_write(e, &p->v);
}

int vmm__names_publish(vmm__reg *r, const vmm__name_desc *d, size_t n, char *err, size_t errlen)
{
    if (!r->attached) return vmm__names_say(err, errlen, -EINVAL, "this process is not registered");
    if (n == 0) return 0;
    if (!d) return vmm__names_say(err, errlen, -EINVAL, "the tensors are NULL");
    if (n > VMM__NAMES_CAPACITY) return vmm__names_say(err, errlen, -ENOSPC, "%zu names; a table holds %u", n, VMM__NAMES_CAPACITY);
    plan *ps = calloc(n, sizeof *ps);
    if (!ps) return vmm__names_say(err, errlen, -ENOMEM, "out of memory");
    plan *seen = NULL;
    int rc = 0;
    pthread_mutex_lock(&names_mutex);
    for (size_t i = 0; i < n && !rc; i++) {
        ps[i].d = &d[i];
        if ((rc = check_desc(&ps[i], err, errlen))) break;
        plan *twice;
        HASH_FIND_STR(seen, ps[i].v.name, twice);
        if (twice) {
            rc = vmm__names_say(err, errlen, -EINVAL, "\"%s\" is given twice in one call", ps[i].v.name);
            break;
        }
        HASH_ADD_KEYPTR(hh, seen, ps[i].v.name, strlen(ps[i].v.name), &ps[i]);
        rc = locate(r, &ps[i], err, errlen);
    }
    HASH_CLEAR(hh, seen);
    if (!rc && !r->names) rc = table_make(r, err, errlen);
    struct vmm__names *t = r->names;
    uint64_t fresh = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        HASH_FIND_STR(t->by_name, ps[i].v.name, ps[i].existing);
        fresh += !ps[i].existing;
        rc = prepare_memory(&ps[i], err, errlen);
    }
    /* entries for the new names: freed ones first, then never used ones */
    uint64_t used = t ? __atomic_load_n(&t->hdr->used, __ATOMIC_RELAXED) : 0;
    uint64_t from_free = 0, from_new = 0;
    if (!rc) {
        from_free = fresh < t->n_free ? fresh : t->n_free;
        from_new = fresh - from_free;
        if (used + from_new > VMM__NAMES_CAPACITY)
            rc = vmm__names_say(err, errlen, -ENOSPC, "the name table is full (%u names)", VMM__NAMES_CAPACITY);
    }
    if (!rc && t->cap_free < used + from_new) {
        uint32_t cap = t->cap_free ? t->cap_free : 1024;
        while (cap < used + from_new) cap *= 2;
        uint32_t *f = realloc(t->free_entries, (size_t)cap * sizeof *f);
        if (!f) rc = vmm__names_say(err, errlen, -ENOMEM, "out of memory");
        else t->free_entries = f, t->cap_free = cap;
    }
    if (!rc && (rc = back_entries(t, used + from_new)) != 0)
        vmm__names_say(err, errlen, rc, "cannot back the name table %s: %s", t->path, strerror(-rc));
    if (!rc) {
        changes_step(t);
        uint64_t next = used;
        for (size_t i = 0; i < n; i++) {
            uint32_t entry = 0;
            if (ps[i].existing) {
            } else if (from_free) {
                from_free--;
                entry = t->free_entries[--t->n_free];
            } else {
                entry = (uint32_t)next++;
            }
            commit(t, &ps[i], entry);
        }
        __atomic_store_n(&t->hdr->used, next, __ATOMIC_RELEASE);
        __atomic_store_n(&t->hdr->count, t->count, __ATOMIC_RELAXED);
        __atomic_store_n(&r->names_live, t->count, __ATOMIC_RELAXED);
        changes_step(t);
    }
    pthread_mutex_unlock(&names_mutex);
    for (size_t i = 0; i < n; i++) plan_free(&ps[i]);
    free(ps);
    return rc;
}

int vmm__names_unpublish(vmm__reg *r, const char *name, char *err, size_t errlen)
{
    int rc = check_name(name, err, errlen);
    if (rc) return rc;
    pthread_mutex_lock(&names_mutex);
    struct vmm__names *t = r->names;
    nm_name *n = NULL;
    if (t) HASH_FIND_STR(t->by_name, name, n);
    if (n) {
        changes_step(t);
        drop_name(r, t, n);
        changes_step(t);
    } else {
        rc = vmm__names_say(err, errlen, -ENOENT, "no tensor named \"%s\" is published by this process", name);
    }
    pthread_mutex_unlock(&names_mutex);
    return rc;
}

void vmm__names_drop_slot(vmm__reg *r, uint32_t slot)
{
    pthread_mutex_lock(&names_mutex);
    struct vmm__names *t = r->names;
    nm_rec *rec = NULL;
    if (t) HASH_FIND(hh, t->by_rec, &slot, sizeof slot, rec);
    if (rec) {
        changes_step(t);
        /* drop_name frees the record's list once its last name goes: look it up again each time */
        while (rec) {
            drop_name(r, t, rec->head->name);
            HASH_FIND(hh, t->by_rec, &slot, sizeof slot, rec);
        }
        changes_step(t);
    }
    pthread_mutex_unlock(&names_mutex);
}

int vmm__names_set_job(vmm__reg *r, const char *job, char *err, size_t errlen)
{
    if (!r->attached) return vmm__names_say(err, errlen, -EINVAL, "this process is not registered");
    size_t len = job ? strnlen(job, 24) : 0;
    if (len >= 24) return vmm__names_say(err, errlen, -EINVAL, "a job tag is at most 23 bytes");
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)job[i] < 0x20 || job[i] == 0x7f) return vmm__names_say(err, errlen, -EINVAL, "the job tag holds a control character");
    pthread_mutex_lock(&names_mutex);
    int rc = r->names ? 0 : table_make(r, err, errlen);
    if (!rc) {
        changes_step(r->names);
        memset(r->names->hdr->job, 0, sizeof r->names->hdr->job);
        memcpy(r->names->hdr->job, job ? job : "", len);
        changes_step(r->names);
    }
    pthread_mutex_unlock(&names_mutex);
    return rc;
}

/* Updates begun and not yet ended: weights_seq is odd while there are any.  Its own lock, since
 * update_end runs on the driver's thread, which must not wait for a publish. */
static pthread_mutex_t update_mutex = PTHREAD_MUTEX_INITIALIZER;
static uint64_t updates_open;

int vmm__names_update_begin(vmm__reg *r, char *err, size_t errlen)
{
    if (!r->attached) return vmm__names_say(err, errlen, -EINVAL, "this process is not registered");
    pthread_mutex_lock(&names_mutex);
    int rc = r->names ? 0 : table_make(r, err, errlen);
    vmm_names_header *h = rc ? NULL : r->names->hdr;
    pthread_mutex_unlock(&names_mutex);
    if (!h) return rc;
    pthread_mutex_lock(&update_mutex);
    if (updates_open++ == 0) __atomic_fetch_add(&h->weights_seq, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&update_mutex);
    return 0;
}

void vmm__names_update_end(vmm__reg *r, uint64_t version)
{
    /* the table lives until the process detaches; an end arriving after that finds none */
    vmm_names_header *h = r->names ? r->names->hdr : NULL;
    pthread_mutex_lock(&update_mutex);
    if (h && updates_open && --updates_open == 0) {
        __atomic_store_n(&h->weights_version, version, __ATOMIC_RELAXED);
        __atomic_fetch_add(&h->weights_seq, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&update_mutex);
}

void vmm__names_release(vmm__reg *r, bool unlink_table)
{
    pthread_mutex_lock(&names_mutex);
    struct vmm__names *t = r->names;
    r->names = NULL;
    __atomic_store_n(&r->names_live, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&names_mutex);
    if (!t) return;
    if (unlink_table) shm_unlink(t->path);
    table_free(t);
}

void vmm__names_forget_after_fork(vmm__reg *r)
{
    pthread_mutex_init(&names_mutex, NULL);
    if (r->names) inherited = r->names;
    r->names = NULL;
    r->names_live = 0;
}

void vmm__names_unlink(const vmm__reg *r, uint32_t pid, uint64_t start_time)
{
    char path[sizeof r->name + 48];
    if (pid && start_time && vmm__names_path(r, pid, start_time, path, sizeof path) == 0) shm_unlink(path);
}

/* A name table (or a ".tmp" one its owner died making) whose owner died and is not kept: the
 * header says which pid namespace the owner is in, so one in another is never judged dead. */
static bool table_dead(const vmm__reg *r, const char *name, uint32_t pid, uint64_t start)
{
    int fd = shm_open(name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) return false;
    vmm_names_header h;
    ssize_t got = pread(fd, &h, sizeof h, 0);
    close(fd);
    if (got != (ssize_t)sizeof h || h.magic != VMM_NAMES_MAGIC || h.pid != pid || h.start_time != start) return false;
    /* a dead owner a living keeper keeps still has its names (layout.h KEEP) */
    return vmm__reg_liveness(pid, start, h.pidns) == VMM__DEAD && !vmm__keep_held(r, pid, start);
}

unsigned vmm__names_sweep(const vmm__reg *r) { return vmm__reg_sweep_files(r, "names", true, table_dead); }
