/* y = W x with float32 activations for GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K):
 * each block's codes are converted to float and multiplied by x, then scaled (and the block's
 * min times the block sum of x added), so the result is the float32 product of the dequantized
 * weight up to the order of the float32 additions. F32 rows (dense weights) too, n a multiple
 * of 32. AVX2 + FMA + F16C; rows spread over the thread pool. */
#include <stdlib.h>

#include "gguf_blocks.h"

static inline __m256 u8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 s8f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* sum_i c_i * x_i over 16 byte codes (unsigned or signed), as 8 lanes */
static inline __m256 dot16(__m128i c, const float *x, int is_signed) {
    __m256 lo = is_signed ? s8f(c) : u8f(c), hi = is_signed ? s8f(_mm_srli_si128(c, 8)) : u8f(_mm_srli_si128(c, 8));
    return _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 8), _mm256_mul_ps(lo, _mm256_loadu_ps(x)));
}
static inline __m256 dot32(__m256i c, const float *x, int is_signed) {
    return _mm256_add_ps(dot16(_mm256_castsi256_si128(c), x, is_signed),
                         dot16(_mm256_extracti128_si256(c, 1), x + 16, is_signed));
}

/* one weight row (n values) times x; sx: the sums of x per 32 values */
static float fdot_row(int fmt, const uint8_t *w, const float *x, const float *sx, int n) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f, sc, m;
    switch (fmt) {
    case F32:
        for (int i = 0; i < n; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)w + i), _mm256_loadu_ps(x + i), acc);
        break;
    case Q4_0:
    case Q4_1: {
        int stride = fmt == Q4_1 ? 20 : 18;
        for (int b = 0; b < n / 32; b++, w += stride) {
            float d = h2f(w), mn = fmt == Q4_1 ? h2f(w + 2) : -8.f * d;
            __m128i raw = _mm_loadu_si128((const __m128i *)(w + stride - 16)), m4 = _mm_set1_epi8(15);
            __m256 p = _mm256_add_ps(dot16(_mm_and_si128(raw, m4), x + 32 * b, 0),
                                     dot16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), x + 32 * b + 16, 0));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
            off += mn * sx[b];
        }
        break;
    }
    case Q8_0:
        for (int b = 0; b < n / 32; b++, w += 34)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w)), dot32(LD(w + 2), x + 32 * b, 1), acc);
        break;
    case Q4_K:
    case Q5_K: {
        int five = fmt == Q5_K;
        for (int b = 0; b < n / 256; b++, w += five ? 176 : 144, x += 256, sx += 8) {
            float d = h2f(w), dmin = h2f(w + 2);
            for (int s = 0; s < 8; s++) {
                scale_min_k4(s, w + 4, &sc, &m);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc), dot32(codes_q45_k(w, five, s / 2, s & 1), x + 32 * s, 0),
                                      acc);
                off -= dmin * m * sx[s];
            }
        }
        break;
    }
    case Q6_K:
        for (int b = 0; b < n / 256; b++, w += 210, x += 256) {
            const int8_t *scales = (const int8_t *)(w + 192);
            float d = h2f(w + 208);
            for (int k = 0; k < 8; k++) {
                __m256i c = codes_q6_k(w, k);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * scales[2 * k]), dot16(_mm256_castsi256_si128(c), x + 32 * k, 1),
                                      acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * scales[2 * k + 1]),
                                      dot16(_mm256_extracti128_si256(c, 1), x + 32 * k + 16, 1), acc);
            }
        }
        break;
    }
    return hsum(acc) + off;
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
            for (int t = 0; t < j->n_tok; t++) {
                float y = fdot_row(pt->fmt, w, j->x + (int64_t)t * j->n, j->sx + t * nb, j->n);
                float *o = j->out + t * j->ldo + r;
                *o = j->accumulate ? *o + y : y;
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
