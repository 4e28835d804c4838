"""cachegw: an OpenAI-compatible caching gateway with a built-in paged-KV engine.

One namespace for everything installed. In a checkout the subpackages are links to the repository's
top-level folders (``gateway/``, ``backend/``, ``embeddings/``, ``policies/``, ``protocol/``,
``configtools/``); the wheel carries them as real folders under ``cachegw/``.
"""
