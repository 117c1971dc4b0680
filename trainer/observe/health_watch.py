"""The HealthWatch callback: trainer/judge/health.py's health lines said as a run's records come, and at the end the
run's report or the command that writes it (trainer/runtime/callbacks.py wires it into every run)."""
from trainer.base.launch import is_main_process
from trainer.base.log import Logger
from trainer.judge.health import Health

REPORT_AFTER_S = 60  # --report auto: runs of a minute or more (the page and its plots take 1-3 s, pandas + matplotlib)


class HealthWatch:
    """The callback: each new health line once, as `health: step N: ...` (every rank sees the same records); at the
    end, the run's report (rank 0, under --report) or the command that writes it."""

    def __init__(self, vocab_size, metrics_file=None, report="0", run_config=None):
        self.health, self.metrics_file = Health(vocab_size), metrics_file
        self.report, self.run_config = report, run_config

    def on_train_end(self, trainer):
        if not self.metrics_file:
            return
        command = f"python scripts/report.py {self.metrics_file}"
        if not (self.writes_report() and not trainer.guard.stop and is_main_process()):
            Logger(f"report of this run: {command}")
            return
        from trainer.judge.report import write_report  # pandas, matplotlib: read by a run that writes one only
        try:
            page, png = write_report([self.metrics_file], run_config=self.run_config)
        except (OSError, ValueError) as e:  # the weights are saved: a report that fails is a note, not a failed run
            Logger(f"note: the report of this run was not written ({type(e).__name__}: {e}); later: {command}")
            return
        Logger(f"report of this run: {page} (plots: {png})")

    def writes_report(self):
        """--report 1, or auto on a run that took REPORT_AFTER_S or more (its last logged record's elapsed_s)."""
        elapsed = self.health.train[-1].get("elapsed_s", 0.0) if self.health.train else 0.0
        return self.report == "1" or (self.report == "auto" and elapsed >= REPORT_AFTER_S)

    def on_step_end(self, trainer, record):
        if record is not None:
            self.say(self.health.add(record))

    def on_eval(self, trainer, record):
        self.say(self.health.add(record))

    @staticmethod
    def say(found):
        for _, step, line in found:
            Logger(f"health: step {step}: {line}")

    def state_dict(self):  # the records the checks read too: a resume says a spike as the run without one would
        return dict(said=sorted(self.health.said), train=self.health.train, evals=self.health.evals)

    def load_state_dict(self, state):
        self.health.said, self.health.train, self.health.evals = set(state["said"]), state.get("train", []), \
            state.get("evals", [])
