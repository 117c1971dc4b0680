"""Where a training step's time goes, from the trainer's torch.profiler trace (--profile_steps A:B).

    python scripts/step_profile.py out/profile/rank0.*.pt.trace.json     # or: scripts/bench.py --profile

The shares and how each operator's time is counted: scripts/benchmarks/step_shares.py.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `scripts.` imports

from scripts.benchmarks.step_shares import shares_line, step_shares  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description="Where a training step's time goes, from a torch.profiler trace.")
    parser.add_argument("trace", help="a Chrome trace the trainer wrote with --profile_steps A:B "
                                      "(out/profile/rank0.*.pt.trace.json)")
    args = parser.parse_args(argv)
    try:
        result, count, seconds = step_shares(args.trace)
    except OSError as e:
        sys.exit(print(f"error: cannot read {args.trace}: {e.strerror or e}", file=sys.stderr) or 2)
    except (ValueError, KeyError) as e:  # not JSON, not a Chrome trace, no step marks
        sys.exit(print(f"error: {args.trace} is not a trace written by --profile_steps: {e}", file=sys.stderr) or 2)
    print(f"{count} steps, {seconds:.3f} s each: {shares_line(result)}")


if __name__ == "__main__":
    main()
