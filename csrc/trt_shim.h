/* policyd's C ABI over TensorRT's name-based runtime API (TensorRT 8.5 and later).
 *
 * Why a shim: no maintained Rust binding covers TensorRT 8.6/10's name-based API, and the C++
 * API cannot be called from Rust directly. Every function catches everything: no C++ exception
 * crosses this boundary. A failing call returns TRT_ERR and writes a message into `err`
 * (`err_len` bytes, always NUL-terminated). The Rust side mirrors these signatures in
 * src/engine/tensorrt/shim.rs; keep them in step.
 */
#ifndef POLICYD_TRT_SHIM_H
#define POLICYD_TRT_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TRT_OK 0
#define TRT_ERR (-1)
#define TRT_MAX_DIMS 8

typedef struct trt_engine trt_engine;

/* TensorRT's log messages; severity is nvinfer1::ILogger::Severity (0 internal error .. 4 verbose). */
typedef void (*trt_log_fn)(int32_t severity, const char* msg, void* user);

/* Opens libnvinfer (the given path, or the sonames of TensorRT 11, 10 and 8). TRT_ERR with the
 * loader's message when none loads. Safe to call again; the first success sticks. */
int32_t trt_open_library(const char* path, char* err, size_t err_len);

/* getInferLibVersion() of the loaded library (e.g. 100300 for 10.3.0), or -1 if none is loaded. */
int32_t trt_library_version(void);

/* The TensorRT version the shim was compiled against, in getInferLibVersion()'s scheme
 * (8.x: major*1000 + minor*100 + patch; 10+: major*10000 + minor*100 + patch). */
int32_t trt_header_version(void);

/* Deserializes a plan and creates one execution context. dla_core < 0: the GPU. */
int32_t trt_engine_load(const void* plan, size_t len, int32_t dla_core, trt_log_fn log, void* user,
                        trt_engine** out, char* err, size_t err_len);
void trt_engine_free(trt_engine* e);

int32_t trt_num_io(const trt_engine* e);

/* I/O tensor i: its name (valid while the engine lives), whether it is an input, its
 * nvinfer1::DataType and its shape as the engine declares it (-1 for a dynamic dimension). */
int32_t trt_io_info(const trt_engine* e, int32_t i, const char** name, int32_t* is_input,
                    int32_t* dtype, int64_t* dims, int32_t* nb_dims, char* err, size_t err_len);

/* The shape the execution context resolved for a tensor once every input shape is set (outputs
 * of engines with dynamic shapes); -1 where it is still unknown. */
int32_t trt_context_shape(const trt_engine* e, const char* name, int64_t* dims, int32_t* nb_dims,
                          char* err, size_t err_len);

/* Device memory the execution context took for activations (bytes). */
int64_t trt_scratch_size(const trt_engine* e);

int32_t trt_set_input_shape(trt_engine* e, const char* name, const int64_t* dims, int32_t nb_dims,
                            char* err, size_t err_len);
int32_t trt_set_tensor_address(trt_engine* e, const char* name, void* device_ptr, char* err,
                               size_t err_len);
/* enqueueV3 on a CUDA stream (a CUstream from cudarc is a cudaStream_t). */
int32_t trt_enqueue(trt_engine* e, void* stream, char* err, size_t err_len);

#ifdef __cplusplus
}
#endif
#endif
