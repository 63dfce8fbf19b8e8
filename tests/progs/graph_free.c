/* A cudaFreeAsync captured into a graph, of memory allocated before the capture.  Natively (an
 * H100, driver 580, CUDA 13) the free is refused with cudaErrorInvalidValue, the capture goes on,
 * and the memory stays allocated: a later cudaFreeAsync outside the capture frees it.  Prints
 * every call's result, to compare native and shim runs. */
#include <cuda_runtime_api.h>
#include <stdio.h>

#define SIZE (64u << 20)

static const char *n(cudaError_t e) { return cudaGetErrorName(e); }

int main(void)
{
    cudaStream_t s;
    void *p = NULL;
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaError_t a = cudaMallocAsync(&p, SIZE, s);
    cudaError_t m = cudaMemsetAsync(p, 7, SIZE, s);
    cudaStreamSynchronize(s);
    cudaError_t b = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaError_t f = cudaFreeAsync(p, s);
    cudaError_t last = cudaGetLastError();
    cudaError_t e = cudaStreamEndCapture(s, &g);
    printf("malloc %s memset %s begin %s captured free %s last error %s end %s\n", n(a), n(m), n(b), n(f), n(last), n(e));
    if (e == cudaSuccess) {
        cudaError_t i = cudaGraphInstantiate(&x, g, 0);
        cudaError_t l = i == cudaSuccess ? cudaGraphLaunch(x, s) : i;
        printf("instantiate %s launch %s sync %s\n", n(i), n(l), n(cudaStreamSynchronize(s)));
    }
    unsigned char byte = 0;
    cudaError_t r = cudaMemcpy(&byte, p, 1, cudaMemcpyDeviceToHost);
    printf("still allocated: read %s byte %u\n", n(r), byte);
    cudaError_t f2 = cudaFreeAsync(p, s);
    printf("free after the capture %s sync %s\n", n(f2), n(cudaStreamSynchronize(s)));
    if (x) cudaGraphExecDestroy(x);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(s);
    return 0;
}
