#!/bin/bash
# Example Slurm batch script: 2 nodes x 8 GPUs, dp2 x tp2 x pp2 x cp2 = 16 processes.
# Submit with: sbatch scripts/slurm_train.sh
#SBATCH --job-name=minimind-4d
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR}"
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=8

# one torchrun per node; torchrun starts the 8 local workers and meets the other node at the endpoint
srun torchrun \
    --nnodes "$SLURM_NNODES" --nproc_per_node 8 \
    --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "${HEAD_NODE}:29500" \
    trainer/train_pretrain.py --tp 2 --pp 2 --cp 2 \
    --data_path dataset/pretrain_hq.jsonl --hidden_size 768 --num_hidden_layers 16 \
    --max_seq_len 2048 --batch_size 4 --accumulation_steps 8 --packing 1 --use_wandb
