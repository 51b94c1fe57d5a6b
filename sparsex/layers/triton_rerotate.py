"""Move cached K/V rows to new slots and re-rotate the keys to their new positions (segment reuse).

RoPE is a rotation per frequency pair, R(b - a)·R(a)·k = R(b)·k, so a key cached at position a is
moved to position b by one more rotation by delta = b - a; values carry no position and are copied.
Layout is HF "rotate_half" (neox): pair i is (i, i + rot/2), with rot = 2 * len(inv_freq) (partial
rotary: dims >= rot are copied unrotated).

Angles are formed in float64 and reduced modulo 2π before the float32 sin/cos: delta * inv_freq
reaches ~1e5 rad for long prompts, where a float32 product alone would be off by ~1e-2 rad.

`copy_and_rerotate_torch` is the reference and the CPU path; `copy_and_rerotate_layers` is the Triton
kernel (CUDA only), which moves the rows of every layer in one launch: a blended step copies 30+
layers, and one launch per layer cost ~40 us of host time each (the host launches a blended 8k
step in about the time the GPU runs it). The torch version reads every source row before any
write; the Triton kernel needs the destination slots disjoint from the other rows' source slots (a
row may be moved in place).
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                    # CPU-only installs: only the torch reference is available
    triton = None


def _rotation(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of delta * inv_freq: [n, rot/2] float32, angle formed in float64."""
    angle = delta.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]    # [n, rot/2]
    angle = torch.remainder(angle, 2 * math.pi)
    return angle.cos().float(), angle.sin().float()


def _rerotated(k: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """float32 keys [n, kv_heads, D] rotated by `rotation` (`_rotation`'s cos/sin, [n, rot/2]);
    dims past rot (partial rotary) unrotated."""
    cos, sin = rotation[0][:, None, :], rotation[1][:, None, :]           # [n, 1, rot/2]
    half = cos.shape[-1]
    x1, x2, rest = k[..., :half], k[..., half:2 * half], k[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rerotate_keys(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [n, kv_heads, D] (any float dtype) rotated by `delta` [n] positions, in float32."""
    return _rerotated(k.float(), _rotation(delta, inv_freq.to(k.device)))


def copy_and_rerotate_torch(
    k_cache: torch.Tensor,          # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    src_slots: torch.Tensor,        # [n] int64
    dst_slots: torch.Tensor,        # [n] int64
    delta: torch.Tensor,            # [n] int64, new position - old position
    inv_freq: torch.Tensor,         # [rot/2] float32
    rotation: tuple[torch.Tensor, torch.Tensor] | None = None,   # _rotation(delta, inv_freq), if precomputed
) -> None:
    k_flat = k_cache.view(-1, *k_cache.shape[2:])                         # [slots, kv_heads, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if rotation is None:
        rotation = _rotation(delta.to(k_cache.device), inv_freq.to(k_cache.device))
    k = _rerotated(k_flat.index_select(0, src_slots).float(), rotation)   # [n, kv_heads, D]
    v = v_flat.index_select(0, src_slots)                                 # gathered before any write
    k_flat.index_copy_(0, dst_slots, k.to(k_cache.dtype))
    v_flat.index_copy_(0, dst_slots, v)


def _per_layer(inv_freq: torch.Tensor | list[torch.Tensor], num_layers: int) -> list[torch.Tensor]:
    """One frequency tensor per layer: `inv_freq` itself for all, or the list (a layer's own base)."""
    if isinstance(inv_freq, torch.Tensor):
        return [inv_freq] * num_layers
    if len(inv_freq) != num_layers:
        raise ValueError(f"{len(inv_freq)} inv_freq tensors for {num_layers} layers")
    return list(inv_freq)


def _rotations(delta: torch.Tensor, inv_freqs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`_rotation` per layer, computed once per distinct frequency tensor (layers share them)."""
    by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for f in inv_freqs:
        if id(f) not in by_id:
            by_id[id(f)] = _rotation(delta, f)
    return [by_id[id(f)] for f in inv_freqs]


def copy_and_rerotate_all_layers_torch(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src_slots: torch.Tensor, dst_slots: torch.Tensor,
    delta: torch.Tensor, inv_freq: torch.Tensor | list[torch.Tensor],
) -> None:
    """`copy_and_rerotate_torch` on every layer, with the rotation angles computed once per distinct
    `inv_freq` (one tensor for all layers, or a list: each layer's own, e.g. Gemma 3's two bases)."""
    inv_freqs = _per_layer(inv_freq, len(kv_caches))
    for (k_cache, v_cache), f, rotation in zip(kv_caches, inv_freqs, _rotations(delta, inv_freqs)):
        copy_and_rerotate_torch(k_cache, v_cache, src_slots, dst_slots, delta, f, rotation)


def merge_rerotated_all_layers_torch(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src_slots: torch.Tensor, mean_slots: torch.Tensor,
    dst_slots: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor | list[torch.Tensor], weight: float,
) -> None:
    """Every layer: dst <- (1 - weight) * mean + weight * src, src's keys re-rotated by `delta` first
    (in float32). Folds another encoding of a segment into an index entry's running mean
    (segment/segment_registrar.py, "merged encodings"): `mean_slots` hold the mean now, `dst_slots` get the new
    one (the same slots, or an entry's fresh blocks on copy-on-write: one pass, no separate copy);
    `src_slots` must not overlap `dst_slots`. `inv_freq`: as in `copy_and_rerotate_all_layers_torch`."""
    for (k_cache, v_cache), rotation in zip(kv_caches, _rotations(delta, _per_layer(inv_freq, len(kv_caches)))):
        k_flat = k_cache.view(-1, *k_cache.shape[2:])                     # [slots, kv_heads, D]
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        k = _rerotated(k_flat.index_select(0, src_slots).float(), rotation)   # [n, kv_heads, D]
        k = torch.lerp(k_flat.index_select(0, mean_slots).float(), k, weight)
        v = torch.lerp(v_flat.index_select(0, mean_slots).float(), v_flat.index_select(0, src_slots).float(), weight)
        k_flat.index_copy_(0, dst_slots, k.to(k_cache.dtype))
        v_flat.index_copy_(0, dst_slots, v.to(v_cache.dtype))


if triton is not None:

    @triton.jit
    def _rerotate_layers_kernel(
        k_ptrs, v_ptrs, k_ref, src_slots, dst_slots, delta, inv_freq,
        stride_kslot, stride_kh, stride_vslot, stride_vh,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Program (i, l) moves row i of layer l, whose caches are found through the per-layer
        base-address tables `k_ptrs` / `v_ptrs` (int64; every layer's cache has the shape and
        strides of `k_ref`, layer 0's)."""
        i = tl.program_id(0)
        layer = tl.program_id(1)
        k_cache = tl.load(k_ptrs + layer).to(tl.pointer_type(k_ref.dtype.element_ty))
        v_cache = tl.load(v_ptrs + layer).to(tl.pointer_type(k_ref.dtype.element_ty))
        src = tl.load(src_slots + i)
        dst = tl.load(dst_slots + i)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        ok = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        # pair partner and sign of each dim: d < HALF pairs with d + HALF (-sin), d < 2*HALF with
        # d - HALF (+sin); dims past the rotary part are copied (cos 1, sin 0)
        first = offs_d < HALF
        rotary = offs_d < 2 * HALF
        partner = tl.where(first, offs_d + HALF, tl.where(rotary, offs_d - HALF, offs_d))
        freq = tl.load(inv_freq + offs_d % HALF, mask=rotary, other=0.0)                 # [BLOCK_D]
        angle = tl.load(delta + i).to(tl.float64) * freq.to(tl.float64)
        angle = (angle - tl.floor(angle / 6.283185307179586) * 6.283185307179586).to(tl.float32)
        cos = tl.where(rotary, tl.cos(angle), 1.0)
        sin = tl.where(first, -tl.sin(angle), tl.where(rotary, tl.sin(angle), 0.0))
        src_k = k_cache + src * stride_kslot + offs_h[:, None] * stride_kh
        x = tl.load(src_k + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)         # [H, D]
        xp = tl.load(src_k + partner[None, :], mask=ok, other=0.0).to(tl.float32)
        k_new = x * cos[None, :] + xp * sin[None, :]
        v = tl.load(v_cache + src * stride_vslot + offs_h[:, None] * stride_vh + offs_d[None, :], mask=ok)
        tl.store(k_cache + dst * stride_kslot + offs_h[:, None] * stride_kh + offs_d[None, :],
                 k_new.to(k_ref.dtype.element_ty), mask=ok)
        tl.store(v_cache + dst * stride_vslot + offs_h[:, None] * stride_vh + offs_d[None, :], v, mask=ok)


class LayerPointers:
    """Device tables of every layer's K and V cache base address, made once for a list of caches
    (they never move), for `copy_and_rerotate_layers`."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        k0 = kv_caches[0][0]
        for k_cache, v_cache in kv_caches:
            for c in (k_cache, v_cache):
                if c.shape != k0.shape or c.stride() != k0.stride() or c.dtype != k0.dtype or c.device != k0.device:
                    raise ValueError("every layer's K/V cache must have layer 0's shape, strides, dtype and device")
        self.k_ref = k0
        self.v_stride = kv_caches[0][1].stride()
        self.k_ptrs = torch.tensor([k.data_ptr() for k, _ in kv_caches], dtype=torch.int64, device=k0.device)
        self.v_ptrs = torch.tensor([v.data_ptr() for _, v in kv_caches], dtype=torch.int64, device=k0.device)
        self.num_layers = len(kv_caches)


def copy_and_rerotate_layers(
    layers: LayerPointers,
    src_slots: torch.Tensor,        # [n] int64
    dst_slots: torch.Tensor,        # [n] int64, disjoint from other rows' src slots
    delta: torch.Tensor,            # [n] int64, new position - old position
    inv_freq: torch.Tensor,         # [rot/2] float32
) -> None:
    """`copy_and_rerotate_torch` on every layer of `layers`, in one kernel launch (CUDA only)."""
    n = src_slots.numel()
    if n == 0:
        return
    k = layers.k_ref
    num_kv_heads, head_dim = k.shape[2], k.shape[3]
    half = inv_freq.numel()
    assert 2 * half <= head_dim and k.stride(-1) == 1 and k.stride(0) == k.shape[1] * k.stride(1)
    _rerotate_layers_kernel[(n, layers.num_layers)](
        layers.k_ptrs, layers.v_ptrs, k, src_slots, dst_slots, delta, inv_freq.float(),
        k.stride(1), k.stride(2), layers.v_stride[1], layers.v_stride[2],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
