"""Quantized AllGather of trained weights on DeepSeek's tiles: every 128x128 tile whole on one rank, the last tile
row and column of a matrix holding what remains, so the gathered weights are bitwise a quantize-dequantize of the
whole fp32 master on any world size; and the bytes actually handed to the AllGathers.

One class of tests per world size (1, 2, 3 ranks), each started once for the module and shared with the fixture
that saves the tile-major checkpoint the 3 ranks reload; one test per behaviour and case:

* gathered weights are bitwise the whole matrix's tiles, per layout, format and parameter dtype (1-3 ranks);
* the bytes handed to the AllGathers are what comm_stats counts, and cost what the plan says against bf16 (2, 3);
* the tile-major master trains as the row-band one (losses 1e-6, parameters 1e-6, gradients 1e-5; 2 ranks), and its
  checkpoint reloads bitwise on 3 ranks and, read whole, into an unsharded model in one process;
* Muon refuses a tile-major master by name; torch's state-dict helpers read and load the row-major weight (1, 3).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_vescale import MixedPrecisionPolicy, comm_stats, fully_shard
from lightning_vescale.engine import collectives
from lightning_vescale.engine.fully_shard import sharded_groups
from lightning_vescale.quant import BlockFormat, dequantize_block_major, quantize_all_gather, quantize_block_major
from lightning_vescale.quant.blocks import tile_boxes
from lightning_vescale.quant.formats import dequantize_tiles, quantize_tiles
from tests.dist_pool import DistributedPools, ModuleRanksTest

SHAPES = {"a": (300, 256), "b": (200, 384), "c": (257, 130), "d": (128, 128)}
STACK = (3, 200, 130)  # an expert stack: each expert's last tile row holds 72 rows
STACK2 = (2, 192, 320)  # tile-major: the experts' 64-row and 64-column edge tiles pair up into whole granules
FORMATS = (BlockFormat("fp8_e4m3", 128), BlockFormat("int8", 128))


class Tiles(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.ModuleDict({k: nn.Linear(cols, rows, bias=k == "c") for k, (rows, cols) in SHAPES.items()})
        self.stack = nn.Parameter(torch.randn(STACK) * 0.02)
        self.stack2 = nn.Parameter(torch.randn(STACK2) * 0.02)


def build() -> Tiles:
    torch.manual_seed(0)
    return Tiles()


def whole_matrix(w: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's format: the whole fp32 master quantized in ceil(R/128) x ceil(C/128) tiles, then dequantized."""
    w = w.detach()
    return dequantize_block_major(*quantize_block_major(w, fmt), w.shape, fmt, dtype)


def old_gcd_tiles(w: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The tiling the quantized AllGather used before: gcd(rows, b) x b tiles (4x128 for 300 rows)."""
    w = w.detach()
    rows, cols = w.shape[-2:]
    h, b = math.gcd(rows, fmt.block_size), fmt.block_size
    tc = -(-cols // b)
    x = nn.functional.pad(w.reshape(-1, cols), (0, tc * b - cols)).reshape(-1, h, tc, b).transpose(1, 2)
    codes, scales = quantize_tiles(x, fmt)
    out = dequantize_tiles(codes, scales, fmt).transpose(1, 2).reshape(-1, tc * b)[:, :cols]
    return out.reshape(w.shape)


def _names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() >= 2]


TILE_MAJOR = {"lin.a.weight", "lin.c.weight", "stack2"}  # the others: edge tiles the tile order cannot serve, or C = 128


def _bitwise(rank: int, world: int, layout: str, fmt_index: int, param_dtype) -> None:
    master = build()
    fmt = FORMATS[fmt_index]
    model = copy.deepcopy(master)
    declared = quantize_all_gather(model, fmt, layout=layout)
    assert sorted(declared) == sorted(_names(master))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    # Every cut falls between 128-row bands of a matrix, or for a tile-major master between two tiles (its
    # pieces are whole tiles: tile_boxes raises otherwise); at 3 ranks some weights really are cut.
    cut = []
    for name in declared:
        p = model.get_parameter(name)
        rows, cols = p.shape[-2:]
        lo, hi = p.local_range
        order = p.layout_info.order
        if layout == "auto":  # tile-major only where it can be, and only if it pads less (it does at 2 ranks)
            assert order is None or name in TILE_MAJOR, name
        else:
            assert (order is not None) == (layout == "block_major" and name in TILE_MAJOR), (name, order)
        if order is None:
            for off in (lo, hi):
                assert off % (rows * cols) % (128 * cols) == 0, (name, p.local_range)
        else:
            tile_boxes(tuple(p.shape), 128, lo, hi)
        if 0 < hi - lo < p.numel():
            cut.append(name)
    owned = torch.tensor([len(cut)])
    torch.distributed.all_reduce(owned)
    if world != 2:  # (2 ranks: these shapes split between whole tensors)
        assert (owned.item() > 0) == (world > 1), (world, owned)
    tiled_cut = torch.tensor([len(TILE_MAJOR & set(cut))])
    torch.distributed.all_reduce(tiled_cut)
    if layout == "block_major" and world == 3:
        assert tiled_cut.item() > 0, "a tile-major weight cut between tiles"
    model.unshard()
    dtype = param_dtype or torch.float32
    for name in declared:
        got, w = model.get_parameter(name), master.get_parameter(name)
        assert got.dtype == dtype
        want = whole_matrix(w, fmt, dtype)
        assert torch.equal(got, want), (fmt.name, dtype, name, (got != want).sum().item())
        if w.shape[-2] % 128:  # negative control: the old tiling is another format
            old = old_gcd_tiles(w, fmt).to(dtype)
            assert (old != want).sum() > 1000, (name, (old != want).sum().item())
    bias = model.get_parameter("lin.c.bias")
    assert torch.equal(bias, master.lin.c.bias.detach().to(dtype))  # 1-D stays unquantized
    model.reshard()


def _llama() -> nn.Module:
    from lightning_vescale.models import Llama, LlamaConfig

    torch.manual_seed(0)
    # Rows that are not multiples of 128 (wk/wv 64, w1/w3 320, vocab 200): their last tile row holds what remains.
    return Llama(LlamaConfig(vocab_size=200, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=320,
                             max_seq_len=32))


def _bytes(rank: int, world: int, model_name: str) -> None:
    """comm_stats and the tensors actually handed to the AllGathers agree, and codes + scales cost what the plan says:
    one byte per element and padding plus four per scale, against two per element for bf16. That is <= 0.52x of bf16
    where the 128-row granules cost little padding (the Llama at 2 ranks: 3.6%); on models this small a granule is
    a large part of a shard (Tiles, or the Llama at 3 ranks: 8%), which the plan table flags (test_dry_run)."""
    sent: dict[str, int] = {}
    flat = collectives._all_gather_flat

    def counting(output, input, *args, **kwargs):  # a ring AllGather sends N - 1 of the N pieces
        sent["bytes"] = sent.get("bytes", 0) + (world - 1) * input.numel() * input.element_size()
        return flat(output, input, *args, **kwargs)

    collectives._all_gather_flat = counting
    try:
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        totals, padding = {}, {}
        for fmt in (None, *FORMATS):
            model = _llama() if model_name == "llama" else build()
            if fmt is not None:
                quantize_all_gather(model, fmt)
            groups = [*getattr(model, "layers", []), model]
            for module in groups:
                # The embedding in the root's group with the head (as the plan tables count it): split off, its
                # 200 rows alone pad to two 128-row tiles per rank.
                fully_shard(module, mp_policy=bf16, split_embeddings=False)
            comm_stats.step()
            sent.clear()
            for module in groups:
                module.unshard()
                module.reshard()
            counted = {k: v for k, v in comm_stats.step().items() if k.startswith("all_gather")}
            assert sum(counted.values()) == sent["bytes"] > 0, (counted, sent)
            if fmt is not None:
                assert counted["all_gather_quant_codes"] > 0 and counted["all_gather_quant_scales"] > 0
            key = fmt.name if fmt else "bf16"
            totals[key] = sum(counted.values())
            plans = [plan for group in sharded_groups(model) for plan in group.plans]
            padding[key] = sum(p.padding for p in plans) / sum(p.total_numel for p in plans)
        ratios = {k: v / totals["bf16"] for k, v in totals.items()}
        if rank == 0:
            print(model_name, world, {k: round(v, 4) for k, v in ratios.items()},
                  {k: f"{v:.3%}" for k, v in padding.items()})
        for name in ("fp8_e4m3/128", "int8/128"):
            if model_name == "llama" and world == 2:
                assert ratios[name] <= 0.52, ratios
            # One byte per element and padding, 4 per scale, against two per element and the bf16 padding.
            assert ratios[name] <= 0.5 * (1 + padding[name]) / (1 + padding["bf16"]) + 0.005, (ratios, padding)
    finally:
        collectives._all_gather_flat = flat


# -- the tile-major (block-major) master against the row-band one -------------------------------------------------
def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 200, (2, 17), generator=g)
    return nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _train(model: nn.Module, layout: str, steps: int) -> tuple[list[float], torch.Tensor, torch.optim.Optimizer]:
    """Quantized AllGather in ``layout``, fp32 master, AdamW; then one more backward and clip_grad_norm_ (a global
    norm over the pieces, summed in another order when the pieces are tile-major: compared to 1e-6, not bitwise,
    and kept out of the steps, where fp8 rounding would amplify its last bit)."""
    from lightning_vescale import clip_grad_norm_

    quantize_all_gather(model, FORMATS[0], layout=layout)
    for module in (*model.layers, model):
        fully_shard(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _loss(model, steps).backward()
    return losses, clip_grad_norm_(model.parameters(), 0.5), opt


def _train_layouts(rank: int, world: int) -> None:
    runs = {}
    for layout in ("bands", "block_major"):
        model = _llama()
        runs[layout] = (model, _train(model, layout, steps=3))
    tiled, banded = runs["block_major"][0], runs["bands"][0]
    orders = {n: p.layout_info.order is not None for n, p in tiled.named_parameters()}
    assert orders["layers.0.attention.wq.weight"] and orders["layers.0.feed_forward.w1.weight"], orders
    assert not orders["tok_embeddings.weight"]  # 200 rows: a 72-row edge tile the tile order cannot serve
    (tiled_losses, tiled_norm, _), (banded_losses, banded_norm, _) = runs["block_major"][1], runs["bands"][1]
    for a, b in zip(tiled_losses, banded_losses):
        assert abs(a - b) <= 1e-6, (tiled_losses, banded_losses)
    torch.testing.assert_close(tiled_norm, banded_norm, rtol=1e-6, atol=0)
    for (name, p), q in zip(tiled.named_parameters(), banded.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-5, atol=1e-7, msg=name)


def _save_tiled(rank: int, world: int, tmp: str) -> None:
    """The tile-major master trained as in ``_train_layouts``, saved; rank 0 keeps its full (row-major) state."""
    from lightning_vescale import checkpoint

    tiled = _llama()
    _, _, opt = _train(tiled, "block_major", steps=3)
    tiled.zero_grad()
    # The tile-major master reads as the row-major weight everywhere: full_tensor, state_dict, checkpoints.
    state = {k: v.full_tensor() for k, v in tiled.state_dict().items()}
    names = {p: n for n, p in tiled.named_parameters()}
    state.update({f"exp_avg.{names[p]}": s["exp_avg"].full_tensor() for p, s in opt.state.items()})
    checkpoint.save(f"{tmp}/ckpt", tiled, opt)
    if rank == 0:
        torch.save(state, f"{tmp}/full.pt")


def _reload_layouts(rank: int, world: int, tmp: str) -> None:
    from lightning_vescale import checkpoint

    want = torch.load(f"{tmp}/full.pt", weights_only=True)
    model = _llama()
    quantize_all_gather(model, FORMATS[0], layout="block_major")
    for module in (*model.layers, model):
        fully_shard(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    checkpoint.load(f"{tmp}/ckpt", model, opt)
    assert any(p.layout_info.order is not None and 0 < p.local_range[1] - p.local_range[0] < p.numel()
               for p in model.parameters()), "some tile-major weight is cut on 3 ranks"
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), want[name]), name
    for name, p in model.named_parameters():  # optimizer states of tile-major masters reshard too
        assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), want[f"exp_avg.{name}"]), name


def _tile_major_llama():
    model = _llama()
    master = copy.deepcopy(model)
    quantize_all_gather(model, FORMATS[0], layout="block_major")
    for module in (*model.layers, model):
        fully_shard(module)
    wq = model.layers[0].attention.wq.weight
    assert wq.layout_info.order is not None
    return model, master, wq


def _muon_refuses_tile_major(rank: int, world: int) -> None:
    from lightning_vescale.optim import Muon

    _, _, wq = _tile_major_llama()
    with pytest.raises(ValueError, match="stored tile-major"):
        Muon([wq])


def _full_state_dict_helpers(rank: int, world: int) -> None:
    """torch's DCP state-dict helpers see the row-major weights: full state dict, and a load of one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model, master, wq = _tile_major_llama()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for name, value in master.state_dict().items():
        assert torch.equal(full[name], value), name
    want = full["layers.0.attention.wq.weight"] + 1
    set_model_state_dict(model, {k: v + 1 for k, v in full.items()}, options=StateDictOptions(full_state_dict=True))
    assert torch.equal(wq.full_tensor(), want)


def _broadcast_from_rank0(rank: int, world: int) -> None:
    """broadcast_from_rank0: rank 0 alone holds the full state dict (DTensor code asks the placement for the rows
    that cover a piece: all rows for a tile-major one)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model, master, _ = _tile_major_llama()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plus2 = {k: v + 2 for k, v in full.items()} if rank == 0 else {}
    set_model_state_dict(model, plus2, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, value in master.state_dict().items():
        assert torch.equal(model.state_dict()[name].full_tensor(), value + 2), name


# -- the module's ranks: the 2 that save the tile-major checkpoint are those of the 2-rank tests -------------------


@pytest.fixture(scope="module")
def tiled_ckpt(ranks: DistributedPools, tmp_path_factory) -> str:
    """A checkpoint of the tile-major master trained on 2 ranks, and its full state (``full.pt``)."""
    tmp = str(tmp_path_factory.mktemp("tiles"))
    ranks(2).run(_save_tiled, tmp)
    return tmp




class _GatherTests(ModuleRanksTest):
    @pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("fmt_index", range(len(FORMATS)), ids=[f.name for f in FORMATS])
    @pytest.mark.parametrize("layout", ["auto", "block_major", "bands"])
    def test_gathered_weights_are_the_whole_matrix_tiles_bitwise(self, layout, fmt_index, param_dtype) -> None:
        self.run_ranks(_bitwise, layout, fmt_index, param_dtype)


class _BytesTests(_GatherTests):
    @pytest.mark.parametrize("model_name", ["llama", "tiles"])
    def test_quantized_all_gather_bytes_against_bf16(self, model_name: str) -> None:
        self.run_ranks(_bytes, model_name)


class _TileMajorHelperTests:
    """Muon refuses a tile-major master by name (its pieces are not row-major ranges); torch's
    get_model_state_dict / set_model_state_dict (also broadcast_from_rank0) read and load the row-major weight."""

    def test_muon_refuses_a_tile_major_master(self) -> None:
        self.run_ranks(_muon_refuses_tile_major)

    def test_torch_full_state_dict_helpers_see_the_row_major_weight(self) -> None:
        self.run_ranks(_full_state_dict_helpers)

    def test_torch_broadcast_from_rank0_loads_the_row_major_weight(self) -> None:
        self.run_ranks(_broadcast_from_rank0)


class TestQuantTilesOn1Rank(_GatherTests, _TileMajorHelperTests):
    world_size = 1


class TestQuantTilesOn2Ranks(_BytesTests):
    world_size = 2

    def test_block_major_trains_as_the_band_layout(self) -> None:
        """fp32 master: the same losses (1e-6) and parameters as the row-band layout on 2 ranks."""
        self.run_ranks(_train_layouts)


class TestQuantTilesOn3Ranks(_BytesTests, _TileMajorHelperTests):
    world_size = 3

    def test_tile_major_checkpoint_reloads_bitwise(self, tiled_ckpt: str) -> None:
        self.run_ranks(_reload_layouts, tiled_ckpt)


def test_tile_major_checkpoint_reads_whole_into_an_unsharded_model(tiled_ckpt: str) -> None:
    """Read whole in one process, the 2-rank tile-major checkpoint loads into an unsharded model bitwise."""
    from lightning_vescale import checkpoint

    want = torch.load(f"{tiled_ckpt}/full.pt", weights_only=True)
    state, _ = checkpoint.read_full_checkpoint(f"{tiled_ckpt}/ckpt")
    plain = _llama()
    plain.load_state_dict(state)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert len(want) > len(state)  # the optimizer's states are compared on 3 ranks
