"""The training loop: batches of sequences through the head's training forward (EAGLE-3: train-time test,
engine.forge.train; DFlash: anchored blocks, engine.forge.blocks), a time-based schedule, evaluation on the
validation answers, the best state kept, checkpoints to resume from.

The schedule runs on the clock rather than on a step count, since the budget is time: warm-up over the first 5% of
the training seconds, then a cosine down to a tenth of the peak rate at the deadline. Every `eval_every` seconds the
validation answers are scored (loss, greedy acceptance per draft position as the loop sees it, expected accepted
length); the state with the longest expected accepted length is the one exported. A checkpoint (weights, optimizer,
clock, best state, history) is written at each evaluation, so a resumed run continues from it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import threading
import time
from typing import Iterator

import torch

from engine.forge import blocks as B
from engine.forge import train as T
from engine.forge.data import Dataset, Sequence


def _batches(sequences: list[Sequence], rows: int, rng: random.Random | None) -> list[list[Sequence]]:
    """Groups of sequences of similar length, at most `rows` padded rows each (shuffled when rng is given)."""
    order = list(sequences)
    if rng is not None:
        rng.shuffle(order)
        chunks = [sorted(order[i : i + 64], key=lambda s: len(s.tokens)) for i in range(0, len(order), 64)]
        order = [s for c in chunks for s in c]
    else:
        order.sort(key=lambda s: len(s.tokens))
    out, current = [], []
    for s in order:
        width = max([len(x.tokens) for x in current + [s]])
        if current and width * (len(current) + 1) > rows:
            out.append(current)
            current = []
        current.append(s)
    if current:
        out.append(current)
    if rng is not None:
        rng.shuffle(out)
    return out


@contextlib.contextmanager
def _detached(head):
    """The head without the target's embedding for a moment (a dtype change or a copy must not touch it)."""
    embed, head.embed_tokens = head.embed_tokens, None
    try:
        yield head
    finally:
        head.embed_tokens = embed


class Trainer:
    def __init__(self, target, ids: torch.Tensor, dataset: Dataset, cfg, folder, train_dtype: torch.dtype,
                 stop: threading.Event | None = None):  # fmt: skip
        self.cfg, self.folder, self.stop = cfg, folder, stop or threading.Event()
        self.dataset, self.ids = dataset, ids
        self.device = next(target.parameters()).device
        self.target_dtype = next(target.parameters()).dtype
        self.dflash = cfg.kind == "dflash"
        if self.dflash:
            self.head = B.start_head(target, ids, cfg.steps, cfg.draft_layers, cfg.init, cfg.seed)
        else:
            self.head = T.start_head(target, ids, cfg.init, cfg.seed)
        self.embed = self.head.embed_tokens  # the target's own: never converted, never copied
        with _detached(self.head):
            self.head.float()  # master weights in float32; the passes may run in bfloat16 (autocast)
        self.autocast = train_dtype if train_dtype != torch.float32 else None
        self.t2d = T.to_draft_ids(self.head.config.vocab_size, self.head.d2t)
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.rng = random.Random(cfg.seed)
        self.step, self.seconds_done, self.rows_done = 0, 0.0, 0
        self.best: dict | None = None  # {"score", "state", "acceptance", "loss", "step"}
        self.history: list[dict] = []
        self._resume()

    # -- checkpoints --
    def _trainable(self) -> dict:
        return {k: v.detach().clone() for k, v in self.head.state_dict().items()
                if not k.startswith(("embed_tokens.", "lm_head.")) and k not in ("inv_freq", "d2t")}  # fmt: skip

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.ids, self.folder / "vocab.pt")
        torch.save({"head": self._trainable(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "seconds": self.seconds_done, "rows": self.rows_done, "best": self.best,
                    "history": self.history}, self.folder / "train.pt")  # fmt: skip

    def _resume(self) -> None:
        path = self.folder / "train.pt"
        if not path.is_file():
            return
        state = torch.load(path, weights_only=True)
        self.head.load_state_dict(state["head"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.seconds_done, self.rows_done = state["step"], state["seconds"], state["rows"]
        self.best, self.history = state["best"], state["history"]
        self.resumed = True

    # -- one batch --
    def _forward(self, batch: dict) -> tuple[torch.Tensor, list[dict]]:
        moved = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        method = B if self.dflash else T
        if self.autocast is not None:
            with torch.autocast(self.device.type, dtype=self.autocast):
                return method.batch_loss(self.head, moved, self.cfg.steps)
        return method.batch_loss(self.head, moved, self.cfg.steps)

    def _collate(self, group: list[Sequence], gamma: int | None = None) -> dict:
        """A training batch (random DFlash anchors and block lengths), or with `gamma` an evaluation's: for DFlash
        every anchor with blocks of gamma + 1, as served."""
        if self.dflash:
            return B.collate(group, self.cfg.steps, self.t2d, torch.float32, None if gamma else self.rng, gamma)
        return T.collate(group, self.cfg.steps, self.t2d, torch.float32)

    def _scored(self, group: list[Sequence], gammas: range) -> tuple[float, list[dict], dict]:
        """A validation group's loss and per-position stats at the longest gamma, and the greedy loop replayed at
        each gamma: {gamma: (tokens, verify passes)}. An EAGLE-3 chain's first k steps are the same at every gamma,
        so one pass serves them all; a DFlash block of another length is another pass (non-causal attention)."""
        spans = [(s.prompt_len - 1, len(s.tokens) - 3) for s in group]
        loss, stats = self._forward(self._collate(group, gammas[-1]))
        if not self.dflash:
            return float(loss), stats, T.served_lengths([s["hit_mask"] for s in stats], spans, gammas)
        served = T.served_lengths([s["hit_mask"] for s in stats], spans, gammas[-1:])
        for g in gammas[:-1]:
            stats_g = self._forward(self._collate(group, g))[1]
            served |= T.served_lengths([s["hit_mask"] for s in stats_g], spans, range(g, g + 1))
        return float(loss), stats, served

    def evaluate(self) -> dict:
        """Loss and greedy chain acceptance per draft position on the validation answers."""
        self.head.eval()
        totals, losses, n = None, 0.0, 0
        gammas = range(1, self.cfg.steps + 1)
        served = {g: (0, 0) for g in gammas}
        with torch.no_grad():
            for group in _batches(self.dataset.val, self.cfg.batch_rows, None):
                loss, stats, replayed = self._scored(group, gammas)
                served = {g: (served[g][0] + replayed[g][0], served[g][1] + replayed[g][1]) for g in gammas}
                rows = stats[0]["rows"]
                losses += loss * rows
                n += rows
                alive = None
                counts = []
                for s in stats:
                    base = s["valid"] if alive is None else alive & s["valid"]
                    counts.append((int(base.sum()), int((s["hit_mask"] & base).sum())))
                    alive = s["hit_mask"] & base
                totals = counts if totals is None else [(a + c, b + d) for (a, b), (c, d) in zip(totals, counts)]
        self.head.train()
        acceptance = [k / r if r else 0.0 for r, k in (totals or [])]
        per_pass = [tokens / passes if passes else 1.0 for tokens, passes in served.values()]
        return {"loss": losses / max(n, 1), "acceptance": acceptance, "expected_length": T.expected_length(acceptance),
                "per_pass": per_pass, "rows": n}  # fmt: skip

    def _lr(self, frac: float, warm: float = 0.05) -> float:
        if frac < warm:
            return self.cfg.lr * max(frac / warm, 0.02)
        progress = (frac - warm) / (1 - warm)
        return self.cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    # -- the loop --
    def run(self, seconds: float) -> Iterator[dict]:
        """Train for `seconds` (or until stopped); yields progress dicts (message, done, loss, acceptance...)."""
        if not self.dataset.val:  # no validation answers: score on a slice of the training ones
            self.dataset.val = self.dataset.train[-max(1, len(self.dataset.train) // 10) :]
        start = time.perf_counter()
        eval_every = max(10.0, seconds / 15)
        next_eval, window = start + eval_every, []
        self.eval_s = self._last_eval_s = 0.0
        plan = []
        while True:
            if not plan:
                plan = _batches(self.dataset.train, self.cfg.batch_rows, self.rng)
            group = plan.pop()
            now = time.perf_counter()
            frac = (now - start) / seconds
            # the final evaluation must fit in the budget too: stop when one more would not
            if frac >= 1 or now + self._last_eval_s > start + seconds or self.stop.is_set():
                break
            for g in self.optimizer.param_groups:
                g["lr"] = self._lr(frac)
            loss, stats = self._forward(self._collate(group))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
            self.optimizer.step()
            self.step += 1
            self.rows_done += stats[0]["rows"]
            window.append((loss.item(), [s["hits"] / max(s["rows"], 1) for s in stats]))
            if time.perf_counter() >= next_eval:
                yield self._checkpoint(start, seconds, window)
                window = []
                next_eval = time.perf_counter() + eval_every
        self.seconds_done += time.perf_counter() - start
        if not window and self.history and self.history[-1]["step"] == self.step:
            # the last evaluation came after the last update: it is the final one, already reported (a second
            # record of the same step would show it twice, the second without a train loss)
            self.history[-1]["seconds"] = round(self.seconds_done, 1)
            self.save()
            return
        yield self._checkpoint(start, seconds, window, final=True)

    def _checkpoint(self, start: float, seconds: float, window: list, final: bool = False) -> dict:
        took = time.perf_counter()
        val = self.evaluate()
        self._last_eval_s = time.perf_counter() - took
        self.eval_s += self._last_eval_s
        elapsed = time.perf_counter() - start
        train_loss = sum(w[0] for w in window) / len(window) if window else None
        train_acc = [sum(w[1][k] for w in window) / len(window) for k in range(self.cfg.steps)] if window else []
        score = val["expected_length"] - 1e-3 * val["loss"]
        improved = self.best is None or score > self.best["score"]
        if improved:
            self.best = {"score": score, "state": self._trainable(), "acceptance": val["acceptance"],
                         "loss": val["loss"], "expected_length": val["expected_length"], "per_pass": val["per_pass"],
                         "step": self.step}  # fmt: skip
        trained = self.seconds_done + (0.0 if final else elapsed)  # the final call comes after run() added it
        record = {"step": self.step, "seconds": round(trained, 1), "rows": self.rows_done,
                  "train_loss": train_loss, "train_top1": train_acc, "val_loss": val["loss"],
                  "val_acceptance": val["acceptance"], "val_expected_length": val["expected_length"],
                  "val_per_pass": val["per_pass"]}  # fmt: skip
        self.history.append(record)
        self.save()
        per = " ".join(f"{a:.2f}" for a in val["acceptance"])
        tl = f"{train_loss:.3f}" if train_loss is not None else "-"
        message = (f"step {self.step}: train loss {tl}, validation loss {val['loss']:.3f}, acceptance per position "
                   f"{per}, expected accepted length {val['expected_length']:.2f}; per verify pass as served at "
                   f"gamma 1..{len(val['per_pass'])}: " + " / ".join(f"{x:.2f}" for x in val["per_pass"]))  # fmt: skip
        message += " (best)" if improved else ""
        return {"message": message, "done": 1.0 if final else min(1.0, elapsed / seconds)} | record

    # -- results --
    def best_head(self):
        """The best state as a Head in the target's dtype, ready to draft (eval mode, no gradients)."""
        with _detached(self.head):
            head = copy.deepcopy(self.head)
        if self.best is not None:
            head.load_state_dict(self.best["state"], strict=False)
        head.to(self.target_dtype)
        head.embed_tokens = self.embed
        return head.eval().requires_grad_(False)

    def report(self) -> dict:
        best = self.best or {}
        return {"steps": self.step, "rows": self.rows_done, "seconds": round(self.seconds_done, 1),
                "eval_seconds": round(getattr(self, "eval_s", 0.0), 1), "ttt_steps": self.cfg.steps,
                "best_step": best.get("step"), "val_acceptance": best.get("acceptance", []),
                "val_expected_length": best.get("expected_length"), "val_per_pass": best.get("per_pass", []),
                "val_loss": best.get("loss"),
                "history": self.history, "resumed": bool(getattr(self, "resumed", False))}  # fmt: skip
