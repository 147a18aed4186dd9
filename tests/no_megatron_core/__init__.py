"""sitecustomize.py here blocks ``import megatron.core`` in a process that has this folder first on PYTHONPATH."""
