/* Pair times (allocate + free) at a few sizes: median of N pairs.  Run natively and under the
 * shim by tests/gpu/run.sh, which prints the ratio table. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv)
{
    int reps = argc > 1 ? atoi(argv[1]) : 2000;
    size_t sizes[] = {4096, 2u << 20, 64u << 20, 1u << 30};
    const char *names[] = {"4 KiB", "2 MiB", "64 MiB", "1 GiB"};
    double *t = malloc(sizeof(double) * reps);
    cudaStream_t s;
    cudaFree(0);
    cudaStreamCreate(&s);
    for (int k = 0; k < 4; k++) {
        for (int async = 0; async < 2; async++) {
            for (int i = -20; i < reps; i++) {
                void *p;
                double t0 = now_us();
                if (async) {
                    cudaMallocAsync(&p, sizes[k], s);
                    cudaFreeAsync(p, s);
                } else {
                    cudaMalloc(&p, sizes[k]);
                    cudaFree(p);
                }
                double t1 = now_us();
                if (i >= 0) t[i] = t1 - t0;
            }
            cudaStreamSynchronize(s);
            qsort(t, reps, sizeof *t, cmp);
            printf("bench %s %s %.3f\n", names[k], async ? "async" : "sync", t[reps / 2]);
        }
    }
    return 0;
}
