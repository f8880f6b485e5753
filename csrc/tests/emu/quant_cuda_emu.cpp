// quant_cuda.cu compiled by the host compiler for the CUDA emulator (cuda_runtime.h here, first on the include
// path), with its device code paths (__CUDA_ARCH__): see cuda_runtime.h.
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900
#include "../../quant_cuda.cu"
