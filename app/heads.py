"""The draft heads the Playground offers where a head drafter (EAGLE-3, P-EAGLE, DFlash, DSpark, DFlash2) is picked:
those the Lab's forge wrote into the cache (for the target in the form, newest first) and those the presets name.

A head is offered by what its own files say (config.json for its kind, the forge's forge-report.json for its target
and date), read without loading any weights, so that listing them costs nothing when the drafter changes. A folder
that is not a head, or is a head for another target, is not offered: picking it would only be refused at Run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from engine import policy, presets
from engine.errors import UserError
from engine.models.heads import KIND_OF, layout_of
from engine.settings import BUNDLED


@dataclass(frozen=True)
class Offered:
    """One head the Playground offers: what the list says, and what picking it puts in the draft field."""

    label: str
    spec: str
    target: str = ""  # the target it was forged or published for ("" where its files do not say)
    when: float = 0.0  # when it was forged (seconds since the epoch); 0 for a preset's


def same_target(a: str, b: str) -> bool:
    """Whether two target specs name one model: "bundled" is the bundled model's short name."""
    norm = lambda spec: BUNDLED if (spec or "").strip() in ("bundled", BUNDLED) else (spec or "").strip()  # noqa: E731
    return norm(a) == norm(b)


def _forged(folder: Path, kind: str) -> Offered | None:
    """The forged head in `folder` if it is a `kind` head; None for anything else (a half-written forge, a
    folder that is not a head)."""
    try:
        config = json.loads((folder / "config.json").read_text())
        if KIND_OF.get(layout_of(config)) != kind:
            return None
    except (OSError, ValueError, UserError):
        return None
    report = folder / "forge-report.json"
    try:
        target = json.loads(report.read_text()).get("target") or ""
    except (OSError, ValueError, AttributeError):
        target = ""
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    when = (report if report.is_file() else folder / "config.json").stat().st_mtime
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(when))
    return Offered(f"forged {stamp} · {folder.name}", str(folder), target or verifier, when)


def forged_heads(target: str, kind: str, root: Path | None = None) -> list[Offered]:
    """The `kind` heads the forge wrote under `root` (the app's heads folder) for `target`, newest first; a head
    whose files name no target is offered too, marked so."""
    root = Path(root) if root is not None else policy.forged_heads()
    found = [_forged(folder, kind) for folder in sorted(root.iterdir())] if root.is_dir() else []
    fits = [h for h in found if h and (not h.target or same_target(h.target, target))]
    fits = [h if h.target else Offered(h.label + " · target not recorded", h.spec, h.target, h.when) for h in fits]
    return sorted(fits, key=lambda h: h.when, reverse=True)


def preset_heads(target: str, kind: str) -> list[Offered]:
    """The `kind` heads the presets name for `target`."""
    return [Offered(f"preset · {p['draft']}", p["draft"], p["target"]) for p in presets.pairs()
            if p.get("drafter") == kind and p.get("draft") and same_target(p["target"], target)]  # fmt: skip


def offered(target: str, kind: str, root: Path | None = None) -> list[Offered]:
    """Every head offered for `target` and a drafter of `kind`: forged ones first (newest first), then presets'.
    Empty for a drafter that takes no head."""
    if kind not in KIND_OF.values():
        return []
    return forged_heads(target, kind, root) + preset_heads(target, kind)


def elsewhere(kind: str) -> list[str]:
    """The targets the presets have a `kind` head for (to say where heads exist when this target has none)."""
    return sorted({p["target"] for p in presets.pairs() if p.get("drafter") == kind and p.get("draft")})
