"""Fixtures: tiny random models built offline from configs, saved as real model folders.

ByT5's tokenizer needs no files (bytes are tokens), so a complete target/draft pair exists in
a temporary folder within a second, and every path the app uses (loading by folder, vocabulary
checks, the CLI) runs on it. The draft is the target with noise on its weights, so it agrees with
the target often but not always: acceptance lands strictly between 0 and 1.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never wait on the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EOS = 1  # ByT5's </s>


def tiny_llama(vocab_size: int = 384, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=EOS, pad_token_id=0, initializer_range=0.2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(vocab_size: int = 384, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=256,
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0, initializer_range=0.2,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def noisy_copy(model, scale: float = 0.05, seed: int = 1):
    """The same model with Gaussian noise on every weight: a draft that is often, not always, right."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    return draft


def byte_tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


class LetterTokenizer:
    """Minimal tokenizer for tiny-vocabulary models: id i is the letter chr(97 + i) (`reverse`: of the last
    letter, so that the same text has other ids: another tokenizer)."""

    eos_token_id = None
    chat_template = None

    def __init__(self, size: int = 8, reverse: bool = False):
        self.size, self.reverse = size, reverse

    def _id(self, i: int) -> int:
        return self.size - 1 - i if self.reverse else i

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + self._id(i)) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [self._id(ord(c) - 97) for c in text]

    def get_vocab(self):
        return {chr(97 + self._id(i)): i for i in range(self.size)}


@pytest.fixture(scope="session")
def llama_pair():
    target = tiny_llama()
    return target, noisy_copy(target), byte_tokenizer()


@pytest.fixture(scope="session")
def gpt2_pair():
    target = tiny_gpt2()
    return target, noisy_copy(target), byte_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, llama_pair):
    """Saved folders: target, draft (same vocabulary), and a draft with another vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("models")
    os.environ["SPECARENA_MODELS_DIR"] = str(root)  # the app may read local models from here only
    target, draft, tokenizer = llama_pair
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    words = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(381)])}
    other = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=other, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    tiny_llama(seed=3).save_pretrained(root / "other-vocab")
    fast.save_pretrained(root / "other-vocab")
    return {name: str(root / name) for name in ("target", "draft", "other-vocab")}


@contextlib.contextmanager
def app_server(python: str | None = None, **env_extra):
    """`python app.py` (with this interpreter, or `python`) on a free loopback port, on the bundled model, with
    `env_extra` in its environment; yields its URL and stops it after."""
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    from engine.backends.servers import free_port

    port = free_port()
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), GRADIO_ANALYTICS_ENABLED="0",
               SPECARENA_QUEUE_SIZE="4", **env_extra)  # fmt: skip
    env.pop("SPECARENA_MODELS_DIR", None)  # as a public app runs: no local folders, whatever ran before
    root = Path(__file__).resolve().parent.parent
    log = open(root / ".pytest_cache" / "app.log", "w") if (root / ".pytest_cache").is_dir() else subprocess.DEVNULL
    proc = subprocess.Popen([python or sys.executable, "app.py"], cwd=root, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"app.py did not start (exit code {proc.poll()})")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def live_app():
    """`python app.py` on a free loopback port, on the bundled model; yields its URL."""
    with app_server() as url:
        yield url


def seed_hub_cache(root):
    """A Hugging Face Hub cache under `root` holding the bundled model as the Hub names it
    (HuggingFaceTB/SmolLM2-135M-Instruct), made from the converted bundled folder: what a machine that once
    downloaded it has. Set HF_HUB_CACHE to `root` (and HF_HUB_OFFLINE=1) to load it without a network."""
    import shutil
    from pathlib import Path

    from engine.models.loading import BUNDLED_HUB, bundled_folder

    commit = "0" * 40
    repo = Path(root) / ("models--" + BUNDLED_HUB.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in bundled_folder().iterdir():
        if file.is_file():
            shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return Path(root)


@pytest.fixture
def online(monkeypatch):
    """The Hub reachable as far as huggingface_hub knows (the tests set HF_HUB_OFFLINE=1 by default)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False, raising=False)


class RepoNotFound(BaseHTTPRequestHandler):
    def do_GET(self):  # the Hub's answer for an id that does not exist
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_without_repos(online, monkeypatch):
    """A local stand-in for the Hub that knows no repository: it answers 404 RepoNotFound to every request."""
    server = HTTPServer(("127.0.0.1", 0), RepoNotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield
    server.shutdown()
