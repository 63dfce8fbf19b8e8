/* Shared by the matrix's C/CUDA programs: the pause protocol and a deterministic pattern.
 * Volatile values (pointers, pids) go only on lines starting with '#': matrix.sh compares the
 * rest of the output of a native run and a run under the shim. */
#ifndef MATRIX_COMMON_H
#define MATRIX_COMMON_H
#include <stdio.h>
#include <unistd.h>

/* Print "# pause PID" and wait for a line on stdin (EOF, as natively with </dev/null, goes on). */
static void pause_point(void)
{
    char line[64];
    printf("# pause %d\n", (int)getpid());
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;
}

#ifdef __CUDACC__
#define MATRIX_HD __host__ __device__
#else
#define MATRIX_HD
#endif
/* A 32-bit mix of (index, seed): every word of a buffer differs, every seed differs. */
static MATRIX_HD inline unsigned mix(unsigned long long i, unsigned seed)
{
    unsigned long long x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull + 1;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (unsigned)x;
}
#endif
