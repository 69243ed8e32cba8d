"""fp16kit.doctor: where your gradients live in fp16 and bf16, which loss scale fits them, which layers need fp32.

::

    from fp16kit import doctor

    with doctor.watch(model, every=100, activations=True, scaler=scaler) as w:
        for x, y in loader:
            ...                      # your training loop, unchanged
    report = w.report(torch.float16)  # loss_scale=None: the scaler's current scale
    print(report)                     # table: flush / subnormal / normal / overflow per parameter and module
    report.save_png("doctor.png")     # the histogram against fp16's ranges, and per-layer bars
    report.to_dict()                  # the same, JSON-serializable

The histograms are accumulated on the device by ``fp16kit.kernels.exponent_histogram``; nothing reads
back to the host until ``report()``. What a step is, what is sampled: ``fp16kit/doctor/_watch.py``; the
classification and its rounding rule: ``fp16kit/doctor/_report.py``; how to read the picture:
``docs/doctor.md``.
"""

from ._report import CLASSES, Entry, FormatReport, Report, classify, format_limits, scale_exponent
from ._watch import Watcher, watch

__all__ = [
    "CLASSES",
    "Entry",
    "FormatReport",
    "Report",
    "Watcher",
    "classify",
    "format_limits",
    "scale_exponent",
    "watch",
]
