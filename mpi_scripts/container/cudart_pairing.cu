// The GPU image's pairing on a GPU (docs/containers.md): a kernel compiled by nvcc 13.0, as
// Horovod's cuda_kernels.cu is there, whose host stubs (__cudaRegisterFatBinary,
// __cudaLaunchKernel) bind at run time to the libcudart the program was linked with: 12.9, as
// TensorFlow 2.21's GPU build exports it, or 13.0 and cudart_static as the controls.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void scale_add(float* x, float a, float b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = a * x[i] + b;
}

int main() {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  const int n = 1 << 20;
  float* host = new float[n];
  for (int i = 0; i < n; ++i) host[i] = float(i % 7);
  float* dev = nullptr;
  cudaError_t err = cudaMalloc(&dev, n * sizeof(float));
  if (err != cudaSuccess) { std::printf("runtime %d driver %d: cudaMalloc: %s\n", runtime, driver, cudaGetErrorString(err)); return 2; }
  cudaMemcpy(dev, host, n * sizeof(float), cudaMemcpyHostToDevice);
  scale_add<<<(n + 255) / 256, 256>>>(dev, 2.0f, 1.0f, n);
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) { std::printf("runtime %d driver %d: kernel: %s\n", runtime, driver, cudaGetErrorString(err)); return 3; }
  cudaMemcpy(host, dev, n * sizeof(float), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += host[i] != 2.0f * float(i % 7) + 1.0f;
  std::printf("runtime %d driver %d: kernel ran, %d of %d wrong\n", runtime, driver, wrong, n);
  return wrong != 0;
}
