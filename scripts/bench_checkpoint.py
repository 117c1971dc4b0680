"""Time a resume checkpoint's save and load with and without its crc32 (complete.json's sums, step_dirs.py), and the
hashes one could use instead, at the default model.

    python scripts/bench_checkpoint.py                    # hidden 768, 8 layers (the default model), 3 rounds
    python scripts/bench_checkpoint.py --rounds 5 --dir /scratch/bench_ckpt

The state is the trainer's own (sharded_state_dict of MiniMindForCausalLM + AdamW after one step: fp32 weights and
Adam's two moments), saved by DCP in one process. Per round, alternately: the save with DCP's FileSystemWriter and the
sizes only (before), then with SummingWriter and the sums (now); the load (damage, then dcp.load) with sizes only and
with the contents summed, each from the page cache (warm: the files just written) and from the disk (cold: the files
dropped from the page cache by posix_fadvise first). Then each hash (crc32, sha256, blake2b) streamed over the step's
files, warm. Each is timed by the wall clock and by this process's CPU time (the figure that holds on a machine
shared with other work; a cold load's disk wait is in the wall time only). Medians over the rounds; one JSON line
appended to --results (default out/bench_checkpoint.jsonl).
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `trainer.` imports

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from model.atomic import atomic_json, atomic_save  # noqa: E402
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from scripts.benchmarks.machine import machine_description  # noqa: E402
from trainer.ckpt.checkpointer import SummingWriter  # noqa: E402
from trainer.ckpt.step_dirs import CRC_CHUNK, MANIFEST, TRAIN_STATE, damage, file_sizes, record_crcs  # noqa: E402
from trainer.parallel.state_dict import sharded_state_dict  # noqa: E402

HASHES = {"crc32": None, "sha256": hashlib.sha256, "blake2b": hashlib.blake2b}


def timed(work):
    """(wall seconds, CPU seconds of this process) of work()."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def trained_state(hidden, layers):
    """The default model and AdamW after one step on random gradients: what a resume checkpoint holds."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return sharded_state_dict([model], optimizer)


def save(state, path, summed):
    """One save as the Checkpointer does it in one process: train_state.pt (a stand-in: the record is small), the
    shards, then the manifest (sizes; and the sums)."""
    shutil.rmtree(path, ignore_errors=True)

    def work():
        atomic_save({"format_version": 3}, os.path.join(path, TRAIN_STATE))
        dcp.save(state, checkpoint_id=path, storage_writer=SummingWriter(path) if summed else FileSystemWriter(path))
        record = dict(step=1, files=file_sizes(path))
        if summed:
            record["crc32"] = record_crcs(path)
        atomic_json(record, os.path.join(path, MANIFEST))
    return timed(work)


def drop_from_cache(path):
    """The step's files out of the page cache (written and fsynced: clean pages go), so the next read is the disk's."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(state, path, summed, cold):
    """One load as read_resume + the model part do it: damage (sizes; and contents when summed), then dcp.load."""
    if cold:
        drop_from_cache(path)

    def work():
        why = damage(path, contents=(0, 1) if summed else None)
        assert why is None, why
        dcp.load(state, checkpoint_id=path)
    return timed(work)


def hash_seconds(path, name):
    """(wall, CPU) seconds to hash every file of the step, streamed in CRC_CHUNK reads (warm)."""
    buffer = bytearray(CRC_CHUNK)
    view = memoryview(buffer)

    def work():
        for file in sorted(os.listdir(path)):
            digest, crc = HASHES[name]() if HASHES[name] else None, 0
            with open(os.path.join(path, file), "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    if digest is None:
                        crc = zlib.crc32(view[:n], crc)
                    else:
                        digest.update(view[:n])
    return timed(work)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    state = trained_state(args.hidden_size, args.num_hidden_layers)
    path = os.path.join(args.dir, "step_1")
    times = {key: [] for key in ("save", "save_crc32", "load_warm", "load_crc32_warm", "load_cold", "load_crc32_cold",
                                 *(f"hash_{name}" for name in HASHES))}
    for _ in range(args.rounds):
        for summed in (False, True):  # alternately, the same state, so that load drifts hit both alike
            suffix = "_crc32" if summed else ""
            times["save" + suffix].append(save(state, path, summed))
            times[f"load{suffix}_warm"].append(load(state, path, summed, cold=False))
            times[f"load{suffix}_cold"].append(load(state, path, summed, cold=True))
        for name in HASHES:
            times[f"hash_{name}"].append(hash_seconds(path, name))
    size = sum(file_sizes(path).values())
    shutil.rmtree(args.dir, ignore_errors=True)
    medians = {key: [statistics.median(pair[i] for pair in values) for i in (0, 1)] for key, values in times.items()}
    record = dict(machine=machine_description("cpu"), hidden_size=args.hidden_size,
                  num_hidden_layers=args.num_hidden_layers, checkpoint_mib=round(size / 2**20, 1), rounds=args.rounds,
                  seconds={key: [round(v, 3) for v in value] for key, value in medians.items()},
                  rounds_seconds={key: [[round(v, 3) for v in pair] for pair in values]
                                  for key, values in times.items()})
    print(f"machine: {record['machine']}")
    print(f"checkpoint: {record['checkpoint_mib']} MiB (hidden {args.hidden_size}, {args.num_hidden_layers} layers), "
          f"median of {args.rounds} rounds; wall / CPU seconds")
    for what in ("save", "load_warm", "load_cold"):
        plain, summed = medians[what], medians[what.replace("save", "save_crc32").replace("load_", "load_crc32_")]
        print(f"{what:10s} sizes only {plain[0]:6.2f} / {plain[1]:6.2f}   with crc32 {summed[0]:6.2f} / "
              f"{summed[1]:6.2f}   +{summed[0] - plain[0]:5.2f} / +{summed[1] - plain[1]:5.2f}")
    for name in HASHES:
        wall, cpu = medians[f"hash_{name}"]
        print(f"hash {name:8s} {wall:6.2f} / {cpu:6.2f}  {size / 2**20 / cpu:6.0f} MiB per CPU second (streamed, warm)")
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(record) + "\n")


def parse_args(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's OMP_NUM_THREADS)")
    parser.add_argument("--dir", default=os.path.join(root, "out", "bench_checkpoint"),
                        help="where the checkpoint is written (removed at the end)")
    parser.add_argument("--results", default=os.path.join(root, "out", "bench_checkpoint.jsonl"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
