// One linear layer's product for the few rows of a pass (engine.models.native.Rows): the kernel is in rows.h.
#include <vector>

#include "rows.h"

extern "C" int rows_lanes() { return V; }

#if K_PAIRS
extern "C" int rows_pairs() { return 1; }  // bfloat16 weights packed in pairs along k (rows.h, tile_pairs)
#else
extern "C" int rows_pairs() { return 0; }
#endif
extern "C" int rows_depth() { return K_DEPTH; }  // a bfloat16 weight's k padded with zeros to a multiple of this

#if AMX_TILES
extern "C" int rows_tiles() { return amx_ready; }  // bfloat16 products summed by AMX tiles (rows.h, tiles_amx)
#else
extern "C" int rows_tiles() { return 0; }
#endif

// w packed by the caller as [tiles][k][nb * V] (outputs padded with zeros to whole tiles), b (float32) padded the same
extern "C" void rows_f32(const float *x, const float *w, const float *b, float *y, int rows, int k, int n, int nb,
                         int threads) {
#pragma omp parallel num_threads(threads)
    product(x, w, b, y, rows, k, n, nb);
}

extern "C" void rows_bf16(const bf16 *x, const bf16 *w, const float *b, bf16 *y, int rows, int k, int n, int nb,
                          int threads) {
    std::vector<float> wide((size_t)rows * k);  // the inputs widened once, not once per tile
    for (size_t i = 0; i < wide.size(); i++) wide[i] = widen(x[i]);
#pragma omp parallel num_threads(threads)
    product(wide.data(), w, b, y, rows, k, n, nb);
}

// which products prefetch their weight's lines (rows.h, prefetch_rows): bit r - 1 for r rows (bit 31: 32 or more)
extern "C" void rows_prefetch(uint32_t f32, uint32_t bf16) {
    prefetch_rows[0] = f32;
    prefetch_rows[1] = bf16;
}
