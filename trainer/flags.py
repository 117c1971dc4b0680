"""The flag schema: every flag of the training scripts, its default and its help; nothing else."""
import argparse
import sys

import torch

from trainer.config_file import config_argv


def add_train_args(parser, **defaults):
    """MiniMind's flags (plus ours); `defaults` sets the script-specific values."""
    a = parser.add_argument
    a("--save_dir", default=None, help="where weights and metrics go (default: out/ in the repo)")
    a("--checkpoint_dir", default=None, help="where resume checkpoints go (default: checkpoints/ in the repo)")
    a("--save_weight", default="pretrain", help="weight file prefix: <save_dir>/<save_weight>_<hidden>[_moe].pth")
    a("--epochs", type=int, default=1, help="passes over the training data")
    a("--batch_size", type=int, default=32, help="samples per micro-batch per data-parallel rank")
    a("--learning_rate", type=float, default=5e-4, help="peak learning rate of the schedule (MiniMind's cosine)")
    a("--warmup_steps", type=int, default=0, help="linear warm-up steps before the --lr_schedule")
    a("--device", default="cuda:0" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    a("--dtype", default="auto", help="auto|bfloat16|float16|float32 (auto: bf16 where the device has it)")
    a("--num_workers", type=int, default=0, help="DataLoader worker processes")
    a("--accumulation_steps", type=int, default=8, help="micro-batches per optimizer step (pipeline: micro-batches)")
    a("--grad_clip", type=float, default=1.0, help="clip the global gradient norm to this value")
    a("--weight_decay", type=float, default=0.01, help="decoupled weight decay (adamw, lamb, muon), L2 term of "
      "sgd and lars")
    a("--log_interval", type=int, default=None, help="optimizer steps between metrics records (default: 100, or "
      "fewer so that an epoch has at least ten)")
    a("--save_interval", type=int, default=100, help="optimizer steps between weights + resume checkpoints")
    a("--hidden_size", type=int, default=768, help="model width")
    a("--num_hidden_layers", type=int, default=8, help="decoder blocks")
    a("--num_attention_heads", type=int, default=8, help="query heads")
    a("--num_key_value_heads", type=int, default=4, help="key/value heads (GQA)")
    a("--intermediate_size", type=int, default=None, help="dense MLP width (default: the model's rule)")
    a("--moe_intermediate_size", type=int, default=None, help="expert MLP width (default: the model's rule)")
    a("--head_dim", type=int, default=None, help="attention head size (default: hidden_size / heads)")
    a("--max_seq_len", type=int, default=340, help="tokens per sample")
    a("--use_moe", type=int, default=0, choices=[0, 1], help="mixture-of-experts MLPs")
    a("--num_experts", type=int, default=4, help="experts per MoE layer")
    a("--num_experts_per_tok", type=int, default=1, help="experts each token is routed to")
    a("--from_weight", default="none", help="weight prefix in save_dir, a .pth path, or none")
    a("--from_resume", default="0",
      help="1: continue from the newest complete checkpoint; auto: that, or start fresh if there is none "
      "(for torchrun --max-restarts); or a step_<N> directory: continue from that checkpoint (later ones of "
      "this run are dropped at its first save)")
    a("--max_steps", type=int, default=0, help="stop after this many optimizer steps, the lr schedule's length "
      "(0: run all epochs)")
    a("--max_tokens", type=int, default=0, help="stop after the optimizer step that reaches this many target tokens "
      "(all ranks; 0: no token budget); the lr schedule keeps its length")
    a("--seed", type=int, default=42, help="model init and data order (a pure function of seed and epoch)")
    a("--metrics_file", default=None,
      help="JSONL records (default: <save_dir>/<save_weight>_<hidden>[_moe]_metrics.jsonl)")
    a("--save_dtype", default="float16", choices=["float16", "bfloat16", "float32"], help="dtype of the saved weights")
    a("--use_compile", type=int, default=0, choices=[0, 1], help="torch.compile each decoder block")
    a("--grad_checkpointing", default="0", choices=["0", "1", "none", "full", "attention", "mlp"],
      help="recompute activations in backward: full (1) each decoder block (least memory, ~1/3 more compute), "
      "attention or mlp only that sub-layer of each block; 0/none: off")
    a("--dropout", type=float, default=0.0, help="dropout on the embeddings and each attention output (MiniMind's "
      "config.dropout; draws from each rank's RNG, so layouts differ from one process when > 0)")
    a("--deterministic", type=int, default=0, choices=[0, 1], help="torch.use_deterministic_algorithms (CUDA: "
      "CUBLAS_WORKSPACE_CONFIG, no cuDNN autotuning); an op without a deterministic kernel then raises")
    a("--loss_chunk_size", type=int, default=1024,
      help="lm_head + cross-entropy over chunks of this many tokens, never the full logits (0: off)")
    add_optimizer_args(parser)
    add_data_args(parser)
    add_tracking_args(parser)
    add_checkpoint_args(parser)
    add_callback_args(parser)
    add_guard_args(parser)
    add_parallel_args(parser)
    a("--config", default=None, help="a YAML file of flags (the same names, e.g. learning_rate: 1.0e-3); the command "
      "line overrides it; each run writes its flags to <checkpoint_dir>/<save_weight>_<hidden>[_moe]_config.yaml, "
      "which repeats it")
    parser.set_defaults(**defaults)
    return parser


def add_optimizer_args(parser):
    """The optimizer and the lr schedule (trainer/optim.py, trainer/schedule.py)."""
    a = parser.add_argument
    a("--optimizer", default="adamw", choices=["adamw", "lamb", "lars", "sgd", "muon"],
      help="adamw, sgd (torch.optim); muon (torch.optim.Muon on the decoder blocks' matrices, AdamW on the rest; "
      "needs a torch that has it, 2.9+, else one error line); lamb, lars (the papers' trust-ratio updates, written "
      "here: torch has none)")
    a("--beta1", type=float, default=0.9, help="first-moment decay of adamw, lamb and muon's AdamW part")
    a("--beta2", type=float, default=0.999, help="second-moment decay of adamw, lamb and muon's AdamW part")
    a("--eps", type=float, default=1e-8, help="denominator epsilon of adamw and lamb")
    a("--momentum", type=float, default=None, help="momentum of sgd, lars and muon (default: 0.9; muon 0.95)")
    a("--lr_schedule", default="cosine", choices=["cosine", "linear", "wsd", "constant"],
      help="after --warmup_steps: cosine (MiniMind's), linear decay, wsd (warmup-stable-decay: the peak, then a "
      "linear decay over the last --wsd_decay_fraction), constant; down to --min_lr")
    a("--min_lr", type=float, default=None, help="the schedule's last lr (default: MiniMind's 0.1 x the peak)")
    a("--wsd_decay_fraction", type=float, default=0.1, help="--lr_schedule wsd: the fraction of the steps after "
      "warm-up that decays")
    a("--lr_scaling", default="none", choices=["none", "linear", "sqrt"],
      help="scale --learning_rate by global batch / --base_batch (linear) or its square root (sqrt)")
    a("--base_batch", type=int, default=None, help="the global batch in samples that --learning_rate was tuned "
      "for (with --lr_scaling)")


def add_callback_args(parser):
    """Best checkpoint, early stopping and a user's callbacks (trainer/callbacks.py)."""
    a = parser.add_argument
    a("--save_best", type=int, default=0, choices=[0, 1], help="keep the checkpoint with the lowest eval_loss "
      "(never pruned, in <checkpoint_dir>/<run>/best.json) and its weights as <save_weight>_<hidden>[_moe]_best.pth")
    a("--early_stop_patience", type=int, default=0, help="stop after this many --eval_interval evals without an "
      "eval_loss below the best by more than --early_stop_min_delta (0: off)")
    a("--early_stop_min_delta", type=float, default=0.0, help="the improvement early stopping asks for")
    a("--callbacks", default=None, help="comma list of FILE.py:NAME, a class (made with no arguments) or object "
      "with any of on_step_end, on_eval, on_save, on_train_end (trainer/callbacks.py)")


def add_data_args(parser):
    """Training and held-out data, the tokenizer and the token cache (dataset/)."""
    a = parser.add_argument
    a("--data_path", default=None, help="JSONL, parquet or token shard; a directory, a glob, or a comma list with "
      "optional weights, e.g. a.jsonl:0.7,shards/*.parquet:0.3 (default: the embedded demo corpus)")
    a("--eval_data_path", default=None, help="held-out data for eval_loss / eval_ppl, same forms (default: none)")
    a("--num_proc", type=int, default=None, help="tokenizer worker processes per rank while building the token "
      "cache (default: the cores available / local ranks)")
    a("--eval_interval", type=int, default=0, help="optimizer steps between validation runs (0: only at the end)")
    a("--eval_batches", type=int, default=50, help="batches per validation run")
    a("--packing", type=int, default=0, choices=[0, 1], help="fill whole rows (max_seq_len tokens): pretraining "
      "joins documents; SFT packs whole conversations, on by default there (chat rows are mostly far shorter)")
    a("--doc_mask", type=int, default=1, choices=[0, 1], help="with --packing 1: a token attends only to earlier "
      "tokens of its own document and position ids restart at each document (0: the whole row is one sequence)")
    a("--skip_bad_lines", type=int, default=0, choices=[0, 1], help="skip malformed data lines instead of stopping")
    a("--cache_dir", default=None, help="token cache of the datasets (default: dataset/.cache in the repo)")
    a("--tokenizer_path", default=None, help="Hugging Face tokenizer folder (default: the one the starting weights "
      "were trained with, as their sidecar records; else model/ in the repo)")
    a("--force_tokenizer", type=int, default=0, choices=[0, 1], help="1: use the tokenizer folder given even where "
      "its tokenizer.json differs from the one the starting weights were trained with")


def add_tracking_args(parser):
    """Where metrics and traces go besides the metrics file (trainer/tracking.py)."""
    a = parser.add_argument
    a("--tensorboard_dir", default=None, help="also write TensorBoard scalars here (default: off)")
    a("--profile_steps", default=None,
      help="A:B: torch.profiler trace of optimizer steps A to B under <save_dir>/profile (default: off)")
    a("--use_wandb", action="store_true", help="MiniMind's flag: --tracker swanlab (offline when not logged in)")
    a("--wandb_project", default="MiniMind", help="swanlab / wandb project name")
    a("--tracker", default=None, help="comma list of swanlab, wandb (offline unless WANDB_MODE=online), "
      "tensorboard (--tensorboard_dir, default <save_dir>/tensorboard), none (default: from --use_wandb and "
      "--tensorboard_dir); the metrics JSONL is always written")
    a("--log_dir", default=None, help="each rank's timestamped log, rank_<N>.log (default: <save_dir>/logs; none: off)")


def add_checkpoint_args(parser):
    """How resume checkpoints and weights are written (trainer/checkpoint.py)."""
    a = parser.add_argument
    a("--keep_checkpoints", type=int, default=3,
      help="complete resume checkpoints kept; older ones are deleted (0: all)")
    a("--async_save", type=int, default=0, choices=[0, 1],
      help="write resume checkpoints in the background (dcp.async_save)")
    a("--save_weights_every", type=int, default=0,
      help="also write the <save_weight>.pth weights every N steps (0: at the end only)")
    a("--save_every_minutes", type=float, default=10, help="also save a resume checkpoint at the step after which the "
      "next would end more than this many minutes after the last save, so that a slow run loses little (0: off)")


def add_guard_args(parser):
    """Preemption, the non-finite step guard and the replica check (trainer/guard.py)."""
    a = parser.add_argument
    a("--grace_seconds", type=float, default=60,
      help="after SIGTERM/SIGINT: seconds to finish the step and save before exiting non-zero")
    a("--max_bad_steps", type=int, default=5, help="stop after this many non-finite (skipped) optimizer steps in a row")
    a("--check_replicas", type=int, default=0,
      help="every N steps compare parameter checksums across data-parallel replicas (0: off)")


def add_parallel_args(parser):
    """The layout flags (4D parallelism, ZeRO, collectives)."""
    a = parser.add_argument
    a("--dist_timeout", type=int, default=600, help="seconds a collective may hang once training runs (from step 2)")
    a("--dist_init_timeout", type=int, default=1800, help="seconds for start-up to the end of the first step "
      "(rendezvous, token cache, loading weights, compile) before a hung collective fails")
    a("--tf32", type=int, default=1, choices=[0, 1], help="CUDA: fp32 matmuls in TF32 (0: strict fp32)")
    a("--tp", type=int, default=1, help="tensor-parallel degree")
    a("--pp", type=int, default=1, help="pipeline-parallel degree (micro-batches = --accumulation_steps)")
    a("--cp", type=int, default=1, help="context-parallel (ring attention) degree")
    a("--pp_schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved1f1b"], help="pipeline schedule")
    a("--sequence_parallel", type=int, default=0, choices=[0, 1], help="shard norms along the sequence (tp > 1)")
    a("--zero_stage", type=int, default=0, help="0: DDP, 1: sharded optimizer, 2: +gradients, 3: +parameters (FSDP2)")
    a("--grad_compression", default="none", help="none|bf16|powersgd (DDP communication hook)")
    a("--powersgd_rank", type=int, default=1, help="--grad_compression powersgd: rank of the low-rank approximation")
    a("--powersgd_start_step", type=int, default=1000, help="--grad_compression powersgd: optimizer steps of exact "
      "all-reduce before compression starts (warm-up; a resumed run warms up again)")
    a("--cpu_offload", type=int, default=0, choices=[0, 1], help="FSDP2 (--zero_stage 2/3): keep sharded parameters, "
      "gradients and optimizer state in CPU memory (CUDA only; the optimizer step runs on the CPU)")


def add_lora_args(parser):
    """train_lora.py: the adapters (model/lora.py)."""
    a = parser.add_argument
    a("--lora_name", default="lora_identity", help="adapter name: <save_dir>/lora/<lora_name>_<hidden>[_moe].pth "
      "(MiniMind's format) and a PEFT folder <lora_name>_<hidden>[_moe]_peft beside it")
    a("--lora_rank", type=int, default=16, help="rank of each adapter (A: in -> rank, B: rank -> out)")
    a("--lora_alpha", type=float, default=None, help="scale = alpha / rank (default: alpha = rank, MiniMind's scale 1)")
    a("--lora_dropout", type=float, default=0.0, help="dropout on the adapters' input")
    a("--lora_targets", default=None, help="comma list of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj "
      "(MoE experts included; default: MiniMind's choice, every square linear layer)")


def add_dpo_args(parser):
    """train_dpo.py: the preference loss and its reference model (trainer/dpo.py)."""
    a = parser.add_argument
    a("--beta", type=float, default=0.15, help="DPO's beta: how far the policy may move from the reference (> 0)")
    a("--ref_weight", default=None, help="the reference model: a weight prefix in save_dir, a .pth, a resume "
      "checkpoint step_<N> or an HF folder (default: the starting weights, --from_weight)")


def add_distillation_args(parser):
    """train_distillation.py: the teacher and the mixed loss (trainer/distillation.py); MiniMind's defaults."""
    a = parser.add_argument
    a("--teacher_weight", default=None,
      help="the teacher: a .pth, a resume checkpoint (step_<N> folder or *_resume.pth), a Hugging Face folder, or a "
      "weight name in save_dir (default: MiniMind's teacher, the MoE SFT model of the student's width, "
      "<save_dir>/full_sft_<hidden>_moe.pth); any size, dense or MoE, with the student's tokenizer")
    a("--alpha", type=float, default=0.5, help="loss = alpha * CE + (1 - alpha) * T^2 * KL(teacher || student)")
    a("--temperature", type=float, default=1.5, help="softmax temperature T of both models in the KL")


def add_rollout_args(parser):
    """The RL stages' rollouts and rewards (trainer/rl_stage.py, rollout.py, rewards.py); MiniMind's defaults."""
    a = parser.add_argument
    a("--max_gen_len", type=int, default=1024, help="tokens generated at most per completion (agent: per turn)")
    a("--temperature", type=float, default=0.8, help="sampling temperature; the log-probs are taken at it too")
    a("--top_p", type=float, default=1.0, help="nucleus sampling mass (1: the whole vocabulary)")
    a("--thinking_ratio", type=float, default=0.9, help="share of prompts that open the think block")
    a("--reward", default="rule", choices=["rule", "none"], help="rule: MiniMind's rule terms (GRPO, PPO: length, "
      "think format, repetition; agent: the tool-call rule against the row's gt), offline")
    a("--reward_model", default=None, help="a local Hugging Face AutoModelForSequenceClassification folder (its "
      "first logit is a reward)")
    a("--reward_fn", action="append", default=None, help="FILE.py:NAME, a reward function NAME(prompts, completions, "
      "**columns) -> list[float] (TRL's convention); repeat for several")
    a("--reward_weights", default=None, help="comma list, one weight per reward function in the order: rule terms "
      "(GRPO, PPO: 3; agent: 1), reward model, each --reward_fn (default: 1 each)")
    a("--rollout_engine", default="torch", choices=["torch", "sglang", "vllm"], help="torch: generate in-process; "
      "sglang|vllm: an OpenAI-compatible server at --rollout_url, synced through an HF export folder")
    a("--rollout_url", default=None, help="the rollout server's base URL (--rollout_engine sglang|vllm)")
    a("--rollout_timeout", type=float, default=600, help="seconds a rollout server request may take")


def add_group_args(parser):
    """GRPO's group-relative loss (trainer/grpo.py), which the agent stage trains with too; TRL's names."""
    a = parser.add_argument
    a("--num_generations", type=int, default=6, help="completions per prompt (a group, on one data-parallel rank)")
    a("--loss_type", default="cispo", choices=["grpo", "dapo", "dr_grpo", "bnpo", "cispo"],
      help="policy loss and its normaliser, as TRL defines them")
    a("--beta", type=float, default=0.1, help="weight of the k3 KL to the reference (the starting weights); 0 loads "
      "no reference")
    a("--epsilon", type=float, default=0.2, help="lower clip of the ratio: 1 - epsilon")
    a("--epsilon_high", type=float, default=None, help="upper clip of the ratio: 1 + epsilon_high (cispo: the "
      "ratio's cap; default: 5.0 for cispo, --epsilon otherwise)")
    a("--num_iterations", type=int, default=1, help="optimizer steps on each rollout (> 1: the ratio moves from 1 "
      "and clipping acts)")


def add_grpo_args(parser):
    """train_grpo.py: rollouts, rewards and the policy loss (trainer/grpo.py, rollout.py, rewards.py); MiniMind's
    defaults, TRL's names."""
    add_rollout_args(parser)
    add_group_args(parser)


def add_ppo_args(parser):
    """train_ppo.py: the value head, GAE and the clipped losses (trainer/ppo.py); MiniMind's defaults and names."""
    add_rollout_args(parser)
    a = parser.add_argument
    a("--clip_epsilon", type=float, default=0.2, help="the policy ratio's clip range: [1 - clip, 1 + clip]")
    a("--cliprange_value", type=float, default=0.2, help="the value prediction's clip range around the rollout's")
    a("--vf_coef", type=float, default=0.5, help="weight of the value loss beside the policy loss")
    a("--kl_coef", type=float, default=0.02, help="per-token KL penalty to the reference in the reward (the starting "
      "weights); 0 loads no reference")
    a("--gamma", type=float, default=1.0, help="GAE's discount")
    a("--lam", type=float, default=0.95, help="GAE's lambda")
    a("--ppo_update_iters", type=int, default=2, help="optimizer steps on each rollout (each over the step's whole "
      "rollout: MiniMind's mini_batch_size = batch_size)")
    a("--early_stop_kl", type=float, default=0.25, help="roll out anew once the policy's approx KL to the rollout's "
      "exceeds this (checked before each further update on a rollout; 0: off)")


def add_agent_args(parser):
    """train_agent.py: multi-turn tool rollouts (trainer/agent.py) with GRPO's loss; MiniMind's defaults."""
    add_rollout_args(parser)
    add_group_args(parser)
    a = parser.add_argument
    a("--max_turns", type=int, default=3, help="model turns per episode (a turn that calls a tool gets the mock "
      "tool's answer and a next turn)")
    a("--max_total_len", type=int, default=2500, help="tokens of a whole episode at most (prompt, turns, tool "
      "answers); a turn that would pass it is cut there")


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """--help adds "(default: X)" to a flag's help unless the help says its default itself (a None default means
    "unset", which the help explains: "(default: out/ in the repo)", not "... (default: None)")."""

    def _get_help_string(self, action):
        if "default:" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse_args(description, stage_args=None, **defaults):
    """The script's flags (plus a stage's own, `stage_args(parser)`, e.g. add_dpo_args); --help shows every default."""
    parser = argparse.ArgumentParser(description=description, formatter_class=DefaultsOnce)
    add_train_args(parser)
    if stage_args is not None:
        stage_args(parser)
    parser.set_defaults(**defaults)
    return parser.parse_args(config_argv(parser, sys.argv[1:]))


MODEL_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "moe_intermediate_size", "head_dim", "use_moe", "num_experts", "num_experts_per_tok")
