// y[r, n] = sum_k x[r, k] * w[n, k] (+ b[n]) for the few rows of a decode or verify pass, at the speed memory reads
// the weight. The weight is held packed, [tiles][k][NB * V]: a tile's NB * V outputs sit side by side in vector lanes
// and a thread reads its tiles as one stream. Every output's sum runs over k in order, whatever the number of rows,
// so a verify pass rounds exactly like a one-token pass.
#include <cstddef>
#include <cstring>

#if defined(__AVX512F__)
constexpr int V = 16, REGS = 32;
#else
constexpr int V = 8, REGS = 16;  // AVX2
#endif
// rows read together from one tile: NB * R sums, R inputs and a weight vector in registers, at most 6 (a verify pass
// of 5 draft tokens and its bonus row reads every weight once)
template <int NB> constexpr int rows_at_once() { return (REGS - 1) / (NB + 1) < 6 ? (REGS - 1) / (NB + 1) : 6; }
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

template <int NB, int R>
static inline void rows_of(const float *x, const float *wt, const float *b, float *y, int r0, int left, int n0, int k,
                           int n) {
    if constexpr (R > 1) if (left < R) return rows_of<NB, R - 1>(x, wt, b, y, r0, left, n0, k, n);
    tile<NB, R>(x, wt, b, y, r0, n0, k, n);
}

template <int NB>
static void run(const float *x, const float *w, const float *b, float *y, int rows, int k, int n, int threads) {
    constexpr int RB = rows_at_once<NB>();
    const int tiles = (n + NB * V - 1) / (NB * V);
    const int blocks = (rows + RB - 1) / RB;  // each tile is read once per block of rows, blocks as even as can be
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tiles; t++) {
        const float *wt = w + (size_t)t * k * NB * V;
        for (int block = 0, r0 = 0; block < blocks; block++) {
            const int size = (rows - r0) / (blocks - block);
            rows_of<NB, RB>(x, wt, b, y, r0, size, t * NB * V, k, n);
            r0 += size;
        }
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
