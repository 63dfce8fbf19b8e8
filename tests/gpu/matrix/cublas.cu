/* Row k: cuBLAS (nvcc ... -lcublas).  SGEMM on small-integer data, so that every product and sum
 * is exact whatever algorithm cuBLAS picks: the checksum is a deterministic integer. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

#define CK(call)                                                                                       \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            printf("error %s: %s\n", #call, cudaGetErrorName(e_));                                     \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)
#define CB(call)                                                                                       \
    do {                                                                                               \
        cublasStatus_t s_ = (call);                                                                    \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                             \
            printf("error %s: cublas status %d\n", #call, (int)s_);                                    \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

int main(void)
{
    const int M = 512, K = 384, N = 256; /* column-major: A is M x K, B is K x N, C is M x N */
    float *hA = (float *)malloc(sizeof(float) * M * K), *hB = (float *)malloc(sizeof(float) * K * N),
          *hC = (float *)malloc(sizeof(float) * M * N);
    for (int i = 0; i < M * K; i++) hA[i] = (float)(i % 7 - 3);
    for (int i = 0; i < K * N; i++) hB[i] = (float)(i % 5 - 2);
    float *A, *B, *C;
    CK(cudaMalloc((void **)&A, sizeof(float) * M * K));
    CK(cudaMalloc((void **)&B, sizeof(float) * K * N));
    CK(cudaMalloc((void **)&C, sizeof(float) * M * N));
    CK(cudaMemcpy(A, hA, sizeof(float) * M * K, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(B, hB, sizeof(float) * K * N, cudaMemcpyHostToDevice));
    cublasHandle_t h;
    CB(cublasCreate(&h));
    float alpha = 1.0f, beta = 0.0f;
    CB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &alpha, A, M, B, K, &beta, C, M));
    CK(cudaMemcpy(hC, C, sizeof(float) * M * N, cudaMemcpyDeviceToHost));
    long long sum = 0;
    for (int i = 0; i < M * N; i++) sum += (long long)hC[i];
    int ok = 1;
    for (int r = 0; r < M; r += 37)
        for (int c = 0; c < N; c += 29) {
            long long ref = 0;
            for (int k = 0; k < K; k++) ref += (long long)hA[r + (size_t)k * M] * (long long)hB[k + (size_t)c * K];
            ok &= (long long)hC[r + (size_t)c * M] == ref;
        }
    printf("sgemm %dx%dx%d: checksum %lld, host reference %s\n", M, N, K, sum, ok ? "matches" : "DIFFERS");
    printf("# A %p B %p C %p\n", (void *)A, (void *)B, (void *)C);

    pause_point(); /* A, B, C and cuBLAS's workspace are live */

    /* C = 2 * A * B + C, then C^T * C's trace-like checksum through a second call */
    alpha = 2.0f;
    beta = 1.0f;
    CB(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &alpha, A, M, B, K, &beta, C, M));
    CK(cudaMemcpy(hC, C, sizeof(float) * M * N, cudaMemcpyDeviceToHost));
    sum = 0;
    for (int i = 0; i < M * N; i++) sum += (long long)hC[i];
    printf("sgemm accumulate: checksum %lld\n", sum);
    CB(cublasDestroy(h));
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(C));
    free(hA);
    free(hB);
    free(hC);
    printf("done\n");
    return 0;
}
