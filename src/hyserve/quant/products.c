/* `q8_products` (and `q4_products`, at the end): y = x @ W^T for a few float32 rows x [rows, k] against a
 * weight held as GGUF's Q8_0 values (quant/layout.py): int8 q [n, k] row-major and one float16 scale
 * d [n, k / 32] per block of 32 weights along k, W[j, i] = d[j, i / 32] * q[j, i]. Sums in float32; the caller
 * rounds to the activation's dtype.
 *
 * Each thread streams its own contiguous stretch of W's rows; every input row takes the same dot product in
 * the same order whatever the number of rows, so a row's result does not depend on its batch. The
 * instruction set is the compiler's (`-march=native`): AVX512F, else AVX2 with FMA, else portable C. VNNI's
 * int8 products are not used: they need int8 activations, which would change the results (weight-only
 * quantization keeps the activations as they are).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32

static inline float h2f(uint16_t h) { /* IEEE half to float, subnormals included */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112u) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
static float dot_q8(const int8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t *qb = q + (long)b * BLOCK;
        const float *xb = x + (long)b * BLOCK;
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16))));
        const __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
        const float scale = h2f(d[b]);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(scale), s, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static float dot_q4(const uint8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m512 acc = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int b = 0; b < blocks; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + (long)b * BLOCK / 2));
        const float *xb = x + (long)b * BLOCK;
        const __m512 w0 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low))), eight);
        const __m512 w1 = _mm512_sub_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low))), eight);
        const __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
        const float scale = h2f(d[b]);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(scale), s, acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

static inline __m256 widen8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static float dot_q8(const int8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t *qb = q + (long)b * BLOCK;
        const float *xb = x + (long)b * BLOCK;
        __m256 s = _mm256_mul_ps(widen8(qb), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(widen8(qb + 8), _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(widen8(qb + 16), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(widen8(qb + 24), _mm256_loadu_ps(xb + 24), s);
        const float scale = h2f(d[b]);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), s, acc);
    }
    return hsum8(acc);
}

static inline __m256 widen4(__m128i nibbles) { /* the low 8 bytes, each 0..15, as floats -8..7 */
    return _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles)), _mm256_set1_ps(8.0f));
}

static float dot_q4(const uint8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m256 acc = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int b = 0; b < blocks; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + (long)b * BLOCK / 2));
        const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        const float *xb = x + (long)b * BLOCK;
        __m256 s = _mm256_mul_ps(widen4(lo), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(widen4(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(widen4(hi), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(widen4(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), s);
        const float scale = h2f(d[b]);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), s, acc);
    }
    return hsum8(acc);
}
#else
static float dot_q8(const int8_t *q, const uint16_t *d, const float *x, int blocks) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        float s = 0.0f;
        for (int i = 0; i < BLOCK; i++) s += (float)q[(long)b * BLOCK + i] * x[(long)b * BLOCK + i];
        const float scale = h2f(d[b]);
        acc += scale * s;
    }
    return acc;
}

static float dot_q4(const uint8_t *q, const uint16_t *d, const float *x, int blocks) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t *qb = q + (long)b * BLOCK / 2;
        const float *xb = x + (long)b * BLOCK;
        float s = 0.0f;
        for (int i = 0; i < BLOCK / 2; i++) s += (float)((qb[i] & 0x0f) - 8) * xb[i];
        for (int i = 0; i < BLOCK / 2; i++) s += (float)((qb[i] >> 4) - 8) * xb[BLOCK / 2 + i];
        const float scale = h2f(d[b]);
        acc += scale * s;
    }
    return acc;
}
#endif

/* The instruction set this build runs: 2 AVX512F, 1 AVX2, 0 portable C (for `hyserve env`). */
int q8_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Both return 0, or -1 when k is not a whole number of blocks (nothing written). */
int q8_products(int rows, int n, int k, const float *x, long x_stride, const int8_t *q, const uint16_t *d,
                float *y, int threads) {
    if (k % BLOCK) return -1;
    const int blocks = k / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long per = (n + nt - 1) / nt, first = t * per, last = first + per < n ? first + per : n;
        for (long j = first; j < last; j++)
            for (int r = 0; r < rows; r++)
                y[(long)r * n + j] = dot_q8(q + j * (long)k, d + j * (long)blocks, x + r * x_stride, blocks);
    }
    return 0;
}

/* `q4_products`: the same over GGUF's Q4_0 values: q [n, k / 2] bytes, per block of 32 weights 16 bytes whose low
 * nibbles are its weights 0-15 and high nibbles 16-31, each nibble u standing for (u - 8); W = d * (u - 8). */
int q4_products(int rows, int n, int k, const float *x, long x_stride, const uint8_t *q, const uint16_t *d,
                float *y, int threads) {
    if (k % BLOCK) return -1;
    const int blocks = k / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long per = (n + nt - 1) / nt, first = t * per, last = first + per < n ? first + per : n;
        for (long j = first; j < last; j++)
            for (int r = 0; r < rows; r++)
                y[(long)r * n + j] = dot_q4(q + j * (long)k / 2, d + j * (long)blocks, x + r * x_stride, blocks);
    }
    return 0;
}
