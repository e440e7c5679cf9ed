/* CPU elementwise and matrix operations of the backend table: matrix products through
 * OpenBLAS, RMSNorm, RoPE, SwiGLU, residual adds and KV-cache stores. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "kernels/f16.h"

static void cpu_matmul(struct ThreadPool *pool, float *y, const float *x, const float *w, int n,
                       int k, int m)
{
    (void)pool;
    if (n == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, m, k, 1.f, w, k, x, 1, 0.f, y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.f, x, k, w, k, 0.f, y, m);
}

static void cpu_rmsnorm(struct ThreadPool *pool, float *y, const float *x, const float *w, int n,
                        int d, float eps)
{
    (void)pool;
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * d;
        float *yr = y + (size_t)r * d;
        double ss = 0;
        for (int i = 0; i < d; i++) ss += (double)xr[i] * xr[i];
        float inv = (float)(1.0 / sqrt(ss / d + eps));
        for (int i = 0; i < d; i++) yr[i] = xr[i] * inv * w[i];
    }
}

static void cpu_rope(float *x, int n_tok, size_t stride, int n_heads, int head_dim, int n_rot,
                     int layout, const float *cos_t, const float *sin_t)
{
    int half = n_rot / 2;
    for (int t = 0; t < n_tok; t++) {
        const float *c = cos_t + (size_t)t * half, *s = sin_t + (size_t)t * half;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t)t * stride + (size_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                int a = layout ? i : 2 * i, b = layout ? i + half : 2 * i + 1;
                float xa = v[a], xb = v[b];
                v[a] = xa * c[i] - xb * s[i];
                v[b] = xa * s[i] + xb * c[i];
            }
        }
    }
}

static void cpu_swiglu(float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.f + expf(-g)) * up[i];
    }
}

static void cpu_add(float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

static void cpu_kv_store(void *kcache, void *vcache, enum KvType type, size_t kv_head_stride,
                         const float *k, const float *v, size_t stride, int n_tok, int pos0,
                         int n_kv_head, int head_dim)
{
    for (int t = 0; t < n_tok; t++)
        for (int g = 0; g < n_kv_head; g++) {
            size_t dst = (size_t)g * kv_head_stride + (size_t)(pos0 + t) * head_dim;
            const float *ks = k + (size_t)t * stride + (size_t)g * head_dim;
            const float *vs = v + (size_t)t * stride + (size_t)g * head_dim;
            if (type == KV_F32) {
                memcpy((float *)kcache + dst, ks, (size_t)head_dim * sizeof(float));
                memcpy((float *)vcache + dst, vs, (size_t)head_dim * sizeof(float));
            } else {
                uint16_t *kd = (uint16_t *)kcache + dst, *vd = (uint16_t *)vcache + dst;
                for (int i = 0; i < head_dim; i++) {
                    kd[i] = f32_to_f16(ks[i]);
                    vd[i] = f32_to_f16(vs[i]);
                }
            }
        }
}

const struct Backend backend_cpu = {
    .name = "cpu",
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .attention_scratch = cpu_attention_scratch,
};
