/* GGUF block formats shared by the kernels (format ids are GGML's type ids). */
#ifndef REDLITE_GGUF_BLOCKS_H
#define REDLITE_GGUF_BLOCKS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

typedef struct {            /* one row block of a stacked weight (e.g. q, k, v) */
    const uint8_t *data;    /* rows * row_bytes bytes */
    int64_t row_bytes;
    int32_t rows;
    int32_t fmt;
} part_t;

/* fn(ctx, begin, end) over chunks of [0, n), on the caller and the pool's workers (pool.c) */
typedef void (*task_fn)(void *ctx, int64_t begin, int64_t end);
void pool_run(task_fn fn, void *ctx, int64_t n, int64_t chunk);
int get_threads(void);

/* y[t, :] = W x[t, :] (+= when accumulate) over the stacked parts (qmatvec.c) */
void qmatvec(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo,
             int accumulate);

static inline float h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

/* 6-bit scale and min j (0..7) of a Q4_K/Q5_K block's 12 packed bytes q */
static inline void scale_min_k4(int j, const uint8_t *q, float *sc, float *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define LD(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOW4(v) _mm256_and_si256(v, _mm256_set1_epi8(15))
#define HIGH4(v) _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15))
#define SHR16(v, n) _mm256_srl_epi16(v, _mm_cvtsi32_si128(n))

static inline __m256i nibbles16(const uint8_t *q) {  /* 16 bytes -> 32 codes, low nibbles first */
    __m128i r = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r, 4), m), _mm_and_si128(r, m));
}

/* codes of sub-block (2j + hi) of a Q4_K/Q5_K block w, as 32 unsigned bytes */
static inline __m256i codes_q45_k(const uint8_t *w, int five, int j, int hi) {
    __m256i raw = LD(w + (five ? 48 : 16) + 32 * j), c = hi ? HIGH4(raw) : LOW4(raw);
    if (five)
        c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(SHR16(LD(w + 16), 2 * j + hi),
                                                                  _mm256_set1_epi8(1)), 4));
    return c;
}

/* codes - 32 of sub-block k (0..7) of a Q6_K block w, as 32 signed bytes */
static inline __m256i codes_q6_k(const uint8_t *w, int k) {
    int h = k / 4, t = k % 4;
    __m256i lo = _mm256_and_si256(SHR16(LD(w + 64 * h + 32 * (t & 1)), 4 * (t >> 1)), _mm256_set1_epi8(15));
    __m256i hb = _mm256_and_si256(SHR16(LD(w + 128 + 32 * h), 2 * t), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
}

#endif
