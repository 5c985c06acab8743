"""The forge: an EAGLE-3 head for a target, made on the machine at hand within a time budget.

    1. prompts   the task suite's categories or a prompts file (engine.measure.promptsets); a held-out share set
                 aside by hash (never generated on, never trained on: the final measurement's), a validation share
                 of the rest (generated, never trained on: early stopping and the held-out figures)
    2. data      the target answers the training prompts (greedy and sampled rows in the same batches), then
                 general prompts (engine.forge.bank) with rounds of follow-up questions after its first answers
                 between them (without general prompts: follow-ups, then new prompts it writes), until the data
                 share of the budget is spent (engine.forge.data)
    3. vocab     the draft vocabulary from the labels (covering `coverage` of them)
    4. train     TTT training with soft labels, evaluated on the validation data every so often; the best state kept
    5. export    speculators layout (engine.models.heads.write_head) with a model card

`forge_events` yields ForgeEvents (phase, progress, ETA, loss and acceptance per draft position) for the CLI and the
Lab; `forge` drains them. A stop flag ends the current phase at the next batch and the best state is still written.
A folder that already holds data and a checkpoint resumes: its data is read back, training continues; a run cut
short while making data replays its plan over the shards on disk and generates only what is missing.
"""

from __future__ import annotations

import copy
import json
import random
import signal
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from engine.errors import blame
from engine.forge import BANKS
from engine.forge import data as D
from engine.forge import train as T

ASK_TEMPERATURE = 0.7  # new prompts written by the target: at 1.0 a small target's drift into noise
MAX_STEPS = 8  # train-time-test steps: EAGLE-3 trains 7
# general prompts taken for this many batches at once and batched by length: a text to rewrite is ~200 tokens where
# a question is ~45, and a few of them in a batch padded every row's prefill to their length
GENERAL_GROUP = 4
VAL_SHARE = 0.1  # of the training side's prompts (and of the target's new prompts): validation, never trained on


@dataclass
class ForgeConfig:
    target: str
    out: str
    suite: str | None = None  # task categories (comma-separated; all when empty) or a prompts file / dataset
    minutes: float = 15.0  # the whole budget: loading, data, training, export and the "does it pay" bench (Plan)
    held_out: float = 0.2  # share of the prompts kept for the final measurement (by hash of their ids)
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    # the data passes: "target" (its own dtype: the features the served target produces) or a 16-bit dtype for a copy
    # of a float32 target, on CPUs with fast 16-bit units 1.8x the answer tokens a second (bundled model, AMX Xeon)
    data_dtype: str = "target"
    data_share: float = 0.5  # of the budget left after loading
    batch_size: int = 128  # rows generated together (a 128-row step makes 1.4x the tokens/s of a 48-row one)
    max_new_tokens: int = 128
    temperature: float = 0.8  # the sampled answers' (each prompt is answered greedily too)
    general: bool = True  # general prompts (engine.forge.bank) beside the given ones once those are answered
    bank: str = "workload"  # BANKS: general prompts' kinds in proportion to the given prompts' categories, or "even"
    variations: bool = True  # without general prompts: the target writes new prompts when the given ones are spent
    # train-time-test steps, the longest draft trained (--gamma-max); 0: 2 on a CPU, 4 on a GPU. Training is what a
    # CPU's budget runs short of (validation acceptance still climbing at the end of 15 minutes), a step costs about
    # `steps` forward passes, and a CPU's verify costs make gamma 1-2 the best there: on the bundled model's data
    # (bfloat16, 132.7k answer tokens, 7 minutes of training, AMX Xeon) 2 steps made 958 updates against 546 and
    # validation acceptance 0.51 / 0.52 at positions 1 / 2 against 0.45 / 0.46
    steps: int = 0
    coverage: float = 0.97  # of the training labels the draft vocabulary covers
    lr: float = 1e-3
    init: str = "random"  # or "target": the layer starts as the target's last layer. Measured on the bundled model's
    # validation answers: soft-label loss 46 at the start from the target's layer against 12 from random weights
    # (18 with the layer's output projections zeroed), and after 14 steps acceptance at position 1 0.08 against 0.16
    batch_rows: int = 1024  # padded rows per training batch (more, smaller steps: a few minutes of CPU buy few)
    threads: str = "auto"  # "auto": timed (engine.forge.machine); or a number
    fast: str = "auto"  # training passes in bfloat16 where the CPU does those far faster ("auto"), "off"
    pays: bool = True  # measure the head against prompt lookup, suffix and the target alone at the end
    pays_repeats: int = 1
    pays_max_new_tokens: int = 64


@dataclass
class ForgeEvent:
    phase: str  # load | data | vocab | train | export | pays | done
    message: str
    done: float = 0.0  # of this phase, 0-1
    eta_s: float | None = None  # of the whole budget
    metrics: dict = field(default_factory=dict)  # train: loss, acceptance per position; done: the result


@dataclass
class ForgeResult:
    folder: str
    timing: dict  # seconds per phase
    data: dict
    vocabulary: dict
    training: dict
    held_out: dict  # validation acceptance per position, expected accepted length, recommended gamma
    pays: dict | None = None
    card: str = ""


class Budget:
    """Wall-clock budget of a run, from its start; each phase's seconds recorded."""

    def __init__(self, minutes: float):
        self.start = time.perf_counter()
        self.end = self.start + minutes * 60
        self.spent: dict[str, float] = {}
        self._phase, self._since = None, self.start

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        if self._phase:
            self.spent[self._phase] = self.spent.get(self._phase, 0.0) + now - self._since
        self._phase, self._since = name, now

    def left(self) -> float:
        return self.end - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


PAYS_SHARE = 0.3  # of the budget, the most the final measurement is planned to take: the rest makes the head
PROCESS_S = 10.0  # the measurement's own process: Python, torch and transformers imported before it loads the target
FLOORS = {"data": 10.0, "train": 5.0, "export": 5.0}  # seconds no phase gets less of, whatever the budget


@dataclass
class Plan:
    """The budget cut into the phases' seconds, made once the target is loaded: what loading took, then the data,
    training (the vocabulary with it), export and the final measurement. The measurement is planned from the target's
    one-token pass (it runs A/B pairs of answers on the held-out prompts) and measures as many of those prompts as
    PAYS_SHARE of the budget allows, one at least. The seconds add up to the budget unless the FLOORS outgrow it (a
    budget of well under a minute): `over` says by how much."""

    load: float
    data: float
    train: float
    export: float
    pays: float
    prompts: int  # held-out prompts the measurement takes (the first ones of held-out.jsonl)
    held_out: int  # held-out prompts there are
    over: float = 0.0

    def seconds(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("load", "data", "train", "export", "pays")}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds().items() if k != "load")
        pays = ""
        if self.prompts:
            share = "all" if self.prompts == self.held_out else f"{self.prompts} of"
            pays = f"; the measurement takes {share} {self.held_out} held-out prompts"
        over = f"; {self.over:.0f} s over the budget: its floors outgrow it" if self.over > 0 else ""
        return f"plan after loading ({self.load:.0f} s): {parts}{pays}{over}"


def measurement_s(cfg: ForgeConfig, turns: list[int], pass_s: float, load_s: float) -> float:
    """Seconds the does-it-pay measurement of prompts with these turns is planned at: its process, the target loaded
    again, then per prompt-turn and cell a warm-up and `pays_repeats` A/B pairs of `pays_max_new_tokens` tokens, each
    side counted as one one-token pass a token (the speculative side takes fewer: a margin for prefills and the
    head's steps). Cells: a chain and a tree per trained gamma, prompt lookup and suffix."""
    from engine.compare import WARM_STEPS

    cells = 2 * cfg.steps + 2
    per_turn = cells * (2 * WARM_STEPS + cfg.pays_repeats * 2 * cfg.pays_max_new_tokens) * pass_s
    return PROCESS_S + load_s + per_turn * sum(turns)


def plan_budget(cfg: ForgeConfig, load_s: float, pass_s: float, turns: list[int]) -> Plan:
    """The phases' seconds for a budget of cfg.minutes, `load_s` of it spent loading, a one-token pass of `pass_s`
    and held-out prompts of `turns` turns each (see Plan)."""
    budget = cfg.minutes * 60
    export = max(FLOORS["export"], 0.02 * budget)
    prompts, pays = 0, 0.0
    if cfg.pays and turns:
        fits = [k for k in range(1, len(turns) + 1) if measurement_s(cfg, turns[:k], pass_s, load_s) <= PAYS_SHARE
                * budget]  # fmt: skip
        prompts = max(fits, default=1)
        pays = measurement_s(cfg, turns[:prompts], pass_s, load_s)
    rest = budget - load_s - export - pays
    data = max(FLOORS["data"], cfg.data_share * rest)
    train = max(FLOORS["train"], rest - data)
    over = load_s + data + train + export + pays - budget
    return Plan(load_s, data, train, export, pays, prompts, len(turns), over)


# --- prompts ------------------------------------------------------------------------------------------------------


def prompt_sets(cfg: ForgeConfig):
    """(train, val, held_out) PromptSets: held-out by the promptsets hash, validation by a second hash."""
    from engine.measure import promptsets

    found = promptsets.load(cfg.suite)
    if cfg.held_out == 1:  # every given prompt measured, none trained on: a head from general prompts alone
        if not cfg.general:
            from engine.errors import UserError

            raise UserError("a held-out share of 1 leaves no prompts to train on without general prompts: give a "
                            "smaller share, or let the forge use its general prompts.")  # fmt: skip
        return found.narrowed([], part="train"), found.narrowed([], part="val"), found.narrowed(found.items,
                                                                                                 part="held-out")
    train_side, held = found.split(cfg.held_out, cfg.seed) if cfg.held_out else (found, found.narrowed([]))
    inside = [i for i in train_side.items if not promptsets.is_held_out(i.id, VAL_SHARE, cfg.seed + 1)]
    val = [i for i in train_side.items if promptsets.is_held_out(i.id, VAL_SHARE, cfg.seed + 1)]
    if not val and len(inside) > 1:  # a validation set is needed: the last item then
        val = inside[-1:]
        inside = inside[:-1]
    if not inside:
        from engine.errors import UserError

        raise UserError(f"{found.name} leaves no prompts to train on after the held-out share {cfg.held_out}: give "
                        "more prompts or a smaller held-out share.")  # fmt: skip
    return train_side.narrowed(inside, part="train"), train_side.narrowed(val, part="val"), held


def _encoded(loaded, items, chat) -> list[tuple[str, list[int]]]:
    from engine.decoding.runtime import encode_prompt

    return [(i.id, encode_prompt(loaded.tokenizer, i.prompt, chat)) for i in items]


# --- the pipeline -------------------------------------------------------------------------------------------------


class Forge:
    """One forge run's state, its phases as generator methods yielding ForgeEvents."""

    def __init__(self, cfg: ForgeConfig, stop: threading.Event | None = None, notify=None):
        self.cfg, self.stop = cfg, stop or threading.Event()
        self.notify = notify or (lambda event: None)  # events from inside a phase that cannot yield (the bench)
        self.out = Path(cfg.out)
        self.budget = Budget(cfg.minutes)
        self.state = self._read_state()
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.data_note = ""  # why the data phase ended early (the disk), when it did
        self.bank_shares: dict | None = None  # the general prompts' kinds (engine.forge.bank.kind_shares)

    # -- state on disk (resume) --
    def _read_state(self) -> dict:
        path = self.out / "forge-state.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _write_state(self, **values) -> None:
        self.state.update(values)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "forge-state.json").write_text(json.dumps(self.state, indent=1))

    def eta(self) -> float:
        return max(0.0, self.budget.left())

    def event(self, phase: str, message: str, done: float = 0.0, **metrics) -> ForgeEvent:
        return ForgeEvent(phase, message, done, self.eta(), metrics)

    # -- 0. load --
    def load(self) -> Iterator[ForgeEvent]:
        from engine.forge.machine import choose
        from engine.models.loading import MODELS

        self.budget.phase("load")
        yield self.event("load", f"loading {self.cfg.target}")
        said: list[str] = []
        # stock layers (pack=False): the forge reads the target's weights and runs batched passes, which the CPU
        # layouts of engine.models.cpu are not made for; the final measurement loads the engine's own form
        with blame("target"):  # a model that cannot be found or loaded is the target's fault, not the forge's
            self.loaded = MODELS.get(self.cfg.target, self.cfg.dtype, self.cfg.device, said.append, pack=False)
        model = self.loaded.model
        text = model.config.get_text_config()
        from engine.models.heads import eagle3_layers

        self.layers = eagle3_layers(text.num_hidden_layers)
        self.eos = D.eos_of(model, self.loaded.tokenizer)
        self.chat = self.loaded.has_chat_template
        threads = None if self.cfg.threads == "auto" else int(self.cfg.threads)
        if threads:
            torch.set_num_threads(threads)
        self.machine = choose(text.hidden_size, self.loaded.device, self.loaded.dtype, self.cfg.fast != "off")
        if not self.cfg.steps:
            self.cfg = replace(self.cfg, steps=2 if self.loaded.device.type == "cpu" else 4)
        if threads:
            torch.set_num_threads(threads)
            self.machine.threads = threads
        own = str(self.loaded.dtype).removeprefix("torch.")
        self.data_dtype = own if self.cfg.data_dtype in ("target", own) else self.cfg.data_dtype
        self.data_copy = self.data_dtype != own  # the data passes on a copy of the target in that dtype
        data = f"; data passes on a {self.data_dtype} copy" if self.data_copy else ""
        yield self.event("load", f"{self.loaded.describe()}; {self.machine.describe()}{data}; train-time test over "
                         f"{self.cfg.steps} steps", 1.0)  # fmt: skip
        self.plan = self._plan_budget()
        yield self.event("load", self.plan.describe(), 1.0, plan=asdict(self.plan))

    def _plan_budget(self) -> Plan:
        """The phases' seconds (Plan), from what loading took and the target's one-token pass, timed now."""
        from engine.decoding.runtime import time_passes

        with torch.inference_mode():
            pass_s = time_passes(self.loaded.model, (1,))[1] if self.cfg.pays and self.held_set.items else 0.0
        turns = [len(i.turns) for i in self.held_set.items]
        return plan_budget(self.cfg, self.budget.elapsed(), pass_s, turns)

    # -- 1. data --
    def make_data(self) -> Iterator[ForgeEvent]:
        folder = self.out / "data"
        self.dataset = D.Dataset.read(folder) if folder.is_dir() else D.Dataset()
        if self.state.get("data_done") and self.dataset.train:
            self.budget.phase("data")
            yield self.event("data", f"read {self.dataset.answer_tokens():,} answer tokens back from {folder}", 1.0)
            return
        self.budget.phase("data")
        model = self.loaded.model
        if self.data_copy:
            from engine.models.loading import resolve_dtype

            model = copy.deepcopy(model).to(resolve_dtype(self.data_dtype, self.loaded.device))
        deadline = time.perf_counter() + self.plan.data
        started = time.perf_counter()
        made_before = self.dataset.answer_tokens() + self.dataset.answer_tokens("val")
        replay = D.Replay(self.dataset)  # a run cut short in this phase (killed, not stopped) goes on where it was
        for what in self._plan(deadline):
            if self.stop.is_set() or time.perf_counter() > deadline:
                break
            split, batch = what
            if split == "ask":  # the target writing new prompts: its text is training data too
                split = "train"
            found, missing = replay.take(split, batch)
            if missing is None:
                self._made = found  # what the plan reads back: new prompts, answers to follow up on
                continue
            if replay.taken:
                yield self.event("data", f"read {replay.taken:,} answer tokens back from {folder}; going on from "
                                 "there", 0.0)  # fmt: skip
                replay.taken = 0
            sequences = D.generate(model, missing, self.layers, self.eos, self.generator, deadline, stop=self.stop)
            rows = iter(sequences)
            self._made = [s if s is not None else next(rows) for s in found]
            self.data_note = D.disk_full(folder, sequences)
            if self.data_note:
                yield self.event("data", self.data_note, 1.0)
                break
            path = D.write_shard(folder, self.dataset.shards, sequences, split)
            self.dataset.shards += 1
            self.dataset.add(split, D.read_shard(path)[1])  # mapped from the file: memory holds no copy
            made = self.dataset.answer_tokens() + self.dataset.answer_tokens("val") - made_before
            rate = made / max(time.perf_counter() - started, 1e-6)  # answer tokens: the labelled positions
            share = min(1.0, (time.perf_counter() - started) / max(deadline - started, 1e-6))
            train, val = len(self.dataset.train), len(self.dataset.val)
            yield self.event("data", f"{made:,} answer tokens ({rate:.0f}/s), {train} train and {val} validation "
                             "sequences", share, tokens=made, rate=rate)  # fmt: skip
        # a run the disk cut short makes the rest when resumed with space to spare
        self._write_state(data_done=not self.data_note, data_tokens=self.dataset.answer_tokens())

    def _plan(self, deadline: float) -> Iterator[tuple[str, D.Batch]]:
        """Validation answers first (small), then greedy and sampled answers to the training prompts, then rounds of
        follow-up questions after the target's own greedy answers (D.FOLLOW_UPS), then rounds of new prompts the
        target writes (a full batch of asks each round, the new prompts answered greedily and sampled). After each
        yield, make_data leaves the batch's sequences in self._made."""
        cfg = self.cfg
        train = _encoded(self.loaded, self.train_set.items, self.chat)
        val = _encoded(self.loaded, self.val_set.items, self.chat)
        size, n = cfg.batch_size, cfg.max_new_tokens
        both = (0.0, cfg.temperature)
        talks = {i.id: [{"role": "user", "content": i.prompt}] for i in self.train_set.items + self.val_set.items}
        for b in D.batches(val, size, (0.0,), n, ("greedy",)):
            yield "val", b
            self._answered(talks, self._made)
        for b in D.batches(train, size, both, n, ("greedy", "sampled")):
            yield "train", b
            self._answered(talks, self._made)
        val_ids = {i.id for i in self.val_set.items}
        if cfg.general:
            yield from self._general(talks, val_ids, deadline)
            return
        for round_ in range(len(D.FOLLOW_UPS)):
            if time.perf_counter() >= deadline or self.stop.is_set():
                return
            yield from self._follow_ups(talks, val_ids, round_)
        seen = {D.normalised(i.prompt) for i in self.train_set.items + self.val_set.items}
        sources = [i.prompt for i in self.train_set.items]
        rounds = 0
        while cfg.variations and rounds < 50 and time.perf_counter() < deadline and not self.stop.is_set():
            rounds += 1
            yield from self._variations(sources, seen, rounds, deadline)

    def _general(self, talks: dict[str, list[dict]], val_ids: set[str],
                 deadline: float) -> Iterator[tuple[str, D.Batch]]:  # fmt: skip
        """General prompts (engine.forge.bank) in full batches of similar lengths, a round of follow-ups on the given
        prompts between them while there are rounds left; each prompt answered once, greedily or sampled by turns. A
        first batch of them, answered greedily, is validation data: new subjects, as the held-out prompts are."""
        from engine.decoding.runtime import encode_prompt
        from engine.forge.bank import Bank

        cfg, tok = self.cfg, self.loaded.tokenizer
        given = self.train_set.items + self.val_set.items + self.held_set.items
        categories = [i.category for i in given] if cfg.bank == "workload" else None
        general = Bank(cfg.seed, [i.prompt for i in given], categories)
        self.bank_shares = general.shares.copy()
        general.use([t[1]["content"] for t in talks.values() if len(t) > 1])
        first = [(i, encode_prompt(tok, p, self.chat)) for i, p in general.take(min(32, cfg.batch_size))]
        for b in D.batches(first, cfg.batch_size, (0.0,), cfg.max_new_tokens, ("general",)):
            yield "val", b
        round_, pending = 0, []
        while time.perf_counter() < deadline and not self.stop.is_set():
            if round_ < len(D.FOLLOW_UPS):
                yield from self._follow_ups(talks, val_ids, round_)
                round_ += 1
            if not pending:  # a few batches' worth at a time, by length: the long ones padded together
                pending = sorted(((i, encode_prompt(tok, p, self.chat)) for i, p in general.take(
                    GENERAL_GROUP * cfg.batch_size)), key=lambda x: len(x[1]))  # fmt: skip
            prompts, pending = pending[: cfg.batch_size], pending[cfg.batch_size :]
            temperatures = [0.0 if k % 2 == 0 else cfg.temperature for k in range(len(prompts))]
            yield "train", D.Batch([p for _, p in prompts], [i for i, _ in prompts], temperatures,
                                   cfg.max_new_tokens, "general")  # fmt: skip
            greedy = [s for s, t in zip(self._made, temperatures) if t == 0.0]
            general.use(D.texts(tok, greedy, self.eos))

    def _answered(self, talks: dict[str, list[dict]], sequences: list[D.Sequence]) -> None:
        """The first greedy answers just made, added to their conversations as the assistant's turn."""
        firsts = [s for s in sequences if s.source == "greedy" and len(talks.get(s.prompt_id, ())) == 1]
        for s, text in zip(firsts, D.texts(self.loaded.tokenizer, firsts, self.eos)):
            if text:
                talks[s.prompt_id].append({"role": "assistant", "content": text})

    def _follow_ups(self, talks: dict[str, list[dict]], val_ids: set[str],
                    round_: int) -> Iterator[tuple[str, D.Batch]]:  # fmt: skip
        """A follow-up question after each first answer, a different one per conversation and round (always on the
        first exchange: deeper conversations made every prefill longer and the data 40% slower): validation
        conversations answered greedily, the others greedy and sampled."""
        from engine.decoding.runtime import encode_prompt

        cfg, tok = self.cfg, self.loaded.tokenizer
        asked: dict[str, list] = {"val": [], "train": []}
        for k, (root, turns) in enumerate(talks.items()):
            if len(turns) == 2:
                question = {"role": "user", "content": D.FOLLOW_UPS[(round_ + k) % len(D.FOLLOW_UPS)]}
                ids = encode_prompt(tok, turns + [question], self.chat)
                asked["val" if root in val_ids else "train"].append((f"{root}+{round_ + 1}", ids))
        for b in D.batches(asked["val"], cfg.batch_size, (0.0,), cfg.max_new_tokens, ("follow-up",)):
            yield "val", b
        for b in D.batches(asked["train"], cfg.batch_size, (0.0, cfg.temperature), cfg.max_new_tokens,
                           ("follow-up", "sampled")):  # fmt: skip
            yield "train", b

    def _variations(self, sources: list[str], seen: set[str], round_: int,
                    deadline: float) -> Iterator[tuple[str, D.Batch]]:  # fmt: skip
        from engine.decoding.runtime import encode_prompt
        from engine.measure.promptsets import is_held_out

        cfg, tok = self.cfg, self.loaded.tokenizer
        rng = random.Random(cfg.seed * 1000 + round_)
        k = cfg.batch_size  # a full batch of asks even while the sources are few: each ask is sampled anew
        chosen = rng.sample(sources, k) if len(sources) >= k else [rng.choice(sources) for _ in range(k)]
        asks = [(f"ask-{round_}-{i}", encode_prompt(tok, D.VARIATION.format(prompt=p), self.chat))
                for i, p in enumerate(chosen)]  # fmt: skip
        new: list[tuple[str, list[int]]] = []
        for b in D.batches(asks, cfg.batch_size, (ASK_TEMPERATURE,), min(160, cfg.max_new_tokens), ("ask",)):
            yield "ask", b
            for text in D.texts(tok, self._made, self.eos):
                if D.usable_variation(text, seen):
                    new.append((D.prompt_id(text), encode_prompt(tok, text, self.chat)))
                    sources.append(text)
        val = [p for p in new if is_held_out(p[0], VAL_SHARE, cfg.seed + 1)]
        train = [p for p in new if not is_held_out(p[0], VAL_SHARE, cfg.seed + 1)]
        for b in D.batches(val, cfg.batch_size, (0.0,), cfg.max_new_tokens, ("variation",)):
            yield "val", b
        for b in D.batches(train, cfg.batch_size, (0.0, cfg.temperature), cfg.max_new_tokens,
                           ("variation", "variation")):  # fmt: skip
            yield "train", b

    # -- 2. vocabulary --
    def vocabulary(self) -> Iterator[ForgeEvent]:
        self.budget.phase("vocab")
        vocab_size = self.loaded.model.config.get_text_config().vocab_size
        counts = T.label_counts(self.dataset.train, vocab_size)
        saved = self.out / "checkpoint" / "vocab.pt"
        if saved.is_file():
            self.ids = torch.load(saved, weights_only=True)
        else:
            soft = T.label_counts(self.dataset.train, vocab_size, soft=True)
            self.ids = T.draft_vocabulary(counts, soft, coverage=self.cfg.coverage)
        val_counts = T.label_counts(self.dataset.val, vocab_size)
        self.vocab = {"size": int(self.ids.numel()), "target_vocabulary": vocab_size,
                      "train_coverage": T.covered(counts, self.ids),
                      "val_coverage": T.covered(val_counts, self.ids)}  # fmt: skip
        yield self.event("vocab", f"draft vocabulary {self.vocab['size']:,} of {vocab_size:,} tokens: covers "
                         f"{self.vocab['train_coverage']:.1%} of training labels, {self.vocab['val_coverage']:.1%} "
                         "of validation labels", 1.0, **self.vocab)  # fmt: skip

    # -- 3. training --
    def training(self) -> Iterator[ForgeEvent]:
        from engine.forge.loop import Trainer

        self.budget.phase("train")
        # what is left but the export's and the measurement's planned seconds: a data phase that ended early (or a
        # resumed run's, read back) leaves training the difference
        seconds = max(FLOORS["train"], self.budget.left() - self.plan.export - self.plan.pays)
        trainer = Trainer(self.loaded.model, self.ids, self.dataset, self.cfg, self.out / "checkpoint",
                          self.machine.train_dtype, self.stop)  # fmt: skip
        for update in trainer.run(seconds):
            yield self.event("train", update.pop("message"), update.pop("done"), **update)
        self.trainer = trainer

    # -- 4. export --
    def export(self) -> Iterator[ForgeEvent]:
        from engine.forge.export import held_out, write

        self.budget.phase("export")
        self.head = self.trainer.best_head()
        report = self.trainer.report()
        figures = held_out(self.head, self.loaded, report["val_acceptance"], report["val_per_pass"])
        self.budget.phase("export")  # the time so far counted, before the summary reads it
        self.summary = self._summary() | {"held_out": figures}
        write(self.head, self.out, self.loaded, self.summary)
        if self.held_set.items:  # measured below, or later with `bench --suite DIR/held-out.jsonl`
            from engine.forge.pays import HELD_OUT_FILE, write_prompts

            write_prompts(self.out / HELD_OUT_FILE, self.held_set)
        yield self.event("export", f"wrote {self.out} (speculators layout, README.md)", 1.0)

    def _summary(self) -> dict:
        from engine.models.cpu import device_name

        spent = {k: round(v, 1) for k, v in self.budget.spent.items() if k}
        return {
            "target": self.cfg.target, "origin": self.loaded.origin, "revision": _revision(self.loaded),
            "machine": device_name(self.loaded.device),
            "machine_choice": self.machine.describe(), "config": asdict(self.cfg), "timing": spent,
            "wall_s": round(sum(spent.values()), 1),
            "prompts": {"train": len(self.train_set), "val": len(self.val_set), "held_out": len(self.held_set),
                        "held_out_ids": [i.id for i in self.held_set.items], "source": self.train_set.name,
                        "fingerprint": self.train_set.fingerprint},
            "data": {"train_answers": len(self.dataset.train), "val_answers": len(self.dataset.val),
                     "train_answer_tokens": self.dataset.answer_tokens(),
                     "val_answer_tokens": self.dataset.answer_tokens("val"),
                     "sources": _sources(self.dataset.train), "bytes": self.dataset.bytes(),
                     "dtype": self.data_dtype, "stopped": self.data_note or None,
                     "general_kinds": self.bank_shares},
            "vocabulary": self.vocab, "training": self.trainer.report(), "plan": asdict(self.plan),
        }  # fmt: skip

    # -- 5. does it pay --
    def pays(self) -> Iterator[ForgeEvent]:
        from engine.forge.pays import measure

        if not self.cfg.pays or not self.held_set.items or self.stop.is_set():
            return
        self.budget.phase("pays")
        plan = self.plan
        share = "" if plan.prompts == plan.held_out else f"{plan.prompts} of "
        yield self.event("pays", f"measuring on {share}{plan.held_out} held-out prompts: the head against prompt "
                         f"lookup, suffix and the target alone, planned at {plan.pays:.0f} s")  # fmt: skip
        self._release()  # the measurement loads the target in a process of its own
        started = time.perf_counter()

        def progress(done: int, total: int, what: str) -> None:
            self.notify(ForgeEvent("pays", f"{done}/{total} {what}", done / total if total else 1.0))

        from engine.measure.bench import Stopped

        try:
            result = measure(self.cfg, self.summary, progress, self.stop)
        except Stopped:  # the head is written already; only the measurement is cut short
            return
        result["wall_s"] = round(time.perf_counter() - started, 1)
        self.summary["pays"] = result
        from engine.forge.export import set_gamma

        set_gamma(self.out, result["chain"]["gamma"])  # measured beats predicted; other engines verify chains
        yield self.event("pays", result["verdict"], 1.0, **{"pays": result})

    def _timing(self) -> None:
        """The whole job's seconds, the measurement's included, in the summary and the card: "forged in" is the
        time the budget covered."""
        from engine.forge.export import write_card

        self.budget.phase("")  # the last phase's seconds counted
        self.summary["timing"] = {k: round(v, 1) for k, v in self.budget.spent.items() if k}
        self.summary["wall_s"] = round(self.budget.elapsed(), 1)
        write_card(self.out, self.summary)

    def _release(self) -> None:
        """Free the forge's own copy of the target and its data (a GPU would hold two targets otherwise)."""
        from engine.models.loading import MODELS, free_memory

        self.loaded = self.dataset = self.trainer = self.head = None
        MODELS.drop(self.cfg.target, self.cfg.dtype, self.cfg.device, pack=False)
        free_memory()

    def run(self) -> Iterator[ForgeEvent]:
        if not 0 <= self.cfg.steps <= MAX_STEPS:
            from engine.errors import UserError

            raise UserError(f"gamma max {self.cfg.steps}: train 1 to {MAX_STEPS} draft positions, or 0 for the "
                            "machine's default (2 on a CPU, 4 on a GPU).")  # fmt: skip
        if self.cfg.bank not in BANKS:
            from engine.errors import UserError

            raise UserError(f"general prompts {self.cfg.bank!r}: use {' or '.join(BANKS)}.")
        self.train_set, self.val_set, self.held_set = prompt_sets(self.cfg)  # a bad file fails before loading
        yield from self.load()
        yield from self.make_data()
        if not self.dataset.train:
            yield self.event("done", self.data_note or "no training data was made within the budget: give it more "
                             "minutes.", 1.0)  # fmt: skip
            return
        yield from self.vocabulary()
        yield from self.training()
        yield from self.export()
        yield from self.pays()
        self._timing()
        (self.out / "forge-report.json").write_text(json.dumps(self.summary, indent=1, default=str))
        yield self.event("done", f"forged {self.out} in {self.summary['wall_s']:.0f} s", 1.0, result=self.summary)


def _revision(loaded) -> str:
    """The target's commit where the Hub gave one (a snapshot folder's name), else its folder."""
    path = getattr(loaded.model, "name_or_path", "") or ""
    parts = Path(path).parts
    if "snapshots" in parts:
        return parts[parts.index("snapshots") + 1]
    return path


def _sources(sequences: list[D.Sequence]) -> dict:
    out: dict[str, int] = {}
    for s in sequences:
        out[s.source] = out.get(s.source, 0) + s.answer_len
    return out


def forge_events(cfg: ForgeConfig, stop: threading.Event | None = None, notify=None) -> Iterator[ForgeEvent]:
    """The forge as events: what the CLI prints and the Lab shows. The last event's metrics["result"] (phase "done")
    is the run's summary, also written to DIR/forge-report.json. The final measurement's progress goes to `notify`
    (it runs the engine's bench, which cannot yield from here)."""
    threads = torch.get_num_threads()
    try:
        yield from Forge(cfg, stop, notify).run()
    finally:
        torch.set_num_threads(threads)


def forge(cfg: ForgeConfig, progress=lambda event: None, stop: threading.Event | None = None) -> dict:
    """Run the forge to the end on the engine thread (engine.worker), where all of the engine's torch work runs (two
    threads' OpenMP teams on a 2-core CPU slow each other up to 2x); `progress` gets every ForgeEvent. Returns the
    summary (forge-report.json). The caller's thread only waits, so a first Ctrl-C there stops the forge as Stop
    does (the best state is written) and a second one leaves at once."""
    from engine.worker import ENGINE

    stop = stop or threading.Event()
    events = forge_events(cfg, stop, progress)
    result: dict = {}
    try:
        with _CtrlC(stop) as ctrl_c:
            while (event := _next_on_engine(events, ctrl_c, progress)) is not None:
                progress(event)
                if event.phase == "done":
                    result = event.metrics.get("result", {})
    except KeyboardInterrupt:  # the second: the engine thread still runs its step, and the process leaves
        raise
    except BaseException:
        ENGINE.call(events.close)  # its clean-up (the thread count) where it ran
        raise
    return result


class _CtrlC:
    """While the forge runs from the main thread: a first Ctrl-C (SIGINT) sets its stop flag wherever the thread is
    (printing a line, handing the engine its next step), and a second raises KeyboardInterrupt. Python's own handler
    raises at the first, on whatever line the thread is: one that landed while a progress line was printed left the
    forge there, without its head. Elsewhere (another thread; SIGINT ignored or handled by the caller) it stays out
    of the way."""

    def __init__(self, stop: threading.Event):
        self.stop, self.pressed, self.told, self.previous = stop, False, False, None

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # fmt: skip
            self.previous = signal.signal(signal.SIGINT, self._pressed)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _pressed(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True  # the handler runs on the main thread, as does tell()
        self.stop.set()

    def tell(self, progress) -> None:
        """The stop event, once, from the waiting loop (not from the handler, which may interrupt a print)."""
        if self.pressed and not self.told:
            self.told = True
            progress(ForgeEvent("stop", "stopping at the next batch; the best state so far is kept (Ctrl-C again "
                                "to leave now)", 0.0))  # fmt: skip


def _next_on_engine(events: Iterator[ForgeEvent], ctrl_c: _CtrlC, progress) -> ForgeEvent | None:
    from engine.worker import ENGINE

    step = ENGINE.submit(next, events, None)
    while True:
        try:
            # a short wait, again and again: a SIGINT the kernel hands to the busy engine thread only marks Python's
            # handler as due, and a main thread blocked in one long wait would not run it until the step ended
            event = step.result(timeout=0.2)
        except FutureTimeout:
            ctrl_c.tell(progress)
            continue
        ctrl_c.tell(progress)
        return event
