/* Copies of one device's cudaMalloc memory while another device is current (needs two devices):
 * natively the runtime copies any device's memory from any context; the shim's memory is VMM
 * memory, which a context may copy only when its device was granted access.  Prints observations
 * only, so native and shim runs compare line by line. */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdio.h>

static void copy_from(const char *what, const unsigned char *d)
{
    unsigned char h[4] = {0};
    cudaError_t e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    printf("%s: %s, first byte 0x%02x\n", what, cudaGetErrorName(e), h[0]);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
        printf("needs two devices, found %d\n", n);
        return 2;
    }
    unsigned char *p;
    cudaSetDevice(0);
    cudaMalloc((void **)&p, 4u << 20);
    cudaMemset(p, 0x5a, 4u << 20);
    cudaDeviceSynchronize();
    cudaSetDevice(1);
    copy_from("device 1 current, no peer access", p);
    CUcontext ctx0;
    cuDevicePrimaryCtxRetain(&ctx0, 0);
    printf("enable peer access to device 0: %d\n", (int)cuCtxEnablePeerAccess(ctx0, 0));
    copy_from("device 1 current, peer access enabled", p);
    printf("disable it again: %d\n", (int)cuCtxDisablePeerAccess(ctx0));
    copy_from("device 1 current, peer access disabled", p);
    cudaSetDevice(0);
    unsigned char *q;
    cudaMalloc((void **)&q, 64u << 20); /* a segment made after all that */
    cudaMemset(q, 0x33, 64u << 20);
    cudaDeviceSynchronize();
    cudaSetDevice(1);
    copy_from("device 1 current, memory made later", q);
    cudaSetDevice(0);
    cudaFree(p);
    cudaFree(q);
    return 0;
}
