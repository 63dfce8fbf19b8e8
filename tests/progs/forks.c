/* The DataLoader pattern: a program that started CUDA forks workers, which exit normally.
 *
 * The parent allocates (cudaMalloc 3 MiB, cudaMallocAsync 1 MiB) and fills its buffers, stops at
 * checkpoint "before", then forks two workers at once: one that touches no CUDA, and one that
 * reads the parent's buffer and allocates, copies, reads back and frees memory of its own (the
 * emulated driver lets a fork child use CUDA; NVIDIA's does not, natively or under the shim).
 * Both exit with exit(), running their atexit handlers.  The parent reaps them, stops at
 * checkpoint "after", frees and exits.
 *
 * One line per call with its result, never a pointer, the workers' lines in a fixed order, so
 * runs compare natively and under the shim; apart from that, "workers <pid> <pid>" and the
 * checkpoint lines "checkpoint <name> <pid> <address>:<size>:<sum>...", after which it waits for
 * a line on stdin (end of input goes on at once). */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MiB (1u << 20)

typedef struct buf {
    void *p;
    size_t size;
    unsigned long long sum;
} buf;

static void show(const char *what, cudaError_t e) { printf("%-52s %s\n", what, cudaGetErrorName(e)); }

/* FNV-1a over 64-bit words, as tests/progs/lifecycle.c and prog_fault_companion compute it. */
static unsigned long long sum_of(const unsigned long long *w, size_t bytes)
{
    unsigned long long f = 0xcbf29ce484222325ull;
    for (size_t k = 0; k < bytes / 8; k++) f = (f ^ w[k]) * 0x100000001b3ull;
    return f;
}

static void fill(const char *who, buf *b, int seed)
{
    unsigned long long *h = malloc(b->size);
    for (size_t k = 0; k < b->size / 8; k++) h[k] = (k + 1) * 0x9e3779b97f4a7c15ull + (unsigned long long)seed;
    b->sum = sum_of(h, b->size);
    char what[64];
    snprintf(what, sizeof what, "%s cudaMemcpy pattern in", who);
    cudaError_t e = cudaMemcpy(b->p, h, b->size, cudaMemcpyHostToDevice);
    show(what, e);
    if (e != cudaSuccess) b->sum = 0;
    free(h);
}

static void check(const char *who, const buf *b)
{
    unsigned long long *h = malloc(b->size);
    char what[64];
    snprintf(what, sizeof what, "%s cudaMemcpy back", who);
    cudaError_t e = cudaMemcpy(h, b->p, b->size, cudaMemcpyDeviceToHost);
    show(what, e);
    if (e == cudaSuccess && b->sum) printf("%-52s %s\n", "  bytes intact", sum_of(h, b->size) == b->sum ? "yes" : "NO");
    free(h);
}

static void checkpoint(const char *name, const buf *b, int n)
{
    printf("checkpoint %s %d", name, (int)getpid());
    for (int i = 0; i < n; i++)
        if (b[i].p) printf(" 0x%llx:%zu:%llx", (unsigned long long)(uintptr_t)b[i].p, b[i].size, b[i].sum);
    printf("\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return;
}

/* The worker that uses CUDA: the parent's bytes, then memory of its own. */
static void cuda_worker(const buf *parent)
{
    check("worker: parent's buffer", parent);
    buf own = {.size = 2 * MiB};
    show("worker: cudaMalloc 2 MiB", cudaMalloc(&own.p, own.size));
    if (own.p) {
        fill("worker:", &own, 7);
        check("worker:", &own);
    }
    show("worker: cudaFree", cudaFree(own.p));
    void *q = NULL;
    show("worker: cudaMallocAsync 64 KiB", cudaMallocAsync(&q, 64 * 1024, 0));
    show("worker: cudaFreeAsync", cudaFreeAsync(q, 0));
    show("worker: cudaDeviceSynchronize", cudaDeviceSynchronize());
}

int main(void)
{
    buf b[2] = {{.size = 3 * MiB}, {.size = MiB}};
    show("parent: cudaMalloc 3 MiB", cudaMalloc(&b[0].p, b[0].size));
    show("parent: cudaMallocAsync 1 MiB", cudaMallocAsync(&b[1].p, b[1].size, 0));
    show("parent: cudaStreamSynchronize", cudaStreamSynchronize(0));
    for (int i = 0; i < 2; i++)
        if (b[i].p) fill("parent:", &b[i], i);
    checkpoint("before", b, 2);

    fflush(stdout);
    pid_t quiet = fork();
    if (quiet == 0) exit(0); /* a worker that never touches CUDA */
    int go[2];
    if (pipe(go) != 0) return 1;
    pid_t busy = fork();
    if (busy == 0) {
        char c;
        close(go[1]);
        if (read(go[0], &c, 1) != 1) exit(2); /* after the quiet one is reaped: a fixed order */
        cuda_worker(&b[0]);
        fflush(stdout);
        exit(0);
    }
    close(go[0]);
    int st = -1;
    waitpid(quiet, &st, 0);
    printf("%-52s %d\n", "worker without CUDA exited with", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    fflush(stdout);
    if (write(go[1], "g", 1) != 1) return 1;
    close(go[1]);
    waitpid(busy, &st, 0);
    printf("%-52s %d\n", "worker with CUDA exited with", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    printf("workers %d %d\n", (int)quiet, (int)busy);
    check("parent: after the workers", &b[0]);
    checkpoint("after", b, 2);

    show("parent: cudaFree", cudaFree(b[0].p));
    show("parent: cudaFreeAsync", cudaFreeAsync(b[1].p, 0));
    show("parent: cudaDeviceSynchronize", cudaDeviceSynchronize());
    return 0;
}
