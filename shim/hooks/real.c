/* Every real function underneath the shim is found here, so that no hook can resolve to the shim
 * itself by accident: the shim exports dlsym and the CUDA names, so any lookup that does not start
 * from glibc's own dlsym may come back to us.  This file is the floor the hooks, resolve.c's
 * dlsym and the backing stand on; it calls nothing of theirs.  The thread-local guard lives here
 * too, because it is what lets the shim's own CUDA calls pass straight through to what is found. */
#include "hooks/real.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* dlsym is called by sanitizer runtimes while they start, before their shadow memory exists:
 * what runs on that path must not be instrumented in the sanitizer builds. */
#define VMM_EARLY __attribute__((no_sanitize_address, no_sanitize_thread))

/* glibc's dlsym, bootstrapped without going through the shim's own (resolve.c). */
typedef void *(*dlsym_fn)(void *, const char *);
static void *real_dlsym_obj;

VMM_EARLY void *vmm__real_dlsym(void *handle, const char *name)
{
    /* No pthread_once: ThreadSanitizer's interceptor of it is not ready this early.  Two threads
     * looking it up at once find the same pointer. */
    void *p = __atomic_load_n(&real_dlsym_obj, __ATOMIC_ACQUIRE);
    if (!p) {
        p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        __atomic_store_n(&real_dlsym_obj, p, __ATOMIC_RELEASE);
    }
    if (!p) {
        static const char msg[] = "vmmshim: error: cannot find the real dlsym; aborting\n";
        (void)!write(2, msg, sizeof msg - 1);
        abort();
    }
    dlsym_fn real;
    memcpy(&real, &p, sizeof p);
    return real(handle, name);
}

static __thread int tls_depth;
bool vmm__in_shim(void) { return tls_depth > 0; }
void vmm__enter(void) { tls_depth++; }
void vmm__leave(void) { tls_depth--; }

static void die_self_resolved(const char *name)
{
    char msg[200];
    int n = snprintf(msg, sizeof msg, "vmmshim: error: %s resolved to the shim itself; aborting\n", name);
    if (n > 0) (void)!write(2, msg, (size_t)n);
    abort();
}

static int find_cudart(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    const char *slash = strrchr(info->dlpi_name, '/');
    const char *base = slash ? slash + 1 : info->dlpi_name;
    if (strncmp(base, "libcudart.so", 12) != 0) return 0;
    *(void **)data = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
    return *(void **)data != NULL;
}

void *vmm__real_runtime(const char *name, const void *self)
{
    void *fn = vmm__real_dlsym(RTLD_NEXT, name);
    if (!fn) {
        void *h = NULL;
        dl_iterate_phdr(find_cudart, &h);
        if (h) {
            fn = vmm__real_dlsym(h, name);
            dlclose(h); /* NOLOAD handle: drops only the reference it took */
        }
    }
    if (fn && fn == self) die_self_resolved(name);
    return fn;
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static void *cuda_handle;
static char cuda_why[160];

static void open_libcuda(void)
{
    cuda_handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda_handle) snprintf(cuda_why, sizeof cuda_why, "%s", dlerror());
}

void *vmm__real_libcuda(char *why, unsigned long why_len)
{
    pthread_once(&cuda_once, open_libcuda);
    if (!cuda_handle && why) snprintf(why, why_len, "%s", cuda_why);
    return cuda_handle;
}

void *vmm__real_driver(const char *name)
{
    void *h = vmm__real_libcuda(NULL, 0);
    return h ? vmm__real_dlsym(h, name) : NULL;
}
