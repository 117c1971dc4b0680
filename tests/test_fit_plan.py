"""scripts/planner/fit.py (scripts/fit_plan.py, `scripts/bench.py --plan --gpu NAME`): its memory against the peak
measured here for four configs (dense, MoE, GRPO, distillation with its teacher), its FLOPs against a hand count, the
extra models' sizes against the models themselves, the corpus's tokens from the token cache, the cheapest change that
makes a run fit."""
import json
import os

import pytest
import torch

from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights import save_weights_file
from scripts.planner.fit import ALLOCATOR_SLACK, CUDA_CONTEXT_GIB, corpus_tokens, estimate, memory_parts, stage_plan
from scripts.planner.gpus import GIB
from tests.launch import forked
from tests.weight_files import wider_tokenizer

SMALL = ["--hidden_size", "256", "--num_hidden_layers", "4", "--accumulation_steps", "1", "--dtype", "float32",
         "--device", "cpu"]
CONFIGS = {  # name: (stage, flags); GRPO's prompts are cut at 32 tokens, so its rows are as long as the plan's
    "dense": ("pretrain", SMALL + ["--batch_size", "8", "--max_seq_len", "256"]),
    "moe": ("pretrain", SMALL + ["--batch_size", "8", "--max_seq_len", "256", "--use_moe", "1"]),
    "grpo": ("grpo", SMALL + ["--max_gen_len", "64", "--num_generations", "4", "--max_seq_len", "32"]),
    # the teacher (hidden 512, 8 layers: 30M parameters, 0.11 GiB) is a quarter of the peak: leaving it out misses
    "distillation": ("distillation", SMALL + ["--batch_size", "8", "--max_seq_len", "128"]),
}
TEACHER = dict(hidden_size=512, num_hidden_layers=8)


def write_teacher(folder, **fields):
    """A real teacher weights file (random init) and its sidecar, as train_sft.py writes them."""
    torch.manual_seed(0)
    config = MiniMindConfig(**fields)
    path = os.path.join(folder, "teacher.pth")
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_memory_within_15_percent_of_the_measured_peak(tmp_path, name):
    """The measured peak is the most bytes of tensors alive at once after the data were loaded (tests/memory_entry.py:
    torch's profiler over the CPU allocator; on a GPU, torch.cuda.max_memory_allocated): the model(s), optimizer,
    activations, rollouts; the estimate's parts summed."""
    stage, flags = CONFIGS[name]
    if stage == "distillation":
        flags = flags + ["--teacher_weight", write_teacher(str(tmp_path), **TEACHER)]
    out = str(tmp_path / "memory.json")
    proc = forked("tests/memory_entry.py", [*flags, "--from_weight", "none", "--max_steps", "3", "--log_interval", "1",
                                            "--save_dir", str(tmp_path / "out"), "--checkpoint_dir",
                                            str(tmp_path / "ckpt"), "--cache_dir", str(tmp_path / "cache")],
                  env=dict(MINIMIND_TEST_STAGE=f"train_{stage}", MINIMIND_TEST_MEMORY_OUT=out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out) as f:
        measured = json.load(f)
    peak = measured["peak_bytes"]
    plan, run = stage_plan(stage, flags, 1)
    parts, _ = memory_parts(plan, plan.model.config, run)
    predicted = sum(parts.values())
    assert measured["allocations"] > 1000 and peak > 0.2 * GIB  # three training steps' tensors, not noise
    print(f"{name}: estimate {predicted / GIB:.4f} GiB, measured {peak / GIB:.4f} GiB")
    assert abs(predicted / peak - 1) < 0.15, (name, predicted / GIB, peak / GIB, parts)
    if stage == "distillation":  # the teacher's part is what makes the estimate right, not slack in the others
        assert abs((predicted - parts["teacher"]) / peak - 1) > 0.15


TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads", "2",
        "--max_seq_len", "128", "--batch_size", "4", "--accumulation_steps", "2", "--packing", "1"]


def test_flops_and_epoch_time_by_hand():
    """Per trained token: 6 x (the matmul weights a token passes: q, k, v, o of 64x64, 64x32, 64x32, 64x64 and the
    MLP's 3 x 64x256, two layers, the lm_head 6400x64) + 6 x layers x q width x length (causal attention, forward
    and backward); the epoch: that x the corpus's tokens / (peak x MFU)."""
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256
    hand = 6 * (2 * per_layer + 6400 * 64) + 6 * 2 * 64 * 128
    out = estimate("pretrain", TINY, 1, "H100", mfu=0.25, usd_per_hour=3.0, data_tokens=(10 ** 9, 1000, "given"))
    assert out["train_flops_per_token"] == hand
    hours = hand * 10 ** 9 / (989.4e12 * 0.25) / 3600
    assert out["epoch_hours"] == pytest.approx(hours, rel=1e-12)
    assert out["epoch_usd"] == pytest.approx(3.0 * hours, rel=1e-12)
    assert out["params_active"] == out["params_total"]  # dense


def test_the_planner_counts_the_embedding_its_tokenizer_gives(tmp_path):
    """The plan's model follows --tokenizer_path as the trainer's does: 6,401 ids -> a 6,464-row lm_head (101 x 64)
    in the FLOPs' hand count, and 64 x 64 more parameters (the tied embedding) than with model/'s 6,400."""
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256
    wide = estimate("pretrain", TINY + ["--tokenizer_path", wider_tokenizer(tmp_path / "wide", 1)])
    assert wide["train_flops_per_token"] == 6 * (2 * per_layer + 6464 * 64) + 6 * 2 * 64 * 128
    assert wide["params_total"] - estimate("pretrain", TINY)["params_total"] == 64 * 64


def test_moe_active_parameters_by_hand():
    """MoE (the config's experts and top-k): a token passes the shared parts and top-k of the routed experts."""
    out = estimate("pretrain", TINY + ["--use_moe", "1"])
    plan, _ = stage_plan("pretrain", TINY + ["--use_moe", "1"], 1)
    c = plan.model.config
    routed_per_layer = 3 * 64 * c.moe_intermediate_size * c.num_experts
    skipped = 2 * routed_per_layer * (c.num_experts - c.num_experts_per_tok) / c.num_experts
    assert out["params_total"] - out["params_active"] == pytest.approx(skipped, rel=1e-12)


def test_the_cheapest_change_is_the_first_that_fits():
    """A GRPO run of the 104M model (fp32) does not fit a 24 GiB card at its defaults; the change found fits what the
    card holds for tensors, and the change before it in the order (a micro-batch twice as large) does not."""
    flags = ["--hidden_size", "768", "--num_hidden_layers", "16", "--device", "cpu"]
    out = estimate("grpo", flags, 1, "4090")
    assert not out["fits"]
    fix = out["cheapest_fix"]["flags"].split()
    assert fix[:2] == ["--batch_size", "1"]  # the script's 2 halved
    plan, run = stage_plan("grpo", flags + fix, 1)
    usable = (24 * GIB - CUDA_CONTEXT_GIB * GIB) / (1 + ALLOCATOR_SLACK)  # the card less the context and slack
    assert out["usable_gib"] * GIB == pytest.approx(usable, rel=1e-12)
    assert sum(memory_parts(plan, plan.model.config, run)[0].values()) <= usable


def test_extra_models_by_hand(tmp_path):
    """The teacher's bytes are its parameters (counted on the model the trainer builds) x 4 (fp32), from its file or,
    not at hand, from the --teacher_* fields; PPO's value head trains hidden + 1 parameters at 16 bytes each (fp32
    weight, gradient and two AdamW moments); a reward model's folder is sized by its own config (Llama: a hand count);
    DPO's reference is not beside the policy in training."""
    flags = TINY[:-2] + ["--dtype", "float32", "--device", "cpu"]  # unpacked rows: every stage takes them
    fields = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    teacher_params = sum(p.numel() for p in MiniMindForCausalLM(MiniMindConfig(**fields)).parameters())
    from_file = estimate("distillation", flags + ["--teacher_weight", write_teacher(str(tmp_path), **fields)])
    not_at_hand = estimate("distillation", flags + ["--teacher_weight", str(tmp_path / "absent.pth")],
                           teacher=dict(fields, use_moe=False))
    student = estimate("sft", flags)["train_flops_per_token"]
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 448  # q, k, v, o; the MLP (ceil(128 pi / 64) x 64)
    teacher_forward = 2 * (3 * per_layer + 6400 * 128) + 2 * 3 * 128 * 128  # + causal attention at 128 positions
    for out in (from_file, not_at_hand):
        assert out["memory_gib"]["teacher"] * GIB == pytest.approx(4 * teacher_params, rel=1e-12)
        assert out["train_flops_per_token"] == pytest.approx(student + teacher_forward, rel=1e-12)
    assert "not at hand" in not_at_hand["notes"][0] and "absent" not in not_at_hand["notes"][0]

    assert estimate("ppo", flags)["memory_gib"]["value_head"] * GIB == pytest.approx(16 * 65, rel=1e-12)

    from transformers import LlamaConfig
    LlamaConfig(vocab_size=6400, hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_labels=1).save_pretrained(tmp_path / "rm")
    layer = 96 * 96 * 2 + 96 * 48 * 2 + 3 * 96 * 256 + 2 * 96  # q, o; k, v; the MLP; two norms
    hand = 6400 * 96 + 2 * layer + 96 + 96  # embeddings, layers, final norm, the score head (1 label)
    out = estimate("grpo", flags + ["--reward_model", str(tmp_path / "rm")])
    assert out["memory_gib"]["reward_model"] * GIB == pytest.approx(4 * hand, rel=1e-12)
    dpo = estimate("dpo", flags)
    assert "reference" not in dpo["memory_gib"] and dpo["notes"][0].startswith("reference: its log-probs")


def test_corpus_tokens_from_the_token_cache(tmp_path):
    """With the trainer's token cache of the file there (built by the dataset the trainer uses), the tokens and
    documents are the cache's, counted from its arrays; without it, a sample."""
    from transformers import AutoTokenizer

    from dataset.lm_dataset import PretrainDataset
    tokenizer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model")
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of a small corpus, " * (i % 5 + 1)}) + "\n"
                            for i in range(40)))
    before = corpus_tokens(str(data), tokenizer, cache_dir=str(tmp_path), kinds=("pretrain",))
    assert before[2] == "counted"  # the whole file tokenized here: bos + text + eos per line, as the cache holds
    ds = PretrainDataset(str(data), AutoTokenizer.from_pretrained(tokenizer), max_length=64,
                         cache_dir=str(tmp_path))
    tokens, documents, how = corpus_tokens(str(data), tokenizer, cache_dir=str(tmp_path), kinds=("pretrain",))
    assert how.startswith("the token cache corpus.jsonl.pretrain.")
    assert (tokens, documents) == (int(ds.offsets[-1]), len(ds.offsets) - 1) == (before[0], 40)
