"""``import lightning_vescale`` needs only torch, and ``strategy="vescale"`` still works in either import order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_core_import_does_not_import_lightning_accelerate_or_hydra() -> None:
    out = run_python(
        "import sys, lightning_vescale as lv\n"
        "lv.parallelize, lv.Plan, lv.fully_shard\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'hydra', 'omegaconf') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_vescale_strategy_registers_whichever_is_imported_first() -> None:
    trainer = "Trainer(strategy='vescale', accelerator='cpu', devices=1, logger=False).strategy"
    fabric = "Fabric(strategy='vescale', accelerator='cpu', devices=1).strategy"
    after = run_python(
        "import lightning_vescale\n"
        "from lightning.pytorch import Trainer\nfrom lightning.fabric import Fabric\n"
        f"print(type({trainer}).__name__, type({fabric}).__name__)"
    )
    before = run_python(
        "from lightning.pytorch import Trainer\nfrom lightning.fabric import Fabric\n"
        "import lightning_vescale\n"
        f"print(type({trainer}).__name__, type({fabric}).__name__, lightning_vescale.VeScaleStrategy.__name__)"
    )
    assert after.split()[-2:] == ["VeScaleStrategy", "VeScaleFabricStrategy"]
    assert before.split()[-3:] == ["VeScaleStrategy", "VeScaleFabricStrategy", "VeScaleStrategy"]
