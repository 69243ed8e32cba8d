"""fp16kit.doctor: where your gradients live in fp16 and bf16, which loss scale fits them, which layers need fp32.

::

    from fp16kit import doctor

    with doctor.watch(model, every=100, activations=True, scaler=scaler) as w:
        for x, y in loader:
            ...                      # your training loop, unchanged
    report = w.report(torch.float16)  # loss_scale=None: the run's scale (the scaler's), else the recommended one
    print(report)                     # the worst gradients, what to keep in fp32 and the line that does it
    report.save_png("doctor.png")     # the histogram against fp16's ranges, and per-layer bars
    report.to_dict()                  # everything, JSON-serializable; Report.from_dict reads it back
    doctor.keep_fp32(model, "encoder.layer.0.attention.self")  # what a "keep in fp32" entry's line says

The histograms are accumulated on the device by ``fp16kit.kernels.exponent_histogram``; nothing reads
back to the host until ``report()``. What a step is, what is sampled: ``fp16kit/doctor/_watch.py``; the
classification and its rounding rule: ``fp16kit/doctor/_report.py``; how to read the picture:
``docs/doctor.md``.

May import: ``fp16kit.kernels`` (``exponent_histogram``), ``fp16kit.amp``, ``fp16kit.numerics``; its command line
(``fp16kit/doctor/cli.py``, an entry point like ``fp16kit/__main__.py``) may also run the demo.
"""

from ._report import (
    CLASSES,
    NOISE_BINADES,
    Entry,
    FormatReport,
    Report,
    classify,
    fix_for,
    format_limits,
    keep_fp32,
    scale_exponent,
)
from ._watch import Watcher, watch

__all__ = [
    "CLASSES",
    "NOISE_BINADES",
    "Entry",
    "FormatReport",
    "Report",
    "Watcher",
    "classify",
    "fix_for",
    "format_limits",
    "keep_fp32",
    "scale_exponent",
    "watch",
]
