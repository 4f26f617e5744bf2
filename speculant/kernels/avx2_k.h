// AVX2's vpmaddubsw helpers and its nibble kernels, q4_k and q5_k (`k_tile`), q4_b and q5_b (`b_tile`).
// The includer defines TILE and includes immintrin.h and common.h first.
// Keeps a row's int16 sum in a register, its adds in program order: integer adds being associative, GCC otherwise
// sums a block's vpmaddubsw products as a tree and spills them to the stack (a store and a load per product).
#define IN_ORDER(sum) __asm__("" : "+x"(sum))

static inline __m256i pairs(__m256i w, const int8_t *a) {  // u8 weights x four s8 activations, broadcast
    return _mm256_maddubs_epi16(w, _mm256_set1_epi32(load32(a)));
}

// A block of 32 inputs' int16 sums for each row of a tile, half a panel (h) at a time: q4_k's and q4_b's nibbles
// (byte c*64 + j*4 + t: input 4c + t of output j low, 16 + 4c + t high), eight vpmaddubsw pairs a row.
static inline __attribute__((always_inline)) void nibble_sums(const int rows, const uint8_t *nibbles, int h,
                                                             const int8_t *qa, int64_t K, int64_t kb, __m256i *sum) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < rows; r++) sum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(nibbles + c * 64 + h * 32));
        __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int r = 0; r < rows; r++) {
            const int8_t *a = qa + r * K + kb * 32;
            sum[r] = _mm256_add_epi16(sum[r], pairs(lo, a + 4 * c));
            sum[r] = _mm256_add_epi16(sum[r], pairs(hi, a + 16 + 4 * c));
            IN_ORDER(sum[r]);
        }
    }
}

// bit k of each byte of `plane` at bit 4, the others cleared: a 16-bit lane's shift by at most 4 (left) or 3 (right)
// moves no bit of one byte to bit 4 of the other.
static inline __m256i bit4(__m256i plane, int k) {
    __m256i moved = k <= 4 ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - k))
                           : _mm256_srl_epi16(plane, _mm_cvtsi32_si128(k - 4));
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// A five-bit block of 32 inputs (q5_k's, q5_b's): int32 dots for each row of a tile, half a panel (h) at a time,
// q4_k's nibbles with each one's high bit from the 64 bytes after them (bit 2c: the low nibble of group c, 2c + 1:
// the high). Five bits times 127 make a pair of at most 2 * 31 * 127 = 7874: four pairs (two groups) to an int16 sum.
static inline __attribute__((always_inline)) void five_dots(const int rows, const uint8_t *nibbles, int h,
                                                           const int8_t *qa, int64_t K, int64_t kb, __m256i *dot) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i plane = _mm256_loadu_si256((const __m256i *)(nibbles + 256 + h * 32));
    for (int r = 0; r < rows; r++) dot[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {
        __m256i sum[TILE];
        for (int r = 0; r < rows; r++) sum[r] = _mm256_setzero_si256();
        for (int c = 2 * half; c < 2 * half + 2; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(nibbles + c * 64 + h * 32));
            __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low), bit4(plane, 2 * c));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), bit4(plane, 2 * c + 1));
            for (int r = 0; r < rows; r++) {
                const int8_t *a = qa + r * K + kb * 32;
                sum[r] = _mm256_add_epi16(sum[r], pairs(lo, a + 4 * c));
                sum[r] = _mm256_add_epi16(sum[r], pairs(hi, a + 16 + 4 * c));
                IN_ORDER(sum[r]);
            }
        }
        for (int r = 0; r < rows; r++) dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(sum[r], ones));
    }
}

// A super-block's sums land in y, the tile's outputs (one half of the panel's: y points at it).
static inline __attribute__((always_inline)) void add_super8(const int rows, const __m256 *sb, const float *sa,
                                                            int64_t s, int64_t K, float *y, int64_t O) {
    for (int r = 0; r < rows; r++)
        _mm256_storeu_ps(y + r * O, _mm256_fmadd_ps(sb[r], _mm256_set1_ps(sa[r * supers(K) + s]),
                                                    s ? _mm256_loadu_ps(y + r * O) : _mm256_setzero_ps()));
}

// q4_k, and q5_k (`five`: its blocks' high bits beside the nibbles, `five_dots`).
static inline __attribute__((always_inline)) void k_tile(const int five, const int rows, const int8_t *qa,
                                                        const float *sa, const int16_t *s32, int64_t K,
                                                        const uint8_t *panel, float *y, int64_t O) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t super = five ? Q5K_SUPER : Q4K_SUPER, block = five ? Q5K_BLOCK : Q4K_BLOCK;
    for (int h = 0; h < 2; h++)
        for (int64_t s = 0; s < supers(K); s++) {
            const uint8_t *sp = panel + s * super;
            if (h == 0) prefetch(sp + PREFETCH * super, super);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + h * 16))), sb[TILE];
            for (int r = 0; r < rows; r++) sb[r] = _mm256_setzero_ps();
            for (int b = 0; b < blocks_in(s, K, 8); b++) {
                const uint8_t *bp = sp + 64 + b * block;
                __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bp + h * 8)))));
                int64_t kb = s * 8 + b;
                __m256i dot[TILE];
                if (five) {
                    five_dots(rows, bp + 32, h, qa, K, kb, dot);
                } else {
                    nibble_sums(rows, bp + 32, h, qa, K, kb, dot);  // int16: the block's eight vpmaddubsw per row
                    for (int r = 0; r < rows; r++) dot[r] = _mm256_madd_epi16(dot[r], ones);
                }
                for (int r = 0; r < rows; r++)
                    sb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), scale, sb[r]);
            }
            // The mins: each lane's m of blocks 2j and 2j + 1 as int16 pairs, times the rows' pairs of sums.
            __m256i mins[4];
            for (int j = 0; j < blocks_in(s, K, 8) / 2; j++) {
                const uint8_t *m = sp + 64 + 2 * j * block + 16 + h * 8;
                __m256i even = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m));
                __m256i odd = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m + block)));
                mins[j] = _mm256_or_si256(even, _mm256_slli_epi32(odd, 16));
            }
            __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + 32 + h * 16)));
            for (int r = 0; r < rows; r++) {
                const int16_t *sums = s32 + r * (K / 32) + s * 8;
                __m256i total = _mm256_setzero_si256();
                for (int j = 0; j < blocks_in(s, K, 8) / 2; j++) {
                    __m256i pair = _mm256_set1_epi32(load32((const int8_t *)(sums + 2 * j)));
                    total = _mm256_add_epi32(total, _mm256_madd_epi16(mins[j], pair));
                }
                sb[r] = _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(total), sb[r]);
            }
            add_super8(rows, sb, sa, s, K, y + h * 8, O);
        }
}

// q4_b's and q5_b's (`five`) blocks, half a panel at a time: the dots of q4_k's nibbles (`nibble_sums`, eight
// vpmaddubsw pairs of at most 3810 in int16) or of q5_k's five bits (`five_dots`), q8_b's fp32 arithmetic.
static inline __attribute__((always_inline)) void b_tile(const int five, const int rows, const int8_t *qa,
                                                        const float *sa, const int16_t *s32, int64_t K,
                                                        const uint8_t *panel, float *y, int64_t O) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t block = five ? Q5B_BLOCK : Q4B_BLOCK;
    for (int h = 0; h < 2; h++)
        for (int64_t s = 0; s < supers(K); s++) {
            const uint8_t *sp = panel + s * 8 * block;
            if (h == 0) prefetch(sp + PREFETCH * 8 * block, 8 * block);
            __m256 sb[TILE];
            for (int r = 0; r < rows; r++) sb[r] = _mm256_setzero_ps();
            for (int b = 0; b < blocks_in(s, K, 8); b++) {
                const uint8_t *bp = sp + b * block;
                __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + h * 16)));
                __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bp + 32 + h * 16)));
                int64_t kb = s * 8 + b;
                __m256i dot[TILE];
                if (five) {
                    five_dots(rows, bp + 64, h, qa, K, kb, dot);
                } else {
                    nibble_sums(rows, bp + 64, h, qa, K, kb, dot);
                    for (int r = 0; r < rows; r++) dot[r] = _mm256_madd_epi16(dot[r], ones);
                }
                for (int r = 0; r < rows; r++) {
                    sb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), d, sb[r]);
                    sb[r] = _mm256_fmadd_ps(_mm256_set1_ps((float)s32[r * (K / 32) + kb]), m, sb[r]);
                }
            }
            add_super8(rows, sb, sa, s, K, y + h * 8, O);
        }
}
