// specgate patch: flash attention for batch-invariant mode. Each query row is reduced over the cache in
// blocks of SPECGATE_FA_BLOCK cells at fixed positions (0, B, 2B, ...): the block's scores as the
// one-chunk kernel computes them, one max, the exponentials vectorised (ggml_vec_soft_max_f32), the
// values accumulated in fp32. A row's result depends only on its own query, mask row and the cache,
// never on the other rows of the decode, and the exponentials cost a fraction of one expf per cell.
// F16 K and V, F32 Q, no sinks, softcap or ALiBi; anything else takes the one-chunk kernel.
#define SPECGATE_FA_BLOCK 32

static bool specgate_fa_blocked_supported(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    float max_bias = 0.0f, logit_softcap = 0.0f;
    memcpy(&max_bias,      (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    return q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 &&
           dst->src[4] == nullptr && max_bias == 0.0f && logit_softcap == 0.0f;
}

static void specgate_fa_blocked(const ggml_compute_params * params, ggml_tensor * dst, int ir0, int ir1) {
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

    const int64_t DK = nek0;
    const int64_t DV = v->ne[0];
    const int64_t rk2 = neq2/nek2, rk3 = neq3/nek3;
    const int64_t rv2 = neq2/v->ne[2], rv3 = neq3/v->ne[3];

    float scale = 1.0f;
    memcpy(&scale, (const float *) dst->op_params + 0, sizeof(float));

    // per thread: the query in F16, the fp32 accumulator, one value row in fp32, a block's scores
    float       * VKQ = (float *) params->wdata + params->ith*(1*DK + 2*DV + CACHE_LINE_SIZE_F32);
    float       * V32 = VKQ + DV;
    ggml_fp16_t * Q16 = (ggml_fp16_t *) (VKQ + 2*DV);
    float KQ[SPECGATE_FA_BLOCK];

    for (int ir = ir0; ir < ir1; ++ir) {
        const int iq3 = ir/(neq2*neq1);
        const int iq2 = (ir - iq3*neq2*neq1)/neq1;
        const int iq1 = (ir - iq3*neq2*neq1 - iq2*neq1);
        const int ik2 = iq2/rk2, ik3 = iq3/rk3, iv2 = iq2/rv2, iv3 = iq3/rv3;

        const ggml_fp16_t * mp = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq1*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : nullptr;
        ggml_cpu_fp32_to_fp16((const float *) ((const char *) q->data + iq1*nbq1 + iq2*nbq2 + iq3*nbq3), Q16, DK);
        memset(VKQ, 0, DV*sizeof(float));
        float M = -INFINITY;
        ggml_float S = 0.0;

        for (int64_t ic0 = 0; ic0 < nek1; ic0 += SPECGATE_FA_BLOCK) {
            float bmax = -INFINITY;
            for (int j = 0; j < SPECGATE_FA_BLOCK; ++j) {
                const int64_t ic = ic0 + j;
                const float mv = ic >= nek1 ? -INFINITY : mp ? GGML_CPU_FP16_TO_FP32(mp[ic]) : 0.0f;
                if (mv == -INFINITY) {
                    KQ[j] = -INFINITY;
                    continue;
                }
                float s;
                ggml_vec_dot_f16(DK, &s, 0, (ggml_fp16_t *) ((const char *) k->data + ic*nbk1 + ik2*nbk2 + ik3*nbk3), 0, Q16, 0, 1);
                KQ[j] = s*scale + mv;
                bmax = MAX(bmax, KQ[j]);
            }
            if (bmax == -INFINITY) {
                continue;  // every cell of the block is masked
            }
            if (bmax > M) {  // a new maximum: what was summed so far shrinks by exp(M_old - M_new)
                const float ms = M == -INFINITY ? 0.0f : expf(M - bmax);
                ggml_vec_scale_f32(DV, VKQ, ms);
                S *= ms;
                M = bmax;
            }
            S += ggml_vec_soft_max_f32(SPECGATE_FA_BLOCK, KQ, KQ, M);  // KQ[j] = exp(KQ[j] - M)
            for (int j = 0; j < SPECGATE_FA_BLOCK; ++j) {
                if (KQ[j] != 0.0f) {
                    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) ((const char *) v->data + (ic0 + j)*nbv1 + iv2*nbv2 + iv3*nbv3), V32, DV);
                    ggml_vec_mad_f32(DV, VKQ, V32, KQ[j]);
                }
            }
        }

        ggml_vec_scale_f32(DV, VKQ, S == 0.0 ? 0.0f : (float) (1.0/S));
        memcpy((char *) dst->data + (iq3*ne2*ne1 + iq2 + iq1*ne1)*nb1, VKQ, nb1);  // permute(0, 2, 1, 3)
    }
}

