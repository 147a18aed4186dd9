"""Megatron-style training front-end: arguments, model providers, data, loop, checkpoints."""
