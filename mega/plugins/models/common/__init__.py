"""The transformer parts more than one model family uses (gpt, moe, bert, t5), so that no model
plugin imports another: each family imports only this package and mega's own layers.

One job per module:

* ``config``: ``GPTConfig``, the transformer flags every family's config is or extends;
  ``flops``: the decoder's training FLOPs per token; ``checks``: what a model refuses (at build
  time, and of the encoder models' configs); ``batches``: micro-batch preparation (dropping a
  mask that masks nothing).
* ``norms``, ``rotary``, ``embedding``, ``attention``, ``mlp``, ``moe``, ``layers``, ``heads``:
  the modules the models are built of, with Megatron-core's parameter names; ``init``:
  Megatron's initialisation of them.
* ``decoder``: the decoder-only model that the gpt and moe plugins build (``GPTModel``);
  ``plan``: the parallel-plan pieces every family's plan is made of; ``decoder_plan``: the
  decoder's whole plan.

Nothing here imports a model plugin (tests/test_architecture.py). The package itself imports
nothing, so that ``import mega.plugins.models.gpt`` stays free of torch.
"""
