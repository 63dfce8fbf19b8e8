/* The import mechanism shared by the client library (tools/client) and the shim's emulated
 * legacy IPC (shim/backing/ipc.c): registry record reading (records.c), opening and closing a
 * registry (open.c), importing (import.c, range.c, many*.c over fetch.c, broker.c, cache.c,
 * devices.c, owners.c, driver.c) and copies out of an import (copy.c); README.md lists them.
 * Internal (never installed); nothing here calls into tools/client, whose public functions are
 * thin faces over these.  The record lookups here trust their arguments (client.c checks them);
 * the vmm__import* functions still check their own and name the public function in the reason. */
#ifndef VMM_IMPORT_H
#define VMM_IMPORT_H
#include "api/vmm_api.h"

#include <stdbool.h>
#include <stdint.h>

#include "registry/registry.h"

struct vmm_registry {
    vmm__reg r;
};

static inline const uint64_t *vmm__chunk_table(const vmm__reg *r)
{
    return (const uint64_t *)(r->base + r->hdr->chunk_off);
}

/* ---- errors and records (records.c) ---- */

/* Record the calling thread's one-line reason (vmm_last_error) and return st. */
__attribute__((format(printf, 2, 3))) vmm_status vmm__error(vmm_status st, const char *fmt, ...);
/* The calling thread's last reason (vmm_last_error), and a status's words (vmm_strerror). */
const char *vmm__error_text(void);
const char *vmm__status_text(vmm_status status);
/* One entry of a table of driver functions: the exported name and where its address goes. */
typedef struct vmm__driver_sym {
    const char *name;
    void **slot;
    bool optional; /* left NULL when the driver lacks it */
} vmm__driver_sym;
/* dlopen libcuda.so.1 and fill every slot: 0; or -1 with the table (size bytes) zeroed and why
 * in err, for a missing library or a missing required symbol. */
int vmm__driver_load(const vmm__driver_sym *syms, size_t n, void *table, size_t size, char *err, size_t errlen);

/* A registry error code (-errno style) as a status; with the registry's own reason `msg` (or
 * strerror of rc) as the thread's reason. */
vmm_status vmm__status_of(int rc, bool too_new);
vmm_status vmm__reg_error(int rc, const char *msg, bool too_new);
bool vmm__pid_exists(uint32_t pid);
/* A registry header of a newer layout than this reader's (magic right, compat_version beyond). */
bool vmm__header_too_new(const vmm_reg_header *h);
/* vmm_open / vmm_open_writable (mode VMM__REG_READ or VMM__REG_WRITE) and vmm_close (open.c). */
vmm_status vmm__open(const char *name, int mode, vmm_registry **out);
void vmm__close(vmm_registry *reg);

/* Claimed process slots, found with pread (the table is sparse); fn returning non-zero stops. */
typedef int (*vmm__claim_fn)(void *ctx, uint32_t index, uint64_t claim);
int vmm__scan_claims(const vmm__reg *r, vmm__claim_fn fn, void *ctx);
/* Read a claimed proc slot.  0 and *pid, *alive filled; -ENOENT when the slot was released (or
 * re-claimed) meanwhile; -EAGAIN when the record stayed mid-write (waiting on wait). */
int vmm__read_claimed_proc(const vmm__reg *r, uint32_t index, uint64_t claim, vmm_reg_proc *p, uint32_t *pid,
                           int *alive, vmm__reg_wait *wait);

/* vmm_pause_process / vmm_resume_process (control.c): op VMM_BROKER_OP_PAUSE or _RESUME, sent to
 * pid's broker (protocol v4); the owner's report in the first report_size bytes of *report. */
vmm_status vmm__remote_sleep(vmm_registry *reg, uint32_t pid, uint32_t op, const char *tag, unsigned flags,
                             vmm_sleep_report *report, size_t report_size);

/* vmm_foreach_alloc, vmm_foreach_proc, vmm_find_proc, vmm_find without their argument checks. */
vmm_status vmm__foreach_alloc(vmm_registry *reg, vmm_alloc_fn fn, void *ctx);
vmm_status vmm__foreach_proc(vmm_registry *reg, vmm_proc_fn fn, void *ctx);
vmm_status vmm__find_proc(vmm_registry *reg, uint32_t pid, vmm_proc_info *out);
/* The same with bytes_paused left 0: its sum walks every record of the registry (~0.3 ms for a
 * cold reader of a few thousand), which a caller after the owner's identity does without. */
vmm_status vmm__find_proc_identity(vmm_registry *reg, uint32_t pid, vmm_proc_info *out);
vmm_status vmm__find(vmm_registry *reg, uint32_t pid, uint64_t address, vmm_alloc_info *out);
/* vmm__find for many lookups in one call: the owner's liveness (a read of /proc, ~20 us, more
 * than the lookup) judged once per owner identity and kept in *cache (zeroed by the caller). */
typedef struct vmm__liveness_cache {
    bool valid;
    uint32_t pid;
    uint64_t start_time, pidns;
    int alive;
    uint64_t levels; /* the index levels the call's records were found at (vmm__reg_find_near) */
} vmm__liveness_cache;
vmm_status vmm__find_cached(vmm_registry *reg, uint32_t pid, uint64_t address, vmm_alloc_info *out,
                            vmm__liveness_cache *cache);
/* The same for a range [address, address + size_hint) that most likely lies in one allocation:
 * the index levels it can be at are searched first (vmm__reg_find_near). */
vmm_status vmm__find_cached_near(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t size_hint,
                                 vmm_alloc_info *out, vmm__liveness_cache *cache);
/* The record at `slot` as it is now, converted as vmm_find does, except that owner_alive is
 * VMM_OWNER_UNKNOWN (judging it reads /proc; the caller may know better).  VMM_ERR_STALE when the
 * slot holds no live allocation, VMM_ERR_BUSY when it stayed mid-write.  The chunk cache uses it to
 * check a cached chunk's allocation without asking the owner's broker. */
vmm_status vmm__read_slot(vmm_registry *reg, uint64_t slot, vmm_alloc_info *out);
/* The registry still shows allocation a, live, at its place in its chunk: VMM_OK, else
 * VMM_ERR_STALE (freed, or placed otherwise) or vmm__read_slot's status. */
vmm_status vmm__record_unchanged(vmm_registry *reg, const vmm_alloc_info *a);
/* The owner of a has died and a living keeper holds a's memory now (layout.h KEEP): its record
 * is still that live allocation, flagged kept, and the keeper's lock is held.  The imports ask
 * it before they call a dead owner's cached chunk gone. */
bool vmm__kept_now(vmm_registry *reg, const vmm_alloc_info *a);

/* ---- imports (import.c, range.c, many.c, fetch.c, cache.c): the vmm_import* functions of vmmshim.h
 * under vmm__ names ---- */

vmm_status vmm__import(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported **out);
vmm_status vmm__import_fd(vmm_registry *reg, const vmm_alloc_info *alloc, int *fd);
vmm_status vmm__import_fds(vmm_registry *reg, const vmm_alloc_info *alloc, int *fds, uint64_t *sizes, uint32_t max,
                           uint32_t *n);
vmm_status vmm__import_range(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t length,
                             vmm_imported **out);
vmm_status vmm__import_many(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *lengths,
                            size_t n, vmm_imported **out);
/* vmm_import_many in two halves (vmmshim.h vmm_import_many_begin, _end): the job is one call's
 * state (shim/import/many.h), the grant running on a thread of its own between them.  hints
 * (malloc'd, taken in every case; NULL: none) is per range the record its caller read for the
 * range's start (extent 0: none): a hint covering the start stands for the index search, checked
 * against the registry as every record the call uses is. */
struct many;
vmm_status vmm__import_many_begin(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *lengths,
                                  vmm_alloc_info *hints, size_t n, struct many **job);
/* Range i's place as begun: pointer, size, device, records under it and the first one's id. */
void vmm__import_many_place(const struct many *job, size_t i, uint64_t *ptr, uint64_t *size, int *device,
                            uint32_t *n_records, uint8_t alloc_id[16]);
vmm_status vmm__import_many_end(struct many *job, vmm_imported **out);
vmm_status vmm__import_check(vmm_registry *reg, const vmm_imported *imp);
vmm_status vmm__import_last_timing(vmm_import_timing *out);
vmm_status vmm__import_many_last_timing(vmm_import_many_timing *out);
uint64_t vmm__import_ptr(const vmm_imported *imp);
uint64_t vmm__import_size(const vmm_imported *imp);
int vmm__import_device(const vmm_imported *imp);
size_t vmm__import_records(const vmm_imported *imp, vmm_alloc_info *out, size_t max);
vmm_status vmm__import_release(vmm_imported *imp);
vmm_status vmm__import_drop_idle(void);
/* From now on keep nothing imported once released: the last release unmaps the chunk and the
 * owner's connection closes with its last use.  For the shim's emulated legacy IPC
 * (cudaIpcCloseMemHandle unmaps; the shim starts no thread of its own in its host program). */
void vmm__import_keep_nothing(void);
/* vmm_close: unmap the idle imported chunks read through reg; held ones go at their last release. */
void vmm__import_forget_registry(vmm_registry *reg);

/* ---- copies (copy.c) ---- */

vmm_status vmm__import_read(const vmm_imported *imp, uint64_t offset, void *dst, uint64_t length);
vmm_status vmm__import_copy(const vmm_imported *imp, uint64_t offset, uint64_t length, vmm_sink_fn sink,
                            void *ctx);
#endif
