/* Row c: legacy CUDA IPC between two processes.  The parent cudaMalloc's 4 MiB, writes a pattern
 * with a kernel and exports it with cudaIpcGetMemHandle; a second process (this program started
 * again as "ipc child HEX") opens the handle, checks the pattern with a kernel and writes its own;
 * the parent checks that with a kernel.  (A new process, not fork: CUDA does not survive fork.) */
#include <cuda_runtime.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

extern char **environ;

#define CK(call)                                                                                       \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            printf("%s error %s: %s\n", role, #call, cudaGetErrorName(e_));                            \
            fflush(stdout);                                                                            \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

static const char *role = "parent";
static const size_t N = (4u << 20) / 4;

__global__ void fill(unsigned *p, size_t n, unsigned seed, int invert)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = invert ? ~mix(i, seed) : mix(i, seed);
}

__global__ void verify(const unsigned *p, size_t n, unsigned seed, int invert, unsigned long long *bad)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        if (p[i] != (invert ? ~mix(i, seed) : mix(i, seed))) atomicAdd(bad, 1ull);
}

static unsigned long long count_bad(const unsigned *p, unsigned seed, int invert)
{
    unsigned long long *bad, h = 0;
    CK(cudaMalloc((void **)&bad, sizeof *bad));
    CK(cudaMemset(bad, 0, sizeof *bad));
    verify<<<256, 256>>>(p, N, seed, invert, bad);
    CK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
    CK(cudaFree(bad));
    return h;
}

static int child(const char *hex)
{
    role = "child";
    cudaIpcMemHandle_t handle;
    if (strlen(hex) != 2 * sizeof handle) {
        printf("child: bad handle text\n");
        return 1;
    }
    for (size_t i = 0; i < sizeof handle; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        handle.reserved[i] = (char)v;
    }
    unsigned *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle((void **)&p, handle, cudaIpcMemLazyEnablePeerAccess);
    printf("child: cudaIpcOpenMemHandle %s\n", cudaGetErrorName(e));
    if (e != cudaSuccess) return 1;
    printf("# child %d sees the buffer at %p\n", (int)getpid(), (void *)p);
    printf("child: parent's pattern, words wrong: %llu\n", count_bad(p, 21, 0));
    fill<<<256, 256>>>(p, N, 21, 1);
    CK(cudaDeviceSynchronize());
    printf("child: cudaIpcCloseMemHandle %s\n", cudaGetErrorName(cudaIpcCloseMemHandle(p)));
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "child")) return child(argv[2]);
    unsigned *p;
    CK(cudaMalloc((void **)&p, N * 4));
    fill<<<256, 256>>>(p, N, 21, 0);
    CK(cudaDeviceSynchronize());
    cudaIpcMemHandle_t handle;
    printf("parent: cudaIpcGetMemHandle %s\n", cudaGetErrorName(cudaIpcGetMemHandle(&handle, p)));
    char hex[2 * sizeof handle + 1];
    for (size_t i = 0; i < sizeof handle; i++) snprintf(hex + 2 * i, 3, "%02x", (unsigned char)handle.reserved[i]);
    printf("# parent buffer %p\n", (void *)p);

    pause_point(); /* the exported buffer is live */

    fflush(stdout);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 1;
    self[n] = 0;
    char *cargv[] = {self, (char *)"child", hex, NULL};
    pid_t pid;
    if (posix_spawn(&pid, self, NULL, NULL, cargv, environ) != 0) {
        printf("parent: cannot start the child\n");
        return 1;
    }
    int st = 0;
    waitpid(pid, &st, 0);
    printf("parent: child exited %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
    printf("parent: child's pattern, words wrong: %llu\n", count_bad(p, 21, 1));
    CK(cudaFree(p));
    printf("done\n");
    return 0;
}
