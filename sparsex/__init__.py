"""SparseX: an LLM serving engine that reuses KV cache for segments, not only exact prefixes."""
from sparsex.entrypoints.llm import LLM
from sparsex.outputs import CompletionOutput, RequestOutput
from sparsex.sampling_params import SamplingParams
from sparsex.version import __version__  # noqa: F401  (sparsex.__version__)

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
