"""Moved: trainer/base/launch.py (the collectives, main_guard) and trainer/base/errors.py (ConfigError,
TrainingHalted, SignalStop). These names stay importable here for code written against the old path."""
from trainer.base.errors import ConfigError, SignalStop, TrainingHalted  # noqa: F401
from trainer.base.launch import (  # noqa: F401
    OUTSIDE_LOOP,
    add_stats,
    backend_for,
    count_sum,
    full_value,
    init_distributed_mode,
    is_main_process,
    leave_without_finalizing,
    local_shard,
    main_guard,
    per_rank,
    rank,
    set_collective_timeout,
    setup_seed,
    stop_on_signals,
    world_sum,
)
