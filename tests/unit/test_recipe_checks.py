"""What the recipes check before a run starts (unknown keys, resume against the saved config), the fine-tune's
``model=from_checkpoint`` and the Hugging Face export. No processes are started."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_vescale.export import export_hf, main, write_run_model
from lightning_vescale.models import Llama, MoE, llama_config, moe_config, save_pretrained
from lightning_vescale.recipe.checks import ConfigError, preflight
from lightning_vescale.recipe.schema import CheckpointModelConfig, validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module", autouse=True)
def hydra_configs():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield


def compose_cfg(*overrides: str, config: str = "train"):
    return compose(config, overrides=list(overrides))


def load(*overrides: str, config: str = "train"):
    return validate(compose_cfg(*overrides, config=config))


def fake_run(
    root: Path, stamp: str, *overrides: str, step: int, mtime: float = 1000.0, name: str = "llama_tiny"
) -> Path:
    """A run directory as a recipe leaves it: the composed config, model.json and checkpoints/last.ckpt."""
    cfg = compose_cfg(f"output_root={root}", *overrides)
    run = root / name / stamp
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    write_run_model(run, validate(cfg).model.build_config())
    checkpoint = run / "checkpoints" / f"step-{step:06d}.ckpt"
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").touch()  # what makes a directory a complete sharded checkpoint
    (run / "checkpoints" / "last.ckpt").symlink_to(checkpoint.name)
    os.utime(checkpoint, (mtime, mtime))
    os.utime(run / "checkpoints" / "last.ckpt", (mtime, mtime), follow_symlinks=False)
    return run


# ---------------------------------------------------------------------------------------------------------
# Unknown keys


def test_keys_added_with_plus_are_rejected_unless_under_notes():
    with pytest.raises(ValueError, match=r"unknown config key\(s\): foo\. .*\+notes\.foo="):
        load("+foo=1")
    with pytest.raises(ValueError, match=r"model\.dimm \(did you mean model\.dim\?\)"):
        load("+model.dimm=3")
    with pytest.raises(ValueError, match=r"unknown config key\(s\): trainer\.x"):
        load("+trainer.x.y=3")
    cfg = load("+notes.purpose=sweep", "+notes.owner.team=infra")
    assert cfg.notes == {"purpose": "sweep", "owner": {"team": "infra"}}


# ---------------------------------------------------------------------------------------------------------
# Resume


def test_resume_true_continues_the_newest_run_with_the_same_settings(tmp_path):
    older = fake_run(tmp_path, "a", step=100, mtime=1000)
    newer = fake_run(tmp_path, "b", step=200, mtime=2000)
    checked = preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))
    assert checked.resume.checkpoint == newer / "checkpoints" / "step-000200.ckpt"  # last.ckpt, resolved once
    assert checked.resume.run_dir == newer and checked.resume.step == 200 and checked.resume.notes == []
    explicit = preflight(compose_cfg(f"output_root={tmp_path}", f"resume={older}")).resume
    assert explicit.run_dir == older and explicit.step == 100


def test_resume_refuses_a_run_trained_with_other_settings_and_names_the_keys(tmp_path):
    matching = fake_run(tmp_path, "a", step=100, mtime=1000)
    other = fake_run(tmp_path, "b", "precision=bf16_mixed", "trainer.devices=4", step=200, mtime=2000)
    with pytest.raises(ConfigError) as info:
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))
    message = str(info.value)
    assert f"resume=true would continue {other} (checkpoint at step 200)" in message
    assert "trainer.precision: saved 'bf16-mixed', now '32-true'" in message
    assert "trainer.precision=bf16-mixed" in message  # the override that matches the run
    assert "trainer.devices" not in message  # the world size may change
    assert f"runs of 'llama_tiny' with matching settings: {matching}" in message
    # Its own settings (on 2 processes instead of 4) continue it, with a note on the world size.
    resume = preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", "precision=bf16_mixed")).resume
    assert resume.run_dir == other
    assert any("trained on 4 processes and continues on 2" in note for note in resume.notes)


def test_resume_compares_model_optimizer_schedule_data_seed_and_strategy(tmp_path):
    fake_run(tmp_path, "a", step=100)
    changed = ["model.n_layers=3", "optimizer.lr=0.01", "scheduler.decay=linear", "data.seq_len=64", "seed=7",
               "strategy=fsdp2"]
    with pytest.raises(ConfigError) as info:
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", *changed))
    message = str(info.value)
    for expected in ("model.n_layers: saved 2, now 3", "optimizer.lr: saved 0.003, now 0.01",
                     "scheduler.decay: saved 'cosine', now 'linear'", "data.seq_len: saved 128, now 64",
                     "seed: saved 1234, now 7",
                     "strategy._target_: saved 'lightning_vescale.lightning.VeScaleStrategy'"):
        assert expected in message, message
    # On purpose (e.g. a lower learning rate): resume_strict=false continues and says what differs.
    lenient = preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", "optimizer.lr=0.001",
                                    "resume_strict=false")).resume
    assert lenient.step == 100 and any("optimizer.lr differs" in note for note in lenient.notes)
    # What may change: loader workers, accumulation, max_steps.
    resume = preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", "data.num_workers=2",
                                   "trainer.accumulate_grad_batches=2", "trainer.max_steps=400")).resume
    assert resume.step == 100 and "trainer.max_steps changes from 300 to 400" in " ".join(resume.notes)


def test_resuming_a_finished_run_says_how_to_extend_it(tmp_path):
    run = fake_run(tmp_path, "a", "trainer.max_steps=12", step=12)
    with pytest.raises(ConfigError, match=rf"{run} \(checkpoint at step 12\) already reached trainer.max_steps=12.*"
                                          r"trainer.max_steps=24"):
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", "trainer.max_steps=12"))
    assert preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", "trainer.max_steps=24")).resume.step == 12


def test_resume_true_never_continues_an_older_run_when_the_newest_lost_its_last_ckpt(tmp_path):
    fake_run(tmp_path, "a", step=100, mtime=1000)
    newer = fake_run(tmp_path, "b", step=200, mtime=2000)
    # Killed after the new checkpoint was written and the old one deleted, before last.ckpt was relinked.
    (newer / "checkpoints" / "step-000200.ckpt" / ".metadata").unlink()
    (newer / "checkpoints" / "step-000200.ckpt").rmdir()
    with pytest.raises(ConfigError, match=r"resume=true: the newest run named 'llama_tiny', .*b, has no usable "
                                          r"checkpoints/last\.ckpt \(it names 'step-000200\.ckpt', which does not "
                                          r"exist\).*an older run is never picked instead"):
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))
    # Killed after its first checkpoint and before the link existed: its checkpoint is offered, not run a.
    (newer / "checkpoints" / "last.ckpt").unlink()
    step = newer / "checkpoints" / "step-000300.ckpt"
    step.mkdir()
    (step / ".metadata").touch()
    os.utime(step, (3000, 3000))
    with pytest.raises(ConfigError, match=r"\(it is missing\).*complete checkpoints: \['step-000300\.ckpt'\].*"
                                          r"ckpt_path=.*step-000300\.ckpt"):
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))


def test_init_from_a_sharded_checkpoint_without_checksums_is_refused_before_the_run(tmp_path):
    run = tmp_path / "ft" / "run"
    _sharded_checkpoint(run / "checkpoints" / "step-000004.ckpt", Llama(llama_config("tiny")))
    (run / "checkpoints" / "last.ckpt").symlink_to("step-000004.ckpt")
    write_run_model(run, llama_config("tiny"))
    (run / "checkpoints" / "step-000004.ckpt" / "checksums.json").unlink()
    with pytest.raises(ConfigError, match=r"init_from=.*run: the checkpoint .*step-000004\.ckpt has no checksums\.json"
                                          r".*allow_unverified=true"):
        preflight(compose_cfg(f"init_from={run}", config="finetune"))
    assert preflight(compose_cfg(f"init_from={run}", "allow_unverified=true", config="finetune")).resume is None


def test_resume_without_a_checkpoint_and_a_bad_run_dir_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="resume=true found no checkpoint to continue"):
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"resume=.*empty: .* is neither a run directory nor a checkpoint"):
        preflight(compose_cfg(f"output_root={tmp_path}", f"resume={tmp_path / 'empty'}"))


# ---------------------------------------------------------------------------------------------------------
# model=from_checkpoint


def _hf_llama(tmp_path: Path) -> tuple[Path, object]:
    arch = llama_config("tiny")
    arch.norm_eps, arch.rope_theta = 1e-6, 10000.0  # not the preset's: the old recipe needed them restated
    save_pretrained(Llama(arch), arch, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return tmp_path / "hf", arch


def test_from_checkpoint_takes_the_model_config_from_the_checkpoint(tmp_path):
    hf, arch = _hf_llama(tmp_path)
    cfg = load(f"init_from={hf}", config="finetune")
    assert isinstance(cfg.model, CheckpointModelConfig) and cfg.model.family == "llama"
    assert cfg.model.build_config() == arch and cfg.model.hf_model_type == "llama"
    assert cfg.name == "hf_finetune"
    longer = load(f"init_from={hf}", "model.max_seq_len=256", config="finetune").model
    assert longer.build_config().max_seq_len == 256 and longer.overrides() == {"max_seq_len": 256}
    with pytest.raises(ValueError, match=r"holds a llama model, which has no field\(s\) \['num_experts'\]"):
        load(f"init_from={hf}", "model.num_experts=8", config="finetune")
    torch.save(Llama(arch).state_dict(), tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"carries no model config .* name the model instead"):
        load(f"init_from={tmp_path / 'w.pt'}", config="finetune")
    # A preset that does not match is stopped before anything runs, from config.json alone.
    with pytest.raises(ValueError, match=r"does not match model=llama_tiny:\n  norm_eps: checkpoint 1e-06"):
        preflight(compose_cfg(f"init_from={hf}", "model=llama_tiny", config="finetune"))


def test_from_checkpoint_reads_a_recipe_run(tmp_path):
    run = fake_run(tmp_path, "a", "model=moe_tiny", "model.n_layers=3", step=10, name="moe_tiny")
    cfg = load(f"init_from={run}", config="finetune")
    assert cfg.model.family == "moe"
    assert cfg.model.build_config() == load("model=moe_tiny", "model.n_layers=3").model.build_config()
    assert cfg.name == "moe_tiny_finetune"
    assert load(f"init_from={run / 'checkpoints' / 'step-000010.ckpt'}", config="finetune").name == "moe_tiny_finetune"


# ---------------------------------------------------------------------------------------------------------
# Export


def _sharded_checkpoint(path: Path, model: torch.nn.Module) -> None:
    """The layout VeScaleStrategy writes ("model." section + the LightningModule's "model." attribute)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"model.model.{k}": v for k, v in model.state_dict().items()},
                 storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    from lightning_vescale.checkpoint import add_checksums

    add_checksums(str(path))  # as the recipes' StepCheckpoint does for any sharded directory


def _exported_run(tmp_path: Path, model: torch.nn.Module, arch, hf_model_type, *, with_model_json=True) -> Path:
    run = tmp_path / "ft" / "run"
    checkpoint = run / "checkpoints" / "step-000004.ckpt"
    _sharded_checkpoint(checkpoint, model)
    (run / "checkpoints" / "last.ckpt").symlink_to(checkpoint.name)
    if with_model_json:
        write_run_model(run, arch, hf_model_type)
    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return run


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_export_writes_a_directory_transformers_loads(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "llama":
        arch = llama_config("tiny")
        arch.rope_theta = 10000.0
        model = Llama(arch)
    else:
        arch = moe_config("tiny")
        arch.shared_expert_gate = True
        model = MoE(arch)
    model.eval()
    run = _exported_run(tmp_path, model, arch, family)
    out = export_hf(run, tmp_path / "out")
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}\n'
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert hf.config.model_type == family
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_hf(run, out)
    assert main([str(run), str(tmp_path / "out2")]) == 0  # the command line does the same
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == sorted(p.name for p in out.iterdir())


def test_export_of_a_run_without_model_json_and_bad_sources(tmp_path, capsys):
    torch.manual_seed(0)
    model = Llama(llama_config("tiny"))
    run = _exported_run(tmp_path, model, None, None, with_model_json=False)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose_cfg()))  # an older run: preset only
    out = export_hf(run / "checkpoints" / "step-000004.ckpt", tmp_path / "out")
    from safetensors.torch import load_file

    assert torch.equal(load_file(out / "model.safetensors")["model.norm.weight"], model.norm.weight)
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "nowhere"), str(tmp_path / "out3")])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out3").exists()


def test_memory_estimate_of_an_hsdp_run_shards_over_the_shard_group():
    """strategy.replicate_size=2 on 4 ranks: a rank holds what it holds on 2 ranks of plain sharding."""
    from lightning_vescale.recipe.memory import estimate_for

    hsdp = estimate_for(load("memory=budget", "strategy.replicate_size=2"), 4)
    assert hsdp.params == estimate_for(load("memory=budget"), 2).params
    assert hsdp.params > estimate_for(load("memory=budget"), 4).params


# ---------------------------------------------------------------------------------------------------------
# Run folders


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, capsys):
    from hydra.core.utils import setup_globals

    from lightning_vescale.recipe.run_dir import claim_run_dir

    setup_globals()  # the ${now:...} resolver, as @hydra.main registers it
    # The default folder's form, to the year: the two runs share its name whenever the test runs.
    same_time = [f"output_root={tmp_path}", "hydra.run.dir=${output_root}/${name}/${now:%Y}"]
    first = compose("train", overrides=same_time, return_hydra_config=True)
    second = compose("train", overrides=same_time, return_hydra_config=True)
    assert first.hydra.run.dir == second.hydra.run.dir
    a, b = claim_run_dir(first), claim_run_dir(second)
    assert a != b and b.name == f"{a.name}_2" and a.is_dir() and b.is_dir()
    assert second.hydra.run.dir == str(b)  # where Hydra and the launched ranks will write
    assert f"this run writes to {b}" in capsys.readouterr().err
    explicit = compose("train", overrides=[f"hydra.run.dir={a}"], return_hydra_config=True)
    with pytest.raises(FileExistsError, match=rf"hydra.run.dir={a} already exists \(another run's folder"):
        claim_run_dir(explicit)


@pytest.mark.parametrize("name", ["..", ".", "a/b"])
def test_a_name_that_leaves_the_output_root_is_refused(name):
    with pytest.raises(ValueError, match=r"name must be a directory name .* so the run stays under "
                                         r"output_root/<name>/"):
        load(f"name={name}")


# ---------------------------------------------------------------------------------------------------------
# Tokenizer files that link out of their folder


def test_a_tokenizer_file_linking_out_of_the_run_is_never_copied(tmp_path):
    from lightning_vescale.export import copy_tokenizer_files

    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    run = _exported_run(tmp_path, Llama(llama_config("tiny")), llama_config("tiny"), "llama")
    (run / "tokenizer" / "tokenizer.json").symlink_to(secret)
    refused = rf"tokenizer file .*tokenizer\.json is a link to {secret}, outside .*run: refused"
    with pytest.raises(ValueError, match=refused):
        export_hf(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=rf"init_from=.*run: {refused}"):  # a fine-tune of the run, before it starts
        preflight(compose_cfg(f"init_from={run}", config="finetune"))
    # A link inside the folder is its file; a Hugging Face cache snapshot links into its repository's blobs.
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"model_max_length": 8}')
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer_config.json").symlink_to("../../blobs/abc123")
    assert copy_tokenizer_files(snapshot, tmp_path / "copied") == ["tokenizer_config.json"]
    assert (tmp_path / "copied" / "tokenizer_config.json").read_text() == '{"model_max_length": 8}'


def test_a_disk_tier_too_small_for_the_placement_activations_included_is_refused_before_the_run(tmp_path):
    from collections import namedtuple
    from unittest import mock

    from lightning_vescale.recipe.memory import estimate_for

    cfg = compose_cfg(f"output_root={tmp_path}", "memory=offload_disk")
    estimate = estimate_for(validate(cfg), 2)
    on_disk = 2 * (estimate.params + estimate.grads + estimate.optimizer_states + estimate.activations)
    usage = namedtuple("usage", "total used free")
    with mock.patch("shutil.disk_usage", return_value=usage(0, 0, int(on_disk - estimate.activations))):
        with pytest.raises(ConfigError, match=rf"memory: the disk tier at {tmp_path} has .* MiB free, but this "
                                              r"placement puts .* activations of a micro-batch .* MiB.*memory\.disk_dir="):
            preflight(cfg)  # room for all but the activations: still refused
    with mock.patch("shutil.disk_usage", return_value=usage(0, 0, int(on_disk) + 1)):
        preflight(cfg)


# ---------------------------------------------------------------------------------------------------------
# What the run needs from the machine, the weights and the data: refused before launch, not in every rank


def test_trainer_gpu_on_a_machine_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"trainer.accelerator=gpu \(trainer=gpu\) but this machine has no CUDA GPU"
                                          r".*trainer=default"):
        preflight(compose_cfg("trainer=gpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"trainer.devices=2 asks for 2 GPUs but this machine has 1"):
        preflight(compose_cfg("trainer=gpu", "trainer.devices=2"))


def test_a_replicate_size_that_does_not_divide_the_processes_is_refused():
    with pytest.raises(ConfigError, match=r"strategy.replicate_size=3 does not divide the 2 processes .*pick one of "
                                          r"1, 2, or strategy.replicate_size=null"):
        preflight(compose_cfg("strategy=vescale_hsdp", "strategy.replicate_size=3"))
    assert preflight(compose_cfg("strategy=vescale_hsdp", "strategy.replicate_size=2")).config.strategy.replicate_size == 2


def test_a_model_too_large_for_the_machine_is_refused_naming_the_dry_run(monkeypatch):
    from lightning_vescale.recipe import checks

    sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 24 * 2**30 // 4096}  # a 24 GiB machine, wherever this runs
    monkeypatch.setattr(checks.os, "sysconf", lambda name: sizes[name])
    with pytest.raises(ConfigError, match=r"model=llama_70b has 70.6B parameters: training them holds about 526 GiB "
                                          r"per rank .* more than the 12.0 GiB a rank has here .*python -m "
                                          r"lightning_vescale.plan model=llama_70b .*model=llama_tiny"):
        preflight(compose_cfg("model=llama_70b", "data.seq_len=128"))
    preflight(compose_cfg("model=llama_1b", "data.seq_len=128"))  # 9.2 GiB per rank: fits


def test_a_fine_tune_override_that_changes_the_weights_shapes_is_refused(tmp_path):
    hf, _ = _hf_llama(tmp_path)
    with pytest.raises(ConfigError, match=r"model.n_layers=3 \(the checkpoint's: 2\) contradicts init_from=.*\n.*"
                                          r"missing from the checkpoint .*layers.2"):
        preflight(compose_cfg(f"init_from={hf}", "model.n_layers=3", config="finetune"))
    preflight(compose_cfg(f"init_from={hf}", "model.max_seq_len=256", config="finetune"))  # no tensor changes
    from safetensors.torch import save_file

    save_file(Llama(llama_config("tiny")).state_dict(), str(tmp_path / "w.safetensors"))
    with pytest.raises(ConfigError, match=r"does not match model=llama_tiny:\n.*unexpected in the checkpoint"):
        preflight(compose_cfg(f"init_from={tmp_path / 'w.safetensors'}", "model=llama_tiny", "model.n_layers=1",
                              config="finetune"))


def test_data_text_file_without_a_path_says_what_to_set():
    from omegaconf.errors import MissingMandatoryValue

    from lightning_vescale.recipe.checks import config_error_message

    with pytest.raises(MissingMandatoryValue) as info:
        preflight(compose_cfg("data=text_file"))
    assert config_error_message(info.value).startswith(
        "data=text_file trains on your own text, so it needs data.path: set data.path=/path/to/corpus.txt")


def test_a_binary_data_file_is_refused(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 500)
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 3 is 0xe9\).*iconv -f <its encoding> -t UTF-8"):
        preflight(compose_cfg("data=text_file", f"data.path={tmp_path / 'latin1.txt'}"))
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02\x03" * 500)
    with pytest.raises(ValueError, match=r"holds NUL bytes \(the first at byte 0\), so it is a binary file"):
        preflight(compose_cfg("data=text_file", f"data.path={tmp_path / 'blob.bin'}"))


def test_a_text_too_small_for_the_windows_says_what_helps(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("x" * 200)  # fewer than two windows of 128 (+1): no val_fraction can help
    with pytest.raises(ValueError,
                       match=r"has 200 tokens, fewer than the 258 of one training and one validation window of "
                             r"data.seq_len=128 \(\+1 for the target\): use a longer text, or data.seq_len=99 at most$"):
        preflight(compose_cfg("data=text_file", f"data.path={small}"))
    medium = tmp_path / "medium.txt"
    medium.write_text("x" * 1000)  # two windows fit; 5% (50 tokens) of it cannot hold a validation window
    with pytest.raises(ValueError, match=r"the validation split .* \(data.val_fraction=0.05: 50 of 1000 tokens\) is "
                                         r"shorter than one window .*: set data.val_fraction=0.129 or more"):
        preflight(compose_cfg("data=text_file", f"data.path={medium}"))
    preflight(compose_cfg("data=text_file", f"data.path={medium}", "data.val_fraction=0.129"))


# ---------------------------------------------------------------------------------------------------------
# Which run resume=true continues, and the overrides its message suggests


def test_resume_suggests_the_strategy_option_not_its_target(tmp_path):
    # strategy._target_=...DDPStrategy alone keeps vescale's fields, which DDPStrategy does not take.
    run = fake_run(tmp_path, "a", "strategy=ddp", step=100)
    with pytest.raises(ConfigError) as info:
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))
    message = str(info.value)
    assert "Continue it with its settings (strategy=ddp)" in message, message
    assert "strategy._target_=" not in message
    # The run's Hydra choices, where it kept them, name the option it was composed from.
    (run / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      strategy: my_ddp\n")
    with pytest.raises(ConfigError, match=r"Continue it with its settings \(strategy=my_ddp\)"):
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))
    assert preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", "strategy=ddp")).resume.run_dir == run


def test_resume_true_refuses_the_newest_run_when_its_strategy_settings_differ(tmp_path):
    # The README in order: the main job, then a short HSDP run; resume=true with the main job's settings must not
    # stretch the HSDP run to 300 steps.
    main_job = fake_run(tmp_path, "a", step=200, mtime=1000)
    hsdp = fake_run(tmp_path, "b", "strategy=vescale_hsdp", "trainer.max_steps=30", step=30, mtime=2000)
    with pytest.raises(ConfigError) as info:
        preflight(compose_cfg(f"output_root={tmp_path}", "resume=true"))
    message = str(info.value)
    assert f"resume=true would continue {hsdp} (checkpoint at step 30)" in message
    assert "strategy.replicate_size: saved 'auto', now None" in message
    assert "(strategy.replicate_size=auto)" in message and f"matching settings: {main_job}" in message
    resume = preflight(compose_cfg(f"output_root={tmp_path}", f"resume={main_job}")).resume
    assert resume.reason == (f"resume={main_job} continues {main_job} (checkpoint at step 200); its settings match "
                             f"this run's. The continued run writes a new run directory")
    resume = preflight(compose_cfg(f"output_root={tmp_path}", "resume=true", "strategy=vescale_hsdp",
                                   "trainer.max_steps=60")).resume
    assert resume.reason == (f"resume=true continues {hsdp} (checkpoint at step 30): the newest of the 2 run(s) named "
                             f"'llama_tiny' under {str(tmp_path)!r} with a checkpoints/last.ckpt; its settings match "
                             f"this run's. The continued run writes a new run directory")
