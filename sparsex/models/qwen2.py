"""Qwen2: the Llama decoder with biases on the q/k/v projections (ModelConfig.attention_bias=True)."""
from sparsex.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same module tree as Llama; `Attention.qkv_proj` gets a bias because config.attention_bias is set."""
