"""Run the target's sampling through torch ops instead of the Triton kernels of
spec_runtime/kernels/race.py (dense_race, uniforms), for A/B timings of a whole run.

Python imports `sitecustomize` at start-up from its path. With this folder first on
PYTHONPATH, each target process (its command line names "target") has
spec_runtime.rejection sample and draw its uniforms with sampling.sample_torch and
sampling.uniform_torch, the same bits in several dozen kernels each:

    PYTHONPATH=$PWD/scripts/torch_sampling:$PYTHONPATH python3 scripts/bench_e2e.py ...
"""

import sys

if "target" in sys.argv[:3]:
    from spec_runtime import rejection, sampling

    rejection.sample = sampling.sample_torch
    rejection.uniform = sampling.uniform_torch
