/* The owner side of named tensors (vmmshim.h: vmm_publish, vmm_publish_many, vmm_unpublish,
 * vmm_publish_error), exported by the shim so that a program running under it, or Python through
 * ctypes.CDLL(None), can name its tensors.  Forwarding only: the table is shim/registry/names.c's,
 * in the registry this process publishes in (backing's).  The client library defines the same
 * names, answering VMM_ERR_NO_SHIM; a preloaded shim's come first in symbol lookup, so a program
 * linked with the client library reaches these when it runs under the shim. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/vmm_api.h"
#include "backing/backing.h"
#include "backing/preexport.h"
#include "registry/names.h"

#define VMM_HOOK __attribute__((visibility("default")))

/* the table's limits are the header's */
_Static_assert(sizeof(((vmm_tensor_desc *)0)->dtype) == 4 && VMM_NAME_MAX == VMM_NAMES_NAME_MAX &&
                   VMM_MAX_DIMS == VMM_NAMES_MAX_DIMS,
               "public limits match the table's");

static _Thread_local char last_error[512];

static vmm_status fail(vmm_status st, const char *fn, const char *why)
{
    snprintf(last_error, sizeof last_error, "%s: %s", fn, why);
    for (char *p = last_error; *p; p++) /* one line, whatever a name held */
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = ' ';
    return st;
}

static vmm_status status_of(int rc)
{
    switch (-rc) {
    case 0: return VMM_OK;
    case EINVAL: return VMM_ERR_INVALID;
    case ENOENT: return VMM_ERR_NOT_FOUND;
    case EACCES: return VMM_ERR_ACCESS;
    case EAGAIN: return VMM_ERR_BUSY;
    case ENOSPC:
    case ENOMEM: return VMM_ERR_NOMEM;
    default: return VMM_ERR_IO;
    }
}

static vmm__reg *registry_or_fail(const char *fn)
{
    vmm__reg *r = vmm__registry();
    if (!r)
        fail(VMM_ERR_NO_SHIM, fn,
             "the shim is not active in this process (VMMSHIM_ENABLE=0, or it could not start: see its warning)");
    return r;
}

/* The owner wants these taken: the broker exports the segments under them in the background
 * (shim/backing/preexport.c), so a companion's first take pays no export.  They were checked. */
static void want_exported(const vmm_tensor_desc *t, size_t n)
{
    uint64_t one_addr, one_len, *addr = n == 1 ? &one_addr : malloc(n * sizeof *addr),
                                *len = n == 1 ? &one_len : malloc(n * sizeof *len);
    if (addr && len) {
        for (size_t i = 0; i < n; i++) {
            uint32_t item = (uint32_t)t[i].dtype.bits * t[i].dtype.lanes / 8;
            int64_t contiguous[VMM_MAX_DIMS], step = 1;
            for (uint32_t k = t[i].ndim; k-- > 0;) {
                contiguous[k] = step;
                step *= t[i].shape[k] ? t[i].shape[k] : 1;
            }
            addr[i] = t[i].address;
            len[i] = vmm__names_span(item, t[i].ndim, t[i].shape, t[i].strides ? t[i].strides : contiguous);
        }
        vmm__preexport_want(addr, len, n);
    }
    if (addr != &one_addr) free(addr);
    if (len != &one_len) free(len);
}

_Static_assert(VMM_MESH_MAX_DIMS == VMM_NAMES_MESH_MAX_DIMS && (int)VMM_PLACE_SHARD == (int)VMM_NAMES_PLACE_SHARD &&
                   (int)VMM_PLACE_PARTIAL == (int)VMM_NAMES_PLACE_PARTIAL &&
                   (int)VMM_PLACE_REPLICATE == (int)VMM_NAMES_PLACE_REPLICATE,
               "public placements match the table's");

static vmm__name_shard shard_of(const vmm_shard *s)
{
    vmm__name_shard o = {.mesh_ndim = s->mesh_ndim > 255 ? 255 : (uint8_t)s->mesh_ndim};
    for (uint32_t i = 0; i < VMM_MESH_MAX_DIMS && i < s->mesh_ndim; i++) {
        o.kind[i] = s->place[i].kind;
        o.dim[i] = s->place[i].dim;
        o.mesh[i] = s->place[i].mesh;
        o.coord[i] = s->place[i].coord;
        o.global_extent[i] = s->place[i].global_extent;
    }
    return o;
}

static vmm_status publish(const char *fn, const vmm_tensor_desc *t, const vmm_shard *shards, size_t n, uint64_t version)
{
    if (n && !t) return fail(VMM_ERR_INVALID, fn, "tensors is NULL");
    vmm__reg *r = registry_or_fail(fn);
    if (!r) return VMM_ERR_NO_SHIM;
    vmm__name_desc one, *d = n == 1 ? &one : calloc(n ? n : 1, sizeof *d);
    vmm__name_shard one_shard, *sh = !shards ? NULL : n == 1 ? &one_shard : calloc(n, sizeof *sh);
    if (!d || (shards && !sh)) {
        if (d != &one) free(d);
        return fail(VMM_ERR_NOMEM, fn, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        d[i] = (vmm__name_desc){.name = t[i].name, .address = t[i].address, .code = t[i].dtype.code,
                                .bits = t[i].dtype.bits, .lanes = t[i].dtype.lanes, .ndim = t[i].ndim,
                                .shape = t[i].shape, .strides = t[i].strides, .version = version};
        if (shards && shards[i].mesh_ndim) {
            sh[i] = shard_of(&shards[i]);
            d[i].shard = &sh[i];
        }
    }
    char why[400];
    int rc = vmm__names_publish(r, d, n, why, sizeof why);
    if (d != &one) free(d);
    if (sh != &one_shard) free(sh);
    if (rc) return fail(status_of(rc), fn, why);
    want_exported(t, n);
    return VMM_OK;
}

VMM_HOOK vmm_status vmm_publish(const char *name, uint64_t address, vmm_dtype dtype, uint32_t ndim, const int64_t *shape,
                                const int64_t *strides)
{
    vmm_tensor_desc t = {.name = name, .address = address, .dtype = dtype, .ndim = ndim, .shape = shape, .strides = strides};
    return publish("vmm_publish", &t, NULL, 1, 0);
}

VMM_HOOK vmm_status vmm_publish_many(const vmm_tensor_desc *tensors, size_t n)
{
    return publish("vmm_publish_many", tensors, NULL, n, 0);
}

VMM_HOOK vmm_status vmm_publish_shards(const vmm_tensor_desc *tensors, const vmm_shard *shards, size_t n, uint64_t version)
{
    return publish("vmm_publish_shards", tensors, shards, n, version);
}

/* A names.c call's result as the public API answers it: rc 0, or its reason (why) for fn. */
static vmm_status answer(const char *fn, int rc, const char *why) { return rc ? fail(status_of(rc), fn, why) : VMM_OK; }

VMM_HOOK vmm_status vmm_publish_job(const char *job)
{
    vmm__reg *r = registry_or_fail("vmm_publish_job");
    char why[400];
    return r ? answer("vmm_publish_job", vmm__names_set_job(r, job, why, sizeof why), why) : VMM_ERR_NO_SHIM;
}

VMM_HOOK vmm_status vmm_update_begin(void)
{
    vmm__reg *r = registry_or_fail("vmm_update_begin");
    char why[400];
    return r ? answer("vmm_update_begin", vmm__names_update_begin(r, why, sizeof why), why) : VMM_ERR_NO_SHIM;
}

static void CUDA_CB update_reached(void *version)
{
    vmm__reg *r = vmm__registry();
    if (r) vmm__names_update_end(r, (uint64_t)(uintptr_t)version);
}

VMM_HOOK vmm_status vmm_update_end(uint64_t version, void *stream)
{
    _Static_assert(sizeof(uintptr_t) >= sizeof(uint64_t), "a version travels in the host function's pointer");
    vmm__reg *r = registry_or_fail("vmm_update_end");
    if (!r) return VMM_ERR_NO_SHIM;
    int rc = vmm__when_reached(stream, update_reached, (void *)(uintptr_t)version);
    if (rc)
        return fail(VMM_ERR_IO, "vmm_update_end",
                    "the driver refused to call back when the stream reaches this point: the update stays open");
    return VMM_OK;
}

VMM_HOOK vmm_status vmm_unpublish(const char *name)
{
    vmm__reg *r = registry_or_fail("vmm_unpublish");
    char why[400];
    return r ? answer("vmm_unpublish", vmm__names_unpublish(r, name, why, sizeof why), why) : VMM_ERR_NO_SHIM;
}

VMM_HOOK const char *vmm_publish_error(void) { return last_error; }

VMM_HOOK const char *vmm_set_thread_tag(const char *tag)
{
    int rc;
    const char *was = vmm__thread_tag_set(tag, &rc);
    if (rc == -1) fail(VMM_ERR_INVALID, "vmm_set_thread_tag", "a tag is at most 31 bytes; the thread keeps its tag");
    else if (rc) fail(VMM_ERR_NOMEM, "vmm_set_thread_tag", "a process names at most 32 thread tags; the thread keeps its tag");
    return was;
}

VMM_HOOK const char *vmm_thread_tag(void) { return vmm__thread_tag_get(); }
