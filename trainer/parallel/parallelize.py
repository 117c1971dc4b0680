"""Applies the parallel dimensions to a plain model in a fixed order (torchtitan's parallelize_llama).

Order: pipeline split -> tensor parallel -> expert parallel -> context parallel -> activation checkpointing -> compile
-> data parallel (DDP / ZeRO / FSDP2). For one process every step is skipped: the plain model trains. A dimension's
module is read only when its size is above 1 (mesh.py dimension_module).
"""
from trainer.parallel.mesh import dimension_module, grad_reduce_factor
from trainer.parallel.perf import apply_activation_checkpointing, compile_blocks


def parallelize(model, dims, plan):
    """Shard `model` (plain, on the plan's device) for this rank; returns (model_parts, pipeline or None).

    dims: this rank's ParallelDims; plan: the TrainPlan. The parts keep the full model's parameter
    names; under pp they are this rank's stages, else [model].
    """
    layout, model_plan = plan.layout, plan.model
    used = {name: dimension_module(name) for name in ("pp", "tp", "ep", "cp") if getattr(layout, name) > 1}
    if layout.dp_mode != "none":  # a data-parallel group: dp x cp ranks reduce gradients
        used["dp"] = dimension_module("dp")
    pipeline, parts = None, [model]
    if "pp" in used:
        pipeline = used["pp"].Pipeline(model, dims.group("pp"), layout.pp_schedule, plan.data.num_microbatches,
                                       layout.device, micro_batch_shape=plan.micro_batch_shape,
                                       autocast_dtype=model_plan.autocast_dtype)
        parts = pipeline.stage_modules
        if not plan.data.doc_mask:  # rows are single sequences: no mask, SDPA's causal kernel (cp swaps in its ring)
            for part in parts:
                part.document_mask = dimension_module("cp").no_document_mask
    for part in parts:
        if "tp" in used:
            # a pipeline schedule computes the loss itself: gather the last stage's logits there; under ep the routed
            # experts stay whole (ETP=1: expert parallel shards them, tp ranks run the same tokens)
            used["tp"].apply_tensor_parallel(part, dims.mesh("tp"), sequence_parallel=layout.sequence_parallel,
                                             loss_parallel=layout.pp == 1, shard_experts=layout.ep == 1)
        if "ep" in used:  # experts over the ep ranks; the trainer scales the loss by dp*cp for DDP's average
            used["ep"].apply_expert_parallel(part, dims.group("ep"),
                                             grad_divide=grad_reduce_factor(layout))
        if "cp" in used:
            used["cp"].apply_context_parallel(part, dims.mesh("cp"), doc_mask=plan.data.doc_mask)
        if model_plan.grad_checkpointing:
            apply_activation_checkpointing(part, model_plan.grad_checkpointing)
        if model_plan.use_compile:
            compile_blocks(part)
    experts = (lambda part: [name for name, _ in used["ep"].expert_params(part)]) if "ep" in used else (lambda part: ())
    if "dp" in used:
        # FSDP2 gathers parameters in the autocast dtype and reduces gradients in fp32
        parts = [used["dp"].apply_data_parallel(
            part, dims.mesh("dp_cp"), layout.zero_stage, layout.grad_compression, powersgd_rank=layout.powersgd_rank,
            powersgd_start_iter=layout.powersgd_start_step, param_dtype=model_plan.autocast_dtype,
            cpu_offload=layout.cpu_offload, ignored=experts(part)) for part in parts]
    if pipeline is not None:
        pipeline.make_schedule(parts)
    return parts, pipeline
