"""Every attention backend implements `AttentionBackend` (sparsex/layers/attention_backend_protocol.py):
each of its methods with the same parameters (names, kinds, defaults, annotations) and return type,
and a `name`. Signatures only: no CUDA; where Triton is not installed, the Triton backend's module
is loaded with a stand-in `triton` module that only lets its kernels be defined."""
from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path

import pytest

import sparsex.layers
from sparsex.engine.cuda_graph import FixedSplitDecodeBackend
from sparsex.layers.attention_backend import TorchAttentionBackend
from sparsex.layers.attention_backend_protocol import AttentionBackend

pytestmark = pytest.mark.unit

METHODS = ("store_kv", "attention")


class _Placeholder:
    """Any attribute or call of the stand-in triton: a placeholder (the kernels are defined, never run)."""

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder()

    def __call__(self, *args, **kwargs) -> _Placeholder:
        return _Placeholder()


def _stand_in_triton() -> dict[str, types.ModuleType]:
    def jit(fn=None, **options):           # @triton.jit and @triton.jit(...): the function as it is
        return fn if fn is not None else (lambda f: f)

    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    for module in (triton, language):
        module.__getattr__ = lambda name: _Placeholder()
    triton.jit, triton.language = jit, language
    return {"triton": triton, "triton.language": language}


def _triton_backend() -> type:
    if importlib.util.find_spec("triton") is not None:
        from sparsex.layers.triton_attention import TritonAttentionBackend
        return TritonAttentionBackend
    path = Path(sparsex.layers.__file__).with_name("triton_attention.py")
    with pytest.MonkeyPatch.context() as mp:       # the stand-in leaves sys.modules afterwards
        for name, module in _stand_in_triton().items():
            mp.setitem(sys.modules, name, module)
        spec = importlib.util.spec_from_file_location("_triton_attention_signatures", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.TritonAttentionBackend


def _signature(fn) -> tuple[list[tuple], object]:
    """(name, kind, default, annotation) per parameter, `self` left out, and the return annotation."""
    sig = inspect.signature(fn)
    params = [p for i, p in enumerate(sig.parameters.values()) if not (i == 0 and p.name == "self")]
    return [(p.name, p.kind, p.default, p.annotation) for p in params], sig.return_annotation


def _mismatches(backend) -> list[str]:
    out = []
    if not isinstance(getattr(backend, "name", None), str):
        out.append("no `name` string")
    for method in METHODS:
        fn = getattr(backend, method, None)
        if fn is None:
            out.append(f"no {method}")
            continue
        want, got = _signature(getattr(AttentionBackend, method)), _signature(fn)
        if got != want:
            out.append(f"{method}{inspect.signature(fn)} is not {method}{inspect.signature(getattr(AttentionBackend, method))}")
    return out


@pytest.mark.parametrize("make", [lambda: TorchAttentionBackend, _triton_backend, lambda: FixedSplitDecodeBackend(4)],
                         ids=["torch", "triton", "cuda-graph-decode"])
def test_backend_implements_the_protocol(make):
    assert _mismatches(make()) == []


def test_a_dropped_or_changed_method_is_caught():
    class NoSoftCap(TorchAttentionBackend):
        @staticmethod
        def attention(query, k_cache, v_cache, md, scale, key=None, value=None, *, sliding_window=None):
            raise NotImplementedError

    class NoStore:
        name = "no-store"
        attention = TorchAttentionBackend.attention

    assert [m.split("(")[0] for m in _mismatches(NoSoftCap)] == ["attention"]
    assert _mismatches(NoStore) == ["no store_kv"]
