// Shared by every ISA's kernel file: the packed layouts, activation quantization, and the per-output
// arithmetic that all of them perform in the same order, so that every path (scalar, AVX2, AVX-512 VNNI)
// gives the same bits, and a row's result never depends on how many rows share the call.
//
// Packed weights (speculant/kernels/formats.py writes them), for panels of 16 outputs, K / 256 super-blocks
// each, then where K (a multiple of 128) is not a multiple of 256 the first half of one (its header and the
// blocks of its first 128 inputs: the rest would be padding):
//   q4_k  per 256 inputs (a super-block), 2368 bytes: d[16], dmin[16] (f16), then 8 blocks of 32 inputs,
//         each sc[16], m[16] (u8, six bits used) and 256 bytes of nibbles: byte c*64 + j*4 + t holds input
//         4c + t of output j in its low nibble and input 16 + 4c + t in its high nibble (c < 4, t < 4).
//         w = d*sc * q - dmin*m.
//   q5_k  per 256 inputs, 2880 bytes: q4_k's, each block's nibbles followed by 64 bytes of high bits (byte j*4 + t:
//         bit 2c that of input 4c + t of output j, bit 2c + 1 that of input 16 + 4c + t, c < 4). w = d*sc * q - dmin*m,
//         q < 32: Q5_K, at 5.6 bits a weight where q8_b spends 10.
//   q6_k  per 256 inputs, 3360 bytes: d[16] (f16), then 16 blocks of 16 inputs, each sc[16] (i8), 128 bytes
//         of low nibbles (byte c*64 + j*4 + t: input 4c + t low, input 8 + 4c + t high, c < 2) and 64 bytes
//         of high bit pairs (byte j*4 + t: bits 2g, 2g+1 of input 4g + t's six, g < 4). w = d*sc * (q - 32).
//   q8_b  per 32 inputs (a block; 8 to a super-block), 640 bytes: d[16], m[16] (fp32), then 512 bytes: byte g*64 +
//         j*4 + t holds q + 128 for input 4g + t of output j (g < 8, t < 4), q an int8. w = d*q + m: Q8_0, whose
//         weights are exactly that (formats.unpack_blocks32).
//   q4_b  per 32 inputs (a block), 320 bytes: d[16], m[16] (f16), then q4_k's 256 bytes of nibbles (0..15).
//         w = d*q + m: Q4_0 (q + 8, m = -8d) and Q4_1, at 5 bits a weight where q8_b spends 10.
//   q5_b  per 32 inputs, 384 bytes: q4_b's, then q5_k's 64 bytes of high bits: q < 32, Q5_0 (q + 16, m = -16d) and
//         Q5_1 at 6 bits a weight.
// Activations: each row quantized on its own, per super-block of 256 inputs (128 for a last half one), to int8
// with one scale sa (ggml's Q8_K rule), beside the sums of its quants per 32 inputs (s32, int16: q4_k's mins)
// and -32 times those per 16 (o16, int32: q6_k's offset, where each block's integer dot starts).
// Per output, super-block after super-block from acc = 0, with sb = 0 at each one's start:
//   q4_k  sb = fma((float)dot_b, d*sc_b, sb) for each block b in order, then sb = fma(-dmin, (float)(the exact
//         integer sum of m_b * s32_b), sb); q5_k alike;
//   q6_k  sb = fma((float)(o16_b + dot_b), d*sc_b, sb) for each block b in order;
//   q8_b  sb = fma((float)dot_b, d_b, sb), then sb = fma((float)s32_b, m_b, sb), for each block b in order;
//   q4_b  as q8_b, its dot over the nibbles as they are (no offset); q5_b alike;
//   then acc = fma(sb, sa, acc). The integer sums are exact whatever their order, and per-256 activation scales
//   leave two float operations per block and row where per-32 ones needed four (ggml's numerics for K-quants).
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define Q4K_SUPER 2368
#define Q4K_BLOCK 288
#define Q5K_BLOCK 352
#define Q5K_SUPER (64 + 8 * Q5K_BLOCK)
#define Q5K_TAIL (64 + 4 * Q5K_BLOCK)
#define Q6K_SUPER 3360
#define Q6K_BLOCK 208
#define Q4K_TAIL (64 + 4 * Q4K_BLOCK)
#define Q6K_TAIL (32 + 8 * Q6K_BLOCK)
#define Q8B_BLOCK 640
#define Q8B_SUPER (8 * Q8B_BLOCK)
#define Q8B_TAIL (4 * Q8B_BLOCK)
#define Q4B_BLOCK 320
#define Q4B_SUPER (8 * Q4B_BLOCK)
#define Q4B_TAIL (4 * Q4B_BLOCK)
#define Q5B_BLOCK 384
#define Q5B_SUPER (8 * Q5B_BLOCK)
#define Q5B_TAIL (4 * Q5B_BLOCK)

// A panel's bytes, and the blocks of super-block s (a last half one holds half of them).
static inline int64_t panel_bytes(int64_t K, int64_t super, int64_t tail) {
    return K / 256 * super + (K % 256 ? tail : 0);
}
static inline int blocks_in(int64_t s, int64_t K, int blocks) { return s < K / 256 ? blocks : blocks / 2; }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  // subnormal: normalize
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Prefetch into L2 the super-block this many ahead of the one being multiplied (the next panels of a thread
// follow in memory): the weight stream then overlaps the arithmetic of several rows (docs/results/cpu.md measures
// what it buys). Reading past the end is harmless: a prefetch never faults.
#define PREFETCH 4

static inline void prefetch(const uint8_t *p, int bytes) {
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 2);
}

static inline int32_t load32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

#ifdef __AVX__
#include <immintrin.h>
// The end of sum16 (layer.h) on AVX: lanes l and l + 8 already added (w8), then l += l + 4, l + 2, l + 1 as
// halves of registers, then the products past the last 16 inputs.
static inline float lanes8_sum(__m256 w8, const float *a, const float *b, int64_t whole, int64_t n) {
    __m128 w4 = _mm_add_ps(_mm256_castps256_ps128(w8), _mm256_extractf128_ps(w8, 1));
    __m128 w2 = _mm_add_ps(w4, _mm_movehl_ps(w4, w4));
    __m128 w1 = _mm_add_ss(w2, _mm_shuffle_ps(w2, w2, 1));
    float tail = 0.0f;
    for (int64_t i = whole; i < n; i++) tail += a[i] * b[i];
    return _mm_cvtss_f32(w1) + tail;
}
#endif

// e^x for softmax and SiLU: x = n ln2 + r (Cody-Waite's two-part ln2), e^r by Cephes' expf polynomial (within an
// ulp of libm's expf), 2^n built in the exponent bits; 0 below -87.3 (no subnormals), e^88.3 above 88.3. Plain C
// whose selects compilers vectorize (with -fno-trapping-math), with the same bits on every ISA, where a libm call
// per element cost ~11 cycles.
static inline float exp_poly(float x) {
    float xc = x < -87.3f ? -87.3f : x;
    xc = xc > 88.3f ? 88.3f : xc;
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // to nearest, ties to even (1.5 * 2^23)
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23};
    float y = p * scale.f;
    return x >= -87.3f ? y : 0.0f;
}

// The super-blocks of a row of K inputs (a multiple of 128): the last holds 128 where K is not a multiple of 256.
static inline int64_t supers(int64_t K) { return (K + 255) / 256; }

// One super-block of n (256 or 128) inputs -> its quants, scale and sums. Written so that compilers vectorize it
// (lanes compared, never a library call): max and round-to-nearest-even are exact, so every ISA gives the same bits.
static inline void quantize_super(const float *x, int n, int8_t *q, float *sa, int16_t *s32, int32_t *o16) {
    float lanes[16] = {0}, rounded[256];
    for (int i = 0; i < n; i += 16)
        for (int l = 0; l < 16; l++) {
            float a = fabsf(x[i + l]);
            lanes[l] = a > lanes[l] ? a : lanes[l];
        }
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lanes[l] = lanes[l + w] > lanes[l] ? lanes[l + w] : lanes[l];
    float d = lanes[0] / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) rounded[i] = __builtin_roundevenf(x[i] * id);
    for (int i = 0; i < n; i++) q[i] = (int8_t)(int32_t)rounded[i];
    for (int b = 0; b < n / 32; b++) {
        int32_t low = 0, high = 0;
        for (int i = 0; i < 16; i++) low += q[32 * b + i], high += q[32 * b + 16 + i];
        s32[b] = (int16_t)(low + high);
        o16[2 * b] = -32 * low;
        o16[2 * b + 1] = -32 * high;
    }
    *sa = d;
}

// x [rows, K] -> qa [rows, K] int8, sa [rows, supers(K)], s32 [rows, K/32], o16 [rows, K/16]; K a multiple of
// 128. Super-blocks are independent: split among threads where there are enough of them.
void quantize_rows(const float *x, int64_t rows, int64_t K, int8_t *qa, float *sa, int16_t *s32, int32_t *o16,
                   int threads) {
    int64_t S = supers(K), items = rows * S;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(items >= 64)")
    for (int64_t i = 0; i < items; i++) {
        int64_t r = i / S, s = i % S, k = r * K + s * 256;
        quantize_super(x + k, K - s * 256 < 256 ? 128 : 256, qa + k, sa + i, s32 + k / 32, o16 + k / 16);
    }
}

// The row-tile loop every ISA shares: panels split among threads, rows in tiles of at most TILE, a
// tile's rows all reading each unpacked weight block (TILE_FN(rows, ...) is the ISA's kernel).
#define MATMUL(NAME, SUPER, TAIL, TILE, TILE_FN)                                                        \
    void NAME(const int8_t *qa, const float *sa, const int16_t *s32, const int32_t *o16, int64_t rows,  \
              int64_t K, const uint8_t *packed, int64_t O, float *y, int threads) {                     \
        int64_t stride = panel_bytes(K, SUPER, TAIL);                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                               \
        for (int64_t p = 0; p < O / PANEL; p++)                                                         \
            for (int64_t n = 0; n < rows; n += TILE)                                                    \
                TILE_FN(rows - n < TILE ? rows - n : TILE, qa + n * K, sa + n * supers(K),              \
                        s32 + n * (K / 32), o16 + n * (K / 16), K, packed + p * stride,                 \
                        y + n * O + p * PANEL, O);                                                      \
    }

// One specialization per tile height up to TILE (at most 16), so that each keeps its accumulators in
// registers: KERNEL##_rows(rows, ...) calls KERNEL(rows, ...) with rows a constant.
#define ROWS_CASE(KERNEL, TILE, N) case N: if (TILE >= N) KERNEL(N, qa, sa, s32, o16, K, panel, y, O); break;
#define DISPATCH(KERNEL, TILE)                                                                          \
    static void KERNEL##_rows(int64_t rows, const int8_t *qa, const float *sa, const int16_t *s32,      \
                              const int32_t *o16, int64_t K, const uint8_t *panel, float *y,            \
                              int64_t O) {                                                              \
        switch (rows < TILE ? rows : TILE) {                                                            \
            ROWS_CASE(KERNEL, TILE, 1) ROWS_CASE(KERNEL, TILE, 2) ROWS_CASE(KERNEL, TILE, 3)            \
            ROWS_CASE(KERNEL, TILE, 4) ROWS_CASE(KERNEL, TILE, 5) ROWS_CASE(KERNEL, TILE, 6)            \
            ROWS_CASE(KERNEL, TILE, 7) ROWS_CASE(KERNEL, TILE, 8) ROWS_CASE(KERNEL, TILE, 9)            \
            ROWS_CASE(KERNEL, TILE, 10) ROWS_CASE(KERNEL, TILE, 11) ROWS_CASE(KERNEL, TILE, 12)         \
            ROWS_CASE(KERNEL, TILE, 13) ROWS_CASE(KERNEL, TILE, 14) ROWS_CASE(KERNEL, TILE, 15)         \
            default: if (TILE >= 16) KERNEL(16, qa, sa, s32, o16, K, panel, y, O);                      \
        }                                                                                               \
    }
