"""The integrations' one engine object (``lightning_vescale.parallel.session``): the Trainer strategy, the Fabric strategy
and the Accelerate adapter each hold a ``ShardingSession``, their keyword arguments become a plan through one function
(``plan._compile.resolve_for``), and a bad argument fails with one message whichever integration took it. In one
process: without a process group, or on a fake one (``tests.dist_pool.fake_world``) where only meshes and plans are
built."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from accelerate.state import AcceleratorState

import lightning_vescale as lv
import lightning_vescale.parallel.session as session_module
from lightning_vescale.accelerate import VeScaleAccelerator, VeScaleConfig, _num_nodes
from lightning_vescale.lightning import VeScaleFabricStrategy, VeScaleStrategy
from lightning_vescale.memory import MemoryPolicy
from lightning_vescale.parallel.session import ShardingConfig, ShardingSession
from lightning_vescale.plan._compile import resolve_for
from tests.dist_pool import fake_world
from tests.toy_models import MLP

PACKAGE = Path(lv.__file__).resolve().parent
INTEGRATIONS = [PACKAGE / "lightning" / name for name in ("strategy.py", "fabric.py", "_common.py", "_checkpoints.py")]
INTEGRATIONS.append(PACKAGE / "accelerate.py")
PLAN = {"rules": [{"match": "blocks.*", "group": True}, {"match": "inp", "group": True}]}
BF16 = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.fixture
def accelerate_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _integrations(**kwargs) -> dict[str, ShardingSession]:
    """Each integration built with ``kwargs``, as the engine object it holds (Accelerate: one process, no sharding)."""
    return {
        "VeScaleStrategy": VeScaleStrategy(**kwargs).sharding_session,
        "VeScaleFabricStrategy": VeScaleFabricStrategy(**kwargs).sharding_session,
        "VeScaleConfig": VeScaleAccelerator(cpu=True, vescale=VeScaleConfig(**kwargs)).sharding_session,
    }


def test_the_three_integrations_hold_the_same_engine_class(accelerate_state) -> None:
    sessions = _integrations(reshard_after_forward=False)
    assert {type(s) for s in sessions.values()} == {ShardingSession}
    assert {name: s.who for name, s in sessions.items()} == {name: name for name in sessions}
    assert all(s.config.reshard_after_forward is False for s in sessions.values())  # the kwargs reached the config


def test_the_same_kwargs_give_every_integration_the_plan_resolve_for_gives(accelerate_state) -> None:
    kwargs = dict(plan=PLAN, granularity="row", reshard_after_forward=False, mp_policy=BF16)
    model = MLP()
    expected = resolve_for(model, lv.load_plan(PLAN), roots=[model], mp_policy=BF16,
                           defaults={"reshard_after_forward": False}, granularity="row")
    default = resolve_for(model, lv.load_plan(PLAN), roots=[model])
    assert expected != default  # the kwargs change the plan: the comparison below can fail
    for name, session in _integrations(**kwargs).items():
        assert session.resolve(model, roots=[model]) == expected, name


def test_sharding_applies_the_one_resolved_plan(monkeypatch) -> None:
    calls = []

    def spy(*args, **kwargs):
        calls.append(resolve_for(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(session_module, "resolve_for", spy)
    session = ShardingSession(ShardingConfig(plan=PLAN, granularity="row", sync_module_states=False))
    with torch.device("meta"):
        model = MLP()
    with fake_world(2):
        session.build_mesh(torch.device("cpu"), 2)
        session.shard(model, roots=[model], init_weights=False)
        assert len(calls) == 1  # parallelize applied the session's plan; nothing resolved the kwargs again
        assert lv.resolved_plan_of(model) is calls[0]
        assert session.modules == [model]


def _calls(path: Path) -> set[str]:
    """The functions ``path`` calls: ``f`` for ``f(...)``, ``mod.f`` for ``mod.f(...)`` (a method of the session,
    ``session.f(...)``, is ``session.f``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                names.add(f"{func.value.id}.{func.attr}")
    return names


def test_no_integration_resolves_plans_shards_or_checkpoints_by_another_path() -> None:
    # Plans, meshes, sharding, optimizer remapping, memory handles and sharded checkpoints go through the session.
    forbidden = {"resolve_for", "resolve_plan", "load_plan", "parallelize", "parallelize_spmd", "build_mesh",
                 "build_tensor_parallel_mesh", "build_expert_parallel_mesh", "remap_optimizer", "param_mapping",
                 "apply_memory_policy", "vckpt.save", "vckpt.load", "checkpoint.save", "checkpoint.load"}
    found = {path.name: sorted(_calls(path) & forbidden) for path in INTEGRATIONS}
    assert not any(found.values()), found
    assert "resolve_for" in _calls(PACKAGE / "parallel" / "session.py")  # the control: the scan sees calls


@pytest.mark.parametrize(("kwargs", "error"), [
    (dict(plan=PLAN, auto_wrap_policy={nn.Linear}), ValueError),
    (dict(replicate_size=0), ValueError),
    (dict(mp_policy="bf16"), TypeError),
    (dict(memory=MemoryPolicy(budget="1GiB")), ValueError),
], ids=["plan-and-auto-wrap", "replicate-size", "mp-policy", "memory-budget"])
def test_a_bad_argument_fails_alike_in_all_three(kwargs, error, accelerate_state) -> None:
    constructors = {"VeScaleStrategy": VeScaleStrategy, "VeScaleFabricStrategy": VeScaleFabricStrategy,
                    "VeScaleConfig": VeScaleConfig, "X": lambda **kw: ShardingConfig(who="X", **kw)}
    messages = {}
    for who, make in constructors.items():
        with pytest.raises(error) as info:
            make(**kwargs)
        messages[who] = str(info.value).replace(who, "<integration>")
    assert len(set(messages.values())) == 1, messages
    assert "<integration>" in messages["X"], messages["X"]  # each names the integration that took the argument


def test_replicate_size_auto_is_one_replica_per_node(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _num_nodes(4) == 2
    assert VeScaleConfig(replicate_size="auto").sharding.replicate_for(_num_nodes(4)) == 2
    session = ShardingSession(ShardingConfig(replicate_size="auto"))
    with fake_world(4):
        mesh = session.build_mesh(torch.device("cpu"), 4, num_nodes=2)
        assert (mesh.mesh_dim_names, tuple(mesh.shape)) == (("replicate", "shard"), (2, 2))
        assert session.mesh is mesh
