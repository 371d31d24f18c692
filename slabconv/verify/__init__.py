"""Stage 4, verify: prove a fused model equals its original, and say how close in numbers.

Two questions (``docs/verification.md``): (1) is the fold exact? -- the fused graph against the original in
float64, to rounding; (2) do the written files compute the model? -- each file, in each runtime, against the
original evaluated in float64, within the tolerance its dtype allows (``policy``).

- ``policy``: every tolerance, and why. ``judge``: the policy applied to numbers.
- ``reference``: the float64 reference graph. ``backends``: the runtime table (``BACKENDS``: PyTorch,
  onnxruntime, OpenVINO), for accuracy here and timing in ``slabconv.bench``.
- ``inputs``: what to verify on. ``integrity``: file checks that are not numbers.
- ``run``: verification after a fold; ``pair``: any two sides (``slabconv verify``).
- ``layerwise``: one decoder layer at a time, for the streamed mode. ``generate``: greedy generation end to end.
- ``faults``: non-finite outputs, named before anything is written. ``results``: what was found, as objects.
"""
