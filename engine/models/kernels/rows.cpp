// y[r, n] = sum_k x[r, k] * w[n, k] (+ b[n]) for the few rows of a decode or verify pass, at the speed memory reads
// the weight. The weight is held packed, [tiles][k][NB * V]: a tile's NB * V outputs sit side by side in vector lanes
// and a thread reads its tiles as one stream. Every output's sum runs over k in order, whatever the number of rows,
// so a verify pass rounds exactly like a one-token pass.
#include <cstddef>
#include <cstring>

#if defined(__AVX512F__)
constexpr int V = 16, RB = 4;  // 32 vector registers: NB * RB sums, RB inputs and a weight vector
#else
constexpr int V = 8, RB = 2;  // 16 registers (AVX2)
#endif
typedef float vf __attribute__((vector_size(V * sizeof(float))));

static inline vf load(const float *p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { std::memcpy(p, &v, sizeof v); }

template <int NB, int R>
static inline void tile(const float *x, const float *wt, const float *b, float *y, int r0, int n0, int k, int n) {
    vf acc[NB][R];
#pragma GCC unroll 16
    for (int j = 0; j < NB; j++)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[j][r] = vf{};
    const float *xs = x + (size_t)r0 * k;
    for (int i = 0; i < k; i++) {
        vf xb[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) xb[r] = vf{} + xs[(size_t)r * k + i];
        const float *wi = wt + (size_t)i * NB * V;
#pragma GCC unroll 16
        for (int j = 0; j < NB; j++) {
            vf wv = load(wi + j * V);
            asm("" : "+v"(wv));  // held in a register: folded into each FMA, it was loaded R times (load-port bound)
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[j][r] += wv * xb[r];
        }
    }
    for (int r = 0; r < R; r++) {
        float *yr = y + (size_t)(r0 + r) * n + n0;
        for (int j = 0; j < NB; j++) {
            vf s = acc[j][r];
            if (b) s += load(b + n0 + j * V);  // b is padded like the weight
            if (n0 + (j + 1) * V <= n) store(yr + j * V, s);
            else for (int l = 0; l < V && n0 + j * V + l < n; l++) yr[j * V + l] = s[l];
        }
    }
}

template <int NB>
static void run(const float *x, const float *w, const float *b, float *y, int rows, int k, int n, int threads) {
    const int tiles = (n + NB * V - 1) / (NB * V);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tiles; t++) {
        const float *wt = w + (size_t)t * k * NB * V;
        const int n0 = t * NB * V;
        int r0 = 0;
        for (; r0 + RB <= rows; r0 += RB) tile<NB, RB>(x, wt, b, y, r0, n0, k, n);
        const int left = rows - r0;  // fewer than RB
        if constexpr (RB > 3) if (left == 3) tile<NB, 3>(x, wt, b, y, r0, n0, k, n);
        if constexpr (RB > 2) if (left == 2) tile<NB, 2>(x, wt, b, y, r0, n0, k, n);
        if (left == 1) tile<NB, 1>(x, wt, b, y, r0, n0, k, n);
    }
}

extern "C" int rows_lanes() { return V; }

// w packed by the caller as [tiles][k][nb * V] (outputs padded with zeros to whole tiles), b padded the same way
extern "C" void rows_f32(const float *x, const float *w, const float *b, float *y, int rows, int k, int n, int nb,
                         int threads) {
    if (nb == 4) run<4>(x, w, b, y, rows, k, n, threads);
    else if (nb == 2) run<2>(x, w, b, y, rows, k, n, threads);
    else run<1>(x, w, b, y, rows, k, n, threads);
}
