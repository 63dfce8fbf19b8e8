/* libvmmshim-client: the vmm_import* functions of tools/include/vmmshim.h, over the import
 * mechanism in shim/import (import.c, copy.c), which also serves the shim's legacy IPC.  Each
 * checks its arguments there and reports them under its public name. */
#include "vmmshim.h"
#include "import/import.h"
#include "internal.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define VMM_PUBLIC __attribute__((visibility("default")))

VMM_PUBLIC vmm_status vmm_import(vmm_registry *reg, const vmm_alloc_info *alloc, vmm_imported **out)
{
    return vmm__import(reg, alloc, out);
}

VMM_PUBLIC vmm_status vmm_import_fd(vmm_registry *reg, const vmm_alloc_info *alloc, int *fd)
{
    return vmm__import_fd(reg, alloc, fd);
}

VMM_PUBLIC vmm_status vmm_import_fds(vmm_registry *reg, const vmm_alloc_info *alloc, int *fds, uint64_t *sizes,
                                     uint32_t max, uint32_t *n)
{
    return vmm__import_fds(reg, alloc, fds, sizes, max, n);
}

VMM_PUBLIC vmm_status vmm_import_range(vmm_registry *reg, uint32_t pid, uint64_t address, uint64_t length,
                                       vmm_imported **out)
{
    return vmm__import_range(reg, pid, address, length, out);
}

VMM_PUBLIC vmm_status vmm_import_many(vmm_registry *reg, uint32_t pid, const uint64_t *addresses,
                                      const uint64_t *sizes, size_t n, vmm_imported **out)
{
    return vmm__import_many(reg, pid, addresses, sizes, n, out);
}

/* vmm_import_many_begin, hints given (vmm__import_many_begin's), its job described in desc. */
static vmm_status begin_described(vmm_registry *reg, uint32_t pid, const uint64_t *addresses, const uint64_t *sizes,
                                  vmm_alloc_info *hints, size_t n, vmm_import_desc *desc, vmm_import_job **job)
{
    struct many *m;
    vmm_status st = vmm__import_many_begin(reg, pid, addresses, sizes, hints, n, &m);
    if (st != VMM_OK) return st;
    for (size_t i = 0; i < n; i++) {
        int device;
        memset(&desc[i], 0, sizeof desc[i]);
        vmm__import_many_place(m, i, &desc[i].ptr, &desc[i].size, &device, &desc[i].n_records, desc[i].alloc_id);
        desc[i].device = device;
    }
    *job = (vmm_import_job *)m;
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_import_many_begin(vmm_registry *reg, uint32_t pid, const uint64_t *addresses,
                                            const uint64_t *sizes, size_t n, vmm_import_desc *desc, vmm_import_job **job)
{
    if (!job) return vmm__error(VMM_ERR_INVALID, "vmm_import_many_begin: job is NULL");
    *job = NULL;
    if (n && !desc) return vmm__error(VMM_ERR_INVALID, "vmm_import_many_begin: desc is NULL");
    return begin_described(reg, pid, addresses, sizes, NULL, n, desc, job);
}

/* The records the names lie in, read by the slots their table gives: each is a hint (extent 0
 * where the slot holds another allocation now), so that the import finds no record again. */
static vmm_alloc_info *records_of(vmm_registry *reg, uint32_t pid, const vmm_tensor_info *t, const uint64_t *slots,
                                  size_t n)
{
    vmm_alloc_info *hints = calloc(n, sizeof *hints);
    for (size_t i = 0; hints && i < n; i++) {
        vmm_alloc_info a;
        if (vmm__read_slot(reg, slots[i], &a) == VMM_OK && a.pid == pid &&
            memcmp(a.alloc_id, t[i].alloc_id, sizeof a.alloc_id) == 0 && a.address <= t[i].address &&
            t[i].address - a.address < a.extent)
            hints[i] = a;
    }
    return hints;
}

VMM_PUBLIC vmm_status vmm_import_tensors_begin(vmm_registry *reg, uint32_t pid, vmm_tensor_info *tensors, size_t max,
                                               size_t *n, vmm_import_desc *desc, vmm_import_job **job)
{
    if (!job || !n) return vmm__error(VMM_ERR_INVALID, "vmm_import_tensors_begin: %s is NULL", job ? "n" : "job");
    *job = NULL;
    *n = 0;
    if (max && (!tensors || !desc))
        return vmm__error(VMM_ERR_INVALID, "vmm_import_tensors_begin: %s is NULL", tensors ? "desc" : "tensors");
    if (!reg || !pid) return vmm__error(VMM_ERR_INVALID, "vmm_import_tensors_begin: %s", reg ? "pid is 0" : "reg is NULL");
    uint64_t *slots = calloc(max ? max : 1, sizeof *slots);
    if (!slots) return vmm__error(VMM_ERR_NOMEM, "vmm_import_tensors_begin: out of memory");
    vmm_status st = vmm__list_tensor_slots(reg, pid, tensors, slots, max, n);
    size_t k = *n;
    uint64_t *ranges = st == VMM_OK && k && k <= max ? calloc(2 * k, sizeof *ranges) : NULL;
    if (ranges) {
        for (size_t i = 0; i < k; i++) {
            ranges[i] = tensors[i].address;
            ranges[k + i] = tensors[i].nbytes;
        }
        st = begin_described(reg, pid, ranges, ranges + k, records_of(reg, pid, tensors, slots, k), k, desc, job);
    } else if (st == VMM_OK && k && k <= max) {
        st = vmm__error(VMM_ERR_NOMEM, "vmm_import_tensors_begin: out of memory");
    }
    free(ranges);
    free(slots);
    return st;
}

VMM_PUBLIC vmm_status vmm_import_many_end(vmm_import_job *job, vmm_imported **out)
{
    return vmm__import_many_end((struct many *)job, out);
}

VMM_PUBLIC vmm_status vmm_import_check(vmm_registry *reg, const vmm_imported *imp)
{
    return vmm__import_check(reg, imp);
}

VMM_PUBLIC vmm_status vmm_import_last_timing(vmm_import_timing *out) { return vmm__import_last_timing(out); }

VMM_PUBLIC vmm_status vmm_import_many_last_timing(vmm_import_many_timing *out)
{
    return vmm__import_many_last_timing(out);
}

VMM_PUBLIC uint64_t vmm_import_ptr(const vmm_imported *imp) { return vmm__import_ptr(imp); }

VMM_PUBLIC uint64_t vmm_import_size(const vmm_imported *imp) { return vmm__import_size(imp); }

VMM_PUBLIC int vmm_import_device(const vmm_imported *imp) { return vmm__import_device(imp); }

VMM_PUBLIC size_t vmm_import_records(const vmm_imported *imp, vmm_alloc_info *out, size_t max)
{
    return vmm__import_records(imp, out, max);
}

_Static_assert(sizeof(vmm_import_desc) == 40 && offsetof(vmm_import_desc, device) == 16 &&
                   offsetof(vmm_import_desc, n_records) == 20 && offsetof(vmm_import_desc, alloc_id) == 24,
               "vmm_import_desc's layout (the Python package reads it with struct)");

VMM_PUBLIC vmm_status vmm_import_describe(vmm_imported *const *imps, size_t n, vmm_import_desc *out)
{
    if (n && (!imps || !out)) return vmm__error(VMM_ERR_INVALID, "vmm_import_describe: %s is NULL", imps ? "out" : "imps");
    for (size_t i = 0; i < n; i++)
        if (!imps[i]) return vmm__error(VMM_ERR_INVALID, "vmm_import_describe: imps[%zu] is NULL", i);
    for (size_t i = 0; i < n; i++) {
        vmm_alloc_info first;
        memset(&out[i], 0, sizeof out[i]);
        out[i].ptr = vmm__import_ptr(imps[i]);
        out[i].size = vmm__import_size(imps[i]);
        out[i].device = vmm__import_device(imps[i]);
        size_t records = vmm__import_records(imps[i], &first, 1);
        out[i].n_records = records > UINT32_MAX ? UINT32_MAX : (uint32_t)records;
        if (records) memcpy(out[i].alloc_id, first.alloc_id, sizeof out[i].alloc_id);
    }
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_import_release(vmm_imported *imp) { return vmm__import_release(imp); }

VMM_PUBLIC vmm_status vmm_import_drop_idle(void) { return vmm__import_drop_idle(); }

VMM_PUBLIC vmm_status vmm_import_read(const vmm_imported *imp, uint64_t offset, void *dst, uint64_t length)
{
    return vmm__import_read(imp, offset, dst, length);
}

VMM_PUBLIC vmm_status vmm_import_copy(const vmm_imported *imp, uint64_t offset, uint64_t length, vmm_sink_fn sink,
                                      void *ctx)
{
    return vmm__import_copy(imp, offset, length, sink, ctx);
}
