/* A program that reaches the driver the way a statically linked runtime does: it links no CUDA
 * library, dlopen()s libcuda.so.1, takes only cuGetProcAddress_v2 with dlsym, and resolves every
 * other entry point through it.  It allocates 3 MiB with cuMemAlloc and 1 MiB with
 * cuMemAllocAsync, writes and reads back a pattern, prints
 *   ready PID ADDR_ALLOC ADDR_ASYNC
 *   pattern ok|BAD
 * waits for a line on stdin, frees both and prints "freed". */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*dev_get_fn)(CUdevice *, int);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*set_ctx_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
typedef CUresult (*htod_fn)(CUdeviceptr, const void *, size_t);
typedef CUresult (*dtoh_fn)(void *, CUdeviceptr, size_t);
typedef CUresult (*sync_fn)(CUstream);

static gpa_fn gpa;

static void *get(const char *name)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = gpa(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st);
    if (rc != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS || !p) {
        printf("error cuGetProcAddress_v2(%s): rc %d status %d\n", name, (int)rc, (int)st);
        exit(1);
    }
    return p;
}

#define GET(type, var, name)                                                                          \
    type var;                                                                                         \
    do {                                                                                              \
        void *p_ = get(name);                                                                         \
        memcpy(&var, &p_, sizeof var);                                                                \
    } while (0)

#define CK(call)                                                                                      \
    do {                                                                                              \
        CUresult rc_ = (call);                                                                        \
        if (rc_ != CUDA_SUCCESS) {                                                                    \
            printf("error %s: %d\n", #call, (int)rc_);                                                \
            return 1;                                                                                 \
        }                                                                                             \
    } while (0)

int main(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        printf("error dlopen: %s\n", dlerror());
        return 1;
    }
    void *g = dlsym(h, "cuGetProcAddress_v2");
    if (!g) {
        printf("error dlsym cuGetProcAddress_v2\n");
        return 1;
    }
    memcpy(&gpa, &g, sizeof gpa);
    GET(init_fn, init, "cuInit");
    GET(dev_get_fn, dev_get, "cuDeviceGet");
    GET(retain_fn, retain, "cuDevicePrimaryCtxRetain");
    GET(set_ctx_fn, set_ctx, "cuCtxSetCurrent");
    GET(alloc_fn, mem_alloc, "cuMemAlloc");
    GET(free_fn, mem_free, "cuMemFree");
    GET(alloc_async_fn, mem_alloc_async, "cuMemAllocAsync");
    GET(free_async_fn, mem_free_async, "cuMemFreeAsync");
    GET(htod_fn, htod, "cuMemcpyHtoD");
    GET(dtoh_fn, dtoh, "cuMemcpyDtoH");
    GET(sync_fn, stream_sync, "cuStreamSynchronize");

    CUdevice dev;
    CUcontext ctx;
    CK(init(0));
    CK(dev_get(&dev, 0));
    CK(retain(&ctx, dev));
    CK(set_ctx(ctx));
    CUdeviceptr a = 0, b = 0;
    size_t na = 3u << 20, nb = 1u << 20;
    CK(mem_alloc(&a, na));
    CK(mem_alloc_async(&b, nb, NULL));
    CK(stream_sync(NULL));
    unsigned char *host = malloc(na), *back = malloc(na);
    if (!host || !back) return 1;
    for (size_t i = 0; i < na; i++) host[i] = (unsigned char)(i * 13 + 7);
    CK(htod(a, host, na));
    CK(htod(b, host + 4096, nb));
    memset(back, 0, na);
    CK(dtoh(back, a, na));
    int ok = memcmp(back, host, na) == 0;
    memset(back, 0, nb);
    CK(dtoh(back, b, nb));
    ok &= memcmp(back, host + 4096, nb) == 0;
    printf("ready %d 0x%llx 0x%llx\n", (int)getpid(), (unsigned long long)a, (unsigned long long)b);
    printf("pattern %s\n", ok ? "ok" : "BAD");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;
    CK(mem_free(a));
    CK(mem_free_async(b, NULL));
    CK(stream_sync(NULL));
    printf("freed\n");
    free(host);
    free(back);
    return ok ? 0 : 1;
}
