// specgate patch: the one-row VNNI kernels' arithmetic for up to 8 token rows at once (Q4_0, Q4_1, Q8_0).
// Each weight tile (16 output columns x one 32-weight block) is loaded and unpacked once for up to 4
// rows. Every output keeps the one-row kernel's float steps: the block's exact int32 sum, then the same
// scale products and FMAs, the blocks in the same order. So every output is bit-identical to the one-row
// kernel's (and to the AMX tiles', which reduce alike), whatever the number of rows.
// The int32 sums are exact, so their order is free: 4 column tiles and up to 4 rows are summed side by
// side. That keeps the dpbusd unit busy (one tile at a time left a single dependent chain per row,
// waiting on the instruction's latency) and lets each broadcast row value serve 4 tiles.
// Why by hand: ggml's VNNI kernels (tinygemm_kernel_vnni) read row 0 alone.
template <typename TB, int MR, int NC>
static void specgate_vnni_rows_tiles(int KB, const char * RESTRICT A, int64_t row_size_A, const char * RESTRICT B, int TILE_SIZE,
                                     int col0, float * RESTRICT C, int64_t ldc) {
    using TA = typename std::conditional<std::is_same<TB, block_q4_1>::value, block_q8_1, block_q8_0>::type;
    constexpr bool q4_0 = std::is_same<TB, block_q4_0>::value;
    constexpr bool q4_1 = std::is_same<TB, block_q4_1>::value;
    constexpr bool q8_0 = std::is_same<TB, block_q8_0>::value;
    constexpr int offset = q8_0 ? TILE_N * TILE_K : TILE_N * TILE_K / 2;  // a tile's scales follow its weights
    const __m512i lowMask = _mm512_set1_epi8(0xF);
    const __m512i off4 = _mm512_set1_epi8(8);
    const __m512i off8 = _mm512_set1_epi8(static_cast<char>(0x80));

    __m512 vc[MR][NC];
    for (int m = 0; m < MR; ++m) {
        for (int c = 0; c < NC; ++c) {
            vc[m][c] = _mm512_setzero_ps();
        }
    }
    for (int i = 0; i < KB; ++i) {
        const char * b_ptr[NC];
        for (int c = 0; c < NC; ++c) {
            const int col = col0 + c;  // PACKED_INDEX does not parenthesize its arguments
            b_ptr[c] = B + PACKED_INDEX(col, i, KB, TILE_SIZE);
        }
        const int32_t * a_ptr[MR];
        for (int m = 0; m < MR; ++m) {
            a_ptr[m] = reinterpret_cast<const int32_t *>((reinterpret_cast<const TA *>(A + m * row_size_A) + i)->qs);
        }
        __m512i vsum[MR][NC];
        for (int m = 0; m < MR; ++m) {
            for (int c = 0; c < NC; ++c) {
                vsum[m][c] = _mm512_setzero_si512();
            }
        }
        for (int k = 0; k < 8; ++k) {
            __m512i vb[NC];
            for (int c = 0; c < NC; ++c) {
                if constexpr (q8_0) {
                    vb[c] = _mm512_loadu_si512((const __m512i *) (b_ptr[c] + k * 64));
                } else {  // a 64-byte load holds the low nibbles of weight group k and the high ones of k + 1
                    const __m512i bytes = _mm512_loadu_si512((const __m512i *) (b_ptr[c] + (k & ~1) * 32));
                    vb[c] = _mm512_and_si512(k & 1 ? _mm512_srli_epi16(bytes, 4) : bytes, lowMask);
                }
            }
            for (int m = 0; m < MR; ++m) {
                const __m512i va = q8_0 ? _mm512_add_epi8(_mm512_set1_epi32(a_ptr[m][k]), off8) : _mm512_set1_epi32(a_ptr[m][k]);
                for (int c = 0; c < NC; ++c) {
                    vsum[m][c] = q8_0 ? _mm512_dpbusd_epi32(vsum[m][c], va, vb[c]) : _mm512_dpbusd_epi32(vsum[m][c], vb[c], va);
                }
            }
        }
        __m512i vcomp[MR];  // Q4_0: the one-row kernel's compensation for the offset of 8 (exact), one per row
        if constexpr (q4_0) {
            for (int m = 0; m < MR; ++m) {
                vcomp[m] = _mm512_setzero_si512();
                for (int k = 0; k < 8; ++k) {
                    vcomp[m] = _mm512_dpbusd_epi32(vcomp[m], off4, _mm512_set1_epi32(a_ptr[m][k]));
                }
            }
        }
        for (int c = 0; c < NC; ++c) {
            const __m512 vd0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b_ptr[c] + offset)));
            for (int m = 0; m < MR; ++m) {
                const TA * a = reinterpret_cast<const TA *>(A + m * row_size_A) + i;
                const __m512 vd1 = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(a->d));
                __m512i vs = vsum[m][c];
                if constexpr (q4_0) {
                    vs = _mm512_sub_epi32(vs, vcomp[m]);
                } else if constexpr (q8_0) {
                    vs = _mm512_sub_epi32(vs, _mm512_loadu_si512((const __m512i *) (b_ptr[c] + offset + TILE_N * sizeof(ggml_half))));
                }
                vc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(vs), _mm512_mul_ps(vd0, vd1), vc[m][c]);
                if constexpr (q4_1) {
                    const __m512 vm0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b_ptr[c] + offset + TILE_N * sizeof(ggml_half))));
                    vc[m][c] = _mm512_fmadd_ps(vm0, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(a->s)), vc[m][c]);
                }
            }
        }
    }
    for (int m = 0; m < MR; ++m) {
        for (int c = 0; c < NC; ++c) {
            _mm512_storeu_ps(C + m * ldc + (col0 + c) * 16, vc[m][c]);
        }
    }
}

// MR rows against `cols` 16-column tiles, 4 tiles at a time (the rest one by one). Past 4 rows the sums
// and accumulators would not fit the 32 registers, so the rows go 4 at a time: the second pass reads the
// weights again, which measured no slower than summing 8 rows within each block (2-core Xeon with AMX).
template <typename TB, int MR>
static void specgate_vnni_rows(int KB, const char * A, int64_t row_size_A, const char * B, int tile_size, int cols, float * C,
                               int64_t ldc) {
    if constexpr (MR > 4) {
        specgate_vnni_rows<TB, 4>(KB, A, row_size_A, B, tile_size, cols, C, ldc);
        specgate_vnni_rows<TB, MR - 4>(KB, A + 4 * row_size_A, row_size_A, B, tile_size, cols, C + 4 * ldc, ldc);
        return;
    }
    constexpr int NC = 4;
    int col = 0;
    for (; col + NC <= cols; col += NC) {
        specgate_vnni_rows_tiles<TB, MR, NC>(KB, A, row_size_A, B, tile_size, col, C, ldc);
    }
    for (; col < cols; ++col) {
        specgate_vnni_rows_tiles<TB, MR, 1>(KB, A, row_size_A, B, tile_size, col, C, ldc);
    }
}

// M (1-8) rows of A, row_size_A apart, against `cols` 16-column tiles of B: true where a kernel above took them.
template <typename TB>
static bool specgate_vnni_rows_any(int M, int KB, const char * A, int64_t row_size_A, const char * B, int tile_size, int cols,
                                   float * C, int64_t ldc) {
    if constexpr (std::is_same<TB, block_q4_0>::value || std::is_same<TB, block_q4_1>::value ||
                  std::is_same<TB, block_q8_0>::value) {
        switch (M) {
            case 1: specgate_vnni_rows<TB, 1>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            case 2: specgate_vnni_rows<TB, 2>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            case 3: specgate_vnni_rows<TB, 3>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            case 4: specgate_vnni_rows<TB, 4>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            case 5: specgate_vnni_rows<TB, 5>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            case 6: specgate_vnni_rows<TB, 6>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            case 7: specgate_vnni_rows<TB, 7>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            case 8: specgate_vnni_rows<TB, 8>(KB, A, row_size_A, B, tile_size, cols, C, ldc); return true;
            default: return false;
        }
    }
    return false;
}
