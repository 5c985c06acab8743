"""The forge's data: the target's own answers to prompts, with what a head learns from, written as it goes.

Self-distillation (EAGLE-3, HASS): the target answers the training prompts itself, greedily and sampled, in
left-padded batches (one prompt at a time leaves a CPU's matrix units idle: a batch of 48 one-token rows costs
about what 4 single rows do). Every pass of that generation already computes what a head needs, so nothing is run
twice: the hidden states of the layers the head reads (transformers' `hidden_states[i]`, i in [2, L//2, L-3]) for
every token fed, and the next-token distribution at every answer position, kept as its top-k (ids and
probabilities: the soft label). Rows leave the batch as their answers end. Only answers carry labels: a head drafts
answers, and a prompt's rows (the chat template's boilerplate, repeated in every sample, and the user's text) would
both cost an LM head pass here and flatter the validation figures (on the bundled model, one head scored 2.09 tokens
per verify pass with prompt rows counted and 1.33 without; the engine measured 1.26). Their features still serve
as the context the head attends over.
Where the prompts are few, the target writes new ones in their style (`VARIATION`, sampled), then answers those
too; what it wrote is data as well.

One batch becomes one shard under `DIR/data/` (safetensors, sequences packed end to end with their offsets), so a
run that stops keeps what it made and a resumed run reads it back instead of generating again. Features are kept in
16 bits (float16 when they fit, else bfloat16), labels as int32 ids and float16 probabilities. The data set in memory
is the shards mapped from disk (`read_shard`), not copies: its pages come from the OS's file cache as training
touches them and go back under pressure, so the data never has to fit in memory (an 8B target's features take
24.6 KB a token: a GPU's 15 minutes would make more than many hosts hold). What must fit is the disk: the data phase
stops, and says so, when the next shard would leave less than DISK_SPARE free.

Position bookkeeping (the head's rows, engine.decoding.heads): a sequence x_0..x_{n-1} (prompt of P tokens, then the
answer) has features g_0..g_{n-2} (every token fed to the target) and labels at positions P-1..n-2 (the distribution
of x_{j+1}); the head's row t reads (x_{t+1}, g_t) and learns the label at position t+1.

The data passes run in the target's own dtype: a head learns the features and the distributions the served target
produces (a float32 target's head trained on bfloat16 passes accepted 1.33 tokens per verify pass in float32 and 1.48
in bfloat16).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

TOP_K = 16  # probabilities kept per answer position: the soft label (the rest of the mass is dropped)
DISK_SPARE = 2 * 2**30  # bytes the data phase leaves free on the disk it writes to

# Follow-up turns the forge adds to the target's own conversations: where the prompts are few, these keep the data on
# the prompts' subjects and in the target's own voice. New prompts written by a small target (VARIATION) drift into
# noise: the bundled model's came out as "A japan's espresson. Ok, so here's an example of a request...".
FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Give a concrete example.",
    "Summarize your answer in two sentences.",
    "Explain it to a twelve-year-old.",
    "What are the most common mistakes here?",
    "Rewrite your answer as a short list of steps.",
    "Why is that? Give the reasoning behind it.",
    "What would change if the situation were different?",
    "Make your answer more formal.",
    "What should I do next?",
    "Can you check your answer and correct anything wrong?",
    "Give me a different way to do it.",
)

VARIATION = (
    "Here is an example of a request a user sent to an assistant:\n\n{prompt}\n\n"
    "Write one new request of the same kind, on a different subject. Reply with the new request only."
)


@dataclass
class Sequence:
    """One prompt and the target's answer, with the head's inputs and labels (see the module docstring)."""

    tokens: list[int]
    prompt_len: int
    features: torch.Tensor  # (n - 1, layers x hidden), 16 bits
    top_ids: torch.Tensor  # (n - 1, TOP_K) int32: the label of position j sits in row j (zeros in the prompt)
    top_p: torch.Tensor  # (n - 1, TOP_K) float16
    source: str = ""  # "greedy" | "sampled" | "variation" | "ask" (the target writing a new prompt)
    prompt_id: str = ""

    @property
    def answer_len(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Batch:
    """Prompts' token ids, generated together; each row with its own temperature (0: greedy) and source, so a prompt's
    greedy and sampled answers share one batch."""

    prompts: list[list[int]]
    ids: list[str]
    temperature: float | list[float]
    max_new_tokens: int
    source: str | list[str]

    def __post_init__(self):
        n = len(self.prompts)
        self.temperatures = list(self.temperature) if isinstance(self.temperature, list) else [self.temperature] * n
        self.sources = list(self.source) if isinstance(self.source, list) else [self.source] * n


def feature_dtype(features: torch.Tensor) -> torch.dtype:
    """float16 keeps 3 more bits than bfloat16 where the states fit its range (some models' residual streams
    carry values in the thousands)."""
    return torch.float16 if features.abs().max().item() < 6e4 else torch.bfloat16


def eos_of(model, tokenizer) -> set[int]:
    from engine.decoding.runtime import eos_ids

    return eos_ids(model, tokenizer)


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _pick(logits: torch.Tensor, top: torch.Tensor, temperatures: torch.Tensor,
          generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """Next tokens (B,) from last-row logits (B, V) and their top-k ids (B, k): per row the argmax (temperature 0:
    the top-k's first, no second pass over the vocabulary) or a draw at its temperature, by the inverse of the
    cumulative distribution (one uniform number per row). torch.multinomial drew an exponential for every entry of
    the vocabulary: 100 ms a step for 128 rows of the bundled model's 49,152, 29% of a bfloat16 data pass."""
    greedy = top[:, 0]
    rows = torch.nonzero(temperatures > 0)[:, 0]
    if not rows.numel():
        return greedy
    probs = torch.softmax(logits[rows] / temperatures[rows, None], -1)
    cdf = probs.cumsum(-1)
    # drawn where the generator lives (the forge's is a CPU one), so a seed draws the same numbers on every device
    u = torch.rand((rows.numel(), 1), generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
    return greedy.index_copy(0, rows, drawn)


class Rows:
    """What each prompt of a batch has made so far, by its index in the batch (rows leave the running batch as they
    finish, so a running row's index there is not its index here)."""

    def __init__(self, n: int):
        self.feats, self.tops, self.probs, self.tokens = ([[] for _ in range(n)] for _ in range(4))

    def add(self, active: list[int], feats, top, p, token) -> None:
        token_list = token.tolist()
        for j, r in enumerate(active):
            if feats is not None:
                self.feats[r].append(feats[j])
            self.tops[r].append(top[j])
            self.probs[r].append(p[j])
            self.tokens[r].append(token_list[j])


def _growing_cache(model):
    """A DynamicCache whose full-attention layers write their keys and values into room kept ahead (doubling) rather
    than concatenating: at every step DynamicLayer copied the whole cache of every layer, 18% of a bfloat16 data
    pass of 128 rows and 128 new tokens."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Growing(DynamicLayer):
        length = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.room_k = self.room_v = None
            end = self.length + key_states.shape[-2]
            if self.room_k is None or end > self.room_k.shape[-2]:
                size = max(end, 2 * (0 if self.room_k is None else self.room_k.shape[-2]))
                shape = key_states.shape[:2] + (size,) + key_states.shape[3:]
                room_k, room_v = key_states.new_empty(shape), value_states.new_empty(shape)
                if self.length:
                    room_k[..., : self.length, :] = self.keys
                    room_v[..., : self.length, :] = self.values
                self.room_k, self.room_v = room_k, room_v
            self.room_k[..., self.length : end, :] = key_states
            self.room_v[..., self.length : end, :] = value_states
            self.length = end
            self.keys, self.values = self.room_k[..., :end, :], self.room_v[..., :end, :]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.length:
                self.room_k, self.room_v = self.room_k[indices], self.room_v[indices]
                self.keys, self.values = self.room_k[..., : self.length, :], self.room_v[..., : self.length, :]

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            self.length = self.get_seq_length()

    cache = DynamicCache(config=model.config)
    cache.layers = [Growing() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def generate(model, batch: Batch, layers: tuple[int, ...], eos: set[int], generator: torch.Generator,
             deadline: float = float("inf"), compact: float = 0.25, stop=None) -> list[Sequence]:  # fmt: skip
    """The target answers a batch of prompts, left-padded, over a KV cache; each pass's hidden states of `layers`
    and top-k next-token probabilities are kept. A row stops at EOS or max_new_tokens, all at `deadline`
    (time.perf_counter()) or when `stop` (a threading.Event) is set, keeping what they have so far. Once `compact`
    of the running rows have finished they leave the batch (their keys and values too): answers end at very
    different lengths, and a finished row costs a running one's compute."""
    device = next(model.parameters()).device
    ids, mask = _left_pad(batch.prompts, 0)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = _growing_cache(model)
    rows, active = Rows(len(batch.prompts)), list(range(len(batch.prompts)))
    temperatures = torch.tensor(batch.temperatures, dtype=torch.float32, device=device)
    # the last row's logits only, picked by index: `logits_to_keep=1` slices the states into a strided (B, 1, H) view,
    # which the LM head's matmul turned into a batched product over B copies of its weight (a bfloat16 prefill of
    # 128 prompts took 14.9 s instead of 2.4 s; with an 8B target's vocabulary the copies would not fit a GPU)
    last = torch.tensor([ids.shape[1] - 1], device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    output_hidden_states=True, logits_to_keep=last)  # fmt: skip
        prompt_feats = torch.cat([out.hidden_states[i] for i in layers], -1).float()  # (B, width, F)
        finished = torch.zeros(len(active), dtype=torch.bool)
        for step in range(batch.max_new_tokens):
            feats = None if step == 0 else torch.cat([out.hidden_states[i][:, -1] for i in layers], -1).float()
            logits = out.logits[:, -1].float()  # (B, V)
            p, top = torch.softmax(logits, -1).topk(TOP_K, -1)
            token = _pick(logits, top, temperatures, generator)
            running = ~finished
            keep = [j for j in range(len(active)) if running[j]]
            rows.add([active[j] for j in keep], None if feats is None else feats[keep], top[keep].to(torch.int32),
                     p[keep].to(torch.float16), token[keep])  # fmt: skip
            finished |= torch.tensor([int(t) in eos for t in token.tolist()])
            late = time.perf_counter() > deadline or (stop is not None and stop.is_set())
            if bool(finished.all()) or step + 1 == batch.max_new_tokens or late:
                break
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)], 1)
            positions = positions[:, -1:] + 1
            if int(finished.sum()) >= max(1, compact * len(active)):
                stay = torch.nonzero(~finished)[:, 0]
                cache.batch_select_indices(stay.to(device))
                mask, positions, token, temperatures = mask[stay], positions[stay], token[stay], temperatures[stay]
                active = [active[j] for j in stay.tolist()]
                finished = torch.zeros(len(active), dtype=torch.bool)
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True, output_hidden_states=True)  # fmt: skip
    return _sequences(batch, prompt_feats, rows, eos)


def _sequences(batch: Batch, prompt_feats: torch.Tensor, rows: Rows, eos: set[int]) -> list[Sequence]:
    """Per-row sequences (left padding and everything after a row's EOS dropped)."""
    width = prompt_feats.shape[1]
    out = []
    for i, prompt in enumerate(batch.prompts):
        answer = rows.tokens[i]
        end = next((k + 1 for k, t in enumerate(answer) if t in eos), len(answer))
        answer = answer[:end]
        n = len(prompt) + len(answer)
        # features of every token fed: the prompt's (prefill) and the answer's but its last
        answer_feats = rows.feats[i][: len(answer) - 1]
        f = torch.cat([prompt_feats[i, width - len(prompt) :]] + ([torch.stack(answer_feats)] if answer_feats else []))
        ids = torch.zeros((n - 1, TOP_K), dtype=torch.int32)  # the prompt's rows: no labels
        p = torch.zeros((n - 1, TOP_K), dtype=torch.float16)
        ids[len(prompt) - 1 :] = torch.stack(rows.tops[i][: len(answer)])
        p[len(prompt) - 1 :] = torch.stack(rows.probs[i][: len(answer)])
        features = f.to("cpu", feature_dtype(f))  # shards are written from, and kept in, host memory
        out.append(Sequence(prompt + answer, len(prompt), features, ids, p, batch.sources[i], batch.ids[i]))
    return out


def texts(tokenizer, sequences: list[Sequence], eos: set[int]) -> list[str]:
    """The answers as text (for new prompts written by the target)."""
    return [tokenizer.decode([t for t in s.tokens[s.prompt_len :] if t not in eos], skip_special_tokens=True).strip()
            for s in sequences]  # fmt: skip


def usable_variation(text: str, seen: set[str]) -> bool:
    """A prompt the target wrote that is worth answering: not empty, not huge, not a repeat."""
    key = normalised(text)
    if not 15 <= len(text) <= 800 or key in seen:
        return False
    seen.add(key)
    return True


def normalised(text: str) -> str:
    """A prompt as compared for repeats: lower case, whitespace collapsed."""
    return " ".join(text.lower().split())


def prompt_id(text: str, prefix: str = "gen") -> str:
    return f"{prefix}-" + hashlib.sha256(text.encode()).hexdigest()[:12]


# --- shards on disk -----------------------------------------------------------------------------------------------


def disk_full(folder: Path, sequences: list[Sequence], spare: int | None = None) -> str:
    """Why the next shard should not be written ("" when it fits with `spare` bytes, DISK_SPARE by default, left on
    the disk)."""
    import shutil

    spare = DISK_SPARE if spare is None else spare
    folder.mkdir(parents=True, exist_ok=True)
    need = sum(s.features.nbytes + s.top_ids.nbytes + s.top_p.nbytes + 8 * len(s.tokens) for s in sequences)
    free = shutil.disk_usage(folder).free
    if free - need >= spare:
        return ""
    left = max(free - need, 0) / 2**30
    return (f"stopped making data: the next shard ({need / 2**20:.0f} MiB) would leave {left:.1f} GiB free on the "
            f"disk of {folder} (the forge keeps {spare / 2**30:.0f} GiB); training on what was made. Free some space "
            "or give --out another disk for more.")  # fmt: skip


def write_shard(folder: Path, index: int, sequences: list[Sequence], split: str) -> Path:
    """One shard: the sequences packed end to end (tokens, features, labels) and their offsets."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([len(s.tokens) for s in sequences], dtype=torch.int64)
    tensors = {
        "tokens": torch.tensor([t for s in sequences for t in s.tokens], dtype=torch.int32),
        "lengths": lengths, "prompt_lens": torch.tensor([s.prompt_len for s in sequences], dtype=torch.int64),
        "features": torch.cat([s.features.to(sequences[0].features.dtype) for s in sequences]),
        "top_ids": torch.cat([s.top_ids for s in sequences]), "top_p": torch.cat([s.top_p for s in sequences]),
    }  # fmt: skip
    meta = {"split": split, "sources": json.dumps([s.source for s in sequences]),
            "prompt_ids": json.dumps([s.prompt_id for s in sequences])}  # fmt: skip
    path = folder / f"shard-{index:05d}-{split}.safetensors"
    part = path.with_suffix(".part")  # a run killed while writing leaves no half shard for a resume to read
    save_file(tensors, str(part), metadata=meta)
    part.replace(path)
    return path


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
                      "I64": torch.int64}  # fmt: skip


def mapped(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A safetensors file's tensors as views of the file mapped copy-on-write (nothing is read until touched, and
    pages stay the OS's to drop), and its metadata. safetensors orders tensors so that each starts aligned to its
    element size."""
    import mmap

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # the map outlives the file descriptor
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        flat = torch.frombuffer(view, dtype=dtype, count=count, offset=8 + size + start) if count else \
            torch.empty(0, dtype=dtype)  # fmt: skip
        tensors[name] = flat.view(info["shape"])  # the tensor keeps the map alive
    return tensors, header.get("__metadata__") or {}


def read_shard(path: Path) -> tuple[str, list[Sequence]]:
    """A shard's sequences, their features and labels mapped from the file (see `mapped`)."""
    t, meta = mapped(path)
    sources, ids = json.loads(meta["sources"]), json.loads(meta["prompt_ids"])
    out, at, row = [], 0, 0
    for i, (n, p) in enumerate(zip(t["lengths"].tolist(), t["prompt_lens"].tolist())):
        rows = slice(row, row + n - 1)
        out.append(Sequence(t["tokens"][at : at + n].tolist(), p, t["features"][rows], t["top_ids"][rows],
                            t["top_p"][rows], sources[i], ids[i]))  # fmt: skip
        at, row = at + n, row + n - 1
    return meta["split"], out


@dataclass
class Dataset:
    """Every sequence made so far, by split ("train" or "val": prompts of the training side kept for early stopping
    and for the held-out figures; the evaluation prompts are never generated here)."""

    train: list[Sequence] = field(default_factory=list)
    val: list[Sequence] = field(default_factory=list)
    shards: int = 0

    def add(self, split: str, sequences: list[Sequence]) -> None:
        (self.val if split == "val" else self.train).extend(sequences)

    def answer_tokens(self, split: str = "train") -> int:
        """Answer tokens: the positions with a label."""
        return sum(s.answer_len for s in (self.val if split == "val" else self.train))

    def bytes(self) -> int:
        return sum(s.features.numel() * s.features.element_size() + s.top_ids.numel() * 6
                   for s in self.train + self.val)  # fmt: skip

    @classmethod
    def read(cls, folder: Path) -> "Dataset":
        data = cls()
        for path in sorted(folder.glob("shard-*.safetensors")):
            split, sequences = read_shard(path)
            data.add(split, sequences)
            data.shards += 1
        return data


class Replay:
    """The sequences already on disk, by (split, prompt id, source): a resumed forge runs its plan again and takes
    what was made from here instead of generating it twice (the plan is seeded, and what it reads back from the
    target's answers, follow-ups and new prompts, comes from these same sequences)."""

    def __init__(self, dataset: Dataset):
        self.left: dict[tuple[str, str, str], list[Sequence]] = {}
        for split, sequences in (("train", dataset.train), ("val", dataset.val)):
            for s in sequences:
                self.left.setdefault((split, s.prompt_id, s.source), []).append(s)
        self.taken = 0  # answer tokens taken back

    def take(self, split: str, batch: Batch) -> tuple[list[Sequence | None], Batch | None]:
        """The batch's rows found on disk (None where missing) and a batch of the missing rows (None if none)."""
        found: list[Sequence | None] = []
        for prompt_id, source in zip(batch.ids, batch.sources):
            stack = self.left.get((split, prompt_id, source))
            found.append(stack.pop(0) if stack else None)
        self.taken += sum(s.answer_len for s in found if s is not None)
        missing = [i for i, s in enumerate(found) if s is None]
        if not missing:
            return found, None
        rest = Batch([batch.prompts[i] for i in missing], [batch.ids[i] for i in missing],
                     [batch.temperatures[i] for i in missing], batch.max_new_tokens,
                     [batch.sources[i] for i in missing])  # fmt: skip
        return found, rest


# --- the plan: which prompts, answered how ----------------------------------------------------------------------


def batches(prompts: list[tuple[str, list[int]]], size: int, temperatures: tuple[float, ...], max_new_tokens: int,
            sources: tuple[str, ...]) -> Iterator[Batch]:  # fmt: skip
    """Every prompt answered once at each of `temperatures` (its rows labelled with the matching `sources`), prompts
    of similar length together (less padding), `size` rows at a time."""
    rows = [(p, t, src) for p in prompts for t, src in zip(temperatures, sources)]
    rows.sort(key=lambda r: len(r[0][1]))
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        yield Batch([r[0][1] for r in chunk], [r[0][0] for r in chunk], [r[1] for r in chunk], max_new_tokens,
                    [r[2] for r in chunk])  # fmt: skip

