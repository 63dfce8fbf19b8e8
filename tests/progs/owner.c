/* An owner for companion tests: allocates buffers of the sizes given (MiB; suffix 'a' = async,
 * 'c' = async on a stream being captured, left unfilled),
 * fills buffer i with bytes (i*31 + k) & 0xff, prints "ready <pid> <address> <size>" per
 * buffer (with the FNV-1a checksum of its bytes), then waits for a line on stdin: "verify" checks that a companion wrote 0xC3 into the
 * first 4096 bytes of buffer 0; "free" frees everything; "quit" exits. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_BUFS 128 /* enough for a companion taking many chunks at once (test_open_many.py) */

int main(int argc, char **argv)
{
    static void *buf[MAX_BUFS];
    static size_t size[MAX_BUFS];
    static unsigned long long fnv[MAX_BUFS]; /* FNV-1a of each buffer's bytes, for companions to compare */
    int n = 0;
    if (argc - 1 > MAX_BUFS) {
        printf("error at most %d buffers\n", MAX_BUFS);
        return 1;
    }
    for (int i = 1; i < argc && n < MAX_BUFS; i++, n++) {
        size[n] = (size_t)(atof(argv[i]) * 1048576.0);
        cudaError_t e;
        if (strchr(argv[i], 'c')) { /* allocated while its stream is captured into a graph */
            cudaStream_t s;
            cudaGraph_t g;
            cudaStreamCreate(&s);
            cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
            e = cudaMallocAsync(&buf[n], size[n], s);
            cudaStreamEndCapture(s, &g);
            if (e != cudaSuccess) {
                printf("error %s\n", cudaGetErrorName(e));
                return 1;
            }
            continue;
        }
        e = strchr(argv[i], 'a') ? cudaMallocAsync(&buf[n], size[n], 0) : cudaMalloc(&buf[n], size[n]);
        if (e != cudaSuccess) {
            printf("error %s\n", cudaGetErrorName(e));
            return 1;
        }
        unsigned char *h = malloc(size[n]);
        fnv[n] = 0xcbf29ce484222325ull;
        for (size_t k = 0; k < size[n]; k++) {
            h[k] = (unsigned char)((size_t)n * 31 + k);
            fnv[n] = (fnv[n] ^ h[k]) * 0x100000001b3ull;
        }
        cudaMemcpy(buf[n], h, size[n], cudaMemcpyHostToDevice);
        free(h);
    }
    cudaDeviceSynchronize();
    for (int i = 0; i < n; i++)
        printf("ready %d 0x%llx %zu fnv %016llx\n", (int)getpid(), (unsigned long long)(uintptr_t)buf[i], size[i], fnv[i]);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (!strncmp(line, "verify", 6)) {
            unsigned char h[4096];
            cudaMemcpy(h, buf[0], sizeof h, cudaMemcpyDeviceToHost);
            int ok = 1;
            for (int k = 0; k < 4096; k++) ok &= h[k] == 0xC3;
            printf("verify %s\n", ok ? "ok" : "FAILED");
        } else if (!strncmp(line, "free", 4)) {
            for (int i = 0; i < n; i++) cudaFree(buf[i]);
            printf("freed\n");
        } else if (!strncmp(line, "quit", 4)) {
            break;
        }
        fflush(stdout);
    }
    return 0;
}
