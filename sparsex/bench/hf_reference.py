"""The Hugging Face transformers baseline the CPU benchmarks compare against.

Same weights (the HF-style directory the engine itself loads from), same dtype, same threads, same
process: `transformers.AutoModelForCausalLM` with its default (SDPA) attention and dynamic KV cache.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from sparsex.config import parse_dtype
from sparsex.models.loader import load_model


@dataclass
class HFReference:
    model: "torch.nn.Module"          # transformers PreTrainedModel, eval mode
    pad_token_id: int
    supports_logits_to_keep: bool


def model_dir_of(model: str) -> str:
    """The HF-style directory behind a model spec (for GGUF specs: the conversion cache entry)."""
    loaded = load_model(model)
    if loaded.model_dir is None:
        raise ValueError(f"model {model!r} has no weights on disk (dummy model): "
                         "the transformers baseline needs a real checkpoint")
    return loaded.model_dir


def load_hf_reference(model_dir: str, dtype: str) -> HFReference:
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="sdpa").eval()
    cfg = model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    return HFReference(model, int(pad if pad is not None else 0), keep)


@torch.inference_mode()
def hf_prefill_seconds(ref: HFReference, token_ids: list[int], logits_to_keep: bool = True) -> float:
    """Wall time of one cold prefill and the greedy pick of the first token (what TTFT measures).

    `use_cache=True` like the first step of `generate`: the prefill also materialises the KV cache,
    as the engine's prefill writes its paged cache."""
    ids = torch.tensor([token_ids], dtype=torch.int64)
    kwargs = {"logits_to_keep": 1} if (logits_to_keep and ref.supports_logits_to_keep) else {}
    t0 = time.perf_counter()
    out = ref.model(input_ids=ids, use_cache=True, **kwargs)
    out.logits[0, -1].argmax().item()
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_generate_seconds(ref: HFReference, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    """Batched greedy `generate` over left-padded prompts, never stopping at EOS.

    Returns (wall seconds, generated tokens counted from the output)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), ref.pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    # min_new_tokens == max_new_tokens is the transformers spelling of ignore_eos: EOS is masked
    # until the length is reached, so every row generates exactly max_new_tokens.
    out = ref.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=ref.pad_token_id)
    elapsed = time.perf_counter() - t0
    generated = int(out.shape[1] - width) * len(prompts)
    return elapsed, generated
