"""The step schedule (lightning_vescale.engine.schedule): its answers for a small block model, and that the engine's
hooks and the dry run use the same schedule (a step recorded on one gloo rank against the dry run of its plan)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale.engine.fully_shard import get_state
from lightning_vescale.engine.param_group import ParamGroup
from lightning_vescale.engine.schedule import GroupSettings, StepSchedule
from lightning_vescale.models.families import FAMILIES
from lightning_vescale.plan import _dry_run, resolve_plan
from lightning_vescale.plan._files import load_plan
from lightning_vescale.plan._hardware import load_profile

BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


def block_model(root_keeps: bool = True) -> list[GroupSettings]:
    """The FSDP2 idiom's groups: the root (input layer and head), three blocks, each prefetching one group ahead."""
    return [GroupSettings("", is_root=True, root_keeps=root_keeps), *(GroupSettings(b) for b in BLOCKS)]


def kinds(schedule: StepSchedule, *wanted: str) -> list[tuple[str, ...]]:
    return [(e.kind, *e.groups) for e in schedule.events() if e.kind in wanted]


def test_forward_prefetches_the_next_groups_in_forward_order() -> None:
    schedule = StepSchedule(block_model())
    assert [schedule.forward_prefetch(n) for n in ["", *BLOCKS]] == [["blocks.0"], ["blocks.1"], ["blocks.2"], []]
    two = StepSchedule([GroupSettings("", is_root=True, prefetch=2), *(GroupSettings(b, prefetch=0) for b in BLOCKS)])
    assert two.forward_prefetch("") == ["blocks.0", "blocks.1"] and two.forward_prefetch("blocks.0") == []


def test_backward_runs_in_reverse_post_forward_order_and_prefetches_there() -> None:
    # The root's pre-forward comes first, its post-forward last: its backward starts first. It prefetches nothing
    # (FSDP2's does: roots_prefetch_backward); a block prefetches the next one, not the embedding after it.
    groups = [GroupSettings("", is_root=True), GroupSettings("embed", backward_reads_params=False),
              *(GroupSettings(b) for b in BLOCKS)]
    schedule = StepSchedule(groups)
    assert schedule.backward_order == ["", "blocks.2", "blocks.1", "blocks.0", "embed"]
    assert [schedule.backward_prefetch(n) for n in ["", *BLOCKS[::-1]]] == [[], ["blocks.1"], ["blocks.0"], []]
    assert StepSchedule(groups, roots_prefetch_backward=True).backward_prefetch("") == ["blocks.2"]
    cpu = StepSchedule([dataclasses.replace(g, backward_prefetch=False) for g in groups])  # CPU's default
    assert [cpu.backward_prefetch(n) for n in cpu.groups] == [[]] * len(groups)


def test_a_nested_group_runs_its_backward_after_its_parent_starts() -> None:
    groups = [GroupSettings("", is_root=True), GroupSettings("blocks.0"), GroupSettings("blocks.0.experts"),
              GroupSettings("blocks.1")]
    assert StepSchedule(groups).backward_order == ["", "blocks.1", "blocks.0", "blocks.0.experts"]


def test_the_root_keeps_its_parameters_for_backward_unless_asked() -> None:
    assert not StepSchedule(block_model()).frees_after_forward("")
    assert StepSchedule(block_model(root_keeps=False)).frees_after_forward("")
    assert StepSchedule(block_model()).frees_after_forward("blocks.0")
    kept = StepSchedule([GroupSettings("", is_root=True), GroupSettings("blocks.0", reshard_after_forward=False)])
    assert not kept.frees_after_forward("blocks.0")
    assert kinds(StepSchedule(block_model()), "free") == [("free", b) for b in BLOCKS]


def test_explicit_prefetch_lists_override_the_order() -> None:
    groups = block_model()
    groups[1] = dataclasses.replace(groups[1], forward_prefetch=("blocks.2",), backward_prefetch=False,
                                    backward_prefetch_targets=("blocks.1", ""))
    groups[2] = dataclasses.replace(groups[2], forward_prefetch=())
    schedule = StepSchedule(groups)
    assert schedule.forward_prefetch("blocks.0") == ["blocks.2"] and schedule.forward_prefetch("blocks.1") == []
    # Listed, so prefetched even with backward prefetch off; never the root (its backward has started).
    assert schedule.backward_prefetch("blocks.0") == ["blocks.1"]
    with pytest.raises(ValueError, match="without settings"):
        StepSchedule([GroupSettings("", is_root=True, forward_prefetch=("nowhere",))])


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_reduces_in_flight_complete_oldest_first(in_flight: int) -> None:
    schedule = StepSchedule([dataclasses.replace(g, reduces_in_flight=in_flight) for g in block_model()])
    assert schedule.reduces_in_flight("blocks.0") == in_flight
    events = kinds(schedule, "reduce", "reduce_done")
    order = ["blocks.2", "blocks.1", "blocks.0", ""]  # the root holds the input layer: its gradients come last
    want: list[tuple[str, ...]] = []
    running: list[str] = []
    for name in order:
        want.append(("reduce", name))
        running.append(name)
        while len(running) > in_flight:
            want.append(("reduce_done", running.pop(0)))
    assert events == want + [("reduce_done", n) for n in running]


def test_the_events_of_one_step() -> None:
    groups = [GroupSettings("", is_root=True, done_early=True), GroupSettings("embed", backward_reads_params=False),
              GroupSettings("blocks.0"), GroupSettings("blocks.1"),
              GroupSettings("frozen", reduces=False, reshard_after_forward=False)]
    got = [(e.kind, *e.groups) for e in StepSchedule(groups).events()]
    assert got == [
        ("gather", ""), ("prefetch", "embed"), ("forward", ""),
        ("gather", "embed"), ("prefetch", "blocks.0"), ("forward", "embed"), ("free", "embed"),
        ("gather", "blocks.0"), ("prefetch", "blocks.1"), ("forward", "blocks.0"), ("free", "blocks.0"),
        ("gather", "blocks.1"), ("prefetch", "frozen"), ("forward", "blocks.1"), ("free", "blocks.1"),
        ("gather", "frozen"), ("forward", "frozen"),
        ("loss_backward",), ("gather", ""), ("root_grad_buffers", ""),
        ("backward_done", ""), ("reduce", ""),  # the head's backward is over at once
        ("gather", "frozen"), ("grad_buffer", "frozen"), ("prefetch", "blocks.1"), ("backward", "frozen"),
        ("backward_done", "frozen"), ("reduce", "frozen"),  # nothing to reduce: the root's stays in flight
        ("gather", "blocks.1"), ("grad_buffer", "blocks.1"), ("prefetch", "blocks.0"), ("backward", "blocks.1"),
        ("backward_done", "blocks.1"), ("reduce", "blocks.1"), ("reduce_done", ""),
        ("gather", "blocks.0"), ("grad_buffer", "blocks.0"), ("backward", "blocks.0"),
        ("backward_done", "blocks.0"), ("reduce", "blocks.0"), ("reduce_done", "blocks.1"),
        ("grad_buffer", "embed"), ("backward", "embed"), ("backward_done", "embed"), ("reduce", "embed"),
        ("reduce_done", "blocks.0"), ("reduce_done", "embed"),
    ]


def test_a_nested_group_ends_its_backward_before_its_parent() -> None:
    """A block's experts (a group inside the block's): the block's backward starts first (it gathers and allocates
    its gradients), the experts' runs inside it and reduces first, and the block's ends only then."""
    groups = [GroupSettings("", is_root=True), GroupSettings("blocks.0"), GroupSettings("blocks.0.experts"),
              GroupSettings("blocks.1"), GroupSettings("blocks.1.experts")]
    got = [(e.kind, *e.groups) for e in StepSchedule(groups, roots_prefetch_backward=False).events()
           if e.kind in ("gather", "backward", "backward_done", "reduce") and e.groups != ("",)]
    backward = got[[k for k, *_ in got].index("backward") - 1:]
    assert backward == [
        ("gather", "blocks.1"), ("backward", "blocks.1"),
        ("gather", "blocks.1.experts"), ("backward", "blocks.1.experts"),
        ("backward_done", "blocks.1.experts"), ("reduce", "blocks.1.experts"),
        ("backward_done", "blocks.1"), ("reduce", "blocks.1"),
        ("gather", "blocks.0"), ("backward", "blocks.0"),
        ("gather", "blocks.0.experts"), ("backward", "blocks.0.experts"),
        ("backward_done", "blocks.0.experts"), ("reduce", "blocks.0.experts"),
        ("backward_done", "blocks.0"), ("reduce", "blocks.0"),
    ]


# --------------------------------------------------------------------------------------------------------
# The engine's hooks and the dry run: one schedule


def _tiny(family: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = FAMILIES[family]
    with torch.device(device):
        return spec.model_cls(dataclasses.replace(spec.preset("tiny"), n_layers=3))


def _dry_run_schedule(monkeypatch: pytest.MonkeyPatch, family: str) -> StepSchedule:
    """The schedule the dry run of the family's plan walks for lightning-vescale on one CPU rank."""
    model = _tiny(family, "meta")
    seen: list[StepSchedule] = []
    simulate = _dry_run._simulate
    monkeypatch.setattr(_dry_run, "_simulate", lambda schedule, *a: seen.append(schedule) or simulate(schedule, *a))
    _dry_run.dry_run(model, resolve_plan(model, load_plan(family)), 1, hardware=load_profile("cpu"), activations={},
                     workload=_dry_run.Workload(batch_size=1, seq_len=8))
    return seen[0]  # lightning-vescale's, then FSDP2's


@pytest.mark.parametrize("family", ["llama", "moe"])  # moe: each block's experts a group nested in the block's
def test_the_engine_runs_the_schedule_the_dry_run_walks(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                        family: str) -> None:
    """One step of the family's plan on one gloo rank: the root's schedule (built by the hooks from the recorded order
    and the groups' settings) has the events the dry run walks, and the hooks did what it says: the prefetches
    and the frees after forward, in its order (with backward prefetch on too, off on CPU by default)."""
    expected = _dry_run_schedule(monkeypatch, family)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = _tiny(family, "cpu")
        lv.parallelize(model, family, init_weights=False)
        names = {get_state(m).group: n for n, m in model.named_modules() if get_state(m) is not None}
        tokens = torch.randint(0, model.tok_embeddings.num_embeddings, (1, 9))

        def step() -> None:
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            model.zero_grad(set_to_none=True)

        step()  # records the order
        schedule = get_state(model).schedule
        assert schedule.events() == expected.events()
        for name in expected.groups:
            assert (schedule.forward_prefetch(name), schedule.backward_prefetch(name), schedule.frees_after_forward(name),
                    schedule.reduces_in_flight(name)) == (expected.forward_prefetch(name), expected.backward_prefetch(name),
                                                          expected.frees_after_forward(name),
                                                          expected.reduces_in_flight(name)), name
        for backward_prefetch in (False, True):
            model.set_backward_prefetch(backward_prefetch)
            done: list[tuple[str, str]] = []
            unshard, reshard = ParamGroup.unshard, ParamGroup.reshard

            def spy_unshard(group: ParamGroup, async_op: bool = False) -> None:
                if async_op:
                    done.append(("prefetch", names[group]))
                unshard(group, async_op=async_op)

            def spy_reshard(group: ParamGroup, keep_for_backward: bool = False) -> None:
                if group.is_unsharded and torch._C._current_graph_task_id() == -1:  # a free after forward
                    done.append(("free", names[group]))
                reshard(group, keep_for_backward)

            monkeypatch.setattr(ParamGroup, "unshard", spy_unshard)
            monkeypatch.setattr(ParamGroup, "reshard", spy_reshard)
            step()
            monkeypatch.setattr(ParamGroup, "unshard", unshard)
            monkeypatch.setattr(ParamGroup, "reshard", reshard)
            schedule = get_state(model).schedule
            assert done == kinds(schedule, "prefetch", "free"), backward_prefetch
            assert any(kind == "prefetch" for kind, _ in done[done.index(("free", "layers.2")) + 1:]) is backward_prefetch
    finally:
        dist.destroy_process_group()
