"""model/atomic.py's file modes: an exported folder's files get the user's umask, as a plain open() would give them,
even the ones a library wrote through its own 0600 temp file (transformers' model.safetensors)."""
import os
import stat

import pytest

from model.atomic import atomic_write_text, files_replaced_in
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM


@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_exported_files_get_the_umask(tmp_path, umask):
    reference = tmp_path / "plain.txt"
    reference.write_text("x")  # a file any program creates: 0666 less the umask
    assert mode(reference) == 0o666 & ~umask
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1))
    folder = tmp_path / "hf"
    with files_replaced_in(str(folder)) as tmp:
        model.save_pretrained(tmp)
        os.chmod(os.path.join(tmp, "config.json"), 0o600)  # as a writer's temp file would leave it
    names = sorted(os.listdir(folder))
    assert "model.safetensors" in names and "config.json" in names
    assert {name: mode(folder / name) for name in names} == {name: mode(reference) for name in names}
    atomic_write_text(str(tmp_path / "index.json"), "{}")
    assert mode(tmp_path / "index.json") == mode(reference)
