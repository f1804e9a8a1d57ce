"""The collective transfer engine: one rank's side of a plan (``reshard/plan.py``), on
torch.distributed (gloo on CPU, NCCL on GPU).

Every scheme runs the same loop — bucket by bucket, each member packs its pieces into one byte
buffer, the group all-gathers the buffers, each member copies what falls inside its generation
shard out of them — so the schemes differ only in the plan's groups and bucket order. Groups of
different micro-DP replicas gather concurrently (they share no ranks).

``reuse=True`` (HybridFlow's zero redundancy): where a rank's training piece lies inside its
generation shard it is copied there once and the training tensor is re-pointed (``Tensor.set_``)
at that region of the generation tensor, freeing its own storage: the training piece *is* part of
the generation shard until ``release`` gives it storage of its own again and drops what was
gathered. The training tensors keep their identity throughout (optimizers, modules and DTensors
still hold the same objects).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.layout import Box, box_numel, contains, intersect, relative
from reshard.plan import Piece, Plan
from transport.device import BACKENDS, HOST, DeviceKind


class ReshardError(RuntimeError):
    """A transfer that cannot run as planned (a missing or misshapen tensor)."""


def gather_group(plan: Plan) -> dist.ProcessGroup | None:
    """This rank's gather group; every rank of the world must call this (same order), since
    creating process groups is collective. None when the group is the whole world."""
    members = [g.members for g in plan.groups]
    if len(members) == 1 and len(members[0]) == dist.get_world_size():
        return None
    mine, _ = dist.new_subgroups_by_enumeration(members)
    return mine


@dataclass
class Transfer:
    """One rank running a plan. ``train``: name → this rank's training piece (the box
    ``plan.held_box`` says); returns name → generation shard for every parameter the rank
    generates with."""

    plan: Plan
    rank: int
    group: dist.ProcessGroup | None
    dtype: torch.dtype = torch.float32
    #: where the training pieces are; shards and buffers are made there (NCCL gathers device
    #: memory, gloo host memory)
    device: torch.device = HOST

    def run(
        self, train: Mapping[str, torch.Tensor], reuse: bool = False
    ) -> dict[str, torch.Tensor]:
        gen = self._allocate(train if reuse else {})
        self._own(train, gen, reuse)
        index = self.plan.groups[self.plan.group_of[self.rank]]
        me = index.members.index(self.rank)
        staging = (
            _Staging(self.plan.bucket_bytes, self.device) if self.plan.scheme == "verl" else None
        )
        gloo = len(index.members) > 1 and dist.get_backend(self.group) == BACKENDS[DeviceKind.CPU]
        for b, per_member in enumerate(index.buckets):
            if gloo:
                self._broadcast_pieces(per_member, train, gen, index.members, staging)
                continue
            sizes = index.bucket_bytes(self.plan.params, b)
            width = max(sizes)
            if width == 0:
                continue
            # in place: the own part is packed straight into its slot of the gathered buffer,
            # so one bucket is all the extra memory a gather takes
            out = torch.empty(width * len(sizes), dtype=torch.uint8, device=self.device)
            send = out[me * width : (me + 1) * width]
            self._pack(per_member[me], train, send)
            if len(sizes) > 1:
                dist.all_gather_into_tensor(out, send, group=self.group)  # in place
            for m, pieces in enumerate(per_member):
                if m != me:
                    self._unpack(pieces, out[m * width : (m + 1) * width], gen, staging)
            del send, out
        if staging is not None:
            staging.flush(gen)
        return gen

    def _broadcast_pieces(
        self,
        per_member: list[list[Piece]],
        train: Mapping[str, torch.Tensor],
        gen: dict[str, torch.Tensor],
        members: list[int],
        staging: _Staging | None,
    ) -> None:
        """One bucket on gloo: a broadcast per piece, sent from where it lies (a contiguous
        training piece goes as is, anything else is packed first) and received where it
        belongs (straight into the generation shard when it is a contiguous region of it, else
        into a buffer copied out at once). Gloo's all-gather would stage the whole bucket
        through a second full-size buffer."""
        me = members.index(self.rank)
        for m, pieces in enumerate(per_member):
            for piece in pieces:
                if m == me:
                    dist.broadcast(self._source(piece, train), src=self.rank, group=self.group)
                    continue
                landing = None if staging is not None else self._landing(piece, gen)
                buffer = landing if landing is not None else self._buffer(piece)
                dist.broadcast(buffer, src=members[m], group=self.group)
                if landing is None:
                    self._unpack([piece], buffer, gen, staging)

    def _buffer(self, piece: Piece) -> torch.Tensor:
        size = torch.empty((), dtype=self.dtype).element_size()
        return torch.empty(box_numel(piece.box) * size, dtype=torch.uint8, device=self.device)

    def _source(self, piece: Piece, train: Mapping[str, torch.Tensor]) -> torch.Tensor:
        tensor, held = self._train_piece(train, piece.param)
        part = tensor[_slices(relative(piece.box, held))]
        if not (part.is_contiguous() and part.dtype == self.dtype):
            part = part.to(self.dtype).contiguous()
        return part.view(-1).view(torch.uint8)

    def _landing(self, piece: Piece, gen: dict[str, torch.Tensor]) -> torch.Tensor | None:
        box = self.plan.gen_box(piece.param, self.rank)
        if box is None or not contains(box, piece.box):
            return None
        region = gen[self.plan.params[piece.param].name][_slices(relative(piece.box, box))]
        return region.view(-1).view(torch.uint8) if region.is_contiguous() else None

    # -- pieces ----------------------------------------------------------------------------------

    def _allocate(self, shared: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Generation shards; where the rank's training piece *is* its generation shard (and
        ``shared`` offers it), the training tensor itself, with nothing allocated or copied."""
        gen = {}
        for i, p in enumerate(self.plan.params):
            box = self.plan.gen_box(i, self.rank)
            if box is None:
                continue
            mine = shared.get(p.name)
            same = box == self.plan.held_box(i, self.rank)
            if mine is not None and same and mine.dtype == self.dtype:
                gen[p.name] = mine
            else:
                shape = [b - a for a, b in box]
                gen[p.name] = torch.empty(shape, dtype=self.dtype, device=self.device)
        return gen

    def _train_piece(
        self, train: Mapping[str, torch.Tensor], param: int
    ) -> tuple[torch.Tensor, Box]:
        p = self.plan.params[param]
        held = self.plan.held_box(param, self.rank)
        tensor = train.get(p.name)
        if held is None or tensor is None:
            raise ReshardError(f"rank {self.rank} holds no training piece of {p.name}")
        want = [b - a for a, b in held]
        if list(tensor.shape) != want:
            raise ReshardError(
                f"rank {self.rank}: {p.name} is {list(tensor.shape)}, the plan expects {want}"
            )
        return tensor, held

    def _own(
        self, train: Mapping[str, torch.Tensor], gen: dict[str, torch.Tensor], reuse: bool
    ) -> None:
        """The rank's own training piece into its generation shard, in place when reusing."""
        for i, p in enumerate(self.plan.params):
            box, held = self.plan.gen_box(i, self.rank), self.plan.held_box(i, self.rank)
            if box is None or held is None:
                continue
            overlap = intersect(box, held)
            if overlap is None:
                continue
            tensor, _ = self._train_piece(train, i)
            if gen[p.name] is tensor:
                continue  # the training piece is the generation shard
            target = gen[p.name][_slices(relative(overlap, box))]
            with torch.no_grad():
                target.copy_(tensor[_slices(relative(overlap, held))])
                if reuse and contains(box, held) and tensor.dtype == self.dtype:
                    tensor.set_(
                        target.untyped_storage(),
                        target.storage_offset(),
                        target.size(),
                        target.stride(),
                    )

    def _pack(
        self, pieces: list[Piece], train: Mapping[str, torch.Tensor], out: torch.Tensor
    ) -> None:
        offset = 0
        for piece in pieces:
            tensor, held = self._train_piece(train, piece.param)
            part = tensor[_slices(relative(piece.box, held))].to(self.dtype)
            n = part.numel() * part.element_size()
            out[offset : offset + n].view(self.dtype).view(part.shape).copy_(part)
            offset += n

    def _unpack(
        self,
        pieces: list[Piece],
        data: torch.Tensor,
        gen: dict[str, torch.Tensor],
        staging: _Staging | None,
    ) -> None:
        offset = 0
        size = torch.empty((), dtype=self.dtype).element_size()
        for piece in pieces:
            shape = [b - a for a, b in piece.box]
            n = _numel(shape) * size
            name = self.plan.params[piece.param].name
            box = self.plan.gen_box(piece.param, self.rank)
            overlap = intersect(box, piece.box) if box is not None else None
            if overlap is not None:
                values = data[offset : offset + n].view(self.dtype).view(shape)
                part = values[_slices(relative(overlap, piece.box))]
                where = _slices(relative(overlap, box))  # type: ignore[arg-type]
                if staging is None:
                    gen[name][where].copy_(part)
                else:
                    staging.add(name, where, part, gen)
            offset += n


def release(train: Mapping[str, torch.Tensor], gen: dict[str, torch.Tensor]) -> None:
    """After generation: training tensors that live inside generation shards get storage of
    their own again, one at a time, and every generation shard is dropped (``gen`` empties)."""
    for name in list(gen):
        shard = gen.pop(name)
        tensor = train.get(name)
        if tensor is None or tensor is shard:
            continue  # nothing of its own: the training tensor served as the shard
        if tensor.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
            fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            with torch.no_grad():
                fresh.copy_(tensor)
                tensor.set_(fresh.untyped_storage(), 0, fresh.size(), fresh.stride())
        del shard


class _Staging:
    """verl's order: each gathered tensor's generation slice is staged through one flat bucket
    before it lands in the engine's weights (an extra copy per byte, as verl pays)."""

    def __init__(self, nbytes: int, device: torch.device = HOST) -> None:
        self.capacity, self.device = nbytes, device
        self.buffer: torch.Tensor | None = None
        self.pending: list[tuple[str, tuple[slice, ...], int, torch.Size]] = []
        self.used = 0

    def add(
        self,
        name: str,
        where: tuple[slice, ...],
        part: torch.Tensor,
        gen: dict[str, torch.Tensor],
    ) -> None:
        n = part.numel() * part.element_size()
        if self.buffer is None:
            self.buffer = torch.empty(max(self.capacity, n), dtype=torch.uint8, device=self.device)
        if self.used + n > self.buffer.numel():
            self.flush(gen)
            if n > self.buffer.numel():
                self.buffer = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.buffer[self.used : self.used + n].view(part.dtype).view(part.shape).copy_(part)
        self.pending.append((name, where, self.used, part.shape))
        self.used += n

    def flush(self, gen: dict[str, torch.Tensor]) -> None:
        if self.buffer is None:
            return
        for name, where, start, shape in self.pending:
            target = gen[name][where]
            n = target.numel() * target.element_size()
            target.copy_(self.buffer[start : start + n].view(target.dtype).view(shape))
        self.pending, self.used = [], 0


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
