"""The forge's prompts: the given ones split three ways, by hash of their ids (engine.measure.promptsets).

    held out    never generated on, never trained on: the final measurement's (ForgeConfig.held_out of them)
    validation  VAL_SHARE of the rest: answered by the target, never trained on (early stopping, held-out figures)
    train       the rest
"""

from __future__ import annotations

VAL_SHARE = 0.1  # of the training side's prompts (and of the target's new prompts): validation, never trained on


def prompt_sets(cfg):
    """(train, val, held_out) PromptSets of a ForgeConfig: held-out by the promptsets hash, validation by a second
    hash."""
    from engine.errors import UserError
    from engine.measure import promptsets

    found = promptsets.load(cfg.suite)
    if cfg.held_out == 1:  # every given prompt measured, none trained on: a head from general prompts alone
        if not cfg.general:
            raise UserError("a held-out share of 1 leaves no prompts to train on without general prompts: give a "
                            "smaller share, or let the forge use its general prompts.")  # fmt: skip
        return (found.narrowed([], part="train"), found.narrowed([], part="val"),
                found.narrowed(found.items, part="held-out"))  # fmt: skip
    train_side, held = found.split(cfg.held_out, cfg.seed) if cfg.held_out else (found, found.narrowed([]))
    inside = [i for i in train_side.items if not is_val(i.id, cfg.seed)]
    val = [i for i in train_side.items if is_val(i.id, cfg.seed)]
    if not val and len(inside) > 1:  # a validation set is needed: the last item then
        val = inside[-1:]
        inside = inside[:-1]
    if not inside:
        raise UserError(f"{found.name} leaves no prompts to train on after the held-out share {cfg.held_out}: give "
                        "more prompts or a smaller held-out share.")  # fmt: skip
    return train_side.narrowed(inside, part="train"), train_side.narrowed(val, part="val"), held


def is_val(prompt_id: str, seed: int) -> bool:
    """Whether a training-side prompt (given, or written by the target) is a validation one."""
    from engine.measure.promptsets import is_held_out

    return is_held_out(prompt_id, VAL_SHARE, seed + 1)
