/* Runtime semantics a program can observe.  It prints one line per observation; the tests run
 * it natively and under the shim and require identical output (only the pointer values may
 * differ, and they are never printed). */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void show(const char *what, cudaError_t e) { printf("%-44s %s\n", what, cudaGetErrorName(e)); }

int main(void)
{
    void *p = NULL, *q = NULL;
    show("cudaMalloc(NULL, 1)", cudaMalloc(NULL, 1));
    show("  cudaGetLastError", cudaGetLastError());
    show("cudaMalloc(&p, 0)", cudaMalloc(&p, 0));
    printf("%-44s %s\n", "  p after size 0", p ? "non-NULL" : "NULL");
    show("cudaFree(NULL)", cudaFree(NULL));
    show("cudaMalloc(&p, 3 MiB)", cudaMalloc(&p, 3u << 20));
    unsigned char *host = malloc(3u << 20), *back = malloc(3u << 20);
    for (size_t i = 0; i < (3u << 20); i++) host[i] = (unsigned char)(i * 7 + 1);
    show("  cudaMemcpy H2D", cudaMemcpy(p, host, 3u << 20, cudaMemcpyHostToDevice));
    show("  cudaMemcpy D2H", cudaMemcpy(back, p, 3u << 20, cudaMemcpyDeviceToHost));
    printf("%-44s %s\n", "  bytes round-trip", memcmp(host, back, 3u << 20) ? "DIFFER" : "same");
    show("  cudaFree(interior p+4096)", cudaFree((char *)p + 4096));
    show("  cudaGetLastError", cudaGetLastError());
    show("  cudaFree(p)", cudaFree(p));
    show("  cudaFree(p) again (double free)", cudaFree(p));
    show("  cudaGetLastError", cudaGetLastError());
    show("cudaMalloc(&p, 1 TiB)", cudaMalloc(&p, 1ull << 40));
    show("  cudaGetLastError", cudaGetLastError());
    show("  cudaGetLastError again", cudaGetLastError());
    show("cudaMalloc(&p, 4 KiB) after OOM", cudaMalloc(&p, 4096));
    cudaStream_t s;
    show("cudaStreamCreate", cudaStreamCreate(&s));
    show("cudaFreeAsync(cudaMalloc'd p)", cudaFreeAsync(p, s));
    show("cudaMallocAsync(&q, 5 MiB)", cudaMallocAsync(&q, 5u << 20, s));
    show("  cudaMemsetAsync", cudaMemsetAsync(q, 0x5a, 5u << 20, s));
    show("  cudaStreamSynchronize", cudaStreamSynchronize(s));
    show("  cudaMemcpy D2H", cudaMemcpy(back, q, 1u << 20, cudaMemcpyDeviceToHost));
    int ok = 1;
    for (size_t i = 0; i < (1u << 20); i++) ok &= back[i] == 0x5a;
    printf("%-44s %s\n", "  memset visible", ok ? "yes" : "NO");
    show("cudaFree(cudaMallocAsync'd q)", cudaFree(q));
    show("cudaMallocAsync(NULL, 1)", cudaMallocAsync(NULL, 1, s));
    show("  cudaGetLastError", cudaGetLastError());
    show("cudaMallocAsync(&q, 0)", cudaMallocAsync(&q, 0, s));
    show("cudaFreeAsync(NULL)", cudaFreeAsync(NULL, s));
    size_t f = 0, t = 0, f2 = 0;
    show("cudaMemGetInfo", cudaMemGetInfo(&f, &t));
    printf("%-44s %s\n", "  free <= total", f <= t && t > 0 ? "yes" : "NO");
    show("cudaMalloc(&p, 64 MiB)", cudaMalloc(&p, 64u << 20));
    cudaMemGetInfo(&f2, &t);
    printf("%-44s %s\n", "  free dropped by at least 64 MiB", f2 + (64u << 20) <= f ? "yes" : "NO");
    show("  cudaFree(p)", cudaFree(p));
    cudaMemGetInfo(&f2, &t);
    printf("%-44s %s\n", "  free back to where it was", f2 == f ? "yes" : "NO");
    show("cudaStreamDestroy", cudaStreamDestroy(s));
    show("cudaDeviceSynchronize", cudaDeviceSynchronize());
    free(host);
    free(back);
    return 0;
}
