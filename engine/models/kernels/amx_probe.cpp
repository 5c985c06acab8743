// Whether this process may use AMX tiles and they compute: asks Linux for the tiles' state and configures them as the
// kernel does (rows.h), multiplies one tile of bfloat16 ones by twos and checks the sums. Built and run once per CPU
// and compiler, in a process of its own, before the kernel is built to use the tiles (engine.models.native.amx_works):
// llama.cpp's AMX kernels died with SIGILL or SIGSEGV on Xeons with AMX seen here, and a kernel that dies takes the app
// with it. Exit status 0 where the tiles work.
#include "rows.h"

int main() {
#if AMX_TILES
    if (!amx_ready) return 2;  // Linux refused the tiles' state
    configure_tiles(5);        // 5 rows: sums in tile 0, inputs in 4, weights in 5
    static uint16_t a[5 * 32], b[16 * 32];
    static float sums[5 * 16];
    for (auto &v : a) v = 0x3f80;  // 1.0
    for (auto &v : b) v = 0x4000;  // 2.0
    _tile_zero(0);
    _tile_loadd(4, a, 64);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_stored(0, sums, 64);
    _tile_release();
    for (float s : sums)
        if (s != 64.0f) return 3;  // 32 products of 1 and 2
    return 0;
#else
    return 4;  // this compiler builds no AMX for this CPU
#endif
}
