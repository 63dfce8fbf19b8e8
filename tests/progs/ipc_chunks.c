/* Legacy CUDA IPC of several small allocations, as a framework shares small tensors: buffers an
 * allocator may place side by side in one chunk of device memory.  Every observation is one line,
 * "ipc: <what> <result>"; pointers are never printed, only distances between them.
 *
 *   ipc_chunks serve        cudaMalloc 4 KiB, 8 KiB and 64 KiB, fill each with its own pattern,
 *                           print "handle <hex> <address> <size>" for each (the second handle taken
 *                           from an interior pointer), then answer stdin: "verify" prints
 *                           "verify ok" when each buffer holds its second pattern; EOF frees
 *   ipc_chunks open H0 H1 H2  open the three handles, print "distance <i> <pointer i - pointer 0>",
 *                           read each, write its second pattern, close the first and read the
 *                           others again, close the rest, then once too often */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 3
#define FLAGS cudaIpcMemLazyEnablePeerAccess

static const size_t SIZE[N] = {4096, 8192, 65536};

static unsigned char pattern(size_t k, int buf, int which)
{
    return (unsigned char)(which == 1 ? k * 13 + 5 + (size_t)buf * 17 : (k * 7 + 3 + (size_t)buf) ^ 0x5a);
}

static void show(const char *what, cudaError_t e)
{
    printf("ipc: %-44s %s\n", what, cudaGetErrorName(e));
    fflush(stdout);
}

static void note(const char *what, int ok)
{
    printf("ipc: %-44s %s\n", what, ok ? "ok" : "FAILED");
    fflush(stdout);
}

/* Copy buffer i out and compare it with its pattern `which`. */
static int holds(const void *dev, int i, int which)
{
    unsigned char *h = malloc(SIZE[i]);
    int ok = h && cudaMemcpy(h, dev, SIZE[i], cudaMemcpyDeviceToHost) == cudaSuccess;
    for (size_t k = 0; ok && k < SIZE[i]; k++) ok = h[k] == pattern(k, i, which);
    free(h);
    return ok;
}

static cudaError_t put(void *dev, int i, int which)
{
    unsigned char *h = malloc(SIZE[i]);
    if (!h) return cudaErrorMemoryAllocation;
    for (size_t k = 0; k < SIZE[i]; k++) h[k] = pattern(k, i, which);
    cudaError_t e = cudaMemcpy(dev, h, SIZE[i], cudaMemcpyHostToDevice);
    free(h);
    return e;
}

static int serve(void)
{
    unsigned char *p[N];
    for (int i = 0; i < N; i++) {
        cudaError_t e = cudaMalloc((void **)&p[i], SIZE[i]);
        if (e == cudaSuccess) e = put(p[i], i, 1);
        if (e != cudaSuccess) {
            show("owner cudaMalloc and fill", e);
            return 1;
        }
    }
    for (int i = 0; i < N; i++) {
        cudaIpcMemHandle_t h;
        cudaError_t e = cudaIpcGetMemHandle(&h, p[i] + (i == 1 ? 100 : 0));
        if (e != cudaSuccess) {
            show("owner cudaIpcGetMemHandle", e);
            return 1;
        }
        printf("handle ");
        for (int k = 0; k < 64; k++) printf("%02x", (unsigned char)h.reserved[k]);
        printf(" 0x%llx %zu\n", (unsigned long long)(uintptr_t)p[i], SIZE[i]);
    }
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "verify", 6) != 0) continue;
        int ok = 1;
        for (int i = 0; i < N; i++) ok &= holds(p[i], i, 2);
        printf("verify %s\n", ok ? "ok" : "FAILED");
        fflush(stdout);
    }
    for (int i = 0; i < N; i++) cudaFree(p[i]);
    return 0;
}

static int from_hex(const char *s, cudaIpcMemHandle_t *h)
{
    if (strlen(s) != 128) return -1;
    for (int i = 0; i < 64; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
        h->reserved[i] = (char)v;
    }
    return 0;
}

static int open_all(char **hex)
{
    cudaIpcMemHandle_t h[N];
    void *p[N] = {NULL};
    for (int i = 0; i < N; i++)
        if (from_hex(hex[i], &h[i])) {
            printf("ipc: bad handle argument\n");
            return 2;
        }
    int all = 1;
    for (int i = 0; i < N; i++) {
        char what[64];
        snprintf(what, sizeof what, "open %d", i);
        cudaError_t e = cudaIpcOpenMemHandle(&p[i], h[i], FLAGS);
        show(what, e);
        all &= e == cudaSuccess;
    }
    if (!all) return 0;
    note("three distinct pointers", p[0] != p[1] && p[1] != p[2] && p[0] != p[2]);
    for (int i = 1; i < N; i++)
        printf("distance %d %lld\n", i, (long long)((uintptr_t)p[i] - (uintptr_t)p[0]));
    for (int i = 0; i < N; i++) {
        char what[64];
        snprintf(what, sizeof what, "buffer %d holds the owner's pattern", i);
        note(what, holds(p[i], i, 1));
        snprintf(what, sizeof what, "buffer %d written", i);
        show(what, put(p[i], i, 2));
    }
    show("cudaDeviceSynchronize", cudaDeviceSynchronize());
    show("close 0", cudaIpcCloseMemHandle(p[0]));
    note("buffers 1 and 2 readable with 0 closed", holds(p[1], 1, 2) && holds(p[2], 2, 2));
    void *again = NULL;
    show("open 1 again", cudaIpcOpenMemHandle(&again, h[1], FLAGS));
    note("open 1 again: same pointer", again == p[1]);
    show("close 1", cudaIpcCloseMemHandle(p[1]));
    show("close 1 again", cudaIpcCloseMemHandle(again));
    note("buffer 2 readable with 0 and 1 closed", holds(p[2], 2, 2));
    show("close 2", cudaIpcCloseMemHandle(p[2]));
    show("close 2 once too often", cudaIpcCloseMemHandle(p[2]));
    cudaGetLastError();
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "serve")) return serve();
    if (argc == 2 + N && !strcmp(argv[1], "open")) return open_all(argv + 2);
    fprintf(stderr, "usage: ipc_chunks serve | open HEX HEX HEX\n");
    return 2;
}
