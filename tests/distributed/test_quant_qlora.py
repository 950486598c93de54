"""QLoRA-style fine-tuning on a block-quantized frozen base, sharded on gloo ranks, against one process.

One test per behaviour; 2 and 3 ranks, each started once for the module (:class:`tests.dist_pool.ModuleRanksTest`)
and shared by the class of its world size and by the fixture whose checkpoint the 3 ranks reload:

* the frozen base is sharded codes + scales, bitwise the one-process quantization (and its gathered
  dequantization), in about half the bytes of bf16 sharding; fine-tuning gives the one-process losses and adapters
  (1e-5); a checkpoint stores codes + scales and reloads bitwise on 3 ranks (fp8_e4m3 and int8 tiles);
* a frozen parameter backward still needs stays gathered (gradients to torch's default tolerance);
* QLoRA from an fp8 checkpoint keeps its codes (bitwise) and trains like one process (1e-5), and the adapters it
  exports equal one process's (1e-5);
* quantized 3-D expert stacks train like one process (1e-5); unfreezing a quantized weight is refused by name.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_vescale import checkpoint, fully_shard
from lightning_vescale.models import Llama, LlamaConfig
from lightning_vescale.quant import BlockFormat, QuantizedTensor, quantize_frozen_weights
from lightning_vescale.quant.lora import LoRAConfig, apply_lora
from tests.dist_pool import DistributedPools, ModuleRanksTest

CONFIG = LlamaConfig(vocab_size=128, dim=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=176, max_seq_len=32)
LORA = LoRAConfig(rank=4, alpha=8.0)
STEPS = 3


def build(fmt: BlockFormat, *, meta: bool = False) -> Llama:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = Llama(CONFIG)
    apply_lora(model, LORA)
    quantize_frozen_weights(model, fmt, exclude=("tok_embeddings.*", "output.*"))
    if not meta:
        torch.manual_seed(1)  # non-zero B so the adapters matter from the first step
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                torch.nn.init.normal_(p, std=0.02)
    return model


def shard(model: Llama) -> Llama:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, steps: int = STEPS) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _frozen_base_is_codes(rank: int, world: int, fmt_kind: str) -> None:
    fmt = BlockFormat(fmt_kind, 32)
    ref = build(fmt)
    model = shard(copy.deepcopy(ref))
    # The frozen base is codes + scales: every quantized weight is a sharded QuantizedTensor, bitwise the
    # reference's tiles (quantizing a rank's tiles = quantizing the whole weight), and nothing else is stored.
    wq = model.layers[0].attention.wq.base_layer.weight
    assert isinstance(wq, QuantizedTensor) and wq.is_sharded and not wq.requires_grad
    ref_wq = ref.layers[0].attention.wq.base_layer.weight
    assert torch.equal(wq.codes.full_tensor().view(torch.uint8), ref_wq.codes.view(torch.uint8))
    assert torch.equal(wq.scale_inv.full_tensor(), ref_wq.scale_inv)
    # Gathered and dequantized = single-process dequantization, bitwise.
    model.layers[0].unshard()
    assert torch.equal(model.layers[0].attention.wq.base_layer.weight, ref_wq.dequantize())
    model.layers[0].reshard()


def _finetuning_equals_one_process(rank: int, world: int, fmt_kind: str) -> None:
    """Fine-tuning: the same losses and adapters as the one-process run (1e-5)."""
    fmt = BlockFormat(fmt_kind, 32)
    ref = build(fmt)
    model = shard(copy.deepcopy(ref))
    ref_losses = train(ref)
    losses = train(model)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert any(p.requires_grad for p in model.parameters())


def _train_and_save(rank: int, world: int, tmp: str, fmt_kind: str) -> None:
    """A checkpoint of the fine-tuned model writes each quantized weight as codes + scales (RaggedTensors: every
    rank its tiles); rank 0 keeps the trained plain parameters and the reference's codes to compare a reload with."""
    fmt = BlockFormat(fmt_kind, 32)
    ref = build(fmt)
    model = shard(copy.deepcopy(ref))
    train(model)
    sd = checkpoint.get_model_state_dict(model)
    assert sd["layers.0.attention.wq.base_layer.weight"].dtype == fmt.code_dtype
    assert sd["layers.0.attention.wq.base_layer.weight_scale_inv"].dtype == torch.float32
    checkpoint.save(os.path.join(tmp, fmt_kind), model)
    trained = {n: p.full_tensor() for n, p in model.named_parameters() if not isinstance(p, QuantizedTensor)}
    if rank == 0:
        torch.save(trained, os.path.join(tmp, "plain.pt"))
        torch.save({n: torch.cat([p.codes.reshape(-1).view(torch.uint8), p.scale_inv.reshape(-1).view(torch.uint8)])
                    for n, p in ref.named_parameters() if isinstance(p, QuantizedTensor)}, os.path.join(tmp, "codes.pt"))


def _frozen_base_memory(rank: int, world: int, fmt_kind: str) -> None:
    """Memory: the frozen base per rank vs bf16 sharding of the same weights."""
    from lightning_vescale.engine.fully_shard import sharded_groups
    from lightning_vescale.quant._storage import QuantizedStorage

    model = shard(build(BlockFormat(fmt_kind, 32)))
    stored = sum(b.local_nbytes() for g in sharded_groups(model) for b in g.buffers.values()
                 if isinstance(b, QuantizedStorage))
    numel = sum(p.numel() for p in model.parameters() if isinstance(p, QuantizedTensor))
    total = torch.tensor([stored], dtype=torch.int64)
    dist.all_reduce(total)
    assert total.item() / world <= 0.55 * 2 * numel / world, (total.item() / world, 2 * numel / world)


def _reload(rank: int, world: int, tmp: str, fmt_kind: str) -> None:
    fmt = BlockFormat(fmt_kind, 32)
    model = shard(build(fmt, meta=True))
    from lightning_vescale import init_sharded_weights

    init_sharded_weights(model)
    checkpoint.load(os.path.join(tmp, fmt_kind), model)
    plain = torch.load(os.path.join(tmp, "plain.pt"), weights_only=True)
    codes = torch.load(os.path.join(tmp, "codes.pt"), weights_only=True)
    for name, p in model.named_parameters():
        if isinstance(p, QuantizedTensor):
            got = torch.cat([p.codes.full_tensor().reshape(-1).view(torch.uint8),
                             p.scale_inv.full_tensor().reshape(-1).view(torch.uint8)])
            assert torch.equal(got, codes[name]), name  # bitwise, on another world size
        else:
            assert torch.equal(p.full_tensor(), plain[name]), name  # trained adapters and the frozen rest



class _NormThenLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def _frozen_before_trainable(rank: int, world: int) -> None:
    # A frozen parameter that backward needs after the group's last trainable gradient arrived (the norm weight
    # is used to compute the input gradient, after proj's weight gradient): it must still be gathered then.
    torch.manual_seed(0)
    ref = torch.nn.Sequential(_NormThenLinear(), _NormThenLinear())
    for block in ref:
        torch.nn.init.normal_(block.norm.weight)
        block.norm.weight.requires_grad_(False)
    model = copy.deepcopy(ref)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    model(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(model[1].proj.weight.grad.full_tensor(), ref[1].proj.weight.grad)


def _lora_values(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=g) * 0.05 for n, p in model.named_parameters() if "lora_" in n}


def _qlora_from_fp8(rank: int, world: int, path: str, tmp: str) -> None:
    from lightning_vescale import init_sharded_weights
    from lightning_vescale.checkpoint import load_full_state_dict
    from lightning_vescale.models import from_pretrained
    from lightning_vescale.quant.lora import load_base_state_dict
    from lightning_vescale.quant.peft import save_peft_adapter
    from lightning_vescale.quant.tensor import rowmajor_codes, weights_state_dict

    fmt = BlockFormat("fp8_e4m3", 32)
    hf_model, config = from_pretrained(path, quantized_weights="keep")
    state = weights_state_dict(hf_model)
    assert isinstance(state["layers.0.attention.wq.weight"], QuantizedTensor)
    # The one-process reference: the checkpoint's model with adapters.
    ref = hf_model
    apply_lora(ref, LORA)
    load_full_state_dict(ref, _lora_values(ref), strict=False)
    # The sharded run: built on meta, base quantized in storage, filled from the checkpoint's codes.
    model = shard(build(fmt, meta=True))
    init_sharded_weights(model)
    load_base_state_dict(model, state)
    load_full_state_dict(model, _lora_values(model), strict=False)
    stored = hf_model.layers[1].feed_forward.w2.base_layer.weight
    got = model.layers[1].feed_forward.w2.base_layer.weight
    assert torch.equal(got.codes.full_tensor().view(torch.uint8), stored.codes.view(torch.uint8))  # no re-quantizing
    assert torch.equal(got.scale_inv.full_tensor(), rowmajor_codes(stored)[1])
    torch.testing.assert_close(torch.tensor(train(model)), torch.tensor(train(ref)), rtol=1e-5, atol=1e-5)
    # Adapters exported from the sharded run = from the one-process run.
    save_peft_adapter(model, config, os.path.join(tmp, "sharded"), write=rank == 0)
    if rank == 0:
        save_peft_adapter(ref, config, os.path.join(tmp, "single"))
        from safetensors.torch import load_file

        a = load_file(os.path.join(tmp, "sharded", "adapter_model.safetensors"))
        b = load_file(os.path.join(tmp, "single", "adapter_model.safetensors"))
        assert a.keys() == b.keys() and len(a) == 2 * 7 * CONFIG.n_layers  # A and B of 7 Linears per layer
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def _quantized_moe():
    """Expert stacks (3-D) stored as codes + scales per expert matrix, MLA attention with adapters."""
    from lightning_vescale.models import DeepSeekV3, deepseek_v3_config

    torch.manual_seed(0)
    ref = DeepSeekV3(deepseek_v3_config("tiny"))
    apply_lora(ref, LoRAConfig(rank=4, alpha=8.0, targets=("*attention.wq_b", "*attention.wo")))
    names = quantize_frozen_weights(ref, BlockFormat("int8", 32), exclude=("tok_embeddings.*", "output.*",
                                                                          "*.router.*"))
    assert "layers.1.feed_forward.experts.w1_EDF" in names
    for name, p in ref.named_parameters():
        if name.endswith("lora_B.weight"):
            torch.nn.init.normal_(p, std=0.02)
    model = shard(copy.deepcopy(ref))
    stack = model.layers[1].feed_forward.experts.w1_EDF
    assert isinstance(stack, QuantizedTensor) and stack.is_sharded and stack.dim() == 3
    return ref, model, stack


def _moe_qlora(rank: int, world: int) -> None:
    ref, model, _ = _quantized_moe()
    torch.testing.assert_close(torch.tensor(train(model)), torch.tensor(train(ref)), rtol=1e-5, atol=1e-5)


def _unfreezing_refused(rank: int, world: int) -> None:
    """Codes cannot train: unfreezing a quantized weight is refused by name at the next forward."""
    _, model, stack = _quantized_moe()
    stack.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"block-quantized frozen weight .* was set to requires_grad=True"):
        model(batch(0)[0])


# --------------------------------------------------------------------------------------------------------
# The module's ranks: the 2 that save the fine-tuned checkpoints are those of the 2-rank tests.




@pytest.fixture(scope="module")
def saved(ranks: DistributedPools, tmp_path_factory):
    """``saved(fmt_kind)``: the directory of the 2-rank fine-tuned checkpoint in that format (saved once)."""
    done: dict[str, str] = {}

    def get(fmt_kind: str) -> str:
        if fmt_kind not in done:
            tmp = str(tmp_path_factory.mktemp(f"qlora_{fmt_kind}"))
            ranks(2).run(_train_and_save, tmp, fmt_kind)
            done[fmt_kind] = tmp
        return done[fmt_kind]

    return get




FORMATS = ["fp8_e4m3", "int8"]


class TestQLoRAOn2Ranks(ModuleRanksTest):
    world_size = 2

    @pytest.mark.parametrize("fmt_kind", FORMATS)
    def test_frozen_base_is_sharded_codes_bitwise_one_process(self, fmt_kind: str) -> None:
        self.run_ranks(_frozen_base_is_codes, fmt_kind)

    @pytest.mark.parametrize("fmt_kind", FORMATS)
    def test_finetuning_equals_one_process(self, fmt_kind: str) -> None:
        self.run_ranks(_finetuning_equals_one_process, fmt_kind)

    @pytest.mark.parametrize("fmt_kind", FORMATS)
    def test_checkpoint_writes_codes_and_scales(self, saved, fmt_kind: str) -> None:
        tmp = saved(fmt_kind)  # the ranks check the state dict's dtypes, then save
        assert os.path.isfile(os.path.join(tmp, fmt_kind, ".metadata"))

    @pytest.mark.parametrize("fmt_kind", FORMATS)
    def test_frozen_base_takes_about_half_the_bytes_of_bf16(self, fmt_kind: str) -> None:
        self.run_ranks(_frozen_base_memory, fmt_kind)

    def test_frozen_parameters_stay_gathered_until_backward_used_them(self) -> None:
        self.run_ranks(_frozen_before_trainable)

    def test_qlora_from_an_fp8_checkpoint_keeps_its_codes(self, tmp_path) -> None:
        from tests.unit.test_quant_hf_import import _write_fp8

        torch.manual_seed(0)
        _write_fp8(Llama(CONFIG), CONFIG, tmp_path / "hf")
        self.run_ranks(_qlora_from_fp8, str(tmp_path / "hf"), str(tmp_path))

    def test_qlora_over_quantized_expert_stacks(self) -> None:
        self.run_ranks(_moe_qlora)

    def test_unfreezing_a_quantized_weight_is_refused(self) -> None:
        self.run_ranks(_unfreezing_refused)


class TestQLoRAOn3Ranks(ModuleRanksTest):
    world_size = 3

    @pytest.mark.parametrize("fmt_kind", FORMATS)
    def test_checkpoint_reloads_bitwise_on_another_world_size(self, saved, fmt_kind: str) -> None:
        self.run_ranks(_reload, saved(fmt_kind), fmt_kind)
