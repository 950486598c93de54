"""The step schedule: when each group is gathered, prefetched, freed and reduced in one training step.

[Note: one schedule]
A :class:`StepSchedule` is built from the groups' settings (``fully_shard``'s ``prefetch`` and
``reshard_after_forward``, the ``set_*`` methods, the plan) and the order their forwards run in. It answers the
questions ``fully_shard``'s hooks ask (which groups to prefetch when this one's forward or backward starts, whether
to free the parameters after forward, how many ReduceScatters stay in flight) and lists one step as events
(:meth:`StepSchedule.events`), which the dry run walks to size its memory. Neither decides these itself, so the
prediction follows the engine. The rules:

* forward: a group's pre-forward prefetches the next ``prefetch`` groups in forward order (or exactly the groups
  ``set_modules_to_forward_prefetch`` listed); its post-forward frees its parameters if it reshards after forward,
  except a root, which keeps them for backward (its backward comes first) unless ``set_reshard_after_forward`` was
  called on it, as FSDP2's ``_auto_reshard_after_forward``;
* backward runs in reverse order of the post-forwards (the root's pre-forward comes first but its head runs last);
  a group's pre-backward gathers it again if its backward reads its parameters (not a group of embeddings) and
  prefetches the next ``prefetch`` groups in backward order (or the ``set_modules_to_backward_prefetch`` list); not
  the root's (the loss's backward holds the step's peak there), nor on CPU (:func:`default_backward_prefetch`);
* a group's backward ends when the next group's to start is not nested in it (a block's experts start after the
  block's backward has and end before it), and its ReduceScatter is issued then; then the oldest beyond its ``reduces_in_flight``
  complete (:func:`default_reduces_in_flight`).

Groups are named by their module's path under the root (``""``: the root); only torch is needed, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence, Union

import torch

__all__ = [
    "REDUCES_IN_FLIGHT", "GroupSettings", "StepEvent", "StepSchedule", "default_backward_prefetch",
    "default_reduces_in_flight", "root_done_early",
]

REDUCES_IN_FLIGHT = 1
"""ReduceScatters left in flight when a group issues its own, on an accelerator: the previous group's had this
group's backward to complete, and waiting for it before the next one frees its unsharded gradient buffer while
at most one group's reduction overlaps compute, as FSDP2 keeps one ReduceScatter input."""


def default_backward_prefetch(device: Union[torch.device, str]) -> bool:
    """True on an accelerator (the next group's AllGather runs beside this group's backward); False on CPU, where
    gloo's AllGather is a thread on the cores that compute and holds a staging copy of its output while it runs:
    prefetching saved no step time and put the next group twice into the backward peak (MoE, 2 ranks: 0.89x
    FSDP2's peak without it, 0.99x with it; benchmarks/results/train_gradalloc.md)."""
    return torch.device(device).type != "cpu"


def default_reduces_in_flight(device: Union[torch.device, str]) -> int:
    """1 on an accelerator (the ReduceScatter runs beside compute); 0 on CPU, where gloo's ReduceScatter is a
    thread on the cores that compute and keeps staging copies of its input: overlapping it saved no step time
    and held the previous group's gradients in the backward peak (benchmarks/results/train.md)."""
    return 0 if torch.device(device).type == "cpu" else REDUCES_IN_FLIGHT


def root_done_early(module_names: Sequence[str], inner_groups: Sequence[str], param_modules: Sequence[str]) -> bool:
    """Whether a root's parameters all sit in modules after every other group's (a final norm and head), so its
    gradients are complete as soon as backward has passed the head. ``module_names``: the model's module paths in
    ``named_modules()`` order; ``inner_groups``: the other groups' paths; ``param_modules``: the paths of the
    modules holding the root's parameters."""
    position = {name: i for i, name in enumerate(module_names)}
    last_inner = max((i for name, i in position.items()
                      if any(name == n or name.startswith(n + ".") for n in inner_groups)), default=-1)
    owners = [position.get(m, -1) for m in param_modules]
    return bool(owners) and min(owners) > last_inner


@dataclass(frozen=True)
class GroupSettings:
    """One group's part in the step schedule, as ``fully_shard``, its ``set_*`` methods or a plan set it."""

    name: str
    """The module's path under the root (``""``: the root itself)."""
    is_root: bool = False
    reshard_after_forward: bool = True
    root_keeps: bool = True
    """A root keeps its parameters from forward to backward whatever ``reshard_after_forward`` says (False once
    ``set_reshard_after_forward`` was called on it)."""
    prefetch: int = 1
    """Groups ahead whose AllGathers this group's hooks issue, in forward and in backward order."""
    forward_prefetch: Optional[tuple[str, ...]] = None
    """``set_modules_to_forward_prefetch``: exactly these groups instead of the next ``prefetch`` ones."""
    backward_prefetch: bool = True
    """Whether this group's pre-backward prefetches (``set_backward_prefetch``; :func:`default_backward_prefetch`)."""
    backward_prefetch_targets: Optional[tuple[str, ...]] = None
    """``set_modules_to_backward_prefetch``: exactly these groups (whatever ``backward_prefetch`` says)."""
    backward_reads_params: bool = True
    """False for a group of embeddings: its backward reads no weight, so it is not gathered for backward."""
    reduces_in_flight: int = REDUCES_IN_FLIGHT
    """ReduceScatters left running once this group has issued its own (``set_reduces_in_flight``)."""
    reduces: bool = True
    """Whether the group has gradients to reduce (a frozen or empty group issues no ReduceScatter)."""
    done_early: bool = False
    """A root whose modules run after every other group's (:func:`root_done_early`): its backward is over as soon
    as backward has passed the head."""


EventKind = Literal["gather", "prefetch", "forward", "free", "loss_backward", "root_grad_buffers", "grad_buffer",
                    "backward", "backward_done", "reduce", "reduce_done"]


@dataclass(frozen=True)
class StepEvent:
    """One thing the engine does in a step, to ``groups`` (in order):

    ``gather`` (wait for the AllGather, issuing it unless prefetched), ``prefetch`` (issue it), ``forward`` (the
    group's forward runs, saving its activations), ``free`` (its gathered parameters go, after forward),
    ``loss_backward`` (backward starts at the loss), ``root_grad_buffers`` (the head's weight gradient arrives and
    the roots' gradient buffers come with it), ``grad_buffer`` (the group's first gradient allocates its buffer),
    ``backward`` (its backward runs), ``backward_done`` (its activations and gathered parameters go), ``reduce``
    (its ReduceScatter is issued), ``reduce_done`` (a ReduceScatter completes, freeing its unsharded gradients).
    """

    kind: EventKind
    groups: tuple[str, ...] = ()


def _is_ancestor(a: str, b: str) -> bool:
    return a == "" or b.startswith(a + ".")


def _first_index(order: Sequence[str]) -> dict[str, int]:
    first: dict[str, int] = {}
    for i, name in enumerate(order):
        first.setdefault(name, i)
    return first


def _next_in(order: Sequence[str], first: dict[str, int], name: str, count: int) -> list[str]:
    """The ``count`` entries after ``name``'s first one in ``order`` (none when it is not there)."""
    i = first.get(name)
    return [] if i is None else list(order[i + 1 : i + 1 + count])


def _post_forward_order(forward_order: Sequence[str]) -> list[str]:
    """The order the post-forwards of groups run in when their forwards start in ``forward_order`` and a group
    contains those named below it (a group's forward ends once its subtree's have)."""
    out: list[str] = []
    parents: list[str] = []
    for name in forward_order:
        while parents and not _is_ancestor(parents[-1], name):
            out.append(parents.pop())
        parents.append(name)
    return out + parents[::-1]


class StepSchedule:
    """One training step's schedule (see [Note: one schedule] in :mod:`lightning_vescale.engine.schedule`).

    Args:
        groups: every group's settings, in forward order unless ``forward_order`` is given.
        forward_order: the names of the groups as their forwards start (a module called twice appears twice; a
            group whose forward did not run is left out); default: ``groups``' order. Empty before the engine has
            recorded one step: then only explicit prefetch lists apply.
        backward_order: the names as their backwards start; default: the reverse of the post-forward order (as the
            engine records it; derived from the names' nesting here).
        roots_prefetch_backward: whether a root's pre-backward prefetches the first groups in backward order, as
            FSDP2's does (lightning-vescale's does not: the loss's backward holds the step's peak there).
    """

    def __init__(self, groups: Sequence[GroupSettings], *, forward_order: Optional[Sequence[str]] = None,
                 backward_order: Optional[Sequence[str]] = None, roots_prefetch_backward: bool = False) -> None:
        self.groups = {g.name: g for g in groups}
        if len(self.groups) != len(groups):
            raise ValueError(f"group names must be unique, got {[g.name for g in groups]}")
        self.forward_order = list(forward_order) if forward_order is not None else [g.name for g in groups]
        listed = [n for g in groups for n in (*(g.forward_prefetch or ()), *(g.backward_prefetch_targets or ()))]
        unknown = [n for n in [*self.forward_order, *(backward_order or ()), *listed] if n not in self.groups]
        if unknown:
            raise ValueError(f"the orders or prefetch lists name groups without settings: {unknown}")
        self.backward_order = (list(backward_order) if backward_order is not None
                               else _post_forward_order(self.forward_order)[::-1])
        self.roots_prefetch_backward = roots_prefetch_backward
        self._forward_index = _first_index(self.forward_order)
        self._backward_index = _first_index(self.backward_order)

    # -- the hooks' questions -----------------------------------------------------------------------------
    def forward_prefetch(self, name: str) -> list[str]:
        """The groups whose AllGathers ``name``'s pre-forward issues."""
        g = self.groups[name]
        if g.forward_prefetch is not None:
            return list(g.forward_prefetch)
        return _next_in(self.forward_order, self._forward_index, name, g.prefetch)

    def frees_after_forward(self, name: str) -> bool:
        """Whether ``name``'s post-forward frees its gathered parameters (when backward will come)."""
        g = self.groups[name]
        return g.reshard_after_forward and not (g.is_root and g.root_keeps)

    def backward_prefetch(self, name: str) -> list[str]:
        """The groups whose AllGathers ``name``'s pre-backward issues: neither a root (its backward has started)
        nor a group whose backward reads no parameters."""
        g = self.groups[name]
        if g.backward_prefetch_targets is not None:
            targets = list(g.backward_prefetch_targets)
        elif not g.backward_prefetch:
            targets = []
        elif g.is_root:
            inner = [n for n in self.backward_order if not self.groups[n].is_root]
            targets = inner[: g.prefetch] if self.roots_prefetch_backward else []
        else:
            targets = _next_in(self.backward_order, self._backward_index, name, g.prefetch)
        return [n for n in targets if not self.groups[n].is_root and self.groups[n].backward_reads_params]

    def reduces_in_flight(self, name: str) -> int:
        """ReduceScatters left running once ``name`` has issued its own."""
        return self.groups[name].reduces_in_flight

    # -- the step, as events ------------------------------------------------------------------------------
    def events(self) -> list[StepEvent]:
        """One training step as the engine runs it (the dry run walks this; see [Note: one schedule])."""
        out: list[StepEvent] = []

        def add(kind: EventKind, *names: str) -> None:
            out.append(StepEvent(kind, names))

        parents: list[str] = []  # groups whose forward is still running
        for name in self.forward_order:
            while parents and not _is_ancestor(parents[-1], name):
                done = parents.pop()
                if self.frees_after_forward(done):
                    add("free", done)
            add("gather", name)
            for nxt in self.forward_prefetch(name):
                add("prefetch", nxt)
            add("forward", name)
            parents.append(name)
        for done in reversed(parents):  # the innermost forward ends first
            if self.frees_after_forward(done):
                add("free", done)
        add("loss_backward")
        ran = list(dict.fromkeys(self.forward_order))  # a module called twice runs one backward
        roots = [n for n in ran if self.groups[n].is_root]
        for root in roots:
            add("gather", root)
            for nxt in self.backward_prefetch(root):
                add("prefetch", nxt)
        add("root_grad_buffers", *roots)
        in_flight: list[str] = []

        def reduce(name: str) -> None:
            add("reduce", name)
            if self.groups[name].reduces:
                in_flight.append(name)
                while len(in_flight) > self.reduces_in_flight(name):
                    add("reduce_done", in_flight.pop(0))

        for root in roots:
            if self.groups[root].done_early:
                add("backward_done", root)
                reduce(root)
        def finish(name: str) -> None:
            add("backward_done", name)
            reduce(name)

        running: list[str] = []  # groups whose backward has started and not ended (a nested one ends first)
        for name in dict.fromkeys(self.backward_order):
            if self.groups[name].is_root or name not in ran:
                continue
            while running and not _is_ancestor(running[-1], name):
                finish(running.pop())
            if self.groups[name].backward_reads_params:
                add("gather", name)
            add("grad_buffer", name)
            for nxt in self.backward_prefetch(name):
                add("prefetch", nxt)
            add("backward", name)
            running.append(name)
        while running:
            finish(running.pop())
        for root in roots:
            if not self.groups[root].done_early:
                add("backward", root)
                add("backward_done", root)
                reduce(root)
        for name in in_flight:  # the end of backward waits for every ReduceScatter
            add("reduce_done", name)
        return out
