"""Shard a small Llama with ``fully_shard`` and train it in a plain PyTorch loop.

    torchrun --nproc_per_node=2 examples/train_llama.py --steps 40

Runs on CPU with gloo or on GPUs with NCCL unchanged. The data is a fixed-seed Markov chain over
bytes, so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale.models import Llama, llama_config


def markov_batch(generator: torch.Generator, transitions: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Token sequences drawn from a fixed transition table (learnable structure, no files needed)."""
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, transitions.shape[0], (batch,), generator=generator)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=generator).squeeze(1)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="Llama preset (tiny, debug, small, 1b, 8b, 70b)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision with fp32 master weights")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    config = llama_config(args.model)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(config)  # nothing is allocated until each rank materializes its pieces
    mp_policy = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    for block in model.layers:
        lv.fully_shard(block, mp_policy=mp_policy)
    lv.fully_shard(model, mp_policy=mp_policy)
    lv.init_sharded_weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    transitions = torch.softmax(torch.randn(config.vocab_size, config.vocab_size, generator=torch.Generator().manual_seed(1)) * 4, dim=-1)
    data_gen = torch.Generator().manual_seed(1000 + rank)
    if rank == 0:
        # Sharded parameters report the global shape; to_local() is this rank's piece, local_range where it
        # sits in the flattened global tensor, placement its RaggedShard.
        wq = model.layers[0].attention.wq.weight
        print(f"Llama-{args.model}: {sum(p.numel() for p in model.parameters())} parameters, "
              f"{sum(p.to_local().numel() for p in model.parameters())} on rank 0, {world} ranks, backend {backend}; "
              f"layers.0.attention.wq.weight {tuple(wq.shape)}: rank 0 holds elements {wq.local_range} "
              f"({wq.placement})")
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        tokens = markov_batch(data_gen, transitions, args.batch, args.seq).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        norm = lv.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_bytes = lv.comm_stats.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0 and (step % 5 == 0 or step == 1):
            print(f"step {step:4d}  loss {reported.item() / world:.4f}  grad-norm {norm.item():.3f}  "
                  f"sent {sum(step_bytes.values()) / 2**20:.2f} MiB  {time.perf_counter() - start:.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
