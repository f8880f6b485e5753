// csrc/tests/test_cuda.cu compiled by the host compiler against the CUDA emulator (cuda_runtime.h here, first
// on the include path): the CUDA kernels against the CPU kernels, run on the CPU. Host code, as nvcc's host pass
// sees it (__CUDACC__ without __CUDA_ARCH__).
#define __CUDACC__ 1
#include "../test_cuda.cu"
