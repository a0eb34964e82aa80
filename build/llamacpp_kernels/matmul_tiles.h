// specgate patch (x86 with AVX2, FMA and F16C): weight rows x[r] (r < nr, bx bytes apart) against
// activation columns y[c] (c < nc, by bytes apart) into s[r + c*bs], one summation order for every nc
void ggml_vec_dot_tile_q4_0_q8_0(int n, int nr, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by);
void ggml_vec_dot_tile_q4_1_q8_1(int n, int nr, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by);
void ggml_vec_dot_tile_q8_0_q8_0(int n, int nr, int nc, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by);

