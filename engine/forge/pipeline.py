"""The forge: a draft head for a target (EAGLE-3 or DFlash), made on the machine at hand within a time budget.

    1. prompts   the task suite's categories or a prompts file, split into train / validation / held out
                 (engine.forge.prompts)
    2. data      the target answers what engine.forge.questions asks of it (the training prompts, general prompts,
                 follow-ups, prompts it writes), with its hidden states and soft labels, until the data share of the
                 budget is spent (engine.forge.data)
    3. vocab     the draft vocabulary from the labels (covering `coverage` of them)
    4. train     the head trained on the data, evaluated on the validation data every so often; the best state kept
                 (engine.forge.loop: EAGLE-3 by train-time test, engine.forge.train; DFlash by anchored blocks,
                 engine.forge.blocks)
    5. export    speculators layout (engine.models.heads.write_head) with a model card (engine.forge.export)
    6. pays      the head against prompt lookup, suffix and the target alone on the held-out prompts
                 (engine.forge.pays)

One budget covers it all (engine.forge.budget): loading first, then a plan gives each phase its seconds.
`forge_events` yields ForgeEvents (phase, progress, ETA, loss and acceptance per draft position) for the CLI and the
Lab; engine.forge.foreground runs them from a waiting thread. A stop flag ends the current phase at the next batch
and the best state is still written. A folder that already holds data and a checkpoint resumes: its data is read
back, training continues; a run cut short while making data replays its plan over the shards on disk and generates
only what is missing.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from engine.errors import UserError, blame
from engine.forge import BANKS, KINDS
from engine.forge import data as D
from engine.forge import train as T
from engine.forge.budget import FLOORS, Budget, Plan, plan_budget
from engine.forge.prompts import prompt_sets

MAX_STEPS = 8  # train-time-test steps (EAGLE-3 trains 7), or a DFlash block's drafts


@dataclass
class ForgeConfig:
    target: str
    out: str
    suite: str | None = None  # task categories (comma-separated; all when empty) or a prompts file / dataset
    kind: str = "eagle3"  # KINDS: an EAGLE-3 head (a chain of one-layer steps) or a DFlash head (one block pass)
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
    # the longest draft trained (--gamma-max): EAGLE-3's train-time-test steps, a DFlash block's drafts (its block is
    # one longer); 0: 2 on a CPU, 4 on a GPU. Training is what a CPU's budget runs short of (validation acceptance
    # still climbing at the end of 15 minutes), an EAGLE-3 step costs about `steps` forward passes, and a CPU's
    # verify costs make gamma 1-2 the best there: on the bundled model's data (bfloat16, 132.7k answer tokens, 7
    # minutes of training, AMX Xeon) 2 steps made 958 updates against 546 and validation acceptance 0.51 / 0.52 at
    # positions 1 / 2 against 0.45 / 0.46
    steps: int = 0
    draft_layers: int = 1  # DFlash: the head's decoder layers (z-lab's and speculators' default 5; EAGLE-3 has 1)
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
    # a head folder measured beside this one on the same held-out prompts: an EAGLE-3 head forged with the same
    # prompts, seed and minutes beside a DFlash one, say (its chains, gamma 1 to its trained length)
    beside: str = ""


@dataclass
class ForgeEvent:
    phase: str  # load | data | vocab | train | export | pays | done
    message: str
    done: float = 0.0  # of this phase, 0-1
    eta_s: float | None = None  # of the whole budget
    metrics: dict = field(default_factory=dict)  # train: loss, acceptance per position; done: the result


def refused(cfg: ForgeConfig) -> str:
    """What is wrong with a config before anything loads ("" when nothing)."""
    if cfg.kind not in KINDS:
        return f"head kind {cfg.kind!r}: use {' or '.join(KINDS)}."
    if not 0 <= cfg.steps <= MAX_STEPS:
        return (f"gamma max {cfg.steps}: train 1 to {MAX_STEPS} draft positions, or 0 for the machine's default (2 on "
                "a CPU, 4 on a GPU).")  # fmt: skip
    if cfg.bank not in BANKS:
        return f"general prompts {cfg.bank!r}: use {' or '.join(BANKS)}."
    if cfg.kind == "dflash" and cfg.draft_layers < 1:
        return f"draft layers {cfg.draft_layers}: a DFlash head has one layer at least."
    return ""


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
        self.questions = None  # engine.forge.questions.Questions, once the target is loaded
        self.beside: dict | None = None  # the head measured beside this one (beside_head), once the prompts are read

    def run(self) -> Iterator[ForgeEvent]:
        if problem := refused(self.cfg):
            raise UserError(problem)
        self.train_set, self.val_set, self.held_set = prompt_sets(self.cfg)  # a bad file fails before loading
        self.beside = beside_head(self.cfg, [i.id for i in self.held_set.items])
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

    # -- state on disk (resume) --
    def _read_state(self) -> dict:
        path = self.out / "forge-state.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _write_state(self, **values) -> None:
        self.state.update(values)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "forge-state.json").write_text(json.dumps(self.state, indent=1))

    def event(self, phase: str, message: str, done: float = 0.0, **metrics) -> ForgeEvent:
        return ForgeEvent(phase, message, done, max(0.0, self.budget.left()), metrics)

    # -- 0. load --
    def load(self) -> Iterator[ForgeEvent]:
        from engine.forge.machine import choose
        from engine.forge.questions import Questions
        from engine.models.heads import eagle3_layers
        from engine.models.loading import MODELS

        self.budget.phase("load")
        yield self.event("load", f"loading {self.cfg.target}")
        said: list[str] = []
        # stock layers (pack=False): the forge reads the target's weights and runs batched passes, which the CPU
        # layouts of engine.models.cpu are not made for; the final measurement loads the engine's own form
        with blame("target"):  # a model that cannot be found or loaded is the target's fault, not the forge's
            self.loaded = MODELS.get(self.cfg.target, self.cfg.dtype, self.cfg.device, said.append, pack=False)
        text = self.loaded.model.config.get_text_config()
        # both kinds read EAGLE-3's three layers: the same data makes either head
        self.layers = eagle3_layers(text.num_hidden_layers)
        eos = D.eos_of(self.loaded.model, self.loaded.tokenizer)
        self.questions = Questions(self.cfg, self.loaded, self.loaded.has_chat_template, eos,
                                   (self.train_set, self.val_set, self.held_set), self.stop)  # fmt: skip
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
        yield self.event("load", f"{self.loaded.describe()}; {self.machine.describe()}{data}; {self._trains()}", 1.0)
        self.plan = self._plan_budget()
        yield self.event("load", self.plan.describe(), 1.0, plan=asdict(self.plan))

    def _trains(self) -> str:
        if self.cfg.kind == "dflash":
            return (f"a {self.cfg.draft_layers}-layer DFlash head, blocks of {self.cfg.steps + 1} (drafts up to "
                    f"{self.cfg.steps})")  # fmt: skip
        return f"train-time test over {self.cfg.steps} steps"

    def _plan_budget(self) -> Plan:
        """The phases' seconds (Plan), from what loading took and the target's one-token pass, timed now."""
        from engine.decoding.runtime import time_passes

        with torch.inference_mode():
            pass_s = time_passes(self.loaded.model, (1,))[1] if self.cfg.pays and self.held_set.items else 0.0
        turns = [len(i.turns) for i in self.held_set.items]
        beside = len(self.beside["gammas"]) if self.beside else 0
        return plan_budget(self.cfg, self.budget.elapsed(), pass_s, turns, beside)

    # -- 1. data --
    def make_data(self) -> Iterator[ForgeEvent]:
        folder = self.out / "data"
        self.dataset = D.Dataset.read(folder) if folder.is_dir() else D.Dataset()
        self.budget.phase("data")
        if self.state.get("data_done") and self.dataset.train:
            yield self.event("data", f"read {self.dataset.answer_tokens():,} answer tokens back from {folder}", 1.0)
            return
        model = self.loaded.model
        if self.data_copy:
            from engine.models.loading import resolve_dtype

            model = copy.deepcopy(model).to(resolve_dtype(self.data_dtype, self.loaded.device))
        deadline = time.perf_counter() + self.plan.data
        started = time.perf_counter()
        made_before = self.dataset.answer_tokens() + self.dataset.answer_tokens("val")
        replay = D.Replay(self.dataset)  # a run cut short in this phase (killed, not stopped) goes on where it was
        plan, made = self.questions.plan(deadline), None
        while (asked := next_question(plan, made)) is not None:
            if self.stop.is_set() or time.perf_counter() > deadline:
                break
            split, batch = asked
            split = "train" if split == "ask" else split  # the target writing new prompts: its text is data too
            found, missing = replay.take(split, batch)
            if missing is None:
                made = found
                continue
            if replay.taken:
                yield self.event("data", f"read {replay.taken:,} answer tokens back from {folder}; going on from "
                                 "there", 0.0)  # fmt: skip
                replay.taken = 0
            sequences = D.generate(model, missing, self.layers, self.questions.eos, self.generator, deadline,
                                   stop=self.stop)  # fmt: skip
            rows = iter(sequences)
            made = [s if s is not None else next(rows) for s in found]
            self.data_note = D.disk_full(folder, sequences)
            if self.data_note:
                yield self.event("data", self.data_note, 1.0)
                break
            path = D.write_shard(folder, self.dataset.shards, sequences, split)
            self.dataset.shards += 1
            self.dataset.add(split, D.read_shard(path)[1])  # mapped from the file: memory holds no copy
            made_now = self.dataset.answer_tokens() + self.dataset.answer_tokens("val") - made_before
            rate = made_now / max(time.perf_counter() - started, 1e-6)  # answer tokens: the labelled positions
            share = min(1.0, (time.perf_counter() - started) / max(deadline - started, 1e-6))
            train, val = len(self.dataset.train), len(self.dataset.val)
            yield self.event("data", f"{made_now:,} answer tokens ({rate:.0f}/s), {train} train and {val} validation "
                             "sequences", share, tokens=made_now, rate=rate)  # fmt: skip
        # a run the disk cut short makes the rest when resumed with space to spare
        self._write_state(data_done=not self.data_note, data_tokens=self.dataset.answer_tokens())

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
            "target": self.cfg.target, "kind": self.cfg.kind, "origin": self.loaded.origin,
            "revision": _revision(self.loaded), "machine": device_name(self.loaded.device),
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
                     "general_kinds": self.questions.bank_shares},
            "vocabulary": self.vocab, "training": self.trainer.report(), "plan": asdict(self.plan),
            "beside": self.beside,
        }  # fmt: skip

    # -- 5. does it pay --
    def pays(self) -> Iterator[ForgeEvent]:
        from engine.forge.export import set_gamma
        from engine.forge.pays import measure
        from engine.measure.bench import Stopped

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

        try:
            result = measure(self.cfg, self.summary, progress, self.stop)
        except Stopped:  # the head is written already; only the measurement is cut short
            return
        result["wall_s"] = round(time.perf_counter() - started, 1)
        self.summary["pays"] = result
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


def beside_head(cfg: ForgeConfig, held_ids: list[str]) -> dict | None:
    """The head measured beside the forged one (cfg.beside), from its folder: its kind, the chains to measure (gamma 1
    to its trained length, or to the draft length its config proposes) and the minutes it was forged in. Refused when
    the forge that made it held out other prompts: its training prompts could be among the ones measured here."""
    if not cfg.beside:
        return None
    from engine.models.heads import KIND_OF, head_folder, layout_of, read_config

    folder = head_folder(cfg.beside)
    config = read_config(folder)
    kind = KIND_OF[layout_of(config)]  # a P-EAGLE head beside is run as one, not as an EAGLE-3 chain
    report = folder / "forge-report.json"
    forged = json.loads(report.read_text()) if report.is_file() else {}
    if forged and forged.get("prompts", {}).get("held_out_ids") != held_ids:
        raise UserError(f"the head beside ({cfg.beside}) was forged with other held-out prompts, so some prompts "
                        "measured here may be ones it trained on: forge both with the same prompts, --held-out and "
                        "--seed.")  # fmt: skip
    method = next(iter((config.get("speculators_config") or {}).get("proposal_methods") or []), {})
    steps = (forged.get("config") or {}).get("steps") or method.get("speculative_tokens") or 2
    minutes = (forged.get("config") or {}).get("minutes")
    return {"folder": str(folder), "kind": kind, "gammas": list(range(1, steps + 1)), "minutes": minutes}


def next_question(plan, made: list[D.Sequence] | None) -> tuple[str, D.Batch] | None:
    """The plan's next (split, Batch), the last batch's sequences sent in (None at the start); None at its end."""
    try:
        return plan.send(made)
    except StopIteration:
        return None


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
