/* An owner that names its tensors (vmmshim.h's owner side), driven line by line on stdin for the
 * tests of named tensors (tests/unit/test_names.c, tests/python/test_names.py).  Linked with the
 * client library, so natively its vmm_publish answers VMM_ERR_NO_SHIM and under the shim it is
 * the shim's.
 *   "a <bytes>"          cudaMalloc; answers "ok <index> 0x<address>"
 *   "w <index> <seed>"   fills the buffer with 64-bit words seed * 0x9e3779b97f4a7c15 + word index
 *   "f <index>"          cudaFree
 *   "p <name> <index> <offset> <dtype> <shape> [<strides>]"
 *                        vmm_publish of the tensor at buffer index + offset bytes; dtype one of
 *                        u8 i32 i64 f16 bf16 f32 f64; shape and strides (elements) as 4x8, "-"
 *                        for none (a scalar; row-major strides)
 *   "x <name> <address> <bytes>"  vmm_publish of bytes uint8 at a raw address (0x...)
 *   "m <prefix> <count> <index> <bytes> [<dup>]"
 *                        vmm_publish_many of count uint8 tensors named <prefix><k>, tensor k at
 *                        buffer index + k * bytes; with dup, the last one named as the first
 *   "u <name>"           vmm_unpublish
 *   "q"                  exits
 * Answers "ok", or "error <vmm_status> <vmm_publish_error()>" (a failed CUDA call: "error cuda
 * <name>"). */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vmmshim.h"

#define MAX_BUFS 64

static int dtype_of(const char *s, vmm_dtype *d)
{
    static const struct {
        const char *name;
        vmm_dtype d;
    } T[] = {{"u8", {VMM_DTYPE_UINT, 8, 1}},    {"i32", {VMM_DTYPE_INT, 32, 1}},   {"i64", {VMM_DTYPE_INT, 64, 1}},
             {"f16", {VMM_DTYPE_FLOAT, 16, 1}}, {"bf16", {VMM_DTYPE_BFLOAT, 16, 1}}, {"f32", {VMM_DTYPE_FLOAT, 32, 1}},
             {"f64", {VMM_DTYPE_FLOAT, 64, 1}}};
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++)
        if (strcmp(s, T[i].name) == 0) {
            *d = T[i].d;
            return 0;
        }
    return -1;
}

/* "4x8" into dims; "-" is none.  The count, or -1. */
static int dims_of(const char *s, int64_t *dims)
{
    if (strcmp(s, "-") == 0) return 0;
    int n = 0;
    for (char *end; *s && n < 16; s = *end == 'x' ? end + 1 : end) {
        dims[n++] = strtoll(s, &end, 10);
        if (end == s) return -1;
    }
    return n;
}

static void answer(vmm_status st)
{
    if (st == VMM_OK) printf("ok\n");
    else printf("error %d %s\n", (int)st, vmm_publish_error());
}

int main(void)
{
    static void *buf[MAX_BUFS];
    static size_t size[MAX_BUFS];
    int n = 0;
    static char line[4096], name[2048], a1[64], a2[256], a3[256];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long a = 0, b = 0, c = 0;
        cudaError_t e = cudaSuccess;
        if (line[0] == 'q') break;
        if (line[0] == 'a' && sscanf(line + 1, "%llu", &a) == 1 && n < MAX_BUFS) {
            size[n] = (size_t)a;
            e = cudaMalloc(&buf[n], size[n]);
            if (e == cudaSuccess) printf("ok %d 0x%llx\n", n, (unsigned long long)(uintptr_t)buf[n]), n++;
        } else if (line[0] == 'w' && sscanf(line + 1, "%llu %llu", &a, &b) == 2 && a < (unsigned long long)n) {
            size_t words = size[a] / 8;
            uint64_t *h = malloc(words * 8);
            for (size_t k = 0; h && k < words; k++) h[k] = b * 0x9e3779b97f4a7c15ull + k;
            e = h ? cudaMemcpy(buf[a], h, words * 8, cudaMemcpyHostToDevice) : cudaErrorMemoryAllocation;
            free(h);
            if (e == cudaSuccess) printf("ok\n");
        } else if (line[0] == 'f' && sscanf(line + 1, "%llu", &a) == 1 && a < (unsigned long long)n) {
            e = cudaFree(buf[a]);
            if (e == cudaSuccess) printf("ok\n");
        } else if (line[0] == 'p') {
            int64_t shape[16], strides[16];
            vmm_dtype d;
            a3[0] = 0;
            int got = sscanf(line + 1, "%2047s %llu %llu %63s %255s %255s", name, &a, &b, a1, a2, a3);
            int ndim = got >= 5 ? dims_of(a2, shape) : -1;
            int nstr = got == 6 ? dims_of(a3, strides) : 0;
            if (got < 5 || a >= (unsigned long long)n || dtype_of(a1, &d) || ndim < 0 || (got == 6 && nstr != ndim))
                printf("error bad command\n");
            else
                answer(vmm_publish(name, (uint64_t)(uintptr_t)buf[a] + b, d, (uint32_t)ndim, shape, got == 6 ? strides : NULL));
        } else if (line[0] == 'x' && sscanf(line + 1, "%2047s %llx %llu", name, &a, &b) == 3) {
            int64_t shape[1] = {(int64_t)b};
            answer(vmm_publish(name, a, (vmm_dtype){VMM_DTYPE_UINT, 8, 1}, 1, shape, NULL));
        } else if (line[0] == 'm' && sscanf(line + 1, "%255s %llu %llu %llu", a2, &a, &b, &c) == 4 && b < (unsigned long long)n) {
            int dup = strstr(line, " dup") != NULL;
            vmm_tensor_desc *t = calloc(a ? a : 1, sizeof *t);
            char (*names)[300] = calloc(a ? a : 1, 300);
            int64_t *shape = calloc(a ? a : 1, sizeof *shape);
            if (!t || !names || !shape) {
                printf("error malloc\n");
            } else {
                for (unsigned long long k = 0; k < a; k++) {
                    snprintf(names[k], 300, "%s%llu", a2, dup && k + 1 == a ? 0ull : k);
                    shape[k] = (int64_t)c;
                    t[k] = (vmm_tensor_desc){.name = names[k], .address = (uint64_t)(uintptr_t)buf[b] + k * c,
                                             .dtype = {VMM_DTYPE_UINT, 8, 1}, .ndim = 1, .shape = &shape[k]};
                }
                answer(vmm_publish_many(t, (size_t)a));
            }
            free(t);
            free(names);
            free(shape);
        } else if (line[0] == 'u' && sscanf(line + 1, "%2047s", name) == 1) {
            answer(vmm_unpublish(name));
        } else {
            printf("error bad command\n");
        }
        if (e != cudaSuccess) printf("error cuda %s\n", cudaGetErrorName(e));
        fflush(stdout);
    }
    return 0;
}
