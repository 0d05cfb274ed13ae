"""geoparam's linen shell: the modules that run inside `flax.linen` models."""
