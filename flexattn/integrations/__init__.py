"""flexattn inside other libraries.

Each submodule plugs flexattn into one library and imports that library only when its
registration function is called, so ``import flexattn`` never pulls it in:

* ``flexattn.integrations.transformers``: ``register()`` makes flexattn a Hugging Face
  transformers attention implementation (``attn_implementation="flexattn"``).
"""
