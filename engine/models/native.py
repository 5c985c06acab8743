"""A linear-layer kernel of our own for the few rows of a decode or verify pass, compiled for this CPU at first use.

At batch 1 a pass reads every weight once and does two flops per weight, so its linear layers should run at the
speed memory reads the weights. The BLAS kernels torch and numpy call are built for large products: on a 2-core AMD
EPYC (AVX512, BF16) whose memory reads 35 GB/s, none of them reached 20 GB/s of the bundled model's weights at 1-8
rows (docs/performance.md). kernels/rows.cpp reads each weight once for all the rows of a pass, from a packed copy
that puts a tile's outputs side by side in vector lanes and streams a thread's tiles in order, so no horizontal sum
is needed; and every output's sum runs over k in the same order whatever the number of rows, so a verify pass of k
rows rounds exactly like k one-token passes (the baseline).

It is compiled once per CPU (-march=native: a binary built on one CPU kind may not start on another) and source, with
the C++ compiler there is (CXX, else g++ or c++), into the cache folder; where no compiler is present or the build
fails, the kernel is simply not among the forms engine.models.cpu chooses from, and `status()` says why. The library
links the OpenMP runtime torch has loaded (libgomp.so.1), so its threads are torch's.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import mmap
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from engine.models import cpuinfo

KERNELS = Path(__file__).with_name("kernels")
SOURCES = [KERNELS / "rows.cpp", KERNELS / "layers.cpp"]  # one library; both include rows.h
PROBE = KERNELS / "amx_probe.cpp"  # whether AMX tiles work in a process here (amx_works)
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-strict-aliasing", "-fopenmp", "-shared", "-fPIC",
         "-std=c++17"]  # fmt: skip
# the weight stream's prefetch hint (kernels/rows.h) per CPU vendor, as measured over the bundled model's weights at
# one row: non-temporal on the AMD EPYC (29-31 GB/s where memory read 35; 25 with no prefetch), locality 1 on the
# Intel Xeon (27 GB/s where memory read 28; 11 non-temporal, 22 with no prefetch). SPECARENA_PREFETCH=0..3 sets it.
LOCALITY = {"AuthenticAMD": 0}  # any other vendor: 1
# where bfloat16 weights are summed in pairs by AVX512_BF16's vdpbf16ps (kernels/rows.h, tile_pairs), per CPU vendor:
# on the AMD EPYC (AVX512, BF16) a fused verify pass of 5 rows of the bundled model took 9.8 ms so against 10.6
# widening each weight to float32 (6 rows 10.2 / 11.9), one row within 2%. On the Intel Xeon (AMX) an earlier build
# (its inputs packed in scalar code at every call) bought nothing, and the vector-packed one does not either (5 rows
# 11.4 ms against 10.9 widening). SPECARENA_BF16_PAIRS=0 or 1 sets it.
BF16_PAIRS = {"AuthenticAMD"}
# Where the CPU has AMX, bfloat16 products run on its tiles (kernels/rows.h, tiles_amx) whatever BF16_PAIRS says: on
# the 2-core Intel Xeon (AMX), in turns, a fused 5-row verify pass of the bundled model took 9.8 ms against 10.9
# widening, 8 rows 10.8 against 17.2, one row the same. SPECARENA_AMX=0 leaves them out.
BUILD_TIMEOUT = 300  # seconds; a 2-core machine under load takes a few

_loaded: dict[str, object] = {}  # "lib": the ctypes library or None, "why": the reason when None


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def flags() -> list[str]:
    """The compiler's flags: FLAGS, the prefetch locality for this CPU's vendor (LOCALITY), whether its bfloat16
    products sum pairs (BF16_PAIRS; only where the CPU has AVX512_BF16) and whether AMX tiles may sum them (where
    -march=native finds AMX, unless SPECARENA_AMX=0)."""
    vendor = cpuinfo.field("vendor_id")
    locality = os.environ.get("SPECARENA_PREFETCH", "")
    if locality not in ("0", "1", "2", "3"):
        locality = LOCALITY.get(vendor, 1)
    pairs = os.environ.get("SPECARENA_BF16_PAIRS", "")
    if pairs not in ("0", "1"):
        pairs = "1" if vendor in BF16_PAIRS else "0"
    amx = os.environ.get("SPECARENA_AMX", "")
    if amx not in ("0", "1"):
        amx = "1" if amx_works() else "0"
    amx = [] if amx == "1" else ["-DNO_AMX"]
    return [*FLAGS, f"-DPREFETCH_LOCALITY={locality}", *(["-DNO_K_PAIRS"] if pairs == "0" else []), *amx]


def amx_works() -> bool:
    """Whether AMX tiles work in a process on this machine: False where the CPU has none; else the probe
    (kernels/amx_probe.cpp) built and run in a process of its own, once per CPU and compiler, its answer kept in the
    cache folder. llama.cpp's AMX kernels died (SIGILL, SIGSEGV) on Xeons with AMX seen here; where the probe fails
    so, the kernel is built without the tiles rather than take the app down with it."""
    if "amx_bf16" not in cpuinfo.flags():
        return False
    if "amx" in _loaded:
        return bool(_loaded["amx"])
    from engine.settings import cache_dir

    cxx = compiler()
    if cxx is None:
        return False
    texts = [PROBE.read_text(), (KERNELS / "rows.h").read_text(), cxx, cpuinfo.field("model name"),
             cpuinfo.field("flags")]  # fmt: skip
    digest = hashlib.sha1("\n".join(texts).encode())
    answer = cache_dir() / "kernels" / f"amx-probe-{digest.hexdigest()[:12]}.txt"
    if not answer.is_file():
        answer.parent.mkdir(parents=True, exist_ok=True)
        probe = answer.with_suffix(f".{os.getpid()}.bin")
        try:
            built = subprocess.run([cxx, "-O1", "-march=native", "-std=c++17", str(PROBE), "-o", str(probe)],
                                   capture_output=True, timeout=BUILD_TIMEOUT)  # fmt: skip
            ran = subprocess.run([str(probe)], capture_output=True, timeout=60) if not built.returncode else None
            works = ran is not None and ran.returncode == 0
        except (OSError, subprocess.SubprocessError):
            works = False
        finally:
            probe.unlink(missing_ok=True)
        answer.write_text("works\n" if works else "fails\n")
    _loaded["amx"] = answer.read_text().strip() == "works"
    return bool(_loaded["amx"])


def _library_path(cxx: str, cpu: str) -> Path:
    from engine.settings import cache_dir

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    texts = [path.read_text() for path in sorted(KERNELS.iterdir())]
    digest = hashlib.sha1("\n".join([*texts, " ".join(flags()), version, cpu]).encode()).hexdigest()
    return cache_dir() / "kernels" / f"rows-{digest[:12]}.so"


def build(cxx: str, cpu: str) -> Path:
    """The compiled library for this CPU (`cpu`: engine.models.cpu.cpu_id(), its name and feature flags), built now
    unless the cache has it (one build at a time across processes)."""
    path = _library_path(cxx, cpu)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.so")
            done = subprocess.run([cxx, *flags(), *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT)  # fmt: skip
            if done.returncode:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-400:]}")
            os.replace(tmp, path)
    return path


def library(cpu: str):
    """The kernel's ctypes library for this CPU (`cpu`: engine.models.cpu.cpu_id()), built or recalled once per
    process; None where it cannot be (`status()` says why). SPECARENA_OWN_KERNEL=0 turns it off."""
    if "lib" in _loaded:
        return _loaded["lib"]
    lib, why, name = None, "", ""
    cxx = compiler()
    if os.environ.get("SPECARENA_OWN_KERNEL", "1") == "0":
        why = "turned off (SPECARENA_OWN_KERNEL=0)"
    elif cxx is None:
        why = "no C++ compiler (install g++ to have it built)"
    else:
        try:
            path = build(cxx, cpu)
            lib, name = ctypes.CDLL(str(path)), path.stem
            for kernel in (lib.rows_f32, lib.rows_bf16):
                kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
                kernel.restype = None
            lib.rows_lanes.restype = lib.rows_pairs.restype = lib.rows_depth.restype = ctypes.c_int
            lib.rows_tiles.restype = ctypes.c_int
            for kernel in (lib.layers_f32, lib.layers_bf16):
                kernel.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4 + [
                    ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3  # fmt: skip
                kernel.restype = None
            lib.norm_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int]
            lib.norm_rows.restype = None
            lib.rows_prefetch.argtypes = [ctypes.c_uint32] * 2
            lib.rows_prefetch.restype = None
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            lib, why = None, f"not built: {error}"
    _loaded.update(lib=lib, why=why, name=name)
    if lib is not None:
        prefetch = choose_prefetch(lib, f"{cpu}|{torch.get_num_threads()} threads|{name}")
        lib.rows_prefetch(prefetch_bits(prefetch["float32"]), prefetch_bits(prefetch["bfloat16"]))
        _loaded["prefetch"] = prefetch
    return lib


# Whether a product prefetches its weight's lines in software or leaves them to the hardware prefetchers, per weight
# type and rows (kernels/rows.h, prefetch_rows): neither wins everywhere. On the AMD EPYC (AVX2) a float32 one-token
# pass of the bundled model ran 10-14% faster without (15.6-16.3 ms against 17.9; 13.6-13.9 against 15.8), its 5-row
# verify pass 9% slower and every bfloat16 pass 3-20% slower (the variants in turns, in one process); on the AMD EPYC
# (AVX512, BF16) and the Intel Xeon (AMX) one-row products had read ~20% slower without. So it is measured once per CPU,
# thread count and build, over a stream of weights far larger than the caches (PREFETCH_BYTES of float32, half that
# of bfloat16), every size with and without in turns, and kept in the cache folder. SPECARENA_PREFETCH_ROWS=1 (always)
# or 0 (never) sets it instead.
PREFETCH_ROWS = tuple(range(1, 9))  # the sizes timed; 8's answer stands for every larger product
PREFETCH_GAIN = 0.03  # leaving prefetches out must save this share of a product's time (prefetching is the default)
PREFETCH_BYTES = 256 << 20
PREFETCH_SHAPE = (3072, 576)  # the weights of the stream (a layer's gate and up joined, in the bundled model)


def prefetch_bits(prefetched: list[bool]) -> int:
    """kernels/rows.h's bits for a list of whether products of 1, 2, ... rows prefetch (the last for all after)."""
    bits = sum(1 << i for i, on in enumerate(prefetched) if on)
    return bits | (((1 << 32) - (1 << len(prefetched))) if prefetched[-1] else 0)


def choose_prefetch(lib, key: str) -> dict:
    """{"float32": [...], "bfloat16": [...]}: whether products of 1..8 rows prefetch their weights (the last for
    larger ones too): SPECARENA_PREFETCH_ROWS, else recalled from the cache folder, else measured (`time_prefetch`,
    about a second) and kept there. Prefetching is left out at a size where that saved PREFETCH_GAIN in the timing
    and again in a second one of the sizes it did (once, a single timing left it out at 4 and 7 rows but not 5 or 6).
    "measured": the timings where measured now, the second look's under "again"."""
    forced = os.environ.get("SPECARENA_PREFETCH_ROWS", "")
    if forced in ("0", "1"):
        return {name: [forced == "1"] * len(PREFETCH_ROWS) for name in ("float32", "bfloat16")}
    from engine.settings import cache_dir, read_kept, write_kept

    path = cache_dir() / "prefetch.json"
    known = read_kept(path)
    if key in known:
        return known[key]
    def saved(by: dict, n: int) -> bool:  # leaving prefetches out saved PREFETCH_GAIN at n rows
        return by[False][n] < (1 - PREFETCH_GAIN) * by[True][n]

    times = time_prefetch(lib)
    sizes = tuple(n for n in PREFETCH_ROWS if any(saved(by, n) for by in times.values()))
    again = time_prefetch(lib, sizes) if sizes else {}
    choice = {name: [not (n in sizes and saved(by, n) and saved(again[name], n)) for n in PREFETCH_ROWS]
              for name, by in times.items()}  # fmt: skip
    write_kept(path, dict(list(known.items())[-63:]) | {key: choice})
    return choice | {"measured": times | {"again": again}}


def time_prefetch(lib, sizes: tuple[int, ...] = PREFETCH_ROWS, repeats: int = 7) -> dict:
    """{"float32" | "bfloat16": {prefetched: {rows: seconds}}}: a stream of PREFETCH_SHAPE weights (random bits of
    no consequence: the products' speed does not depend on the values) through the kernel at each of `sizes` rows,
    with and without prefetching in turns, best of `repeats` after a warm-up round. The prefetch bits are left all
    on."""
    threads, (out, k) = torch.get_num_threads(), PREFETCH_SHAPE
    blocks = tile_blocks(out, lib.rows_lanes(), threads)
    times = {}
    for dtype, kernel in ((torch.float32, lib.rows_f32), (torch.bfloat16, lib.rows_bf16)):
        count = PREFETCH_BYTES // 4 // (out * k)  # as many weights in either type: the bfloat16 stream is half as long
        stream = huge_empty((count, out * k), dtype)
        stream = torch.empty(count, out * k, dtype=dtype) if stream is None else stream
        stream.fill_(0.01)
        x, y = torch.full((max(PREFETCH_ROWS), k), 0.01, dtype=dtype), torch.empty(max(PREFETCH_ROWS), out, dtype=dtype)
        best = {on: dict.fromkeys(sizes, float("inf")) for on in (True, False)}
        for round_ in range(repeats + 1):
            for rows in sizes:
                for on in (True, False):
                    lib.rows_prefetch(*[(1 << 32) - 1 if on else 0] * 2)
                    start = time.perf_counter()
                    for weight in stream:
                        kernel(x.data_ptr(), weight.data_ptr(), None, y.data_ptr(), rows, k, out, blocks, threads)
                    took = time.perf_counter() - start
                    if round_:
                        best[on][rows] = min(best[on][rows], took)
        times[str(dtype).removeprefix("torch.")] = best
        del stream
    lib.rows_prefetch((1 << 32) - 1, (1 << 32) - 1)
    return times


def prefetch_words(dtype: torch.dtype) -> str:
    """Where products of `dtype` weights leave the prefetching to the hardware, in words ("" where none does, or the
    kernel is not built): "float32 products of 1 row leave prefetching to the hardware"."""
    name = str(dtype).removeprefix("torch.")
    off = [n for n, on in zip(PREFETCH_ROWS, prefetching().get(name, [])) if not on]
    if not off:
        return ""
    runs: list[list[int]] = []
    for n in off:  # stretches of consecutive sizes
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    words = [f"{r[0]}" + (f"-{r[-1]}" if len(r) > 1 else "") for r in runs]
    if off == list(PREFETCH_ROWS):
        return f"every {name} product leaves prefetching to the hardware"
    if off[-1] == PREFETCH_ROWS[-1]:
        words[-1] = f"{runs[-1][0]} or more"
    plural = len(off) > 1 or off[-1] == PREFETCH_ROWS[-1]
    return f"{name} products of {', '.join(words)} row{'s' if plural else ''} leave prefetching to the hardware"


def prefetching() -> dict:
    """What the built kernel prefetches: {"float32": [...], "bfloat16": [...]} for products of 1..8 rows (8: and
    more), {} where it is not built."""
    return {name: list(on) for name, on in _loaded.get("prefetch", {}).items() if name != "measured"}


def version() -> str:
    """The built kernel's name ("rows-<digest of its source, flags, compiler and CPU>"), "" where there is none: a
    choice of forms timed with one build is not recalled for another (engine.models.cpu)."""
    return str(_loaded.get("name", ""))


def sixteen() -> str:
    """How the built kernel sums bfloat16 weights, in words ("" where it is not built): the page's and bench's
    "measured with" line says it, since the three ways round differently and run at different speeds."""
    lib = _loaded.get("lib")
    if lib is None:
        return ""
    if lib.rows_tiles():
        return "on AMX tiles"
    return "summed in pairs by vdpbf16ps" if lib.rows_pairs() else "widened to float32"


def status() -> str:
    """"built for this CPU", or why the kernel is not available (once `library` has been asked)."""
    if "lib" not in _loaded:
        return "not asked for yet"
    return "built for this CPU" if _loaded["lib"] is not None else str(_loaded["why"])


DTYPES = (torch.float32, torch.bfloat16)  # the weights the kernel reads (bfloat16: summed in float32, see rows.cpp)


def tile_blocks(outputs: int, lanes: int, threads: int) -> int:
    """Vectors per tile (4, 2 or 1) for a layer of `outputs` outputs: 4 where there are many outputs, fewer where that
    leaves a thread idle; and among those, the widest whose tiles share out evenly among the threads. With 2 threads, a
    576-output layer in 9 tiles of 64 ran one thread 5 tiles and the other 4 (the down projection: 3.5 MB of each
    layer's 14 MB), where 18 tiles of 32 give each 9."""
    widest = 4 if outputs >= 32 * lanes else 2 if outputs >= 16 * lanes else 1
    if lanes == 8:  # AVX2's 16 registers hold 3 rows' sums of a 4-vector tile (kernels/rows.h, rows_at_once), 5 of a
        # 2-vector one: on the AVX2 EPYC 4-vector tiles took a 5-row verify pass to 1.55 one-token passes in float32
        # (the tile's second block of rows cost as much as its first), 2-vector ones 1.05-1.20, one row the same
        widest = min(widest, 2)
    candidates = [blocks for blocks in (4, 2, 1) if blocks <= widest]

    def uneven(blocks: int) -> float:  # the busiest thread's tiles over an even share
        tiles = -(-outputs // (blocks * lanes))
        return -(-tiles // threads) * threads / tiles

    return min(candidates, key=lambda blocks: (round(uneven(blocks), 3), -blocks))


class Rows:
    """One weight [out, in] (and bias) packed for the kernel: tiles of `blocks` vectors of outputs, zero-padded to
    whole tiles. `blocks` is 4 for layers with many outputs and fewer where that would leave a thread idle. Float32 or
    bfloat16 (DTYPES); the bias is kept in float32, where the sums are made. `weight` is [tiles, in, width], or, for
    bfloat16 where the kernel sums pairs (`pairs`: native.flags), [tiles, in / 2, width, 2], `in` padded with zeros to a
    multiple of the library's `rows_depth()` (2, or 32 for AMX tiles)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib):
        self.lib = lib
        self.kernel = lib.rows_bf16 if weight.dtype == torch.bfloat16 else lib.rows_f32
        self.weight_dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        lanes = lib.rows_lanes()
        self.blocks = tile_blocks(self.out_features, lanes, torch.get_num_threads())
        width = self.blocks * lanes
        tiles = -(-self.out_features // width)
        padded = weight.new_zeros(tiles * width, self.in_features)
        padded[: self.out_features] = weight
        self.pairs = weight.dtype == torch.bfloat16 and bool(lib.rows_pairs())
        if self.pairs:  # [tiles, k / 2, width, 2]: a lane's pair of weights along k side by side (rows.h, tile_pairs)
            depth = lib.rows_depth()  # k padded with zeros to a multiple of 2, or of 32 for AMX tiles
            padded = torch.nn.functional.pad(padded, (0, -self.in_features % depth))
            self.weight = padded.reshape(tiles, width, -1, 2).transpose(1, 2).contiguous()
        else:
            self.weight = self._paired(padded.reshape(tiles, width, self.in_features)).transpose(1, 2).contiguous()
        self.weight = on_huge_pages(self.weight)
        self.bias = None
        if bias is not None:
            self.bias = bias.new_zeros(tiles * width, dtype=torch.float32)
            self.bias[: self.out_features] = bias

    def _paired(self, tiles: torch.Tensor, undo: bool = False) -> torch.Tensor:
        """[tiles, width, in] with a bfloat16 tile's vectors interleaved in pairs, as rows.cpp reads them (one 32-bit
        lane: output m of a vector in its low half, of the next vector in its high half), or back (`undo`); other
        tiles as they are."""
        if self.weight_dtype != torch.bfloat16 or self.blocks % 2 or self.pairs:
            return tiles
        count, width, k = tiles.shape
        lanes = width // self.blocks
        split = (lanes, 2) if undo else (2, lanes)
        return tiles.reshape(count, self.blocks // 2, *split, k).transpose(2, 3).reshape(count, width, k)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight [out, in] as it was given and the bias in float32 (copies)."""
        tiles, width = self.weight.shape[0], self.weight.shape[2]
        if self.pairs:
            weight = self.weight.transpose(1, 2).reshape(tiles * width, -1)[:, : self.in_features]
        else:
            weight = self._paired(self.weight.transpose(1, 2), undo=True).reshape(tiles * width, self.in_features)
        bias = None if self.bias is None else self.bias[: self.out_features].clone()
        return weight[: self.out_features].contiguous(), bias

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        flat = x.reshape(rows, self.in_features).to(self.weight.dtype).contiguous()
        out = flat.new_empty(rows, self.out_features)
        bias = None if self.bias is None else self.bias.data_ptr()
        self.kernel(flat.data_ptr(), self.weight.data_ptr(), bias, out.data_ptr(), rows, self.in_features,
                    self.out_features, self.blocks, torch.get_num_threads())  # fmt: skip
        return out.reshape(*x.shape[:-1], self.out_features)


HUGE = 2 << 20  # a transparent huge page on x86-64


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` (contiguous) in 2 MB-aligned memory that Linux is asked to back with huge pages (`huge_empty`),
    or `t` itself where that cannot be had. The kernel streams each packed weight once per pass, and on 4 KB pages the
    hardware prefetchers stop at every page: on the AMD EPYC (AVX512, BF16) a one-row product over a 113 MB bfloat16
    weight read 26-29 GB/s from huge pages against 20-24 from 4 KB pages, in turns in one process."""
    out = huge_empty(t.shape, t.dtype)
    return t if out is None else out.copy_(t)


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised contiguous CPU tensor in 2 MB-aligned memory that Linux is asked to back with huge pages
    (madvise MADV_HUGEPAGE: honoured where transparent huge pages are "always" or "madvise"), or None where that
    cannot be had: under 2 MB, off Linux, SPECARENA_HUGE_PAGES=0. Only whole 2 MB stretches get huge pages (a tail
    stays on 4 KB ones), so no memory is added; the extra 2 MB mapped for the alignment is never touched."""
    item = torch.empty(0, dtype=dtype).element_size()
    size = torch.Size(shape).numel() * item
    if size < HUGE or not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("SPECARENA_HUGE_PAGES", "1") == "0":
        return None
    try:
        area = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    raw = torch.frombuffer(area, dtype=torch.uint8)  # its storage keeps the mapping alive
    start = -raw.data_ptr() % HUGE
    # set_, not a view of `raw`: a view holds its base, and settle (which re-points tensors) would leave the base
    # holding this mapping, as a view of views held the LM head's first copy (56 MB in bfloat16) after it moved
    return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), start // item, shape)


def settle(packed: list[Rows], chunk: int = 64 << 20) -> int:
    """Lay the weights of `packed` one after another on huge pages (`huge_empty`), in stretches of `chunk` bytes (a
    weight larger than that gets one of its own), and point each at its copy in place (`Tensor.set_`, so the CpuLinear
    forms that hold the same tensor follow); a joined weight brings its members' views along. Alone, a weight under 2
    MB gets no huge page (on_huge_pages), and a bfloat16 layer's q/k/v, o and down of the bundled model are each under
    2 MB: 70% of its bytes. A Stack settles its layers' weights before it takes their pointers. Returns the bytes moved
    (0 where huge pages cannot be had: SPECARENA_HUGE_PAGES=0, off Linux, under 2 MB in all); the old copies are freed
    as they are left."""
    shared: dict[int, list[torch.Tensor]] = {}
    for rows in packed:  # a joined weight brings its members' views (join)
        for t in [rows.weight] + [m.weight for m in getattr(rows, "members", ())]:
            shared.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    spans = []  # per storage: (its first byte the tensors read, the bytes from there to their last)
    for tensors in shared.values():
        low = min(t.storage_offset() * t.element_size() for t in tensors)
        spans.append((low, max((t.storage_offset() + t.numel()) * t.element_size() for t in tensors) - low))
    left = sum(-(-size // 64) * 64 for _, size in spans)
    area, used, moved = None, 0, 0
    for tensors, (low, size) in zip(shared.values(), spans):
        if area is None or used + size > area.numel():  # a stretch no longer than what is left to lay out (a copy
            # of the model, as the forge makes one, copies each stretch whole)
            area, used = huge_empty((max(size, min(chunk, left)),), torch.uint8), 0
            if area is None:  # under 2 MB left, or no huge pages here: the rest stays where it is
                return moved
        start = area.storage_offset() + used - low  # where the old storage's byte 0 would lie in the mapping
        with torch.inference_mode():  # weights made in inference mode may be changed in place only there
            whole = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            area[used : used + size].copy_(whole[low : low + size])
            for t in tensors:  # contiguous tensors of one dtype: the offsets are whole elements (64-byte steps)
                t.set_(area.untyped_storage(), (start + t.storage_offset() * t.element_size()) // t.element_size(),
                       t.shape, t.stride())  # fmt: skip
        step = -(-size // 64) * 64  # the next weight on a whole cache line
        used, left, moved = used + step, left - step, moved + size
    return moved


def join(members: list[Rows]) -> Rows | None:
    """One packed weight for layers that read the same input (a layer's q, k and v projections; gate and up): a pass
    makes one call instead of several, and each member keeps a view of its own tiles, so no memory is added. Each
    output's sum is the same as in its member alone, to the bit. None where the members cannot share tiles (outputs
    not a whole number of tiles, biases on some only, other input sizes)."""
    if len({m.in_features for m in members}) != 1 or len({m.bias is None for m in members}) != 1:
        return None
    parts = [m.unpacked() for m in members]
    bias = None if parts[0][1] is None else torch.cat([b for _, b in parts])
    joined = Rows(torch.cat([w for w, _ in parts]), bias, members[0].lib)
    width = joined.weight.shape[2]
    if any(m.out_features % width for m in members[:-1]):
        return None
    start = 0
    for m in members:  # each member now reads its tiles of the joined weight (and frees its own copy)
        tiles = -(-m.out_features // width)
        m.weight, m.blocks = joined.weight[start // width : start // width + tiles], joined.blocks
        m.bias = None if bias is None else joined.bias[start : start + tiles * width]
        start += m.out_features
    joined.sizes, joined.members = [m.out_features for m in members], members
    return joined


class _Layer(ctypes.Structure):  # kernels/layers.cpp's Layer
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + [
        field for name in ("qkv", "o", "gate_up", "down")
        for field in ((name, ctypes.c_void_p), (f"{name}_bias", ctypes.c_void_p), (f"{name}_nb", ctypes.c_int))
    ] + [("hidden_norm", ctypes.c_void_p), ("normed_residual", ctypes.c_int), ("q_norm", ctypes.c_void_p),
         ("k_norm", ctypes.c_void_p)]  # fmt: skip


class _Shape(ctypes.Structure):  # kernels/layers.cpp's Shape
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]  # fmt: skip


class _Final(ctypes.Structure):  # kernels/layers.cpp's Final
    _fields_ = [("norm", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("nb", ctypes.c_int),
                ("n", ctypes.c_int)]  # fmt: skip


class Final:
    """A draft head's final norm and LM head (packed: `Rows`) as the last steps of its layers' call (Stack.__call__):
    the norm's weight in float32 and the pointers, made once. The head's LM head must not be re-packed meanwhile."""

    def __init__(self, norm: torch.Tensor, head: Rows):
        self.norm, self.head = norm.detach().to(torch.float32).contiguous(), head
        bias = None if head.bias is None else head.bias.data_ptr()
        self.struct = _Final(self.norm.data_ptr(), head.weight.data_ptr(), bias, head.blocks, head.out_features)


class Stack:
    """A Llama-family decoder's layers as one call of kernels/layers.cpp (engine.decoding.lean's fused pass, a draft
    head's: engine.decoding.heads): each layer's norms (float32 copies) and its q/k/v, o, gate/up and down products
    packed for the kernel (`Rows`, q/k/v and gate/up joined), with the shapes. An EAGLE-3 head's first layer also
    gives its "hidden_norm" (its q/k/v read the token's embedding beside the normed state) and "normed_residual", a
    DFlash head's layers their per-head "q_norm" and "k_norm". Holds references to every tensor it points to. It lays
    the packed weights it is given on huge pages first (`settle`), which moves them: a stack made over weights another
    stack points to would leave that one pointing at freed memory (lean.join and Head.join replace theirs)."""

    def __init__(self, layers: list[dict], shape: dict, lib):
        self.dtype, self.lib = layers[0]["qkv"].weight_dtype, lib
        settle([layer[name] for layer in layers for name in ("qkv", "o", "gate_up", "down")])  # before the pointers
        self.kernel = lib.layers_bf16 if self.dtype == torch.bfloat16 else lib.layers_f32
        self.count, self.hidden, self.head_dim = len(layers), shape["hidden"], shape["head_dim"]
        self._kept = []
        self.layers = (_Layer * len(layers))()
        for out, layer in zip(self.layers, layers):
            norms = [layer[name].detach().to(torch.float32).contiguous() for name in ("input_norm", "post_norm")]
            self._kept += norms
            out.input_norm, out.post_norm = norms[0].data_ptr(), norms[1].data_ptr()
            for name in ("hidden_norm", "q_norm", "k_norm"):  # a head's, where it has them
                if layer.get(name) is not None:
                    self._kept.append(layer[name].detach().to(torch.float32).contiguous())
                    setattr(out, name, self._kept[-1].data_ptr())
            out.normed_residual = int(layer.get("normed_residual", False))
            for name in ("qkv", "o", "gate_up", "down"):
                rows = layer[name]
                setattr(out, name, rows.weight.data_ptr())
                setattr(out, f"{name}_bias", None if rows.bias is None else rows.bias.data_ptr())
                setattr(out, f"{name}_nb", rows.blocks)
                self._kept.append(rows)
        self.shape = _Shape(**shape)

    def __call__(self, x: torch.Tensor, first: int, last: int, past: int, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None, keys, values, capacity: int, embedded: torch.Tensor | None = None,
                 context: torch.Tensor | None = None, final: Final | None = None):
        """Run layers first..last-1 over x ([rows, hidden] float32, contiguous, written in place); cos and sin:
        [context rows + rows, head_dim] float32; mask: [rows, past + context rows + rows] uint8 or None (causal);
        keys, values: ctypes arrays of each layer's cache pointers ([kv heads, capacity, head_dim] of the model's
        dtype); embedded: [rows, hidden] float32, the rows' token embeddings, for a layer with a hidden_norm;
        context: [context rows, hidden] float32, a DFlash head's context rows (keys and values only, written first).
        final: a draft head's final norm and LM head, run after layer last - 1 in the same call: then returns (the
        normed rows, [rows, hidden] float32 holding values of the model's dtype; their logits, [rows, n] of the
        model's dtype), else None."""
        pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        rows, normed, logits = x.shape[0], None, None
        if final is not None:
            normed = torch.empty_like(x)
            logits = torch.empty(rows, final.head.out_features, dtype=self.dtype)
        self.kernel(self.layers, first, last, ctypes.byref(self.shape), x.data_ptr(), pointer(embedded),
                    pointer(context), 0 if context is None else context.shape[0], rows, past, cos.data_ptr(),
                    sin.data_ptr(), pointer(mask), keys, values, capacity, torch.get_num_threads(),
                    final and ctypes.byref(final.struct), pointer(normed), pointer(logits))  # fmt: skip
        return None if final is None else (normed, logits)

    @staticmethod
    def final(norm: torch.Tensor, head: Rows) -> Final:
        """A draft head's final norm and packed LM head, to be run at the end of its layers' call (`__call__`)."""
        return Final(norm, head)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """LlamaRMSNorm of x's rows ([rows, hidden] float32, contiguous) by `weight` (float32, contiguous), as the
        layers' norms compute it: float32 holding the model's dtype's values."""
        out = torch.empty_like(x)
        self.lib.norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                           int(self.dtype == torch.bfloat16))  # fmt: skip
        return out
