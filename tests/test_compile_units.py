"""What ``--compile`` compiles (layers, or each pipeline chunk's stacks where the plan asks; MoE
layers one by one; the head), and that compiled models train like eager ones: under activation
recompute, and in an interleaved pipeline, where each chunk holds its own copy of the stack."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mega import BuildContext
from mega.core.training.compile import compile_model, compiled_units
from mega.parallel.pipeline.layout import PipelineLayout
from mega.parallel.pipeline.split import split_for_pipeline
from mega.parallel.recompute import apply_recompute
from mega.plugins.models.bert.config import BertConfig
from mega.plugins.models.bert.model import BertModel
from mega.plugins.models.bert.plan import bert_parallel_plan
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.decoder import GPTModel
from mega.plugins.models.common.decoder_plan import gpt_parallel_plan
from mega.testing import train_losses

from conftest import TINY
from parallel_runs import layout_run

SMALL = dict(num_layers=4, hidden_size=32, num_attention_heads=2)
CTX = BuildContext(
    seed=1, device="cpu", params_dtype="float32", seq_length=32, padded_vocab_size=64
)


def _names(model: torch.nn.Module, units: list[torch.nn.Module]) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(u)] for u in units]


def test_gpt_compiles_layers_and_bert_its_stack():
    gpt = GPTModel(GPTConfig(**SMALL), CTX)
    names = _names(gpt, compiled_units(gpt, gpt_parallel_plan(gpt.config)))
    assert names == [f"decoder.layers.{i}" for i in range(4)] + ["output_head"]
    bert = BertModel(BertConfig(**SMALL), CTX)
    assert _names(bert, compiled_units(bert, bert_parallel_plan(bert.config)))[0] == "encoder"


def test_a_fully_recomputed_stack_is_compiled_layer_by_layer():
    """Each checkpointed layer is compiled inside its checkpoint, so the stack cannot be one graph."""
    bert = BertModel(BertConfig(**SMALL), CTX)
    plan = bert_parallel_plan(bert.config)
    apply_recompute(bert, plan, "full", "uniform", 1)
    names = _names(bert, compiled_units(bert, plan))
    assert names[:4] == [f"encoder.layers.{i}" for i in range(4)]


def _saved_storages(model: torch.nn.Module, *args: torch.Tensor) -> dict[int, int]:
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args).sum().backward()
    return saved


def test_a_compiled_fully_recomputed_layer_keeps_only_its_input():
    """Compiled around its checkpoint, a layer kept a third of what it keeps without recompute
    (the partitioner saved matmul outputs inside the checkpoint: +5 GiB on the 1.3B GPT)."""
    gpt = GPTModel(GPTConfig(**SMALL, hidden_dropout=0.0, attention_dropout=0.0), CTX)
    plan = gpt_parallel_plan(gpt.config)
    apply_recompute(gpt, plan, "full", "uniform", 1)
    compile_model(gpt, plan)
    layer = gpt.decoder.layers[0]
    hidden = torch.randn(2, 32, 32, requires_grad=True)
    saved = _saved_storages(layer, hidden)
    assert sum(saved.values()) == hidden.untyped_storage().nbytes()


def test_moe_layers_are_compiled_one_by_one_even_in_a_stacked_plan():
    """An MoE layer's routing sets shapes on the host, so its stack cannot be one graph."""
    cfg = GPTConfig(**SMALL, num_experts=2, add_bias_linear=False)
    gpt = GPTModel(cfg, CTX)
    plan = dataclasses.replace(gpt_parallel_plan(cfg), compile_stacks=True)
    names = _names(gpt, compiled_units(gpt, plan))
    assert names == [f"decoder.layers.{i}" for i in range(4)] + ["output_head"]


def test_each_pipeline_chunk_compiles_its_own_stack():
    """A chunk's stack is a shallow copy holding only the chunk's layers: compiling the rank
    model's stack would leave every chunk eager."""
    gpt = GPTModel(GPTConfig(**SMALL), CTX)
    plan = dataclasses.replace(gpt_parallel_plan(gpt.config), compile_stacks=True)
    layout = PipelineLayout(pp=2, vpp=2, stages=tuple(range(i, i + 1) for i in range(4)))
    rank_model, chunks = split_for_pipeline(gpt, plan, layout, pp_rank=1)
    stacks = [compiled_units(chunk, plan)[0] for chunk in chunks]
    assert len({id(s) for s in stacks}) == 2 and rank_model.decoder not in stacks
    assert [len(s.layers) for s in stacks] == [1, 1]


@pytest.mark.parametrize("model", ["gpt", "bert"], ids=["by-layer", "stack"])
def test_recompute_under_compile_trains_like_compile_alone(model: str, tmp_path: Path):
    """Dropout on: the recomputed masks are the ones of the forward, so recompute (selective or
    full) changes nothing, in compiled layers (GPT) and a compiled stack (BERT). Both crashed
    under --compile before: torch.compile accepts no ``context_fn`` but its own for checkpoint."""
    run = [*TINY, "--model", model, "--train-iters", "3", "--compile"]
    base = train_losses(run, tmp_path / "base")
    selective = train_losses([*run, "--recompute-granularity", "selective"], tmp_path / "sel")
    full = [
        *run, "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
    ]  # fmt: skip
    # within rounding: the recomputing graphs may fuse differently; a recompute that drew other
    # dropout masks moves the loss by about 1e-3
    assert selective == pytest.approx(base, rel=1e-5)
    assert train_losses(full, tmp_path / "full") == pytest.approx(base, rel=1e-5)


def test_compiled_stacks_in_an_interleaved_pipeline_train_like_eager(tmp_path: Path):
    """Two forked ranks (PP=2, two virtual stages each), eager and compiled: what is compiled is
    each chunk's stack in the ranks, whichever way they were started (the launcher's ranks run
    the same Engine)."""
    run = [
        *TINY, "--model", "bert", "--num-layers", "4", "--train-iters", "3", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "1",
    ]  # fmt: skip
    eager = layout_run(run, 2, str(tmp_path / "eager"))[0]
    compiled = layout_run([*run, "--compile"], 2, str(tmp_path / "compiled"))[0]
    assert len(eager["losses"]) == 3
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled["other_losses"], eager["other_losses"], rtol=1e-5, atol=0)


def test_a_units_compile_options_come_from_its_modules(monkeypatch):
    """A module's ``compile_options`` reach inductor where its unit is compiled (the pipelined
    flex trips ask for the ``sink_waits`` pass in their layer), and a unit without any is
    compiled plainly."""
    from mega.core.training import compile as compile_module

    gpt = GPTModel(GPTConfig(**SMALL), CTX)
    plan = gpt_parallel_plan(gpt.config)
    wanted = {"reorder_for_compute_comm_overlap": True}
    gpt.decoder.layers[1].mlp.compile_options = wanted
    assert compile_module.compile_options(gpt.decoder.layers[1]) == wanted
    assert compile_module.compile_options(gpt.decoder.layers[0]) == {}
    seen = []
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: seen.append((self, kw.get("options")))
    )
    compile_model(gpt, plan)
    options = {id(unit): given for unit, given in seen}
    assert options[id(gpt.decoder.layers[1])] == wanted
    assert options[id(gpt.decoder.layers[0])] is None


def test_the_overlapped_flex_dispatcher_asks_its_layer_for_sink_waits():
    """``--overlap-moe-expert-parallel-comm``: the flex dispatcher's pipelined trips rely on
    inductor's sink_waits pass (its default schedule waits at once: flex_schedule); the MoE
    layer carries the dispatcher's options, so ``--compile`` passes them."""
    from types import SimpleNamespace

    from mega.parallel.expert.apply import apply_expert_parallel
    from mega.parallel.expert.dispatchers import DeviceSplitDispatcher
    from mega.parallel.expert.flex_schedule import PIPELINED_COMPILE_OPTIONS

    layer = torch.nn.Module()
    layer.experts = torch.nn.Linear(2, 2)
    layer.experts.count = 2
    layer.router = SimpleNamespace()
    plan = SimpleNamespace(moe_layers="moe")
    model = torch.nn.Module()
    model.moe = layer
    topology = SimpleNamespace(
        expert_model_parallel_size=2, tensor_model_parallel_size=1,
        group=lambda name: None, group_rank=lambda name: 0,
    )  # fmt: skip
    for overlap, expected in ((False, None), (True, PIPELINED_COMPILE_OPTIONS)):
        layer.experts = torch.nn.Linear(2, 2)
        layer.experts.count = 2
        layer.__dict__.pop("compile_options", None)
        apply_expert_parallel(
            model, plan, topology, False, lambda g, o=overlap: DeviceSplitDispatcher(g, o)
        )
        assert getattr(layer, "compile_options", None) == expected
