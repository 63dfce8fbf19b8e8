/* vmmctl list --names: the tensors living processes publish by name (vmmshim.h, named tensors),
 * one row each, sorted by name within a process.  Processes that publish none have no row; a
 * dead owner's names are never shown (they went with it). */
#include "format.h"
#include "vmmctl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    vmm_tensor_info t;
    vmm_tensor_shard s;
} row;

typedef struct {
    vmm_registry *reg;
    uint32_t pid; /* 0: every process */
    bool json;
    uint64_t rows, bytes;
    unsigned procs;
    int rc;
} names_ctx;

/* dtype as its usual name (bfloat16, float8_e4m3fn), lanes as a suffix (float32x4). */
static const char *dtype_name(vmm_dtype d, char *buf, size_t len)
{
    const char *kind = NULL;
    switch (d.code) {
    case VMM_DTYPE_INT: kind = "int"; break;
    case VMM_DTYPE_UINT: kind = "uint"; break;
    case VMM_DTYPE_FLOAT: kind = "float"; break;
    case VMM_DTYPE_BFLOAT: kind = "bfloat"; break;
    case VMM_DTYPE_COMPLEX: kind = "complex"; break;
    case VMM_DTYPE_BOOL: kind = "bool"; break;
    case VMM_DTYPE_FLOAT8_E4M3FN: kind = "float8_e4m3fn"; break;
    case VMM_DTYPE_FLOAT8_E5M2: kind = "float8_e5m2"; break;
    }
    int n;
    if (!kind)
        n = snprintf(buf, len, "dlpack(%u,%u)", d.code, d.bits);
    else if (d.code == VMM_DTYPE_BOOL || d.code >= VMM_DTYPE_FLOAT8_E4M3FN)
        n = snprintf(buf, len, "%s", kind);
    else
        n = snprintf(buf, len, "%s%u", kind, d.bits);
    if (d.lanes > 1 && n > 0 && (size_t)n < len) snprintf(buf + n, len - (size_t)n, "x%u", d.lanes);
    return buf;
}

/* "4096x1024" (sep "x") or "4096, 1024" (sep ", "); a scalar is "-" or "". */
static const char *dims_text(const int64_t *v, uint32_t n, const char *sep, const char *none, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = 0;
    for (uint32_t i = 0; i < n && at < len; i++) {
        int k = snprintf(buf + at, len - at, "%s%lld", i ? sep : "", (long long)v[i]);
        if (k < 0) break;
        at += (size_t)k;
    }
    return n ? buf : none;
}

static bool row_major(const vmm_tensor_info *t)
{
    int64_t step = 1;
    for (uint32_t i = t->ndim; i-- > 0;) {
        if (t->shape[i] > 1 && t->strides[i] != step) return false;
        step *= t->shape[i];
    }
    return true;
}

static int by_name(const void *a, const void *b) { return strcmp(((const row *)a)->t.name, ((const row *)b)->t.name); }

/* "Shard(0) 1/2" per mesh dimension, then " of 4096" per split: where the piece lies in the whole. */
static const char *place_text(const vmm_shard *sh, bool json, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = 0;
    for (uint32_t i = 0; i < sh->mesh_ndim && i < VMM_MESH_MAX_DIMS && at < len; i++) {
        const vmm_placement *p = &sh->place[i];
        char kind[24];
        if (p->kind == VMM_PLACE_SHARD) snprintf(kind, sizeof kind, "Shard(%u)", p->dim);
        else snprintf(kind, sizeof kind, "%s", p->kind == VMM_PLACE_REPLICATE ? "Replicate" : p->kind == VMM_PLACE_PARTIAL ? "Partial" : "?");
        int k = json ? snprintf(buf + at, len - at, "%s{\"placement\": \"%s\", \"mesh\": %u, \"coord\": %u, \"global_extent\": %lld}",
                                i ? ", " : "", kind, p->mesh, p->coord, (long long)p->global_extent)
                     : p->kind == VMM_PLACE_SHARD
                         ? snprintf(buf + at, len - at, "%s%s %u/%u of %lld", i ? ", " : "", kind, p->coord, p->mesh, (long long)p->global_extent)
                         : snprintf(buf + at, len - at, "%s%s %u/%u", i ? ", " : "", kind, p->coord, p->mesh);
        if (k < 0) break;
        at += (size_t)k;
    }
    return buf;
}

static void print_row(names_ctx *c, const row *r)
{
    const vmm_tensor_info *t = &r->t;
    char dt[32], shape[256], strides[256], place[300];
    dtype_name(t->dtype, dt, sizeof dt);
    if (c->json) {
        char id[33];
        vmm__ctl_hex(t->alloc_id, sizeof t->alloc_id, id);
        printf("%s\n  {\"pid\": %u, \"name\": ", c->rows ? "," : "", t->pid);
        vmm__ctl_json_str(stdout, t->name);
        printf(", \"dtype\": \"%s\", \"dtype_code\": %u, \"dtype_bits\": %u, \"dtype_lanes\": %u, \"shape\": [%s], "
               "\"strides\": [%s], \"address\": %llu, \"address_hex\": \"0x%llx\", \"nbytes\": %llu, \"alloc_id\": \"%s\", "
               "\"published_ns\": %llu, \"version\": %llu, \"shard\": [%s]}",
               dt, t->dtype.code, t->dtype.bits, t->dtype.lanes, dims_text(t->shape, t->ndim, ", ", "", shape, sizeof shape),
               dims_text(t->strides, t->ndim, ", ", "", strides, sizeof strides), (unsigned long long)t->address,
               (unsigned long long)t->address, (unsigned long long)t->nbytes, id, (unsigned long long)t->published_ns,
               (unsigned long long)r->s.version, place_text(&r->s.shard, true, place, sizeof place));
    } else {
        char name[sizeof t->name], cell[300];
        hbuf size;
        dims_text(t->shape, t->ndim, "x", "-", shape, sizeof shape);
        if (row_major(t)) snprintf(cell, sizeof cell, "%s", t->ndim ? shape : "-");
        else snprintf(cell, sizeof cell, "%s (strides %s)", shape, dims_text(t->strides, t->ndim, "x", "-", strides, sizeof strides));
        printf("%7u %-40s %-14s %-24s 0x%012llx %10s %s\n", t->pid, vmm__ctl_cell(t->name, name, sizeof name), dt, cell,
               (unsigned long long)t->address, vmm__ctl_human(t->nbytes, &size),
               r->s.shard.mesh_ndim ? place_text(&r->s.shard, false, place, sizeof place) : "-");
    }
    c->rows++;
    c->bytes += t->nbytes;
}

static int one_process(names_ctx *c, uint32_t pid, bool asked)
{
    size_t room = 64, n = 0;
    vmm_tensor_info *t = NULL;
    vmm_tensor_shard *sh = NULL;
    row *rows = NULL;
    vmm_status st;
    for (;;) { /* again with room for more when the names outgrew the arrays */
        free(t), free(sh);
        t = malloc(room * sizeof *t), sh = malloc(room * sizeof *sh);
        if (!t || !sh) {
            st = VMM_ERR_NOMEM;
            break;
        }
        st = vmm_list_shards(c->reg, pid, t, sh, room, &n);
        if (st != VMM_OK || n <= room) break;
        room = n + 64;
    }
    if (st == VMM_OK && n && !(rows = malloc(n * sizeof *rows))) st = VMM_ERR_NOMEM;
    /* a process seen in the listing that exits before its names are read had none to show */
    if (st == VMM_ERR_OWNER_DEAD && !asked) st = VMM_OK, n = 0;
    if (st != VMM_OK) c->rc = vmm__ctl_api_error(st);
    for (size_t i = 0; st == VMM_OK && i < n; i++) rows[i] = (row){.t = t[i], .s = sh[i]};
    if (st == VMM_OK && n) {
        qsort(rows, n, sizeof *rows, by_name);
        for (size_t i = 0; i < n; i++) print_row(c, &rows[i]);
        c->procs++;
    }
    free(t), free(sh), free(rows);
    return 0;
}

static int proc_visit(void *ctx, const vmm_proc_info *p)
{
    names_ctx *c = ctx;
    if (p->alive == VMM_OWNER_DEAD) return 0;
    return one_process(c, p->pid, false);
}

int vmm__ctl_list_names(uint32_t pid, bool json)
{
    names_ctx c = {.pid = pid, .json = json};
    int rc = vmm__ctl_open_registry(&c.reg, false);
    if (rc) return rc;
    if (json)
        putchar('[');
    else
        printf("%7s %-40s %-14s %-24s %-14s %10s %s\n", "PID", "NAME", "DTYPE", "SHAPE", "ADDRESS", "SIZE", "PLACE");
    if (pid) {
        one_process(&c, pid, true);
    } else {
        vmm_status st = vmm_foreach_proc(c.reg, proc_visit, &c);
        if (st != VMM_OK) c.rc = vmm__ctl_api_error(st);
    }
    vmm_close(c.reg);
    if (json) {
        printf("%s]\n", c.rows ? "\n" : "");
    } else {
        hbuf b;
        printf("%llu name%s in %u process%s, %s\n", (unsigned long long)c.rows, c.rows == 1 ? "" : "s", c.procs,
               c.procs == 1 ? "" : "es", vmm__ctl_human(c.bytes, &b));
    }
    if (fflush(stdout) != 0) return vmm__ctl_error("writing the output: %s", strerror(errno));
    return c.rc;
}
