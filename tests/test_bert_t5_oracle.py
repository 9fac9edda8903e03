"""mega's BERT and T5 against megatron-core 0.16.1 (the oracle): the same weights, the same batch,
the same losses (fp32 on CPU, dropout off).

One forked rank (gloo, world size 1) builds megatron-core's ``BertModel`` (``bert_layer_local_spec``)
and ``T5Model`` (the local encoder/decoder block specs), loads mega's state dict into each (the
parameter names are the same by design: the test requires every name to match both ways) and
returns the per-token losses and BERT's binary logits for a batch with padding.

Intended difference (said in mega's BERT docstring): mega masks padding as keys only, megatron
as keys and queries. Real positions' outputs are equal; the losses compared here are at real
positions, and the binary head reads position 0, which is real.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megatron_cpu import megatron_on_cpu

from mega import BuildContext
from mega.testing.ranks import run_ranks

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core (the oracle) is not installed", allow_module_level=True)

VOCAB, SEQ, DEC, BATCH, HIDDEN, HEADS, LAYERS = 128, 32, 24, 3, 64, 4, 2
TOLERANCE = 1e-5  # max |difference| relative to max |megatron's value|
TRANSFORMER = dict(
    hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0
)


def _bert_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.tensor([SEQ, SEQ - 7, SEQ // 2])
    padding_mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    types = (torch.arange(SEQ)[None] >= (lengths[:, None] // 2)).long() * padding_mask
    labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.3, text, -1) * padding_mask
    labels[padding_mask == 0] = -1
    return {"text": text, "types": types, "padding_mask": padding_mask, "labels": labels}


def _mega_bert(binary_head: bool):
    from mega.plugins.models.bert.config import BertConfig
    from mega.plugins.models.bert.model import BertModel

    cfg = BertConfig(num_layers=LAYERS, bert_binary_head=binary_head, **TRANSFORMER)
    ctx = BuildContext(
        seed=7, device="cpu", params_dtype="float32", seq_length=SEQ, padded_vocab_size=VOCAB
    )
    return _perturbed(BertModel(cfg, ctx).eval())


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Init leaves biases at 0 and norms at 1: move them, so that a misplaced one shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _t5_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    enc_lengths, dec_lengths = torch.tensor([SEQ, SEQ - 5, 9]), torch.tensor([DEC, 7, DEC - 3])
    enc_mask = (torch.arange(SEQ)[None] < enc_lengths[:, None]).long()
    dec_mask = (torch.arange(DEC)[None] < dec_lengths[:, None]).long()
    labels = torch.randint(0, VOCAB, (BATCH, DEC), generator=g)
    labels[dec_mask == 0] = -1
    return {
        "text_enc": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) * enc_mask,
        "text_dec": torch.randint(0, VOCAB, (BATCH, DEC), generator=g) * dec_mask,
        "enc_mask": enc_mask,
        "dec_mask": dec_mask,
        "labels": labels,
    }


def _mega_t5():
    from mega.plugins.models.t5.config import T5Config
    from mega.plugins.models.t5.model import T5Model

    cfg = T5Config(num_layers=LAYERS, decoder_seq_length=DEC, **TRANSFORMER)
    ctx = BuildContext(
        seed=7, device="cpu", params_dtype="float32", seq_length=SEQ, padded_vocab_size=VOCAB
    )
    return _perturbed(T5Model(cfg, ctx).eval())


def _megatron_t5(cfg, state: dict, batch: dict) -> tuple:
    """megatron-core's T5 with mega's weights: (per-token loss, parameter names differences)."""
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.models.T5.t5_spec import (
        decoder_model_with_local_spec,
        encoder_model_with_local_spec,
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    # The local block specs name TENorm for the final norms, which is None without Transformer
    # Engine: megatron-core on CPU would drop the norms every GPU run has (see mega's T5).
    def block(layer):
        return TransformerBlockSubmodules([layer] * LAYERS, layer_norm=WrappedTorchNorm)

    model = T5Model(
        config=cfg, encoder_config=cfg,
        transformer_encoder_layer_spec=block(encoder_model_with_local_spec()),
        transformer_decoder_layer_spec=block(decoder_model_with_local_spec()),
        vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
    ).eval()  # fmt: skip
    # megatron-core registers two modules twice: position_embeddings and output_layer
    aliases = {"position_embeddings.weight", "output_layer.bias"}
    theirs = {k for k in model.state_dict() if not k.endswith("_extra_state")} - aliases
    names = (sorted(theirs - set(state)), sorted(set(state) - theirs))
    model.load_state_dict(state, strict=False)

    def mask(queries, keys, causal=False):  # bool [b, 1, q, k], True = masked (megatron's)
        allowed = queries[:, None, :, None].bool() & keys[:, None, None, :].bool()
        if causal:
            allowed = allowed & torch.ones(queries.shape[1], keys.shape[1]).tril().bool()
        return ~allowed

    enc, dec = batch["enc_mask"], batch["dec_mask"]
    with torch.no_grad():
        loss = model(
            batch["text_enc"], batch["text_dec"], mask(enc, enc), mask(dec, dec, causal=True),
            mask(dec, enc), lm_labels=batch["labels"].clamp(min=0),
        )  # fmt: skip
    return loss, names


def _megatron_side(rank: int, world_size: int, weights: dict, batch: dict) -> dict:
    import torch.distributed as dist

    megatron_on_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state as ps
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(123)
    results = {}
    try:
        cfg = TransformerConfig(num_layers=LAYERS, use_cpu_initialization=True, **TRANSFORMER)
        results["t5"] = _megatron_t5(cfg, weights.pop("t5"), batch.pop("t5"))
        for name, state in weights.items():
            cfg = TransformerConfig(num_layers=LAYERS, use_cpu_initialization=True, **TRANSFORMER)
            binary = name == "bert_binary"
            model = BertModel(
                config=cfg, num_tokentypes=2 if binary else 0,
                transformer_layer_spec=bert_layer_local_spec, vocab_size=VOCAB,
                max_sequence_length=SEQ, add_binary_head=binary,
                share_embeddings_and_output_weights=True,
            ).eval()  # fmt: skip
            theirs = {k for k in model.state_dict() if not k.endswith("_extra_state")}
            results[name + "_names"] = (sorted(theirs - set(state)), sorted(set(state) - theirs))
            model.load_state_dict(state, strict=False)
            with torch.no_grad():
                bert = batch["bert"]
                lm, binary_logits = model(
                    bert["text"], bert["padding_mask"],
                    tokentype_ids=bert["types"] if binary else None,
                    lm_labels=bert["labels"].clamp(min=0),
                )  # fmt: skip
            results[name] = (lm, binary_logits)
    finally:
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def pair():
    """(mega's models, their batches, megatron-core's results): one megatron rank for all."""
    models = {"bert_binary": _mega_bert(True), "bert_plain": _mega_bert(False), "t5": _mega_t5()}
    weights = {name: m.state_dict() for name, m in models.items()}
    batches = {"bert": _bert_batch(), "t5": _t5_batch()}
    theirs = run_ranks(_megatron_side, 1, weights, dict(batches), timeout=240)[0]
    return models, batches, theirs


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("name", ["bert_binary", "bert_plain"])
def test_bert_parameter_names_are_megatron_cores(pair, name):
    _, _, theirs = pair
    assert theirs[name + "_names"] == ([], [])


@pytest.mark.parametrize("name", ["bert_binary", "bert_plain"])
def test_bert_losses_equal_megatron_cores(pair, name):
    models, batches, theirs = pair
    batch = batches["bert"]
    with torch.no_grad():
        lm, binary_logits = models[name](**batch)
    their_lm, their_binary = theirs[name]
    real = batch["padding_mask"].bool()
    assert _close(lm[real], their_lm[real]) <= TOLERANCE
    if name == "bert_binary":
        assert _close(binary_logits, their_binary) <= TOLERANCE
    else:
        assert binary_logits is None and their_binary is None


def test_t5_parameter_names_are_megatron_cores(pair):
    _, _, theirs = pair
    assert theirs["t5"][1] == ([], [])


def test_t5_losses_equal_megatron_cores(pair):
    models, batches, theirs = pair
    batch = batches["t5"]
    with torch.no_grad():
        ours = models["t5"](
            batch["text_enc"], batch["text_dec"], batch["enc_mask"], batch["labels"]
        )
    real = batch["dec_mask"].bool()
    assert _close(ours[real], theirs["t5"][0][real]) <= TOLERANCE


def test_padding_changes_no_real_position():
    """A batch without padding loses its mask on the host (the plugin's prepare_microbatch) and
    runs unmasked (flash/cuDNN kernels on a GPU); one more position of padding, masked, leaves
    every real position's loss and the binary logits unchanged."""
    from mega.plugins.models.common.batches import without_full_mask

    model = _mega_bert(True)
    batch = {key: value[:, : SEQ - 1] for key, value in _bert_batch().items()}
    batch["padding_mask"] = torch.ones_like(batch["padding_mask"])
    padded = {key: torch.cat([value, value[:, :1]], dim=1) for key, value in batch.items()}
    padded["padding_mask"][:, -1] = 0
    prepare = without_full_mask("padding_mask")
    unmasked = prepare({key: value.numpy() for key, value in batch.items()})
    assert sorted(unmasked) == sorted(set(batch) - {"padding_mask"})
    assert "padding_mask" in prepare({key: value.numpy() for key, value in padded.items()})
    with torch.no_grad():
        lm, binary = model(**{key: torch.from_numpy(value) for key, value in unmasked.items()})
        lm_padded, binary_padded = model(**padded)
    torch.testing.assert_close(lm_padded[:, :-1], lm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(binary_padded, binary, rtol=1e-5, atol=1e-6)


def test_masked_lm_loss_at_the_predicted_positions_only_is_the_whole_sequence_loss():
    """The plugin's prepare_microbatch hands the model the loss mask's positions, and the
    vocabulary-sized product and loss run there only: the lm loss and every gradient equal the
    whole-sequence computation (to float rounding: the sums run over fewer terms)."""
    from mega.plugins.models.bert import bert_loss, bert_prepare_microbatch

    batch = _bert_batch()
    batch["loss_mask"] = (batch["labels"] >= 0).long()
    batch["is_random"] = torch.tensor([0, 1, 0])
    prepared = bert_prepare_microbatch({key: value.numpy() for key, value in batch.items()})
    prepared = {key: torch.from_numpy(value) for key, value in prepared.items()}
    assert prepared["lm_positions"].numel() == int(batch["loss_mask"].sum())
    results = []
    for microbatch in (batch, prepared):
        torch.manual_seed(0)  # the same perturbation of the norms and biases
        model = _mega_bert(True).train()
        inputs = {k: v for k, v in microbatch.items() if k not in ("loss_mask", "is_random")}
        parts = bert_loss(model(**inputs), microbatch)
        sum(parts.values()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((parts, grads))
    (whole, whole_grads), (sparse, sparse_grads) = results
    assert sparse["lm loss"].shape == () and whole["lm loss"].item() > 1.0
    torch.testing.assert_close(sparse["lm loss"], whole["lm loss"], rtol=1e-6, atol=0)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
