/* Fuzz target: the registry reader (libvmmshim-client over shim/registry) on a segment of
 * arbitrary bytes, as a companion meets a corrupt, truncated or hostile registry.
 *
 * Input (all little-endian):
 *    0  u32  segment size, modulo 4 MiB + 1 (the real writer's smallest layout is 2.1 MiB)
 *    4  u32  pid to look up
 *    8  u64  address to look up
 *   16  patches: u32 offset, u16 length, that many bytes, written over a zero segment
 * so a seed made by the real writer stays a few KiB (tests/fuzz/gen_seeds.c), while a small
 * flat image is one patch at offset 0.  The segment is a POSIX shm object of this process
 * (unlinked once opened), read through the public API: vmm_open, vmm_registry_describe,
 * vmm_check, vmm_foreach_alloc (looking the first records up again with vmm_find),
 * vmm_foreach_proc, vmm_find_proc and vmm_find around the input's address.  A segment
 * smaller than its header claims must be refused, never mapped past its end (SIGBUS); what
 * comes back must be what the API promises. */
#include "vmmshim.h"

#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_SEGMENT (4u << 20)
#define MAX_LOOKUPS 4 /* records looked up again per input: a lookup may wait out a torn index */

static uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t le64(const uint8_t *p) { return le32(p) | (uint64_t)le32(p + 4) << 32; }

static bool nul_within(const char *s, size_t n) { return memchr(s, 0, n) != NULL; }

static void check_alloc(const vmm_alloc_info *a)
{
    if (a->n_frames > 8 || !nul_within(a->tag, sizeof a->tag)) abort();
    if (a->owner_alive != VMM_OWNER_DEAD && a->owner_alive != VMM_OWNER_ALIVE && a->owner_alive != VMM_OWNER_UNKNOWN)
        abort();
}

/* vmm_find's promise: a live allocation of that pid that contains the address. */
static vmm_status find_at(vmm_registry *reg, uint32_t pid, uint64_t address)
{
    vmm_alloc_info a;
    vmm_status st = vmm_find(reg, pid, address, &a);
    if (st == VMM_OK) {
        check_alloc(&a);
        if (a.pid != pid || address < a.address || address - a.address >= a.extent) abort();
    } else if (st != VMM_ERR_NOT_FOUND && st != VMM_ERR_BUSY && !(st == VMM_ERR_INVALID && pid == 0)) {
        abort();
    }
    if (st != VMM_OK && !vmm_last_error()[0]) abort();
    return st;
}

typedef struct {
    vmm_registry *reg;
    unsigned lookups; /* records still to look up again */
} walk;

static int on_alloc(void *ctx, const vmm_alloc_info *a)
{
    walk *w = ctx;
    check_alloc(a);
    if (w->lookups) {
        w->lookups--;
        find_at(w->reg, a->pid, a->address);
        if (a->extent) find_at(w->reg, a->pid, a->address + a->extent - 1);
        find_at(w->reg, a->pid, a->address + a->extent);
    }
    return 0;
}

static int on_proc(void *ctx, const vmm_proc_info *p)
{
    (void)ctx;
    if (!nul_within(p->broker_path, sizeof p->broker_path) || !nul_within(p->cmdline, sizeof p->cmdline)) abort();
    if (p->alive != VMM_OWNER_DEAD && p->alive != VMM_OWNER_ALIVE && p->alive != VMM_OWNER_UNKNOWN) abort();
    return 0;
}

/* The segment as the input describes it, under a name of this process; the fd is closed. */
static bool make_segment(const char *name, const uint8_t *data, size_t size)
{
    int fd = shm_open(name, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    uint64_t seg = le32(data) % (MAX_SEGMENT + 1ull);
    bool ok = ftruncate(fd, (off_t)seg) == 0;
    for (size_t at = 16; ok && at + 6 <= size;) {
        uint64_t off = le32(data + at);
        size_t len = (size_t)data[at + 4] | (size_t)data[at + 5] << 8;
        at += 6;
        if (len > size - at) len = size - at;
        if (off < seg) {
            size_t n = len < seg - off ? len : (size_t)(seg - off);
            ok = pwrite(fd, data + at, n, (off_t)off) == (ssize_t)n;
        }
        at += len;
    }
    close(fd);
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 16) return 0;
    char name[64];
    snprintf(name, sizeof name, "/vmmshim-fuzz-%d", (int)getpid());
    if (!make_segment(name, data, size)) {
        shm_unlink(name);
        return 0;
    }
    vmm_registry *reg = NULL;
    vmm_status st = vmm_open(name, &reg);
    shm_unlink(name); /* the reader keeps its fd; nothing is left behind after a crash below */
    if (st != VMM_OK) {
        if (reg || !vmm_last_error()[0]) abort();
        if (st != VMM_ERR_CORRUPT && st != VMM_ERR_VERSION && st != VMM_ERR_BUSY) abort();
        return 0;
    }

    vmm_registry_info info;
    if (vmm_registry_describe(reg, &info) != VMM_OK || !nul_within(info.name, sizeof info.name)) abort();
    if (info.used_chunks > info.capacity / (info.chunk_records ? info.chunk_records : 1)) abort();

    /* A torn index (or a busy record) makes every further lookup wait out its retry time and
     * cover nothing new: one says it all. */
    uint32_t pid = le32(data + 4);
    uint64_t address = le64(data + 8);
    bool more = find_at(reg, pid, address) != VMM_ERR_BUSY;

    /* open validated these very bytes: check may find busy records, never a corrupt segment */
    vmm_gc_report rep;
    st = vmm_check(reg, &rep);
    if (st != VMM_OK && st != VMM_ERR_BUSY) abort();

    walk w = {.reg = reg, .lookups = more ? MAX_LOOKUPS : 0};
    if (vmm_foreach_alloc(reg, on_alloc, &w) != VMM_OK) abort();
    if (vmm_foreach_proc(reg, on_proc, NULL) != VMM_OK) abort();

    vmm_proc_info p;
    st = vmm_find_proc(reg, pid, &p);
    if (st == VMM_OK ? p.pid != pid : st != VMM_ERR_NOT_FOUND && !(st == VMM_ERR_INVALID && pid == 0)) abort();
    if (more) {
        find_at(reg, pid, address - 1);
        find_at(reg, pid, address & ~(uint64_t)0x1fffff);
    }
    vmm_close(reg);
    return 0;
}
