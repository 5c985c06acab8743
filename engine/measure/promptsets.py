"""Prompt sets: one reader for the workloads speculation is measured (and heads are trained) on.

Speedup depends on the workload more than on anything else, so a pair is tuned on the prompts it will serve.
This module turns what teams keep their traffic in, and what papers report on, into one PromptSet:

    JSONL / JSON   records with `prompt`, `text`, `question` or `instruction`; chat `messages`; MT-Bench and
                   Spec-Bench `turns` (with `category`, `question_id`); ShareGPT `conversations` (the human turns);
                   SpecArena's own {"categories": {name: {"prompts": [...]}}}
    CSV            a header with a prompt column (prompt, text, question, instruction, or the only column)
    text           one prompt a line
    Hub dataset    org/name[@revision][:split or file], read through huggingface_hub like a Hub model

Each PromptItem keeps all its user turns. A multi-turn item runs as Spec-Bench runs it: turn k+1 is asked after
the model's own answer to turns 1..k, through the chat template, and each turn is its own sample (bench.sweep).

A set names itself by a fingerprint (sha256 of the file's bytes, or the dataset's revision) so a report can be
reproduced. `split(share, seed)` marks a held-out share by hashing each item's id with the seed: the same item
lands on the same side whatever else the file holds or in which order, so a forge that trains on the `train`
part never sees the prompts a speedup was measured on.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.errors import UserError

PROMPT_KEYS = ("prompt", "text", "question", "instruction")  # single-prompt records, in this order of preference
ID_KEYS = ("question_id", "id")
HUMAN = ("human", "user")  # ShareGPT's `from` values (and chat roles) that are the user's turns
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".txt", ".parquet")


@dataclass(frozen=True)
class PromptItem:
    """One question: its user turns in order (one for most sets, two for MT-Bench's), its category and id."""

    id: str
    category: str
    turns: tuple[str, ...]
    where: str = ""  # where in the source it came from ("line 12"), for messages

    @property
    def prompt(self) -> str:
        return self.turns[0]


@dataclass(frozen=True)
class Skip:
    """A part of the source that gave no prompt, and why."""

    where: str
    why: str


@dataclass
class PromptSet:
    """Prompts read from one source, and how they were narrowed (categories, sampling, held-out split)."""

    name: str  # file name, dataset id, or "task suite"
    fingerprint: str  # "sha256:<hex>" of the file's bytes, or "revision:<sha>" of a Hub dataset
    layout: str  # what the reader recognised: "turns", "conversations", "messages", "prompt", "csv", "text", ...
    items: list[PromptItem]
    skipped: list[Skip] = field(default_factory=list)
    selection: dict = field(default_factory=dict)  # categories, per_category, seed, held_out, part

    def __len__(self) -> int:
        return len(self.items)

    def categories(self) -> dict[str, int]:
        """Items per category, in the order the source gives them."""
        counts: dict[str, int] = {}
        for item in self.items:
            counts[item.category] = counts.get(item.category, 0) + 1
        return counts

    def turns(self) -> int:
        """Samples one pass over the set gives: each turn is its own sample."""
        return sum(len(item.turns) for item in self.items)

    def by_category(self) -> dict[str, list[PromptItem]]:
        out: dict[str, list[PromptItem]] = {}
        for item in self.items:
            out.setdefault(item.category, []).append(item)
        return out

    def first_turns(self) -> dict[str, list[str]]:
        """Each item's first turn by category: for measurements that take one prompt at a time (load curves)."""
        return {name: [item.prompt for item in items] for name, items in self.by_category().items()}

    def narrowed(self, items: list[PromptItem], **selection) -> "PromptSet":
        return replace(self, items=items, selection=self.selection | selection)

    def only(self, categories: list[str] | None) -> "PromptSet":
        """The items of some categories (all when None or empty); an unknown category is an error."""
        if not categories:
            return self
        unknown = [c for c in categories if c not in self.categories()]
        if unknown:
            raise UserError(f"{self.name} has no categories {unknown}: it has {', '.join(self.categories())}.")
        return self.narrowed([i for i in self.items if i.category in categories], categories=list(categories))

    def sample(self, per_category: int | None, seed: int | None = None) -> "PromptSet":
        """At most `per_category` items of each category: the first ones without a seed, a seeded random choice
        with one. The items keep the source's order either way."""
        if per_category is None:
            return self
        if per_category < 1:
            raise UserError(f"prompts per category {per_category} is out of range: use 1 or more.")
        keep: set[int] = set()  # positions in self.items
        for positions in self._positions_by_category().values():
            n = min(per_category, len(positions))
            keep |= set(positions[:n] if seed is None else random.Random(seed).sample(positions, n))
        kept = [item for k, item in enumerate(self.items) if k in keep]
        return self.narrowed(kept, per_category=per_category, seed=seed)

    def _positions_by_category(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for k, item in enumerate(self.items):
            out.setdefault(item.category, []).append(k)
        return out

    def split(self, held_out: float, seed: int | None = None) -> tuple["PromptSet", "PromptSet"]:
        """(train, held_out): each item's side decided by its id and the seed alone (is_held_out)."""
        check_share(held_out)
        out = [i for i in self.items if is_held_out(i.id, held_out, seed)]
        inside = [i for i in self.items if not is_held_out(i.id, held_out, seed)]
        marks = dict(held_out=held_out, split_seed=seed or 0)
        return self.narrowed(inside, part="train", **marks), self.narrowed(out, part="held-out", **marks)

    def describe(self) -> dict:
        """What a report records: enough to find the same prompts again."""
        return {"name": self.name, "fingerprint": self.fingerprint, "layout": self.layout,
                "items": len(self.items), "turns": self.turns(), "categories": self.categories(),
                "skipped": [asdict(s) for s in self.skipped], "selection": self.selection,
                "ids": [i.id for i in self.items]}  # fmt: skip

    def summary(self) -> str:
        """One paragraph for people: how many prompts and turns, which categories, what was skipped."""
        cats = ", ".join(f"{name} {n}" for name, n in self.categories().items())
        multi = sum(len(i.turns) > 1 for i in self.items)
        text = f"{self.name} ({self.layout}, {short(self.fingerprint)}): {len(self.items)} prompt(s)"
        if multi:
            text += f", {multi} of them multi-turn ({self.turns()} turns in all)"
        text += f" in {len(self.categories())} categor{'y' if len(self.categories()) == 1 else 'ies'}: {cats}."
        if self.skipped:
            text += f" Skipped {len(self.skipped)}: " + "; ".join(f"{s.where}: {s.why}" for s in self.skipped[:8])
            text += " ..." if len(self.skipped) > 8 else "."
        return text


def short(fingerprint: str) -> str:
    kind, _, value = fingerprint.partition(":")
    return f"{kind} {value[:12]}" if value else fingerprint


def check_share(share: float) -> None:
    if not 0.0 <= share < 1.0:
        raise UserError(f"held-out share {share} is out of range: use 0 (none) up to below 1, e.g. 0.2.")


def is_held_out(item_id: str, share: float, seed: int | None = None) -> bool:
    """Whether an item belongs to the held-out share: a hash of (seed, id) read as a number in [0, 1)."""
    if share <= 0:
        return False
    digest = hashlib.sha256(f"{seed or 0}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def split(prompts: "PromptSet", share: float, seed: int | None = None) -> tuple[PromptSet, PromptSet]:
    """(train, held_out) of a set; see PromptSet.split. The forge trains on the first part only."""
    return prompts.split(share, seed)


# --- reading records -------------------------------------------------------------------------------------------


def _text(value) -> str:
    return value.strip() if isinstance(value, str) else ""


def _content(message: dict) -> str:
    content = message.get("content", message.get("value", ""))
    if isinstance(content, list):  # multimodal-style parts: keep the text ones
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return _text(content)


def _user_turns(messages: list, role_key: str) -> tuple[str, ...]:
    return tuple(_content(m) for m in messages if isinstance(m, dict) and str(m.get(role_key, "")).lower() in HUMAN)


def record_turns(record) -> tuple[str, tuple[str, ...]] | None:
    """(layout, user turns) of one record, None when it has none of the known keys. A known key with nothing
    usable in it gives empty turns (the caller says so)."""
    if isinstance(record, str):
        return "text", (record.strip(),)
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("turns"), list):
        return "turns", tuple(_text(t) for t in record["turns"])
    if isinstance(record.get("conversations"), list):
        messages = record["conversations"]
        role = "from" if any(isinstance(m, dict) and "from" in m for m in messages) else "role"
        return "conversations", _user_turns(messages, role)
    for key in ("messages",) + PROMPT_KEYS:
        value = record.get(key)
        if isinstance(value, list):  # a chat in a `prompt` column, as some Hub sets keep it
            return "messages", _user_turns(value, "role")
        if key != "messages" and value is not None:
            return key, (_text(value),)
    return None


def _item_id(record, turns: tuple[str, ...]) -> str:
    if isinstance(record, dict):
        for key in ID_KEYS:
            if record.get(key) not in (None, ""):
                return str(record[key])
    # no id in the file: the text itself, so an item keeps its id (and its side of the split) wherever it moves
    return "sha256:" + hashlib.sha256("\x1e".join(turns).encode()).hexdigest()[:16]


def _category(record, default: str) -> str:
    value = record.get("category") if isinstance(record, dict) else None
    return str(value).strip() if value not in (None, "") else default


def items_of(records: list[tuple[str, object]], default_category: str) -> tuple[list[PromptItem], list[Skip], str]:
    """PromptItems from (where, record) pairs; the skipped ones with why; the layout most records had. Records
    with no known key at all make an unknown layout, said with the keys seen."""
    items, skipped, layouts, unknown_keys = [], [], {}, {}
    for where, record in records:
        found = record_turns(record)
        if found is None:
            keys = sorted(record) if isinstance(record, dict) else [type(record).__name__]
            unknown_keys.update(dict.fromkeys(keys))
            skipped.append(Skip(where, f"no prompt in it (keys: {', '.join(keys)})"))
            continue
        layout, turns = found
        if not turns or any(not t for t in turns):
            skipped.append(Skip(where, f"an empty {layout if layout != 'text' else 'prompt'}"))
            continue
        layouts[layout] = layouts.get(layout, 0) + 1
        items.append(PromptItem(_item_id(record, turns), _category(record, default_category), turns, where))
    if not items and unknown_keys:
        raise UserError(f"unknown layout: no record has a prompt. Keys seen: {', '.join(unknown_keys)}. Use one of "
                        "prompt, text, question, instruction, messages, turns (MT-Bench, Spec-Bench) or "
                        "conversations (ShareGPT).")  # fmt: skip
    return items, skipped, max(layouts, key=layouts.get) if layouts else "empty"


def _json_records(data, name: str) -> list[tuple[str, object]]:
    """A whole JSON document: a list of records, a {data|questions|prompts|rows: [...]} wrapper, or SpecArena's
    {"categories": {name: {"prompts": [...]}}} (also without the "categories" level)."""
    if isinstance(data, dict):
        for key in ("data", "questions", "prompts", "rows"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
    if isinstance(data, list):
        return [(f"record {i + 1}", r) for i, r in enumerate(data)]
    if isinstance(data, dict):
        groups = data.get("categories", data)
        if isinstance(groups, dict) and groups and all(isinstance(v, (list, dict)) for v in groups.values()):
            records = []
            for category, group in groups.items():
                prompts = group.get("prompts") if isinstance(group, dict) else group
                if not isinstance(prompts, list):
                    break
                records += [(f"{category} {i + 1}", _with_category(p, category)) for i, p in enumerate(prompts)]
            else:
                return records
        raise UserError(f"unknown layout in {name}: a JSON object with keys {', '.join(list(data)[:12])}. Use a "
                        "list of records, JSON lines, or {\"categories\": {name: {\"prompts\": [...]}}}.")  # fmt: skip
    raise UserError(f"unknown layout in {name}: the JSON holds a {type(data).__name__}, not a list of records.")


def _with_category(record, category: str):
    if isinstance(record, str):
        return {"prompt": record, "category": category}
    return {"category": category} | record if isinstance(record, dict) else record


def _jsonl_records(text: str, name: str) -> list[tuple[str, object]]:
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise UserError(f"{name}, line {number} is not JSON ({exc.msg}): every line of a .jsonl file is one "
                            "JSON record.") from None  # fmt: skip
    return records


def _csv_records(text: str, name: str) -> list[tuple[str, object]]:
    rows = csv.DictReader(io.StringIO(text))
    columns = [c for c in rows.fieldnames or [] if c is not None]
    lower = {c.strip().lower(): c for c in columns}
    column = next((lower[k] for k in PROMPT_KEYS if k in lower), columns[0] if len(columns) == 1 else None)
    if column is None:
        raise UserError(f"unknown layout in {name}: no prompt column among {', '.join(columns) or 'no columns'}. "
                        f"Name one {', '.join(PROMPT_KEYS)}.")  # fmt: skip
    extra = {k: lower[k] for k in ("category", *ID_KEYS) if k in lower}
    # line numbers count the header as line 1 (fields spanning lines are rare in prompt files)
    return [(f"line {n + 2}", {"prompt": row.get(column) or ""} | {k: row.get(c) for k, c in extra.items()})
            for n, row in enumerate(rows)]  # fmt: skip


def _parquet_records(data: bytes, name: str) -> list[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{name} is a Parquet file, and reading Parquet needs pyarrow (`pip install pyarrow`); or "
                        "give the same prompts as JSON lines or CSV.") from None  # fmt: skip
    rows = pq.read_table(io.BytesIO(data)).to_pylist()
    return [(f"row {i + 1}", r) for i, r in enumerate(rows)]


def _kind(name: str, text: str) -> str:
    suffix = Path(name).suffix.lower()
    if suffix in DATA_SUFFIXES:
        return suffix[1:]
    head = text.lstrip()[:1]
    if head == "[":
        return "json"
    if head == "{":  # one document, or one record a line
        try:
            json.loads(text)
            return "json"
        except json.JSONDecodeError:
            return "jsonl"
    return "txt"


def read_bytes(data: bytes, name: str, fingerprint: str | None = None, category: str | None = None) -> PromptSet:
    """A PromptSet from a file's bytes; `name` (a file name) decides the format by its extension, or the content
    does when the extension says nothing. Records without a category get `category` (default: the file's stem)."""
    fingerprint = fingerprint or "sha256:" + hashlib.sha256(data).hexdigest()
    stem = category or Path(name).stem or "prompts"
    if Path(name).suffix.lower() == ".parquet":
        records, kind = _parquet_records(data, name), "parquet"
    else:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise UserError(f"{name} is not UTF-8 text: save it as UTF-8 JSON lines, JSON, CSV or text.") from None
        if not text.strip():
            raise UserError(f"{name} is empty: it needs prompts (JSON lines, JSON, CSV, or one prompt a line).")
        kind = _kind(name, text)
        if kind == "jsonl":
            records = _jsonl_records(text, name)
        elif kind == "json":
            try:
                records = _json_records(json.loads(text), name)
            except json.JSONDecodeError as exc:
                raise UserError(f"{name} is not valid JSON (line {exc.lineno}: {exc.msg}); for one record a line, "
                                "name it .jsonl.") from None  # fmt: skip
        elif kind == "csv":
            records = _csv_records(text, name)
        else:
            records = [(f"line {n}", line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    items, skipped, layout = items_of(records, stem)
    if not items:
        raise UserError(f"{name} has no prompts" + (f" ({len(skipped)} record(s) skipped: {skipped[0].where}: "
                                                   f"{skipped[0].why})" if skipped else "") + ".")  # fmt: skip
    return PromptSet(Path(name).name, fingerprint, layout if kind not in ("csv", "txt") else kind, items, skipped)


def read_file(path: str | Path) -> PromptSet:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompts file {str(path)!r} does not exist.")
    return read_bytes(path.read_bytes(), path.name)


# --- SpecArena's task suite and selections ------------------------------------------------------------------------


def task_suite() -> PromptSet:
    """presets/tasks.json, SpecArena's own categories, through the same reader."""
    found = read_file(Path(__file__).resolve().parents[2] / "presets" / "tasks.json")  # engine.presets' folder
    return replace(found, name="task suite")


def is_dataset_id(spec: str) -> bool:
    repo = spec.split(":", 1)[0].split("@", 1)[0]
    return repo.count("/") == 1 and " " not in spec and not Path(spec).exists() and not spec.startswith((".", "/", "~"))


def load(selection: str | list[str] | None = None) -> PromptSet:
    """What `--suite` names: task categories (comma-separated; all when empty), a prompts file, or a Hub dataset
    (org/name[@revision][:split or file])."""
    if isinstance(selection, str) and Path(selection).expanduser().is_file():
        return read_file(Path(selection).expanduser())
    if isinstance(selection, str) and ":" not in selection and selection.lower().endswith(DATA_SUFFIXES):
        raise UserError(f"prompts file {selection!r} does not exist.")  # a path, not a Hub dataset's id
    names = selection.split(",") if isinstance(selection, str) else selection or []
    names = [n.strip() for n in names if n.strip()]
    suite = task_suite()
    if len(names) == 1 and names[0] not in suite.categories() and is_dataset_id(names[0]):
        return read_hub(names[0])
    unknown = [n for n in names if n not in suite.categories()]
    if unknown:
        raise UserError(f"unknown task categories {unknown}: use {', '.join(suite.categories())}, a prompts file "
                        "(JSON lines, JSON, CSV, text) or a Hub dataset (org/name).")  # fmt: skip
    return suite.only(names)


def as_set(prompts) -> PromptSet:
    """A PromptSet as is; the older {category: [prompt, ...]} mapping as a set named "prompts"."""
    if isinstance(prompts, PromptSet):
        return prompts
    records = [(f"{c} {i + 1}", {"prompt": p, "category": c}) for c, ps in prompts.items() for i, p in enumerate(ps)]
    items, skipped, _ = items_of(records, "prompts")
    text = json.dumps(prompts, sort_keys=True).encode()
    return PromptSet("prompts", "sha256:" + hashlib.sha256(text).hexdigest(), "prompt", items, skipped)


def select(prompts: PromptSet, categories: list[str] | None = None, per_category: int | None = None,
           seed: int | None = None, held_out: float = 0.0, part: str = "held-out") -> PromptSet:  # fmt: skip
    """Categories, then the held-out split (measure on `part`: "held-out", "train" or "all"), then N per category.
    The split comes before sampling so an item's side never depends on how many were drawn."""
    chosen = prompts.only(categories)
    if held_out:
        train, out = chosen.split(held_out, seed)
        parts = {"held-out": out, "train": train}
        if part in parts:
            chosen = parts[part]
        else:
            chosen = chosen.narrowed(chosen.items, held_out=held_out, split_seed=seed or 0, part="all")
        if not chosen.items:
            raise UserError(f"the {part} part of {prompts.name} is empty at a held-out share of {held_out}: raise the "
                            "share or pick more categories.")  # fmt: skip
    return chosen.sample(per_category, seed)


# --- Hub datasets ----------------------------------------------------------------------------------------------


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _data_files(files: list[str], part: str, spec: str) -> list[str]:
    """The files of a dataset to read: the one named, or a split's shards, or the only data file."""
    data = sorted(f for f in files if f.lower().endswith(DATA_SUFFIXES) and not f.startswith("."))
    if part and part in files:
        return [part]
    if part:
        chosen = [f for f in data if Path(f).name.startswith(part) or f"/{part}/" in f"/{f}"
                  or Path(f).stem.endswith(f"_{part}") or Path(f).stem == part]  # fmt: skip
        if not chosen:
            raise UserError(f"dataset {spec!r} has no split or file {part!r}: its data files are "
                            f"{', '.join(data[:10]) or 'none'}.")  # fmt: skip
        return chosen
    if len(data) == 1:
        return data
    raise UserError(f"dataset {spec!r} has {len(data)} data files: name a split or a file after ':', e.g. "
                    f"{spec}:{data[0] if data else 'train'}. Files: {', '.join(data[:10]) or 'none'}.")  # fmt: skip


def read_hub(spec: str) -> PromptSet:
    """A Hub dataset, `org/name[@revision][:split or file]`: one quick question to the Hub first (as for models,
    engine.models.loading.hub_folder), then the chosen files; with no network, or HF_HUB_OFFLINE=1, the local
    cache alone. The fingerprint is the dataset's revision."""
    from huggingface_hub import HfApi, snapshot_download

    head, _, part = spec.partition(":")
    repo, _, revision = head.partition("@")
    offline, why, files = _offline(), "HF_HUB_OFFLINE is set", None
    if not offline:
        try:
            info = HfApi().dataset_info(repo, revision=revision or None, timeout=10)
            files = [s.rfilename for s in info.siblings or []]
        except Exception as exc:  # noqa: BLE001 - sorted into the Hub's answers and "no answer"
            known = _hub_refusal(exc, repo, revision)
            if known is not None:
                raise known from None
            offline, why = True, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}"
    try:
        patterns = _data_files(files, part, spec) if files is not None else None
        folder = Path(snapshot_download(repo, repo_type="dataset", revision=revision or None, allow_patterns=patterns,
                                        local_files_only=offline))  # fmt: skip
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001
        if offline:
            raise UserError(f"the Hugging Face Hub cannot be reached from here ({why}) and dataset {repo!r} is not in "
                            "the local cache: connect this machine to the network, or give the prompts as a local "
                            "file (JSON lines, JSON, CSV or text).") from None  # fmt: skip
        raise _hub_refusal(exc, repo, revision) or UserError(f"could not fetch dataset {repo!r} from the Hub "
                                                             f"({type(exc).__name__}: {exc}).") from None  # fmt: skip
    local = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    chosen = _data_files(local, part, spec)
    return _read_shards(folder, chosen, spec, f"revision:{folder.name}")


def _read_shards(folder: Path, files: list[str], spec: str, fingerprint: str) -> PromptSet:
    name = spec.split(":")[0].split("@")[0]  # records without a category are the dataset's
    sets = [read_bytes((folder / f).read_bytes(), f, fingerprint, category=name) for f in files]
    items = [replace(i, where=f"{f} {i.where}") for f, s in zip(files, sets) for i in s.items]
    skipped = [replace(k, where=f"{f} {k.where}") for f, s in zip(files, sets) for k in s.skipped]
    return PromptSet(spec, fingerprint, sets[0].layout, items, skipped)


def _hub_refusal(exc: Exception, repo: str, revision: str) -> UserError | None:
    from engine.models.loading import hub_refusal

    return hub_refusal(exc, repo, revision, kind="dataset")


# --- the target's context ----------------------------------------------------------------------------------------


def too_long(exc: UserError) -> bool:
    """Whether a backend's encode refused a prompt for the context (its message names the prompt field)."""
    return exc.field == "prompt" and ("context" in str(exc) or "max_model_len" in str(exc))
