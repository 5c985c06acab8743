// y[r, n] = sum_k x[r, k] * w[n, k] (+ b[n]) for the few rows of a decode or verify pass, at the speed memory reads
// the weight. The weight is held packed, [tiles][k][NB * V]: a tile's NB * V outputs sit side by side in vector lanes
// and a thread reads its tiles as one stream. Every output's sum runs over k in order, whatever the number of rows,
// so a verify pass rounds exactly like a one-token pass.
//
// float32 and bfloat16 weights alike: a bfloat16 weight is widened to float32 in registers (exact: its 16 bits are
// float32's upper half), the sums run in float32 as oneDNN's do, and each output is rounded to bfloat16 once, to
// nearest even. Half the bytes to read, so twice the tokens/s at the same bandwidth. Where the CPU has AVX512_BF16
// they may be summed in pairs instead (tile_pairs), and where it has AMX on its tiles (tiles_amx).
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(NO_AMX)
#define AMX_TILES 1  // bfloat16 weights in pairs along k, summed by AMX tiles (tiles_amx below)
#define K_PAIRS 1
#elif defined(__AVX512BF16__) && !defined(NO_K_PAIRS)
#define K_PAIRS 1
#endif
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if AMX_TILES
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__)
constexpr int V = 16, REGS = 32;
#else
constexpr int V = 8, REGS = 16;  // AVX2
#endif
// rows read together from one tile: NB * R sums, R inputs and a weight vector in registers, at most 6 (a verify pass
// of 5 draft tokens and its bonus row reads every weight once)
constexpr int AHEAD = 8192;  // bytes of the weight stream prefetched ahead of the loads (past a tile's end: the next)
#ifndef PREFETCH_LOCALITY  // the prefetch's locality hint, chosen per CPU vendor by engine.models.native.flags
#define PREFETCH_LOCALITY 0
#endif
#if AMX_TILES
constexpr int K_DEPTH = 32;  // a bfloat16 weight's k padded with zeros to a multiple of this (engine.models.native)
#elif K_PAIRS
constexpr int K_DEPTH = 2;
#else
constexpr int K_DEPTH = 1;
#endif
template <int NB> constexpr int rows_at_once() { return (REGS - 1) / (NB + 1) < 6 ? (REGS - 1) / (NB + 1) : 6; }
typedef float vf __attribute__((vector_size(V * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(V * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(V * sizeof(uint32_t))));
struct bf16 { uint16_t bits; };

// acc + w * x, one rounding, in every instantiation of the kernel: left to -ffp-contract, GCC fused it for some row
// counts and not for others when built for AVX2 (16 vector registers), so a verify pass's rows did not round like
// one-token passes there (tests/test_engine.py, built with -mno-avx512f on an AVX512 machine)
static inline vf fused(vf w, vf x, vf acc) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)w, (__m512)x, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)acc);
#else
    vf out;
    for (int l = 0; l < V; l++) out[l] = __builtin_fmaf(w[l], x[l], acc[l]);
    return out;
#endif
}
static inline vf load(const float *p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
// *p in every lane, broadcast from memory: a load alone. `vf{} + *p` added a zero first (the compiler may not drop it:
// -0 + 0 is +0) and broadcast from a register, two more instructions per row and k, the broadcast a shuffle on one of
// AMD Zen 3's two FMA ports. The sums' bits are the same: a sum that starts at +0 never holds -0, so the sign of a zero
// input is never seen.
static inline vf splat(const float *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX__)
    return (vf)_mm256_broadcast_ss(p);
#else
    vf v;
    for (int l = 0; l < V; l++) v[l] = *p;
    return v;
#endif
}
static inline vf load(const bf16 *p) {
    vh h;
    std::memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}
static inline float widen(float v) { return v; }
static inline float widen(bf16 v) {
    uint32_t u = (uint32_t)v.bits << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t bf16_bits(float v) {  // round to nearest even, as torch does; a NaN stays a (quiet) NaN
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
// v rounded to bfloat16, kept as a float (exact): what a bfloat16 tensor holds after each of torch's operations
static inline float round_bf16(float v) { return widen(bf16{bf16_bits(v)}); }
// an output kept in float32 but rounded to bfloat16, as a bfloat16 model's pass holds it (engine's fused layers)
struct bf16f { float value; };
static inline void put(float *p, float v) { *p = v; }
static inline void put(bf16 *p, float v) { p->bits = bf16_bits(v); }
static inline void put(bf16f *p, float v) { p->value = round_bf16(v); }

// V values at once, each exactly as the scalar functions above do it (the bits do not depend on the path taken)
static inline void store(float *p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline vu bf16_bits_lanes(vf v) {  // bf16_bits of each lane, in the upper half of a 32-bit lane
    vu u;
    std::memcpy(&u, &v, sizeof u);
    const vu quiet = (u | 0x400000u) & 0xffff0000u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
}
static inline vf round_bf16_lanes(vf v) {
    const vu bits = bf16_bits_lanes(v);
    vf out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}
static inline void put_lanes(float *p, vf v) { store(p, v); }
static inline void put_lanes(bf16f *p, vf v) { store(&p->value, round_bf16_lanes(v)); }
static inline void put_lanes(bf16 *p, vf v) {
    const vh h = __builtin_convertvector(bf16_bits_lanes(v) >> 16, vh);
    std::memcpy(p, &h, sizeof h);
}
// a tile's vector of outputs: whole, or the lanes before n
template <typename Y> static inline void put_vector(Y *p, vf v, int left) {
    if (left >= V) return put_lanes(p, v);
    for (int l = 0; l < left; l++) put(p + l, v[l]);
}

#if K_PAIRS
// bfloat16 weights where the CPU has AVX512_BF16: packed in pairs along k, [tiles][k / 2][NB * V][2] (an odd k padded
// with a zero column), and summed by vdpbf16ps, which adds both products of a pair to a lane's float32 sum in one
// instruction. The widening tile below spends a shift or a mask and an FMA per weight: on a 2-core AMD EPYC (AVX512,
// BF16) its products of 5 rows ran at 37 GB/s of weights from the caches, 53 in pairs, where memory reads 35-64, and
// a fused verify pass of 5 rows of the bundled model cost 1.52 one-token passes widening, 1.38 in pairs. Each output
// is still one sum over k in one order, whatever the rows, so verify passes round like one-token passes (not like
// the widening tile: vdpbf16ps rounds its pair's sum, and flushes subnormals). The inputs, bfloat16 values held in
// float32, are packed in pairs by each thread at every call (xp: [rows][k / 2]): packed in scalar code, with
// rounding, that cost a one-row pass 8%.
template <typename Y, int NB, int R, bool PF>
static inline void tile_pairs(const uint32_t *xp, const bf16 *wt, const float *b, Y *y, int r0, int n0, int kp,
                              int n) {
    __m512 acc[NB][R];
#pragma GCC unroll 16
    for (int j = 0; j < NB; j++)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[j][r] = _mm512_setzero_ps();
    const uint32_t *xs = xp + (size_t)r0 * kp;
    for (int i = 0; i < kp; i++) {
        __m512bh xb[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) xb[r] = (__m512bh)_mm512_set1_epi32((int)xs[(size_t)r * kp + i]);
        const bf16 *wi = wt + (size_t)i * NB * V * 2;
        if constexpr (PF)
#pragma GCC unroll 16
            for (int line = 0; line < NB * V * 2 * 2 / 64; line++)
                __builtin_prefetch((const char *)wi + AHEAD + line * 64, 0, PREFETCH_LOCALITY);
#pragma GCC unroll 16
        for (int j = 0; j < NB; j++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wi + j * V * 2);
            asm("" : "+v"(wv));
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv, xb[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        Y *yr = y + (size_t)(r0 + r) * n + n0;
        for (int j = 0; j < NB; j++) {
            __m512 s = acc[j][r];
            if (b) s = _mm512_add_ps(s, _mm512_loadu_ps(b + n0 + j * V));
            put_vector(yr + j * V, (vf)s, n - n0 - j * V);
        }
    }
}

template <typename Y, int NB, int R, bool PF>
static inline void pair_rows(const uint32_t *xp, const bf16 *wt, const float *b, Y *y, int r0, int left, int n0,
                             int kp, int n) {
    if constexpr (R > 1) if (left < R) return pair_rows<Y, NB, R - 1, PF>(xp, wt, b, y, r0, left, n0, kp, n);
    tile_pairs<Y, NB, R, PF>(xp, wt, b, y, r0, n0, kp, n);
}

// the rows of x [rows][k] as tile_pairs reads them, [rows][kp] pairs (k padded with zeros to 2 kp), in a buffer of
// the calling thread's (each thread packs them for itself: no barrier). x holds bfloat16 values (exactly), so a
// value's bits are the upper half of its float's.
static inline const uint32_t *pack_pairs(const float *x, int rows, int k, int kp) {
    static thread_local std::vector<uint32_t> pairs;
    pairs.assign((size_t)rows * kp, 0);
    for (int r = 0; r < rows; r++) {
        const uint32_t *xr = (const uint32_t *)(x + (size_t)r * k);
        uint32_t *pr = pairs.data() + (size_t)r * kp;
#pragma GCC ivdep
        for (int i = 0; i < k / 2; i++) pr[i] = (xr[2 * i] >> 16) | (xr[2 * i + 1] & 0xffff0000u);
        if (k % 2) pr[k / 2] = xr[k - 1] >> 16;
    }
    return pairs.data();
}
#endif

#if AMX_TILES
// bfloat16 weights on CPUs with AMX: the same pairs along k, summed by tdpbf16ps, which multiplies a tile of up to 16
// rows' inputs (16 pairs of each) by 16 pairs of 16 outputs' weights at once. The widening tile's FMAs were the limit
// of a verify pass there: on the 2-core Intel Xeon (AMX) a fused 5-row bfloat16 pass of the bundled model cost 1.40
// one-token passes, its weights coming largely from a 300 MB L3. A tile's weights are one more [kp][16][2] view of
// the packed weight (the row stride NB * V pairs), so its layout is tile_pairs', with k padded to whole steps of 32.
// Each output is one sum over k in 16-pair steps, in order, and a tile's rows are computed apart: a verify pass
// rounds like one-token passes (not like either AVX512 tile: tdpbf16ps flushes subnormals and rounds as it does).
// Linux hands a process the tiles' state only when asked (arch_prctl); where it refuses, tile_pairs runs instead
static inline bool ask_for_tiles() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
inline const bool amx_ready = ask_for_tiles();

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
// tiles 0-3: the sums of up to 16 rows' outputs, 16 per tile (float32); 4: the rows' inputs, 16 pairs each; 5-7: a
// step's weights, 16 pairs of 16 outputs. Loaded by each thread at each call: torch's oneDNN uses the same tiles on
// the same threads with configurations of its own
static inline void configure_tiles(int rows) {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 5 ? rows : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

template <typename Y, int NB, bool PF>
static void tiles_amx(const uint32_t *xp, const bf16 *w, const float *b, Y *y, int rows, int kp, int n) {
    constexpr int width = NB * V;
    const int tiles = (n + width - 1) / width;
    float sums[16 * width];
    int configured = 0;
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const bf16 *wt = w + (size_t)t * kp * width * 2;
        for (int r0 = 0; r0 < rows; r0 += 16) {
            const int m = rows - r0 < 16 ? rows - r0 : 16;
            if (m != configured) configure_tiles(configured = m);
            _tile_zero(0);
            if constexpr (NB > 1) _tile_zero(1);
            if constexpr (NB > 2) _tile_zero(2);
            if constexpr (NB > 3) _tile_zero(3);
            const uint32_t *xs = xp + (size_t)r0 * kp;
            for (int i = 0; i < kp; i += 16) {
                const bf16 *wi = wt + (size_t)i * width * 2;
                if constexpr (PF)
#pragma GCC unroll 64
                    for (int line = 0; line < 16 * width * 4 / 64; line++)
                        __builtin_prefetch((const char *)wi + AHEAD + line * 64, 0, PREFETCH_LOCALITY);
                _tile_loadd(4, xs + i, kp * 4);
                _tile_loadd(5, wi, width * 4);
                _tile_dpbf16ps(0, 4, 5);
                if constexpr (NB > 1) {
                    _tile_loadd(6, wi + 2 * V, width * 4);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if constexpr (NB > 2) {
                    _tile_loadd(7, wi + 4 * V, width * 4);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if constexpr (NB > 3) {
                    _tile_loadd(5, wi + 6 * V, width * 4);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, sums, width * 4);
            if constexpr (NB > 1) _tile_stored(1, sums + V, width * 4);
            if constexpr (NB > 2) _tile_stored(2, sums + 2 * V, width * 4);
            if constexpr (NB > 3) _tile_stored(3, sums + 3 * V, width * 4);
            for (int r = 0; r < m; r++) {
                Y *yr = y + (size_t)(r0 + r) * n + t * width;
                for (int j = 0; j < NB; j++) {
                    vf s = load(sums + r * width + j * V);
                    if (b) s += load(b + t * width + j * V);
                    put_vector(yr + j * V, s, n - t * width - j * V);
                }
            }
        }
    }
    if (configured) _tile_release();
}
#endif

// W: the weight's type (float or bf16); Y: the output's (float, bf16, or bf16f: rounded to bfloat16, kept in float)
template <typename W, typename Y, int NB, int R, bool PF>
static inline void tile(const float *x, const W *wt, const float *b, Y *y, int r0, int n0, int k, int n) {
    vf acc[NB][R];
#pragma GCC unroll 16
    for (int j = 0; j < NB; j++)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[j][r] = vf{};
    const float *xs = x + (size_t)r0 * k;
    // AVX2's 16 registers: each row's input broadcast just before its FMAs, not all of them first, or they run short
    // at 5 rows and sums spill (float32 tiles of 2 vectors spilled one sum at every k: a 5-row product from the
    // caches ran at 24 GB/s, 58 late, on the 2-core AMD EPYC (AVX2); bfloat16's 5 rows from memory at 15, 20 late)
    constexpr bool late = REGS == 16;
    for (int i = 0; i < k; i++) {
        vf xb[R];
        if constexpr (!late)
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) xb[r] = splat(xs + (size_t)r * k + i);
        const W *wi = wt + (size_t)i * NB * V;
        // the weight's lines 8 KiB ahead asked for now: on the 2-core AMD EPYC (AVX512, BF16) the hardware
        // prefetchers alone left a one-row product at 25 GB/s where memory reads 35, non-temporal prefetches (0)
        // 29-31. On the Intel Xeon (AMX) non-temporal ones held it at 11 GB/s where memory reads 28 (27 with
        // locality 1 or 3, 22 with none): the hint is the CPU vendor's (native.flags)
        constexpr int STEP = NB * V * sizeof(W);  // bytes of weight per k: 32 in AVX2's bfloat16 tiles of 2 vectors
        if constexpr (PF && STEP >= 64) {
#pragma GCC unroll 16
            for (int line = 0; line < STEP / 64; line++)
                __builtin_prefetch((const char *)wi + AHEAD + line * 64, 0, PREFETCH_LOCALITY);
        } else if constexpr (PF) {  // a line spans several k: asked for at each (a test of which k would cost a branch)
            __builtin_prefetch((const char *)wi + AHEAD, 0, PREFETCH_LOCALITY);
        }
        if constexpr (std::is_same_v<W, bf16> && NB % 2 == 0) {
            // bfloat16 tiles of an even number of vectors are packed in pairs: lane m of a 32-bit load holds output m
            // of one vector in its low half and of the next in its high half, so one shift and one mask widen both
#pragma GCC unroll 16
            for (int j = 0; j < NB; j += 2) {
                vu u;
                std::memcpy(&u, wi + j * V, sizeof u);
                vu low = u << 16, high = u & 0xffff0000u;
                vf w0, w1;
                std::memcpy(&w0, &low, sizeof w0);
                std::memcpy(&w1, &high, sizeof w1);
                asm("" : "+v"(w0), "+v"(w1));
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    vf xr = late ? splat(xs + (size_t)r * k + i) : xb[r];
                    acc[j][r] = fused(w0, xr, acc[j][r]);
                    acc[j + 1][r] = fused(w1, xr, acc[j + 1][r]);
                }
            }
        } else {
            // held in registers: folded into each FMA, a weight vector was loaded R times (load-port bound)
            vf wv[NB];
#pragma GCC unroll 16
            for (int j = 0; j < NB; j++) {
                wv[j] = load(wi + j * V);
                asm("" : "+v"(wv[j]));
                if constexpr (!late)  // AVX512's 32 registers: a weight vector at a time, over the inputs in registers
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++) acc[j][r] = fused(wv[j], xb[r], acc[j][r]);
            }
            if constexpr (late)  // AVX2's: the tile's weight vectors in registers, over each row's input in turn
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const vf xr = splat(xs + (size_t)r * k + i);
#pragma GCC unroll 16
                    for (int j = 0; j < NB; j++) acc[j][r] = fused(wv[j], xr, acc[j][r]);
                }
        }
    }
    // unrolled like the loops above, so that acc lives in registers: indexed at run time here, GCC kept it in memory
    // and stored every sum at every k where the registers ran short (AVX2's 16)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        Y *yr = y + (size_t)(r0 + r) * n + n0;
#pragma GCC unroll 16
        for (int j = 0; j < NB; j++) {
            vf s = acc[j][r];
            if (b) s += load(b + n0 + j * V);  // b is padded like the weight
            put_vector(yr + j * V, s, n - n0 - j * V);
        }
    }
}

template <typename W, typename Y, int NB, int R, bool PF>
static inline void rows_of(const float *x, const W *wt, const float *b, Y *y, int r0, int left, int n0, int k, int n) {
    if constexpr (R > 1) if (left < R) return rows_of<W, Y, NB, R - 1, PF>(x, wt, b, y, r0, left, n0, k, n);
    tile<W, Y, NB, R, PF>(x, wt, b, y, r0, n0, k, n);
}

// the tiles shared among the threads of the enclosing parallel region (a worksharing loop: called outside one, the
// calling thread does them all), in order, each read once per block of at most rows_at_once rows
template <typename W, typename Y, int NB, bool PF>
static void run(const float *x, const W *w, const float *b, Y *y, int rows, int k, int n) {
    constexpr int RB = rows_at_once<NB>();
    const int tiles = (n + NB * V - 1) / (NB * V);
    const int blocks = (rows + RB - 1) / RB;  // each tile is read once per block of rows, blocks as even as can be
#if K_PAIRS
    constexpr bool paired = std::is_same_v<W, bf16>;  // bfloat16 weights packed in pairs along k (tile_pairs)
#else
    constexpr bool paired = false;
#endif
    const int depth = paired ? (k + K_DEPTH - 1) / K_DEPTH * K_DEPTH : k;  // a tile's weights along k (padded)
#if K_PAIRS
    const uint32_t *xp = paired ? pack_pairs(x, rows, k, depth / 2) : nullptr;
#if AMX_TILES
    if constexpr (paired)
        if (amx_ready) return tiles_amx<Y, NB, PF>(xp, w, b, y, rows, depth / 2, n);
#endif
#endif
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const W *wt = w + (size_t)t * depth * NB * V;
        for (int block = 0, r0 = 0; block < blocks; block++) {
            const int size = (rows - r0) / (blocks - block);
            if constexpr (paired) {
#if K_PAIRS
                pair_rows<Y, NB, RB, PF>(xp, wt, b, y, r0, size, t * NB * V, depth / 2, n);
#endif
            } else {
                rows_of<W, Y, NB, RB, PF>(x, wt, b, y, r0, size, t * NB * V, k, n);
            }
            r0 += size;
        }
    }
}

// Whether a product of r rows prefetches its weight's lines (bit min(r, 32) - 1), per weight type: [0] float32, [1]
// bfloat16. Set once per process from what engine.models.native.choose_prefetch measured on this CPU: on the AMD EPYC
// (AVX2) a float32 one-token pass of the bundled model ran 10-14% faster on the hardware prefetchers alone, its verify
// passes and every bfloat16 pass faster prefetched (the variants in turns); on the AMD EPYC (AVX512, BF16) and the
// Intel Xeon (AMX) one-row products had run ~20% slower without (see the hint above). All on until told otherwise.
inline uint32_t prefetch_rows[2] = {~0u, ~0u};

template <typename W, typename Y, int NB>
static void prefetched(const float *x, const W *w, const float *b, Y *y, int rows, int k, int n) {
    const uint32_t bit = 1u << ((rows < 32 ? rows : 32) - 1);
    if (prefetch_rows[std::is_same_v<W, bf16>] & bit) run<W, Y, NB, true>(x, w, b, y, rows, k, n);
    else run<W, Y, NB, false>(x, w, b, y, rows, k, n);
}

// y = x w^T (+ b) with w packed in tiles of nb vectors (4, 2 or 1), inside a parallel region
template <typename W, typename Y>
static void product(const float *x, const W *w, const float *b, Y *y, int rows, int k, int n, int nb) {
    if (nb == 4) prefetched<W, Y, 4>(x, w, b, y, rows, k, n);
    else if (nb == 2) prefetched<W, Y, 2>(x, w, b, y, rows, k, n);
    else prefetched<W, Y, 1>(x, w, b, y, rows, k, n);
}
