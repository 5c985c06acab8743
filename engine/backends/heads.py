"""A draft head for the server backends (vLLM, llama-server): its folder found, its config read and checked against
the target before any server starts, since a server that refuses a head says so only deep in its log.

The head's math is the servers' own; this reads the same layouts the in-process engine reads (engine.models.heads),
with the same layer conventions, so one folder means the same head on every backend.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

from engine.decoding.heads import HeadConfig
from engine.errors import UserError
from engine.settings import HEAD_NAMES, Settings


def target_folder(spec: str, progress=lambda message: None) -> str:
    """A folder (or Hub id) with the target's config.json: what AutoConfig reads for the checks."""
    from engine.models import loading, random_shapes

    source = loading.resolve(spec, progress)
    if source.shape:
        return str(random_shapes.config_folder(source.shape))
    return str(source.path) if source.path else loading.hub_folder(source, progress, weights=False)


def same_kind(c: HeadConfig, s: Settings) -> None:
    """An EAGLE-3 head is not run as DFlash, nor the other way round: the drafter picked is the one that runs."""
    if c.kind != s.drafter:
        def a(kind: str) -> str:
            return ("an " if kind == "eagle3" else "a ") + HEAD_NAMES[kind]

        raise UserError(f"{s.draft!r} is {a(c.kind)} ({c.layout} layout), not {a(s.drafter)}: pick the "
                        f"{HEAD_NAMES[c.kind]} drafter.", field="drafter")  # fmt: skip


def served_head(s: Settings, progress=lambda message: None, target: str = "") -> tuple[Path, HeadConfig]:
    """The head folder the settings name and what it is, once it is known to fit the drafter and the target (read
    from `target`, a folder with its config.json, or else from the settings' target)."""
    from transformers import AutoConfig

    from engine.models.heads import check, head_config, head_folder, read_config

    folder = head_folder(s.draft, progress)
    target = AutoConfig.from_pretrained(target or target_folder(s.target, progress))
    c = head_config(read_config(folder), target)
    same_kind(c, s)
    problems = check(c, target)
    if problems:
        raise UserError(f"head {s.draft!r} does not fit the target {s.target}: {problems[0]}", field="draft")
    if c.block and s.gamma > c.most_drafts:  # vLLM and llama-server would draft past the block
        raise UserError(f"this {HEAD_NAMES[c.kind]} fills blocks of {c.block_size}, so it drafts at most "
                        f"{c.most_drafts} tokens a step: set γ to {c.most_drafts} or less.", field="gamma")  # fmt: skip
    return folder, c


# ---- llama.cpp: a head as a GGUF file -------------------------------------------------------------------------

# What llama.cpp's converter writes from each dtype the settings name (its --outtype); "auto" is float32 on a CPU.
OUTTYPES = {"auto": "f32", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}
WIDTHS = {"f32": 4, "bf16": 2, "f16": 2}  # bytes a weight in each
RECIPE = 1  # how a head's GGUF is made (the staged config below); a GGUF cached by another recipe is made again
# llama.cpp's converter run with our interpreter. Its Llama vocabulary path imports sentencepiece before it looks for
# a tokenizer.model; targets without one (a tokenizer.json, as SmolLM2 and Llama 3 ship) never use it, so where the
# package is missing a stand-in that says what to install takes its place. transformers comes first: it probes for
# sentencepiece itself and would take the stand-in for the package.
CONVERT = """
import runpy, sys, types
from pathlib import Path
import transformers
try:
    import sentencepiece
except ImportError:
    class SentencePieceProcessor:
        def __init__(self, *args, **kwargs):
            raise SystemExit("this target's tokenizer is a sentencepiece model: pip install sentencepiece")
    sys.modules["sentencepiece"] = types.SimpleNamespace(SentencePieceProcessor=SentencePieceProcessor)
script = Path(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
runpy.run_path(str(script), run_name="__main__")
"""
_DIGESTS: dict[tuple, str] = {}


def converter_target(s: Settings, progress=lambda message: None) -> Path:
    """The target's Hugging Face folder (config and tokenizer), which llama.cpp's converter reads beside the head:
    the bundled model's own, else the verifier the head's config names (a folder, or a Hub id fetched without
    weights)."""
    from engine.models.heads import head_folder, read_config
    from engine.models.loading import BUNDLED, bundled_folder

    if s.target.strip() in (BUNDLED, "bundled"):
        return bundled_folder(progress)
    raw = read_config(head_folder(s.draft, progress))
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    if not verifier:
        raise UserError("llama.cpp's converter needs the target's Hugging Face config and tokenizer beside the head, "
                        "and this head's config names no verifier: write the target's folder or Hub id into its "
                        "speculators_config.verifier.name_or_path, or use the vLLM or transformers backend.",
                        field="draft")  # fmt: skip
    return Path(target_folder(verifier, progress))


def files_digest(folders: list[Path], *extra: str) -> str:
    """sha256 of the files that make a GGUF (names and bytes), remembered per file size and mtime."""
    files = sorted(f for folder in folders for f in folder.iterdir()
                   if f.is_file() and f.name != "README.md" and not f.name.startswith("."))  # fmt: skip
    key = (tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files), extra)
    if key not in _DIGESTS:
        digest = hashlib.sha256("\n".join(extra).encode())
        for f in files:
            digest.update(f.name.encode())
            with f.open("rb") as stream:
                while block := stream.read(1 << 20):
                    digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def llama_config(raw: dict, c: HeadConfig) -> dict:
    """The head's config.json as llama.cpp's converter reads it, meaning what ours means: EAGLE-3's feature ids and
    norm flag written out (the converter's defaults differ from vLLM's for an absent flag), speculators' dflash and
    dflash2 as z-lab's flat layout (the only one the converter knows for them), a DSpark head as it is; a block head's
    causality stated (the converter reads it from `is_causal` or `dflash_config.causal` only, and writes none
    otherwise)."""
    if c.kind == "eagle3":
        if c.num_layers != 1 or c.fc_norm or c.norm_output:
            what = (f"{c.num_layers} layers" if c.num_layers != 1 else "per-feature norms (fc_norm)" if c.fc_norm
                    else "a normed output fed back (norm_output)")  # fmt: skip
            raise UserError(f"llama.cpp's EAGLE-3 runs one-layer heads without fc_norm or norm_output, and this head "
                            f"has {what}: run it on the vLLM or transformers backend.", field="draft")  # fmt: skip
        return raw | {"eagle_aux_hidden_state_layer_ids": list(c.layers), "norm_before_residual":
                      c.norm_before_residual, "draft_vocab_size": c.draft_vocab_size or c.vocab_size}  # fmt: skip
    causal = set(c.causal) or {False}
    if len(causal) > 1:
        raise UserError(f"llama.cpp runs one block causality for all of a head's layers, and this "
                        f"{HEAD_NAMES[c.kind]} has causal and non-causal layers: run it on the transformers backend.",
                        field="draft")  # fmt: skip
    if c.kind == "dspark":  # the converter reads the speculators layout itself; the causality is stated, as ours
        return raw | {"is_causal": causal.pop()}
    if c.draft_vocab_size and c.draft_vocab_size != c.vocab_size:  # z-lab's layout has no d2t: its converter fails
        raise UserError(f"llama.cpp's {HEAD_NAMES[c.kind]} drafts over the target's whole vocabulary, and this head "
                        f"drafts over {c.draft_vocab_size:,} of its {c.vocab_size:,} tokens (d2t), as the forge's do: "
                        "run it on the transformers or vLLM backend.", field="draft")  # fmt: skip
    dflash = {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.layers],
              "block_size": c.block_size, "causal": causal.pop()}  # fmt: skip
    if c.kind == "dflash2":  # z-lab's flat DFlash2 config: the convolutions and the selector in dflash_config
        dflash |= {name: getattr(c, name) for name in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                       "selector_top_k")}  # fmt: skip
    layer = raw.get("transformer_layer_config", raw) if c.layout.startswith("speculators") else raw
    architecture = "DFlash2DraftModel" if c.kind == "dflash2" else "DFlashDraftModel"
    return layer | {"architectures": [architecture], "block_size": c.block_size,
                    "dflash_config": (raw.get("dflash_config") or {}) | dflash}  # fmt: skip


def _stage(folder: Path, config: dict, to: Path) -> Path:
    """A folder the converter reads: the head's files linked, its config.json replaced."""
    to.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file() and f.name != "config.json":
            (to / f.name).symlink_to(f.resolve())
    (to / "config.json").write_text(json.dumps(config, indent=2))
    return to


def head_gguf(s: Settings, progress=lambda message: None) -> Path:
    """The settings' head as a GGUF file for llama-server's -md, converted once by llama.cpp's own converter and
    cached by the content of the head, the target's config and tokenizer, and the dtype."""
    from engine.backends.llamacpp_source import BUILD
    from engine.models.heads import read_config
    from engine.settings import cache_dir

    target = converter_target(s, progress)
    folder, c = served_head(s, progress, target=str(target))
    config = llama_config(read_config(folder), c)
    outtype = OUTTYPES[s.dtype]
    names = ("config.json", "tokenizer.json", "tokenizer_config.json")
    target_files = [target / n for n in names if (target / n).is_file()]
    digest = files_digest([folder], f"b{BUILD} r{RECIPE} {outtype}", json.dumps(config, sort_keys=True),
                     *(f.read_text() for f in target_files))  # fmt: skip
    out = cache_dir() / "heads-gguf" / f"{c.kind}-{digest[:24]}-{outtype}.gguf"
    if out.is_file():
        return out
    progress(f"converting the {HEAD_NAMES[c.kind]} to GGUF ({outtype}) with llama.cpp's converter")
    with tempfile.TemporaryDirectory(prefix="specarena-head-") as work:
        staged = _stage(folder, config, Path(work) / "head")
        part = to_gguf(staged, out.with_suffix(".part"), outtype, target, progress, what=f"the head {s.draft!r}")
    _check_layers(part, c)
    part.rename(out)
    return out


# What llama.cpp's convert_hf_to_gguf.py logs as it goes (build b11434): the last line that matches is its phase
CONVERT_PHASES = [
    (r"Loading model:|Model architecture:|indexing model part", "reading the model"),
    (r"Exporting model|--> \w+, shape = ", "converting tensors"),
    (r"Set meta model|Set model parameters|Set model tokenizer|gguf\.vocab:", "writing the metadata"),
    (r"^Writing:\s+(\d+)%", "writing the file, {0}%"),
    (r"successfully exported", "done"),
]


def to_gguf(folder: Path, out: Path, outtype: str, target: Path | None = None, progress=lambda message: None,
            what: str = "", field: str = "draft") -> Path:  # fmt: skip
    """`folder` (a transformers model, or a head with its target's folder as `target`) written to `out` by llama.cpp's
    convert_hf_to_gguf.py, as `outtype` (f32, bf16, f16, q8_0), saying its phase as it goes (a 1.7B model takes
    minutes)."""
    from engine.backends.llamacpp_source import converter
    from engine.backends.servers import last_error, run_watched

    script = converter(progress) / "convert_hf_to_gguf.py"
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = ["--target-model-dir", str(target)] if target is not None else []
    command = [sys.executable, "-c", CONVERT, str(script), str(folder), *extra, "--outtype", outtype, "--outfile",
               str(out)]  # fmt: skip
    code, log = run_watched(command, f"converting {what or folder.name} to GGUF ({outtype})", CONVERT_PHASES, progress)
    if code or not out.is_file():
        raise UserError(f"llama.cpp's converter could not convert {what or folder}: {last_error(log)}",
                        field=field, detail="\n".join(log.splitlines()[-20:]))  # fmt: skip
    return out


def _check_layers(path: Path, c: HeadConfig) -> None:
    """The target layers the GGUF makes llama-server read must be the head's own (they index the same residual
    stream as transformers' hidden_states); a converter that put others there would draft from other features."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.target_layers")
    written = [int(i) for i in field.contents()] if field is not None else None
    if written != list(c.layers):
        path.unlink()
        raise UserError(f"llama.cpp's converter wrote target layers {written} for this head, which reads layers "
                        f"{list(c.layers)}: llama-server would draft from other features. Run the head on the vLLM "
                        "or transformers backend.", field="draft")  # fmt: skip
