"""The demo: a tiny Llama warm-started on a synthetic arithmetic task with verifiable answers.

`python -m everstep_trainer.demo --out DIR` builds it; see `build.py` for what DIR holds.
"""
