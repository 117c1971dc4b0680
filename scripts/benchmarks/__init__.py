"""What the benchmark commands share: running the real trainer and its default model (run.py), the machine line
(machine.py), the MoE layer and MoE-vs-dense benches (moe.py, moe_dense.py). The commands are scripts/bench.py,
scripts/bench_loader.py, scripts/bench_doc_mask.py, scripts/bench_rollout.py and scripts/quality.py."""
