"""FP8 training on Hopper: the transformer layers' linears run their three GEMMs (forward, input
gradient, weight gradient) on FP8 tensor cores through ``torch._scaled_mm``.

- ``scaling``: casting a tensor to an FP8 format with a per-tensor scale (current scaling);
- ``delayed``: ``--fp8-recipe delayed``, scales from earlier steps' amaxes (histories, update);
- ``linear``: the FP8 linear (autograd function) and its fused weight-gradient op;
- ``mlp``: FC1, GeLU, FC2 as one autograd function, its two cast sites from ``gelu_cast``
  (Triton kernels in ``gelu_kernels`` on a GPU, the eager reference ops elsewhere);
- ``apply``: which weights of a model are FP8, from its parallel plan (``--first-last-layers-bf16``);
- ``checks``: the flags, the dtype and the GPU a run needs, checked before launch.
"""
