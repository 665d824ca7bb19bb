/* splitserve CPU kernels: the small ops of a transformer step, fused (float32 only).
 *
 * Built by cpu_build.py at first use with -O3 -march=native for the host it runs on (the build
 * is cached per source hash and CPU flags), loaded with ctypes and called from cpu_ops.py, which
 * keeps a pure-torch path for every op. Plain C over raw pointers; threads are OpenMP over
 * independent rows.
 *
 *   ss_rms_norm         out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w
 *   ss_add_rms_norm     res[t] += x[t]; out[t] = rms_norm(res[t])        (residual add fused)
 *   ss_rope_write_kv    rotate q and k of a fused qkv row in place (rotate-half layout, cos/sin
 *                       read from the model's tables by position) and store k, v in their slots
 *   ss_decode_attention one query token per sequence against its paged K/V, read in place
 *                       through the block table (no gather, no copy); GQA by query groups per KV
 *                       head; scores, softmax and sums in float32
 *   ss_silu_mul         out[t] = silu(gate[t]) * up[t] for a fused gate|up row
 *
 * Batch invariance: every sum runs in an order fixed by the source (LANES partial sums combined
 * in a fixed tree), never by the vector width, the alignment or the thread count, so a row gets
 * the same bits whatever else is in the batch. No -ffast-math: the compiler may not reassociate.
 * exp is our own (exp2 split + degree-6 polynomial, max relative error ~2e-7), so it vectorizes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float sum_lanes(const float *p) {
    float s8[8];
    for (int i = 0; i < 8; i++) s8[i] = p[i] + p[i + 8];
    float s4[4];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = sum_lanes(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float sum_squares(const float *a, int64_t n) { return dot(a, a, n); }

/* exp(x) for x <= 0 (softmax) and moderate |x| (silu): 2^n * p(f), f in [-0.5, 0.5]. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    float n = nearbyintf(t);
    float f = (t - n) * 0.693147180559945309f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666671633720f + f * (0.0416664853692055f
              + f * (0.00833336077630519f + f * 0.00139053508546203f)))));
    union { float f; int32_t i; } u = {p};
    u.i += (int32_t)n << 23;
    return u.f;
}

static inline void norm_row(const float *x, const float *w, float *out, int64_t h, float eps) {
    float inv = 1.0f / sqrtf(sum_squares(x, h) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = x[i] * inv * w[i];
}

void ss_rms_norm(const float *x, const float *w, float *out, int64_t t, int64_t h, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) norm_row(x + r * h, w, out + r * h, h, eps);
}

void ss_add_rms_norm(const float *x, float *res, const float *w, float *out, int64_t t, int64_t h, float eps,
                     int threads) {
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) {
        float *rr = res + r * h;
        const float *xr = x + r * h;
        for (int64_t i = 0; i < h; i++) rr[i] += xr[i];
        norm_row(rr, w, out + r * h, h, eps);
    }
}

static inline void rotate(float *v, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

void ss_rope_write_kv(float *qkv, const int64_t *positions, const float *cos_cache, const float *sin_cache,
                      float *k_cache, float *v_cache, const int64_t *slots, int64_t t, int64_t nh, int64_t nkv,
                      int64_t d, int threads) {
    int64_t row = (nh + 2 * nkv) * d, kv = nkv * d;
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) {
        float *q = qkv + r * row;
        const float *cos = cos_cache + positions[r] * d, *sin = sin_cache + positions[r] * d;
        for (int64_t hh = 0; hh < nh + nkv; hh++) rotate(q + hh * d, cos, sin, d);
        memcpy(k_cache + slots[r] * kv, q + nh * d, sizeof(float) * kv);
        memcpy(v_cache + slots[r] * kv, q + (nh + nkv) * d, sizeof(float) * kv);
    }
}

/* One (sequence, KV head): its `group` query heads against ctx keys, two passes over the blocks. */
static void attend_group(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                         int64_t ctx, float *out, int64_t group, int64_t nkv, int64_t g, int64_t d,
                         int64_t block_size, float scale, float *scores) {
    int64_t kv = nkv * d;
    for (int64_t p = 0; p < ctx; p++) {
        int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float *kp = k_cache + slot * kv + g * d;
        for (int64_t j = 0; j < group; j++) scores[j * ctx + p] = dot(q + j * d, kp, d) * scale;
    }
    for (int64_t j = 0; j < group; j++) {
        float *sj = scores + j * ctx;
        float m = -INFINITY;
        for (int64_t p = 0; p < ctx; p++) m = sj[p] > m ? sj[p] : m;
        for (int64_t p = 0; p < ctx; p++) sj[p] = fast_exp(sj[p] - m);
        float acc[LANES] = {0};
        int64_t p = 0;
        for (; p + LANES <= ctx; p += LANES)
            for (int i = 0; i < LANES; i++) acc[i] += sj[p + i];
        float l = sum_lanes(acc);
        for (; p < ctx; p++) l += sj[p];
        float inv = 1.0f / l;
        for (int64_t q2 = 0; q2 < ctx; q2++) sj[q2] *= inv;
    }
    for (int64_t j = 0; j < group; j++) memset(out + j * d, 0, sizeof(float) * d);
    for (int64_t p = 0; p < ctx; p++) {
        int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float *vp = v_cache + slot * kv + g * d;
        for (int64_t j = 0; j < group; j++) {
            float w = scores[j * ctx + p], *o = out + j * d;
            for (int64_t i = 0; i < d; i++) o[i] += w * vp[i];
        }
    }
}

void ss_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_table,
                         const int64_t *context_lens, float *out, int64_t b, int64_t nh, int64_t nkv, int64_t d,
                         int64_t block_size, int64_t max_blocks, float scale, int threads) {
    int64_t group = nh / nkv, max_ctx = 0;
    for (int64_t s = 0; s < b; s++) max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
#pragma omp parallel num_threads(threads) if (b * nkv * max_ctx >= 4096)
    {
        float *scores = malloc(sizeof(float) * group * (max_ctx > 0 ? max_ctx : 1));
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < b; s++)
            for (int64_t g = 0; g < nkv; g++)
                attend_group(q + (s * nh + g * group) * d, k_cache, v_cache, block_table + s * max_blocks,
                             context_lens[s], out + (s * nh + g * group) * d, group, nkv, g, d, block_size, scale,
                             scores);
        free(scores);
    }
}

void ss_silu_mul(const float *gate_up, float *out, int64_t t, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
    }
}
