"""CPU speed: run linear layers on oneDNN-packed weights where that is faster, measured on this machine.

A stock float32 nn.Linear on CPU calls a BLAS GEMM that re-packs the weight matrix on every call; a weight
packed once for oneDNN skips that. Which is faster depends on the CPU and on the pass size: on an AMD EPYC
(AVX2) packed weights made one-token and verify passes of the bundled model ~1.4x faster; on an Intel Xeon
(AVX512) they made one-token passes ~25% slower and multi-token verify passes faster. A playground whose
baseline runs slower than it could overstates what speculation buys.

So each linear layer holds both forms at load, `choose_forms` times whole forward passes of the model in
each form at 1, 2, 3, 5, 9 and 17 rows, and every layer then runs the packed weight from the smallest pass
size from which packed wins at every size measured, the stock GEMM below it. A form that never runs is
freed; where both are kept and the second copy of the weights would take over a quarter of the free
memory, the form fastest for one-token passes (the baseline's) serves every pass. The choice is cached per
architecture and sizes (not path), dtype, CPU, thread count and torch version, so it is measured once.
Baseline and speculative runs use the same layers, so a pass of a given size runs the same form in both.

Within a form, a pass is not always cheaper for having fewer rows: on an AMD EPYC (AVX512) a two-row pass of
the bundled model took ~45 ms and a three-row pass ~40 ms, the same as one row (oneDNN picks its kernel by
row count). So `choose_forms` then times whole passes of every size from 1 to PAD_ROWS rows, and a pass
runs padded with zero rows up to the cheapest size at or above its own where that is clearly faster
(`pad`); the extra rows' outputs are dropped. The verify cost of a k-token draft is then never more than
that of a longer one, and the adaptive drafters see the true costs.

The weight is packed without a batch-size hint: packed for one row (hint 1), oneDNN ran 2-5-row passes
~1.5x slower than one row. Results match nn.Linear to float32 rounding (~1e-5).

The measurement must see what the runs will see. On an Intel Xeon with AMX the forms chosen at load lost to
stock layers in whole runs (ours / HF generate 0.85, with stock layers 1.01): the choice was timed on the
thread that loaded the model, while the runs went on another, and on 2 cores a thread's torch work runs up to
3x slower while another thread's OpenMP team is about (engine.worker); and packed weights won by any margin,
however thin. Now loading, timing and runs share the engine thread, each size is timed best of 5, and
packed weights and padding must each save more than 5% (FORM_GAIN, PAD_GAIN). Measured there with this rule
(best of 5, ms): one-token pass 35.5 stock / 45 packed, five rows 57 / 52-57, seventeen 74-78 / 68-75, so
stock layers serve passes below 6 rows there and nothing is padded (a 2-row pass costs 14% more than one row).

SPECARENA_CPU_PACK: auto (default) measures; 1 packs every pass; 0 keeps stock layers. Float32 on CPU only;
any failure leaves the model as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import psutil
import torch

ROWS = (1, 2, 3, 5, 9, 17)  # pass sizes timed: a decode step, verify passes of 1-16 draft tokens
NEVER = 1 << 30  # min_rows that no pass reaches: the layer stays stock
PAD_ROWS = 17  # passes of up to this many rows may run padded to a cheaper size
PAD_GAIN = 0.05  # padding must save this share of the pass, more than the timing noise
FORM_GAIN = 0.05  # packed weights must save this share of a pass at every size they serve; else stock layers
FORMS_VERSION = 3  # cached choices of an older version are measured again (3: the margin above, engine thread)


class PackedLinear(torch.nn.Module):
    """Inference-only stand-in for nn.Linear: the oneDNN-packed weight for passes of at least `min_rows`
    rows, the stock weight below that. Whichever form no pass uses is dropped (`keep_only`)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)  # no batch hint: see above
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.min_rows = 1
        self.pad: tuple[int, ...] = ()  # pad[n]: the rows a pass of n rows runs as (shared by every layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows < len(self.pad) and self.pad[rows] > rows:
            flat = torch.cat([flat, flat.new_zeros(self.pad[rows] - rows, self.in_features)])
        if flat.shape[0] >= self.min_rows:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        else:
            out = torch.nn.functional.linear(flat, self.weight, self.bias)
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def keep_only(self, min_rows: int) -> None:
        self.min_rows = min_rows
        if min_rows <= 1:
            self.weight = None  # packed serves every pass
        elif min_rows >= NEVER:
            self.packed = None  # stock serves every pass


def mode() -> str:
    return os.environ.get("SPECARENA_CPU_PACK", "auto")


def enabled(model: torch.nn.Module) -> bool:
    param = next(model.parameters())
    return (
        mode() != "0"
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: torch.nn.Module) -> list[PackedLinear]:
    """Swap every nn.Linear for a PackedLinear holding both forms, in place; [] where packing is not used."""
    if not enabled(model):
        return []
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]  # fmt: skip
    try:
        packed = [(parent, name, PackedLinear(child)) for parent, name, child in targets]
        probe = packed[0][2] if packed else None
        if probe is not None:
            probe(torch.zeros(2, probe.in_features))
    except (RuntimeError, AttributeError):
        return []
    for parent, name, module in packed:
        setattr(parent, name, module)
    return [module for _, _, module in packed]


def _cpuinfo_field(field: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (avx2, avx512f, amx_tile, ...)."""
    return set(_cpuinfo_field("flags").split())


def cpu_name() -> str:
    """The CPU as people name it, with its widest vector instructions: "AMD EPYC" alone has named both an
    AVX2 and an AVX512 machine here, and they pick different linear forms."""
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    flags = cpu_flags()
    isa = [label for flag, label in (("avx512f", "AVX512"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))
           if flag in flags] or (["AVX2"] if "avx2" in flags else [])  # fmt: skip
    return f"{name} ({', '.join(isa)})" if isa else name


def cpu_id() -> str:
    """A key for what is measured or compiled for this CPU: its name and a digest of every feature flag
    (a binary built with -march=native on one may not even start on another of the same name)."""
    digest = hashlib.sha1(_cpuinfo_field("flags").encode()).hexdigest()[:8]
    return f"{cpu_name()} {digest}"


def shape_key(model) -> str:
    """What pass timings depend on: the architecture and its sizes, not where the weights came from. The same
    model from another folder or revision, or a test's fresh random model, recalls the same choice."""
    cfg = model.config.get_text_config()
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size")  # fmt: skip
    return f"{type(model).__name__} " + "/".join(str(getattr(cfg, name, "-")) for name in names)


def _decide(stock: dict[int, float], packed: dict[int, float]) -> int:
    """The smallest measured pass size from which packed wins by more than FORM_GAIN at every larger size; NEVER
    if it never does. Stock layers are what Hugging Face runs: a form chosen on a margin inside the timing noise
    can only lose to them in whole runs."""
    min_rows = NEVER
    for n in sorted(stock, reverse=True):
        if packed[n] >= (1 - FORM_GAIN) * stock[n]:
            break
        min_rows = n
    return min_rows


def _pad_table(times: dict[int, float]) -> tuple[int, ...]:
    """pad[n]: the cheapest measured size at or above n, where it saves more than PAD_GAIN of n's time;
    else n itself. () when no size is padded."""
    pad = [0]
    for n in sorted(times):
        cheapest = min((m for m in times if m >= n), key=times.__getitem__)
        pad.append(cheapest if times[cheapest] < (1 - PAD_GAIN) * times[n] else n)
    return tuple(pad) if any(m != n for n, m in enumerate(pad)) else ()


def describe(min_rows: int, pad: tuple[int, ...] = ()) -> str:
    if min_rows <= 1:
        text = "oneDNN-packed for every pass"
    elif min_rows >= NEVER:
        text = "stock nn.Linear for every pass"
    else:
        text = f"stock nn.Linear below {min_rows} rows, oneDNN-packed from {min_rows}"
    padded = [f"{n} as {m}" for n, m in enumerate(pad) if m != n]
    return text + (f"; passes of {', '.join(padded)} rows (cheaper)" if padded else "")


def choose_forms(model, layers: list[PackedLinear], key: str, cache_file: Path) -> dict:
    """Measure (or recall) which form is faster for which pass size, and which pass sizes run padded, and
    keep only what is used. Returns {"min_rows", "pad", "linear_forms", "measured"}: the pass size from
    which packed weights run, the padding table, both in words, and the timings behind them (None when
    recalled from the cache)."""
    if not layers:
        return {"min_rows": None, "pad": (), "linear_forms": "stock nn.Linear (not packed here)", "measured": None}
    key = f"{key}|{cpu_id()}|{torch.get_num_threads()} threads|torch {torch.__version__}|forms v{FORMS_VERSION}"
    from engine.decoding.runtime import time_passes

    known = _read(cache_file)
    measured = None
    if mode() == "1":
        min_rows, pad = 1, ()
    elif key in known:
        min_rows, pad = known[key]["min_rows"], tuple(known[key]["pad"])
    else:
        with torch.inference_mode():
            for layer in layers:
                layer.min_rows = NEVER
            stock = time_passes(model, ROWS, repeats=5)
            for layer in layers:
                layer.min_rows = 1
            packed = time_passes(model, ROWS, repeats=5)
            min_rows = _decide(stock, packed)
            if 1 < min_rows < NEVER and _second_copy_too_big(layers):
                min_rows = 1 if packed[1] < stock[1] else NEVER  # one form only: the baseline's fastest
            for layer in layers:
                layer.min_rows = min_rows
            each = time_passes(model, tuple(range(1, PAD_ROWS + 1)), repeats=5)
        pad = _pad_table(each)
        measured = {"stock_s": stock, "packed_s": packed, "rows_s": each}
        entry = {"min_rows": min_rows, "pad": list(pad)}
        _write(cache_file, dict(list(known.items())[-255:]) | {key: entry})  # the latest 256 choices
    for layer in layers:
        layer.keep_only(min_rows)
        layer.pad = pad
    return {"min_rows": min_rows, "pad": pad, "linear_forms": describe(min_rows, pad), "measured": measured}


def _second_copy_too_big(layers: list[PackedLinear]) -> bool:
    extra = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    return extra > 0.25 * psutil.virtual_memory().available


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a measurement per load
