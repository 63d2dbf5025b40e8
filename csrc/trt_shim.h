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

/* Opens libnvinfer (the given path, or the soname of the headers' major version first, then
 * those of TensorRT 11, 10 and 8). TRT_ERR with the loader's message when none loads. Safe to
 * call again; the first success sticks. */
int32_t trt_open_library(const char* path, char* err, size_t err_len);

/* getInferLibVersion() of the loaded library (e.g. 100300 for 10.3.0), or -1 if none is loaded. */
int32_t trt_library_version(void);

/* The TensorRT version the shim was compiled against, in getInferLibVersion()'s scheme
 * (8.x: major*1000 + minor*100 + patch; 10+: major*10000 + minor*100 + patch). */
int32_t trt_header_version(void);

/* TensorRT keeps a single logger pointer per process ("to use a new logger, first destroy all
 * existing builder, runner or refitter objects"), so the shim owns one logger for the life of
 * the process and every runtime uses it. This sets where its messages go and the most verbose
 * severity passed on: messages above it are dropped before anything is formatted. Call it
 * before the first trt_engine_load; later calls change only the severity. */
void trt_set_logger(trt_log_fn log, void* user, int32_t max_severity);

/* Opens libnvinfer_plugin (the soname of the headers' major version, then the unversioned name)
 * and calls initLibNvInferPlugins once with the process logger, so that plans with plugin layers
 * (InstanceNormalization and GroupNorm map to plugins on TensorRT 8.x) deserialize. 1: done
 * (now or before); 0: no plugin library, `msg` says what was tried; TRT_ERR: it failed. */
int32_t trt_init_plugins(char* msg, size_t msg_len);

/* Deserializes a plan and creates one execution context. dla_core < 0: the GPU. */
int32_t trt_engine_load(const void* plan, size_t len, int32_t dla_core, trt_engine** out,
                        char* err, size_t err_len);
void trt_engine_free(trt_engine* e);

int32_t trt_num_io(const trt_engine* e);

/* I/O tensor i: its name (valid while the engine lives), whether it is an input, its
 * nvinfer1::DataType, its shape as the engine declares it (-1 for a dynamic dimension), its
 * nvinfer1::TensorLocation (0 device, 1 host: shape tensors), its nvinfer1::TensorFormat
 * (0 linear; vectorised formats such as kCHW16 come from --inputIOFormats) and its components
 * per element (1 unless vectorised). */
int32_t trt_io_info(const trt_engine* e, int32_t i, const char** name, int32_t* is_input,
                    int32_t* dtype, int64_t* dims, int32_t* nb_dims, int32_t* location,
                    int32_t* format, int32_t* components, char* err, size_t err_len);

/* An input's shape in optimisation profile 0: `which` 0 = kMIN, 1 = kOPT, 2 = kMAX. TRT_ERR when
 * the input has no profile shape (a static input). */
int32_t trt_profile_shape(const trt_engine* e, const char* name, int32_t which, int64_t* dims,
                          int32_t* nb_dims, char* err, size_t err_len);

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
