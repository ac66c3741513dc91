"""Other attention APIs, each a thin translation onto the core: :mod:`.flash_attn` (flash-attn 2/3),
:mod:`.sdpa` and :mod:`.sdpa_hook` (PyTorch SDPA), :mod:`.npu` (Ascend torch_npu), :mod:`.transformers`
(Hugging Face). Their public import paths are the older ones: ``tileattn.compat.flash_attn``,
``tileattn.sdpa``, ``tileattn.npu``, ``tileattn.integrations.transformers`` and
``tileattn.integrations.torch_sdpa`` (aliases of the modules here)."""
