// specgate patch: the EAGLE head's layer for a few new pairs (a drafted chain's node, an EAGLE-2 tree's
// block), fused into one call on the caller's thread. In PyTorch a node was about 60 operators beside
// its products, and their per-call costs made a node cost a fifth to a third of a decode
// (docs/speculative.md, "The EAGLE head's weights"). Here a node is its products, read once each.
//
// Weights are int8 with one scale per output row; activations are quantized per row (symmetric,
// scale max|x| / 127) and each output is an exact int32 dot product, scaled once. `fc` keeps the head
// file's bf16 weights and fp32 inputs: its input puts a token's embedding beside the target's feature,
// whose outliers one int8 scale cannot hold.
// tests/unit/test_eagle_kernel.py holds it to a PyTorch emulation of the same arithmetic.
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

struct specgate_eagle_weights {
    int32_t hidden, heads, kv_heads, head_dim, intermediate, draft_vocab;
    int32_t vocab;             // rows of embed
    int32_t max_len;           // cells of the K/V cache
    int32_t rope_len;          // rows of rope_cos / rope_sin
    int32_t threads;           // 2: the caller and one helper share each product's rows; 1: the caller alone
    float eps;
    const float * embed;       // [vocab][hidden], the target's input table
    const uint16_t * fc;       // [hidden][2 hidden] bf16 (the head file's own dtype): cat(embedding, feature) -> hidden
    const int8_t * qkv;        // [(heads + 2 kv_heads) head_dim][hidden]
    const float * qkv_scale;
    const int8_t * o;          // [hidden][heads head_dim]
    const float * o_scale;
    const int8_t * gate_up;    // [2 intermediate][hidden]: gate rows, then up rows
    const float * gate_up_scale;
    const int8_t * down;       // [hidden][intermediate]
    const float * down_scale;
    const float * post_norm;   // [hidden]
    const int8_t * lm_head;    // [draft_vocab][hidden]
    const float * lm_head_scale;
    const float * rope_cos;    // [max positions][head_dim] (specgate.decoding.model.Rotary's tables)
    const float * rope_sin;
};

// x [k] -> q [k] int8, returns the scale (0 for a zero row). Rounds half to even, as _mm256_cvtps_epi32.
static float specgate_quantize_row(const float * x, int k, int8_t * q) {
    float amax = 0.0f;
    for (int i = 0; i < k; ++i) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    if (amax == 0.0f) {
        memset(q, 0, (size_t) k);
        return 0.0f;
    }
    const float inv = 127.0f / amax;
    for (int i = 0; i < k; ++i) {
        q[i] = (int8_t) nearbyintf(x[i] * inv);
    }
    return amax / 127.0f;
}

#if defined(__AVX2__)
// |a| * (b with a's sign): u8 x s8 pairs of at most 2 * 127 * 127, inside int16; then 8 int32 sums.
static inline __m256i specgate_dot32(const __m256i a_abs, const __m256i a, const int8_t * b) {
    const __m256i p = _mm256_maddubs_epi16(a_abs, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *) b), a));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline int32_t specgate_hsum_i32(const __m256i v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
}
#endif

// The exact int32 dots of nr <= 4 weight rows w[0..nr-1] (stride k) with one int8 row a of k elements:
// four rows share each load of a. Short of four, the last row stands in for the missing ones.
static void specgate_dot4_i8(const int8_t * w, int nr, const int8_t * a, int k, int32_t * out) {
    const int8_t * w0 = w, * w1 = w + (size_t) (nr > 1 ? 1 : 0)*k, * w2 = w + (size_t) (nr > 2 ? 2 : nr - 1)*k,
                 * w3 = w + (size_t) (nr > 3 ? 3 : nr - 1)*k;
    int32_t sums[4];
#if defined(__AVX2__)
    if (k % 32 == 0) {
        __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        for (int i = 0; i < k; i += 32) {
            const __m256i va = _mm256_loadu_si256((const __m256i *) (a + i));
            const __m256i vabs = _mm256_sign_epi8(va, va);
            acc0 = _mm256_add_epi32(acc0, specgate_dot32(vabs, va, w0 + i));
            acc1 = _mm256_add_epi32(acc1, specgate_dot32(vabs, va, w1 + i));
            acc2 = _mm256_add_epi32(acc2, specgate_dot32(vabs, va, w2 + i));
            acc3 = _mm256_add_epi32(acc3, specgate_dot32(vabs, va, w3 + i));
        }
        sums[0] = specgate_hsum_i32(acc0);
        sums[1] = specgate_hsum_i32(acc1);
        sums[2] = specgate_hsum_i32(acc2);
        sums[3] = specgate_hsum_i32(acc3);
    } else
#endif
    {
        const int8_t * rows[4] = {w0, w1, w2, w3};
        for (int r = 0; r < 4; ++r) {
            int32_t sum = 0;
            for (int i = 0; i < k; ++i) {
                sum += (int32_t) rows[r][i] * (int32_t) a[i];
            }
            sums[r] = sum;
        }
    }
    memcpy(out, sums, sizeof(int32_t) * (size_t) nr);
}

#if defined(__AVX2__)
static inline float specgate_hsum_f32(const __m256 s) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#endif

// dot(bf16 row w, fp32 row x): a bf16 value is the top half of an fp32 one.
static float specgate_dot_bf16(const uint16_t * w, const float * x, int k) {
#if defined(__AVX2__) && defined(__FMA__)
    if (k % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int i = 0; i < k; i += 16) {
            const __m256i w16 = _mm256_loadu_si256((const __m256i *) (w + i));
            const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w16)), 16));
            const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w16, 1)), 16));
            s0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), s0);
            s1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), s1);
        }
        return specgate_hsum_f32(_mm256_add_ps(s0, s1));
    }
#endif
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) {
        union { uint32_t u; float f; } v = { (uint32_t) w[i] << 16 };
        sum += v.f * x[i];
    }
    return sum;
}

static float specgate_dot_f32(const float * a, const float * b, int k) {
#if defined(__AVX2__) && defined(__FMA__)
    if (k % 16 == 0) {  // two chains: one FMA's latency would otherwise pace the loop
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int i = 0; i < k; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        return specgate_hsum_f32(_mm256_add_ps(s0, s1));
    }
#endif
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) {
        sum += a[i] * b[i];
    }
    return sum;
}

// The weights come from memory at every node (a decode between two drafts streams the whole target
// through the caches), and the hardware prefetchers alone kept too few lines in flight: asking for the
// rows 16 ahead made a node after a 100 MB sweep 1.3-1.5x faster on a 2-core Zen 3 EPYC.
static inline void specgate_prefetch(const void * p, size_t bytes, int in_range) {
    if (!in_range) {
        return;
    }
    for (const char * c = (const char *) p, * e = c + bytes; c < e; c += 64) {
        __builtin_prefetch(c);
    }
}

// One product: y[t][n] = scale[n] * xs[t] * dot(w[n], xq[t]) for int8 weights, or dot(w[n], x[t]) for
// bf16 ones (no scales), t < rows <= 64. Each weight row is read once for all the rows.
struct specgate_product {
    const void * w;
    const float * scale;   // NULL: bf16 weights against fp32 inputs x
    int n_out, k, rows;
    const int8_t * xq;
    const float * xs;
    const float * x;
    float * y;
};

static void specgate_product_rows(const struct specgate_product * p, int n0, int n1) {
    const int k = p->k;
    int32_t dots[4];
    for (int n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? n1 - n : 4;
        if (p->scale == NULL) {
            const uint16_t * w = (const uint16_t *) p->w;
            specgate_prefetch(w + (size_t) (n + 16)*k, 8*k, n + 16 < n1);
            for (int r = 0; r < nr; ++r) {
                for (int t = 0; t < p->rows; ++t) {
                    p->y[(size_t) t*p->n_out + n + r] = specgate_dot_bf16(w + (size_t) (n + r)*k, p->x + (size_t) t*k, k);
                }
            }
            continue;
        }
        const int8_t * w = (const int8_t *) p->w;
        specgate_prefetch(w + (size_t) (n + 16)*k, 4*k, n + 16 < n1);
        for (int t = 0; t < p->rows; ++t) {
            specgate_dot4_i8(w + (size_t) n*k, nr, p->xq + (size_t) t*k, k, dots);
            for (int r = 0; r < nr; ++r) {
                p->y[(size_t) t*p->n_out + n + r] = (float) dots[r] * (p->scale[n + r] * p->xs[t]);
            }
        }
    }
}

// A second thread for the products. A node reads the head's weights from memory (a decode between two
// drafts streams the target through the caches), and one core reads at about half of what two do, so
// each product's rows are split between the caller and one helper. The helper spins for a short while
// after each product (the next one follows within microseconds) and then sleeps, so that it does not
// take a core from the decode that follows a draft. Each output is computed whole by one thread: the
// result does not depend on the split. One caller at a time (a mutex); a busy helper means one thread.
#define SPECGATE_SPIN_NS 100000  // 0.1 ms: a decode that follows a draft loses at most that much of a core
static pthread_mutex_t specgate_mutex = PTHREAD_MUTEX_INITIALIZER;  // held by the caller for a whole product
static pthread_mutex_t specgate_wake_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t specgate_wake = PTHREAD_COND_INITIALIZER;
static atomic_int specgate_posted, specgate_finished;
static const struct specgate_product * specgate_job;
static int specgate_job_n0, specgate_job_n1;
static int specgate_helper_state;  // 0: not started, 1: running, -1: could not start

static int64_t specgate_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void * specgate_helper(void * unused) {
    (void) unused;
    int seen = 0;
    for (;;) {
        const int64_t until = specgate_now_ns() + SPECGATE_SPIN_NS;
        while (atomic_load_explicit(&specgate_posted, memory_order_acquire) == seen && specgate_now_ns() < until) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        if (atomic_load_explicit(&specgate_posted, memory_order_acquire) == seen) {
            pthread_mutex_lock(&specgate_wake_mutex);
            while (atomic_load_explicit(&specgate_posted, memory_order_acquire) == seen) {
                pthread_cond_wait(&specgate_wake, &specgate_wake_mutex);
            }
            pthread_mutex_unlock(&specgate_wake_mutex);
        }
        seen = atomic_load_explicit(&specgate_posted, memory_order_acquire);
        specgate_product_rows(specgate_job, specgate_job_n0, specgate_job_n1);
        atomic_store_explicit(&specgate_finished, seen, memory_order_release);
    }
    return NULL;
}

// A forked child has no helper (fork copies only the calling thread), and may have copied a mutex
// mid-product: it starts its own helper at its first product.
static void specgate_after_fork(void) {
    specgate_helper_state = 0;
    pthread_mutex_init(&specgate_mutex, NULL);
    pthread_mutex_init(&specgate_wake_mutex, NULL);
    pthread_cond_init(&specgate_wake, NULL);
    atomic_store(&specgate_posted, 0);
    atomic_store(&specgate_finished, 0);
}

static void specgate_run(const struct specgate_product * p, int threads) {
    if (threads < 2 || p->n_out < 64 || pthread_mutex_trylock(&specgate_mutex) != 0) {
        specgate_product_rows(p, 0, p->n_out);
        return;
    }
    if (specgate_helper_state == 0) {
        static int registered = 0;
        if (!registered) {
            registered = pthread_atfork(NULL, NULL, specgate_after_fork) == 0;
        }
        pthread_t t;
        specgate_helper_state = pthread_create(&t, NULL, specgate_helper, NULL) == 0 ? 1 : -1;
        if (specgate_helper_state == 1) {
            pthread_detach(t);
        }
    }
    if (specgate_helper_state != 1) {
        pthread_mutex_unlock(&specgate_mutex);
        specgate_product_rows(p, 0, p->n_out);
        return;
    }
    const int half = (p->n_out / 2 + 3) & ~3;
    specgate_job = p;
    specgate_job_n0 = half;
    specgate_job_n1 = p->n_out;
    pthread_mutex_lock(&specgate_wake_mutex);
    const int ticket = atomic_fetch_add_explicit(&specgate_posted, 1, memory_order_acq_rel) + 1;
    pthread_cond_signal(&specgate_wake);
    pthread_mutex_unlock(&specgate_wake_mutex);
    specgate_product_rows(p, 0, half);
    while (atomic_load_explicit(&specgate_finished, memory_order_acquire) != ticket) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    pthread_mutex_unlock(&specgate_mutex);
}

// An int8 product of `rows` fp32 inputs x [rows][k]: each row quantized into xq, then the product.
static void specgate_linear_i8(const int8_t * w, const float * scale, int n_out, int k, int rows, const float * x,
                               int8_t * xq, float * y, int threads) {
    float xs[64];
    for (int t = 0; t < rows; ++t) {
        xs[t] = specgate_quantize_row(x + (size_t) t*k, k, xq + (size_t) t*k);
    }
    const struct specgate_product p = {w, scale, n_out, k, rows, xq, xs, NULL, y};
    specgate_run(&p, threads);
}

GGML_BACKEND_API void ggml_cpu_specgate_eagle_logits(const struct specgate_eagle_weights * w, int rows, const float * hidden,
                                                      float * logits) {
    int8_t * xq = malloc((size_t) 64 * w->hidden);
    for (int t = 0; t < rows; t += 64) {  // 64 rows' scales at a time (specgate_linear_i8)
        const int n = rows - t < 64 ? rows - t : 64;
        specgate_linear_i8(w->lm_head, w->lm_head_scale, w->draft_vocab, w->hidden, n, hidden + (size_t) t*w->hidden, xq,
                           logits + (size_t) t*w->draft_vocab, w->threads);
    }
    free(xq);
}

static void specgate_rope(float * x, const float * cos, const float * sin, int d) {
    const int h = d / 2;
    for (int i = 0; i < h; ++i) {
        const float a = x[i], b = x[i + h];
        x[i] = a*cos[i] - b*sin[i];
        x[i + h] = b*cos[i + h] + a*sin[i + h];
    }
}

// The layer over `rows` new pairs (tokens[t], features[t]) at positions[t], their K/V written at cache
// cells cache_len + t of cache_k / cache_v [kv_heads][max_len][head_dim]. Row t sees every cell before
// cache_len and the new cells j with visible[t*rows + j] (NULL: j <= t). out [rows][hidden]: the
// predicted next features. Returns 0, or -1 if the rows (at most 64), cells, tokens or positions are out of range.
GGML_BACKEND_API int ggml_cpu_specgate_eagle_layer(const struct specgate_eagle_weights * w, int rows, const int32_t * tokens,
                                                    const float * features, const int32_t * positions, const uint8_t * visible,
                                                    float * cache_k, float * cache_v, int cache_len, float * out) {
    if (rows < 1 || rows > 64 || cache_len < 0 || cache_len + rows > w->max_len) {
        return -1;
    }
    for (int t = 0; t < rows; ++t) {
        if (tokens[t] < 0 || tokens[t] >= w->vocab || positions[t] < 0 || positions[t] >= w->rope_len) {
            return -1;
        }
    }
    const int D = w->hidden, H = w->heads, HK = w->kv_heads, HD = w->head_dim, F = w->intermediate, L = w->max_len;
    const int QKV = (H + 2*HK) * HD, group = H / HK, cells = cache_len + rows;
    size_t widest = (size_t) 2*D;  // the widest row any step holds: cat(embedding, feature), qkv or gate_up
    widest = (size_t) QKV > widest ? (size_t) QKV : widest;
    widest = (size_t) 2*F > widest ? (size_t) 2*F : widest;
    float * in = malloc(sizeof(float) * rows * widest);      // cat(embedding, feature), then reused
    float * x = malloc(sizeof(float) * rows * D);            // the residual stream
    float * act = malloc(sizeof(float) * rows * widest);     // qkv / gate_up outputs
    float * att = malloc(sizeof(float) * rows * H * HD);     // attention outputs
    float * tmp = malloc(sizeof(float) * rows * (D > F ? D : F));
    float * scores = malloc(sizeof(float) * cells);
    int8_t * xq = malloc((size_t) rows * widest);

    // x = fc(cat(embed(token), feature)), bf16 weights, fp32 sums
    for (int t = 0; t < rows; ++t) {
        memcpy(in + (size_t) t*2*D, w->embed + (size_t) tokens[t]*D, sizeof(float) * D);
        memcpy(in + (size_t) t*2*D + D, features + (size_t) t*D, sizeof(float) * D);
    }
    const struct specgate_product fc = {w->fc, NULL, D, 2*D, rows, NULL, NULL, in, x};
    specgate_run(&fc, w->threads);

    // attention (no input norm): q, k, v; RoPE; the new K/V into the cache; then each row over its cells
    specgate_linear_i8(w->qkv, w->qkv_scale, QKV, D, rows, x, xq, act, w->threads);
    for (int t = 0; t < rows; ++t) {
        float * q = act + (size_t) t*QKV;
        const float * cs = w->rope_cos + (size_t) positions[t]*HD;
        const float * sn = w->rope_sin + (size_t) positions[t]*HD;
        for (int h = 0; h < H + HK; ++h) {
            specgate_rope(q + h*HD, cs, sn, HD);
        }
        for (int h = 0; h < HK; ++h) {
            memcpy(cache_k + ((size_t) h*L + cache_len + t)*HD, q + (H + h)*HD, sizeof(float) * HD);
            memcpy(cache_v + ((size_t) h*L + cache_len + t)*HD, q + (H + HK + h)*HD, sizeof(float) * HD);
        }
    }
    const float inv_sqrt = 1.0f / sqrtf((float) HD);
    for (int t = 0; t < rows; ++t) {
        for (int h = 0; h < H; ++h) {
            const float * q = act + (size_t) t*QKV + h*HD;
            const float * kh = cache_k + (size_t) (h / group)*L*HD;
            const float * vh = cache_v + (size_t) (h / group)*L*HD;
            float m = -INFINITY;
            for (int c = 0; c < cells; ++c) {
                const int j = c - cache_len;
                const int seen = j < 0 || (visible ? visible[t*rows + j] : j <= t);
                scores[c] = seen ? specgate_dot_f32(q, kh + (size_t) c*HD, HD) * inv_sqrt : -INFINITY;
                m = fmaxf(m, scores[c]);
            }
            float sum = 0.0f;
            float * o = att + (size_t) t*H*HD + h*HD;
            memset(o, 0, sizeof(float) * HD);
            for (int c = 0; c < cells; ++c) {
                if (scores[c] == -INFINITY) {
                    continue;
                }
                const float p = expf(scores[c] - m);
                sum += p;
                const float * vc = vh + (size_t) c*HD;
                for (int i = 0; i < HD; ++i) {
                    o[i] += p * vc[i];
                }
            }
            for (int i = 0; i < HD; ++i) {
                o[i] /= sum;
            }
        }
    }
    specgate_linear_i8(w->o, w->o_scale, D, H*HD, rows, att, xq, tmp, w->threads);
    for (size_t i = 0; i < (size_t) rows*D; ++i) {
        x[i] += tmp[i];
    }

    // MLP: x + down(silu(gate) * up) over the post-attention norm
    for (int t = 0; t < rows; ++t) {
        const float * xt = x + (size_t) t*D;
        const float r = 1.0f / sqrtf(specgate_dot_f32(xt, xt, D) / (float) D + w->eps);
        for (int i = 0; i < D; ++i) {
            in[(size_t) t*D + i] = w->post_norm[i] * (xt[i] * r);
        }
    }
    specgate_linear_i8(w->gate_up, w->gate_up_scale, 2*F, D, rows, in, xq, act, w->threads);
    for (int t = 0; t < rows; ++t) {
        const float * g = act + (size_t) t*2*F;
        for (int i = 0; i < F; ++i) {
            tmp[(size_t) t*F + i] = g[i] / (1.0f + expf(-g[i])) * g[F + i];
        }
    }
    specgate_linear_i8(w->down, w->down_scale, D, F, rows, tmp, xq, act, w->threads);
    for (size_t i = 0; i < (size_t) rows*D; ++i) {
        out[i] = x[i] + act[i];
    }
    free(in); free(x); free(act); free(att); free(tmp); free(scores); free(xq);
    return 0;
}

