"""The callbacks a flag adds on evals (trainer/runtime/callbacks.py imports this module for those runs only):
--early_stop_patience (EarlyStopping) and --save_best (BestCheckpoint)."""
import json
import os

from model.atomic import atomic_write_text
from model.weights.files import save_weights_file
from trainer.base.launch import is_main_process
from trainer.base.log import Logger
from trainer.ckpt.resume import read_checkpoint_model
from trainer.ckpt.step_dirs import BEST_INDEX, MANIFEST, best_checkpoint_step
from trainer.ckpt.weights_file import save_weights


class EarlyStopping:
    """--early_stop_patience N: stop once N evals in a row (of those every --eval_interval steps; a run's extra
    eval at its end does not count) brought no eval_loss below the best so far minus --early_stop_min_delta."""

    def __init__(self, patience, min_delta, eval_interval):
        self.patience, self.min_delta, self.eval_interval = patience, min_delta, eval_interval
        self.best = self.best_step = self.stop_reason = None
        self.evals_without_improvement = 0

    def on_eval(self, trainer, record):
        step, loss = record["step"], record["eval_loss"]
        if step % self.eval_interval:
            return
        if self.best is None or loss < self.best - self.min_delta:
            self.best, self.best_step, self.evals_without_improvement = loss, step, 0
            return
        self.evals_without_improvement += 1
        if self.evals_without_improvement >= self.patience:
            self.stop_reason = (f"early stopping at step {step}: {self.patience} evals without an eval_loss below "
                                f"{self.best:.6f} - {self.min_delta:g} (the best, at step {self.best_step})")

    def state_dict(self):
        return dict(best=self.best, best_step=self.best_step, stop_reason=self.stop_reason,
                    evals_without_improvement=self.evals_without_improvement)

    def load_state_dict(self, state):
        self.best, self.best_step = state["best"], state["best_step"]
        self.evals_without_improvement, self.stop_reason = state["evals_without_improvement"], state["stop_reason"]


class BestCheckpoint:
    """--save_best 1: the resume checkpoint of the lowest eval_loss is saved (also off --save_interval), kept when
    older ones are pruned, and named in <run_dir>/best.json; its weights go to <save_weight>_..._best.pth (a stage
    that writes its own weight files, LoRA, keeps the checkpoint only)."""

    def __init__(self, run_dir, weights_path):
        self.index = os.path.join(run_dir, BEST_INDEX)
        self.weights_path = weights_path  # None: a stage whose weights are not the whole model (LoRA's adapters)
        self.best = self.best_step = self.save_step = None

    def on_eval(self, trainer, record):
        if self.best is None or record["eval_loss"] < self.best:
            self.best, self.best_step = record["eval_loss"], record["step"]
            self.save_step = record["step"]  # the loop checkpoints this step

    def on_save(self, trainer, step):
        if step != self.save_step:
            return
        self.save_step = None
        trainer.checkpointer.wait()  # best.json names a complete checkpoint only
        if self.weights_path:
            save_weights(trainer, self.weights_path)  # a collective: every rank gathers
        if is_main_process():
            self.write_index(os.path.join(os.path.dirname(self.index), f"step_{step}"))
            Logger(f"best eval_loss {self.best:.6f} at step {step}: checkpoint kept in {self.index}")

    def write_index(self, checkpoint):
        atomic_write_text(self.index, json.dumps(dict(step=self.best_step, eval_loss=self.best,
                                                      checkpoint=checkpoint, weights=self.weights_path)) + "\n")

    def state_dict(self):
        return dict(best=self.best, best_step=self.best_step)

    def load_state_dict(self, state):
        """Resume: the best of the resumed timeline; best.json (and the weights) follow it when they name another
        step (a run resumed from an earlier checkpoint, or killed between its save and the index)."""
        self.best, self.best_step = state["best"], state["best_step"]
        if not is_main_process() or self.best_step is None or best_checkpoint_step(
                os.path.dirname(self.index)) == self.best_step:
            return
        checkpoint = os.path.join(os.path.dirname(self.index), f"step_{self.best_step}")
        if not os.path.isfile(os.path.join(checkpoint, MANIFEST)):  # resumed from another run's checkpoint
            Logger(f"--save_best: the resumed best (step {self.best_step}) has no checkpoint in {checkpoint}; "
                   "best.json follows from the next better eval")
            return
        if self.weights_path:
            model_state, config, _ = read_checkpoint_model(checkpoint)
            save_weights_file(model_state, config, self.weights_path)
        self.write_index(checkpoint)
