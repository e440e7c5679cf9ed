/* Finding and loading the GPU backend library (kernels/gpu.h). */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/gpu.h"

#define GPU_LIB "libdiffrag_cuda.so"

struct Loaded {
    pthread_mutex_t mu;
    int tried;
    const struct GpuApi *api;
    char why[512];
};

static struct Loaded loaded = {PTHREAD_MUTEX_INITIALIZER, 0, NULL, ""};

/* Appends "; " (unless first) and s to why, truncating at len. */
static void append(char *why, size_t len, const char *s)
{
    size_t n = strlen(why);
    if (n && n + 2 < len) {
        memcpy(why + n, "; ", 2);
        n += 2;
    }
    size_t k = strlen(s);
    if (n + k >= len) k = len - n - 1;
    memcpy(why + n, s, k);
    why[n + k] = 0;
}

static void *try_open(const char *path, char *why, size_t len)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        append(why, len, e ? e : path);
    }
    return h;
}

static const struct GpuApi *load(char *why, size_t len)
{
    why[0] = 0;
    void *h = NULL;
    const char *env = getenv("DIFFRAG_CUDA_LIB");
    if (env && *env) {
        h = try_open(env, why, len);
    } else {
        char exe[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n > 0) {
            exe[n] = 0;
            char *slash = strrchr(exe, '/');
            if (slash) {
                *slash = 0;
                char path[PATH_MAX + 32];
                snprintf(path, sizeof path, "%s/%s", exe, GPU_LIB);
                if (access(path, R_OK) == 0) h = try_open(path, why, len);
                if (!h) {
                    snprintf(path, sizeof path, "%s/../%s", exe, GPU_LIB);
                    if (access(path, R_OK) == 0) h = try_open(path, why, len);
                }
                if (!h) { /* where `make install` puts it: PREFIX/bin/diffragd, PREFIX/lib */
                    snprintf(path, sizeof path, "%s/../lib/%s", exe, GPU_LIB);
                    if (access(path, R_OK) == 0) h = try_open(path, why, len);
                }
            }
        }
        if (!h) h = try_open(GPU_LIB, why, len);
    }
    if (!h) return NULL;
    const struct GpuApi *(*get)(void) = (const struct GpuApi *(*)(void))dlsym(h, "diffrag_gpu_api");
    if (!get) {
        snprintf(why, len, "%s has no diffrag_gpu_api", GPU_LIB);
        return NULL;
    }
    const struct GpuApi *api = get();
    if (!api || api->version != GPU_API_VERSION) {
        snprintf(why, len, "%s speaks version %d of the GPU table, this program %d", GPU_LIB,
                 api ? api->version : -1, GPU_API_VERSION);
        return NULL;
    }
    return api;
}

const struct GpuApi *gpu_api_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&loaded.mu);
    if (!loaded.tried) {
        loaded.api = load(loaded.why, sizeof loaded.why);
        loaded.tried = 1;
    }
    const struct GpuApi *api = loaded.api;
    if (!api && err && errlen)
        snprintf(err, errlen, "no CUDA backend: %s (this build makes %s only where nvcc is "
                 "installed)", loaded.why, GPU_LIB);
    pthread_mutex_unlock(&loaded.mu);
    return api;
}
