"""Build a run's parts from its config and the plugins, in the documented order.

tokenizer -> data -> model (fp32 on the CPU: the exact seeded init, the same global weights for
every layout) -> parallelize (tensor/sequence, pipeline split, recompute) -> device and dtype ->
compile -> gradient buffer (data parallel / distributed optimizer) -> optimizer -> the schedule's
executor -> learning-rate schedule. Nothing here trains; ``Engine`` owns the loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mega.core.config.sections import RunConfig
from mega.core.console.display import Display
from mega.core.plugins.manager import Plugins
from mega.core.plugins.specs import BuildContext, DataRequest
from mega.core.schedules.learning_rate import LRSchedule, resolve_warmup_iters
from mega.core.schedules.samples import schedule_lengths
from mega.core.training.batches import requested_samples
from mega.core.training.compile import compile_model
from mega.core.training.parameter_count import unpadded_parameter_count
from mega.core.training.step import loss_parts, model_forward
from mega.core.training.vocab import padded_vocab_size
from mega.errors import MegaUsageError
from mega.parallel import attention_kernels
from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.data.optimizer import FlatOptimizer
from mega.parallel.dimension import ParallelDimension, chain
from mega.parallel.dimensions import run_dimensions
from mega.parallel.expert.validate import set_graphed_trips
from mega.parallel.parallelize import parallelize
from mega.parallel.pipeline.executor import PipelineExecutor
from mega.parallel.pipeline.setup import PipelineSetup, pipeline_setup
from mega.parallel.pipeline.split import tied_weights
from mega.parallel.sharded_state import vocab_rows
from mega.parallel.topology import Topology

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunParts:
    """Everything a training run steps with, built once."""

    tokenizer: Any
    padded_vocab: int
    vocab_rows: dict[str, int]  # parameters whose rows are the padded vocabulary: real rows
    splits: Any  # DatasetSplits
    model: torch.nn.Module  # this rank's part; global parameter names
    num_parameters: int  # of the whole model, before sharding
    pipeline: PipelineSetup
    executor: PipelineExecutor
    buffer: ParamAndGradBuffer
    optimizer: FlatOptimizer
    lr_schedule: LRSchedule
    flops_per_token: float
    loss_names: tuple[str, ...]  # the model's loss parts, in the order the executor gives them
    prepare_microbatch: Any  # ModelSpec.prepare_microbatch: the host-side step of each batch
    fp8_scaling: Any = None  # --fp8-recipe delayed: DelayedScaling, updated after each step
    # the run's parallel dimensions, in the order they were applied (``run_dimensions``)
    dimensions: tuple[ParallelDimension, ...] = ()


def build_run(
    config: RunConfig, plugins: Plugins, topology: Topology, device: torch.device, display: Display
) -> RunParts:
    """The run's parts on this rank. Bad input a plugin finds is a ``MegaUsageError``."""
    ctx = build_context(config, plugins, topology, device, display)
    splits = build_data(config, plugins, ctx)
    return build_parts(config, plugins, topology, device, ctx, splits, display)


@contextmanager
def plugin_imports(kind: str, name: str, registry: Any) -> Iterator[None]:
    """A plugin's factory that imports what this mega does not have (a name that moved, a
    dependency not installed) stops the run with one line naming the plugin, not a traceback:
    the fix is the plugin's version or an install, not the run's flags."""
    try:
        yield
    except ImportError as exc:
        provider = registry.provider(name) if name in registry else name
        raise MegaUsageError(
            f"{kind} '{name}' (plugin '{provider}') failed to import what it needs: {exc}"
            " (a plugin written for another mega version, or a missing dependency)"
        ) from None


def build_context(
    config: RunConfig,
    plugins: Plugins,
    topology: Topology,
    device: torch.device,
    display: Display | None = None,
) -> BuildContext:
    """The tokenizer and what the factories are told about the run (a padded vocabulary)."""
    t = config.training
    # the model finds its attention kernel by name, a plugin's too (mega.parallel.attention_kernels)
    attention_kernels.install(plugins.choices(attention_kernels.AttentionKernelSpec.choice_kind))
    with plugin_imports("tokenizer", config.tokenizer_name, plugins.tokenizers):
        tokenizer = plugins.tokenizers.get(config.tokenizer_name).build(config.tokenizer)
    vocab = tokenizer.vocab_size
    divisor = config.data.make_vocab_size_divisible_by * topology.tensor_model_parallel_size
    padded_vocab = padded_vocab_size(vocab, divisor)
    if display is not None:
        display.print(
            f" > padded vocab (size: {vocab}) with {padded_vocab - vocab} dummy tokens"
            f" (new size: {padded_vocab})"
        )
    return BuildContext(
        seed=t.seed,
        device=device.type,
        params_dtype=config.precision.params_dtype,
        seq_length=t.seq_length,
        padded_vocab_size=padded_vocab,
        tokenizer=tokenizer,
        topology=topology,
        model_config=config.model,
    )


def build_parts(
    config: RunConfig,
    plugins: Plugins,
    topology: Topology,
    device: torch.device,
    ctx: BuildContext,
    splits: Any,
    display: Display | None = None,
) -> RunParts:
    """Everything but the data: model, parallelism, buffer, optimizer, executor. On the meta
    device (the planner, ``mega.core.plan``) it builds shapes only and compiles nothing."""
    t = config.training
    tokenizer, padded_vocab = ctx.tokenizer, ctx.padded_vocab_size
    vocab = tokenizer.vocab_size
    model_spec = plugins.models.get(config.model_name)
    try:
        with plugin_imports("model", config.model_name, plugins.models):
            model = model_spec.build(config.model, ctx)  # fp32 on the CPU: the exact seeded init
    except ValueError as exc:
        raise MegaUsageError(f"model '{config.model_name}': {exc}") from None
    plan = model_spec.parallel_plan(config.model) if model_spec.parallel_plan else None
    num_parameters = unpadded_parameter_count(model, plan, vocab, padded_vocab)
    pipeline, problems = pipeline_setup(config, plugins)
    if pipeline is None:  # resolve_config reported these already; a library caller may not have
        raise MegaUsageError(problems)
    layout = pipeline.layout
    dimensions = run_dimensions(topology, plugins.choices)
    model, chunks = parallelize(model, plan, config.parallel, topology, layout, plugins.choices)
    if config.precision.fp8_format:
        mark_fp8_weights(model, plan, config.precision, device, display)
    dtype = DTYPES[config.precision.params_dtype]
    model = model.to(device=device, dtype=dtype)  # the chunks share its modules
    fp8_scaling = delayed_fp8_scaling(model, config.precision, topology, device)
    # the MoE trips' "auto" under CUDA graphs (meta: the planner's count of a GPU run)
    set_graphed_trips(t.cuda_graph_impl == "local" and device.type != "cpu")
    if compiles_layers(t.compile, device) and device.type != "meta":
        compile_model(model, plan, chunks, cuda_graphs=t.cuda_graph_impl == "local")
    p = config.parallel
    pipelined = layout.pp > 1
    buffer = ParamAndGradBuffer.build(
        model,
        topology,
        bucket_size=p.ddp_bucket_size,
        overlap=p.overlap_grad_reduce,
        distributed=p.use_distributed_optimizer,
        tied=tied_weights(model, plan, topology.pp_rank, layout.pp) if pipelined else [],
        graph_safe=t.cuda_graph_impl == "local",
    )
    if t.gradient_accumulation_fusion:
        for param in buffer.params:  # honoured by mega.parallel.linear's linear layers
            param.fuse_wgrad = True
    rule = plugins.optimizers.get(config.optimizer.optimizer)
    optimizer = FlatOptimizer(buffer, config.optimizer, config.precision, rule)
    # the positions one rank holds between layers (context parallelism's share, split again
    # by sequence parallelism's)
    positions = t.seq_length
    loss_fn = loss_parts(model_spec, config.model)
    for dimension in dimensions:
        positions = dimension.local_positions(positions, p, topology)
        loss_fn = dimension.share_loss(loss_fn, topology)
    executor = PipelineExecutor(
        name=pipeline.spec.name,
        chunks=chunks,
        table=pipeline.spec.table,
        layout=layout,
        topology=topology,
        # what crosses between stages; nothing does with one stage (and a plan-less model)
        activation_shape=plan.activation_shape(t.micro_batch_size, positions) if pipelined else (),
        dtype=dtype,
        device=device,
        forward_fn=model_forward,
        loss_fn=loss_fn,
        overlap_p2p=p.overlap_p2p_communication,
        scale_hooks=[dimension.step_scale for dimension in dimensions],
    )
    if layout.pp * layout.vpp > 1 and display is not None:
        display.print(f" > pipeline layers by rank and chunk: {layout.describe()}")
    return RunParts(
        tokenizer=tokenizer,
        padded_vocab=padded_vocab,
        vocab_rows=vocab_rows(model, plan.vocab_parameters, vocab, padded_vocab) if plan else {},
        splits=splits,
        model=model,
        num_parameters=num_parameters,
        pipeline=pipeline,
        executor=executor,
        buffer=buffer,
        optimizer=optimizer,
        lr_schedule=lr_schedule(config),
        flops_per_token=model_spec.flops_per_token(config.model, t.seq_length, padded_vocab),
        loss_names=model_spec.losses_of(config.model),
        prepare_microbatch=microbatch_preparation(
            model_spec.prepare_microbatch, topology, dimensions
        ),
        fp8_scaling=fp8_scaling,
        dimensions=tuple(dimensions),
    )


def build_data(config: RunConfig, plugins: Plugins, ctx: BuildContext) -> Any:
    t = config.training
    request = DataRequest(
        split=config.data.split,
        data_path=tuple(config.data.data_path),
        num_samples=requested_samples(
            config.train_iters,
            t.eval_interval,
            t.eval_iters,
            config.global_batch_size,
            train_samples=t.train_samples,
        ),
        cache_path=config.data.data_cache_path,
        split_paths=split_paths(config.data),
    )
    try:
        with plugin_imports("dataset", config.dataset_name, plugins.datasets):
            return plugins.datasets.get(config.dataset_name).build(config.dataset, request, ctx)
    except (ValueError, FileNotFoundError) as exc:
        raise MegaUsageError(f"dataset '{config.dataset_name}': {exc}") from None


def split_paths(data: Any) -> tuple[tuple[str, ...], ...] | None:
    """--train-data-path/--valid-data-path/--test-data-path as a DataRequest's ``split_paths``."""
    paths = (data.train_data_path, data.valid_data_path, data.test_data_path)
    return tuple(tuple(p) for p in paths) if any(paths) else None


def lr_schedule(config: RunConfig) -> LRSchedule:
    """The run's learning-rate schedule (Megatron's OptimizerParamScheduler)."""
    s = config.scheduler
    # counted in iterations, or in samples with --train-samples (mega.core.schedules.samples)
    lengths = schedule_lengths(config)
    decay_iters = lengths["decay_iters"]
    return LRSchedule(
        max_lr=config.optimizer.lr,
        min_lr=config.optimizer.min_lr,
        decay_style=s.lr_decay_style,
        decay_iters=decay_iters,
        warmup_iters=resolve_warmup_iters(
            lengths["warmup_iters"], s.lr_warmup_fraction, decay_iters
        ),
        warmup_init=s.lr_warmup_init,
        wsd_decay_style=s.lr_wsd_decay_style,
        wsd_decay_iters=lengths["wsd_decay_iters"],
    )


def mark_fp8_weights(
    model: torch.nn.Module,
    plan: Any,
    precision: Any,
    device: torch.device,
    display: Display | None,
) -> None:
    """--fp8-format: mark the transformer layers' linears (``mega.parallel.fp8.apply``), once
    this rank's GPU is known to have FP8 tensor cores (the launcher checked through NVML, where
    it could)."""
    from mega.parallel.fp8 import checks
    from mega.parallel.fp8.apply import apply_fp8

    if device.type != "meta":  # the planner builds on meta, for a GPU kind it names itself
        problems = checks.rank_device_problems(f"--fp8-format {precision.fp8_format}", device)
        if problems:
            raise MegaUsageError(problems)
    keep = precision.first_last_layers_bf16
    marked = apply_fp8(
        model,
        plan,
        precision.fp8_format,
        bf16_at_start=precision.num_layers_at_start_in_bf16 if keep else 0,
        bf16_at_end=precision.num_layers_at_end_in_bf16 if keep else 0,
    )
    if display is not None:
        message = f" > FP8 ({precision.fp8_format}, {precision.fp8_recipe}): {len(marked)} linears"
        display.print(message)


def delayed_fp8_scaling(
    model: torch.nn.Module, precision: Any, topology: Topology, device: torch.device
) -> Any:
    """--fp8-recipe delayed: the FP8 linears' amax histories and scales (float32, so made after
    the model's dtype cast), reduced over the ranks that hold the same layers; None otherwise."""
    if not precision.fp8_format or precision.fp8_recipe != "delayed":
        return None
    if device.type == "meta":
        # the planner counts a delayed run as tensorwise: its meta compile fails on the in-place
        # amax records (AOTAutograd: "select_scatter ... was invalid, but is output"), and the
        # tensorwise graph only has more amax passes, a few percent of the step
        return None
    from mega.parallel.fp8.delayed import DelayedScaling

    return DelayedScaling(
        model,
        history_len=precision.fp8_amax_history_len,
        compute_algo=precision.fp8_amax_compute_algo,
        margin=precision.fp8_margin,
        groups=[topology.group("dpcp"), topology.group("tp")],
        device=device,
    )


def compiles_layers(flag: bool | None, device: torch.device) -> bool:
    """Whether ``--compile`` (``flag``; None when not given) compiles the layers on ``device``.
    Its default: on a GPU. Tensor and expert parallelism compile: their collectives are
    functional ones (``mega.parallel.functional_comm``), which torch.compile traces correctly;
    context parallelism's ring and gathered attention are opaque custom ops there (compiled CP2
    at 16k ran 34,293 against 32,824 tokens/s per GPU eager on 2 H200)."""
    if flag is not None:
        return flag
    return device.type == "cuda"


def microbatch_preparation(
    model_step: Any, topology: Topology, dimensions: list[ParallelDimension] | None = None
) -> Any:
    """The host-side step of each micro-batch: the model's (``ModelSpec.prepare_microbatch``),
    then each parallel dimension's (context parallelism: the cut to this rank's positions).
    ``dimensions``: the run's (``run_dimensions``); the built-in ones when None."""
    if dimensions is None:
        dimensions = run_dimensions(topology, None)
    return chain([model_step, *(d.prepare_microbatch(topology) for d in dimensions)])
