"""A stage's team: the ranks of one stage that serve one pipeline, led by the rank that talks to the pipeline.

[Note: teams]
``torch.distributed.pipelining`` maps one stage to one rank of a pipeline. A stage here may span several
ranks, and stages may differ in size (1 rank for a vision encoder, 3 for a language decoder). With ``R`` the
greatest common divisor of the stages' rank counts, ``R`` pipelines run side by side; pipeline ``p`` takes
from every stage a *team* of ``ranks / R`` consecutive ranks. The team's first rank (the *leader*) is the
pipeline's rank for that stage: torch's ``PipelineStage`` and schedule run there and move activations and
gradients to the neighbouring stages' leaders. Inside the team, each micro-batch is split along dim 0:

* forward: the leader tells the team which micro-batch comes (a broadcast), scatters the inputs, every
  member runs the stage's sharded module on its slice, and the outputs are gathered back to the leader,
  which hands the whole micro-batch's output to the pipeline;
* backward: the leader scatters the output gradients it received, every member runs backward on its slice,
  and the input gradients are gathered back to the leader (for the previous stage).

Both directions are autograd functions, so the leader's team traffic happens exactly where torch's schedule
runs forward and backward, and a member's autograd graph has the same shape as the leader's: the stage's
own collectives (AllGather, ReduceScatter over the stage's sub-mesh) come in the same order on every rank.
With a team of one rank (equal stage sizes) none of this runs: each rank is its pipeline's stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Team", "TeamLeader", "serve_team"]

FORWARD, BACKWARD, END = "F", "B", "END"


class Team:
    """The ranks of one stage serving one pipeline (a process group); rank 0 of the group leads."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.is_leader = dist.get_rank(group) == 0
        self.device = torch.device(device)

    def command(self, cmd: Any = None) -> Any:
        """The leader's ``cmd`` on every member: one broadcast of a few integers (no pickling) for the step's
        commands, an object broadcast for anything else."""
        box = torch.zeros(_COMMAND_LEN, dtype=torch.int64, device=self.device)
        if self.is_leader:
            code = _encode(cmd) or [_OBJECT]
            box[: len(code)] = torch.tensor(code, dtype=torch.int64)
        dist.broadcast(box, group=self.group, group_src=0)
        if int(box[0]) == _OBJECT:
            obj = [cmd]
            dist.broadcast_object_list(obj, group=self.group, group_src=0)
            return obj[0]
        return cmd if self.is_leader else _decode(box.tolist())

    def scatter(self, full: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """The leader's ``full`` cut along dim 0 into ``size`` equal pieces; each member gets its own."""
        piece = torch.empty(tuple(shape), dtype=dtype, device=device)
        pieces = None
        if self.is_leader:
            assert full is not None  # the leader passes the tensor it cuts
            pieces = [c.contiguous() for c in full.chunk(self.size)]
        dist.scatter(piece, pieces, group=self.group, group_src=0)
        return piece

    def gather(self, piece: torch.Tensor) -> torch.Tensor | None:
        """Every member's ``piece`` concatenated along dim 0 on the leader (None elsewhere)."""
        piece = piece.contiguous()
        pieces = [torch.empty_like(piece) for _ in range(self.size)] if self.is_leader else None
        dist.gather(piece, pieces, group=self.group, group_dst=0)
        return torch.cat(pieces) if pieces is not None else None  # (pieces: the leader's)


_COMMAND_LEN = 64
_KINDS = (FORWARD, BACKWARD, END)
_OBJECT = len(_KINDS)  # the command follows as a pickled object
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


def _encode(cmd: Any) -> list[int] | None:
    """``(FORWARD, microbatch, [(shape, dtype, requires_grad), ...])``, ``(BACKWARD, microbatch)`` or ``(END,)``
    as integers; None when it does not fit."""
    if not isinstance(cmd, tuple) or not cmd or cmd[0] not in _KINDS:
        return None
    code = [_KINDS.index(cmd[0]), *(int(x) for x in cmd[1:2])]
    if cmd[0] == FORWARD:
        code.append(len(cmd[2]))
        for shape, dtype, requires_grad in cmd[2]:
            if dtype not in _DTYPES:
                return None
            code += [_DTYPES.index(dtype), int(requires_grad), len(shape), *shape]
    return code if len(code) <= _COMMAND_LEN else None


def _decode(code: list[int]) -> tuple:
    kind = _KINDS[code[0]]
    if kind == END:
        return (END,)
    if kind == BACKWARD:
        return (BACKWARD, code[1])
    metas, i = [], 3
    for _ in range(code[2]):
        dtype, requires_grad, ndim = _DTYPES[code[i]], bool(code[i + 1]), code[i + 2]
        metas.append((tuple(code[i + 3:i + 3 + ndim]), dtype, requires_grad))
        i += 3 + ndim
    return (FORWARD, code[1], metas)


def _piece_shape(shape: Sequence[int], size: int) -> tuple[int, ...]:
    return (shape[0] // size, *shape[1:])


class _ScatterInputs(torch.autograd.Function):
    """Leader: scatter the micro-batch's inputs, keep its own pieces; backward gathers the input gradients."""

    @staticmethod
    def forward(ctx: Any, team: Team, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.team = team
        pieces = tuple(team.scatter(x, _piece_shape(x.shape, team.size), x.dtype, x.device) for x in xs)
        ctx.mark_non_differentiable(*[p for p in pieces if not p.is_floating_point()])
        return pieces

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = [None]
        for needs, g in zip(ctx.needs_input_grad[1:], grads):
            out.append(ctx.team.gather(g) if needs else None)
        return tuple(out)


class _SendInputGrads(torch.autograd.Function):
    """Member: identity on the received pieces; backward sends their gradients to the leader."""

    @staticmethod
    def forward(ctx: Any, team: Team, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.team = team
        out = tuple(p.view_as(p) for p in pieces)
        ctx.mark_non_differentiable(*[p for p in out if not p.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = [None]
        for needs, g in zip(ctx.needs_input_grad[1:], grads):
            if needs:
                ctx.team.gather(g)
            out.append(None)
        return tuple(out)


class _GatherOutputs(torch.autograd.Function):
    """Leader: gather the team's outputs of a micro-batch; backward tells the team and scatters the gradients."""

    @staticmethod
    def forward(ctx: Any, team: Team, microbatch: int, *outs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.team, ctx.microbatch = team, microbatch
        ctx.differentiable = [o.requires_grad for o in outs]
        full = tuple(team.gather(o) for o in outs)
        ctx.mark_non_differentiable(*[f for f, d in zip(full, ctx.differentiable) if not d])
        return full

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        team = ctx.team
        team.command((BACKWARD, ctx.microbatch))
        out: list[torch.Tensor | None] = [None, None]
        for d, g in zip(ctx.differentiable, grads):
            out.append(team.scatter(g, _piece_shape(g.shape, team.size), g.dtype, g.device) if d else None)
        return tuple(out)


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class TeamLeader(nn.Module):
    """What torch's ``PipelineStage`` runs on a team's leader: the stage's module, spread over the team."""

    def __init__(self, stage: nn.Module, team: Team) -> None:
        super().__init__()
        self.stage = stage
        self.team = team
        self._microbatch = 0

    def start_step(self) -> None:
        """Number the next step's micro-batches from 0 (the members number theirs per step too)."""
        self._microbatch = 0

    def forward(self, *args: torch.Tensor) -> Any:
        team = self.team
        microbatch, self._microbatch = self._microbatch, self._microbatch + 1
        metas = [(tuple(a.shape), a.dtype, a.requires_grad) for a in args]
        team.command((FORWARD, microbatch, metas))
        pieces = _ScatterInputs.apply(team, *args)
        outs = _as_tuple(self.stage(*pieces))
        full = _GatherOutputs.apply(team, microbatch, *outs)
        return full if len(full) > 1 else full[0]


def serve_team(stage: nn.Module, team: Team, device: torch.device,
               on_command: Callable[[Any], None] | None = None) -> None:
    """A member's loop for one step: run forward and backward on its slices as the leader says, until END."""
    saved: dict[int, tuple[torch.Tensor, ...]] = {}
    while True:
        cmd = team.command()
        if cmd[0] == END:
            break
        if cmd[0] == FORWARD:
            _, microbatch, metas = cmd
            pieces = []
            for shape, dtype, requires_grad in metas:
                piece = team.scatter(None, _piece_shape(shape, team.size), dtype, device)
                pieces.append(piece.requires_grad_(requires_grad))
            inputs = _SendInputGrads.apply(team, *pieces) if any(p.requires_grad for p in pieces) else tuple(pieces)
            outs = _as_tuple(stage(*inputs))
            for o in outs:
                team.gather(o.detach())
            if torch.is_grad_enabled():  # (evaluation runs forward only)
                saved[microbatch] = outs
        elif cmd[0] == BACKWARD:
            outs = saved.pop(cmd[1])
            diff = [o for o in outs if o.requires_grad]
            grads = [team.scatter(None, o.shape, o.dtype, device) for o in diff]
            torch.autograd.backward(diff, grads)
        else:  # pragma: no cover - a protocol error is a bug, never user input
            raise RuntimeError(f"MPMD team member got an unknown command {cmd!r}")
    if saved:
        raise RuntimeError(f"MPMD team member: micro-batches {sorted(saved)} ran forward but never backward")
