"""The test suite; tests/README.md says how it is laid out and how to add to it."""

import os

# The checkout under test, for tests that run its scripts (pretrain_gpt.py, tools/) or read its docs.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
