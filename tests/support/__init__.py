"""Helpers the tests share, and the scripts they start as processes (trainers, faults).

Tests import them as ``support.<module>`` (pyproject puts tests/ on pytest's path); a script
started by path (``python tests/support/fsdp_trainer.py``) imports its neighbours by name.
No test imports another test module.
"""
