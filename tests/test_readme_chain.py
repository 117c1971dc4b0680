"""README.md's small chain, run as written there (smaller and for 2 steps a stage): every stage starts from the file
the stage before it wrote (its start line names the path and the sha256 of the bytes it read), the outputs are
where the README says, and a stage without its predecessor names the files of other sizes and the flags to use."""
import hashlib
import os
import re
import shlex

from scripts import report
from tests.helpers.launch import ROOT, forked, python
from tests.helpers.readme_lines import own_corpus, quick_start, readme_chain, readme_text

# the README's size, and the test's: the file names follow (_256 -> _64)
SMALLER = [("--hidden_size 256", "--hidden_size 64 --num_attention_heads 4 --num_key_value_heads 2"),
           ("--num_hidden_layers 4", "--num_hidden_layers 2"), ("_256", "_64")]
# the trainers' outputs and caches in the test's folder (the command's own flags come first, these win)
TRAINER_FLAGS = "--max_steps 2 --dtype float32 --save_dir out --checkpoint_dir checkpoints --cache_dir cache"


def sha12(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def run(line, cwd):
    for old, new in SMALLER:
        line = line.replace(old, new)
    script, *args = shlex.split(line, comments=True)  # a line's comment: what it prints
    extra = TRAINER_FLAGS if script.startswith("trainer/") else "--save_dir out --temperature 0 --max_new_tokens 8" \
        if script.endswith(("eval_llm.py", "eval_toolcall.py")) else ""
    proc = forked(script, args + shlex.split(extra), cwd=cwd, timeout=300)
    assert proc.returncode == 0, (line, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


def started_from(output, path, digests):
    """The output's start line names `path` and the digest it had when its stage wrote it."""
    return f"weights {path} (sha256 {digests[path]})" in output


def test_the_readme_chain_runs_each_stage_from_the_one_before(tmp_path):
    chain = readme_chain()
    assert chain[0] != quick_start()  # pasted after the quick start, the block does not begin with its refused rerun
    commands = [quick_start()] + chain
    scripts = [line.split()[0] for line in commands]
    assert scripts == ["trainer/train_pretrain.py", "trainer/train_sft.py", "scripts/eval_llm.py",
                       "trainer/train_lora.py",
                       "trainer/train_dpo.py", "trainer/train_reward.py", "trainer/train_pretrain.py",
                       "trainer/train_sft.py", "trainer/train_distillation.py", "trainer/train_gkd.py",
                       "trainer/train_grpo.py", "trainer/train_ppo.py", "trainer/train_agent.py",
                       "scripts/eval_toolcall.py", "scripts/eval_llm.py", "scripts/convert_model.py",
                       "scripts/plot_metrics.py"], scripts
    out, digests, outputs = os.path.join(str(tmp_path), "out"), {}, []
    for command in commands:
        outputs.append(run(command, str(tmp_path)))
        for root, _, names in os.walk(out):  # what every weight file held when this stage ended
            digests.update({os.path.join(root, n): sha12(os.path.join(root, n)) for n in names if n.endswith(".pth")
                            and os.path.join(root, n) not in digests})
    w = {name: os.path.join(out, name) for name in ("pretrain_64.pth", "full_sft_64.pth", "pretrain_64_moe.pth",
                                                     "full_sft_64_moe.pth", "lora/lora_identity_64.pth")}
    assert len(outputs) == len(commands) == 17
    (pretrain, sft, sft_chat, lora, dpo, reward, moe, moe_sft, distill, gkd, grpo, ppo, agent, toolcall, chat, export,
     plot) = outputs
    assert f"weights {w['full_sft_64.pth']} (sha256 {digests[w['full_sft_64.pth']]})" in sft_chat
    assert "initialised from --seed" in pretrain and "Done: 2 steps" in pretrain
    assert started_from(sft, w["pretrain_64.pth"], digests)
    assert started_from(lora, w["full_sft_64.pth"], digests) and os.path.isfile(w["lora/lora_identity_64.pth"])
    assert "on 4 modules (o_proj, q_proj in 2 layers)" in lora  # the square layers of 2 blocks (it said "4 layers")
    assert started_from(dpo, w["full_sft_64.pth"], digests) and os.path.isfile(os.path.join(out, "dpo_64.pth"))
    # the pass before DPO's step 1 that the README's times name (minutes at the README's size): its line, then its bar
    assert "reference log-probs: computing them with" in dpo and "`reference log-probs` bar" in readme_text()
    assert "initialised from --seed" in moe and started_from(moe_sft, w["pretrain_64_moe.pth"], digests)
    assert started_from(reward, w["full_sft_64.pth"], digests)
    assert os.path.isfile(os.path.join(out, "reward_64_hf", "config.json"))  # the folder PPO's --reward_model reads
    for student in (distill, gkd):  # the student; the teacher by default:
        assert started_from(student, w["full_sft_64.pth"], digests)
        assert f"teacher {w['full_sft_64_moe.pth']} (sha256 {digests[w['full_sft_64_moe.pth']]})" in student
    assert "reward_model x1" in ppo  # its start line lists the reward model beside the rule rewards
    for stage, weights in ((grpo, "grpo_64.pth"), (ppo, "ppo_actor_64.pth"), (agent, "agent_64.pth")):
        assert started_from(stage, w["full_sft_64.pth"], digests) and os.path.isfile(os.path.join(out, weights))
    agent_weights = os.path.join(out, "agent_64.pth")
    assert f"weights {agent_weights} (sha256 {digests[agent_weights]})" in toolcall  # the agent stage's output
    assert re.search(r"tool-call eval: \d/9 passed", toolcall)
    assert (f"weights {w['full_sft_64.pth']} (sha256 {digests[w['full_sft_64.pth']]}) + LoRA adapter "
            f"{w['lora/lora_identity_64.pth']} (sha256 {digests[w['lora/lora_identity_64.pth']]})") in chat
    assert "verify: max abs logits diff" in export and os.path.isfile(os.path.join(out, "hf_64", "config.json"))
    assert plot.splitlines()[-1] == f"wrote {os.path.join(out, 'chain.png')}"
    assert os.path.isfile(os.path.join(out, "chain.png"))
    for stage in (pretrain, sft, lora, dpo, reward, moe, moe_sft, distill, gkd, grpo, ppo, agent):
        assert "Done: 2 steps" in stage and "preempted" not in stage
    chain_reports_name_their_files(out)
    # without the size flags SFT looks for the default model's file and names the one that exists
    missing = forked("trainer/train_sft.py", shlex.split(TRAINER_FLAGS), cwd=str(tmp_path), timeout=120)
    assert missing.returncode == 2 and (
        f"error: --from_weight: {os.path.join(out, 'pretrain_768.pth')} does not exist; {out} has pretrain_64.pth "
        f"(--hidden_size 64), pretrain_64_moe.pth (--hidden_size 64 --use_moe 1): pass its size flags or "
        f"--from_weight {w['pretrain_64.pth']}; ") in missing.stderr, missing.stderr[-2000:]
    # MiniMind's name for the SFT stage, run from trainer/ as MiniMind's README does
    full_sft = python("trainer/train_full_sft.py", shlex.split(TRAINER_FLAGS.replace(" out ", f" {out} ")) + [
        "--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--num_hidden_layers",
        "2", "--save_weight", "minimind_name", "--checkpoint_dir", str(tmp_path / "ck2"), "--cache_dir",
        str(tmp_path / "cache")], cwd=os.path.join(ROOT, "trainer"), timeout=300)  # a fresh python in trainer/
    assert full_sft.returncode == 0 and started_from(full_sft.stdout, w["pretrain_64.pth"], digests), \
        full_sft.stderr[-2000:]
    assert os.path.isfile(os.path.join(out, "minimind_name_64.pth"))


def chain_reports_name_their_files(out):
    """scripts/report.py on every stage's metrics file of the chain: each page names the run's metrics, its weights'
    sidecar and rank-0 log where the stage wrote them, the plots beside it, and no health line (a clean run)."""
    runs = sorted(n[:-len("_metrics.jsonl")] for n in os.listdir(out) if n.endswith("_metrics.jsonl"))
    assert {"pretrain_64", "full_sft_64", "dpo_64", "grpo_64", "ppo_actor_64", "agent_64"} <= set(runs), runs
    for run in runs:
        metrics = os.path.join(out, f"{run}_metrics.jsonl")
        report.main([metrics])
        page = open(os.path.join(out, f"{run}_report.md")).read()
        assert f"- metrics: `{metrics}`" in page and os.path.isfile(os.path.join(out, f"{run}_report.png")), run
        assert f"![curves]({run}_report.png)" in page, run
        for kind, path in (("weights", os.path.join(out, f"{run}.pth")), ("sidecar", os.path.join(out, f"{run}.json")),
                           ("log", os.path.join(out, "logs", f"{run}_rank_0.log"))):
            assert (f"- {kind}: `{path}`" in page) == os.path.isfile(path), (run, kind)
        assert page.split("## Health", 1)[1].split("\n## ", 1)[0].strip() == "- no health line", run


def test_the_own_corpus_path_runs_on_a_small_corpus(tmp_path):
    """The README's own-corpus block after curation (datatrove's run: tests/test_curate_data.py), as written there on a
    curated folder of 142 documents: its tokenizer line, then its last pretraining line (the small corpus's flags),
    smaller and for 2 steps; the default global batch of 256 rows is more than such a corpus holds."""
    lines = own_corpus()
    assert [line.split()[0] for line in lines] == ["scripts/curate_data.py", "scripts/train_tokenizer.py",
                                                  "trainer/train_pretrain.py", "trainer/train_pretrain.py"]
    with open(os.path.join(ROOT, "dataset", "pretrain_demo.jsonl"), encoding="utf-8") as f:
        rows = [next(f) for _ in range(142)]
    os.makedirs(tmp_path / "curated")
    (tmp_path / "curated" / "00000.jsonl").write_text("".join(rows), encoding="utf-8")  # as curate_data writes it
    run(lines[1], str(tmp_path))
    output = run(lines[-1], str(tmp_path))
    assert f"tokenizer {tmp_path / 'out' / 'my_tokenizer'}" in output and "Done: 2 steps" in output
