/* Exports ahead of requests (preexport.c): the segments under the tensors a program names are
 * exported by the broker thread in the background, so a companion's first take pays no export. */
#ifndef VMM_BACKING_PREEXPORT_H
#define VMM_BACKING_PREEXPORT_H
#include <stddef.h>
#include <stdint.h>

#include "broker/broker.h"

/* The program named tensors over these byte ranges (vmm_publish's hook, after it succeeded):
 * queued for the broker thread, which starts on them VMMSHIM_PREEXPORT_MS later.  Never blocks
 * on an export. */
void vmm__preexport_want(const uint64_t *addr, const uint64_t *len, size_t n);
/* The broker thread's idle function (vmm__broker_idle_fn): one handle a call. */
int vmm__preexport_step(vmm__broker_export_fn export_fn);
#endif
