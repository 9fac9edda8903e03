"""What ``--context-parallel-size`` needs, checked before launch (pure Python, one line each)."""

from __future__ import annotations

from typing import Any

from mega.parallel.context.transport_choice import graphs_problem, transport_problem


def context_parallel_problems(config: Any, plan: Any, plugins: Any) -> list[str]:
    """Every reason the run cannot split its sequences over ``--context-parallel-size`` ranks."""
    p, cp = config.parallel, config.parallel.context_parallel_size
    if cp == 1:
        return []
    flag = f"--context-parallel-size {cp}"
    if plan is None or not plan.context_parallel:
        return [
            f"{flag}: model '{config.model_name}' does not support context parallelism"
            " (its plan must declare causal self-attention: gpt does)"
        ]
    errors = []
    types = plugins.cp_comm_types
    if p.cp_comm_type not in types:
        errors.append(
            f"--cp-comm-type {p.cp_comm_type!r}: no such type (have: {', '.join(types.names())})"
        )
    transport = transport_problem() if p.cp_comm_type == "p2p" else None
    if transport:
        errors.append(transport)
    graphs = graphs_problem(p.cp_comm_type)
    if graphs:
        errors.append(graphs)
    seq, tp = config.training.seq_length, p.tensor_model_parallel_size
    if seq % (2 * cp):
        errors.append(
            f"--seq-length {seq} must be divisible by 2 x {flag} = {2 * cp}"
            " (each rank holds two chunks of every sequence)"
        )
    elif p.sequence_parallel and (seq // cp) % tp:
        errors.append(
            f"--seq-length {seq} / {flag} = {seq // cp} positions per rank must be divisible by"
            f" --tensor-model-parallel-size {tp} under --sequence-parallel"
        )
    model = config.model
    if getattr(model, "attention_dropout", 0.0):
        errors.append(
            f"{flag}: attention is computed without dropout under context parallelism;"
            " give --attention-dropout 0"
        )
    if getattr(config.dataset, "reset_attention_mask", False):
        errors.append(
            f"{flag} with --reset-attention-mask: context parallelism computes causal attention"
            " without a mask"
        )
    if p.cp_comm_type in types and types.peek(p.cp_comm_type).heads_split:
        heads = model.num_attention_heads // tp
        groups = max(1, model.resolved_num_query_groups() // tp)
        if heads % cp or groups % cp:
            errors.append(
                f"--cp-comm-type {p.cp_comm_type} splits heads over the {cp} ranks: the"
                f" {heads} attention heads and {groups} query groups per tensor-parallel rank"
                " must both be divisible by it"
            )
    return errors
