// Loads libnvinfer at run time, so policyd links and starts on machines without TensorRT and
// reports the backend unavailable as an ordinary error.
//
// The shim needs exactly two symbols from libnvinfer; everything else is reached through the
// virtual tables of the objects they return. This file defines both as forwarders to the
// library opened by trt_open_library().

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <mutex>

#include "NvInferVersion.h"
#include "trt_shim.h"

#define POLICYD_STR2(x) #x
#define POLICYD_STR(x) POLICYD_STR2(x)

namespace {
using CreateRuntimeFn = void* (*)(void*, int32_t);
using VersionFn = int32_t (*)();

std::mutex g_lock;
void* g_lib = nullptr;
CreateRuntimeFn g_create = nullptr;
VersionFn g_version = nullptr;

void put(char* err, size_t n, const char* msg) {
    if (err && n) {
        snprintf(err, n, "%s", msg);
    }
}
}  // namespace

extern "C" int32_t trt_open_library(const char* path, char* err, size_t err_len) {
    std::lock_guard<std::mutex> guard(g_lock);
    if (g_lib) {
        return TRT_OK;
    }
    // The major the shim was compiled against first: its ABI is the one it speaks.
    const char* names[] = {path, "libnvinfer.so." POLICYD_STR(NV_TENSORRT_MAJOR),
                           "libnvinfer.so.11", "libnvinfer.so.10", "libnvinfer.so.8",
                           "libnvinfer.so"};
    char tried[1024] = {0};
    for (const char* name : names) {
        if (!name || !*name) {
            continue;
        }
        void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char* why = dlerror();
            size_t used = strlen(tried);
            snprintf(tried + used, sizeof(tried) - used, "%s%s", used ? "; " : "",
                     why ? why : name);
            continue;
        }
        auto create = reinterpret_cast<CreateRuntimeFn>(dlsym(lib, "createInferRuntime_INTERNAL"));
        auto version = reinterpret_cast<VersionFn>(dlsym(lib, "getInferLibVersion"));
        if (!create || !version) {
            size_t used = strlen(tried);
            snprintf(tried + used, sizeof(tried) - used, "%s%s: not a TensorRT runtime library",
                     used ? "; " : "", name);
            dlclose(lib);
            continue;
        }
        g_lib = lib;
        g_create = create;
        g_version = version;
        return TRT_OK;
    }
    put(err, err_len, tried);
    return TRT_ERR;
}

extern "C" int32_t trt_library_version(void) {
    std::lock_guard<std::mutex> guard(g_lock);
    return g_version ? g_version() : -1;
}

// The two libnvinfer entry points the inline wrappers in NvInferRuntime.h call.
extern "C" void* createInferRuntime_INTERNAL(void* logger, int32_t version) noexcept {
    return g_create ? g_create(logger, version) : nullptr;
}

extern "C" int32_t getInferLibVersion() noexcept {
    return g_version ? g_version() : -1;
}
