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

from fullshard import runtime
from fullshard.errors import fail
from fullshard.gather import Context, Plain, register_format
from fullshard.param import ShardedParam


class Extension(Plain):
    """One parameter's side of Note [all-gather extensions]: what fsdp_pre_all_gather gives to
    send, its output buffers, and the full tensor fsdp_post_all_gather rebuilt."""

    static = False

    def __init__(self, p: ShardedParam, full_dtype: torch.dtype, context: Context) -> None:
        super().__init__(p, full_dtype, context)
        shard = p.padded_shard
        arguments = len(inspect.signature(shard.fsdp_pre_all_gather).parameters)
        if arguments not in (1, 5):
            raise fail(f"parameter {p.fqn!r}: fsdp_pre_all_gather takes {arguments} arguments",
                       "Define fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) "
                       "(or FSDP2's older fsdp_pre_all_gather(self, mesh)).")
        self.short = arguments == 1
        self.world, self.param_dtype, self.device, self.context = context.world, full_dtype, context.device, context
        self.metadata: Any = None
        self.shapes: list[torch.Size] = []  # of the inputs, padded
        self.outputs_: list[torch.Tensor] = []  # [world * numel] each, reused from gather to gather
        self.sent: list[torch.Tensor] = []  # the inputs of the gather being made
        self.inner: list[torch.Tensor] = []  # what holds the full tensor's storage (post's second result)
        self.full: nn.Parameter | None = None

    def prepare(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """fsdp_pre_all_gather, on the compute stream (Note [gather streams]): the tensors this rank
        sends, flat, each of the shard's padded rows (a shorter one, on a rank holding fewer rows,
        padded with zeros); their sizes make the output buffers."""
        p, call = self.p, self.context
        local = runtime.active.to_device(p.sharded._local_tensor, self.device)  # offload: from pinned memory
        if self.short:
            sent, self.metadata = local.fsdp_pre_all_gather(call.mesh)
        else:
            stride = torch.empty(p.global_shape, device="meta").stride()
            sent, self.metadata = local.fsdp_pre_all_gather(call.mesh, p.global_shape, stride, call.module,
                                                            call.mp_policy)
        out = []
        for tensor in sent:
            if tensor.dim() == 0 or tensor.size(0) != p.rows_per_shard:
                padded = tensor.new_zeros((p.rows_per_shard, *tensor.shape[1:]))
                padded[: tensor.size(0)].copy_(tensor)
                tensor = padded
            out.append(tensor.contiguous())
        self.shapes = [t.shape for t in out]
        self.dtypes = [t.dtype for t in out]
        self.numels = [t.numel() for t in out]
        self.sent = [t.reshape(-1) for t in out]
        if len(self.outputs_) != len(out) or any(o.dtype != t.dtype for o, t in zip(self.outputs_, out)):
            self.outputs_ = [torch.empty(0, dtype=t.dtype, device=self.device) for t in out]
        self.allocate(False)
        return self.sent

    def allocate(self, small: bool) -> None:
        """The output buffers get their memory (on the compute stream; the objects stay)."""
        for buffer, numel in zip(self.outputs_, self.numels):
            buffer.resize_(self.world * numel)
            buffer.untyped_storage().resize_(self.world * numel * buffer.element_size())
            if runtime.active.tracks:
                runtime.active.allocated(buffer)

    def inputs(self, shard: torch.Tensor) -> list[torch.Tensor]:
        sent, self.sent = self.sent, []
        return sent

    def outputs(self, small: bool) -> list[torch.Tensor]:
        return self.outputs_

    def after(self, small: bool) -> None:
        """The full parameter from the gathered outputs (fsdp_post_all_gather); the metadata stays: a
        gather inside the smaller group rebuilds from it again."""
        p = self.p
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs_, self.shapes))
        post = p.sharded._local_tensor.fsdp_post_all_gather
        if self.full is None:
            full, self.inner = post(outputs, self.metadata, self.param_dtype)
            stride = torch.empty(p.global_shape, device="meta").stride()
            self.full = nn.Parameter(torch.as_strided(full, p.global_shape, stride, 0),
                                     requires_grad=p.sharded.requires_grad)
        else:
            for tensor in self.inner:
                tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            with torch.no_grad(), _unsafe_preserve_version_counter(self.full):  # refills what autograd saved
                post(outputs, self.metadata, self.param_dtype, out=self.full)
        p.unsharded = self.full

    def free(self) -> None:
        """Free the full tensor's storage and the output buffers (the objects stay)."""
        for tensor in (*self.inner, *self.outputs_):
            tensor.untyped_storage().resize_(0)


register_format(lambda p, options: p.extension, Extension)
