"""One command that exercises and measures every CUDA path on a lent GPU, and writes one report.

    python scripts/gpu_check.py --out gpu_report              # one CUDA GPU, the repository, no network: < 9 min
    python scripts/gpu_check.py --dry_run --out /tmp/check    # the same plan on CPU with tiny shapes (CI runs it)
    python scripts/gpu_check.py --sections attention,bench    # a part of the plan
    python scripts/gpu_check.py --quick --out $OUT            # the 8-minute plan, written row by row; --only NAME,...
                                                              # reruns some rows (scripts/benchmarks/gpu_quick.py)

Sections, in order:
  tests      pytest -m cuda: the tests that take the GPU when there is one (model parity, chunked loss, masks, resume)
  smoke      short real runs of the trainer scripts: bf16, doc mask on/off, compile, MoE fp16 + grad checkpointing
             (each row named by the dtype it ran in: the CPU dry run trains bf16 only where the CPU has it),
             torchrun with one process (NCCL), async save, profiler, eval, SFT, and resume equal to a straight run
  attention  SDPA causal, SDPA with a dense document mask, FlexAttention with a document block mask: fwd+bwd time
             and peak memory at B16 x L2048 (GQA 8/4 heads of 96)
  bench      scripts/bench.py on the GPU-truth configs (minimind-3 at seq 340/1024, h768 x 16 layers at 2048 with
             compile, doc mask on/off, MoE against dense)
The data is generated (Python's own documentation and the demo's tool/reasoning chats): no download, no
chatterbot-corpus. The report is <out>/gpu_check.json and <out>/gpu_check.md.
"""
import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dataset.demo.records import pydoc_topic_texts, reasoning_records, stdlib_docstrings, tool_records  # noqa: E402
from model.torch_compat import cpu_bf16_native  # noqa: E402
from scripts.benchmarks.gpu_quick import quick_items, quick_markdown  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("tests", "smoke", "attention", "bench")
# the model every smoke run trains: minimind-3's shape on the GPU, a tiny one in the dry run
GPU_MODEL = dict(hidden_size=768, num_hidden_layers=8, max_seq_len=340, batch_size=8, accumulation_steps=2)
DRY_TEXTS = 400  # pretraining rows of the dry run
DRY_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_seq_len=64,
                 batch_size=2, accumulation_steps=2)


# ---------------------------------------------------------------------------------------------- data
def write_data(data_dir, dry_run):
    """{"text"} pretraining rows and SFT conversations generated from local material; returns both paths."""
    os.makedirs(data_dir, exist_ok=True)
    topics = pydoc_topic_texts()
    texts = topics + stdlib_docstrings(limit=max(0, DRY_TEXTS - len(topics)) if dry_run else None)
    texts = texts[:DRY_TEXTS] if dry_run else texts
    sft = tool_records() + reasoning_records()
    paths = {}
    for name, rows in (("pretrain", [{"text": t} for t in texts]), ("sft", sft)):
        paths[name] = os.path.join(data_dir, f"{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return paths


# ---------------------------------------------------------------------------------------------- runs
def run(argv, log_path, timeout, env=None):
    """Run argv from the repo root (`env` added to the environment); (exit code, seconds, log tail)."""
    start = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        try:
            code = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  env=dict(os.environ, **(env or {}))).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    with open(log_path, errors="replace") as log:
        tail = log.read()[-1500:]
    return code, round(time.time() - start, 1), tail


def trainer_argv(script, flags, torchrun=False):
    argv = [sys.executable]
    if torchrun:
        argv += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    argv.append(os.path.join(ROOT, "trainer", script))
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    return argv


def read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def smoke_plan(ctx):
    """[(name, script, extra flags, torchrun)]: each CUDA path a user takes, once. A row's name says the dtype it
    trains in (the dry run: bf16 where the CPU has it natively, else fp32; fp16 is refused on CPU)."""
    half = "float32" if ctx.dry_run else "float16"
    # the dry run leaves out compile (a minute of C++ builds on 2 cores; tests/test_perf.py compiles blocks on CPU)
    compiled = [] if ctx.dry_run else [("compile", "train_pretrain.py", dict(dtype=ctx.dtype, use_compile=1), False)]
    return compiled + [
        (SHORT[ctx.dtype], "train_pretrain.py", dict(dtype=ctx.dtype), False),
        ("doc_mask_off", "train_pretrain.py", dict(dtype=ctx.dtype, doc_mask=0), False),
        (f"moe_{SHORT[half]}_grad_ckpt", "train_pretrain.py", dict(dtype=half, use_moe=1, grad_checkpointing=1), False),
        ("torchrun_1", "train_pretrain.py", dict(dtype=ctx.dtype), True),
        ("async_save", "train_pretrain.py", dict(dtype=ctx.dtype, async_save=1, save_interval=2), False),
        ("profiler", "train_pretrain.py", dict(dtype=ctx.dtype, profile_steps="2:3"), False),
        ("eval", "train_pretrain.py", dict(dtype=ctx.dtype, eval_data_path=ctx.data["pretrain"], eval_batches=2),
         False),
        ("sft", "train_sft.py", dict(dtype=ctx.dtype, data_path=ctx.data["sft"], from_weight="none"), False),
    ]


def dry_run_dtype():
    """The dry run's training dtype: bf16 where the CPU computes it natively (--dtype bfloat16 is refused elsewhere)."""
    return "bfloat16" if cpu_bf16_native() else "float32"


def fresh_folder(ctx, name):
    """out/runs/<name>, emptied: every run of the check starts afresh, so a second check in the same folder (a warm
    GPU machine keeps the first one's outputs) runs the same plan instead of meeting `error: run ... exists`."""
    folder = os.path.join(ctx.out, "runs", name)
    shutil.rmtree(folder, ignore_errors=True)
    if os.path.exists(folder + ".log"):
        os.remove(folder + ".log")
    return folder


def smoke_run(ctx, name, script, extra, torchrun=False, steps=4, expect=None, fresh=True):
    """One short trainer run of --max_steps `steps` in its own folder (`expect` step records: default `steps`); its
    result row (exit code, losses, token counts, speed, memory, checks). `fresh`: start from an empty folder (False
    only to continue the run that folder holds)."""
    folder = fresh_folder(ctx, name) if fresh else os.path.join(ctx.out, "runs", name)
    flags = dict(ctx.model, data_path=ctx.data["pretrain"], packing=1, max_steps=steps, log_interval=1,
                 save_interval=steps, save_dir=os.path.join(folder, "out"), checkpoint_dir=os.path.join(folder, "ckpt"),
                 metrics_file=os.path.join(folder, "metrics.jsonl"), cache_dir=ctx.cache_dir, device=ctx.device)
    flags.update(extra)
    code, seconds, tail = run(trainer_argv(script, flags, torchrun), os.path.join(folder + ".log"), ctx.timeout)
    records = [r for r in read_metrics(flags["metrics_file"]) if "loss" in r]
    losses = [r["loss"] for r in records]
    expect = steps if expect is None else expect
    checks = {"exit 0": code == 0, f"{expect} step records": len(records) == expect,
              "finite losses": bool(losses) and all(math.isfinite(x) for x in losses)}
    if "profile_steps" in extra:
        checks["trace written"] = any(f.endswith(".json") or ".pt.trace" in f
                                      for _, _, files in os.walk(os.path.join(folder, "out")) for f in files)
    if "eval_data_path" in extra:
        checks["eval_loss logged"] = any("eval_loss" in r for r in read_metrics(flags["metrics_file"]))
    last = records[-1] if records else {}
    return dict(name=name, dtype=flags["dtype"], seconds=seconds, exit=code, losses=losses,
                tokens=[r.get("tokens") for r in records], checks=checks,
                ok=all(checks.values()),
                tokens_per_sec=last.get("tokens_per_sec"), mfu=last.get("mfu"), peak_mem_gb=last.get("peak_mem_gb"),
                log_tail=None if all(checks.values()) else tail)


def resume_check(ctx):
    """fp32: 4 steps straight, against 2 steps (of a 4-step run) + --from_resume 1 to 4: the losses equal."""
    straight = smoke_run(ctx, "resume_straight", "train_pretrain.py", dict(dtype="float32"))
    # the first half stops at step 2 by --max_tokens: --max_steps 4 keeps the lr schedule the straight run's
    tokens = straight["tokens"][1] if len(straight["tokens"]) == 4 else 1
    first = smoke_run(ctx, "resume_part", "train_pretrain.py", dict(dtype="float32", save_interval=2,
                                                                    max_tokens=tokens), expect=2)
    part_dir = os.path.join(ctx.out, "runs", "resume_part")
    flags = dict(dtype="float32", from_resume=1, save_dir=os.path.join(part_dir, "out"),
                 checkpoint_dir=os.path.join(part_dir, "ckpt"), metrics_file=os.path.join(part_dir, "metrics.jsonl"))
    resumed = smoke_run(ctx, "resume_part", "train_pretrain.py", flags, fresh=False)
    a, b = straight["losses"], resumed["losses"]
    # TF32 off is not promised on every path, so the GPU compares at fp32 accumulation-order level, the CPU exactly
    tolerance = 1e-3 if ctx.device.startswith("cuda") else 1e-6
    equal = len(a) == len(b) == 4 and all(abs(x - y) <= tolerance * abs(x) for x, y in zip(a, b))
    checks = {"straight ok": straight["ok"], "first half ok": first["ok"], "resumed ok": resumed["ok"],
              f"resumed losses equal the straight run (rel {tolerance})": equal}
    return dict(name="resume", dtype="float32", seconds=straight["seconds"] + first["seconds"] + resumed["seconds"],
                exit=resumed["exit"], losses=b, straight_losses=a, checks=checks, ok=all(checks.values()),
                log_tail=resumed.get("log_tail") or first.get("log_tail"))


def section_smoke(ctx):
    rows = [smoke_run(ctx, *entry) for entry in smoke_plan(ctx)]
    return rows + [resume_check(ctx)]


def section_tests(ctx):
    """pytest -m cuda (on this machine's device: tests pick CUDA when it is there)."""
    xml = os.path.join(ctx.out, "cuda_tests.xml")
    # only the files that hold cuda-marked tests: collecting the rest imports the server's and exports' packages,
    # which a GPU machine may not have
    files = sorted(os.path.join("tests", name) for name in os.listdir(os.path.join(ROOT, "tests"))
                   if name.startswith("test_") and name.endswith(".py")
                   and "mark.cuda" in open(os.path.join(ROOT, "tests", name), encoding="utf-8").read())
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", *files, f"--junitxml={xml}"]
    code, seconds, tail = run(argv, os.path.join(ctx.out, "cuda_tests.log"), ctx.timeout * 3)
    summary = tail.strip().splitlines()[-1] if tail.strip() else ""
    return [dict(name="pytest -m cuda", seconds=seconds, exit=code, summary=summary, ok=code == 0,
                 checks={"exit 0": code == 0}, log_tail=None if code == 0 else tail)]


# ---------------------------------------------------------------------------------------------- attention
def document_positions(batch, seq_len, docs_per_row, device):
    """Position ids of rows packed with `docs_per_row` equal documents (restarting at 0 at each start)."""
    length = seq_len // docs_per_row
    positions = torch.arange(seq_len, device=device) % length
    return positions.expand(batch, seq_len)


def attention_variants(ctx, positions, heads, kv_heads):
    """{name: fn(q, k, v)} for SDPA causal, SDPA + dense document mask, FlexAttention + document block mask."""
    batch, seq_len = positions.shape
    document = (positions == 0).cumsum(1)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions.device).tril()
    dense = (document[:, :, None] == document[:, None, :]) & causal  # (B, L, L)

    def sdpa(q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

    variants = {"sdpa_causal": lambda q, k, v: sdpa(q, k, v),
                "sdpa_dense_doc_mask": lambda q, k, v: sdpa(q, k, v, dense[:, None])}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # optional: torch >= 2.5
    except ImportError:
        return variants

    def mask_mod(b, h, q_idx, kv_idx):
        return (document[b, q_idx] == document[b, kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=positions.device)
    flex = torch.compile(flex_attention) if ctx.device.startswith("cuda") else flex_attention  # CPU: eager reference
    variants["flex_doc_mask"] = lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    return variants


def time_attention(fn, q, k, v, repeats, backward=True):
    """Median fwd(+bwd) seconds and peak memory (GiB, CUDA only) of fn over `repeats` runs after one warm-up."""
    cuda = q.is_cuda
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = fn(q, k, v)
        if backward:
            out.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
        del out
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    return sorted(times)[len(times) // 2], peak


def section_attention(ctx):
    batch, seq_len, heads, kv_heads, head_dim = (2, 128, 4, 2, 16) if ctx.dry_run else (16, 2048, 8, 4, 96)
    dtype = torch.bfloat16 if ctx.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    positions = document_positions(batch, seq_len, 2, ctx.device)
    q, k, v = (torch.randn(batch, n, seq_len, head_dim, device=ctx.device, dtype=dtype, requires_grad=True)
               for n in (heads, kv_heads, kv_heads))
    variants = attention_variants(ctx, positions, heads, kv_heads)
    with torch.no_grad():
        reference = variants["sdpa_dense_doc_mask"](q, k, v).float()
    rows = []
    for name, fn in variants.items():
        try:
            # torch's FlexAttention has no CPU backward: the dry run times its forward alone
            backward = not (name.startswith("flex") and not q.is_cuda)
            inputs = (q, k, v) if backward else (q.detach(), k.detach(), v.detach())
            seconds, peak = time_attention(fn, *inputs, 3 if ctx.dry_run else 10, backward)
            with torch.no_grad():
                error = float((fn(*inputs).float() - reference).abs().max()) if name != "sdpa_causal" else None
            bound = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: a few ulp of outputs of size ~1
            checks = {"matches the dense mask": error is None or error <= bound}
            rows.append(dict(name=name, shape=[batch, heads, seq_len, head_dim], dtype=str(dtype), ms=seconds * 1e3,
                             timed="forward+backward" if backward else "forward",
                             peak_mem_gb=peak, max_error_vs_dense=error, checks=checks, ok=all(checks.values())))
        except Exception as e:  # one variant failing (a kernel missing on this GPU) must not hide the others
            rows.append(dict(name=name, ok=False, checks={"ran": False}, log_tail=f"{type(e).__name__}: {e}"))
    return rows


# ---------------------------------------------------------------------------------------------- bench
def bench_plan(ctx):
    """[(label, flags)] of the GPU-truth issue's speed configs (tiny shapes in the dry run)."""
    if ctx.dry_run:
        tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, batch_size=2)
        return [("dense_seq64", dict(tiny, max_seq_len=64)), ("moe_seq64", dict(tiny, max_seq_len=64, use_moe=1))]
    m3 = dict(hidden_size=768, num_hidden_layers=8, dtype="bfloat16", accumulation_steps=1, packing=1)
    deep = dict(m3, num_hidden_layers=16, max_seq_len=2048, batch_size=8, use_compile=1)
    return [("m3_seq340", dict(m3, max_seq_len=340, batch_size=64)),
            ("m3_seq1024", dict(m3, max_seq_len=1024, batch_size=24)),
            ("m3_seq340_compile", dict(m3, max_seq_len=340, batch_size=64, use_compile=1)),
            ("h768x16_seq2048_compile", deep),
            ("h768x16_seq2048_compile_no_doc_mask", dict(deep, doc_mask=0)),
            ("m3_moe4_top1_seq1024", dict(m3, max_seq_len=1024, batch_size=24, use_moe=1))]


def section_bench(ctx):
    results = os.path.join(ctx.out, "bench.jsonl")
    steps, warmup = (2, 1) if ctx.dry_run else (10, 3)
    rows = []
    for label, flags in bench_plan(ctx):
        argv = [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--steps", str(steps), "--warmup",
                str(warmup), "--label", label, "--results", results, "--device", ctx.device,
                "--data_path", ctx.data["pretrain"], "--cache_dir", ctx.cache_dir]
        if ctx.dry_run:
            argv += ["--peak_fp32", "1e11", "--dtype", "float32"]
        for name, value in flags.items():
            argv += [f"--{name}", str(value)]
        code, seconds, tail = run(argv, os.path.join(ctx.out, f"bench_{label}.log"), ctx.timeout * 2)
        found = [r for r in read_metrics(results) if r.get("label") == label]
        row = found[-1] if found else {}
        checks = {"exit 0": code == 0, "result recorded": bool(row)}
        rows.append(dict(name=label, seconds=seconds, exit=code, tokens_per_sec=row.get("tokens_per_sec"),
                         mfu=row.get("mfu"), peak_mem_gb=row.get("peak_mem_gb"), checks=checks,
                         ok=all(checks.values()), log_tail=None if all(checks.values()) else tail))
    return rows


# ---------------------------------------------------------------------------------------------- report
def environment(ctx):
    env = dict(torch=torch.__version__, python=platform.python_version(), device=ctx.device, dry_run=ctx.dry_run,
               cuda=torch.version.cuda, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if ctx.device.startswith("cuda"):
        env.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                   memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1))
    try:
        import triton  # optional: only CUDA builds ship it
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def markdown(report):
    lines = [f"# GPU check ({'dry run on CPU' if report['environment']['dry_run'] else 'CUDA'})", "",
             "| key | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in report["environment"].items()]
    for section, rows in report["sections"].items():
        lines += ["", f"## {section}", "", "| name | dtype | ok | seconds | figures | failed checks |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            figures = ", ".join(f"{k} {row[k]:.4g}" for k in ("tokens_per_sec", "mfu", "peak_mem_gb", "ms")
                                if isinstance(row.get(k), (int, float)))
            failed = "; ".join(name for name, good in row.get("checks", {}).items() if not good)
            lines.append(f"| {row['name']} | {row.get('dtype', '')} | {'yes' if row['ok'] else '**NO**'} | "
                         f"{row.get('seconds', '')} | "
                         f"{figures} | {failed} |")
    lines += ["", f"**{report['passed']} ok, {report['failed']} failed** in {report['seconds']:.0f} s"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_check"), help="report folder")
    parser.add_argument("--dry_run", action="store_true", help="the same plan on CPU with tiny shapes")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per trainer run before it counts as failed")
    parser.add_argument("--quick", action="store_true", help="the 8-minute plan instead of the sections: cuda tests, "
                        "speed/MFU/memory of the issue's configs, kill + resume, top kernels "
                        "(scripts/benchmarks/gpu_quick.py)")
    parser.add_argument("--only", default="", help="with --quick: comma list of its items to run (e.g. those that "
                        "failed the first time)")
    parser.add_argument("--budget_s", type=int, default=450, help="with --quick: start no item after this many seconds")
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.exit(2, f"error: --sections {','.join(sorted(unknown))} unknown; use {','.join(SECTIONS)}\n")
    if not args.dry_run and not torch.cuda.is_available():
        parser.exit(2, "error: no CUDA device is available; run with --dry_run for the CPU rehearsal\n")
    return args


def main(argv=None):
    args = parse_args(argv)
    ctx = argparse.Namespace(dry_run=args.dry_run, out=os.path.abspath(args.out), timeout=args.timeout,
                             device="cpu" if args.dry_run else "cuda",
                             dtype=dry_run_dtype() if args.dry_run else "bfloat16",
                             model=DRY_MODEL if args.dry_run else GPU_MODEL)
    os.makedirs(os.path.join(ctx.out, "runs"), exist_ok=True)
    ctx.cache_dir = os.path.join(ctx.out, "cache")
    ctx.data = write_data(os.path.join(ctx.out, "data"), args.dry_run)
    # what the quick plan's items call (looked up now, so a test's replacement of `run` is the one they use)
    ctx.run, ctx.trainer_argv, ctx.read_metrics, ctx.fresh_folder = run, trainer_argv, read_metrics, fresh_folder
    ctx.table_peak, ctx.matmul_peak = matmul_peaks(ctx)
    ctx.environment = dict(environment(ctx), bf16_dense_peak_tflops=ctx.table_peak and ctx.table_peak / 1e12,
                           bf16_matmul_8192_tflops=ctx.matmul_peak and round(ctx.matmul_peak / 1e12, 1))
    if args.quick:
        return run_quick(ctx, set(filter(None, args.only.split(","))), args.budget_s)
    start, sections = time.time(), {}
    for name in (s for s in SECTIONS if s in args.sections.split(",")):
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            sections[name] = globals()[f"section_{name}"](ctx)
        except Exception:
            sections[name] = [dict(name=name, ok=False, checks={"section ran": False}, log_tail=traceback.format_exc())]
        for row in sections[name]:
            print(f"[gpu_check]   {row['name']}: {'ok' if row['ok'] else 'FAILED ' + str(row.get('log_tail'))}",
                  flush=True)
    report = write_report(ctx, sections, start)
    print(f"gpu_check report: {report['passed']} ok, {report['failed']} failed ({ctx.out}/gpu_check.md)", flush=True)
    return 0 if report["failed"] == 0 else 1


def write_report(ctx, sections, start):
    """<out>/gpu_check.json and .md of the rows so far (rewritten after each quick row: a time-out keeps them)."""
    rows = [row for section in sections.values() for row in section]
    report = dict(environment=ctx.environment, sections=sections, passed=sum(r["ok"] for r in rows),
                  failed=sum(not r["ok"] for r in rows), seconds=time.time() - start)
    with open(os.path.join(ctx.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    if "quick" in sections:
        text += "\n## quick: speed, memory, profile\n\n" + quick_markdown(sections["quick"])
    with open(os.path.join(ctx.out, "gpu_check.md"), "w") as f:
        f.write(text)
    return report


def run_quick(ctx, only, budget_s):
    """The quick plan's items in order (those named in `only`, when given), each written to the report when done;
    an item that would start after `budget_s` seconds is recorded as not run."""
    start, rows, items = time.time(), [], quick_items(ctx, section_tests)
    unknown = only - {name for name, _ in items}
    if unknown:
        print(f"error: --only {','.join(sorted(unknown))}: not an item of the quick plan here; use "
              f"{','.join(name for name, _ in items)}", file=sys.stderr)
        return 2
    for name, measure in items:
        if only and name not in only:
            continue
        if time.time() - start > budget_s:
            rows.append(dict(name=name, ok=False, checks={f"started within --budget_s {budget_s}": False}))
            continue
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            row = measure()
        except Exception:  # one item failing must not hide the others
            row = dict(name=name, ok=False, checks={"ran": False}, log_tail=traceback.format_exc())
        rows.append(row)
        figures = ", ".join(f"{k} {row[k]:.4g}" for k in ("tokens_per_sec", "mfu", "peak_mem_gb")
                            if isinstance(row.get(k), (int, float)))
        print(f"[gpu_check]   {name}: {'ok' if row['ok'] else 'FAILED ' + str(row.get('log_tail'))} {figures}",
              flush=True)
        write_report(ctx, {"quick": rows}, start)
    report = write_report(ctx, {"quick": rows}, start)
    print(quick_markdown(rows), flush=True)
    print(f"gpu_check report: {report['passed']} ok, {report['failed']} failed ({ctx.out}/gpu_check.md)", flush=True)
    return 0 if report["failed"] == 0 else 1


def matmul_peaks(ctx):
    """(the datasheet's dense bf16 peak, a measured 8192^3 bf16 matmul rate) on CUDA; (None, None) on CPU."""
    if not ctx.device.startswith("cuda"):
        return None, None
    from trainer.observe.metrics import cuda_table_peak  # CUDA only: the trainer's table of datasheet peaks
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    rate = 10 * 2 * 8192 ** 3 / (time.perf_counter() - begin)
    return cuda_table_peak(torch.cuda.get_device_name(0), torch.bfloat16, True), rate


if __name__ == "__main__":
    sys.exit(main())
