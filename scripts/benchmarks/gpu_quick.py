"""The GPU check's quick plan (scripts/gpu_check.py --quick): the speed, resume and profile figures of one lent GPU in
at most 8 minutes, every row written to the report as soon as it is measured.

Items, in order of what matters most when time runs out (`--only` picks some by name):
  tests                     pytest -m cuda (model parity, chunked loss, document mask, greedy generate = full forward)
  m3_seq340_eager ...       20 steps of minimind-3 (h768 L8) at seq 340 and 1024, bf16, eager and torch.compile:
                            target tokens/s, MFU against the card's dense bf16 peak (and the measured matmul rate),
                            peak memory
  moe4_top1_seq1024_eager   4 experts top-1 (each expert the dense MLP's width: the dense model's active parameters)
  h768x16_seq2048_compile   h768 L16 at seq 2048 compiled, the issue's >= 50% MFU goal, with a profile of two extra
                            steps after the measured ones: the top 15 kernels; then the same with --doc_mask 0
  kill_resume               SIGKILL after step 2 (tests/helpers/fault_entry.py, as fault tests do), --from_resume 1 to
                            step 4: the losses of steps 3-4 equal a straight 4-step run's
"""
import glob
import json
import os

from scripts.benchmarks.run import step_stats

M3 = dict(hidden_size=768, num_hidden_layers=8, dtype="bfloat16", accumulation_steps=1, packing=1)
DEEP = dict(M3, num_hidden_layers=16, max_seq_len=2048, batch_size=8, use_compile=1)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, accumulation_steps=1,
            packing=1, max_seq_len=64, batch_size=2)
TOP_KERNELS = 15


def speed_plan(dry_run):
    """[(name, trainer flags, profile?)]: the issue's configs in priority order (tiny shapes in the dry run)."""
    if dry_run:
        return [("m3_seq340_eager", dict(TINY, dtype="float32"), False),
                ("h768x16_seq2048_compile", dict(TINY, dtype="float32"), True)]
    m340, m1024 = dict(M3, max_seq_len=340, batch_size=64), dict(M3, max_seq_len=1024, batch_size=24)
    return [("m3_seq340_eager", m340, False),
            ("m3_seq1024_eager", m1024, False),
            ("moe4_top1_seq1024_eager", dict(m1024, use_moe=1, num_experts=4, num_experts_per_tok=1), False),
            ("h768x16_seq2048_compile", DEEP, True),
            ("h768x16_seq2048_compile_doc_mask0", dict(DEEP, doc_mask=0), False),
            ("m3_seq340_compile", dict(m340, use_compile=1), False),
            ("m3_seq1024_compile", dict(m1024, use_compile=1), False)]


def top_kernels(trace_path, n=TOP_KERNELS):
    """[(name, calls, total ms, share of all kernel time)] of a torch.profiler Chrome trace: CUDA kernels where the
    trace has them, else (a CPU trace) the operators' inclusive times, the top `n` by total time."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kind = "kernel" if any(e.get("cat") == "kernel" for e in events) else "cpu_op"
    totals = {}
    for e in events:
        if e.get("cat") == kind:
            calls, dur = totals.get(e["name"], (0, 0.0))
            totals[e["name"]] = (calls + 1, dur + e["dur"])
    whole = sum(dur for _, dur in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda item: -item[1][1])[:n]
    return kind, [(name[:90], calls, dur / 1e3, dur / whole) for name, (calls, dur) in rows]


def speed_run(ctx, name, flags, profile):
    """warm-up + measured steps of train_pretrain.py with `flags` (+ two profiled steps after them when `profile`):
    the statistics of the measured steps (scripts/bench.py's), and the top kernels of the profiled ones."""
    warmup, steps = (1, 2) if ctx.dry_run else (5, 15)
    folder = ctx.fresh_folder(ctx, name)
    measured_last = warmup + steps
    run_flags = dict(data_path=ctx.data["pretrain"], max_steps=measured_last + (2 if profile else 0), log_interval=1,
                     save_interval=10 ** 9, epochs=1000, save_dir=os.path.join(folder, "out"),
                     checkpoint_dir=os.path.join(folder, "ckpt"), metrics_file=os.path.join(folder, "metrics.jsonl"),
                     cache_dir=ctx.cache_dir, device=ctx.device, **flags)
    if profile:
        run_flags["profile_steps"] = f"{measured_last + 1}:{measured_last + 2}"
    code, seconds, tail = ctx.run(ctx.trainer_argv("train_pretrain.py", run_flags), folder + ".log", ctx.timeout)
    records = [r for r in ctx.read_metrics(run_flags["metrics_file"]) if "loss" in r]
    row = dict(name=name, dtype=flags["dtype"], seconds=seconds, exit=code, config=flags, warmup=warmup, steps=steps)
    checks = {"exit 0": code == 0, f"{run_flags['max_steps']} step records": len(records) == run_flags["max_steps"]}
    if checks[f"{run_flags['max_steps']} step records"]:
        stats = step_stats([r for r in records if r["step"] <= measured_last], warmup)
        row.update({k: stats[k] for k in ("tokens_per_sec", "mfu", "peak_mem_gb", "step_time_median",
                                          "final_loss")})
        if ctx.matmul_peak and row["mfu"] is not None:  # the trainer's MFU is against the datasheet's dense peak
            row["mfu_vs_measured_matmul"] = row["mfu"] * ctx.table_peak / ctx.matmul_peak
    if profile:
        traces = sorted(glob.glob(os.path.join(folder, "out", "profile", "rank0.*.pt.trace.json")))
        checks["trace written"] = bool(traces)
        if traces:
            row["kernel_kind"], row["top_kernels"] = top_kernels(traces[-1])
    row.update(checks=checks, ok=all(checks.values()), log_tail=None if all(checks.values()) else tail)
    return row


def kill_resume(ctx):
    """A straight 4-step fp32 run; the same run SIGKILLed right after step 2 (saved every step), resumed with
    --from_resume 1 to step 4: steps 3 and 4 of the resumed run equal the straight run's (CPU exactly; CUDA within
    1e-3 relative, since TF32 and atomics in some backward kernels are not bit-reproducible)."""
    model = TINY if ctx.dry_run else dict(M3, max_seq_len=340, batch_size=8)
    flags = dict(model, dtype="float32", data_path=ctx.data["pretrain"], max_steps=4, log_interval=1, save_interval=1,
                 cache_dir=ctx.cache_dir, device=ctx.device)
    rows = {}
    for name, env in (("kill_straight", {}), ("kill_part", {"MINIMIND_TEST_STAGE": "train_pretrain",
                                                            "MINIMIND_TEST_KILL_AT_STEP": "2"})):
        folder = ctx.fresh_folder(ctx, name)
        run_flags = dict(flags, save_dir=os.path.join(folder, "out"), checkpoint_dir=os.path.join(folder, "ckpt"),
                         metrics_file=os.path.join(folder, "metrics.jsonl"))
        script = os.path.join("..", "tests", "helpers", "fault_entry.py") if env else "train_pretrain.py"
        rows[name] = (ctx.run(ctx.trainer_argv(script, run_flags), folder + ".log", ctx.timeout, env), run_flags)
    (code, _, tail), run_flags = rows["kill_part"]
    resumed = ctx.run(ctx.trainer_argv("train_pretrain.py", dict(run_flags, from_resume=1)),
                      os.path.join(ctx.out, "runs", "kill_resumed.log"), ctx.timeout)
    straight = {r["step"]: r["loss"] for r in ctx.read_metrics(rows["kill_straight"][1]["metrics_file"]) if "loss" in r}
    after = {r["step"]: r["loss"] for r in ctx.read_metrics(run_flags["metrics_file"]) if "loss" in r}
    tolerance = 1e-3 if ctx.device.startswith("cuda") else 0.0
    equal = sorted(straight) == sorted(after) == [1, 2, 3, 4] and all(
        abs(straight[s] - after[s]) <= tolerance * abs(straight[s]) for s in (3, 4))
    checks = {"straight run exit 0": rows["kill_straight"][0][0] == 0, "killed at step 2": code not in (0, "timeout"),
              "resumed exit 0": resumed[0] == 0, f"steps 3-4 equal the straight run (rel {tolerance})": equal}
    return dict(name="kill_resume", dtype="float32", seconds=rows["kill_straight"][0][1] + rows["kill_part"][0][1]
                + resumed[1], exit=resumed[0], straight_losses=[straight.get(s) for s in (1, 2, 3, 4)],
                losses=[after.get(s) for s in (1, 2, 3, 4)], checks=checks, ok=all(checks.values()),
                log_tail=None if all(checks.values()) else (resumed[2] or tail))


def quick_items(ctx, section_tests):
    """[(name, fn() -> row)] in priority order; the dry run leaves out the cuda tests (the suite runs them)."""
    items = [] if ctx.dry_run else [("tests", lambda: section_tests(ctx)[0])]
    items += [(name, lambda n=name, f=flags, p=profile: speed_run(ctx, n, f, p))
              for name, flags, profile in speed_plan(ctx.dry_run)]
    # the resume check before the compiled m3 rows: a failed resume is worth more than two more speed rows
    items.insert(len(items) - (0 if ctx.dry_run else 2), ("kill_resume", lambda: kill_resume(ctx)))
    return items


def quick_markdown(rows):
    """The speed table (one line a config) and the top kernels of the profiled one."""
    lines = ["| config | ok | target tokens/s | MFU (dense bf16 peak) | MFU (measured matmul) | peak GiB | step s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    fmt = {"tokens_per_sec": "{:.0f}", "mfu": "{:.1%}", "mfu_vs_measured_matmul": "{:.1%}", "peak_mem_gb": "{:.2f}",
           "step_time_median": "{:.3f}"}
    for row in rows:
        cells = [fmt[k].format(row[k]) if isinstance(row.get(k), (int, float)) else "" for k in fmt]
        lines.append(f"| {row['name']} | {'yes' if row['ok'] else '**NO**'} | " + " | ".join(cells) + " |")
    for row in rows:
        if row.get("top_kernels"):
            lines += ["", f"Top {len(row['top_kernels'])} {row['kernel_kind']}s of {row['name']} (2 profiled steps):",
                      "", "| kernel | calls | ms | share |", "| --- | --- | --- | --- |"]
            lines += [f"| `{name}` | {calls} | {ms:.2f} | {share:.1%} |"
                      for name, calls, ms, share in row["top_kernels"]]
    return "\n".join(lines) + "\n"
