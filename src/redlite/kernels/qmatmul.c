/* GGUF block formats on CPU: rows dequantized to float32, and y = W x with x quantized to
 * 8 bits per 32-value block (as llama.cpp does), for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K.
 * Format ids are GGML's type ids. AVX2 + FMA + F16C; OpenMP over output rows.
 * Built and loaded by redlite/kernels/native.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

typedef struct { int8_t q[32]; float d; float s; } xq8; /* s = d * sum(q) */

typedef struct {            /* one row block of a stacked weight (e.g. q, k, v) */
    const uint8_t *data;    /* rows * row_bytes bytes */
    int64_t row_bytes;
    int32_t rows;
    int32_t fmt;
} part_t;

static inline float h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

int block_bytes(int fmt) {  /* bytes per block of block_values(fmt) values */
    switch (fmt) {
    case Q4_0: return 18; case Q4_1: return 20; case Q8_0: return 34;
    case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
    }
    return 0;
}
int block_values(int fmt) { return fmt >= Q4_K ? 256 : 32; }

/* ---- dequantization (reference for everything else) ---- */

static inline void scale_min_k4(int j, const uint8_t *q, float *sc, float *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static void dequant_row(int fmt, const uint8_t *w, int n, float *y) {
    for (int b = 0; b < n / block_values(fmt); b++) {
        if (fmt == Q4_0 || fmt == Q4_1) {
            float d = h2f(w), m = fmt == Q4_1 ? h2f(w + 2) : -8.f * d;
            const uint8_t *q = w + (fmt == Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) { y[i] = (q[i] & 15) * d + m; y[i + 16] = (q[i] >> 4) * d + m; }
        } else if (fmt == Q8_0) {
            float d = h2f(w);
            for (int i = 0; i < 32; i++) y[i] = (int8_t)w[2 + i] * d;
        } else if (fmt == Q4_K || fmt == Q5_K) {
            float d = h2f(w), dmin = h2f(w + 2), sc, m;
            const uint8_t *s = w + 4, *qh = w + 16, *q = w + (fmt == Q5_K ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                scale_min_k4(j, s, &sc, &m);
                for (int l = 0; l < 32; l++) {
                    int c = (q[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                    if (fmt == Q5_K) c |= ((qh[l] >> j) & 1) << 4;
                    y[32 * j + l] = d * sc * c - dmin * m;
                }
            }
        } else if (fmt == Q6_K) {
            const uint8_t *ql = w, *qh = w + 128; const int8_t *sc = (const int8_t *)(w + 192);
            float d = h2f(w + 208);
            for (int k = 0; k < 8; k++) {
                int h = k / 4, t = k % 4;
                for (int l = 0; l < 32; l++) {
                    int lo = (ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15;
                    int c = lo | (((qh[32 * h + l] >> (2 * t)) & 3) << 4);
                    y[32 * k + l] = d * sc[2 * k + l / 16] * (c - 32);
                }
            }
        }
        w += block_bytes(fmt);
        y += block_values(fmt);
    }
}

/* Rows ids[i] of one part (n values each) -> out [n_ids, n] float32. */
void dequant_rows(const part_t *p, const int64_t *ids, int64_t n_ids, int n, float *out) {
    #pragma omp parallel for schedule(static) if (n_ids > 8)
    for (int64_t i = 0; i < n_ids; i++) dequant_row(p->fmt, p->data + ids[i] * p->row_bytes, n, out + i * n);
}

/* All rows of the stacked parts -> out [sum rows, n] float32. */
void dequant_parts(const part_t *parts, int n_parts, int n, float *out) {
    #pragma omp parallel
    {
        float *o = out;
        for (int p = 0; p < n_parts; p++) {
            #pragma omp for schedule(static) nowait
            for (int r = 0; r < parts[p].rows; r++)
                dequant_row(parts[p].fmt, parts[p].data + r * parts[p].row_bytes, n, o + (int64_t)r * n);
            o += (int64_t)parts[p].rows * n;
        }
    }
}

/* ---- 8-bit activations ---- */

void quantize_q8(const float *x, int n, xq8 *out) {
    for (int b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < 32; i++) { int q = (int)nearbyintf(v[i] * id); out[b].q[i] = (int8_t)q; sum += q; }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

/* ---- dot products of one weight row with 8-bit activations (nb: 32-value blocks) ---- */

static inline __m256 mul_us8(__m256i u, __m256i s) {  /* unsigned u x signed s, summed per 4 */
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline __m256 mul_ss8(__m256i a, __m256i b) { return mul_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define LD(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOW4(v) _mm256_and_si256(v, _mm256_set1_epi8(15))
#define HIGH4(v) _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15))

static inline __m256i nibbles16(const uint8_t *q) {  /* 16 bytes -> 32 codes, low nibbles first */
    __m128i r = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r, 4), m), _mm_and_si128(r, m));
}

static float dot_q4_01(const uint8_t *w, const xq8 *x, int nb, int has_min) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    int stride = has_min ? 20 : 18;
    for (int b = 0; b < nb; b++, w += stride) {
        float d = h2f(w), m = has_min ? h2f(w + 2) : -8.f * d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), mul_us8(nibbles16(w + stride - 16), LD(x[b].q)), acc);
        off += m * x[b].s;
    }
    return hsum(acc) + off;
}

static float dot_q8_0(const uint8_t *w, const xq8 *x, int nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 34)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w) * x[b].d), mul_ss8(LD(w + 2), LD(x[b].q)), acc);
    return hsum(acc);
}

static float dot_q45_k(const uint8_t *w, const xq8 *x, int nb, int five) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f, sc0, m0, sc1, m1;
    for (int b = 0; b < nb / 8; b++, w += five ? 176 : 144, x += 8) {
        float d = h2f(w), dmin = h2f(w + 2);
        const uint8_t *q = w + (five ? 48 : 16);
        __m256i qh = five ? LD(w + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++, q += 32) {
            scale_min_k4(2 * j, w + 4, &sc0, &m0);
            scale_min_k4(2 * j + 1, w + 4, &sc1, &m1);
            __m256i raw = LD(q), lo = LOW4(raw), hi = HIGH4(raw);
            if (five) {
                __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one), 4));
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc0 * x[2 * j].d), mul_us8(lo, LD(x[2 * j].q)), acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc1 * x[2 * j + 1].d), mul_us8(hi, LD(x[2 * j + 1].q)), acc);
            off += dmin * (m0 * x[2 * j].s + m1 * x[2 * j + 1].s);
        }
    }
    return hsum(acc) - off;
}

static float dot_q6_k(const uint8_t *w, const xq8 *x, int nb) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
    for (int b = 0; b < nb / 8; b++, w += 210, x += 8) {
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = h2f(w + 208);
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = LD(w + 64 * h), ql1 = LD(w + 64 * h + 32), qh = LD(w + 128 + 32 * h);
            for (int t = 0; t < 4; t++) {
                int k = 4 * h + t;
                __m256i ql = (t & 1) ? ql1 : ql0;
                __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (t >> 1))), m4);
                __m256i hb = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), m2);
                __m256i c = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 4)), c32);
                __m256i xq = LD(x[k].q);
                __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(xq, c));
                __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[k].d), _mm256_cvtepi32_ps(_mm256_madd_epi16(p, s)), acc);
            }
        }
    }
    return hsum(acc);
}

static inline float dot_row(int fmt, const uint8_t *w, const xq8 *x, int nb) {
    switch (fmt) {
    case Q4_0: return dot_q4_01(w, x, nb, 0);
    case Q4_1: return dot_q4_01(w, x, nb, 1);
    case Q8_0: return dot_q8_0(w, x, nb);
    case Q4_K: return dot_q45_k(w, x, nb, 0);
    case Q5_K: return dot_q45_k(w, x, nb, 1);
    case Q6_K: return dot_q6_k(w, x, nb);
    }
    return NAN;
}

/* y[t, :] = W x[t, :] for the stacked parts (each x row of n values quantized to q8 once, shared
 * by every part); out row stride ldo. */
void qmatmul_q8(const part_t *parts, int n_parts, const xq8 *xq, int n_tok, int n, float *out, int64_t ldo) {
    int nb = n / 32;
    #pragma omp parallel
    {
        int64_t col = 0;
        for (int p = 0; p < n_parts; p++) {
            const part_t *pt = parts + p;
            #pragma omp for schedule(static) nowait
            for (int r = 0; r < pt->rows; r++) {
                const uint8_t *w = pt->data + r * pt->row_bytes;
                for (int t = 0; t < n_tok; t++) out[t * ldo + col + r] = dot_row(pt->fmt, w, xq + t * nb, nb);
            }
            col += pt->rows;
        }
    }
}

void qmatmul(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo) {
    int nb = n / 32;
    xq8 *xq = (xq8 *)aligned_alloc(64, ((sizeof(xq8) * nb * n_tok + 63) / 64) * 64);
    for (int t = 0; t < n_tok; t++) quantize_q8(x + (int64_t)t * n, n, xq + t * nb);
    qmatmul_q8(parts, n_parts, xq, n_tok, n, out, ldo);
    free(xq);
}

void set_threads(int n) { omp_set_num_threads(n); }
int get_threads(void) { return omp_get_max_threads(); }
