// specgate patch: attention for batch-invariant mode. Each query row is reduced over the cache in two
// passes: its scores in blocks of SPECGATE_FA_BLOCK cells and its largest score, then its weights
// exp(score - max) (vectorised: ggml_vec_soft_max_f32), each added in cell order to the weights' sum,
// and their values to an F32 sum. Every step of a row reads only its own query (rounded to F16, as the
// one-chunk kernel rounds it), its mask row and the cache, in the same order whatever else the decode
// holds, so a row's result never depends on the other rows; and it depends only on the cells it sees,
// in order, not on where they sit (details at specgate_fa_blocked_rows).
// A score is 16-lane FMAs over the head's dimensions, then one fixed reduction tree (on AVX-512, the
// 16 cells of a half block together); a value row is FMAs at the build's native width into
// accumulators that stay in registers. The one-chunk kernel made three calls per cell and row and
// converted every cell for every row.
// Why by hand: ggml's vector helpers work on one row of one cell at a time. GCC's vector extensions
// give each instruction-set level of the portable build its own widths from this one source.
// F16 K and V, F32 Q, no sinks, softcap or ALiBi, head sizes a multiple of 16 up to
// SPECGATE_FA_MAX_D; anything else takes the one-chunk kernel.
#include <vector>

#define SPECGATE_FA_BLOCK 32
#define SPECGATE_FA_MAX_D 256
#define SPECGATE_FA_ROWS 16
#define SPECGATE_FA_SHARE_ROWS 3  // groups of at least this many rows share one conversion of a block

typedef float specgate_f32x16 __attribute__((vector_size(64)));
// The build's native vector, for the value loop: scalar-times-vector on a 64-byte vector made GCC build
// the broadcast on the stack element by element on AVX2. Elementwise, so the same bits at either width.
#if defined(__AVX512F__)
#define SPECGATE_VN 16
#else
#define SPECGATE_VN 8
#endif
typedef float specgate_vn __attribute__((vector_size(4*SPECGATE_VN), may_alias));
typedef float specgate_f32x8 __attribute__((vector_size(32)));
typedef float specgate_f32x4 __attribute__((vector_size(16)));

static bool specgate_fa_blocked_supported(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    float max_bias = 0.0f, logit_softcap = 0.0f;
    memcpy(&max_bias,      (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    return q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 &&
           dst->src[4] == nullptr && max_bias == 0.0f && logit_softcap == 0.0f &&
           k->ne[0] % 16 == 0 && v->ne[0] % 16 == 0 && k->ne[0] <= SPECGATE_FA_MAX_D && v->ne[0] <= SPECGATE_FA_MAX_D;
}

// 16 F16 values in F32 (GCC 12 turns __builtin_convertvector of _Float16 into one conversion per lane).
static inline void specgate_f16x16_load(const ggml_fp16_t * p, specgate_f32x16 * out) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256((const __m256i *) p));  // (GCC 12 warns on the unmasked form's undefined source)
    memcpy(out, &f, sizeof(f));
#elif defined(__F16C__) && defined(__AVX__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 8)));
    memcpy(out, &lo, sizeof(lo));
    memcpy((char *) out + sizeof(lo), &hi, sizeof(hi));
#else
    float f[16];
    for (int i = 0; i < 16; ++i) {
        f[i] = GGML_CPU_FP16_TO_FP32(p[i]);
    }
    memcpy(out, f, sizeof(f));
#endif
}

// A block's keys (pass 1) or values (pass 2): converted to F32 once for a group of rows (F32), or read
// from the cache's F16 rows by each row. The same values either way, so a row's result does not
// depend on which.
template <bool F32>
struct specgate_fa_block {
    const specgate_f32x16 (*f32)[SPECGATE_FA_MAX_D/16];  // F32: the block's rows, read in place
    const char * f16;                                    // otherwise: the first cell's F16 row, nb1 apart
    size_t nb1;

    void load(int j, int64_t c, specgate_f32x16 * out) const {
        specgate_f16x16_load((const ggml_fp16_t *) (f16 + j*nb1) + 16*c, out);
    }
};

// `cells` F16 rows of n16 16-lane vectors each, nb1 apart, into F32.
static inline void specgate_fa_convert(const char * f16, size_t nb1, int cells, int64_t n16,
                                       specgate_f32x16 (*out)[SPECGATE_FA_MAX_D/16]) {
    for (int j = 0; j < cells; ++j) {
        for (int64_t c = 0; c < n16; ++c) {
            specgate_f16x16_load((const ggml_fp16_t *) (f16 + j*nb1) + 16*c, &out[j][c]);
        }
    }
}

// The scores of up to 16 consecutive cells from j0 (0 past n): per cell 16-lane FMAs over the head's
// dimensions, then its 16 lanes summed in one fixed order.
template <bool F32>
static inline void specgate_scores16(const specgate_f32x16 * Q, int64_t nk, const specgate_fa_block<F32> & blk, int j0,
                                     int n, specgate_f32x16 * out) {
    specgate_f32x16 p[16], kv;
    for (int j = 0; j < 16; ++j) {
        if (j >= n) {
            p[j] = specgate_f32x16{};
            continue;
        }
        if constexpr (F32) {
            p[j] = Q[0]*blk.f32[j0 + j][0];
            for (int64_t c = 1; c < nk; ++c) {
                p[j] += Q[c]*blk.f32[j0 + j][c];
            }
        } else {
            blk.load(j0 + j, 0, &kv);
            p[j] = Q[0]*kv;
            for (int64_t c = 1; c < nk; ++c) {
                blk.load(j0 + j, c, &kv);
                p[j] += Q[c]*kv;
            }
        }
    }
#if defined(__AVX512F__)
    // the 16 cells' lanes summed together, a butterfly: pairs of cells within 128-bit lanes, then
    // across them, so the 16 sums land in cell order (45 instructions, against 16 reductions)
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i) {
        const __m512 a = (__m512) p[2*i], b = (__m512) p[2*i + 1];
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[2*i]), b = _mm512_castps_pd(t[2*i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i) {
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2*i], u[2*i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2*i], u[2*i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    *out = (specgate_f32x16) _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                           _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
#else
    // each cell's lanes: halves, quarters, then the last four in pairs (into a float array: element
    // writes into a 64-byte vector went through the stack on AVX2)
    float sums[16];
    for (int j = 0; j < 16; ++j) {
        specgate_f32x8 lo, hi;
        memcpy(&lo, &p[j], sizeof(lo));
        memcpy(&hi, (const char *) &p[j] + sizeof(lo), sizeof(hi));
        const specgate_f32x8 s8 = lo + hi;
        specgate_f32x4 l4, h4;
        memcpy(&l4, &s8, sizeof(l4));
        memcpy(&h4, (const char *) &s8 + sizeof(l4), sizeof(h4));
        const specgate_f32x4 s4 = l4 + h4;
        sums[j] = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    }
    memcpy(out, sums, sizeof(sums));
#endif
}

// One query row's state while it is reduced over the cache.
struct specgate_fa_row {
    specgate_f32x16 Q32[SPECGATE_FA_MAX_D/16];  // the query, rounded to F16 and back
    specgate_f32x16 VKQ[SPECGATE_FA_MAX_D/16];  // the sum of weighted values
    float M;                                    // the largest score
    ggml_float S;                               // the sum of the weights exp(score - M)
    const ggml_fp16_t * mp;                     // the mask row, or null
    float * KQ;                                 // a score per cell (-inf where masked), then its weight
    float * out;
};

// A row's mask over a block (-inf past the cache); false where it sees none of the block's cells.
static inline bool specgate_fa_mask(const specgate_fa_row & row, int64_t ic0, int cells, specgate_f32x16 m[2]) {
    for (int h = 0; h < 2; ++h) {
        const int n = MAX(0, MIN(16, cells - 16*h));
        if (row.mp && n == 16) {
            specgate_f16x16_load(row.mp + ic0 + 16*h, &m[h]);
        } else {
            float mv[16];
            for (int j = 0; j < 16; ++j) {
                mv[j] = j >= n ? -INFINITY : row.mp ? GGML_CPU_FP16_TO_FP32(row.mp[ic0 + 16*h + j]) : 0.0f;
            }
            memcpy(&m[h], mv, sizeof(mv));
        }
    }
    float mm[16];
    const specgate_f32x16 larger = m[0] > m[1] ? m[0] : m[1];
    memcpy(mm, &larger, sizeof(mm));
    bool open = false;
    for (int j = 0; j < 16; ++j) {
        open |= mm[j] != -INFINITY;
    }
    return open;
}

// Pass 1 of a row over a block: its scores, -inf where masked, and its largest score so far.
template <int NK, bool F32>
static inline void specgate_fa_row_scores(specgate_fa_row & row, int64_t nk, const specgate_f32x16 m[2],
                                          const specgate_fa_block<F32> & blk, int64_t ic0, int cells, float scale) {
    if (NK) { nk = NK; }
    const specgate_f32x16 neg_inf = specgate_f32x16{} - INFINITY;
    specgate_f32x16 sc[2];
    for (int h = 0; h < 2; ++h) {
        specgate_scores16<F32>(row.Q32, nk, blk, 16*h, MAX(0, MIN(16, cells - 16*h)), &sc[h]);
        sc[h] = m[h] == neg_inf ? neg_inf : sc[h]*scale + m[h];  // a masked cell's score is -inf, whatever its key holds
    }
    memcpy(row.KQ + ic0, sc, sizeof(sc));
    float mx[16];
    const specgate_f32x16 larger = sc[0] > sc[1] ? sc[0] : sc[1];
    memcpy(mx, &larger, sizeof(mx));
    for (int j = 0; j < 16; ++j) {
        row.M = MAX(row.M, mx[j]);
    }
}

// Pass 2 of a row over a block: its weights exp(score - M), each added to S and its value row to
// VKQ, cell after cell. NV: 16-lane vectors per value row when known at compile time (the
// accumulators then live in registers), 0 to take nv.
template <int NV, bool F32>
static inline void specgate_fa_row_values(specgate_fa_row & row, int64_t nv, const specgate_fa_block<F32> & blk,
                                          int64_t ic0, int cells) {
    if (NV) { nv = NV; }
    constexpr int per16 = 16/SPECGATE_VN;  // native vectors per 16 lanes
    const int64_t nn = nv*per16;
    float * w = row.KQ + ic0;
    specgate_vn acc[(NV ? NV : SPECGATE_FA_MAX_D/16)*per16];
    memcpy(acc, row.VKQ, nn*sizeof(specgate_vn));
    ggml_float S = row.S;
    for (int j = 0; j < cells; ++j) {
        if (w[j] == 0.0f) {
            continue;  // masked: whatever the cell holds adds nothing
        }
        S += (ggml_float) w[j];
        const float wj = w[j];
        if constexpr (F32) {
            const specgate_vn * vr = (const specgate_vn *) blk.f32[j];
            for (int64_t c = 0; c < nn; ++c) {
                acc[c] += wj*vr[c];
            }
        } else {
            for (int64_t c = 0; c < nv; ++c) {
                specgate_f32x16 vv;
                blk.load(j, c, &vv);
                const specgate_vn * vr = (const specgate_vn *) &vv;
                for (int h = 0; h < per16; ++h) {
                    acc[c*per16 + h] += wj*vr[h];
                }
            }
        }
    }
    row.S = S;
    memcpy(row.VKQ, acc, nn*sizeof(specgate_vn));
}

// Rows ir0..ir1, a group of consecutive rows that read the same K/V head at a time (a decode's queries
// of one head, the query heads of a GQA group), in two passes over the cache: every score and the
// row's largest, then the weights and the values. So a row's result depends only on the cells it sees,
// in order, never on where they sit: a tree's node, whose ancestors' cells have its siblings' between
// them, gets its chain's bits (the one-pass form rescaled at block boundaries and summed each block's
// weights in lanes, both placed by cell position). Within a pass the group goes block by block, and
// the block's keys or values are converted to F32 once for all its rows (the conversions were half
// the work when each row converted its own); a group of one or two rows converts as it reads.
template <int NK, int NV>
static void specgate_fa_blocked_rows(ggml_tensor * dst, int ir0, int ir1) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, nek, k,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbk, k,   nb)
    GGML_TENSOR_LOCALS(size_t,  nbv, v,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)

    const int64_t nk = nek0/16, nv = v->ne[0]/16;
    const int64_t rk2 = neq2/nek2, rk3 = neq3/nek3;
    const int64_t rv2 = neq2/v->ne[2], rv3 = neq3/v->ne[3];
    const int64_t cells_padded = (nek1 + SPECGATE_FA_BLOCK - 1)/SPECGATE_FA_BLOCK*SPECGATE_FA_BLOCK;

    float scale = 1.0f;
    memcpy(&scale, (const float *) dst->op_params + 0, sizeof(float));

    static thread_local std::vector<float> scores;  // each row's scores over the whole cache
    if (scores.size() < (size_t) (SPECGATE_FA_ROWS*cells_padded)) {
        scores.resize(SPECGATE_FA_ROWS*cells_padded);
    }
    specgate_fa_row rows[SPECGATE_FA_ROWS];
    specgate_f32x16 masks[SPECGATE_FA_ROWS][2];
    bool open[SPECGATE_FA_ROWS];
    specgate_f32x16 KV32[SPECGATE_FA_BLOCK][SPECGATE_FA_MAX_D/16];  // a block's keys, then its values, in F32
    ggml_fp16_t q16[SPECGATE_FA_MAX_D];

    for (int ir = ir0; ir < ir1; ) {
        int n = 0;
        int64_t ik2 = 0, ik3 = 0, iv2 = 0, iv3 = 0;
        for (; ir < ir1 && n < SPECGATE_FA_ROWS; ++ir, ++n) {
            const int64_t iq3 = ir/(neq2*neq1);
            const int64_t iq2 = (ir - iq3*neq2*neq1)/neq1;
            const int64_t iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);
            if (n == 0) {
                ik2 = iq2/rk2, ik3 = iq3/rk3, iv2 = iq2/rv2, iv3 = iq3/rv3;
            } else if (iq2/rk2 != ik2 || iq3/rk3 != ik3 || iq2/rv2 != iv2 || iq3/rv3 != iv3) {
                break;
            }
            specgate_fa_row & row = rows[n];
            row.mp = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq1*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : nullptr;
            row.out = (float *) ((char *) dst->data + (iq3*ne2*ne1 + iq2 + iq1*ne1)*nb1);  // permute(0, 2, 1, 3)
            row.KQ = scores.data() + n*cells_padded;
            ggml_cpu_fp32_to_fp16((const float *) ((const char *) q->data + iq1*nbq1 + iq2*nbq2 + iq3*nbq3), q16, nek0);
            for (int64_t c = 0; c < nk; ++c) {
                specgate_f16x16_load(q16 + 16*c, &row.Q32[c]);
            }
            memset(row.VKQ, 0, sizeof(row.VKQ));
            row.M = -INFINITY;
            row.S = 0.0;
        }
        const bool share = n >= SPECGATE_FA_SHARE_ROWS;
        const char * kh = (const char *) k->data + ik2*nbk2 + ik3*nbk3;
        const char * vh = (const char *) v->data + iv2*nbv2 + iv3*nbv3;

        for (int64_t ic0 = 0; ic0 < nek1; ic0 += SPECGATE_FA_BLOCK) {  // pass 1: scores
            const int cells = (int) MIN(SPECGATE_FA_BLOCK, nek1 - ic0);
            bool any = false;
            for (int r = 0; r < n; ++r) {
                open[r] = specgate_fa_mask(rows[r], ic0, cells, masks[r]);
                any |= open[r];
                if (!open[r]) {
                    std::fill(rows[r].KQ + ic0, rows[r].KQ + ic0 + SPECGATE_FA_BLOCK, -INFINITY);
                }
            }
            if (!any) {
                continue;
            }
            const char * kb = kh + ic0*nbk1;
            if (share) {
                specgate_fa_convert(kb, nbk1, cells, nk, KV32);
            }
            const specgate_fa_block<true> blk32 = {KV32, nullptr, 0};
            const specgate_fa_block<false> blk16 = {nullptr, kb, nbk1};
            for (int r = 0; r < n; ++r) {
                if (!open[r]) {
                    continue;
                }
                if (share) {
                    specgate_fa_row_scores<NK, true>(rows[r], nk, masks[r], blk32, ic0, cells, scale);
                } else {
                    specgate_fa_row_scores<NK, false>(rows[r], nk, masks[r], blk16, ic0, cells, scale);
                }
            }
        }

        for (int64_t ic0 = 0; ic0 < nek1; ic0 += SPECGATE_FA_BLOCK) {  // pass 2: weights and values
            const int cells = (int) MIN(SPECGATE_FA_BLOCK, nek1 - ic0);
            bool any = false;
            for (int r = 0; r < n; ++r) {
                open[r] = false;
                if (rows[r].M != -INFINITY) {
                    float * w = rows[r].KQ + ic0;
                    ggml_vec_soft_max_f32(SPECGATE_FA_BLOCK, w, w, rows[r].M);  // w[j] = exp(score - M), 0 where masked
                    for (int j = 0; j < cells; ++j) {
                        open[r] |= w[j] != 0.0f;
                    }
                }
                any |= open[r];
            }
            if (!any) {
                continue;
            }
            const char * vb = vh + ic0*nbv1;
            if (share) {
                specgate_fa_convert(vb, nbv1, cells, nv, KV32);
            }
            const specgate_fa_block<true> blk32 = {KV32, nullptr, 0};
            const specgate_fa_block<false> blk16 = {nullptr, vb, nbv1};
            for (int r = 0; r < n; ++r) {
                if (!open[r]) {
                    continue;
                }
                if (share) {
                    specgate_fa_row_values<NV, true>(rows[r], nv, blk32, ic0, cells);
                } else {
                    specgate_fa_row_values<NV, false>(rows[r], nv, blk16, ic0, cells);
                }
            }
        }

        for (int r = 0; r < n; ++r) {
            const float inv = rows[r].S == 0.0 ? 0.0f : (float) (1.0/rows[r].S);
            for (int64_t c = 0; c < nv; ++c) {
                const specgate_f32x16 o = rows[r].VKQ[c]*inv;
                memcpy(rows[r].out + 16*c, &o, sizeof(o));
            }
        }
    }
}

static void specgate_fa_blocked(const ggml_compute_params * params, ggml_tensor * dst, int ir0, int ir1) {
    GGML_UNUSED(params);
    const int64_t nk = dst->src[1]->ne[0]/16, nv = dst->src[2]->ne[0]/16;
    if (nk == 4 && nv == 4) {
        specgate_fa_blocked_rows<4, 4>(dst, ir0, ir1);  // head size 64
    } else if (nk == 8 && nv == 8) {
        specgate_fa_blocked_rows<8, 8>(dst, ir0, ir1);  // head size 128
    } else {
        specgate_fa_blocked_rows<0, 0>(dst, ir0, ir1);
    }
}
