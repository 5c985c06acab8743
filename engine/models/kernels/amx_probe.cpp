// Whether this process may use AMX tiles and they compute: asks Linux for the tiles' state, multiplies one tile of
// bfloat16 ones by twos and checks the sums. Built and run once per CPU, in a process of its own, before the kernel is
// built to use the tiles (engine.models.native.amx_works): llama.cpp's AMX kernels died with SIGILL or SIGSEGV on
// Xeons with AMX seen here, and a kernel that dies takes the app with it. Exit status 0 where the tiles work.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

int main() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 2;
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 3; t++) {
        c.rows[t] = t == 2 ? 16 : 5;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
    static uint16_t a[5 * 32], b[16 * 32];
    static float sums[5 * 16];
    for (auto &v : a) v = 0x3f80;  // 1.0
    for (auto &v : b) v = 0x4000;  // 2.0
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, sums, 64);
    _tile_release();
    for (float s : sums)
        if (s != 64.0f) return 3;  // 32 products of 1 and 2
    return 0;
}
