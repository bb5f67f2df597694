"""Section 5 of the device check, ``profile_sim``: ``pagedkv profile``'s ``measure`` on the engine
section's model writes a cost profile (beside --output), and the simulator replays the engine
section's eager run on it; measured against predicted seconds."""

from __future__ import annotations

from pathlib import Path

from gpu_check_engine import engine_model, engine_workload, pagedkv_throughput
from gpu_check_run import Run
from pagedkv.engine import EngineConfig

# -- 5. profile + simulator -----------------------------------------------------------------------


def check_profile_sim(run: Run) -> dict:
    """Fit a cost profile on the engine model, predict section 4's eager run with it."""
    from pagedkv.commands.profile import measure
    from pagedkv.engine.profiling import ProfilePlan
    from pagedkv.kvcache.policies import get_policy
    from pagedkv.sched import SchedulerConfig
    from pagedkv.sim.costs.profiled import read_cost_profile
    from pagedkv.sim.simulator import Simulation
    from pagedkv.traces import FreshSegments, TraceRequest

    loaded = run.state.get("engine_loaded") or engine_model(run)[0]
    if "engine_run" not in run.state:  # section 4 did not run it: measure it here
        pagedkv_throughput(run, loaded, *engine_workload(run, loaded[0].vocab_size), False)
    measured = run.state["engine_run"]
    base = EngineConfig(device=str(loaded[1].device), dtype="bfloat16",
                        attention_backend="triton", log_startup=False)  # fmt: skip
    profile = measure(base, ProfilePlan(**run.sizes.profile_plan), None, run.args.seed, False,
                      "wall", loaded)  # fmt: skip
    path = Path(run.args.output).with_suffix(".cost_profile.json")
    profile.write(path)  # what `pagedkv simulate --cost-profile` reads, read back the same way
    config, fresh = measured["config"], FreshSegments()
    requests = [TraceRequest(0.0, fresh.take(len(p)), n)
                for p, n in zip(measured["ids"], measured["outs"], strict=True)]  # fmt: skip
    scheduler = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.max_num_batched_tokens,
                                max_model_len=measured["max_model_len"],
                                preemption=config.preemption)  # fmt: skip
    # The engine's usable blocks + the null block, as build_parts gives its allocator.
    slots = (measured["num_blocks"] + 1) * measured["block_size"]
    sim = Simulation(requests, get_policy(config.policy), slots, scheduler,
                     read_cost_profile(path).cost_model()).run()  # fmt: skip
    return {"profile_path": str(path), "profile": profile.describe(),
            "fit_rms_rel_error": profile.fit.rms_rel_error, "fit_samples": profile.fit.num_samples,
            "measured_s": measured["seconds"], "predicted_s": sim.duration_s,
            "rel_error": sim.duration_s / measured["seconds"] - 1,
            "steps": {"engine": measured["row"]["steps"], "simulator": sim.num_steps},
            "preemptions": {"engine": measured["row"]["preemptions"],
                            "simulator": sim.preemptions}}  # fmt: skip
