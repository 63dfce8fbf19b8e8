/* libvmmshim-client: named tensors (vmmshim.h).  The companion side lists the names a living
 * owner publishes, read from its table beside the registry and checked against the records they
 * lie in (shim/registry/names.c; layout.h NAMES).  The owner side's functions are the shim's
 * (shim/hooks/publish.c); the ones here are what a program linked with this library gets when
 * it does not run under the shim: VMM_ERR_NO_SHIM. */
#include "vmmshim.h"
#include "import/import.h"
#include "internal.h"

#include "registry/names.h"

#include <errno.h>
#include <stdbool.h>
#include <string.h>

#define VMM_PUBLIC __attribute__((visibility("default")))

_Static_assert(sizeof(((vmm_tensor_info *)0)->name) == sizeof(((vmm_names_entry *)0)->name), "name size");
_Static_assert(sizeof(((vmm_tensor_info *)0)->shape) == sizeof(((vmm_names_entry *)0)->shape), "shape size");
_Static_assert(sizeof(((vmm_tensor_info *)0)->strides) == sizeof(((vmm_names_entry *)0)->strides), "strides size");
_Static_assert(sizeof(((vmm_tensor_info *)0)->alloc_id) == sizeof(((vmm_names_entry *)0)->alloc_id), "alloc_id size");

#define NEED(cond, what)                                                                          \
    do {                                                                                          \
        if (!(cond)) return vmm__error(VMM_ERR_INVALID, "%s: %s", __func__, what);               \
    } while (0)

static void info_from(vmm_tensor_info *o, uint32_t pid, const vmm_names_entry *e)
{
    memset(o, 0, sizeof *o);
    memcpy(o->name, e->name, sizeof o->name);
    o->name[sizeof o->name - 1] = 0;
    o->pid = pid;
    o->dtype = (vmm_dtype){.code = e->dtype_code, .bits = e->dtype_bits, .lanes = e->dtype_lanes};
    o->ndim = e->ndim;
    o->address = e->address;
    o->nbytes = e->nbytes;
    memcpy(o->shape, e->shape, e->ndim * sizeof o->shape[0]);
    memcpy(o->strides, e->strides, e->ndim * sizeof o->strides[0]);
    memcpy(o->alloc_id, e->alloc_id, sizeof o->alloc_id);
    o->published_ns = e->published_ns;
}

static void shard_from(vmm_tensor_shard *o, const vmm_names_entry *e)
{
    memset(o, 0, sizeof *o);
    o->version = e->version;
    o->shard.mesh_ndim = e->mesh_ndim;
    for (uint32_t i = 0; i < e->mesh_ndim && i < VMM_MESH_MAX_DIMS; i++)
        o->shard.place[i] = (vmm_placement){.kind = e->place_kind[i], .dim = e->place_dim[i], .mesh = e->mesh[i],
                                            .coord = e->coord[i], .global_extent = e->global_extent[i]};
}

typedef struct {
    uint32_t pid;
    vmm_tensor_fn fn;  /* vmm_foreach_tensor */
    void *ctx;
    const char *want;  /* vmm_find_tensor */
    vmm_tensor_info *out;
    bool found;
    vmm_tensor_shard *shards; /* vmm_list_shards */
    uint64_t *slots;          /* vmm__list_tensor_slots */
    size_t max, n;
} tensor_walk;

static int visit(void *ctx, const vmm_names_entry *e)
{
    tensor_walk *w = ctx;
    if (w->shards || w->slots) {
        if (w->n < w->max) {
            info_from(&w->out[w->n], w->pid, e);
            if (w->shards) shard_from(&w->shards[w->n], e);
            if (w->slots) w->slots[w->n] = e->rec_slot;
        }
        w->n++;
        return 0;
    }
    if (w->want) {
        if (strcmp(e->name, w->want) != 0) return 0;
        info_from(w->out, w->pid, e);
        w->found = true;
        return 1;
    }
    vmm_tensor_info info;
    info_from(&info, w->pid, e);
    return w->fn(w->ctx, &info);
}

/* pid's table mapped into *m; VMM_OK with m->hdr NULL when it publishes no names. */
static vmm_status open_table(vmm_registry *reg, const char *fn, uint32_t pid, vmm__names_map *m)
{
    memset(m, 0, sizeof *m);
    vmm_proc_info p;
    if (vmm__find_proc_identity(reg, pid, &p) != VMM_OK)
        return vmm__error(VMM_ERR_NOT_FOUND,
                          "%s: pid %u has no record in registry %s (it does not run under the shim, or publishes in "
                          "another registry)",
                          fn, pid, reg->r.name);
    if (p.alive == VMM_OWNER_DEAD)
        return vmm__error(VMM_ERR_OWNER_DEAD, "%s: pid %u has exited; its names went with it", fn, pid);
    char why[300];
    int rc = vmm__names_open(&reg->r, pid, p.start_time, m, why, sizeof why);
    if (rc == -ENOENT) {
        m->hdr = NULL; /* it publishes no names */
        return VMM_OK;
    }
    if (rc) {
        vmm_status st = rc == -ENOTSUP  ? VMM_ERR_VERSION
                        : rc == -EPROTO ? VMM_ERR_CORRUPT
                        : rc == -EAGAIN ? VMM_ERR_BUSY
                                        : vmm__status_of(rc, false);
        return vmm__error(st, "%s: pid %u: %s", fn, pid, why);
    }
    return VMM_OK;
}

static vmm_status walk(vmm_registry *reg, const char *fn, uint32_t pid, tensor_walk *w)
{
    vmm__names_map m;
    vmm_status st = open_table(reg, fn, pid, &m);
    if (st != VMM_OK || !m.hdr) return st;
    w->pid = pid;
    int rc = vmm__names_for_each(&reg->r, &m, visit, w);
    vmm__names_close(&m);
    if (rc) return vmm__error(VMM_ERR_NOMEM, "%s: out of memory", fn);
    return VMM_OK;
}

VMM_PUBLIC vmm_status vmm_foreach_tensor(vmm_registry *reg, uint32_t pid, vmm_tensor_fn fn, void *ctx)
{
    NEED(reg, "reg is NULL");
    NEED(fn, "fn is NULL");
    NEED(pid != 0, "pid is 0");
    tensor_walk w = {.fn = fn, .ctx = ctx};
    return walk(reg, "vmm_foreach_tensor", pid, &w);
}

VMM_PUBLIC vmm_status vmm_find_tensor(vmm_registry *reg, uint32_t pid, const char *name, vmm_tensor_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(name, "name is NULL");
    NEED(out, "out is NULL");
    NEED(pid != 0, "pid is 0");
    tensor_walk w = {.want = name, .out = out};
    vmm_status st = walk(reg, "vmm_find_tensor", pid, &w);
    if (st == VMM_OK && !w.found)
        return vmm__error(VMM_ERR_NOT_FOUND, "vmm_find_tensor: pid %u publishes no tensor named \"%.*s\"", pid,
                          VMM_NAME_MAX, name);
    return st;
}

typedef struct tensor_list {
    vmm_tensor_info *out;
    size_t max, n;
} tensor_list;

static int list_one(void *ctx, const vmm_tensor_info *t)
{
    tensor_list *l = ctx;
    if (l->n < l->max) l->out[l->n] = *t;
    l->n++;
    return 0;
}

VMM_PUBLIC vmm_status vmm_list_tensors(vmm_registry *reg, uint32_t pid, vmm_tensor_info *out, size_t max, size_t *n)
{
    NEED(n, "n is NULL");
    *n = 0;
    NEED(out || max == 0, "out is NULL");
    tensor_list l = {.out = out, .max = max};
    vmm_status st = vmm_foreach_tensor(reg, pid, list_one, &l);
    *n = l.n;
    return st;
}

VMM_PUBLIC vmm_status vmm_list_shards(vmm_registry *reg, uint32_t pid, vmm_tensor_info *out, vmm_tensor_shard *shards,
                                      size_t max, size_t *n)
{
    NEED(n, "n is NULL");
    *n = 0;
    NEED(reg, "reg is NULL");
    NEED(pid != 0, "pid is 0");
    NEED((out && shards) || max == 0, "out or shards is NULL");
    vmm_tensor_shard none;
    tensor_walk w = {.out = out, .shards = max ? shards : &none, .max = max};
    vmm_status st = walk(reg, "vmm_list_shards", pid, &w);
    *n = w.n;
    return st;
}

vmm_status vmm__list_tensor_slots(vmm_registry *reg, uint32_t pid, vmm_tensor_info *out, uint64_t *slots, size_t max,
                                  size_t *n)
{
    uint64_t none;
    tensor_walk w = {.out = out, .slots = max ? slots : &none, .max = max};
    vmm_status st = walk(reg, "vmm_import_tensors_begin", pid, &w);
    *n = w.n;
    return st;
}

VMM_PUBLIC vmm_status vmm_weights_state(vmm_registry *reg, uint32_t pid, vmm_weights_info *out)
{
    NEED(reg, "reg is NULL");
    NEED(out, "out is NULL");
    NEED(pid != 0, "pid is 0");
    memset(out, 0, sizeof *out);
    vmm__names_map m;
    vmm_status st = open_table(reg, "vmm_weights_state", pid, &m);
    if (st != VMM_OK || !m.hdr) return st;
    vmm__names_state(&m, &out->seq, &out->version, out->job);
    vmm__names_close(&m);
    return VMM_OK;
}

/* ---- the owner side, without the shim ---- */

#define NO_SHIM(fn)                                                                                                  \
    vmm__error(VMM_ERR_NO_SHIM, "%s: not running under the shim (start the program with LD_PRELOAD=libvmmshim.so)", fn)

VMM_PUBLIC vmm_status vmm_publish(const char *name, uint64_t address, vmm_dtype dtype, uint32_t ndim, const int64_t *shape,
                                  const int64_t *strides)
{
    (void)name, (void)address, (void)dtype, (void)ndim, (void)shape, (void)strides;
    return NO_SHIM("vmm_publish");
}

VMM_PUBLIC vmm_status vmm_publish_many(const vmm_tensor_desc *tensors, size_t n)
{
    (void)tensors, (void)n;
    return NO_SHIM("vmm_publish_many");
}

VMM_PUBLIC vmm_status vmm_unpublish(const char *name)
{
    (void)name;
    return NO_SHIM("vmm_unpublish");
}

VMM_PUBLIC vmm_status vmm_publish_shards(const vmm_tensor_desc *tensors, const vmm_shard *shards, size_t n, uint64_t version)
{
    (void)tensors, (void)shards, (void)n, (void)version;
    return NO_SHIM("vmm_publish_shards");
}

VMM_PUBLIC vmm_status vmm_publish_job(const char *job)
{
    (void)job;
    return NO_SHIM("vmm_publish_job");
}

VMM_PUBLIC vmm_status vmm_update_begin(void) { return NO_SHIM("vmm_update_begin"); }

VMM_PUBLIC vmm_status vmm_update_end(uint64_t version, void *stream)
{
    (void)version, (void)stream;
    return NO_SHIM("vmm_update_end");
}

VMM_PUBLIC const char *vmm_publish_error(void) { return vmm__error_text(); }

VMM_PUBLIC const char *vmm_set_thread_tag(const char *tag)
{
    (void)tag;
    NO_SHIM("vmm_set_thread_tag");
    return NULL;
}

VMM_PUBLIC const char *vmm_thread_tag(void) { return NULL; }

VMM_PUBLIC vmm_status vmm_pause_ex(const char *tag, unsigned flags, vmm_sleep_report *report, size_t report_size)
{
    (void)tag, (void)flags, (void)report, (void)report_size;
    return NO_SHIM("vmm_pause");
}

VMM_PUBLIC vmm_status vmm_resume_ex(const char *tag, vmm_sleep_report *report, size_t report_size)
{
    (void)tag, (void)report, (void)report_size;
    return NO_SHIM("vmm_resume");
}

VMM_PUBLIC vmm_status vmm_pause(const char *tag, unsigned flags) { return vmm_pause_ex(tag, flags, NULL, 0); }

VMM_PUBLIC vmm_status vmm_resume(const char *tag) { return vmm_resume_ex(tag, NULL, 0); }

VMM_PUBLIC vmm_status vmm_pause_prepare(const char *tag, uint64_t *bytes_ready)
{
    (void)tag;
    if (bytes_ready) *bytes_ready = 0;
    return NO_SHIM("vmm_pause_prepare");
}

VMM_PUBLIC int vmm_paused_overlaps(const uint64_t *starts, const uint64_t *sizes, size_t n)
{
    (void)starts, (void)sizes, (void)n;
    return 0;
}

VMM_PUBLIC vmm_status vmm_sleep_host(uint64_t addr, void **host, uint64_t *bytes)
{
    (void)addr;
    if (host) *host = NULL;
    if (bytes) *bytes = 0;
    return NO_SHIM("vmm_sleep_host");
}

VMM_PUBLIC uint64_t vmm_sleep_drop_host(const char *tag)
{
    (void)tag;
    return 0;
}

VMM_PUBLIC uint64_t vmm_give_back(void) { return 0; }

VMM_PUBLIC void vmm_set_alloc_margin(uint64_t bytes) { (void)bytes; }

VMM_PUBLIC void vmm_tms_entries(int (*pause)(const char *), int (*resume)(const char *)) { (void)pause, (void)resume; }

VMM_PUBLIC const char *vmm_sleep_error(void) { return vmm__error_text(); }
