"""Where a training step's time goes, from the trainer's torch.profiler trace (--profile_steps A:B): the library of
scripts/step_profile.py and scripts/bench.py --profile.

Each operator's self time (its duration less its children's) on the step's thread goes to one share: a region when
the operator runs inside one (optimizer, data loader, chunked loss, attention kernels: the outermost region wins),
else the kind of the nearest operator that has one (matmul; cast/copy: dtype casts and layout copies), else
elementwise/other; the step's time no operator covers is the framework's (Python, the autograd engine, the profiler).
"""
import json

# regions by name fragment (lower case): everything inside them counts to them
REGIONS = (("optimizer", ("optimizer.",)), ("loader", ("dataloader",)), ("chunked loss", ("_chunkedhead",)),
           ("attention", ("scaled_dot_product", "flash_attention", "flex_attention")))
# operator kinds by exact name
KINDS = {"matmul": {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"},
         "cast/copy": {"aten::_to_copy", "aten::to", "aten::copy_"}}
SHARES = ("matmul", "cast/copy", "elementwise/other", "attention", "chunked loss", "optimizer", "loader", "framework")


def _region(name):
    low = name.lower()
    return next((region for region, parts in REGIONS if any(p in low for p in parts)), None)


def _kind(name):
    return next((kind for kind, names in KINDS.items() if name in names), None)


def step_shares(trace_path):
    """({share: fraction of the profiled steps' time}, profiled steps, seconds per step) of a Chrome trace."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError(f"{trace_path}: no ProfilerStep# marks (was it written by --profile_steps?)")
    tid = steps[0]["tid"]
    ops = sorted((e for e in events if e["tid"] == tid and not e["name"].startswith("ProfilerStep#")
                  and any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps)),
                 key=lambda e: (e["ts"], -e["dur"]))
    totals, stack = dict.fromkeys(SHARES, 0.0), []  # stack: (end, event, region, kind, child time)
    for e in ops + [None]:
        while stack and (e is None or e["ts"] >= stack[-1][0]):
            _close(stack, totals)
        if e is None:
            break
        outer_region = stack[-1][2] if stack else None
        outer_kind = stack[-1][3] if stack else None
        stack.append([e["ts"] + e["dur"], e, outer_region or _region(e["name"]), _kind(e["name"]) or outer_kind, 0.0])
    step_time = sum(s["dur"] for s in steps)
    totals["framework"] = step_time - sum(totals.values())
    return {k: v / step_time for k, v in totals.items()}, len(steps), step_time / len(steps) / 1e6


def _close(stack, totals):
    """Pop the innermost open operator: its self time to its share, its duration to its parent's child time."""
    _, event, region, kind, children = stack.pop()
    totals[region or kind or "elementwise/other"] += max(event["dur"] - children, 0.0)
    if stack:
        stack[-1][4] += event["dur"]


def shares_line(shares):
    return ", ".join(f"{name} {shares[name]:.0%}" for name in SHARES)
