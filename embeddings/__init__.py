"""Sentence embeddings for the semantic cache (all-MiniLM-L6-v2, CPU, offline)."""

from cachegw.embeddings.encoder import Encoder

__all__ = ["Encoder"]
