"""How docs/benchmarks.md shows each result file: one renderer per benchmark (``RENDERERS``, by file stem),
from the JSON's headline figures, parameters and definitions to markdown lines (stdlib only)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from benchmarks.report_format import fmt, params_line, table


def throughput(result: dict) -> list[str]:
    rows = [[r["workload"] + (f" (run {r['carried_from']['date'][:10]})" if "carried_from" in r else ""),
             fmt(r["ours_median_samples_per_s"], 1), fmt(r["torchrun_median_samples_per_s"], 1),
             f"**{r['ratio_ours_over_torchrun']:.3f}**", f"{r['paired_ratio_median']:.3f}",
             f"{r['median_cpu_ms_per_step']['ours']['rank']} / {r['median_cpu_ms_per_step']['torchrun']['rank']}",
             f"{r['median_cpu_ms_per_step']['ours']['support']} / {r['median_cpu_ms_per_step']['torchrun']['support']}",
             fmt(max(m["max_param_diff"] for m in r["torchrun"]))]
            for r in result["results"]]
    workers = result["results"][0].get("num_workers", 2)
    out = [f"Ours / torchrun steady-state samples/s, {workers} worker{'s' if workers > 1 else ''} a side (goal: at "
           f"least {result['goal_ratio']}):", "",
           table(["workload", "ours samples/s", "torchrun", "ratio of medians", "paired ratio",
                  "rank CPU ms/step, ours / torchrun", "support CPU ms/step, ours / torchrun",
                  "largest parameter difference"], rows), ""]
    out += cpu_by_piece(result)
    out += [f"- `{r['workload']}` ({len(r['ours'])} rounds, {r['steps']} steps, first {r['warmup_steps']} not "
            f"measured; load average {r['load_average_1_5_15_min']['before'][0]} before, "
            f"{r['load_average_1_5_15_min']['after'][0]} after): {params_line(r['job'])}" for r in result["results"]]
    out += [""] + [f"- {key}: {text}" for key, text in result.get("method", {}).items() if isinstance(text, str)]
    return out


def cpu_by_piece(result: dict) -> list[str]:
    """Where each side's CPU per step goes (medians over the rounds), where the run measured it by piece."""
    rows = []
    for r in result["results"]:
        for side in ("ours", "torchrun"):
            cpu = r["median_cpu_ms_per_step"][side]
            if cpu.get("training_thread") is None:
                continue
            pieces = ", ".join(f"{piece} {fmt(ms)}" for piece, ms in cpu["support_by_piece"].items() if ms)
            rows.append([r["workload"], side, fmt(cpu["training_thread"]), fmt(cpu["rank"] - cpu["training_thread"]),
                         fmt(cpu["training_thread_preemptions"]), pieces])
    if not rows:
        return []
    return ["Where the CPU goes, ms per step (medians over the rounds):", "",
            table(["workload", "side", "training threads", "ranks' other threads", "preemptions of a training "
                   "thread per step", "support processes"], rows), ""]


STEP_VARIANTS = {"peer": "the peer's step (torchrun side)", "steprunner": "our StepRunner",
                 "+vote": "+ the stop vote (what a worker runs)", "-norm": "ours with torch's clip_grad_norm_",
                 "-seed": "ours without the per-micro-batch RNG seed", "-loader": "ours with the peer's batches"}


def step_costs(result: dict) -> list[str]:
    ratios, medians = result["paired_ratio_to_peer"], result["median_us_per_step"]
    rows = [[STEP_VARIANTS.get(v, v), fmt(medians[v]["wall"] / 1000, 1), f"**{ratios[v]['wall']:.3f}**",
             f"{ratios[v]['thread_cpu']:.3f}", f"{ratios[v]['process_cpu']:.3f}"] for v in ratios]
    pieces = [[piece, fmt(us, 1)] for piece, us in result["piece_us_per_call"].items()]
    return [f"In {result.get('where', 'the same processes')}: median over {result['rounds']} rounds of "
            f"{result['steps']} steps of each variant's time per step against the peer's in the same round:", "",
            table(["variant", "median ms/step (wall)", "wall ratio", "thread CPU ratio", "process CPU ratio"], rows),
            "", "Per call, us:", "", table(["piece", "us"], pieces), "",
            f"Job: {params_line(result['job'])}.",
            "Measures: " + "; ".join(f"{k}: {v}" for k, v in result.get("measures", {}).items()) + "."]


def recovery(result: dict) -> list[str]:
    medians, goals, met = result["medians"], result["goals"], result["goals_met"]
    ours, ours2, peer, up = medians["ours_min1"], medians["ours_min2"], medians["ray_train"], medians["scale_up"]
    rows = [["ours, `min_workers` 1 (survivor goes on)", f"**{ours['recovery_s']:.2f}**", ours["steps_redone"],
             f"detected {ours['detected_s']:.3f}, generation formed {ours['generation_formed_s']:.3f}"],
            ["ours, `min_workers` 2 (a replacement must start)", f"{ours2['recovery_s']:.2f}", ours2["steps_redone"],
             f"detected {ours2['detected_s']:.3f}, waiting for the replacement {ours2['recover_s']:.2f}, "
             f"generation formed {ours2['generation_formed_s']:.2f}"]]
    if late := medians.get("ours_min2_late"):
        rows.append(["ours, `min_workers` 2, killed at the spare run's step (the replacement in a warm process)",
                     f"{late['recovery_s']:.2f}", late["steps_redone"],
                     f"detected {late['detected_s']:.3f}, waiting for the replacement {late['recover_s']:.2f}, "
                     f"generation formed {late['generation_formed_s']:.2f}"])
    if spare := medians.get("ours_spare"):
        rows.append(["ours, `min_workers` 2 + `spare_workers` 1 (the spare comes in)",
                     f"**{spare['recovery_s']:.2f}**", spare["steps_redone"],
                     f"detected {spare['detected_s']:.3f}, spare taken {spare['recover_s']:.3f}, "
                     f"generation formed (state handed to the spare) {spare['generation_formed_s']:.2f}"])
    rows.append(["Ray Train TorchTrainer", f"**{peer['recovery_s']:.2f}**", peer["steps_redone"],
                 f"train function restarted {peer['train_fn_restarted_s']:.2f}, "
                 f"resumed from step {peer['resumed_from']}"])
    out = [f"Kill to next step, median over the rounds: Ray Train / ours = "
           f"**{result['ray_train_over_ours_recovery']:.0f}x**.", "",
           table(["side", "recovery s", "steps redone", "breakdown, s"], rows), "",
           f"Scale-up (resources appear -> first step at 2 workers): **{up['scale_up_s']:.2f} s** = slot placed and "
           f"scaling check {up['slot_and_scaling_tick_s']:.2f} + new actor constructed {up['actor_construction_s']:.2f}"
           f" + step boundary {up['tick_and_step_boundary_s']:.3f} + generation formed {up['generation_formed_s']:.2f}"
           f" + first step {up['first_step_s']:.3f}."]
    out += recovery_spare_scale_up(result) + recovery_drain(result)
    phase_order = ("process_start_s", "setup_hook_imports_s", "to_constructor_s", "construct_worker_s",
                   "first_join_s", "total_s")
    for key, what in (("startup", "in a process started for it"), ("startup_warm", "in a warm process")):
        if phases := medians.get(key):
            out += ["", f"A worker's start-up {what}, s: " + ", ".join(
                f"{k.removesuffix('_s').replace('_', ' ')} {phases[k]:.2f}" for k in phase_order if k in phases) + "."]
    verdicts = {True: "met", False: "not met", None: "not measured"}
    out += ["", "Goals: " + ", ".join(f"{k} {v}: {verdicts[met.get(k)]}" for k, v in goals.items()) + ".",
            "", f"Job: {params_line(result['job'])}.", "",
            "Definitions:", ""] + [f"- {k}: {v}" for k, v in result.get("definitions", {}).items()]
    out += ["", "Ray Train facts the JSON records (paths in the installed ray package):", ""]
    out += [f"- {k}: {v}" for k, v in result.get("ray_train_facts", {}).items()]
    return out


def recovery_spare_scale_up(result: dict) -> list[str]:
    up, outcomes = result["medians"].get("scale_up_spare"), result.get("outcomes", {}).get("scale_up_spare", [])
    if up is None:
        return []
    if "scale_up_s" in up:
        parts = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.3f}" for k, v in up.items()
                          if k != "scale_up_s")
        return ["", f"Scale-up with `spare_workers` 1: **{up['scale_up_s']:.2f} s** ({parts})."]
    counted = ", ".join(f"{outcome} in {outcomes.count(outcome)} of {len(outcomes)} rounds"
                        for outcome in dict.fromkeys(outcomes))
    return ["", f"Scale-up with `spare_workers` 1: nothing to time ({counted}): the run trained at world size 2 "
                f"from step {up.get('world_size_2_at_step', 1):.0f}, before the blocker went (see "
                f"`scale_up_spare` below)."]


def recovery_drain(result: dict) -> list[str]:
    drain = result["medians"].get("drain")
    if not drain:
        return []
    return ["", f"Preemption notice (a drain; the Controller saw {drain['deadline_s']:.0f} s left of its deadline) "
                f"-> first step without the node: **{drain['notice_to_step_without_node_s']:.2f} s** = seen by the "
                f"Controller "
                f"{drain['noticed_s']:.3f} + step boundary {drain['step_boundary_s']:.3f} + generation formed "
                f"{drain['generation_formed_s']:.3f} + first step {drain['first_step_s']:.3f}; steps lost in the "
                f"worst round: **{result['drain_steps_lost_worst_round']}** (the drained event, the next generation "
                f"and the history agree), workers failed: {drain['workers_failed']:.0f}."]


def redundancy(result: dict) -> list[str]:
    medians, held, sides = result["medians"], result["bytes_per_rank"], result["job"]["sides"]
    rows = []
    for side, label in sides.items():
        if not medians.get(f"kill_{side}"):  # a side measured by its steady run only
            continue
        kill, sources = medians[f"kill_{side}"], result["state_sources"][side]
        rows.append([f"`{side}`: {label}", ", ".join(f"{s} x{sources.count(s)}" for s in dict.fromkeys(sources)),
                     result["worst_round"][side]["steps_lost"], f"{kill['steps_redone']:.0f}",
                     f"**{kill['time_lost_s']:.2f}**", f"detected {kill['detected_s']:.2f}, generation formed "
                     f"{kill['generation_formed_s']:.2f}, first step {kill['first_step_s']:.2f}, redo to step K "
                     f"{kill['redo_s']:.2f}", f"{kill['rejoin_time_lost_s']:.2f} (joined "
                     f"{kill['rejoin_joined_after_kill_s']:.1f} s after the kill)",
                     f"{kill['time_lost_with_rejoin_s']:.2f}"])
    speed = ", ".join(f"`{side}` {medians[f'steady_{side}']['samples_per_s']:,.0f}" for side in sides)
    over = "; ".join(f"{side} / r1 {r['samples_per_s']} (per-round pairs {r['samples_per_s_paired_median']})"
                     for side, r in result["over_r1_samples_per_s"].items())
    byte_rows = [[f"`{side}`", fmt(b["formula_bytes_per_parameter"]), fmt(b["max_bytes_per_parameter"], 3),
                  f"{b['max_over_formula']:.3f}", fmt(b["max_buddy_copies_bytes"] / held["parameters"], 2),
                  f"{b['buddy_copies_over_shard']:.2f}" if b["max_buddy_copies_bytes"] else "-"]
                 for side in sides if (b := held.get(side))]
    verdicts = {True: "met", False: "not met", None: "not measured"}
    goals = "; ".join(f"{group}: " + ", ".join(f"{k} {v}: {verdicts[result['goals_met'][group].get(k)]}"
                                               for k, v in goals.items()) for group, goals in result["goals"].items())
    return ["A worker SIGKILLed mid-interval (digits), medians over the rounds (steps lost: committed steps lost, "
            "worst round; time lost = back at step K - one step, s):", "",
            table(["side", "state after the kill", "steps lost", "steps redone", "time lost", "breakdown, s",
                   "replacement's rejoin, time lost", "time lost in all"], rows), "",
            f"Digits steady state at 4 workers, samples/s: {speed}; {over}.", "",
            f"Bytes per rank ({held['parameters']:,} parameters, fp32 AdamW, N=4; parameters + gradients + optimizer "
            "state against 16R/N, and the buddy copies' host bytes beside them):", "",
            table(["side", "formula 16R/N, B/param", "measured (largest rank)", "measured / formula",
                   "buddy copies, B/param (host)", "copies / the rank's shard"], byte_rows), "",
            *buddy_cost(result["buddy_cost"]), *timed_checkpoint(result.get("timed_checkpoint")), f"Goals: {goals}.",
            "", f"Job: {params_line(result['job'])}.", "",
            "Definitions:", ""] + [f"- {k}: {v}" for k, v in result.get("definitions", {}).items()]


def buddy_cost(cost: dict) -> list[str]:
    """The redundancy benchmark's GPT pair: the buddy copy on against off."""
    gpt, host = cost["medians"], cost["host_bytes"] or {}
    return [f"The buddy copy's cost on the GPT recipe (zero3, 4 workers of 0.5 CPU, replicas 1, no periodic "
            f"checkpoint): **{cost['paired_ratio_median']}x** samples/s with the copy against without (median of "
            f"the rounds' {cost['paired_ratios']}; of the medians {cost['ratio_of_medians']}): "
            f"{gpt['buddy']['samples_per_s']:,.1f} against {gpt['none']['samples_per_s']:,.1f}; the rank processes' "
            f"CPU {gpt['buddy']['rank_cpu_ms_per_step']:,.0f} against {gpt['none']['rank_cpu_ms_per_step']:,.0f} ms "
            f"per step. Host bytes of the copies: {host.get('max_buddy_copies_bytes', 0):,} on the largest rank, "
            f"**{host.get('max_over_shard')}x** its shard ({host.get('shard_bytes_of_that_rank', 0):,} bytes of "
            "parameters and optimizer state).", ""]


def copy_cost(result: dict) -> list[str]:
    """The buddy copy on against off in the same 4 processes, alternating blocks of steps."""
    job, cpu, spread = result["job"], result["rank_cpu_ms_per_step"], result["paired_ratio_spread"]
    quartiles, host = result["paired_ratio_quartiles"], result["host_bytes_rank0"]
    goal = result["goals"]["copy_over_none_samples_per_s_at_least"]
    verdict = "met" if spread[0] >= goal else "not met" if spread[1] < goal else "not resolved: the spread straddles it"
    return [f"The buddy copy's cost on the GPT recipe ({job['gpt']}; {job['ranks']} gloo ranks, blocks of "
            f"{job['steps_per_block']} steps alternating over {job['rounds']} rounds): "
            f"**{result['paired_ratio_median']}x** samples/s with the copy against without (median of the rounds' "
            f"pairs; spread {spread[0]}-{spread[1]}, quartiles {quartiles[0]}-{quartiles[1]}; goal at least "
            f"{goal}: {verdict}). The rank processes' CPU {cpu['copy']:,.0f} against "
            f"{cpu['none']:,.0f} ms per step (median per-round ratio {result['cpu_ratio_median']}); host bytes of "
            f"the copies on rank 0: {host:,}, {host / result['shard_bytes_rank0']:.1f}x its packed shard.",
            ""] + [f"- {k}: {v}" for k, v in result.get("definitions", {}).items()]


def timed_checkpoint(timed: dict | None) -> list[str]:
    """The redundancy benchmark's timed side: what the default time-based checkpoint costs a run."""
    if not timed or timed.get("excess_s_per_save") is None:
        return []
    second = timed["second_copy_cost_fraction"]
    return [f"The default time-based checkpoint (checkpoint.every_minutes {timed['default_every_minutes']:g}), "
            f"measured with the period shortened: each save (in the background, {timed['save_duration_s']:.2f} s) "
            f"cost the steps trained meanwhile **{timed['excess_s_per_save']:.3f} s** (saves per run "
            f"{timed['saves_per_run']}; samples/s timed / buddy "
            f"{timed['timed_over_buddy_samples_per_s_paired_median']}): **{timed['default_cost_fraction']:.4%}** of a "
            f"run's time at the default period"
            + (f", against {second:.1%} of every step for a second buddy copy (one copy's cost on the GPT pair)."
               if second is not None else "."), ""]


def balance(result: dict) -> list[str]:
    out = []
    for r in result["results"]:
        out += balance_at(r, result["goals"]) + [""]
    verdicts = {True: "met", False: "not met", None: "not measured"}
    met = "; ".join(f"{workers.replace('_', ' ')}: " + ", ".join(f"{goal} {verdicts[ok]}" for goal, ok in goals.items())
                    for workers, goals in result["goals_met"].items())
    out += [f"Goals: {met}.", "", f"Job: {params_line(result['job'])}.", "", "Definitions:", ""]
    return out + [f"- {k}: {v}" for k, v in result.get("definitions", {}).items()]


def balance_at(r: dict, goals: dict) -> list[str]:
    """One worker count of the balance benchmark."""
    ratios, paired, shares = r["ratios_of_medians"], r["paired_ratios"], r["balanced_throttled_run_medians"]
    rounds = len(r["runs"]["ours_auto_throttled"])
    other = {side: statistics.median(run["other_cpu_ms_per_step"] for run in runs) for side, runs in r["runs"].items()}
    rows = [[side.replace("_", " "), fmt(value, 1), fmt(max(0.0, other[side]), 1)]  # < 0: sampling error
            for side, value in r["median_samples_per_s"].items()]
    return [f"{r['workers']} workers, rank {r['throttled_rank']} throttled 2x where throttled ({rounds} rounds, "
            f"{r['steps']} steps, the first {r['warmup_steps']} not measured):", "",
            table(["side", "samples/s, median", "other processes' CPU, ms/step, median"], rows), "",
            f"- balance auto / off, throttled: **{ratios['auto_over_off_throttled']:.2f}x** (ideal "
            f"{r['ideal_gain']:.2f}, goal {r['throttled_goal']}; per round "
            f"{', '.join(map(str, paired['auto_over_off_throttled']))}); the balanced throttled run keeps "
            f"{ratios.get('auto_throttled_over_off_unthrottled', float('nan')):.2f} of the unthrottled equal split's "
            f"samples/s",
            f"- balance auto / off, unthrottled: **{ratios['auto_over_off_unthrottled']:.2f}x** (goal "
            f"{goals['auto_over_off_unthrottled_at_least']}; per round "
            f"{', '.join(map(str, paired['auto_over_off_unthrottled']))}; shares changed "
            f"{', '.join(map(str, r['unthrottled_auto_share_changes']))} times)",
            f"- ours (auto) / torchrun, throttled: **{ratios['ours_auto_over_torchrun_throttled']:.2f}x**; "
            f"ours (off) / torchrun: {ratios['ours_off_over_torchrun_throttled']:.2f}x",
            f"- the balanced throttled runs, medians: the throttled rank's share / the others' ends at "
            f"{shares['final_share_ratio']:.2f}; within 10% of that from step {shares['first_step_within_10pct']:.0f} "
            f"({shares['first_within_after_s']:.1f} s), for good from step {shares['settled_from_step']:.0f} "
            f"({shares['settled_after_s']:.1f} s); {shares['share_changes']:.0f} changes; longest / shortest rank "
            f"compute in a step {shares['steady_compute_imbalance']:.2f}"]


def memory(result: dict) -> list[str]:
    params = result["model"]["parameters"]
    rows = []
    for r in result["results"]:
        ranks = r["ranks"]
        buckets = ranks[0].get("ddp_buckets")
        rows.append([r["strategy"], r["world_size"], fmt(r["formula_bytes_per_parameter"]),
                     fmt(max(k["resident_bytes_per_parameter"] for k in ranks), 2),
                     fmt(max(k["peak_bytes_per_parameter"] for k in ranks), 2), r["compared"],
                     f"{r['worst_deviation']:.1%}", fmt(buckets / params, 2) if buckets else "-"])
    return [f"Bytes per parameter on each rank, {params:,}-parameter GPT ({params_line(result['model'])}), "
            f"{result['optimizer']}; goal: within {result['goal_max_deviation']:.0%} of the ZeRO paper's formula:", "",
            table(["strategy", "N", "formula", "resident", "peak", "compared", "worst deviation",
                   "+ DDP buckets"], rows), "", "Definitions:", ""] + [
        f"- {k}: {v}" for k, v in result.get("definitions", {}).items()]


def checkpoint(result: dict) -> list[str]:
    rows = []
    for r in result["save_load"]:
        m = r["medians"]
        rows.append([r["world_size"], f"{r['dcp_bytes'] / 1e6:,.0f}", f"**{m['dcp_save_s']:.2f}**",
                     f"{m['torch_save_s']:.2f}", f"{m['dcp_load_s']:.2f}",
                     f"{m['dcp_resharded_load_s']:.2f} (from {r['resharded_load']['from_world_size']})",
                     f"{m['torch_load_s']:.2f}"])
    a = result["async_save"]
    # The JSON keeps the script's docstring: its first paragraph is the title, its last sentence says how long it runs.
    method = result.get("definitions", "").split("\n\n", 1)[-1].split("Run from the repository root")[0].strip()
    return ["Sharded DCP save and load against rank-0 `torch.save`, zero3, medians, s:", "",
            table(["N", "MB", "DCP save", "torch.save (gather + write)", "DCP load", "DCP load, resharded",
                   "torch.load + scatter"], rows), "",
            f"Async save ({a['model']['parameters']:,}-parameter GPT, N={a['world_size']}, global batch "
            f"{a['global_batch_size']}, a save after step {a['save_after_step']} of each {a['period_steps']}-step "
            f"period): the training thread is blocked **{a['median_save_call_s']['async']:.2f} s** against "
            f"{a['median_save_call_s']['sync']:.2f} s for a sync save ({a['blocking_overhead']['async']:.1%} / "
            f"{a['blocking_overhead']['sync']:.1%} of a period's step time); counting the background writer's CPU, "
            f"a period costs +{a['step_time_overhead']['async']:.1%} (async) / +{a['step_time_overhead']['sync']:.1%} "
            f"(sync). Goal: async save under {result['goal_async_overhead_below']:.0%}: "
            f"{'met' if a['async_meets_goal'] else 'not met'}.", "", "Method:", "", *method.splitlines()]


def communication(result: dict) -> list[str]:
    rows = [[r["option"], r["world_size"], f"**{r['bytes_ratio']:.1f}**" + (f" ({r['bytes_goal']:g})"
                                                                         if r["bytes_goal"] else ""),
             f"{r['wire_ratio_estimate']:.1f}", f"{r['loss_ratio']:.3f}", f"{r['samples_per_s_ratio']:.2f}",
             f"{r['exposed_comm_share']:.0%}"] for r in result["relative_to_uncompressed"]]
    bucket = result["bucket_size_vs_throughput"]
    bucket_rows = [[b["bucket_cap_mb"], b["samples_per_s"], f"{b['exposed_comm_share']:.0%}"] for b in bucket["rows"]]
    setup = {k: v for k, v in result["setup"].items() if not isinstance(v, str) or len(v) < 80}
    notes = [f"- {k}: {v}" for k, v in result["setup"].items() if isinstance(v, str) and len(v) >= 80]
    return [f"Relative to uncompressed DDP (goals: bytes as in brackets, loss within "
            f"{result['goals']['loss_ratio_within']:.0%}):", "",
            table(["option", "N", "bytes ratio (goal)", "wire ratio, estimated", "loss vs none",
                   "samples/s vs none", "exposed comm share"], rows), "",
            f"Bucket size at {bucket['world_size']} workers, `{bucket['option']}`:", "",
            table(["bucket_cap_mb", "samples/s", "exposed comm share"], bucket_rows), "",
            f"Setup: {params_line(setup)}.", "", *notes, *([f"- {result['machine']['note']}"]
                                                          if "note" in result.get("machine", {}) else [])]


def slow_links(result: dict) -> list[str]:
    summary, verdicts = result["summary"], {True: "met", False: "not met", None: "not measured"}
    rounds = len(next(iter(result["runs"].values())))

    def seconds(value: float | None) -> str:
        return "never" if value is None else fmt(value, 1)

    rows = [[name, f"{seconds(s['time_to_target_s'])}", "-" if s["time_over_baseline"] is None
             else f"**{s['time_over_baseline']:.2f}x** {s['baseline']}", fmt(s["steps_to_target"]),
             fmt(s["bytes_per_sample"] / 1e3, 1), f"**{s['bytes_fewer_than_baseline']:.1f}x**",
             f"{s['median_step_s'] * 1000:.0f} ({s['link_delay_s_per_step'] * 1000:.0f})",
             fmt(s["eval_loss"], 3), f"{s['accuracy']:.1%}"] for name, s in summary.items()]
    goals = ", ".join(f"{goal} {value}: {verdicts[result['goals_met'].get(goal)]}"
                      for goal, value in result["goals"].items())
    return [f"Emulated link {result['job']['link']}; target: {result['definitions']['target_loss']} = "
            f"**{result['target_loss']:.4f}**; medians over {rounds} rounds:", "",
            table(["side", "time to target, s", "time vs baseline", "steps to target", "kB sent per sample",
                   "bytes fewer than baseline", "step ms (link delay ms)", "eval loss", "accuracy"], rows), "",
            f"Goals: {goals}.", "", f"Job: {params_line({k: v for k, v in result['job'].items() if k != 'sides'})}.",
            "", "Definitions:", ""] + [f"- {k}: {v}" for k, v in result.get("definitions", {}).items()]


def model_parallel(result: dict) -> list[str]:
    def ratios(by_kind: dict[str, float]) -> str:
        return ", ".join(f"{by_kind[kind]:.2f}" for kind in ("parameters", "gradients", "optimizer"))

    rows = [[r["layout"], fmt(statistics.median(m["samples_per_s"] for m in r["ours"]), 1),
             fmt(statistics.median(m["samples_per_s"] for m in r["torchrun"]), 1),
             f"**{r['ratio_ours_over_torchrun']:.3f}**", ratios(r["memory_over_formula"]),
             ratios(r["mean_memory_over_formula"]) if "mean_memory_over_formula" in r else "-"]
            for r in result["results"]]
    first = result["results"][0]
    return [f"Ours / a torchrun script of the same torch APIs, steady-state samples/s, {result['num_workers']} "
            f"workers (goal: at least {result['goal_ratio']}), and memory over the formula (the largest rank's, the "
            "ranks' mean):", "",
            table(["layout", "ours samples/s", "torchrun", "ratio of medians",
                   "largest rank / formula (parameters, gradients, optimizer)", "mean / formula"], rows), "",
            f"{len(first['ours'])} rounds per layout, {first['steps']} steps, "
            f"global batch {first['global_batch_size']}."]


def model_parallel_recovery(result: dict) -> list[str]:
    breakdown = ("detected_s", "to_forming_s", "forming_s", "first_step_s")
    rows = [[r["layout"], way, fmt(summary.get("recovery_s"), 2),
             " / ".join(fmt(summary[key], 2) for key in breakdown) if "forming_s" in summary else "-",
             fmt(summary.get("steps_redone"), 1),
             fmt(summary.get("after_over_before"), 3),
             ", ".join(str(run.get("state_source")) for run in r["runs"][way]),
             ", ".join(f"{run['moved_bytes']} / {run['lost_rank_bytes']}" for run in r["runs"][way]
                       if run.get("moved_bytes") is not None)]
            for r in result["results"] for way, summary in r["summary"].items()]
    first = result["results"][0]
    return [f"One of {result['num_workers']} workers (rank {first['killed_rank']}) SIGKILLed before step "
            f"{first['kill_step']} of {first['steps']}; medians over {len(next(iter(first['runs'].values())))} "
            "rounds (goals: under 1 s from the kill to the next step, at most 1 step redone, samples/s after the "
            "loss at least (N-1)/N of before, bytes moved no more than the lost rank's part):", "",
            table(["layout", "way", "kill -> next step (s)", "of it: heard / to forming / forming / first step (s)",
                   "steps redone", "samples/s after / before",
                   "state from", "bytes moved / lost rank's part"], rows)]


def control_plane(result: dict) -> list[str]:
    rows = [[n, fmt(row["poll_ms_median"]), fmt(row["poll_ms_max"]), fmt(row["failure_ms"]),
             fmt(row["formation_ms_median"]), fmt(row["resize_ms_max"]), fmt(row["peak_mb"], 2)]
            for n, row in result["by_workers"].items()]
    exponents = ", ".join(f"{key} {value}" for key, value in result["growth_exponent_last_two"].items())
    return [f"The Controller's milliseconds over the fake group, {result['steps']} steps with a failure, a scale-up "
            f"and a drain (goal: under {fmt(result['goal_ms'])} ms each at the largest size, growing no faster than "
            f"N log N). Growth exponents between the two largest sizes: {exponents}; goal met: "
            f"{fmt(result['meets_goal'])}.", "",
            table(["workers", "poll, median", "poll, max", "a failure's decisions", "a formation, median",
                   "a resize, max", "peak MB"], rows)]


def control_plane_real(result: dict) -> list[str]:
    rows = [[n, fmt(row["formation_s"]), fmt(row["rendezvous_calls"]), fmt(row["recovery_s"]),
             " / ".join(fmt(row[key]) for key in ("detected_s", "to_forming_s", "forming_s", "first_step_s")),
             fmt(row["step_ms"]), fmt(row["support_cpu_ms_per_step"]), fmt(row["support_cpu_ms_per_step_per_worker"])]
            for n, row in result["by_workers"].items()]
    return [f"Real worker processes on {result['logical_cpus']} logical CPUs, rank 1 killed before step "
            f"{result['kill_step']} of {result['steps']}, global batch {result['global_batch_size']}; support CPU "
            f"over steps {result['steady_from_step']}-{result['kill_step'] - 1}. Recovery at the largest size over "
            f"the smallest: {fmt(result['recovery_largest_over_smallest'])} (goal at most "
            f"{fmt(result['recovery_goal_ratio'])}); support CPU per step per worker, largest over smallest: "
            f"{fmt(result['support_per_worker_largest_over_smallest'])} (goal at most 1); the rendezvous calls' growth "
            f"exponent: {fmt(result['rendezvous_calls_growth_exponent'])}.", "",
            table(["workers", "first generation formed (s)", "rendezvous calls", "kill -> next step (s)",
                   "of it: heard / to forming / forming / first step (s)", "step (ms)", "support CPU (ms/step)",
                   "per worker"], rows)]


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    "throughput": throughput, "throughput_same_allocator": throughput,
    "throughput_same_allocator_1_worker": throughput, "step_costs": step_costs,
    "step_costs_ray": step_costs, "recovery": recovery,
    "redundancy": redundancy, "copy_cost": copy_cost, "balance": balance,
    "memory": memory, "checkpoint": checkpoint, "communication": communication, "slow_links": slow_links,
    "model_parallel": model_parallel, "model_parallel_recovery": model_parallel_recovery,
    "control_plane": control_plane, "control_plane_real": control_plane_real}
