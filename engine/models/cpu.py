"""CPU speed: run each pass's linear layers on the weight layout that is fastest for its size, measured here.

A stock float32 nn.Linear on CPU computes x @ W.T: a BLAS GEMM that reads the weight transposed. Two other
layouts of the same weight compute the same product: "transposed", W.T stored contiguous once, so the GEMM
reads it in order; and "packed", the weight reordered once for oneDNN. Which is fastest depends on the CPU
and on the pass size. On an AMD EPYC (AVX2) packed weights made one-token and verify passes of the bundled
model ~1.4x faster; on an Intel Xeon (AVX512) they made one-token passes ~25% slower and verify passes
faster; on an Intel Xeon with AMX neither beat stock layers for one row, and transposed weights made passes
of 4-8 rows 10-12% cheaper (best of 5, ms: 4 rows 53.4 stock / 47.8 transposed / 51.4 packed, 5 rows 55.4 /
49.0 / 52.5, one row 34.8 / 33.9 / 44.0). A playground whose passes run slower than they could overstates
or understates what speculation buys.

So each linear layer holds the forms at load (a form whose copy would take over a quarter of the free memory
is not made), `choose_forms` times whole forward passes of the model in each form at every size from 1 to
PAD_ROWS rows, in turns, and each size then runs in the form that is fastest for it, if that form beats the
stock layers by more than FORM_GAIN: a win inside the timing noise can only lose to stock layers (what
Hugging Face runs) in whole runs. Passes longer than PAD_ROWS (a prompt) run in the form chosen for
PAD_ROWS. A form that no pass uses is freed. The choice is cached per architecture and sizes (not path),
dtype, CPU, thread count and torch version, so it is measured once.
Baseline and speculative runs use the same layers, so a pass of a given size runs the same form in both.

Within a form, a pass is not always cheaper for having fewer rows: on an AMD EPYC (AVX512) a two-row pass of
the bundled model took ~45 ms and a three-row pass ~40 ms, the same as one row (oneDNN picks its kernel by
row count). So a pass also runs padded with zero rows up to the cheapest size at or above its own where that
is clearly faster (`pad`, PAD_GAIN); the extra rows' outputs are dropped. The verify cost of a k-token draft
is then never more than that of a longer one, and the adaptive drafters see the true costs.

The weight is packed without a batch-size hint: packed for one row (hint 1), oneDNN ran 2-5-row passes
~1.5x slower than one row. Every form matches nn.Linear to float32 rounding (~1e-5).

The measurement must see what the runs will see. On the AMX Xeon the forms once chosen at load lost to
stock layers in whole runs (ours / HF generate 0.85, with stock layers 1.01): the choice was timed on the
thread that loaded the model, while the runs went on another, and on 2 cores a thread's torch work runs up to
3x slower while another thread's OpenMP team is about (engine.worker); and packed weights won by any margin,
however thin. Now loading, timing and runs share the engine thread, each size is timed best of 5 with the
forms taking turns, and a form and padding must each save more than 5%.

One form for every layer of a pass is not the best either: the layers' kernels change at different row counts. On the
AMX Xeon stock layers won every pass of 1-6 rows, yet from 4 rows the LM head (49152 x 576) ran 7.8 ms stock against
5.0 ms packed, and the 576 x 576 projections ran faster transposed. So after the table, each weight shape's layers
are timed alone, all of them in a row as a pass meets them (their weights out of the caches), at each size in each
form; a shape takes another form for a size where that saves FORM_GAIN of the shape's time, and the sizes where
whole passes then run faster than with the table (by GROUP_GAIN, timed in turns) keep it: 4-row passes of the bundled
model 1.45 one-token passes against 1.54, 9-row 1.71 against 1.80.

Bfloat16 weights choose between stock layers and our kernel (engine.models.native), which reads them as they are
and sums in float32: on CPU only, where the kernel is built.

SPECARENA_CPU_PACK: auto (default) measures; 1 packs every pass (float32); 0 keeps stock layers. Any failure leaves
the model as it was.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from engine.models import cpuinfo
from engine.settings import read_kept, write_kept

FORMS = ("stock", "transposed", "packed", "blas", "own")  # stock first: what a form must beat, and what HF runs
COPIES = ("own", "transposed", "packed")  # the forms that hold a copy of the weight (blas reads the stock one in
# place), in the order they are given memory
PAD_ROWS = 17  # pass sizes timed (a decode step, verify passes of 1-16 draft tokens); longer ones run as this
PAD_GAIN = 0.05  # padding must save this share of the pass, more than the timing noise
FORM_GAIN = 0.05  # a form must save this share of a pass over stock layers to serve it
GROUP_GAIN = 0.02  # forms per weight shape must save this share of a whole pass over the table's, timed in turns
# cached choices of an older version are measured again (4: the transposed form, per size; 5: timed in the lean
# forward pass where it runs, engine.decoding.lean; 6: padding kept only where a second timing agrees; 7: the lean
# pass's verify attention reads shared keys and values in place, which makes multi-row passes cheaper; 8: forms per
# weight shape; 9: numpy's OpenBLAS, the "blas" form; 10: our own kernel, engine.models.native; 11: OpenBLAS only where
# our kernel is not built, see available; 12: our kernel timed in the fused pass it runs in, see choose_forms)
FORMS_VERSION = 12


class CpuLinear(torch.nn.Module):
    """Inference-only stand-in for nn.Linear that holds the weight in several layouts (`FORMS`) and runs each
    pass in the one its size is given by `table` (table[n]: the form for a pass of n rows; longer passes take
    the last; each layer has its own, see `_measure`). Forms that no pass uses are dropped (`keep_only`)."""

    def __init__(self, linear: torch.nn.Linear, forms: tuple[str, ...] | None = None):
        super().__init__()
        forms = available(linear.weight.dtype) if forms is None else forms
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.weights = {"stock": weight}
        if "transposed" in forms:
            self.weights["transposed"] = weight.t().contiguous()
        if "packed" in forms:
            self.weights["packed"] = torch.ops.mkldnn._reorder_linear_weight(weight)  # no batch hint: see above
        self.bias = None if linear.bias is None else linear.bias.detach()
        if "blas" in forms:  # numpy views of the same memory: no copy
            self.weights["blas"] = weight
            self._blas = (weight.numpy(), None if self.bias is None else self.bias.numpy())
        self._own = None
        if "own" in forms:
            from engine.models import native

            self._own = native.Rows(weight, self.bias, native.library(cpu_id()))
            self.weights["own"] = self._own.weight
        self.table: tuple[str, ...] = ("stock",)
        self.pad: tuple[int, ...] = ()  # pad[n]: the rows a pass of n rows runs as (shared by every layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as lean as nn.Linear's own forward where the form is stock: a wrapper that cost a few microseconds more
        # per call made every one-token pass of the bundled model ~3% slower than Hugging Face's (211 calls)
        rows = x.numel() // self.in_features
        if rows < len(self.pad) and self.pad[rows] > rows:
            flat = torch.cat([x.reshape(rows, self.in_features), x.new_zeros(self.pad[rows] - rows, self.in_features)])
            return self._run(flat, self.pad[rows])[:rows].reshape(*x.shape[:-1], self.out_features)
        return self._run(x, rows)

    def form(self, rows: int) -> str:
        """The form a pass of `rows` rows runs this layer in (as the rows `pad` says it runs as)."""
        size = self.pad[rows] if rows < len(self.pad) else rows
        return self.table[min(size, len(self.table) - 1)]

    def _run(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        form = self.table[min(rows, len(self.table) - 1)]
        weight = self.weights[form]
        if form == "stock":
            return torch.nn.functional.linear(x, weight, self.bias)
        if form == "transposed":
            out = torch.matmul(x, weight)
            return out if self.bias is None else out.add_(self.bias)
        if form == "blas":
            return self._run_blas(x, rows)
        if form == "own":
            return self._run_own(x, rows)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    @torch.compiler.disable  # a ctypes call: compiled graphs break around it instead of tracing into it
    def _run_own(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return self._own(x, rows)

    @torch.compiler.disable  # numpy views: dynamo's guards on them fail (compiled pairs), so graphs break here
    def _run_blas(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """numpy's OpenBLAS on views of the same tensors: one row as a matrix-vector product (W @ x, reading W
        row by row, in order), more rows as x @ W.T."""
        weight, bias = self._blas
        flat = x.reshape(rows, self.in_features).numpy()
        out = np.matmul(weight, flat[0])[None] if rows == 1 else np.matmul(flat, weight.T)
        if bias is not None:
            out += bias
        return torch.from_numpy(out).reshape(*x.shape[:-1], self.out_features)

    def plain_weight(self) -> torch.Tensor:
        """The weight [out, in] as it was given, read back from whichever form is kept (a packed one by a product
        with the identity, which is exact; our kernel's tiles unpacked)."""
        forms = self.weights
        if "stock" in forms:
            return forms["stock"]
        if "blas" in forms:
            return forms["blas"]
        if "transposed" in forms:
            return forms["transposed"].t()
        if "own" in forms:
            return self._own.unpacked()[0]
        with torch.inference_mode():
            out = torch.ops.mkldnn._linear_pointwise(torch.eye(self.in_features), forms["packed"], None, "none", [], "")
        return out.t().contiguous()

    @property
    def shape(self) -> str:
        """The weight's shape, "out x in": the layers that share it run the same kernels."""
        return f"{self.out_features}x{self.in_features}"

    def use(self, table: tuple[str, ...]) -> None:
        self.table = table

    def keep_only(self, table: tuple[str, ...]) -> None:
        self.table = table
        self.weights = {form: w for form, w in self.weights.items() if form in used(table)}
        if "own" not in self.weights:
            self._own = None


class Joined:
    """Layers that read one input and all run our kernel, called as one (engine.models.native.join): the lean pass
    (engine.decoding.lean) makes a layer's q, k and v projections one call, and gate and up another."""

    def __init__(self, layers: list[CpuLinear], rows):
        self.lead, self.rows = layers[0], rows

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Each member's output (views of one tensor), or None where this pass's size runs another form."""
        n = x.numel() // self.lead.in_features
        if self.lead.form(n) != "own":  # our kernel's rows need no padding: same bits
            return None
        return self.rows(x, n).split(self.rows.sizes, -1)


def join(layers: list) -> Joined | None:
    """The layers as one call where all of them hold our kernel under one table (and can share its tiles), else None."""
    from engine.models import native

    if not all(type(layer) is CpuLinear and layer._own is not None for layer in layers):
        return None
    if len({(layer.table, layer.pad) for layer in layers}) != 1:
        return None
    rows = native.join([layer._own for layer in layers])
    if rows is None:
        return None
    for layer in layers:
        layer.weights["own"] = layer._own.weight  # a view of the joined weight now
    return Joined(layers, rows)


SIXTEEN = ("stock", "own")  # bfloat16 weights: torch's own layers or our kernel, which reads half the bytes


def available(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The forms the engine chooses among here: FORMS with our own kernel where it could be built (engine.models.native
    says why not), else with numpy's OpenBLAS in its place; for bfloat16 weights, SIXTEEN where our kernel is built
    (stock layers alone leave nothing to choose). Never OpenBLAS and our kernel both: OpenBLAS runs on a thread pool
    of its own that spins for a while after each product, beside torch's OpenMP team (which our kernel shares). On a
    2-core AMD EPYC (AVX512, BF16) passes timed with the forms taking turns then ran our kernel 1.6-1.8x slower than
    alone, and the timing at load chose oneDNN-packed layers (29 ms a one-token pass) over our kernel's (18 ms)."""
    if dtype == torch.bfloat16:
        return SIXTEEN if own_built() else ("stock",)
    return tuple(form for form in FORMS if form not in ("blas", "own") or (form == "own") == own_built())


def measurable(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """Every form that can run here, OpenBLAS included: what `python -m engine roofline` sets side by side."""
    if dtype == torch.bfloat16:
        return available(dtype)
    return tuple(form for form in FORMS if form != "own" or own_built())


def own_built() -> bool:
    from engine.models import native

    return native.library(cpu_id()) is not None


def used(table: tuple[str, ...]) -> set[str]:
    """The forms a table runs: table[0] stands for no pass (a pass has rows), unless it is the only entry."""
    return set(table[1:] or table)


def mode() -> str:
    return os.environ.get("SPECARENA_CPU_PACK", "auto")


def enabled(model: torch.nn.Module) -> bool:
    param = next(model.parameters())
    return (
        mode() != "0"
        and param.device.type == "cpu"
        and (param.dtype == torch.float32 or param.dtype == torch.bfloat16 and mode() != "1")
        and torch.backends.mkldnn.is_available()
    )


def _linears(model) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is torch.nn.Linear]  # fmt: skip


def fitting_forms(model) -> tuple[str, ...]:
    """The forms this model's linear layers can hold: stock, blas (no copy), and each form with a copy of the
    weights (on top of those before it) that stays within a quarter of the free memory; packed alone besides stock
    with SPECARENA_CPU_PACK=1; () where the forms are not used at all."""
    if not enabled(model):
        return ()
    if mode() == "1":
        return ("stock", "packed")
    copy_bytes = sum(child.weight.numel() * child.weight.element_size() for _, _, child in _linears(model))
    free = psutil.virtual_memory().available
    forms = available(next(model.parameters()).dtype)
    copies = [form for i, form in enumerate((f for f in COPIES if f in forms), 1) if i * copy_bytes <= 0.25 * free]
    return tuple(form for form in forms if form not in COPIES or form in copies)


def wrap_linears(model: torch.nn.Module, forms: tuple[str, ...]) -> list[CpuLinear]:
    """Swap every nn.Linear for a CpuLinear holding `forms`, in place; [] (the model as it was) where one
    cannot be made."""
    try:
        wrapped = [(parent, name, CpuLinear(child, forms)) for parent, name, child in _linears(model)]
        probe = wrapped[0][2] if wrapped else None
        for form in forms if probe is not None else ():
            probe.use((form,))
            probe(torch.zeros(2, probe.in_features, dtype=probe.weights["stock"].dtype))
    except (RuntimeError, AttributeError):
        return []
    for parent, name, module in wrapped:
        setattr(parent, name, module)
    return [module for _, _, module in wrapped]


def like_target(module: torch.nn.Module, target: torch.nn.Module, keep: tuple[str, ...] = ()) -> list[tuple]:
    """Give `module`'s linear layers (a draft head's) the forms the target's own layers run each pass size in: its
    table, timed for this CPU at load; layers named in `keep` stay as they are. Returns the swaps made, (parent,
    name, the nn.Linear, its CpuLinear) each, for `swap_back`: [] where the target keeps stock layers (another
    device, SPECARENA_CPU_PACK=0) or nothing was swapped."""
    lead = next((layer for layer in target.modules() if type(layer) is CpuLinear), None)
    if lead is None or used(lead.table) == {"stock"}:
        return []
    forms, dtype = tuple(dict.fromkeys(("stock", *used(lead.table)))), next(target.parameters()).dtype
    swaps = []
    for parent, name, child in _linears(module):
        if name not in keep and child.weight.dtype == dtype:
            layer = CpuLinear(child, forms)
            layer.keep_only(lead.table)
            swaps.append((parent, name, child, layer))
    swap_back(swaps, back=False)
    return swaps


def swap_back(swaps: list[tuple], back: bool = True) -> None:
    """Put like_target's swaps' nn.Linear layers back in place (or, `back=False`, their CpuLinear again)."""
    for parent, name, linear, wrapped in swaps:
        setattr(parent, name, linear if back else wrapped)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (avx2, avx512f, amx_tile, ...)."""
    return cpuinfo.flags()


def device_name(device) -> str:
    """What a run ran on, as people name it: the GPU's name for a CUDA device, else the CPU's (cpu_name)."""
    import torch

    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else cpu_name()


def cpu_name() -> str:
    """The CPU as people name it, with its widest vector instructions: "AMD EPYC" alone has named both an
    AVX2 and an AVX512 machine here, and they pick different linear forms."""
    name = cpuinfo.field("model name") or platform.processor() or platform.machine()
    flags = cpu_flags()
    isa = [label for flag, label in (("avx512f", "AVX512"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))
           if flag in flags] or (["AVX2"] if "avx2" in flags else [])  # fmt: skip
    return f"{name} ({', '.join(isa)})" if isa else name


def cpu_id() -> str:
    """A key for what is measured or compiled for this CPU: its name and a digest of every feature flag
    (a binary built with -march=native on one may not even start on another of the same name)."""
    digest = hashlib.sha1(cpuinfo.field("flags").encode()).hexdigest()[:8]
    return f"{cpu_name()} {digest}"


def shape_key(model) -> str:
    """What pass timings depend on: the architecture and its sizes, not where the weights came from. The same
    model from another folder or revision, or a test's fresh random model, recalls the same choice."""
    cfg = model.config.get_text_config()
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size")  # fmt: skip
    return f"{type(model).__name__} " + "/".join(str(getattr(cfg, name, "-")) for name in names)


def _choose(times: dict[str, dict[int, float]]) -> tuple[str, ...]:
    """table[n] for n = 0..PAD_ROWS: the form fastest for passes of n rows, where it beats stock layers by more
    than FORM_GAIN; else stock. Stock layers are what Hugging Face runs: a form chosen on a margin inside the
    timing noise can only lose to them in whole runs."""
    stock = times["stock"]
    table = ["stock"]
    for n in sorted(stock):
        best = min(times, key=lambda form: times[form][n])
        table.append(best if times[best][n] < (1 - FORM_GAIN) * stock[n] else "stock")
    return tuple(table)


def _pad_table(times: dict[int, float]) -> tuple[int, ...]:
    """pad[n]: the cheapest measured size at or above n, where it saves more than PAD_GAIN of n's time;
    else n itself. () when no size is padded."""
    pad = [0]
    for n in sorted(times):
        cheapest = min((m for m in times if m >= n), key=times.__getitem__)
        pad.append(cheapest if times[cheapest] < (1 - PAD_GAIN) * times[n] else n)
    return tuple(pad) if any(m != n for n, m in enumerate(pad)) else ()


NAMES = {"stock": "stock nn.Linear", "transposed": "transposed weights", "packed": "oneDNN-packed",
         "blas": "OpenBLAS (numpy)", "own": "our few-row kernel"}


def _runs(table: tuple[str, ...]) -> list[list]:
    """[form, first rows, last rows] for each stretch of pass sizes that run one form."""
    runs: list[list] = []
    for n, form in enumerate(table[1:], 1):
        if runs and runs[-1][0] == form:
            runs[-1][2] = n
        else:
            runs.append([form, n, n])
    return runs


def _rows(first: int, last: int) -> str:
    return f"{first}" + (f"-{last}" if last > first else "") + (" rows" if last > 1 else " row")


def describe(table: tuple[str, ...], pad: tuple[int, ...] = (), groups: dict[str, tuple[str, ...]] | None = None):
    """The table in words: "stock nn.Linear for 1-3 rows, transposed weights from 4", and where weight shapes run
    forms of their own: "; 2 weight shapes run a form of their own at 4-17 rows" (cpu-forms.json says which)."""
    runs = _runs(table)
    if len(runs) <= 1:
        text = f"{NAMES[table[-1]]} for every pass"
    else:
        parts = [f"{NAMES[form]} for {_rows(first, last)}" for form, first, last in runs[:-1]]
        text = ", ".join(parts) + f", {NAMES[runs[-1][0]]} from {runs[-1][1]}"
    groups = groups or {}
    sizes = [n for own in groups.values() for n in range(1, len(own)) if own[n] != table[min(n, len(table) - 1)]]
    if sizes:
        text += f"; {len(groups)} weight shape{'s run' if len(groups) > 1 else ' runs'} a form of their own at "
        text += f"{min(sizes)}-{max(sizes)} rows" if max(sizes) > min(sizes) else _rows(min(sizes), min(sizes))
    padded = [f"{n} as {m}" for n, m in enumerate(pad) if m != n]
    return text + (f"; passes of {', '.join(padded)} rows (cheaper)" if padded else "")


# what a model whose linear layers keep their own form reports (another device or dtype, or no room for a copy)
STOCK = {"layers": [], "table": ("stock",), "pad": (), "groups": {}, "linear_forms": "stock nn.Linear",
         "measured": None}  # fmt: skip


def choose_forms(model, key: str, cache_file: Path, progress=lambda message: None, joined=None) -> dict:
    """Give the model's linear layers the form that is fastest for each pass size: measured here (saying so
    through `progress`) or recalled, and only the forms used are made. `joined` (the lean pass's join) is called once
    the layers hold every form and before they are timed: our kernel's form is then timed in the pass it runs in,
    q/k/v and gate/up joined and whole layers fused (engine.decoding.lean). Timed with its layers in torch ops
    instead, on the Intel Xeon (AMX) our kernel lost 1-3 row passes to MKL's, whose products read as fast, and the
    fused pass that would have run 1.4-1.6x faster never ran. Returns {"layers", "table", "pad",
    "groups", "linear_forms", "measured"}: the CpuLinear layers ([] where the model keeps its own), the form per pass
    size, the padding table, the weight shapes that run other forms at some sizes ({shape: table}), all of it in
    words, and the timings behind them (None when recalled)."""
    forms = fitting_forms(model)
    if len(forms) <= 1:
        return STOCK
    key = f"{key}|{cpu_id()}|{torch.get_num_threads()} threads|torch {torch.__version__}|forms v{FORMS_VERSION}"
    key += "" if forms == available(next(model.parameters()).dtype) else f"|{'+'.join(forms)}"  # less memory, fewer
    if "own" in forms:  # a change to our kernel is timed again
        from engine.models import native

        key += f"|{native.version()}"
    key += "|lean" if getattr(model, "lean", None) is not None else ""  # timed in the passes that will run
    known = read_kept(cache_file)
    recalled = {"table": ["packed"], "pad": []} if mode() == "1" else known.get(key)
    measured = None
    if recalled is not None:
        table, pad = tuple(recalled["table"]), tuple(recalled["pad"])
        groups = {shape: tuple(own) for shape, own in recalled.get("groups", {}).items()}
        needed = used(table).union(*map(used, groups.values()))
        layers = wrap_linears(model, tuple(form for form in forms if form in needed))
    else:
        layers = wrap_linears(model, forms)
        if layers:
            progress(f"timing this CPU's weight layouts at each pass size, once (~{_estimate(model, forms):.0f} s; "
                     "remembered for later loads)")  # fmt: skip
            if joined is not None:
                joined()
            table, pad, groups, measured = _measure(model, layers, forms, fused=joined is not None)
            entry = {"table": list(table), "pad": list(pad), "groups": {k: list(v) for k, v in groups.items()}}
            write_kept(cache_file, dict(list(known.items())[-255:]) | {key: entry})  # the latest 256 choices
    if not layers:
        return STOCK
    for layer in layers:
        layer.keep_only(groups.get(layer.shape, table))
        layer.pad = pad
    return {"layers": layers, "table": table, "pad": pad, "groups": groups,
            "linear_forms": describe(table, pad, groups), "measured": measured}  # fmt: skip


def _estimate(model, forms: tuple[str, ...]) -> float:
    """Seconds _measure will take, from one pass of the smallest and the largest size (a tenth of a second): a
    first load says how long it keeps the user waiting."""
    from engine.decoding.runtime import time_passes

    with torch.inference_mode():
        one = time_passes(model, (1, PAD_ROWS), repeats=1, warmup=0)
    passes = (1 + 5) * len(forms) * PAD_ROWS  # as _measure: a warm-up round and five timed, every form and size
    passes += (1 + 3) * len(forms) * PAD_ROWS  # the weight shapes alone: about a pass's linears each
    return max(5.0, round(1.3 * passes * (one[1] + one[PAD_ROWS]) / 2 / 5) * 5)  # +30%: the second looks


def _measure(model, layers: list[CpuLinear], forms: tuple[str, ...], fused: bool = False):
    """Every pass size timed in every form (time_passes, the forms taking turns), then each weight shape alone
    (`_time_shapes`): the table, the padding, the shapes' own tables and the timings. `fused`: where the table runs
    our kernel, the pass runs its layers as one call (engine.decoding.lean), which a shape in another form would
    split; no shape leaves it there."""
    from engine.decoding.runtime import time_passes

    sizes = tuple(range(1, PAD_ROWS + 1))
    with torch.inference_mode():
        variants = {form: lambda form=form: _run_as(layers, (form,)) for form in forms}
        times = time_passes(model, sizes, repeats=5, variants=variants)
    table = _choose(times)
    pad = _pad_table({n: times[table[n]][n] for n in sizes})
    if pad:  # a second look, each size in its chosen form: one timing on a noisy machine decides little
        _run_as(layers, table)
        with torch.inference_mode():
            involved = {size for n, m in enumerate(pad) if m != n for size in (n, m)}
            again = time_passes(model, tuple(sorted(involved)), 5)
        pad = _confirmed(pad, again)
    by_shape: dict[str, list[CpuLinear]] = {}
    for layer in layers:
        by_shape.setdefault(layer.shape, []).append(layer)
    unpadded = tuple(n for n in sizes if not pad or pad[n] == n)  # a padded size runs as another
    with torch.inference_mode():
        shape_times = _time_shapes(by_shape, forms, unpadded)
    groups = _choose_shapes(shape_times, table)
    if fused:
        groups = {shape: mine for shape, own in groups.items()
                  if (mine := tuple("own" if size == "own" else form for size, form in zip(table, own))) != table}
    if groups:  # whole passes decide: the shapes' own forms against the table's, in turns
        differ = tuple(n for n in unpadded if any(own[n] != table[n] for own in groups.values()))
        chosen = groups
        variants = {"table": lambda: _run_as(layers, table), "own": lambda: _run_as(layers, table, chosen)}
        with torch.inference_mode():
            whole = time_passes(model, differ, 5, variants=variants)
        groups = _kept_shapes(groups, table, whole)
    measured = {f"{form}_s": times[form] for form in forms}
    measured["shapes_s"] = shape_times
    return table, pad, groups, measured


def _run_as(layers: list[CpuLinear], table: tuple[str, ...], groups: dict[str, tuple[str, ...]] | None = None):
    """Every layer runs its weight shape's own table where `groups` has one, else `table` (for timing: no form is
    freed)."""
    for layer in layers:
        layer.use((groups or {}).get(layer.shape, table))


def _time_shapes(by_shape: dict[str, list[CpuLinear]], forms: tuple[str, ...], sizes: tuple[int, ...], repeats=3):
    """{shape: {form: {rows: seconds}}}: every layer of a shape run one after the other on `rows` rows, as a pass
    meets them (each reads its weights after the others have pushed them out of the caches), best of `repeats`
    after a warm-up round, the shapes, sizes and forms taking turns."""
    best = {shape: {form: dict.fromkeys(sizes, float("inf")) for form in forms} for shape in by_shape}
    for round_ in range(repeats + 1):
        for n in sizes:
            for shape, members in by_shape.items():
                x = torch.randn(n, members[0].in_features, dtype=members[0].weights["stock"].dtype)
                for form in forms:
                    for layer in members:
                        layer.use((form,))
                    start = time.perf_counter()
                    for layer in members:
                        layer(x)
                    took = time.perf_counter() - start
                    if round_:
                        best[shape][form][n] = min(best[shape][form][n], took)
    return best


def _choose_shapes(times: dict[str, dict[str, dict[int, float]]], table: tuple[str, ...]):
    """{shape: its table} for the weight shapes where, at some size, another form than the table's saves more than
    FORM_GAIN of the shape's own time (timed alone, `_time_shapes`)."""
    groups = {}
    for shape, by_form in times.items():
        own = list(table)
        for n in next(iter(by_form.values())):
            given = table[min(n, len(table) - 1)]
            best = min(by_form, key=lambda form: by_form[form][n])
            if by_form[best][n] < (1 - FORM_GAIN) * by_form[given][n]:
                own[n] = best
        if tuple(own) != table:
            groups[shape] = tuple(own)
    return groups


def _kept_shapes(groups: dict[str, tuple[str, ...]], table: tuple[str, ...], whole: dict[str, dict[int, float]]):
    """The shapes' own forms at the sizes where whole passes with them beat the table's by more than GROUP_GAIN
    (`whole`: {"table" | "own": {rows: seconds}}); elsewhere the table's form. Shapes left with the table drop out."""
    kept = {}
    for shape, own in groups.items():
        mine = tuple(form if n in whole["own"] and whole["own"][n] < (1 - GROUP_GAIN) * whole["table"][n] else table[n]
                     for n, form in enumerate(own))  # fmt: skip
        if mine != table:
            kept[shape] = mine
    return kept


def _confirmed(pad: tuple[int, ...], times: dict[int, float]) -> tuple[int, ...]:
    """The padding that a second timing of the sizes involved agrees with: pad[n] where it still saves more than
    PAD_GAIN of n's time, else n. Once on the AMX Xeon one timing padded passes of 7-14 rows to 15 rows, which a
    second measurement put at 49-58 ms against 59 ms."""
    kept = tuple(m if m == n or times[m] < (1 - PAD_GAIN) * times[n] else n for n, m in enumerate(pad))
    return kept if any(m != n for n, m in enumerate(kept)) else ()
