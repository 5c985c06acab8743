"""What SpecArena's own path costs on a server backend (vLLM): the same streamed request read through the
backend (events, detokenising, the per-step record) and read raw, alternating which goes first.

    python -m engine bench --backend vllm --compare direct
"""

from __future__ import annotations

import json
import time
import urllib.request

from engine.compare import open_backend, result_of, run
from engine.measure.bench import spread
from engine.settings import Settings

SIDES = ("baseline", "speculative")


def direct_overhead(s: Settings, prompts: list[str], repeats: int = 3, progress=lambda *a: None) -> dict:
    """What SpecArena's path costs on vLLM: decode tokens/s of a streamed completion read through this backend
    (events, detokenising, per-step record) over the same request read raw (bytes counted, nothing parsed
    but the token ids), alternating which goes first, on both servers."""
    backend = open_backend(s)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = backend.encode(prompt, s)
        for role in ("baseline", "speculative"):
            _raw(backend, role, ids, s)  # warm-up
            for r in range(repeats):
                progress(i * repeats + r, len(prompts) * repeats, f"prompt {i + 1}, {role}")
                got = {}
                for name in ("ours", "raw") if r % 2 == 0 else ("raw", "ours"):
                    if name == "ours":
                        events = backend._stream(role, ids, s, None)
                        got[name] = result_of(run(role, events, backend.decode)).metrics.tokens_per_s
                    else:
                        got[name] = _raw(backend, role, ids, s)
                rows.append({"prompt": i, "role": role, "repeat": r, **got, "ratio": got["ours"] / got["raw"]})
    return {
        "kind": "vllm_overhead", "settings": s.to_dict() | {"prompts": prompts, "repeats": repeats},
        "environment": backend.environment,
        "ratio": {side: spread([x["ratio"] for x in rows if x["role"] == side]) for side in SIDES},
        "runs": rows,
    }  # fmt: skip


def _raw(backend, role: str, ids: list[int], s: Settings) -> float:
    """Decode tokens/s of one streamed completion read with nothing but json.loads: tokens after the first
    over the time after the first chunk, as RunResult counts them."""
    request = backend._request(role, ids, s)
    first = last = None
    tokens = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            if raw.startswith(b"data: {"):
                n = len(json.loads(raw[6:])["choices"][0].get("token_ids") or [])
                if n:
                    now = time.perf_counter()
                    first, last, tokens = first or now, now, tokens + n
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
