// specgate patch: the one-row VNNI kernels' arithmetic for up to 8 token rows at once (Q4_0, Q4_1, Q8_0).
// Each weight tile (16 output columns x one 32-weight block) is loaded and unpacked once for all the
// rows; each row then takes exactly the one-row kernel's steps for that tile: the same dpbusd sequence
// into an exact int32 sum, the same scale products and FMAs, the blocks in the same order. So every
// output is bit-identical to the one-row kernel's (and to the AMX tiles', which reduce alike), whatever
// the number of rows, while the unpacking is paid once per tile instead of once per row.
// Why by hand: ggml's VNNI kernels (tinygemm_kernel_vnni) read row 0 alone.
template <typename TB, int MR>
static void specgate_vnni_rows(int KB, const char * RESTRICT A, int64_t row_size_A, const char * RESTRICT B, int TILE_SIZE,
                               int cols, float * RESTRICT C, int64_t ldc) {
    using TA = typename std::conditional<std::is_same<TB, block_q4_1>::value, block_q8_1, block_q8_0>::type;
    constexpr bool q4_0 = std::is_same<TB, block_q4_0>::value;
    constexpr bool q4_1 = std::is_same<TB, block_q4_1>::value;
    const __m512i lowMask = _mm512_set1_epi8(0xF);
    const __m512i off4 = _mm512_set1_epi8(8);
    const __m512i off8 = _mm512_set1_epi8(static_cast<char>(0x80));

    for (int col = 0; col < cols; ++col) {
        __m512 vc[MR];
        for (int m = 0; m < MR; ++m) {
            vc[m] = _mm512_setzero_ps();
        }
        for (int i = 0; i < KB; ++i) {
            const char * b_ptr = B + PACKED_INDEX(col, i, KB, TILE_SIZE);
            __m512i vb[8];
            __m512 vd0, vm0 = _mm512_setzero_ps();
            __m512i vcompb = _mm512_setzero_si512();
            if constexpr (q4_0 || q4_1) {
                for (int k = 0; k < 8; k += 2) {
                    const __m512i bytes = _mm512_loadu_si512((const __m512i *) (b_ptr + k * 32));
                    vb[k + 0] = _mm512_and_si512(bytes, lowMask);
                    vb[k + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), lowMask);
                }
                const int offset = TILE_N * TILE_K / 2;
                vd0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b_ptr + offset)));
                if constexpr (q4_1) {
                    vm0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b_ptr + offset + TILE_N * sizeof(ggml_half))));
                }
            } else {
                for (int k = 0; k < 8; ++k) {
                    vb[k] = _mm512_loadu_si512((const __m512i *) (b_ptr + k * 64));
                }
                vd0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (b_ptr + TILE_N * TILE_K)));
                vcompb = _mm512_loadu_si512((const __m512i *) (b_ptr + TILE_N * TILE_K + TILE_N * sizeof(ggml_half)));
            }
            for (int m = 0; m < MR; ++m) {
                const TA * a = reinterpret_cast<const TA *>(A + m * row_size_A) + i;
                const int32_t * a_ptr = reinterpret_cast<const int32_t *>(a->qs);
                const __m512 vd1 = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(a->d));
                __m512i vsum = _mm512_setzero_si512();
                if constexpr (q4_0) {
                    // the one-row kernel's compensation for the offset of 8, built and subtracted as it does
                    __m512i vcomp = _mm512_setzero_si512();
                    for (int k = 0; k < 8; ++k) {
                        vcomp = _mm512_dpbusd_epi32(vcomp, off4, _mm512_set1_epi32(a_ptr[k]));
                    }
                    for (int k = 0; k < 8; ++k) {
                        vsum = _mm512_dpbusd_epi32(vsum, vb[k], _mm512_set1_epi32(a_ptr[k]));
                    }
                    vsum = _mm512_sub_epi32(vsum, vcomp);
                    vc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(vsum), _mm512_mul_ps(vd0, vd1), vc[m]);
                } else if constexpr (q4_1) {
                    const __m512 vs1 = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(a->s));
                    for (int k = 0; k < 8; ++k) {
                        vsum = _mm512_dpbusd_epi32(vsum, vb[k], _mm512_set1_epi32(a_ptr[k]));
                    }
                    vc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(vsum), _mm512_mul_ps(vd0, vd1), vc[m]);
                    vc[m] = _mm512_fmadd_ps(vm0, vs1, vc[m]);
                } else {
                    for (int k = 0; k < 8; ++k) {
                        vsum = _mm512_dpbusd_epi32(vsum, _mm512_add_epi8(_mm512_set1_epi32(a_ptr[k]), off8), vb[k]);
                    }
                    vsum = _mm512_sub_epi32(vsum, vcompb);
                    vc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(vsum), _mm512_mul_ps(vd0, vd1), vc[m]);
                }
            }
        }
        for (int m = 0; m < MR; ++m) {
            _mm512_storeu_ps(C + m * ldc + col * 16, vc[m]);
        }
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

