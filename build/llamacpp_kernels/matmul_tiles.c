// specgate patch: a tile of weight rows against up to 16 activation columns (a verified draft's tokens),
// for Q4_0, Q4_1 and Q8_0 weights. Each weight block is unpacked once for all the columns, each column's
// block scales are converted once for all the rows, and each output is summed in one fixed order: per
// block, the int8 dot product in 8 float lanes, scaled and accumulated with one FMA, then the lanes
// summed (as ggml_vec_dot_<type> does). The matmul uses this for every column count, one included,
// so a token's result does not depend on how many tokens its decode holds.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECGATE_COLS 8
#if defined(__AVX512VL__)
#define SPECGATE_ROWS 2  // 32 vector registers: 2 x 8 accumulators
#else
#define SPECGATE_ROWS 1
#endif

enum specgate_kind { SPECGATE_Q4_0, SPECGATE_Q4_1, SPECGATE_Q8_0 };

// NR x NC outputs s[r + c*bs]: rows at vx + r*bx, columns at vy + c*by, the columns' block scales
// yd[ib*SPECGATE_COLS + c] (and ysum, q8_1's d*sum(q), for Q4_1). Constant kind, NR and NC after
// inlining: the loops unroll and the accumulators live in registers.
static inline __attribute__((always_inline)) void specgate_tile(const enum specgate_kind kind, const int NR, const int NC,
        const int nb, float * GGML_RESTRICT s, const size_t bs, const char * GGML_RESTRICT vx, const size_t bx,
        const char * GGML_RESTRICT vy, const size_t by, const float * GGML_RESTRICT yd, const float * GGML_RESTRICT ysum) {
    const size_t xsize = kind == SPECGATE_Q4_0 ? sizeof(block_q4_0) : kind == SPECGATE_Q4_1 ? sizeof(block_q4_1) : sizeof(block_q8_0);
    const size_t ysize = kind == SPECGATE_Q4_1 ? sizeof(block_q8_1) : sizeof(block_q8_0);
    __m256 acc[SPECGATE_ROWS][SPECGATE_COLS];
    __m256 summ[SPECGATE_ROWS];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < NR; ++r) {
        summ[r] = _mm256_setzero_ps();
        _Pragma("GCC unroll 8")
        for (int c = 0; c < NC; ++c) {
            acc[r][c] = _mm256_setzero_ps();
        }
    }
    for (int ib = 0; ib < nb; ++ib) {
        __m256 dx[SPECGATE_ROWS];
        __m256i qx[SPECGATE_ROWS];
        _Pragma("GCC unroll 8")
        for (int r = 0; r < NR; ++r) {
            const char * x = vx + r*bx + ib*xsize;
            if (kind == SPECGATE_Q4_0) {
                dx[r] = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(((const block_q4_0 *) x)->d));
                qx[r] = _mm256_sub_epi8(bytes_from_nibbles_32(((const block_q4_0 *) x)->qs), _mm256_set1_epi8(8));
            } else if (kind == SPECGATE_Q4_1) {
                const block_q4_1 * x1 = (const block_q4_1 *) x;
                dx[r] = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x1->d));
                qx[r] = bytes_from_nibbles_32(x1->qs);
                summ[r] = _mm256_fmadd_ps(_mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x1->m)), _mm256_loadu_ps(ysum + ib*SPECGATE_COLS), summ[r]);
            } else {
                dx[r] = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(((const block_q8_0 *) x)->d));
                qx[r] = _mm256_loadu_si256((const __m256i *) ((const block_q8_0 *) x)->qs);
            }
        }
        _Pragma("GCC unroll 8")
        for (int c = 0; c < NC; ++c) {
            const char * y = vy + c*by + ib*ysize;
            const __m256 dy = _mm256_broadcast_ss(yd + ib*SPECGATE_COLS + c);
            const __m256i qy = _mm256_loadu_si256((const __m256i *) (kind == SPECGATE_Q4_1 ? ((const block_q8_1 *) y)->qs : ((const block_q8_0 *) y)->qs));
            _Pragma("GCC unroll 8")
            for (int r = 0; r < NR; ++r) {
                const __m256 q = kind == SPECGATE_Q4_1 ? mul_sum_us8_pairs_float(qx[r], qy) : mul_sum_i8_pairs_float(qx[r], qy);
                acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dx[r], dy), q, acc[r][c]);
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < NR; ++r) {
        float sums[SPECGATE_COLS];
        _mm256_storeu_ps(sums, summ[r]);
        _Pragma("GCC unroll 8")
        for (int c = 0; c < NC; ++c) {
            s[r + c*bs] = hsum_float_8(acc[r][c]) + sums[c];
        }
    }
}

#define SPECGATE_CASE(R, C) case C: specgate_tile(kind, R, C, nb, sr, bs, xr, bx, yc, by, yd, ysum); break;
#define SPECGATE_ROW_GROUP(R)                                                                     \
    switch (ncc) {                                                                                \
        SPECGATE_CASE(R, 1) SPECGATE_CASE(R, 2) SPECGATE_CASE(R, 3) SPECGATE_CASE(R, 4)           \
        SPECGATE_CASE(R, 5) SPECGATE_CASE(R, 6) SPECGATE_CASE(R, 7) default: SPECGATE_CASE(R, 8)  \
    }

// rows in groups of SPECGATE_ROWS (the rest one by one), columns in groups of SPECGATE_COLS
static inline __attribute__((always_inline)) void specgate_tiles(const enum specgate_kind kind, int n, int nr, int nc,
        float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by) {
    const int nb = n / 32;
    const size_t ysize = kind == SPECGATE_Q4_1 ? sizeof(block_q8_1) : sizeof(block_q8_0);
    float yd[nb*SPECGATE_COLS];
    float ysum[kind == SPECGATE_Q4_1 ? nb*SPECGATE_COLS : 1];
    for (int c0 = 0; c0 < nc; c0 += SPECGATE_COLS) {
        const int ncc = nc - c0 < SPECGATE_COLS ? nc - c0 : SPECGATE_COLS;
        const char * yc = (const char *) vy + c0*by;
        for (int ib = 0; ib < nb; ++ib) {
            for (int c = 0; c < SPECGATE_COLS; ++c) {
                const char * y = yc + c*by + ib*ysize;
                yd[ib*SPECGATE_COLS + c] = c >= ncc ? 0.0f : GGML_CPU_FP16_TO_FP32(kind == SPECGATE_Q4_1 ? ((const block_q8_1 *) y)->d : ((const block_q8_0 *) y)->d);
                if (kind == SPECGATE_Q4_1) {
                    ysum[ib*SPECGATE_COLS + c] = c >= ncc ? 0.0f : GGML_CPU_FP16_TO_FP32(((const block_q8_1 *) y)->s);
                }
            }
        }
        int r0 = 0;
        for (; r0 + SPECGATE_ROWS <= nr; r0 += SPECGATE_ROWS) {
            float * sr = s + r0 + c0*bs;
            const char * xr = (const char *) vx + r0*bx;
            SPECGATE_ROW_GROUP(SPECGATE_ROWS)
        }
        for (; r0 < nr; ++r0) {
            float * sr = s + r0 + c0*bs;
            const char * xr = (const char *) vx + r0*bx;
            SPECGATE_ROW_GROUP(1)
        }
    }
}

void ggml_vec_dot_tile_q4_0_q8_0(int n, int nr, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by) {
    specgate_tiles(SPECGATE_Q4_0, n, nr, nc, s, bs, vx, bx, vy, by);
}

void ggml_vec_dot_tile_q4_1_q8_1(int n, int nr, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by) {
    specgate_tiles(SPECGATE_Q4_1, n, nr, nc, s, bs, vx, bx, vy, by);
}

void ggml_vec_dot_tile_q8_0_q8_0(int n, int nr, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by) {
    specgate_tiles(SPECGATE_Q8_0, n, nr, nc, s, bs, vx, bx, vy, by);
}
#endif

