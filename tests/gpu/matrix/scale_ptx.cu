/* Row b's kernel, compiled to PTX (nvcc -ptx) and loaded by driver.c with cuModuleLoadData. */
extern "C" __global__ void scale(unsigned *x, unsigned long long n, unsigned mul, unsigned add)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        x[i] = x[i] * mul + add;
}
