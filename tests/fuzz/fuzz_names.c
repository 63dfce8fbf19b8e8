/* Fuzz target: the name table reader (layout.h NAMES; vmm_foreach_tensor and vmm_find_tensor over
 * shim/registry/names.c) on a table of arbitrary bytes, as a companion meets the corrupt,
 * truncated or hostile table of an owner.
 *
 * Input (all little-endian):
 *    0  u32  table size, modulo 4096 + 64 x 384 + 1 (a header page and 64 entries)
 *    4  u8   flags: bit 0 keeps the header's pid and start time as given (else this process's are
 *            written over them, so the table is taken as this owner's); bit 1 points each entry at
 *            one of this process's two registry records (rec_slot and alloc_id written over, from
 *            the entry's own rec_slot modulo 2), so entries get past the record check
 *    5  patches: u32 offset, u16 length, that many bytes, written over a zero table
 * This process is the owner: it makes a registry of its own (a writer attached, two records),
 * writes the table where its own would be, and reads it through the public API.  A table smaller
 * than its header claims must be refused, never read past its end; every tensor given must be one
 * the API promises: a NUL-terminated, non-empty name, at most VMM_MAX_DIMS dimensions, no negative
 * extent or stride, nbytes > 0, and its first byte in the live record it names. */
#include "registry/registry.h"
#include "vmmshim.h"

#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define TABLE_MAX (4096u + 64u * 384u)
#define REC_A 0x7e0000000000ull
#define REC_B 0x7e0000200000ull

static uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static vmm__reg g_writer;
static vmm_registry *g_reg;
static uint32_t g_slot[2];
static uint8_t g_id[2][16];
static char g_table[300];

/* Once per process: the registry (unlinked at once: both handles keep it mapped) and its records. */
static void setup(void)
{
    char name[64], err[256];
    snprintf(name, sizeof name, "/vmmshim-fuzz-names-%d", (int)getpid());
    if (vmm__reg_open(&g_writer, name, VMM__REG_CREATE, 64, NULL, err, sizeof err) != 0 || vmm__reg_attach(&g_writer, NULL) != 0)
        abort();
    const uint64_t at[2] = {REC_A, REC_B};
    for (int i = 0; i < 2; i++) {
        vmm_reg_alloc d, pub;
        memset(&d, 0, sizeof d);
        d.requested_size = 2u << 20;
        d.handle_kinds = VMM_HANDLE_BROKER;
        d.api = VMM_API_TEST;
        if (vmm__reg_add(&g_writer, at[i], 2u << 20, &d, &g_slot[i], &pub) != 0) abort();
        memcpy(g_id[i], pub.alloc_id, 16);
    }
    if (vmm_open(name, &g_reg) != VMM_OK) abort();
    shm_unlink(name);
    snprintf(g_table, sizeof g_table, VMM_REG_NAMES_NAME, name, g_writer.pid, (unsigned long long)g_writer.start_time);
}

static void check_tensor(const vmm_tensor_info *t)
{
    if (!memchr(t->name, 0, sizeof t->name) || !t->name[0] || t->ndim > VMM_MAX_DIMS || t->nbytes == 0 ||
        t->pid != g_writer.pid || t->dtype.bits == 0 || t->dtype.lanes == 0)
        abort();
    for (uint32_t i = 0; i < t->ndim; i++)
        if (t->shape[i] < 0 || t->strides[i] < 0) abort();
    bool in_a = t->address >= REC_A && t->address - REC_A < (2u << 20);
    bool in_b = t->address >= REC_B && t->address - REC_B < (2u << 20);
    if (!(in_a && !memcmp(t->alloc_id, g_id[0], 16)) && !(in_b && !memcmp(t->alloc_id, g_id[1], 16))) abort();
}

static int on_tensor(void *ctx, const vmm_tensor_info *t)
{
    check_tensor(t);
    vmm_tensor_info *first = ctx;
    if (!first->name[0]) *first = *t;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 5) return 0;
    if (!g_reg) setup();
    size_t tsize = le32(data) % (TABLE_MAX + 1u);
    uint8_t flags = data[4];
    uint8_t *img = calloc(1, tsize ? tsize : 1);
    if (!img) abort();
    for (size_t at = 5; at + 6 <= size;) {
        uint64_t off = le32(data + at);
        size_t len = (size_t)data[at + 4] | (size_t)data[at + 5] << 8;
        at += 6;
        if (len > size - at) len = size - at;
        if (off < tsize) memcpy(img + off, data + at, len < tsize - off ? len : (size_t)(tsize - off));
        at += len;
    }
    if (!(flags & 1) && tsize >= sizeof(vmm_names_header)) {
        vmm_names_header *h = (vmm_names_header *)img;
        h->pid = g_writer.pid;
        h->start_time = g_writer.start_time;
    }
    if ((flags & 2) && tsize >= sizeof(vmm_names_header)) {
        const vmm_names_header *h = (const vmm_names_header *)img;
        uint64_t hs = h->header_size;
        /* by memcpy: a fuzzed header_size need not keep the entries aligned */
        for (uint64_t e = hs; hs >= sizeof *h && e + sizeof(vmm_names_entry) <= tsize; e += sizeof(vmm_names_entry)) {
            uint64_t slot;
            memcpy(&slot, img + e + offsetof(vmm_names_entry, rec_slot), 8);
            unsigned k = (unsigned)(slot % 2);
            slot = g_slot[k];
            memcpy(img + e + offsetof(vmm_names_entry, rec_slot), &slot, 8);
            memcpy(img + e + offsetof(vmm_names_entry, alloc_id), g_id[k], 16);
        }
    }
    int fd = shm_open(g_table, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    bool ok = tsize == 0 || pwrite(fd, img, tsize, 0) == (ssize_t)tsize;
    close(fd);
    free(img);
    if (ok) {
        vmm_tensor_info first;
        memset(&first, 0, sizeof first);
        vmm_status st = vmm_foreach_tensor(g_reg, g_writer.pid, on_tensor, &first);
        if (st != VMM_OK && st != VMM_ERR_CORRUPT && st != VMM_ERR_VERSION && st != VMM_ERR_BUSY) abort();
        if (st != VMM_OK && !vmm_last_error()[0]) abort();
        if (st == VMM_OK && first.name[0]) {
            vmm_tensor_info again;
            st = vmm_find_tensor(g_reg, g_writer.pid, first.name, &again);
            /* the table is not changing: a name given once is found again */
            if (st != VMM_OK || strcmp(again.name, first.name) != 0) abort();
            check_tensor(&again);
        }
        if (st == VMM_OK && vmm_find_tensor(g_reg, g_writer.pid, "", &first) != VMM_ERR_NOT_FOUND) abort();
    }
    shm_unlink(g_table);
    return 0;
}
