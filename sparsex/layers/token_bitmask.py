"""Token bitmasks (structured outputs): which tokens each row may sample, 32 tokens per int32 word.

Bit t % 32 of word t // 32 of a row set = token t allowed (xgrammar's layout; an unconstrained row
is all ones). Applied on the logits' device by xgrammar's kernel (`apply_token_bitmask_`), so the mask
never travels back to the host; `unpack_bitmask` reads a mask as [num_seqs, vocab] bools.
"""
from __future__ import annotations

import torch

BITS_PER_WORD = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_seqs, num_words] int32 -> [num_seqs, vocab_size] bool (True: allowed). Tokens past the
    mask's last word (logits wider than the mask) are disallowed."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [num_seqs, num_words] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)       # [32]
    # arithmetic shift of a negative word fills with ones; & 1 keeps exactly the wanted bit
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                                          # [num_seqs, num_words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()                                  # [num_seqs, num_words * 32]
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.cat([allowed, allowed.new_zeros(bitmask.shape[0], vocab_size - width)], dim=1)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens' logits -> -inf, in place, by xgrammar's own kernel for the logits' device
    (the bitmask exists only once xgrammar has filled it, so it is loaded). logits [num_seqs, vocab]
    float32, bitmask [num_seqs, num_words] on the same device. Returns logits."""
    if logits.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"need logits [num_seqs, vocab] and bitmask [num_seqs, num_words], got "
                         f"{tuple(logits.shape)} and {tuple(bitmask.shape)}")
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
    return logits
