"""Where a forged head misses (EAGLE-3 or DFlash): its first draft, teacher-forced, on the target's own greedy
answers, by how sure the target was of its token; on the forge's validation answers beside a prompt set (the held-out
prompts, a workload).

    python -m engine head-misses --draft DIR --suite open_qa,creative_writing

A head served on new prompts accepting less than its validation figures said has two possible causes, and they call
for different remedies: the new answers are harder for anyone (the target itself is less sure of its tokens there:
more data will not help), or the head has not learnt what it needs there (at the same confidence it hits less: data
closer to the workload will). The table tells them apart, bucket by bucket of the target's top-1 probability. It also
counts the misses whose token continues a pair of tokens already in the context, which a prompt lookup would have
proposed (copying a name, a word of the prompt). On the bundled model's forged heads, the 10 open QA and creative
writing prompts of the task suite read 0.57 hits where the target was above 0.9 sure, against 0.76 on the forge's
validation answers: the head, not the text, falls short.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)  # buckets of the target's top-1 probability at the answer's positions


def _bucket(p: float) -> int:
    return next((i for i in range(len(EDGES) - 2) if p < EDGES[i + 1]), len(EDGES) - 2)


def tally(head, sequences, vocab_size: int, tokens: int | None = None) -> dict:
    """First-draft hits of `head` over the answers of `sequences` (engine.forge.data.Sequence, with the target's top-k
    labels), at most `tokens` answer positions each: per confidence bucket, the positions and hits; a position whose
    token is outside the draft vocabulary counts as a miss (as served) and among `outside`. The hits are the trainer's
    own (an EAGLE-3 head's first train-time-test step; a DFlash head's first block row, every answer token an anchor,
    in blocks of the length it was trained for: a non-causal block's rows see the masks after them), in one layout:
    row r says whether the head drafted the token at position r + 2."""
    from engine.forge import blocks as B
    from engine.forge import train as T

    block = head.config.kind == "dflash"
    t2d = T.to_draft_ids(vocab_size, head.d2t)
    device, dtype = head.fc.weight.device, head.fc.weight.dtype
    buckets = [{"low": EDGES[i], "high": EDGES[i + 1], "positions": 0, "hits": 0} for i in range(len(EDGES) - 1)]
    confidence, outside, copies, misses = 0.0, 0, 0, 0
    with torch.no_grad():
        for s in sequences:
            if block:
                batch = B.collate([s], 1, t2d, dtype, gamma=head.config.block_size - 1)
            else:
                batch = T.collate([s], 1, t2d, dtype)
            moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            stat = (B if block else T).batch_loss(head, moved, 1)[1][0]  # the trainer's own hits, first draft
            hits, valid = stat["hit_mask"][0].tolist(), stat["valid"][0].tolist()
            # row r labels the token at position r + 2 (engine.forge.data); a block's first anchor is the answer's
            # first token (the prefill's), so its first draft is the answer's second
            first = s.prompt_len - 1 if block else max(s.prompt_len - 2, 0)
            last = len(s.tokens) - 2 if tokens is None else min(first + tokens, len(s.tokens) - 2)
            earliest = {}  # pair of tokens -> where it first stands
            for j in range(len(s.tokens) - 2, -1, -1):
                earliest[(s.tokens[j], s.tokens[j + 1])] = j
            for r in range(first, last):
                p = float(s.top_p[r + 1, 0])
                b = buckets[_bucket(p)]
                b["positions"] += 1
                b["hits"] += hits[r]
                confidence += p
                outside += not valid[r]
                if not hits[r]:
                    misses += 1
                    copies += earliest[(s.tokens[r + 1], s.tokens[r + 2])] <= r  # already in the context
    n = sum(b["positions"] for b in buckets)
    hits = sum(b["hits"] for b in buckets)
    return {"positions": n, "hits": hits, "hit_rate": hits / n if n else 0.0,
            "hit_rate_in_vocabulary": hits / (n - outside) if n > outside else 0.0,
            "mean_confidence": confidence / n if n else 0.0, "outside_vocabulary": outside, "misses": misses,
            "copy_misses": copies, "buckets": buckets}  # fmt: skip


def report(folder: str, target: str | None = None, suite: str | None = None, tokens: int = 64, dtype: str = "float32",
           device: str = "auto", batch_size: int = 16) -> dict:  # fmt: skip
    """The tally on the forge's validation answers (DIR/data) and on the target's greedy answers to `suite` (default:
    the forge's held-out prompts, DIR/held-out.jsonl), `tokens` answer tokens each."""
    from engine.decoding.runtime import encode_prompt
    from engine.errors import UserError
    from engine.forge import data as D
    from engine.forge.pays import HELD_OUT_FILE
    from engine.measure import promptsets
    from engine.models.heads import load_head
    from engine.models.loading import MODELS

    out = Path(folder)
    forged = out / "forge-report.json"
    if target is None:
        if not forged.is_file():
            raise UserError(f"{folder} has no forge-report.json to name its target: give --target.")
        target = json.loads(forged.read_text())["target"]
    name = None
    if suite is None:
        name = "held-out"
        if not (out / HELD_OUT_FILE).is_file():
            raise UserError(f"{folder} holds no {HELD_OUT_FILE}: give --suite (task categories or a prompts file).")
        suite = str(out / HELD_OUT_FILE)
    prompts = promptsets.load(suite)
    loaded = MODELS.get(target, dtype, device, pack=False)
    model, tok = loaded.model, loaded.tokenizer
    head = load_head(folder, model).eval()
    if head.config.kind not in ("eagle3", "dflash"):  # the trainer's own hits exist for the forge's kinds only
        raise UserError(f"head-misses reads the forge's kinds, EAGLE-3 and DFlash heads; {folder} is a "
                        f"{head.config.kind} head: measure it with `python -m engine bench --drafter "
                        f"{head.config.kind}`.")  # fmt: skip
    text = model.config.get_text_config()
    sets = {}
    if (out / "data").is_dir():
        val = D.Dataset.read(out / "data").val
        if val:
            sets["validation"] = tally(head, val, text.vocab_size, tokens)
    encoded = [(i.id, encode_prompt(tok, i.prompt, loaded.has_chat_template)) for i in prompts.items]
    layers = head.config.layers  # the target's hidden states the head reads, as drafting hands them
    eos = D.eos_of(model, tok)
    answers = []
    for batch in D.batches(encoded, batch_size, (0.0,), tokens, ("greedy",)):
        answers += D.generate(model, batch, layers, eos, torch.Generator().manual_seed(0))
    sets[name or prompts.name] = tally(head, answers, text.vocab_size, tokens)
    return {"head": str(folder), "target": target, "tokens": tokens, "sets": sets}


def table(result: dict) -> str:
    """The report as text: per set, hits per confidence bucket."""
    lines = [f"first-draft hits of {result['head']} (teacher forced, greedy answers, {result['tokens']} tokens each), "
             "by the target's top-1 probability"]  # fmt: skip
    for name, t in result["sets"].items():
        cells = "  ".join(f"[{b['low']:.1f}, {b['high']:.1f}{']' if b['high'] == 1 else ')'} "
                          f"{b['hits']}/{b['positions']}" + (f" = {b['hits'] / b['positions']:.2f}" if b["positions"]
                                                             else "") for b in t["buckets"])  # fmt: skip
        lines.append(f"{name}: {t['hit_rate']:.2f} of {t['positions']} positions (target's mean top-1 "
                     f"{t['mean_confidence']:.3f}); {cells}; misses outside the draft vocabulary "
                     f"{t['outside_vocabulary']}, continuing a pair already in the context {t['copy_misses']} of "
                     f"{t['misses']}")  # fmt: skip
    return "\n".join(lines)
