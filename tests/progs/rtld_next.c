/* dlsym(RTLD_NEXT, ...) from the main program must mean "after the main program" whether or not
 * the shim (which exports its own dlsym) is preloaded. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(void)
{
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *next = dlsym(RTLD_NEXT, "getpid"), *direct = libc ? dlsym(libc, "getpid") : NULL;
    printf("RTLD_NEXT getpid is libc's: %s\n", next && next == direct ? "yes" : "no");
    Dl_info info;
    void *m = dlsym(RTLD_NEXT, "cudaMalloc");
    printf("RTLD_NEXT cudaMalloc comes from: %s\n",
           m && dladdr(m, &info) && info.dli_fname ? (strstr(info.dli_fname, "libvmmshim") ? "the shim" : "the runtime") : "nowhere");
    printf("RTLD_NEXT of a missing name: %s\n", dlsym(RTLD_NEXT, "no_such_symbol_anywhere") ? "found" : "NULL");
    return 0;
}
