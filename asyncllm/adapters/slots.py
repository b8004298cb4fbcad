"""Device slots holding stacked LoRA weights, and their application over a mixed batch.

Each projection of each layer has a stack ``A`` [max_loras, max_rank, in] and ``B`` [max_loras,
out, max_rank]. Every token of a step carries a slot index (-1 for the base model); tokens are
grouped by slot once per step and each group gets ``x @ A[slot].T @ B[slot].T`` (B is pre-scaled)
added to its output slice. Fused projections (qkv, gate/up) add each part to its own columns.

LoRA on a mixture-of-experts layer's experts (PEFT ``target_parameters``) has stacks of one more dimension,
``A`` [max_loras, experts, max_rank, in] and ``B`` [max_loras, experts, out, max_rank], whole-model sized (the
expert stack cuts its share as it applies them, model/moe_lora.py).
"""

from __future__ import annotations

import torch

from ..kernels.ops import use_cpu, use_triton
from ..kernels import cpu_ops as cpu_kernels
from ..kernels.transfer import stage, to_device
from ..model.shape import DecoderShape
from .peft_loader import EXPERT_TARGETS, LoRALayout, LoRAWeights


class LoRASlots:
    """``max_loras`` device slots; an adapter used by a running sequence is never evicted."""

    def __init__(self, shape: DecoderShape, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, sharding=None, layout: LoRALayout | None = None) -> None:
        """``shape``: the rank's local shape; ``sharding`` (tensor parallelism) cuts each adapter's
        A/B to this rank as it is slotted (distributed/sharding.py); ``layout``: which module applies
        which PEFT targets (default: a native family's fused projections)."""
        self.sharding = sharding
        self.shape, self.max_loras, self.max_rank = shape, max_loras, max_rank
        self.device, self.dtype = device, dtype
        self.layout = layout or LoRALayout.of(shape)
        self.parts = self.layout.parts
        self.shapes = self.layout.shapes
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # allocated on first use
        # per (layer, expert target): the experts' stacks, allocated when an adapter first brings some
        self.expert_stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.expert_slots: dict[tuple[int, str], set[int]] = {}  # the slots holding weights there
        self.row_slots = torch.empty(0, dtype=torch.int64)  # this step: each token row's slot (-1: none)
        # per (layer, part): each slot's rank there (0: its adapter does not target the part); CPU kernel input
        self.ranks: dict[tuple[int, str], torch.Tensor] = {}
        self.token_slots = torch.empty(0, dtype=torch.int64)  # this step: the slot of each row of segments[0]
        self.slot_adapter: list[LoRAWeights | None] = [None] * max_loras
        self.groups: list[tuple[int, torch.Tensor]] = []  # this step: (slot, token rows)
        self.segments: tuple = ()                          # the same, flattened for the kernels
        self._offsets = self._column_offsets()

    def _column_offsets(self) -> dict[str, tuple[str, int, int]]:
        offsets = {}
        for fused, parts in self.parts.items():
            start = 0
            for part in parts:
                size = self.shapes[part][1]
                offsets[part] = (fused, start, size)
                start += size
        return offsets

    def slot_of(self, adapter: LoRAWeights) -> int | None:
        for slot, held in enumerate(self.slot_adapter):
            if held is adapter:
                return slot
        return None

    def activate(self, needed: list[LoRAWeights], in_use: set[int]) -> dict[int, int]:
        """Put every ``needed`` adapter in a slot, evicting only adapters not in ``in_use`` (ids).

        Returns adapter_id -> slot. The scheduler guarantees the running adapters fit."""
        mapping = {}
        for adapter in needed:
            slot = self.slot_of(adapter)
            if slot is None:
                slot = self._free_slot(in_use | {a.adapter_id for a in needed})
                self._load(slot, adapter)
            mapping[adapter.adapter_id] = slot
        return mapping

    def _free_slot(self, protected: set[int]) -> int:
        for slot, held in enumerate(self.slot_adapter):
            if held is None:
                return slot
        for slot, held in enumerate(self.slot_adapter):
            if held.adapter_id not in protected:
                return slot
        raise RuntimeError("more adapters in use than LoRA slots (scheduler invariant broken)")

    def _load(self, slot: int, adapter: LoRAWeights) -> None:
        for layer in range(self.shape.num_layers):
            for target in self.shapes:
                a_stack, b_stack = self._stack(layer, target)
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                pair = adapter.weights.get((layer, target))
                if pair is not None:
                    a, b = pair if self.sharding is None else self.sharding.lora(target, *pair)
                    a_stack[slot, :a.shape[0]].copy_(a)
                    b_stack[slot, :, :b.shape[1]].copy_(b)
                self.ranks.setdefault((layer, target), torch.zeros(self.max_loras, dtype=torch.int64))[slot] = \
                    pair[0].shape[0] if pair is not None else 0
        self._load_experts(slot, adapter)
        self.slot_adapter[slot] = adapter

    def _load_experts(self, slot: int, adapter: LoRAWeights) -> None:
        for key, (a_stack, b_stack) in self.expert_stacks.items():
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            self.expert_slots[key].discard(slot)
        for (layer, target), (a, b) in adapter.weights.items():
            if target not in EXPERT_TARGETS:
                continue
            experts, rank, in_features = a.shape
            key = (layer, target)
            if key not in self.expert_stacks:
                make = lambda *s: torch.zeros(s, device=self.device, dtype=self.dtype)  # noqa: E731
                self.expert_stacks[key] = (make(self.max_loras, experts, self.max_rank, in_features),
                                           make(self.max_loras, experts, b.shape[1], self.max_rank))
                self.expert_slots[key] = set()
            a_stack, b_stack = self.expert_stacks[key]
            a_stack[slot, :, :rank].copy_(a)
            b_stack[slot, :, :, :rank].copy_(b)
            self.expert_slots[key].add(slot)

    def experts_of(self, layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This step's expert LoRA stacks of ``layer`` (per expert target), where a slot in use has weights."""
        found = {}
        for target in EXPERT_TARGETS:
            slots = self.expert_slots.get((layer, target))
            if slots and any(slot in slots for slot, _ in self.groups):
                found[target] = self.expert_stacks[(layer, target)]
        return found

    def _stack(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, target)
        if key not in self.stacks:
            in_features, out_features = self.shapes[target]
            make = lambda *s: torch.zeros(s, device=self.device, dtype=self.dtype)  # noqa: E731
            a_stack = make(self.max_loras, self.max_rank, in_features)
            if self.device.type == "cpu":  # B stored transposed for the CPU kernel; a [slots, out, rank] view
                b_stack = make(self.max_loras, self.max_rank, out_features).transpose(1, 2)
            else:
                b_stack = make(self.max_loras, out_features, self.max_rank)
            self.stacks[key] = (a_stack, b_stack)
        return self.stacks[key]

    def set_groups(self, rows_by_slot: dict[int, list[int]]) -> None:
        """This step's token rows per slot (base-model tokens are in no group: nothing to add)."""
        self.groups = [(slot, to_device(rows, self.device)) for slot, rows in sorted(rows_by_slot.items())]
        if self.expert_stacks:
            row_slots = [-1] * (1 + max((max(rows) for rows in rows_by_slot.values() if rows), default=-1))
            for slot, rows in rows_by_slot.items():
                for row in rows:
                    row_slots[row] = slot
            self.row_slots = to_device(row_slots, self.device)
        ordered = sorted(rows_by_slot.items())
        starts = [0]
        for _, rows in ordered:
            starts.append(starts[-1] + len(rows))
        # the same grouping, flattened segment by segment, for the Triton kernels
        self.token_slots = torch.tensor([slot for slot, rows in ordered for _ in rows], dtype=torch.int64)
        segment_rows, segment_starts, segment_slots = stage(
            [[r for _, rows in ordered for r in rows], starts, [slot for slot, _ in ordered]], self.device)
        longest = max((len(rows) for _, rows in ordered), default=0)
        self.segments = (segment_rows, segment_starts, segment_slots, longest)

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add every group's LoRA delta for ``fused`` of ``layer`` into ``y`` (in place)."""
        if fused not in self.parts:
            return  # a projection this model's layout takes no LoRA on (a latent-attention model's dense MLP)
        if use_triton(x):
            self._apply_kernels(layer, fused, x, y)
            return
        if use_cpu(x) and y.is_contiguous() and x.stride(-1) == 1 and cpu_kernels.lora_available():
            self._apply_cpu(layer, fused, x, y)
            return
        for slot, rows in self.groups:
            adapter = self.slot_adapter[slot]
            xs = x.index_select(0, rows)
            for part in self.parts[fused]:
                pair = adapter.weights.get((layer, part))
                if pair is None:
                    continue
                rank = pair[0].shape[0]
                a_stack, b_stack = self.stacks[(layer, part)]
                delta = (xs @ a_stack[slot, :rank].T) @ b_stack[slot, :, :rank].T
                _, start, size = self._offsets[part]
                y[:, start:start + size].index_add_(0, rows, delta.to(y.dtype))

    def _apply_cpu(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """The same sum with the C kernel: one call per part covers every adapter's tokens."""
        rows = self.segments[0]
        for part in self.parts[fused]:
            a_stack, b_stack = self.stacks[(layer, part)]
            cpu_kernels.lora_apply(x, y, self._offsets[part][1], a_stack, b_stack.transpose(1, 2),
                                   self.ranks[(layer, part)], rows, self.token_slots)

    def _apply_kernels(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """The same sum with the segmented Triton kernels (one shrink and one expand per part)."""
        from ..kernels.lora_kernels import lora_expand, lora_shrink

        rows, starts, slots, longest = self.segments
        x = x.contiguous()
        for part in self.parts[fused]:
            a_stack, b_stack = self.stacks[(layer, part)]
            z = lora_shrink(x, rows, starts, slots, a_stack, longest)
            lora_expand(z, y, self._offsets[part][1], rows, starts, slots, b_stack, longest)
