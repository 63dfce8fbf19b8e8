/* The one resolver for the real functions underneath the shim (runtime and driver). */
#ifndef VMM_HOOKS_REAL_H
#define VMM_HOOKS_REAL_H
#include <cuda.h>
#include <stdbool.h>
#include <string.h>

/* glibc's dlsym (the shim exports its own: resolve.c).  Safe before the sanitizers' runtimes
 * are ready. */
void *vmm__real_dlsym(void *handle, const char *name);

/* A runtime function by name: the next definition after the shim, else the one in whichever
 * libcudart the process loaded privately (Python extensions load it RTLD_LOCAL).  Aborts with a
 * message if it resolves to the shim itself.  NULL if no runtime is loaded. */
void *vmm__real_runtime(const char *name, const void *self);
/* libcuda.so.1, opened once; NULL (with a reason in why) when absent. */
void *vmm__real_libcuda(char *why, unsigned long why_len);
void *vmm__real_driver(const char *name);

/* A real function looked up once into *slot, NULL when there is none: the slot is read and
 * written atomically, as threads may race to look it up first (and all find the same pointer).
 * vmm__real_runtime_once takes the hook's own address, as vmm__real_runtime does. */
static inline void *vmm__real_driver_once(void **slot, const char *name)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!p && (p = vmm__real_driver(name))) __atomic_store_n(slot, p, __ATOMIC_RELEASE);
    return p;
}

static inline void *vmm__real_runtime_once(void **slot, const char *name, const void *self)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!p && (p = vmm__real_runtime(name, self))) __atomic_store_n(slot, p, __ATOMIC_RELEASE);
    return p;
}

/* Inside a hook: `real_`, the real function of the hook's own name, resolved once (a runtime
 * name through vmm__real_runtime, a driver ABI name in libcuda.so.1); the hook returns `none`
 * when there is none.  memcpy moves pointers between function and object types, which ISO C
 * does not convert. */
#define VMM_REAL_RUNTIME(name, none)                                                                  \
    static void *real_slot_;                                                                          \
    __typeof__(&name) real_;                                                                          \
    {                                                                                                 \
        __typeof__(&name) self_ = name;                                                               \
        void *self_obj_, *found_;                                                                     \
        memcpy(&self_obj_, &self_, sizeof self_obj_);                                                 \
        found_ = vmm__real_runtime_once(&real_slot_, #name, self_obj_);                               \
        memcpy(&real_, &found_, sizeof found_);                                                       \
    }                                                                                                 \
    if (!real_) return none

#define VMM_REAL_DRIVER(name, none)                                                                   \
    static void *real_slot_;                                                                          \
    __typeof__(&name) real_;                                                                          \
    {                                                                                                 \
        void *found_ = vmm__real_driver_once(&real_slot_, #name);                                     \
        memcpy(&real_, &found_, sizeof found_);                                                       \
    }                                                                                                 \
    if (!real_) return none

/* Calls the shim makes into CUDA pass through the shim's own hooks; this guard tells them. */
bool vmm__in_shim(void);
void vmm__enter(void);
void vmm__leave(void);
#endif
