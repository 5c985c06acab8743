"""Read the data in presets/: model pairs and the task-category prompt suite."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from engine.errors import UserError

PRESETS = Path(__file__).resolve().parent.parent / "presets"


@lru_cache(maxsize=None)
def pairs() -> tuple[dict, ...]:
    return tuple(json.loads((PRESETS / "pairs.json").read_text()))


@lru_cache(maxsize=None)
def tasks() -> dict:
    return json.loads((PRESETS / "tasks.json").read_text())


def pair(name: str) -> dict:
    for p in pairs():
        if p["name"] == name:
            return p
    raise UserError(f"unknown preset {name!r}: choose one of the listed presets.")


def categories() -> list[str]:
    return list(tasks()["categories"])


def suite(selection: str | list[str] | None = None, per_category: int | None = None) -> dict[str, list[str]]:
    """First turns by category: all task categories, some named ones, a prompts file or a Hub dataset, read by
    engine.measure.promptsets (which sweeps take whole, multi-turn questions and all)."""
    from engine.measure.promptsets import load

    return load(selection).sample(per_category).first_turns()
