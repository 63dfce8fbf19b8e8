/* An owner driven line by line on stdin, for companion tests of allocations that span several
 * of the allocator's segments (tests/unit/test_import_multi.c):
 *   "a <bytes>"      cudaMalloc; answers "ok <index> 0x<address>"
 *   "A <bytes>"      cudaMallocAsync on the default stream (the stream-ordered pool packs, where
 *                    cudaMalloc's maps each large request alone); answers the same
 *   "w <index> <seed>" fills the buffer with 64-bit words seed * 0x9e3779b97f4a7c15 + word index
 *                      (cudaMemcpy); answers "ok"
 *   "f <index>"      cudaFree; answers "ok"
 *   "d <device>"     cudaSetDevice: later allocations are that device's; answers "ok"
 *   "k"              the current device's default pool keeps what is freed (release threshold
 *                    UINT64_MAX, as PyTorch's cudaMallocAsync backend sets it); answers "ok"
 *   "T"              cudaDeviceSynchronize, then cudaMemPoolTrimTo(default pool, 0): what the
 *                    stream-ordered pool keeps empty goes back; answers "ok"
 *   "e <us>"         the emulated driver's exports take that long (fakecuda_set_export_delay_us;
 *                    "error" on a real GPU); answers "ok"
 *   "p <index> <name>" names the buffer (vmm_publish, the shim's: uint8, one dimension); answers "ok"
 *   "c"              answers "ok <exports>": the emulated driver's successful exports so far
 *   "t <ms>"         cudaMalloc and cudaFree 1 MiB, again and again for that long; answers
 *                    "ok <slowest call in us> <pairs>"
 *   "x <code>"       exit(code), answering nothing (tests/unit/test_keep.c: how an owner ended)
 *   "s"              raises SIGSEGV, as a crash would (no handler of its own)
 *   "P <flags> [tag]" vmm_pause_ex (the shim's; no tag: NULL, every allocation); answers "ok <bytes
 *                    released> <kept> <not the shim's> <segments> <allocations> <bytes held> <holders>
 *                    <their pids...>", or "error <status> <why>"
 *   "R [tag]"        vmm_resume_ex; answers as "P"
 *   "g [tag]"        vmm_set_thread_tag (the shim's): later allocations of this (the only) thread
 *                    carry that tag; no tag: none again (the process's VMMSHIM_TAG); answers "ok"
 *   "v <index> <seed>" reads the buffer back (cudaMemcpy) and compares it with what "w" wrote;
 *                    answers "ok" or "error mismatch at word <k>"
 *   "m"              answers "ok <physical bytes> <handles> <host allocations> <cuMemHostAlloc calls>
 *                    <cuMemFreeHost calls> <cuMemcpyDtoHAsync calls> <cuMemcpyHtoDAsync calls> <event records>
 *                    <cuMemHostRegister calls> <most registers in flight at once>": the
 *                    emulated driver's live counts in this process, and its calls so far
 *   "b <bytes>"      the emulated device's memory budget (fakecuda_set_budget); answers "ok"
 *   "F"              forks a child that exits at once (through exit(), the shim's exit path); answers
 *                    "ok <its exit status>"
 *   "V <bytes> <release>" the program's own VMM memory (tests/unit/test_sleep_adopted.c): cuMemCreate
 *                    (no shareable type, as PyTorch's expandable segments), cuMemAddressReserve,
 *                    cuMemMap, cuMemSetAccess (read-write, device 0), then cuMemRelease of the handle
 *                    when release is 1; a buffer as any other ("w", "v"); answers "ok <index>
 *                    0x<address> 0x<handle>"
 *   "U <index>"      of a "V" buffer: cuMemUnmap, cuMemRelease (when still held), cuMemAddressFree;
 *                    answers "ok", or "error <call> <CUresult>"
 *   "L <index>"      cuMemRelease of a "V" buffer's held handle (it stays mapped); answers "ok <CUresult>"
 *   "H <index>"      cuMemRetainAllocationHandle at the buffer, then cuMemRelease of what it gave;
 *                    answers "ok <retain's CUresult> 0x<handle> <release's CUresult>"
 *   "G <index>"      cuMemGetAllocationPropertiesFromHandle of the buffer's handle; answers "ok
 *                    <CUresult> <handle types> <device>"
 *   "M <index>"      cuMemMap of the buffer's handle at a fresh reservation (unmapped and freed
 *                    again); answers "ok <cuMemMap's CUresult>"
 *   "X <index>"      cuMemExportToShareableHandle (POSIX fd) of the buffer's handle (the fd
 *                    closed); answers "ok <CUresult>"
 *   "N <bytes>"      memory made the way NCCL makes its own, by code inside a library named like it
 *                    (VMMSHIM_TEST_NCCL_LIB: build/tests/libnccl-standin.so); a buffer as any other
 *                    ("w", "v"); answers "ok <index> 0x<address>"
 *   "Q [tag]"        vmm_pause_prepare (the shim's; no tag: NULL); answers "ok <bytes made ready>" or
 *                    "error <status> <why>"
 *   "O <address> <bytes>" vmm_paused_overlaps of that one range (the shim's); answers "ok <0|1>"
 *   "C <address>"    vmm_sleep_host there; answers "ok <status> <contiguous bytes> 0x<the copy's first
 *                    8 bytes as a word, 0 when none>"
 *   "D"              vmm_sleep_drop_host(NULL); answers "ok <bytes freed>"
 *   "q"              exits
 * A failure answers "error <what>". */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <time.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vmmshim.h"
#include "../fakecuda/fakecuda.h"

#define MAX_BUFS 256

static void *sym_of(const char *name) { return dlsym(RTLD_DEFAULT, name); }

/* The emulated driver's counters now: 0, or -1 under a real driver (it has none). */
static int counters_now(struct fakecuda_counters *c)
{
    void *sym = sym_of("fakecuda_counters");
    fakecuda_counters_fn counters = NULL;
    memcpy(&counters, &sym, sizeof counters);
    memset(c, 0, sizeof *c);
    if (!counters) return -1;
    counters(c);
    return 0;
}

typedef const char *(*thread_tag_fn)(const char *);
typedef vmm_status (*pause_fn)(const char *, unsigned, vmm_sleep_report *, size_t);
typedef vmm_status (*resume_fn)(const char *, vmm_sleep_report *, size_t);

/* Answer a pause's or resume's outcome. */
static void sleep_answer(vmm_status st, const vmm_sleep_report *r)
{
    if (st == VMM_OK) {
        printf("ok %llu %llu %llu %llu %llu %llu %u", (unsigned long long)r->bytes_released, (unsigned long long)r->bytes_kept,
               (unsigned long long)r->bytes_not_shim, (unsigned long long)r->segments, (unsigned long long)r->allocations,
               (unsigned long long)r->bytes_held, r->n_holders);
        for (uint32_t i = 0; i < r->n_holders && i < 8; i++) printf(" %u", r->holders[i]);
        printf("\n");
    } else {
        void *sym = dlsym(RTLD_DEFAULT, "vmm_sleep_error");
        const char *(*why)(void) = NULL;
        memcpy(&why, &sym, sizeof why);
        printf("error %d %s\n", (int)st, why ? why() : "");
    }
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

int main(void)
{
    static void *buf[MAX_BUFS];
    static size_t size[MAX_BUFS];
    static CUmemGenericAllocationHandle own[MAX_BUFS]; /* "V" buffers: the handle the program holds */
    static int held[MAX_BUFS];
    int n = 0;
    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long a = 0, b = 0;
        cudaError_t e = cudaSuccess;
        if (line[0] == 'q') break;
        if (line[0] == 'x' && sscanf(line + 1, "%llu", &a) == 1) exit((int)a);
        if (line[0] == 's') raise(SIGSEGV);
        if ((line[0] == 'a' || line[0] == 'A') && sscanf(line + 1, "%llu", &a) == 1 && n < MAX_BUFS) {
            size[n] = (size_t)a;
            e = line[0] == 'a' ? cudaMalloc(&buf[n], size[n]) : cudaMallocAsync(&buf[n], size[n], 0);
            if (e == cudaSuccess) {
                printf("ok %d 0x%llx\n", n, (unsigned long long)(uintptr_t)buf[n]);
                n++;
            }
        } else if (line[0] == 'w' && sscanf(line + 1, "%llu %llu", &a, &b) == 2 && a < (unsigned long long)n) {
            size_t words = size[a] / 8;
            uint64_t *h = malloc(words * 8);
            if (!h) {
                printf("error malloc\n");
                fflush(stdout);
                continue;
            }
            for (size_t k = 0; k < words; k++) h[k] = b * 0x9e3779b97f4a7c15ull + k;
            e = cudaMemcpy(buf[a], h, words * 8, cudaMemcpyHostToDevice);
            free(h);
            if (e == cudaSuccess) printf("ok\n");
        } else if (line[0] == 'f' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            e = cudaFree(buf[a]);
            if (e == cudaSuccess) printf("ok\n");
        } else if (line[0] == 'k') {
            cudaMemPool_t pool;
            uint64_t keep = UINT64_MAX;
            int dev = 0;
            e = cudaGetDevice(&dev);
            if (e == cudaSuccess) e = cudaDeviceGetDefaultMemPool(&pool, dev);
            if (e == cudaSuccess) e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
            if (e == cudaSuccess) printf("ok\n");
        } else if (line[0] == 'T') {
            cudaMemPool_t pool;
            int dev = 0;
            e = cudaDeviceSynchronize();
            if (e == cudaSuccess) e = cudaGetDevice(&dev);
            if (e == cudaSuccess) e = cudaDeviceGetDefaultMemPool(&pool, dev);
            if (e == cudaSuccess) e = cudaMemPoolTrimTo(pool, 0);
            if (e == cudaSuccess) printf("ok\n");
        } else if (line[0] == 'e' && sscanf(line + 1, "%llu", &a) == 1) {
            void *sym = dlsym(RTLD_DEFAULT, "fakecuda_set_export_delay_us");
            void (*set_delay)(unsigned long long) = NULL;
            memcpy(&set_delay, &sym, sizeof set_delay); /* ISO C has no object-to-function cast */
            if (set_delay) {
                set_delay(a);
                printf("ok\n");
            } else {
                printf("error no emulated driver\n");
            }
        } else if (line[0] == 'p' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            char name[64];
            void *sym = sym_of("vmm_publish");
            vmm_status (*publish)(const char *, uint64_t, vmm_dtype, uint32_t, const int64_t *, const int64_t *) = NULL;
            memcpy(&publish, &sym, sizeof publish);
            int64_t shape[1] = {(int64_t)size[a]};
            vmm_status st = VMM_ERR_NO_SHIM;
            if (sscanf(line + 1, "%*u %63s", name) == 1 && publish)
                st = publish(name, (uint64_t)(uintptr_t)buf[a], (vmm_dtype){VMM_DTYPE_UINT, 8, 1}, 1, shape, NULL);
            if (st == VMM_OK) printf("ok\n");
            else printf("error vmm_publish %d\n", (int)st);
        } else if (line[0] == 'c') {
            struct fakecuda_counters c;
            if (counters_now(&c) == 0) {
                printf("ok %llu\n", c.exports);
            } else {
                printf("error no emulated driver\n");
            }
        } else if (line[0] == 't' && sscanf(line + 1, "%llu", &a) == 1) {
            double until = now_us() + (double)a * 1000, slowest = 0;
            unsigned long long pairs = 0;
            void *p = NULL;
            while (e == cudaSuccess && now_us() < until) {
                double t0 = now_us();
                e = cudaMalloc(&p, 1 << 20);
                if (e == cudaSuccess) e = cudaFree(p);
                double dt = now_us() - t0;
                if (dt > slowest) slowest = dt;
                pairs++;
            }
            if (e == cudaSuccess) printf("ok %.0f %llu\n", slowest, pairs);
        } else if (line[0] == 'P' && sscanf(line + 1, "%llu", &a) == 1) {
            char tag[64];
            int has_tag = sscanf(line + 1, "%*u %63s", tag) == 1;
            void *sym = sym_of("vmm_pause_ex");
            pause_fn pause = NULL;
            memcpy(&pause, &sym, sizeof pause);
            vmm_sleep_report r = {0};
            sleep_answer(pause ? pause(has_tag ? tag : NULL, (unsigned)a, &r, sizeof r) : VMM_ERR_NO_SHIM, &r);
        } else if (line[0] == 'g') {
            char tag[64];
            int has_tag = sscanf(line + 1, "%63s", tag) == 1;
            void *sym = sym_of("vmm_set_thread_tag");
            thread_tag_fn set_tag = NULL;
            memcpy(&set_tag, &sym, sizeof set_tag);
            if (set_tag) {
                (void)set_tag(has_tag ? tag : NULL);
                printf("ok\n");
            } else {
                printf("error no shim\n");
            }
        } else if (line[0] == 'R') {
            char tag[64];
            int has_tag = sscanf(line + 1, "%63s", tag) == 1;
            void *sym = sym_of("vmm_resume_ex");
            resume_fn resume = NULL;
            memcpy(&resume, &sym, sizeof resume);
            vmm_sleep_report r = {0};
            sleep_answer(resume ? resume(has_tag ? tag : NULL, &r, sizeof r) : VMM_ERR_NO_SHIM, &r);
        } else if (line[0] == 'v' && sscanf(line + 1, "%llu %llu", &a, &b) == 2 && a < (unsigned long long)n) {
            size_t words = size[a] / 8, bad = words;
            uint64_t *h = malloc(words * 8);
            e = h ? cudaMemcpy(h, buf[a], words * 8, cudaMemcpyDeviceToHost) : cudaErrorMemoryAllocation;
            for (size_t k = 0; e == cudaSuccess && k < words && bad == words; k++)
                if (h[k] != b * 0x9e3779b97f4a7c15ull + k) bad = k;
            free(h);
            if (e == cudaSuccess && bad == words) printf("ok\n");
            else if (e == cudaSuccess) printf("error mismatch at word %zu\n", bad);
        } else if (line[0] == 'm') {
            struct fakecuda_counters c;
            if (counters_now(&c) == 0) {
                /* pinned host buffers, however made: cuMemHostAlloc'd or the program's page-locked */
                printf("ok %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", c.phys_bytes_live, c.handles_live,
                       c.host_allocs_live + c.host_registered_live, c.calls_cuMemHostAlloc + c.calls_cuMemHostRegister,
                       c.calls_cuMemFreeHost + c.calls_cuMemHostUnregister, c.calls_cuMemcpyDtoHAsync, c.calls_cuMemcpyHtoDAsync,
                       c.calls_cuEventRecord, c.calls_cuMemHostRegister, c.host_register_peak);
            } else {
                printf("error no emulated driver\n");
            }
        } else if (line[0] == 'b' && sscanf(line + 1, "%llu", &a) == 1) {
            void *sym = sym_of("fakecuda_set_budget");
            fakecuda_set_budget_fn set_budget = NULL;
            memcpy(&set_budget, &sym, sizeof set_budget);
            if (set_budget) {
                set_budget(a);
                printf("ok\n");
            } else {
                printf("error no emulated driver\n");
            }
        } else if (line[0] == 'F') {
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) exit(0);
            int wst = 0;
            if (child > 0 && waitpid(child, &wst, 0) == child) printf("ok %d\n", WIFEXITED(wst) ? WEXITSTATUS(wst) : 128 + WTERMSIG(wst));
            else printf("error fork\n");
        } else if (line[0] == 'V' && sscanf(line + 1, "%llu %llu", &a, &b) == 2 && n < MAX_BUFS) {
            CUmemAllocationProp prop = {0};
            prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
            CUdeviceptr va = 0;
            CUresult r;
            const char *at = "cuMemCreate";
            (void)cudaFree(0); /* the runtime's context current, as a program's first CUDA call makes it */
            if ((r = cuMemCreate(&own[n], a, &prop, 0)) == CUDA_SUCCESS && (at = "cuMemAddressReserve") &&
                (r = cuMemAddressReserve(&va, a, 0, 0, 0)) == CUDA_SUCCESS && (at = "cuMemMap") &&
                (r = cuMemMap(va, a, 0, own[n], 0)) == CUDA_SUCCESS && (at = "cuMemSetAccess") &&
                (r = cuMemSetAccess(va, a, &acc, 1)) == CUDA_SUCCESS && (at = "cuMemRelease") &&
                (!b || (r = cuMemRelease(own[n])) == CUDA_SUCCESS)) {
                buf[n] = (void *)(uintptr_t)va;
                size[n] = (size_t)a;
                held[n] = !b;
                printf("ok %d 0x%llx 0x%llx\n", n, (unsigned long long)va, (unsigned long long)own[n]);
                n++;
            } else {
                printf("error %s %d\n", at, (int)r);
            }
        } else if (line[0] == 'O' && sscanf(line + 1, "%llx %llu", &a, &b) == 2) {
            void *sym = sym_of("vmm_paused_overlaps");
            int (*overlaps)(const uint64_t *, const uint64_t *, size_t) = NULL;
            memcpy(&overlaps, &sym, sizeof overlaps);
            uint64_t start = a, len = b;
            if (overlaps) printf("ok %d\n", overlaps(&start, &len, 1));
            else printf("error no vmm_paused_overlaps\n");
        } else if (line[0] == 'C' && sscanf(line + 1, "%llx", &a) == 1) {
            void *sym = sym_of("vmm_sleep_host");
            vmm_status (*host_of)(uint64_t, void **, uint64_t *) = NULL;
            memcpy(&host_of, &sym, sizeof host_of);
            void *host = NULL;
            uint64_t bytes = 0, first = 0;
            vmm_status st = host_of ? host_of(a, &host, &bytes) : VMM_ERR_NO_SHIM;
            if (st == VMM_OK && bytes >= sizeof first) memcpy(&first, host, sizeof first);
            printf("ok %d %llu 0x%llx\n", (int)st, (unsigned long long)bytes, (unsigned long long)first);
        } else if (line[0] == 'D') {
            void *sym = sym_of("vmm_sleep_drop_host");
            uint64_t (*drop)(const char *) = NULL;
            memcpy(&drop, &sym, sizeof drop);
            printf("ok %llu\n", (unsigned long long)(drop ? drop(NULL) : 0));
        } else if (line[0] == 'Q') {
            char tag[64] = "";
            int has = sscanf(line + 1, "%63s", tag) == 1;
            void *sym = sym_of("vmm_pause_prepare"), *err = sym_of("vmm_sleep_error");
            vmm_status (*prepare)(const char *, uint64_t *) = NULL;
            const char *(*why)(void) = NULL;
            memcpy(&prepare, &sym, sizeof prepare);
            memcpy(&why, &err, sizeof why);
            uint64_t ready = 0;
            vmm_status st = prepare ? prepare(has ? tag : NULL, &ready) : VMM_ERR_NO_SHIM;
            if (st == VMM_OK) printf("ok %llu\n", (unsigned long long)ready);
            else printf("error %d %s\n", (int)st, why ? why() : "");
        } else if (line[0] == 'N' && sscanf(line + 1, "%llu", &a) == 1 && n < MAX_BUFS) {
            const char *path = getenv("VMMSHIM_TEST_NCCL_LIB");
            void *lib = path ? dlopen(path, RTLD_NOW) : NULL, *sym = lib ? dlsym(lib, "nccl_standin_alloc") : NULL;
            CUresult (*make)(size_t, CUdeviceptr *) = NULL;
            memcpy(&make, &sym, sizeof make);
            CUdeviceptr va = 0;
            CUresult r = CUDA_ERROR_NOT_FOUND;
            (void)cudaFree(0);
            if (make && (r = make((size_t)a, &va)) == CUDA_SUCCESS) {
                buf[n] = (void *)(uintptr_t)va;
                size[n] = (size_t)a;
                printf("ok %d 0x%llx\n", n, (unsigned long long)va);
                n++;
            } else {
                printf("error nccl_standin_alloc %d %s\n", (int)r, make ? "" : dlerror());
            }
        } else if (line[0] == 'U' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            CUdeviceptr va = (CUdeviceptr)(uintptr_t)buf[a];
            CUresult r;
            if ((r = cuMemUnmap(va, size[a])) != CUDA_SUCCESS) printf("error cuMemUnmap %d\n", (int)r);
            else if (held[a] && (r = cuMemRelease(own[a])) != CUDA_SUCCESS) printf("error cuMemRelease %d\n", (int)r);
            else if ((r = cuMemAddressFree(va, size[a])) != CUDA_SUCCESS) printf("error cuMemAddressFree %d\n", (int)r);
            else printf("ok\n");
            held[a] = 0;
        } else if (line[0] == 'L' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            CUresult r = cuMemRelease(own[a]);
            if (r == CUDA_SUCCESS) held[a] = 0;
            printf("ok %d\n", (int)r);
        } else if (line[0] == 'H' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            CUmemGenericAllocationHandle h = 0;
            CUresult r = cuMemRetainAllocationHandle(&h, buf[a]);
            CUresult l = r == CUDA_SUCCESS ? cuMemRelease(h) : CUDA_SUCCESS;
            printf("ok %d 0x%llx %d\n", (int)r, (unsigned long long)h, (int)l);
        } else if (line[0] == 'G' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            CUmemAllocationProp p;
            memset(&p, 0, sizeof p);
            CUresult r = cuMemGetAllocationPropertiesFromHandle(&p, own[a]);
            printf("ok %d %d %d\n", (int)r, (int)p.requestedHandleTypes, p.location.id);
        } else if (line[0] == 'M' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            CUdeviceptr va = 0;
            CUresult r = cuMemAddressReserve(&va, size[a], 0, 0, 0);
            if (r == CUDA_SUCCESS) {
                r = cuMemMap(va, size[a], 0, own[a], 0);
                if (r == CUDA_SUCCESS) cuMemUnmap(va, size[a]);
                cuMemAddressFree(va, size[a]);
            }
            printf("ok %d\n", (int)r);
        } else if (line[0] == 'X' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            int fd = -1;
            CUresult r = cuMemExportToShareableHandle(&fd, own[a], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            if (fd >= 0) close(fd);
            printf("ok %d\n", (int)r);
        } else if (line[0] == 'd' && sscanf(line + 1, "%llu", &a) == 1) {
            e = cudaSetDevice((int)a);
            if (e == cudaSuccess) printf("ok\n");
        } else {
            printf("error bad command\n");
        }
        if (e != cudaSuccess) printf("error %s\n", cudaGetErrorName(e));
        fflush(stdout);
    }
    return 0;
}
