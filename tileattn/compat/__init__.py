"""Drop-in stand-ins for other attention APIs, each a thin translation onto :func:`tileattn.flash_attention`.

* ``tileattn.compat.flash_attn``: the ``flash_attn`` 2.x package (``import tileattn.compat.flash_attn
  as flash_attn``), including ``flash_attn.flash_attn_interface``.
* :mod:`tileattn.sdpa`: ``torch.nn.functional.scaled_dot_product_attention`` and ``patch_sdpa``.
* :mod:`tileattn.npu`: ``torch_npu.npu_fusion_attention`` and its grad.
* :mod:`tileattn.integrations.transformers`: a Hugging Face attention implementation.

Top-left causal masks (SDPA, some torch_npu modes) need no translation: ``flash_attention``'s ``align``
places the diagonal.
"""
