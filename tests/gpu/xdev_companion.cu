// The companion of tests/gpu/xdev_import.sh (not under the shim; linked with the client library):
// imports allocations of an owner on two GPUs and checks, with PASS/FAIL lines, where they are
// mapped and that every reader sees the owner's bytes.
//   xdev_companion MODE PID     MODE: 0 or 1 (cudaSetDevice(MODE) before importing: the
//                               companion's device), or none (no CUDA call before the import: the
//                               client library makes device 0's primary context current; give
//                               one line only, the later ones would find that context)
// stdin lines:
//   NAME DEV 0xADDR BYTES FNV   import the allocation at ADDR (the owner's device DEV, its FNV-1a
//                               64), then check: the record's device and handle count (NAME M*:
//                               a MULTI-HANDLE record); the devices granted read-write
//                               (cuMemGetAccess) are exactly the memory's own (found by UUID) and
//                               the companion's when it can access that one as a peer;
//                               vmm_import_device; the FNV of a cudaMemcpy to the host and of a
//                               kernel copy on every granted device
//   write NAME 0xADDR BYTES SEED  import it and fill it with SEED's pattern from a kernel on the
//                               companion's device (the owner checks the words)
// Exits 0 when every check passed.
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vmmshim.h"

__global__ void copy_words(unsigned *dst, const unsigned *src, size_t n) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
__global__ void fill(unsigned *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = seed ^ (unsigned)(i * 2654435761u);
}

static int failed;
static void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(bool ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(ok ? "PASS " : "FAIL ", stdout);
    vprintf(fmt, ap);
    putchar('\n');
    va_end(ap);
    fflush(stdout);
    if (!ok) failed = 1;
}

static unsigned long long fnv1a(const unsigned char *p, size_t n) {
    unsigned long long h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

// FNV of bytes at device pointer p copied by a kernel on GPU dev into memory of its own, then to
// the host; *e the first CUDA error.
static unsigned long long kernel_fnv(int dev, uint64_t p, size_t bytes, cudaError_t *e) {
    unsigned *local = NULL;
    unsigned char *h = (unsigned char *)malloc(bytes);
    unsigned long long f = 0;
    if ((*e = cudaSetDevice(dev)) == cudaSuccess && (*e = cudaMalloc(&local, bytes)) == cudaSuccess) {
        copy_words<<<132, 256>>>(local, (const unsigned *)(uintptr_t)p, bytes / 4);
        if ((*e = cudaDeviceSynchronize()) == cudaSuccess && (*e = cudaMemcpy(h, local, bytes, cudaMemcpyDeviceToHost)) == cudaSuccess)
            f = fnv1a(h, bytes);
        cudaFree(local);
    }
    free(h);
    return f;
}

// This process's ordinal of the device with the record's UUID, or -1.
static int local_device(const vmm_alloc_info *a) {
    int n = 0;
    cudaGetDeviceCount(&n);
    for (int d = 0; d < n; d++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, d) == cudaSuccess && memcmp(p.uuid.bytes, a->device_uuid, 16) == 0) return d;
    }
    return -1;
}

// cuMemGetAccess from the driver the runtime uses (no link to libcuda.so, which the GPU machine
// may have only as libcuda.so.1).
typedef CUresult (*get_access_fn)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
static get_access_fn get_access(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
    void *f = h ? dlsym(h, "cuMemGetAccess") : NULL;
    get_access_fn fn;
    memcpy(&fn, &f, sizeof f);
    return fn;
}

static const char *flags_name(unsigned long long f) {
    return f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? "rw" : f == CU_MEM_ACCESS_FLAGS_PROT_READ ? "r" : "none";
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: xdev_companion 0|1|none PID\n"); return 2; }
    bool own = strcmp(argv[1], "none") != 0;
    int mode = own ? atoi(argv[1]) : -1;
    uint32_t pid = (uint32_t)strtoul(argv[2], NULL, 10);
    if (own) {
        cudaError_t e = cudaSetDevice(mode);
        if (e == cudaSuccess) e = cudaFree(0); // the context, current on this thread
        if (e != cudaSuccess) { printf("FAIL cudaSetDevice(%d): %s\n", mode, cudaGetErrorName(e)); return 1; }
    }
    vmm_registry *reg = NULL;
    if (vmm_open(NULL, &reg) != VMM_OK) { printf("FAIL vmm_open: %s\n", vmm_last_error()); return 1; }
    char line[512];
    while (fgets(line, sizeof line, stdin)) {
        char name[32];
        unsigned dev = 0, seed = 0;
        unsigned long long addr = 0, bytes = 0, want = 0;
        bool writing = strncmp(line, "write ", 6) == 0;
        if (writing ? sscanf(line, "write %31s %llx %llu %u", name, &addr, &bytes, &seed) != 4
                    : sscanf(line, "%31s %u %llx %llu %llx", name, &dev, &addr, &bytes, &want) != 5) {
            printf("FAIL bad input line: %s", line);
            failed = 1;
            continue;
        }
        vmm_alloc_info a;
        vmm_imported *imp = NULL;
        if (vmm_find(reg, pid, addr, &a) != VMM_OK || vmm_import(reg, &a, &imp) != VMM_OK) {
            check(false, "%s: import of pid %u's 0x%llx: %s", name, pid, addr, vmm_last_error());
            continue;
        }
        uint64_t ptr = vmm_import_ptr(imp);
        int here = -1, ndev = 0, res = local_device(&a), can = 0;
        cudaGetDevice(&here); // none: the context the library made current (device 0's primary)
        cudaGetDeviceCount(&ndev);
        if (res >= 0 && res != here) cudaDeviceCanAccessPeer(&can, here, res);
        unsigned want_bits = res < 0 || res == here ? 1u << here : (1u << res) | (can ? 1u << here : 0);
        int want_dev = res < 0 || res == here ? here : (!can || !own) ? res : here;
        char access[64] = "";
        unsigned got_bits = 0;
        for (int d = 0; d < ndev && d < 8; d++) {
            CUmemLocation loc = {};
            loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
            loc.id = d;
            unsigned long long f = 0;
            get_access_fn ga = get_access();
            CUresult r = ga ? ga(&f, &loc, (CUdeviceptr)ptr) : CUDA_ERROR_NOT_FOUND;
            if (r != CUDA_SUCCESS) f = 99;
            if (f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) got_bits |= 1u << d;
            snprintf(access + strlen(access), sizeof access - strlen(access), "%sGPU %d %s", d ? ", " : "", d,
                     f == 99 ? "?" : flags_name(f));
        }
        printf("%s: the owner's device %u, here GPU %d (by UUID), %u handle%s; companion on GPU %d (%s); "
               "vmm_import_device %d; access: %s\n",
               name, a.device, res, a.n_handles, a.n_handles == 1 ? "" : "s", here,
               own ? "its own context" : "no context before the import", vmm_import_device(imp), access);
        if (!writing) {
            check(a.device == dev, "%s: the record names the owner's device %u", name, dev);
            if (name[0] == 'M')
                check((a.flags & VMM_ALLOC_MULTI_HANDLE) && a.n_handles >= 2, "%s: a multi-handle record (%u handles)",
                      name, a.n_handles);
        }
        check(got_bits == want_bits, "%s: mapped read-write for exactly the memory's GPU %d and the companion's GPU %d "
              "when it can reach it (peer: %s): %s", name, res, here, res == here ? "same GPU" : can ? "yes" : "no", access);
        check(vmm_import_device(imp) == want_dev, "%s: vmm_import_device is %d (want %d)", name, vmm_import_device(imp),
              want_dev);
        if (writing) {
            cudaSetDevice(here);
            fill<<<132, 256>>>((unsigned *)(uintptr_t)ptr, bytes / 4, seed);
            cudaError_t e = cudaDeviceSynchronize();
            check(e == cudaSuccess, "%s: a kernel on GPU %d filled the owner's GPU %d memory: %s", name, here, res,
                  cudaGetErrorName(e));
        } else {
            unsigned char *h = (unsigned char *)malloc(bytes);
            cudaSetDevice(here);
            cudaError_t e = cudaMemcpy(h, (const void *)(uintptr_t)ptr, bytes, cudaMemcpyDeviceToHost);
            unsigned long long f = e == cudaSuccess ? fnv1a(h, bytes) : 0;
            free(h);
            check(e == cudaSuccess && f == want, "%s: cudaMemcpy to the host on GPU %d reads the owner's bytes "
                  "(fnv %016llx, owner's %016llx, %s)", name, here, f, want, cudaGetErrorName(e));
            for (int d = 0; d < ndev && d < 8; d++) {
                if (!(got_bits >> d & 1)) continue; // a kernel on a device without access would fault
                f = kernel_fnv(d, ptr, bytes, &e);
                check(e == cudaSuccess && f == want, "%s: a kernel on GPU %d reads the owner's GPU %d bytes (fnv "
                      "%016llx, %s)", name, d, res, f, cudaGetErrorName(e));
            }
            cudaSetDevice(here);
        }
        vmm_import_release(imp);
    }
    vmm_close(reg);
    return failed;
}
