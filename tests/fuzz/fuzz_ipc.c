/* Fuzz target: the 64-byte IPC handle decoder (vmm__ipc_decode, shim/backing/ipc.h), which
 * cudaIpcOpenMemHandle runs on whatever bytes a program hands it.
 *
 * Input: the first 64 bytes are the handle (zero-padded when shorter); byte 64, if any, picks a
 * byte of a freshly encoded handle to damage.  Beyond "no crash", it holds the decoder to its
 * contract: only canonical handles are accepted, every handle the encoder makes is accepted with
 * its own fields, and damaging any one byte of a sound handle is always noticed (each step of the
 * check chain is a bijection, so no single-word change can keep the check word). */
#include "backing/ipc.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* A heap copy of exactly 64 bytes: a decoder reading past the handle trips ASan. */
    unsigned char *bytes = malloc(64);
    if (!bytes) return 0;
    memset(bytes, 0, 64);
    memcpy(bytes, data, size < 64 ? size : 64);

    vmm__ipc_handle h;
    vmm__result r = vmm__ipc_decode(bytes, &h);
    if (r != VMM__DONE && r != VMM__PASS && r != VMM__INVALID) abort();
    bool ours = memcmp(bytes, VMM__IPC_MAGIC, 6) == 0 && bytes[6] == VMM__IPC_VERSION;
    if ((r == VMM__PASS) == ours) abort();

    unsigned char again[64];
    if (r == VMM__DONE) {
        vmm__ipc_encode(h.pid, h.start_time, h.slot, h.generation, h.alloc_id, again);
        if (memcmp(again, bytes, 64) != 0) abort(); /* accepted, so it must be canonical */
    }

    /* Whatever fields the input holds, their encoding decodes to them (pid 0 names nobody). */
    vmm__ipc_handle f;
    memcpy(&f, bytes, sizeof f);
    vmm__ipc_encode(f.pid, f.start_time, f.slot, f.generation, f.alloc_id, again);
    vmm__ipc_handle back;
    r = vmm__ipc_decode(again, &back);
    if (r != (f.pid ? VMM__DONE : VMM__INVALID)) abort();
    if (back.pid != f.pid || back.start_time != f.start_time || back.slot != f.slot ||
        back.generation != f.generation || memcmp(back.alloc_id, f.alloc_id, 16) != 0)
        abort();

    if (f.pid && size > 64) {
        size_t at = data[64] % 64;
        unsigned char flip = size > 65 && data[65] ? data[65] : 0x01;
        again[at] ^= flip;
        if (vmm__ipc_decode(again, &back) == VMM__DONE) abort();
    }
    free(bytes);
    return 0;
}
