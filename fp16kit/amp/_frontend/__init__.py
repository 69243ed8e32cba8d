"""Internals of the apex-style frontend (:mod:`fp16kit.amp.frontend`), one job per module:

``options`` opt levels, override rules, printed text; ``casting`` model casting and forward hooks;
``masters`` fp32 master weights and gradient plumbing; ``stepping`` ``scale_loss`` and the patched
``step``/``zero_grad``; ``state`` sessions and the amp state dict.

May import: the rest of ``fp16kit.amp`` and what it may import (``tests/amp/test_amp_structure.py`` pins the
directions inside ``amp``).
"""
