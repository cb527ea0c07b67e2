/* Parts of a bfloat16 decode step, one call each (kernels/native.py builds and checks them):
 * `products`, a few rows against a linear layer's weight, `zero_centered_norm`, Qwen3.5's RMSNorm,
 * `gdn_step`, Qwen3.5's Gated DeltaNet between its two products (the causal conv step, the delta rule and the
 * gated norm), and `decode_attention`, one query token per row against grouped KV heads.
 *
 * `gdn_step` computes what `decode_layer._gdn_step` computes with PyTorch operations, rounding to bfloat16 at the
 * same points: the conv output and its SiLU, beta's sigmoid, the delta rule's output, the norm and its
 * weight product, the gated result. Sums may run in another order (float32 rounding differs).
 * Per head, the recurrent state (dk x dv float32) is read twice and written once while it sits in the
 * core's cache, where the operations read it from memory six times.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, as PyTorch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf(float f) { return bf(to_bf(f)); }

/* y = exp(x - n ln 2), x's remainder r after n: the reduction and the polynomial, for `vexp` and `vexp8` alike
 * (y holds 1.9875691500e-4 going in: a float, or eight of them). */
#define EXP_OF_REMAINDER(y, r, x, n)                                                                                   \
    do {                                                                                                               \
        r = x - n * 0.693359375f;                                                                                      \
        r = r + n * 2.12194440e-4f;                                                                                    \
        y = y * r + 1.3981999507e-3f;                                                                                  \
        y = y * r + 8.3334519073e-3f;                                                                                  \
        y = y * r + 4.1665795894e-2f;                                                                                  \
        y = y * r + 1.6666665459e-1f;                                                                                  \
        y = y * r + 5.0000001201e-1f;                                                                                  \
        y = y * (r * r) + r + 1.0f;                                                                                    \
    } while (0)

/* exp(x) within ~2 units of float32's last place (Cephes' polynomial), branch-free so that loops of it
 * vectorize; inputs are clamped to [-87.3, 88.0] (results from 1.2e-38 to 1.6e38). */
static inline float vexp(float x) {
    x = fminf(fmaxf(x, -87.33654785f), 88.0f);
    const float n = floorf(x * 1.44269504f + 0.5f);
    float r, y = 1.9875691500e-4f;
    EXP_OF_REMAINDER(y, r, x, n);
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return y * scale;
}

static inline float silu(float x) { return x / (1.0f + vexp(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* beta 1, threshold 20 */

/* Zero-centered RMSNorm (Qwen3.5's, Gemma's; `norm.zero_centered`) of `rows` bfloat16 rows of width n, `stride`
 * apart: y = bf16(x * (1 / sqrt(mean(x^2) + eps)) * scale), scale = 1 + weight in float32. The mean's sum runs in
 * double (PyTorch sums float32 in another order), the rest as PyTorch's `rms_norm` does it in float32. One call
 * where PyTorch dispatches eight operations for a decode row. */
int zero_centered_norm(int rows, int n, const uint16_t *x, long stride, const float *scale, float eps, uint16_t *y) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (long)r * stride;
        double sum = 0.0;
        for (int i = 0; i < n; i++) {
            const float v = bf(xr[i]);
            sum += (double)(v * v);
        }
        const float inv = 1.0f / sqrtf((float)(sum / n) + eps);
        for (int i = 0; i < n; i++) y[(long)r * n + i] = to_bf(bf(xr[i]) * inv * scale[i]);
    }
    return 0;
}

typedef struct {
    int rows, hk, dk, hv, dv, kernel, state_len, threads;
    const uint16_t *mixed, *z, *b, *a;          /* bf16 rows: conv input [conv_dim], gate [hv*dv], [hv], [hv] */
    long mixed_stride, z_stride, b_stride, a_stride;  /* row strides, in elements */
    uint16_t *conv_state;                       /* [rows, conv_dim, state_len] bf16, shifted in place */
    const float *taps;                          /* [conv_dim, kernel] */
    const float *conv_bias;                     /* [conv_dim] or NULL */
    const float *neg_a, *dt_bias;               /* [hv]: -exp(A_log), dt_bias */
    float *state;                               /* [rows, hv, dk, dv] float32, updated in place */
    const uint16_t *norm_weight;                /* [dv] bf16 */
    float norm_eps;
    uint16_t *out;                              /* [rows, hv*dv] bf16 */
} GdnStep;

static void conv_channel(const GdnStep *p, float *conv, int r, int c, int conv_dim) {
    uint16_t *st = p->conv_state + ((long)r * conv_dim + c) * p->state_len;
    for (int t = 0; t + 1 < p->state_len; t++) st[t] = st[t + 1];
    st[p->state_len - 1] = p->mixed[r * p->mixed_stride + c];
    const uint16_t *win = st + p->state_len - p->kernel;
    const float *w = p->taps + (long)c * p->kernel;
    float acc = 0.0f;
    for (int t = 0; t < p->kernel; t++) acc += bf(win[t]) * w[t];
    if (p->conv_bias) acc += p->conv_bias[c];
    conv[(long)r * conv_dim + c] = acc;
}

static void head(const GdnStep *p, const float *conv, int r, int h, int conv_dim) {
    const int dk = p->dk, dv = p->dv, key_dim = p->hk * dk, kh = h / (p->hv / p->hk);
    const float *row = conv + (long)r * conv_dim;
    const float *cq = row + kh * dk, *ck = row + key_dim + kh * dk, *cv = row + 2 * key_dim + h * dv;
    float q[dk], k[dk], kv[dv], delta[dv], o[dv];
    float sq = 0.0f, sk = 0.0f;
    for (int i = 0; i < dk; i++) { sq += cq[i] * cq[i]; sk += ck[i] * ck[i]; }
    const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f), scale = sqrtf((float)dk);
    for (int i = 0; i < dk; i++) { q[i] = (cq[i] * rq) / scale; k[i] = ck[i] * rk; }
    const float g = p->neg_a[h] * softplus(bf(p->a[r * p->a_stride + h]) + p->dt_bias[h]);
    const float decay = expf(g);
    const float x = bf(p->b[r * p->b_stride + h]);
    const float beta = round_bf(1.0f / (1.0f + expf(-x)));
    float *S = p->state + ((long)r * p->hv + h) * (long)dk * dv;
    for (int j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int i = 0; i < dk; i++) {  /* decay the state, and k^T of it */
        float *s = S + (long)i * dv;
        const float ki = k[i];
        for (int j = 0; j < dv; j++) { const float d = s[j] * decay; s[j] = d; kv[j] += ki * d; }
    }
    for (int j = 0; j < dv; j++) { delta[j] = (cv[j] - kv[j]) * beta; o[j] = 0.0f; }
    for (int i = 0; i < dk; i++) {  /* the rank-1 update, and q^T of the new state */
        float *s = S + (long)i * dv;
        const float ki = k[i], qi = q[i];
        for (int j = 0; j < dv; j++) { const float n = s[j] + ki * delta[j]; s[j] = n; o[j] += qi * n; }
    }
    float ss = 0.0f;
    for (int j = 0; j < dv; j++) { o[j] = round_bf(o[j]); ss += o[j] * o[j]; }
    const float inv = 1.0f / sqrtf(ss / (float)dv + p->norm_eps);
    const uint16_t *z = p->z + r * p->z_stride + (long)h * dv;
    uint16_t *out = p->out + ((long)r * p->hv + h) * dv;
    for (int j = 0; j < dv; j++) {
        const float normed = round_bf(bf(p->norm_weight[j]) * round_bf(o[j] * inv));
        out[j] = to_bf(normed * silu(bf(z[j])));
    }
}

/* Returns 0, or -1 when its scratch could not be allocated (nothing changed then). */
int gdn_step(const GdnStep *p) {
    const int conv_dim = 2 * p->hk * p->dk + p->hv * p->dv;
    float *conv = (float *)malloc(sizeof(float) * (size_t)p->rows * conv_dim);
    if (!conv) return -1;
    const long channels = (long)p->rows * conv_dim, heads = (long)p->rows * p->hv;
#pragma omp parallel num_threads(p->threads)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < channels; i++) conv_channel(p, conv, (int)(i / conv_dim), (int)(i % conv_dim), conv_dim);
#pragma omp for simd schedule(static)
        for (long i = 0; i < channels; i++) conv[i] = round_bf(silu(round_bf(conv[i])));
#pragma omp for schedule(static)
        for (long i = 0; i < heads; i++) head(p, conv, (int)(i / p->hv), (int)(i % p->hv), conv_dim);
    }
    free(conv);
    return 0;
}

/* Attention of one query token per row against grouped KV heads, bfloat16 in and out, float32 inside (as
 * PyTorch's CPU flash kernel: scores scaled in float32, the softmax's numerators rounded to bfloat16 before
 * they weight the values, the sum of the unrounded ones dividing at the end). The keys are split into chunks
 * run on separate threads and combined after (split-K), so that both cores stream the KV even for one row
 * and two KV heads. Head dimensions are a multiple of 8 (the caller checks). */
typedef struct {
    int rows, heads, kv_heads, dim, keys, chunk, threads;
    const uint16_t *q;
    long q_row, q_head;                      /* q[r, h, :], unit stride inside */
    const uint16_t *k, *v;
    long k_row, k_head, k_seq, v_row, v_head, v_seq;
    const uint8_t *mask;                     /* NULL, or mask[r * m_row + s * m_key]: nonzero attends */
    long m_row, m_key;
    float scale;
    uint16_t *out;                           /* [rows, heads, dim] */
} Attention;

/* Eight floats as one vector (GCC's and clang's vector extensions: -march picks the instructions). The loops below
 * are written on it: the compiler left their plain-C forms scalar (arrays whose sizes come at run time). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8f bf8(const uint16_t *p) { /* eight bfloat16 values widened */
    v8h h;
    memcpy(&h, p, sizeof h);
    const v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

static inline v8f pick(v8i mask, v8f yes, v8f no) { return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask)); }

/* `vexp` of eight values: the same clamp, polynomial and scaling, the floor from a truncation. */
static inline v8f vexp8(v8f x) {
    x = pick(x < -87.33654785f, (v8f){0} - 87.33654785f, x);
    x = pick(x > 88.0f, (v8f){0} + 88.0f, x);
    const v8f t = x * 1.44269504f + 0.5f, whole = __builtin_convertvector(__builtin_convertvector(t, v8i), v8f);
    const v8f n = whole + __builtin_convertvector(whole > t, v8f); /* floor: less one where truncation rose */
    v8f r, y = (v8f){0} + 1.9875691500e-4f;
    EXP_OF_REMAINDER(y, r, x, n);
    return y * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
}

/* `round_bf` of eight values (a NaN stays one). */
static inline v8f round_bf8(v8f f) {
    const v8u u = (v8u)f, nan = (v8u)(f != f);
    const v8u r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (v8f)((r & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan));
}

/* The scores of two keys (k0, k1: bfloat16) against H <= 4 query heads (q: H rows of `dim` floats, dim a multiple
 * of 8): 2 * H vector sums added side by side. One dot product at a time waits on its own additions (a key then
 * ran at the adder's latency, not its throughput). */
static inline void qk_pair(const int H, const float *q, int dim, const uint16_t *k0, const uint16_t *k1, float *o0,
                           float *o1) {
    v8f a[4] = {0}, b[4] = {0};
    for (int d = 0; d < dim; d += 8) {
        const v8f x = bf8(k0 + d), y = bf8(k1 + d);
        for (int i = 0; i < H; i++) {
            const v8f w = load8(q + (long)i * dim + d);
            a[i] += w * x;
            b[i] += w * y;
        }
    }
    for (int i = 0; i < H; i++) {
        o0[i] = sum8(a[i]);
        o1[i] = sum8(b[i]);
    }
}

static void attention_chunk(const Attention *a, int r, int kh, int c, float *part) {
    const int g = a->heads / a->kv_heads, dim = a->dim;
    const int s0 = c * a->chunk, s1 = s0 + a->chunk < a->keys ? s0 + a->chunk : a->keys, n = s1 - s0;
    float q[g][dim], scores[g][n];
    for (int i = 0; i < g; i++) {
        const uint16_t *qi = a->q + r * a->q_row + (long)(kh * g + i) * a->q_head;
        for (int d = 0; d < dim; d++) q[i][d] = bf(qi[d]);
    }
    const uint16_t *k = a->k + r * a->k_row + kh * a->k_head;
    for (int s = 0; s < n; s += 2) { /* the keys two at a time (the last one twice when n is odd) */
        const uint16_t *k0 = k + (s0 + s) * a->k_seq, *k1 = s + 1 < n ? k0 + a->k_seq : k0;
        float d0[g], d1[g];
        for (int i = 0; i < g;) { /* the group's heads four, two, then one at a time (H a constant in each) */
            const int h = g - i >= 4 ? 4 : g - i >= 2 ? 2 : 1;
            if (h == 4) qk_pair(4, q[i], dim, k0, k1, d0 + i, d1 + i);
            else if (h == 2) qk_pair(2, q[i], dim, k0, k1, d0 + i, d1 + i);
            else qk_pair(1, q[i], dim, k0, k1, d0 + i, d1 + i);
            i += h;
        }
        for (int t = 0; t < 2 && s + t < n; t++) {
            const int open = !a->mask || a->mask[r * a->m_row + (s0 + s + t) * a->m_key];
            for (int i = 0; i < g; i++) scores[i][s + t] = open ? (t ? d1[i] : d0[i]) * a->scale : -INFINITY;
        }
    }
    /* part: per query, [max, sum, acc[dim]] */
    for (int i = 0; i < g; i++) {
        float *pi = part + (long)i * (dim + 2);
        float m = -INFINITY, l = 0.0f;
        for (int s = 0; s < n; s++) m = scores[i][s] > m ? scores[i][s] : m;
        if (m != -INFINITY) {
            int s = 0;
            v8f l8 = {0};
            for (; s + 8 <= n; s += 8) {
                const v8f sc = load8(&scores[i][s]);
                const v8f e = pick(sc == -INFINITY, (v8f){0}, vexp8(sc - m));
                l8 += e;
                const v8f rounded = round_bf8(e);
                memcpy(&scores[i][s], &rounded, sizeof rounded);
            }
            l = sum8(l8);
            for (; s < n; s++) {
                const float e = scores[i][s] == -INFINITY ? 0.0f : vexp(scores[i][s] - m);
                l += e;
                scores[i][s] = round_bf(e);
            }
        }
        pi[0] = m;
        pi[1] = l;
        for (int d = 0; d < dim; d++) pi[2 + d] = 0.0f;
    }
    const uint16_t *v = a->v + r * a->v_row + kh * a->v_head;
    for (int s = 0; s < n; s += 2) { /* two keys at a time: each accumulator read and written once for both */
        const int open0 = !a->mask || a->mask[r * a->m_row + (s0 + s) * a->m_key];
        const int open1 = s + 1 < n && (!a->mask || a->mask[r * a->m_row + (s0 + s + 1) * a->m_key]);
        if (!open0 && !open1) continue;
        const uint16_t *v0 = v + (s0 + s) * a->v_seq, *v1 = open1 ? v0 + a->v_seq : v0;
        float p0[g], p1[g]; /* a closed key's weights are 0 (its values, read anyway, are then not added) */
        for (int i = 0; i < g; i++) {
            p0[i] = open0 ? scores[i][s] : 0.0f;
            p1[i] = open1 ? scores[i][s + 1] : 0.0f;
        }
        for (int d = 0; d < dim; d += 8) {
            const v8f x0 = bf8(v0 + d), x1 = bf8(v1 + d);
            for (int i = 0; i < g; i++) {
                float *acc = part + (long)i * (dim + 2) + 2 + d;
                v8f sum = load8(acc);
                if (open0) sum += p0[i] * x0;
                if (open1) sum += p1[i] * x1;
                memcpy(acc, &sum, sizeof sum);
            }
        }
    }
}

/* Returns 0, or -1 when its scratch could not be allocated. */
int decode_attention(const Attention *a) {
    const int g = a->heads / a->kv_heads, dim = a->dim;
    const int chunks = (a->keys + a->chunk - 1) / a->chunk;
    const long items = (long)a->rows * a->kv_heads * chunks, per = (long)g * (dim + 2);
    float *parts = (float *)malloc(sizeof(float) * (size_t)(items * per));
    if (!parts) return -1;
#pragma omp parallel num_threads(a->threads)
    {
#pragma omp for schedule(static)
        for (long it = 0; it < items; it++) {
            const int c = (int)(it % chunks), kh = (int)((it / chunks) % a->kv_heads);
            const int r = (int)(it / chunks / a->kv_heads);
            attention_chunk(a, r, kh, c, parts + it * per);
        }
#pragma omp for schedule(static)
        for (long rq = 0; rq < (long)a->rows * a->heads; rq++) {
            const int r = (int)(rq / a->heads), h = (int)(rq % a->heads), kh = h / g, i = h % g;
            const float *first = parts + (((long)r * a->kv_heads + kh) * chunks) * per + (long)i * (dim + 2);
            float top = -INFINITY, l = 0.0f;
            for (int c = 0; c < chunks; c++)
                if (first[c * per] > top) top = first[c * per];
            float acc[dim];
            for (int d = 0; d < dim; d++) acc[d] = 0.0f;
            if (top != -INFINITY) {
                for (int c = 0; c < chunks; c++) {
                    const float *pc = first + c * per;
                    if (pc[0] == -INFINITY) continue;
                    const float w = expf(pc[0] - top);
                    l += w * pc[1];
#pragma omp simd
                    for (int d = 0; d < dim; d++) acc[d] += w * pc[2 + d];
                }
            }
            uint16_t *o = a->out + ((long)r * a->heads + h) * dim;
            for (int d = 0; d < dim; d++) o[d] = to_bf(l > 0.0f ? acc[d] / l : 0.0f);
        }
    }
    free(parts);
    return 0;
}

/* `products`: y = x @ W^T for a few bfloat16 rows x [rows, k] against a row-major bfloat16 weight W [n, k],
 * float32 sums rounded to bfloat16 once, as oneDNN's product does (its sums run in another order). Each
 * thread streams its own contiguous stretch of W's rows, one row at a time; every input row takes the same
 * dot product in the same order whatever the number of rows, so a row's result does not depend on its batch.
 * Returns -1 where the compiler targets no AVX512-BF16 (the caller keeps oneDNN's product). */
#ifdef __AVX512BF16__
#include <immintrin.h>

static inline float dot_bf16(const uint16_t *w, const uint16_t *x, int k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 128 <= k; i += 128) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + i), (__m512bh)_mm512_loadu_si512(w + i));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + i + 32), (__m512bh)_mm512_loadu_si512(w + i + 32));
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(x + i + 64), (__m512bh)_mm512_loadu_si512(w + i + 64));
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(x + i + 96), (__m512bh)_mm512_loadu_si512(w + i + 96));
    }
    for (; i < k; i += 32) {
        const __mmask32 m = k - i >= 32 ? 0xffffffffu : (1u << (k - i)) - 1u;
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, x + i), (__m512bh)_mm512_maskz_loadu_epi16(m, w + i));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

int products(int rows, int n, int k, const uint16_t *x, long x_stride, const uint16_t *w, uint16_t *y, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long per = (n + nt - 1) / nt, first = t * per, last = first + per < n ? first + per : n;
        for (long j = first; j < last; j++)
            for (int r = 0; r < rows; r++)
                y[(long)r * n + j] = to_bf(dot_bf16(w + j * (long)k, x + r * x_stride, k));
    }
    return 0;
}
#else
int products(int rows, int n, int k, const uint16_t *x, long x_stride, const uint16_t *w, uint16_t *y, int threads) {
    (void)rows, (void)n, (void)k, (void)x, (void)x_stride, (void)w, (void)y, (void)threads;
    return -1;
}
#endif

/* `gdn_layer` and `mlp_block`: a Qwen3.5 decoder layer for one token per row (`decode_layer._lean`'s operations)
 * in one call, over int8-activation quantized weights. Between the layer's products a decode step ran a dozen
 * Python calls; here they are C. The products are `a8_products.c`'s `a8_linear` (built apart; its address comes
 * in `linear`) with the arguments the Python path gives it, the norms are `zero_centered_norm`, the Gated
 * DeltaNet step is `gdn_step`, the residual sums round to bfloat16 as PyTorch's do: the same results as the
 * Python path but for SiLU (`silu`'s exp against PyTorch's: a bfloat16 ulp, rarely). */
typedef int (*A8Linear)(int fmt, int rows, int n, int k, const void *x, long x_stride, int bf16, const void *q,
                        const uint16_t *d, const float *bias, void *y, int threads);

typedef struct {
    int fmt, n, k;  /* `a8_linear`'s format code and shape */
    const void *q;
    const uint16_t *d;
    const float *bias;  /* or NULL */
} A8Weight;

typedef struct {
    A8Linear linear;
    int rows, hidden, inter, threads;
    long one_thread_below;          /* products of fewer rows x n x k weights run on one thread, as in Python */
    const float *norm_scale;        /* post-attention norm: 1 + weight, float32 */
    float norm_eps;
    A8Weight gate_up, down;         /* gate_up's output: gate at `gate_at`, up at `up_at` */
    int gate_at, up_at;
} Mlp;

typedef struct {
    Mlp mlp;
    const float *norm_scale;        /* input norm: 1 + weight, float32 */
    float norm_eps;
    A8Weight in_proj, out_proj;     /* in_proj's output: conv input, z, b, a at these columns */
    int mixed_at, z_at, b_at, a_at;
    GdnStep gdn;                    /* dims and constants; the caller sets conv_state, state and state_len */
} GdnLayer;

static int product(const Mlp *m, const A8Weight *w, const uint16_t *x, uint16_t *y) {
    const int threads = (long)m->rows * w->n * w->k >= m->one_thread_below ? m->threads : 1;
    return m->linear(w->fmt, m->rows, w->n, w->k, x, w->k, 1, w->q, w->d, w->bias, y, threads);
}

/* out = h + down(silu(gate) * up) of the norm of h (out may be h). 0, or -1 when memory ran out or a product
 * refused (out unwritten then). */
int mlp_block(const Mlp *m, const uint16_t *h, uint16_t *out) {
    const long rows = m->rows, hidden = m->hidden, inter = m->inter, width = m->gate_up.n;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * (hidden + width + inter + hidden));
    if (!x) return -1;
    uint16_t *gu = x + rows * hidden, *act = gu + rows * width, *y = act + rows * inter;
    zero_centered_norm(m->rows, m->hidden, h, hidden, m->norm_scale, m->norm_eps, x);
    int code = product(m, &m->gate_up, x, gu);
    if (code == 0) {
        for (long r = 0; r < rows; r++)
            for (long i = 0; i < inter; i++) {
                const float g = bf(gu[r * width + m->gate_at + i]), u = bf(gu[r * width + m->up_at + i]);
                act[r * inter + i] = to_bf(round_bf(silu(g)) * u);
            }
        code = product(m, &m->down, act, y);
    }
    if (code == 0)
        for (long i = 0; i < rows * hidden; i++) out[i] = to_bf(bf(h[i]) + bf(y[i]));
    free(x);
    return code;
}

/* out = the layer's output for h [rows, hidden]: the input norm, in_proj, `gdn_step` (conv and recurrent states
 * updated in place), out_proj, the residual sum, then `mlp_block`. 0, or -1 when memory ran out or a product
 * refused (the states may have been updated then: the caller trusts none of them). */
int gdn_layer(const GdnLayer *L, const uint16_t *h, uint16_t *out) {
    const Mlp *m = &L->mlp;
    const long rows = m->rows, hidden = m->hidden, width = L->in_proj.n, value_dim = (long)L->gdn.hv * L->gdn.dv;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * (hidden + width + value_dim + hidden));
    if (!x) return -1;
    uint16_t *y = x + rows * hidden, *o = y + rows * width, *mixed = o + rows * value_dim;
    zero_centered_norm(m->rows, m->hidden, h, hidden, L->norm_scale, L->norm_eps, x);
    int code = product(m, &L->in_proj, x, y);
    if (code == 0) {
        GdnStep g = L->gdn;
        g.rows = m->rows, g.threads = m->threads;
        g.mixed = y + L->mixed_at, g.z = y + L->z_at, g.b = y + L->b_at, g.a = y + L->a_at;
        g.mixed_stride = g.z_stride = g.b_stride = g.a_stride = width;
        g.out = o;
        code = gdn_step(&g);
    }
    if (code == 0) code = product(m, &L->out_proj, o, mixed);
    if (code == 0) {
        for (long i = 0; i < rows * hidden; i++) out[i] = to_bf(bf(h[i]) + bf(mixed[i]));
        code = mlp_block(m, out, out);
    }
    free(x);
    return code;
}
