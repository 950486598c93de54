"""Fabric's and Hugging Face's state idioms under ``strategy="vescale"`` give what Fabric's DDP gives.

Each idiom is one test on 2 gloo ranks (``tests.dist_pool.DistributedTest``): it runs with
``Fabric(strategy=DDPStrategy)`` and with ``Fabric(strategy="vescale")`` on the same seed and data, and each rank
compares the per-step losses (and what the idiom wrote) of the two:

* LitGPT's pre-training order: ``fabric.init_module(empty_init=True)``, ``initialize_weights`` (``reset_parameters``
  set per module, then called), ``wte.weight = lm_head.weight``, then ``fabric.setup``;
* LitGPT's fine-tuning entry: ``fabric.load_raw("lit_model.pth", model)`` of a plain ``torch.save``'d state dict;
* the DDP habit ``fabric.save(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), ...})``,
  then ``fabric.load(path)`` and ``load_state_dict``;
* ``fabric.save`` / ``fabric.load`` of a model with two optimizers;
* ``save_pretrained`` of a sharded Hugging Face model (``lightning_vescale.checkpoint.save_pretrained`` and the
  strategy's method), read back with ``from_pretrained``.
Losses are fp32 and compared to 1e-5 relative (the engines reduce gradients in different orders).
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.lightning import ProcessGroupEnvironment, VeScaleFabricStrategy
from tests.dist_pool import DistributedTest

VOCAB, DIM, SEQ = 37, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class GPT(nn.Module):
    """LitGPT's layout: ``lm_head`` before ``transformer`` (wte, h, ln_f), tied after construction."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), h=nn.ModuleList(Block() for _ in range(2)), ln_f=nn.LayerNorm(DIM)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def initialize_weights(fabric: Fabric, model: nn.Module) -> None:
    """LitGPT's ``initialize_weights``: ``reset_parameters`` replaced per module, then called on every module."""
    def init(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.Linear)):
            mod.reset_parameters = partial(init, mod, std=math.sqrt(2.0 / 5 / DIM))
    for mod in model.modules():
        if isinstance(mod, Block):
            mod.proj.reset_parameters = partial(init, mod.proj, std=1 / math.sqrt(DIM) / 2)
    for mod in model.modules():
        reset = getattr(mod, "reset_parameters", None)
        if callable(reset):
            reset()


def _fabric(engine: str) -> Fabric:
    if engine == "ddp":
        strategy: Any = DDPStrategy(cluster_environment=ProcessGroupEnvironment())
    else:
        strategy = "vescale"
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    # The comparison means something only if the two runs use the two engines.
    if engine == "ddp":
        assert type(fabric.strategy) is DDPStrategy, fabric.strategy
    else:
        assert isinstance(fabric.strategy, VeScaleFabricStrategy), fabric.strategy
    return fabric


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (2 * dist.get_world_size(), SEQ + 1), generator=g)
    mine = tokens[2 * dist.get_rank():2 * dist.get_rank() + 2]
    return mine[:, :-1], mine[:, 1:]


def _train(fabric: Fabric, model: nn.Module, optimizers: list, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        fabric.backward(loss)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def _setup(fabric: Fabric, model: nn.Module, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = fabric.setup(model)
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=lr))


# -- the idioms: each returns {"losses": [...], ...} per engine -----------------------------------------------


def litgpt_pretrain_ties_after_init(engine: str, tmp: str) -> dict:
    fabric = _fabric(engine)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = GPT()
    initialize_weights(fabric, model)
    model.transformer.wte.weight = model.lm_head.weight
    model, opt = _setup(fabric, model)
    return {"losses": _train(fabric, model, [opt], range(3))}


def litgpt_finetune_load_raw(engine: str, tmp: str) -> dict:
    path = os.path.join(tmp, "lit_model.pth")
    if dist.get_rank() == 0 and not os.path.exists(path):
        torch.manual_seed(7)
        torch.save(GPT().state_dict(), path)
    dist.barrier()
    fabric = _fabric(engine)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = GPT()
    model, opt = _setup(fabric, model)
    fabric.load_raw(path, model)
    return {"losses": _train(fabric, model, [opt], range(3))}


def fabric_save_state_dicts_as_under_ddp(engine: str, tmp: str) -> dict:
    fabric = _fabric(engine)
    fabric.seed_everything(0)
    model, opt = _setup(fabric, GPT())
    first = _train(fabric, model, [opt], range(2))
    path = os.path.join(tmp, f"state_dicts_{engine}.pt")
    fabric.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2})
    assert os.path.isfile(path), "state dicts are saved as one file, as under DDP"
    after = _train(fabric, model, [opt], range(2, 4))
    fabric.seed_everything(1)
    model2, opt2 = _setup(fabric, GPT())
    checkpoint = fabric.load(path)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    assert checkpoint["step"] == 2
    again = _train(fabric, model2, [opt2], range(2, 4))
    assert again == after or max(abs(a - b) for a, b in zip(again, after)) < 1e-6, (again, after)
    return {"losses": first + again}


def fabric_save_two_optimizers(engine: str, tmp: str) -> dict:
    fabric = _fabric(engine)
    fabric.seed_everything(0)
    model = fabric.setup(GPT())
    body = [p for n, p in model.named_parameters() if "transformer.h" in n]
    rest = [p for n, p in model.named_parameters() if "transformer.h" not in n]
    opts = fabric.setup_optimizers(torch.optim.AdamW(body, lr=1e-2), torch.optim.SGD(rest, lr=0.1, momentum=0.9))
    first = _train(fabric, model, list(opts), range(2))
    path = os.path.join(tmp, f"two_opts_{engine}")
    fabric.save(path, {"model": model, "body": opts[0], "rest": opts[1], "step": 2})
    after = _train(fabric, model, list(opts), range(2, 4))
    fabric.seed_everything(1)
    model2 = fabric.setup(GPT())
    body2 = [p for n, p in model2.named_parameters() if "transformer.h" in n]
    rest2 = [p for n, p in model2.named_parameters() if "transformer.h" not in n]
    opts2 = fabric.setup_optimizers(torch.optim.AdamW(body2, lr=1e-2), torch.optim.SGD(rest2, lr=0.1, momentum=0.9))
    state = {"model": model2, "body": opts2[0], "rest": opts2[1], "step": 0}
    fabric.load(path, state)
    assert state["step"] == 2
    again = _train(fabric, model2, list(opts2), range(2, 4))
    return {"losses": first + after, "resumed_diff": max(abs(a - b) for a, b in zip(again, after))}


def hugging_face_save_pretrained(engine: str, tmp: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    fabric = _fabric(engine)
    torch.manual_seed(0)
    model = fabric.setup(LlamaForCausalLM(config))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, _ = _batch(0)
    fabric.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    out = os.path.join(tmp, f"hf_{engine}")
    if engine == "ddp":
        if fabric.global_rank == 0:
            model.module.save_pretrained(out)
        fabric.barrier()
    else:
        fabric.strategy.save_pretrained(model, out)
    loaded = LlamaForCausalLM.from_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        architectures = json.load(f)["architectures"]
    logits = loaded(input_ids=_batch(5)[0]).logits
    return {"losses": [logits.double().abs().sum().item()], "architectures": architectures}


IDIOMS: dict[str, Callable[[str, str], dict]] = {f.__name__: f for f in (
    litgpt_pretrain_ties_after_init, litgpt_finetune_load_raw, fabric_save_state_dicts_as_under_ddp,
    fabric_save_two_optimizers, hugging_face_save_pretrained,
)}


def _idiom_matches_ddp(rank: int, world_size: int, idiom: str, tmp: str) -> None:
    ref = IDIOMS[idiom]("ddp", tmp)
    dist.barrier()
    got = IDIOMS[idiom]("vescale", tmp)
    assert len(got["losses"]) == len(ref["losses"]) > 0
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got["losses"], ref["losses"]))
    assert worst <= 1e-5, f"rank {rank}: {idiom} differs from DDP by {worst:.2e}: {got['losses']} vs {ref['losses']}"
    for key in set(ref) - {"losses"}:
        assert got[key] == ref[key] or (key == "resumed_diff" and got[key] < 1e-6), (idiom, key, got[key], ref[key])


class TestFabricIdiomsMatchDDP(DistributedTest):
    world_size = 2
    pg_timeout = 180

    @pytest.mark.parametrize("idiom", list(IDIOMS))
    def test_fabric_idiom_matches_ddp(self, idiom: str, tmp_path) -> None:
        self.run_ranks(_idiom_matches_ddp, idiom, str(tmp_path))
