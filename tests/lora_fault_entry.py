"""trainer/train_lora.py with tests/fault_entry.py's kill injected from outside (MINIMIND_TEST_KILL_AT_STEP, ...)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from tests.fault_entry import KILL_AT_STEP, patch_kill  # noqa: E402
from trainer import train_lora  # noqa: E402
from trainer.launch import main_guard  # noqa: E402


def main():
    if os.environ.get(KILL_AT_STEP) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        patch_kill(int(os.environ[KILL_AT_STEP]), os.environ.get("MINIMIND_TEST_KILL_POINT", "step"),
                   int(os.environ.get("MINIMIND_TEST_KILL_RANK", 0)))
    train_lora.main()


if __name__ == "__main__":
    main_guard(main)
