"""FSDP2's all-gather extensions: a parameter whose local tensor defines fsdp_pre_all_gather
and fsdp_post_all_gather decides what a gather sends and how the full tensor is rebuilt.

# Note [all-gather extensions]: a tensor subclass (torchao's float8 weights, or any of its
# kind) defines two methods. Before each gather the unit calls the shard's
# `fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)` (or, in its
# older form, `fsdp_pre_all_gather(mesh)`), which returns the tensors to send and a
# metadata object; they go in the unit's one all-gather as their bytes (Note [bytes on
# the wire]), so a subclass that sends float8 or bf16 sends that many bytes. After the
# gather the unit calls `fsdp_post_all_gather(outputs, metadata, param_dtype)`, with each
# output the gathered rows of one input ([world * rows, ...], padding included), which
# returns the full tensor and the tensors holding its storage. The full Parameter is made
# from the first call and kept (Note [stable full params]): later gathers pass it as
# `out=`, into the same output buffers and inner storage, which freeing the parameters
# resized to zero. The shard itself is the subclass (sliced and padded through its own
# ops), so the optimizer steps on it as the subclass says. With reshard_after_forward=k the
# 1/k kept after forward is of the gathered outputs, and the gather inside the smaller
# group refills them and rebuilds with the forward's metadata (FSDP2 does not offer this).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from fullshard.errors import fail


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a parameter's local tensor) takes part in Note [all-gather extensions]."""
    pre, post = hasattr(tensor, "fsdp_pre_all_gather"), hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise fail(f"a {type(tensor).__name__} parameter defines only one of fsdp_pre_all_gather and "
                   f"fsdp_post_all_gather", "Define both (FSDP2's all-gather extension protocol), or neither.")
    return pre


class Extension:
    """One parameter's side of Note [all-gather extensions]: its output buffers, the metadata
    of the gather in flight, and the full tensor it rebuilt."""

    def __init__(self, shard: torch.Tensor, fqn: str) -> None:
        self.fqn = fqn
        arguments = len(inspect.signature(shard.fsdp_pre_all_gather).parameters)
        if arguments not in (1, 5):
            raise fail(f"parameter {fqn!r}: fsdp_pre_all_gather takes {arguments} arguments",
                       "Define fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) "
                       "(or FSDP2's older fsdp_pre_all_gather(self, mesh)).")
        self.short = arguments == 1
        self.metadata: Any = None
        self.shapes: list[torch.Size] = []  # of the inputs, padded
        self.kinds: list[tuple[int, torch.dtype, torch.device]] = []  # their numels, dtypes and devices
        self.outputs: list[torch.Tensor] = []  # [world * numel] each, reused from gather to gather
        self.inner: list[torch.Tensor] = []  # what holds the full tensor's storage (post's second result)
        self.full: nn.Parameter | None = None

    def inputs(self, shard: torch.Tensor, padded_rows: int, *, mesh, outer: torch.Size, module: nn.Module,
               mp_policy) -> list[torch.Tensor]:
        """The tensors this rank sends, flat, each of `padded_rows` rows (a shorter one, on a
        rank holding fewer rows, is padded with zeros): what fsdp_pre_all_gather returns."""
        if self.short:
            sent, self.metadata = shard.fsdp_pre_all_gather(mesh)
        else:
            stride = torch.empty(outer, device="meta").stride()
            sent, self.metadata = shard.fsdp_pre_all_gather(mesh, outer, stride, module, mp_policy)
        out = []
        for tensor in sent:
            if tensor.dim() == 0 or tensor.size(0) != padded_rows:
                padded = tensor.new_zeros((padded_rows, *tensor.shape[1:]))
                padded[: tensor.size(0)].copy_(tensor)
                tensor = padded
            out.append(tensor.contiguous())
        self.shapes = [t.shape for t in out]
        self.kinds = [(t.numel(), t.dtype, t.device) for t in out]
        return [t.reshape(-1) for t in out]

    def output_buffers(self, world: int) -> list[torch.Tensor]:
        """Where the gather puts every rank's rows of each input of the gather in flight: the
        first gather's buffers, given their storage back."""
        if not self.outputs:
            self.outputs = [torch.empty(world * numel, dtype=dtype, device=device)
                            for numel, dtype, device in self.kinds]
        else:
            for buffer in self.outputs:
                buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        return self.outputs

    def rebuild(self, shard: torch.Tensor, param_dtype: torch.dtype, shape: torch.Size,
                requires_grad: bool) -> nn.Parameter:
        """The full parameter from the gathered outputs (`shard`'s fsdp_post_all_gather)."""
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.shapes))
        post = shard.fsdp_post_all_gather
        if self.full is None:
            full, self.inner = post(outputs, self.metadata, param_dtype)
            stride = torch.empty(shape, device="meta").stride()
            self.full = nn.Parameter(torch.as_strided(full, shape, stride, 0), requires_grad=requires_grad)
        else:
            for tensor in self.inner:
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            with torch.no_grad(), _unsafe_preserve_version_counter(self.full):  # refills what autograd saved
                post(outputs, self.metadata, param_dtype, out=self.full)
        return self.full  # the metadata stays: a gather inside a smaller group rebuilds from it again

    def free(self) -> None:
        """Free the full tensor's storage and the output buffers (the objects stay)."""
        for tensor in (*self.inner, *self.outputs):
            tensor.untyped_storage().resize_(0)
