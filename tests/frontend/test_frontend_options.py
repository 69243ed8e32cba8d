"""amp.initialize: the exact printed text, the override rules and their errors, the opt-level error."""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import make_model

from fp16kit import amp


def _options(opt_level: str, cast: str, patch: bool, bn: bool | None, master: bool | None, scale: str) -> str:
    """apex's listing of one set of optimization options, one ``name : value`` line each."""
    values = {
        "enabled": True,
        "opt_level": opt_level,
        "cast_model_type": cast,
        "patch_torch_functions": patch,
        "keep_batchnorm_fp32": bn,
        "master_weights": master,
        "loss_scale": scale,
    }
    return "".join(f"{name:<23}: {value}\n" for name, value in values.items())


_OVERRIDES = "Processing user overrides (additional kwargs that are not None)...\n"
_AFTER = "After processing overrides, optimization options are:\n"
_O1 = _options("O1", "None", True, None, None, "dynamic")
_O3 = _options("O3", "torch.float16", False, False, False, "1.0")

O1_TEXT = (
    "Selected optimization level O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n\n"
    "Defaults for this optimization level are:\n" + _O1 + _OVERRIDES + _AFTER + _O1
)

O2_OVERRIDDEN_TEXT = (
    "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n\n"
    "Defaults for this optimization level are:\n"
    + _options("O2", "torch.float16", False, True, True, "dynamic")
    + _OVERRIDES
    + _AFTER
    + _options("O2", "torch.float16", False, False, True, "128.0")
)

O3_TEXT = (
    "Selected optimization level O3:  Pure FP16 training.\n"
    "Defaults for this optimization level are:\n" + _O3 + _OVERRIDES + _AFTER + _O3
)


def _init(capsys, **kwargs):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, **kwargs)
    return capsys.readouterr().out


def test_o1_text_exact(capsys):
    assert _init(capsys, opt_level="O1") == O1_TEXT


def test_overrides_text_exact_keep_batchnorm_string_and_loss_scale_number(capsys):
    # "False" (a string) is accepted and becomes False; 128 becomes 128.0
    assert _init(capsys, opt_level="O2", keep_batchnorm_fp32="False", loss_scale=128) == O2_OVERRIDDEN_TEXT


def test_o3_has_no_blank_line_after_description(capsys):
    assert _init(capsys, opt_level="O3") == O3_TEXT


@pytest.mark.parametrize(
    ("level", "first_line"),
    [("O0", "Selected optimization level O0:  Pure FP32 training.\n\n"),
     ("O2", "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n\n")],
)
def test_descriptions_of_o0_o2(capsys, level, first_line):
    out = _init(capsys, opt_level=level)
    assert out.startswith(first_line)
    assert out.count("\n") == 19  # description, blank, 2 x (header + 7 options), overrides line


def test_o0_defaults_values(capsys):
    lines = _init(capsys, opt_level="O0").splitlines()
    assert lines[3:10] == [
        "enabled                : True",
        "opt_level              : O0",
        "cast_model_type        : torch.float32",
        "patch_torch_functions  : False",
        "keep_batchnorm_fp32    : None",
        "master_weights         : False",
        "loss_scale             : 1.0",
    ]


def test_verbosity_zero_prints_nothing(capsys):
    for level in ("O0", "O1", "O2", "O3"):
        assert _init(capsys, opt_level=level, verbosity=0) == ""


def test_low_precision_dtype_is_reported_after_overrides(capsys):
    lines = _init(capsys, opt_level="O2", low_precision_dtype=torch.bfloat16).splitlines()
    assert lines[-1] == "low_precision_dtype    : torch.bfloat16"
    assert lines[-6] == "cast_model_type        : torch.bfloat16"
    assert lines[5] == "cast_model_type        : torch.float16"  # the defaults stay apex's


@pytest.mark.parametrize("bad", ["01", "o1", "O4", 1, None])
def test_unknown_opt_level_explains_letter_o(bad):
    with pytest.raises(RuntimeError) as err:
        amp.initialize(make_model(), opt_level=bad, verbosity=0)
    msg = str(err.value)
    assert f"Unexpected optimization level {bad}." in msg
    assert "Options are 'O0', 'O1', 'O2', 'O3'." in msg
    assert "the prefix O is the letter O, not the number zero" in msg


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"opt_level": "O1", "cast_model_type": torch.float16}, "cast_model_type was torch.float16"),
        ({"opt_level": "O2", "patch_torch_functions": True}, "patch_torch_functions=True should only be set"),
        ({"opt_level": "O3", "patch_torch_functions": True}, "patch_torch_functions=True should only be set"),
        ({"opt_level": "O1", "keep_batchnorm_fp32": True}, "keep_batchnorm_fp32 should be None"),
        ({"opt_level": "O1", "keep_batchnorm_fp32": "True"}, "keep_batchnorm_fp32 should be None"),
        ({"opt_level": "O1", "master_weights": True}, "doesn't make sense to use master_weights with O1"),
        ({"opt_level": "O1", "master_weights": False}, "doesn't make sense to use master_weights with O1"),
        ({"opt_level": "O2", "keep_batchnorm_fp32": "yes"}, "keep_batchnorm_fp32 must be a boolean"),
        ({"opt_level": "O2", "keep_batchnorm_fp32": 1}, "keep_batchnorm_fp32 must be a boolean"),
    ],
)
def test_override_rules(kwargs, needle):
    with pytest.raises(RuntimeError) as err:
        amp.initialize(make_model(), verbosity=0, **kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("ok", [None, False, torch.float32])
def test_o1_accepts_fp32_like_cast_model_type(ok):
    model = amp.initialize(make_model(), opt_level="O1", cast_model_type=ok, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("bad", ["big", [1.0], 0.0, -4.0, float("inf")])
def test_loss_scale_must_be_dynamic_or_a_number(bad):
    with pytest.raises(ValueError, match="loss_scale must be"):
        amp.initialize(make_model(), opt_level="O2", loss_scale=bad, verbosity=0)


def test_loss_scale_string_number_accepted(capsys):
    out = _init(capsys, opt_level="O2", loss_scale="512")
    assert out.splitlines()[-1] == "loss_scale             : 512.0"


def test_bad_low_precision_dtype_and_num_losses():
    with pytest.raises(ValueError, match=r"low_precision_dtype must be torch.float16 or torch.bfloat16"):
        amp.initialize(make_model(), opt_level="O2", low_precision_dtype=torch.float64, verbosity=0)
    with pytest.raises(ValueError, match="num_losses must be a positive integer"):
        amp.initialize(make_model(), opt_level="O1", num_losses=0, verbosity=0)
