"""The Checkpointer: the one writer of resume checkpoints (a DCP directory per save, trainer/ckpt/resume.py
describes it) and their restorer once the model is wrapped. It walks the registered parts (trainer/ckpt/parts.py),
marks a step complete only when every rank's files are there (with each file's size and crc32: step_dirs.py), and
prunes to --keep_checkpoints.
"""
import os
import shutil
import threading
import zlib
from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from model.atomic import atomic_json, atomic_save
from model.errors import ConfigError
from trainer.base import launch
from trainer.base.launch import rank
from trainer.base.log import Logger
from trainer.ckpt.parts import LEGACY_PARTS, PER_RANK, RANK0, SHARDED, missing_parts_line, note_unused_parts
from trainer.ckpt.resume import resume_fields
from trainer.ckpt.step_dirs import (
    CRC_FILE,
    FORMAT_VERSION,
    MANIFEST,
    TRAIN_STATE,
    best_checkpoint_step,
    checkpoints,
    file_sizes,
    incomplete_line,
    latest_checkpoint,
    read_rank_state,
    record_crcs,
    save_rank_state,
)
from trainer.ckpt.storage import check_room, disk_full_as_one_line, from_rank0, mib, tree_bytes

RECORD_KEYS = ("format_version", "parts", "world_size", "global_batch", "layout", "args", "config", "tokenizer",
               "resume_fields")  # train_state.pt's own keys beside the rank-0 parts
MINIMIND_PARTS = ("model", "scaler", "train_state")  # what MiniMind's resume file restores; the rest starts fresh


class SummingFileSystem(FileSystem):
    """DCP's file system for a save: each shard file's crc32 is taken from the bytes as they are written (`crcs`)."""

    def __init__(self):
        super().__init__()
        self.crcs = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if mode != "wb" or not str(path).endswith(".distcp"):
                yield stream  # .metadata goes through a temporary name: summed from the file once complete
                return
            summing = SummingStream(stream)
            yield summing
            self.crcs[os.path.basename(path)] = f"{summing.crc:08x}"


class SummingStream:
    """A written stream that keeps the crc32 of what went through it (DCP appends: torch.save writes, never seeks)."""

    def __init__(self, stream):
        self.stream, self.crc = stream, 0

    def write(self, data):
        self.crc = zlib.crc32(data, self.crc)
        return self.stream.write(data)

    def __getattr__(self, name):  # tell, flush, fileno (fsync), close
        return getattr(self.stream, name)


class SummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that writes the crc32 of each shard it wrote beside it (step_dirs.CRC_FILE) before DCP
    hands the write results to the coordinator, so they are there when rank 0 marks the step complete."""

    def __init__(self, path):
        super().__init__(path)
        self.fs = SummingFileSystem()

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()  # FileSystemWriter writes before it returns; a failure is raised here, nothing recorded
        atomic_json(self.fs.crcs, os.path.join(self.path, CRC_FILE.format(rank=rank())))
        return written


def keep_line(run_dir, keep, estimate):
    """The start-up line on what the checkpoints will hold on disk (`estimate`: bytes of one)."""
    if not keep:
        return f"checkpoints: every complete one kept in {run_dir} (--keep_checkpoints 0), ~{mib(estimate)} each"
    return (f"checkpoints: the last {keep} kept in {run_dir} (--keep_checkpoints), ~{keep} x {mib(estimate)} = "
            f"{mib(keep * estimate)}")


class Checkpointer:
    """Writes resume checkpoints of its registered parts (trainer/ckpt/parts.py), one DCP directory per save; keeps
    the newest `keep` complete ones (0: all). `plan` and `config` are recorded beside the parts.

    With async_save, dcp.async_save writes in a thread over its own gloo group while training goes on; the next
    save, and the end of the run (wait), wait for it. A save counts once rank 0 has written its manifest.
    """

    def __init__(self, run_dir, async_save=False, keep=3, parts=(), plan=None, config=None, estimate=0):
        self.run_dir, self.async_save, self.keep, self.plan, self.config = run_dir, async_save, keep, plan, config
        self.parts, self.resumed = {}, None  # name -> Part, in registration order; read_resume's dict once loaded
        for part in parts:
            self.register(part)
        self.pending, self.incomplete = None, None  # (future, manifest-written event) of the async save in flight;
        # rank 0: the line of an async save it could not mark complete, told to every rank at the next wait
        self.needed, self.last = estimate, None  # bytes a save takes (the last one's, else the estimate); last one
        # a separate group, so the writer thread's collectives never interleave with training's (a collective)
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        if plan is not None:
            Logger(keep_line(run_dir, keep, estimate))

    def register(self, part):
        """Add a stateful part, once by name; one registered after the resume was loaded is restored at once."""
        if part.name in self.parts or part.name in RECORD_KEYS:
            raise ValueError(f"a checkpoint part named {part.name!r} exists already")
        self.parts[part.name] = part
        if self.resumed is not None:
            self.load_parts(self.resumed, [part])

    def of_scope(self, scope, parts=None):
        return [part for part in (self.parts.values() if parts is None else parts) if part.scope == scope]

    def save(self, step):
        """Write step `step`'s checkpoint (a collective); returns once it is written, or staged under async_save.

        A disk without room for it (the last checkpoint's size), or one that fills during the write, ends the run
        with one line naming the directory, the space needed and free, and the last complete checkpoint."""
        self.wait()
        path = os.path.join(self.run_dir, f"step_{step}")
        self.last = latest_checkpoint(self.run_dir)
        self.needed = tree_bytes(self.last) if self.last else self.needed
        check_room(self.run_dir, self.needed, self.last)  # a collective: every rank stops together
        with disk_full_as_one_line(self.run_dir, self.needed, self.last, partial=path):
            self.save_files(path)

    def restore(self, ckpt, progress, steps_per_epoch):
        """A resumed run's start: every part loaded (load), the progress's global step counted over the epochs before
        (MiniMind's resume file counts steps within its epoch only), and the line that says where the run resumes."""
        self.load(ckpt)
        progress.global_step = max(progress.global_step, progress.epoch * steps_per_epoch + progress.step_in_epoch)
        processes = f"{ckpt['world_size']} process{'es' * (ckpt['world_size'] != 1)}"
        Logger(f"Resumed from epoch {progress.epoch}, step {progress.global_step} ({processes} when saved)")

    def load(self, ckpt):
        """Restore every part from read_resume's `ckpt` (a DCP step directory's train_state.pt, or MiniMind's resume
        file, which restores model + optimizer, scaler and progress): a part the checkpoint lacks starts from its
        start value (a note), or the checkpoint is refused when it has none."""
        self.resumed = ckpt
        if "dcp_path" in ckpt:
            note_unused_parts(ckpt["dcp_path"], ckpt.get("parts") or LEGACY_PARTS, self.parts.values())
        self.load_parts(ckpt, list(self.parts.values()))

    def load_parts(self, ckpt, parts):
        """Restore `parts` from `ckpt`: sharded ones (DCP reshards into this layout), then per-rank ones (this rank's
        file under the same world size, else rank 0's), then rank 0's (keys of train_state.pt)."""
        if "dcp_path" in ckpt:
            saved = ckpt.get("parts") or LEGACY_PARTS
            line = missing_parts_line(ckpt["dcp_path"], saved, parts)
            if line:
                raise ConfigError(line)
        else:
            saved = MINIMIND_PARTS
        missing = [part for part in parts if part.name not in saved]
        parts = [part for part in parts if part.name in saved]
        same_world = ckpt["world_size"] == self.plan.layout.world_size
        for part in self.of_scope(SHARDED, parts):
            part.load(ckpt)
        for part in self.of_scope(PER_RANK, parts) if "dcp_path" in ckpt else []:
            state = read_rank_state(ckpt["dcp_path"], part.name, same_world)
            if state is not None:  # else the part had nothing to save (an objective without state)
                part.load(state, same_world)
        for part in self.of_scope(RANK0, parts):
            if part.name in ckpt:
                part.load(ckpt[part.name])
        for part in missing:  # their start values, which may follow the restored parts (EMA: the restored weights)
            if part.begin is not None:
                part.begin()

    def save_files(self, path):
        """train_state.pt (rank 0), this rank's per-rank files and its DCP shards into `path`."""
        if rank() == 0 and os.path.exists(path):  # rewriting a step: no earlier save's file may count for this one
            shutil.rmtree(path)
        if dist.is_initialized():
            dist.barrier()
        if rank() == 0:
            atomic_save(self.train_state(), os.path.join(path, TRAIN_STATE))
        for part in self.of_scope(PER_RANK):
            state = part.state()
            if state is not None:
                save_rank_state(path, part.name, state)
        state = {}
        for part in self.of_scope(SHARDED):
            state.update(part.state())
        if not self.async_save:
            self.write(state, path)
            return
        # FileSystemWriter stages (copies into new CPU buffers) before returning: training may then update the weights
        response = dcp.async_save(state, checkpoint_id=path, storage_writer=SummingWriter(path),
                                  process_group=self.group)
        # newer torch may return an AsyncSaveResponse
        future, marked = getattr(response, "upload_completion", response), threading.Event()
        if rank() == 0:
            def on_done(f):  # rank 0's save finishes only once every rank's write result reached it
                try:
                    if f.exception() is None:
                        self.incomplete = self.mark_complete(path)
                finally:
                    marked.set()
            future.add_done_callback(on_done)
        self.pending, self.pending_path = (future, marked), path

    def write(self, state, path):
        """The synchronous save: shards, then a barrier, then rank 0's manifest."""
        dcp.save(state, checkpoint_id=path, storage_writer=SummingWriter(path))
        if dist.is_initialized():
            dist.barrier()  # every rank's shards and RNG file are on disk
        line = self.mark_complete(path) if rank() == 0 else None
        line = from_rank0(line)  # every rank stops together on a step that cannot be complete
        if line:
            raise ConfigError(line)
        launch.SAVED["path"] = path  # what a rank that stops later says is saved

    def train_state(self):
        """What rank 0 writes beside the shards: the rank-0 parts, the parts list, the layout, the typed flags and
        the model config."""
        plan = self.plan
        layout = plan.layout
        record = dict(world_size=layout.world_size, global_batch=plan.data.global_batch,
                      layout=dict(dp=layout.dp, **layout.model_sizes, zero_stage=layout.zero_stage),
                      args=dict(plan.flags), config=self.config.to_dict(), format_version=FORMAT_VERSION,
                      tokenizer=plan.data.tokenizer_record, resume_fields=resume_fields(plan),
                      parts={part.name: part.scope for part in self.parts.values()})
        return dict(record, **{part.name: part.state() for part in self.of_scope(RANK0)})

    def wait(self):
        """Wait for the pending async save (its manifest included); re-raises its error."""
        if self.pending is None:
            return
        future, marked = self.pending
        self.pending = None
        with disk_full_as_one_line(self.run_dir, self.needed, self.last):
            future.result()
        if rank() == 0:
            marked.wait()
        line, self.incomplete = from_rank0(self.incomplete), None  # a collective: every rank waits here
        if line:
            raise ConfigError(line)
        launch.SAVED["path"] = self.pending_path

    def mark_complete(self, path):
        """Rank 0, once every rank's files are written: the manifest, last, and a prune; the refusal line instead
        when some rank's files are not there as this rank sees them (nodes that do not share the directory)."""
        line = incomplete_line(path, dist.get_world_size() if dist.is_initialized() else 1)
        if line:
            return line
        step = int(path.rsplit("_", 1)[1])
        # the sizes and crc32 of what was written: a damaged file is found before any rank builds a model (damage)
        record = dict(step=step, format_version=FORMAT_VERSION, files=file_sizes(path), crc32=record_crcs(path))
        atomic_json(record, os.path.join(path, MANIFEST))
        self.prune(step)
        return None

    def prune(self, step):
        """Drop steps after `step` (an abandoned timeline), partial saves before it, complete ones past `keep`."""
        best = best_checkpoint_step(self.run_dir)  # --save_best's, on this timeline (before `step`): never pruned
        older = [(s, p, done) for s, p, done in checkpoints(self.run_dir)
                 if s != step and not (s == best < step and done)]
        kept = [p for s, p, done in older if done and s < step][-(self.keep - 1):] if self.keep > 1 else []
        for s, p, done in older:
            if p not in kept and (self.keep or s > step or not done):
                shutil.rmtree(p, ignore_errors=True)
