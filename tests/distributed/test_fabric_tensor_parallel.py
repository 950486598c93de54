"""Fabric with ``VeScaleFabricStrategy(tensor_parallel_size=2, plan="llama")`` on 4 gloo ranks (dp2 x tp2), the
ordinary Fabric loop (``init_module(empty_init=True)``, ``setup``, ``setup_optimizers``, ``setup_dataloaders``,
``backward``, ``clip_gradients``), one test per behaviour (``tests.dist_pool.DistributedTest``, 4 ranks):

* the mesh is Lightning's ``("data_parallel", "tensor_parallel")``, (2, 2);
* the llama plan splits the attention projections columnwise over tp;
* the ranks of one tp group read the same batches, the two dp groups different ones;
* training equals one process on the whole batch (losses per step and the final weights, fp32, 1e-5: reductions
  run in other orders).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.distributed.tensor import Shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_vescale.lightning import VeScaleFabricStrategy
from lightning_vescale.models.llama import Llama, LlamaConfig
from tests.dist_pool import DistributedTest

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
PER_DP_RANK, STEPS, CLIP = 2, 3, 1.0


def _data() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (PER_DP_RANK * 2 * STEPS, 9), generator=torch.Generator().manual_seed(3))


def _fabric(world: int) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=VeScaleFabricStrategy(tensor_parallel_size=2, plan="llama"))
    fabric.launch()
    return fabric


def _setup_model(fabric: Fabric):
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = Llama(CONFIG)
    return fabric.setup(model)


def _gather(batch: torch.Tensor, world: int) -> list[torch.Tensor]:
    gathered = [torch.empty_like(batch) for _ in range(world)]
    dist.all_gather(gathered, batch)
    return gathered


def _mesh_is_lightnings(rank: int, world: int) -> None:
    mesh = _fabric(world).strategy.device_mesh
    assert mesh.mesh_dim_names == ("data_parallel", "tensor_parallel") and mesh.shape == (2, 2)


def _plan_splits_attention(rank: int, world: int) -> None:
    model = _setup_model(_fabric(world))
    assert model.layers[0].attention.wq.weight.placements[1] == Shard(0)


def _tp_ranks_read_the_same_batches(rank: int, world: int) -> None:
    fabric = _fabric(world)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(_data()), batch_size=PER_DP_RANK))
    steps = 0
    for (batch,) in loader:
        gathered = _gather(batch, world)
        assert torch.equal(gathered[0], gathered[1]) and torch.equal(gathered[2], gathered[3]), "tp ranks differ"
        assert not torch.equal(gathered[0], gathered[2]), "the dp ranks must read different batches"
        steps += 1
    assert steps == STEPS


def _trains_like_one_process(rank: int, world: int) -> None:
    fabric = _fabric(world)
    model = _setup_model(fabric)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(_data()), batch_size=PER_DP_RANK))

    torch.manual_seed(0)
    ref = Llama(CONFIG)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    seen = []
    for step, (batch,) in enumerate(loader):
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=CLIP)
        opt.step()
        opt.zero_grad()
        seen.append(batch)
        # The reference takes the batches both dp ranks drew this step, from the sampler's own order.
        gathered = _gather(batch, world)
        assert torch.equal(gathered[0], gathered[1]) and torch.equal(gathered[2], gathered[3]), "tp ranks differ"
        whole = torch.cat([gathered[0], gathered[2]])
        ref_loss = F.cross_entropy(ref(whole[:, :-1]).flatten(0, 1), whole[:, 1:].flatten())
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        mean = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
        assert abs(mean - ref_loss.item()) <= 1e-5, (step, mean, ref_loss.item())
    assert len(seen) == STEPS
    full = {n: p.full_tensor() for n, p in model.module.named_parameters()}
    worst = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    assert worst <= 1e-5, f"Fabric dp2 x tp2 differs from one process by {worst}"


class TestFabricTensorParallel(DistributedTest):
    """dp2 x tp2 on 4 ranks."""

    world_size = 4

    def test_mesh_is_lightnings_data_by_tensor_parallel(self) -> None:
        self.run_ranks(_mesh_is_lightnings)

    def test_llama_plan_splits_attention_columnwise(self) -> None:
        self.run_ranks(_plan_splits_attention)

    def test_tp_ranks_read_the_same_batches_dp_ranks_different(self) -> None:
        self.run_ranks(_tp_ranks_read_the_same_batches)

    def test_trains_like_one_process_on_the_whole_batch(self) -> None:
        self.run_ranks(_trains_like_one_process)
