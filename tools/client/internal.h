/* What one file of libvmmshim-client calls in another; never installed. */
#ifndef VMM_CLIENT_INTERNAL_H
#define VMM_CLIENT_INTERNAL_H
#include "vmmshim.h"

/* vmm_list_tensors with the registry slot of each name's record beside it (slots[i] for out[i]):
 * tensors.c, for vmm_import_tensors_begin (import_api.c). */
vmm_status vmm__list_tensor_slots(vmm_registry *reg, uint32_t pid, vmm_tensor_info *out, uint64_t *slots, size_t max,
                                  size_t *n);

#endif
