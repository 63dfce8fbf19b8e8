/* Writes the fuzz targets' seed inputs (tests/fuzz/corpus/<target>/) from the real code: a
 * registry and a name table made by the shim's own writer, handles from the shim's encoder, requests in the
 * broker's wire format, the sample config the options table generates.  Run once by
 * `make fuzz-seeds`; the seeds are committed, so `make fuzz` and `make check` never run it.
 *
 *   gen_seeds CORPUS_DIR */
#include "backing/ipc.h"
#include "broker/protocol.h"
#include "core/options.h"
#include "registry/names.h"
#include "registry/registry.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *g_root;

static void put(const char *target, const char *name, const void *bytes, size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_root, target);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        perror(path);
        exit(1);
    }
    snprintf(path, sizeof path, "%s/%s/%s", g_root, target, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, len, f) != len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* A growable byte buffer for building inputs. */
typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf;

static void add(buf *b, const void *bytes, size_t len)
{
    if (b->n + len > b->cap) {
        b->cap = (b->n + len) * 2;
        if (!(b->p = realloc(b->p, b->cap))) exit(1);
    }
    memcpy(b->p + b->n, bytes, len);
    b->n += len;
}

static void add_u8(buf *b, uint8_t v) { add(b, &v, 1); }
static void add_u16(buf *b, uint16_t v) { add(b, &v, 2); }
static void add_u32(buf *b, uint32_t v) { add(b, &v, 4); }
static void add_u64(buf *b, uint64_t v) { add(b, &v, 8); }

/* ---- registry: the segment as fuzz_registry.c reads it (size, lookup, sparse patches) ---- */

#define GAP 32 /* zero bytes that end a patch: fewer are cheaper to keep inside it */

static void put_registry(const char *name, const vmm__reg *r, uint32_t pid, uint64_t address)
{
    size_t size = r->map_size;
    uint8_t *img = malloc(size);
    if (!img || pread(r->fd, img, size, 0) != (ssize_t)size) exit(1);
    buf b = {0};
    add_u32(&b, (uint32_t)size);
    add_u32(&b, pid);
    add_u64(&b, address);
    for (size_t at = 0; at < size;) {
        if (!img[at]) {
            at++;
            continue;
        }
        size_t end = at, zeros = 0;
        while (end < size && end - at < 0xffff && zeros < GAP) zeros = img[end++] ? 0 : zeros + 1;
        end -= zeros;
        add_u32(&b, (uint32_t)at);
        add_u16(&b, (uint16_t)(end - at));
        add(&b, img + at, end - at);
        at = end;
    }
    put("registry", name, b.p, b.n);
    free(b.p);
    free(img);
}

static uint32_t add_alloc(vmm__reg *r, uint64_t address, uint64_t extent, uint64_t requested, uint32_t api,
                          uint64_t chunk_id, uint64_t chunk_offset, uint64_t mapped, uint32_t flags, const char *tag)
{
    vmm_reg_alloc d;
    memset(&d, 0, sizeof d);
    d.api = api;
    d.requested_size = requested;
    d.mapped_size = mapped;
    d.chunk_id = chunk_id;
    d.chunk_offset = chunk_offset;
    d.flags = flags;
    d.handle_kinds = flags & VMM_REG_F_NOT_EXPORTABLE ? 0 : VMM_HANDLE_BROKER;
    d.n_frames = 2;
    d.frames[0] = 0x401000;
    d.frames[1] = 0x402000;
    snprintf(d.tag, sizeof d.tag, "%s", tag);
    uint32_t slot;
    vmm_reg_alloc pub;
    if (vmm__reg_add(r, address, extent, &d, &slot, &pub) != 0) exit(1);
    return slot;
}

static void registry_seeds(void)
{
    char name[64], err[256];
    snprintf(name, sizeof name, "/vmmshim-seed-%d", (int)getpid());
    vmm__reg r;
    memset(&r, 0, sizeof r);
    /* the smallest capacity keeps the seeds small; the layout is the real writer's */
    if (vmm__reg_open(&r, name, VMM__REG_CREATE, 64, NULL, err, sizeof err) != 0 ||
        vmm__reg_attach(&r, "/run/user/1000/vmmshim/4242.sock") != 0) {
        fprintf(stderr, "gen_seeds: %s\n", err);
        exit(1);
    }
    const uint64_t small = 0x7f0000000000ull, big = 0x7f0100000000ull, mapped = 0x7f0200000000ull;
    add_alloc(&r, small, 512, 500, VMM_API_CUDA_MALLOC, 1, 0, 2u << 20, VMM_REG_F_SHARED_CHUNK, "weights");
    uint32_t second = add_alloc(&r, small + 512, 1024, 1000, VMM_API_CUDA_MALLOC_ASYNC, 1, 512, 2u << 20,
                                VMM_REG_F_SHARED_CHUNK, "");
    add_alloc(&r, big, 64u << 20, 64u << 20, VMM_API_CU_MEM_ALLOC, 2, 0, 64u << 20, 0, "activations");
    add_alloc(&r, mapped, 2u << 20, 2u << 20, VMM_API_CU_MEM_MAP, 3, 0, 2u << 20, VMM_REG_F_NOT_EXPORTABLE, "");
    put_registry("live", &r, r.pid, small + 100);
    put_registry("live-mapped", &r, r.pid, mapped + (1u << 20));

    vmm__reg_remove(&r, second); /* a tombstone in the index, a record gone back to unbound */
    put_registry("freed", &r, r.pid, small + 600);

    /* A writer that died mid-write leaves an odd sequence counter behind. */
    vmm_reg_alloc *rec = (vmm_reg_alloc *)(r.base + r.hdr->rec_off);
    __atomic_store_n(&rec[0].seq, rec[0].seq | 1u, __ATOMIC_RELAXED);
    put_registry("torn-record", &r, r.pid, small);

    vmm__reg_close(&r);
    shm_unlink(name);
}

/* ---- name tables: as fuzz_names.c reads them (size, flags, sparse patches) ---- */

static void put_names(const char *name, const char *table, uint8_t flags, void (*damage)(uint8_t *img))
{
    int fd = shm_open(table, O_RDONLY, 0);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) exit(1);
    /* the header page and the entries the fuzz target maps: a table's first 64 */
    size_t size = (size_t)st.st_size < 4096 + 64 * 384 ? (size_t)st.st_size : 4096 + 64 * 384;
    uint8_t *img = malloc(size);
    if (!img || pread(fd, img, size, 0) != (ssize_t)size) exit(1);
    close(fd);
    ((vmm_names_header *)img)->capacity = 64; /* as much as the seed holds */
    if (damage) damage(img);
    buf b = {0};
    add_u32(&b, (uint32_t)size);
    add_u8(&b, flags);
    for (size_t at = 0; at < size;) {
        if (!img[at]) {
            at++;
            continue;
        }
        size_t end = at, zeros = 0;
        while (end < size && end - at < 0xffff && zeros < GAP) zeros = img[end++] ? 0 : zeros + 1;
        end -= zeros;
        add_u32(&b, (uint32_t)at);
        add_u16(&b, (uint16_t)(end - at));
        add(&b, img + at, end - at);
        at = end;
    }
    put("names", name, b.p, b.n);
    free(b.p);
    free(img);
}

static void torn_entry(uint8_t *img) { ((vmm_names_entry *)(img + 4096))[1].seq |= 1u; }
static void changing(uint8_t *img) { ((vmm_names_header *)img)->changes |= 1u; }

static void names_seeds(void)
{
    char name[64], err[256], table[300];
    snprintf(name, sizeof name, "/vmmshim-seed-names-%d", (int)getpid());
    vmm__reg r;
    memset(&r, 0, sizeof r);
    if (vmm__reg_open(&r, name, VMM__REG_CREATE, 64, NULL, err, sizeof err) != 0 || vmm__reg_attach(&r, NULL) != 0) {
        fprintf(stderr, "gen_seeds: %s\n", err);
        exit(1);
    }
    const uint64_t a = 0x7e0000000000ull, b2 = 0x7e0000200000ull;
    add_alloc(&r, a, 2u << 20, 2u << 20, VMM_API_CUDA_MALLOC, 1, 0, 2u << 20, 0, "");
    add_alloc(&r, b2, 2u << 20, 2u << 20, VMM_API_CUDA_MALLOC, 2, 0, 2u << 20, 0, "");
    int64_t shape[2] = {256, 1024}, strides[2] = {1, 256}, one[1] = {16};
    vmm__name_desc d[4] = {
        {.name = "model.layers.0.self_attn.q_proj.weight", .address = a, .code = 4, .bits = 16, .lanes = 1, .ndim = 2, .shape = shape},
        {.name = "transposed", .address = a + (1u << 20), .code = 2, .bits = 32, .lanes = 1, .ndim = 2, .shape = shape, .strides = strides},
        {.name = "step", .address = b2, .code = 0, .bits = 64, .lanes = 1, .ndim = 0},
        {.name = "bias", .address = b2 + 4096, .code = 2, .bits = 16, .lanes = 1, .ndim = 1, .shape = one},
    };
    /* entry 1 ("transposed") is published in the second record: rec_slot odd */
    if (vmm__names_publish(&r, d, 4, err, sizeof err) != 0) {
        fprintf(stderr, "gen_seeds: %s\n", err);
        exit(1);
    }
    snprintf(table, sizeof table, VMM_REG_NAMES_NAME, name, r.pid, (unsigned long long)r.start_time);
    put_names("live", table, 2, NULL);
    put_names("other-records", table, 0, NULL); /* this registry's ids: no entry passes the record check */
    put_names("torn-entry", table, 2, torn_entry);
    put_names("changing", table, 2, changing);
    if (vmm__names_unpublish(&r, "step", err, sizeof err) != 0) exit(1);
    put_names("unpublished", table, 2, NULL);
    vmm__reg_close(&r); /* detaches: the table goes too */
    shm_unlink(name);
}

/* ---- IPC handles: 64 bytes, then which byte to damage and how ---- */

static void ipc_seeds(void)
{
    static const uint8_t id[16] = {0x9e, 0x37, 0x79, 0xb9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    unsigned char h[66];
    vmm__ipc_encode(4242, 123456789, 3, 7, id, h);
    put("ipc", "handle", h, 64);
    h[64] = 24; /* the slot */
    h[65] = 0x80;
    put("ipc", "handle-damaged-slot", h, 66);
    vmm__ipc_encode(1, 0, 0, 0, id, h);
    put("ipc", "handle-small-fields", h, 64);
    for (int i = 0; i < 64; i++) h[i] = (unsigned char)(i * 37 + 11); /* someone else's (a native handle) */
    put("ipc", "foreign", h, 64);
}

/* ---- broker: credentials byte, then length-prefixed datagrams ---- */

static void add_request(buf *b, uint64_t slot, uint32_t version)
{
    vmm_broker_request q;
    memset(&q, 0, sizeof q);
    q.magic = VMM_BROKER_MAGIC;
    q.version = version;
    q.slot = slot;
    q.generation = 2 * slot + 1;
    for (int i = 0; i < 16; i++) q.alloc_id[i] = (uint8_t)(slot + (uint64_t)i);
    add_u8(b, sizeof q);
    add(b, &q, sizeof q);
}

static void add_request2(buf *b, uint64_t slot, uint32_t first, uint32_t max)
{
    vmm_broker_request2 q;
    memset(&q, 0, sizeof q);
    q.magic = VMM_BROKER_MAGIC;
    q.version = VMM_BROKER_VERSION2;
    q.slot = slot;
    q.generation = 2 * slot + 1;
    for (int i = 0; i < 16; i++) q.alloc_id[i] = (uint8_t)(slot + (uint64_t)i);
    q.first = first;
    q.max = max;
    add_u8(b, sizeof q);
    add(b, &q, sizeof q);
}

/* A v3 batch of n entries: entry i asks slot[i] for handles [first[i], first[i] + count[i]). */
static void add_request3(buf *b, uint32_t n, const uint64_t *slot, const uint32_t *first, const uint32_t *count,
                         uint32_t flags)
{
    vmm_broker_request3 h;
    memset(&h, 0, sizeof h);
    h.magic = VMM_BROKER_MAGIC;
    h.version = VMM_BROKER_VERSION3;
    h.n_entries = n;
    h.flags = flags;
    add_u8(b, (uint8_t)(sizeof h + n * sizeof(vmm_broker_entry3)));
    add(b, &h, sizeof h);
    for (uint32_t i = 0; i < n; i++) {
        vmm_broker_entry3 e;
        memset(&e, 0, sizeof e);
        e.slot = slot[i];
        e.generation = 2 * slot[i] + 1;
        for (int k = 0; k < 16; k++) e.alloc_id[k] = (uint8_t)(slot[i] + (uint64_t)k);
        e.first = first[i];
        e.count = count[i];
        add(b, &e, sizeof e);
    }
}

static void broker_seeds(void)
{
    buf b = {0};
    add_u8(&b, 1);
    add_request(&b, 0, VMM_BROKER_VERSION);
    put("broker", "one-request", b.p, b.n);

    b.n = 0; /* a kept connection: every answer the export gives, then a request of another version */
    add_u8(&b, 1);
    for (uint64_t s = 0; s < 8; s++) add_request(&b, s, VMM_BROKER_VERSION);
    add_request(&b, 0, VMM_BROKER_VERSION + 1);
    put("broker", "kept-connection", b.p, b.n);

    b.n = 0;
    add_u8(&b, 0); /* a peer the credentials check refused */
    add_request(&b, 0, VMM_BROKER_VERSION);
    put("broker", "refused-peer", b.p, b.n);

    b.n = 0; /* one byte too many, then an empty datagram */
    add_u8(&b, 1);
    add_request(&b, 6, VMM_BROKER_VERSION);
    b.p[1] = sizeof(vmm_broker_request) + 1;
    add_u8(&b, 0);
    add_u8(&b, 0);
    put("broker", "oversized", b.p, b.n);

    /* v2 on a kept connection: a one-handle allocation, one of 3 handles asked for all at once and
     * then one by one, one of 100 (two replies: 64, then the rest), first past the end, max 0,
     * every answer the export gives, then a v1 request for a multi-handle allocation */
    b.n = 0;
    add_u8(&b, 1);
    add_request2(&b, 0, 0, 1);
    add_request2(&b, 2u << 3, 0, 64);
    for (uint32_t i = 0; i < 3; i++) add_request2(&b, 2u << 3, i, 1);
    add_request2(&b, 99u << 3, 0, 1000);
    add_request2(&b, 99u << 3, 64, 64);
    add_request2(&b, 2u << 3, 3, 4);
    add_request2(&b, 0, 0, 0);
    for (uint64_t s = 1; s < 8; s++) add_request2(&b, (4u << 3) | s, 1, 2);
    add_request(&b, 2u << 3, VMM_BROKER_VERSION);
    put("broker", "v2-runs", b.p, b.n);

    b.n = 0; /* a v2 request one byte short, which ends the connection */
    add_u8(&b, 1);
    add_request2(&b, 8, 0, 8);
    b.p[1] = sizeof(vmm_broker_request2) - 1;
    put("broker", "v2-short", b.p, b.n);

    /* v3 on a kept connection: one-handle, 3-handle and 100-handle allocations in one batch (94
     * fds, two messages); five of 128 handles (640 fds, ten messages: more than a socket queues at
     * once); a batch whose second entry is stale (the first's 64 fds come, then the status); one
     * whose count runs past the allocation's end; n_entries 0; a flag no broker knows; then a v1
     * request */
    b.n = 0;
    add_u8(&b, 1);
    {
        uint64_t s1[3] = {0, 2u << 3, 99u << 3};
        uint32_t f1[3] = {0, 0, 6}, c1[3] = {1, 0, 0};
        add_request3(&b, 3, s1, f1, c1, 0);
        uint64_t s2[5] = {127u << 3, 127u << 3, 127u << 3, 127u << 3, 127u << 3};
        uint32_t z[5] = {0, 0, 0, 0, 0};
        add_request3(&b, 5, s2, z, z, 0);
        uint64_t s3[2] = {99u << 3, (2u << 3) | 1};
        add_request3(&b, 2, s3, z, z, 0);
        uint64_t s4[2] = {2u << 3, 2u << 3};
        uint32_t f4[2] = {1, 1}, c4[2] = {2, 5};
        add_request3(&b, 2, s4, f4, c4, 0);
        add_request3(&b, 0, NULL, NULL, NULL, 0);
        add_request3(&b, 1, s1, f1, c1, 2);
        add_request(&b, 0, VMM_BROKER_VERSION);
    }
    put("broker", "v3-batches", b.p, b.n);

    /* v3 with VMM_BROKER_REQ3_REPEATS: a 3-handle allocation named twice (its second run all
     * repeats); two slots whose handles share keys, overlapping runs; a 100-handle allocation
     * twice (its repeats cross a message boundary); repeats, then a stale entry; and a plain
     * batch after them on the same connection (every fd again) */
    b.n = 0;
    add_u8(&b, 1);
    {
        uint64_t s1[2] = {2u << 3, 2u << 3};
        uint32_t z[4] = {0, 0, 0, 0};
        add_request3(&b, 2, s1, z, z, VMM_BROKER_REQ3_REPEATS);
        uint64_t s2[2] = {5u << 3, (5u << 3) | 6};
        uint32_t f2[2] = {0, 2}, c2[2] = {4, 0};
        add_request3(&b, 2, s2, f2, c2, VMM_BROKER_REQ3_REPEATS);
        uint64_t s3[2] = {99u << 3, 99u << 3};
        uint32_t f3[2] = {0, 40}, c3[2] = {0, 0};
        add_request3(&b, 2, s3, f3, c3, VMM_BROKER_REQ3_REPEATS);
        uint64_t s4[3] = {2u << 3, 2u << 3, (2u << 3) | 1};
        add_request3(&b, 3, s4, z, z, VMM_BROKER_REQ3_REPEATS);
        add_request3(&b, 2, s1, z, z, 0);
    }
    put("broker", "v3-repeats", b.p, b.n);

    b.n = 0; /* a v3 batch whose length does not match its n_entries, which ends the connection */
    add_u8(&b, 1);
    {
        uint64_t s1[2] = {0, 8};
        uint32_t z[2] = {0, 0};
        add_request3(&b, 2, s1, z, z, 0);
        b.p[1] = (uint8_t)(b.p[1] - 8);
        b.n -= 8;
    }
    put("broker", "v3-short", b.p, b.n);

    /* v4 control on one connection: a pause asking for the holders (the 304-byte answer), the same
     * without the flag (256 bytes), a resume asking for them ('c': 3 of 8 named), a bad op, and a
     * tag without its NUL */
    b.n = 0;
    add_u8(&b, 1);
    for (int k = 0; k < 5; k++) {
        vmm_broker_request4 q;
        memset(&q, 0, sizeof q);
        q.magic = VMM_BROKER_MAGIC;
        q.version = VMM_BROKER_VERSION4;
        q.op = k == 2 ? VMM_BROKER_OP_RESUME : k == 3 ? 7u : VMM_BROKER_OP_PAUSE;
        q.flags = k == 0 ? VMM_BROKER_REQ4_HOLDERS | 1u : k == 1 ? 2u : k == 2 ? VMM_BROKER_REQ4_HOLDERS : 0u;
        if (k == 4) memset(q.tag, 'x', sizeof q.tag);
        else snprintf(q.tag, sizeof q.tag, "%c", k == 0 ? 'k' : 'a' + k); /* 'k' % 12: 11 holders, 8 named */
        add_u8(&b, sizeof q);
        add(&b, &q, sizeof q);
    }
    put("broker", "v4-control", b.p, b.n);
    free(b.p);
}

/* ---- options: a mode byte, then a config file or NUL-separated environment values ---- */

static void options_seeds(void)
{
    buf b = {0};
    int fd = memfd_create("conf", MFD_CLOEXEC);
    if (fd < 0) exit(1);
    vmm__opt_print_conf(fd); /* config/vmmshim.conf: every option commented out */
    off_t len = lseek(fd, 0, SEEK_END);
    char *text = malloc((size_t)len);
    if (!text || pread(fd, text, (size_t)len, 0) != len) exit(1);
    close(fd);
    add_u8(&b, 0);
    add(&b, text, (size_t)len);
    free(text);
    put("options", "sample-conf", b.p, b.n);

    static const char conf[] = "# every option set, in the forms the parser takes\n"
                               "strict = no\nVMMSHIM_VERBOSE = 1\nlog_level = DEBUG\n"
                               "log_file = \"/tmp/vmmshim fuzz.log\"\nenable = on\n"
                               "registry = /vmmshim-fuzz\nregistry_group = 1000\n"
                               "registry_capacity = 4096\ncache_size = 512 MiB # trailing comment\ngive_back_ms = 50\n"
                               "isolate = false\nadopt = yes\nexport = pidfd\nbroker_dir = '/tmp/b#1'\n"
                               "broker_group = video\nfabric = off\ntag = run-42\nframes = 8\n"
                               "config = /etc/ignored.conf\nno_such_option = 1\nnot a line\n";
    b.n = 0;
    add_u8(&b, 0);
    add(&b, conf, sizeof conf - 1);
    put("options", "every-option", b.p, b.n);

    b.n = 0;
    add_u8(&b, 2); /* the same file under VMMSHIM_STRICT=1, with bad values */
    static const char bad[] = "cache_size = 2P\ngive_back_ms = 60001\nframes = 9\nlog_level = loud\ntag = "
                              "a-tag-that-is-longer-than-thirty-one-bytes\nregistry = no-slash\n";
    add(&b, bad, sizeof bad - 1);
    put("options", "strict-bad-values", b.p, b.n);

    /* Environment values, one per option in table order from STRICT (CONFIG's is skipped). */
    static const char *const env[VMM__OPT_COUNT] = {
        "0", "1", "info", "/tmp/vmmshim.log", "", "TRUE", "/vmmshim-env", "wheel", "1024",
        "1T", "250", "1", "0", "broker", "/run/vmmshim", "video", "auto", "tag", "0", "1"};
    b.n = 0;
    add_u8(&b, 1);
    for (int i = 0; i < VMM__OPT_COUNT; i++) add(&b, env[i], strlen(env[i]) + (i + 1 < VMM__OPT_COUNT));
    put("options", "env-every-option", b.p, b.n);

    static const char sizes[] = "18446744073709551615\0-9223372036854775808\0 4 kib \0 16777217\0 0x10";
    b.n = 0;
    add_u8(&b, 1 | (VMM__OPT_CACHE_SIZE << 1));
    add(&b, sizes, sizeof sizes - 1);
    put("options", "env-numbers", b.p, b.n);
    free(b.p);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_seeds CORPUS_DIR\n");
        return 2;
    }
    g_root = argv[1];
    registry_seeds();
    names_seeds();
    ipc_seeds();
    broker_seeds();
    options_seeds();
    return 0;
}
