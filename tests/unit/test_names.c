/* Named tensors (layout.h NAMES, vmmshim.h's owner and companion sides).
 *
 * In this process, against a private registry with records of made-up addresses
 * (shim/registry/names.c directly): publish and read back every field; each bad input refused
 * with its reason and nothing changed (a name of 128 bytes, empty, NULL, with a control
 * character; 9 dimensions, a negative stride, no element, a dtype of 4 bits; an address in no
 * record, bytes running past the records, memory not exportable; a name twice in one call);
 * publishing a name again replaces it in place; a name over two records back to back; the
 * registry's remove and retract drop the names in a freed record and only those; a name whose
 * record went while the owner did not drop it (as a crashed owner's) is not given to readers;
 * freed entries are reused; detach removes the table; a fork child keeps none of its parent's
 * names; tables of killed owners go with vmm__names_sweep and gc; the reader refuses bad headers.
 *
 * With processes, through the public API: tests/progs/named natively (VMM_ERR_NO_SHIM from the
 * client library), under the shim with VMMSHIM_ENABLE=0 (VMM_ERR_NO_SHIM from the shim), and under
 * the shim: vmm_publish, vmm_publish_many, vmm_unpublish and their errors as the owner sees them;
 * vmm_foreach_tensor and vmm_find_tensor here, the bytes read through vmm_import_many; names
 * vanishing when their memory is freed; `vmmctl list --names` (table, --json, errors); a SIGKILLed
 * owner's names are not served (VMM_ERR_OWNER_DEAD) and `vmmctl gc` removes its table. */
#include "check.h"
#include "registry/names.h"
#include "registry/registry.h"
#include "spawn.h"
#include "vmmshim.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB (1ull << 20)
#define BASE 0x7e0000000000ull

static char g_build[512], g_preload[700], g_reg[64], g_reg_unit[64];

static bool shm_exists(const char *name)
{
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd >= 0) close(fd);
    return fd >= 0;
}

static void table_name(const vmm__reg *r, uint32_t pid, uint64_t start, char *buf, size_t len)
{
    snprintf(buf, len, VMM_REG_NAMES_NAME, r->name, pid, (unsigned long long)start);
}

/* ---- in this process ---------------------------------------------------------------------- */

typedef struct {
    vmm_names_entry e[512];
    int n;
} seen;

static int collect(void *ctx, const vmm_names_entry *e)
{
    seen *s = ctx;
    if (s->n < 512) s->e[s->n++] = *e;
    return 0;
}

/* The names readers get from r's own table (this process is the owner). */
static int read_names(vmm__reg *r, seen *s)
{
    s->n = 0;
    vmm__names_map m;
    char err[256];
    int rc = vmm__names_open(r, r->pid, r->start_time, &m, err, sizeof err);
    if (rc) return rc;
    rc = vmm__names_for_each(r, &m, collect, s);
    vmm__names_close(&m);
    return rc;
}

static const vmm_names_entry *find_name(const seen *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->e[i].name, name) == 0) return &s->e[i];
    return NULL;
}

static vmm__name_desc desc(const char *name, uint64_t address, uint32_t ndim, const int64_t *shape, const int64_t *strides)
{
    return (vmm__name_desc){.name = name, .address = address, .code = 2, .bits = 32, .lanes = 1, .ndim = ndim,
                            .shape = shape, .strides = strides};
}

static int publish1(vmm__reg *r, vmm__name_desc d, char *err)
{
    return vmm__names_publish(r, &d, 1, err, 256);
}

static uint32_t add_record(vmm__reg *r, uint64_t address, uint64_t extent, uint32_t flags, uint32_t kinds)
{
    vmm_reg_alloc d;
    memset(&d, 0, sizeof d);
    d.requested_size = extent;
    d.handle_kinds = kinds;
    d.flags = flags;
    d.api = VMM_API_TEST;
    uint32_t slot = UINT32_MAX;
    int rc = vmm__reg_add(r, address, extent, &d, &slot, NULL);
    CHECK(rc == 0, "vmm__reg_add: %d", rc);
    return slot;
}

static void test_bad_inputs(vmm__reg *r, uint64_t a)
{
    char err[256], name[200];
    int64_t shape[9] = {4, 4, 4, 4, 4, 4, 4, 4, 4}, neg[2] = {4, -1}, zero[2] = {4, 0};
    memset(name, 'n', 127);
    name[127] = 0;
    CHECK_EQ(publish1(r, desc(name, a, 1, shape, NULL), err), 0);
    name[127] = 'n';
    name[128] = 0;
    CHECK(publish1(r, desc(name, a, 1, shape, NULL), err) == -EINVAL && strstr(err, "128 bytes long; at most 127"),
          "a 128-byte name: %s", err);
    CHECK(publish1(r, desc("", a, 1, shape, NULL), err) == -EINVAL && strstr(err, "empty"), "empty: %s", err);
    CHECK(publish1(r, desc(NULL, a, 1, shape, NULL), err) == -EINVAL && strstr(err, "NULL"), "NULL: %s", err);
    CHECK(publish1(r, desc("a\nb", a, 1, shape, NULL), err) == -EINVAL && strstr(err, "control character"), "newline: %s", err);
    CHECK(publish1(r, desc("nine", a, 9, shape, NULL), err) == -EINVAL && strstr(err, "9 dimensions; at most 8"),
          "9 dims: %s", err);
    CHECK(publish1(r, desc("neg", a, 2, shape, neg), err) == -EINVAL && strstr(err, "negative stride"), "neg: %s", err);
    CHECK(publish1(r, desc("empty", a, 2, zero, NULL), err) == -EINVAL && strstr(err, "no elements"), "empty: %s", err);
    vmm__name_desc d4 = desc("nibble", a, 1, shape, NULL);
    d4.bits = 4;
    CHECK(publish1(r, d4, err) == -EINVAL && strstr(err, "whole number of bytes"), "4 bits: %s", err);
    CHECK(publish1(r, desc("nowhere", 0x1000, 1, shape, NULL), err) == -ENOENT && strstr(err, "not in the shim's memory"),
          "not shim memory: %s", err);
    int64_t big[1] = {(int64_t)(3 * MIB)}; /* 12 MiB of float32 from a 2 MiB record, with a gap after the next */
    CHECK(publish1(r, desc("past", a, 1, big, NULL), err) == -ENOENT && strstr(err, "run past"), "past the end: %s", err);
    vmm__name_desc dup[2] = {desc("twice", a, 1, shape, NULL), desc("twice", a + 64, 1, shape, NULL)};
    CHECK(vmm__names_publish(r, dup, 2, err, sizeof err) == -EINVAL && strstr(err, "given twice"), "dup: %s", err);
    seen s;
    CHECK_EQ(read_names(r, &s), 0);
    memset(name, 'n', 127);
    name[127] = 0;
    CHECK(s.n == 4 && find_name(&s, name), "of all these, only the 127-byte name was published (%d names)", s.n);
    CHECK_EQ(vmm__names_unpublish(r, name, err, sizeof err), 0);
}

static void test_in_process(void)
{
    vmm__reg r;
    char err[256];
    memset(&r, 0, sizeof r);
    int rc = vmm__reg_open(&r, g_reg_unit, VMM__REG_CREATE, 4096, NULL, err, sizeof err);
    CHECK(rc == 0, "open: %s", err);
    if (rc) return;
    CHECK_EQ(vmm__reg_attach(&r, NULL), 0);
    char table[300];
    table_name(&r, r.pid, r.start_time, table, sizeof table);

    /* records: A and B back to back (2 MiB each), C apart, D not exportable */
    uint64_t A = BASE, B = BASE + 2 * MIB, C = BASE + 64 * MIB, D = BASE + 128 * MIB;
    uint32_t sa = add_record(&r, A, 2 * MIB, 0, VMM_HANDLE_BROKER);
    uint32_t sb = add_record(&r, B, 2 * MIB, 0, VMM_HANDLE_BROKER);
    uint32_t sc = add_record(&r, C, 2 * MIB, VMM_REG_F_SHARED_CHUNK, VMM_HANDLE_BROKER);
    add_record(&r, D, 2 * MIB, VMM_REG_F_NOT_EXPORTABLE, 0);
    CHECK(r.names == NULL && r.names_live == 0 && !shm_exists(table), "no table before the first publish");
    int64_t shape[2] = {256, 1024}, strides[2] = {1, 256}, pshape[1] = {4};
    CHECK(publish1(&r, desc("na", D, 1, pshape, NULL), err) == -EACCES && strstr(err, "exportable"), "not exportable: %s", err);

    /* one name, every field */
    CHECK(publish1(&r, desc("w", A + 256, 2, shape, strides), err) == 0, "publish: %s", err);
    CHECK(shm_exists(table) && r.names_live == 1, "the table %s exists, one name", table);
    seen s;
    CHECK_EQ(read_names(&r, &s), 0);
    const vmm_names_entry *w = find_name(&s, "w");
    vmm_reg_alloc rec;
    vmm__reg_read_alloc(&r, sa, &rec);
    CHECK(s.n == 1 && w && w->address == A + 256 && w->nbytes == 4 * (1 + 255 * 1 + 1023 * 256) && w->ndim == 2 &&
              w->shape[0] == 256 && w->shape[1] == 1024 && w->strides[0] == 1 && w->strides[1] == 256 &&
              w->dtype_code == 2 && w->dtype_bits == 32 && w->dtype_lanes == 1 && w->rec_slot == sa &&
              !memcmp(w->alloc_id, rec.alloc_id, 16) && w->published_ns > 0,
          "the entry as published (%d names)", s.n);
    int64_t sshape[1] = {16};
    CHECK(publish1(&r, desc("row", A + 4096, 1, sshape, NULL), err) == 0, "publish: %s", err);
    CHECK_EQ(read_names(&r, &s), 0);
    w = find_name(&s, "row");
    CHECK(w && w->strides[0] == 1 && w->nbytes == 64, "row-major strides filled in");
    CHECK(publish1(&r, desc("scalar", A + 8192, 0, NULL, NULL), err) == 0, "a scalar: %s", err);

    test_bad_inputs(&r, A);
    CHECK_EQ(read_names(&r, &s), 0);
    CHECK(s.n == 3 && find_name(&s, "w") && find_name(&s, "row") && find_name(&s, "scalar"),
          "the failed calls changed nothing (%d names)", s.n);

    /* publishing again replaces, in place */
    int64_t shape2[1] = {8};
    CHECK(publish1(&r, desc("w", C + 64, 1, shape2, NULL), err) == 0, "again: %s", err);
    CHECK_EQ(read_names(&r, &s), 0);
    w = find_name(&s, "w");
    CHECK(s.n == 3 && w && w->address == C + 64 && w->ndim == 1 && w->rec_slot == sc && r.names_live == 3,
          "the name now names the new tensor (%d names)", s.n);

    /* across two records back to back; the retract of the second drops it */
    int64_t span[1] = {(int64_t)(MIB / 4 * 3)}; /* 3 MiB of float32 from 1 MiB into A */
    CHECK(publish1(&r, desc("span", A + MIB, 1, span, NULL), err) == 0, "a name over A and B: %s", err);
    CHECK_EQ(vmm__reg_retract(&r, sb), 0);
    CHECK_EQ(read_names(&r, &s), 0);
    CHECK(s.n == 3 && !find_name(&s, "span") && r.names_live == 3, "retracting B dropped the name over A and B only");
    CHECK_EQ(vmm__reg_unbind(&r, sb), 0);

    /* a batch of 100 over A and C; removing A drops A's names and only those */
    static char names[100][16];
    vmm__name_desc many[100];
    int64_t one[1] = {1};
    for (int i = 0; i < 100; i++) {
        snprintf(names[i], sizeof names[i], "t%d", i);
        many[i] = desc(names[i], (i % 2 ? C : A) + 16384 + (uint64_t)i * 4, 1, one, NULL);
    }
    CHECK(vmm__names_publish(&r, many, 100, err, sizeof err) == 0, "publish_many: %s", err);
    CHECK_EQ(read_names(&r, &s), 0);
    CHECK(s.n == 103 && r.names_live == 103, "103 names (%d)", s.n);
    CHECK_EQ(vmm__reg_remove(&r, sa), 0);
    CHECK_EQ(read_names(&r, &s), 0);
    bool only_c = s.n == 51 && find_name(&s, "w") && find_name(&s, "t1") && !find_name(&s, "t0") &&
                  !find_name(&s, "row") && !find_name(&s, "scalar");
    CHECK(only_c && r.names_live == 51, "freeing A dropped its 52 names, C's 51 stay (%d)", s.n);
    CHECK(vmm__names_unpublish(&r, "t0", err, sizeof err) == -ENOENT && strstr(err, "no tensor named"), "gone: %s", err);
    CHECK_EQ(vmm__names_unpublish(&r, "t1", err, sizeof err), 0);
    CHECK_EQ(read_names(&r, &s), 0);
    CHECK(s.n == 50 && !find_name(&s, "t1"), "unpublished");

    /* entries freed are used again: the table does not grow */
    vmm__names_map m;
    CHECK_EQ(vmm__names_open(&r, r.pid, r.start_time, &m, err, sizeof err), 0);
    uint64_t used_before = m.hdr ? __atomic_load_n(&m.hdr->used, __ATOMIC_ACQUIRE) : 0;
    for (int i = 0; i < 50; i++) many[i] = desc(names[i], C + 65536 + (uint64_t)i * 4, 1, one, NULL);
    CHECK(vmm__names_publish(&r, many, 50, err, sizeof err) == 0, "again: %s", err);
    CHECK(m.hdr && __atomic_load_n(&m.hdr->used, __ATOMIC_ACQUIRE) == used_before, "freed entries reused (used %llu)",
          (unsigned long long)(m.hdr ? m.hdr->used : 0));
    CHECK(m.hdr && m.hdr->count == r.names_live && m.hdr->pid == r.pid && !(m.hdr->changes & 1), "header counts");
    vmm__names_close(&m);

    /* a name whose record went without the owner dropping it (as a crashed owner leaves it, or
     * a publish racing a free) is not given to readers */
    uint64_t E = BASE + 256 * MIB;
    uint32_t se = add_record(&r, E, 2 * MIB, 0, VMM_HANDLE_BROKER);
    CHECK(publish1(&r, desc("orphan", E, 1, one, NULL), err) == 0, "publish: %s", err);
    uint64_t live = r.names_live;
    r.names_live = 0; /* the remove skips the names */
    CHECK_EQ(vmm__reg_remove(&r, se), 0);
    r.names_live = live;
    CHECK_EQ(read_names(&r, &s), 0);
    CHECK(!find_name(&s, "orphan") && s.n == (int)live - 1, "the orphan is not served (%d of %llu)", s.n,
          (unsigned long long)live);
    uint32_t se2 = add_record(&r, E, 2 * MIB, 0, VMM_HANDLE_BROKER); /* the same place, another allocation */
    CHECK_EQ(read_names(&r, &s), 0);
    CHECK(!find_name(&s, "orphan"), "nor once another allocation holds its address (alloc_id differs)");
    CHECK_EQ(vmm__names_unpublish(&r, "orphan", err, sizeof err), 0);
    (void)se2;

    /* a fork child keeps none of its parent's names, and its attach leaves the parent's table */
    pid_t kid = fork();
    if (kid == 0) {
        vmm__reg_forget_after_fork(&r);
        int ok = r.names == NULL && r.names_live == 0 && vmm__reg_attach(&r, NULL) == 0 && shm_exists(table);
        int64_t o[1] = {1};
        vmm__name_desc d = desc("kid", C, 1, o, NULL);
        ok = ok && vmm__names_publish(&r, &d, 1, err, sizeof err) == -ENOENT; /* C is the parent's */
        vmm__reg_detach(&r);
        _exit(ok ? 0 : 1);
    }
    int st = -1;
    waitpid(kid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fork child: status 0x%x", st);
    CHECK(shm_exists(table), "the parent's table stays after the child exits");
    CHECK_EQ(read_names(&r, &s), 0);
    CHECK(s.n == 76, "and its names (%d: C's 50 and 26 new of the 50 published again)", s.n);

    /* the reader refuses what is not a table of this owner */
    static uint8_t fake[4096 + 384 * 4];
    vmm_names_header *fh = (vmm_names_header *)fake;
    *fh = (vmm_names_header){.magic = VMM_NAMES_MAGIC, .version = 1, .compat_version = 1, .header_size = 4096,
                             .entry_size = sizeof(vmm_names_entry), .capacity = 4, .ready = 1, .pid = 7, .start_time = 9};
    CHECK_EQ(vmm__names_validate(fake, sizeof fake, 7, 9, err, sizeof err), 0);
    CHECK(vmm__names_validate(fake, sizeof fake, 8, 9, err, sizeof err) == -EPROTO && strstr(err, "not of pid 8"), "%s", err);
    CHECK(vmm__names_validate(fake, sizeof fake - 1, 7, 9, err, sizeof err) == -EPROTO, "truncated: %s", err);
    fh->used = 5;
    CHECK(vmm__names_validate(fake, sizeof fake, 7, 9, err, sizeof err) == -EPROTO, "used > capacity: %s", err);
    fh->used = 0;
    fh->compat_version = VMM_NAMES_VERSION + 1;
    CHECK(vmm__names_validate(fake, sizeof fake, 7, 9, err, sizeof err) == -ENOTSUP, "newer: %s", err);
    fh->compat_version = 1;
    fh->ready = 0;
    CHECK_EQ(vmm__names_validate(fake, sizeof fake, 7, 9, err, sizeof err), -EAGAIN);
    fh->ready = 1;
    fh->magic ^= 1;
    CHECK_EQ(vmm__names_validate(fake, sizeof fake, 7, 9, err, sizeof err), -EPROTO);

    /* detach removes the table */
    vmm__reg_detach(&r);
    CHECK(!shm_exists(table) && r.names == NULL, "detach removed %s", table);

    /* killed owners: their tables go with the sweep, and with gc */
    for (int round = 0; round < 2; round++) {
        int p[2];
        if (pipe(p)) break;
        pid_t owner = fork();
        if (owner == 0) {
            vmm__reg o;
            char e2[256];
            memset(&o, 0, sizeof o);
            int ok = vmm__reg_open(&o, g_reg_unit, VMM__REG_WRITE, 0, NULL, e2, sizeof e2) == 0 && vmm__reg_attach(&o, NULL) == 0;
            if (ok) add_record(&o, BASE + 512 * MIB, 2 * MIB, 0, VMM_HANDLE_BROKER);
            int64_t o1[1] = {1};
            vmm__name_desc d = desc("dead", BASE + 512 * MIB, 1, o1, NULL);
            ok = ok && vmm__names_publish(&o, &d, 1, e2, sizeof e2) == 0;
            char c = ok ? 'y' : 'n';
            if (write(p[1], &c, 1) != 1) _exit(2);
            pause();
            _exit(0);
        }
        close(p[1]);
        char c = 0;
        CHECK(read(p[0], &c, 1) == 1 && c == 'y', "the owner published");
        close(p[0]);
        uint64_t start = 0;
        vmm__proc_identity((uint32_t)owner, &start, NULL);
        char dead[300];
        table_name(&r, (uint32_t)owner, start, dead, sizeof dead);
        CHECK(shm_exists(dead), "%s exists", dead);
        kill(owner, SIGKILL);
        waitpid(owner, NULL, 0);
        CHECK(shm_exists(dead), "a killed owner leaves its table");
        vmm__reg_gc_stats gs;
        if (round == 0) {
            CHECK_EQ(vmm__names_sweep(&r), 1);
        } else {
            vmm__reg g;
            memset(&g, 0, sizeof g);
            CHECK_EQ(vmm__reg_open(&g, g_reg_unit, VMM__REG_WRITE, 0, NULL, err, sizeof err), 0);
            CHECK_EQ(vmm__reg_gc(&g, &gs), 0);
            vmm__reg_close(&g);
        }
        CHECK(!shm_exists(dead), "%s removed by %s", dead, round ? "gc" : "the sweep");
    }
    vmm__reg_close(&r);
    shm_unlink(g_reg_unit);
}

/* ---- threads: publishes, unpublishes and frees at once, a reader walking meanwhile ---------- */

#define THREADS 4
#define ROUNDS 150

typedef struct {
    vmm__reg *r;
    int t;
    int bad;
    int *stop;
} worker;

static void *publisher(void *arg)
{
    worker *w = arg;
    char err[256], names[8][32];
    int64_t one[1] = {64};
    for (int i = 0; i < ROUNDS && !w->bad; i++) {
        uint64_t at = BASE + (uint64_t)(1024 + w->t * 64 + i % 64) * 2 * MIB;
        vmm_reg_alloc d;
        memset(&d, 0, sizeof d);
        d.handle_kinds = VMM_HANDLE_BROKER;
        uint32_t slot;
        if (vmm__reg_add(w->r, at, 2 * MIB, &d, &slot, NULL) != 0) {
            w->bad = 1;
            break;
        }
        vmm__name_desc ds[8];
        for (int k = 0; k < 8; k++) {
            snprintf(names[k], sizeof names[k], "t%d.%d", w->t, k);
            ds[k] = desc(names[k], at + (uint64_t)k * 256, 1, one, NULL);
        }
        if (vmm__names_publish(w->r, ds, 8, err, sizeof err) != 0) w->bad = 2;
        if (i % 3 == 0 && vmm__names_unpublish(w->r, names[i % 8], err, sizeof err) != 0) w->bad = 3;
        if (i % 2 ? vmm__reg_remove(w->r, slot) != 0 : vmm__reg_retract(w->r, slot) != 0 || vmm__reg_unbind(w->r, slot) != 0)
            w->bad = 4;
        /* the names of this thread went with the record */
        if (i % 3 != 0 && vmm__names_unpublish(w->r, names[0], err, sizeof err) != -ENOENT) w->bad = 5;
    }
    return NULL;
}

typedef struct {
    vmm__reg *r;
    int *stop;
    int bad;
    unsigned walks;
    char err[256];
} reader_ctx;

static int check_held(void *ctx, const vmm_names_entry *e)
{
    reader_ctx *c = ctx;
    vmm_reg_alloc rec;
    /* given only while its record held it (the walk checked); the record may go right after */
    if (e->rec_slot >= c->r->hdr->capacity || vmm__reg_read_alloc(c->r, e->rec_slot, &rec) != 0) c->bad = 1;
    if (e->name[0] != 't' || e->ndim != 1 || e->nbytes != 256) c->bad = 2;
    return 0;
}

static void *walker(void *arg)
{
    reader_ctx *c = arg;
    while ((!__atomic_load_n(c->stop, __ATOMIC_ACQUIRE) || c->walks < 3) && !c->bad) {
        vmm__names_map m;
        int rc = vmm__names_open(c->r, c->r->pid, c->r->start_time, &m, c->err, sizeof c->err);
        if (rc == -ENOENT) continue; /* before the first publish; a table half made is never found */
        if (rc) {
            c->bad = 3;
            break;
        }
        if (vmm__names_for_each(c->r, &m, check_held, c) != 0) c->bad = 4;
        vmm__names_close(&m);
        c->walks++;
    }
    return NULL;
}

static void test_threads(void)
{
    vmm__reg r;
    char err[256], name[80];
    memset(&r, 0, sizeof r);
    snprintf(name, sizeof name, "%s-threads", g_reg_unit);
    if (vmm__reg_open(&r, name, VMM__REG_CREATE, 4096, NULL, err, sizeof err) != 0 || vmm__reg_attach(&r, NULL) != 0) {
        CHECK(0, "open: %s", err);
        return;
    }
    int stop = 0;
    pthread_t th[THREADS], rd;
    worker w[THREADS];
    reader_ctx rc = {.r = &r, .stop = &stop};
    pthread_create(&rd, NULL, walker, &rc);
    for (int t = 0; t < THREADS; t++) {
        w[t] = (worker){.r = &r, .t = t, .stop = &stop};
        pthread_create(&th[t], NULL, publisher, &w[t]);
    }
    for (int t = 0; t < THREADS; t++) {
        pthread_join(th[t], NULL);
        CHECK(w[t].bad == 0, "thread %d failed at step %d", t, w[t].bad);
    }
    __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
    pthread_join(rd, NULL);
    CHECK(rc.bad == 0 && rc.walks > 0, "the reader: %d after %u walks (%s)", rc.bad, rc.walks, rc.err);
    seen s;
    CHECK(read_names(&r, &s) == 0 && s.n == 0 && r.names_live == 0, "every name went with its record (%d left)", s.n);
    printf("stat: %d threads x %d rounds of 8 names, a reader walking %u times meanwhile\n", THREADS, ROUNDS, rc.walks);
    vmm__reg_close(&r);
    shm_unlink(name);
}

/* ---- processes ---------------------------------------------------------------------------- */

static FILE *g_to, *g_from;
static pid_t g_pid;

static bool named_start(bool preload, const char *extra_env)
{
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC)) return false;
    char prog[600];
    snprintf(prog, sizeof prog, "%s/progs/named", g_build);
    g_pid = fork();
    if (g_pid < 0) return false;
    if (g_pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        if (preload) putenv(g_preload);
        if (extra_env) putenv((char *)extra_env);
        alarm(300);
        char *argv[] = {prog, NULL};
        execv(prog, argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    g_to = fdopen(in[1], "w");
    g_from = fdopen(out[0], "r");
    return g_to && g_from;
}

static void named_stop(void)
{
    if (g_to) {
        fputs("q\n", g_to);
        fclose(g_to);
    }
    if (g_from) fclose(g_from);
    g_to = g_from = NULL;
    if (g_pid > 0) waitpid(g_pid, NULL, 0);
    g_pid = 0;
}

/* One command and its answer (without the newline); true when it is "ok". */
__attribute__((format(printf, 2, 3))) static bool cmd(char *answer, const char *fmt, ...)
{
    static char sink[1024];
    char *a = answer ? answer : sink;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(g_to, fmt, ap);
    va_end(ap);
    fputc('\n', g_to);
    fflush(g_to);
    a[0] = 0;
    if (!fgets(a, 1024, g_from)) return false;
    a[strcspn(a, "\n")] = 0;
    return strncmp(a, "ok", 2) == 0;
}

typedef struct {
    vmm_tensor_info t[128];
    int n;
} tensors;

static int collect_tensor(void *ctx, const vmm_tensor_info *t)
{
    tensors *s = ctx;
    if (s->n < 128) s->t[s->n++] = *t;
    return 0;
}

static const vmm_tensor_info *tensor_named(const tensors *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->t[i].name, name) == 0) return &s->t[i];
    return NULL;
}

static vmm_status list(vmm_registry *reg, tensors *s)
{
    s->n = 0;
    return vmm_foreach_tensor(reg, (uint32_t)g_pid, collect_tensor, s);
}

static inline uint64_t word(uint64_t seed, uint64_t k) { return seed * 0x9e3779b97f4a7c15ull + k; }

static int vmmctl(char *out, size_t outlen, const char *a1, const char *a2, const char *a3, const char *a4)
{
    char prog[600], err[2048];
    snprintf(prog, sizeof prog, "%s/vmmctl", g_build);
    char *argv[] = {prog, (char *)a1, (char *)a2, (char *)a3, (char *)a4, NULL};
    int rc = spawn_capture(argv, NULL, out, outlen, err, sizeof err, 60);
    if (rc != 0 && outlen > strlen(out) + strlen(err) + 1) strcat(out, err);
    return rc;
}

static void test_not_under_shim(void)
{
    char a[1024];
    /* natively: the client library's vmm_publish */
    CHECK(named_start(false, NULL), "start");
    CHECK(cmd(a, "a 1048576"), "alloc: %s", a);
    CHECK(!cmd(a, "p w 0 0 f32 16") && strstr(a, "error 12 ") && strstr(a, "not running under the shim"), "natively: %s", a);
    CHECK(!cmd(a, "u w") && strstr(a, "error 12 "), "unpublish natively: %s", a);
    named_stop();
    /* the shim preloaded but off: the shim's */
    CHECK(named_start(true, "VMMSHIM_ENABLE=0"), "start");
    CHECK(cmd(a, "a 1048576"), "alloc: %s", a);
    CHECK(!cmd(a, "p w 0 0 f32 16") && strstr(a, "error 12 ") && strstr(a, "the shim is not active"), "disabled: %s", a);
    named_stop();
    /* in this process (linked with the client library) */
    int64_t shape[1] = {4};
    CHECK_EQ(vmm_publish("x", 0x1000, (vmm_dtype){2, 32, 1}, 1, shape, NULL), VMM_ERR_NO_SHIM);
    CHECK(strstr(vmm_publish_error(), "vmm_publish: not running under the shim"), "%s", vmm_publish_error());
    CHECK_EQ(vmm_publish_many(NULL, 0), VMM_ERR_NO_SHIM);
    CHECK_EQ(vmm_unpublish("x"), VMM_ERR_NO_SHIM);
    CHECK(strcmp(vmm_strerror(VMM_ERR_NO_SHIM), "unknown status") != 0, "a status text: %s", vmm_strerror(VMM_ERR_NO_SHIM));
}

static void test_under_shim(void)
{
    char a[1024];
    vmm_registry *reg = NULL;
    CHECK(named_start(true, NULL), "start");
    unsigned long long b0 = 0, b1 = 0;
    int i0 = -1, i1 = -1;
    CHECK(cmd(a, "a 4194304") && sscanf(a, "ok %d 0x%llx", &i0, &b0) == 2, "alloc: %s", a);
    CHECK(cmd(a, "a 2097152") && sscanf(a, "ok %d 0x%llx", &i1, &b1) == 2, "alloc: %s", a);
    CHECK(cmd(a, "w 0 5") && cmd(a, "w 1 6"), "fill: %s", a);
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg) return;
    tensors s;
    CHECK(list(reg, &s) == VMM_OK && s.n == 0, "no names yet: %s", vmm_last_error());

    CHECK(cmd(a, "p model.w 0 0 f32 256x1024"), "publish: %s", a);
    CHECK(cmd(a, "p model.b 0 1048576 bf16 64x32 1x64"), "publish: %s", a);
    CHECK(cmd(a, "p step 1 0 i64 -"), "publish: %s", a);
    CHECK_EQ(list(reg, &s), VMM_OK);
    const vmm_tensor_info *w = tensor_named(&s, "model.w"), *bt = tensor_named(&s, "model.b"), *st = tensor_named(&s, "step");
    vmm_alloc_info al;
    CHECK_EQ(vmm_find(reg, (uint32_t)g_pid, b0, &al), VMM_OK);
    CHECK(s.n == 3 && w && w->address == b0 && w->nbytes == 1 * MIB && w->dtype.code == VMM_DTYPE_FLOAT && w->dtype.bits == 32 &&
              w->ndim == 2 && w->shape[0] == 256 && w->shape[1] == 1024 && w->strides[0] == 1024 && w->strides[1] == 1 &&
              w->pid == (uint32_t)g_pid && !memcmp(w->alloc_id, al.alloc_id, 16),
          "model.w as published (%d names)", s.n);
    CHECK(bt && bt->address == b0 + MIB && bt->dtype.code == VMM_DTYPE_BFLOAT && bt->strides[1] == 64 &&
              bt->nbytes == 2 * (1 + 63 + 31 * 64),
          "model.b");
    CHECK(st && st->ndim == 0 && st->nbytes == 8 && st->address == b1, "the scalar");
    vmm_tensor_info one, arr[3];
    size_t n_list = 99;
    CHECK(vmm_list_tensors(reg, (uint32_t)g_pid, arr, 3, &n_list) == VMM_OK && n_list == 3 && w &&
              !memcmp(&arr[0], &s.t[0], sizeof arr) && !memcmp(&arr[2], &s.t[2], sizeof arr[2]),
          "vmm_list_tensors: the three names as vmm_foreach_tensor gives them (%zu)", n_list);
    memset(arr, 0, sizeof arr);
    CHECK(vmm_list_tensors(reg, (uint32_t)g_pid, arr, 1, &n_list) == VMM_OK && n_list == 3 &&
              !memcmp(&arr[0], &s.t[0], sizeof arr[0]) && arr[1].name[0] == 0,
          "vmm_list_tensors with room for one: the first, and 3 for the count (%zu)", n_list);
    CHECK(vmm_list_tensors(reg, (uint32_t)g_pid, NULL, 0, &n_list) == VMM_OK && n_list == 3, "vmm_list_tensors: a count only");
    CHECK(vmm_list_tensors(reg, (uint32_t)g_pid, NULL, 2, &n_list) == VMM_ERR_INVALID && n_list == 0,
          "vmm_list_tensors: out NULL with room asked for");
    CHECK(vmm_list_tensors(reg, 0x7ffffff0u, arr, 3, &n_list) == VMM_ERR_NOT_FOUND && n_list == 0,
          "vmm_list_tensors of a pid not under the shim: %s", vmm_last_error());
    CHECK(vmm_find_tensor(reg, (uint32_t)g_pid, "model.b", &one) == VMM_OK && one.address == b0 + MIB, "vmm_find_tensor");
    CHECK(vmm_find_tensor(reg, (uint32_t)g_pid, "nope", &one) == VMM_ERR_NOT_FOUND && strstr(vmm_last_error(), "no tensor named"),
          "%s", vmm_last_error());

    /* the bytes, through the names, with one vmm_import_many */
    if (w && bt && st) {
        uint64_t addrs[3] = {w->address, bt->address, st->address}, sizes[3] = {w->nbytes, bt->nbytes, st->nbytes};
        vmm_imported *out[3] = {0};
        vmm_status ist = vmm_import_many(reg, (uint32_t)g_pid, addrs, sizes, 3, out);
        CHECK(ist == VMM_OK, "vmm_import_many: %s", vmm_last_error());
        if (ist == VMM_OK) {
            const volatile uint64_t *p0 = (const volatile uint64_t *)(uintptr_t)vmm_import_ptr(out[0]);
            const volatile uint64_t *p1 = (const volatile uint64_t *)(uintptr_t)vmm_import_ptr(out[1]);
            const volatile uint64_t *p2 = (const volatile uint64_t *)(uintptr_t)vmm_import_ptr(out[2]);
            CHECK(p0[0] == word(5, 0) && p0[MIB / 8 - 1] == word(5, MIB / 8 - 1) && p1[0] == word(5, MIB / 8) &&
                      p2[0] == word(6, 0),
                  "the named bytes are the owner's");
            for (int i = 0; i < 3; i++) vmm_import_release(out[i]);
        }
    }

    /* the same names listed and imported in one call (the records taken from the table) */
    vmm_tensor_info tb[8];
    vmm_import_desc db[8];
    vmm_import_job *job = (vmm_import_job *)1;
    size_t nb = 99;
    CHECK(vmm_import_tensors_begin(reg, (uint32_t)g_pid, tb, 1, &nb, db, &job) == VMM_OK && nb == 3 && job == NULL,
          "vmm_import_tensors_begin with room for one: the count, no job (%zu)", nb);
    CHECK(vmm_import_tensors_begin(reg, 0x7ffffff0u, tb, 8, &nb, db, &job) == VMM_ERR_NOT_FOUND && nb == 0 && job == NULL,
          "vmm_import_tensors_begin of a pid not under the shim: %s", vmm_last_error());
    CHECK(vmm_import_tensors_begin(reg, (uint32_t)g_pid, tb, 8, &nb, NULL, &job) == VMM_ERR_INVALID && job == NULL,
          "vmm_import_tensors_begin: desc NULL with room asked for");
    CHECK(vmm_import_tensors_begin(reg, (uint32_t)g_pid, tb, 8, &nb, db, &job) == VMM_OK && nb == 3 && job &&
              !memcmp(tb, s.t, 3 * sizeof tb[0]),
          "vmm_import_tensors_begin: the three names as vmm_foreach_tensor gives them, and a job: %s", vmm_last_error());
    if (job) {
        vmm_imported *ib[3] = {0};
        vmm_import_desc ended[3];
        CHECK(vmm_import_many_end(job, ib) == VMM_OK && vmm_import_describe(ib, 3, ended) == VMM_OK &&
                  !memcmp(ended, db, sizeof ended),
              "its end: imports where begin said (%s)", vmm_last_error());
        bool right = ib[0] && ib[1] && ib[2];
        for (int i = 0; right && i < 3; i++) {
            const volatile uint64_t *p = (const volatile uint64_t *)(uintptr_t)vmm_import_ptr(ib[i]);
            uint64_t first = tb[i].address == b0 ? word(5, 0) : tb[i].address == b0 + MIB ? word(5, MIB / 8) : word(6, 0);
            right = db[i].size == tb[i].nbytes && p[0] == first;
        }
        CHECK(right, "each name's bytes are the owner's");
        for (int i = 0; i < 3; i++) vmm_import_release(ib[i]);
    }

    /* bad input, as the owner sees it */
    char longname[200];
    memset(longname, 'L', 128);
    longname[128] = 0;
    CHECK(!cmd(a, "p %s 0 0 f32 4", longname) && strstr(a, "error 1 ") && strstr(a, "at most 127"), "too long: %s", a);
    CHECK(!cmd(a, "x host 0x1000 16") && strstr(a, "error 2 ") && strstr(a, "not in the shim's memory"), "not shim memory: %s", a);
    CHECK(!cmd(a, "p past 1 0 f32 1048576") && strstr(a, "error 2 ") && strstr(a, "run past"), "past the end: %s", a);
    CHECK(!cmd(a, "m dup 4 1 64 dup") && strstr(a, "error 1 ") && strstr(a, "given twice"), "twice in one call: %s", a);
    CHECK(!cmd(a, "u nope") && strstr(a, "error 2 ") && strstr(a, "no tensor named"), "unpublish unknown: %s", a);
    CHECK_EQ(list(reg, &s), VMM_OK);
    CHECK(s.n == 3, "failed calls published nothing (%d names)", s.n);

    /* published twice: replaced */
    CHECK(cmd(a, "p model.w 0 2097152 f16 8"), "again: %s", a);
    CHECK_EQ(list(reg, &s), VMM_OK);
    w = tensor_named(&s, "model.w");
    CHECK(s.n == 3 && w && w->address == b0 + 2 * MIB && w->dtype.bits == 16 && w->ndim == 1, "model.w replaced");

    /* publish_many of 40, then vmmctl list --names */
    CHECK(cmd(a, "m layer. 40 1 4096"), "publish_many: %s", a);
    CHECK_EQ(list(reg, &s), VMM_OK);
    CHECK(s.n == 43 && tensor_named(&s, "layer.0") && tensor_named(&s, "layer.39"), "43 names (%d)", s.n);
    static char out[1 << 16];
    char pid[16];
    snprintf(pid, sizeof pid, "%d", (int)g_pid);
    int rc = vmmctl(out, sizeof out, "list", "--names", NULL, NULL);
    char row[200];
    snprintf(row, sizeof row, "%7d %-40s %-14s %-24s 0x%012llx", (int)g_pid, "model.b", "bfloat16", "64x32 (strides 1x64)",
             b0 + MIB);
    CHECK(rc == 0 && strstr(out, row) && strstr(out, "layer.39") && strstr(out, "43 names in 1 process"),
          "vmmctl list --names (rc %d):\n%s\nwanted the row: %s", rc, out, row);
    rc = vmmctl(out, sizeof out, "list", "--names", "--json", NULL);
    CHECK(rc == 0 && strstr(out, "\"name\": \"step\", \"dtype\": \"int64\"") && strstr(out, "\"shape\": [64, 32], \"strides\": [1, 64]"),
          "--json (rc %d):\n%.2000s", rc, out);
    rc = vmmctl(out, sizeof out, "list", "--names", "--pid", "1");
    CHECK(rc == 1 && strstr(out, "pid 1 has no record"), "--pid 1 (rc %d): %s", rc, out);
    rc = vmmctl(out, sizeof out, "list", "--names", "--all", NULL);
    CHECK(rc == 2 && strstr(out, "drop --all"), "--all (rc %d): %s", rc, out);

    /* frees: the names in buffer 1 go, buffer 0's stay */
    CHECK(cmd(a, "f 1"), "free: %s", a);
    CHECK_EQ(list(reg, &s), VMM_OK);
    CHECK(s.n == 2 && tensor_named(&s, "model.w") && tensor_named(&s, "model.b"), "freeing buffer 1 dropped its 41 names (%d left)", s.n);
    CHECK(vmm_find_tensor(reg, (uint32_t)g_pid, "step", &one) == VMM_ERR_NOT_FOUND, "step is gone");
    CHECK(cmd(a, "u model.b"), "unpublish: %s", a);
    CHECK_EQ(list(reg, &s), VMM_OK);
    CHECK(s.n == 1 && tensor_named(&s, "model.w"), "unpublished (%d left)", s.n);
    rc = vmmctl(out, sizeof out, "list", "--names", "--pid", pid);
    CHECK(rc == 0 && strstr(out, "model.w") && !strstr(out, "model.b") && strstr(out, "1 name in 1 process"), "after: %s", out);

    /* killed: its names are not served, and gc removes its table */
    vmm_proc_info pi;
    CHECK_EQ(vmm_find_proc(reg, (uint32_t)g_pid, &pi), VMM_OK);
    char table[300];
    snprintf(table, sizeof table, VMM_REG_NAMES_NAME, g_reg, (unsigned)g_pid, (unsigned long long)pi.start_time);
    CHECK(shm_exists(table), "%s exists", table);
    kill(g_pid, SIGKILL);
    pid_t dead = g_pid;
    named_stop();
    g_pid = dead;
    CHECK(list(reg, &s) == VMM_ERR_OWNER_DEAD && strstr(vmm_last_error(), "has exited"), "dead: %s", vmm_last_error());
    rc = vmmctl(out, sizeof out, "list", "--names", NULL, NULL);
    CHECK(rc == 0 && strstr(out, "0 names in 0 processes"), "a dead owner's names are not listed: %s", out);
    CHECK(shm_exists(table), "its table stays until gc");
    rc = vmmctl(out, sizeof out, "gc", NULL, NULL, NULL);
    CHECK(rc == 0 && !shm_exists(table), "vmmctl gc removed %s (rc %d: %s)", table, rc, out);
    g_pid = getpid();
    CHECK(list(reg, &s) == VMM_ERR_NOT_FOUND && strstr(vmm_last_error(), "does not run under the shim"),
          "a process not under the shim: %s", vmm_last_error());
    g_pid = 0;
    vmm_close(reg);
}

static void cleanup(void)
{
    shm_unlink(g_reg);
    shm_unlink(g_reg_unit);
}

int main(void)
{
    const char *b = getenv("VMMSHIM_TEST_BUILD");
    snprintf(g_build, sizeof g_build, "%s", b ? b : "build");
    char shim[600];
    snprintf(shim, sizeof shim, "%s/libvmmshim.so", g_build);
    spawn_preload(g_preload, sizeof g_preload, shim);
    snprintf(g_reg, sizeof g_reg, "/vmmshim-names-%d", (int)getpid());
    snprintf(g_reg_unit, sizeof g_reg_unit, "/vmmshim-names-u-%d", (int)getpid());
    setenv("VMMSHIM_REGISTRY", g_reg, 1);
    signal(SIGPIPE, SIG_IGN);
    alarm(240);

    test_in_process();
    test_threads();
    test_not_under_shim();
    test_under_shim();
    cleanup();
    CHECK_DONE();
}
