/* The one resolver for the real functions underneath the shim (runtime and driver). */
#ifndef VMM_HOOKS_REAL_H
#define VMM_HOOKS_REAL_H
#include <cuda.h>
#include <stdbool.h>

/* glibc's dlsym (the shim exports its own: resolve.c). */
void *vmm__real_dlsym(void *handle, const char *name);
/* The shim's wrapper for a real driver function pointer it wraps, else fn itself. */
void *vmm__wrap_driver_fn(void *fn);

/* A runtime function by name: the next definition after the shim, else the one in whichever
 * libcudart the process loaded privately (Python extensions load it RTLD_LOCAL).  Aborts with a
 * message if it resolves to the shim itself.  NULL if no runtime is loaded. */
void *vmm__real_runtime(const char *name, const void *self);
/* libcuda.so.1, opened once; NULL (with a reason in why) when absent. */
void *vmm__real_libcuda(char *why, unsigned long why_len);
void *vmm__real_driver(const char *name);

/* Calls the shim makes into CUDA pass through the shim's own hooks; this guard tells them. */
bool vmm__in_shim(void);
void vmm__enter(void);
void vmm__leave(void);
#endif
