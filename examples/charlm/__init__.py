"""A tiny character-level language model trained with nothing but the CLI: ignite-mgpu train configs/charlm.yaml."""
