// A Llama-family decoder's layers for the few rows of a decode or verify pass, as one call (engine.decoding.lean's
// fused pass): the norms, the four products of rows.h, rotary embeddings, the cache's writes, attention over the
// cache, SiLU and the residual adds, in one parallel region. Around the products, a pass of the bundled model ran
// ~1,400 small torch operations and SDPA at 32-70 us a call: 4.5-6 ms of an 18 ms pass (float32) and 40% of a
// bfloat16 one, where the products alone read the weights in ~7.5 ms.
//
// Every row is computed alone, in one order, whatever the rows of the pass: its norm, its rotary embedding, its
// attention over the keys it sees (in the order they sit in the cache; a tree's rows see their ancestors, which a
// one-token pass would have found in the same order), so a verify pass or a tree pass rounds exactly like the
// one-token passes of the baseline. A bfloat16 model's pass rounds to bfloat16 where torch's would hold a bfloat16
// tensor (after each product, norm, rotary product and sum, attention, SiLU, product and add); sums run in float32.
#include <algorithm>
#include <cmath>
#include <vector>

#include <omp.h>

#include "rows.h"

struct Layer {                      // one decoder layer's weights, packed for rows.h (filled by engine.models.native)
    const float *input_norm;        // [E], float32
    const float *post_norm;         // [E], float32
    const void *qkv; const float *qkv_bias; int qkv_nb;   // q, k and v joined: [H*D + 2*KV*D, E]
    const void *o; const float *o_bias; int o_nb;         // [E, H*D]
    const void *gate_up; const float *gate_up_bias; int gate_up_nb;  // gate and up joined: [2*I, E]
    const void *down; const float *down_bias; int down_nb;           // [E, I]
    // an EAGLE-3 head's first layer (null in a decoder's): its q, k and v read [input_norm(the token's embedding),
    // hidden_norm(the state)], 2E wide, and with normed_residual the residual stream is the normed state
    const float *hidden_norm; int normed_residual;
    // a DFlash head's layer: Qwen3's per-head norms of q and k, [D] each, before their rotary embeddings (or null)
    const float *q_norm, *k_norm;
};

constexpr int GROUPED = 4;  // query heads an attention task takes at most (a group's heads share keys and values)

struct Shape {
    int hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
};

// A draft head's last steps, run after its layers in the same call: its final norm and its LM head's product (packed
// as rows.h reads it), as the head's own norm and LM head compute them apart. Called apart, they cost an EAGLE-3 chain
// step of the bundled model's head more in calls and torch operations around them than their 9 MB took to read.
struct Final {
    const float *norm;                                 // [E], float32
    const void *weight; const float *bias; int nb, n;  // the LM head: [n, E]
};

template <typename W> static inline float keep(float v) {  // what a tensor of the model's dtype holds
    if constexpr (std::is_same_v<W, bf16>) return round_bf16(v); else return v;
}
// The element-wise stages (norms, rotary embeddings, SiLU, the residual adds, the attention's output) run V lanes at a
// time, each lane's arithmetic the scalar tail's, so their bits are what they were one value at a time: in scalar code,
// rounding each value to bfloat16 on its own, they cost a 5-row bfloat16 pass of the bundled model ~0.5 ms more than
// a one-row pass, the attention's per-value loops 0.3 ms more
template <typename W> static inline vf keep_lanes(vf v) {
    if constexpr (std::is_same_v<W, bf16>) return round_bf16_lanes(v); else return v;
}
template <typename W> using Out = std::conditional_t<std::is_same_v<W, bf16>, bf16f, float>;

typedef int32_t vi __attribute__((vector_size(V * sizeof(int32_t))));

// e^x for V lanes at once (Cephes' expf: x = k ln 2 + r, |r| <= ln 2 / 2, e^r by a degree-6 polynomial; within 2 ulp
// of the true value): a five-row pass made ~230,000 calls of the scalar expf in SiLU and the softmax
static inline vf exp_lanes(vf x) {
    const vf high = vf{} + 88.37626f, low = vf{} - 87.33654f;
    x = x > high ? high : x;
    x = x < low ? low : x;
    const vf t = x * 1.44269504088896341f + 0.5f;
    vi k = __builtin_convertvector(t, vi);
    k += (t < __builtin_convertvector(k, vf));  // truncation to floor: -1 where t was negative and not whole
    const vf kf = __builtin_convertvector(k, vf);
    const vf r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
    vf p = vf{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vf y = p * r * r + r + 1.0f;
    const vi scale = (k + 127) << 23;
    vf two_k;
    std::memcpy(&two_k, &scale, sizeof two_k);
    return y * two_k;
}

// e^x of n values in place, V at a time (the tail through a padded vector: the same lanes' arithmetic)
static void exp_all(float *x, int n) {
    int i = 0;
    for (; i + V <= n; i += V) {
        vf v = exp_lanes(load(x + i));
        std::memcpy(x + i, &v, sizeof v);
    }
    if (i < n) {
        float tail[V] = {};
        std::memcpy(tail, x + i, (n - i) * sizeof(float));
        vf v = exp_lanes(load(tail));
        std::memcpy(x + i, &v, (n - i) * sizeof(float));
    }
}

template <typename W> static inline float dot(const float *a, const W *b, int n) {  // one order for every row
    vf acc{};
    int i = 0;
    for (; i + V <= n; i += V) acc += load(a + i) * load(b + i);
    float s = 0;
    for (int l = 0; l < V; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * widen(b[i]);
    return s;
}

// LlamaRMSNorm of n values: in float32, scaled by the weight; rounded as torch rounds a bfloat16 model's (h may be x)
template <typename W> static void norm(const float *x, const float *weight, float *h, int n, float eps) {
    const float mean = dot(x, x, n) / n, inv = 1.0f / std::sqrt(mean + eps);
    int i = 0;
    for (; i + V <= n; i += V) store(h + i, keep_lanes<W>(load(weight + i) * keep_lanes<W>(load(x + i) * inv)));
    for (; i < n; i++) h[i] = keep<W>(weight[i] * keep<W>(x[i] * inv));
}
template <typename W> static void norm(const float *x, const float *weight, float *h, const Shape &s) {
    norm<W>(x, weight, h, s.hidden, s.eps);
}

// x[i] = x[i] + y[i] as the model's dtype holds it, for i < n
template <typename W> static inline void add(float *x, const float *y, int n) {
    int i = 0;
    for (; i + V <= n; i += V) store(x + i, keep_lanes<W>(load(x + i) + load(y + i)));
    for (; i < n; i++) x[i] = keep<W>(x[i] + y[i]);
}

// x * cos + roll(x, D/2) * sin for one head of one row (sin signed: -s then s, as engine.decoding.lean computes it)
template <typename W> static void rotate(float *x, const float *cos, const float *sin, int d) {
    float rotated[512];
    const int half = d / 2;
    for (int part = 0; part < 2; part++) {  // roll: the first half's partners are the second half's, and back
        const int from = part * half, to = from + half, shift = part ? -half : half;
        int i = from;
        for (; i + V <= to; i += V)
            store(rotated + i, keep_lanes<W>(keep_lanes<W>(load(x + i) * load(cos + i)) +
                                             keep_lanes<W>(load(x + i + shift) * load(sin + i))));
        for (; i < to; i++) rotated[i] = keep<W>(keep<W>(x[i] * cos[i]) + keep<W>(x[i + shift] * sin[i]));
    }
    std::memcpy(x, rotated, d * sizeof(float));
}

// The attention of one row's query heads q[0..G) that share one key/value head (k, v: [capacity][D]) over the keys the
// row sees (`sees`, or every key before `end`), into a[0..G): each head's scores, softmax and weighted sum of values
// exactly as for that head alone, in one order whatever the rows of the pass (the sums' own lanes, FMAs written out),
// but each key and value read once for the G heads, and G sums in flight: one head at a time, each score waited on
// its own chain of FMAs and lane sum (some 60 cycles a key on the AVX2 EPYC, counted from the instructions, not
// timed). score: G * end floats of room.
template <typename W, int G>
static void attend(const float *const *q, float *const *a, const W *k, const W *v, const uint8_t *sees, int end,
                   int D, float scale, float *score) {
    float top[G], sum[G] = {};
    for (int g = 0; g < G; g++) top[g] = -INFINITY;
    for (int j = 0; j < end; j++) {
        if (sees && !sees[j]) continue;
        const W *kj = k + (size_t)j * D;
        vf acc[G] = {};
        int i = 0;
        for (; i + V <= D; i += V) {
            const vf key = load(kj + i);
            for (int g = 0; g < G; g++) acc[g] = fused(load(q[g] + i), key, acc[g]);
        }
        for (int g = 0; g < G; g++) {
            float dot = 0;
            for (int l = 0; l < V; l++) dot += acc[g][l];
            for (int t = i; t < D; t++) dot = __builtin_fmaf(q[g][t], widen(kj[t]), dot);
            const float x = dot * scale;
            score[g * end + j] = x;
            top[g] = x > top[g] ? x : top[g];
        }
    }
    for (int g = 0; g < G; g++) {
        float *row = score + g * end;
        for (int j = 0; j < end; j++) row[j] = sees && !sees[j] ? -INFINITY : row[j] - top[g];
        exp_all(row, end);  // keys the row does not see are skipped below
    }
    for (int j = 0; j < end; j++) {
        if (sees && !sees[j]) continue;
        for (int g = 0; g < G; g++) sum[g] += score[g * end + j];
    }
    // each value's sum over the keys in order, in registers: 2V values of every head at a time, then V, then one (the
    // loops for head sizes that are not a multiple of 2V)
    float o[G][512];
    int i = 0;
    for (; i + 2 * V <= D; i += 2 * V) {  // two vectors of each head's values at a time: 2G sums in flight
        vf acc[G][2] = {};
        for (int j = 0; j < end; j++) {
            if (sees && !sees[j]) continue;
            const vf value[2] = {load(v + (size_t)j * D + i), load(v + (size_t)j * D + i + V)};
            for (int g = 0; g < G; g++) {
                const vf p = splat(score + g * end + j);
                acc[g][0] = fused(p, value[0], acc[g][0]);
                acc[g][1] = fused(p, value[1], acc[g][1]);
            }
        }
        for (int g = 0; g < G; g++) store(o[g] + i, acc[g][0]), store(o[g] + i + V, acc[g][1]);
    }
    for (; i + V <= D; i += V) {
        vf acc[G] = {};
        for (int j = 0; j < end; j++) {
            if (sees && !sees[j]) continue;
            const vf value = load(v + (size_t)j * D + i);
            for (int g = 0; g < G; g++) acc[g] = fused(splat(score + g * end + j), value, acc[g]);
        }
        for (int g = 0; g < G; g++) store(o[g] + i, acc[g]);
    }
    for (; i < D; i++) {
        float acc[G] = {};
        for (int j = 0; j < end; j++) {
            if (sees && !sees[j]) continue;
            for (int g = 0; g < G; g++) acc[g] = __builtin_fmaf(score[g * end + j], widen(v[(size_t)j * D + i]), acc[g]);
        }
        for (int g = 0; g < G; g++) o[g][i] = acc[g];
    }
    for (int g = 0; g < G; g++) {
        int c = 0;
        for (; c + V <= D; c += V) store(a[g] + c, keep_lanes<W>(load(o[g] + c) / sum[g]));
        for (; c < D; c++) a[g][c] = keep<W>(o[g][c] / sum[g]);
    }
}

template <typename W>
static void layers(const Layer *stack, int first, int last, const Shape &s, float *x, const float *embedded,
                   const float *context, int C, int rows, int past, const float *cos, const float *sin,
                   const uint8_t *mask, W **keys, W **values, int capacity, int threads, const Final *final,
                   float *normed, void *logits) {
    const int E = s.hidden, D = s.head_dim, H = s.heads, KV = s.kv_heads, I = s.intermediate;
    const int q_width = H * D, kv_width = KV * D, qkv_width = q_width + 2 * kv_width, total = past + C + rows;
    const int groups = H / KV;
    int widest = E;  // the widest input of a q/k/v product: 2E where a layer reads the embedding beside the state
    for (int l = first; l < last; l++) widest = stack[l].hidden_norm ? 2 * E : widest;
    const int all = C + rows;  // rows whose keys and values the pass writes: the context's, then its own
    std::vector<float> h((size_t)all * widest), qkv((size_t)all * qkv_width), att((size_t)rows * q_width);
    std::vector<float> out((size_t)rows * E), gate_up((size_t)rows * 2 * I), act((size_t)rows * I);
    const int chunks = (groups + GROUPED - 1) / GROUPED;  // attention tasks per row and key/value head
    std::vector<float> scores((size_t)threads * GROUPED * total);  // a task's scores per thread (a long prompt's are many)
#pragma omp parallel num_threads(threads)
    for (int l = first; l < last; l++) {
        const Layer &L = stack[l];
        const int in = L.hidden_norm ? 2 * E : E;  // the q/k/v products' input width
#pragma omp for schedule(static)
        for (int a = 0; a < all; a++) {
            float *hr = h.data() + (size_t)a * in;
            if (a < C) {  // a DFlash context row: its keys and values come from it as it is, unnormed
                std::memcpy(hr, context + (size_t)a * E, E * sizeof(float));
                continue;
            }
            float *xr = x + (size_t)(a - C) * E;
            if (!L.hidden_norm) {
                norm<W>(xr, L.input_norm, hr, s);
                continue;
            }
            norm<W>(embedded + (size_t)(a - C) * E, L.input_norm, hr, s);
            norm<W>(xr, L.hidden_norm, hr + E, s);
            if (L.normed_residual) std::memcpy(xr, hr + E, E * sizeof(float));
        }
        product(h.data(), (const W *)L.qkv, L.qkv_bias, (Out<W> *)qkv.data(), all, in, qkv_width, L.qkv_nb);
        // per-head norms (a DFlash head's), rotary embeddings of q and k; k and v written to the cache at the rows'
        // positions
#pragma omp for schedule(static)
        for (int r = 0; r < all; r++) {
            float *row = qkv.data() + (size_t)r * qkv_width;
            for (int head = 0; L.q_norm && head < H + KV; head++)
                norm<W>(row + head * D, head < H ? L.q_norm : L.k_norm, row + head * D, D, s.eps);
            for (int head = 0; head < H + KV; head++) rotate<W>(row + head * D, cos + (size_t)r * D, sin + (size_t)r * D, D);
            for (int head = 0; head < KV; head++) {
                const size_t at = ((size_t)head * capacity + past + r) * D;
                for (int i = 0; i < D; i++) {
                    put(keys[l] + at + i, row[q_width + head * D + i]);
                    put(values[l] + at + i, row[q_width + kv_width + head * D + i]);
                }
            }
        }
        // attention of each row and query head over the keys the row sees, in cache order: a task is one row and up
        // to GROUPED of the query heads that share a key/value head
#pragma omp for schedule(static)
        for (int task = 0; task < rows * KV * chunks; task++) {
            const int r = task / (KV * chunks), kv = task / chunks % KV, head = kv * groups + task % chunks * GROUPED;
            const int count = std::min(GROUPED, (kv + 1) * groups - head);
            const float *q[GROUPED];
            float *a[GROUPED];
            for (int g = 0; g < count; g++) {
                q[g] = qkv.data() + (size_t)(C + r) * qkv_width + (head + g) * D;
                a[g] = att.data() + (size_t)r * q_width + (head + g) * D;
            }
            const W *k = keys[l] + (size_t)kv * capacity * D, *v = values[l] + (size_t)kv * capacity * D;
            const uint8_t *sees = mask ? mask + (size_t)r * total : nullptr;
            const int end = mask ? total : past + C + r + 1;
            float *score = scores.data() + (size_t)omp_get_thread_num() * GROUPED * total;
            if (count == 4) attend<W, 4>(q, a, k, v, sees, end, D, s.scale, score);
            else if (count == 3) attend<W, 3>(q, a, k, v, sees, end, D, s.scale, score);
            else if (count == 2) attend<W, 2>(q, a, k, v, sees, end, D, s.scale, score);
            else attend<W, 1>(q, a, k, v, sees, end, D, s.scale, score);
        }
        product(att.data(), (const W *)L.o, L.o_bias, (Out<W> *)out.data(), rows, q_width, E, L.o_nb);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            float *xr = x + (size_t)r * E;
            add<W>(xr, out.data() + (size_t)r * E, E);
            norm<W>(xr, L.post_norm, h.data() + (size_t)r * E, s);
        }
        product(h.data(), (const W *)L.gate_up, L.gate_up_bias, (Out<W> *)gate_up.data(), rows, E, 2 * I, L.gate_up_nb);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {  // SiLU(gate) * up
            const float *g = gate_up.data() + (size_t)r * 2 * I, *u = g + I;
            float *a = act.data() + (size_t)r * I;
            for (int c = 0; c < I; c++) a[c] = -g[c];
            exp_all(a, I);
            int c = 0;
            for (; c + V <= I; c += V)
                store(a + c, keep_lanes<W>(keep_lanes<W>(load(g + c) / (1.0f + load(a + c))) * load(u + c)));
            for (; c < I; c++) a[c] = keep<W>(keep<W>(g[c] / (1.0f + a[c])) * u[c]);
        }
        product(act.data(), (const W *)L.down, L.down_bias, (Out<W> *)out.data(), rows, I, E, L.down_nb);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) add<W>(x + (size_t)r * E, out.data() + (size_t)r * E, E);
        if (final && l == last - 1) {  // a draft head's final norm and LM head, in the same parallel region
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) norm<W>(x + (size_t)r * E, final->norm, normed + (size_t)r * E, s);
            // the logits in the model's dtype, each rounded once, as the LM head's own call returns them (rows_bf16)
            using Logit = std::conditional_t<std::is_same_v<W, bf16>, bf16, float>;
            product(normed, (const W *)final->weight, final->bias, (Logit *)logits, rows, E, final->n, final->nb);
        }
    }
}

// x: [rows, E] float32 (a bfloat16 model's values, exactly), the residual stream entering layer `first`, left as it
// leaves layer `last` - 1; embedded: [rows, E], the rows' token embeddings where a layer reads them (hidden_norm), else
// unused; context: [C, E], a DFlash head's context rows, whose keys and values each layer writes before the rows' (at
// positions past..past + C - 1) and which pass through no more of it (C = 0: none); cos, sin: [C + rows, D] (the rows'
// positions; values of the model's dtype); mask: [rows, past + C + rows], which keys each row sees (a tree, a sliding
// window, a block), or null (causal); keys, values: each layer's cache, [KV][capacity][D]; final: a draft head's final
// norm and LM head, run after layer `last` - 1 (or null): normed, [rows, E] float32, gets the normed rows (values of
// the model's dtype), logits, [rows, final->n] of the model's dtype, their LM head's outputs
extern "C" void layers_f32(const Layer *stack, int first, int last, const Shape *s, float *x, const float *embedded,
                           const float *context, int C, int rows, int past, const float *cos, const float *sin,
                           const uint8_t *mask, float **keys, float **values, int capacity, int threads,
                           const Final *final, float *normed, float *logits) {
    layers<float>(stack, first, last, *s, x, embedded, context, C, rows, past, cos, sin, mask, keys, values, capacity,
                  threads, final, normed, logits);
}

extern "C" void layers_bf16(const Layer *stack, int first, int last, const Shape *s, float *x, const float *embedded,
                            const float *context, int C, int rows, int past, const float *cos, const float *sin,
                            const uint8_t *mask, bf16 **keys, bf16 **values, int capacity, int threads,
                            const Final *final, float *normed, bf16 *logits) {
    layers<bf16>(stack, first, last, *s, x, embedded, context, C, rows, past, cos, sin, mask, keys, values, capacity,
                 threads, final, normed, logits);
}

// LlamaRMSNorm of each of `rows` rows of x [rows, n] into out, as a layer's norms compute it (rounded to bfloat16 where
// `sixteen`): a draft head's final norm after its layers' call, where the norm's ~8 torch operations cost an EAGLE-3
// chain step more than the products of a small layer
extern "C" void norm_rows(const float *x, const float *weight, float *out, int rows, int n, float eps, int sixteen) {
    for (int r = 0; r < rows; r++) {
        if (sixteen) norm<bf16>(x + (size_t)r * n, weight, out + (size_t)r * n, n, eps);
        else norm<float>(x + (size_t)r * n, weight, out + (size_t)r * n, n, eps);
    }
}
