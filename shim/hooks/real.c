/* One resolver for every real symbol; see real.h. */
#include "hooks/real.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
