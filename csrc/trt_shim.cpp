// policyd's shim over TensorRT's C++ runtime API; the ABI is documented in trt_shim.h.
//
// Only the name-based API of TensorRT 8.5+ is used (getNbIOTensors, setInputShape,
// setTensorAddress, enqueueV3), so one source covers JetPack 5.1 (8.5), 6.0 (8.6) and 6.1+ (10.x).
// Calls that differ between major versions are behind NV_TENSORRT_MAJOR.

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>

#include "NvInferRuntime.h"
#include "NvInferVersion.h"
#include "trt_shim.h"

namespace {

void put(char* err, size_t n, const char* msg) {
    if (err && n) {
        snprintf(err, n, "%s", msg);
    }
}

// Routes TensorRT's messages to the Rust logger. One for the process (see trt_set_logger): it
// is never destroyed, so no runtime, engine or plugin can outlive it.
class Logger final : public nvinfer1::ILogger {
public:
    void set(trt_log_fn fn, void* user, int32_t max_severity) {
        user_.store(user);
        fn_.store(fn);
        max_.store(max_severity);
    }
    void set_max(int32_t max_severity) { max_.store(max_severity); }
    void log(Severity severity, const char* msg) noexcept override {
        // Deserialisation can log thousands of verbose lines: drop them before any call.
        if (static_cast<int32_t>(severity) > max_.load(std::memory_order_relaxed)) {
            return;
        }
        trt_log_fn fn = fn_.load();
        if (fn) {
            fn(static_cast<int32_t>(severity), msg, user_.load());
        }
    }

private:
    std::atomic<trt_log_fn> fn_{nullptr};
    std::atomic<void*> user_{nullptr};
    std::atomic<int32_t> max_{static_cast<int32_t>(Severity::kWARNING)};
};

Logger& process_logger() {
    static Logger* logger = new Logger();  // deliberately leaked: lives as long as TensorRT
    return *logger;
}

// What trt_init_plugins found, for the deserialisation error.
std::mutex g_plugins_lock;
int32_t g_plugins = -2;  // -2 not tried, else trt_init_plugins' result
std::string g_plugins_msg;

#define POLICYD_STR2(x) #x
#define POLICYD_STR(x) POLICYD_STR2(x)

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
// the engine before the runtime. The logger is the process's (process_logger).
struct trt_engine {
    std::unique_ptr<nvinfer1::IRuntime> runtime;
    std::unique_ptr<nvinfer1::ICudaEngine> engine;
    std::unique_ptr<nvinfer1::IExecutionContext> context;
};

extern "C" void trt_set_logger(trt_log_fn log, void* user, int32_t max_severity) {
    static std::once_flag once;
    bool first = false;
    std::call_once(once, [&] {
        process_logger().set(log, user, max_severity);
        first = true;
    });
    if (!first) {
        // The destination stays (TensorRT holds the logger); only the level changes.
        process_logger().set_max(max_severity);
    }
}

extern "C" int32_t trt_init_plugins(char* msg, size_t msg_len) {
    std::lock_guard<std::mutex> guard(g_plugins_lock);
    if (g_plugins != -2) {
        put(msg, msg_len, g_plugins_msg.c_str());
        return g_plugins;
    }
    using InitFn = bool (*)(void*, const char*);
    const char* names[] = {"libnvinfer_plugin.so." POLICYD_STR(NV_TENSORRT_MAJOR),
                           "libnvinfer_plugin.so"};
    std::string tried;
    for (const char* name : names) {
        void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
        if (!lib) {
            const char* why = dlerror();
            tried += tried.empty() ? "" : "; ";
            tried += why ? why : name;
            continue;
        }
        auto init = reinterpret_cast<InitFn>(dlsym(lib, "initLibNvInferPlugins"));
        if (!init) {
            g_plugins = TRT_ERR;
            g_plugins_msg = std::string(name) + " has no initLibNvInferPlugins";
        } else if (!init(&process_logger(), "")) {
            g_plugins = TRT_ERR;
            g_plugins_msg = std::string("initLibNvInferPlugins failed in ") + name;
        } else {
            g_plugins = 1;
            g_plugins_msg = std::string("plugins from ") + name;
        }
        put(msg, msg_len, g_plugins_msg.c_str());
        return g_plugins;  // the library stays loaded: its creators are registered
    }
    g_plugins = 0;
    g_plugins_msg = "no plugin library: " + tried;
    put(msg, msg_len, g_plugins_msg.c_str());
    return 0;
}

extern "C" int32_t trt_header_version(void) {
    // The scheme getInferLibVersion() uses for the same release.
#if NV_TENSORRT_MAJOR >= 10
    return (NV_TENSORRT_MAJOR * 100 + NV_TENSORRT_MINOR) * 100 + NV_TENSORRT_PATCH;
#else
    return NV_TENSORRT_MAJOR * 1000 + NV_TENSORRT_MINOR * 100 + NV_TENSORRT_PATCH;
#endif
}

extern "C" int32_t trt_engine_load(const void* plan, size_t len, int32_t dla_core,
                                   trt_engine** out, char* err, size_t err_len) {
    try {
        *out = nullptr;
        if (trt_library_version() < 0) {
            put(err, err_len, "libnvinfer is not loaded");
            return TRT_ERR;
        }
        std::unique_ptr<trt_engine> e(new trt_engine());
        e->runtime.reset(nvinfer1::createInferRuntime(process_logger()));
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
            std::string why =
                "deserializeCudaEngine failed (see the TensorRT messages above): the plan was "
                "built by another TensorRT version or for another GPU, has plugin layers whose "
                "library is not loaded, or is not a TensorRT plan; rebuild it on this device with "
                "trtexec. Plugins: ";
            {
                std::lock_guard<std::mutex> guard(g_plugins_lock);
                why += g_plugins == -2 ? std::string("not initialised") : g_plugins_msg;
            }
            put(err, err_len, why.c_str());
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
                               int32_t* location, int32_t* format, int32_t* components, char* err,
                               size_t err_len) {
    try {
        const char* n = e->engine->getIOTensorName(i);
        if (!n) {
            put(err, err_len, "I/O tensor index out of range");
            return TRT_ERR;
        }
        *name = n;
        *is_input = e->engine->getTensorIOMode(n) == nvinfer1::TensorIOMode::kINPUT ? 1 : 0;
        *dtype = static_cast<int32_t>(e->engine->getTensorDataType(n));
        *location = static_cast<int32_t>(e->engine->getTensorLocation(n));
        *format = static_cast<int32_t>(e->engine->getTensorFormat(n));
        *components = e->engine->getTensorComponentsPerElement(n);
        return put_dims(e->engine->getTensorShape(n), dims, nb_dims, err, err_len);
    } catch (...) {
        put(err, err_len, "C++ exception in trt_io_info");
    }
    return TRT_ERR;
}

extern "C" int32_t trt_profile_shape(const trt_engine* e, const char* name, int32_t which,
                                     int64_t* dims, int32_t* nb_dims, char* err, size_t err_len) {
    try {
        if (which < 0 || which > 2 || e->engine->getNbOptimizationProfiles() < 1) {
            put(err, err_len, "no optimisation profile");
            return TRT_ERR;
        }
        nvinfer1::Dims d =
            e->engine->getProfileShape(name, 0, static_cast<nvinfer1::OptProfileSelector>(which));
        if (d.nbDims < 0) {
            put(err, err_len, "the input has no profile shape");
            return TRT_ERR;
        }
        return put_dims(d, dims, nb_dims, err, err_len);
    } catch (...) {
        put(err, err_len, "C++ exception in trt_profile_shape");
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
    // getDeviceMemorySizeV2 exists from TensorRT 10.1 on.
#if NV_TENSORRT_MAJOR > 10 || (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR >= 1)
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
