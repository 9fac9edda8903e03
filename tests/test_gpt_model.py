"""The GPT model plugin: names, init, attention numerics, FLOPs and config validation (CPU, tiny)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mega import BuildContext, ModelSpec
from mega.core.training.init import normal_
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.decoder import GPTModel
from mega.plugins.models.common.flops import flops_per_token
from mega.plugins.models.common.rotary import rotary_cos_sin
from mega.plugins.models.gpt import register_models

VOCAB, SEQ = 256, 16


def tiny(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0)
    fields.update(attention_dropout=0.0)
    fields.update(overrides)
    return GPTConfig(**fields)


def build(cfg: GPTConfig | None = None, seed: int = 1234, seq: int = SEQ) -> GPTModel:
    ctx = BuildContext(
        seed=seed, device="cpu", params_dtype="float32", seq_length=seq, padded_vocab_size=VOCAB
    )
    return GPTModel(cfg or tiny(), ctx).eval()


def tokens(batch: int = 4, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


FULL = dict(  # every non-default switch at once
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    ffn_hidden_size=96,
    group_query_attention=True,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)


# ---------------------------------------------------------------------------- init


@pytest.mark.parametrize("overrides", [{}, FULL], ids=["default", "full"])
def test_fresh_loss_is_log_vocab(overrides):
    model = build(tiny(**overrides))
    loss = model(tokens(8), tokens(8, seed=1))
    assert loss.shape == (8, SEQ) and loss.dtype == torch.float32
    assert abs(loss.mean().item() - math.log(VOCAB)) < 0.05


def test_init_depends_only_on_seed_and_name():
    a = dict(build().named_parameters())
    torch.manual_seed(999)  # the global RNG plays no part
    b = dict(build().named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)

    c = dict(build(seed=4321).named_parameters())
    for name in ("embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"):
        assert not torch.equal(a[name], c[name])

    # Extra modules built before or after a parameter do not shift its values.
    deeper = dict(
        build(tiny(num_layers=3, untie_embeddings_and_output_weights=True)).named_parameters()
    )
    for name in (
        "embedding.word_embeddings.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
    ):
        assert torch.equal(a[name], deeper[name])


def test_parameter_is_normal_of_its_name():
    model = build(seed=7)
    for name, std in [
        ("embedding.word_embeddings.weight", 0.02),
        ("decoder.layers.1.self_attention.linear_qkv.weight", 0.02),
        ("decoder.layers.1.mlp.linear_fc2.weight", 0.02 / math.sqrt(4)),
    ]:
        param = model.get_parameter(name)
        expected = normal_(torch.empty(param.shape), std=std, seed=7, name=name)
        assert torch.equal(param, expected), name


def test_init_statistics():
    layers = 4
    model = build(tiny(num_layers=layers, hidden_size=128))
    params = dict(model.named_parameters())
    scaled = 0.02 / math.sqrt(2 * layers)
    for name, p in params.items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "layernorm" in name:
            assert torch.all(p == 1), name
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert p.std().item() == pytest.approx(scaled, rel=0.05), name
        else:
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name


# ---------------------------------------------------------------------------- names and shapes


def expected_shapes(cfg: GPTConfig, seq: int = SEQ) -> dict[str, tuple[int, ...]]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    groups, d = cfg.resolved_num_query_groups(), cfg.resolved_kv_channels()
    ffn = cfg.resolved_ffn_hidden_size()
    bias, layer_norm = cfg.add_bias_linear, cfg.normalization == "LayerNorm"
    shapes = {"embedding.word_embeddings.weight": (VOCAB, h)}
    if cfg.position_embedding_type == "learned_absolute":
        shapes["embedding.position_embeddings.weight"] = (cfg.max_position_embeddings or seq, h)

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.weight"] = (h,)
        if layer_norm:
            shapes[f"{prefix}.bias"] = (h,)

    def linear(prefix: str, out: int, inp: int) -> None:
        shapes[f"{prefix}.weight"] = (out, inp)
        if bias:
            shapes[f"{prefix}.bias"] = (out,)

    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}"
        norm(f"{p}.input_layernorm")
        linear(f"{p}.self_attention.linear_qkv", (heads + 2 * groups) * d, h)
        linear(f"{p}.self_attention.linear_proj", h, heads * d)
        norm(f"{p}.pre_mlp_layernorm")
        linear(f"{p}.mlp.linear_fc1", ffn * (2 if cfg.swiglu else 1), h)
        linear(f"{p}.mlp.linear_fc2", h, ffn)
    norm("decoder.final_layernorm")
    if cfg.untie_embeddings_and_output_weights:
        shapes["output_layer.weight"] = (VOCAB, h)
    return shapes


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"normalization": "RMSNorm"},
        {"swiglu": True},  # default SwiGLU width int((4*64*2/3)/64)*64 = 128
        {"position_embedding_type": "rope"},
        {"group_query_attention": True, "num_query_groups": 1},
        {"untie_embeddings_and_output_weights": True},
        {"add_bias_linear": False},
        {"kv_channels": 8, "max_position_embeddings": 40},
        FULL,
    ],
    ids=["default", "rmsnorm", "swiglu", "rope", "mqa", "untied", "nobias", "kv8", "full"],
)
def test_parameter_names_and_shapes(overrides):
    cfg = tiny(**overrides)
    model = build(cfg)
    actual = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert actual == expected_shapes(cfg)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def test_swiglu_default_width():
    assert tiny(swiglu=True).resolved_ffn_hidden_size() == 128
    assert GPTConfig(hidden_size=4096, swiglu=True).resolved_ffn_hidden_size() == 10880
    assert GPTConfig(hidden_size=96).resolved_ffn_hidden_size() == 384


# ---------------------------------------------------------------------------- forward numerics


@pytest.mark.parametrize("overrides", [{}, FULL], ids=["default", "full"])
def test_causal(overrides):
    model = build(tiny(**overrides))
    x = tokens(2)
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_gqa_with_one_head_per_group_is_mha():
    mha = build(tiny())
    gqa = build(tiny(group_query_attention=True, num_query_groups=4))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(mha(x), gqa(x), rtol=0, atol=0)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A 2-group model equals a 4-head MHA model whose k/v heads repeat their group's."""
    heads, groups, d = 4, 2, 16
    gqa = build(tiny(group_query_attention=True, num_query_groups=groups))
    mha = build(tiny())
    shared = {k: v for k, v in gqa.state_dict().items() if "linear_qkv" not in k}
    mha.load_state_dict(shared, strict=False)  # everything but linear_qkv has the same shape
    for i in range(2):
        name = f"decoder.layers.{i}.self_attention.linear_qkv"
        w = gqa.get_submodule(name).weight.view(groups, heads // groups + 2, d, -1)
        b = gqa.get_submodule(name).bias.view(groups, heads // groups + 2, d)
        rows_w, rows_b = [], []
        for head in range(heads):
            g, j = divmod(head, heads // groups)
            # MHA layout per head: [q, k, v]; k/v come from the head's group.
            rows_w += [w[g, j], w[g, -2], w[g, -1]]
            rows_b += [b[g, j], b[g, -2], b[g, -1]]
        with torch.no_grad():
            mha.get_submodule(name).weight.copy_(torch.cat(rows_w))
            mha.get_submodule(name).bias.copy_(torch.cat(rows_b))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def naive_attention(attn, x: torch.Tensor, rope_base: float | None) -> torch.Tensor:
    """Loops over heads with an explicit mask and complex-number RoPE: an independent reference."""
    b, s, _ = x.shape
    d, per_group = attn.head_dim, attn.heads_per_group
    qkv = attn.linear_qkv(x)
    groups = qkv.shape[-1] // ((per_group + 2) * d)

    def rope(t: torch.Tensor) -> torch.Tensor:  # [b, s, d]: pairs (j, j + d/2) rotate together
        if rope_base is None:
            return t
        angle = torch.arange(s)[:, None] * rope_base ** (-torch.arange(0, d, 2) / d)  # [s, d/2]
        z = torch.complex(t[..., : d // 2].double(), t[..., d // 2 :].double()) * torch.polar(
            torch.ones_like(angle, dtype=torch.float64), angle.double()
        )
        return torch.cat([z.real, z.imag], dim=-1).float()

    mask = torch.ones(s, s, dtype=torch.bool).tril()
    outputs = []
    for head in range(groups * per_group):
        g, j = divmod(head, per_group)
        base = g * (per_group + 2) * d
        q = rope(qkv[..., base + j * d : base + (j + 1) * d])
        k = rope(qkv[..., base + per_group * d : base + (per_group + 1) * d])
        v = qkv[..., base + (per_group + 1) * d : base + (per_group + 2) * d]
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outputs.append(probs @ v)
    return attn.linear_proj(torch.cat(outputs, dim=-1))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"position_embedding_type": "rope", "group_query_attention": True, "num_query_groups": 2}],
    ids=["mha", "rope-gqa"],
)
def test_attention_matches_naive_reference(overrides):
    cfg = tiny(**overrides)
    model = build(cfg)
    attn = model.decoder.layers[0].self_attention
    with torch.no_grad():  # give the bias some weight so a misplaced row would show
        attn.linear_qkv.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, SEQ, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    rope = cfg.rotary_base if cfg.position_embedding_type == "rope" else None
    rotary = rotary_cos_sin(SEQ, attn.head_dim, cfg.rotary_base) if rope else None
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, rotary), naive_attention(attn, x, rope), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("untied", [False, True])
def test_logits_use_the_right_output_matrix(untied):
    model = build(tiny(untie_embeddings_and_output_weights=untied))
    names = dict(model.named_parameters())
    assert ("output_layer.weight" in names) is untied
    x = tokens()
    with torch.no_grad():
        hidden = model.decoder(model.embedding(x))
        matrix = names["output_layer.weight" if untied else "embedding.word_embeddings.weight"]
        torch.testing.assert_close(model(x), hidden @ matrix.T)
        labels = tokens(seed=5)
        torch.testing.assert_close(
            model(x, labels), F.cross_entropy(model(x).transpose(1, 2), labels, reduction="none")
        )


def test_sequence_longer_than_position_table_fails():
    model = build(tiny(max_position_embeddings=SEQ))
    with pytest.raises(ValueError, match="max-position-embeddings"):
        model(tokens(seq=SEQ + 1))
    rope = build(tiny(position_embedding_type="rope"))  # rope has no table: any length runs
    assert rope(tokens(seq=SEQ + 8)).shape == (4, SEQ + 8, VOCAB)


def test_bf16_forward_and_training_reduces_loss():
    model = build(tiny(**FULL)).to(torch.bfloat16)
    x, y = tokens(), tokens(seed=1)
    loss = model(x, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert abs(loss.mean().item() - math.log(VOCAB)) < 0.1

    model = build(tiny(hidden_dropout=0.1, attention_dropout=0.1)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(8):
        loss = model(x, y).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


# ---------------------------------------------------------------------------- config and plugin


def test_flops_per_token_by_hand():
    # h=64, L=2, 4 heads, d=16, ffn=256, s=32, V=512:
    # per layer qkv 64*192 + proj 64*64 + fc1 64*256 + fc2 256*64 = 49152; x2 + 64*512 = 131072.
    cfg = tiny()
    assert flops_per_token(cfg, 32, 512) == 6 * 131072 + 12 * 2 * 64 * 32
    # GQA (2 groups of 2 heads) + SwiGLU ffn 96, per layer:
    # qkv 64*(4*16 + 2*2*16) + proj 64*64 + fc1 64*192 + fc2 96*64 = 30720.
    full = tiny(**FULL)
    assert flops_per_token(full, 32, 512) == 6 * (2 * 30720 + 64 * 512) + 12 * 2 * 64 * 32
    # N is the model's own 2-D weights minus the embedding lookups, plus h*V once, tied or not.
    for cfg in (tiny(), full):
        layers = sum(
            p.numel()
            for n, p in build(cfg).named_parameters()
            if p.dim() == 2 and not n.startswith(("embedding.", "output_layer."))
        )
        assert flops_per_token(cfg, 0, VOCAB) == 6 * (layers + 64 * VOCAB)


@pytest.mark.parametrize(
    "overrides, messages",
    [
        ({"hidden_size": 100, "num_attention_heads": 3}, ["--hidden-size (100) must be divisible"]),
        (
            {"group_query_attention": True, "num_query_groups": 3},
            ["--num-attention-heads (4) must be divisible by --num-query-groups (3)"],
        ),
        (
            {"group_query_attention": True, "num_query_groups": 8},
            ["--num-query-groups (8) must not exceed --num-attention-heads (4)"],
        ),
        (
            {"num_layers": 0, "hidden_dropout": 1.0, "attention_dropout": -0.1},
            ["--num-layers (0) must be positive", "--hidden-dropout", "--attention-dropout"],
        ),
        ({"hidden_size": 16, "num_attention_heads": 2, "swiglu": True}, ["--ffn-hidden-size"]),
        ({"kv_channels": 7, "position_embedding_type": "rope"}, ["even head dim"]),
        ({"normalization": "BatchNorm"}, ["--normalization"]),
    ],
)
def test_validate_messages(overrides, messages):
    problems = tiny(**overrides).validate()
    assert len(problems) == len(messages), problems
    for problem, expected in zip(problems, messages, strict=True):
        assert expected in problem
    with pytest.raises(ValueError, match="invalid GPT config"):
        build(tiny(**overrides))


def test_valid_configs_have_no_problems():
    assert GPTConfig().validate() == []
    assert tiny(**FULL).validate() == []
    # num_query_groups without --group-query-attention is ignored, as in Megatron.
    cfg = tiny(num_query_groups=3)
    assert cfg.validate() == [] and cfg.resolved_num_query_groups() == 4


def test_plugin_registers_spec_without_importing_torch():
    specs: list[ModelSpec] = []
    register_models(specs.append)
    (spec,) = specs
    assert spec.name == "gpt" and spec.config_cls is GPTConfig
    assert spec.flops_per_token is flops_per_token
    ctx = BuildContext(
        seed=0, device="cpu", params_dtype="float32", seq_length=8, padded_vocab_size=64
    )
    assert isinstance(spec.build(tiny(), ctx), GPTModel)
    code = "import sys, mega.plugins.models.gpt; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_explicit_positions_and_causal_mask_equal_the_defaults(position_embedding_type):
    model = build(tiny(position_embedding_type=position_embedding_type, hidden_dropout=0.0,
                       attention_dropout=0.0)).eval()  # fmt: skip
    ids = tokens(batch=2)
    positions = torch.arange(SEQ).expand(2, SEQ)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)  # True = masked
    expected = model(ids)
    torch.testing.assert_close(model(ids, position_ids=positions), expected)
    torch.testing.assert_close(model(ids, attention_mask=causal), expected)


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_reset_positions_and_document_mask_isolate_packed_documents(position_embedding_type):
    """A document packed after another, with positions restarted and a document-causal mask
    (Megatron's --reset-position-ids --reset-attention-mask), gives the logits it has alone."""
    model = build(tiny(position_embedding_type=position_embedding_type, hidden_dropout=0.0,
                       attention_dropout=0.0)).eval()  # fmt: skip
    first, second = 5, SEQ - 5
    ids = tokens(batch=1)
    positions = torch.cat([torch.arange(first), torch.arange(second)])[None]
    document = torch.cat([torch.zeros(first), torch.ones(second)]).long()
    allowed = (document[:, None] == document[None, :]) & torch.ones(SEQ, SEQ).tril().bool()
    packed = model(ids, position_ids=positions, attention_mask=~allowed[None, None])
    alone = model(ids[:, first:])
    torch.testing.assert_close(packed[:, first:], alone, rtol=1e-5, atol=1e-5)


def test_vocabulary_padding_changes_nothing():
    """Padding rows are masked out of the softmax and the real rows' init ignores the padding, so
    TP=1's 384-row and TP=2's 512-row vocabularies for 257 real ids train the same model."""
    from types import SimpleNamespace

    def padded_model(padded: int) -> GPTModel:
        ctx = BuildContext(
            seed=7,
            device="cpu",
            params_dtype="float32",
            seq_length=SEQ,
            padded_vocab_size=padded,
            tokenizer=SimpleNamespace(vocab_size=257),
        )
        return GPTModel(tiny(), ctx)

    small, large = padded_model(384), padded_model(512)
    ids = torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(1))
    losses = [m(ids, labels=ids.roll(-1, 1)) for m in (small, large)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    assert math.isclose(float(losses[0].detach().mean()), math.log(257), rel_tol=0.05)
    for loss in losses:
        loss.mean().backward()
    grads = [m.embedding.word_embeddings.weight.grad for m in (small, large)]
    torch.testing.assert_close(grads[0][:257], grads[1][:257], rtol=1e-5, atol=1e-7)
    assert not grads[1][257:].any()  # padding rows learn nothing


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_the_printed_parameter_count_is_the_same_in_every_layout(plugins, untie):
    """TP=2 pads the vocabulary further (to a multiple of 128 x 2): the padding rows are not
    counted, so the model size printed at TP=1 and TP=2 is the same, and it is the real one."""
    from mega import BuildContext
    from mega.core.config.resolve import resolve_config
    from mega.core.training.parameter_count import unpadded_parameter_count

    args = ["--model", "gpt", "--num-layers", "2", "--hidden-size", "32"]
    args += (
        ["--num-attention-heads", "2", "--untie-embeddings-and-output-weights"]
        if untie
        else ["--num-attention-heads", "2"]
    )
    config = resolve_config(args, plugins)
    spec = plugins.models.get("gpt")
    plan = spec.parallel_plan(config.model)
    counts, totals = [], []
    for padded in (384, 512):  # 258 byte ids padded for TP=1 and TP=2 (x 128 x TP)
        ctx = BuildContext(seed=1, device="cpu", params_dtype="float32", seq_length=32,
                           padded_vocab_size=padded)  # fmt: skip
        model = spec.build(config.model, ctx)
        counts.append(unpadded_parameter_count(model, plan, 258, padded))
        totals.append(sum(p.numel() for p in model.parameters()))
    assert counts[0] == counts[1]
    assert totals[1] - totals[0] == 128 * 32 * (2 if untie else 1)  # what padding used to add
    assert totals[0] - counts[0] == (384 - 258) * 32 * (2 if untie else 1)


def test_a_norm_as_wide_as_the_padded_vocabulary_is_not_vocabulary_padding(plugins):
    """Hidden size 512 and 258 ids padded to 512 at TP=2: the final norm has 512 rows too, and
    was counted as 258 of them (508 parameters short with its bias; issue 49)."""
    from mega import BuildContext
    from mega.core.config.resolve import resolve_config
    from mega.core.training.parameter_count import unpadded_parameter_count

    args = ["--model", "gpt", "--num-layers", "1", "--hidden-size", "512"]
    config = resolve_config([*args, "--num-attention-heads", "2"], plugins)
    spec = plugins.models.get("gpt")
    plan = spec.parallel_plan(config.model)
    counts = []
    for padded in (384, 512):
        ctx = BuildContext(seed=1, device="cpu", params_dtype="float32", seq_length=32,
                           padded_vocab_size=padded)  # fmt: skip
        model = spec.build(config.model, ctx)
        counts.append(unpadded_parameter_count(model, plan, 258, padded))
        real = sum(p.numel() for p in model.parameters()) - (padded - 258) * 512
    assert counts == [real, real]


def test_rope_scaling_and_the_qwen_options_are_validated_by_name():
    from mega.plugins.models.bert.config import BertConfig

    rope = {"position_embedding_type": "rope"}
    for fields, message in (
        ({"use_rope_scaling": True}, "--use-rope-scaling needs --position-embedding-type rope"),
        ({**rope, "use_rope_scaling": True, "rotary_seq_len_interpolation_factor": 2.0},
         "--use-rope-scaling and --rotary-seq-len-interpolation-factor: give one RoPE scaling"),
        ({**rope, "rotary_seq_len_interpolation_factor": 0.0},
         "--rotary-seq-len-interpolation-factor (0.0) must be positive"),
        ({**rope, "use_rope_scaling": True, "rope_scaling_factor": -1.0},
         "--rope-scaling-factor (-1.0) must be positive"),
    ):  # fmt: skip
        assert message in tiny(**fields).validate()
    assert (
        tiny(**rope, add_qkv_bias=True, qk_layernorm=True, use_rope_scaling=True).validate() == []
    )
    assert (
        "--qk-layernorm: a GPT (decoder) option; the bert model has none"
        in BertConfig(qk_layernorm=True).validate()
    )


def test_llama3_rope_frequencies_are_transformers_ones():
    """--use-rope-scaling's frequencies against transformers' llama3 rope (Llama 3.1's theta
    and factor, a head dim whose frequencies fall in all three bands), and linear scaling's
    angles against positions / factor."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mega.plugins.models.common.rotary import llama3_scaled

    config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    expected, scale = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    got = llama3_scaled(plain, 8.0)
    assert scale == 1.0 and torch.allclose(got, expected, rtol=1e-6, atol=0)
    assert (got < plain).any() and (got == plain).any()  # bands both scaled and kept
    cos, _ = rotary_cos_sin(6, 8, 10000.0, interpolation=4.0)
    positions = torch.arange(6, dtype=torch.float32)[:, None] / 4.0
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    assert torch.allclose(cos, torch.cat([positions * inv_freq] * 2, dim=-1).cos(), atol=1e-6)


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
         "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": False},
    ],
    ids=["qwen-style", "deepseek-style"],
)  # fmt: skip
def test_yarn_frequencies_and_scale_are_transformers_ones(scaling):
    """--position-embedding-type yarn against transformers' yarn rope init: the blended
    frequencies (rtol 1e-6) and the cos/sin factor, for Qwen's plain yarn and DeepSeek's mscale
    pair (a head dim of 64 whose frequencies fall on both sides of the ramp)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mega.plugins.models.common.rotary import yarn_scaled

    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=1, rope_theta=10000.0, max_position_embeddings=65536,
        rope_scaling={"rope_type": "yarn", **scaling},
    )  # fmt: skip
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    cfg = tiny(
        position_embedding_type="yarn",
        yarn_rotary_scaling_factor=scaling["factor"],
        yarn_original_max_position_embeddings=scaling["original_max_position_embeddings"],
        yarn_beta_fast=scaling.get("beta_fast", 32.0),
        yarn_mscale=scaling.get("mscale", 1.0),
        yarn_mscale_all_dim=scaling.get("mscale_all_dim", 0.0),
        yarn_correction_range_round_to_int=scaling.get("truncate", True),
    )
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    got, scale = yarn_scaled(plain, cfg)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0) and scale == pytest.approx(factor)
    assert (got == plain).any() and (got < plain).any()  # kept and scaled frequencies both
