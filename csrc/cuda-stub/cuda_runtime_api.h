/* The two CUDA runtime types TensorRT's headers use, for compiling the shim where the CUDA
 * toolkit's headers are absent (CI). The shim calls no CUDA function: cudarc owns CUDA. Set
 * CUDA_INCLUDE_DIR (or have /usr/local/cuda/include) to compile against the real header. */
#ifndef POLICYD_CUDA_RUNTIME_API_STUB_H
#define POLICYD_CUDA_RUNTIME_API_STUB_H
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
