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
    """Prompts by category: all, some named categories, or a JSON/text file (one prompt a line)."""
    if isinstance(selection, str) and Path(selection).is_file():
        path = Path(selection)
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            chosen = data.get("categories", data)
            return {k: (v["prompts"] if isinstance(v, dict) else list(v))[:per_category] for k, v in chosen.items()}
        return {path.stem: [line for line in path.read_text().splitlines() if line.strip()][:per_category]}
    names = selection.split(",") if isinstance(selection, str) else selection or categories()
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in tasks()["categories"]]
    if unknown:
        raise UserError(f"unknown task categories {unknown}: use {', '.join(categories())} or a prompts file.")
    return {n: tasks()["categories"][n]["prompts"][:per_category] for n in names}
