/* Shared by the client library's own files only (never installed). */
#ifndef VMM_CLIENT_INTERNAL_H
#define VMM_CLIENT_INTERNAL_H
#include "vmmshim.h"

/* Record the calling thread's one-line reason (vmm_last_error) and return st. */
__attribute__((format(printf, 2, 3))) vmm_status vmm__client_error(vmm_status st, const char *fmt, ...);

/* The record at `slot` as it is now, converted as vmm_find does, except that owner_alive is
 * VMM_OWNER_UNKNOWN (judging it reads /proc; the caller may know better).  VMM_ERR_STALE when the
 * slot holds no live allocation, VMM_ERR_BUSY when it stayed mid-write.  import.c uses it to check
 * a cached chunk's allocation without asking the owner's broker. */
vmm_status vmm__client_read_slot(vmm_registry *reg, uint64_t slot, vmm_alloc_info *out);
/* From now on keep nothing imported once released: the last release unmaps the chunk and the
 * owner's connection closes with its last use.  For the shim's emulated legacy IPC
 * (cudaIpcCloseMemHandle unmaps; the shim starts no thread of its own in its host program). */
void vmm__import_keep_nothing(void);
/* vmm_close: unmap the idle imported chunks read through reg; held ones go at their last release. */
void vmm__import_forget_registry(vmm_registry *reg);
#endif
