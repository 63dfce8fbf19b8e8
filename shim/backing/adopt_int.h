/* What adopt.c and adopt_sleep.c share, for those two files only: the program's own VMM handles
 * and mapped ranges, under one lock.  adopt.c defines the state and stands below adopt_sleep.c
 * (which calls it and never the reverse: tests/scripts/circles.py). */
#ifndef VMM_BACKING_ADOPT_INT_H
#define VMM_BACKING_ADOPT_INT_H
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <uthash.h>

#include "backing/adopt.h"
#include "backing/backing.h"
#include "backing/frames.h"

/* Devices whose access a paused range remembers (the shim's own MAX_DEVICES). */
#define VMM__ADOPT_MAX_DEV 64

typedef struct vmm__adopt_range vmm__adopt_range;

typedef struct vmm__adopt_handle {
    CUmemGenericAllocationHandle handle; /* key: the value the program holds (a stand-in, or the driver's) */
    CUmemGenericAllocationHandle real;   /* the driver's; 0 while paused */
    uint64_t size, chunk_id;
    int dev, exportable;
    int stand_in; /* VMMSHIM_SLEEP_ADOPTED: the program holds a stand-in, the shim the driver's handle */
    int paused;   /* released by vmm_pause: no driver handle until vmm_resume */
    int mark;     /* adopt_sleep.c: chosen by the pause or resume under way */
    int shared;   /* the program exported it itself (vmm__adopt_shared): never paused */
    /* The program's references: 1 at cuMemCreate, +1 each cuMemRetainAllocationHandle, -1 each
     * cuMemRelease.  Without a stand-in only "released" (0) matters, as before.  With one, the
     * driver's handle carries exactly one reference of the shim's while refs > 0, none at 0
     * (its mappings then keep it, as the driver keeps a released handle that is still mapped). */
    unsigned refs;
    unsigned asked_types; /* the handle types the program asked for */
    unsigned n_maps;
    unsigned pins; /* calls using `real` with the lock let go: the broker's export, a translated call */
    uint32_t tag;  /* the creating thread's tag (vmm__tag_current) */
    CUcontext ctx; /* current at cuMemCreate: where a pause waits, copies out and back */
    CUmemAllocationProp prop; /* as made (the added POSIX fd type included): a resume makes the same */
    int broker_fd; /* exported at the first broker request, dup'ed for each after (as a segment's, export.c) */
    vmm__adopt_range *ranges; /* its mapped ranges, through next_of */
    UT_hash_handle hh, hr;    /* by the program's value; by the driver's (stand-ins only) */
} vmm__adopt_handle;

struct vmm__adopt_range {
    uint64_t addr; /* key */
    uint64_t size, offset;
    vmm__adopt_handle *h;
    vmm__adopt_range *next_of; /* the next range of the same handle */
    vmm__frames frames;
    vmm__published pub;
    int unmapping;
    /* while paused: each device's access (CUmemAccess_flags) and the contents (sleep.h's; NULL
     * when discarded) */
    unsigned char access[VMM__ADOPT_MAX_DEV];
    void *kept;
    UT_hash_handle hh, hs; /* by address, by registry slot */
};

typedef struct vmm__adopt_state {
    pthread_mutex_t lock;
    vmm__adopt_handle *handles, *by_real;
    vmm__adopt_range *by_addr, *by_slot;
    uint64_t stand_ins; /* made so far: the next one's number */
    /* the real driver functions (never the shim's wrappers) */
    CUresult (*RetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
    CUresult (*ExportToShareableHandle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
    CUresult (*Release)(CUmemGenericAllocationHandle);
    CUresult (*Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*Unmap)(CUdeviceptr, size_t);
    CUresult (*SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*GetAccess)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*DeviceGetCount)(int *);
} vmm__adopt_state;

extern vmm__adopt_state vmm__A;

/* VMMSHIM_ADOPT and VMMSHIM_SLEEP_ADOPTED (and the shim enabled), read once. */
int vmm__adopt_on(void);
int vmm__adopt_sleeping(void);
/* The driver's functions above resolved (once): 1, or 0 when the driver lacks one. */
int vmm__adopt_load(void);
/* vmm__A.lock held: forget e once nothing holds it (no reference, no mapping, no pin). */
void vmm__adopt_forget_if_done(vmm__adopt_handle *e);
#endif
