"""The online dashboards a run may log to, started by trainer/observe/tracking.py's Tracker (which imports this module
for --tracker swanlab/wandb or MiniMind's --use_wandb only): swanlab (online when logged in, else offline) and
wandb (offline unless WANDB_MODE says otherwise)."""
import os


def start_wandb(project, run_name, resume_id, config, log_dir):
    """A wandb run, offline unless WANDB_MODE says otherwise (upload later with `wandb sync`)."""
    import wandb  # optional dependency: only --tracker wandb needs it (checked by resolve_trackers)
    os.makedirs(log_dir, exist_ok=True)
    return wandb.init(project=project, name=run_name, id=resume_id, resume="allow" if resume_id else None,
                      dir=log_dir, config=config, mode=os.environ.get("WANDB_MODE", "offline"))


def start_swanlab(project, run_name, resume_id, config, log_dir):
    """A swanlab run: online when logged in (SWANLAB_API_KEY or `swanlab login`), else offline; None if missing."""
    try:
        import swanlab  # optional dependency: only --use_wandb needs it
    except ImportError:
        print("--use_wandb: swanlab is not installed (pip install swanlab); continuing without it", flush=True)
        return None
    kwargs = dict(project=project, name=run_name, id=resume_id, resume="allow" if resume_id else None,
                  log_dir=log_dir, config=config)
    try:
        return swanlab.init(settings=swanlab.Settings(interactive=False), **kwargs)  # never prompts on a TTY-less job
    except Exception as e:  # not logged in, or the service is unreachable: keep the run, log it locally
        print(f"swanlab: no online run ({str(e).rstrip('.')}); logging offline under {log_dir}, "
              "upload later with `swanlab sync <run dir>`", flush=True)
        return swanlab.init(mode="offline", **kwargs)
