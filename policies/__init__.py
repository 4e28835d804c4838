"""Cache policies: what may be stored and when a stored answer may be served."""
