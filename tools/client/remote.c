/* libvmmshim-client: pause and resume another process's memory (vmm_pause_process,
 * vmm_resume_process of tools/include/vmmshim.h), through its broker over shim/import/control.c.
 * The owner decides: it must have opted in (VMMSHIM_REMOTE_PAUSE=1). */
#include "vmmshim.h"
#include "broker/protocol.h"
#include "import/import.h"

#define VMM_PUBLIC __attribute__((visibility("default")))

VMM_PUBLIC vmm_status vmm_pause_process(vmm_registry *reg, uint32_t pid, const char *tag, unsigned flags,
                                        vmm_sleep_report *report, size_t report_size)
{
    if (!reg) return vmm__error(VMM_ERR_INVALID, "vmm_pause_process: reg is NULL");
    if (pid == 0) return vmm__error(VMM_ERR_INVALID, "vmm_pause_process: pid 0");
    if ((flags & ~(unsigned)(VMM_PAUSE_DISCARD | VMM_PAUSE_FILE)) || (flags & VMM_PAUSE_DISCARD && flags & VMM_PAUSE_FILE))
        return vmm__error(VMM_ERR_INVALID, "vmm_pause_process: bad flags 0x%x (VMM_PAUSE_DISCARD or VMM_PAUSE_FILE)",
                          flags);
    return vmm__remote_sleep(reg, pid, VMM_BROKER_OP_PAUSE, tag, flags, report, report_size);
}

VMM_PUBLIC vmm_status vmm_resume_process(vmm_registry *reg, uint32_t pid, const char *tag, vmm_sleep_report *report,
                                         size_t report_size)
{
    if (!reg) return vmm__error(VMM_ERR_INVALID, "vmm_resume_process: reg is NULL");
    if (pid == 0) return vmm__error(VMM_ERR_INVALID, "vmm_resume_process: pid 0");
    return vmm__remote_sleep(reg, pid, VMM_BROKER_OP_RESUME, tag, 0, report, report_size);
}
