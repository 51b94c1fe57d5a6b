"""Hugging Face-style model directories: config.json + *.safetensors + tokenizer files.

Used both for user-supplied HF checkpoints and for the GGUF conversion cache. Cache entries are
written into a private temp directory and published with one `os.rename`, so a reader sees
either no entry or a complete one, even with concurrent or crashed writers.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from sparsex.models.model_config import ModelConfig
from sparsex.models.moe import detect_moe_layout
from sparsex.models.shapes import param_shapes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Written last into every cache entry; names the entry and the conversion format that made it.
MARKER_FILE = "sparsex_source.json"
# Bump when the conversion changes (names, layout, config keys): older entries are then rebuilt.
CONVERSION_FORMAT = 1
_TMP_PREFIX = ".tmp-"
# Keys some checkpoints carry that are buffers, not parameters (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class HFDirContents:
    hf_config: dict[str, Any]
    config: ModelConfig
    weights: dict[str, torch.Tensor]    # HF parameter name -> tensor in the requested dtype
    tokenizer: "PreTrainedTokenizerBase"
    marker: dict[str, Any] | None       # MARKER_FILE content when the directory is a cache entry


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def read_marker(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MARKER_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:   # sharded checkpoints: model-00001-of-0000N.safetensors, ...
        tensors.update(load_file(file))
    return tensors


# Multimodal checkpoints whose text model is served on its own: the prefixes its tensors carry on
# disk (original layout, then transformers 5's in-memory one) and the towers that are dropped.
_TEXT_MODEL_PREFIXES = {"gemma3": ("language_model.", "model.language_model.")}
_OTHER_TOWERS = {"gemma3": ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")}


def _text_model_tensors(hf_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint (Gemma 3 4B+): its language model's tensors under the text model's
    own names (`language_model.model.layers.0...` -> `model.layers.0...`); vision tensors dropped."""
    arch = hf_config.get("model_type")
    if arch not in _TEXT_MODEL_PREFIXES:
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.startswith(_OTHER_TOWERS[arch]):
            continue
        for prefix in _TEXT_MODEL_PREFIXES[arch]:
            if name.startswith(prefix):
                name = name[len(prefix):]
                # transformers 5 keeps `model.language_model.layers...`: the text model's `model.` is implied
                name = name if name.startswith(("model.", "lm_head.")) else "model." + name
                break
        out[name] = t
    return out


def _select_weights(path: str, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Keep exactly the expected parameters (validated by shape), cast to `dtype`."""
    expected = param_shapes(config, detect_moe_layout(tensors))
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"model directory {path!r} lacks parameter {name!r}")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"model directory {path!r}: {name!r} has shape {tuple(t.shape)}, expected {shape}")
        weights[name] = t if t.dtype == dtype else t.to(dtype)
    # A tied checkpoint may still store lm_head.weight (a copy of the embeddings): drop it.
    unexpected = [n for n in tensors if n not in expected and n != "lm_head.weight" and not n.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        raise ValueError(f"model directory {path!r} has unexpected tensors, e.g. {unexpected[:3]}")
    return weights


# Tokenizer classes that are nothing but a `tokenizer.json` (what conversions save).
_PLAIN_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str) -> "PreTrainedTokenizerBase":
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        tokenizer_class = None
    try:
        if tokenizer_class in _PLAIN_FAST_TOKENIZERS:
            # Same class AutoTokenizer would pick, but without AutoTokenizer's detour through
            # AutoConfig, whose imports cost seconds per process (0.3 s vs ~4 s here).
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"model directory {path!r}: cannot load its tokenizer ({e})") from e


def read_hf_dir(path: str, *, dtype: torch.dtype) -> HFDirContents:
    if not is_hf_dir(path):
        raise ValueError(f"{path!r} is not a model directory (no config.json)")
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    config = ModelConfig.from_hf_config(hf_config)
    weights = _select_weights(path, config, _text_model_tensors(hf_config, _load_tensors(path)), dtype)
    return HFDirContents(hf_config, config, weights, load_tokenizer(path), read_marker(path))


def write_hf_dir(
    tmp: str,
    hf_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    tokenizer: "PreTrainedTokenizerBase",
    marker: dict[str, Any],
) -> None:
    """Fill the (empty) directory `tmp`; the caller publishes it with `publish`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = dict(hf_config)
    # Round-trip through transformers' config class so config.json is exactly what
    # `AutoModelForCausalLM.from_pretrained` expects for this transformers version.
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, MARKER_FILE), "w") as f:
        json.dump({**marker, "format": CONVERSION_FORMAT}, f, indent=2)


def is_current_entry(path: str) -> bool:
    marker = read_marker(path)
    return marker is not None and marker.get("format") == CONVERSION_FORMAT


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_orphan_temps(root: str) -> None:
    """Temp dirs of writers that died mid-conversion (their pid is gone) are garbage."""
    for tmp in glob.glob(os.path.join(root, _TMP_PREFIX + "*")):
        try:
            pid = int(os.path.basename(tmp)[len(_TMP_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def build_cache_entry(root: str, entry: str, fill: Callable[[str], None]) -> str:
    """Create `root/entry` atomically: `fill(tmp)` writes a complete directory, then one rename
    publishes it. If another process published first, its entry wins and ours is discarded."""
    os.makedirs(root, exist_ok=True)
    _remove_orphan_temps(root)
    final = os.path.join(root, entry)
    tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-{entry}-", dir=root)
    try:
        fill(tmp)
        # mkdtemp makes the directory private (0700); a cache entry is meant to be shared.
        os.chmod(tmp, 0o755)
        for file in os.listdir(tmp):
            os.chmod(os.path.join(tmp, file), 0o644)
        if os.path.isdir(final) and not is_current_entry(final):
            # Stale format: move it aside (atomically) so the rename below can take its place.
            stale = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-stale-", dir=root)
            try:
                os.rename(final, os.path.join(stale, entry))
            except FileNotFoundError:
                pass   # a concurrent writer moved it first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_current_entry(final):   # not a lost race: a real error
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
