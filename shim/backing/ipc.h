/* Legacy CUDA IPC (cudaIpcGetMemHandle / cuIpcGetMemHandle and friends) emulated for shim memory.
 *
 * VMM memory has no legacy IPC handle: the real functions refuse it with invalid-value, which
 * would break programs that share device memory that way (torch.multiprocessing CUDA tensors).
 * For an allocation the shim backs, the handle is instead a vmmshim handle naming the registry
 * record; opening it imports the allocation through the owner's broker (vmm_import), exactly as
 * a companion would.  Anything else is left to the real functions.
 *
 * THE 64 BYTES (all integers little-endian):
 *
 *   0   magic      "VMMIPC" (6 bytes)
 *   6   version    u8, VMM__IPC_VERSION
 *   7   zero       u8, must be 0
 *   8   pid        u32  owner's pid (in the owner's pid namespace)
 *  12   flags      u32  reserved, must be 0
 *  16   start_time u64  owner's /proc/<pid>/stat start time (with pid: the owner's identity)
 *  24   slot       u64  registry record index
 *  32   generation u64  the record's generation when the handle was made
 *  40   alloc_id   16 bytes, the allocation's random id
 *  56   check      u64  vmm__ipc_check() over bytes 0..55
 *
 * A handle for an interior pointer names the whole allocation (as native handles do: opening it
 * returns the allocation's base).  The allocation may share a chunk with others of its owner:
 * the importer maps the chunk once (the client library's chunk cache) and gets the allocation's
 * own base in it, so two allocations of one chunk open at distinct pointers and stay valid
 * until each is closed.  Handles carry no secret: memory moves only through the
 * owner's broker, which checks the importer's credentials and the (slot, generation, alloc_id)
 * triple, so a stale or forged handle is refused.  The check word only tells vmmshim handles
 * that were damaged apart from other handles. */
#ifndef VMM_BACKING_IPC_H
#define VMM_BACKING_IPC_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backing/backing.h"

#define VMM__IPC_MAGIC "VMMIPC"
#define VMM__IPC_VERSION 1u
#define VMM__IPC_CHECK_KEY 0x216d6968736d6d76ull /* "vmmshim!" little-endian, mixed into the check word */

typedef struct vmm__ipc_handle {
    char magic[6];
    uint8_t version;
    uint8_t zero;
    uint32_t pid;
    uint32_t flags;
    uint64_t start_time;
    uint64_t slot;
    uint64_t generation;
    uint8_t alloc_id[16];
    uint64_t check;
} vmm__ipc_handle;

_Static_assert(sizeof(vmm__ipc_handle) == 64, "an IPC handle is 64 bytes");
_Static_assert(offsetof(vmm__ipc_handle, magic) == 0, "magic offset");
_Static_assert(offsetof(vmm__ipc_handle, version) == 6, "version offset");
_Static_assert(offsetof(vmm__ipc_handle, zero) == 7, "zero offset");
_Static_assert(offsetof(vmm__ipc_handle, pid) == 8, "pid offset");
_Static_assert(offsetof(vmm__ipc_handle, flags) == 12, "flags offset");
_Static_assert(offsetof(vmm__ipc_handle, start_time) == 16, "start_time offset");
_Static_assert(offsetof(vmm__ipc_handle, slot) == 24, "slot offset");
_Static_assert(offsetof(vmm__ipc_handle, generation) == 32, "generation offset");
_Static_assert(offsetof(vmm__ipc_handle, alloc_id) == 40, "alloc_id offset");
_Static_assert(offsetof(vmm__ipc_handle, check) == 56, "check offset");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the IPC handle layout is little-endian; this code copies it as a struct"
#endif

/* The check word over the first 56 bytes: a splitmix64 chain keyed with VMM__IPC_CHECK_KEY over
 * the seven little-endian u64 words (inline, so readers and tests compute the same). */
static inline uint64_t vmm__ipc_mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static inline uint64_t vmm__ipc_check(const unsigned char bytes[56])
{
    uint64_t h = VMM__IPC_CHECK_KEY;
    for (int i = 0; i < 7; i++) {
        uint64_t w;
        memcpy(&w, bytes + 8 * i, sizeof w);
        h = vmm__ipc_mix(h ^ w) + 0x9e3779b97f4a7c15ull;
    }
    return vmm__ipc_mix(h ^ 56u);
}

/* The 64 bytes naming one allocation: magic, version, the fields, zeroes, and the check word. */
static inline void vmm__ipc_encode(uint32_t pid, uint64_t start_time, uint64_t slot, uint64_t generation,
                                   const uint8_t alloc_id[16], unsigned char out[64])
{
    vmm__ipc_handle h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, VMM__IPC_MAGIC, sizeof h.magic);
    h.version = VMM__IPC_VERSION;
    h.pid = pid;
    h.start_time = start_time;
    h.slot = slot;
    h.generation = generation;
    memcpy(h.alloc_id, alloc_id, sizeof h.alloc_id);
    memcpy(out, &h, sizeof h);
    h.check = vmm__ipc_check(out);
    memcpy(out, &h, sizeof h);
}

/* DONE: a sound vmmshim handle in *h; PASS: someone else's; INVALID: ours but damaged.  Pure (no
 * state, no I/O), so tests/fuzz drives the very decoder vmm__ipc_open uses. */
static inline vmm__result vmm__ipc_decode(const unsigned char bytes[64], vmm__ipc_handle *h)
{
    memcpy(h, bytes, sizeof *h);
    if (memcmp(h->magic, VMM__IPC_MAGIC, sizeof h->magic) != 0 || h->version != VMM__IPC_VERSION) return VMM__PASS;
    if (vmm__ipc_check(bytes) != h->check || h->zero != 0 || h->flags != 0 || h->pid == 0) return VMM__INVALID;
    return VMM__DONE;
}

/* Fill handle for the shim allocation containing ptr.  DONE: filled; PASS: not shim memory (or
 * the shim is inactive): call the real function. */
vmm__result vmm__ipc_get_handle(uint64_t ptr, unsigned char handle[64]);
/* Map the allocation a handle names into this process.  Opening one handle again returns the
 * same pointer and counts a reference (as does a handle of another allocation that the owner
 * placed at the same offset of the same chunk after freeing this one: the same bytes).
 * DONE: *ptr set; PASS: not a vmmshim handle (call the real function); INVALID: a vmmshim
 * handle that is damaged, stale (freed since), refused, made by this very process, or whose
 * owner is dead.  The caller has made sure the thread has a CUDA
 * context when the native call would need one; if it has none, the primary context of the
 * runtime's current device is bound, as the runtime does. */
vmm__result vmm__ipc_open(const unsigned char handle[64], uint64_t *ptr);
/* DONE: one reference dropped (the import is released at the last, and the chunk's mapping
 * with the last import of it); PASS: ptr is not a base pointer vmm__ipc_open returned (call the
 * real function). */
vmm__result vmm__ipc_close(uint64_t ptr);
#endif
