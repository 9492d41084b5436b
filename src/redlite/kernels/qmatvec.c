/* y = W x with float32 activations for GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K):
 * each block's codes are converted to float and multiplied by x, then scaled (and the block's
 * min times the block sum of x added), so the result is the float32 product of the dequantized
 * weight up to the order of the float32 additions. F32 rows (dense weights) too, n a multiple
 * of 32. AVX2 + FMA + F16C; rows spread over the thread pool. */
#include <stdlib.h>

#include "gguf_blocks.h"

static inline __m256 u8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 s8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* A block's codes converted to float once, then multiplied by the activations of up to NT
 * tokens: each token's sums are formed exactly as for that token alone (the same operations in
 * the same order), so a row's result does not depend on how many tokens share the pass. */
#define NT 4

/* 16 byte codes as two float vectors (codes 0-7, 8-15) */
static inline void codes16(__m128i c, int is_signed, __m256 *f) {
    f[0] = is_signed ? s8f(c) : u8f(c);
    f[1] = is_signed ? s8f(_mm_srli_si128(c, 8)) : u8f(_mm_srli_si128(c, 8));
}
static inline void codes32(__m256i c, int is_signed, __m256 *f) {
    codes16(_mm256_castsi256_si128(c), is_signed, f);
    codes16(_mm256_extracti128_si256(c, 1), is_signed, f + 2);
}
/* sum_i c_i * x_i over 16 codes, as 8 lanes */
static inline __m256 dot16f(const __m256 *f, const float *x) {
    return _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(x)));
}
static inline __m256 dot32f(const __m256 *f, const float *x) {
    return _mm256_add_ps(dot16f(f, x), dot16f(f + 2, x + 16));
}

/* y[t] = one weight row (n values) times token t's x (x + t * n), t < nt <= NT; sx: the sums
 * of x per 32 values, n / 32 per token */
static void fdot_rows(int fmt, const uint8_t *w, const float *x, const float *sx, int n, int nt, float *y) {
    __m256 acc[NT], f[4];
    float off[NT];
    int nb = n / 32;
    for (int t = 0; t < nt; t++) { acc[t] = _mm256_setzero_ps(); off[t] = 0.f; }
    switch (fmt) {
    case F32:
        for (int i = 0; i < n; i += 8) {
            __m256 wv = _mm256_loadu_ps((const float *)w + i);
            for (int t = 0; t < nt; t++) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * n + i), acc[t]);
        }
        break;
    case Q4_0:
    case Q4_1: {
        int stride = fmt == Q4_1 ? 20 : 18;
        for (int b = 0; b < nb; b++, w += stride) {
            float d = h2f(w), mn = fmt == Q4_1 ? h2f(w + 2) : -8.f * d;
            __m128i raw = _mm_loadu_si128((const __m128i *)(w + stride - 16)), m4 = _mm_set1_epi8(15);
            codes16(_mm_and_si128(raw, m4), 0, f);
            codes16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), 0, f + 2);
            __m256 ds = _mm256_set1_ps(d);
            for (int t = 0; t < nt; t++) {
                const float *xt = x + t * n + 32 * b;
                acc[t] = _mm256_fmadd_ps(ds, _mm256_add_ps(dot16f(f, xt), dot16f(f + 2, xt + 16)), acc[t]);
                off[t] += mn * sx[t * nb + b];
            }
        }
        break;
    }
    case Q8_0:
        for (int b = 0; b < nb; b++, w += 34) {
            codes32(LD(w + 2), 1, f);
            __m256 ds = _mm256_set1_ps(h2f(w));
            for (int t = 0; t < nt; t++) acc[t] = _mm256_fmadd_ps(ds, dot32f(f, x + t * n + 32 * b), acc[t]);
        }
        break;
    case Q4_K:
    case Q5_K: {
        int five = fmt == Q5_K;
        float sc, m;
        for (int b = 0; b < n / 256; b++, w += five ? 176 : 144) {
            float d = h2f(w), dmin = h2f(w + 2);
            for (int s = 0; s < 8; s++) {
                scale_min_k4(s, w + 4, &sc, &m);
                codes32(codes_q45_k(w, five, s / 2, s & 1), 0, f);
                __m256 ds = _mm256_set1_ps(d * sc);
                for (int t = 0; t < nt; t++) {
                    acc[t] = _mm256_fmadd_ps(ds, dot32f(f, x + t * n + 256 * b + 32 * s), acc[t]);
                    off[t] -= dmin * m * sx[t * nb + 8 * b + s];
                }
            }
        }
        break;
    }
    case Q6_K:
        for (int b = 0; b < n / 256; b++, w += 210) {
            const int8_t *scales = (const int8_t *)(w + 192);
            float d = h2f(w + 208);
            for (int k = 0; k < 8; k++) {
                codes32(codes_q6_k(w, k), 1, f);
                __m256 lo = _mm256_set1_ps(d * scales[2 * k]), hi = _mm256_set1_ps(d * scales[2 * k + 1]);
                for (int t = 0; t < nt; t++) {
                    const float *xt = x + t * n + 256 * b + 32 * k;
                    acc[t] = _mm256_fmadd_ps(lo, dot16f(f, xt), acc[t]);
                    acc[t] = _mm256_fmadd_ps(hi, dot16f(f + 2, xt + 16), acc[t]);
                }
            }
        }
        break;
    }
    for (int t = 0; t < nt; t++) y[t] = hsum(acc[t]) + off[t];
}

static void block_sums(const float *x, int n, float *sx) {
    for (int b = 0; b < n / 32; b++) {
        __m256 s = _mm256_loadu_ps(x + 32 * b);
        for (int i = 8; i < 32; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + 32 * b + i));
        sx[b] = hsum(s);
    }
}

typedef struct {
    const part_t *parts;
    int n_parts, n_tok, n, accumulate;
    const float *x, *sx;
    float *out;
    int64_t ldo;
} job_t;

static void rows_task(void *arg, int64_t begin, int64_t end) {
    const job_t *j = (const job_t *)arg;
    int nb = j->n / 32;
    int64_t first = 0;
    for (int p = 0; p < j->n_parts; p++) {
        const part_t *pt = j->parts + p;
        int64_t lo = begin > first ? begin : first, hi = end < first + pt->rows ? end : first + pt->rows;
        for (int64_t r = lo; r < hi; r++) {
            const uint8_t *w = pt->data + (r - first) * pt->row_bytes;
            for (int t0 = 0; t0 < j->n_tok; t0 += NT) {
                int nt = j->n_tok - t0 < NT ? j->n_tok - t0 : NT;
                float y[NT];
                fdot_rows(pt->fmt, w, j->x + (int64_t)t0 * j->n, j->sx + t0 * nb, j->n, nt, y);
                for (int t = 0; t < nt; t++) {
                    float *o = j->out + (t0 + t) * j->ldo + r;
                    *o = j->accumulate ? *o + y[t] : y[t];
                }
            }
        }
        first += pt->rows;
    }
}

/* y[t, :] = W x[t, :] (+ y[t, :] when accumulate) for the stacked parts; x rows of n values,
 * out row stride ldo. */
void qmatvec(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo,
             int accumulate) {
    int nb = n / 32;
    float sx_stack[1024];
    float *sx = nb * n_tok <= 1024 ? sx_stack : (float *)malloc(sizeof(float) * nb * n_tok);
    for (int t = 0; t < n_tok; t++) block_sums(x + (int64_t)t * n, n, sx + t * nb);
    int64_t rows = 0;
    for (int p = 0; p < n_parts; p++) rows += parts[p].rows;
    job_t job = {parts, n_parts, n_tok, n, accumulate, x, sx, out, ldo};
    int64_t chunk = rows / (8 * get_threads());
    pool_run(rows_task, &job, rows, chunk < 16 ? 16 : chunk);
    if (sx != sx_stack) free(sx);
}
