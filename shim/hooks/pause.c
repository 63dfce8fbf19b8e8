/* Sleep and wake, the owner side (vmmshim.h: vmm_pause, vmm_resume, their _ex forms and
 * vmm_sleep_error), exported by the shim beside vmm_publish, and the hand-over of the control
 * function that serves them from outside (below).  Forwarding only: the mechanism is
 * shim/backing/sleep.c's.  The client library defines the same names, answering VMM_ERR_NO_SHIM;
 * a preloaded shim's come first in symbol lookup. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/vmm_api.h"
#include "backing/internal.h"
#include "backing/sleep.h"
#include "core/options.h"

#define VMM_HOOK __attribute__((visibility("default")))

static _Thread_local char last_error[512];

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static vmm_status status_of(int rc)
{
    switch (-rc) {
    case 0: return VMM_OK;
    case ENODEV: return VMM_ERR_NO_SHIM;
    case EINVAL: return VMM_ERR_INVALID;
    case ENOENT: return VMM_ERR_NOT_FOUND;
    case EALREADY: return VMM_ERR_STATE;
    case EBUSY: return VMM_ERR_BUSY;
    case ENOSPC:
    case ENOMEM: return VMM_ERR_NOMEM;
    default: return VMM_ERR_IO;
    }
}

/* The caller's report gets the first report_size bytes of ours: a caller built against a shorter,
 * older struct gets the fields it knows. */
static vmm_status finish(const char *fn, int rc, const char *why, const vmm__sleep_out *o, uint64_t t0,
                         vmm_sleep_report *report, size_t report_size)
{
    if (rc) snprintf(last_error, sizeof last_error, "%s: %s", fn, why);
    else last_error[0] = 0;
    if (report && report_size) {
        vmm_sleep_report r = {.bytes_released = o->released, .bytes_kept = o->kept, .bytes_not_shim = o->not_shim,
                              .ns = now_ns() - t0, .segments = o->segments, .allocations = o->allocations,
                              .bytes_held = o->held, .n_holders = o->n_holders};
        memcpy(r.holders, o->holders, sizeof r.holders);
        memcpy(report, &r, report_size < sizeof r ? report_size : sizeof r);
    }
    return status_of(rc);
}

VMM_HOOK vmm_status vmm_pause_ex(const char *tag, unsigned flags, vmm_sleep_report *report, size_t report_size)
{
    uint64_t t0 = now_ns();
    vmm__sleep_out o;
    char why[400];
    int rc = vmm__sleep_pause(tag, flags, &o, why, sizeof why);
    return finish("vmm_pause", rc, why, &o, t0, report, report_size);
}

VMM_HOOK vmm_status vmm_resume_ex(const char *tag, vmm_sleep_report *report, size_t report_size)
{
    uint64_t t0 = now_ns();
    vmm__sleep_out o;
    char why[400];
    int rc = vmm__sleep_resume(tag, &o, why, sizeof why);
    return finish("vmm_resume", rc, why, &o, t0, report, report_size);
}

VMM_HOOK vmm_status vmm_pause(const char *tag, unsigned flags) { return vmm_pause_ex(tag, flags, NULL, 0); }

VMM_HOOK vmm_status vmm_resume(const char *tag) { return vmm_resume_ex(tag, NULL, 0); }

VMM_HOOK vmm_status vmm_pause_prepare(const char *tag, uint64_t *bytes_ready)
{
    int64_t ready = vmm__sleep_prepare(tag);
    if (bytes_ready) *bytes_ready = ready > 0 ? (uint64_t)ready : 0;
    if (ready < 0) snprintf(last_error, sizeof last_error, "vmm_pause_prepare: the shim is not active in this process");
    else last_error[0] = 0;
    return status_of(ready < 0 ? (int)ready : 0);
}

VMM_HOOK int vmm_paused_overlaps(const uint64_t *starts, const uint64_t *sizes, size_t n)
{
    return starts && sizes ? vmm__sleep_overlaps(starts, sizes, n) : 0;
}

VMM_HOOK vmm_status vmm_sleep_host(uint64_t addr, void **host, uint64_t *bytes)
{
    if (!host || !bytes) return VMM_ERR_INVALID;
    return status_of(vmm__sleep_host(addr, host, bytes));
}

VMM_HOOK uint64_t vmm_sleep_drop_host(const char *tag) { return vmm__sleep_drop_host(tag); }

VMM_HOOK const char *vmm_sleep_error(void) { return last_error; }

/* Not sleep, but the same wish: memory back to the device now, for a program that just emptied
 * its own cache (the stand-in for torch_memory_saver, once every tag sleeps). */
VMM_HOOK uint64_t vmm_give_back(void) { return vmm__give_back_now(); }

VMM_HOOK void vmm_set_alloc_margin(uint64_t bytes) { vmm__set_alloc_margin(bytes); }

/* torch_memory_saver's two C entry points, which its callers reach through the process's symbols
 * (ctypes.CDLL(None).tms_pause).  vmmshim's stand-in for its Python module hands in its own pause
 * and resume (vmm_tms_entries), so that a C caller pauses exactly what a Python one would.  Before
 * that, the only memory TMS would own is what TMS_INIT_ENABLE=1 puts under its "default" tag: this
 * process's untagged memory, kept when TMS_INIT_ENABLE_CPU_BACKUP=1.  0, or -1 with the reason in
 * vmm_sleep_error. */
typedef int (*tms_entry_fn)(const char *);
static tms_entry_fn tms_entry[2];

VMM_HOOK void vmm_tms_entries(tms_entry_fn pause, tms_entry_fn resume)
{
    __atomic_store_n(&tms_entry[0], pause, __ATOMIC_RELEASE);
    __atomic_store_n(&tms_entry[1], resume, __ATOMIC_RELEASE);
}

static int env_is_1(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "1") == 0;
}

static int tms_call(int which, const char *tag)
{
    tms_entry_fn f = __atomic_load_n(&tms_entry[which], __ATOMIC_ACQUIRE);
    if (f) return f(tag);
    if (!env_is_1("TMS_INIT_ENABLE") || (tag && *tag && strcmp(tag, "default") != 0)) return 0;
    const char *untagged = vmm__opt_str(VMM__OPT_TAG);
    vmm_status s = which ? vmm_resume(untagged)
                         : vmm_pause(untagged, env_is_1("TMS_INIT_ENABLE_CPU_BACKUP") ? 0 : VMM_PAUSE_DISCARD);
    return s == VMM_OK || s == VMM_ERR_STATE || s == VMM_ERR_NOT_FOUND ? 0 : -1;
}

VMM_HOOK int tms_pause(const char *tag) { return tms_call(0, tag); }

VMM_HOOK int tms_resume(const char *tag) { return tms_call(1, tag); }

/* Pause and resume from outside (vmmctl pause, vmm_pause_process) come through the broker, which
 * needs the backing's control function before its first request.  A constructor sets it (one
 * atomic store, no CUDA call, nothing read), so the allocation path gains no check for it;
 * whether the process accepts such requests is decided when one comes (VMMSHIM_REMOTE_PAUSE). */
__attribute__((constructor)) static void serve_remote(void) { vmm__sleep_serve_remote(); }
