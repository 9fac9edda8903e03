"""The engine's own config sections, and the resolved ``RunConfig`` that holds every section.

Field names are Megatron-LM's argument names, so each field is also its flag (``--lr-decay-style``).
Plugin sections (model, tokenizer, dataset) are the plugins' own dataclasses, chosen by name.
Defaults train the small quickstart GPT on a CPU in about a minute.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega.core.config.fields import option
from mega.parallel.topology import GROUP_NAMES as STREAM_GROUPS

# Megatron's --fp8-recipe names and torchao's rowwise; mega builds tensorwise and delayed
# (mega.parallel.fp8.checks refuses the others by name)
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "mxfp8", "blockwise")
# --split: non-negative numbers separated by commas (Megatron's), slashes (its older form) or
# spaces. Megatron takes the numbers its regex [.0-9]+ finds, so `1,x,1` would be `1,1`
SPLIT_SYNTAX = re.compile(r"\s*(\d+\.?\d*|\.\d+)(\s*[,/\s]\s*(\d+\.?\d*|\.\d+))*\s*")


@dataclass(kw_only=True)
class TrainingConfig:
    micro_batch_size: int = option(16, "Batch size per model instance (per micro-batch).")
    global_batch_size: int | None = option(
        None, "Samples per optimizer step; default micro-batch size x data-parallel size."
    )
    seq_length: int = option(
        128,
        "Tokens per sample (T5: the encoder's).",
        aliases=("--encoder-seq-length",),
    )
    train_iters: int | None = option(
        None, "Optimizer steps to train for (default 500, unless --train-samples is given)."
    )
    train_samples: int | None = option(
        None,
        "Train for this many samples instead of --train-iters (Megatron's sample-based training:"
        " iterations = samples // global batch, counting --rampup-batch-size's smaller batches).",
    )
    rampup_batch_size: list[str] = option(
        [],
        "START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over SAMPLES"
        " samples up to --global-batch-size (needs --train-samples, as in Megatron).",
        nargs="+",
        metavar="START INCREMENT SAMPLES",
    )
    num_workers: int = option(
        0,
        "Threads that build the next global batch while the current step runs (0: build it in"
        " the training loop; mega reads samples in-process, Megatron's default is 2 workers).",
    )
    seed: int = option(1234, "Seed for initialisation, data order and dropout.")
    eval_interval: int = option(100, "Evaluate on the validation split every N iterations.")
    eval_iters: int = option(10, "Batches per evaluation.")
    log_interval: int = option(50, "Print an iteration line every N iterations.")
    device: str = option("auto", "cpu, cuda, or auto (cuda when available).")
    compile: bool | None = option(
        None,
        "torch.compile each transformer layer and the output head (fuses norms, element-wise "
        "ops and the loss). Default: on with CUDA (every parallel layout), off on the CPU.",
    )
    cuda_graph_impl: str = option(
        "none",
        "Experimental. local: replay each compiled transformer layer and the output head as CUDA graphs "
        "(inductor's CUDA graph trees), so that a host-bound step (tensor parallelism at small "
        "micro-batches) launches a layer at once. Needs --compile on GPUs; dense layers with "
        "tensor, sequence and data parallelism, or MoE layers over the flex dispatcher's padded "
        "trips; no dropout. Megatron's other choices "
        "(transformer_engine, full_iteration) are not built.",
        choices=("none", "local"),
    )
    gradient_accumulation_fusion: bool = option(
        True,
        "Accumulate linear weight gradients into the fp32 gradient buffer inside the weight-"
        "gradient GEMM, instead of writing them in the model dtype and adding them after.",
    )

    def __post_init__(self) -> None:
        if self.train_iters is None and self.train_samples is None:
            self.train_iters = 500

    def validate(self) -> list[str]:
        from mega.core.schedules.samples import training_length_problems

        errors = training_length_problems(self)
        for name in ("micro_batch_size", "seq_length", "train_iters", "log_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                errors.append(f"--{name.replace('_', '-')} must be at least 1")
        if self.num_workers < 0:
            errors.append("--num-workers must not be negative")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            errors.append("--global-batch-size must be at least 1")
        if self.eval_interval < 1 or self.eval_iters < 0:
            errors.append("--eval-interval must be at least 1 and --eval-iters at least 0")
        if self.seed < 0:
            errors.append("--seed must not be negative")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            errors.append(f"--device must be cpu, cuda or auto, not '{self.device}'")
        return errors


# --exp-avg-dtype / --exp-avg-sq-dtype: Megatron's choices (fp8 is refused in validate())
_STATE_DTYPE_CHOICES = ("fp32", "bf16", "fp16", "fp8")


@dataclass(kw_only=True)
class OptimizerConfig:
    optimizer: str = option(
        "adam",
        "Optimizer: a registered update rule: adam (AdamW, as in Megatron), sgd (torch's SGD"
        " with --sgd-momentum) or a plugin's.",
    )
    lr: float = option(3e-3, "Peak learning rate.")
    min_lr: float = option(0.0, "Learning rate at the end of decay.")
    weight_decay: float = option(0.01, "AdamW weight decay (not applied to biases and norms).")
    clip_grad: float = option(1.0, "Clip the global gradient norm to this value (0: off).")
    adam_beta1: float = option(0.9, "Adam beta1.")
    adam_beta2: float = option(0.999, "Adam beta2.")
    adam_eps: float = option(1e-8, "Adam epsilon.")
    sgd_momentum: float = option(0.9, "Momentum of --optimizer sgd (Megatron's default 0.9).")
    use_precision_aware_optimizer: bool = option(
        False,
        "Keep optimizer state in lower precision (Megatron's precision-aware optimizer): Adam's"
        " moments in --exp-avg-dtype and --exp-avg-sq-dtype; the update still computes in fp32.",
    )
    exp_avg_dtype: str = option(
        "fp32",
        "dtype of Adam's first moment under --use-precision-aware-optimizer.",
        choices=_STATE_DTYPE_CHOICES,
    )
    exp_avg_sq_dtype: str = option(
        "fp32",
        "dtype of Adam's second moment under --use-precision-aware-optimizer.",
        choices=_STATE_DTYPE_CHOICES,
    )
    main_grads_dtype: str = option(
        "fp32",
        "dtype of the main gradients (only fp32 is built in mega).",
        choices=("fp32", "bf16"),
    )

    def validate(self) -> list[str]:
        errors = []
        if not math.isfinite(self.lr) or self.lr <= 0:
            errors.append("--lr must be a positive number")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            errors.append("--adam-beta1 and --adam-beta2 must lie in [0, 1)")
        if self.clip_grad < 0 or self.weight_decay < 0:
            errors.append("--clip-grad and --weight-decay must not be negative")
        if not 0 <= self.sgd_momentum < 1:
            errors.append("--sgd-momentum must lie in [0, 1)")
        lowered = [
            f"--{flag.replace('_', '-')} {value}"
            for flag, value in (
                ("exp_avg_dtype", self.exp_avg_dtype),
                ("exp_avg_sq_dtype", self.exp_avg_sq_dtype),
            )
            if value in ("bf16", "fp16")
        ]
        if lowered and not self.use_precision_aware_optimizer:
            errors.append(
                f"{', '.join(lowered)} needs --use-precision-aware-optimizer (as in Megatron)"
            )
        if "fp8" in (self.exp_avg_dtype, self.exp_avg_sq_dtype):
            errors.append(
                "--exp-avg-dtype/--exp-avg-sq-dtype fp8: fp8 moments are not built in mega"
                " (Megatron keeps them through Transformer Engine); use bf16 or fp16"
            )
        if self.main_grads_dtype != "fp32":
            errors.append(
                f"--main-grads-dtype {self.main_grads_dtype}: mega accumulates main gradients in"
                " fp32 only (bf16 main gradients are not built)"
            )
        return errors


@dataclass(kw_only=True)
class SchedulerConfig:
    lr_decay_style: str = option(
        "cosine",
        "Learning-rate decay after warmup.",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    )
    lr_decay_iters: int | None = option(None, "Iterations to decay over (default --train-iters).")
    lr_warmup_iters: int = option(0, "Linear warmup iterations.")
    lr_warmup_fraction: float | None = option(None, "Warmup as a fraction of --lr-decay-iters.")
    lr_warmup_init: float = option(0.0, "Learning rate at the start of warmup.")
    lr_wsd_decay_style: str = option(
        "exponential",
        "Annealing shape of the WSD schedule.",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
    )
    lr_wsd_decay_iters: int | None = option(None, "Annealing iterations of the WSD schedule.")
    lr_decay_samples: int | None = option(
        None, "Samples to decay over, with --train-samples (default --train-samples)."
    )
    lr_warmup_samples: int = option(0, "Linear warmup samples, with --train-samples.")
    lr_wsd_decay_samples: int | None = option(
        None, "Annealing samples of the WSD schedule, with --train-samples."
    )
    override_opt_param_scheduler: bool = option(
        False,
        "On --load, use the command line's schedule even if the checkpoint's differs.",
        flag="--override-opt_param-scheduler",
    )
    use_checkpoint_opt_param_scheduler: bool = option(
        False,
        "On --load, use the checkpoint's schedule instead of the command line's.",
        flag="--use-checkpoint-opt_param-scheduler",
    )

    def validate(self) -> list[str]:
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            return [
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler"
                " cannot both be set"
            ]
        return []


@dataclass(kw_only=True)
class PrecisionConfig:
    fp16: bool = option(False, "fp16 parameters, fp32 master weights, dynamic loss scaling.")
    bf16: bool = option(False, "bf16 parameters with fp32 master weights and gradients.")
    loss_scale: float | None = option(None, "Static loss scale for --fp16 (default: dynamic).")
    initial_loss_scale: float = option(2.0**32, "Starting dynamic loss scale.")
    min_loss_scale: float = option(1.0, "Smallest dynamic loss scale.")
    loss_scale_window: int = option(1000, "Clean steps before the loss scale doubles.")
    hysteresis: int = option(2, "Overflowing steps tolerated before the loss scale halves.")
    fp8_format: str | None = option(
        None,
        "Run the transformer layers' linears in FP8 (Hopper GPUs): e4m3 everywhere, or hybrid"
        " (e4m3 activations and weights, e5m2 gradients). Needs --bf16.",
        choices=("e4m3", "hybrid"),
    )
    fp8_recipe: str = option(
        "tensorwise",
        "FP8 scaling recipe: tensorwise (one scale per tensor from its current amax) or delayed"
        " (scales from the amaxes of earlier steps, recorded while casting). Megatron's mxfp8"
        " and blockwise, and rowwise, are not built in mega.",
        choices=FP8_RECIPES,
    )
    fp8_margin: int = option(
        0, "--fp8-recipe delayed: scale down by 2^margin (headroom above the recorded amax)."
    )
    fp8_amax_history_len: int = option(
        1, "--fp8-recipe delayed: steps of amax history kept per tensor."
    )
    fp8_amax_compute_algo: str = option(
        "most_recent",
        "--fp8-recipe delayed: the amax a scale is computed from: the newest step's, or the"
        " history's max.",
        choices=("most_recent", "max"),
    )
    first_last_layers_bf16: bool = option(
        False,
        "Under --fp8-format, keep the first --num-layers-at-start-in-bf16 and the last"
        " --num-layers-at-end-in-bf16 transformer layers in bf16 (the output layer always is).",
    )
    num_layers_at_start_in_bf16: int = option(
        1, "Layers kept in bf16 at the start with --first-last-layers-bf16."
    )
    num_layers_at_end_in_bf16: int = option(
        1, "Layers kept in bf16 at the end with --first-last-layers-bf16."
    )

    def validate(self) -> list[str]:
        from mega.parallel.fp8.checks import fp8_flag_problems

        errors = fp8_flag_problems(self)
        if self.fp16 and self.bf16:
            errors.append("--fp16 and --bf16 cannot both be set")
        if self.loss_scale is not None and self.loss_scale <= 0:
            errors.append("--loss-scale must be positive")
        if self.hysteresis < 1 or self.loss_scale_window < 1:
            errors.append("--hysteresis and --loss-scale-window must be at least 1")
        if not (self.initial_loss_scale > 0 and self.min_loss_scale > 0):
            errors.append("--initial-loss-scale and --min-loss-scale must be positive")
        return errors

    @property
    def params_dtype(self) -> str:
        return "float16" if self.fp16 else "bfloat16" if self.bf16 else "float32"


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = option(None, "Directory to save checkpoints to.")
    load: str | None = option(None, "Directory to resume from (its latest complete checkpoint).")
    save_interval: int | None = option(None, "Save every N iterations (and at the end).")
    ckpt_format: str = option(
        "zarr",
        "Checkpoint backend plugin: zarr (sharded global tensors, any layout, reshards on load)"
        " or torch (one torch.save file, one process only).",
    )
    async_save: bool = option(
        False,
        "Write checkpoints in the background from a copy while training goes on; the next"
        " save or the end of training waits for it (zarr backend).",
    )
    exit_signal_handler: bool = option(
        False,
        "On SIGTERM (what SLURM sends before a time limit): finish the step, save (with"
        " --save), exit with code 0.",
    )
    exit_interval: int | None = option(
        None, "Exit after the iteration that is a multiple of N (saving first, with --save)."
    )
    exit_duration_in_mins: float | None = option(
        None, "Exit after this many minutes of training (saving first, with --save)."
    )
    load_optim: bool = option(
        True,
        "On --load, do not restore the optimizer state (moments, masters, loss scale).",
        flag="--no-load-optim",
        store=False,
    )
    load_rng: bool = option(
        True, "On --load, do not restore the random number generators.", flag="--no-load-rng",
        store=False,
    )  # fmt: skip
    finetune: bool = option(
        False,
        "On --load, load the model weights only: start at iteration 0 with no consumed samples,"
        " a fresh optimizer and fresh RNG (Megatron's --finetune).",
    )
    use_checkpoint_args: bool = option(
        False,
        "Take the model's architecture flags from the --load checkpoint's saved config (flags"
        " given on the command line still win).",
    )

    def validate(self) -> list[str]:
        errors = []
        if self.save_interval is not None and self.save_interval < 1:
            errors.append("--save-interval must be at least 1")
        if self.use_checkpoint_args and not self.load:
            errors.append("--use-checkpoint-args needs --load")
        if self.exit_interval is not None and self.exit_interval < 1:
            errors.append("--exit-interval must be at least 1")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            errors.append("--exit-duration-in-mins must be > 0")
        return errors


@dataclass(kw_only=True)
class LoggingConfig:
    tensorboard_dir: str | None = option(None, "Write TensorBoard event files here.")
    run_dir: str | None = option(
        None, "Where metrics.jsonl goes (default: the --save directory, else runs/<time>)."
    )
    log_throughput: bool = option(
        False,
        "Accepted for Megatron: mega's iteration line always shows TFLOP/s per GPU and tokens/s.",
    )
    wandb_project: str | None = option(
        None,
        "Log the iteration metrics to this Weights & Biases project (pip install 'mega[wandb]').",
    )
    wandb_exp_name: str | None = option(None, "The W&B run name (with --wandb-project).")
    wandb_save_dir: str | None = option(
        None, "Where W&B writes its files (default: <run directory>/wandb)."
    )

    def validate(self) -> list[str]:
        import importlib.util

        from mega.core.checkpoint.store import unwritable_reason

        errors = []
        for flag, path in (
            ("--run-dir", self.run_dir),
            ("--tensorboard-dir", self.tensorboard_dir),
        ):
            problem = path and unwritable_reason(Path(path))
            if problem:
                errors.append(f"{flag} {path}: not a writable directory ({problem})")
        if self.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
            errors.append(
                "--tensorboard-dir needs the tensorboard package: pip install 'mega[tensorboard]'"
            )
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            errors.append("--wandb-project needs the wandb package: pip install 'mega[wandb]'")
        if (self.wandb_exp_name or self.wandb_save_dir) and not self.wandb_project:
            errors.append("--wandb-exp-name and --wandb-save-dir need --wandb-project")
        return errors


@dataclass(kw_only=True)
class DataConfig:
    data_path: list[str] = option(
        [], "Dataset prefixes, optionally weighted: [w1] p1 [w2] p2.", nargs="+"
    )
    split: str = option("969,30,1", "Train/valid/test proportions, e.g. 949,50,1.")
    train_data_path: list[str] = option(
        [], "Training dataset prefixes ([w1] p1 [w2] p2), instead of --data-path + --split.",
        nargs="+",
    )  # fmt: skip
    valid_data_path: list[str] = option(
        [], "Validation dataset prefixes, with --train-data-path.", nargs="+"
    )
    test_data_path: list[str] = option(
        [], "Test dataset prefixes, with --train-data-path.", nargs="+"
    )
    mock_data: bool = option(False, "Synthetic tokens (for throughput runs).")
    dataset: str | None = option(
        None, "Dataset plugin (default: mock, data-path or embedded text)."
    )
    tokenizer_type: str | None = option(None, "Tokenizer plugin (default: the dataset's choice).")
    make_vocab_size_divisible_by: int = option(128, "Pad the vocabulary to a multiple of this.")
    data_cache_path: str | None = option(None, "Where dataset index caches go.")

    def validate(self) -> list[str]:
        errors = []
        if self.make_vocab_size_divisible_by < 1:
            errors.append("--make-vocab-size-divisible-by must be at least 1")
        if not SPLIT_SYNTAX.fullmatch(self.split):
            errors.append(
                f"--split {self.split!r}: expected numbers separated by commas, e.g. 949,50,1"
            )
        per_split = self.train_data_path or self.valid_data_path or self.test_data_path
        if per_split and self.data_path:
            errors.append(
                "give --data-path (split by --split) or --train-data-path/--valid-data-path/"
                "--test-data-path, not both"
            )
        elif per_split and not self.train_data_path:
            errors.append("--valid-data-path and --test-data-path need --train-data-path")
        elif per_split and self.dataset not in (None, "gpt"):
            errors.append(
                f"--train-data-path/--valid-data-path/--test-data-path are read by the gpt"
                f" dataset, not '{self.dataset}'"
            )
        return errors


def _name_and_size(item: str) -> tuple[str, int | None]:
    """``"NAME=SIZE"`` as ``(NAME, SIZE)``; the size None where it is not an integer."""
    name, _, size = item.partition("=")
    size = size.strip()
    return name.strip(), int(size) if size.lstrip("-").isdigit() else None


@dataclass(kw_only=True)
class ParallelConfig:
    parallel: str | None = option(
        None,
        "Schedule plugin that runs forward and backward: no-pipelining, gpipe, 1f1b, interleaved"
        " or a plugin's (default: no-pipelining on one stage, 1f1b with pipeline stages,"
        " interleaved with virtual stages).",
    )
    tensor_model_parallel_size: int = option(
        1, "Tensor-parallel size (ranks splitting each layer)."
    )
    pipeline_model_parallel_size: int = option(1, "Pipeline-parallel size (stages).")
    virtual_pipeline_model_parallel_size: int | None = option(
        None, "Model chunks (virtual stages) per pipeline rank, for --parallel interleaved."
    )
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "Layers per virtual stage (sets the virtual stages per pipeline rank)."
    )
    decoder_first_pipeline_num_layers: int | None = option(
        None, "Layers on the first pipeline stage (uneven split; the rest are spread evenly)."
    )
    decoder_last_pipeline_num_layers: int | None = option(
        None, "Layers on the last pipeline stage (uneven split; the rest are spread evenly)."
    )
    pipeline_model_parallel_layout: str | None = option(
        None,
        "Layers of every virtual stage, e.g. 'Et*7|t*6|t*6|t*5L' (E embedding, t layer, L loss,"
        " | between stages in virtual-stage order, t*N and (...)*N repeat).",
    )
    overlap_p2p_communication: bool = option(
        False,
        "Overlap pipeline sends and receives with compute: wait for a received tensor only "
        "when a chunk needs it, and for sends at the end of the step.",
    )
    context_parallel_size: int = option(
        1, "Context-parallel size: ranks splitting every sequence (attention sees all of it)."
    )
    cp_comm_type: str = option(
        "p2p",
        "How attention reaches other context-parallel ranks' positions (a registered type:"
        " p2p, all_gather, a2a).",
    )
    expert_model_parallel_size: int = option(
        1, "Expert-parallel size: ranks (among the data-parallel ones) splitting the experts."
    )
    expert_tensor_parallel_size: int = option(
        1, "Tensor-parallel size inside each expert (mega keeps experts whole: 1)."
    )
    sequence_parallel: bool = option(
        False, "Shard norm/dropout activations along the sequence over the tensor-parallel group."
    )
    tp_comm_overlap: bool | None = option(
        None,
        "Overlap the tensor-parallel collectives of backward with the weight-gradient GEMMs"
        " (column-parallel layers; with --sequence-parallel they also keep only their token"
        " block for backward, re-gathered then, which saves memory). Default: on with"
        " --tensor-model-parallel-size > 1.",
    )
    use_distributed_optimizer: bool = option(
        False, "Shard fp32 master weights and Adam state over the data-parallel ranks."
    )
    overlap_grad_reduce: bool = option(
        False, "Reduce gradient buckets during the backward pass of the last micro-batch."
    )
    ddp_bucket_size: int | None = option(
        None, "Elements per gradient bucket (default max(40M, 1M x data-parallel size))."
    )
    recompute_granularity: str | None = option(
        None,
        "Recompute activations in backward: full (whole layers) or selective (core attention).",
        choices=("full", "selective"),
    )
    recompute_method: str | None = option(
        None,
        "With full: uniform (checkpoint groups of --recompute-num-layers layers) or block "
        "(recompute only the first --recompute-num-layers layers).",
        choices=("uniform", "block"),
    )
    recompute_num_layers: int | None = option(
        None,
        "Layers per group (uniform) or recomputed (block).",
        aliases=("--checkpoint-num-layers",),
    )
    recompute_activations: bool = option(
        False, "Megatron's short form of --recompute-granularity selective."
    )
    use_checkpoint_activations: bool = option(
        False,
        "Megatron's old name of full recompute: --recompute-granularity full --recompute-method"
        " uniform, --checkpoint-num-layers (default 1) layers per group.",
        aliases=("--checkpoint-activations",),
    )
    distributed_backend: str | None = option(
        None, "Process-group backend (default nccl on GPU, gloo on CPU).", choices=("nccl", "gloo")
    )
    distributed_timeout_minutes: float = option(
        10.0, "A collective that waits longer than this fails the run instead of hanging it."
    )
    high_priority_stream_groups: list[str] = option(
        [],
        "Process groups whose NCCL kernels run on high-priority streams, so that a collective"
        " overlapping compute gets SMs first: any of " + ", ".join(STREAM_GROUPS) + ". Without"
        " context parallelism dpcp is dp's group, edpcp edp's and tpcp tp's (either name puts"
        " it on a high-priority stream).",
        nargs="+",
    )
    extra_parallel_size: list[str] = option(
        [],
        "Sizes of parallel dimensions that plugins register (mega.parallel.dimension), as"
        " NAME=SIZE; their ranks hold the same data, as tensor-parallel ranks do.",
        nargs="+",
    )

    def __post_init__(self) -> None:
        # Megatron's shorthands become the flags they stand for (so the resolved config says
        # what runs); a contradicting explicit choice is an error, not silently overridden.
        for switch, flag, granularity in (
            ("recompute_activations", "--recompute-activations", "selective"),
            ("use_checkpoint_activations", "--use-checkpoint-activations", "full"),
        ):
            if not getattr(self, switch):
                continue
            if self.recompute_granularity not in (None, granularity):
                raise ValueError(
                    f"{flag} means --recompute-granularity {granularity}, but"
                    f" --recompute-granularity {self.recompute_granularity} is given"
                )
            self.recompute_granularity = granularity
            setattr(self, switch, False)
            if granularity == "full":
                self.recompute_method = self.recompute_method or "uniform"
                self.recompute_num_layers = self.recompute_num_layers or 1

    def sizes(self) -> dict[str, int]:
        """The built-in model-parallel sizes by dimension, in the topology's names (a plugin's
        dimensions: ``extra_sizes``)."""
        return {
            "tp": self.tensor_model_parallel_size,
            "cp": self.context_parallel_size,
            "ep": self.expert_model_parallel_size,
            "pp": self.pipeline_model_parallel_size,
        }

    def extra_sizes(self) -> dict[str, int]:
        """``--extra-parallel-size NAME=SIZE ...`` as ``{NAME: SIZE}`` (malformed items and
        built-in names left out: ``validate`` names them)."""
        parsed = (_name_and_size(item) for item in self.extra_parallel_size)
        return {
            name: size for name, size in parsed if size is not None and name not in STREAM_GROUPS
        }

    def validate(self) -> list[str]:
        errors = []
        if self.tp_comm_overlap is True and self.tensor_model_parallel_size == 1:
            errors.append("--tp-comm-overlap needs --tensor-model-parallel-size > 1")
        if self.overlap_p2p_communication and self.pipeline_model_parallel_size == 1:
            errors.append("--overlap-p2p-communication needs --pipeline-model-parallel-size > 1")
        if self.recompute_granularity == "full" and self.recompute_method is None:
            errors.append("--recompute-granularity full needs --recompute-method uniform or block")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            errors.append("--recompute-method applies only with --recompute-granularity full")
        if self.recompute_method is not None and (self.recompute_num_layers or 0) < 1:
            errors.append(
                f"--recompute-method {self.recompute_method} needs --recompute-num-layers >= 1"
            )
        if (
            self.virtual_pipeline_model_parallel_size is not None
            and self.num_layers_per_virtual_pipeline_stage is not None
        ):
            errors.append(
                "give --virtual-pipeline-model-parallel-size or"
                " --num-layers-per-virtual-pipeline-stage, not both"
            )
        for flag, value in (
            ("--virtual-pipeline-model-parallel-size", self.virtual_pipeline_model_parallel_size),
            ("--num-layers-per-virtual-pipeline-stage", self.num_layers_per_virtual_pipeline_stage),
        ):
            if value is not None and value < 1:
                errors.append(f"{flag} must be at least 1 (got {value})")
        for flag, value in (
            ("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers),
        ):
            if value is not None and value < 0:
                errors.append(f"{flag} must not be negative (got {value})")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            errors.append("--ddp-bucket-size must be at least 1")
        if self.distributed_timeout_minutes <= 0:
            errors.append("--distributed-timeout-minutes must be positive")
        for item in self.extra_parallel_size:
            name, size = _name_and_size(item)
            if not name or size is None:
                errors.append(f"--extra-parallel-size: '{item}' is not NAME=SIZE")
            elif name in STREAM_GROUPS:
                errors.append(
                    f"--extra-parallel-size: '{name}' is a built-in dimension or group"
                    " (set its own flag)"
                )
        names = [_name_and_size(item)[0] for item in self.extra_parallel_size]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            errors.append(f"--extra-parallel-size names {', '.join(repeated)} more than once")
        unknown = [g for g in self.high_priority_stream_groups if g not in STREAM_GROUPS]
        if unknown:
            errors.append(
                f"--high-priority-stream-groups: no group {', '.join(unknown)}"
                f" (groups: {', '.join(STREAM_GROUPS)})"
            )
        return errors


@dataclass(kw_only=True)
class LaunchConfig:
    """How many processes to start; read by ``mega train`` before any worker exists."""

    nproc_per_node: int = option(
        1, "Worker processes to start on this node (torch elastic).", aliases=("--nproc_per_node",)
    )
    nnodes: int = option(1, "Number of nodes taking part.")
    node_rank: int = option(0, "This node's index among --nnodes.", aliases=("--node_rank",))
    master_addr: str = option(
        "127.0.0.1", "Address of node 0 (rendezvous).", aliases=("--master_addr",)
    )
    master_port: int = option(
        29500, "Port on node 0 for the rendezvous.", aliases=("--master_port",)
    )

    def validate(self) -> list[str]:
        errors = []
        if self.nproc_per_node < 1 or self.nnodes < 1:
            errors.append("--nproc-per-node and --nnodes must be at least 1")
        if not 0 <= self.node_rank < max(self.nnodes, 1):
            errors.append(f"--node-rank must lie in [0, --nnodes) (got {self.node_rank})")
        if not 0 < self.master_port < 65536:
            errors.append(f"--master-port must be a port number (got {self.master_port})")
        return errors

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


# The engine's sections: section name -> dataclass. Plugin sections are "model", "tokenizer",
# "dataset"; their classes come from the selected plugins' specs.
CORE_SECTIONS: dict[str, type] = {
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "launch": LaunchConfig,
}
PLUGIN_SECTIONS = ("model", "tokenizer", "dataset")


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs, typed. Built once by ``mega.core.config.resolve.resolve_config``."""

    model_name: str
    tokenizer_name: str
    dataset_name: str
    model: Any
    tokenizer: Any
    dataset: Any
    training: TrainingConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    precision: PrecisionConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    data: DataConfig
    parallel: ParallelConfig
    launch: LaunchConfig
    # Processes in the job: WORLD_SIZE under torchrun/SLURM, else --nproc-per-node x --nnodes.
    world_size: int = 1

    def sections(self) -> dict[str, Any]:
        """Section name -> dataclass instance, in a stable order (for writing and display)."""
        names = ["model", "tokenizer", "dataset", *CORE_SECTIONS]
        return {name: getattr(self, name) for name in names}

    @property
    def data_parallel_size(self) -> int:
        """Ranks with the same dense weights and different data: expert-parallel ranks count
        (they hold different experts but different data too)."""
        sizes = {**self.parallel.sizes(), **self.parallel.extra_sizes()}
        return max(self.world_size // (math.prod(sizes.values()) // sizes["ep"]), 1)

    @property
    def train_iters(self) -> int:
        """Iterations to train: --train-iters, or from --train-samples as Megatron computes them."""
        if self.training.train_samples is None:
            return self.training.train_iters
        from mega.core.schedules.samples import batch_schedule, train_iters_from_samples

        return train_iters_from_samples(self.training.train_samples, batch_schedule(self))

    @property
    def global_batch_size(self) -> int:
        mbs = self.training.micro_batch_size
        return self.training.global_batch_size or mbs * self.data_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size)
