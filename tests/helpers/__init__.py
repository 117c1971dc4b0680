"""What the tests share: launching processes (launch.py), the layout runs (layouts.py), models, weight files,
numerics, disks, serving, the CPU's bf16 probe (cpu_probe.py), and the entry scripts a test runs by path
(fault_entry.py, memory_entry.py, curate_kill.py, curate_worker_modules.py, rollout_server.py). Imported as
`from tests.helpers.launch import ...`; fixtures shared across files live in tests/conftest.py."""
