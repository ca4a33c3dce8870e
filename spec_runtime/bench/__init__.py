"""Benchmark-only machinery, imported only when a benchmark asks for it.

    oracle.py         the synthetic acceptance oracle: replaces both models' logits so that
                      random-weight models accept at a configured rate (--synthetic-acceptance)
    random_models.py  real-size models with random weights (`random:` paths)
"""
