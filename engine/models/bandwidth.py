"""The machine's limit for decoding: how fast a one-token pass could be, and how close each kernel comes.

At batch 1 a decode step reads every weight once and does two flops per weight: on a CPU (and on a GPU) that is
bound by memory, not arithmetic. So tokens/s cannot exceed the memory's read bandwidth over the weights' bytes
per token (`bound`): the roofline of a one-token pass. A speedup measured over a baseline far below its bound
speaks of the baseline's kernels as much as of speculation, so the bound stands beside every figure (bench's
header, the Playground's "measured on" line) and `python -m engine roofline` (engine.measure.roofline) says what
each linear-layer kernel reaches on the model's own weight shapes (engine.models.cpu holds the kernels and chooses
among them).

The read bandwidth is a plain reduction (`sum`) over a buffer far larger than the caches, best of a few, on all of
the engine's threads: what the memory delivers to a kernel that does nothing else. It is measured at each model load
and the best ever seen per CPU (or GPU) and thread count is remembered in the cache folder.
"""

from __future__ import annotations

import time

import torch

BUFFER_BYTES = 512 * 2**20  # far beyond any CPU's caches, near a small model's weights
REPEATS = 5


def bytes_per_token(model) -> int:
    """Bytes of weights a one-token pass reads: every parameter once, but of an input embedding that is not also the
    output layer only one row. Call it on the model as loaded (before its linears change form)."""
    params = {p.data_ptr(): p for p in model.parameters()}  # tied weights once
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    if head is None or head.data_ptr() != embed.data_ptr():
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total


def _key(device: torch.device) -> str:
    from engine.models.cpu import cpu_id, device_name

    if device.type == "cpu":
        return f"{cpu_id()}|{torch.get_num_threads()} threads"
    return f"{device_name(device)}|{device}"


def measure_bandwidth(device: torch.device, size: int = BUFFER_BYTES) -> float:
    """Bytes per second that a reduction over `size` bytes reads on `device`, best of REPEATS after a warm-up. On a CPU
    the buffer lies on huge pages where Linux gives them, as our kernel's packed weights do (native.on_huge_pages), so
    the bound is read from the same kind of memory the passes read: on the AMD EPYC (AVX512, BF16) a product over huge
    pages passed the reduction over 4 KB pages (26-29 GB/s against 23-26, in turns), the reduction itself read about
    the same from either."""
    buffer = None
    if torch.device(device).type == "cpu":
        from engine.models.native import huge_empty

        buffer = huge_empty((size // 4,), torch.float32)  # filled once, not made on 4 KB pages and copied
    buffer = torch.ones(size // 4, dtype=torch.float32, device=device) if buffer is None else buffer.fill_(1.0)
    best = float("inf")
    for round_ in range(REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        buffer.sum().item()  # .item() waits for the device
        took = time.perf_counter() - start
        if round_:
            best = min(best, took)
    return size / best


_KNOWN: dict[str, float] = {}  # this process's recalls: a comparison's environment asks once per run


def read_bandwidth(device: torch.device | str = "cpu", measure: bool = False) -> float:
    """The device's read bandwidth in bytes per second, per CPU (or GPU) and thread count, kept in the cache folder as
    engine.models.cpu keeps its layout choices. `measure` (each model load: a fraction of a second) measures again and
    keeps the best ever seen: a first measurement beside other work once read 12.6 GB/s on a machine that reads 33."""
    from engine.settings import cache_dir, read_kept

    device = torch.device(device)
    key = _key(device)
    if measure:
        return keep_best(device, measure_bandwidth(device))
    if key not in _KNOWN:
        known = read_kept(cache_dir() / "bandwidth.json")
        if key not in known:
            return keep_best(device, measure_bandwidth(device))
        _KNOWN[key] = known[key]
    return _KNOWN[key]


def keep_best(device: torch.device | str, measured: float) -> float:
    """Keep a read of `measured` bytes per second among the device's reads (the best ever seen stays); returns it."""
    from engine.settings import cache_dir, read_kept, write_kept

    device = torch.device(device)
    key, path = _key(device), cache_dir() / "bandwidth.json"
    known = read_kept(path)
    best = max(known.get(key, 0.0), measured)
    if best != known.get(key):
        write_kept(path, known | {key: best})
    _KNOWN[key] = best
    return best


def bound(token_bytes: int, bandwidth: float) -> float:
    """The most tokens per second a one-token pass can decode: every weight read once per token."""
    return bandwidth / token_bytes if token_bytes else 0.0


def limit(token_bytes: int, device: torch.device | str) -> dict:
    """{"read_gbs", "token_mb", "bound_tok_s"}: the numbers that stand beside a measured tokens/s."""
    bandwidth = read_bandwidth(device)
    return {"read_gbs": round(bandwidth / 1e9, 1), "token_mb": round(token_bytes / 1e6, 1),
            "bound_tok_s": round(bound(token_bytes, bandwidth), 1)}  # fmt: skip


def words(env: dict) -> str:
    """The limit in words, or '' where it was not measured: "bound 56 tok/s (538 MB per token at 30.5 GB/s)"."""
    if not env.get("bound_tok_s"):
        return ""
    return f"bound {env['bound_tok_s']:.0f} tok/s ({env['token_mb']:.0f} MB per token at {env['read_gbs']:.1f} GB/s)"


def kernel_rates(model, rows=(1, 2, 3, 5, 8), repeats: int = 3,
                 reads: dict | None = None) -> dict[str, dict[int, float]]:  # fmt: skip
    """{kernel: {rows: GB/s}}: the weights' bytes over the time every linear layer of the model takes in that
    kernel, layer after layer as a pass meets them (engine.models.cpu's forms, each timed alone on copies made for
    the measurement: the model itself is left as it is). Float32 or bfloat16 on CPU; {} elsewhere. `reads`, where
    given, gets each kernel's read bandwidth beside it (bytes/s, the mean of a read just before and just after)."""
    from engine.models import cpu

    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
        return {}
    linears = [child for _, _, child in cpu._linears(model)]
    if not linears:
        return {}
    forms = cpu.measurable(param.dtype)  # copies made here, for the measurement
    layers = [cpu.CpuLinear(child, forms) for child in linears]
    by_shape: dict[str, list] = {}
    for layer in layers:
        by_shape.setdefault(layer.shape, []).append(layer)
    times = {shape: {} for shape in by_shape}
    with torch.inference_mode():  # one form after another, OpenBLAS last: its threads spin a while after it ran
        for form in sorted(forms, key=lambda form: form == "blas"):
            before = measure_bandwidth(param.device) if reads is not None else 0.0
            for shape, rates in cpu._time_shapes(by_shape, (form,), tuple(rows), repeats).items():
                times[shape] |= rates
            if reads is not None:
                reads[form] = (before + measure_bandwidth(param.device)) / 2
    weight_bytes = sum(child.weight.numel() * child.weight.element_size() for child in linears)
    return {form: {n: weight_bytes / sum(times[shape][form][n] for shape in times) / 1e9 for n in rows}
            for form in forms}  # fmt: skip

