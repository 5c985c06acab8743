"""Draft heads as they are published: reading the six layouts, checking a head against a target, writing one.

    eagle3-original     SafeAILab's EAGLE-3: a LlamaConfig with `draft_vocab_size`, weights `midlayer.*`, `fc`, `norm`,
                        `lm_head`, `d2t`/`t2d`; the embedding is the target's. Features [2, L//2, L-3].
    speculators-eagle3  vLLM's speculators: `speculators_model_type: eagle3`, a `transformer_layer_config`, the norm
                        flags, `eagle_aux_hidden_state_layer_ids`; weights `layers.i.*`, `embed_tokens` included.
    dflash              z-lab's DFlash: a Qwen3Config with `block_size` and `dflash_config {mask_token_id,
                        target_layer_ids}`; no embedding, no LM head (the target's).
    speculators-dflash  speculators' dflash: `speculators_model_type: dflash`, `aux_hidden_state_layer_ids`.
    speculators-peagle  speculators' P-EAGLE: EAGLE-3's config and weights with a `mask_token_id` and a learnt
                        `mask_hidden` feature; its norm flags as vLLM's `update_peagle` reads them (absent: False).
    speculators-dspark  speculators' DSpark: DFlash's config and weights with `markov_rank` (`markov_head.markov_w1`,
                        `markov_w2`), `enable_confidence_head` and `confidence_head_with_markov` (`confidence_head.
                        proj`), `sample_from_anchor`; each layer's block causal by its type (vLLM's update_dspark).

Layer indices. Every head here names target features as indices into transformers' `hidden_states` (0: the
embedding output; i: the residual stream entering decoder layer i), which is what vLLM, llama.cpp, SGLang,
speculators and SafeAILab mean by "layer i" for EAGLE-3 and what speculators' dflash means too. z-lab's DFlash
`target_layer_ids` name the layer whose OUTPUT is read, so they are one lower: we add 1 when reading and take it off
when writing (as vLLM and speculators' converter do).

Fields that change the math are read the way vLLM 0.32 reads them (`vllm/transformers_utils/configs/speculators/
algos.py`, `model_executor/models/llama_eagle3.py`, `qwen3_dflash.py`): a speculators config is its
`transformer_layer_config` plus the algorithm's own fields, so `norm_before_residual` absent means True there and False
in SafeAILab's layout; a layer's sliding window comes from `layer_types` and `sliding_window` (DFlash also `use_swa`,
`swa_window_size`); a DFlash layer's block is causal by `is_causal`, else `dflash_config.causal` (speculators:
`not sliding_window_non_causal`, absent = non-causal), else by being a sliding layer. A field SpecArena cannot honour is
refused by name before any weights load (`HeadConfig.refused`), never ignored.

Safety as for models (engine.models.loading): safetensors only unless SPECARENA_ALLOW_PICKLE=1; heads never run
remote code: the math is ours (engine.decoding.heads), the folder only gives weights and a config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.decoding.heads import DFlash, DFlash2, DSpark, Eagle3, Head, HeadCache, HeadConfig, MTPHead, PEagle
from engine.decoding.runtime import PRE_NORM, Clock
from engine.errors import UserError
from engine.models.cpu import like_target, swap_back
from engine.models.loading import allow_pickle, hub_folder, resolve

# each layout's head kind
KIND_OF = {"speculators-eagle3": "eagle3", "eagle3-original": "eagle3", "dflash": "dflash",
           "speculators-dflash": "dflash", "speculators-peagle": "peagle", "speculators-dspark": "dspark",
           "speculators-dflash2": "dflash2", "speculators-mtp": "mtp-head"}  # fmt: skip
LAYOUTS = tuple(KIND_OF)
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout we write


def eagle3_layers(target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default features: low, middle and high (SafeAILab, vLLM, llama.cpp, speculators agree)."""
    return (2, target_layers // 2, target_layers - 3)


def dflash_layers(target_layers: int, draft_layers: int) -> tuple[int, ...]:
    """z-lab's default DFlash features, spread from layer 1 to L-3, in hidden_states indices (z-lab's ids + 1)."""
    if draft_layers == 1:
        return (target_layers // 2 + 1,)
    span = target_layers - 4
    return tuple(int(round(1 + i * span / (draft_layers - 1))) + 1 for i in range(draft_layers))


def head_folder(spec: str, progress=lambda message: None) -> Path:
    """A head's folder: a local one, or a Hub id downloaded as models are (engine.models.loading)."""
    source = resolve(spec, progress)
    if source.shape:
        raise UserError(f"{spec!r} names a random model, not a draft head: name a head's folder or Hub id.",
                        field="draft")  # fmt: skip
    folder = Path(hub_folder(source, progress) if source.repo_id else source.location)
    return folder


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"head folder {str(folder)!r} has no readable config.json ({exc}).", field="draft") from None


def layout_of(raw: dict) -> str:
    """Which published layout a head's config.json is in; a clear error when none."""
    kind = raw.get("speculators_model_type")
    if f"speculators-{kind}" in KIND_OF:
        return f"speculators-{kind}"
    if kind:
        raise UserError(f"speculators head type {kind!r} is not one SpecArena runs: eagle3, peagle, dflash, "
                        "dspark, dflash2 and mtp are.", field="draft")  # fmt: skip
    if "dflash_config" in raw or "DFlashDraftModel" in raw.get("architectures", []):
        return "dflash"
    if "draft_vocab_size" in raw or any("Eagle3" in a for a in raw.get("architectures", [])):
        return "eagle3-original"
    raise UserError(
        "this folder is not a draft head: its config.json has neither `speculators_model_type` (vLLM speculators), "
        "`draft_vocab_size` (SafeAILab EAGLE-3) nor `dflash_config` (z-lab DFlash). For a draft model, pick the "
        "draft-model drafter.", field="draft",
    )  # fmt: skip


def _rope_fields(layer: dict, kind: str, layout: str) -> dict:
    """The layer's rope fields; none at all is vLLM's default base: 10000, but 1e6 for a speculators DFlash head
    (qwen3_dflash's set_default_rope_theta; a z-lab config is a Qwen3Config, whose default is 10000)."""
    rope = {k: layer[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if layer.get(k) is not None}
    theta = rope.get("rope_theta") or (rope.get("rope_parameters") or {}).get("rope_theta")
    if not theta and layout == "speculators-dflash":
        rope["rope_theta"] = 1e6
    return rope


def _rope_refused(layer: dict) -> list[str]:
    """Rope settings whose frequencies are not fixed per position (they change with the text's length) or rotate
    part of a head only: SpecArena's heads rotate whole heads with fixed frequencies."""
    out = []
    for name in ("rope_scaling", "rope_parameters"):
        params = layer.get(name) or {}
        if not isinstance(params, dict):
            continue
        if "sliding_attention" in params or "full_attention" in params:
            out.append(f"`{name}` per layer type")
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind in ("dynamic", "longrope", "mrope") or "mrope_section" in params:
            out.append(f"`{name}` of type {kind!r}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            out.append(f"`{name}.partial_rotary_factor` {params['partial_rotary_factor']}")
    if layer.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        out.append(f"`partial_rotary_factor` {layer['partial_rotary_factor']}")
    if layer.get("is_neox_style") is False:
        out.append("`is_neox_style: false`")
    return out


def _layer_types(view: dict, layers: int) -> list[str] | None:
    """Each layer's attention type: `layer_types`, or for a Qwen3-style config with `use_sliding_window` the layers
    from `max_window_layers` on (transformers' rule, which builds the config vLLM reads); None where neither says."""
    types = view.get("layer_types")
    if types:
        return list(types)[:layers] + ["full_attention"] * max(0, layers - len(types))
    if view.get("use_sliding_window") and view.get("sliding_window"):
        first = view.get("max_window_layers", 28)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return None


def _attention(view: dict, kind: str, layers: int) -> tuple[tuple[int, ...], tuple[bool, ...], list[str]]:
    """Per layer: the sliding window (0: none) and, for DFlash, whether the block is causal, as vLLM resolves them
    (llama_eagle3 / qwen3_eagle3: `layer_types` + `sliding_window`; qwen3_dflash: `_resolve_layer_attention` and
    `_dflash_layer_causal`)."""
    types, refused = _layer_types(view, layers), []
    window = view.get("sliding_window") or 0
    sliding = [t == "sliding_attention" for t in types] if types else [False] * layers
    if kind not in ("dflash", "dspark", "dflash2"):
        return tuple(window if s else 0 for s in sliding), (), refused
    dflash = view.get("dflash_config") or {}
    use_swa = bool(dflash.get("use_swa"))
    if types is None or (use_swa and not any(sliding)):
        sliding = [use_swa] * layers
    window = dflash.get("swa_window_size") or window
    if any(sliding) and not window:
        refused.append("sliding-window layers without a `sliding_window` (or `dflash_config.swa_window_size`)")
    if view.get("is_causal") is not None:
        causal = [bool(view["is_causal"])] * layers
    elif dflash.get("causal") is not None:
        causal = [bool(dflash["causal"])] * layers
    else:
        causal = [t == "sliding_attention" for t in types] if types else [False] * layers
    return tuple(window if s else 0 for s in sliding), tuple(causal), refused


def _vllm_view(raw: dict, layout: str) -> dict:
    """The config as vLLM builds it: a speculators config's `transformer_layer_config` with the algorithm's fields
    over it (configs/speculators/algos.py); another layout's config as it stands."""
    if not layout.startswith("speculators"):
        return raw
    view = dict(raw.get("transformer_layer_config") or {})
    if layout in ("speculators-dflash", "speculators-dflash2"):  # update_dflash2 is update_dflash, and more keys
        view["dflash_config"] = {"mask_token_id": raw.get("mask_token_id"),
                                 "sample_from_anchor": raw.get("sample_from_anchor", False),
                                 "causal": not raw.get("sliding_window_non_causal", True)}  # fmt: skip
    if layout == "speculators-dspark":  # update_dspark sets no `causal`: each layer's type decides (sliding: causal)
        view["dflash_config"] = {"mask_token_id": raw.get("mask_token_id"),
                                 "sample_from_anchor": raw.get("sample_from_anchor", False)}  # fmt: skip
    return view


def _refused(raw: dict, view: dict, kind: str, layout: str) -> list[str]:
    """The fields of this config that change the head's math in a way SpecArena does not run, by name."""
    from transformers.activations import ACT2FN

    out = _rope_refused(view)
    act = view.get("hidden_act", "silu")
    if act not in ACT2FN:
        out.append(f"`hidden_act` {act!r}")
    eagle = view.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", view.get("use_aux_hidden_state", True)) is False:
        out.append("`use_aux_hidden_state: false`")
    if layout.startswith("speculators") and view.get("model_type", "llama") not in ("llama", "qwen3"):
        out.append(f"`transformer_layer_config.model_type` {view.get('model_type')!r} (vLLM runs llama and qwen3)")
    if kind in ("dflash", "dspark", "dflash2"):
        dflash = view.get("dflash_config") or {}
        if kind != "dspark" and (dflash.get("sample_from_anchor") or raw.get("sample_from_anchor")):
            out.append("`sample_from_anchor: true` on a DFlash head (vLLM refuses it too)")
        if dflash.get("attention_value_scale") is not None:
            out.append("`dflash_config.attention_value_scale`")
        if dflash.get("attention_sink_bias") or view.get("add_swa_attention_sink_bias"):
            out.append("attention sink biases (`attention_sink_bias`)")
        if dflash.get("mask_token_id", raw.get("mask_token_id")) is None:
            out.append("no `mask_token_id` (the token that fills the block)")
    if kind == "mtp-head":
        if int(raw.get("num_nextn_predict_layers", 1)) != 1:
            out.append(f"`num_nextn_predict_layers: {raw['num_nextn_predict_layers']}` (speculators runs one)")
        if view.get("model_type") != "qwen3":
            out.append(f"an MTP layer of model type {view.get('model_type')!r} (the qwen3 one runs here; speculators "
                       "also makes qwen3_next and qwen3_5 layers, with another attention)")  # fmt: skip
        if raw.get("draft_vocab_size") and raw["draft_vocab_size"] != view.get("vocab_size"):
            out.append("a reduced `draft_vocab_size` (speculators' MTP drafts over the full vocabulary)")
    if kind == "dflash2":
        needed = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        missing = [k for k in needed if not raw.get(k)]
        if missing:
            out.append(f"no {', '.join(f'`{k}`' for k in missing)} (vLLM needs them too)")
        elif view.get("hidden_size", 0) % raw["conv_group_size"] or raw["conv_kernel_size"] > raw.get("block_size", 0):
            out.append("`conv_group_size` that does not divide the hidden size, or `conv_kernel_size` over the block")
        vocab = view.get("vocab_size")
        if raw.get("draft_vocab_size") and vocab and raw["draft_vocab_size"] != vocab:
            out.append("a reduced `draft_vocab_size` (DFlash2 drafts over the full vocabulary, as its trainer "
                       "requires)")
    if kind == "dspark":
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            out.append(f"`markov_head_type: {raw['markov_head_type']}` (vLLM 0.32 and llama.cpp run the vanilla Markov "
                       "head only)")  # fmt: skip
        if raw.get("sliding_window_non_causal"):
            out.append("`sliding_window_non_causal: true` on a DSpark head (vLLM 0.32 runs its sliding layers "
                       "causally, speculators' forward not)")  # fmt: skip
        if raw.get("confidence_head_with_markov") and raw.get("enable_confidence_head") and not raw.get("markov_rank"):
            out.append("`confidence_head_with_markov` without a Markov head (`markov_rank: 0`)")
    if kind == "peagle":
        if raw.get("mask_token_id") is None:
            out.append("no `mask_token_id` (the token of the mask rows; vLLM needs it too)")
        if raw.get("fc_norm"):  # speculators' forward norms each feature, vLLM's update_peagle drops the flag
            out.append("`fc_norm` on a P-EAGLE head (vLLM 0.32 runs it without, speculators with)")
    return out


def head_config(raw: dict, target_config) -> HeadConfig:
    """A head's config.json read against its target's config (the default features depend on its layer count)."""
    layout = layout_of(raw)
    view = _vllm_view(raw, layout)
    layer = view
    text = target_config.get_text_config()
    target_layers = text.num_hidden_layers
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    kind = KIND_OF[layout]
    dflash = raw.get("dflash_config") or {}
    eagle = raw.get("eagle_config") or {}
    if layout in ("speculators-eagle3", "speculators-peagle"):
        layers = raw.get("eagle_aux_hidden_state_layer_ids") or eagle3_layers(target_layers)
    elif layout == "eagle3-original":
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") or eagle3_layers(target_layers)
    elif layout == "speculators-mtp":  # the target's last layer before its final norm (vLLM's aux id L)
        layers = [PRE_NORM]
    elif layout == "dflash":
        ids = dflash.get("target_layer_ids")
        layers = [i + 1 for i in ids] if ids else dflash_layers(target_layers, layer["num_hidden_layers"])
    else:
        layers = raw.get("aux_hidden_state_layer_ids") or dflash_layers(target_layers, layer["num_hidden_layers"])
    count = 1 if kind == "mtp-head" else layer["num_hidden_layers"]  # an MTP config is its verifier's: one layer
    windows, causal, refused = _attention(view, kind, count)
    mask_token = raw.get("mask_token_id", dflash.get("mask_token_id"))
    return HeadConfig(
        kind=kind, hidden_size=hidden, num_layers=count, num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or hidden // heads, intermediate_size=layer["intermediate_size"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6), vocab_size=layer.get("vocab_size") or text.vocab_size,
        layers=tuple(int(i) for i in layers), draft_vocab_size=raw.get("draft_vocab_size") or 0,
        target_hidden_size=raw.get("target_hidden_size") or 0, attention_bias=bool(layer.get("attention_bias")),
        mlp_bias=bool(layer.get("mlp_bias")), hidden_act=layer.get("hidden_act", "silu"),
        rope=_rope_fields(layer, kind, layout), max_position_embeddings=layer.get("max_position_embeddings", 2048),
        # absent: vLLM's speculators adapter (update_eagle3) says True, its llama_eagle3 (SafeAILab's layout) False
        norm_before_residual=bool(raw.get("norm_before_residual", layout == "speculators-eagle3")),
        norm_before_fc=bool(eagle.get("norm_before_fc", raw.get("norm_before_fc"))), fc_norm=bool(raw.get("fc_norm")),
        norm_output=bool(raw.get("norm_output")) or kind == "mtp-head",  # MTP feeds its final-normed output back
        qk_norm=layer.get("model_type", "qwen3" if kind in ("dflash", "dspark") else "llama") in ("qwen3", "qwen3_moe"),
        windows=windows, causal=causal, logit_scale=float(view.get("logit_scale") or 1.0),
        block_size=int(raw.get("block_size") or dflash.get("block_size") or 0),
        mask_token_id=int(mask_token or 0),
        verifier=((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "",
        proposed_gamma=int(next(iter((raw.get("speculators_config") or {}).get("proposal_methods") or []),
                                {}).get("speculative_tokens") or 0),
        layout=layout, refused=tuple(refused + _refused(raw, view, kind, layout)),
        note=_disagreement(raw, layout, windows), **_dspark_fields(raw, kind), **_dflash2_fields(raw, kind),
    )  # fmt: skip


def _dflash2_fields(raw: dict, kind: str) -> dict:
    """A DFlash2 head's convolutions and candidate selector (refused by name where one is missing: `_refused`)."""
    if kind != "dflash2":
        return {}
    return {name: int(raw.get(name) or 0) for name in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                       "selector_top_k")}  # fmt: skip


def _dspark_fields(raw: dict, kind: str) -> dict:
    """A DSpark head's Markov rank, confidence head and block layout, as vLLM's update_dspark reads them (absent:
    no Markov head, no confidence head, DFlash's layout: the reference writes every one of them)."""
    if kind != "dspark":
        return {}
    rank = int(raw.get("markov_rank") or 0)
    confidence = ("" if not raw.get("enable_confidence_head") else
                  "hidden+markov" if raw.get("confidence_head_with_markov") and rank else "hidden")  # fmt: skip
    return {"markov_rank": rank, "confidence": confidence, "sample_from_anchor": bool(raw.get("sample_from_anchor"))}


def _disagreement(raw: dict, layout: str, windows: tuple[int, ...]) -> str:
    """Where speculators' own forward and vLLM run this head differently, what we follow."""
    speculators_block = layout in ("speculators-dflash", "speculators-dflash2")
    if speculators_block and not raw.get("sliding_window_non_causal", True) and not all(windows):
        return ("its full-attention layers run the block causally, as vLLM 0.32 does (sliding_window_non_causal is "
                "false); speculators' own forward runs them non-causally")  # fmt: skip
    return ""


def check(c: HeadConfig, target_config) -> list[str]:
    """What keeps this head from drafting for this target, one sentence each (empty: nothing)."""
    text = target_config.get_text_config()
    problems = []
    width = c.target_hidden_size or c.hidden_size
    if width != text.hidden_size:
        problems.append(f"the head reads features {width} wide, the target's hidden size is {text.hidden_size}: "
                        "it was made for another target.")  # fmt: skip
    if c.vocab_size != text.vocab_size:
        problems.append(f"the head's vocabulary has {c.vocab_size} tokens, the target's {text.vocab_size}: "
                        "another tokenizer.")  # fmt: skip
    deepest = text.num_hidden_layers
    if any(not 0 <= i <= deepest and i != PRE_NORM for i in c.layers):
        problems.append(f"the head reads target layers {list(c.layers)}, the target has {deepest}: it was made for "
                        "a deeper target.")  # fmt: skip
    if c.block and c.block_size < 2:
        problems.append("the DFlash head's config has no block_size of 2 or more.")
    if c.block and c.hidden_size != text.hidden_size:
        problems.append("a DFlash head's hidden size must equal the target's (it uses the target's embedding).")
    if c.refused:
        problems.append(f"its config asks for what SpecArena does not run: {', '.join(c.refused)}.")
    return problems


def _folder_refused(folder: Path) -> list[str]:
    """Files beside the weights that would change the math (vLLM reads a DFlash head's mask_embedding.pt)."""
    return ["a separate mask embedding (`mask_embedding.pt`)"] if (folder / "mask_embedding.pt").exists() else []


def doctor_checks(spec: str, target_spec: str, target_config, gamma: int | None = None,
                  ) -> tuple[list[tuple[str, str, str]], int]:  # fmt: skip
    """The pair doctor's checks of a head against a target, from the head's config.json alone (downloaded without its
    weights): (name, status, detail) each, and the head's parameter count. With the run's `gamma`, a note where
    the head proposes another draft length."""
    source = resolve(spec)
    folder = Path(hub_folder(source, weights=False) if source.repo_id else source.location)
    c = head_config(read_config(folder), target_config)
    c.refused += tuple(_folder_refused(folder))
    problems = check(c, target_config)
    what = f"{c.kind} head ({c.layout} layout) reading target layers {list(c.layers)}, {attention(c)}"
    checks = [("head", "fail" if problems else "ok", " ".join(problems) if problems else what)]
    if c.verifier:
        status = "ok" if _model_name(c.verifier) == _model_name(target_spec) else "warn"
        detail = f"the head was trained for {c.verifier}"
        if status != "ok":
            detail += f", not {target_spec}: expect lower acceptance"
        checks.append(("verifier", status, detail))
    if c.proposed_gamma:
        p = c.proposed_gamma
        other = gamma is not None and gamma != p
        detail = f"the head proposes γ {p} (its config: for a forged head, the draft length measured fastest)"
        if other:
            detail += f"; this run drafts γ {gamma}: set γ to {p}, or sweep both in the Lab"
        checks.append(("draft length", "note" if other else "ok", detail))
    with torch.device("meta"):
        params = sum(p.numel() for p in Head(c).parameters())
    return checks, params + (c.draft_vocab_size or 0) * c.hidden_size * c.eagle


def _model_name(spec: str) -> str:
    """What a verifier and a target spec are compared by: the model's name (a Hub id's or a folder's, revision
    dropped, lowercase), the bundled model's under all its names (a forged head names it "bundled"; the target is
    also "bundled:smollm2-135m-instruct", or its converted folder)."""
    from engine.settings import BUNDLED

    spec = str(spec).split("@")[0].rstrip("/")
    return BUNDLED.partition(":")[2] if spec in ("bundled", BUNDLED) else Path(spec).name.lower()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(folder.glob("*.bin"))
        if pickled and allow_pickle():
            out = {}
            for f in pickled:
                out.update(torch.load(f, map_location="cpu", weights_only=True))
            return out
        hint = (" It ships pickled .bin weights, which can run code when loaded: set SPECARENA_ALLOW_PICKLE=1 if "
                "you trust it.") if pickled else ""  # fmt: skip
        raise UserError(f"head folder {str(folder)!r} has no .safetensors weights.{hint}", field="draft")
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def _normalise(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every layout's names as Head's: no `model.` prefix, SafeAILab's `midlayer.` as layer 0."""
    out = {}
    for name, tensor in weights.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        if name.startswith("mtp_layers.0."):  # speculators' MTP layer: its fusion and final norm are the head's
            rest = name.removeprefix("mtp_layers.0.")
            name = MTP_NAMES.get(rest, "layers.0." + rest)
        if name.startswith("verifier_"):  # the target's own weights, saved by some reference builds
            continue
        out[name] = tensor
    return out


# speculators' MTP layer names -> Head's (the rest of `mtp_layers.0.` is the decoder layer, `layers.0.` here)
MTP_NAMES = {"input_proj.weight": "fc.weight", "final_layernorm.weight": "norm.weight",
             "hidden_layernorm.weight": "hidden_norm.weight", "token_layernorm.weight": "token_norm.weight"}


def load_head(spec: str, target, progress=lambda message: None) -> Head:
    """A head for `target` (a transformers model), on its device and in its dtype, its features checked."""
    folder = head_folder(spec, progress)
    c = head_config(read_config(folder), target.config)
    c.refused += tuple(_folder_refused(folder))
    problems = check(c, target.config)
    if problems:
        raise UserError(f"head {spec!r} does not fit this target: {problems[0]}", field="draft")
    weights = _normalise(_weights(folder))
    return build(c, weights, target, spec)


def build(c: HeadConfig, weights: dict[str, torch.Tensor], target, name: str = "head") -> Head:
    """A Head from its config and weights, with the target's embedding (and LM head) where it has none of its own."""
    p = next(target.parameters())
    own = {k: weights.pop(k) for k in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d") if k in weights}
    with torch.device("meta"):
        head = Head(c)
    missing, unexpected = head.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if k not in ("d2t", "inv_freq")]
    if missing or unexpected:
        what = f"missing {missing[:4]}" if missing else f"unexpected {unexpected[:4]}"
        raise UserError(f"head {name!r} does not match its config ({c.layout} layout): {what}.", field="draft")
    head.to(device=p.device, dtype=p.dtype)
    head.reset_rotary()
    if "embed_tokens.weight" in own:
        head.embed_tokens = torch.nn.Embedding.from_pretrained(own["embed_tokens.weight"].to(p.device, p.dtype))
    else:
        head.embed_tokens = target.get_input_embeddings()
    if "lm_head.weight" in own:
        weight = own["lm_head.weight"].to(p.device, p.dtype)
        head.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=p.device, dtype=p.dtype)
        head.lm_head.weight.data = weight
    elif c.draft_vocab_size and c.draft_vocab_size != c.vocab_size:
        raise UserError(f"head {name!r} has a {c.draft_vocab_size}-token draft vocabulary but no lm_head weights.",
                        field="draft")  # fmt: skip
    else:
        head.lm_head = target.get_output_embeddings()
    rows = head.lm_head.out_features
    if rows != c.vocab_size:  # a reduced vocabulary: d2t holds each draft id's offset to its target id
        if "d2t" not in own:
            raise UserError(f"head {name!r} drafts over {rows} tokens but ships no d2t mapping.", field="draft")
        ids = own["d2t"].long() + torch.arange(rows)
        t2d = own.get("t2d")
        if t2d is not None and (int(t2d.sum()) != rows or not bool(t2d.bool()[ids].all())):
            raise UserError(f"head {name!r}: its t2d and d2t name different draft vocabularies.", field="draft")
        head.d2t = ids.to(p.device)
    return head.eval().requires_grad_(False)


class LoadedHeads:
    """The heads loaded lately, keyed by (spec, target): a head shares its target's embedding, so it lives and dies
    with that very model object."""

    def __init__(self, size: int = 2):
        self.size, self.heads = size, {}

    def get(self, spec: str, target, progress=lambda message: None) -> Head:
        key = (spec, id(target))
        if key not in self.heads:
            while len(self.heads) >= self.size:
                self.heads.pop(next(iter(self.heads)))
            head = load_head(spec, target, progress)
            serve_forms(head, target)
            self.heads[key] = (head, target)  # the target kept: its id stays unique
        return self.heads[key][0]


HEADS = LoadedHeads()


def serve_forms(head: Head, target, repeats: int = 15) -> bool:
    """Run the head's layers in the kernels the target's run (`in_target_kernels`) where its draft passes are faster
    so, timed here in turns against torch's stock layers; else leave them. Whether they were swapped. On the Intel Xeon
    (AMX), in bfloat16 an EAGLE-3 chain step of the bundled model's head cost 1.0-1.5 ms so against 1.5-2.7 in stock
    layers, and a DFlash block 5-10% less; in float32 a chain step cost 6-10% more (the head's 35 MB sit largely in the
    CPU's caches, where MKL reads fast) and a block 5% less (both before a head's layers ran as one call)."""
    swaps = in_target_kernels(head, target)
    if not swaps:
        return False
    best = time_forms(swaps, draft_pass(head), Clock(next(head.parameters()).device), repeats)
    back = best[True] >= best[False]
    swap_back(swaps, back=back)
    if back:
        head.stack = None
    return not back


def in_target_kernels(head: Head, target) -> list[tuple]:
    """Give the head's linear layers the forms the target's run (engine.models.cpu.like_target; fc stays) and, where
    they all run our kernel, the head's layers one call of it (Head.join). The swaps made, for swap_back."""
    from engine.models import native
    from engine.models.cpu import join

    swaps = like_target(head, target, keep=("fc",))
    if swaps:
        head.join(join, native.Stack)
    return swaps


def time_forms(swaps: list[tuple], step, clock: Clock, repeats: int) -> dict[bool, float]:
    """The best time of `step` with the swapped layers in the target's kernels (True) and in torch's stock layers
    (False), the two taking turns after a round of warm-up: a shared machine's speed drifts, turns share the drift.
    Leaves the stock layers in place."""
    best = {True: float("inf"), False: float("inf")}
    with torch.inference_mode():
        for _ in range(repeats + 1):
            for ours in (True, False):
                swap_back(swaps, back=not ours)
                start = clock.now()
                step()
                best[ours] = min(best[ours], clock.now() - start)
    return best


def draft_pass(head: Head, context: int = 64, block: int = 4):
    """One draft pass of `head` after `context` positions of random features, as a function that leaves the head's
    cache as it found it: an EAGLE-3 (or MTP, P-EAGLE) chain step over one row, or a block of `block` rows (at most
    the head's) and its drafting rows' logits. For timing: random features cost what real ones do."""
    c, p = head.config, next(head.parameters())
    block = min(block, c.block_size or block)
    cache = HeadCache(c.num_layers, c.num_kv_heads, c.head_dim, p.dtype, p.device, context + block + 8)
    features = torch.randn(context + 1, c.feature_size, dtype=p.dtype, device=p.device)
    tokens = torch.arange(1, context + 2, device=p.device) % c.vocab_size
    with torch.inference_mode():
        if c.block:
            head.dflash(features[:context], tokens[:block], cache)
        else:
            state = head.eagle3(tokens[:context], head.fuse(features[:context]), cache)[0]

    def step():
        if c.block:
            head.logits(head.dflash(features[context:], tokens[:block], cache)[1:])
        else:
            head.eagle3(tokens[context:], state[-1:], cache)
        cache.crop(context)

    return step


def own_parameters(head: Head) -> int:
    """The head's own weights: its layers, fc and norms, and an EAGLE-3 head's LM head (a DFlash head drafts through
    the target's, unless it ships a reduced one); never the embedding, which is the target's or a copy of it. Each
    tensor once, however many names it has (a tied target's embedding is its LM head)."""
    shared = {id(p) for p in head.embed_tokens.parameters()}
    params = {id(p): p.numel() for name, p in head.named_parameters(remove_duplicate=False)
              if not name.startswith(("embed_tokens.", "lm_head.")) and id(p) not in shared}  # fmt: skip
    if head.config.eagle or head.d2t is not None:  # its own LM head (also a CPU-path linear)
        params[id(head.lm_head)] = head.lm_head.out_features * head.lm_head.in_features
    return sum(params.values())


def attention(c) -> str:
    """How the head's layers attend, in words: windows, and a DFlash block's causality."""
    windows = sorted({w for w in c.windows if w})
    where = f"sliding window {', '.join(map(str, windows))}" if windows else "full attention"
    if len(windows) and not all(c.windows):
        where = f"{where} on {sum(1 for w in c.windows if w)} of {c.num_layers} layers"
    if c.block:
        n = sum(c.causal) if c.causal else 0
        where += (", causal block" if n == c.num_layers else ", non-causal block" if n == 0
                  else f", causal block on {n} of {c.num_layers} layers")  # fmt: skip
    return where + (f" ({c.note})" if c.note else "")


def describe(head: Head) -> str:
    c = head.config
    vocab = head.lm_head.out_features
    what = (f"{c.num_layers}-layer EAGLE-3 head, draft vocabulary {vocab}" if c.kind == "eagle3"
            else f"{c.num_layers}-layer P-EAGLE head (all drafts in one pass), draft vocabulary {vocab}"
            if c.kind == "peagle" else f"{c.num_layers}-layer DFlash head, blocks of {c.block_size}"
            if c.kind == "dflash" else f"{c.num_layers}-layer DFlash2 head, blocks of {c.block_size}, "
            f"{c.conv_kernel_size}-tap convolutions, a candidate selector over the top {c.selector_top_k}"
            if c.kind == "dflash2" else "an MTP layer (speculators' layout), one pass per draft" if c.kind == "mtp-head"
            else f"{c.num_layers}-layer DSpark head, blocks of {c.block_size}"
            f"{' drafting from their first row' if c.sample_from_anchor else ''}, "
            + (f"a rank-{c.markov_rank} Markov bias" if c.markov_rank else "no Markov bias")
            + (f", a confidence head ({c.confidence})" if c.confidence else ", no confidence head"))  # fmt: skip
    params = own_parameters(head)
    reads = ("reads the target's last layer before its final norm" if c.layers == (PRE_NORM,)
             else f"reads target layers {list(c.layers)}")  # fmt: skip
    return (f"{what}, {reads}, {attention(c)}, {params / 1e6:.1f}M parameters "
            f"({c.layout} layout)")  # fmt: skip


def linear_weight(module) -> torch.Tensor:
    """The (out, in) weight of a linear layer, also of one the CPU path holds in other layouts (engine.models.cpu's
    CpuLinear reads it back from whichever form it kept)."""
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else module.plain_weight()


def drafter_for(head: Head, vocab_size: int, gamma: int, adaptive: bool = False, topk: int = 1,
                costs: list[float] | None = None, p_min: float = 0.0):  # fmt: skip
    """The Drafter that runs this head (an EAGLE-3 head drafts a tree with topk > 1, sized by the verify `costs`; a
    DSpark head stops at a position whose confidence is below `p_min`)."""
    if head.config.kind == "eagle3":
        return Eagle3(head, vocab_size, gamma, adaptive, topk, costs)
    if head.config.kind == "peagle":
        return PEagle(head, vocab_size, gamma, adaptive)
    if head.config.kind == "dspark":
        return DSpark(head, vocab_size, gamma, adaptive, p_min)
    if head.config.kind == "dflash2":
        return DFlash2(head, vocab_size, gamma, adaptive)
    if head.config.kind == "mtp-head":
        return MTPHead(head, vocab_size, gamma, adaptive)
    return DFlash(head, vocab_size, gamma, adaptive)


# ---- writing ---------------------------------------------------------------------------------------------------


def _layer_dict(c: HeadConfig, model_type: str) -> dict:
    """The layer config; a head with sliding windows says which layers and how wide (one width, as configs hold)."""
    windows = sorted({w for w in c.windows if w})
    if len(windows) > 1:
        raise ValueError(f"a config holds one sliding window, this head has {windows}")
    attention = {"layer_types": ["sliding_attention" if w else "full_attention" for w in c.windows],
                 "sliding_window": windows[0], "use_sliding_window": True} if windows else {}  # fmt: skip
    return attention | {
        "model_type": model_type, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "hidden_act": c.hidden_act, "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False, **c.rope,
    }  # fmt: skip


def write_head(
    head: Head, folder: Path, layout: str = "speculators-eagle3", verifier: str = "",
    verifier_arch: str = "LlamaForCausalLM", speculative_tokens: int = 3, card: str = "",
) -> Path:  # fmt: skip
    """Save `head` in one of the published layouts (safetensors, and a README.md model card when given)."""
    from safetensors.torch import save_file

    c = head.config
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    if KIND_OF[layout] != c.kind:
        raise ValueError(f"a {c.kind} head cannot be written in the {layout} layout")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in head.state_dict().items() if k not in ("inv_freq", "d2t")
             and not k.startswith(("embed_tokens.", "lm_head."))}  # fmt: skip
    draft_vocab = head.lm_head.out_features
    reduced = head.d2t is not None
    if c.eagle or reduced:
        state["lm_head.weight"] = linear_weight(head.lm_head)
    if reduced:
        state["d2t"] = head.d2t - torch.arange(draft_vocab, device=head.d2t.device)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device=head.d2t.device)
        t2d[head.d2t] = True
        state["t2d"] = t2d
    speculators = {
        "algorithm": c.kind, "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": verifier, "architectures": [verifier_arch]},
    }  # fmt: skip
    block = {  # what speculators' block layouts (dflash, dspark, dflash2) share
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _layer_dict(c, "qwen3"),
        "draft_vocab_size": draft_vocab, "target_hidden_size": c.target_hidden_size or None,
        "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "aux_hidden_state_layer_ids": list(c.layers), "speculators_config": speculators,
    }  # fmt: skip
    if layout in ("speculators-eagle3", "speculators-peagle"):
        state["embed_tokens.weight"] = head.embed_tokens.weight
        peagle = layout == "speculators-peagle"
        config = {
            "architectures": ["PEagleSpeculator" if peagle else "Eagle3Speculator"],
            "speculators_model_type": c.kind,
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _layer_dict(c, "llama"),
            "draft_vocab_size": draft_vocab, "target_hidden_size": c.target_hidden_size or None,
            "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
            "fc_norm": c.fc_norm, "norm_output": c.norm_output, "embed_requires_grad": False,
            "eagle_aux_hidden_state_layer_ids": list(c.layers), "speculators_config": speculators,
        } | ({"mask_token_id": c.mask_token_id} if peagle else {})  # fmt: skip
    elif layout == "eagle3-original":
        if c.norm_before_residual or c.norm_before_fc or c.fc_norm or c.norm_output or c.num_layers != 1:
            raise ValueError("SafeAILab's layout has one layer and none of the norm options")
        state = {("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k: v
                 for k, v in state.items()}  # fmt: skip
        config = _layer_dict(c, "llama") | {"architectures": ["LlamaForCausalLMEagle3"],
                                            "draft_vocab_size": draft_vocab}  # fmt: skip
    elif layout == "dflash":
        config = _layer_dict(c, "qwen3") | {
            "architectures": ["DFlashDraftModel"], "block_size": c.block_size, "num_target_layers": 0,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.layers],
                              "causal": _one_causality(c)},
        }  # fmt: skip
    elif layout == "speculators-dspark":
        if any(bool(w) != k for w, k in zip(c.windows or (0,) * c.num_layers, c.causal or (False,) * c.num_layers)):
            raise ValueError("a DSpark config states a layer's block causality by its type: causal layers must be "
                             "the sliding ones")  # fmt: skip
        config = {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark"} | block | {
            "sliding_window_non_causal": False, "sample_from_anchor": c.sample_from_anchor,
            "markov_rank": c.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": bool(c.confidence),
            "confidence_head_with_markov": c.confidence == "hidden+markov",
        }  # fmt: skip
    elif layout == "speculators-mtp":
        back = {v: k for k, v in MTP_NAMES.items()}
        state = {"mtp_layers.0." + back.get(k, k.removeprefix("layers.0.")): v for k, v in state.items()}
        config = {
            "architectures": ["MTPDraftModel"], "speculators_model_type": "mtp",
            "speculators_version": SPECULATORS_VERSION, "num_nextn_predict_layers": 1,
            # the verifier's config, as the trainer writes it (its depth names the state the layer reads)
            "transformer_layer_config": _layer_dict(c, "qwen3") | {"num_hidden_layers": _depth(verifier)},
            "speculators_config": speculators,
        }  # fmt: skip
    elif layout == "speculators-dflash2":
        config = {"architectures": ["DFlash2Speculator"], "speculators_model_type": "dflash2"} | block | {
            "sliding_window_non_causal": not _one_causality(c), "sample_from_anchor": False,
            "conv_kernel_size": c.conv_kernel_size, "conv_group_size": c.conv_group_size,
            "selector_rank": c.selector_rank, "selector_top_k": c.selector_top_k,
        }  # fmt: skip
    else:
        config = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash"} | block | {
            # vLLM runs every layer's block causally iff this is false; speculators' own forward only sliding layers
            "sliding_window_non_causal": not _one_causality(c), "sample_from_anchor": False,
        }  # fmt: skip
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if card:
        (folder / "README.md").write_text(card)
    return folder


def _depth(verifier: str) -> int:
    """The layers of the verifier named by a local folder (1 where it is not one here)."""
    config = Path(verifier) / "config.json" if verifier else None
    return int(json.loads(config.read_text()).get("num_hidden_layers", 1)) if config and config.is_file() else 1


def _one_causality(c: HeadConfig) -> bool:
    """A DFlash head's block causality, one for all layers (what both DFlash layouts can state)."""
    causal = set(c.causal) or {False}
    if len(causal) > 1:
        raise ValueError("this head's layers differ in block causality: no DFlash layout states that")
    return causal.pop()


def random_head(target, kind: str = "eagle3", draft_vocab: int = 0, layers: int = 1, block_size: int = 8,
                mask_token_id: int = 0, seed: int = 0, **flags) -> Head:  # fmt: skip
    """A head with random layers for `target` (tests, and the forge's starting point): the target's layer shape,
    its embedding, and for EAGLE-3 an LM head of the target's rows for a draft vocabulary of `draft_vocab` ids
    (0: the whole vocabulary; P-EAGLE alike, with a random `mask_hidden`). A DSpark head takes its Markov rank,
    confidence head and layout as `flags` (HeadConfig's fields), a DFlash2 head its convolutions and selector (random,
    where its trainer starts the convolutions at the identity)."""
    text = target.config.get_text_config()
    p = next(target.parameters())
    heads, depth = text.num_attention_heads, text.num_hidden_layers
    block = kind in ("dflash", "dspark", "dflash2")
    mtp = kind == "mtp-head"
    c = HeadConfig(
        kind=kind, hidden_size=text.hidden_size, num_layers=layers, num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate_size=text.intermediate_size, rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        vocab_size=text.vocab_size,
        layers=dflash_layers(depth, layers) if block else (PRE_NORM,) if mtp else eagle3_layers(depth),
        draft_vocab_size=0 if block else draft_vocab, hidden_act=getattr(text, "hidden_act", "silu"),
        rope={"rope_theta": (getattr(text, "rope_parameters", None) or {}).get("rope_theta", 10000.0)},
        max_position_embeddings=getattr(text, "max_position_embeddings", 2048), qk_norm=block or mtp,
        norm_output=flags.pop("norm_output", False) or mtp,
        block_size=block_size if block else 0, mask_token_id=mask_token_id,
        layout="speculators-mtp" if mtp else f"speculators-{kind}", **flags,
    )  # fmt: skip
    torch.manual_seed(seed)
    head = Head(c).to(p.device, p.dtype)
    head.embed_tokens = target.get_input_embeddings()
    if kind == "peagle":
        with torch.no_grad():
            head.mask_hidden.normal_()  # speculators starts it at torch.randn too
    if kind == "dflash2":  # the trainer starts its convolutions at the identity: random ones, so that they matter
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "_conv." in name or name.startswith("candidate_selector."):
                    p.normal_(0.0, 0.3)
    if c.eagle:
        out = linear_weight(target.get_output_embeddings())
        keep = torch.arange(draft_vocab or c.vocab_size, device=p.device)
        head.lm_head = torch.nn.Linear(c.hidden_size, keep.numel(), bias=False, device=p.device, dtype=p.dtype)
        head.lm_head.weight.data = out[keep].clone()
        if draft_vocab and draft_vocab != c.vocab_size:
            head.d2t = keep
    else:
        head.lm_head = target.get_output_embeddings()
    return head.eval().requires_grad_(False)
