/* `ggml_linear`: y = x @ W^T (+ bias) over a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * Q6_K), the activations rounded to Q8_0 blocks of 32 as `a8_products.c` rounds them (this file is compiled after
 * it, in one unit: `quant.ggml_library.source`, for its `round_rows` and conversions). `ggml_dequantize`: rows of
 * blocks to float32, bit for bit what gguf-py's `dequantize` computes.
 *
 * Why not dequantize at load, or re-quantize: a Q4_K_M file held as float32 is 7x its size and streams 7x the
 * bytes every token; re-quantized it loses quality twice. The file's blocks are read as they are.
 *
 * Every format is a run of sub-blocks of 32 weights, each standing for a * w + b (w small integers, a and b
 * floats of the block's scales; Q6_K also has an integer scale per 16 weights). Against a row of x rounded to
 * Q8_0 (dx, qx) a sub-block adds (sum of w * qx, in integers, exact) * (a * dx) + b * (dx * sum of qx). Each output
 * takes the same operations in the same order whatever the number of rows or threads, so a row's result does not
 * depend on its batch or its prefill piece (cache on == cache off, batched == each row alone). The reference it is
 * checked against at load is `layout.dequantized_linear(rounded=True)`'s arithmetic over gguf-py's dequantized
 * weight (`ggml_blocks.reference_linear`); they agree up to float32 rounding.
 *
 * Block layouts (bytes; ggml's): Q4_0 d, 16 nibble bytes (weight i low nibble of byte i, weight 16 + i its high
 * one), u - 8. Q4_1 d, m, nibbles: d u + m. Q5_0 d, 32 high bits (uint32), nibbles: u - 16. Q5_1 d, m, high bits,
 * nibbles. Q8_0 d, 32 int8. Q4_K (256 weights) d, dmin, 12 bytes of eight 6-bit scales and mins, 128 nibble bytes
 * (sub-block 2c low nibbles of bytes 32c.., 2c + 1 their high ones): d sc u - dmin m. Q5_K as Q4_K with 32 bytes of
 * high bits before the nibbles (sub-block j's in bit j). Q6_K 128 bytes of low nibbles, 64 of high pairs, 16 int8
 * scales (one per 16 weights), d: d s (u - 32).
 */

#define QK_K 256
enum { G_Q4_0, G_Q4_1, G_Q5_0, G_Q5_1, G_Q8_0, G_Q4_K, G_Q5_K, G_Q6_K, G_FORMATS };
static const int G_WEIGHTS[G_FORMATS] = {32, 32, 32, 32, 32, QK_K, QK_K, QK_K};
static const int G_BYTES[G_FORMATS] = {18, 20, 22, 24, 34, 144, 176, 210};
#define G_TILE 4 /* input rows passing a weight row's sub-block while it is unpacked */
#define G_GROUP 16 /* weight rows kept in the core's cache while every tile of input rows passes them */

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

/* Q4_K / Q5_K's 6-bit scale and min of sub-block j (of 8) from their 12 bytes. */
static inline void scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Sub-block j of a block: its 32 integers w (signed; for the formats with an offset, the unsigned u), its scales
 * a and b (0 where the format has none), and for Q6_K the integer scales of its two halves (1, 1 otherwise). */
typedef struct {
    int8_t w[32];
    float a, b;
    int s0, s1;
} Sub;

static void sub_block(int fmt, const uint8_t *blk, int j, Sub *o) {
    o->b = 0.0f;
    o->s0 = o->s1 = 1;
    switch (fmt) {
    case G_Q4_0:
    case G_Q4_1: {
        const uint8_t *qs = blk + (fmt == G_Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) {
            o->w[i] = (int8_t)((qs[i] & 15) - (fmt == G_Q4_0 ? 8 : 0));
            o->w[i + 16] = (int8_t)((qs[i] >> 4) - (fmt == G_Q4_0 ? 8 : 0));
        }
        o->a = h2f(rd16(blk));
        if (fmt == G_Q4_1) o->b = h2f(rd16(blk + 2));
        break;
    }
    case G_Q5_0:
    case G_Q5_1: {
        const int off = fmt == G_Q5_0 ? 2 : 4;
        const uint32_t qh = rd32(blk + off);
        const uint8_t *qs = blk + off + 4;
        for (int i = 0; i < 32; i++) {
            const int low = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
            o->w[i] = (int8_t)((low | (int)((qh >> i) & 1) << 4) - (fmt == G_Q5_0 ? 16 : 0));
        }
        o->a = h2f(rd16(blk));
        if (fmt == G_Q5_1) o->b = h2f(rd16(blk + 2));
        break;
    }
    case G_Q8_0:
        memcpy(o->w, blk + 2, 32);
        o->a = h2f(rd16(blk));
        break;
    case G_Q4_K:
    case G_Q5_K: {
        int sc, m;
        scale_min(blk + 4, j, &sc, &m);
        const uint8_t *qs = blk + (fmt == G_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = blk + 16;
        for (int i = 0; i < 32; i++) {
            int u = j & 1 ? qs[i] >> 4 : qs[i] & 15;
            if (fmt == G_Q5_K) u |= ((qh[i] >> j) & 1) << 4;
            o->w[i] = (int8_t)u;
        }
        o->a = h2f(rd16(blk)) * (float)sc;
        o->b = -(h2f(rd16(blk + 2)) * (float)m);
        break;
    }
    default: { /* G_Q6_K: sub-block j = 4h + t */
        const int h = j / 4, t = j % 4;
        const uint8_t *ql = blk + 64 * h + 32 * (t & 1), *qh = blk + 128 + 32 * h;
        const int8_t *s = (const int8_t *)(blk + 192);
        for (int i = 0; i < 32; i++) {
            const int low = t >= 2 ? ql[i] >> 4 : ql[i] & 15;
            o->w[i] = (int8_t)((low | ((qh[i] >> (2 * t)) & 3) << 4) - 32);
        }
        o->a = h2f(rd16(blk + 208));
        o->s0 = s[2 * j];
        o->s1 = s[2 * j + 1];
        break;
    }
    }
}

/* Rows [0, rows) of blocks (`row_bytes` apart) dequantized into out [rows, k] in float32, with gguf-py's float
 * operations in its order (d * q, d * q + m, (d * sc) * q - dmin * m, (d * s) * q), so bit for bit its values. */
int ggml_dequantize(int fmt, long rows, int k, const uint8_t *q, long row_bytes, float *out) {
    if (fmt < 0 || fmt >= G_FORMATS || k % G_WEIGHTS[fmt]) return -1;
    const int per = G_WEIGHTS[fmt] / 32, blocks = k / G_WEIGHTS[fmt];
    for (long r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) {
            const uint8_t *blk = q + r * row_bytes + (long)b * G_BYTES[fmt];
            for (int j = 0; j < per; j++) {
                Sub s;
                sub_block(fmt, blk, j, &s);
                float *o = out + r * k + (long)b * G_WEIGHTS[fmt] + 32 * j;
                if (fmt == G_Q6_K) {
                    const float d = s.a, a0 = d * (float)s.s0, a1 = d * (float)s.s1;
                    for (int i = 0; i < 32; i++) o[i] = (i < 16 ? a0 : a1) * (float)s.w[i];
                } else if (fmt == G_Q4_K || fmt == G_Q5_K) {
                    for (int i = 0; i < 32; i++) o[i] = s.a * (float)s.w[i] + s.b; /* s.b = -(dmin * m) */
                } else if (fmt == G_Q4_1 || fmt == G_Q5_1) {
                    for (int i = 0; i < 32; i++) o[i] = s.a * (float)s.w[i] + s.b;
                } else {
                    for (int i = 0; i < 32; i++) o[i] = s.a * (float)s.w[i];
                }
            }
        }
    return 0;
}

static inline int has_offset(int fmt) { return fmt == G_Q4_1 || fmt == G_Q5_1 || fmt == G_Q4_K || fmt == G_Q5_K; }

#if A8_ISA == 1
/* The 8 lanes' sum, in one fixed order. */
INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if A8_ISA == 1
/* A sub-block's 32 integers in one vector (as `sub_block` gives them), for the AVX2 product. */
INLINE __m256i sub_vector(const int fmt, const uint8_t *blk, int j) {
    const __m256i low4 = _mm256_set1_epi8(15);
    switch (fmt) {
    case G_Q8_0: return _mm256_loadu_si256((const __m256i *)(blk + 2));
    case G_Q4_0:
    case G_Q4_1:
    case G_Q5_0:
    case G_Q5_1: {
        const int off = fmt == G_Q4_0 ? 2 : fmt == G_Q4_1 ? 4 : fmt == G_Q5_0 ? 6 : 8;
        const __m128i b = _mm_loadu_si128((const __m128i *)(blk + off));
        __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4);
        if (fmt == G_Q5_0 || fmt == G_Q5_1) { /* bit i of the uint32 -> 16 in byte i */
            const uint32_t qh = rd32(blk + off - 4);
            const __m256i spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32((int)qh),
                _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                                 3, 3, 3, 3));
            const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
            u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        if (fmt == G_Q4_0) u = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
        if (fmt == G_Q5_0) u = _mm256_sub_epi8(u, _mm256_set1_epi8(16));
        return u;
    }
    case G_Q4_K:
    case G_Q5_K: {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + (fmt == G_Q4_K ? 16 : 48) + 32 * (j / 2)));
        __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(b, 4) : b, low4);
        if (fmt == G_Q5_K) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m256i one = _mm256_set1_epi8(1);
            u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), one), 4));
        }
        return u;
    }
    default: {
        const int h = j / 4, t = j % 4;
        const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (t & 1)));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(l, 4) : l, low4);
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * t), _mm256_set1_epi8(3)), 4);
        return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
    }
    }
}

/* The outputs of input rows 0 .. R) with one weight row (`row`): per row, 8 lanes of integer sums times a * dx
 * summed in float32 over the sub-blocks in order, then the lanes in a fixed order, then the offsets' sum. */
INLINE void row_outputs(const int fmt, const int R, const uint8_t *row, int k, const int8_t *xq, const float *xd,
                        const float *xsf, float *out) {
    const int per = G_WEIGHTS[fmt] / 32, blocks = k / G_WEIGHTS[fmt], subs = k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[G_TILE];
    float off[G_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        off[r] = 0.0f;
    }
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = row + (long)b * G_BYTES[fmt];
        _mm_prefetch((const char *)blk + 512, _MM_HINT_T0);
        float a_all = 0.0f, dmin = 0.0f;
        uint8_t sc[8], mn[8];
        if (fmt == G_Q4_K || fmt == G_Q5_K) {
            for (int j = 0; j < 8; j++) {
                int s, m;
                scale_min(blk + 4, j, &s, &m);
                sc[j] = (uint8_t)s;
                mn[j] = (uint8_t)m;
            }
            a_all = h2f(rd16(blk));
            dmin = h2f(rd16(blk + 2));
        } else if (fmt == G_Q6_K) {
            a_all = h2f(rd16(blk + 208));
        } else {
            a_all = h2f(rd16(blk));
            if (fmt == G_Q4_1 || fmt == G_Q5_1) dmin = h2f(rd16(blk + 2));
        }
        for (int j = 0; j < per; j++) {
            const int at = b * per + j;
            const __m256i w = sub_vector(fmt, blk, j);
            float a = a_all, bo = dmin;
            __m256i s16 = ones;
            if (fmt == G_Q4_K || fmt == G_Q5_K) {
                a = a_all * (float)sc[j];
                bo = -(dmin * (float)mn[j]);
            } else if (fmt == G_Q6_K) {
                const int8_t *s = (const int8_t *)(blk + 192);
                s16 = _mm256_set_m128i(_mm_set1_epi16(s[2 * j + 1]), _mm_set1_epi16(s[2 * j]));
            }
            const int unsigned_w = has_offset(fmt);
            const __m256i aw = unsigned_w ? w : _mm256_sign_epi8(w, w);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (long)r * k + 32 * at));
                const __m256i sx = unsigned_w ? xv : _mm256_sign_epi8(xv, w);
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), s16);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(a * xd[(long)r * subs + at]), acc[r]);
                if (unsigned_w) off[r] = off[r] + bo * xsf[(long)r * subs + at];
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]) + off[r];
}
#else
INLINE void row_outputs(const int fmt, const int R, const uint8_t *row, int k, const int8_t *xq, const float *xd,
                        const float *xsf, float *out) {
    const int per = G_WEIGHTS[fmt] / 32, blocks = k / G_WEIGHTS[fmt], subs = k / 32;
    float acc[G_TILE], off[G_TILE];
    for (int r = 0; r < R; r++) acc[r] = off[r] = 0.0f;
    for (int b = 0; b < blocks; b++)
        for (int j = 0; j < per; j++) {
            Sub s;
            sub_block(fmt, row + (long)b * G_BYTES[fmt], j, &s);
            const int at = b * per + j;
            for (int r = 0; r < R; r++) {
                const int8_t *xb = xq + (long)r * k + 32 * at;
                int32_t lo = 0, hi = 0;
                for (int i = 0; i < 16; i++) lo += s.w[i] * xb[i];
                for (int i = 16; i < 32; i++) hi += s.w[i] * xb[i];
                acc[r] = acc[r] + (float)(s.s0 * lo + s.s1 * hi) * (s.a * xd[(long)r * subs + at]);
                if (has_offset(fmt)) off[r] = off[r] + s.b * xsf[(long)r * subs + at];
            }
        }
    for (int r = 0; r < R; r++) out[r] = acc[r] + off[r];
}
#endif

/* The K-quants against rows of x rounded to Q8_K blocks of 256 (llama.cpp's Q8_K): per block d = amax / 127 and
 * q = roundf(x * (1 / d)) (0 where d is 0; `layout.round_activations` with blocks of 256, in the same float32
 * operations), and the sums of q per 16 (`s16`, int16). Then a super-block's integer sums, scales included, are exact
 * and one float multiply-add per 256 weights and row takes them: Q4_K / Q5_K sum sc * (u . q) over its 8 sub-blocks
 * and m * (sum of q) apart, Q6_K s * (u . q) over its 16 groups and 32 s (sum of q) apart. */
static void round_rows_k(int rows, int k, const void *x, long x_stride, int bf16, int8_t *q, float *d, int16_t *s16) {
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < k / QK_K; b++) {
            const long at = (long)r * x_stride + (long)b * QK_K;
            float v[QK_K], amax = 0.0f;
            for (int i = 0; i < QK_K; i++) {
                v[i] = bf16 ? bf2f(((const uint16_t *)x)[at + i]) : ((const float *)x)[at + i];
                const float a = fabsf(v[i]);
                amax = (a > amax || a != a || amax != amax) ? (amax != amax ? amax : a) : amax;
            }
            const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
            int8_t *qb = q + (long)r * k + (long)b * QK_K;
            for (int i = 0; i < QK_K; i++) {
                const float p = v[i] * inv, t = truncf(p);
                float u = fabsf(p - t) >= 0.5f ? t + (p < 0.0f ? -1.0f : 1.0f) : t; /* roundf */
                u = u > 127.0f ? 127.0f : u < -127.0f ? -127.0f : (u == u ? u : 0.0f);
                qb[i] = (int8_t)u;
            }
            d[(long)r * (k / QK_K) + b] = db;
            for (int g = 0; g < QK_K / 16; g++) {
                int32_t sum = 0;
                for (int i = 0; i < 16; i++) sum += qb[16 * g + i];
                s16[(long)r * (k / 16) + (long)b * 16 + g] = (int16_t)sum; /* |sum| <= 16 * 127 */
            }
        }
}

#if A8_ISA == 1
/* Shuffle masks over eight int16 held in both 128-bit lanes: int16 j everywhere (`same_mask`), or int16 2j in the
 * low lane and 2j + 1 in the high one (`pair_mask`). */
INLINE __m256i same_mask(int j) { return _mm256_set1_epi16((short)((2 * j) | (2 * j + 1) << 8)); }
INLINE __m256i pair_mask(int j) {
    return _mm256_set_m128i(_mm_set1_epi16((short)((4 * j + 2) | (4 * j + 3) << 8)),
                            _mm_set1_epi16((short)((4 * j) | (4 * j + 1) << 8)));
}

INLINE void k_outputs(const int fmt, const int R, const uint8_t *row, int k, const int8_t *xq, const float *xd,
                      const int16_t *s16, float *out) {
    const int blocks = k / QK_K;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[G_TILE], offv[G_TILE];
    for (int r = 0; r < R; r++) acc[r] = offv[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = row + (long)b * G_BYTES[fmt];
        _mm_prefetch((const char *)blk + 1024, _MM_HINT_T0);
        __m256i sumi[G_TILE];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        if (fmt == G_Q6_K) {
            const int8_t *sc = (const int8_t *)(blk + 192);
            const __m256i all16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
            const __m256i first8 = _mm256_permute2x128_si256(all16, all16, 0x00), last8 = _mm256_permute2x128_si256(all16, all16, 0x11);
            for (int j = 0; j < 8; j++) {
                const int h = j / 4, t = j % 4;
                const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (t & 1)));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                const __m256i u = _mm256_or_si256(
                    _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(l, 4) : l, low4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * t), _mm256_set1_epi8(3)), 4));
                const __m256i s = _mm256_shuffle_epi8(j < 4 ? first8 : last8, pair_mask(j % 4));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (long)r * k + (long)b * QK_K + 32 * j));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), s));
                }
            }
            const float d = h2f(rd16(blk + 208));
            for (int r = 0; r < R; r++) { /* the -32 of every weight: 32 s times the sums of q per 16 */
                const __m256i bs = _mm256_loadu_si256((const __m256i *)(s16 + (long)r * (k / 16) + (long)b * 16));
                const float dd = d * xd[(long)r * blocks + b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(dd), acc[r]);
                offv[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(all16, bs)), _mm256_set1_ps(-32.0f * dd),
                                          offv[r]);
            }
        } else {
            uint32_t w[4]; /* the 12 bytes of scales and mins -> sc[0..7] in bytes 0-7, m[0..7] in bytes 8-15 */
            memcpy(w, blk + 4, 12);
            const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
            w[0] = w0 & 0x3f3f3f3fu;
            w[1] = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
            w[2] = w1 & 0x3f3f3f3fu;
            w[3] = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
            const __m128i both = _mm_loadu_si128((const __m128i *)w);
            const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(both));
            const __m128i mbytes = _mm_srli_si128(both, 8); /* m_j twice, as int16: madd with the sums per 16 */
            const __m256i mdup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mbytes, mbytes));
            const uint8_t *qs = blk + (fmt == G_Q4_K ? 16 : 48);
            const __m256i qh = fmt == G_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if (fmt == G_Q5_K) {
                    const __m256i one = _mm256_set1_epi8(1);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
                }
                const __m256i s_lo = _mm256_shuffle_epi8(sc16, same_mask(2 * c)), s_hi = _mm256_shuffle_epi8(sc16, same_mask(2 * c + 1));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const int8_t *xb = xq + (long)r * k + (long)b * QK_K + 64 * c;
                    const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xb)), s_lo);
                    const __m256i ph =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb + 32))), s_hi);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                }
            }
            const float d = h2f(rd16(blk)), dmin = h2f(rd16(blk + 2));
            for (int r = 0; r < R; r++) { /* lane j: m_j times the sum of q over sub-block j (its two halves) */
                const __m256i bs = _mm256_loadu_si256((const __m256i *)(s16 + (long)r * (k / 16) + (long)b * 16));
                const float dx = xd[(long)r * blocks + b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * dx), acc[r]);
                offv[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mdup)), _mm256_set1_ps(-(dmin * dx)),
                                          offv[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]) + hsum_ps(offv[r]);
}
#else
INLINE void k_outputs(const int fmt, const int R, const uint8_t *row, int k, const int8_t *xq, const float *xd,
                      const int16_t *s16, float *out) {
    const int blocks = k / QK_K;
    float acc[G_TILE], off[G_TILE];
    for (int r = 0; r < R; r++) acc[r] = off[r] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = row + (long)b * G_BYTES[fmt];
        for (int r = 0; r < R; r++) {
            const int8_t *xb = xq + (long)r * k + (long)b * QK_K;
            const int16_t *bs = s16 + (long)r * (k / 16) + (long)b * 16;
            int32_t sumi = 0, msum = 0;
            for (int j = 0; j < 8; j++) {
                Sub s;
                sub_block(fmt, blk, j, &s);
                int32_t lo = 0, hi = 0;
                for (int i = 0; i < 16; i++) lo += s.w[i] * xb[32 * j + i];
                for (int i = 16; i < 32; i++) hi += s.w[i] * xb[32 * j + i];
                if (fmt == G_Q6_K) sumi += s.s0 * lo + s.s1 * hi;
                else {
                    int sc, m;
                    scale_min(blk + 4, j, &sc, &m);
                    sumi += sc * (lo + hi);
                    msum += m * (bs[2 * j] + bs[2 * j + 1]);
                }
            }
            const float dx = xd[(long)r * blocks + b];
            if (fmt == G_Q6_K) acc[r] = acc[r] + (float)sumi * (h2f(rd16(blk + 208)) * dx);
            else {
                acc[r] = acc[r] + (float)sumi * (h2f(rd16(blk)) * dx);
                off[r] = off[r] + -(h2f(rd16(blk + 2)) * dx) * (float)msum;
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = acc[r] + off[r];
}
#endif

/* The same with the activations as they are (float32 x, `xs` its sums per 32): per sub-block the float sum of
 * w * x, times a, plus b times the sum of x; weight-only, as `--quantization int8|int4` asks. */
#if A8_ISA == 1
INLINE void float_outputs(const int fmt, const int R, const uint8_t *row, int k, const float *x, const float *xs,
                          float *out) {
    const int per = G_WEIGHTS[fmt] / 32, blocks = k / G_WEIGHTS[fmt];
    __m256 acc[G_TILE];
    float off[G_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        off[r] = 0.0f;
    }
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = row + (long)b * G_BYTES[fmt];
        for (int j = 0; j < per; j++) {
            const int at = b * per + j;
            float a, bo = 0.0f;
            if (fmt == G_Q4_K || fmt == G_Q5_K) {
                int sc, m;
                scale_min(blk + 4, j, &sc, &m);
                a = h2f(rd16(blk)) * (float)sc;
                bo = -(h2f(rd16(blk + 2)) * (float)m);
            } else if (fmt == G_Q6_K) {
                a = h2f(rd16(blk + 208));
            } else {
                a = h2f(rd16(blk));
                if (fmt == G_Q4_1 || fmt == G_Q5_1) bo = h2f(rd16(blk + 2));
            }
            const __m256i w = sub_vector(fmt, blk, j);
            __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
            __m256 wf[4];
            if (has_offset(fmt)) {
                wf[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                wf[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                wf[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                wf[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            } else {
                wf[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
                wf[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
                wf[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
                wf[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
            }
            if (fmt == G_Q6_K) { /* the int8 scales of the two halves folded into the integers (exact) */
                const int8_t *s6 = (const int8_t *)(blk + 192);
                const __m256 s0 = _mm256_set1_ps((float)s6[2 * j]), s1 = _mm256_set1_ps((float)s6[2 * j + 1]);
                wf[0] = _mm256_mul_ps(wf[0], s0);
                wf[1] = _mm256_mul_ps(wf[1], s0);
                wf[2] = _mm256_mul_ps(wf[2], s1);
                wf[3] = _mm256_mul_ps(wf[3], s1);
            }
            const __m256 va = _mm256_set1_ps(a);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const float *xb = x + (long)r * k + 32 * at;
                __m256 sum = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xb));
                sum = _mm256_fmadd_ps(wf[1], _mm256_loadu_ps(xb + 8), sum);
                sum = _mm256_fmadd_ps(wf[2], _mm256_loadu_ps(xb + 16), sum);
                sum = _mm256_fmadd_ps(wf[3], _mm256_loadu_ps(xb + 24), sum);
                acc[r] = _mm256_fmadd_ps(sum, va, acc[r]);
                if (has_offset(fmt)) off[r] = off[r] + bo * xs[(long)r * (k / 32) + at];
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]) + off[r];
}
#else
INLINE void float_outputs(const int fmt, const int R, const uint8_t *row, int k, const float *x, const float *xs,
                          float *out) {
    const int per = G_WEIGHTS[fmt] / 32, blocks = k / G_WEIGHTS[fmt];
    float acc[G_TILE], off[G_TILE];
    for (int r = 0; r < R; r++) acc[r] = off[r] = 0.0f;
    for (int b = 0; b < blocks; b++)
        for (int j = 0; j < per; j++) {
            Sub s;
            sub_block(fmt, row + (long)b * G_BYTES[fmt], j, &s);
            const int at = b * per + j;
            for (int r = 0; r < R; r++) {
                const float *xb = x + (long)r * k + 32 * at;
                float sum = 0.0f;
                for (int i = 0; i < 32; i++) sum = sum + (float)(s.w[i] * (i < 16 ? s.s0 : s.s1)) * xb[i];
                acc[r] = acc[r] + sum * s.a;
                if (has_offset(fmt)) off[r] = off[r] + s.b * xs[(long)r * (k / 32) + at];
            }
        }
    for (int r = 0; r < R; r++) out[r] = acc[r] + off[r];
}
#endif

/* Weight rows [first, last) for every input row: G_GROUP weight rows at a time, passed by every tile of input rows
 * while they are in the core's cache; outputs with the bias added, written in y's dtype. */
static inline int is_k(int fmt) { return fmt == G_Q4_K || fmt == G_Q5_K || fmt == G_Q6_K; }

INLINE void ggml_rows(const int fmt, int rows, long n, int k, const int8_t *xq, const float *xd, const float *xsf,
                      const float *xf, const float *dk, const int16_t *s16, const uint8_t *q, long row_bytes,
                      const float *bias, void *y, int bf16, long first, long last) {
    const int subs = k / 32;
    float out[G_TILE];
    for (long g = first; g < last; g += G_GROUP) {
        const long end = g + G_GROUP < last ? g + G_GROUP : last;
        for (int r0 = 0; r0 < rows; r0 += G_TILE) {
            const int R = rows - r0 < G_TILE ? rows - r0 : G_TILE;
            const int8_t *xr = xq + (long)r0 * k;
            const float *dr = xd + (long)r0 * subs, *sr = xsf + (long)r0 * subs, *fr = xf + (long)r0 * k;
            for (long j = g; j < end; j++) {
                const uint8_t *row = q + j * row_bytes;
                if (is_k(fmt) && !xf) { /* R a constant in each case: the accumulators stay in registers */
                    switch (R) {
                    case 1: k_outputs(fmt, 1, row, k, xr, dk + (long)r0 * (k / QK_K), s16 + (long)r0 * (k / 16), out); break;
                    case 2: k_outputs(fmt, 2, row, k, xr, dk + (long)r0 * (k / QK_K), s16 + (long)r0 * (k / 16), out); break;
                    case 3: k_outputs(fmt, 3, row, k, xr, dk + (long)r0 * (k / QK_K), s16 + (long)r0 * (k / 16), out); break;
                    default: k_outputs(fmt, G_TILE, row, k, xr, dk + (long)r0 * (k / QK_K), s16 + (long)r0 * (k / 16), out); break;
                    }
                } else if (xf) {
                    switch (R) {
                    case 1: float_outputs(fmt, 1, row, k, fr, sr, out); break;
                    case 2: float_outputs(fmt, 2, row, k, fr, sr, out); break;
                    case 3: float_outputs(fmt, 3, row, k, fr, sr, out); break;
                    default: float_outputs(fmt, G_TILE, row, k, fr, sr, out); break;
                    }
                } else {
                    switch (R) {
                    case 1: row_outputs(fmt, 1, row, k, xr, dr, sr, out); break;
                    case 2: row_outputs(fmt, 2, row, k, xr, dr, sr, out); break;
                    case 3: row_outputs(fmt, 3, row, k, xr, dr, sr, out); break;
                    default: row_outputs(fmt, G_TILE, row, k, xr, dr, sr, out); break;
                    }
                }
                for (int r = 0; r < R; r++) {
                    const long at = (long)(r0 + r) * n + j;
                    const float v = bias ? out[r] + bias[j] : out[r];
                    if (bf16) ((uint16_t *)y)[at] = f2bf(v);
                    else ((float *)y)[at] = v;
                }
            }
        }
    }
}

/* x [rows, k] (rows `x_stride` elements apart; bfloat16 when `bf16`, else float32) times the weight of n rows of
 * the file's blocks (`fmt`; plus G_FLOAT: x taken as it is, not rounded to Q8_0 blocks), plus `bias` (float32, or
 * NULL), into y [rows, n] in x's dtype; `unused` keeps `a8_linear`'s argument list (its scales). The threads
 * prepare their share of x's rows, then compute their share of the weight's rows. 0, or -1 for an unknown format,
 * k not a whole number of blocks, or no memory (nothing written). */
#define G_FLOAT 16
int ggml_linear(int fmt, int rows, int n, int k, const void *x, long x_stride, int bf16, const void *q,
                const void *unused, const float *bias, void *y, int threads) {
    (void)unused;
    const int as_is = fmt >= G_FLOAT;
    fmt -= as_is ? G_FLOAT : 0;
    if (fmt < 0 || fmt >= G_FORMATS || k % G_WEIGHTS[fmt] || rows <= 0) return -1;
    const int subs = k / 32;
    const long row_bytes = (long)(k / G_WEIGHTS[fmt]) * G_BYTES[fmt];
    const size_t xq_bytes = ((size_t)rows * k + 63) / 64 * 64, xf_bytes = as_is ? sizeof(float) * (size_t)rows * k : 0;
    const int k_rounded = is_k(fmt) && !as_is; /* Q8_K activations: dk per 256, s16 per 16 */
    char *scratch = malloc(xq_bytes + xf_bytes + (sizeof(float) * 2 + sizeof(int32_t)) * (size_t)rows * subs +
                           (sizeof(float) + sizeof(int16_t) * 16) * (size_t)rows * (k / QK_K + 1));
    if (!scratch) return -1;
    int8_t *xq = (int8_t *)scratch;
    float *xf = as_is ? (float *)(scratch + xq_bytes) : NULL;
    float *xd = (float *)(scratch + xq_bytes + xf_bytes);
    float *xsf = xd + (size_t)rows * subs;
    int32_t *xs = (int32_t *)(xsf + (size_t)rows * subs);
    float *dk = (float *)(xs + (size_t)rows * subs);
    int16_t *s16 = (int16_t *)(dk + (size_t)rows * (k / QK_K + 1));
    const size_t x_size = bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int per_t = (rows + nt - 1) / nt, r_first = t * per_t < rows ? t * per_t : rows,
                  r_last = r_first + per_t < rows ? r_first + per_t : rows;
        if (as_is) /* x in float32, and its sums per 32 in a fixed order */
            for (long r = r_first; r < r_last; r++)
                for (int i = 0; i < k; i++) {
                    const long at = r * x_stride + i;
                    const float v = bf16 ? bf2f(((const uint16_t *)x)[at]) : ((const float *)x)[at];
                    xf[r * k + i] = v;
                    if (i % 32 == 0) xsf[r * subs + i / 32] = v;
                    else xsf[r * subs + i / 32] = xsf[r * subs + i / 32] + v;
                }
        else if (k_rounded)
            round_rows_k(r_last - r_first, k, (const char *)x + (size_t)r_first * x_stride * x_size, x_stride, bf16,
                         xq + (size_t)r_first * k, dk + (size_t)r_first * (k / QK_K), s16 + (size_t)r_first * (k / 16));
        else {
            round_rows(r_last - r_first, k, (const char *)x + (size_t)r_first * x_stride * x_size, x_stride, bf16,
                       xq + (size_t)r_first * k, xd + (size_t)r_first * subs, xs + (size_t)r_first * subs);
            for (long i = (long)r_first * subs; i < (long)r_last * subs; i++) xsf[i] = xd[i] * (float)(xs[i] / 8);
        }
#pragma omp barrier
        const long per = (n + nt - 1) / nt, first = t * per < n ? t * per : n, last = first + per < n ? first + per : n;
        switch (fmt) { /* a constant in each: the format's branches leave the inner loops */
#define G_CASE(f) case f: ggml_rows(f, rows, n, k, xq, xd, xsf, xf, dk, s16, q, row_bytes, bias, y, bf16, first, last); break
        G_CASE(G_Q4_0); G_CASE(G_Q4_1); G_CASE(G_Q5_0); G_CASE(G_Q5_1); G_CASE(G_Q8_0);
        G_CASE(G_Q4_K); G_CASE(G_Q5_K); default: G_CASE(G_Q6_K);
#undef G_CASE
        }
    }
    free(scratch);
    return 0;
}
