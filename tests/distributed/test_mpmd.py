"""MPMD on gloo ranks: sub-models on disjoint groups of ranks, pipelined, equal single-process training.

One class of tests per world size (:class:`tests.dist_pool.DistributedTest`: the ranks are shared), one test per
behaviour; the tests that need a trained model train it again (``_trained_vlm_gpipe``):

* 3 ranks: the VLM with its encoder and projector on 1 rank and the decoder sharded over 2 (a team of 2 behind
  one pipeline), GPipe: losses and parameters equal one process training the whole model (fp32, 1e-5),
  with clipping by the global norm; one ReduceScatter and one AllGather per buffer and step (the dry run's bytes,
  exact); a wrong micro-batch gradient scale is detected (negative control); the checkpoint of all stages reloads
  into a plain sharded model and back, and into another grouping, bitwise, and resumes training (1e-5).
* 4 ranks: the VLM with 1 + 3 ranks under 1F1B (and its forward-only evaluation; a batch the team of 3 cannot split
  is refused); bf16 stages pass fp32 activations (bf16 tolerances); and a Llama split in two stages of 2 ranks (two
  pipelines side by side) under 1F1B.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.engine.fully_shard import sharded_groups
from lightning_vescale.models.llama import Llama, LlamaConfig
from lightning_vescale.models.vlm import VLM, synthetic_vlm_batch, vlm_config
from lightning_vescale.parallel.parallelize import resolve_for
from lightning_vescale.pipeline import (
    MPMDModel,
    _runtime,
    lm_loss,
    load_full_into,
    load_mpmd,
    read_mpmd_full_state_dict,
    save_mpmd,
)
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import load_profile
from tests.dist_pool import DistributedTest
from tests.dist_utils import max_piece_diff

BATCH, SEQ, LR, CLIP = 8, 6, 1e-2, 0.05
# Adam divides by sqrt(v): with its default eps a gradient element near 0 turns round-off (the order of a sum
# over ranks) into a full-size update. A larger eps keeps the comparison about the gradients.
EPS = 1e-5
BLOCKS = {"rules": [{"match": "**.layers.*", "group": True}]}


def vlm_plan(encoder_ranks: int, decoder_ranks: int, schedule: str, microbatches: int = 2) -> dict:
    return {"name": "vlm", "schedule": schedule, "microbatches": microbatches, "stages": [
        {"name": "vision", "modules": ["encoder", "projector"], "ranks": encoder_ranks,
         "plan": {"rules": [{"match": "encoder.blocks.*", "group": True}]}},
        {"name": "language", "modules": ["decoder"], "ranks": decoder_ranks, "plan": "llama"},
    ]}


def train(model: nn.Module, steps: int, step_fn) -> tuple[list[float], torch.optim.Optimizer]:
    """AdamW steps clipped at CLIP; returns the losses and the gradient norms before clipping, and the optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        loss = step_fn(model, step)
        if isinstance(model, MPMDModel):
            norm = model.clip_grad_norm_(CLIP)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append((float(loss), float(norm)))
    return losses, opt


def assert_same_run(losses: list, ref_losses: list) -> None:
    """Same losses (1e-5) and the same global gradient norms (relative 1e-5; above CLIP, so clipping acted) as
    the reference."""
    assert all(norm > CLIP for _, norm in ref_losses), ref_losses
    assert max(abs(a[0] - b[0]) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert max(abs(a[1] - b[1]) / b[1] for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)


def vlm_step(config, batch: int = BATCH):
    def step_fn(model, step):
        images, tokens, target = synthetic_vlm_batch(config, batch, SEQ, step)
        if isinstance(model, MPMDModel):
            return model.step(images, tokens, target=target)
        loss = lm_loss(model(images, tokens), target)
        loss.backward()
        return loss.detach()
    return step_fn



def _trained_vlm_gpipe(rank: int, with_reference: bool = True):
    """The VLM (1 + 2 ranks, GPipe) and, with ``with_reference``, one process on the whole model, 3 steps each."""
    config = vlm_config("tiny")
    ref = ref_losses = ref_opt = None
    if with_reference:
        torch.manual_seed(0)
        ref = VLM(config)
        ref_losses, ref_opt = train(ref, 3, vlm_step(config))
    torch.manual_seed(0)
    images, tokens, _ = synthetic_vlm_batch(config, BATCH, SEQ, 0)
    mpmd = lv.parallelize(VLM(config), vlm_plan(1, 2, "gpipe"), example_inputs=(images, tokens))
    losses, opt = train(mpmd, 3, vlm_step(config))
    return config, ref, ref_losses, ref_opt, mpmd, losses, opt


def _vlm_gpipe_trains_like_one_process(rank: int, world: int) -> None:
    config, ref, ref_losses, _, mpmd, losses, _ = _trained_vlm_gpipe(rank)
    assert isinstance(mpmd, MPMDModel)
    assert set(n.split(".")[0] for n, _ in mpmd.named_parameters()) == ({"encoder", "projector"} if rank == 0
                                                                          else {"decoder"})
    assert mpmd.mesh.size() == (1 if rank == 0 else 2)
    assert_same_run(losses, ref_losses)
    d = max_piece_diff(mpmd, ref)
    assert d < 1e-5, d


def _bytes_per_step(rank: int, world: int) -> None:
    """One ReduceScatter per group and step, whatever the number of micro-batches (gradients accumulate unsharded):
    the dry run's bytes of one step; and one AllGather per buffer and step."""
    config, _, _, _, mpmd, _, opt = _trained_vlm_gpipe(rank, with_reference=False)
    lv.comm_stats.step()
    vlm_step(config)(mpmd, 9)
    sent = lv.comm_stats.step()
    opt.zero_grad()
    with torch.device("meta"):
        meta = VLM(config)
    stage = nn.Module()
    for name in mpmd.spec.modules:
        stage.add_module(name, getattr(meta, name))
    predicted = dry_run(stage, resolve_for(stage, mpmd.spec.plan), mpmd.mesh.size(), activations={},
                        hardware=load_profile("cpu"), workload=Workload(precision="32-true", clip_grad=False)).vescale
    assert sent.get("reduce_scatter", 0) == predicted.collectives["reduce_scatter"], (sent, predicted.collectives)
    assert (sent.get("reduce_scatter", 0) > 0) == (rank > 0)
    # And one AllGather per buffer and step (gather_once): the parameters gathered for the first micro-batch serve
    # every micro-batch's forward and backward (per micro-batch it would be 3x these bytes or more).
    once = sum((b.world_size - 1) * b.shard_size * b.unsharded.element_size()
               for g in sharded_groups(mpmd) for b in g.buffers.values())
    assert sent.get("all_gather", 0) == once, (sent, once)
    assert (once > 0) == (rank > 0)


def _checkpoint_round_trips_through_plain_sharding(rank: int, world: int, tmp: str) -> None:
    """Checkpoint of all stages -> plain sharding over every rank -> MPMD again, bitwise."""
    config, ref, _, _, mpmd, _, opt = _trained_vlm_gpipe(rank)
    save_mpmd(f"{tmp}/mpmd", mpmd, opt)
    full = read_mpmd_full_state_dict(f"{tmp}/mpmd")
    assert set(full) == set(ref.state_dict()), set(full) ^ set(ref.state_dict())
    plain = lv.parallelize(VLM(config), None, init_device_mesh("cpu", (world,)))
    ckpt.load_full_state_dict(plain, full)
    assert max_piece_diff(plain, ref) < 1e-5
    ckpt.save(f"{tmp}/plain", plain)
    torch.manual_seed(1)
    again = lv.parallelize(VLM(config), vlm_plan(1, 2, "gpipe"))
    full_plain = {k.removeprefix("model."): v for k, v in ckpt.read_full_tensors(f"{tmp}/plain").items()}
    load_full_into(again, full_plain)
    for name, p in again.named_parameters():
        assert torch.equal(p.full_tensor(), full[name]), name


def _checkpoint_loads_into_another_grouping(rank: int, world: int, tmp: str) -> None:
    """Into another grouping: the projector moves to the decoder's ranks, bitwise."""
    config, _, _, _, mpmd, _, opt = _trained_vlm_gpipe(rank, with_reference=False)
    save_mpmd(f"{tmp}/mpmd", mpmd, opt)
    full = read_mpmd_full_state_dict(f"{tmp}/mpmd")
    regrouped_plan = {"schedule": "gpipe", "microbatches": 2, "stages": [
        {"name": "vision", "modules": ["encoder"], "ranks": 1},
        {"name": "language", "modules": ["projector", "decoder"], "ranks": 2}]}
    regrouped = lv.parallelize(VLM(config), regrouped_plan)
    load_full_into(regrouped, full)
    for name, p in regrouped.named_parameters():
        assert torch.equal(p.full_tensor(), full[name]), name


def _sharded_checkpoint_resumes_training(rank: int, world: int, tmp: str) -> None:
    """The sharded MPMD checkpoint resumes training exactly (optimizer states included)."""
    config, ref, _, ref_opt, mpmd, _, opt = _trained_vlm_gpipe(rank)
    save_mpmd(f"{tmp}/mpmd", mpmd, opt)
    torch.manual_seed(1)
    again = lv.parallelize(VLM(config), vlm_plan(1, 2, "gpipe"))
    again_opt = torch.optim.AdamW(again.parameters(), lr=LR, eps=EPS)
    load_mpmd(f"{tmp}/mpmd", again, again_opt)
    assert max_piece_diff(again, ref) < 1e-5
    for net, optimizer in ((again, again_opt), (ref, ref_opt)):
        vlm_step(config)(net, 3)
        if net is again:
            again.clip_grad_norm_(CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        optimizer.step()
    assert max_piece_diff(again, ref) < 1e-5


def _micro_batch_gradient_scale(rank: int, world: int, scale_right: bool) -> None:
    """Without the division by the number of micro-batches the gradients are twice too large, which the parameters
    show after one unclipped SGD step (negative control); with it they equal one process's."""
    config = vlm_config("tiny")
    original = _runtime._gradient_divide_factor
    if not scale_right:
        _runtime._gradient_divide_factor = lambda pipelines, microbatches: float(pipelines)
    try:
        torch.manual_seed(0)
        ref2 = VLM(config)
        torch.manual_seed(0)
        m = lv.parallelize(VLM(config), vlm_plan(1, 2, "gpipe"))
    finally:
        _runtime._gradient_divide_factor = original
    for net in (m, ref2):
        vlm_step(config)(net, 0)
        with torch.no_grad():
            for p in net.parameters():
                p.sub_(p.grad)
    assert (max_piece_diff(m, ref2) < 1e-5) == scale_right, scale_right


class TestMPMDOn3Ranks(DistributedTest):
    """The VLM's encoder and projector on rank 0, its decoder sharded over ranks 1 and 2, GPipe."""

    world_size = 3

    def test_vlm_gpipe_trains_like_one_process_with_global_norm_clipping(self) -> None:
        self.run_ranks(_vlm_gpipe_trains_like_one_process)

    def test_one_reduce_scatter_and_all_gather_per_step_as_the_dry_run_says(self) -> None:
        self.run_ranks(_bytes_per_step)

    def test_checkpoint_round_trips_through_plain_sharding_bitwise(self, tmp_path) -> None:
        self.run_ranks(_checkpoint_round_trips_through_plain_sharding, str(tmp_path))

    def test_checkpoint_loads_into_another_grouping_bitwise(self, tmp_path) -> None:
        self.run_ranks(_checkpoint_loads_into_another_grouping, str(tmp_path))

    def test_sharded_checkpoint_resumes_training_exactly(self, tmp_path) -> None:
        self.run_ranks(_sharded_checkpoint_resumes_training, str(tmp_path))

    @pytest.mark.parametrize("scale_right", [True, False], ids=["divided-by-microbatches", "not-divided-is-detected"])
    def test_micro_batch_gradient_scale(self, scale_right: bool) -> None:
        self.run_ranks(_micro_batch_gradient_scale, scale_right)


class LlamaFront(nn.Module):
    """Embedding and the first blocks of a Llama (a pipeline stage that is plain PyTorch)."""

    def __init__(self, llama: Llama, n: int) -> None:
        super().__init__()
        self.tok_embeddings, self.rope, self.layers = llama.tok_embeddings, llama.rope, nn.ModuleList(llama.layers[:n])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h


class LlamaBack(nn.Module):
    """The remaining blocks, the final norm and the head."""

    def __init__(self, llama: Llama, n: int) -> None:
        super().__init__()
        self.rope, self.layers = copy.deepcopy(llama.rope), nn.ModuleList(llama.layers[n:])
        self.norm, self.output = llama.norm, llama.output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(h.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class SplitLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        llama = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                  max_seq_len=32))
        self.front, self.back = LlamaFront(llama, 2), LlamaBack(llama, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(tokens))


def llama_step(model, step):
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    if isinstance(model, MPMDModel):
        return model.step(tokens[:, :-1], target=tokens[:, 1:])
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach()


def _vlm_1f1b(rank: int, world: int) -> None:
    """The VLM on 1 + 3 ranks under 1F1B (a team of 3 behind one pipeline): trains like one process, and evaluates
    (forward only) the trained model like it."""
    config = vlm_config("tiny")
    torch.manual_seed(0)
    ref = VLM(config)
    step_fn = vlm_step(config, batch=12)
    ref_losses, _ = train(ref, 3, step_fn)
    torch.manual_seed(0)
    mpmd = lv.parallelize(VLM(config), vlm_plan(1, 3, "1f1b"))
    losses, _ = train(mpmd, 3, step_fn)
    assert_same_run(losses, ref_losses)
    d = max_piece_diff(mpmd, ref)
    assert d < 1e-5, d
    images, tokens, target = synthetic_vlm_batch(config, 12, SEQ, 7)
    with torch.no_grad():
        expected = lm_loss(ref(images, tokens), target)
    assert abs(float(mpmd.evaluate(images, tokens, target=target)) - float(expected)) < 1e-5  # forward only
    assert all(p.grad is None for p in mpmd.parameters())


def _batch_not_divisible_by_the_team(rank: int, world: int) -> None:
    config = vlm_config("tiny")
    torch.manual_seed(0)
    mpmd = lv.parallelize(VLM(config), vlm_plan(1, 3, "1f1b"))
    images, tokens, target = synthetic_vlm_batch(config, 8, SEQ, 0)
    with pytest.raises(ValueError, match="use a multiple of 6"):
        mpmd.step(images, tokens, target=target)  # 8 = 2 micro-batches of 4, not divisible by the team of 3


def _stage_precision(rank: int, world: int) -> None:
    """A stage's own precision: both stages compute in bf16, activations still cross stages in fp32 (the receive
    buffers are laid out from the model)."""
    config = vlm_config("tiny")
    images, tokens, target = synthetic_vlm_batch(config, 12, SEQ, 7)
    bf16 = vlm_plan(1, 3, "1f1b")
    bf16["stages"][0]["plan"] = {"fallback": {"param_dtype": "bf16"}, "rules": [
        {"match": "encoder.blocks.*", "group": True}]}
    bf16["stages"][1]["plan"] = {"fallback": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
                                 "rules": [{"match": "decoder.layers.*", "group": True}]}
    torch.manual_seed(0)
    fresh_ref = VLM(config)
    torch.manual_seed(0)
    mixed = lv.parallelize(VLM(config), bf16)
    received = []
    if rank > 0:  # the decoder's team: member k gets samples 2k, 2k+1 of the first micro-batch (6 samples)
        mixed.decoder.register_forward_pre_hook(lambda m, args: received.append(args[0].detach().clone()))
    loss = float(mixed.step(images, tokens, target=target))
    with torch.no_grad():
        expected = float(lm_loss(fresh_ref(images, tokens), target))
        embeds = fresh_ref.projector(fresh_ref.encoder(images))
    assert abs(loss - expected) < 1e-3 * expected and loss != expected, (loss, expected)  # bf16 noise, no more
    if rank > 0:
        k = rank - 1
        want = embeds[2 * k:2 * k + 2]
        assert (received[0].float() - want).abs().max() < 3e-2 * want.abs().max(), "activations lost in transit"


def _two_stage_llama(rank: int, world: int) -> None:
    """A Llama in two stages of 2 ranks: two pipelines side by side, each stage sharded over its 2 ranks."""
    torch.manual_seed(0)
    ref = SplitLlama()
    ref_losses, _ = train(ref, 3, llama_step)
    torch.manual_seed(0)
    plan = {"schedule": "1f1b", "microbatches": 2, "stages": [
        {"name": "front", "modules": ["front"], "ranks": 2, "plan": BLOCKS},
        {"name": "back", "modules": ["back"], "ranks": 2, "plan": BLOCKS}]}
    mpmd = lv.parallelize(SplitLlama(), plan)
    assert mpmd._rt.num_pipelines == 2 and mpmd._rt.team is None
    losses, _ = train(mpmd, 3, llama_step)
    assert_same_run(losses, ref_losses)
    d = max_piece_diff(mpmd, ref)
    assert d < 1e-5, d


class TestMPMDOn4Ranks(DistributedTest):
    world_size = 4

    def test_vlm_1f1b_on_1_plus_3_ranks_trains_and_evaluates_like_one_process(self) -> None:
        self.run_ranks(_vlm_1f1b)

    def test_a_batch_the_team_cannot_split_is_refused(self) -> None:
        self.run_ranks(_batch_not_divisible_by_the_team)

    def test_bf16_stages_pass_fp32_activations(self) -> None:
        self.run_ranks(_stage_precision)

    def test_llama_in_two_stages_of_two_ranks_trains_like_one_process(self) -> None:
        self.run_ranks(_two_stage_llama)
