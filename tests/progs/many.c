/* N live cudaMalloc allocations of SIZE bytes: prints how many failed and how much device memory
 * they took (cudaMemGetInfo before and after), then frees them.  many N SIZE
 *
 * many N SIZE hold: the same, then writes its index into each allocation and reads every one back
 * ("bad=<how many differ>" on the line, which starts "ready <pid> "), and waits for lines on stdin
 * before freeing them: "more" (once) frees the first 10 and makes 20 new ones (checked the same way,
 * answered "more allocated=... failures=... bad=..."); "quit", or the end of stdin, frees all. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Writes i into allocation i of p[from..to) and reads them back: how many differ. */
static int check(void **p, int from, int to)
{
    int bad = 0;
    for (int i = from; i < to; i++) {
        int v = i;
        if (!p[i] || cudaMemcpy(p[i], &v, sizeof v, cudaMemcpyHostToDevice) != cudaSuccess) bad++;
    }
    for (int i = from; i < to; i++) {
        int back = -1;
        if (p[i] && (cudaMemcpy(&back, p[i], sizeof back, cudaMemcpyDeviceToHost) != cudaSuccess || back != i)) bad++;
    }
    return bad;
}

int main(int argc, char **argv)
{
    if (argc != 3 && !(argc == 4 && strcmp(argv[3], "hold") == 0)) {
        fprintf(stderr, "usage: many N SIZE [hold]\n");
        return 2;
    }
    int n = atoi(argv[1]), hold = argc == 4;
    size_t size = strtoull(argv[2], NULL, 0);
    void **p = calloc((size_t)n + 10, sizeof *p);
    size_t free0 = 0, free1 = 0, total = 0;
    if (!p || cudaFree(0) != cudaSuccess || cudaMemGetInfo(&free0, &total) != cudaSuccess) return 1;
    int failed = 0;
    for (int i = 0; i < n; i++)
        if (cudaMalloc(&p[i], size) != cudaSuccess) {
            p[i] = NULL;
            failed++;
        }
    cudaMemGetInfo(&free1, &total);
    if (!hold) {
        printf("allocated=%d failures=%d used=%zu\n", n - failed, failed, free0 - free1);
    } else {
        printf("ready %d allocated=%d failures=%d used=%zu bad=%d\n", (int)getpid(), n - failed, failed, free0 - free1,
               check(p, 0, n));
        fflush(stdout);
        char line[64];
        int more = 0;
        while (fgets(line, sizeof line, stdin) && strcmp(line, "quit\n") != 0) {
            if (strcmp(line, "more\n") != 0 || n < 10 || more++) continue;
            failed = 0;
            for (int i = 0; i < 10; i++) {
                cudaFree(p[i]);
                p[i] = NULL;
            }
            for (int i = 0; i < 10; i++) failed += cudaMalloc(&p[i], size) != cudaSuccess;
            for (int i = n; i < n + 10; i++) failed += cudaMalloc(&p[i], size) != cudaSuccess;
            printf("more allocated=%d failures=%d bad=%d\n", 20 - failed, failed, check(p, 0, 10) + check(p, n, n + 10));
            fflush(stdout);
            n += 10;
        }
    }
    for (int i = 0; i < n; i++) cudaFree(p[i]);
    free(p);
    return 0;
}
