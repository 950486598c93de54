"""The recipes' Hydra configs: every option composes and validates; typos and bad values fail naming them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue

from lightning_vescale.checkpoint import CheckpointError
from lightning_vescale.models import DeepSeekV3, Llama, MoE, llama_config, moe_config, save_pretrained
from lightning_vescale.optim import AdamW8bit
from lightning_vescale.recipe import build_strategy, find_last_checkpoint, load_initial_weights, lr_multiplier
from lightning_vescale.recipe.module import build_optimizer_from_config
from lightning_vescale.recipe.schema import (
    AdamW8bitConfig,
    AdamWConfig,
    DDPStrategyConfig,
    DeepSeekV3ModelConfig,
    FinetuneConfig,
    LlamaModelConfig,
    ModelParallelStrategyConfig,
    MoEModelConfig,
    MuonConfig,
    Qwen3MoEModelConfig,
    TrainConfig,
    VeScaleStrategyConfig,
    validate,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


PRESET_MODELS = [m for m in options("model") if m != "from_checkpoint"]  # from_checkpoint: test_recipe_checks.py


@pytest.fixture(scope="module", autouse=True)
def hydra_configs():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield


def load(*overrides: str, config: str = "train") -> TrainConfig:
    return validate(compose(config, overrides=list(overrides)))


def test_defaults_are_the_quick_start():
    cfg = load()
    assert isinstance(cfg, TrainConfig) and not isinstance(cfg, FinetuneConfig)
    assert isinstance(cfg.model, LlamaModelConfig) and (cfg.model.family, cfg.model.preset) == ("llama", "tiny")
    assert cfg.model.build_config() == llama_config("tiny")
    assert isinstance(cfg.optimizer, AdamWConfig) and cfg.optimizer._target_ == "torch.optim.AdamW"
    assert isinstance(cfg.strategy, VeScaleStrategyConfig)
    assert cfg.strategy._target_ == "lightning_vescale.lightning.VeScaleStrategy"
    assert cfg.data.path is None and cfg.data.tokenizer == "byte"
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2 and cfg.trainer.precision == "32-true"
    assert cfg.name == "llama_tiny"


def test_every_group_has_the_promised_options():
    assert {"llama_tiny", "llama_debug", "llama_small", "llama_1b", "llama_8b", "llama_70b", "moe_tiny",
            "moe_debug", "moe_small"} <= set(options("model"))
    assert {"adamw", "muon"} <= set(options("optimizer"))
    assert {"vescale", "vescale_hsdp", "fsdp2", "ddp"} <= set(options("strategy"))
    assert {"fp32", "bf16_mixed", "bf16_true"} <= set(options("precision"))
    assert {"embedded", "text_file"} <= set(options("data"))
    assert {"default", "gpu"} <= set(options("trainer"))


@pytest.mark.parametrize("model", PRESET_MODELS)
def test_every_model_composes_and_validates(model):
    # Big presets need a matching window only; the config never allocates the model.
    cfg = load(f"model={model}")
    arch = cfg.model.build_config()
    assert f"{cfg.model.family}_{cfg.model.preset}" == model and cfg.name == model
    schemas = {"llama": LlamaModelConfig, "moe": MoEModelConfig, "qwen3_moe": Qwen3MoEModelConfig,
               "deepseek_v3": DeepSeekV3ModelConfig}
    assert type(cfg.model) is schemas[cfg.model.family]
    assert arch.vocab_size >= 256 and arch.max_seq_len >= cfg.data.seq_len


@pytest.mark.parametrize("optimizer", options("optimizer"))
def test_every_optimizer_composes_validates_and_builds(optimizer):
    cfg = load(f"optimizer={optimizer}")
    assert type(cfg.optimizer) is {"adamw": AdamWConfig, "muon": MuonConfig, "adamw8bit": AdamW8bitConfig}[optimizer]
    model = Llama(llama_config("tiny"))
    opt = build_optimizer_from_config(cfg.optimizer, model)
    assert isinstance(opt, torch.optim.Optimizer)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    if optimizer == "muon":
        assert {g["use_muon"] for g in opt.param_groups} == {True, False}
    if optimizer == "adamw8bit":
        assert isinstance(opt, AdamW8bit) and opt.block_size == 256
        assert build_strategy(cfg)._granularity == "elements:256"  # the strategy cuts on the blocks


@pytest.mark.parametrize("strategy", options("strategy"))
def test_every_strategy_composes_validates_and_instantiates(strategy):
    cfg = load(f"strategy={strategy}")
    expected = {
        "vescale": VeScaleStrategyConfig, "vescale_hsdp": VeScaleStrategyConfig,
        "fsdp2": ModelParallelStrategyConfig, "ddp": DDPStrategyConfig,
    }[strategy]
    assert type(cfg.strategy) is expected
    built = build_strategy(cfg)
    assert type(built).__name__ == cfg.strategy._target_.rsplit(".", 1)[1]
    if strategy == "vescale_hsdp":
        assert built._replicate_size == "auto"
    if strategy == "fsdp2":
        assert built._data_parallel_size == 2 and built._tensor_parallel_size == 1


@pytest.mark.parametrize("trainer", options("trainer"))
def test_every_trainer_composes_and_validates(trainer):
    cfg = load(f"trainer={trainer}", "precision=bf16_mixed")
    assert cfg.trainer.max_steps >= 1 and cfg.trainer.precision == "bf16-mixed"


@pytest.mark.parametrize(
    "precision,value", [("fp32", "32-true"), ("bf16_mixed", "bf16-mixed"), ("bf16_true", "bf16-true")]
)
def test_every_precision_composes_into_the_trainer(precision, value):
    assert options("precision") == sorted(["fp32", "bf16_mixed", "bf16_true"])
    assert load(f"precision={precision}").trainer.precision == value


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_validates(experiment):
    cfg = load(f"experiment={experiment}")
    assert cfg.trainer.max_steps >= 1


def test_groups_an_mpmd_run_does_not_apply_are_refused_rather_than_ignored():
    with pytest.raises(ValueError, match=r"memory=\.\.\. is not applied to MPMD runs yet"):
        load("experiment=vlm_mpmd", "memory=offload_disk")
    with pytest.raises(ValueError, match=r"quant=\.\.\., precision=bf16-mixed are not applied to MPMD runs yet"):
        load("experiment=vlm_mpmd", "quant=fp8_gather", "precision=bf16_mixed")


def test_experiment_overrides_groups_and_values():
    cfg = load("experiment=llama_debug_bpe")
    assert cfg.model.preset == "debug" and cfg.data.tokenizer == "bpe" and cfg.data.bpe_vocab_size == 2048
    cfg = load("experiment=fsdp2_baseline")
    assert isinstance(cfg.strategy, ModelParallelStrategyConfig) and cfg.name == "llama_tiny_fsdp2"


def test_field_overrides_reach_the_model_config():
    cfg = load("model=moe_tiny", "model.num_experts=8", "model.top_k=1", "model.n_layers=3")
    arch = cfg.model.build_config()
    assert (arch.num_experts, arch.top_k, arch.n_layers, arch.dim) == (8, 1, 3, 64)
    assert cfg.model.overrides() == {"num_experts": 8, "top_k": 1, "n_layers": 3}
    with torch.device("meta"):
        assert isinstance(cfg.model.build_model(), MoE)


def test_qwen3_and_deepseek_overrides_reach_the_model_config():
    cfg = load("model=deepseek_v3_tiny", "model.top_k_groups=3", "model.q_lora_rank=0")
    arch = cfg.model.build_config()
    assert arch.top_k_groups == 3 and arch.q_lora_rank == 0 and arch.num_expert_groups == 4
    with torch.device("meta"):
        assert isinstance(cfg.model.build_model(), DeepSeekV3)
    cfg = load("model=qwen3_moe_tiny", "model.dense_layers=[1]", "model.dense_ffn_hidden=48")
    assert cfg.model.build_config().dense_layers == (1,)
    with pytest.raises(ConfigCompositionException, match="n_kv_heads"):
        load("model=deepseek_v3_tiny", "model.n_kv_heads=2")  # MLA has no separate key/value heads
    with pytest.raises(ValueError, match=r"top_k=5 experts cannot be chosen from top_k_groups=2 groups of 2"):
        load("model=deepseek_v3_tiny", "model.top_k=5")


def test_finetune_config_requires_init_from(tmp_path):
    with pytest.raises((ValueError, MissingMandatoryValue), match="init_from"):
        load(config="finetune")  # model=from_checkpoint reads its config from init_from
    with pytest.raises((MissingMandatoryValue, InterpolationToMissingValueError), match="init_from"):
        load("model=llama_tiny", config="finetune")
    weights = tmp_path / "w.pt"
    torch.save({}, weights)
    cfg = load(f"init_from={weights}", "model=llama_tiny", config="finetune")
    assert isinstance(cfg, FinetuneConfig) and cfg.optimizer.lr == 1e-3 and cfg.name == "w_finetune"
    with pytest.raises(ValueError, match=r"init_from='.*missing.pt' does not exist"):
        load(f"init_from={tmp_path / 'missing.pt'}", "model=llama_tiny", config="finetune")


# ---------------------------------------------------------------------------------------------------------
# Typos and bad values


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.n_layer=3", "n_layer"),  # misspelled field of the model schema
        ("model.num_experts=8", "num_experts"),  # an MoE field on a Llama model
        ("optimizer.lrr=0.1", "lrr"),
        ("trainer.max_step=10", "max_step"),
        ("data.seqlen=64", "seqlen"),
        ("strategy.reshard_after_fwd=false", "reshard_after_fwd"),
        ("seeed=1", "seeed"),
    ],
)
def test_misspelled_keys_are_rejected_naming_them(override, key):
    with pytest.raises(ConfigCompositionException, match=f"Could not override '.*{key}'") as info:
        load(override)
    assert key in str(info.value.__cause__)


@pytest.mark.parametrize("group,option", [("model", "llama_tinyy"), ("optimizer", "adamww"), ("strategy", "fsdp")])
def test_unknown_options_list_the_valid_ones(group, option):
    with pytest.raises(MissingConfigException, match=rf"Could not find '{group}/{option}'") as info:
        load(f"{group}={option}")
    for valid in options(group):
        assert valid in str(info.value)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.preset=tinyy"], r"unknown llama preset model.preset='tinyy'; valid presets are: 1b, 70b, 8b, "
                                 r"debug, small, tiny"),
        (["model=moe_tiny", "model.preset=huge"], r"unknown moe preset model.preset='huge'; valid presets are: "
                                                  r"debug, small, tiny"),
        (["model.dim=100"], r"model=llama_tiny with overrides \{'dim': 100\}: .*head dim"),
        (["model=moe_tiny", "model.top_k=9"], r"top_k \(9\) must be <= num_experts \(4\)"),
        (["optimizer.lr=-1"], r"optimizer.lr must be a finite number > 0, got -1.0"),
        (["optimizer.lr=inf"], r"optimizer.lr must be a finite number > 0, got inf"),  # trained to NaN (issue 25)
        (["optimizer.lr=nan"], r"optimizer.lr must be a finite number > 0, got nan"),
        (["optimizer=muon", "optimizer.muon_lr=inf"], r"optimizer.muon_lr must be a finite number > 0, got inf"),
        (["optimizer.weight_decay=inf"], r"optimizer.weight_decay must be a finite number >= 0, got inf"),
        (["trainer.on_non_finite=ignore"], r"trainer.on_non_finite must be 'stop' or 'skip', got 'ignore'"),
        (["optimizer.betas=[0.9,1.5]"], r"optimizer.betas must be two numbers in \[0, 1\), got \[0.9, 1.5\]"),
        (["optimizer=muon", "optimizer.momentum=1.2"], r"optimizer.momentum must be in \[0, 1\), got 1.2"),
        (["optimizer._target_=not a path"], r"optimizer._target_ must be a dotted import path"),
        (["scheduler.decay=exp"], r"scheduler.decay must be one of cosine, linear, constant, got 'exp'"),
        (["trainer.precision=bf16"], r"trainer.precision must be one of .*got 'bf16'"),
        (["trainer.devices=0"], r"trainer.devices must be >= 1, got 0"),
        (["memory=offload_disk", "memory.prefetch_buckets=0"], r"memory.prefetch_buckets must be >= 1 \(the bucket stepping\), got 0"),
        (["trainer.max_steps=0"], r"trainer.max_steps must be >= 1, got 0"),
        (["trainer.gradient_clip_val=-1"], r"trainer.gradient_clip_val must be a finite number > 0 or null"),
        (["trainer.checkpoint_keep=3"], r"trainer.checkpoint_keep must be -1 or 1, got 3"),
        (["data.tokenizer=wordpiece"], r"data.tokenizer must be one of byte, bpe, got 'wordpiece'"),
        (["data.val_fraction=0"], r"data.val_fraction must be in \(0, 1\), got 0"),
        (["data.seq_len=1000"], r"data.seq_len=1000 exceeds model=llama_tiny max_seq_len=128"),
        (["data.tokenizer=bpe", "data.bpe_vocab_size=1024"],
         r"can produce 1024 token ids but model=llama_tiny has vocab_size=256"),
        (["strategy.replicate_size=0"], r"strategy.replicate_size must be null, 'auto' or a positive int, got 0"),
        (["strategy=fsdp2", "strategy.tensor_parallel_size=2"], r"strategy.tensor_parallel_size=2"),
        (["resume=true", "ckpt_path=x.ckpt"], r"set either resume=... or ckpt_path=..., not both"),
    ],
)
def test_bad_values_fail_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        load(*overrides)


def test_wrong_types_are_rejected_while_composing():
    with pytest.raises(ConfigCompositionException, match="trainer.max_steps"):
        load("trainer.max_steps=many")


def test_text_file_needs_an_existing_path(tmp_path):
    with pytest.raises(MissingMandatoryValue, match="data.path"):
        load("data=text_file")
    with pytest.raises(FileNotFoundError, match=r"data.path '.*absent.txt' does not exist"):
        load("data=text_file", f"data.path={tmp_path / 'absent.txt'}")
    corpus = tmp_path / "mine.txt"
    corpus.write_text("hello world\n" * 100)
    assert load("data=text_file", f"data.path={corpus}").data.path == str(corpus)


# ---------------------------------------------------------------------------------------------------------
# Pieces of the runner that need no processes


def test_lr_schedule_warms_up_then_decays():
    kw = dict(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_multiplier(0, decay="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, decay="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(60, decay="cosine", **kw) == pytest.approx(0.55)
    assert lr_multiplier(110, decay="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(60, decay="linear", **kw) == pytest.approx(0.55)
    assert lr_multiplier(100, decay="constant", **kw) == 1.0


def test_find_last_checkpoint_takes_the_newest(tmp_path):
    assert find_last_checkpoint(tmp_path, "run") is None
    older = tmp_path / "run" / "a" / "checkpoints"
    newer = tmp_path / "run" / "b" / "checkpoints"
    for d, t in ((older, 1000), (newer, 2000)):
        d.mkdir(parents=True)
        (d / "last.ckpt").mkdir()
        import os

        os.utime(d / "last.ckpt", (t, t))
    assert find_last_checkpoint(tmp_path, "run") == newer / "last.ckpt"
    assert find_last_checkpoint(tmp_path, "other") is None


def test_initial_weights_from_a_hugging_face_dir_must_match_the_model(tmp_path):
    cfg = load()
    torch.manual_seed(0)
    model = Llama(llama_config("tiny"))
    save_pretrained(model, llama_config("tiny"), tmp_path / "hf")
    state = load_initial_weights(tmp_path / "hf", cfg.model)
    assert state.keys() == model.state_dict().keys()
    assert torch.equal(state["layers.1.attention.wq.weight"], model.state_dict()["layers.1.attention.wq.weight"])

    bigger = llama_config("tiny")
    bigger.dim, bigger.n_layers = 128, 3
    save_pretrained(Llama(bigger), bigger, tmp_path / "hf_big")
    expected = r"does not match model=llama_tiny:\n  dim: checkpoint 128, model=llama_tiny 64\n  n_layers: checkpoint 3"
    with pytest.raises(ValueError, match=expected):
        load_initial_weights(tmp_path / "hf_big", cfg.model)
    moe_arch = moe_config("tiny")
    moe_arch.shared_expert_gate = True  # Qwen2-MoE's gated shared expert, so transformers can express it
    save_pretrained(MoE(moe_arch), moe_arch, tmp_path / "hf_moe")
    with pytest.raises(ValueError, match=r"holds a MoE model but model=llama_tiny is a Llama"):
        load_initial_weights(tmp_path / "hf_moe", cfg.model)
    (tmp_path / "not_hf").mkdir()
    with pytest.raises(FileNotFoundError, match=r"directory without config.json"):
        load_initial_weights(tmp_path / "not_hf", cfg.model)


def test_initial_weights_from_a_state_dict_file_must_match_the_model(tmp_path):
    cfg = load()
    model = Llama(llama_config("tiny"))
    torch.save(model.state_dict(), tmp_path / "w.pt")
    assert load_initial_weights(tmp_path / "w.pt", cfg.model).keys() == model.state_dict().keys()
    bad = dict(model.state_dict())
    bad.pop("norm.weight")
    bad["extra.weight"] = torch.zeros(1)
    bad["output.weight"] = torch.zeros(3, 3)
    torch.save(bad, tmp_path / "bad.pt")
    expected = (r"missing from the checkpoint \(1\): norm.weight \(64,\)\n  unexpected in the checkpoint, not in the model "
                r"\(1\): extra.weight \(1,\)\n  shape mismatch \(1\): output.weight: checkpoint \(3, 3\), model \(256, 64\)")
    with pytest.raises(ValueError, match=expected):
        load_initial_weights(tmp_path / "bad.pt", cfg.model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_initial_weights_from_a_sharded_checkpoint_directory(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = load()
    model = Llama(llama_config("tiny"))
    # The layout VeScaleStrategy writes: "model." (checkpoint section) + "model." (the LightningModule's attribute).
    dcp.save({f"model.model.{k}": v for k, v in model.state_dict().items()} | {"extra.step": torch.tensor(3)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "step-000003.ckpt")), no_dist=True)
    # Written without checksums.json (as by another library): refused unless the user allows it (issue 25).
    with pytest.raises(CheckpointError, match=r"has no checksums\.json, so its bytes cannot be verified"):
        load_initial_weights(tmp_path / "step-000003.ckpt", cfg.model)
    state = load_initial_weights(tmp_path / "step-000003.ckpt", cfg.model, allow_unverified=True)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_plans_disk_tier_gets_the_runs_swap_directory(tmp_path):
    from lightning_vescale.memory import MemoryPolicy
    from lightning_vescale.recipe.memory import memory_policy_for

    cfg = load("plan=llama_offload")
    assert cfg.plan["rules"][0] == {"match": "**.layers.*", "group": True, "tier": "disk"}
    policy = memory_policy_for(cfg, tmp_path, 2)  # no memory group: <run dir>/swap, as memory.disk_dir=null gives
    assert policy.disk_dir == str(tmp_path / "swap") and policy.optimizer_states == policy.params == "device"
    assert memory_policy_for(load("plan=llama"), tmp_path, 2) is None
    explicit = memory_policy_for(load("plan=llama_offload", "memory=offload_disk",
                                      f"memory.disk_dir={tmp_path / 'nvme'}"), tmp_path, 2)
    assert explicit.disk_dir == str(tmp_path / "nvme")
    deeper = memory_policy_for(load("memory=offload_disk", "memory.prefetch_buckets=8"), tmp_path, 2)
    assert deeper.prefetch_buckets == 8 and MemoryPolicy().prefetch_buckets == 5
