"""What the benchmark commands share: running the real trainer, its default model and the figures of its step records
(run.py), the machine line (machine.py), the MoE layer and MoE-vs-dense benches (moe.py, moe_dense.py), the
per-step time shares (step_shares.py), the GPU check's quick plan (gpu_quick.py), the stock datatrove peer of the
curation (stock_curate.py). The commands are scripts/bench.py, scripts/bench_loader.py, scripts/bench_doc_mask.py,
scripts/bench_rollout.py, scripts/bench_curate.py, scripts/quality.py, scripts/step_profile.py and
scripts/gpu_check.py."""
