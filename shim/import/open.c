/* A registry handle's life: vmm_open and vmm_close under their vmm__ names.  Closing sits above
 * both the records (records.c) and the chunk cache (cache.c): a closed handle must leave no idle
 * mapping that names it (the reaper would read a freed registry through it), so vmm__close tells
 * the cache first.  Neither of those calls up here, which keeps records.c below the imports.
 * Rules as in records.c: never print, never exit, every failure leaves a one-line reason. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "registry/registry.h"

#include "import/import.h"

/* A -EPROTO from the registry means "not a segment this reader can read": is it a registry of a
 * newer layout (vmm__header_too_new) rather than a corrupt one? */
static bool segment_too_new(const char *name)
{
    int fd = shm_open(name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) return false;
    vmm_reg_header h;
    memset(&h, 0, sizeof h);
    ssize_t n = pread(fd, &h, sizeof h, 0);
    close(fd);
    return n == (ssize_t)sizeof h && vmm__header_too_new(&h);
}

vmm_status vmm__open(const char *name, int mode, vmm_registry **out)
{
    if (!out) return vmm__error(VMM_ERR_INVALID, "%s: %s", "open_mode", "out is NULL");
    *out = NULL;
    if (name && strlen(name) >= sizeof(((vmm__reg *)0)->name))
        return vmm__error(VMM_ERR_INVALID, "registry name is longer than %zu bytes",
                         sizeof(((vmm__reg *)0)->name) - 1);
    vmm_registry *reg = calloc(1, sizeof *reg);
    if (!reg) return vmm__error(VMM_ERR_NOMEM, "registry: out of memory");
    char err[256] = "";
    /* The group only matters for a writer: it lets gc write to a segment shared with a group. */
    const char *group = mode == VMM__REG_READ ? NULL : getenv("VMMSHIM_REGISTRY_GROUP");
    int rc = vmm__reg_open(&reg->r, name, mode, 0, group, err, sizeof err);
    if (rc) {
        bool too_new = rc == -EPROTO && segment_too_new(reg->r.name);
        free(reg);
        return vmm__reg_error(rc, err, too_new);
    }
    *out = reg;
    return VMM_OK;
}

void vmm__close(vmm_registry *reg)
{
    if (!reg) return;
    vmm__import_forget_registry(reg);
    vmm__reg_close(&reg->r);
    free(reg);
}
