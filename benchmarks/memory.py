"""Per-rank memory of ddp, zero1, zero2 and zero3 on the ~50M-parameter GPT, against the ZeRO paper.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
section 5, with fp32 AdamW (4 bytes of parameters, 4 of gradients, 8 of optimizer state per
parameter), bytes per parameter held by each of N ranks:

    ddp 16    zero1 4 + 4 + 8/N    zero2 4 + (4 + 8)/N    zero3 16/N

The chargpt GPT with n_layer=8, n_head=8, n_embd=720, block_size=64 (50,073,120 parameters; the
lm head is tied to the token embedding and counted once) is set up with each strategy in a gloo
group of N local processes (tests/support/distributed_harness.py, no Ray) and trained 2 steps (global batch
N, micro-batch 1). On every rank we measure (model states only: activations are not counted):

- resident: ``strategies.base.memory_breakdown`` after step 2 (gradients are still held: the step
  loop frees them at the start of the next step): parameters, gradients, optimizer state;
- peak: the largest sum of parameter, gradient and optimizer-state storages allocated at step 2's
  hook points (each block's forward pre-hook, the gradient of each block's output, before and
  after the optimizer step). Storages are counted once (zero1's shards alias the parameters) and
  only while allocated, so FSDP2's gathered parameters count from all-gather to reshard;
  transients between hook points (FSDP2's unsharded gradients before reduce-scatter) are missed;
- ddp_buckets: DDP's flat gradient buckets (ddp, zero1): a second copy of the gradients, since
  ``gradient_as_bucket_view`` is off; outside the formula, reported beside it;
- peak RSS growth: the process's VmHWM minus its RSS before the model was built (everything:
  activations, buckets, temporaries, allocator slack), after setup and after the steps.

The goal (issue 4): within 10% of the formula, on every rank. Run from the repository root (about
3 minutes on 2 busy cores; ddp at N=4 holds ~4 GB in all)::

    .venv/bin/python -m benchmarks.memory                  # N = 2 and 4, all four strategies
    .venv/bin/python -m benchmarks.memory --world-sizes 2 --strategies zero2 zero3

Writes benchmarks/results/memory.json and memory.png.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks._sharded_setup import GPT_50M, set_up
from benchmarks.common import RESULTS, machine_info
from raylastic.strategies.base import TrainState, memory_breakdown
from raylastic.workloads.chargpt import CharGPT
from tests.support.distributed_harness import run_distributed

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
NUM_PARAMETERS = CharGPT.num_parameters(**GPT_50M)
GOAL = 0.10
COMPONENTS = ("parameters", "gradients", "optimizer")
DEFINITIONS = {
    "resident": "raylastic.strategies.base.memory_breakdown after step 2, gradients still held (local shards only)",
    "peak": "largest parameter+gradient+optimizer storage bytes (distinct, allocated) over step 2's hook "
            "points: forward pre-hook of each block, gradient of each block's output, before/after optimizer "
            "step; activations and transients between hook points not counted",
    "ddp_buckets": "DDP's flat gradient buckets (gradient_as_bucket_view off): a second gradient copy",
    "peak_rss_growth": "VmHWM minus VmRSS before the model was built: everything, allocator slack included "
                       "(peak_rss_growth_setup: the same right after the strategy's setup, before any step)",
    "compared": "what the goal compares with the formula: the peak for zero2 (FSDP2 gathers its parameters "
                "from forward to backward only), the resident bytes otherwise",
    "bytes_per_parameter": "bytes / 50,073,120",
}


def formula_bytes_per_parameter(strategy: str, world_size: int) -> float:
    return {"ddp": 16.0, "zero1": 4 + 4 + 8 / world_size, "zero2": 4 + 12 / world_size,
            "zero3": 16 / world_size}[strategy]


def held_bytes(state: TrainState) -> dict[str, int]:
    """Bytes of the distinct, allocated storages behind parameters, gradients and optimizer state."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:  # freed (resharded) or aliased: skip
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    # The optimizer's parameters are FSDP2's sharded ones (kept while the module holds gathered ones)
    # and zero1's shards; the module's are the gathered ones while FSDP2 has them unsharded.
    parameters = [*state.model.parameters(), *(p for g in state.optimizer.param_groups for p in g["params"])]
    optimizer = [v for entries in state.optimizer.state.values() for v in entries.values()
                 if isinstance(v, torch.Tensor)]
    return {"parameters": count(parameters), "gradients": count(p.grad for p in parameters),
            "optimizer": count(optimizer)}


class PeakSampler:
    """Samples ``held_bytes`` at hook points of one training step; ``peak`` is the largest total."""

    def __init__(self, state: TrainState) -> None:
        self.state, self.peak, self.peak_at = state, {c: 0 for c in COMPONENTS}, ""
        self.handles = []
        for index, block in enumerate(state.model.blocks):
            self.handles.append(block.register_forward_pre_hook(lambda *_, i=index: self.sample(f"forward {i}")))
            self.handles.append(block.register_forward_hook(lambda _m, _a, out, i=index: self._on_output(out, i)))
        optimizer_step = state.optimizer.step

        def step(*args, **kwargs):
            self.sample("before optimizer step")
            result = optimizer_step(*args, **kwargs)
            self.sample("after optimizer step")
            return result

        state.optimizer.step = step  # an instance attribute: ``del`` restores the class's

    def _on_output(self, output: torch.Tensor, index: int) -> None:
        if output.requires_grad:
            output.register_hook(lambda _grad: self.sample(f"backward {index}"))

    def sample(self, where: str) -> None:
        held = held_bytes(self.state)
        if sum(held.values()) > sum(self.peak.values()):
            self.peak, self.peak_at = held, where

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        del self.state.optimizer.step


def measure_rank(strategy_name: str) -> dict:
    """On every rank: set up, step twice (Adam's state is created in step 1), measure step 2."""
    rss_before = _status_kib("VmRSS")
    world_size = dist.get_world_size()
    setup = set_up(strategy_name, GPT_50M, global_batch_size=world_size, micro_batch_size=1)
    setup_rss_growth = (_status_kib("VmHWM") - rss_before) * 1024  # every rank builds the whole model first
    setup.runner.run(setup.state, 0)
    sampler = PeakSampler(setup.state)
    setup.runner.run(setup.state, 1)
    sampler.remove()
    logging_data = getattr(setup.state.wrapped, "_get_ddp_logging_data", dict)()
    buckets = sum(int(b) for b in str(logging_data.get("bucket_sizes", "")).split(",") if b.strip())
    return {"rank": dist.get_rank(), "resident": memory_breakdown(setup.state), "peak": sampler.peak,
            "peak_at": sampler.peak_at, "ddp_buckets": buckets,
            "peak_rss_growth_setup": setup_rss_growth, "peak_rss_growth": (_status_kib("VmHWM") - rss_before) * 1024}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def summarize(strategy: str, world_size: int, ranks: list[dict]) -> dict:
    formula = formula_bytes_per_parameter(strategy, world_size)
    for rank in ranks:
        rank["resident_bytes_per_parameter"] = round(sum(rank["resident"].values()) / NUM_PARAMETERS, 4)
        rank["peak_bytes_per_parameter"] = round(sum(rank["peak"].values()) / NUM_PARAMETERS, 4)
        rank["resident_over_formula"] = round(rank["resident_bytes_per_parameter"] / formula, 4)
        rank["peak_over_formula"] = round(rank["peak_bytes_per_parameter"] / formula, 4)
    # FSDP2's zero2 gathers parameters only from forward to backward; the paper's stage 2 keeps
    # them replicated all along, so its formula is a peak, not what is resident between steps.
    compared = "peak" if strategy == "zero2" else "resident"
    worst = max(abs(rank[f"{compared}_over_formula"] - 1) for rank in ranks)
    return {"strategy": strategy, "world_size": world_size, "formula_bytes_per_parameter": round(formula, 4),
            "formula_bytes": round(formula * NUM_PARAMETERS), "compared": compared,
            "worst_deviation": round(worst, 4), "meets_goal": worst <= GOAL, "ranks": ranks}


def plot(results: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.2))
    labels = [f"{r['strategy']}\nN={r['world_size']}" for r in results]
    x = range(len(results))
    worst = [max(r["ranks"], key=lambda rank: rank["resident_bytes_per_parameter"]) for r in results]
    bars = [("formula (ZeRO paper)", [r["formula_bytes_per_parameter"] for r in results], "tab:gray"),
            ("resident after step", [w["resident_bytes_per_parameter"] for w in worst], "tab:blue"),
            ("peak during step", [w["peak_bytes_per_parameter"] for w in worst], "tab:orange")]
    for offset, (name, values, color) in zip((-0.27, 0, 0.27), bars, strict=True):
        ax.bar([i + offset for i in x], values, width=0.27, label=name, color=color)
    buckets = [w["ddp_buckets"] / NUM_PARAMETERS for w in worst]
    ax.bar(list(x), buckets, width=0.27, bottom=bars[1][1], color="none", edgecolor="tab:blue", hatch="//",
           label="+ DDP gradient buckets")
    for i, result in enumerate(results):
        ratio = worst[i][f"{result['compared']}_over_formula"]
        ax.annotate(f"{ratio:.2f}x", (i, max(bars[1][1][i] + buckets[i], bars[2][1][i], bars[0][1][i]) + 0.3),
                    ha="center", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("bytes per parameter on one rank")
    ax.set_title(f"chargpt GPT, {NUM_PARAMETERS / 1e6:.1f}M parameters, fp32 AdamW: model states per rank "
                 "(largest rank; label: measured/formula)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    args = parser.parse_args(argv)
    machine = machine_info()
    results = []
    for world_size in args.world_sizes:
        for strategy in args.strategies:  # one group at a time: ddp at N=4 alone holds ~4 GB
            ranks = run_distributed(measure_rank, world_size, strategy, timeout_s=900)
            results.append(summarize(strategy, world_size, ranks))
            r = results[-1]
            print(f"{strategy:6s} N={world_size}  formula {r['formula_bytes_per_parameter']:6.2f} B/param  "
                  + "  ".join(f"rank {k['rank']}: resident {k['resident_bytes_per_parameter']:6.2f} "
                              f"peak {k['peak_bytes_per_parameter']:6.2f} ({k['peak_at']})" for k in r["ranks"]),
                  flush=True)
    machine["loadavg_1_5_15_after"] = [round(x, 2) for x in os.getloadavg()]
    payload = {"benchmark": "per-rank bytes of parameters, gradients and optimizer state vs the ZeRO formulas",
               "machine": machine, "model": {**GPT_50M, "parameters": NUM_PARAMETERS}, "optimizer": "AdamW fp32",
               "goal_max_deviation": GOAL, "definitions": DEFINITIONS, "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(payload, indent=1) + "\n")
    plot(results, RESULTS / "memory.png")
    print(f"wrote {RESULTS / 'memory.json'} and memory.png")


if __name__ == "__main__":
    main()
