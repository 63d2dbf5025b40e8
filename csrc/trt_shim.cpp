// policyd's shim over TensorRT's C++ runtime API; the ABI is documented in trt_shim.h.
//
// Only the name-based API of TensorRT 8.5+ is used (getNbIOTensors, setInputShape,
// setTensorAddress, enqueueV3), so one source covers JetPack 5.1 (8.5), 6.0 (8.6) and 6.1+ (10.x).
// Calls that differ between major versions are behind NV_TENSORRT_MAJOR.

#include <stdio.h>
#include <string.h>

#include <memory>
#include <new>
#include <type_traits>

#include "NvInferRuntime.h"
#include "trt_shim.h"

namespace {

void put(char* err, size_t n, const char* msg) {
    if (err && n) {
        snprintf(err, n, "%s", msg);
    }
}

// Routes TensorRT's messages to the Rust logger.
class Logger final : public nvinfer1::ILogger {
public:
    Logger(trt_log_fn fn, void* user) : fn_(fn), user_(user) {}
    void log(Severity severity, const char* msg) noexcept override {
        if (fn_) {
            fn_(static_cast<int32_t>(severity), msg, user_);
        }
    }

private:
    trt_log_fn fn_;
    void* user_;
};

// Copies a shape out; TRT_ERR for a rank the ABI cannot carry (or -1: no shape).
int32_t put_dims(const nvinfer1::Dims& d, int64_t* dims, int32_t* nb_dims, char* err,
                 size_t err_len) {
    if (d.nbDims < 0 || d.nbDims > TRT_MAX_DIMS) {
        put(err, err_len, "the tensor has no shape, or a rank above 8");
        return TRT_ERR;
    }
    *nb_dims = d.nbDims;
    for (int32_t k = 0; k < d.nbDims; ++k) {
        dims[k] = static_cast<int64_t>(d.d[k]);
    }
    return TRT_OK;
}

}  // namespace

// Declared in this order so that they are destroyed in reverse: the context before the engine,
// the engine before the runtime, and the logger last (the runtime logs until it is gone).
struct trt_engine {
    Logger logger;
    std::unique_ptr<nvinfer1::IRuntime> runtime;
    std::unique_ptr<nvinfer1::ICudaEngine> engine;
    std::unique_ptr<nvinfer1::IExecutionContext> context;
    trt_engine(trt_log_fn fn, void* user) : logger(fn, user) {}
};

extern "C" int32_t trt_header_version(void) {
    // The scheme getInferLibVersion() uses for the same release.
#if NV_TENSORRT_MAJOR >= 10
    return (NV_TENSORRT_MAJOR * 100 + NV_TENSORRT_MINOR) * 100 + NV_TENSORRT_PATCH;
#else
    return NV_TENSORRT_MAJOR * 1000 + NV_TENSORRT_MINOR * 100 + NV_TENSORRT_PATCH;
#endif
}

extern "C" int32_t trt_engine_load(const void* plan, size_t len, int32_t dla_core, trt_log_fn log,
                                   void* user, trt_engine** out, char* err, size_t err_len) {
    try {
        *out = nullptr;
        if (trt_library_version() < 0) {
            put(err, err_len, "libnvinfer is not loaded");
            return TRT_ERR;
        }
        std::unique_ptr<trt_engine> e(new trt_engine(log, user));
        e->runtime.reset(nvinfer1::createInferRuntime(e->logger));
        if (!e->runtime) {
            put(err, err_len, "createInferRuntime failed (see the TensorRT messages above)");
            return TRT_ERR;
        }
        if (dla_core >= 0) {
            if (dla_core >= e->runtime->getNbDLACores()) {
                char msg[128];
                snprintf(msg, sizeof(msg), "DLA core %d requested, this device has %d", dla_core,
                         e->runtime->getNbDLACores());
                put(err, err_len, msg);
                return TRT_ERR;
            }
            e->runtime->setDLACore(dla_core);
        }
        e->engine.reset(e->runtime->deserializeCudaEngine(plan, len));
        if (!e->engine) {
            put(err, err_len,
                "deserializeCudaEngine failed: the plan was built by another TensorRT version or "
                "for another GPU, or is not a TensorRT plan; rebuild it on this device with trtexec");
            return TRT_ERR;
        }
        e->context.reset(e->engine->createExecutionContext());
        if (!e->context) {
            put(err, err_len, "createExecutionContext failed (out of device memory?)");
            return TRT_ERR;
        }
        *out = e.release();
        return TRT_OK;
    } catch (const std::exception& x) {
        put(err, err_len, x.what());
    } catch (...) {
        put(err, err_len, "unknown C++ exception in trt_engine_load");
    }
    return TRT_ERR;
}

extern "C" void trt_engine_free(trt_engine* e) {
    try {
        delete e;
    } catch (...) {
    }
}

extern "C" int32_t trt_num_io(const trt_engine* e) {
    return e->engine->getNbIOTensors();
}

extern "C" int32_t trt_io_info(const trt_engine* e, int32_t i, const char** name,
                               int32_t* is_input, int32_t* dtype, int64_t* dims, int32_t* nb_dims,
                               char* err, size_t err_len) {
    try {
        const char* n = e->engine->getIOTensorName(i);
        if (!n) {
            put(err, err_len, "I/O tensor index out of range");
            return TRT_ERR;
        }
        *name = n;
        *is_input = e->engine->getTensorIOMode(n) == nvinfer1::TensorIOMode::kINPUT ? 1 : 0;
        *dtype = static_cast<int32_t>(e->engine->getTensorDataType(n));
        return put_dims(e->engine->getTensorShape(n), dims, nb_dims, err, err_len);
    } catch (...) {
        put(err, err_len, "C++ exception in trt_io_info");
    }
    return TRT_ERR;
}

extern "C" int32_t trt_context_shape(const trt_engine* e, const char* name, int64_t* dims,
                                     int32_t* nb_dims, char* err, size_t err_len) {
    try {
        return put_dims(e->context->getTensorShape(name), dims, nb_dims, err, err_len);
    } catch (...) {
        put(err, err_len, "C++ exception in trt_context_shape");
    }
    return TRT_ERR;
}

extern "C" int64_t trt_scratch_size(const trt_engine* e) {
#if NV_TENSORRT_MAJOR >= 10
    return static_cast<int64_t>(e->engine->getDeviceMemorySizeV2());
#else
    return static_cast<int64_t>(e->engine->getDeviceMemorySize());
#endif
}

extern "C" int32_t trt_set_input_shape(trt_engine* e, const char* name, const int64_t* dims,
                                       int32_t nb_dims, char* err, size_t err_len) {
    try {
        if (nb_dims < 0 || nb_dims > nvinfer1::Dims::MAX_DIMS) {
            put(err, err_len, "shape has too many dimensions");
            return TRT_ERR;
        }
        nvinfer1::Dims d{};
        d.nbDims = nb_dims;
        for (int32_t k = 0; k < nb_dims; ++k) {
            d.d[k] = static_cast<std::remove_reference<decltype(d.d[0])>::type>(dims[k]);
        }
        if (!e->context->setInputShape(name, d)) {
            put(err, err_len,
                "setInputShape refused the shape (outside the engine's optimization profile?)");
            return TRT_ERR;
        }
        return TRT_OK;
    } catch (...) {
        put(err, err_len, "C++ exception in trt_set_input_shape");
    }
    return TRT_ERR;
}

extern "C" int32_t trt_set_tensor_address(trt_engine* e, const char* name, void* device_ptr,
                                          char* err, size_t err_len) {
    try {
        if (!e->context->setTensorAddress(name, device_ptr)) {
            put(err, err_len, "setTensorAddress failed (unknown tensor or misaligned address)");
            return TRT_ERR;
        }
        return TRT_OK;
    } catch (...) {
        put(err, err_len, "C++ exception in trt_set_tensor_address");
    }
    return TRT_ERR;
}

extern "C" int32_t trt_enqueue(trt_engine* e, void* stream, char* err, size_t err_len) {
    try {
        if (!e->context->enqueueV3(static_cast<cudaStream_t>(stream))) {
            put(err, err_len, "enqueueV3 failed (see the TensorRT messages above)");
            return TRT_ERR;
        }
        return TRT_OK;
    } catch (...) {
        put(err, err_len, "C++ exception in trt_enqueue");
    }
    return TRT_ERR;
}
