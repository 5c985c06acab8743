"""What a user of the web app may load, as the operator decides (the CLI, run by the machine's owner, is free).

- SPECARENA_ALLOWED_MODELS: unset lets any Hub id through; "presets" allows the bundled model and the
  models in presets/pairs.json; any other value is a comma-separated list of allowed specs (the bundled
  model is always allowed). For public Spaces.
- SPECARENA_MODELS_DIR: the one folder whose models the app may read. Without it the app reads no local
  paths at all, so nobody can point it at arbitrary files on the server.
- Heads the app forged itself (the Lab's Forge panel) sit under the SpecArena cache's heads folder: the app may
  write there, and read back from there.
- SPECARENA_FORGE: unset or "on" lets the Lab forge heads (up to an hour each); "off" turns forging off (a forge
  keeps the machine busy for its whole budget); a number caps a forge's minutes. For public Spaces.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine import presets
from engine.errors import UserError
from engine.settings import BUNDLED, cache_dir


def allowed_models() -> set[str] | None:
    """The allow-list, or None when any model may be used."""
    value = os.environ.get("SPECARENA_ALLOWED_MODELS", "").strip()
    if not value:
        return None
    if value == "presets":
        names = {p["target"] for p in presets.pairs()} | {p["draft"] for p in presets.pairs() if p.get("draft")}
    else:
        names = {v.strip() for v in value.split(",") if v.strip()}
    return names | {BUNDLED, "bundled"}


def forge_minutes(most: float) -> float:
    """The longest forge the app may run: `most`, or the operator's cap (SPECARENA_FORGE), 0 when forging is off."""
    value = os.environ.get("SPECARENA_FORGE", "").strip().lower()
    if value in ("", "on", "1", "true"):
        return most
    if value in ("off", "0", "false", "no"):
        return 0.0
    try:
        return max(0.0, min(most, float(value)))
    except ValueError:
        raise UserError(f"SPECARENA_FORGE={value!r}: the operator set it to neither on, off nor a number of "
                        "minutes.") from None  # fmt: skip


def forged_heads() -> Path:
    """The one folder the app writes heads into (the Lab's forge) and may read them back from."""
    return cache_dir() / "heads"


def _forged(spec: str) -> bool:
    path, base = Path(spec).expanduser().resolve(), forged_heads().expanduser().resolve()
    return base in path.parents


def _looks_local(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or Path(spec).expanduser().exists()


def app_model(spec: str) -> str:
    """The spec the app may load for `spec`, or a UserError saying what is allowed."""
    spec = (spec or "").strip()
    if spec in (BUNDLED, "bundled"):
        return spec
    allowed = allowed_models()
    root = os.environ.get("SPECARENA_MODELS_DIR")
    if root and not _looks_local(spec) and (Path(root) / spec).exists():
        spec = str(Path(root) / spec)  # a bare folder (or .gguf file) name inside the models folder
    if _looks_local(spec) and _forged(spec):
        return str(Path(spec).expanduser().resolve())  # a head this app forged
    if _looks_local(spec):
        if not root:
            raise UserError("this app does not read local folders: use a Hub id or the bundled model "
                            "(an operator can allow a folder with SPECARENA_MODELS_DIR).")  # fmt: skip
        path, base = Path(spec).expanduser().resolve(), Path(root).expanduser().resolve()
        if base != path and base not in path.parents:
            raise UserError(f"only models inside the operator's models folder ({root}) can be loaded here.")
        if allowed is not None and path.name not in allowed and str(path) not in allowed:
            raise UserError(f"{path.name!r} is not on this app's list of allowed models.")
        return str(path)
    if allowed is not None and spec not in allowed:
        shown = ", ".join(sorted(allowed - {"bundled"}))
        raise UserError(f"{spec!r} is not on this app's list of allowed models: choose one of {shown}.")
    return spec
