/* An allocation with a call site to read back: callsite_allocate (exported: the Makefile links
 * this program with -rdynamic) allocates 1 MiB; prints "ready <pid> <address>", then waits for
 * "quit" on stdin.  Run with VMMSHIM_FRAMES set, `vmmctl show` names the function. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

__attribute__((noinline, visibility("default"))) void *callsite_allocate(size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    __asm__ volatile("" ::: "memory"); /* keeps the call a call, not a jump: this frame stays */
    return e == cudaSuccess ? p : NULL;
}

int main(void)
{
    void *p = callsite_allocate(1u << 20);
    if (!p) return 1;
    printf("ready %d 0x%llx\n", (int)getpid(), (unsigned long long)(uintptr_t)p);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin) && strncmp(line, "quit", 4)) {}
    cudaFree(p);
    return 0;
}
