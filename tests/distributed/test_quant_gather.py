"""Quantized AllGather of trained weights: what is gathered, training against one process, bytes on the wire.

One class of tests on 2 gloo ranks (:class:`tests.dist_pool.DistributedTest`), one test per behaviour: which weights
are quantized (in the test process: no ranks needed); the gathered, dequantized weights are bitwise what one process
reconstructs from the whole weight (fp8 e4m3, 64x64 tiles); straight-through training equals one process with
fake-quantized weights (1e-5); the quantized AllGather sends at most 52% of the bf16 bytes, the ReduceScatter the
same bytes.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from lightning_vescale import MixedPrecisionPolicy, comm_stats, fully_shard
from lightning_vescale.models import Llama, LlamaConfig
from lightning_vescale.quant import BlockFormat, dequantize_block_major, quantize_all_gather, quantize_block_major
from tests.dist_pool import DistributedTest

# Rows not multiples of the block (wk/wv: 32 rows, vocab 96): the last tile row of a matrix holds what remains.
CONFIG = LlamaConfig(vocab_size=96, dim=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=192, max_seq_len=32)
FMT = BlockFormat("fp8_e4m3", 64)
STEPS = 4


def fake_quant(w: torch.Tensor) -> torch.Tensor:
    """What every rank reconstructs from the gathered codes: the whole weight quantized in 64x64 tiles."""
    w = w.detach()
    return dequantize_block_major(*quantize_block_major(w, FMT), w.shape, FMT)


def build() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def shard(model, mp_policy=None, split_embeddings=True):
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy, split_embeddings=split_embeddings)
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, step):
    x, y = batch(step)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def test_matrices_are_quantized_and_1d_tensors_are_not() -> None:
    names = quantize_all_gather(build(), FMT)
    assert "layers.0.attention.wk.weight" in names and "tok_embeddings.weight" in names
    assert "norm.weight" not in names  # 1-D tensors keep their dtype on the wire


def _quantized_sharded() -> tuple[Llama, Llama, list[str]]:
    master = build()
    model = copy.deepcopy(master)
    names = quantize_all_gather(model, FMT)
    return master, shard(model), names


def _gathered_weights_are_the_whole_weight_quantized(rank: int, world: int) -> None:
    """Gathered and dequantized weights: bitwise what one process reconstructs from the whole weight."""
    master, model, _ = _quantized_sharded()
    model.layers[0].unshard()
    for name in ("attention.wq.weight", "attention.wk.weight", "feed_forward.w2.weight"):
        got = model.layers[0].get_parameter(name)
        want = fake_quant(master.layers[0].get_parameter(name))
        assert torch.equal(got, want), name
        assert not torch.equal(got, master.layers[0].get_parameter(name)), "the test must see quantization"
    model.layers[0].reshard()


def _straight_through_training_matches_one_process(rank: int, world: int) -> None:
    """Training: forward and backward at the dequantized weights, the update on the fp32 master (straight-through),
    exactly as one process does it with fake-quantized weights."""
    master, model, names = _quantized_sharded()
    ref = copy.deepcopy(master)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        with torch.no_grad():
            for (name, p), mp in zip(ref.named_parameters(), master.parameters()):
                p.copy_(fake_quant(mp) if name in names else mp)
        ref_loss = loss_of(ref, step)
        ref_loss.backward()
        for p, mp in zip(ref.parameters(), master.parameters()):
            mp.grad, p.grad = p.grad, None
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for (name, p), mp in zip(model.named_parameters(), master.parameters()):
        torch.testing.assert_close(p.full_tensor(), mp.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _bytes(rank: int, world: int) -> None:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    counts = {}
    comm_stats.step()  # count from here: these ranks may have run other tests before
    for quantized in (False, True):
        model = build()
        if quantized:
            quantize_all_gather(model, FMT)
        # The embedding in the root's group, as the head: on this tiny vocabulary (96 rows, 64-row tiles) a group of
        # its own pads its quantized buffer to whole tiles, and the ReduceScatter of master pieces would grow with it.
        shard(model, bf16, split_embeddings=False)
        loss_of(model, 0).backward()
        comm_stats.step()
        sent = {k: v for k, v in comm_stats.last_step_bytes.items() if k.startswith("all_gather")}
        counts[quantized] = sum(sent.values())
        if quantized:
            assert sent["all_gather_quant_codes"] > 0 and sent["all_gather_quant_scales"] > 0
        reduce = comm_stats.last_step_bytes["reduce_scatter"]
        counts[f"rs{quantized}"] = reduce
    assert counts[True] <= 0.52 * counts[False], counts
    assert counts["rsTrue"] == counts["rsFalse"]  # the ReduceScatter is unchanged


class TestQuantizedAllGatherOn2Ranks(DistributedTest):
    world_size = 2

    def test_gathered_weights_are_bitwise_the_whole_weight_quantized(self) -> None:
        self.run_ranks(_gathered_weights_are_the_whole_weight_quantized)

    def test_straight_through_training_matches_one_process(self) -> None:
        self.run_ranks(_straight_through_training_matches_one_process)

    def test_quantized_gather_halves_the_bytes_and_keeps_the_reduce_scatter(self) -> None:
        self.run_ranks(_bytes)
